"""safetensors headers: parse and validate completely before any data is read.

The format (https://github.com/huggingface/safetensors, "Format" section):

* 8 bytes: ``N``, an unsigned little-endian 64-bit integer, the size of the header;
* ``N`` bytes: a UTF-8 JSON object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
  with an optional ``"__metadata__"`` string-to-string map; it may be padded with spaces;
* the data section: the rest of the file. Offsets are relative to its first byte, and the
  tensors cover it exactly — no holes, no overlaps — with ``end - begin == numel * itemsize``.

Rules enforced here are the reference implementation's: a header cap of 100 MB
(``MAX_HEADER_SIZE`` in safetensors' Rust core), checked arithmetic, a complete cover of the data
section. Any violation raises :class:`~tiered.errors.HeaderError` (or
:class:`~tiered.errors.TruncatedShardError` when the file is shorter than the header promises),
naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import (
    DuplicateTensorError,
    HeaderError,
    ShardNotFoundError,
    TruncatedShardError,
)

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "TensorInfo",
    "Shard",
    "Checkpoint",
    "read_header",
    "open_checkpoint",
    "dtype_name",
    "parse_size",
    "encode_header",
]

#: Header size cap in bytes, as in safetensors' Rust core (``MAX_HEADER_SIZE``).
MAX_HEADER_SIZE = 100_000_000

#: safetensors dtype string -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number and a unit (case-insensitive): ``"5GB"`` = 5e9 (decimal, as
    transformers' ``max_shard_size``), ``"2GiB"`` = 2 * 2**30, ``"500MB"``, ``"1.5GB"``.

    Raises:
        ValueError: unparsable, or not > 0.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"invalid size {size!r}; use a number and a unit, e.g. 5GB, 500MB, 2GiB")
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {size!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise HeaderError(f"dtype {dtype} has no safetensors name") from None


def encode_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...] | list[int], int]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
) -> bytes:
    """8-byte length + JSON header for ``(name, dtype, shape, nbytes)`` laid out contiguously in this order.

    The JSON is padded with spaces (the spec allows it) so the data section starts at a multiple of
    ``align`` bytes: 8 is what ``safetensors.torch.save_file`` writes (byte-identical for the same
    tensor order); 4096 page-aligns the data for streaming and O_DIRECT.
    """
    doc: dict[str, object] = {}
    if metadata is not None:
        doc["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        doc[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie on disk.

    ``offset`` is absolute in ``file`` (bytes, header included); ``nbytes = numel * itemsize``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Shard:
    """One validated safetensors file: its header and where its data section starts (bytes)."""

    path: Path
    file_size: int
    data_start: int  # 8 + N
    tensors: dict[str, TensorInfo]  # in data-offset order
    metadata: dict[str, str] | None = None


def _fail(path: Path, what: str, fix: str = "re-download or re-convert the checkpoint") -> HeaderError:
    return HeaderError(f"{path}: {what}; {fix}")


def read_header(path: str | os.PathLike[str]) -> Shard:
    """Read and validate the safetensors header of ``path``; reads no tensor data.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        HeaderError: malformed header, unknown dtype, bad shape or offsets, holes/overlaps.
        TruncatedShardError: the file ends before the data section the header describes.
    """
    path = Path(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            raise TruncatedShardError(
                f"{path}: {file_size} bytes, too short for the 8-byte safetensors header size; "
                "the file is truncated: re-download or re-convert it"
            )
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_SIZE:
            raise _fail(path, f"header size {n} bytes exceeds the {MAX_HEADER_SIZE}-byte cap (not a safetensors file?)")
        if 8 + n > file_size:
            raise TruncatedShardError(
                f"{path}: header says {n} bytes of JSON but the file has {file_size} bytes in all; "
                "the file is truncated: re-download or re-convert it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"header at offset 8 is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise _fail(path, "__metadata__ must map strings to strings")

    data_start = 8 + n
    data_len = file_size - data_start
    entries: list[tuple[int, int, str, torch.dtype, tuple[int, ...]]] = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise _fail(path, f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        dt = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        if dt is None:
            raise _fail(path, f"tensor {name!r}: unknown dtype {info.get('dtype')!r}", "convert it to a supported dtype")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        offs = info.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise _fail(path, f"tensor {name!r}: data_offsets {offs!r} must be [begin, end] with 0 <= begin <= end")
        nbytes = math.prod(shape) * dt.itemsize
        if offs[1] - offs[0] != nbytes:
            raise _fail(
                path,
                f"tensor {name!r}: data_offsets {offs} span {offs[1] - offs[0]} bytes but "
                f"shape {shape} x {info['dtype']} needs {nbytes}",
            )
        entries.append((offs[0], offs[1], name, dt, tuple(shape)))

    entries.sort(key=lambda e: (e[0], e[1]))
    pos = 0
    for begin, end, name, _, _ in entries:
        if begin != pos:
            kind = "hole" if begin > pos else "overlap"
            raise _fail(path, f"tensor {name!r}: {kind} in the data section at offset {data_start + min(begin, pos)}")
        pos = end
    if pos > data_len:
        last = entries[-1][2]
        raise TruncatedShardError(
            f"{path}: tensor {last!r} ends at offset {data_start + pos} but the file has {file_size} bytes; "
            "the file is truncated: re-download or re-convert it"
        )
    if pos < data_len:
        raise _fail(path, f"{data_len - pos} trailing bytes after the last tensor at offset {data_start + pos}")

    tensors = {
        name: TensorInfo(name, dt, shape, path, data_start + begin, end - begin) for begin, end, name, dt, shape in entries
    }
    return Shard(path=path, file_size=file_size, data_start=data_start, tensors=tensors, metadata=metadata)


@dataclass
class Checkpoint:
    """A model directory's safetensors: shards (each parsed once) and every tensor by name."""

    root: Path
    shards: list[Shard]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data (headers excluded)."""
        return sum(t.nbytes for t in self.tensors.values())


INDEX_NAME = "model.safetensors.index.json"


def _inside(root: Path, name: str, index: Path) -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ShardNotFoundError(f"{index}: shard name {name!r} must be a relative file name inside {root}")
    # Lexical check (no symlink resolution): a Hugging Face cache snapshot holds symlinks into ../../blobs.
    base = Path(os.path.abspath(root))
    p = Path(os.path.normpath(base / name))
    if base not in p.parents:
        raise ShardNotFoundError(f"{index}: shard {name!r} points outside {root}; fix the index's weight_map")
    return p


def open_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Parse every shard header of a Hugging Face model directory (no tensor data is read).

    Looks for ``model.safetensors.index.json`` (sharded), else ``model.safetensors``, else
    any ``*.safetensors`` files.

    Raises:
        ShardNotFoundError: no safetensors file, or the index names a missing shard or one outside ``model_dir``.
        HeaderError / TruncatedShardError: a shard fails validation (see :func:`read_header`).
        DuplicateTensorError: a tensor name appears in two shards.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ShardNotFoundError(f"{root}: not a directory; pass a Hugging Face model directory")
    index = root / INDEX_NAME
    expected: dict[str, str] | None = None
    if index.exists():
        try:
            doc = json.loads(index.read_text())
            expected = doc["weight_map"]
            assert isinstance(expected, dict)
        except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as e:
            raise HeaderError(f"{index}: not a valid index (needs a 'weight_map' object): {e}") from None
        names = sorted(set(expected.values()))
        paths = [_inside(root, n, index) for n in names]
        for n, p in zip(names, paths, strict=False):
            if not p.is_file():
                raise ShardNotFoundError(f"{index}: shard {n!r} is missing from {root}; re-download it")
    elif (root / "model.safetensors").is_file():
        paths = [root / "model.safetensors"]
    else:
        paths = sorted(root.glob("*.safetensors"))
        if not paths:
            bins = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
            hint = f" (found {', '.join(bins[:3])}: convert it with `tiered reshard`)" if bins else ""
            raise ShardNotFoundError(f"{root}: no safetensors checkpoint{hint}")

    ckpt = Checkpoint(root=root, shards=[])
    for p in paths:
        shard = read_header(p)
        ckpt.shards.append(shard)
        for name, t in shard.tensors.items():
            if name in ckpt.tensors:
                raise DuplicateTensorError(
                    f"tensor {name!r} is in both {ckpt.tensors[name].file} and {p}; remove one copy"
                )
            ckpt.tensors[name] = t
    if expected is not None:
        for name, shard_name in expected.items():
            t = ckpt.tensors.get(name)
            if t is None or t.file.name != Path(shard_name).name:
                where = "no shard" if t is None else str(t.file)
                raise HeaderError(
                    f"{index}: weight_map puts {name!r} in {shard_name!r} but it is in {where}; regenerate the index"
                )
    return ckpt
