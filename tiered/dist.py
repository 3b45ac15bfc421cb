"""Several processes, one model: each rank streams 1/N of every unit and the unit is all-gathered.

The scheme is ZeRO-Inference's, on PyTorch's own distributed engine (``torchrun`` +
``torch.distributed``: NCCL between GPUs, gloo on the CPU). With ``tiered.load(..., distributed=True)``
under ``torchrun --nproc-per-node N``:

* every unit's layout (``Unit.nbytes`` bytes, targets at aligned offsets) is cut into N equal
  *chunks* of ``chunk = align_up(ceil(nbytes / N))`` bytes; rank ``r`` reads only the checkpoint
  bytes of layout bytes ``[r * chunk, (r + 1) * chunk)`` (:func:`split_unit`: for each target that
  overlaps the chunk, the matching element run of its source tensor, cast like any copy) into its
  own ring, and on CUDA copies that chunk (H2D) into its place in a full-size device buffer;
* before the unit runs, the full layout is assembled on every rank with one in-place all-gather
  (``all_gather_single``; ``all_gather_into_tensor`` before torch 2.12). On CUDA it is issued on a
  dedicated *gather stream* that waits for the chunk's H2D event, and the compute stream waits for
  the gather's event, never the host; over NVLink it overlaps the previous unit's compute;
* so host->GPU traffic and disk reads per rank are 1/N of the streamed bytes, together the ranks read
  each byte once per pass, and each rank's host RSS stays bounded by its own ring. The weights every
  rank computes with are the full ones, so each rank's outputs equal the one-process outputs bit for bit.

Collectives must be issued in the same order on every rank. Loads are not (a prefetch may be
cancelled on one rank and already running on another), so the all-gather is issued by the thread that
runs the model, when a pass first binds a unit (:meth:`tiered.streamer.Streamer.acquire`) — every rank
runs the same modules in the same order — and, for resident units, once at load in unit order. Each
rank runs its own batch (data parallel); ``generate`` then defaults to ``synced_gpus=True`` so that a
rank whose sequences finished keeps running passes until every rank is done (as transformers does for
DeepSpeed ZeRO-3). A rank that dies (an exception, Ctrl-C) leaves the others waiting in a collective
until ``torchrun`` stops the job (it does when a rank *exits*; a rank that hangs is not stopped, and the
others wait for the backend's timeout).

Units that cannot be cut (a conversion ``transformers`` computes from whole tensors, or a stacked
source placed non-contiguously) are read whole by every rank and not gathered: correct, not faster.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError, StreamerError
from .lossless import LosslessInfo, window
from .plan import Copy, Plan, Target, Unit

__all__ = ["Dist", "Single", "SINGLE", "IoPlan", "read_args", "resolve", "split_unit", "io_plans", "check_same_plan",
           "all_gather_bytes", "min_over_ranks", "from_rank0"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: ``rank`` of ``world`` processes in ``group`` (``backend``)."""

    group: Any  # torch.distributed.ProcessGroup (None: the default group)
    rank: int
    world: int
    backend: str

    # The strategy: what a load asks of the job (Single answers the same questions for one process).
    @property
    def shared(self) -> Dist:
        """The job whose ranks share each unit (all-gathers in the streamer and stage)."""
        return self

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a collective: every rank calls it)."""
        return min_over_ranks(self, value)

    def check_same_plan(self, plan: Plan, extra: tuple) -> None:
        """Refuse ranks that built different plans (:func:`check_same_plan`)."""
        check_same_plan(self, plan, extra)

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective)."""
        return from_rank0(self, value)


@dataclass(frozen=True)
class Single:
    """One process: the no-op strategy, so that a load asks the same questions whether it is distributed or not."""

    rank: int = 0
    world: int = 1

    @property
    def shared(self) -> None:
        return None

    def min(self, value: int) -> int:
        return value

    def check_same_plan(self, plan: Plan, extra: tuple) -> None:
        return None

    def agree(self, value: Any) -> Any:
        return value


#: The one-process job.
SINGLE = Single()


@dataclass(frozen=True)
class IoPlan:
    """How one unit is read on this rank.

    ``read``: the unit (or this rank's piece of it: 1-D runs of its targets) the reader fills;
    ``slot_bytes``: ring bytes it takes; ``read_at``: where in the slot ``read`` is placed (CPU: this
    rank's chunk offset in a full-size slot; CUDA: 0); ``at``/``chunk``/``full``: this rank's chunk in
    the full layout buffer (bytes), None when the unit is read whole (no gather).
    """

    read: Unit
    slot_bytes: int
    read_at: int = 0
    at: int | None = None
    chunk: int = 0
    full: int = 0

    @property
    def gathered(self) -> bool:
        return self.at is not None


def read_args(u: Unit, p: IoPlan | None) -> tuple[Unit, int, int]:
    """(what the reader fills, ring bytes the slot takes, offset in the slot) for unit ``u`` read as ``p``
    (None: the whole unit, as one process reads it)."""
    return (p.read, p.slot_bytes, p.read_at) if p is not None else (u, u.nbytes, 0)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def resolve(distributed: object, device: torch.device | None) -> Dist | Single:
    """The :class:`Dist` for ``distributed`` (``False``: none; ``True``: the default process group,
    initialised from ``torchrun``'s environment if it is not yet: ``nccl`` for CUDA, ``gloo`` for the
    CPU; a ``ProcessGroup``: that group). One process (``False``, or a world of one) is :data:`SINGLE`.

    Raises:
        ConfigError: ``distributed=True`` outside ``torchrun`` (no ``RANK``/``WORLD_SIZE`` in the
            environment) or a group whose backend does not match the device.
    """
    if distributed is False or distributed is None:
        return SINGLE
    import torch.distributed as tdist

    if not tdist.is_available():
        raise ConfigError("distributed=True but this torch build has no torch.distributed")
    if distributed is not True and not isinstance(distributed, tdist.ProcessGroup):
        raise ConfigError(f"distributed must be True, False or a torch.distributed.ProcessGroup, got {distributed!r}")
    group = None if distributed is True else distributed
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    if not tdist.is_initialized():
        if group is not None:
            raise ConfigError("distributed=<ProcessGroup> but torch.distributed is not initialised")
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise ConfigError(
                f"distributed=True needs its processes started by torchrun, one per GPU (or several on the CPU, "
                f"with gloo) ({' and '.join(missing)} not set): run `torchrun --standalone --nproc-per-node N "
                "script.py`, or call torch.distributed.init_process_group first"
            )
        cuda = device is not None and device.type == "cuda"
        try:
            if cuda:
                tdist.init_process_group("nccl", device_id=device)
            else:
                tdist.init_process_group("gloo")
        except ValueError as e:  # RANK/WORLD_SIZE set, but not the rest of torchrun's environment (MASTER_ADDR...)
            raise ConfigError(f"distributed=True: cannot join the torchrun job ({e}); start it with torchrun") from None
    world = tdist.get_world_size(group)
    if world == 1:
        return SINGLE
    backend = str(tdist.get_backend(group))
    if device is not None and device.type == "cuda" and "nccl" not in backend:
        raise ConfigError(f"device={device} needs the nccl backend to gather units, but the process group uses {backend}")
    return Dist(group, tdist.get_rank(group), world, backend)


def split_unit(unit: Unit, rank: int, world: int, align: int) -> tuple[Unit, int] | None:
    """This rank's piece of ``unit``: ``(piece, chunk)``, or None when the unit cannot be cut.

    ``piece`` is a :class:`~tiered.plan.Unit` (no module) of 1-D targets, one per run of a source
    tensor that lands in layout bytes ``[rank * chunk, (rank + 1) * chunk)``; reading it with
    :meth:`tiered.reader.Reader.read_unit` into ``chunk`` bytes gives exactly those layout bytes (gaps
    between targets are alignment padding, never read). Its ``src_bytes`` are the checkpoint bytes
    this rank reads. ``chunk`` is a multiple of ``align``, so runs start on element boundaries. A run of a
    losslessly coded source (:mod:`tiered.lossless`) is a :func:`~tiered.lossless.window` of it: the coded chunks
    covering the run, a chunk cut by the run's edge read and decoded by both pieces (its coded bytes count in both
    ``src_bytes``).

    None: the unit runs a ``transformers`` conversion on whole tensors (``Unit.converts``), decodes float8 codes
    (``Copy.decode``), or one of its stacked sources lands in a non-contiguous slice of its target.
    """
    if unit.converts or unit.coded_at is not None or any(c.decode is not None for t in unit.targets for c in t.copies):
        return None  # a conversion, float8 codes decoded whole (tiered.quant), or a unit decoded on the device
    chunk = _align(max(1, math.ceil(unit.nbytes / world)), align)
    lo, hi = rank * chunk, min(unit.nbytes, (rank + 1) * chunk)
    runs = plain_runs(unit.targets, lo, hi)
    if runs is None:
        return None
    piece = Unit(unit.index, unit.name, None, runs, nbytes=chunk,  # type: ignore[arg-type]
                 src_bytes=sum(r.copies[0].nbytes for r in runs))
    return piece, chunk


def plain_runs(targets: list[Target], lo: int, hi: int) -> list[Target] | None:
    """The 1-D targets that fill layout bytes ``[lo, hi)`` of ``targets`` (laid out plain, :func:`tiered.plan.lay_out`),
    at offsets from ``lo``: for each target that overlaps, the matching element run of each source (a coded source's
    :func:`~tiered.lossless.window`). ``lo`` and ``hi`` must lie on element boundaries of the targets they cut (the
    layout's ``align`` multiples do). None: a stacked source lands in a non-contiguous slice of its target."""
    runs: list[Target] = []
    for t in targets:
        isz = t.dtype.itemsize
        a, b = max(lo, t.offset), min(hi, t.offset + t.nbytes)
        whole = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for c in t.copies:
            if c.place is None:
                p = 0
            else:
                v = c.place(whole)
                if not v.is_contiguous() or v.numel() != c.src.numel:
                    return None
                p = v.storage_offset() - whole.storage_offset()
            if a >= b:
                continue
            x, y = max(p, (a - t.offset) // isz), min(p + c.src.numel, (b - t.offset) // isz)
            if x >= y:
                continue
            sisz = c.src.dtype.itemsize
            if isinstance(c.src, LosslessInfo):  # coded: the chunks covering the run (an edge chunk read by both sides)
                src = window(c.src, x - p, y - p)
            else:
                src = dataclasses.replace(c.src, offset=c.src.offset + (x - p) * sisz, shape=(y - x,),
                                          nbytes=(y - x) * sisz)
            runs.append(Target(f"{t.key}[{x}:{y}]", None, t.attr, t.is_param, (y - x,), t.dtype,  # type: ignore[arg-type]
                               copies=[Copy(src)], offset=t.offset + x * isz - lo))
    return runs


def io_plans(units: list[Unit], dist: Dist | None, device: torch.device, align: int) -> list[IoPlan]:
    """One :class:`IoPlan` per unit of ``units`` (detached from their modules) for this rank."""
    out = []
    for u in units:
        cut = split_unit(u, dist.rank, dist.world, align) if dist is not None else None
        if cut is None:
            out.append(IoPlan(u, u.nbytes))
            continue
        piece, chunk = cut
        at, full = dist.rank * chunk, dist.world * chunk  # type: ignore[union-attr]
        if device.type == "cuda":  # the ring holds the chunk; the device buffer the whole layout
            out.append(IoPlan(piece, chunk, 0, at, chunk, full))
        else:  # zero copy: the slot is the unit's memory, so it holds the whole layout
            out.append(IoPlan(piece, full, at, at, chunk, full))
    return out


def all_gather_bytes(dist: Dist, buf: torch.Tensor, at: int, chunk: int) -> None:
    """In place: ``buf[:world * chunk]`` (uint8) gets every rank's ``buf[r * chunk:(r + 1) * chunk]``.

    Called on the thread that runs the model; on CUDA it runs on the current stream's terms (the
    collective waits for the current stream and the current stream for it). Every rank must call it
    for the same unit in the same order.
    """
    import torch.distributed as tdist

    gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    try:
        gather(buf[: dist.world * chunk], buf[at : at + chunk], group=dist.group)
    except RuntimeError as e:
        raise StreamerError(f"all-gather of a unit failed on rank {dist.rank} of {dist.world}: {e}") from e


def _plan_signature(plan: Plan) -> list[tuple]:
    """Per unit: what each of its bytes means (target names, dtypes, shapes, offsets; source names, dtypes,
    shapes). Names and sizes alone are not enough: fp16 vs bf16, or two checkpoints of one architecture, give
    equal names and byte counts. File paths and offsets are left out (a resharded copy is legitimate)."""
    return [(u.name, u.nbytes,
             tuple((t.key, str(t.dtype), t.shape, t.offset,
                    tuple((c.src.name, str(c.src.dtype), tuple(c.src.shape)) for c in t.copies)) for t in u.targets),
             tuple((s.name, str(s.dtype), tuple(s.shape)) for cv in u.converts for ss in cv.sources.values() for s in ss))
            for u in plan.units]


def check_same_plan(dist: Dist, plan: Plan, extra: tuple) -> None:
    """Raise :class:`~tiered.errors.ConfigError` on every rank unless every rank built the same plan (units,
    and for each target its dtype, shape, offset and sources) with the same ``extra`` options: otherwise the
    ranks' all-gathers would not match and the job would hang or mix weights. (Two checkpoints with equal
    headers and different values are not told apart.)"""
    import hashlib

    import torch.distributed as tdist

    sig = _plan_signature(plan)
    mine = (hashlib.sha256(repr(extra).encode()).hexdigest(),
            [hashlib.sha256(repr(x).encode()).hexdigest() for x in sig])
    got: list[object] = [None] * dist.world
    tdist.all_gather_object(got, mine, group=dist.group)
    bad = [r for r, g in enumerate(got) if g != got[0]]
    if bad:
        ref = got[bad[0]] if dist.rank == 0 else got[0]  # the one to compare with: rank 0, or the first differing
        opts, units = ref  # type: ignore[misc]
        diff = next((i for i, (a, b) in enumerate(zip(mine[1], units, strict=False)) if a != b), None)
        if opts != mine[0]:
            what = f"their options differ (device type, embedding_rows; here {extra})"
        elif diff is not None:
            what = f"unit {plan.units[diff].name!r} differs (its tensors' names, dtypes or shapes)"
        else:
            what = f"{len(mine[1])} units here, {len(units)} there"
        raise ConfigError(
            f"rank {bad[0]} and rank 0 built different plans: {what}; every rank must load the same checkpoint "
            "with the same dtype, embedding_rows and device type, and the same transformers version"
        )


def min_over_ranks(dist: Dist, value: int) -> int:
    """The smallest ``value`` over all ranks (an int, e.g. a GPU budget in bytes)."""
    import torch.distributed as tdist

    got: list[object] = [None] * dist.world
    tdist.all_gather_object(got, int(value), group=dist.group)
    return min(int(g) for g in got)  # type: ignore[call-overload]


def from_rank0(dist: Dist, value: Any) -> Any:
    """Rank 0's ``value`` (any picklable object) on every rank."""
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, src=tdist.get_global_rank(dist.group, 0) if dist.group is not None else 0,
                                group=dist.group)
    return box[0]
