"""Lossless coding of tensor bytes (issue 25): byte planes, each zstd-coded, in independent chunks.

The codec ``bytegroup-zstd1`` (chosen by ``benchmarks/codecs.py``, `benchmarks/NOTES.md` "Issue 25: which lossless
codec"): a tensor's bytes are cut into chunks of ``chunk`` elements; within a chunk, byte ``i`` of every element forms
plane ``i`` (ZipNN's byte grouping: a bf16's sign-and-exponent byte is one plane, its mantissa byte the other), and
each plane is coded with zstd level 1 — or kept raw where zstd does not make it smaller (a bf16 mantissa plane
almost never shrinks). Chunks are independent, so reader threads can decode any chunk straight into its place in a
ring slot, and a device decoder gets a batch of independent streams.

Layout of one coded tensor (a ``uint8`` blob): the chunks one after another, each chunk's planes in order. Its
*table* (:class:`Coded`) says, per chunk and plane, where the plane's bytes lie in the blob, how long they are and
whether they are zstd or raw. Nothing here knows about files; the converter stores blob and table, the reader decodes.

Exact by construction: decoding returns the input bytes (NaN payloads, subnormals, any dtype). :func:`decode_into`
checks every plane's length against the table, and each zstd frame carries its content size and a checksum, so a
corrupted or truncated zstd plane raises :class:`~tiered.errors.CodecError` naming the chunk and plane. A plane kept
raw carries no checksum (as plain safetensors data carries none): a flipped bit there decodes to a flipped bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import CodecError

__all__ = ["CODEC", "Coded", "CodecError", "encode", "decode_into", "DEFAULT_CHUNK_BYTES"]

#: the codec's name, as the converter records it
CODEC = "bytegroup-zstd1"
#: bytes of plain data per chunk (a reader task's worth: :data:`tiered.reader.DECODE_CHUNK` scale)
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass
class Coded:
    """One coded tensor: ``itemsize`` bytes per element, ``nbytes`` plain bytes, chunks of ``chunk`` elements (the
    last may be short); ``planes[c][i] = (offset, length, zstd)`` of plane ``i`` of chunk ``c`` in the blob."""

    itemsize: int
    nbytes: int
    chunk: int
    planes: list[list[tuple[int, int, bool]]] = field(default_factory=list)

    @property
    def coded_bytes(self) -> int:
        return sum(n for ch in self.planes for _, n, _ in ch)

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Plain bytes ``[lo, hi)`` chunk ``c`` decodes to."""
        lo = c * self.chunk * self.itemsize
        return lo, min(self.nbytes, lo + self.chunk * self.itemsize)

    def to_json(self) -> dict:
        return {"codec": CODEC, "itemsize": self.itemsize, "nbytes": self.nbytes, "chunk": self.chunk,
                "planes": [[[o, n, int(z)] for o, n, z in ch] for ch in self.planes]}

    @classmethod
    def from_json(cls, d: dict, where: str) -> Coded:
        """Raises CodecError: an unknown codec or a malformed table (``where`` names the file and tensor)."""
        try:
            if d["codec"] != CODEC:
                raise CodecError(f"{where}: codec {d['codec']!r} is not one tiered decodes ({CODEC})")
            c = cls(int(d["itemsize"]), int(d["nbytes"]), int(d["chunk"]),
                    [[(int(o), int(n), bool(z)) for o, n, z in ch] for ch in d["planes"]])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"{where}: malformed lossless table ({e!r}); re-run `tiered reshard --compress`") from None
        want = -(-c.nbytes // (c.chunk * c.itemsize)) if c.nbytes else 0
        if c.itemsize < 1 or c.chunk < 1 or c.nbytes % c.itemsize or len(c.planes) != want \
                or any(len(ch) != c.itemsize for ch in c.planes):
            raise CodecError(f"{where}: lossless table does not fit {c.nbytes} bytes of {c.itemsize}-byte elements "
                             f"in chunks of {c.chunk}; re-run `tiered reshard --compress`")
        return c


def encode(data: np.ndarray, itemsize: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           level: int = 1) -> tuple[bytes, Coded]:
    """Code ``data`` (a 1-D ``uint8`` array, a whole number of ``itemsize``-byte elements): returns the blob and its
    table. Runs on the caller's thread; memory: one chunk's planes and their codes."""
    import zstandard

    data = np.ascontiguousarray(data).reshape(-1)
    if data.dtype != np.uint8 or data.size % itemsize:
        raise ValueError(f"encode: {data.size} bytes of {data.dtype} are not whole {itemsize}-byte elements")
    chunk = max(1, chunk_bytes // itemsize)
    z = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    out = bytearray()
    coded = Coded(itemsize, int(data.size), chunk)
    step = chunk * itemsize
    for lo in range(0, data.size, step):
        part = data[lo: lo + step].reshape(-1, itemsize)
        ch = []
        for i in range(itemsize):
            plane = np.ascontiguousarray(part[:, i]).tobytes()
            packed = z.compress(plane)
            use = len(packed) < len(plane)
            body = packed if use else plane
            ch.append((len(out), len(body), use))
            out += body
        coded.planes.append(ch)
    return bytes(out), coded


def decode_into(blob: memoryview | bytes | np.ndarray, coded: Coded, out: np.ndarray, chunks: range | None = None,
                *, where: str = "") -> None:
    """Decode ``chunks`` (default: all) of ``blob`` into ``out`` (1-D ``uint8``, ``coded.nbytes`` long: each chunk
    lands at :meth:`Coded.chunk_range`). ``blob`` is the whole coded tensor. Runs on the caller's thread (a reader
    thread); temporaries: one chunk's planes.

    Raises:
        CodecError: a plane that zstd rejects (checksum, truncation) or that decodes to the wrong length.
    """
    import zstandard

    src = memoryview(blob).cast("B") if not isinstance(blob, np.ndarray) else memoryview(blob.reshape(-1))
    isz = coded.itemsize
    d = zstandard.ZstdDecompressor()
    for c in chunks if chunks is not None else range(len(coded.planes)):
        lo, hi = coded.chunk_range(c)
        n = (hi - lo) // isz
        dest = out[lo:hi].reshape(n, isz)
        for i, (off, ln, zs) in enumerate(coded.planes[c]):
            if off + ln > len(src):
                raise CodecError(f"{where}: chunk {c} plane {i} lies at {off}..{off + ln} past the coded data's "
                                 f"{len(src)} bytes (truncated)")
            body = src[off: off + ln]
            try:
                plane = d.decompress(body, max_output_size=n) if zs else body
            except zstandard.ZstdError as e:
                raise CodecError(f"{where}: chunk {c} plane {i} (bytes {off}..{off + ln}) does not decode: {e}") \
                    from None
            if len(plane) != n:
                raise CodecError(f"{where}: chunk {c} plane {i} decodes to {len(plane)} bytes, not {n}")
            dest[:, i] = np.frombuffer(plane, dtype=np.uint8)
