"""safetensors header validation (tiered.format) against files written by safetensors and crafted bad ones."""

from __future__ import annotations

import json
import os
import struct
from contextlib import nullcontext
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import logits_of, make_ids
from safetensors import safe_open
from safetensors.torch import save_file

from tiered.errors import (
    ConfigError,
    DuplicateTensorError,
    HeaderError,
    ShardNotFoundError,
    TieredError,
    TruncatedShardError,
)
from tiered.format import DTYPES, INDEX_NAME, MAX_HEADER_SIZE, SPEC_DTYPE_BITS, SkippedTensor, open_checkpoint, read_header

# ---------------------------------------------------------------------------------------------- helpers


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", *, n: int | None = None) -> Path:
    """Write ``path`` byte by byte: 8-byte LE header size (``n`` overrides it), the header, the data section."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if n is None else n) + h + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "d.i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "e.u8": torch.randint(0, 255, (9,), generator=g).to(torch.uint8),
        "f.bool": torch.tensor([True, False, True]),
        "g.scalar": torch.tensor(1.5, dtype=torch.float64),
        "h.empty": torch.empty(0, 4),
        "i.i8": torch.randint(-100, 100, (5,), generator=g).to(torch.int8),
    }


def assert_names_file(err: pytest.ExceptionInfo, path: Path, *also: str) -> None:
    msg = str(err.value)
    assert str(path) in msg or path.name in msg, f"message does not name {path}: {msg}"
    for s in also:
        assert s in msg, f"message does not name {s!r}: {msg}"


# ---------------------------------------------------------------------------------------------- valid files


def test_read_header_equals_safe_open(tmp_path: Path) -> None:
    tensors = sample_tensors()
    p = tmp_path / "ok.safetensors"
    save_file(tensors, p, metadata={"format": "pt", "note": "x"})
    shard = read_header(p)
    assert shard.path == p and shard.file_size == p.stat().st_size
    assert shard.metadata == {"format": "pt", "note": "x"}
    with safe_open(p, "pt") as f:
        assert set(shard.tensors) == set(f.keys())
        for name in f.keys():
            info, ref = shard.tensors[name], f.get_tensor(name)
            assert info.name == name
            assert info.shape == tuple(ref.shape), name
            assert info.dtype == ref.dtype, name
            assert info.nbytes == ref.numel() * ref.element_size()
            assert info.file == p
    # offsets are absolute and point at the tensor's bytes
    blob = p.read_bytes()
    for name, t in tensors.items():
        info = shard.tensors[name]
        got = blob[info.offset : info.offset + info.nbytes]
        assert got == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else got == b"", name
    # in data-offset order, starting at the data section
    offs = [t.offset for t in shard.tensors.values()]
    assert offs == sorted(offs) and offs[0] == shard.data_start


def test_read_header_no_metadata_and_padding(tmp_path: Path) -> None:
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    h = json.dumps({"x": entry("F32", [2, 3], 0, 24)}).encode() + b"     "  # padded with spaces, as allowed
    p = raw_file(tmp_path / "pad.safetensors", h, data)
    shard = read_header(p)
    assert shard.metadata is None
    assert shard.data_start == 8 + len(h)
    assert shard.tensors["x"].offset == 8 + len(h) and shard.tensors["x"].shape == (2, 3)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips(name: str, tmp_path: Path) -> None:
    dt = DTYPES[name]
    n = 2 * dt.itemsize
    p = raw_file(tmp_path / "d.safetensors", {"t": entry(name, [2], 0, n)}, bytes(range(n)))
    assert read_header(p).tensors["t"].dtype == dt


def test_models_written_by_save_pretrained(ckpts) -> None:
    d = ckpts["llama"]
    ck = open_checkpoint(d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(ck.tensors) == set(idx)
    for name, t in ck.tensors.items():
        assert t.file.name == idx[name]
    assert ck.nbytes == sum(t.nbytes for t in ck.tensors.values()) > 0


# ---------------------------------------------------------------------------------------------- bad headers


def test_file_shorter_than_size_field(tmp_path: Path) -> None:
    p = tmp_path / "tiny.safetensors"
    p.write_bytes(b"\x10\x00\x00")
    with pytest.raises(TruncatedShardError) as e:
        read_header(p)
    assert_names_file(e, p)


def test_header_size_larger_than_file(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "big.safetensors", b'{"a": 1}', n=10_000)
    with pytest.raises(TruncatedShardError) as e:
        read_header(p)
    assert_names_file(e, p, "10000")


def test_header_size_cap(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "cap.safetensors", b"{}", n=MAX_HEADER_SIZE + 1)
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert not isinstance(e.value, TruncatedShardError)
    assert_names_file(e, p, str(MAX_HEADER_SIZE))


@pytest.mark.parametrize("header", [b"not json at all", b"\xff\xfe{}", b'{"a": ', b"[1, 2, 3]", b'"str"'])
def test_header_not_json_object(header: bytes, tmp_path: Path) -> None:
    p = raw_file(tmp_path / "nj.safetensors", header)
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert_names_file(e, p)


def test_unknown_dtype(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "dt.safetensors", {"w": entry("F7", [2], 0, 2)}, b"\0\0")
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert_names_file(e, p, "'w'", "F7")


@pytest.mark.parametrize("shape", [[-1, 2], [True, 2], [2.0], "2", [None], {"0": 1}])
def test_bad_shape(shape, tmp_path: Path) -> None:
    p = raw_file(tmp_path / "sh.safetensors", {"w": entry("F32", shape, 0, 8)}, bytes(8))
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert_names_file(e, p, "'w'")


@pytest.mark.parametrize("offsets", [[0, 12], [0, 4], [4, 0], [0], [0, 8, 16], [False, 8], [0.0, 8], "0-8", [-8, 0]])
def test_offsets_not_matching_shape(offsets, tmp_path: Path) -> None:
    p = raw_file(tmp_path / "of.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, bytes(8))
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert_names_file(e, p, "'w'")


def test_entry_with_extra_or_missing_fields(tmp_path: Path) -> None:
    # Extra per-tensor fields: safetensors ignores them (serde without deny_unknown_fields), so tiered does too.
    e1 = entry("F32", [2], 0, 8) | {"extra": 1}
    p = raw_file(tmp_path / "x.safetensors", {"w": e1}, bytes(8))
    with safe_open(p, "pt") as f:
        assert list(f.keys()) == ["w"]
    assert read_header(p).tensors["w"].shape == (2,)
    p = raw_file(tmp_path / "y.safetensors", {"w": {"dtype": "F32", "shape": [2]}}, bytes(8))
    with pytest.raises(HeaderError, match="'w'"):
        read_header(p)
    p = raw_file(tmp_path / "z.safetensors", {"w": [1, 2]}, bytes(8))
    with pytest.raises(HeaderError, match="'w'"):
        read_header(p)


def test_bad_metadata(tmp_path: Path) -> None:
    h = {"__metadata__": {"format": 1}, "w": entry("F32", [2], 0, 8)}
    p = raw_file(tmp_path / "md.safetensors", h, bytes(8))
    with pytest.raises(HeaderError) as e:
        read_header(p)
    assert_names_file(e, p, "__metadata__")


def test_hole(tmp_path: Path) -> None:
    h = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}
    p = raw_file(tmp_path / "hole.safetensors", h, bytes(20))
    with pytest.raises(HeaderError, match="hole") as e:
        read_header(p)
    assert not isinstance(e.value, TruncatedShardError)
    assert_names_file(e, p, "'b'")


def test_hole_at_start(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "hole0.safetensors", {"a": entry("F32", [2], 4, 12)}, bytes(12))
    with pytest.raises(HeaderError, match="hole") as e:
        read_header(p)
    assert_names_file(e, p, "'a'")


def test_overlap(tmp_path: Path) -> None:
    h = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}
    p = raw_file(tmp_path / "ov.safetensors", h, bytes(12))
    with pytest.raises(HeaderError, match="overlap") as e:
        read_header(p)
    assert_names_file(e, p, "'b'")


def test_same_offsets_twice(tmp_path: Path) -> None:
    h = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 0, 8)}
    p = raw_file(tmp_path / "dup.safetensors", h, bytes(8))
    with pytest.raises(HeaderError, match="overlap"):
        read_header(p)


def test_trailing_bytes(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "tr.safetensors", {"a": entry("F32", [2], 0, 8)}, bytes(8 + 3))
    with pytest.raises(HeaderError, match="trailing") as e:
        read_header(p)
    assert not isinstance(e.value, TruncatedShardError)
    assert_names_file(e, p, "3")


def test_trailing_bytes_after_empty_header(tmp_path: Path) -> None:
    p = raw_file(tmp_path / "tr0.safetensors", {}, bytes(5))
    with pytest.raises(HeaderError, match="trailing"):
        read_header(p)


@pytest.mark.parametrize("cut", [1, 100, "data"])
def test_truncated_data_section(cut, tmp_path: Path) -> None:
    p = tmp_path / "cut.safetensors"
    save_file(sample_tensors(), p)
    full = p.read_bytes()
    shard = read_header(p)
    keep = shard.data_start if cut == "data" else len(full) - cut
    p.write_bytes(full[:keep])
    with pytest.raises(TruncatedShardError) as e:
        read_header(p)
    assert_names_file(e, p)
    assert "truncated" in str(e.value)


def test_truncated_inside_header(tmp_path: Path) -> None:
    p = tmp_path / "cuth.safetensors"
    save_file(sample_tensors(), p)
    full = p.read_bytes()
    p.write_bytes(full[:20])
    with pytest.raises(TruncatedShardError) as e:
        read_header(p)
    assert_names_file(e, p)


def test_errors_are_tiered_errors() -> None:
    for cls in (HeaderError, TruncatedShardError, ShardNotFoundError, DuplicateTensorError):
        assert issubclass(cls, TieredError)
    assert issubclass(TruncatedShardError, HeaderError)


# ---------------------------------------------------------------------------------------------- checkpoints


def write_sharded(root: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None):
    """Write each shard with safetensors and an index (``weight_map`` overrides the true one)."""
    root.mkdir(parents=True, exist_ok=True)
    true_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, root / fname)
        true_map.update({k: fname for k in tensors})
    doc = {"metadata": {"total_size": 0}, "weight_map": true_map if weight_map is None else weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(doc))
    return root


def two_shards() -> dict[str, dict[str, torch.Tensor]]:
    t = sample_tensors()
    names = sorted(t)
    return {
        "model-00001-of-00002.safetensors": {k: t[k] for k in names[:4]},
        "model-00002-of-00002.safetensors": {k: t[k] for k in names[4:]},
    }


def test_open_sharded_checkpoint(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "m", two_shards())
    ck = open_checkpoint(root)
    assert len(ck.shards) == 2
    assert set(ck.tensors) == set(sample_tensors())
    assert ck.tensors["a.weight"].file.name == "model-00001-of-00002.safetensors"


def test_open_single_file_and_glob(tmp_path: Path) -> None:
    save_file(sample_tensors(), tmp_path / "model.safetensors")
    assert set(open_checkpoint(tmp_path).tensors) == set(sample_tensors())
    other = tmp_path / "other"
    other.mkdir()
    save_file({"x": torch.ones(2)}, other / "weights.safetensors")
    assert set(open_checkpoint(other).tensors) == {"x"}


def test_index_names_missing_shard(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "m", two_shards())
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ShardNotFoundError) as e:
        open_checkpoint(root)
    assert_names_file(e, root / "model.safetensors.index.json", "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("bad", ["../x.safetensors", "sub/../../x.safetensors", "ABS"])
def test_shard_path_escaping_dir(bad: str, tmp_path: Path) -> None:
    outside = tmp_path / "x.safetensors"
    save_file({"secret": torch.ones(3)}, outside)  # it exists: it must still not be read
    if bad == "ABS":
        bad = str(outside)
    root = tmp_path / "m"
    write_sharded(root, {"model-1.safetensors": {"a": torch.ones(2)}}, {"a": "model-1.safetensors", "secret": bad})
    with pytest.raises(ShardNotFoundError) as e:
        open_checkpoint(root)
    assert_names_file(e, root / "model.safetensors.index.json", bad)


def test_hf_cache_symlinked_shards(tmp_path: Path) -> None:
    """The Hugging Face hub cache layout: snapshots/<rev>/<shard> are symlinks to ../../blobs/<hash>.

    The shard *names* stay inside the directory; their targets do not. from_pretrained loads such a
    directory, and so must tiered (it is where every downloaded checkpoint lives).
    """
    src = write_sharded(tmp_path / "src", two_shards())
    blobs = tmp_path / "cache" / "blobs"
    snap = tmp_path / "cache" / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = blobs / f"{i:040x}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    ck = open_checkpoint(snap)
    assert set(ck.tensors) == set(sample_tensors())


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    shards = two_shards()
    shards["model-00002-of-00002.safetensors"]["a.weight"] = torch.zeros(3, 5)
    root = write_sharded(tmp_path / "m", shards)
    with pytest.raises(DuplicateTensorError) as e:
        open_checkpoint(root)
    msg = str(e.value)
    assert "'a.weight'" in msg
    assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg


def test_duplicate_tensor_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "two.safetensors")
    with pytest.raises(DuplicateTensorError, match="'a'"):
        open_checkpoint(tmp_path)


def test_index_disagrees_with_shards(tmp_path: Path) -> None:
    """The index is a list of shards to read, not an authority on where each tensor is.

    transformers 5 loads every key of every shard the index lists (``safe_open(...).keys()``), so a
    tensor the index puts in the wrong (listed) shard loads from where it is, and a name no shard
    holds is reported in ``index_missing`` for the loader to judge (it used to raise HeaderError).
    """
    shards = two_shards()
    wm = {k: f for f, ts in shards.items() for k in ts}
    wm["a.weight"] = "model-00002-of-00002.safetensors"  # it is really in shard 1
    root = write_sharded(tmp_path / "m", shards, wm)
    ck = open_checkpoint(root)
    assert ck.tensors["a.weight"].file.name == "model-00001-of-00002.safetensors"
    assert ck.index_missing == []
    assert set(ck.tensors) == set(sample_tensors())
    wm = {k: f for f, ts in shards.items() for k in ts} | {
        "ghost": "model-00001-of-00002.safetensors",
        "another.ghost": "model-00002-of-00002.safetensors",
    }
    root = write_sharded(tmp_path / "m2", shards, wm)
    ck = open_checkpoint(root)
    assert ck.index_missing == ["another.ghost", "ghost"]
    assert set(ck.tensors) == set(sample_tensors()) and ck.skipped == {}


def test_index_omits_a_tensor_of_a_listed_shard(tmp_path: Path) -> None:
    shards = two_shards()
    wm = {k: f for f, ts in shards.items() for k in ts}
    del wm["a.weight"]  # still in shard 1, which the index lists: transformers loads it, so does tiered
    root = write_sharded(tmp_path / "m", shards, wm)
    ck = open_checkpoint(root)
    assert "a.weight" in ck.tensors and ck.index_missing == []


def test_no_index_means_no_index_missing(tmp_path: Path) -> None:
    save_file(sample_tensors(), tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).index_missing == []


@pytest.mark.parametrize("doc", ["{not json", "[]", '{"metadata": {}}', '{"weight_map": [1]}'])
def test_bad_index(doc: str, tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(doc)
    with pytest.raises(HeaderError) as e:
        open_checkpoint(tmp_path)
    assert_names_file(e, tmp_path / "model.safetensors.index.json")


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ShardNotFoundError):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(ShardNotFoundError) as e:
        open_checkpoint(tmp_path)
    assert_names_file(e, tmp_path)
    torch.save({"a": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ShardNotFoundError, match="pytorch_model.bin"):
        open_checkpoint(tmp_path)


def test_bad_shard_inside_checkpoint_names_it(tmp_path: Path) -> None:
    root = write_sharded(tmp_path / "m", two_shards())
    bad = root / "model-00002-of-00002.safetensors"
    bad.write_bytes(bad.read_bytes()[:-7])
    with pytest.raises(TruncatedShardError) as e:
        open_checkpoint(root)
    assert_names_file(e, bad)


# ---------------------------------------------------------------------------------------------- spec dtypes, skipped


def safe_open_accepts(path: Path) -> bool:
    try:
        with safe_open(path, "pt") as f:
            f.keys()
        return True
    except Exception:
        return False


def test_spec_dtype_list_is_safetensors_own() -> None:
    """SPEC_DTYPE_BITS names exactly the dtypes the installed safetensors knows (its error lists them)."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = raw_file(Path(d) / "x.safetensors", {"t": entry("NOPE", [0], 0, 0)})
        with pytest.raises(Exception) as e, safe_open(p, "pt"):
            pass
    known = re.findall(r"`([A-Z0-9_]+)`", str(e.value).split("expected one of", 1)[1])
    assert known == list(SPEC_DTYPE_BITS)


@pytest.mark.parametrize("name", list(SPEC_DTYPE_BITS))
def test_every_spec_dtype_is_accepted(name: str, tmp_path: Path) -> None:
    bits = SPEC_DTYPE_BITS[name]
    n = bits  # 8 elements: a whole number of bytes for every dtype
    p = raw_file(tmp_path / "d.safetensors", {"t": entry(name, [8], 0, n)}, bytes(range(n)))
    assert safe_open_accepts(p)
    shard = read_header(p)
    if name in DTYPES:
        t = shard.tensors["t"]
        assert t.dtype == DTYPES[name] and t.nbytes == n and t.offset == shard.data_start and not shard.skipped
        with safe_open(p, "pt") as f:
            assert f.get_tensor("t").dtype == t.dtype
    else:
        s = shard.skipped["t"]
        assert s == SkippedTensor("t", name, (8,), p, shard.data_start, n) and not shard.tensors
        assert name in s.reason


def test_dtypes_torch_has_are_normal_tensors() -> None:
    assert DTYPES["C64"] is torch.complex64
    for name, attr in [("F8_E8M0", "float8_e8m0fnu"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")]:
        if hasattr(torch, attr):
            assert DTYPES[name] is getattr(torch, attr)
    # sub-byte dtypes are never torch tensors here: torch.float4_e2m1fn_x2 packs two per byte (another shape)
    assert not {"F4", "F6_E2M3", "F6_E3M2"} & set(DTYPES)
    assert set(DTYPES) <= set(SPEC_DTYPE_BITS)


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "ok"),
    [
        ("F4", [4], 2, True),
        ("F4", [2, 3], 3, True),
        ("F4", [3], 2, False),  # 12 bits: not a whole number of bytes
        ("F4", [1], 0, False),
        ("F6_E2M3", [4], 3, True),
        ("F6_E3M2", [2, 2], 3, True),
        ("F6_E3M2", [2], 2, False),  # 12 bits
        ("F6_E2M3", [0, 3], 0, True),
    ],
)
def test_sub_byte_dtypes(dtype: str, shape: list, nbytes: int, ok: bool, tmp_path: Path) -> None:
    p = raw_file(tmp_path / "s.safetensors", {"q": entry(dtype, shape, 0, nbytes)}, bytes(nbytes))
    assert safe_open_accepts(p) is ok
    if ok:
        shard = read_header(p)
        assert shard.skipped["q"] == SkippedTensor("q", dtype, tuple(shape), p, shard.data_start, nbytes)
        assert "packs" in shard.skipped["q"].reason
    else:
        with pytest.raises(HeaderError) as e:
            read_header(p)
        assert_names_file(e, p, "'q'", "whole number of bytes", "offset")


def test_skipped_tensors_count_in_the_cover(tmp_path: Path) -> None:
    h = {"a": entry("F32", [2], 0, 8), "q": entry("F4", [6], 8, 11), "r": entry("F6_E2M3", [4], 11, 14),
         "b": entry("F8_E8M0", [2], 14, 16)}
    p = raw_file(tmp_path / "mx.safetensors", h, bytes(range(16)))
    assert safe_open_accepts(p)
    shard = read_header(p)
    assert list(shard.tensors) == ["a", "b"] and list(shard.skipped) == ["q", "r"]
    assert shard.skipped["q"].offset == shard.data_start + 8 and shard.skipped["q"].nbytes == 3
    assert shard.skipped["r"].offset == shard.data_start + 11 and shard.skipped["r"].file == p
    del h["q"]  # its bytes become a hole
    p = raw_file(tmp_path / "mx2.safetensors", h, bytes(range(16)))
    assert not safe_open_accepts(p)
    with pytest.raises(HeaderError, match="hole") as e:
        read_header(p)
    assert_names_file(e, p, "'r'")


# ---------------------------------------------------------------------------------------------- degenerate shapes


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "where"),
    [
        ("F32", [], 4, "tensors"),  # scalar
        ("F32", [0], 0, "tensors"),
        ("F32", [0, 4], 0, "tensors"),
        ("BF16", [3, 0, 5], 0, "tensors"),
        ("F32", [0, 2**63 - 1], 0, "tensors"),
        ("U8", [0, 2**33, 2**33], 0, "tensors"),  # 0 first: the product never overflows
        ("U8", [2**32, 2**31, 0], 0, "tensors"),  # 2**63 fits 64 bits
        ("F64", [2**61, 0], 0, "tensors"),
        ("F32", [0, 2**63], 0, "skipped"),  # torch sizes are int64: an empty tensor torch cannot shape
        ("F32", [0, 2**64 - 1], 0, "skipped"),
        ("F32", [0, 2**64], 0, "refused"),  # not a usize
        ("U8", [2**33, 2**33, 0], 0, "refused"),  # overflows before the 0
        ("U8", [2**60, 2**4, 0], 0, "refused"),
        ("F64", [2**61], 2**64 - 8, "refused"),  # numel * 64 bits overflows
        ("F32", [1] * 64, 4, "tensors"),
    ],
)
def test_degenerate_shapes_as_safetensors(dtype: str, shape: list, nbytes: int, where: str, tmp_path: Path) -> None:
    data = bytes(nbytes) if nbytes < 2**20 else b""
    p = raw_file(tmp_path / "z.safetensors", {"t": entry(dtype, shape, 0, nbytes)}, data)
    assert safe_open_accepts(p) is (where != "refused")
    if where == "refused":
        with pytest.raises(HeaderError) as e:
            read_header(p)
        assert_names_file(e, p, "'t'")
        return
    shard = read_header(p)
    got = shard.tensors if where == "tensors" else shard.skipped
    assert got["t"].shape == tuple(shape) and got["t"].nbytes == nbytes and got["t"].offset == shard.data_start
    if where == "tensors":
        with safe_open(p, "pt") as f:
            ref = f.get_tensor("t")
        assert tuple(ref.shape) == shard.tensors["t"].shape and ref.dtype == shard.tensors["t"].dtype
    else:
        assert "2**63" in shard.skipped["t"].reason


# ---------------------------------------------------------------------------------------------- serde_json's rules

_OK = '{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]%s}}'
_EXTRA = lambda v: _OK % (', "x": ' + v)  # noqa: E731


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        # numbers: shape dims and offsets are usize; -0 is a float to serde_json
        ('{"t": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}', False),
        ('{"t": {"dtype": "F32", "shape": [0], "data_offsets": [-0, 0]}}', False),
        ('{"t": {"dtype": "F32", "shape": [1e0], "data_offsets": [0, 4]}}', False),
        (_EXTRA("-0"), True),
        (_EXTRA("1e-400"), True),
        (_EXTRA("NaN"), False),
        (_EXTRA("-Infinity"), False),
        (_EXTRA("1e400"), False),
        (_EXTRA("1.7976931348623157e308"), True),
        (_EXTRA("1.7976931348623158e308"), False),  # serde_json's rounding, not Python's
        (_EXTRA("17976931348623158e292"), False),
        (_EXTRA("9" * 308), True),
        (_EXTRA("9" * 309), False),
        (_EXTRA("9" * 5000), False),  # beyond Python's int() digit limit
        (_EXTRA("18446744073709551616.5"), True),
        (_EXTRA("1e2147483648"), False),
        (_EXTRA("0e2147483648"), True),
        (_EXTRA("-18446744073709551616"), True),
        # strings
        (_EXTRA('"\\ud800"'), False),
        (_EXTRA('"\\udc00\\ud800"'), False),
        (_EXTRA('"\\ud83d\\ude00"'), True),
        ('{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', False),
        (_EXTRA('"a\\u0000b"'), True),
        (_EXTRA('"a\tb"'), False),  # raw control character
        # nesting: serde_json's limit is 128 levels, the top-level object included
        (_EXTRA("[" * 125 + "]" * 125), True),
        (_EXTRA("[" * 126 + "]" * 126), False),
        (_EXTRA("[" * 5000 + "]" * 5000), False),  # beyond Python's recursion limit
        # duplicate keys
        ('{"t": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', False),
        (_EXTRA('1, "x": 2'), True),
        ('{"__metadata__": {}, "__metadata__": {}}', False),
        ('{"__metadata__": {"a": "b", "a": "c"}}', True),
        ('{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
         '"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', True),  # the last one wins
        ('{"t": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}, '
         '"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', False),  # ... each is type-checked
        # serde's other spellings of a TensorInfo and of a dtype
        ('{"t": ["F32", [1], [0, 4]]}', True),
        ('{"t": ["F32", [1], [0, 4], 0]}', False),
        ('{"t": {"dtype": {"F32": null}, "shape": [1], "data_offsets": [0, 4]}}', True),
        ('{"t": {"dtype": {"F32": null, "F32": null}, "shape": [1], "data_offsets": [0, 4]}}', False),
        ('{"t": {"dtype": {"F32": 0}, "shape": [1], "data_offsets": [0, 4]}}', False),
        ('{"t": {"dtype": "\\u0046\\u0033\\u0032", "shape": [1], "data_offsets": [0, 4]}}', True),
        # metadata
        ('{"__metadata__": null, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', True),
        ('{"__metadata__": {"a": null}}', False),
        ('{"__metadata__": []}', False),
        # whitespace: JSON's four only
        (' \t\r\n{}\n ', True),
        ('{}\x0c', False),
        ('\ufeff{}', False),
    ],
)
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_serde_json_rules(header: str, accepted: bool, exact: bool, tmp_path: Path, monkeypatch) -> None:
    """Each case is checked against safe_open too, so a change in safetensors shows up here."""
    import tiered.format as fmt

    if exact:  # the fallback decoder must agree with the fast one
        monkeypatch.setattr(fmt, "_decode", fmt._EXACT.decode)
    h = header.encode("utf-8", "surrogatepass")
    data = bytes(4) if '"t"' in header and "[0, 4]" in header else b""
    p = raw_file(tmp_path / "j.safetensors", h, data)
    assert safe_open_accepts(p) is accepted, "safetensors changed its rules"
    if accepted:
        read_header(p)
    else:
        with pytest.raises(HeaderError) as e:
            read_header(p)
        assert_names_file(e, p)


def test_new_messages_name_file_tensor_offset(tmp_path: Path) -> None:
    cases = {
        "F4 odd": ({"a": entry("F32", [1], 0, 4), "w": entry("F4", [3], 4, 6)}, 6, ["'w'", "offset", "whole number of bytes"]),
        "overflow": ({"w": entry("U8", [2**33, 2**33, 0], 0, 0)}, 0, ["'w'", "offset", "overflows"]),
        "span": ({"w": entry("F32", [2], 0, 4)}, 4, ["'w'", "offset", "needs 8"]),
        "dup field": ('{"w": {"dtype": "F32", "shape": [1], "shape": [1], "data_offsets": [0, 4]}}', 4, ["'w'", "8..", "twice"]),
        "dtype": ({"w": entry("F7", [1], 0, 4)}, 4, ["'w'", "8..", "F7", "F8_E8M0"]),
    }
    for label, (h, n, words) in cases.items():
        p = raw_file(tmp_path / f"{label}.safetensors", h if isinstance(h, dict) else h.encode(), bytes(n))
        with pytest.raises(HeaderError) as e:
            read_header(p)
        assert_names_file(e, p, *words)
        assert ";" in str(e.value)  # "...; how to fix it"


# ---------------------------------------------------------------------------------------------- checkpoints: skipped


def test_checkpoint_collects_skipped(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    save_file({"a": torch.ones(2)}, root / "model-1.safetensors")
    raw_file(root / "model-2.safetensors", {"q": entry("F4", [4], 0, 2), "c": entry("C64", [1], 0 + 2, 10)}, bytes(10))
    wm = {"a": "model-1.safetensors", "q": "model-2.safetensors", "c": "model-2.safetensors", "gone": "model-2.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    ck = open_checkpoint(root)
    assert set(ck.tensors) == {"a", "c"} and ck.tensors["c"].dtype == torch.complex64
    assert set(ck.skipped) == {"q"} and ck.skipped["q"].file == root / "model-2.safetensors"
    assert ck.index_missing == ["gone"]
    assert ck.nbytes == 8 + 8


def test_duplicate_between_tensor_and_skipped(tmp_path: Path) -> None:
    save_file({"q": torch.ones(2)}, tmp_path / "one.safetensors")
    raw_file(tmp_path / "two.safetensors", {"q": entry("F4", [4], 0, 2)}, bytes(2))
    with pytest.raises(DuplicateTensorError, match="'q'") as e:
        open_checkpoint(tmp_path)
    assert "offset" in str(e.value)


# ---------------------------------------------------------------------------------------------- which files, as stock


def _tiny_llama(seed: int):
    """A two-layer bf16 Llama with seeded random weights (``seed`` differs: the weights differ)."""
    cfg = transformers.LlamaConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg)
    models.randomize_(m, seed=seed)
    m.config.dtype = torch.bfloat16
    return m.to(torch.bfloat16).eval()


def _set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _write_case(case: str, d: Path, a, b, tmp: Path) -> None:
    """Two checkpoints of ``a`` and ``b`` (different weights) in ``d``, laid out as ``case`` says."""
    if case == "sharded_then_single":  # save_pretrained deletes the shards, not the index
        a.save_pretrained(d, max_shard_size="40KB")
        b.save_pretrained(d)
        assert (d / INDEX_NAME).is_file() and not list(d.glob("model-0*.safetensors"))
    elif case == "single_then_sharded":  # model.safetensors stays, next to the index and its shards
        b.save_pretrained(d)
        a.save_pretrained(d, max_shard_size="40KB")
        assert (d / "model.safetensors").is_file() and (d / INDEX_NAME).is_file()
    elif case == "transformers_weights":
        a.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in b.state_dict().items()}, d / "custom.safetensors", metadata={"format": "pt"})
        _set_config(d, transformers_weights="custom.safetensors")
    else:  # transformers_weights_index: another index and its shards
        a.save_pretrained(d)
        b.save_pretrained(tmp / "other", max_shard_size="40KB")
        for f in (tmp / "other").glob("model-0*.safetensors"):
            f.rename(d / f.name)
        (tmp / "other" / INDEX_NAME).rename(d / "custom.safetensors.index.json")
        _set_config(d, transformers_weights="custom.safetensors.index.json")


@pytest.mark.parametrize("case", ["sharded_then_single", "single_then_sharded", "transformers_weights",
                                  "transformers_weights_index"])
def test_weight_files_are_the_ones_from_pretrained_loads(case: str, tmp_path: Path) -> None:
    """A directory holding two checkpoints: tiered loads the one ``from_pretrained`` loads (transformers 5.17
    ``_get_resolved_checkpoint_files``: ``config.json``'s ``transformers_weights``, else ``model.safetensors``, else
    the index), and its logits are stock's bit for bit. Directories ``save_pretrained`` leaves (sharded then
    unsharded: the index stays, its shards are gone) load; an ignored index with its shards is warned about."""
    import tiered

    a, b = _tiny_llama(1), _tiny_llama(2)
    d = tmp_path / "m"
    _write_case(case, d, a, b, tmp_path)
    ids = make_ids(0, (2, 8))
    assert not torch.equal(logits_of(a, ids), logits_of(b, ids))  # the two checkpoints really differ
    want = logits_of(transformers.AutoModelForCausalLM.from_pretrained(d).eval(), ids)
    warns = pytest.warns(UserWarning, match="two checkpoints") if case == "single_then_sharded" else nullcontext()
    with warns:
        m = tiered.load(d, device="cpu", ring_gb=1.0)
    with m:
        assert torch.equal(logits_of(m, ids), want)


@pytest.mark.parametrize(("name", "error"), [("weights.bin", ConfigError), ("../outside.safetensors", ShardNotFoundError),
                                             ("missing.safetensors", ShardNotFoundError),
                                             ("adapter_model.bin", ShardNotFoundError)])
def test_transformers_weights_refused_names_config_json(name: str, error: type, tmp_path: Path) -> None:
    """A ``transformers_weights`` transformers refuses (not safetensors, outside the directory) or that is missing:
    an error naming config.json and the file, never the other weights of the directory."""
    save_file(sample_tensors(), tmp_path / "outside.safetensors")
    d = tmp_path / "m"
    d.mkdir()
    save_file(sample_tensors(), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"transformers_weights": name}))
    with pytest.raises(error) as e:
        open_checkpoint(d)
    assert_names_file(e, d / "config.json", name)


def test_pytorch_bin_comes_before_other_safetensors(tmp_path: Path) -> None:
    """transformers loads ``pytorch_model.bin`` before looking at any other name: tiered (which does not read .bin)
    says so instead of loading some other ``*.safetensors`` file of the directory."""
    torch.save({"a.weight": torch.ones(3, 5)}, tmp_path / "pytorch_model.bin")
    save_file(sample_tensors(), tmp_path / "adapter.safetensors")
    with pytest.raises(ShardNotFoundError, match="pytorch_model.bin.*tiered reshard"):
        open_checkpoint(tmp_path)


def test_a_fused_tensor_chunked_into_parameters_loads_as_stock(tmp_path):
    """NomicBert's checkpoint holds one fused ``attn.Wqkv`` that transformers splits into q/k/v with ``Chunk(dim=0)``:
    it was refused with a MissingTensorError about config.json for k_proj/v_proj. Each parameter is now a run of the
    fused tensor's rows (tiered/chunks.py), mapped or copied like any tensor: streamed, equal to stock bit for bit."""
    from conftest import make_ids, stream

    import tiered

    models.nomic_bert(tmp_path / "nomic", seed=26)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "nomic" / "model.safetensors"), "pt") as f:
        assert any(k.endswith("attn.Wqkv.weight") for k in f.keys())  # the fused name is what is on disk
    ref = transformers.AutoModel.from_pretrained(tmp_path / "nomic").eval()
    ids = make_ids(11, (2, 7))
    with stream(tmp_path / "nomic") as t, torch.no_grad():
        want = ref(ids).last_hidden_state
        assert want.abs().sum() > 0 and torch.equal(t(ids).last_hidden_state, want)
        assert tiered.stats(t).mapped_units > 0
