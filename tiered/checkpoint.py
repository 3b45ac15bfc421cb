"""A model directory's checkpoint: find its safetensors shards (through the index, if any) and read every header.

:func:`open_checkpoint` validates each shard with :func:`~tiered.format.read_header` and gathers every tensor by
name into a :class:`Checkpoint`; :func:`read_index` and :func:`index_shard_paths` are the one reader of an index's
``weight_map`` and the one path check of its shard names; :func:`check_model_dir` says what a path that is not a
model directory is instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DuplicateTensorError, HeaderError, ShardNotFoundError
from .header import read_header
from .tensor_info import Shard, SkippedTensor, TensorInfo

__all__ = ["Checkpoint", "INDEX_NAME", "read_index", "index_shard_paths", "check_model_dir", "open_checkpoint"]


@dataclass
class Checkpoint:
    """A model directory's safetensors: shards (each parsed once) and every tensor by name.

    ``skipped``: tensors torch cannot hold (see :class:`SkippedTensor`), not in ``tensors``.
    ``index_missing``: names the index's ``weight_map`` lists that no shard holds (sorted).
    """

    root: Path
    shards: list[Shard]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    skipped: dict[str, SkippedTensor] = field(default_factory=dict)
    index_missing: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data in ``tensors`` (headers and skipped tensors excluded)."""
        return sum(t.nbytes for t in self.tensors.values())


INDEX_NAME = "model.safetensors.index.json"


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
    tensor name -> shard file name. The one index reader of tiered (the loader and ``tiered reshard``).

    Raises:
        HeaderError: unreadable, not JSON, no ``weight_map`` object, or one that does not map names to file names.
    """
    try:
        doc = json.loads(index.read_text())
        wm = doc["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeaderError(f"{index}: not a valid index (needs a 'weight_map' object): {e}; regenerate it") from None
    return wm


def _inside(root: Path, name: str, index: Path) -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ShardNotFoundError(f"{index}: shard name {name!r} must be a relative file name inside {root}")
    # Lexical check (no symlink resolution): a Hugging Face cache snapshot holds symlinks into ../../blobs.
    base = Path(os.path.abspath(root))
    p = Path(os.path.normpath(base / name))
    if base not in p.parents:
        raise ShardNotFoundError(f"{index}: shard {name!r} points outside {root}; fix the index's weight_map")
    return p


def index_shard_paths(root: Path, index: Path, names: Iterable[str]) -> list[Path]:
    """The shard files ``names`` of ``index``'s weight_map as paths inside ``root``, in the order given.

    The one path check of index shard names: every name must be relative and stay inside ``root``
    (checked lexically, without resolving symlinks: a Hugging Face cache snapshot's shards are
    symlinks into ``../../blobs``), and every file must exist.

    Raises:
        ShardNotFoundError: a name is absolute, empty or points outside ``root``; or a shard is missing.
    """
    names = list(names)
    paths = [_inside(root, n, index) for n in names]
    for n, p in zip(names, paths, strict=True):
        if not p.is_file():
            raise ShardNotFoundError(f"{index}: shard {n!r} is missing from {root}; re-download it")
    return paths


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir`` as a Path if it is an existing directory; else a :class:`ShardNotFoundError` that says
    what it is instead: missing, a file (a lone ``.safetensors``/``.gguf``/``.bin``), or a Hugging Face Hub id
    (tiered reads local directories only; nothing is downloaded)."""
    root = Path(model_dir)
    if root.is_dir():
        return root
    if root.exists():
        hint = ""
        if root.suffix in (".safetensors", ".bin", ".pt"):
            hint = f" (for a lone weight file, put it in a directory with its config.json: pass {str(root.parent)!r})"
        elif root.suffix == ".gguf":
            hint = (f" (a GGUF file: convert it once into a model directory, then pass that: "
                    f"tiered.reshard({str(root)!r}, {str(root.with_suffix(''))+'-tiered'!r}, dtype='bf16'))")
        raise ShardNotFoundError(f"{root} is a file, not a directory; pass the directory that holds config.json and "
                                 f"the weights{hint}")
    if _HUB_ID.fullmatch(str(model_dir)) and not str(model_dir).startswith((".", "~")):
        raise ShardNotFoundError(
            f"{str(model_dir)!r} is not a local directory; it looks like a Hugging Face Hub id. tiered reads local "
            f"directories and downloads nothing: fetch it first, e.g. huggingface_hub.snapshot_download({str(model_dir)!r}), "
            "and pass the directory it returns"
        )
    raise ShardNotFoundError(f"{root}: no such directory; pass a local Hugging Face model directory")


def open_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Parse every shard header of a Hugging Face model directory (no tensor data is read).

    Looks for ``model.safetensors.index.json`` (sharded), else ``model.safetensors``, else
    any ``*.safetensors`` files.

    With an index, the shards read are the files its ``weight_map`` names, and every tensor of
    those files is taken from where it actually is — as ``transformers`` 5 does, which loads every
    key of every shard the index lists. So a tensor the index puts in shard A but that lies in
    shard B (also listed) is simply found in B, and a tensor of a listed shard that the index
    omits is kept. Names the index lists that no shard holds are not an error here: they are
    recorded, sorted, in :attr:`Checkpoint.index_missing`, for the loader to warn about (unused)
    or refuse (needed). A tensor torch cannot hold is in :attr:`Checkpoint.skipped`, not missing.

    Raises:
        ShardNotFoundError: no safetensors file, or the index names a missing shard or one outside ``model_dir``.
        HeaderError / TruncatedShardError: a shard fails validation (see :func:`read_header`).
        DuplicateTensorError: a tensor name appears in two shards.
    """
    root = check_model_dir(model_dir)
    index = root / INDEX_NAME
    expected: dict[str, str] | None = None
    if index.exists():
        expected = read_index(index)
        paths = index_shard_paths(root, index, sorted(set(expected.values())))
    elif (root / "model.safetensors").is_file():
        paths = [root / "model.safetensors"]
    else:
        paths = sorted(root.glob("*.safetensors"))
        if not paths:
            bins = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
            hint = f" (found {', '.join(bins[:3])}: convert it with `tiered reshard`)" if bins else ""
            raise ShardNotFoundError(f"{root}: no safetensors checkpoint{hint}")

    ckpt = Checkpoint(root=root, shards=[])
    for p in paths:
        shard = read_header(p)
        ckpt.shards.append(shard)
        found: list[TensorInfo | SkippedTensor] = [*shard.tensors.values(), *shard.skipped.values()]
        for t in found:
            prev = ckpt.tensors.get(t.name) or ckpt.skipped.get(t.name)
            if prev is not None:
                raise DuplicateTensorError(
                    f"tensor {t.name!r} is in both {prev.file} (offset {prev.offset}) and {p} (offset {t.offset}); "
                    "remove one copy"
                )
            if isinstance(t, TensorInfo):
                ckpt.tensors[t.name] = t
            else:
                ckpt.skipped[t.name] = t
    if expected is not None:
        ckpt.index_missing = sorted(n for n in expected if n not in ckpt.tensors and n not in ckpt.skipped)
    return ckpt
