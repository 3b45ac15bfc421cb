"""Embedding rows (issue 8, capability 2): a streamed embedding reads only the rows its ids look up.

Every test compares with stock ``transformers`` bit for bit; byte counts are checked against the ids.
"""

from __future__ import annotations

import threading
from pathlib import Path

import models
import pytest
import torch
import transformers

import tiered
from tiered.placeholder import is_placeholder
from tiered.rows import row_eligible


def _ref(path: Path, cls=transformers.AutoModelForCausalLM) -> torch.nn.Module:
    return cls.from_pretrained(path).eval()


def _ring_without_embedding(path: Path) -> float:
    """A ring (GiB) holding the largest unit of ``path`` that is *not* an embedding, twice over (from the plan
    of a probe load)."""
    with tiered.load(path, ring_gb=1, device="cpu") as probe:
        big = max(u.nbytes for u in probe._tiered.plan.units if not row_eligible(u))
    return 2 * (big + 4096) / 2**30


@pytest.mark.parametrize("name", ["llama_fp32", "gpt2", "llama_tied_single"])
def test_logits_and_generate_equal_with_row_streaming(ckpts, name):
    path = ckpts[name]
    ref = _ref(path)
    ids = torch.tensor([[1, 5, 5, 9, 100, 3, 7, 5]])
    with torch.no_grad():
        want = ref(ids).logits
        want_gen = ref.generate(ids, max_new_tokens=6, do_sample=False)
        ring = _ring_without_embedding(path)
        with tiered.load(path, ring_gb=ring, device="cpu") as model:
            s = tiered.stats(model)
            assert s.row_units >= 1 and s.resident_units == 0
            assert torch.equal(model(ids).logits, want)
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want_gen)
    assert want.abs().sum() > 0


def test_decode_step_reads_only_its_rows(ckpts):
    path = ckpts["llama_fp32"]
    ref = _ref(path)
    emb = ref.model.embed_tokens.weight
    row_bytes = emb.shape[1] * emb.element_size()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 8, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        ring = _ring_without_embedding(path)
        with tiered.load(path, ring_gb=ring, device="cpu") as model:
            out = model(ids, use_cache=True)
            s0 = tiered.stats(model).embedding_bytes
            assert s0 == len(set(ids.flatten().tolist())) * row_bytes  # 12 distinct ids of 16
            nxt = torch.tensor([[99], [99]])  # batch 2, one token each, the same id: one row
            step = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            s1 = tiered.stats(model)
            assert s1.embedding_bytes - s0 == row_bytes
            assert s1.embedding_bytes < emb.numel() * emb.element_size() / 4  # not the table
            want = ref(nxt, past_key_values=ref(ids, use_cache=True).past_key_values).logits
            assert torch.equal(step.logits, want)


def test_embedding_larger_than_the_ring(tmp_path):
    """A Llama base model (no head) whose embedding (vocab 8192 x 64 fp32 = 2 MiB) is 4x the ring: that was
    RingTooSmallError, now it runs, equal to stock; embedding_rows=False still refuses, naming the unit, when
    units go through the ring (zero_copy=False; with zero copy on the CPU a unit needs no ring: test_zero_copy.py)."""
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.LlamaModel(cfg)
    models.save_model(m, tmp_path / "m", seed=5, dtype=torch.float32, max_shard_size=None)
    ref = _ref(tmp_path / "m", transformers.AutoModel)
    emb_bytes = 8192 * 64 * 4
    ring_gb = emb_bytes / 4 / 2**30
    with pytest.raises(tiered.RingTooSmallError, match="embed_tokens"):
        tiered.load(tmp_path / "m", ring_gb=ring_gb, device="cpu", embedding_rows=False, zero_copy=False)
    ids = torch.tensor([[7, 8191, 0, 4000, 7]])
    with torch.no_grad(), tiered.load(tmp_path / "m", ring_gb=ring_gb, device="cpu") as model:
        want = ref(ids).last_hidden_state
        assert torch.equal(model(ids).last_hidden_state, want)
        s = tiered.stats(model)
        assert s.ring_high_water <= ring_gb * 2**30 < emb_bytes
        assert s.embedding_bytes == 4 * 64 * 4  # 4 distinct ids of 5
    assert want.abs().sum() > 0


def test_out_of_range_id_raises_like_stock(ckpts):
    path = ckpts["llama_fp32"]
    ref = _ref(path)
    bad = torch.tensor([[1, ref.config.vocab_size]])
    with pytest.raises(IndexError):
        ref(bad)
    ring = _ring_without_embedding(path)
    with tiered.load(path, ring_gb=ring, device="cpu") as model:
        with pytest.raises(IndexError, match="out of range"):
            model(bad)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)  # the next call is fine


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.bool])
def test_ids_of_another_integer_dtype_raise_like_stock(ckpts, dtype):
    """int8, uint8, int16 and bool ids: stock's ``F.embedding`` raises its RuntimeError naming the dtypes it takes;
    a row embedding raises the same (before the fix: a TypeError of tiered's own)."""
    path = ckpts["llama_fp32"]
    ref = _ref(path)
    ids = torch.tensor([[1, 0, 1]]).to(dtype)
    with pytest.raises(Exception) as want:
        ref(ids)
    with tiered.load(path, ring_gb=_ring_without_embedding(path), device="cpu") as model:
        assert tiered.stats(model).row_units == 1
        with pytest.raises(Exception) as got:
            model(ids)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
        assert is_placeholder(model.model.embed_tokens.weight)


def test_direct_calls_from_threads_and_after_close(ckpts):
    path = ckpts["llama_fp32"]
    ref = _ref(path)
    ring = _ring_without_embedding(path)
    model = tiered.load(path, ring_gb=ring, device="cpu")
    emb = model.model.embed_tokens
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(20):
                ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=g)
                with torch.no_grad():
                    if not torch.equal(emb(ids), ref.model.embed_tokens(ids)):
                        raise AssertionError(f"thread {seed}: rows differ")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert is_placeholder(emb.weight)  # the placeholder is back between calls
    model.close()
    with pytest.raises(tiered.StreamerError):
        emb(torch.tensor([[1]]))


def test_truncated_shard_names_tensor(tmp_path, ckpts):
    path = ckpts.copy("llama_tied_single", tmp_path / "m")
    shard = path / "model.safetensors"
    ring = _ring_without_embedding(path)
    with tiered.load(path, ring_gb=ring, device="cpu") as model:
        src = next(u for u in model._tiered.plan.units if row_eligible(u)).targets[0].copies[0].src
        row = src.shape[1] * src.dtype.itemsize
        with open(shard, "r+b") as f:  # cut the file inside the embedding table, after row 10
            f.truncate(src.offset + 10 * row)
        with pytest.raises(tiered.TruncatedShardError, match=r"model\.safetensors.*truncated"):
            model.model.embed_tokens(torch.tensor([[3, 50]]))


def test_rewritten_shard_is_an_error(tmp_path, ckpts):
    import os

    path = ckpts.copy("llama_tied_single", tmp_path / "m")
    shard = path / "model.safetensors"
    ring = _ring_without_embedding(path)
    with tiered.load(path, ring_gb=ring, device="cpu") as model:
        ids = torch.tensor([[3, 50]])
        model.model.embed_tokens(ids)
        st = os.stat(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "rewritten in place"
        with pytest.raises(tiered.ShardChangedError, match="model.safetensors"):
            model.model.embed_tokens(ids)


def test_dropped_model_closes_row_reader(ckpts):
    import gc
    import os

    path = ckpts["llama_fp32"]
    ring = _ring_without_embedding(path)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    model = tiered.load(path, ring_gb=ring, device="cpu")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert tiered.stats(model).row_units == 1
    del model
    gc.collect()
    import time

    deadline = time.time() + 30  # the reaper thread closes a dropped model, just after the collector frees it
    while len(os.listdir("/proc/self/fd")) > before and time.time() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before  # every shard fd, the row reader's included, is closed


def test_keyboard_interrupt_inside_the_embedding(ckpts, monkeypatch):
    """Ctrl-C inside the embedding's forward skips its forward hook (torch runs always_call hooks for Exception
    only): the next model call must still find the placeholder back, the lock free and the output equal."""
    import torch.nn.functional as F

    path = ckpts["gpt2"]
    ref = _ref(path)
    ring = _ring_without_embedding(path)
    ids = torch.tensor([[1, 2, 3, 2]])
    real = F.embedding
    calls = {"n": 0}

    def once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    with torch.no_grad(), tiered.load(path, ring_gb=ring, device="cpu") as model:
        monkeypatch.setattr(F, "embedding", once)
        with pytest.raises(KeyboardInterrupt):
            model(ids)
        monkeypatch.setattr(F, "embedding", real)
        assert all(not rg.lock.locked() for rg in model._tiered.rows)
        assert is_placeholder(model.transformer.wte.weight)
        assert torch.equal(model(ids).logits, ref(ids).logits)
        # the same, in a direct call of the embedding: its next direct call recovers
        monkeypatch.setattr(F, "embedding", once)
        calls["n"] = 0
        with pytest.raises(KeyboardInterrupt):
            model.transformer.wte(ids)
        monkeypatch.setattr(F, "embedding", real)
        # the interrupted direct call left nothing behind: another thread's call runs (it used to wait forever)
        assert all(not rg.lock.locked() for rg in model._tiered.rows)
        assert is_placeholder(model.transformer.wte.weight)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(out=model(ids).logits), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a call from another thread waited on the embedding's lock"
        assert torch.equal(got["out"], ref(ids).logits)
        assert torch.equal(model.transformer.wte(ids), ref.transformer.wte(ids))


def test_positional_embeddings_that_compute_their_ids_are_not_row_streamed(tmp_path):
    """OPT's positional embedding takes the attention mask first and computes the ids itself: not eligible
    (it streams whole, as before), and the model stays equal to stock."""
    cfg = transformers.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=64, word_embed_proj_dim=32)
    models.save_model(transformers.OPTForCausalLM(cfg), tmp_path / "m", seed=3, dtype=torch.float32,
                      max_shard_size=None)
    ref = _ref(tmp_path / "m")
    ring = _ring_without_embedding(tmp_path / "m")
    with tiered.load(tmp_path / "m", ring_gb=1, device="cpu") as probe:
        eligible = {u.name for u in probe._tiered.plan.units if row_eligible(u)}
    assert not any("embed_positions" in n for n in eligible), eligible
    ids = torch.tensor([[5, 6, 7, 8, 5], [1, 2, 3, 4, 9]])
    with torch.no_grad(), tiered.load(tmp_path / "m", ring_gb=ring, device="cpu") as model:
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)).logits,
                           ref(ids, attention_mask=torch.ones_like(ids)).logits)


class _SoftTokens(torch.nn.Module):
    """Ovis2's visual embedding table (stock class) behind a block: integer ids look rows up; float "soft tokens"
    (probabilities over the visual vocabulary) are multiplied by the whole table."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.ovis2.modeling_ovis2 import Ovis2VisualEmbeddingTable

        self.table = Ovis2VisualEmbeddingTable(512, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.table(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_eligibility_is_decided_per_call(tmp_path: Path, dtype) -> None:
    """Integer ids read rows; float input (Ovis2's ``get_image_features``) binds the whole table for that call. Before
    the fix: a TypeError on float input."""
    from safetensors.torch import save_model

    torch.manual_seed(7)
    ref = _SoftTokens().to(dtype).eval()
    save_model(ref, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        mod = _SoftTokens().to(dtype)
    m = tiered.attach(mod, tmp_path, ring_gb=40 * 1024 / 2**30, device="cpu")  # 40 KiB: two blocks, not the table
    try:
        assert tiered.stats(m).row_units == 1, tiered.stats(m).placement
        ids = torch.tensor([[3, 500, 3, 17]])
        soft = torch.softmax(torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(1)), -1).to(dtype)
        with torch.no_grad():
            for x in (ids, soft, ids, soft):
                want = ref(x)
                assert want.abs().sum() > 0
                assert torch.equal(m(x), want)
        assert is_placeholder(m.table.weight)
    finally:
        m.close()
