#!/usr/bin/env python
"""Issue 8's case on the CPU: a Llama-shaped checkpoint with a 32000 x 2048 fp32 embedding (0.245 GiB) and an
untied head of the same size, run with ``ring_gb=0.125``: peak RSS growth against ring + 200 MiB, and logits and
greedy tokens against stock ``transformers``, for zero copy (the CPU default) and the ring copy.

    python benchmarks/big_unit_cpu.py          # writes the 0.59 GiB checkpoint once to $TIERED_CACHE (or /tmp)

Each run is its own child process (its own VmHWM). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import json, sys, torch, transformers, tiered
transformers.LlamaForCausalLM
from tiered.stats import proc_status
torch.set_num_threads(2)
ids = torch.tensor([[1, 500, 31999, 7, 7]])
base = proc_status()["VmRSS"]
m = tiered.load(sys.argv[1], ring_gb=0.125, device="cpu", zero_copy=sys.argv[2] == "1")
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=4, do_sample=False)
    logits = m(ids).logits
s = tiered.stats(m).snapshot()
torch.save(logits, sys.argv[3])
print(json.dumps({"growth_mib": (proc_status()["VmHWM"] - base) / 2**20, "tokens": out[0].tolist(),
                  "mapped": s["mapped_units"], "rows": s["row_units"], "ring_mib": s["ring_bytes"] / 2**20}))
'''


def main() -> int:
    d = Path(os.environ.get("TIERED_CACHE", "/tmp")) / "big-unit-llama-fp32"
    if not (d / "config.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        import models

        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
        models.save_model(transformers.LlamaForCausalLM(cfg), d, seed=1, dtype=torch.float32, max_shard_size="200MB")
    ids = torch.tensor([[1, 500, 31999, 7, 7]])
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, max_new_tokens=4, do_sample=False)[0].tolist()
    del ref
    res: dict = {"checkpoint_gib": sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**30, "ring_gb": 0.125}
    for zc, key in (("1", "zero_copy"), ("0", "ring_copy")):
        out = d.parent / f"big-unit-logits{zc}.pt"
        p = subprocess.run([sys.executable, "-c", CHILD, str(d), zc, str(out)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        if p.returncode != 0:
            res[key] = p.stderr.strip().splitlines()[-1]
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["logits_equal"] = torch.equal(torch.load(out), want)
        r["tokens_equal"] = r.pop("tokens") == want_tokens
        r["within_ring_plus_200_mib"] = r["growth_mib"] <= 0.125 * 1024 + 200
        res[key] = r
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
