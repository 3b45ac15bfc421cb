"""safetensors input: one file, or a directory of shards (with ``model.safetensors.index.json`` or not).

Every header is validated by :func:`tiered.format.read_header` (the index, missing shards and
duplicate names by :func:`tiered.format.open_checkpoint`) before any data is read. Each shard is then
mapped once (:class:`~tiered.reader.ShardMap`); ``TensorInfo.offset`` is the absolute file offset, so
bytes can also move kernel to kernel (:meth:`SafetensorsSource.file_range`, for ``copy_file_range``).
Tensors torch cannot hold (F4, F6_*...) are refused rather than dropped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import DuplicateTensorError
from ...format import Checkpoint, TensorInfo, open_checkpoint, read_header
from ...reader import ShardMap
from ..errors import UnsupportedCheckpointError
from .base import Drop, Source

__all__ = ["SafetensorsSource", "open_safetensors"]


class SafetensorsSource(Source):
    """safetensors shards, each mapped once; bytes are views of the mapping, dropped after each chunk."""

    def __init__(self, root: Path, files: list[Path], infos: dict[str, TensorInfo]) -> None:
        super().__init__(root, "safetensors", files, infos)
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
        return m.span(info.offset, info.nbytes), lambda lo, hi: m.drop(info.offset + lo, hi - lo)

    def file_range(self, name: str) -> tuple[int, int] | None:
        info = self.infos[name]
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
            shard = read_header(f)
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
    return SafetensorsSource(root, [s.path for s in ckpt.shards], dict(ckpt.tensors))
