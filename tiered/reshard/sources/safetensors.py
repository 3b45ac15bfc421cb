"""safetensors input: one file, or a directory of shards (with ``model.safetensors.index.json`` or not), or a
losslessly compressed checkpoint (``tiered reshard --compress``'s, :mod:`tiered.lossless`).

Every header is validated by :func:`tiered.format.read_header` (the index, missing shards and
duplicate names by :func:`tiered.format.open_checkpoint`; a compressed shard's tables by
:func:`tiered.lossless.logical_shard`) before any data is read. Each shard is then
mapped once (:class:`~tiered.reader.ShardMap`); ``TensorInfo.offset`` is the absolute file offset, so
bytes can also move kernel to kernel (:meth:`SafetensorsSource.file_range`, for ``copy_file_range``).
A coded tensor is a :class:`~tiered.lossless.LosslessInfo` (its plain dtype and shape); its bytes are decoded as
they are read (:class:`_Decoded`), never moved by the kernel (that would copy coded bytes as plain ones).
Tensors torch cannot hold (F4, F6_*...) are refused rather than dropped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ...errors import DuplicateTensorError
from ...format import Checkpoint, TensorInfo, open_checkpoint, read_header
from ...lossless import LosslessInfo, decode_chunk, is_coded, logical_shard
from ...reader import ShardMap
from ..errors import UnsupportedCheckpointError
from .base import Drop, Source

__all__ = ["SafetensorsSource", "open_safetensors"]


class _Decoded:
    """The plain bytes of one coded tensor, read by slicing: ``view[lo:hi]`` is a ``(hi - lo,)`` uint8 tensor of
    plain bytes ``[lo, hi)``, decoded from the chunks that cover that range only (:meth:`Coded.covering`), valid until
    the next slice of this view (one window buffer, reused: the converter is done with a window before it asks for
    the next). The last chunk decoded in part is kept for the next slice (a window's edge seldom falls on a chunk's),
    so reading front to back decodes each chunk once; memory: the largest window, one plain chunk, the mapped pages
    and planes of the chunk being decoded.

    Runs on the caller's thread. Raises :class:`~tiered.errors.CodecError` (a chunk fails its CRC-32 or does not
    decode) naming the file, the tensor, the chunk and its file offset.
    """

    def __init__(self, m: ShardMap, info: LosslessInfo) -> None:
        self.m = m
        self.info = info
        self.coded = info.coded
        self.where = f"{info.file}: tensor {info.name!r}"
        self.kept: tuple[int, np.ndarray] | None = None  # (chunk, its plain bytes)
        self.window = torch.empty(0, dtype=torch.uint8)  # what the last slice returned a view of

    def _decode(self, c: int, out: np.ndarray) -> None:
        start, length = self.coded.chunk_span(c)
        at = self.info.offset + start
        decode_chunk(self.m.span(at, length).numpy(), self.coded, c, out, where=self.where, at=at)
        self.m.drop(at, length)  # its mapped pages: at most one coded chunk's stay mapped

    def _chunk(self, c: int) -> np.ndarray:
        if self.kept is None or self.kept[0] != c:
            lo, hi = self.coded.chunk_range(c)
            self.kept = (c, np.empty(hi - lo, dtype=np.uint8))
            self._decode(c, self.kept[1])
        return self.kept[1]

    def __getitem__(self, s: slice) -> torch.Tensor:
        lo, hi, step = s.indices(self.info.nbytes)
        if step != 1:
            raise IndexError("a coded tensor's bytes are read in contiguous slices")
        if hi <= lo:
            return torch.empty(0, dtype=torch.uint8)
        if self.window.numel() < hi - lo:
            self.window = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one is allocated
            self.window = torch.empty(hi - lo, dtype=torch.uint8)
        out = self.window[: hi - lo]
        dst, isz = out.numpy(), self.coded.itemsize
        for c in self.coded.covering(lo // isz, -(-hi // isz)):
            clo, chi = self.coded.chunk_range(c)
            a, b = max(lo, clo), min(hi, chi)
            if (a, b) == (clo, chi):
                self._decode(c, dst[a - lo: b - lo])
            else:
                dst[a - lo: b - lo] = self._chunk(c)[a - clo: b - clo]
        return out

    def drop(self, lo: int, hi: int) -> None:
        """Drop the mapped pages of the coded chunks that cover plain bytes ``[lo, hi)`` (the :data:`Drop` function;
        each chunk's pages are dropped as soon as it is decoded, so this only makes sure)."""
        if hi <= lo:
            return
        isz = self.coded.itemsize
        chunks = self.coded.covering(lo // isz, -(-hi // isz))
        first = self.coded.chunk_span(chunks[0])[0]
        start, length = self.coded.chunk_span(chunks[-1])
        self.m.drop(self.info.offset + first, start + length - first)


class SafetensorsSource(Source):
    """safetensors shards, each mapped once; bytes are views of the mapping, dropped after each chunk; a coded
    tensor's are decoded as they are read (:class:`_Decoded`). ``compressed``: the checkpoint is a compressed one
    (a shard carries :data:`~tiered.lossless.VERSION_KEY`)."""

    def __init__(self, root: Path, files: list[Path], infos: dict[str, TensorInfo], compressed: bool = False) -> None:
        super().__init__(root, "safetensors", files, infos)
        self.compressed = compressed
        self.maps: dict[Path, ShardMap] = {}
        self.fds: dict[Path, int] = {}

    def shard_map(self, path: Path) -> ShardMap:
        if path not in self.maps:
            self.maps[path] = ShardMap(path)
        return self.maps[path]

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def byte_view(self, name: str) -> tuple[torch.Tensor, Drop]:
        info = self.infos[name]
        m = self.shard_map(info.file)
        if isinstance(info, LosslessInfo):
            view = _Decoded(m, info)
            return view, view.drop  # type: ignore[return-value]  (sliced like a tensor: all the converter does)
        return m.span(info.offset, info.nbytes), lambda lo, hi: m.drop(info.offset + lo, hi - lo)

    def file_range(self, name: str) -> tuple[int, int] | None:
        info = self.infos[name]
        if isinstance(info, LosslessInfo):
            return None  # the file holds coded bytes: a kernel copy would write them as plain ones
        return self.fd(info.file), info.offset

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        for fd in self.fds.values():
            os.close(fd)
        self.maps.clear()
        self.fds.clear()


def open_safetensors(root: Path, files: list[Path], index: Path | None) -> SafetensorsSource:
    """The safetensors ``files`` (a single weight file), or with none the checkpoint in ``root`` (through its
    index, if any: :func:`~tiered.format.open_checkpoint`). Every header is validated; no data is read."""
    if files:
        ckpt = Checkpoint(root=root, shards=[])
        for f in files:
            shard = logical_shard(read_header(f))
            for name, t in shard.tensors.items():
                if name in ckpt.tensors:
                    raise DuplicateTensorError(f"tensor {name!r} is in both {ckpt.tensors[name].file} and {f}; "
                                               "remove one copy")
                ckpt.tensors[name] = t
            ckpt.shards.append(shard)
    else:
        ckpt = open_checkpoint(root)  # index, missing shards, duplicates, every header
    skipped = [t for sh in ckpt.shards for t in sh.skipped.values()]
    if skipped:  # copying them raw is possible but not written yet: refuse rather than drop them
        t = skipped[0]
        raise UnsupportedCheckpointError(
            f"{t.file}: tensor {t.name!r} at offset {t.offset} has dtype {t.dtype_name} ({t.reason}); "
            f"tiered reshard cannot convert such tensors yet ({len(skipped)} in all): keep the checkpoint as "
            "it is (tiered.load reads it and skips them when the model does not use them)"
        )
    return SafetensorsSource(root, [s.path for s in ckpt.shards], dict(ckpt.tensors),
                             compressed=any(is_coded(s) for s in ckpt.shards))
