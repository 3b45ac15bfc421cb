"""What model code sees of a streamed model outside a unit's forward (issue 22, items 1-3): stock's devices, dtypes,
shapes and ``requires_grad``; a clear :class:`~tiered.placeholder.StreamedTensorError` — never garbage, never a silent
no-op — for reading or changing a streamed tensor's values, and for module methods tiered cannot do as stock does.

Every test compares with stock ``transformers`` (``from_pretrained``) bit for bit."""

from __future__ import annotations

from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import make_ids, sgd_step, stream

import tiered
from tiered.placeholder import Placeholder, StreamedTensorError


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory) -> Path:
    return models.llama(tmp_path_factory.mktemp("ph") / "llama", dtype=torch.bfloat16, seed=21)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    """A tiny Llama-4 text model (bf16, two MoE layers): its forward reads ``embed_tokens.weight.device``."""
    cfg = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=128, attention_chunk_size=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.Llama4ForCausalLM(cfg).to(torch.bfloat16)
    d = models.save_model(m, tmp_path_factory.mktemp("ph") / "llama4", seed=22, dtype=m.dtype, max_shard_size=None)
    return d


def _stock(d: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(d).eval()


def _equal_logits(m, ref, ids) -> bool:
    with torch.no_grad():
        a, b = m(ids).logits, ref(ids).logits
    assert b.abs().sum() > 0
    return torch.equal(a, b)


def test_parameters_and_submodules_look_like_stock(llama_bf16):
    ref = _stock(llama_bf16)
    with stream(llama_bf16) as m:
        got = dict(m.named_parameters())
        assert got.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            q = got[name]
            assert (q.device, q.dtype, q.shape, q.requires_grad, isinstance(q, torch.nn.Parameter)) == \
                (p.device, p.dtype, p.shape, p.requires_grad, True), name
        streamed = [n for n, p in got.items() if isinstance(p, Placeholder)]
        assert streamed, "the model must stream for this test"
        for name, sub in ref.named_modules():  # inner models' own device / dtype (PreTrainedModel properties)
            if isinstance(sub, transformers.PreTrainedModel):
                mine = m.get_submodule(name)
                assert (mine.device, mine.dtype) == (sub.device, sub.dtype), name


def test_a_parameter_the_model_builds_in_real_memory_requires_grad_as_stock(tmp_path):
    """DiffLlama's ``lambda_q1``..``lambda_k2`` are ``nn.Parameter(torch.normal(0, std, size=...))``: that factory
    escapes the meta device context, so the model is built with them in real memory. Stock loads them with
    ``requires_grad=True``; tiered bound them without a placeholder (``requires_grad=False``, and a streamed one kept
    its ring view between passes), so one SGD step gave other logits (found by an attack, 2026-12-06). Now: the same
    flags, streamed and whole; whole on the CPU, the same logits after one SGD step; streamed, a placeholder between
    passes (reading it is an error, not old ring bytes)."""
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m0 = transformers.DiffLlamaForCausalLM(cfg)
    d = models.save_model(m0, tmp_path / "diffllama", seed=23, dtype=m0.dtype, max_shard_size=None)
    ids = make_ids(9, (1, 6)) % 96
    ref = _stock(d)
    key = "model.layers.0.self_attn.lambda_q1"
    assert ref.get_parameter(key).requires_grad and ref.get_parameter(key).abs().sum() > 0

    with tiered.load(d, device="cpu", ring_gb=1.0) as m:
        assert tiered.stats(m).resident_units == tiered.stats(m).units
        assert [(n, p.requires_grad) for n, p in m.named_parameters()] == \
            [(n, p.requires_grad) for n, p in ref.named_parameters()]
        assert _equal_logits(m, ref, ids)
        assert torch.equal(sgd_step(m, ids), sgd_step(_stock(d), ids))
    ref = _stock(d)
    with stream(d) as m:
        assert [(n, p.requires_grad) for n, p in m.named_parameters()] == \
            [(n, p.requires_grad) for n, p in ref.named_parameters()]
        assert _equal_logits(m, ref, ids)
        assert isinstance(m.get_parameter(key), Placeholder)
        with pytest.raises(StreamedTensorError):
            m.get_parameter(key).tolist()


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "table"])
def test_model_code_reading_a_weights_device_equals_stock(llama4, rows):
    """Llama-4's text model moves its ids to ``embed_tokens.weight.device``: with ``meta`` placeholders that crashed
    (row embeddings) or gave wrong logits silently (the table streamed)."""
    ref = _stock(llama4)
    with stream(llama4, embedding_rows=rows) as m:
        assert _equal_logits(m, ref, make_ids(3, (2, 9)))


def test_reading_a_streamed_weight_outside_its_forward_is_an_error(llama_bf16):
    with stream(llama_bf16) as m:
        w = m.model.layers[1].mlp.up_proj.weight
        assert w.T.shape == w.shape[::-1]  # metadata and views work
        with pytest.raises(StreamedTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.layers\.1"):
            w.sum()
        for read in (lambda: float(w[0, 0]), w.tolist, w.numpy, lambda: __import__("numpy").asarray(w)):
            with pytest.raises(StreamedTensorError, match="streamed"):
                read()


def test_new_tensors_from_a_streamed_weights_metadata_are_stock_s(llama_bf16):
    """``weight.new_zeros(...)`` / ``torch.zeros_like(weight)`` read no value: real tensors of stock's dtype, device
    and shape (on ``meta`` they were meta tensors, failing later)."""
    ref = _stock(llama_bf16)
    with stream(llama_bf16) as m:
        w, r = m.model.layers[2].mlp.down_proj.weight, ref.model.layers[2].mlp.down_proj.weight
        for make in (lambda t: t.new_zeros(3, 5), lambda t: torch.zeros_like(t), lambda t: t.new_full((4,), 1.5),
                     lambda t: torch.ones_like(t, dtype=torch.float32)):
            got, want = make(w), make(r)
            assert type(got) is torch.Tensor and got.device == want.device and torch.equal(got, want)


def test_in_place_edit_of_a_streamed_weight_is_refused(llama_bf16):
    """A LoRA merge (``w.add_(delta)`` under ``no_grad``) had no effect and raised nothing."""
    ref = _stock(llama_bf16)
    with stream(llama_bf16) as m:
        w = m.model.layers[0].self_attn.q_proj.weight
        delta = torch.full(w.shape, 0.5, dtype=w.dtype)
        with torch.no_grad():
            for edit in (lambda: w.add_(delta), lambda: w.copy_(delta), lambda: w.mul_(2)):
                with pytest.raises(StreamedTensorError, match="in-place"):
                    edit()
        assert _equal_logits(m, ref, make_ids(1))


@pytest.mark.parametrize("convert", ["half", "float", "to_fp16", "to_dtype_kw"])
def test_dtype_change_is_refused_before_anything_changes(llama_bf16, convert):
    """``.half()`` / ``.float()`` / ``.to(dtype)`` cast buffers and placeholders but kept binding bf16 weights:
    logits of neither dtype, silently."""
    ref = _stock(llama_bf16)
    with stream(llama_bf16) as m:
        before = {n: (b.dtype, b.device) for n, b in m.named_buffers()}
        call = {"half": lambda: m.half(), "float": lambda: m.float(), "to_fp16": lambda: m.to(torch.float16),
                "to_dtype_kw": lambda: m.to(dtype=torch.float32)}[convert]
        with pytest.raises(StreamedTensorError, match="load it again"):
            call()
        with pytest.raises(StreamedTensorError, match="runs on cpu or cuda"):
            m.to("meta")
        assert {n: (b.dtype, b.device) for n, b in m.named_buffers()} == before  # nothing was changed
        assert _equal_logits(m, ref, make_ids(2))


def test_conversions_that_change_nothing_pass(llama_bf16):
    ref = _stock(llama_bf16)
    with stream(llama_bf16) as m:
        assert m.to("cpu") is m and m.cpu() is m and m.to(m.device) is m and m.to(torch.device("cpu")) is m
        assert _equal_logits(m, ref, make_ids(4))


def test_save_pretrained_is_refused_before_writing(llama_bf16, tmp_path):
    with stream(llama_bf16) as m:
        with pytest.raises(StreamedTensorError, match="tiered reshard"):
            m.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resize_token_embeddings_is_refused(llama_bf16):
    with stream(llama_bf16) as m:
        with pytest.raises(StreamedTensorError, match="resize"):
            m.resize_token_embeddings(300)
        assert m.get_input_embeddings().weight.shape[0] == 256


def test_grad_mode_outputs_require_grad_as_stock(llama_bf16):
    """Stock's parameters require grad, so in grad mode its logits do; after ``requires_grad_(False)`` they don't.
    tiered bound every weight with ``requires_grad=False`` and ignored ``requires_grad_(True)``."""
    ref = _stock(llama_bf16)
    ids = make_ids(5)
    with stream(llama_bf16) as m:
        a, b = m(ids).logits, ref(ids).logits
        assert a.requires_grad == b.requires_grad is True and torch.equal(a, b)
        m.requires_grad_(False)
        ref.requires_grad_(False)
        a, b = m(ids).logits, ref(ids).logits
        assert a.requires_grad == b.requires_grad is False and torch.equal(a, b)
        assert not any(p.requires_grad for p in m.parameters())
        m.requires_grad_(True)
        assert m(ids).logits.requires_grad


@pytest.mark.parametrize("how", ["mmap", "ring"])
def test_backward_through_a_streamed_weight_raises(llama_bf16, how):
    """The default CPU path (zero copy) ran backward without a word and left every ``.grad`` None: the gradients landed
    on the tensors bound for the call. Now it raises at the first streamed weight backward reaches, naming it."""
    kw = {"zero_copy": False, "io": "pread"} if how == "ring" else {}
    # through the ring, torch's own check may fire first: the saved weight's memory was refilled (version bumped)
    err = (StreamedTensorError, RuntimeError) if how == "ring" else StreamedTensorError
    with stream(llama_bf16, **kw) as m:
        loss = m(make_ids(8)).logits.float().sum()
        with pytest.raises(err, match=r"backward\(\) reached 'lm_head\.weight'|modified by an inplace operation"):
            loss.backward()
        m.requires_grad_(False)  # inference in grad mode: no graph through the weights, nothing to refuse
        assert not m(make_ids(8)).logits.requires_grad


def test_input_gradients_through_refilled_ring_memory_raise(llama_bf16):
    """Gradients of the inputs only (no weight's gradient hook runs) through streamed weights whose ring slot was
    refilled must raise (the slot's version counter is bumped at release), never differentiate through another unit's
    bytes."""
    with tiered.load(llama_bf16, device="cpu", ring_gb=1.0) as probe:
        from conftest import streaming_ring_gb

        ring = streaming_ring_gb(probe)
    with tiered.load(llama_bf16, device="cpu", ring_gb=ring, zero_copy=False, io="pread") as m:
        assert tiered.stats(m).resident_units == 0
        emb = m.get_input_embeddings()(make_ids(6)).detach().requires_grad_(True)
        loss = m(inputs_embeds=emb).logits.float().sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, emb)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "resident"])
def test_t5_in_grad_mode_equals_stock(ckpts, streamed):
    """Under default grad mode SDPA picks another kernel when T5's position bias requires grad: with weights bound
    ``requires_grad=False`` the logits differed from stock by 2.4e-7."""
    d = ckpts["t5"]
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(d).eval()
    ids, dec = make_ids(0, (2, 7)), make_ids(1, (2, 4))
    with (stream(d) if streamed else tiered.load(d, device="cpu", ring_gb=1.0)) as m:
        assert (tiered.stats(m).resident_units == 0) == streamed
        a = m(input_ids=ids, decoder_input_ids=dec).logits
        b = ref(input_ids=ids, decoder_input_ids=dec).logits
        assert b.abs().sum() > 0 and a.requires_grad and torch.equal(a, b)


def test_idefics3_text_only_forward_equals_stock(tmp_path):
    """Idefics3's inner model moves its embeddings ``.to(self.device)``: its ``device`` (``PreTrainedModel.device``:
    its first parameter's) was ``meta`` (only the top-level class was overridden) and a text-only forward crashed."""
    tc = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
    cfg = transformers.Idefics3Config(text_config=tc, vision_config=vc, image_token_id=255, scale_factor=2)
    torch.manual_seed(0)
    m = transformers.Idefics3ForConditionalGeneration(cfg).to(torch.bfloat16)
    models.save_model(m, tmp_path / "idefics3", seed=23, dtype=m.dtype, max_shard_size=None)
    ref = transformers.Idefics3ForConditionalGeneration.from_pretrained(tmp_path / "idefics3").eval()
    ids = make_ids(7, (1, 9))
    with stream(tmp_path / "idefics3") as t, torch.no_grad():
        want = ref(input_ids=ids).logits
        assert want.abs().sum() > 0 and torch.equal(t(input_ids=ids).logits, want)


@pytest.mark.parametrize("rescale_every", [6, 1])
def test_rwkv_rescales_in_place_only_where_tiered_can(tmp_path, rescale_every):
    """RWKV divides blocks i >= rescale_every by 2 ** (i // rescale_every) in place at its first forward. With three
    blocks and rescale_every=6 every division is by 1: streamed, equal to stock (it raised StreamedTensorError at
    the in-place op). With rescale_every=1 a streamed block cannot be divided: refused before any weight is read;
    resident, equal to stock (the division runs on the resident weights as on stock's)."""
    cfg = transformers.RwkvConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, attention_hidden_size=64,
                                  intermediate_size=128, context_length=64, rescale_every=rescale_every)
    torch.manual_seed(0)
    m = transformers.RwkvForCausalLM(cfg).to(torch.bfloat16)
    d = models.save_model(m, tmp_path / "rwkv", seed=24, dtype=m.dtype, max_shard_size=None)
    ref = transformers.RwkvForCausalLM.from_pretrained(d).eval()
    ids = make_ids(9, (2, 7))
    if rescale_every == 1:
        with pytest.raises(tiered.ConfigError, match="in place"):
            stream(d)
        with tiered.load(d, device="cpu", ring_gb=1.0) as t:
            assert tiered.stats(t).resident_units == tiered.stats(t).units
            assert _equal_logits(t, ref, ids)
    else:
        with stream(d) as t:
            assert _equal_logits(t, ref, ids) and _equal_logits(t, ref, ids)


class _ReadsAWeight(torch.nn.Module):
    """A parent that reads a streamed unit's weight as a value (Gemma-4's pad embedding) and one only as metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids.to(self.head.weight.device))  # metadata: not a reader
        x = x + self.emb.weight[0]  # a value, outside emb's call: the emb unit is bound for this call too
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_parent_reading_a_units_weight_binds_it_for_its_call(tmp_path):
    """Model code that reads another unit's weight as a value outside that unit's call (Gemma-4:
    ``embed_tokens.weight[pad_token_id]``; ProphetNet: ``position_embeddings._forward``) raised StreamedTensorError;
    the plan now finds such readers in the forward source and binds the unit for the reader's call too (not by rows);
    a metadata read (``.weight.device``) binds nothing."""
    from safetensors.torch import save_model

    torch.manual_seed(3)
    ref = _ReadsAWeight().eval()
    save_model(ref, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        mod = _ReadsAWeight()
    with tiered.attach(mod, tmp_path, device="cpu", ring_gb=12 * 1024 / 2**30) as m, torch.no_grad():
        units = {u.name: u for u in m._tiered.plan.units}
        assert units["emb"].readers == [m] and units["head"].readers == []
        s = tiered.stats(m)
        assert s.resident_units == 0 and s.row_units == 0
        ids = torch.tensor([[1, 5, 63, 2]])
        for _ in range(2):
            want = ref(ids)
            assert want.abs().sum() > 0 and torch.equal(m(ids), want)


def test_prophetnet_causal_lm_equals_stock(tmp_path):
    """ProphetNet's decoder calls ``self.position_embeddings._forward(...)`` (past the hooks) and reads
    ``self.ngram_embeddings.weight``: both units are bound for the decoder's call (it raised StreamedTensorError)."""
    cfg = transformers.ProphetNetConfig(vocab_size=256, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                        num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                                        num_decoder_attention_heads=4, max_position_embeddings=64, ngram=2,
                                        is_encoder_decoder=False, add_cross_attention=False)
    torch.manual_seed(0)
    m = transformers.ProphetNetForCausalLM(cfg).to(torch.bfloat16)
    models.save_model(m, tmp_path / "pn", seed=25, dtype=m.dtype, max_shard_size=None)
    ref = transformers.ProphetNetForCausalLM.from_pretrained(tmp_path / "pn").eval()
    with stream(tmp_path / "pn") as t:
        assert any(u.readers for u in t._tiered.plan.units)
        assert _equal_logits(t, ref, make_ids(10, (2, 7)))


def test_a_replaced_placeholder_is_refused_not_dropped(llama_bf16):
    """``load_state_dict(sd, assign=True)`` or ``mod.weight = nn.Parameter(new)`` replaces a streamed weight's
    placeholder: the next pass bound the checkpoint's bytes over it and ran them, silently (review of 2026-12-01)."""
    with stream(llama_bf16) as m:
        q = m.model.layers[0].self_attn.q_proj
        q.weight = torch.nn.Parameter(torch.zeros(q.weight.shape, dtype=q.weight.dtype))
        with pytest.raises(StreamedTensorError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' .* replaced"), \
                torch.no_grad():
            m(make_ids(12))


def test_metadata_reads_make_no_reader():
    """``self.head.bias is not None``, ``self.head.weight.T.shape``, ``.stride(0)`` read no value: no reader (the
    head stays eligible for rows or pieces); ``self.emb.weight[0]`` and ``._forward(`` are readers."""
    from tiered.units import _READ

    for src in ("self.head.bias is not None", "self.head.weight.T.shape", "self.head.weight.stride(0)",
                "self.head.weight.device", "self.head.weight.dtype"):
        assert _READ.findall(src) == [], src
    assert _READ.findall("x + self.emb.weight[0]") == ["emb"]
    assert _READ.findall("self.pe._forward(ids)") == ["pe"]
    assert _READ.findall("self.a.b.weight.T @ x") == ["a.b"]
