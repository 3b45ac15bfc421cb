"""The converter: reshard any checkpoint into stream order, with bounded memory, never half-written.

Input: a Hugging Face model directory (or one weight file) with safetensors (one file, or shards
with ``model.safetensors.index.json``) or PyTorch checkpoints (``pytorch_model.bin``, shards with
``pytorch_model.bin.index.json``, ``*.pt``/``*.pth``). PyTorch files are read with
``torch.load(..., mmap=True, weights_only=True)`` only: never unrestricted pickle.

Output (a new directory), as the loader wants it:

* safetensors shards ``model-0000i-of-0000N.safetensors`` whose tensors are written in *execution
  order* — the unit plan of :func:`tiered.plan.build_plan`, the one the loader streams — so every
  unit is one contiguous span inside one shard (without a usable ``config.json``: by the layer index
  in tensor names, and the summary says so). Every shard's data section starts on a 4 KiB boundary.
* ``model.safetensors.index.json`` with ``metadata.total_size`` (bytes of tensor data), and every
  non-weight file and folder (config, generation config, tokenizer files, a sentence-transformers model's
  ``1_Pooling/``; hidden folders apart) copied.
* the checkpoint's own tensor names and bytes: each tensor is bit-equal to the input, or equal to
  ``tensor.to(dtype)`` for floating tensors when ``dtype`` is given. Duplicates of tied weights
  (an ``lm_head.weight`` sharing the embedding's storage in a ``.bin``) are written once.
* with ``compress``: the same shards losslessly compressed (:mod:`tiered.lossless`'s format: tensors of
  64 KiB or more coded in chunks, a CRC-32 each), indexed by ``model.lossless.index.json`` instead (stock
  ``from_pretrained`` finds no weights there and refuses; ``tiered.load`` reads it). A compressed SRC is
  decoded as it is read, so without ``compress`` (``--decompress``) it comes out plain, bit-equal to a
  plain reshard of the original.

Memory: bytes move in chunks of :data:`CHUNK_BYTES` (kernel to kernel with ``copy_file_range`` where
possible); peak RSS growth is about two chunks whatever the checkpoint or shard size.

Safety: everything is written into ``.DST.tiered-tmp-<pid>`` beside ``DST``, fsynced, optionally
re-read and compared by hash, and only then installed as ``DST`` (atomically where the kernel allows,
else through a journal the next run rolls forward or back). A killed run leaves no partial ``DST``;
``SRC`` is only ever opened read-only; an existing ``DST`` is refused unless ``force``; a full disk
raises :class:`DiskFullError` and removes the partial output.

Python: ``tiered.reshard(src, dst, max_shard_size="2GB", dtype="bf16")``.
Command line: ``tiered reshard SRC DST ...`` or ``python tools/reshard.py SRC DST ...``.

Modules: :mod:`.convert` (:func:`reshard`, the one pass), :mod:`.sources` (the inputs, one
:class:`~tiered.reshard.sources.Source` per format, registered by file suffix), :mod:`.layout`
(units, order, shards, headers), :mod:`.writer` (bytes, files, verify, memory bounds),
:mod:`.compress` (compressed shards: coding on a thread pool, the header written last),
:mod:`.install` (temporary directory, atomic install, recovery after a kill), :mod:`.summary`
(:class:`ReshardSummary`), :mod:`.cli` (the command line), :mod:`.errors`, :mod:`.libc`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# torch-free: errors and the summary (so `tiered --help` and usage errors need no torch); the rest is
# imported on first use (PEP 562), from the module that defines it
from .errors import (
    DestinationExistsError,
    DiskFullError,
    ReshardError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    VerifyError,
)
from .summary import ReshardSummary

_LAZY = {
    "reshard": ".convert", "parse_size": ".convert", "add_parser": ".cli", "main": ".cli",
    "CHUNK_BYTES": ".writer", "WRITEBACK_BYTES": ".writer", "DATA_ALIGN": ".layout",
    "BIN_INDEX_NAME": ".sources", "INDEX_NAME": "..format",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "WRITEBACK_BYTES",
    "INDEX_NAME",
    "BIN_INDEX_NAME",
]
