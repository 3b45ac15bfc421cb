"""`tiered reshard` and MoE experts (issue 8): each expert's tensors adjacent, so one expert is one range of the file.

Per-expert checkpoints (Mixtral's ``experts.j.w1/w3/w2``, Qwen's and DeepSeek's ``experts.j.gate_proj/up_proj/
down_proj``) come out with expert ``j``'s tensors touching, in the order the reader reads them; a stacked checkpoint
(``mlp.experts.gate_up_proj`` ``(E, 2I, D)``, ``down_proj`` ``(E, D, I)``) keeps its tensors. Every output is checked
from its own safetensors header (parsed here, not by tiered), bit for bit against the input, and by its logits:
stock ``transformers`` and ``tiered`` (experts routed through a ring smaller than one MoE layer, read whole, zero copy
or not) on the output against stock on the *original* checkpoint, and greedy generation too.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import ring_below_layer
from safetensors.torch import load_file

import tiered
from tiered.cli import inspect_dir
from tiered.experts import merge_adjacent

LEGACY = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.(?P<j>\d+)\.(?P<rest>.+)$")
#: per-expert tensor names in the order the reader reads one expert (gate_up_proj's halves, then down_proj)
_READ_ORDER = {"w1.weight": 0, "w3.weight": 1, "w2.weight": 2,
               "gate_proj.weight": 0, "up_proj.weight": 1, "down_proj.weight": 2}


@pytest.fixture(scope="module")
def fused(ckpts, tmp_path_factory) -> Path:
    """Mixtral in the stacked layout (what transformers holds in memory), written from the legacy checkpoint."""
    return models.fused_experts(ckpts["mixtral"], tmp_path_factory.mktemp("fused") / "mixtral_fused")


def _src(ckpts, fused, name: str) -> Path:
    return fused if name == "mixtral_fused" else ckpts[name]


# ---------------------------------------------------------------------------------------------- helpers


def _header(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute begin, end) in ``path``, from its own JSON header (the safetensors format, read here)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        doc = json.loads(f.read(n))
    start = 8 + n
    return {k: (start + v["data_offsets"][0], start + v["data_offsets"][1]) for k, v in doc.items() if k != "__metadata__"}


def _ranges(d: Path) -> dict[str, tuple[str, int, int]]:
    """Every tensor of directory ``d``: name -> (file, begin, end)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: (f.name, a, b) for k, (a, b) in _header(f).items()})
    return out


def _experts(d: Path) -> dict[tuple[str, int], list[tuple[str, int, int, str]]]:
    """Per-expert tensors: (block, j) -> [(file, begin, end, name)] in read order (none for a stacked checkpoint)."""
    out: dict[tuple[str, int], list[tuple[str, int, int, str]]] = {}
    for name, (f, a, b) in _ranges(d).items():
        m = _EXPERT.match(name)
        if m and m["rest"] in _READ_ORDER and "shared" not in m["block"]:
            out.setdefault((m["block"], int(m["j"])), []).append((f, a, b, name))
    for v in out.values():
        v.sort(key=lambda r: _READ_ORDER[_EXPERT.match(r[3])["rest"]])
    return out


def _spans(rs: list[tuple[str, int, int, str]]) -> int:
    """Ranges of the file ``rs`` take once adjacent ones are joined."""
    spans, end = 0, None
    for f, a, b, _ in sorted(rs):
        spans += end != (f, a)
        end = (f, b)
    return spans


def _hashes(d: Path) -> dict[str, tuple[int, int, str]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.blake2b(p.read_bytes()).hexdigest())
            for p in sorted(d.iterdir()) if p.is_file()}


def _ids(seed: int = 0, shape=(2, 7)) -> torch.Tensor:
    return torch.randint(0, models.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _stock(d: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(d).eval()


# ---------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("name", [*LEGACY, "mixtral_fused"])
def test_reshard_lays_each_expert_out_contiguously(ckpts, fused, tmp_path: Path, name: str) -> None:
    src = _src(ckpts, fused, name)
    before = _hashes(src)
    s = tiered.reshard(src, tmp_path / "out", max_shard_size="100KB", quiet=True)
    dst = tmp_path / "out"
    assert _hashes(src) == before, "SRC was modified"
    assert s.order == "plan"
    # the same tensors, names and bytes
    want, got = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        want.update(load_file(f))
    for f in sorted(dst.glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and torch.equal(got[k].view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)), k

    experts = _experts(dst)
    info = inspect_dir(dst)["experts"]
    info_src = inspect_dir(src)["experts"]
    if name == "mixtral_fused":  # stacked tensors are kept: an expert is one range of each of them
        assert not experts and not _experts(src)
        stacked = [k for k in got if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert len(stacked) == 2 * info["blocks"]
        assert info["layout"] == "stacked" and info["spans_per_expert"] == 2 and not info["experts_contiguous"]
        assert info_src["layout"] == "stacked"
    else:
        n_blocks = len({b for b, _ in experts})
        assert n_blocks == info["blocks"] and len(experts) == n_blocks * info["experts_per_block"]
        for (block, j), rs in experts.items():
            assert len(rs) == 3, (block, j, rs)
            # one range: each tensor starts where the one before it (in read order) ends, in one file
            assert all(b[0] == a[0] and b[1] == a[2] for a, b in zip(rs, rs[1:], strict=False)), (block, j, rs)
        # the original layout is not (save_pretrained writes names sorted: w1, w2, w3 / down, gate, up)
        assert max(_spans(rs) for rs in _experts(src).values()) > 1
        assert info_src["spans_per_expert"] == max(_spans(rs) for rs in _experts(src).values())
        assert info["layout"] == "per-expert" and info["spans_per_expert"] == 1 and info["experts_contiguous"]
        # gate|up land adjacent in gate_up_proj (one copy), down in down_proj (another)
        assert info["reads_per_expert"] == 2
    # the expected bytes per decode token: dense part + k/E of the experts
    k, E = info["top_k"], info["experts_per_block"]
    assert info["routed_bytes_per_token"] == (info["dense_bytes"] + info["embedding_row_bytes"]
                                              + info["experts_bytes"] * k // E)
    assert info["all_bytes"] == sum(b - a for _, a, b in _ranges(dst).values())
    assert {k: v for k, v in info.items() if "spans" not in k and "contig" not in k and "reads" not in k} == \
        {k: v for k, v in info_src.items() if "spans" not in k and "contig" not in k and "reads" not in k}


# ---------------------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "mixtral_fused"])
def test_resharded_experts_equal_stock_on_the_original(ckpts, fused, tmp_path: Path, name: str) -> None:
    original = ckpts["mixtral"] if name == "mixtral_fused" else ckpts[name]
    src = _src(ckpts, fused, name)
    dst = tmp_path / "out"
    tiered.reshard(src, dst, max_shard_size="100KB", quiet=True)
    ref = _stock(original)
    ids = _ids()
    want = ref(ids).logits
    want_gen = ref.generate(ids, max_new_tokens=5, do_sample=False)
    stock = _stock(dst)
    assert torch.equal(stock(ids).logits, want)
    assert torch.equal(stock.generate(ids, max_new_tokens=5, do_sample=False), want_gen)
    ring = ring_below_layer(ref)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    for kw in ({}, {"zero_copy": False}, {"routed_experts": False}):
        # experts read whole: a ring of a few layers (each unit whole), still less than the model
        r = ring if kw.get("routed_experts", True) else 3 * (layer + 8192) / 2**30
        with tiered.load(dst, ring_gb=r, device="cpu", **kw) as m:
            assert torch.equal(m(ids).logits, want), kw
            assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False), want_gen), kw
            st = tiered.stats(m).snapshot()
            assert st["streamed_bytes"] > sum(p.numel() * p.element_size() for p in ref.parameters()), st  # streamed
            if kw.get("routed_experts", True):
                assert st["expert_modules"] >= 2 and st["experts_read"] > 0, st
            else:
                assert st["expert_modules"] == 0 and st["experts_read"] == 0, st


# ---------------------------------------------------------------------------------------------- reads


def test_reader_requests_per_expert(ckpts, fused, tmp_path: Path) -> None:
    """What the routed read asks the reader for: after resharding, a Mixtral expert's w1 and w3 are one copy (two
    before: w1, w2, w3 apart), its w2 another; a stacked checkpoint's consecutive routed experts are one copy
    per stacked tensor. The bytes are the same either way (the equality tests above)."""
    dst = tmp_path / "out"
    tiered.reshard(ckpts["mixtral"], dst, quiet=True)
    ring = ring_below_layer(_stock(dst))

    def requests(d: Path, ids: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        with tiered.load(d, ring_gb=ring, device="cpu") as m:
            eg = m._tiered.experts[0]
            out = [torch.empty((len(ids), *p.slab_shape), dtype=p.target.dtype) for p in eg.spec.parts]
            n = len(eg._pairs(list(enumerate(ids)), out))  # (row, expert) pairs
            got = eg.read(ids)
            whole = eg.read(list(range(eg.spec.num_experts)))  # every expert: compare slabs by position
            return n, got, [w[ids] for w in whole]

    n, got, want = requests(dst, [1])
    assert n == 2 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    n, _, _ = requests(ckpts["mixtral"], [1])
    assert n == 3
    n, got, want = requests(fused, [1, 2])  # adjacent experts of a stacked tensor: one copy per tensor
    assert n == 2 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    n, _, _ = requests(fused, [0, 2])
    assert n == 4


def test_merge_adjacent_only_merges_what_is_adjacent_on_both_sides(tmp_path: Path) -> None:
    from tiered.format import TensorInfo

    f = tmp_path / "x"
    buf = torch.zeros(10, dtype=torch.bfloat16)
    other = torch.zeros(4, dtype=torch.bfloat16)
    a = TensorInfo("a", torch.bfloat16, (3,), f, 100, 6)
    b = TensorInfo("b", torch.bfloat16, (2,), f, 106, 4)
    c = TensorInfo("c", torch.bfloat16, (4,), f, 110, 8)
    d = TensorInfo("d", torch.bfloat16, (5,), f, 200, 10)
    out = merge_adjacent([(c, other), (b, buf[3:5]), (a, buf[0:3]), (d, buf[5:10])])
    # a+b: adjacent in the file and in buf; c: adjacent in the file, another tensor; d: adjacent in buf, not the file
    assert [(i.offset, i.nbytes) for i, _ in out] == [(100, 10), (110, 8), (200, 10)]
    merged = out[0][1]
    assert merged.shape == (5,) and merged.data_ptr() == buf.data_ptr()
    assert merge_adjacent([(a, buf[0:3]), (b, buf[4:6])])[1][0] is b  # a hole in the destination: two copies
    assert len(merge_adjacent([(a, buf[0:3]), (b, buf.float()[3:5])])) == 2  # another dtype: two copies
