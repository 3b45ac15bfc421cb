#!/usr/bin/env python
"""Does SDPA's cuDNN graph build for a new sequence length wait for the GPU? (diagnostic; CUDA)

    python benchmarks/sdpa_build_probe.py [--copy-gib 2]

Times, on the host, one ``F.scaled_dot_product_attention`` decode call (q ``(1, 32, 1, 128)``, k/v
``(1, 32, n, 128)``, bf16, cuDNN backend forced) in these cases, each with a length ``n`` new to the process
unless it says "seen":

* ``idle``: nothing queued on the GPU;
* ``idle-seen``: the same ``n`` again, new tensors (is the built graph reused?);
* ``after-copy-current``: just after queueing an H2D of ``--copy-gib`` GiB of pinned memory on the current stream;
* ``after-copy-side``: the same copy on a second stream (``torch.cuda.Stream()``, which does not synchronise with
  the default stream);
* ``after-copy-current-seen``: the copy on the current stream, then a seen ``n``.

If ``after-copy-current`` takes about the copy's time plus ``idle``, the build waits for the current stream; if
``after-copy-side`` does too, it waits for the whole device. Prints one JSON line (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(int(a.copy_gib * 2**30), dtype=torch.uint8).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    n_next = [300]

    def call(n: int) -> float:
        q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
        t = time.perf_counter()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v)
        return (time.perf_counter() - t) * 1e3

    def new() -> int:
        n_next[0] += 1
        return n_next[0]

    call(new())  # cuDNN's handle and library loads, once
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    res: dict[str, list[float]] = {"copy_ms": [(time.perf_counter() - t) * 1e3]}
    for _ in range(a.reps):
        n = new()
        torch.cuda.synchronize()
        res.setdefault("idle", []).append(call(n))
        torch.cuda.synchronize()
        res.setdefault("idle-seen", []).append(call(n))
        torch.cuda.synchronize()
        dst.copy_(src, non_blocking=True)
        res.setdefault("after-copy-current", []).append(call(new()))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        res.setdefault("after-copy-side", []).append(call(new()))
        torch.cuda.synchronize()
        dst.copy_(src, non_blocking=True)
        res.setdefault("after-copy-current-seen", []).append(call(n))
        torch.cuda.synchronize()
    print(json.dumps({k: round(statistics.median(v), 2) for k, v in res.items()} | {"all_ms": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
