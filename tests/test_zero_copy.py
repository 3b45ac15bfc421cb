"""CPU zero copy (io="mmap", the default): streamed units that need no conversion compute on views of the
checkpoint's file mapping, as ``from_pretrained`` does, and drop its pages after they run.

Equality is with stock ``transformers`` bit for bit; the RSS bound is in tests/test_rss.py (subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import Checkpoints, make_ids, run_child, streaming_ring_gb

import tiered
from tiered import faults
from tiered.errors import StreamerError
from tiered.placeholder import is_placeholder

ROOT = Path(__file__).resolve().parents[1]


def unit_ring(d: Path, **kw) -> float:
    """A ring (GiB) that holds the largest unit (up to ~3) but not the whole model: zero copy runs on the mapping,
    and the ring bounds the mapped pages of the unit running (issue 22, item 11)."""
    with tiered.load(d, device="cpu", ring_gb=1.0, **kw) as probe:
        return streaming_ring_gb(probe)


@pytest.mark.parametrize("name", ["llama_fp32", "llama", "gptj", "gpt2", "llama_tied_single"])
def test_equal_to_stock_on_the_mapping(name: str, ckpts: Checkpoints) -> None:
    """Every unit computes on the mapping (the ring bounds only the mapped pages of the unit running); logits for a
    one-token and a longer input, and greedy generate, equal stock's. In fp32 the one-token product rounds with the
    weight's address: the mapping gives the same addresses as stock's, where a 64-byte aligned copy in the ring did not."""
    d = ckpts[name]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=unit_ring(d)) as m, torch.no_grad():
        s = tiered.stats(m)
        # (an embedding may read rows instead)
        assert s.ring_high_water == 0 and s.mapped_units >= s.units - 2 and s.resident_units == 0, s
        for shape in ((1, 1), (2, 7)):
            ids = make_ids(1, shape)
            assert torch.equal(m(ids).logits, ref(ids).logits), shape
        ids = make_ids(2, (1, 5))
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False),
                           ref.generate(ids, max_new_tokens=6, do_sample=False))
        # between passes no streamed parameter is bound: the placeholders are back
        layer = m.model.layers[0] if hasattr(m, "model") and hasattr(m.model, "layers") else None
        if layer is not None:
            assert all(is_placeholder(p) for p in layer.parameters())


def test_bert_encoder(ckpts: Checkpoints) -> None:
    d = ckpts["bert"]
    ref = transformers.AutoModel.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=unit_ring(d)) as m, torch.no_grad():
        assert tiered.stats(m).mapped_units > 0
        ids = make_ids(3)
        assert torch.equal(m(ids).last_hidden_state, ref(ids).last_hidden_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_larger_than_the_ring_is_computed_in_pieces(tmp_path: Path, dtype, monkeypatch) -> None:
    """An untied lm_head of 8192 x 64 (2 MiB in fp32) with a 0.5 MiB ring. The ring path refuses it, naming the unit.
    Zero copy computes it in pieces of output rows on the mapping (tiered/linear_pieces.py: one piece's pages in RSS
    at a time, issue 22 item 11; before, it ran on the mapping whole, 4x over the ring), equal to stock for a prompt,
    one token and greedy generate. A layer (not one linear module) larger than the ring is refused; and where the
    pieces do not give the whole product's bits (the check at load, forced here), the head is refused too."""
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=3, dtype=dtype, max_shard_size=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ring_gb = 0.5 / 1024
    with pytest.raises(tiered.RingTooSmallError, match="lm_head"):
        tiered.load(tmp_path / "m", device="cpu", ring_gb=ring_gb, zero_copy=False)
    ids = torch.tensor([[7, 8191, 0, 4000, 7]])
    with tiered.load(tmp_path / "m", device="cpu", ring_gb=ring_gb) as m, torch.no_grad():
        s = tiered.stats(m)
        head = [i for i, u in enumerate(m._tiered.plan.units) if u.name == "lm_head"]
        assert list(s.placement.linear_pieces) == head and s.placement.linear_pieces[head[0]] < 8192
        for x in (ids, ids[:, :1]):
            assert torch.equal(m(x).logits, ref(x).logits)
        assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, max_new_tokens=5, do_sample=False))
        assert s.ring_high_water == 0 and s.streamed_bytes >= 8192 * 64 * dtype.itemsize
        with torch.enable_grad():  # as stock's, the logits require grad; backward is refused, not silent
            out = m(ids).logits
            assert out.requires_grad and torch.equal(out, ref(ids).logits)
            with pytest.raises(tiered.StreamedTensorError, match="backward"):
                out.float().sum().backward()
    with pytest.raises(tiered.RingTooSmallError, match=r"'model\.layers\.0' needs .*file mapping"):
        tiered.load(tmp_path / "m", device="cpu", ring_gb=0.02 / 1024)  # 20 KiB: below a layer
    monkeypatch.setattr(tiered.api, "pieces_exact", lambda *a: False)
    with pytest.raises(tiered.RingTooSmallError, match="'lm_head' needs .*checked at load"):
        tiered.load(tmp_path / "m", device="cpu", ring_gb=ring_gb)


@pytest.mark.parametrize("where", ["alloc", "free"])
def test_an_interrupt_in_a_piece_room_leaves_no_slot_behind(tmp_path: Path, where: str, monkeypatch) -> None:
    """A head computed in pieces takes its room in the ring on the model's own thread, where a KeyboardInterrupt can
    land inside ``Ring.alloc`` after the slot is taken (before it is returned) or inside ``Ring.free``. The slot so
    left is given back at the next call (``Ring.free_owned`` by its owner), also by the model's outermost call before
    any unit waits for room — before, the next forward hung waiting for ring room (a helper's attack with real
    SIGINTs, twentieth session). Here the interrupt is raised at exactly those points; logits stay stock's."""
    import tiered.ring

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=5, dtype=torch.float32,
                      max_shard_size=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ids = torch.tensor([[5, 8000, 1, 77]])
    with torch.no_grad():
        want = ref(ids).logits
    with tiered.load(tmp_path / "m", device="cpu", ring_gb=0.5 / 1024) as m, torch.no_grad():
        ring = m._tiered.ring
        lp = m._tiered.linear[0]
        assert lp.ring is ring and lp.room_bytes > 0
        assert torch.equal(m(ids).logits, want)
        base = ring.used
        real = getattr(tiered.ring.Ring, where)

        def interrupted(self, *a, **kw):
            if where == "alloc":
                real(self, *a, **kw)  # the slot is taken ...
            raise KeyboardInterrupt  # ... and the interrupt lands before alloc returns / before free frees

        monkeypatch.setattr(tiered.ring.Ring, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            m(ids)
        monkeypatch.setattr(tiered.ring.Ring, where, real)
        assert ring.used > base  # the room was left behind
        assert torch.equal(m(ids).logits, want)  # the next call gives it back first, and runs
        assert ring.used == base, (ring.used, base)
        monkeypatch.setattr(tiered.ring.Ring, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            m.lm_head(torch.randn(1, 1, 64))  # called directly: the next direct call reclaims too
        monkeypatch.setattr(tiered.ring.Ring, where, real)
        assert ring.used > base
        x = torch.randn(1, 1, 64)
        assert torch.equal(m.lm_head(x), ref.lm_head(x)) and ring.used == base


@pytest.mark.parametrize("grad", [False, True])
def test_a_head_with_a_tail_piece_is_exact_or_refused(tmp_path: Path, grad: bool) -> None:
    """An fp32 head of 8195 rows: its last piece is 3 rows wide, and on the 2-core machine an fp32 product that narrow
    changed the low bits of those columns (review of 2026-12-01: silently wrong logits). The check at load now tries
    the last piece too, and several batch sizes: the head is refused there, or — where the kernel agrees — equal to
    stock for every input tried. In grad mode the logits require grad as stock's, and backward is refused."""
    cfg = transformers.LlamaConfig(vocab_size=8195, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=4, dtype=torch.float32,
                      max_shard_size=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    try:
        m = tiered.load(tmp_path / "m", device="cpu", ring_gb=0.5 / 1024)
    except tiered.RingTooSmallError as e:
        assert "checked at load" in str(e)
        return
    with m:
        assert m._tiered.placement.linear_pieces
        for shape in ((1, 1), (2, 5), (3, 9), (8, 1)):
            ids = torch.randint(0, 8195, shape, generator=torch.Generator().manual_seed(sum(shape)))
            if grad:
                out = m(ids).logits
                assert out.requires_grad and torch.equal(out, ref(ids).logits)
                with pytest.raises(tiered.StreamedTensorError, match="backward"):
                    out.sum().backward()
            else:
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, ref(ids).logits), shape


def test_converted_units_still_use_the_ring(ckpts: Checkpoints) -> None:
    """A unit whose tensors need a conversion (a cast) is copied through the ring; the rest is mapped."""
    d = ckpts["llama_fp32"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    with tiered.load(d, device="cpu", ring_gb=0.002, dtype=torch.bfloat16) as m, torch.no_grad():
        s = tiered.stats(m)
        assert s.mapped_units == 0  # fp32 on disk, bf16 in the model: every unit casts
        ids = make_ids(4)
        assert torch.equal(m(ids).logits, ref(ids).logits)
        assert tiered.stats(m).ring_high_water > 0


def test_zero_copy_off_is_the_ring(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    with tiered.load(d, device="cpu", ring_gb=0.002, zero_copy=False) as m, torch.no_grad():
        assert tiered.stats(m).mapped_units == 0
        ids = make_ids(5)
        assert torch.equal(m(ids).logits, ref(ids).logits)


TRUNCATE = textwrap.dedent(
    """
    import os, sys, torch, tiered
    d = sys.argv[1]
    m = tiered.load(d, device="cpu", ring_gb=float(sys.argv[2]))
    ids = torch.arange(1, 6).unsqueeze(0)
    with torch.no_grad():
        m(ids)  # the next pass's first units are prefetched now: views of the mapping
        shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[-1]
        with open(os.path.join(d, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(d, shard)) // 2)
        try:
            m(ids)
        except tiered.TruncatedShardError as e:
            print("TRUNCATED", shard in str(e))
        except tiered.StreamerError as e:
            print("STREAMER", type(e.__cause__).__name__, shard in str(e) + str(e.__cause__))
    """
)


def test_shard_truncated_under_a_mapped_unit_is_an_error_not_sigbus(ckpts: Checkpoints, tmp_path: Path) -> None:
    """A shard cut short after its units were prefetched as views: the check before compute raises (a SIGBUS
    would kill the process: run in a child)."""
    d = ckpts.copy("llama", tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", TRUNCATE, str(d), str(unit_ring(d))], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert "TRUNCATED True" in out.stdout or "STREAMER TruncatedShardError True" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------------- hostile


PLAIN_CHILD = """
import os, sys, torch, tiered
from torch import nn
from safetensors.torch import save_file
torch.set_num_threads(2)

class Pos(nn.Module):  # a position table returning a view of its weight (as binding.copy_out_aliases describes)
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, 32))
    def forward(self, x):
        return self.table[: x.shape[1]]

class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)) for _ in range(3)])
        self.pos = Pos()
        self.emb = nn.Embedding(50, 32, max_norm=0.5)
    def forward(self, x):
        if self.mode == "alias":
            return self.pos(x)
        if self.mode == "batchnorm":  # train mode: running stats are updated in place
            h = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
            for b in self.blocks:
                h = b(h)
            return h
        return self.emb(x)  # max_norm: F.embedding renormalises the looked-up rows of the weight in place

work = sys.argv[1]
for zc in sys.argv[2].split(","):
    for mode in ("alias", "batchnorm", "max_norm"):
        print("case", mode, zc, flush=True)  # the last one printed is the one that crashed, if any
        d = os.path.join(work, mode + zc); os.makedirs(d)
        torch.manual_seed(0)
        ref = Net(mode)
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, d + "/model.safetensors")
        with torch.device("meta"):
            net = Net(mode)
        m = tiered.attach(net, d, device="cpu", ring_gb=16 * 1024 / 2**30, zero_copy=zc == "1", embedding_rows=False)
        assert (tiered.stats(m).mapped_units > 0) == (zc == "1")
        x = torch.tensor([[1, 2, 3, 7]])
        if mode == "batchnorm":
            m.train(); ref.train()
        for _ in range(2):
            out, want = m(x), ref(x)
            if mode == "alias":
                assert torch.equal(out, want)
                out.add_(1.0)  # the caller owns its output
                assert torch.equal(m(x), want), "a write into an output changed the weights"
        m.close()
        print("ok", mode, zc, flush=True)
print("DONE", flush=True)
"""


class TestHostile:
    """Ctrl-C while a mapped unit's views are built, and writes into what zero copy maps (an output aliasing a
    weight, BatchNorm's running stats in train mode, Embedding(max_norm)) — in a child process, where a SIGSEGV on
    the read-only mapping fails the test. "Regression:" failed on commit 60471ee (fixed: reader.py MAP_PRIVATE,
    stage.py ``owns`` knows the shard mappings)."""

    @pytest.mark.parametrize("point", ["read", "stage"])
    def test_ctrl_c_while_mapping_a_zero_copy_unit(self, ckpts, point):
        """KeyboardInterrupt on the loader thread while it builds a mapped unit's views (Loader._map)."""
        d = ckpts["llama"]
        ref = transformers.AutoModelForCausalLM.from_pretrained(d)
        ids = make_ids(7)
        with tiered.load(d, device="cpu", ring_gb=unit_ring(d)) as m, torch.no_grad():
            assert tiered.stats(m).mapped_units > 0
            hit = {"n": 0}

            def boom(**kw):
                if hit["n"] == 0 and "layers.1" in str(kw.get("unit")):
                    hit["n"] += 1
                    raise KeyboardInterrupt

            with faults.inject(point, boom), pytest.raises(BaseException) as e:
                m(ids)
            assert isinstance(e.value, (KeyboardInterrupt, StreamerError)), e.value
            for _ in range(2):
                assert torch.equal(m(ids).logits, ref(ids).logits)


    def test_writes_are_fine_through_the_ring(self, tmp_path):
        out = run_child(PLAIN_CHILD, str(tmp_path), "0", timeout=120)
        assert out.returncode == 0 and "DONE" in out.stdout, (out.returncode, out.stdout[-500:], out.stderr[-2000:])


    def test_writes_into_mapped_weights_and_aliasing_outputs_do_not_crash(self, tmp_path):
        """Regression (SIGSEGV on 60471ee): zero copy bound weights/buffers as views of a read-only PROT_READ mapping and
        returned an output aliasing a mapped weight uncopied (CpuStage.owns knew only the ring). Writing the output, a
        BatchNorm in train mode (running stats) and Embedding(max_norm) (renormalises rows in place) killed the process."""
        out = run_child(PLAIN_CHILD, str(tmp_path), "1", timeout=120)
        assert out.returncode == 0 and "DONE" in out.stdout, (out.returncode, out.stdout[-500:], out.stderr[-2000:])


    def test_attach_plain_module_zero_copy_on_off(self, tmp_path):
        from safetensors.torch import save_file

        torch.manual_seed(3)
        ref = models.MLPStack().eval()
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = ref(x)
        for zc in (True, False):
            with torch.device("meta"):
                mod = models.MLPStack()
            with tiered.attach(mod, tmp_path, device="cpu", ring_gb=160 * 1024 / 2**30, zero_copy=zc) as m, \
                    torch.no_grad():
                assert (tiered.stats(m).mapped_units > 0) == zc
                for _ in range(2):
                    assert torch.equal(m(x), want)
                assert all(is_placeholder(p) for p in m.parameters())



class _Outer(torch.nn.Module):
    """A parameter owned directly by the parent of the block list: its unit (``<root>``) is held for the whole call,
    around the blocks' units."""

    def __init__(self, w: int = 256) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(w, w))
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.GELU(),
                                                              torch.nn.Linear(2 * w, w)) for _ in range(4))
        self.head = torch.nn.Linear(w, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x) @ self.scale
        return self.head(x)


@pytest.mark.parametrize("case", ["cast-root", "page-cache-tier"])
def test_mapped_units_beside_ring_copies_run_where_held_units_fill_the_ring(case: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapped unit beside units copied into the ring holds ring room of its size (tiered.sources.MappedSource); an
    outer unit held around the blocks with a ring of exactly the largest unit leaves no room for that. Such a model
    ran before the room was held and must still run, bit for bit: ``cast-root`` (default io, the held root unit is
    stored fp16 and cast into the ring, the blocks mapped: a mapped block finds no room) and ``page-cache-tier``
    (io="auto" -> O_DIRECT, the held root unit mapped in the page-cache tier: a copied block needs its room). Both
    were refused with RingTooSmallError by the first version (found by the attack of the nineteenth session)."""
    from safetensors.torch import save_file

    import tiered.machine
    import tiered.policy
    from tiered.format import open_checkpoint
    from tiered.hostmem import page_up

    torch.manual_seed(0)
    ref = _Outer().eval()
    with torch.no_grad():
        ref.scale.copy_(torch.randn(256, 256) * 0.05)
        if case == "cast-root":
            ref.scale.copy_(ref.scale.half().float())
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if case == "cast-root":
        sd["scale"] = sd["scale"].half()  # cast at load: its unit is copied into the ring, the blocks are mapped
    save_file(sd, str(tmp_path / "model.safetensors"))
    if case == "page-cache-tier":
        total = open_checkpoint(tmp_path).nbytes
        monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (total - 1, "cgroup /x memory.max=1"))
        monkeypatch.setattr(tiered.policy, "page_cache_reserve", lambda threads: 0)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
    with torch.device("meta"):
        probe = tiered.attach(_Outer(), tmp_path, device="cpu", ring_gb=1, compute_threads=1)
    big = max(page_up(u.nbytes) for u in probe._tiered.plan.units)
    probe.close()
    with torch.device("meta"):
        m = tiered.attach(_Outer(), tmp_path, device="cpu", ring_gb=big / 2**30, compute_threads=1)
    with m, torch.no_grad():
        p = tiered.stats(m).placement
        copied = set(p.streamed) - set(p.mapped)
        assert p.mapped and copied, p  # both kinds of streamed unit: the ring room is held
        assert (0 in p.mapped) == (case == "page-cache-tier"), p  # the held root unit
        for _ in range(2):
            assert torch.equal(m(x), want)
        assert tiered.stats(m).mapped_unreserved > 0  # it ran without the room, as before the room was held
