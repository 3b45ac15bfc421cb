#!/usr/bin/env python
"""Where a cold streamed token's read time goes: every ``preadv`` and every reader task, timed (issues 23 and 25).

    python benchmarks/read_trace.py MODEL_DIR [MODEL_DIR ...] [--device cuda] [--gpu-gb 1] [--ring-gb 0.42]
        [--io direct] [--threads 4] [--tokens 3] [--out trace.json]

Each checkpoint is loaded with ``tiered.load`` and generates ``--tokens`` greedy tokens from a 16-token prompt. While
it runs, ``os.preadv`` (every disk read of the reader threads: O_DIRECT or buffered), the reader's tasks
(``Reader._task``, ``Reader._coded_raw_task``, ``Reader._lossless_task``) and ``Reader.read_unit`` /
``Reader.start_unit`` (a unit's, or a piece's, reads submitted) are wrapped to record their start and end
(``time.perf_counter``) and thread. Over the decode steps (after the first token) it reports:

* ``reads``, ``read_mib_mean``, ``read_ms_mean``: the requests the disk saw, their size and latency;
* ``disk_busy``: the union of the requests' intervals / the window (1.0: a request always in flight);
* ``in_flight_mean``: summed request time / the window (the mean queue depth the threads kept);
* ``task_busy``: summed task time / (threads x window) — the reader threads' occupancy; ``task_overhead``: the share
  of task time outside ``preadv`` (staging copies, CRC-32, decode);
* ``unit_gap_ms``: per unit, the time before its first request during which no request at all was in flight (0 when
  an earlier unit's read still was) — where the disk idled because the loader waited (ring space, a device buffer,
  the model); ``unit_gap_before_call_ms_mean`` and ``unit_gap_call_to_first_read_ms_mean`` split it into the time
  before the loader called the reader (ring room, the H2D before it, the model) and from that call to the unit's
  first ``preadv`` (the reader's own submission), and ``unit_gaps`` lists each unit's gap and parts by name;
* ``read_gbps``: bytes read / window.

Figures are printed and, with ``--out``, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiered.reader as rd  # noqa: E402


class Trace:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads: list[tuple[float, float, int, int]] = []  # start, end, bytes, thread
        self.tasks: list[tuple[float, float, int]] = []
        self.units: list[tuple[float, str]] = []

    def install(self) -> None:
        real_preadv, trace = os.preadv, self

        def preadv(fd, bufs, offset, *a):
            t0 = time.perf_counter()
            n = real_preadv(fd, bufs, offset, *a)
            t1 = time.perf_counter()
            with trace.lock:
                trace.reads.append((t0, t1, n, threading.get_ident()))
            return n

        rd.os.preadv = preadv  # the reader module's os is the os module: every caller's preadv is traced
        for name in ("_task", "_coded_raw_task", "_lossless_task"):
            real = getattr(rd.Reader, name)

            def wrapped(self, *a, _real=real, **k):
                t0 = time.perf_counter()
                try:
                    return _real(self, *a, **k)
                finally:
                    t1 = time.perf_counter()
                    with trace.lock:
                        trace.tasks.append((t0, t1, threading.get_ident()))

            setattr(rd.Reader, name, wrapped)
        for name in ("start_unit", "read_unit"):  # a piece's reads submitted; a whole unit read (synchronous)
            real = getattr(rd.Reader, name)

            def unit_wrapped(self, unit, slot, *a, _real=real, **k):
                with trace.lock:
                    trace.units.append((time.perf_counter(), unit.name))
                return _real(self, unit, slot, *a, **k)

            setattr(rd.Reader, name, unit_wrapped)

    def clear(self) -> None:
        with self.lock:
            self.reads.clear()
            self.tasks.clear()
            self.units.clear()

    def summary(self, t0: float, t1: float, threads: int) -> dict:
        w = t1 - t0
        reads = [r for r in self.reads if t0 <= r[0] < t1]
        tasks = [t for t in self.tasks if t0 <= t[0] < t1]
        units = sorted(u for u in self.units if t0 <= u[0] < t1)
        out = {"window_s": w, "reads": len(reads)}
        if not reads:
            return out
        out["read_mib_mean"] = statistics.mean(r[2] for r in reads) / (1 << 20)
        out["read_ms_mean"] = statistics.mean(r[1] - r[0] for r in reads) * 1e3
        out["read_ms_p90"] = sorted(r[1] - r[0] for r in reads)[int(0.9 * (len(reads) - 1))] * 1e3
        out["read_gbps"] = sum(r[2] for r in reads) / w / 1e9
        out["disk_busy"] = rd._union([(a, b) for a, b, _, _ in reads]) / w
        out["in_flight_mean"] = sum(b - a for a, b, _, _ in reads) / w
        ttime = sum(b - a for a, b, _ in tasks)
        out["task_busy"] = ttime / (threads * w)
        out["task_overhead"] = 1 - sum(b - a for a, b, _, _ in reads) / ttime if ttime else None
        out["threads_seen"] = len({r[3] for r in reads})
        gaps: list[float] = []
        each: list[dict] = []  # per unit: its name, the gap, and the gap's two parts
        starts = sorted(r[0] for r in reads)
        merged: list[list[float]] = []  # the union of the requests' intervals, in order
        for a, b, _, _ in sorted(reads):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        m_starts = [m[0] for m in merged]
        import bisect
        for (ut, _), nxt in zip(units, [*units[1:], (t1, "")], strict=True):
            k = bisect.bisect_left(starts, ut)
            first = starts[k] if k < len(starts) else None
            if first is None or first >= nxt[0]:
                continue
            j = bisect.bisect_left(m_starts, first) - 1  # the last stretch of reads that began before ``first``
            if j >= 0:  # no read in flight from that stretch's end to ``first`` (0: one still was)
                gap = max(0.0, first - merged[j][1])
                gaps.append(gap)
                # split: before the loader called the reader (ring room, the model, the H2D) and after (submission)
                each.append({"unit": _, "gap_ms": round(gap * 1e3, 2),
                             "before_call_ms": round(max(0.0, min(ut, first) - merged[j][1]) * 1e3, 2),
                             "call_to_first_read_ms": round(max(0.0, first - max(ut, merged[j][1])) * 1e3, 2)})
        if gaps:
            out["unit_gap_ms_mean"] = statistics.mean(gaps) * 1e3
            out["unit_gap_ms_sum_per_s"] = sum(gaps) / w * 1e3
            out["units"] = len(gaps)
            out["unit_gap_before_call_ms_mean"] = statistics.mean(e["before_call_ms"] for e in each)
            out["unit_gap_call_to_first_read_ms_mean"] = statistics.mean(e["call_to_first_read_ms"] for e in each)
            out["unit_gaps"] = each
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-gb", type=float, default=1.0)
    p.add_argument("--ring-gb", type=float, default=None)
    p.add_argument("--io", default="direct")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--policy", action="append", default=[], metavar="NAME=VALUE",
                   help="set tiered.policy.NAME (an A/B switch, e.g. HEAD_IN_RING_PIECES=1) before loading; repeatable")
    a = p.parse_args()
    import tiered.policy

    for kv in a.policy:
        name, _, value = kv.partition("=")
        if not hasattr(tiered.policy, name):
            p.error(f"--policy {kv}: tiered.policy has no {name}")
        old = getattr(tiered.policy, name)
        setattr(tiered.policy, name, type(old)(int(value)) if isinstance(old, (bool, int)) else type(old)(value))
    tr = Trace()
    tr.install()
    res = {}
    for d in a.dirs:
        kw = {"device": a.device, "io": a.io, "threads": a.threads}
        if a.device != "cpu":
            kw["gpu_gb"] = a.gpu_gb
        if a.ring_gb is not None:
            kw["ring_gb"] = a.ring_gb
        with tiered.load(d, **kw) as m:
            vocab = m.config.vocab_size
            ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0)).to(a.device)
            with torch.no_grad():
                out = m(ids, use_cache=True)  # the prompt: the first token (not traced)
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                if a.device != "cpu":
                    torch.cuda.synchronize()
                tr.clear()
                t0 = time.perf_counter()
                for _ in range(a.tokens):
                    out = m(nxt, past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    if a.device != "cpu":
                        torch.cuda.synchronize()
                t1 = time.perf_counter()
            s = tr.summary(t0, t1, a.threads)
            s["s_per_token"] = (t1 - t0) / a.tokens
            st = tiered.stats(m)
            s["stats_read_gbps"] = st.snapshot().get("read_gbps")
        res[d] = s
        print(d, json.dumps(s, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))


if __name__ == "__main__":
    main()
