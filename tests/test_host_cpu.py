"""The host tier on the CPU (``host_gb``): streamed units read once into host memory and computed in place.

Outputs bitwise equal to stock ``transformers`` with every reader backend; the host tier's units are read only at
load and never again (a pass reads the rest); the placement spreads them over the execution order; memory: the RSS
bound with ``host_gb`` is measured in a subprocess in ``tests/test_rss.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import Checkpoints, streaming_ring_gb
from models import VOCAB

import tiered
import tiered.machine
import tiered.placement
import tiered.policy
from tiered.hostmem import page_up

GiB = 1 << 30


def _ids(batch: int = 2, seq: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _stock(d, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock ``from_pretrained``'s logits for ``ids`` and its ``n`` greedy tokens."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        return ref(ids).logits, ref.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def _rings(d) -> tuple[float, float]:
    """(ring_gb that streams, host_gb holding about half of what streams)."""
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=ring) as m:
        st = m._tiered.streamer
        streamed = sum(page_up(m._tiered.plan.units[i].nbytes) for i in st.streamed)
    return ring, streamed / 2 / GiB


@pytest.mark.parametrize("name", ["llama", "gptj", "mixtral"])
@pytest.mark.parametrize("io", ["mmap", "direct", "mmap-ring"])
def test_cpu_host_tier_equal_to_stock(ckpts: Checkpoints, name: str, io: str) -> None:
    d = ckpts[name]
    ids = _ids()
    want, want_gen = _stock(d, ids, 5)
    ring, host = _rings(d)
    kw = {"io": "mmap", "zero_copy": False} if io == "mmap-ring" else {"io": io}
    try:
        m = tiered.load(d, device="cpu", ring_gb=ring, host_gb=host, **kw)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m, torch.no_grad():
        s = tiered.stats(m)
        st = m._tiered.streamer
        assert s.host_units >= 1 and st.host_ids and not (st.host_ids & st.resident_ids)
        assert not (st.host_ids & set(st.loader.mapped))  # computed on its own copy, not the mapping
        assert s.host_bytes <= page_up(int(host * GiB))
        assert torch.equal(m(ids).logits, want)
        before = tiered.stats(m).snapshot()
        assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), want_gen)
        after = tiered.stats(m).snapshot()
        assert after["host_used_bytes"] > before["host_used_bytes"]  # used every pass ...
        assert after["load_bytes"] == before["load_bytes"]  # ... and never read again


def test_cpu_host_tier_reads_less_per_pass(ckpts: Checkpoints) -> None:
    """One forward: the bytes read after load drop by what the host tier holds."""
    d = ckpts["llama"]
    ring, host = _rings(d)
    ids = _ids(1, 6)
    got = {}
    for h in (0.0, host):
        with tiered.load(d, device="cpu", ring_gb=ring, host_gb=h, io="direct", prefetch=0) as m, torch.no_grad():
            s0 = tiered.stats(m).snapshot()
            m(ids)
            s1 = tiered.stats(m).snapshot()
            got[h] = (s1["read_bytes"] - s0["read_bytes"], sum(m._tiered.plan.units[i].src_bytes
                                                                for i in m._tiered.streamer.host_ids))
    (plain, _), (tiered_read, held) = got[0.0], got[host]
    assert held > 0 and tiered_read == plain - held, got


def test_host_tier_units_are_spread(ckpts: Checkpoints) -> None:
    """Half the streamed bytes in the host tier: its units alternate with streamed ones (tiered.api._choose_host),
    so the reader fetches a streamed unit while a host-tier one computes."""
    d = ckpts["llama"]
    ring, host = _rings(d)
    with tiered.load(d, device="cpu", ring_gb=ring, host_gb=host) as m:
        st = m._tiered.streamer
        layers = [i for i in st.streamed if m._tiered.plan.units[i].name.startswith("model.layers.")]
        marks = [i in st.host_ids for i in layers]
        assert any(marks) and not all(marks)
        assert not any(a and b for a, b in zip(marks, marks[1:], strict=False)) or sum(marks) > len(marks) / 2


def test_cpu_host_tier_takes_routed_experts_after_its_units(ckpts: Checkpoints) -> None:
    """A host budget beyond the streamed units holds whole MoE blocks' experts (read once at load); each call copies
    its routed experts from there: no expert is read after load, outputs stay stock's."""
    d = ckpts["mixtral"]
    ids = _ids()
    want, want_gen = _stock(d, ids, 4)
    ring, _ = _rings(d)
    with tiered.load(d, device="cpu", ring_gb=ring, host_gb=1.0) as m, torch.no_grad():
        s = tiered.stats(m).snapshot()
        assert s["expert_modules"] >= 2 and s["host_expert_modules"] == s["expert_modules"], s
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want_gen)
        after = tiered.stats(m).snapshot()
        assert after["experts_read"] == s["experts_read"] and after["experts_from_host"] > 0, after


def test_cpu_host_tier_memory_check_counts_the_ring(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the ring is untouched anonymous memory that MemAvailable does not see yet: a ring and a host tier
    that each fit what is available but not together are refused (HostMemoryError), not OOM-killed later."""
    import tiered.machine as machine
    import tiered.policy as policy

    d = ckpts["llama"]
    ring, host = _rings(d)
    ring_bytes, host_bytes = page_up(int(ring * GiB)), page_up(int(host * GiB))
    spare = max(ring_bytes, host_bytes) + 4096  # each fits, the two do not
    monkeypatch.setattr(machine, "host_memory_available", lambda: (policy.HOST_HEADROOM_BYTES + spare, "simulated"))
    with pytest.raises(tiered.HostMemoryError, match="host_gb"):
        tiered.load(d, device="cpu", ring_gb=ring, host_gb=host, io="pread")
    monkeypatch.setattr(machine, "host_memory_available",
                        lambda: (policy.HOST_HEADROOM_BYTES + ring_bytes + host_bytes + (1 << 20), "simulated"))
    tiered.load(d, device="cpu", ring_gb=ring, host_gb=host, io="pread").close()  # both fit: fine


@pytest.mark.parametrize("io", ["pread", "direct", "mmap-ring"])
def test_cpu_host_tier_holds_units_larger_than_the_ring(ckpts: Checkpoints, io: str) -> None:
    """The host tier's units are read straight into it, never through the ring: a ring below the largest unit works
    when the host tier holds that unit (here every unit: host_gb=1), with stock's outputs."""
    d = ckpts["llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0, embedding_rows=False) as probe:
        largest = max(page_up(u.nbytes) for u in probe._tiered.plan.units)
    ids = _ids()
    want, _ = _stock(d, ids, 1)
    kw = {"io": "mmap", "zero_copy": False} if io == "mmap-ring" else {"io": io}
    try:
        m = tiered.load(d, device="cpu", ring_gb=largest / 2 / GiB, host_gb=1.0, embedding_rows=False, **kw)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m, torch.no_grad():
        st = m._tiered.streamer
        assert st.host_ids == set(st.streamed)
        assert torch.equal(m(ids).logits, want)


def test_auto_maps_a_unit_larger_than_the_ring(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """io="auto" that picked O_DIRECT on the CPU: a unit larger than the ring computes on the file mapping (as with
    io="mmap") instead of RingTooSmallError; the others are read O_DIRECT."""
    d = ckpts["llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0, embedding_rows=False) as probe:
        sizes = sorted(page_up(u.nbytes) for u in probe._tiered.plan.units)
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # no room: direct
    ids = _ids()
    want, _ = _stock(d, ids, 1)
    ring = (sizes[-1] - 4096) / GiB  # below the largest unit, above the others
    with pytest.raises(tiered.RingTooSmallError):
        tiered.load(d, device="cpu", ring_gb=ring, io="direct", embedding_rows=False)  # asked for O_DIRECT: refused
    with tiered.load(d, device="cpu", ring_gb=ring, io="auto", embedding_rows=False) as m, torch.no_grad():
        assert m._tiered.reader.io == "direct" and tiered.stats(m).mapped_units >= 1
        assert torch.equal(m(ids).logits, want)


def test_generate_summary_names_the_host_and_page_cache_tiers(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`tiered generate`'s summary: the units read each pass, the host tier's apart, and the page-cache tier."""
    from tiered.cli import main
    from tiered.format import open_checkpoint

    d = ckpts["llama"]
    ring, host = _rings(d)
    total = open_checkpoint(d).nbytes
    # as "auto" picks it under a limit
    monkeypatch.setattr(tiered.placement, "choose_io", lambda io, ckpt_bytes, machine: "direct")
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (4 * total, "cgroup /x memory.max=1"))  # room for a tier
    monkeypatch.setattr(tiered.policy, "page_cache_reserve", lambda threads: 0)
    main(["generate", str(d), "--ids", "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu",
          "--ring-gb", str(ring), "--host-gb", str(host / 4), "--io", "auto"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert "in the host tier" in text and "kept in the page cache between tokens" in text, text


def test_tied_embedding_and_head_share_one_host_slot(ckpts: Checkpoints) -> None:
    """A tied head reads the same checkpoint bytes as its embedding: with embedding_rows=False both are units, and the
    host tier holds those bytes once (one slot, one read at load), not twice; outputs stay stock's."""
    d = ckpts["llama_tied_single"]
    ids = _ids()
    want, want_gen = _stock(d, ids, 5)
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=ring, host_gb=1.0, embedding_rows=False) as m, torch.no_grad():
        h, st, s = m._tiered, m._tiered.streamer, tiered.stats(m)
        emb = next(u.index for u in h.plan.units if u.name.endswith("embed_tokens"))
        head = next(u.index for u in h.plan.units if u.name == "lm_head")
        assert {emb, head} <= st.host_ids
        assert st.host_slots[head] is st.host_slots[emb]
        distinct = {t.copies[0].src.name for i in st.host_ids for t in h.plan.units[i].targets}
        assert s.host_bytes == sum(page_up(h.plan.units[i].nbytes) for i in st.host_ids if i != head)
        assert s.read_bytes == s.model_bytes  # every distinct weight read once, at load
        assert len(distinct) < sum(len(h.plan.units[i].targets) for i in st.host_ids)  # the tied weight is in both
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), want_gen)
        assert s.read_bytes == s.model_bytes  # nothing read after load
