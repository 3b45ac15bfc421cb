"""Quantized checkpoints (issue 24): block-scaled FP8 decoded bit for bit as stock transformers dequantizes it
(``FineGrainedFP8Config(dequantize=True)``), every other ``quantization_config`` refused before a weight is read,
and codes or scales that do not fit refused with the file, tensor and offset."""

from __future__ import annotations

import json
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import logits_of, make_ids, streaming_ring_gb
from safetensors.torch import load_file, save_file

import tiered
from tiered.errors import QuantizationError


def _stock_dequantized(path: Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Stock's dequantized model: what ``from_pretrained`` does on a machine without a GPU, asked explicitly (so it
    is the same on the GPU machine)."""
    kw: dict = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)}
    if dtype is not None:
        kw["dtype"] = dtype
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def _ring(path: Path) -> float:
    """A ring (GiB) that streams ``path``'s model (:func:`conftest.streaming_ring_gb` of a probe load)."""
    with tiered.load(path) as probe:
        return streaming_ring_gb(probe)


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return models.fp8_block(models.llama(root / "bf16"), root / "fp8")


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8moe")
    return models.fp8_block(models.qwen3_moe(root / "bf16"), root / "fp8", skip=("lm_head", "mlp.gate."))


def test_the_test_checkpoint_holds_codes_and_scales(fp8_llama: Path) -> None:
    keys = models.checkpoint_keys(fp8_llama)
    codes = [k for k in keys if k + "_scale_inv" in keys]
    assert len(codes) == 4 * 7 and "lm_head.weight_scale_inv" not in keys
    cfg = json.loads((fp8_llama / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "io": "pread"},
                                {"ring_gb": "stream", "io": "mmap", "host_gb": 0}],
                         ids=["defaults", "streamed-direct", "streamed-pread", "streamed-mmap"])
def test_block_fp8_logits_equal_stock_dequantized(fp8_llama: Path, kw: dict) -> None:
    ids = make_ids(0, (2, 9))
    ref = logits_of(_stock_dequantized(fp8_llama), ids)
    kw = {**kw, "ring_gb": _ring(fp8_llama)} if kw else kw
    with tiered.load(fp8_llama, **kw) as m:
        assert m.dtype == torch.bfloat16
        got = logits_of(m, ids)
        snap = tiered.stats(m).snapshot()
        if kw:
            assert snap["streamed_bytes"] > 0
    assert torch.equal(got, ref)
    if not kw:  # loaded once: every code tensor decoded once, into its 2-byte weight
        from tiered.cli import inspect_dir

        q = inspect_dir(fp8_llama)["quantized"]
        assert snap["decoded_bytes"] == q["decoded_bytes"] and snap["read_bytes"] < 2 * q["decoded_bytes"]
    else:
        assert snap["decoded_bytes"] > 0


def test_block_fp8_decodes_to_the_dtype_asked_for(fp8_llama: Path) -> None:
    ids = make_ids(1, (1, 6))
    ref = logits_of(_stock_dequantized(fp8_llama, torch.float32), ids)
    with tiered.load(fp8_llama, dtype=torch.float32, ring_gb=2 * _ring(fp8_llama)) as m:
        assert torch.equal(logits_of(m, ids), ref)


def test_block_fp8_moe_experts_equal_stock_dequantized(fp8_qwen3_moe: Path) -> None:
    keys = models.checkpoint_keys(fp8_qwen3_moe)
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in keys
    ids = make_ids(2, (2, 7))
    ref = logits_of(_stock_dequantized(fp8_qwen3_moe), ids)
    ring = _ring(fp8_qwen3_moe)
    for kw in ({}, {"ring_gb": ring, "io": "direct"}, {"ring_gb": ring, "io": "mmap"}, {"ring_gb": ring, "host_gb": 1}):
        with tiered.load(fp8_qwen3_moe, **kw) as m:
            assert torch.equal(logits_of(m, ids), ref), kw
            snap = tiered.stats(m).snapshot()
            if "io" in kw:  # streamed: the router's experts are read and decoded alone, codes and scales
                assert snap["experts_read"] > 0 and snap["expert_bytes"] > 0 and snap["streamed_bytes"] > 0, snap
                spec = m._tiered.experts[0].spec
                assert spec.expert_src_bytes < spec.expert_bytes  # stored: 1-byte codes + scales; decoded: bf16
            elif "host_gb" in kw:  # the host tier holds every expert, decoded once at load
                assert snap["experts_from_host"] > 0 and snap["experts_read"] == 0, snap


def test_routed_fp8_experts_keep_their_scales_beside_them_after_reshard(fp8_qwen3_moe: Path, tmp_path: Path) -> None:
    """``tiered reshard`` writes each FP8 expert's codes and block scales together (one range per expert), and the
    output streams to the same logits."""
    from tiered.reshard import reshard

    reshard(fp8_qwen3_moe, tmp_path / "out", quiet=True)
    order: list[str] = []
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        raw = f.read_bytes()
        h = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])
        order += [k for _, k in sorted((v["data_offsets"][0], k) for k, v in h.items() if k != "__metadata__")]
    for i, k in enumerate(order):
        if ".experts." in k and k.endswith("proj.weight"):
            assert order[i + 1] == k + "_scale_inv", order[i: i + 3]
    ids = make_ids(2, (2, 7))
    with tiered.load(tmp_path / "out", ring_gb=_ring(tmp_path / "out")) as m:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_dequantized(fp8_qwen3_moe), ids))
        assert tiered.stats(m).snapshot()["experts_read"] > 0


def test_the_unused_warning_does_not_name_scales(fp8_llama: Path, recwarn: pytest.WarningsRecorder) -> None:
    with tiered.load(fp8_llama) as m:
        assert not m._tiered.plan.unused
    assert not [w for w in recwarn if "not used" in str(w.message)]


class _Lin(torch.nn.Module):
    def __init__(self, rows: int, cols: int, lead: int = 0) -> None:
        super().__init__()
        shape = (lead, rows, cols) if lead else (rows, cols)
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.transpose(-1, -2)


def _one_tensor_dir(path: Path, codes: torch.Tensor, scale: torch.Tensor, block) -> Path:
    path.mkdir()
    save_file({"proj.weight": codes, "proj.weight_scale_inv": scale}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": list(block) if block else None}}))
    return path


def _blockwise(codes: torch.Tensor, scale: torch.Tensor, block, dtype=torch.bfloat16) -> torch.Tensor:
    """The reference decode, block by block (independent of tiered's row bands): each element's float32 code
    times its block's float32 scale, rounded once to ``dtype``."""
    rows, cols = codes.shape
    bm, bn = block
    out = torch.empty(rows, cols, dtype=dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = codes[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float() * scale[i, j].float()
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = blk.to(dtype)
    return out


@pytest.mark.parametrize("io", ["mmap", "direct"])
@pytest.mark.parametrize("rows,cols,block", [(200, 72, (64, 32)), (129, 300, (128, 128)), (4100, 130, (128, 128)),
                                             (3000, 1500, (4096, 128))],
                         ids=["200x72", "129x300", "4100x130", "bands-inside-one-block-row"])
def test_shapes_the_block_does_not_divide_decode_as_the_block_says(tmp_path: Path, rows: int, cols: int, block,
                                                                    io: str) -> None:
    """The grid is ceil(rows / block) x ceil(cols / block): the last blocks are short. Stock 5.17's dequantize
    derives the block from the grid (rows // grid rows) and refuses or misplaces scales here; the kernels and
    DeepSeek's reference use the config's block, as tiered does. 4100 rows: several decode bands; 3000 x 1500 with a
    4096-row block: bands of 2 MiB start inside the one block row."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.05
    codes, scale = models.quantize_fp8_block(w, block)
    d = _one_tensor_dir(tmp_path / "ckpt", codes, scale, block)
    m = tiered.attach(_Lin(rows, cols), d, io=io, ring_gb=0.05)
    try:
        x = torch.eye(cols, dtype=torch.bfloat16)
        with torch.no_grad():
            got = m(x).transpose(0, 1)  # x @ W.T with x = I: W itself
        assert torch.equal(got, _blockwise(codes, scale, block))
    finally:
        tiered.close(m)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_block_fp8_equals_stocks_own_dequantize_per_scale_dtype(tmp_path: Path, scale_dtype: torch.dtype) -> None:
    """Against transformers' ``Fp8Dequantize._dequantize_one`` itself: float32, bfloat16 and E8M0 (uint8
    exponent) scales, and a stack of matrices (experts stored fused, scales per matrix)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(7)
    codes = (torch.randn(3, 96, 64, generator=g) * 40).to(torch.float8_e4m3fn)
    if scale_dtype == torch.uint8:
        scale = torch.randint(110, 135, (3, 3, 2), generator=g, dtype=torch.uint8)
    else:
        scale = (torch.rand(3, 3, 2, generator=g) * 0.01 + 1e-4).to(scale_dtype)
    ref = Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=torch.bfloat16)
    d = _one_tensor_dir(tmp_path / "ckpt", codes, scale, (32, 32))
    m = tiered.attach(_Lin(96, 64, lead=3), d, ring_gb=0.05)
    try:
        with torch.no_grad():
            got = m(torch.eye(64, dtype=torch.bfloat16)).transpose(-1, -2)
        assert got.abs().sum() > 0 and torch.equal(got, ref)
    finally:
        tiered.close(m)


def _truncate_data(path: Path) -> None:
    """Cut every shard after its header: a valid header whose tensor data is gone, so any weight read fails."""
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[: 8 + n + 16])


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "fbgemm_fp8", "torchao"])
def test_other_quantization_methods_are_refused_before_any_weight_is_read(tmp_path: Path, method: str) -> None:
    d = models.llama(tmp_path / "m", max_shard_size=None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    _truncate_data(d)
    with pytest.raises(QuantizationError, match=f"quant_method='{method}'.*does not decode") as e:
        tiered.load(d)
    assert "config.json" in str(e.value) and "To run it" in str(e.value)


def test_scales_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    d = models.fp8_block(models.llama(tmp_path / "bf16"), tmp_path / "fp8", config=False)
    with pytest.raises(QuantizationError, match=r"model\.safetensors|\.safetensors.*block scales.*no fp8 "
                                                r"quantization_config") as e:
        tiered.load(d)
    assert "_scale_inv" in str(e.value) and "offset" in str(e.value)


def test_a_scale_grid_that_fits_no_block_is_refused(tmp_path: Path) -> None:
    codes, _ = models.quantize_fp8_block(torch.randn(64, 64) * 0.1, (32, 32))
    d = _one_tensor_dir(tmp_path / "ckpt", codes, torch.full((3, 5), 0.01), (32, 32))
    with pytest.raises(QuantizationError, match=r"model\.safetensors: scale 'proj\.weight_scale_inv' at offset \d+ "
                                                r"is a 3 x 5 grid"):
        tiered.attach(_Lin(64, 64), d)


def test_fp8_embeddings_are_refused(tmp_path: Path) -> None:
    d = models.fp8_block(models.llama(tmp_path / "bf16"), tmp_path / "fp8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_convert"] = ["embed_tokens"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match="modules_to_convert"):
        tiered.load(d)


def test_codes_that_are_not_float8_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"proj.weight": torch.randn(64, 64).to(torch.bfloat16), "proj.weight_scale_inv": torch.ones(2, 2)},
              d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                       "weight_block_size": [32, 32]}}))
    with pytest.raises(QuantizationError, match="torch.bfloat16 and block scales"):
        tiered.attach(_Lin(64, 64), d)
    assert load_file(d / "model.safetensors")["proj.weight"].dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "host_gb": 0.01}],
                         ids=["resident", "streamed", "host-tier"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_cuda_block_fp8_equals_stock_dequantized_on_the_gpu(request: pytest.FixtureRequest, name: str, kw: dict) -> None:
    """On the GPU, against stock's dequantized model on the same GPU (``FineGrainedFP8Config(dequantize=True)``:
    stock decodes at load on the CPU, then moves the weights; tiered decodes on a reader thread into the ring slot)."""
    path = request.getfixturevalue("fp8_llama" if name == "llama" else "fp8_qwen3_moe")
    ids = make_ids(3, (2, 8))
    ref_model = _stock_dequantized(path).to("cuda")
    ref = logits_of(ref_model, ids.cuda())
    del ref_model
    kw = {**kw, "ring_gb": _ring(path)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(path, device="cuda", gpu_gb=0 if kw else None, **kw) as m:
        got = logits_of(m, ids.cuda())
    assert torch.equal(got, ref)


def test_inspect_shows_stored_and_decoded_bytes(fp8_llama: Path) -> None:
    from tiered.cli import inspect_dir

    q = inspect_dir(fp8_llama)["quantized"]
    assert q["method"] == "fp8" and q["block"] == [32, 32] and q["tensors"] == 4 * 7 and q["dtype"] == "bfloat16"
    codes = sum(v.numel() for f in fp8_llama.glob("*.safetensors") for k, v in load_file(f).items()
                if v.dtype == torch.float8_e4m3fn)
    scales = sum(v.nbytes for f in fp8_llama.glob("*.safetensors") for k, v in load_file(f).items()
                 if k.endswith("_scale_inv"))
    assert q["stored_bytes"] == codes + scales and q["decoded_bytes"] == 2 * codes


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_code_decodes_as_stock_decodes_it(code_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """All 256 codes (NaN, infinities, subnormals, both zeros) in every block, against stock's
    ``Fp8Dequantize._dequantize_one`` byte for byte (NaN payloads included)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from tiered.quant import decode_rows

    raw = (torch.arange(256)[None, :] + 37 * torch.arange(96)[:, None]) % 256  # 96 x 256, rows shifted
    assert raw[:32, :32].unique().numel() == 256  # every code in the first block (and the others alike)
    codes = raw.to(torch.uint8).view(code_dtype)
    scale = torch.rand(3, 8, generator=torch.Generator().manual_seed(5)) * 4 + 1e-3
    ref = Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=out_dtype)
    for row0 in (0, 32, 64):  # a band starting at each block row
        out = torch.empty(96 - row0, 256, dtype=out_dtype)
        decode_rows(codes[row0:], scale, (32, 32), row0, out)
        assert torch.equal(out.view(torch.uint8), ref[row0:].view(torch.uint8))


def _split_scales(src: Path, dst: Path) -> Path:
    """``src`` (one ``model.safetensors``) with its scale tensors moved to a shard of their own, plus an index."""
    import shutil

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    sd = load_file(src / "model.safetensors")
    scales = {k: v for k, v in sd.items() if k.endswith("_scale_inv")}
    save_file({k: v for k, v in sd.items() if k not in scales}, dst / "codes.safetensors", metadata={"format": "pt"})
    save_file(scales, dst / "scales.safetensors", metadata={"format": "pt"})
    wmap = {k: ("scales" if k in scales else "codes") + ".safetensors" for k in sd}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return dst


def test_a_scale_shard_rewritten_under_a_loaded_model_is_an_error(tmp_path: Path) -> None:
    """The shard of the scales is checked like the shard of the codes (a review found it was not: new scales were
    decoded silently)."""
    one = models.fp8_block(models.llama(tmp_path / "bf16", max_shard_size=None), tmp_path / "fp8")
    d = _split_scales(one, tmp_path / "split")
    ids = make_ids(4, (1, 5))
    with tiered.load(d, ring_gb=_ring(d), io="pread") as m:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_dequantized(one), ids))
        f = d / "scales.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-4:] = bytes(4)  # another last scale, same size
        tmp = d / "scales.new"
        tmp.write_bytes(bytes(raw))
        tmp.replace(f)
        with pytest.raises(tiered.ShardChangedError, match="scales.safetensors"):
            logits_of(m, ids)


def test_scales_named_dot_scale_decode_as_stock_renames_them(tmp_path: Path) -> None:
    """DeepSeek-V4-Flash names a weight's block scales ``X.scale``; stock renames them to ``X.weight_scale_inv``.
    The loader decodes them, and the converter keeps them exact under --dtype."""
    from tiered.reshard import reshard

    one = models.fp8_block(models.llama(tmp_path / "bf16", max_shard_size=None), tmp_path / "fp8")
    d = tmp_path / "dot"
    d.mkdir()
    (d / "config.json").write_text((one / "config.json").read_text())
    sd = load_file(one / "model.safetensors")
    save_file({(k[: -len("weight_scale_inv")] + "scale" if k.endswith("_scale_inv") else k): v for k, v in sd.items()},
              d / "model.safetensors", metadata={"format": "pt"})
    ids = make_ids(5, (1, 6))
    ref = logits_of(_stock_dequantized(one), ids)
    assert torch.equal(logits_of(_stock_dequantized(d), ids), ref)
    with tiered.load(d, ring_gb=_ring(d)) as m:
        assert torch.equal(logits_of(m, ids), ref)
    reshard(d, tmp_path / "out", dtype="fp16", quiet=True)
    out = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    scales = [k for k in out if k.endswith(".scale")]
    assert len(scales) == 4 * 7 and all(out[k].dtype == torch.float32 and torch.equal(out[k], sd[k[:-5] + "weight_scale_inv"])
                                        for k in scales)


class _Block(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, with_scale: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(torch.empty(64, 64, dtype=dtype, device="meta"), requires_grad=False)
        if with_scale:
            self.proj.weight_scale_inv = torch.nn.Parameter(torch.empty(2, 2, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [self.proj.weight.float().clone()]
        if hasattr(self.proj, "weight_scale_inv"):
            out.append(self.proj.weight_scale_inv.float().clone())
        return out


class _Raw(torch.nn.Module):
    """Blocks whose forward returns their weight (and scale) as float32: what was bound, seen from outside."""

    def __init__(self, n: int, dtype: torch.dtype, with_scale: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dtype, with_scale) for _ in range(n))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [t for b in self.blocks for t in b(x)]


def _raw_dir(path: Path, n: int) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {}
    for i in range(n):
        codes, scale = models.quantize_fp8_block(torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) * 0.1,
                                                 (32, 32))
        sd[f"blocks.{i}.proj.weight"], sd[f"blocks.{i}.proj.weight_scale_inv"] = codes, scale
    path.mkdir()
    save_file(sd, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                          "weight_block_size": [32, 32]}}))
    return path, sd


@pytest.mark.parametrize("kw", [{}, {"io": "mmap", "host_gb": 0}], ids=["ring", "mapped"])
def test_a_float8_parameter_gets_decoded_codes_wherever_it_streams(tmp_path: Path, kw: dict) -> None:
    """A module whose weight is itself float8 gets stock's ``_dequantize_one(..., output_dtype=float8)``, also when
    its unit would compute on the file mapping (CPU zero copy: a review found the raw codes bound there)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    d, sd = _raw_dir(tmp_path / "ckpt", 4)
    m = tiered.attach(_Raw(4, torch.float8_e4m3fn), d, ring_gb=2 * 4096 / 2**30, **kw)
    try:
        with torch.no_grad():
            got = m(torch.zeros(1))
        for i in range(4):
            want = Fp8Dequantize(None)._dequantize_one(sd[f"blocks.{i}.proj.weight"],
                                                       sd[f"blocks.{i}.proj.weight_scale_inv"],
                                                       output_dtype=torch.float8_e4m3fn)
            assert torch.equal(got[i], want.float())
        assert tiered.stats(m).snapshot()["streamed_bytes"] > 0
    finally:
        tiered.close(m)


def test_a_module_that_holds_its_scales_gets_the_codes_as_stored(tmp_path: Path) -> None:
    """An FP8Linear-like module (float8 weight and a ``weight_scale_inv`` parameter) decodes itself: tiered binds
    codes and scales as stored (a review found them decoded, then scaled again); a bf16 weight beside a scale
    parameter is refused."""
    d, sd = _raw_dir(tmp_path / "ckpt", 2)
    m = tiered.attach(_Raw(2, torch.float8_e4m3fn, with_scale=True), d)
    try:
        with torch.no_grad():
            got = m(torch.zeros(1))
        for i in range(2):
            assert torch.equal(got[2 * i], sd[f"blocks.{i}.proj.weight"].float())
            assert torch.equal(got[2 * i + 1], sd[f"blocks.{i}.proj.weight_scale_inv"])
    finally:
        tiered.close(m)
    with pytest.raises(QuantizationError, match="are a parameter of the model"):
        tiered.attach(_Raw(2, torch.bfloat16, with_scale=True), d)


def test_a_config_object_with_the_method_as_an_enum_is_read(fp8_llama: Path) -> None:
    """``config.quantization_config`` may be transformers' config object (``quant_method`` an enum), not a dict."""
    from tiered.meta import meta_model_from_dir

    model = meta_model_from_dir(fp8_llama)
    model.config.quantization_config = transformers.FineGrainedFP8Config(weight_block_size=[32, 32])
    ids = make_ids(6, (1, 5))
    m = tiered.attach(model, fp8_llama)
    try:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_dequantized(fp8_llama), ids))
    finally:
        tiered.close(m)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4")
    return models.mxfp4_experts(models.gpt_oss(root / "bf16"), root / "mxfp4")


def _stock_mxfp4(path: Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    kw: dict = {"quantization_config": transformers.Mxfp4Config(dequantize=True)}
    if dtype is not None:
        kw["dtype"] = dtype
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "io": "mmap"},
                                {"dtype": torch.float32}],
                         ids=["defaults", "streamed-direct", "streamed-mmap", "float32"])
def test_mxfp4_experts_equal_stock_dequantized(mxfp4_gpt_oss: Path, kw: dict) -> None:
    """gpt-oss's MXFP4 experts (``_blocks`` + ``_scales``) decode with transformers' own ``convert_moe_packed_tensors``
    per band of rows on the reader threads: logits equal ``from_pretrained(..., Mxfp4Config(dequantize=True))``. At
    float32 stock keeps the decoded experts in bf16 (its op returns a bf16 Parameter); so does tiered."""
    ids = make_ids(7, (2, 6))
    ref_model = _stock_mxfp4(mxfp4_gpt_oss, kw.get("dtype"))
    ref = logits_of(ref_model, ids)
    kw = {**kw, "ring_gb": _ring(mxfp4_gpt_oss)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(mxfp4_gpt_oss, **kw) as m:
        assert torch.equal(logits_of(m, ids), ref)
        assert not m._tiered.plan.unused
        e = m.model.layers[0].mlp.experts
        assert e.gate_up_proj.dtype == ref_model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
        snap = tiered.stats(m).snapshot()
        assert snap["decoded_bytes"] > 0 and ("io" not in kw or snap["streamed_bytes"] > 0)
        if "io" in kw:  # streamed: the experts are routed, each call reads and decodes only its experts' blocks
            assert snap["expert_modules"] == m.config.num_hidden_layers and 0 < snap["experts_read"]
            assert snap["expert_bytes"] < snap["experts_read"] * m._tiered.experts[0].spec.expert_bytes


def test_mxfp4_blocks_without_scales_or_of_the_wrong_shape_are_refused(mxfp4_gpt_oss: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(mxfp4_gpt_oss, d)
    f = next(f for f in d.glob("*.safetensors") if any(k.endswith("gate_up_proj_scales") for k in load_file(f)))
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("gate_up_proj_scales"))
    bad = dict(sd)
    bad[key] = sd[key][:, :, :1].contiguous() if sd[key].shape[2] > 1 else sd[key][:, :-1].contiguous()
    save_file(bad, f, metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match=r"does not decode to"):
        tiered.load(d)
    del bad[key]
    save_file(bad, f, metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        j = json.loads(idx.read_text())
        del j["weight_map"][key]
        idx.write_text(json.dumps(j))
    with pytest.raises(QuantizationError, match=r"holds MXFP4 codes but the checkpoint has no"):
        tiered.load(d)


def test_mxfp4_reshard_keeps_blocks_and_scales(mxfp4_gpt_oss: Path, tmp_path: Path) -> None:
    from tiered.cli import inspect_dir
    from tiered.reshard import reshard

    reshard(mxfp4_gpt_oss, tmp_path / "out", dtype="bf16", quiet=True)
    src = {k: v for f in mxfp4_gpt_oss.glob("*.safetensors") for k, v in load_file(f).items()}
    out = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(out) == set(src)
    assert all(torch.equal(out[k], src[k]) for k in src if k.endswith(("_blocks", "_scales")))
    ids = make_ids(8, (1, 5))
    with tiered.load(tmp_path / "out") as m:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_mxfp4(mxfp4_gpt_oss), ids))
    q = inspect_dir(tmp_path / "out")["quantized"]
    assert q["method"] == "mxfp4" and q["tensors"] == 3 * 2 and q["stored_bytes"] < q["decoded_bytes"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}], ids=["resident", "streamed"])
def test_cuda_mxfp4_experts_equal_stock_dequantized_on_the_gpu(mxfp4_gpt_oss: Path, kw: dict) -> None:
    ids = make_ids(9, (2, 6))
    ref = logits_of(_stock_mxfp4(mxfp4_gpt_oss).to("cuda"), ids.cuda())
    kw = {**kw, "ring_gb": _ring(mxfp4_gpt_oss)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(mxfp4_gpt_oss, device="cuda", gpu_gb=0 if kw else None, **kw) as m:
        assert torch.equal(logits_of(m, ids.cuda()), ref)


@pytest.mark.parametrize("io", ["mmap", "direct"])
@pytest.mark.parametrize("layout", ["column-slice", "transposed", "other-shape"])
def test_a_strided_destination_is_decoded_band_by_band(tmp_path: Path, io: str, layout: str) -> None:
    """A placed FP8 source whose slice of the fused tensor is not contiguous (a concatenation along a later dim) is
    decoded band by band into its strided rows (a review found a whole-tensor temporary per thread); a destination
    whose strides cannot take the source's shape goes through one temporary. Equal to stock's ``_dequantize_one``."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from tiered.format import open_checkpoint
    from tiered.quant import Fp8Block
    from tiered.reader import Reader

    g = torch.Generator().manual_seed(11)
    codes = (torch.randn(2, 96, 64, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, 2, generator=g) * 0.01 + 1e-4
    d = _one_tensor_dir(tmp_path / "ckpt", codes, scale, (32, 32))
    ref = Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=torch.bfloat16)
    if layout == "column-slice":
        base = torch.zeros(2, 96, 128, dtype=torch.bfloat16)
        dest = base[:, :, 32:96]
    elif layout == "transposed":
        base = torch.zeros(2, 64, 96, dtype=torch.bfloat16)
        dest = base.transpose(1, 2)
    else:
        base = torch.zeros(64, 192, dtype=torch.bfloat16)
        dest = base.t()  # (192, 64), strides that (2, 96, 64) cannot view
    assert not dest.is_contiguous()
    ck = open_checkpoint(d)
    r = Reader(ck, io=io)
    try:
        src = ck.tensors["proj.weight"]
        r.copy_all(type("U", (), {"name": "u"})(), [(src, dest, Fp8Block(ck.tensors["proj.weight_scale_inv"],
                                                                           (32, 32)))])
    finally:
        r.close()
    assert torch.equal(dest.reshape(ref.shape), ref)
    if layout == "column-slice":
        assert not base[:, :, :32].any() and not base[:, :, 96:].any()


def test_a_plain_tensor_beside_mxfp4_blocks_wins_as_in_stock(mxfp4_gpt_oss: Path, tmp_path: Path) -> None:
    """A checkpoint holding both ``experts.gate_up_proj`` and its ``_blocks``/``_scales``: stock loads the plain
    tensor and leaves the blocks unused; so does tiered (a review found the blocks decoded instead)."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(mxfp4_gpt_oss, d)
    f = next(f for f in d.glob("*.safetensors") if any(k.endswith("layers.0.mlp.experts.gate_up_proj_blocks")
                                                        for k in load_file(f)))
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("layers.0.mlp.experts.gate_up_proj_blocks"))[: -len("_blocks")]
    e, rows, groups, _ = sd[key + "_blocks"].shape
    sd[key] = torch.randn(e, groups * 32, rows, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) * 0.1
    save_file(sd, f, metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        j = json.loads(idx.read_text())
        j["weight_map"][key] = f.name
        idx.write_text(json.dumps(j))
    ids = make_ids(10, (1, 5))
    with pytest.warns(UserWarning, match="gate_up_proj_blocks"), tiered.load(d) as m:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_mxfp4(d), ids))
        assert key + "_blocks" in m._tiered.plan.unused


def test_stats_count_decoded_bytes_live(fp8_llama: Path) -> None:
    """``tiered.stats(m)`` is the live object: a held one sees the decodes of later passes."""
    with tiered.load(fp8_llama, ring_gb=_ring(fp8_llama)) as m:
        held = tiered.stats(m)
        before = held.decoded_bytes
        logits_of(m, make_ids(11, (1, 4)))
        assert held.decoded_bytes > before


def _meta_model(path: Path) -> torch.nn.Module:
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("io", ["mmap", "direct"])
@pytest.mark.parametrize("name", ["fp8_llama", "fp8_qwen3_moe", "mxfp4_gpt_oss"])
def test_a_stored_unit_decodes_after_the_copy_to_the_reader_decodes_bytes(request: pytest.FixtureRequest, name: str,
                                                                          io: str) -> None:
    """CUDA's layout (``build_plan(stored=True)``): the slot carries the codes and scales as stored — fewer bytes than
    the decoded layout — and :func:`tiered.quant.decode_stored` (what the device stage runs after the H2D copy, here
    on CPU tensors) writes a device buffer whose every target is byte for byte the target the reader decodes into
    a slot of the CPU layout."""
    from tiered.format import open_checkpoint
    from tiered.plan import build_plan
    from tiered.quant import decode_stored
    from tiered.reader import Reader

    path = request.getfixturevalue(name)
    ck = open_checkpoint(path)
    flat, stored = build_plan(_meta_model(path), ck, align=512), build_plan(_meta_model(path), ck, align=512, stored=True)
    r = Reader(ck, io=io)
    try:
        n_stored = 0
        for a, b in zip(flat.units, stored.units, strict=True):
            assert [t.key for t in a.targets] == [t.key for t in b.targets]
            ref = torch.full((a.nbytes,), 0xA5, dtype=torch.uint8)
            r.read_unit(a, ref)
            slot = torch.full((b.nbytes,), 0x5A, dtype=torch.uint8)
            r.read_unit(b, slot)
            if b.coded_at is None:
                assert b.nbytes == b.dev_bytes == a.nbytes
                dev = slot
            else:
                n_stored += 1
                assert b.nbytes < b.dev_bytes == a.nbytes  # stored bytes move; the device holds the decoded ones
                dev = torch.full((b.dev_bytes,), 0x5A, dtype=torch.uint8)
                dev[: b.coded_at] = slot[: b.coded_at]
                written = decode_stored(b, slot[b.coded_at : b.nbytes].clone(), dev)
                assert written == sum(t.nbytes for t in b.targets if t.offset >= b.coded_at) > 0
            for ta, tb in zip(a.targets, b.targets, strict=True):
                assert torch.equal(dev[tb.offset : tb.offset + tb.nbytes], ref[ta.offset : ta.offset + ta.nbytes]), tb.key
        assert n_stored >= 2
    finally:
        r.close()


@pytest.mark.parametrize("rows,cols,block,row0", [(200, 72, (64, 32), 0), (129, 300, (128, 128), 0),
                                                  (77, 130, (32, 128), 40), (256, 256, (128, 128), 128)])
def test_the_vectorised_decode_equals_the_table_decode(rows: int, cols: int, block, row0: int) -> None:
    """:func:`tiered.quant.decode_rows` on the GPU path (torch ops on whole bands: each row's scale row gathered,
    here reached on the CPU with codes that are not contiguous) equals its CPU table path and stock's
    ``_dequantize_one`` bit for bit, for bands that start inside a block row."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from tiered.quant import decode_rows

    g = torch.Generator().manual_seed(rows * cols)
    wide = torch.randint(0, 256, (rows + row0, 2 * cols), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    wide = torch.where(wide.float().isnan(), torch.zeros_like(wide.float()), wide.float()).to(torch.float8_e4m3fn)
    gr, gc = -(-(rows + row0) // block[0]), -(-cols // block[1])
    scale = torch.rand(gr, gc, generator=g) * 4 + 0.01
    strided = wide[row0:, :cols]  # not contiguous: the torch path
    assert not strided.is_contiguous()
    a = torch.empty(rows, cols, dtype=torch.bfloat16)
    b = torch.empty(rows, cols, dtype=torch.bfloat16)
    decode_rows(strided, scale, block, row0, a)
    decode_rows(strided.contiguous(), scale, block, row0, b)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    if (rows + row0) % block[0] == 0 and cols % block[1] == 0:  # stock's reshape needs whole blocks
        full = Fp8Dequantize(None)._dequantize_one(wide[:, :cols].contiguous(), scale, torch.bfloat16)
        assert torch.equal(a.view(torch.int16), full[row0:].view(torch.int16))


@pytest.mark.parametrize("name", ["fp8_qwen3_moe", "mxfp4_gpt_oss"])
def test_host_tier_coded_experts_are_kept_as_stored_and_decode_as_stock(request: pytest.FixtureRequest,
                                                                        name: str) -> None:
    """CUDA's host tier of FP8 (and MXFP4) experts (``ExpertSpec.stored``) keeps each expert's codes and block scales as stored —
    fewer pinned bytes than decoded — and a call decodes the routed ones after the copy; here on the CPU (the layout,
    the fill, the per-call decode). Logits equal stock's dequantized model; nothing is read after the fill."""
    from tiered.experts import HostExperts

    path = request.getfixturevalue(name)
    ref = _stock_dequantized(path) if name.startswith("fp8") else _stock_mxfp4(path)
    ids = make_ids(5, (2, 7))
    want = logits_of(ref, ids)
    with tiered.load(path, ring_gb=_ring(path), device="cpu") as m:
        h = m._tiered
        specs = [eg.spec for eg in h.experts]
        assert specs and all(any(getattr(i, "decode", None) for p in sp.parts for i, _ in p.per[0]) for sp in specs)
        decoded_size = sum(HostExperts.bytes_for(sp) for sp in specs)
        for sp in specs:
            sp.stored = True
        stored_size = sum(HostExperts.bytes_for(sp) for sp in specs)
        assert stored_size < decoded_size  # (page-rounded regions: the tiny model saves less than half)
        hx = HostExperts(specs, torch.device("cpu"))
        try:
            hx.fill(h.reader, h.stats)
            assert hx.nbytes == stored_size
            for eg in h.experts:
                eg.host = hx.parts(eg.spec)
                assert all(isinstance(x, list) for x in eg.host)
            before = tiered.stats(m).snapshot()
            assert torch.equal(logits_of(m, ids), want)
            after = tiered.stats(m).snapshot()
            assert after["experts_read"] == before["experts_read"] and after["experts_from_host"] > 0
            assert after["decoded_bytes"] > before["decoded_bytes"]
            n = after["experts_from_host"] - before["experts_from_host"]
            assert after["host_expert_bytes"] - before["host_expert_bytes"] == n * specs[0].expert_src_bytes
        finally:
            for eg in h.experts:
                eg.host = None
            hx.close()



# compressed-tensors (tiered.quant.CtWeight): weight-only and dynamic-activation schemes, decoded after the read by the
# package's own compressor, compared with stock transformers loading the same directory (which also uses the package)

_W4A16 = ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}, None)
_CT = {
    "w4a16-group": _W4A16,
    "w8a16-channel-packed": ("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}, None),
    "int8-w8a8-dynamic": ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                          {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
    "fp8-dynamic": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}),
    "fp8-tensor-weight-only": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"}, None),
}


@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("ct")
    src = models.llama(root / "bf16")
    return {name: models.compressed_tensors(src, root / name, fmt, w, a) for name, (fmt, w, a) in _CT.items()}


def _stock_ct(path: Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Stock transformers on a compressed-tensors directory, as a user loads it (no quantization_config argument)."""
    kw = {} if dtype is None else {"dtype": dtype}
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "io": "mmap", "host_gb": 0}],
                         ids=["defaults", "streamed-direct", "streamed-mmap"])
@pytest.mark.parametrize("name", list(_CT))
def test_compressed_tensors_logits_equal_stock(ct_dirs: dict[str, Path], name: str, kw: dict) -> None:
    path = ct_dirs[name]
    ids = make_ids(4, (2, 9))
    ref = logits_of(_stock_ct(path), ids)
    kw = {**kw, "ring_gb": _ring(path)} if kw else kw
    with tiered.load(path, **kw) as m:
        got = logits_of(m, ids)
        snap = tiered.stats(m).snapshot()
        assert not m._tiered.plan.unused
    assert torch.equal(got, ref)
    assert snap["decoded_bytes"] > 0 and (snap["streamed_bytes"] > 0) == bool(kw)


def test_compressed_tensors_the_test_checkpoints_are_what_stock_quantizes(ct_dirs: dict[str, Path]) -> None:
    """The fixtures hold codes and scales (not weights), and stock really quantizes: its decoded weight differs from
    a plain cast of the codes, and for a dynamic-activation scheme its logits differ from a plain forward of the same
    decoded weights (so the tests above check the activation path too)."""
    keys = models.checkpoint_keys(ct_dirs["w4a16-group"])
    w = {k: v for f in ct_dirs["w4a16-group"].glob("*.safetensors") for k, v in load_file(f).items()}
    assert w["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    assert w["model.layers.0.self_attn.q_proj.weight_packed"].any()
    assert "model.layers.0.self_attn.q_proj.weight" not in keys and "lm_head.weight" in keys
    stock = _stock_ct(ct_dirs["fp8-dynamic"])
    plain = transformers.AutoModelForCausalLM.from_config(stock.config.__class__.from_pretrained(ct_dirs["fp8-dynamic"]))
    plain.config.quantization_config = None
    plain.load_state_dict({k: v for k, v in stock.state_dict().items() if not k.endswith(("_scale", "_shape"))},
                          strict=False)
    plain.to(stock.dtype).eval()
    ids = make_ids(5, (1, 6))
    assert not torch.equal(logits_of(plain, ids), logits_of(stock, ids))


def test_compressed_tensors_decodes_to_the_dtype_asked_for(ct_dirs: dict[str, Path]) -> None:
    ids = make_ids(6, (1, 7))
    for name in ("w4a16-group", "fp8-dynamic"):
        path = ct_dirs[name]
        ref = logits_of(_stock_ct(path, torch.float32), ids)
        with tiered.load(path, dtype=torch.float32, ring_gb=2 * _ring(path)) as m:
            assert torch.equal(logits_of(m, ids), ref), name


def test_compressed_tensors_inspect_and_reshard_keep_the_stored_bytes(ct_dirs: dict[str, Path], tmp_path: Path) -> None:
    from tiered.cli import inspect_dir
    from tiered.reshard import reshard
    from tiered.reshard.errors import UnsupportedCheckpointError

    path = ct_dirs["w4a16-group"]
    q = inspect_dir(path)["quantized"]
    packed = sum(v.nbytes for f in path.glob("*.safetensors") for k, v in load_file(f).items()
                 if k.endswith(("weight_packed", "weight_scale")))
    assert q["method"] == "compressed-tensors" and q["tensors"] == 4 * 7 and q["stored_bytes"] == packed
    assert q["decoded_bytes"] > 3 * q["stored_bytes"]
    reshard(path, tmp_path / "out", quiet=True)
    before = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k].view(torch.uint8) if before[k].dim() else
                                                                  before[k], after[k].view(torch.uint8) if after[k].dim()
                                                                  else after[k]) for k in before)
    ids = make_ids(7, (1, 5))
    with tiered.load(tmp_path / "out", ring_gb=_ring(tmp_path / "out")) as m:
        assert torch.equal(logits_of(m, ids), logits_of(_stock_ct(path), ids))
    with pytest.raises(UnsupportedCheckpointError, match="compressed-tensors.*without --dtype"):
        reshard(path, tmp_path / "cast", dtype=torch.float16, quiet=True)
    assert not (tmp_path / "cast").exists()


_BAD = {
    "asymmetric": ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
                                "symmetric": False}}, "asymmetric"),
    "static-input": ({"input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}},
                     "statically"),
    "actorder-group": ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
                                    "actorder": "group"}}, "actorder"),
    "block-strategy": ({"weights": {"num_bits": 8, "type": "int", "strategy": "block", "block_structure": [8, 8]}},
                       "strategy 'block'"),
    "marlin-format": ({"format": "marlin-24"}, "format 'marlin-24'"),
    "sparsity": ({"top": {"sparsity_config": {"format": "sparse-24-bitmask"}}}, "sparsity_config"),
    "frozen": ({"top": {"quantization_status": "frozen"}}, "quantization_status='frozen'"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_compressed_tensors_schemes_it_cannot_decode_exactly_are_refused_before_a_weight_is_read(
        ct_dirs: dict[str, Path], tmp_path: Path, case: str) -> None:
    import shutil

    change, msg = _BAD[case]
    d = tmp_path / case
    shutil.copytree(ct_dirs["w4a16-group"], d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    grp = qc["config_groups"]["group_0"]
    for k, v in change.items():
        if k == "top":
            qc.update(v)
        else:
            grp[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    _truncate_data(d)
    with pytest.raises(QuantizationError, match=msg) as e:
        tiered.load(d)
    assert "config.json" in str(e.value) and "CompressedTensorsConfig(dequantize=True)" in str(e.value)


def test_compressed_tensors_codes_that_do_not_fit_are_refused_with_the_tensor(ct_dirs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    src = ct_dirs["w4a16-group"]
    # the config says 8 bits where 4-bit codes are stored: the packed width does not fit
    d = tmp_path / "bits"
    import shutil

    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=r"\.safetensors: tensor '.*weight_packed' at offset \d+ is torch.int32"):
        tiered.load(d)
    # a scale missing
    d2 = tmp_path / "noscale"
    models._rewrite(src, d2, lambda k, v: {} if k == "model.layers.0.mlp.up_proj.weight_scale" else {k: v},
                    lambda c: None)
    with pytest.raises(QuantizationError, match="has no 'model.layers.0.mlp.up_proj.weight_scale'"):
        tiered.load(d2)


def test_compressed_tensors_a_modules_group_is_the_one_stock_picks(ct_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Several config groups match a module: stock takes the most specific target (exact name, then regex, then class
    name: the package's ``match_targets``), not the last group; here the MLPs' group quantizes activations and the
    catch-all one does not, so a wrong pick changes the logits."""
    import shutil

    d = tmp_path / "groups"
    shutil.copytree(ct_dirs["int8-w8a8-dynamic"], d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    g = qc["config_groups"].pop("group_0")
    g["format"] = "int-quantized"  # (per group: stock infers pack-quantized for a weight-only int group otherwise)
    qc["config_groups"] = {"g_mlp": {**g, "targets": ["re:.*mlp\\..*_proj$"]},
                           "g_all": {**g, "targets": ["Linear"], "input_activations": None}}
    (d / "config.json").write_text(json.dumps(cfg))
    ids = make_ids(9, (2, 7))
    ref = logits_of(_stock_ct(d), ids)
    with tiered.load(d) as m:
        assert torch.equal(logits_of(m, ids), ref)
        assert m.model.layers[0].mlp.up_proj.quantization_scheme.input_activations is not None
        assert not hasattr(m.model.layers[0].self_attn.q_proj, "quantization_scheme")


_CT_MOE = {"w4a16-group": _W4A16, "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float",
                                                                        "strategy": "channel"}, None)}


@pytest.fixture(scope="module")
def ct_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-MoE with compressed-tensors experts (per expert ``gate_proj``/``up_proj``/``down_proj``: what
    transformers' conversion stacks into ``gate_up_proj``/``down_proj``), each scheme with its scales stored in the
    model's bf16 as the package stores them, and in float32 (random values bf16 cannot hold)."""
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("ctmoe")
    src = models.qwen3_moe(root / "bf16")
    out = {}
    g = torch.Generator().manual_seed(5)
    for name, (fmt, w, a) in _CT_MOE.items():
        d = models.compressed_tensors(src, root / name, fmt, w, a, skip=("lm_head", "mlp.gate."))
        out[f"{name}-bf16-scales"] = d
        out[f"{name}-f32-scales"] = models._rewrite(
            d, root / f"{name}-f32", lambda k, v: {k: v.float() * (1 + 1e-3 * torch.rand(v.shape, generator=g))}
            if k.endswith("weight_scale") else {k: v}, lambda c: None)
    return out


@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}], ids=["defaults", "streamed"])
@pytest.mark.parametrize("name", ["w4a16-group-bf16-scales", "w4a16-group-f32-scales", "fp8-channel-bf16-scales",
                                  "fp8-channel-f32-scales"])
def test_compressed_tensors_moe_experts_equal_stock(ct_moe_dirs: dict[str, Path], name: str, kw: dict) -> None:
    """compressed-tensors MoE experts (per-expert packed int4 or float8 codes) decode as stock's ``DecompressExperts``
    decodes them before transformers stacks them: the package's decompress with the scale as stored (float8: the
    float32 product, then bfloat16), the fused expert tensors in the dtype that gives (float32 scales: float32
    experts, as in stock); logits bit for bit, resident and streamed (the experts decoded with their layer)."""
    path = ct_moe_dirs[name]
    keys = models.checkpoint_keys(path)
    codes = "weight_packed" if name.startswith("w4a16") else "weight"
    assert f"model.layers.0.mlp.experts.3.down_proj.{codes}" in keys
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale" in keys
    ids = make_ids(4, (2, 9))
    stock = _stock_ct(path)
    ref = logits_of(stock, ids)
    kw = {**kw, "ring_gb": _ring(path)} if kw else kw
    with tiered.load(path, **kw) as m:
        got = logits_of(m, ids)
        assert not m._tiered.plan.unused
        want_dt = stock.model.layers[0].mlp.experts.gate_up_proj.dtype
        assert m.model.layers[0].mlp.experts.gate_up_proj.dtype == want_dt
        assert want_dt == (torch.float32 if name.startswith("w4a16") and "f32" in name else torch.bfloat16)
        assert tiered.stats(m).snapshot()["decoded_bytes"] > 0
    assert torch.equal(got, ref)


def test_compressed_tensors_moe_experts_stock_cannot_decode_are_refused(ct_moe_dirs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Experts stored ``int-quantized`` (stock's expert decode reads packed or float8 experts only and fails), float8
    experts with group scales (its product does not broadcast), plain experts stacked with coded ones and packed
    experts without their ``weight_shape`` are refused while the plan is made, before any unit is read, naming the
    config or tensor."""
    from tiered import faults

    def no_read(**info):
        raise AssertionError(f"a read before the refusal: {info}")

    src = ct_moe_dirs["fp8-channel-bf16-scales"].parent / "bf16"
    bad = {"int8": ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                    "MoE experts stored 'int-quantized'.*fails on these too"),
           "fp8g": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16},
                    "float8 MoE experts with group scales")}
    for case, (fmt, w, msg) in bad.items():
        d = models.compressed_tensors(src, tmp_path / case, fmt, w, None, skip=("lm_head", "mlp.gate."))
        with faults.inject("read", no_read), pytest.raises(QuantizationError, match=msg) as e:
            tiered.load(d)
        assert "config.json" in str(e.value)
    # one expert left plain by the config's ignore list: stock pairs the others with wrong scales; refused
    d = models.compressed_tensors(src, tmp_path / "mixed", *_W4A16,
                                  skip=("lm_head", "mlp.gate.", "layers.1.mlp.experts.2.down_proj"))
    with faults.inject("read", no_read), pytest.raises(QuantizationError, match=r"experts\.2\.down_proj\.weight.* is "
                                                                              "a plain expert matrix stacked"):
        tiered.load(d)
    d = models._rewrite(ct_moe_dirs["w4a16-group-bf16-scales"], tmp_path / "noshape",
                        lambda k, v: {} if k == "model.layers.1.mlp.experts.2.up_proj.weight_shape" else {k: v},
                        lambda c: None)
    with faults.inject("read", no_read), pytest.raises(QuantizationError,
                                                       match=r"experts\.2\.up_proj\.weight_scale.*weight_shape"):
        tiered.load(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "host_gb": 0.002}],
                         ids=["resident", "streamed", "host-tier"])
@pytest.mark.parametrize("name", ["w4a16-group-f32-scales", "fp8-channel-f32-scales"])
def test_cuda_compressed_tensors_moe_experts_equal_stock(ct_moe_dirs: dict[str, Path], name: str, kw: dict) -> None:
    """On the GPU the experts' codes and scales go over PCIe as stored and decode on the device after the copy, into
    their slabs of the fused expert tensors: logits equal stock's on the same GPU, bit for bit."""
    path = ct_moe_dirs[name]
    ids = make_ids(4, (2, 9)).cuda()
    stock = _stock_ct(path).to("cuda")
    with torch.no_grad():
        want = stock(ids).logits
    del stock
    kw = {**kw, "ring_gb": _ring(path)} if kw else kw
    with tiered.load(path, device="cuda", gpu_gb=0 if kw else None, **kw) as m, torch.no_grad():
        assert torch.equal(m(ids).logits, want)
        assert tiered.stats(m).decoded_bytes > 0


def test_compressed_tensors_a_vision_language_checkpoint_finds_its_renamed_codes(tmp_path: Path) -> None:
    """A Llava checkpoint stores its language model under ``language_model.model.`` (transformers' renaming makes it
    ``model.language_model.``): the codes and scales are found under the stored names, as stock finds them."""
    pytest.importorskip("compressed_tensors")
    src = models.llava(tmp_path / "bf16")
    keys = models.checkpoint_keys(src)
    d = models.compressed_tensors(src, tmp_path / "ct", *_W4A16, skip=("lm_head", "vision_tower", "projector"),
                                  ignore=["re:.*lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"])
    cts = [k for k in models.checkpoint_keys(d) if k.endswith("weight_packed")]
    assert cts and all(k.startswith("language_model.model.") for k in cts), (cts[:3], list(keys)[:3])
    ids = make_ids(10, (1, 7))
    ref = transformers.AutoModelForImageTextToText.from_pretrained(d).eval()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    with tiered.load(d) as m, torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, want)


@pytest.mark.parametrize("case", ["e5m2-codes", "naive-int-with-fp8-codes", "no-status", "group-does-not-divide",
                                  "no-weight-shape", "actorder-true"])
def test_compressed_tensors_configs_and_codes_that_disagree_are_refused(ct_dirs: dict[str, Path], tmp_path: Path,
                                                                        case: str) -> None:
    import shutil

    if case in ("e5m2-codes", "naive-int-with-fp8-codes"):
        src = ct_dirs["fp8-tensor-weight-only"]
        conv = (lambda k, v: {k: v.view(torch.uint8).view(torch.float8_e5m2)} if v.dtype == torch.float8_e4m3fn
                else {k: v}) if case == "e5m2-codes" else (lambda k, v: {k: v})

        def cfg(c: dict) -> None:
            if case != "e5m2-codes":
                c["quantization_config"]["format"] = "naive-quantized"
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"

        d = models._rewrite(src, tmp_path / case, conv, cfg)
        msg = r"\.safetensors: tensor '.*q_proj\.weight' at offset \d+ is torch\.float8_e"
    else:
        d = tmp_path / case
        shutil.copytree(ct_dirs["w4a16-group"], d)
        cfg = json.loads((d / "config.json").read_text())
        qc = cfg["quantization_config"]
        w = qc["config_groups"]["group_0"]["weights"]
        if case == "no-status":
            del qc["quantization_status"]
            msg = "quantization_status='\\(none\\)'"
        elif case == "group-does-not-divide":
            w["group_size"] = 24
            msg = "group_size 24, which does not divide"
        elif case == "actorder-true":
            w["actorder"] = True
            msg = "does not validate"
        else:
            for f in d.glob("*.safetensors"):
                t = load_file(f)
                save_file({k: v for k, v in t.items() if not k.endswith("weight_shape")}, f)
            idx = d / "model.safetensors.index.json"
            if idx.exists():
                doc = json.loads(idx.read_text())
                doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not k.endswith("weight_shape")}
                idx.write_text(json.dumps(doc))
            msg = "without their weight_shape"
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match=msg):
        tiered.load(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "host_gb": 0.01}],
                         ids=["resident", "streamed", "host-tier"])
@pytest.mark.parametrize("name", ["w4a16-group", "fp8-dynamic"])
def test_cuda_compressed_tensors_equal_stock_on_the_gpu(ct_dirs: dict[str, Path], name: str, kw: dict) -> None:
    """On the GPU (decoded after the H2D copy where the unit streams), against stock on the same GPU."""
    path = ct_dirs[name]
    ids = make_ids(8, (2, 8))
    ref_model = _stock_ct(path).to("cuda")
    ref = logits_of(ref_model, ids.cuda())
    del ref_model
    kw = {**kw, "ring_gb": _ring(path)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(path, device="cuda", gpu_gb=0 if kw else None, **kw) as m:
        got = logits_of(m, ids.cuda())
        if kw:
            assert m._tiered.plan.stored
    assert torch.equal(got, ref)


def test_a_plain_checkpoint_loads_without_the_compressed_tensors_package(ckpts, monkeypatch) -> None:
    """The H200 image has no compressed-tensors: a plain model must not import it (a 2026-12-03 device run of every
    plain `tiered.load` failed with ModuleNotFoundError in ct_forward)."""
    import builtins

    real = builtins.__import__

    def no_ct(name, *a, **k):
        if name.startswith("compressed_tensors"):
            raise ModuleNotFoundError("No module named 'compressed_tensors'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ct)
    ids = make_ids(1, (1, 5))
    with tiered.load(ckpts["llama"]) as m:
        assert logits_of(m, ids).shape[-1] > 0
