"""safetensors: the one import point of tiered's safetensors support, and the header writer.

What it re-exports, by module (each name stays importable from here):

* :mod:`tiered.tensor_info` — the dtype tables (:data:`SPEC_DTYPE_BITS`, :data:`DTYPES`, :func:`dtype_name`) and
  the records :class:`TensorInfo`, :class:`SkippedTensor`, :class:`Shard`;
* :mod:`tiered.header` — :func:`read_header`: a header parsed and validated completely before any data is read,
  accepting exactly the files ``safetensors.safe_open`` accepts (its module docstring gives the format's rules);
* :mod:`tiered.serde_json` — the header's JSON decoded as safetensors' ``serde_json`` decodes it (re-exported
  here as ``_decode``, ``_FAST``, ``_EXACT``: :func:`read_header` calls ``tiered.format._decode``, so a test may
  swap it for ``_EXACT.decode`` here);
* :mod:`tiered.checkpoint` — :func:`open_checkpoint` (a model directory's shards and every tensor by name),
  :func:`weight_files` (which files ``from_pretrained`` loads), :func:`checkpoint_dtype` (the dtype its default
  takes from them), :func:`read_index`, :func:`index_shard_paths`, :func:`check_model_dir`.

Defined here: :func:`encode_header` (the header of a file tiered writes) and :func:`parse_size`.
"""

from __future__ import annotations

import json
import struct

import torch

from .checkpoint import (
    INDEX_NAME,
    Checkpoint,
    WeightFiles,
    check_model_dir,
    checkpoint_dtype,
    index_shard_paths,
    open_checkpoint,
    read_index,
    weight_files,
)
from .header import MAX_HEADER_SIZE, read_header
from .serde_json import _EXACT as _EXACT
from .serde_json import _FAST as _FAST
from .serde_json import _decode as _decode
from .tensor_info import DTYPES, SPEC_DTYPE_BITS, Shard, SkippedTensor, TensorInfo, dtype_name

__all__ = [
    "DTYPES",
    "SPEC_DTYPE_BITS",
    "MAX_HEADER_SIZE",
    "TensorInfo",
    "SkippedTensor",
    "Shard",
    "Checkpoint",
    "read_header",
    "open_checkpoint",
    "weight_files",
    "WeightFiles",
    "checkpoint_dtype",
    "dtype_name",
    "parse_size",
    "encode_header",
    "check_model_dir",
    "read_index",
    "index_shard_paths",
    "INDEX_NAME",
]


from .sizes import parse_size  # noqa: E402,F401  (torch-free: the command line checks sizes before torch)


def encode_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...] | list[int], int]],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
) -> bytes:
    """8-byte length + JSON header for ``(name, dtype, shape, nbytes)`` laid out contiguously in this order.

    The JSON is padded with spaces (the spec allows it) so the data section starts at a multiple of
    ``align`` bytes: 8 is what ``safetensors.torch.save_file`` writes (byte-identical for the same
    tensor order); 4096 page-aligns the data for streaming and O_DIRECT.
    """
    doc: dict[str, object] = {}
    if metadata is not None:
        doc["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        doc[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text

