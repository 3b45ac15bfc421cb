"""torch.compile over a streamed model (issue 9, capability 6, first step): the streamer's hooks are opaque
to dynamo — the unit's root hooks are ``torch.compiler.disable``d, the hooks inside a unit are no-ops while
dynamo traces — so compiled forwards give stock ``transformers``' bits and dynamo never traces tiered's own
code (its locks and dicts), breaking the graph only at unit boundaries."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import streaming_ring_gb

import tiered


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
