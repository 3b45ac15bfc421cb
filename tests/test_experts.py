"""Routed experts (tiered/experts.py): a streamed MoE block reads only the experts its router picked.

Every equality test compares with stock ``transformers`` (``from_pretrained``, same ``experts_implementation``)
bit for bit, with a ring smaller than one MoE layer, so the experts cannot be streamed whole.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

import tiered
from tests import models
from tiered.errors import ShardChangedError, StreamerError, TruncatedShardError
from tiered.experts import find_experts

ARCHS = {  # name -> builder kwargs
    "mixtral": (models.mixtral, {}),  # per-expert w1/w3/w2 in the checkpoint, fused in the model
    "qwen2_moe": (models.qwen2_moe, {}),  # shared expert + routed experts
    "qwen3_moe": (models.qwen3_moe, {}),
    "deepseek_v3": (models.deepseek_v3, {}),  # shared + routed, grouped routing, a dense first layer
    "deepseek_v2": (models.deepseek_v2, {}),  # latent attention, shared + routed, group_limited_greedy
    "olmoe": (models.olmoe, {}),
    "gpt_oss": (models.gpt_oss, {}),  # expert biases (bf16; the MXFP4 checkpoints are another format)
    "glm4_moe": (models.glm4_moe, {}),  # dense first layer, shared + routed, grouped routing
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {name: fn(root / name, **kw) for name, (fn, kw) in ARCHS.items()}
    # bf16: in fp32 a one-row product on the CPU rounds differently with the weight's address (stock computes
    # on the file mapping, where an fp32 tensor may sit at any 8-byte offset), routed or not
    out["mixtral16"] = models.mixtral(root / "mixtral16", num_experts=16, top_k=2, max_shard_size="200KB")
    return out


def _ids(seed=0, shape=(2, 7)):
    return torch.randint(0, models.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _ref(path, impl="grouped_mm"):
    return transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl)


def _moe_layer_bytes(m) -> int:
    """Bytes of the largest decoder layer with its experts (what streaming it whole would need)."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in m.model.layers)


def _ring_below_layer(path) -> float:
    """A ring smaller than the largest MoE layer (so its experts cannot stream whole) that holds every layer
    without its routed experts (64-byte aligned tensors, a page-rounded slot, as the ring allocates it)."""
    ref = _ref(path)
    dense = max(sum(-(-p.numel() * p.element_size() // 64) * 64 for n, p in layer.named_parameters()
                    if ".experts." not in f".{n}" or "shared" in n) for layer in ref.model.layers)
    ring = max(_moe_layer_bytes(ref) * 0.6, -(-dense // 4096) * 4096 + 4096)
    assert ring < _moe_layer_bytes(ref)
    return ring / 2**30


@pytest.mark.parametrize("arch", list(ARCHS))
def test_routed_equal_to_stock(ckpts, arch):
    path = ckpts[arch]
    ref = _ref(path)
    ring = _ring_below_layer(path)
    ids = _ids()
    want = ref(ids).logits
    want_gen = ref.generate(ids, max_new_tokens=6, do_sample=False)
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        assert tiered.stats(m).expert_modules >= 2
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), want_gen)
        s = tiered.stats(m).snapshot()
        assert s["experts_read"] > 0 and s["expert_bytes"] > 0
        assert s["dense_bytes"] == s["streamed_bytes"] - s["expert_bytes"] - s["embedding_bytes"]


@pytest.mark.parametrize("arch", ["mixtral16", "gpt_oss", "glm4_moe"])
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation(ckpts, impl, arch):
    """``eager`` loops over the hit experts, ``grouped_mm`` groups rows per expert, ``batched_mm`` gathers a
    weight per row: with the compact experts and remapped ids each gives the stock result bit for bit (gpt-oss:
    expert biases; GLM-4-MoE: a shared expert beside the routed ones)."""
    path = ckpts[arch]
    ref = _ref(path, impl)
    ids = _ids(1, (3, 5))
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        m.set_experts_implementation(impl)
        assert m.config._experts_implementation == impl
        assert torch.equal(m(ids).logits, ref(ids).logits)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_io_backends(ckpts, io):
    path = ckpts["qwen3_moe"]
    ref = _ref(path)
    ids = _ids(2)
    try:
        m = tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu", io=io)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m:
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_one_token_reads_only_routed_experts(ckpts):
    """16 experts, top-2: a one-token decode step reads <= dense bytes + 1.5 x (k/E) x expert bytes (issue 8)."""
    path = ckpts["mixtral16"]
    ref = _ref(path)
    ids = _ids(3, (1, 6))
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu", embedding_rows=False) as m:
        h = m._tiered
        experts = [eg.spec for eg in h.experts]
        assert len(experts) == 3
        expert_total = sum(sp.num_experts * sp.expert_src_bytes for sp in experts)
        dense = sum(u.src_bytes for u in h.plan.units)
        assert expert_total > 2 * dense  # a MoE model: most bytes are experts
        assert _moe_layer_bytes(ref) > h.ring.size  # a MoE layer does not fit the ring
        got = m(ids[:, :5], use_cache=True)
        want = ref(ids[:, :5], use_cache=True)
        assert torch.equal(got.logits, want.logits)
        before = tiered.stats(m).snapshot()
        step = m(ids[:, 5:], past_key_values=got.past_key_values, use_cache=True)  # one token: a decode step
        after = tiered.stats(m).snapshot()
        assert torch.equal(step.logits, ref(ids[:, 5:], past_key_values=want.past_key_values, use_cache=True).logits)
        used = after["streamed_bytes"] - before["streamed_bytes"]
        assert after["experts_read"] - before["experts_read"] == 3 * 2  # top-2 of one token, 3 layers
        assert used <= dense + 1.5 * (2 / 16) * expert_total
        assert after["expert_bytes"] - before["expert_bytes"] == 6 * experts[0].expert_src_bytes


@pytest.mark.parametrize("arch", list(ARCHS))
def test_host_tier_experts_layout_equal_to_stock(ckpts, arch):
    """The host tier's copy of every expert (``HostExperts``: read once, cast, one ``(E, ...)`` region per part)
    serves the routed experts with stock's bits, and no expert is read after it is filled. On the CPU here (the
    layout, the fill and the per-call copy; unpinned); ``tests/test_cuda.py`` runs it through ``host_gb``."""
    from tiered.experts import HostExperts

    path = ckpts[arch]
    ref = _ref(path)
    ids = _ids(5)
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        h = m._tiered
        specs = [eg.spec for eg in h.experts]
        hx = HostExperts(specs, torch.device("cpu"))
        try:
            hx.fill(h.reader, h.stats)
            assert hx.nbytes >= sum(sp.num_experts * sp.expert_bytes for sp in specs)
            for eg in h.experts:
                eg.host = hx.parts(eg.spec)
                for p, t in zip(eg.spec.parts, eg.host, strict=True):  # the whole stacked parameter, expert by expert
                    want = ref.get_parameter(f"{eg.spec.name}.{p.target.attr}") if p.target.is_param else None
                    if want is not None:
                        assert torch.equal(t, want)
            before = tiered.stats(m).snapshot()
            assert torch.equal(m(ids).logits, ref(ids).logits)
            assert torch.equal(m.generate(ids[:1], max_new_tokens=4, do_sample=False),
                               ref.generate(ids[:1], max_new_tokens=4, do_sample=False))
            after = tiered.stats(m).snapshot()
            assert after["experts_read"] == before["experts_read"] and after["expert_bytes"] == before["expert_bytes"]
            assert after["experts_from_host"] > 0 and after["host_expert_bytes"] > 0
        finally:
            for eg in h.experts:
                eg.host = None
            hx.close()


def test_not_routed_when_the_model_fits(ckpts):
    path = ckpts["mixtral"]
    ids = _ids(4)
    with tiered.load(path, ring_gb=1, device="cpu") as m:
        assert tiered.stats(m).expert_modules == 0 and not m._tiered.experts
        assert torch.equal(m(ids).logits, _ref(path)(ids).logits)
    with tiered.load(path, ring_gb=_ring_below_layer(path) * 2, device="cpu", routed_experts=False) as m:
        assert tiered.stats(m).expert_modules == 0
        assert tiered.stats(m).experts_read == 0
        assert torch.equal(m(ids).logits, _ref(path)(ids).logits)


def test_find_experts_takes_every_stacked_parameter(ckpts):
    ref = _ref(ckpts["qwen2_moe"])
    from tiered.format import open_checkpoint
    from tiered.meta import meta_model_from_dir
    from tiered.plan import build_plan

    meta = meta_model_from_dir(ckpts["qwen2_moe"])
    plan = build_plan(meta, open_checkpoint(ckpts["qwen2_moe"]))
    specs = [s for u in plan.units for s in find_experts(u)]
    assert len(specs) == ref.config.num_hidden_layers
    for s in specs:
        assert {p.target.attr for p in s.parts} == {"gate_up_proj", "down_proj"}
        assert s.num_experts == ref.config.num_experts
        # the shared expert is not routed: it stays in the unit
        assert not any("shared_expert" in p.target.key for p in s.parts)


def test_threads_serialise(ckpts):
    path = ckpts["qwen2_moe"]
    ref = _ref(path)
    inputs = [_ids(10 + i, (1, 5)) for i in range(4)]
    want = [ref(x).logits for x in inputs]
    errors: list[BaseException] = []
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        def run(k: int) -> None:
            try:
                for _ in range(3):
                    assert torch.equal(m(inputs[k]).logits, want[k])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors


def test_keyboard_interrupt_inside_the_read_is_recovered(ckpts, monkeypatch):
    path = ckpts["mixtral"]
    ref = _ref(path)
    ids = _ids(5)
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        eg = m._tiered.experts[1]
        real = eg.read
        calls = {"n": 0}

        def interrupted(ids_):
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt
            return real(ids_)

        monkeypatch.setattr(eg, "read", interrupted)
        with pytest.raises(KeyboardInterrupt):
            m(ids)
        assert not eg.lock.locked()
        assert m.model.layers[1].mlp.experts.gate_up_proj.device.type == "meta"
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_closed_model_refuses(ckpts):
    path = ckpts["mixtral"]
    m = tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu")
    experts = m.model.layers[0].mlp.experts
    m.close()
    with pytest.raises(StreamerError):
        experts(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.long),
                torch.ones(1, 2, dtype=torch.bfloat16))


def test_truncated_shard_names_file(ckpts, tmp_path):
    import shutil

    src = ckpts["mixtral16"]
    path = tmp_path / "m"
    shutil.copytree(src, path)
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        eg = m._tiered.experts[-1]
        last = max((info for p in eg.spec.parts for per in p.per for info, _ in per), key=lambda i: i.offset)
        with open(last.file, "r+b") as f:
            f.truncate(last.offset + 8)
        with pytest.raises((TruncatedShardError, ShardChangedError)) as e:
            m.generate(_ids(6, (4, 16)), max_new_tokens=2, do_sample=False)
        assert last.file.name in str(e.value)


def test_out_of_range_expert_id(ckpts):
    path = ckpts["mixtral"]
    with tiered.load(path, ring_gb=_ring_below_layer(path), device="cpu") as m:
        experts = m.model.layers[0].mlp.experts
        with pytest.raises(IndexError, match="out of range"):
            experts(torch.zeros(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 9]]),
                    torch.ones(1, 2, dtype=torch.bfloat16))
        assert torch.equal(m(_ids(7)).logits, _ref(path)(_ids(7)).logits)


def test_inspect_reports_experts_and_routed_bytes(ckpts):
    """`tiered inspect`: MoE blocks, experts, their layout on disk, and the routed bytes per decode token, which
    the one-token test above measures for real."""
    from tiered.cli import inspect_dir

    info = inspect_dir(ckpts["mixtral16"])["experts"]
    assert info["blocks"] == 3 and info["experts_per_block"] == 16 and info["top_k"] == 2
    # the legacy per-expert layout: w1, w2, w3 of one expert are three tensors
    assert info["spans_per_expert"] >= 1
    assert info["routed_bytes_per_token"] == (info["dense_bytes"] + info["embedding_row_bytes"]
                                              + 3 * 2 * info["expert_bytes"])
    assert 0 < info["embedding_row_bytes"] < info["expert_bytes"]  # the embedding reads one row, not its table
    assert info["all_bytes"] > 4 * info["routed_bytes_per_token"] / 2
    assert inspect_dir(ckpts["mixtral"])["experts"]["experts_per_block"] == 4
    assert inspect_dir(ckpts["qwen3_moe"])["experts"]["top_k"] == 2


