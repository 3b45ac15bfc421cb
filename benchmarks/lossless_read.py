#!/usr/bin/env python
"""Where a compressed checkpoint's cold read goes: the disk, the decoder, or the two in the reader threads (issue 25).

    python benchmarks/lossless_read.py DIR [--threads 4,8,14] [--rounds 2] [--io direct] [--out results.json]

``DIR`` is a ``tiered reshard --compress`` output. For each thread count, in alternating rounds, over every coded
tensor's chunks in file order (the reader's own methods, ``tiered.reader.Reader``):

* ``read``: each chunk's coded bytes read with ``--io`` (O_DIRECT by default: no page cache, so every round is cold)
  on the thread pool, not decoded — the disk's rate for this request pattern;
* ``read+decode``: what the loader does, each task reading its chunk then decoding it (CRC-32, zstd, interleave) into
  a per-thread buffer;
* ``decode``: the chunks already in memory (read once, outside the timing), decoded on the pool — the decoder's rate.

Figures are GB/s of coded bytes (and of plain bytes for the decode modes). If ``read+decode`` is well below both
``read`` and ``decode`` x ratio, the reader loses time by doing the two in turn on one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiered.format import open_checkpoint  # noqa: E402
from tiered.lossless import LosslessInfo, decode_chunk  # noqa: E402
from tiered.reader import Reader  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--threads", default="4,8,14")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--io", default="direct", choices=["direct", "pread", "mmap"])
    p.add_argument("--max-gb", type=float, default=2.0, help="chunks read per measurement (GB of coded bytes)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    ckpt = open_checkpoint(Path(a.dir))
    infos = sorted((t for t in ckpt.tensors.values() if isinstance(t, LosslessInfo)), key=lambda t: (str(t.file), t.offset))
    jobs, total = [], 0
    for t in infos:
        for c in t.chunks:
            n = t.coded.chunk_span(c)[1]
            if total + n > a.max_gb * 1e9:
                break
            jobs.append((t, c))
            total += n
    plain = sum(t.coded.chunk_range(c)[1] - t.coded.chunk_range(c)[0] for t, c in jobs)
    print(f"{len(jobs)} chunks, {total / 1e9:.3f} GB coded, {plain / 1e9:.3f} GB plain (ratio {total / plain:.3f})")
    local = threading.local()

    def out_buf(n: int) -> np.ndarray:
        b = getattr(local, "b", None)
        if b is None or b.size < n:
            b = local.b = np.empty(n, dtype=np.uint8)
        return b[:n]

    rows = []
    threads = [int(x) for x in a.threads.split(",") if x]
    blobs = None
    for r in range(a.rounds):
        for t_n in (threads if r % 2 == 0 else threads[::-1]):
            reader = Reader(ckpt, threads=t_n, io=a.io)
            try:
                def read(job, reader=reader):
                    reader._read_chunk(job[0], job[1], a.io)

                def read_decode(job, reader=reader):
                    t, c = job
                    body = reader._read_chunk(t, c, a.io)
                    lo, hi = t.coded.chunk_range(c)
                    decode_chunk(body.numpy(), t.coded, c, out_buf(hi - lo))

                if blobs is None:  # the coded bytes in memory once, for the decode-only mode
                    blobs = [reader._read_chunk(t, c, a.io).clone().numpy() for t, c in jobs]

                def decode(k, blobs=blobs):
                    t, c = jobs[k]
                    lo, hi = t.coded.chunk_range(c)
                    decode_chunk(blobs[k], t.coded, c, out_buf(hi - lo))

                for mode, fn, items in (("read", read, jobs), ("read+decode", read_decode, jobs),
                                        ("decode", decode, range(len(jobs)))):
                    with ThreadPoolExecutor(t_n) as pool:
                        t0 = time.perf_counter()
                        list(pool.map(fn, items))
                        dt = time.perf_counter() - t0
                    row = {"round": r, "threads": t_n, "mode": mode, "s": dt, "coded_gbps": total / dt / 1e9,
                           "plain_gbps": plain / dt / 1e9}
                    rows.append(row)
                    print(f"round {r} threads {t_n:>2} {mode:<12} {row['coded_gbps']:.2f} GB/s coded, "
                          f"{row['plain_gbps']:.2f} plain", flush=True)
            finally:
                reader.close()
    summary = {}
    for t_n in threads:
        for mode in ("read", "read+decode", "decode"):
            v = [x["coded_gbps"] for x in rows if x["threads"] == t_n and x["mode"] == mode]
            summary[f"{t_n}/{mode}"] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "coded_bytes": total, "plain_bytes": plain, "rows": rows,
                                           "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
