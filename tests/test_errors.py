"""Every user-facing failure of tiered.load raises its own TieredError subclass with a message that helps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import Checkpoints
from safetensors.torch import load_file, save_file

import tiered
from tiered.errors import (
    ConfigError,
    MissingTensorError,
    RingTooSmallError,
    ShapeMismatchError,
    ShardNotFoundError,
    TieredError,
    TruncatedShardError,
)

GiB = 2**30


def _load(d: Path, **kw) -> torch.nn.Module:
    kw.setdefault("device", "cpu")
    kw.setdefault("ring_gb", 1.0)
    kw.setdefault("zero_copy", False)  # these are the ring's and the reader's errors (zero copy: test_zero_copy.py)
    return tiered.load(d, **kw)


def _drop_tensor(d: Path, key: str) -> Path:
    """Remove ``key`` from the checkpoint in ``d`` (its shard and the index): the file it was in."""
    idx_path = d / "model.safetensors.index.json"
    if idx_path.exists():
        idx = json.loads(idx_path.read_text())
        f = d / idx["weight_map"].pop(key)
        idx_path.write_text(json.dumps(idx))
    else:
        f = d / "model.safetensors"
    sd = load_file(f)
    sd.pop(key)
    save_file(sd, f, metadata={"format": "pt"})
    return f


def _edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------- ring


def test_ring_too_small_names_unit_and_size(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with _load(d) as m:
        big = m._tiered.plan.max_unit
    with pytest.raises(RingTooSmallError) as e:
        _load(d, ring_gb=1e-5)  # ~10 KiB, the biggest unit is ~72 KiB
    msg = str(e.value)
    assert repr(big.name) in msg, msg
    assert re.search(r"\d+(\.\d+)?(e-?\d+)? GiB", msg), msg


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_ring_too_small_suggestion_is_enough(name: str, ckpts: Checkpoints) -> None:
    """The ``ring_gb >= X`` the message suggests must be enough: X may not round below the unit's size."""
    d = ckpts[name]
    with _load(d) as m:
        need = m._tiered.plan.max_unit.nbytes
    with pytest.raises(RingTooSmallError) as e:
        _load(d, ring_gb=need / GiB / 2)
    msg = str(e.value)
    found = re.search(r"ring_gb >= ([0-9.eE+-]+)", msg)
    assert found, msg
    suggested = float(found.group(1))
    assert suggested * GiB >= need, f"suggests ring_gb >= {suggested} but the unit needs {need} bytes: {msg}"
    with _load(d, ring_gb=suggested) as m:  # and it loads (streamed)
        assert tiered.stats(m).units > 0


@pytest.mark.parametrize("ring_gb", [0, -1.0])
def test_ring_not_positive(ring_gb: float, ckpts: Checkpoints) -> None:
    with pytest.raises(RingTooSmallError, match="ring_gb"):
        _load(ckpts["llama"], ring_gb=ring_gb)


# ---------------------------------------------------------------------------------------------- checkpoint vs model


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("llama", "model.layers.1.mlp.up_proj.weight"),
        ("llama_tied_single", "model.embed_tokens.weight"),  # tied: lm_head has no source either
        ("bert", "encoder.layer.2.attention.self.query.bias"),
    ],
)
def test_missing_tensor(name: str, key: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy(name, tmp_path / "m")
    _drop_tensor(d, key)
    with pytest.raises(MissingTensorError) as e:
        _load(d)
    msg = str(e.value)
    assert key in msg or (name == "llama_tied_single" and "lm_head.weight" in msg), msg
    assert str(d) in msg


def test_missing_expert_tensor(ckpts: Checkpoints, tmp_path: Path) -> None:
    """One expert's w1 gone from a Mixtral checkpoint: the fused gate_up_proj cannot be assembled.

    Expected: MissingTensorError naming what is missing, at load time (not a raw torch shape error).
    """
    d = ckpts.copy("mixtral", tmp_path / "m")
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    _drop_tensor(d, key)
    with pytest.raises(TieredError) as e:
        _load(d)
    assert isinstance(e.value, MissingTensorError), f"{type(e.value).__name__}: {e.value}"
    msg = str(e.value)
    assert "experts.2.w1" in msg or "layers.1.mlp.experts.gate_up_proj" in msg, msg


def test_shape_mismatch_names_file_and_tensor(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_config(d, intermediate_size=96)  # checkpoint has 128
    with pytest.raises(ShapeMismatchError) as e:
        _load(d)
    msg = str(e.value)
    m = re.search(r"'(model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight)'", msg)
    assert m, msg
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][m.group(1)]
    assert str(d / shard) in msg, msg
    assert "128" in msg and "96" in msg


def test_shape_mismatch_in_fused_expert(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("mixtral", tmp_path / "m")
    _edit_config(d, intermediate_size=80)  # checkpoint experts have 96
    with pytest.raises(TieredError) as e:
        _load(d)
    assert isinstance(e.value, ShapeMismatchError), f"{type(e.value).__name__}: {e.value}"


# ---------------------------------------------------------------------------------------------- files


def test_truncated_shard(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    shard = sorted(d.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(TruncatedShardError) as e:
        _load(d)
    assert str(shard) in str(e.value)


def test_truncated_single_file(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("gpt2_single", tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(TruncatedShardError, match=re.escape(str(f))):
        _load(d)


def test_missing_shard(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    shard = sorted(d.glob("*.safetensors"))[2]
    shard.unlink()
    with pytest.raises(ShardNotFoundError, match=re.escape(shard.name)):
        _load(d)


# ---------------------------------------------------------------------------------------------- config


def test_no_config_json(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        _load(d)


def test_unknown_architecture(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_config(d, architectures=["NoSuchModelForCausalLM"])
    with pytest.raises(ConfigError, match="NoSuchModelForCausalLM"):
        _load(d)


def test_no_architectures(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_config(d, architectures=None)
    with pytest.raises(ConfigError, match="model_class"):
        _load(d)
    with _load(d, model_class="LlamaForCausalLM") as m:  # the fix the message suggests
        assert type(m).__name__ == "LlamaForCausalLM"


def test_unknown_model_type(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_config(d, model_type="no-such-model-type")
    with pytest.raises(ConfigError):
        _load(d)


@pytest.mark.parametrize(
    "kw",
    [{"device": "tpu"}, {"device": "meta"}, {"io": "uring"}, {"dtype": "fp7"}],
    ids=["device-unparseable", "device-unsupported", "io", "dtype"],
)
def test_bad_options(kw: dict, ckpts: Checkpoints) -> None:
    """Documented: ConfigError for an unknown device, io backend or dtype name."""
    with pytest.raises(ConfigError, match=re.escape(str(next(iter(kw.values()))))):
        _load(ckpts["llama"], **kw)


# ---------------------------------------------------------------------------------------------- worker threads


def test_reader_error_surfaces_in_forward(ckpts: Checkpoints) -> None:
    """An exception in a reader thread reaches the caller's forward as StreamerError (cause chained), no hang."""
    m = _load(ckpts["llama"], ring_gb=3 * 4096 / GiB + 64 * 1024 / GiB)
    with m:
        assert tiered.stats(m).resident_units == 0
        reader = m._tiered.reader

        def boom(*a, **k):
            raise OSError(5, "Input/output error (injected)")

        reader._copy = boom  # every later copy fails in a reader thread
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(tiered.StreamerError) as e:
            with torch.no_grad():
                m(ids)
        assert isinstance(e.value.__cause__, OSError) and "injected" in str(e.value.__cause__)


@pytest.mark.parametrize("io", ["direct", "pread"])
def test_shard_truncated_after_load_direct_io(io: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    """With io="direct" or "pread", a shard cut short while the model is loaded gives TruncatedShardError in forward."""
    d = ckpts.copy("llama", tmp_path / "m")
    m = _load(d, ring_gb=3 * 4096 / GiB + 64 * 1024 / GiB, io=io)
    with m:
        assert tiered.stats(m).resident_units == 0
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
        with pytest.raises(TruncatedShardError, match="truncated"):
            with torch.no_grad():
                m(torch.tensor([[1, 2, 3]]))


# ---------------------------------------------------------------------------------------------- found by a new user


@pytest.mark.parametrize(
    "kw",
    [{"threads": 0}, {"threads": -2}, {"prefetch": -1}, {"gpu_gb": -1}, {"ring_gb": float("nan")}, {"ring_gb": "1"},
     {"dtype": torch.int8}],
    ids=["threads0", "threads-2", "prefetch-1", "gpu_gb-1", "ring-nan", "ring-str", "dtype-int8"],
)
def test_bad_option_values(kw: dict, ckpts: Checkpoints) -> None:
    with pytest.raises(ConfigError):
        _load(ckpts["llama"], **kw)


def test_use_after_close_raises(ckpts: Checkpoints) -> None:
    m = _load(ckpts["llama"])
    m.close()
    with pytest.raises(tiered.StreamerError, match="closed"):
        m(torch.tensor([[1, 2, 3]]))


def test_unused_checkpoint_tensors_warn(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_config(d, num_hidden_layers=2)  # the checkpoint has 4
    with pytest.warns(UserWarning, match="not used by the model"):
        _load(d).close()


def test_ring_capped_at_model_size(ckpts: Checkpoints) -> None:
    with _load(ckpts["llama"], ring_gb=4.0) as m:
        s = tiered.stats(m)
        assert s.ring_bytes <= m._tiered.plan.nbytes + 4096 * s.units  # every unit's layout, page-rounded
        assert s.resident_units == s.units


def test_attach_module_built_under_torch_meta_device(minilm_dir: Path) -> None:
    """A transformers model built with ``torch.device("meta")`` has meta buffers: they are computed as
    from_pretrained computes them, and the output is bitwise equal to stock."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(minilm_dir)
    with torch.device("meta"):
        m = transformers.BertModel(cfg)
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    with tiered.attach(m, minilm_dir, ring_gb=0.05, device="cpu") as m, torch.no_grad():
        m.eval()
        assert torch.equal(m(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)


def test_attach_plain_module_with_meta_buffer_is_refused(tmp_path: Path) -> None:
    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4), persistent=False)

    src = WithBuffer()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(ConfigError, match="scale"):
        tiered.attach(m, tmp_path, ring_gb=0.01, device="cpu")



# ---------------------------------------------------------------------------------------------- what the path is


def test_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ShardNotFoundError, match="no such directory"):
        tiered.load(tmp_path / "nope")


def test_hub_id_is_named_as_one() -> None:
    with pytest.raises(ShardNotFoundError, match=r"Hub id.*snapshot_download\('someone/some-model'\)"):
        tiered.load("someone/some-model")


def test_weight_file_instead_of_directory(ckpts: Checkpoints) -> None:
    f = ckpts["llama_tied_single"] / "model.safetensors"
    with pytest.raises(ShardNotFoundError, match="is a file, not a directory.*" + re.escape(str(f.parent))):
        tiered.load(f)


def test_cli_version() -> None:
    import subprocess
    import sys

    import tiered as t

    out = subprocess.run([sys.executable, "-m", "tiered.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"tiered {t.__version__}", (out.stdout, out.stderr)


@pytest.mark.parametrize("name", ["llama", "gptj", "mixtral"])
def test_inspect_and_ring_too_small_agree_on_the_ring_needed(name: str, ckpts: Checkpoints) -> None:
    import subprocess
    import sys

    d = ckpts[name]
    out = subprocess.run([sys.executable, "-m", "tiered.cli", "inspect", str(d)], capture_output=True, text=True,
                         timeout=300)
    said = re.search(r"(?:ring needed|ring to copy every unit into it[^:]*): >= ([0-9.]+) GiB", out.stdout)
    assert said, out.stdout + out.stderr
    with pytest.raises(RingTooSmallError) as e:
        _load(d, ring_gb=1e-6)  # zero_copy=False: every unit through the ring
    assert f"pass ring_gb >= {said.group(1)} " in str(e.value), (said.group(1), str(e.value))
    # with the defaults (CPU zero copy, embedding rows), what inspect says is needed is what load needs
    default = re.search(r"ring needed with the defaults: (>= ([0-9.]+) GiB|any size)", out.stdout)
    if default is not None and default.group(2) is None:
        tiered.load(d, device="cpu", ring_gb=1e-6).close()  # any size: nothing goes through the ring
    elif default is not None:
        with pytest.raises(RingTooSmallError) as e:
            tiered.load(d, device="cpu", ring_gb=1e-6)
        assert f"pass ring_gb >= {default.group(2)} " in str(e.value), (default.group(2), str(e.value))
