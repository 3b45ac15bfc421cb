"""The safetensors format's dtypes and their bits per element, torch-free: what the header check
(:func:`tiered.header.check_shard`) needs before the command line imports torch."""

from __future__ import annotations

__all__ = ["SPEC_DTYPE_BITS"]

#: Every dtype of the safetensors format (the Rust core's ``Dtype`` in safetensors 0.8) -> bits per element.
SPEC_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
