"""A linear layer larger than the ring, computed on the CPU in pieces of output rows, each on the file mapping.

On the CPU a streamed unit computes on views of the file mapping (zero copy), and the pages of the unit running are
in RSS: they count against the ring (the bound ``tiered.load`` promises). An untied head (``nn.Linear``, vocabulary
x hidden: 1.05 GB for Llama-3-8B in bf16) is often the one unit larger than a small ring. Such a unit is computed
here in pieces instead of refused: for rows ``[a, b)`` of the weight (at most ``piece_rows`` of them, at most half
the ring), ``out[..., a:b] = F.linear(x, W[a:b], bias[a:b])`` on views of the mapping, whose pages are then dropped
(``MADV_DONTNEED``) before the next piece: one piece's pages in RSS at a time.

Ring room. Units copied into the ring (a cast, or O_DIRECT reads beside ``io="auto"``'s page-cache tier) leave the
ring's pages in RSS after they ran. A piece's mapped pages count against the ring as a copy's do: for each call a
ring slot of one piece's bytes is taken (never written; its pages given back, ``MADV_DONTNEED``:
:meth:`tiered.ring.Ring.drop_pages`) and freed when the call returns, so the ring's touched pages plus the piece stay
within ``ring_gb``. It is taken only if free at once: units loaded ahead (``prefetch``) run after this call and hold
their slots until then, so waiting for them would never end; the call then runs without room, counted in
``tiered.stats(model).mapped_unreserved``. So that the room is free, the streamer loads nothing of the next pass ahead
where units are copied into the ring beside such a unit (``Streamer._no_wrap``; the price: the next pass's first unit
is read when it is called, not while the head runs). Without the room, prefetch 0 and a 512 MiB head after a cast
layer in a 0.45 GiB ring grew RSS by 727 MiB against the 661 MiB bound (a helper's attack, nineteenth session); with
prefetch 2, the next pass's first layer copied while the head ran: +806 MiB (twentieth session).

The room is taken and freed on the model's thread, where a ``KeyboardInterrupt`` can land inside ``Ring.alloc`` or
``Ring.free``; a slot so left is found by its owner and given back at the next call (:meth:`LinearPieces.reclaim`).

Exactness. Output row ``n`` of a linear layer is one dot product of ``x`` with ``W[n]``; a piece is the same product
on the same bytes at the same addresses (views of the one mapping stock also computes on). Whether the CPU kernel
sums those products in the same order for a piece as for the whole matrix is the kernel's business (its blocking and
threading may depend on the output width), so it is **verified at load on this machine** (:func:`pieces_exact`):
with random inputs of 1 and 7 rows, the first two pieces computed apart must equal the same rows computed as one
product, bit for bit, or the unit is refused as before (``RingTooSmallError`` naming the ring it needs). The check
reads two pieces of the real weight (at most the ring), and drops them.

Eligible (:func:`linear_piece_eligible`): the unit is one ``nn.Linear`` (its class's ``forward`` is
``nn.Linear.forward``; no other library's instance ``forward``), its ``weight`` (and ``bias``) each one checkpoint
tensor mapped as is (:func:`~tiered.reader.zero_copy_eligible`). Threads: the call runs on the caller's thread
inside the module's :class:`~tiered.guard.CallGuard` (one call at a time per module: :attr:`LinearPieces.lock`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from .binding import follow_requires_grad
from .errors import RingTooSmallError, StreamerError
from .guard import foreign_forward
from .hostmem import PAGE_SIZE, page_up
from .plan import Unit
from .reader import zero_copy_eligible

__all__ = ["linear_piece_eligible", "piece_rows_for", "pieces_exact", "LinearPieces", "RingLinearPieces",
           "ring_piece_eligible"]


def linear_piece_eligible(unit: Unit) -> bool:
    """Whether ``unit`` is one ``nn.Linear`` whose weight (and bias) map as they are (see the module docstring)."""
    m = unit.module
    if type(m).forward is not nn.Linear.forward or not isinstance(m, nn.Linear) or foreign_forward(m) \
            or getattr(unit, "readers", None):  # read as a whole outside its call (tiered/units.py weight_readers)
        return False
    attrs = {t.attr for t in unit.targets}
    if attrs not in ({"weight"}, {"weight", "bias"}) or any(t.module is not m for t in unit.targets):
        return False
    return zero_copy_eligible(unit) and len(_weight(unit).shape) == 2


def ring_piece_eligible(unit: Unit) -> bool:
    """Whether ``unit`` can be read and computed in pieces through ring slots (:class:`RingLinearPieces`): a
    :func:`linear_piece_eligible` unit with a weight only, read without a conversion."""
    if not linear_piece_eligible(unit) or len(unit.targets) != 1 or unit.converts or unit.coded_at is not None:
        return False
    t = unit.targets[0]
    return len(t.copies) == 1 and t.copies[0].decode is None and t.copies[0].place is None


def _weight(unit: Unit) -> Any:
    return next(t for t in unit.targets if t.attr == "weight")


#: Pieces are whole multiples of this many rows (CPU GEMM kernels block output columns; a piece of an odd width took
#: another path in fp32 on the 2-core machine and changed the low bits: the review of 2026-12-01).
PIECE_ALIGN = 64


def piece_rows_for(unit: Unit, ring_bytes: int) -> int:
    """Rows of the weight per piece: as many as half the ring holds with the bias's share, rounded down to a multiple
    of :data:`PIECE_ALIGN` (at least that)."""
    w = _weight(unit)
    row = w.shape[1] * w.dtype.itemsize + sum(t.dtype.itemsize for t in unit.targets if t.attr == "bias")
    return max(PIECE_ALIGN, (ring_bytes // 2) // max(1, row) // PIECE_ALIGN * PIECE_ALIGN)


class LinearPieces:
    """Computes one eligible linear unit in pieces on the file mapping (module docstring).

    Args:
        unit: a :func:`linear_piece_eligible` unit.
        maps: the reader's ``ShardMap`` per file (views, checks, page drops).
        piece_rows: rows per piece (:func:`piece_rows_for`).
        stats: the model's ``Stats`` (the weight's bytes are counted as read and streamed per call).
        ring: the model's CPU ring, where a piece takes room while a call runs (module docstring; None: no room is
            taken, as for the load-time check :func:`pieces_exact`; a pinned ring is never written by a CPU copy).
    """

    def __init__(self, unit: Unit, maps: dict, piece_rows: int, stats: Any, ring: Any = None) -> None:
        self.unit = unit
        self.maps = maps
        self.piece_rows = piece_rows
        self.stats = stats
        self.w = _weight(unit).copies[0].src
        b = [t for t in unit.targets if t.attr == "bias"]
        self.b = b[0].copies[0].src if b else None
        self.rows = self.w.shape[0]
        self.closed = False
        self.placeholder = next((t.module._parameters.get(t.attr) for t in unit.targets if t.attr == "weight"), None)
        self.ring = ring if ring is not None and not ring.pinned else None
        row = self.w.shape[1] * self.w.dtype.itemsize + (self.b.dtype.itemsize if self.b is not None else 0)
        self.room_bytes = min(page_up(piece_rows * row), self.ring.size) if self.ring is not None else 0
        self.owner = f"{unit.name} (a piece's room)"  # no other slot has this owner: Ring.free_owned finds it
        self.lock = threading.Lock()  # the module's CallGuard lock: its calls one at a time

    def reclaim(self) -> None:
        """Give back a piece's room that an interrupted call left in the ring (a ``KeyboardInterrupt`` inside
        ``Ring.alloc`` or ``Ring.free``, which run on the model's thread here). Run at the start of each call, and
        by the model's outermost call before anything streams (``tiered.hooks``: else units waiting for ring room
        would wait for it forever). Calls of this module are one at a time (its ``CallGuard``), so at those points
        no call holds the room."""
        if self.ring is not None and self.lock.acquire(blocking=False):  # else a call runs: it reclaims itself
            try:
                self.ring.free_owned(self.owner)
            finally:
                self.lock.release()

    def _room(self) -> Any:
        """A ring slot of one piece's bytes with its pages given back, or None: no ring, or no room free now
        (counted in ``Stats.mapped_unreserved``; module docstring). Never waits."""
        if self.ring is None:
            return None
        self.ring.free_owned(self.owner)  # what an interrupted call left (reclaim)
        try:
            slot = self.ring.alloc(self.room_bytes, self.owner, wait=False)
        except RingTooSmallError:
            self.stats.mapped_unreserved += 1
            return None
        try:
            self.ring.drop_pages(slot)
        except BaseException:
            self.ring.free(slot)
            raise
        return slot

    def _views(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``[a, b)`` of the weight and bias as views of the mapping (after the shards' checks)."""
        k = self.w.shape[1]
        wm = self.maps[self.w.file]
        wm.check()
        w = wm.elements(self.w, a * k, b * k).view(b - a, k)
        bias = None
        if self.b is not None:
            bm = self.maps[self.b.file]
            bm.check()
            bias = bm.elements(self.b, a, b)
        return w, bias

    def _drop(self, a: int, b: int) -> None:
        isz = self.w.dtype.itemsize
        k = self.w.shape[1]
        self.maps[self.w.file].drop(self.w.offset + a * k * isz, (b - a) * k * isz)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` in pieces of output rows: ``(..., in) -> (..., out)`` in ``x``'s dtype."""
        if self.closed:
            raise StreamerError("this model was closed (tiered.close / end of its with-block); load it again")
        t0 = time.perf_counter()
        out = torch.empty((*x.shape[:-1], self.rows), dtype=x.dtype, device=x.device)
        room = self._room()
        try:
            for a in range(0, self.rows, self.piece_rows):
                b = min(self.rows, a + self.piece_rows)
                w, bias = self._views(a, b)
                if self.placeholder is not None and torch.is_grad_enabled():  # stock's flags; backward refused
                    w = follow_requires_grad(nn.Parameter(w, requires_grad=False), self.placeholder,
                                            key=f"{self.unit.name}.weight")
                try:
                    out[..., a:b] = F.linear(x, w, bias)
                finally:
                    del w, bias
                    self._drop(a, b)
        finally:
            if room is not None:
                self.ring.free(room)
        n = self.w.nbytes + (self.b.nbytes if self.b is not None else 0)
        self.stats.add_read(n, time.perf_counter() - t0)
        self.stats.add_streamed(n)
        return out

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def restore(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


#: Input rows (tokens x batch) the exactness check tries: decode steps of batch 1-9 and a prompt.
CHECK_ROWS = (1, 2, 3, 7, 8, 9, 33)


def pieces_exact(unit: Unit, maps: dict, piece_rows: int) -> bool:
    """Whether computing ``unit`` in pieces of ``piece_rows`` gives the whole product's bits on this machine, checked on
    the real weight in two windows: the first two pieces, and the last full piece with the tail after it (the one
    piece of another width) — each computed apart against those rows as one product, for inputs of
    :data:`CHECK_ROWS` rows (random, the weight's dtype). Reads at most two pieces at a time (the ring's worth) and
    drops their pages. A window is not the whole width stock computes: what it checks is that the kernel's result for
    a row does not depend on which piece it is in."""
    lp = LinearPieces(unit, maps, piece_rows, None)
    k, n = lp.w.shape[1], lp.rows
    last = (n - 1) // piece_rows * piece_rows  # the last piece's first row
    windows = {(0, min(n, 2 * piece_rows)), (max(0, last - piece_rows), n)}
    g = torch.Generator().manual_seed(0)
    for lo, hi in sorted(windows):
        try:
            w, bias = lp._views(lo, hi)
            for m in CHECK_ROWS:
                x = torch.randn(m, k, generator=g).to(lp.w.dtype)
                whole = F.linear(x, w, bias)
                parts = torch.cat([F.linear(x, w[a - lo:min(hi, a + piece_rows) - lo],
                                            None if bias is None else bias[a - lo:min(hi, a + piece_rows) - lo])
                                   for a in range(lo, hi, piece_rows)], dim=-1)
                if not torch.equal(whole, parts):
                    return False
        finally:
            w = bias = None
            lp._drop(lo, hi)
    return True


class RingLinearPieces:
    """CPU: one eligible linear unit (a head) the ring holds whole but not beside the next unit, read in pieces of
    output rows through a few ring slots of its own and computed piece by piece as each read lands.

    Why: on the CPU a unit computes on its ring slot. Where the ring holds the head but not the head and a layer (the
    Llama-3-8B shape in a 2 GiB cgroup: a 0.98 GiB ``lm_head`` in a 1.197 GiB ring beside 0.41 GiB layers), the head's
    read waits for the last layer's compute and the next pass's first layer waits for the head's compute: the disk
    idled 35-55 and 80-107 ms of each 1.3 s token there (``benchmarks/read_trace.py``, ``benchmarks/NOTES.md``,
    twenty-second session). In pieces the head takes :data:`tiered.policy.HEAD_PIECE_SLOTS` slots of
    :data:`tiered.policy.HEAD_PIECE_BYTES` (taken from the ring once, at load, and held until close: the ring's bound
    holds), so the layers keep the rest of the ring and are loaded ahead across the head, and a piece is read while
    the one before it is computed.

    Reads: the reader threads (``Reader.start_unit``: O_DIRECT or ``pread``, as the reader chose), each piece into
    its slot, starting at its layout offset modulo :data:`tiered.plan.CPU_ALIGN` (the address stock's weight has
    there: the kernel's sums depend on it) and, where that agrees, at its file offset modulo the page (O_DIRECT then
    reads straight into it); up to one piece per slot in flight. Off by default
    (:data:`tiered.policy.HEAD_IN_RING_PIECES`: measured slower on a 2-core host). Compute: on the caller's thread,
    ``out[..., a:b] = F.linear(x, W[a:b])`` on the slot's bytes, then the slot is read into again. Exactness as
    :class:`LinearPieces` (checked at load, :func:`pieces_exact`).
    An exception or interrupt cancels the reads in flight and waits for the running ones before it propagates, so
    no reader writes into a slot the next call reads.

    Args:
        unit: a :func:`ring_piece_eligible` unit (a weight only, no bias).
        reader: the model's :class:`~tiered.reader.Reader`.
        slots: the ring slots this unit reads into (``Ring.alloc`` at load; freed by the handle at close).
        piece_rows: rows per piece (a multiple of :data:`PIECE_ALIGN`; a piece's bytes fit a slot with its shift).
        stats: the model's ``Stats``.
    """

    def __init__(self, unit: Unit, reader: Any, slots: list, piece_rows: int, stats: Any) -> None:
        from . import dist as _dist
        from . import reader as _reader
        from .plan import CPU_ALIGN

        self.unit, self.reader, self.slots, self.stats = unit, reader, slots, stats
        w = _weight(unit)
        self.w = w.copies[0].src
        self.rows, self.k = w.shape[0], w.shape[1]
        self.dtype = w.dtype
        row = self.k * w.dtype.itemsize
        self.pieces: list[tuple[Unit, int, int, int]] = []  # (piece, first row, end row, shift)
        for a in range(0, self.rows, piece_rows):
            b = min(self.rows, a + piece_rows)
            runs = _dist.plain_runs(unit.targets, w.offset + a * row, w.offset + b * row)
            assert runs is not None, unit.name
            piece = Unit(unit.index, unit.name, None, runs, nbytes=(b - a) * row,  # type: ignore[arg-type]
                         src_bytes=sum(r.copies[0].nbytes for r in runs))
            # where the piece starts in its slot: at its layout offset modulo CPU_ALIGN, the address a whole unit's
            # weight has in its slot (the plan keeps stock's: the kernel's sums depend on it, 4.8e-7 off in fp32
            # otherwise), and at its file offset modulo the page where that agrees, so O_DIRECT reads straight in
            want = (w.offset + a * row) % CPU_ALIGN
            page = (self.w.offset + a * row) % PAGE_SIZE
            shift = page if page % CPU_ALIGN == want and _reader.SLOT_DIRECT else want
            assert all(s.size >= shift + piece.nbytes for s in slots), (unit.name, shift, piece.nbytes)
            self.pieces.append((piece, a, b, shift))
        self.placeholder = next((t.module._parameters.get(t.attr) for t in unit.targets if t.attr == "weight"), None)
        self.closed = False
        self.lock = threading.Lock()  # the module's CallGuard lock: its calls one at a time

    def _start(self, jobs: list, starts: list, j: int) -> None:
        """Queue piece ``j``'s read into its slot: its jobs go into ``jobs`` (every piece's of this call, one list, so
        one cancel reaches them all) before any is queued, from index ``starts[j]`` on."""
        if self.closed:  # (the model is being closed: its reader pool may refuse the submit)
            raise StreamerError("this model was closed (tiered.close / end of its with-block); load it again")
        piece, _a, _b, shift = self.pieces[j]
        slot = self.slots[j % len(self.slots)]
        starts.append((len(jobs), time.perf_counter()))
        self.reader.start_unit(piece, slot.view[shift : shift + piece.nbytes], jobs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)`` in pieces of output rows read through the unit's slots: ``(..., in) -> (..., out)``
        in ``x``'s dtype. Raises the reader's errors (``ShardChangedError``, ``OSError``) after cancelling the rest;
        ``StreamerError`` once the model is closed."""
        if self.closed:
            raise StreamerError("this model was closed (tiered.close / end of its with-block); load it again")
        out = torch.empty((*x.shape[:-1], self.rows), dtype=x.dtype, device=x.device)
        jobs: list = []  # every read job of this call, in piece order
        starts: list = []  # per piece started: (its first job's index in jobs, when it was queued)
        n, slots = len(self.pieces), len(self.slots)
        try:
            for j in range(min(slots, n)):
                self._start(jobs, starts, j)
            for j in range(n):
                lo, t0 = starts[j]
                self.reader.finish(jobs[lo : starts[j + 1][0] if j + 1 < len(starts) else len(jobs)])
                piece, a, b, shift = self.pieces[j]
                # the read's interval (Stats counts the union with the loader's reads)
                self.stats.add_read(piece.src_bytes, time.perf_counter() - t0)
                view = self.slots[j % slots].view[shift : shift + piece.nbytes]
                w = view.view(self.dtype).view(b - a, self.k)
                if self.placeholder is not None and torch.is_grad_enabled():  # stock's flags; backward refused
                    w = follow_requires_grad(nn.Parameter(w, requires_grad=False), self.placeholder,
                                             key=f"{self.unit.name}.weight")
                out[..., a:b] = F.linear(x, w)
                del w
                if j + slots < n:  # its slot is free again: read the piece that goes there next
                    self._start(jobs, starts, j + slots)
        except RuntimeError as e:  # the reader pool shut down under a call: the model was closed meanwhile
            if self.closed and "shutdown" in str(e):
                raise StreamerError("this model was closed (tiered.close / end of its with-block) during this call; "
                                    "load it again") from e
            raise
        finally:
            # an error or an interrupt: nothing may still write into a slot. One call for every job: Reader.cancel
            # waits for the running ones even through a second Ctrl-C (per piece, a Ctrl-C in one piece's wait left
            # the next piece's read running into a slot the next call reads: a helper's attack, twenty-third session)
            self.reader.cancel(jobs)
        self.stats.add_streamed(self.w.nbytes)
        return out

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def restore(self) -> None:
        pass

    def reclaim(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
