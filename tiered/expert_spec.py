"""Which experts modules of a unit can be routed, and where each expert's bytes lie in the checkpoint.

:func:`find_experts` finds a unit's experts modules whose parameters can be read one expert at a time
(:class:`ExpertSpec`: per part, the checkpoint sources of each expert's slab). Two kinds are recognized:

* the ``transformers`` classes decorated with ``use_experts_implementation`` (``MixtralExperts``, ...): stacked
  ``(E, ...)`` parameters on the experts module itself, expert ``j`` at ``[j]``;
* Llama 4's ``Llama4TextExperts`` (``transformers.models.llama4.modeling_llama4``, that class exactly): stacked
  ``gate_up_proj`` ``(E, H, 2F)`` and ``down_proj`` ``(E, F, H)``, called with no router ids: its block
  (``Llama4TextMoe``) scales a copy of every token by each expert's router score — ``sigmoid(-inf) = 0`` for the
  experts not picked — and the module runs *every* expert on its ``(E * T, H)`` input (``bmm`` over ``E``). Routed
  as a ``dense`` spec: an expert whose ``T`` input rows are all zero computes zeros whatever its (finite) weights,
  so only the experts with a nonzero input row are read, into a full ``(E, ...)`` tensor whose other slabs are zero;
  the module's own forward then runs the same ``bmm`` on the same shapes (:mod:`tiered.experts`);
* DBRX's ``DbrxExperts`` (``transformers.models.dbrx.modeling_dbrx``, that class exactly): its parameters live on
  its child ``mlp`` (``DbrxExpertGLU``), flat ``(E * F, H)`` matrices ``w1``, ``v1``, ``w2`` (``F`` =
  ``ffn_hidden_size``); expert ``j`` is rows ``[jF, (j + 1)F)`` — its forward views each as ``(-1, F, H)`` and
  takes ``[expert_idx]``, loops over the hit experts in ascending order and reads the expert count from
  ``self.num_experts`` (``one_hot(top_k_index, num_classes=self.num_experts)``), so a compact ``(U * F, H)``
  matrix with ``num_experts = U`` and monotone renumbered ids computes the same products in the same order.

:func:`route_out` lays out what
the unit keeps once they leave it; :func:`expert_pairs` gives the (source, destination) reads of some experts,
merged by :func:`merge_adjacent`; :func:`slot_layout` places one expert's parts in an expert-cache slot. The reading
itself is :mod:`tiered.experts`' (its module docstring tells the whole routing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import quant
from .errors import QuantizationError
from .format import TensorInfo
from .guard import foreign_forward
from .lossless import LosslessInfo, window
from .plan import Target, Unit, lay_out

__all__ = ["ExpertPart", "ExpertSpec", "find_experts", "route_out", "merge_adjacent", "expert_pairs", "slot_layout",
           "top_k_of"]

Dest = Callable[[torch.Tensor], torch.Tensor] | None  # where a source lands inside one expert's slab (None: all of it)


@dataclass(eq=False)
class ExpertPart:
    """One parameter (or buffer) of an experts module holding all its experts: ``per[j]`` = what fills expert ``j``'s
    slab. Its expert axis: ``rows=None``, stacked ``(E, ...)`` (expert ``j`` is ``[j]``); ``rows=F``, flat
    ``(E * F, ...)`` (expert ``j`` is rows ``[jF, (j + 1)F)``: DBRX's, see the module docstring)."""

    target: Target
    per: list[list[tuple[TensorInfo, Dest]]]
    rows: int | None = None

    @property
    def slab_shape(self) -> tuple[int, ...]:
        """One expert's shape: ``shape[1:]`` (stacked) or ``(F, *shape[1:])`` (flat)."""
        rest = tuple(self.target.shape[1:])
        return rest if self.rows is None else (self.rows, *rest)

    def bound(self, t: torch.Tensor) -> torch.Tensor:
        """A compact ``(U, *slab_shape)`` tensor (contiguous) as the module binds it: itself (stacked) or its
        ``(U * F, ...)`` view (flat, the layout the module's forward views as ``(-1, F, ...)``)."""
        return t if self.rows is None else t.view(-1, *self.target.shape[1:])

    @property
    def slab_bytes(self) -> int:
        return math.prod(self.slab_shape) * self.target.dtype.itemsize


@dataclass(eq=False)
class ExpertSpec:
    """An experts module inside ``unit`` whose parameters can be read one expert at a time. ``module`` is the one
    whose call is guarded and whose ``num_experts`` is set per call; ``owner`` holds the parameters (``module``
    itself, or DBRX's ``module.mlp``: the module docstring)."""

    unit: Unit
    module: nn.Module
    name: str
    num_experts: int
    parts: list[ExpertPart] = field(default_factory=list)
    owner: nn.Module | None = None
    dense: bool = False  # Llama 4: every expert runs on zero-scaled input, the picked ones read (module docstring)
    stored: bool = False  # CUDA, float8 codes: the host tier keeps them as stored (tiered.experts.HostExperts)

    def __post_init__(self) -> None:
        if self.owner is None:
            self.owner = self.module

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert takes in the model dtype (all parts)."""
        return sum(p.slab_bytes for p in self.parts)

    @property
    def expert_src_bytes(self) -> int:
        """Bytes of the checkpoint read for one expert (expert 0; float8 codes with their scales)."""
        return sum(getattr(info, "stored_bytes", info.nbytes) for p in self.parts for info, _ in p.per[0])


def _is_experts_module(m: nn.Module) -> bool:
    # an instance forward already set (another library's wrapper) would see the renumbered ids: not routed
    return (isinstance(getattr(m, "num_experts", None), int) and isinstance(getattr(m, "has_gate", None), bool)
            and isinstance(getattr(m, "is_transposed", None), bool) and m.num_experts > 0
            and not foreign_forward(m))


_DBRX = "transformers.models.dbrx.modeling_dbrx"


def _dbrx_owner(m: nn.Module) -> tuple[nn.Module, int] | None:
    """(``m.mlp``, ``F``) when ``m`` is exactly transformers' ``DbrxExperts`` (the forward read for the module
    docstring) with all its parameters on ``mlp`` (``w1``, ``v1``, ``w2``), else None."""
    if type(m).__module__ != _DBRX or type(m).__name__ != "DbrxExperts" or foreign_forward(m) or m._parameters:
        return None
    mlp = m._modules.get("mlp")
    E, F = getattr(m, "num_experts", None), getattr(m, "ffn_hidden_size", None)
    if (mlp is None or type(mlp).__module__ != _DBRX or type(mlp).__name__ != "DbrxExpertGLU" or foreign_forward(mlp)
            or not isinstance(E, int) or not isinstance(F, int) or E <= 0 or F <= 0
            or set(mlp._parameters) != {"w1", "v1", "w2"}
            or any(sub._parameters for sub in m.modules() if sub is not m and sub is not mlp)):
        return None
    return mlp, F


_LLAMA4 = "transformers.models.llama4.modeling_llama4"


def _llama4_dense(m: nn.Module) -> bool:
    """``m`` is exactly transformers' ``Llama4TextExperts`` (the forward read for the module docstring): stacked
    ``gate_up_proj`` ``(E, H, 2F)`` and ``down_proj`` ``(E, F, H)`` on itself, no child holding parameters."""
    if type(m).__module__ != _LLAMA4 or type(m).__name__ != "Llama4TextExperts" or foreign_forward(m):
        return False
    E, H = getattr(m, "num_experts", None), getattr(m, "hidden_size", None)
    gu, dn = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    return (isinstance(E, int) and E > 0 and isinstance(H, int) and set(m._parameters) == {"gate_up_proj", "down_proj"}
            and gu is not None and dn is not None and gu.dim() == 3 and dn.dim() == 3 and gu.shape[0] == E
            and dn.shape[0] == E and gu.shape[1] == H and dn.shape[2] == H
            and not any(sub._parameters or sub._buffers for sub in m.modules() if sub is not m))


def _experts_owner(m: nn.Module) -> tuple[nn.Module, int | None, bool] | None:
    """Where ``m``'s experts lie if it is an experts module tiered can route: (the module holding the parameters,
    ``rows``: None for stacked ``(E, ...)``, ``F`` for flat ``(E * F, ...)``, ``dense``: Llama 4's); None otherwise."""
    if _is_experts_module(m):
        return m, None, False
    if _llama4_dense(m):
        return m, None, True
    found = _dbrx_owner(m)
    return None if found is None else (*found, False)


def _slices(tgt: Target, E: int, converted: set[str],
            rows: int | None = None) -> list[list[tuple[TensorInfo, Dest]]] | None:
    """Per expert, the sources that fill its slab of ``tgt`` (shape ``(E, ...)``; ``rows=F``: ``(E * F, ...)``, one
    whole source tensor); None if not expert-separable."""
    if tgt.key in converted or not tgt.shape or tgt.shape[0] != E * (rows or 1) or not tgt.copies:
        return None
    if any(isinstance(c.decode, quant.CtWeight) for c in tgt.copies):  # compressed-tensors experts: decoded with
        return None  # their layer (the routed reads and device decodes take float8 blocks and MXFP4 only)
    if any(isinstance(c.decode, quant.Mxfp4Block) for c in tgt.copies):  # gpt-oss's packed experts: per expert
        c = tgt.copies[0]
        if len(tgt.copies) != 1 or c.place is not None or rows is not None or len(c.src.shape) != 4 \
                or c.src.shape[0] != E:
            return None
        return [[(quant.mxfp4_slab(c.src, c.decode, j), None)] for j in range(E)]
    slab_shape = tuple(tgt.shape[1:]) if rows is None else (rows, *tgt.shape[1:])
    per_el = math.prod(slab_shape)
    out: list[list[tuple[TensorInfo, Dest]]] = [[] for _ in range(E)]
    full = torch.empty(tgt.shape, dtype=tgt.dtype, device="meta")
    slab = torch.empty(slab_shape, dtype=tgt.dtype, device="meta")
    for c in tgt.copies:
        s = c.src
        if c.place is None:
            if tuple(s.shape) != tuple(tgt.shape):
                return None
            pb = per_el * s.dtype.itemsize
            for j in range(E):
                if c.decode is not None:  # float8 codes: expert j's matrix and its scales (tiered.quant)
                    if rows is not None or len(slab_shape) != 2:
                        return None
                    try:
                        out[j].append((quant.slab(s, c.decode, j), None))
                    except QuantizationError:
                        return None
                    continue
                if isinstance(s, LosslessInfo):  # losslessly coded: expert j's chunks (never shared with another)
                    out[j].append((window(s, j * per_el, (j + 1) * per_el, slab_shape), None))
                    continue
                out[j].append((TensorInfo(f"{s.name}[{j}]", s.dtype, slab_shape, s.file, s.offset + j * pb, pb), None))
            continue
        if rows is not None:
            return None  # a flat part is taken from one whole checkpoint tensor only
        if c.decode is not None:
            s = quant.CodedInfo(s.name, s.dtype, s.shape, s.file, s.offset, s.nbytes, c.decode)
        try:
            v = c.place(full)
        except (RuntimeError, IndexError, TypeError):
            return None
        if v.numel() != s.numel or v.numel() == 0:
            return None
        off = v.storage_offset()
        j = off // per_el if per_el else -1
        end = off + sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True))
        if not (0 <= j < E and end < (j + 1) * per_el):
            return None

        def dest(t: torch.Tensor, place=c.place, E=E) -> torch.Tensor:  # expert j's slab seen as every expert
            return place(t.unsqueeze(0).expand(E, *t.shape))

        try:
            w = dest(slab)
        except (RuntimeError, IndexError, TypeError):
            return None
        if not w.is_contiguous() or w.storage_offset() != off - j * per_el or tuple(w.shape) != tuple(v.shape):
            return None
        out[j].append((s, dest))
    if any(not o for o in out):
        return None
    return out


def top_k_of(config: Any) -> int:
    """Experts per token from a ``transformers`` config: ``num_experts_per_tok`` (Mixtral, Qwen-MoE...), ``moe_topk``,
    or DBRX's ``ffn_config.moe_top_k``; 1 when none is set (for per-token byte figures, never for outputs)."""
    ffn = getattr(config, "ffn_config", None)
    return (getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None)
            or getattr(ffn, "moe_top_k", None) or 1)


def find_experts(unit: Unit) -> list[ExpertSpec]:
    """The experts modules of ``unit`` that can be routed (see the module docstring); [] if none."""
    if unit.module is None:
        return []
    converted = {k for conv in unit.converts for k in conv.targets}
    by_module: dict[int, list[Target]] = {}
    for t in unit.targets:
        by_module.setdefault(id(t.module), []).append(t)
    specs = []
    for name, m in unit.module.named_modules():
        found = _experts_owner(m)
        if found is None or id(found[0]) not in by_module:
            continue
        owner, rows, dense = found
        tgts = by_module[id(owner)]
        if {t.attr for t in tgts if t.is_param} != set(owner._parameters) or len(tgts) == len(unit.targets):
            continue  # every parameter must be a target here, and the unit must keep something
        parts = []
        for t in tgts:
            per = _slices(t, m.num_experts, converted, rows)
            if per is None:
                break
            parts.append(ExpertPart(t, per, rows))
        else:
            specs.append(ExpertSpec(unit, m, f"{unit.name}.{name}" if name else unit.name, m.num_experts, parts,
                                    owner, dense))
    return specs


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def route_out(unit: Unit, specs: list[ExpertSpec], align: int, *, stored: bool = False) -> None:
    """Take the experts' targets out of ``unit`` and lay out what is left (:func:`tiered.plan.lay_out`; ``stored``:
    the plan's :attr:`~tiered.plan.Plan.stored`)."""
    gone = {id(p.target) for s in specs for p in s.parts}
    unit.targets = [t for t in unit.targets if id(t) not in gone]
    lay_out(unit, align, stored=stored)
    for s in specs:
        s.stored = stored and any(getattr(info, "decode", None) is not None
                                  for p in s.parts for info, _ in p.per[0])


def merge_adjacent(pairs: list[tuple[TensorInfo, torch.Tensor]]) -> list[tuple[TensorInfo, torch.Tensor]]:
    """``pairs`` (checkpoint source, destination) in file order, each run of sources that are adjacent in one file
    *and* land adjacent in one destination tensor merged into one pair: the reader copies a pair as one range
    (chunked), so such a run is one request instead of one per tensor. Same bytes to the same places: the copies
    are disjoint, so their order and grouping do not change the result.

    Merged when: same file, the next source starts where the last ends, same source dtype, and the destinations
    are contiguous, of one dtype, in one storage, the next starting where the last ends (Mixtral's ``w1, w3`` of
    one expert written adjacent by ``tiered reshard`` fill the two halves of its ``gate_up_proj`` slab; experts
    ``j, j + 1`` of a stacked tensor when both are routed). Sources adjacent in the file whose destinations are
    not (``w3`` then ``w2``: ``gate_up_proj`` and ``down_proj``) stay separate pairs, read one after the other.
    """
    order = sorted(pairs, key=lambda p: (str(p[0].file), p[0].offset))
    out: list[tuple[TensorInfo, torch.Tensor]] = []
    for info, dest in order:
        if out and getattr(info, "decode", None) is None and getattr(out[-1][0], "decode", None) is None \
                and not isinstance(info, LosslessInfo) and not isinstance(out[-1][0], LosslessInfo):  # coded: by chunks
            last, ld = out[-1]
            if (info.file == last.file and info.offset == last.offset + last.nbytes and info.dtype == last.dtype
                    and info.numel and last.numel and dest.dtype == ld.dtype and dest.device == ld.device
                    and dest.is_contiguous() and ld.is_contiguous()
                    and dest.untyped_storage().data_ptr() == ld.untyped_storage().data_ptr()
                    and dest.storage_offset() == ld.storage_offset() + ld.numel()):
                n = last.numel + info.numel
                merged = TensorInfo(f"{last.name.partition(' .. ')[0]} .. {info.name}", info.dtype, (n,), info.file,
                                    last.offset, last.nbytes + info.nbytes)
                out[-1] = (merged, ld.as_strided((n,), (1,), ld.storage_offset()))
                continue
        out.append((info, dest))
    return out


def expert_pairs(spec: ExpertSpec, todo: list[tuple[int, int]],
                 out: list[torch.Tensor]) -> list[tuple[TensorInfo, torch.Tensor]]:
    """(source, destination) of expert ``j`` into row ``u`` of each part's ``(U, ...)`` tensor in ``out``, for each
    ``(u, j)`` of ``todo``, adjacent reads merged."""
    pairs = []
    for p, t in zip(spec.parts, out, strict=True):
        for u, j in todo:
            for info, dest in p.per[j]:
                pairs.append((info, t[u] if dest is None else dest(t[u])))
    return merge_adjacent(pairs)


def slot_layout(spec: ExpertSpec) -> tuple[list[int], int]:
    """Where each part of one expert sits in an :class:`~tiered.expert_cache.ExpertCache` slot (byte offsets,
    512-aligned) and the bytes the slot needs."""
    offs, at = [], 0
    for p in spec.parts:
        offs.append(at)
        at += _align(p.slab_bytes, 512)
    return offs, at
