"""safetensors headers: parse and validate completely before any data is read.

The format (https://github.com/huggingface/safetensors, "Format" section):

* 8 bytes: ``N``, an unsigned little-endian 64-bit integer, the size of the header;
* ``N`` bytes: a UTF-8 JSON object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
  with an optional ``"__metadata__"`` string-to-string map; it may be padded with spaces;
* the data section: the rest of the file. Offsets are relative to its first byte, and the
  tensors cover it exactly — no holes, no overlaps — with ``end - begin == numel * bits / 8``.

:func:`read_header` accepts exactly the files ``safetensors.safe_open`` accepts (safetensors 0.8,
checked by ``tests/test_fuzz_header.py``, a differential fuzz test against it) and raises
:class:`~tiered.errors.HeaderError` for every file it refuses. The reference implementation's rules:

* the header size is capped at 100 MB (``MAX_HEADER_SIZE`` in safetensors' Rust core);
* the header is parsed by ``serde_json`` into typed fields: shape dimensions and offsets are
  ``usize`` (integers ``0 .. 2**64 - 1``; ``-0``, ``1.0``, ``true`` are refused), numbers that
  overflow a 64-bit float anywhere in the header are refused (with serde_json's own rounding),
  as are lone UTF-16 surrogate escapes and nesting deeper than 127 levels; a duplicate
  ``dtype``/``shape``/``data_offsets`` field or ``__metadata__`` key is refused, a duplicate tensor
  name keeps the last entry (after each entry was type-checked);
* a tensor entry may carry extra fields (ignored), may be written as a 3-element array
  ``[dtype, shape, data_offsets]``, and its dtype may be written ``{"F32": null}`` (serde's forms);
* the 22 dtypes of :data:`SPEC_DTYPE_BITS`; ``numel`` and ``numel * bits`` are computed with
  checked 64-bit arithmetic, dimension by dimension in order (``[2**33, 2**33, 0]`` overflows,
  ``[0, 2**33, 2**33]`` is an empty tensor), and ``numel * bits`` must be a whole number of bytes;
* sorted by ``(begin, end)``, the tensors cover the data section exactly.

Tensors that torch cannot hold — a dtype with no torch dtype in this torch version, a sub-byte
packed dtype (``F4``, ``F6_*``), or a dimension above ``2**63 - 1`` (only possible in an empty
tensor) — are valid and count in the cover check, but are listed in :attr:`Shard.skipped` as
:class:`SkippedTensor` instead of :attr:`Shard.tensors`; the loader decides whether the model needs
them.

Violations raise :class:`~tiered.errors.HeaderError` (or :class:`~tiered.errors.TruncatedShardError`
when the file is shorter than the header promises), naming the file, the tensor and the offset.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import serde_json as _serde_json
from .errors import HeaderError, ShardNotFoundError, TruncatedShardError
from .serde_json import (
    _MAX_DEPTH,
    _SURROGATE_ESCAPE,
    _U64_MAX,
    _extra_refused,
    _is_object,
    _items,
    _lone_surrogate,
    _Obj,
    _Refused,
)
from .spec_dtypes import SPEC_DTYPE_BITS

if TYPE_CHECKING:
    from .tensor_info import Shard

__all__ = ["MAX_HEADER_SIZE", "read_header", "check_shard", "scan_header"]

#: Header size cap in bytes, as in safetensors' Rust core (``MAX_HEADER_SIZE``).
MAX_HEADER_SIZE = 100_000_000
_I64_MAX = 2**63 - 1


_REFETCH = "re-download or re-convert the checkpoint"


def _fail(path: Path, what: str, fix: str = _REFETCH) -> HeaderError:
    return HeaderError(f"{path}: {what}; {fix}")


_FIELDS = ("dtype", "shape", "data_offsets")
_DTYPE_LIST = ", ".join(SPEC_DTYPE_BITS)


def _usize(x: object) -> bool:
    return type(x) is int and 0 <= x <= _U64_MAX


def _entry(path: Path, where: str, name: str, value: object) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor entry, type-checked as serde deserializes ``TensorInfo``: ``(dtype, shape, begin, end)``."""
    if _is_object(value):
        if type(value) is dict and len(value) == 3:  # the common case: exactly the three fields
            dt, shape, offs = value.get("dtype", _NONE), value.get("shape", _NONE), value.get("data_offsets", _NONE)
        else:
            dt = shape = offs = _NONE
        if dt is _NONE or shape is _NONE or offs is _NONE:
            fields: dict[str, object] = {}
            for k, v in _items(value):  # type: ignore[arg-type]
                if k in _FIELDS:
                    if k in fields:
                        raise _bad_entry(path, where, name, f"field {k!r} appears twice", "keep one and re-save the header")
                    fields[k] = v
                else:
                    why = _extra_refused(v, _MAX_DEPTH - 2)
                    if why:
                        raise _bad_entry(path, where, name, f"extra field {k!r} {why}", "remove the field")
            missing = [k for k in _FIELDS if k not in fields]
            if missing:
                raise _bad_entry(path, where, name, f"entry lacks {', '.join(missing)}; it needs dtype, shape and data_offsets")
            dt, shape, offs = fields["dtype"], fields["shape"], fields["data_offsets"]
    elif type(value) is list and len(value) == 3:
        dt, shape, offs = value
    else:
        raise _bad_entry(path, where, name, f"entry {_short(value)} is not an object with dtype, shape and data_offsets")
    if type(dt) is not str:
        if _is_object(dt) and len(dt) == 1:  # type: ignore[arg-type]
            ((variant, unit),) = _items(dt)  # type: ignore[arg-type]
            if unit is None:  # serde's {"F32": null} form of an enum
                dt = variant
    if type(dt) is not str or dt not in SPEC_DTYPE_BITS:
        fix = f"safetensors knows {_DTYPE_LIST}; convert the tensor to one of them"
        raise _bad_entry(path, where, name, f"unknown dtype {_short(dt)}", fix)
    if type(shape) is not list or (shape and (set(map(type, shape)) != _INT or min(shape) < 0 or max(shape) > _U64_MAX)):
        raise _bad_entry(
            path,
            where,
            name,
            f"shape {_short(shape)} is not a list of non-negative integers below 2**64",
            "write each dimension as a plain integer (no sign, fraction or exponent) and re-save the header",
        )
    if type(offs) is not list or len(offs) != 2 or not (_usize(offs[0]) and _usize(offs[1])):
        raise _bad_entry(
            path,
            where,
            name,
            f"data_offsets {_short(offs)} must be [begin, end], two non-negative integers below 2**64",
            "regenerate the header (safetensors.torch.save_file writes it)",
        )
    return dt, tuple(shape), offs[0], offs[1]


_INT = {int}
_NONE = object()  # a field not given


def _bad_entry(path: Path, where: str, name: str, what: str, fix: str = _REFETCH) -> HeaderError:
    return _fail(path, f"tensor {name!r} in the {where}: {what}", fix)


def _plain(value: object, depth: int = 0) -> object:
    """``value`` with its objects as dicts (nesting beyond 4 levels elided), for messages."""
    if type(value) is list or _is_object(value):
        if depth >= 4:
            return ...
        if _is_object(value):
            return {k: _plain(v, depth + 1) for k, v in _items(value)}  # type: ignore[arg-type]
        return [_plain(v, depth + 1) for v in value]  # type: ignore[attr-defined]
    return value


def _short(value: object, limit: int = 80) -> str:
    r = repr(_plain(value))
    return r if len(r) <= limit else r[: limit - 3] + "..."


_JSON_TYPES = {dict: "object", _Obj: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _nbytes(path: Path, name: str, dt: str, shape: tuple[int, ...], begin: int, end: int, data_start: int) -> int:
    """``numel * bits / 8`` with safetensors' checked 64-bit arithmetic, dimension by dimension in order."""
    where = f"data_offsets [{begin}, {end}] (file offset {data_start + begin})"
    numel = 1
    for d in shape:
        numel *= d
        if numel > _U64_MAX:
            raise _fail(
                path,
                f"tensor {name!r} at {where}: shape {list(shape)} overflows 64 bits before its end "
                "(safetensors multiplies the dimensions in order)",
                "fix the shape in the header (an empty tensor needs its 0 before the large dimensions)",
            )
    bits = numel * SPEC_DTYPE_BITS[dt]
    if bits > _U64_MAX:
        raise _fail(path, f"tensor {name!r} at {where}: shape {list(shape)} x {dt} overflows 64 bits", "fix the shape")
    if bits % 8:
        raise _fail(
            path,
            f"tensor {name!r} at {where}: shape {list(shape)} of {dt} ({SPEC_DTYPE_BITS[dt]} bits each) is "
            f"{bits} bits, not a whole number of bytes",
            "pad the tensor to a whole number of bytes and re-convert it",
        )
    return bits // 8


def _read_raw(path: Path) -> tuple[int, int, bytes]:
    """``(file size, N, the N header bytes)`` of ``path``, checked against the size cap and the file's size.

    Raises:
        ShardNotFoundError: no file there (also a dangling symlink).
        HeaderError: not a regular file (a directory, a FIFO, a device), or one the process cannot open.
        TruncatedShardError / HeaderError: as :func:`read_header`.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShardNotFoundError(f"{path}: no such file (a dangling symlink?); re-download or re-convert the "
                                 "checkpoint") from None
    except OSError as e:  # a symlink loop, a path too long, no permission on a parent
        raise _fail(path, f"cannot be read ({e.strerror or e})", "check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise _fail(path, "not a regular file (a directory, a FIFO or a device) where a safetensors shard should be",
                    "move it aside or point at the checkpoint's real shard")
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise _fail(path, f"cannot be opened ({e.strerror or e})", "check the file's permissions") from None
    with f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            raise TruncatedShardError(
                f"{path}: {file_size} bytes, too short for the 8-byte safetensors header size at offset 0; "
                "the file is truncated: re-download or re-convert it"
            )
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_SIZE:
            raise _fail(
                path, f"header size {n} bytes (at offset 0) exceeds the {MAX_HEADER_SIZE}-byte cap (not a safetensors file?)"
            )
        if 8 + n > file_size:
            raise TruncatedShardError(
                f"{path}: header says {n} bytes of JSON but the file has {file_size} bytes in all; "
                "the file is truncated: re-download or re-convert it"
            )
        raw = f.read(n)
    if len(raw) != n:
        raise TruncatedShardError(f"{path}: file shrank while its header was read; re-download or re-convert it")
    return file_size, n, raw


def _parse_json(path: Path, header: str, raw: bytes) -> object:
    """The header bytes decoded as serde_json decodes them: a JSON object (a dict, or an :class:`_Obj`)."""
    # tiered.format's _decode, looked up at each call (tests swap in the exact decoder there); serde_json's own while
    # tiered.format is not imported (the command line's torch-free check_shard: tiered.format imports torch)
    _format = sys.modules.get(f"{__package__}.format", _serde_json)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header byte at offset {8 + e.start} is not valid UTF-8 ({e.reason})") from None
    try:
        doc = _format._decode(text)
    except json.JSONDecodeError as e:
        at = 8 + len(text[: e.pos].encode("utf-8"))
        raise _fail(path, f"header is not valid JSON at offset {at} ({e.msg})") from None
    except _Refused as e:
        raise _fail(path, f"{header}: {e}") from None
    except RecursionError:
        raise _fail(path, f"{header} nests deeper than {_MAX_DEPTH} levels") from None
    except ValueError as e:  # defensive: any other refusal by the decoder
        raise _fail(path, f"{header} is not valid JSON ({e})") from None
    if not _is_object(doc):
        raise _fail(path, f"{header} is a JSON {_JSON_TYPES.get(type(doc), 'null')}, not an object")
    if _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(doc)
        if bad is not None:
            raise _fail(path, f"{header}: string {bad!r} has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
    return doc


def _split_doc(
    path: Path, header: str, doc: object
) -> tuple[dict[str, str] | None, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """``(__metadata__, tensor name -> (dtype, shape, begin, end))`` of the header object, each entry type-checked."""
    metadata: dict[str, str] | None = None
    seen_metadata = False
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, value in _items(doc):  # type: ignore[arg-type]
        if name == "__metadata__":
            if seen_metadata:
                raise _fail(path, f"{header}: __metadata__ appears twice", "merge the two into one map")
            seen_metadata = True
            if value is None:
                metadata = None
            elif _is_object(value) and all(type(v) is str for _, v in _items(value)):  # type: ignore[arg-type]
                metadata = dict(_items(value))  # type: ignore[arg-type]  # a repeated key keeps its last value, as in safetensors
            else:
                raise _fail(path, f"{header}: __metadata__ must map strings to strings, got {_short(value)}")
        else:
            entries[name] = _entry(path, header, name, value)  # a repeated name keeps its last entry
    return metadata, entries


def _check_cover(
    path: Path, entries: dict[str, tuple[str, tuple[int, ...], int, int]], data_start: int, file_size: int
) -> list[tuple[int, int, str, str, tuple[int, ...]]]:
    """The entries as ``(begin, end, name, dtype, shape)`` sorted by ``(begin, end)``, once each spans its bytes
    exactly and together they cover the data section exactly."""
    data_len = file_size - data_start
    checked: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for name, (dt, shape, begin, end) in entries.items():
        if end < begin:
            raise _fail(
                path,
                f"tensor {name!r}: data_offsets [{begin}, {end}] must be [begin, end] with 0 <= begin <= end",
                "regenerate the header",
            )
        nbytes = _nbytes(path, name, dt, shape, begin, end, data_start)
        if end - begin != nbytes:
            raise _fail(
                path,
                f"tensor {name!r} at file offset {data_start + begin}: data_offsets [{begin}, {end}] span "
                f"{end - begin} bytes but shape {list(shape)} x {dt} needs {nbytes}",
            )
        checked.append((begin, end, name, dt, shape))

    checked.sort(key=lambda e: (e[0], e[1]))
    pos = 0
    for begin, end, name, _, _ in checked:
        if begin != pos:
            kind = "hole" if begin > pos else "overlap"
            raise _fail(path, f"tensor {name!r}: {kind} in the data section at offset {data_start + min(begin, pos)}")
        pos = end
    if pos > data_len:
        last = checked[-1][2]
        raise TruncatedShardError(
            f"{path}: tensor {last!r} ends at offset {data_start + pos} but the file has {file_size} bytes; "
            "the file is truncated: re-download or re-convert it"
        )
    if pos < data_len:
        raise _fail(
            path,
            f"{data_len - pos} trailing bytes after the last tensor at offset {data_start + pos}",
            "safetensors refuses such a file too: truncate it to the last tensor's end or re-convert it",
        )
    return checked


def check_shard(path: str | os.PathLike[str]) -> None:
    """:func:`read_header`'s checks without building the records (no torch: the command line runs it before torch is
    imported, so a bad or truncated shard is reported at once).

    Raises:
        FileNotFoundError / HeaderError / TruncatedShardError: as :func:`read_header`.
    """
    scan_header(path)


def scan_header(
    path: str | os.PathLike[str],
) -> tuple[int, int, dict[str, str] | None, list[tuple[int, int, str, str, tuple[int, ...]]]]:
    """:func:`read_header`'s checks and what they found, torch-free (``tiered inspect`` without ``--units``):
    ``(file size, data start, __metadata__, entries)``, the entries ``(begin, end, name, dtype, shape)`` sorted by
    offset, ``begin``/``end`` relative to the data section and ``dtype`` the header's string (``"BF16"``), every
    tensor of the file included (those :attr:`Shard.skipped` would hold too).

    Raises:
        FileNotFoundError / HeaderError / TruncatedShardError: as :func:`read_header`.
    """
    path = Path(path)
    file_size, n, raw = _read_raw(path)
    header = f"header JSON at offsets 8..{8 + n}"
    metadata, entries = _split_doc(path, header, _parse_json(path, header, raw))
    return file_size, 8 + n, metadata, _check_cover(path, entries, 8 + n, file_size)


def read_header(path: str | os.PathLike[str]) -> Shard:
    """Read and validate the safetensors header of ``path``; reads no tensor data.

    Accepts exactly what ``safetensors.safe_open`` accepts (see the module docstring). Tensors torch
    cannot hold are returned in :attr:`Shard.skipped`, the others in :attr:`Shard.tensors`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        HeaderError: malformed header, unknown dtype, bad shape or offsets, holes/overlaps.
        TruncatedShardError: the file ends before the data section the header describes.
    """
    from .tensor_info import DTYPES, Shard, SkippedTensor, TensorInfo

    path = Path(path)
    file_size, n, raw = _read_raw(path)
    header = f"header JSON at offsets 8..{8 + n}"
    doc = _parse_json(path, header, raw)
    metadata, entries = _split_doc(path, header, doc)
    data_start = 8 + n
    checked = _check_cover(path, entries, data_start, file_size)

    tensors: dict[str, TensorInfo] = {}
    skipped: dict[str, SkippedTensor] = {}
    for begin, end, name, dt, shape in checked:
        torch_dtype = DTYPES.get(dt)
        if torch_dtype is not None and all(d <= _I64_MAX for d in shape):
            tensors[name] = TensorInfo(name, torch_dtype, shape, path, data_start + begin, end - begin)
        else:
            skipped[name] = SkippedTensor(name, dt, shape, path, data_start + begin, end - begin)
    return Shard(
        path=path, file_size=file_size, data_start=data_start, tensors=tensors, metadata=metadata, skipped=skipped
    )
