"""The header's JSON, decoded as safetensors' Rust core (``serde_json``) decodes it.

Two decoders (:data:`_FAST`: objects as dicts, integers as Python ints; :data:`_EXACT`: objects as
their ``(key, value)`` pairs in document order, integers as serde_json reads them) and the checks
Python's ``json`` does not make: numbers that overflow a 64-bit float with serde_json's own rounding,
lone UTF-16 surrogate escapes, nesting deeper than serde_json's recursion limit. Used by
:func:`tiered.format.read_header`; :class:`_Refused` carries a refusal out of the decoder's hooks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable

_U64_MAX = 2**64 - 1
_I32_MAX = 2**31 - 1
#: serde_json's recursion limit: 128 nested arrays/objects fail, the header's top-level object included.
_MAX_DEPTH = 127


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
