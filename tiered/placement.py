"""Where each unit lives for given budgets, and the decode time that predicts (issue 9, capability 1).

``tiered inspect MODEL_DIR --device cuda --ring-gb R --gpu-gb G [--host-gb H] [--io IO]`` prints it; :func:`place`
and :func:`predict` are the functions behind it.

The placement is the one :func:`tiered.load` makes, computed by the same functions (``tiered/api.py``):
routed experts leave their units when the model does not fit (``_fits_whole``), eligible embeddings read their
rows, resident units are chosen largest first within ``gpu_gb`` less the device buffers it counts
(``_choose_resident``, ``_buffers_counted``), the host tier takes streamed units in execution order within ``host_gb``
(``_choose_host``), and the expert cache what ``gpu_gb`` leaves. Every streamed byte costs the same per pass
from a given tier, so the placement that minimises time per token is the one that keeps the most bytes in the
fastest tiers — a knapsack over whole units, which largest-first fills to within one unit of the budget.

The prediction is the streaming bound at batch 1 (compute is not counted, so it is a lower bound): the
reader (disk or page cache -> ring) and the H2D copy (ring and host tier -> GPU) overlap, so the streamed part
takes ``max(streamed / read, (streamed + host tier) / h2d)``; routed experts are read on the model's thread
once their router has picked them, not overlapped, so their misses add ``experts / min(read, h2d)``, or
``experts / h2d`` for blocks whose experts are in the host tier (which takes them after its units). Random or
uniform routing gives the expert cache a hit rate of slots / experts, which is used here.

The io backend (``io``, ``"auto"`` resolved as :func:`tiered.load` resolves it, against this machine's page-cache
room) changes two things. On the CPU, which streamed units compute on views of the file mapping (zero copy: only
with ``io="mmap"``, or ``"auto"`` when it picked O_DIRECT for units larger than the ring and its page-cache tier)
and so which ones the ring must hold (the others: :func:`tiered.load` refuses a ring below the largest). On CUDA,
the prediction: ``io="direct"`` bypasses the page cache, so even a warm pass reads at the disk rate. Where the
units live (GPU, host tier, rows, streamed) does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .hostmem import page_up
from .plan import Plan
from .ring import GiB

__all__ = ["GBPS", "Placement", "place", "predict"]

#: Default bandwidths in GB/s (1e9 bytes/s), measured on the project's GPU machine (one H200, benchmarks/RESULTS.md;
#: the GPT-J tables): O_DIRECT cold reads 1.48-1.88 GB/s with 4 threads; page cache -> pinned ring copy 29-31 GB/s;
#: pinned H2D 55.3 GB/s. Measure your own with ``python benchmarks/ceilings.py`` and pass them.
GBPS = {"disk": 1.5, "page_cache": 30.0, "h2d": 55.0}


@dataclass
class Placement:
    """Unit indices per tier and the bytes a decode token moves (checkpoint bytes read; device bytes copied)."""

    device: str
    resident: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    host_bytes: int = 0
    streamed_bytes: int = 0  # checkpoint bytes read per token for the streamed units
    device_buffer_bytes: int = 0
    expert_modules: int = 0
    experts_total: int = 0
    expert_cache_slots: int = 0
    routed_expert_bytes: int = 0  # per decode token at batch 1: top-k experts of every routed block
    host_expert_modules: int = 0  # routed blocks whose experts are all in the host tier
    host_expert_bytes: int = 0  # their pinned bytes (in host_gb)
    routed_host_bytes: int = 0  # of routed_expert_bytes, what comes from the host tier (H2D, no read)
    pieces: dict[int, int] = field(default_factory=dict)  # CUDA: streamed units larger than the ring -> pieces
    host_pieces: dict[int, int] = field(default_factory=dict)  # of those, how many first pieces the host tier holds
    host_piece_bytes: int = 0  # their pinned bytes (slots, in host_gb)
    expert_hit_rate: float = 0.0  # the cache's, under uniform routing
    io: str = "mmap"  # the reader backend tiered.load would use ("auto" resolved)
    mapped: list[int] = field(default_factory=list)  # CPU: streamed units on views of the file mapping (no ring copy)
    page_cache: list[int] = field(default_factory=list)  # of mapped: io="auto" picked O_DIRECT, the page-cache tier
    ring_bytes: int = 0  # the ring as tiered.load allocates it (never more than the whole model)
    ring_need_bytes: int = 0  # CPU: ring bytes of the largest unit copied into it (0: none); load refuses less

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def place(plan: Plan, config: Any, *, device: str, ring_gb: float, gpu_gb: float | None, host_gb: float = 0.0,
          prefetch: int = 2, embedding_rows: bool = True, routed_experts: bool = True,
          expert_cache_gb: float | None = None, io: str = "mmap", ckpt: Any = None, threads: int = 4) -> Placement:
    """The placement :func:`tiered.load` would make with these options (one process). ``plan`` is changed (routed
    experts leave their units, as at load). ``io``: tiered.load's (``"auto"`` needs ``ckpt``, the plan's
    checkpoint: its size against the page-cache room decides); ``threads``: the reader's, which only the
    page-cache tier of ``io="auto"`` on the CPU depends on (its O_DIRECT staging is kept out of the room).

    Raises:
        ConfigError: ``device="cuda"`` with ``gpu_gb=None`` on a machine without CUDA (the default budget is
            what the GPU has free); an option :func:`tiered.load` would refuse (not a finite number, negative).
        RingTooSmallError: ``ring_gb <= 0``.
    """
    from . import dist as _dist
    from .api import (
        _buffers_counted,
        _check_options,
        _choose_host,
        _choose_host_experts,
        _choose_host_pieces,
        _choose_resident,
        _fits_whole,
        _gpu_budget,
        _host_slot_bytes,
        _piece_slot,
        _pieces,
    )
    from .errors import ConfigError, RingTooSmallError
    from .experts import HostExperts, find_experts, route_out, slot_layout
    from .rows import row_eligible

    _check_options(ring_gb=ring_gb, prefetch=prefetch, threads=threads, gpu_gb=gpu_gb, io=io, host_gb=host_gb,
                   expert_cache_gb=expert_cache_gb)
    auto_io = io == "auto"
    if auto_io:
        if ckpt is None:
            raise ConfigError("io='auto' is resolved against the checkpoint's size: pass ckpt= (the plan's checkpoint)")
        from .api import _choose_io

        io = _choose_io(io, ckpt)
    dev = torch.device(device)
    if dev.type == "cuda" and gpu_gb is None and not torch.cuda.is_available():
        raise ConfigError("a CUDA placement on a machine without CUDA needs a GPU budget: pass gpu_gb=<GiB> (the "
                          "default is the free memory of this machine's GPU)")
    experts = {u.index: ss for u in plan.units if routed_experts and (ss := find_experts(u))}
    if experts and _fits_whole(plan, ring_gb, dev, gpu_gb):
        experts = {}
    for i, ss in experts.items():
        route_out(plan.units[i], ss, plan.align)
    need = [u.nbytes for u in plan.units]
    ring = page_up(min(int(ring_gb * GiB), sum(page_up(n) for n in need)))
    eligible = {u.index for u in plan.units if embedding_rows and row_eligible(u)}
    resident = _choose_resident(plan, ring, dev, gpu_gb, prefetch, rows=eligible, slot_need=need)
    rows = eligible - resident
    host = _choose_host(plan, resident, rows, need, host_gb)
    streamed = [u.index for u in plan.units if u.index not in resident | rows | host]
    p = Placement(str(dev), sorted(resident), sorted(host), streamed, sorted(rows))
    p.resident_bytes = sum(plan.units[i].nbytes for i in resident)
    p.host_bytes = sum(plan.units[i].nbytes for i in host)
    p.streamed_bytes = sum(plan.units[i].src_bytes for i in streamed)
    p.io, p.ring_bytes = io, ring
    if dev.type == "cpu":
        mapped, cached, p.ring_need_bytes = _cpu_mapping(plan, io, auto_io, ring, need, eligible, resident, host,
                                                         host_gb, threads)
        p.mapped, p.page_cache = sorted(mapped), sorted(cached)
    if dev.type == "cuda" and (streamed or host):  # host-tier units are copied into the same device buffers
        p.device_buffer_bytes = (prefetch + 1) * max(plan.units[i].nbytes for i in [*streamed, *host])
    specs = [sp for ss in experts.values() for sp in ss]
    left = int(host_gb * GiB) - _host_slot_bytes(plan, host, need)
    in_host = [specs[i] for i in _choose_host_experts(specs, left)] if specs else []
    if dev.type == "cuda":  # units larger than the ring stream in pieces; the host tier may hold their first ones
        try:
            p.pieces = _pieces([plan.units[i] for i in streamed], ring, ring_gb, plan.align)
        except RingTooSmallError:
            p.pieces = {}
        p.host_pieces = _choose_host_pieces(plan, p.pieces, left - sum(HostExperts.bytes_for(sp) for sp in in_host))
        for i, n_held in p.host_pieces.items():
            u, n = plan.units[i], p.pieces[i]
            held = [_dist.split_unit(u, j, n, plan.align) for j in range(n_held)]
            p.streamed_bytes -= sum(piece.src_bytes for piece, _ in held)  # type: ignore[misc]
            p.host_bytes += min(u.nbytes, n_held * held[0][1])  # type: ignore[index]
            p.host_piece_bytes += n_held * _piece_slot(u, n, plan.align)
    if specs:
        k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1
        p.expert_modules = len(specs)
        p.experts_total = sum(sp.num_experts for sp in specs)
        p.routed_expert_bytes = sum(min(k, sp.num_experts) * sp.expert_src_bytes for sp in specs)
        p.host_expert_modules = len(in_host)
        p.host_expert_bytes = sum(HostExperts.bytes_for(sp) for sp in in_host)
        p.routed_host_bytes = sum(min(k, sp.num_experts) * sp.expert_src_bytes for sp in in_host)
        slot = max(slot_layout(sp)[1] for sp in specs)
        if expert_cache_gb is not None:
            room = int(expert_cache_gb * GiB)
        elif dev.type == "cuda":
            room = (_gpu_budget(dev, gpu_gb) - p.resident_bytes
                    - _buffers_counted(gpu_gb, prefetch) * p.device_buffer_bytes // (prefetch + 1)
                    - max(sp.num_experts * sp.expert_bytes for sp in specs))
        else:
            room = 0
        p.expert_cache_slots = min(max(0, room) // slot, p.experts_total) if slot else 0
        p.expert_hit_rate = p.expert_cache_slots / p.experts_total
    return p


def _cpu_mapping(plan: Plan, io: str, auto_io: bool, ring: int, need: list[int], eligible: set[int],
                 resident: set[int], host: set[int], host_gb: float, threads: int) -> tuple[set[int], set[int], int]:
    """CPU, as :func:`tiered.api.attach` works them out (zero copy on, one process): the streamed units that compute
    on views of the file mapping, those of them that are ``io="auto"``'s page-cache tier, and the ring bytes the
    largest unit copied into the ring takes (0: none is)."""
    from .api import _choose_host, _choose_page_cache_tier
    from .reader import zero_copy_eligible

    mappable = {u.index for u in plan.units if io == "mmap" and u.index not in eligible and zero_copy_eligible(u)}
    if auto_io and io == "direct":  # units larger than the ring compute on the mapping instead of being refused
        mappable |= {u.index for u in plan.units if u.index not in eligible and zero_copy_eligible(u)
                     and page_up(need[u.index]) > ring}
    host_first = _choose_host(plan, set(), eligible, need, host_gb) if host_gb else set()  # read straight into it
    ring_need = max((page_up(need[u.index]) for u in plan.units if u.index not in eligible | mappable | host_first),
                    default=0)
    mapped = mappable - resident - host
    cached = set()
    if auto_io and io == "direct":
        cached = _choose_page_cache_tier(plan, resident | host | (eligible - resident), need, ring, host_gb, threads)
    return mapped | cached, cached, ring_need


def predict(p: Placement, gbps: dict[str, float] | None = None) -> dict[str, float]:
    """Decode s/token at batch 1 from a warm page cache and from a cold disk: the streaming bound (module
    docstring), a lower bound. CUDA only (on the CPU the weights are not copied to a device); 0.0 when nothing
    streams. ``p.io == "direct"`` bypasses the page cache: the warm figure is the cold one."""
    g = {**GBPS, **(gbps or {})}
    out = {}
    misses = (p.routed_expert_bytes - p.routed_host_bytes) * (1 - p.expert_hit_rate)  # read after the router
    from_host = p.routed_host_bytes * (1 - p.expert_hit_rate)  # H2D from the host tier after the router
    for name, read in (("warm", g["disk"] if p.io == "direct" else g["page_cache"]), ("cold", g["disk"])):
        dense = max(p.streamed_bytes / (read * 1e9), (p.streamed_bytes + p.host_bytes) / (g["h2d"] * 1e9))
        out[f"{name}_s_per_token"] = dense + misses / (min(read, g["h2d"]) * 1e9) + from_host / (g["h2d"] * 1e9)
    out["bytes_per_token"] = p.streamed_bytes + p.host_bytes + misses + from_host
    return out
