#!/usr/bin/env python
"""Ceilings for several GPUs of one host, measured in the same run as the systems (issue 11).

Run under ``torchrun --standalone --nproc-per-node N`` (NCCL; keep ``NCCL_NVLS_ENABLE=0``). Rank 0
prints one JSON object (decimal GB/s, best of 5, CUDA events):

* ``h2d_pinned_alone_gbps`` — 1 GiB pinned host -> device on rank 0's GPU while the others wait;
* ``h2d_pinned_together_gbps`` — every rank copies 1 GiB to its own GPU at once: the *aggregate*
  (N x 1 GiB over the slowest rank's time) — what N PCIe links give together, the ceiling of
  streaming 1/N of every unit per rank;
* ``allgather_gbps`` — an in-place ``all_gather_single`` of ``--chunk-mb`` per rank (a GPT-J-6B layer
  is ~403 MB, 1/2 of it per rank at N = 2): bytes each GPU *receives* ((N-1) x chunk) over its time.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

GiB = 1 << 30


def _time(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk-mb", type=float, default=200.0)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    d = torch.empty(GiB, dtype=torch.uint8, device=dev)
    res: dict[str, object] = {"world_size": world, "gpu": torch.cuda.get_device_name(dev)}

    def h2d():
        d.copy_(host, non_blocking=True)

    # alone: rank 0 copies, the others only join the barrier
    t = _time(h2d if rank == 0 else (lambda: None))
    res["h2d_pinned_alone_gbps"] = GiB / t / 1e9 if rank == 0 else None
    t = _time(h2d)
    times: list[object] = [None] * world
    dist.all_gather_object(times, t)
    res["h2d_pinned_together_gbps"] = world * GiB / max(times) / 1e9  # type: ignore[type-var]
    chunk = int(a.chunk_mb * 1e6) // 512 * 512
    buf = torch.ones(world * chunk, dtype=torch.uint8, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(buf, buf[rank * chunk : (rank + 1) * chunk])  # warm-up: NCCL sets up its channels
    t = _time(lambda: gather(buf, buf[rank * chunk : (rank + 1) * chunk]))
    res["allgather_chunk_mb"] = chunk / 1e6
    res["allgather_gbps"] = (world - 1) * chunk / t / 1e9
    res["allgather_ms"] = t * 1e3
    if rank == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
