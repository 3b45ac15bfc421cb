"""The placement rules: which units stay on the GPU, which the host tier and the page-cache tier hold, which stream
in pieces, how much GPU memory the device buffers and the expert cache take. Pure functions of the plan, the options
and the machine facts (no allocation, no I/O); :func:`tiered.placement.place` applies them in one pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import RingTooSmallError
from .hostmem import PAGE_SIZE, page_up
from .stats import GiB

if TYPE_CHECKING:  # torch-free at import (the plan's modules import torch): `tiered inspect` asks auto_ring_bytes
    from collections.abc import Callable

    from .experts import ExpertSpec
    from .plan import Plan, Unit

__all__ = ["MIN_PIECE_BYTES", "PAGE_CACHE_MARGIN_BYTES", "GPU_HEADROOM_BYTES", "HOST_HEADROOM_BYTES",
           "CUDA_HOST_HEADROOM_BYTES", "gpu_budget", "fits_whole", "buffers_counted", "choose_resident", "choose_host",
           "host_slot_bytes", "piece_slot", "piece_room", "cut_pieces", "choose_host_pieces", "page_cache_reserve",
           "choose_page_cache_tier", "choose_host_experts", "headroom", "auto_ring_bytes", "MIN_AUTO_RING_BYTES",
           "auto_split", "auto_ring_want", "PIECE_RING_BYTES", "AUTO_RING_IN_PIECES", "pieces_ring_ok", "ring_ask",
           "DEVICE_ALIGN", "device_slot_bytes"]

#: CUDA device pool: each buffer's offset (bytes) is a multiple of this, so every dtype's view and the vectorised copy
#: kernels are aligned (``tiered.stage.DeviceArena``).
DEVICE_ALIGN = 512


def device_slot_bytes(largest: int) -> int:
    """One slot of the CUDA device pool: the largest buffer the streamer copies (bytes), rounded up to DEVICE_ALIGN."""
    return -(-largest // DEVICE_ALIGN) * DEVICE_ALIGN


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

#: io="auto" on the CPU: page cache kept free beside the page-cache tier (:func:`choose_page_cache_tier`) for the
#: runtime's own file pages (libraries, the tokenizer) and what the limit's accounting leaves out.
PAGE_CACHE_MARGIN_BYTES = 128 << 20

#: GPU memory left free for activations, KV cache and the CUDA context when ``gpu_gb`` is not given.
GPU_HEADROOM_BYTES = 4 * GiB


def headroom(cuda: bool) -> int:
    """Host memory kept for the runtime beside the ring and the host tier (bytes)."""
    return CUDA_HOST_HEADROOM_BYTES if cuda else HOST_HEADROOM_BYTES


#: The smallest ring ``ring_gb=None`` picks: below this the host is too full for tiered (HostMemoryError instead).
MIN_AUTO_RING_BYTES = 16 << 20


def auto_ring_bytes(host_available: int | None, host_where: str, cuda: bool, host_bytes: int) -> tuple[int, str]:
    """The ring ``ring_gb=None`` takes, in bytes, and why: ``DEFAULT_RING_GB`` (4 GiB) where the host can give it,
    else what ``host_available`` (``MemAvailable`` and every cgroup ``memory.max`` above the process:
    :func:`tiered.hostmem.host_memory_available`) leaves after :func:`headroom` and the host tier (``host_bytes``),
    rounded down to a page. The placement then refuses only what no smaller ring would run (a unit larger than
    this ring on the CPU). ``host_bytes``: the host tier, and on the CPU one MoE block's routed experts during its
    call. Below :data:`MIN_AUTO_RING_BYTES` left, returns 0 (the caller raises HostMemoryError; pass a smaller
    ``ring_gb`` for a model that small).

    A 2 GiB cgroup on the H200 machine (issue 23, 2026-12-01) left 1.37 GiB at load: 4 GiB was refused there,
    ``ring_gb=0.5`` ran; this picks 1.37 - 0.875 = 0.49 GiB on CUDA."""
    from .options import DEFAULT_RING_GB

    want = int(DEFAULT_RING_GB * GiB)
    if host_available is None:
        return want, f"the default {DEFAULT_RING_GB:g} GiB (host memory unknown here)"
    left = host_available - headroom(cuda) - host_bytes
    if left >= want:
        return want, f"the default {DEFAULT_RING_GB:g} GiB; {host_available / GiB:.2f} GiB available: {host_where}"
    left = max(0, left) // PAGE_SIZE * PAGE_SIZE
    kept = f"{headroom(cuda) >> 20} MiB for the runtime" + (
        f" and {host_bytes / GiB:.3g} GiB for the host tier and routed experts" if host_bytes else "")
    why = f"what {host_where} leaves ({host_available / GiB:.3f} GiB available) after {kept}"
    if left < MIN_AUTO_RING_BYTES:
        return 0, f"{why}: {left >> 20} MiB, less than the {MIN_AUTO_RING_BYTES >> 20} MiB tiered asks for"
    return left, f"{left / GiB:.3f} GiB: {why}"


def auto_ring_want(largest: int, prefetch: int) -> int:
    """The ring :func:`auto_split` asks for (bytes): ``prefetch + 1`` of the ``largest`` unit, at most
    :data:`~tiered.options.DEFAULT_RING_GB` unless one unit needs more, at least :data:`MIN_AUTO_RING_BYTES`, in whole
    pages."""
    from .options import DEFAULT_RING_GB

    return page_up(max(MIN_AUTO_RING_BYTES, min((prefetch + 1) * largest, max(int(DEFAULT_RING_GB * GiB), largest))))


#: CUDA, one process: the ring :func:`auto_split` asks for when every unit that streams can be read in pieces
#: (:func:`pieces_ring_ok`): three pieces of 64 MiB, one whose H2D runs while the next two are read
#: (:data:`tiered.sources.PIECES_IN_FLIGHT`); 64 MiB is 4 O_DIRECT requests of ``DIRECT_CHUNK`` (16 MiB), one for each
#: of the 4 default reader threads. A ring of ``prefetch + 1`` whole units holds nothing a pass needs more of: the device pool
#: holds the units loaded ahead, the ring only what is being read. So the memory a limit leaves would go to the host
#: tier, which saves its bytes on every pass (GPT-J-6B at 2 GiB: 0.29 GiB more host tier, ~3% fewer bytes per token;
#: Llama-3-8B at 4 GiB: ~1.0 GiB more, ~9% fewer: predictions, not measured).
PIECE_RING_BYTES = 192 << 20
#: Whether :func:`auto_split` sizes the ring for pieces (:data:`PIECE_RING_BYTES`). **Off** until measured on the GPU
#: against the whole-unit ring in alternating rounds (``benchmarks/run.py --scaling 2,4 --scaling-pieces-ring``): the
#: pieces path streamed 0.88-1.01x as fast as a whole-unit ring at equal bytes in one 2026-12-01 call
#: (benchmarks/NOTES.md, issue 9), within that call's noise. The 2026-12-06 session had no device time left to run it.
AUTO_RING_IN_PIECES = False


def ring_ask(largest: int, prefetch: int, pieces: bool = False) -> int:
    """The ring :func:`auto_split` asks for (bytes): :func:`auto_ring_want`, and with ``pieces`` (:func:`pieces_ring_ok`)
    at most :data:`PIECE_RING_BYTES`."""
    want = auto_ring_want(largest, prefetch)
    return min(want, PIECE_RING_BYTES) if pieces else want


def auto_split(total: int, largest: int, prefetch: int, streamed: int, at_least: int = 0,
               pieces: bool = False) -> tuple[int, int]:
    """``ring_gb`` and ``host_gb`` both left to tiered, and the model does not stay whole: how ``total`` bytes (what
    :func:`auto_ring_bytes` found the host leaves after the runtime's headroom) are shared between the ring and the
    host tier, as ``(ring_bytes, host_bytes)``, both page multiples.

    The ring takes ``prefetch + 1`` of the ``largest`` unit it must hold (page-rounded slot bytes): the streamer never
    holds more than the running unit and ``prefetch`` ahead, so a larger ring would hold nothing more; it takes at
    most :data:`~tiered.options.DEFAULT_RING_GB` unless one unit needs more, and never less than
    :data:`MIN_AUTO_RING_BYTES`. The rest goes to the host tier, up to ``streamed`` (the page-rounded slot bytes of
    the units that would stream): each of its bytes is read once at load instead of on every pass, while a byte
    more in the ring saves nothing. Measured on the 2-core CPU machine in a 2 GiB cgroup (TinyLlama-1.1B shape, bf16,
    cold; ``benchmarks/NOTES.md``, issue 23): the 1.2 GiB all in the ring ran at 0.64x accelerate's speed, a 0.25 GiB
    ring beside a 0.75 GiB host tier at 1.24-1.95x. ``largest`` is a unit that streams: on CUDA a resident unit passes
    through the ring once, at load, in pieces where it is larger (:mod:`tiered.pieces`); ``at_least``: bytes the ring
    must hold whole all the same (a resident unit that cannot be cut). ``pieces`` (CUDA, :func:`pieces_ring_ok`): the
    ring asks for no more than :data:`PIECE_RING_BYTES`, units larger than it stream in pieces."""
    ring = min(max(ring_ask(largest, prefetch, pieces), page_up(at_least)), total // PAGE_SIZE * PAGE_SIZE)
    host = max(0, min(total - ring, page_up(streamed))) // PAGE_SIZE * PAGE_SIZE
    return ring, host


def pieces_ring_ok(plan: Plan, streamed: list[int], align: int) -> bool:
    """CUDA, one process, ``ring_gb`` and ``host_gb`` left to tiered: whether :func:`auto_split` sizes the ring for
    pieces (:data:`PIECE_RING_BYTES`): :data:`AUTO_RING_IN_PIECES`, no unit losslessly coded or stored (decoded after
    the copy: those keep the whole-unit ring they were measured with, issues 24 and 25), and every unit of
    ``streamed`` (indices) that is larger than that ring can be cut into pieces that fit a third of it."""
    from . import pieces as _pieces

    if not AUTO_RING_IN_PIECES:
        return False
    room = piece_room(PIECE_RING_BYTES)
    for u in plan.units:
        if u.coded_at is not None or _decoded(u):
            return False
    for i in streamed:
        u = plan.units[i]
        if page_up(u.nbytes) > PIECE_RING_BYTES and (not _pieces.cuttable(u) or _pieces.count(u, room, align) is None):
            return False
    return True


def gpu_budget(gpu_gb: float | None, gpu_free: int | None) -> int:
    """Bytes of GPU memory for resident units: ``gpu_gb``, or what is free (``gpu_free``) minus
    ``GPU_HEADROOM_BYTES``; 0 when neither is known (the CPU)."""
    if gpu_gb is not None:
        return int(gpu_gb * GiB)
    return gpu_free - GPU_HEADROOM_BYTES if gpu_free is not None else 0


def fits_whole(plan: Plan, ring_bytes: int, cpu: bool, budget: int) -> bool:
    """Whether the whole model would stay loaded: in the ring (CPU), or in the GPU ``budget`` (bytes) with every unit
    fitting the ring to be loaded through it (CUDA). Then nothing is routed: every expert stays."""
    if cpu:
        return resident_ring_bytes(plan) <= ring_bytes
    return plan.dev_bytes <= budget and page_up(plan.max_unit.nbytes) <= ring_bytes


def buffers_counted(gpu_gb: float | None, prefetch: int) -> int:
    """Device buffers (each the largest streamed unit) counted inside the GPU budget. An explicit ``gpu_gb`` counts
    the resident units and one buffer, the unit being computed, as accelerate's ``max_memory`` counts its weights
    and reserves one offloaded layer (``infer_auto_device_map``'s largest layer): so at the same number as
    ``max_memory`` at least as many bytes stay resident; the ``prefetch`` other buffers come on top. The default
    budget (free memory - ``GPU_HEADROOM_BYTES``) counts all ``prefetch + 1``: it must fit what is free."""
    return 1 if gpu_gb is not None else prefetch + 1


def resident_ring_bytes(plan: Plan, slot_need: list[int] | None = None) -> int:
    """Ring bytes (page-rounded slots) that hold every unit of ``plan`` at once, on the CPU: a unit whose slot would
    hold the same bytes as an earlier one's (a tied head after its embedding, :func:`tiered.plan.same_bytes`) is
    bound to that unit's tensors instead (:meth:`tiered.streamer.Streamer.load_resident`) and takes none.
    ``slot_need``: each unit's slot bytes by index (default ``Unit.nbytes``)."""
    from .plan import same_bytes

    twins = same_bytes(plan.units)
    sizes = slot_need or [u.nbytes for u in plan.units]
    return sum(page_up(sizes[u.index]) for u in plan.units if u.index not in twins)


def choose_resident(plan: Plan, ring: int, cpu: bool, budget: int, buffers: int,
                    rows: set[int] = frozenset(),  # type: ignore[assignment]
                    slot_need: list[int] | None = None) -> set[int]:
    """Units to load once and keep. ``rows``: embeddings that can read their rows on demand instead: on CUDA
    they are resident only when the whole model fits the budget (and the ring); otherwise they read rows.
    ``slot_need``: ring bytes each unit's slot takes (distributed on the CPU: N equal chunks, a little more
    than ``Unit.nbytes``); default ``Unit.nbytes``. ``budget``: GPU bytes (:func:`gpu_budget`); ``buffers``: device
    buffers counted in it (:func:`buffers_counted`)."""
    if cpu:
        # The ring is the only memory: keep everything there when it all fits, else stream everything. A unit holding
        # the same bytes as an earlier one (a tied head after its embedding: tiered.plan.same_bytes) takes no slot of
        # its own when both stay: it is bound to the earlier one's tensors, as stock ties them
        return {u.index for u in plan.units} if resident_ring_bytes(plan, slot_need) <= ring else set()
    too_big = {i for i in rows if page_up(plan.units[i].nbytes) > ring}
    if plan.dev_bytes <= budget and not too_big:
        return {u.index for u in plan.units}
    # Largest units first: what streams then needs the smallest device buffers. Embeddings that read their
    # rows on demand are never chosen: a token costs them a few rows, so the budget goes to units that
    # would stream whole (and they need no device buffer either).
    chosen: set[int] = set()
    order = sorted((u for u in plan.units if u.index not in rows), key=lambda u: -u.dev_bytes)
    for u in order:  # device bytes: a stored unit (decoded after the H2D copy) takes its decoded layout there
        streamed_max = max((v.buf_bytes for v in plan.units if v.index not in chosen | {u.index} | rows), default=0)
        pool = buffers * streamed_max
        used = sum(plan.units[i].dev_bytes for i in chosen) + u.dev_bytes
        if used + pool <= budget:
            chosen.add(u.index)
    return chosen


def choose_host(plan: Plan, resident: set[int], rows: set[int], slot_need: list[int], host_gb: float) -> set[int]:
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
    from .plan import same_bytes

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


def host_slot_bytes(plan: Plan, host: set[int], slot_need: list[int]) -> int:
    """Host-tier bytes of the whole units ``host`` (page-rounded slots; a unit sharing a twin's slot counted once)."""
    from .plan import same_bytes

    twins = same_bytes([plan.units[i] for i in sorted(host)])
    return sum(page_up(slot_need[i]) for i in host if i not in twins)


def piece_slot(u: Unit, n: int, align: int) -> int:
    """Bytes of one ring (or host-tier) slot of ``u`` read in ``n`` pieces (:func:`tiered.pieces.slot_bytes`: the
    largest piece's)."""
    from . import pieces as _pieces

    return _pieces.slot_bytes(u, n, align)


#: CUDA, one process: also cut into pieces a unit the ring holds whole but not twice (:func:`cut_pieces`). With such
#: a ring the next unit's read waits for this one's H2D to finish and its slot to be freed: the disk idled 4-10% of
#: every pass at 2 GiB (``Stats.disk_busy`` 0.90-0.96 in the eleven runs of ``benchmarks/results/2026-12-07-*``;
#: GPT-J-6B and Llama-3-8B, rings of 0.48-0.50 GiB, units of 0.40-0.41 GiB). In pieces (a third of the ring each)
#: the next piece is read while one's H2D runs; each piece's ring slot is shifted so that O_DIRECT reads it straight
#: into the slot (:class:`tiered.sources.PiecesSource`), as a whole unit's is. **Off** until measured on the GPU
#: against whole units in the same rounds (``benchmarks/run.py --scaling 2 --scaling-pieces-cut``).
PIECES_WHEN_ONE_FITS = False


#: CPU, one process: read a linear unit (a head) that the ring holds whole but not beside the largest other unit it
#: streams in pieces of output rows through :data:`HEAD_PIECE_SLOTS` ring slots of :data:`HEAD_PIECE_BYTES` of its own
#: (:class:`tiered.linear_pieces.RingLinearPieces`), so that the disk reads the next pass's first layer while the head
#: computes and a piece while the one before it computes. Measured where it was built (the 2-core CPU machine, the
#: Llama-3-8B shape in a 2 GiB cgroup, cold): the head's 0.98 GiB in a 1.197 GiB ring left the disk idle 35-55 ms
#: before the head and 80-107 ms after it, of each 1.3 s token (``benchmarks/NOTES.md``, twenty-second session).
#: **Off**: it closed those gaps but ran 5% slower there in six alternating rounds against whole units (median 1.420
#: against 1.353 s/token, ``benchmarks/run.py --scaling 2 --scaling-head-pieces``, twenty-third session; two cores
#: shared by four reader threads and the compute may be what bounds that host, not the disk).
HEAD_IN_RING_PIECES = False
#: Bytes of one piece of such a head (64 MiB: four 16 MiB O_DIRECT requests, one per default reader thread).
HEAD_PIECE_BYTES = 64 << 20
#: Ring slots such a head reads into: one piece computed while the next two are read.
HEAD_PIECE_SLOTS = 3


def head_piece_slot_bytes() -> int:
    """One slot of :data:`HEAD_PIECE_SLOTS` (bytes): a piece and a page for its O_DIRECT shift."""
    return page_up(HEAD_PIECE_BYTES) + PAGE_SIZE


def choose_head_pieces(plan: Plan, copied: list[int], others: list[int], need: list[int], ring_bytes: int,
                       eligible: Callable[[Unit], bool]) -> dict[int, int]:
    """CPU (:data:`HEAD_IN_RING_PIECES`): the unit read in pieces through slots of its own, as ``{unit index: rows per
    piece}`` (at most one: the largest such), or ``{}``. A unit qualifies when it is copied into the ring (``copied``),
    ``eligible`` (:func:`tiered.linear_pieces.ring_piece_eligible`), the ring holds it but not beside the largest
    other unit that takes ring room (``others``: streamed, copied or mapped), and the ring less the slots still holds
    two of those (one runs while the next loads)."""
    from .linear_pieces import PIECE_ALIGN

    if not HEAD_IN_RING_PIECES:
        return {}
    slots = HEAD_PIECE_SLOTS * head_piece_slot_bytes()
    best: Unit | None = None
    for i in copied:
        u = plan.units[i]
        rest = max((page_up(need[j]) for j in others if j != i), default=0)
        if (eligible(u) and page_up(need[i]) <= ring_bytes < page_up(need[i]) + rest
                and 2 * rest + slots <= ring_bytes and u.nbytes > slots and (best is None or u.nbytes > best.nbytes)):
            best = u
    if best is None:
        return {}
    row = next(t for t in best.targets if t.attr == "weight")
    row_bytes = row.shape[1] * row.dtype.itemsize
    rows = HEAD_PIECE_BYTES // row_bytes // PIECE_ALIGN * PIECE_ALIGN
    return {best.index: rows} if rows >= PIECE_ALIGN else {}


def _decoded(u: Unit) -> bool:
    """Whether a copy of ``u`` is decoded after it is read (losslessly coded, or float8 codes)."""
    return any(getattr(c.src, "coded", None) is not None or c.decode is not None for t in u.targets for c in t.copies)


def cut_pieces(units: list[Unit], ring_bytes: int, ring_gb: float, align: int) -> dict[int, int]:
    """CUDA, one process: for each unit larger than the ring (with :data:`PIECES_WHEN_ONE_FITS`, also one larger than
    half of it, where its pieces' room is at least :data:`MIN_PIECE_BYTES`) that can be cut (:func:`tiered.pieces.cuttable`: no
    whole-tensor conversion, no float8 codes decoded whole), the number of pieces it is read in — each piece's slot
    at most :func:`piece_room` (a third of the ring, or half), so the next piece is read while one is waited for and
    the last one's H2D runs (:data:`tiered.sources.PIECES_IN_FLIGHT`).

    Raises:
        RingTooSmallError: a unit needs pieces but half the ring is below :data:`MIN_PIECE_BYTES`.
    """
    from . import pieces as _pieces
    from .ring import gib_up

    room = piece_room(ring_bytes)
    out: dict[int, int] = {}
    for u in units:
        whole = page_up(u.nbytes) <= ring_bytes
        if whole and (not PIECES_WHEN_ONE_FITS or 2 * page_up(u.nbytes) <= ring_bytes or room < MIN_PIECE_BYTES
                      or u.coded_at is not None or _decoded(u)):
            continue  # (never refused for want of room for its pieces; a unit decoded after the copy stays whole)
        if not _pieces.cuttable(u):
            continue  # cannot be cut: attach's check names it and the ring it needs whole
        if room < MIN_PIECE_BYTES:
            raise RingTooSmallError(
                f"unit {u.name!r} ({u.nbytes / GiB:.3f} GiB) is larger than the ring and is read in pieces, but "
                f"ring_gb={ring_gb} cannot hold two pieces of {MIN_PIECE_BYTES >> 20} MiB; pass ring_gb >= "
                f"{gib_up(2 * (MIN_PIECE_BYTES + 2 * PAGE_SIZE))}"
            )
        n = _pieces.count(u, room, align)
        if n is not None:  # (None: a coded chunk larger than a piece; the placement lays such a unit out plain)
            out[u.index] = n
    return out


def piece_room(ring_bytes: int) -> int:
    """The largest slot (bytes, page multiple) of one piece of a unit larger than a ring of ``ring_bytes``: a third
    of the ring, or half when a third is below :data:`MIN_PIECE_BYTES` (:func:`cut_pieces`)."""
    third = ring_bytes // 3 // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
    return third if third >= MIN_PIECE_BYTES else ring_bytes // 2 // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE


def choose_host_pieces(plan: Plan, pieces: dict[int, int], budget: int) -> dict[int, int]:
    """CUDA: what the host tier holds of streamed units larger than the ring (``pieces``: unit index -> pieces) with
    the ``budget`` bytes whole units and experts left: unit index -> how many of its first pieces. Taken one piece
    per unit in turn, in execution order, so the streamed bytes left are spread over the pass (as
    :func:`choose_host` spreads whole units). Each held piece is one the ring does not read per pass."""
    from . import pieces as _pieces

    out: dict[int, int] = {}
    order = sorted(pieces)
    sizes = {i: _pieces.slot_sizes(plan.units[i], pieces[i], plan.align) for i in order}  # each real piece's slot
    for r in range(max(map(len, sizes.values()), default=0)):
        took = False
        for i in order:
            need = sizes[i][r] if r < len(sizes[i]) else 0
            if r < len(sizes[i]) and out.get(i, 0) == r and need <= budget:
                out[i] = r + 1
                budget -= need
                took = True
        if not took:
            break
    return out


def page_cache_reserve(threads: int) -> int:
    """Bytes of the page-cache room the page-cache tier leaves alone: the reader's O_DIRECT staging (``threads`` x
    ``DIRECT_CHUNK``) and :data:`PAGE_CACHE_MARGIN_BYTES`."""
    from .reader import DIRECT_CHUNK

    return threads * DIRECT_CHUNK + PAGE_CACHE_MARGIN_BYTES


def choose_page_cache_tier(plan: Plan, taken: set[int], slot_need: list[int], ring_bytes: int, host_gb: float,
                           threads: int, room: int | None) -> set[int]:
    """``io="auto"`` on the CPU when it picked O_DIRECT (the model does not fit the page-cache room): streamed units
    that compute on the file mapping (zero copy) instead of being read O_DIRECT, within the page cache the limit
    still leaves once the ring and the host tier are filled, spread over the execution order (as the host tier).
    Their pages stay in the page cache between passes — the other units' O_DIRECT reads never enter it, so nothing
    cycles it out — and a pass reads only the rest from disk: the cgroup's spare memory, which a model larger than
    it would otherwise thrash through, becomes a tier of its own. Page cache is reclaimable, so a wrong estimate
    costs re-reads (page faults), never an OOM kill. Kept out of it: what the running unit maps, the reader's O_DIRECT
    staging and :data:`PAGE_CACHE_MARGIN_BYTES`. ``room``: the page cache's room (:attr:`Machine.page_cache_room`)."""
    from .reader import zero_copy_eligible

    if room is None:
        return set()
    cands = [u for u in plan.units if u.index not in taken and zero_copy_eligible(u)]
    if not cands:
        return set()
    spare = room - ring_bytes - int(host_gb * GiB) - max(page_up(u.nbytes) for u in cands) - page_cache_reserve(threads)
    if spare <= 0:
        return set()
    others = {u.index for u in plan.units} - {u.index for u in cands}
    return choose_host(plan, others, set(), slot_need, spare / GiB)


def choose_host_experts(specs: list[ExpertSpec], left: int) -> list[int]:
    """Routed experts modules (indices into ``specs``, forward order) whose every expert goes into the host tier
    with the ``left`` bytes the host tier's units leave (each module's parts page-rounded, as
    :class:`~tiered.experts.HostExperts` allocates them). Units come first: a streamed unit in the host tier saves
    all its bytes of every pass, an experts module only the k/E of them a token routes to."""
    from .experts import HostExperts

    chosen = []
    for i, sp in enumerate(specs):
        n = HostExperts.bytes_for(sp)
        if n <= left:
            chosen.append(i)
            left -= n
    return chosen


#: reader threads for a plain checkpoint (one stream of requests does not saturate NVMe; issue 23's sweeps on the
#: H200's disk: 4, 8 and 16 threads read at the same rate)
READER_THREADS = 4
#: most reader threads chosen for a losslessly coded checkpoint
MAX_DECODE_THREADS = 16


def reader_threads(asked: int | None, coded: bool, cpu: bool, cores: int | None,
                   room: int | None = None) -> tuple[int, str]:
    """Reader threads and why: ``asked`` when given; else :data:`READER_THREADS`, or, when the checkpoint is
    losslessly coded (:mod:`tiered.lossless`: the reader threads read *and* decode each chunk, ~1.1 GB/s of output
    per thread, where the disk gives 1.4-2 GB/s of coded bytes), more: on CUDA the cores less two (the model's
    thread and the copy stage), on the CPU half the cores (the other half computes), at least
    :data:`READER_THREADS`, at most :data:`MAX_DECODE_THREADS`. Measured on the H200 machine (16 cores; Llama-3-8B
    shape, 6 layers, 2 GiB cgroup, cold): the coded twin at 4 threads 2.79 s/token, at 8 threads 2.09, the plain
    twin 2.3-2.9 with either (benchmarks/NOTES.md, issue 25). ``room``: host bytes left after the runtime's headroom
    (None: unknown); the extra threads' decode buffers (:func:`extra_reader_bytes`) take at most an eighth of it, so
    that more threads never take the memory a ring needs."""
    if asked is not None:
        return asked, "given (threads)"
    if not coded or not cores:
        return READER_THREADS, "automatic: the default" + ("" if not coded else " (cores unknown)")
    want = min(MAX_DECODE_THREADS, cores // 2 if cpu else cores - 2)
    n = max(READER_THREADS, want)
    capped = ""
    if room is not None and extra_reader_bytes(n) > room // 8:
        n = READER_THREADS + max(0, room // 8) // DECODE_THREAD_BYTES
        capped = f"; capped by memory: {DECODE_THREAD_BYTES >> 20} MiB a thread beyond {READER_THREADS}, at most 1/8 " \
                 f"of the {room >> 20} MiB left"
    share = f"{n}, the floor, on {cores} cores" if n == READER_THREADS and want < READER_THREADS else (
        f"{n} of {cores} cores")
    return n, (f"automatic: {share}, the checkpoint is losslessly coded (the readers decode it"
               f"{'; half the cores compute' if cpu else ''}{capped})")


#: host bytes one reader thread holds while it decodes coded chunks (tiered/reader.py: its O_DIRECT staging
#: DIRECT_CHUNK, its coded and plain chunk buffers, the zstd planes' scratch; grown, never shrunk). Measured on the H200
#: (issue 25, third session): VmHWM 2.34-2.38 GiB with 14 reader threads against 2.18 with 4, i.e. ~18 MiB a thread
#: while DIRECT_CHUNK was 8 MiB; it is 16 MiB since the sixteenth session, so 8 MiB more.
DECODE_THREAD_BYTES = 28 << 20


def extra_reader_bytes(threads: int) -> int:
    """Host bytes that reader threads beyond :data:`READER_THREADS` hold (:data:`DECODE_THREAD_BYTES` each): the
    automatic ring and host tier leave them out, as they leave out the runtime's headroom (the default's threads are
    inside that headroom)."""
    return max(0, threads - READER_THREADS) * DECODE_THREAD_BYTES


def compute_threads(asked: int | str | None, reader_threads: int, cores: int | None, streams_on_cpu: bool) -> int | None:
    """torch's CPU compute threads to set (``torch.set_num_threads``), or None to leave torch as it is.

    ``asked``: the ``compute_threads`` option (None: leave; ``"auto"``: below; N: N). ``"auto"``: where units stream
    on the CPU (``streams_on_cpu``), ``cores - min(reader_threads, cores // 2)``, at least 1 — the cores the reader
    threads leave, the readers taking at most half (they wait on the disk part of the time); the caller never raises
    torch above its own setting. Why: torch's default (a thread per core) beside busy readers oversubscribes the
    cores; measured on the 2-core CPU machine (issue 26), SmolLM2 streamed: 0.4-0.7 tokens/s, 7.5-8.2 with one
    compute thread."""
    if asked is None:
        return None
    if asked != "auto":
        return int(asked)
    if not streams_on_cpu or not cores:
        return None
    return max(1, cores - min(reader_threads, cores // 2))
