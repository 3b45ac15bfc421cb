#!/usr/bin/env python
"""How the cold read rate depends on request size and reader threads (issues 23 and 25).

    python benchmarks/read_requests.py PLAIN_DIR [CODED_DIR] [--sizes-mib 2.75,5.5,8,16,32] [--threads 4,8]
        [--raw-mib 8,16,24] [--chunk-mib 8,16] [--max-gb 3] [--rounds 2] [--out results.json]

Two parts, each over the same first ``--max-gb`` of bytes in every round (O_DIRECT: no page cache, so every read is
cold; no root needed):

* ``disk``: ``os.preadv`` with ``O_DIRECT`` of ``PLAIN_DIR``'s shard files in page-aligned requests of each size in
  ``--sizes-mib``, ``T`` threads (each of ``--threads``) each pulling the next request into its own buffer: the
  disk's rate for that request size at queue depth ``T``. If the rate grows with ``T x size`` (bytes in flight), a
  reader that issues smaller requests reads slower at the same thread count.
* ``reader``: ``tiered.reader.Reader`` itself with ``io="direct"`` and 4 threads (the default), over whole tensors
  in file order, as the loader submits them: ``plain`` — each tensor of ``PLAIN_DIR`` in ``DIRECT_CHUNK`` steps
  (each of ``--chunk-mib``); ``exp3`` — each stored exp3 tensor of ``CODED_DIR`` (``tiered reshard --compress
  --codec exp3``) in runs of whole chunks of at most ``RAW_READ`` bytes (each of ``--raw-mib``), each run read in
  ``DIRECT_CHUNK`` steps and its chunks CRC-checked (``Reader._coded_raw_task``). ``RAW_READ`` and ``DIRECT_CHUNK``
  are the module's constants, set for the run; every variant gets a new ``Reader`` (its staging buffers follow).

Rows are GB/s (1e9 bytes per second of wall time) of file bytes read. Variants alternate within a round, the order
reversed on odd rounds; the summary gives the median, min and max over rounds.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiered.reader as rd  # noqa: E402
from tiered.format import open_checkpoint  # noqa: E402
from tiered.lossless import LosslessInfo  # noqa: E402
from tiered.plan import Unit  # noqa: E402

PAGE = 4096
MIB = 1 << 20


def _counts(s: str) -> list[int]:
    v = [x.strip() for x in s.split(",") if x.strip()]
    if not v or not all(x.isdigit() and int(x) > 0 for x in v):
        raise SystemExit(f"need a comma list of positive whole numbers, got {s!r}")
    return [int(x) for x in v]


def _floats(s: str) -> list[float]:
    v = [float(x) for x in s.split(",") if x.strip()]
    if not v or min(v) <= 0:
        raise SystemExit(f"need a comma list of positive numbers, got {s!r}")
    return v


def _requests(files: list[Path], size: int, limit: int) -> list[tuple[Path, int, int]]:
    """(file, offset, length) requests of ``size`` bytes (page multiples) over the files' first ``limit`` bytes."""
    out, total = [], 0
    for f in files:
        n = f.stat().st_size // PAGE * PAGE
        for off in range(0, n, size):
            k = min(size, n - off)
            if total + k > limit and out:  # (at least one request)
                return out
            out.append((f, off, k))
            total += k
    return out


def disk(files: list[Path], size_mib: float, threads: int, limit: int) -> float:
    size = max(PAGE, int(size_mib * MIB) // PAGE * PAGE)
    reqs = _requests(files, size, limit)
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    local = threading.local()
    nxt = iter(range(len(reqs)))
    lock = threading.Lock()

    def work() -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, size)
        got = 0
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return got
            f, off, k = reqs[i]
            got += os.preadv(fds[f], [memoryview(buf)[:k]], off)

    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            got = sum(pool.map(lambda _: work(), range(threads)))
            dt = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return got / dt / 1e9


def reader_plain(ckpt, limit: int, chunk_mib: float, threads: int) -> float:
    rd.DIRECT_CHUNK = int(chunk_mib * MIB)
    tensors = sorted(ckpt.tensors.values(), key=lambda t: (str(t.file), t.offset))
    picked, total = [], 0
    for t in tensors:
        if total + t.nbytes > limit and picked:  # (at least one tensor)
            break
        picked.append(t)
        total += t.nbytes
    dest = torch.empty(total, dtype=torch.uint8)
    r = rd.Reader(ckpt, threads=threads, io="direct")
    unit = Unit(index=0, name="probe", module=torch.nn.Module(), targets=[])
    try:
        jobs: list = []
        at = 0
        t0 = time.perf_counter()
        for t in picked:
            view = dest[at: at + t.nbytes].view(t.dtype) if t.nbytes % t.dtype.itemsize == 0 else None
            at += t.nbytes
            step = max(1, rd.DIRECT_CHUNK // t.dtype.itemsize)
            for lo in range(0, t.numel, step):
                r._submit(jobs, ("direct", rd.DIRECT_CHUNK, threads), unit, t, view, lo, min(t.numel, lo + step),
                          "direct")
        rd._wait_all(jobs)
        for f in jobs:
            f.result()
        dt = time.perf_counter() - t0
    finally:
        r.close()
    return total / dt / 1e9


def reader_exp3(ckpt, limit: int, raw_mib: float, chunk_mib: float, threads: int) -> tuple[float, float]:
    rd.RAW_READ, rd.DIRECT_CHUNK = int(raw_mib * MIB), int(chunk_mib * MIB)
    infos = sorted((t for t in ckpt.tensors.values() if isinstance(t, LosslessInfo)), key=lambda t: (str(t.file), t.offset))
    picked, total = [], 0
    for t in infos:
        n = sum(t.coded.chunk_span(c)[1] for c in t.chunks)
        if total + n > limit and picked:
            break
        picked.append((t, n))
        total += n
    r = rd.Reader(ckpt, threads=threads, io="direct")
    unit = Unit(index=0, name="probe", module=torch.nn.Module(), targets=[])
    sizes = []
    try:
        bufs = [torch.empty(sum(t.coded.chunk_span(t.chunks[-1])), dtype=torch.uint8) for t, _ in picked]
        jobs: list = []
        t0 = time.perf_counter()
        for (t, _), dest in zip(picked, bufs, strict=True):
            for run in rd._chunk_runs(t, rd.RAW_READ):
                a = t.coded.chunk_span(run[0])[0]
                sizes.append(sum(t.coded.chunk_span(run[-1])) - a)
                fut: Future = Future()
                jobs.append(fut)
                r.pool.submit(rd._run_job, fut, r._coded_raw_task, (unit, t, dest, run, "direct"))
        rd._wait_all(jobs)
        for f in jobs:
            f.result()
        dt = time.perf_counter() - t0
    finally:
        r.close()
    return total / dt / 1e9, (statistics.mean(sizes) / MIB if sizes else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plain_dir")
    p.add_argument("coded_dir", nargs="?")
    p.add_argument("--sizes-mib", default="2.75,5.5,8,16,32")
    p.add_argument("--threads", default="4,8")
    p.add_argument("--raw-mib", default="8,16,24")
    p.add_argument("--chunk-mib", default="8,16")
    p.add_argument("--reader-threads", type=int, default=4)
    p.add_argument("--max-gb", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.rounds < 1 or a.reader_threads < 1 or a.max_gb <= 0:
        p.error("--rounds and --reader-threads take at least 1, --max-gb more than 0")
    limit = int(a.max_gb * 1e9)
    plain = open_checkpoint(Path(a.plain_dir))
    files = sorted({s.path for s in plain.shards})
    coded = open_checkpoint(Path(a.coded_dir)) if a.coded_dir else None
    variants: list[tuple[str, object]] = []
    for s in _floats(a.sizes_mib):
        for t in _counts(a.threads):
            variants.append((f"disk {s:g}MiB x{t}", lambda s=s, t=t: disk(files, s, t, limit)))
    for c in _floats(a.chunk_mib):
        variants.append((f"reader plain chunk {c:g}MiB", lambda c=c: reader_plain(plain, limit, c, a.reader_threads)))
    if coded is not None:
        for raw in _floats(a.raw_mib):
            for c in _floats(a.chunk_mib):
                variants.append((f"reader exp3 raw {raw:g}MiB chunk {c:g}MiB",
                                 lambda raw=raw, c=c: reader_exp3(coded, limit, raw, c, a.reader_threads)))
    rows = []
    for r in range(a.rounds):
        for name, fn in (variants if r % 2 == 0 else variants[::-1]):
            got = fn()
            gbps, extra = (got if isinstance(got, tuple) else (got, None))
            rows.append({"round": r, "variant": name, "gbps": gbps, "mean_request_mib": extra})
            print(f"round {r} {name:<36} {gbps:6.3f} GB/s" + (f"  (mean run {extra:.2f} MiB)" if extra else ""),
                  flush=True)
    summary = {}
    for name, _ in variants:
        v = [x["gbps"] for x in rows if x["variant"] == name]
        summary[name] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
