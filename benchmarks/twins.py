#!/usr/bin/env python
"""A quantized checkpoint against its unquantized twin, side by side in one invocation (issue 24's targets).

    python benchmarks/twins.py --arch qwen3-30b-a3b --layers 8 --experts per-expert --gpu-gb 2 \\
        --modes cold,warm --mem-limit-gb 4 --host-gb 1.5 --rounds 2 --stock --out-dir "$OUT"

Both checkpoints come from ``make_checkpoint.py`` with the same arch, layers, scale and seed: the twin in
``--dtype`` (bf16), the other with ``--quant fp8`` (same shapes; e4m3 codes and their float32 block scales where the
twin has a linear weight) or ``--quant mxfp4`` (gpt-oss: the experts as e2m1 blocks and E8M0 scales). The "fp8"
rows of the report are the quantized checkpoint's, whichever ``--quant``. Each run is one child process of
``systems.py`` (tiered, ``device="cuda"`` unless ``--device cpu``, ``gpu_gb`` given so that most of the model
streams), in a cgroup v2 ``memory.max`` of ``--mem-limit-gb`` when given; rounds alternate the order (twin first,
then quantized first), so a drift of the machine hits both alike. Modes:

* ``cold`` — the page cache dropped before the load, no host tier (``host_gb=0``): every pass reads the disk;
* ``warm`` — the host tier given (``--host-gb``): what it holds is read once at load and copied from pinned memory
  every pass;
* ``cold-auto`` — the page cache dropped before the load, ``host_gb`` left to tiered (what a user's
  ``tiered.load(dir, gpu_gb=...)`` does): the memory ``--mem-limit-gb`` leaves beside the ring becomes a host tier
  (``tiered.policy.auto_split``), read once at load; a quantized checkpoint's stored experts fit about twice as many
  in it as the twin's.

``--quant lossless`` (issue 25): the other checkpoint is the twin itself through ``tiered reshard --compress``
(losslessly compressed shards, decoded after the read); ``--stock`` then runs stock on the twin.

``--stock`` adds one run of stock transformers on the quantized checkpoint (``FineGrainedFP8Config(dequantize=True)``
or ``Mxfp4Config(dequantize=True)``, no limit): the quantized runs' tokens must equal it.

``--prefetch`` and ``--threads`` take comma-separated lists (``--prefetch 2,5 --threads auto,4``): every combination is
a *variant*, run in every round beside the others (the order of variants and twins reversed on odd rounds), and
reported in its own row (``warm pf5 t4``), so that settings are compared within one invocation.

Reported per mode, variant and twin (medians over rounds, with min-max): seconds per decode token, load seconds, and the bytes
per token of the streamed units — read from disk, over PCIe (H2D), out of the host tier's experts — and their ratios
(quantized / twin, speed twin / quantized). Output in ``--out-dir``: ``<date>-<machine>-twins-<arch>.json`` (every
run, the summary) and ``.md`` (the table). Only the standard library here (children import torch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import cgroup  # noqa: E402

GiB = 1 << 30
FIGURES = ("decode_s_per_token_median", "load_s", "streamed_gb_per_token", "h2d_gb_per_token",
           "host_expert_gb_per_token", "decoded_gb_per_token", "peak_rss_gb", "gpu_peak_gb")

#: printed with each run when its cgroup had them (:func:`_run`): what running at the memory limit cost
CGROUP_FIGURES = ("cgroup_max", "cgroup_pgmajfault", "cgroup_workingset_refault_file", "cgroup_pressure_full_s")


def _make(args: argparse.Namespace, quant: bool) -> Path:
    out = Path(args.cache_dir) / (f"{args.arch}-L{args.layers}-s{args.scale:g}-{args.experts}-"
                                  + ((args.quant + ("-exp3" if args.codec == "exp3" else "")) if quant
                                     else args.dtype))
    if quant and args.quant == "lossless":  # the twin itself, through `tiered reshard --compress` (issue 25)
        twin = _make(args, False)
        if not out.exists():
            subprocess.run([sys.executable, "-m", "tiered.reshard", str(twin), str(out), "--compress", "--codec",
                            args.codec, "--quiet"], check=True, cwd=ROOT)
        return out
    cmd = [sys.executable, str(HERE / "make_checkpoint.py"), "--arch", args.arch, "--dtype", args.dtype,
           "--layers", str(args.layers), "--scale", str(args.scale), "--experts", args.experts, "--quiet", str(out)]
    if quant:
        cmd += ["--quant", args.quant]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _run(args: argparse.Namespace, work: Path, spec: dict, limit: int | None) -> dict[str, Any]:
    sp = work / "spec.json"
    sp.write_text(json.dumps(spec))
    out, err = work / "child.out", work / "child.err"
    r = cgroup.run_child([sys.executable, str(HERE / "systems.py"), str(sp)], timeout_s=args.timeout_s,
                         mem_limit_bytes=limit, stdout=out, stderr=err, cwd=ROOT)
    res: dict[str, Any] = {}
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("BENCH_RESULT "):
            res = json.loads(line[len("BENCH_RESULT "):])
    if r.status != "ok" or not res:
        res.setdefault("status", r.status if r.status != "ok" else "failed: no result line")
        res["stderr_tail"] = err.read_text(errors="replace")[-3000:]
    res["child_status"] = r.status
    if r.cgroup and r.cgroup.get("memory_peak") is not None:
        res["cgroup_peak_gb"] = r.cgroup["memory_peak"] / GiB
    if r.cgroup:  # what running at the limit cost: limit hits, major faults, refaults, memory PSI stall seconds
        res.update({f"cgroup_{k}": v for k, v in (r.cgroup.get("events") or {}).items() if k in ("max", "high")})
        res.update({f"cgroup_{k}": v for k, v in (r.cgroup.get("stat") or {}).items()
                    if k in ("pgmajfault", "workingset_refault_file")})
        res.update({f"cgroup_{k}": r.cgroup[k] for k in ("pressure_some_s", "pressure_full_s") if k in r.cgroup})
    return res


def _variants(prefetch: str, threads: str, merge: str = "off") -> list[dict[str, Any]]:
    """Every combination of the comma-separated ``--prefetch``, ``--threads`` and ``--merge-reads`` values, each with
    its label (empty when there is one combination, so that a plain invocation's report is as before). Raises
    ValueError: a value that is not a positive integer (or ``auto`` for threads; ``on``/``off`` for merge)."""
    def ints(text: str, name: str, auto: bool) -> list[int | None]:
        out: list[int | None] = []
        for x in (t.strip() for t in text.split(",")):
            if auto and x == "auto":
                out.append(None)
            elif x.isdigit() and int(x) >= 1:
                out.append(int(x))
            else:
                raise ValueError(f"--{name}: {x!r} is not a positive integer{' or auto' if auto else ''}")
        if not out:
            raise ValueError(f"--{name}: no value given")
        return out

    pfs, ths = ints(prefetch, "prefetch", False), ints(threads, "threads", True)
    mgs = [x.strip() for x in merge.split(",") if x.strip()]
    if not mgs or any(x not in ("on", "off") for x in mgs):
        raise ValueError(f"--merge-reads: {merge!r}: a comma-separated list of on, off")
    out = []
    for pf in pfs:
        for th in ths:
            for mg in mgs:
                label = " ".join(([f"pf{pf}"] if len(pfs) > 1 else []) + ([f"t{th or 'auto'}"] if len(ths) > 1 else [])
                                 + ([f"merge-{mg}"] if len(mgs) > 1 else []))
                out.append({"prefetch": pf, "threads": th, "merge": mg == "on", "label": label})
    return out


def _spread(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--arch", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--quant", default="fp8", choices=["fp8", "mxfp4", "lossless"],
                   help="make_checkpoint.py --quant of the quantized checkpoint (mxfp4: --arch gpt-oss-120b); "
                        "lossless: the twin through `tiered reshard --compress` (issue 25; --stock then runs stock "
                        "on the twin, whose tokens the compressed runs must equal)")
    p.add_argument("--codec", default="zstd", choices=["zstd", "exp3"],
                   help="--quant lossless: `reshard --compress --codec` (exp3: bf16 decoded on the GPU after the copy)")
    p.add_argument("--experts", default="stacked", choices=["stacked", "per-expert"],
                   help="make_checkpoint.py --experts (an FP8 MoE needs per-expert); both twins get the same")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu-gb", type=float, default=2.0)
    p.add_argument("--host-gb", type=float, default=1.0, help="the warm mode's host tier (GiB)")
    p.add_argument("--ring-gb", type=float, default=None, help="default: tiered's automatic ring")
    p.add_argument("--prefetch", default="2", help="tiered.load(prefetch=), or a comma-separated list (variants): on "
                   "CUDA the device pool is prefetch + 1 slots of the largest streamed unit")
    p.add_argument("--mem-limit-gb", type=float, default=None, help="cgroup memory.max of every tiered run")
    p.add_argument("--modes", default="cold,warm", help="comma-separated: cold, warm, cold-auto (see above)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", default="auto", help="reader threads ('auto': tiered's), or a comma-separated list "
                   "(variants)")
    p.add_argument("--io", default="auto")
    p.add_argument("--merge-reads", default="off",
                   help="CUDA routed experts: read each staging batch in file order, adjacent ranges as one request "
                        "(tiered.experts.MERGE_STAGED_READS): on, off, or 'off,on' (variants, for an A/B)")
    p.add_argument("--stock", action="store_true", help="also run stock transformers on the quantized checkpoint")
    p.add_argument("--accelerate", action="store_true",
                   help="cold mode (else cold-auto): also run accelerate's disk offload of the quantized checkpoint each "
                        "round (stock's "
                        "dequantize at load, then device_map='auto' with max_memory {0: --gpu-gb, 'cpu': "
                        "--accelerate-cpu-gb} and an offload folder), in the same memory.max")
    p.add_argument("--accelerate-cpu-gb", type=float, default=0.8)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "bench"))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"cold", "warm", "cold-auto"}:
        p.error(f"--modes: cold, warm and/or cold-auto, got {args.modes!r}")
    try:
        variants = _variants(args.prefetch, args.threads, args.merge_reads)
    except ValueError as e:
        p.error(str(e))
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.cache_dir) / f"twins-{os.getpid()}"
    work.mkdir()
    twins = {"twin": _make(args, False), "fp8": _make(args, True)}
    rng = random.Random(0)
    ids = [rng.randrange(_vocab(twins["twin"])) for _ in range(args.prompt_len)]
    limit = int(args.mem_limit_gb * GiB) if args.mem_limit_gb else None
    stem = (f"{datetime.date.today().isoformat()}-{platform.node() or 'machine'}-twins-{args.arch}")
    report: dict[str, Any] = {"args": vars(args), "checkpoints": {k: str(v) for k, v in twins.items()}, "runs": []}

    def save() -> None:
        (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))

    if args.stock:
        spec = {"system": "transformers", "model_dir": str(twins["twin" if args.quant == "lossless" else "fp8"]),
                "prompt_ids": ids,
                "new_tokens": args.new_tokens, "device": args.device}
        report["stock"] = _run(args, work, spec, None)
        print(f"stock: {report['stock'].get('status')} tokens {report['stock'].get('tokens_out')}", flush=True)
        save()
    accel_mode = "cold" if "cold" in modes else "cold-auto"
    for r in range(args.rounds):
        for mode in modes:
            order = [(v, w) for v in variants for w in ("twin", "fp8")]
            order = order if r % 2 == 0 else order[::-1]
            if mode == accel_mode and args.accelerate:  # once a round: accelerate has no host tier to vary
                order = order + [(None, "accelerate")] if r % 2 == 0 else [(None, "accelerate")] + order
            for var, which in order:
                if which == "accelerate":
                    spec = {"system": "accelerate", "model_dir": str(twins["fp8"]), "prompt_ids": ids,
                            "new_tokens": args.new_tokens, "device": args.device, "cold": True, "gpu_gb": args.gpu_gb,
                            "cpu_gb": args.accelerate_cpu_gb, "offload_folder": str(work / "offload")}
                    res = _run(args, work, spec, limit)
                    res.update(round=r, mode=mode, which=which)
                    report["runs"].append(res)
                    print(f"round {r} {mode} accelerate: {res.get('status')} "
                          f"s/token={res.get('decode_s_per_token_median')} tokens={res.get('tokens_out')}", flush=True)
                    save()
                    continue
                spec = {"system": "tiered", "model_dir": str(twins[which]), "prompt_ids": ids,
                        "new_tokens": args.new_tokens, "device": args.device, "cold": mode.startswith("cold"),
                        "ring_gb": args.ring_gb, "gpu_gb": args.gpu_gb, "threads": var["threads"], "io": args.io,
                        "prefetch": var["prefetch"],
                        "extra": {"host_gb": {"cold": 0.0, "cold-auto": None}.get(mode, args.host_gb),
                                  "merge_staged_reads": var["merge"]}}
                res = _run(args, work, spec, limit)
                res.update(round=r, mode=mode, which=which, variant=var["label"])
                report["runs"].append(res)
                print(f"round {r} {mode}{' ' + var['label'] if var['label'] else ''} {which}: {res.get('status')} "
                      + " ".join(f"{k}={res.get(k):.4g}" for k in (*FIGURES, *CGROUP_FIGURES, "read_gbps")
                                 if isinstance(res.get(k), (int, float))),
                      flush=True)
                save()
    summary: dict[str, Any] = {}
    stock_tokens = (report.get("stock") or {}).get("tokens_out")
    for mode, var in [(m, v) for m in modes for v in variants]:
        m: dict[str, Any] = {}
        for which in ("twin", "fp8"):
            rows = [x for x in report["runs"] if x["mode"] == mode and x["which"] == which and x.get("status") == "ok"
                    and x.get("variant") == var["label"]]
            m[which] = {k: _spread([x.get(k) for x in rows]) for k in FIGURES}
            if which == "fp8" and stock_tokens is not None:
                m["fp8_tokens_equal_stock"] = all(x.get("tokens_out") == stock_tokens for x in rows) and bool(rows)
        t, q = m["twin"], m["fp8"]

        def med(d: dict, k: str) -> float | None:
            return d[k]["median"] if d.get(k) else None

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        m["speedup"] = ratio(med(t, "decode_s_per_token_median"), med(q, "decode_s_per_token_median"))
        for k in ("streamed_gb_per_token", "h2d_gb_per_token", "host_expert_gb_per_token"):
            m[k.replace("_gb_per_token", "_bytes_ratio")] = ratio(med(q, k), med(t, k))
        acc = [x for x in report["runs"] if x["mode"] == mode and x["which"] == "accelerate" and x.get("status") == "ok"]
        if acc and var is variants[0]:  # accelerate runs once a round, not per variant: reported with the first
            m["accelerate"] = {k: _spread([x.get(k) for x in acc]) for k in FIGURES}
            m["speedup_vs_accelerate"] = ratio(med(m["accelerate"], "decode_s_per_token_median"),
                                               med(q, "decode_s_per_token_median"))
            if stock_tokens is not None:
                m["accelerate_tokens_equal_stock"] = all(x.get("tokens_out") == stock_tokens for x in acc)
        failed = [x for x in report["runs"] if x["mode"] == mode and x["which"] == "accelerate"
                  and x.get("status") != "ok"]
        if failed and var is variants[0]:
            m["accelerate_failed"] = [str(x.get("status"))[:300] for x in failed]
        summary[f"{mode} {var['label']}" if var["label"] else mode] = m
    report["summary"] = summary
    save()
    lines = [f"# {args.arch} L{args.layers} scale {args.scale:g}: {args.quant} (rows 'fp8') against its {args.dtype} twin "
             f"({args.device}, gpu_gb={args.gpu_gb}, memory.max {args.mem_limit_gb} GiB, {args.rounds} rounds)", "",
             "| mode | twin s/token | fp8 s/token | speed-up | disk bytes/token fp8/twin | H2D bytes/token fp8/twin | "
             "host-expert bytes fp8/twin | tokens = stock |", "|---|---|---|---|---|---|---|---|"]

    def fmt(d: dict | None) -> str:
        return f"{d['median']:.4f} ({d['min']:.4f}-{d['max']:.4f})" if d else "-"

    def f2(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, (int, float)) else "-"

    for mode, m in summary.items():
        lines.append(f"| {mode} | {fmt(m['twin']['decode_s_per_token_median'])} | "
                     f"{fmt(m['fp8']['decode_s_per_token_median'])} | {f2(m['speedup'])} | "
                     f"{f2(m['streamed_bytes_ratio'])} | {f2(m['h2d_bytes_ratio'])} | "
                     f"{f2(m['host_expert_bytes_ratio'])} | {m.get('fp8_tokens_equal_stock', '-')} |")
    for mode, m in summary.items():
        if m.get("accelerate"):
            lines.append(f"\n{mode}: accelerate disk offload of the {args.quant} checkpoint (dequantized at load): "
                         f"{fmt(m['accelerate']['decode_s_per_token_median'])} s/token; {args.quant} under tiered is "
                         f"{f2(m['speedup_vs_accelerate'])}x faster; tokens = stock: "
                         f"{m.get('accelerate_tokens_equal_stock', '-')}")
        if m.get("accelerate_failed"):
            lines.append(f"\n{mode}: accelerate failed: {m['accelerate_failed'][0]}")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
