#!/usr/bin/env python
"""Generate Hugging Face model directories at real model shapes with random weights, offline.

The output looks like what ``model.save_pretrained(out_dir)`` writes for the real model:

* ``config.json`` built from the transformers config class (real hyperparameters, no hub
  access), with ``architectures`` and ``dtype`` (plus the legacy ``torch_dtype`` key) set;
* ``generation_config.json`` from ``GenerationConfig.from_model_config`` so ``.generate()`` works;
* ``model.safetensors`` (one shard), or ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` (several shards);
* ``tiered_checkpoint.json``, a marker recording the generation parameters (used as a cache key).

No tokenizer files are written.

The tensor names and shapes are exactly those of ``model.state_dict()`` of the model built by
transformers on the meta device, minus tied duplicates. Each shard is byte-identical to what
``safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})`` writes for the same
tensors, but it is streamed tensor by tensor, so peak memory stays at a few MiB whatever the size
of the checkpoint.

Values are random but cheap: one seeded random block per kind of tensor (matrices: normal with
std 0.02; 1-D norm weights: 1 + 0.02 * normal; biases: 0.01 * normal) is generated once, and each
tensor is that block tiled from a per-tensor offset (a hash of the seed and the tensor name), so
tensors differ from each other, nothing is all zero, and generation runs at disk speed.
Everything is deterministic for a given seed.

Command line: ``python benchmarks/make_checkpoint.py --help``.
Python: ``make_checkpoint(out_dir, "gptj-6b", dtype="fp16")``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
from tiered.format import encode_header, parse_size  # noqa: E402  (the project's one header writer)

__all__ = [
    "ARCHS",
    "ArchSpec",
    "TensorSpec",
    "build_config",
    "generate_state_dict",
    "make_checkpoint",
    "parse_size",
    "weight_specs",
]

MARKER_NAME = "tiered_checkpoint.json"
MARKER_FORMAT = 1
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Elements per random block. Deliberately not a power of two, so that a block tiled over a matrix
# whose row length is a power of two lands shifted on each repetition (rows do not repeat).
_BLOCK_ELEMS = {"matrix": (1 << 22) - 3, "norm": (1 << 18) - 5, "bias": (1 << 18) - 5,
                "codes": (1 << 22) - 3, "scale": (1 << 18) - 5, "e2m1": (1 << 22) - 3, "e8m0": (1 << 18) - 5}
# (mean, std) of each kind of tensor. ``codes``: float8 e4m3 codes (a weight / its block's scale, so they spread over
# the e4m3 range); ``scale``: its float32 ``weight_scale_inv`` (0.02 / 100: codes x scale has the matrices' spread).
_KIND_STATS = {"matrix": (0.0, 0.02), "norm": (1.0, 0.02), "bias": (0.0, 0.01), "codes": (0.0, 100.0),
               "scale": (2e-4, 2e-5), "e2m1": (0.0, 1.0), "e8m0": (120.0, 1.0)}
# ``e2m1``: gpt-oss's MXFP4 blocks (uint8, two e2m1 codes per byte: every byte is valid, uniform over 0..255);
# ``e8m0``: their scales (uint8 exponents 117..123, 2**-10..2**-4: decoded weights of about the matrices' spread)
#: ``quant="fp8"``: the block of DeepSeek-V3 / Qwen3-FP8 checkpoints (``weight_block_size``), and the tensors quantized
FP8_BLOCK = 128
_FP8_NAMES = re.compile(r"(proj|\.w[123]|fc_in|fc_out|out_proj)\.weight$")

_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_DTYPE_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

# safetensors dtype names, and their order in the Rust ``Dtype`` enum (safetensors 0.8): inside a
# file, tensors are sorted by this rank descending (larger alignment first), then by name.
_ST_DTYPE_NAME = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
}
_ST_DTYPE_RANK = {
    name: i
    for i, name in enumerate(
        [
            "BOOL",
            "F4",
            "F6_E2M3",
            "F6_E3M2",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "F8_E8M0",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "C64",
            "F64",
            "I64",
            "U64",
        ]
    )
}


# --------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: the transformers config class and the real hyperparameters.

    ``family`` is ``"gptj"`` or ``"llama"`` and decides how ``--scale`` is applied.
    """

    description: str
    family: str
    config_class: str
    architecture: str
    kwargs: dict[str, Any] = field(default_factory=dict)


ARCHS: dict[str, ArchSpec] = {
    "gptj-6b": ArchSpec(
        description="EleutherAI/gpt-j-6B: 28 layers, hidden 4096, 16 heads, vocab 50400, "
        "untied lm_head with bias (~6.05 B params, 12.1 GB in fp16)",
        family="gptj",
        config_class="GPTJConfig",
        architecture="GPTJForCausalLM",
        kwargs={
            "vocab_size": 50400,
            "n_positions": 2048,
            "n_embd": 4096,
            "n_layer": 28,
            "n_head": 16,
            "rotary_dim": 64,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "initializer_range": 0.02,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "tie_word_embeddings": False,
        },
    ),
    "llama3-8b": ArchSpec(
        description="Meta-Llama-3-8B: 32 layers, hidden 4096, intermediate 14336, 32 heads, "
        "8 kv heads, vocab 128256, rope_theta 5e5, untied (~8.03 B params, 16.1 GB in bf16)",
        family="llama",
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        kwargs={
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "tie_word_embeddings": False,
        },
    ),
    "llama2-13b": ArchSpec(
        description="Llama-2-13b: 40 layers, hidden 5120, intermediate 13824, 40 heads, "
        "40 kv heads, vocab 32000, untied (~13.0 B params, 26.0 GB in bf16)",
        family="llama",
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        kwargs={
            "vocab_size": 32000,
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 40,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    ),
    "llama3-70b": ArchSpec(
        description="Meta-Llama-3-70B: 80 layers, hidden 8192, intermediate 28672, 64 heads, 8 kv heads, "
        "vocab 128256, rope_theta 5e5, untied (~70.6 B params, 141 GB in bf16; 1.71 GB per layer, "
        "2.10 GB embedding and head)",
        family="llama",
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        kwargs={
            "vocab_size": 128256,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "tie_word_embeddings": False,
        },
    ),
    "tinyllama-1.1b": ArchSpec(
        description="TinyLlama-1.1B: 22 layers, hidden 2048, intermediate 5632, 32 heads, "
        "4 kv heads, vocab 32000, untied (~1.10 B params, 2.2 GB in bf16)",
        family="llama",
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        kwargs={
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    ),
    "mixtral-8x7b": ArchSpec(
        description="Mixtral-8x7B: 32 layers, hidden 4096, 8 experts of intermediate 14336, top-2, 32 heads, "
        "8 kv heads, vocab 32000, untied (~46.7 B params, 93.4 GB in bf16; ~2.9 GB per layer)",
        family="llama",
        config_class="MixtralConfig",
        architecture="MixtralForCausalLM",
        kwargs={
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-30b-a3b": ArchSpec(
        description="Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of intermediate 768, top-8, 32 heads, "
        "4 kv heads, vocab 151936, untied (~30.5 B params, 61 GB in bf16; ~1.25 GB per layer)",
        family="llama",
        config_class="Qwen3MoeConfig",
        architecture="Qwen3MoeForCausalLM",
        kwargs={
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "tie_word_embeddings": False,
        },
    ),
    "gpt-oss-120b": ArchSpec(
        description="openai/gpt-oss-120b: 36 layers, hidden 2880, 128 experts of intermediate 2880, top-4, 64 heads "
        "of 64, 8 kv heads, vocab 201088, untied (~117 B params, 234 GB in bf16; ~6.4 GB per layer; the hub ships its "
        "experts in MXFP4: --quant mxfp4)",
        family="llama",
        config_class="GptOssConfig",
        architecture="GptOssForCausalLM",
        kwargs={
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    "llama-tall": ArchSpec(
        description="synthetic Llama for memory tests: 24 layers, hidden 1024, intermediate "
        "4096, 16 heads, 16 kv heads, vocab 8192, untied (~420 M params, 0.84 GB in bf16)",
        family="llama",
        config_class="LlamaConfig",
        architecture="LlamaForCausalLM",
        kwargs={
            "vocab_size": 8192,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    ),
}


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPE_SHORT:
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of fp16, bf16, fp32")


def _round64(x: float) -> int:
    return max(64, round(x / 64.0) * 64)


def _scaled_heads(heads: int, kv_heads: int, scale: float) -> tuple[int, int]:
    """Scale the head counts; the kv head count is the largest divisor of the new head count
    that does not exceed the scaled kv head count."""
    new_heads = max(1, round(heads * scale))
    kv_target = max(1, min(new_heads, round(kv_heads * scale)))
    new_kv = max(d for d in range(1, kv_target + 1) if new_heads % d == 0)
    return new_heads, new_kv


def build_config(
    arch: str,
    *,
    dtype: str | torch.dtype,
    layers: int | None = None,
    scale: float = 1.0,
    tie: bool | None = None,
):
    """Build the ``transformers.PretrainedConfig`` of ``arch``, offline.

    Args:
        arch: a key of ``ARCHS``.
        dtype: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (or the torch dtype); written as ``dtype``.
        layers: number of decoder layers (default: the real model's).
        scale: factor in (0, 1] applied to the hidden and intermediate sizes. The head dimension
            is kept: the number of attention heads is scaled instead (at least 1), the number of
            kv heads becomes the largest divisor of it not above the scaled kv head count, and
            hidden size = heads * head_dim (a multiple of 64). Llama's intermediate size is
            scaled and rounded to a multiple of 64 (at least 64); GPT-J's stays 4 * hidden.
            Vocabulary and head dimension are not scaled.
        tie: tie the lm_head to the input embedding (default: the real model's, untied for all).

    Returns:
        a ``GPTJConfig`` or ``LlamaConfig`` with ``architectures`` set.

    Raises:
        ValueError: unknown ``arch`` or ``dtype``, ``layers`` < 1, ``scale`` outside (0, 1].
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    spec = ARCHS[arch]
    tdtype = _torch_dtype(dtype)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    scale = float(scale)
    if not (0.0 < scale <= 1.0) or math.isnan(scale):
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")

    kw = dict(spec.kwargs)
    if spec.family == "gptj":
        head_dim = kw["n_embd"] // kw["n_head"]
        heads, _ = _scaled_heads(kw["n_head"], kw["n_head"], scale)
        kw["n_head"] = heads
        kw["n_embd"] = heads * head_dim
        kw["rotary_dim"] = min(kw["rotary_dim"], head_dim)
        if layers is not None:
            kw["n_layer"] = layers
    elif spec.family == "llama":
        head_dim = kw["head_dim"]
        real_heads = kw["num_attention_heads"]
        heads, kv = _scaled_heads(real_heads, kw["num_key_value_heads"], scale)
        kw["num_attention_heads"] = heads
        kw["num_key_value_heads"] = kv
        if scale != 1.0:
            # hidden = heads x head_dim where the real model has it so; else (Qwen3-MoE: 2048 against 32 x 128)
            # the real hidden size scaled, as the help says
            if kw["hidden_size"] == real_heads * head_dim:
                kw["hidden_size"] = heads * head_dim
            else:
                kw["hidden_size"] = _round64(kw["hidden_size"] * scale)
            kw["intermediate_size"] = _round64(kw["intermediate_size"] * scale)
            if "moe_intermediate_size" in kw:  # the experts' size (Qwen3-MoE)
                kw["moe_intermediate_size"] = _round64(kw["moe_intermediate_size"] * scale)
        if layers is not None:
            kw["num_hidden_layers"] = layers
    else:  # pragma: no cover - ARCHS is static
        raise ValueError(f"unknown family {spec.family!r}")
    if tie is not None:
        kw["tie_word_embeddings"] = bool(tie)
    config_cls = getattr(transformers, spec.config_class)
    return config_cls(architectures=[spec.architecture], dtype=tdtype, **kw)


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: state-dict name, shape, kind (``matrix``/``norm``/``bias``), dtype."""

    name: str
    shape: tuple[int, ...]
    kind: str
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _kind(name: str, ndim: int) -> str:
    if ndim >= 2:
        return "matrix"
    if name.endswith("bias"):
        return "bias"
    return "norm"


def fp8_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` as a block-FP8 checkpoint stores them: each 2-D linear weight (``*proj.weight``, ``w1/w2/w3``,
    GPT-J's ``fc_in/fc_out``) whose sides are multiples of :data:`FP8_BLOCK` becomes e4m3 codes of the same shape plus
    its float32 ``<name>_scale_inv`` grid; everything else (embeddings, norms, the head) keeps its dtype, as the hub's
    FP8 checkpoints ship it."""
    out: list[TensorSpec] = []
    for s in specs:
        if (s.kind == "matrix" and len(s.shape) == 2 and _FP8_NAMES.search(s.name)
                and s.shape[0] % FP8_BLOCK == 0 and s.shape[1] % FP8_BLOCK == 0):
            out.append(TensorSpec(s.name, s.shape, "codes", torch.float8_e4m3fn))
            out.append(TensorSpec(s.name + "_scale_inv", (s.shape[0] // FP8_BLOCK, s.shape[1] // FP8_BLOCK), "scale",
                                  torch.float32))
        else:
            out.append(s)
    return out


#: ``experts="per-expert"``: a stacked experts parameter -> the per-expert tensors its hub checkpoint stores, as
#: (stacked suffix, [(per-expert name, row range as fractions of the stacked rows)]) — Qwen3-MoE's ``gate_up_proj``
#: ``(E, 2I, D)`` is ``gate_proj`` (rows ``[0, I)``) then ``up_proj`` (``[I, 2I)``), transformers' concatenation order
_PER_EXPERT = {".mlp.experts.gate_up_proj": [("gate_proj.weight", 0, 2), ("up_proj.weight", 1, 2)],
               ".mlp.experts.down_proj": [("down_proj.weight", 0, 1)]}


def mxfp4_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` as gpt-oss's checkpoints store them: each stacked experts matrix ``mlp.experts.gate_up_proj``
    ``(E, H, 2I)`` / ``mlp.experts.down_proj`` ``(E, I, H)`` becomes ``<name>_blocks`` ``(E, R, G, 16)`` uint8 (two
    e2m1 codes per byte) and ``<name>_scales`` ``(E, R, G)`` uint8 (E8M0 exponents), ``R`` the output features (the
    last dim) and ``G * 32`` the input features; everything else (attention, router, biases, embeddings) keeps its
    dtype, as gpt-oss ships it. Random codes (every byte valid), not a quantization."""
    out: list[TensorSpec] = []
    for s in specs:
        if s.name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and len(s.shape) == 3 \
                and s.shape[1] % 32 == 0:
            E, cin, rows = s.shape
            out.append(TensorSpec(s.name + "_blocks", (E, rows, cin // 32, 16), "e2m1", torch.uint8))
            out.append(TensorSpec(s.name + "_scales", (E, rows, cin // 32), "e8m0", torch.uint8))
        else:
            out.append(s)
    return out


def per_expert_specs(specs: list[TensorSpec], arch: str) -> list[TensorSpec]:
    """``specs`` with each stacked experts parameter split into the per-expert tensors the hub's Qwen3-MoE checkpoints
    store (``mlp.experts.<j>.gate_proj.weight`` ``(I, D)``, ``up_proj``, ``down_proj`` ``(D, I)``), which
    ``from_pretrained`` stacks back (its conversion mapping) and which FP8 checkpoints quantize one by one.

    Raises:
        ValueError: ``arch`` stores no stacked experts of that layout.
    """
    out: list[TensorSpec] = []
    hit = False
    for s in specs:
        rule = next(((k, v) for k, v in _PER_EXPERT.items() if s.name.endswith(k)), None)
        if rule is None or len(s.shape) != 3:
            out.append(s)
            continue
        hit = True
        prefix = s.name[: -len(rule[0])] + ".mlp.experts"
        E, R, C = s.shape
        for j in range(E):
            for name, _, parts in rule[1]:
                out.append(TensorSpec(f"{prefix}.{j}.{name}", (R // parts, C), "matrix", s.dtype))
    if not hit:
        raise ValueError(f"experts='per-expert' for {arch}: it has no stacked experts of Qwen3-MoE's layout "
                         "(mlp.experts.gate_up_proj / down_proj)")
    return out


def weight_specs(config, dtype: str | torch.dtype | None = None) -> list[TensorSpec]:
    """The tensors of the checkpoint of ``config``, in ``state_dict()`` order.

    The model is built by ``AutoModelForCausalLM.from_config`` on the meta device (no memory);
    tied duplicates (e.g. ``lm_head.weight`` when ``tie_word_embeddings``) are dropped, keeping
    the first occurrence, as ``save_pretrained`` does. Non-persistent buffers are not in
    ``state_dict()``. Floating tensors get ``dtype`` (default: ``config.dtype``).

    Raises:
        ValueError: ``dtype`` unsupported, or the model has a non-floating persistent tensor.
    """
    from transformers import AutoModelForCausalLM

    tdtype = _torch_dtype(dtype if dtype is not None else config.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied: set[str] = set()
    if getattr(config, "tie_word_embeddings", False):
        tied_map = getattr(model, "_tied_weights_keys", None)
        if isinstance(tied_map, dict):
            tied = set(tied_map)
    specs: list[TensorSpec] = []
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or name in tied:
            continue
        seen.add(id(t))
        if not t.is_floating_point():
            raise ValueError(f"{name}: non-floating persistent tensor ({t.dtype}) not supported")
        specs.append(TensorSpec(name, tuple(t.shape), _kind(name, t.dim()), tdtype))
    return specs


class _Blocks:
    """The random source blocks, one per kind, as raw little-endian bytes of ``dtype``."""

    def __init__(self, dtype: torch.dtype, seed: int):
        self.dtype = dtype
        self.seed = int(seed)
        self.itemsize = dtype.itemsize
        gen = torch.Generator().manual_seed(self.seed)
        base = torch.randn(max(_BLOCK_ELEMS.values()), generator=gen, dtype=torch.float32)
        self.bytes: dict[str, memoryview] = {}
        kind_dtype = {"codes": torch.float8_e4m3fn, "scale": torch.float32, "e2m1": torch.uint8, "e8m0": torch.uint8}
        for kind, n in _BLOCK_ELEMS.items():
            mean, std = _KIND_STATS[kind]
            kd = kind_dtype.get(kind, dtype)
            vals = (base[:n] * std + mean)
            if kind == "codes":  # finite codes only: clamp to e4m3's largest (448), never its NaN
                vals = vals.clamp(-448.0, 448.0)
            if kind == "e2m1":  # every byte value, spread uniformly (float ops in place: no int64 temporary)
                vals = (base[:n] * 1e6).remainder_(256).floor_()
            if kind == "e8m0":
                vals = vals.round().clamp(117, 123)
            vals = vals.to(kd)
            if kind == "bias":  # make sure no bias element is exactly zero
                vals[vals == 0] = torch.tensor(std, dtype=dtype)
            self.bytes[kind] = memoryview(vals.view(torch.uint8).numpy()).cast("B")
        del base

    def offset(self, spec: TensorSpec) -> int:
        """Element offset of ``spec`` in its block: a hash of (seed, name)."""
        h = hashlib.blake2b(f"{self.seed}\0{spec.name}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") % _BLOCK_ELEMS[spec.kind]

    def chunks(self, spec: TensorSpec) -> Iterator[memoryview]:
        """The bytes of ``spec``: its block, rotated by the tensor's offset and tiled.

        Yields views into the block (no copies), each at most one block long.
        """
        isz = spec.dtype.itemsize
        if spec.dtype != self.dtype and spec.kind not in ("codes", "scale", "e2m1", "e8m0"):
            raise ValueError(f"{spec.name}: dtype {spec.dtype} but blocks are {self.dtype}")
        block = self.bytes[spec.kind]
        pos = self.offset(spec) * isz
        remaining = spec.nbytes
        while remaining:
            n = min(remaining, len(block) - pos)
            yield block[pos : pos + n]
            remaining -= n
            pos = 0

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        """Materialize ``spec`` as a CPU tensor (for tests and small models)."""
        buf = bytearray(spec.nbytes)
        pos = 0
        for c in self.chunks(spec):
            buf[pos : pos + len(c)] = c
            pos += len(c)
        if not buf:
            return torch.empty(spec.shape, dtype=spec.dtype)
        return torch.frombuffer(buf, dtype=spec.dtype).reshape(spec.shape)


def generate_state_dict(
    arch: str,
    *,
    dtype: str = "bf16",
    layers: int | None = None,
    scale: float = 1.0,
    seed: int = 0,
    tie: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Materialize in memory the tensors that ``make_checkpoint`` writes with these arguments.

    Same values, names and order (state-dict order). Holds the whole model in RAM: for tests
    and small models only. Raises what ``build_config`` raises.
    """
    config = build_config(arch, dtype=dtype, layers=layers, scale=scale, tie=tie)
    tdtype = _torch_dtype(dtype)
    blocks = _Blocks(tdtype, seed)
    return {s.name: blocks.tensor(s) for s in weight_specs(config, tdtype)}


# --------------------------------------------------------------------------------------------
# safetensors writing
# --------------------------------------------------------------------------------------------




def _plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Split ``specs`` in order: a new shard starts when the next tensor would push the current
    one over ``max_shard_size`` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for s in specs:
        if current and size + s.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    if current:
        shards.append(current)
    return shards


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, list[TensorSpec]]:
    """The safetensors header exactly as safetensors' Rust serializer writes it (tensors ordered by
    dtype alignment, then name; JSON padded to a multiple of 8), and the tensors in file order."""
    ordered = sorted(specs, key=lambda s: (-_ST_DTYPE_RANK[_ST_DTYPE_NAME[s.dtype]], s.name))
    return encode_header([(s.name, s.dtype, s.shape, s.nbytes) for s in ordered], metadata), ordered


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(path: Path, specs: list[TensorSpec], blocks: _Blocks, progress) -> int:
    header, ordered = _header(specs, {"format": "pt"})
    written = 0
    with open(path, "wb") as f:
        f.write(header)
        for s in ordered:
            for chunk in blocks.chunks(s):
                f.write(chunk)
                written += len(chunk)
                progress.update(len(chunk))
        f.flush()
        os.fsync(f.fileno())
    return len(header) + written


# --------------------------------------------------------------------------------------------
# Checkpoint directory
# --------------------------------------------------------------------------------------------


@dataclass
class _Result:
    path: Path
    cached: bool
    params: dict[str, Any]
    tensor_bytes: int = 0
    file_bytes: int = 0
    shards: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        p = self.params
        what = f"{p['arch']} {p['dtype']} layers={p['layers']} scale={p['scale']} seed={p['seed']} tie={p['tie']}"
        if p.get("quant") == "mxfp4":
            what += f" quant=mxfp4 ({p.get('mxfp4_tensors', '?')} experts matrices in MXFP4)"
        elif p.get("quant"):
            what += f" quant={p['quant']} ({p.get('fp8_weights', '?')} linear weights quantized)"
        if self.cached:
            return f"cached: {self.path} already holds {what}; nothing written"
        gb = self.file_bytes / 1e9
        rate = gb / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"wrote {self.path}: {gb:.3f} GB in {self.shards} shard(s), {self.seconds:.1f} s, {rate:.2f} GB/s ({what})"
        )


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _marker_matches(out: Path, params: dict[str, Any]) -> bool:
    """True when ``out`` holds a complete checkpoint generated with ``params``."""
    marker = _read_marker(out)
    if marker is None or marker.get("params") != params:
        return False
    files = marker.get("files")
    if not isinstance(files, dict):
        return False
    for name, size in files.items():
        try:
            if (out / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _generate(
    out_dir: str | os.PathLike,
    arch: str,
    *,
    dtype: str = "bf16",
    layers: int | None = None,
    scale: float = 1.0,
    max_shard_size: int | str = "5GB",
    seed: int = 0,
    tie: bool | None = None,
    force: bool = False,
    quiet: bool = True,
    quant: str | None = None,
    experts: str = "stacked",
) -> _Result:
    from tqdm import tqdm
    from transformers import GenerationConfig

    out = Path(out_dir).absolute()
    tdtype = _torch_dtype(dtype)
    shard_limit = parse_size(max_shard_size)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    config = build_config(arch, dtype=tdtype, layers=layers, scale=scale, tie=tie)
    params = {
        "arch": arch,
        "dtype": _DTYPE_SHORT[tdtype],
        "layers": int(config.num_hidden_layers),
        "scale": float(scale),
        "seed": int(seed),
        "tie": bool(config.tie_word_embeddings),
        "max_shard_size": shard_limit,
    }
    if experts not in ("stacked", "per-expert"):
        raise ValueError(f"experts={experts!r}: 'stacked' or 'per-expert'")
    if experts == "per-expert":
        params["experts"] = experts
    if quant == "mxfp4":
        if getattr(config, "model_type", None) != "gpt_oss":
            raise ValueError(f"quant='mxfp4' for {arch}: MXFP4 experts are gpt-oss's format (--arch gpt-oss-120b)")
        params["quant"] = quant
    elif quant is not None:
        if quant != "fp8":
            raise ValueError(f"quant={quant!r}: 'fp8' (block-scaled e4m3, weight_block_size {FP8_BLOCK}) or 'mxfp4' "
                             "(gpt-oss's experts)")
        if experts == "stacked" and any(hasattr(config, k) for k in ("num_experts", "num_local_experts")):
            raise ValueError(f"quant='fp8' for {arch}: stock transformers does not dequantize stacked FP8 experts; "
                             "pass experts='per-expert' (--experts per-expert: one tensor per expert, as the hub's "
                             "Qwen3-*-FP8 checkpoints store them)")
        params["quant"] = quant

    if out.exists() or out.is_symlink():
        if out.is_dir() and _marker_matches(out, params):
            return _Result(out, True, params)
        empty_dir = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
        if not empty_dir and not force:
            marker = _read_marker(out)
            if marker is None:
                why = f"it has no valid {MARKER_NAME} marker (not made by this script?)"
            else:
                old = marker.get("params")
                old = old if isinstance(old, dict) else {}
                diff = [f"{k}={old.get(k)!r} (requested {v!r})" for k, v in params.items() if old.get(k) != v]
                why = (
                    f"it was generated with {', '.join(diff)}"
                    if diff
                    else "its files do not match its marker (incomplete or modified)"
                )
            raise FileExistsError(f"{out} already exists and {why}; pass --force (force=True) to replace it")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"parent directory {out.parent} does not exist")

    specs = weight_specs(config, tdtype)
    if experts == "per-expert":
        specs = per_expert_specs(specs, arch)
    if quant == "mxfp4":
        specs = mxfp4_specs(specs)
        n_blocks = sum(s.kind == "e2m1" for s in specs)
        if not n_blocks:
            raise ValueError(f"quant='mxfp4' for {arch} at scale {scale}: no experts matrix has input features a "
                             "multiple of 32; use a larger scale")
        shown = {**params, "mxfp4_tensors": n_blocks}
    elif quant == "fp8":
        plain = specs
        specs = fp8_specs(specs)
        n_codes = sum(s.kind == "codes" for s in specs)
        n_linear = sum(s.kind == "matrix" and len(s.shape) == 2 and bool(_FP8_NAMES.search(s.name)) for s in plain)
        if n_codes == 0:
            raise ValueError(f"quant='fp8' for {arch} at scale {scale}: none of its {n_linear} linear weights has both "
                             f"sides a multiple of {FP8_BLOCK}; use a larger scale (1.0: the real shapes)")
        shown = {**params, "fp8_weights": f"{n_codes}/{n_linear}"}  # for the summary (not the cache key)
    else:
        shown = params
    shards = _plan_shards(specs, shard_limit)
    tensor_bytes = sum(s.nbytes for s in specs)
    n = len(shards)
    names = [SINGLE_FILE_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        blocks = _Blocks(tdtype, seed)
        files: dict[str, int] = {}
        with tqdm(
            total=tensor_bytes,
            unit="B",
            unit_scale=True,
            desc=f"{arch} {params['dtype']}",
            file=sys.stderr,
            disable=quiet,
            mininterval=0.5,
        ) as progress:
            for name, shard in zip(names, shards, strict=True):
                files[name] = _write_shard(tmp / name, shard, blocks, progress)
        del blocks

        cfg = json.loads(config.to_json_string(use_diff=True))  # as save_pretrained
        # "torch_dtype" is the legacy key, read by transformers < 5 and other tools.
        cfg["torch_dtype"] = cfg["dtype"]
        if quant == "mxfp4":  # as openai/gpt-oss-* declare it
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        if quant == "fp8":  # as the hub's block-FP8 checkpoints (DeepSeek-V3, Qwen3-*-FP8) declare it
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        _write_text(tmp / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if n > 1:
            index = {
                "metadata": {
                    "total_parameters": sum(s.numel for s in specs),
                    "total_size": tensor_bytes,
                },
                "weight_map": {s.name: name for name, shard in zip(names, shards, strict=True) for s in shard},
            }
            _write_text(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        marker = {
            "format": MARKER_FORMAT,
            "generator": "benchmarks/make_checkpoint.py",
            "params": params,
            "total_size": tensor_bytes,
            "files": files,
        }
        for extra in ("config.json", "generation_config.json"):
            _fsync_file(tmp / extra)
        _write_text(tmp / MARKER_NAME, json.dumps(marker, indent=2, sort_keys=True) + "\n")
        _fsync_dir(tmp)
        installed = _install(tmp, out, params, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    if not installed:  # a concurrent run with the same parameters finished first
        return _Result(out, True, params)
    return _Result(out, False, shown, tensor_bytes, sum(files.values()), n, seconds)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, out: Path, params: dict[str, Any], force: bool) -> bool:
    """Rename ``tmp`` to ``out``, replacing an existing ``out`` only when ``force``.

    Returns False (and removes ``tmp``) when a concurrent run installed the same checkpoint."""
    trash = None
    if (out.exists() or out.is_symlink()) and not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        if not force:  # appeared while we were writing
            if out.is_dir() and _marker_matches(out, params):
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            raise FileExistsError(f"{out} appeared while generating; pass --force to replace it")
        trash = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, trash)
    try:
        os.rename(tmp, out)  # replaces an empty directory atomically
    except OSError:
        # A concurrent run with the same parameters may have won the race.
        if out.is_dir() and _marker_matches(out, params):
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise
    _fsync_dir(out.parent)
    if trash is not None:
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink()
    return True


def make_checkpoint(
    out_dir: str | os.PathLike,
    arch: str,
    *,
    dtype: str = "bf16",
    layers: int | None = None,
    scale: float = 1.0,
    max_shard_size: int | str = "5GB",
    seed: int = 0,
    tie: bool | None = None,
    force: bool = False,
    quiet: bool = True,
    quant: str | None = None,
    experts: str = "stacked",
) -> Path:
    """Generate a Hugging Face model directory for ``arch`` with random weights at ``out_dir``.

    The directory is written next to ``out_dir`` under a temporary name, fsynced, then renamed
    to ``out_dir``, so it either exists complete or not at all. If ``out_dir`` already holds a
    checkpoint made with the same parameters (per its ``tiered_checkpoint.json`` marker, and
    all its files have their recorded sizes), nothing is written (cache hit).

    Args:
        out_dir: the directory to create. Its parent must exist. An existing empty directory is
            replaced silently.
        arch: a key of ``ARCHS``.
        dtype: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the dtype of every tensor.
        layers: number of decoder layers (default: the real model's).
        scale: hidden/intermediate size factor in (0, 1]; see ``build_config``.
        max_shard_size: largest shard, in bytes (int) or a string like ``"5GB"`` (decimal, as
            transformers), ``"500MB"``, ``"2GiB"``. Tensors are taken in state-dict order and a
            new shard starts when the next tensor would exceed it (a bigger tensor gets its own).
        seed: random seed (integer >= 0); same arguments and seed give identical bytes.
        tie: tie lm_head to the embedding (default: the real model's, untied for all ARCHS).
        force: replace an ``out_dir`` that exists with other parameters or without a marker.
        quiet: no tqdm progress bar (stderr) and no summary line (stdout).
        quant: ``"fp8"``: a block-scaled FP8 checkpoint (:func:`fp8_specs`: e4m3 codes and float32
            ``weight_scale_inv`` per 128 x 128 block, ``quantization_config`` as DeepSeek-V3's); a MoE
            architecture needs ``experts="per-expert"``.
        experts: ``"stacked"`` (the model's own parameters) or ``"per-expert"`` (:func:`per_expert_specs`: one
            tensor per expert and projection, as the hub's Qwen3-MoE checkpoints; Qwen3-MoE layouts only).

    Returns:
        ``out_dir`` as an absolute ``pathlib.Path``.

    Raises:
        ValueError: bad ``arch``, ``dtype``, ``layers``, ``scale``, ``max_shard_size``, ``seed``.
        FileExistsError: ``out_dir`` exists, is not empty and does not match, and not ``force``.
        FileNotFoundError: the parent of ``out_dir`` does not exist.
        OSError: writing failed (e.g. disk full); the temporary directory is removed.
    """
    result = _generate(
        out_dir,
        arch,
        dtype=dtype,
        layers=layers,
        scale=scale,
        max_shard_size=max_shard_size,
        seed=seed,
        tie=tie,
        force=force,
        quiet=quiet,
        quant=quant,
        experts=experts,
    )
    if not quiet:
        print(result.summary(), flush=True)
    return result.path


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _arg_parser() -> argparse.ArgumentParser:
    archs = "\n".join(f"  {name:<15} {spec.description}" for name, spec in ARCHS.items())
    parser = argparse.ArgumentParser(
        prog="make_checkpoint.py",
        description=(
            "Generate a Hugging Face model directory (config.json, generation_config.json, "
            "safetensors shards and index) at a real model's shapes with random weights, "
            "offline. Shards are byte-identical to safetensors.torch.save_file output and are "
            "streamed, so memory stays at a few MiB. The result is cached: re-running with the "
            "same parameters on an existing OUT_DIR does nothing."
        ),
        epilog=f"archs:\n{archs}\n\nexample:\n  python benchmarks/make_checkpoint.py "
        "--arch gptj-6b --dtype fp16 /data/gptj-6b-random",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to create (its parent must exist)")
    parser.add_argument(
        "--arch",
        required=True,
        choices=list(ARCHS),
        help="model architecture (see below)",
    )
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=["fp16", "bf16", "fp32"],
        help="dtype of every tensor: 2 bytes per parameter for fp16/bf16, 4 for fp32 (default: bf16)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="number of decoder layers, >= 1 (default: the real model's)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        metavar="F",
        help="factor in (0, 1] for hidden and intermediate sizes; head_dim is kept, the number "
        "of heads is scaled, sizes stay multiples of 64; vocab is not scaled (default: 1.0)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest shard file, bytes or a number with a unit: KB/MB/GB/TB are decimal "
        "(5GB = 5*10^9 bytes, as transformers), KiB/MiB/GiB/TiB binary (default: 5GB)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed, integer >= 0; same arguments and seed give identical bytes (default: 0)",
    )
    parser.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie lm_head.weight to the input embedding (--tie) or not (--no-tie); tied "
        "checkpoints omit lm_head.weight (default: the real model's, untied for all archs)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it exists with other parameters or was not made by this script",
    )
    parser.add_argument(
        "--quant",
        choices=["fp8", "mxfp4"],
        default=None,
        help="fp8: a block-scaled FP8 checkpoint (e4m3 codes + float32 weight_scale_inv per 128x128 block of each "
        "linear weight, quantization_config as DeepSeek-V3's; a MoE arch needs --experts per-expert); mxfp4: "
        "gpt-oss's experts as *_blocks (e2m1) and *_scales (E8M0), the rest in --dtype (--arch gpt-oss-120b)",
    )
    parser.add_argument(
        "--experts",
        choices=["stacked", "per-expert"],
        default="stacked",
        help="MoE experts as the model's stacked parameters (default) or one tensor per expert and projection, as "
        "the hub's Qwen3-MoE (and Qwen3-*-FP8) checkpoints store them",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (the bar counts bytes, on stderr); the one-line summary is still printed on stdout",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok or cached, 1 refused/failed,
    2 bad arguments)."""
    parser = _arg_parser()
    args = parser.parse_args(argv)
    try:
        result = _generate(
            args.out_dir,
            args.arch,
            dtype=args.dtype,
            layers=args.layers,
            scale=args.scale,
            max_shard_size=args.max_shard_size,
            seed=args.seed,
            tie=args.tie,
            force=args.force,
            quiet=args.quiet,
            quant=args.quant,
            experts=args.experts,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:
        print(f"make_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
