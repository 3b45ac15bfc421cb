"""The converter: reshard any checkpoint into stream order, with bounded memory, never half-written.

Input: a Hugging Face model directory (or one weight file) with safetensors (one file, or shards
with ``model.safetensors.index.json``) or PyTorch checkpoints (``pytorch_model.bin``, shards with
``pytorch_model.bin.index.json``, ``*.pt``/``*.pth``). PyTorch files are read with
``torch.load(..., mmap=True, weights_only=True)`` only: never unrestricted pickle.

Output (a new directory), as the loader wants it:

* safetensors shards ``model-0000i-of-0000N.safetensors`` whose tensors are written in *execution
  order* — the unit plan of :func:`tiered.plan.build_plan`, the one the loader streams — so every
  unit is one contiguous span inside one shard. A shard boundary falls only between units; a unit
  larger than ``max_shard_size`` gets a shard of its own. Without ``config.json``, or with an
  architecture ``transformers`` does not know, units are ordered by the layer index in tensor names
  (``…layers.12.…``, ``…h.12.…``) and the summary says so.
* every shard's data section starts on a 4 KiB boundary: the JSON header is padded with spaces,
  which the safetensors spec allows ("Format" section); the spec forbids holes between tensors, so
  tensors stay packed.
* ``model.safetensors.index.json`` with ``metadata.total_size`` (bytes of tensor data), and every
  non-weight file (config, generation config, tokenizer files) copied.
* the checkpoint's own tensor names and bytes: each tensor is bit-equal to the input, or equal to
  ``tensor.to(dtype)`` for floating tensors when ``dtype`` is given. Duplicates of tied weights
  (an ``lm_head.weight`` sharing the embedding's storage in a ``.bin``) are written once.

Memory: bytes move in chunks of at most :data:`CHUNK_BYTES`. Without a cast and without ``verify``,
safetensors bytes move with ``copy_file_range`` (kernel to kernel, as ``cp`` does: no user pages at
all); otherwise through the source mapping with ``os.pwrite``, dropping read pages with
``madvise(MADV_DONTNEED)`` after each chunk (mapped pages count in RSS until dropped). Written pages
are pushed to disk in windows of :data:`WRITEBACK_BYTES` (``sync_file_range``) and dropped from the
page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``). A cast goes through one fixed buffer of
``CHUNK_BYTES`` (``copy_``, allocated once). Peak RSS growth is about two chunks whatever the
checkpoint or shard size (measured on 1.56 GiB in one shard: 9 MiB copying, ~50-70 MiB verifying,
~90-110 MiB casting); a non-contiguous tensor in a ``.bin`` is made contiguous first (one tensor).
With ``verify``, each chunk is hashed on one helper thread while the calling thread writes it.

Safety: everything is written into ``.DST.tiered-tmp-<pid>`` beside ``DST``, each file fsynced, the
directory fsynced, optionally every tensor re-read from disk and compared by BLAKE2b hash, and only
then installed as ``DST``. A killed run leaves no partial ``DST``; its temporary directory is removed
by the next run (a live run holds an ``flock`` on it). ``SRC`` is only ever opened read-only. An
existing ``DST`` is refused unless ``force``. A full disk raises :class:`DiskFullError` and removes the
partial output.

Install, and what a kill (SIGKILL) at any point of it leaves:

* no ``DST`` yet: one rename, tmp -> ``DST`` (``renameat2(RENAME_NOREPLACE)`` where the kernel has it,
  so a ``DST`` that appeared meanwhile is never replaced). Killed before it: no ``DST``, a stray tmp.
* ``force`` and a ``DST``: ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15; ext4, xfs, btrfs, tmpfs...)
  swaps the two atomically; then the old one, now under the tmp name, is deleted. Killed before the
  swap: the old ``DST`` and a stray tmp; after it: the new ``DST`` and the old one under a stray name.
  ``DST`` is never absent.
* ``force`` where the swap is unsupported (or ``TIERED_RESHARD_NO_RENAMEAT2=1``, for tests): a journal
  ``.DST.tiered-install-<pid>`` is created, locked and fsynced — the commit point, reached only once
  tmp is complete and fsynced — then ``DST`` -> ``.DST.tiered-old-<pid>``, tmp -> ``DST``, the old one
  deleted, the journal removed. Killed in between: possibly no ``DST`` for now, but the complete new
  output and the old one beside it, and the journal that says so.

Every run first recovers, before it checks ``DST`` or removes anything: a journal whose run is dead
(its pid gone and its lock free) is *rolled forward* (the complete tmp becomes ``DST``, then the old
one is deleted), or *rolled back* (the old one is renamed back to ``DST``) if the new output is gone;
only then are stray temporary directories of dead runs removed. So ``DST`` is never partial, an old
``DST`` is deleted only once the new one holds its name, and a finished output is never deleted as a
stray. A plain rerun after a killed ``force`` run finds ``DST`` (old or new) and refuses, as before it.

Python: ``tiered.reshard(src, dst, max_shard_size="2GB", dtype="bf16")``.
Command line: ``tiered reshard SRC DST ...`` or ``python tools/reshard.py SRC DST ...``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import hashlib
import itertools
import json
import mmap
import os
import pickle
import platform
import re
import shutil
import signal
import sys
import threading
import time
import zipfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, DuplicateTensorError, HeaderError, ShardNotFoundError, TieredError
from .format import INDEX_NAME, Checkpoint, TensorInfo, dtype_name, encode_header, open_checkpoint, read_header
from .format import parse_size as _parse_size
from .hostmem import PAGE_SIZE, page_up
from .reader import ShardMap

__all__ = [
    "reshard",
    "ReshardSummary",
    "ReshardError",
    "DestinationExistsError",
    "DiskFullError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "VerifyError",
    "parse_size",
    "add_parser",
    "main",
    "CHUNK_BYTES",
    "DATA_ALIGN",
]

#: Bytes moved per copy call: the fixed buffer that bounds RSS on the mmap/cast paths.
CHUNK_BYTES = 64 << 20
#: Alignment of every output shard's data section (bytes): one page, what mmap and O_DIRECT need.
DATA_ALIGN = 4096
#: Written bytes between writeback kicks (sync_file_range); what keeps dirty page cache bounded.
WRITEBACK_BYTES = 256 << 20

BIN_INDEX_NAME = "pytorch_model.bin.index.json"
_TMP_TAG = ".tiered-tmp-"
_OLD_TAG = ".tiered-old-"
_JOURNAL_TAG = ".tiered-install-"
_LOCK_NAME = ".tiered-lock"
# Files that describe the *source* weights; never copied (their content would be stale).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_STALE_FILES = {INDEX_NAME, BIN_INDEX_NAME, "tiered_checkpoint.json"}
_CASTABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_DTYPE_ARGS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
               "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_CONFIG_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ---------------------------------------------------------------------------------------------- errors


class ReshardError(TieredError):
    """The converter could not produce ``DST`` (nothing of ``DST`` is left behind)."""


class DestinationExistsError(ReshardError, FileExistsError):
    """``DST`` exists (pass ``force=True`` / ``--force`` to replace it)."""


class DiskFullError(ReshardError, OSError):
    """The disk filled up (ENOSPC/EDQUOT) while writing; the partial output was removed."""


class UnsafePickleError(ReshardError, ValueError):
    """A PyTorch file needs pickle beyond plain tensors: ``torch.load(weights_only=True)`` refused it."""


class UnsupportedCheckpointError(ReshardError, ValueError):
    """A PyTorch file that loads safely but is not a mapping of names to plain tensors, or is unreadable."""


class VerifyError(ReshardError):
    """A tensor re-read from ``DST`` does not hash like the bytes that were written."""


# ---------------------------------------------------------------------------------------------- sizes


def parse_size(size: int | str) -> int:
    """Bytes in ``size`` (see :func:`tiered.format.parse_size`). Raises ReshardError when unparsable or not > 0."""
    try:
        return _parse_size(size)
    except ValueError as e:
        raise ReshardError(f"max_shard_size: {e}") from None


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


_libc: Any = None


def _libc_fn(name: str) -> Any:
    """The libc function ``name`` (errno kept for :func:`ctypes.get_errno`), or None when there is none."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:  # pragma: no cover - not glibc/musl
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def _libc_call(name: str, *args: Any) -> int | None:
    """Call a libc function by name (None when there is none); errors are ignored (advice only)."""
    fn = _libc_fn(name)
    return None if fn is None else fn(*args)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276}  # for a libc without the wrapper (glibc < 2.28)


def _renameat2(old: Path, new: Path, flags: int) -> bool:
    """``renameat2(old, new, flags)``: True once done, False where the kernel, the filesystem or libc lacks it.

    Any other failure raises OSError (``FileExistsError`` for RENAME_NOREPLACE onto an existing ``new``).
    ``TIERED_RESHARD_NO_RENAMEAT2=1`` makes it always return False (the portable path, for tests).
    """
    if os.environ.get("TIERED_RESHARD_NO_RENAMEAT2", "") not in ("", "0"):
        return False
    args = (ctypes.c_int(_AT_FDCWD), os.fsencode(old), ctypes.c_int(_AT_FDCWD), os.fsencode(new), ctypes.c_uint(flags))
    fn = _libc_fn("renameat2")
    if fn is not None:
        rc = fn(*args)
    else:
        nr, syscall = _SYS_RENAMEAT2.get(platform.machine()), _libc_fn("syscall")
        if nr is None or syscall is None:
            return False
        rc = syscall(ctypes.c_long(nr), *args)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(old), None, str(new))


def _madvise_dontneed(addr: int, nbytes: int) -> None:
    """Drop the pages of a *file-backed, never-written* mapping range from this process (RssFile)."""
    lo = addr // PAGE_SIZE * PAGE_SIZE
    hi = page_up(addr + nbytes)
    if hi > lo:
        _libc_call("madvise", ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))


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


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- the source


class _Source:
    """The input checkpoint: a :class:`TensorInfo` per tensor (source order) and byte access to each.

    safetensors: each shard is mapped once (:class:`~tiered.reader.ShardMap`), ``TensorInfo.offset`` is
    the absolute file offset. PyTorch: each file is ``torch.load``-ed with ``mmap=True`` (tensors are
    views of a private, read-only-in-practice file mapping); ``TensorInfo.offset`` is 0 (unknown).
    """

    def __init__(self, root: Path, kind: str, files: list[Path], infos: dict[str, TensorInfo],
                 tensors: dict[str, torch.Tensor] | None = None, mapped: set[Path] | None = None,
                 notes: list[str] | None = None) -> None:
        self.root = root
        self.kind = kind  # "safetensors" | "torch"
        self.files = files
        self.infos = infos
        self.keep_dtype: set[str] = set()  # not cast with --dtype: the model's dtype plan keeps them (float32)
        self.tensors = tensors or {}
        self.mapped = mapped or set()  # torch files whose tensors are unmodified views of a file mapping
        self.notes = notes or []
        self.maps: dict[Path, ShardMap] = {}
        self.fds: dict[Path, int] = {}

    def checkpoint(self) -> Checkpoint:
        """A :class:`Checkpoint` view for :func:`~tiered.plan.build_plan` (names, dtypes, shapes)."""
        return Checkpoint(root=self.root, shards=[], tensors=dict(self.infos))

    def shard_map(self, path: Path) -> ShardMap:
        if path not in self.maps:
            self.maps[path] = ShardMap(path)
        return self.maps[path]

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def byte_view(self, name: str) -> tuple[torch.Tensor, Any]:
        """(all bytes of tensor ``name`` as a flat uint8 view, a drop(lo, hi) function for them)."""
        info = self.infos[name]
        if self.kind == "safetensors":
            m = self.shard_map(info.file)
            return m.span(info.offset, info.nbytes), lambda lo, hi: m.drop(info.offset + lo, hi - lo)
        t = self.tensors[name]
        copied = not t.is_contiguous()
        if copied:
            t = t.contiguous()  # memory: this one tensor (anonymous: never madvise it, DONTNEED would zero it)
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if copied or info.file not in self.mapped:
            return flat, lambda lo, hi: None
        base = flat.data_ptr()
        return flat, lambda lo, hi: _madvise_dontneed(base + lo, hi - lo)

    def same_storage(self, a: str, b: str) -> bool:
        """True when PyTorch tensors ``a`` and ``b`` are the same view of one storage (tied in the file)."""
        ta, tb = self.tensors.get(a), self.tensors.get(b)
        return (ta is not None and tb is not None and ta.dtype == tb.dtype and ta.shape == tb.shape
                and ta.stride() == tb.stride() and ta.numel() > 0 and ta.data_ptr() == tb.data_ptr())

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        for fd in self.fds.values():
            os.close(fd)
        self.maps.clear()
        self.fds.clear()
        self.tensors.clear()


def _read_index(index: Path) -> dict[str, str]:
    try:
        doc = json.loads(index.read_text())
        wm = doc["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeaderError(f"{index}: not a valid index (needs a 'weight_map' object): {e}; regenerate it") from None
    return wm


def _torch_load(path: Path) -> tuple[Mapping[str, torch.Tensor], bool, list[str]]:
    """``torch.load(path, mmap=True, weights_only=True)``: (state dict, mapped?, notes)."""
    notes: list[str] = []
    mapped = zipfile.is_zipfile(path)
    try:
        obj = torch.load(path, map_location="cpu", mmap=mapped, weights_only=True)
    except pickle.UnpicklingError as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch colours its message
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        what = f"it stores a {found.group(1)} object" if found else "it needs pickle beyond plain tensors"
        raise UnsafePickleError(
            f"{path}: torch.load(weights_only=True) refused it: {what}. tiered never runs arbitrary pickle; "
            "if you trust the file, keep only its tensors yourself: sd = torch.load(path, weights_only=False); "
            "safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}, "
            "'model.safetensors')"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise UnsupportedCheckpointError(f"{path}: torch.load failed ({e}); the file is damaged or not a "
                                         "PyTorch checkpoint: re-download it") from None
    if not mapped:
        notes.append(f"{path.name}: legacy (non-zip) torch.save format, read into memory (no mmap)")
    else:
        with zipfile.ZipFile(path) as z:
            order = [n for n in z.namelist() if n.endswith("/byteorder")]
            if order and z.read(order[0]).decode().strip() != sys.byteorder:
                mapped = False  # torch byte-swapped the (private) mapping in place: dropping pages would undo it
                notes.append(f"{path.name}: saved {z.read(order[0]).decode().strip()}-endian; pages not dropped")
    sd = obj
    if isinstance(obj, Mapping) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model_state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                notes.append(f"{path.name}: took the tensors under key {key!r} (other keys ignored: "
                             f"{sorted(k for k in obj if k != key)[:5]})")
                sd = inner
                break
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in sd.items()):
        what = (f"a mapping with keys {sorted(map(str, sd))[:5]} of types "
                f"{sorted({type(v).__name__ for v in sd.values()})}" if isinstance(sd, Mapping) else type(sd).__name__)
        raise UnsupportedCheckpointError(f"{path}: holds {what}, not a mapping of names to tensors (a state dict); "
                                         "save model.state_dict() instead")
    for k, t in sd.items():
        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            raise UnsupportedCheckpointError(f"{path}: tensor {k!r} is {t.layout}/quantized={t.is_quantized}; only "
                                             "dense tensors can be written to safetensors")
        try:
            dtype_name(t.dtype)
        except HeaderError:
            raise UnsupportedCheckpointError(f"{path}: tensor {k!r} has dtype {t.dtype}, which safetensors cannot "
                                             "store; cast it first") from None
    return sd, mapped, notes


def _weight_files(root: Path) -> tuple[str, list[Path], Path | None]:
    """(kind, weight files in order, index file or None) of a model directory; raises if none."""
    if (root / INDEX_NAME).is_file() or list(root.glob("*.safetensors")):
        return "safetensors", [], root / INDEX_NAME if (root / INDEX_NAME).is_file() else None
    index = root / BIN_INDEX_NAME
    if index.is_file():
        wm = _read_index(index)
        files = []
        for name in dict.fromkeys(wm.values()):
            p = root / name
            # lexical check: in a Hugging Face cache snapshot every file is a symlink into ../../blobs
            if os.path.isabs(name) or os.path.normpath(name).startswith(".."):
                raise ShardNotFoundError(f"{index}: shard {name!r} points outside {root}; fix the index's weight_map")
            if not p.is_file():
                raise ShardNotFoundError(f"{index}: shard {name!r} is missing from {root}; re-download it")
            files.append(p)
        return "torch", files, index
    if (root / "pytorch_model.bin").is_file():
        return "torch", [root / "pytorch_model.bin"], None
    bins = sorted(p for p in root.glob("*.bin") if p.name != "training_args.bin")
    pts = sorted(list(root.glob("*.pt")) + list(root.glob("*.pth")))
    if bins or pts:
        return "torch", bins or pts, None
    raise ShardNotFoundError(f"{root}: no weights found (model.safetensors, *.safetensors with "
                             f"{INDEX_NAME}, pytorch_model.bin, {BIN_INDEX_NAME}, *.pt); pass a model directory")


def _open_source(src: Path) -> _Source:
    """Validate the whole input (every header, index and pickle) before any tensor data is read."""
    if src.is_file():
        root, files = src.parent, [src]
        kind = "safetensors" if src.suffix == ".safetensors" else "torch"
        index = None
    elif src.is_dir():
        root = src
        kind, files, index = _weight_files(src)
    else:
        raise ShardNotFoundError(f"{src}: no such file or directory; pass a model directory or a weight file")
    if kind == "safetensors":
        if src.is_file():
            shard = read_header(src)
            ckpt = Checkpoint(root=root, shards=[shard], tensors=dict(shard.tensors))
        else:
            ckpt = open_checkpoint(src)  # index, missing shards, duplicates, every header
        skipped = [t for sh in ckpt.shards for t in sh.skipped.values()]
        if skipped:  # copying them raw is possible but not written yet: refuse rather than drop them
            t = skipped[0]
            raise UnsupportedCheckpointError(
                f"{t.file}: tensor {t.name!r} at offset {t.offset} has dtype {t.dtype_name} ({t.reason}); "
                f"tiered reshard cannot convert such tensors yet ({len(skipped)} in all): keep the checkpoint as "
                "it is (tiered.load reads it and skips them when the model does not use them)"
            )
        return _Source(root, kind, [s.path for s in ckpt.shards], dict(ckpt.tensors))

    infos: dict[str, TensorInfo] = {}
    tensors: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    mapped: set[Path] = set()
    for p in files:
        sd, is_mapped, n = _torch_load(p)
        if is_mapped:
            mapped.add(p)
        notes += n
        for name, t in sd.items():
            if name in infos:
                raise DuplicateTensorError(f"tensor {name!r} is in both {infos[name].file} and {p}; remove one copy")
            infos[name] = TensorInfo(name, t.dtype, tuple(t.shape), p, 0, t.numel() * t.dtype.itemsize)
            tensors[name] = t
    if index is not None:
        for name, shard_name in _read_index(index).items():
            info = infos.get(name)
            if info is None or info.file.name != Path(shard_name).name:
                where = "no shard" if info is None else str(info.file)
                raise HeaderError(f"{index}: weight_map puts {name!r} in {shard_name!r} but it is in {where}; "
                                  "regenerate the index")
    return _Source(root, "torch", files, infos, tensors, mapped, notes)


# ---------------------------------------------------------------------------------------------- the order


@dataclass
class _Unit:
    """One streaming unit of the output: checkpoint tensor names, in the order they are written."""

    name: str
    tensors: list[str] = field(default_factory=list)
    nbytes: int = 0  # output bytes (after a cast)


_LAYER_PREFIX = re.compile(r"^(?P<prefix>(?:.*?\.)?(?:layers|layer|h|blocks|block))\.(?P<idx>\d+)\.")
_EMBED = re.compile(r"embed|wte|wpe|tok_|word_|position_|patch_")


def _units_by_layer(names: list[str]) -> list[_Unit]:
    """Units when there is no plan: embedding-like modules, each stack's layers by index, the rest.

    Layer tensors are grouped by (stack prefix, layer index); stacks in order of first appearance.
    Other tensors are grouped by module (the name without its last component).
    """
    head: dict[str, _Unit] = {}
    layers: dict[tuple[str, int], _Unit] = {}
    tail: dict[str, _Unit] = {}
    stacks: dict[str, int] = {}
    for n in names:
        m = _LAYER_PREFIX.match(n)
        if m:
            key = (m["prefix"], int(m["idx"]))
            stacks.setdefault(m["prefix"], len(stacks))
            layers.setdefault(key, _Unit(f"{key[0]}.{key[1]}")).tensors.append(n)
        else:
            mod = n.rpartition(".")[0] or n
            group = head if _EMBED.search(mod) else tail
            group.setdefault(mod, _Unit(mod)).tensors.append(n)
    ordered = sorted(layers.items(), key=lambda kv: (stacks[kv[0][0]], kv[0][1]))
    return list(head.values()) + [u for _, u in ordered] + list(tail.values())


def _plan_units(source: _Source, notes: list[str],
                dtype: torch.dtype | None = None) -> tuple[list[_Unit], str | None, dict[str, str]]:
    """(units in execution order, architecture or None, tied pairs {checkpoint name: name it duplicates}).

    Uses the loader's own plan (:func:`~tiered.plan.build_plan` on a model built on ``meta`` from
    ``config.json``, at ``dtype``); falls back to :func:`_units_by_layer` and says why in ``notes``.
    Sets ``source.keep_dtype``: checkpoint tensors that ``from_pretrained`` keeps in float32 at ``dtype``
    (``_keep_in_fp32_modules``; T5's ``wo`` in fp16), which are therefore not cast.
    """
    names = list(source.infos)
    cfg = source.root / "config.json"

    def fallback(why: str) -> tuple[list[_Unit], None, dict[str, str]]:
        notes.append(f"{why}: units ordered by the layer index in tensor names")
        return _units_by_layer(names), None, {}

    if not cfg.is_file():
        return fallback(f"no config.json in {source.root}")
    try:
        from .meta import meta_model_from_dir
        from .plan import build_plan

        model = meta_model_from_dir(source.root, dtype=dtype or torch.float32)  # the dtype plan needs it
        plan = build_plan(model, source.checkpoint())
    except ConfigError as e:
        return fallback(str(e))
    except TieredError as e:
        return fallback(f"config.json does not match the checkpoint ({e})")
    except Exception as e:  # the order is an optimisation: any failure to build the plan falls back
        return fallback(f"cannot build the {cfg} model on meta ({type(e).__name__}: {e})")

    # Checkpoint names each model key reads (a tied parameter absent from the checkpoint reads its source's).
    reads: dict[str, list[str]] = {}
    units: list[_Unit] = []
    for u in plan.units:
        unit = _Unit(u.name)
        for t in u.targets:
            reads[t.key] = [c.src.name for c in t.copies]
            unit.tensors += reads[t.key]
        for conv in u.converts:
            unit.tensors += [s.name for ss in conv.sources.values() for s in ss]
        units.append(unit)
    if dtype is not None and dtype != torch.float32:  # transformers' dtype plan: these stay float32
        source.keep_dtype = {c.src.name for u in plan.units for t in u.targets if t.dtype == torch.float32
                             for c in t.copies}
        if source.keep_dtype:
            notes.append(f"{len(source.keep_dtype)} tensors kept in their dtype: {type(model).__name__} keeps them "
                         f"in float32 at {dtype} (_keep_in_fp32_modules), as from_pretrained does")
    if plan.unused:
        units.append(_Unit(f"(not used by {type(model).__name__})", list(plan.unused)))
        notes.append(f"{len(plan.unused)} tensors not used by {type(model).__name__} written last "
                     f"({', '.join(plan.unused[:3])}{', ...' if len(plan.unused) > 3 else ''})")
    tied: dict[str, str] = {}
    for dup_key, keep_key in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        dup, keep = reads.get(dup_key, []), reads.get(keep_key, [])
        if len(dup) == 1 and len(keep) == 1 and dup[0] != keep[0]:
            tied[dup[0]] = keep[0]
    return units, type(model).__name__, tied


def _same_bytes(source: _Source, a: str, b: str) -> bool:
    """True when tensors ``a`` and ``b`` have the same dtype, shape and bytes (read in chunks)."""
    ia, ib = source.infos[a], source.infos[b]
    if (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
        return False
    if source.kind == "torch" and source.same_storage(a, b):
        return True
    va, drop_a = source.byte_view(a)
    vb, drop_b = source.byte_view(b)
    for lo in range(0, ia.nbytes, CHUNK_BYTES):
        hi = min(ia.nbytes, lo + CHUNK_BYTES)
        same = torch.equal(va[lo:hi], vb[lo:hi])
        drop_a(lo, hi)
        drop_b(lo, hi)
        if not same:
            return False
    return True


# ---------------------------------------------------------------------------------------------- the layout


@dataclass
class _Out:
    """One output tensor: its source name, output dtype and bytes, and where it lies in its shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int = 0  # relative to the shard's data section
    cast: bool = False


@dataclass
class _Shard:
    name: str
    units: list[_Unit]
    tensors: list[_Out]
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.data_bytes


def _header(tensors: list[_Out], metadata: dict[str, str]) -> bytes:
    """The header in write order, padded so the data starts at a DATA_ALIGN boundary."""
    assert [t.data_offset for t in tensors] == list(itertools.accumulate((t.nbytes for t in tensors[:-1]), initial=0))
    return encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata, align=DATA_ALIGN)


def _out_dtype(info: TensorInfo, dtype: torch.dtype | None, keep: set[str]) -> torch.dtype:
    """The dtype ``info`` is written in: ``dtype`` for floating tensors, unless the model keeps it (``keep``)."""
    cast = dtype is not None and info.dtype in _CASTABLE and info.name not in keep
    return dtype if cast else info.dtype  # type: ignore[return-value]


def _out_nbytes(info: TensorInfo, dtype: torch.dtype | None, keep: set[str]) -> int:
    return info.numel * _out_dtype(info, dtype, keep).itemsize


def _layout(units: list[_Unit], source: _Source, dtype: torch.dtype | None, max_bytes: int,
            order: str) -> list[_Shard]:
    """Pack units into shards in order: a new shard starts when the next unit would pass ``max_bytes``."""
    groups: list[list[_Unit]] = []
    size = 0
    for u in units:
        if not groups or (groups[-1] and size + u.nbytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.nbytes
    shards = []
    for i, group in enumerate(groups):
        outs: list[_Out] = []
        off = 0
        for u in group:
            for n in u.tensors:
                info = source.infos[n]
                dt = _out_dtype(info, dtype, source.keep_dtype)
                cast = dt != info.dtype
                nbytes = info.numel * dt.itemsize
                outs.append(_Out(n, dt, info.shape, nbytes, off, cast))
                off += nbytes
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = _Shard(name, group, outs)
        shard.header = _header(outs, {"format": "pt", "tiered_order": order})
        shards.append(shard)
    return shards


# ---------------------------------------------------------------------------------------------- copying


class _Copier:
    """Moves tensor bytes from the source into output shards, in chunks of CHUNK_BYTES."""

    def __init__(self, source: _Source, progress: Any, hashes: dict[str, bytes] | None) -> None:
        self.source = source
        self.progress = progress
        self.hashes = hashes  # name -> blake2b of the written bytes, when verifying
        self.kernel_copy = hashes is None  # copy_file_range until it proves unavailable
        self.cast_buf: torch.Tensor | None = None  # (CHUNK_BYTES,) uint8, allocated once, on the first cast
        # verify: each chunk is hashed on this thread while the caller's thread writes it (both release the GIL)
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="tiered-hash") if hashes is not None else None
        self.kernel_copied = 0  # bytes moved by copy_file_range

    def tensor(self, out: _Out, fd: int, offset: int, wb: _Writeback) -> None:
        """Write ``out`` at byte ``offset`` of ``fd`` (its bytes, or its bytes cast to ``out.dtype``)."""
        if out.nbytes == 0:
            if self.hashes is not None:
                self.hashes[out.name] = hashlib.blake2b(digest_size=16).digest()
            return
        info = self.source.infos[out.name]
        if not out.cast and self.kernel_copy and self.source.kind == "safetensors":
            if self._kernel(info, fd, offset, wb):
                return
        h = hashlib.blake2b(digest_size=16) if self.hashes is not None else None
        src, drop = self.source.byte_view(out.name)
        isz = info.dtype.itemsize
        step = max(1, CHUNK_BYTES // max(isz, out.dtype.itemsize)) * isz  # source bytes per chunk, whole elements
        pos = offset
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
            pos += _pwrite(fd, buf, pos)
            if hashed is not None:
                hashed.result()  # before buf is reused or its pages dropped
            drop(lo, hi)
            self.progress.update(buf.nbytes)
            wb.advance(pos)
        if h is not None:
            self.hashes[out.name] = h.digest()  # type: ignore[index]

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)

    def _kernel(self, info: TensorInfo, fd: int, offset: int, wb: _Writeback) -> bool:
        """copy_file_range the tensor; False (nothing written) when the kernel/filesystem cannot."""
        src_fd = self.source.fd(info.file)
        done = 0
        while done < info.nbytes:
            n = min(CHUNK_BYTES, info.nbytes - done)
            try:
                k = _copy_range(src_fd, info.offset + done, fd, offset + done, n)
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
                raise OSError(errno.EIO, f"copy_file_range stopped at byte {info.offset + done} of {info.file}")
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_to_copy(source: _Source, src: Path) -> tuple[list[Path], list[str]]:
    """(non-weight files of the source directory, notes on what is skipped). A single-file SRC copies nothing."""
    if src.is_file():
        return [], []
    files, skipped_dirs, skipped = [], [], []
    weights = {p.name for p in source.files}
    for p in sorted(source.root.iterdir()):
        if p.is_dir():
            skipped_dirs.append(p.name + "/")
        elif not p.is_file():
            skipped.append(f"{p.name} (dangling link)")
        elif p.name in weights or p.name in _STALE_FILES:
            continue
        elif p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            skipped.append(p.name)
        else:
            files.append(p)
    notes = []
    if skipped:
        notes.append(f"not copied (weights in another format, or unused): {', '.join(skipped)}")
    if skipped_dirs:
        notes.append(f"subdirectories not copied: {', '.join(skipped_dirs)}")
    return files, notes


def _copy_file(src: Path, dst: Path, dtype: torch.dtype | None, notes: list[str]) -> None:
    """Copy ``src`` to ``dst`` and fsync it; ``config.json`` gets ``dtype`` when the weights were cast."""
    if dtype is not None and src.name == "config.json":
        try:
            doc = json.loads(src.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            notes.append(f"config.json is not JSON ({e}): copied unchanged, its dtype not updated")
        else:
            doc["dtype"] = _CONFIG_DTYPE[dtype]
            if "torch_dtype" in doc:
                doc["torch_dtype"] = _CONFIG_DTYPE[dtype]
            _write_file(dst, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
            notes.append(f"config.json: dtype set to {_CONFIG_DTYPE[dtype]}")
            return
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
        fo.flush()
        os.fsync(fo.fileno())


def _verify(tmp: Path, shards: list[_Shard], hashes: dict[str, bytes], progress: Any) -> None:
    """Re-read every written tensor from disk (page cache dropped first) and compare BLAKE2b hashes.

    Also re-validates each shard's header with :func:`~tiered.format.read_header` and checks that it
    lists exactly the planned tensors at the planned offsets, data section 4 KiB-aligned.
    """
    for shard in shards:
        path = tmp / shard.name
        parsed = read_header(path)
        got = [(n, t.dtype, t.shape, t.offset - parsed.data_start) for n, t in parsed.tensors.items()]
        want = [(t.name, t.dtype, tuple(t.shape), t.data_offset) for t in shard.tensors]
        if got != want or parsed.data_start % DATA_ALIGN:
            raise VerifyError(f"{path}: the header read back differs from the one written; rerun, and check the disk")
        m = ShardMap(path)
        try:
            os.posix_fadvise(m.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean after fsync: the read below hits the disk
            for t in shard.tensors:
                h = hashlib.blake2b(digest_size=16)
                off = parsed.data_start + t.data_offset
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
                        f"{path}: tensor {t.name!r} at offset {off} ({t.nbytes} bytes) reads back differently from "
                        "what was written; the disk or filesystem corrupted it: check it (dmesg, smartctl) and rerun"
                    )
        finally:
            m.close()


# ---------------------------------------------------------------------------------------------- atomicity


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(path: Path, kind: str, pid: int) -> bool:
    """A temporary directory is stale when no live run holds its lock (or, lockless, its pid is dead)."""
    lock = path / _LOCK_NAME
    if kind == "tmp" and lock.is_file():
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return not _alive(pid)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # releases the lock
        return True
    return pid != os.getpid() and not _alive(pid)


def _remove_strays(dst: Path) -> list[Path]:
    """Remove ``.DST.tiered-tmp-<pid>`` / ``-old-<pid>`` / ``-probe-<pid>`` left by killed runs (after :func:`_recover`)."""
    pat = re.compile(re.escape(f".{dst.name}") + r"\.tiered-(tmp|old|probe)-(\d+)")
    removed = []
    if not dst.parent.is_dir():
        return removed
    for p in dst.parent.iterdir():
        m = pat.fullmatch(p.name)
        if m and _lexists(dst.parent / f".{dst.name}{_JOURNAL_TAG}{m[2]}"):
            continue  # its run's install journal is there: that tmp or old DST is _recover's to finish
        if m and _stale(p, m[1], int(m[2])):
            _remove_tree(p)
            removed.append(p)
    return removed


def _remove_tree(p: Path) -> None:
    """Delete a directory tree, or a file or symlink (never what a symlink points to)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _lexists(p: Path) -> bool:
    return os.path.lexists(p)


def _check_paths(src: Path, dst: Path) -> None:
    if not src.exists():
        raise ShardNotFoundError(f"{src}: no such file or directory; pass a model directory or a weight file")
    rs, rd = src.resolve(), dst.resolve()
    if rd == rs or rd in rs.parents or (src.is_dir() and rs in rd.parents):
        raise ReshardError(f"DST {dst} is SRC, inside it or contains it; SRC is never modified: choose another DST")


def _check_dst(dst: Path, force: bool, recovered: list[str]) -> None:
    if _lexists(dst) and not force:
        why = f" ({'; '.join(recovered)})" if recovered else ""
        raise DestinationExistsError(f"{dst} exists{why}; pass --force (force=True) to replace it")


def _install(tmp: Path, dst: Path, force: bool) -> None:
    """Make the finished, fsynced ``tmp`` the ``dst`` (an existing ``dst`` is replaced, with ``force``).

    Crash-safe at every step (see "Install" in the module docstring): one rename when there is no
    ``dst``; with one, an atomic ``RENAME_EXCHANGE`` swap, or else the journaled two-rename scheme
    that :func:`_recover` finishes or undoes after a kill.
    """
    parent = dst.parent
    if not _lexists(dst):
        try:
            done = _renameat2(tmp, dst, _RENAME_NOREPLACE)
        except FileExistsError:
            done = False  # it appeared just now: the checks below refuse or replace it
        if not done and not _lexists(dst):
            os.rename(tmp, dst)
            done = True
        if done:
            _fsync_path(parent)
            return
    if not force:
        raise DestinationExistsError(f"{dst} appeared while resharding; pass --force to replace it")
    if _renameat2(tmp, dst, _RENAME_EXCHANGE):  # atomic: dst is the new output, tmp now holds the old one
        _fsync_path(parent)
        _remove_tree(tmp)  # killed before this: the next run removes it as a stray
        return
    old = parent / f".{dst.name}{_OLD_TAG}{os.getpid()}"
    journal = parent / f".{dst.name}{_JOURNAL_TAG}{os.getpid()}"
    fd = os.open(journal, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this run lives: _recover of other runs leaves it alone
        os.write(fd, (json.dumps({"complete": tmp.name, "old": old.name, "dst": dst.name}) + "\n").encode())
        os.fsync(fd)
        _fsync_path(parent)  # the commit point: from here a kill is rolled forward by the next run
        try:
            os.rename(dst, old)
            os.rename(tmp, dst)
        except BaseException:
            if _lexists(old) and not _lexists(dst):
                os.rename(old, dst)  # roll back: the old DST as it was, the new output stays in tmp
            _fsync_path(parent)
            journal.unlink()
            raise
        _fsync_path(parent)
        _remove_tree(old)
        journal.unlink()
        _fsync_path(parent)
    finally:
        os.close(fd)


def _recover(dst: Path) -> list[str]:
    """Finish or undo the install of every run killed inside it (its journal beside ``dst``); returns notes.

    Run first by every run, before ``dst`` is checked and strays are removed. A journal is stale when
    its pid is gone and its lock is free (a live run, or another run recovering it, holds the lock).
    With a stale journal: the complete new output (tmp) becomes ``dst`` — if the old ``dst`` was
    not yet moved aside, it is first (roll forward); if the new output is gone, a moved-aside old
    ``dst`` is renamed back (roll back); then the old one is deleted and the journal last. A kill
    during recovery leaves the journal, and the next run resumes from whatever state it finds.
    Raises OSError when the directory cannot be changed.
    """
    parent = dst.parent
    if not parent.is_dir():
        return []
    pat = re.compile(re.escape(f".{dst.name}{_JOURNAL_TAG}") + r"(\d+)")
    notes = []
    for journal in sorted(parent.iterdir()):
        m = pat.fullmatch(journal.name)
        if not m:
            continue
        pid = int(m[1])
        if pid != os.getpid() and _alive(pid):
            continue
        try:
            fd = os.open(journal, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if os.fstat(fd).st_nlink == 0:  # recovered (and unlinked) by another run meanwhile
                continue
            tmp = parent / f".{dst.name}{_TMP_TAG}{pid}"
            old = parent / f".{dst.name}{_OLD_TAG}{pid}"
            complete = _lexists(tmp) and not _lexists(tmp / _LOCK_NAME)  # a locked tmp is another run's
            if complete and not (_lexists(dst) and _lexists(old)):
                # Two renames, not a swap: each step leaves a state this function resumes correctly.
                if _lexists(dst):
                    os.rename(dst, old)  # killed before it moved the old DST aside: do it now
                    _fsync_path(parent)
                os.rename(tmp, dst)
                notes.append(f"completed the install of an interrupted run (pid {pid}): {dst.name} is its output")
            elif complete:
                notes.append(f"{dst.name} was written again after run {pid} was interrupted; kept it")
            elif _lexists(old) and not _lexists(dst):
                os.rename(old, dst)
                notes.append(f"rolled back the install of an interrupted run (pid {pid}): restored the old {dst.name}")
            _fsync_path(parent)
            if _lexists(old) and _lexists(dst):
                _remove_tree(old)
            journal.unlink()
            _fsync_path(parent)
        finally:
            os.close(fd)
    return notes


def _disk_full(e: OSError, dst: Path, where: str) -> DiskFullError:
    free = shutil.disk_usage(dst.parent).free
    return DiskFullError(f"{dst}: disk full while writing {where} ({os.strerror(e.errno or errno.ENOSPC)}); "
                         f"{free / 1e9:.2f} GB free on {dst.parent}; the partial output was removed: "
                         "free space or choose a DST on another disk")


# ---------------------------------------------------------------------------------------------- the summary


def _human(n: int) -> str:
    """Decimal units, as disks are quoted: 3.34 GB, 898.6 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{3 if unit == 'GB' else 1}f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ReshardSummary:
    """What :func:`reshard` did. Bytes are exact; GB/s is decimal (1e9 bytes/s), as disks are quoted."""

    src: Path
    dst: Path
    input_format: str  # "safetensors" or "torch" (.bin / .pt, read with torch.load(mmap=True, weights_only=True))
    input_files: int  # weight files read
    shards: int  # output shards written
    tensors: int  # tensors written
    data_bytes: int  # tensor bytes written (the index's metadata.total_size)
    file_bytes: int  # bytes of the output shards, headers included
    seconds: float  # wall time from the call to the rename into place
    order: str  # "plan": the loader's unit plan; "layer-index": by the layer number in tensor names
    architecture: str | None  # the transformers class whose plan ordered the units
    units: int  # streaming units, each contiguous inside one shard
    reordered: bool  # the output tensor order differs from the input's
    cast: int  # tensors cast to ``dtype``
    dtype: str | None  # the requested dtype ("bfloat16", ...), or None
    dropped_tied: dict[str, str]  # duplicate of a tied weight -> the tensor kept
    copied_files: tuple[str, ...]  # non-weight files copied
    verified: bool  # every tensor re-read from disk and compared by BLAKE2b hash
    kernel_copy_bytes: int  # bytes moved with copy_file_range (no user-space pages)
    notes: tuple[str, ...] = ()

    @property
    def gb_per_s(self) -> float:
        return self.data_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        lines = [f"resharded {self.src} -> {self.dst}",
                 f"  {self.shards} shard(s), {self.tensors} tensors, {_human(self.data_bytes)} "
                 f"({self.data_bytes} bytes) in {self.seconds:.2f} s = {self.gb_per_s:.2f} GB/s"]
        if self.order == "plan":
            lines.append(f"  order: execution order of {self.architecture}, {self.units} units, each contiguous "
                         "in one shard; data sections 4 KiB-aligned")
        else:
            lines.append(f"  order: by layer index in tensor names (no usable config.json), {self.units} units, "
                         "each contiguous in one shard; data sections 4 KiB-aligned")
        changed = ["reordered" if self.reordered else "order unchanged"]
        if self.cast:
            changed.append(f"cast {self.cast} tensors to {self.dtype}")
        if self.dropped_tied:
            pairs = ", ".join(f"{d} (= {k})" for d, k in self.dropped_tied.items())
            changed.append(f"dropped duplicates of tied weights: {pairs}")
        lines.append(f"  changed: {'; '.join(changed)}")
        if self.copied_files:
            lines.append(f"  copied: {', '.join(self.copied_files)}")
        if self.verified:
            lines.append("  verified: every tensor re-read from disk, BLAKE2b hashes match")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- reshard


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    d = _DTYPE_ARGS.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if d not in _CONFIG_DTYPE:
        raise ReshardError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    return d


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GB",
    dtype: torch.dtype | str | None = None,
    verify: bool = False,
    force: bool = False,
    quiet: bool = False,
) -> ReshardSummary:
    """Rewrite the checkpoint in ``src`` into ``dst`` in stream order (see the module docstring).

    Args:
        src: a model directory (safetensors or PyTorch weights, plus config/tokenizer files), or one
            weight file (``.safetensors``, ``.bin``, ``.pt``); never modified.
        dst: the directory to create; must not exist unless ``force``. Its parent is created if needed.
        max_shard_size: largest output shard in bytes, or a string (``"2GB"`` = 2e9 bytes, decimal as
            transformers; ``"2GiB"``). Units are never split: a larger unit gets a shard of its own.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (or the torch dtype): cast floating tensors
            (F16/BF16/F32/F64; integer and fp8 tensors are kept) and set ``config.json``'s dtype.
        verify: re-read every written tensor from disk and compare BLAKE2b hashes before the rename
            (bytes are then copied through user space, to hash them on the way).
        force: replace an existing ``dst`` (only once the new one is complete).
        quiet: no progress bar (tqdm, stderr).

    Returns:
        a :class:`ReshardSummary` (``print`` it for the human-readable summary).

    Memory: chunks of :data:`CHUNK_BYTES` (64 MiB); peak RSS growth is a few chunks plus, for a
    non-contiguous tensor in a ``.bin``, that tensor.

    Raises:
        DestinationExistsError: ``dst`` exists and not ``force``.
        DiskFullError: ENOSPC/EDQUOT, or not enough free space up front; nothing is left behind.
        ShardNotFoundError: no weights in ``src``, or an index names a missing shard.
        DuplicateTensorError: a tensor name in two shards.
        HeaderError / TruncatedShardError: a malformed safetensors header or index.
        UnsafePickleError: a PyTorch file needs pickle beyond tensors (``weights_only=True`` refused it).
        UnsupportedCheckpointError: a PyTorch file that is not a state dict of dense tensors, or is damaged.
        VerifyError: with ``verify``, a tensor read back from disk differs.
        ReshardError: bad arguments (``dst`` inside ``src``, an unknown ``dtype``, a bad size).
    """
    t0 = time.perf_counter()
    src_p, dst_p = Path(src).absolute(), Path(dst).absolute()
    max_bytes = parse_size(max_shard_size)
    out_dtype = _parse_dtype(dtype)
    _check_paths(src_p, dst_p)
    try:  # first of all: finish or undo an install that a kill interrupted (it may have left no DST) ...
        notes = _recover(dst_p)
        removed = _remove_strays(dst_p)  # ... only then remove what dead runs left
    except OSError as e:
        raise ReshardError(f"{dst_p}: could not clean up after an interrupted run ({e}); "
                           "check the permissions of its directory") from None
    _check_dst(dst_p, force, notes)
    try:
        dst_p.parent.mkdir(parents=True, exist_ok=True)
        probe = dst_p.parent / f".{dst_p.name}.tiered-probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ReshardError(f"{dst_p.parent}: cannot write there ({e.strerror}); choose a writable DST") from None
    notes += [f"removed {p.name}, left by an interrupted run" for p in removed]
    source = _open_source(src_p)  # every header, index and pickle validated; no tensor data read
    try:
        return _reshard(source, src_p, dst_p, t0, max_bytes, out_dtype, verify, force, quiet, notes)
    finally:
        source.close()


def _reshard(source: _Source, src: Path, dst: Path, t0: float, max_bytes: int, dtype: torch.dtype | None,
             verify: bool, force: bool, quiet: bool, notes: list[str]) -> ReshardSummary:
    from tqdm.auto import tqdm

    notes += source.notes
    units, arch, tied = _plan_units(source, notes, dtype)
    dropped = {dup: keep for dup, keep in tied.items() if _same_bytes(source, dup, keep)}
    if source.kind == "torch" and arch is None:
        views: dict[tuple, list[str]] = {}
        for n, t in source.tensors.items():
            if t.numel():
                views.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), []).append(n)
        shared = [" = ".join(names) for names in views.values() if len(names) > 1]
        if shared:
            notes.append("tensors share storage in the PyTorch file, but without a model nothing says they are "
                         f"tied, so each is written: {', '.join(shared[:3])}")
    placed: set[str] = set(dropped)
    for u in units:  # a tensor read by two units (a tied source) is written with the first
        own = []
        for n in u.tensors:
            if n not in placed:
                placed.add(n)
                own.append(n)
        u.tensors = own
    rest = [n for n in source.infos if n not in placed]
    if rest:  # pragma: no cover - the plan and the fallback place every tensor
        units.append(_Unit("(other)", rest))
    units = [u for u in units if u.tensors]
    for u in units:
        u.nbytes = sum(_out_nbytes(source.infos[n], dtype, source.keep_dtype) for n in u.tensors)
    shards = _layout(units, source, dtype, max_bytes, "plan" if arch else "layer-index")
    written = [t.name for s in shards for t in s.tensors]
    files, file_notes = _files_to_copy(source, src)
    notes += file_notes
    need = sum(s.file_bytes for s in shards) + sum(p.stat().st_size for p in files)
    if need > shutil.disk_usage(dst.parent).free:
        raise DiskFullError(f"{dst}: needs {need / 1e9:.2f} GB but {dst.parent} has "
                            f"{shutil.disk_usage(dst.parent).free / 1e9:.2f} GB free; free space or choose another DST")
    total = sum(s.data_bytes for s in shards)

    tmp = dst.parent / f".{dst.name}{_TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier failed call of this very process
    tmp.mkdir()
    lock_fd = os.open(tmp / _LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # live: _remove_strays of other runs leaves tmp alone
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"reshard {dst.name}",
               file=sys.stderr, disable=quiet, dynamic_ncols=True, mininterval=0.25)
    where = "the index"
    hashes: dict[str, bytes] | None = {} if verify else None
    copier = _Copier(source, bar, hashes)
    try:
        for s in shards:
            where = s.name
            _write_shard(tmp / s.name, s, copier)
        where = INDEX_NAME
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: s.name for s in shards for t in s.tensors}}
        _write_file(tmp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        copied = []
        for p in files:
            where = p.name
            _copy_file(p, tmp / p.name, dtype, notes)
            copied.append(p.name)
        bar.close()
        if hashes is not None:
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"verify {dst.name}",
                      file=sys.stderr, disable=quiet, dynamic_ncols=True, mininterval=0.25) as vbar:
                _verify(tmp, shards, hashes, vbar)
        os.unlink(tmp / _LOCK_NAME)
        _fsync_path(tmp)
        _install(tmp, dst, force)
    except BaseException as e:
        bar.close()
        copier.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, TieredError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(e, dst, where) from e
        raise
    finally:
        os.close(lock_fd)
    copier.close()
    src_order = [n for n in source.infos if n not in dropped]
    return ReshardSummary(
        src=src, dst=dst, input_format=source.kind, input_files=len(source.files), shards=len(shards),
        tensors=len(written), data_bytes=total, file_bytes=sum(s.file_bytes for s in shards),
        seconds=time.perf_counter() - t0, order="plan" if arch else "layer-index", architecture=arch,
        units=len(units), reordered=written != src_order, cast=sum(t.cast for s in shards for t in s.tensors),
        dtype=_CONFIG_DTYPE[dtype] if dtype is not None else None, dropped_tied=dropped,
        copied_files=tuple(copied), verified=verify, kernel_copy_bytes=copier.kernel_copied, notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------- command line

_DESCRIPTION = """\
Reshard a checkpoint for streaming: rewrite its weights as safetensors shards in execution order
(every unit -- one decoder layer, the embeddings, the head -- contiguous inside one shard), each
shard's data section 4 KiB-aligned, with a standard model.safetensors.index.json; config,
generation config and tokenizer files are copied. Tensor names and bytes are kept (bit-equal), so
the output loads with transformers' from_pretrained as well as with tiered.load.

SRC is a Hugging Face model directory (safetensors, one file or sharded; pytorch_model.bin, sharded
.bin with index, or .pt/.pth) or one weight file. PyTorch files are read with
torch.load(mmap=True, weights_only=True) only. Memory stays bounded (64 MiB chunks) whatever the
checkpoint size. The output is written to .DST.tiered-tmp-<pid> beside DST and renamed into place
only when complete: an interrupted run leaves no partial DST (with --force: the old DST or the new
one), and the next run first completes or rolls back an install that was interrupted.
"""
_EPILOG = """\
examples:
  tiered reshard ~/models/llama-3-8b ~/models/llama-3-8b.tiered
  tiered reshard ckpt/ out/ --max-shard-size 4GB --dtype bf16 --verify
  python tools/reshard.py SRC DST          (the same tool, from a checkout)
exit status: 0 done, 1 error (nothing written), 130 interrupted (nothing written)
"""


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="model directory (or one .safetensors/.bin/.pt file) to read")
    p.add_argument("dst", metavar="DST", help="directory to create (refused if it exists, unless --force)")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="largest output shard: 2GB = 2e9 bytes (decimal, as transformers), 2GiB = 2*2^30; "
                   "a unit larger than this gets a shard of its own (default: 2GB)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="cast floating tensors (tensor.to(dtype)) and set config.json's dtype (default: keep)")
    p.add_argument("--verify", action="store_true",
                   help="before renaming into place, re-read every tensor from disk and compare BLAKE2b hashes")
    p.add_argument("--force", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary; errors only")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _cmd_reshard(a: argparse.Namespace) -> int:
    """Run ``reshard`` for parsed arguments; SIGTERM cleans up like Ctrl-C. Raises TieredError."""
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = reshard(a.src, a.dst, max_shard_size=a.max_shard_size, dtype=a.dtype, verify=a.verify,
                          force=a.force, quiet=a.quiet)
    except KeyboardInterrupt:
        print("reshard: interrupted; the partial output was removed", file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if not a.quiet:
        print(summary)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``reshard`` on an ``argparse`` subparsers object (``tiered reshard ...``); returns the parser.

    The parser's ``fn`` default runs the command and returns an exit status; it raises
    :class:`~tiered.errors.TieredError` for the caller to print.
    """
    p = subparsers.add_parser("reshard", help="rewrite a checkpoint in stream order (bounded memory, atomic)",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(fn=_cmd_reshard)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python tools/reshard.py SRC DST ...``: the same command as ``tiered reshard``."""
    p = argparse.ArgumentParser(prog="reshard", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    a = p.parse_args(argv)
    try:
        return _cmd_reshard(a)
    except TieredError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
