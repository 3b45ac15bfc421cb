"""The loader: one thread that turns load jobs into :class:`~tiered.stage.Loaded` units, in FIFO order.

Every job is a :class:`concurrent.futures.Future` with exactly one owner from submission to release:

* the loader thread runs it (``set_running_or_notify_cancel``) through the unit's source (:mod:`tiered.sources`;
  by default: allocate a ring slot — back-pressure while the ring is full; on CUDA it first retires finished H2D
  copies — read the unit into it on the reader threads, hand the slot to the device stage); any exception — the
  slot is freed first —
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

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .dist import IoPlan
from .errors import StreamerError
from .plan import Unit
from .reader import Reader
from .ring import Ring
from .sources import HOST, MAPPED, PIECES, PIECES_IN_FLIGHT, RING, MappedSource, Source
from .stage import CpuStage, CudaStage, Loaded
from .stats import Stats

__all__ = ["Loader", "PIECES_IN_FLIGHT"]



class Discarded(StreamerError):
    """A load job given up by its owner while it waited for room (:meth:`Loader.abort`); nobody waits on it."""


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
        host_ids: set[int] = frozenset(),  # type: ignore[assignment]
        reserve_mapped: bool = False,
    ) -> None:
        self.reader = reader
        # CPU: mapped units share the ring with units copied into it and no room was set aside for them once
        # (Streamer._mapped_room), so each holds ring room of its size while it is loaded (tiered.sources.MappedSource)
        self.reserve_mapped = reserve_mapped
        # CUDA: units larger than the ring, as (piece, offset in the unit's layout, bytes) read one at a time
        self.pieces = pieces or {}
        # the host tier's part of such units: unit index -> Slots of its first pieces (read once, kept; filled by
        # Streamer.load_host before the first pass)
        self.host_pieces = host_pieces if host_pieces is not None else {}
        self.io = io or {}  # distributed: how each unit is read on this rank (tiered/dist.py)
        self.host = host if host is not None else {}  # unit index -> its host-tier Slot (read once, kept)
        self.ring = ring
        self.stage = stage
        self.stats = stats
        self.device = device
        self._abort_check = abort
        # unit index -> its slot shift (tiered.sources._shift; fixed by the plan, computed on a unit's first ring read)
        self.shifts: dict[int | tuple[int, int], int] = {}
        # where each unit's bytes come from (tiered/sources.py): one lookup, the ring by default
        self.sources: dict[int, Source] = {**{i: MAPPED for i in mapped}, **{i: HOST for i in host_ids},
                                           **{i: PIECES for i in self.pieces}}
        self._q: queue.Queue[tuple[Future[Loaded], Unit, bool] | None] = queue.Queue()
        self.live: dict[Future[Loaded], int] = {}  # job -> owning thread id, until forgotten
        self._current: Future[Loaded] | None = None  # the job the loader thread runs now
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

    @property
    def mapped(self) -> set[int]:
        """CPU zero copy: the units bound as views of the file mapping (no ring, no copy)."""
        return {i for i, src in self.sources.items() if isinstance(src, MappedSource)}

    # ------------------------------------------------------------------ loader thread
    def abort(self) -> BaseException | None:
        """Polled while a source waits for room: the error to fail the job with (closed; a deadlock), or None.

        A job discarded while it waits (a stale prefetch: its owner gave it up) fails at once with
        :class:`Discarded`, so that the job queued behind it — often the miss that discarded it — is not kept
        waiting for room the discarded job would only give back."""
        if self._closed:
            return StreamerError("the model was closed")
        cur = self._current
        if cur is not None and cur not in self.live:
            return Discarded("a prefetch given up while it waited for room")
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
                self._current = fut
                try:
                    ld = self._load(unit, resident)
                except BaseException as e:  # noqa: BLE001 - the job's owner re-raises it
                    fut.set_exception(e)
                else:
                    ld.job_ref = weakref.ref(fut)
                    fut.set_result(ld)
                self._current = None
                item = fut = unit = ld = None  # hold nothing while idle
        finally:
            self._closed = True
            self._cancel_queued()

    def _load(self, u: Unit, resident: bool) -> Loaded:
        return self.sources.get(u.index, RING).load(self, u, resident)
