"""Bitwise equality on a GPU: ``tiered.load(device="cuda")`` against stock ``transformers`` on the same GPU.

For every tiny architecture of ``tests/models.py`` (Llama tied/untied, GPT-J, GPT-2, BERT,
Mixtral, Qwen2-MoE; sharded and unsharded), resident (whole model on the GPU) and streamed
(``gpu_gb=0``: every unit through the ring and the copy stream, every pass), compares logits
(``torch.equal``) and greedy ``generate`` ids. Prints a table; exits 1 on any difference.

    python benchmarks/gpu_equality.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from models import BUILDERS, VOCAB  # noqa: E402

import tiered  # noqa: E402


def run(name: str, d: Path, auto, causal: bool, mode: str, dtype: torch.dtype | None, dev: str) -> dict:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)).to(dev)
    kw = {"dtype": dtype} if dtype is not None else {}
    ref = auto.from_pretrained(d, device_map=dev, **kw).eval()
    if mode == "streamed":
        model = tiered.load(d, device=dev, gpu_gb=0, ring_gb=0.0005, dtype=dtype)
    else:
        model = tiered.load(d, device=dev, ring_gb=0.05, dtype=dtype)
    with torch.no_grad():
        a = ref(ids)
        b = model(ids)
        key = "logits" if causal else "last_hidden_state"
        same = torch.equal(a[key], b[key])
        maxdiff = (a[key].float() - b[key].float()).abs().max().item()
        gen_same = None
        if causal:
            ga = ref.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
            gb = model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
            gen_same = torch.equal(ga, gb)
    s = tiered.stats(model)
    model.close()
    del ref
    return {"model": name, "mode": mode, "dtype": str(dtype or "config"), "logits_equal": same,
            "max_abs_diff": maxdiff,
            "generate_equal": gen_same, "resident_units": s.resident_units, "units": s.units,
            "h2d_gb": s.h2d_bytes / 1e9, "hits": s.hits, "misses": s.misses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, kw, auto, causal) in BUILDERS.items():
            d = build(Path(tmp) / name, **kw)
            for mode in ("resident", "streamed"):
                rows.append(run(name, d, auto, causal, mode, None, a.device))
                print(json.dumps(rows[-1]), flush=True)
        d = Path(tmp) / "llama_fp32"
        for mode in ("resident", "streamed"):
            rows.append(run("llama_fp32->bf16", d, BUILDERS["llama_fp32"][2], True, mode, torch.bfloat16, a.device))
            print(json.dumps(rows[-1]), flush=True)
    bad = [r for r in rows if not r["logits_equal"] or r["generate_equal"] is False]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    if a.out:
        gpu = torch.cuda.get_device_name() if a.device != "cpu" else "cpu"
        a.out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows},
                                    indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
