"""Public entry points: :func:`load`, :func:`attach`, :func:`stats`, :func:`close`."""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import queue
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import dist as _dist
from . import expert_cache as _expert_cache_mod
from .errors import ConfigError, HostMemoryError, RingTooSmallError, StreamerError
from .expert_cache import ExpertCache
from .experts import STAGING_BYTES, ExpertGather, ExpertSpec, HostExperts, find_experts, route_out, slot_layout
from .format import Checkpoint, open_checkpoint
from .guard import CallGuard
from .hostmem import PAGE_SIZE, host_memory_available, page_up
from .meta import build_meta_model, materialize_meta_buffers, meta_model_from_dir
from .plan import Plan, Unit, build_plan, same_bytes
from .reader import Reader, zero_copy_eligible
from .ring import GiB, Ring, gib_up
from .rows import RowGather, row_eligible
from .speculate import Speculator, find_router
from .stats import Stats, page_cache_room, proc_status
from .streamer import Streamer

__all__ = ["Options", "load", "attach", "stats", "close", "build_meta_model", "meta_model_from_dir"]

#: Host memory left to the process beyond the ring (Python, torch, activations) when checking ``ring_gb``
#: against what the host or cgroup has: a ring that leaves less is refused.
HOST_HEADROOM_BYTES = 512 << 20
#: The same on CUDA: the runtime keeps growing after the check (lazily loaded kernel images, cuBLAS
#: workspaces). Measured on the H200 (GPT-J-6B, cgroup memory.max = 2 GiB, 1.37 GiB available at the check,
#: ``benchmarks/results/2026-11-30-h200-cold2g*.md``): ring_gb=0.8 (0.57 GiB left) was OOM-killed in its first
#: pass; ring_gb=0.45 (0.92 GiB left) ran, peak RSS 2.12 GiB.
CUDA_HOST_HEADROOM_BYTES = 896 << 20

#: CUDA: the smallest piece a unit larger than the ring is read in (two must fit the ring).
MIN_PIECE_BYTES = 4 << 20
#: io="auto" on the CPU: page cache kept free beside the page-cache tier (:func:`_choose_page_cache_tier`) for the
#: runtime's own file pages (libraries, the tokenizer) and what the limit's accounting leaves out.
PAGE_CACHE_MARGIN_BYTES = 128 << 20

#: GPU memory left free for activations, KV cache and the CUDA context when ``gpu_gb`` is not given.
GPU_HEADROOM_BYTES = 4 * GiB


@dataclass(frozen=True)
class Options:
    """How a model is streamed. Sizes in GiB (2**30 bytes) say so in their name."""

    ring_gb: float = 4.0  # host ring, GiB: RSS is bounded by this plus a constant
    device: str | None = None  # "cuda" when available, else "cpu"
    dtype: torch.dtype | None = None  # cast on the fly (None: config.json's dtype, as from_pretrained)
    prefetch: int = 2  # units loaded ahead of the one running
    gpu_gb: float | None = None  # GPU budget: resident units + one device buffer (None: free - 4 GiB, all buffers)
    io: str = "mmap"  # reader: "mmap"/"pread" (page cache), "direct" (O_DIRECT) or "auto" (direct if it won't fit)
    threads: int = 4  # reader threads (one stream does not saturate NVMe)
    drop_pages: bool = True  # madvise(MADV_DONTNEED) after each copy: what bounds RssFile
    drop_page_cache: bool = False  # also posix_fadvise(DONTNEED): for cgroups that charge page cache
    embedding_rows: bool = True  # a streamed embedding reads only the rows looked up (tiered/rows.py)
    routed_experts: bool = True  # a streamed MoE block reads only the experts its router picked (tiered/experts.py)
    zero_copy: bool = True  # CPU, io="mmap": streamed units compute on views of the file mapping (no ring copy)
    distributed: bool = False  # (True or a ProcessGroup) each torchrun rank streams 1/N of every unit (tiered/dist.py)
    host_gb: float = 0.0  # host tier, GiB: streamed units read once and kept (CUDA: pinned, copied to the GPU)
    expert_cache_gb: float | None = None  # routed experts kept on the device (None: CUDA, what gpu_gb leaves; CPU 0)
    expert_prefetch: bool = False  # CUDA, host-tier experts: guess the next block's experts and copy them early


#: Seconds ``close()`` waits for a forward running in another thread to stop before releasing anyway.
CLOSE_WAIT_S = 30.0


class _Handle:
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
        self.expert_staging: Ring | None = None  # CUDA: pinned staging of the routed experts
        self.expert_cache: ExpertCache | None = None  # routed experts kept on the device
        self.speculator: Speculator | None = None  # CUDA: the next block's guessed experts, copied early
        self.closed = False
        self.closed_hooks: list[Any] = []
        self.call_lock = threading.RLock()  # one forward pass at a time (see _TieredMixin.__call__)
        self.depth = 0  # nesting of the model's __call__ in the thread holding call_lock
        self.dist: _dist.Dist | None = None

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
            for rg in self.rows:
                rg.close()
            for eg in self.experts:
                eg.close()
            _release_resources(None, None, self.reader, self.ring, self.host_ring, self.expert_staging, self.expert_cache,
                               self.speculator, self.host_experts)
            self.closed = True
        finally:
            if got:
                self.call_lock.release()


def _unique(mods: list[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in mods}.values())


def _release_resources(loader: Any, stage: Any, reader: Reader | None, ring: Ring | None, *more: Any) -> None:
    """Stop the loader, wait for copies, stop the readers, unmap the ring, close ``more`` (each idempotent).
    Holds no module: also the finaliser of a model dropped without close()."""
    for part in (loader, stage, reader, ring, *more):
        if part is not None:
            part.close()


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


_LIVE: dict[int, weakref.ref[_Handle]] = {}  # no callback (see _PARTS): dead entries are pruned on each load


def _live_add(h: _Handle) -> None:
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


class _TieredMixin:
    """Added to the returned model's class: the right ``device``, ``close()``, a context manager, and
    the owner of each forward pass (``__call__``)."""

    _tiered: _Handle

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
            try:
                h.depth = depth + 1
                return super().__call__(*args, **kwargs)
            finally:
                h.depth = depth
                if depth == 0 and h.streamer is not None:
                    h.streamer.release_all()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers``' ``generate``; distributed (several ranks), ``synced_gpus`` defaults to True: a
        rank whose sequences are done keeps running passes until every rank is, so that the ranks'
        all-gathers stay matched (as transformers does for DeepSpeed ZeRO-3)."""
        if self._tiered.dist is not None:
            kwargs.setdefault("synced_gpus", True)
        return super().generate(*args, **kwargs)  # type: ignore[misc]

    @property
    def device(self) -> torch.device:  # parameters of streamed units sit on "meta" between passes
        return self._tiered.device

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


def _is_number(x: object) -> bool:
    """A finite int/float (not a bool) whose GiB still converts to a whole number of bytes (1e300 GiB does not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and math.isfinite(x * GiB)


def _check_options(*, ring_gb: object, prefetch: object, threads: object, gpu_gb: object, io: object,
                   host_gb: object = 0.0, expert_cache_gb: object = None) -> None:
    """Reject option values a user could mistype, before anything is allocated (ConfigError / RingTooSmallError)."""
    if not _is_number(ring_gb):
        raise ConfigError(f"ring_gb must be a number of GiB (e.g. 1 or 0.5), got {ring_gb!r}")
    if ring_gb <= 0:  # type: ignore[operator]
        raise RingTooSmallError(f"ring_gb must be > 0, got {ring_gb}")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ConfigError(f"prefetch must be an integer >= 0 (units of lookahead), got {prefetch!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ConfigError(f"threads must be an integer >= 1 (reader threads), got {threads!r}")
    if gpu_gb is not None and (not _is_number(gpu_gb) or gpu_gb < 0):  # type: ignore[operator]
        raise ConfigError(f"gpu_gb must be a number of GiB >= 0 or None (all that fits), got {gpu_gb!r}")
    if not _is_number(host_gb) or host_gb < 0:  # type: ignore[operator]
        raise ConfigError(f"host_gb must be a number of GiB >= 0 (0: no host tier), got {host_gb!r}")
    if expert_cache_gb is not None and (not _is_number(expert_cache_gb) or expert_cache_gb < 0):  # type: ignore[operator]
        raise ConfigError(f"expert_cache_gb must be a number of GiB >= 0 or None (what gpu_gb leaves), got {expert_cache_gb!r}")
    if io not in ("mmap", "pread", "direct", "auto"):
        raise ConfigError(
            f"io={io!r}: use 'mmap' (page cache, default), 'pread' (page cache, copied by read(2)), 'direct' "
            "(O_DIRECT, bypasses the page cache) or 'auto' (direct when the model does not fit in the page cache room)"
        )


def _choose_io(io: str, ckpt: Checkpoint) -> str:
    """Resolve ``io="auto"``; warn when ``mmap`` must re-read a model larger than the page-cache room."""
    room, where = page_cache_room()
    too_big = room is not None and ckpt.nbytes > room
    if io == "auto":
        return "direct" if too_big else "mmap"
    if io == "mmap" and too_big and where.startswith("cgroup"):
        warnings.warn(
            f"{ckpt.root}: the checkpoint ({ckpt.nbytes / GiB:.2f} GiB) is larger than the page cache this "
            f"{where} leaves ({room / GiB:.2f} GiB): io='mmap' re-reads it from disk through a thrashing "
            "page cache on every pass; io='direct' (or 'auto') reads it without one",
            stacklevel=3,
        )
    return io


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


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                m._buffers[name] = b.to(device)


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


def _headroom(device: torch.device) -> int:
    return CUDA_HOST_HEADROOM_BYTES if device.type == "cuda" else HOST_HEADROOM_BYTES


def _check_host_memory(ring_bytes: int, ring_gb: float, need: int, device: torch.device) -> None:
    """Refuse a ring the host or cgroup cannot give (HostMemoryError) rather than be OOM-killed filling it."""
    avail, where = host_memory_available()
    room = _headroom(device)
    if avail is None or ring_bytes + room <= avail:
        return
    most = max(0, avail - room)
    raise HostMemoryError(
        f"ring_gb={ring_gb} needs {ring_bytes / GiB:.3f} GiB of host memory but only {avail / GiB:.3f} GiB is "
        f"available ({where}) and {room >> 20} MiB is kept for the runtime; pass ring_gb <= "
        f"{math.floor(most / GiB * 1000) / 1000:.3f} (the largest unit needs {gib_up(need)} GiB)"
    )


def _pieces(units: list[Unit], ring_bytes: int, ring_gb: float, align: int) -> dict[int, int]:
    """CUDA, one process: for each unit larger than the ring that can be cut (no whole-tensor conversion; see
    :func:`tiered.dist.split_unit`), the number of pieces it is read in — each piece's slot at most a third of the
    ring (half when a third is below :data:`MIN_PIECE_BYTES`), so the next piece is read while one is waited for and
    the last one's H2D runs (:data:`tiered.loader.PIECES_IN_FLIGHT`).

    Raises:
        RingTooSmallError: a unit needs pieces but half the ring is below :data:`MIN_PIECE_BYTES`.
    """
    room = ring_bytes // 2 // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE  # a piece's slot, page-rounded, fits here
    third = ring_bytes // 3 // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
    if third >= MIN_PIECE_BYTES:
        room = third
    out: dict[int, int] = {}
    for u in units:
        if page_up(u.nbytes) <= ring_bytes:
            continue
        if _dist.split_unit(u, 0, 2, align) is None:
            continue  # cannot be cut: attach's check names it and the ring it needs whole
        if room < MIN_PIECE_BYTES:
            raise RingTooSmallError(
                f"unit {u.name!r} ({u.nbytes / GiB:.3f} GiB) is larger than the ring and is read in pieces, but "
                f"ring_gb={ring_gb} cannot hold two pieces of {MIN_PIECE_BYTES >> 20} MiB; pass ring_gb >= "
                f"{gib_up(2 * (MIN_PIECE_BYTES + 2 * PAGE_SIZE))}"
            )
        out[u.index] = math.ceil(u.nbytes / (room - align))
    return out


def _expert_cache(experts: dict[int, list[ExpertSpec]], device: torch.device, gb: float | None,
                  left: int) -> ExpertCache | None:
    """The model's expert cache: ``gb`` GiB, or (None, CUDA) the GPU budget ``left`` after resident units and
    device buffers, less room for one call's compact tensors (every expert of the largest block: a prefill can
    route to all of them); never more than all the experts. None when that is not one expert."""
    specs = [sp for ss in experts.values() for sp in ss]
    slot = max(slot_layout(sp)[1] for sp in specs)
    if gb is None:
        if device.type != "cuda":
            return None
        room = left - max(sp.num_experts * sp.expert_bytes for sp in specs)
    else:
        room = int(gb * GiB)
    n = min(max(0, room) // slot, sum(sp.num_experts for sp in specs)) if slot else 0
    if n < 1:
        return None
    try:
        return ExpertCache(slot, n, device, policy=_expert_cache_mod.POLICY)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise ConfigError(f"cannot allocate an expert cache of {n} experts ({n * slot / GiB:.3f} GiB) on {device} ({e}); "
                          "pass a smaller expert_cache_gb (0: none) or gpu_gb") from None


def _speculator(model: nn.Module, specs: list[ExpertSpec], device: torch.device, left: int,
                stats: Stats) -> Speculator | None:
    """The model's :class:`~tiered.speculate.Speculator`: ``config.num_experts_per_tok`` slots of the largest expert,
    if that fits in ``left`` bytes of the GPU budget; None otherwise (no prefetch, nothing else changes)."""
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        return None
    slot = max(slot_layout(sp)[1] for sp in specs)
    if k * slot > left:
        return None
    try:
        return Speculator(slot, k, device, stats)
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError: run without the guess
        return None


def _link_speculator(model: nn.Module, gathers: list[ExpertGather], sp: Speculator) -> None:
    """Give each experts call the speculator and, where the next block's experts are in the host tier and its
    router weight is found, what it needs to guess and fill for that block."""
    for eg, nxt in zip(gathers, [*gathers[1:], None], strict=True):
        eg.speculator = sp
        if nxt is None or nxt.host is None:
            continue
        found = find_router(model, nxt.spec.name, nxt.spec.num_experts)
        if found is not None:
            eg.next_block = (nxt.block, found, nxt.host, nxt.slot_offsets)


def _gpu_budget(device: torch.device, gpu_gb: float | None) -> int:
    """Bytes of GPU memory for resident units: ``gpu_gb``, or what is free minus ``GPU_HEADROOM_BYTES``."""
    return int(gpu_gb * GiB) if gpu_gb is not None else torch.cuda.mem_get_info(device)[0] - GPU_HEADROOM_BYTES


def _fits_whole(plan: Plan, ring_gb: float, device: torch.device, gpu_gb: float | None) -> bool:
    """Whether the whole model would stay loaded: in the ring (CPU), or in the GPU budget with every unit
    fitting the ring to be loaded through it (CUDA). Then nothing is routed: every expert stays."""
    ring = int(ring_gb * GiB)
    if device.type == "cpu":
        return sum(page_up(u.nbytes) for u in plan.units) <= ring
    return plan.nbytes <= _gpu_budget(device, gpu_gb) and page_up(plan.max_unit.nbytes) <= ring


def _buffers_counted(gpu_gb: float | None, prefetch: int) -> int:
    """Device buffers (each the largest streamed unit) counted inside the GPU budget. An explicit ``gpu_gb`` counts
    the resident units and one buffer, the unit being computed, as accelerate's ``max_memory`` counts its weights
    and reserves one offloaded layer (``infer_auto_device_map``'s largest layer): so at the same number as
    ``max_memory`` at least as many bytes stay resident; the ``prefetch`` other buffers come on top. The default
    budget (free memory - ``GPU_HEADROOM_BYTES``) counts all ``prefetch + 1``: it must fit what is free."""
    return 1 if gpu_gb is not None else prefetch + 1


def _choose_resident(plan: Plan, ring: int, device: torch.device, gpu_gb: float | None, prefetch: int,
                     rows: set[int] = frozenset(),  # type: ignore[assignment]
                     slot_need: list[int] | None = None, buffers: int | None = None) -> set[int]:
    """Units to load once and keep. ``rows``: embeddings that can read their rows on demand instead: on CUDA
    they are resident only when the whole model fits the budget (and the ring); otherwise they read rows.
    ``slot_need``: ring bytes each unit's slot takes (distributed on the CPU: N equal chunks, a little more
    than ``Unit.nbytes``); default ``Unit.nbytes``. ``buffers``: device buffers counted in the budget (default
    :func:`_buffers_counted`)."""
    if device.type == "cpu":
        # The ring is the only memory: keep everything there when it all fits, else stream everything.
        need = sum(page_up(n) for n in (slot_need or [u.nbytes for u in plan.units]))
        return {u.index for u in plan.units} if need <= ring else set()
    too_big = {i for i in rows if page_up(plan.units[i].nbytes) > ring}
    budget = _gpu_budget(device, gpu_gb)
    if plan.nbytes <= budget and not too_big:
        return {u.index for u in plan.units}
    # Largest units first: what streams then needs the smallest device buffers. Embeddings that read their
    # rows on demand are never chosen: a token costs them a few rows, so the budget goes to units that
    # would stream whole (and they need no device buffer either).
    chosen: set[int] = set()
    order = sorted((u for u in plan.units if u.index not in rows), key=lambda u: -u.nbytes)
    for u in order:
        streamed_max = max((v.nbytes for v in plan.units if v.index not in chosen | {u.index} | rows), default=0)
        pool = (buffers if buffers is not None else _buffers_counted(gpu_gb, prefetch)) * streamed_max
        used = sum(plan.units[i].nbytes for i in chosen) + u.nbytes
        if used + pool <= budget:
            chosen.add(u.index)
    return chosen


def _choose_host(plan: Plan, resident: set[int], rows: set[int], slot_need: list[int], host_gb: float) -> set[int]:
    """The host tier: streamed units within ``host_gb`` (page-rounded slots), spread evenly over the execution order;
    each rank keeps only its own chunk. They are copied to the GPU from there every pass: no disk, no ring.

    Why spread: the loader runs the units in order, reading a streamed unit while the H2D of the units before it
    runs, so the pass takes about ``max(streamed / read GB/s, all / H2D GB/s)`` when host-tier units sit between
    streamed ones, but ``streamed / read + host / H2D`` when they form one block (measured on the H200, GPT-J-6B
    fp16 with half of its layers in the host tier, the first half: 0.252 s/token = 4.83 GB / 30.9 GB/s + 5.24 GB /
    55 GB/s). Each streamed byte costs the same per pass, so which units does not matter beyond that; a budget that
    holds them all takes them all.

    A unit whose slot would hold the same bytes as an earlier candidate's (a tied head after its embedding:
    :func:`tiered.plan.same_bytes`) shares that unit's slot: it costs nothing and comes with it."""
    every = [u for u in plan.units if u.index not in resident and u.index not in rows]
    twins = same_bytes(every)
    cands = [u for u in every if u.index not in twins]
    need = {u.index: page_up(slot_need[u.index]) for u in cands}
    budget = int(host_gb * GiB)
    total = sum(need.values())

    def with_twins(chosen: set[int]) -> set[int]:
        return chosen | {i for i, first in twins.items() if first in chosen}

    if budget >= total:
        return with_twins(set(need))
    host: set[int] = set()
    used = seen = 0
    for u in cands:  # Bresenham: take a unit while the tier is behind its even share of the units so far
        n = need[u.index]
        seen += n
        if used + n <= budget and (used + n / 2) * total <= budget * seen:
            host.add(u.index)
            used += n
    for u in cands:  # what rounding left: any unit that still fits
        n = need[u.index]
        if u.index not in host and used + n <= budget:
            host.add(u.index)
            used += n
    first, held = set(), 0  # first fit in order: when units differ a lot in size, it may hold more bytes
    for u in cands:
        n = need[u.index]
        if held + n <= budget:
            first.add(u.index)
            held += n
    return with_twins(host if used >= held else first)


def _host_slot_bytes(plan: Plan, host: set[int], slot_need: list[int]) -> int:
    """Host-tier bytes of the whole units ``host`` (page-rounded slots; a unit sharing a twin's slot counted once)."""
    twins = same_bytes([plan.units[i] for i in sorted(host)])
    return sum(page_up(slot_need[i]) for i in host if i not in twins)


def _piece_slot(u: Unit, n: int, align: int) -> int:
    """Bytes of one ring (or host-tier) slot of ``u`` read in ``n`` pieces (:func:`tiered.dist.split_unit`)."""
    return page_up(_dist._align(max(1, math.ceil(u.nbytes / n)), align))


def _choose_host_pieces(plan: Plan, pieces: dict[int, int], budget: int) -> dict[int, int]:
    """CUDA: what the host tier holds of streamed units larger than the ring (``pieces``: unit index -> pieces) with
    the ``budget`` bytes whole units and experts left: unit index -> how many of its first pieces. Taken one piece
    per unit in turn, in execution order, so the streamed bytes left are spread over the pass (as
    :func:`_choose_host` spreads whole units). Each held piece is one the ring does not read per pass."""
    out: dict[int, int] = {}
    order = sorted(pieces)
    for r in range(max(pieces.values(), default=0)):
        took = False
        for i in order:
            need = _piece_slot(plan.units[i], pieces[i], plan.align)
            if r < pieces[i] and out.get(i, 0) == r and need <= budget:
                out[i] = r + 1
                budget -= need
                took = True
        if not took:
            break
    return out


def _page_cache_reserve(threads: int) -> int:
    """Bytes of the page-cache room the page-cache tier leaves alone: the reader's O_DIRECT staging (``threads`` x
    ``DIRECT_CHUNK``) and :data:`PAGE_CACHE_MARGIN_BYTES`."""
    from .reader import DIRECT_CHUNK

    return threads * DIRECT_CHUNK + PAGE_CACHE_MARGIN_BYTES


def _choose_page_cache_tier(plan: Plan, taken: set[int], slot_need: list[int], ring_bytes: int, host_gb: float,
                            threads: int) -> set[int]:
    """``io="auto"`` on the CPU when it picked O_DIRECT (the model does not fit the page-cache room): streamed units
    that compute on the file mapping (zero copy) instead of being read O_DIRECT, within the page cache the limit
    still leaves once the ring and the host tier are filled, spread over the execution order (as the host tier).
    Their pages stay in the page cache between passes — the other units' O_DIRECT reads never enter it, so nothing
    cycles it out — and a pass reads only the rest from disk: the cgroup's spare memory, which a model larger than
    it would otherwise thrash through, becomes a tier of its own. Page cache is reclaimable, so a wrong estimate
    costs re-reads (page faults), never an OOM kill. Kept out of it: what the running unit maps, the reader's O_DIRECT
    staging and :data:`PAGE_CACHE_MARGIN_BYTES`."""
    room, _ = page_cache_room()
    if room is None:
        return set()
    cands = [u for u in plan.units if u.index not in taken and zero_copy_eligible(u)]
    if not cands:
        return set()
    spare = room - ring_bytes - int(host_gb * GiB) - max(page_up(u.nbytes) for u in cands) - _page_cache_reserve(threads)
    if spare <= 0:
        return set()
    others = {u.index for u in plan.units} - {u.index for u in cands}
    return _choose_host(plan, others, set(), slot_need, spare / GiB)


def _choose_host_experts(specs: list[ExpertSpec], left: int) -> list[int]:
    """Routed experts modules (indices into ``specs``, forward order) whose every expert goes into the host tier
    with the ``left`` bytes the host tier's units leave (each module's parts page-rounded, as
    :class:`~tiered.experts.HostExperts` allocates them). Units come first: a streamed unit in the host tier saves
    all its bytes of every pass, an experts module only the k/E of them a token routes to."""
    chosen = []
    for i, sp in enumerate(specs):
        n = HostExperts.bytes_for(sp)
        if n <= left:
            chosen.append(i)
            left -= n
    return chosen


def attach(
    module: nn.Module,
    model_dir: str | os.PathLike[str],
    *,
    ring_gb: float = 4.0,
    device: str | torch.device | None = None,
    prefetch: int = 2,
    gpu_gb: float | None = None,
    io: str = "mmap",
    threads: int = 4,
    drop_pages: bool = True,
    drop_page_cache: bool = False,
    progress: bool | None = None,
    embedding_rows: bool = True,
    distributed: bool | Any = False,
    host_gb: float = 0.0,
    routed_experts: bool = True,
    zero_copy: bool = True,
    expert_cache_gb: float | None = None,
    expert_prefetch: bool = False,
    _rss_before: int | None = None,
) -> nn.Module:
    """Stream ``model_dir``'s weights into ``module`` (built on ``meta``) through a pinned ring.

    ``module``'s ``state_dict`` names must match the checkpoint (for ``transformers`` models its
    conversion mapping is applied too). Parameter dtypes are the module's (cast on the fly).
    Returns ``module`` itself, now with ``.device``, ``.close()`` and a context manager.

    Memory: host RSS grows by ``ring_gb`` GiB (allocated once, page-locked on CUDA), plus the host tier
    (``host_gb``: the streamed units it holds, exactly their size), plus a constant; device memory
    by the resident units plus ``prefetch + 1`` buffers of the largest
    streamed unit.

    A streamed ``nn.Embedding`` reads only the rows its ids look up, on each call (``embedding_rows``;
    see ``tiered/rows.py``): it needs no ring space, so a table larger than the ring is fine.

    When the model does not fit (the ring on the CPU; the GPU budget or the ring on CUDA), each MoE block's
    experts module reads only the experts its router picked, on each call (``routed_experts``; see
    ``tiered/experts.py``): the experts need no ring space, so a MoE layer larger than the ring is fine.
    Memory: the routed experts of one call (``U`` x one expert), on the device; on CUDA also a pinned
    staging buffer of ``tiered.experts.STAGING_BYTES`` (256 MiB; at most half the ring) on the host, and the
    expert cache (``expert_cache_gb``; by default what ``gpu_gb`` leaves) on the GPU.

    ``distributed=True`` (one process per GPU under ``torchrun``; or a ``ProcessGroup``): every rank reads
    and copies only its 1/N chunk of each unit and the unit is all-gathered before it runs (NCCL on CUDA,
    gloo on the CPU; see ``tiered/dist.py``). The device defaults to ``cuda:$LOCAL_RANK``. Each rank runs
    its own inputs and gets the one-process outputs bit for bit; every rank must run the same passes
    (``generate`` defaults to ``synced_gpus=True``). The GPU budget is the smallest over the ranks.

    Raises:
        RingTooSmallError: a unit is larger than the ring (names the unit and the GiB needed); a
            row-streamed embedding never is.
        MissingTensorError / ShapeMismatchError: the checkpoint does not match the module.
        HeaderError / TruncatedShardError / ShardNotFoundError: a bad checkpoint.
        ConfigError: an unknown device or io backend; a bad option value;
            ``distributed`` outside ``torchrun`` or with ranks that built different plans.
        HostMemoryError: the ring or host tier is more than the host or cgroup can give.
    """
    _check_options(ring_gb=ring_gb, prefetch=prefetch, threads=threads, gpu_gb=gpu_gb, io=io, host_gb=host_gb,
                   expert_cache_gb=expert_cache_gb)
    if distributed is not False and device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"  # one GPU per rank, as torchrun numbers them
    dev = _resolve_device(device)
    if host_gb and dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"host_gb={host_gb}: a host tier serves device=cuda or cpu, not {dev}")
    if dev.type == "cpu" and gpu_gb is not None:
        warnings.warn(f"gpu_gb={gpu_gb} has no effect on device=cpu: the ring (ring_gb) is the only memory there",
                      UserWarning, stacklevel=2)
    if expert_prefetch and dev.type != "cuda":
        warnings.warn(f"expert_prefetch=True has no effect on device={dev.type}: it copies guessed experts to a GPU "
                      "(tiered/speculate.py)", UserWarning, stacklevel=2)
    if host_gb and distributed is not False and distributed is not None and dev.type == "cpu":  # before any rendezvous
        raise ConfigError(f"host_gb={host_gb} with distributed on the CPU is not supported (each rank would hold a "
                          "chunk that the all-gather overwrites): raise ring_gb, or pass host_gb=0")
    dist = _dist.resolve(distributed, dev)
    opts = Options(ring_gb=ring_gb, device=str(dev), prefetch=prefetch, gpu_gb=gpu_gb, io=io, threads=threads,
                   drop_pages=drop_pages, drop_page_cache=drop_page_cache, embedding_rows=embedding_rows,
                   distributed=dist is not None, host_gb=host_gb, routed_experts=routed_experts, zero_copy=zero_copy,
                   expert_cache_gb=expert_cache_gb, expert_prefetch=bool(expert_prefetch))
    rss0 = _rss_before if _rss_before is not None else proc_status().get("VmRSS", 0)
    ckpt = open_checkpoint(model_dir)
    auto_io = io == "auto"
    io = _choose_io(io, ckpt)
    opts = dataclasses.replace(opts, io=io)
    plan = build_plan(module, ckpt, align=512 if dev.type == "cuda" else 64)
    if dist is not None:  # every rank must issue the same all-gathers: same units, same options
        _dist.check_same_plan(dist, plan, (dev.type, embedding_rows, routed_experts))
    # Routed experts: when the model does not fit, MoE experts leave their units and are read per call.
    experts = {u.index: ss for u in plan.units if routed_experts and (ss := find_experts(u))}
    if experts:
        fits = _fits_whole(plan, ring_gb, dev, gpu_gb)
        if dist is not None:
            fits = bool(_dist.min_over_ranks(dist, int(fits)))
        if fits:
            experts = {}
        for i, ss in experts.items():
            route_out(plan.units[i], ss, plan.align)
    # Ring bytes each unit takes on this rank (distributed on CUDA: only this rank's chunk).
    slot_need = [p.slot_bytes for p in _dist.io_plans(plan.units, dist, dev, plan.align)] if dist is not None \
        else [u.nbytes for u in plan.units]
    # A ring larger than the whole model (page-aligned units) would only cost RSS: cap it.
    whole = sum(page_up(n) for n in slot_need)
    ring_bytes = page_up(min(int(ring_gb * GiB), whole))
    eligible = {u.index for u in plan.units if embedding_rows and row_eligible(u)}
    # CPU zero copy: streamed units that need no conversion compute on views of the file mapping (no ring)
    mappable = {u.index for u in plan.units if zero_copy and dev.type == "cpu" and io == "mmap" and dist is None
                and drop_pages and u.index not in eligible and zero_copy_eligible(u)}
    if auto_io and io == "direct" and dev.type == "cpu" and zero_copy and dist is None and drop_pages:
        # io="auto" picked O_DIRECT on the CPU: a unit larger than the ring that can compute on the file mapping
        # does so (through the page cache, as with io="mmap") instead of being refused
        mappable |= {u.index for u in plan.units if u.index not in eligible and zero_copy_eligible(u)
                     and page_up(slot_need[u.index]) > ring_bytes}
    # CPU: the units the host tier will hold are read straight into it, never through the ring (nothing is resident
    # on the CPU unless everything is, and then the ring holds it all)
    host_first = _choose_host(plan, set(), eligible, slot_need, host_gb) \
        if dev.type == "cpu" and host_gb and dist is None else set()
    ring_units = [u for u in plan.units if u.index not in eligible | mappable | host_first]
    pieces = _pieces(ring_units, ring_bytes, ring_gb, plan.align) if dev.type == "cuda" and dist is None else {}
    whole_units = [u for u in ring_units if u.index not in pieces]
    big = max(whole_units or ring_units or plan.units, key=lambda u: slot_need[u.index])
    need = page_up(slot_need[big.index])  # as the ring allocates it (and as `tiered inspect` reports it)
    if not whole_units:  # everything is mapped, read by rows or in pieces when it streams
        need = min(need, ring_bytes)
    if need > ring_bytes:
        why = ""
        if dev.type == "cuda" and dist is None:
            why = (" and cannot be read in pieces (transformers builds it from whole tensors, e.g. fused, or stacked "
                   "from per-expert ones)")
        elif dev.type == "cpu" and zero_copy and io == "mmap" and dist is None:
            why = (" and cannot run on views of the file mapping (it is cast or converted from the checkpoint's "
                   "tensors)")
        raise RingTooSmallError(
            f"unit {big.name!r} needs {gib_up(need)} GiB but ring_gb={ring_gb}{why}; pass ring_gb >= "
            f"{gib_up(need)} (>= {gib_up(2 * need)} lets the next unit load while one runs)"
        )
    global _ATEXIT
    if not _ATEXIT:  # once per process, on first use (import has no side effects)
        atexit.register(_close_all)
        _ATEXIT = True
    materialize_meta_buffers(module, skip={t.key for u in plan.units for t in u.targets}
                             | {p.target.key for ss in experts.values() for sp in ss for p in sp.parts})
    _warn_unused(module, plan, ckpt)
    _move_buffers(module, dev)
    h = _Handle(module, plan, ckpt, opts, dev)
    h.dist = dist
    _live_add(h)
    h.stats.rss_before_load = rss0
    h.stats.world_size = dist.world if dist is not None else 1
    h.stats.rank = dist.rank if dist is not None else 0
    h.stats.io = io
    try:
        _check_host_memory(ring_bytes, ring_gb, big.nbytes, dev)
        try:
            h.ring = Ring(ring_bytes, pin=dev.type == "cuda")
        except (OSError, MemoryError) as e:
            raise ConfigError(
                f"cannot allocate a {ring_bytes / GiB:.3f} GiB ring ({e}); lower ring_gb "
                f"(>= {gib_up(big.nbytes)} GiB is enough to run)"
            ) from None
        h.stats.ring_bytes = h.ring.size
        # io="auto" that picked O_DIRECT: measure it against buffered reads while streaming, keep the faster
        h.reader = Reader(ckpt, threads=threads, drop_pages=drop_pages, drop_page_cache=drop_page_cache, io=io,
                          adapt=auto_io and io == "direct" and dist is None)
        h.reader.on_choice = h.stats.set_io_choice
        if dist is not None and dev.type == "cuda":  # one budget for all: the smallest
            local = _gpu_budget(dev, gpu_gb)
            gpu_gb = _dist.min_over_ranks(dist, local) / GiB
        # Distributed: every rank must stream the same units, so all decide on the smallest ring and budget,
        # and rank 0's choice is used (a choice one rank's ring cannot hold would wait forever for room).
        counted = _buffers_counted(opts.gpu_gb, prefetch)  # from the user's gpu_gb, not the ranks' minimum above
        budget = _gpu_budget(dev, gpu_gb) if dev.type == "cuda" else 0
        ring_room = h.ring.size if dist is None else _dist.min_over_ranks(dist, h.ring.size)
        resident = _choose_resident(plan, ring_room, dev, gpu_gb, prefetch, rows=eligible, slot_need=slot_need,
                                    buffers=counted)
        if dist is not None:
            resident = _dist.from_rank0(dist, resident)
        rows = eligible - resident
        host = _choose_host(plan, resident, rows, slot_need, host_gb)
        mapped = mappable - resident - host  # a host-tier unit computes on its own copy, not on the mapping
        if auto_io and io == "direct" and dev.type == "cpu" and zero_copy and dist is None and drop_pages:
            cached = _choose_page_cache_tier(plan, resident | host | rows, slot_need, ring_bytes, host_gb, threads)
            mapped |= cached
            h.stats.page_cache_units = len(cached)
            h.stats.page_cache_bytes = sum(plan.units[i].src_bytes for i in cached)
        specs = [sp for ss in experts.values() for sp in ss]  # forward order, as the ExpertGathers below
        host_slots = _host_slot_bytes(plan, host, slot_need)
        host_experts = _choose_host_experts(specs, int(host_gb * GiB) - host_slots)
        streamed_pieces = {i: n for i, n in pieces.items() if i not in host and i not in resident}
        host_pieces = _choose_host_pieces(plan, streamed_pieces, int(host_gb * GiB) - host_slots
                                          - sum(HostExperts.bytes_for(specs[i]) for i in host_experts))
        piece_host_bytes = sum(k * _piece_slot(plan.units[i], streamed_pieces[i], plan.align)
                               for i, k in host_pieces.items())
        if host or host_experts or host_pieces:
            host_bytes = host_slots + piece_host_bytes + \
                sum(HostExperts.bytes_for(specs[i]) for i in host_experts)
            avail, where = host_memory_available()
            # a pinned ring (CUDA) is counted in what is available already; the CPU's is untouched anonymous memory
            # that no figure sees yet, so it counts here
            ring_unseen = h.ring.size if dev.type == "cpu" else 0
            if avail is not None and host_bytes + ring_unseen + _headroom(dev) > avail:
                raise HostMemoryError(
                    f"host_gb={host_gb} takes {host_bytes / GiB:.3f} GiB of host memory but only "
                    f"{max(0, avail - ring_unseen) / GiB:.3f} GiB is available ({where}) beside the ring, and "
                    f"{_headroom(dev) >> 20} MiB is kept for the runtime; pass host_gb <= "
                    f"{max(0, avail - ring_unseen - _headroom(dev)) / GiB:.3f}"
                )
            try:
                if host or host_pieces:
                    h.host_ring = Ring(host_slots + piece_host_bytes,
                                       pin=dev.type == "cuda")
                if host_experts:
                    h.host_experts = HostExperts([specs[i] for i in host_experts], dev)
            except (OSError, MemoryError) as e:
                raise ConfigError(f"cannot allocate a {host_bytes / GiB:.3f} GiB host tier ({e}); lower host_gb") \
                    from None
        h.stats.model_bytes = plan.weight_bytes + sum(sp.num_experts * sp.expert_bytes for ss in experts.values() for sp in ss)
        h.stats.units = len(plan.units)
        h.stats.resident_units = len(resident)
        h.stats.resident_bytes = sum(plan.units[i].nbytes for i in resident)
        h.stats.row_units = len(rows)
        h.stats.expert_modules = sum(len(ss) for ss in experts.values())
        h.stats.mapped_units = len(mapped)
        h.stats.piece_units = len(pieces)
        h.streamer = Streamer(plan, h.reader, h.ring, dev, prefetch=prefetch, resident=resident, stats=h.stats,
                              rows=rows, dist=dist, host=host, host_ring=h.host_ring, mapped=mapped,
                              pieces={i: n for i, n in pieces.items() if i not in host}, host_pieces=host_pieces)
        if progress is None:  # a bar when it is worth one: a terminal and >= 1 GiB to load
            progress = sys.stderr.isatty() and sum(plan.units[i].src_bytes for i in resident) >= GiB
        h.streamer.load_resident(progress=progress)
        h.streamer.load_host()
        s = h.streamer
        for u in plan.units:
            if u.index in resident:
                continue
            if u.index in rows:  # reads its looked-up rows itself: no ring, no streamer
                rg = RowGather(u, dev, h.stats)
                h.rows.append(rg)
                h.hooks.append(CallGuard(u.module, rg.bind, rg.restore, u.name, rg.lock))
                continue
            # The unit's root, and every module inside it that owns one of its tensors: calling such a
            # module directly (model.model.layers[2].mlp(x)) binds the unit too, instead of computing on
            # meta placeholders; inside the unit's own forward it is a reference count.
            for mod in _unique([u.module, *(t.module for t in u.targets)]):
                pre, post = _unit_hooks(s, u.index, root=mod is u.module)
                h.hooks.append(mod.register_forward_pre_hook(pre))
                h.hooks.append(mod.register_forward_hook(post, always_call=True))
        if experts:
            staging = None
            if dev.type == "cuda":
                try:
                    h.expert_staging = Ring(min(STAGING_BYTES, max(16 << 20, h.ring.size // 2)), pin=True)
                except (OSError, MemoryError) as e:
                    raise ConfigError(f"cannot pin {STAGING_BYTES >> 20} MiB (at most) of staging for routed experts ({e}); "
                                      "pass routed_experts=False") from None
                staging = (h.expert_staging.buf, threading.Lock(), [None, None])
            buf_bytes = h.stats.device_buffer_bytes // (prefetch + 1)  # 0 when nothing streams
            left = budget - h.stats.resident_bytes - counted * buf_bytes
            if expert_prefetch and dev.type == "cuda" and h.host_experts is not None and dist is None:
                h.speculator = _speculator(module, specs, dev, left, h.stats)
                if h.speculator is not None:
                    left -= h.speculator.nbytes
            h.expert_cache = _expert_cache(experts, dev, expert_cache_gb, left)
            if h.expert_cache is not None:
                h.stats.expert_cache_slots = h.expert_cache.slots
                h.stats.expert_cache_bytes = h.expert_cache.nbytes
            cache_lock = threading.Lock()
            for spec in specs:
                eg = ExpertGather(spec, h.reader, dev, h.stats, staging, cache=h.expert_cache, cache_lock=cache_lock,
                                  block=len(h.experts))
                h.experts.append(eg)
                h.hooks.append(CallGuard(spec.module, eg.bind, eg.restore, spec.name, eg.lock))
            if h.host_experts is not None:
                h.host_experts.fill(h.reader, h.stats)
                for eg in h.experts:
                    eg.host = h.host_experts.parts(eg.spec)  # None: this block's experts are read
                if h.speculator is not None:
                    _link_speculator(module, h.experts, h.speculator)
        _allow_one_compile_per_unit(len(plan.units))
        h.stats.ring_high_water = h.ring.high_water
        # Dropped without close(): the worker threads hold no module (see Streamer), so the model is
        # collected, and this gives back the threads, the device pool and the ring.
        _on_drop(module, s.loader, s.stage, h.reader, h.ring, h.host_ring, h.expert_staging, h.expert_cache,
                 h.speculator, h.host_experts, *(rg.shard for rg in h.rows))  # the row readers' shards (they hold no module)
    except BaseException:
        h.close()
        raise
    module._tiered = h  # type: ignore[attr-defined]
    _wrap_class(module)
    return module


def load(
    model_dir: str | os.PathLike[str],
    *,
    ring_gb: float = 4.0,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    prefetch: int = 2,
    gpu_gb: float | None = None,
    io: str = "mmap",
    threads: int = 4,
    model_class: type | str | None = None,
    drop_pages: bool = True,
    drop_page_cache: bool = False,
    progress: bool | None = None,
    embedding_rows: bool = True,
    distributed: bool | Any = False,
    host_gb: float = 0.0,
    routed_experts: bool = True,
    zero_copy: bool = True,
    expert_cache_gb: float | None = None,
    expert_prefetch: bool = False,
) -> nn.Module:
    """Build a ``transformers`` model from ``model_dir/config.json`` on ``meta`` and stream its weights.

    Args:
        model_dir: ``config.json`` plus ``model.safetensors`` or shards with ``model.safetensors.index.json``.
        ring_gb: host ring size in GiB (float). Host RSS is bounded by this plus a constant.
        device: ``"cuda[:N]"`` or ``"cpu"``; default CUDA when available.
        dtype: run in this dtype (``torch.bfloat16`` or ``"bf16"``...), cast while copying into the ring;
            default: ``config.json``'s dtype, as ``from_pretrained`` does.
        prefetch: units of lookahead.
        gpu_gb: GiB of GPU memory for resident units (loaded once, never streamed) and the device buffer of the
            unit being computed, as accelerate's ``max_memory`` counts weights plus one offloaded layer; the
            ``prefetch`` other device buffers (each the largest streamed unit) come on top. Default: free memory
            minus 4 GiB, all ``prefetch + 1`` buffers inside it. When the whole model fits, it is loaded once
            through the ring and stays.
        io: reader backend: ``"mmap"`` (default; through the page cache, pages dropped from the process
            after each copy), ``"pread"`` (through the page cache with buffered ``preadv`` straight into the ring:
            no file page is mapped into the process), ``"direct"`` (``O_DIRECT`` reads: no page cache at all;
            cold-cache and cgroup use)
            or ``"auto"`` (``direct`` when the checkpoint is larger than the page cache can hold:
            MemAvailable or the cgroup's limit, v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; measured on an H200
            in a 3 GiB cgroup, GPT-J-6B: 6.0 s/token direct vs 10.7 s/token mmap). On the CPU ``"auto"`` then also
            keeps a page-cache tier: the streamed units that fit the page cache the limit leaves beside the ring and
            the host tier compute on the file mapping and stay cached between passes (``Stats.page_cache_units``).
            When ``"auto"`` picks ``direct``, the reader also times it against buffered ``pread`` (each followed by
            ``POSIX_FADV_DONTNEED``) on the first units it streams and keeps the faster (``Stats.io_choice``;
            ``tiered/reader.py``).
        threads: reader threads.
        drop_pages: after copying a span of the file mapping, ``madvise(MADV_DONTNEED)`` it, so the process never
            keeps the checkpoint's pages mapped (what bounds RSS with ``io="mmap"``). Keep True; False is the naive
            loader, kept to show what the bound is worth.
        drop_page_cache: also ``posix_fadvise(POSIX_FADV_DONTNEED)`` what was copied, so the page cache does not
            keep it either: for cgroups that charge page cache to the process (``memory.max``). Default False.
        model_class: a ``transformers`` class (or its name) overriding ``config.architectures[0]``.
        progress: a progress bar on stderr while resident units load (default: on a terminal, >= 1 GiB).
        embedding_rows: a streamed embedding reads only the rows its ids look up, each call
            (batch x tokens x hidden x itemsize bytes, not the table; ``tiered/rows.py``); False streams
            it whole through the ring like any unit.
        distributed: under ``torchrun``, each rank reads and copies 1/N of every unit and the ranks
            all-gather it (NCCL between GPUs, gloo on the CPU); see :func:`attach` and ``tiered/dist.py``.
        host_gb: GiB of host memory (exact size) for a host tier: streamed units (their 1/N chunks, distributed)
            read once at load and kept, spread over the execution order, touching neither disk nor page cache
            again. On CUDA it is pinned, and each pass copies them to the GPU from there at the pinned H2D rate;
            what units leave goes to routed MoE blocks, whole blocks at a time in forward order: all their
            experts are read once at load, and each call copies only its routed experts to the GPU from there
            (no read after the router; ``tiered.experts.HostExperts``). On the CPU the units compute in place
            (as accelerate's ``max_memory["cpu"]`` keeps weights in RAM): ``ring_gb + host_gb`` is the memory
            to compare with accelerate's. Peak host RSS is bounded by ``ring_gb + host_gb`` plus a constant.
            Default 0: no host tier.
        routed_experts: when the model does not fit, a MoE block's experts module reads only the experts its
            router picked, each call (``tiered/experts.py``); False streams them whole with their layer.
        expert_cache_gb: GiB of device memory keeping routed experts between calls (``tiered/expert_cache.py``):
            a call that picks a cached expert copies it device to device instead of reading it. None (default):
            on CUDA, what ``gpu_gb`` leaves after resident units and device buffers, less one block's experts
            (room for a prefill's compact tensors); on the CPU none. 0: no cache. On the CPU a value > 0 keeps
            them in host memory (RSS grows by it).
        expert_prefetch: on CUDA, when the host tier holds a MoE block's experts and the router of that block is
            resident: while the block before it runs, guess its experts with its router applied to that block's
            input and copy them to a device buffer of top-k expert slots (inside ``gpu_gb``, before the expert
            cache) on a second stream, so the copy engine works while the host waits (SDPA's cuDNN graph build at
            each new sequence length waits for the whole device; ``tiered/speculate.py``). A wrong guess costs its
            copy, never the output. ``Stats.expert_prefetch_hits`` counts the experts served from it. Default
            False: measured on an H200 (Mixtral-8x7B shape, batch 1) it was slower, 0.147 against 0.122 s/token
            with new sequence lengths and 0.113 against 0.084 with seen ones: 58% of the guesses were used, and
            the decode is bound by the copied bytes, which wrong guesses add to.
        zero_copy: on the CPU with ``io="mmap"``, a streamed unit that needs no conversion (same dtype, no fused
            tensors) computes on views of the checkpoint's file mapping, as ``from_pretrained`` does, instead of a
            copy in the ring; its pages are dropped from the process (``MADV_DONTNEED``) when it has run, so RSS
            holds at most the units running at once. Units that convert still go through the ring.

    Returns:
        an ordinary ``transformers`` model (``forward``, ``generate``, ``pipeline``) with ``.close()``.

    Raises:
        ConfigError: no ``config.json`` or an architecture ``transformers`` does not know.
        and every error :func:`attach` raises.
    """
    rss0 = proc_status().get("VmRSS", 0)
    import transformers

    root = Path(model_dir)
    model = meta_model_from_dir(root, dtype=dtype, model_class=model_class)
    gen = root / "generation_config.json"
    if gen.is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(root)
    return attach(model, root, ring_gb=ring_gb, device=device, prefetch=prefetch, gpu_gb=gpu_gb, io=io,
                  threads=threads, drop_pages=drop_pages, drop_page_cache=drop_page_cache, progress=progress,
                  embedding_rows=embedding_rows, distributed=distributed, host_gb=host_gb,
                  routed_experts=routed_experts, zero_copy=zero_copy, expert_cache_gb=expert_cache_gb,
                  expert_prefetch=expert_prefetch, _rss_before=rss0)


def _handle(model: nn.Module) -> _Handle:
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
