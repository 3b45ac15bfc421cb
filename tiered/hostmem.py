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

import numpy as np
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


def host_memory_available(*, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """Bytes of memory this process can still take without an OOM kill, and where the figure came from.

    The least of ``MemAvailable`` (``/proc/meminfo``: free plus reclaimable page cache) and, for the
    process's cgroup v2 and each of its parents with a limit, ``memory.max - memory.current + file``
    (``memory.stat``'s ``file``: page cache the group can reclaim; ``Documentation/admin-guide/cgroup-v2.rst``).
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
    return best, where
