"""Lossless coding of tensor bytes (issue 25): byte planes, each zstd-coded, in independent checksummed chunks; and
the file format that stores them in safetensors shards.

The codec ``bytegroup-zstd1`` (chosen by ``benchmarks/codecs.py``, `benchmarks/NOTES.md` "Issue 25: which lossless
codec"): a tensor's elements are cut into chunks of at most ``chunk`` elements that never cross a multiple of
``slice`` elements (the converter makes a slice one expert of a stacked ``(E, ...)`` tensor, so one expert's bytes
decode alone; otherwise the whole tensor); within a chunk, byte ``i`` of every element forms plane ``i`` (ZipNN's
byte grouping: a bf16's sign-and-exponent byte is one plane, its mantissa byte the other), and each plane is coded
with zstd level 1 — or kept raw where zstd does not make it smaller (a bf16 mantissa plane almost never shrinks).
Chunks are independent, so reader threads decode any chunk straight into its place in a ring slot, and a device
decoder gets a batch of independent streams.

Layout of one coded tensor (a ``uint8`` blob): the chunks one after another, each chunk's planes in order. Its
*table* (:class:`Coded`) gives, per chunk, the coded length of each plane (a plane whose length equals its plain
length is raw; a zstd plane is always shorter) and the CRC-32 (``zlib.crc32``'s; computed with :func:`crc32`, ISA-L's
where the ``isal`` package is installed: 20 against 4.2 GB/s on the 2-core CPU machine) of the chunk's coded bytes.

A second codec, ``exp3-bf16`` (:mod:`tiered.expcode`, ``tiered reshard --compress --codec exp3``), codes bf16 tensors
so that the GPU decodes them after the H2D copy (a fixed-width exponent code; its layout is that module's). Its table
rows hold one length per chunk (``2 * elements`` for a raw chunk); each table names its codec (``"codec"``), so one
shard may hold both.

Exact by construction: decoding returns the input bytes (NaN payloads, subnormals, any dtype). Every chunk's coded
bytes are checked against its CRC-32 before they are decoded, every zstd frame carries its content size, every plane
must decode to its plain length: a corrupted or truncated chunk raises :class:`~tiered.errors.CodecError` naming the
file, tensor, chunk and byte offset; nothing decodes to silent garbage.

The file format (version :data:`FORMAT_VERSION`), written by ``tiered reshard --compress``: ordinary safetensors
shards ``model-0000i-of-0000N.safetensors`` with the index :data:`INDEX_NAME` (not ``model.safetensors.index.json``,
so that stock ``from_pretrained`` finds no weights and refuses the directory instead of loading coded bytes). A coded
tensor is a ``U8`` entry of shape ``[coded bytes]`` under the tensor's own name; the shard's ``__metadata__`` holds
:data:`VERSION_KEY` and, under :data:`META_KEY`, one JSON object mapping each coded tensor's name to its dtype, shape
and table. Tensors the converter left plain (small ones, those that do not shrink) are ordinary entries.
:func:`logical_shard` turns a shard's coded entries back into tensors of their own dtype and shape
(:class:`LosslessInfo`), which is what the loader plans with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import expcode
from .errors import CodecError

try:  # Intel ISA-L's CRC-32 (the ``isal`` package, ``tiered[compress]``): zlib's polynomial and results, ~5x faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is in the test extra
    from zlib import crc32

if TYPE_CHECKING:
    from .tensor_info import Shard

__all__ = ["crc32", "CODEC", "EXP3", "CODECS", "Coded", "CodecError", "encode", "decode_into", "decode_chunk",
           "DEFAULT_CHUNK_BYTES", "META_KEY", "VERSION_KEY", "FORMAT_VERSION", "INDEX_NAME", "LosslessInfo",
           "logical_shard", "is_coded", "table_entry", "window"]

#: the codec's name, as the converter records it
CODEC = "bytegroup-zstd1"
#: the GPU-decodable bf16 codec (:mod:`tiered.expcode`)
EXP3 = expcode.CODEC
#: the codecs a table may name
CODECS = (CODEC, EXP3)
#: bytes of plain data per chunk (a reader task's worth; fits the O_DIRECT staging buffer coded)
DEFAULT_CHUNK_BYTES = 4 << 20
#: ``__metadata__`` key of a shard's tables (a JSON object: tensor name -> :func:`table_entry`)
META_KEY = "tiered_lossless"
#: ``__metadata__`` key of the format version; a reader refuses a version it does not know
VERSION_KEY = "tiered_lossless_version"
FORMAT_VERSION = "1"
#: the index of a compressed checkpoint (``model.safetensors.index.json``'s layout, another name)
from .checkpoint import LOSSLESS_INDEX_NAME as INDEX_NAME  # noqa: E402


@dataclass
class Coded:
    """One coded tensor: ``itemsize`` bytes per element, ``nbytes`` plain bytes, chunks of at most ``chunk`` elements
    that never cross a multiple of ``slice`` elements; ``lens[c][i]`` is the coded length of plane ``i`` of chunk
    ``c`` (raw when it equals the chunk's element count), ``crc[c]`` the CRC-32 of chunk ``c``'s coded bytes."""

    itemsize: int
    nbytes: int
    chunk: int
    slice: int
    lens: list[list[int]] = field(default_factory=list)
    crc: list[int] = field(default_factory=list)
    #: :data:`CODEC` (byte planes, zstd: ``lens[c]`` has ``itemsize`` planes) or :data:`tiered.expcode.CODEC` (bf16,
    #: decodable on the GPU after the H2D copy: ``lens[c]`` is ``[stored length]``, ``2 * elements`` when raw)
    codec: str = CODEC
    starts: list[int] = field(default_factory=list, repr=False)  # byte offset of each chunk in the blob (derived)

    def __post_init__(self) -> None:
        self.reindex()

    def reindex(self) -> None:
        """Recompute :attr:`starts` from :attr:`lens`."""
        acc, self.starts = 0, []
        for ch in self.lens:
            self.starts.append(acc)
            acc += sum(ch)

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize

    @property
    def coded_bytes(self) -> int:
        return sum(sum(ch) for ch in self.lens)

    @property
    def per_slice(self) -> int:
        """Chunks in a whole slice."""
        return -(-self.slice // self.chunk)

    def count(self) -> int:
        """Chunks of the tensor."""
        whole, rest = divmod(self.numel, self.slice)
        return whole * self.per_slice + -(-rest // self.chunk)

    def elements(self, c: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` chunk ``c`` decodes to."""
        s, p = divmod(c, self.per_slice)
        lo = s * self.slice + p * self.chunk
        return lo, min(lo + self.chunk, (s + 1) * self.slice, self.numel)

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Plain bytes ``[lo, hi)`` chunk ``c`` decodes to."""
        lo, hi = self.elements(c)
        return lo * self.itemsize, hi * self.itemsize

    def chunk_span(self, c: int) -> tuple[int, int]:
        """``(start, length)`` of chunk ``c``'s coded bytes in the blob."""
        return self.starts[c], sum(self.lens[c])

    def covering(self, lo: int, hi: int) -> range:
        """The chunks whose elements meet elements ``[lo, hi)`` (``lo < hi``), in order."""
        per = self.per_slice
        first = lo // self.slice * per + (lo % self.slice) // self.chunk
        last = (hi - 1) // self.slice * per + ((hi - 1) % self.slice) // self.chunk
        return range(first, last + 1)

    @property
    def planes_per_chunk(self) -> int:
        """Entries of each ``lens`` row: ``itemsize`` byte planes (zstd), one body (exp3)."""
        return self.itemsize if self.codec == CODEC else 1

    @property
    def planes(self) -> list[list[tuple[int, int, bool]]]:
        """``planes[c][i] = (offset, length, zstd)`` of plane ``i`` of chunk ``c`` in the blob."""
        out = []
        for c, ch in enumerate(self.lens):
            lo, hi = self.elements(c)
            at, row = self.starts[c], []
            for n in ch:
                row.append((at, n, n != hi - lo))
                at += n
            out.append(row)
        return out

    def to_json(self) -> dict:
        return {"codec": self.codec, "itemsize": self.itemsize, "nbytes": self.nbytes, "chunk": self.chunk,
                "slice": self.slice, "chunks": [[c, *ch] for c, ch in zip(self.crc, self.lens, strict=True)]}

    @classmethod
    def from_json(cls, d: dict, where: str) -> Coded:
        """Raises CodecError: an unknown codec or a malformed table (``where`` names the file and tensor)."""
        fix = "re-run `tiered reshard --compress` on the source checkpoint"
        try:
            if d["codec"] not in CODECS:
                raise CodecError(f"{where}: codec {d['codec']!r} is not one tiered decodes ({', '.join(CODECS)}); {fix}")
            rows = d["chunks"]
            if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) >= 2 for r in rows):
                raise TypeError("chunks must be [[crc, length, ...], ...]")
            c = cls(_int(d["itemsize"]), _int(d["nbytes"]), _int(d["chunk"]), _int(d["slice"]),
                    [[_int(n) for n in r[1:]] for r in rows], [_int(r[0]) for r in rows], codec=d["codec"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"{where}: malformed lossless table ({e!r}); {fix}") from None
        ok = c.itemsize >= 1 and c.chunk >= 1 and c.slice >= 1 and c.nbytes >= 0 and not c.nbytes % c.itemsize \
            and len(c.lens) == c.count() and all(len(ch) == c.planes_per_chunk for ch in c.lens) \
            and all(0 <= x < 1 << 32 for x in c.crc)
        if ok and c.codec == EXP3:  # bf16; each chunk raw (2n bytes) or at least its fixed sections and shorter
            ok = c.itemsize == 2 and all(
                len(ch) == 1 and (ch[0] == 2 * (hi - lo) or expcode.chunk_layout(hi - lo)[3] <= ch[0] < 2 * (hi - lo))
                for ch, (lo, hi) in zip(c.lens, (c.elements(i) for i in range(len(c.lens))), strict=True))
        elif ok:
            for i, ch in enumerate(c.lens):
                lo, hi = c.elements(i)
                if any(n < 1 or n > hi - lo for n in ch):
                    ok = False
                    break
        if not ok:
            raise CodecError(f"{where}: lossless table does not fit {c.nbytes} bytes of {c.itemsize}-byte elements in "
                             f"chunks of {c.chunk} within slices of {c.slice}; {fix}")
        return c


def _int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{x!r} is not an integer")
    return x


def encode(data: np.ndarray, itemsize: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, slice_elems: int | None = None,
           level: int = 1, codec: str = CODEC) -> tuple[bytes, Coded]:
    """Code ``data`` (a 1-D ``uint8`` array, a whole number of ``itemsize``-byte elements): returns the blob and its
    table. ``slice_elems``: chunks never cross a multiple of it (default: the whole tensor). Runs on the caller's
    thread; memory: one chunk's planes and their codes."""
    data = np.ascontiguousarray(data).reshape(-1)
    if data.dtype != np.uint8 or data.size % itemsize:
        raise ValueError(f"encode: {data.size} bytes of {data.dtype} are not whole {itemsize}-byte elements")
    numel = data.size // itemsize
    sl = max(1, slice_elems or numel)
    coded = Coded(itemsize, int(data.size), max(1, min(chunk_bytes // itemsize, sl)), sl, codec=codec)
    out = bytearray()
    for c in range(coded.count()):
        lo, hi = coded.chunk_range(c)
        lens, body = encode_chunk(data[lo:hi], itemsize, level, codec)
        coded.lens.append(lens)
        coded.crc.append(crc32(body))
        out += body
    coded.reindex()
    return bytes(out), coded


def encode_chunk(part: np.ndarray, itemsize: int, level: int = 1, codec: str = CODEC) -> tuple[list[int], bytes]:
    """One chunk's coded bytes: ``(plane lengths, planes one after another)`` (exp3: ``([length], body)``). ``part``:
    1-D ``uint8``, whole elements (exp3: bf16, ``itemsize`` 2). Thread-safe (one compressor per call; zstandard
    releases the GIL)."""
    if codec == EXP3:
        if itemsize != 2:
            raise ValueError(f"{EXP3} codes 2-byte (bf16) elements, not {itemsize}-byte ones")
        body = expcode.encode_chunk(np.ascontiguousarray(part).view(np.uint16))
        return [len(body)], body
    import zstandard

    z = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    rows = part.reshape(-1, itemsize)
    lens, body = [], bytearray()
    for i in range(itemsize):
        plane = np.ascontiguousarray(rows[:, i]).tobytes()
        packed = z.compress(plane)
        use = packed if len(packed) < len(plane) else plane
        lens.append(len(use))
        body += use
    return lens, bytes(body)


def decode_chunk(body: memoryview | bytes | np.ndarray, coded: Coded, c: int, out: np.ndarray, *,
                 where: str = "", at: int = 0) -> None:
    """Decode chunk ``c`` from ``body`` (exactly its coded bytes, :meth:`Coded.chunk_span`) into ``out`` (1-D
    ``uint8`` of the chunk's plain length). ``where`` names the file and tensor, ``at`` the chunk's file offset, for
    messages. Runs on the caller's thread (a reader thread); temporaries: the chunk's planes.

    Raises:
        CodecError: a checksum mismatch, a plane zstd rejects or that decodes to the wrong length.
    """
    src = memoryview(body.reshape(-1) if isinstance(body, np.ndarray) else body).cast("B")
    lo, hi = coded.elements(c)
    n, isz = hi - lo, coded.itemsize
    start, length = coded.chunk_span(c)
    if len(src) != length:
        raise CodecError(f"{where}: chunk {c} has {len(src)} coded bytes at file offset {at}, its table says "
                         f"{length} (truncated); re-run `tiered reshard --compress`")
    if crc32(src) != coded.crc[c]:
        raise CodecError(f"{where}: chunk {c} (coded bytes {at}..{at + length} of the file) fails its CRC-32: the file "
                         "is corrupted; re-copy it or re-run `tiered reshard --compress` on the source checkpoint")
    if coded.codec == EXP3:
        expcode.decode_cpu(np.frombuffer(src, dtype=np.uint8), n, out, where=f"{where}: chunk {c} (file offset {at})")
        return
    import zstandard

    d = zstandard.ZstdDecompressor()
    planes, off = [], 0
    for i, ln in enumerate(coded.lens[c]):
        part = src[off: off + ln]
        if ln != n:
            plane = _scratch(len(planes), n)
            try:
                got = _read_frame(d, part, plane)
            except zstandard.ZstdError as e:
                raise CodecError(f"{where}: chunk {c} plane {i} (file offset {at + off}) does not decode: {e}") \
                    from None
        else:
            plane, got = np.frombuffer(part, dtype=np.uint8), n
        if got != n:
            raise CodecError(f"{where}: chunk {c} plane {i} (file offset {at + off}) decodes to "
                             f"{'more than ' if got > n else ''}{min(got, n)} bytes, not {n}")
        planes.append(plane)
        off += ln
    _interleave(planes, out, n, isz)


_local = threading.local()


def _scratch(k: int, n: int) -> np.ndarray:
    """This thread's scratch buffer ``k`` for a decoded plane, ``n`` bytes (grown, never shrunk: no page faults per
    chunk)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    b = bufs.get(k)
    if b is None or b.size < n:
        b = bufs[k] = np.empty(max(n, 1 << 16), dtype=np.uint8)
    return b[:n]


def _read_frame(d: Any, frame: memoryview, out: np.ndarray) -> int:
    """Decode one zstd frame into ``out`` (its length is what the table says); returns bytes it decodes to (more
    than ``len(out)``: one more than ``len(out)``)."""
    r = d.stream_reader(frame)
    mv, got = memoryview(out), 0
    while got < len(mv):
        k = r.readinto(mv[got:])
        if not k:
            return got
        got += k
    return got + (1 if r.read(1) else 0)


def _interleave(planes: list, out: np.ndarray, n: int, isz: int) -> None:
    """Byte ``i`` of element ``k`` of ``out`` = ``planes[i][k]``: one ``torch.stack`` into ``out`` (measured 5.4 GB/s
    of output for bf16 on the 2-core machine, against 2.8 GB/s per plane for a numpy strided assignment)."""
    import torch

    if isz == 1:
        out[:] = planes[0]
        return
    ts = []
    for k, p in enumerate(planes):
        if not p.flags.writeable:  # a raw plane of a read-only blob (bytes): torch wants writable memory
            p = np.copyto(_scratch(isz + k, n), p) or _scratch(isz + k, n)
        ts.append(torch.from_numpy(p))
    torch.stack(ts, dim=1, out=torch.from_numpy(out).view(n, isz))


def decode_into(blob: memoryview | bytes | np.ndarray, coded: Coded, out: np.ndarray, chunks: range | None = None,
                *, where: str = "", at: int = 0) -> None:
    """Decode ``chunks`` (default: all) of ``blob`` (the whole coded tensor, starting at file offset ``at``) into
    ``out`` (1-D ``uint8``, ``coded.nbytes`` long: each chunk lands at :meth:`Coded.chunk_range`). Runs on the
    caller's thread.

    Raises:
        CodecError: see :func:`decode_chunk`; a chunk past the end of ``blob`` (truncated).
    """
    src = memoryview(blob.reshape(-1) if isinstance(blob, np.ndarray) else blob).cast("B")
    for c in chunks if chunks is not None else range(len(coded.lens)):
        start, length = coded.chunk_span(c)
        if start + length > len(src):
            raise CodecError(f"{where}: chunk {c} lies at {at + start}..{at + start + length}, past the coded data's "
                             f"end at {at + len(src)} (truncated); re-copy the file")
        lo, hi = coded.chunk_range(c)
        decode_chunk(src[start: start + length], coded, c, out[lo:hi], where=where, at=at + start)


# ---------------------------------------------------------------------------------------------- the file format


def table_entry(dtype_name: str, shape: tuple[int, ...] | list[int], coded: Coded) -> dict:
    """A coded tensor's entry in :data:`META_KEY`: its dtype (safetensors name), shape and table."""
    return {"dtype": dtype_name, "shape": list(shape), **coded.to_json()}


def is_coded(shard: Shard) -> bool:
    """Whether ``shard`` was written by ``tiered reshard --compress`` (its metadata has :data:`META_KEY`)."""
    return bool(shard.metadata) and (META_KEY in shard.metadata or VERSION_KEY in shard.metadata)


if TYPE_CHECKING:
    from .tensor_info import TensorInfo as _TensorInfoBase
else:
    from .tensor_info import TensorInfo as _TensorInfoBase


@dataclass(frozen=True)
class LosslessInfo(_TensorInfoBase):
    """A coded tensor, seen as the tensor it decodes to: ``dtype``, ``shape`` and ``nbytes`` are the plain tensor's;
    ``offset`` is where its coded blob starts in ``file`` and :attr:`stored_bytes` its length; ``coded`` its table.
    Only the reader's decode path (:meth:`tiered.reader.Reader.copy_all` and the sources built on it) may read it: a
    plain read of ``offset`` would be the coded bytes."""

    coded: Coded | None = field(default=None, compare=False, hash=False)
    stored: int = 0
    #: a window (:func:`window`): the element of the whole coded tensor this view's first element is; ``shape`` and
    #: ``nbytes`` are the window's, ``coded`` and ``offset`` the whole tensor's, ``stored`` its covering chunks' bytes
    first: int = 0

    @property
    def stored_bytes(self) -> int:
        return self.stored

    @property
    def chunks(self) -> range:
        """The chunks of :attr:`coded` this tensor (or window) decodes from, in order (empty for no elements)."""
        n = self.nbytes // self.dtype.itemsize
        return self.coded.covering(self.first, self.first + n) if n and self.coded is not None else range(0)

    def overlap(self, c: int) -> tuple[int, int, int]:
        """For chunk ``c`` of :attr:`chunks`: ``(skip, start, count)`` in elements: the chunk's first ``skip``
        elements lie before this view, its elements ``[skip, skip + count)`` are this view's ``[start, start +
        count)``."""
        lo, hi = self.coded.elements(c)  # type: ignore[union-attr]
        a, b = max(lo, self.first), min(hi, self.first + self.nbytes // self.dtype.itemsize)
        return a - lo, a - self.first, b - a


def window(info: LosslessInfo, lo: int, hi: int, shape: tuple[int, ...] | None = None) -> LosslessInfo:
    """Elements ``[lo, hi)`` of ``info`` (flattened; ``0 <= lo <= hi <= numel``) as a :class:`LosslessInfo` (1-D, or
    of ``shape``: one routed expert's slab) that decodes from the chunks covering them (:meth:`Coded.covering`; the
    reader decodes a chunk cut by the window's edge into a temporary and copies the part inside). Raises ValueError:
    a range outside ``info``, or a ``shape`` of another element count. ``stored`` counts those chunks' coded bytes:
    what reading the window costs. Used to cut a coded unit into pieces (:func:`tiered.dist.split_unit`) and to read
    one expert of a stacked ``(E, ...)`` tensor (:func:`tiered.expert_spec.find_experts`: the converter's chunks never
    cross an expert)."""
    isz = info.dtype.itemsize
    numel = info.nbytes // isz
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"window [{lo}, {hi}) of {info.name!r} ({numel} elements)")
    if shape is not None and math.prod(shape) != hi - lo:
        raise ValueError(f"window [{lo}, {hi}) of {info.name!r} as shape {shape}")
    w = dataclasses.replace(info, shape=tuple(shape) if shape is not None else (hi - lo,), nbytes=(hi - lo) * isz,
                            first=info.first + lo, stored=0)
    coded = w.coded
    assert coded is not None
    stored = sum(coded.chunk_span(c)[1] for c in w.chunks)
    return dataclasses.replace(w, stored=stored)


def logical_shard(shard: Shard) -> Shard:
    """``shard`` with its coded entries replaced by :class:`LosslessInfo` of their own dtype and shape (``shard``
    itself when it is not coded). Every table is validated here, before any data is read.

    Raises:
        CodecError: an unknown format version, a malformed table, a table without its ``U8`` entry or whose coded
            length differs from the entry's, or a dtype torch cannot hold.
    """
    if not is_coded(shard):
        return shard
    from .tensor_info import DTYPES

    meta = shard.metadata or {}
    path = shard.path
    ver = meta.get(VERSION_KEY)
    if ver != FORMAT_VERSION:
        raise CodecError(f"{path}: lossless format version {ver!r}; this tiered reads version {FORMAT_VERSION} "
                         "(upgrade tiered, or convert the source checkpoint again with this version's "
                         "`tiered reshard --compress`)")
    try:
        tables = json.loads(meta.get(META_KEY, "{}"))
        if not isinstance(tables, dict):
            raise TypeError("not a JSON object")
    except (ValueError, TypeError) as e:
        raise CodecError(f"{path}: __metadata__[{META_KEY!r}] is not a JSON object of tables ({e}); re-run "
                         "`tiered reshard --compress`") from None
    tensors = dict(shard.tensors)
    for name, entry in tables.items():
        where = f"{path}: tensor {name!r}"
        blob = tensors.get(name)
        if not isinstance(entry, dict) or blob is None or str(blob.dtype) != "torch.uint8" or len(blob.shape) != 1:
            raise CodecError(f"{where}: the lossless table names no U8 entry of that name; re-run "
                             "`tiered reshard --compress`")
        dt = DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
        shape = entry.get("shape")
        if dt is None or not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise CodecError(f"{where}: lossless entry dtype {entry.get('dtype')!r} / shape {shape!r} is not a "
                             "tensor torch can hold; re-run `tiered reshard --compress`")
        coded = Coded.from_json(entry, where)
        nbytes = math.prod(shape) * dt.itemsize
        if coded.itemsize != dt.itemsize or coded.nbytes != nbytes or coded.coded_bytes != blob.nbytes:
            raise CodecError(f"{where}: lossless table says {coded.nbytes} plain bytes of {coded.itemsize}-byte "
                             f"elements in {coded.coded_bytes} coded bytes; the entry has {blob.nbytes} coded bytes of "
                             f"{entry.get('dtype')} {shape} ({nbytes} plain): re-run `tiered reshard --compress`")
        tensors[name] = LosslessInfo(name, dt, tuple(shape), blob.file, blob.offset, nbytes, coded=coded,
                                     stored=blob.nbytes)
    return dataclasses.replace(shard, tensors=tensors)


# ---------------------------------------------------------------------------------------------- the converter's choices

#: tensors of fewer plain bytes than this are stored plain by ``tiered reshard --compress`` (a table and a zstd frame
#: per plane cost more than they save there, and a small tensor is read in one request anyway)
MIN_CODED_BYTES = 64 << 10


def chunk_geometry(shape: tuple[int, ...] | list[int], itemsize: int,
                   chunk_bytes: int | None = None) -> tuple[int, int]:
    """``(chunk, slice)`` in elements, as ``tiered reshard --compress`` codes a tensor of ``shape``: chunks of about
    ``chunk_bytes`` plain bytes rounded down to whole rows of the last dimension where a row fits (so the loader's
    row bands fall on chunk boundaries); a slice is one ``shape[0]`` slice of a tensor of 3 or more dimensions (one
    expert of a stacked ``(E, ...)`` tensor decodes alone), else the whole tensor. Both are at least 1."""
    numel = math.prod(shape)
    sl = math.prod(shape[1:]) if len(shape) >= 3 else numel
    chunk = max(1, (chunk_bytes or DEFAULT_CHUNK_BYTES) // itemsize)  # read here: tests make chunks small
    row = shape[-1] if len(shape) else 1
    if 0 < row <= chunk:
        chunk = chunk // row * row
    return max(1, min(chunk, sl)), max(1, sl)


__all__ += ["MIN_CODED_BYTES", "chunk_geometry"]
