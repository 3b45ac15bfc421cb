"""The step suites of ``benchmarks/run.py``: fixed lists of commands, each one measuring child process.

``quick`` and ``full`` are plans of systems side by side (``run.py`` builds them, ``systems.py`` runs each). The
suites here are thinner: each is a list of *blocks*; a block is its setup (make the checkpoint with
``make_checkpoint.py``, read it into the page cache) and its steps, each one command of the existing measuring code
(``stream_run.py``, ``run.py --suite full`` with fixed options, ``dist_ceilings.py``, ``soak.py``, ...). A block's
setup runs once before its steps, when one of them is selected; with ``--repeat N`` the steps of a block marked
``repeat`` run in N rounds, every other round in reverse order (drift in the machine hits every step alike).

Every JSON line a step prints on stdout is appended to ``<out-dir>/<stem>.jsonl`` with ``"step"`` and ``"round"``
added; ``<stem>-logs.txt`` gets each command, its status and the tail of its output. Steps that call ``run.py``
write their own report (``<stem>-<tag>.md/.json``) in the same directory.

Only the standard library is imported here (and ``cgroup.py``, to run each child with a timeout).
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import cgroup  # noqa: E402

PY = sys.executable


@dataclass
class Step:
    name: str  # unique in its suite; --steps selects steps by fnmatch on it
    argv: list[str]  # run in the repository root; "{round}" is replaced by the round number
    timeout_s: float = 300.0


@dataclass
class Block:
    name: str
    setup: list[Step]
    steps: list[Step]
    repeat: bool = True  # --repeat N runs the steps in N rounds; False: once (they repeat inside, or need not)


@dataclass
class StepSuite:
    help: str  # one line, for --help
    device: str  # "cpu", "cuda" or "multi-gpu": what it needs (checked unless --dry-run)
    blocks: Callable[[Any], list[Block]]  # built from the parsed arguments (cache dir, nproc, device)
    notes: list[str] = field(default_factory=list)


def _ckpt_dir(a: Any, arch: str, dtype: str, layers: int | None = None) -> Path:
    """The directory ``run.py`` uses for the same checkpoint (``run._ckpt_name``), so both reuse one copy."""
    name = f"{arch}-{dtype}" + (f"-L{layers}" if layers is not None else "")
    return Path(a.cache_dir) / name


def _make(d: Path, arch: str, dtype: str, layers: int | None = None) -> list[Step]:
    """Generate the checkpoint once (cached by ``make_checkpoint.py``), then read it into the page cache."""
    cmd = [PY, "benchmarks/make_checkpoint.py", "--arch", arch, "--dtype", dtype, "--quiet", str(d)]
    if layers is not None:
        cmd[4:4] = ["--layers", str(layers)]
    return [Step(f"make {d.name}", cmd, timeout_s=900.0),
            Step(f"warm {d.name}", ["sh", "-c", f"cat {shlex.quote(str(d))}/*.safetensors > /dev/null"], 600.0)]


def _stream(d: Path, label: str, *flags: object) -> list[str]:
    """One ``stream_run.py`` measurement (one JSON line): tiered.load + greedy generate, timed token by token."""
    return [PY, "benchmarks/stream_run.py", str(d), "--label", f"{label}-{{round}}", *map(str, flags)]


def _run_full(a: Any, tag: str, *flags: object) -> list[str]:
    """``run.py --suite full`` with fixed options: systems side by side in their own processes, its own report."""
    return [PY, "benchmarks/run.py", "--suite", "full", "--device", "cuda", "--out-dir", str(a.out_dir),
            "--cache-dir", str(a.cache_dir), "--sweep-layers", "", "--no-plots", "--tag", tag, *map(str, flags)]


# ---------------------------------------------------------------------------------------------------
# The suites
# ---------------------------------------------------------------------------------------------------


def _gpu(a: Any) -> list[Block]:
    """GPT-J-6B shape, fp16, 12.1 GB, on one GPU (RESULTS.md: side by side, the host tier, the 2 GiB cgroup)."""
    g = _ckpt_dir(a, "gptj-6b", "fp16")
    make = _make(g, "gptj-6b", "fp16")
    stream = ("--ring-gb", 1, "--gpu-gb", 2, "--new-tokens", 16, "--threads", 4)
    return [
        # tiered streamed (ring 1 GiB, gpu_gb 2) against accelerate disk offload at the same GPU budget, warm and
        # cold page cache, with the machine's ceilings measured in the same invocation
        Block("side-by-side", make[:1], [Step("side-by-side", _run_full(
            a, "gpu-side-by-side", "--groups", "core,cold", "--systems", "tiered,accelerate",
            "--runs", "main/tiered-streamed/*,main/accelerate-*"), timeout_s=600.0)], repeat=False),
        # the host tier: none, half of the streamed layers (spread over them), all of them
        Block("host", make, [Step(f"host-{h}", _stream(g, f"gptj-host{h}", *stream, "--host-gb", h))
                             for h in (0, 5, 11)]),
        # a 2 GiB cgroup, cold disk, GPU budget 3 GiB: accelerate (cpu 0.8 GiB), tiered io=direct with a 0.45 GiB
        # ring, and with a 0.15 GiB ring (layers in pieces) + a 0.2 GiB host tier; three rounds, alternating
        Block("cold2g", make[:1], [Step("cold2g", _run_full(
            a, "gpu-cold2g", "--groups", "limit,io", "--mem-limit-gb", 2, "--gpu-gb", 3, "--ring-gb", 0.45,
            "--cpu-gb", 0.8, "--pieces-ring-gb", 0.15, "--pieces-host-gb", 0.2, "--repeat", 3,
            "--runs", "main/accelerate-*,main/tiered-streamed/original/direct/cold/limit,"
                      "main/tiered-streamed-pieces-host*"), timeout_s=600.0)], repeat=False),
    ]


def _gpu_moe(a: Any) -> list[Block]:
    """Routed experts: Mixtral-8x7B (6 layers) and Qwen3-30B-A3B (12 layers) shapes, bf16, one GPU."""
    blocks = []
    # 16 tokens measured after 16 of warm-up from a 64-token prompt: the measured lengths are new to the process,
    # as in one long generation (repeating them hides cuDNN attention's per-length graph build: NOTES.md)
    common = ("--ring-gb", 6, "--new-tokens", 16, "--threads", 4, "--warmup-tokens", 16, "--warmup-prompt-len", 64)
    for arch, short, layers in (("mixtral-8x7b", "mixtral", 6), ("qwen3-30b-a3b", "qwen3", 12)):
        g = _ckpt_dir(a, arch, "bf16", layers)
        runs = [Step(f"{short}-routed-host20", _stream(g, f"{short}-routed-host20", *common, "--gpu-gb", 2,
                                                        "--host-gb", 20)),
                Step(f"{short}-dense-host20", _stream(g, f"{short}-dense-host20", *common, "--gpu-gb", 2,
                                                       "--host-gb", 20, "--no-routed-experts")),
                Step(f"{short}-routed", _stream(g, f"{short}-routed", *common, "--gpu-gb", 2)),
                Step(f"{short}-dense", _stream(g, f"{short}-dense", *common, "--gpu-gb", 2, "--no-routed-experts")),
                Step(f"{short}-routed-host20-no-cudnn-sdp", _stream(g, f"{short}-routed-host20-no-cudnn-sdp", *common,
                                                                     "--gpu-gb", 2, "--host-gb", 20, "--no-cudnn-sdp")),
                Step(f"{short}-dense-host20-no-cudnn-sdp", _stream(g, f"{short}-dense-host20-no-cudnn-sdp", *common,
                                                                    "--gpu-gb", 2, "--host-gb", 20, "--no-routed-experts",
                                                                    "--no-cudnn-sdp"))]
        if short == "mixtral":  # the GPU expert cache: gpu_gb=10 leaves it 19 of the 48 experts
            runs += [Step("mixtral-routed-gpu10-cache", _stream(g, "mixtral-routed-gpu10-cache", *common, "--gpu-gb", 10)),
                     Step("mixtral-routed-gpu10-no-cache", _stream(g, "mixtral-routed-gpu10-no-cache", *common,
                                                                    "--gpu-gb", 10, "--expert-cache-gb", 0))]
        make = _make(g, arch, "bf16", layers)
        blocks.append(Block(short, make, runs))
        # accelerate disk offload at the same GPU budget (max_memory cuda 2 GiB, cpu 1 GiB), 4 tokens
        blocks.append(Block(f"{short}-accelerate", make[:1], [Step(f"{short}-accelerate", _run_full(
            a, f"gpu-moe-{short}-accelerate", "--arch", arch, "--dtype", "bf16", "--layers", layers, "--groups", "core",
            "--systems", "accelerate", "--gpu-gb", 2, "--cpu-gb", 1, "--slow-new-tokens", 4), timeout_s=600.0)],
            repeat=False))
    return blocks


def _gpu_big(a: Any) -> list[Block]:
    """Units larger than the ring: Llama-3-70B shape, 6 layers, bf16 (layers 1.71 GB, embedding and head 2.10 GB)."""
    g = _ckpt_dir(a, "llama3-70b", "bf16", 6)
    base = ("--ring-gb", 1, "--new-tokens", 8)
    return [Block("llama70", _make(g, "llama3-70b", "bf16", 6), [
        Step("ring1-gpu0", _stream(g, "llama70-ring1-gpu0", *base, "--gpu-gb", 0)),
        Step("ring1-gpu8", _stream(g, "llama70-ring1-gpu8", *base, "--gpu-gb", 8)),
        # peak RSS over a CUDA runtime that has already run this architecture's kernels
        Step("ring1-gpu0-cuda-warmup", _stream(g, "llama70-ring1-gpu0-cuda-warmup", *base, "--gpu-gb", 0,
                                               "--cuda-warmup")),
        Step("batch1", _stream(g, "llama70-batch1", *base, "--gpu-gb", 0, "--batch", 1)),
        Step("batch32", _stream(g, "llama70-batch32", *base, "--gpu-gb", 0, "--batch", 32)),
    ])]


def _multi_gpu(a: Any) -> list[Block]:
    """GPT-J-6B shape on N GPUs of one host under torchrun (distributed=True) against one GPU."""
    g = _ckpt_dir(a, "gptj-6b", "fp16")
    make = _make(g, "gptj-6b", "fp16")
    n = a.nproc
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    runs = []
    for io, threads, host in (("mmap", 4, 0), ("pread", 16, 0), ("mmap", 4, 11)):
        flags = ("--ring-gb", 1, "--gpu-gb", 2, "--new-tokens", 8, "--io", io, "--threads", threads, "--host-gb", host)
        name = f"{io}-t{threads}-host{host}"
        runs.append(Step(f"n1-{name}", _stream(g, f"n1-{name}", *flags)))
        runs.append(Step(f"n{n}-{name}", torchrun + _stream(g, f"n{n}-{name}", *flags, "--distributed")[1:]))
    return [
        # pinned H2D per GPU alone and all at once, page-cache reads alone and together, NCCL all-gather
        Block("dist-ceilings", make, [Step("dist-ceilings", torchrun + ["benchmarks/dist_ceilings.py", "--model-dir",
                                                                         str(g)])], repeat=False),
        Block("dist", make, runs),
    ]


def _soak(a: Any) -> list[Block]:
    """1,000 streamed decode steps on one loaded model, RSS sampled every 50 ms; the ring must be empty once idle."""
    return [Block("soak", [], [Step("soak", [PY, "benchmarks/soak.py", "--steps", "1000", "--device", a.device or "cpu"],
                                    timeout_s=1800.0)], repeat=False)]


def _reshard(a: Any) -> list[Block]:
    """``tiered reshard``: its speed next to ``cp`` of the same bytes, and 100 SIGKILLs at random points."""
    return [Block("reshard", [], [
        Step("reshard-vs-cp", [PY, "benchmarks/reshard_bench.py", "--cache", str(a.cache_dir)], timeout_s=1800.0),
        Step("kill-reshard", [PY, "benchmarks/kill_reshard.py", "--n", "100"], timeout_s=3600.0),
    ], repeat=False)]


STEP_SUITES: dict[str, StepSuite] = {
    "gpu": StepSuite("GPU: GPT-J-6B fp16 streamed vs accelerate (warm, cold), the host tier (0/5/11 GiB), a cold "
                     "2 GiB cgroup (3 rounds)", "cuda", _gpu),
    "gpu-moe": StepSuite("GPU: Mixtral-8x7B / Qwen3-30B-A3B shapes, routed vs dense experts, host tier, cuDNN SDPA "
                         "off, expert cache, accelerate", "cuda", _gpu_moe),
    "gpu-big": StepSuite("GPU: Llama-3-70B shape (units larger than the 1 GiB ring, in pieces), RSS over a warm "
                         "runtime, batch 1 vs 32", "cuda", _gpu_big),
    "multi-gpu": StepSuite("several GPUs: GPT-J-6B under torchrun (distributed=True) vs one GPU, mmap/pread/host "
                           "tier, plus dist ceilings", "multi-gpu", _multi_gpu),
    "soak": StepSuite("reliability: 1,000 streamed decode steps, RSS growth and an empty ring once idle (--device "
                      "cpu|cuda)", "cpu", _soak),
    "reshard": StepSuite("CPU: tiered reshard's speed vs cp, and 100 random SIGKILLs of it (never a partial DST)",
                         "cpu", _reshard),
}


# ---------------------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------------------


def gpu_count() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU ")) if r.returncode == 0 else 0


def schedule(a: Any, suite: StepSuite) -> list[tuple[str, Step, int]]:
    """(block name, step with its round filled in, round) in the order they run; setup steps have round 0."""
    patterns = [p.strip() for p in (a.steps or "").split(",") if p.strip()]
    out: list[tuple[str, Step, int]] = []
    for b in suite.blocks(a):
        steps = [s for s in b.steps if not patterns or any(fnmatch.fnmatch(s.name, p) for p in patterns)]
        if not steps:
            continue
        out += [(b.name, s, 0) for s in b.setup]
        rounds = a.repeat if b.repeat else 1
        for k in range(1, rounds + 1):
            for s in (steps if k % 2 == 1 else steps[::-1]):
                argv = [x.replace("{round}", str(k)) for x in s.argv]
                out.append((b.name, Step(s.name, argv, s.timeout_s), k))
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def run_suite(a: Any, name: str, stem: str, machine: dict[str, Any] | None) -> int:
    """Print (``--dry-run``) or run the suite's steps; returns the exit status (1 if any step failed)."""
    suite = STEP_SUITES[name]
    plan = schedule(a, suite)
    if not plan:
        print(f"run.py: no step of suite {name!r} matches --steps {a.steps!r}", file=sys.stderr)
        return 2
    if a.dry_run or a.list:
        print(f"# suite {name}: {suite.help}")
        print(f"# in {ROOT}, env HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 PYTHONPATH={ROOT}; JSON lines -> "
              f"{a.out_dir / (stem + '.jsonl')}")
        for block, s, k in plan:
            tag = "setup" if k == 0 else f"round {k}"
            print(f"[{block} / {s.name}, {tag}, timeout {s.timeout_s:.0f} s]\n  {shlex.join(s.argv)}")
        return 0
    a.out_dir.mkdir(parents=True, exist_ok=True)
    Path(a.cache_dir).mkdir(parents=True, exist_ok=True)
    jsonl, logs = a.out_dir / f"{stem}.jsonl", a.out_dir / f"{stem}-logs.txt"
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="tiered-steps-", dir=a.cache_dir))
    t0 = time.monotonic()
    failed = 0
    done_setup: set[tuple[str, ...]] = set()  # checkpoints made in this invocation

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        with open(logs, "a") as f:
            f.write(line + "\n")

    with open(jsonl, "a") as f:
        f.write(json.dumps({"step": "machine", "suite": name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"), "machine": machine}) + "\n")
    log(f"suite {name}: {len(plan)} commands -> {jsonl}")
    try:
        for block, s, k in plan:
            if k == 0 and s.name.startswith("make ") and tuple(s.argv) in done_setup:
                continue  # made (or found cached) already; a warm step runs again: a cold run may have dropped it
            out, err = work / "out.txt", work / "err.txt"
            log(f"{block} / {s.name}" + (f" round {k}" if k else "") + f": {shlex.join(s.argv)}")
            r = cgroup.run_child(s.argv, timeout_s=s.timeout_s, stdout=out, stderr=err, env=env, cwd=ROOT)
            text = out.read_text(errors="replace")
            with open(jsonl, "a") as f:
                for line in text.splitlines():
                    if line.startswith("{"):
                        try:
                            obj = json.loads(line)
                        except ValueError:
                            continue
                        f.write(json.dumps({"step": s.name, "block": block, "round": k,
                                            **(obj if isinstance(obj, dict) else {"value": obj})}) + "\n")
            tail = [t for t in (text.splitlines() + err.read_text(errors="replace").splitlines())
                    if t and not t.startswith("{") and "Loading weights" not in t][-30:]
            with open(logs, "a") as f:
                f.write("\n".join(f"    {t}" for t in tail) + ("\n" if tail else ""))
            log(f"  {r.status} ({r.wall_s:.0f} s)")
            if r.status != "ok":
                failed += 1
                if k == 0:  # a setup failed: its block cannot run
                    log(f"  setup of {block} failed: its steps will fail too")
            elif k == 0:
                done_setup.add(tuple(s.argv))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"done: {len(plan)} commands, {failed} failed; {jsonl}")
    return 1 if failed else 0
