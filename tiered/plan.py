"""The plan: which checkpoint bytes go to which parameter, grouped into units in execution order.

A *unit* is the streaming granule: one block of a layer list (a decoder layer: each child of an
``nn.ModuleList`` of identical layers, or of a hybrid stack mixing layer classes, or of a stack of
one; the rule is :mod:`tiered.units`'), or one other module that owns parameters outside the
block lists (embeddings, final norm, head). Its hook point is that module: everything the
unit holds is used inside that module's ``forward``.

Checkpoint names are mapped onto module names with ``transformers``' own conversion machinery
(``transformers.conversion_mapping.get_model_conversion_mapping`` and
``transformers.core_model_loading.rename_source_key``), so renamed and fused weights (a Mixtral
checkpoint's per-expert ``w1``/``w3`` become one stacked ``experts.gate_up_proj``) load the way
``from_pretrained`` loads them. Stack/concatenate conversions are *placed*: each source span is
copied straight into its slice of the fused tensor inside the ring slot; any other conversion runs
``transformers``' own operation on the source and copies the result (memory: one fused tensor).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import quant
from .chunks import chunk_sources
from .errors import MissingTensorError, QuantizationError, ShapeMismatchError, TruncatedShardError, UnsupportedDtypeError
from .errors import caller_stacklevel as _caller_stacklevel
from .format import Checkpoint, TensorInfo
from .meta import regenerate_param
from .units import find_unit_roots, layer_index, weight_readers

__all__ = ["Copy", "Target", "Unit", "Plan", "build_plan", "lay_out", "find_unit_roots", "layer_index"]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


#: the CPU plan's alignment (bytes): targets there sit at their file offset's residue modulo it (:func:`lay_out`)
CPU_ALIGN = 64


def _file_residue(t: Target, align: int) -> int | None:
    """Where stock's tensor for ``t`` sits modulo ``align`` on the CPU, when ``t`` is one whole stored tensor of its
    own dtype: stock (transformers 5 on the CPU, safetensors) keeps such a tensor in the file's page-aligned memory
    mapping, at its offset in the file. None for a cast, a slice, a decode or several copies (stock allocates those:
    aligned), and for an offset the target's dtype cannot be viewed at (not a multiple of its item size)."""
    if len(t.copies) != 1:
        return None
    c = t.copies[0]
    src = c.src
    if (c.place is not None or c.decode is not None or getattr(src, "coded", None) is not None
            or getattr(src, "stored", 0) or src.dtype != t.dtype or src.nbytes != t.nbytes
            or src.offset % max(1, t.dtype.itemsize)):
        return None
    return src.offset % align


@dataclass
class Copy:
    """Copy checkpoint tensor ``src`` into ``place(target_view)`` (cast to the target dtype), or, with ``decode`` (a
    :class:`tiered.quant.Fp8Block`), decode its codes into it (:func:`tiered.quant.decode_rows`)."""

    src: TensorInfo
    place: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: the whole target
    decode: Any = None  # tiered.quant.Fp8Block: src holds float8 codes, decode.scale their block scales
    # a unit laid out stored (:func:`lay_out`, CUDA): where the codes and the scales lie in its slot (bytes); the
    # device stage decodes them into the target after the H2D copy. None: the reader decodes into the target.
    at: int | None = None
    scale_at: int | None = None

    @property
    def nbytes(self) -> int:
        """Checkpoint bytes this copy reads (the codes and their scales; a losslessly coded tensor's coded bytes)."""
        n = getattr(self.src, "stored", 0) or self.src.nbytes  # tiered.lossless.LosslessInfo.stored
        return n + (self.decode.scale.nbytes if self.decode is not None else 0)


@dataclass
class Convert:
    """A conversion that cannot be placed: run ``transformers``' operations, copy the results."""

    converter: object  # transformers.core_model_loading.WeightConverter
    layer_name: str
    sources: dict[str, list[TensorInfo]]
    targets: list[str]  # model keys filled by this conversion


@dataclass
class Target:
    """One model tensor (parameter or persistent buffer) a unit binds.

    ``offset`` (bytes) is its place inside the unit's layout; ``nbytes = numel * itemsize``.
    """

    key: str
    module: nn.Module
    attr: str
    is_param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    copies: list[Copy] = field(default_factory=list)
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Unit:
    """The streaming granule: the targets bound while ``module`` runs.

    ``nbytes`` is the layout size in bytes (targets at ``align``-byte offsets): what its ring or host-tier slot
    holds and the H2D copy moves; ``src_bytes`` is what is read from disk for it.

    Stored (:func:`lay_out` with ``stored``; CUDA, a unit with decoded copies): the slot holds the plain targets in
    ``[0, coded_at)`` and the codes and scales of the decoded ones in ``[coded_at, nbytes)`` (``Copy.at``,
    ``Copy.scale_at``); the device buffer (``dev_bytes``) holds the plain targets at the same offsets and the decoded
    ones after them (``Target.offset``). Otherwise ``dev_bytes == nbytes`` and both layouts are one.
    """

    index: int
    name: str
    module: nn.Module
    targets: list[Target]
    converts: list[Convert] = field(default_factory=list)
    nbytes: int = 0
    src_bytes: int = 0
    readers: list[nn.Module] = field(default_factory=list)  # modules that read its weights past its call (units.py)
    coded_at: int | None = None  # stored: where the codes begin in the slot (None: not stored)
    dev_nbytes: int = 0  # stored: the device layout's bytes

    @property
    def dev_bytes(self) -> int:
        """Bytes of the unit's device buffer (its decoded layout)."""
        return self.dev_nbytes if self.coded_at is not None else self.nbytes

    @property
    def buf_bytes(self) -> int:
        """Bytes of a pool device buffer that streams this unit: its decoded layout, and for a stored unit its stored
        region after it (the H2D copy's staging, :meth:`tiered.stage.CudaStage.put`: reused in the buffer's own
        order, so no other staging memory)."""
        return self.dev_bytes + (_align(self.stored_bytes, 512) if self.coded_at is not None else 0)

    @property
    def stored_bytes(self) -> int:
        """Stored: the codes and scales the device stage decodes (the slot's ``[coded_at, nbytes)``); else 0."""
        return self.nbytes - self.coded_at if self.coded_at is not None else 0


def _refuse_coded_codes(targets: dict[str, Target]) -> None:
    """Quantized codes or scales that are also losslessly coded (:mod:`tiered.lossless`) cannot be read yet: the
    dequantize path reads codes and scales by byte ranges of the file. Refused here, before any read (a plain read of
    a coded blob would be silently wrong numbers).

    Raises:
        CodecError: naming the tensor and its file.
    """
    from .errors import CodecError

    for t in targets.values():
        for c in t.copies:
            if c.decode is None:
                continue
            for info in (c.src, c.decode.scale):
                if getattr(info, "coded", None) is not None:
                    raise CodecError(f"{info.file}: tensor {info.name!r} holds quantized codes or scales that are "
                                     "also losslessly compressed; tiered does not decode both yet: run `tiered reshard "
                                     "SRC DST --decompress` and load DST")


def device_coded(t: Target) -> bool:
    """Whether ``t`` is one whole ``exp3-bf16`` coded tensor (:mod:`tiered.expcode`) copied as it is (no cast, no
    place): a CUDA plan carries its coded bytes to the device and decodes them there (:func:`lay_out`)."""
    from .lossless import EXP3, LosslessInfo

    if len(t.copies) != 1:
        return False
    c = t.copies[0]
    s = c.src
    return (isinstance(s, LosslessInfo) and s.coded is not None and s.coded.codec == EXP3 and s.first == 0
            and s.nbytes == s.coded.nbytes and c.place is None and c.decode is None and s.dtype == t.dtype)


def _file_order(t: Target) -> tuple:
    """A target's place in file order: its first source's file and offset (targets with no source last)."""
    return (0, str(t.copies[0].src.file), t.copies[0].src.offset) if t.copies else (1, "", 0)


def lay_out(u: Unit, align: int, *, stored: bool = False) -> None:
    """Give ``u``'s targets their offsets (``align``-byte aligned, in the order of their sources in the checkpoint's
    files; on the CPU, :data:`CPU_ALIGN`, a whole stored tensor of the target's dtype at its file offset's residue:
    :func:`_file_residue`) and set ``nbytes`` and ``src_bytes``.

    ``stored`` (a CUDA plan: :attr:`Plan.stored`): a unit whose every decoded target (a copy with ``decode``) has
    only decoded copies is laid out *stored* (:class:`Unit`): its slot carries the codes and scales as the
    checkpoint stores them — the ring, the host tier and the H2D copy move those bytes — and the device stage
    decodes them after the copy (:meth:`tiered.stage.CudaStage.put`). Otherwise the reader decodes into the slot.
    Targets that are whole ``exp3-bf16`` tensors (:func:`device_coded`) are decoded targets too: their slot region
    holds the coded chunks as stored, which the reader checks (CRC-32) and :func:`tiered.quant.decode_stored`
    decodes on the GPU (:func:`tiered.expcode.decode_cuda`).
    """
    coded = [t for t in u.targets if any(c.decode is not None for c in t.copies) or (stored and device_coded(t))]
    stored = stored and bool(coded) and not u.converts and all(
        c.decode is not None or device_coded(t) for t in coded for c in t.copies)
    coded_ids = {id(t) for t in coded}
    plain = [t for t in u.targets if id(t) not in coded_ids] if stored else u.targets
    # in file order: tensors that follow each other in a shard then follow each other in the slot, at the same
    # distances where their sizes are multiples of ``align`` — one residue modulo the page, so the reader's O_DIRECT
    # requests land straight in the slot (tiered.reader.slot_shift; issue 23, seventeenth session)
    plain = sorted(plain, key=_file_order)
    off = 0
    for t in plain:
        # CPU: at the residue modulo 64 its bytes have in the file, as stock's mmap'd tensor (slots are page-aligned).
        # Some CPU kernels round differently at other alignments: JetMoe's experts' F.linear gave logits 1.5e-7 off
        # stock's with 64-aligned weights (attack of 2026-12-06)
        r = _file_residue(t, align) if align == CPU_ALIGN else None
        off = off + (r - off) % align if r is not None else _align(off, align)
        t.offset = off
        off += t.nbytes
    for t in u.targets:
        for c in t.copies:
            c.at = c.scale_at = None
    if stored:
        off = u.coded_at = _align(off, align)
        dev = off
        for t in coded:
            dev = _align(dev, align)
            t.offset = dev
            dev += t.nbytes
            for c in t.copies:
                c.at = off = _align(off, align)
                if c.decode is None:  # exp3: the coded chunks
                    off += c.src.stored_bytes
                    continue
                off += c.src.nbytes
                c.scale_at = off = _align(off, align)
                off += c.decode.scale.nbytes
        u.dev_nbytes = _align(dev, align)
    else:
        u.coded_at, u.dev_nbytes = None, 0
    u.nbytes = _align(off, align)
    u.src_bytes = sum(c.nbytes for t in u.targets for c in t.copies) + sum(
        s.nbytes for c in u.converts for ss in c.sources.values() for s in ss)


def same_bytes_key(u: Unit) -> tuple | None:
    """A key equal for two units exactly when their slots hold the same bytes: the same checkpoint bytes, copied whole
    into targets of the same dtypes, shapes and offsets (a tied embedding and head read from one checkpoint tensor).
    None when a conversion or a placed copy makes that undecidable from the plan."""
    if getattr(u, "converts", None) or not getattr(u, "targets", None):  # also a bare stand-in with index/nbytes only
        return None
    parts = []
    for t in u.targets:
        if any(c.place is not None or c.decode is not None for c in t.copies):
            return None
        parts.append((t.offset, str(t.dtype), tuple(t.shape),
                      tuple((str(c.src.file), c.src.offset, c.src.nbytes, str(c.src.dtype)) for c in t.copies)))
    return (u.nbytes, tuple(parts))


def same_bytes(units: list[Unit]) -> dict[int, int]:
    """Unit index -> the index of the first unit of ``units`` (in their order) whose slot holds the same bytes
    (:func:`same_bytes_key`); units with no such earlier twin are not keys."""
    first: dict[tuple, int] = {}
    out: dict[int, int] = {}
    for u in units:
        k = same_bytes_key(u)
        if k is None:
            continue
        if k in first:
            out[u.index] = first[k]
        else:
            first[k] = u.index
    return out


@dataclass
class Plan:
    """Units in predicted execution order, plus checkpoint keys nothing uses.

    ``unused``: checkpoint tensors the model does not need; ``unused_skipped``: those of them torch
    cannot hold (``Checkpoint.skipped``); ``unused_index_missing``: names the index lists, no shard
    holds, and the model does not need; ``dropped``: tensors ``from_pretrained`` reads and drops (an FP8
    checkpoint's ``activation_scale``), not in ``unused``.
    """

    units: list[Unit]
    unused: list[str]
    align: int
    unused_skipped: list[str] = field(default_factory=list)
    unused_index_missing: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # read and dropped by stock too (FP8 activation scales)
    stored: bool = False  # units with decoded copies laid out stored (CUDA: decoded after the H2D copy; lay_out)
    # (target key, source key): tensors stock makes one Parameter (transformers' all_tied_weights_keys, then tensors
    # the model's modules share, e.g. a BERT MLM head's decoder bias); :func:`tie_pairs`
    ties: list[tuple[str, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of every unit's layout (targets at aligned offsets): what streaming them all once moves."""
        return sum(u.nbytes for u in self.units)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's distinct weights in the model dtype: no layout padding, and a tied weight (two
        targets read from one checkpoint tensor, e.g. an embedding and its tied head, each a unit of its own)
        counted once."""
        seen: set = set()
        n = 0
        for u in self.units:
            for t in u.targets:
                key = tuple(sorted((str(c.src.file), c.src.offset, c.src.name) for c in t.copies)) or t.key
                if key not in seen:
                    seen.add(key)
                    n += t.nbytes
        return n

    @property
    def dev_bytes(self) -> int:
        """Bytes of every unit's device layout (decoded; :attr:`Unit.dev_bytes`)."""
        return sum(u.dev_bytes for u in self.units)

    @property
    def max_unit(self) -> Unit:
        return max(self.units, key=lambda u: u.nbytes)


def _conversion_tools(model: nn.Module):
    """(renamings, converters, rename_fn, natural_key) from transformers, or None for plain modules."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - transformers missing or too old
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, rename_source_key, dot_natural_key


def _to_model_name(model: nn.Module, sd: dict[str, torch.Tensor]):
    """A checkpoint name -> the model's name for it under transformers' renamings (identity for a plain module)."""
    tools = _conversion_tools(model)
    if tools is None:
        return lambda n: n
    renamings, converters, rename, _ = tools
    prefix = getattr(model, "base_model_prefix", "") or None
    return lambda n: rename(n, renamings, converters, prefix, sd)[0]


def _place_converter(
    converter, sources: dict[str, list[TensorInfo]], key: str, shape: tuple[int, ...],
    decodes: dict[str, Any] | None = None,
) -> list[Copy] | None:
    """Copies that assemble a stack/concatenate conversion of ``key`` in place. ``decodes``: a source name -> the
    decode of its codes (compressed-tensors experts, :func:`tiered.quant.ct_experts`): the source counts with the
    decoded shape and its copy carries the decode.

    Returns None when the operations are not stack (``MergeModulelist``) then/or concatenate
    (``Concatenate``): those run ``transformers``' own operation at read time instead.

    Raises:
        MissingTensorError: a source pattern has no tensor, or fewer experts than the target stacks.
        ShapeMismatchError: the sources' shapes disagree with each other or with the target's.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    merge = ops.pop(0) if ops and type(ops[0]) is MergeModulelist else None
    cat = ops.pop(0) if ops and type(ops[0]) is Concatenate else None
    if ops or (merge is None and cat is None) or getattr(converter, "quantization_operation", None):
        return None
    pats = list(converter.source_patterns)
    for p in pats:
        if not sources.get(p):
            have = [s.name for ss in sources.values() for s in ss][:3]
            raise MissingTensorError(
                f"{key!r} is assembled from checkpoint tensors matching {p!r}, but there are none (found {have}...); "
                "the checkpoint is incomplete or does not match config.json"
            )
    if merge is not None and len(shape) > merge.dim:
        for p in pats:
            if len(sources[p]) != shape[merge.dim]:
                names = [s.name for s in sources[p]]
                raise MissingTensorError(
                    f"{key!r} stacks {shape[merge.dim]} tensors matching {p!r} but the checkpoint has "
                    f"{len(names)}: {names}; a shard is incomplete or config.json does not match"
                )
    decodes = decodes or {}

    def shp(s: TensorInfo) -> tuple[int, ...]:
        return tuple(decodes[s.name].shape) if s.name in decodes else tuple(s.shape)

    first = sources[pats[0]][0]
    for p in pats:
        for s in sources[p]:
            if merge is not None and shp(s) != shp(sources[p][0]):
                raise ShapeMismatchError(
                    f"{s.file}: tensor {s.name!r} at offset {s.offset} has shape {list(shp(s))} but "
                    f"{sources[p][0].name!r} has {list(shp(sources[p][0]))}; they are stacked into {key!r}"
                )
    pieces: list[tuple[list[TensorInfo], torch.Size]] = []
    for p in pats:
        srcs = sources[p]
        if merge is not None:
            pieces.append((srcs, torch.stack([torch.empty(shp(s), device="meta") for s in srcs], merge.dim).shape))
        else:
            pieces.extend(([s], torch.Size(shp(s))) for s in srcs)
    try:
        if cat is None:
            total = pieces[0][1] if len(pieces) == 1 else None
        else:
            total = torch.cat([torch.empty(ps, device="meta") for _, ps in pieces], cat.dim).shape
    except (RuntimeError, IndexError):
        total = None
    if total is None or tuple(total) != tuple(shape):
        raise ShapeMismatchError(
            f"{first.file}: tensors for {key!r} (first {first.name!r} at offset {first.offset}, shape "
            f"{list(shp(first))}) assemble to {list(total) if total is not None else 'nothing'} but the model built "
            f"from config.json expects {list(shape)}; use the checkpoint's own config.json"
        )
    copies: list[Copy] = []
    off = 0
    for srcs, ps in pieces:
        width = ps[cat.dim] if cat is not None else 0

        def piece(t: torch.Tensor, off=off, width=width) -> torch.Tensor:
            return t.narrow(cat.dim, off, width) if cat is not None else t

        for k, s in enumerate(srcs):
            if merge is not None:
                copies.append(Copy(s, lambda t, piece=piece, k=k, d=merge.dim: piece(t).select(d, k),
                                   decode=decodes.get(s.name)))
            else:
                copies.append(Copy(s, piece, decode=decodes.get(s.name)))
        off += width
    return copies


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str, bool]:
    mod_name, _, attr = key.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        return mod, attr, True
    return mod, attr, False


_Conv = dict[str, tuple[object, dict[str, list[TensorInfo]]]]  # model key -> (its converter, pattern -> sources)


def _match_keys(model: nn.Module, ckpt: Checkpoint, sd: dict[str, torch.Tensor], alias: dict[str, str] | None = None
                ) -> tuple[dict[str, TensorInfo], _Conv, list[str], dict[str, Exception], list[str], list[str]]:
    """Checkpoint names onto the state_dict keys ``sd`` (``transformers``' renamings and converters for a
    ``PreTrainedModel``): ``(direct, conv, unused, unavailable, unused_skipped, unused_missing)``; ``direct``: model
    key -> the one checkpoint tensor it copies; ``unused``: checkpoint tensors nothing uses. ``alias``: a name to match
    -> the checkpoint tensor it stands for (compressed-tensors' packed experts, matched as the weights they decode to:
    :func:`tiered.quant.ct_experts`)."""
    tools = _conversion_tools(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    direct: dict[str, TensorInfo] = {}
    conv: _Conv = {}
    unused: list[str] = []
    # model key -> the error to raise if the model needs it: a tensor torch cannot hold, or one the index
    # names and no shard holds. Unneeded ones are only listed (the loader warns), as from_pretrained ignores them.
    unavailable: dict[str, Exception] = {}
    unused_skipped: list[str] = []
    unused_missing: list[str] = []
    index = f"{ckpt.root}/model.safetensors.index.json"
    odd: list[tuple[str, Exception, list[str]]] = [
        (k, UnsupportedDtypeError(f"{s.file}: tensor {k!r} at offset {s.offset}: {s.reason}, and the model needs "
                                  "it; convert the checkpoint to a dtype torch supports (F16, BF16, F32...)"),
         unused_skipped) for k, s in ckpt.skipped.items()]
    odd += [(k, MissingTensorError(f"{index} names tensor {k!r} but no shard holds it, and the model needs it; "
                                   "a shard is incomplete or the index is stale: re-download the checkpoint"),
             unused_missing) for k in ckpt.index_missing]

    if tools is not None:
        renamings, converters, rename, natural = tools
        for k, why, bucket in odd:
            new, _ = rename(k, renamings, converters, prefix or None, sd)
            if new in sd or k in sd:
                unavailable[new if new in sd else k] = why
            else:
                bucket.append(k)
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        alias = alias or {}
        stands = set(alias.values())
        names = {k: ckpt.tensors[k] for k in ckpt.tensors if k not in stands}
        names.update({a: ckpt.tensors[k] for a, k in alias.items()})
        for k in sorted(names, key=natural):
            new, pat = rename(k, renamings, converters, prefix or None, sd)
            if new not in sd and k in sd:
                new, pat = k, None
            if new not in sd:
                unused.append(names[k].name)
            elif pat is None:
                direct[new] = names[k]
            elif (rows := chunk_sources(by_pattern[pat], new, names[k], sd)) is not None:
                direct.update(rows)  # Chunk(dim=0): each target is a run of the source's rows (tiered/chunks.py)
            else:
                c, srcs = conv.setdefault(new, (deepcopy(by_pattern[pat]), {}))
                srcs.setdefault(pat, []).append(names[k])
    else:  # a plain module: checkpoint names are state_dict names
        for k, info in ckpt.tensors.items():
            if k in sd:
                direct[k] = info
            else:
                unused.append(k)
        for k, why, bucket in odd:
            if k in sd:
                unavailable[k] = why
            else:
                bucket.append(k)
    return direct, conv, unused, unavailable, unused_skipped, unused_missing


def _shared_keys(sd: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """State-dict key -> the other keys (sorted) that name the same tensor object: a parameter or buffer two modules
    share. ``safetensors.torch.save_model`` stores such a group once, under one of its names
    (``_remove_duplicate_names``), and ``load_model`` fills the other names by loading that one into the shared
    tensor; on ``meta`` there is no storage to compare, so sharing is the object's identity (``keep_vars=True``)."""
    groups: dict[int, list[str]] = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    return {k: sorted(o for o in ks if o != k) for ks in groups.values() if len(ks) > 1 for k in ks}


def tie_pairs(model: nn.Module, sd: dict[str, torch.Tensor], declined: Iterable[str] = ()) -> list[tuple[str, str]]:
    """``(target, source)`` model keys that stock holds as one Parameter: ``transformers``' ``all_tied_weights_keys``
    (a head tied to its embedding: from_pretrained ties them when the checkpoint has only one of the two, or both
    ``torch.equal``), then each other key of a tensor the modules share (``sd`` on ``meta``: the object's identity,
    :func:`_shared_keys`) to the first of its group. Keys only: whether a pair is tied at load is
    :meth:`tiered.streamer.Streamer.load_resident`'s check of the bound values.

    A key of ``all_tied_weights_keys`` (either side) or of ``declined`` (targets :func:`_decline_ties` dropped from
    it) takes no part in the identity groups: on ``meta`` those Parameters are one object only because the model
    tied them at init, and stock's loading sets each key's own Parameter and then ties the map's pairs alone. So two
    declined targets stored with equal values (a T5 checkpoint whose encoder and decoder embeddings both differ from
    ``shared.weight``) stay two Parameters, as in stock."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    out = [(t, s) for t, s in tied.items() if t in sd and s in sd]
    skip = set(tied) | set(tied.values()) | set(declined)
    seen = {t for t, _ in out}
    for key, others in _shared_keys(sd).items():
        if key in skip:
            continue
        first = min(k for k in [key, *others] if k not in skip)
        if key != first and key not in seen:
            out.append((key, first))
            seen.add(key)
    return out


def stock_tie_sources(tied: dict[str, str], present: set[str]) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Stock's tie rule at load, on keys: ``PreTrainedModel.tie_weights(missing_keys=...)`` (transformers 5) walks
    ``all_tied_weights_keys`` (``target -> source``) in order; a missing target takes its source; a missing source
    takes its target (the swap); where both are missing, the target takes the first later target of the same source
    that is present; each key so filled counts as present for the pairs after it; where both are present, stock ties
    them only if their values are ``torch.equal`` and otherwise drops the pair from ``all_tied_weights_keys``.
    So a T5 checkpoint holding ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight`` (different values)
    but not ``shared.weight`` gives ``shared`` and ``lm_head`` the encoder's tensor and keeps the decoder's apart.

    Args:
        tied: ``all_tied_weights_keys``, in its order.
        present: keys the checkpoint fills (direct or converted).

    Returns:
        ``(bound, both)``: each tied key the checkpoint lacks -> the present key whose tensor fills it (a key no rule
        reaches is left out: stock leaves it missing); and each pair stock compares, as ``(target, key whose tensor
        fills the target, key whose tensor fills the source)``.
    """
    have = set(present)
    bound: dict[str, str] = {}
    both: list[tuple[str, str, str]] = []
    pairs = list(tied.items())
    for i, (t, s) in enumerate(pairs):
        if t in have and s in have:
            both.append((t, bound.get(t, t), bound.get(s, s)))
        elif t in have:
            bound[s] = bound.get(t, t)
            have.add(s)
        elif s in have:
            bound[t] = bound.get(s, s)
            have.add(t)
        else:
            tb = next((tb for tb, sb in pairs[i + 1:] if sb == s and tb in have), None)
            if tb is not None:
                bound[t] = bound.get(tb, tb)
                have.add(t)
    return bound, both


_COMPARE_CHUNK = 8 << 20  # bytes of each tensor read at a time by _equal_on_disk: bounds its host memory


def _equal_on_disk(a: TensorInfo, b: TensorInfo, dtype: torch.dtype) -> bool:
    """``torch.equal`` of two stored tensors once cast to ``dtype`` (the model's: what stock compares after loading
    both), read in pieces of at most :data:`_COMPARE_CHUNK` bytes each with ``os.pread`` (host memory stays bounded
    for an embedding of any size). Same tensor (file and offset) -> True; shapes differ -> False."""
    if (a.file, a.offset) == (b.file, b.offset) and a.dtype == b.dtype:
        return True
    if tuple(a.shape) != tuple(b.shape):
        return False
    n = a.numel
    step = max(1, _COMPARE_CHUNK // max(a.dtype.itemsize, b.dtype.itemsize, 1))
    fa, fb = os.open(a.file, os.O_RDONLY), os.open(b.file, os.O_RDONLY)
    try:
        for lo in range(0, n, step):
            k = min(step, n - lo)
            xs = []
            for fd, t in ((fa, a), (fb, b)):
                size = k * t.dtype.itemsize
                raw = os.pread(fd, size, t.offset + lo * t.dtype.itemsize)
                if len(raw) != size:
                    raise TruncatedShardError(f"{t.file}: tensor {t.name!r} at offset {t.offset} ends past the end of the "
                                      "file; the file is truncated: download or write it again")
                xs.append(torch.frombuffer(bytearray(raw), dtype=t.dtype).to(dtype))
            if not torch.equal(xs[0], xs[1]):
                return False
    finally:
        os.close(fa)
        os.close(fb)
    return True


def declined_ties(model: nn.Module, sd: dict[str, torch.Tensor], both: list[tuple[str, str, str]],
                  direct: dict[str, TensorInfo]) -> list[str]:
    """Targets of tied pairs whose two stored tensors differ (:func:`stock_tie_sources`' ``both``): stock keeps them
    two Parameters, warns and drops the target from ``all_tied_weights_keys`` (so ``save_pretrained`` writes both),
    and so does this (the caller drops them). A pair filled by a conversion is not compared (kept)."""
    out = []
    for t, vt, vs in both:
        if vt == vs or vt not in direct or vs not in direct:
            continue
        if not _equal_on_disk(direct[vt], direct[vs], sd[t].dtype):
            out.append(t)
    return out


def _decline_ties(model: nn.Module, sd: dict[str, torch.Tensor], direct: dict[str, TensorInfo], conv: _Conv) -> list[str]:
    """Drop from ``model.all_tied_weights_keys`` each tied target whose stored tensor differs from its source's
    (:func:`declined_ties`), with stock's warning, as ``from_pretrained`` does. Returns the dropped targets."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if not tied:
        return []
    _, both = stock_tie_sources(dict(tied), set(direct) | set(conv))
    out = declined_ties(model, sd, both, direct)
    for t in out:
        warnings.warn(f"the checkpoint holds {t!r} and {tied[t]!r}, tied by the config, with different values: they "
                      "are not tied (as transformers' tie_weights does); set tie_word_embeddings=False in config.json "
                      "to silence this", stacklevel=_caller_stacklevel())
        tied.pop(t)
    return out


def _source_key(key: str, stock_ties: dict[str, str], shared: dict[str, list[str]], direct: dict[str, TensorInfo],
                conv: _Conv) -> str | None:
    """The model key whose checkpoint tensor fills ``key``: ``key`` itself; else the key stock's tie rule gives it
    (:func:`stock_tie_sources`: a tied head reads the embedding); else the first key, sorted, that shares its tensor
    object and the checkpoint holds (as ``safetensors.torch.load_model``); None if none."""
    if key in direct or key in conv:
        return key
    if key in stock_ties:
        return stock_ties[key]
    return next((o for o in shared.get(key, ()) if o in direct or o in conv), None)


def _from_config(model: nn.Module, ckpt: Checkpoint) -> bool:
    """A ``transformers`` model next to a ``config.json`` (``tiered.load``'s case): messages name config.json then."""
    root = ckpt.root if ckpt.root.is_dir() else ckpt.root.parent
    return getattr(model, "config", None) is not None and (root / "config.json").is_file()


def _missing_error(model: nn.Module, ckpt: Checkpoint, sd: dict[str, torch.Tensor], missing: list[str]) -> MissingTensorError:
    shown = ", ".join(f"{k!r} (shape {list(sd[k].shape)})" for k in missing[:10])
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    if _from_config(model, ckpt):
        return MissingTensorError(f"{ckpt.root}: no checkpoint tensor for parameter {shown}{more}; the checkpoint does "
                                  "not match config.json: use the checkpoint's own config, or pass the right architecture")
    files = [str(sh.path) for sh in ckpt.shards]
    return MissingTensorError(
        f"{ckpt.root}: {len(missing)} key(s) of {type(model).__name__}'s state_dict have no tensor in {files}: "
        f"{shown}{more}; the checkpoint's names must be the module's state_dict names (a shared parameter may be "
        "stored under any one of its names)")


def _check_source(model: nn.Module, ckpt: Checkpoint, s: TensorInfo, tgt: Target) -> None:
    """A direct copy's source agrees with its target: same shape, both complex or both real."""
    if tuple(s.shape) == tgt.shape and s.dtype.is_complex == tgt.dtype.is_complex:
        return
    cfg = _from_config(model, ckpt)
    built = "the model built from config.json" if cfg else f"the module ({type(model).__name__})"
    fix = ("the config does not match the checkpoint: use the checkpoint's own config.json" if cfg
           else "the checkpoint was not saved from this module")
    if tuple(s.shape) != tgt.shape:
        raise ShapeMismatchError(f"{s.file}: tensor {s.name!r} at offset {s.offset} has shape {list(s.shape)} but "
                                 f"{built} expects {list(tgt.shape)} for {tgt.key!r}; {fix}")
    raise UnsupportedDtypeError(f"{s.file}: tensor {s.name!r} at offset {s.offset} has dtype {s.dtype} but {tgt.key!r} "
                                f"is {tgt.dtype}: complex and real data do not convert; {fix}")


def _make_targets(model: nn.Module, ckpt: Checkpoint, sd: dict[str, torch.Tensor], direct: dict[str, TensorInfo],
                  conv: _Conv, unavailable: dict[str, Exception],
                  coded: dict[str, Any] | None = None,
                  src_decodes: dict[str, Any] | None = None) -> tuple[dict[str, Target], list[tuple[Convert, str]]]:
    """Model key -> its :class:`Target` and copies (a tied or shared weight copies its twin's source:
    :func:`_source_key`), in state_dict order; and each conversion that cannot be placed, with the key it fills.
    ``coded``: model key -> the decode of its packed source in ``direct`` (MXFP4: :func:`tiered.quant.mxfp4_sources`).
    ``src_decodes``: a checkpoint name -> the decode of a conversion's source (:func:`tiered.quant.ct_experts`).

    Raises:
        MissingTensorError: parameters with no source, all of them named (with the files for a plain module).
    """
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    stock_ties, _ = stock_tie_sources(tied, set(direct) | set(conv))
    shared = _shared_keys(sd)
    targets: dict[str, Target] = {}
    converts: list[tuple[Convert, str]] = []
    missing: list[str] = []
    for key, ref in sd.items():
        mod, attr, is_param = _owner(model, key)
        src_key = _source_key(key, stock_ties, shared, direct, conv)
        if not is_param and src_key is None:
            continue  # buffer not in the checkpoint: keep its initialised value
        if key in unavailable and key not in direct:
            raise unavailable[key]
        if src_key is None:
            if not (is_param and regenerate_param(model, key, mod, attr)):  # Marian's sinusoidal positions
                missing.append(key)
            continue
        tgt = Target(key, mod, attr, is_param, tuple(ref.shape), ref.dtype)
        if coded and src_key in coded:  # packed codes whose decode gives the target's shape (tiered.quant)
            tgt.copies.append(Copy(direct[src_key], decode=coded[src_key]))
        elif src_key in direct:
            _check_source(model, ckpt, direct[src_key], tgt)
            tgt.copies.append(Copy(direct[src_key]))
        else:
            converter, srcs = conv[src_key]
            placed = _place_converter(converter, srcs, key, tgt.shape, src_decodes)
            if placed is not None:
                tgt.copies.extend(placed)
            elif src_decodes and any(s.name in src_decodes for ss in srcs.values() for s in ss):
                raise QuantizationError(f"{key!r}: its compressed-tensors expert codes feed a transformers conversion "
                                        f"other than a stack or concatenation ({type(converter).__name__}), which "
                                        f"tiered does not decode. {quant._CT_ADVICE[0].upper()}{quant._CT_ADVICE[1:]}")
            else:
                converts.append((Convert(converter, src_key, srcs, [key]), key))
        targets[key] = tgt
    if missing:
        raise _missing_error(model, ckpt, sd, missing)
    return targets, converts


def _group_units(model: nn.Module, targets: dict[str, Target], converts: list[tuple[Convert, str]], align: int,
                 stored: bool = False) -> list[Unit]:
    """The targets grouped by unit root (:func:`find_unit_roots`), each unit laid out (:func:`lay_out`)."""
    roots = find_unit_roots(model)
    owner_of: dict[int, int] = {}
    for i, (_, mod, direct_only) in enumerate(roots):
        for m in [mod] if direct_only else mod.modules():
            owner_of.setdefault(id(m), i)
    grouped: dict[int, list[Target]] = {}
    for t in targets.values():
        grouped.setdefault(owner_of[id(t.module)], []).append(t)
    units: list[Unit] = []
    claimed: set[str] = set()
    for i, (name, mod, _) in enumerate(roots):
        own = grouped.get(i)
        if not own:
            continue
        claimed.update(t.key for t in own)
        keys = {t.key for t in own}
        u = Unit(len(units), name, mod, own)
        u.converts = [c for c, k in converts if k in keys]
        lay_out(u, align, stored=stored)
        units.append(u)
    rest = [k for k in targets if k not in claimed]
    if rest:  # pragma: no cover - find_unit_roots covers every parameter
        raise MissingTensorError(f"internal: targets without a unit: {rest[:5]}")
    return units


def _decoded_dtype(model: nn.Module, sd: dict[str, torch.Tensor], key: str, dtypes: set[torch.dtype]) -> None:
    """Give parameter ``key`` the dtype its decoded compressed-tensors experts have in stock (its expert decode hands
    back tensors of the scale's dtype, bfloat16 for float8, which replace the parameter at any model dtype).

    Raises:
        QuantizationError: experts of one parameter that would decode to different dtypes."""
    if len(dtypes) != 1:
        raise QuantizationError(f"{key!r}: its compressed-tensors experts decode to {sorted(map(str, dtypes))} (their "
                                "scales' dtypes differ), which tiered does not stack into one tensor (stock promotes "
                                f"them to one dtype). {quant._CT_ADVICE[0].upper()}{quant._CT_ADVICE[1:]}")
    (dt,) = dtypes
    mod, attr, _ = _owner(model, key)
    old = mod._parameters.get(attr)
    if old is not None and old.dtype != dt:
        mod._parameters[attr] = sd[key] = nn.Parameter(torch.empty(old.shape, dtype=dt, device="meta"),
                                                       requires_grad=old.requires_grad)


def build_plan(model: nn.Module, ckpt: Checkpoint, *, align: int = 64, stored: bool = False) -> Plan:
    """Map every checkpoint tensor onto ``model`` (built on ``meta``) and group targets into units.

    Target dtype is the meta parameter's dtype (what ``from_pretrained`` casts to).
    Persistent buffers found in the checkpoint are targets too.

    A quantized checkpoint (``quantization_config``) is checked first, before anything else is matched, and copies of
    float8 codes get their decode (:mod:`tiered.quant`). ``stored`` (CUDA): units with decoded copies carry the stored
    codes and are decoded on the device after the H2D copy (:func:`lay_out`).

    Raises:
        QuantizationError: a quantization method tiered does not decode, or codes it cannot decode exactly.
        MissingTensorError: a parameter has no checkpoint tensor (and is not tied to one that has).
        ShapeMismatchError: a checkpoint tensor's shape differs from the parameter's.
    """
    where = f"{ckpt.root}/config.json"
    qc = quant.config_of(model, ckpt.root)
    quant.check_config(qc, where)
    sd = model.state_dict(keep_vars=True)
    alias = quant.ct_expert_alias(qc, ckpt.tensors)  # packed per-expert compressed-tensors codes, as weights
    direct, conv, unused, unavailable, unused_skipped, unused_missing = _match_keys(model, ckpt, sd, alias)
    feeding = {s.name for _, ss in conv.values() for v in ss.values() for s in v}
    expert_decodes, claimed = quant.ct_experts(qc, ckpt.tensors, where, feeding)
    if claimed:
        unused[:] = [n for n in unused if n not in claimed]
    coded = quant.mxfp4_sources(qc, unused, ckpt.tensors, sd, where)  # gpt-oss: <key>_blocks + <key>_scales
    for key, (blocks, _) in coded.items():
        direct[key] = blocks
        # stock's Mxfp4Dequantize hands back a bf16 Parameter that replaces the module's at any dtype: so here too
        mod, attr, _ = _owner(model, key)
        old = mod._parameters[attr]
        if old is not None and old.dtype != torch.bfloat16:
            mod._parameters[attr] = sd[key] = nn.Parameter(torch.empty(old.shape, dtype=torch.bfloat16, device="meta"),
                                                           requires_grad=old.requires_grad)
    ct = quant.ct_sources(qc, model, unused, ckpt.tensors, sd, where, direct, _to_model_name(model, sd))
    for key, (codes, _) in ct.items():
        direct[key] = codes
    coded.update(ct)
    for key, (_, ss) in conv.items():
        srcs = [s for v in ss.values() for s in v]
        names = {s.name for s in srcs} & expert_decodes.keys()
        if names and len(names) != len(srcs):  # some experts coded, some plain (an `ignore` list)
            plain = next(s for s in srcs if s.name not in names)
            raise QuantizationError(
                f"{plain.file}: tensor {plain.name!r} at offset {plain.offset} is a plain expert matrix stacked into "
                f"{key!r} with compressed-tensors experts; stock cannot load that mix either (it leaves the stacked "
                f"tensor uninitialised or pairs experts with the wrong scales). {quant._CT_ADVICE[0].upper()}"
                f"{quant._CT_ADVICE[1:]}")
        if names:
            _decoded_dtype(model, sd, key, {quant.ct_expert_dtype(expert_decodes[n]) for n in names})
    targets, converts = _make_targets(model, ckpt, sd, direct, conv, unavailable,
                                      {k: d for k, (_, d) in coded.items()}, expert_decodes)
    quant.ct_forward(model, ct)
    dropped = quant.attach_decodes(targets, converts, unused, ckpt.tensors, qc, where)
    _refuse_coded_codes(targets)
    units = _group_units(model, targets, converts, align, stored)
    declined = _decline_ties(model, sd, direct, conv)
    weight_readers(model, units)  # modules that read a unit's weights outside its call: bound for theirs too
    return Plan(units=units, unused=unused, align=align, unused_skipped=unused_skipped, unused_index_missing=unused_missing,
                dropped=dropped, stored=stored, ties=tie_pairs(model, sd, declined))

