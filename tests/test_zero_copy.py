"""CPU zero copy (io="mmap", the default): streamed units that need no conversion compute on views of the
checkpoint's file mapping, as ``from_pretrained`` does, and drop its pages after they run.

Equality is with stock ``transformers`` bit for bit; the RSS bound is in tests/test_rss.py (subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import Checkpoints
from models import VOCAB

import tiered

ROOT = Path(__file__).resolve().parents[1]
TINY_RING = 64 * 1024 / 2**30  # 64 KiB: smaller than any test model's largest unit


def _ids(seed: int, shape=(2, 7)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["llama_fp32", "llama", "gptj", "gpt2", "llama_tied_single"])
def test_equal_to_stock_with_a_ring_smaller_than_any_unit(name: str, ckpts: Checkpoints) -> None:
    """Every unit computes on the mapping (no ring needed at all); logits for a one-token and a longer input, and
    greedy generate, equal stock's. In fp32 the one-token product rounds with the weight's address: the mapping
    gives the same addresses as stock's, where a 64-byte aligned copy in the ring did not."""
    d = ckpts[name]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=TINY_RING) as m, torch.no_grad():
        s = tiered.stats(m)
        assert s.mapped_units >= s.units - 2 and s.resident_units == 0, s  # (an embedding may read rows instead)
        for shape in ((1, 1), (2, 7)):
            ids = _ids(1, shape)
            assert torch.equal(m(ids).logits, ref(ids).logits), shape
        ids = _ids(2, (1, 5))
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False),
                           ref.generate(ids, max_new_tokens=6, do_sample=False))
        # between passes no streamed parameter is bound: the placeholders are back
        layer = m.model.layers[0] if hasattr(m, "model") and hasattr(m.model, "layers") else None
        if layer is not None:
            assert all(p.device.type == "meta" for p in layer.parameters())


def test_bert_encoder(ckpts: Checkpoints) -> None:
    d = ckpts["bert"]
    ref = transformers.AutoModel.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=TINY_RING) as m, torch.no_grad():
        assert tiered.stats(m).mapped_units > 0
        ids = _ids(3)
        assert torch.equal(m(ids).last_hidden_state, ref(ids).last_hidden_state)


def test_a_unit_larger_than_the_ring(tmp_path: Path) -> None:
    """An untied lm_head of 8192 x 64 fp32 (2 MiB) with a 0.5 MiB ring: zero copy runs it, equal to stock; the
    ring path refuses it, naming the unit (issue 8, capability 1, on the CPU)."""
    import models

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=3, dtype=torch.float32,
                      max_shard_size=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ring_gb = 0.5 / 1024
    with pytest.raises(tiered.RingTooSmallError, match="lm_head"):
        tiered.load(tmp_path / "m", device="cpu", ring_gb=ring_gb, zero_copy=False)
    ids = torch.tensor([[7, 8191, 0, 4000, 7]])
    with tiered.load(tmp_path / "m", device="cpu", ring_gb=ring_gb) as m, torch.no_grad():
        assert torch.equal(m(ids).logits, ref(ids).logits)
        s = tiered.stats(m)
        assert s.ring_high_water == 0 and s.streamed_bytes >= 8192 * 64 * 4


def test_converted_units_still_use_the_ring(ckpts: Checkpoints) -> None:
    """A unit whose tensors need a conversion (a cast) is copied through the ring; the rest is mapped."""
    d = ckpts["llama_fp32"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with tiered.load(d, device="cpu", ring_gb=0.002, dtype=torch.bfloat16) as m, torch.no_grad():
        s = tiered.stats(m)
        assert s.mapped_units == 0  # fp32 on disk, bf16 in the model: every unit casts
        ids = _ids(4)
        assert torch.equal(m(ids).logits, ref(ids).logits)
        assert tiered.stats(m).ring_high_water > 0


def test_zero_copy_off_is_the_ring(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=0.002, zero_copy=False) as m, torch.no_grad():
        assert tiered.stats(m).mapped_units == 0
        ids = _ids(5)
        assert torch.equal(m(ids).logits, ref(ids).logits)


TRUNCATE = textwrap.dedent(
    """
    import os, sys, torch, tiered
    d = sys.argv[1]
    m = tiered.load(d, device="cpu", ring_gb=64 * 1024 / 2**30)
    ids = torch.arange(1, 6).unsqueeze(0)
    with torch.no_grad():
        m(ids)  # the next pass's first units are prefetched now: views of the mapping
        shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[-1]
        with open(os.path.join(d, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(d, shard)) // 2)
        try:
            m(ids)
        except tiered.TruncatedShardError as e:
            print("TRUNCATED", shard in str(e))
        except tiered.StreamerError as e:
            print("STREAMER", type(e.__cause__).__name__, shard in str(e) + str(e.__cause__))
    """
)


def test_shard_truncated_under_a_mapped_unit_is_an_error_not_sigbus(ckpts: Checkpoints, tmp_path: Path) -> None:
    """A shard cut short after its units were prefetched as views: the check before compute raises (a SIGBUS
    would kill the process: run in a child)."""
    d = ckpts.copy("llama", tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", TRUNCATE, str(d)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert "TRUNCATED True" in out.stdout or "STREAMER TruncatedShardError True" in out.stdout, out.stdout
