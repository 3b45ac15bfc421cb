"""io="auto": O_DIRECT when the checkpoint cannot stay in the page cache (RAM or the cgroup's memory.max)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import Checkpoints

import tiered
import tiered.api
import tiered.machine
import tiered.policy
from tiered.hostmem import host_memory_available
from tiered.stats import page_cache_room


def _fake_tree(tmp_path: Path, *, avail_kb: int, cg_max: str, cg_cur: int) -> tuple[str, str]:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kb} kB\n")
    (proc / "self" / "cgroup").write_text("0::/bench/run1\n")
    d = cg / "bench" / "run1"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(cg_max + "\n")
    (d / "memory.current").write_text(f"{cg_cur}\n")
    return str(proc), str(cg)


def test_page_cache_room_reads_meminfo_and_cgroup(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, avail_kb=8 << 20, cg_max=str(3 << 30), cg_cur=1 << 30)
    room, where = page_cache_room(proc=proc, cgroup_root=cg)
    assert room == 2 << 30 and "memory.max" in where  # the cgroup leaves 2 GiB, RAM 8 GiB
    proc, cg = _fake_tree(tmp_path / "b", avail_kb=1 << 20, cg_max="max", cg_cur=0)
    assert page_cache_room(proc=proc, cgroup_root=cg) == (1 << 30, "MemAvailable")


@pytest.mark.parametrize("layout", ["host", "container"])
def test_page_cache_room_reads_a_cgroup_v1_memory_group(tmp_path: Path, layout: str) -> None:
    """A hybrid host (memory controller on cgroup v1): the hierarchical limit less the usage, under
    {root}/memory{path} on the host or {root}/memory itself inside a container; no limit: MemAvailable."""
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemAvailable: 8388608 kB\n")
    (proc / "self" / "cgroup").write_text("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    d = cg / "memory" / "docker" / "abc" if layout == "host" else cg / "memory"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")  # its own limit; an ancestor's is smaller
    (d / "memory.stat").write_text(f"cache 1\nhierarchical_memory_limit {3 << 30}\ntotal_cache {256 << 20}\n")
    (d / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    room, where = page_cache_room(proc=str(proc), cgroup_root=str(cg))
    assert room == 2 << 30 and where.startswith("cgroup v1 /docker/abc"), where
    # what the process can still take without an OOM kill: the room plus the group's reclaimable page cache
    avail, where = host_memory_available(proc=str(proc), cgroup_root=str(cg))
    assert avail == (2 << 30) + (256 << 20) and where.startswith("cgroup v1"), where
    (d / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\n")
    assert page_cache_room(proc=str(proc), cgroup_root=str(cg)) == (8 << 30, "MemAvailable")


@pytest.mark.parametrize(("room", "want"), [(1, "direct"), (1 << 50, "mmap")])
def test_auto_picks_direct_when_the_model_does_not_fit(room: int, want: str, ckpts: Checkpoints,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (room, "cgroup /x memory.max=1"))
    with tiered.load(ckpts["llama"], device="cpu", ring_gb=0.01, io="auto") as m:
        assert m._tiered.reader.io == want == m._tiered.opts.io


def test_mmap_under_a_small_cgroup_warns(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))
    with pytest.warns(UserWarning, match="io='direct'"):
        tiered.load(ckpts["llama"], device="cpu", ring_gb=0.01, io="mmap").close()
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "MemAvailable"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain RAM pressure: no warning
        tiered.load(ckpts["llama"], device="cpu", ring_gb=0.01, io="mmap").close()


def test_auto_keeps_a_page_cache_tier_in_the_room_the_limit_leaves(ckpts: Checkpoints,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """io="auto" picked O_DIRECT (the model does not fit the page-cache room) on the CPU: the units that fit in the
    room left after the ring compute on the file mapping, so their pages stay in the page cache; the rest is read
    O_DIRECT. Outputs are stock's; a pass reads from disk only what is outside the tier; no room, no tier."""
    import transformers

    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    from tiered.format import open_checkpoint

    total = open_checkpoint(d).nbytes  # what io="auto" compares with the room
    monkeypatch.setattr(tiered.policy, "page_cache_reserve", lambda threads: 0)
    seen = {}
    for room in (total - 1, 1):  # just too small for the checkpoint: some units in the tier; no room: none
        monkeypatch.setattr(tiered.machine, "page_cache_room", lambda room=room: (room, "cgroup /x memory.max=1"))
        with tiered.load(d, device="cpu", ring_gb=0.0002, io="auto") as m, torch.no_grad():
            s = tiered.stats(m)
            p = s.placement
            assert p.io == "direct"
            tier = set(p.mapped)
            assert s.page_cache_units == len(tier) and tier <= set(p.host) | set(p.streamed)
            assert torch.equal(m(ids).logits, want)
            seen[room] = (len(tier), s.page_cache_bytes)
    assert seen[total - 1][0] >= 1 and 0 < seen[total - 1][1] < total
    assert seen[1] == (0, 0)


@pytest.mark.parametrize("slow", ["pread", "direct"])
def test_auto_measures_direct_against_buffered_and_keeps_the_faster(slow: str, ckpts: Checkpoints,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """io="auto" that picked O_DIRECT alternates O_DIRECT and buffered pread (+ DONTNEED) unit by unit while it
    streams, then keeps the faster: here the other one, since every copy of ``slow`` is made 20 ms slower. After the
    choice every read uses it; outputs are stock's throughout; stats report both rates and the choice."""
    import transformers

    import tiered.reader
    from tiered import faults

    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # auto -> direct
    monkeypatch.setattr(tiered.reader, "PROBE_UNITS", 3)
    monkeypatch.setattr(tiered.reader, "PROBE_BYTES", 1)
    used: list[str] = []

    def timed(**info):
        used.append(info["io"])
        if info["io"] == slow:
            import time

            time.sleep(0.02)

    try:
        m = tiered.load(d, device="cpu", ring_gb=0.0002, io="auto", zero_copy=False)
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    with m, torch.no_grad(), faults.inject("read", timed):
        r = m._tiered.reader
        assert r.adapt and r.choice is None
        passes = 0
        while r.choice is None:
            assert torch.equal(m(ids).logits, want)
            passes += 1
            assert passes < 20, r._probe
        s = tiered.stats(m)
        fast = "direct" if slow == "pread" else "pread"
        assert r.choice["chosen"] == fast == s.io == r.backend and s.io_choice == r.choice
        assert r.choice[f"{fast}_gbps"] > r.choice[f"{slow}_gbps"] > 0
        assert {"direct", "pread"} <= set(used)  # both were tried
        for _ in range(2):  # a pass that started before the choice may still finish on the other backend
            m(ids)
        used.clear()
        assert torch.equal(m(ids).logits, want)
        assert used and set(used) == {fast}, set(used)
    with tiered.load(d, device="cpu", ring_gb=0.0002, io="direct", zero_copy=False) as m2:
        assert not m2._tiered.reader.adapt  # an explicit backend is kept as asked


def test_summary_says_what_auto_measured() -> None:
    from tiered.stats import Stats

    s = Stats()
    s.io = "direct"
    assert "chosen over" not in str(s)
    s.set_io_choice({"direct_gbps": 0.3, "pread_gbps": 0.45, "chosen": "pread"})
    line = str(s)
    # with the margin the choice was made by (tiered.reader.PROBE_MARGIN), so a slower-looking choice reads right
    assert (f"io=pread chosen over direct: direct 0.3 vs pread 0.45 GB/s (pread is kept only when "
            f"{tiered.reader.PROBE_MARGIN - 1:.0%} faster)") in line, line
    s.set_io_choice({"direct_gbps": 0.3, "pread_gbps": 0.31, "chosen": "direct", "request": 16 << 20, "depth": 4,
                     "shapes": {"16 MiB x4": 0.3, "32 MiB x4": 0.31}})
    line = str(s)
    assert (f"16 MiB x4 chosen of 2 read shapes (16 MiB x4 0.3, 32 MiB x4 0.31 GB/s; another than the first is kept "
            f"only when {tiered.reader.SHAPE_MARGIN - 1:.0%} faster)") in line, line


def test_auto_probe_times_both_backends_on_every_kind_of_read(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a MoE model a pass alternates layer reads and routed-expert reads; the probe alternates backends per read
    (unit, kind), so both backends time both kinds (one turn for all reads gave the expert reads one backend only:
    found by an adversarial review). Outputs stay stock's."""
    import collections

    import transformers

    import tiered.reader
    from tiered import faults

    d = ckpts["mixtral"]
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        from conftest import streaming_ring_gb

        ring = streaming_ring_gb(probe)
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # auto -> direct
    monkeypatch.setattr(tiered.reader, "PROBE_UNITS", 10**9)  # keep probing
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    seen: dict[str, set[str]] = collections.defaultdict(set)

    def rec(**info):
        seen["experts" if ".experts." in info["tensor"] else "dense"].add(info["io"])

    try:
        m = tiered.load(d, device="cpu", ring_gb=ring, io="auto", zero_copy=False, prefetch=0)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with m, torch.no_grad():
        assert m._tiered.reader.adapt and tiered.stats(m).expert_modules > 0
        with faults.inject("read", rec):
            for _ in range(4):
                assert torch.equal(m(ids).logits, want)
    assert seen["experts"] == {"direct", "pread"} and seen["dense"] == {"direct", "pread"}, dict(seen)


def test_stats_say_how_busy_the_disk_was_during_the_passes(ckpts: Checkpoints) -> None:
    """``tiered.stats`` times the model's passes (``passes``, ``pass_s``) and derives the fraction of that time a read
    was in flight (``disk_busy``) and the bytes read per pass-second (``pass_read_gbps``): with every read made 30 ms
    slow, the passes are mostly reading (> 50%); the figures agree with the counters; the summary line says them."""
    import time

    from tiered import faults

    ids = torch.randint(0, 200, (1, 5), generator=torch.Generator().manual_seed(2))
    with tiered.load(ckpts["llama"], device="cpu", ring_gb=0.0002, io="pread", zero_copy=False) as m, torch.no_grad():
        assert tiered.stats(m).snapshot()["disk_busy"] == 0  # no pass yet
        with faults.inject("read", lambda **_: time.sleep(0.03)):
            for _ in range(2):
                m(ids)
        s = tiered.stats(m).snapshot()
        assert s["passes"] == 2 and s["pass_s"] > 0
        assert s["disk_busy"] == s["read_s"] / s["pass_s"] > 0.5
        assert s["pass_read_gbps"] == (s["read_bytes"] - s["load_bytes"]) / s["pass_s"] / 1e9 > 0
        assert f"passes 2 in {s['pass_s']:.2f} s" in str(tiered.stats(m))
    with faults.inject("read", lambda **_: time.sleep(0.03)):  # reads at load only: the whole model resident
        m = tiered.load(ckpts["llama"], device="cpu", ring_gb=1, io="pread", zero_copy=False)
    with m, torch.no_grad():
        m(ids)
        s = tiered.stats(m).snapshot()
        assert s["load_read_s"] == s["read_s"] > 0 and s["disk_busy"] == 0  # not the load's reads


def test_reads_made_at_once_count_their_overlap_once_in_read_s() -> None:
    """``Stats.add_read`` counts the union of the reads' intervals (a head read in pieces on the model's thread while
    the loader reads the next layer: ``disk_busy`` went to 1.28 with a sum): two reads of 0.2 s ending together
    count 0.2 s; one of 0.05 s after an idle 0.1 s adds 0.05; bytes add up."""
    import time

    from tiered.stats import Stats

    s = Stats()
    time.sleep(0.2)
    s.add_read(100, 0.2)
    s.add_read(100, 0.2)  # the same interval, from another thread
    time.sleep(0.1)
    s.add_read(50, 0.05)
    assert s.read_bytes == 250 and 0.25 <= s.read_s < 0.27, s.read_s
    s.add_read(10, 0.0)
    assert s.read_s < 0.27


def test_auto_keeps_the_mapping_for_a_linear_unit_larger_than_the_ring(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The default io="auto" on the CPU with a checkpoint larger than the page cache's room would read O_DIRECT into
    the ring, which must then hold every unit whole; a linear unit larger than the ring runs on the file mapping in
    pieces of rows (as io="mmap" does). So auto keeps the mapping there instead of refusing what mmap runs (found by
    review: the io="auto" default refused a model the old io="mmap" default ran). Outputs equal the module's own."""
    import safetensors.torch
    from torch import nn

    from tiered.machine import Machine

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(8))  # 1 MiB each
            self.head = nn.Linear(512, 6144, bias=False)  # 12 MiB

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    g = torch.Generator().manual_seed(0)
    sd = {f"blocks.{i}.weight": torch.randn(512, 512, generator=g) * 0.04 for i in range(8)}
    sd["head.weight"] = torch.randn(6144, 512, generator=g) * 0.04
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"))
    ref = M()
    ref.load_state_dict(sd)
    x = torch.randn(3, 512, generator=g)
    with torch.no_grad():
        want = ref(x)
    monkeypatch.setattr(tiered.policy, "MIN_AUTO_RING_BYTES", 4096)
    fake = Machine(host_available=tiered.policy.headroom(False) + (8 << 20), host_where="cgroup /t memory.max",
                   page_cache_room=8 << 20, page_cache_where="cgroup /t memory.max")
    monkeypatch.setattr(tiered.api, "gather", lambda dev=None, **kw: fake)
    with torch.device("meta"):
        mod = M()
    with tiered.attach(mod, tmp_path, device="cpu") as m, torch.no_grad():
        p = tiered.stats(m).placement
        assert p.io == "mmap" and p.linear_pieces and not p.io_probe
        assert torch.equal(m(x), want)


def test_auto_probe_chooses_by_wall_time_not_by_the_sum_of_task_times(ckpts: Checkpoints, monkeypatch) -> None:
    """The probe compares what each backend delivered per second of wall time (the union of its copies' intervals):
    O_DIRECT's four 100 MB copies running side by side in one second (0.4 GB/s) beat buffered copies that each look
    quick (kernel readahead fetched part of them before) but follow one another over two seconds (0.2 GB/s). Summing
    each task's time instead gave O_DIRECT 0.1 GB/s and chose buffered reads (issue 25, fifth session)."""
    import tiered.reader
    from tiered.format import open_checkpoint

    monkeypatch.setattr(tiered.reader, "PROBE_UNITS", 1)
    monkeypatch.setattr(tiered.reader, "PROBE_BYTES", 1)
    try:
        r = tiered.reader.Reader(open_checkpoint(ckpts["llama"]), threads=2, io="direct", adapt=True)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    clock = [0.0]
    monkeypatch.setattr(tiered.reader.time, "perf_counter", lambda: clock[0])
    try:
        direct, pread = r._arms
        assert direct[0] == "direct" and pread[0] == "pread"
        r._unit_started(direct)
        r._unit_started(pread)
        clock[0] = 1.0
        r._local.arm = direct
        for _ in range(4):  # [0, 1] each, side by side
            r._measured(100_000_000, 1.0)
        r._local.arm = pread
        for k in range(4):  # [1 + 0.5 k, 1.5 + 0.5 k], one after another
            clock[0] = 1.5 + 0.5 * k
            r._measured(100_000_000, 0.5)
        assert r.choice is not None and r.choice["chosen"] == "direct", r.choice
        assert r.choice["direct_gbps"] == pytest.approx(0.4) and r.choice["pread_gbps"] == pytest.approx(0.2)
    finally:
        r.close()
    assert tiered.reader._union([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)


def _shape_probe_setup(monkeypatch: pytest.MonkeyPatch, *, units: int = 2) -> None:
    """io="auto" resolves to O_DIRECT; each way is measured after ``units`` unit reads; the default request is one
    page, so the test model's units split into several requests of each shape."""
    import tiered.reader

    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # auto -> direct
    monkeypatch.setattr(tiered.reader, "PROBE_UNITS", units)
    monkeypatch.setattr(tiered.reader, "PROBE_BYTES", 1)
    monkeypatch.setattr(tiered.reader, "DIRECT_CHUNK", 4096)


def _track_requests(monkeypatch: pytest.MonkeyPatch, r) -> tuple[dict, dict]:
    """Wrap ``r._pread_direct``: per way of reading, the sizes of its O_DIRECT requests and the most O_DIRECT requests
    in flight at once while one of its requests was."""
    import collections
    import threading

    sizes: dict = collections.defaultdict(list)
    peak: dict = collections.defaultdict(int)
    lock, active = threading.Lock(), [0]
    orig = r._pread_direct

    def tracked(file, buf, offset):
        arm = r._local.arm
        with lock:
            active[0] += 1
            sizes[arm].append(len(buf))
            peak[arm] = max(peak[arm], active[0])
        try:
            import time

            time.sleep(0.005)  # long enough for requests of a deep way to overlap
            return orig(file, buf, offset)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(r, "_pread_direct", tracked)
    return sizes, peak


def test_auto_measures_read_shapes_and_keeps_the_fastest(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once O_DIRECT is chosen, io="auto" measures its read shapes (request size, requests in flight) unit by unit and
    keeps the fastest: here the second shape, since every read in any other way is made slow. Each shape's requests
    are at most its request size (the largest shape's larger than the default's) and never more of them in flight
    than its depth; after the choice every read uses it; outputs are stock's throughout; stats say what was
    measured."""
    import time

    import transformers

    import tiered.reader
    from tiered import faults

    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    _shape_probe_setup(monkeypatch)
    try:
        m = tiered.load(d, device="cpu", ring_gb=0.0002, io="auto", zero_copy=False, threads=4)
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    r = m._tiered.reader
    shapes = tiered.reader.read_shapes(4)
    assert shapes == [(4096, 4), (8192, 4), (4096, 2), (16384, 1)] and r.shape == shapes[0]
    fast = ("direct", *shapes[1])

    def slow(**info):
        if r._local.arm != fast:  # buffered reads slowest: O_DIRECT is chosen, then its shapes measured
            time.sleep(0.1 if info["io"] == "pread" else 0.01)

    sizes, peak = _track_requests(monkeypatch, r)
    with m, torch.no_grad(), faults.inject("read", slow):
        passes = 0
        while r.choice is None or "shapes" not in r.choice:
            assert torch.equal(m(ids).logits, want)
            passes += 1
            assert passes < 40, (r._phase, r._probe)
        assert r.choice["chosen"] == "direct" and r.shape == shapes[1]
        assert (r.choice["request"], r.choice["depth"]) == shapes[1]
        assert set(r.choice["shapes"]) == {tiered.reader.shape_name(*s) for s in shapes}
        best = r.choice["shapes"][tiered.reader.shape_name(*shapes[1])]
        assert all(best > g > 0 for k, g in r.choice["shapes"].items() if k != tiered.reader.shape_name(*shapes[1]))
        assert tiered.stats(m).io_choice == r.choice
        assert "8 KiB x4 chosen of 4 read shapes" in str(tiered.stats(m)), str(tiered.stats(m))
        for arm, got in sizes.items():
            if arm is None or arm[0] != "direct":
                continue
            # whole pages straight into the slot (<= the request), or a staged piece's page-aligned superset
            assert max(got) <= arm[1] + 4096, (arm, max(got))
            assert peak[arm] <= arm[2], (arm, peak[arm])
        assert max(sizes[("direct", *shapes[3])]) > 8192 + 4096  # the 16 KiB shape's: larger than any other's
        assert peak[("direct", *shapes[1])] >= 2  # the deep ways' requests did overlap: the bound above can fail
        for _ in range(2):  # a pass that started before the choice may still finish in another way
            m(ids)
        sizes.clear()
        assert torch.equal(m(ids).logits, want)
        assert set(sizes) == {fast}, set(sizes)


def test_auto_measures_again_when_the_chosen_way_slows(ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the choice the reader watches the chosen way's rate; a window of REPROBE_BYTES read at under REPROBE_DROP
    x the rate it was chosen at (the disk changed) starts the measurement again, which then chooses anew: here
    buffered reads, once O_DIRECT became slow. The choice (and the summary line) then no longer reports an O_DIRECT
    read shape — the old ``shapes``/``request``/``depth`` were kept beside ``chosen: pread`` (found by an adversarial
    review). Outputs stay stock's."""
    import time

    import transformers

    import tiered.reader
    from tiered import faults

    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
    _shape_probe_setup(monkeypatch)
    monkeypatch.setattr(tiered.reader, "REPROBE_BYTES", 1 << 40)  # no window ends before the disk changes below
    slow_io = ["pread"]

    def slow(**info):
        if info["io"] == slow_io[0]:
            time.sleep(0.01)

    try:
        m = tiered.load(d, device="cpu", ring_gb=0.0002, io="auto", zero_copy=False)
    except tiered.ConfigError as e:
        pytest.skip(str(e))
    with m, torch.no_grad(), faults.inject("read", slow):
        r = m._tiered.reader
        for _ in range(40):
            assert torch.equal(m(ids).logits, want)
            if r.choice is not None and r._phase is None:
                break
        assert r.choice["chosen"] == "direct" and r.reprobes == 0 and "shapes" in r.choice
        slow_io[0] = "direct"  # the disk changed: O_DIRECT now slow
        monkeypatch.setattr(tiered.reader, "REPROBE_BYTES", 1 << 16)
        for _ in range(60):
            assert torch.equal(m(ids).logits, want)
            if r.reprobes and r._phase is None:
                break
        assert r.reprobes >= 1 and r.choice["chosen"] == "pread" == tiered.stats(m).io, (r.reprobes, r.choice)
        assert r.choice["reprobes"] == r.reprobes
        assert not {"shapes", "request", "depth"} & set(r.choice), r.choice
        assert "read shapes" not in str(tiered.stats(m)), str(tiered.stats(m))


def test_a_shallow_read_never_runs_beside_more_than_its_depth() -> None:
    """The gate: a task of depth d enters only while fewer than d and fewer than the smallest running depth are in
    flight — so a depth-1 task waits for every running depth-4 task, and depth-4 tasks wait while it runs; depth-4
    tasks run four at once, and a fifth waits."""
    import threading

    from tiered.reader import _Gate

    g = _Gate()
    inside: list[int] = []
    lock = threading.Lock()

    def start(depth: int) -> tuple[threading.Thread, threading.Event]:
        release = threading.Event()

        def task() -> None:
            g.enter(depth)
            with lock:
                inside.append(depth)
            release.wait(10)
            with lock:
                inside.remove(depth)
            g.leave(depth)

        t = threading.Thread(target=task)
        t.start()
        return t, release

    def settle(n: int) -> list[int]:
        import time

        for _ in range(200):
            with lock:
                if len(inside) == n:
                    break
            time.sleep(0.005)
        time.sleep(0.05)  # and nothing else gets in meanwhile
        with lock:
            return sorted(inside)

    deep = [start(4) for _ in range(3)]
    assert settle(3) == [4, 4, 4]
    shallow = start(1)
    assert settle(3) == [4, 4, 4]  # waits for the deep ones
    late = start(4)
    assert settle(4) == [4, 4, 4, 4]  # depth 4: four at once (the shallow one still waits)
    fifth = start(4)
    assert settle(4) == [4, 4, 4, 4]
    for t, release in [*deep, late]:
        release.set()
        t.join(10)
    assert settle(1) in ([1], [4])
    if settle(1) == [4]:  # the fifth got in first: the shallow one waits for it too
        fifth[1].set()
        fifth[0].join(10)
        assert settle(1) == [1]
    blocked = start(4)
    assert settle(1) == [1]  # nothing runs beside the shallow one
    shallow[1].set()
    shallow[0].join(10)
    for t, release in (fifth, blocked):
        release.set()
        t.join(10)
        assert not t.is_alive()
    assert settle(0) == []


def test_auto_probe_gives_each_way_every_kind_of_read_before_it_chooses(ckpts: Checkpoints,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE pass alternates a layer's read and its routed experts' read. Staggering each read's first turn by the
    number of reads seen before it put, within one pass, every layer read on one way and every expert read on the
    other (even and odd reads): a measurement that ends within a pass (the production thresholds are met in a few
    layers of a large model) compared layer reads on one way with expert reads on the other (found by an adversarial
    review). Each way must have timed both kinds when the choice is made."""
    import collections
    import threading

    import tiered.reader
    from tiered import faults

    d = ckpts["mixtral"]
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        from conftest import streaming_ring_gb

        ring = streaming_ring_gb(probe)
    monkeypatch.setattr(tiered.machine, "page_cache_room", lambda: (1, "cgroup /x memory.max=1"))  # auto -> direct
    monkeypatch.setattr(tiered.reader, "PROBE_UNITS", 2)
    monkeypatch.setattr(tiered.reader, "PROBE_BYTES", 1)
    monkeypatch.setattr(tiered.reader, "SHAPES", ((1, 1.0),))  # the backend only
    kind = threading.local()
    credited: dict[str, set[str]] = collections.defaultdict(set)

    def rec(**info):
        kind.k = "experts" if ".experts." in info["tensor"] else "dense"

    try:
        m = tiered.load(d, device="cpu", ring_gb=ring, io="auto", zero_copy=False, prefetch=0)
    except tiered.ConfigError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    r = m._tiered.reader
    orig = r._measured

    def measured(nbytes, seconds):
        arm = getattr(r._local, "arm", None)
        with r._probe_lock:
            if r._phase == "backend" and arm in r._probe:
                credited[arm[0]].add(getattr(kind, "k", "?"))
        orig(nbytes, seconds)

    monkeypatch.setattr(r, "_measured", measured)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with m, torch.no_grad(), faults.inject("read", rec):
        for _ in range(10):
            m(ids)
            if r.choice is not None:
                break
        assert r.choice is not None
    assert credited["direct"] == {"dense", "experts"} == credited["pread"], dict(credited)


def test_a_shallow_read_shape_limits_requests_not_the_decode_after_them(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The depth of an O_DIRECT read shape bounds the requests in flight; the gate was held for a whole task, so a
    depth-1 shape also ran every float8 decode (CPU work after the read) on one thread at a time, a cost the shape
    measurement (read seconds only) never saw (found by an adversarial review). With depth 1 the requests stay one
    at a time while decodes overlap; outputs are stock's."""
    import threading
    import time

    import models
    import transformers

    import tiered.quant
    import tiered.reader

    d = models.fp8_block(models.llama(tmp_path / "bf16"), tmp_path / "fp8")
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids).logits
    try:
        m = tiered.load(d, device="cpu", ring_gb=0.0002, io="direct", zero_copy=False, threads=4)
    except tiered.ConfigError as e:
        pytest.skip(str(e))
    r = m._tiered.reader
    r.shape = (tiered.reader.DIRECT_CHUNK, 1)  # the shallowest shape, as the measurement may choose
    lock = threading.Lock()
    now = {"decode": 0, "read": 0}
    peak = {"decode": 0, "read": 0}

    def counted(what, fn):
        def run(*a, **k):
            with lock:
                now[what] += 1
                peak[what] = max(peak[what], now[what])
            try:
                time.sleep(0.01)
                return fn(*a, **k)
            finally:
                with lock:
                    now[what] -= 1
        return run

    monkeypatch.setattr(tiered.quant, "decode_rows", counted("decode", tiered.quant.decode_rows))
    monkeypatch.setattr(r, "_pread_direct", counted("read", r._pread_direct))
    with m, torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert peak["read"] == 1 and peak["decode"] > 1, peak
