"""The CUDA path: pinned ring, copy stream and events, device buffer pool, residency, interrupts.

Run on a GPU machine with ``pytest -m cuda``; skipped without CUDA (CI has none). Every check
compares with stock ``transformers`` on the same GPU bit for bit.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import wait as futures_wait
from pathlib import Path

import pytest
import torch
import transformers
from conftest import Checkpoints
from conftest import run_child as _run_child
from models import VOCAB
from safetensors.torch import save_file
from test_equality import _Tables
from test_lifecycle import USE_AFTER_CLOSE

import tiered
import tiered.expert_cache
import tiered.experts  # the tests below patch constants here and in tiered.policy
import tiered.policy
from tiered import faults
from tiered.errors import StreamerError
from tiered.placeholder import is_placeholder
from tiered.stage import CudaStage, DeviceArena

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GiB = 1 << 30
DEV = "cuda"


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _ref(d: Path, auto=transformers.AutoModelForCausalLM, **kw):
    return auto.from_pretrained(d, device_map=DEV, **kw).eval()


@pytest.mark.parametrize("name", ["llama", "llama_tied_single", "gptj", "gpt2", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("mode", ["resident", "streamed", "mixed"])
def test_bitwise_equal_to_stock_on_cuda(name: str, mode: str, ckpts: Checkpoints) -> None:
    d = ckpts[name]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    kw = {"resident": {"ring_gb": 0.05}, "streamed": {"ring_gb": 0.0005, "gpu_gb": 0}}.get(mode)
    if kw is None:  # part resident (an explicit budget counts the resident units and one device buffer);
        # experts stay in their layers (routed, the layers left without them would all fit: test_routed_* covers that)
        with tiered.load(d, device=DEV, ring_gb=0.05) as probe:
            plan = probe._tiered.plan
        # two of the largest units short of the whole model, so a few units stream (and are prefetched)
        kw = {"ring_gb": 0.0005, "gpu_gb": (plan.nbytes - 2 * plan.max_unit.nbytes - 1) / GiB, "prefetch": 1,
              "routed_experts": False}
    with tiered.load(d, device=DEV, **kw) as m, torch.no_grad():
        s = tiered.stats(m)
        if mode == "resident":
            assert s.resident_units == s.units
        elif mode == "streamed":
            assert s.resident_units == 0
        else:
            assert 0 < s.resident_units < s.units, s
        for _ in range(3):  # several passes: buffers and slots are reused under the events
            assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0), want_gen)
        if mode != "resident":
            assert s.h2d_bytes > 0 and s.hits > 0


def test_ring_is_pinned_and_copies_run_on_their_own_stream(ckpts: Checkpoints) -> None:
    with tiered.load(ckpts["llama"], device=DEV, ring_gb=0.0005, gpu_gb=0, prefetch=2) as m:
        h = m._tiered
        assert h.ring.pinned
        stage = h.streamer.stage
        assert isinstance(stage, CudaStage)
        assert stage.copy_stream != torch.cuda.current_stream()
        largest = max(u.buf_bytes for u in h.plan.units if u.index not in h.streamer.resident_ids)
        assert stage.n_bufs == 3 and largest <= stage.arena.slot_bytes < largest + DeviceArena.ALIGN
        assert h.stats.device_buffer_bytes == stage.pool_bytes == 3 * stage.arena.slot_bytes
        with torch.no_grad():
            m(_ids())
        torch.cuda.synchronize()
        assert h.stats.h2d_bytes > 0 and h.stats.h2d_s > 0
        assert not h.streamer.held


def test_prefetch_goes_by_bytes_of_the_device_pool(tmp_path: Path) -> None:
    """A head about seven times a layer: with prefetch=1 the device pool is two head-sized slots, and the streamer
    keeps as many layers ahead as fit one slot (by bytes), where a pool counted in buffers held one; outputs stay
    stock's."""
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    import models

    d = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "bighead", seed=7, dtype=torch.bfloat16,
                   max_shard_size="200KB")
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    del ref
    with tiered.load(d, device=DEV, ring_gb=0.004, gpu_gb=0, prefetch=1) as m, torch.no_grad():
        st = m._tiered.streamer
        layer = max(st.units[i].nbytes for i in st.streamed if ".layers." in st.units[i].name)
        assert st.stage.arena.slot_bytes > 5 * layer, "the head should dwarf a layer"
        ahead: list[int] = []
        hook = m.model.layers[1].register_forward_pre_hook(lambda mod, args: ahead.append(len(st.pending)))
        for _ in range(3):  # the first pass learns the order; the later ones prefetch by it
            assert torch.equal(m(_ids()).logits, want)
        hook.remove()
        assert max(ahead[1:]) >= 3, f"units pending at layer 1: {ahead}"
        assert st.stage.arena.live_bytes <= st.stage.pool_bytes
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0), want_gen)


def test_close_gives_the_device_pool_back(ckpts: Checkpoints) -> None:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    m = tiered.load(ckpts["llama"], device=DEV, ring_gb=0.0005, gpu_gb=0, prefetch=3)
    with torch.no_grad():
        m(_ids())
    stage = m._tiered.streamer.stage
    assert torch.cuda.memory_allocated() > before
    one_buf = stage.arena.slot_bytes
    m.close()
    assert stage.arena.live == 0 and stage.pool_bytes == 0
    torch.cuda.synchronize()
    # what is left is the model's own small buffers (rotary inv_freq on the device), not a device buffer
    assert torch.cuda.memory_allocated() - before < one_buf, "device buffers outlived close()"
    del m
    gc.collect()
    assert torch.cuda.memory_allocated() <= before


def test_keyboard_interrupt_on_cuda(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with torch.no_grad():
        want = _ref(d)(_ids()).logits
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0, prefetch=1) as m, torch.no_grad():
        stage = m._tiered.streamer.stage

        def interrupt(mod, args):
            raise KeyboardInterrupt

        for _ in range(stage.n_bufs + 2):  # more interrupts than device buffers
            h = m.model.layers[1].register_forward_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                m(_ids())
            h.remove()
            assert not m._tiered.streamer.held
        for _ in range(2):
            assert torch.equal(m(_ids()).logits, want)


def test_injected_faults_on_cuda(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with torch.no_grad():
        want = _ref(d)(_ids()).logits
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0) as m, torch.no_grad():
        for point in ("read", "stage"):
            def fail(point: str = point, **info) -> None:
                raise OSError(5, f"injected at {point}")

            with faults.inject(point, fail), pytest.raises(StreamerError, match="injected"):
                m(_ids())
            assert torch.equal(m(_ids()).logits, want)


def test_a_failed_copy_gives_its_device_buffer_back(ckpts: Checkpoints, monkeypatch) -> None:
    """An H2D copy that raises (``CudaStage.put``) gives its pool buffer back: with prefetch=1 (two slots), two lost
    buffers would leave no room and the next pass would wait forever."""
    d = ckpts["llama"]
    with torch.no_grad():
        want = _ref(d)(_ids()).logits
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0, prefetch=1) as m, torch.no_grad():
        st = m._tiered.streamer
        real = CudaStage.put

        def boom(self, *args, **kw):
            raise RuntimeError("injected: the copy failed")

        for _ in range(3):
            monkeypatch.setattr(CudaStage, "put", boom)
            with pytest.raises(StreamerError, match="injected"):
                m(_ids())
            monkeypatch.setattr(CudaStage, "put", real)
            futures_wait(list(st.pending.values()), timeout=30)
            ahead = [f.result() for f in list(st.pending.values()) if f.exception() is None]
            assert st.stage.arena.live == sum(ld.dev is not None for ld in ahead), "a failed copy kept its buffer"
        assert torch.equal(m(_ids()).logits, want)


def test_threads_on_cuda(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with torch.no_grad():
        want = _ref(d)(_ids()).logits
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0) as m:
        out: list[torch.Tensor] = []

        def run() -> None:
            with torch.no_grad():
                for _ in range(3):
                    out.append(m(_ids()).logits)

        ts = [threading.Thread(target=run) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert len(out) == 9 and all(torch.equal(o, want) for o in out)


def test_aliased_output_on_cuda(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = _Tables()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    with torch.no_grad():
        want, _ = ref.to(DEV)(40)
    with torch.device("meta"):
        mod = _Tables()
    with tiered.attach(mod, tmp_path, ring_gb=2 * 64 * 256 * 4 / GiB, device=DEV, gpu_gb=0, prefetch=1) as m:
        with torch.no_grad():
            for _ in range(2):
                got, extra = m(40)
                assert torch.equal(got, want) and torch.equal(extra["first"], want[0])


def test_keep_in_fp32_on_cuda(ckpts: Checkpoints) -> None:
    d = ckpts["t5"]
    ref = _ref(d, transformers.AutoModelForSeq2SeqLM, dtype=torch.float16)
    kw = {"input_ids": _ids(), "decoder_input_ids": _ids(1)[:, :4]}
    with torch.no_grad():
        want = ref(**kw).logits
    for extra in ({"ring_gb": 0.05}, {"ring_gb": 0.001, "gpu_gb": 0}):
        with tiered.load(d, device=DEV, dtype=torch.float16, **extra) as m, torch.no_grad():
            assert torch.equal(m(**kw).logits, want)


def test_use_after_close_on_cuda_does_not_crash(ckpts: Checkpoints) -> None:
    code = USE_AFTER_CLOSE.replace('device="cpu"', 'device="cuda", gpu_gb=0').replace(
        "torch.tensor([[1, 2, 3]])", "torch.tensor([[1, 2, 3]], device='cuda')")
    r = _run_child(code, str(ckpts["llama"]), "0.0005")
    assert r.returncode == 0 and "ok 1" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_embedding_rows_on_cuda(tmp_path: Path) -> None:
    """A Llama base model whose embedding is 4x the ring streams it by rows on CUDA, equal to stock on the GPU."""
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    import models

    models.save_model(transformers.LlamaModel(cfg), tmp_path / "m", seed=5, dtype=torch.float32, max_shard_size=None)
    ref = _ref(tmp_path / "m", transformers.AutoModel)
    ring_gb = 8192 * 64 * 4 / 4 / GiB
    ids = torch.tensor([[7, 8191, 0, 4000, 7]], device=DEV)
    with torch.no_grad(), tiered.load(tmp_path / "m", device=DEV, ring_gb=ring_gb, gpu_gb=0) as m:
        s = tiered.stats(m)
        assert s.row_units == 1 and s.resident_units == 0
        want = ref(ids).last_hidden_state
        assert torch.equal(m(ids).last_hidden_state, want)
        assert tiered.stats(m).embedding_bytes == 4 * 64 * 4
        emb = m.embed_tokens
        assert torch.equal(emb(ids), ref.embed_tokens(ids)) and is_placeholder(emb.weight)


def _big_layers(root: Path, dtype=torch.float32, tie: bool = False) -> Path:
    """A Llama whose decoder layers (~1.3 MB in fp32) and untied head (1 MB) are several times the 0.3 MiB pieces
    the tests below allow."""
    import models

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=704, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    models.save_model(transformers.LlamaForCausalLM(cfg), root, seed=11, dtype=dtype, max_shard_size="700KB")
    return root


def _big_layers_and_stock(tmp_path: Path, monkeypatch, *, seed: int):
    """:func:`_big_layers` with 64 KiB pieces allowed, ids ``(2, 9)`` on the GPU, and stock's logits for them and
    greedy generate (6 tokens) from the first row."""
    monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 64 << 10)
    d = _big_layers(tmp_path / "m")
    ref = _ref(d)
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(seed)).to(DEV)
    with torch.no_grad():
        return d, ids, ref(ids).logits, ref.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("io", ["mmap", "pread", "direct"])
@pytest.mark.parametrize("mode", ["streamed", "resident"])
def test_units_larger_than_the_ring_stream_in_pieces(io: str, mode: str, tmp_path: Path, monkeypatch) -> None:
    """Issue 8, capability 1 on CUDA: every layer and the head are larger than the ring; each is read through it
    in pieces into one full-size device buffer. Logits and greedy generate equal stock's on the GPU bit for bit,
    the ring never holds more than its size, and RingTooSmallError is gone."""
    d, ids, want, want_gen = _big_layers_and_stock(tmp_path, monkeypatch, seed=4)
    ring_gb = (640 << 10) / GiB  # 0.625 MiB: pieces of < 0.3 MiB
    kw = {"gpu_gb": 0} if mode == "streamed" else {"gpu_gb": 1}
    with tiered.load(d, device=DEV, ring_gb=ring_gb, io=io, **kw) as m, torch.no_grad():
        h = m._tiered
        s = tiered.stats(m)
        rows = {rg.unit.index for rg in h.rows}  # the embedding reads its rows (no ring, no pieces)
        big = [u for u in h.plan.units if u.nbytes > h.ring.size and u.index not in rows]
        assert len(big) >= 4, [(u.name, u.nbytes) for u in h.plan.units]  # 3 layers and the head
        assert s.piece_units == len(big)
        assert all(len(h.streamer.loader.pieces[u.index]) >= 4 for u in big)
        if mode == "resident":
            assert s.resident_units == s.units - s.row_units
        for _ in range(2):
            assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
        assert h.ring.high_water <= h.ring.size
        if mode == "streamed":
            assert s.h2d_bytes >= sum(u.nbytes for u in big)


@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_units_the_ring_holds_once_stream_in_pieces(io: str, tmp_path: Path, monkeypatch) -> None:
    """``tiered.policy.PIECES_WHEN_ONE_FITS`` (issue 23: the next unit's read need not wait for this one's H2D): the
    layers and the head, each of which the ring holds whole but not twice, are read in pieces; logits and greedy
    generate equal stock's on the GPU bit for bit; with O_DIRECT the pieces are read straight into their ring slots
    (each piece's slot shifted as a whole unit's is: ``Reader.slot_direct_bytes``)."""
    from tiered.hostmem import page_up

    d, ids, want, want_gen = _big_layers_and_stock(tmp_path, monkeypatch, seed=6)
    monkeypatch.setattr(tiered.policy, "PIECES_WHEN_ONE_FITS", True)
    ring_gb = 1.9 * (1 << 20) / GiB  # a 1.3 MB layer and the 1 MiB head whole, never two of them
    with tiered.load(d, device=DEV, ring_gb=ring_gb, io=io, gpu_gb=0) as m, torch.no_grad():
        h = m._tiered
        rows = {rg.unit.index for rg in h.rows}
        once = [u for u in h.plan.units if u.index not in rows and page_up(u.nbytes) <= h.ring.size < 2 * page_up(u.nbytes)]
        assert len(once) >= 4, [(u.name, u.nbytes) for u in h.plan.units]  # 3 layers and the head
        assert tiered.stats(m).piece_units == len(once)
        assert all(len(h.streamer.loader.pieces[u.index]) >= 2 for u in once)
        for _ in range(2):
            assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
        assert h.ring.high_water <= h.ring.size
        if io == "direct" and h.reader.backend == "direct":
            assert h.reader.slot_direct_bytes > 0


def test_pieces_with_a_cast_and_faults(tmp_path: Path, monkeypatch) -> None:
    """Pieces of a unit cast on the fly (fp32 checkpoint run in bf16) give stock's bits; a read that fails part-way
    through a unit's pieces is an error in the caller, the device buffer goes back to the pool, and the next
    pass is equal again."""
    monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 64 << 10)
    d = _big_layers(tmp_path / "m")
    ref = _ref(d, dtype=torch.bfloat16)
    ids = _ids(5)
    with torch.no_grad():
        want = ref(ids).logits
    # bf16 halves the units (0.64 MB layers, 0.5 MB head): a 320 KiB ring still needs pieces for them
    with tiered.load(d, device=DEV, ring_gb=(320 << 10) / GiB, gpu_gb=0, dtype=torch.bfloat16) as m, torch.no_grad():
        assert tiered.stats(m).piece_units >= 4
        assert torch.equal(m(ids).logits, want)
        n = {"k": 0}

        def boom(**info):
            n["k"] += 1
            if n["k"] == 5:
                raise OSError("injected: the disk went away")

        with faults.inject("read", boom), pytest.raises((OSError, StreamerError)):
            m(ids)
        st = m._tiered.streamer
        for _ in range(2):
            assert torch.equal(m(ids).logits, want)
        # every device buffer is back in the pool, or holds a prefetch of the next pass
        ahead = [f.result() for f in list(st.pending.values())]
        assert st.stage.arena.live == sum(ld.dev is not None for ld in ahead)


@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_host_tier_holds_pieces_of_units_larger_than_the_ring(io: str, tmp_path: Path, monkeypatch) -> None:
    """A host tier smaller than any layer holds the first pieces of the units larger than the ring (one per unit in
    turn); the rest streams through the ring, its reads pipelined (the next piece queued before this one is waited
    for). Stock's bits; per pass, exactly the held pieces' bytes come from the host tier instead of the disk; the
    placement `tiered inspect` prints is the load's; the ring never holds more than its size."""
    from tiered.cli import _plan_for
    from tiered.placement import place_here

    d, ids, want, want_gen = _big_layers_and_stock(tmp_path, monkeypatch, seed=6)
    ring_gb = (640 << 10) / GiB
    per_pass = {}
    small = (900 << 10) / GiB  # below a layer (1.3 MB) and the head (1 MiB): several pieces of ~0.2 MiB
    for host_gb in (0.0, small):
        with tiered.load(d, device=DEV, ring_gb=ring_gb, gpu_gb=0, io=io, host_gb=host_gb) as m, torch.no_grad():
            h, st = m._tiered, m._tiered.streamer
            s = tiered.stats(m)
            assert s.piece_units >= 4
            s0 = s.snapshot()
            assert torch.equal(m(ids).logits, want)
            s1 = s.snapshot()
            per_pass[host_gb] = (s1["streamed_bytes"] - s0["streamed_bytes"], s1["host_used_bytes"] - s0["host_used_bytes"])
            assert torch.equal(m(ids).logits, want)
            assert torch.equal(m.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
            assert h.ring.high_water <= h.ring.size
            if host_gb:
                assert s.host_pieces >= 3 and st.host_pieces, s.snapshot()
                assert max(st.host_pieces.values()) - min(st.host_pieces.values()) <= 1
                held = sum(st.host_piece_bytes.values())
                config, ck, plan = _plan_for(d, None, "cuda")
                p = place_here(plan, device="cuda", ckpt_bytes=ck.nbytes, config=config, ring_gb=ring_gb, gpu_gb=0,
                               host_gb=host_gb)
                assert p.host_pieces == st.host_pieces and set(p.host) == st.host_ids
    (streamed0, used0), (streamed1, used1) = per_pass[0.0], per_pass[small]
    assert used0 == 0 and used1 > 0
    assert streamed0 - streamed1 == used1  # what the host tier gave is exactly what the disk did not
    whole = sum(st.read_share[i] for i in st.host_ids)  # small units it holds whole (a norm), if any
    assert used1 == held + whole and held > 0


def test_ring_too_small_for_a_piece_says_so(tmp_path: Path) -> None:
    d = _big_layers(tmp_path / "m")
    with pytest.raises(tiered.RingTooSmallError, match="two pieces"):
        tiered.load(d, device=DEV, ring_gb=(640 << 10) / GiB, gpu_gb=0)  # MIN_PIECE_BYTES is 4 MiB


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "olmoe", "gpt_oss",
                                  "glm4_moe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_routed_experts_on_cuda(name: str, impl: str, ckpts: Checkpoints) -> None:
    """Streamed MoE blocks read only their routed experts (pinned staging, H2D on the compute stream):
    stock's bits on the GPU with each experts implementation, for prefill, decode and generate."""
    d = ckpts[name]
    ref = _ref(d, experts_implementation=impl)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0) as m, torch.no_grad():
        m.set_experts_implementation(impl)
        s = tiered.stats(m)
        assert s.expert_modules >= 2 and s.resident_units == 0
        assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0), want_gen)
        s = tiered.stats(m).snapshot()
        assert s["experts_read"] > 0 and s["expert_bytes"] > 0
        # every expert module's parameters are the meta placeholders again between calls
        for eg in m._tiered.experts:
            assert all(is_placeholder(p) for p in eg.spec.module.parameters(recurse=False))


def test_parameters_the_checkpoint_never_holds_on_cuda(ckpts: Checkpoints) -> None:
    """Marian's sinusoidal position tables, computed at load (tiered.meta.regenerate_param), are moved to the GPU with
    the buffers: stock's logits and tokens on CUDA, streamed."""
    d = ckpts["marian"]
    ref = _ref(d, auto=transformers.MarianMTModel)
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        want_gen = ref.generate(ids, max_new_tokens=4, do_sample=False)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0) as m, torch.no_grad():
        assert tiered.stats(m).resident_units == 0
        assert m.model.encoder.embed_positions.weight.device.type == "cuda"
        assert torch.equal(m(input_ids=ids, decoder_input_ids=ids[:, :4]).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False), want_gen)


@pytest.mark.parametrize("name", ["llama4", "llama4_top2", "dbrx"])
@pytest.mark.parametrize("cache", [None, 1.0])
def test_routed_experts_of_their_own_kind_on_cuda(name: str, cache: float | None, ckpts: Checkpoints) -> None:
    """Experts modules tiered routes by their own rules (tiered/expert_spec.py): Llama 4's, which run every expert
    on score-scaled input (the picked ones read into full ``(E, ...)`` device tensors, the rest zero), and DBRX's
    flat ``(E * F, H)`` rows: stock's bits on the GPU for prefill and generate, with and without an expert cache."""
    d = ckpts[name]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0, expert_cache_gb=cache) as m, torch.no_grad():
        s = tiered.stats(m)
        assert s.expert_modules == 2 and s.resident_units == 0
        assert all(eg.spec.dense == name.startswith("llama4") for eg in m._tiered.experts)
        for _ in range(2):
            assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0), want_gen)
        assert tiered.stats(m).snapshot()["experts_read"] > 0
        for eg in m._tiered.experts:
            assert all(is_placeholder(p) for p in eg.spec.owner.parameters(recurse=False))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("policy", ["layer", "lru"])
def test_expert_cache_on_cuda(name: str, policy: str, ckpts: Checkpoints, monkeypatch) -> None:
    """Routed experts with a GPU expert cache (hits copied device to device on the compute stream, misses read
    through the staging and then stored): stock's bits on the GPU for prefill, decode and generate; a default
    cache from what gpu_gb leaves."""
    monkeypatch.setattr(tiered.expert_cache, "POLICY", policy)
    d = ckpts[name]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    from tiered.experts import slot_layout

    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0, expert_cache_gb=0) as m0:
        e = m0._tiered.experts[0].spec.expert_bytes
        total = sum(eg.spec.num_experts for eg in m0._tiered.experts)
        dense = sum(u.nbytes for u in m0._tiered.plan.units)  # the units without their routed experts
        reserve = max(eg.spec.num_experts * eg.spec.expert_bytes for eg in m0._tiered.experts)
        slot = max(slot_layout(eg.spec)[1] for eg in m0._tiered.experts)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0, expert_cache_gb=(total // 3 + 0.5) * e / GiB) as m, \
            torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=8, do_sample=False, pad_token_id=0), want_gen)
        s = tiered.stats(m).snapshot()
        assert s["expert_cache_slots"] == total // 3
        assert s["expert_cache_hits"] > 0 or policy == "lru"  # LRU on this cycle may never hit (see expert_cache.py)
        assert m._tiered.expert_cache.store.device.type == "cuda"
    # the default: what gpu_gb leaves after the (all resident) dense part and one block's experts for a prefill
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=(dense + reserve + 3.5 * slot) / GiB) as m, torch.no_grad():
        assert tiered.stats(m).expert_cache_slots == 3
        assert torch.equal(m(_ids()).logits, want)


def test_routed_experts_staging_larger_than_half(ckpts: Checkpoints, monkeypatch) -> None:
    """Experts larger than half the pinned staging are copied in pieces, double-buffered: same bits."""
    import tiered.experts as ex

    monkeypatch.setattr(ex, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(tiered.experts, "STAGING_BYTES", 64 << 10)
    d = ckpts["mixtral"]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids(3)).logits
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0) as m, torch.no_grad():
        assert m._tiered.experts[0].spec.expert_bytes > (64 << 10) // 2
        assert torch.equal(m(_ids(3)).logits, want)


@pytest.mark.parametrize("name", ["llama", "mixtral", "gptj"])
def test_host_tier_on_cuda(name: str, ckpts: Checkpoints) -> None:
    """host_gb: streamed units read once into pinned host memory, copied to the GPU from there every pass:
    stock's bits, and no disk read after load (bar embedding rows, which read their own ids' rows)."""
    d = ckpts[name]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    for host_gb in (1.0, None):  # everything in the host tier; then about half of it
        if host_gb is None:
            with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0, host_gb=1.0) as probe:
                host_gb = tiered.stats(probe).host_bytes / 2 / GiB
        m = tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0, host_gb=host_gb)
        with m, torch.no_grad():
            s0 = tiered.stats(m).snapshot()
            assert s0["host_units"] >= 1 and s0["resident_units"] == 0
            assert torch.equal(m(_ids()).logits, want)
            assert torch.equal(m.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
            s1 = tiered.stats(m).snapshot()
            assert s1["host_used_bytes"] > 0
            streams = s1["units"] - s1["resident_units"] - s1["row_units"] - s1["host_units"]
            if streams == 0:  # all in the host tier: the disk is not touched after load (rows aside)
                assert s1["read_bytes"] - s0["read_bytes"] == (s1["embedding_bytes"] - s0["embedding_bytes"]
                                                               + s1["expert_bytes"] - s0["expert_bytes"])
            else:
                assert s1["streamed_bytes"] > s0["streamed_bytes"]


def test_tied_embedding_and_head_share_one_host_slot_on_cuda(ckpts: Checkpoints) -> None:
    """embedding_rows=False, a tied model, everything in the host tier: the embedding and the head share one pinned
    slot (the tied bytes held and read once) and each is copied to the GPU from it: stock's bits."""
    d = ckpts["llama_tied_single"]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0, host_gb=1.0, embedding_rows=False) as m, torch.no_grad():
        h, st, s = m._tiered, m._tiered.streamer, tiered.stats(m)
        emb = next(u.index for u in h.plan.units if u.name.endswith("embed_tokens"))
        head = next(u.index for u in h.plan.units if u.name == "lm_head")
        assert {emb, head} <= st.host_ids and st.host_slots[head] is st.host_slots[emb]
        assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
        assert s.read_bytes == s.model_bytes  # each distinct weight read once, at load


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_host_tier_experts_on_cuda(name: str, ckpts: Checkpoints) -> None:
    """host_gb larger than the streamed units: the rest takes whole MoE blocks' experts (HostExperts), and a call
    copies its routed experts to the GPU from pinned memory: stock's bits, no expert read after load; a budget
    for the units and one block's experts splits them (that block from the host, the others read)."""
    d = ckpts[name]
    ref = _ref(d)
    with torch.no_grad():
        want = ref(_ids()).logits
        want_gen = ref.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    m = tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0, host_gb=1.0)
    with m, torch.no_grad():
        s0 = tiered.stats(m).snapshot()
        n = len(m._tiered.experts)
        assert n >= 2 and s0["host_expert_modules"] == n
        assert all(eg.host is not None and eg.host[0].is_pinned() for eg in m._tiered.experts)
        assert torch.equal(m(_ids()).logits, want)
        assert torch.equal(m.generate(_ids()[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
        s1 = tiered.stats(m).snapshot()
        assert s1["experts_read"] == s0["experts_read"] and s1["experts_from_host"] > 0
        units = s0["host_bytes"] - m._tiered.host_experts.nbytes  # what the units took
    from tiered.experts import HostExperts

    one = HostExperts.bytes_for(m._tiered.experts[0].spec)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=0, host_gb=(units + one + 4096) / GiB) as m2, torch.no_grad():
        k = tiered.stats(m2).host_expert_modules
        assert 0 < k < n  # whole blocks, in forward order: a prefix
        assert all(eg.host is not None for eg in m2._tiered.experts[:k])
        assert all(eg.host is None for eg in m2._tiered.experts[k:])
        assert torch.equal(m2(_ids()).logits, want)
        s = tiered.stats(m2).snapshot()
        assert s["experts_from_host"] > 0 and s["experts_read"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(("name", "host_gb"), [("llama", "0"), ("mixtral", "0"), ("llama", "1")])
def test_two_gpus_under_torchrun_equal_stock(name: str, host_gb: str, ckpts: Checkpoints, tmp_path: Path) -> None:
    """Issue 11: two ranks (NCCL), each streaming half of every unit (from disk, or from its host tier); each
    rank's own ids give stock's logits and greedy tokens on the same GPU model bit for bit."""
    from test_dist import torchrun

    d = ckpts[name]
    res = torchrun(tmp_path, str(d), "--ring-gb", "0.0005", "--gpu-gb", "0", "--device", "cuda", "--host-gb", host_gb)
    ref = _ref(d)
    for r, got in enumerate(res):
        assert got["device"] == f"cuda:{r}" and got["world_size"] == 2 and got["gathered_bytes"] > 0
        out = torch.load(tmp_path / f"rank{r}.pt")
        ids = out["ids"].to(DEV)
        with torch.no_grad():
            want = ref(ids).logits.cpu()
            want_gen = ref.generate(ids, max_new_tokens=got["max_new_tokens"], do_sample=False).cpu()
        assert torch.equal(out["logits"], want), f"rank {r}: logits differ"
        assert torch.equal(out["generated"], want_gen), f"rank {r}: generate differs"


@pytest.mark.parametrize(("gpu_gb", "host_gb"), [(0, 0), (0.0003, 0), (0.0003, 0.0004), (1, 0)])
def test_inspect_placement_is_what_load_does_on_cuda(gpu_gb: float, host_gb: float, ckpts: Checkpoints) -> None:
    """tiered.placement.place (what `tiered inspect --gpu-gb --host-gb` prints) against a real load on the GPU."""
    from tiered.cli import _plan_for
    from tiered.placement import place_here

    d = ckpts["llama"]
    config, ck, plan = _plan_for(d, None, "cuda")
    p = place_here(plan, device="cuda", ckpt_bytes=ck.nbytes, config=config, ring_gb=0.002, gpu_gb=gpu_gb,
                   host_gb=host_gb)
    with tiered.load(d, device=DEV, ring_gb=0.002, gpu_gb=gpu_gb, host_gb=host_gb) as m:
        st = m._tiered.streamer
        assert set(p.resident) == st.resident_ids
        assert set(p.host) == st.host_ids
        assert p.streamed == [i for i in st.streamed if i not in st.host_ids]
        assert p.device_buffer_bytes == tiered.stats(m).device_buffer_bytes


def test_an_integer_device_is_that_gpu(ckpts: Checkpoints) -> None:
    """device=0 is cuda:0, as torch.device(0) is (the Hugging Face habit of passing a GPU index)."""
    d = ckpts["llama"]
    with tiered.load(d, device=0, ring_gb=0.01, gpu_gb=0) as m, tiered.load(d, device="cuda:0", ring_gb=0.01, gpu_gb=0) as r:
        assert m.device == torch.device("cuda", 0)
        assert torch.equal(m(_ids()).logits, r(_ids()).logits)


def test_placeholders_look_like_stock_on_cuda(ckpts: Checkpoints) -> None:
    """Between passes a streamed parameter reports stock's device (cuda:N, not meta), dtype, shape and requires_grad;
    an inner model's ``device`` is the GPU; in grad mode the logits require grad and equal stock's; moving the model
    to the CPU is refused before anything changes; backward through refilled device buffers raises."""
    d = ckpts["llama"]
    ref = _ref(d)
    with tiered.load(d, device=DEV, ring_gb=0.0005, gpu_gb=0) as m:
        assert tiered.stats(m).resident_units == 0
        mine = dict(m.named_parameters())
        for name, p in ref.named_parameters():
            q = mine[name]
            assert (q.device, q.dtype, q.shape, q.requires_grad) == (p.device, p.dtype, p.shape, p.requires_grad), name
        assert m.model.device == ref.model.device and m.model.dtype == ref.model.dtype
        a, b = m(_ids(3)).logits, ref(_ids(3)).logits
        assert a.requires_grad and b.requires_grad and torch.equal(a, b)
        with pytest.raises(tiered.TieredError, match="load it again"):
            m.to("cpu")
        assert m.to(DEV) is m and m.cuda() is m
        with pytest.raises(RuntimeError, match=r"backward\(\) reached|modified by an inplace operation"):
            m(_ids(4)).logits.float().sum().backward()
        with torch.no_grad():
            assert torch.equal(m(_ids(3)).logits, ref(_ids(3)).logits)
