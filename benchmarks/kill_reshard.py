#!/usr/bin/env python
"""SIGKILL `tiered reshard` at random points, N times: never a partial DST, never a changed SRC.

Each run picks a mode at random: plain, ``--dtype bf16``, ``--verify``, or ``--force`` over an
existing DST (a complete bf16 conversion, so the old and the new DST differ). It starts
``python -m tiered.cli reshard SRC DST --max-shard-size 8MB --quiet [mode flags]`` on a small
generated Llama checkpoint (fp32, several shards; ``benchmarks/make_checkpoint.py``) and SIGKILLs it
after a random delay: one time in three uniform over the whole unkilled run of that mode (from
its start), two in three counted from the appearance of its temporary directory, uniform over
that directory's life (writing, verifying, installing; 10% past it), so that not every kill lands
in Python's imports or exit. Run times are the median of the mode's last 5 unkilled runs
(measured first, then the reruns), so the delays follow the machine's load.
``--force`` runs use the atomic ``renameat2`` install, or, one in two, the portable journaled
two-rename install (``TIERED_RESHARD_NO_RENAMEAT2=1``).

After the kill it checks:

* DST is absent or complete: its files are byte-equal to the reference (unkilled) conversion of
  the mode, and its tensors, read with ``safetensors.torch.load_file``, equal the reference's bit
  for bit. After ``--force`` it is the old DST or the new one; absent only inside the journaled
  window (then the journal, the complete new output and the old DST are beside it);
* SRC is unchanged (BLAKE2b of every file, and the file list);
* nothing visible beside DST but DST: temporaries are the hidden ``.DST.tiered-*-<pid>`` names.

Then it reruns the same command, unkilled (with ``--force`` added when DST exists: a plain run
refuses an existing DST by design), which must exit 0, leave DST equal to the reference, leave no
``.DST.tiered-*`` behind and SRC unchanged. The phase of each kill is read from what it left
(startup: nothing yet; writing: its locked temporary directory; install: an unlocked one, a
journal or a moved-aside old DST; after install: the new DST only).

Prints a summary (runs per mode, kills per phase, DST states, failures) and exits 1 on any failure.

Launchers: ``exec`` (default) starts a fresh interpreter per run, as a user does. ``fork`` forks
every run from a zygote process that imported torch, transformers and tiered once, then calls
``tiered.cli.main`` (the same code as ``python -m tiered.cli``): a run costs ~0.5 s instead of
several. It hung twice in CI simulations of 2026-12-07 (once on tqdm's lock, fixed below; once more, cause open), so
the CI test (``tests/test_reshard.py::test_kill_loop_script``) uses ``exec``.

Usage: ``python benchmarks/kill_reshard.py --n 100`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

MODES = {"plain": [], "bf16": ["--dtype", "bf16"], "verify": ["--verify"], "force": ["--force"]}
REF_OF = {"plain": "plain", "bf16": "bf16", "verify": "plain", "force": "plain"}
PHASES = ["startup", "writing", "install", "after install", "finished"]
NO_RENAMEAT2 = "TIERED_RESHARD_NO_RENAMEAT2"


# ---------------------------------------------------------------------------------------------- launchers


class ExecLauncher:
    """Each run: ``python -m tiered.cli reshard ...`` in a fresh interpreter."""

    name = "exec"

    def warm(self, argv: list[str]) -> None:
        pass

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ExecRun:
        return ExecRun(argv, env, log)

    def close(self) -> None:
        pass


class ExecRun:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        with open(log, "wb") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "tiered.cli", "reshard", *argv], cwd=ROOT, stdin=subprocess.DEVNULL,
                                      stdout=f, stderr=f,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), **env})
        self.pid = self.p.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)  # a no-op once reaped: never another process's pid


ZYGOTE = r"""
import json, os, select, signal, sys, threading, traceback
import torch, transformers, tqdm.auto  # noqa: F401  the runtime, imported once
transformers.LlamaForCausalLM  # resolve the lazy import
import tiered.cli, tiered.reshard  # noqa: F401
import tqdm.std

# no tqdm monitor thread in the zygote: a fork while that thread held tqdm's write lock left the forked run waiting for
# it forever (tqdm.__new__ -> TqdmDefaultWriteLock.acquire; a CI simulation of 2026-12-07 hung here for 600 s)
tqdm.std.tqdm.monitor_interval = 0


def readline():  # unbuffered: select() on fd 0 must see every line not yet read
    buf = b""
    while not buf.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            return b""
        buf += c
    return buf


def reply(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())


while True:
    line = readline()
    if not line:
        break
    req = json.loads(line)
    if "warm" in req:  # one plain run in the zygote itself: every lazy import done once, no torch compute
        saved = os.dup(1), os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        try:
            rc = tiered.cli.main(req["warm"])
        except BaseException:
            rc = 1
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        reply({"rc": rc, "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()]})
        continue
    if "argv" not in req:
        continue  # a kill that arrived after its run had ended
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(req["env"])
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            tqdm.std.tqdm.set_lock(tqdm.std.TqdmDefaultWriteLock())  # a fresh lock: none held by a thread not forked
            rc = tiered.cli.main(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    reply({"pid": pid})
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([0, pidfd], [], [])
        if pidfd in ready:
            break
        got = readline()
        if not got or json.loads(got).get("kill"):  # a kill, or the driver is gone (EOF): end the run
            os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
            if not got:
                os.waitpid(pid, 0)
                sys.exit(1)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    reply({"rc": os.waitstatus_to_exitcode(status)})
"""


class ForkLauncher:
    """Each run: forked from one zygote that imported everything once, then ``tiered.cli.main(argv)``."""

    name = "fork"

    def __init__(self) -> None:
        self.z = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, bufsize=0, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def warm(self, argv: list[str]) -> None:
        """One unforked run inside the zygote, so that forked runs do not each redo the lazy imports."""
        self.z.stdin.write((json.dumps({"warm": ["reshard", *argv]}) + "\n").encode())
        line = self.z.stdout.readline()
        if not line or json.loads(line)["rc"] != 0:
            raise RuntimeError("the zygote's warm-up run failed")
        left = json.loads(line).get("threads")
        if left:  # a forked run inherits the locks such a thread holds at the fork, and can wait for them forever
            raise RuntimeError(f"Python threads left in the zygote after its warm-up run: {left}; forked runs could "
                               "deadlock on a lock one of them holds (stop the thread before forking)")

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ForkRun:
        return ForkRun(self.z, argv, env, log)

    def close(self) -> None:
        self.z.stdin.close()
        self.z.wait(timeout=60)


class ForkRun:
    def __init__(self, z: subprocess.Popen, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.z = z
        z.stdin.write((json.dumps({"argv": ["reshard", *argv], "env": env, "log": str(log)}) + "\n").encode())
        self.pid = self._read()["pid"]
        self.rc: int | None = None

    def _read(self) -> dict:
        line = self.z.stdout.readline()  # unbuffered (bufsize=0): nothing is read ahead of select()
        if not line:
            raise RuntimeError("the zygote died")
        return json.loads(line)

    def wait(self, timeout: float | None) -> int | None:
        if self.rc is None:
            ready, _, _ = select.select([self.z.stdout], [], [], timeout)
            if ready:
                self.rc = self._read()["rc"]
        return self.rc

    def kill(self) -> None:
        if self.rc is None:
            self.z.stdin.write(b'{"kill": 1}\n')


# ---------------------------------------------------------------------------------------------- checks


def tree_hashes(d: Path) -> dict[str, str]:
    """Relative path -> BLAKE2b of every file under ``d`` ("dir" for directories)."""
    return {str(p.relative_to(d)): hashlib.blake2b(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


class Reference:
    """A complete, unkilled conversion: its file hashes and its tensors (safetensors' own reader)."""

    def __init__(self, d: Path) -> None:
        from safetensors.torch import load_file

        self.dir = d
        self.hashes = tree_hashes(d)
        self.tensors = {}
        for f in sorted(d.glob("*.safetensors")):
            self.tensors.update(load_file(f))

    def matches(self, d: Path) -> str | None:
        """None when ``d`` equals this reference (every file's bytes, every tensor bit for bit), else why not."""
        import torch
        from safetensors.torch import load_file

        got = tree_hashes(d)
        if got != self.hashes:
            diff = sorted(k for k in set(got) | set(self.hashes) if got.get(k) != self.hashes.get(k))
            return f"files differ from {self.dir.name}: {diff[:4]}"
        tensors = {}
        for f in sorted(d.glob("*.safetensors")):
            tensors.update(load_file(f))
        if set(tensors) != set(self.tensors):
            return f"tensor names differ from {self.dir.name}"
        for k, w in self.tensors.items():
            g = tensors[k]
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.reshape(-1).view(torch.uint8),
                                                                           w.reshape(-1).view(torch.uint8)):
                return f"tensor {k} differs from {self.dir.name}"
        return None


def temporaries(parent: Path, dst: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{dst.name}.tiered-"))


def phase_after_kill(parent: Path, dst: Path, pid: int, new: Reference) -> str:
    tmp, tag = parent / f".{dst.name}.tiered-tmp-{pid}", f".{dst.name}.tiered-"
    if (parent / f"{tag}install-{pid}").exists() or (parent / f"{tag}old-{pid}").exists():
        return "install"
    if tmp.exists():
        return "writing" if (tmp / ".tiered-lock").exists() else "install"
    if dst.exists() and new.matches(dst) is None:
        return "after install"
    return "startup"


# ---------------------------------------------------------------------------------------------- the loop


class Timing:
    """One unkilled run: its length, and when its temporary directory appeared and went (installed)."""

    def __init__(self, secs: float, appeared: float | None, gone: float | None) -> None:
        self.secs = secs
        self.appeared = appeared if appeared is not None else 0.0
        self.gone = gone if gone is not None else secs


def run_once(launcher, argv: list[str], env: dict[str, str], log: Path, *, kill_after: float | None = None,
             anchored: bool = False, watch: Path | None = None, timeout: float = 600) -> tuple[int, Timing, int, bool]:
    """(exit status, its timing (its temporary directory watched in ``watch``), pid, killed).

    ``kill_after``: SIGKILL that many seconds after the start, or, ``anchored``, after its temporary
    directory appeared in ``watch`` (no kill if it never does).
    """
    t0 = time.monotonic()
    r = launcher.start(argv, env, log)
    appeared = gone = None
    killed = False
    while True:
        now = time.monotonic() - t0
        step = 0.005 if watch is not None and gone is None else 0.05
        at = None  # when to kill, seconds from the start (None: not now)
        if kill_after is not None and not killed:
            if not anchored:
                at = kill_after
            elif appeared is not None:
                at = appeared + kill_after
        if at is not None:
            step = min(step, max(0.0, at - now))
        rc = r.wait(step)
        now = time.monotonic() - t0
        if rc is not None:
            return rc, Timing(now, appeared, gone), r.pid, killed
        if watch is not None and gone is None:
            there = any(q.name.endswith(f".tiered-tmp-{r.pid}") for q in watch.iterdir())
            if appeared is None and there:
                appeared = now
            elif appeared is not None and not there:
                gone = now
        if at is not None and now >= at:
            r.kill()
            killed = True
        if now > timeout:
            r.kill()
            raise RuntimeError(f"{argv}: still running after {timeout} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kill_reshard.py", description=__doc__.rsplit("\n\nUsage:", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit status: 0 no failure, 1 a failure (each is listed)")
    p.add_argument("--n", type=int, default=100, help="runs to SIGKILL (default 100)")
    p.add_argument("--seed", type=int, default=0, help="random seed of modes and delays (default 0)")
    p.add_argument("--launcher", choices=["exec", "fork"], default="exec",
                   help="exec: `python -m tiered.cli reshard` per run (default); fork: forked from a zygote that "
                   "imported everything once (fast; same tiered.cli.main)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the generated checkpoint (default 4)")
    p.add_argument("--scale", type=float, default=0.25,
                   help="width factor of the llama-tall checkpoint (default 0.25: ~34 MB in fp32)")
    p.add_argument("--workdir", default=None, help="where to write (default: a new temporary directory, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per run")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error("--n must be >= 1")

    from make_checkpoint import make_checkpoint

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="kill-reshard-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    launcher = ForkLauncher() if a.launcher == "fork" else ExecLauncher()
    failures: list[str] = []
    try:
        src = make_checkpoint(work / "src", "llama-tall", dtype="fp32", layers=a.layers, scale=a.scale,
                              max_shard_size="10MB", quiet=True)
        src_hashes = tree_hashes(src)
        refs_dir, runs, logs = work / "refs", work / "runs", work / "logs"
        for d in (refs_dir, runs, logs):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        dst = runs / "out"
        common = [str(src), str(dst), "--max-shard-size", "8MB", "--quiet"]

        # Unkilled runs: a warm-up (page cache, imports), then the references, and how long each mode takes
        # (and when its conversion starts).
        launcher.warm(common)
        shutil.rmtree(dst, ignore_errors=True)
        rc, *_ = run_once(launcher, common, {}, logs / "warm-up.log")
        shutil.rmtree(dst, ignore_errors=True)
        if rc != 0:
            raise RuntimeError(f"warm-up run failed ({rc}): {(logs / 'warm-up.log').read_text()[-2000:]}")
        timings: dict[str, list[Timing]] = collections.defaultdict(list)  # of unkilled runs, per mode
        refs: dict[str, Reference] = {}
        for mode in ["plain", "bf16", "verify", "force"]:
            if mode == "force":
                shutil.copytree(refs["bf16"].dir, dst)
            rc, timing, _, _ = run_once(launcher, common + MODES[mode], {}, logs / f"ref-{mode}.log", watch=runs)
            if rc != 0:
                raise RuntimeError(f"unkilled {mode} run failed ({rc}): {(logs / f'ref-{mode}.log').read_text()[-2000:]}")
            timings[mode].append(timing)
            if mode in ("plain", "bf16"):
                dst.rename(refs_dir / mode)
                refs[mode] = Reference(refs_dir / mode)
            else:
                why = refs["plain"].matches(dst)
                if why:
                    raise RuntimeError(f"unkilled {mode} run: {why}")
                shutil.rmtree(dst)
        if refs["plain"].matches(refs["bf16"].dir) is None:
            raise RuntimeError("the bf16 reference equals the plain one: --force could not tell old from new")

        modes = collections.Counter()
        portable_runs = 0
        phases = collections.Counter()
        dst_states = collections.Counter()
        reruns_ok = 0
        delays = []
        for i in range(a.n):
            mode = rng.choice(list(MODES))
            env = {}
            if mode == "force":
                shutil.copytree(refs["bf16"].dir, dst)
                if rng.random() < 0.5:
                    env[NO_RENAMEAT2] = "1"
                    portable_runs += 1
            modes[mode] += 1
            # The run time of this mode now: the median of its last 5 unkilled runs (the reruns keep it current
            # on a machine whose load changes).
            recent = timings[mode][-5:]
            dur, start, done = (sorted(getattr(t, k) for t in recent)[len(recent) // 2]
                                for k in ("secs", "appeared", "gone"))
            anchored = rng.random() >= 1 / 3
            if not anchored:  # anywhere in the run (imports, planning, writing, install, exit)
                delay = rng.uniform(0, 1.05 * dur)
            else:  # counted from its temporary directory's appearance: while it writes and installs, or a bit after
                delay = rng.uniform(0, 1.1 * (done - start))
            delays.append((delay + start * anchored) / dur)
            rc, _, pid, killed = run_once(launcher, common + MODES[mode], env, logs / f"{i}-killed.log",
                                          kill_after=delay, anchored=anchored, watch=runs if anchored else None)
            killed = killed and rc == -signal.SIGKILL
            new = refs[REF_OF[mode]]
            phase = phase_after_kill(runs, dst, pid, new) if killed else "finished"
            phases[phase] += 1
            bad: list[str] = []
            if not killed and rc != 0:
                bad.append(f"exited {rc} before the kill: {(logs / f'{i}-killed.log').read_text()[-500:]}")
            # DST: absent or complete (old or new with --force).
            if dst.exists():
                why = new.matches(dst)
                state = "new"
                if why and mode == "force" and refs["bf16"].matches(dst) is None:
                    why, state = None, "old"
                if why:
                    bad.append(f"partial or wrong DST after the kill: {why}")
                    state = "PARTIAL"
            else:
                state = "absent"
                if mode == "force":
                    tag = f".{dst.name}.tiered-"
                    window = ((runs / f"{tag}install-{pid}").exists() and (runs / f"{tag}old-{pid}").is_dir()
                              and new.matches(runs / f"{tag}tmp-{pid}") is None)
                    if not window:
                        bad.append("--force killed: no DST, and not inside the journaled install window")
                    state = "absent (journaled window)"
            dst_states[state] += 1
            if tree_hashes(src) != src_hashes:
                bad.append("SRC changed by the killed run")
            visible = sorted(q.name for q in runs.iterdir() if not q.name.startswith("."))
            if visible not in ([], [dst.name]):
                bad.append(f"visible beside DST: {visible}")
            pat = re.compile(re.escape(f".{dst.name}.tiered-") + r"(tmp|old|install|probe)-" + str(pid))
            strange = [n for n in temporaries(runs, dst) if not pat.fullmatch(n)]
            if strange:
                bad.append(f"unexpected temporaries: {strange}")
            # The next run, unkilled: recovers, then converts.
            flags = MODES[mode] + (["--force"] if dst.exists() and mode != "force" else [])
            rc2, timing2, _, _ = run_once(launcher, common + flags, env, logs / f"{i}-rerun.log", watch=runs)
            if rc2 == 0:
                timings[mode].append(timing2)
            if rc2 != 0:
                bad.append(f"rerun exited {rc2}: {(logs / f'{i}-rerun.log').read_text()[-800:]}")
            elif not dst.exists() or new.matches(dst):
                bad.append(f"rerun: DST {'missing' if not dst.exists() else new.matches(dst)}")
            left = temporaries(runs, dst)
            if left:
                bad.append(f"rerun left {left}")
            if tree_hashes(src) != src_hashes:
                bad.append("SRC changed by the rerun")
            if not bad:
                reruns_ok += 1
            when = f"{delay:5.2f} s after its tmp appeared" if anchored else f"at {delay:5.2f} s"
            line = (f"[{i:3d}] {mode:6s}{' two-renames' if env else ''} kill {when} (run {dur:.1f} s, tmp "
                    f"{start:.2f}-{done:.2f} s): {phase}, DST {state}; rerun rc {rc2}")
            if a.verbose or bad:
                print(line + ("" if not bad else "  FAILED: " + "; ".join(bad)), flush=True)
            failures += [f"run {i} ({mode}, {phase}): {b}" for b in bad]
            shutil.rmtree(dst, ignore_errors=True)
            for q in runs.iterdir():
                shutil.rmtree(q, ignore_errors=True)

        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        how = "`python -m tiered.cli reshard` per run" if launcher.name == "exec" else "tiered.cli.main forked from a zygote"
        print(f"kill_reshard: {a.n} runs of `tiered reshard` SIGKILLed at random (launcher {launcher.name}: {how}; "
              f"seed {a.seed})")
        print(f"  SRC: generated Llama fp32, {a.layers} layers, {len(list(src.glob('*.safetensors')))} shards, "
              f"{size / 1e6:.1f} MB; DST --max-shard-size 8MB: {len(list(refs['plain'].dir.glob('*.safetensors')))} shards")
        def med(m: str, k: str) -> float:
            return sorted(getattr(t, k) for t in timings[m])[len(timings[m]) // 2]

        print("  unkilled run, median: " + ", ".join(
            f"{m} {med(m, 'secs'):.2f} s (temporary directory from {med(m, 'appeared'):.2f} to {med(m, 'gone'):.2f} s)"
            for m in MODES))
        print("  modes: " + ", ".join(f"{m} {modes[m]}" for m in MODES)
              + f" ({portable_runs} of the --force runs with the journaled two-rename install)")
        killed_n = a.n - phases["finished"]
        print(f"  killed: {killed_n} of {a.n} (delay/run time: min {min(delays):.0%}, median "
              f"{sorted(delays)[len(delays) // 2]:.0%}, max {max(delays):.0%})")
        print("  phase at the kill: " + ", ".join(f"{ph} {phases[ph]}" for ph in PHASES))
        print("  DST after the kill: " + ", ".join(f"{s} {n}" for s, n in sorted(dst_states.items())))
        print(f"  rerun: {reruns_ok} of {a.n} runs fully checked OK (rerun exit 0, DST equal to the reference bit for "
              "bit, no temporaries left, SRC unchanged)")
        print(f"  failures: {len(failures)}")
        for f in failures[:20]:
            print(f"    {f}")
    except Exception:
        traceback.print_exc()
        failures.append("the loop itself failed")
    finally:
        launcher.close()
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
