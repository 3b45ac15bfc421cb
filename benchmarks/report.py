#!/usr/bin/env python
"""Markdown table and plots of a ``benchmarks/run.py`` result file.

    python benchmarks/report.py RESULTS.json [MORE.json ...] [--out-stem PATH]

Several files (e.g. the full suite split over two commands) are merged: machine info, ceilings and
config come from the first, runs are concatenated (a later run with the same key replaces an earlier
one). Writes ``STEM.md`` and ``STEM-rss.png``, ``STEM-spt.png``, ``STEM-gbps.png`` (default STEM:
the first file without ``.json``). matplotlib is imported only for the plots; without it they are
skipped with a note.

Ceilings are printed as median (min-max, n runs) over ``ceilings.py``'s interleaved rounds (a file from before
the rounds: one run). Efficiency = achieved / the max over its rounds of the ceiling that bounds the run; a figure
above that max is flagged in bold, never excused (no allowance beyond the spread the rounds measured):
* reading weights: O_DIRECT (the thread count with the highest max) when the bytes come from the disk —
  ``io=direct``, or a memory limit smaller than the model, or the load of a cold run — else the page cache
  (likewise); on CUDA also at most pinned H2D;
* ``decode GB/s`` = bytes moved per token / median s per token (tiered: bytes streamed; accelerate:
  parameters placed on "cpu"/"disk"; DeepSpeed: the whole model);
* ``load GB/s`` = checkpoint bytes / load s (systems that read the whole model at load);
* tiered's disk→ring GB/s against the same read ceiling, its ring→GPU GB/s against pinned H2D (flagged only when
  above).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["markdown", "plots", "ceiling_for", "ceiling_stats", "ceiling_text", "merge", "main", "scaling_rows",
           "limit_label"]

GiB = 1 << 30
SYSTEM_COLORS = {"tiered": "#1f77b4", "transformers": "#d62728", "accelerate": "#ff7f0e", "deepspeed": "#2ca02c"}


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, (int, float)):
        if x != 0 and abs(x) < 10 ** (-nd):
            return f"{x:.1e}"
        return f"{x:.{nd}f}"
    return str(x)


def ceiling_stats(c: dict[str, Any], name: str) -> dict[str, float] | None:
    """``{median, min, max, n}`` (GB/s; n = rounds) of ceiling ``name`` (e.g. ``odirect_1t``), or None when it was not
    measured. A file from before the rounds (``ceilings.py`` measured each ceiling once) gives n = 1, min = max."""
    v = c.get(f"{name}_gbps")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return {"median": float(v), "min": float(c.get(f"{name}_gbps_min", v)), "max": float(c.get(f"{name}_gbps_max", v)),
            "n": int(c.get(f"{name}_n", 1))}


def ceiling_text(c: dict[str, Any], name: str) -> str | None:
    """Ceiling ``name`` as "median (min-max, n runs)", or None when it was not measured."""
    st = ceiling_stats(c, name)
    if st is None:
        return None
    n = st["n"]
    return f"{st['median']:.2f} ({st['min']:.2f}-{st['max']:.2f}, {n} run{'' if n == 1 else 's'})"


def _best(c: dict[str, Any], prefix: str) -> tuple[float | None, str]:
    """The ``{prefix}{N}t`` ceiling with the highest max over its rounds: (that max, its name)."""
    vals = []
    for k in c:
        if k.startswith(prefix) and k.endswith("_gbps"):
            st = ceiling_stats(c, k.removesuffix("_gbps"))
            if st is not None:
                vals.append((st["max"], k.removesuffix("_gbps")))
    if not vals:
        return None, ""
    return max(vals)


def _read_ceiling(row: dict[str, Any], ceilings: dict[str, Any], what: str) -> tuple[float | None, str]:
    """(max GB/s, name) of the read ceiling bounding ``what`` ("decode" or "load") of ``row``: disk or page cache."""
    limit = row.get("mem_limit_gb")
    model_gib = (row.get("model_gb") or 0) * 1e9 / GiB
    from_disk = row.get("io") == "direct" or (limit is not None and limit < model_gib)
    if what == "load":
        from_disk = from_disk or row.get("cache") == "cold"
    return _best(ceilings, "odirect_" if from_disk else "pagecache_")


def ceiling_for(row: dict[str, Any], ceilings: dict[str, Any], what: str) -> tuple[float | None, str]:
    """(GB/s, name) of the ceiling bounding ``what`` ("decode" or "load") of ``row``: its max over the rounds."""
    v, n = _read_ceiling(row, ceilings, what)
    if v is None:
        return None, ""
    h2d = ceiling_stats(ceilings, "h2d_pinned")
    if h2d and (row.get("spec") or {}).get("device", "cpu").startswith("cuda") and h2d["max"] < v:
        v, n = h2d["max"], "h2d_pinned"
    return v, n


def _zero_copy(row: dict[str, Any]) -> bool:
    """A tiered run whose streamed units computed on the file mapping (zero copy): its bytes were never copied."""
    return row.get("system") == "tiered" and bool((row.get("stats_total") or {}).get("mapped_units"))


def _eff(row: dict[str, Any], ceilings: dict[str, Any], key: str, what: str) -> str:
    """``row[key]`` (GB/s) and its share of the max, over its rounds, of the ceiling bounding it. A decode figure of a
    zero-copy run says so instead of a share (bytes read in place by the compute, never copied: no copy ceiling bounds
    them). A figure above the ceiling's max is flagged in bold with its share, not excused: the rounds' spread is the
    only allowance (a load above it may be lazy: ``from_pretrained`` mapping safetensors reads at first use)."""
    x = row.get(key)
    if not x:
        return _f(x if x != 0 else None)
    if what == "decode" and _zero_copy(row):
        return f"{x:.2f} (zero copy: read in place, no copy)"
    c, n = ceiling_for(row, ceilings, what)
    if not c:
        return _f(x)
    pct = 100 * x / c
    name = n.replace("_", " ")
    if pct > 100:
        return f"**{x:.2f} (above {name} max: {pct:.0f}%{'; lazy load?' if what == 'load' else ''})**"
    return f"{x:.2f} ({pct:.0f}% of {name} max)"


def _stage(row: dict[str, Any], ceilings: dict[str, Any]) -> str:
    """tiered's "disk→ring / ring→GPU" GB/s; either is flagged in bold when above the max of the ceiling bounding it
    (the read ceiling of the decode, pinned H2D)."""
    if _zero_copy(row):  # nothing copied: no copy rate
        read = "zero copy"
    else:
        read = _f(row.get("read_gbps"))
        c, n = _read_ceiling(row, ceilings, "decode")
        if row.get("read_gbps") and c and row["read_gbps"] > c:
            read = f"**{row['read_gbps']:.2f} (above {n.replace('_', ' ')} max {c:.2f})**"
    h2d = _f(row.get("h2d_gbps"))
    st = ceiling_stats(ceilings, "h2d_pinned")
    if row.get("h2d_gbps") and st and row["h2d_gbps"] > st["max"]:
        h2d = f"**{row['h2d_gbps']:.2f} (above h2d pinned max {st['max']:.2f})**"
    return f"{read} / {h2d}"


def _short_status(s: str) -> str:
    """The status up to its first ';' or '(' (a plot label)."""
    for sep in (";", " ("):
        s = s.split(sep)[0]
    return s


def merge(paths: list[Path]) -> dict[str, Any]:
    base = json.loads(paths[0].read_text())
    runs = {r["key"]: r for r in base["runs"]}
    order = [r["key"] for r in base["runs"]]
    for p in paths[1:]:
        extra = json.loads(p.read_text())
        for r in extra["runs"]:
            if r["key"] not in runs:
                order.append(r["key"])
            if r["key"] not in runs or r.get("status") == "ok" or not runs[r["key"]].get("status", "").startswith("ok"):
                runs[r["key"]] = r
        base["checkpoints"] = {**extra.get("checkpoints", {}), **base.get("checkpoints", {})}
        base.setdefault("notes", []).append(f"merged with {p.name}")
    base["runs"] = [runs[k] for k in order]
    return base


def _settle_txt(st: dict | None) -> str:
    """The checkpoint's settle read (``run.py``'s ``Runner.settle``) in words, or "" where none ran."""
    if not st:
        return ""
    if "error" in st:
        return f", settle read failed ({st['error']})"
    sl = " ".join(f"{g:.2f}" for g in st.get("slices_gbps", []))
    return (f", read once whole before the timed runs (O_DIRECT, {st['threads']} threads): {st['gbps']:.2f} GB/s, "
            f"per {st['slice_bytes'] / GiB:g} GiB: {sl}")


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    c = res.get("ceilings") or {}
    cfg = res.get("config", {})
    v = m.get("versions", {})
    disk = m.get("disk", {})
    out = [f"# tiered benchmark: {res['suite']} suite, {res['date'][:10]}, {res.get('machine_label', '')}", ""]
    gpu = "; ".join(m.get("gpus") or []) or "none"
    out.append(f"**Machine**: {m.get('cpu')} ({m.get('cores')} cores), {_f(m.get('ram_gib'), 1)} GiB RAM, GPU: {gpu}; "
               f"checkpoint disk: {disk.get('source', '?')} ({disk.get('fstype', '?')} on {disk.get('mount', '?')}"
               + (f", rotational={disk['rotational']}" if "rotational" in disk else "") + f"); kernel {m.get('kernel')}.  ")
    out.append(f"**Versions**: torch {v.get('torch')}, transformers {v.get('transformers')}, accelerate "
               f"{v.get('accelerate')}, deepspeed {v.get('deepspeed') or 'not installed'}, python {m.get('python')}, "
               f"tiered {m.get('tiered_commit')}.  ")
    cks = res.get("checkpoints", {})
    parts = []
    for k, ck in cks.items():
        if ck.get("bytes"):
            layers = ck.get("layers") or "all"
            rs = ck.get("reshard_status", "pending")
            rs_txt = "" if rs == "pending" else f", resharded: {rs}"
            if ck.get("reshard_s") and rs == "ok":
                rs_txt += f" ({ck['reshard_s']:.1f} s)"
            q = f" {ck['quant']} (stock: dequantized at load)" if ck.get("quant") else ""
            parts.append(f"`{k}` = {ck['arch']} {ck['dtype']}{q} layers={layers} scale={ck['scale']:g}: "
                         f"{ck['bytes'] / 1e9:.3f} GB ({ck['bytes'] / GiB:.2f} GiB) in {ck['max_shard_size']} shards{rs_txt}"
                         + _settle_txt(ck.get("settle")))
    out.append("**Checkpoints** (random weights, `benchmarks/make_checkpoint.py`): " + "; ".join(parts) + ".  ")
    gpu_txt = f", GPU budget of streamed/accelerate {cfg.get('gpu_gb')} GiB" if cfg.get("device") == "cuda" else ""
    out.append(f"**Setup**: device {cfg.get('device')}, prompt {cfg.get('prompt_len')} token ids (seed {cfg.get('seed')}), "
               f"greedy; {cfg.get('new_tokens')} new tokens (warm tiered/transformers), {cfg.get('slow_new_tokens')} "
               f"(accelerate, DeepSpeed, cold, limited); tiered ring {cfg.get('ring_gb')} GiB (CPU resident: a ring "
               f"that holds the model), {cfg.get('threads')} reader threads, prefetch {cfg.get('prefetch')}{gpu_txt}; "
               f"accelerate max_memory cpu {cfg.get('cpu_gb') or cfg.get('ring_gb')} GiB.  ")
    cg = res.get("cgroup", {})
    lim = f"; memory.max = {cg.get('mem_limit_gb')} GiB" if cg.get("available") else ""
    cold = "drop_caches" if m.get("drop_caches_permitted") else "not permitted (runs are warm)"
    out.append(f"**Memory limit**: {cg.get('why')}{lim}. **Cold cache**: {cold}.  ")
    ce = []
    for k, name in (("odirect_1t", "O_DIRECT 1 thread"), ("odirect_4t", "O_DIRECT 4 threads"),
                    ("buffered_cold", "buffered cold"), ("pagecache_1t", "page cache 1 thread"),
                    ("pagecache_4t", "page cache 4 threads"), ("memcpy", "memcpy 1 thread"),
                    ("h2d_pinned", "H2D pinned"), ("h2d_pageable", "H2D pageable")):
        txt = ceiling_text(c, k)
        if txt is not None:
            ce.append(f"{name} {txt}")
        elif f"{k}_error" in c:
            ce.append(f"{name}: {c[f'{k}_error']}")
    out.append(f"**Ceilings** (GB/s, same run, median (min-max, n runs) over rounds interleaved across the ceilings, "
               f"{c.get('max_bytes', 0) / GiB:.2f} GiB of the checkpoint per read figure; each figure below is held "
               "against its ceiling's max): " + ("; ".join(ce) or "not measured") + ".")
    out += ["", "| system | ckpt | cache | limit | status | load s | TTFT s | decode s/token | tok/s | peak RSS GiB "
            "| over base | cgroup peak | GPU peak | GB/token | decode GB/s (eff.) | disk→ring / ring→GPU GB/s "
            "| load GB/s (eff.) | tokens ok |",
            "|" + "---|" * 18]
    for r in res.get("runs", []):
        st = r.get("status", "?")
        lim = f"{r['mem_limit_gb']:g} GiB" if r.get("mem_limit_gb") else "none"
        stage = _stage(r, c) if r.get("system") == "tiered" and r.get("status") == "ok" else "–"
        over = r.get("peak_rss_over_base_gb")
        out.append("| " + " | ".join([
            r.get("label", r.get("key", "?")), r.get("ckpt", ""), r.get("cache", ""), lim,
            st if len(st) < 90 else st[:87] + "...",
            _f(r.get("load_s")), _f(r.get("ttft_s")), _f(r.get("decode_s_per_token_median"), 3),
            _f(r.get("tokens_per_s")), _f(r.get("peak_rss_gb")), f"**{_f(over)}**" if over is not None else "–",
            _f(r.get("cgroup_peak_gb")), _f(r.get("gpu_peak_gb")), _f(r.get("streamed_gb_per_token"), 3),
            _eff(r, c, "decode_gbps", "decode"), stage, _eff(r, c, "load_gbps", "load"),
            _f(r.get("tokens_match")) + (f" ({r.get('tokens')})" if r.get("tokens") else ""),
        ]) + " |")
    out += ["", "Peak RSS = VmHWM of the run's own process (from `wait4` when it was killed); \"over base\" subtracts "
            "its RSS once torch, transformers and the model's transformers modules are imported, before anything is "
            "loaded (on CUDA it still includes the CUDA context and cuBLAS, which every system pays; "
            "`peak_rss_over_cuda_base_gb` in the JSON subtracts those too). "
            "cgroup peak = `memory.peak` (includes page cache charged to the group). "
            "GPU peak = `torch.cuda.max_memory_allocated`. Decode s/token = median gap between consecutive new tokens "
            "(a `generate()` streamer). Tokens ok = greedy ids equal to the reference run of the same checkpoint "
            "(transformers when it ran). GB = 1e9 bytes, GiB = 2^30."]
    out += _repeats(res.get("runs", []))
    out += _scaling(res.get("runs", []))
    notes = list(res.get("notes", []))
    for r in res.get("runs", []):
        for n in (r.get("notes") or []) + (r.get("child", {}) or {}).get("notes", []):
            notes.append(f"{r['key']}: {n}")
    if notes:
        out += ["", "Notes:", *[f"* {n}" for n in notes]]
    if res.get("plots"):
        out += ["", *[f"![{p}]({p})" for p in res["plots"]]]
    return "\n".join(out) + "\n"


def limit_label(limit_gib: float | None) -> str:
    """A cgroup ``memory.max`` in GiB as the tables and plots print it: ``"2 GiB"``; 0 or None: ``"none"``."""
    return f"{limit_gib:g} GiB" if limit_gib else "none"


def scaling_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run.py --scaling``: per memory limit (GiB; 0: none) and system, the decode s/token of the rounds that ran
    (``each``), their median, and the medians over those rounds of GB read per token (GB = 1e9 bytes), decode read
    rate (GB/s), peak RSS over base and the cgroup's peak (GiB); with tiered's automatic ring and host tier (GiB),
    accelerate's ``max_memory["cpu"]`` (``cpu_gb``: the values its rounds were given, GiB) and each ok round's
    ``tokens_match`` (greedy ids equal to the file's reference run of the checkpoint; None: not compared)."""
    by: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("group") != "scaling":
            continue
        by.setdefault((float(r.get("mem_gb") or 0), r["system"]), []).append(r)
    out = []
    for (lim, system), rs in sorted(by.items(), key=lambda kv: (kv[0][0] or float("inf"), kv[0][1])):
        ok = [r for r in rs if r.get("status") == "ok" and r.get("decode_s_per_token_median")]

        def med(k: str, ok: list[dict[str, Any]] = ok) -> float | None:
            v = [r[k] for r in ok if r.get(k) is not None]
            return statistics.median(v) if v else None

        out.append({"limit_gb": lim, "system": system, "rounds": len(rs), "ok": len(ok),
                    "each": [r["decode_s_per_token_median"] for r in ok], "median": med("decode_s_per_token_median"),
                    "gb_per_token": med("streamed_gb_per_token"), "rss_over_base_gb": med("peak_rss_over_base_gb"),
                    "cgroup_peak_gb": med("cgroup_peak_gb"), "ring_gb": med("ring_gb_used"),
                    "host_gb": med("host_gb_used"), "status": sorted({str(r.get("status")) for r in rs} - {"ok"}),
                    "decode_gbps": med("decode_gbps"), "tokens_match": [r.get("tokens_match") for r in ok],
                    # issue 23's disk efficiency (run.disk_efficiency; tiered, cold, every byte from the disk): each
                    # round's against the ceiling measured beside it, and the median against the invocation's
                    "disk_eff_each": [r.get("disk_efficiency") for r in ok],
                    "disk_eff": med("disk_efficiency"), "disk_eff_invocation": med("disk_efficiency_invocation"),
                    "cpu_gb": sorted({c for r in rs if (c := (r.get("opts") or {}).get("cpu_gb")) is not None})})
    return out


def disk_efficiency_text(r: dict[str, Any]) -> str:
    """A :func:`scaling_rows` row's disk efficiency: each round's against the disk ceiling measured beside it, then
    the median against the invocation's ceilings in parentheses (``–``: not a cold tiered run read wholly from the
    disk, or no ceiling measured)."""
    each = [x for x in r.get("disk_eff_each") or [] if x is not None]
    inv = r.get("disk_eff_invocation")
    if not each and inv is None:
        return "–"
    return (", ".join(f"{x:.2f}" for x in each) or "–") + (f" ({inv:.2f})" if inv is not None else "")


def _scaling(runs: list[dict[str, Any]]) -> list[str]:
    rows = scaling_rows(runs)
    if not rows:
        return []
    acc = {r["limit_gb"]: r["median"] for r in rows if r["system"] == "accelerate"}
    out = ["", "Memory scaling (`--scaling`: cold page cache; tiered with its defaults, accelerate disk offload with "
           "max_memory cpu = limit - 1.2 GiB on CUDA, - 1.0 on the CPU; medians over the rounds, each round's "
           "figure listed):", "",
           "| limit | system | s/token, each round | median | accelerate ÷ this | GB read/token | disk efficiency, "
           "each round (invocation) | peak RSS over base GiB | cgroup peak GiB | tiered ring + host tier GiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = acc.get(r["limit_gb"])
        ratio = f"{a / r['median']:.2f}×" if a and r["median"] and r["system"] != "accelerate" else "–"
        each = ", ".join(f"{x:.3f}" for x in r["each"]) + (f" ({'; '.join(r['status'])})" if r["status"] else "")
        split = f"{r['ring_gb']:.2f} + {r['host_gb']:.2f}" if r["ring_gb"] is not None and r["host_gb"] is not None else "–"
        eff = disk_efficiency_text(r)
        out.append(f"| {r['limit_gb']:g} GiB | {r['system']} | {each} | {_f(r['median'], 3)} | {ratio} | "
                   f"{_f(r['gb_per_token'], 3)} | {eff} | {_f(r['rss_over_base_gb'])} | {_f(r['cgroup_peak_gb'])} | "
                   f"{split} |" if r["limit_gb"] else
                   f"| none | {r['system']} | {each} | {_f(r['median'], 3)} | {ratio} | {_f(r['gb_per_token'], 3)} | "
                   f"{eff} | {_f(r['rss_over_base_gb'])} | – | {split} |")
    return out


def _repeats(runs: list[dict[str, Any]]) -> list[str]:
    """With ``run.py --repeat``: the median decode s/token of each run over its rounds (keys ``KEY#n``), and its ratio
    to accelerate disk offload's median under the same cache and memory limit (> 1: faster than accelerate)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        base, sep, _ = r.get("key", "").rpartition("#")
        if sep:
            by.setdefault(base, []).append(r)
    if not by:
        return []
    med: dict[str, float | None] = {}
    for base, rs in by.items():
        vals = sorted(x for x in (r.get("decode_s_per_token_median") for r in rs if r.get("status") == "ok") if x)
        med[base] = statistics.median(vals) if vals else None
    out = ["", "Over the rounds (`--repeat`; rounds alternate in order):", "",
           "| run | rounds ok | decode s/token, each round | median | accelerate's median ÷ this |", "|---|---|---|---|---|"]
    for base, rs in by.items():
        ckpt, rest = base.split("/", 1)[0], base.split("/", 2)[-1]  # checkpoint; layout/io/cache[/limit]
        # accelerate's row on the same checkpoint, under the same cache and limit
        acc = [m for b, m in med.items() if "/accelerate-" in b and b.split("/", 1)[0] == ckpt
               and b.split("/")[-1] == base.split("/")[-1] and (b.endswith("/limit") == base.endswith("/limit")) and m]
        each = ", ".join(_f(r.get("decode_s_per_token_median"), 3) if r.get("status") == "ok" else "–" for r in rs)
        m = med[base]
        ratio = f"{acc[0] / m:.2f}×" if acc and m and "/accelerate-" not in base else "–"
        out.append(f"| {rs[0].get('label', base)} ({ckpt}: {rest}) | {sum(r.get('status') == 'ok' for r in rs)}/{len(rs)} | "
                   f"{each} | {_f(m, 3)} | {ratio} |")
    return out


def _row_name(r: dict[str, Any], with_ckpt: bool = False) -> str:
    s = r.get("label", r["key"])
    s += f" · {r.get('cache')}"
    if r.get("mem_limit_gb"):
        s += f" · ≤{r['mem_limit_gb']:g} GiB"
    if with_ckpt:
        s += f" · {r.get('ckpt')}"
    return s


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend, tight layout; write ``fig`` to ``path`` and close it."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plots(res: dict[str, Any], stem: Path) -> tuple[list[Path], str | None]:
    """Write the three PNGs; returns (paths, note) — note says why something was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [], f"plots skipped: matplotlib not importable ({e})"
    runs = res.get("runs", [])
    made: list[Path] = []
    title = f"{res['suite']} suite · {res.get('machine_label', '')} · {res['date'][:10]}"
    plt.rcParams.update({"font.size": 8})

    # 1. peak RSS over base vs model size, warm unlimited runs, original layout, mmap
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    series: dict[str, list[tuple[float, float, str]]] = {}
    for r in runs:
        if r.get("status") != "ok" or r.get("cache") != "warm" or r.get("mem_limit_gb") or r.get("layout") != "original":
            continue
        if r.get("peak_rss_over_base_gb") is None or not r.get("model_gb"):
            continue
        series.setdefault(r["label"], []).append((r["model_gb"] * 1e9 / GiB, r["peak_rss_over_base_gb"], r["system"]))
    xs_all: list[float] = []
    markers = "osD^v<>"
    for i, (lab, pts) in enumerate(sorted(series.items())):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        xs_all += xs
        ax.plot(xs, ys, marker=markers[i % len(markers)], label=lab, color=SYSTEM_COLORS.get(pts[0][2]),
                linestyle="-" if "streamed" in lab else "--")
    if xs_all:
        lo, hi = 0, max(xs_all) * 1.05
        ax.plot([lo, hi], [lo, hi], ":", color="gray", label="model size")
        ring = res.get("config", {}).get("ring_gb")
        if ring:
            ax.axhline(ring, color="#1f77b4", lw=0.8, alpha=0.5, ls=":", label=f"ring {ring:g} GiB")
    ax.set_xlabel("model size (GiB)")
    ax.set_ylabel("peak RSS over base (GiB)")
    ax.set_title(f"Peak host RSS vs model size (warm, no limit) — {title}")
    made.append(_save(plt, fig, ax, Path(f"{stem}-rss.png")))

    # 2. s/token per run on the main checkpoint (log scale); runs that did not finish are annotated
    main_rows = [r for r in runs if r.get("ckpt") == "main"]
    if main_rows:
        fig, ax = plt.subplots(figsize=(7.5, 0.28 * len(main_rows) + 1.2), dpi=90)
        names = [_row_name(r) for r in main_rows]
        vals = [r.get("decode_s_per_token_median") or 0 for r in main_rows]
        ypos = list(range(len(main_rows)))[::-1]
        ok_vals = [x for x in vals if x > 0]
        floor = min(ok_vals) / 2 if ok_vals else 1e-3
        ax.barh(ypos, [x if x > 0 else 0 for x in vals], color=[SYSTEM_COLORS.get(r["system"], "gray") for r in main_rows])
        for y, x, r in zip(ypos, vals, main_rows, strict=True):
            if x > 0:
                ax.text(x * 1.05, y, f"{x:.3f}", va="center", fontsize=7)
            else:
                ax.text(floor * 1.05, y, _short_status(r.get("status", "?"))[:60], va="center", fontsize=7, color="dimgray")
        ax.set_yticks(ypos)
        ax.set_yticklabels(names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(left=floor, right=(max(ok_vals) * 4 if ok_vals else 1))
        ax.set_xlabel("decode s/token (median, log scale; lower is better)")
        ax.set_title(f"s/token per system — {title}")
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        p = Path(f"{stem}-spt.png")
        fig.savefig(p)
        plt.close(fig)
        made.append(p)

    # 3. achieved GB/s vs ceilings
    c = res.get("ceilings") or {}
    bars: list[tuple[str, float, str]] = []
    for r in main_rows:
        if r.get("status") != "ok":
            continue
        if r.get("decode_gbps"):
            bars.append((f"{_row_name(r)}: decode", r["decode_gbps"], SYSTEM_COLORS.get(r["system"], "gray")))
        if r.get("system") == "tiered" and r.get("read_gbps"):
            bars.append((f"{_row_name(r)}: disk→ring", r["read_gbps"], "#9ecae1"))
        if r.get("system") == "tiered" and r.get("h2d_gbps"):
            bars.append((f"{_row_name(r)}: ring→GPU", r["h2d_gbps"], "#c6dbef"))
        if r.get("load_gbps"):
            bars.append((f"{_row_name(r)}: load", r["load_gbps"], "#bbbbbb"))
    if bars:
        fig, ax = plt.subplots(figsize=(8, 0.25 * len(bars) + 1.6), dpi=90)
        ypos = list(range(len(bars)))[::-1]
        ax.barh(ypos, [b[1] for b in bars], color=[b[2] for b in bars])
        for y, b in zip(ypos, bars, strict=True):
            ax.text(b[1] * 1.05, y, f"{b[1]:.2f}", va="center", fontsize=6)
        ax.set_yticks(ypos)
        ax.set_yticklabels([b[0] for b in bars], fontsize=6)
        ax.set_xscale("log")
        styles = {"odirect_1t": ("O_DIRECT 1t", "#8c564b", "--"), "odirect_4t": ("O_DIRECT 4t", "#8c564b", "-"),
                  "pagecache_1t": ("page cache 1t", "#9467bd", "--"), "pagecache_4t": ("page cache 4t", "#9467bd", "-"),
                  "memcpy": ("memcpy 1t", "#7f7f7f", "-."), "h2d_pinned": ("H2D pinned", "#17becf", "-")}
        for k, (name, col, ls) in styles.items():
            st = ceiling_stats(c, k)
            if st and st["median"]:
                ax.axvline(st["median"], color=col, ls=ls, lw=1,
                           label=f"{name} {st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f}, n={st['n']})")
                if st["max"] > st["min"]:
                    ax.axvspan(st["min"], st["max"], color=col, alpha=0.12, lw=0)
        ax.set_xlabel("GB/s (log scale; bars: achieved, lines: ceilings measured in the same run, median; "
                      "bands: min-max of their rounds)")
        ax.set_title(f"Achieved GB/s vs machine ceilings — {title}")
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        p = Path(f"{stem}-gbps.png")
        fig.savefig(p)
        plt.close(fig)
        made.append(p)
    rows = scaling_rows(runs)
    if rows:  # 4. the memory-scaling benchmark: s/token against the memory limit, median and each round
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
        lims = sorted({r["limit_gb"] for r in rows}, key=lambda x: x or float("inf"))
        xpos = {lim: i for i, lim in enumerate(lims)}
        for system in sorted({r["system"] for r in rows}):
            pts = [r for r in rows if r["system"] == system and r["median"]]
            ax.plot([xpos[r["limit_gb"]] for r in pts], [r["median"] for r in pts], marker="o",
                    color=SYSTEM_COLORS.get(system), label="tiered, its defaults" if system == "tiered" else
                    "accelerate disk offload" if system == "accelerate" else system)
            for r in pts:
                ax.scatter([xpos[r["limit_gb"]]] * len(r["each"]), r["each"], s=8, alpha=0.5,
                           color=SYSTEM_COLORS.get(system))
        ax.set_xticks(range(len(lims)), [limit_label(x) for x in lims])
        ax.set_yscale("log")
        ax.set_xlabel("cgroup memory.max (cold page cache)")
        ax.set_ylabel("decode s/token (log; line: median, dots: rounds)")
        ax.set_title(f"Memory scaling — {title}", fontsize=8)
        made.append(_save(plt, fig, ax, Path(f"{stem}-scaling.png")))
    return made, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--out-stem", type=Path, default=None)
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    res = merge(a.results)
    stem = a.out_stem or a.results[0].with_suffix("")
    if not a.no_plots:
        made, note = plots(res, stem)
        res["plots"] = [m.name for m in made]
        if note:
            res.setdefault("notes", []).append(note)
    md = markdown(res)
    Path(f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
