"""Where each unit lives, every budget, and the decode time that predicts: :func:`place` is a pure function of the
plan, the :class:`~tiered.options.Options` and the :class:`~tiered.machine.Machine` facts (no allocation, no I/O, no
collective) returning a printable :class:`Placement`. :func:`tiered.attach` builds exactly what it names,
``tiered.stats(model).placement`` is that value, and ``tiered inspect MODEL_DIR --ring-gb R [--gpu-gb G] [--host-gb H]
[--io IO]`` prints the same function's result on this machine (:func:`place_here`).

The rules are in :mod:`tiered.policy`: routed experts leave their units when the model does not fit
(``fits_whole``), eligible embeddings read their rows, resident units are chosen largest first within ``gpu_gb``
less the device buffers it counts (``choose_resident``, ``buffers_counted``), the host tier takes streamed units
spread over the execution order within ``host_gb`` (``choose_host``), then routed blocks' experts and the first
pieces of units larger than the ring, and the expert cache what ``gpu_gb`` leaves. Every streamed byte costs the
same per pass from a given tier, so the placement that minimises time per token is the one that keeps the most
bytes in the fastest tiers — a knapsack over whole units, which largest-first fills to within one unit of the budget.
Golden records of every decision (``tests/golden/``, recorded before this module took them over) pin it down.

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

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import dist as _dist
from . import pieces as _pieces
from . import policy
from .errors import ConfigError, HostMemoryError, RingTooSmallError
from .expert_spec import top_k_of
from .experts import STAGING_BYTES, ExpertSpec, HostExperts, find_experts, route_out, slot_layout
from .hostmem import PAGE_SIZE, page_up
from .linear_pieces import linear_piece_eligible, piece_rows_for, ring_piece_eligible
from .machine import Machine
from .options import Options
from .plan import Plan, lay_out, same_bytes
from .reader import zero_copy_eligible
from .ring import GiB, gib_up
from .rows import row_eligible

__all__ = ["GBPS", "Placement", "place", "place_here", "predict", "choose_io"]

#: Default bandwidths in GB/s (1e9 bytes/s), measured on the project's GPU machine (one H200, benchmarks/RESULTS.md;
#: the GPT-J tables): O_DIRECT cold reads 1.48-1.88 GB/s with 4 threads; page cache -> pinned ring copy 29-31 GB/s;
#: pinned H2D 55.3 GB/s. Measure your own with ``python benchmarks/ceilings.py`` and pass them.
GBPS = {"disk": 1.5, "page_cache": 30.0, "h2d": 55.0}


@dataclass
class Placement:
    """Where every unit lives and every budget, for one process (rank) — what :func:`tiered.attach` builds, what
    ``tiered inspect`` prints and what ``tiered.stats(model).placement`` holds. Unit indices are the plan's; bytes
    are exact; ``*_bytes`` per token count checkpoint bytes read (streamed) or device bytes copied (host tier)."""

    device: str
    resident: list[int] = field(default_factory=list)  # loaded once (CUDA: on the GPU; CPU: in the ring, all or none)
    host: list[int] = field(default_factory=list)  # the host tier's whole units
    streamed: list[int] = field(default_factory=list)  # read every pass (not resident, rows or host)
    rows: list[int] = field(default_factory=list)  # embeddings that read their looked-up rows
    resident_bytes: int = 0
    host_bytes: int = 0
    streamed_bytes: int = 0  # checkpoint bytes read per token for the streamed units
    device_buffer_bytes: int = 0  # CUDA: the device pool, prefetch + 1 slots of the largest unit the streamer copies
    expert_modules: int = 0
    experts_total: int = 0
    expert_cache_slots: int = 0
    expert_slot_bytes: int = 0  # bytes of one expert-cache slot (the largest expert)
    routed_expert_bytes: int = 0  # per decode token at batch 1: top-k experts of every routed block
    host_expert_modules: int = 0  # routed blocks whose experts are all in the host tier
    host_expert_bytes: int = 0  # their pinned bytes (in host_gb)
    routed_host_bytes: int = 0  # of routed_expert_bytes, what comes from the host tier (H2D, no read)
    pieces: dict[int, int] = field(default_factory=dict)  # CUDA: units larger than the ring the streamer cuts -> pieces
    piece_counts: dict[int, int] = field(default_factory=dict)  # of those, how many non-empty pieces each has
    host_pieces: dict[int, int] = field(default_factory=dict)  # of those, how many first pieces the host tier holds
    host_piece_bytes: int = 0  # their pinned bytes (slots, in host_gb)
    expert_hit_rate: float = 0.0  # the cache's, under uniform routing
    io: str = "mmap"  # the reader backend ("auto" resolved)
    io_probe: bool = False  # io="auto" picked O_DIRECT: the reader times it against buffered reads (tiered/reader.py)
    mapped: list[int] = field(default_factory=list)  # CPU: streamed units on views of the file mapping (no ring copy)
    linear_pieces: dict[int, int] = field(default_factory=dict)  # CPU: linear units larger than the ring -> rows/piece
    head_pieces: dict[int, int] = field(default_factory=dict)  # CPU: a head read through slots of its own -> rows/piece
    page_cache: list[int] = field(default_factory=list)  # of mapped: io="auto" picked O_DIRECT, the page-cache tier
    page_cache_bytes: int = 0
    ring_bytes: int = 0  # the ring as allocated (never more than the whole model)
    ring_need_bytes: int = 0  # CPU: ring bytes of the largest unit copied into it (0: none); load refuses less
    largest_unit_bytes: int = 0  # the largest unit the ring must hold whole (bytes): the least ring that runs
    host_ring_bytes: int = 0  # the host tier's buffer: whole-unit slots and first pieces (experts apart)
    gpu_budget: int = 0  # CUDA: bytes for resident units and the counted device buffers
    buffers_counted: int = 0  # device buffers counted inside gpu_budget
    routed: dict[int, list[ExpertSpec]] = field(default_factory=dict, repr=False)  # unit -> its routed experts modules
    host_experts: list[int] = field(default_factory=list)  # indices into specs (forward order) kept in the host tier
    refused: list[str] = field(default_factory=list)  # place(strict=False): why a load would refuse these options
    ring_gb: float = 0.0  # the ring asked for (GiB): ring_gb, or what ring_gb=None resolved to
    ring_why: str = ""  # where ring_gb came from ("given", or policy.auto_ring_bytes's reason)
    host_gb: float = 0.0  # the host tier asked for (GiB): host_gb, or what host_gb=None resolved to
    host_why: str = ""  # where host_gb came from ("given", or why tiered chose it: policy.auto_split)
    threads: int = 4  # reader threads (policy.reader_threads: given, or chosen)
    threads_why: str = ""  # where threads came from
    compute_threads: int | None = None  # torch's CPU threads to set (None: left as they are; policy.compute_threads)
    # CUDA, an exp3 checkpoint: units whose coded tensors the reader threads decode (on the CPU) instead of
    # the GPU after the copy, by name, and why (larger than the ring; distributed; no Triton). A cold 2 GiB cgroup's
    # 0.44 GiB ring does this to Llama-3-8B's lm_head, and the disk idles while the readers decode it
    # (benchmarks/NOTES.md, issue 25, eighth session)
    reader_decoded: dict[str, str] = field(default_factory=dict)

    def resident_bytes_of(self, plan: Plan) -> int:
        """Bytes the resident units hold: on the CPU a unit bound to an earlier one's tensors (a tied head,
        :func:`tiered.plan.same_bytes`) counts once, as the ring holds it (:func:`tiered.policy.resident_ring_bytes`);
        on CUDA each has a device copy."""
        twins = same_bytes([plan.units[i] for i in sorted(self.resident)]) if _is_cpu(self.device) else {}
        return sum(plan.units[i].dev_bytes for i in self.resident if i not in twins)

    @property
    def specs(self) -> list[ExpertSpec]:
        """Every routed experts module, in forward order."""
        return [sp for ss in self.routed.values() for sp in ss]

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "routed"}
        d["routed"] = [sp.name for sp in self.specs]
        return d


def choose_io(io: str, ckpt_bytes: int, machine: Machine) -> str:
    """``io="auto"`` resolved: ``"direct"`` when the checkpoint is larger than the page cache's room, else ``"mmap"``;
    any other backend as given."""
    if io != "auto":
        return io
    room = machine.page_cache_room
    return "direct" if room is not None and ckpt_bytes > room else "mmap"


def warn_mmap_thrash(io: str, ckpt_bytes: int, root: Any, machine: Machine) -> None:
    """Warn when ``io="mmap"`` must re-read a model larger than the page-cache room a cgroup leaves."""
    room, where = machine.page_cache_room, machine.page_cache_where
    if io == "mmap" and room is not None and ckpt_bytes > room and where.startswith("cgroup"):
        warnings.warn(
            f"{root}: the checkpoint ({ckpt_bytes / GiB:.2f} GiB) is larger than the page cache this "
            f"{where} leaves ({room / GiB:.2f} GiB): io='mmap' re-reads it from disk through a thrashing "
            "page cache on every pass; io='direct' (or 'auto') reads it without one",
            stacklevel=3,
        )


def _triton_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _unstore_exp3(plan: Plan, which: Any) -> dict[str, int]:
    """Lay out plain again (:func:`tiered.plan.lay_out`) every unit stored only for its exp3 tensors
    (:func:`tiered.plan.device_coded`) for which ``which(unit)`` holds: the reader threads then decode it into the slot,
    and it can be cut into pieces or rank chunks. Used where the GPU decoder cannot take it: a unit larger than the
    ring with a coded chunk larger than a piece (:mod:`tiered.pieces`), a distributed load (ranks read chunks of a
    unit's plain layout), no Triton.
    Returns each such unit's name and its stored layout's bytes before."""
    done: dict[str, int] = {}
    if not plan.stored:
        return done
    for u in plan.units:
        if u.coded_at is not None and all(c.decode is None for t in u.targets for c in t.copies) and which(u):
            done[u.name] = u.nbytes
            lay_out(u, plan.align, stored=False)
    return done


def _exp3_on_readers(plan: Plan, experts: dict[int, list[ExpertSpec]], known: dict[str, str]) -> dict[str, str]:
    """CUDA: the units not in ``known`` whose exp3 tensors the reader threads still decode, and why: a copy the GPU
    decoder cannot take whole as stored (:func:`tiered.plan.device_coded`: a cast, a slice, a fused or converted
    tensor), or routed experts (the expert cache reads and decodes each expert's chunks on the reader threads)."""
    from .lossless import EXP3, LosslessInfo

    def exp3(info: Any) -> bool:
        return isinstance(info, LosslessInfo) and info.coded is not None and info.coded.codec == EXP3

    out: dict[str, str] = {}
    for u in plan.units:
        if u.name in known:
            continue
        if any(exp3(c.src) and c.at is None for t in u.targets for c in t.copies) or any(
                exp3(s) for conv in u.converts for ss in conv.sources.values() for s in ss):
            out[u.name] = ("a cast, a slice, or a fused or converted tensor: the GPU decoder takes whole exp3 tensors "
                           "copied as stored")
        elif any(exp3(info) for sp in experts.get(u.index, []) for part in sp.parts for info, _ in part.per[0]):
            out[u.name] = "its routed experts: the expert cache reads and decodes each expert's chunks on the readers"
    return out


def place(plan: Plan, opts: Options, machine: Machine, *, ckpt_bytes: int, config: Any = None,
          job: Any = None, strict: bool = True) -> Placement:
    """The placement of ``plan`` with ``opts`` on ``machine``: a pure function (no allocation, no I/O, no
    collective), the one :func:`tiered.attach` builds and ``tiered inspect`` prints.

    ``opts.device`` must be resolved (``"cpu"``, ``"cuda[:N]"``); ``ckpt_bytes``: the checkpoint's size, against the
    page cache's room for ``io="auto"``; ``config``: the model's (MoE top-k for the per-token figures); ``job``: the
    distribution strategy (:mod:`tiered.dist`; default one process). Under ``torchrun`` its ranks agree — the
    smallest ring and GPU budget, whether the model fits, rank 0's resident set — so that every rank streams the same
    units (the job's collectives; nothing else here leaves the process). ``plan`` is changed as at load: routed
    experts leave their units when the model does not fit. ``strict=False`` (``tiered inspect``): what a load would
    refuse is recorded in ``Placement.refused`` instead of raised.

    Raises:
        RingTooSmallError: a unit the ring must hold is larger than it, or pieces cannot fit it.
        HostMemoryError: the ring, or the ring and host tier, is more than ``machine`` says the process can take.
    """
    job = _dist.SINGLE if job is None else job
    cpu = _is_cpu(opts.device)
    dist = job.shared  # the Dist whose ranks share each unit; None: one process
    reader_decoded: dict[str, str] = {}  # exp3 units the reader threads decode on this CUDA load, and why
    # ranks cut units into chunks; no Triton, no GPU decoder
    no_gpu = ("a distributed load: ranks read chunks of its plain layout" if dist is not None else
              None if _triton_here() else "no Triton here: no GPU decoder")
    if no_gpu:
        reader_decoded.update(dict.fromkeys(_unstore_exp3(plan, lambda u: True), no_gpu))
    io = choose_io(opts.io, ckpt_bytes, machine)
    coded = _coded(plan)  # before route_out takes routed experts' targets out of their units
    experts = {u.index: ss for u in plan.units if opts.routed_experts and (ss := find_experts(u))}
    call = _expert_call_bytes(experts, cpu)
    room = None if machine.host_available is None else max(0, machine.host_available - policy.headroom(not cpu))
    threads, threads_why = policy.reader_threads(opts.threads, coded, cpu, machine.cores, room)
    readers = policy.extra_reader_bytes(threads) if coded else 0  # decode buffers beyond the default threads' ones
    split = opts.ring_gb is None and opts.host_gb is None and dist is None  # both left to tiered: share the memory
    opts, ring_why = _resolve_ring(opts, machine, cpu, call, readers)
    local = 0 if cpu else policy.gpu_budget(opts.gpu_gb, machine.gpu_free)
    if experts and job.min(int(policy.fits_whole(plan, opts.ring_bytes, cpu, local))):  # fits on every rank
        experts = {}
    for i, ss in experts.items():
        route_out(plan.units[i], ss, plan.align, stored=plan.stored)
    if no_gpu and experts:  # route_out laid those units out again, stored where it could
        reader_decoded.update(dict.fromkeys(_unstore_exp3(plan, lambda u: u.index in experts), no_gpu))
    host_why = "given (host_gb)" if opts.host_gb is not None else "none: ring_gb given, or distributed"
    if split and machine.host_available is not None and (experts or not policy.fits_whole(plan, opts.ring_bytes, cpu,
                                                                                          local)):
        opts, ring_why, host_why = _split(plan, opts, machine, cpu, local, call if experts else 0, experts, readers)
    elif opts.host_gb is None:
        opts = dataclasses.replace(opts, host_gb=0.0)
        if split:
            host_why = "none: the whole model stays loaded" if machine.host_available is not None else (
                "none: host memory unknown here")
    # larger than the ring: read in pieces of whole coded chunks (tiered.pieces) and decoded on the GPU after the
    # last; a chunk larger than a piece's room cannot be: that unit is laid out plain, its pieces decoded by the readers
    room, ring = policy.piece_room(page_up(opts.ring_bytes)), page_up(opts.ring_bytes)
    big = _unstore_exp3(plan, lambda u: page_up(u.nbytes) > ring and _pieces.count(u, room, plan.align) is None)
    reader_decoded.update({name: f"it is larger than the {opts.ring_gb:.3g} GiB ring and one of its coded chunks is "
                                 f"larger than a piece of it ({room / 2**20:.3g} MiB of the ring); "
                                 f"ring_gb >= {gib_up(page_up(n))} keeps it on the GPU whole"
                           for name, n in big.items()})
    if not cpu:
        reader_decoded.update(_exp3_on_readers(plan, experts, reader_decoded))
    p = Placement(opts.device, io=io, io_probe=opts.io == "auto" and io == "direct" and dist is None,
                  ring_gb=opts.ring_gb, ring_why=ring_why, host_gb=opts.host_gb, host_why=host_why)
    p.buffers_counted = policy.buffers_counted(opts.gpu_gb, opts.prefetch)
    p.threads, p.threads_why = threads, threads_why
    p.reader_decoded = reader_decoded
    p.routed = experts

    def slot_need(rank: int | None) -> list[int]:  # ring bytes of each unit's slot on a rank
        if dist is None or rank is None:
            return [u.nbytes for u in plan.units]
        return [q.slot_bytes for q in _dist.io_plans(plan.units, _dist.Dist(None, rank, dist.world, ""),
                                                      _device(opts), plan.align)]

    need = slot_need(dist.rank if dist else None)
    p.ring_bytes = _ring_bytes(opts.ring_bytes, need, plan if cpu else None)
    if cpu and opts.io == "auto" and p.io == "direct" and dist is None and opts.zero_copy and opts.drop_pages and any(
            page_up(need[u.index]) > p.ring_bytes and linear_piece_eligible(u) for u in plan.units):
        # O_DIRECT copies each unit into the ring whole; a linear unit larger than the ring runs only on the file
        # mapping, in pieces of rows (tiered/linear_pieces.py): keep the mapping rather than refuse what mmap runs
        p.io, p.io_probe = "mmap", False
    p.gpu_budget = local if cpu else job.min(local)  # one budget for all ranks: the smallest
    ring_min = job.min(opts.ring_bytes)  # every rank places with the smallest ring (rank 0's choice must fit all)
    ring_room = (min(_ring_bytes(ring_min, slot_need(r), plan if cpu else None) for r in range(dist.world)) if dist
                 else p.ring_bytes)
    eligible = {u.index for u in plan.units if opts.embedding_rows and row_eligible(u)}
    mappable, pieces, big = _ring_units(plan, opts, p, need, eligible, dist is None, strict)
    call = call if experts else 0  # routed: a block's experts live for its call beside the ring (CPU)
    if machine.host_available is not None and p.ring_bytes + policy.headroom(not cpu) + call > machine.host_available:
        most = max(0, machine.host_available - policy.headroom(not cpu) - call)
        also = f" and {call / GiB:.3f} GiB for one MoE block's routed experts during its call" if call else ""
        _refuse(p, strict, HostMemoryError(
            f"{_ring_said(opts, p)} needs {p.ring_bytes / GiB:.3f} GiB of host memory but only "
            f"{machine.host_available / GiB:.3f} GiB is available ({machine.host_where}) and "
            f"{policy.headroom(not cpu) >> 20} MiB is kept for the runtime{also}; pass ring_gb <= "
            f"{math.floor(most / GiB * 1000) / 1000:.3f} (the largest unit needs {gib_up(big)} GiB)"))
    resident = job.agree(policy.choose_resident(plan, ring_room, cpu, p.gpu_budget, p.buffers_counted,
                                                rows=eligible, slot_need=need))  # rank 0's choice on every rank
    rows = eligible - resident
    host = policy.choose_host(plan, resident, rows, need, opts.host_gb)
    mapped = mappable - resident - host  # a host-tier unit computes on its own copy, not on the mapping
    if p.io_probe and cpu and opts.zero_copy and opts.drop_pages:
        cached = policy.choose_page_cache_tier(plan, resident | host | rows, need, p.ring_bytes, opts.host_gb,
                                               p.threads, machine.page_cache_room)
        mapped |= cached
        p.page_cache, p.page_cache_bytes = sorted(cached), sum(plan.units[i].src_bytes for i in cached)
    p.resident, p.rows, p.host, p.mapped = sorted(resident), sorted(rows), sorted(host), sorted(mapped)
    p.streamed = [u.index for u in plan.units if u.index not in resident | rows | host]
    p.pieces = {i: n for i, n in pieces.items() if i not in host}
    p.linear_pieces = {i: n for i, n in p.linear_pieces.items() if i in mapped}
    if cpu and dist is None:  # a head the ring holds but not beside a layer: in pieces through slots of its own
        p.head_pieces = policy.choose_head_pieces(plan, [i for i in p.streamed if i not in mapped], p.streamed, need,
                                                  p.ring_bytes, ring_piece_eligible)
    _host_tier(plan, opts, machine, p, need, cpu, strict)
    _device_memory(plan, opts, p, config, dist, cpu)
    _per_token(plan, p, config)
    p.compute_threads = policy.compute_threads(opts.compute_threads, p.threads, machine.cores,
                                               cpu and bool(p.streamed or p.routed))
    return p


def place_here(plan: Plan, *, device: str, ckpt_bytes: int, config: Any = None, strict: bool = True,
               **options: Any) -> Placement:
    """:func:`place` on this machine's facts (:func:`tiered.machine.gather`) with ``tiered.load``'s keyword options:
    the placement ``tiered.load(..., device=device, **options)`` makes here (one process). What ``tiered inspect``
    prints.

    Raises:
        ConfigError: ``device="cuda"`` with ``gpu_gb=None`` on a machine without CUDA (the default budget is what the
            GPU has free); an option :func:`tiered.load` would refuse.
        RingTooSmallError, HostMemoryError: as :func:`place`.
    """
    import torch

    from .machine import gather

    opts = Options(device=device, **options)
    dev = torch.device(device)
    cuda_here = dev.type == "cuda" and torch.cuda.is_available()
    if dev.type == "cuda" and opts.gpu_gb is None and not cuda_here:
        raise ConfigError("a CUDA placement on a machine without CUDA needs a GPU budget: pass gpu_gb=<GiB> (the "
                          "default is the free memory of this machine's GPU)")
    return place(plan, opts, gather(dev if cuda_here else None), ckpt_bytes=ckpt_bytes, config=config, strict=strict)


def _expert_call_bytes(experts: dict[int, list[ExpertSpec]], cpu: bool) -> int:
    """CPU: host bytes the largest MoE block's routed experts take during its call (every expert: a prefill may pick
    them all, and Llama 4's dense spec always reads into full tensors), were ``experts`` (unit -> its routable
    experts modules) routed; 0 on CUDA (device memory, counted in the GPU budget) or without routable experts."""
    if not cpu:
        return 0
    return max((sp.num_experts * sp.expert_bytes for ss in experts.values() for sp in ss), default=0)


def _resolve_ring(opts: Options, machine: Machine, cpu: bool, call: int = 0, readers: int = 0) -> tuple[Options, str]:
    """``opts`` with ``ring_gb=None`` resolved (:func:`tiered.policy.auto_ring_bytes`, less ``call``: routed experts'
    bytes during a call, :func:`_expert_call_bytes`, and ``readers``: the extra reader threads' decode buffers,
    :func:`tiered.policy.extra_reader_bytes`), and where its value came from.

    Raises:
        HostMemoryError: ``ring_gb=None`` and the host leaves no room for a ring.
    """
    if opts.ring_gb is not None:
        return opts, "given (ring_gb)"
    ring, why = policy.auto_ring_bytes(machine.host_available, machine.host_where, not cpu,
                                       opts.host_bytes + call + readers)
    if readers and "available)" in why:
        why += f" ({readers >> 20} MiB of that for the decode buffers of the extra reader threads)"
    if not ring:
        fix = "lower host_gb, " if opts.host_gb else ""
        raise HostMemoryError(f"no room for a ring: {why}; {fix}free host memory or raise the memory limit")
    return dataclasses.replace(opts, ring_gb=ring / GiB), f"automatic: {why}"


def _split(plan: Plan, opts: Options, machine: Machine, cpu: bool, budget: int, call: int,
           experts: dict[int, list[ExpertSpec]], readers: int = 0) -> tuple[Options, str, str]:
    """``ring_gb`` and ``host_gb`` both None, and the model does not stay whole with the automatic ring: the memory
    the host leaves shared between the ring and the host tier (:func:`tiered.policy.auto_split`), as ``opts`` with
    both resolved and where each came from. ``budget``: the GPU bytes for resident units (CUDA); ``call``: the CPU's
    routed-experts bytes during a call (kept out of both); ``readers``: the decode buffers of reader threads beyond
    the default's (:func:`tiered.policy.extra_reader_bytes`, kept out of both)."""
    assert machine.host_available is not None
    total = max(0, machine.host_available - policy.headroom(not cpu) - call - readers)
    rows = {u.index for u in plan.units if opts.embedding_rows and row_eligible(u)}
    need = [u.nbytes for u in plan.units]
    largest = max((page_up(need[u.index]) for u in plan.units if u.index not in rows), default=0)
    want = policy.auto_ring_want(largest, opts.prefetch)
    staging = 0
    if experts and not cpu:  # CUDA: routed experts' pinned staging comes beside the ring (tiered.api._build)
        staging = page_up(min(STAGING_BYTES, max(16 << 20, min(want, total) // 2)))
        total = max(0, total - staging)
    ring = min(want, total // PAGE_SIZE * PAGE_SIZE)  # as auto_split sizes it; the resident set depends on it
    resident = policy.choose_resident(plan, ring, cpu, budget, policy.buffers_counted(opts.gpu_gb, opts.prefetch),
                                      rows=rows, slot_need=need)
    rows -= resident
    streamed = sum(page_up(need[u.index]) for u in plan.units if u.index not in resident | rows)
    streamed += sum(HostExperts.bytes_for(sp) for ss in experts.values() for sp in ss)
    # CUDA, the model streams by the GPU budget: a ring of a few pieces (policy.PIECE_RING_BYTES) where every unit that
    # streams can be cut, the rest of the memory to the host tier (policy.pieces_ring_ok)
    in_pieces = (not cpu and not experts and plan.dev_bytes > budget
                 and policy.pieces_ring_ok(plan, [u.index for u in plan.units if u.index not in resident | rows],
                                           plan.align))
    floor = 0
    if not cpu and resident:
        # CUDA: the ring holds what streams; a resident unit passes through it once, at load, in pieces where it is
        # larger (tiered.pieces) -- only one that cannot be cut needs the ring whole. Measured on the H200 (Llama-3-8B
        # bf16, gpu_gb=3, 4 GiB cgroup, benchmarks/NOTES.md issue 23): sized by the resident 0.98 GiB lm_head, the
        # ring took all 2.5 GiB the limit left (1.38 GiB high water) and the host tier got none
        largest = max((page_up(need[u.index]) for u in plan.units if u.index not in resident | rows), default=0)
        room = policy.piece_room(min(policy.ring_ask(largest, opts.prefetch, in_pieces), total // PAGE_SIZE * PAGE_SIZE))
        floor = max((page_up(need[i]) for i in resident
                     if _pieces.count(plan.units[i], room, plan.align) is None), default=0)
    ring, host = policy.auto_split(total, largest, opts.prefetch, streamed, at_least=floor, pieces=in_pieces)
    left = (f"what {machine.host_where} leaves ({machine.host_available / GiB:.3f} GiB available) after "
            f"{policy.headroom(not cpu) >> 20} MiB for the runtime"
            + (f" and {call / GiB:.3g} GiB for one MoE block's routed experts during its call" if call else "")
            + (f" and {readers >> 20} MiB for the decode buffers of the extra reader threads" if readers else ""))
    if staging:
        left += f" and {staging / GiB:.3g} GiB of pinned staging for routed experts"
    n = opts.prefetch + 1
    want = max(policy.ring_ask(largest, opts.prefetch, in_pieces), page_up(floor))
    units = (f"at least {floor / GiB:.3f} GiB: a resident unit that cannot be read in pieces passes through it whole"
             if floor and want == page_up(floor) else
             f"three pieces of {policy.PIECE_RING_BYTES // 3 >> 20} MiB: every unit it streams larger than that is "
             f"read in pieces, the rest of the memory is the host tier's (policy.PIECE_RING_BYTES)"
             if in_pieces and want == policy.PIECE_RING_BYTES < page_up(n * largest) else
             f"prefetch + 1 = {n} of the largest unit it streams ({largest / GiB:.3f} GiB)"
             if want == page_up(n * largest) else
             f"at most {gib_up(want)} GiB: the default ring, or the largest unit it streams ({largest / GiB:.3f} GiB)"
             if want < page_up(n * largest) else f"at least {policy.MIN_AUTO_RING_BYTES >> 20} MiB")
    if ring >= want:  # the ring got what it asks for
        ring_why = f"automatic: {ring / GiB:.3f} GiB, {units}, of {left}"
    else:
        ring_why = f"automatic: {ring / GiB:.3f} GiB, all of {left} (it asks for {units})"
    if host:
        host_why = (f"automatic: {host / GiB:.3f} GiB, the rest of {left}"
                    + (" (all the streamed units)" if host >= page_up(streamed) else ""))
    elif not streamed:
        host_why = "automatic: none, nothing streams"
    else:
        host_why = "automatic: none, the ring takes all the host leaves"
    return dataclasses.replace(opts, ring_gb=ring / GiB, host_gb=host / GiB), ring_why, host_why


def _ring_said(opts: Options, p: Placement) -> str:
    """``ring_gb=X`` as messages say it, with where an automatic value came from."""
    if p.ring_why.startswith("automatic"):
        return f"ring_gb={opts.ring_gb:.4g} ({p.ring_why}; this host cannot give a larger ring now)"
    return f"ring_gb={opts.ring_gb}"


def _is_cpu(device: str) -> bool:
    """``"cpu"`` or ``"cpu:N"`` (a resolved device's string)."""
    return device.partition(":")[0] == "cpu"


def _device(opts: Options) -> Any:
    import torch

    return torch.device(opts.device)


def _ring_bytes(ring: int, need: list[int], plan: Plan | None = None) -> int:
    """The ring as allocated: ``ring`` bytes, never more than every unit's page-rounded slot (more would only cost
    RSS). With ``plan`` (the CPU, where a ring that holds every unit keeps them all): less the slots of units bound to
    an earlier unit's tensors (a tied head, :func:`tiered.policy.resident_ring_bytes`)."""
    whole = policy.resident_ring_bytes(plan, need) if plan is not None else sum(page_up(n) for n in need)
    return page_up(min(ring, whole))


def _refuse(p: Placement, strict: bool, e: Exception) -> None:
    """Raise ``e`` (a load refuses), or record it in ``p.refused`` (``tiered inspect``)."""
    if strict:
        raise e
    p.refused.append(f"{type(e).__name__}: {e}")


def _coded(plan: Plan) -> bool:
    """Whether any copy of ``plan`` reads a losslessly coded tensor (:mod:`tiered.lossless`: decoded by the readers)."""
    return any(getattr(c.src, "coded", None) is not None for u in plan.units for t in u.targets for c in t.copies)


def _ring_units(plan: Plan, opts: Options, p: Placement, need: list[int], eligible: set[int],
                one: bool, strict: bool) -> tuple[set[int], dict[int, int], int]:
    """Which units compute on the file mapping (CPU zero copy), which are cut in pieces (CUDA), and the ring bytes the
    largest unit copied whole into the ring takes; refuses a ring below it (RingTooSmallError)."""
    cpu = _is_cpu(p.device)
    zc = opts.zero_copy and cpu and one and opts.drop_pages
    mappable = {u.index for u in plan.units if zc and p.io == "mmap" and u.index not in eligible and zero_copy_eligible(u)}
    # CPU: the units the host tier will hold are read straight into it, never through the ring
    host_first = policy.choose_host(plan, set(), eligible, need, opts.host_gb) if cpu and opts.host_gb and one else set()
    ring_units = [u for u in plan.units if u.index not in eligible | mappable | host_first]
    try:
        pieces = policy.cut_pieces(ring_units, p.ring_bytes, opts.ring_gb, plan.align) if not cpu and one else {}
    except RingTooSmallError as e:
        _refuse(p, strict, e)
        pieces = {}
    # CPU zero copy: a mapped unit's pages are in RSS while it runs (faulted in from the page cache, dropped after), so
    # it counts against the ring as a copied one does: the bound load() promises is the ring, not the largest unit
    on_map = [u for u in plan.units if u.index in mappable and u.index not in host_first] if cpu else []
    # ... except a linear layer larger than the ring, computed in pieces of output rows (tiered/linear_pieces.py;
    # their exactness is checked at load, on this machine)
    p.linear_pieces = {u.index: piece_rows_for(u, p.ring_bytes) for u in on_map
                       if page_up(need[u.index]) > p.ring_bytes and linear_piece_eligible(u)}
    on_map = [u for u in on_map if u.index not in p.linear_pieces]
    if cpu:
        p.ring_need_bytes = max((page_up(need[u.index]) for u in ring_units + on_map), default=0)
    whole_units = [u for u in ring_units if u.index not in pieces] + on_map
    big = max(whole_units or ring_units or plan.units, key=lambda u: need[u.index])
    most = page_up(need[big.index])  # as the ring allocates it (and as `tiered inspect` reports it)
    p.largest_unit_bytes = big.nbytes
    if not whole_units:  # everything is mapped, read by rows or in pieces when it streams
        most = min(most, p.ring_bytes)
    if most > p.ring_bytes and not p.refused:  # (not a second note after cut_pieces's refusal, in inspect)
        why = ""
        if not cpu and one:
            why = (" and cannot be read in pieces (transformers builds it from whole tensors, e.g. fused, or stacked "
                   "from per-expert ones)")
        elif big.index in mappable:
            why = (" (it runs on views of the file mapping, whose pages are resident while it runs: the ring bounds "
                   "them too)")
        elif cpu and opts.zero_copy and p.io == "mmap" and one:
            coded = any(getattr(c.src, "coded", None) is not None for t in big.targets for c in t.copies)
            why = (" and cannot run on views of the file mapping (" + (
                "it is stored losslessly compressed: the reader threads decode it into the ring" if coded else
                "it is cast or converted from the checkpoint's tensors") + ")")
        _refuse(p, strict, RingTooSmallError(
            f"unit {big.name!r} needs {gib_up(most)} GiB but {_ring_said(opts, p)}{why}; pass ring_gb >= "
            f"{gib_up(most)} (>= {gib_up(2 * most)} lets the next unit load while one runs)"))
    return mappable, pieces, big.nbytes


def _host_tier(plan: Plan, opts: Options, machine: Machine, p: Placement, need: list[int], cpu: bool,
               strict: bool) -> None:
    """The host tier's experts and first pieces, after its whole units; refuses more than the host can give."""
    specs = p.specs
    host = set(p.host)
    host_slots = policy.host_slot_bytes(plan, host, need)
    p.host_experts = policy.choose_host_experts(specs, opts.host_bytes - host_slots)
    p.host_expert_bytes = sum(HostExperts.bytes_for(specs[i]) for i in p.host_experts)
    streamed_pieces = {i: n for i, n in p.pieces.items() if i not in set(p.resident)}
    p.host_pieces = policy.choose_host_pieces(plan, streamed_pieces, opts.host_bytes - host_slots - p.host_expert_bytes)
    p.host_piece_bytes = sum(sum(_pieces.slot_sizes(plan.units[i], streamed_pieces[i], plan.align)[:k])
                             for i, k in p.host_pieces.items())
    p.piece_counts = {i: len(_pieces.slot_sizes(plan.units[i], n, plan.align)) for i, n in p.pieces.items()}
    p.host_ring_bytes = host_slots + p.host_piece_bytes if host or p.host_pieces else 0
    total = p.host_ring_bytes + p.host_expert_bytes
    avail, room = machine.host_available, policy.headroom(not cpu)
    # machine facts are read before the ring is allocated: the ring counts here on CUDA (pinned) and CPU alike
    if total and avail is not None and total + p.ring_bytes + room > avail:
        _refuse(p, strict, HostMemoryError(
            f"host_gb={opts.host_gb} takes {total / GiB:.3f} GiB of host memory but only "
            f"{max(0, avail - p.ring_bytes) / GiB:.3f} GiB is available ({machine.host_where}) beside the ring, and "
            f"{room >> 20} MiB is kept for the runtime; pass host_gb <= {max(0, avail - p.ring_bytes - room) / GiB:.3f}"))


def _device_memory(plan: Plan, opts: Options, p: Placement, config: Any, dist: Any, cpu: bool) -> None:
    """CUDA: the streamer's device pool (``prefetch + 1`` slots of the largest unit it copies, host-tier ones included;
    distributed: gathered whole) and the expert cache in what ``gpu_gb`` leaves."""
    if not cpu:
        copied = [u.index for u in plan.units if u.index not in set(p.resident) | set(p.rows)]
        full = ([q.full if q.gathered else u.buf_bytes for q, u in
                 zip(_dist.io_plans(plan.units, dist, _device(opts), plan.align), plan.units, strict=True)]
                if dist is not None else [u.dev_bytes if u.index in p.pieces else u.buf_bytes for u in plan.units])
        p.device_buffer_bytes = (opts.prefetch + 1) * policy.device_slot_bytes(max(full[i] for i in copied)) if copied else 0
    specs = p.specs
    if not specs:
        return
    p.expert_slot_bytes = slot = max(slot_layout(sp)[1] for sp in specs)
    left = (p.gpu_budget - p.resident_bytes_of(plan)
            - p.buffers_counted * (p.device_buffer_bytes // (opts.prefetch + 1)))
    if opts.expert_cache_gb is not None:
        room = int(opts.expert_cache_gb * GiB)
    elif not cpu:
        room = left - max(sp.num_experts * sp.expert_bytes for sp in specs)
    else:
        room = 0
    n = min(max(0, room) // slot, sum(sp.num_experts for sp in specs)) if slot else 0
    p.expert_cache_slots = n if n >= 1 else 0


def _per_token(plan: Plan, p: Placement, config: Any) -> None:
    """The bytes a decode token moves per tier (the prediction's inputs; :func:`predict`)."""
    p.resident_bytes = p.resident_bytes_of(plan)
    p.host_bytes = sum(plan.units[i].nbytes for i in p.host)
    p.streamed_bytes = sum(plan.units[i].src_bytes for i in p.streamed)
    for i, n_held in p.host_pieces.items():
        u, n = plan.units[i], p.pieces[i]
        held = _pieces.cut_all(u, n, plan.align)[:n_held]
        p.streamed_bytes -= sum(piece.src_bytes for piece, _, _ in held)
        p.host_bytes += sum(nbytes for _, _, nbytes in held)
    specs = p.specs
    if specs:
        k = top_k_of(config)
        in_host = [specs[i] for i in p.host_experts]
        p.expert_modules = len(specs)
        p.experts_total = sum(sp.num_experts for sp in specs)
        p.routed_expert_bytes = sum(min(k, sp.num_experts) * sp.expert_src_bytes for sp in specs)
        p.host_expert_modules = len(in_host)
        p.routed_host_bytes = sum(min(k, sp.num_experts) * sp.expert_src_bytes for sp in in_host)
        p.expert_hit_rate = p.expert_cache_slots / p.experts_total


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
