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
import math
import os
import re
import struct
from collections.abc import Iterable
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
    "SPEC_DTYPE_BITS",
    "MAX_HEADER_SIZE",
    "TensorInfo",
    "SkippedTensor",
    "Shard",
    "Checkpoint",
    "read_header",
    "open_checkpoint",
    "dtype_name",
    "parse_size",
    "encode_header",
    "check_model_dir",
    "read_index",
    "index_shard_paths",
    "INDEX_NAME",
]

#: Header size cap in bytes, as in safetensors' Rust core (``MAX_HEADER_SIZE``).
MAX_HEADER_SIZE = 100_000_000

#: Every dtype of the safetensors format (the Rust core's ``Dtype`` in safetensors 0.8) -> bits per element.
SPEC_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def _torch_dtypes() -> dict[str, torch.dtype]:
    dtypes = {
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
    # Newer or rarer dtypes, where this torch has them (float8_e8m0fnu: torch >= 2.7). F4 is left out:
    # torch.float4_e2m1fn_x2 packs two elements per byte, so its shape is not the header's.
    for name, attr in (
        ("F8_E8M0", "float8_e8m0fnu"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("C64", "complex64"),
    ):
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            dtypes[name] = dt
    return dtypes


#: safetensors dtype string -> torch dtype, for the dtypes torch computes with (a subset of :data:`SPEC_DTYPE_BITS`).
DTYPES: dict[str, torch.dtype] = _torch_dtypes()
_NAMES = {v: k for k, v in DTYPES.items()}

_U64_MAX = 2**64 - 1
_I64_MAX = 2**63 - 1
_I32_MAX = 2**31 - 1
#: serde_json's recursion limit: 128 nested arrays/objects fail, the header's top-level object included.
_MAX_DEPTH = 127


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
class SkippedTensor:
    """A valid tensor that torch cannot hold, so it is not in ``Shard.tensors`` (see :attr:`reason`).

    Its dtype has no torch dtype in this torch version (``F6_E2M3``; ``F8_E8M0`` before torch 2.7),
    is packed below a byte per element (``F4``, ``F6_*``), or a dimension exceeds ``2**63 - 1`` (an
    empty tensor only). ``dtype_name`` is the header's dtype string; ``offset`` is absolute in
    ``file``, as in :class:`TensorInfo`; ``nbytes = numel * bits / 8``.
    """

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def reason(self) -> str:
        """Why torch cannot hold it, for messages."""
        if self.dtype_name in DTYPES:
            return f"shape {list(self.shape)} has a dimension above torch's limit of 2**63 - 1"
        bits = SPEC_DTYPE_BITS.get(self.dtype_name, 0)
        if bits < 8:
            return f"dtype {self.dtype_name} packs {bits}-bit elements, which torch has no unpacked dtype for"
        return f"torch {torch.__version__} has no dtype for {self.dtype_name}"


@dataclass(frozen=True)
class Shard:
    """One validated safetensors file: its header and where its data section starts (bytes)."""

    path: Path
    file_size: int
    data_start: int  # 8 + N
    tensors: dict[str, TensorInfo]  # in data-offset order
    metadata: dict[str, str] | None = None
    skipped: dict[str, SkippedTensor] = field(default_factory=dict)  # in data-offset order


# ---------------------------------------------------------------------------------------------- JSON, as serde_json


class _Obj(list):
    """A JSON object as its ``(key, value)`` pairs in document order, duplicates kept."""

    __slots__ = ()


class _Refused(Exception):
    """Raised inside the JSON decoder's hooks: serde_json refuses this token."""


_POW10 = [float(f"1e{i}") for i in range(309)]
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE]([+-]?)([0-9]+))?")


def _serde_f64_in_range(literal: str) -> bool:
    """Whether serde_json (without ``float_roundtrip``, as safetensors builds it) reads this number
    literal as a finite 64-bit float: ``parse_integer``/``parse_decimal``/``parse_exponent`` and
    ``f64_from_parts`` of serde_json's ``de.rs``, step by step (its rounding differs from Python's
    near the largest float: it refuses ``1.7976931348623158e308``)."""
    m = _NUMBER.fullmatch(literal)
    if m is None:  # cannot happen: the decoder matched the same grammar
        return False
    int_part, frac, exp_sign, exp_digits = m.group(1), m.group(2) or "", m.group(3), m.group(4)
    significand, exponent = 0, 0
    for i, c in enumerate(int_part):
        nxt = significand * 10 + ord(c) - 48
        if nxt > _U64_MAX:  # parse_long_integer: every further integer digit only scales by 10
            exponent = len(int_part) - i
            break
        significand = nxt
    if significand == 0:  # leading fraction zeros only scale (and would cost a loop turn each)
        digits = frac.lstrip("0")
        exponent -= len(frac) - len(digits)
        frac = digits
    for c in frac:
        nxt = significand * 10 + ord(c) - 48
        if nxt > _U64_MAX:  # parse_decimal_overflow: further fraction digits are ignored
            break
        significand = nxt
        exponent -= 1
    if exp_digits is not None:
        e = 0
        for c in exp_digits:
            e = e * 10 + ord(c) - 48
            if e > _I32_MAX:  # parse_exponent_overflow
                return significand == 0 or exp_sign == "-"
        exponent = max(-(2**31), min(_I32_MAX, exponent - e if exp_sign == "-" else exponent + e))
    if significand == 0 or exponent < 0:
        return True
    if exponent > 308:
        return False
    return math.isfinite(float(significand) * _POW10[exponent])


def _parse_int(literal: str) -> int | float:
    """serde_json's reading of an integer literal: u64 or negative i64 stay integers; ``-0`` and
    integers beyond 64 bits become floats (so they are no ``usize``); out-of-range ones are refused."""
    if len(literal) <= 19:  # fits u64 and i64
        return -0.0 if literal == "-0" else int(literal)
    negative = literal[0] == "-"
    digits = literal[1:] if negative else literal
    if len(digits) <= 20:
        v = int(digits)
        if not negative and v <= _U64_MAX:
            return v
        if negative and v <= 2**63:
            return -v
        if v <= _U64_MAX:
            return -float(v)
    if not _serde_f64_in_range(literal):
        raise _Refused(f"number {literal[:40]}{'...' if len(literal) > 40 else ''} overflows a 64-bit float")
    return float(literal)


def _parse_float(literal: str) -> float:
    if not _serde_f64_in_range(literal):
        raise _Refused(f"number {literal[:40]}{'...' if len(literal) > 40 else ''} overflows a 64-bit float")
    return float(literal)


def _parse_constant(literal: str) -> float:
    raise _Refused(f"{literal} is not JSON")


class _Duplicate(Exception):
    """A JSON object repeats a key: decode again keeping every pair (:class:`_Obj`)."""


def _dict_no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _Duplicate
    return d


# Fast: objects as dicts, integers as Python ints. Exact: objects as their pairs, integers as serde_json
# reads them. The fast one is used unless the text holds "-0" (an integer serde_json reads as a float)
# or a repeated key, or an integer too long for int() (ValueError); the two agree on everything else
# (integers beyond 64 bits are refused wherever their value matters, and range-checked in extra fields).
_FAST = json.JSONDecoder(
    object_pairs_hook=_dict_no_duplicates, parse_float=_parse_float, parse_constant=_parse_constant, strict=True
)
_EXACT = json.JSONDecoder(
    object_pairs_hook=_Obj, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant, strict=True
)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _decode(text: str) -> object:
    if "-0" not in text:
        try:
            return _FAST.decode(text)
        except json.JSONDecodeError:
            raise
        except (_Duplicate, ValueError):
            pass
    return _EXACT.decode(text)


def _is_object(v: object) -> bool:
    return type(v) is dict or type(v) is _Obj


def _items(v: dict[str, object] | _Obj) -> Iterable[tuple[str, object]]:
    return v.items() if type(v) is dict else v  # type: ignore[union-attr,return-value]


def _lone_surrogate(doc: object) -> str | None:
    """The first string (key or value) holding an unpaired UTF-16 surrogate, which serde_json refuses."""
    stack = [doc]
    while stack:
        v = stack.pop()
        if type(v) is str:
            if _SURROGATE.search(v):
                return v
        elif _is_object(v):
            for k, x in _items(v):  # type: ignore[arg-type]
                stack.append(k)
                stack.append(x)
        elif type(v) is list:
            stack.extend(v)
    return None


def _extra_refused(value: object, limit: int) -> str | None:
    """Why serde_json refuses ``value`` (an extra field's), if it does: nesting beyond ``limit``
    arrays/objects, or an integer beyond 64 bits that overflows a float (the fast decoder's ints)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if type(v) is list or _is_object(v):
            if depth > limit:
                return f"nests deeper than {_MAX_DEPTH} levels"
            items = [x for _, x in _items(v)] if _is_object(v) else v  # type: ignore[arg-type]
            stack.extend((x, depth + 1) for x in items)  # type: ignore[union-attr]
        elif type(v) is int and not -(2**63) <= v <= _U64_MAX and not _serde_f64_in_range(str(v)):
            return "holds a number that overflows a 64-bit float"
    return None


# ---------------------------------------------------------------------------------------------- read_header


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


def read_header(path: str | os.PathLike[str]) -> Shard:
    """Read and validate the safetensors header of ``path``; reads no tensor data.

    Accepts exactly what ``safetensors.safe_open`` accepts (see the module docstring). Tensors torch
    cannot hold are returned in :attr:`Shard.skipped`, the others in :attr:`Shard.tensors`.

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
    header = f"header JSON at offsets 8..{8 + n}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header byte at offset {8 + e.start} is not valid UTF-8 ({e.reason})") from None
    try:
        doc = _decode(text)
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

    data_start = 8 + n
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


# ---------------------------------------------------------------------------------------------- checkpoints


@dataclass
class Checkpoint:
    """A model directory's safetensors: shards (each parsed once) and every tensor by name.

    ``skipped``: tensors torch cannot hold (see :class:`SkippedTensor`), not in ``tensors``.
    ``index_missing``: names the index's ``weight_map`` lists that no shard holds (sorted).
    """

    root: Path
    shards: list[Shard]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    skipped: dict[str, SkippedTensor] = field(default_factory=dict)
    index_missing: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data in ``tensors`` (headers and skipped tensors excluded)."""
        return sum(t.nbytes for t in self.tensors.values())


INDEX_NAME = "model.safetensors.index.json"


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
    tensor name -> shard file name. The one index reader of tiered (the loader and ``tiered reshard``).

    Raises:
        HeaderError: unreadable, not JSON, no ``weight_map`` object, or one that does not map names to file names.
    """
    try:
        doc = json.loads(index.read_text())
        wm = doc["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeaderError(f"{index}: not a valid index (needs a 'weight_map' object): {e}; regenerate it") from None
    return wm


def _inside(root: Path, name: str, index: Path) -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ShardNotFoundError(f"{index}: shard name {name!r} must be a relative file name inside {root}")
    # Lexical check (no symlink resolution): a Hugging Face cache snapshot holds symlinks into ../../blobs.
    base = Path(os.path.abspath(root))
    p = Path(os.path.normpath(base / name))
    if base not in p.parents:
        raise ShardNotFoundError(f"{index}: shard {name!r} points outside {root}; fix the index's weight_map")
    return p


def index_shard_paths(root: Path, index: Path, names: Iterable[str]) -> list[Path]:
    """The shard files ``names`` of ``index``'s weight_map as paths inside ``root``, in the order given.

    The one path check of index shard names: every name must be relative and stay inside ``root``
    (checked lexically, without resolving symlinks: a Hugging Face cache snapshot's shards are
    symlinks into ``../../blobs``), and every file must exist.

    Raises:
        ShardNotFoundError: a name is absolute, empty or points outside ``root``; or a shard is missing.
    """
    names = list(names)
    paths = [_inside(root, n, index) for n in names]
    for n, p in zip(names, paths, strict=True):
        if not p.is_file():
            raise ShardNotFoundError(f"{index}: shard {n!r} is missing from {root}; re-download it")
    return paths


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir`` as a Path if it is an existing directory; else a :class:`ShardNotFoundError` that says
    what it is instead: missing, a file (a lone ``.safetensors``/``.gguf``/``.bin``), or a Hugging Face Hub id
    (tiered reads local directories only; nothing is downloaded)."""
    root = Path(model_dir)
    if root.is_dir():
        return root
    if root.exists():
        hint = ""
        if root.suffix in (".safetensors", ".bin", ".pt"):
            hint = f" (for a lone weight file, put it in a directory with its config.json: pass {str(root.parent)!r})"
        elif root.suffix == ".gguf":
            hint = (f" (a GGUF file: convert it once into a model directory, then pass that: "
                    f"tiered.reshard({str(root)!r}, {str(root.with_suffix(''))+'-tiered'!r}, dtype='bf16'))")
        raise ShardNotFoundError(f"{root} is a file, not a directory; pass the directory that holds config.json and "
                                 f"the weights{hint}")
    if _HUB_ID.fullmatch(str(model_dir)) and not str(model_dir).startswith((".", "~")):
        raise ShardNotFoundError(
            f"{str(model_dir)!r} is not a local directory; it looks like a Hugging Face Hub id. tiered reads local "
            f"directories and downloads nothing: fetch it first, e.g. huggingface_hub.snapshot_download({str(model_dir)!r}), "
            "and pass the directory it returns"
        )
    raise ShardNotFoundError(f"{root}: no such directory; pass a local Hugging Face model directory")


def open_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Parse every shard header of a Hugging Face model directory (no tensor data is read).

    Looks for ``model.safetensors.index.json`` (sharded), else ``model.safetensors``, else
    any ``*.safetensors`` files.

    With an index, the shards read are the files its ``weight_map`` names, and every tensor of
    those files is taken from where it actually is — as ``transformers`` 5 does, which loads every
    key of every shard the index lists. So a tensor the index puts in shard A but that lies in
    shard B (also listed) is simply found in B, and a tensor of a listed shard that the index
    omits is kept. Names the index lists that no shard holds are not an error here: they are
    recorded, sorted, in :attr:`Checkpoint.index_missing`, for the loader to warn about (unused)
    or refuse (needed). A tensor torch cannot hold is in :attr:`Checkpoint.skipped`, not missing.

    Raises:
        ShardNotFoundError: no safetensors file, or the index names a missing shard or one outside ``model_dir``.
        HeaderError / TruncatedShardError: a shard fails validation (see :func:`read_header`).
        DuplicateTensorError: a tensor name appears in two shards.
    """
    root = check_model_dir(model_dir)
    index = root / INDEX_NAME
    expected: dict[str, str] | None = None
    if index.exists():
        expected = read_index(index)
        paths = index_shard_paths(root, index, sorted(set(expected.values())))
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
        found: list[TensorInfo | SkippedTensor] = [*shard.tensors.values(), *shard.skipped.values()]
        for t in found:
            prev = ckpt.tensors.get(t.name) or ckpt.skipped.get(t.name)
            if prev is not None:
                raise DuplicateTensorError(
                    f"tensor {t.name!r} is in both {prev.file} (offset {prev.offset}) and {p} (offset {t.offset}); "
                    "remove one copy"
                )
            if isinstance(t, TensorInfo):
                ckpt.tensors[t.name] = t
            else:
                ckpt.skipped[t.name] = t
    if expected is not None:
        ckpt.index_missing = sorted(n for n in expected if n not in ckpt.tensors and n not in ckpt.skipped)
    return ckpt
