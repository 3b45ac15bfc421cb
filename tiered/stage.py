"""Device stages: make a unit that was read into a ring slot usable by its modules.

* :class:`CpuStage` — zero copy: the modules use views of the ring slot itself; the slot is the
  unit's memory until the caller releases it.
* :class:`CudaStage` — an H2D copy on a dedicated **copy stream** into one of a small pool of
  device buffers (``prefetch + 1`` of the largest streamed unit), after the event that says the
  compute stream is done with that buffer; a *ready* event is recorded after the copy and the
  compute stream waits on it, never the host. The ring slot is freed once its copy has finished:
  :meth:`CudaStage.retire`, called by the loader thread (no thread of its own that could die).

Ownership: :meth:`stage` takes the slot; the returned :class:`Loaded` owns the device buffer (or,
on CPU, the slot) until :meth:`release` (the unit ran) or :meth:`drop` (it was never used) gives it
back. Both are idempotent, so a cleanup path that runs twice cannot hand a buffer out twice.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import quant
from .dist import Dist, IoPlan, all_gather_bytes
from .plan import Unit
from .ring import Ring, Slot
from .stats import Stats

__all__ = ["Loaded", "CpuStage", "CudaStage", "views"]


def views(unit: Unit, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each target of ``unit`` as a typed view of ``base`` (uint8) at its layout offset."""
    out: dict[str, torch.Tensor] = {}
    for t in unit.targets:
        v = base[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)
        out[t.key] = nn.Parameter(v, requires_grad=False) if t.is_param and v.is_floating_point() else v
    return out


def stale(ld: Loaded) -> None:
    """``ld``'s memory is about to be refilled with another unit: bump its autograd version counter (shared by the
    bound views), so that a graph built in grad mode that saved one of them raises at ``backward()`` ("modified by
    an inplace operation") instead of differentiating through another unit's bytes. Mapped units (their file
    mapping is never rewritten) and host-tier slots keep their values and are not bumped."""
    if ld.base is not None:
        torch.autograd.graph.increment_version(ld.base)


@dataclass(eq=False)
class DevBuf:
    t: torch.Tensor  # (nbytes,) uint8 on the device
    free: torch.cuda.Event | None = None  # recorded on the compute stream when compute is done with it


@dataclass(eq=False)
class Loaded:
    """A unit whose bytes are ready (on CUDA: once ``ready`` has fired on the copy stream)."""

    unit: Unit
    params: dict[str, torch.Tensor]  # target key -> view (nn.Parameter for floating parameters)
    slot: Slot | None = None  # CPU: the ring slot the views live in
    dev: DevBuf | None = None  # CUDA: the device buffer the views live in
    ready: torch.cuda.Event | None = None
    given_back: bool = False
    job_ref: Callable[[], object] = lambda: None  # weakref to the loader's Future that produced it (no cycle)
    io: IoPlan | None = None  # distributed: this rank's chunk, to be all-gathered before first use
    base: torch.Tensor | None = None  # the full layout buffer the views live in (uint8)
    mapped: list | None = None  # CPU zero copy: (ShardMap, offset, nbytes) the views of the file mapping cover

    @property
    def job(self) -> object:
        return self.job_ref()


class CpuStage:
    """The CPU no-op stage: modules compute on views of the ring slot — or, for a mapped unit (zero copy),
    on views of the checkpoint's file mapping, whose pages :meth:`release` drops from the process
    (``MADV_DONTNEED``: they stay in the page cache, not in RSS)."""

    def __init__(self, ring: Ring, dist: Dist | None = None, *, drop_pages: bool = True,
                 drop_page_cache: bool = False, maps: dict | None = None) -> None:
        self.ring = ring
        self.dist = dist
        self.maps = maps if maps is not None else {}  # the reader's ShardMaps: mapped units' memory
        self.drop_pages = drop_pages
        self.drop_page_cache = drop_page_cache

    def stage(self, unit: Unit, slot: Slot, *, resident: bool, abort: Callable[[], BaseException | None],
              io: IoPlan | None = None, keep: bool = False) -> Loaded:
        # the ring slot is the unit's memory; a host-tier slot (``keep``) stays allocated when the unit is released
        gather = io if io is not None and io.gathered else None
        return Loaded(unit, views(unit, slot.view), slot=None if keep else slot, io=gather, base=slot.view)

    def gather(self, ld: Loaded) -> None:
        """Distributed: assemble the unit from every rank's chunk (gloo, blocking). Caller thread, once."""
        if ld.io is not None and self.dist is not None:
            io, ld.io = ld.io, None
            all_gather_bytes(self.dist, ld.base, io.at, io.chunk)  # type: ignore[arg-type]

    def before_compute(self, ld: Loaded) -> None:
        if ld.mapped:  # a shard truncated since the unit was prefetched would SIGBUS: an error instead
            for m in {id(m): m for m, _, _ in ld.mapped}.values():
                m.check()

    def release(self, ld: Loaded) -> None:
        if not ld.given_back:
            ld.given_back = True
            if ld.slot is not None:
                stale(ld)
                self.ring.free(ld.slot)
            if ld.mapped and self.drop_pages:
                for m, off, n in ld.mapped:
                    if getattr(m, "mm", None) is not None and not m.mm.closed:
                        m.drop(off, n, page_cache=self.drop_page_cache)

    drop = release

    def retire(self, *, block: bool) -> bool:
        return False

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in the ring or in a shard mapping (an output aliasing either is copied out)."""
        if self.ring.owns(t):
            return True
        if t.device.type != "cpu" or not self.maps:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(getattr(m, "u8", None) is not None and m.u8.data_ptr() == ptr for m in list(self.maps.values()))

    def close(self) -> None:
        pass


class CudaStage:
    """H2D on a copy stream into a pool of device buffers; ring slots retired when their copy is done.

    Threads: :meth:`stage` and :meth:`retire` run on the loader thread; :meth:`before_compute`,
    :meth:`release` on the caller's; :meth:`drop` on either.
    """

    def __init__(self, ring: Ring, device: torch.device, *, n_bufs: int, buf_bytes: int, stats: Stats,
                 dist: Dist | None = None) -> None:
        self.ring = ring
        self.device = device
        self.stats = stats
        self.dist = dist
        self.copy_stream = torch.cuda.Stream(device)
        # stored units decode here, after their H2D copy, so that the next unit's copy overlaps the decode
        self.decode_stream = torch.cuda.Stream(device)
        self.gather_stream = torch.cuda.Stream(device) if dist is not None else None
        self.n_bufs = n_bufs
        self._pool: queue.Queue[DevBuf] = queue.Queue()
        self._ptrs: set[int] = set()
        for _ in range(n_bufs):
            b = DevBuf(torch.empty(buf_bytes, dtype=torch.uint8, device=device))
            self._ptrs.add(b.t.data_ptr())
            self._pool.put(b)
        self._inflight: deque[tuple[torch.cuda.Event, torch.cuda.Event, Slot | None, int]] = deque()
        self._lock = threading.Lock()  # _inflight: the loader retires, close() drains

    def _get_buf(self, abort: Callable[[], BaseException | None]) -> DevBuf:
        while True:
            try:
                return self._pool.get(timeout=0.05)
            except queue.Empty:
                if (err := abort()) is not None:
                    raise err from None

    def stage(self, unit: Unit, slot: Slot, *, resident: bool, abort: Callable[[], BaseException | None],
              io: IoPlan | None = None, keep: bool = False) -> Loaded:
        """Issue ``slot`` -> device copy; the slot is retired when it completes (``keep``: a host-tier
        slot, which stays). Loader thread.

        Distributed (``io.gathered``): the slot holds this rank's chunk, copied to its place in the
        full-size buffer; :meth:`gather` assembles the rest before first use.

        Raises (before taking ``slot``; the caller frees it): whatever ``abort`` returns.
        """
        gather = io if io is not None and io.gathered else None
        size = gather.full if gather is not None else unit.dev_bytes
        at, n = (gather.at, gather.chunk) if gather is not None else (0, unit.nbytes)
        buf = self.buffer(size, resident=resident, abort=abort)
        ready = self.put(buf, slot, at, n, keep=keep, unit=unit if unit.coded_at is not None else None)
        return Loaded(unit, views(unit, buf.t), dev=None if resident else buf, ready=ready, io=gather, base=buf.t)

    def buffer(self, size: int, *, resident: bool, abort: Callable[[], BaseException | None]) -> DevBuf:
        """A device buffer for one unit: a new one of ``size`` bytes (resident), else one of the pool (waits for
        one, polling ``abort``). Loader thread."""
        return DevBuf(torch.empty(size, dtype=torch.uint8, device=self.device)) if resident else self._get_buf(abort)

    def put(self, buf: DevBuf, slot: Slot, at: int, n: int, *, keep: bool = False, unit: Unit | None = None
            ) -> torch.cuda.Event:
        """Issue the H2D copy ``slot.view[:n]`` -> ``buf.t[at:at + n]`` on the copy stream, after the compute
        stream is done with ``buf`` (its ``free`` event); returns the copy's *ready* event. The slot is freed
        by :meth:`retire` once the copy has finished (``keep``: a host-tier slot, which stays). Loader thread.

        ``unit``: a stored unit (:func:`tiered.plan.lay_out`): the slot's plain bytes ``[0, coded_at)`` are copied to
        the same offsets, its codes and scales ``[coded_at, n)`` into a staging tensor allocated on the copy stream
        (and marked used by the decode stream, so the allocator reuses it only once the decode has run), and
        :func:`tiered.quant.decode_stored` decodes them into the buffer on the decode stream, after the copy's event
        and before *ready*, while the copy stream goes on with the next unit's copy: the ring,
        the host tier and PCIe carry the stored bytes (``Stats.h2d_bytes``), the device the decoded ones
        (``Stats.decoded_bytes``). Device memory beside the buffers (not in the GPU budget), transient: up to ``prefetch
        + 1`` stored regions (each kept until its decode ran) and :data:`tiered.quant.DEVICE_BAND` of float32 decode
        temporaries (benchmarks/NOTES.md, issue 25, fourth session: a fix on branch wip/exp3-staging-in-buffer).

        A unit larger than the ring is put piece by piece into one buffer (:meth:`tiered.loader.Loader`):
        the copy stream runs in order, so the last piece's event says the whole unit is there."""
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copied = torch.cuda.Event(enable_timing=True) if unit is not None else ready
        decoded = 0
        with torch.cuda.stream(self.copy_stream):
            if buf.free is not None:
                self.copy_stream.wait_event(buf.free)
            start.record(self.copy_stream)
            if unit is None:
                buf.t[at : at + n].copy_(slot.view[:n], non_blocking=True)  # type: ignore[operator]
            else:
                p0 = unit.coded_at
                if p0:
                    buf.t[:p0].copy_(slot.view[:p0], non_blocking=True)  # type: ignore[operator]
                d0 = unit.dev_bytes
                own = buf.t.numel() >= d0 + n - p0  # a pool buffer (Unit.buf_bytes): its tail is the staging
                stored = buf.t[d0 : d0 + n - p0] if own else torch.empty(n - p0, dtype=torch.uint8, device=self.device)
                stored.copy_(slot.view[p0:n], non_blocking=True)  # type: ignore[operator]
                copied.record(self.copy_stream)
        if unit is None:
            with torch.cuda.stream(self.copy_stream):
                ready.record(self.copy_stream)
        else:  # the decode on its own stream, after the copy: the copy stream goes on to the next unit meanwhile
            with torch.cuda.stream(self.decode_stream):
                self.decode_stream.wait_event(copied)
                decoded = quant.decode_stored(unit, stored, buf.t[:d0])
                if not own:  # a resident unit's temporary: not reused by the copy stream before the decode ran
                    stored.record_stream(self.decode_stream)
                del stored
                ready.record(self.decode_stream)
        with self._lock:
            self._inflight.append((start, copied, None if keep else slot, n))
        if decoded:
            self.stats.add_decoded(decoded)
        return ready

    def give_back(self, buf: DevBuf, after: torch.cuda.Event | None) -> None:
        """A pool buffer that will not be used (a piecewise load failed part-way): reusable once ``after`` (the
        last copy issued into it) has fired."""
        if buf.t.data_ptr() in self._ptrs:
            if after is not None:
                buf.free = after
            self._pool.put(buf)

    def gather(self, ld: Loaded) -> None:
        """Distributed: all-gather the unit's chunks into its buffer on the gather stream, after its H2D
        (event), and make ``ld.ready`` the gather's event. Caller thread, once per load, in the same
        unit order on every rank (see :mod:`tiered.dist`)."""
        if ld.io is None or self.dist is None:
            return
        io, ld.io = ld.io, None
        gs = self.gather_stream
        done = torch.cuda.Event()
        with torch.cuda.stream(gs):
            if ld.ready is not None:
                gs.wait_event(ld.ready)  # type: ignore[union-attr]
            all_gather_bytes(self.dist, ld.base, io.at, io.chunk)  # type: ignore[arg-type]
            done.record(gs)
        ld.ready = done

    def retire(self, *, block: bool) -> bool:
        """Free the ring slots of finished H2D copies (oldest first; with ``block``, wait for the oldest
        when none has finished). True if a copy was retired."""
        freed = False
        while True:
            with self._lock:
                if not self._inflight:
                    return freed
                head = self._inflight[0]
            start, ready, slot, nbytes = head
            if not ready.query():
                if not block or freed:
                    return freed
                ready.synchronize()  # releases the GIL
            with self._lock:
                if self._inflight and self._inflight[0] is head:
                    self._inflight.popleft()
                else:
                    continue
            if slot is not None:  # None: a host-tier slot, which stays
                self.ring.free(slot)
            self.stats.add_h2d(nbytes, start.elapsed_time(ready) / 1e3)
            freed = True

    def before_compute(self, ld: Loaded) -> None:
        """Make the caller's current stream wait for ``ld``'s H2D copy (no host sync)."""
        if ld.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ld.ready)

    def release(self, ld: Loaded) -> None:
        """The unit ran: its buffer is reusable once the compute stream is past this point."""
        if ld.given_back or ld.dev is None:
            return
        ld.given_back = True
        stale(ld)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        ld.dev.free = ev
        self._pool.put(ld.dev)

    def drop(self, ld: Loaded) -> None:
        """The unit was never used: its buffer is reusable once its own H2D copy is done."""
        if ld.given_back or ld.dev is None:
            return
        ld.given_back = True
        ld.dev.free = ld.ready
        self._pool.put(ld.dev)

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and t.untyped_storage().data_ptr() in self._ptrs

    def close(self) -> None:
        """Wait for every copy and decode, free their slots and let go of the device buffer pool."""
        self.copy_stream.synchronize()
        self.decode_stream.synchronize()
        while self.retire(block=True):
            pass
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        self._ptrs.clear()
