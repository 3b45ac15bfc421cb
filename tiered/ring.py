"""The ring: one host buffer of exactly ``ring_bytes``, allocated once, carved into FIFO slots.

Memory: an anonymous private ``mmap`` (page-aligned, so it also serves O_DIRECT reads), wrapped by
:func:`tiered.hostmem.map_tensor` so that it is unmapped by its last reference, never under a live
tensor (a parameter taken from the model and read after ``close()`` keeps the mapping alive instead
of crashing). With CUDA it is page-locked in place with ``cudaHostRegister`` — not
``torch.empty(pin_memory=True)``, whose caching host allocator rounds every block up to a power of
two (a 2.1 GiB request takes 4 GiB). Pages are not touched at creation: RSS grows as slots are first
filled (registration pins, and so faults in, every page at once).

Slots are allocated next-fit in allocation order (a circular buffer that tolerates out-of-order
frees). A thread that finds no room waits (back-pressure) until a slot is freed.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import RingTooSmallError, StreamerError
from .hostmem import PAGE_SIZE, anon_mapping, map_tensor, page_up, try_unmap

__all__ = ["Ring", "Slot", "GiB", "gib_up"]

GiB = 1 << 30


def gib_up(nbytes: int | float) -> str:
    """``nbytes`` in GiB, rounded *up* to 0.001 GiB, for "pass ring_gb >= ..." advice that is enough."""
    return f"{math.ceil(nbytes / GiB * 1000) / 1000:.3f}"


@dataclass(eq=False)
class Slot:
    """A region ``[start, start + size)`` of the ring (bytes); ``view`` is that region as uint8."""

    start: int
    size: int
    view: torch.Tensor
    owner: str = ""


class Ring:
    """A fixed host buffer of ``ring_bytes`` bytes and its slot allocator.

    Args:
        ring_bytes: size in bytes (rounded up to a page; at least one page).
        pin: page-lock with ``cudaHostRegister`` (needs CUDA); unregistered on :meth:`close`.

    Thread safety: :meth:`alloc` and :meth:`free` may be called from any thread.
    """

    def __init__(self, ring_bytes: int, *, pin: bool = False) -> None:
        if ring_bytes < 0:
            raise RingTooSmallError(f"ring size must be >= 0 bytes, got {ring_bytes}")
        self.size = max(PAGE_SIZE, page_up(ring_bytes))
        self._mm = anon_mapping(self.size)
        self.buf = map_tensor(self._mm)  # (size,) uint8, zero copy; pages untouched until written
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.size, 0)
            if int(err) != 0:
                del self.buf
                try_unmap(self._mm)
                raise MemoryError(f"cudaHostRegister of a {self.size / GiB:.2f} GiB ring failed (CUDA error {int(err)})")
            self.pinned = True
        self._live: list[Slot] = []  # sorted by start
        self._next = 0  # next-fit cursor
        self._cv = threading.Condition()
        self.high_water = 0  # max bytes allocated at once
        self._used = 0
        self._closed = False

    @property
    def used(self) -> int:
        """Bytes currently allocated (page-rounded slot sizes)."""
        return self._used

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is this ring's memory (a view of some slot)."""
        buf = getattr(self, "buf", None)
        return buf is not None and t.device.type == "cpu" and t.untyped_storage().data_ptr() == buf.data_ptr()

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

    def alloc(
        self,
        n: int,
        owner: str = "",
        *,
        wait: bool = True,
        abort: Callable[[], BaseException | None] | None = None,
        reclaim: Callable[[], bool] | None = None,
        extra: int = 0,
    ) -> Slot:
        """A slot of ``n`` bytes (rounded up to a page), blocking while the ring is full.

        ``extra``: take ``n + extra`` bytes instead when that much is free at the moment room for ``n`` is found (never
        waiting for it: a slot of ``n`` is taken as soon as one fits, as without ``extra``); ``Slot.size`` says which.

        While there is no room: ``reclaim()`` (if given) is called first and, when it freed
        something, the search is retried at once; else ``abort()`` is polled every 50 ms and the
        exception it returns is raised.

        Raises:
            RingTooSmallError: ``n`` exceeds the whole ring, or no room and ``wait`` is False.
            StreamerError: the ring was closed.
        """
        n = max(PAGE_SIZE, page_up(n))
        if n > self.size:
            raise RingTooSmallError(
                f"unit {owner!r} needs {gib_up(n)} GiB but the ring is {self.size / GiB:.3f} GiB; "
                f"pass ring_gb >= {gib_up(n)} (>= {gib_up(2 * n)} lets the next unit load while one runs)"
            )
        while True:
            with self._cv:
                if self._closed:
                    raise StreamerError("the ring was closed")
                big = page_up(n + extra) if extra > 0 else n
                start = self._find(big) if big > n and big <= self.size else None
                size = big if start is not None else n
                if start is None:
                    start = self._find(n)
                if start is not None:
                    slot = Slot(start, size, self.buf[start : start + size], owner)
                    self._live.append(slot)
                    self._live.sort(key=lambda s: s.start)
                    self._next = start + size if start + size < self.size else 0
                    self._used = sum(s.size for s in self._live)  # from the list: right after an interrupted update
                    self.high_water = max(self.high_water, self._used)
                    return slot
                if not wait:
                    raise RingTooSmallError(f"no room in the ring for {owner!r} ({n} bytes)")
            if reclaim is not None and reclaim():
                continue
            if abort is not None and (err := abort()) is not None:
                raise err
            with self._cv:
                if self._find(n) is None and not self._closed:
                    self._cv.wait(timeout=0.05)

    def drop_pages(self, slot: Slot) -> None:
        """Give ``slot``'s pages back to the kernel (``madvise(MADV_DONTNEED)``: RSS falls by those the ring had
        touched; the next write there faults in zeroed pages). For a slot held as a reservation that nothing writes:
        a CPU mapped unit's (:class:`tiered.sources.MappedSource`), whose own pages count against the ring instead.
        A no-op on a pinned ring (page-locked pages stay; CUDA never maps units)."""
        if not self.pinned and slot.size > 0:
            self._mm.madvise(mmap.MADV_DONTNEED, slot.start, slot.size)

    def free(self, slot: Slot) -> None:
        """Return ``slot`` to the ring and wake a waiting thread. Freeing a slot twice is a no-op."""
        with self._cv:
            for i, s in enumerate(self._live):
                if s is slot:
                    del self._live[i]
                    self._used = sum(s.size for s in self._live)
                    self._cv.notify_all()
                    return

    def free_owned(self, owner: str) -> int:
        """Free every live slot whose ``owner`` is ``owner``; the bytes freed. For a caller that allocates on the
        model's own thread (:class:`tiered.linear_pieces.LinearPieces`), where a ``KeyboardInterrupt`` can land inside
        :meth:`alloc` after the slot is taken but before it is returned, or inside :meth:`free`: at its next call
        such a slot is found by its owner, which nobody else uses, and given back."""
        with self._cv:
            mine = [s for s in self._live if s.owner == owner]
            if not mine:
                return 0
            self._live = [s for s in self._live if s.owner != owner]
            self._used = sum(s.size for s in self._live)
            self._cv.notify_all()
            return sum(s.size for s in mine)

    def close(self) -> None:
        """Unpin, and unmap unless a tensor still points into the ring (then its last reference unmaps it).

        The caller guarantees no copy into or out of the ring is still in flight. Idempotent, step by
        step: a close interrupted half way is finished by the next.
        """
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self._live.clear()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.pinned = False
        self.__dict__.pop("buf", None)
        try_unmap(self._mm)
