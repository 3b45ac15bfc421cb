"""Binding: put a unit's tensors into its modules for the length of its forward, and take them out.

Parameters of streamed units live on ``meta`` between passes (the placeholders the model was built
with); :func:`bind` swaps in views of a ring slot (CPU) or device buffer (CUDA) and :func:`unbind`
swaps the placeholders back, so nothing keeps pointing at memory that is about to be refilled.

:func:`copy_out_aliases` handles the one way memory could still escape: a module whose forward
*returns* a view of its own weight (a position table returning ``self.weight[:n]``). Such outputs
are copied before the unit's memory is reused, so the caller never sees the next unit's bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .plan import Unit

__all__ = ["remember_placeholders", "bind", "unbind", "copy_out_aliases"]

_PLACEHOLDER = "_tiered_placeholder"


def remember_placeholders(unit: Unit) -> None:
    """Record each target's current (``meta``) tensor: what :func:`unbind` restores."""
    for t in unit.targets:
        store = t.module._parameters if t.is_param else t.module._buffers
        cur = store.get(t.attr)
        if cur is not None and cur.device.type == "meta":
            t.__dict__.setdefault(_PLACEHOLDER, cur)


def bind(unit: Unit, params: dict[str, torch.Tensor]) -> None:
    """Point ``unit``'s module attributes at ``params`` (target key -> tensor)."""
    for t in unit.targets:
        (t.module._parameters if t.is_param else t.module._buffers)[t.attr] = params[t.key]


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
