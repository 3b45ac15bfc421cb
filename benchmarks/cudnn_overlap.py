"""Does stock SDPA's cuDNN graph build (one per new KV length) wait for H2D copies on another stream?

Usage (GPU machine): ``python benchmarks/cudnn_overlap.py`` prints one JSON line.

* ``copy_alone_gbps``: 8 pinned 512 MiB H2D copies on a side stream, nothing else running.
* ``a0..a2``: the same 8 copies issued first, then three SDPA calls (decode shape: q length 1, 32 heads, 8 KV heads
  repeated, bf16) at new KV lengths on the default stream; ``sdpa_cpu_ms`` is each call's host time. If the first
  call's host time equals the copies' GPU time (``copy_ms``) rather than a build's ~40 ms, the build waited for them.
* ``b0..b2``: 16 copies issued from a second Python thread while the main thread runs the SDPA calls.

Measured on the H200 (2026-12-04, ``results/2026-12-04b-h200-call2-cudnn-build-vs-h2d.json``): a build costs 39-42 ms
of host time with no copy in flight and the first call after 78 ms of queued copies takes 79-80 ms: the build returns
only once the copy stream's queue has drained.
"""
import json
import threading
import time

import torch
import torch.nn.functional as F

GIB = 1 << 30


def sdpa(n: int, dev: torch.device) -> float:
    """One decode-shaped SDPA call at KV length ``n``; returns its host time in seconds."""
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16).repeat_interleave(4, 1)
    v = torch.randn_like(k)
    t = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v)
    c = time.perf_counter() - t
    torch.cuda.synchronize()
    return c


def main() -> None:
    dev = torch.device("cuda")
    src = torch.empty(512 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    cs = torch.cuda.Stream()

    def copies(n: int, issued: list | None = None, t0: float = 0.0) -> None:
        with torch.cuda.stream(cs):
            for _ in range(n):
                dst.copy_(src, non_blocking=True)
                if issued is not None:
                    issued.append(round((time.perf_counter() - t0) * 1e3, 1))

    for n in (5, 6):
        sdpa(n, dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    copies(8)
    cs.synchronize()
    base = time.perf_counter() - t
    res: dict = {"copy_alone_gbps": 8 * 0.5 * GIB / base / 1e9, "cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled()}
    for trial in range(3):  # (a) copies queued first, then three builds
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(cs)
        copies(8)
        e1.record(cs)
        cpu = [sdpa(100 + 10 * trial + j, dev) for j in range(3)]
        cs.synchronize()
        res[f"a{trial}"] = {"copy_ms": e0.elapsed_time(e1), "alone_ms": base * 1e3,
                            "sdpa_cpu_ms": [round(c * 1e3, 1) for c in cpu]}
    for trial in range(3):  # (b) copies issued from a second thread while the builds run
        torch.cuda.synchronize()
        issued: list = []
        t0 = time.perf_counter()
        th = threading.Thread(target=copies, args=(16, issued, t0))
        th.start()
        cpu = [sdpa(300 + 10 * trial + j, dev) for j in range(3)]
        th.join()
        cs.synchronize()
        wall = time.perf_counter() - t0
        res[f"b{trial}"] = {"issue_times_ms": issued, "sdpa_cpu_ms": [round(c * 1e3, 1) for c in cpu],
                            "wall_ms": round(wall * 1e3, 1)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
