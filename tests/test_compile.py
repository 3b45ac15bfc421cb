"""torch.compile over a streamed model (issue 9, capability 6, first step): the streamer's hooks are opaque
to dynamo — the unit's root hooks are ``torch.compiler.disable``d, the hooks inside a unit are no-ops while
dynamo traces — so compiled forwards give stock ``transformers``' bits and dynamo never traces tiered's own
code (its locks and dicts), breaking the graph only at unit boundaries."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_cache_bytes, assert_clean, load_mix, logits_of, make_ids, streaming_ring_gb

import tiered

GiB = 1 << 30


def test_compiled_forward_equals_stock_and_breaks_only_at_units(ckpts):
    dynamo = pytest.importorskip("torch._dynamo")
    path = ckpts["llama_fp32"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 9, 22, 7, 3]])
    with torch.no_grad():
        want = ref(ids).logits
    with tiered.load(path, ring_gb=1, device="cpu") as probe:
        ring = streaming_ring_gb(probe)
    m = tiered.load(path, ring_gb=ring, device="cpu")
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(m, backend="eager")
    with m, torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(ids).logits, want)
        s = tiered.stats(m).snapshot()
        assert s["units_streamed"] >= 3 * (s["units"] - s["row_units"])  # it streamed: not all resident
    breaks = dynamo.utils.counters["graph_break"]
    # never inside tiered: only the disabled hooks (one per unit boundary, deduplicated by reason) and the
    # model's own lock
    assert not [r for r in breaks if "tiered" in r and "disable" not in r and "lock" not in r], dict(breaks)
    assert sum(breaks.values()) <= 2 * s["units"], dict(breaks)


def test_deep_model_compiles_each_layer_without_hitting_the_recompile_limit(tmp_path):
    """Issue 9, capability 6: the graph breaks at each unit, so dynamo compiles each decoder layer (specialised on
    its layer_idx) as an entry of one code object; on a 12-layer model that passed dynamo's default limit of 8
    and the later layers fell back to eager with a warning. tiered raises the limit to fit its units."""
    import logging

    import models

    dynamo = pytest.importorskip("torch._dynamo")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=1, dtype=torch.float32,
                             max_shard_size="40KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("torch._dynamo")
    handler = Catch(level=logging.WARNING)
    log.addHandler(handler)
    try:
        with tiered.load(path, ring_gb=0.0003, device="cpu") as m, torch.no_grad():
            assert tiered.stats(m).resident_units == 0
            dynamo.reset()
            compiled = torch.compile(m, backend="eager")
            for n in (6, 1, 1, 9):  # a prefill, then other shapes
                ids = torch.arange(1, n + 1).reshape(1, n)
                assert torch.equal(compiled(ids).logits, ref(ids).logits)
    finally:
        log.removeHandler(handler)
        dynamo.reset()
    assert not [s for s in seen if "recompile_limit" in s or "cache_size_limit" in s], seen


class TestHostile:
    """torch.compile over the modules CallGuard binds per call (tests/test_guard.py)."""

    def test_compile_eager_with_rows_experts_and_cache(self, mix, stock, ring_rows):
        """torch.compile(backend='eager') of a model with a row-streamed embedding, routed experts and an expert
        cache: logits equal stock, twice (the second with cache hits), the guards run eagerly (graph breaks at the
        modules, no tracing into their locks)."""
        import torch._dynamo

        ref = stock(mix, impl="grouped_mm")
        a, b = make_ids(14, (2, 9)), make_ids(15, (1, 4))
        wa, wb = logits_of(ref, a), logits_of(ref, b)
        torch._dynamo.reset()
        try:
            with load_mix(mix, ring_rows, expert_cache_gb=4.5 * 36864 / GiB) as m, torch.no_grad():
                cm = torch.compile(m, backend="eager")
                assert torch.equal(cm(a).logits, wa)
                assert torch.equal(cm(a).logits, wa)  # the cache hits now
                assert torch.equal(m(b).logits, wb)  # and the eager model beside the compiled one
                assert_clean(m)
                s = tiered.stats(m).snapshot()
                assert s["experts_read"] > 0 and s["embedding_bytes"] > 0 and s["expert_cache_hits"] > 0
                assert_cache_bytes(m, ref)
        finally:
            torch._dynamo.reset()
