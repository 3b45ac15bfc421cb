"""libc functions that Python's ``os`` lacks, looked up once through :mod:`ctypes` (``madvise`` on a
torch mapping, ``sync_file_range``, ``renameat2``). Where there is no such function (not glibc/musl,
an old libc), callers fall back or skip: these calls are advice or an optional fast path.
"""

from __future__ import annotations

import ctypes
from typing import Any

_libc: Any = None


def _libc_fn(name: str) -> Any:
    """The libc function ``name`` (errno kept for :func:`ctypes.get_errno`), or None when there is none."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:  # pragma: no cover - not glibc/musl
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def _libc_call(name: str, *args: Any) -> int | None:
    """Call a libc function by name (None when there is none); errors are ignored (advice only)."""
    fn = _libc_fn(name)
    return None if fn is None else fn(*args)
