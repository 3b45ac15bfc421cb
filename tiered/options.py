"""How a model is streamed: :class:`Options`, the one place every knob is defaulted, documented and validated.

Torch-free (the CLI checks options before the heavy imports). :func:`tiered.load` and :func:`tiered.attach` keep their
keyword signatures and build an ``Options`` on their first line; a bad value raises :class:`~tiered.errors.ConfigError`
(or :class:`~tiered.errors.RingTooSmallError` for ``ring_gb <= 0``) whose ``option`` attribute names the field, so the
CLI maps it to its flag (``--ring-gb``) without reading the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError, RingTooSmallError

__all__ = ["Options", "IO_BACKENDS", "GiB", "OPTION_DOCS"]

GiB = 1 << 30  # bytes in a GiB: every *_gb option counts in these
IO_BACKENDS = ("mmap", "pread", "direct", "auto")


def _is_number(x: object) -> bool:
    """A finite int/float (not a bool) whose GiB still converts to a whole number of bytes (1e300 GiB does not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and math.isfinite(x * GiB)


def _bad(option: str, message: str, cls: type[ConfigError] | type[RingTooSmallError] = ConfigError) -> Exception:
    e = cls(message)
    e.option = option  # type: ignore[attr-defined]
    return e


#: The ring when ``ring_gb`` is not given and the host can give it (GiB): tiered's default since the first release.
DEFAULT_RING_GB = 4.0

#: Every option, documented once (appended to ``tiered.load``'s and ``tiered.attach``'s docstrings).
OPTION_DOCS = """\
        ring_gb: host ring size in GiB (float). Host RSS is bounded by this plus a constant. It must hold the
            largest unit (CUDA: the largest one that cannot be cut in pieces); on the CPU also with zero copy, whose
            running unit's mapped pages count against it (a smaller ring: ``RingTooSmallError`` before loading).
            Default ``None``: :data:`DEFAULT_RING_GB` (4), or less where the host cannot give that — what
            ``MemAvailable`` and every cgroup ``memory.max`` above the process leave after the runtime's headroom
            and ``host_gb`` (:func:`tiered.policy.auto_ring_bytes`; ``tiered.stats(model).placement.ring_why`` says
            which). With ``host_gb`` not given either and a model that does not stay whole, the ring takes
            ``prefetch + 1`` of the largest unit and the host tier the rest of that memory
            (:func:`tiered.policy.auto_split`). A number given is a hard limit, in whole pages (rounded up to 4 KiB):
            more than the host can give is a ``HostMemoryError``.
        device: ``"cuda[:N]"`` or ``"cpu"``; default CUDA when available.
        dtype: run in this dtype (``torch.bfloat16`` or ``"bf16"``...), cast while copying into the ring;
            default: ``from_pretrained``'s (``"auto"``: ``config.json``'s dtype, else the checkpoint's).
        prefetch: units of lookahead.
        gpu_gb: GiB of GPU memory for resident units (loaded once, never streamed) and the device buffer of the
            unit being computed, as accelerate's ``max_memory`` counts weights plus one offloaded layer; the
            ``prefetch`` other device buffers (each the largest streamed unit) come on top. Default: free memory
            minus 4 GiB, all ``prefetch + 1`` buffers inside it. When the whole model fits, it is loaded once
            through the ring and stays.
        io: reader backend: ``"mmap"`` (through the page cache, pages dropped from the process
            after each copy), ``"pread"`` (through the page cache with buffered ``preadv`` straight into the ring:
            no file page is mapped into the process), ``"direct"`` (``O_DIRECT`` reads: no page cache at all;
            cold-cache and cgroup use)
            or ``"auto"`` (the default: ``mmap`` where the checkpoint fits the page cache, ``direct`` where it is
            larger than the page cache can hold:
            MemAvailable or the cgroup's limit, v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; measured on an H200
            in a 3 GiB cgroup, GPT-J-6B: 6.0 s/token direct vs 10.7 s/token mmap). On the CPU ``"auto"`` then also
            keeps a page-cache tier: the streamed units that fit the page cache the limit leaves beside the ring and
            the host tier compute on the file mapping and stay cached between passes (``Stats.page_cache_units``).
            When ``"auto"`` picks ``direct``, the reader also times it against buffered ``pread`` (each followed by
            ``POSIX_FADV_DONTNEED``) on the first units it streams and keeps the faster; once ``direct`` is kept, it
            times O_DIRECT's read shapes (request size and requests in flight, :func:`tiered.reader.read_shapes`)
            the same way and keeps the fastest; and it measures again when the chosen way slows
            (``Stats.io_choice``; ``tiered/reader.py``). An explicit ``"direct"`` reads in 16 MiB requests on every
            reader thread, as asked, and is never re-chosen.
        threads: reader threads. Default ``None``: :func:`tiered.policy.reader_threads` — 4 (one stream does not
            saturate NVMe), more for a losslessly compressed checkpoint, whose chunks the reader threads decode
            (``tiered.stats(model).placement.threads`` and ``threads_why`` say what was chosen).
        compute_threads: torch's CPU compute threads (``torch.set_num_threads``, process-wide) for a model on the CPU.
            Default ``None``: torch's setting is left as it is — results are then stock's bit for bit in the same
            process (torch's float32 matmuls can round differently with another thread count: measured on the 2-core
            machine, ``linear`` of (7, 4096) x (4096, 4096)) — and a warning says when it oversubscribes the cores
            beside the reader threads while units stream. ``"auto"`` (``tiered generate/chat/serve``'s default):
            where units stream on the CPU, the cores this process may use (``sched_getaffinity``, the cgroup's
            ``cpu.max``) less those the readers take, ``min(threads, cores // 2)``, at least 1 and never more than
            torch had (torch's default beside busy readers made SmolLM2 decode at 0.4-0.7 tokens/s on the 2-core
            machine, one compute thread at 7.5-8.2: issue 26). ``N``: set N (a warning when N plus the reader
            threads exceed the cores). ``tiered.stats(model).placement.compute_threads`` says what was set.
        drop_pages: after copying a span of the file mapping, ``madvise(MADV_DONTNEED)`` it, so the process never
            keeps the checkpoint's pages mapped (what bounds RSS with ``io="mmap"``). Keep True; False is the naive
            loader, kept to show what the bound is worth.
        drop_page_cache: also ``posix_fadvise(POSIX_FADV_DONTNEED)`` what was copied, so the page cache does not
            keep it either: for cgroups that charge page cache to the process (``memory.max``). Default False.
        embedding_rows: a streamed embedding reads only the rows its ids look up, each call
            (batch x tokens x hidden x itemsize bytes, not the table; ``tiered/rows.py``); False streams
            it whole through the ring like any unit.
        routed_experts: when the model does not fit, a MoE block's experts module reads only the experts its
            router picked, each call (``tiered/experts.py``); False streams them whole with their layer.
        zero_copy: on the CPU with ``io="mmap"``, a streamed unit that needs no conversion (same dtype, no fused
            tensors) computes on views of the checkpoint's file mapping, as ``from_pretrained`` does, instead of a
            copy in the ring; its pages are dropped from the process (``MADV_DONTNEED``) when it has run, so RSS
            holds at most the units running at once. Units that convert still go through the ring.

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
            Default ``None``: with ``ring_gb`` not given either, what the host leaves beside the automatic ring when
            the model does not stay whole (``ring_gb`` above; ``tiered.stats(model).placement.host_why``), else 0: no
            host tier. 0: none.
        expert_cache_gb: GiB of device memory keeping routed experts between calls (``tiered/expert_cache.py``):
            a call that picks a cached expert copies it device to device instead of reading it. None (default):
            on CUDA, what ``gpu_gb`` leaves after resident units and device buffers, less one block's experts
            (room for a prefill's compact tensors); on the CPU none. 0: no cache. On the CPU a value > 0 keeps
            them in host memory (RSS grows by it).
        expert_prefetch: accepted and ignored, with a DeprecationWarning: the speculative expert prefetch it turned
            on was removed (measured slower on an H200, Mixtral-8x7B shape, batch 1: 0.147 against 0.122 s/token
            with new sequence lengths, 0.113 against 0.084 with seen ones; 58% of its guesses were used).
"""


@dataclass(frozen=True)
class Options:
    """How a model is streamed. Sizes in GiB (2**30 bytes) say so in their name; each field is a keyword of
    :func:`tiered.load` and :func:`tiered.attach`, documented at length in :data:`OPTION_DOCS` (``help(tiered.load)``
    shows it)."""

    ring_gb: float | None = None  # host ring, GiB: RSS is bounded by this plus a constant (None: 4, or what fits)
    device: str | None = None  # "cuda[:N]" when available, else "cpu" (resolved by tiered.attach)
    dtype: Any = None  # cast on the fly (None: config.json's dtype, as from_pretrained); tiered.load only
    prefetch: int = 2  # units loaded ahead of the one running
    gpu_gb: float | None = None  # GPU budget: resident units + one device buffer (None: free - 4 GiB, all buffers)
    io: str = "auto"  # reader: "mmap"/"pread" (page cache), "direct" (O_DIRECT) or "auto" (direct if it won't fit)
    threads: int | None = None  # reader threads (None: policy.reader_threads, 4 unless the checkpoint is coded)
    compute_threads: int | str | None = None  # torch's CPU threads: None leaves torch's; "auto"; N
    drop_pages: bool = True  # madvise(MADV_DONTNEED) after each copy: what bounds RssFile
    drop_page_cache: bool = False  # also posix_fadvise(DONTNEED): for cgroups that charge page cache
    embedding_rows: bool = True  # a streamed embedding reads only the rows looked up (tiered/rows.py)
    routed_experts: bool = True  # a streamed MoE block reads only the experts its router picked (tiered/experts.py)
    zero_copy: bool = True  # CPU, io="mmap": streamed units compute on views of the file mapping (no ring copy)
    distributed: Any = False  # True or a ProcessGroup: each torchrun rank streams 1/N of every unit (tiered/dist.py)
    host_gb: float | None = None  # host tier, GiB: streamed units read once and kept (None: what the host leaves)
    expert_cache_gb: float | None = None  # routed experts kept on the device (None: CUDA, what gpu_gb leaves; CPU 0)
    expert_prefetch: bool = False  # ignored (DeprecationWarning): the speculative expert prefetch was removed

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse a value a user could mistype, before anything is read or allocated.

        Raises:
            RingTooSmallError: ``ring_gb <= 0``.
            ConfigError: any other bad value (``.option`` names the field).
        """
        if self.ring_gb is not None and not _is_number(self.ring_gb):
            raise _bad("ring_gb", f"ring_gb must be a number of GiB (e.g. 1 or 0.5) or None (what fits the host), got "
                                  f"{self.ring_gb!r}")
        if self.ring_gb is not None and self.ring_gb <= 0:
            raise _bad("ring_gb", f"ring_gb must be > 0, got {self.ring_gb}", RingTooSmallError)
        for name, what in (("prefetch", "integer >= 0 (units of lookahead)"),
                           ("threads", "integer >= 1 (reader threads) or None (automatic)")):
            v = getattr(self, name)
            if name == "threads" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < (name == "threads"):
                raise _bad(name, f"{name} must be an {what}, got {v!r}")
        c = self.compute_threads
        if c is not None and c != "auto" and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise _bad("compute_threads", f"compute_threads must be an integer >= 1 (torch's CPU threads), 'auto' "
                                          f"(cores less the readers') or None (torch's setting left), got {c!r}")
        for name, none in (("gpu_gb", "or None (all that fits)"), ("host_gb", "(0: no host tier) or None (automatic)"),
                           ("expert_cache_gb", "or None (what gpu_gb leaves)")):
            v = getattr(self, name)
            if v is not None and (not _is_number(v) or v < 0):
                raise _bad(name, f"{name} must be a number of GiB >= 0 {none}, got {v!r}")
        if self.io not in IO_BACKENDS:
            raise _bad("io", f"io={self.io!r}: use 'mmap' (page cache), 'pread' (page cache, copied by read(2)), "
                             "'direct' (O_DIRECT, bypasses the page cache) or 'auto' (the default: direct when the model "
                             "does not fit in the page cache room, else mmap)")

    @property
    def ring_bytes(self) -> int:
        """The ring asked for, in bytes (``ring_gb=None`` is resolved by :func:`tiered.placement.place` first)."""
        if self.ring_gb is None:
            raise ValueError("ring_gb=None (automatic) is resolved by tiered.placement.place")
        return int(self.ring_gb * GiB)

    @property
    def host_bytes(self) -> int:
        """The host tier asked for, in bytes (0 for ``host_gb=None`` until :func:`tiered.placement.place` resolves
        it)."""
        return int((self.host_gb or 0) * GiB)

    @property
    def dist_on(self) -> bool:
        return self.distributed is not False and self.distributed is not None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
