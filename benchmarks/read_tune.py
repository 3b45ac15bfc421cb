#!/usr/bin/env python
"""Cold reads of whole units through tiered's own reader, by backend, thread count and request size, alternating.

Issue 9, capability 5 ("the disk path adapts to the disk ... tune request size and queue depth"): which reader
settings read a cold checkpoint fastest on this machine. Each measurement reads the next ``--gb`` GB of the
checkpoint's units (distinct bytes every time, so no cache of any layer, the host's included, can serve a
repeat) with :meth:`tiered.reader.Reader.read_unit` into a page-aligned buffer, after dropping the page cache
(``/proc/sys/vm/drop_caches``, root). Configurations run in rounds, in rotating order, so drift in the disk
hits them alike; the medians per configuration are printed, with the ceilings of ``benchmarks/ceilings.py``
measured in the same run (O_DIRECT with 1 and 4 threads, buffered cold).

    python benchmarks/read_tune.py MODEL_DIR [--gb 0.4] [--rounds 3] [--out results.jsonl]

``io="pread"`` rows also evict what they read (``posix_fadvise(POSIX_FADV_DONTNEED)``, tiered's
``drop_page_cache``), as they would have to in a small cgroup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [  # (io, threads, request MiB)
    ("direct", 4, 8), ("direct", 4, 16), ("direct", 4, 32), ("direct", 8, 8), ("direct", 8, 16), ("direct", 2, 32),
    ("pread", 4, 8), ("pread", 8, 16),
]


def _drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--gb", type=float, default=0.4, help="GB read per measurement (default 0.4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per measurement")
    a = p.parse_args()

    import tiered.reader as rd
    from benchmarks.ceilings import buffered_read, odirect_read
    from tiered.cli import _plan_for
    from tiered.hostmem import anon_mapping, map_tensor

    _, ckpt, plan = _plan_for(a.model_dir, None, "cuda")
    units = [u for u in plan.units if u.src_bytes > 0]
    ceil = {}
    for name, fn in (("odirect_1t", lambda: odirect_read(a.model_dir, threads=1, max_bytes=1 << 30)),
                     ("odirect_4t", lambda: odirect_read(a.model_dir, threads=4, max_bytes=1 << 30)),
                     ("buffered_cold", lambda: buffered_read(a.model_dir, threads=1, max_bytes=1 << 30, warm=False))):
        _drop_caches()
        try:
            ceil[name] = round(fn()["gbps"], 3)
        except Exception as e:  # noqa: BLE001 - report and go on
            ceil[name] = f"error: {e}"
    print(json.dumps({"ceilings_gbps": ceil}), flush=True)
    buf_mm = anon_mapping(max(u.nbytes for u in units) + (1 << 20))
    buf = map_tensor(buf_mm)
    nxt, skip = 0, 0
    while skip < 1.2 * (1 << 30) and nxt < len(units) // 2:  # past the bytes the ceilings read
        skip += units[nxt].src_bytes
        nxt += 1
    rows: dict[tuple, list[float]] = {}
    for r in range(a.rounds):
        k = r % len(CONFIGS)
        for io, threads, mib in CONFIGS[k:] + CONFIGS[:k]:
            rd.DIRECT_CHUNK = mib << 20
            reader = rd.Reader(ckpt, threads=threads, io=io, drop_page_cache=io == "pread")
            chunk = mib << 20
            orig = reader.copy_all
            reader.copy_all = lambda unit, pairs, also=None, *, chunk=chunk, orig=orig: orig(unit, pairs, also,
                                                                                             chunk=chunk)
            _drop_caches()
            got, t0 = 0, time.perf_counter()
            while got < a.gb * 1e9:
                u = units[nxt % len(units)]
                nxt += 1
                got += reader.read_unit(u, buf[: u.nbytes])
            dt = time.perf_counter() - t0
            reader.close()
            gbps = got / dt / 1e9
            rows.setdefault((io, threads, mib), []).append(gbps)
            line = {"round": r, "io": io, "threads": threads, "request_mib": mib, "gb": got / 1e9, "gbps": gbps}
            print(json.dumps(line), flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(json.dumps({**line, "ceilings_gbps": ceil}) + "\n")
            if nxt >= len(units):
                print(json.dumps({"note": "wrapped around the checkpoint: later rows may re-read bytes"}), flush=True)
    del buf
    print("| io | threads | request MiB | median GB/s | all |")
    print("|---|---|---|---|---|")
    for (io, threads, mib), v in sorted(rows.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"| {io} | {threads} | {mib} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    print(f"ceilings (same run, GB/s): {ceil}")


if __name__ == "__main__":
    main()
