"""``transformers.pipeline`` accepts a tiered model like any other (device, dtype, forward hooks)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

import tiered


def test_feature_extraction_pipeline_matches_stock(minilm_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    text = ["A fixed ring of host memory.", "Streaming weights layer by layer."]
    want = transformers.pipeline("feature-extraction", model=ref, tokenizer=tok, device="cpu")(text)
    with tiered.load(minilm_dir, ring_gb=0.05, device="cpu") as m:
        got = transformers.pipeline("feature-extraction", model=m, tokenizer=tok, device="cpu")(text)
        assert tiered.stats(m).resident_units == 0  # 0.05 GiB < 87 MiB model: really streamed
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        g, w = torch.tensor(g), torch.tensor(w)
        assert g.abs().sum() > 0 and torch.equal(g, w)
