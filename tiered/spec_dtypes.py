"""The safetensors format's dtypes and their bits per element, torch-free: what the header check
(:func:`tiered.header.check_shard`) needs before the command line imports torch."""

from __future__ import annotations

__all__ = ["SPEC_DTYPE_BITS", "SPEC_DTYPE_TORCH_NAMES"]

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

#: The dtypes torch holds unpacked (:data:`tiered.tensor_info.DTYPES`) by torch's own name for them (``str(dtype)``
#: without ``"torch."``), torch-free: ``tiered inspect`` names dtypes so without importing torch. ``F8_E8M0``,
#: ``F8_E4M3FNUZ`` and ``F8_E5M2FNUZ`` need a torch that has them (``float8_e8m0fnu``: torch >= 2.7); ``F4`` and
#: ``F6_*`` (packed below a byte) none.
SPEC_DTYPE_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
