"""Tiny random-weight checkpoints written the way Hugging Face writes them (no hub access).

Every builder makes a model from a config, overwrites *every* parameter with seeded random
values (``from_config`` leaves norms at one and biases at zero, which would hide a wrong
binding), checks nothing is all-zero, and ``save_pretrained``s it into ``path``: sharded
(``max_shard_size`` small, so units straddle shards) or as one ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn

__all__ = [
    "VOCAB",
    "randomize_",
    "save_model",
    "llama",
    "gptj",
    "gpt2",
    "bert",
    "mixtral",
    "qwen2_moe",
    "dbrx",
    "llama4",
    "marian",
    "llava",
    "custom_code",
    "BUILDERS",
    "checkpoint_keys",
    "MLPStack",
    "quantize_fp8_block",
    "fp8_block",
    "mxfp4_experts",
]

VOCAB = 256  # token ids of the test inputs are drawn from [0, VOCAB)


def randomize_(model: nn.Module, *, seed: int, std: float = 0.1) -> None:
    """Overwrite every parameter in place with seeded N(0, std) values (1-D norm weights: 1 + N(0, std)).

    Tied parameters are one object and are written once. Raises AssertionError if any parameter ends up all zero.
    """
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            r = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if p.dim() == 1 and name.endswith("weight"):  # norm scales around one
                r += 1.0
            p.copy_(r.to(p.dtype))
            assert p.abs().sum().item() > 0, f"{name} is all zero"
            assert p.std().item() > 0 if p.numel() > 1 else True, f"{name} is constant"


def save_model(
    model: transformers.PreTrainedModel,
    path: Path,
    *,
    seed: int,
    dtype: torch.dtype,
    max_shard_size: str | None,
    std: float = 0.1,
) -> Path:
    """Randomize ``model``, cast it to ``dtype`` and ``save_pretrained`` it into ``path`` (sharded or not)."""
    randomize_(model, seed=seed, std=std)
    model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {"max_shard_size": "10GB"}
    model.save_pretrained(path, **kw)
    sharded = (path / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size is not None), f"{path}: expected sharded={max_shard_size is not None}"
    if sharded:
        files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) >= 3, f"{path}: only {len(files)} shards; lower max_shard_size"
    return path


def checkpoint_keys(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint in ``path``: name -> (shard file name, shape)."""
    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                out[k] = (f.name, list(st.get_slice(k).get_shape()))
    return out


# ---------------------------------------------------------------------------------------------- builders
# Each returns the directory it wrote. Shapes are tiny; 4 layers so a streamed run has more units
# than a ring of 2-3 units holds.


def nomic_bert(path: Path, *, seed: int) -> Path:
    """A 2-layer NomicBert in bf16 saved with ``save_pretrained`` (random weights, ``seed``): its checkpoint holds one
    fused ``attn.Wqkv`` per layer that transformers splits into q/k/v with ``Chunk(dim=0)`` (tiered/chunks.py)."""
    cfg = transformers.NomicBertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    m = transformers.NomicBertModel(cfg).to(torch.bfloat16)
    randomize_(m, seed=seed)
    m.save_pretrained(path)
    return path


def llama(
    path: Path,
    *,
    tied: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str | None = "40KB",
    seed: int = 1,
) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
    # a tied checkpoint stores the embedding once: tiered must bind lm_head from it
    assert ("lm_head.weight" in checkpoint_keys(path)) == (not tied)
    return path


def gptj(path: Path, *, dtype: torch.dtype = torch.float16, max_shard_size: str | None = "40KB", seed: int = 2) -> Path:
    cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4, rotary_dim=8)
    return save_model(transformers.GPTJForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def gpt2(path: Path, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = "60KB", seed: int = 3) -> Path:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
    assert "lm_head.weight" not in checkpoint_keys(path)
    return path


def bert(path: Path, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = "60KB", seed: int = 4) -> Path:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    return save_model(transformers.BertModel(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def mixtral(
    path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "40KB", seed: int = 5,
    num_experts: int = 4, top_k: int = 2,
) -> Path:
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=128,
    )
    save_model(transformers.MixtralForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
    keys = checkpoint_keys(path)
    # transformers 5 fuses experts in memory but save_pretrained writes the legacy per-expert layout:
    # that is what exercises tiered's conversion path. Write it ourselves if it ever stops doing so.
    if "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in keys:  # pragma: no cover
        _write_legacy_mixtral(path, cfg)
        keys = checkpoint_keys(path)
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_local_experts):
            for w in ("w1", "w2", "w3"):
                assert f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    return path


def _write_legacy_mixtral(path: Path, cfg: transformers.MixtralConfig) -> None:  # pragma: no cover
    """Rewrite a fused Mixtral checkpoint in the per-expert layout (w1/w3 = gate/up halves, w2 = down)."""
    from safetensors.torch import load_file, save_file

    files = sorted(path.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
        f.unlink()
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts"
            for e in range(v.shape[0]):
                g, u = v[e].chunk(2, dim=0)  # (2*I, H) -> (I, H), (I, H)
                out[f"{pre}.{e}.w1.weight"] = g.contiguous()
                out[f"{pre}.{e}.w3.weight"] = u.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("mlp.experts.down_proj")] + "block_sparse_moe.experts"
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w2.weight"] = v[e].contiguous()
        elif ".mlp.gate." in k:
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
        else:
            out[k] = v
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})


def qwen2_moe(
    path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "40KB", seed: int = 6
) -> Path:
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    save_model(transformers.Qwen2MoeForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
    keys = checkpoint_keys(path)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, sorted(keys)[:20]
    return path


#: name -> (builder, kwargs, AutoModel class used as the reference, causal LM?)
BUILDERS: dict[str, tuple[Callable[..., Path], dict, type, bool]] = {
    "llama": (llama, {}, transformers.AutoModelForCausalLM, True),
    "llama_tied_single": (llama, {"tied": True, "max_shard_size": None}, transformers.AutoModelForCausalLM, True),
    "llama_fp32": (llama, {"dtype": torch.float32, "seed": 7}, transformers.AutoModelForCausalLM, True),
    "gptj": (gptj, {}, transformers.AutoModelForCausalLM, True),  # fp16, like GPT-J-6B's published weights
    "gpt2": (gpt2, {}, transformers.AutoModelForCausalLM, True),
    "gpt2_single": (gpt2, {"max_shard_size": None}, transformers.AutoModelForCausalLM, True),
    "bert": (bert, {}, transformers.AutoModel, False),
    "bert_single": (bert, {"max_shard_size": None}, transformers.AutoModel, False),
    "mixtral": (mixtral, {}, transformers.AutoModelForCausalLM, True),
    "qwen2_moe": (qwen2_moe, {}, transformers.AutoModelForCausalLM, True),
}


def t5(path: Path, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = "60KB", seed: int = 8) -> Path:
    """T5 keeps ``wo`` in float32 when loaded in fp16 (``_keep_in_fp32_modules``)."""
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return save_model(transformers.T5ForConditionalGeneration(cfg), path, seed=seed, dtype=dtype,
                      max_shard_size=max_shard_size)


def deepseek_v3(path: Path, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = "60KB",
                seed: int = 9) -> Path:
    """DeepSeek-V3 keeps the router's ``e_score_correction_bias`` in float32 at fp16 and bf16
    (``_keep_in_fp32_modules_strict``)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a buffer save_model does not randomise: make it matter
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape,
                                                            generator=torch.Generator().manual_seed(seed)) * 0.1)
    return save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def qwen3_moe(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
              seed: int = 10, num_experts: int = 8, top_k: int = 2) -> Path:
    """Qwen3-MoE: every layer sparse, no shared expert, normalised top-k; checkpoints store per-expert tensors."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=num_experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=128,
    )
    return save_model(transformers.Qwen3MoeForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def olmoe(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB", seed: int = 11) -> Path:
    """OLMoE: every layer sparse, 8 experts, top-2, no shared expert."""
    cfg = transformers.OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                                   max_position_embeddings=128)
    return save_model(transformers.OlmoeForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def gpt_oss(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB", seed: int = 12) -> Path:
    """gpt-oss in bf16 (the published MXFP4 weights are another format): expert biases, attention sinks."""
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                    num_experts_per_tok=2, max_position_embeddings=128,
                                    layer_types=["full_attention"] * 3)
    return save_model(transformers.GptOssForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def glm4_moe(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
             seed: int = 13) -> Path:
    """GLM-4-MoE: a dense first layer, then shared + routed experts with grouped routing."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=128,
    )
    return save_model(transformers.Glm4MoeForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def deepseek_v2(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
                seed: int = 14) -> Path:
    """DeepSeek-V2: multi-head latent attention, a dense first layer, shared + routed experts,
    ``group_limited_greedy`` routing."""
    cfg = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, topk_method="group_limited_greedy", q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
    )
    return save_model(transformers.DeepseekV2ForCausalLM(cfg), path, seed=seed, dtype=dtype,
                      max_shard_size=max_shard_size)


def dbrx(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB", seed: int = 15) -> Path:
    """DBRX: the experts' parameters live on a child (``experts.mlp``) as flat ``(E * F, H)`` matrices (``w1``,
    ``v1``, ``w2``), not the stacked ``(E, ...)`` tensors of the ``use_experts_implementation`` classes; decoder
    blocks are ``transformer.blocks``. ``rope_theta`` and ``clip_qkv`` (8, as the published DBRX) are set: transformers
    5.17's DbrxAttention reads the first from ``attn_config`` and cannot run with ``clip_qkv=None``."""
    cfg = transformers.DbrxConfig(
        vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    )
    return save_model(transformers.DbrxForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def llama4(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB", seed: int = 16,
           top_k: int = 1) -> Path:
    """Llama 4's text model: its experts module (``Llama4TextExperts``, stacked ``gate_up_proj`` ``(E, H, 2F)`` and
    ``down_proj`` ``(E, F, H)``) is called with no router ids and runs all ``E`` experts on score-scaled copies of the
    tokens (zero for the experts not picked). Two MoE layers of 4 experts, ``top_k`` picked per token."""
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=top_k,
        interleave_moe_layer_step=1, max_position_embeddings=128, attention_chunk_size=64, tie_word_embeddings=False)
    return save_model(transformers.Llama4ForCausalLM(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def marian(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "20KB", seed: int = 5) -> Path:
    """Marian (an encoder-decoder): its sinusoidal position tables are parameters it never saves
    (``_keys_to_ignore_on_save``) and ``from_pretrained`` computes with ``_init_weights``."""
    cfg = transformers.MarianConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
                                    decoder_start_token_id=0, eos_token_id=1)
    return save_model(transformers.MarianMTModel(cfg), path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def llava(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = None, seed: int = 13) -> Path:
    """A composite (multimodal) model: Llava, a one-layer CLIP vision tower and a two-layer Llama text model; its
    ``config.json`` has sub-configs (``text_config``, ``vision_config``). Token ids below ``VOCAB``; the image token
    is ``VOCAB`` (text-only inputs never hold it)."""
    cfg = transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": VOCAB + 1, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 64},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                       "projection_dim": 32},
        image_token_id=VOCAB,
    )
    return save_model(transformers.LlavaForConditionalGeneration(cfg), path, seed=seed, dtype=dtype,
                      max_shard_size=max_shard_size)


_TOY_CONFIG = '''from transformers import LlamaConfig


class ToyConfig(LlamaConfig):
    model_type = "tiered_toy"
'''

_TOY_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_toy import ToyConfig


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = -out.logits  # not Llama's outputs: equal ones mean this code ran
        return out
'''


def custom_code(src: Path, path: Path) -> Path:
    """``src`` (a Llama checkpoint) as a model with its own code (``trust_remote_code``): ``configuration_toy.py``
    and ``modeling_toy.py`` in the directory, named by config.json's ``auto_map`` (model type ``tiered_toy``, unknown
    to transformers). Its ``ToyForCausalLM`` is Llama with negated logits: equal outputs prove the code ran."""
    import shutil

    shutil.copytree(src, path)
    (path / "configuration_toy.py").write_text(_TOY_CONFIG)
    (path / "modeling_toy.py").write_text(_TOY_MODEL)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="tiered_toy", architectures=["ToyForCausalLM"],
               auto_map={"AutoConfig": "configuration_toy.ToyConfig",
                         "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


#: Checkpoints outside the equality sweep (not plain causal LMs or encoders): name -> (builder, kwargs, auto class)
EXTRA_BUILDERS: dict[str, tuple[Callable[..., Path], dict, type]] = {
    "t5": (t5, {}, transformers.AutoModelForSeq2SeqLM),
    "deepseek_v3": (deepseek_v3, {}, transformers.AutoModelForCausalLM),
    "qwen3_moe": (qwen3_moe, {}, transformers.AutoModelForCausalLM),
    "olmoe": (olmoe, {}, transformers.AutoModelForCausalLM),
    "gpt_oss": (gpt_oss, {}, transformers.AutoModelForCausalLM),
    "glm4_moe": (glm4_moe, {}, transformers.AutoModelForCausalLM),
    "deepseek_v2": (deepseek_v2, {}, transformers.AutoModelForCausalLM),
}


# ---------------------------------------------------------------------------------------------- hybrid stacks
# Decoder stacks that mix layer classes in one ModuleList, or hold one layer (not in the placement golden grid).


def jamba(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
          seed: int = 21) -> Path:
    """Jamba: Mamba and attention decoder layers in one ``model.layers`` (MoE on odd layers); the torch Mamba path."""
    cfg = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        use_mamba_kernels=False, max_position_embeddings=128,
    )
    model = transformers.JambaForCausalLM(cfg)
    assert len({type(lay) for lay in model.model.layers}) == 2
    return save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def zamba(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
          seed: int = 22) -> Path:
    """Zamba: Mamba layers and hybrid layers in one ``model.layers``; the hybrid layers share one attention block
    (one module object, saved once under the first hybrid layer's names)."""
    cfg = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=4, attention_hidden_size=128, attention_head_dim=32, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, n_mamba_heads=1, attn_layer_period=2, attn_layer_offset=1,
        use_mamba_kernels=False, max_position_embeddings=128,
    )
    model = transformers.ZambaForCausalLM(cfg)
    assert len({type(lay) for lay in model.model.layers}) == 2
    return save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def mllama(path: Path, *, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
           seed: int = 23) -> Path:
    """Mllama (Llama-3.2-Vision): self- and cross-attention decoder layers in one ``language_model.layers``, a
    vision tower with a one-layer ``global_transformer``. Inputs: :func:`mllama_inputs`."""
    vc = transformers.MllamaVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0, 1], vision_output_dim=96,
        supported_aspect_ratios=[[1, 1], [1, 2]],
    )
    tc = transformers.MllamaTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg = transformers.MllamaConfig(vision_config=vc.to_dict(), text_config=tc.to_dict(), image_token_index=VOCAB - 1)
    model = transformers.MllamaForConditionalGeneration(cfg)
    return save_model(model, path, seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def mllama_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """One image (two tiles) and 7 tokens, the first the image token, for :func:`mllama`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (1, 7), generator=g)
    ids[0, 0] = VOCAB - 1
    return {"input_ids": ids, "pixel_values": torch.randn(1, 1, 2, 3, 28, 28, generator=g),
            "aspect_ratio_ids": torch.tensor([[2]]), "aspect_ratio_mask": torch.ones(1, 1, 2, dtype=torch.long),
            "cross_attention_mask": torch.ones(1, 7, 1, 2, dtype=torch.long)}


def falcon_h1(path: Path, *, layers: int = 1, dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = "60KB",
              seed: int = 24) -> Path:
    """Falcon-H1 (attention and Mamba-2 side by side in each layer), ``layers`` decoder layers (default one: a stack
    of one layer)."""
    cfg = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=128,
    )
    return save_model(transformers.FalconH1ForCausalLM(cfg), path, seed=seed, dtype=dtype,
                      max_shard_size=max_shard_size)


# ---------------------------------------------------------------------------------------------- plain module


class MLPStack(nn.Module):
    """A non-transformers module for ``tiered.attach``: embedding-free MLP blocks in a ModuleList + a head."""

    def __init__(self, width: int = 64, depth: int = 4, out: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, out)
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.norm(x))


def fused_experts(src: Path, path: Path) -> Path:
    """``src`` (a per-expert MoE checkpoint: Mixtral's ``experts.j.w1/w3/w2``, Qwen's ``experts.j.gate_proj/...``)
    rewritten in the stacked layout ``transformers`` holds in memory (``mlp.experts.gate_up_proj`` ``(E, 2I, D)``,
    ``mlp.experts.down_proj`` ``(E, D, I)``): the state dict ``from_pretrained`` builds from ``src``, saved as is
    (one ``model.safetensors``) with ``src``'s other files. Same weights, so the same logits as ``src``."""
    import shutil

    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, path / f.name)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd), sorted(sd)[:20]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D) as DeepSeek-style block FP8: e4m3 codes and a float32 ``weight_scale_inv`` grid of
    ``ceil(rows / block[0]) x ceil(cols / block[1])`` (each block's absolute max / 448, the e4m3 maximum), as
    transformers' ``Fp8Quantize`` writes them. Written block by block: the tests' own code, not tiered's."""
    rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    scale = torch.empty(gr, gc, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    wf = w.float()
    for i in range(gr):
        for j in range(gc):
            blk = wf[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            s = blk.abs().amax().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            codes[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / s).to(torch.float8_e4m3fn)
    assert codes.view(torch.uint8).any() and scale.min() > 0
    return codes, scale


def _rewrite(src: Path, path: Path, tensor: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
             config: Callable[[dict], None]) -> Path:
    """``src`` copied to ``path`` with each checkpoint tensor replaced by ``tensor(name, value)`` (a dict of the
    tensors to write in its place, in the same shard; the index follows) and config.json edited by ``config``."""
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True)
    index = src / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for f in src.iterdir():
        if not f.is_file() or f.name == "config.json":
            continue
        if not f.name.endswith(".safetensors"):
            if f.name != index.name:
                shutil.copy(f, path / f.name)
            continue
        out: dict[str, torch.Tensor] = {}
        for k, v in load_file(f).items():
            new = tensor(k, v)
            out.update(new)
            if wmap is not None:
                if k not in new:
                    del wmap[k]
                wmap.update({n: f.name for n in new})
        save_file(out, path / f.name, metadata={"format": "pt"})
    if wmap is not None:
        (path / index.name).write_text(json.dumps({"metadata": {}, "weight_map": wmap}, indent=1))
    cfg = json.loads((src / "config.json").read_text())
    config(cfg)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def fp8_block(src: Path, path: Path, *, block: tuple[int, int] = (32, 32), skip: tuple[str, ...] = ("lm_head",),
              scale_dtype: torch.dtype = torch.float32, config: bool = True) -> Path:
    """``src`` rewritten as a block-FP8 checkpoint (``quant_method="fp8"``, ``weight_block_size=block``): every 2-D
    ``*proj.weight`` / ``*w1|w2|w3.weight`` not under a name in ``skip`` becomes codes plus ``..._scale_inv`` (in
    ``scale_dtype``), in the shard it was in; other tensors and files are kept. ``config=False`` leaves the
    ``quantization_config`` out of config.json (a stripped config)."""
    import re

    def tensor(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if v.dim() == 2 and re.search(r"(proj|w[123])\.weight$", k) and not any(s in k for s in skip):
            codes, sc = quantize_fp8_block(v, block)
            return {k: codes, k + "_scale_inv": sc.to(scale_dtype)}
        return {k: v}

    def cfg(c: dict) -> None:
        if config:
            c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                        "activation_scheme": "dynamic", "modules_to_not_convert": list(skip)}

    return _rewrite(src, path, tensor, cfg)


def mxfp4_experts(src: Path, path: Path, *, seed: int = 21) -> Path:
    """``src`` (a bf16 gpt-oss checkpoint) with its experts in gpt-oss's MXFP4 form: each ``experts.gate_up_proj``
    ``(E, H, 2I)`` / ``experts.down_proj`` ``(E, I, H)`` replaced by random ``<name>_blocks`` ``(E, R, G, 16)`` uint8
    (two e2m1 codes per byte) and ``<name>_scales`` ``(E, R, G)`` uint8 E8M0 exponents (117..123), ``R`` the output
    features and ``G * 32`` the input features, and ``quant_method: "mxfp4"`` in config.json (attention, router, biases
    and embeddings stay bf16, as gpt-oss ships them). Random codes, not a quantization of ``src``: the test compares
    decodes, not approximations."""
    g = torch.Generator().manual_seed(seed)

    def tensor(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {k: v}
        e, cin, rows = v.shape  # stored transposed: (E, out features, in features / 32, 16)
        return {k + "_blocks": torch.randint(0, 256, (e, rows, cin // 32, 16), generator=g, dtype=torch.uint8),
                k + "_scales": torch.randint(117, 124, (e, rows, cin // 32), generator=g, dtype=torch.uint8)}

    def cfg(c: dict) -> None:
        c["quantization_config"] = {"quant_method": "mxfp4",
                                    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}

    return _rewrite(src, path, tensor, cfg)


def compressed_tensors(src: Path, path: Path, fmt: str, weights: dict, input_activations: dict | None = None, *,
                       seed: int = 22, skip: tuple[str, ...] = ("lm_head",), extra: dict | None = None,
                       ignore: list[str] | None = None) -> Path:
    """``src`` rewritten as a compressed-tensors checkpoint (``quant_method="compressed-tensors"``, one config group
    targeting ``Linear``, ``ignore=skip``): every 2-D ``*proj.weight`` becomes random codes and a random positive
    ``weight_scale`` in the weight's dtype, stored as the package stores ``fmt`` — ``pack-quantized``: ``weight_packed``
    (int32, the package's own ``pack_to_int32`` of signed ``num_bits`` codes) and ``weight_shape``; ``int-quantized``:
    int8 ``weight``; ``float-quantized``: float8_e4m3fn ``weight`` (no NaN codes). Scale shapes follow
    ``weights["strategy"]``. Random codes, not a quantization of ``src``: the test compares decodes. ``extra``: more
    keys of the config (e.g. to break it); ``ignore``: the config's (default ``skip``, as exact names)."""
    import re

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(seed)
    bits, strategy = int(weights.get("num_bits", 8)), weights.get("strategy", "tensor")

    def tensor(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if not (v.dim() == 2 and re.search(r"proj\.weight$", k) and not any(s in k for s in skip)):
            return {k: v}
        rows, cols = v.shape
        base = k[: -len("weight")]
        cols_s = {"tensor": None, "channel": 1, "group": -(-cols // int(weights.get("group_size") or cols))}[strategy]
        shape = (1,) if cols_s is None else (rows, cols_s)
        scale = (torch.rand(shape, generator=g) * 0.02 + 0.002).to(v.dtype)
        if fmt == "pack-quantized":
            lo = 1 << (bits - 1)
            q = torch.randint(-lo, lo, (rows, cols), generator=g, dtype=torch.int8)
            return {base + "weight_packed": pack_to_int32(q, bits), base + "weight_scale": scale,
                    base + "weight_shape": torch.tensor([rows, cols])}
        if fmt == "int-quantized":
            return {k: torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8), base + "weight_scale": scale}
        u = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
        u[(u & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        return {k: u.view(torch.float8_e4m3fn), base + "weight_scale": scale}

    def cfg(c: dict) -> None:
        c["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False,
                                                                             **weights},
                                          "input_activations": input_activations, "output_activations": None}},
            "ignore": list(skip) if ignore is None else ignore, **(extra or {})}

    return _rewrite(src, path, tensor, cfg)
