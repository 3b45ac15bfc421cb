"""The streamer: keeps ``prefetch`` units ahead of the one running (on CUDA, more while their device buffers fit
``prefetch`` slots of the device pool: :meth:`Streamer._ahead`). It composes four roles:

* :class:`~tiered.order.OrderPolicy` — which units come next (learned from what ran);
* :class:`~tiered.loader.Loader` — one thread; each load job is a ``Future`` with one owner;
* a device stage — :class:`~tiered.stage.CudaStage` (H2D on a copy stream, events) or
  :class:`~tiered.stage.CpuStage` (zero copy: views of the ring slot);
* :mod:`~tiered.binding` — swaps a unit's tensors into its modules and back.

Threads and streams:

* **caller** (the thread running ``forward``): :meth:`Streamer.acquire` in a unit's forward
  pre-hook, :meth:`Streamer.release` in its forward hook, :meth:`Streamer.release_all` when the
  model's outermost call ends however it ends (an exception, ``KeyboardInterrupt``: forward hooks
  do not run for a ``BaseException``, so this is what gives back what an interrupted unit held).
  On CUDA it never blocks the compute stream on the host: it waits on the unit's *ready* event.
* **loader** and **reader** threads: see :mod:`tiered.loader` and :mod:`tiered.reader`.

Concurrency: ``acquire``/``release`` hold one re-entrant lock, so threads driving a model's
modules at once cannot corrupt its state; whole forward passes are serialised one level up, by
the model's ``__call__`` (see :func:`tiered.load`).

A unit asked for out of the predicted order is a *miss*, loaded on demand, and stale prefetches
are given back. Any exception in a worker thread is re-raised in the caller's ``forward``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .binding import bind, copy_out_aliases, remember_placeholders, unbind
from .dist import Dist, io_plans, read_args
from .errors import RingTooSmallError, StreamerError, TieredError
from .hostmem import PAGE_SIZE, page_up
from .loader import Loader
from .order import OrderPolicy
from .pieces import cut_all
from .plan import Plan, Unit, same_bytes
from .reader import Reader
from .ring import GiB, Ring, Slot, gib_up
from .stage import CpuStage, CudaStage, DeviceArena, Loaded
from .stats import Stats

__all__ = ["Streamer"]


def _detached(u: Unit) -> Unit:
    """``u`` with no reference to a module (targets keep keys, offsets, dtypes, shapes, copies)."""
    return dataclasses.replace(u, module=None, targets=[dataclasses.replace(t, module=None) for t in u.targets])


@dataclass(eq=False)
class _Held:
    """A bound unit and how many times each thread has it acquired (nested and concurrent use)."""

    ld: Loaded
    counts: dict[int, int]


class Streamer:
    """Runs the data path for one model. See the module docstring for who does what.

    Args:
        plan: units in predicted order.
        reader: copies spans into ring slots.
        ring: the host ring.
        device: ``cpu`` or a CUDA device.
        prefetch: units loaded ahead of the one running.
        resident: indices of units loaded once and kept (never streamed).
        rows: indices of embedding units that read only their looked-up rows (``tiered/rows.py``):
            never loaded, prefetched or bound here.
        stats: counters to update.
        dist: this rank of a distributed job (``tiered/dist.py``): each unit is read as this rank's
            chunk and all-gathered when a pass first binds it (resident units: once, at load).
        host: indices of streamed units kept in the host tier (CUDA): read once into ``host_ring`` by
            :meth:`load_host`, then copied to the GPU from there every pass (no disk, no ring).
        host_ring: pinned host memory for them, exactly their size.
        mapped: CPU zero copy: indices of streamed units bound as views of the checkpoint's file mapping
            (no copy); their pages are dropped from the process when the unit is released. Beside streamed units
            copied into the ring their pages take ring room as a copy's do (:meth:`_mapped_room`).
        pieces: CUDA, one process: unit index -> number of pieces, for units larger than the ring; each is
            read piece by piece through the ring into one full-size device buffer (:class:`tiered.sources.PiecesSource`).
        host_pieces: CUDA, one process: unit index (of ``pieces``) -> how many of its first pieces the host tier
            holds (read once into ``host_ring`` by :meth:`load_host`, copied to the GPU from there every pass); the
            rest of the unit streams through the ring.
        linear_pieces: CPU: indices of linear units computed in pieces on the file mapping (never streamed here).
        fixed: ring bytes taken before the streamer and held until close (CPU: a head's slots,
            :class:`tiered.linear_pieces.RingLinearPieces`): counted as held where the streamer judges the ring full.
    """

    def __init__(
        self,
        plan: Plan,
        reader: Reader,
        ring: Ring,
        device: torch.device,
        *,
        prefetch: int,
        resident: set[int],
        stats: Stats,
        rows: set[int] = frozenset(),  # type: ignore[assignment]
        dist: Dist | None = None,
        host: set[int] = frozenset(),  # type: ignore[assignment]
        host_ring: Ring | None = None,
        mapped: set[int] = frozenset(),  # type: ignore[assignment]
        pieces: dict[int, int] | None = None,
        host_pieces: dict[int, int] | None = None,
        linear_pieces: set[int] = frozenset(),  # type: ignore[assignment]
        fixed: int = 0,
    ) -> None:
        self.plan = plan
        self.fixed = fixed  # ring bytes taken for good before the streamer (a head's slots: RingLinearPieces)
        self.dist = dist
        self.host_ids = set(host)
        self.host_ring = host_ring
        self.host_slots: dict[int, object] = {}  # filled by load_host
        self.host_pieces = {i: k for i, k in (host_pieces or {}).items() if k > 0}
        self.host_piece_slots: dict[int, list] = {}  # unit index -> Slots of its first pieces; filled by load_host
        self.host_piece_bytes: dict[int, int] = {}  # unit index -> checkpoint bytes of those pieces
        self.units = plan.units
        self.ring = ring
        self.device = device
        self.prefetch = max(0, prefetch)
        self.resident_ids = set(resident)
        self.stats = stats
        self.streamed = [u.index for u in self.units if u.index not in self.resident_ids and u.index not in rows]
        self.order = OrderPolicy(self.streamed)
        for u in self.units:
            remember_placeholders(u)
        # What the loader, reader and stage see: the units without their modules, so that no worker
        # thread keeps the model alive (a model dropped without close() is collected and finalised).
        self._io = [_detached(u) for u in self.units]
        self.io_plans = io_plans(self._io, dist, device, plan.align) if dist is not None else None
        # Bytes of the checkpoint this rank reads for each unit (all of it, unless distributed).
        self.read_share = [p.read.src_bytes for p in self.io_plans] if self.io_plans else [u.src_bytes for u in self.units]
        if device.type == "cuda":
            # a unit read in pieces stages its stored region apart (PiecesSource): its decoded layout in the pool
            full = [p.full if p.gathered else u.buf_bytes for p, u in zip(self.io_plans, self.units, strict=True)] \
                if self.io_plans else [u.dev_bytes if u.index in (pieces or {}) else u.buf_bytes for u in self.units]
            streamed_max = max((full[i] for i in self.streamed), default=0)
            n_bufs = self.prefetch + 1 if self.streamed else 0
            self.stage: CpuStage | CudaStage = CudaStage(ring, device, n_bufs=n_bufs, buf_bytes=streamed_max, stats=stats,
                                                         dist=dist)
            stats.device_buffer_bytes = self.stage.pool_bytes
            # prefetch by bytes: the pool's bytes beyond the running unit's slot, and each unit's share of them
            self._ahead_bytes = self.prefetch * self.stage.arena.slot_bytes
            self._dev_size = [DeviceArena._round(n) for n in full]
        else:
            self.stage = CpuStage(ring, dist, drop_pages=reader.drop_pages, drop_page_cache=reader.drop_page_cache,
                                  maps=reader.maps if mapped else None)
        # CPU, a linear unit computed in pieces (tiered/linear_pieces.py) beside units copied into the ring: no unit of
        # the next pass is loaded ahead (_ahead), so the ring has a piece's room free when the head runs at the pass's
        # end — else the next pass's first copies filled it and the pieces ran on top (+782-868 MiB for a 0.45 GiB
        # ring, bound 661, with prefetch 1 or 2: a helper's attack, twentieth session)
        self._copied = [i for i in self.streamed if i not in mapped and i not in self.host_ids]  # through the ring
        self._no_wrap = bool(linear_pieces) and device.type == "cpu" and bool(self._copied) and self.prefetch > 0
        self.pending: OrderedDict[int, Future[Loaded]] = OrderedDict()
        self.held: dict[int, _Held] = {}
        self.resident: dict[int, Loaded] = {}
        self.resident_twins: dict[int, int] = {}  # a resident unit bound to an earlier one's tensors -> that unit
        self._waiting: set[int] = set()  # ids of threads blocked in _wait
        self._closed = False  # no new units (stop)
        self._released = False  # everything given back (close)
        self._lock = threading.RLock()
        # the loader thread must not keep the model alive; a plain weakref (no callback: a WeakMethod's runs Python
        # code inside the garbage collector, where a Ctrl-C landing meanwhile would be swallowed)
        wself = weakref.ref(self)

        def abort() -> BaseException | None:
            me = wself()
            return me._deadlock() if me is not None else StreamerError("the model was garbage-collected")

        cut: dict[int, list[tuple[Unit, int, int]]] = {}
        for i, n in (pieces or {}).items():
            cut[i] = cut_all(self._io[i], n, plan.align)  # cuttable: checked by the placement (tiered.pieces.count)
        self.loader = Loader(reader, ring, self.stage, stats, device=device, abort=abort,
                             io=dict(enumerate(self.io_plans)) if self.io_plans else None, host=self.host_slots,
                             mapped=mapped, pieces=cut, host_pieces=self.host_piece_slots, host_ids=self.host_ids,
                             reserve_mapped=self._mapped_room(mapped))
        self._cut = cut

    # ---------------------------------------------------------------- loader thread
    def _mapped_room(self, mapped: set[int]) -> bool:
        """CPU, mapped units streamed beside units copied into the ring: their pages count against the ring as a
        copy's do. Where the ring holds the resident units, the largest mapped unit and the largest copied one at
        once, that room is set aside once (:attr:`mapped_room`: a slot never written, so never in RSS) and the
        copies stream through the rest, overlapping the mapped units' compute; else each mapped unit holds room of
        its size while loaded (returns True: ``Loader.reserve_mapped``, tiered.sources.MappedSource)."""
        self.mapped_room: Slot | None = None
        on_map = [i for i in self.streamed if i in mapped]
        copied = self._copied
        if not on_map or not copied or self.device.type != "cpu":
            return False
        room = max(page_up(self.units[i].src_bytes) for i in on_map)
        need = max(page_up(self.units[i].nbytes) + PAGE_SIZE for i in copied)  # + a page: the slot's shift
        held = sum(page_up(self.units[i].nbytes) for i in self.resident_ids) + self.fixed
        if self.ring.size - held - room >= need:
            self.mapped_room = self.ring.alloc(room, "mapped units' room", wait=False)
            return False
        return True

    def _deadlock(self) -> BaseException | None:
        """While callers wait: an error if what the loader waits for can never be freed — every thread that
        holds a unit is itself waiting, and the ring (CPU) or device pool (CUDA) is all held."""
        try:
            waiting = set(self._waiting)
            if not waiting:
                return None
            held = [h for h in list(self.held.values()) if not h.ld.given_back]
        except RuntimeError:  # a dict changed under us: someone is making progress
            return None
        if not {t for h in held for t, n in h.counts.items() if n > 0} <= waiting:
            return None  # a holder is running and will give back
        if isinstance(self.stage, CudaStage):
            # the pool cannot place the next buffer, nothing was freed since, and every live buffer is bound by a
            # waiting holder (none is a prefetch that will be used or dropped)
            arena = self.stage.arena
            bound = sum(1 for h in held if h.ld.dev is not None)
            if arena.full_of(bound):
                return RingTooSmallError(
                    f"{bound} units are bound at once and fill the device pool ({self.stage.n_bufs} slots of "
                    f"{arena.slot_bytes / GiB:.3f} GiB); raise prefetch"
                )
            return None
        owned = sum(h.ld.slot.size for h in held if h.ld.slot is not None)
        owned += self.mapped_room.size if self.mapped_room is not None else 0
        owned += self.fixed  # a head's slots, held until close
        owned += sum(ld.slot.size for ld in list(self.resident.values()) if ld.slot is not None)
        if self.ring.used <= owned:
            lent = [h.ld for h in held if h.ld.mapped and h.ld.slot is not None]
            if lent:  # held mapped units give up their ring room (tiered.sources.MappedSource) before a refusal: they
                for ld in lent:  # run on as they did before they held it (Stats.mapped_unreserved counts it)
                    slot, ld.slot = ld.slot, None
                    if slot is not None:
                        self.ring.free(slot)
                        self.stats.mapped_unreserved += 1
                return None
            need = max(u.nbytes for u in self.units)
            return RingTooSmallError(
                f"the ring ({self.ring.size / GiB:.3f} GiB) is full of units held at once and cannot load the "
                f"next; pass ring_gb >= {gib_up(2 * need)}"
            )
        return None

    # ---------------------------------------------------------------- caller thread
    def _check_open(self) -> None:
        if self._closed:
            raise StreamerError("this tiered model is closed (its ring was released): load it again")

    def _wait(self, fut: Future[Loaded], name: str) -> Loaded:
        """The job's result; on an error it is given back. Called without the lock."""
        try:
            return self.loader.wait(fut)
        except TieredError:
            self.loader.discard(fut)
            raise
        except Exception as e:
            self.loader.discard(fut)
            raise StreamerError(f"loading unit {name!r} failed: {e!r}") from e

    def _gather(self, ld: Loaded) -> None:
        """Distributed: assemble ``ld`` from every rank's chunk (once; see :mod:`tiered.dist`)."""
        if ld.io is not None:
            self.stats.add_gathered(ld.io.full - ld.io.chunk)
            self.stage.gather(ld)

    def _take(self, i: int, ld: Loaded, tid: int) -> None:
        self.held[i] = _Held(ld, {tid: 1})
        self.loader.forget(ld.job)  # type: ignore[arg-type]
        self._gather(ld)
        self.stage.before_compute(ld)
        bind(self.units[i], ld.params)

    def _give_back(self, i: int) -> None:
        """Unbind unit ``i`` and give its memory back; each step idempotent, ``held`` left last, so an
        interrupted call is finished by the next one."""
        h = self.held[i]
        unbind(self.units[i])
        self.stage.release(h.ld)
        del self.held[i]

    def reconcile(self, tid: int | None = None) -> None:
        """Give back jobs thread ``tid`` (default: this one) owns but no longer tracks — orphaned by an
        interrupt between two statements. Safe only while that thread is at a boundary (holds no unit
        and waits for none): the start and end of the model's outermost call, or a unit acquired from
        nothing."""
        tid = threading.get_ident() if tid is None else tid
        with self._lock:
            keep = set(self.pending.values()) | {h.ld.job for h in self.held.values()}
            for fut, owner in list(self.loader.live.items()):
                if owner == tid and fut not in keep:
                    self.loader.discard(fut)

    def load_resident(self, *, progress: bool = False) -> None:
        """Load every resident unit once (through the ring) and keep it. Caller thread; blocks.

        ``progress``: a tqdm bar on stderr (bytes read, GB/s, ETA).
        """
        # CPU: a unit holding the same bytes as an earlier resident one (a tied head after its embedding) is not read:
        # it is bound to that unit's tensors, the same Parameter objects, as stock ties them (and costs no ring slot).
        # Not yet on CUDA (each keeps a device copy, as before): that path has not run its CUDA tests with it
        self.resident_twins = (same_bytes([self.units[i] for i in sorted(self.resident_ids)])
                               if isinstance(self.stage, CpuStage) else {})
        ids = [i for i in sorted(self.resident_ids) if i not in self.resident_twins]
        futs = [self.loader.submit(self._io[i], resident=True) for i in ids]
        bar = None
        if progress and futs:
            from tqdm import tqdm

            total = sum(self.units[i].src_bytes for i in ids)
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="tiered: loading resident units",
                       leave=False, dynamic_ncols=True)
        try:
            for k, (i, fut) in enumerate(zip(ids, futs, strict=True)):
                try:
                    ld = self._wait(fut, self.units[i].name)
                except BaseException:
                    for f in futs[k + 1 :]:
                        self.loader.discard(f)
                    raise
                self.resident[i] = ld
                self.loader.forget(fut)
                self._gather(ld)
                self.stage.before_compute(ld)
                bind(self.units[i], ld.params, streamed=False)  # resident: stock's parameter, gradients and all
                for t, first in self.resident_twins.items():
                    if first == i:
                        tw = self.units[t]
                        bind(tw, {a.key: ld.params[b.key] for a, b in zip(tw.targets, self.units[i].targets,
                                                                         strict=True)}, streamed=False)
                if bar is not None:
                    bar.update(self.units[i].src_bytes)
        finally:
            if bar is not None:
                bar.close()
        if isinstance(self.stage, CudaStage) and futs:
            torch.cuda.synchronize(self.device)
        self._tie_resident()

    def _tie_resident(self) -> None:
        """CPU, every unit resident: make each of the plan's tied pairs (:attr:`Plan.ties`) whose tensors were read
        apart one Parameter, the source's, as ``from_pretrained`` does — when their bound values are ``torch.equal``
        (stock's test where a checkpoint holds both keys: a head stored beside its embedding; different values stay
        two Parameters, as in stock). Covers ties inside units and across units that are not whole twins (a BERT MLM
        head's decoder weight and bias). The target's slot bytes stay in the ring (read, then unused). Not yet on
        CUDA, as the whole-unit twins."""
        if not isinstance(self.stage, CpuStage) or not self.plan.ties or not self.resident:
            return
        where = {t.key: t for i in self.resident_ids for t in self.units[i].targets}
        for tk, sk in self.plan.ties:
            t, s = where.get(tk), where.get(sk)
            if t is None or s is None:
                continue
            store_t = t.module._parameters if t.is_param else t.module._buffers
            store_s = s.module._parameters if s.is_param else s.module._buffers
            a, b = store_t.get(t.attr), store_s.get(s.attr)
            if a is None or b is None or a is b or t.is_param != s.is_param:
                continue
            if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
                store_t[t.attr] = b  # unbind() at close restores the placeholder, as for every target

    def load_host(self) -> None:
        """Read every host-tier unit (this rank's chunk of it, distributed) once into its slot of the pinned
        host ring; from then on the loader copies it to the GPU from there. Caller thread; blocks."""
        twins = same_bytes([self.units[i] for i in sorted(self.host_ids)])  # a tied head shares its embedding's slot
        for i in sorted(self.host_ids):
            if i in twins:
                self.host_slots[i] = self.host_slots[twins[i]]
                self.stats.host_units += 1
                continue
            u = self._io[i]
            rd, size, at = read_args(u, self.io_plans[i] if self.io_plans else None)
            slot = self.host_ring.alloc(size, u.name, wait=False)  # type: ignore[union-attr]
            t0 = time.perf_counter()
            n = self.loader.reader.read_unit(rd, slot.view[at:] if at else slot.view)
            self.stats.add_read(n, time.perf_counter() - t0, resident=True)
            self.host_slots[i] = slot
            self.stats.host_units += 1
            self.stats.host_bytes += slot.size
        for i in sorted(self.host_pieces):  # the first pieces of units larger than the ring
            slots, src = [], 0
            for piece, _, _ in self._cut[i][: self.host_pieces[i]]:
                slot = self.host_ring.alloc(piece.nbytes, self.units[i].name, wait=False)  # type: ignore[union-attr]
                t0 = time.perf_counter()
                n = self.loader.reader.read_unit(piece, slot.view)
                self.stats.add_read(n, time.perf_counter() - t0, resident=True)
                slots.append(slot)
                src += n
                self.stats.host_bytes += slot.size
            self.host_piece_slots[i] = slots
            self.host_piece_bytes[i] = src
            self.stats.host_pieces += len(slots)

    def acquire(self, i: int) -> None:
        """Bind unit ``i``'s tensors into its modules (pre-hook; any caller thread).

        Waits for the unit without holding the streamer's lock, so threads driving different units at
        once make progress; a thread that holds nothing first reconciles its orphaned jobs.
        """
        tid = threading.get_ident()
        with self._lock:
            self._check_open()
            h = self.held.get(i)
            if h is not None:  # nested use, or another thread's use, of a bound unit
                h.counts[tid] = h.counts.get(tid, 0) + 1
                return
            if not any(h.counts.get(tid) for h in self.held.values()):
                self.reconcile(tid)
            self.order.record(i)
            if i in self.pending:
                self.stats.hits += 1
                for j in list(self.pending):  # queued before i: stale predictions
                    if j == i:
                        break
                    self.loader.discard(self.pending.pop(j))
                fut = self.pending.pop(i)
                self.loader.live[fut] = tid  # this thread owns it now
            else:
                self.stats.misses += 1
                for j in list(self.pending):
                    self.loader.discard(self.pending.pop(j))
                fut = self.loader.submit(self._io[i])
            self._prefetch_after(i)
            self._waiting.add(tid)
        t0 = time.perf_counter()
        try:
            ld = self._wait(fut, self.units[i].name)
        finally:
            self._waiting.discard(tid)
        with self._lock:
            self.stats.stall_s += time.perf_counter() - t0
            if self._closed:
                self.loader.discard(fut)
                self._check_open()
            h = self.held.get(i)
            if h is not None:  # another thread bound it while this one waited: use theirs
                self.loader.discard(fut)
                h.counts[tid] = h.counts.get(tid, 0) + 1
                return
            self._take(i, ld, tid)
            if i in self.host_slots:
                self.stats.add_host_used(self.read_share[i])
            else:
                held = self.host_piece_bytes.get(i, 0)  # the host tier's pieces of it: used, not read
                if held:
                    self.stats.add_host_used(held)
                self.stats.add_streamed(self.read_share[i] - held)  # counted when used, not when read

    def _ahead(self, i: int) -> list[int]:
        """The units to load ahead of ``i``: ``prefetch`` of them, and on CUDA more while their device buffers fit
        ``prefetch`` slots of the pool (:class:`~tiered.stage.DeviceArena`), so that more units run ahead when the
        largest unit (a head) is much larger than the rest. Caller thread, under the streamer's lock."""
        if not isinstance(self.stage, CudaStage) or not self.prefetch:
            ahead = self.order.ahead(i, self.prefetch)
            if self._no_wrap:  # not past the pass's end (units run in their plan's order: a unit before i starts one)
                ahead = list(itertools.takewhile(lambda j: j > i, ahead))
            return ahead
        out, total = [], 0
        for j in self.order.after(i):
            n = 0 if j in self.resident_ids else self._dev_size[j]
            if len(out) >= self.prefetch and total + n > self._ahead_bytes:
                break
            out.append(j)
            total += n
        return out

    def _prefetch_after(self, i: int) -> None:
        for j in self._ahead(i):
            if j in self.pending or j in self.held or j in self.resident_ids:
                continue
            self.pending[j] = self.loader.submit(self._io[j])

    def release(self, i: int, output: object = None) -> object:
        """Unbind unit ``i`` and give its memory back (forward hook; the thread that acquired it).

        Returns ``output`` with any tensor that aliases streamed memory replaced by a copy (a module
        returning a view of its own weight), so the caller never sees a refilled buffer.
        """
        tid = threading.get_ident()
        with self._lock:
            h = self.held.get(i)
            if h is None or not h.counts.get(tid):
                return output
            if output is not None:
                output = copy_out_aliases(output, self.stage.owns)
            h.counts[tid] -= 1
            if not any(h.counts.values()):
                self._give_back(i)
            return output

    def release_all(self) -> None:
        """The end (or start) of this thread's outermost model call: give back every unit it still holds
        (an interrupted unit's forward hook never ran) and reconcile its orphaned jobs. Units other
        threads hold stay bound."""
        tid = threading.get_ident()
        with self._lock:
            for i, h in list(self.held.items()):
                h.counts.pop(tid, None)
                if not any(h.counts.values()):
                    self._give_back(i)
            self.reconcile(tid)

    def stop(self) -> None:
        """Refuse new units and stop the loader: a forward running in another thread fails at its next unit
        (StreamerError) instead of hanging. Idempotent; callable from any thread."""
        self._closed = True
        self.loader.close()

    def close(self) -> None:
        """Stop, wait for copies, unbind everything. Idempotent; callable from any thread.

        Memory a live tensor still points into (a parameter the user kept) is not unmapped here: the
        ring's mapping goes with its last reference (see :mod:`tiered.hostmem`).
        """
        if self._released:
            return
        self.stop()  # the loader thread has ended: every job is done or cancelled
        got = self._lock.acquire(timeout=10)  # a forward in another thread fails fast once closed
        try:  # every step idempotent: a close() interrupted here is finished by the next close()
            for j in list(self.pending):
                self.loader.discard(self.pending.pop(j))  # gives finished prefetches back to the pool
            for fut in list(self.loader.live):
                self.loader.discard(fut)
            for i in list(self.held):
                unbind(self.units[i])
                del self.held[i]
            for t in list(self.resident_twins):
                unbind(self.units[t])
                del self.resident_twins[t]
            for i in list(self.resident):
                unbind(self.units[i])
                del self.resident[i]
            self.stage.close()  # last: wait for copies, then let go of the whole pool
            self._released = True
        finally:
            if got:
                self._lock.release()
