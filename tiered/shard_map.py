"""One shard file, opened and mapped once (read-only): views of its bytes, page dropping and readahead, and the
check that the file did not change under the model (:class:`ShardMap`, used by the reader, row-streamed
embeddings and ``tiered reshard``).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from .errors import ShardChangedError, TruncatedShardError
from .format import TensorInfo
from .hostmem import PAGE_SIZE as _PAGE
from .hostmem import map_tensor, try_unmap

__all__ = ["ShardMap"]


class ShardMap:
    """One shard file, opened and mapped once (read-only).

    The mapping is unmapped by its last reference (:func:`tiered.hostmem.map_tensor`), never under
    a live tensor. :meth:`check` compares the file with what was opened (same inode at the path,
    same size and mtime): a shard replaced, truncated or rewritten in place is an error before any
    byte of it is read, instead of a SIGBUS (truncated) or silently different weights (rewritten).
    """

    def __init__(self, path: Path, *, sequential: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self._ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        # copy-on-write (MAP_PRIVATE), as safetensors maps a file for from_pretrained: a module that writes a weight
        # it computes on in place (zero copy: tiered/loader.py) gets a private page, never a SIGSEGV, and the file
        # is never written; MADV_DONTNEED drops such pages too (the next pass sees the file's bytes again)
        self.mm = mmap.mmap(self.fd, st.st_size, access=mmap.ACCESS_COPY) if st.st_size else None
        if sequential and self.mm is not None:  # aggressive readahead; reclaimed first under pressure
            self.mm.madvise(mmap.MADV_SEQUENTIAL)
        self.u8 = map_tensor(self.mm) if self.mm is not None else torch.empty(0, dtype=torch.uint8)  # (file_size,)

    def check(self) -> None:
        """Raise :class:`~tiered.errors.ShardChangedError` if the file changed since it was opened."""
        st = os.fstat(self.fd)
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            at_path = os.stat(self.path)
            replaced = (at_path.st_dev, at_path.st_ino) != now[:2]
        except OSError:
            replaced = True
        if now != self._ident or replaced:
            fix = "tiered.load it again (do not modify checkpoint files under a loaded model)"
            if not replaced and st.st_size < self._ident[2]:
                raise TruncatedShardError(
                    f"{self.path}: the shard was truncated from {self._ident[2]} to {st.st_size} bytes while the "
                    f"model was loaded; {fix}"
                )
            what = "replaced or deleted" if replaced else "rewritten (size or mtime changed)"
            raise ShardChangedError(
                f"{self.path}: the shard was {what} while the model was loaded; {fix}"
            )

    def span(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the file as a uint8 view (no copy)."""
        return self.u8[offset : offset + nbytes]

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        """``t`` as a typed view of the mapping (a copy only if its offset is misaligned)."""
        return self.elements(t, 0, t.numel).view(t.shape)

    def elements(self, t: TensorInfo, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``t`` (flattened) as a 1-D typed view; a copy of just those
        elements when the file offset is not a multiple of the itemsize."""
        isz = t.dtype.itemsize
        raw = self.span(t.offset + lo * isz, (hi - lo) * isz)
        if t.offset % isz:
            raw = raw.clone()
        return raw.view(t.dtype)

    def drop(self, offset: int, nbytes: int, *, page_cache: bool = False) -> None:
        """Drop the pages of ``[offset, offset + nbytes)`` from this process (and the page cache)."""
        lo = offset // _PAGE * _PAGE
        hi = min(len(self.mm), (offset + nbytes + _PAGE - 1) // _PAGE * _PAGE)
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            if page_cache:
                os.posix_fadvise(self.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def willneed(self, offset: int, nbytes: int) -> None:
        """Ask the kernel to read ``[offset, offset + nbytes)`` into the page cache now, asynchronously
        (``MADV_WILLNEED``: readahead; nothing is mapped into the process, so RSS does not grow)."""
        lo = offset // _PAGE * _PAGE
        hi = min(len(self.mm), (offset + nbytes + _PAGE - 1) // _PAGE * _PAGE)
        if hi > lo:
            self.mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)

    def close(self) -> None:
        """Close the file; unmap now unless a tensor still points into the mapping (then its last reference
        does). Idempotent."""
        self.__dict__.pop("u8", None)
        if self.mm is not None:
            try_unmap(self.mm)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
