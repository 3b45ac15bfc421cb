"""The ring: one host buffer of exactly ``ring_bytes``, allocated once, carved into FIFO slots.

Memory: an anonymous private ``mmap`` (page-aligned, so it also serves O_DIRECT reads). With
CUDA it is page-locked in place with ``cudaHostRegister`` — not ``torch.empty(pin_memory=True)``,
whose caching host allocator rounds every block up to a power of two (a 2.1 GiB request takes
4 GiB). Pages are touched once at creation so the ring's RSS is paid up front and stays flat.

Slots are allocated next-fit in allocation order (a circular buffer that tolerates out-of-order
frees). A reader thread that finds no room waits (back-pressure) until the consumer frees a slot.
"""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass

import torch

from .errors import RingTooSmallError

__all__ = ["Ring", "Slot", "GiB", "gib_up"]

GiB = 1 << 30
_PAGE = mmap.PAGESIZE


def gib_up(nbytes: int | float) -> str:
    """``nbytes`` in GiB, rounded *up* to 0.001 GiB, for "pass ring_gb >= ..." advice that is enough."""
    return f"{math.ceil(nbytes / GiB * 1000) / 1000:.3f}"


@dataclass
class Slot:
    """A region ``[start, start + size)`` of the ring (bytes); ``view`` is that region as uint8."""

    start: int
    size: int
    view: torch.Tensor
    owner: str = ""


class Ring:
    """A fixed host buffer of ``ring_bytes`` bytes and its slot allocator.

    Args:
        ring_bytes: exact size in bytes (rounded up to a page).
        pin: page-lock with ``cudaHostRegister`` (needs CUDA); unregistered on :meth:`close`.

    Thread safety: :meth:`alloc` and :meth:`free` may be called from any thread.
    """

    def __init__(self, ring_bytes: int, *, pin: bool = False) -> None:
        if ring_bytes <= 0:
            raise RingTooSmallError(f"ring size must be positive, got {ring_bytes} bytes")
        self.size = (ring_bytes + _PAGE - 1) // _PAGE * _PAGE
        self._mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)  # (size,) uint8, zero copy
        self.buf.zero_()  # fault every page in now: RSS is paid once, up front
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.buf.data_ptr(), self.size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {self.size / GiB:.2f} GiB ring failed (error {int(err)})")
            self.pinned = True
        self._live: list[Slot] = []  # sorted by start
        self._next = 0  # next-fit cursor
        self._cv = threading.Condition()
        self.high_water = 0  # max bytes allocated at once
        self._used = 0
        self._closed = False

    @property
    def used(self) -> int:
        """Bytes currently allocated."""
        return self._used

    def _find(self, n: int) -> int | None:
        gaps: list[tuple[int, int]] = []
        pos = 0
        for s in self._live:
            gaps.append((pos, s.start))
            pos = s.start + s.size
        gaps.append((pos, self.size))
        for lo, hi in gaps:  # next-fit: at or after the cursor ...
            start = max(lo, self._next)
            if hi - start >= n:
                return start
        for lo, hi in gaps:  # ... then wrap around
            if hi - lo >= n:
                return lo
        return None

    def alloc(self, n: int, owner: str = "", *, wait: bool = True, abort=None) -> Slot:
        """A slot of ``n`` bytes (rounded up to a page), blocking while the ring is full.

        ``abort`` (a callable) is polled while waiting: if it returns an exception, that is raised.

        Raises:
            RingTooSmallError: ``n`` exceeds the whole ring.
        """
        n = max(_PAGE, (n + _PAGE - 1) // _PAGE * _PAGE)
        if n > self.size:
            raise RingTooSmallError(
                f"unit {owner!r} needs {gib_up(n)} GiB but the ring is {self.size / GiB:.3f} GiB; "
                f"pass ring_gb >= {gib_up(n)} (>= {gib_up(2 * n)} lets the next unit load while one runs)"
            )
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("ring closed")
                start = self._find(n)
                if start is not None:
                    break
                if not wait:
                    raise RingTooSmallError(f"no room for {owner!r} ({n} bytes)")
                if abort is not None and (err := abort()) is not None:
                    raise err
                self._cv.wait(timeout=0.05)
            slot = Slot(start, n, self.buf[start : start + n], owner)
            self._live.append(slot)
            self._live.sort(key=lambda s: s.start)
            self._next = start + n if start + n < self.size else 0
            self._used += n
            self.high_water = max(self.high_water, self._used)
            return slot

    def free(self, slot: Slot) -> None:
        """Return ``slot`` to the ring and wake a waiting reader."""
        with self._cv:
            for i, s in enumerate(self._live):
                if s is slot:
                    del self._live[i]
                    self._used -= s.size
                    break
            self._cv.notify_all()

    def close(self) -> None:
        """Unpin and unmap. Views of the ring must not be used afterwards."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.pinned = False
        self._live.clear()
        del self.buf
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass
