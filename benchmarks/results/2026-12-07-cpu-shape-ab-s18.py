"""One-off CPU A/B (session 18): io="auto" forced to O_DIRECT (page_cache_room faked small), read shapes measured
(SHAPES as committed) against fixed (SHAPES[:1]); TinyLlama-1.1B bf16 L22, ring 0.3 GiB; s per forward of 8 tokens."""
import statistics
import sys
import time

import torch

import tiered
import tiered.machine
import tiered.reader

d = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
passes = 7
tiered.machine.page_cache_room = lambda: (1, "faked: cgroup /x memory.max=1")
ALL = tiered.reader.SHAPES
ids = torch.randint(100, 30000, (1, 8), generator=torch.Generator().manual_seed(0))
res = {"measured": [], "fixed": []}
torch.set_num_threads(1)
for rnd in range(rounds):
    order = ["measured", "fixed"] if rnd % 2 == 0 else ["fixed", "measured"]
    for v in order:
        tiered.reader.SHAPES = ALL if v == "measured" else ALL[:1]
        with tiered.load(d, device="cpu", ring_gb=0.3, io="auto", zero_copy=False, compute_threads=1) as m, torch.no_grad():
            ts = []
            for _ in range(passes):
                t0 = time.perf_counter()
                m(ids)
                ts.append(time.perf_counter() - t0)
            r = m._tiered.reader
            ch = r.choice or {}
            steady = statistics.median(ts[3:])
            res[v].append(steady)
            print(f"round {rnd} {v:8} passes {' '.join(f'{t:.2f}' for t in ts)} steady {steady:.3f} "
                  f"chosen {ch.get('chosen')} shape {r.shape[0] >> 20} MiB x{r.shape[1]} "
                  f"shapes {({k: round(g, 2) for k, g in ch.get('shapes', {}).items()})} "
                  f"direct {ch.get('direct_gbps', 0):.2f} pread {ch.get('pread_gbps', 0):.2f} reprobes {r.reprobes}",
                  flush=True)
for v, xs in res.items():
    print(v, "median", f"{statistics.median(xs):.3f}", "spread", f"{min(xs):.3f}-{max(xs):.3f}")
print("fixed / measured:", f"{statistics.median(res['fixed']) / statistics.median(res['measured']):.3f}")
