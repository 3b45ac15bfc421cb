#!/usr/bin/env python3
"""Architecture sweep: every transformers (5.17) model class with a tiny config, stock vs ``tiered`` streamed.

For each model class (``*ForCausalLM`` from transformers' causal-LM auto mapping; optionally encoders ``*Model`` and
encoder-decoders ``*ForConditionalGeneration`` from the seq2seq mapping, run with ``decoder_input_ids``):
build a tiny config from the config class defaults (sizes shrunk, sub-configs too), create the model with a fixed
seed, randomize every parameter (``tests/models.py`` ``randomize_``), cast to bf16, ``save_pretrained`` it, load
stock ``from_pretrained`` and ``tiered.load(..., device="cpu")`` streamed (a ring that holds the largest unit but
not the whole model; for MoE models also a ring below one MoE layer, so the experts are routed; for the others a
ring of 0.6 x the largest unit, where a ``RingTooSmallError`` at load — the placement's, before any weight is read —
is the run's accepted outcome ``refused``), run a forward on fixed ids (and ``generate`` 4 greedy tokens for causal
LMs) and compare every output tensor with ``torch.equal``.

Each model runs in a worker process with a timeout (a crash or hang of one model kills only its worker, which is
started again for the remaining models); ``--fresh`` starts one process per model. One JSON line per class:
``status`` in equal / DIFFERENT / tiered_error / stock_error / skipped.

    .venv/bin/python tools/arch_sweep.py --only llama,mixtral --fresh          # a repro
    .venv/bin/python tools/arch_sweep.py --priority-first --budget-min 60      # the sweep

No network: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "2026-12-01-cpu-arch-sweep.jsonl"
PAGE = 4096
GiB = 1 << 30
TAG = "@@"

#: popular decoder architectures first (model_type keys of the causal-LM auto mapping)
PRIORITY = [
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma", "gemma2", "gemma3_text", "gemma3",
    "phi", "phi3", "gpt2", "gptj", "gpt_neox", "falcon", "mixtral", "olmo", "olmo2", "olmo3", "olmoe", "granite",
    "granitemoe", "cohere", "cohere2", "starcoder2", "deepseek_v2", "deepseek_v3", "jamba", "zamba", "zamba2",
    "bloom", "opt", "mpt", "stablelm", "nemotron", "exaone4", "glm", "glm4", "glm4_moe", "gpt_oss", "gpt_bigcode",
    "gpt_neo", "codegen", "phimoe", "dbrx", "falcon_h1", "mamba", "mamba2", "qwen3_next", "llama4_text",
    "minimax", "ministral", "smollm3", "helium", "persimmon", "gemma3n_text", "recurrent_gemma", "bamba",
    "granitemoehybrid", "nemotron_h", "lfm2", "hunyuan_v1_dense", "hunyuan_v1_moe", "ernie4_5", "ernie4_5_moe",
    "seed_oss", "apertus", "arcee", "bitnet", "diffllama", "jetmoe", "dots1", "glm4_moe_lite", "qwen3_5_text",
    "qwen3_5_moe_text", "falcon_mamba", "rwkv", "xglm", "biogpt", "ctrl", "openai-gpt", "vaultgemma",
]

# ---------------------------------------------------------------------------------------------- tiny configs

_SET = {  # field -> tiny value (set only where the config has the field and it is not None)
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "embed_dim": 64, "dim": 64, "model_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "d_ff": 128, "n_inner": 128, "ffn_hidden_size": 128,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "inner_hidden_size": 128, "mlp_dim": 128,
    "num_hidden_layers": 3, "n_layer": 3, "num_layers": 3, "n_layers": 3, "decoder_layers": 3, "encoder_layers": 3,
    "num_decoder_layers": 3,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "attention_head_dim": 16, "kv_channels": 16, "d_kv": 16, "d_head": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128, "seq_length": 128,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "ffn_config": None,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "num_selected_experts": 2,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "moe_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 64,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "rotary_dim": 8,
    "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_expand": 2, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 16, "mamba_d_ssm": 64, "mamba_head_dim": 16,
    "state_size": 8, "ssm_state_size": 8, "time_step_rank": 8, "conv_kernel": 4, "chunk_size": 16, "n_groups": 1,
    "use_mamba_kernels": False, "use_cache_kernels": False, "attention_hidden_size": 128,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_codebooks": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32, "vision_output_dim": 64,
    "sliding_window": 64, "attention_window_size": 64,
}
_ZERO_OK: set[str] = set()
_SET.update({"emb_dim": 64, "embedding_dim": 64, "hidden_size_global": 64, "num_blocks": 3,
             "num_layers_per_stack": 1, "encoder_hash_byte_group_vocab": 256, "expert_ffn_hidden_size": 32,
             "zero_expert_num": 2, "router_hidden_size": 32, "n_shared_experts": 1, "num_shared_experts": 1,
             "max_window_layers": 3, "num_dense_layers": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
             "expert_layer_period": 2, "expert_layer_offset": 1, "index_n_heads": 4, "index_head_dim": 16,
             "index_topk": 8, "num_global_layers": 1,
             "vocab_size_per_layer_input": 256, "entity_vocab_size": 256})
_SET.pop("attention_hidden_size", None)
_SET.pop("ffn_config", None)
#: MoE fields set even where the default is None (None there means "unset", not "dense")
_MOE_NONE_OK = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_group", "topk_group", "n_routed_experts",
                "n_shared_experts"}
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
              "sep_token_id": 2, "cls_token_id": 1, "mask_token_id": 3, "unk_token_id": 3}
N_LAYERS = 3
VOCAB = 256
#: per model type, after the generic shrinking (what a generic rule cannot know)
OVERRIDES: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1], [["global"], 1]], "num_layers": 3},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "bamba": {"mamba_n_heads": 8, "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 8, "layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "esmc": {"num_key_value_heads": 4},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
    "zamba": {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1, "attention_head_dim": 32,
              "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid", "linear_attention"],
              "n_mamba_heads": 1},
    "reformer": {"is_decoder": True, "axial_pos_shape": [8, 16], "axial_pos_embds_dim": [32, 32],
                 "attn_layers": ["local", "lsh", "local"], "num_hashes": 1},
}


def _truncate_layers(v, n: int):
    """A per-layer list cut to ``n`` entries, keeping every distinct value (the last entries replaced)."""
    out = list(v[:n])
    missing = []
    for x in v:
        key = json.dumps(x, sort_keys=True, default=str)
        if key not in {json.dumps(y, sort_keys=True, default=str) for y in out} and \
                key not in {json.dumps(y, sort_keys=True, default=str) for y in missing}:
            missing.append(x)
    for i, x in enumerate(missing[: max(0, n - 1)]):
        out[n - 1 - i] = x
    return "".join(out) if isinstance(v, str) else out


def _shrink_dict(d: dict, depth: int = 0, layers: int = N_LAYERS) -> dict:
    """The config dict ``d`` with its size fields shrunk (sub-config dicts too)."""
    old_layers = None
    for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(d.get(k), int) and d[k] > 1:
            old_layers = d[k]
            break
    moe = any(d.get(k) is not None for k in ("n_routed_experts", "num_experts", "num_local_experts",
                                              "moe_intermediate_size"))
    out = dict(d)
    for k, v in d.items():
        if k in _ZERO_OK:
            continue
        if isinstance(v, dict) and depth < 3 and ("model_type" in v or k.endswith("_config")):
            out[k] = _shrink_dict(v, depth + 1, layers)
        elif k in _SET and (v is not None or ((moe or k in ("num_key_value_heads", "head_dim")) and k in _MOE_NONE_OK)) \
                and not isinstance(v, (list, dict)):
            if isinstance(v, bool) != isinstance(_SET[k], bool):
                continue
            if k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") and isinstance(v, int) and v <= 1:
                continue
            out[k] = layers if k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") else _SET[k]
        elif k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("token_ids"):
            out[k] = _fix_token(k, v)
    if "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: rotary over the rope part only
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in d and "num_key_value_heads" in d:  # MLA: one key/value head per query head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    if isinstance(d.get("num_experts_per_tok"), int) and d["num_experts_per_tok"] == 1:
        out["num_experts_per_tok"] = 1
    n = out.get("num_hidden_layers", out.get("n_layer", out.get("num_layers", N_LAYERS)))
    if not isinstance(n, int):
        n = N_LAYERS
    for k, v in d.items():
        if (isinstance(v, list) or (isinstance(v, str) and any(w in k for w in ("pattern", "layer", "block")))) \
                and old_layers and len(v) == old_layers and k not in ("architectures",):
            v = _truncate_layers(v, n)
            if "heads" in k and isinstance(v, list):
                v = [4 if isinstance(x, int) else x for x in v]
            out[k] = v
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
                and ("layer" in k or "layers" in k) and old_layers and max(v) >= n and max(v) < old_layers:
            out[k] = sorted({min(x, n - 1) for x in v if x < n} or {n - 1})
        elif isinstance(v, dict) and v and all(str(x).isdigit() for x in v) and old_layers:
            keep = {x: y for x, y in v.items() if int(x) < n}
            if not keep:
                keep = {n - 1: next(iter(v.values()))}
            out[k] = keep
    if isinstance(out.get("intermediate_size"), list):
        out["intermediate_size"] = [128] * len(out["intermediate_size"])
    return out


def _fix_token(k: str, v):
    if isinstance(v, int):
        if v < VOCAB:
            return v
        return _TOKEN_IDS.get(k, VOCAB - 2 if "image" not in k else VOCAB - 1)
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return [x if x < VOCAB else 2 for x in v] if v else v
    return v


def _diff(tiny: dict, base: dict) -> dict:
    """Only the fields the shrinking changed (derived fields are computed again by the config's __init__);
    sub-config dicts whole."""
    out = {}
    for k, v in tiny.items():
        if k in ("transformers_version", "architectures", "_name_or_path", "model_type"):
            continue
        if isinstance(v, dict) and isinstance(base.get(k), dict) and "model_type" in v:
            sub = _diff(v, base[k])
            if v.get("model_type"):
                sub["model_type"] = v["model_type"]
            out[k] = sub
        elif v != base.get(k, object()):
            out[k] = v
    return out


def tiny_config(cls, model_type: str):
    """A tiny config for model class ``cls``: the config class's defaults with the size fields shrunk."""
    ccls = getattr(cls, "config_class", None)
    if ccls is None:
        raise RuntimeError(f"{cls.__name__} has no config_class")
    base = ccls()
    d = base.to_dict()
    over = OVERRIDES.get(model_type, {})
    tiny = _shrink_dict(d, layers=over.get("num_hidden_layers", N_LAYERS))
    tiny.update(over)
    kw = _diff(tiny, d)
    try:
        cfg = ccls(**kw)
    except Exception:
        # some configs want every field: pass them all
        cfg = ccls(**{k: v for k, v in tiny.items() if k not in ("transformers_version", "architectures",
                                                                  "_name_or_path", "model_type")})
    if hasattr(cfg, "use_mamba_kernels"):
        cfg.use_mamba_kernels = False
    return cfg


# ---------------------------------------------------------------------------------------------- rings


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def streaming_ring_gb(model) -> float:
    """``tests/conftest.py`` ``streaming_ring_gb``: holds the biggest unit (MoE units without their routed
    experts, ``conftest.routed_unit_sizes``), up to ~3 of them, but not the whole model; RuntimeError, not an
    assertion, when there is none."""
    from conftest import routed_unit_sizes

    sizes = routed_unit_sizes(model._tiered.plan)
    big = _page(max(sizes))
    whole = sum(_page(n) for n in sizes)
    ring = max(big, min(3 * big, whole - PAGE))
    if not big <= ring < whole:
        raise RuntimeError(f"no streaming ring: big {big}, whole {whole}")
    return ring / GiB


def below_layer_ring_gb(model) -> float | None:
    """``tests/conftest.py`` ``ring_below_layer`` from the plan: smaller than the largest MoE unit, holding every
    unit without its routed experts (64-byte aligned tensors, a page more). None without a MoE unit."""
    import dataclasses

    from tiered.experts import find_experts, route_out

    plan = model._tiered.plan
    moe, dense = [], []
    for u in plan.units:
        specs = find_experts(u)
        if specs:
            moe.append(u.nbytes)
            u = dataclasses.replace(u, targets=list(u.targets))
            route_out(u, specs, plan.align)
        dense.append(u.nbytes)
    if not moe:
        return None
    layer = max(moe)
    ring = max(layer * 0.6, _page(max(dense)) + PAGE)
    if ring >= layer:
        return None
    return ring / GiB


# ---------------------------------------------------------------------------------------------- one model


def _err(e: BaseException) -> str:
    return f"{type(e).__module__}.{type(e).__name__}: {str(e)[:600]}"


def _tensors(out, prefix="") -> dict:
    import torch

    res = {}
    if isinstance(out, torch.Tensor):
        res[prefix or "out"] = out
    elif isinstance(out, dict):
        for k, v in out.items():
            res.update(_tensors(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            res.update(_tensors(v, f"{prefix}[{i}]"))
    return res


def _compare(a: dict, b: dict) -> tuple[bool, str]:
    import torch

    if set(a) != set(b):
        return False, f"output keys differ: stock {sorted(a)} tiered {sorted(b)}"
    worst = []
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            worst.append(f"{k}: shape/dtype {tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)}/{y.dtype}")
        elif not (torch.equal(x, y) or (x.is_floating_point() and
                                         torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))):
            if x.is_floating_point():
                d = (x.float() - y.float()).abs()
                d = d[~torch.isnan(d)] if torch.isnan(d).any() else d
                worst.append(f"{k}: max abs diff {d.max().item() if d.numel() else 'nan'}")
            else:
                worst.append(f"{k}: {(x != y).sum().item()} elements differ")
    return (not worst), "; ".join(worst)


def _is_tiered_error(e: BaseException) -> bool:
    from tiered.errors import TieredError

    return isinstance(e, TieredError)


def _phase(name: str) -> None:
    print(f"{TAG}PHASE {name}", flush=True)


def run_one(model_type: str, class_name: str, kind: str, workdir: Path) -> dict:
    """Build, save, compare one model class; a result record."""
    import torch
    import transformers

    import tiered
    sys.path.insert(0, str(ROOT / "tests"))
    from models import randomize_  # tests/models.py

    rec: dict = {"class": class_name, "model_type": model_type, "kind": kind}
    torch.manual_seed(0)
    cls = getattr(transformers, class_name, None)
    if cls is None:
        rec.update(status="skipped", reason=f"transformers has no attribute {class_name}")
        return rec
    _phase("config")
    try:
        cfg = tiny_config(cls, model_type)
    except Exception as e:
        rec.update(status="skipped", reason=f"could not build tiny config ({_err(e)})")
        return rec
    is_lm = kind in ("causal", "seq2seq")
    vocab = getattr(cfg.get_text_config(), "vocab_size", None) or VOCAB
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, min(VOCAB, vocab) - 3), (2, 7), generator=g)
    mask = torch.ones_like(ids)

    extra = {"decoder_input_ids": ids[:, :4]} if kind == "seq2seq" else {}

    def forward(m):
        with torch.no_grad():
            return {k: v.detach().clone() for k, v in _tensors(m(input_ids=ids, attention_mask=mask, **extra)).items()}

    def gen(m):
        with torch.no_grad():
            return m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, min_new_tokens=4)

    bf16_note = None
    for dtype in (torch.bfloat16, torch.float32):
        _phase("build")
        try:
            torch.manual_seed(0)
            model = cls(cfg)
            nparams = sum(p.numel() for p in model.parameters())
            rec["params"] = nparams
            if nparams > 40_000_000:
                rec.update(status="skipped", reason=f"tiny config still has {nparams} parameters (a size field "
                           "this script does not shrink)")
                return rec
            randomize_(model, seed=1)
            model.to(dtype)
            model.config.dtype = dtype
            model.eval()
            d = workdir / f"{class_name}_{str(dtype)[6:]}"
            model.save_pretrained(d, max_shard_size="100KB")
            del model
        except Exception as e:
            rec.update(status="skipped", reason=f"could not build/save tiny model ({_err(e)})")
            return rec
        _phase("stock")
        try:
            ref = cls.from_pretrained(d).eval()
            rec["dtype"] = str(next(ref.parameters()).dtype)
            want = forward(ref)
        except Exception as e:
            if dtype == torch.bfloat16:
                bf16_note = f"stock fails in bf16 ({_err(e)[:200]}); run in fp32"
                continue
            rec.update(status="stock_error", reason=f"stock load/forward: {_err(e)}" +
                       (f" (bf16 too: {bf16_note})" if bf16_note else ""))
            return rec
        break
    if bf16_note:
        rec["note_dtype"] = bf16_note
    want_gen, gen_note = None, None
    if is_lm:
        try:
            want_gen = gen(ref)
        except Exception as e:
            gen_note = f"stock generate fails: {_err(e)}"
    del ref

    # tiered: probe for the rings
    _phase("tiered_probe")
    try:
        probe = tiered.load(d, device="cpu", ring_gb=1.0)
        try:
            rings = [("streaming", streaming_ring_gb(probe))]
            below = below_layer_ring_gb(probe)
            if below is not None:
                rings.append(("below_moe_layer", below))
            rec["largest_unit_bytes"] = probe._tiered.plan.max_unit.nbytes
            if below is None:  # the done-when of issue 22: below the largest unit it streams equal or is refused
                rings.append(("below_largest_unit", _page(int(0.6 * rec["largest_unit_bytes"])) / GiB))
            rec["model_bytes"] = sum(u.nbytes for u in probe._tiered.plan.units)
        finally:
            probe.close()
    except Exception as e:
        rec.update(status="tiered_error", phase="probe load (ring_gb=1)", reason=_err(e),
                   refused_before_read=_is_tiered_error(e),
                   traceback=traceback.format_exc()[-2500:])
        return rec

    rec["runs"] = []
    status = "equal"
    for label, ring in rings:
        run = {"ring": label, "ring_gb": ring}
        rec["runs"].append(run)
        _phase(f"tiered_{label}")
        try:
            m = tiered.load(d, device="cpu", ring_gb=ring)
        except Exception as e:
            if label == "below_largest_unit" and isinstance(e, tiered.RingTooSmallError):
                run.update(status="refused", reason=_err(e))  # at placement, before any weight is read
                continue
            run.update(status="tiered_error", phase="load", reason=_err(e), traceback=traceback.format_exc()[-2500:])
            status = "tiered_error" if status == "equal" else status
            continue
        try:
            s = tiered.stats(m)
            run.update(units=s.units, resident_units=s.resident_units, streamed=s.units > s.resident_units,
                       expert_modules=s.expert_modules, row_units=getattr(s, "row_units", None))
            try:
                got = forward(m)
            except Exception as e:
                run.update(status="tiered_error", phase="forward", reason=_err(e),
                           traceback=traceback.format_exc()[-2500:])
                status = "tiered_error" if status == "equal" else status
                continue
            ok, why = _compare(want, got)
            run["forward"] = "equal" if ok else f"DIFFERENT ({why})"
            if not ok:
                status = "DIFFERENT"
            if is_lm and want_gen is not None:
                try:
                    got_gen = gen(m)
                    same = want_gen.shape == got_gen.shape and torch.equal(want_gen, got_gen)
                    run["generate"] = "equal" if same else \
                        f"DIFFERENT (stock {want_gen.tolist()} tiered {got_gen.tolist()})"
                    if not same:
                        status = "DIFFERENT"
                except Exception as e:
                    run.update(generate=f"tiered_error ({_err(e)})", traceback=traceback.format_exc()[-2500:])
                    status = "tiered_error" if status == "equal" else status
            elif is_lm:
                run["generate"] = gen_note
            s = tiered.stats(m)
            run.update(streamed_bytes=s.streamed_bytes, experts_read=s.experts_read)
            run["status"] = "equal" if (run.get("forward") == "equal" and run.get("generate") in ("equal", None,
                                                                                                   gen_note)) else \
                ("DIFFERENT" if "DIFFERENT" in str(run.get("forward")) + str(run.get("generate")) else "tiered_error")
        finally:
            try:
                m.close()
            except Exception:
                pass
    rec["status"] = status
    if gen_note:
        rec["note"] = gen_note
    first = rec["runs"][0]
    rec.update(units=first.get("units"), streamed=first.get("streamed"), ring_gb=first.get("ring_gb"),
               ring_below_largest_unit=min(r["ring_gb"] for r in rec["runs"]) * GiB < rec["largest_unit_bytes"])
    if status != "equal":
        bad = [r for r in rec["runs"] if r.get("status") != "equal"]
        rec["reason"] = "; ".join(f"[{r['ring']}] " + str(r.get("reason") or r.get("forward") if r.get("forward")
                                  != "equal" else r.get("generate")) for r in bad)
    return rec


def _quiet() -> None:
    import warnings

    import torch

    torch.set_num_threads(2)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


def worker(jobs: list[tuple[str, str, str]]) -> None:
    """Run ``jobs`` in this process, one result line each on stdout."""
    _quiet()
    with tempfile.TemporaryDirectory(prefix="arch_sweep_") as tmp:
        for model_type, class_name, kind in jobs:
            print(f"{TAG}START {class_name}", flush=True)
            t0 = time.monotonic()
            try:
                rec = run_one(model_type, class_name, kind, Path(tmp))
            except BaseException as e:  # noqa: BLE001 - a record whatever happens
                rec = {"class": class_name, "model_type": model_type, "kind": kind, "status": "sweep_error",
                       "reason": _err(e), "traceback": traceback.format_exc()[-2500:]}
            rec["seconds"] = round(time.monotonic() - t0, 1)
            print(f"{TAG}RESULT {json.dumps(rec, default=str)}", flush=True)
            import shutil

            for q in Path(tmp).glob(f"{class_name}_*"):
                shutil.rmtree(q, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the sweep


def enumerate_jobs(kinds: list[str]) -> list[tuple[str, str, str]]:
    from transformers.models.auto import modeling_auto as ma

    jobs, seen = [], set()
    for kind, mapping in (("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("seq2seq", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)):
        if kind not in kinds:
            continue
        for mt, name in mapping.items():
            if isinstance(name, (list, tuple)):
                name = name[0]
            if name not in seen:
                seen.add(name)
                jobs.append((mt, name, kind))
    if "encoder" in kinds:
        enc = set()
        for mapping in ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",):
            enc |= set(getattr(ma, mapping, {}))
        for mt, name in ma.MODEL_MAPPING_NAMES.items():
            if isinstance(name, (list, tuple)):
                name = name[0]
            if mt in enc and name not in seen:
                seen.add(name)
                jobs.append((mt, name, "encoder"))
    return jobs


def order_jobs(jobs, priority_first: bool):
    if not priority_first:
        return jobs
    rank = {mt: i for i, mt in enumerate(PRIORITY)}
    return sorted(jobs, key=lambda j: (rank.get(j[0], len(PRIORITY)), jobs.index(j)))


def run_sweep(jobs, *, timeout: float, fresh: bool, budget_s: float, out_path: Path, append: bool) -> list[dict]:
    results: list[dict] = []
    t_start = time.monotonic()
    pending = list(jobs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fout = open(out_path, "a" if append else "w")

    def emit(rec):
        results.append(rec)
        fout.write(json.dumps(rec, default=str) + "\n")
        fout.flush()
        print(f"  {rec['class']:<42} {rec['status']:<13} {rec.get('seconds', '')}s  "
              f"{str(rec.get('reason', ''))[:150]}", file=sys.stderr, flush=True)

    while pending:
        if time.monotonic() - t_start > budget_s:
            for mt, name, kind in pending:
                emit({"class": name, "model_type": mt, "kind": kind, "status": "skipped",
                      "reason": "not run: the sweep's wall-time budget was spent"})
            break
        batch = pending[:1] if fresh else pending
        spec = json.dumps(batch)
        p = subprocess.Popen([sys.executable, __file__, "--worker", spec], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True, bufsize=1)
        current, phase, t0 = None, None, time.monotonic()
        stderr_tail: list[str] = []
        done_names = set()
        os.set_blocking(p.stderr.fileno(), False)
        dead = False
        while True:
            left = timeout - (time.monotonic() - t0)
            if current is not None and left <= 0:
                p.kill()
                p.wait()
                mt, kind = next((j[0], j[2]) for j in pending if j[1] == current)
                emit({"class": current, "model_type": mt, "kind": kind,
                      "status": "tiered_error" if phase and phase.startswith("tiered") else
                      ("stock_error" if phase == "stock" else "skipped"),
                      "reason": f"timeout after {timeout:.0f}s in phase {phase}", "seconds": round(timeout, 1)})
                done_names.add(current)
                dead = True
                break
            r, _, _ = select.select([p.stdout], [], [], max(0.1, min(left, 5.0)) if current else 5.0)
            try:
                err = p.stderr.read()
                if err:
                    stderr_tail = (stderr_tail + err.splitlines())[-40:]
            except (TypeError, BlockingIOError):
                pass
            if not r:
                if p.poll() is not None:
                    pass
                else:
                    continue
            line = p.stdout.readline()
            if not line:
                p.wait()
                if current is not None and current not in done_names:
                    mt, kind = next((j[0], j[2]) for j in pending if j[1] == current)
                    emit({"class": current, "model_type": mt, "kind": kind,
                          "status": "tiered_error" if phase and phase.startswith("tiered") else
                          ("stock_error" if phase == "stock" else "skipped"),
                          "reason": f"process died (exit {p.returncode}) in phase {phase}: "
                                    + " | ".join(stderr_tail[-6:])[-800:],
                          "seconds": round(time.monotonic() - t0, 1)})
                    done_names.add(current)
                    dead = True
                break
            if line.startswith(f"{TAG}START "):
                current, phase, t0 = line.split(" ", 1)[1].strip(), None, time.monotonic()
            elif line.startswith(f"{TAG}PHASE "):
                phase = line.split(" ", 1)[1].strip()
            elif line.startswith(f"{TAG}RESULT "):
                emit(json.loads(line.split(" ", 1)[1]))
                done_names.add(current)
                current = None
                if time.monotonic() - t_start > budget_s:
                    p.kill()
                    p.wait()
                    break
        pending = [j for j in pending if j[1] not in done_names]
        if not dead and not fresh and pending and time.monotonic() - t_start <= budget_s:
            # the worker ended without a START line for the rest: record them
            for mt, name, kind in pending:
                emit({"class": name, "model_type": mt, "kind": kind, "status": "sweep_error",
                      "reason": "worker exited early: " + " | ".join(stderr_tail[-4:])})
            pending = []
    fout.close()
    return results


def summarize(results: list[dict]) -> str:
    from collections import Counter

    c = Counter(r["status"] for r in results)
    below = Counter(run.get("status") for r in results for run in r.get("runs", []) or []
                    if run.get("ring") in ("below_moe_layer", "below_largest_unit"))
    lines = ["", "counts: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())),
             "below the largest unit: " + ", ".join(f"{k} {v}" for k, v in sorted(below.items(), key=str)), "",
             f"| {'class':<40} | {'status':<12} | units | streamed | ring GiB | routed | note",
             f"|{'-' * 42}|{'-' * 14}|-------|----------|----------|--------|------"]
    for r in results:
        routed = ""
        for run in r.get("runs", []) or []:
            if run.get("ring") == "below_moe_layer":
                routed = f"{run.get('expert_modules')} ({run.get('status')})"
            elif run.get("ring") == "below_largest_unit":
                routed = f"below: {run.get('status')}"
        ring = r.get("ring_gb")
        note = "" if r["status"] == "equal" else str(r.get("reason", ""))[:110]
        lines.append(f"| {r['class']:<40} | {r['status']:<12} | {str(r.get('units', '')):>5} | "
                     f"{str(r.get('streamed', '')):>8} | {f'{ring:.6f}' if ring else '':>8} | {routed:>6} | {note}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model types or class names")
    ap.add_argument("--skip", help="comma-separated model types or class names to leave out")
    ap.add_argument("--limit", type=int, help="at most this many classes (after ordering)")
    ap.add_argument("--kinds", default="causal", help="causal, encoder, seq2seq (comma-separated)")
    ap.add_argument("--priority-first", action="store_true", help="popular decoder architectures first")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    ap.add_argument("--budget-min", type=float, default=60.0, help="wall-time budget of the whole sweep (minutes)")
    ap.add_argument("--fresh", action="store_true", help="one process per model")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    ap.add_argument("--list", action="store_true", help="print the classes and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if a.worker:
        worker([tuple(j) for j in json.loads(a.worker)])
        return
    jobs = order_jobs(enumerate_jobs(a.kinds.split(",")), a.priority_first)
    if a.only:
        want = [w.strip() for w in a.only.split(",") if w.strip()]
        jobs = [j for w in want for j in jobs if w in (j[0], j[1])]
    if a.skip:
        drop = {w.strip() for w in a.skip.split(",")}
        jobs = [j for j in jobs if j[0] not in drop and j[1] not in drop]
    if a.limit:
        jobs = jobs[: a.limit]
    if a.list:
        for j in jobs:
            print(*j)
        return
    print(f"{len(jobs)} classes; out {a.out}", file=sys.stderr)
    results = run_sweep(jobs, timeout=a.timeout, fresh=a.fresh, budget_s=a.budget_min * 60, out_path=a.out,
                        append=a.append)
    print(summarize(results))


if __name__ == "__main__":
    main()
