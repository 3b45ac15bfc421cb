"""A model directory's checkpoint: find its safetensors files as transformers does, and read every header.

:func:`weight_files` chooses the files (transformers 5.17's order: ``config.json``'s ``transformers_weights``,
``model.safetensors``, ``model.safetensors.index.json``); :func:`open_checkpoint` validates each shard with
:func:`~tiered.format.read_header` and gathers every tensor by name into a :class:`Checkpoint`;
:func:`checkpoint_dtype` is the dtype ``from_pretrained``'s default (``dtype="auto"``) takes from the weights;
:func:`read_index` and :func:`index_shard_paths` are the one reader of an index's ``weight_map`` and the one path
check of its shard names; :func:`check_model_dir` says what a path that is not a model directory is instead.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, DuplicateTensorError, HeaderError, ShardNotFoundError
from .header import read_header

if TYPE_CHECKING:  # torch-free at import: the command line finds weight files before torch loads (tiered/cli_checks.py)
    import torch

    from .tensor_info import Shard, SkippedTensor, TensorInfo

__all__ = ["Checkpoint", "WeightFiles", "INDEX_NAME", "SINGLE_NAME", "LOSSLESS_INDEX_NAME", "read_index", "index_shard_paths",
           "check_model_dir", "weight_files", "open_checkpoint", "checkpoint_dtype"]


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
SINGLE_NAME = "model.safetensors"
#: the index of a losslessly compressed checkpoint (``tiered reshard --compress``, :mod:`tiered.lossless`): another
#: name than :data:`INDEX_NAME`, so that ``from_pretrained`` finds no weights there and refuses the directory
LOSSLESS_INDEX_NAME = "model.lossless.index.json"


def _read_index_doc(index: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """(``weight_map``, ``metadata`` or ``{}``) of an index file; see :func:`read_index`."""
    try:
        doc = json.loads(index.read_text())
        wm = doc["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeaderError(f"{index}: not a valid index (needs a 'weight_map' object): {e}; regenerate it") from None
    meta = doc.get("metadata")
    return wm, meta if isinstance(meta, dict) else {}


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
    tensor name -> shard file name. The one index reader of tiered (the loader and ``tiered reshard``).

    Raises:
        HeaderError: unreadable, not JSON, no ``weight_map`` object, or one that does not map names to file names.
    """
    return _read_index_doc(index)[0]


def _inside(root: Path, name: str, index: Path, fix: str = "the index's weight_map") -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ShardNotFoundError(f"{index}: shard name {name!r} must be a relative file name inside {root}; fix {fix}")
    # Lexical check (no symlink resolution): a Hugging Face cache snapshot holds symlinks into ../../blobs.
    base = Path(os.path.abspath(root))
    p = Path(os.path.normpath(base / name))
    if base not in p.parents:
        raise ShardNotFoundError(f"{index}: shard {name!r} points outside {root}; fix {fix}")
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


@dataclass
class WeightFiles:
    """The weight files :func:`weight_files` chose: ``paths`` (in the order ``from_pretrained`` reads them), and for
    a sharded checkpoint its ``index`` file, ``weight_map`` and ``metadata`` (the index's ``"metadata"``, or ``{}``)."""

    paths: list[Path]
    index: Path | None = None
    weight_map: dict[str, str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _explicit_name(root: Path) -> str | None:
    """``config.json``'s ``transformers_weights`` (None: no such key, or no readable config.json, which the
    loader reports itself; ``tiered inspect``/``reshard`` read weights without one)."""
    try:
        doc = json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    name = doc.get("transformers_weights") if isinstance(doc, dict) else None
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"{root / 'config.json'}: transformers_weights must be a file name, not {name!r}; fix it")
    return name


def _explicit_files(root: Path, name: str) -> WeightFiles:
    """The files ``config.json``'s ``transformers_weights`` names (checked as transformers 5.17 checks it)."""
    cfg = root / "config.json"
    if name == "adapter_model.bin":  # the one non-safetensors name transformers accepts here
        raise ShardNotFoundError(f"{cfg}: transformers_weights names {name!r}, a PyTorch file tiered does not "
                                 f"read; convert the directory with `tiered reshard {root} DST`")
    if not name.endswith((".safetensors", ".safetensors.index.json")):
        raise ConfigError(f"{cfg}: transformers_weights {name!r} is neither a *.safetensors file nor a "
                          "*.safetensors.index.json (transformers refuses it too); fix or remove the key")
    path = _inside(root, name, cfg, "its transformers_weights")
    if not path.is_file():
        raise ShardNotFoundError(f"{cfg}: transformers_weights names {name!r}, which is missing from {root}; "
                                 "re-download it, or fix or remove the key")
    if name.endswith(".safetensors.index.json"):
        return _indexed(root, path)
    return WeightFiles([path])


def _indexed(root: Path, index: Path) -> WeightFiles:
    """An index's shards (sorted by name, as ``transformers.utils.hub.get_checkpoint_shard_files`` lists them)."""
    wm, meta = _read_index_doc(index)
    return WeightFiles(index_shard_paths(root, index, sorted(set(wm.values()))), index, wm, meta)


def _warn_index_ignored(root: Path) -> None:
    """``model.safetensors`` is loaded; say so when an index whose shards are also there is ignored."""
    try:
        names = set(read_index(root / INDEX_NAME).values())
    except HeaderError:
        names = set()
    there = sorted(n for n in names if (root / n).is_file() and n != SINGLE_NAME)
    if there:
        warnings.warn(f"{root} holds two checkpoints: {SINGLE_NAME} and {INDEX_NAME} with its shards (e.g. "
                      f"{there[0]}); {SINGLE_NAME} is loaded, as transformers loads it. Delete the files of the "
                      "one you do not want", UserWarning, stacklevel=3)


def weight_files(model_dir: str | os.PathLike[str]) -> WeightFiles:
    """The weight files of a model directory, chosen as ``from_pretrained(model_dir)`` chooses them
    (transformers 5.17 ``modeling_utils._get_resolved_checkpoint_files``, a local directory, no ``variant``):

    1. ``config.json``'s ``transformers_weights``: that ``*.safetensors`` file, or that ``*.safetensors.index.json``
       and its shards (it must be inside the directory);
    2. ``model.safetensors`` (even when ``model.safetensors.index.json`` is there too: a warning then says so if
       the index's shards are present);
    3. ``model.safetensors.index.json`` and the shards its ``weight_map`` names, sorted by name;
    3b. (tiered only) :data:`LOSSLESS_INDEX_NAME` and its shards: a losslessly compressed checkpoint;
    4. ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``: transformers loads those; tiered refuses them
       (convert once with ``tiered reshard``).

    Beyond transformers (which refuses such a directory): every ``*.safetensors`` file, sorted by name.

    Raises:
        ShardNotFoundError: no weights, PyTorch weights, a missing or escaping file or shard.
        ConfigError: ``transformers_weights`` names neither a safetensors file nor a safetensors index.
        HeaderError: an unreadable index.
    """
    root = check_model_dir(model_dir)
    explicit = _explicit_name(root)
    if explicit is not None:
        return _explicit_files(root, explicit)
    if (root / SINGLE_NAME).is_file():
        if (root / INDEX_NAME).is_file():
            _warn_index_ignored(root)
        return WeightFiles([root / SINGLE_NAME])
    if (root / INDEX_NAME).is_file():
        return _indexed(root, root / INDEX_NAME)
    if (root / LOSSLESS_INDEX_NAME).is_file():
        return _indexed(root, root / LOSSLESS_INDEX_NAME)
    torch_files = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (root / n).is_file()]
    paths = [] if torch_files else sorted(root.glob("*.safetensors"))
    if not paths:
        found = torch_files or sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {', '.join(found[:3])}: convert it with `tiered reshard`)" if found else ""
        raise ShardNotFoundError(f"{root}: no safetensors checkpoint{hint}")
    return WeightFiles(paths)


def _read_shard(path: Path) -> Shard:
    """:func:`read_header`, with a losslessly compressed shard's coded entries seen as the tensors they decode to
    (:func:`tiered.lossless.logical_shard`)."""
    shard = read_header(path)
    if shard.metadata and any(k.startswith("tiered_lossless") for k in shard.metadata):
        from .lossless import logical_shard

        shard = logical_shard(shard)
    return shard


def open_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Parse every shard header of a Hugging Face model directory (no tensor data is read).

    The files are those ``from_pretrained`` loads (:func:`weight_files`: ``config.json``'s
    ``transformers_weights``, else ``model.safetensors``, else ``model.safetensors.index.json``'s shards), or,
    where transformers finds none, every ``*.safetensors`` file.

    With an index, the shards read are the files its ``weight_map`` names, and every tensor of
    those files is taken from where it actually is — as ``transformers`` 5 does, which loads every
    key of every shard the index lists. So a tensor the index puts in shard A but that lies in
    shard B (also listed) is simply found in B, and a tensor of a listed shard that the index
    omits is kept. Names the index lists that no shard holds are not an error here: they are
    recorded, sorted, in :attr:`Checkpoint.index_missing`, for the loader to warn about (unused)
    or refuse (needed). A tensor torch cannot hold is in :attr:`Checkpoint.skipped`, not missing.

    Raises:
        ShardNotFoundError: no safetensors file, or the index names a missing shard or one outside ``model_dir``.
        ConfigError: a ``transformers_weights`` key that names no safetensors file (see :func:`weight_files`).
        HeaderError / TruncatedShardError: a shard fails validation (see :func:`read_header`).
        DuplicateTensorError: a tensor name appears in two shards.
    """
    from .tensor_info import TensorInfo

    files = weight_files(model_dir)
    ckpt = Checkpoint(root=Path(model_dir), shards=[])
    for p in files.paths:
        shard = _read_shard(p)
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
    if files.weight_map is not None:
        wm = files.weight_map
        ckpt.index_missing = sorted(n for n in wm if n not in ckpt.tensors and n not in ckpt.skipped)
    return ckpt


def checkpoint_dtype(model_dir: str | os.PathLike[str]) -> torch.dtype:
    """The dtype ``from_pretrained(model_dir)`` takes from the weights when ``config.json`` names none: its
    default ``dtype="auto"`` (transformers 5.17 ``modeling_utils._get_dtype``, ``get_state_dict_dtype``):

    the index's ``metadata["dtype"]`` (a sharded checkpoint), else, in the first weight file ``from_pretrained``
    reads (:func:`weight_files`), the dtype of the first floating-point tensor by name (float8 and float4 ones
    passed over), else of its first tensor; float32 for a file without tensors.

    Raises:
        ConfigError: that dtype is not a floating-point dtype (transformers cannot build the model at it either).
        and what :func:`weight_files` and :func:`read_header` raise.
    """
    import torch

    files = weight_files(model_dir)
    if files.index is not None and "dtype" in files.metadata:
        name = files.metadata["dtype"]
        dt = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ConfigError(f"{files.index}: metadata dtype {name!r} is not a floating-point torch dtype; fix it, "
                              "or pass dtype=")
        return dt
    shard = _read_shard(files.paths[0])
    first = {**shard.tensors, **shard.skipped}
    names = sorted(first)
    floats = [n for n in names if n in shard.tensors and shard.tensors[n].dtype.is_floating_point
              and not str(shard.tensors[n].dtype).startswith(("torch.float8_", "torch.float4_"))]
    if floats:
        return shard.tensors[floats[0]].dtype
    if not names:
        return torch.float32
    raise ConfigError(f"{files.paths[0]}: no floating-point tensor to take the model's dtype from, and config.json "
                      f"names none (first tensor: {names[0]!r}); pass dtype= (e.g. dtype='bf16')")
