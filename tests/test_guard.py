"""CallGuard (tiered/guard.py): the modules tiered binds per call itself — a row-read embedding (tiered/rows.py) and
a routed experts module (tiered/experts.py) — called directly, re-entrantly, from threads, under a user's hooks or
``forward`` wrappers (installed before or after load), after a Ctrl-C inside their bind, after close, and deep-copied.

All on the CPU, on ``mix`` (tests/conftest.py: Mixtral, 8 experts, top-2, bf16) with a ring in which the embedding
reads rows and the experts are routed (``ring_rows``). Every output is compared with stock ``transformers`` bit for
bit (``torch.equal``); reference outputs are checked not to be all zero. A strict xfail for CallGuard binding outside
another library's instance forward passes since the fix in rows.py/experts.py.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import transformers
from conftest import assert_cache_bytes, assert_clean, experts_read_fault, greedy, load_mix, logits_of, make_ids
from torch import nn

import tiered
from tests import models
from tiered import faults
from tiered.errors import StreamerError
from tiered.hostmem import PAGE_SIZE

GiB = 1 << 30
E = 8  # experts per block of the test Mixtral


def test_guard_reentrant_call_raises_and_recovers(mix, stock, ring_rows):
    """A same-thread call of the embedding / experts module from inside its own forward raises StreamerError
    (no deadlock); the module is clean afterwards and the model still equals stock."""
    import torch.nn.functional as F

    ref = stock(mix, impl="grouped_mm")
    ids = make_ids()
    want = logits_of(ref, ids)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        emb = m.model.embed_tokens
        real = F.embedding

        def reenter(*a, **k):
            return emb(torch.tensor([[1]]))

        F.embedding = reenter
        try:
            with pytest.raises(StreamerError, match="inside its own forward"):
                emb(ids)
        finally:
            F.embedding = real
        assert_clean(m)

        ex = m.model.layers[0].mlp.experts
        stock_ex = ref.model.layers[0].mlp.experts
        real_act = ex.act_fn
        x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        idx = torch.tensor([[0, 5], [2, 3], [5, 7]])
        w = torch.rand(3, 2, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

        class Reenter(nn.Module):
            def forward(self, h):
                return ex(x, idx, w)

        ex.act_fn = Reenter()
        try:
            with pytest.raises(StreamerError, match="inside its own forward"):
                ex(x, idx, w)
        finally:
            ex.act_fn = real_act
        assert_clean(m)
        assert torch.equal(ex(x, idx, w), stock_ex(x, idx, w))
        assert torch.equal(m(ids).logits, want)


@pytest.mark.parametrize("n_ok", [0, 1, 3])
def test_guard_keyboard_interrupt_in_bind_via_read_fault(mix, stock, ring_rows, n_ok):
    """Ctrl-C inside an experts module's bind (a reader thread, tiered.faults 'read'), at different experts:
    the lock is released, the placeholders are back, and the next model and direct calls equal stock."""
    ref = stock(mix, impl="grouped_mm")
    ids = make_ids(3)
    want = logits_of(ref, ids)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        fn, state = experts_read_fault(n_ok)
        with faults.inject("read", fn), pytest.raises(KeyboardInterrupt):
            m(ids)
        assert state["fired"]
        assert_clean(m)
        t = threading.Thread(target=lambda: m.model.layers[2].mlp.experts(
            torch.ones(1, 64, dtype=torch.bfloat16), torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bfloat16)),
            daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "another thread waited forever on an experts module's lock"
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(greedy(m, ids), greedy(ref, ids))


def test_guard_keyboard_interrupt_in_row_bind(mix, stock, ring_rows, monkeypatch):
    ref = stock(mix, impl="grouped_mm")
    ids = make_ids(4)
    want = logits_of(ref, ids)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        rg = m._tiered.rows[0]
        real = rg.read

        def once(u):
            monkeypatch.setattr(rg, "read", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(rg, "read", once)
        with pytest.raises(KeyboardInterrupt):
            m(ids)
        assert_clean(m)
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.model.embed_tokens(ids), ref.model.embed_tokens(ids))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("where", ["embedding_hook", "experts_hook", "experts_forward", "embedding_pre_hook"])
def test_guard_exception_in_user_hooks_and_forward(mix, stock, ring_rows, exc, where):
    """A user's forward (pre-)hook on the module, or its forward itself, raises once: the next call equals stock."""
    ref = stock(mix, impl="grouped_mm")
    ids = make_ids(5)
    want = logits_of(ref, ids)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        state = {"n": 0}

        def boom(*a):
            state["n"] += 1
            if state["n"] == 1:
                raise exc("boom")

        ex = m.model.layers[1].mlp.experts
        handle = None
        if where == "embedding_hook":
            handle = m.model.embed_tokens.register_forward_hook(boom)
        elif where == "embedding_pre_hook":
            handle = m.model.embed_tokens.register_forward_pre_hook(boom)
        elif where == "experts_hook":
            handle = ex.register_forward_hook(boom)
        else:
            real_act = ex.act_fn

            class Act(nn.Module):
                def forward(self, h):
                    boom()
                    return real_act(h)

            ex.act_fn = Act()
        with pytest.raises(exc):
            m(ids)
        assert_clean(m)
        assert torch.equal(m(ids).logits, want)
        assert state["n"] >= 2
        if handle is not None:
            handle.remove()
        else:
            ex.act_fn = real_act
        assert torch.equal(m(ids).logits, want)


@pytest.mark.parametrize("cache_gb", [0, 2.5 * 36864 / GiB, 1.0])
def test_guard_threads_direct_and_model_calls(mix, stock, ring_rows, cache_gb):
    """Direct calls of the embedding and of two experts modules from threads, concurrent with whole-model
    calls from two more threads (sharing the expert cache): every result equals stock."""
    ref = stock(mix, impl="grouped_mm")
    inputs = [make_ids(10 + i, (1 + i % 2, 5)) for i in range(2)]
    want = [logits_of(ref, x) for x in inputs]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    idxs = [torch.randint(0, E, (4, 2), generator=g) for _ in range(3)]
    ws = [torch.rand(4, 2, generator=g).to(torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        want_ex = {(b, i): ref.model.layers[b].mlp.experts(xs[i], idxs[i], ws[i]) for b in (0, 2) for i in range(3)}
        want_emb = [ref.model.embed_tokens(x) for x in inputs]
    errors: list[BaseException] = []
    with load_mix(mix, ring_rows, expert_cache_gb=cache_gb) as m:

        def model_calls(k):
            with torch.no_grad():
                for _ in range(3):
                    if not torch.equal(m(inputs[k]).logits, want[k]):
                        raise AssertionError(f"model call {k} differs")

        def expert_calls(b):
            with torch.no_grad():
                for r in range(6):
                    i = r % 3
                    if not torch.equal(m.model.layers[b].mlp.experts(xs[i], idxs[i], ws[i]), want_ex[(b, i)]):
                        raise AssertionError(f"experts of block {b} differ")

        def emb_calls():
            with torch.no_grad():
                for r in range(10):
                    if not torch.equal(m.model.embed_tokens(inputs[r % 2]), want_emb[r % 2]):
                        raise AssertionError("embedding rows differ")

        def run(fn, *a):
            try:
                fn(*a)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=run, args=a, daemon=True) for a in
              [(model_calls, 0), (model_calls, 1), (expert_calls, 0), (expert_calls, 2), (emb_calls,)]]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "a thread hung"
        assert not errors, errors
        assert_clean(m)
        if tiered.stats(m).expert_cache_slots:
            assert_cache_bytes(m, ref)


def test_guard_calls_after_close(mix, ring_rows):
    m = load_mix(mix, ring_rows, expert_cache_gb=1.0)
    with torch.no_grad():
        m(make_ids())
    emb, ex = m.model.embed_tokens, m.model.layers[1].mlp.experts
    m.close()
    assert "forward" not in emb.__dict__ and "forward" not in ex.__dict__  # the guards are gone
    with pytest.raises(StreamerError):
        emb(torch.tensor([[1, 2]]))
    with pytest.raises(StreamerError):
        ex(torch.ones(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bfloat16))
    with pytest.raises(StreamerError):
        m(make_ids())
    m.close()  # idempotent


def test_guard_user_wrapper_after_load(mix, stock, ring_rows):
    """accelerate-style: the user replaces module.forward after load by a wrapper calling the old one."""
    ref = stock(mix, impl="grouped_mm")
    ids = make_ids(8)
    want = logits_of(ref, ids)
    m = load_mix(mix, ring_rows)
    calls = {"emb": 0, "ex": 0}
    for name, mod in (("emb", m.model.embed_tokens), ("ex", m.model.layers[1].mlp.experts)):
        old = mod.forward

        def new_forward(*a, _old=old, _name=name, **k):
            calls[_name] += 1
            return _old(*a, **k)

        mod.forward = new_forward
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(greedy(m, ids), greedy(ref, ids))
    assert calls["emb"] >= 2 and calls["ex"] >= 2
    assert_clean(m)
    m.close()
    with pytest.raises(StreamerError):
        m.model.embed_tokens(torch.tensor([[1]]))
    with pytest.raises(StreamerError):
        m.model.layers[1].mlp.experts(torch.ones(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 1]]),
                                      torch.ones(1, 2, dtype=torch.bfloat16))


def _ring_whole_layer(ref, ring_rows):
    """A ring that holds a whole MoE layer twice: a wrapped experts module is not routed and streams with its layer."""
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    return max(ring_rows, 2 * (layer + 2 * PAGE_SIZE) / GiB)


def _attach_wrapped(mix, ring, wrap):
    cfg = transformers.AutoConfig.from_pretrained(mix)
    with torch.device("meta"):
        mm = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    mm.eval()
    wrap(mm)
    return tiered.attach(mm, mix, ring_gb=ring, device="cpu")


def test_guard_user_wrapper_before_attach_that_passes_inputs_through(mix, ring_rows):
    """A wrapper installed before tiered (an instance ``forward``) that passes inputs unchanged: the wrapped modules
    are not row-read or routed (the wrapper would see renumbered inputs), they stream whole with their unit; equal
    to stock, and close() leaves the user's wrapper in place."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(mix).eval()
    ids = make_ids(9)
    want = logits_of(ref, ids)
    calls = {"n": 0}
    mine = {}

    def wrap(model):
        for mod in (model.model.embed_tokens, model.model.layers[2].mlp.experts):
            orig = mod.forward

            def fwd(*a, _orig=orig, **k):
                calls["n"] += 1
                return _orig(*a, **k)

            mod.forward = fwd
            mine[id(mod)] = fwd

    m = _attach_wrapped(mix, _ring_whole_layer(ref, ring_rows), wrap)
    assert tiered.stats(m).row_units == 0 and tiered.stats(m).expert_modules == 2
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert calls["n"] == 2
    m.close()
    for mod in (m.model.embed_tokens, m.model.layers[2].mlp.experts):
        assert mod.__dict__["forward"] is mine[id(mod)]


def _offset_ids(model):
    emb = model.model.embed_tokens
    orig = emb.forward
    emb.forward = lambda ids: orig(models.VOCAB - 1 - ids)  # e.g. a vocabulary remap


def _remap_experts(model):
    ex = model.model.layers[1].mlp.experts
    orig = ex.forward
    ex.forward = lambda h, idx, w: orig(h, E - 1 - idx, w)  # e.g. an expert-id remap (pruned/merged experts)


def test_guard_user_wrapper_before_attach_that_remaps_ids(mix, ring_rows):
    ref = transformers.AutoModelForCausalLM.from_pretrained(mix).eval()
    _offset_ids(ref)
    ids = make_ids(11)
    want = logits_of(ref, ids)
    with _attach_wrapped(mix, _ring_whole_layer(ref, ring_rows), _offset_ids) as m, torch.no_grad():
        assert torch.equal(m(ids).logits, want)


def test_guard_user_wrapper_before_attach_that_remaps_experts(mix, ring_rows):
    ref = transformers.AutoModelForCausalLM.from_pretrained(mix).eval()
    _remap_experts(ref)
    ids = make_ids(12)
    want = logits_of(ref, ids)
    with _attach_wrapped(mix, _ring_whole_layer(ref, ring_rows), _remap_experts) as m, torch.no_grad():
        assert torch.equal(m(ids).logits, want)


def test_guard_deepcopy_refuses_cleanly(mix, stock, ring_rows):
    """deepcopy of a loaded model is refused at once (StreamedTensorError: it would share the ring) and leaves it
    usable."""
    ref = stock(mix, impl="grouped_mm")
    ids = make_ids(13)
    want = logits_of(ref, ids)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        m(ids)
        out: dict = {}

        def cp():
            try:
                out["copy"] = copy.deepcopy(m)
            except BaseException as e:  # noqa: BLE001
                out["err"] = e

        t = threading.Thread(target=cp, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "deepcopy hung"
        if "copy" in out:  # if it ever works, the copy must be right
            assert torch.equal(out["copy"](ids).logits, want)
        else:
            assert isinstance(out["err"], tiered.StreamedTensorError) and "load the directory again" in str(out["err"])
        assert_clean(m)
        assert torch.equal(m(ids).logits, want)


def test_pickle_is_refused_with_advice(mix, ring_rows):
    """``pickle.dumps`` and ``torch.save`` of a loaded model raise StreamedTensorError with advice that works (before
    the fix: pickle's "not the same object" error about the class tiered derives), and leave it usable."""
    import io
    import pickle

    ids = make_ids(14)
    with load_mix(mix, ring_rows) as m, torch.no_grad():
        want = m(ids).logits
        for dump in (pickle.dumps, lambda obj: torch.save(obj, io.BytesIO())):
            with pytest.raises(tiered.StreamedTensorError, match="pass the checkpoint directory"):
                dump(m)
        assert_clean(m)
        assert torch.equal(m(ids).logits, want)
