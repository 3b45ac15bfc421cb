"""Routed experts: a streamed mixture-of-experts block reads only the experts its router picked.

``transformers`` >= 5 keeps a MoE block's experts in one module (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts``, ... — the classes decorated with
``transformers.integrations.moe.use_experts_implementation``) whose parameters are stacked, shape
``(E, ...)`` (``gate_up_proj`` ``(E, 2I, D)``, ``down_proj`` ``(E, D, I)``, biases ``(E, ...)``), and which the
block calls as ``experts(hidden_states, top_k_index, top_k_weights)`` *after* its router has run. When the
model does not fit (the ring on the CPU, the GPU budget on CUDA), those parameters leave their decoder
layer's ring unit, and on each call of the experts module (its ``forward`` is wrapped by
:class:`~tiered.guard.CallGuard`), before its own forward,

1. moves ``top_k_index`` (``(tokens, k)``, int64) to the host — the one sync, the router's ids — and takes
   its ``U`` distinct experts, sorted;
2. reads only those experts' bytes from the checkpoint — from a stacked tensor (expert ``j`` is the byte
   range ``[j * per, (j + 1) * per)``) or from per-expert tensors (a Mixtral checkpoint's
   ``experts.j.w1/w3/w2``, placed the way ``transformers``' own conversion places them) — on the reader
   threads, with the model's ``io`` backend, cast like the rest of the unit, into compact tensors of shape
   ``(U, ...)``: on the CPU straight into them; on CUDA through a fixed pinned staging buffer
   (:data:`STAGING_BYTES` at most, two halves: one is read into while the other's H2D runs on the compute
   stream) into device tensors;
3. binds the compact tensors as the module's parameters (DBRX's ``DbrxExperts``: as its child ``mlp``'s, flat
   ``(U * F, H)``: :mod:`tiered.expert_spec`), sets ``num_experts = U`` for the call, and
   replaces ``top_k_index`` by each id's rank among the ``U`` (``searchsorted``).

The experts module's own forward (``eager``, ``grouped_mm`` or ``batched_mm``) then runs the same
per-expert products on the same rows in the same order — the remap is monotone, so experts are visited,
grouped and accumulated exactly as with all ``E`` — and outputs are bitwise equal to the whole
module's. Then the ``meta`` placeholders and ``num_experts`` are restored, however the call ended.

Bytes per call: ``U x`` (one expert's bytes); a decode step of batch ``B`` with top-``k`` routing reads at
most ``B x k`` experts per block. Counted in ``Stats.expert_bytes`` (also in ``read_bytes`` and
``streamed_bytes``); ``Stats.experts_read`` counts experts read, ``expert_calls`` the calls.

Memory: the compact tensors live for the call: ``U x`` expert bytes on the device (CUDA) or the host
(CPU; a prefill that routes to every expert holds all of that block's experts for the call). CUDA adds
the pinned staging buffer, allocated once (host RSS).

The host tier (``host_gb`` left after its units): :class:`HostExperts` holds every expert of whole experts modules in
host memory (pinned on CUDA), read once at load; step 2 is then a copy of the routed experts from there (H2D on the
compute stream on CUDA, a memcpy on the CPU; ``Stats.experts_from_host``, ``host_expert_bytes``), with no read
after the router.

Llama 4 (``Llama4TextExperts``, a ``dense`` spec: :mod:`tiered.expert_spec`) is called with no router ids: its block
has scaled a copy of every token by each expert's score, zero for the experts not picked, and the module runs all
``E``. Step 1 is then the experts whose input rows are not all zero (one sync); step 2 reads them into full
``(E, ...)`` tensors whose other slabs are zero; step 3 binds those, ``num_experts`` and the input unchanged. The
module runs stock's ``bmm`` on stock's shapes; an expert not picked multiplies zero input by zero weights instead of
its own, which gives the same zeros for any finite weights (a checkpoint with an inf or NaN weight in an expert not
picked gives NaN in stock and not here: the one difference). Memory per call: every expert's bytes, as when the unit
is read whole; the reads: only the picked experts'.

Not routed (the experts stay in their unit, read whole): a parameter assembled by a conversion that is not
a stack/concatenate placed per expert, a per-expert piece that is not contiguous, or a module without the
``use_experts_implementation`` attributes that is not transformers' ``DbrxExperts`` or ``Llama4TextExperts``.

Threads: the experts are read and bound on the calling thread, inside the module's call; concurrent calls
of one experts module are serialised by its lock, released however the call ends (``KeyboardInterrupt``
included: :class:`~tiered.guard.CallGuard`).

Which experts modules can be routed and where each expert's bytes lie (:func:`find_experts`, :func:`route_out`,
:func:`merge_adjacent`, ...) is :mod:`tiered.expert_spec`'s job; its names are re-exported here. This module reads
and binds the routed experts on each call (:class:`ExpertGather`) and holds the host tier's (:class:`HostExperts`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .binding import follow_requires_grad
from .errors import RingTooSmallError, StreamerError
from .expert_cache import ExpertCache
from .expert_spec import Dest as Dest
from .expert_spec import ExpertPart as ExpertPart
from .expert_spec import ExpertSpec, _align, expert_pairs, find_experts, merge_adjacent, route_out, slot_layout
from .expert_spec import _is_experts_module as _is_experts_module
from .expert_spec import _slices as _slices
from .format import TensorInfo
from .hostmem import page_up
from .lossless import LosslessInfo, window
from .quant import DEVICE_BAND, Fp8Block, Mxfp4Block, decode_mxfp4, decode_rows, rows_of, scale_f32
from .ring import Ring

__all__ = ["ExpertSpec", "find_experts", "route_out", "ExpertGather", "HostExperts", "STAGING_BYTES", "merge_adjacent",
           "MERGE_STAGED_READS", "staged_reads", "read_pairs"]

#: Pinned host staging per model on CUDA (bytes, at most; and at most half the ring): two halves, one read
#: into while the other is copied to the GPU.
STAGING_BYTES = 256 << 20
#: Bytes per reader task when reading experts: small enough that one expert keeps every reader thread busy.
READ_CHUNK = 8 << 20
#: CUDA: read each staging batch in file order, ranges adjacent in a file and in the staging as one request
#: (:func:`staged_reads`). An FP8 expert's three projections lie adjacent in a safetensors file (tensors sorted by
#: name within a dtype) and were read as three requests of 1.5 MB each (Qwen3-30B-A3B shape), where the bf16 twin's
#: read as two of 6 and 3 MB: the suspect of the FP8 twin's cold speed-up falling short of its bytes (1.21-1.63x for
#: 0.50x the bytes; benchmarks/NOTES.md, issue 24). **Off** until measured on the GPU with ``pytest -m cuda`` beside
#: it (the 2026-12-06 session had no device time): ``benchmarks/twins.py`` sets it for an A/B.
MERGE_STAGED_READS = False


def staged_reads(chunks: list, merge: bool) -> list:
    """The chunks of :meth:`ExpertGather._read_cuda` (``(sources, device destination, decode)``) in the order to pack
    them into the staging: file order of their first source when ``merge`` (so that ranges adjacent in a file land
    adjacent in the staging, and :func:`merge_adjacent` can read them as one request), else as given. Pure: a new list.
    """
    if not merge:
        return list(chunks)
    return sorted(chunks, key=lambda c: (str(c[0][0].file), c[0][0].offset))


def read_pairs(pairs: list[tuple[TensorInfo, torch.Tensor]], merge: bool) -> list[tuple[TensorInfo, torch.Tensor]]:
    """``(source, staging view)`` pairs of one staging batch as the reader gets them: with ``merge``, runs adjacent in
    one file and in the staging as one pair (:func:`merge_adjacent`: the same bytes to the same places)."""
    return merge_adjacent(pairs) if merge else pairs


def _files_of(info: TensorInfo) -> tuple:
    """The shard files a read of ``info`` touches: its own, and its block scales' (float8 codes: tiered.quant)."""
    dec = getattr(info, "decode", None)
    return (info.file,) if dec is None else (info.file, dec.scale.file)


def _plain(info: TensorInfo) -> TensorInfo:
    """``info`` as a plain byte range (a :class:`~tiered.quant.CodedInfo` without its decode: read as stored)."""
    return TensorInfo(info.name, info.dtype, tuple(info.shape), info.file, info.offset, info.nbytes)


@dataclass(frozen=True)
class _StoredSource:
    """One source of a stored experts part in the host tier: ``codes`` ``(E, *shape)`` as the checkpoint stores them
    (float8 codes, or a plain tensor in its checkpoint dtype), ``scale`` ``(E, *grid)`` its block scales (None: a plain
    tensor, cast on the device), ``dest`` where it lands in an expert's slab (None: the whole slab)."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    dest: Any


class HostExperts:
    """The host tier's routed experts (``host_gb``). Every expert of each chosen experts module, read once at load,
    cast as the module wants, into host memory (one mapping, page-locked on CUDA, a ``(E, ...)`` region per part,
    page-aligned); a call then copies its routed experts from there — to the GPU (H2D on the compute stream, at the
    pinned rate), or on the CPU into the call's compact tensors (a memcpy) — with no disk, no page cache, no staging
    and no reader thread, instead of reading them.

    Memory: host RSS grows by :meth:`bytes_for` of each module (counted in ``host_gb``), allocated once.

    Args:
        specs: the experts modules it holds (from :func:`find_experts`).
        device: the CUDA device the copies go to.

    Raises:
        MemoryError: the page-lock (``cudaHostRegister``) failed.
    """

    def __init__(self, specs: list[ExpertSpec], device: torch.device) -> None:
        self.specs = specs
        self.device = device
        self.ring = Ring(sum(self.bytes_for(sp) for sp in specs), pin=device.type == "cuda")
        self._parts: dict[str, list[Any]] = {}
        for sp in specs:
            views: list[Any] = []
            for p in sp.parts:
                if sp.stored:  # each source of a slab as stored: (E, *shape) of its dtype, and its scales
                    regions = []
                    for info, dest in p.per[0]:
                        sc = getattr(info, "decode", None)
                        codes = self._region(sp, info.dtype, tuple(info.shape))
                        scale = self._region(sp, sc.scale.dtype, tuple(sc.scale.shape)) if sc is not None else None
                        regions.append(_StoredSource(codes, scale, dest))
                    views.append(regions)
                    continue
                views.append(self._region(sp, p.target.dtype, tuple(p.slab_shape)))
            self._parts[sp.name] = views

    def _region(self, sp: ExpertSpec, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = sp.num_experts * math.prod(shape) * dtype.itemsize
        slot = self.ring.alloc(n, sp.name, wait=False)
        return slot.view[:n].view(dtype).view(sp.num_experts, *shape)

    @staticmethod
    def bytes_for(spec: ExpertSpec) -> int:
        """Pinned bytes one experts module takes: each part's ``E`` slabs in the model dtype, or (``spec.stored``)
        each source's ``E`` codes and scales as stored; every region page-rounded."""
        if not spec.stored:
            return sum(page_up(spec.num_experts * p.slab_bytes) for p in spec.parts)
        n = 0
        for p in spec.parts:
            for info, _ in p.per[0]:
                n += page_up(spec.num_experts * info.nbytes)
                dec = getattr(info, "decode", None)
                if dec is not None:
                    n += page_up(spec.num_experts * dec.scale.nbytes)
        return n

    @staticmethod
    def expert_bytes(spec: ExpertSpec) -> int:
        """Bytes one expert takes in the host tier (what a call copies out of it per expert)."""
        return spec.expert_src_bytes if spec.stored else spec.expert_bytes

    @property
    def nbytes(self) -> int:
        return self.ring.size

    def parts(self, spec: ExpertSpec) -> list[Any] | None:
        """``spec``'s parts in pinned host memory, each ``(E, *slab_shape)`` in the model dtype, or (``spec.stored``)
        a list of :class:`_StoredSource` per part; None when the host tier does not hold that module."""
        return self._parts.get(spec.name)

    def fill(self, reader: Any, stats: Any) -> None:
        """Read every expert of every module once (the reader's threads and backend). Caller thread; blocks.

        Raises:
            ShardChangedError / TruncatedShardError: from the reader (names the file, tensor and offset).
        """
        for sp in self.specs:
            for f in sorted({f for p in sp.parts for per in p.per for info, _ in per for f in _files_of(info)}):
                reader.maps[f].check()  # a shard truncated or rewritten since load: an error, not SIGBUS or new bytes
            t0 = time.perf_counter()
            todo = [(j, j) for j in range(sp.num_experts)]
            if sp.stored:
                pairs = []
                for p, regions in zip(sp.parts, self.parts(sp), strict=True):  # type: ignore[arg-type]
                    for k, r in enumerate(regions):
                        for j in range(sp.num_experts):
                            info = p.per[j][k][0]
                            pairs.append((_plain(info), r.codes[j]))
                            if r.scale is not None:
                                pairs.append((_plain(info.decode.scale), r.scale[j]))
                reader.copy_all(sp.unit, merge_adjacent(pairs), chunk=READ_CHUNK)
            else:
                reader.copy_all(sp.unit, expert_pairs(sp, todo, self.parts(sp)), chunk=READ_CHUNK)
            n = sp.num_experts * sp.expert_src_bytes
            stats.add_read(n, time.perf_counter() - t0, resident=True)
            stats.add_host_experts_loaded(self.bytes_for(sp))

    def close(self) -> None:
        """Wait for the copies out of it, then unpin and unmap (idempotent)."""
        if self.ring.pinned and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ring.close()


class ExpertGather:
    """Reads the routed experts of one experts module on each call (see the module docstring).

    Args:
        spec: from :func:`find_experts` (its targets already taken out of the unit by :func:`route_out`).
        reader: the model's :class:`~tiered.reader.Reader` (its threads, its ``io`` backend, its shards).
        device: where the experts run.
        stats: the model's :class:`~tiered.stats.Stats`.
        staging: CUDA: pinned host memory shared by the model's experts modules (uint8, even length), the
            lock that serialises its use, and the two halves' last H2D events (a list of two, shared too);
            None on the CPU.
        cache: the model's :class:`~tiered.expert_cache.ExpertCache` (None: none), with ``cache_lock`` (shared by
            the model's experts modules) and ``block``, this module's position in the forward order.
    """

    def __init__(self, spec: ExpertSpec, reader: Any, device: torch.device, stats: Any,
                 staging: tuple[torch.Tensor, threading.Lock, list] | None = None, *,
                 cache: ExpertCache | None = None, cache_lock: threading.Lock | None = None, block: int = 0) -> None:
        self.spec = spec
        self.cache = cache
        self.cache_lock = cache_lock or threading.Lock()
        self.block = block
        self.slot_offsets = slot_layout(spec)[0]
        self.reader = reader
        self.device = device
        self.stats = stats
        self.staging = staging
        self.lock = threading.Lock()  # held for each call by its CallGuard
        owner = spec.owner  # where the parameters are bound (DBRX: the experts module's ``mlp``)
        self.placeholders = {p.target.attr: owner._parameters.get(p.target.attr) if p.target.is_param
                             else owner._buffers.get(p.target.attr) for p in spec.parts}
        self.closed = False
        self.host: list[torch.Tensor] | None = None  # the host tier's copy of every expert (HostExperts.parts)
        self._scale_grids: list | None = None  # CUDA, float8 experts: their scales on the device (_grids)
        self.files = sorted({f for p in spec.parts for per in p.per for info, _ in per for f in _files_of(info)})

    # ----------------------------------------------------------------------------------- reading

    def _pairs(self, todo: list[tuple[int, int]], out: list[torch.Tensor]) -> list[tuple[TensorInfo, torch.Tensor]]:
        return expert_pairs(self.spec, todo, out)

    def read(self, ids: list[int], *, full: bool = False) -> list[torch.Tensor]:
        """Experts ``ids`` (sorted, distinct, in range) of every part, as ``(len(ids), ...)`` tensors on the device;
        ``full``: as ``(E, ...)`` tensors, expert ``j`` at ``[j]`` and every other slab zero (a ``dense`` spec).

        Raises:
            ShardChangedError / TruncatedShardError: from the reader (names the file, tensor and offset).
        """
        if self.host is None:
            for f in self.files:
                self.reader.maps[f].check()
        parts = self.spec.parts
        U = len(ids)
        rows = list(ids) if full else list(range(U))  # where expert ids[u] lands
        shape0 = self.spec.num_experts if full else U
        alloc = torch.zeros if full else torch.empty
        out = [alloc((shape0, *p.slab_shape), dtype=p.target.dtype, device=self.device) for p in parts]
        cache = self.cache
        todo = list(zip(rows, ids, strict=True))
        if cache is None:
            self._read_into(todo, out)
        else:
            with self.cache_lock:  # one call at a time across the model's experts modules (they share the slots)
                slots = cache.lookup(self.block, ids)
                for u, s in zip(rows, slots, strict=True):  # hits: device to device, on the current stream
                    if s is not None:
                        for p, off, t in zip(parts, self.slot_offsets, out, strict=True):
                            t[u].copy_(cache.view(s, off, p.slab_shape, p.target.dtype))
                todo = [(u, j) for u, j, s in zip(rows, ids, slots, strict=True) if s is None]
                self.stats.add_expert_cache(U - len(todo), len(todo))
                self._read_into(todo, out)
                keep = {s for s in slots if s is not None}
                for u, j in todo:
                    s = cache.admit(self.block, j, keep)  # a free slot, not yet holding anything
                    if s is not None:
                        keep.add(s)
                        for p, off, t in zip(parts, self.slot_offsets, out, strict=True):
                            cache.view(s, off, p.slab_shape, p.target.dtype).copy_(t[u])
                        cache.commit(self.block, j, s)  # only now can a lookup find it (an interrupt leaves it free)
        if self.host is not None:
            self.stats.add_host_experts(len(todo) * HostExperts.expert_bytes(self.spec), len(todo))
        else:
            per = self.spec.expert_src_bytes
            if self._scale_grids:  # the scales were read once, at first use: a call reads the codes
                per -= sum(info.decode.scale.nbytes for pi, p in enumerate(self.spec.parts)
                           for k, (info, _) in enumerate(p.per[0]) if self._scale_grids[pi][k] is not None)
            self.stats.add_experts(len(todo) * per, len(todo))
        return out

    def _read_into(self, todo: list[tuple[int, int]], out: list[torch.Tensor]) -> None:
        """Read expert ``j`` into row ``u`` of ``out`` for each ``(u, j)`` of ``todo`` (CPU: straight; CUDA:
        through the pinned staging)."""
        if not todo:
            return
        if self.host is not None:  # the host tier: H2D straight from pinned memory, on the current stream
            decoded = 0
            for p, h, t in zip(self.spec.parts, self.host, out, strict=True):
                for u, j in todo:
                    if not isinstance(h, list):
                        t[u].copy_(h[j], non_blocking=True)
                        continue
                    for k, r in enumerate(h):  # stored: the codes and scales over PCIe, decoded on the device
                        dst = t[u] if r.dest is None else r.dest(t[u])
                        codes = r.codes[j].to(self.device, non_blocking=True)
                        if r.scale is None:
                            dst.copy_(codes.view(dst.shape))
                            continue
                        dec = p.per[j][k][0].decode
                        scale = r.scale[j].to(self.device, non_blocking=True)
                        if isinstance(dec, Mxfp4Block):
                            decode_mxfp4(codes[None], scale[None], dst)
                            decoded += dst.numel() * dst.element_size()
                            continue
                        decode_rows(codes.view(-1, codes.shape[-1]), scale_f32(scale), dec.block, dec.row0,
                                    dst.view(-1, codes.shape[-1]) if dst.is_contiguous() else dst)
                        decoded += dst.numel() * dst.element_size()
            if decoded:
                self.stats.add_decoded(decoded)
        elif self.device.type == "cpu":
            self.reader.copy_all(self.spec.unit, self._pairs(todo, out), chunk=READ_CHUNK)
        else:
            self._read_cuda(todo, out)

    def _grids(self) -> list[list[torch.Tensor | None]] | None:
        """CUDA, float8 experts: every expert's block scales on the device, as float32 (``scale_f32``), read once on
        first use: ``[part][source]`` -> ``(E, grid_rows, grid_cols)`` (None: a plain source, or one scale per
        tensor). A call then reads only its experts' codes: the scales are ~1/4096 of the codes' bytes but would be
        one more small read per expert and projection (on a cold disk, a request as slow as the codes'). Device
        memory: ``E`` grids per source (Qwen3-30B-A3B: 128 x 3 x 384 bytes of float32 per layer)."""
        if self._scale_grids is not None or self.device.type != "cuda":
            return self._scale_grids or None
        grids: list[list[torch.Tensor | None]] = []
        any_coded = False
        E = self.spec.num_experts
        for p in self.spec.parts:
            row: list[torch.Tensor | None] = []
            for k, (info0, _) in enumerate(p.per[0]):
                dec = getattr(info0, "decode", None)
                if not isinstance(dec, Fp8Block) or dec.scale.numel == 1 or len(info0.shape) != 2:
                    row.append(None)
                    continue
                host = torch.empty((E, *dec.scale.shape), dtype=dec.scale.dtype)
                pairs = [(_plain(p.per[j][k][0].decode.scale), host[j]) for j in range(E)]
                self.reader.copy_all(self.spec.unit, merge_adjacent(pairs), chunk=READ_CHUNK)
                self.stats.add_read(host.numel() * host.element_size(), 0.0, resident=True)
                row.append(scale_f32(host).to(self.device))
                any_coded = True
            grids.append(row)
        self._scale_grids = grids if any_coded else []
        return self._scale_grids or None

    def _read_cuda(self, todo: list[tuple[int, int]], out: list[torch.Tensor]) -> None:
        """Read into the pinned staging halves, H2D on the current stream from each (double-buffered).

        Float8 codes (a :class:`~tiered.quant.CodedInfo`) move as stored: each band of whole block rows is read, copied
        to the device and decoded there with its expert's scales, which :meth:`_grids` keeps on the device
        (:func:`tiered.quant.decode_rows`, on the current stream, into the call's tensor; a tensor with one scale: the
        scale is read with each band): the staging and PCIe carry the stored bytes."""
        buf, lock, events = self.staging  # type: ignore[misc]
        half = buf.numel() // 2
        # (sources, device destination, decode) in chunks of at most half the staging: a 1-D element range of a
        # plain source; or a band of rows of codes and the scale rows it uses
        chunks: list[tuple[list[TensorInfo], torch.Tensor, Any]] = []
        grids = self._grids()
        pairs: list[tuple[TensorInfo, torch.Tensor]] = []
        for pi, (p, t) in enumerate(zip(self.spec.parts, out, strict=True)):
            for u, j in todo:
                for k, (info, dest) in enumerate(p.per[j]):
                    d = t[u] if dest is None else dest(t[u])
                    g = grids[pi][k] if grids is not None else None
                    if g is None:
                        pairs.append((info, d))
                        continue
                    # float8 codes whose scales are on the device already: bands of whole block rows of codes
                    rows, cols = info.shape
                    bm = info.decode.block[0]
                    fit = min((half - 4096) // max(1, cols * info.dtype.itemsize), DEVICE_BAND // max(1, cols * 4))
                    band = max(bm, fit // bm * bm)
                    if _align(band * cols * info.dtype.itemsize, 512) > half:
                        raise RingTooSmallError(f"{self.spec.name}: {bm} rows of {info.name!r} are more than half the "
                                                f"{buf.numel() >> 20} MiB expert staging buffer")
                    flat = d.reshape(-1)
                    for r in range(0, rows, band):
                        r1 = min(rows, r + band)
                        n = (r1 - r) * cols
                        codes = TensorInfo(f"{info.name}[{r}:{r1}]", info.dtype, (n,), info.file,
                                           info.offset + r * cols * info.dtype.itemsize, n * info.dtype.itemsize)
                        chunks.append(([codes], flat[r * cols:r1 * cols].view(r1 - r, cols),
                                       ("grid", g[j], info.decode.block, r)))
        for info, d in merge_adjacent(pairs):
            flat = d.reshape(-1)
            isz = d.element_size()
            dec = getattr(info, "decode", None)
            if isinstance(dec, Mxfp4Block):  # one expert's MXFP4 blocks (R, G, 16) and scales (R, G): bands of R
                R, G, _ = info.shape
                band = max(1, min(R, (half - 4096) // (G * 17), DEVICE_BAND // (G * 32 * 16)))
                for r in range(0, R, band):
                    r1 = min(R, r + band)
                    b = TensorInfo(f"{info.name}[{r}:{r1}]", info.dtype, ((r1 - r) * G * 16,), info.file,
                                   info.offset + r * G * 16, (r1 - r) * G * 16)
                    sc = dec.scale
                    s = TensorInfo(f"{sc.name}[{r}:{r1}]", sc.dtype, ((r1 - r) * G,), sc.file, sc.offset + r * G,
                                   (r1 - r) * G)
                    chunks.append(([b, s], d, ("mxfp4", r, r1, G)))
                continue
            if dec is not None:  # float8 codes: bands of whole block rows (tiered.quant)
                rows, cols = info.shape
                bm = dec.block[0]
                cisz = info.dtype.itemsize
                srow = dec.scale.nbytes // max(1, dec.scale.shape[0]) if dec.scale.numel > 1 else 0
                # whole block rows whose codes and scale rows fit half the staging, and whose float32 decode
                # temporary on the device is at most DEVICE_BAND
                fit = min((half - 4096) // max(1, cols * cisz + srow), DEVICE_BAND // max(1, cols * 4))
                band = max(bm, fit // bm * bm)
                if _align(band * cols * cisz, 512) + _align((band // bm + 2) * srow + 64, 512) > half:
                    raise RingTooSmallError(f"{self.spec.name}: {bm} rows of {info.name!r} and their scales are more "
                                            f"than half the {buf.numel() >> 20} MiB expert staging buffer")
                for r in range(0, rows, band):
                    r1 = min(rows, r + band)
                    ci = rows_of(info, r, r1)
                    sc = ci.decode.scale
                    codes = TensorInfo(ci.name, ci.dtype, (ci.numel,), ci.file, ci.offset, ci.nbytes)
                    scale = TensorInfo(sc.name, sc.dtype, (sc.numel,), sc.file, sc.offset, sc.nbytes)
                    chunks.append(([codes, scale], flat[r * cols:r1 * cols].view(r1 - r, cols), ci.decode))
                continue
            step = max(1, half // isz)
            for lo in range(0, info.numel, step):
                hi = min(info.numel, lo + step)
                if isinstance(info, LosslessInfo):  # losslessly coded: the chunks covering [lo, hi), decoded
                    chunks.append(([window(info, lo, hi)], flat[lo:hi], None))
                    continue
                sub = TensorInfo(info.name, info.dtype, (hi - lo,), info.file, info.offset + lo * info.dtype.itemsize,
                                 (hi - lo) * info.dtype.itemsize)
                chunks.append(([sub], flat[lo:hi], None))
        chunks = staged_reads(chunks, MERGE_STAGED_READS)
        stream = torch.cuda.current_stream(self.device)

        def room(c: tuple) -> int:
            srcs, d, dec = c
            if dec is None:
                return _align(d.numel() * d.element_size(), 512)
            return sum(_align(s.nbytes, 512) for s in srcs)

        with lock:
            h, i = 0, 0
            while i < len(chunks):
                base = buf[h * half:(h + 1) * half]
                batch, used = [], 0
                while i < len(chunks) and used + room(chunks[i]) <= half:
                    srcs, d, dec = chunks[i]
                    hosts = []
                    for s in srcs:
                        dt = d.dtype if dec is None else s.dtype
                        n = s.numel * dt.itemsize if dec is not None else d.numel() * d.element_size()
                        hosts.append(base[used:used + n].view(dt))
                        used += _align(n, 512)
                    batch.append((srcs, hosts, d, dec))
                    i += 1
                ev = events[h]
                if ev is not None:
                    ev.synchronize()  # the H2D that last read this half (any experts module's) is done
                self.reader.copy_all(self.spec.unit, read_pairs([(s, host) for srcs, hosts, _, _ in batch
                                                                 for s, host in zip(srcs, hosts, strict=True)],
                                                                MERGE_STAGED_READS), chunk=READ_CHUNK)
                decoded = 0
                for _srcs, hosts, d, dec in batch:
                    if dec is None:
                        d.copy_(hosts[0], non_blocking=True)
                        continue
                    codes = hosts[0].to(self.device, non_blocking=True)  # the stored bytes over PCIe
                    if isinstance(dec, tuple) and dec[0] == "mxfp4":  # gpt-oss: rows [r0, r1) of the slab
                        _, r0, r1, G = dec
                        scale = hosts[1].to(self.device, non_blocking=True)
                        decode_mxfp4(codes.view(1, r1 - r0, G, 16), scale.view(1, r1 - r0, G), d[:, r0:r1])
                        decoded += (r1 - r0) * G * 32 * d.element_size()
                        continue
                    if isinstance(dec, tuple):  # its scales are on the device (_grids)
                        _, grid, block, r0 = dec
                        decode_rows(codes.view(d.shape), grid, block, r0, d)
                        decoded += d.numel() * d.element_size()
                        continue
                    scale = hosts[1].to(self.device, non_blocking=True)
                    grid = scale if dec.scale.numel == 1 else scale.view(dec.scale.shape)
                    decode_rows(codes.view(d.shape), scale_f32(grid), dec.block, dec.row0, d)
                    decoded += d.numel() * d.element_size()
                ev = torch.cuda.Event()
                ev.record(stream)
                events[h] = ev
                h ^= 1
                if decoded:
                    self.stats.add_decoded(decoded)

    # ----------------------------------------------------------------------------------- the call

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Read the routed experts, bind them (on ``spec.owner``, each part in its layout: ``ExpertPart.bound``), set
        ``spec.module.num_experts`` and renumber ``top_k_index`` (``CallGuard``: the module's lock is held and
        :meth:`restore` follows whatever happens)."""
        module = self.spec.module
        if self.closed:
            raise StreamerError("this model was closed (tiered.close / end of its with-block); load it again")
        if self.spec.dense:
            self._bind_parts(self.read(self._dense_ids(args, kwargs), full=True))
            return args, kwargs
        if len(args) >= 2:
            idx, where = args[1], ("args", 1)
        else:
            idx, where = kwargs.get("top_k_index"), ("kwargs", "top_k_index")
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(module).__name__}: expected the router's top_k_index (an integer tensor) as the "
                            f"second argument, got {type(idx).__name__ if not isinstance(idx, torch.Tensor) else idx.dtype}")
        # the distinct ids on idx's own device, then to the host: the one sync (the router's ids). The remap is
        # computed there too, before the experts' copies are queued: an ids tensor copied *to* the GPU from
        # pageable memory would make the host wait for every copy queued before it (CUDA's pageable H2D
        # semantics), so the host could not queue the next block's kernels while this block's experts copy.
        flat = idx.detach().reshape(-1).to(torch.int64)
        u_dev = torch.unique(flat, sorted=True)
        uniq = u_dev.to("cpu")
        E = self.spec.num_experts
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) > E):
            bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
            raise IndexError(f"expert {bad} is out of range for {self.spec.name!r} ({E} experts)")
        # an id == E is the expert-parallel sentinel (no expert: grouped_mm/batched_mm mask it): it maps to
        # U, the sentinel of the U bound experts; a call with no token still binds one expert (no id uses it)
        n = int((uniq < E).sum())
        uniq, u_dev = uniq[:n], u_dev[:n]
        if not n:
            uniq = torch.zeros(1, dtype=torch.int64)
            u_dev = torch.zeros(1, dtype=torch.int64, device=idx.device)
        new_idx = torch.searchsorted(u_dev, idx.contiguous().to(torch.int64)).to(idx.dtype)
        self._bind_parts(self.read(uniq.tolist()))
        module.num_experts = n or 1
        if where[0] == "args":
            args = (*args[:1], new_idx, *args[2:])
        else:
            kwargs = {**kwargs, where[1]: new_idx}
        return args, kwargs

    def _bind_parts(self, tensors: list[torch.Tensor]) -> None:
        """Bind each part's tensor on ``spec.owner`` in its layout (``ExpertPart.bound``), with stock's flags."""
        owner = self.spec.owner
        for p, t in zip(self.spec.parts, tensors, strict=True):
            t = p.bound(t)
            if p.target.is_param:
                owner._parameters[p.target.attr] = follow_requires_grad(
                    nn.Parameter(t, requires_grad=False), self.placeholders[p.target.attr]) \
                    if t.is_floating_point() else t
            else:
                owner._buffers[p.target.attr] = t

    def _dense_ids(self, args: tuple, kwargs: dict) -> list[int]:
        """A ``dense`` spec (Llama 4's ``Llama4TextExperts``, called as ``experts(hidden_states)`` with the
        ``(E * T, H)`` input its block scaled by each expert's router score): the experts ``j`` whose ``T`` input rows
        are not all zero (NaN counts as nonzero), sorted — the one sync. The others compute zeros from zero input with
        any finite weights, so their slabs stay zero (:mod:`tiered.expert_spec`). An input that is no tensor or not
        ``E`` equal blocks reads every expert (the module's own forward then raises as stock's does)."""
        x = args[0] if args else kwargs.get("hidden_states")
        E = self.spec.num_experts
        if not isinstance(x, torch.Tensor) or x.numel() % E:
            return list(range(E))
        hit = x.detach().reshape(E, -1).ne(0).any(dim=1)
        return torch.nonzero(hit).reshape(-1).tolist()

    def restore(self) -> None:
        """Put the placeholders and ``num_experts`` back (idempotent; ``CallGuard`` calls it after every call)."""
        owner = self.spec.owner
        for p in self.spec.parts:
            (owner._parameters if p.target.is_param else owner._buffers)[p.target.attr] = self.placeholders[p.target.attr]
        self.spec.module.num_experts = self.spec.num_experts

    def close(self) -> None:
        """Idempotent: later calls of the module raise StreamerError."""
        self.closed = True
