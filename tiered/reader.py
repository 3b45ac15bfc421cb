"""Readers: copy a unit's checkpoint spans from the shards into its ring slot.

Backend ``"mmap"`` (the reader's default; ``tiered.load``'s ``io="auto"`` picks it where the model fits the page
cache): each shard is opened and mapped once, read-only, with
``MADV_SEQUENTIAL``. After a span is copied into the ring, its pages are dropped from the process
with ``madvise(MADV_DONTNEED)`` — pages touched through a mapping count in RSS (``RssFile``) until
dropped, which is the classic way to break a memory bound. ``drop_page_cache=True`` also asks the
kernel to evict them from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``).

Backend ``"direct"``: ``O_DIRECT`` ``os.preadv`` of the page-aligned superset of each chunk into
a page-aligned per-thread staging buffer (``DIRECT_CHUNK`` bytes), then a copy into the slot
keeping the offset. It bypasses the page cache entirely, which matters on low-RAM hosts and in
cgroups that charge page cache; the staging buffers add ``threads * DIRECT_CHUNK`` bytes of RSS.
Where a run of a unit's tensors lies in the slot at the file's offset modulo the page (:func:`slot_shift`: the ring
source shifts the slot's start so that the unit's largest such run does), the run's whole pages are read with
``O_DIRECT`` straight into the slot — no staging copy, which cost ~20% of the 2-core CPU machine's disk rate (16 MiB
requests: 1.00-1.10 GB/s through staging, 1.24-1.37 straight into the destination; ``benchmarks/read_ways.py``,
benchmarks/NOTES.md, issue 23, sixteenth session) — and only its first and last partial pages go through the staging buffer
(:data:`SLOT_DIRECT`; :attr:`Reader.slot_direct_bytes` counts the bytes read so).

Backend ``"pread"``: buffered ``os.preadv`` from the page cache straight into the ring slot (through
the per-thread staging buffer when the copy casts). The kernel copies out of the page cache, so no
page of the file is ever mapped into the process (no ``RssFile`` to drop, no ``MADV_DONTNEED`` TLB
shootdowns, no page-fault lock shared by the threads) and kernel readahead serves cold reads.

``adapt=True`` (``io="auto"`` when it picks O_DIRECT): the reader measures both cold-read backends while it
streams — O_DIRECT, and buffered ``pread`` (kernel readahead) followed by ``posix_fadvise(POSIX_FADV_DONTNEED)`` of
what it copied, so the page cache never holds more than what is in flight — alternating them unit by unit until
each has read :data:`PROBE_UNITS` units and :data:`PROBE_BYTES` bytes, then keeps the one with the higher
bytes per second of its reads' wall time (the union of the intervals its copy tasks ran; O_DIRECT unless buffered is
:data:`PROBE_MARGIN` faster). Where O_DIRECT is kept, the same measurement then runs over its read shapes
(:func:`read_shapes`: request size x requests in flight, from :data:`SHAPES`; the depth is held by a gate each O_DIRECT
request passes, :class:`_Gate`) and keeps the fastest (the default unless another is :data:`SHAPE_MARGIN` faster). After
the choice the chosen way's rate is checked over each :data:`REPROBE_BYTES`; a window under :data:`REPROBE_DROP` x the
rate it was chosen at starts the whole measurement again (the disk changed). :attr:`Reader.choice` says what was
measured and chosen. Issue 9: on the H200's virtual
disk either could win from one day to the next. Wall time, not the sum of each task's copy time: with many threads
and small requests, buffered reads that kernel readahead had already fetched looked fast per task while the disk
delivered less (issue 25, fifth session: a 14-thread exp3 twin chose pread at "0.99 vs 0.21 GB/s" and then read 0.82
GB/s where O_DIRECT gave the plain twin 1.4-1.5, in a 2 GiB cgroup).

Copies run on a small thread pool (``torch`` copies release the GIL); a large tensor is split into
chunks so several page-fault streams are in flight — one stream does not saturate NVMe.
Casting (a fp32 checkpoint run in bf16) happens in the same copy: ``dest.copy_(src)``.

Each shard is a :class:`~tiered.shard_map.ShardMap` (the mapping, its page dropping and the changed-file check;
re-exported here).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import errno
import math
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import expcode, faults, quant
from .errors import CodecError, ConfigError, TieredError, TruncatedShardError
from .format import Checkpoint, TensorInfo
from .hostmem import PAGE_SIZE as _PAGE
from .hostmem import anon_mapping, map_tensor, try_unmap
from .lossless import EXP3, LosslessInfo, crc32, decode_chunk
from .plan import Unit
from .shard_map import ShardMap

__all__ = ["ShardMap", "Reader"]
_CHUNK = 32 << 20  # bytes per copy task: big enough for readahead, small enough to spread over threads
#: bytes per O_DIRECT read (each reader thread's staging buffer holds one: x threads = staging RSS). 16 MiB: on the
#: H100's virtual disk, four threads reading a GPT-J-6B unit sequence in 8 MiB requests through the staging buffer ran
#: at 1.15-1.23 GB/s against 1.64-1.79 for 16 MiB requests (``benchmarks/read_ways.py``, 3 rounds), and in a 2 GiB
#: cgroup tiered's defaults took 7.83 and 7.36 s/token with 8 MiB against 6.47 and 6.51 with 16 (6.13 and 6.74 with
#: 32; accelerate 7.87 and 7.50) in one invocation (benchmarks/NOTES.md, issue 23, sixteenth session).
DIRECT_CHUNK = 16 << 20
#: O_DIRECT reads straight into the ring slot where a run of tensors lies there at its file offset modulo the page
#: (module docstring); False: every O_DIRECT read through the staging buffer (the A/B of ``benchmarks/run.py
#: --scaling-staged``)
SLOT_DIRECT = True
#: coded bytes per read task of a losslessly coded tensor: consecutive chunks up to this many are read in one request,
#: then decoded in turn (0: one chunk, ~2.8 MiB coded, per task). 0 because 8 MiB tasks made the 2-core CPU machine's
#: compressed TinyLlama 1.3-1.8x slower per token (fewer, longer tasks per unit: the unit waits for its last one's
#: decode; benchmarks/NOTES.md, issue 25, third session); on the H200 the 8 MiB figure was not measured.
LOSSLESS_READ = 0
#: Coded bytes per read task of a stored exp3 tensor (consecutive whole chunks, one request of up to this many bytes,
#: then each chunk's CRC-32 and block starts checked; no CPU decode). 8 MiB, as :data:`DIRECT_CHUNK` was then: one ~2.8 MiB
#: chunk per request made the H200's cold exp3 twin read 1.16 GB/s against the plain twin's ~2.0 GB/s in 8 MiB
#: requests (benchmarks/NOTES.md, issue 25, fifth session).
RAW_READ = 8 << 20
#: a pair's third item (:meth:`Reader._pairs`): read the exp3 tensor's coded chunks as they lie (CRC-checked)
RAW_CODED = object()
#: adapt=True: unit reads each backend makes before the choice, and bytes it must have read (both must be reached)
PROBE_UNITS = 4
PROBE_BYTES = 256 << 20
#: adapt=True: how much faster (bytes per second of wall time) buffered reads must be to replace O_DIRECT, which keeps the
#: page cache out of the picture (a cgroup charges it) and measured as fast or faster on most runs of issue 9
PROBE_MARGIN = 1.10
#: adapt=True, once O_DIRECT is chosen: the read shapes measured against each other, as (request bytes, depth) — depth:
#: O_DIRECT requests in flight at once, at most the reader threads — given as multiples of (:data:`DIRECT_CHUNK`, the
#: reader threads); the first is the default and the incumbent. Issue 23 measured each way of reading win on some disk:
#: one thread faster than four (1.65 vs 1.42 GB/s, eleventh session, call 3) and four faster than one (1.59 vs 1.48,
#: call 1); 16 MiB requests faster than 8 MiB (1.64-1.79 vs 1.15-1.23 GB/s, sixteenth session) — so the shape is
#: measured on the disk at hand, not fixed (benchmarks/NOTES.md).
SHAPES = ((1, 1.0), (2, 1.0), (1, 0.5), (4, 0.0))
#: how much faster (bytes per second of wall time) another read shape must be to replace the incumbent
SHAPE_MARGIN = 1.05
#: adapt=True, after the choice: the chosen way's rate is checked over each window of this many bytes read; a window
#: slower than :data:`REPROBE_DROP` x the rate it was chosen at starts the measurement again (the disk changed: issue
#: 23's eleventh session saw the same O_DIRECT reads fall from 1.76 to 1.10 GB/s within six minutes)
REPROBE_BYTES = 4 << 30
REPROBE_DROP = 0.70
#: bytes of float8 codes one decode task reads (its float32 temporary is 4x this, per reader thread)
DECODE_CHUNK = 2 << 20


def _decode_band(row_bytes: int, bm: int) -> int:
    """Rows of float8 codes per decode task: :data:`DECODE_CHUNK` bytes of rows of ``row_bytes``, whole block rows
    (``bm``) where one fits."""
    band = max(1, DECODE_CHUNK // max(1, row_bytes))
    return band // bm * bm if bm <= band else band


def zero_copy_eligible(unit: Unit) -> bool:
    """Whether ``unit`` can compute on views of the file mapping as it is (CPU zero copy): every target is one
    checkpoint tensor of the same dtype and shape, at an offset that is a multiple of its itemsize (as
    ``from_pretrained`` maps it), and nothing is converted."""
    if unit.converts or not unit.targets:
        return False
    for t in unit.targets:
        if len(t.copies) != 1 or t.copies[0].place is not None or t.copies[0].decode is not None \
                or isinstance(t.copies[0].src, LosslessInfo):  # coded bytes on the mapping: decoded into the ring
            return False
        s = t.copies[0].src
        if s.dtype != t.dtype or tuple(s.shape) != tuple(t.shape) or s.offset % max(1, s.dtype.itemsize):
            return False
    return True


def _run_job(fut: Future, fn: Any, args: tuple) -> None:
    """A reader thread: run ``fn(*args)`` into ``fut`` unless ``fut`` was cancelled first."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - the caller re-raises it
        fut.set_exception(e)


#: The states of a job that will never write again (``concurrent.futures``' own names).
_OVER = ("CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED")


def _wait_all(jobs: list[Future], *, cancel: bool = False) -> None:
    """Until every job is done (finished or cancelled); a Ctrl-C meanwhile cancels the jobs not started yet and is
    raised once the running ones have finished. ``cancel``: cancel the jobs not started yet first (the caller is
    giving up: an error or an interrupt) — inside the same guarded loop, so that a second Ctrl-C landing while they are
    cancelled is caught too and the wait goes on (before, it escaped from the caller's cancel loop while a copy still
    wrote into the slot the caller then freed: a helper's attack, twenty-second session).

    A cancelled job counts as done at once: it never runs (:func:`_run_job` checks first), so the memory it would
    have written may be freed. ``concurrent.futures.wait`` alone counts a cancelled future done only once a worker has
    taken it off the pool's queue, which a job never submitted never is: a Ctrl-C between a job's ``jobs.append`` and
    its ``pool.submit`` (:meth:`Reader._go`), or a submit refused at interpreter exit (the pool's threads are stopped
    before ``atexit`` runs ``tiered``'s close), left the loader thread waiting for ever — a script that ended while a
    unit was being read took 3 x ``CLOSE_WAIT_S`` = 90 s to exit (found 2026-12-07). The state is read without the
    future's lock (one attribute read): an interrupt inside a ``Condition``'s ``__enter__`` can leave that lock held."""
    interrupted: BaseException | None = None
    while True:
        try:
            if cancel or interrupted is not None:
                for f in jobs:
                    f.cancel()
            wait([f for f in jobs if f._state not in _OVER])
            break
        except BaseException as e:  # noqa: BLE001 - re-raised below, once nothing writes any more
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


def _chunk_runs(src: LosslessInfo, limit: int) -> list[list[int]]:
    """``src``'s chunks in runs of consecutive ones of at most ``limit`` coded bytes (a chunk larger than ``limit``,
    or ``limit`` 0: a run of its own): one read request each."""
    runs: list[list[int]] = []
    size = 0
    for c in src.chunks:
        n = src.coded.chunk_span(c)[1]
        if not runs or size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(c)
        size += n
    return runs


def read_shapes(threads: int) -> list[tuple[int, int]]:
    """The O_DIRECT read shapes ``(request bytes, depth)`` the reader measures with ``threads`` reader threads
    (:data:`SHAPES` scaled, depth at least 1 and at most ``threads``, duplicates dropped; the default first)."""
    out: list[tuple[int, int]] = []
    for k, f in SHAPES:
        shape = (k * DIRECT_CHUNK, max(1, min(threads, int(threads * f))))
        if shape not in out:
            out.append(shape)
    return out


def auto_measures(threads: int) -> str:
    """What ``io="auto"`` resolved to O_DIRECT (``Reader(adapt=True)``) measures while the first units stream, in
    words (``tiered inspect`` prints it; :attr:`Reader.choice` / ``tiered.stats(model).io_choice`` say what was kept):
    the backends (:data:`PROBE_UNITS`, :data:`PROBE_BYTES`, :data:`PROBE_MARGIN`), then O_DIRECT's read shapes for
    ``threads`` reader threads (:func:`read_shapes`, :data:`SHAPE_MARGIN`), then the watch
    (:data:`REPROBE_BYTES`, :data:`REPROBE_DROP`)."""
    shapes = ", ".join(shape_name(r, d) for r, d in read_shapes(threads))
    return (f"measured while streaming: O_DIRECT against buffered pread, each >= {PROBE_UNITS} unit reads and "
            f"{PROBE_BYTES >> 20} MiB, pread kept only if {PROBE_MARGIN - 1:.0%} faster; then O_DIRECT's read shapes "
            f"({shapes}; another kept only if {SHAPE_MARGIN - 1:.0%} faster than the first); measured again when a "
            f"{REPROBE_BYTES >> 30} GiB window reads under {REPROBE_DROP:.2f}x the kept rate; tiered.stats(model) says "
            "what was kept")


def shape_name(request: int, depth: int) -> str:
    """``"16 MiB x4"``: requests of 16 MiB, four in flight (KiB under a MiB)."""
    return f"{request / (1 << 20):g} MiB x{depth}" if request >= 1 << 20 else f"{request / 1024:g} KiB x{depth}"


class _Gate:
    """O_DIRECT requests in flight, each with its read's depth: a request enters only while fewer than its own depth
    *and* fewer than the smallest depth of those running are in flight, so no request ever runs beside more than its
    depth less one others (a shallow read is measured alone, not beside the tail of a deep one)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._running: collections.Counter[int] = collections.Counter()

    def enter(self, depth: int) -> None:
        with self._cv:
            while (n := sum(self._running.values())) >= depth or (n and n >= min(self._running)):
                self._cv.wait()
            self._running[depth] += 1

    def leave(self, depth: int) -> None:
        with self._cv:
            self._running[depth] -= 1
            if not self._running[depth]:
                del self._running[depth]
            self._cv.notify_all()


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (> 0: at least one nanosecond)."""
    tot, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            tot += b - max(a, end)
            end = b
    return max(tot, 1e-9)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-D uint8 view (also for one element with a stride other than 1, which torch
    counts as contiguous but will not view as bytes through ``reshape(-1)``: a slice such as ``x[::2]`` of two)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _whole_copy(tgt: Any, c: Any) -> bool:
    """``c`` copies a plain checkpoint tensor byte for byte into the whole of ``tgt`` (no cast, slice or decode)."""
    return (len(tgt.copies) == 1 and c.place is None and c.decode is None and c.at is None
            and not isinstance(c.src, LosslessInfo) and c.src.dtype == tgt.dtype and c.src.nbytes == tgt.nbytes)


def slot_shift(unit: Unit, gran: int = 1) -> int:
    """Bytes (``0 <= shift < PAGE_SIZE``, a multiple of ``gran``) to start ``unit``'s layout after the start of a
    page-aligned slot so that most of its bytes lie at their file offset modulo the page: those tensors' whole pages
    can then be read with ``O_DIRECT`` straight into the slot (:meth:`Reader._submit_slot_direct`). Chosen by bytes
    (the largest sum of ``nbytes`` of whole-tensor copies sharing one residue); 0 when no residue gathers two pages.
    ``gran``: the slot is used in place (CPU: :data:`tiered.plan.CPU_ALIGN`, which keeps every tensor's address
    modulo 64 as the plan laid it out); 1 where the slot is only copied from (CUDA: the H2D copy). The shift is also
    a multiple of every item size the unit's slot is viewed as (targets, sources, scales): torch views a dtype only at
    a multiple of its item size (attack of 2026-12-07: fp32 tensors 2 bytes off in the file)."""
    weight: collections.Counter[int] = collections.Counter()
    sizes = [1]  # every dtype the slot is viewed as: a view's start must be a multiple of its item size
    for tgt in unit.targets:
        sizes.append(tgt.dtype.itemsize)
        for c in tgt.copies:
            sizes.append(c.src.dtype.itemsize)
            scale = getattr(c.decode, "scale", None)
            if scale is not None:
                sizes.append(scale.dtype.itemsize)
            if _whole_copy(tgt, c):
                weight[(c.src.offset - tgt.offset) % _PAGE] += c.src.nbytes
    step = math.lcm(max(1, gran), *sizes)
    best = max(((w, -r) for r, w in weight.items() if r % step == 0), default=(0, 0))
    return -best[1] if best[0] >= 2 * _PAGE else 0


@dataclasses.dataclass
class _Run:
    """Checkpoint bytes ``[a, b)`` of one file that lie in memory at ``address = file offset + delta`` (``delta`` a
    multiple of the page): one or more whole tensors, each right after the one before."""

    file: Path
    delta: int
    a: int
    b: int
    names: list[tuple[int, str]]  # (file offset, tensor name) of each tensor, in file order
    flat: torch.Tensor  # the whole storage of the destinations, uint8
    base: int  # flat.data_ptr()

    def name_at(self, x: int) -> str:
        return self.names[max(0, bisect.bisect_right([o for o, _ in self.names], x) - 1)][1]

    def out(self, x0: int, x1: int) -> torch.Tensor:
        """Where file bytes ``[x0, x1)`` go (uint8)."""
        return self.flat[x0 + self.delta - self.base : x1 + self.delta - self.base]


class Reader:
    """Copies units from a checkpoint into ring slots on ``threads`` reader threads.

    Args:
        ckpt: the parsed checkpoint (each shard is mapped once, here).
        threads: reader threads (disk parallelism).
        drop_pages: ``madvise(MADV_DONTNEED)`` each span after copying it (keep True: it is what
            bounds RSS; False exists to show that the bound breaks without it).
        drop_page_cache: also ``posix_fadvise(POSIX_FADV_DONTNEED)`` (for cgroups that charge page cache).
        io: ``"mmap"``, ``"pread"`` or ``"direct"``.
        adapt: with ``io="direct"``: measure O_DIRECT against buffered ``pread`` + ``DONTNEED`` while streaming and
            keep the faster, then O_DIRECT's read shapes, and measure again when the chosen way slows (module
            docstring); :attr:`choice` reports it.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        *,
        threads: int = 4,
        drop_pages: bool = True,
        drop_page_cache: bool = False,
        io: str = "mmap",
        adapt: bool = False,
    ):
        if io not in ("mmap", "direct", "pread"):
            raise ConfigError(f"io={io!r}: use 'mmap' (page cache), 'pread' (page cache, read(2)) or 'direct' (O_DIRECT)")
        coded = next((t for t in ckpt.tensors.values() if isinstance(t, LosslessInfo) and t.coded.codec != EXP3),
                     None)  # exp3 decodes with numpy (CPU) or Triton (GPU): zstandard only for zstd-coded tensors
        if coded is not None:
            try:
                import zstandard  # noqa: F401
            except ImportError:
                raise TieredError(f"{coded.file}: a losslessly compressed checkpoint (`tiered reshard --compress`) "
                                  "needs the zstandard package: pip install 'tiered[compress]'") from None
        if any(isinstance(t, LosslessInfo) and t.coded.codec == EXP3 for t in ckpt.tensors.values()):
            from . import native

            native.exp3()  # the CPU decoder of exp3 chunks built (or its absence said) here, not in a reader thread
        self.io = io
        # drop_pages=False is the naive loader (plain mmap, no advice at all): the counter-proof of the RSS bound
        self.maps = {s.path: ShardMap(s.path, sequential=drop_pages) for s in ckpt.shards}
        self.direct_fds: dict[Path, int] = {}
        if io == "direct":
            for s in ckpt.shards:
                try:
                    self.direct_fds[s.path] = os.open(s.path, os.O_RDONLY | os.O_DIRECT)
                except OSError as e:
                    for fd in self.direct_fds.values():
                        os.close(fd)
                    raise ConfigError(
                        f"{s.path}: cannot open with O_DIRECT ({e.strerror}); this file system does not support "
                        "it: use io='mmap'"
                    ) from None
        self._local = threading.local()
        self._stages: list[mmap.mmap] = []
        self._stage_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tiered-read")
        self.drop_pages = drop_pages
        self.drop_page_cache = drop_page_cache
        self.threads = max(1, threads)
        #: the O_DIRECT read shape in use, ``(request bytes, depth)`` (with ``adapt``: measured, :func:`read_shapes`)
        self.shape: tuple[int, int] = (DIRECT_CHUNK, self.threads)
        self._gate = _Gate()
        # adapt: the measurement under way ("backend", "shape"; None: watching the chosen way), its ways of reading
        # (arms: (backend, request bytes, depth)) and per arm [unit reads, bytes, copy seconds, (start, end) of each
        # copy]; after the choice, _watch = [bytes, (start, end) spans, GB/s it was chosen at]
        self.adapt = adapt and io == "direct"
        self._phase: str | None = None
        self._arms: list[tuple[str, int, int]] = []
        self._probe: dict[tuple[str, int, int], list] = {}
        self._watch: list = [0, [], 0.0]
        self._probe_lock = threading.Lock()
        self._turns: dict[tuple, int] = {}
        self._kinds: collections.Counter = collections.Counter()  # keys seen per kind of read (key[1])
        #: adapt=True: ``{"direct_gbps", "pread_gbps", "chosen", "reprobes"}`` once the backend is chosen (GB/s = 1e9
        #: bytes per second of the way's reads' wall time), and once O_DIRECT's read shape is too, ``"shapes"``
        #: (``{shape_name: GB/s}``), ``"request"`` (bytes) and ``"depth"``; ``reprobes``: measurements started again
        #: because the chosen way slowed (:data:`REPROBE_DROP`)
        self.choice: dict[str, Any] | None = None
        #: the number of times the measurement started again
        self.reprobes = 0
        #: called with a copy of :attr:`choice` each time it changes (on a reader thread, holding the reader's probe
        #: lock: it must not call back into the reader)
        self.on_choice: Any = None
        if self.adapt:
            self._start("backend")
        #: bytes of the model dtype decoded from stored codes so far (tiered.quant); ``on_decoded(n)`` is called with
        #: each band's bytes on the reader thread that decoded it (the loader passes ``Stats.add_decoded``)
        self.decoded_bytes = 0
        self.on_decoded: Any = None
        #: bytes read with ``O_DIRECT`` straight into a slot, no staging copy (:data:`SLOT_DIRECT`); ``on_slot_direct(n)``
        #: is called with each request's bytes on the reader thread that read them (the loader passes
        #: ``Stats.add_slot_direct``)
        self.slot_direct_bytes = 0
        self.on_slot_direct: Any = None

    def _stage(self) -> tuple[mmap.mmap, torch.Tensor]:
        st = getattr(self._local, "stage", None)
        if st is None:
            mm = anon_mapping(DIRECT_CHUNK + 2 * _PAGE)
            st = (mm, map_tensor(mm))
            self._local.stage = st
            with self._stage_lock:
                self._stages.append(mm)
        return st

    def _copy_direct(self, t: TensorInfo, dest: torch.Tensor, lo: int, hi: int) -> None:
        """O_DIRECT read of elements ``[lo, hi)`` of ``t`` via the thread's staging buffer."""
        isz = t.dtype.itemsize
        a, b = t.offset + lo * isz, t.offset + hi * isz
        A, B = a // _PAGE * _PAGE, (b + _PAGE - 1) // _PAGE * _PAGE
        mm, stage = self._stage()
        n = self._direct_read(t.file, memoryview(mm)[: B - A], A)
        if n < b - A:
            raise TruncatedShardError(
                f"{t.file}: tensor {t.name!r} ends at offset {b} but only {A + n} bytes could be read; "
                "the file is truncated: re-download or re-convert it"
            )
        src = stage[a - A : b - A]
        if dest.dtype == t.dtype and dest.is_contiguous():
            _bytes_of(dest)[lo * isz : hi * isz].copy_(src)
        else:
            typed = (src if (a - A) % isz == 0 else src.clone()).view(t.dtype)
            dest.reshape(-1)[lo:hi].copy_(typed)

    def _direct_read(self, file: Path, buf: memoryview, offset: int) -> int:
        """:meth:`_pread_direct` as one request of this reader thread's way of reading: it waits for the way's depth
        (:class:`_Gate`) only around the request itself, so the staging copy, a decode or a CRC check after it runs
        beside other requests (held for a whole task, a depth-1 shape decoded float8 and zstd on one thread at a
        time, a cost its measurement of read seconds never saw: attack of session 18); the wait is not read time
        (:meth:`_measured` leaves it out)."""
        depth = getattr(self._local, "depth", None)
        if depth is None:
            return self._pread_direct(file, buf, offset)
        t0 = time.perf_counter()
        self._gate.enter(depth)
        self._local.waited = getattr(self._local, "waited", 0.0) + time.perf_counter() - t0
        try:
            return self._pread_direct(file, buf, offset)
        finally:
            self._gate.leave(depth)

    def _pread_direct(self, file: Path, buf: memoryview, offset: int) -> int:
        """One ``O_DIRECT`` ``preadv`` of ``len(buf)`` bytes at ``offset`` (both page multiples, ``buf``
        page-aligned) into ``buf``; returns the bytes read (fewer only at the end of the file).

        Raises:
            ConfigError: the kernel refused the request (EINVAL: a file system without O_DIRECT)."""
        try:
            return os.preadv(self.direct_fds[file], [buf], offset)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise ConfigError(f"{file}: O_DIRECT read refused (EINVAL); use io='mmap'") from None
            raise

    def _submit_slot_direct(self, jobs: list[Future], unit: Unit, pairs: list, size: int,
                            arm: tuple[str, int, int]) -> list:
        """Queue, as tasks of :meth:`_span_task`, the pairs that lie in memory at their file offset modulo the page
        (whole tensors of the checkpoint's dtype into contiguous destinations), merged into runs of tensors that follow
        each other with no gap both in one file and in memory: each run's whole pages in requests of at most ``size``
        bytes read with ``O_DIRECT`` straight into place, its partial first and last pages through the staging buffer,
        so that no byte outside the pairs' destinations is ever written. Returns the pairs left for the other paths (in
        their order)."""
        def direct(p: tuple) -> bool:
            if len(p) > 2:
                return False
            src, dest = p
            return (not isinstance(src, LosslessInfo) and getattr(src, "decode", None) is None and src.numel > 0
                    and src.file in self.direct_fds and dest.device.type == "cpu" and dest.dtype == src.dtype
                    and dest.is_contiguous() and dest.numel() == src.numel
                    and (dest.data_ptr() - src.offset) % _PAGE == 0)

        cand = [i for i, p in enumerate(pairs) if direct(p)]
        if not cand:
            return pairs
        cand.sort(key=lambda i: (str(pairs[i][0].file), pairs[i][1].data_ptr() - pairs[i][0].offset, pairs[i][0].offset))
        runs: list[tuple[_Run, list[int]]] = []
        for i in cand:
            src, dest = pairs[i]
            d, a, b = dest.data_ptr() - src.offset, src.offset, src.offset + src.nbytes
            store = dest.untyped_storage().data_ptr()
            if runs:
                r, members = runs[-1]
                # the next tensor, right after it in both, in the same memory (two storages may touch: attack of 12-07)
                if r.file == src.file and r.delta == d and r.b == a and r.base == store:
                    r.b = b
                    r.names.append((a, src.name))
                    members.append(i)
                    continue
            flat = torch.empty(0, dtype=torch.uint8).set_(dest.untyped_storage())
            runs.append((_Run(src.file, d, a, b, [(a, src.name)], flat, flat.data_ptr()), [i]))
        taken: set[int] = set()
        step = max(_PAGE, size // _PAGE * _PAGE)
        for r, members in runs:
            A, B = -(-r.a // _PAGE) * _PAGE, r.b // _PAGE * _PAGE
            if B - A < _PAGE:  # not one whole page: as any other tensor
                continue
            taken.update(members)
            spans = ([(r.a, A)] if r.a < A else []) + [(x, min(B, x + step)) for x in range(A, B, step)] + (
                [(B, r.b)] if B < r.b else [])
            for x0, x1 in spans:
                self._go(jobs, arm, self._span_task, (unit, r, x0, x1, arm[0]))
        return [p for i, p in enumerate(pairs) if i not in taken] if taken else pairs

    def _span_task(self, unit: Unit, r: _Run, x0: int, x1: int, backend: str) -> None:
        """A reader thread: file bytes ``[x0, x1)`` of run ``r`` into place — with ``O_DIRECT`` straight into the
        slot when both ends are on a page, else (a run's partial first or last page) through the staging buffer.

        Raises:
            TruncatedShardError: the file ends before ``x1`` (names the tensor and offset).
            ConfigError: O_DIRECT refused (:meth:`_pread_direct`)."""
        t0 = time.perf_counter()
        name = r.name_at(x0)
        faults.hit("read", unit=unit.name, tensor=name, offset=x0, io=backend)
        out = r.out(x0, x1)
        if x0 % _PAGE == 0 and x1 % _PAGE == 0:
            A, n = x0, self._direct_read(r.file, memoryview(out.numpy()), x0)
        else:
            A, B = x0 // _PAGE * _PAGE, -(-x1 // _PAGE) * _PAGE
            mm, stage = self._stage()
            n = self._direct_read(r.file, memoryview(mm)[: B - A], A)
        if A + n < x1:
            raise TruncatedShardError(
                f"{r.file}: tensor {r.name_at(max(x0, A + n))!r} needs bytes up to offset {x1} or later but the file "
                f"ends at {A + n}; the file is truncated: re-download or re-convert it")
        if A != x0 or x1 % _PAGE:  # through the staging buffer
            out.copy_(stage[x0 - A : x1 - A])
        else:
            with self._probe_lock:
                self.slot_direct_bytes += x1 - x0
            if self.on_slot_direct is not None:
                self.on_slot_direct(x1 - x0)
        if self.adapt:
            self._measured(x1 - x0, time.perf_counter() - t0)

    @staticmethod
    def _pread_into(fd: int, out: torch.Tensor, offset: int, t: TensorInfo) -> None:
        """Buffered ``preadv`` of ``out.numel()`` bytes at file ``offset`` into ``out`` (uint8, contiguous)."""
        mv = memoryview(out.numpy())
        got, n = 0, out.numel()
        while got < n:
            k = os.preadv(fd, [mv[got:]], offset + got)
            if k <= 0:
                raise TruncatedShardError(
                    f"{t.file}: tensor {t.name!r} needs bytes up to offset {offset + n} but the file ends at "
                    f"{offset + got}; the file is truncated: re-download or re-convert it"
                )
            got += k

    def _copy_pread(self, t: TensorInfo, dest: torch.Tensor, lo: int, hi: int, *, drop: bool = False) -> None:
        """``pread`` of elements ``[lo, hi)`` of ``t`` from the page cache into ``dest`` (contiguous)."""
        isz = t.dtype.itemsize
        a, n = t.offset + lo * isz, (hi - lo) * isz
        fd = self.maps[t.file].fd
        if dest.dtype == t.dtype:
            self._pread_into(fd, _bytes_of(dest)[lo * isz : hi * isz], a, t)
        else:  # a cast: read this chunk (<= DIRECT_CHUNK bytes) into the staging buffer, cast from there
            _, stage = self._stage()
            self._pread_into(fd, stage[:n], a, t)
            dest.reshape(-1)[lo:hi].copy_(stage[:n].view(t.dtype))
        if self.drop_page_cache or drop:
            os.posix_fadvise(fd, a, n, os.POSIX_FADV_DONTNEED)

    def _start(self, phase: str) -> None:
        """Begin measuring ``phase``'s ways of reading (under ``_probe_lock`` or before the threads run): "backend",
        O_DIRECT in the shape in use against buffered ``pread``; "shape", each of :func:`read_shapes`."""
        self._phase = phase
        if phase == "backend":
            self._arms = [("direct", *self.shape), ("pread", DIRECT_CHUNK, self.threads)]
        else:
            shapes = read_shapes(self.threads)
            if self.shape in shapes:  # the incumbent first
                shapes.remove(self.shape)
            self._arms = [("direct", *s) for s in [self.shape, *shapes]]
        self._probe = {a: [0, 0, 0.0, []] for a in self._arms}
        self._turns.clear()
        self._kinds.clear()

    def _arm(self, key: tuple) -> tuple[str, int, int]:
        """The way of reading, ``(backend, request bytes, depth)``, of the next read of ``key`` (a unit, and whether
        the read is the whole unit or some of its routed experts): ``io`` in :attr:`shape`; with ``adapt`` while
        measuring, each of the phase's ways in turn *for that key*, so over passes all time the same reads (one turn
        for all reads would give each kind of read, e.g. a MoE pass's alternating layers and expert reads, always the
        same way); each key's first turn is the number of keys *of its kind* seen before it, so within one pass the
        ways alternate unit by unit among the layer reads and among the expert reads (a whole pass in one way would
        give each way another stretch of time on a disk that drifts; counted over all keys, the two kinds' alternation
        gave each way one kind only for a whole pass)."""
        with self._probe_lock:
            if self._phase is None:
                return (self.backend, *self.shape)
            if key not in self._turns:  # the keys' first turns staggered: one pass alternates the ways unit by unit,
                # counted per kind of read (key[1]): counted over all keys, a MoE pass's alternating layer and expert
                # reads put every layer read on even turns and every expert read on odd ones, so a measurement ending
                # within a pass compared layer reads on one way with expert reads on another (attack of session 18)
                self._turns[key] = self._kinds[key[1]] - 1
                self._kinds[key[1]] += 1
            n = self._turns[key] = self._turns[key] + 1
            return self._arms[n % len(self._arms)]

    def _measured(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` copied in the ``seconds`` up to now by this reader thread's task, in its way of reading (set by
        :meth:`_armed`). While measuring: once every way of the phase has read :data:`PROBE_UNITS` units and
        :data:`PROBE_BYTES` bytes, choose by bytes per second of wall time (:func:`_union` of its copies' intervals);
        after the choice: the chosen way's rate over each :data:`REPROBE_BYTES`, measured again when it falls under
        :data:`REPROBE_DROP` x the rate it was chosen at."""
        arm = getattr(self._local, "arm", None)
        if arm is None:
            return
        now = time.perf_counter()
        seconds = max(1e-9, seconds - getattr(self._local, "waited", 0.0))  # not the gate's wait (_direct_read)
        self._local.waited = 0.0
        with self._probe_lock:
            if self._phase is None:  # the chosen way: watch its rate
                if arm != (self.backend, *self.shape) and not (arm[0] == "pread" == self.backend):
                    return  # a read queued before the choice
                w = self._watch
                w[0] += nbytes
                w[1].append((now - seconds, now))
                if w[0] < REPROBE_BYTES:
                    return
                gbps = w[0] / _union(w[1]) / 1e9
                self._watch = [0, [], w[2]]
                if gbps >= REPROBE_DROP * w[2]:
                    return
                self.reprobes += 1
                self._start("backend")
                return
            rec = self._probe.get(arm)
            if rec is None:  # a read queued in an earlier phase
                return
            rec[1] += nbytes
            rec[2] += seconds
            rec[3].append((now - seconds, now))
            recs = self._probe.values()
            if not all(r[0] >= PROBE_UNITS and r[1] >= PROBE_BYTES and r[2] > 0 for r in recs):
                return
            rate = {a: r[1] / _union(r[3]) / 1e9 for a, r in self._probe.items()}
            if self._phase == "backend":
                direct, pread = self._arms
                dg, pg = rate[direct], rate[pread]
                chosen = "pread" if pg > PROBE_MARGIN * dg else "direct"
                kept = {k: v for k, v in (self.choice or {}).items()
                        if chosen == "direct" or k not in ("shapes", "request", "depth")}  # no O_DIRECT shape on pread
                self.choice = {**kept, "direct_gbps": dg, "pread_gbps": pg, "chosen": chosen,
                               "reprobes": self.reprobes}
                if chosen == "direct" and len(read_shapes(self.threads)) > 1:
                    self._start("shape")
                else:
                    self._phase, self._watch = None, [0, [], pg if chosen == "pread" else dg]
            else:
                incumbent = self._arms[0]
                best = max(self._arms, key=lambda a: rate[a])
                if rate[best] < SHAPE_MARGIN * rate[incumbent]:
                    best = incumbent
                self.shape = best[1:]
                self.choice = {**(self.choice or {}), "shapes": {shape_name(*a[1:]): rate[a] for a in self._arms},
                               "request": best[1], "depth": best[2], "reprobes": self.reprobes}
                self._phase, self._watch = None, [0, [], rate[best]]
            if self.on_choice is not None:  # under the lock: two choices in quick succession reach it in order
                self.on_choice(dict(self.choice))

    def _unit_started(self, arm: tuple[str, int, int]) -> None:
        with self._probe_lock:
            rec = self._probe.get(arm) if self._phase is not None else None
            if rec is not None:
                rec[0] += 1

    def _armed(self, arm: tuple[str, int, int], fn: Any, args: tuple) -> Any:
        """A reader thread: run ``fn(*args)`` as a read in way ``arm`` — each of its O_DIRECT requests waits for the
        arm's depth (:class:`_Gate`: every O_DIRECT request counts, so a shallow read never overlaps a deep one;
        :meth:`_direct_read`), and :meth:`_measured` credits its bytes to the arm."""
        self._local.depth = arm[2] if arm[0] == "direct" else None  # each O_DIRECT request waits: _direct_read
        self._local.waited = 0.0
        self._local.arm = arm if self.adapt else None
        try:
            return fn(*args)
        finally:
            self._local.arm = self._local.depth = None

    def _go(self, jobs: list[Future], arm: tuple[str, int, int], fn: Any, args: tuple) -> None:
        """Queue ``fn(*args)`` on the reader threads as a read in way ``arm`` (:meth:`_armed`). Its future is in
        ``jobs`` before the pool has it, so a Ctrl-C between two statements here cannot lose a copy that is writing
        into the caller's memory."""
        fut: Future = Future()
        jobs.append(fut)
        self.pool.submit(_run_job, fut, self._armed, (arm, fn, args))

    @property
    def backend(self) -> str:
        """The backend unit reads use now (with ``adapt``: ``io`` until the choice, then the chosen one)."""
        return self.choice["chosen"] if self.choice is not None else self.io

    def _copy(self, t: TensorInfo, dest: torch.Tensor, lo: int, hi: int, backend: str | None = None) -> None:
        """Copy elements ``[lo, hi)`` of ``t`` (flattened) into the same elements of ``dest`` with ``backend``
        (default: ``io``)."""
        backend = backend or self.io
        if backend == "direct" and dest.is_contiguous():
            self._copy_direct(t, dest, lo, hi)
            return
        if backend == "pread" and dest.is_contiguous():
            self._copy_pread(t, dest, lo, hi, drop=self.adapt)
            return
        m = self.maps[t.file]
        isz = t.dtype.itemsize
        if dest.dtype == t.dtype and dest.is_contiguous():
            _bytes_of(dest)[lo * isz : hi * isz].copy_(m.span(t.offset + lo * isz, (hi - lo) * isz))
        elif lo == 0 and hi == t.numel:
            dest.copy_(m.tensor(t))
        else:  # a chunk of a cast into a contiguous target: only this chunk's elements
            dest.view(-1)[lo:hi].copy_(m.elements(t, lo, hi))
        if self.drop_pages:
            m.drop(t.offset + lo * isz, (hi - lo) * isz, page_cache=self.drop_page_cache)

    def _submit(self, jobs: list[Future], arm: tuple[str, int, int], *args: Any) -> None:
        """Queue ``_task(*args)`` on the reader threads as a read in way ``arm`` (:meth:`_go`)."""
        self._go(jobs, arm, self._task, args)

    def _task(self, unit: Unit, t: TensorInfo, dest: torch.Tensor, lo: int, hi: Any, backend: str | None = None,
              dec: Any = None) -> None:
        t0 = time.perf_counter()  # the fault seam inside the timed span: a test can make one backend slow
        if dec is not None:  # lo: the matrix; hi: its rows (r0, r1) — or, for a non-contiguous dest, (0, numel)
            faults.hit("read", unit=unit.name, tensor=t.name, offset=t.offset, io=backend or self.io)
            if isinstance(hi, tuple) and hi[0] == "mxfp4":
                took = self._decode_mxfp4(t, dest, lo, hi[1], hi[2], backend or self.io, dec)
                nbytes = (hi[2] - hi[1]) * t.shape[2] * 16
            elif isinstance(hi, tuple):
                g0, cols = lo * t.shape[-2] + hi[0], dest.shape[-1]  # (a packed source has fewer columns)
                took = self._decode(t, dest.reshape(-1, cols)[g0 : g0 + hi[1] - hi[0]], lo, hi[0], hi[1],
                                    backend or self.io, dec)
                nbytes = (hi[1] - hi[0]) * t.shape[-1] * t.dtype.itemsize
            else:  # a non-contiguous destination: band by band into its strided rows (a placed slice of a stack)
                rows, cols = t.shape[-2:]
                band = _decode_band(cols * t.dtype.itemsize, dec.block[0])
                took = 0.0
                lead = tuple(t.shape[:-2])
                try:
                    dv, temp = dest.view(t.shape), False
                except RuntimeError:  # strides that cannot take the source's shape: through one whole temporary
                    dv, temp = torch.empty(t.shape, dtype=dest.dtype), True
                for e in range(t.numel // max(1, rows * cols)):
                    mat = dv[tuple(int(i) for i in np.unravel_index(e, lead))] if lead else dv
                    for r in range(0, rows, band):
                        r1 = min(rows, r + band)
                        took += self._decode(t, mat[r:r1], e, r, r1, backend or self.io, dec)
                if temp:
                    dest.copy_(dv.view(dest.shape))
                nbytes = t.nbytes
            if self.adapt:
                self._measured(nbytes, took)
            return
        faults.hit("read", unit=unit.name, tensor=t.name, offset=t.offset + lo * t.dtype.itemsize, io=backend or self.io)
        self._copy(t, dest, lo, hi, backend)
        if self.adapt:  # time this copy for its way of reading
            self._measured((hi - lo) * t.dtype.itemsize, time.perf_counter() - t0)

    def read_unit(self, unit: Unit, slot: torch.Tensor) -> int:
        """Fill ``slot`` (uint8, >= ``unit.nbytes``) with ``unit``'s tensors at their layout offsets.

        Runs the copies on the reader threads and returns, bytes read, only once every copy has
        finished — also when one fails, so the caller may free ``slot`` as soon as this returns or
        raises. The first exception of any copy is re-raised here.

        Raises:
            ShardChangedError: a shard was replaced, truncated or rewritten since it was opened.
        """
        self._check_files(unit)
        self.copy_all(unit, self._pairs(unit, slot), lambda: [self._convert(unit, conv, slot) for conv in unit.converts])
        return unit.src_bytes

    def _check_files(self, unit: Unit) -> None:
        for path in {c.src.file for tgt in unit.targets for c in tgt.copies} | {
            c.decode.scale.file for tgt in unit.targets for c in tgt.copies if c.decode is not None} | {
            s.file for conv in unit.converts for ss in conv.sources.values() for s in ss
        }:
            self.maps[path].check()

    @staticmethod
    def _pairs(unit: Unit, slot: torch.Tensor) -> list[tuple[TensorInfo, torch.Tensor]]:
        pairs: list = []
        for tgt in unit.targets:
            if tgt.copies and tgt.copies[0].at is not None:  # stored (plan.lay_out): codes and scales as they lie
                for c in tgt.copies:
                    if c.decode is None:  # exp3 (plan.device_coded): the coded chunks, CRC-checked, not decoded
                        pairs.append((c.src, slot[c.at : c.at + c.src.stored_bytes], RAW_CODED))
                        continue
                    sc = c.decode.scale
                    pairs.append((c.src, slot[c.at : c.at + c.src.nbytes].view(c.src.dtype).view(c.src.shape)))
                    pairs.append((sc, slot[c.scale_at : c.scale_at + sc.nbytes].view(sc.dtype).view(sc.shape)))
                continue
            whole = slot[tgt.offset : tgt.offset + tgt.nbytes].view(tgt.dtype).view(tgt.shape)
            for c in tgt.copies:
                dest = whole if c.place is None else c.place(whole)
                pairs.append((c.src, dest) if c.decode is None else (c.src, dest, c.decode))
        return pairs

    def start_unit(self, unit: Unit, slot: torch.Tensor, jobs: list[Future] | None = None) -> list[Future]:
        """:meth:`read_unit` without waiting: queue ``unit``'s copies into ``slot`` on the reader threads and return
        their jobs, so the caller can queue the next unit's copies before these finish (the reader threads never
        run dry between two reads). ``unit`` must have no conversion (``Unit.converts``: those run on the caller's
        thread). The caller must pass the jobs to :meth:`finish` (or :meth:`cancel`) before it frees ``slot``.
        ``jobs``: a list of the caller's the jobs are appended to (and returned), each before the pool has it, so a
        Ctrl-C landing in this call or just after it cannot lose one that writes into ``slot``.

        Raises:
            ShardChangedError: a shard was replaced, truncated or rewritten since it was opened.
        """
        if unit.converts:
            raise ValueError(f"start_unit: unit {unit.name!r} runs a conversion; use read_unit")
        self._check_files(unit)
        jobs = [] if jobs is None else jobs
        try:
            self._submit_pairs(jobs, unit, self._pairs(unit, slot), None)
        except BaseException:
            self.cancel(jobs)
            raise
        return jobs

    @staticmethod
    def finish(jobs: list[Future]) -> None:
        """Wait for every job of :meth:`start_unit`; then re-raise the first copy's exception, if any."""
        _wait_all(jobs)
        for f in jobs:
            f.result()

    @staticmethod
    def cancel(jobs: list[Future]) -> None:
        """Cancel the jobs not started yet and wait for the running ones (their errors are dropped): the slot they
        write into may then be freed."""
        _wait_all(jobs, cancel=True)

    def copy_all(self, unit: Unit, pairs: list[tuple[TensorInfo, torch.Tensor]], also=None, *,
                 chunk: int | None = None) -> None:
        """Copy each checkpoint tensor ``src`` of ``pairs`` into its ``dest`` (same numel; cast to ``dest``'s
        dtype), split into chunks of ``chunk`` bytes (default: 32 MiB for mmap, ``DIRECT_CHUNK`` otherwise) over
        the reader threads; ``also()`` runs on this thread meanwhile.

        Returns (or raises the first copy's exception) only once every copy has finished, so the caller may
        free the destinations as soon as this returns. ``unit`` names the copies for fault injection.
        """
        jobs: list[Future] = []
        try:
            self._submit_pairs(jobs, unit, pairs, chunk)
            if also is not None:
                also()
        except BaseException:
            # copies not started yet never start (also one a Ctrl-C left unsubmitted); never leave a copy writing
            # into memory the caller is about to free
            _wait_all(jobs, cancel=True)
            raise
        _wait_all(jobs)
        for f in jobs:
            f.result()

    def _submit_pairs(self, jobs: list[Future], unit: Unit, pairs: list[tuple[TensorInfo, torch.Tensor]],
                      chunk: int | None) -> None:
        arm = self._arm((unit.name, chunk))  # one way of reading for all of a read's copies (one readahead stream)
        backend = arm[0]
        self._unit_started(arm)
        if backend == "direct" and SLOT_DIRECT and self.direct_fds:
            pairs = self._submit_slot_direct(jobs, unit, pairs, min(chunk or arm[1], arm[1]), arm)
        for pair in pairs:
            src, dest = pair[0], pair[1]
            n = src.numel
            if n == 0:
                continue
            dec = pair[2] if len(pair) > 2 else getattr(src, "decode", None)
            if dec is RAW_CODED:  # a stored exp3 tensor: its chunks as they lie, for the GPU to decode
                for run in _chunk_runs(src, RAW_READ):
                    self._go(jobs, arm, self._coded_raw_task, (unit, src, dest, run, backend))
                continue
            if isinstance(dec, quant.Mxfp4Block):  # gpt-oss's packed experts: bands of rows, one expert at a time
                if len(src.shape) == 3:  # one routed expert's (R, G, 16) slab (quant.mxfp4_slab): a stack of one
                    src = TensorInfo(src.name, src.dtype, (1, *src.shape), src.file, src.offset, src.nbytes)
                    dec = quant.Mxfp4Block(dataclasses.replace(dec.scale, shape=(1, *dec.scale.shape)))
                    dest = dest.unsqueeze(0)
                self._submit_mxfp4(jobs, unit, src, dest, dec, arm)
                continue
            if dec is not None:  # float8 codes and their block scales: decoded on the reader threads
                self._submit_decode(jobs, unit, src, dest, dec, arm)
                continue
            if isinstance(src, LosslessInfo):  # losslessly coded: chunk by chunk, decoded into place
                self._submit_lossless(jobs, unit, src, dest, arm)
                continue
            size = chunk or (_CHUNK if self.io == "mmap" else arm[1])
            if self.io != "mmap":  # a piece must fit the per-thread staging buffer
                size = min(size, DIRECT_CHUNK)
            step = max(1, size // src.dtype.itemsize)
            if dest.is_contiguous() or n <= step:
                for lo in range(0, n, step):
                    self._submit(jobs, arm, unit, src, dest, lo, min(n, lo + step), backend)
            else:
                self._submit(jobs, arm, unit, src, dest, 0, n, backend)

    def _submit_lossless(self, jobs: list[Future], unit: Unit, src: LosslessInfo, dest: torch.Tensor,
                         arm: tuple[str, int, int]) -> None:
        """Queue the decode of ``src``'s coded chunks (:mod:`tiered.lossless`) into ``dest``: one task per run of
        consecutive chunks of at most :data:`LOSSLESS_READ` coded bytes (one read request, then each chunk decoded; a
        cast or a chunk cut by a window's edge goes through a temporary); a non-contiguous ``dest``: one task for the
        tensor."""
        backend = arm[0]
        if not dest.is_contiguous():
            self._go(jobs, arm, self._lossless_whole, (unit, src, dest, backend))
            return
        for run in _chunk_runs(src, LOSSLESS_READ):
            self._go(jobs, arm, self._lossless_task, (unit, src, dest, run, backend))

    def _coded_raw_task(self, unit: Unit, src: LosslessInfo, dest: torch.Tensor, run: list[int],
                        backend: str | None) -> None:
        """A reader thread: read the consecutive chunks ``run`` of ``src`` (a whole coded tensor, or a window of whole
        chunks: a stored piece, :mod:`tiered.pieces`) in one request into their place in ``dest`` (the slot's region
        for those chunks' coded bytes, uint8, starting where ``src``'s first chunk does), then check each chunk's
        CRC-32 and block starts there; no decode (the device stage decodes after the H2D copy). Raises CodecError: a
        chunk that fails its CRC-32 or whose starts disagree with its codes (names file, tensor, offset)."""
        backend = backend or self.io
        base = src.coded.chunk_span(src.chunks[0])[0]  # 0 for a whole tensor
        start = src.coded.chunk_span(run[0])[0]
        length = sum(src.coded.chunk_span(run[-1])) - start
        t0 = time.perf_counter()
        faults.hit("read", unit=unit.name, tensor=src.name, offset=src.offset + start, io=backend)
        sub = TensorInfo(src.name, torch.uint8, (length,), src.file, src.offset + start, length)
        out = dest[start - base : start - base + length]
        step = DIRECT_CHUNK if backend != "mmap" else _CHUNK
        for lo in range(0, length, step):
            self._copy(sub, out, lo, min(length, lo + step), backend)
        took = time.perf_counter() - t0
        for c in run:
            at, n = src.coded.chunk_span(c)  # in the tensor's coded blob (file offset src.offset + at)
            body = dest[at - base : at - base + n].numpy()
            if crc32(body) != src.coded.crc[c]:
                raise CodecError(f"{src.file}: tensor {src.name!r}: chunk {c} (coded bytes {src.offset + at}.."
                                 f"{src.offset + at + n} of the file) fails its CRC-32: the file is corrupted; "
                                 "re-copy it or re-run `tiered reshard --compress` on the source checkpoint")
            lo, hi = src.coded.elements(c)
            expcode.check_starts(body, hi - lo, where=f"{src.file}: tensor {src.name!r}: chunk {c} (file offset "
                                 f"{src.offset + at})")
        if self.adapt:
            self._measured(length, took)

    def _coded_buf(self, n: int, name: str) -> torch.Tensor:
        """This reader thread's buffer ``name`` of at least ``n`` bytes (uint8; grown, never shrunk)."""
        buf = getattr(self._local, name, None)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1 << 20), dtype=torch.uint8)
            setattr(self._local, name, buf)
        return buf[:n]

    def _read_chunk(self, src: LosslessInfo, c: int, backend: str, last: int | None = None) -> torch.Tensor:
        """The coded bytes of chunks ``c`` to ``last`` (default ``c``) of ``src``, consecutive in the file, read with
        ``backend`` into this thread's coded buffer."""
        start = src.coded.chunk_span(c)[0]
        end = sum(src.coded.chunk_span(last if last is not None else c))
        length = end - start
        buf = self._coded_buf(length, "coded")
        sub = TensorInfo(src.name, torch.uint8, (length,), src.file, src.offset + start, length)
        step = DIRECT_CHUNK if backend != "mmap" else _CHUNK
        for lo in range(0, length, step):
            self._copy(sub, buf, lo, min(length, lo + step), backend)
        return buf

    def _lossless_task(self, unit: Unit, src: LosslessInfo, dest: torch.Tensor, run: list[int],
                       backend: str | None) -> None:
        """A reader thread: read the consecutive chunks ``run`` of ``src`` in one request and decode each into its
        elements of ``dest`` (contiguous)."""
        backend = backend or self.io
        base = src.coded.chunk_span(run[0])[0]
        t0 = time.perf_counter()
        faults.hit("read", unit=unit.name, tensor=src.name, offset=src.offset + base, io=backend)
        body = self._read_chunk(src, run[0], backend, run[-1]).numpy()
        took = time.perf_counter() - t0
        isz = src.dtype.itemsize
        for c in run:
            start, length = src.coded.chunk_span(c)
            lo, hi = src.coded.elements(c)
            skip, at, n = src.overlap(c)  # a window's edge may cut the chunk: its part inside goes to dest[at:at + n]
            whole = n == hi - lo
            if dest.dtype == src.dtype and whole:
                out = _bytes_of(dest)[at * isz: (at + n) * isz]
            else:  # a cast or a cut chunk: the chunk's plain bytes first, then copy_ casts or copies the part
                out = self._coded_buf((hi - lo) * isz, "plain")
            decode_chunk(body[start - base: start - base + length], src.coded, c, out.numpy(),
                         where=f"{src.file}: tensor {src.name!r}", at=src.offset + start)
            if dest.dtype != src.dtype or not whole:
                dest.reshape(-1)[at: at + n].copy_(out.view(src.dtype)[skip: skip + n])
        if self.adapt:
            self._measured(body.size, took)

    def _lossless_whole(self, unit: Unit, src: LosslessInfo, dest: torch.Tensor, backend: str | None) -> None:
        """A reader thread: decode all of ``src`` into a temporary, then copy it into ``dest`` (any strides)."""
        dest.copy_(self.decode_whole(src, backend or self.io, unit.name).view(dest.shape))

    def decode_whole(self, src: LosslessInfo, backend: str | None = None, unit: str = "") -> torch.Tensor:
        """All of ``src`` decoded into a new tensor of its dtype and shape, on the calling thread."""
        backend = backend or self.io
        plain = torch.empty(src.nbytes, dtype=torch.uint8)
        isz = src.dtype.itemsize
        for c in src.chunks:
            start = src.offset + src.coded.chunk_span(c)[0]
            faults.hit("read", unit=unit, tensor=src.name, offset=start, io=backend)
            body = self._read_chunk(src, c, backend)
            lo, hi = src.coded.chunk_range(c)
            skip, at, n = src.overlap(c)
            out = plain[at * isz: (at + n) * isz] if n * isz == hi - lo else self._coded_buf(hi - lo, "plain")
            decode_chunk(body.numpy(), src.coded, c, out.numpy(), where=f"{src.file}: tensor {src.name!r}", at=start)
            if n * isz != hi - lo:  # a window's edge cuts the chunk
                plain[at * isz: (at + n) * isz].copy_(out[skip * isz: (skip + n) * isz])
        return plain.view(src.dtype).view(src.shape)

    def _decoded(self, n: int) -> None:
        with self._stage_lock:
            self.decoded_bytes += n
        if self.on_decoded is not None:
            self.on_decoded(n)

    def _submit_decode(self, jobs: list[Future], unit: Unit, src: TensorInfo, dest: torch.Tensor, dec: Any,
                       arm: tuple[str, int, int]) -> None:
        """Queue the decode of ``src``'s float8 codes into ``dest`` (:mod:`tiered.quant`) in bands of rows, at most
        :data:`DECODE_CHUNK` code bytes each (whole block rows where a block row fits; a non-contiguous ``dest``: one
        task for the tensor)."""
        backend = arm[0]
        rows, cols = src.shape[-2:]
        lead = src.numel // max(1, rows * cols)
        band = _decode_band(cols * src.dtype.itemsize, dec.block[0])
        if not dest.is_contiguous():
            self._submit(jobs, arm, unit, src, dest, 0, src.numel, backend, dec)
            return
        for e in range(lead):
            for r in range(0, rows, band):
                self._submit(jobs, arm, unit, src, dest, e, (r, min(rows, r + band)), backend, dec)

    def _submit_mxfp4(self, jobs: list[Future], unit: Unit, src: TensorInfo, dest: torch.Tensor, dec: Any,
                      arm: tuple[str, int, int]) -> None:
        """Queue the MXFP4 decode of ``src`` (``(E, R, G, 16)`` blocks) into ``dest`` (``(E, G * 32, R)``): per expert,
        bands of rows ``R`` of at most :data:`DECODE_CHUNK` block bytes (their bf16 temporaries: 4x that)."""
        backend = arm[0]
        E, R, G, _ = src.shape
        band = max(1, DECODE_CHUNK // (G * 16))
        for e in range(E):
            for r in range(0, R, band):
                self._submit(jobs, arm, unit, src, dest, e, ("mxfp4", r, min(R, r + band)), backend, dec)

    def _decode_mxfp4(self, src: TensorInfo, dest: torch.Tensor, e: int, r0: int, r1: int, backend: str,
                      dec: Any) -> float:
        """Read rows ``[r0, r1)`` of expert ``e``'s blocks and scales with ``backend``; decode them into columns
        ``[r0, r1)`` of ``dest[e]`` (:func:`tiered.quant.decode_mxfp4`). Returns the seconds spent reading."""
        E, R, G, _ = src.shape
        n = r1 - r0
        b_off = src.offset + (e * R + r0) * G * 16
        s_off = dec.scale.offset + (e * R + r0) * G
        bsub = dataclasses.replace(src, offset=b_off, shape=(n * G * 16,), nbytes=n * G * 16)
        ssub = dataclasses.replace(dec.scale, offset=s_off, shape=(n * G,), nbytes=n * G)
        blocks = torch.empty(n * G * 16, dtype=torch.uint8)
        scales = torch.empty(n * G, dtype=torch.uint8)
        t0 = time.perf_counter()
        self._copy(bsub, blocks, 0, blocks.numel(), backend)
        self._copy(ssub, scales, 0, scales.numel(), backend)
        took = time.perf_counter() - t0
        out = dest[e][:, r0:r1]
        quant.decode_mxfp4(blocks.view(1, n, G, 16), scales.view(1, n, G), out)
        self._decoded(out.numel() * out.element_size())
        return took

    def _decode(self, src: TensorInfo, out: torch.Tensor, e: int, r0: int, r1: int, backend: str, dec: Any) -> float:
        """Read rows ``[r0, r1)`` of matrix ``e`` of ``src`` (float8 codes) and the scales of their blocks with
        ``backend``, decode them into ``out`` (``(r1 - r0, cols)``, any strides). Returns the seconds spent reading."""
        rows, cols = src.shape[-2:]
        isz = src.dtype.itemsize
        n = (r1 - r0) * cols
        g0 = e * rows + r0
        sub = dataclasses.replace(src, offset=src.offset + g0 * cols * isz, shape=(n,), nbytes=n * isz)
        codes = torch.empty(n, dtype=src.dtype)
        sc = dec.scale
        if sc.numel == 1:
            band, ssub = dec, sc
        else:  # matrix e's grid, then the rows of it this band uses
            gr, gc = sc.shape[-2:]
            sisz = sc.dtype.itemsize
            mat = dataclasses.replace(sc, offset=sc.offset + e * gr * gc * sisz, shape=(gr, gc), nbytes=gr * gc * sisz)
            band = quant.band_block(dataclasses.replace(dec, scale=mat), r0, r1)
            ssub = band.scale
        scale = torch.empty(ssub.numel, dtype=sc.dtype)
        t0 = time.perf_counter()
        self._copy(sub, codes, 0, n, backend)
        self._copy(dataclasses.replace(ssub, shape=(ssub.numel,)), scale, 0, ssub.numel, backend)
        took = time.perf_counter() - t0
        grid = scale if sc.numel == 1 else scale.view(-1, sc.shape[-1])
        if isinstance(dec, quant.CtWeight):
            quant.decode_ct(codes.view(r1 - r0, cols), grid, dec, out)
            self._decoded(out.numel() * out.element_size())
            return took
        quant.decode_rows(codes.view(r1 - r0, cols), quant.scale_f32(grid), dec.block, band.row0, out)
        self._decoded(out.numel() * out.element_size())
        return took

    def _convert(self, unit: Unit, conv, slot: torch.Tensor) -> None:
        """Run a non-placeable ``transformers`` conversion on mapped sources; copy the results in."""
        c = conv.converter
        by_key = {t.key: t for t in unit.targets}
        first = by_key[conv.targets[0]]
        c.collected_tensors.clear()
        for pat, infos in conv.sources.items():
            for info in infos:
                faults.hit("read", unit=unit.name, tensor=info.name, offset=info.offset)
                whole = self.decode_whole(info, "mmap", unit.name) if isinstance(info, LosslessInfo) \
                    else self.maps[info.file].tensor(info)
                c.collected_tensors[pat].append(whole.to(first.dtype))
        out = c.convert(conv.layer_name)
        for key, value in out.items():
            tgt = by_key.get(key)
            if tgt is not None:
                slot[tgt.offset : tgt.offset + tgt.nbytes].view(tgt.dtype).view(tgt.shape).copy_(value)
        if self.drop_pages:
            for infos in conv.sources.values():
                for info in infos:
                    self.maps[info.file].drop(info.offset, getattr(info, "stored", 0) or info.nbytes,
                                              page_cache=self.drop_page_cache)

    def close(self) -> None:
        """Stop the reader threads, close the shards. Idempotent: an interrupted close is finished by the next."""
        self.pool.shutdown(wait=True)
        while self.maps:
            self.maps.popitem()[1].close()
        while self.direct_fds:
            os.close(self.direct_fds.popitem()[1])
        self._local = threading.local()
        while self._stages:
            try_unmap(self._stages.pop())
