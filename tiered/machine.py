"""Machine facts a placement depends on, gathered once per load (:func:`gather`) and passed to
:func:`tiered.placement.place` as a plain value, so that a placement can be computed for another machine (``tiered
inspect --gpu-gb``, the golden tests) and never reads the machine itself.

Sources: host memory with every parent cgroup (:func:`tiered.hostmem.host_memory_available`), the page cache's room
before eviction (:func:`tiered.stats.page_cache_room`), the GPU's free memory (``cudaMemGetInfo``), the page size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hostmem import PAGE_SIZE, host_memory_available
from .stats import page_cache_room

__all__ = ["Machine", "gather"]


@dataclass(frozen=True)
class Machine:
    """What this process may use, in bytes. ``None``: unknown (not Linux; no GPU asked about)."""

    host_available: int | None = None  # memory the process can still take without an OOM kill
    host_where: str = "unknown"  # where that figure came from ("MemAvailable", "cgroup /x memory.max=...")
    page_cache_room: int | None = None  # bytes the page cache can grow by before it must evict
    page_cache_where: str = "unknown"
    gpu_free: int | None = None  # free memory of the device placed on (CUDA only)
    page_size: int = PAGE_SIZE
    cores: int | None = None  # CPUs this process may run on: sched_getaffinity, capped by the cgroup's cpu.max


def usable_cores() -> int | None:
    """CPUs this process may run on: ``os.sched_getaffinity(0)`` (``os.cpu_count()`` where it does not exist), capped
    by a cgroup v2 ``cpu.max`` quota (``ceil(quota / period)``) of this process's cgroup. None: unknown."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count()
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()
        path = next((ln.split(":", 2)[2] for ln in rel if ln.startswith("0::")), None)
        if path is not None:
            quota, period = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text().split()[:2]
            if quota != "max" and n is not None:
                n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError, IndexError):
        pass
    return n


def gather(device: Any = None, *, gpu_free: int | None = None) -> Machine:
    """The facts of this machine now. ``device``: a CUDA ``torch.device`` whose free memory is read (unless
    ``gpu_free`` is given, e.g. the smallest over the ranks of a distributed job)."""
    avail, where = host_memory_available()
    room, room_where = page_cache_room()
    if gpu_free is None and device is not None and getattr(device, "type", None) == "cuda":
        import torch

        gpu_free = torch.cuda.mem_get_info(device)[0]
    return Machine(avail, where, room, room_where, gpu_free, cores=usable_cores())
