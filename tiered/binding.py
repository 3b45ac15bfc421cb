"""Binding: put a unit's tensors into its modules for the length of its forward, and take them out.

Parameters of streamed units are :class:`~tiered.placeholder.Placeholder` s between passes (stock's device, dtype,
shape and ``requires_grad``, no storage); :func:`bind` swaps in views of a ring slot (CPU) or device buffer (CUDA),
each taking its placeholder's ``requires_grad`` (as stock's parameter has it; ``model.requires_grad_(False)`` is
followed), and :func:`unbind` swaps the placeholders back, so nothing keeps pointing at memory that is about to be
refilled.

:func:`copy_out_aliases` handles the one way memory could still escape: a module whose forward
*returns* a view of its own weight (a position table returning ``self.weight[:n]``). Such outputs
are copied before the unit's memory is reused, so the caller never sees the next unit's bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import StreamedTensorError
from .placeholder import is_placeholder
from .plan import Unit

__all__ = ["remember_placeholders", "bind", "unbind", "copy_out_aliases", "follow_requires_grad"]

_PLACEHOLDER = "_tiered_placeholder"


def remember_placeholders(unit: Unit) -> None:
    """Record each target's current placeholder (or ``meta`` tensor): what :func:`unbind` restores."""
    for t in unit.targets:
        store = t.module._parameters if t.is_param else t.module._buffers
        cur = store.get(t.attr)
        if is_placeholder(cur):
            t.__dict__.setdefault(_PLACEHOLDER, cur)


def bind(unit: Unit, params: dict[str, torch.Tensor], *, streamed: bool = True) -> None:
    """Point ``unit``'s module attributes at ``params`` (target key -> tensor); a floating parameter takes its
    placeholder's ``requires_grad`` (``streamed``: and refuses a gradient, see :func:`follow_requires_grad`)."""
    for t in unit.targets:
        v = params[t.key]
        ph = t.__dict__.get(_PLACEHOLDER)
        store = t.module._parameters if t.is_param else t.module._buffers
        if ph is not None and store.get(t.attr) is not ph:
            raise StreamedTensorError(
                f"tiered: {t.key!r} is streamed, and its placeholder was replaced (load_state_dict(assign=True), or "
                "an attribute assigned): tiered binds the checkpoint's bytes here, so the new tensor would be dropped "
                "silently; write the weights into a checkpoint and load that, or use stock transformers")
        if t.is_param:
            follow_requires_grad(v, ph, streamed=streamed, key=t.key)
            t.module._parameters[t.attr] = v
        else:
            t.module._buffers[t.attr] = v


def follow_requires_grad(v: torch.Tensor, ph: torch.Tensor | None, *, streamed: bool = True,
                         key: str | None = None) -> torch.Tensor:
    """Give ``v`` (a bound floating parameter, a leaf) the ``requires_grad`` of ``ph`` (its placeholder; stock's
    flag, True unless the user turned it off). Returns ``v``.

    ``streamed`` (bound for one call, then unbound): in grad mode ``v`` also gets a gradient hook that raises
    :class:`~tiered.errors.StreamedTensorError` when ``backward()`` reaches it — the gradient would land on a tensor
    that is gone after the call (stock's parameter would hold it), so a silent nothing is refused."""
    if ph is not None and v.is_floating_point() and v.requires_grad != ph.requires_grad:
        v.requires_grad_(ph.requires_grad)
    if streamed and v.requires_grad and torch.is_grad_enabled():
        name = key or getattr(ph, "tiered_key", "a streamed weight")
        v.register_hook(lambda g: _no_backward(name))
    return v


def _no_backward(key: str) -> None:
    from .errors import StreamedTensorError

    raise StreamedTensorError(
        f"tiered: backward() reached {key!r}, a streamed weight: tiered runs inference only (its weights are bound for "
        "one call, so no gradient can be kept); for gradients, load the model with stock transformers, or call "
        "model.requires_grad_(False) / run under torch.no_grad() for inference")


def unbind(unit: Unit) -> None:
    """Restore ``unit``'s placeholders (idempotent)."""
    for t in unit.targets:
        ph = t.__dict__.get(_PLACEHOLDER)
        if ph is not None:
            (t.module._parameters if t.is_param else t.module._buffers)[t.attr] = ph


def copy_out_aliases(out: object, is_ours: Callable[[torch.Tensor], bool]) -> object:
    """``out`` with every tensor whose storage ``is_ours`` replaced by a copy (tuples, lists, dicts and
    ``ModelOutput``s are walked; a ``ModelOutput`` or dict is updated in place). Returns ``out`` itself
    when nothing aliases (the common case: no allocation)."""
    if isinstance(out, torch.Tensor):
        return out.clone() if is_ours(out) else out
    if isinstance(out, dict):
        for k, v in list(out.items()):
            nv = copy_out_aliases(v, is_ours)
            if nv is not v:
                out[k] = nv
        return out
    if isinstance(out, (tuple, list)):
        new = [copy_out_aliases(v, is_ours) for v in out]
        if all(a is b for a, b in zip(new, out, strict=True)):
            return out
        if isinstance(out, list):
            return new
        return type(out)(*new) if hasattr(out, "_fields") else type(out)(new)
    return out
