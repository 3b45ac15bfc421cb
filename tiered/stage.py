"""Device stages: make a unit that was read into a ring slot usable by its modules.

* :class:`CpuStage` — zero copy: the modules use views of the ring slot itself; the slot is the
  unit's memory until the caller releases it.
* :class:`CudaStage` — an H2D copy on a dedicated **copy stream** into a buffer carved from the
  device pool (:class:`DeviceArena`: ``prefetch + 1`` slots of the largest streamed unit, carved by
  bytes in ring order), after the events that say the compute stream is done with those bytes; a
  *ready* event is recorded after the copy and the compute stream waits on it, never the host. The
  ring slot is freed once its copy has finished: :meth:`CudaStage.retire`, called by the loader
  thread (no thread of its own that could die).

Ownership: :meth:`stage` takes the slot; the returned :class:`Loaded` owns the device buffer (or,
on CPU, the slot) until :meth:`release` (the unit ran) or :meth:`drop` (it was never used) gives it
back. Both are idempotent, so a cleanup path that runs twice cannot hand a buffer out twice.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import policy, quant
from .dist import Dist, IoPlan, all_gather_bytes
from .plan import Unit
from .ring import Ring, Slot
from .stats import Stats

__all__ = ["Loaded", "CpuStage", "CudaStage", "DeviceArena", "views"]


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
    at: int = -1  # offset in the device pool (DeviceArena); -1: a buffer of its own (resident)
    waits: list = field(default_factory=list)  # events of the earlier users of these bytes (DeviceArena.alloc)


class DeviceArena:
    """The device pool: one allocation of ``n_slots`` slots of ``slot_bytes``, carved into unit buffers in ring order.

    Why: a pool of ``prefetch + 1`` whole buffers of the largest streamed unit holds ``prefetch + 1`` units whatever
    their size, so with one large unit (Llama-3-8B's 1.05 GB head beside 0.44 GB layers) the copy stream runs only
    two layers ahead. Carved by bytes, the same memory holds about seven such layers, and four run ahead. (Measured on
    the H200: no change beyond the noise in a warm decode step, whose 33-64 ms cuDNN set-up stall neither pool
    covers; benchmarks/NOTES.md, "Prefetch by bytes on CUDA", 2026-12-04.)

    Rules: a buffer is at most ``slot_bytes`` and never straddles two slots, so while fewer than ``n_slots`` buffers are
    live a whole slot is free and any buffer fits — the count pool's guarantee, kept. Allocation is first fit in ring
    order from the end of the newest live buffer (so bytes are reused oldest first); buffers are freed in any order,
    each with the event after which its bytes may be overwritten (the compute stream's, or its own copy's for a
    prefetch never used); a new buffer carries in :attr:`DevBuf.waits` the events of earlier users of its bytes that
    have not fired yet, which the copy stream waits on before writing (never the host).

    Threads: :meth:`alloc` on the loader thread; :meth:`free` on any. ``base`` may be a CPU tensor (tests), and the
    events anything with ``query()``.
    """

    ALIGN = policy.DEVICE_ALIGN  # buffer offsets (bytes): every dtype's view and the vectorised copy kernels are aligned

    def __init__(self, base: torch.Tensor, n_slots: int, slot_bytes: int) -> None:
        if base.numel() < n_slots * slot_bytes or slot_bytes % self.ALIGN:
            raise ValueError(f"DeviceArena: {base.numel()} bytes for {n_slots} slots of {slot_bytes} (a multiple of "
                             f"{self.ALIGN})")
        self.base = base
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.total = n_slots * slot_bytes
        self._live: list[DevBuf] = []  # in allocation order
        self._size: dict[int, int] = {}  # id(buf) -> its byte count (rounded up to ALIGN)
        self._used: list[tuple[int, int, object]] = []  # (start, end, event) of freed buffers not known to be done
        self._head = 0  # where the next buffer goes when nothing newer is live
        self._cv = threading.Condition()
        self._frees = 0  # bumped by every free: a waiting alloc retries
        self._failed = -1  # self._frees when the last alloc attempt failed (blocked())

    @staticmethod
    def _round(n: int) -> int:
        return policy.device_slot_bytes(n)

    @property
    def live(self) -> int:
        """How many buffers are allocated and not freed."""
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes of the live buffers (rounded up to ALIGN). Any thread."""
        with self._cv:
            return sum(self._size[id(b)] for b in self._live)

    def _fits(self, p: int, n: int) -> bool:
        if p + n > self.total or p // self.slot_bytes != (p + n - 1) // self.slot_bytes:
            return False
        return all(p + n <= b.at or b.at + self._size[id(b)] <= p for b in self._live)

    def _place(self, n: int) -> int | None:
        head = self._live[-1].at + self._size[id(self._live[-1])] if self._live else self._head
        cands = {head % self.total, *(k * self.slot_bytes for k in range(self.n_slots)),
                 *((b.at + self._size[id(b)]) % self.total for b in self._live)}
        for p in sorted(cands, key=lambda c: (c - head) % self.total):
            if self._fits(p, n):
                return p
        return None

    def try_alloc(self, size: int) -> DevBuf | None:
        """A buffer of ``size`` bytes, or None if no place fits now. Raises ValueError if ``size > slot_bytes``."""
        if size > self.slot_bytes:
            raise ValueError(f"a device buffer of {size} bytes is larger than the pool's slots ({self.slot_bytes})")
        n = self._round(max(size, 1))
        with self._cv:
            p = self._place(n)
            if p is None:
                self._failed = self._frees
                return None
            waits: dict[int, object] = {}  # id -> event: each waited on once
            keep = []
            for s, e, ev in self._used:
                if ev.query():
                    continue  # done: nothing to wait for
                if e <= p or p + n <= s:
                    keep.append((s, e, ev))  # outside the new buffer
                    continue
                waits[id(ev)] = ev
                if s < p or p + n < e:
                    keep.append((s, e, ev))  # partly outside: the next user of the rest waits too
            self._used = keep
            buf = DevBuf(self.base[p : p + size], at=p, waits=list(waits.values()))
            self._live.append(buf)
            self._size[id(buf)] = n
            self._head = p + n
            return buf

    def alloc(self, size: int, abort: Callable[[], BaseException | None]) -> DevBuf:
        """A buffer of ``size`` bytes, waiting for frees; between waits (50 ms), raises what ``abort`` returns."""
        while True:
            buf = self.try_alloc(size)
            if buf is not None:
                return buf
            with self._cv:
                if self._failed == self._frees:
                    self._cv.wait(0.05)
            if self._failed == self._frees and (err := abort()) is not None:
                raise err

    def blocked(self) -> bool:
        """Whether the last allocation failed and nothing was freed since."""
        return self._failed == self._frees

    def full_of(self, bound: int) -> bool:
        """The deadlock check: the last allocation failed, nothing was freed since, and at most ``bound`` buffers are
        live (so all of them are bound by holders that wait). One snapshot under the lock: a free between reading the
        two would make the pool look full of bound buffers when it no longer is."""
        with self._cv:
            return self._failed == self._frees and bound >= len(self._live)

    def free(self, buf: DevBuf, after: object | None) -> None:
        """Give ``buf`` back; its bytes may be reused once ``after`` (an event; None: now) has fired. Idempotent."""
        with self._cv:
            if id(buf) not in self._size:
                return
            n = self._size.pop(id(buf))
            self._live = [b for b in self._live if b is not buf]
            # waits never issued (no copy was put into it): the next user of these bytes inherits them; an event
            # already listed for these bytes is not listed twice (else a buffer taken and given back unused over and
            # over would double its entries each time)
            have = {id(ev) for s, e, ev in self._used if s == buf.at and e == buf.at + n}
            for ev in ([after] if after is not None else []) + buf.waits:
                if id(ev) not in have:
                    have.add(id(ev))
                    self._used.append((buf.at, buf.at + n, ev))
            buf.waits = []
            self._frees += 1
            self._cv.notify_all()

    def owns(self, t: torch.Tensor) -> bool:
        return t.device == self.base.device and t.untyped_storage().data_ptr() == self.base.untyped_storage().data_ptr()


@dataclass(eq=False)
class Loaded:
    """A unit whose bytes are ready (on CUDA: once ``ready`` has fired on the copy stream)."""

    unit: Unit
    params: dict[str, torch.Tensor]  # target key -> view (nn.Parameter for floating parameters)
    slot: Slot | None = None  # CPU: the ring slot the views live in
    dev: DevBuf | None = None  # CUDA: the device buffer the views live in
    ready: torch.cuda.Event | None = None
    given_back: bool = False
    waited: bool = False  # CUDA: the compute stream was made to wait on ``ready`` (before_compute)
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
            if ld.mapped and self.drop_pages:  # before the slot a mapped unit holds goes back (its room in the ring)
                for m, off, n in ld.mapped:
                    if getattr(m, "mm", None) is not None and not m.mm.closed:
                        m.drop(off, n, page_cache=self.drop_page_cache)
            if ld.slot is not None:
                stale(ld)
                self.ring.free(ld.slot)

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
        slot = DeviceArena._round(buf_bytes)
        self.arena = DeviceArena(torch.empty(n_bufs * slot, dtype=torch.uint8, device=device), n_bufs, slot)
        self._inflight: deque[tuple[torch.cuda.Event, torch.cuda.Event, Slot | None, int]] = deque()
        self._lock = threading.Lock()  # _inflight: the loader retires, close() drains

    @property
    def pool_bytes(self) -> int:
        """Bytes of the device pool (:class:`DeviceArena`): ``prefetch + 1`` slots of the largest streamed unit."""
        return self.arena.total

    def stage(self, unit: Unit, slot: Slot, *, resident: bool, abort: Callable[[], BaseException | None],
              io: IoPlan | None = None, keep: bool = False) -> Loaded:
        """Issue ``slot`` -> device copy; the slot is retired when it completes (``keep``: a host-tier
        slot, which stays). Loader thread.

        Distributed (``io.gathered``): the slot holds this rank's chunk, copied to its place in the
        full-size buffer; :meth:`gather` assembles the rest before first use.

        Raises (before taking ``slot``; the caller frees it): whatever ``abort`` returns.
        """
        gather = io if io is not None and io.gathered else None
        size = gather.full if gather is not None else unit.dev_bytes if resident else unit.buf_bytes
        at, n = (gather.at, gather.chunk) if gather is not None else (0, unit.nbytes)
        buf = self.buffer(size, resident=resident, abort=abort)
        try:
            ready = self.put(buf, slot, at, n, keep=keep, unit=unit if unit.coded_at is not None else None)
        except BaseException:
            if not resident:  # back to the pool once whatever put issued into it (copy, decode) has run
                try:
                    after = torch.cuda.Event()
                    self.decode_stream.wait_stream(self.copy_stream)
                    after.record(self.decode_stream)
                except Exception:  # noqa: BLE001 - the device itself failed: put's error is the one to raise
                    after = None
                self.arena.free(buf, after)
            raise
        return Loaded(unit, views(unit, buf.t), dev=None if resident else buf, ready=ready, io=gather, base=buf.t)

    def buffer(self, size: int, *, resident: bool, abort: Callable[[], BaseException | None]) -> DevBuf:
        """A device buffer for one unit: a new one of ``size`` bytes (resident), else ``size`` bytes of the pool
        (:meth:`DeviceArena.alloc`: waits for room, polling ``abort``). Loader thread."""
        if resident:
            return DevBuf(torch.empty(size, dtype=torch.uint8, device=self.device))
        return self.arena.alloc(size, abort)

    def put(self, buf: DevBuf, slot: Slot, at: int, n: int, *, keep: bool = False, unit: Unit | None = None,
            into: torch.Tensor | None = None) -> torch.cuda.Event:
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

        A unit larger than the ring is put piece by piece into one buffer (:class:`tiered.sources.PiecesSource`):
        the copy stream runs in order, so the last piece's event says the whole unit is there. ``into``: the
        destination instead of ``buf.t`` (the stored region of a stored unit read in pieces, :meth:`staging`)."""
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copied = torch.cuda.Event(enable_timing=True) if unit is not None else ready
        decoded = 0
        with torch.cuda.stream(self.copy_stream):
            for ev in buf.waits:  # earlier users of these pool bytes (DeviceArena): once, before the first write
                self.copy_stream.wait_event(ev)
            buf.waits = []
            start.record(self.copy_stream)
            if unit is None:
                dst = buf.t if into is None else into
                dst[at : at + n].copy_(slot.view[:n], non_blocking=True)  # type: ignore[operator]
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

    def staging(self, n: int) -> torch.Tensor:
        """``n`` bytes (uint8) of device memory for the stored region of a stored unit read in pieces, allocated on
        the copy stream (the H2D copies write it; :meth:`decode_after` marks it used by the decode stream): beside the
        pool and the GPU budget, transient, cached by torch's allocator between loads. Loader thread."""
        with torch.cuda.stream(self.copy_stream):
            return torch.empty(n, dtype=torch.uint8, device=self.device)

    def decode_after(self, unit: Unit, stored: torch.Tensor, base: torch.Tensor, *, temporary: bool = False
                     ) -> torch.cuda.Event:
        """A stored unit read in pieces (:mod:`tiered.pieces`), every piece's H2D copy issued: decode its stored
        region ``stored`` (``(unit.stored_bytes,)`` uint8 on the device) into ``base`` (``(unit.dev_bytes,)``) with
        :func:`tiered.quant.decode_stored` on the decode stream, after all the copy stream's work so far; returns the
        decode's event (the unit's *ready*). ``temporary``: ``stored`` is a :meth:`staging` tensor, which the allocator
        must not reuse before the decode ran. Loader thread."""
        ready = torch.cuda.Event()
        with torch.cuda.stream(self.decode_stream):
            self.decode_stream.wait_stream(self.copy_stream)
            if temporary:  # before the launch: also if the decode fails part-way
                stored.record_stream(self.decode_stream)
            n = quant.decode_stored(unit, stored, base)
            ready.record(self.decode_stream)
        if n:
            self.stats.add_decoded(n)
        return ready

    def give_back(self, buf: DevBuf, after: torch.cuda.Event | None) -> None:
        """A pool buffer that will not be used (a piecewise load failed part-way): reusable once ``after`` (the
        last copy issued into it) has fired."""
        if buf.at >= 0:
            self.arena.free(buf, after)

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
            ld.waited = True

    def release(self, ld: Loaded) -> None:
        """The unit ran: its buffer is reusable once the compute stream is past this point."""
        if ld.given_back or ld.dev is None:
            return
        ld.given_back = True
        stale(ld)
        stream = torch.cuda.current_stream(self.device)
        if ld.ready is not None and not ld.waited:  # bound but interrupted before compute: its copy, decode or
            stream.wait_event(ld.ready)  # gather may still be writing; the next user of the bytes waits for them
        ev = torch.cuda.Event()
        ev.record(stream)
        self.arena.free(ld.dev, ev)

    def drop(self, ld: Loaded) -> None:
        """The unit was never used: its buffer is reusable once its own H2D copy is done."""
        if ld.given_back or ld.dev is None:
            return
        ld.given_back = True
        self.arena.free(ld.dev, ld.ready)

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and self.arena.owns(t)

    def close(self) -> None:
        """Wait for every copy and decode, free their slots and let go of the device buffer pool."""
        self.copy_stream.synchronize()
        self.decode_stream.synchronize()
        while self.retire(block=True):
            pass
        self.arena = DeviceArena(torch.empty(0, dtype=torch.uint8, device=self.device), 0, self.arena.slot_bytes)
