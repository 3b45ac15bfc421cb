"""The host tier (``host_gb``): streamed units read once into host memory and computed in place, on the CPU.

Outputs bitwise equal to stock ``transformers`` with every reader backend; the host tier's units are read only at
load and never again (a pass reads the rest); the placement spreads them over the execution order (placement
arithmetic: tests/test_placement.py; CUDA: tests/test_cuda.py); the host tier's routed experts (``HostExperts``);
bad ``host_gb`` values; memory: the RSS bound with ``host_gb`` is measured in a subprocess in ``tests/test_rss.py``.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    STOCK,
    Checkpoints,
    ids_for,
    in_a_fresh_process,
    make_ids,
    plan_ring_gb,
    ring_below_layer,
    run_child,
    streaming_ring_gb,
    wait_for,
)

import tiered
import tiered.machine
import tiered.placement
import tiered.policy
from tiered.errors import ConfigError, ShardChangedError, TruncatedShardError
from tiered.experts import HostExperts
from tiered.hostmem import page_up
from tiered.ring import gib_up

GiB = 1 << 30


def _stock(d, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock ``from_pretrained``'s logits for ``ids`` and its ``n`` greedy tokens."""
    ref = STOCK(d)
    with torch.no_grad():
        return ref(ids).logits, ref.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def _rings(d) -> tuple[float, float]:
    """(ring_gb that streams, host_gb holding about half of what streams)."""
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=ring) as m:
        p = tiered.stats(m).placement
        streamed = sum(page_up(m._tiered.plan.units[i].nbytes) for i in [*p.host, *p.streamed])
    return ring, streamed / 2 / GiB


@pytest.mark.parametrize("name", ["llama", "gptj", "mixtral"])
@pytest.mark.parametrize("io", ["mmap", "direct", "mmap-ring"])
def test_cpu_host_tier_equal_to_stock(ckpts: Checkpoints, name: str, io: str) -> None:
    d = ckpts[name]
    ids = make_ids(0, (2, 9))
    want, want_gen = _stock(d, ids, 5)
    ring, host = _rings(d)
    kw = {"io": "mmap", "zero_copy": False} if io == "mmap-ring" else {"io": io}
    try:
        m = tiered.load(d, device="cpu", ring_gb=ring, host_gb=host, **kw)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m, torch.no_grad():
        s = tiered.stats(m)
        in_host, resident, mapped = set(s.placement.host), set(s.placement.resident), set(s.placement.mapped)
        assert s.host_units >= 1 and in_host and not (in_host & resident)
        assert not (in_host & mapped)  # computed on its own copy, not the mapping
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
    ids = make_ids(0, (1, 6))
    got = {}
    for h in (0.0, host):
        with tiered.load(d, device="cpu", ring_gb=ring, host_gb=h, io="direct", prefetch=0) as m, torch.no_grad():
            s0 = tiered.stats(m).snapshot()
            m(ids)
            s1 = tiered.stats(m).snapshot()
            got[h] = (s1["read_bytes"] - s0["read_bytes"], sum(m._tiered.plan.units[i].src_bytes
                                                                for i in tiered.stats(m).placement.host))
    (plain, _), (tiered_read, held) = got[0.0], got[host]
    assert held > 0 and tiered_read == plain - held, got


def test_host_tier_units_are_spread(ckpts: Checkpoints) -> None:
    """Half the streamed bytes in the host tier: its units alternate with streamed ones (tiered.api._choose_host),
    so the reader fetches a streamed unit while a host-tier one computes."""
    d = ckpts["llama"]
    ring, host = _rings(d)
    with tiered.load(d, device="cpu", ring_gb=ring, host_gb=host) as m:
        p = tiered.stats(m).placement
        layers = [i for i in sorted([*p.host, *p.streamed]) if m._tiered.plan.units[i].name.startswith("model.layers.")]
        marks = [i in p.host for i in layers]
        assert any(marks) and not all(marks)
        assert not any(a and b for a, b in zip(marks, marks[1:], strict=False)) or sum(marks) > len(marks) / 2


def test_cpu_host_tier_takes_routed_experts_after_its_units(ckpts: Checkpoints) -> None:
    """A host budget beyond the streamed units holds whole MoE blocks' experts (read once at load); each call copies
    its routed experts from there: no expert is read after load, outputs stay stock's."""
    d = ckpts["mixtral"]
    ids = make_ids(0, (2, 9))
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
    ids = make_ids(0, (2, 9))
    want, _ = _stock(d, ids, 1)
    kw = {"io": "mmap", "zero_copy": False} if io == "mmap-ring" else {"io": io}
    try:
        m = tiered.load(d, device="cpu", ring_gb=largest / 2 / GiB, host_gb=1.0, embedding_rows=False, **kw)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m, torch.no_grad():
        p = tiered.stats(m).placement
        assert set(p.host) == set(p.host) | set(p.streamed)  # every unit that streams is in the host tier
        assert torch.equal(m(ids).logits, want)


def test_auto_refuses_a_unit_larger_than_the_ring(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """io="auto" that picked O_DIRECT on the CPU: a unit larger than the ring is refused before loading, as with
    io="direct" and io="mmap" (it computed on the file mapping, its pages resident over the ring: issue 22, item 11);
    with a ring of that unit the model runs O_DIRECT, equal to stock."""
    d = ckpts["llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0, embedding_rows=False) as probe:
        sizes = sorted(page_up(u.nbytes) for u in probe._tiered.plan.units)
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # no room: direct
    ids = make_ids(0, (2, 9))
    want, _ = _stock(d, ids, 1)
    ring = (sizes[-1] - 4096) / GiB  # below the largest unit, above the others
    with pytest.raises(tiered.RingTooSmallError):
        tiered.load(d, device="cpu", ring_gb=ring, io="direct", embedding_rows=False)  # asked for O_DIRECT: refused
    for io in ("auto", "mmap"):
        with pytest.raises(tiered.RingTooSmallError, match=f"pass ring_gb >= {gib_up(sizes[-1])} "):
            tiered.load(d, device="cpu", ring_gb=ring, io=io, embedding_rows=False)
    with tiered.load(d, device="cpu", ring_gb=sizes[-1] / GiB, io="auto", embedding_rows=False) as m, torch.no_grad():
        assert tiered.stats(m).placement.io == "direct"
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
    ids = make_ids(0, (2, 9))
    want, want_gen = _stock(d, ids, 5)
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=ring, host_gb=1.0, embedding_rows=False) as m, torch.no_grad():
        h, st, s = m._tiered, m._tiered.streamer, tiered.stats(m)
        in_host = set(s.placement.host)
        emb = next(u.index for u in h.plan.units if u.name.endswith("embed_tokens"))
        head = next(u.index for u in h.plan.units if u.name == "lm_head")
        assert {emb, head} <= in_host
        assert st.host_slots[head] is st.host_slots[emb]
        distinct = {t.copies[0].src.name for i in in_host for t in h.plan.units[i].targets}
        assert s.host_bytes == sum(page_up(h.plan.units[i].nbytes) for i in in_host if i != head)
        assert s.read_bytes == s.model_bytes  # every distinct weight read once, at load
        assert len(distinct) < sum(len(h.plan.units[i].targets) for i in in_host)  # the tied weight is in both
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), want_gen)
        assert s.read_bytes == s.model_bytes  # nothing read after load


# ---------------------------------------------------------------------------------------------- hostile


def _host(m, specs=None):
    h = m._tiered
    specs = [eg.spec for eg in h.experts] if specs is None else specs
    return h, HostExperts(specs, torch.device("cpu"))


def _use(h, hx) -> None:
    for eg in h.experts:
        eg.host = hx.parts(eg.spec)


def _unuse(h) -> None:
    for eg in h.experts:
        eg.host = None


def _assert_parts_stock(hx, ref) -> None:
    n = 0
    for sp in hx.specs:
        for p, t in zip(sp.parts, hx.parts(sp), strict=True):
            want = ref.get_parameter(f"{sp.name}.{p.target.attr}")
            assert want.abs().sum() > 0
            assert t.dtype == want.dtype and torch.equal(t, want), f"{sp.name}.{p.target.attr}"
            n += 1
    assert n > 0


def _files(specs) -> list[Path]:
    return sorted({Path(info.file) for sp in specs for p in sp.parts for per in p.per for info, _ in per})


TRUNC_CHILD = """
import os, sys, torch, tiered
from tiered.experts import HostExperts
d, ring = sys.argv[1], float(sys.argv[2])
m = tiered.load(d, ring_gb=ring, device="cpu", io="mmap")
h = m._tiered
specs = [eg.spec for eg in h.experts]
assert specs
victim = sorted({str(i.file) for sp in specs for p in sp.parts for per in p.per for i, _ in per})[-1]
os.truncate(victim, os.path.getsize(victim) // 2)
hx = HostExperts(specs, torch.device("cpu"))
try:
    hx.fill(h.reader, h.stats)
except tiered.TieredError as e:
    print("RAISED", type(e).__name__, "NAMES-FILE" if victim in str(e) else "NO-FILE", str(e), flush=True)
else:
    print("NO-ERROR", flush=True)
"""


def _fill_interrupted(m):
    """``HostExperts.fill`` with a SIGINT to the main thread on its first copy (slow copies): (KeyboardInterrupt
    raised?, copies still running when it was raised, the HostExperts)."""
    h, hx = _host(m)
    main = threading.get_ident()
    inflight = [0]
    lock = threading.Lock()
    sent = threading.Event()
    orig = h.reader._copy

    def copy(*a):
        with lock:
            inflight[0] += 1
        try:
            if not sent.is_set():
                sent.set()
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.02)
            return orig(*a)
        finally:
            with lock:
                inflight[0] -= 1

    h.reader._copy = copy
    raised, running = False, 0
    callbacks = gc.callbacks[:]  # other libraries' gc callbacks would swallow the interrupt (see above)
    gc.callbacks.clear()
    # Python's own SIGINT handler (raises KeyboardInterrupt): a process started in the background of a
    # non-interactive shell (a CI job under `cmd &`) inherits SIGINT ignored, and Python then installs none
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        hx.fill(h.reader, h.stats)
    except KeyboardInterrupt:
        with lock:
            running = inflight[0]
        raised = True
    finally:
        signal.signal(signal.SIGINT, old)
        gc.callbacks[:] = callbacks
        sent.set()
        assert wait_for(lambda: inflight[0] == 0, 30)
        del h.reader._copy  # the instance attribute: the class method again
    return raised, running, hx


class TestHostileHostExperts:
    """The host tier's routed experts (tiered/experts.py ``HostExperts``, built by hand and unpinned on the CPU as
    tests/test_experts.py does): a shard truncated or rewritten before ``fill``, Ctrl-C during ``fill``, threads, an
    expert cache beside it, a cast, a subset and a double close. Outputs are stock's bit for bit."""

    def test_host_experts_fill_of_a_truncated_shard_mmap_raises_naming_the_file(self, ckpts, tmp_path):
        """io='mmap': a shard truncated between load and ``HostExperts.fill`` must raise an error naming the file
        (as ``ExpertGather.read`` and ``Reader.read_unit`` do by checking the shard first), not kill the process with
        SIGBUS reading past the file's end through the mapping. In a child process."""
        d = Path(shutil.copytree(ckpts["mixtral"], tmp_path / "m"))
        r = run_child(TRUNC_CHILD, str(d), str(ring_below_layer(d)), timeout=120)
        assert r.returncode == 0, (f"the child died (rc {r.returncode}: -7 is SIGBUS) filling the host tier from a "
                                   f"truncated shard; stdout={r.stdout[-1000:]!r} stderr={r.stderr[-1500:]!r}")
        assert "RAISED" in r.stdout and "NAMES-FILE" in r.stdout, r.stdout[-2000:]


    def test_host_experts_fill_of_a_truncated_shard_pread_raises_naming_the_file(self, ckpts, tmp_path):
        d = Path(shutil.copytree(ckpts["mixtral"], tmp_path / "m"))
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", io="pread") as m:
            h, hx = _host(m)
            victim = _files(hx.specs)[-1]
            os.truncate(victim, victim.stat().st_size // 2)
            try:
                with pytest.raises((TruncatedShardError, ShardChangedError), match=re.escape(str(victim))):
                    hx.fill(h.reader, h.stats)
            finally:
                hx.close()


    @pytest.mark.parametrize("io", ["mmap", "pread"])
    def test_host_experts_fill_of_a_rewritten_shard_raises_naming_the_file(self, ckpts, tmp_path, io):
        """A shard rewritten in place (same size, other bytes) between load and ``HostExperts.fill`` must raise
        ShardChangedError naming the file — as a routed read of the same experts does — instead of filling the host
        tier with weights that are not the loaded checkpoint's (it then serves them for the model's whole life)."""
        d = Path(shutil.copytree(ckpts["mixtral"], tmp_path / "m"))
        ref = STOCK(d, impl="grouped_mm")
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", io=io) as m:
            h, hx = _host(m)
            victim = _files(hx.specs)[-1]
            size = victim.stat().st_size
            with open(victim, "r+b") as f:  # flip every bit of the last quarter (tensor data), same size
                f.seek(size - size // 4)
                data = f.read()
                f.seek(size - size // 4)
                f.write(bytes(b ^ 0xFF for b in data))
            try:
                try:
                    hx.fill(h.reader, h.stats)
                except ShardChangedError as e:
                    assert str(victim) in str(e)
                    return
                same = True
                try:
                    _assert_parts_stock(hx, ref)
                except AssertionError:
                    same = False
                pytest.fail(f"HostExperts.fill read a shard rewritten after load without ShardChangedError "
                            f"({'and its host tier now differs from the loaded checkpoint' if not same else 'same bits'})")
            finally:
                hx.close()


    def test_ctrl_c_during_host_experts_fill_propagates_and_a_refill_is_stock(self, ckpts, request):
        """Ctrl-C during ``HostExperts.fill`` reaches the caller; the reader is still usable: a second fill gives stock's
        bits, and the model then serves its routed experts from the host tier with stock's outputs and no read."""
        if in_a_fresh_process(request):
            return
        d = ckpts["mixtral"]
        ref = STOCK(d, impl="grouped_mm")
        ids = make_ids(4)
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", threads=2) as m:
            raised, _, hx = _fill_interrupted(m)
            h = m._tiered
            try:
                assert raised, "KeyboardInterrupt during HostExperts.fill was swallowed"
                hx.fill(h.reader, h.stats)
                _assert_parts_stock(hx, ref)
                _use(h, hx)
                before = tiered.stats(m).snapshot()
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, ref(ids).logits)
                after = tiered.stats(m).snapshot()
                assert after["experts_read"] == before["experts_read"] and after["experts_from_host"] > 0
            finally:
                _unuse(h)
                hx.close()


    def test_ctrl_c_during_host_experts_fill_leaves_no_copy_running(self, ckpts, request):
        """When Ctrl-C makes ``HostExperts.fill`` raise, no reader copy may still be writing into the host tier:
        ``Reader.copy_all`` promises to return or raise 'only once every copy has finished, so the caller may free the
        destinations as soon as this returns' — a KeyboardInterrupt landing in its wait must not break that."""
        if in_a_fresh_process(request):
            return
        d = ckpts["mixtral"]
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", threads=2) as m:
            raised, running, hx = _fill_interrupted(m)
            hx.close()
            assert raised
            assert running == 0, f"{running} reader copies were still writing into the host tier when fill raised"


    def test_host_experts_calls_from_several_threads_equal_stock(self, ckpts):
        d = ckpts["mixtral"]
        ref = STOCK(d, impl="grouped_mm")
        seeds = [11, 12, 13]
        with torch.no_grad():
            want = {s: ref(make_ids(s)).logits for s in seeds}
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu") as m:
            h, hx = _host(m)
            try:
                hx.fill(h.reader, h.stats)
                _use(h, hx)
                read0 = tiered.stats(m).experts_read
                got: dict[int, list[bool]] = {s: [] for s in seeds}
                errors: list[BaseException] = []
                go = threading.Barrier(len(seeds))

                def run(s):
                    try:
                        go.wait(30)
                        for _ in range(3):
                            with torch.no_grad():
                                got[s].append(torch.equal(m(make_ids(s)).logits, want[s]))
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)

                ts = [threading.Thread(target=run, args=(s,)) for s in seeds]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(120)
                assert not errors, errors
                assert all(len(v) == 3 and all(v) for v in got.values()), got
                assert tiered.stats(m).experts_read == read0  # all from the host tier
            finally:
                _unuse(h)
                hx.close()


    def test_host_experts_with_an_expert_cache_equal_stock(self, ckpts):
        """An expert cache (hits copied from it) plus host parts (misses copied from them): stock's outputs, prefill and
        generate, with cache hits, experts from the host tier, and no expert read from the checkpoint."""
        d = ckpts["mixtral"]
        ref = STOCK(d, impl="grouped_mm")
        ids = make_ids(5)
        with torch.no_grad():
            want = ref(ids).logits
            want_gen = ref.generate(ids, max_new_tokens=5, do_sample=False)
        probe = tiered.load(d, ring_gb=ring_below_layer(d), device="cpu")
        e = tiered.stats(probe).placement.specs[0].expert_bytes
        probe.close()
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", expert_cache_gb=5.5 * e / GiB) as m:
            h, hx = _host(m)
            try:
                assert h.expert_cache is not None and 0 < h.expert_cache.slots
                hx.fill(h.reader, h.stats)
                _use(h, hx)
                before = tiered.stats(m).snapshot()
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, want)
                    assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False), want_gen)
                s = tiered.stats(m).snapshot()
                assert s["expert_cache_hits"] > before["expert_cache_hits"]
                assert s["experts_from_host"] > before["experts_from_host"]
                assert s["experts_read"] == before["experts_read"]
            finally:
                _unuse(h)
                hx.close()


    @pytest.mark.parametrize(("ckpt", "dtype"), [("mixtral32", torch.bfloat16), ("mixtral", torch.float32)])
    def test_host_experts_cast_equal_stock(self, ckpts, ckpt, dtype):
        """``tiered.load(dtype=...)`` casts the host tier's copy as stock ``from_pretrained(dtype=...)`` casts its
        parameters: fp32 checkpoint run in bf16 (outputs compared too), bf16 checkpoint run in fp32 (parts compared: an
        fp32 one-row product on the CPU may round with the weight's address, see tests/test_experts.py)."""
        d = ckpts["mixtral_fp32" if ckpt == "mixtral32" else ckpt]
        ref = STOCK(d, impl="grouped_mm", dtype=dtype)
        ids = make_ids(6)
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu", dtype=dtype) as m:
            h, hx = _host(m)
            try:
                hx.fill(h.reader, h.stats)
                _assert_parts_stock(hx, ref)
                if dtype == torch.bfloat16:
                    _use(h, hx)
                    with torch.no_grad():
                        assert torch.equal(m(ids).logits, ref(ids).logits)
            finally:
                _unuse(h)
                hx.close()


    def test_host_experts_subset_and_close_twice(self, ckpts):
        """A host tier holding one block: ``parts`` is None for the others (read as usual), outputs are stock's;
        ``close()`` twice is harmless, and the model still runs (reading) after the host tier is gone."""
        d = ckpts["mixtral"]
        ref = STOCK(d, impl="grouped_mm")
        ids = make_ids(7)
        with torch.no_grad():
            want = ref(ids).logits
        with tiered.load(d, ring_gb=ring_below_layer(d), device="cpu") as m:
            specs = tiered.stats(m).placement.specs
            assert len(specs) >= 2
            h, hx = _host(m, [specs[1]])
            try:
                assert hx.parts(specs[0]) is None and hx.parts(specs[1]) is not None
                hx.fill(h.reader, h.stats)
                _assert_parts_stock(hx, ref)
                _use(h, hx)
                before = tiered.stats(m).snapshot()
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, want)
                after = tiered.stats(m).snapshot()
                assert after["experts_read"] > before["experts_read"]  # the blocks it does not hold
                assert after["experts_from_host"] > before["experts_from_host"]
            finally:
                _unuse(h)
                hx.close()
                hx.close()
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)



class TestHostileHostGb:
    """``host_gb`` values that must be refused (before anything starts) or that must change nothing."""

    @pytest.mark.parametrize("host_gb", [-1, -0.5, -1e-9, float("nan"), float("inf"), float("-inf"), "1", True,
                                         1e300])  # 1e300 GiB overflows a byte count: refused, not an OverflowError
    def test_bad_host_gb_through_load_is_a_config_error(self, ckpts, host_gb):
        with pytest.raises(ConfigError, match="host_gb"):
            tiered.load(ckpts["llama"], device="cpu", ring_gb=1.0, host_gb=host_gb)


    @pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "1", True, [1]])
    def test_host_gb_invalid_values(self, ckpts, bad):
        with pytest.raises(tiered.ConfigError, match="host_gb"):
            tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", host_gb=bad)


    @pytest.mark.parametrize("gb", [1, 0.5, 1e-9])
    def test_host_gb_on_cpu_with_distributed_is_refused_before_anything_starts(self, ckpts, monkeypatch, gb):
        import torch.distributed as tdist

        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any rendezvous would be attempted
        with pytest.raises(tiered.ConfigError, match="host_gb"):
            tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", host_gb=gb, distributed=True)
        assert not tdist.is_initialized()


    def test_host_gb_zero_on_cpu_is_fine(self, ckpts):
        path = ckpts["llama"]
        ids = ids_for(0)
        with torch.no_grad():
            want = STOCK(path)(ids).logits
        with tiered.load(path, ring_gb=plan_ring_gb(path), device="cpu", host_gb=0, io="pread") as m:
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)
            assert tiered.stats(m).host_units == 0

