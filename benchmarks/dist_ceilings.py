#!/usr/bin/env python
"""Ceilings for several GPUs of one host, measured in the same run as the systems (issue 11).

Run under ``torchrun --standalone --nproc-per-node N`` (NCCL; keep ``NCCL_NVLS_ENABLE=0``). Rank 0
prints one JSON object (decimal GB/s, best of 5, CUDA events):

* ``h2d_pinned_alone_gbps`` — 1 GiB pinned host -> device on rank 0's GPU while the others wait;
* ``h2d_pinned_together_gbps`` — every rank copies 1 GiB to its own GPU at once: the *aggregate*
  (N x 1 GiB over the slowest rank's time) — what N PCIe links give together, the ceiling of
  streaming 1/N of every unit per rank;
* ``pagecache_{T}t_alone_gbps`` / ``pagecache_{T}t_together_gbps`` (with ``--model-dir``) — buffered
  ``preadv`` of the first ``--max-gb`` of the checkpoint's shards, warm in the page cache, with T threads:
  rank 0 alone, then every rank at once (aggregate: N x bytes over the slowest rank's time). What
  the disk->ring step can reach from the page cache, on one rank and on N;
* ``allgather_gbps`` — an in-place ``all_gather_single`` of ``--chunk-mb`` per rank (a GPT-J-6B layer
  is ~403 MB, 1/2 of it per rank at N = 2): bytes each GPU *receives* ((N-1) x chunk) over its time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import _files, _parallel_read, _requests  # noqa: E402

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
    p.add_argument("--model-dir", type=Path, default=None, help="a checkpoint: also measure page-cache reads")
    p.add_argument("--max-gb", type=float, default=2.0)
    p.add_argument("--threads", default="4,8,16")
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
    if a.model_dir is not None:
        reqs = _requests(_files(a.model_dir), int(a.max_gb * GiB))
        _parallel_read(reqs, 8, direct=False)  # warm: in the page cache from here on
        for t in (int(x) for x in a.threads.split(",")):
            dist.barrier()
            if rank == 0:
                n, dt = _parallel_read(reqs, t, direct=False)
                res[f"pagecache_{t}t_alone_gbps"] = n / dt / 1e9
            dist.barrier()
            n, dt = _parallel_read(reqs, t, direct=False)
            per: list[object] = [None] * world
            dist.all_gather_object(per, (n, dt))
            res[f"pagecache_{t}t_together_gbps"] = sum(b for b, _ in per) / max(s for _, s in per) / 1e9  # type: ignore[misc]
    if rank == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
