"""The C decoder of ``exp3-bf16`` chunks (``tiered/exp3_decode.c``), built on first use with the system's C compiler.

Why C: on the CPU the reader threads that decode share the cores with the model's compute, so the decoder must cost
about what the copy it replaces costs. On the 2-core CPU machine, one thread, the reader's whole per-chunk path (CRC-32,
then decode) of random-normal bf16 in 4 MiB chunks runs at 0.57 GB/s of plain bytes with numpy, 0.93 with this file's
scalar path and 3.31 with its AVX2 path (``python benchmarks/cpu_decode.py``,
``benchmarks/results/2026-12-06-cpu-2c-decode-isal.json``; zstd: 1.47); the decode alone reached 4.2-4.4, a numba loop
1.7 (`benchmarks/NOTES.md`, sixteenth session).

How: :func:`exp3` compiles the source once per source and compiler into the cache directory
(``$TIERED_CACHE_DIR``, else ``$XDG_CACHE_HOME/tiered``, else ``~/.cache/tiered``; ``native/<hash>/``) with
``$CC`` (default ``cc``; it may carry arguments) ``-O3 -shared -fPIC`` (no ``-march``: the AVX2 path is chosen at run
time, so one build runs on any x86-64 CPU; other CPUs get the scalar path), writes it under a temporary name and
renames it into place, mode 0755 less the umask (two processes that build at once both succeed; users who share the
cache can load it), then loads it with :mod:`ctypes` (a call releases the GIL, so reader threads decode in parallel).
A cache that cannot be written gets a private temporary directory, removed once the library is loaded; a file at the
cache path that does not load as the decoder is rebuilt once. Where no compiler works, or ``TIERED_NATIVE=0``, it
returns None and tiered decodes with numpy: the same bits, ~6x slower (a :class:`UserWarning` says so once per
process).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from .errors import caller_stacklevel

__all__ = ["exp3", "cache_dir", "SOURCE"]

#: the decoder's C source, shipped in the package
SOURCE = Path(__file__).with_name("exp3_decode.c")
_lock = threading.Lock()
_lib: Any = None
_tried = False
#: why the last build failed ("" when it did not), for messages and ``tiered inspect``
why_not = ""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TIERED_CACHE_DIR``, ``$XDG_CACHE_HOME/tiered`` or ``~/.cache/tiered``."""
    if os.environ.get("TIERED_CACHE_DIR"):
        return Path(os.environ["TIERED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiered"


def _build(out_dir: Path, cc: list[str], *, rebuild: bool = False) -> Path:
    """Compile :data:`SOURCE` into ``out_dir`` (``rebuild``: even if a library is there); returns the library's path.
    Raises OSError or SubprocessError."""
    lib = out_dir / "libtiered_exp3.so"
    if lib.exists() and not rebuild:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([*cc, "-O3", "-shared", "-fPIC", "-std=gnu11", "-o", tmp, str(SOURCE)], check=True,
                       capture_output=True, text=True, timeout=120)
        if os.path.getsize(tmp) == 0:
            raise OSError(f"{cc[0]} wrote an empty library")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp's 0600 would keep the cache's other users out
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load(path: Path) -> Any:
    """Load a built library and declare its functions. Raises OSError (not a loadable library) or AttributeError (one
    without the decoder's symbols: a stale or foreign file at the cache path)."""
    lib = ctypes.CDLL(str(path))
    lib.tiered_exp3_init.restype = None
    lib.tiered_exp3_init.argtypes = []
    lib.tiered_exp3_decode.restype = ctypes.c_int64
    lib.tiered_exp3_decode.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.tiered_exp3_simd.restype = ctypes.c_int
    lib.tiered_exp3_init()
    return lib


def _build_and_load(cc: list[str]) -> Any:
    key = hashlib.sha256(SOURCE.read_bytes() + f"\0{shutil.which(cc[0])}\0{cc[1:]}\0{platform.machine()}".encode())
    sub = Path("native") / key.hexdigest()[:16]
    try:
        path = _build(cache_dir() / sub, cc)
    except OSError:  # a cache that cannot be written (EACCES, EROFS): a private directory, removed once loaded
        private = Path(tempfile.mkdtemp(prefix="tiered-native-"))
        try:
            return _load(_build(private, cc))
        finally:
            shutil.rmtree(private, ignore_errors=True)  # the mapped library stays valid
    try:
        return _load(path)
    except (OSError, AttributeError):  # a stale or damaged file at the cache path: build it again, once
        return _load(_build(cache_dir() / sub, cc, rebuild=True))


def exp3() -> Any:
    """The loaded library (``tiered_exp3_decode``, ``tiered_exp3_simd``), or None where it cannot be built or
    ``TIERED_NATIVE=0``. Thread-safe; builds at most once per process."""
    global _lib, _tried, why_not
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("TIERED_NATIVE", "1") == "0":
            why_not = "TIERED_NATIVE=0"
        else:
            cc = shlex.split(os.environ.get("CC") or "cc") or ["cc"]
            try:
                if shutil.which(cc[0]) is None:
                    raise FileNotFoundError(f"no C compiler {cc[0]!r} on PATH (set CC)")
                _lib = _build_and_load(cc)
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                why_not = f"{type(e).__name__}: {detail.strip()[:300]}"
        _tried = True
        if _lib is None and why_not != "TIERED_NATIVE=0":
            warnings.warn(f"tiered: the C decoder of exp3 chunks could not be built or loaded ({why_not}); decoding "
                          "with numpy instead (the same bits, ~6x slower). Install a C compiler (e.g. gcc) or set CC.",
                          UserWarning, stacklevel=caller_stacklevel())
        return _lib
