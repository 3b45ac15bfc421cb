"""Every user-facing failure raises its own TieredError subclass with a message that helps: at load (a ring too
small, missing or mismatched tensors, bad files and options), and after it (shards truncated, rewritten or replaced
under a loaded model, faults in the reader and copy workers); checkpoint extras the model does not need only warn."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import (
    STOCK,
    Checkpoints,
    ids_for,
    make_ids,
    plan_ring_gb,
    run_child,
    stream,
    streaming_ring_gb,
)
from safetensors.torch import load_file, save_file

import tiered
from tiered import faults
from tiered.errors import (
    ConfigError,
    MissingTensorError,
    RingTooSmallError,
    ShapeMismatchError,
    ShardChangedError,
    ShardNotFoundError,
    StreamerError,
    TieredError,
    TruncatedShardError,
    UnsupportedDtypeError,
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


def test_missing_tensor_of_a_plain_module_names_keys_and_files(tmp_path: Path) -> None:
    """``tiered.attach`` of a plain module (no config.json anywhere) whose checkpoint lacks two tensors: the
    MissingTensorError names both keys and the file searched, and says nothing of config.json (there is none).
    Before the fix: the first key only, and 'the checkpoint does not match config.json'."""
    from models import MLPStack

    sd = {k: v.contiguous() for k, v in MLPStack().state_dict().items()
          if k not in ("blocks.1.0.weight", "head.bias")}
    save_file(sd, tmp_path / "model.safetensors")
    with torch.device("meta"):
        mod = MLPStack()
    with pytest.raises(MissingTensorError) as e:
        tiered.attach(mod, tmp_path, ring_gb=0.01, device="cpu")
    msg = str(e.value)
    assert "'blocks.1.0.weight'" in msg and "'head.bias'" in msg, msg
    assert str(tmp_path / "model.safetensors") in msg, msg
    assert "config.json" not in msg, msg


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
    out = subprocess.run([sys.executable, "-m", "tiered.cli", "inspect", str(d), "--units"], capture_output=True, text=True,
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


# ----------------------------------------------------------------------------------- files changed under a loaded model


TRUNCATE_MMAP = """
import sys, torch, tiered
from pathlib import Path
d, ring = Path(sys.argv[1]), float(sys.argv[2])
m = tiered.load(d, device="cpu", ring_gb=ring, io="mmap")
for f in sorted(d.glob("*.safetensors")):
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
try:
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))
except tiered.TieredError as e:
    print(type(e).__name__, e)
"""


def test_shard_truncated_under_mmap_is_an_error_not_sigbus(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    r = run_child(TRUNCATE_MMAP, str(d), str(ring))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7 is SIGBUS
    assert "TruncatedShardError" in r.stdout and "while the model was loaded" in r.stdout, r.stdout


@pytest.mark.parametrize("how", ["rewritten", "replaced"])
def test_shard_changed_under_a_loaded_model(how: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    with stream(d) as m, torch.no_grad():
        m(make_ids(0, (2, 10)))
        shard = sorted(d.glob("*.safetensors"))[1]
        data = shard.read_bytes()
        if how == "rewritten":  # same size, new bytes in place (mtime changes)
            time.sleep(0.01)
            with open(shard, "r+b") as f:
                f.write(data)
        else:  # a new file renamed over the old one
            (d / "new").write_bytes(data)
            os.replace(d / "new", shard)
        with pytest.raises(ShardChangedError, match=how if how == "rewritten" else "replaced"):
            for _ in range(2):
                m(make_ids(0, (2, 10)))


# ---------------------------------------------------------------------------------------------- faults in the workers


def test_read_fault_surfaces_in_forward_and_the_next_call_works(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        calls = {"n": 0}

        def eio(**info):
            calls["n"] += 1
            raise OSError(5, f"Input/output error (injected at {info['tensor']} offset {info['offset']})")

        with faults.inject("read", eio), pytest.raises(StreamerError) as e:
            m(make_ids(0, (2, 10)))
        assert calls["n"] >= 1 and isinstance(e.value.__cause__, OSError) and "injected" in str(e.value.__cause__)
        assert not m._tiered.streamer.held
        for _ in range(2):
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)


def test_stage_fault_surfaces_in_forward_and_the_next_call_works(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        def fail(**info):
            raise RuntimeError(f"copy failed (injected, {info['unit']})")

        with faults.inject("stage", fail), pytest.raises(StreamerError, match="injected"):
            m(make_ids(0, (2, 10)))
        assert torch.equal(m(make_ids(0, (2, 10))).logits, want)


def test_exception_inside_a_layer_leaves_the_model_usable(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        h = m.model.layers[1].mlp.register_forward_hook(lambda *a: (_ for _ in ()).throw(ValueError("in a layer")))
        with pytest.raises(ValueError, match="in a layer"):
            m(make_ids(0, (2, 10)))
        h.remove()
        assert not m._tiered.streamer.held
        assert torch.equal(m(make_ids(0, (2, 10))).logits, want)


def test_fault_points_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        with faults.inject("nowhere", lambda **k: None):
            pass


def test_failed_conversion_waits_for_the_units_copies(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit whose conversion fails must not free its slot while its copies still write into it:
    read_unit returns (raises) only after every copy of the unit has finished."""
    import tiered.plan

    monkeypatch.setattr(tiered.plan, "_place_converter", lambda *a, **k: None)  # experts: converted at read time
    d = ckpts["mixtral"]
    copies_done: list[tuple[str, float]] = []
    failed: list[str] = []

    def fault(**info) -> None:
        if threading.current_thread().name.startswith("tiered-read"):
            time.sleep(0.2)  # a slow copy of the unit's dense weights
            copies_done.append((info["unit"], time.perf_counter()))
        else:
            failed.append(info["unit"])
            raise OSError(5, "conversion source unreadable (injected)")

    with tiered.load(d, device="cpu", ring_gb=1.0, prefetch=0) as probe:
        ring = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=ring, prefetch=0) as m, torch.no_grad():
        with faults.inject("read", fault), pytest.raises(StreamerError, match="conversion source"):
            m(make_ids(0, (2, 10)))
        raised = time.perf_counter()
        mine = [t for u, t in copies_done if u == failed[0]]
        assert mine and max(mine) <= raised, "the failed unit's slot was freed under a running copy"


# --------------------------------------------------------------------------- checkpoint extras, tensors the model needs


def _rewrite(f: Path, edit) -> None:
    """Rewrite shard ``f``: ``edit(header: dict, data: bytearray)`` changes the JSON header and data section."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = bytearray(raw[8 + n :])
    edit(header, data)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))


def _append(name: str, dtype: str, shape: list[int], payload: bytes):
    def edit(header: dict, data: bytearray) -> None:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data.extend(payload)

    return edit


def _index_add(d: Path, name: str, shard: str) -> None:
    idx = d / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"][name] = shard
    idx.write_text(json.dumps(doc))


def _shard_of(d: Path, key: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.mark.parametrize("odd", ["index-names-absent", "extra-fields", "F4", "F6_E2M3", "C64", "F8_E8M0"])
def test_checkpoint_extras_the_model_does_not_need_warn_and_load(odd: str, llama_ref, tmp_path: Path) -> None:
    d0, want = llama_ref
    d = Path(shutil.copytree(d0, tmp_path / "m"))
    shard = sorted(d.glob("*.safetensors"))[0]
    if odd == "index-names-absent":  # multi-token-prediction weights some hub checkpoints list but do not ship
        _index_add(d, "mtp.layers.0.eh_proj.weight", shard.name)
        match = "no shard holds"
    elif odd == "extra-fields":
        _rewrite(shard, lambda h, data: [v.update({"quant": "none", "group": 1}) for k, v in h.items()
                                         if k != "__metadata__"])
        match = None
    else:
        size = {"F4": 16, "F6_E2M3": 24, "C64": 256, "F8_E8M0": 32}[odd]
        _rewrite(shard, _append(f"mtp.{odd}.scale", odd, [32], bytes(i % 251 + 1 for i in range(size))))
        _index_add(d, f"mtp.{odd}.scale", shard.name)
        match = "skipped" if odd.startswith(("F4", "F6")) else "not used"
    assert safetensors_accepts(shard)
    if match is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m = tiered.load(d, device="cpu", ring_gb=1.0)
    else:
        with pytest.warns(UserWarning, match=match):
            m = tiered.load(d, device="cpu", ring_gb=1.0)
    with m, torch.no_grad():
        assert torch.equal(m(make_ids(0, (2, 10))).logits, want)


def safetensors_accepts(f: Path) -> bool:
    from safetensors import safe_open

    with safe_open(f, "pt") as st:
        return len(list(st.keys())) > 0


def test_needed_tensor_the_index_names_but_no_shard_holds(ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    key = "model.layers.1.mlp.up_proj.weight"
    shard = _shard_of(d, key)
    _rewrite(shard, lambda h, data: h.pop(key) and _fix_cover(h, data))
    with pytest.raises(MissingTensorError, match=r"index.json names tensor 'model.layers.1.mlp.up_proj.weight'"):
        tiered.load(d, device="cpu", ring_gb=1.0)


def _fix_cover(header: dict, data: bytearray) -> None:
    """Re-pack the data section after an entry was removed (offsets cover it exactly again)."""
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
    out = bytearray()
    for _, v in entries:
        a, b = v["data_offsets"]
        chunk = data[a:b]
        v["data_offsets"] = [len(out), len(out) + len(chunk)]
        out.extend(chunk)
    data[:] = out


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [("F4", [64], 32), ("C64", [64], 512)])
def test_needed_tensor_with_a_dtype_torch_cannot_use_names_it(dtype: str, shape: list[int], nbytes: int,
                                                              ckpts: Checkpoints, tmp_path: Path) -> None:
    d = ckpts.copy("llama", tmp_path / "m")
    key = "model.norm.weight"  # (64,) bf16
    shard = _shard_of(d, key)

    def edit(h: dict, data: bytearray) -> None:
        h.pop(key)
        _fix_cover(h, data)
        _append(key, dtype, shape, bytes(i % 251 + 1 for i in range(nbytes)))(h, data)

    _rewrite(shard, edit)
    with pytest.raises(UnsupportedDtypeError, match=rf"model.norm.weight.*{dtype if dtype == 'F4' else 'complex'}"):
        tiered.load(d, device="cpu", ring_gb=1.0)


# ---------------------------------------------------------------------------------------------- hostile


SHARD_CHILD = """
import json, os, shutil, sys, torch, tiered
from conftest import experts_case, load_routed, make_ids
torch.set_num_threads(2)
moe_src, dense_src, work = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
for n, (what, io) in enumerate(json.loads(sys.argv[4])):
    print("scenario", what, io, flush=True)  # the last one printed is the one that crashed, if any
    d = shutil.copytree(moe_src if what.startswith("experts") else dense_src, os.path.join(work, str(n)))
    if what.startswith("experts"):
        try:
            m = load_routed(d, io=io)
        except tiered.ConfigError:  # no O_DIRECT on this file system
            continue
        eg = m._tiered.experts[-1]
        target = str(max((i for p in eg.spec.parts for per in p.per for i, _ in per), key=lambda i: i.offset).file)
    else:
        m = tiered.load(d, device="cpu", ring_gb=0.00025, io=io)  # one layer: units stream, the ring bounds them
        assert tiered.stats(m).mapped_units > 0
        target = os.path.join(d, sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[-1])
    ids = make_ids(15)
    res = out[what + "-" + io] = {}
    with torch.no_grad():
        m(ids)  # prefetches the next pass's first units (views of the mapping on zero copy)
        size = os.path.getsize(target)
        if what.endswith("replace"):
            shutil.copyfile(target, target + ".tmp"); os.replace(target + ".tmp", target)
        elif what.endswith("touch"):
            st = os.stat(target); os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        elif what.endswith("truncate"):
            with open(target, "r+b") as f:
                f.truncate(size // 2)
        for k in range(2):
            try:
                if what.startswith("experts") and k == 1:
                    eg.spec.module(*experts_case(1, 3, eg.spec.num_experts))  # the module directly
                else:
                    m.generate(ids, max_new_tokens=2, do_sample=False)
                res[k] = "ok"
            except tiered.TieredError as e:
                msg = str(e) + str(e.__cause__ or "")
                res[k] = [type(e).__name__, type(e.__cause__).__name__, os.path.basename(target) in msg]
        m.close()
print(json.dumps(out))
"""

SHARD_CASES = [("experts-replace", "mmap"), ("experts-touch", "pread"), ("experts-truncate", "mmap"),
               ("experts-truncate", "direct"), ("mapped-truncate", "mmap"), ("mapped-replace", "mmap"),
               ("mapped-touch", "mmap")]


class TestHostileChangedShards:
    """Shards replaced, rewritten (mtime) or truncated after a call, under routed experts, zero-copy (mapped) units
    and ``io="pread"``: the next call raises a tiered error naming the file, never zeros, a hang or SIGBUS (child
    processes where a mapping is read)."""

    def test_shard_changed_between_calls_is_a_clear_error(self, ckpts, tmp_path):
        """Expert shards and zero-copy (mapped) shards replaced / rewritten (mtime) / truncated after a call: the next
        model call and a direct experts call raise a tiered error naming the file; never SIGBUS (a child process)."""
        out = run_child(SHARD_CHILD, str(ckpts["mixtral"]), str(ckpts["llama"]), str(tmp_path), json.dumps(SHARD_CASES),
                        timeout=240)
        assert out.returncode == 0, (out.returncode, out.stdout[-500:], out.stderr[-3000:])  # never SIGBUS
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(res) >= len(SHARD_CASES) - 1, res  # (direct I/O may be unsupported)
        for case, r in res.items():
            for k in ("0", "1"):
                assert isinstance(r[k], list), (case, r)  # an error, not a silent success on a changed file
                name, cause, names_file = r[k]
                assert {name, cause} & {"ShardChangedError", "TruncatedShardError"}, (case, r)
                assert names_file, (case, r)


    def test_pread_truncated_shard_is_an_error(self, ckpts, tmp_path, monkeypatch):
        """A shard truncated under a loaded io="pread" model: TruncatedShardError naming it (caught by the shard
        check, and by the short read itself when the truncation races the check), never zeros or a hang."""
        d = ckpts.copy("llama", tmp_path / "m")
        ids = ids_for(0)
        ref = STOCK(d)
        with torch.no_grad():
            want = ref(ids).logits
        shards = sorted(d.glob("*.safetensors"))
        victim = shards[len(shards) // 2]
        with tiered.load(d, ring_gb=plan_ring_gb(d), device="cpu", io="pread") as m:
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)
            monkeypatch.setattr(tiered.reader.ShardMap, "check", lambda self: None)  # the race: check passed, then
            os.truncate(victim, victim.stat().st_size - 100)
            with pytest.raises(tiered.TruncatedShardError, match=victim.name):
                with torch.no_grad():
                    m(ids)
            monkeypatch.undo()
            with pytest.raises(tiered.TruncatedShardError, match="truncated"):
                with torch.no_grad():
                    m(ids)
        with pytest.raises(tiered.TruncatedShardError):
            tiered.load(d, ring_gb=0.01, device="cpu", io="pread")

