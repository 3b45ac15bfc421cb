#!/usr/bin/env python
"""Where one decode token's time goes, on the GPU's streams (issue 25: a warm pass that is not H2D-bound).

    python benchmarks/profile_token.py MODEL_DIR [MODEL_DIR ...] --gpu-gb 1 --host-gb 4 [--tokens 4] [--prefetch 2] \
        [--out-dir DIR]

Each checkpoint is loaded with ``tiered.load(device="cuda", gpu_gb=, host_gb=)``, generates ``--tokens`` tokens to
warm the host tier, then one more decode step (``model(ids, past_key_values=...)``) runs under ``torch.profiler``
(CPU and CUDA activities). Reported per checkpoint: each timed step's wall time (until the compute stream is done,
as ``generate`` sees it; the profiled step's until the whole device is, so its copies are in the trace); per CUDA
stream the busy time (union of its kernel and memcpy intervals), split into kernels, H2D memcpy and other memcpy; when
each H2D copy ran and when the loader issued it (ms from the step's first GPU event: a copy issued late is the CPU's
doing, one issued early but run late waited on the GPU); the compute stream's idle gaps over 1 ms (where it waited,
and for what: the top CPU-side ops overlapping each gap); and ``tiered.stats`` of the step (``h2d_s``, ``stall_s``,
prefetch hits and misses). A Chrome trace (``<name>.trace.json.gz``) goes to ``--out-dir`` for a closer look.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiered  # noqa: E402


def _union(iv: list[tuple[float, float]]) -> float:
    tot, end = 0.0, -1e30
    for a, b in sorted(iv):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def analyse(trace: dict, step: tuple[float, float]) -> dict:
    """Busy time per CUDA stream (us) and the largest gaps of the stream that ran the most kernels."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams: dict[int, dict] = {}
    for e in gpu:
        s = streams.setdefault(int(e.get("args", {}).get("stream", e.get("tid", 0))), {"iv": [], "kernel": 0.0,
                                                                                        "h2d": 0.0, "memcpy": 0.0})
        a, d = float(e["ts"]), float(e["dur"])
        s["iv"].append((a, a + d))
        if e["cat"] == "kernel":
            s["kernel"] += d
        elif "HtoD" in e.get("name", ""):
            s["h2d"] += d
        else:
            s["memcpy"] += d
    t0 = min((a for s in streams.values() for a, _ in s["iv"]), default=0.0)
    t1 = max((b for s in streams.values() for _, b in s["iv"]), default=0.0)
    out: dict = {"gpu_span_ms": (t1 - t0) / 1e3, "streams": {}}
    for sid, s in streams.items():
        out["streams"][sid] = {"busy_ms": _union(s["iv"]) / 1e3, "kernel_ms": s["kernel"] / 1e3,
                               "h2d_ms": s["h2d"] / 1e3, "other_memcpy_ms": s["memcpy"] / 1e3, "events": len(s["iv"])}
    if not streams:
        return out
    comp = max(streams, key=lambda k: streams[k]["kernel"])
    iv = sorted(streams[comp]["iv"])
    gaps = [(b, a2) for (_, b), (a2, _) in zip(iv, iv[1:], strict=False) if a2 - b > 1000]
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")]
    rows = []
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:12]:
        over: dict[str, float] = {}
        for e in cpu:
            a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            o = min(b, g1) - max(a, g0)
            if o > 200:
                over[e["name"][:80]] = over.get(e["name"][:80], 0.0) + o
        top = sorted(over.items(), key=lambda kv: -kv[1])[:6]
        rows.append({"at_ms": (g0 - t0) / 1e3, "gap_ms": (g1 - g0) / 1e3,
                     "cpu_ops": [(k, round(v / 1e3, 2)) for k, v in top]})
    out["compute_stream"] = comp
    # when each copy was issued on the CPU (ms from the same origin, thread id): issued late, or waiting on the GPU
    out["memcpy_issued_at_ms"] = sorted((round((float(e["ts"]) - t0) / 1e3, 1), e.get("tid")) for e in ev
                                        if e.get("cat") == "cuda_runtime" and "Memcpy" in e.get("name", ""))[:40]
    # when each H2D copy ran (ms from the first GPU event of the step): whether the copies overlap the compute gaps
    out["h2d_at_ms"] = sorted((round((a - t0) / 1e3, 1), round((b - a) / 1e3, 1)) for sid, s in streams.items()
                              if sid != comp for a, b in s["iv"])
    out["compute_gaps_over_1ms"] = {"count": len(gaps), "total_ms": sum(b - a for a, b in gaps) / 1e3, "largest": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dirs", nargs="+")
    p.add_argument("--gpu-gb", type=float, default=1.0)
    p.add_argument("--host-gb", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="decode steps timed (the profiled one is the last)")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--prefetch", type=int, default=2, help="tiered.load(prefetch=): the device pool is prefetch + 1 "
                   "slots of the largest streamed unit")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {}
    for md in args.model_dirs:
        name = Path(md).name
        model = tiered.load(md, device="cuda", gpu_gb=args.gpu_gb, host_gb=args.host_gb, prefetch=args.prefetch)
        ids = torch.arange(3, 19, device="cuda").unsqueeze(0)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            walls = []
            for _ in range(args.tokens + args.steps):
                # the compute stream only: the copy stream goes on with the next step's prefetch, as in generate()
                # (a device-wide sync would count those copies in this step: 2026-12-04 notes)
                torch.cuda.current_stream().synchronize()
                t = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                torch.cuda.current_stream().synchronize()
                walls.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            st0 = tiered.stats(model)
            s0 = (st0.h2d_s, st0.stall_s, st0.h2d_bytes, st0.hits, st0.misses)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                torch.cuda.synchronize()
                prof_wall = time.perf_counter() - t
            st1 = tiered.stats(model)
        tp = out_dir / f"{name}.trace.json"
        prof.export_chrome_trace(str(tp))
        trace = json.loads(tp.read_text())
        with gzip.open(str(tp) + ".gz", "wt") as f:
            json.dump(trace, f)
        tp.unlink()
        r = {"step_wall_s": walls, "profiled_wall_s": prof_wall,
             "stats_delta": {"h2d_s": st1.h2d_s - s0[0], "stall_s": st1.stall_s - s0[1],
                             "hits": st1.hits - s0[3], "misses": st1.misses - s0[4],
                             "h2d_gb": (st1.h2d_bytes - s0[2]) / 1e9},
             "trace": analyse(trace, (0.0, 0.0)),
             "top_cuda": prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)}
        report[name] = r
        print(f"== {name}: step wall {[round(w, 4) for w in walls]} profiled {prof_wall:.4f} s; "
              f"stats {r['stats_delta']}", flush=True)
        print(json.dumps(r["trace"], indent=1), flush=True)
        print(r["top_cuda"], flush=True)
        del model, out, past
        torch.cuda.empty_cache()
    (out_dir / "profile_token.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
