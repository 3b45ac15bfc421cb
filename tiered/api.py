"""Public entry points: :func:`load`, :func:`attach`, :func:`stats`, :func:`close`.

One pass: options (:class:`~tiered.options.Options`) -> plan (:func:`~tiered.plan.build_plan`) -> machine facts
(:func:`~tiered.machine.gather`) -> placement (:func:`~tiered.placement.place`, pure) -> build what the placement names
(:func:`_build`) -> hooks. Nothing here decides where a unit goes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import dist as _dist
from . import expert_cache as _expert_cache_mod
from . import experts as _experts_mod
from . import policy as _policy
from .errors import ConfigError, RingTooSmallError
from .errors import caller_stacklevel as _caller_stacklevel
from .expert_cache import ExpertCache
from .experts import ExpertGather, HostExperts
from .format import Checkpoint, open_checkpoint
from .guard import CallGuard
from .hooks import allow_one_compile_per_unit, unit_hooks, wrap_class
from .hostmem import page_up
from .lifecycle import Handle, ensure_atexit, live_add, on_drop, unique
from .linear_pieces import LinearPieces, RingLinearPieces, pieces_exact
from .machine import gather, usable_cores
from .meta import build_meta_model, load_generation_config, materialize_meta_buffers, meta_model_from_dir
from .options import OPTION_DOCS, Options
from .placeholder import install_placeholders
from .placement import Placement, choose_io, place, warn_mmap_thrash
from .plan import Plan, build_plan
from .quant import check_config, config_of
from .reader import Reader
from .ring import GiB, Ring, gib_up
from .rows import RowGather
from .stats import Stats, proc_status
from .streamer import Streamer

__all__ = ["Options", "load", "attach", "stats", "close", "build_meta_model", "meta_model_from_dir"]

def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"device {device!r} is not a device: {e}; use 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available; pass device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported; use 'cpu' or 'cuda[:N]'")
    return dev


def _is_transformers_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers computed at build, and parameters computed because the checkpoint never holds them
    (:func:`tiered.meta.regenerate_param`), to ``device``; streamed tensors are still on ``meta`` here."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                m._buffers[name] = b.to(device)
        for name, p in m._parameters.items():
            if p is not None and p.device.type != "meta" and p.device != device:
                m._parameters[name] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)


def _warn_unused(module: nn.Module, plan: Plan, ckpt: Checkpoint) -> None:
    """Warn about checkpoint tensors nothing reads (config.json with fewer layers than the checkpoint...)."""
    import re

    ignore = [re.compile(p) for p in (getattr(module, "_keys_to_ignore_on_load_unexpected", None) or [])]
    buffers = {n.rpartition(".")[2] for n, _ in module.named_buffers()}
    unused = [k for k in plan.unused if not any(p.search(k) for p in ignore) and k.rpartition(".")[2] not in buffers]
    if unused:
        warnings.warn(
            f"{ckpt.root}: {len(unused)} checkpoint tensors are not used by the model built from config.json "
            f"(e.g. {unused[:3]}); check that config.json matches the checkpoint",
            stacklevel=3,
        )
    if plan.unused_skipped:
        s = ckpt.skipped[plan.unused_skipped[0]]
        warnings.warn(
            f"{ckpt.root}: {len(plan.unused_skipped)} checkpoint tensors torch cannot hold are skipped; the model does "
            f"not use them (e.g. {s.name!r} in {s.file.name}: {s.reason})",
            stacklevel=3,
        )
    if plan.unused_index_missing:
        warnings.warn(
            f"{ckpt.root}: model.safetensors.index.json names {len(plan.unused_index_missing)} tensors no shard holds; "
            f"the model does not need them (e.g. {plan.unused_index_missing[:3]})",
            stacklevel=3,
        )


def _check_device(opts: Options, device: str | torch.device | int | None) -> torch.device:
    """The device to run on (``device`` as given: a string, a ``torch.device`` or a CUDA index), with the warnings
    and refusals that depend on it (before any rendezvous)."""
    if opts.dist_on and device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"  # one GPU per rank, as torchrun numbers them
    dev = _resolve_device(device)
    if opts.host_gb and dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"host_gb={opts.host_gb}: a host tier serves device=cuda or cpu, not {dev}")
    if dev.type == "cpu" and opts.gpu_gb is not None:
        warnings.warn(f"gpu_gb={opts.gpu_gb} has no effect on device=cpu: the ring (ring_gb) is the only memory there",
                      UserWarning, stacklevel=3)
    if opts.expert_prefetch:  # a FutureWarning: shown to the user by default (a DeprecationWarning from here is not)
        warnings.warn("expert_prefetch=True has no effect: the speculative expert prefetch was removed (measured slower "
                      "on an H200, Mixtral-8x7B shape: 0.147 against 0.122 s/token; benchmarks/NOTES.md)",
                      FutureWarning, stacklevel=3)
    if opts.host_gb and opts.dist_on and dev.type == "cpu":
        raise ConfigError(f"host_gb={opts.host_gb} with distributed on the CPU is not supported (each rank would hold a "
                          "chunk that the all-gather overwrites): raise ring_gb, or pass host_gb=0")
    return dev


def attach(
    module: nn.Module,
    model_dir: str | os.PathLike[str],
    *,
    ring_gb: float | None = None,
    device: str | torch.device | None = None,
    prefetch: int = 2,
    gpu_gb: float | None = None,
    io: str = "auto",
    threads: int | None = None,
    drop_pages: bool = True,
    drop_page_cache: bool = False,
    progress: bool | None = None,
    embedding_rows: bool = True,
    distributed: bool | Any = False,
    host_gb: float | None = None,
    routed_experts: bool = True,
    zero_copy: bool = True,
    expert_cache_gb: float | None = None,
    expert_prefetch: bool = False,
    compute_threads: int | None = None,
    _rss_before: int | None = None,
) -> nn.Module:
    """Stream ``model_dir``'s weights into ``module`` (built on ``meta``) through a pinned ring.

    ``module``'s ``state_dict`` names must match the checkpoint (for ``transformers`` models its
    conversion mapping is applied too). Parameter dtypes are the module's (cast on the fly).
    Returns ``module`` itself, now with ``.device``, ``.close()`` and a context manager.

    Memory: host RSS grows by ``ring_gb`` GiB (allocated once, page-locked on CUDA; not given: 4 GiB, or what the
    host's ``MemAvailable`` and cgroup ``memory.max`` leave, ``placement.ring_why``), plus the host tier (``host_gb``),
    plus a constant; device memory by the resident units plus ``prefetch + 1`` buffers of the largest streamed unit.

    Embeddings that read their rows (``embedding_rows``) and routed experts (``routed_experts``; their staging, 256
    MiB at most, and the expert cache) need no ring slot; ``distributed``: every rank reads 1/N of each unit and
    gets the one-process outputs bit for bit. The options are documented below.

    Raises:
        RingTooSmallError: a unit is larger than the ring (names the unit and the GiB needed).
        MissingTensorError / ShapeMismatchError: the checkpoint does not match the module.
        HeaderError / TruncatedShardError / ShardNotFoundError: a bad checkpoint.
        ConfigError: an unknown device or io backend; a bad option value;
            ``distributed`` outside ``torchrun`` or with ranks that built different plans.
        HostMemoryError: the ring or host tier is more than the host or cgroup can give.
    """
    opts = Options(ring_gb=ring_gb, prefetch=prefetch, gpu_gb=gpu_gb, io=io, threads=threads, drop_pages=drop_pages,
                   drop_page_cache=drop_page_cache,
                   embedding_rows=embedding_rows, distributed=distributed, host_gb=host_gb,
                   routed_experts=routed_experts, zero_copy=zero_copy, expert_cache_gb=expert_cache_gb,
                   expert_prefetch=bool(expert_prefetch), compute_threads=compute_threads)
    dev = _check_device(opts, device)
    job = _dist.resolve(distributed, dev)  # the distribution strategy: one process (a no-op) or torchrun's ranks
    rss0 = _rss_before if _rss_before is not None else proc_status().get("VmRSS", 0)
    machine = gather(dev)
    # a quantization method tiered does not decode is refused before a shard is opened (tiered/quant.py)
    check_config(config_of(module, Path(model_dir)), f"{Path(model_dir) / 'config.json'}")
    ckpt = open_checkpoint(model_dir)
    warn_mmap_thrash(choose_io(io, ckpt.nbytes, machine), ckpt.nbytes, ckpt.root, machine)
    plan = build_plan(module, ckpt, align=512 if dev.type == "cuda" else 64, stored=dev.type == "cuda")
    job.check_same_plan(plan, (dev.type, embedding_rows, routed_experts))  # the ranks' all-gathers must match
    opts = dataclasses.replace(opts, device=str(dev), distributed=job.world > 1)
    p = place(plan, opts, machine, ckpt_bytes=ckpt.nbytes, config=getattr(module, "config", None), job=job)
    opts = dataclasses.replace(opts, io=p.io, ring_gb=p.ring_gb, host_gb=p.host_gb)  # "auto", None: as resolved
    _refuse_inplace_rescale(module, plan, p)
    ensure_atexit()
    materialize_meta_buffers(module, skip={t.key for u in plan.units for t in u.targets}
                             | {q.target.key for sp in p.specs for q in sp.parts})
    _warn_unused(module, plan, ckpt)
    _move_buffers(module, dev)
    install_placeholders(module, plan.units, p.specs, dev,  # stock's device, dtype, requires_grad between passes
                         loaded_flags=_is_transformers_model(module))
    h = Handle(module, plan, ckpt, opts, dev)
    h.dist, h.placement = job.shared, p
    live_add(h)
    try:
        _build(h, p, progress, rss0)
        _install_hooks(h, p)
    except BaseException:
        h.close()
        raise
    module._tiered = h  # type: ignore[attr-defined]
    wrap_class(module)
    return module


def _refuse_inplace_rescale(module: nn.Module, plan: Plan, p: Placement) -> None:
    """RWKV divides the weights of blocks ``i >= rescale_every`` in place by ``2 ** (i // rescale_every)`` at its first
    eval forward (transformers 5.17 ``RwkvModel._rescale_layers``): a streamed weight cannot be changed, so such a
    block must be resident, or the load is refused before any weight is read. Where every division is by 1 (no block
    that far), the rescale is marked done (the same numbers, no in-place op on a placeholder)."""
    for m in module.modules():
        every = getattr(getattr(m, "config", None), "rescale_every", 0) or 0
        if not hasattr(m, "layers_are_rescaled") or not hasattr(m, "blocks") or every <= 0:
            continue
        prefix = next(n for n, x in module.named_modules() if x is m)
        names = {f"{prefix}.blocks.{i}" if prefix else f"blocks.{i}" for i in range(every, len(m.blocks))}
        streamed = [u.name for u in plan.units if u.index not in set(p.resident) and u.name in names]
        if streamed:
            raise ConfigError(
                f"{type(m).__name__} (rescale_every={every}) divides the weights of blocks {every}.. in place at its "
                f"first forward; tiered cannot change streamed weights (e.g. {streamed[0]!r}): pass a ring_gb (CPU) or "
                f"gpu_gb (CUDA) that keeps the whole model resident, or load it with stock transformers")
        if not names:
            m.layers_are_rescaled = not m.training  # every division would be by 1: the same weights


def _build(h: Handle, p: Placement, progress: bool | None, rss0: int) -> None:
    """Allocate what ``p`` names — ring, reader, host tier, streamer, expert staging and cache — and load
    the resident units and the host tier. Decides nothing, but for one check on this machine's kernel: a head placed in
    ring pieces whose pieces do not give the whole product's bits streams whole instead (:func:`_head_slots`)."""
    plan, dev, opts, dist = h.plan, h.device, h.opts, h.dist
    cuda = dev.type == "cuda"
    _stats_from(h.stats, plan, p, dist or _dist.SINGLE, rss0)
    _set_compute_threads(p, opts)
    h.ring = _allocate(lambda: Ring(p.ring_bytes, pin=cuda), f"a {p.ring_bytes / GiB:.3f} GiB ring",
                       f"lower ring_gb (>= {gib_up(p.largest_unit_bytes)} GiB is enough to run)")
    h.stats.ring_bytes = h.ring.size
    h.reader = Reader(h.ckpt, threads=p.threads, drop_pages=opts.drop_pages, drop_page_cache=opts.drop_page_cache,
                      io=p.io, adapt=p.io_probe)
    h.reader.on_choice = h.stats.set_io_choice
    h.reader.on_decoded = h.stats.add_decoded
    h.reader.on_slot_direct = h.stats.add_slot_direct
    _check_linear_pieces(h, p)
    _head_slots(h, p)
    specs = p.specs
    if p.host_ring_bytes or p.host_experts:
        what = f"a {(p.host_ring_bytes + p.host_expert_bytes) / GiB:.3f} GiB host tier"
        if p.host_ring_bytes:
            h.host_ring = _allocate(lambda: Ring(p.host_ring_bytes, pin=cuda), what, "lower host_gb")
        if p.host_experts:
            h.host_experts = _allocate(lambda: HostExperts([specs[i] for i in p.host_experts], dev), what, "lower host_gb")
    host = set(p.host)
    h.streamer = Streamer(plan, h.reader, h.ring, dev, prefetch=opts.prefetch, resident=set(p.resident), stats=h.stats,
                          rows=set(p.rows) | set(p.linear_pieces) | set(p.head_pieces), dist=dist, host=host,
                          host_ring=h.host_ring, mapped=set(p.mapped), pieces=p.pieces, host_pieces=p.host_pieces,
                          linear_pieces=set(p.linear_pieces),
                          fixed=sum(sl.size for slots in h.head_slots.values() for sl in slots))
    if progress is None:  # a bar when it is worth one: a terminal and >= 1 GiB to load
        progress = sys.stderr.isatty() and sum(plan.units[i].src_bytes for i in p.resident) >= GiB
    h.streamer.load_resident(progress=progress)
    h.streamer.load_host()
    if not specs:
        return
    if cuda:
        n = min(_experts_mod.STAGING_BYTES, max(16 << 20, h.ring.size // 2))
        h.expert_staging = _allocate(lambda: Ring(n, pin=True), f"{_experts_mod.STAGING_BYTES >> 20} MiB (at most) of "
                                     "staging for routed experts", "pass routed_experts=False", verb="pin")
    if p.expert_cache_slots:
        n, slot = p.expert_cache_slots, p.expert_slot_bytes
        h.expert_cache = _allocate(lambda: ExpertCache(slot, n, dev, policy=_expert_cache_mod.POLICY),
                                   f"an expert cache of {n} experts ({n * slot / GiB:.3f} GiB) on {dev}",
                                   "pass a smaller expert_cache_gb (0: none) or gpu_gb", errors=(RuntimeError, MemoryError))
        h.stats.expert_cache_slots, h.stats.expert_cache_bytes = h.expert_cache.slots, h.expert_cache.nbytes


class OversubscribedWarning(UserWarning):
    """torch's compute threads and tiered's reader threads share too few cores while units stream on the CPU
    (:func:`_set_compute_threads`). Said once per process."""


_warned_oversubscribed = [False]


def _set_compute_threads(p: Placement, opts: Options) -> None:
    """Apply ``p.compute_threads`` (:func:`tiered.policy.compute_threads`): torch's intra-op threads, process-wide
    (``"auto"`` never raises torch's own setting). Warns when compute and reader threads oversubscribe the cores
    while units stream on the CPU (``compute_threads=None`` leaves torch's setting: the warning says what to pass)."""
    n = p.compute_threads
    if n is not None:
        if opts.compute_threads == "auto":
            n = p.compute_threads = min(n, torch.get_num_threads())
        torch.set_num_threads(n)
    if p.device != "cpu" or not (p.streamed or p.routed) or opts.compute_threads == "auto":
        return
    cores = usable_cores()
    busy = min(p.threads, (cores or 0) // 2)
    have = torch.get_num_threads()
    if cores and have + busy > cores and not _warned_oversubscribed[0]:
        _warned_oversubscribed[0] = True
        auto = _policy.compute_threads("auto", p.threads, cores, True)
        warnings.warn(f"{have} torch compute threads and {p.threads} reader threads share {cores} cores while units "
                      "stream: torch's spinning threads can starve the readers (10x slower decode measured on 2 cores); "
                      f"pass compute_threads='auto' (here {auto}) or a number, or set OMP_NUM_THREADS (said once)",
                      OversubscribedWarning, stacklevel=_caller_stacklevel())


def _check_linear_pieces(h: Handle, p: Placement) -> None:
    """Each linear unit the placement computes in pieces (CPU, larger than the ring) gives the whole product's bits in
    pieces on this machine (:func:`~tiered.linear_pieces.pieces_exact`), or the load is refused with the ring that
    runs it whole."""
    assert h.reader is not None
    for i, rows in p.linear_pieces.items():
        u = h.plan.units[i]
        if not pieces_exact(u, h.reader.maps, rows):
            raise RingTooSmallError(
                f"unit {u.name!r} needs {gib_up(page_up(u.nbytes))} GiB but ring_gb={h.opts.ring_gb}: it is larger than "
                "the ring, and computing it in pieces of rows does not give the whole product's bits on this machine "
                f"(checked at load); pass ring_gb >= {gib_up(page_up(u.nbytes))}")


def _head_slots(h: Handle, p: Placement) -> None:
    """CPU: the ring slots of the head the placement reads in pieces through slots of its own (``p.head_pieces``,
    :class:`~tiered.linear_pieces.RingLinearPieces`), taken once, before anything streams, and held until close. A
    head whose pieces do not give the whole product's bits on this machine (:func:`~tiered.linear_pieces.pieces_exact`,
    checked here as for a head larger than the ring) streams whole instead, as without this."""
    assert h.reader is not None and h.ring is not None
    for i, rows in list(p.head_pieces.items()):
        u = h.plan.units[i]
        if not pieces_exact(u, h.reader.maps, rows):
            del p.head_pieces[i]
            continue
        h.head_slots[i] = [h.ring.alloc(_policy.head_piece_slot_bytes(), f"{u.name} (its pieces)", wait=False)
                           for _ in range(_policy.HEAD_PIECE_SLOTS)]


def _allocate(make: Any, what: str, fix: str, verb: str = "allocate",
              errors: tuple[type[BaseException], ...] = (OSError, MemoryError)) -> Any:
    """``make()``, with an allocation failure (``errors``; the device's: ``RuntimeError``, which
    ``torch.OutOfMemoryError`` is) as a ConfigError saying ``fix``."""
    try:
        return make()
    except errors as e:
        raise ConfigError(f"cannot {verb} {what} ({e}); {fix}") from None


def _stats_from(s: Stats, plan: Plan, p: Placement, job: _dist.Dist | _dist.Single, rss0: int) -> None:
    """What the placement says, in the figures ``tiered.stats`` reports."""
    s.rss_before_load = rss0
    s.world_size, s.rank = job.world, job.rank
    s.io = p.io
    s.page_cache_units, s.page_cache_bytes = len(p.page_cache), p.page_cache_bytes
    s.model_bytes = plan.weight_bytes + sum(sp.num_experts * sp.expert_bytes for sp in p.specs)
    s.units, s.resident_units, s.resident_bytes = len(plan.units), len(p.resident), p.resident_bytes_of(plan)
    s.row_units, s.expert_modules, s.mapped_units = len(p.rows), len(p.specs), len(p.mapped)
    s.piece_units = len(p.pieces) + len(p.head_pieces)
    s._placement = weakref.ref(p)  # the handle holds it: a Stats kept after the model is dropped holds no module


def _install_hooks(h: Handle, p: Placement) -> None:
    """Forward hooks that bind each streamed unit, row gathers for row-read embeddings, expert gathers for routed
    experts; the reaper's parts for a model dropped without close()."""
    plan, dev, s = h.plan, h.device, h.streamer
    assert s is not None and h.reader is not None and h.ring is not None
    resident, rows = set(p.resident), set(p.rows)
    for u in plan.units:
        if u.index in resident:
            continue
        if u.index in p.linear_pieces:  # computed in pieces of rows on the mapping, no streamer; a piece's ring room
            lp = LinearPieces(u, h.reader.maps, p.linear_pieces[u.index], h.stats, ring=h.ring)
            h.linear.append(lp)
            h.hooks.append(CallGuard(u.module, lp.bind, lp.restore, u.name, lock=lp.lock, run=lp.forward))
            continue
        if u.index in p.head_pieces:  # read in pieces through ring slots of its own as it computes, no streamer
            rp = RingLinearPieces(u, h.reader, h.head_slots[u.index], p.head_pieces[u.index], h.stats)
            h.linear.append(rp)
            h.hooks.append(CallGuard(u.module, rp.bind, rp.restore, u.name, lock=rp.lock, run=rp.forward))
            continue
        if u.index in rows:  # reads its looked-up rows itself: no ring, no streamer
            rg = RowGather(u, dev, h.stats)
            h.rows.append(rg)
            h.hooks.append(CallGuard(u.module, rg.bind, rg.restore, u.name, rg.lock))
            continue
        # The unit's root, and every module inside it that owns one of its tensors: calling such a
        # module directly (model.model.layers[2].mlp(x)) binds the unit too, instead of computing on
        # meta placeholders; inside the unit's own forward it is a reference count.
        for mod in unique([u.module, *(t.module for t in u.targets)]):
            pre, post = unit_hooks(s, u.index, root=mod is u.module)
            h.hooks.append(mod.register_forward_pre_hook(pre))
            h.hooks.append(mod.register_forward_hook(post, always_call=True))
        for mod in u.readers:  # reads the unit's weights past its call: bound for the reader's call too
            pre, post = unit_hooks(s, u.index, root=True)
            h.hooks.append(mod.register_forward_pre_hook(pre))
            h.hooks.append(mod.register_forward_hook(post, always_call=True))
    if p.specs:
        staging = (h.expert_staging.buf, threading.Lock(), [None, None]) if h.expert_staging is not None else None
        cache_lock = threading.Lock()
        for spec in p.specs:
            eg = ExpertGather(spec, h.reader, dev, h.stats, staging, cache=h.expert_cache, cache_lock=cache_lock,
                              block=len(h.experts))
            h.experts.append(eg)
            h.hooks.append(CallGuard(spec.module, eg.bind, eg.restore, spec.name, eg.lock))
        if h.host_experts is not None:
            h.host_experts.fill(h.reader, h.stats)
            for eg in h.experts:
                eg.host = h.host_experts.parts(eg.spec)  # None: this block's experts are read
    allow_one_compile_per_unit(len(plan.units))
    h.stats.ring_high_water = h.ring.high_water
    # Dropped without close(): the worker threads hold no module (see Streamer), so the model is
    # collected, and this gives back the threads, the device pool and the ring.
    on_drop(h.module, *h.parts)




def load(
    model_dir: str | os.PathLike[str],
    *,
    ring_gb: float | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    prefetch: int = 2,
    gpu_gb: float | None = None,
    io: str = "auto",
    threads: int | None = None,
    model_class: type | str | None = None,
    drop_pages: bool = True,
    drop_page_cache: bool = False,
    progress: bool | None = None,
    embedding_rows: bool = True,
    distributed: bool | Any = False,
    host_gb: float | None = None,
    routed_experts: bool = True,
    zero_copy: bool = True,
    expert_cache_gb: float | None = None,
    expert_prefetch: bool = False,
    compute_threads: int | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Build a ``transformers`` model from ``model_dir/config.json`` on ``meta`` and stream its weights.

    What is loaded is what ``transformers``' ``from_pretrained(model_dir)`` (5.17) loads: the weight files it picks
    (:func:`tiered.format.weight_files`), at its default dtype (``"auto"``: the config's, else the checkpoint's;
    :func:`tiered.meta.default_dtype`), with its generation config (:func:`tiered.meta.load_generation_config`).

    Args:
        model_dir: ``config.json`` plus ``model.safetensors`` or shards with ``model.safetensors.index.json``.
        model_class: a ``transformers`` class (or its name) overriding ``config.architectures[0]``.
        dtype: the compute dtype (weights are cast while streamed); default: as ``from_pretrained``'s default.
        trust_remote_code: run the directory's own model code where ``config.json``'s ``auto_map`` names it (as
            ``from_pretrained(..., trust_remote_code=True)``; :func:`tiered.meta.model_class_for`). Only for code
            you have read.
        progress: a progress bar on stderr while resident units load (default: on a terminal, >= 1 GiB).
        **options: the fields of :class:`tiered.Options` (listed below), each a keyword.
    Returns:
        an ordinary ``transformers`` model (``forward``, ``generate``, ``pipeline``) with ``.close()``.

    Raises:
        ConfigError: no ``config.json``, an architecture ``transformers`` does not know, or custom code
            (``auto_map``) without ``trust_remote_code=True``.
        and every error :func:`attach` raises.
    """
    rss0 = proc_status().get("VmRSS", 0)
    root = Path(model_dir)
    model = meta_model_from_dir(root, dtype=dtype, model_class=model_class, trust_remote_code=trust_remote_code)
    load_generation_config(model, root)
    return attach(model, root, ring_gb=ring_gb, device=device, prefetch=prefetch, gpu_gb=gpu_gb, io=io,
                  threads=threads, drop_pages=drop_pages, drop_page_cache=drop_page_cache, progress=progress,
                  embedding_rows=embedding_rows, distributed=distributed, host_gb=host_gb,
                  routed_experts=routed_experts, zero_copy=zero_copy, expert_cache_gb=expert_cache_gb,
                  expert_prefetch=expert_prefetch, compute_threads=compute_threads, _rss_before=rss0)


def _handle(model: nn.Module) -> Handle:
    h = getattr(model, "_tiered", None)
    if h is None:
        raise TypeError("not a tiered model: use tiered.load or tiered.attach")
    return h


def stats(model: nn.Module) -> Stats:
    """The model's live :class:`~tiered.stats.Stats` (print it, or ``.snapshot()`` for a dict)."""
    h = _handle(model)
    if h.ring is not None:
        h.stats.ring_high_water = h.ring.high_water
    return h.stats


def close(model: nn.Module) -> None:
    """Release the model's ring, threads and hooks."""
    _handle(model).close()


def _document_options(f: Any) -> None:
    """Append every option's documentation (:data:`tiered.options.OPTION_DOCS`) to ``f``'s docstring: written once,
    shown by ``help(tiered.load)`` and ``help(tiered.attach)``."""
    f.__doc__ = (f.__doc__ or "") + "\n    Options (:class:`tiered.Options`; keyword-only):\n" + OPTION_DOCS


_document_options(load)
_document_options(attach)
