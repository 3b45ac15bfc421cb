"""tiered vs stock transformers, bit for bit, resident and streamed, on tiny random checkpoints and a real one; odd
cases of the same promise: outputs that alias weights, dtype plans (``_keep_in_fp32_modules``), zero-size and scalar
tensors, casts from misaligned sources (every reader backend), submodules of a streamed unit called directly; a model
directory loaded as stock loads it (default dtype, generation config, custom code with ``trust_remote_code``)."""

from __future__ import annotations

import json
import warnings
from contextlib import nullcontext
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import STOCK, Checkpoints, greedy, ids_for, logits_of, make_ids, plan_ring_gb, sgd_step, stream, streaming_ring_gb
from models import BUILDERS, MLPStack
from safetensors.torch import load_file, save_file
from torch import nn

import tiered
from tiered.format import encode_header, open_checkpoint
from tiered.lifecycle import _closed
from tiered.placeholder import is_placeholder

ALL = list(BUILDERS)
CAUSAL = [n for n, (_, _, _, causal) in BUILDERS.items() if causal]
MODES = ["resident", "streamed"]
RESIDENT_GB = 1.0  # far more than any test checkpoint: everything stays in the ring
GiB = 1 << 30


def _inputs(causal: bool) -> dict[str, torch.Tensor]:
    ids = make_ids(0, (2, 10))
    mask = torch.ones_like(ids)
    if not causal:
        mask[1, -3:] = 0  # padding in the second row: exercises the attention mask
    return {"input_ids": ids, "attention_mask": mask}


class References:
    """Stock ``from_pretrained`` models and their outputs, computed once per checkpoint."""

    def __init__(self, ckpts: Checkpoints) -> None:
        self.ckpts = ckpts
        self.models: dict[str, torch.nn.Module] = {}
        self.outputs: dict[str, object] = {}
        self.generated: dict[str, torch.Tensor] = {}
        self.rings: dict[str, float] = {}

    def model(self, name: str) -> torch.nn.Module:
        if name not in self.models:
            self.models[name] = STOCK(self.ckpts[name], auto=BUILDERS[name][2])
        return self.models[name]

    def output(self, name: str):
        if name not in self.outputs:
            with torch.no_grad():
                self.outputs[name] = self.model(name)(**_inputs(BUILDERS[name][3]))
        return self.outputs[name]

    def generate(self, name: str) -> torch.Tensor:
        if name not in self.generated:
            self.generated[name] = _generate(self.model(name))
        return self.generated[name]

    def ring_gb(self, name: str) -> float:
        """A ring that streams ``name`` (holds ~3 units, not the whole model)."""
        if name not in self.rings:
            with tiered.load(self.ckpts[name], device="cpu", ring_gb=RESIDENT_GB) as m:
                self.rings[name] = streaming_ring_gb(m)
        return self.rings[name]


def _generate(model: torch.nn.Module) -> torch.Tensor:
    inp = _inputs(True)
    with torch.no_grad():
        return model.generate(**inp, max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="session")
def refs(ckpts: Checkpoints) -> References:
    return References(ckpts)


def _load(name: str, mode: str, ckpts: Checkpoints, refs: References, **kw) -> torch.nn.Module:
    ring = kw.pop("ring_gb", None) or (RESIDENT_GB if mode == "resident" else refs.ring_gb(name))
    return tiered.load(ckpts[name], device="cpu", ring_gb=ring, **kw)


def _check_mode(m: torch.nn.Module, mode: str) -> None:
    s = tiered.stats(m).snapshot()
    assert s["units"] == len(m._tiered.plan.units) > 0
    if mode == "resident":
        assert s["resident_units"] == s["units"], s
        assert s["misses"] == 0 and s["hits"] == 0, s
        # loaded exactly once; a tied head is bound to its embedding's tensors, not read again
        twins = m._tiered.streamer.resident_twins
        assert s["read_bytes"] == sum(u.src_bytes for u in m._tiered.plan.units if u.index not in twins), s
    else:
        assert s["resident_units"] == 0, s
        assert s["hits"] > 0, s
        assert s["read_bytes"] > sum(u.src_bytes for u in m._tiered.plan.units), s  # 2 passes: read twice
        assert s["ring_high_water"] <= s["ring_bytes"], s


# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", ALL)
def test_buffers_match_from_pretrained(name: str, ckpts: Checkpoints, refs: References) -> None:
    """Buffers computed at construction (rotary tables, position ids) equal from_pretrained's.

    from_pretrained recomputes non-persistent buffers after loading (``initialize_weights``, in the default
    fp32); a model built under ``dtype=fp16/bf16`` computes them in that dtype instead.
    """
    want = dict(refs.model(name).named_buffers())
    with tiered.load(ckpts[name], device="cpu", ring_gb=RESIDENT_GB) as m:
        got = dict(m.named_buffers())
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k].dtype == v.dtype, k
            assert torch.equal(got[k], v), f"buffer {k}: max diff {(got[k].double() - v.double()).abs().max()}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALL)
def test_forward_and_generate_match_transformers(name: str, mode: str, ckpts: Checkpoints, refs: References) -> None:
    causal = BUILDERS[name][3]
    ref = refs.output(name)
    with _load(name, mode, ckpts, refs) as m:
        assert type(m).__name__ == type(refs.model(name)).__name__
        assert m.dtype == refs.model(name).dtype
        assert m.device == torch.device("cpu")
        for _ in range(2):  # the second pass streams everything again (or reuses the resident set)
            with torch.no_grad():
                out = m(**_inputs(causal))
            if causal:
                assert torch.equal(out.logits, ref.logits), (out.logits - ref.logits).abs().max()
            else:
                assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
                assert torch.equal(out.pooler_output, ref.pooler_output)
        if causal:
            gen = _generate(m)
            want = refs.generate(name)
            assert gen.shape == want.shape and torch.equal(gen, want), (gen, want)
            assert (gen[:, -8:] != gen[:, -9:-8]).any(), "degenerate generation: weights too small?"
        _check_mode(m, mode)
        text = str(tiered.stats(m))
        assert "hits/misses" in text and "GiB" in text


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_streamed_prefetch_depths(prefetch: int, ckpts: Checkpoints, refs: References) -> None:
    ref = refs.output("llama")
    with _load("llama", "streamed", ckpts, refs, prefetch=prefetch, threads=1) as m:
        with torch.no_grad():
            out = m(**_inputs(True))
        assert torch.equal(out.logits, ref.logits)
        s = tiered.stats(m).snapshot()
        assert s["resident_units"] == 0
        if prefetch == 0:
            assert s["hits"] == 0 and s["misses"] == s["units_streamed"] > 0, s


def test_tied_head_stays_tied_to_its_embedding_when_the_model_stays_whole(ckpts: Checkpoints,
                                                                          refs: References) -> None:
    """A tied model that fits the ring keeps stock's tie: the head's weight *is* the embedding's Parameter (one tensor,
    read once, one ring slot), not an equal copy in a slot of its own; outputs stay stock's bits. The default ring is
    the model's distinct bytes, not the embedding twice."""
    d = ckpts["llama_tied_single"]
    ref = refs.model("llama_tied_single")
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # what stock does
    with tiered.load(d, device="cpu", ring_gb=RESIDENT_GB) as m, torch.no_grad():
        s = tiered.stats(m)
        assert s.resident_units == s.units and m.lm_head.weight is m.model.embed_tokens.weight
        assert s.read_bytes == s.model_bytes  # the tied table read once
        assert s.resident_bytes <= s.ring_bytes  # and counted once among the resident bytes
        assert s.ring_high_water <= sum(-(-u.nbytes // 4096) * 4096 for u in m._tiered.plan.units
                                        if u.name != "lm_head")
        assert torch.equal(m(**_inputs(True)).logits, refs.output("llama_tied_single").logits)
    assert is_placeholder(m.lm_head.weight) and is_placeholder(m.model.embed_tokens.weight)  # both unbound at close
    with tiered.load(d, device="cpu") as m:  # the default ring holds it whole: sized without the twin's slot
        whole = sum(-(-u.nbytes // 4096) * 4096 for u in m._tiered.plan.units)
        head = next(u for u in m._tiered.plan.units if u.name == "lm_head")
        assert tiered.stats(m).resident_units == tiered.stats(m).units
        assert m._tiered.ring.size <= whole - (-(-head.nbytes // 4096) * 4096), (m._tiered.ring.size, whole)


@pytest.mark.parametrize("equal", [True, False])
def test_a_tied_head_stored_beside_its_embedding_is_tied_as_stock_ties_it(equal: bool, tmp_path: Path) -> None:
    """A tied model whose checkpoint also holds ``lm_head.weight`` (as a converted ``.bin`` does): from_pretrained ties
    the two when both are ``torch.equal`` and keeps two Parameters when they differ. Loaded whole on the CPU, tiered
    does the same: the same Parameter objects, the same logits, and the same logits after one SGD step (which a tie
    and two copies give differently). Before: two Parameters either way (the attack of 2026-12-06)."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    d = models.save_model(model, tmp_path / "tied_both", seed=31, dtype=model.dtype, max_shard_size=None)
    st = load_file(d / "model.safetensors")
    emb = st["model.embed_tokens.weight"]
    st["lm_head.weight"] = emb.clone() if equal else emb + 0.25
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    ids = make_ids(3, (1, 6))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == equal  # stock's rule
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    with tiered.load(d, device="cpu", ring_gb=RESIDENT_GB) as m:
        m.eval()
        assert tiered.stats(m).resident_units == tiered.stats(m).units
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == equal
        assert dict(m.all_tied_weights_keys) == dict(ref.all_tied_weights_keys)  # stock drops an unequal pair
        assert len(list(m.parameters())) == len(list(ref.parameters()))
        with torch.no_grad():
            assert torch.equal(m(input_ids=ids).logits, want)
        assert torch.equal(sgd_step(m, ids), sgd_step(ref, ids))


def test_a_bert_mlm_head_keeps_stocks_ties_across_and_inside_units(tmp_path: Path) -> None:
    """BertForMaskedLM ties ``cls.predictions.decoder.weight`` to the word embeddings (another unit, not a whole twin)
    and ``cls.predictions.bias`` to ``decoder.bias`` (inside one unit): loaded whole on the CPU, both are stock's one
    Parameter each, and one SGD step gives stock's logits bit for bit. Before: 44 Parameters against stock's 42."""
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    models.save_model(model, tmp_path / "mlm", seed=32, dtype=model.dtype, max_shard_size=None)
    ref = transformers.BertForMaskedLM.from_pretrained(tmp_path / "mlm").eval()
    ids = make_ids(4, (1, 7)) % 128
    with tiered.load(tmp_path / "mlm", device="cpu", ring_gb=RESIDENT_GB,
                     model_class=transformers.BertForMaskedLM) as m:
        m.eval()
        head = m.cls.predictions
        assert head.decoder.weight is m.bert.embeddings.word_embeddings.weight
        assert head.bias is head.decoder.bias
        assert len(list(m.parameters())) == len(list(ref.parameters()))
        with torch.no_grad():
            assert torch.equal(m(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert torch.equal(sgd_step(m, ids), sgd_step(ref, ids))


def _tiny_t5(d: Path, *, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny tied T5 (vocab 64, seeded random weights) saved to ``d``; returns ``d`` and its stored tensors, for the
    test to edit and save back."""
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                tie_word_embeddings=True, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    models.save_model(model, d, seed=seed, dtype=model.dtype, max_shard_size=None)
    return d, load_file(d / "model.safetensors")


@pytest.mark.parametrize("equal", [True, False])
def test_t5_without_its_shared_embedding_takes_stocks_tie_sources(equal: bool, tmp_path: Path) -> None:
    """A T5 checkpoint that stores ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight`` but not
    ``shared.weight`` (tied by the config; ``lm_head`` too): stock's ``tie_weights`` fills ``shared`` and the head from
    the encoder's tensor (the first stored target of ``shared`` in ``all_tied_weights_keys``' order, after the head's
    own pair), ties the decoder's only if equal, and drops an unequal pair from ``all_tied_weights_keys``. tiered,
    streamed and whole: the same logits, the same tie map, whole on the CPU the same Parameters and the same logits
    after one SGD step. Before: the head read the decoder's tensor (first sorted of the shared group): wrong logits."""
    d, st = _tiny_t5(tmp_path / "t5", seed=33)
    emb = st.pop("shared.weight")
    assert "lm_head.weight" not in st and "encoder.embed_tokens.weight" not in st
    st["encoder.embed_tokens.weight"] = emb
    st["decoder.embed_tokens.weight"] = emb.clone() if equal else emb + 0.25
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    ids, dec = make_ids(5, (1, 7)) % 64, make_ids(6, (1, 5)) % 64
    ref = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
    assert torch.equal(ref.lm_head.weight, emb) and (ref.decoder.embed_tokens.weight is ref.shared.weight) == equal
    with torch.no_grad():
        want = ref(input_ids=ids, decoder_input_ids=dec).logits

    rings = [RESIDENT_GB]
    for ring_gb in rings:
        with pytest.warns(UserWarning, match="not tied") if not equal else nullcontext():
            m = tiered.load(d, device="cpu", ring_gb=ring_gb)
        with m:
            m.eval()
            assert dict(m.all_tied_weights_keys) == dict(ref.all_tied_weights_keys)
            with torch.no_grad():
                assert torch.equal(m(input_ids=ids, decoder_input_ids=dec).logits, want)
            if ring_gb == RESIDENT_GB:
                assert tiered.stats(m).resident_units == tiered.stats(m).units
                names = [k for k, _ in ref.named_parameters(remove_duplicate=False)]
                same = {(a, b) for a in names for b in names if ref.get_parameter(a) is ref.get_parameter(b)}
                assert {(a, b) for a in names for b in names if m.get_parameter(a) is m.get_parameter(b)} == same
                rings.append(streaming_ring_gb(m))
                assert torch.equal(sgd_step(m, ids, dec), sgd_step(ref, ids, dec))
            else:
                assert tiered.stats(m).resident_units < tiered.stats(m).units


def test_two_declined_ties_with_equal_values_stay_two_parameters_as_in_stock(tmp_path: Path) -> None:
    """A T5 checkpoint with ``shared.weight`` = X and both ``encoder.embed_tokens.weight`` and
    ``decoder.embed_tokens.weight`` = X + 0.25 (stored twice), no ``lm_head.weight``: stock declines both embedding
    pairs (two warnings), ties the head to ``shared`` and keeps the encoder's and decoder's embeddings two Parameters,
    though equal. Loaded whole on the CPU, tiered gives the same Parameter identities, the same count, the same tie
    map, and the same logits after one SGD step (one shared embedding would take both gradients). Before: the two
    declined keys came back through the meta model's identity groups and were tied (48 Parameters against 49; the
    attack of 2026-12-06). The warning names this file (the caller's frame), not tiered's."""
    d, st = _tiny_t5(tmp_path / "t5_declined", seed=34)
    x = st["shared.weight"]
    assert "lm_head.weight" not in st
    st["encoder.embed_tokens.weight"] = x + 0.25
    st["decoder.embed_tokens.weight"] = x + 0.25
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    ids, dec = make_ids(7, (1, 7)) % 64, make_ids(8, (1, 5)) % 64
    ref = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
    assert ref.encoder.embed_tokens.weight is not ref.decoder.embed_tokens.weight  # stock's rule, checked here
    assert ref.lm_head.weight is ref.shared.weight

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = tiered.load(d, device="cpu", ring_gb=RESIDENT_GB)
    declined = [w for w in caught if "not tied" in str(w.message)]
    assert len(declined) == 2 and all(w.filename == __file__ for w in declined)
    with m:
        m.eval()
        assert tiered.stats(m).resident_units == tiered.stats(m).units
        assert dict(m.all_tied_weights_keys) == dict(ref.all_tied_weights_keys)
        names = [k for k, _ in ref.named_parameters(remove_duplicate=False)]
        same = {(a, b) for a in names for b in names if ref.get_parameter(a) is ref.get_parameter(b)}
        assert {(a, b) for a in names for b in names if m.get_parameter(a) is m.get_parameter(b)} == same
        assert len(list(m.parameters())) == len(list(ref.parameters()))
        with torch.no_grad():
            assert torch.equal(m(input_ids=ids, decoder_input_ids=dec).logits,
                               ref(input_ids=ids, decoder_input_ids=dec).logits)
        assert torch.equal(sgd_step(m, ids, dec), sgd_step(ref, ids, dec))


def test_weights_sit_where_stocks_mmap_puts_them_so_alignment_sensitive_kernels_agree(tmp_path: Path) -> None:
    """Stock (transformers 5 on the CPU) keeps a same-dtype tensor in the safetensors file's mmap, so its address
    modulo 64 is its file offset's; some CPU kernels round differently at other alignments. JetMoe's experts'
    ``F.linear`` gave logits up to 1.5e-7 off stock's when tiered placed every target 64-aligned in its ring (the
    attack of 2026-12-06). Now a whole same-dtype target sits at its file offset's residue modulo 64: logits bitwise
    equal, whole and streamed; and stock's own model with its weights cloned into fresh (64-aligned) memory differs,
    so this test can fail."""
    cfg = transformers.JetMoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, kv_channels=8,
                                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                                    tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(cfg)
    d = models.save_model(model, tmp_path / "jetmoe", seed=35, dtype=model.dtype, max_shard_size=None)
    ids = make_ids(10, (1, 6)) % 96
    ref = transformers.JetMoeForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        moved = transformers.JetMoeForCausalLM.from_pretrained(d).eval()
        for p in moved.parameters():
            p.data = p.data.clone()
        assert not torch.equal(moved(input_ids=ids).logits, want), "no alignment-sensitive kernel here: vacuous"
    for ring_gb in (RESIDENT_GB, None):
        m = tiered.load(d, device="cpu", ring_gb=ring_gb or RESIDENT_GB)
        if ring_gb is None:
            ring = streaming_ring_gb(m)
            m.close()
            m = tiered.load(d, device="cpu", ring_gb=ring)
        with m, torch.no_grad():
            st = tiered.stats(m)
            assert (st.resident_units == st.units) == (ring_gb is not None)
            assert torch.equal(m(input_ids=ids).logits, want), ring_gb


def test_checkpoint_really_differs_between_models(ckpts: Checkpoints, refs: References) -> None:
    """Guard against a vacuous pass: different seeds give different logits, so equality above means something."""
    a = refs.output("llama").logits
    b = refs.output("llama_tied_single").logits
    assert not torch.equal(a, b)
    assert a.abs().max() > 0 and a.std() > 0


# ---------------------------------------------------------------------------------------------- dtype cast


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_dtype_cast_matches_from_pretrained(dtype, mode: str, ckpts: Checkpoints, refs: References) -> None:
    d = ckpts["llama_fp32"]
    assert load_file(next(d.glob("*.safetensors")).as_posix()).popitem()[1].dtype == torch.float32
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = ref(**_inputs(True)).logits
    with _load("llama_fp32", mode, ckpts, refs, dtype=dtype) as m:
        assert m.dtype == torch.bfloat16
        with torch.no_grad():
            got = m(**_inputs(True)).logits
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        assert torch.equal(_generate(m), _generate(ref))


# ---------------------------------------------------------------------------------------------- real checkpoint


SENTENCES = [
    "Weights stay on NVMe in safetensors shards.",
    "A small fixed ring of host memory bounds the resident set size.",
    "hello",
]


@pytest.mark.parametrize("mode", MODES)
def test_all_minilm_l6_v2_matches_transformers(mode: str, minilm_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        want = ref(**batch)

    def pool(h: torch.Tensor) -> torch.Tensor:  # mean over real tokens: (B, T, H) -> (B, H)
        mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)

    ring = RESIDENT_GB
    if mode == "streamed":
        with tiered.load(minilm_dir, device="cpu", ring_gb=RESIDENT_GB) as m:
            ring = streaming_ring_gb(m)
    with tiered.load(minilm_dir, device="cpu", ring_gb=ring) as m:
        assert type(m).__name__ == "BertModel"
        for _ in range(2):
            with torch.no_grad():
                got = m(**batch)
            assert torch.equal(got.last_hidden_state, want.last_hidden_state)
            assert torch.equal(got.pooler_output, want.pooler_output)
        emb, ref_emb = pool(got.last_hidden_state), pool(want.last_hidden_state)
        assert torch.equal(emb, ref_emb)
        sims = emb @ emb.T
        assert sims.diagonal().allclose(torch.ones(3)) and not torch.equal(emb[0], emb[1])  # sane embeddings
        _check_mode(m, mode)


# ---------------------------------------------------------------------------------------------- attach


@pytest.fixture(scope="session")
def mlp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(11)
    ref = MLPStack()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    assert all(p.abs().sum() > 0 for p in ref.parameters())
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, d / "model.safetensors")
    return d


@pytest.mark.parametrize("ring_gb", [RESIDENT_GB, 160 * 1024 / 2**30])  # 160 KiB: ~2 blocks of 66 KiB
def test_attach_plain_module(ring_gb: float, mlp_dir: Path) -> None:
    ref = MLPStack()
    ref.load_state_dict(load_file(mlp_dir / "model.safetensors"))
    ref.eval()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(x)
    with torch.device("meta"):
        mod = MLPStack()
    assert all(is_placeholder(p) for p in mod.parameters())
    m = tiered.attach(mod, mlp_dir, ring_gb=ring_gb, device="cpu")
    assert m is mod
    try:
        assert {u.name for u in m._tiered.plan.units} >= {"blocks.0", "blocks.3", "norm", "head"}
        for _ in range(2):
            with torch.no_grad():
                got = m(x)
            assert torch.equal(got, want)
        s = tiered.stats(m).snapshot()
        if ring_gb == RESIDENT_GB:
            assert s["resident_units"] == s["units"]
        else:
            assert s["resident_units"] == 0 and s["hits"] > 0, s
            assert all(is_placeholder(p) for p in m.parameters())  # unbound between passes
    finally:
        m.close()


class _SharedHead(nn.Module):
    """A plain module whose head shares the embedding's weight (one ``nn.Parameter`` in two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(3))
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


@pytest.mark.parametrize("saved_as", ["save_model", "head.weight"])
@pytest.mark.parametrize("ring_gb", [RESIDENT_GB, 80 * 1024 / GiB])  # 80 KiB: one block (33 KiB) at a time
def test_attach_plain_module_with_a_shared_parameter(saved_as: str, ring_gb: float, tmp_path: Path) -> None:
    """``safetensors.torch.save_model`` stores a shared parameter once, under one of its names (``emb.weight``);
    ``load_model`` fills the other. ``tiered.attach`` binds both from that one tensor, whichever name was stored
    (``head.weight``: the file written by hand with the other name), and gives ``load_model``'s outputs bit for bit.
    Before the fix: MissingTensorError about config.json."""
    from safetensors.torch import load_model, save_model

    torch.manual_seed(5)
    src = _SharedHead()
    with torch.no_grad():
        for prm in src.parameters():
            prm.copy_(torch.randn_like(prm) * 0.2 + (1.0 if prm.dim() == 1 else 0.0))
    if saved_as == "save_model":
        save_model(src, str(tmp_path / "model.safetensors"))
    else:
        sd = {k: v.contiguous() for k, v in src.state_dict().items() if k != "emb.weight"}
        save_file(sd, tmp_path / "model.safetensors")
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert ("emb.weight" in keys) != ("head.weight" in keys), keys  # stored once
    ref = _SharedHead()
    missing, unexpected = load_model(ref, tmp_path / "model.safetensors", strict=True)
    assert not missing and not unexpected
    ref.eval()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids)
    assert want.abs().sum() > 0
    with torch.device("meta"):
        mod = _SharedHead()
    with tiered.attach(mod, tmp_path, ring_gb=ring_gb, device="cpu", embedding_rows=False) as m, torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(ids), want)
        s = tiered.stats(m)
        assert (s.resident_units == s.units) == (ring_gb == RESIDENT_GB), s.snapshot()


# ---------------------------------------------------------------------------------------------- hybrid stacks

#: checkpoint (conftest SHARED_BUILDERS) -> its decoder layer list: mixed layer classes, or one layer
HYBRID = {
    "jamba": "model.layers",  # Mamba and attention layers (MoE on odd ones)
    "zamba": "model.layers",  # Mamba and hybrid layers (a shared attention block, tied)
    "mllama": "model.language_model.layers",  # self- and cross-attention layers; the vision tower's 1-layer list
    "falcon_h1_one_layer": "model.layers",  # a stack of one layer
}


def _hybrid_stock(name: str, d: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import models

    if name == "mllama":  # an image and its tokens: the cross-attention layer runs
        return STOCK(d, auto=transformers.MllamaForConditionalGeneration), models.mllama_inputs()
    return STOCK(d), {"input_ids": make_ids(0)}


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_stack_streams_per_layer(name: str, io: str, ckpts: Checkpoints) -> None:
    """A decoder stack mixing layer classes (Jamba, Zamba, Mllama's language model) or holding one layer is split
    into one unit per layer (tiered/units.py), so a ring that holds the largest layer but not the stack runs it:
    every layer streams, and the logits equal stock ``from_pretrained``'s bit for bit, twice. Before the fix the
    stack was one unit: ``io="pread"`` refused with RingTooSmallError for ``<root>``."""
    from tiered.hostmem import PAGE_SIZE, page_up
    from tiered.meta import meta_model_from_dir
    from tiered.plan import build_plan

    d = ckpts[name]
    ref, inputs = _hybrid_stock(name, d)
    with torch.no_grad():
        want = ref(**inputs).logits
    assert want.abs().sum() > 0
    stack = HYBRID[name]
    n = len(ref.get_submodule(stack))
    plan = build_plan(meta_model_from_dir(d), open_checkpoint(d), align=64)
    layer_units = {u.index for u in plan.units if u.name in {f"{stack}.{i}" for i in range(n)}}
    assert len(layer_units) == n, [u.name for u in plan.units]
    ring = page_up(max(u.nbytes for u in plan.units)) + PAGE_SIZE
    assert ring < sum(page_up(plan.units[i].nbytes) for i in layer_units) or n == 1  # smaller than the stack
    assert ring < sum(page_up(u.nbytes) for u in plan.units)  # and than the model
    with tiered.load(d, device="cpu", ring_gb=ring / GiB, io=io) as m, torch.no_grad():
        p = tiered.stats(m).placement
        assert tiered.stats(m).units == len(plan.units)
        assert layer_units <= set(p.streamed), (p.streamed, p.resident)
        for _ in range(2):
            assert torch.equal(m(**inputs).logits, want)
        assert tiered.stats(m).units_streamed >= n


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.q(self.norm(x))


class _Ffn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _ReadHead(nn.Module):
    """Reads its list's weights without calling them: the list must not be split out of this module's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(64, 64), nn.LayerNorm(64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.parts[0].weight * self.parts[1].weight[:, None]
        return x @ w.T + self.parts[0].bias + self.parts[1].bias


class _PlainHybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attn(), _Ffn(), _Attn(), _Ffn()])  # mixed classes: a unit each
        self.last = nn.ModuleList([_Ffn()])  # one block: a unit
        self.head = _ReadHead()  # leaves read, not called: one unit with their reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lay in [*self.layers, *self.last]:
            x = lay(x)
        return self.head(x)


def test_unit_roots_split_blocks_not_leaves_read_by_a_parent(tmp_path: Path) -> None:
    """The unit-root rule (tiered/units.py) on a plain module: a list of mixed block classes and a list of one block
    are split, a list of leaf modules whose weights the parent reads without calling them stays in the parent's unit;
    streamed one unit at a time it gives the eager module's output bit for bit. Before the fix the whole module was
    one unit."""
    from tiered.plan import find_unit_roots

    torch.manual_seed(9)
    ref = _PlainHybrid().eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(torch.randn_like(prm) * 0.2 + (1.0 if prm.dim() == 1 else 0.0))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x)
    with torch.device("meta"):
        mod = _PlainHybrid()
    names = [n for n, _, _ in find_unit_roots(mod)]
    assert names == ["layers.0", "layers.1", "layers.2", "layers.3", "last.0", "head"], names
    with tiered.attach(mod, tmp_path, ring_gb=80 * 1024 / GiB, device="cpu") as m, torch.no_grad():
        assert tiered.stats(m).resident_units == 0
        for _ in range(2):
            assert torch.equal(m(x), want)


# ---------------------------------------------------------------------------------------------- lifecycle


def test_close_removes_hooks_and_context_manager(ckpts: Checkpoints, refs: References) -> None:
    m = _load("llama", "streamed", ckpts, refs)
    units = [u.module for u in m._tiered.plan.units]
    before = [len(u._forward_pre_hooks) + len(u._forward_hooks) for u in units]
    rows = {id(rg.unit.module) for rg in m._tiered.rows}  # row-streamed embeddings: a guarded forward, no hooks
    assert rows and all("forward" in u.__dict__ for u in units if id(u) in rows)
    assert all(n >= 2 for n, u in zip(before, units, strict=True) if id(u) not in rows), before
    m.close()
    assert not any("forward" in u.__dict__ for u in units)  # the guards put the modules' own forward back
    # the streaming hooks are gone; what is left is the guard that makes a closed unit refuse to run
    assert all(len(u._forward_hooks) == 0 and all(h is _closed for h in u._forward_pre_hooks.values()) for u in units)
    assert all(len(u._forward_pre_hooks) <= 1 for u in units)
    assert m._tiered.closed
    m.close()  # idempotent
    tiered.close(m)

    with _load("llama", "streamed", ckpts, refs) as m2:
        units = [u.module for u in m2._tiered.plan.units]
        assert all(len(u._forward_pre_hooks) >= 1 or "forward" in u.__dict__ for u in units)
        with torch.no_grad():
            assert torch.equal(m2(**_inputs(True)).logits, refs.output("llama").logits)
    assert m2._tiered.closed
    assert all(all(h is _closed for h in u._forward_pre_hooks.values()) for u in units)
    assert not m2._tiered.streamer.loader.alive  # the loader thread has stopped


def test_resident_close_unbinds(ckpts: Checkpoints, refs: References) -> None:
    with _load("gpt2", "resident", ckpts, refs) as m:
        assert all(p.device.type == "cpu" for p in m.parameters())
    assert all(is_placeholder(p) for p in m.parameters())


def test_out_of_order_unit_calls(ckpts: Checkpoints, refs: References) -> None:
    """A unit called outside the predicted order (lm_head right after lm_head, norm alone) is loaded on demand."""
    ref = refs.model("llama")
    want = refs.output("llama").logits
    with _load("llama", "streamed", ckpts, refs) as m:
        with torch.no_grad():
            out = m(**_inputs(True), output_hidden_states=True)
            assert torch.equal(out.logits, want)
            h = out.hidden_states[-1]
            misses = tiered.stats(m).misses
            assert torch.equal(m.lm_head(h), ref.lm_head(h))
            assert torch.equal(m.lm_head(h * 2), ref.lm_head(h * 2))  # same unit twice in a row
            assert torch.equal(m.model.norm(h), ref.model.norm(h))
            assert torch.equal(m.model.embed_tokens(make_ids(0, (2, 10))), ref.model.embed_tokens(make_ids(0, (2, 10))))
            assert torch.equal(m.lm_head(h), ref.lm_head(h))
            assert tiered.stats(m).misses > misses
            # and a full pass afterwards is still exact
            assert torch.equal(m(**_inputs(True)).logits, want)
            assert torch.equal(_generate(m), refs.generate("llama"))


def test_order_policy_predicts_from_what_ran() -> None:
    """The prediction behind prefetch: plan order, cyclic, until units run in another order; ``after`` is lazy and
    ``ahead`` its first ``k``; neither returns the unit itself or a unit twice (a learned cycle shorter than the plan)."""
    from tiered.order import OrderPolicy

    o = OrderPolicy([3, 5, 7, 9])
    assert o.ahead(3, 2) == [5, 7] and o.ahead(9, 10) == [3, 5, 7] and o.ahead(5, 0) == []
    for i in (3, 7, 3):  # 5 and 9 skipped: 3 -> 7 -> 3 is learned
        o.record(i)
    assert o.ahead(3, 10) == [7] and list(o.after(7)) == [3]
    assert list(o.after(5)) == [7, 3] and o.ahead(9, 1) == [3]
    gen = o.after(9)
    assert next(gen) == 3  # lazy: one step at a time
    assert o.ahead(11, 3) == []  # not a streamed unit: no prediction


@pytest.mark.parametrize("io", ["direct", "pread"])
@pytest.mark.parametrize("name", ["llama", "gptj", "mixtral", "bert_single", "llama_fp32"])
def test_direct_io_matches_transformers(name: str, io: str, ckpts: Checkpoints, refs: References) -> None:
    """io="direct" (O_DIRECT reads through a staging buffer) and io="pread" (buffered preadv into the ring)
    give the same bits as stock transformers."""
    causal = BUILDERS[name][3]
    ref = refs.output(name)
    try:
        m = _load(name, "streamed", ckpts, refs, io=io)
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    with m:
        for _ in range(2):
            with torch.no_grad():
                out = m(**_inputs(causal))
            got, want = (out.logits, ref.logits) if causal else (out.last_hidden_state, ref.last_hidden_state)
            assert torch.equal(got, want), (got - want).abs().max()
        _check_mode(m, "streamed")


@pytest.mark.parametrize("mode", MODES)
def test_unplaced_conversion_fallback_matches(mode: str, ckpts: Checkpoints, refs: References,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions tiered cannot place in the ring run transformers' own operations at read time
    (forced here for Mixtral's fused experts): still bitwise equal."""
    import tiered.plan

    monkeypatch.setattr(tiered.plan, "_place_converter", lambda *a, **k: None)
    ref = refs.output("mixtral")
    kw = {}
    if mode != "resident":  # converted experts cannot be routed: the ring must hold whole layers
        with tiered.load(ckpts["mixtral"], device="cpu", ring_gb=1.0) as probe:
            kw["ring_gb"] = streaming_ring_gb(probe)
    with _load("mixtral", mode, ckpts, refs, **kw) as m:
        assert any(u.converts for u in m._tiered.plan.units)
        with torch.no_grad():
            out = m(**_inputs(True))
        assert torch.equal(out.logits, ref.logits)


# ---------------------------------------- outputs aliasing weights, dtype plans, degenerate shapes, casts, direct calls


class _Table(nn.Module):
    def __init__(self, rows: int = 64, width: int = 256) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, width))

    def forward(self, n: int) -> torch.Tensor:
        return self.weight[:n]  # a view of the weight: (n, width)


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Table() for _ in range(6))

    def forward(self, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        outs = [b(n) for b in self.blocks]  # every output kept while later blocks stream through the ring
        return torch.stack(outs), {"first": outs[0]}


def test_output_aliasing_a_weight_is_copied_before_reuse(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = _Tables()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    with torch.no_grad():
        want, _ = ref(40)
    with torch.device("meta"):
        mod = _Tables()
    block = 64 * 256 * 4
    with tiered.attach(mod, tmp_path, ring_gb=2 * block / GiB, device="cpu") as m, torch.no_grad():
        assert tiered.stats(m).resident_units == 0
        for _ in range(2):
            got, extra = m(40)
            assert torch.equal(got, want)
            assert torch.equal(extra["first"], want[0])


@pytest.mark.parametrize(("name", "dtype"), [("t5", torch.float16), ("t5", torch.bfloat16),
                                             ("deepseek_v3", torch.bfloat16), ("deepseek_v3", torch.float16)])
def test_keep_in_fp32_dtype_plan_matches_from_pretrained(name: str, dtype: torch.dtype, ckpts: Checkpoints) -> None:
    d = ckpts[name]
    auto = transformers.AutoModelForSeq2SeqLM if name == "t5" else transformers.AutoModelForCausalLM
    ref = auto.from_pretrained(d, dtype=dtype).eval()
    kw = {"decoder_input_ids": make_ids(1, (2, 4))} if name == "t5" else {}
    with torch.no_grad():
        want = ref(input_ids=make_ids(0, (2, 10)), **kw).logits
    fp32 = {k for k, v in ref.state_dict().items() if v.dtype == torch.float32}
    if name == "t5" and dtype == torch.float16 or name == "deepseek_v3":
        assert fp32, "the reference keeps nothing in fp32: the test would prove nothing"
    for ring in (1.0, None):
        if ring is None:
            m = stream(d, dtype=dtype)
        else:
            m = tiered.load(d, device="cpu", ring_gb=ring, dtype=dtype)
        with m, torch.no_grad():
            if ring is not None:
                assert {k for k, v in m.state_dict().items() if v.dtype == torch.float32} == fp32
            assert torch.equal(m(input_ids=make_ids(0, (2, 10)), **kw).logits, want)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 8))
        self.scale = nn.Parameter(torch.tensor(1.5))  # a scalar: shape ()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("none_here", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x * self.scale + self.empty.sum() + self.none_here.sum()


def test_zero_size_and_scalar_tensors_load_as_safetensors_loads_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = _Odd()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    sd = load_file(tmp_path / "model.safetensors")
    assert sd["empty"].shape == (0, 8) and sd["scale"].shape == ()
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = ref(x)
    for ring in (1.0, 3 * 4096 / GiB):
        with torch.device("meta"):
            mod = _Odd()
        with tiered.attach(mod, tmp_path, ring_gb=ring, device="cpu") as m, torch.no_grad():
            assert torch.equal(m(x), want)
            if ring == 1.0:
                got = m.state_dict()
                for k, v in sd.items():
                    assert got[k].shape == v.shape and got[k].dtype == v.dtype and torch.equal(got[k], v), k


class _AllEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(0, 4))
        self.b = nn.Parameter(torch.zeros(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() + self.a.sum() + self.b.sum()


def test_model_whose_tensors_are_all_empty_loads(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(0, 4), "b": torch.zeros(4, 0)}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        mod = _AllEmpty()
    with tiered.attach(mod, tmp_path, ring_gb=1.0, device="cpu") as m, torch.no_grad():
        assert m.a.shape == (0, 4) and m.b.shape == (4, 0)
        assert float(m(torch.ones(2))) == 2.0


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False, dtype=torch.bfloat16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("io", ["mmap", "direct", "pread"])
def test_cast_from_a_misaligned_source_is_exact(io: str, tmp_path: Path) -> None:
    """fp32 tensors at file offsets that are not a multiple of 4 (a 3-byte tensor first), cast to bf16 on the fly."""
    g = torch.Generator().manual_seed(0)
    sd = {"a_pad": torch.arange(3, dtype=torch.uint8)}
    sd.update({f"blocks.{i}.weight": torch.randn(64, 64, generator=g) for i in range(3)})
    with open(tmp_path / "model.safetensors", "wb") as f:  # in this order (save_file would align them)
        f.write(encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in sd.items()]))
        for v in sd.values():
            f.write(v.numpy().tobytes())
    from tiered.format import read_header

    offs = [t.offset for n, t in read_header(tmp_path / "model.safetensors").tensors.items() if n != "a_pad"]
    assert any(o % 4 for o in offs), offs
    with torch.device("meta"):
        mod = _Lin()
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    ref = _Lin()
    ref.load_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items() if k != "a_pad"})
    with torch.no_grad():
        want = ref(x)
    with pytest.warns(UserWarning, match="not used"):
        m = tiered.attach(mod, tmp_path, ring_gb=2 * 64 * 64 * 2 / GiB, device="cpu", io=io)
    with m, torch.no_grad():
        assert torch.equal(m(x), want)


def test_submodule_of_a_streamed_unit_called_directly(llama_ref, ckpts: Checkpoints) -> None:
    d, _ = llama_ref
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with stream(d) as m, torch.no_grad():
        for _ in range(2):
            assert torch.equal(m.model.layers[2].mlp(x), ref.model.layers[2].mlp(x))
            assert torch.equal(m.model.layers[1].self_attn.q_proj(x), ref.model.layers[1].self_attn.q_proj(x))
            assert torch.equal(m.lm_head(x), ref.lm_head(x))
        assert all(is_placeholder(p) for p in m.model.layers[2].parameters())  # given back after each call
        assert not m._tiered.streamer.held



class TestHostilePread:
    """``io="pread"``: tensors at odd file offsets, casts, staging chunks and zero-size tensors."""

    @pytest.mark.parametrize("dtype", [None, torch.float32])
    def test_pread_odd_offsets_and_a_cast_equal_stock(self, odd_ckpt, dtype):
        ids = ids_for(1)
        kw = {"dtype": dtype} if dtype else {}
        ref = transformers.AutoModelForCausalLM.from_pretrained(odd_ckpt, **kw).eval()
        with torch.no_grad():
            want = ref(ids).logits
        assert want.dtype == (dtype or torch.bfloat16)
        with tiered.load(odd_ckpt, ring_gb=plan_ring_gb(odd_ckpt), device="cpu", io="pread", threads=3, **kw) as m:
            with torch.no_grad():
                for _ in range(2):
                    assert torch.equal(m(ids).logits, want)
            assert tiered.stats(m).units > 1 and set(tiered.stats(m).placement.resident) == set()


    def test_pread_big_cast_zero_size_and_odd_offsets(self, tmp_path):
        """A plain module: a fp32 tensor larger than two pread staging chunks cast to bf16 (and a bf16 one cast up)
        at odd offsets, and zero-size tensors, read with io="pread" equal torch's own casts."""
        from torch import nn

        g = torch.Generator().manual_seed(3)
        from tiered.reader import DIRECT_CHUNK

        big_n = DIRECT_CHUNK // 4 * 3 // 2 + 3  # fp32: more elements than DIRECT_CHUNK / 4, not a multiple of it
        src = {"a_pad": torch.tensor([5], dtype=torch.uint8), "big": torch.randn(big_n, generator=g),
               "empty": torch.empty(0, 4), "small": torch.randn(33, generator=g).to(torch.bfloat16),
               "z_empty16": torch.empty(4, 0, dtype=torch.bfloat16)}
        hdr = encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in src.items()])
        with open(tmp_path / "model.safetensors", "wb") as f:
            f.write(hdr)
            for v in src.values():
                f.write(v.view(torch.uint8).numpy().tobytes())
        offs = {k: t.offset % 2 for k, t in open_checkpoint(tmp_path).tensors.items()}
        assert offs["big"] == offs["small"] == 1

        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.big = nn.Parameter(torch.empty(big_n, dtype=torch.bfloat16))
                self.empty = nn.Parameter(torch.empty(0, 4, dtype=torch.float64))
                self.small = nn.Parameter(torch.empty(33, dtype=torch.float32))
                self.z_empty16 = nn.Parameter(torch.empty(4, 0, dtype=torch.bfloat16))

            def forward(self, x):
                return self.big * x, self.small * x, self.empty.sum() + x, self.z_empty16.shape

        with torch.device("meta"):
            m = M()
        with tiered.attach(m, tmp_path, ring_gb=0.05, device="cpu", io="pread", threads=3) as m:
            with torch.no_grad():
                b, s, e, z = m(torch.tensor(1.0))
        assert torch.equal(b, src["big"].to(torch.bfloat16)) and bool(b.float().abs().sum() > 0)
        assert torch.equal(s, src["small"].float())
        assert float(e) == 1.0 and tuple(z) == (4, 0)



# ---------------------------------------------------------------------------------------------- a model dir, as stock


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _drop_dtype(doc: dict) -> None:
    for k in ("dtype", "torch_dtype"):
        doc.pop(k, None)


@pytest.mark.parametrize("case", ["absent", "null", "sub_config", "index_metadata"])
def test_default_dtype_is_from_pretrained_default(case: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    """No ``dtype`` argument: tiered runs at the dtype stock ``from_pretrained`` picks by default (``"auto"``, 5.17
    ``_get_dtype``: the config's, else the index's metadata, else the checkpoint's first floating tensor), not
    float32: config.json without a dtype, with ``dtype: null``, with one only in a sub-config (multimodal), and an
    index whose metadata names one."""
    if case == "sub_config":
        d, auto = models.llava(tmp_path / "m"), transformers.AutoModelForImageTextToText

        def edit(doc: dict) -> None:
            _drop_dtype(doc)
            _drop_dtype(doc["vision_config"])
            doc["text_config"]["dtype"] = "bfloat16"
    else:
        d, auto = ckpts.copy("llama", tmp_path / "m"), transformers.AutoModelForCausalLM

        def edit(doc: dict) -> None:
            _drop_dtype(doc)
            if case == "null":
                doc["dtype"] = None
    _edit_json(d / "config.json", edit)
    if case == "index_metadata":
        _edit_json(d / "model.safetensors.index.json", lambda doc: doc["metadata"].update(dtype="float16"))
    ref = auto.from_pretrained(d).eval()
    assert ref.dtype != torch.float32, "stock runs in float32: the test would prove nothing"
    ids = make_ids(0, (2, 10))
    want = logits_of(ref, ids)
    with tiered.load(d, device="cpu", ring_gb=RESIDENT_GB) as m:
        assert m.dtype == ref.dtype
        got = logits_of(m, ids)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(greedy(m, ids), greedy(ref, ids))


@pytest.mark.parametrize("case", ["legacy_only", "both", "malformed"])
def test_generation_config_is_from_pretrained_s(case: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    """``model.generation_config`` is the one stock ``from_pretrained`` sets (5.17 ``adjust_generation_fn``):
    legacy generation parameters of config.json (``max_length``, ``repetition_penalty``, ``no_repeat_ngram_size``)
    when there is no generation_config.json or an unreadable one (warned about), generation_config.json alone when
    there is one. Greedy tokens with the model's defaults equal stock's."""
    d = ckpts.copy("llama", tmp_path / "m")
    _edit_json(d / "config.json", lambda doc: doc.update(max_length=14, repetition_penalty=1.5, no_repeat_ngram_size=2))
    gen = d / "generation_config.json"
    assert gen.is_file()
    if case == "legacy_only":
        gen.unlink()
    elif case == "malformed":
        gen.write_text("{not json")
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = make_ids(3, (2, 6))
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
        if case != "both":  # guard: the legacy parameters change the tokens
            plain = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_length=20,
                                 repetition_penalty=1.0, no_repeat_ngram_size=0)
            assert plain.shape != want.shape or not torch.equal(plain, want)
    warns = pytest.warns(UserWarning, match="generation_config.json") if case == "malformed" else nullcontext()
    with warns:
        m = tiered.load(d, device="cpu", ring_gb=RESIDENT_GB)
    with m, torch.no_grad():
        assert m.generation_config.to_dict() == ref.generation_config.to_dict()
        got = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    assert got.shape == want.shape and torch.equal(got, want)


def test_custom_code_with_trust_remote_code_matches_from_pretrained(ckpts: Checkpoints, tmp_path: Path) -> None:
    """A directory with its own model code (``auto_map``): refused without ``trust_remote_code=True``, with advice
    that works; with it, the class ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` builds
    (``get_class_from_dynamic_module``), and its outputs bit for bit, resident and streamed."""
    d = models.custom_code(ckpts["llama"], tmp_path / "toy")
    with pytest.raises(tiered.ConfigError, match=r"tiered\.load\(.*trust_remote_code=True\)") as e:
        tiered.load(d, device="cpu", ring_gb=RESIDENT_GB)
    assert "modeling_toy.py" in str(e.value) and "config.json" in str(e.value)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    ids = make_ids(0, (2, 10))
    want = logits_of(ref, ids)
    assert torch.equal(want, -logits_of(STOCK(ckpts["llama"]), ids))  # stock ran the directory's code
    for m in (tiered.load(d, device="cpu", ring_gb=RESIDENT_GB, trust_remote_code=True),
              stream(d, trust_remote_code=True)):
        with m:
            assert type(ref).__name__ in [c.__name__ for c in type(m).__mro__]
            assert torch.equal(logits_of(m, ids), want)
            assert torch.equal(greedy(m, ids), greedy(ref, ids))


def test_parameters_the_checkpoint_never_holds_are_computed_as_stock(ckpts: Checkpoints) -> None:
    """Marian never saves its sinusoidal position tables (``_keys_to_ignore_on_save``); ``from_pretrained`` computes
    them with ``_init_weights``. tiered computes them the same way (deterministic: checked by two runs), resident on
    the model's device, with stock's ``requires_grad``; logits and greedy tokens bit for bit stock's, streamed.
    Before the fix: MissingTensorError."""
    d = ckpts["marian"]
    assert not any("embed_positions" in k for k in models.checkpoint_keys(d))
    ref = STOCK(d, auto=transformers.MarianMTModel)
    ids = make_ids(3, (2, 9))
    dec = ids[:, :4]
    with stream(d) as m, torch.no_grad():
        for side in ("encoder", "decoder"):
            got, want = (getattr(x.model, side).embed_positions.weight for x in (m, ref))
            assert not is_placeholder(got) and torch.equal(got, want) and got.requires_grad == want.requires_grad
            assert got.abs().sum() > 0
        assert torch.equal(m(input_ids=ids, decoder_input_ids=dec).logits, ref(input_ids=ids, decoder_input_ids=dec).logits)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_never_held_parameters_keep_stocks_random_stream_and_base_class(ckpts: Checkpoints, tmp_path: Path) -> None:
    """Computing Marian's tables draws from the global generator as ``from_pretrained`` does (its init draws
    ``normal_`` first; tiered's second, checking run draws from a forked generator), so a seeded sample after load is
    stock's. The base class (``MarianModel``, whose patterns carry the ``model.`` prefix) loads too. A checkpoint that
    does hold the tables gets ``requires_grad`` as ``from_pretrained`` sets it on loaded parameters (floating point:
    True, though the module is built frozen)."""
    d = ckpts["marian"]
    draws = []
    for load in (lambda: transformers.MarianMTModel.from_pretrained(d), lambda: tiered.load(d, device="cpu")):
        torch.manual_seed(11)
        m = load()
        draws.append(torch.rand(4))
        if hasattr(m, "close"):
            m.close()
    assert torch.equal(draws[0], draws[1])
    ref = transformers.MarianModel.from_pretrained(d).eval()
    ids = make_ids(4, (1, 7))
    with stream(d, model_class=transformers.MarianModel) as m, torch.no_grad():
        assert torch.equal(m(input_ids=ids, decoder_input_ids=ids[:, :3]).last_hidden_state,
                           ref(input_ids=ids, decoder_input_ids=ids[:, :3]).last_hidden_state)
    full = tmp_path / "held"
    stock = transformers.MarianMTModel.from_pretrained(d)
    stock.save_pretrained(full)
    sd = load_file(full / "model.safetensors")
    for side in ("encoder", "decoder"):
        sd[f"model.{side}.embed_positions.weight"] = getattr(stock.model, side).embed_positions.weight.detach()
    save_file(sd, full / "model.safetensors", metadata={"format": "pt"})
    ref = transformers.MarianMTModel.from_pretrained(full)
    with stream(full) as m:
        flags = {n: p.requires_grad for n, p in m.named_parameters()}
        assert flags == {n: p.requires_grad for n, p in ref.named_parameters()}
        assert flags["model.encoder.embed_positions.weight"]


def test_a_random_init_of_a_missing_parameter_is_still_refused() -> None:
    """A key the model lists as never saved but initializes at random cannot be computed as stock would compute it
    (stock's own value is random): not regenerated, so the load reports it missing."""
    from tiered.meta import regenerate_param

    class _Random(nn.Module):
        _keys_to_ignore_on_save = [r"table\.weight"]

        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(8, 4, device="meta")

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)

    m = _Random()
    assert not regenerate_param(m, "table.weight", m.table, "weight")
    assert m.table.weight.device.type == "meta"


class _Blocks(nn.Module):
    """Blocks of two fp32 linears each (a streamed unit each): weights of 75, 128 and 25 pages, biases of 1200, 2048
    and 400 bytes (not page multiples)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, d), nn.Linear(d, 256)) for d in (300, 512, 100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _write_shuffled(path: Path, sd: dict[str, torch.Tensor], seed: int, gaps: tuple[int, ...]) -> None:
    """``sd`` in a shuffled order, with unused uint8 tensors of ``gaps`` bytes (one drawn per tensor) between them."""
    g = torch.Generator().manual_seed(seed)
    names = [list(sd)[i] for i in torch.randperm(len(sd), generator=g).tolist()]
    items: list[tuple[str, torch.Tensor]] = []
    for k, name in enumerate(names):
        n = gaps[int(torch.randint(len(gaps), (1,), generator=g))]
        if n:
            items.append((f"pad{k}", torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)))
        items.append((name, sd[name]))
    with open(path, "wb") as f:  # in this order (save_file would sort and align them)
        f.write(encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in items]))
        for _, v in items:
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(("seed", "gaps", "some_direct"),
                         [(0, (0,), True), (1, (0, 3, 100), False), (2, (0, 4, 5000), True), (3, (8, 4096), True)])
def test_direct_reads_straight_into_the_slot_are_exact(seed: int, gaps: tuple[int, ...], some_direct: bool,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """io="direct" reads the whole pages of a unit's tensors with O_DIRECT straight into the ring slot
    (tiered.reader.SLOT_DIRECT, the slot shifted to the file's page offset): tensors in a shuffled file order, apart by
    gaps of 0 to 5000 bytes, give stock's bits pass after pass, and the staged path gives the same bits. Where the
    gaps keep the fp32 tensors 4-byte aligned in the file, some bytes do go straight into the slot; after a 3-byte gap
    none may on the CPU (such a tensor sits 64-aligned in the slot, not at its file residue: tiered.plan.lay_out)."""
    import tiered.reader

    g = torch.Generator().manual_seed(100 + seed)
    ref = _Blocks()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    _write_shuffled(tmp_path / "model.safetensors", ref.state_dict(), seed, gaps)
    x = torch.randn(3, 256, generator=g)
    with torch.no_grad():
        want = ref(x)
    got = {}
    for on in (True, False):
        monkeypatch.setattr(tiered.reader, "SLOT_DIRECT", on)
        with torch.device("meta"):
            mod = _Blocks()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the pads are not used
            try:
                m = tiered.attach(mod, tmp_path, ring_gb=1.5 * (1 << 20) / GiB, device="cpu", io="direct",
                                  zero_copy=False)
            except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
                pytest.skip(str(e))
        with m, torch.no_grad():
            outs = [m(x) for _ in range(2)]
            assert all(torch.equal(o, want) for o in outs), [(o - want).abs().max() for o in outs]
            got[on] = m._tiered.reader.slot_direct_bytes
    assert (got[True] > 0) == some_direct and got[False] == 0, got


def test_direct_reads_write_only_their_destinations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT runs straight into memory: two tensors that follow each other in the file and in memory are one run (a
    request crosses their boundary); a third, 200 bytes after them in the file and at the same distance in memory, is
    a run of its own, and no request covers those 200 bytes, whose place in memory (someone else's: a sentinel here)
    keeps its bytes; every tensor arrives exact."""
    import types

    from tiered.hostmem import anon_mapping, map_tensor
    from tiered.reader import Reader

    g = torch.Generator().manual_seed(7)
    sizes = {"a": 3 * 4096 + 100, "b": 2 * 4096 + 50, "gap": 200, "c": 2 * 4096 + 8}
    data = {k: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for k, n in sizes.items()}
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(encode_header([(k, torch.uint8, (n,), n) for k, n in sizes.items()]))
        for v in data.values():
            f.write(v.numpy().tobytes())
    ck = open_checkpoint(tmp_path)
    t = ck.tensors
    slot = map_tensor(anon_mapping(10 * 4096))
    base = t["a"].offset - t["a"].offset % 4096  # memory offset = file offset - base: each at its file page offset

    def at(name: str) -> torch.Tensor:
        return slot[t[name].offset - base : t[name].offset - base + t[name].nbytes]

    spans: list[tuple[int, int]] = []
    r = Reader(ck, threads=2, io="direct")
    try:
        orig = r._span_task
        monkeypatch.setattr(r, "_span_task", lambda unit, run, x0, x1, be: (spans.append((x0, x1)),
                                                                         orig(unit, run, x0, x1, be)))
        sentinel = torch.full((sizes["gap"],), 0xA5, dtype=torch.uint8)
        at("gap").copy_(sentinel)
        r.copy_all(types.SimpleNamespace(name="u"), [(t[k], at(k)) for k in "abc"])
        assert all(torch.equal(at(k), data[k]) for k in "abc")
        assert torch.equal(at("gap"), sentinel)
        b0, g0, g1 = t["b"].offset, t["gap"].offset, t["c"].offset
        assert any(x0 < b0 < x1 for x0, x1 in spans), spans  # a and b: one run
        assert not any(x0 < g1 and x1 > g0 for x0, x1 in spans), spans  # the gap: never read
        assert r.slot_direct_bytes > 0
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    finally:
        r.close()


def test_direct_runs_stay_inside_one_storage(tmp_path: Path) -> None:
    """Two destinations that touch in memory but belong to two storages (two buffers of one mapping), each at its
    file page offset, are two runs: both arrive exact (one run over both raised a false TruncatedShardError)."""
    import types

    from tiered.hostmem import anon_mapping
    from tiered.reader import Reader

    g = torch.Generator().manual_seed(3)
    data = {k: torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8, generator=g) for k in "ab"}
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(encode_header([(k, torch.uint8, (v.numel(),), v.numel()) for k, v in data.items()], align=4096))
        for v in data.values():
            f.write(v.numpy().tobytes())
    ck = open_checkpoint(tmp_path)
    mv = memoryview(anon_mapping(8 * 4096))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of a writable mapping
        da = torch.frombuffer(mv[: 3 * 4096], dtype=torch.uint8)
        db = torch.frombuffer(mv[3 * 4096 : 6 * 4096], dtype=torch.uint8)
    assert db.data_ptr() == da.data_ptr() + 3 * 4096 and db.untyped_storage().data_ptr() != da.untyped_storage().data_ptr()
    r = Reader(ck, threads=2, io="direct")
    try:
        r.copy_all(types.SimpleNamespace(name="u"), [(ck.tensors["a"], da), (ck.tensors["b"], db)])
        assert torch.equal(da, data["a"]) and torch.equal(db, data["b"])
        assert r.slot_direct_bytes == 6 * 4096
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    finally:
        r.close()


@pytest.mark.parametrize("pad", [0, 2, 3])
def test_slot_shift_keeps_every_view_at_its_item_size(pad: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot's start shift is a multiple of every item size its unit views (fp32 tensors 2 or 3 bytes off in the
    file): with the CUDA rule (any residue; emulated on the CPU by ``tiered.sources.CPU_ALIGN = 1``) the load gives
    stock's bits instead of failing to view the slot as float32."""
    import tiered.sources

    g = torch.Generator().manual_seed(11)
    ref = _Blocks()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    sd = ref.state_dict()
    items = ([("pad", torch.uint8, (pad,), pad)] if pad else []) + [
        (k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in sd.items()]
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(encode_header(items))
        f.write(bytes(pad))
        for v in sd.values():
            f.write(v.contiguous().numpy().tobytes())
    x = torch.randn(3, 256, generator=g)
    with torch.no_grad():
        want = ref(x)
    monkeypatch.setattr(tiered.sources, "CPU_ALIGN", 1)
    with torch.device("meta"):
        mod = _Blocks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pad is not used
        try:
            m = tiered.attach(mod, tmp_path, ring_gb=1.5 * (1 << 20) / GiB, device="cpu", io="direct", zero_copy=False)
        except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
            pytest.skip(str(e))
    with m, torch.no_grad():
        assert torch.equal(m(x), want)


@pytest.mark.parametrize("io", ["mmap", "pread", "direct"])
def test_one_element_strided_destination(io: str, tmp_path: Path) -> None:
    """A one-element destination with a stride of 2 (torch counts it contiguous) receives its element with every
    backend (it raised "stride(-1) must be 1" when viewed as bytes; attack of 2026-12-07)."""
    import types

    from tiered.reader import Reader

    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(encode_header([("w", torch.float32, (1,), 4)]))
        f.write(torch.tensor([1.5]).numpy().tobytes())
    ck = open_checkpoint(tmp_path)
    dest = torch.zeros(2)[::2]
    r = Reader(ck, threads=1, io=io)
    try:
        r.copy_all(types.SimpleNamespace(name="u"), [(ck.tensors["w"], dest)])
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    finally:
        r.close()
    assert dest.tolist() == [1.5]
