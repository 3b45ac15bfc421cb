"""Compiled decoding on a streamed model (issue 9, capability 6): ``generate(cache_implementation="static")``,
which makes transformers compile the forward, against eager ``generate`` on the same streamed model: tokens,
decode s/token (median of steps, after a warm-up generate that pays the compile), graph breaks and recompiles
counted by dynamo. One JSON line.

    python benchmarks/compile_check.py MODEL_DIR --ring-gb 0.5 --gpu-gb 0.5 --new-tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from systems import Clock, json_line  # noqa: E402

import tiered  # noqa: E402


def _decode(m, ids, n, **kw):
    clock = Clock()
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=clock, **kw)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return statistics.median(steps), out[0, ids.shape[1]:].tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ring-gb", type=float, default=0.5)
    p.add_argument("--gpu-gb", type=float, default=0.5)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    res: dict = {"model_dir": str(a.model_dir), "ring_gb": a.ring_gb, "gpu_gb": a.gpu_gb}
    with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=a.gpu_gb) as m:
        s = tiered.stats(m)
        res["units"], res["resident_units"] = s.units, s.resident_units
        ids = torch.randint(100, min(m.config.vocab_size, 30000), (1, 16), device=m.device)
        _decode(m, ids, 2)
        res["eager_s_per_token"], want = _decode(m, ids, a.new_tokens)
        dynamo.reset()
        dynamo.utils.counters.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t = time.perf_counter()
            _decode(m, ids, a.new_tokens, cache_implementation="static")  # pays the compile
            res["static_first_generate_s"] = time.perf_counter() - t
            res["static_s_per_token"], got = _decode(m, ids, a.new_tokens, cache_implementation="static")
        res["static_tokens_equal_eager"] = got == want
        res["graph_breaks"] = sum(dynamo.utils.counters["graph_break"].values())
        res["graph_break_reasons"] = {k[:160]: v for k, v in list(dynamo.utils.counters["graph_break"].items())[:8]}
        res["recompiles"] = dict(dynamo.utils.counters["recompiles"]) if "recompiles" in dynamo.utils.counters else {}
        res["unique_graphs"] = dynamo.utils.counters["stats"].get("unique_graphs", 0)
        res["warnings"] = sorted({str(x.message)[:200] for x in w})[:8]
        res["recompile_limit_warnings"] = sum("recompile" in str(x.message).lower() for x in w)
    json_line(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
