#!/usr/bin/env python
"""Where a routed-experts decode step spends its time (diagnostic; one process, CUDA).

    python benchmarks/moe_profile.py MODEL_DIR [--gpu-gb 2] [--ring-gb 6] [--threads 4] [--host-gb 0] [--profile]

Loads the model twice: all resident (``gpu_gb=100``: the compute floor) and streamed with routed experts,
decodes the same greedy tokens, and reports the median decode s/token of each plus, for the routed run,
the seconds per token spent in the experts pre-hooks (ids to host, reads, H2D issue) and in the reads alone.
``--host-gb``: the routed run's host tier (its units, then whole blocks' experts: H2D from pinned memory, no read).
``--profile``: also a ``torch.profiler`` table of the routed run's last decode tokens (CPU and CUDA time per op,
memcpy HtoD included) on stderr. Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

import tiered
from tiered import experts as ex

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import Clock, budget_args, greedy, parser  # noqa: E402


def _decode(model, ids, n):
    c = Clock()
    out = greedy(model, ids, n, streamer=c)
    steps = [b - a for a, b in zip(c.times[1:], c.times[2:], strict=False)]
    return statistics.median(steps), out[0, ids.shape[1]:].tolist()


def main() -> int:
    p = parser(__doc__)
    budget_args(p, new_tokens=8, host_gb=0.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the all-resident load (its compute floor): the routed run then starts in a fresh process")
    p.add_argument("--prewarm-gb", type=float, default=0.0,
                   help="allocate and free this many GB on the GPU first (the caching allocator keeps the segment)")
    a = p.parse_args()
    if a.prewarm_gb:
        torch.empty(int(a.prewarm_gb * 1e9), dtype=torch.uint8, device="cuda")
    torch.manual_seed(0)
    ids = torch.randint(100, 30000, (1, 16)).cuda()
    res = {}
    toks_r = None
    if not a.no_resident:
        with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=100, threads=a.threads) as m:
            res["resident_s_per_token"], toks_r = _decode(m, ids, a.new_tokens)
    acc = {"hook": 0.0, "read": 0.0, "ids": 0.0}
    real_pre, real_copy = ex.ExpertGather.bind, None

    def pre(self, args, kwargs):
        t = time.perf_counter()
        try:
            return real_pre(self, args, kwargs)
        finally:
            acc["hook"] += time.perf_counter() - t

    ex.ExpertGather.bind = pre
    with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=a.gpu_gb, threads=a.threads, host_gb=a.host_gb) as m:
        real_copy = m._tiered.reader.copy_all

        def copy_all(*args, **kw):
            t = time.perf_counter()
            try:
                return real_copy(*args, **kw)
            finally:
                acc["read"] += time.perf_counter() - t

        m._tiered.reader.copy_all = copy_all
        _decode(m, ids, 2)  # warm-up
        for k in acc:
            acc[k] = 0.0
        t0 = time.perf_counter()
        res["routed_s_per_token"], toks = _decode(m, ids, a.new_tokens)
        total = time.perf_counter() - t0
        s = tiered.stats(m).snapshot()
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                res["profiled_s_per_token"], _ = _decode(m, ids, 4)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14), file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), file=sys.stderr)
    res.update({"host_gb": a.host_gb, "host_expert_modules": s["host_expert_modules"], "routed_total_s": total,
                "hook_s": acc["hook"], "read_s": acc["read"], "tokens_equal": None if toks_r is None else toks == toks_r,
                "experts_read": s["experts_read"], "experts_from_host": s["experts_from_host"],
                "expert_calls": s["expert_calls"], "expert_gb": s["expert_bytes"] / 1e9})
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
