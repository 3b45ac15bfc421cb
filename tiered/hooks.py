"""What a tiered model adds to its class (:class:`TieredMixin`: ``device``, ``close()``, one forward at a time) and the
forward hooks that bind a streamed unit for the length of a module's call (:func:`unit_hooks`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .errors import StreamedTensorError
from .lifecycle import Handle  # noqa: TC001 - the mixin's annotation is evaluated at run time (get_type_hints)
from .placeholder import is_placeholder
from .streamer import Streamer

__all__ = ["TieredMixin", "wrap_class", "unit_hooks", "allow_one_compile_per_unit"]


class _TieredMixin:
    """Added to the returned model's class: the right ``device``, ``close()``, a context manager, and
    the owner of each forward pass (``__call__``)."""

    _tiered: Handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model, one call at a time: calls from several threads are serialised (each waits for
        the one running), so concurrent use is correct, not parallel — load the model twice for that.
        However the call ends (an exception, ``KeyboardInterrupt``), every unit it bound is given back,
        so the next call starts from a clean ring."""
        h = self._tiered
        with h.call_lock:
            depth = h.depth  # restored, not decremented: right wherever an interrupt lands
            if depth == 0 and h.streamer is not None:
                h.streamer.release_all()  # what an interrupted earlier call may have left
                for lp in h.linear:  # and a piece's ring room (tiered/linear_pieces.py), before any unit waits for room
                    lp.reclaim()
            t0 = time.perf_counter()
            try:
                h.depth = depth + 1
                return super().__call__(*args, **kwargs)
            finally:
                h.depth = depth
                if depth == 0 and h.streamer is not None:
                    h.streamer.release_all()
                    h.stats.add_pass(time.perf_counter() - t0)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers``' ``generate``; distributed (several ranks), ``synced_gpus`` defaults to True: a
        rank whose sequences are done keeps running passes until every rank is, so that the ranks'
        all-gathers stay matched (as transformers does for DeepSpeed ZeRO-3)."""
        if self._tiered.dist is not None:
            kwargs.setdefault("synced_gpus", True)
        return super().generate(*args, **kwargs)  # type: ignore[misc]

    @property
    def device(self) -> torch.device:
        return self._tiered.device

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``.to``, ``.half``, ``.float``, ``.cpu``, ``.cuda``...), as stock, except that it is
        refused up front — before any tensor changes — when it would change a streamed tensor's dtype or device: tiered
        binds the checkpoint's bytes at the dtype and device the model was loaded with. Resident tensors and buffers
        convert as stock's do; a conversion that changes no streamed tensor (``model.to(model.device)``) passes."""
        kinds = {(t.dtype, t.device) for t in [*self.parameters(), *self.buffers()] if is_placeholder(t)}
        for dtype, dev in kinds:
            probe = fn(torch.empty(0, dtype=dtype, device=dev))
            if isinstance(probe, torch.Tensor) and (probe.dtype, probe.device) != (dtype, dev):
                runs = probe.device.type in ("cpu", "cuda") and probe.dtype.is_floating_point
                fix = (f"load it again with tiered.load(..., dtype={probe.dtype}, device={str(probe.device)!r})" if runs
                       else f"tiered runs on cpu or cuda in a floating-point dtype, not {probe.dtype} on {probe.device}")
                raise StreamedTensorError(
                    f"tiered: this would turn {dtype} on {dev} into {probe.dtype} on {probe.device}; a tiered model runs at "
                    f"the dtype and on the device it was loaded with: {fix}. Nothing was changed.")
        return super()._apply(fn, recurse)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict) -> Any:
        """Refused: the copy would share this model's ring, threads and placeholders."""
        raise StreamedTensorError("tiered: a tiered model cannot be copied (copy.deepcopy): it streams its weights "
                                  "through this model's ring; load the directory again for a second model")

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused (``pickle``, ``torch.save(model)``, ``multiprocessing``): the weights are this model's files and
        ring, not part of the object; without this, pickle fails on the class tiered derives for the model."""
        raise StreamedTensorError(
            "tiered: a tiered model cannot be pickled (pickle, torch.save(model), multiprocessing): its weights stream "
            "from its checkpoint through this process's ring; pass the checkpoint directory instead and tiered.load "
            "it where it is needed")

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """Refused before anything is written: a tiered model's weights are its checkpoint's files."""
        raise StreamedTensorError(
            f"tiered: save_pretrained({str(save_directory)!r}): this model's weights are the files in "
            f"{self._tiered.ckpt.root}, read as it runs; copy that directory (or convert it with `tiered reshard`). "
            "Nothing was written.")

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """Refused before anything changes: the embedding table is read from the checkpoint as the model runs."""
        raise StreamedTensorError(
            "tiered: resize_token_embeddings changes the embedding table, which tiered reads from "
            f"{self._tiered.ckpt.root} as the model runs; resize it with stock transformers, save_pretrained, and load "
            "that directory. Nothing was changed.")

    def close(self) -> None:
        """Release the ring, threads and hooks. The model cannot run afterwards."""
        self._tiered.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLASSES: dict[type, type] = {}


def _wrap_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_TieredMixin, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[cls]


def _allow_one_compile_per_unit(n: int) -> None:
    """Under ``torch.compile`` the graph breaks at each unit's root hooks, so dynamo compiles each decoder layer's
    forward as a frame of its own, specialised on the layer (its ``layer_idx`` indexes the KV cache): one compile
    per layer (and per input shape: a prefill, the decode steps), all of them entries of one code object, which
    passes dynamo's default ``recompile_limit`` (8) on any model deeper than a few layers and sends the later
    layers back to eager with a warning. Raise the limit to 4 per unit (+ 8), never lower it."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    want = 4 * n + 8
    if getattr(cfg, name, want) < want:
        setattr(cfg, name, want)


def _unit_hooks(s: Streamer, i: int, *, root: bool) -> tuple[Any, Any]:
    """(pre, post) forward hooks that bind unit ``i`` for the length of a module's call.

    ``torch.compile`` sees them as opaque: the unit's root module's hooks are ``torch.compiler.disable``d
    (dynamo breaks the graph at the unit and runs them eagerly, so the compiled code in between never
    changes with the streamer's state: no recompiles), and the hooks of modules *inside* the unit — there
    so that calling ``layers[2].mlp`` directly binds its unit — are no-ops while dynamo traces (the root's
    hook has bound the unit by then), so they add no graph break inside a layer.
    """
    if root:
        @torch.compiler.disable
        def pre(m: nn.Module, a: Any) -> None:
            s.acquire(i)

        @torch.compiler.disable
        def post(m: nn.Module, a: Any, o: Any) -> Any:
            return s.release(i, o)

        return pre, post

    def pre_inner(m: nn.Module, a: Any) -> None:
        if not torch.compiler.is_compiling():
            s.acquire(i)

    def post_inner(m: nn.Module, a: Any, o: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return s.release(i, o)

    return pre_inner, post_inner


TieredMixin = _TieredMixin
wrap_class = _wrap_class
unit_hooks = _unit_hooks
allow_one_compile_per_unit = _allow_one_compile_per_unit
