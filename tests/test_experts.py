"""Routed experts (tiered/experts.py): a streamed MoE block reads only the experts its router picked.

Every equality test compares with stock ``transformers`` (``from_pretrained``, same ``experts_implementation``)
bit for bit, with a ring smaller than one MoE layer, so the experts cannot be streamed whole.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import STOCK, experts_case, load_routed, make_ids, ring_below_layer

import tiered
from tests import models
from tiered import faults
from tiered.errors import ShardChangedError, StreamerError, TruncatedShardError
from tiered.experts import find_experts
from tiered.placeholder import is_placeholder

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


# The checkpoints are the session's (tests/conftest.py ``ckpts``: the same builders with the same arguments), and
# "mixtral16" (16 experts, top-2). bf16: in fp32 a one-row product on the CPU rounds differently with the weight's
# address (stock computes on the file mapping, where an fp32 tensor may sit at any 8-byte offset), routed or not.


def _ref(path, impl="grouped_mm"):
    return STOCK(path, impl=impl)


def _moe_layer_bytes(m) -> int:
    """Bytes of the largest decoder layer with its experts (what streaming it whole would need)."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in m.model.layers)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_routed_equal_to_stock(ckpts, arch):
    path = ckpts[arch]
    ref = _ref(path)
    ring = ring_below_layer(path)
    ids = make_ids()
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
    ids = make_ids(1, (3, 5))
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
        m.set_experts_implementation(impl)
        assert m.config._experts_implementation == impl
        assert torch.equal(m(ids).logits, ref(ids).logits)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_io_backends(ckpts, io):
    path = ckpts["qwen3_moe"]
    ref = _ref(path)
    ids = make_ids(2)
    try:
        m = tiered.load(path, ring_gb=ring_below_layer(path), device="cpu", io=io)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m:
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_one_token_reads_only_routed_experts(ckpts):
    """16 experts, top-2: a one-token decode step reads <= dense bytes + 1.5 x (k/E) x expert bytes (issue 8)."""
    path = ckpts["mixtral16"]
    ref = _ref(path)
    ids = make_ids(3, (1, 6))
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu", embedding_rows=False) as m:
        h = m._tiered
        experts = tiered.stats(m).placement.specs
        assert len(experts) == 3
        expert_total = sum(sp.num_experts * sp.expert_src_bytes for sp in experts)
        dense = sum(u.src_bytes for u in h.plan.units)
        assert expert_total > 2 * dense  # a MoE model: most bytes are experts
        assert _moe_layer_bytes(ref) > tiered.stats(m).ring_bytes  # a MoE layer does not fit the ring
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
    ids = make_ids(5)
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
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
    ids = make_ids(4)
    with tiered.load(path, ring_gb=1, device="cpu") as m:
        assert tiered.stats(m).expert_modules == 0 and not tiered.stats(m).placement.specs
        assert torch.equal(m(ids).logits, _ref(path)(ids).logits)
    with tiered.load(path, ring_gb=ring_below_layer(path) * 2, device="cpu", routed_experts=False) as m:
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
    inputs = [make_ids(10 + i, (1, 5)) for i in range(4)]
    want = [ref(x).logits for x in inputs]
    errors: list[BaseException] = []
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
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
    ids = make_ids(5)
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
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
        assert is_placeholder(m.model.layers[1].mlp.experts.gate_up_proj)
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_closed_model_refuses(ckpts):
    path = ckpts["mixtral"]
    m = tiered.load(path, ring_gb=ring_below_layer(path), device="cpu")
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
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
        eg = m._tiered.experts[-1]
        last = max((info for p in eg.spec.parts for per in p.per for info, _ in per), key=lambda i: i.offset)
        with open(last.file, "r+b") as f:
            f.truncate(last.offset + 8)
        with pytest.raises((TruncatedShardError, ShardChangedError)) as e:
            m.generate(make_ids(6, (4, 16)), max_new_tokens=2, do_sample=False)
        assert last.file.name in str(e.value)


def test_out_of_range_expert_id(ckpts):
    path = ckpts["mixtral"]
    with tiered.load(path, ring_gb=ring_below_layer(path), device="cpu") as m:
        experts = m.model.layers[0].mlp.experts
        with pytest.raises(IndexError, match="out of range"):
            experts(torch.zeros(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 9]]),
                    torch.ones(1, 2, dtype=torch.bfloat16))
        assert torch.equal(m(make_ids(7)).logits, _ref(path)(make_ids(7)).logits)


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


# ---------------------------------------------------------------------------------------------- hostile


def _same(ref_call, got_call):
    """Both return equal tensors, or both raise (the same exception type)."""
    try:
        want = ref_call()
    except Exception as e:  # noqa: BLE001
        want = e
    try:
        got = got_call()
    except Exception as e:  # noqa: BLE001
        got = e
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"stock returned a tensor, tiered raised {got!r}"
        assert got.shape == want.shape and torch.equal(got, want)
    else:
        assert isinstance(got, Exception), f"stock raised {want!r}, tiered returned a tensor"


class TestHostile:
    """Direct calls of a routed experts module in every argument form (int32, non-contiguous, repeated, empty, the
    expert-parallel sentinel id, out of range), Ctrl-C inside its forward or its reads, direct and model calls from
    threads, use after close, every dtype / io / option combination: bit for bit stock's (same
    ``experts_implementation``), or the same exception. Tests whose docstring says "Regression:" failed on commit
    60471ee and pass since the fixes in experts.py (sentinel/empty call) and guard.py."""

    @pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
    def test_direct_call_argument_forms(self, ckpts, impl):
        """Positional / keyword / mixed arguments, int32 ids, non-contiguous ids, a token routed twice to one expert,
        a single distinct expert: the module alone equals stock's module (or both raise)."""
        path = ckpts["mixtral"]
        ref = STOCK(path, impl=impl)
        with load_routed(path) as m:
            m.set_experts_implementation(impl)
            E, R = m.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts
            h, idx, w = experts_case(1, 5, 4)
            _same(lambda: R(h, idx, w), lambda: E(h, idx, w))
            _same(lambda: R(hidden_states=h, top_k_index=idx, top_k_weights=w),
                  lambda: E(hidden_states=h, top_k_index=idx, top_k_weights=w))
            _same(lambda: R(h, top_k_index=idx, top_k_weights=w), lambda: E(h, top_k_index=idx, top_k_weights=w))
            _same(lambda: R(h, idx.int(), w), lambda: E(h, idx.int(), w))  # eager: both refuse int32 (one_hot)
            nc = idx.t().contiguous().t()
            assert not nc.is_contiguous()
            _same(lambda: R(h, nc, w), lambda: E(h, nc, w))
            same = torch.full_like(idx, 2)
            _same(lambda: R(h, same, w), lambda: E(h, same, w))
            # not an integer tensor: a TypeError, and nothing left bound
            with pytest.raises(TypeError):
                E(h, idx.float(), w)
            assert is_placeholder(E.gate_up_proj) and E.num_experts == 4
            ids = make_ids(3)
            assert torch.equal(m(ids).logits, ref(ids).logits)


    def test_negative_or_too_large_id_is_an_error_and_leaves_the_module_clean(self, ckpts):
        path = ckpts["qwen3_moe"]
        ref = STOCK(path, impl="grouped_mm")
        with load_routed(path) as m:
            E = m.model.layers[0].mlp.experts
            h, idx, w = experts_case(2, 3, 8)
            for bad in (-1, 9, 2**40):
                b = idx.clone()
                b[1, 0] = bad
                with pytest.raises(IndexError, match="out of range"):
                    E(h, b, w)
                assert E.num_experts == 8 and is_placeholder(E.gate_up_proj)
                assert not m._tiered.experts[0].lock.locked()
            assert torch.equal(m(make_ids(4)).logits, ref(make_ids(4)).logits)


    def test_empty_batch_direct_call_grouped_mm(self, ckpts):
        """Regression: a call with 0 tokens bound (0, ...) tensors with num_experts = max(1, 0) = 1; grouped_mm failed
        'matrix batch sizes have to match' where stock returns a (0, D) tensor."""
        path = ckpts["mixtral"]
        ref = STOCK(path, impl="grouped_mm")
        with load_routed(path) as m:
            E, R = m.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
            h, idx, w = experts_case(3, 0, 4)
            want = R(h, idx, w)
            assert want.shape == (0, 64)
            got = E(h, idx, w)
            assert torch.equal(got, want)


    @pytest.mark.parametrize("impl", ["batched_mm", "eager"])
    def test_empty_batch_direct_call_other_impls(self, ckpts, impl):
        path = ckpts["mixtral"]
        ref = STOCK(path, impl=impl)
        with load_routed(path) as m:
            m.set_experts_implementation(impl)
            E, R = m.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
            h, idx, w = experts_case(3, 0, 4)
            _same(lambda: R(h, idx, w), lambda: E(h, idx, w))
            assert E.num_experts == 4


    @pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
    def test_ep_sentinel_id(self, ckpts, impl):
        """Regression: stock grouped_mm/batched_mm accept the expert-parallel sentinel id == num_experts (masked, weight
        0); the pre-hook raised IndexError instead of remapping it to U. Also a call whose every id is the sentinel."""
        path = ckpts["mixtral"]
        ref = STOCK(path, impl=impl)
        with load_routed(path) as m:
            m.set_experts_implementation(impl)
            E, R = m.model.layers[0].mlp.experts, ref.model.layers[0].mlp.experts
            h, idx, w = experts_case(4, 3, 4)
            idx[0, 1] = 4
            idx[2, 0] = 4
            w = w.masked_fill(idx == 4, 0)
            want = R(h, idx, w)
            assert torch.equal(E(h, idx, w), want)
            allsent = torch.full_like(idx, 4)
            assert torch.equal(E(h, allsent, torch.zeros_like(w)), R(h, allsent, torch.zeros_like(w)))
            assert E.num_experts == 4 and is_placeholder(E.gate_up_proj)
            assert torch.equal(m(make_ids(16)).logits, ref(make_ids(16)).logits)


    def test_ctrl_c_inside_the_experts_forward_then_bitwise(self, ckpts):
        """KeyboardInterrupt from inside the experts' own forward (after the pre-hook bound compact tensors): the
        forward hook does not run; the model call's finally must restore placeholders and release the lock."""
        path = ckpts["mixtral"]
        ref = STOCK(path, impl="grouped_mm")
        ids = make_ids(5)
        with load_routed(path) as m:
            E = m.model.layers[1].mlp.experts
            real = E.act_fn
            hits = {"n": 0}

            class Boom(torch.nn.Module):
                def forward(self, x):
                    hits["n"] += 1
                    if hits["n"] == 1:
                        raise KeyboardInterrupt
                    return real(x)

            E.act_fn = Boom()
            with pytest.raises(KeyboardInterrupt):
                m(ids)
            assert not any(eg.lock.locked() for eg in m._tiered.experts)
            assert E.num_experts == 4 and is_placeholder(E.gate_up_proj)
            assert torch.equal(m(ids).logits, ref(ids).logits)
            E.act_fn = real
            assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                               ref.generate(ids, max_new_tokens=4, do_sample=False))


    def test_ctrl_c_in_a_reader_thread_during_an_expert_read(self, ckpts):
        path = ckpts["qwen3_moe"]
        ref = STOCK(path, impl="grouped_mm")
        ids = make_ids(6)
        with load_routed(path) as m:
            hit = {"n": 0}

            def boom(**kw):
                if "experts" in str(kw.get("tensor")) and hit["n"] == 0:
                    hit["n"] += 1
                    raise KeyboardInterrupt

            with faults.inject("read", boom), pytest.raises(KeyboardInterrupt):
                m(ids)
            assert hit["n"] == 1
            assert not any(eg.lock.locked() for eg in m._tiered.experts)
            assert torch.equal(m(ids).logits, ref(ids).logits)


    def test_ctrl_c_in_a_direct_experts_call_then_another_thread(self, ckpts):
        """Regression (was a strict xfail until tiered/guard.py): the interrupted call leaves the module unlocked and
        unbound, and a model call from another thread is bitwise equal to stock."""
        path = ckpts["mixtral"]
        ref = STOCK(path, impl="grouped_mm")
        ids = make_ids(8)
        want = ref(ids).logits
        m = load_routed(path)
        E = m.model.layers[1].mlp.experts
        eg = next(g for g in m._tiered.experts if g.spec.module is E)
        real = E.act_fn

        class Boom(torch.nn.Module):
            def forward(self, x):
                raise KeyboardInterrupt

        E.act_fn = Boom()
        h, idx, w = experts_case(5, 3, 4)
        with pytest.raises(KeyboardInterrupt):
            E(h, idx, w)
        E.act_fn = real
        assert not eg.lock.locked()
        assert E.num_experts == eg.spec.num_experts
        assert all(getattr(E, p.target.attr) is eg.placeholders[p.target.attr] for p in eg.spec.parts)
        out: dict = {}

        def other():
            try:
                out["eq"] = torch.equal(m(ids).logits, want)
            except BaseException as e:  # noqa: BLE001
                out["err"] = e

        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(6)
        hung = t.is_alive()
        m.close()
        assert not hung, "a model call from another thread deadlocked on the experts lock"
        assert out.get("eq") is True, out


    def test_direct_experts_calls_and_model_calls_from_many_threads(self, ckpts):
        path = ckpts["mixtral"]
        ref = STOCK(path, impl="grouped_mm")
        ids = make_ids(9)
        want = ref(ids).logits
        errors: list = []
        with load_routed(path) as m:
            E, R = m.model.layers[2].mlp.experts, ref.model.layers[2].mlp.experts
            cases = [(*experts_case(10 + k, 2 + k, 4),) for k in range(4)]
            cases = [(h, i, w, R(h, i, w)) for h, i, w in cases]

            def direct(k):
                try:
                    for _ in range(8):
                        h, i, w, r = cases[k]
                        assert torch.equal(E(h, i, w), r)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            def model():
                try:
                    for _ in range(2):
                        assert torch.equal(m(ids).logits, want)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            ts = [threading.Thread(target=direct, args=(k,)) for k in range(4)] + [threading.Thread(target=model)
                                                                                    for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            assert not any(t.is_alive() for t in ts)
            assert E.num_experts == 4 and is_placeholder(E.gate_up_proj)
        assert not errors, errors


    def test_generate_from_threads_with_zero_copy_and_experts(self, ckpts):
        path = ckpts["mixtral_fp32"]  # fp32 on disk, fp32 model: the dense units are mapped (zero copy), experts routed
        ref = STOCK(path, impl="grouped_mm")
        prompts = [make_ids(20 + k, (1, 4 + k)) for k in range(3)]
        want = [ref.generate(p, max_new_tokens=4, do_sample=False) for p in prompts]
        errors: list = []
        with load_routed(path) as m:
            assert tiered.stats(m).mapped_units > 0

            def run(k):
                try:
                    assert torch.equal(m.generate(prompts[k], max_new_tokens=4, do_sample=False), want[k])
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            ts = [threading.Thread(target=run, args=(k,)) for k in range(3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
        assert not errors, errors


    def test_use_after_close(self, ckpts):
        path = ckpts["mixtral"]
        m = load_routed(path)
        E = m.model.layers[0].mlp.experts
        m.close()
        h, idx, w = experts_case(13, 2, 4)
        with pytest.raises(StreamerError):
            E(h, idx, w)
        with pytest.raises(StreamerError):
            m.generate(make_ids(13), max_new_tokens=2, do_sample=False)
        assert is_placeholder(E.gate_up_proj)


    COMBOS = [  # (checkpoint, dtype, io, embedding_rows, zero_copy, routed_experts)
        ("mixtral_fp32", torch.bfloat16, "mmap", True, True, True),
        ("mixtral_fp32", torch.bfloat16, "pread", False, True, True),
        ("mixtral_fp32", torch.float16, "direct", True, False, True),
        ("mixtral_fp32", None, "mmap", False, True, True),
        ("mixtral", torch.float32, "mmap", True, True, True),
        ("qwen3_moe", None, "pread", True, True, True),
        ("deepseek_v3", torch.bfloat16, "mmap", False, True, True),
        ("deepseek_v3", None, "direct", True, True, True),
        ("mixtral_fp32", None, "mmap", True, True, False),
        ("qwen3_moe", None, "mmap", False, False, False),
    ]

    @pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
    def test_dtype_io_option_combos_batch_generate_with_padding(self, ckpts, combo):
        name, dtype, io, rows, zc, routed = combo
        path = ckpts[name]
        ref = STOCK(path, impl="grouped_mm", dtype=dtype)
        scale = 2 if dtype == torch.float32 else 1
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
        am = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
        try:
            m = tiered.load(path, ring_gb=ring_below_layer(path, scale) * (1 if routed else 4), device="cpu", dtype=dtype,
                            io=io, embedding_rows=rows, zero_copy=zc, routed_experts=routed)
        except tiered.ConfigError as e:  # a file system without O_DIRECT
            pytest.skip(str(e))
        with m:
            s = tiered.stats(m)
            assert (s.expert_modules > 0) == routed
            if not zc or io != "mmap":
                assert s.mapped_units == 0
            assert torch.equal(m(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits)
            assert torch.equal(m.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False),
                               ref.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False))
            if routed:
                assert tiered.stats(m).experts_read > 0


    def test_inference_mode_and_grad_mode(self, ckpts):
        path = ckpts["qwen3_moe"]
        ref = STOCK(path, impl="grouped_mm")
        ids = make_ids(14)
        with load_routed(path) as m:
            with torch.inference_mode():
                assert torch.equal(m(ids).logits, ref(ids).logits)
            got = m(ids).logits  # grad mode on: nothing requires grad, same bits
            assert torch.equal(got, ref(ids).logits)



# ---------------------------------------------------------------------------------------------- DBRX
# transformers' DbrxExperts: no ``use_experts_implementation``; its parameters live on the child ``mlp``
# (DbrxExpertGLU) as flat ``(E * F, H)`` matrices, expert j the rows [jF, (j+1)F); its forward loops over the hit
# experts in ascending order and reads the expert count from ``self.num_experts``.


def _dbrx(ckpts):
    path = ckpts["dbrx"]
    ref = STOCK(path)
    return path, ref, ring_below_layer(ref)


def _equal_passes(m, ref, seed: int, passes: int) -> None:
    """Logits and 4 greedy tokens bit for bit stock's for ``passes`` batches of 2 x 6 ids (seeds from ``seed``)."""
    for k in range(passes):
        ids = make_ids(seed + k, (2, 6))
        assert torch.equal(m(ids).logits, ref(ids).logits)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))


def _dbrx_check(m, ref, passes: int = 3) -> None:
    """Logits and 4 greedy tokens bit for bit stock's, ``passes`` times; the experts routed and left unbound."""
    s = tiered.stats(m)
    assert s.expert_modules >= 2
    _equal_passes(m, ref, 40, passes)
    for blk in m.transformer.blocks:
        ex = blk.ffn.experts
        assert ex.num_experts == 4
        assert all(is_placeholder(getattr(ex.mlp, a)) for a in ("w1", "v1", "w2"))


def test_dbrx_routed_equal_to_stock(ckpts):
    path, ref, ring = _dbrx(ckpts)
    layer = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in ref.transformer.blocks)
    assert ring * 2**30 < layer  # a MoE block does not fit the ring
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        specs = tiered.stats(m).placement.specs
        assert [sp.owner for sp in specs] == [b.ffn.experts.mlp for b in m.transformer.blocks]
        assert all(sp.module is b.ffn.experts for sp, b in zip(specs, m.transformer.blocks, strict=True))
        assert {p.target.attr for sp in specs for p in sp.parts} == {"w1", "v1", "w2"}
        assert all(p.slab_shape == (32, 64) for sp in specs for p in sp.parts)
        _dbrx_check(m, ref)
        s = tiered.stats(m).snapshot()
        assert s["experts_read"] > 0 and s["expert_bytes"] > 0
        assert s["dense_bytes"] == s["streamed_bytes"] - s["expert_bytes"] - s["embedding_bytes"]
    with tiered.load(path, ring_gb=1, device="cpu") as m:  # fits: read whole, not routed
        assert tiered.stats(m).expert_modules == 0
        ids = make_ids(4)
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_dbrx_one_token_reads_only_routed_experts(ckpts):
    """A decode step of one token reads top-2 of 4 experts per block: each expert is F contiguous rows of each
    flat matrix."""
    sp, n, nbytes = _one_decode_step(*_dbrx(ckpts), make_ids(3, (1, 6)))
    assert n == 2 * 2  # top-2, 2 blocks
    assert nbytes == 4 * sp.expert_src_bytes == 4 * 3 * 32 * 64 * 2


def _one_decode_step(path, ref, ring, ids):
    """A prompt of ``ids[:, :-1]``, then one decode step, streamed with experts routed, both bit for bit stock's:
    (the first routed spec, experts read by the step, expert bytes read by the step)."""
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        sp = tiered.stats(m).placement.specs[0]
        got = m(ids[:, :-1], use_cache=True)
        want = ref(ids[:, :-1], use_cache=True)
        assert torch.equal(got.logits, want.logits)
        before = tiered.stats(m).snapshot()
        step = m(ids[:, -1:], past_key_values=got.past_key_values, use_cache=True)
        after = tiered.stats(m).snapshot()
        assert torch.equal(step.logits, ref(ids[:, -1:], past_key_values=want.past_key_values, use_cache=True).logits)
    return sp, after["experts_read"] - before["experts_read"], after["expert_bytes"] - before["expert_bytes"]


def test_dbrx_direct_call_equal_to_stock(ckpts):
    """The experts module called alone (int32 and repeated ids, one distinct expert, no token): stock's module's
    result or the same exception (an id == E: one_hot raises in both)."""
    path, ref, ring = _dbrx(ckpts)
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        E, R = m.transformer.blocks[1].ffn.experts, ref.transformer.blocks[1].ffn.experts
        h, idx, w = experts_case(1, 5, 4)
        _same(lambda: R(h[None], idx, w), lambda: E(h[None], idx, w))
        _same(lambda: R(h[None], idx.int(), w), lambda: E(h[None], idx.int(), w))
        one = torch.full_like(idx, 3)
        _same(lambda: R(h[None], one, w), lambda: E(h[None], one, w))
        h0, i0, w0 = experts_case(2, 0, 4)
        _same(lambda: R(h0[None], i0, w0), lambda: E(h0[None], i0, w0))
        sent = idx.clone()
        sent[0, 0] = 4
        _same(lambda: R(h[None], sent, w), lambda: E(h[None], sent, w))
        with pytest.raises(IndexError, match="out of range"):
            E(h[None], idx + 5, w)
        assert E.num_experts == 4 and is_placeholder(E.mlp.w1)
        assert not any(eg.lock.locked() for eg in m._tiered.experts)


def test_dbrx_expert_cache(ckpts):
    """``expert_cache_gb`` (host memory on the CPU): cached experts are served with stock's bits, pass after pass."""
    path, ref, ring = _dbrx(ckpts)
    with tiered.load(path, ring_gb=ring, device="cpu", expert_cache_gb=1.0) as m:
        assert tiered.stats(m).expert_cache_slots == 8  # every expert of both blocks
        _dbrx_check(m, ref)
        s = tiered.stats(m)
        assert s.expert_cache_hits > 0 and s.expert_cache_misses <= 8


def test_dbrx_host_tier_experts(ckpts):
    """``host_gb``: the host tier holds every expert of both blocks (``HostExperts``: ``(E, F, H)`` per flat part),
    read once; calls copy the routed ones from there, read nothing more, and match stock."""
    path, ref, ring = _dbrx(ckpts)
    with tiered.load(path, ring_gb=ring, device="cpu", host_gb=1.0) as m:
        h = m._tiered
        assert tiered.stats(m).host_expert_modules == 2
        for eg in h.experts:
            for p, t in zip(eg.spec.parts, eg.host, strict=True):
                want = ref.get_parameter(f"{eg.spec.name}.mlp.{p.target.attr}")
                assert t.shape == (4, 32, 64) and torch.equal(t.reshape(want.shape), want)
        before = tiered.stats(m).snapshot()
        _dbrx_check(m, ref)
        after = tiered.stats(m).snapshot()
        assert after["experts_read"] == before["experts_read"] and after["experts_from_host"] > 0


def test_dbrx_inspect(ckpts):
    from tiered.cli import inspect_dir

    info = inspect_dir(ckpts["dbrx"])["experts"]
    assert info["blocks"] == 2 and info["experts_per_block"] == 4
    assert info["expert_bytes"] == 3 * 32 * 64 * 2 and info["layout"] == "stacked"
    assert info["spans_per_expert"] == 3 and info["reads_per_expert"] == 3  # w1, v1, w2: F rows of each


# ---------------------------------------------------------------------------------------------- Llama 4
# transformers' Llama4TextExperts: called as experts(routed_in) with no router ids; its block (Llama4TextMoe) scales
# a copy of every token by each expert's router score (sigmoid(-inf) = 0 for the experts not picked) and the module
# runs all E experts (bmm over E). tiered reads only the experts with a nonzero input row, into full (E, ...) tensors
# whose other slabs are zero (a ``dense`` spec).


def _llama4(ckpts, name: str = "llama4"):
    path = ckpts[name]
    ref = STOCK(path)
    return path, ref, ring_below_layer(ref)


@pytest.mark.parametrize("name", ["llama4", "llama4_top2"])
def test_llama4_routed_equal_to_stock(ckpts, name):
    """Logits and greedy tokens bit for bit stock's, with top-1 and top-2 routing, the experts read per call (a
    prompt of 12 tokens in 2 rows picks most experts; decode steps one or two per block) and left unbound."""
    path, ref, ring = _llama4(ckpts, name)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    assert ring * 2**30 < layer  # a MoE layer does not fit the ring
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        specs = tiered.stats(m).placement.specs
        assert [sp.module for sp in specs] == [lay.feed_forward.experts for lay in m.model.layers]
        assert all(sp.dense and sp.num_experts == 4 for sp in specs)
        _equal_passes(m, ref, 60, 3)
        for lay in m.model.layers:
            ex = lay.feed_forward.experts
            assert is_placeholder(ex.gate_up_proj) and is_placeholder(ex.down_proj) and ex.num_experts == 4
        s = tiered.stats(m).snapshot()
        assert s["experts_read"] > 0 and s["expert_bytes"] > 0


def test_llama4_one_token_reads_only_picked_experts(ckpts):
    """A decode step of one token reads top-2 of 4 experts per block (their input rows are the nonzero ones)."""
    sp, n, nbytes = _one_decode_step(*_llama4(ckpts, "llama4_top2"), make_ids(61, (1, 6)))
    assert n == 2 * 2  # top-2, 2 blocks
    assert nbytes == 4 * sp.expert_src_bytes == 4 * (64 * 64 + 32 * 64) * 2


def test_llama4_direct_call_equal_to_stock(ckpts):
    """The experts module called alone: blocks of zero rows (some, all, none), -0.0, NaN and inf rows, and an input
    that is not E equal blocks: stock's module's result (NaN where stock's is) or the same exception."""
    path, ref, ring = _llama4(ckpts)
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        E, R = m.model.layers[1].feed_forward.experts, ref.model.layers[1].feed_forward.experts
        g = torch.Generator().manual_seed(7)
        x = torch.randn(4 * 3, 64, generator=g).to(torch.bfloat16)
        cases = {"all": x}
        for name, zero in (("one", [0, 2, 3]), ("two", [1, 3]), ("none", [0, 1, 2, 3])):
            c = x.clone().view(4, 3, 64)
            c[zero] = 0
            cases[name] = c.view(12, 64)
        c = cases["one"].clone()
        c[:3] = -0.0  # expert 0's rows: negative zeros, as x * 0 gives for x < 0
        cases["neg_zero"] = c
        for bad in (float("nan"), float("inf")):
            c = cases["one"].clone()
            c[4, 5] = bad  # expert 1's block gets one non-finite element
            cases[str(bad)] = c
        for name, c in cases.items():
            want, got = R(c), E(c)
            assert torch.equal(want.isnan(), got.isnan()), name
            assert torch.equal(want.nan_to_num(), got.nan_to_num()), name
        _same(lambda: R(x[:10]), lambda: E(x[:10]))  # 10 rows: not 4 equal blocks, stock's view raises
        assert is_placeholder(E.gate_up_proj) and not any(eg.lock.locked() for eg in m._tiered.experts)


def test_llama4_expert_cache_and_host_tier(ckpts):
    """``expert_cache_gb`` and ``host_gb``: experts served from the cache or the host tier land in their own slab of
    the full tensors, with stock's bits."""
    path, ref, ring = _llama4(ckpts, "llama4_top2")
    for kw in ({"expert_cache_gb": 1.0}, {"host_gb": 1.0}):
        with tiered.load(path, ring_gb=ring, device="cpu", **kw) as m:
            for k in range(2):
                ids = make_ids(70 + k, (2, 5))
                assert torch.equal(m(ids).logits, ref(ids).logits)
                assert torch.equal(m.generate(ids, max_new_tokens=3, do_sample=False),
                                   ref.generate(ids, max_new_tokens=3, do_sample=False))
            s = tiered.stats(m)
            assert (s.expert_cache_hits > 0) if "expert_cache_gb" in kw else (s.host_expert_modules == 2)


def test_routed_experts_call_memory_counts_against_the_host(ckpts, monkeypatch):
    """On the CPU a routed block's experts live in host memory for its call (every expert: a prefill may pick them
    all; Llama 4 always reads into full tensors). The host check counts them beside the ring, and the automatic ring
    leaves room for them. Before the fix: accepted at load, then one decode token grew RSS past what was checked."""
    import tiered.api
    from tiered import policy
    from tiered.machine import Machine

    path, ref, ring = _llama4(ckpts)
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        sp = tiered.stats(m).placement.specs[0]
        call = sp.num_experts * sp.expert_bytes
        ring_bytes = tiered.stats(m).placement.ring_bytes
    head = policy.headroom(False)

    def host(avail: int) -> None:
        monkeypatch.setattr(tiered.api, "gather", lambda dev=None, **kw: Machine(host_available=avail,
                                                                                 host_where="cgroup /t memory.max"))

    host(head + ring_bytes + call // 2)
    with pytest.raises(tiered.HostMemoryError, match="routed experts during its call"):
        tiered.load(path, ring_gb=ring, device="cpu")
    host(head + ring_bytes + call + 4096)
    with tiered.load(path, ring_gb=ring, device="cpu") as m:
        ids = make_ids(90, (1, 6))
        assert torch.equal(m(ids).logits, ref(ids).logits)
    host(head + (32 << 20) + call)  # the automatic ring: what is left after the headroom and the experts' call
    with tiered.load(path, device="cpu") as m:
        p = tiered.stats(m).placement
        assert p.ring_gb * 2**30 <= 32 << 20 and "routed experts" in p.ring_why


@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_staged_reads_in_file_order_merge_an_experts_adjacent_projections(io: str, tmp_path) -> None:
    """CUDA routed experts pack each staging batch from a list of chunks (``ExpertGather._read_cuda``); with
    ``tiered.experts.MERGE_STAGED_READS`` they are packed in file order (``staged_reads``), so an FP8 expert's three
    projections, adjacent in a safetensors file, land adjacent in the staging and are read as one request
    (``read_pairs``) instead of three: here two experts' six float8 tensors become one read, and the staging holds the
    same bytes as six reads put it there. (The device path itself runs under ``pytest -m cuda``.)"""
    import types

    from safetensors.torch import save_file

    from tiered.experts import read_pairs, staged_reads
    from tiered.format import open_checkpoint
    from tiered.reader import Reader

    g = torch.Generator().manual_seed(7)
    names = [f"experts.{j}.{p}_proj.weight" for j in range(2) for p in ("gate", "up", "down")]
    save_file({n: (torch.randn(16, 64, generator=g) * 8).to(torch.float8_e4m3fn) for n in names},
              str(tmp_path / "model.safetensors"))
    ck = open_checkpoint(tmp_path)
    infos = {n: ck.tensors[n] for n in names}
    loop_order = [infos[f"experts.{j}.{p}_proj.weight"] for p in ("gate", "up") for j in range(2)] + \
        [infos[f"experts.{j}.down_proj.weight"] for j in range(2)]  # as _read_cuda builds them: by part, then expert
    by_file = sorted(infos.values(), key=lambda i: i.offset)
    assert all(b.offset == a.offset + a.nbytes for a, b in zip(by_file[:-1], by_file[1:], strict=True))  # adjacent in file
    unit = types.SimpleNamespace(name="experts")
    reader = Reader(ck, threads=2, io=io)
    try:
        got = {}
        for merge in (False, True):
            chunks = staged_reads([([i], None, None) for i in loop_order], merge)
            staging = torch.full((sum(i.nbytes for i in infos.values()) + 4096,), 0xEE, dtype=torch.uint8)
            pairs, used = [], 0
            for srcs, _, _ in chunks:  # packed one after the other, as the staging batch is
                pairs.append((srcs[0], staging[used:used + srcs[0].nbytes].view(srcs[0].dtype)))
                used += srcs[0].nbytes
            reads = read_pairs(pairs, merge)
            assert len(reads) == (1 if merge else 6), [r[0].name for r in reads]
            reader.copy_all(unit, reads, chunk=8 << 20)
            got[merge] = {srcs[0].name: p[1].view(torch.uint8).clone() for (srcs, _, _), p in zip(chunks, pairs, strict=True)}
    finally:
        reader.close()
    from safetensors.torch import load_file

    stock = load_file(str(tmp_path / "model.safetensors"))
    for n in infos:
        want = stock[n].reshape(-1).view(torch.uint8)
        assert torch.equal(got[True][n], want) and torch.equal(got[False][n], want), n
        assert want.float().abs().sum() > 0  # not all-zero data
    assert staged_reads([([by_file[2]], None, None), ([by_file[0]], None, None)], False)[0][0][0] is by_file[2]
