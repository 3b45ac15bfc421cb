"""One call's tensors, bound and unbound in one frame: the guard of row-streamed embeddings and routed experts.

A module whose tensors depend on its inputs (:class:`~tiered.rows.RowGather`: the rows its ids look up;
:class:`~tiered.experts.ExpertGather`: the experts its router picked) binds them for exactly one call.
Forward hooks cannot guarantee the unbinding: torch runs ``always_call`` forward hooks for ``Exception``
only, so a ``KeyboardInterrupt`` inside the forward would leave the call's tensors bound and the module's
lock held, and a call from another thread would wait forever.

:class:`CallGuard` replaces ``module.forward`` (an instance attribute, as accelerate's hooks do) by a wrapper
that takes the module's lock, binds, runs the original forward, and in ``finally`` restores the module and
releases the lock — whatever ends the call, on whichever thread. The wrapper is opaque to dynamo
(``torch.compiler.disable``): a compiled model breaks its graph at the module and runs it eagerly.

Threads: calls of one module from several threads are serialised by its lock. A call of the module from
inside its own forward on the same thread raises :class:`~tiered.errors.StreamerError` (it would deadlock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import StreamerError

__all__ = ["CallGuard", "foreign_forward"]


def foreign_forward(m: nn.Module) -> bool:
    """Whether ``m`` has an instance ``forward`` set by someone else (another library's wrapper, which would see the
    renumbered inputs if tiered bound rows or experts around it); tiered's own guard does not count."""
    f = m.__dict__.get("forward")
    return f is not None and not getattr(f, "_tiered_guard", False)


class CallGuard:
    """Wraps ``module.forward``: lock, ``bind(args, kwargs) -> (args, kwargs)``, forward, ``restore()``, unlock.

    ``lock``: the one that serialises the module's calls (default: a new one). ``run``: what computes the call instead
    of the module's own forward (:class:`~tiered.linear_pieces.LinearPieces`). ``bind`` raises to refuse the
    call (``restore`` undoes whatever it did: it is called in every case once the lock is held).
    :meth:`remove` puts the original ``forward`` back (a handle like the one ``register_forward_hook`` returns).
    """

    def __init__(self, module: nn.Module, bind: Callable[[tuple, dict], tuple[tuple, dict]],
                 restore: Callable[[], None], name: str, lock: threading.Lock | None = None,
                 run: Callable[..., Any] | None = None) -> None:
        self.module = module
        self.name = name
        self.lock = lock if lock is not None else threading.Lock()
        self._owner: int | None = None  # the thread inside the call (for the same-thread re-entry error)
        self._bind = bind
        self._restore = restore
        self._had = "forward" in module.__dict__  # an instance forward already there (another library's wrapper)
        self._orig = module.forward
        self._run = run if run is not None else self._orig  # what computes the call (default: the module's forward)

        @torch.compiler.disable
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(args, kwargs)

        forward._tiered_guard = True  # type: ignore[attr-defined]  # ours: not another library's wrapper
        self._wrapper = forward
        module.forward = forward  # type: ignore[method-assign]

    def _call(self, args: tuple, kwargs: dict) -> Any:
        me = threading.get_ident()
        if self._owner == me:
            raise StreamerError(f"{self.name!r} was called from inside its own forward on the same thread; tiered binds "
                                "its tensors for one call at a time")
        with self.lock:
            self._owner = me
            try:
                args, kwargs = self._bind(args, kwargs)
                return self._run(*args, **kwargs)
            finally:
                self._owner = None
                self._restore()

    def remove(self) -> None:
        """Put the module's own ``forward`` back. Idempotent."""
        if self.module.__dict__.get("forward") is self._wrapper:
            if self._had:
                self.module.forward = self._orig  # type: ignore[method-assign]
            else:
                del self.module.forward
