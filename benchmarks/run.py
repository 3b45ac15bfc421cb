#!/usr/bin/env python
"""The benchmarks' one entry point: tiered against transformers, accelerate and DeepSpeed, and the GPU suites.

    python benchmarks/run.py --suite quick                      # CPU, a few minutes
    python benchmarks/run.py --suite full --out-dir "$OUT"       # GPU: GPT-J-6B-shaped fp16, ring_gb=1
    python benchmarks/run.py --suite gpu-moe --dry-run          # the commands a step suite would run, not run

``quick`` and ``full`` are plans of systems side by side (below); the other suites are fixed lists of commands
of the same measuring code (``benchmarks/steps.py``). The list of suites is at the end of ``--help``.

Every run is its own child process (``benchmarks/systems.py``) so its peak RSS (VmHWM) is its own;
each gets a timeout, and optionally a cgroup v2 ``memory.max`` (``benchmarks/cgroup.py``). All runs
of one checkpoint use the same prompt token ids and greedy decoding, so their tokens must agree.
The machine's ceilings (``benchmarks/ceilings.py``) are measured in the same invocation, in ``--ceiling-rounds``
interleaved rounds (default 3): the report prints each as median (min-max, n runs) and holds every figure
against its ceiling's max over those rounds. Before each cold run of the scaling groups the disk's read ceilings
are measured again, over bytes not read before (``adjacent_ceilings``; ``--no-adjacent-ceilings`` skips it): a
virtual disk's rate drifts within minutes, and the run's disk efficiency (``disk_efficiency``) is held against the
ceiling measured beside it as well as the invocation's (``disk_efficiency_invocation``).

Output in ``--out-dir`` (at most 6 files): ``<date>-<machine>-<suite>.json`` (machine info, ceilings,
every run), ``.md`` (the table), ``-rss.png``, ``-spt.png``, ``-gbps.png`` (plots; skipped with a
note when matplotlib is missing) and ``-logs.txt`` (the tail of each child's stderr). The JSON and
the table are rewritten after every run, so a run cut short still leaves its results. Checkpoints
(generated once by ``benchmarks/make_checkpoint.py``, resharded once by ``tiered.reshard``) and
accelerate's offload folders live in ``--cache-dir``, not in the output.

Only the standard library is imported here; children import torch, transformers, accelerate.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import cgroup  # noqa: E402  (benchmarks/cgroup.py: stdlib only)
import steps  # noqa: E402  (benchmarks/steps.py: the step suites, stdlib only)

#: The run options passed to the child (benchmarks/systems.py) in its spec's ``extra``: tiered.load arguments and the
#: module switches the A/B variants set. Every key systems.py reads from ``spec.extra`` is here
#: (tests/test_bench_quick.py checks both lists).
SPEC_EXTRA = ("drop_page_cache", "host_gb", "zero_copy", "auto_ring_in_pieces", "direct_chunk_mib", "slot_direct",
              "read_shapes", "pieces_when_one_fits", "head_in_ring_pieces")

GiB = 1 << 30

__all__ = ["main", "build_plan", "machine_info", "SUITES"]


# ---------------------------------------------------------------------------------------------------
# Suites
# ---------------------------------------------------------------------------------------------------


@dataclass
class Suite:
    """Defaults of one suite; every field can be overridden on the command line. Sizes in GiB."""

    device: str  # "cpu" or "cuda"
    arch: str  # benchmarks/make_checkpoint.py ARCHS key
    dtype: str
    layers: int | None  # None: the real model's
    scale: float
    max_shard_size: str  # as save_pretrained shards (5GB for real models)
    sweep_layers: list[int]  # extra checkpoints (same arch, these layer counts) for RSS-vs-size
    ring_gb: float  # tiered streamed ring (and, on the GPU, the resident run's ring too)
    gpu_gb: float | None  # GPU budget of tiered streamed and accelerate (CUDA only)
    new_tokens: int  # warm runs of the fast systems
    slow_new_tokens: int  # accelerate, DeepSpeed, cold and memory-limited runs
    budget_s: float  # the whole invocation stops starting runs after this
    ceiling_gb: float  # GiB read per read ceiling
    timeout_s: float  # per child (capped by what is left of the budget)
    min_start_s: float  # no run starts with less than this left of the budget
    ceiling_rounds: int = 3  # rounds of every ceiling, interleaved (ceilings.py --rounds)


SUITES: dict[str, Suite] = {
    # CPU: a Llama of ~0.6 GB in fp32 (8 layers of llama-tall), 200 MB shards; a 0.25 GiB ring.
    "quick": Suite(device="cpu", arch="llama-tall", dtype="fp32", layers=8, scale=1.0, max_shard_size="200MB",
                   sweep_layers=[4, 16], ring_gb=0.25, gpu_gb=None, new_tokens=8, slow_new_tokens=4,
                   budget_s=900.0, ceiling_gb=0.5, timeout_s=180.0, min_start_s=10.0),
    # GPU: GPT-J-6B shapes, fp16, 12.1 GB in ~5 GB shards; ring 1 GiB; streamed and accelerate get 2 GiB
    # of GPU. Fits the device tool's 10-minute command limit (budget 540 s, then the report).
    "full": Suite(device="cuda", arch="gptj-6b", dtype="fp16", layers=None, scale=1.0, max_shard_size="5GB",
                  sweep_layers=[14], ring_gb=1.0, gpu_gb=2.0, new_tokens=8, slow_new_tokens=3,
                  budget_s=540.0, ceiling_gb=2.0, timeout_s=120.0, min_start_s=25.0),
}

SUITE_HELP = {
    "quick": "CPU: an 8-layer Llama fp32 (0.60 GB), tiered streamed/resident vs transformers and accelerate "
             "(make bench-quick)",
    "full": "GPU: GPT-J-6B fp16 (12.1 GB), tiered vs transformers, accelerate and DeepSpeed ZeRO-3; warm, cold, "
            "cgroup",
    **{k: v.help for k, v in steps.STEP_SUITES.items()},
}

GROUPS = ("core", "cold", "limit", "sweep", "resharded", "io", "deepspeed", "scaling", "scaling-io")


@dataclass
class Ckpt:
    key: str  # "main" or "L<n>"
    arch: str
    dtype: str
    layers: int | None
    scale: float
    max_shard_size: str
    dir: Path
    bytes: int | None = None
    gen_s: float | None = None
    status: str = "pending"  # "ok" | "failed: ..."
    resharded_dir: Path | None = None
    reshard_status: str = "pending"  # "ok" | "cached" | "not run: ..."
    reshard_s: float | None = None
    quant: str | None = None  # "fp8": make_checkpoint.py --quant fp8 (stock loads it dequantized)
    settle: dict[str, Any] | None = None  # the first whole O_DIRECT read before any timed run (Runner.settle)


@dataclass
class RunDef:
    key: str  # unique: "<ckpt>/<system>-<variant>/<layout>/<io>/<cache>[/limit]"
    group: str  # one of GROUPS
    system: str  # systems.py: tiered | transformers | accelerate | deepspeed
    variant: str  # streamed | resident | cuda | cpu | disk-offload | zero3-offload
    ckpt: str
    layout: str = "original"  # or "resharded"
    io: str = "mmap"
    cache: str = "warm"  # or "cold"
    limit: bool = False
    new_tokens: int = 8
    opts: dict[str, Any] = field(default_factory=dict)  # ring_gb, gpu_gb, cpu_gb for the Spec
    mem_gb: float | None = None  # --scaling: this run's cgroup memory.max (GiB; 0: none), instead of --mem-limit-gb

    @property
    def label(self) -> str:
        names = {("tiered", "streamed"): "tiered streamed", ("tiered", "resident"): "tiered resident",
                 ("tiered", "defaults"): "tiered, its defaults",
                 ("transformers", "cuda"): "transformers (cuda)", ("transformers", "cpu"): "transformers (cpu)",
                 ("accelerate", "disk-offload"): "accelerate disk offload",
                 ("deepspeed", "zero3-offload"): "DeepSpeed ZeRO-3 offload"}
        s = names.get((self.system, self.variant), f"{self.system} {self.variant}")
        if self.layout != "original":
            s += f" [{self.layout}]"
        if self.io != "mmap":
            s += f" [io={self.io}]"
        return s


#: --scaling: host memory a limit leaves to accelerate's weights, the limit less this (GiB): the runtime (torch,
#: transformers, the CUDA context) beside them. Issue 23's H200 run gave accelerate 0.8 GiB of a 2 GiB cgroup; the
#: CPU runs of 2026-12-01 gave it 1.0 GiB of 2 (cgroup peak 2.00 GiB, no OOM kill).
SCALING_RUNTIME_GIB = {"cuda": 1.2, "cpu": 1.0}


def scaling_host_gib() -> float:
    """--scaling with no limit: accelerate's ``max_memory["cpu"]``: what ``MemAvailable`` says now, less
    :data:`SCALING_RUNTIME_GIB` (GiB)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20) - SCALING_RUNTIME_GIB["cpu"]
    return 8.0


def _ckpt_name(arch: str, dtype: str, layers: int | None, scale: float, shard: str, quant: str | None = None) -> str:
    name = f"{arch}-{dtype}"  # the plain name: the step suites (steps.py) use the same directories
    if quant:
        name += f"-{quant}"
    if layers is not None:
        name += f"-L{layers}"
    if scale != 1.0:
        name += f"-s{scale:g}"
    if shard != "5GB":
        name += f"-{shard}"
    return name


def build_plan(a: argparse.Namespace, cuda: bool) -> tuple[dict[str, Ckpt], list[RunDef]]:
    """The checkpoints and the ordered runs (most important first: the budget may cut the tail)."""
    cache = Path(a.cache_dir)
    q = a.quant
    ckpts = {"main": Ckpt("main", a.arch, a.dtype, a.layers, a.scale, a.max_shard_size,
                          cache / _ckpt_name(a.arch, a.dtype, a.layers, a.scale, a.max_shard_size, q), quant=q)}
    for n in a.sweep_layers:
        if n != a.layers:
            ckpts[f"L{n}"] = Ckpt(f"L{n}", a.arch, a.dtype, n, a.scale, a.max_shard_size,
                                  cache / _ckpt_name(a.arch, a.dtype, n, a.scale, a.max_shard_size, q), quant=q)
    fast, slow = a.new_tokens, a.slow_new_tokens
    streamed = {"ring_gb": a.ring_gb, "gpu_gb": a.gpu_gb if cuda else None}
    resident = {"ring_gb": a.ring_gb, "gpu_gb": None} if cuda else {"ring_gb": "fit"}  # CPU: ring >= model
    acc = {"gpu_gb": a.gpu_gb, "cpu_gb": a.cpu_gb if a.cpu_gb is not None else a.ring_gb}
    tf_variant = "cuda" if cuda else "cpu"

    def R(group: str, system: str, variant: str, ckpt: str = "main", **kw: Any) -> RunDef:
        r = RunDef(key="", group=group, system=system, variant=variant, ckpt=ckpt, **kw)
        r.key = "/".join([ckpt, f"{system}-{variant}", r.layout, r.io, r.cache] + (["limit"] if r.limit else []))
        return r

    def four(group: str, ckpt: str = "main", **kw: Any) -> list[RunDef]:
        n_fast = slow if kw.get("cache") == "cold" or kw.get("limit") else fast
        return [R(group, "tiered", "streamed", ckpt, opts=streamed, new_tokens=n_fast, **kw),
                R(group, "tiered", "resident", ckpt, opts=resident, new_tokens=n_fast, **kw),
                R(group, "transformers", tf_variant, ckpt, new_tokens=n_fast, **kw),
                R(group, "accelerate", "disk-offload", ckpt, opts=acc, new_tokens=slow, **kw)]

    runs: list[RunDef] = []
    runs += four("core")
    if not cuda:  # the CPU's streamed default computes on the file mapping (zero copy); the ring copy beside it
        runs.insert(1, R("core", "tiered", "streamed-ring", opts={**streamed, "zero_copy": False}, new_tokens=fast))
    runs += four("cold", cache="cold")
    runs += four("limit", cache="cold", limit=True)
    # tiered with its defaults (issue 23): no ring_gb, host_gb or io: chosen from what the limit leaves; gpu_gb as given
    runs.insert(len(runs) - 3, R("limit", "tiered", "defaults", cache="cold", limit=True, io="auto",
                                 opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None}, new_tokens=slow))
    for key in ckpts:
        if key != "main":
            runs += [r for r in four("sweep", key) if r.variant != "resident" or not cuda]
    runs += [R("resharded", "tiered", "streamed", layout="resharded", opts=streamed, new_tokens=fast),
             R("resharded", "tiered", "resident", layout="resharded", opts=resident, new_tokens=fast),
             R("resharded", "tiered", "streamed", layout="resharded", cache="cold", opts=streamed, new_tokens=slow)]
    # O_DIRECT never uses the page cache: these are cold runs by nature (the cache is dropped anyway)
    runs += [R("io", "tiered", "streamed", io="direct", cache="cold", opts=streamed, new_tokens=slow),
             R("io", "tiered", "streamed", io="direct", cache="cold", limit=True, opts=streamed, new_tokens=slow),
             # what tiered picks itself under the limit (direct when the model cannot stay in the page cache room)
             R("io", "tiered", "streamed", io="auto", cache="cold", limit=True, opts=streamed, new_tokens=slow)]
    # buffered reads on a cold disk (kernel readahead), with and without dropping what was copied from the page
    # cache (posix_fadvise DONTNEED: the cgroup never holds more page cache than is in flight); and a host tier
    # inside the limit (half the ring moved to pinned host memory)
    runs += [R("io", "tiered", "streamed", io="pread", cache="cold", limit=True, opts=streamed, new_tokens=slow),
             R("io", "tiered", "streamed-drop", io="pread", cache="cold", limit=True,
               opts={**streamed, "drop_page_cache": True}, new_tokens=slow)]
    # the same host memory as the ring alone (and as accelerate's max_memory['cpu'] by default), split into a ring and
    # a host tier (--host-gb; default half): on CUDA pinned and copied to the GPU, on the CPU computed in place
    host = a.host_gb if a.host_gb is not None else a.ring_gb / 2
    hopts = {**streamed, "ring_gb": a.ring_gb - host, "host_gb": host}
    if cuda:
        runs += [R("io", "tiered", "streamed-host", io="direct", cache="cold", limit=True, opts=hopts, new_tokens=slow)]
    else:  # io="auto": it measures O_DIRECT against buffered reads while it streams and keeps the faster
        runs += [R("io", "tiered", "streamed-host", io="auto", cache="cold", limit=True, opts=hopts, new_tokens=slow)]
    # a ring smaller than a unit (--pieces-ring-gb): every larger unit streams in pieces, reads pipelined, and the
    # host tier (each of --pieces-host-gb) holds whole small units and the first pieces of the others
    if a.pieces_ring_gb and cuda:
        for hg in [0.0, *a.pieces_host_gb]:
            runs += [R("io", "tiered", f"streamed-pieces-host{hg:g}" if hg else "streamed-pieces", io="direct",
                       cache="cold", limit=True, opts={**streamed, "ring_gb": a.pieces_ring_gb, "host_gb": hg},
                       new_tokens=slow)]
    runs += [R("deepspeed", "deepspeed", "zero3-offload", new_tokens=slow)]
    # the memory-scaling benchmark (issue 23, item 4): tiered with its defaults (only gpu_gb) against accelerate disk
    # offload with the same memory, cold, at each cgroup limit of --scaling (0: none)
    for lim in a.scaling:
        tag = f"limit{lim:g}" if lim else "nolimit"
        cpu = max(0.25, lim - SCALING_RUNTIME_GIB["cuda" if cuda else "cpu"]) if lim else scaling_host_gib()
        runs += [dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim)
                 for r in (R("scaling", "tiered", "defaults", cache="cold", limit=bool(lim), io="auto",
                             opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None}, new_tokens=slow),
                           R("scaling", "accelerate", "disk-offload", cache="cold", limit=bool(lim),
                             opts={**acc, "cpu_gb": round(cpu, 2)}, new_tokens=slow))]
        # --scaling-io: the same defaults with the read backend forced, beside them in every round (group scaling-io,
        # out of the scaling table: the report's rounds table holds each against accelerate at the same limit)
        runs += [dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim)
                 for r in (R("scaling-io", "tiered", "defaults", cache="cold", limit=bool(lim), io=io,
                             opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None}, new_tokens=slow)
                           for io in a.scaling_io)]
        # --scaling-pieces-ring: the defaults with the automatic ring of three pieces on CUDA (tiered.policy
        # .AUTO_RING_IN_PIECES on, PIECE_RING_BYTES) instead of prefetch + 1 whole units: its A/B, in the same rounds
        if a.scaling_pieces_ring:
            r = R("scaling-io", "tiered", "defaults-pieces-ring", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "auto_ring_in_pieces": True},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
        # --scaling-pieces-cut: the defaults with units the ring holds whole but not twice read in pieces on CUDA
        # (tiered.policy.PIECES_WHEN_ONE_FITS on; the ring and host tier as the defaults size them): its A/B
        if a.scaling_pieces_cut:
            r = R("scaling-io", "tiered", "defaults-pieces-cut", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "pieces_when_one_fits": True},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
        # --scaling-head-pieces: the defaults with a head the ring holds but not beside a layer read in pieces through
        # ring slots of its own on the CPU (tiered.policy.HEAD_IN_RING_PIECES on): its A/B
        if a.scaling_head_pieces:
            r = R("scaling-io", "tiered", "defaults-head-pieces", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "head_in_ring_pieces": True},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
        # --scaling-direct-chunk-mib: the defaults with tiered.reader.DIRECT_CHUNK (the O_DIRECT request size) set
        for mib in a.scaling_direct_chunk_mib:
            r = R("scaling-io", "tiered", f"defaults-direct{mib:g}m", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "direct_chunk_mib": mib},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
        # --scaling-staged: the defaults with every O_DIRECT read through the staging buffer (tiered.reader.SLOT_DIRECT
        # off, as before the seventeenth session): the A/B of reading straight into the ring slot, in the same rounds
        if a.scaling_staged:
            r = R("scaling-io", "tiered", "defaults-staged", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "slot_direct": False},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
        # --scaling-fixed-shape: the defaults with O_DIRECT's read shape fixed at 16 MiB on every reader thread
        # (tiered.reader.SHAPES of one; the backend still measured): the A/B of measuring the shape, in the same rounds
        if a.scaling_fixed_shape:
            r = R("scaling-io", "tiered", "defaults-fixed-shape", cache="cold", limit=bool(lim), io="auto",
                  opts={"ring_gb": None, "gpu_gb": a.gpu_gb if cuda else None, "read_shapes": False},
                  new_tokens=slow)
            runs.append(dataclasses.replace(r, key=f"main/{r.system}-{r.variant}/original/{r.io}/cold/{tag}", mem_gb=lim))
    keep = [r for r in runs if r.group in a.groups and r.system in a.systems
            and (not a.runs or any(fnmatch.fnmatch(r.key, pat) for pat in a.runs))]
    if a.no_cold:
        keep = [r for r in keep if r.cache != "cold"]
    if a.no_limit:
        keep = [r for r in keep if not r.limit]
    if a.repeat > 1:  # rounds, the order reversed every other round, so drift in the machine hits every run alike
        rounds = []
        for k in range(a.repeat):
            for r in (keep if k % 2 == 0 else keep[::-1]):
                rounds.append(dataclasses.replace(r, key=f"{r.key}#{k + 1}"))
        keep = rounds
    return ckpts, keep


# ---------------------------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------------------------


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sh(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _mount_of(path: Path) -> dict[str, Any]:
    """The mount holding ``path``: mount point, file system type, source device (+ rotational, model)."""
    path = path.resolve()
    best: dict[str, Any] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mp = left.split()[4].replace("\\040", " ")
                fstype, source = (right.split() + ["", ""])[:2]
                if (str(path) == mp or str(path).startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best.get("mount", "")):
                    best = {"mount": mp, "fstype": fstype, "source": source}
    except OSError:
        return best
    src = best.get("source", "")
    if src.startswith("/dev/"):
        dev = os.path.basename(os.path.realpath(src))
        blk = Path("/sys/class/block") / dev
        parent = blk.resolve().parent.name if (blk / "partition").exists() else dev
        for k, p in (("rotational", f"/sys/block/{parent}/queue/rotational"), ("model", f"/sys/block/{parent}/device/model")):
            try:
                best[k] = Path(p).read_text().strip()
            except OSError:
                pass
    try:
        du = shutil.disk_usage(path)
        best["size_gb"], best["free_gb"] = du.total / 1e9, du.free / 1e9
    except OSError:
        pass
    return best


def machine_info(ckpt_dir: Path) -> dict[str, Any]:
    cpu = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    gpus = _sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    commit = _sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = _sh(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": mem / GiB if mem else None,
        "gpus": gpus.splitlines() if gpus else [],
        "kernel": platform.release(),
        "python": platform.python_version(),
        "disk": _mount_of(ckpt_dir),
        "versions": {p: _version(p) for p in ("torch", "transformers", "accelerate", "deepspeed", "safetensors",
                                               "matplotlib", "psutil")},
        "tiered_commit": (commit + ("+dirty" if dirty else "")) if commit else None,
        "drop_caches_permitted": os.access("/proc/sys/vm/drop_caches", os.W_OK),
    }


def machine_label(info: dict[str, Any]) -> str:
    if info["gpus"]:
        # the model token ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200), else the name's last word
        words = info["gpus"][0].split(",")[0].split()
        name = next((w for w in words if re.fullmatch(r"[A-Za-z]+\d+[A-Za-z]*", w)), words[-1]).lower()
        n = len(info["gpus"])
        return name if n == 1 else f"{n}x{name}"
    ram = f"-{round(info['ram_gib'])}g" if info.get("ram_gib") else ""
    return f"cpu-{info['cores']}c{ram}"


# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, a: argparse.Namespace, ckpts: dict[str, Ckpt], runs: list[RunDef], cuda: bool) -> None:
        self.a = a
        self.ckpts = ckpts
        self.runs = runs
        self.cuda = cuda
        self.t0 = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="tiered-bench-", dir=a.cache_dir))
        self.warm: set[Path] = set()  # checkpoint dirs the page cache holds (emptied by every cache drop)
        self.logs: list[str] = []
        self.ceiling_skip = 0.0  # GiB: where the next adjacent disk ceiling starts reading (disk_ceilings)
        self.invocation_ceilings: dict[str, Any] = {}  # the invocation's ceilings, once measured (main sets it)
        self.took: dict[str, float] = {}  # --repeat: a run's key without its round (#n) -> seconds its last round took
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                        TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        self.logs.append(line)

    def _child_log(self, title: str, path: Path, lines: int = 40) -> None:
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        tail = [t for t in tail if "Loading weights" not in t]
        self.logs.append(f"----- {title} -----")
        self.logs.extend(tail)

    def ensure_ckpt(self, c: Ckpt) -> bool:
        if c.status != "pending":
            return c.status == "ok"
        cmd = [sys.executable, str(HERE / "make_checkpoint.py"), "--arch", c.arch, "--dtype", c.dtype, "--scale",
               str(c.scale), "--max-shard-size", c.max_shard_size, "--quiet", str(c.dir)]
        if c.layers is not None:
            cmd[2:2] = ["--layers", str(c.layers)]
        if c.quant:
            cmd[2:2] = ["--quant", c.quant]
        self.log(f"checkpoint {c.key}: {c.dir}")
        t = time.monotonic()
        log = self.work / f"ckpt-{c.key}.log"
        r = cgroup.run_child(cmd, timeout_s=max(10.0, self.left()), stdout=log, stderr=log, env=self.env, cwd=ROOT)
        c.gen_s = time.monotonic() - t
        if r.status != "ok":
            c.status = f"failed: make_checkpoint {r.status}"
            self._child_log(f"make_checkpoint {c.key}", log)
            return False
        c.status = "ok"
        c.bytes = sum(p.stat().st_size for p in c.dir.glob("*.safetensors"))
        self.log(f"  {c.bytes / 1e9:.3f} GB ready in {c.gen_s:.1f} s ({log.read_text().strip().splitlines()[-1:]})")
        if not (self.a.no_settle or self.a.no_cold):
            self.settle(c)
        return True

    def settle(self, c: Ckpt) -> None:
        """Read checkpoint ``c`` once whole with O_DIRECT before any timed run reads it (``ceilings.py --settle``;
        ``--no-settle`` skips it). Without it the first timed cold run is the first to read the just-written files,
        and it was the slowest of its system's rounds in every invocation of 2026-12-06 and 2026-12-07 on the H100
        (the order of rounds puts tiered first). The per-slice rates are logged and kept (``checkpoints.<key>.settle``
        in the JSON), so whether the disk speeds up during this read is on record."""
        cmd = [sys.executable, str(HERE / "ceilings.py"), str(c.dir), "--settle", "--threads", str(self.a.threads)]
        out, err = self.work / f"settle-{c.key}.out", self.work / f"settle-{c.key}.err"
        r = cgroup.run_child(cmd, timeout_s=max(10.0, min(120.0, self.left() - 20.0)), stdout=out, stderr=err,
                             env=self.env, cwd=ROOT)
        try:
            c.settle = json.loads(out.read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            self._child_log(f"settle {c.key}", err)
            c.settle = {"error": f"ceilings.py --settle {r.status}"}
            return
        self.log(f"  settle read (O_DIRECT, whole checkpoint once, {c.settle['threads']} threads): "
                 f"{c.settle['gbps']:.2f} GB/s; per {c.settle['slice_bytes'] / GiB:g} GiB: "
                 + " ".join(f"{g:.2f}" for g in c.settle["slices_gbps"]))

    def ensure_resharded(self, c: Ckpt) -> str:
        if c.reshard_status != "pending":
            return c.reshard_status
        dst = c.dir.parent / (c.dir.name + "-resharded")
        c.resharded_dir = dst
        if (dst / "model.safetensors.index.json").is_file():
            c.reshard_status = "cached"  # tiered.reshard renames into place only when complete
            return c.reshard_status
        code = ("import sys\ntry:\n    from tiered.reshard import reshard\nexcept ImportError as e:\n"
                "    print('CONVERTER_MISSING', e); sys.exit(3)\n"
                f"print(reshard({str(c.dir)!r}, {str(dst)!r}, quiet=True, force=True))\n")
        log = self.work / f"reshard-{c.key}.log"
        t = time.monotonic()
        r = cgroup.run_child([sys.executable, "-c", code], timeout_s=max(10.0, self.left() - self.a.min_start_s),
                             stdout=log, stderr=log, env=self.env, cwd=ROOT)
        c.reshard_s = time.monotonic() - t
        text = log.read_text(errors="replace")
        if r.returncode == 3 and "CONVERTER_MISSING" in text:
            c.reshard_status = "not run: converter missing (tiered.reshard not importable)"
        elif r.status != "ok":
            c.reshard_status = f"not run: converter {r.status}"
            self._child_log(f"reshard {c.key}", log)
        else:
            c.reshard_status = "ok"
            self.log(f"  resharded {c.key} in {c.reshard_s:.1f} s -> {dst}")
        return c.reshard_status

    def prewarm(self, d: Path) -> None:
        """Read checkpoint ``d`` into the page cache the way a reader leaves it, unless that is known done."""
        if d in self.warm:
            return
        t = time.monotonic()
        n = warm_page_cache(d)
        self.warm.add(d)
        self.log(f"  page cache warmed (evicted, then read): {d.name}, {n / 1e9:.2f} GB in {time.monotonic() - t:.1f} s")

    def ceilings(self) -> dict[str, Any]:
        c = self.ckpts["main"]
        cmd = [sys.executable, str(HERE / "ceilings.py"), str(c.dir), "--max-gb", str(self.a.ceiling_gb),
               "--rounds", str(self.a.ceiling_rounds)]
        if not self.cuda:
            cmd.append("--no-cuda")
        out, err = self.work / "ceilings.out", self.work / "ceilings.err"
        self.log(f"ceilings ({self.a.ceiling_rounds} rounds, interleaved)")
        r = cgroup.run_child(cmd, timeout_s=max(10.0, min(180.0, self.left())), stdout=out, stderr=err, env=self.env, cwd=ROOT)
        try:
            res = json.loads(out.read_text().strip().splitlines()[-1])
            self.log(f"  ceilings measured in {res.get('elapsed_s', 0):.1f} s")
            return res
        except (OSError, ValueError, IndexError):
            self._child_log("ceilings", err)
            return {"error": f"ceilings.py {r.status}"}

    def disk_ceilings(self) -> dict[str, Any]:
        """The disk's read ceilings again, just before a cold run of the scaling groups (``ceilings.py --disk-only``,
        one round of ``ceiling_gb``: O_DIRECT at 1 and 4 threads, buffered cold), each time over bytes of the main
        checkpoint that the previous measurement did not read. A virtual disk's rate drifts within a call (1.76 ->
        1.10 GB/s in six minutes on the H100 of 2026-12-05), so the run's disk efficiency is held against the
        ceiling measured beside it as well as against the invocation's (:func:`disk_efficiency`)."""
        c = self.ckpts["main"]
        skip = self.ceiling_skip
        self.ceiling_skip += self.a.ceiling_gb
        cmd = [sys.executable, str(HERE / "ceilings.py"), str(c.dir), "--max-gb", str(self.a.ceiling_gb),
               "--rounds", "1", "--disk-only", "--no-cuda", "--skip-gb", f"{skip:g}"]
        out, err = self.work / "adjacent.out", self.work / "adjacent.err"
        r = cgroup.run_child(cmd, timeout_s=max(10.0, min(60.0, self.left() - 20.0)), stdout=out, stderr=err,
                             env=self.env, cwd=ROOT)
        try:
            res = json.loads(out.read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            self._child_log("adjacent ceilings", err)
            return {"error": f"ceilings.py --disk-only {r.status}"}
        keep = {k: v for k, v in res.items() if k.endswith("_gbps") or k in ("skip", "max_bytes", "elapsed_s")}
        self.log("  disk now: " + ", ".join(f"{k.removesuffix('_gbps')} {v:.2f}" for k, v in keep.items()
                                             if k.endswith("_gbps")) + " GB/s")
        return keep

    def run_one(self, rd: RunDef, cg_ok: bool, cg_why: str) -> dict[str, Any]:
        a = self.a
        c = self.ckpts[rd.ckpt]
        row: dict[str, Any] = {"key": rd.key, "label": rd.label, **{k: v for k, v in asdict(rd).items() if k != "opts"},
                               "opts": dict(rd.opts), "mem_limit_gb": (rd.mem_gb or a.mem_limit_gb) if rd.limit else None}
        left = self.left()
        if left < a.min_start_s:
            row["status"] = f"not run: suite budget spent (--budget-s {a.budget_s:.0f})"
            return row
        took = self.took.get(rd.key.rpartition("#")[0] or rd.key)
        if took is not None and left - a.min_start_s < 0.9 * took:  # a timeout it cannot meet: a wasted run
            row["status"] = (f"not run: {left:.0f} s of the suite budget left (--budget-s {a.budget_s:.0f}), its "
                             f"earlier round took {took:.0f} s")
            return row
        if not self.ensure_ckpt(c):
            row["status"] = f"not run: checkpoint {c.status}"
            return row
        row["model_gb"] = c.bytes / 1e9 if c.bytes else None
        model_dir = c.dir
        if rd.layout == "resharded":
            st = self.ensure_resharded(c)
            if st.startswith("not run"):
                row["status"] = st
                return row
            model_dir = c.resharded_dir
        if rd.system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            row["status"] = "not run: deepspeed not importable"
            return row
        if rd.limit and not cg_ok:
            row["status"] = "not run: no cgroup v2 memory limit here (see 'Memory limit'); RSS alone is in the unlimited rows"
            return row
        if rd.cache == "warm":
            self.prewarm(model_dir)
        opts = dict(rd.opts)
        if opts.get("ring_gb") == "fit":  # CPU resident: a ring that holds every unit (4 KiB-aligned) + slack
            opts["ring_gb"] = max(a.ring_gb, ((c.bytes or 0) * 1.02 + (64 << 20)) / GiB)
            opts["ring_gb"] = float(f"{opts['ring_gb']:.3f}")
        row["opts"] = opts
        offload = Path(a.cache_dir) / f"offload-{os.getpid()}"
        spec = {"system": rd.system, "model_dir": str(model_dir), "prompt_ids": self.prompt_ids(c),
                "new_tokens": rd.new_tokens, "device": "cuda" if self.cuda else "cpu", "cold": rd.cache == "cold",
                "io": rd.io, "threads": a.threads, "prefetch": a.prefetch, "offload_folder": str(offload),
                **{k: v for k, v in opts.items() if k in ("ring_gb", "gpu_gb", "cpu_gb")},
                "extra": {k: v for k, v in opts.items() if k in SPEC_EXTRA}}
        lost = sorted(set(opts) - set(SPEC_EXTRA) - {"ring_gb", "gpu_gb", "cpu_gb"})
        if lost:  # (the twenty-third session's A/B ran defaults twice: a switch dropped here never reached the child)
            raise SystemExit(f"run.py: run {rd.key} sets {lost}, which the child's spec does not carry; add them to "
                             "SPEC_EXTRA and handle them in benchmarks/systems.py")
        if rd.cache == "cold" and rd.group in ("scaling", "scaling-io") and not a.no_adjacent_ceilings:
            row["adjacent_ceilings"] = self.disk_ceilings()  # the disk's rate now, beside this run (it drifts)
            left = self.left()
        sp = self.work / f"spec-{len(self.logs)}.json"
        sp.write_text(json.dumps(spec))
        out, err = self.work / "child.out", self.work / "child.err"
        timeout = min(a.timeout_s, left - 5.0)
        lim_gb = rd.mem_gb or a.mem_limit_gb
        limit = int(lim_gb * GiB) if rd.limit else None
        self.log(f"run {rd.key} ({rd.new_tokens} tokens, timeout {timeout:.0f} s"
                 + (f", memory.max {lim_gb:g} GiB" if limit else "") + ")")
        r = cgroup.run_child([sys.executable, str(HERE / "systems.py"), str(sp)], timeout_s=timeout,
                             mem_limit_bytes=limit, stdout=out, stderr=err, env=self.env, cwd=ROOT)
        shutil.rmtree(offload, ignore_errors=True)
        if rd.cache == "cold":
            self.warm.clear()
        res: dict[str, Any] = {}
        partial: dict[str, Any] = {}
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("BENCH_RESULT "):
                res = json.loads(line[len("BENCH_RESULT "):])
            elif line.startswith("BENCH_PARTIAL "):
                partial = json.loads(line[len("BENCH_PARTIAL "):])
        row.update(partial)
        row.update(res)
        row["child"] = r.to_dict()
        if r.status != "ok":
            row["status"] = r.status
        elif not res:
            row["status"] = "failed: no result line"
        if not str(row.get("status", "")).startswith(("ok", "not run")) or r.status != "ok":
            self._child_log(rd.key, err)
        if row.get("peak_rss_gb") is None and r.ru_maxrss_bytes:
            row["peak_rss_gb"] = r.ru_maxrss_bytes / GiB  # killed: the kernel's record of its VmHWM
            if row.get("rss_base_gb"):
                row["peak_rss_over_base_gb"] = row["peak_rss_gb"] - row["rss_base_gb"]
        row["ru_maxrss_gb"] = r.ru_maxrss_bytes / GiB if r.ru_maxrss_bytes else None
        if r.cgroup:
            row["cgroup_peak_gb"] = r.cgroup["memory_peak"] / GiB if r.cgroup.get("memory_peak") is not None else None
            row["cgroup_events"] = r.cgroup.get("events")
        row["wall_s"] = r.wall_s
        row.update(disk_efficiency(row, self.invocation_ceilings))
        if r.status == "ok":
            self.took[rd.key.rpartition("#")[0] or rd.key] = r.wall_s
        msg = row["status"]
        if row.get("decode_s_per_token_median"):
            msg += f": load {row.get('load_s', 0):.1f} s, {row['decode_s_per_token_median']:.3f} s/token"
        if row.get("peak_rss_over_base_gb") is not None:
            msg += f", peak RSS +{row['peak_rss_over_base_gb']:.2f} GiB"
        ch = row.get("io_choice") or {}
        if ch:  # io="auto" on O_DIRECT: the way of reading it measured and kept
            msg += f", io {ch.get('chosen')} (direct {ch.get('direct_gbps', 0):.2f} / pread {ch.get('pread_gbps', 0):.2f} GB/s"
            if ch.get("shapes"):
                msg += "; " + ", ".join(f"{k} {g:.2f}" for k, g in ch["shapes"].items())
                msg += f"; kept {ch.get('request', 0) / (1 << 20):g} MiB x{ch.get('depth')}"
            msg += f"; measured again {ch['reprobes']}x)" if ch.get("reprobes") else ")"
        st = row.get("stats_total") or {}
        if st.get("disk_busy"):  # a read in flight this share of the passes' time (tiered.stats: "disk busy")
            msg += (f", disk busy {st['disk_busy']:.3f}, {st.get('read_gbps', 0):.2f} GB/s while reading, "
                    f"{st.get('piece_units', 0)} units in pieces, ring {st.get('ring_bytes', 0) / (1 << 30):.3f} GiB"
                    f" + host {st.get('host_bytes', 0) / (1 << 30):.3f} GiB")
        self.log(f"  {msg} ({r.wall_s:.0f} s)")
        return row

    def prompt_ids(self, c: Ckpt) -> list[int]:
        vocab = 30000
        try:
            vocab = int(json.loads((c.dir / "config.json").read_text()).get("vocab_size", vocab))
        except (OSError, ValueError):
            pass
        rng = random.Random(self.a.seed)
        return [rng.randrange(100, min(vocab, 30000)) for _ in range(self.a.prompt_len)]


DISK_CEILINGS = ("odirect_1t", "odirect_4t", "buffered_cold")  # ceilings.py's disk read figures


def disk_efficiency(row: dict[str, Any], ceilings: dict[str, Any]) -> dict[str, Any]:
    """Issue 23's disk efficiency of a cold tiered run: bytes read per second of decode (``decode_gbps``: GB read per
    token / decode s per token) over the better of the disk's read ceilings (:data:`DISK_CEILINGS`):
    ``disk_efficiency`` against the ones measured just before the run (``adjacent_ceilings``), and
    ``disk_efficiency_invocation`` against the max over the rounds of the invocation's (measured at its start). Only
    where every byte read came from the disk (no page-cache tier: its reads are cache hits) and the decode read at
    least 0.01 GB per token (a host tier holding every streamed unit leaves the disk idle: no rate to hold); ``{}``
    otherwise, or for other systems (accelerate's per-token bytes include what it keeps in CPU memory)."""
    if (row.get("system") != "tiered" or (row.get("decode_gbps") or 0) <= 0 or (row.get("streamed_gb_per_token") or 0)
            < 0.01 or (row.get("spec") or {}).get("cold") is not True
            or (row.get("stats_total") or {}).get("page_cache_units")):
        return {}
    out: dict[str, Any] = {}
    adj = row.get("adjacent_ceilings") or {}
    best = max((adj.get(f"{k}_gbps") or 0.0 for k in DISK_CEILINGS), default=0.0)
    if best:
        out["disk_efficiency"] = row["decode_gbps"] / best
    inv = max((ceilings.get(f"{k}_gbps_max") or ceilings.get(f"{k}_gbps") or 0.0 for k in DISK_CEILINGS), default=0.0)
    if inv:
        out["disk_efficiency_invocation"] = row["decode_gbps"] / inv
    return out


def warm_page_cache(d: Path) -> int:
    """Evict each ``*.safetensors`` file of ``d`` from the page cache (``POSIX_FADV_DONTNEED``: clean pages, no root
    needed), then read it whole; returns the bytes read. A "warm" run then starts from the page cache a *reader*
    leaves, as after a download followed by a reboot or by memory pressure. The evict step matters: pages a writer
    left (``make_checkpoint.py`` just wrote the file) stay in small folios, while a read on Linux 6.x (ext4, xfs)
    fills large ones that a mapping maps by the 2 MiB PMD. On this project's 2-core machine (kernel 6.18, ext4) a
    1 GiB mapping's ``MADV_DONTNEED`` took 35 ms on written pages and 1.4 ms on read pages; a one-row bf16
    ``F.linear`` that faulted them in paid +15 ms per 500 MiB on written pages and nothing measurable on read ones.
    Every system here maps the checkpoint (transformers and accelerate through safetensors, tiered zero copy), so
    each starts from the same pages."""
    n = 0
    for p in sorted(d.glob("*.safetensors")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while k := len(os.read(fd, 8 << 20)):
                n += k
        finally:
            os.close(fd)
    return n


def _tokens_match(rows: list[dict[str, Any]]) -> None:
    """Greedy tokens of every ok run against the reference run of the same checkpoint (transformers first)."""
    by_ckpt: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("tokens_out"):
            by_ckpt.setdefault(r["ckpt"], []).append(r)
    for group in by_ckpt.values():
        ref = next((r for r in group if r["system"] == "transformers"), group[0])
        for r in group:
            n = min(len(r["tokens_out"]), len(ref["tokens_out"]))
            r["tokens_match"] = r["tokens_out"][:n] == ref["tokens_out"][:n]
            r["tokens_ref"] = ref["key"]


def _cuda_available() -> bool:
    out = _sh([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], timeout=120)
    return out is not None and out.strip().endswith("True")


def main(argv: list[str] | None = None) -> int:
    epilog = "suites:\n" + "\n".join(f"  {k:<10} {v}" for k, v in SUITE_HELP.items()) + (
        "\n\nThe step suites (all but quick and full) take only --out-dir, --cache-dir, --repeat, --steps, --tag, "
        "--nproc,\n--device (soak), --dry-run/--list; each of their commands is one measuring child process.")
    p = argparse.ArgumentParser(description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=list(SUITE_HELP), default="quick", help="which suite (list below)")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TIERED_CACHE", ROOT / ".cache" / "bench")),
                   help="checkpoints, resharded copies, offload folders, child logs (default $TIERED_CACHE or "
                   ".cache/bench in the checkout, which `make clean` removes)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the suite's")
    p.add_argument("--arch", default=None, help="make_checkpoint.py arch (default: the suite's)")
    p.add_argument("--dtype", default=None, choices=["fp16", "bf16", "fp32"])
    p.add_argument("--quant", default=None, choices=["fp8"],
                   help="checkpoints in block-scaled FP8 (make_checkpoint.py --quant fp8; dense archs): tiered streams "
                        "the stored codes, transformers/accelerate/DeepSpeed load them with FineGrainedFP8Config("
                        "dequantize=True) (issue 24)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--scale", type=float, default=None)
    p.add_argument("--max-shard-size", default=None)
    p.add_argument("--sweep-layers", default=None, help="comma list of layer counts for the RSS-vs-size sweep ('' for none)")
    p.add_argument("--ring-gb", type=float, default=None, help="tiered ring, GiB")
    p.add_argument("--gpu-gb", type=float, default=None, help="GPU budget of tiered streamed and accelerate, GiB")
    p.add_argument("--cpu-gb", type=float, default=None, help="accelerate max_memory['cpu'], GiB (default: = ring)")
    p.add_argument("--repeat", type=lambda v: max(1, int(v)) if int(v) >= 1 else p.error("--repeat must be >= 1"),
                   default=1, metavar="N",
                   help="run the selected runs N times, in rounds (every other round in reverse order); the report "
                        "adds the median decode s/token of each run over the rounds and its ratio to accelerate's")
    p.add_argument("--pieces-ring-gb", type=float, default=None, metavar="GiB",
                   help="CUDA, group io: also run tiered io=direct, cold, limited, with this ring (smaller than a "
                        "unit: units stream in pieces), without and with each --pieces-host-gb host tier")
    p.add_argument("--pieces-host-gb", type=lambda v: [float(x) for x in v.split(",") if x.strip()], default=[],
                   metavar="GiB[,GiB...]", help="host tiers of the --pieces-ring-gb runs (comma list)")
    p.add_argument("--host-gb", type=float, default=None,
                   help="the streamed-host run's host tier, GiB, taken out of --ring-gb (default: half of it)")
    p.add_argument("--mem-limit-gb", type=float, default=None, help="cgroup memory.max of the limited runs (default: ring + 2)")
    p.add_argument("--scaling", default="", metavar="GIB,...",
                   help="the memory-scaling benchmark (group scaling): tiered with its defaults (only --gpu-gb) and "
                   "accelerate disk offload (max_memory cpu = limit - 1.2 GiB on CUDA, - 1.0 on the CPU), cold, at "
                   "each of these cgroup "
                   "memory.max in GiB ('none' or 0: no limit; e.g. 2,4,8,16,none); with --repeat, alternating rounds")
    p.add_argument("--scaling-io", default="", metavar="IO,...",
                   help="with --scaling: also run tiered's defaults with io forced to each of these (direct, pread, "
                        "mmap) at every limit, in the same rounds (group scaling-io; its rows are in the rounds "
                        "table, against accelerate at the same limit)")
    p.add_argument("--scaling-pieces-ring", action="store_true",
                   help="with --scaling: also run tiered's defaults with the automatic ring of three pieces on CUDA "
                        "(tiered.policy.AUTO_RING_IN_PIECES on; the rest of the memory to the host tier) at every "
                        "limit, in the same rounds (group scaling-io)")
    p.add_argument("--scaling-head-pieces", action="store_true",
                   help="with --scaling: also run tiered's defaults with a head the ring holds but not beside a layer "
                        "read in pieces through ring slots of its own on the CPU (tiered.policy.HEAD_IN_RING_PIECES "
                        "on) at every limit, in the same rounds (group scaling-io): its A/B")
    p.add_argument("--scaling-pieces-cut", action="store_true",
                   help="with --scaling: also run tiered's defaults with every unit the ring holds whole but not twice "
                        "read in pieces on CUDA (tiered.policy.PIECES_WHEN_ONE_FITS on) at every limit, in the same "
                        "rounds (group scaling-io)")
    p.add_argument("--scaling-direct-chunk-mib", default="", metavar="MIB,...",
                   help="with --scaling: also run tiered's defaults with each O_DIRECT request size "
                        "(tiered.reader.DIRECT_CHUNK, MiB) at every limit, in the same rounds (group scaling-io)")
    p.add_argument("--scaling-staged", action="store_true",
                   help="with --scaling: also run tiered's defaults with every O_DIRECT read through the staging "
                        "buffer (tiered.reader.SLOT_DIRECT off) at every limit, in the same rounds (group scaling-io)")
    p.add_argument("--scaling-fixed-shape", action="store_true",
                   help="with --scaling: also run tiered's defaults with O_DIRECT's read shape fixed (16 MiB requests on "
                        "every reader thread: tiered.reader.SHAPES of one, so only the backend is measured) at every "
                        "limit, in the same rounds (group scaling-io)")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--slow-new-tokens", type=int, default=None, help="accelerate, DeepSpeed, cold and limited runs")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="prompt token ids seed")
    p.add_argument("--threads", type=int, default=4, help="tiered reader threads")
    p.add_argument("--ceiling-rounds", type=int, default=None, metavar="N",
                   help="rounds of every machine ceiling, interleaved (default: the suite's, 3); the report holds "
                        "each figure against its ceiling's max over the rounds")
    p.add_argument("--no-adjacent-ceilings", action="store_true",
                   help="scaling groups: do not measure the disk's read ceilings again before each cold run (the "
                        "run's disk efficiency is then held against the invocation's ceilings only)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=None, help="stop starting runs after this many seconds")
    p.add_argument("--timeout-s", type=float, default=None, help="per child process")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {','.join(GROUPS)}")
    p.add_argument("--systems", default="tiered,transformers,accelerate,deepspeed")
    p.add_argument("--runs", default="", help="comma list of fnmatch patterns on run keys (e.g. 'main/tiered-*')")
    p.add_argument("--no-cold", action="store_true", help="skip cold-cache runs")
    p.add_argument("--no-settle", action="store_true",
                   help="do not read each checkpoint once whole (O_DIRECT) before the first timed run (Runner.settle)")
    p.add_argument("--no-limit", action="store_true", help="skip memory-limited runs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="print what the suite would run and exit (step suites: every command; quick/full: the plan)")
    p.add_argument("--steps", default="", help="step suites: comma list of fnmatch patterns on step names (e.g. "
                                               "'host-*'); a selected step's setup (checkpoint, page cache) runs too")
    p.add_argument("--nproc", type=int, default=None, help="multi-gpu: processes (GPUs) under torchrun (default: all)")
    a = p.parse_args(argv)
    if a.suite in steps.STEP_SUITES:
        return _step_suite(p, a)
    s = SUITES[a.suite]
    for k in ("device", "arch", "dtype", "layers", "scale", "max_shard_size", "ring_gb", "gpu_gb", "new_tokens",
              "slow_new_tokens", "budget_s", "timeout_s"):
        if getattr(a, k) is None:
            setattr(a, k, getattr(s, k))
    a.sweep_layers = s.sweep_layers if a.sweep_layers is None else [int(x) for x in a.sweep_layers.split(",") if x.strip()]
    a.ceiling_gb, a.min_start_s = s.ceiling_gb, s.min_start_s
    a.ceiling_rounds = s.ceiling_rounds if a.ceiling_rounds is None else a.ceiling_rounds
    if a.ceiling_rounds < 1:
        p.error("--ceiling-rounds must be >= 1")
    a.mem_limit_gb = a.mem_limit_gb if a.mem_limit_gb is not None else a.ring_gb + 2.0
    a.scaling = [0.0 if x.strip() in ("none", "0") else float(x) for x in a.scaling.split(",") if x.strip()]
    a.scaling_io = [x.strip() for x in a.scaling_io.split(",") if x.strip()]
    if bad_io := [x for x in a.scaling_io if x not in ("direct", "pread", "mmap")]:
        p.error(f"--scaling-io {bad_io}: choose from direct, pread, mmap")
    a.scaling_direct_chunk_mib = [float(x) for x in a.scaling_direct_chunk_mib.split(",") if x.strip()]
    if a.scaling_io and not a.scaling:
        p.error("--scaling-io needs --scaling")
    if a.scaling_pieces_ring and not a.scaling:
        p.error("--scaling-pieces-ring needs --scaling")
    if a.scaling_head_pieces and not a.scaling:
        p.error("--scaling-head-pieces needs --scaling")
    if a.scaling_pieces_cut and not a.scaling:
        p.error("--scaling-pieces-cut needs --scaling")
    if a.scaling and a.groups == ",".join(GROUPS):
        a.groups = "scaling,scaling-io"  # --scaling alone: only its runs
    a.groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    a.systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    a.runs = [x.strip() for x in a.runs.split(",") if x.strip()]
    bad = [g for g in a.groups if g not in GROUPS]
    if bad:
        p.error(f"unknown group(s) {bad}; choose from {GROUPS}")

    cuda = a.device == "cuda"
    a.list = a.list or a.dry_run
    if cuda and not a.list and not _cuda_available():
        print("run.py: --device cuda but torch sees no CUDA device; use --suite quick or --device cpu", file=sys.stderr)
        return 2
    ckpts, runs = build_plan(a, cuda)
    if a.list:
        for r in runs:
            print(f"{r.group:10} {r.key:70} {r.new_tokens} tokens  {r.opts}")
        return 0
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    a.out_dir.mkdir(parents=True, exist_ok=True)

    info = machine_info(a.cache_dir)
    stem = f"{info['date'][:10]}-{machine_label(info)}-{a.suite}{('-' + a.tag) if a.tag else ''}"
    json_path = a.out_dir / f"{stem}.json"
    cg_ok, cg_why = cgroup.probe() if any(r.limit for r in runs) else (False, "no memory-limited runs in this plan")
    runner = Runner(a, ckpts, runs, cuda)
    runner.log(f"{a.suite} suite -> {json_path} ({len(runs)} runs, budget {a.budget_s:.0f} s); {cg_why}")
    if any(r.cache == "cold" for r in runs) and info["drop_caches_permitted"]:
        runner.log("notice: before each cold run this writes 3 to /proc/sys/vm/drop_caches, which empties the page "
                   "cache of the whole machine (other programs re-read their files); --no-cold skips those runs")
    results: dict[str, Any] = {
        "suite": a.suite, "date": info["date"], "machine": info, "machine_label": machine_label(info),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "cgroup": {"available": cg_ok, "why": cg_why, "mem_limit_gb": a.mem_limit_gb},
        "notes": list(a.note), "ceilings": {}, "checkpoints": {}, "runs": [],
    }
    if not info["drop_caches_permitted"]:
        results["notes"].append("drop_caches not permitted (not root): 'cold' runs ran with whatever the page cache held")

    import report  # benchmarks/report.py (matplotlib imported lazily inside)

    def save() -> None:
        _tokens_match(results["runs"])
        results["checkpoints"] = {k: {**asdict(c), "dir": str(c.dir), "resharded_dir": str(c.resharded_dir or "")}
                                  for k, c in ckpts.items()}
        results["elapsed_s"] = time.monotonic() - runner.t0
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        os.replace(tmp, json_path)
        (a.out_dir / f"{stem}.md").write_text(report.markdown(results))
        (a.out_dir / f"{stem}-logs.txt").write_text("\n".join(runner.logs) + "\n")

    try:
        if runner.ensure_ckpt(ckpts["main"]):
            results["ceilings"] = runner.invocation_ceilings = runner.ceilings()
            runner.ceiling_skip = a.ceiling_gb  # the invocation's ceilings read the first ceiling_gb
        save()
        for rd in runs:
            results["runs"].append(runner.run_one(rd, cg_ok, cg_why))
            save()
    finally:
        shutil.rmtree(runner.work, ignore_errors=True)
    if not a.no_plots:
        made, note = report.plots(results, a.out_dir / stem)
        if note:
            results["notes"].append(note)
        results["plots"] = [m.name for m in made]
    save()
    runner.log(f"done in {time.monotonic() - runner.t0:.0f} s: {json_path}")
    print((a.out_dir / f"{stem}.md").read_text())
    return 0


def _step_suite(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """A suite of ``benchmarks/steps.py``: print its commands (--dry-run, --list) or run them."""
    suite = steps.STEP_SUITES[a.suite]
    dry = a.dry_run or a.list
    if a.device is None:
        a.device = "cuda" if suite.device != "cpu" else None
    n_gpus = steps.gpu_count() if suite.device == "multi-gpu" or a.nproc is None else 0
    a.nproc = a.nproc or n_gpus or 2
    if not dry:
        if suite.device == "multi-gpu" and n_gpus < 2:
            print(f"run.py: suite {a.suite} needs 2 or more GPUs (nvidia-smi sees {n_gpus})", file=sys.stderr)
            return 2
        if a.device == "cuda" and not _cuda_available():
            print(f"run.py: suite {a.suite} needs CUDA but torch sees no CUDA device (--dry-run prints its commands)",
                  file=sys.stderr)
            return 2
    info = machine_info(a.cache_dir)
    stem = f"{info['date'][:10]}-{machine_label(info)}-{a.suite}{('-' + a.tag) if a.tag else ''}"
    return steps.run_suite(a, a.suite, stem, None if dry else info)


if __name__ == "__main__":
    sys.exit(main())
