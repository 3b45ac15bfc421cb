"""Unit roots: the modules whose forward a streamed unit is bound for (:func:`find_unit_roots`).

The rule. A *block list* is an ``nn.ModuleList`` or ``nn.Sequential`` whose children are split into units of their
own; each child of a block list that holds parameters is a unit root (its whole subtree, bound for the length of
its own call). A list is a block list when some child holds parameters and either

* it has two or more children, all of one class (the rule since the first plan: a decoder stack of identical
  layers, a ``ModuleList`` of heads), or
* every child that holds parameters is a *block*: a module with a submodule that holds parameters — whatever the
  classes and however many children. This covers the decoder stacks that mix layer classes (Jamba's Mamba and
  attention layers, Zamba's hybrid layers, Mllama's self- and cross-attention layers, OLMo-hybrid) and stacks of
  one layer, which the first rule left in one unit with the whole model.

Why the second rule asks for blocks. The streamer binds a unit in forward hooks (tiered/hooks.py): on the unit's root
and on every module inside it that owns one of its tensors. A module is therefore a safe unit root when the
parameters it holds are used by calling it (or a module inside it), and unsafe when a parent reads them without a
call (``self.layers[0].weight``, a ``ModuleList`` of ``nn.Linear`` whose ``.weight`` the parent stacks): those
parameters would still be ``meta`` when read. A block runs its submodules in its own forward; a leaf holder of
parameters (``nn.Linear``, ``nn.Embedding``, a bare ``nn.Parameter`` holder) in a list of mixed classes or a list of
one is the shape of weights a parent reads, so such a list stays inside its parent's unit, as before. The first
rule is kept as it was (a same-class list of leaf modules still splits), so no plan of a model that loaded before
changes.

Modules that own parameters directly and hold a block list below them (an embedding on the model, a scale on a
vision tower) are descended into: their direct parameters are a unit hooked on them, each other child is a unit
(or descended into in turn).
"""

from __future__ import annotations

import inspect
import re

from torch import nn

__all__ = ["block_lists", "find_unit_roots", "weight_readers", "layer_index"]


def _holds_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _is_block(m: nn.Module) -> bool:
    """A module that runs submodules holding parameters: its parameters are used through calls (see the module
    docstring)."""
    return any(_holds_params(c) for c in m.children())


def block_lists(model: nn.Module) -> set[int]:
    """ids of the ``nn.ModuleList`` / ``nn.Sequential`` modules of ``model`` whose children are unit roots (the
    module docstring's rule)."""
    out = set()
    for mod in model.modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
            continue
        kids = list(mod.children())
        holders = [k for k in kids if _holds_params(k)]
        if not holders:
            continue
        same_class = len(kids) >= 2 and len({type(k) for k in kids}) == 1 and _holds_params(kids[0])
        if same_class or all(_is_block(k) for k in holders):
            out.add(id(mod))
    return out


def find_unit_roots(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """Unit hook points ``(name, module, direct_only)`` in module-registration (DFS) order: the initial guess at
    execution order (tiered/order.py learns the real one).

    A module is descended into when its subtree contains a block list (:func:`block_lists`); each child of a block
    list is a unit; any other module owning parameters or buffers is one unit. Parameters owned directly by an
    ancestor of a block list are a unit hooked on that ancestor (``direct_only``: only its own tensors).
    """
    rep = block_lists(model)
    holds_rep: set[int] = set()

    def mark(mod: nn.Module) -> bool:
        found = id(mod) in rep
        for c in mod.children():
            found = mark(c) or found
        if found:
            holds_rep.add(id(mod))
        return found

    mark(model)
    roots: list[tuple[str, nn.Module, bool]] = []

    def visit(name: str, mod: nn.Module) -> None:
        if id(mod) in rep:
            for cname, c in mod.named_children():
                roots.append((f"{name}.{cname}" if name else cname, c, False))
            return
        if id(mod) in holds_rep:
            if mod._parameters or mod._buffers:
                roots.append((name or "<root>", mod, True))
            for cname, c in mod.named_children():
                visit(f"{name}.{cname}" if name else cname, c)
            return
        if any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
            roots.append((name or "<root>", mod, False))

    visit("", model)
    return roots


#: ``self.<path>.weight`` / ``.bias`` used as a value, or ``self.<path>._forward(`` (a call past the module's hooks),
#: in a module's ``forward`` source; metadata reads (``.weight.device``, ``.dtype``, ``.shape``...) do not count.
_META = r"(?:device|dtype|shape|size|ndim|dim|numel|stride|new_\w+|requires_grad|is_\w+)\b"
_READ = re.compile(r"self\.((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\.(?:(?:weight|bias)\b(?!\s*\.\s*" + _META
                   + r")(?!\s*\.\s*T\s*\.\s*" + _META + r")(?!\s+is\b)|_forward\s*\()")


def _forward_reads(cls: type, cache: dict[type, list[str]]) -> list[str]:
    """Submodule paths whose weights ``cls.forward`` reads as values or calls past their hooks (see :data:`_READ`)."""
    if cls not in cache:
        fn = getattr(cls, "forward", None)
        try:
            src = inspect.getsource(fn) if fn is not None and not cls.__module__.startswith("torch.") else ""
        except (OSError, TypeError):
            src = ""
        cache[cls] = sorted(set(_READ.findall(src)))
    return cache[cls]


def weight_readers(model: nn.Module, units: list) -> None:
    """Set ``unit.readers`` (a list, for every unit): the modules outside ``unit`` whose ``forward`` reads its
    weights as values without calling it (Gemma-4's model takes ``self.language_model.embed_tokens.weight[pad]``;
    ProphetNet's decoder calls ``self.position_embeddings._forward(...)``, past the hooks). The unit is then bound for
    the length of each reader's call too, and is not read by rows or in pieces (those bind only inside its own call).
    The scan reads each class's ``forward`` source once; a read it cannot see raises
    :class:`~tiered.errors.StreamedTensorError` at run time, never a wrong number. Memory: such a unit is held for
    the reader's whole call, beside the unit running; the placement does not count that yet (the ring bound can be
    exceeded by the readers' units, which are small in the models found: embeddings of position and pad rows)."""
    owner: dict[int, int] = {}
    for k, u in enumerate(units):
        u.readers = []
        for t in u.targets:
            owner.setdefault(id(t.module), k)
    inside: dict[int, set[int]] = {k: {id(m) for m in u.module.modules()} for k, u in enumerate(units)}
    cache: dict[type, list[str]] = {}
    for a in model.modules():
        for path in _forward_reads(type(a), cache):
            try:
                m = a.get_submodule(path)
            except AttributeError:
                continue
            k = owner.get(id(m))
            if k is not None and id(a) not in inside[k] and a not in units[k].readers:
                units[k].readers.append(a)


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The layer number in a tensor name (``model.layers.12.mlp`` -> 12), or None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None
