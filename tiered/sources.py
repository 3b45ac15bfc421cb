"""Sources: where a unit's bytes come from when the loader thread loads it — one class per tier, behind one method,
``load(unit, resident) -> Loaded`` (run on the loader thread). The loader picks a unit's source with one lookup
(:attr:`tiered.loader.Loader.sources`, built from the :class:`~tiered.placement.Placement`); a new kind of source
(quantized codes, compressed shards) is one new class here.

* :class:`RingSource` — read from disk or the page cache into a ring slot, then the device stage (the default);
* :class:`MappedSource` — CPU zero copy: views of the checkpoint's file mapping, no ring;
* :class:`HostSource` — the host tier: a slot read once at load, H2D from there every pass (no disk, no ring);
* :class:`PiecesSource` — CUDA, a unit larger than the ring: piece by piece into one device buffer.

Row-read embeddings (:mod:`tiered.rows`) and routed experts (:mod:`tiered.experts`) read on the model's thread
inside their module's call instead: they are not loader units.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import faults, policy
from . import reader as reader_mod
from .dist import read_args
from .errors import RingTooSmallError
from .hostmem import page_up
from .plan import CPU_ALIGN, Unit
from .stage import CudaStage, Loaded, views

if TYPE_CHECKING:
    from .loader import Loader
    from .ring import Slot

__all__ = ["Source", "RingSource", "MappedSource", "HostSource", "PiecesSource", "RING", "MAPPED", "HOST", "PIECES",
           "PIECES_IN_FLIGHT"]

#: Pieces of a unit larger than the ring read at once (their copies queued together on the reader threads).
PIECES_IN_FLIGHT = 2


class Source:
    """One tier's way of loading a unit. Stateless: :meth:`load` is given the loader ``ld`` (its reader, ring, stage,
    stats and abort check), so a source holds no reference to it (no cycle keeps a dropped model's files open)."""

    def load(self, ld: Loader, u: Unit, resident: bool) -> Loaded:
        raise NotImplementedError


class RingSource(Source):
    """Disk or page cache -> a ring slot (the reader threads) -> the device stage (H2D on CUDA)."""

    def load(self, ld: Loader, u: Unit, resident: bool) -> Loaded:
        io = ld.io.get(u.index)
        rd, size, at = read_args(u, io)
        shift = _shift(ld, u, size) if rd is u and not at and not resident else 0
        slot = ld.ring.alloc(size, u.name, abort=ld.abort, reclaim=lambda: ld.stage.retire(block=True), extra=shift)
        if shift and slot.size >= shift + size:  # the layout starts ``shift`` bytes in: at the file's page offsets
            slot.view = slot.view[shift : shift + size]
        try:
            t0 = time.perf_counter()
            n = ld.reader.read_unit(rd, slot.view[at:] if at else slot.view)
            ld.stats.add_read(n, time.perf_counter() - t0, resident=resident)
            faults.hit("stage", unit=u.name)
            return ld.stage.stage(u, slot, resident=resident, abort=ld.abort, io=io)
        except BaseException:
            ld.ring.free(slot)
            raise


def _shift(ld: Loader, u: Unit, size: int, key: int | tuple[int, int] | None = None) -> int:
    """Bytes to start streamed unit ``u``'s layout into its ring slot so that the reader's O_DIRECT requests land
    straight in it (:func:`tiered.reader.slot_shift`; CPU: a multiple of :data:`tiered.plan.CPU_ALIGN`, as the slot is
    the weights). 0 unless the reader reads O_DIRECT now, and 0 when the extra page would leave the ring room for
    fewer slots of this size at once (the prefetch depth the ring was sized for). The ring gives the extra page only
    when it is free at once (``Ring.alloc(extra=)``): a shift never makes the loader wait. ``key``: what the shift is
    kept under (default ``u.index``; a piece of a unit: ``(unit index, piece number)``)."""
    if not reader_mod.SLOT_DIRECT or ld.reader.backend != "direct":
        return 0
    key = u.index if key is None else key
    shift = ld.shifts.get(key)
    if shift is None:  # once per unit, not on every pass: the plan fixes it
        shift = ld.shifts[key] = reader_mod.slot_shift(u, 1 if ld.device.type == "cuda" else CPU_ALIGN)
    if shift and ld.ring.size // page_up(size + shift) < ld.ring.size // page_up(size):
        return 0
    return shift


class MappedSource(Source):
    """CPU zero copy: the unit computes on views of the file mapping. Beside units copied into the ring (io="auto"'s
    page-cache tier next to O_DIRECT reads, or a cast unit), where the ring could not set the mapped units' room aside
    once (``Streamer.mapped_room``), it holds a ring slot of its size that nothing writes, whose pages are given back
    (``Loader.reserve_mapped``, :meth:`tiered.ring.Ring.drop_pages`)."""

    def load(self, ld: Loader, u: Unit, resident: bool) -> Loaded:
        """A mapped unit: views of the checkpoint's file mapping (after the shards' checks), and readahead of
        their pages into the page cache (``MADV_WILLNEED``: asynchronous; RSS grows only when they run). Loaded to
        stay (``resident``), it goes through the ring instead."""
        if resident:
            return RING.load(ld, u, resident)
        # beside units copied into the ring, the unit's mapped pages take ring room, as a copy would: a slot of its
        # size (the whole ring at most: a head computed in pieces of rows) is held, never written, and the ring's
        # pages there are given back, so the ring's touched pages plus the mapped ones stay within ring_gb (the bound
        # tiered.load promises; without it a running mapped unit came on top of a ring full of copies)
        # — unless units held at once fill the ring (an outer module's unit held around the inner ones, with a ring of
        # the largest unit): the unit is then mapped without its room, as before the room was held, rather than
        # refused (a helper's attack found such a model that ran before and was refused with the room; nineteenth session)
        slot = None
        if ld.reserve_mapped:
            try:
                slot = ld.ring.alloc(min(page_up(u.src_bytes), ld.ring.size), u.name, abort=lambda: _held_full(ld),
                                     reclaim=lambda: ld.stage.retire(block=True))
            except _HeldFull:
                ld.stats.mapped_unreserved += 1
            else:
                ld.ring.drop_pages(slot)
        try:
            return self._map(ld, u, resident, slot)
        except BaseException:
            if slot is not None:
                ld.ring.free(slot)
            raise

    def _map(self, ld: Loader, u: Unit, resident: bool, slot: Slot | None) -> Loaded:
        t0 = time.perf_counter()
        params: dict[str, torch.Tensor] = {}
        ranges = []
        for path in {t.copies[0].src.file for t in u.targets}:
            ld.reader.maps[path].check()
        for tgt in u.targets:
            s = tgt.copies[0].src
            faults.hit("read", unit=u.name, tensor=s.name, offset=s.offset)
            m = ld.reader.maps[s.file]
            v = m.tensor(s)
            params[tgt.key] = nn.Parameter(v, requires_grad=False) if tgt.is_param and v.is_floating_point() else v
            ranges.append((m, s.offset, s.nbytes))
        for m, off, n in ranges:
            m.willneed(off, n)
        ld.stats.add_read(u.src_bytes, time.perf_counter() - t0, resident=resident)
        faults.hit("stage", unit=u.name)
        return Loaded(u, params, mapped=ranges, slot=slot)


class _HeldFull(Exception):
    """The ring is full of units held at once (the streamer's deadlock check): a mapped unit gets no ring room."""


def _held_full(ld: Loader) -> BaseException | None:
    err = ld.abort()
    return _HeldFull() if isinstance(err, RingTooSmallError) else err


class HostSource(Source):
    """The host tier: the unit's slot, read once at load (``Streamer.load_host``); each pass stages it from there (H2D
    from pinned memory on CUDA; in place on the CPU). Before its slot is filled, the unit is read as any other."""

    def load(self, ld: Loader, u: Unit, resident: bool) -> Loaded:
        hs = ld.host.get(u.index)
        if hs is None:
            return RING.load(ld, u, resident)
        faults.hit("stage", unit=u.name)
        return ld.stage.stage(u, hs, resident=resident, abort=ld.abort, io=ld.io.get(u.index), keep=True)


class PiecesSource(Source):
    """CUDA: a unit larger than the ring, read piece by piece into one full-size device buffer."""

    def load(self, ld: Loader, u: Unit, resident: bool) -> Loaded:
        """CUDA, a unit larger than the ring: each piece (a few whole-element runs of its targets, see
        :func:`tiered.dist.split_unit`) is copied (H2D, copy stream) into its place in one full-size device buffer —
        from the host tier when it holds the piece (its first pieces: no read), else read into a ring slot first.

        Reads are pipelined: the next piece's copies are queued on the reader threads before this one's are waited
        for (:meth:`Reader.start_unit`), so the disk queue never runs dry between pieces (at most
        :data:`PIECES_IN_FLIGHT` pieces read at once; the ring holds those and the pieces whose H2D runs). The unit
        is ready when its last piece's copy is (the copy stream runs in order), so its views are exactly the whole
        unit's: outputs stay bitwise equal.

        A stored unit (:mod:`tiered.pieces`: exp3 chunks as they lie) puts its coded pieces into its stored region —
        a temporary of ``stored_bytes`` (:meth:`CudaStage.staging`), so that the pool's slots need only its decoded
        layout — and is ready when :meth:`CudaStage.decode_after` has decoded that region into the buffer, after the
        last piece's copy."""
        stage = ld.stage
        assert isinstance(stage, CudaStage)
        p0 = u.coded_at
        buf = stage.buffer(u.dev_bytes, resident=resident, abort=ld.abort)
        d0 = u.dev_bytes
        stored = None if p0 is None else stage.staging(u.stored_bytes)

        def dest(at: int) -> tuple[torch.Tensor | None, int]:  # a stored region's piece: into it, from its start
            return (None, at) if stored is None or at < d0 else (stored, at - d0)

        held = ld.host_pieces.get(u.index, []) if not resident else []
        ready = None
        reading: collections.deque = collections.deque()  # (slot, jobs, at, n, piece, t0), oldest first
        done_at = [0.0]  # when the last piece's reads finished: read time is counted once where pieces overlap

        def put_oldest() -> torch.cuda.Event:
            slot, jobs, at, n, piece, t0 = reading[0]
            ld.reader.finish(jobs)  # raises the first copy's error once all are done; the slot is freed below
            reading.popleft()
            try:
                into, at = dest(at)
                ev = stage.put(buf, slot, at, n, into=into)
            except BaseException:
                ld.ring.free(slot)
                raise
            now = time.perf_counter()
            ld.stats.add_read(piece.src_bytes, now - max(t0, done_at[0]), resident=resident)
            done_at[0] = now
            return ev

        try:
            for k, (piece, at, n) in enumerate(ld.pieces[u.index]):
                if k < len(held):  # in the host tier: H2D straight from its pinned slot
                    into, to = dest(at)
                    ready = stage.put(buf, held[k], to, n, keep=True, into=into)
                    continue
                slot = None
                # as a whole unit's (RingSource): the piece starts `shift` bytes into its slot where that puts its
                # largest run at its file offset modulo the page, so O_DIRECT reads it straight into the slot. Only
                # with policy.PIECES_WHEN_ONE_FITS (its A/B, off): not yet run on a GPU (benchmarks/NOTES.md, issue 23,
                # twenty-first session), so the default CUDA path stays the one `pytest -m cuda` last passed
                shift = (_shift(ld, piece, piece.nbytes, key=(u.index, k))
                         if policy.PIECES_WHEN_ONE_FITS and not resident else 0)
                while slot is None and reading:  # room without waiting: the slots being read are not retired
                    stage.retire(block=False)
                    try:
                        slot = ld.ring.alloc(piece.nbytes, u.name, wait=False, extra=shift)
                    except RingTooSmallError:
                        ready = put_oldest()
                if slot is None:
                    slot = ld.ring.alloc(piece.nbytes, u.name, abort=ld.abort,
                                           reclaim=lambda: stage.retire(block=True), extra=shift)
                if shift and slot.size >= shift + piece.nbytes:
                    slot.view = slot.view[shift : shift + piece.nbytes]
                try:
                    t0 = time.perf_counter()
                    jobs = ld.reader.start_unit(piece, slot.view)
                except BaseException:
                    ld.ring.free(slot)
                    raise
                reading.append((slot, jobs, at, n, piece, t0))
                if len(reading) > PIECES_IN_FLIGHT - 1:
                    ready = put_oldest()
            while reading:
                ready = put_oldest()
            if stored is not None:  # every piece's copy issued: decode the stored region on the decode stream
                ready = stage.decode_after(u, stored, buf.t[:d0], temporary=True)
            faults.hit("stage", unit=u.name)
        except BaseException:
            while reading:  # never free a slot a copy still writes into
                slot, jobs = reading.popleft()[:2]
                ld.reader.cancel(jobs)
                ld.ring.free(slot)
            if not resident:
                after = ready
                if stored is not None:  # a decode may have been issued: the buffer is free once it has run too
                    try:
                        after = torch.cuda.Event()
                        stage.decode_stream.wait_stream(stage.copy_stream)
                        after.record(stage.decode_stream)
                    except Exception:  # noqa: BLE001 - the device itself failed: the first error is the one to raise
                        after = ready
                stage.give_back(buf, after)
            raise
        return Loaded(u, views(u, buf.t), dev=None if resident else buf, ready=ready, base=buf.t)


#: One instance of each (sources hold no state).
RING, MAPPED, HOST, PIECES = RingSource(), MappedSource(), HostSource(), PiecesSource()
