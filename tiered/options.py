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

__all__ = ["Options", "IO_BACKENDS", "GiB"]

GiB = 1 << 30  # bytes in a GiB: every *_gb option counts in these
IO_BACKENDS = ("mmap", "pread", "direct", "auto")


def _is_number(x: object) -> bool:
    """A finite int/float (not a bool) whose GiB still converts to a whole number of bytes (1e300 GiB does not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and math.isfinite(x * GiB)


def _bad(option: str, message: str, cls: type[ConfigError] | type[RingTooSmallError] = ConfigError) -> Exception:
    e = cls(message)
    e.option = option  # type: ignore[attr-defined]
    return e


@dataclass(frozen=True)
class Options:
    """How a model is streamed. Sizes in GiB (2**30 bytes) say so in their name; every field is keyword-only in
    :func:`tiered.load`, whose docstring explains each at length."""

    ring_gb: float = 4.0  # host ring, GiB: RSS is bounded by this plus a constant
    device: str | None = None  # "cuda[:N]" when available, else "cpu" (resolved by tiered.attach)
    dtype: Any = None  # cast on the fly (None: config.json's dtype, as from_pretrained); tiered.load only
    prefetch: int = 2  # units loaded ahead of the one running
    gpu_gb: float | None = None  # GPU budget: resident units + one device buffer (None: free - 4 GiB, all buffers)
    io: str = "mmap"  # reader: "mmap"/"pread" (page cache), "direct" (O_DIRECT) or "auto" (direct if it won't fit)
    threads: int = 4  # reader threads (one stream does not saturate NVMe)
    drop_pages: bool = True  # madvise(MADV_DONTNEED) after each copy: what bounds RssFile
    drop_page_cache: bool = False  # also posix_fadvise(DONTNEED): for cgroups that charge page cache
    embedding_rows: bool = True  # a streamed embedding reads only the rows looked up (tiered/rows.py)
    routed_experts: bool = True  # a streamed MoE block reads only the experts its router picked (tiered/experts.py)
    zero_copy: bool = True  # CPU, io="mmap": streamed units compute on views of the file mapping (no ring copy)
    distributed: Any = False  # True or a ProcessGroup: each torchrun rank streams 1/N of every unit (tiered/dist.py)
    host_gb: float = 0.0  # host tier, GiB: streamed units read once and kept (CUDA: pinned, copied to the GPU)
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
        if not _is_number(self.ring_gb):
            raise _bad("ring_gb", f"ring_gb must be a number of GiB (e.g. 1 or 0.5), got {self.ring_gb!r}")
        if self.ring_gb <= 0:
            raise _bad("ring_gb", f"ring_gb must be > 0, got {self.ring_gb}", RingTooSmallError)
        for name, what in (("prefetch", "integer >= 0 (units of lookahead)"), ("threads", "integer >= 1 (reader threads)")):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (name == "threads"):
                raise _bad(name, f"{name} must be an {what}, got {v!r}")
        for name, none in (("gpu_gb", "or None (all that fits)"), ("host_gb", "(0: no host tier)"),
                           ("expert_cache_gb", "or None (what gpu_gb leaves)")):
            v = getattr(self, name)
            if (v is not None or name == "host_gb") and (not _is_number(v) or v < 0):
                raise _bad(name, f"{name} must be a number of GiB >= 0 {none}, got {v!r}")
        if self.io not in IO_BACKENDS:
            raise _bad("io", f"io={self.io!r}: use 'mmap' (page cache, default), 'pread' (page cache, copied by read(2)), "
                             "'direct' (O_DIRECT, bypasses the page cache) or 'auto' (direct when the model does not "
                             "fit in the page cache room)")

    @property
    def ring_bytes(self) -> int:
        return int(self.ring_gb * GiB)

    @property
    def host_bytes(self) -> int:
        return int(self.host_gb * GiB)

    @property
    def dist_on(self) -> bool:
        return self.distributed is not False and self.distributed is not None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
