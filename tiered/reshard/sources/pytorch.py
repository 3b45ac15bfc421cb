"""PyTorch input: ``pytorch_model.bin``, shards with ``pytorch_model.bin.index.json``, ``*.pt``/``*.pth``.

Files are read with ``torch.load(..., mmap=True, weights_only=True)`` only — never unrestricted
pickle: a file that needs more is refused (:class:`~tiered.reshard.UnsafePickleError`), as is one
that is not a mapping of names to dense tensors (a ``state_dict``/``model`` key holding one is taken).
Tensors are views of a private file mapping; ``TensorInfo.offset`` is 0 (unknown). Pages read are
dropped after each chunk (``madvise(MADV_DONTNEED)``), except for a legacy (non-zip) file, which is
read into memory, and a file saved with the other byte order, which torch byte-swapped in place.
Tied weights saved once and referenced twice share storage (:meth:`TorchSource.same_storage`).
"""

from __future__ import annotations

import ctypes
import mmap
import pickle
import re
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from ...errors import DuplicateTensorError, HeaderError
from ...format import TensorInfo, dtype_name, read_index
from ...hostmem import PAGE_SIZE, page_up
from ..errors import UnsafePickleError, UnsupportedCheckpointError
from ..libc import _libc_call
from .base import Drop, Source

__all__ = ["TorchSource", "open_torch", "BIN_INDEX_NAME"]

BIN_INDEX_NAME = "pytorch_model.bin.index.json"


def _madvise_dontneed(addr: int, nbytes: int) -> None:
    """Drop the pages of a *file-backed, never-written* mapping range from this process (RssFile)."""
    lo = addr // PAGE_SIZE * PAGE_SIZE
    hi = page_up(addr + nbytes)
    if hi > lo:
        _libc_call("madvise", ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))


class TorchSource(Source):
    """PyTorch files, each ``torch.load``-ed with ``mmap=True``: tensors are views of a private,
    read-only-in-practice file mapping."""

    def __init__(self, root: Path, files: list[Path], infos: dict[str, TensorInfo], tensors: dict[str, torch.Tensor],
                 mapped: set[Path], notes: list[str]) -> None:
        super().__init__(root, "torch", files, infos, notes)
        self.tensors = tensors
        self.mapped = mapped  # files whose tensors are unmodified views of a file mapping

    def byte_view(self, name: str) -> tuple[torch.Tensor, Drop]:
        info = self.infos[name]
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
        """True when tensors ``a`` and ``b`` are the same view of one storage (tied in the file)."""
        ta, tb = self.tensors.get(a), self.tensors.get(b)
        return (ta is not None and tb is not None and ta.dtype == tb.dtype and ta.shape == tb.shape
                and ta.stride() == tb.stride() and ta.numel() > 0 and ta.data_ptr() == tb.data_ptr())

    def storage_groups(self) -> list[list[str]]:
        views: dict[tuple, list[str]] = {}
        for n, t in self.tensors.items():
            if t.numel():
                views.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), []).append(n)
        return [names for names in views.values() if len(names) > 1]

    def close(self) -> None:
        self.tensors.clear()


def _torch_load(path: Path) -> tuple[Mapping[str, torch.Tensor], bool, list[str]]:
    """``torch.load(path, mmap=True, weights_only=True)``: (state dict, mapped?, notes)."""
    notes: list[str] = []
    mapped = zipfile.is_zipfile(path)
    try:
        obj = torch.load(path, map_location="cpu", mmap=mapped, weights_only=True)
    except pickle.UnpicklingError as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch colours its message
        if not mapped and re.search(r"Unsupported operand|invalid load key", text):  # not a pickle at all
            raise UnsupportedCheckpointError(
                f"{path}: not a weight file tiered reads (safetensors, a PyTorch .bin/.pt/.pth checkpoint, or GGUF); "
                "pass a model directory or one of those files") from None
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


def open_torch(root: Path, files: list[Path], index: Path | None) -> TorchSource:
    """``torch.load`` every file (mmap, weights only); with ``index``, check its weight_map against them."""
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
        for name, shard_name in read_index(index).items():
            info = infos.get(name)
            if info is None or info.file.name != Path(shard_name).name:
                where = "no shard" if info is None else str(info.file)
                raise HeaderError(f"{index}: weight_map puts {name!r} in {shard_name!r} but it is in {where}; "
                                  "regenerate the index")
    return TorchSource(root, files, infos, tensors, mapped, notes)
