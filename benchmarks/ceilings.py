#!/usr/bin/env python
"""The machine's ceilings, measured in the same run as the systems: what streaming weights could reach.

All GB/s are decimal (1e9 bytes/s), as disks and PCIe are quoted.

* ``odirect_{N}t_gbps`` — ``O_DIRECT`` ``os.preadv`` of the checkpoint's own shard files (so: the
  same file system and device), 16 MiB page-aligned requests, N threads pulling the next request
  (1 and 4 by default). Bypasses the page cache: the disk's (or the virtual disk's) ceiling.
* ``buffered_cold_gbps`` — plain ``preadv`` (one stream, kernel readahead) of bytes just evicted from
  the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (clean pages of those ranges only: no
  root needed, and the rest of the page cache, e.g. the rest of the checkpoint, stays warm).
* ``pagecache_{N}t_gbps`` — the same bytes read twice; the second, timed read comes from the page
  cache (1 thread: one stream; N threads: what a reader pool can copy out of the cache).
* ``memcpy_gbps`` — one thread, ``ctypes.memmove`` of 256 MiB between two page-aligned buffers
  (best of 5): the cost of the copy into the ring.
* ``h2d_pinned_gbps`` / ``h2d_pageable_gbps`` — when CUDA is available: 1 GiB host -> device
  ``copy_`` timed with CUDA events (best of 5), from page-locked and from ordinary memory.

The read ceilings touch at most ``--max-gb`` of the checkpoint (the first bytes of its shards in
name order; every round reads the same bytes). Each figure is independent: one that fails is reported as
``{name}_error``.

Rounds (issue 26): every ceiling is measured ``--rounds`` times (default 3), interleaved — round 1 of every
ceiling, then round 2 of every ceiling, ..., every other round in reverse order — so a drift of the machine
(another tenant, the host's caches, thermal) hits all ceilings alike. ``{name}_gbps`` is the median over the
rounds that succeeded (the key keeps its old meaning: *the* figure of that ceiling), with ``{name}_gbps_min``,
``{name}_gbps_max``, ``{name}_gbps_each`` (round order) and ``{name}_n`` (rounds that succeeded) beside it; a
round that fails is listed in ``{name}_round_errors`` and ``{name}_error`` is set only when every round failed.
``rounds`` (asked) and ``elapsed_s`` (all rounds) are top-level keys. ``memcpy`` and ``h2d_*`` are still best of 5
inside each round.

    python benchmarks/ceilings.py MODEL_DIR [--max-gb 2] [--threads 1,4] [--rounds 3]
prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["measure", "odirect_read", "buffered_read", "settle_read", "memcpy_gbps", "h2d_gbps"]

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 16 * MiB
ALIGN = 4096


def _requests(files: list[Path], max_bytes: int, *, chunk: int = CHUNK, skip: int = 0) -> list[tuple[Path, int, int]]:
    """(file, offset, length) requests of ``chunk`` bytes covering at most ``max_bytes`` of ``files``, after the
    first ``skip`` bytes of them (so that several figures can read disjoint, never-read bytes)."""
    reqs: list[tuple[Path, int, int]] = []
    left = max_bytes
    for f in files:
        size = f.stat().st_size
        if skip >= size:
            skip -= size
            continue
        off, skip = skip // ALIGN * ALIGN, 0
        while off < size and left > 0:
            n = min(chunk, size - off, left)
            reqs.append((f, off, n))
            off += n
            left -= n
        if left <= 0:
            break
    return reqs


def _parallel_read(reqs: list[tuple[Path, int, int]], threads: int, direct: bool) -> tuple[int, float]:
    """Read every request with ``threads`` threads; returns (bytes, seconds). Buffers hold the largest request."""
    chunk = max(n for _, _, n in reqs)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {f: os.open(f, flags) for f in {r[0] for r in reqs}}
    lock = threading.Lock()
    nxt = [0]
    total = [0]
    errors: list[BaseException] = []

    def work() -> None:
        buf = mmap.mmap(-1, chunk + ALIGN)  # anonymous: page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        got = 0
        try:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(reqs):
                    break
                f, off, n = reqs[i]
                length = (n + ALIGN - 1) // ALIGN * ALIGN if direct else n  # O_DIRECT: aligned length
                r = os.preadv(fds[f], [view[:length]], off)
                got += min(r, n)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)
        finally:
            view.release()
            buf.close()
            with lock:
                total[0] += got

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if errors:
        raise errors[0]
    return total[0], dt


def _files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return files


def odirect_read(model_dir: str | os.PathLike[str], *, threads: int, max_bytes: int, skip: int = 0) -> dict:
    """O_DIRECT read GB/s of the checkpoint's shards with ``threads`` threads (after their first ``skip`` bytes)."""
    n, dt = _parallel_read(_requests(_files(Path(model_dir)), max_bytes, skip=skip), threads, direct=True)
    return {"gbps": n / dt / 1e9, "bytes": n, "s": dt, "threads": threads}


def settle_read(model_dir: str | os.PathLike[str], *, threads: int = 4, slice_bytes: int = 2 * GiB) -> dict:
    """Read the whole checkpoint once with O_DIRECT (``threads`` threads, 16 MiB requests), ``slice_bytes`` at a
    time, and return each slice's GB/s in file order (``slices_gbps``), the whole read's (``gbps``) and its bytes and
    seconds. Used by ``run.py`` before the first timed cold run of a checkpoint: on the H100 machines the first run of
    every invocation was the slowest of its system's rounds (tiered 4 of 4 invocations, accelerate 3 of 4 on
    2026-12-07, as on 2026-12-06), so the first system to read a just-written checkpoint paid for something the
    others did not; the slices show whether the disk's rate climbs during this first read."""
    files = _files(Path(model_dir))
    total = sum(f.stat().st_size for f in files)
    slices, nbytes, secs, skip = [], 0, 0.0, 0
    while skip < total:
        n, dt = _parallel_read(_requests(files, slice_bytes, skip=skip), threads, direct=True)
        slices.append(n / dt / 1e9)
        nbytes, secs, skip = nbytes + n, secs + dt, skip + slice_bytes
    return {"gbps": nbytes / secs / 1e9, "bytes": nbytes, "s": secs, "threads": threads,
            "slice_bytes": slice_bytes, "slices_gbps": slices}


def _evict(reqs: list[tuple[Path, int, int]]) -> None:
    """Drop the requests' byte ranges from the page cache (clean pages; ``posix_fadvise`` DONTNEED)."""
    for f in {r[0] for r in reqs}:
        fd = os.open(f, os.O_RDONLY)
        try:
            hi = max(off + n for g, off, n in reqs if g == f)
            os.posix_fadvise(fd, 0, hi, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def buffered_read(model_dir: str | os.PathLike[str], *, threads: int, max_bytes: int, warm: bool,
                  skip: int = 0) -> dict:
    """Buffered read GB/s: ``warm`` reads the bytes once untimed first (page cache), else evicts them first
    (the bytes after the shards' first ``skip``)."""
    reqs = _requests(_files(Path(model_dir)), max_bytes, skip=skip)
    if warm:
        _parallel_read(reqs, max(threads, 4), direct=False)
    else:
        _evict(reqs)
    n, dt = _parallel_read(reqs, threads, direct=False)
    return {"gbps": n / dt / 1e9, "bytes": n, "s": dt, "threads": threads}


def memcpy_gbps(nbytes: int = 256 * MiB, repeats: int = 5) -> dict:
    """One-thread memcpy GB/s (bytes copied / s), best of ``repeats``."""
    a = mmap.mmap(-1, nbytes)
    b = mmap.mmap(-1, nbytes)
    src = ctypes.addressof(ctypes.c_char.from_buffer(a))
    dst = ctypes.addressof(ctypes.c_char.from_buffer(b))
    ctypes.memset(src, 1, nbytes)  # fault both in
    ctypes.memset(dst, 2, nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        best = min(best, time.perf_counter() - t0)
    return {"gbps": nbytes / best / 1e9, "bytes": nbytes, "s": best, "threads": 1}


def h2d_gbps(nbytes: int = GiB, *, pinned: bool, repeats: int = 5) -> dict:
    """Host -> device copy GB/s with CUDA events, best of ``repeats``. Raises RuntimeError without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("CUDA not available")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev.copy_(host, non_blocking=pinned)  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dev.copy_(host, non_blocking=pinned)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del host, dev
    torch.cuda.empty_cache()
    return {"gbps": nbytes / best / 1e9, "bytes": nbytes, "s": best}


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(model_dir: str | os.PathLike[str], *, max_bytes: int = 2 * GiB, threads: tuple[int, ...] = (1, 4),
            cuda: bool = True, cold: bool = True, rounds: int = 3, disk_only: bool = False, skip: int = 0) -> dict:
    """Every ceiling (see the module docstring), each measured in ``rounds`` interleaved rounds, as
    ``{name_gbps: median, name_gbps_min, name_gbps_max, name_gbps_each: [...], name_n, name_detail: {...}}``;
    errors as text.

    ``cold``: also measure the buffered cold read (evicts the bytes it reads from the page cache first).
    ``disk_only``: only the disk's read ceilings (O_DIRECT at each thread count, buffered cold), none of the page
    cache, memcpy or H2D figures: what ``run.py`` measures again beside each cold run (a virtual disk's rate drifts
    within minutes). ``skip``: read the bytes after the shards' first ``skip`` bytes (wrapping round to 0 when fewer
    than ``max_bytes`` are left), so that a measurement repeated later reads bytes not read before.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    t0 = time.perf_counter()
    out: dict = {"max_bytes": max_bytes, "files_dir": str(model_dir), "rounds": rounds,
                 "order": "interleaved: round 1 of every ceiling, then round 2, ...; odd rounds in reverse order"}
    if skip and skip + max_bytes > sum(f.stat().st_size for f in _files(Path(model_dir))):
        skip = 0
    out["skip"] = skip
    at = {"skip": skip} if skip else {}
    figures: list[tuple[str, Callable[[], dict]]] = []  # (name, fn), the order of one round
    for t in threads:
        figures.append((f"odirect_{t}t", lambda t=t: odirect_read(model_dir, threads=t, max_bytes=max_bytes, **at)))
    if cold:
        figures.append(("buffered_cold", lambda: buffered_read(model_dir, threads=1, max_bytes=max_bytes, warm=False,
                                                               **at)))
    for t in threads if not disk_only else ():
        figures.append((f"pagecache_{t}t",
                        lambda t=t: buffered_read(model_dir, threads=t, max_bytes=max_bytes, warm=True)))
    if not disk_only:
        figures.append(("memcpy", lambda: memcpy_gbps()))
    if cuda and not disk_only and _cuda_available():
        import torch

        out["cuda_device"] = torch.cuda.get_device_name()
        figures.append(("h2d_pinned", lambda: h2d_gbps(pinned=True)))
        figures.append(("h2d_pageable", lambda: h2d_gbps(pinned=False)))

    got: dict[str, list[dict]] = {name: [] for name, _ in figures}
    errs: dict[str, list[str]] = {name: [] for name, _ in figures}
    for r in range(rounds):
        for name, fn in figures if r % 2 == 0 else figures[::-1]:
            try:
                got[name].append({**fn(), "round": r})
            except Exception as e:  # noqa: BLE001 - a failed ceiling is data, not a crash
                errs[name].append(f"round {r}: {type(e).__name__}: {e}")
    for name, _ in figures:
        each = [d["gbps"] for d in got[name]]
        if errs[name]:
            out[f"{name}_round_errors"] = errs[name]
        if not each:
            out[f"{name}_error"] = errs[name][-1].split(": ", 1)[1]
            continue
        out[f"{name}_gbps"] = statistics.median(each)
        out[f"{name}_gbps_min"] = min(each)
        out[f"{name}_gbps_max"] = max(each)
        out[f"{name}_gbps_each"] = each
        out[f"{name}_n"] = len(each)
        d0 = got[name][0]
        out[f"{name}_detail"] = {**{k: v for k, v in d0.items() if k not in ("gbps", "s", "round")},
                                 "s_each": [d["s"] for d in got[name]], "rounds": [d["round"] for d in got[name]]}
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def sweep(model_dir: str | os.PathLike[str], *, per_gb: float, threads: tuple[int, ...], chunks_mib: tuple[int, ...],
          rounds: int = 2) -> list[dict]:
    """Issue 23 item 2: cold read GB/s by way of reading, thread count (queue depth) and request size.

    Every figure reads ``per_gb`` GiB the sweep has not read before (disjoint ranges of the shards, wrapping round
    when the checkpoint is used up); buffered figures evict their range from the page cache first. ``rounds``
    passes over the grid, every other one in reverse order. Returns one dict per figure: ``mode`` (``direct`` or
    ``buffered``), ``threads``, ``chunk_mib``, ``round``, ``gbps``, ``skip`` (the byte offset it started at).
    """
    files = _files(Path(model_dir))
    total = sum(f.stat().st_size for f in files)
    per = int(per_gb * GiB)
    grid = [(m, t, c) for m in ("direct", "buffered") for t in threads for c in chunks_mib]
    out: list[dict] = []
    skip = 0
    for r in range(rounds):
        for m, t, c in grid if r % 2 == 0 else grid[::-1]:
            if skip + per > total:
                skip = 0
            reqs = _requests(files, per, chunk=c * MiB, skip=skip)
            if m == "buffered":
                _evict(reqs)
            n, dt = _parallel_read(reqs, t, direct=m == "direct")
            out.append({"mode": m, "threads": t, "chunk_mib": c, "round": r, "gbps": n / dt / 1e9, "skip": skip})
            skip += per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="a checkpoint directory (its *.safetensors are read)")
    p.add_argument("--max-gb", type=float, default=2.0, help="GiB of the shards to read per figure (default 2)")
    p.add_argument("--threads", default="1,4", help="thread counts for the parallel reads (default 1,4)")
    p.add_argument("--no-cuda", action="store_true", help="skip the H2D figures")
    p.add_argument("--no-cold", action="store_true", help="skip the buffered cold read (it evicts what it reads)")
    p.add_argument("--disk-only", action="store_true",
                   help="only the disk's read ceilings (O_DIRECT at --threads, buffered cold): no page cache, memcpy, H2D")
    p.add_argument("--skip-gb", type=float, default=0.0,
                   help="read the bytes after the shards' first GiB given (wraps to 0 past the end; default 0)")
    p.add_argument("--settle", action="store_true",
                   help="instead: read the whole checkpoint once with O_DIRECT, 2 GiB at a time (settle_read)")
    p.add_argument("--sweep", metavar="MIB,...", default="",
                   help="instead: sweep O_DIRECT and buffered cold reads over --threads and these request sizes")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every ceiling, interleaved (default 3); --sweep: passes over the grid (default 2)")
    a = p.parse_args(argv)
    threads = tuple(int(x) for x in a.threads.split(",") if x.strip())
    if a.settle:
        print(json.dumps(settle_read(a.model_dir, threads=max(threads))))
        return 0
    if a.sweep:
        chunks = tuple(int(x) for x in a.sweep.split(",") if x.strip())
        print(json.dumps(sweep(a.model_dir, per_gb=a.max_gb, threads=threads, chunks_mib=chunks,
                               rounds=a.rounds or 2)))
        return 0
    res = measure(a.model_dir, max_bytes=int(a.max_gb * GiB), threads=threads, cuda=not a.no_cuda, cold=not a.no_cold,
                  rounds=a.rounds or 3, disk_only=a.disk_only, skip=int(a.skip_gb * GiB))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
