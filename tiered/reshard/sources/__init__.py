"""The inputs of ``tiered reshard``: one :class:`Source` per checkpoint format, chosen by file suffix.

* :mod:`.base`: the :class:`Source` interface (attributes ``root, kind, files, infos, keep_dtype,
  notes, generated_files``; ``byte_view`` and optional hooks) and the :data:`Opener` signature.
* :mod:`.safetensors`: one file or a sharded directory, mapped; bytes can move kernel to kernel.
* :mod:`.pytorch`: ``.bin``/``.pt``/``.pth``, read with ``torch.load(mmap=True, weights_only=True)`` only.
* :mod:`.gguf`: one llama.cpp GGUF file, dequantized tensor by tensor (needs the ``gguf`` package).

:func:`_open_source` validates the whole input before any tensor data is read. A single weight file
goes to the opener of its suffix in :data:`OPENERS` (any other suffix to ``torch.load``, which says
whether it is a checkpoint); a directory to the first format :func:`_weight_files` finds in it.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ShardNotFoundError
from ...format import INDEX_NAME, index_shard_paths, read_index
from .base import Drop, Opener, Source
from .gguf import GGUFSource, open_gguf_files
from .pytorch import BIN_INDEX_NAME, TorchSource, open_torch
from .safetensors import SafetensorsSource, open_safetensors

__all__ = ["Source", "Opener", "Drop", "SafetensorsSource", "TorchSource", "GGUFSource", "OPENERS", "BIN_INDEX_NAME"]

#: Weight-file suffix -> opener: THE place a new format is registered. A single SRC file goes to the
#: opener of its suffix; a directory holding no safetensors or PyTorch weights, to the opener of the first
#: suffix below (beyond those two) that some of its files have, with all those files, sorted.
OPENERS: dict[str, Opener] = {
    ".safetensors": open_safetensors,
    ".bin": open_torch,
    ".pt": open_torch,
    ".pth": open_torch,
    ".gguf": open_gguf_files,
}
_BUILTIN = (open_safetensors, open_torch)  # found by _weight_files' own rules (index files, precedence)


def _weight_files(root: Path) -> tuple[Opener, list[Path], Path | None]:
    """(opener, weight files in order, index file or None) of a model directory; raises if it has none.

    safetensors first (its files are then found by :func:`~tiered.format.open_checkpoint`), then
    ``pytorch_model.bin.index.json``, ``pytorch_model.bin``, ``*.bin``, ``*.pt``/``*.pth``, then any other
    format registered in :data:`OPENERS`.
    """
    if (root / INDEX_NAME).is_file() or list(root.glob("*.safetensors")):
        return open_safetensors, [], root / INDEX_NAME if (root / INDEX_NAME).is_file() else None
    index = root / BIN_INDEX_NAME
    if index.is_file():
        # the names stay inside root (lexically: a Hugging Face cache snapshot's files link into ../../blobs)
        return open_torch, index_shard_paths(root, index, dict.fromkeys(read_index(index).values())), index
    if (root / "pytorch_model.bin").is_file():
        return open_torch, [root / "pytorch_model.bin"], None
    bins = sorted(p for p in root.glob("*.bin") if p.name != "training_args.bin")
    pts = sorted(list(root.glob("*.pt")) + list(root.glob("*.pth")))
    if bins or pts:
        return open_torch, bins or pts, None
    others = [(suffix, opener) for suffix, opener in OPENERS.items() if opener not in _BUILTIN]
    for suffix, opener in others:
        found = sorted(root.glob(f"*{suffix}"))
        if found:
            return opener, found, None
    also = "".join(f", *{suffix}" for suffix, _ in others)
    raise ShardNotFoundError(f"{root}: no weights found (model.safetensors, *.safetensors with "
                             f"{INDEX_NAME}, pytorch_model.bin, {BIN_INDEX_NAME}, *.pt{also}); pass a model directory")


def _open_source(src: Path) -> Source:
    """The source of ``src`` (a weight file or a model directory), with every header, index and pickle
    validated before any tensor data is read."""
    if src.is_file():
        return OPENERS.get(src.suffix, open_torch)(src.parent, [src], None)
    if src.is_dir():
        opener, files, index = _weight_files(src)
        return opener(src, files, index)
    raise ShardNotFoundError(f"{src}: no such file or directory; pass a model directory or a weight file")
