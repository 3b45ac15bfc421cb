"""The streamer: keeps ``prefetch`` units ahead of the one running. It composes four roles:

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

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from .binding import bind, copy_out_aliases, remember_placeholders, unbind
from .errors import RingTooSmallError, StreamerError, TieredError
from .loader import Loader
from .order import OrderPolicy
from .plan import Plan
from .reader import Reader
from .ring import GiB, Ring, gib_up
from .stage import CpuStage, CudaStage, Loaded
from .stats import Stats

__all__ = ["Streamer"]


class Streamer:
    """Runs the data path for one model. See the module docstring for who does what.

    Args:
        plan: units in predicted order.
        reader: copies spans into ring slots.
        ring: the host ring.
        device: ``cpu`` or a CUDA device.
        prefetch: units loaded ahead of the one running.
        resident: indices of units loaded once and kept (never streamed).
        stats: counters to update.
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
    ) -> None:
        self.plan = plan
        self.units = plan.units
        self.ring = ring
        self.device = device
        self.prefetch = max(0, prefetch)
        self.resident_ids = set(resident)
        self.stats = stats
        self.streamed = [u.index for u in self.units if u.index not in self.resident_ids]
        self.order = OrderPolicy(self.streamed)
        if device.type == "cuda":
            streamed_max = max((self.units[i].nbytes for i in self.streamed), default=0)
            n_bufs = self.prefetch + 1 if self.streamed else 0
            self.stage: CpuStage | CudaStage = CudaStage(ring, device, n_bufs=n_bufs, buf_bytes=streamed_max, stats=stats)
            stats.device_buffer_bytes = n_bufs * streamed_max
        else:
            self.stage = CpuStage(ring)
        for u in self.units:
            remember_placeholders(u)
        self.pending: OrderedDict[int, Future[Loaded]] = OrderedDict()
        self.held: dict[int, list] = {}  # unit -> [Loaded, refcount]
        self.resident: dict[int, Loaded] = {}
        self._owned = 0  # ring bytes of slots held by bound and resident units (CPU)
        self._bound_bufs = 0  # device buffers held by bound units (CUDA)
        self._waiting = False
        self._closed = False  # no new units (stop)
        self._released = False  # everything given back (close)
        self._lock = threading.RLock()
        self.loader = Loader(reader, ring, self.stage, stats, device=device, abort=self._deadlock)

    # ---------------------------------------------------------------- loader thread
    def _deadlock(self) -> BaseException | None:
        """While the caller waits: an error if what the loader waits for can never be freed."""
        if not self._waiting:
            return None
        if isinstance(self.stage, CudaStage):
            if self._bound_bufs >= self.stage.n_bufs:
                return RingTooSmallError(
                    f"{self._bound_bufs} units are bound at once but only {self.stage.n_bufs} device buffers exist; "
                    "raise prefetch"
                )
            return None
        if self.ring.used <= self._owned:
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
        """The job's result, owned by the caller from here on; on any exit without it (an error,
        ``KeyboardInterrupt``) the job is given back."""
        self._waiting = True
        try:
            return self.loader.wait(fut)
        except TieredError:
            self.loader.discard(fut)
            raise
        except Exception as e:
            self.loader.discard(fut)
            raise StreamerError(f"loading unit {name!r} failed: {e!r}") from e
        except BaseException:
            self.loader.discard(fut)
            raise
        finally:
            self._waiting = False

    def _take(self, i: int, ld: Loaded) -> None:
        self.held[i] = [ld, 1]
        if ld.slot is not None:
            self._owned += ld.slot.size
        if ld.dev is not None:
            self._bound_bufs += 1
        self.stage.before_compute(ld)
        bind(ld.unit, ld.params)

    def _give_back(self, i: int) -> None:
        ld, _ = self.held.pop(i)
        unbind(ld.unit)
        if ld.slot is not None:
            self._owned -= ld.slot.size
        if ld.dev is not None:
            self._bound_bufs -= 1
        self.stage.release(ld)

    def load_resident(self, *, progress: bool = False) -> None:
        """Load every resident unit once (through the ring) and keep it. Caller thread; blocks.

        ``progress``: a tqdm bar on stderr (bytes read, GB/s, ETA).
        """
        ids = sorted(self.resident_ids)
        futs = [self.loader.submit(self.units[i], resident=True) for i in ids]
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
                if ld.slot is not None:
                    self._owned += ld.slot.size
                self.stage.before_compute(ld)
                bind(ld.unit, ld.params)
                if bar is not None:
                    bar.update(self.units[i].src_bytes)
        finally:
            if bar is not None:
                bar.close()
        if isinstance(self.stage, CudaStage) and futs:
            torch.cuda.synchronize(self.device)

    def acquire(self, i: int) -> None:
        """Bind unit ``i``'s tensors into its modules (pre-hook; caller thread)."""
        with self._lock:
            self._check_open()
            entry = self.held.get(i)
            if entry is not None:  # nested or concurrent use of a bound unit
                entry[1] += 1
                return
            self.order.record(i)
            if i in self.pending:
                self.stats.hits += 1
                for j in list(self.pending):  # queued before i: stale predictions
                    if j == i:
                        break
                    self.loader.discard(self.pending.pop(j))
                fut = self.pending.pop(i)
            else:
                self.stats.misses += 1
                for j in list(self.pending):
                    self.loader.discard(self.pending.pop(j))
                fut = self.loader.submit(self.units[i])
            self._prefetch_after(i)
            t0 = time.perf_counter()
            ld = self._wait(fut, self.units[i].name)
            self.stats.stall_s += time.perf_counter() - t0
            self._take(i, ld)
            self.stats.units_streamed += 1

    def _prefetch_after(self, i: int) -> None:
        for j in self.order.ahead(i, self.prefetch):
            if j in self.pending or j in self.held or j in self.resident_ids:
                continue
            self.pending[j] = self.loader.submit(self.units[j])

    def release(self, i: int, output: object = None) -> object:
        """Unbind unit ``i`` and give its memory back (forward hook; caller thread).

        Returns ``output`` with any tensor that aliases streamed memory replaced by a copy (a module
        returning a view of its own weight), so the caller never sees a refilled buffer.
        """
        with self._lock:
            entry = self.held.get(i)
            if entry is None:
                return output
            if output is not None:
                output = copy_out_aliases(output, self.stage.owns)
            entry[1] -= 1
            if entry[1] <= 0:
                self._give_back(i)
            return output

    def release_all(self) -> None:
        """Give back every bound unit: the end of the model's outermost call (normally a no-op)."""
        with self._lock:
            for i in list(self.held):
                self._give_back(i)

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
        self._released = True
        self.stop()
        self.stage.close()
        got = self._lock.acquire(timeout=10)  # a forward in another thread fails fast once closed
        try:
            for f in self.pending.values():
                self.loader.discard(f)
            self.pending.clear()
            for ld, _ in self.held.values():
                unbind(ld.unit)
            self.held.clear()
            for ld in self.resident.values():
                unbind(ld.unit)
            self.resident.clear()
        finally:
            if got:
                self._lock.release()
