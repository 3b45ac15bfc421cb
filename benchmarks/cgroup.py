#!/usr/bin/env python
"""Run one command as a child process and measure its memory, optionally under a cgroup v2 ``memory.max``.

Every benchmarked system runs in its own child, so its peak RSS is its own:

* ``ru_maxrss`` from ``wait4`` (the child's VmHWM, kept by the kernel even when it is killed);
* with a limit (root, cgroup v2 with the ``memory`` controller): a fresh group
  ``<cgroup2 mount>/tiered-bench-<pid>-<hex>`` with ``memory.max`` = the limit, ``memory.swap.max`` = 0
  (no escape into swap) and ``memory.oom.group`` = 1; ``+memory`` is written to the parent's
  ``cgroup.subtree_control`` when it is missing. The child moves itself in before ``exec`` (it writes
  ``0`` to ``cgroup.procs``), so nothing it allocates escapes the limit. Afterwards ``memory.peak``
  (kernel >= 5.19; page cache charged to the group counts in it) and ``memory.events`` are read:
  ``oom_kill`` > 0 means the kernel's OOM killer fired inside the group -> ``OOM-killed at limit X``; and, to
  see what running at the limit costs, :data:`STAT_KEYS` of ``memory.stat`` (major faults, refaulted file pages)
  and ``memory.pressure``'s totals (``pressure_some_s``, ``pressure_full_s``: seconds some or all of the group's
  tasks stalled on memory).
  The group is removed (``cgroup.kill`` first if anything is left in it).

Where the memory controller lives on a cgroup v1 hierarchy (a hybrid host, e.g. older Docker hosts and this
project's CPU machine) the same is done there: ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``,
no swap, when the kernel has it); the peak is ``memory.max_usage_in_bytes`` (page cache included, as in v2),
``memory.failcnt`` counts the times the limit was hit (v2's ``max`` event) and ``memory.oom_control``'s
``oom_kill`` the OOM kills. Where neither is available (not root, ``+memory`` refused by the parent),
:func:`probe` says why and the caller reports RSS alone.

    python benchmarks/cgroup.py --mem-limit-gb 2 -- python -c "x = bytearray(3 << 30)"
prints one JSON line: status, returncode, wall_s, peak RSS, cgroup memory.peak / oom_kill.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["CgroupUnavailable", "MemoryCgroup", "ChildResult", "cgroup2_mount", "probe", "run_child"]

GiB = 1 << 30
PREFIX = "tiered-bench"


class CgroupUnavailable(RuntimeError):
    """A cgroup v2 memory limit cannot be set up here; the message says why."""


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` preferred), or None."""
    mounts: list[Path] = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    mounts.append(Path(parts[1]))
    except OSError:
        return None
    for m in mounts:
        if str(m) == "/sys/fs/cgroup":
            return m
    return mounts[0] if mounts else None


def cgroup1_memory_mount() -> Path | None:
    """Where a cgroup v1 hierarchy with the ``memory`` controller is mounted, or None."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] == "cgroup" and "memory" in parts[3].split(","):
                    return Path(parts[1])
    except OSError:
        return None
    return None


#: memory.stat counters :meth:`MemoryCgroup.read` reports (cgroup v2)
STAT_KEYS = ("pgmajfault", "workingset_refault_file", "workingset_refault_anon", "file", "anon")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


class MemoryCgroup:
    """One cgroup v2 group with ``memory.max`` = ``limit_bytes`` (a context manager: create / remove).

    ``parent``: the directory to create the group in (default: the cgroup2 mount's root, i.e.
    ``/sys/fs/cgroup``). ``enter_fn()`` returns a function for ``subprocess.Popen(preexec_fn=...)`` that
    moves the forked child into the group before ``exec``.

    Raises:
        CgroupUnavailable: from :meth:`create`, saying why (no cgroup2, not root, no memory controller,
            ``+memory`` refused by the parent, ``memory.max`` not writable).
    """

    def __init__(self, limit_bytes: int, *, parent: str | os.PathLike[str] | None = None, prefix: str = PREFIX) -> None:
        self.limit_bytes = int(limit_bytes)
        self.parent = Path(parent) if parent is not None else None
        self.prefix = prefix
        self.path: Path | None = None
        self.v1 = False  # the group lives on a cgroup v1 memory hierarchy
        self.notes: list[str] = []

    def create(self) -> Path:
        if not sys.platform.startswith("linux"):
            raise CgroupUnavailable("not Linux")
        parent = self.parent or cgroup2_mount()
        v1 = None if self.parent is not None else cgroup1_memory_mount()
        if parent is None and v1 is None:
            raise CgroupUnavailable("no cgroup2 file system and no cgroup v1 memory hierarchy mounted")
        controllers = (_read(parent / "cgroup.controllers") or "").split() if parent is not None else []
        if "memory" not in controllers and v1 is not None:
            return self._create_v1(v1)
        if parent is None or "memory" not in controllers:
            raise CgroupUnavailable(
                f"the memory controller is not available in {parent}/cgroup.controllers ({' '.join(controllers) or 'empty'}): "
                "it is bound to a cgroup v1 hierarchy or not delegated here"
            )
        if self.parent is None and os.geteuid() != 0:
            raise CgroupUnavailable("not root: cannot create cgroups under the cgroup2 mount")
        subtree = (_read(parent / "cgroup.subtree_control") or "").split()
        if "memory" not in subtree:
            try:
                _write(parent / "cgroup.subtree_control", "+memory")
                self.notes.append(f"enabled +memory in {parent}/cgroup.subtree_control")
            except OSError as e:
                why = "processes live in it (no-internal-process rule)" if e.errno == errno.EBUSY else e.strerror
                raise CgroupUnavailable(f"cannot enable +memory in {parent}/cgroup.subtree_control: {why}") from e
        path = self._make_group(parent, "memory.max")
        for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
            try:
                _write(path / name, value)
            except OSError:
                self.notes.append(f"{name} not set")
        if not (path / "memory.peak").exists():
            self.notes.append("no memory.peak (kernel < 5.19): only VmHWM is reported")
        return path

    def _make_group(self, parent: Path, limit_file: str) -> Path:
        """Create this run's group under ``parent`` and write the limit to ``limit_file``; sets :attr:`path`."""
        path = parent / f"{self.prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            path.mkdir()
        except OSError as e:
            raise CgroupUnavailable(f"cannot create {path}: {e.strerror}") from e
        self.path = path
        try:
            _write(path / limit_file, str(self.limit_bytes))
        except OSError as e:
            self.remove()
            raise CgroupUnavailable(f"cannot write {path}/{limit_file}: {e.strerror}") from e
        return path

    def _create_v1(self, root: Path) -> Path:
        """cgroup v1: a group under the memory hierarchy's root with ``memory.limit_in_bytes``."""
        if os.geteuid() != 0:
            raise CgroupUnavailable("not root: cannot create cgroups under the cgroup v1 memory hierarchy")
        self.v1 = True
        path = self._make_group(root, "memory.limit_in_bytes")
        if (path / "memory.memsw.limit_in_bytes").exists():
            try:  # memory + swap = memory: no escape into swap (limit_in_bytes must be set first)
                _write(path / "memory.memsw.limit_in_bytes", str(self.limit_bytes))
            except OSError:
                self.notes.append("memory.memsw.limit_in_bytes not set")
        self.notes.append("cgroup v1 memory controller (memory.limit_in_bytes)")
        return path

    def enter_fn(self):
        """A ``preexec_fn``: the forked child writes ``0`` (itself) to ``cgroup.procs`` before ``exec``."""
        if self.path is None:
            raise RuntimeError("create() first")
        procs = os.fsencode(self.path / "cgroup.procs")

        def enter() -> None:
            fd = os.open(procs, os.O_WRONLY | os.O_CREAT, 0o644)  # O_CREAT: only for fake trees in tests
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return enter

    def read(self) -> dict:
        """``memory.peak`` / ``memory.current`` (bytes; None when absent) and ``memory.events`` counters."""
        assert self.path is not None
        out: dict = {"path": str(self.path), "limit_bytes": self.limit_bytes}
        if self.v1:  # the same keys as v2: peak (page cache included), current, events max / oom_kill
            def num(name: str) -> int | None:
                txt = _read(self.path / name)  # type: ignore[operator]
                return int(txt) if txt and txt.strip().isdigit() else None

            oom = dict(line.split() for line in (_read(self.path / "memory.oom_control") or "").splitlines()
                       if len(line.split()) == 2)
            out.update(memory_peak=num("memory.max_usage_in_bytes"), memory_current=num("memory.usage_in_bytes"),
                       events={"max": num("memory.failcnt") or 0, "oom_kill": int(oom.get("oom_kill", 0))})
            return out
        for name in ("memory.peak", "memory.current"):
            txt = _read(self.path / name)
            out[name.replace(".", "_")] = int(txt) if txt and txt.strip().isdigit() else None
        events: dict[str, int] = {}
        for line in (_read(self.path / "memory.events") or "").splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                events[k] = int(v)
        out["events"] = events
        # reclaim under the limit (cgroup-v2.rst): major faults and refaults of file pages (code and libraries
        # evicted and read back: the cost of running at the limit) and the memory PSI totals (microseconds stalled)
        stat = dict(ln.partition(" ")[::2] for ln in (_read(self.path / "memory.stat") or "").splitlines())
        out["stat"] = {k: int(stat[k]) for k in STAT_KEYS if stat.get(k, "").strip().isdigit()}
        for line in (_read(self.path / "memory.pressure") or "").splitlines():
            kind, _, rest = line.partition(" ")
            total = dict(f.partition("=")[::2] for f in rest.split()).get("total", "")
            if total.isdigit():
                out[f"pressure_{kind}_s"] = int(total) / 1e6
        return out

    def remove(self) -> None:
        if self.path is None:
            return
        path, self.path = self.path, None
        for _ in range(50):
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
                try:  # only processes we started can be in it
                    _write(path / "cgroup.kill", "1")
                except OSError:
                    for pid in (_read(path / "cgroup.procs") or "").split():  # v1: no cgroup.kill
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass
                time.sleep(0.1)
        self.notes.append(f"could not remove {path}")

    def __enter__(self) -> MemoryCgroup:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def probe(limit_bytes: int = 256 << 20) -> tuple[bool, str]:
    """Can a cgroup v2 memory limit be set here? Creates and removes one group. (ok, why-or-where)."""
    try:
        with MemoryCgroup(limit_bytes) as cg:
            where = str(cg.path.parent) if cg.path else "?"
            notes = "; ".join(cg.notes)
            kind = "cgroup v1 memory.limit_in_bytes" if cg.v1 else "cgroup v2 memory.max"
        return True, f"{kind} available under {where}" + (f" ({notes})" if notes else "")
    except CgroupUnavailable as e:
        return False, f"cgroup memory limit unavailable: {e}"


@dataclass
class ChildResult:
    """What :func:`run_child` measured. Sizes in bytes; ``status`` is a short human string."""

    status: str  # "ok", "failed (exit N)", "killed by SIGx", "timeout after N s", "OOM-killed at limit X GiB"
    returncode: int | None
    timed_out: bool
    oom_killed: bool
    wall_s: float
    ru_maxrss_bytes: int | None  # the child's peak RSS (VmHWM) from wait4, also when it was killed
    mem_limit_bytes: int | None
    cgroup: dict | None = None  # MemoryCgroup.read() when a limit was set
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def run_child(
    cmd: list[str],
    *,
    timeout_s: float,
    mem_limit_bytes: int | None = None,
    stdout: str | os.PathLike[str] | None = None,
    stderr: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    cgroup_parent: str | os.PathLike[str] | None = None,
) -> ChildResult:
    """Run ``cmd`` in a new session, wait at most ``timeout_s`` (then SIGKILL its process group).

    With ``mem_limit_bytes`` the child runs in a fresh cgroup v2 group with that ``memory.max``; when
    that is not possible the child is *not* run and the status says why (a limited run without its
    limit would be a different measurement). stdout/stderr go to the given files (else discarded).
    ``cgroup_parent``: where to create the group (default: the cgroup2 mount; tests pass a fake tree).
    """
    notes: list[str] = []
    cg: MemoryCgroup | None = None
    if mem_limit_bytes is not None:
        cg = MemoryCgroup(mem_limit_bytes, parent=cgroup_parent)
        try:
            cg.create()
        except CgroupUnavailable as e:
            return ChildResult(f"not run: cgroup memory limit unavailable: {e}", None, False, False, 0.0, None,
                               mem_limit_bytes, None, [])
        notes += cg.notes
    out_f = open(stdout, "wb") if stdout is not None else subprocess.DEVNULL  # noqa: SIM115
    err_f = open(stderr, "wb") if stderr is not None else subprocess.DEVNULL  # noqa: SIM115
    t0 = time.perf_counter()
    timed_out = False
    status_code = 0
    rusage = None
    try:
        try:
            p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env, cwd=cwd, start_new_session=True,
                                 preexec_fn=cg.enter_fn() if cg else None)
        except (OSError, subprocess.SubprocessError) as e:
            return ChildResult(f"failed to start: {e}", None, False, False, time.perf_counter() - t0, None,
                               mem_limit_bytes, None, notes)
        deadline = t0 + timeout_s
        while True:
            pid, status_code, rusage = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                break
            if time.perf_counter() >= deadline:
                timed_out = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status_code, rusage = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status_code)  # so Popen does not wait again
        wall = time.perf_counter() - t0
        if not timed_out:  # leftovers of the session (grandchildren) go too
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        cg_info = cg.read() if cg else None
    finally:
        for f in (out_f, err_f):
            if f is not subprocess.DEVNULL:
                f.close()
        if cg is not None:
            cg.remove()
            notes += [n for n in cg.notes if n not in notes]
    rc = p.returncode
    oom = bool(cg_info and cg_info["events"].get("oom_kill", 0) > 0)
    if oom:
        status = f"OOM-killed at limit {_gib(mem_limit_bytes)}"
        if rc == 0:
            status = f"ok (OOM killer fired {cg_info['events']['oom_kill']}x in the group at limit {_gib(mem_limit_bytes)})"
            oom = False
    elif timed_out:
        status = f"timeout after {timeout_s:g} s"
    elif rc == 0:
        status = "ok"
    elif rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        status = f"killed by {name}" + (" (no cgroup: a global OOM kill?)" if -rc == signal.SIGKILL and cg is None else "")
    else:
        status = f"failed (exit {rc})"
    maxrss = rusage.ru_maxrss * 1024 if rusage is not None else None  # Linux: KiB
    return ChildResult(status, rc, timed_out, oom, wall, maxrss, mem_limit_bytes, cg_info, notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mem-limit-gb", type=float, default=None, help="memory.max in GiB (default: no limit)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--probe", action="store_true", help="only say whether a cgroup v2 memory limit is available")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    a = p.parse_args(argv)
    if a.probe:
        ok, why = probe()
        print(json.dumps({"available": ok, "why": why}))
        return 0 if ok else 1
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command")
    limit = int(a.mem_limit_gb * GiB) if a.mem_limit_gb is not None else None
    r = run_child(cmd, timeout_s=a.timeout_s, mem_limit_bytes=limit)
    print(json.dumps(r.to_dict()))
    return 0 if r.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
