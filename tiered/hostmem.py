"""Host memory facts and mappings: the page size, mappings whose last reference unmaps them, and how
much memory this process may still take (``MemAvailable`` and every cgroup v2 ``memory.max`` above it).

Mappings and live tensors: ``torch.frombuffer(mmap)`` keeps the ``mmap`` object alive but holds no
buffer *export*, so ``mmap.close()`` succeeds and unmaps memory a live tensor still points into (a
read afterwards is a SIGSEGV). :func:`map_tensor` goes through NumPy instead: ``numpy.frombuffer``
holds an export for as long as the array lives and ``torch.from_numpy`` keeps the array alive for as
long as any view of the tensor does. ``mmap.close()`` then raises ``BufferError`` while a view is
alive, and the mapping is unmapped when its last reference goes — never under a live tensor.
"""

from __future__ import annotations

import mmap
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: `tiered inspect` reads host memory before (or without) torch
    import torch

__all__ = ["PAGE_SIZE", "page_up", "map_tensor", "anon_mapping", "try_unmap", "host_memory_available"]

#: The host page size in bytes (4 KiB on x86-64; 16/64 KiB on some aarch64 and ppc64le kernels).
#: The one definition every page rounding in tiered uses.
PAGE_SIZE: int = mmap.PAGESIZE


def page_up(n: int) -> int:
    """``n`` bytes rounded up to a whole number of pages."""
    return (n + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE


def map_tensor(mm: mmap.mmap) -> torch.Tensor:
    """The whole of ``mm`` as a ``(len(mm),)`` uint8 tensor that holds a buffer export on it.

    While this tensor or any view of it is alive, ``mm.close()`` raises ``BufferError`` instead
    of unmapping; the mapping goes away with its last reference. A read-only mapping gives a
    tensor that must not be written (torch cannot mark it read-only; tiered never writes to one).
    """
    import numpy as np
    import torch

    arr = np.frombuffer(mm, dtype=np.uint8)
    with warnings.catch_warnings():  # "non-writable array": read-only shard mappings, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def anon_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (page-aligned, so it also serves ``O_DIRECT``).

    Its pages are not touched: RSS grows only as pages are first written (or pinned).
    """
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def try_unmap(mm: mmap.mmap) -> bool:
    """Unmap ``mm`` now if no tensor points into it; else leave that to its last reference. True if unmapped."""
    try:
        mm.close()
        return True
    except BufferError:
        return False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup1_memory(*, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> dict | None:
    """This process's cgroup v1 memory group, when it has a limit: ``limit`` (``hierarchical_memory_limit`` of
    ``memory.stat``: the smallest ``memory.limit_in_bytes`` of it and its ancestors), ``usage``
    (``memory.usage_in_bytes``, page cache included), ``cache`` (``memory.stat``'s ``total_cache``: its reclaimable
    page cache), all bytes, and ``path``. Read under ``{cgroup_root}/memory{path}`` (a host) or
    ``{cgroup_root}/memory`` (a container sees its own group there). None: no v1 memory group, or no limit."""
    cg = _read(f"{proc}/self/cgroup") or ""
    path = next((ln.strip().split(":", 2)[2] for ln in cg.splitlines()
                 if len(ln.split(":", 2)) == 3 and "memory" in ln.split(":", 2)[1].split(",")), None)
    if path is None:
        return None
    for base in (f"{cgroup_root}/memory{path.rstrip('/')}", f"{cgroup_root}/memory"):
        usage = (_read(f"{base}/memory.usage_in_bytes") or "").strip()
        if not usage.isdigit():
            continue
        stat = {k: int(v) for k, _, v in (ln.partition(" ") for ln in (_read(f"{base}/memory.stat") or "").splitlines())
                if v.strip().isdigit()}
        limit = stat.get("hierarchical_memory_limit")
        if limit is None:
            txt = (_read(f"{base}/memory.limit_in_bytes") or "").strip()
            limit = int(txt) if txt.isdigit() else None
        if limit is None or limit >= 1 << 62:  # PAGE_COUNTER_MAX rounded to pages: no limit
            return None
        return {"limit": limit, "usage": int(usage), "cache": stat.get("total_cache", stat.get("cache", 0)),
                "path": path}
    return None


def host_memory_available(*, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """Bytes of memory this process can still take without an OOM kill, and where the figure came from.

    The least of ``MemAvailable`` (``/proc/meminfo``: free plus reclaimable page cache) and, for the
    process's cgroup v2 and each of its parents with a limit, ``memory.max - memory.current + file``
    (``memory.stat``'s ``file``: page cache the group can reclaim; ``Documentation/admin-guide/cgroup-v2.rst``);
    on a cgroup v1 memory hierarchy, the limit less the usage plus ``total_cache`` (:func:`cgroup1_memory`).
    ``(None, "unknown")`` when nothing can be read (not Linux).
    """
    best: int | None = None
    where = "unknown"
    meminfo = _read(f"{proc}/meminfo")
    if meminfo:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                best, where = int(line.split()[1]) * 1024, "MemAvailable"
    cg = _read(f"{proc}/self/cgroup")
    path = next((ln.strip()[3:] for ln in (cg or "").splitlines() if ln.startswith("0::")), None)
    while path is not None:
        base = f"{cgroup_root}{path.rstrip('/')}"
        mx = (_read(f"{base}/memory.max") or "max").strip()
        cur = (_read(f"{base}/memory.current") or "").strip()
        if mx != "max" and cur.isdigit() and mx.isdigit():
            stat = _read(f"{base}/memory.stat") or ""
            file = next((int(ln.split()[1]) for ln in stat.splitlines() if ln.startswith("file ")), 0)
            left = max(0, int(mx) - int(cur) + file)
            if best is None or left < best:
                best, where = left, f"cgroup {path or '/'} memory.max={int(mx)}"
        if path in ("", "/"):
            break
        path = path.rstrip("/").rpartition("/")[0] or "/"
    v1 = cgroup1_memory(proc=proc, cgroup_root=cgroup_root)
    if v1 is not None:
        left = max(0, v1["limit"] - v1["usage"] + v1["cache"])
        if best is None or left < best:
            best, where = left, f"cgroup v1 {v1['path']} memory.limit_in_bytes={v1['limit']}"
    return best, where
