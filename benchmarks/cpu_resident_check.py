"""Resident decode on the CPU against stock transformers (issue 9: "CPU, resident: decode within 3% of stock"),
alternating in one process so both see the same machine state: a Llama-shaped fp32 checkpoint (16 layers by
default, made by make_checkpoint.py), tiered with a ring that holds it (every unit loaded once) and
``from_pretrained``, ``--reps`` rounds of greedy ``generate`` each; medians of the per-token decode time, the
ratio, and whether the tokens are the same. One JSON line.

    python benchmarks/cpu_resident_check.py --layers 16 --reps 5 --new-tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from systems import Clock, json_line  # noqa: E402

import tiered  # noqa: E402


def _decode(m, ids, n):
    clock = Clock()
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=clock)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]  # decode steps, after the prefill
    return statistics.median(steps), out[0, ids.shape[1]:].tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--scale", type=float, default=0.125, help="make_checkpoint --scale (default 0.125: hidden 512)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cache", type=Path, default=Path("/tmp/tiered-cache"))
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    d = a.cache / f"llama3-8b-fp32-L{a.layers}-s{a.scale}"
    if not d.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"), "--arch", "llama3-8b",
                        "--dtype", "fp32", "--layers", str(a.layers), "--scale", str(a.scale), "--quiet", str(d)],
                       check=True)
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    m = tiered.load(d, device="cpu", ring_gb=size * 1.1 / 2**30)
    assert tiered.stats(m).resident_units == tiered.stats(m).units
    ids = torch.randint(100, 30000, (1, 16))
    res: dict = {"model_dir": str(d), "model_gb": size / 1e9, "threads": torch.get_num_threads(), "tiered": [],
                 "stock": []}
    _decode(stock, ids, 2)
    _decode(m, ids, 2)
    for _ in range(a.reps):
        t, tok_t = _decode(m, ids, a.new_tokens)
        s, tok_s = _decode(stock, ids, a.new_tokens)
        res["tiered"].append(t)
        res["stock"].append(s)
        res["same_tokens"] = tok_t == tok_s
    res["tiered_median"] = statistics.median(res["tiered"])
    res["stock_median"] = statistics.median(res["stock"])
    res["ratio"] = res["tiered_median"] / res["stock_median"]
    m.close()
    json_line(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
