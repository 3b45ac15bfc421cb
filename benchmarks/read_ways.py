#!/usr/bin/env python
"""Ways of reading a checkpoint unit by unit from a cold disk, sustained (issue 23, "the disk never idles").

    python benchmarks/read_ways.py MODEL_DIR [--unit-mb 400] [--units 6] [--rounds 2] [--ways a,b,...] [--out F]

Why: the disk ceilings (``ceilings.py``) read 0.5 GiB in one burst; tiered's O_DIRECT reads during a 2 GiB-cgroup
pass of GPT-J-6B ran at 0.68-0.95 of them, accelerate's buffered mmap reads at ~1.7 GB/s, and on one disk the
buffered ceiling (one sequential stream) beat O_DIRECT while tiered's buffered ``pread`` (4 threads on one fd) was
slower than both. Each *way* here reads ``--units`` consecutive units of ``--unit-mb`` MB (the bytes of the
checkpoint's shard files in name order, as a streamed layer spans them) into one destination buffer, unit after
unit, as a streaming pass does, so a way's rate includes its ramp-up and drain at every unit boundary:

* ``direct-8m`` — tiered's ``io="direct"`` until the sixteenth session: 4 threads, 8 MiB ``O_DIRECT`` requests into a
  per-thread staging buffer, then a copy into the destination.
* ``direct-16m`` — the same with 16 MiB requests (tiered's since the sixteenth session).
* ``direct-8m-dest``, ``direct-16m-dest`` — 4 threads, 8 or 16 MiB ``O_DIRECT`` requests straight into the
  (page-aligned) destination: no staging copy.
* ``pread-shared`` — tiered's ``io="pread"`` while probing: 4 threads, 32 MiB buffered ``preadv`` on one shared fd
  per file (one readahead state), ``POSIX_FADV_DONTNEED`` of what each read.
* ``pread-ownfd`` — the same with an fd per thread and file, ``POSIX_FADV_SEQUENTIAL`` (each thread its own
  readahead state, the window doubled).
* ``pread-willneed`` — ``pread-ownfd``, each 32 MiB request first announced with ``POSIX_FADV_WILLNEED`` in 2 MiB
  slices (the kernel starts all of it at once: a deep queue, as O_DIRECT's).
* ``pread-1t`` — one thread, sequential 16 MiB buffered ``preadv``, ``FADV_SEQUENTIAL``, ``DONTNEED`` behind: the
  buffered ceiling's way, sustained.
* ``mmap-1t`` — accelerate's way: the file mapped with ``MADV_SEQUENTIAL``, one thread copying out of the mapping
  (page faults, kernel readahead), then ``MADV_DONTNEED`` and ``FADV_DONTNEED``.

Cold: every way first evicts the bytes it will read (``POSIX_FADV_DONTNEED`` of whole files; no root needed). The
ways alternate within a round, reversed on odd rounds, and each (way, round) reads a different range of the files
where they are large enough. Rows are GB/s (1e9 bytes per second of wall time). The block device's queue settings
(``read_ahead_kb``, ``max_sectors_kb``, ``nr_requests``, scheduler) are printed first: they decide buffered reads.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1 << 20
PAGE = 4096
WAYS = ("direct-8m", "direct-16m", "direct-8m-dest", "direct-16m-dest", "pread-shared", "pread-ownfd", "pread-willneed",
        "pread-1t", "mmap-1t")


def queue_settings(path: Path) -> dict:
    """The block device under ``path``: its sysfs queue settings (best effort; {} where unknown)."""
    try:
        dev = os.stat(path).st_dev
        base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        q = base / "queue"
        if not q.exists():
            q = base.resolve().parent / "queue"  # a partition: its disk's queue
        out = {}
        for k in ("read_ahead_kb", "max_sectors_kb", "max_hw_sectors_kb", "nr_requests", "scheduler", "rotational"):
            try:
                out[k] = (q / k).read_text().strip()
            except OSError:
                pass
        out["device"] = str(base.resolve())
        return out
    except OSError:
        return {}


class Span:
    """Consecutive bytes of the files in name order, cut at file ends: ``[(file, offset, length)]``."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.sizes = [f.stat().st_size // PAGE * PAGE for f in files]
        self.total = sum(self.sizes)

    def segments(self, start: int, n: int) -> list[tuple[Path, int, int]]:
        out, at = [], 0
        for f, size in zip(self.files, self.sizes, strict=True):
            lo, hi = max(start, at), min(start + n, at + size)
            if lo < hi:
                out.append((f, lo - at, hi - lo))
            at += size
        return out


def _evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pieces(segs: list[tuple[Path, int, int]], size: int) -> list[tuple[Path, int, int, int]]:
    """(file, offset, length, dest offset) requests of at most ``size`` bytes over the segments, in order."""
    out, d = [], 0
    for f, off, n in segs:
        for a in range(0, n, size):
            k = min(size, n - a)
            out.append((f, off + a, k, d + a))
        d += n
    return out


def _pool_read(reqs, threads: int, fn) -> None:
    it = iter(reqs)
    lock = threading.Lock()

    def work(_i: int) -> None:
        while True:
            with lock:
                r = next(it, None)
            if r is None:
                return
            fn(r)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))


def way(name: str, span: Span, start: int, unit: int, units: int, dest: mmap.mmap, threads: int = 4) -> float:
    """Read ``units`` units of ``unit`` bytes from ``start`` into ``dest`` the way ``name`` does; GB/s."""
    dv = memoryview(dest)
    files = span.files
    local = threading.local()
    fds: dict = {}
    opened: list[int] = []
    lock = threading.Lock()

    def fd_for(f: Path, flags: int, own: bool, advise: int | None = None) -> int:
        key = (f, flags, threading.get_ident() if own else 0)
        with lock:
            fd = fds.get(key)
            if fd is None:
                fd = fds[key] = os.open(f, flags)
                opened.append(fd)
                if advise is not None:
                    os.posix_fadvise(fd, 0, 0, advise)
        return fd

    def stage() -> mmap.mmap:
        s = getattr(local, "stage", None)
        if s is None:
            s = local.stage = mmap.mmap(-1, 32 * MiB + PAGE)
        return s

    def read_full(fd: int, mv: memoryview, off: int) -> None:
        got = 0
        while got < len(mv):
            k = os.preadv(fd, [mv[got:]], off + got)
            if k <= 0:
                raise OSError(f"short read at {off + got}")
            got += k

    def direct_stage(r) -> None:
        f, off, n, d = r
        A, B = off // PAGE * PAGE, (off + n + PAGE - 1) // PAGE * PAGE
        s = stage()
        os.preadv(fd_for(f, os.O_RDONLY | os.O_DIRECT, False), [memoryview(s)[: B - A]], A)
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dest, d)),
                       ctypes.addressof(ctypes.c_char.from_buffer(s, off - A)), n)

    def direct_dest(r) -> None:
        f, off, n, d = r  # offsets are page multiples (Span cuts files at page multiples)
        os.preadv(fd_for(f, os.O_RDONLY | os.O_DIRECT, False), [dv[d: d + n]], off)

    def pread(own: bool, willneed: bool):
        def go(r) -> None:
            f, off, n, d = r
            fd = fd_for(f, os.O_RDONLY, own, os.POSIX_FADV_SEQUENTIAL if own else None)
            if willneed:
                for a in range(0, n, 2 * MiB):
                    os.posix_fadvise(fd, off + a, min(2 * MiB, n - a), os.POSIX_FADV_WILLNEED)
            read_full(fd, dv[d: d + n], off)
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        return go

    maps: dict = {}

    def mmap_copy(r) -> None:
        f, off, n, d = r
        m = maps.get(f)
        if m is None:
            fd = os.open(f, os.O_RDONLY)
            m = maps[f] = (mmap.mmap(fd, 0, prot=mmap.PROT_READ), fd)
            m[0].madvise(mmap.MADV_SEQUENTIAL)
        mm, fd = m
        dv[d: d + n] = mm[off: off + n]
        A = off // PAGE * PAGE
        mm.madvise(mmap.MADV_DONTNEED, A, min(len(mm), (off + n + PAGE - 1) // PAGE * PAGE) - A)
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)

    plan = {
        "direct-8m": (8 * MiB, threads, direct_stage),
        "direct-16m": (16 * MiB, threads, direct_stage),
        "direct-8m-dest": (8 * MiB, threads, direct_dest),
        "direct-16m-dest": (16 * MiB, threads, direct_dest),
        "pread-shared": (32 * MiB, threads, pread(False, False)),
        "pread-ownfd": (32 * MiB, threads, pread(True, False)),
        "pread-willneed": (32 * MiB, threads, pread(True, True)),
        "pread-1t": (16 * MiB, 1, pread(True, False)),
        "mmap-1t": (16 * MiB, 1, mmap_copy),
    }
    size, nthreads, fn = plan[name]
    _evict(files)
    t0 = time.perf_counter()
    total = 0
    for u in range(units):
        segs = span.segments(start + u * unit, unit)
        _pool_read(_pieces(segs, size), nthreads, fn)
        total += sum(n for _, _, n in segs)
    dt = time.perf_counter() - t0
    for fd in opened:
        os.close(fd)
    for mm, fd in maps.values():
        mm.close()
        os.close(fd)
    return total / dt / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--unit-mb", type=float, default=400.0)
    p.add_argument("--units", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ways = [w for w in a.ways.split(",") if w]
    bad = [w for w in ways if w not in WAYS]
    if bad or a.units < 1 or a.rounds < 1 or a.unit_mb <= 0:
        p.error(f"ways are {', '.join(WAYS)} (got {bad}); --units, --rounds >= 1")
    files = sorted(Path(a.model_dir).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{a.model_dir}: no *.safetensors files")
    span = Span(files)
    unit = int(a.unit_mb * 1e6) // PAGE * PAGE
    need = unit * a.units
    if need > span.total:
        raise SystemExit(f"{a.model_dir}: {span.total} bytes, fewer than --units x --unit-mb = {need}")
    q = queue_settings(files[0])
    print("queue:", json.dumps(q), flush=True)
    dest = mmap.mmap(-1, unit)
    dest.write(b"\1" * unit)  # touched once: no page faults on the destination inside the timed reads
    slots = max(1, span.total // need)
    rows = []
    k = 0
    for r in range(a.rounds):
        for w in (ways if r % 2 == 0 else ways[::-1]):
            start = (k % slots) * need
            k += 1
            g = way(w, span, start, unit, a.units, dest)
            rows.append({"round": r, "way": w, "gbps": g, "start": start})
            print(f"round {r} {w:<16} {g:6.3f} GB/s  (bytes {start / 1e9:.1f}-{(start + need) / 1e9:.1f} GB)", flush=True)
    summary = {}
    for w in ways:
        v = [x["gbps"] for x in rows if x["way"] == w]
        summary[w] = {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "queue": q, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
