"""A test seam: inject a failure at a named point of the data path.

The data path calls :func:`hit` at each point below; it does nothing unless a test armed that
point with :func:`inject`. This is how the tests prove that an error in a worker thread surfaces
in the caller's ``forward`` and leaves the model usable, without patching private names.

Points (thread, keyword arguments passed to the armed callable):

* ``"read"`` — a reader thread, before copying a span of a tensor into a ring slot; or the loader
  thread, before reading a source of a conversion it cannot place (``unit``: unit name, ``tensor``:
  checkpoint tensor name, ``offset``: absolute file offset, bytes; from a reader thread also ``io``: the
  backend of that copy, ``"mmap"``, ``"pread"`` or ``"direct"``).
* ``"stage"`` — the loader thread, after a unit was read into its slot and before it is staged
  (on CUDA: before the H2D copy is issued) (``unit``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["POINTS", "hit", "inject"]

POINTS = ("read", "stage")
_armed: dict[str, Callable[..., None]] = {}
_lock = threading.Lock()


def hit(point: str, **info: object) -> None:
    """Run the callable armed at ``point`` (it may raise); a dict lookup when nothing is armed."""
    fn = _armed.get(point)
    if fn is not None:
        fn(**info)


@contextlib.contextmanager
def inject(point: str, fn: Callable[..., None]) -> Iterator[None]:
    """Arm ``point`` with ``fn`` (called with the point's keyword arguments; raise to inject a fault)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; one of {POINTS}")
    with _lock:
        if point in _armed:
            raise RuntimeError(f"fault point {point!r} is already armed")
        _armed[point] = fn
    try:
        yield
    finally:
        with _lock:
            _armed.pop(point, None)
