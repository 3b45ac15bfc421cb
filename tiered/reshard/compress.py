"""Writing a compressed shard (``tiered reshard --compress``; the format is :mod:`tiered.lossless`'s).

One pass per shard. :func:`~tiered.reshard.layout._layout` has reserved room for the largest header the shard can
have (:func:`~tiered.reshard.layout._coded_header_bound`); the data section starts after it, 4 KiB-aligned. Each
tensor marked for coding (at least :data:`~tiered.lossless.MIN_CODED_BYTES` of output) is read front to back
through the copier's own path (:meth:`~tiered.reshard.writer._Copier.pieces`: the source's view, cast where the
output is cast, hashed when verifying), cut into chunks (:func:`~tiered.lossless.chunk_geometry`: about
:data:`~tiered.lossless.DEFAULT_CHUNK_BYTES`, whole rows, one expert per slice of a stacked tensor), coded on a small
thread pool (:func:`~tiered.lossless.encode_chunk`; zstd and the CRC-32 release the GIL) and written in order.
It stays coded only if that made it smaller: a tensor none of whose planes shrank (random bits) is written again,
plain, over its own bytes (the same length). Other tensors are written as by the plain converter (kernel to kernel
where the source allows). The real header, padded with spaces to the room reserved, is written last.

Memory: the copier's piece (:data:`~tiered.reshard.writer.CHUNK_BYTES`) plus at most :attr:`_Coder.window` chunks in
flight, each its plain copy and its coded bytes (~8 MiB): under 100 MiB with 4 threads, whatever the tensor size.
Every byte goes through :func:`tiered.reshard.writer._pwrite` (the tests make it fail with ENOSPC); a coded tensor
never moves by ``copy_file_range``.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..lossless import CODEC, EXP3, Coded, chunk_geometry, crc32, encode_chunk
from . import writer
from .layout import _coded_header, _Out, _Shard

__all__: list[str] = []


def _code(part: np.ndarray, itemsize: int, codec: str) -> tuple[list[int], bytes, int]:
    """One chunk: (plane lengths, coded bytes, CRC-32 of them). Runs on a coder thread."""
    lens, body = encode_chunk(part, itemsize, codec=codec)
    return lens, body, crc32(body)


class _Coder:
    """Codes tensors chunk by chunk on a thread pool (owned here: :meth:`close` shuts it down, cancelling what has not
    started) and writes the chunks in order on the caller's thread."""

    def __init__(self, threads: int | None = None, codec: str = "zstd") -> None:
        self.codec = codec  # "exp3": bf16 tensors in tiered.expcode's code, the others zstd
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self.window = self.threads + 2  # chunks in flight: every thread busy, the next two ready to write
        self.pool: ThreadPoolExecutor | None = None  # started on the first coded tensor (no threads at import)
        self.coded = 0  # tensors written coded
        self.plain = 0  # candidates written plain after all (no plane shrank)

    def tensor(self, out: _Out, copier: writer._Copier, fd: int, offset: int, wb: writer._Writeback) -> int:
        """Write candidate ``out`` at ``offset`` of ``fd``; sets ``out.coded`` when it stays coded (else None).
        Returns the bytes it takes in the file."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiered-code")
        isz = out.dtype.itemsize
        chunk, sl = chunk_geometry(out.shape, isz)
        codec = EXP3 if self.codec == "exp3" and out.dtype == torch.bfloat16 else CODEC
        coded = Coded(isz, out.nbytes, chunk, sl, codec=codec)
        h = copier.hash_of(out)
        pending: deque[Future] = deque()
        pos = offset

        def write_oldest() -> None:
            nonlocal pos
            lens, body, crc = pending.popleft().result()
            coded.lens.append(lens)
            coded.crc.append(crc)
            pos += writer._pwrite(fd, body, pos)
            wb.advance(pos)

        c, n = 0, coded.count()
        lo, hi = coded.chunk_range(0)
        cur, fill = np.empty(hi - lo, dtype=np.uint8), 0  # the chunk being assembled from the pieces
        for buf in copier.pieces(out, h):
            at = 0
            while at < buf.size:
                k = min(cur.size - fill, buf.size - at)
                cur[fill: fill + k] = buf[at: at + k]
                fill += k
                at += k
                if fill == cur.size:
                    pending.append(self.pool.submit(_code, cur, isz, codec))
                    c += 1
                    if c < n:
                        lo, hi = coded.chunk_range(c)
                        cur, fill = np.empty(hi - lo, dtype=np.uint8), 0
                    while len(pending) >= self.window:
                        write_oldest()
        while pending:
            write_oldest()
        if copier.hashes is not None and h is not None:
            copier.hashes[out.name] = h.digest()
        if len(coded.lens) != n or pos - offset != coded.coded_bytes:  # pragma: no cover - the source ran short
            raise OSError(errno.EIO, f"{out.name}: coded {len(coded.lens)} of {n} chunks")
        coded.reindex()
        if coded.coded_bytes < out.nbytes:
            out.coded = coded
            self.coded += 1
            return coded.coded_bytes
        # no plane shrank: the blob is as long as the plain bytes; write those over it (for 1-byte elements the
        # blob already is the plain bytes). Already hashed and counted.
        out.coded = None
        self.plain += 1
        if isz > 1:
            pos = offset
            for buf in copier.pieces(out, None, count=False):
                pos += writer._pwrite(fd, buf, pos)
        return out.nbytes

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _write_coded_shard(path: Path, shard: _Shard, copier: writer._Copier, coder: _Coder) -> None:
    """Create ``path`` (never overwrite) as a compressed shard: the data from :attr:`_Shard.data_start` on (coded
    candidates through ``coder``, the rest through ``copier``), then the header, fsync, drop it from the page cache.
    Sets each tensor's ``data_offset`` and ``coded`` to what was written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        wb = writer._Writeback(fd)
        pos = shard.data_start
        for t in shard.tensors:
            t.data_offset = pos - shard.data_start
            if t.code and t.nbytes:
                pos += coder.tensor(t, copier, fd, pos, wb)
            else:
                copier.tensor(t, fd, pos, wb)
                pos += t.nbytes
        writer._pwrite(fd, _coded_header(shard), 0)
        size = os.fstat(fd).st_size
        if size != shard.file_bytes:  # pragma: no cover - a short write that did not raise
            raise OSError(errno.EIO, f"{path}: wrote {size} bytes, expected {shard.file_bytes}")
        wb.finish()
    finally:
        os.close(fd)
