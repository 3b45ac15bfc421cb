"""One owner per loaded model: :class:`Handle` holds its ring, reader, streamer, host tier, expert parts and hooks and
releases them in one order on ``close()``; a model dropped without ``close()`` is closed by the reaper thread; and at
interpreter exit every live model is closed (``atexit``) before daemon threads are torn down."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import StreamerError
from .stats import Stats

if TYPE_CHECKING:
    import torch

    from .dist import Dist
    from .expert_cache import ExpertCache
    from .experts import HostExperts
    from .format import Checkpoint
    from .options import Options
    from .placement import Placement
    from .plan import Plan
    from .reader import Reader
    from .ring import Ring
    from .streamer import Streamer

__all__ = ["Handle", "CLOSE_WAIT_S", "on_drop", "live_add", "ensure_atexit", "closed_hook", "unique"]

#: Seconds ``close()`` waits for a forward running in another thread to stop before releasing anyway.
CLOSE_WAIT_S = 30.0


class Handle:
    """What a tiered model owns: ring, reader, streamer, hooks."""

    def __init__(self, module: nn.Module, plan: Plan, ckpt: Checkpoint, opts: Options, device: torch.device) -> None:
        self.module = module
        self.plan = plan
        self.ckpt = ckpt
        self.opts = opts
        self.device = device
        self.stats = Stats()
        self.hooks: list[Any] = []
        self.ring: Ring | None = None
        self.host_ring: Ring | None = None  # the host tier (host_gb)
        self.host_experts: HostExperts | None = None  # the host tier's routed experts (host_gb)
        self.reader: Reader | None = None
        self.streamer: Streamer | None = None
        self.rows: list[Any] = []  # RowGather per row-streamed embedding
        self.experts: list[Any] = []  # ExpertGather per routed experts module
        self.linear: list[Any] = []  # LinearPieces per linear unit computed in pieces (CPU)
        self.head_slots: dict[int, list] = {}  # CPU: the ring slots of a head read in pieces (RingLinearPieces)
        self.expert_staging: Ring | None = None  # CUDA: pinned staging of the routed experts
        self.expert_cache: ExpertCache | None = None  # routed experts kept on the device
        self.closed = False
        self.closed_hooks: list[Any] = []
        self.call_lock = threading.RLock()  # one forward pass at a time (see _TieredMixin.__call__)
        self.depth = 0  # nesting of the model's __call__ in the thread holding call_lock
        self.dist: Dist | None = None
        self.placement: Placement | None = None  # what attach built (tiered.placement.place)

    @property
    def parts(self) -> list[Any]:
        """Everything the model owns that holds no module, in the order it is released — the loader thread first
        (it uses the rest), the device stage (copies read the ring), the readers, then the memory. ``close()``, the
        reaper of a model dropped without it and ``atexit`` all release this one list."""
        s = self.streamer
        return [s.loader if s is not None else None, s.stage if s is not None else None, self.reader, self.ring,
                self.host_ring, self.expert_staging, self.expert_cache, self.host_experts,
                *(rg.shard for rg in self.rows)]  # the row readers' shards (they hold no module)

    def close(self) -> None:
        """Idempotent; callable from any thread. A forward running in another thread is stopped first (its
        next unit raises StreamerError) and its pass ends before hooks and memory go, so it never computes on
        half-released weights; memory a live tensor points into goes with its last reference. Every step is
        idempotent and ``closed`` is set last, so a close() interrupted by Ctrl-C is finished by the next."""
        if self.closed:
            return
        if self.streamer is not None:
            self.streamer.stop()
        got = self.call_lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            if not self.closed_hooks:  # from here on the model and its units refuse to run
                mods = [self.module, *(m for u in self.plan.units for m in (u.module, *(t.module for t in u.targets))),
                        *(eg.spec.module for eg in self.experts)]
                self.closed_hooks = [m.register_forward_pre_hook(_closed) for m in _unique(mods)]
            while self.hooks:
                self.hooks.pop().remove()
            if self.streamer is not None:
                self.streamer.close()
            for part in [*self.rows, *self.experts, *self.linear]:  # later calls of their modules raise StreamerError
                part.close()
            _release_all(self.parts)
            self.closed = True
        finally:
            if got:
                self.call_lock.release()


def _unique(mods: list[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in mods}.values())


def _release_all(parts: list[Any]) -> None:
    """Close every part (each idempotent), in order; one that raises does not leave the rest open: the first error is
    raised once all are closed."""
    first: BaseException | None = None
    for part in parts:
        if part is not None:
            try:
                part.close()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
                first = first or e
    if first is not None:
        raise first


#: Models dropped without close(): a weakref of each module -> the parts to close. The weakref's callback is
#: ``_REAP.put`` itself, a C function, so the garbage collector runs no Python code for a dropped model: a Ctrl-C
#: that lands while it collects cannot be caught in a Python callback and reported as "Exception ignored"
#: (which is what a ``weakref.finalize`` or ``WeakSet`` callback does with it; seen in the test suite).
_PARTS: dict[weakref.ref, tuple[Any, ...]] = {}
_REAP: queue.SimpleQueue[weakref.ref | None] = queue.SimpleQueue()
_REAPER: threading.Thread | None = None
_REAPER_LOCK = threading.Lock()


def _release_each(parts: tuple[Any, ...]) -> None:
    """Close every part, each on its own: one that raises does not leave the others open."""
    for part in parts:
        if part is not None:
            try:
                part.close()
            except BaseException:  # noqa: BLE001 - a dropped model's close has no caller to report to
                pass


def _reap() -> None:
    """The reaper thread: closes dropped models (joining their loader and reader threads, waiting for copies)."""
    while (ref := _REAP.get()) is not None:
        _release_each(_PARTS.pop(ref, ()))
        ref = None


def _start_reaper() -> None:
    global _REAPER
    with _REAPER_LOCK:
        if _REAPER is None or not _REAPER.is_alive():
            _REAPER = threading.Thread(target=_reap, name="tiered-reaper", daemon=True)
            _REAPER.start()


def _on_drop(module: nn.Module, *parts: Any) -> None:
    """Close ``parts`` on the reaper thread once ``module`` is collected (dropped without close())."""
    _PARTS[weakref.ref(module, _REAP.put)] = parts
    _start_reaper()


def _closed(module: nn.Module, args: object) -> None:
    raise StreamerError(f"this tiered {type(module).__name__} is closed (its ring was released): load it again")


_LIVE: dict[int, weakref.ref[Handle]] = {}  # no callback (see _PARTS): dead entries are pruned on each load


def _live_add(h: Handle) -> None:
    for k in [k for k, r in list(_LIVE.items()) if r() is None]:
        _LIVE.pop(k, None)
    _LIVE[id(h)] = weakref.ref(h)


_ATEXIT = False


def _close_all() -> None:
    """atexit: stop every live model's threads before the interpreter finalises.

    A daemon loader thread still inside a torch copy when Python tears down aborts the process
    ("terminate called without an active exception"); daemon threads are still running while
    atexit handlers run, so closing here ends them cleanly.
    """
    for r in list(_LIVE.values()):
        h = r()
        if h is None:
            continue
        try:
            h.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    reaper = _REAPER
    if reaper is not None and reaper.is_alive():  # finish the closes of models dropped before exit
        _REAP.put(None)
        reaper.join(CLOSE_WAIT_S)
    while True:  # what a dead reaper left queued, then models collected from here on: closed in place
        try:
            ref = _REAP.get_nowait()
        except queue.Empty:
            break
        if ref is not None:
            _release_each(_PARTS.pop(ref, ()))


def ensure_atexit() -> None:
    """Register :func:`_close_all` once per process, on first use (import has no side effects)."""
    global _ATEXIT
    if not _ATEXIT:
        atexit.register(_close_all)
        _ATEXIT = True


on_drop = _on_drop
live_add = _live_add
closed_hook = _closed
unique = _unique
