"""Never half-written: the temporary directory, the install into ``DST``, and recovery after a kill.

Everything is written into ``.DST.tiered-tmp-<pid>`` beside ``DST`` (:func:`_make_tmp`), each file
fsynced, then the directory fsynced, and only then installed as ``DST`` (:func:`_commit`). A killed
run leaves no partial ``DST``; its temporary directory is removed by the next run (a live run holds
an ``flock`` on it). An existing ``DST`` is refused unless ``force``.

Install, and what a kill (SIGKILL) at any point of it leaves:

* no ``DST`` yet: one rename, tmp -> ``DST`` (``renameat2(RENAME_NOREPLACE)`` where the kernel has it,
  so a ``DST`` that appeared meanwhile is never replaced). Killed before it: no ``DST``, a stray tmp.
* ``force`` and a ``DST``: ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15; ext4, xfs, btrfs, tmpfs...)
  swaps the two atomically; then the old one, now under the tmp name, is deleted. Killed before the
  swap: the old ``DST`` and a stray tmp; after it: the new ``DST`` and the old one under a stray name.
  ``DST`` is never absent.
* ``force`` where the swap is unsupported (or ``TIERED_RESHARD_NO_RENAMEAT2=1``, for tests): a journal
  ``.DST.tiered-install-<pid>`` is created, locked and fsynced — the commit point, reached only once
  tmp is complete and fsynced — then ``DST`` -> ``.DST.tiered-old-<pid>``, tmp -> ``DST``, the old one
  deleted, the journal removed. Killed in between: possibly no ``DST`` for now, but the complete new
  output and the old one beside it, and the journal that says so.

Every run first recovers (:func:`_prepare`), before it checks ``DST`` or removes anything: a journal
whose run is dead (its pid gone and its lock free) is *rolled forward* (the complete tmp becomes
``DST``, then the old one is deleted), or *rolled back* (the old one is renamed back to ``DST``) if the
new output is gone; only then are stray temporary directories of dead runs removed. So ``DST`` is
never partial, an old ``DST`` is deleted only once the new one holds its name, and a finished output
is never deleted as a stray. A plain rerun after a killed ``force`` run finds ``DST`` (old or new) and
refuses, as before it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import platform
import re
import shutil
from pathlib import Path

from .errors import DestinationExistsError, ReshardError
from .libc import _libc_fn

_TMP_TAG = ".tiered-tmp-"
_OLD_TAG = ".tiered-old-"
_JOURNAL_TAG = ".tiered-install-"
_LOCK_NAME = ".tiered-lock"

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276}  # for a libc without the wrapper (glibc < 2.28)


def _within(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies inside it (both resolved)."""
    return a == b or b in a.parents


def _place(p: Path) -> Path:
    """Where the entry ``p`` itself lies: its directory resolved, its own name kept (a link is not followed); ``.``
    and ``..`` resolved whole. Raises RuntimeError / OSError on a loop."""
    if p.name in ("", ".", ".."):
        return p.resolve()
    return p.parent.resolve() / p.name


def _link_chain(link: Path, limit: int = 40) -> list[Path]:
    """Every place a symbolic link's chain passes through, hop by hop (:func:`_place` of each target), up to the first
    entry that is not a link; a loop, a dangling hop or more than ``limit`` hops ends it (what was found is kept)."""
    out: list[Path] = []
    p = link
    for _ in range(limit):
        try:
            t = os.readlink(p)
            nxt = _place(Path(t) if os.path.isabs(t) else p.parent / t)
        except (OSError, RuntimeError):
            break
        out.append(nxt)
        if not nxt.is_symlink():
            break
        p = nxt
    return out


def overlap(src: Path, dst: Path) -> str | None:
    """Why writing ``dst`` (and with ``force`` replacing it) could modify ``src``, or None: ``dst`` is ``src``, lies
    inside it or contains it — where it resolves to, and where its own entry lies (a symbolic link inside ``src`` named
    as ``dst`` is replaced by the output there) — whether ``src`` is a directory or one weight file; or a link of
    ``src`` (itself, or any entry below it) passes through ``dst`` at any hop (a Hugging Face cache snapshot's files
    point into its ``blobs``: replacing ``dst`` would leave them dangling). Links that loop are not followed further.
    Torch-free: the CLI checks it before its heavy imports."""
    try:
        rs = src.resolve()
    except RuntimeError:  # a link loop: nothing to read (the caller's existence check says so)
        return None
    spots = set()
    for place in (dst.resolve, lambda: _place(dst)):
        try:
            spots.add(place())
        except RuntimeError:
            return f"DST {dst} is a loop of symbolic links"
    for d in spots:
        if _within(d, rs) or _within(rs, d):
            return f"DST {dst} is SRC, inside it or contains it"
    links = [src] if src.is_symlink() else []
    if src.is_dir():
        links += [p for p in src.rglob("*") if p.is_symlink()]
    for link in links:
        if any(_within(hop, d) for hop in _link_chain(link) for d in spots):
            return f"SRC's {link} is a symbolic link into DST {dst} (replacing DST would leave it dangling)"
    return None


def _renameat2(old: Path, new: Path, flags: int) -> bool:
    """``renameat2(old, new, flags)``: True once done, False where the kernel, the filesystem or libc lacks it.

    Any other failure raises OSError (``FileExistsError`` for RENAME_NOREPLACE onto an existing ``new``).
    ``TIERED_RESHARD_NO_RENAMEAT2=1`` makes it always return False (the portable path, for tests).
    """
    if os.environ.get("TIERED_RESHARD_NO_RENAMEAT2", "") not in ("", "0"):
        return False
    args = (ctypes.c_int(_AT_FDCWD), os.fsencode(old), ctypes.c_int(_AT_FDCWD), os.fsencode(new), ctypes.c_uint(flags))
    fn = _libc_fn("renameat2")
    if fn is not None:
        rc = fn(*args)
    else:
        nr, syscall = _SYS_RENAMEAT2.get(platform.machine()), _libc_fn("syscall")
        if nr is None or syscall is None:
            return False
        rc = syscall(ctypes.c_long(nr), *args)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(old), None, str(new))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lexists(p: Path) -> bool:
    return os.path.lexists(p)


def _remove_tree(p: Path) -> None:
    """Delete a directory tree, or a file or symlink (never what a symlink points to)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- before writing


def _prepare(dst: Path, force: bool) -> list[str]:
    """Before any input is read: finish or undo an install a kill interrupted (:func:`_recover`), then
    remove what dead runs left (:func:`_remove_strays`), refuse an existing ``dst`` unless ``force``,
    and check that ``dst``'s parent (created if needed) is writable. Returns notes for the summary.

    Raises:
        ReshardError: the clean-up or the parent directory failed (permissions).
        DestinationExistsError: ``dst`` exists and not ``force``.
    """
    try:  # first of all: finish or undo an install that a kill interrupted (it may have left no DST) ...
        notes = _recover(dst)
        removed = _remove_strays(dst)  # ... only then remove what dead runs left
    except OSError as e:
        raise ReshardError(f"{dst}: could not clean up after an interrupted run ({e}); "
                           "check the permissions of its directory") from None
    _check_dst(dst, force, notes)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        probe = dst.parent / f".{dst.name}.tiered-probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ReshardError(f"{dst.parent}: cannot write there ({e.strerror}); choose a writable DST") from None
    return notes + [f"removed {p.name}, left by an interrupted run" for p in removed]


def _check_dst(dst: Path, force: bool, recovered: list[str]) -> None:
    if _lexists(dst) and not force:
        why = f" ({'; '.join(recovered)})" if recovered else ""
        raise DestinationExistsError(f"{dst} exists{why}; pass --force (force=True) to replace it")


def _stale(path: Path, kind: str, pid: int) -> bool:
    """A temporary directory is stale when no live run holds its lock (or, lockless, its pid is dead)."""
    lock = path / _LOCK_NAME
    if kind == "tmp" and lock.is_file():
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return not _alive(pid)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # releases the lock
        return True
    return pid != os.getpid() and not _alive(pid)


def _remove_strays(dst: Path) -> list[Path]:
    """Remove ``.DST.tiered-tmp-<pid>`` / ``-old-<pid>`` / ``-probe-<pid>`` left by killed runs (after :func:`_recover`)."""
    pat = re.compile(re.escape(f".{dst.name}") + r"\.tiered-(tmp|old|probe)-(\d+)")
    removed = []
    if not dst.parent.is_dir():
        return removed
    for p in dst.parent.iterdir():
        m = pat.fullmatch(p.name)
        if m and _lexists(dst.parent / f".{dst.name}{_JOURNAL_TAG}{m[2]}"):
            continue  # its run's install journal is there: that tmp or old DST is _recover's to finish
        if m and _stale(p, m[1], int(m[2])):
            _remove_tree(p)
            removed.append(p)
    return removed


def _recover(dst: Path) -> list[str]:
    """Finish or undo the install of every run killed inside it (its journal beside ``dst``); returns notes.

    Run first by every run, before ``dst`` is checked and strays are removed. A journal is stale when
    its pid is gone and its lock is free (a live run, or another run recovering it, holds the lock).
    With a stale journal: the complete new output (tmp) becomes ``dst`` — if the old ``dst`` was
    not yet moved aside, it is first (roll forward); if the new output is gone, a moved-aside old
    ``dst`` is renamed back (roll back); then the old one is deleted and the journal last. A kill
    during recovery leaves the journal, and the next run resumes from whatever state it finds.
    Raises OSError when the directory cannot be changed.
    """
    parent = dst.parent
    if not parent.is_dir():
        return []
    pat = re.compile(re.escape(f".{dst.name}{_JOURNAL_TAG}") + r"(\d+)")
    notes = []
    for journal in sorted(parent.iterdir()):
        m = pat.fullmatch(journal.name)
        if not m:
            continue
        pid = int(m[1])
        if pid != os.getpid() and _alive(pid):
            continue
        try:
            fd = os.open(journal, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if os.fstat(fd).st_nlink == 0:  # recovered (and unlinked) by another run meanwhile
                continue
            tmp = parent / f".{dst.name}{_TMP_TAG}{pid}"
            old = parent / f".{dst.name}{_OLD_TAG}{pid}"
            complete = _lexists(tmp) and not _lexists(tmp / _LOCK_NAME)  # a locked tmp is another run's
            if complete and not (_lexists(dst) and _lexists(old)):
                # Two renames, not a swap: each step leaves a state this function resumes correctly.
                if _lexists(dst):
                    os.rename(dst, old)  # killed before it moved the old DST aside: do it now
                    _fsync_path(parent)
                os.rename(tmp, dst)
                notes.append(f"completed the install of an interrupted run (pid {pid}): {dst.name} is its output")
            elif complete:
                notes.append(f"{dst.name} was written again after run {pid} was interrupted; kept it")
            elif _lexists(old) and not _lexists(dst):
                os.rename(old, dst)
                notes.append(f"rolled back the install of an interrupted run (pid {pid}): restored the old {dst.name}")
            _fsync_path(parent)
            if _lexists(old) and _lexists(dst):
                _remove_tree(old)
            journal.unlink()
            _fsync_path(parent)
        finally:
            os.close(fd)
    return notes


# ---------------------------------------------------------------------------------------------- the temporary directory


def _make_tmp(dst: Path) -> tuple[Path, int]:
    """(``.DST.tiered-tmp-<pid>``, created empty, the fd of the lock inside it, held) — closing the fd releases it."""
    tmp = dst.parent / f".{dst.name}{_TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier failed call of this very process
    tmp.mkdir()
    lock_fd = os.open(tmp / _LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # live: _remove_strays of other runs leaves tmp alone
    return tmp, lock_fd


def _commit(tmp: Path, dst: Path, force: bool) -> None:
    """``tmp`` is complete (every file fsynced): remove its lock file, fsync it, install it as ``dst``."""
    os.unlink(tmp / _LOCK_NAME)
    _fsync_path(tmp)
    _install(tmp, dst, force)


def _install(tmp: Path, dst: Path, force: bool) -> None:
    """Make the finished, fsynced ``tmp`` the ``dst`` (an existing ``dst`` is replaced, with ``force``).

    Crash-safe at every step (see "Install" in the module docstring): one rename when there is no
    ``dst``; with one, an atomic ``RENAME_EXCHANGE`` swap, or else the journaled two-rename scheme
    that :func:`_recover` finishes or undoes after a kill.
    """
    parent = dst.parent
    if not _lexists(dst):
        try:
            done = _renameat2(tmp, dst, _RENAME_NOREPLACE)
        except FileExistsError:
            done = False  # it appeared just now: the checks below refuse or replace it
        if not done and not _lexists(dst):
            os.rename(tmp, dst)
            done = True
        if done:
            _fsync_path(parent)
            return
    if not force:
        raise DestinationExistsError(f"{dst} appeared while resharding; pass --force to replace it")
    if _renameat2(tmp, dst, _RENAME_EXCHANGE):  # atomic: dst is the new output, tmp now holds the old one
        _fsync_path(parent)
        _remove_tree(tmp)  # killed before this: the next run removes it as a stray
        return
    old = parent / f".{dst.name}{_OLD_TAG}{os.getpid()}"
    journal = parent / f".{dst.name}{_JOURNAL_TAG}{os.getpid()}"
    fd = os.open(journal, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this run lives: _recover of other runs leaves it alone
        os.write(fd, (json.dumps({"complete": tmp.name, "old": old.name, "dst": dst.name}) + "\n").encode())
        os.fsync(fd)
        _fsync_path(parent)  # the commit point: from here a kill is rolled forward by the next run
        try:
            os.rename(dst, old)
            os.rename(tmp, dst)
        except BaseException:
            if _lexists(old) and not _lexists(dst):
                os.rename(old, dst)  # roll back: the old DST as it was, the new output stays in tmp
            _fsync_path(parent)
            journal.unlink()
            raise
        _fsync_path(parent)
        _remove_tree(old)
        journal.unlink()
        _fsync_path(parent)
    finally:
        os.close(fd)
