"""The ring allocator: slots never overlap, stay inside the ring, and back-pressure wakes on free; the ring in host
memory: sized against what the host (and its cgroups) has available, untouched until used, balanced after passes.
The device pool (``DeviceArena``, tested here on CPU memory with stand-in events): buffers carved by bytes in ring
order, never overlapping or straddling a slot, each waiting for the earlier users of its bytes."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, make_ids, run_child, stream

from tiered.errors import HostMemoryError, RingTooSmallError, TieredError
from tiered.format import encode_header
from tiered.hostmem import PAGE_SIZE, host_memory_available, page_up
from tiered.ring import Ring
from tiered.stage import DeviceArena

PAGE = 4096
GiB = 1 << 30
MiB = 1 << 20


def test_random_fifo_and_out_of_order_frees_never_overlap() -> None:
    ring = Ring(64 * PAGE)
    rng = random.Random(0)
    live = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or ring.used > 48 * PAGE):
            # mostly FIFO, sometimes out of order (a discarded prefetch)
            slot = live.pop(0 if rng.random() < 0.8 else rng.randrange(len(live)))
            ring.free(slot)
        else:
            n = rng.randint(1, 16) * PAGE - rng.randint(0, PAGE - 1)
            try:
                slot = ring.alloc(n, wait=False)
            except RingTooSmallError:
                continue
            assert slot.size >= n and slot.start % PAGE == 0 and slot.start + slot.size <= ring.size
            for other in live:
                assert slot.start + slot.size <= other.start or other.start + other.size <= slot.start
            slot.view.fill_(len(live) % 251)  # the view is writable ring memory
            live.append(slot)
        assert ring.used == sum(s.size for s in live) <= ring.size
    assert ring.high_water <= ring.size
    ring.close()


class _Event:
    """A stand-in for a CUDA event: fires when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("seed", range(4))
def test_device_pool_random_sizes_and_frees_against_a_byte_map(seed: int) -> None:
    """Against a byte-map model: live buffers never overlap or straddle a slot; each new buffer waits for exactly the
    not-yet-fired events of the last user of any of its bytes; while fewer than ``n_slots`` buffers are live, a buffer
    of a whole slot always fits (the count pool's guarantee)."""
    rng = random.Random(seed)
    n_slots, slot = 3, 64 * DeviceArena.ALIGN
    base = torch.empty(n_slots * slot, dtype=torch.uint8)
    pool = DeviceArena(base, n_slots, slot)
    last: list[_Event | None] = [None] * pool.total  # byte -> the event of the last buffer that used it
    live: list = []
    events: list[_Event] = []
    placed = 0
    for step in range(3000):
        if events and rng.random() < 0.3:
            rng.choice(events).done = True
        if live and (rng.random() < 0.45 or len(live) >= 2 * n_slots):
            buf = live.pop(0 if rng.random() < 0.7 else rng.randrange(len(live)))
            ev = _Event()
            events.append(ev)
            pool.free(buf, ev)
            pool.free(buf, ev)  # idempotent
            n = DeviceArena._round(buf.t.numel())
            for b in range(buf.at, buf.at + n):
                last[b] = ev
            continue
        size = slot if rng.random() < 0.1 else rng.randint(1, slot)
        if len(live) < n_slots:  # a whole slot fits (taken and given back unused: its waits pass on)
            probe = pool.try_alloc(slot - rng.randint(0, 3))
            assert probe is not None, f"step {step}: {len(live)} live buffers and no whole slot free"
            pool.free(probe, None)
        buf = pool.try_alloc(size)
        if buf is None:
            assert len(live) >= 1
            continue
        placed += 1
        n = DeviceArena._round(size)
        assert buf.t.numel() == size and buf.at % DeviceArena.ALIGN == 0 and buf.at + n <= pool.total
        assert buf.at // slot == (buf.at + n - 1) // slot, "a buffer straddles two slots"
        assert buf.t.data_ptr() == base.data_ptr() + buf.at and pool.owns(buf.t)
        for other in live:
            m = DeviceArena._round(other.t.numel())
            assert buf.at + n <= other.at or other.at + m <= buf.at, f"step {step}: overlap"
        want = {id(e) for e in last[buf.at : buf.at + n] if e is not None and not e.done}
        got = {id(e) for e in buf.waits}
        assert want <= got, f"step {step}: a new buffer does not wait for an earlier user of its bytes"
        assert all(not e.done or id(e) in want for e in buf.waits)
        live.append(buf)
        assert pool.live == len(live)
    assert placed > 1000


def test_device_pool_packs_small_units_in_ring_order() -> None:
    """Seven 0.42-slot units fit a 3-slot pool at once (two per slot), where a count pool holds three; freed in order,
    the next buffers follow on in ring order (the oldest bytes first)."""
    slot = 1024 * DeviceArena.ALIGN
    pool = DeviceArena(torch.empty(3 * slot, dtype=torch.uint8), 3, slot)
    small = int(0.42 * slot)
    bufs = [pool.try_alloc(small) for _ in range(6)]
    assert all(b is not None for b in bufs)
    assert [b.at // slot for b in bufs] == [0, 0, 1, 1, 2, 2]
    assert pool.try_alloc(small) is None and pool.blocked()
    pool.free(bufs[0], None)
    assert not pool.blocked()
    nxt = pool.try_alloc(small)
    assert nxt is not None and nxt.at == bufs[0].at  # the ring wraps to the oldest bytes
    assert pool.try_alloc(slot) is None  # every slot holds a live buffer
    for b in bufs[1:3]:  # slot 0's second half and slot 1's first: still no whole slot
        pool.free(b, None)
    assert pool.try_alloc(slot) is None
    pool.free(bufs[3], None)
    whole = pool.try_alloc(slot)
    assert whole is not None and whole.at == slot


def test_device_pool_alloc_waits_for_a_free_and_polls_abort() -> None:
    slot = 16 * DeviceArena.ALIGN
    pool = DeviceArena(torch.empty(2 * slot, dtype=torch.uint8), 2, slot)
    a, b = pool.try_alloc(slot), pool.try_alloc(slot)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.alloc(slot, abort=lambda: None)))
    t.start()
    time.sleep(0.2)
    assert not got and pool.blocked()
    ev = _Event()
    pool.free(a, ev)
    t.join(timeout=5)
    assert got and got[0].at == a.at and got[0].waits == [ev]  # the copy into it waits for a's last user
    with pytest.raises(RingTooSmallError, match="stuck"):
        pool.alloc(1, abort=lambda: RingTooSmallError("stuck"))
    with pytest.raises(ValueError, match="larger than the pool's slots"):
        pool.try_alloc(slot + 1)
    pool.free(b, None)


def test_device_pool_full_of_is_one_snapshot() -> None:
    """The deadlock check reads "blocked" and "live" together: after a free it is False whatever ``bound`` says (read
    apart, a free between the two reads made a pool that had just freed a buffer look full of bound ones)."""
    slot = 8 * DeviceArena.ALIGN
    pool = DeviceArena(torch.empty(2 * slot, dtype=torch.uint8), 2, slot)
    a, b = pool.try_alloc(slot), pool.try_alloc(slot - 1)
    assert pool.live_bytes == 2 * slot
    assert pool.try_alloc(1) is None
    assert pool.full_of(2) and not pool.full_of(1)  # one of the two live buffers is not bound: not a deadlock
    pool.free(a, None)
    assert not pool.full_of(2) and not pool.full_of(1) and pool.live_bytes == slot
    pool.free(b, None)


def test_alloc_waits_until_a_free() -> None:
    ring = Ring(8 * PAGE)
    a = ring.alloc(6 * PAGE)
    got = []

    def reader() -> None:
        got.append(ring.alloc(6 * PAGE))  # blocks: only 2 pages are free

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    assert not got
    ring.free(a)
    t.join(timeout=5)
    assert got and got[0].size == 6 * PAGE
    ring.close()


def test_a_discarded_job_stops_waiting_for_room() -> None:
    """A load job given up while it waits for ring room (a stale prefetch) fails at once, so the job queued behind it
    runs as soon as there is room for it, not after the discarded one has taken and given back its slot."""
    from tiered.loader import Discarded, Loader
    from tiered.plan import Unit
    from tiered.stage import CpuStage
    from tiered.stats import Stats

    ring = Ring(8 * PAGE)

    class Source:  # a unit's bytes: a ring slot of its size, nothing read
        def load(self, ld, u, resident):
            return ld.stage.stage(u, ld.ring.alloc(u.nbytes, u.name, abort=ld.abort), resident=resident,
                                  abort=ld.abort)

    loader = Loader(None, ring, CpuStage(ring), Stats(), device=torch.device("cpu"), abort=lambda: None)
    try:
        loader.sources = {0: Source(), 1: Source()}
        units = [Unit(0, "stale", torch.nn.Identity(), [], nbytes=6 * PAGE),
                 Unit(1, "needed", torch.nn.Identity(), [], nbytes=2 * PAGE)]
        full = ring.alloc(7 * PAGE)  # room for neither yet
        stale = loader.submit(units[0])
        needed = loader.submit(units[1])
        time.sleep(0.2)
        assert not stale.done()
        loader.discard(stale)
        assert isinstance(stale.exception(timeout=5), Discarded)
        ring.free(full)
        ld = loader.wait(needed)
        assert ld.unit is units[1] and ring.used == 2 * PAGE  # the stale job never took its 6 pages
        loader.stage.release(ld)
    finally:
        loader.close()
        ring.close()


def test_unit_larger_than_ring_names_it() -> None:
    ring = Ring(4 * PAGE)
    with pytest.raises(RingTooSmallError, match="model.layers.7"):
        ring.alloc(5 * PAGE, "model.layers.7")
    ring.close()


# ---------------------------------------------------------------------------------------------- the ring in host memory


def _fake_tree(tmp_path: Path, avail_kib: int, groups: dict[str, tuple[str, int, int]]) -> tuple[str, str]:
    """A fake /proc (MemAvailable) and cgroup v2 tree: path -> (memory.max, memory.current, file bytes)."""
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kib} kB\n")
    leaf = max(groups, key=len)
    (proc / "self" / "cgroup").write_text(f"0::{leaf}\n")
    for path, (mx, cur, file) in groups.items():
        g = cg / path.strip("/")
        g.mkdir(parents=True, exist_ok=True)
        (g / "memory.max").write_text(mx + "\n")
        (g / "memory.current").write_text(f"{cur}\n")
        (g / "memory.stat").write_text(f"anon {cur - file}\nfile {file}\n")
    return str(proc), str(cg)


def test_host_memory_available_takes_the_tightest_parent_cgroup(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, 20 * 1024 * 1024, {
        "/": ("max", 5 * GiB, 0),
        "/outer": (str(3 * GiB), 2 * GiB, GiB // 2),  # 3 - 2 + 0.5 = 1.5 GiB left: the tightest
        "/outer/inner": ("max", GiB, 0),
    })
    avail, where = host_memory_available(proc=proc, cgroup_root=cg)
    assert avail == 3 * GiB // 2 and "/outer" in where and "inner" not in where


def test_host_memory_available_meminfo_when_no_limit(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, 1024 * 1024, {"/a": ("max", GiB, 0)})
    assert host_memory_available(proc=proc, cgroup_root=cg) == (GiB, "MemAvailable")


TOO_BIG_RING = """
import resource, sys, torch, tiered
from torch import nn
resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # the old code's ring would fail or OOM here
d, ring_gb = sys.argv[1], float(sys.argv[2])
class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32768, 32768, bias=False) for _ in range(int(sys.argv[3])))
with torch.device("meta"):
    m = Big()
try:
    tiered.attach(m, d, ring_gb=ring_gb, device="cpu")
except tiered.TieredError as e:
    print(type(e).__name__, e)
"""


def test_ring_larger_than_available_memory_is_refused_before_allocation(tmp_path: Path) -> None:
    avail, _ = host_memory_available()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    layer = 32768 * 32768 * 4  # 4 GiB of fp32 per block
    n = int(avail // layer) + 3
    tensors = [(f"blocks.{i}.weight", torch.float32, (32768, 32768), layer) for i in range(n)]
    head = encode_header(tensors, {"format": "pt"})
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file: costs no disk
        f.write(head)
        f.truncate(len(head) + n * layer)
    ring_gb = (avail + GiB) / GiB
    r = run_child(TOO_BIG_RING, str(tmp_path), str(ring_gb), str(n))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("HostMemoryError") and "ring_gb <=" in r.stdout, r.stdout + r.stderr[-2000:]


def _machine_with(monkeypatch, avail: int):
    """``tiered.load`` sees a host that has ``avail`` bytes available (a cgroup ``memory.max``), as
    :func:`tiered.machine.gather` reports it."""
    import tiered.api
    from tiered.machine import Machine

    fake = Machine(host_available=avail, host_where="cgroup /test memory.max")
    monkeypatch.setattr(tiered.api, "gather", lambda dev=None, **kw: fake)
    return fake


def test_default_ring_fits_what_the_host_leaves(llama_ref, monkeypatch) -> None:
    """``ring_gb`` not given: 4 GiB where the host can give it, else what the limit leaves after the headroom (here
    0.7 GiB of a 1.2 GiB limit); the model loads and matches stock. A ring_gb given is taken as is (a hard limit:
    more than the host has is refused, test_ring_larger_than_available_memory_is_refused_before_allocation). Before
    the change: the default 4 GiB raised HostMemoryError on such a host."""
    import tiered
    from tiered import policy

    d, want = llama_ref
    avail = int(1.2 * GiB)
    _machine_with(monkeypatch, avail)
    with tiered.load(d, device="cpu") as m:
        p = tiered.stats(m).placement
        left = (avail - policy.headroom(False)) // PAGE_SIZE * PAGE_SIZE
        assert p.ring_gb == left / GiB and p.ring_why.startswith("automatic") and "cgroup /test" in p.ring_why
        assert m._tiered.opts.ring_gb == p.ring_gb
        with torch.no_grad():
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)
    with tiered.load(d, device="cpu", ring_gb=0.5) as m:  # given: taken as is
        assert tiered.stats(m).placement.ring_gb == 0.5 and tiered.stats(m).placement.ring_why.startswith("given")
    _machine_with(monkeypatch, 64 * GiB)
    with tiered.load(d, device="cpu") as m:
        assert tiered.stats(m).placement.ring_gb == 4.0  # the default where the host has room


def test_default_ring_loads_a_model_larger_than_the_host_leaves(tmp_path: Path, monkeypatch) -> None:
    """A 2 GiB model of 256 MiB blocks on a host with 1.5 GiB available: the 1 GiB left after the headroom is shared
    between a ring of prefetch + 1 = 3 blocks and a host tier of the rest (one block), so it loads and streams.
    Before the change: the default 4 GiB ring (capped at the model's 2 GiB) raised HostMemoryError although
    ring_gb=1 runs."""
    from torch import nn

    import tiered

    n, rows = 8, 8192  # 8 blocks of 8192 x 8192 fp32 = 256 MiB each, in a sparse file
    block = rows * 8192 * 4
    head = encode_header([(f"blocks.{i}.weight", torch.float32, (rows, 8192), block) for i in range(n)],
                         {"format": "pt"}, align=4096)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(len(head) + n * block)

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8192, rows, bias=False) for _ in range(n))

    with torch.device("meta"):
        mod = Blocks()
    _machine_with(monkeypatch, int(1.5 * GiB))
    m = tiered.attach(mod, tmp_path, device="cpu")
    try:
        p = tiered.stats(m).placement
        assert p.ring_gb == 0.75 and p.host_gb == 0.25 and not p.resident
        assert len(p.host) == 1 and len(p.streamed) == n - 1
        assert p.ring_why.startswith("automatic") and p.host_why.startswith("automatic")
    finally:
        m.close()


def test_default_memory_is_shared_between_ring_and_host_tier(llama_ref, monkeypatch) -> None:
    """Neither ``ring_gb`` nor ``host_gb`` given and the model larger than what the host leaves: the ring takes
    prefetch + 1 of the largest unit and the host tier the rest (``policy.auto_split``), the total within what the
    host leaves; logits equal stock's (the host-tier units read once, the others streamed every pass). A host_gb or
    ring_gb given turns the split off (only the ring is automatic; or no host tier)."""
    import tiered
    from tiered import policy
    from tiered.rows import row_eligible

    d, want = llama_ref
    monkeypatch.setattr(policy, "MIN_AUTO_RING_BYTES", 4096)  # the test model's units are KiBs
    with tiered.load(d, device="cpu", ring_gb=64) as m:
        units = m._tiered.streamer.plan.units
    model = sum(page_up(u.nbytes) for u in units)
    largest = max(page_up(u.nbytes) for u in units if not row_eligible(u))
    total = model - 2 * PAGE_SIZE  # what the host leaves after the headroom: not the whole model
    _machine_with(monkeypatch, policy.headroom(False) + total)
    with tiered.load(d, device="cpu") as m:
        p = tiered.stats(m).placement
        ring, host = int(p.ring_gb * GiB), int(p.host_gb * GiB)
        assert ring == 3 * largest and ring + host <= total and host > total - ring - PAGE_SIZE
        assert p.host and p.streamed and not p.resident
        with torch.no_grad():
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)  # a second pass: the host tier as kept
    with tiered.load(d, device="cpu", host_gb=0) as m:  # a host tier given: only the ring is automatic
        p = tiered.stats(m).placement
        assert not p.host and p.ring_gb == total / GiB
    with tiered.load(d, device="cpu", ring_gb=3 * largest / GiB) as m:  # a ring given: no host tier
        p = tiered.stats(m).placement
        assert not p.host and p.host_gb == 0


def test_default_ring_refusals_say_why(tmp_path: Path, monkeypatch) -> None:
    """Where no ring would run, the default refuses before reading, and says the ring was chosen from the host's
    memory: a 4 GiB layer with 2 GiB available (RingTooSmallError), and a host with no room left for any ring
    (HostMemoryError)."""
    from torch import nn

    import tiered

    half = 32768 * 16384 * 4  # blocks of two 2 GiB fp32 linears (not one linear: that would run in pieces)
    tensors = [(f"blocks.{i}.{j}.weight", torch.float32, (16384, 32768) if j == 0 else (32768, 16384), half)
               for i in range(2) for j in range(2)]
    head = encode_header(tensors, {"format": "pt"})
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file: costs no disk
        f.write(head)
        f.truncate(len(head) + 4 * half)

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32768, 16384, bias=False),
                                                      nn.Linear(16384, 32768, bias=False)) for _ in range(2))

    def big() -> nn.Module:
        with torch.device("meta"):
            return Big()

    _machine_with(monkeypatch, 2 * GiB)
    with pytest.raises(RingTooSmallError, match=r"needs 4\.0\d* GiB but ring_gb=1\.5 \(automatic: .*cgroup /test"):
        tiered.attach(big(), tmp_path, device="cpu")
    _machine_with(monkeypatch, 520 << 20)
    with pytest.raises(HostMemoryError, match="no room for a ring"):
        tiered.attach(big(), tmp_path, device="cpu")


def test_ring_pages_are_not_touched_at_creation() -> None:
    from tiered.ring import Ring
    from tiered.stats import proc_status

    before = proc_status()["VmRSS"]
    ring = Ring(GiB // 2)
    grew = proc_status()["VmRSS"] - before
    ring.close()
    assert grew < 32 * MiB, f"creating a 512 MiB ring grew RSS by {grew / MiB:.0f} MiB"


def test_host_memory_error_is_a_tiered_and_memory_error() -> None:
    assert issubclass(HostMemoryError, TieredError) and issubclass(HostMemoryError, MemoryError)


def test_streaming_many_passes_keeps_the_ring_balanced(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        ring = m._tiered.ring
        for _ in range(5):
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)
        m._tiered.streamer.loader.close()  # stop prefetching: what is left in the ring is a leak
        for f in list(m._tiered.streamer.pending.values()):
            m._tiered.streamer.loader.discard(f)
        m._tiered.streamer.pending.clear()
        time.sleep(0.1)
        assert ring.used == 0, f"{ring.used} bytes of the ring still allocated after every pass ended"


def test_page_size_has_one_definition() -> None:
    import mmap

    assert PAGE_SIZE == mmap.PAGESIZE
    src = "\n".join((ROOT / "tiered" / f).read_text() for f in os.listdir(ROOT / "tiered") if f.endswith(".py"))
    assert "4095" not in src and "// 4096" not in src and "mmap.PAGESIZE" in (ROOT / "tiered/hostmem.py").read_text()



def test_default_split_keeps_routed_experts_in_the_host_tier(ckpts, monkeypatch) -> None:
    """A MoE model whose dense part fits but not its experts: the default split still runs (routed experts are read
    from disk on every call otherwise) and the host tier takes the experts the memory left holds; greedy tokens equal
    stock's. Before the fix: "none: the whole model stays loaded" and every expert re-read each token."""
    import transformers

    import tiered
    from tiered import policy

    d = ckpts["mixtral_fp32"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = make_ids(1, (1, 5))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    monkeypatch.setattr(policy, "MIN_AUTO_RING_BYTES", 4096)
    from tiered.format import open_checkpoint

    _machine_with(monkeypatch, policy.headroom(False) + int(open_checkpoint(d).nbytes * 0.9))
    with tiered.load(d, device="cpu") as m, torch.no_grad():
        p = tiered.stats(m).placement
        assert p.routed and p.host_experts and p.host_why.startswith("automatic"), p.host_why
        assert torch.equal(m.generate(ids, max_new_tokens=3, do_sample=False), want)
        assert tiered.stats(m).experts_from_host > 0


def test_default_ring_says_when_it_took_all_that_is_left(tmp_path: Path, monkeypatch) -> None:
    """Host memory is counted in KiB (MemAvailable), so what is left is rarely whole pages: a ring capped by it says
    so ("all of ..."), not that it got prefetch + 1 units."""
    from torch import nn

    from tiered import policy
    from tiered.machine import Machine
    from tiered.options import Options
    from tiered.placement import place
    from tiered.plan import build_plan

    n, rows = 8, 8192
    block = rows * 8192 * 4  # 256 MiB
    head = encode_header([(f"blocks.{i}.weight", torch.float32, (rows, 8192), block) for i in range(n)],
                         {"format": "pt"})
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(len(head) + n * block)
    with torch.device("meta"):
        mod = nn.Module()
        mod.blocks = nn.ModuleList(nn.Linear(8192, rows, bias=False) for _ in range(n))
    from tiered.format import open_checkpoint

    ckpt = open_checkpoint(tmp_path)
    machine = Machine(host_available=policy.headroom(False) + (600 << 20) + 1024, host_where="MemAvailable")
    p = place(build_plan(mod, ckpt, align=64), Options(device="cpu"), machine, ckpt_bytes=ckpt.nbytes, strict=False)
    assert p.ring_why.startswith("automatic: 0.586 GiB, all of what MemAvailable leaves"), p.ring_why
    assert "it asks for prefetch + 1 = 3 of the largest unit it streams (0.250 GiB)" in p.ring_why
    assert p.host_why == "automatic: none, the ring takes all the host leaves"


def test_default_split_sizes_the_cuda_ring_by_what_streams(tmp_path: Path, monkeypatch) -> None:
    """CUDA, the default split: a large head the GPU budget keeps resident does not size the ring (it passes through
    it once, at load, in pieces); the ring holds prefetch + 1 of the largest *streamed* unit and the host tier takes
    the rest. Before the fix the ring asked for 3 x the resident head and took all the host left (H200, Llama-3-8B
    at gpu_gb=3 in a 4 GiB cgroup: ring 2.5 GiB, 1.38 GiB high water, no host tier). A resident head that cannot be
    cut still gets a ring that holds it whole."""
    from torch import nn

    from tiered import pieces as _pieces
    from tiered import policy
    from tiered.format import open_checkpoint
    from tiered.machine import Machine
    from tiered.options import Options
    from tiered.placement import place
    from tiered.plan import build_plan

    n, rows, cols = 6, 2048, 8192  # blocks of 64 MiB (fp32)
    head_rows = 4 * rows  # a 256 MiB head
    tensors = [(f"blocks.{i}.weight", torch.float32, (rows, cols), rows * cols * 4) for i in range(n)]
    tensors.append(("head.weight", torch.float32, (head_rows, cols), head_rows * cols * 4))
    head = encode_header(tensors, {"format": "pt"}, align=4096)  # page-aligned data: units are their bytes
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file: costs no disk
        f.write(head)
        f.truncate(len(head) + sum(t[3] for t in tensors))
    ckpt = open_checkpoint(tmp_path)

    def model() -> nn.Module:
        with torch.device("meta"):
            mod = nn.Module()
            mod.blocks = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(n))
            mod.head = nn.Linear(cols, head_rows, bias=False)
        return mod

    block, big = 64 * MiB, 256 * MiB
    machine = Machine(host_available=policy.headroom(True) + GiB, host_where="MemAvailable", gpu_free=80 * GiB)
    opts = Options(device="cuda", gpu_gb=(big + block + MiB) / GiB)  # the head and one device buffer

    p = place(build_plan(model(), ckpt, align=64), opts, machine, ckpt_bytes=ckpt.nbytes, strict=False)
    assert not p.refused, p.refused
    names = {u.index: u.name for u in build_plan(model(), ckpt, align=64).units}
    assert [names[i] for i in p.resident] == ["head"], p.resident
    ring, host = int(p.ring_gb * GiB), int(p.host_gb * GiB)
    assert ring == page_up(3 * block), p.ring_why  # not 3 x the head (768 MiB)
    assert "prefetch + 1 = 3 of the largest unit it streams (0.062 GiB)" in p.ring_why, p.ring_why
    assert host == page_up(n * page_up(block)) and len(p.host) == n, p.host_why  # every block read once, at load
    assert p.pieces.get(next(i for i in p.resident)), "the resident head loads through the ring in pieces"

    count = _pieces.count  # a head that cannot be cut (tiered.pieces.count says None: e.g. FP8 codes decoded whole)
    monkeypatch.setattr(_pieces, "count", lambda u, room, align: None if u.name == "head" else count(u, room, align))
    p = place(build_plan(model(), ckpt, align=64), opts, machine, ckpt_bytes=ckpt.nbytes, strict=False)
    assert not p.refused, p.refused
    assert int(p.ring_gb * GiB) == page_up(big) and not p.pieces, p.ring_why
    assert "a resident unit that cannot be read in pieces passes through it whole" in p.ring_why, p.ring_why


def test_default_split_on_cuda_streams_in_pieces_and_gives_the_rest_to_the_host_tier(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """CUDA, the default split with tiered.policy.AUTO_RING_IN_PIECES (off by default until measured on the GPU),
    layers larger than a third of tiered.policy.PIECE_RING_BYTES: the ring asks for
    three pieces (192 MiB), every streamed layer is read in pieces through it, and the rest of what the limit leaves
    is the host tier's: here 1 GiB left holds three whole 256 MiB layers and the first piece of a fourth, where a ring
    of prefetch + 1 = 3 whole layers (768 MiB, the default rule) leaves one layer's room.
    Fewer bytes stream per pass for the same memory. A losslessly coded or float8 checkpoint keeps the whole-unit ring
    (policy.pieces_ring_ok)."""
    from torch import nn

    from tiered import policy
    from tiered.format import open_checkpoint
    from tiered.machine import Machine
    from tiered.options import Options
    from tiered.placement import place
    from tiered.plan import build_plan

    n, rows, cols = 8, 8192, 8192  # layers of 256 MiB (fp32)
    block = rows * cols * 4
    tensors = [(f"blocks.{i}.weight", torch.float32, (rows, cols), block) for i in range(n)]
    head = encode_header(tensors, {"format": "pt"}, align=4096)  # page-aligned data: units are their bytes
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file: costs no disk
        f.write(head)
        f.truncate(len(head) + n * block)
    ckpt = open_checkpoint(tmp_path)

    def placed():
        with torch.device("meta"):
            mod = nn.Module()
            mod.blocks = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(n))
        plan = build_plan(mod, ckpt, align=64)
        machine = Machine(host_available=policy.headroom(True) + GiB, host_where="cgroup /t memory.max",
                          gpu_free=80 * GiB)
        opts = Options(device="cuda", gpu_gb=(block + MiB) / GiB)  # one device buffer: nothing resident
        p = place(plan, opts, machine, ckpt_bytes=ckpt.nbytes, strict=False)
        assert not p.refused, p.refused
        return p

    monkeypatch.setattr(policy, "AUTO_RING_IN_PIECES", True)  # off by default until measured on the GPU
    p = placed()
    ring, host = int(p.ring_gb * GiB), int(p.host_gb * GiB)
    assert ring == policy.PIECE_RING_BYTES and ring + host == GiB, (p.ring_why, p.host_why)
    assert "three pieces of 64 MiB" in p.ring_why and p.host_why.startswith("automatic: 0.812 GiB"), p.ring_why
    assert not p.resident and len(p.host) == 3, (p.resident, p.host)
    assert set(p.pieces) == set(p.streamed) and len(p.streamed) == n - 3  # every streamed layer, in pieces
    assert sum(p.host_pieces.values()) == 1 and p.host_piece_bytes <= policy.piece_room(ring)
    in_pieces = p.streamed_bytes

    monkeypatch.setattr(policy, "AUTO_RING_IN_PIECES", False)  # the default: prefetch + 1 whole layers
    p = placed()
    assert int(p.ring_gb * GiB) == 3 * page_up(block) and len(p.host) == 1 and not p.pieces, p.ring_why
    assert "prefetch + 1 = 3 of the largest unit it streams" in p.ring_why, p.ring_why
    assert in_pieces < p.streamed_bytes - 2 * block, (in_pieces, p.streamed_bytes)  # > 2 layers fewer per pass
