"""Differential fuzz test: tiered.format.read_header against safetensors.safe_open (framework="pt").

Files are random valid safetensors files (every spec dtype, zero-size and scalar tensors, huge
dimensions next to a 0, sub-byte dtypes, metadata, extra fields, serde's other spellings) to
which 0-3 mutations are applied: to the JSON document (dtypes, shape dims, offsets, fields, duplicate
keys, __metadata__, nesting, number and string literals serde_json treats its own way) or to the
bytes (the size field, padding, truncation, trailing bytes, invalid UTF-8, flipped bytes).

The property, for every file:

* safe_open accepts it  =>  read_header accepts it, and they agree on the tensor names, dtype
  strings, shapes, metadata and each tensor's bytes (``safetensors.deserialize``'s bytes equal the
  file's bytes at tiered's ``offset``/``nbytes``); a tensor torch cannot hold is in ``skipped``
  rather than ``tensors``, and only then;
* safe_open refuses it  =>  read_header raises a TieredError (HeaderError, TruncatedShardError);
* read_header raises nothing else, and returns within 20 s (no hang).

Known, deliberate differences from safetensors: none in what is accepted. (Tensors torch cannot
hold are accepted by both; tiered reports them in ``Shard.skipped``, which the property checks.)
Both decoders of tiered.format (the fast dict one and the exact pairs one it falls back to) are
exercised: each example picks one.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from safetensors import deserialize, safe_open

import tiered.format as fmt
from tiered.errors import TieredError
from tiered.format import DTYPES, SPEC_DTYPE_BITS, dtype_name, read_header

# ---------------------------------------------------------------------------------------------- a JSON model


class Raw(str):
    """A JSON token written as is (``-0``, ``1e400``, ``NaN``, ``"\\ud800"``)."""


@dataclass
class Obj:
    """A JSON object as pairs: keys may repeat."""

    pairs: list[tuple[str, object]] = field(default_factory=list)


def to_json(v: object, style: tuple[str, str, bool]) -> str:
    comma, colon, ascii_only = style
    if isinstance(v, Raw):
        return str(v)
    if v is None:
        return "null"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=ascii_only)
    if isinstance(v, list):
        return "[" + comma.join(to_json(x, style) for x in v) + "]"
    if isinstance(v, Obj):
        return "{" + comma.join(json.dumps(k, ensure_ascii=ascii_only) + colon + to_json(x, style) for k, x in v.pairs) + "}"
    raise TypeError(type(v))


def find(obj: Obj, key: str) -> int | None:
    for i, (k, _) in enumerate(obj.pairs):
        if k == key:
            return i
    return None


# ---------------------------------------------------------------------------------------------- valid files

ALPHABET = list("abcxyz.-0_9") + ["é", "层", "😀", " ", "\\", '"', "\x00"]
HUGE = [2**63 - 1, 2**63, 2**64 - 1]
STYLES = [(",", ":", True), (", ", ": ", False), (",\n  ", " : ", True), ("\t,", ":\r\n", False)]


# Empty tensors with large dimensions, around safetensors' rules (usize dims, checked products in order):
# some are valid, some are refused (2**64 is no usize; the product overflows before reaching the 0).
DEGENERATE = [
    [0, 2**64 - 1], [0, 2**63], [0, 2**64], [2**64, 0], [0, 2**33, 2**33], [2**33, 2**33, 0], [2**32, 2**31, 0],
    [2**32, 2**32, 0], [2**60, 2**3, 0], [2**60, 2**4, 0], [2**61, 2**2, 0], [2**61, 0], [2**62, 2**62, 0], [0] * 40,
    [1] * 70, [0, 2**63 - 1, 2**63 - 1],
]


def random_shape(r: random.Random, dtype: str) -> tuple[list[int], int]:
    """A shape for ``dtype`` and its byte count (mostly valid: some degenerate ones, some sub-byte misaligned)."""
    kind = r.choice(["small"] * 5 + ["scalar", "zero", "zero-huge", "degenerate"])
    shape = [] if kind == "scalar" else [r.randint(1, 4) for _ in range(r.randint(1, 4))]
    if kind == "zero":
        shape[r.randrange(len(shape))] = 0
    elif kind == "zero-huge":  # 0 first, then dims the product never reaches
        shape = [0, r.choice([*HUGE, 2**33, 7]), *shape[1:]]
    elif kind == "degenerate":
        shape = list(r.choice(DEGENERATE))
    bits = _numel(shape) * SPEC_DTYPE_BITS[dtype]
    if bits % 8 and r.random() < 0.8:  # sub-byte dtypes: make the byte count whole
        shape.append(2 if SPEC_DTYPE_BITS[dtype] == 4 else 4)
        bits = _numel(shape) * SPEC_DTYPE_BITS[dtype]
    return shape, (bits + r.choice([0, 7])) // 8  # misaligned: the byte count rounded down or up


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class Case:
    doc: object  # an Obj (the header), or anything after a top-level mutation
    data: bytes
    style: tuple[str, str, bool]
    pad: str = ""
    lead: str = ""
    byte_ops: list[tuple[str, object]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def tensors(self) -> list[tuple[int, str, Obj]]:
        if not isinstance(self.doc, Obj):
            return []
        return [(i, k, v) for i, (k, v) in enumerate(self.doc.pairs) if k != "__metadata__" and isinstance(v, Obj)]


def valid_case(r: random.Random) -> Case:
    names = list(dict.fromkeys("".join(r.choices(ALPHABET, k=r.randint(0, 8))) for _ in range(r.randint(0, 6))))
    specs = []
    for name in names:
        dt = r.choice(list(SPEC_DTYPE_BITS))
        shape, nbytes = random_shape(r, dt)
        specs.append((name, dt, shape, nbytes))
    order = r.sample(range(len(specs)), len(specs))  # the data section's order need not be the header's
    offsets, pos = {}, 0
    for i in order:
        offsets[i] = (pos, pos + specs[i][3])
        pos += specs[i][3]
    data = r.randbytes(pos)
    doc = Obj()
    meta = r.choice(["none", "none", "null", "empty", "map"])
    if meta != "none":
        value = {"null": None, "empty": Obj(), "map": Obj([("format", "pt"), ("note", "é-0 \\u")])}[meta]
        doc.pairs.append(("__metadata__", value))
    for i, (name, dt, shape, _) in enumerate(specs):
        b, e = offsets[i]
        form = r.choice(["object"] * 6 + ["array", "dtype-map", "extra", "reordered"])
        dtype: object = Obj([(dt, None)]) if form == "dtype-map" else dt
        fields = [("dtype", dtype), ("shape", list(shape)), ("data_offsets", [b, e])]
        if form == "reordered":
            r.shuffle(fields)
        if form == "extra":
            fields.insert(r.randint(0, 3), ("x", r.choice(EXTRA_VALUES_OK)))
        entry: object = [dtype, list(shape), [b, e]] if form == "array" else Obj(list(fields))
        doc.pairs.append((name, entry))
    if meta != "none" and r.random() < 0.5:  # __metadata__ anywhere among the tensors
        doc.pairs.insert(r.randint(0, len(doc.pairs) - 1), doc.pairs.pop(0))
    return Case(doc, data, r.choice(STYLES), " " * r.choice([0, 0, 1, 7]), r.choice(["", "", "\n", " \t"]))


EXTRA_VALUES_OK = [
    1, None, True, "x", [1, [2, Obj()]], Obj([("a", 1), ("a", 2)]), Raw("-0"), Raw("1.5e-3"), Raw("1e-400"),
    Raw("9" * 308), Raw("1.7976931348623157e308"), Raw("-18446744073709551616"), Raw('"\\ud83d\\ude00"'),
    Raw('"\\u0000\\/"'), Raw("[" * 125 + "]" * 125), Raw("18446744073709551616.5"),
]
EXTRA_VALUES_BAD = [
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("1.7976931348623158e308"), Raw("9" * 309),
    Raw("9" * 5000), Raw("1e2147483648"), Raw('"\\ud800"'), Raw('"\\udc00x"'), Raw('"a\x01"'), Raw("[" * 126 + "]" * 126),
    Raw("[" * 3000 + "]" * 3000), Raw("[1,]"), Raw("tru"), Raw("01"), Raw('"\\x"'),
]
DIMS = [
    0, 1, 3, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, Raw("-0"), True, Raw("1.0"), Raw("1e2"), "1", [1], None,
    Raw("1" + "0" * 400),
]
DTYPE_VALUES = [
    *SPEC_DTYPE_BITS, "F7", "f32", "F8_E4M3FN", "", "BF16 ", "C128", None, 1, ["F32"], Obj([("F32", None)]),
    Obj([("BF16", None), ("F32", None)]), Obj([("F32", 0)]), Obj(), Raw('"\\u0046\\u0033\\u0032"'), Raw('"\\ud800"'),
]


# ---------------------------------------------------------------------------------------------- mutations


def m_dtype(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        i = find(entry, "dtype")
        if i is not None:
            entry.pairs[i] = ("dtype", r.choice(DTYPE_VALUES))


def m_shape(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        i = find(entry, "shape")
        if i is None or not isinstance(entry.pairs[i][1], list):
            return
        shape = list(entry.pairs[i][1])
        op = r.choice(["set", "insert", "drop", "replace"])
        if op == "replace":
            entry.pairs[i] = ("shape", r.choice([None, "2", Obj([("0", 1)]), [], Raw("[[1]]")]))
            return
        dim = r.choice(DIMS)
        if op == "set" and shape:
            shape[r.randint(0, len(shape) - 1)] = dim
        elif op == "insert":
            shape.insert(r.randint(0, len(shape)), dim)
        elif shape:
            shape.pop(r.randint(0, len(shape) - 1))
        entry.pairs[i] = ("shape", shape)


def m_offsets(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        i = find(entry, "data_offsets")
        if i is None or not isinstance(entry.pairs[i][1], list) or len(entry.pairs[i][1]) != 2:
            return
        b, e = entry.pairs[i][1]
        op = r.choice(["nudge", "swap", "huge", "weird", "length"])
        if op == "nudge":
            k = r.choice([0, 1])
            d = r.choice([-8, -1, 1, 2, 8])
            new = [b, e]
            new[k] = new[k] + d if isinstance(new[k], int) else new[k]
            entry.pairs[i] = ("data_offsets", new)
        elif op == "swap":
            entry.pairs[i] = ("data_offsets", [e, b])
        elif op == "huge":
            entry.pairs[i] = ("data_offsets", [b, r.choice([2**64 - 1, 2**64, 2**63])])
        elif op == "weird":
            entry.pairs[i] = ("data_offsets", [r.choice([Raw("-0"), Raw("0.0"), False, None, "0"]), e])
        else:
            entry.pairs[i] = ("data_offsets", r.choice([[b], [b, e, e], None, Obj([("0", b), ("1", e)])]))


def m_extra(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        value = r.choice(EXTRA_VALUES_OK + EXTRA_VALUES_BAD)
        key = r.choice(["x", "extra", "__metadata__", "y"])
        entry.pairs.insert(r.randint(0, len(entry.pairs)), (key, value))


def m_drop_field(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        if entry.pairs:
            entry.pairs.pop(r.randint(0, len(entry.pairs) - 1))


def m_dup_field(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, _, entry = r.choice(ts)
        if entry.pairs:
            entry.pairs.insert(r.randint(0, len(entry.pairs)), r.choice(entry.pairs))


def m_dup_tensor(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        _, name, entry = r.choice(ts)
        op = r.choice(["same", "other", "zero", "invalid"])
        if op == "same":
            new: object = Obj(list(entry.pairs))
        elif op == "other":
            new = r.choice(ts)[2]
        elif op == "zero":
            new = Obj([("dtype", "F32"), ("shape", [0]), ("data_offsets", [0, 0])])
        else:
            new = Obj([("dtype", "XX"), ("shape", [0]), ("data_offsets", [0, 0])])
        case.doc.pairs.insert(r.randint(0, len(case.doc.pairs)), (name, new))  # type: ignore[union-attr]


def m_metadata(r: random.Random, case: Case) -> None:
    if not isinstance(case.doc, Obj):
        return
    value = r.choice([
        None, Obj(), [], "x", 1, Obj([("a", 1)]), Obj([("a", None)]), Obj([("a", "b"), ("a", "c")]),
        Obj([("a", Raw('"\\udc00"'))]), Obj([("dtype", "F32"), ("shape", "[1]")]),
    ])
    i = find(case.doc, "__metadata__")
    if i is not None and (r.random() < 0.5):
        case.doc.pairs[i] = ("__metadata__", value)
    else:
        case.doc.pairs.insert(r.randint(0, len(case.doc.pairs)), ("__metadata__", value))


def m_entry(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        i, name, entry = r.choice(ts)
        d = dict(entry.pairs)
        as_list = [d.get("dtype"), d.get("shape"), d.get("data_offsets")]
        value = r.choice([None, 1, "x", [], Obj(), as_list, as_list[:2], [*as_list, 0]])
        case.doc.pairs[i] = (name, value)  # type: ignore[union-attr]


def m_name(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        i, _, entry = r.choice(ts)
        case.doc.pairs[i] = (r.choice(["__metadata__", "\ud800", "a\udc00b", ""]), entry)  # type: ignore[union-attr]


def m_drop_tensor(r: random.Random, case: Case) -> None:
    ts = case.tensors()
    if ts:
        i, _, _ = r.choice(ts)
        case.doc.pairs.pop(i)  # type: ignore[union-attr]


def m_top(r: random.Random, case: Case) -> None:
    case.doc = r.choice([[], "x", None, 1, Raw("[{}]"), Raw(""), Raw("{} {}"), Raw("{},")])


def m_bytes(r: random.Random, case: Case) -> None:
    op = r.choice(["size", "size", "pad", "truncate", "trailing", "flip", "utf8", "bom", "tiny", "data"])
    if op == "size":
        arg: object = r.choice(["-1", "+1", "-8", "+8", "0", "cap", "cap+1", "huge", "max"])
    elif op == "pad":
        arg = r.choice([b" " * 3, b"\n\t\r ", b"\x00", b"\x0c", b" \x00 "])
    elif op == "truncate":
        arg = r.randint(0, 64)
    elif op == "trailing":
        arg = r.randbytes(r.randint(1, 9))
    elif op in ("flip", "utf8"):
        arg = (r.randint(0, 10_000), r.choice(SPLICE))
    elif op == "tiny":
        arg = r.randint(0, 7)
    else:
        arg = r.randint(-3, 3)
    case.byte_ops.append((op, arg))


# bytes spliced into the header: invalid UTF-8 (0xFF, an encoded surrogate, an overlong, > U+10FFFF, a lone
# continuation byte) and JSON punctuation
SPLICE = [b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80", b"{", b"}", b"\x00", b'"', b"\\", b"-"]

MUTATIONS = {
    "dtype": m_dtype, "shape": m_shape, "offsets": m_offsets, "extra": m_extra, "drop_field": m_drop_field,
    "dup_field": m_dup_field, "dup_tensor": m_dup_tensor, "metadata": m_metadata, "entry": m_entry, "name": m_name,
    "drop_tensor": m_drop_tensor, "top": m_top, "bytes": m_bytes,
}


def make_case(seed: int, mutations: list[str]) -> Case:
    """A valid file from ``seed``, then ``mutations`` applied in order (details drawn from the seed too:
    cheap to generate, and the seed reproduces a failure)."""
    r = random.Random(seed)
    case = valid_case(r)
    for name in mutations:
        MUTATIONS[name](r, case)
        case.labels.append(name)
    return case


cases = st.builds(
    make_case,
    seed=st.integers(0, 2**64 - 1),
    mutations=st.one_of(st.just([]), st.lists(st.sampled_from(list(MUTATIONS)), min_size=1, max_size=3)),
)


def render(case: Case) -> bytes:
    text = case.lead + to_json(case.doc, case.style) + case.pad
    header = text.encode("utf-8", "surrogatepass")  # lone surrogates in names become invalid UTF-8 (refused)
    data = case.data
    size: int | None = None
    for op, arg in case.byte_ops:
        if op == "pad":
            header += arg  # type: ignore[operator]
        elif op == "flip" or op == "utf8":
            at, b = arg  # type: ignore[misc]
            if header:
                at %= len(header)
                header = header[:at] + b + header[at + (1 if op == "flip" else 0):]
        elif op == "bom":
            header = "\ufeff".encode() + header
        elif op == "data":
            data = data[: max(0, len(data) + arg)] if arg < 0 else data + bytes(arg)  # type: ignore[operator]
        elif op == "size":
            size = {"-1": len(header) - 1, "+1": len(header) + 1, "-8": len(header) - 8, "+8": len(header) + 8, "0": 0,
                    "cap": 100_000_000, "cap+1": 100_000_001, "huge": 2**63, "max": 2**64 - 1}[arg]  # type: ignore[index]
            size = max(size, 0)
    blob = struct.pack("<Q", len(header) if size is None else size) + header + data
    for op, arg in case.byte_ops:
        if op == "truncate":
            blob = blob[: max(0, len(blob) - 1 - arg)]  # type: ignore[operator]
        elif op == "trailing":
            blob += arg  # type: ignore[operator]
        elif op == "tiny":
            blob = blob[:arg]  # type: ignore[misc]
    return blob


# ---------------------------------------------------------------------------------------------- the property


@contextlib.contextmanager
def time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise TimeoutError(f"read_header or safe_open ran over {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def reference(path: Path) -> dict | None:
    """safe_open's view of the file (None: refused)."""
    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
            got = {"metadata": f.metadata(), "tensors": {}}
            for k in keys:
                sl = f.get_slice(k)
                got["tensors"][k] = (sl.get_dtype(), tuple(sl.get_shape()))
    except Exception:
        return None
    got["data"] = {name: bytes(t["data"]) for name, t in deserialize(path.read_bytes())}
    return got


def check(path: Path, exact: bool) -> bool:
    """Assert the property for one file; returns whether safe_open accepted it."""
    with time_limit(20):
        ref = reference(path)
        saved = fmt._decode
        if exact:
            fmt._decode = fmt._EXACT.decode
        try:
            shard = read_header(path)
        except TieredError as e:
            assert ref is None, f"safe_open accepts {path} but read_header refuses it: {e}"
            assert str(path) in str(e)
            return False
        finally:
            fmt._decode = saved
    assert ref is not None, f"safe_open refuses {path} but read_header accepts it: {shard}"
    blob = path.read_bytes()
    mine = {n: (dtype_name(t.dtype), t.shape, t.offset, t.nbytes) for n, t in shard.tensors.items()}
    mine |= {n: (s.dtype_name, s.shape, s.offset, s.nbytes) for n, s in shard.skipped.items()}
    assert len(mine) == len(shard.tensors) + len(shard.skipped), "a tensor in both tensors and skipped"
    assert set(mine) == set(ref["tensors"]) == set(ref["data"])
    assert shard.metadata == ref["metadata"]
    for name, (dt, shape, offset, nbytes) in mine.items():
        assert (dt, shape) == ref["tensors"][name], name
        assert blob[offset : offset + nbytes] == ref["data"][name] and offset + nbytes <= len(blob), name
        torch_can = dt in DTYPES and all(d < 2**63 for d in shape)
        assert (name in shard.tensors) is torch_can, name
    for group in (shard.tensors, shard.skipped):
        offs = [(t.offset, t.offset + t.nbytes) for t in group.values()]
        assert offs == sorted(offs), "not in data-offset order"
    return True


_counter = iter(range(10**9))


def run_case(tmp_path: Path, case: Case, exact: bool) -> bool:
    path = tmp_path / f"f{next(_counter)}.safetensors"
    path.write_bytes(render(case))
    try:
        return check(path, exact)
    finally:
        path.unlink()


FUZZ = settings(
    max_examples=2500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(case=cases, exact=st.booleans())
def test_read_header_agrees_with_safe_open(tmp_path: Path, case: Case, exact: bool) -> None:
    for label in case.labels or ["valid"]:
        event(f"mutation: {label}")
    accepted = run_case(tmp_path, case, exact)
    event("safe_open: accepted" if accepted else "safe_open: refused")


def test_fuzz_generator_covers_both_outcomes(tmp_path: Path) -> None:
    """Deterministic: the generator must produce accepted and refused files, through every mutation,
    and accepted files with the interesting features (else the fuzz test above proves little)."""
    stats: Counter[str] = Counter()

    @settings(
        max_examples=400, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, exact=st.booleans())
    def run(case: Case, exact: bool) -> None:
        accepted = run_case(tmp_path, case, exact)
        stats["accepted" if accepted else "refused"] += 1
        for label in case.labels:
            stats[f"{label}:{'accepted' if accepted else 'refused'}"] += 1
        if accepted and isinstance(case.doc, Obj):
            shard = read_header_of(case)
            stats["accepted with skipped"] += bool(shard.skipped)
            stats["accepted with empty tensor"] += any(t.nbytes == 0 for t in shard.tensors.values())
            stats["accepted with scalar"] += any(t.shape == () for t in shard.tensors.values())
        stats["exact decoder"] += exact

    def read_header_of(case: Case):
        path = tmp_path / "again.safetensors"
        path.write_bytes(render(case))
        try:
            return read_header(path)
        finally:
            path.unlink()

    run()
    total = stats["accepted"] + stats["refused"]
    assert total >= 300, stats
    assert stats["accepted"] >= total // 5 and stats["refused"] >= total // 5, stats
    for label in MUTATIONS:
        assert stats[f"{label}:refused"] > 0, f"mutation {label} never refused: {stats}"
    for label in ("dtype", "shape", "extra", "dup_tensor", "metadata", "bytes"):
        assert stats[f"{label}:accepted"] > 0, f"mutation {label} never kept a file valid: {stats}"
    for feature in ("accepted with skipped", "accepted with empty tensor", "accepted with scalar", "exact decoder"):
        assert stats[feature] > 0, f"no example {feature}: {stats}"


# ---------------------------------------------------------------------------------------------- curated values, each one


_NO_EXTRA = object()


def one_tensor(tmp_path: Path, dtype: object = "F32", shape: object = (1,), offsets: object = (0, 4), nbytes: int = 4,
               extra: object = _NO_EXTRA, exact: bool = False) -> bool:
    """Check the property on a file of one tensor ``t`` (4 bytes of F32 unless told); True: accepted."""
    fields = [("dtype", dtype), ("shape", list(shape) if isinstance(shape, tuple) else shape),
              ("data_offsets", list(offsets) if isinstance(offsets, tuple) else offsets)]
    if extra is not _NO_EXTRA:
        fields.append(("x", extra))
    case = Case(Obj([("t", Obj(fields))]), bytes(nbytes), STYLES[0])
    return run_case(tmp_path, case, exact)


def _id(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 24 else r[:21] + "..."


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("value", EXTRA_VALUES_OK + EXTRA_VALUES_BAD, ids=_id)
def test_every_curated_extra_value(value: object, exact: bool, tmp_path: Path) -> None:
    """Each literal the generator picks from, in an extra field of an otherwise valid file (the
    fuzz test may not draw every one in a run)."""
    assert one_tensor(tmp_path, extra=value, exact=exact) is (value in EXTRA_VALUES_OK)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("dim", DIMS, ids=_id)
def test_every_curated_dim(dim: object, exact: bool, tmp_path: Path) -> None:
    one_tensor(tmp_path, shape=[0, dim], offsets=(0, 0), nbytes=0, exact=exact)  # an empty tensor: any usize fits
    one_tensor(tmp_path, shape=[dim], exact=exact)
    one_tensor(tmp_path, offsets=[dim, 4] if dim != 0 else (0, 4), exact=exact)


@pytest.mark.parametrize("dtype", DTYPE_VALUES, ids=_id)
def test_every_curated_dtype(dtype: object, tmp_path: Path) -> None:
    name = dtype if isinstance(dtype, str) else None
    nbytes = SPEC_DTYPE_BITS.get(name, 8) if name else 8  # 8 elements: whole bytes for every dtype
    one_tensor(tmp_path, dtype=dtype, shape=(8,), offsets=(0, nbytes), nbytes=nbytes)


@pytest.mark.parametrize("dtype", ["U8", "F4", "F64", "C64"])
@pytest.mark.parametrize("shape", DEGENERATE, ids=_id)
def test_every_degenerate_shape(shape: list[int], dtype: str, tmp_path: Path) -> None:
    one_tensor(tmp_path, dtype=dtype, shape=shape, offsets=(0, 0), nbytes=0)


@pytest.mark.parametrize(
    ("dtype", "n", "nbytes"), [("F4", 3, 1), ("F4", 3, 2), ("F6_E2M3", 2, 1), ("F6_E3M2", 5, 4), ("F6_E3M2", 3, 3)]
)
def test_misaligned_sub_byte(dtype: str, n: int, nbytes: int, tmp_path: Path) -> None:
    assert not one_tensor(tmp_path, dtype=dtype, shape=(n,), offsets=(0, nbytes), nbytes=nbytes)
