"""Writing the output: tensor bytes into shards with bounded memory, the other files, and ``verify``.

Memory: bytes move in chunks of at most :data:`CHUNK_BYTES`. Without a cast and without ``verify``,
bytes a source holds verbatim in a file (safetensors) move with ``copy_file_range`` (kernel to kernel,
as ``cp`` does: no user pages at all); otherwise through the source's view (a mapping) with
``os.pwrite``, its read pages dropped after each chunk (mapped pages count in RSS until dropped).
Written pages are pushed to disk in windows of :data:`WRITEBACK_BYTES` (``sync_file_range``) and
dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``). A cast goes through one fixed
buffer of ``CHUNK_BYTES`` (``copy_``, allocated once). Peak RSS growth is about two chunks whatever the
checkpoint or shard size (measured on 1.56 GiB in one shard: 9 MiB copying, ~50-70 MiB verifying,
~90-110 MiB casting); a non-contiguous tensor in a ``.bin`` is made contiguous first (one tensor).
With ``verify``, each chunk is hashed on one helper thread while the calling thread writes it, and
after the last file every tensor is re-read from disk and compared by BLAKE2b hash.

Every byte of tensor data, of the index and of generated files is written through :func:`_pwrite` or
:func:`_copy_range` (the tests make them fail with ENOSPC). Files are created with ``O_EXCL`` (never
overwritten) and fsynced. Besides the shards: every non-weight file of ``SRC`` (config, generation
config, tokenizer files) is copied — ``config.json`` with its dtype set when the weights were cast —
and the source's generated files are written, in place of a copied file of the same name.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import LOSSLESS_INDEX_NAME
from ..format import INDEX_NAME, TensorInfo, read_header
from ..hostmem import PAGE_SIZE
from ..reader import ShardMap
from .errors import VerifyError
from .layout import DATA_ALIGN, _Out, _Shard
from .libc import _libc_call
from .sources import BIN_INDEX_NAME, Source

#: Bytes moved per copy call: the fixed buffer that bounds RSS on the mmap/cast paths.
CHUNK_BYTES = 64 << 20
#: Written bytes between writeback kicks (sync_file_range); what keeps dirty page cache bounded.
WRITEBACK_BYTES = 256 << 20

# Files that describe the *source* weights; never copied (their content would be stale).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_STALE_FILES = {INDEX_NAME, LOSSLESS_INDEX_NAME, BIN_INDEX_NAME, "tiered_checkpoint.json"}


# ---------------------------------------------------------------------------------------------- low-level I/O
# Every byte written goes through _pwrite or _copy_range (the tests make them fail with ENOSPC).


def _pwrite(fd: int, buf: Any, offset: int) -> int:
    """Write all of ``buf`` (a buffer-protocol object) at ``offset``; returns bytes written."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, nbytes: int) -> int:
    """``copy_file_range`` of ``nbytes`` (kernel to kernel, no user pages); returns bytes copied (may be short)."""
    return os.copy_file_range(src_fd, dst_fd, nbytes, src_off, dst_off)


class _Writeback:
    """Keeps an output file's dirty and cached pages bounded while it is written front to back.

    Every :data:`WRITEBACK_BYTES`, writeback of the new window is started (``sync_file_range(WRITE)``,
    asynchronous) and the window before it is waited for and dropped from the page cache
    (``posix_fadvise(DONTNEED)``) — the classic streaming-write pattern. Durability comes from the
    ``fsync`` at the end, not from this.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.kicked = 0  # bytes [0, kicked) have had writeback started
        self.dropped = 0  # bytes [0, dropped) are on disk and out of the page cache

    def advance(self, end: int) -> None:
        while end - self.kicked >= WRITEBACK_BYTES:
            _libc_call("sync_file_range", self.fd, ctypes.c_int64(self.kicked), ctypes.c_int64(WRITEBACK_BYTES),
                       ctypes.c_uint(2))  # SYNC_FILE_RANGE_WRITE
            if self.kicked > self.dropped:
                n = self.kicked - self.dropped
                _libc_call("sync_file_range", self.fd, ctypes.c_int64(self.dropped), ctypes.c_int64(n),
                           ctypes.c_uint(7))  # WAIT_BEFORE | WRITE | WAIT_AFTER
                os.posix_fadvise(self.fd, self.dropped, n, os.POSIX_FADV_DONTNEED)
                self.dropped = self.kicked
            self.kicked += WRITEBACK_BYTES

    def finish(self) -> None:
        """fsync, then drop the whole file from the page cache."""
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ---------------------------------------------------------------------------------------------- shards


class _Copier:
    """Moves tensor bytes from the source into output shards, in chunks of CHUNK_BYTES."""

    def __init__(self, source: Source, progress: Any, hashes: dict[str, bytes] | None) -> None:
        self.source = source
        self.progress = progress
        self.hashes = hashes  # name -> blake2b of the written bytes, when verifying
        self.kernel_copy = hashes is None  # copy_file_range until it proves unavailable
        self.cast_buf: torch.Tensor | None = None  # (CHUNK_BYTES,) uint8, allocated once, on the first cast
        # verify: each chunk is hashed on this thread while the caller's thread writes it (both release the GIL)
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="tiered-hash") if hashes is not None else None
        self.kernel_copied = 0  # bytes moved by copy_file_range
        self.file_range = getattr(source, "file_range", None)  # an optional hook of the source interface

    def tensor(self, out: _Out, fd: int, offset: int, wb: _Writeback) -> None:
        """Write ``out`` at byte ``offset`` of ``fd`` (its bytes, or its bytes cast to ``out.dtype``)."""
        if out.nbytes == 0:
            if self.hashes is not None:
                self.hashes[out.name] = hashlib.blake2b(digest_size=16).digest()
            return
        info = self.source.infos[out.name]
        if not out.cast and self.kernel_copy and self.file_range is not None:
            span = self.file_range(out.name)
            if span is not None and self._kernel(info, span, fd, offset, wb):
                return
        h = self.hash_of(out)
        pos = offset
        for buf in self.pieces(out, h):
            pos += _pwrite(fd, buf, pos)
            wb.advance(pos)
        if h is not None:
            self.hashes[out.name] = h.digest()  # type: ignore[index]

    def hash_of(self, out: _Out) -> Any:
        """A new BLAKE2b for ``out``'s bytes when verifying, else None."""
        return hashlib.blake2b(digest_size=16) if self.hashes is not None else None

    def pieces(self, out: _Out, h: Any, *, count: bool = True) -> Iterator[np.ndarray]:
        """``out``'s output bytes front to back (cast to ``out.dtype`` where it is cast), as 1-D ``uint8`` arrays of at
        most :data:`CHUNK_BYTES`, each valid until the next is asked for (the cast buffer is reused, the source's
        pages dropped). Each piece is hashed into ``h`` (if any) on the hash thread while the caller uses it, and
        counted on the progress bar (``count``) once the caller is done with it."""
        info = self.source.infos[out.name]
        src, drop = self.source.byte_view(out.name)
        isz = info.dtype.itemsize
        step = max(1, CHUNK_BYTES // max(isz, out.dtype.itemsize)) * isz  # source bytes per chunk, whole elements
        for lo in range(0, info.nbytes, step):
            hi = min(info.nbytes, lo + step)
            piece = src[lo:hi]
            if out.cast:
                if piece.data_ptr() % isz:
                    piece = piece.clone()  # a misaligned span cannot be viewed as info.dtype
                if self.cast_buf is None:
                    self.cast_buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                n = (hi - lo) // isz * out.dtype.itemsize
                self.cast_buf[:n].view(out.dtype).copy_(piece.view(info.dtype))  # = .to(out.dtype), in place
                piece = self.cast_buf[:n]
            buf = piece.numpy()
            hashed = self.hasher.submit(h.update, buf) if self.hasher is not None and h is not None else None
            yield buf
            if hashed is not None:
                hashed.result()  # before buf is reused or its pages dropped
            drop(lo, hi)
            if count:
                self.progress.update(buf.nbytes)

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)

    def _kernel(self, info: TensorInfo, span: tuple[int, int], fd: int, offset: int, wb: _Writeback) -> bool:
        """copy_file_range the tensor from ``span`` = (source fd, offset); False (nothing written) when the
        kernel/filesystem cannot."""
        src_fd, src_off = span
        done = 0
        while done < info.nbytes:
            n = min(CHUNK_BYTES, info.nbytes - done)
            try:
                k = _copy_range(src_fd, src_off + done, fd, offset + done, n)
            except OSError as e:
                if done == 0 and e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                                             errno.EBADF, errno.EPERM):
                    self.kernel_copy = False
                    return False
                raise
            if k == 0:  # some filesystems report success without copying
                if done == 0:
                    self.kernel_copy = False
                    return False
                raise OSError(errno.EIO, f"copy_file_range stopped at byte {src_off + done} of {info.file}")
            done += k
            self.progress.update(k)
            wb.advance(offset + done)
        self.kernel_copied += done
        return True


def _write_shard(path: Path, shard: _Shard, copier: _Copier) -> None:
    """Create ``path`` (never overwrite), write header then tensors in order, fsync, drop it from the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        wb = _Writeback(fd)
        pos = _pwrite(fd, shard.header, 0)
        for t in shard.tensors:
            copier.tensor(t, fd, pos, wb)
            pos += t.nbytes
        size = os.fstat(fd).st_size
        if size != shard.file_bytes:  # pragma: no cover - a short write that did not raise
            raise OSError(errno.EIO, f"{path}: wrote {size} bytes, expected {shard.file_bytes}")
        wb.finish()
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (never overwrite) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _index_bytes(shards: list[_Shard], compressed: bool = False) -> bytes:
    """``model.safetensors.index.json``: ``metadata.total_size`` (bytes of tensor data) and the weight map.

    ``compressed``: the index of a compressed checkpoint (:data:`~tiered.lossless.INDEX_NAME`, written once the
    shards are): ``total_size`` is still the plain bytes; ``stored_size`` the bytes of the data sections, and
    ``format``/``version`` name the format (:mod:`tiered.lossless`)."""
    meta: dict[str, Any] = {"total_size": sum(s.data_bytes for s in shards)}
    if compressed:
        from ..lossless import FORMAT_VERSION

        meta.update(stored_size=sum(s.stored_bytes for s in shards), format="tiered-lossless", version=FORMAT_VERSION)
    index = {"metadata": meta, "weight_map": {t.name: s.name for s in shards for t in s.tensors}}
    return (json.dumps(index, indent=2) + "\n").encode()


# ---------------------------------------------------------------------------------------------- other files


def _config_dtype(dtype: torch.dtype) -> str:
    """The name of ``dtype`` in a ``config.json`` (``"bfloat16"``), as transformers writes it."""
    return str(dtype).removeprefix("torch.")


def _files_to_copy(source: Source, src: Path, notes: list[str]) -> list[Path]:
    """The non-weight files of the source directory, its subdirectories' too (a sentence-transformers model's
    ``1_Pooling/``, a tokenizer in ``tokenizer/``), as paths under ``source.root``; notes what is skipped. A
    single-file SRC copies nothing. Skipped: hidden directories (``.git/``, ``.cache/``) and ``__pycache__/``,
    weights in other formats and shard indexes (anywhere), and a file the source generates
    (:attr:`Source.generated_files`: the generated one is written).
    """
    if src.is_file():
        return []
    files, hidden, skipped = [], [], []
    weights = {p.name for p in source.files}
    found = []
    for here, dirs, names in os.walk(source.root):  # hidden directories pruned, never walked (a .git/ can be large)
        keep = [d for d in dirs if not (d.startswith(".") or d == "__pycache__")]
        if Path(here) == source.root:
            hidden += [d + "/" for d in sorted(set(dirs) - set(keep))]
        dirs[:] = keep
        found += [Path(here) / n for n in names]
    for p in sorted(found):
        rel = p.relative_to(source.root)
        top = len(rel.parts) == 1
        if top and p.name in source.generated_files:
            notes.append(f"{p.name}: the one the {source.kind} source generates is written instead")
        elif not p.is_file():
            skipped.append(f"{rel} (dangling link)")
        elif top and (p.name in weights or p.name in _STALE_FILES):
            continue
        elif p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            skipped.append(str(rel))
        else:
            files.append(p)
    if skipped:
        notes.append(f"not copied (weights in another format, or unused): {', '.join(skipped)}")
    if hidden:
        notes.append(f"hidden directories not copied: {', '.join(hidden)}")
    return files


def _set_config_dtype(data: bytes, dtype: torch.dtype, notes: list[str], done: str = "copied") -> bytes | None:
    """``config.json`` with its dtype set to ``dtype``; None (and a note) when it is not JSON."""
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        notes.append(f"config.json is not JSON ({e}): {done} unchanged, its dtype not updated")
        return None
    doc["dtype"] = _config_dtype(dtype)
    if "torch_dtype" in doc:
        doc["torch_dtype"] = _config_dtype(dtype)
    notes.append(f"config.json: dtype set to {_config_dtype(dtype)}")
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _copy_file(src: Path, dst: Path, dtype: torch.dtype | None, notes: list[str], *, top: bool = True) -> None:
    """Copy ``src`` to ``dst`` (its directory made) and fsync it; the model's ``config.json`` (``top``: in the
    directory's root, not a submodule's) gets ``dtype`` when the weights were cast."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dtype is not None and top and src.name == "config.json":
        data = _set_config_dtype(src.read_bytes(), dtype, notes)
        if data is not None:
            _write_file(dst, data)
            return
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
        fo.flush()
        os.fsync(fo.fileno())


def _write_generated(dst: Path, data: bytes, dtype: torch.dtype | None, notes: list[str]) -> None:
    """Write a file the source generates; ``config.json`` gets ``dtype`` when the weights were cast."""
    if dtype is not None and dst.name == "config.json":
        data = _set_config_dtype(data, dtype, notes, "written") or data
    _write_file(dst, data)


# ---------------------------------------------------------------------------------------------- verify


def _verify(tmp: Path, shards: list[_Shard], hashes: dict[str, bytes], progress: Any) -> None:
    """Re-read every written tensor from disk (page cache dropped first) and compare BLAKE2b hashes.

    Also re-validates each shard's header with :func:`~tiered.format.read_header` (a compressed shard's tables
    with :func:`~tiered.lossless.logical_shard`, as the loader reads them) and checks that it lists exactly the
    planned tensors at the planned offsets, coded where they were written coded, data section 4 KiB-aligned. A coded
    tensor is decoded chunk by chunk (each chunk's CRC-32 checked) and the plain bytes hashed.
    """
    from ..lossless import LosslessInfo, logical_shard

    for shard in shards:
        path = tmp / shard.name
        parsed = logical_shard(read_header(path))
        got = [(n, t.dtype, t.shape, t.offset - parsed.data_start, isinstance(t, LosslessInfo))
               for n, t in parsed.tensors.items()]
        want = [(t.name, t.dtype, tuple(t.shape), t.data_offset, t.coded is not None) for t in shard.tensors]
        if got != want or parsed.data_start % DATA_ALIGN:
            raise VerifyError(f"{path}: the header read back differs from the one written; rerun, and check the disk")
        m = ShardMap(path)
        try:
            os.posix_fadvise(m.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean after fsync: the read below hits the disk
            for t in shard.tensors:
                info = parsed.tensors[t.name]
                off = info.offset
                h = hashlib.blake2b(digest_size=16)
                if isinstance(info, LosslessInfo):
                    _hash_coded(m, info, h, progress)
                else:
                    for lo in range(0, t.nbytes, CHUNK_BYTES):
                        n = min(CHUNK_BYTES, t.nbytes - lo)
                        ahead = (off + lo + n) // PAGE_SIZE * PAGE_SIZE
                        if ahead < len(m.mm):  # start reading the next chunk while this one is hashed
                            m.mm.madvise(mmap.MADV_WILLNEED, ahead, min(CHUNK_BYTES, len(m.mm) - ahead))
                        h.update(m.span(off + lo, n).numpy())
                        m.drop(off + lo, n, page_cache=True)
                        progress.update(n)
                if h.digest() != hashes[t.name]:
                    raise VerifyError(
                        f"{path}: tensor {t.name!r} at offset {off} ({t.stored} bytes in the file) reads back "
                        "differently from what was written; the disk or filesystem corrupted it: check it (dmesg, "
                        "smartctl) and rerun"
                    )
        finally:
            m.close()


def _hash_coded(m: ShardMap, info: Any, h: Any, progress: Any) -> None:
    """Decode the coded tensor ``info`` (a :class:`~tiered.lossless.LosslessInfo`) chunk by chunk from ``m`` into
    one chunk's buffer, hashing the plain bytes into ``h``; each chunk's pages dropped (page cache too) after.

    Raises:
        VerifyError: a chunk fails its CRC-32 or does not decode (the message says which, and where).
    """
    from ..errors import CodecError
    from ..lossless import decode_chunk

    coded = info.coded
    buf = np.empty(coded.chunk * coded.itemsize, dtype=np.uint8)
    for c in range(coded.count()):
        start, length = coded.chunk_span(c)
        lo, hi = coded.chunk_range(c)
        at = info.offset + start
        try:
            decode_chunk(m.span(at, length).numpy(), coded, c, buf[: hi - lo], where=f"{m.path}: tensor {info.name!r}",
                         at=at)
        except CodecError as e:
            raise VerifyError(f"{e} (read back after writing: the disk or filesystem corrupted it: check it "
                              "(dmesg, smartctl) and rerun)") from None
        h.update(buf[: hi - lo])
        m.drop(at, length, page_cache=True)
        progress.update(hi - lo)
