"""What a validated safetensors file is: the dtype tables and the records of its tensors.

:data:`SPEC_DTYPE_BITS` (every dtype of the format, with its bits per element) and :data:`DTYPES`
(those torch computes with, as torch dtypes); :class:`TensorInfo` (where one tensor's bytes lie),
:class:`SkippedTensor` (a valid tensor torch cannot hold) and :class:`Shard` (one validated file),
as :func:`tiered.format.read_header` returns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import HeaderError

__all__ = ["DTYPES", "SPEC_DTYPE_BITS", "TensorInfo", "SkippedTensor", "Shard", "dtype_name"]

from .spec_dtypes import SPEC_DTYPE_BITS  # noqa: E402 - torch-free (tiered/spec_dtypes.py)


def _torch_dtypes() -> dict[str, torch.dtype]:
    dtypes = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "U16": torch.uint16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
    # Newer or rarer dtypes, where this torch has them (float8_e8m0fnu: torch >= 2.7). F4 is left out:
    # torch.float4_e2m1fn_x2 packs two elements per byte, so its shape is not the header's.
    for name, attr in (
        ("F8_E8M0", "float8_e8m0fnu"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("C64", "complex64"),
    ):
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            dtypes[name] = dt
    return dtypes


#: safetensors dtype string -> torch dtype, for the dtypes torch computes with (a subset of :data:`SPEC_DTYPE_BITS`).
DTYPES: dict[str, torch.dtype] = _torch_dtypes()
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise HeaderError(f"dtype {dtype} has no safetensors name") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie on disk.

    ``offset`` is absolute in ``file`` (bytes, header included); ``nbytes = numel * itemsize``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SkippedTensor:
    """A valid tensor that torch cannot hold, so it is not in ``Shard.tensors`` (see :attr:`reason`).

    Its dtype has no torch dtype in this torch version (``F6_E2M3``; ``F8_E8M0`` before torch 2.7),
    is packed below a byte per element (``F4``, ``F6_*``), or a dimension exceeds ``2**63 - 1`` (an
    empty tensor only). ``dtype_name`` is the header's dtype string; ``offset`` is absolute in
    ``file``, as in :class:`TensorInfo`; ``nbytes = numel * bits / 8``.
    """

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def reason(self) -> str:
        """Why torch cannot hold it, for messages."""
        if self.dtype_name in DTYPES:
            return f"shape {list(self.shape)} has a dimension above torch's limit of 2**63 - 1"
        bits = SPEC_DTYPE_BITS.get(self.dtype_name, 0)
        if bits < 8:
            return f"dtype {self.dtype_name} packs {bits}-bit elements, which torch has no unpacked dtype for"
        return f"torch {torch.__version__} has no dtype for {self.dtype_name}"


@dataclass(frozen=True)
class Shard:
    """One validated safetensors file: its header and where its data section starts (bytes)."""

    path: Path
    file_size: int
    data_start: int  # 8 + N
    tensors: dict[str, TensorInfo]  # in data-offset order
    metadata: dict[str, str] | None = None
    skipped: dict[str, SkippedTensor] = field(default_factory=dict)  # in data-offset order
