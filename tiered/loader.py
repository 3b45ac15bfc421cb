"""The loader: one thread that turns load jobs into :class:`~tiered.stage.Loaded` units, in FIFO order.

Every job is a :class:`concurrent.futures.Future` with exactly one owner from submission to release:

* the loader thread runs it (``set_running_or_notify_cancel``): allocate a ring slot (back-pressure
  while the ring is full; on CUDA it first retires finished H2D copies), read the unit into it on
  the reader threads, hand the slot to the device stage; any exception — the slot is freed first —
  becomes the future's exception, re-raised in the caller's ``forward``;
* the caller takes the result (``result()``) and from then on owns what it holds;
* or the caller gives the job up with :meth:`Loader.discard`: a job not started yet is cancelled;
  one running or done gets a done-callback that gives its result back (``Future`` runs it exactly
  once, at once if the job is already done) — a stale prefetch can never leak a slot or buffer.

Every job stays in :attr:`Loader.live` (with the thread that owns it) until it is forgotten, so an
owner interrupted between two statements (a ``KeyboardInterrupt`` lands between any two bytecodes)
cannot orphan it: the streamer reconciles ``live`` against what it still holds and gives back the rest.

The thread never dies of a job's error; if it stops (``close()``), jobs still queued are cancelled
and a caller waiting on one gets an error, never a hang.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from torch import nn

from . import faults
from .dist import IoPlan, read_args
from .errors import RingTooSmallError, StreamerError
from .plan import Unit
from .reader import Reader
from .ring import Ring
from .stage import CpuStage, CudaStage, Loaded, views
from .stats import Stats

__all__ = ["Loader", "PIECES_IN_FLIGHT"]

#: Pieces of a unit larger than the ring read at once (their copies queued together on the reader threads).
PIECES_IN_FLIGHT = 2


class Loader:
    """One loader thread feeding ``stage`` from ``reader`` through ``ring``.

    Args:
        abort: polled while the loader waits for room (ring slot or device buffer); returns the
            exception to fail the job with (closed, or a deadlock the caller can never resolve).
    """

    def __init__(
        self,
        reader: Reader,
        ring: Ring,
        stage: CpuStage | CudaStage,
        stats: Stats,
        *,
        device: torch.device,
        abort: Callable[[], BaseException | None],
        io: dict[int, IoPlan] | None = None,
        host: dict | None = None,
        mapped: set[int] = frozenset(),  # type: ignore[assignment]
        pieces: dict[int, list[tuple[Unit, int, int]]] | None = None,
        host_pieces: dict[int, list] | None = None,
    ) -> None:
        self.reader = reader
        # CUDA: units larger than the ring, as (piece, offset in the unit's layout, bytes) read one at a time
        self.pieces = pieces or {}
        # the host tier's part of such units: unit index -> Slots of its first pieces (read once, kept; filled by
        # Streamer.load_host before the first pass)
        self.host_pieces = host_pieces if host_pieces is not None else {}
        self.mapped = set(mapped)  # CPU zero copy: units bound as views of the file mapping (no ring, no copy)
        self.io = io or {}  # distributed: how each unit is read on this rank (tiered/dist.py)
        self.host = host if host is not None else {}  # unit index -> its host-tier Slot (read once, kept)
        self.ring = ring
        self.stage = stage
        self.stats = stats
        self.device = device
        self._abort_check = abort
        self._q: queue.Queue[tuple[Future[Loaded], Unit, bool] | None] = queue.Queue()
        self.live: dict[Future[Loaded], int] = {}  # job -> owning thread id, until forgotten
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiered-load", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, unit: Unit, *, resident: bool = False) -> Future[Loaded]:
        """Queue ``unit``; the calling thread owns the job (see :attr:`live`)."""
        fut: Future[Loaded] = Future()
        self.live[fut] = threading.get_ident()
        if self._closed:
            fut.set_exception(StreamerError("the model was closed"))
        else:
            self._q.put((fut, unit, resident))
        return fut

    def discard(self, fut: Future[Loaded]) -> None:
        """Give up a job: cancel it, or give its result back when it finishes (exactly once)."""
        if not fut.cancel():
            fut.add_done_callback(self._give_back)
        self.live.pop(fut, None)

    def forget(self, fut: Future[Loaded]) -> None:
        """The job's result is now held elsewhere (bound to its modules): stop tracking it."""
        self.live.pop(fut, None)

    def _give_back(self, fut: Future[Loaded]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.stage.drop(fut.result())

    def wait(self, fut: Future[Loaded]) -> Loaded:
        """The job's result; polls so a closed model or a dead thread is an error, never a hang."""
        while True:
            try:
                return fut.result(timeout=0.1)
            except FutureTimeout:
                if self._closed:
                    raise StreamerError("the model was closed while waiting for a unit") from None
                if not self._thread.is_alive():
                    raise StreamerError("the tiered loader thread stopped") from None
            except CancelledError:
                raise StreamerError("the load was cancelled (the model was closed)") from None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; jobs still queued are cancelled. Idempotent; callable from any thread."""
        self._closed = True
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._cancel_queued()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    # ------------------------------------------------------------------ loader thread
    def _abort(self) -> BaseException | None:
        if self._closed:
            return StreamerError("the model was closed")
        return self._abort_check()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while True:
                self.stage.retire(block=False)
                item = self._q.get()
                if item is None:
                    return
                fut, unit, resident = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    ld = self._load(unit, resident)
                except BaseException as e:  # noqa: BLE001 - the job's owner re-raises it
                    fut.set_exception(e)
                else:
                    ld.job_ref = weakref.ref(fut)
                    fut.set_result(ld)
                item = fut = unit = ld = None  # hold nothing while idle
        finally:
            self._closed = True
            self._cancel_queued()

    def _map(self, u: Unit, resident: bool) -> Loaded:
        """A mapped unit: views of the checkpoint's file mapping (after the shards' checks), and readahead of
        their pages into the page cache (``MADV_WILLNEED``: asynchronous; RSS grows only when they run)."""
        t0 = time.perf_counter()
        params: dict[str, torch.Tensor] = {}
        ranges = []
        for path in {t.copies[0].src.file for t in u.targets}:
            self.reader.maps[path].check()
        for tgt in u.targets:
            s = tgt.copies[0].src
            faults.hit("read", unit=u.name, tensor=s.name, offset=s.offset)
            m = self.reader.maps[s.file]
            v = m.tensor(s)
            params[tgt.key] = nn.Parameter(v, requires_grad=False) if tgt.is_param and v.is_floating_point() else v
            ranges.append((m, s.offset, s.nbytes))
        for m, off, n in ranges:
            m.willneed(off, n)
        self.stats.add_read(u.src_bytes, time.perf_counter() - t0, resident=resident)
        faults.hit("stage", unit=u.name)
        return Loaded(u, params, mapped=ranges)

    def _load(self, u: Unit, resident: bool) -> Loaded:
        if u.index in self.mapped and not resident:
            return self._map(u, resident)
        io = self.io.get(u.index)
        hs = self.host.get(u.index)
        if hs is not None:  # in the host tier: no disk, no ring; H2D straight from its pinned slot
            faults.hit("stage", unit=u.name)
            return self.stage.stage(u, hs, resident=resident, abort=self._abort, io=io, keep=True)
        if u.index in self.pieces:
            return self._load_pieces(u, resident)
        rd, size, at = read_args(u, io)
        slot = self.ring.alloc(size, u.name, abort=self._abort, reclaim=lambda: self.stage.retire(block=True))
        try:
            t0 = time.perf_counter()
            n = self.reader.read_unit(rd, slot.view[at:] if at else slot.view)
            self.stats.add_read(n, time.perf_counter() - t0, resident=resident)
            faults.hit("stage", unit=u.name)
            return self.stage.stage(u, slot, resident=resident, abort=self._abort, io=io)
        except BaseException:
            self.ring.free(slot)
            raise

    def _load_pieces(self, u: Unit, resident: bool) -> Loaded:
        """CUDA, a unit larger than the ring: each piece (a few whole-element runs of its targets, see
        :func:`tiered.dist.split_unit`) is copied (H2D, copy stream) into its place in one full-size device buffer —
        from the host tier when it holds the piece (its first pieces: no read), else read into a ring slot first.

        Reads are pipelined: the next piece's copies are queued on the reader threads before this one's are waited
        for (:meth:`Reader.start_unit`), so the disk queue never runs dry between pieces (at most
        :data:`PIECES_IN_FLIGHT` pieces read at once; the ring holds those and the pieces whose H2D runs). The unit
        is ready when its last piece's copy is (the copy stream runs in order), so its views are exactly the whole
        unit's: outputs stay bitwise equal."""
        stage = self.stage
        assert isinstance(stage, CudaStage)
        buf = stage.buffer(u.nbytes, resident=resident, abort=self._abort)
        held = self.host_pieces.get(u.index, []) if not resident else []
        ready = None
        reading: collections.deque = collections.deque()  # (slot, jobs, at, n, piece, t0), oldest first
        done_at = [0.0]  # when the last piece's reads finished: read time is counted once where pieces overlap

        def put_oldest() -> torch.cuda.Event:
            slot, jobs, at, n, piece, t0 = reading[0]
            self.reader.finish(jobs)  # raises the first copy's error once all are done; the slot is freed below
            reading.popleft()
            try:
                ev = stage.put(buf, slot, at, n)
            except BaseException:
                self.ring.free(slot)
                raise
            now = time.perf_counter()
            self.stats.add_read(piece.src_bytes, now - max(t0, done_at[0]), resident=resident)
            done_at[0] = now
            return ev

        try:
            for k, (piece, at, n) in enumerate(self.pieces[u.index]):
                if k < len(held):  # in the host tier: H2D straight from its pinned slot
                    ready = stage.put(buf, held[k], at, n, keep=True)
                    continue
                slot = None
                while slot is None and reading:  # room without waiting: the slots being read are not retired
                    stage.retire(block=False)
                    try:
                        slot = self.ring.alloc(piece.nbytes, u.name, wait=False)
                    except RingTooSmallError:
                        ready = put_oldest()
                if slot is None:
                    slot = self.ring.alloc(piece.nbytes, u.name, abort=self._abort,
                                           reclaim=lambda: stage.retire(block=True))
                try:
                    t0 = time.perf_counter()
                    jobs = self.reader.start_unit(piece, slot.view)
                except BaseException:
                    self.ring.free(slot)
                    raise
                reading.append((slot, jobs, at, n, piece, t0))
                if len(reading) > PIECES_IN_FLIGHT - 1:
                    ready = put_oldest()
            while reading:
                ready = put_oldest()
            faults.hit("stage", unit=u.name)
        except BaseException:
            while reading:  # never free a slot a copy still writes into
                slot, jobs = reading.popleft()[:2]
                self.reader.cancel(jobs)
                self.ring.free(slot)
            if not resident:
                stage.give_back(buf, ready)
            raise
        return Loaded(u, views(u, buf.t), dev=None if resident else buf, ready=ready, base=buf.t)
