#!/usr/bin/env python
"""One merged record of the memory-scaling benchmark, from several ``benchmarks/run.py`` result files.

    python benchmarks/scaling_report.py FILE.json [FILE.json ...] --out PREFIX

A GPU command may run at most 10 minutes, so the scaling benchmark (limits 2, 4, 8, 16 GiB and none) is run one or two
limits per invocation: ``run.py --scaling L`` (group ``scaling``) or ``run.py --groups limit --runs
'main/tiered-defaults/*,main/accelerate-*/*' --mem-limit-gb L`` (group ``limit``). This reads every such file and
writes ``PREFIX.md`` (one table) and ``PREFIX.png`` (one panel per checkpoint).

Runs taken from each file: the cold-page-cache runs of "tiered, its defaults" (system ``tiered``, variant
``defaults``) and "accelerate disk offload" (``accelerate``, ``disk-offload``) of group ``scaling`` (a cgroup limit,
or none: the "none" row) or ``limit`` (always a cgroup limit). Other groups are left out: their accelerate runs get
``max_memory["cpu"]`` = the tiered ring, not the memory the limit leaves.

One row per (checkpoint, limit, file): the rounds of both systems in that file (``--repeat``), each round's decode
s/token and their median, and accelerate's median / tiered's median, computed only from the two systems' runs in the
same file (one invocation: same machine state, same checkpoint files); a file holding only one of the two systems
leaves the ratio blank, and a (checkpoint, limit) measured in two files gives two rows, never a ratio across them.
Medians over the ok rounds, via ``report.scaling_rows``. Units: s/token; GB = 1e9 bytes (GB read per token, decode
read rate GB/s); GiB = 2^30 bytes (limits, RSS, cgroup peak, ring, host tier, accelerate's ``max_memory["cpu"]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402  (benchmarks/report.py: scaling_rows, limit_label, SYSTEM_COLORS; matplotlib lazily)
import run  # noqa: E402  (benchmarks/run.py: _ckpt_name, the checkpoint's directory name; stdlib only)

__all__ = ["TARGET_LIMITS", "SYSTEMS", "checkpoint_names", "selected_runs", "file_rows", "collect", "missing_limits",
           "markdown", "plot", "main"]

#: the limits the README's scaling table wants (GiB; 0: none)
TARGET_LIMITS = (2.0, 4.0, 8.0, 16.0, 0.0)
#: system -> the variant compared (run.py's RunDef.label: "tiered, its defaults", "accelerate disk offload")
SYSTEMS = {"tiered": "defaults", "accelerate": "disk-offload"}
GROUPS = ("scaling", "limit")


def _limit_order(lim: float) -> float:
    """Sort key of a limit (GiB): ascending, none (0) last."""
    return lim or float("inf")


def checkpoint_names(res: dict[str, Any], ckpt: str) -> tuple[str, str]:
    """(identity, description) of checkpoint ``ckpt`` (e.g. ``"main"``) of result file ``res``: the identity is
    run.py's directory name of the generated checkpoint (``gptj-6b-fp16-L28-200MB``: arch, dtype, quantization,
    layers, scale, shard size), the description is ``"gptj-6b fp16 L28"`` (plus quantization and a scale other than 1)."""
    c = (res.get("checkpoints") or {}).get(ckpt) or {}
    cfg = res.get("config") or {}
    arch, dtype = c.get("arch", cfg.get("arch", "?")), c.get("dtype", cfg.get("dtype", "?"))
    layers, scale = c.get("layers", cfg.get("layers")), float(c.get("scale", cfg.get("scale")) or 1.0)
    shard, quant = c.get("max_shard_size", cfg.get("max_shard_size", "?")), c.get("quant", cfg.get("quant"))
    ident = run._ckpt_name(arch, dtype, layers, scale, shard, quant)
    desc = f"{arch} {dtype}" + (f" {quant}" if quant else "") + (f" L{layers}" if layers else " (all layers)")
    if scale != 1.0:
        desc += f" scale {scale:g}"
    return ident, desc


def selected_runs(res: dict[str, Any]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The runs of result file ``res`` that the scaling table takes (module docstring), by (checkpoint key, limit GiB;
    0: none). Each is a copy normalized for ``report.scaling_rows``: ``group`` "scaling", ``mem_gb`` its limit."""
    out: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in res.get("runs", []):
        if (r.get("group") not in GROUPS or SYSTEMS.get(r.get("system", "")) != r.get("variant")
                or r.get("cache") != "cold"):
            continue
        lim = float(r.get("mem_limit_gb") or 0) if r.get("limit") else 0.0
        if r.get("group") == "limit" and not lim:
            continue  # the limit group is always limited; a row without one is not a "none" run
        r = {**r, "group": "scaling", "mem_gb": lim}
        if "disk_efficiency_invocation" not in r:  # a file from before run.py computed it: from its own ceilings
            r.update(run.disk_efficiency(r, res.get("ceilings") or {}))
        out.setdefault((r.get("ckpt", "main"), lim), []).append(r)
    return out


def _machine(res: dict[str, Any]) -> str:
    m = res.get("machine") or {}
    gpus = m.get("gpus") or []
    what = gpus[0].split(",")[0].strip() if gpus else f"{m.get('cpu', '?')}, no GPU"
    label = run.machine_label(m) if gpus else res.get("machine_label", "?")  # (files before 2026-12-05 said "hbm3")
    return f"{label} ({what})"


def file_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """The table rows of one result file, its checkpoints (identity -> description, size) and notes.

    A row: ``ckpt`` (identity), ``limit`` (GiB; 0: none), ``file``, ``machine``, ``date``, ``commit``, ``cold``
    (False: drop_caches was not permitted, the "cold" runs were not), ``tiered`` / ``accelerate`` (a
    ``report.scaling_rows`` row, or None when the file has no run of that system there) and ``ratio`` (accelerate's
    median s/token / tiered's, both from this file; None when either is missing)."""
    res = json.loads(path.read_text())
    if "runs" not in res or "machine" not in res:
        raise ValueError(f"{path}: not a benchmarks/run.py result file (no 'runs'/'machine')")
    rows, cks, notes = [], {}, []
    m = res.get("machine") or {}
    for (ckpt, lim), runs in selected_runs(res).items():
        ident, desc = checkpoint_names(res, ckpt)
        cks.setdefault(ident, {"desc": desc, "bytes": ((res.get("checkpoints") or {}).get(ckpt) or {}).get("bytes")})
        by_sys = {r["system"]: r for r in report.scaling_rows(runs)}
        t, a = by_sys.get("tiered"), by_sys.get("accelerate")
        ratio = a["median"] / t["median"] if t and a and t["median"] and a["median"] else None
        rows.append({"ckpt": ident, "limit": lim, "file": path.name, "machine": _machine(res),
                     "date": str(res.get("date", "?"))[:16].replace("T", " "), "commit": m.get("tiered_commit"),
                     "cold": bool(m.get("drop_caches_permitted")), "tiered": t, "accelerate": a, "ratio": ratio})
    if not rows:
        notes.append(f"{path.name}: no cold run of tiered (its defaults) or accelerate disk offload in group scaling "
                     "or limit")
    return rows, cks, notes


def collect(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """Rows of every file, ordered by checkpoint description, limit (none last), date and file name; the checkpoints
    (identity -> ``desc``, ``bytes``, ``name``: the description, with the identity appended when two identities share
    it); notes."""
    rows, cks, notes = [], {}, []
    for p in paths:
        r, c, n = file_rows(p)
        rows += r
        notes += n
        for k, v in c.items():
            cks.setdefault(k, v)
    for k, v in cks.items():
        clash = sum(w["desc"] == v["desc"] for w in cks.values()) > 1
        v["name"] = f"{v['desc']} [{k}]" if clash else v["desc"]
    rows.sort(key=lambda r: (cks[r["ckpt"]]["name"], _limit_order(r["limit"]), r["date"], r["file"]))
    return rows, cks, notes


def missing_limits(rows: list[dict[str, Any]], ckpt: str) -> tuple[list[float], list[float]]:
    """Of :data:`TARGET_LIMITS`, for checkpoint identity ``ckpt``: (the limits no file measured with both systems,
    i.e. no row has a ratio; of those, the limits where some file measured one system only)."""
    both = {r["limit"] for r in rows if r["ckpt"] == ckpt and r["ratio"] is not None}
    one = {r["limit"] for r in rows if r["ckpt"] == ckpt and ((r["tiered"] or {}).get("median")
                                                              or (r["accelerate"] or {}).get("median"))}
    miss = [lim for lim in TARGET_LIMITS if lim not in both]
    return miss, [lim for lim in miss if lim in one]


def _each(s: dict[str, Any] | None) -> str:
    """A system's s/token of each ok round (3 decimals), its failed rounds' statuses in parentheses."""
    if s is None:
        return "–"
    txt = ", ".join(f"{x:.3f}" for x in s["each"])
    return (txt + (f" ({'; '.join(s['status'])})" if s["status"] else "")).strip() or "–"


def _pair(t: dict[str, Any] | None, a: dict[str, Any] | None, key: str, nd: int = 2) -> str:
    """``tiered / accelerate`` of one figure (``–`` where a system has none)."""
    return f"{report._f((t or {}).get(key), nd)} / {report._f((a or {}).get(key), nd)}"


def _tokens(t: dict[str, Any] | None, a: dict[str, Any] | None) -> str:
    """Whether every ok round of both systems gave the greedy ids of the file's reference run: yes (n rounds),
    **no**, or – (not compared)."""
    vals = [v for s in (t, a) if s for v in s["tokens_match"] if v is not None]
    if not vals:
        return "–"
    n = len(vals)
    return f"yes ({n} round{'' if n == 1 else 's'})" if all(vals) else f"**no** ({vals.count(False)} of {n} rounds differ)"


def markdown(rows: list[dict[str, Any]], cks: dict[str, dict[str, Any]], notes: list[str],
             png: str | None = None) -> str:
    """The merged table, the missing-limits line of each checkpoint, notes and the plot's link."""
    rt = run.SCALING_RUNTIME_GIB
    out = ["# Memory scaling: tiered (its defaults) against accelerate disk offload, merged over invocations", "",
           "Cold page cache, one cgroup `memory.max` per row (`none`: no limit). One row per checkpoint, limit and "
           "result file (one `run.py` invocation); the same checkpoint and limit from two files gives two rows. "
           "Each round's decode s/token is listed, the median is over the ok rounds; **accelerate ÷ tiered is taken "
           "only within one file** (blank when the file holds one system). Figures in the `t / a` columns are "
           "tiered / accelerate medians over the rounds. GB = 1e9 bytes (GB read per token, decode read rate GB/s), "
           "GiB = 2^30 bytes. accelerate's `max_memory[\"cpu\"]` is what its runs were given: `--scaling` gives it "
           f"the limit less {rt['cuda']:.1f} GiB on CUDA ({rt['cpu']:.1f} on the CPU; with no limit MemAvailable "
           f"less {rt['cpu']:.1f}), the limit group `--cpu-gb`. Tokens agree: every ok round's greedy ids equal the "
           "reference run of the checkpoint in the same file (run.py's `tokens_match`). Disk efficiency (issue 23): tiered's "
           "bytes read per second of decode over the better of the disk's read ceilings (O_DIRECT 1 and 4 threads, "
           "buffered cold), each round's against the ceilings measured just before it (files from 2026-12-06 on), in "
           "parentheses the median against the max over the invocation's ceilings measured at its start; blank "
           "where a page-cache tier served some reads.", "",
           "| checkpoint | limit | machine, date (UTC), tiered commit | file | tiered s/token, each round | tiered "
           "median | accelerate s/token, each round | accelerate median | accelerate ÷ tiered (same file) | GB read/"
           "token t / a | decode read GB/s t / a | tiered disk efficiency, each round (invocation) | peak RSS over base "
           "GiB t / a | cgroup peak GiB t / a | tiered ring "
           "+ host tier GiB | accelerate max_memory cpu GiB | tokens agree |", "|" + "---|" * 17]
    for r in rows:
        t, a = r["tiered"], r["accelerate"]
        split = (f"{t['ring_gb']:.2f} + {t['host_gb']:.2f}" if t and t["ring_gb"] is not None
                 and t["host_gb"] is not None else "–")
        cpu = ", ".join(f"{x:g}" for x in a["cpu_gb"]) if a and a["cpu_gb"] else "–"
        when = f"{r['machine']}, {r['date']}, {r['commit'] or '?'}" + ("" if r["cold"] else
                                                                       " (**not cold**: drop_caches not permitted)")
        out.append("| " + " | ".join([
            cks[r["ckpt"]]["name"], report.limit_label(r["limit"]), when, f"`{r['file']}`",
            _each(t), report._f((t or {}).get("median"), 3), _each(a), report._f((a or {}).get("median"), 3),
            f"{r['ratio']:.2f}×" if r["ratio"] is not None else "", _pair(t, a, "gb_per_token", 3),
            _pair(t, a, "decode_gbps"), report.disk_efficiency_text(t or {}), _pair(t, a, "rss_over_base_gb"),
            _pair(t, a, "cgroup_peak_gb"), split, cpu,
            _tokens(t, a)]) + " |")
    want = ", ".join(f"{x:g}" if x else "none" for x in TARGET_LIMITS)
    out += ["", "Limits still missing (of " + want + "; measured = both systems in one file):", ""]
    for k, v in sorted(cks.items(), key=lambda kv: kv[1]["name"]):
        miss, one = missing_limits(rows, k)
        size = f", {v['bytes'] / 1e9:.2f} GB" if v.get("bytes") else ""
        txt = ", ".join(report.limit_label(x) for x in miss) or "none missing"
        extra = f" (one system only: {', '.join(report.limit_label(x) for x in one)})" if one else ""
        out.append(f"* {v['name']} (`{k}`{size}): still missing of {want}: {txt}{extra}")
    if notes:
        out += ["", "Notes:", *[f"* {n}" for n in notes]]
    if png:
        out += ["", f"![memory scaling]({png})"]
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], cks: dict[str, dict[str, Any]], path: Path) -> str | None:
    """Write ``path`` (PNG): decode s/token (log y) against the limit (categorical: 2, 4, 8, 16 GiB, none, and any
    other limit the rows have), one panel per checkpoint; per file a median marker of each system (files at one
    limit side by side, labelled with accelerate ÷ tiered when the file has both) and each round as a small dot.
    Returns None, or a note saying why nothing was written (matplotlib not importable, no rows)."""
    if not rows:
        return "plot skipped: no rows"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError as e:
        return f"plot skipped: matplotlib not importable ({e})"
    names = sorted(cks, key=lambda k: cks[k]["name"])
    ncol = min(len(names), 3)
    nrow = -(-len(names) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 4.0 * nrow), dpi=90, squeeze=False)
    labels = {"tiered": "tiered, its defaults", "accelerate": "accelerate disk offload"}
    dsys = {"tiered": -0.07, "accelerate": 0.07}
    for ax, k in zip(axes.flat, names, strict=False):
        mine = [r for r in rows if r["ckpt"] == k]
        lims = sorted(set(TARGET_LIMITS) | {r["limit"] for r in mine}, key=_limit_order)
        xpos = {lim: i for i, lim in enumerate(lims)}
        seen: set[str] = set()
        for lim in lims:
            here = [r for r in mine if r["limit"] == lim]
            for j, r in enumerate(here):
                x0 = xpos[lim] + (j - (len(here) - 1) / 2) * 0.3
                tops = []
                for system in SYSTEMS:
                    s = r[system]
                    if not s:
                        continue
                    col, x = report.SYSTEM_COLORS.get(system), x0 + dsys[system]
                    if s["each"]:
                        ax.scatter([x] * len(s["each"]), s["each"], s=9, alpha=0.5, color=col, lw=0)
                    if s["median"]:
                        ax.scatter([x], [s["median"]], s=46, marker="o" if system == "tiered" else "s", color=col,
                                   edgecolor="black", lw=0.5, zorder=3,
                                   label=None if system in seen else f"{labels[system]} (median)")
                        seen.add(system)
                        tops.append(max([s["median"], *s["each"]]))
                if r["ratio"] is not None and tops:
                    ax.annotate(f"{r['ratio']:.2f}×", (x0, max(tops)), textcoords="offset points", xytext=(0, 6),
                                ha="center", fontsize=7)
        miss, _ = missing_limits(rows, k)
        for lim in miss:  # a target limit no file measured with both systems
            ax.text(xpos[lim], 0.03, "missing", transform=ax.get_xaxis_transform(), ha="center", fontsize=7,
                    color="gray")
        ax.set_xticks(range(len(lims)), [report.limit_label(x) for x in lims])
        ax.set_xlim(-0.6, len(lims) - 0.4)
        ax.set_yscale("log")
        ys = [y for r in mine for system in SYSTEMS if r[system] for y in [r[system]["median"], *r[system]["each"]] if y]
        if ys:  # room for the labels above and the "missing" notes below
            ax.set_ylim(min(ys) / 2.5, max(ys) * 2.5)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("cgroup memory.max (cold page cache)")
        ax.set_ylabel("decode s/token (log; marker: median, dot: round)")
        machines = sorted({r["machine"].split(" (")[0] for r in mine})
        ax.set_title(f"{cks[k]['name']} · {', '.join(machines)}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle("Memory scaling: one marker per system per invocation; label: accelerate ÷ tiered in that "
                 "invocation", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="benchmarks/run.py result JSON files")
    p.add_argument("--out", type=Path, required=True, metavar="PREFIX", help="writes PREFIX.md and PREFIX.png")
    a = p.parse_args(argv)
    rows, cks, notes = collect(a.results)
    png = Path(f"{a.out}.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    note = plot(rows, cks, png)
    if note:
        notes.append(note)
    md = markdown(rows, cks, notes, None if note else png.name)
    Path(f"{a.out}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
