"""Tests of benchmarks/make_checkpoint.py (CPU only, tiny models, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import make_checkpoint as mc  # noqa: E402

SCRIPT = REPO / "benchmarks" / "make_checkpoint.py"
# ~0.5 M parameters per copy of the 8192-token embedding, 11 layers so that "layers.10" sorts
# before "layers.2" inside a file.
TINY = {"arch": "llama-tall", "layers": 11, "scale": 0.0625}


def _meta_state_dict_keys(config) -> list[str]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict().keys())


def _shard_files(out: Path) -> list[Path]:
    index = out / mc.INDEX_NAME
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [out / n for n in names]
    return [out / mc.SINGLE_FILE_NAME]


def _load_all(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _shard_files(out):
        tensors.update(load_file(f))
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {**TINY, "dtype": "bf16"},
        {**TINY, "dtype": "fp32", "seed": 7},
        {"arch": "gptj-6b", "layers": 2, "scale": 0.05, "dtype": "fp16"},
    ],
    ids=["llama-bf16", "llama-fp32", "gptj-fp16"],
)
def test_single_shard_is_byte_identical_to_save_file(tmp_path, kwargs):
    out = mc.make_checkpoint(tmp_path / "ck", **kwargs)
    assert out == (tmp_path / "ck").absolute()
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        mc.MARKER_NAME,
    ]
    ref = tmp_path / "ref.safetensors"
    save_file(mc.generate_state_dict(**kwargs), ref, metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == ref.read_bytes()


def test_sharded_layout_index_and_bytes(tmp_path):
    limit = 300_000
    out = mc.make_checkpoint(tmp_path / "ck", **TINY, max_shard_size="300KB")
    config = mc.build_config(TINY["arch"], dtype="bf16", layers=11, scale=TINY["scale"])
    keys = _meta_state_dict_keys(config)

    assert not (out / "model.safetensors").exists()
    index = json.loads((out / mc.INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(keys)
    assert len(weight_map) == len(keys)

    full = mc.generate_state_dict(**TINY)
    assert list(full) == keys  # state-dict order
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())

    files = _shard_files(out)
    n = len(files)
    assert n > 2
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # Shards follow state-dict order: the file index never decreases along the keys, and a
    # new shard starts only when the next tensor would overflow the current one.
    order = [files.index(out / weight_map[k]) for k in keys]
    assert order == sorted(order)
    for i in range(n):
        members = [k for k in keys if order[keys.index(k)] == i]
        size = sum(full[k].numel() * full[k].element_size() for k in members)
        assert size <= limit or len(members) == 1
        if i + 1 < n:
            first_next = keys[keys.index(members[-1]) + 1]
            nxt = full[first_next].numel() * full[first_next].element_size()
            assert size + nxt > limit
        # Each shard is byte-identical to save_file of its tensors.
        ref = tmp_path / f"ref{i}.safetensors"
        save_file({k: full[k] for k in members}, ref, metadata={"format": "pt"})
        assert files[i].read_bytes() == ref.read_bytes()
        with safe_open(files[i], "pt") as f:
            assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {**TINY, "dtype": "bf16", "max_shard_size": "400KB"},
        {**TINY, "dtype": "fp16", "tie": True},
        {"arch": "gptj-6b", "layers": 2, "scale": 0.05, "dtype": "fp32"},
        {"arch": "gptj-6b", "layers": 1, "scale": 0.05, "dtype": "bf16", "tie": True},
        {"arch": "llama3-8b", "layers": 1, "scale": 0.05, "dtype": "bf16"},
    ],
    ids=["llama-sharded", "llama-tied", "gptj-fp32", "gptj-tied", "llama3-gqa"],
)
def test_from_pretrained_loads_exactly(tmp_path, kwargs):
    from transformers import AutoModelForCausalLM

    out = mc.make_checkpoint(tmp_path / "ck", **kwargs)
    cfg = json.loads((out / "config.json").read_text())
    want_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[kwargs["dtype"]]
    assert cfg["dtype"] == cfg["torch_dtype"] == want_dtype
    arch_name = mc.ARCHS[kwargs["arch"]].architecture
    assert cfg["architectures"] == [arch_name]
    assert cfg["tie_word_embeddings"] is bool(kwargs.get("tie", False))

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype="auto", output_loading_info=True)
    assert type(model).__name__ == arch_name
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info.get("mismatched_keys")

    on_disk = _load_all(out)
    state = model.state_dict()
    tied = {"lm_head.weight"} if kwargs.get("tie") else set()
    assert set(state) - tied == set(on_disk)
    for name, t in on_disk.items():
        assert state[name].dtype == t.dtype, name
        assert torch.equal(_bits(state[name]), _bits(t)), name
        assert t.float().abs().amax() > 0, name
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    # Realistic scales: matrices ~N(0, 0.02), norm weights ~1, biases small.
    mats = [t.float() for t in on_disk.values() if t.dim() == 2]
    assert all(0.015 < m.std() < 0.025 and abs(m.mean()) < 0.005 for m in mats)
    norms = [t.float() for n, t in on_disk.items() if t.dim() == 1 and n.endswith("weight")]
    assert norms and all(0.95 < v.mean() < 1.05 for v in norms)
    biases = [t.float() for n, t in on_disk.items() if n.endswith("bias")]
    assert all(0 < v.abs().max() < 0.1 for v in biases)
    # Tensors of the same shape differ.
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for t in on_disk.values():
        by_shape.setdefault(tuple(t.shape), []).append(t)
    for group in by_shape.values():
        for a, b in zip(group, group[1:], strict=False):
            assert not torch.equal(a, b)

    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        logits = model(ids).logits
        assert torch.isfinite(logits.float()).all()
        gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 7)


def test_real_hyperparameters():
    expect = {
        "gptj-6b": 6_050_882_784,
        "llama3-8b": 8_030_261_248,
        "llama2-13b": 13_015_864_320,
        "llama3-70b": 70_553_706_496,
        "tinyllama-1.1b": 1_100_048_384,
        "llama-tall": 419_480_576,
    }
    for arch, params in expect.items():
        config = mc.build_config(arch, dtype="fp16")
        specs = mc.weight_specs(config)
        assert sum(s.numel for s in specs) == params, arch
        assert [s.name for s in specs] == _meta_state_dict_keys(config)
        assert config.dtype == torch.float16
    g = mc.build_config("gptj-6b", dtype="bf16")
    assert (g.n_embd, g.n_layer, g.n_head, g.rotary_dim, g.vocab_size, g.n_positions) == (
        4096,
        28,
        16,
        64,
        50400,
        2048,
    )
    assert g.tie_word_embeddings is False and g.architectures == ["GPTJForCausalLM"]
    ll = mc.build_config("llama3-8b", dtype="bf16")
    assert (
        ll.hidden_size,
        ll.intermediate_size,
        ll.num_hidden_layers,
        ll.num_attention_heads,
        ll.num_key_value_heads,
        ll.vocab_size,
        ll.rms_norm_eps,
        ll.rope_parameters["rope_theta"],
    ) == (4096, 14336, 32, 32, 8, 128256, 1e-5, 500000.0)
    assert ll.architectures == ["LlamaForCausalLM"] and ll.tie_word_embeddings is False


@pytest.mark.parametrize("arch", list(mc.ARCHS))
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3, 0.1, 0.01])
def test_scale_keeps_shapes_valid(arch, scale):
    full = mc.build_config(arch, dtype="bf16")
    c = mc.build_config(arch, dtype="bf16", scale=scale, layers=3)
    assert c.num_hidden_layers == 3
    head_dim = getattr(full, "head_dim", None) or full.hidden_size // full.num_attention_heads
    if scale != 1.0 and full.hidden_size == full.num_attention_heads * head_dim:
        assert c.hidden_size == c.num_attention_heads * head_dim
    elif scale != 1.0:  # Qwen3-MoE: hidden is not heads x head_dim; the hidden size itself is scaled
        assert c.hidden_size == max(64, round(full.hidden_size * scale / 64) * 64)
    if getattr(full, "moe_intermediate_size", None):  # the experts' size scales too
        assert c.moe_intermediate_size == (full.moe_intermediate_size if scale == 1.0
                                           else max(64, round(full.moe_intermediate_size * scale / 64) * 64))
    assert c.hidden_size % 64 == 0 and c.hidden_size <= full.hidden_size
    inter = getattr(c, "intermediate_size", None) or c.n_inner or 4 * c.hidden_size
    assert inter % 64 == 0
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads)
    assert c.num_attention_heads % kv == 0
    if scale == 1.0:
        assert c.hidden_size == full.hidden_size


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        mc.build_config("gpt2", dtype="bf16")
    with pytest.raises(ValueError, match="dtype"):
        mc.build_config("llama-tall", dtype="int8")
    with pytest.raises(ValueError, match="scale"):
        mc.build_config("llama-tall", dtype="bf16", scale=0)
    with pytest.raises(ValueError, match="scale"):
        mc.build_config("llama-tall", dtype="bf16", scale=1.5)
    with pytest.raises(ValueError, match="layers"):
        mc.build_config("llama-tall", dtype="bf16", layers=0)
    with pytest.raises(ValueError, match="size"):
        mc.make_checkpoint(tmp_path / "x", "llama-tall", max_shard_size="5 parsecs")
    assert not (tmp_path / "x").exists()
    assert mc.parse_size("5GB") == 5 * 10**9
    assert mc.parse_size("500MB") == 500 * 10**6
    assert mc.parse_size("2GiB") == 2 * 2**30
    assert mc.parse_size("1.5gb") == 1_500_000_000
    assert mc.parse_size(1234) == 1234
    with pytest.raises(ValueError):
        mc.parse_size("0MB")


def test_deterministic_per_seed(tmp_path):
    a = mc.make_checkpoint(tmp_path / "a", **TINY, seed=3)
    b = mc.make_checkpoint(tmp_path / "b", **TINY, seed=3)
    c = mc.make_checkpoint(tmp_path / "c", **TINY, seed=4)
    data = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert data[0] == data[1]
    assert data[0] != data[2]


def test_cache_marker(tmp_path, monkeypatch):
    out = mc.make_checkpoint(tmp_path / "ck", **TINY, max_shard_size="5GB")
    marker = json.loads((out / mc.MARKER_NAME).read_text())
    assert marker["params"] == {
        "arch": "llama-tall",
        "dtype": "bf16",
        "layers": 11,
        "scale": 0.0625,
        "seed": 0,
        "tie": False,
        "max_shard_size": 5 * 10**9,
    }
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise AssertionError("a cached checkpoint must not be rewritten")

    monkeypatch.setattr(mc, "_write_shard", boom)
    # Equivalent spellings of the same parameters hit the cache.
    assert mc.make_checkpoint(tmp_path / "ck", **TINY, max_shard_size="5000MB") == out
    assert mc.make_checkpoint(tmp_path / "ck", **TINY, tie=False) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    monkeypatch.undo()

    cli = [sys.executable, str(SCRIPT), "--arch", "llama-tall", "--layers", "11"]
    cli += ["--scale", "0.0625", "--quiet", str(out)]
    r = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before

    # A damaged checkpoint (a shard of the wrong size) is not a cache hit.
    with open(out / "model.safetensors", "ab") as f:
        f.write(b"x")
    with pytest.raises(FileExistsError, match="do not match"):
        mc.make_checkpoint(out, **TINY)


def test_refuses_existing_different_dir(tmp_path):
    out = mc.make_checkpoint(tmp_path / "ck", **TINY)
    with pytest.raises(FileExistsError, match="layers=11"):
        mc.make_checkpoint(out, **{**TINY, "layers": 2})
    with pytest.raises(FileExistsError, match="seed"):
        mc.make_checkpoint(out, **TINY, seed=1)
    assert json.loads((out / mc.MARKER_NAME).read_text())["params"]["layers"] == 11

    cli = [sys.executable, str(SCRIPT), "--arch", "llama-tall", "--layers", "2"]
    cli += ["--scale", "0.0625", "--quiet", str(out)]
    r = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert r.returncode == 1
    assert "--force" in r.stderr

    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="no valid"):
        mc.make_checkpoint(other, **TINY)
    assert (other / "precious.txt").read_text() == "keep me"

    # --force replaces; an empty directory is simply filled.
    mc.make_checkpoint(other, **TINY, force=True)
    assert not (other / "precious.txt").exists()
    assert (other / "model.safetensors").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    mc.make_checkpoint(empty, **TINY)
    assert (empty / "model.safetensors").exists()
    mc.make_checkpoint(out, **{**TINY, "layers": 2}, force=True)
    assert json.loads((out / mc.MARKER_NAME).read_text())["params"]["layers"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = []
    real = mc._write_shard

    def fail_second(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mc, "_write_shard", fail_second)
    with pytest.raises(OSError, match="simulated"):
        mc.make_checkpoint(tmp_path / "ck", **TINY, max_shard_size="300KB")
    assert list(tmp_path.iterdir()) == []


def test_cli_help_and_summary(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    for word in [*mc.ARCHS, "--max-shard-size", "--scale", "--tie", "--no-tie", "GiB"]:
        assert word in r.stdout
    cli = [sys.executable, str(SCRIPT), "--arch", "gptj-6b", "--layers", "1"]
    cli += ["--scale", "0.05", "--dtype", "fp16", "--max-shard-size", "10MB", str(tmp_path / "g")]
    r = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and "shard(s)" in r.stdout
    assert "B/s" in r.stderr  # tqdm progress bar on stderr
    assert (tmp_path / "g" / mc.INDEX_NAME).exists()
    r = subprocess.run([*cli[:-1], "--scale", "2", str(tmp_path / "h")], capture_output=True, text=True)
    assert r.returncode == 2 and "scale" in r.stderr
    assert not (tmp_path / "h").exists()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_rss_is_bounded(tmp_path):
    """A ~300 MB checkpoint is generated with far less than 300 MB of extra memory."""
    code = textwrap.dedent(
        f"""
        import gc, json, sys
        sys.path.insert(0, {str(REPO)!r})
        from benchmarks import make_checkpoint as mc

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
            raise KeyError(key)

        kw = dict(arch="llama-tall", layers=8, dtype="bf16")
        # Warm up the imports done lazily by transformers (config and modeling modules).
        mc.weight_specs(mc.build_config(kw["arch"], dtype="bf16", layers=8))
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        base = status("VmRSS")
        out = mc.make_checkpoint({str(tmp_path / "big")!r}, **kw, max_shard_size="200MB")
        peak = status("VmHWM")
        size = json.loads((out / mc.MARKER_NAME).read_text())["total_size"]
        print(json.dumps({{"base": base, "peak": peak, "size": size}}))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    growth = res["peak"] - res["base"]
    assert res["size"] > 280e6
    assert growth < 150e6, f"peak RSS grew by {growth / 1e6:.0f} MB"
    # 2 shards, the index, config.json, generation_config.json, the marker
    assert len(os.listdir(tmp_path / "big")) == 6


def test_fp8_checkpoint_decodes_as_stock_dequantizes_it(tmp_path):
    """``quant="fp8"`` (issue 24's benchmarks): every linear weight is e4m3 codes (no NaN) with a float32 block-scale
    grid, the rest keeps its dtype; stock's dequantized model and tiered give the same logits, and the decoded weights
    have the spread of the bf16 checkpoint's matrices."""
    import transformers

    import tiered

    out = mc.make_checkpoint(tmp_path / "f8", "llama3-8b", layers=2, scale=0.125, quant="fp8")
    sd = load_file(out / "model.safetensors")
    codes = {k: v for k, v in sd.items() if v.dtype == torch.float8_e4m3fn}
    assert len(codes) == 2 * 7 and all(k + "_scale_inv" in sd for k in codes)
    assert all(((v.view(torch.uint8) & 0x7F) != 0x7F).all() for v in codes.values())
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    assert 0.015 < ref.model.layers[0].mlp.gate_proj.weight.float().std().item() < 0.025
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad(), tiered.load(out) as m:
        assert torch.equal(m(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="stacked FP8 experts"):
        mc.make_checkpoint(tmp_path / "moe", "qwen3-30b-a3b", layers=1, scale=0.1, quant="fp8")
    with pytest.raises(ValueError, match="none of its 7 linear weights"):  # nothing would be FP8: refused
        mc.make_checkpoint(tmp_path / "tiny", "tinyllama-1.1b", layers=1, scale=0.1, quant="fp8")
    assert mc.make_checkpoint(tmp_path / "f8", "llama3-8b", layers=2, scale=0.125, quant="fp8") == out  # cached


def test_per_expert_fp8_moe_loads_as_stock_dequantizes_it(tmp_path):
    """``experts="per-expert"`` writes Qwen3-MoE's experts one tensor per expert and projection, as the hub's
    Qwen3-*-FP8 checkpoints; with ``quant="fp8"`` each expert's projections are codes with their own block scales
    (issue 24's MoE target). Stock's dequantized model and tiered (experts routed, decoded per expert) agree."""
    import transformers

    import tiered

    out = mc.make_checkpoint(tmp_path / "q8", "qwen3-30b-a3b", layers=1, scale=0.1875, quant="fp8", experts="per-expert")
    sd = load_file(out / "model.safetensors")
    for j in (0, 127):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            k = f"model.layers.0.mlp.experts.{j}.{proj}.weight"
            assert sd[k].dtype == torch.float8_e4m3fn and k + "_scale_inv" in sd
    assert not any(k.endswith("experts.gate_up_proj") for k in sd)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad(), tiered.load(out, ring_gb=0.2) as m:
        assert tiered.stats(m).expert_modules == 1
        assert torch.equal(m(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="no stacked experts"):
        mc.make_checkpoint(tmp_path / "d", "llama3-8b", layers=1, scale=0.125, experts="per-expert")


def test_mxfp4_gpt_oss_checkpoint_loads_as_stock_dequantizes_it(tmp_path):
    """``quant="mxfp4"`` (issue 24's gpt-oss target): the experts as gpt-oss ships them (``_blocks`` e2m1, ``_scales``
    E8M0 117..123), the rest in bf16; stock's dequantized model and tiered (experts routed) agree."""
    import transformers

    import tiered

    out = mc.make_checkpoint(tmp_path / "g", "gpt-oss-120b", layers=1, scale=0.125, quant="mxfp4")
    sd = load_file(out / "model.safetensors")
    b, s = sd["model.layers.0.mlp.experts.down_proj_blocks"], sd["model.layers.0.mlp.experts.down_proj_scales"]
    assert b.dtype == s.dtype == torch.uint8 and b.shape[-1] == 16 and tuple(s.shape) == tuple(b.shape[:-1])
    assert len(torch.unique(b)) == 256 and int(s.min()) >= 117 and int(s.max()) <= 123
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad(), tiered.load(out, ring_gb=0.05) as m:
        assert tiered.stats(m).expert_modules == 1
        assert torch.equal(m(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="gpt-oss"):
        mc.make_checkpoint(tmp_path / "l", "llama3-8b", layers=1, scale=0.125, quant="mxfp4")
