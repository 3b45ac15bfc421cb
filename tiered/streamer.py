"""The streamer: keeps ``prefetch`` units ahead of the one running.

Threads and streams:

* **caller** (the thread running ``forward``): :meth:`Streamer.acquire` in a unit's forward
  pre-hook, :meth:`Streamer.release` in its forward hook. On CUDA it never blocks the compute
  stream on the host: it makes the current stream wait on the unit's *ready* event.
* **loader** (one thread, FIFO): allocates a ring slot (waits when the ring is full:
  back-pressure), has the **reader** threads copy the unit's spans into it, then on CUDA takes a
  device buffer from a small pool and issues the H2D copy on a dedicated **copy stream**, after
  the event that says compute is done with that buffer.
* **retire** (one thread, CUDA only): waits for each H2D copy's event, then frees its ring slot.

On CPU the modules use views of the ring slot itself (zero copy); the slot is freed on release.

Order: the first guess is the plan order, cyclic (after the last unit comes the first: the next
decoding step). What actually ran is recorded (unit -> the unit that followed it) and used for
later predictions, so encoder–decoder models, early exits and routing stay correct: a unit asked
for out of order is a *miss*, loaded on demand, and stale prefetches are discarded.

Any exception in a worker thread is re-raised in the caller's ``forward`` (never a hang).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import RingTooSmallError, StreamerError, TieredError
from .plan import Plan, Unit
from .reader import Reader
from .ring import GiB, Ring, Slot, gib_up
from .stats import Stats

__all__ = ["Streamer", "Loaded"]


@dataclass
class _DevBuf:
    t: torch.Tensor  # (nbytes,) uint8 on the device
    free: torch.cuda.Event | None = None  # recorded on the compute stream when compute is done with it


@dataclass
class Loaded:
    """A unit whose bytes are ready (or will be, after ``ready`` on CUDA)."""

    unit: Unit
    params: dict[str, torch.Tensor]  # target key -> view (nn.Parameter for parameters)
    slot: Slot | None = None  # CPU: the ring slot the views live in
    dev: _DevBuf | None = None  # CUDA: the device buffer the views live in
    ready: torch.cuda.Event | None = None


@dataclass
class _Job:
    unit: Unit
    resident: bool = False
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: Loaded | None = None
    error: BaseException | None = None


def _views(unit: Unit, base: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in unit.targets:
        v = base[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)
        out[t.key] = nn.Parameter(v, requires_grad=False) if t.is_param and v.is_floating_point() else v
    return out


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
        self.reader = reader
        self.ring = ring
        self.device = device
        self.cuda = device.type == "cuda"
        self.prefetch = max(0, prefetch)
        self.resident_ids = set(resident)
        self.stats = stats
        self.streamed = [u.index for u in self.units if u.index not in self.resident_ids]
        # learned order: unit -> the unit that ran after it (initially plan order, cyclic)
        self.successor = {a: b for a, b in zip(self.streamed, self.streamed[1:] + self.streamed[:1], strict=False)}
        self.last: int | None = None
        self.pending: OrderedDict[int, _Job] = OrderedDict()
        self.held: dict[int, tuple[Loaded, int]] = {}  # unit -> (loaded, refcount)
        self.resident: dict[int, Loaded] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._caller_waiting = False
        self._lock = threading.Lock()
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._retire_q: queue.Queue[tuple[torch.cuda.Event, torch.cuda.Event, Slot, int] | None] = queue.Queue()
            self._bufs: queue.Queue[_DevBuf] = queue.Queue()
            streamed_max = max((self.units[i].nbytes for i in self.streamed), default=0)
            self.n_bufs = self.prefetch + 1 if self.streamed else 0
            for _ in range(self.n_bufs):
                self._bufs.put(_DevBuf(torch.empty(streamed_max, dtype=torch.uint8, device=device)))
            self.stats.device_buffer_bytes = self.n_bufs * streamed_max
            self._retirer = threading.Thread(target=self._retire_loop, name="tiered-retire", daemon=True)
            self._retirer.start()
        self._loader = threading.Thread(target=self._load_loop, name="tiered-load", daemon=True)
        self._loader.start()

    # ---------------------------------------------------------------- worker threads
    def _abort(self) -> BaseException | None:
        if self._closed:
            return StreamerError("streamer closed")
        if self._caller_waiting:
            try:  # the caller thread does not touch these while it waits; tolerate a race anyway
                held = {id(ld.slot) for ld, _ in list(self.held.values()) if ld.slot is not None}
                live = {id(s) for s in list(self.ring._live)}
            except RuntimeError:
                return None
            if live and live <= held | {id(ld.slot) for ld in self.resident.values()}:
                need = max(u.nbytes for u in self.units)
                return RingTooSmallError(
                    f"the ring ({self.ring.size / GiB:.3f} GiB) is full of units held at once and cannot load the "
                    f"next; pass ring_gb >= {gib_up(2 * need)}"
                )
        return None

    def _load_loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:
                job.done.set()
                continue
            try:
                job.result = self._load(job)
            except BaseException as e:  # noqa: BLE001 - surfaced in the caller
                job.error = e
            with self._lock:  # done and cancelled change together: _discard drops it, or we do
                cancelled = job.cancelled
                job.done.set()
            if cancelled and job.result is not None:
                self._drop(job.result)

    def _load(self, job: _Job) -> Loaded:
        u = job.unit
        slot = self.ring.alloc(u.nbytes, u.name, abort=self._abort)
        try:
            t0 = time.perf_counter()
            self.reader.read_unit(u, slot.view)
            dt = time.perf_counter() - t0
            self.stats.add_read(u.src_bytes, dt)
        except BaseException:
            self.ring.free(slot)
            raise
        if not self.cuda:
            return Loaded(u, _views(u, slot.view), slot=slot)
        if job.resident:
            buf = _DevBuf(torch.empty(u.nbytes, dtype=torch.uint8, device=self.device))
        else:
            buf = self._get_buf()
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            if buf.free is not None:
                self.copy_stream.wait_event(buf.free)
            start.record(self.copy_stream)
            buf.t[: u.nbytes].copy_(slot.view[: u.nbytes], non_blocking=True)
            ready.record(self.copy_stream)
        self._retire_q.put((start, ready, slot, u.nbytes))
        return Loaded(u, _views(u, buf.t), dev=buf, ready=ready)

    def _get_buf(self) -> _DevBuf:
        while True:
            try:
                return self._bufs.get(timeout=0.05)
            except queue.Empty:
                if self._closed:
                    raise StreamerError("streamer closed") from None
                if self._caller_waiting and len(self.held) >= self.n_bufs:
                    raise RingTooSmallError(
                        f"{len(self.held)} units are held at once but only {self.n_bufs} device buffers exist; "
                        "raise prefetch"
                    ) from None

    def _retire_loop(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            item = self._retire_q.get()
            if item is None:
                return
            start, ready, slot, nbytes = item
            ready.synchronize()  # releases the GIL
            self.ring.free(slot)
            self.stats.add_h2d(nbytes, start.elapsed_time(ready) / 1e3)

    # ---------------------------------------------------------------- caller thread
    def _submit(self, i: int, *, resident: bool = False) -> _Job:
        job = _Job(self.units[i], resident=resident)
        self._jobs.put(job)
        return job

    def _drop(self, ld: Loaded) -> None:
        """Give back what a loaded-but-unused unit holds."""
        if ld.slot is not None:
            self.ring.free(ld.slot)
        if ld.dev is not None:
            ld.dev.free = ld.ready
            self._bufs.put(ld.dev)

    def _discard(self, job: _Job) -> None:
        with self._lock:
            job.cancelled = True
            finished = job.done.is_set()
        if finished and job.result is not None:
            self._drop(job.result)

    def _wait(self, job: _Job) -> Loaded:
        self._caller_waiting = True
        try:
            while not job.done.wait(timeout=0.1):
                if self._closed:
                    raise StreamerError("streamer closed")
                if not self._loader.is_alive():
                    raise StreamerError("the tiered loader thread died")
        finally:
            self._caller_waiting = False
        if job.error is not None:
            if isinstance(job.error, TieredError):
                raise job.error
            raise StreamerError(f"loading unit {job.unit.name!r} failed: {job.error!r}") from job.error
        assert job.result is not None
        return job.result

    def load_resident(self, *, progress: bool = False) -> None:
        """Load every resident unit once (through the ring) and keep it. Caller thread; blocks.

        ``progress``: a tqdm bar on stderr (bytes read, GB/s, ETA).
        """
        jobs = [self._submit(i, resident=True) for i in sorted(self.resident_ids)]
        bar = None
        if progress and jobs:
            from tqdm import tqdm

            total = sum(job.unit.src_bytes for job in jobs)
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="tiered: loading resident units",
                       leave=False, dynamic_ncols=True)
        for job in jobs:
            ld = self._wait(job)
            if bar is not None:
                bar.update(job.unit.src_bytes)
            self.resident[job.unit.index] = ld
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(ld.ready)
            _bind(job.unit, ld.params)
        if self.cuda and jobs:
            torch.cuda.synchronize(self.device)
        if bar is not None:
            bar.close()

    def acquire(self, i: int) -> None:
        """Bind unit ``i``'s tensors into its modules (pre-hook; caller thread)."""
        if i in self.held:
            ld, n = self.held[i]
            self.held[i] = (ld, n + 1)
            return
        if self.last is not None and self.last != i:
            self.successor[self.last] = i
        self.last = i
        if i in self.pending:
            self.stats.hits += 1
            for j in list(self.pending):  # anything queued before i is stale: drop it
                if j == i:
                    break
                self._discard(self.pending.pop(j))
            job = self.pending.pop(i)
        else:
            self.stats.misses += 1
            for j in list(self.pending):
                self._discard(self.pending.pop(j))
            job = self._submit(i)
        self._prefetch_after(i)
        t0 = time.perf_counter()
        ld = self._wait(job)
        self.stats.stall_s += time.perf_counter() - t0
        if ld.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ld.ready)
        _bind(ld.unit, ld.params)
        self.held[i] = (ld, 1)
        self.stats.units_streamed += 1

    def _prefetch_after(self, i: int) -> None:
        j = i
        for _ in range(self.prefetch):
            j = self.successor.get(j, j)
            if j == i:
                break
            if j in self.pending or j in self.held or j in self.resident_ids:
                continue
            self.pending[j] = self._submit(j)

    def release(self, i: int) -> None:
        """Unbind unit ``i`` and give its memory back (forward hook; caller thread)."""
        entry = self.held.get(i)
        if entry is None:
            return
        ld, n = entry
        if n > 1:
            self.held[i] = (ld, n - 1)
            return
        del self.held[i]
        _unbind(ld.unit)
        if ld.dev is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            ld.dev.free = ev
            self._bufs.put(ld.dev)
        elif ld.slot is not None:
            self.ring.free(ld.slot)

    def close(self) -> None:
        """Stop the threads and drop every reference into the ring and device buffers."""
        if self._closed:
            return
        self._closed = True
        for job in self.pending.values():
            job.cancelled = True
        self.pending.clear()
        self._jobs.put(None)
        self._loader.join(timeout=30)
        if self.cuda:
            self._retire_q.put(None)
            self._retirer.join(timeout=30)
        for i in list(self.held):
            _unbind(self.units[i])
        self.held.clear()
        for ld in self.resident.values():
            _unbind(ld.unit)
        self.resident.clear()


_PLACEHOLDER = "_tiered_placeholder"


def _bind(unit: Unit, params: dict[str, torch.Tensor]) -> None:
    for t in unit.targets:
        store = t.module._parameters if t.is_param else t.module._buffers
        cur = store.get(t.attr)
        if cur is not None and cur.device.type == "meta":
            t.__dict__.setdefault(_PLACEHOLDER, cur)
        store[t.attr] = params[t.key]


def _unbind(unit: Unit) -> None:
    for t in unit.targets:
        ph = t.__dict__.get(_PLACEHOLDER)
        if ph is not None:
            (t.module._parameters if t.is_param else t.module._buffers)[t.attr] = ph
