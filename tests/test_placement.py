"""Placement and its prediction (tiered/placement.py, `tiered inspect --ring-gb/--gpu-gb/--host-gb`).

The placement must be the one tiered.load makes: on the CPU it is compared with a real load's choice; on CUDA with
a real load in tests/test_cuda.py. The prediction is checked for its arithmetic, not for a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tiered
from tests import models
from tiered import policy
from tiered.cli import _plan_for
from tiered.errors import ConfigError
from tiered.hostmem import PAGE_SIZE, page_up
from tiered.placement import GBPS, place_here, predict

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("place")
    return {"llama": models.llama(root / "llama", dtype=torch.float32),
            "mixtral": models.mixtral(root / "mixtral", num_experts=8, top_k=2, max_shard_size="200KB")}


def _place(d, device="cpu", **kw):
    config, ckpt, plan = _plan_for(d, None, device)
    return place_here(plan, device=device, ckpt_bytes=ckpt.nbytes, config=config, **kw), plan


@pytest.mark.parametrize("name", ["llama", "mixtral"])
@pytest.mark.parametrize(("ring_mb", "host_mb"), [(0.3, 0), (1.0, 0), (64.0, 0), (0.3, 0.2), (1.0, 0.5)])
def test_cpu_placement_is_what_load_does(dirs, name, ring_mb, host_mb):
    d = dirs[name]
    ring_gb = ring_mb * 2**20 / GiB
    host_gb = host_mb * 2**20 / GiB
    try:
        m = tiered.load(d, ring_gb=ring_gb, device="cpu", zero_copy=False, host_gb=host_gb)
    except tiered.RingTooSmallError:
        pytest.skip("this ring is below a unit: nothing to compare")
    with m:
        p, plan = _place(d, ring_gb=ring_gb, gpu_gb=None, host_gb=host_gb)
        st = m._tiered.streamer
        assert set(p.host) == st.host_ids and (not host_mb or p.host or len(p.resident) == len(plan.units))
        assert set(p.resident) == st.resident_ids
        assert set(p.rows) == {rg.unit.index for rg in m._tiered.rows}
        assert p.streamed == [i for i in st.streamed if i not in st.host_ids]  # the loader runs host units too
        assert p.expert_modules == tiered.stats(m).expert_modules
        assert [u.name for u in plan.units] == [u.name for u in m._tiered.plan.units]


def test_cuda_placement_on_a_cpu_machine(dirs):
    d = dirs["llama"]
    p0, plan = _place(d, "cuda", ring_gb=0.01, gpu_gb=0)
    total = len(plan.units)
    assert not p0.resident and len(p0.streamed) + len(p0.rows) == total
    last = -1
    for gpu in (0, 0.0005, 0.001, 0.01):  # more GPU budget: never fewer bytes resident, never slower
        p, _ = _place(d, "cuda", ring_gb=0.01, gpu_gb=gpu)
        parts = [*p.resident, *p.host, *p.streamed, *p.rows]
        assert sorted(parts) == list(range(total))  # a partition of the units
        assert p.resident_bytes >= last
        last = p.resident_bytes
        # an explicit gpu_gb holds the resident units and one device buffer (as accelerate's max_memory holds
        # the weights and one offloaded layer); the prefetch buffers come on top
        assert p.resident_bytes + p.device_buffer_bytes // 3 <= gpu * GiB or not p.resident
    ph, _ = _place(d, "cuda", ring_gb=0.01, gpu_gb=0, host_gb=0.01)
    assert ph.host and ph.streamed_bytes < p0.streamed_bytes
    assert predict(ph)["warm_s_per_token"] < predict(p0)["warm_s_per_token"]  # the host tier skips the ring copy


def test_prediction_arithmetic(dirs):
    p, _ = _place(dirs["llama"], "cuda", ring_gb=0.01, gpu_gb=0)
    a = predict(p)
    b = predict(p, {k: 2 * v for k, v in GBPS.items()})
    assert a["warm_s_per_token"] > 0
    assert b["warm_s_per_token"] == pytest.approx(a["warm_s_per_token"] / 2)
    assert b["cold_s_per_token"] == pytest.approx(a["cold_s_per_token"] / 2)
    assert a["warm_s_per_token"] == pytest.approx(p.streamed_bytes / (GBPS["page_cache"] * 1e9))
    assert a["cold_s_per_token"] == pytest.approx(p.streamed_bytes / (GBPS["disk"] * 1e9))


def test_moe_placement_routes_and_sizes_the_cache(dirs):
    d = dirs["mixtral"]
    p, _ = _place(d, "cuda", ring_gb=0.001, gpu_gb=0)
    assert p.expert_modules >= 2 and p.routed_expert_bytes > 0 and p.expert_cache_slots == 0
    pc, _ = _place(d, "cuda", ring_gb=0.001, gpu_gb=0, expert_cache_gb=1.0)
    assert pc.expert_cache_slots == pc.experts_total and pc.expert_hit_rate == 1.0
    assert predict(pc)["warm_s_per_token"] < predict(p)["warm_s_per_token"]


def test_host_tier_is_spread_over_the_streamed_units(dirs):
    """A host tier that holds part of the streamed units takes them spread over the execution order (every other
    layer for half of them), not a block at the front: the loader reads a streamed unit while host-tier units'
    H2D runs, which is what the prediction's max(read, H2D) assumes. The budget is never exceeded; a budget that
    holds them all takes them all."""
    d = dirs["llama"]
    p0, plan = _place(d, "cuda", ring_gb=0.01, gpu_gb=0, embedding_rows=False)
    from tiered.hostmem import page_up

    layers = [i for i in p0.streamed if ".layers." in plan.units[i].name]
    n = page_up(plan.units[layers[0]].nbytes)
    assert len(layers) >= 4 and all(page_up(plan.units[i].nbytes) == n for i in layers)
    others = sum(page_up(plan.units[i].nbytes) for i in p0.streamed if i not in layers)
    half = (len(layers) // 2) * n
    ph, _ = _place(d, "cuda", ring_gb=0.01, gpu_gb=0, embedding_rows=False, host_gb=(half + others // 2) / GiB)
    took = [i in ph.host for i in layers]
    assert 0 < sum(took) < len(layers)
    assert sum(page_up(plan.units[i].nbytes) for i in ph.host) <= (half + others // 2)
    # spread: no two host-tier layers more than one apart from their even share (no run of streamed ones at the end)
    runs, cur = [], 0
    for t in took:
        cur = 0 if t else cur + 1
        runs.append(cur)
    assert max(runs) <= 2, took
    assert took != sorted(took, reverse=True)  # not a block at the front
    pa, _ = _place(d, "cuda", ring_gb=0.01, gpu_gb=0, embedding_rows=False, host_gb=1.0)
    assert set(pa.host) == set(p0.streamed) and not pa.streamed


def test_host_tier_holds_first_pieces_of_units_larger_than_the_ring(dirs, monkeypatch):
    """CUDA: a host tier too small for a whole unit still takes bytes off the disk: the first pieces of the units
    larger than the ring, one per unit in turn (spread over the pass), within the budget. Per token, the disk then
    reads exactly those pieces' checkpoint bytes less (each piece's own, from tiered.dist.split_unit)."""
    from tiered import dist as _dist
    from tiered import policy as api

    monkeypatch.setattr(api, "MIN_PIECE_BYTES", 16 << 10)
    d = dirs["llama"]
    ring_gb = (96 << 10) / GiB  # below every layer: they all stream in pieces
    p0, plan = _place(d, "cuda", ring_gb=ring_gb, gpu_gb=0, embedding_rows=False)
    assert len(p0.pieces) >= 4 and not p0.host_pieces and not p0.host
    one = policy.piece_slot(plan.units[min(p0.pieces)], p0.pieces[min(p0.pieces)], plan.align)
    from tiered.hostmem import page_up

    small = sum(page_up(plan.units[i].nbytes) for i in p0.streamed if i not in p0.pieces)  # taken whole first
    smallest = min(plan.units[i].nbytes for i in p0.pieces)
    extra = min(smallest - 4096, (len(p0.pieces) + 2) * one)  # no large unit fits; a bit more than a piece each
    ph, _ = _place(d, "cuda", ring_gb=ring_gb, gpu_gb=0, embedding_rows=False, host_gb=(small + extra) / GiB)
    assert ph.host_pieces and not set(ph.host) & set(ph.host_pieces)
    left = small + extra - sum(page_up(plan.units[i].nbytes) for i in ph.host)  # what whole units left
    assert 0 < ph.host_piece_bytes <= left
    assert max(ph.host_pieces.values()) - min(ph.host_pieces.values()) <= 1  # one per unit in turn
    assert len(ph.host_pieces) == min(len(ph.pieces), left // one)  # every unit gets one before any gets two
    held = 0
    for i, k in ph.host_pieces.items():
        held += sum(_dist.split_unit(plan.units[i], j, ph.pieces[i], plan.align)[0].src_bytes for j in range(k))
    whole = sum(plan.units[i].src_bytes for i in ph.host)
    assert p0.streamed_bytes - ph.streamed_bytes - whole == held > 0
    assert predict(ph)["cold_s_per_token"] < predict(p0)["cold_s_per_token"]
    # the choice itself: budget exhausted in order, never more than a unit's pieces
    units = {i: plan.units[i] for i in p0.pieces}
    got = policy.choose_host_pieces(plan, p0.pieces, 10 * GiB)
    assert got == p0.pieces  # a budget that holds everything holds every piece
    assert policy.choose_host_pieces(plan, p0.pieces, one - 1) == {}
    assert policy.choose_host_pieces(plan, p0.pieces, one) == {min(units): 1}


def test_moe_host_tier_takes_units_then_whole_blocks_of_experts(dirs):
    """host_gb beyond the streamed units goes to routed blocks' experts (whole blocks, forward order); their
    routed bytes then cost an H2D, not a read: the prediction falls, the bytes per token do not."""
    d = dirs["mixtral"]
    p0, _ = _place(d, "cuda", ring_gb=0.001, gpu_gb=0)
    pu, _ = _place(d, "cuda", ring_gb=0.001, gpu_gb=0, host_gb=(p0.streamed_bytes + (64 << 10)) / GiB)
    assert pu.host and not pu.host_expert_modules  # the units first: nothing left for a block's experts
    pa, _ = _place(d, "cuda", ring_gb=0.001, gpu_gb=0, host_gb=1.0)
    assert not pa.streamed and pa.host_expert_modules == pa.expert_modules >= 2
    assert pa.routed_host_bytes == pa.routed_expert_bytes
    # every expert of every block (page-rounded per part): top-2 of 8 routes to a quarter of them
    assert pa.host_expert_bytes >= 4 * pa.routed_expert_bytes
    g = {"page_cache": 10.0, "h2d": 50.0, "disk": 1.0}
    assert predict(pa, g)["warm_s_per_token"] < predict(pu, g)["warm_s_per_token"]
    assert predict(pa, g)["bytes_per_token"] == pytest.approx(predict(pu, g)["bytes_per_token"])
    assert predict(pa, g)["warm_s_per_token"] == pytest.approx(
        (pa.host_bytes + pa.routed_expert_bytes) / 50e9, rel=1e-9)
    assert not _place(d, "cpu", ring_gb=0.001, gpu_gb=None)[0].host_expert_modules  # host_gb=0: none
    pc, _ = _place(d, "cpu", ring_gb=0.0002, gpu_gb=None, host_gb=1.0)  # on the CPU too: kept in host memory
    assert not pc.streamed and pc.host_expert_modules == pc.expert_modules >= 2


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tiered.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_inspect_prints_placement_and_prediction(dirs):
    d = dirs["llama"]
    r = _cli("inspect", d, "--device", "cuda", "--ring-gb", 0.01, "--gpu-gb", 0, "--h2d-gbps", 20)
    assert r.returncode == 0, r.stderr
    assert "placement (cuda, ring_gb=0.01, gpu_gb=0.0 GiB" in r.stdout and "predicted decode" in r.stdout, r.stdout
    assert "20 GB/s H2D" in r.stdout
    assert "-> streamed" in r.stdout and "-> rows" in r.stdout  # each listed unit's tier
    assert "prefetch buffers come on top" in r.stdout  # gpu_gb=0: the device buffers are beyond the budget, said
    r = _cli("inspect", d, "--device", "cuda", "--ring-gb", 0.01, "--gpu-gb", 0, "--json")
    info = json.loads(r.stdout)
    pl = info["placement"]
    assert set(pl["units"].values()) <= {"gpu", "host", "rows", "streamed"} and len(pl["units"]) == len(info["units"])
    r = _cli("inspect", d, "--ring-gb", 1.0, "--json")  # the CPU: a ring that holds the model keeps it all there
    cpu = json.loads(r.stdout)["placement"]["units"]
    assert set(cpu.values()) == {"ring"}, cpu
    assert pl["predicted"]["warm_s_per_token"] > 0
    r = _cli("inspect", d)  # without placement options: as before
    assert r.returncode == 0 and "placement" not in r.stdout
    r = _cli("inspect", d, "--ring-gb", 0.0002, "--host-gb", 0.0002)  # the CPU host tier: units kept in host memory
    assert r.returncode == 0 and "placement (cpu" in r.stdout and "-> host" in r.stdout, r.stdout + r.stderr
    if not torch.cuda.is_available():
        r = _cli("inspect", d, "--device", "cuda", "--ring-gb", 0.01)
        assert r.returncode == 2 and "--gpu-gb" in r.stderr, r.stderr


def test_inspect_prints_pieces_and_the_host_tiers_share_of_them(dirs, monkeypatch, capsys):
    """`tiered inspect --device cuda` with a ring below the layers says they stream in pieces, and with a host tier
    too small for a layer, how many first pieces it holds (the load's choice: tests/test_cuda.py)."""
    from tiered import policy as api
    from tiered.cli import main

    monkeypatch.setattr(api, "MIN_PIECE_BYTES", 16 << 10)
    d = dirs["llama"]
    ring = str((96 << 10) / GiB)
    assert main(["inspect", str(d), "--device", "cuda", "--ring-gb", ring, "--gpu-gb", "0"]) in (0, None)
    out = capsys.readouterr().out
    assert "streamed units are larger than the ring: each streams in pieces" in out, out
    assert "host tier holds the first" not in out
    p, _ = _place(d, "cuda", ring_gb=(96 << 10) / GiB, gpu_gb=0, host_gb=(200 << 10) / GiB)
    assert p.host_pieces
    assert main(["inspect", str(d), "--device", "cuda", "--ring-gb", ring, "--gpu-gb", "0",
                 "--host-gb", str((200 << 10) / GiB)]) in (0, None)
    out = capsys.readouterr().out
    assert f"the host tier holds the first {sum(p.host_pieces.values())} pieces of {len(p.host_pieces)} of them" in out


def test_gpu_gb_on_the_cpu_warns(dirs):
    with pytest.warns(UserWarning, match="gpu_gb=1 has no effect on device=cpu"):
        tiered.load(dirs["llama"], ring_gb=0.01, device="cpu", gpu_gb=1).close()


def test_expert_prefetch_is_accepted_and_ignored(dirs):
    """expert_prefetch was removed (measured slower): the keyword still loads, says so, and changes nothing."""
    with pytest.warns(FutureWarning, match="expert_prefetch=True has no effect"):  # shown by default, unlike Deprecation
        m = tiered.load(dirs["llama"], ring_gb=0.01, device="cpu", expert_prefetch=True)
    with m, tiered.load(dirs["llama"], ring_gb=0.01, device="cpu") as ref:
        assert tiered.stats(m).placement == tiered.stats(ref).placement


@pytest.mark.parametrize("tied", [True, False])
def test_model_bytes_counts_a_tied_weight_once(tmp_path, tied):
    """stats.model_bytes / inspect's model_bytes: the model's distinct weights (stock's own parameters(), which
    lists a tied weight once), not the unit layouts (where a tied head is a unit of its own)."""
    import transformers

    d = models.llama(tmp_path / "m", tied=tied, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    want = sum(p.numel() * p.element_size() for p in ref.parameters())
    with tiered.load(d, device="cpu", ring_gb=1.0) as m:
        assert tiered.stats(m).model_bytes == want
        emb = ref.get_input_embeddings().weight
        # the layouts hold the tied table twice (the embedding's unit and the head's)
        assert (m._tiered.plan.nbytes >= want + emb.numel() * emb.element_size()) == tied
    r = _cli("inspect", d, "--units", "--json")
    assert json.loads(r.stdout)["model_bytes"] == want


def test_inspect_prints_routed_experts_with_or_without_the_gpu_note(dirs):
    """The MoE lines of `tiered inspect --device cuda`: the routed experts per token whether or not the GPU note
    (prefetch buffers beyond gpu_gb) is printed, and the ring a MoE block's dense part needs once routed."""
    d = dirs["mixtral"]
    for extra, note in ((["--gpu-gb", 0], True), (["--gpu-gb", 0.0001, "--prefetch", 0], False)):
        r = _cli("inspect", d, "--device", "cuda", "--ring-gb", 0.01, *extra)
        assert r.returncode == 0, r.stderr
        assert ("note: the GPU holds" in r.stdout) == note, r.stdout
        assert "routed experts: 3 blocks" in r.stdout, r.stdout
    info = json.loads(_cli("inspect", d, "--units", "--json").stdout)
    ex = info["experts"]
    moe = max(u["bytes"] for u in info["units"] if u["layer"] is not None)
    assert 0 < ex["routed_unit_max_bytes"] < moe - ex["experts_bytes"] // ex["blocks"] + 4096
    assert "without its experts takes" in _cli("inspect", d, "--units").stdout


@pytest.mark.parametrize("bad", [{"host_gb": float("nan")}, {"gpu_gb": float("inf")}, {"ring_gb": -1.0},
                                 {"prefetch": -1}, {"expert_cache_gb": float("nan")}])
def test_place_refuses_what_load_refuses(dirs, bad):
    kw = {"ring_gb": 0.01, "gpu_gb": 1.0, **bad}
    with pytest.raises((tiered.ConfigError, tiered.RingTooSmallError)):
        _place(dirs["mixtral"], "cuda", **kw)
    with pytest.raises((tiered.ConfigError, tiered.RingTooSmallError)):
        tiered.load(dirs["mixtral"], device="cpu", **kw)  # refused before gpu_gb's warning on the CPU


# ---------------------------------------------------------------------------------------------- golden decisions

GOLDEN = ROOT / "tests" / "golden"


def _golden(device: str) -> list[dict]:
    return json.loads((GOLDEN / f"placement-{device}.json").read_text())


def _golden_mismatches(device: str, model: str, d: Path, decide) -> list:
    """Every recorded case of ``model`` whose decisions ``decide(case, d)`` gives differently: (case id, {field: (recorded,
    got)})."""
    bad = []
    for r in _golden(device):
        if r["case"]["model"] != model:
            continue
        got = decide(r["case"], d)
        if got != r["decisions"]:
            keys = {*got, *r["decisions"]}
            bad.append((r["case"]["id"], {k: (r["decisions"].get(k), got.get(k)) for k in keys
                                          if got.get(k) != r["decisions"].get(k)}))
    return bad


@pytest.mark.parametrize("model", sorted({r["case"]["model"] for r in _golden("cpu")}))
def test_golden_cpu_decisions(ckpts, model):
    """What a CPU load builds — per unit resident / host / rows / mapped / ring, routed experts, the expert cache,
    the ring, the backend, or the refusal — is what it built before the redesign (tests/placement_golden.py)."""
    import placement_golden

    bad = _golden_mismatches("cpu", model, ckpts[model], placement_golden.run_case)
    assert not bad, bad[:3]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("model", sorted({r["case"]["model"] for r in _golden("cuda")}))
def test_golden_place_is_pure(ckpts, model, device):
    """place() alone — no load, no GPU — gives every recorded decision, CUDA ones (explicit gpu_gb) included: what
    `tiered inspect` prints is what a load on the H200 built before the redesign."""
    import placement_golden

    bad = _golden_mismatches(device, model, ckpts[model], placement_golden.placed)
    assert not bad, bad[:3]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", sorted({r["case"]["model"] for r in _golden("cuda")}))
def test_golden_cuda_decisions(ckpts, model):
    """The same on CUDA with an explicit gpu_gb: what the load builds is what it built before the redesign."""
    import placement_golden

    bad = _golden_mismatches("cuda", model, ckpts[model], placement_golden.run_case)
    assert not bad, bad[:3]


# ---------------------------------------------------------------------------------------------- hostile


def _place_cuda(d, **kw):
    """``place_here`` for CUDA (explicit ``gpu_gb``, 0 unless given; ``ring_gb`` 0.01 unless given)."""
    config, ckpt, plan = _plan_for(d, None, "cuda")
    kw.setdefault("ring_gb", 0.01)
    kw.setdefault("gpu_gb", 0)
    return place_here(plan, device="cuda", ckpt_bytes=ckpt.nbytes, config=config, **kw), plan


def _host_bytes_sweep(sizes: list[int], resident: set[int] = frozenset()) -> list[tuple[int, int]]:
    plan = SimpleNamespace(units=[SimpleNamespace(index=i, nbytes=s) for i, s in enumerate(sizes)])
    total = sum(page_up(s) for i, s in enumerate(sizes) if i not in resident)
    out = []
    for b in range(0, total + 2 * PAGE_SIZE, PAGE_SIZE):
        host = policy.choose_host(plan, set(resident), set(), sizes, b / GiB)
        assert sum(page_up(sizes[i]) for i in host) <= b
        out.append((b, sum(page_up(sizes[i]) for i in host)))
    return out


def _drops(sweep):
    return [(b0, u0, b1, u1) for (b0, u0), (b1, u1) in zip(sweep, sweep[1:], strict=False) if u1 < u0]


class TestHostileHostTier:
    """The host tier spread over the execution order (tiered/policy.py ``choose_host``, tiered/placement.py ``place``)
    at edge budgets: a subset of what streams, within the budget, all when they fit, none when none fits; bad
    budgets refused. Two strict xfails record a known limitation (more budget can hold fewer bytes)."""

    @pytest.mark.parametrize("name", ["llama", "mixtral"])
    @pytest.mark.parametrize("embedding_rows", [False, True])
    @pytest.mark.parametrize("gpu_frac", [0, 0.4])
    def test_host_tier_invariants_at_edge_budgets(self, ckpts, name, embedding_rows, gpu_frac):
        """For budgets 0, 1 byte, below the smallest unit, every prefix of the execution order (and one byte either
        side), the total minus one byte, the total, and far more: the host tier is a subset of the units that would
        stream, never more than the budget (page-rounded, with its experts), takes them all when they fit, takes none
        when none fits, leaves no unit out that still fits, and leaves the resident units as they were."""
        d = ckpts[name]
        _, whole = _place_cuda(d, embedding_rows=embedding_rows)
        gpu_gb = gpu_frac * sum(u.nbytes for u in whole.units) / GiB  # 0.4: some units resident, the rest streamed
        p0, plan0 = _place_cuda(d, embedding_rows=embedding_rows, gpu_gb=gpu_gb)
        assert not p0.host
        cand = set(p0.streamed)
        need = {i: page_up(plan0.units[i].nbytes) for i in cand}
        assert cand and (gpu_frac == 0 or p0.resident)
        total = sum(need.values())
        order = [i for i in range(len(plan0.units)) if i in cand]
        prefixes = [sum(need[i] for i in order[:k]) for k in range(1, len(order) + 1)]
        budgets = {0, 1, min(need.values()) - 1, total - 1, total, total + 1, 64 * total}
        budgets |= {b + e for b in prefixes for e in (-1, 0, 1)}
        for b in sorted(x for x in budgets if x >= 0):
            p, plan = _place_cuda(d, embedding_rows=embedding_rows, gpu_gb=gpu_gb, host_gb=b / GiB)
            host = set(p.host)
            used = sum(need[i] for i in host)
            assert sorted([*p.resident, *p.host, *p.streamed, *p.rows]) == list(range(len(plan.units))), b
            assert p.resident == p0.resident and p.rows == p0.rows, b
            assert host <= cand, (b, host - cand)
            assert used + p.host_expert_bytes <= b, (b, used, p.host_expert_bytes)
            assert all(page_up(plan.units[i].nbytes) == need[i] for i in host)
            if b >= total:
                assert host == cand, (b, total, cand - host)
            if b < min(need.values()):
                assert not host, b
            if b == total - 1:
                assert host != cand
            left = [i for i in cand - host if used + need[i] <= b]
            assert not left, f"budget {b}: units {left} still fit beside {sorted(host)} ({b - used} bytes left)"


    def test_host_tier_spread_is_even_for_equal_units(self):
        """N equal units, a budget of k of them: exactly k taken, and every prefix of the execution order holds its
        even share k*m/N of them to within one unit (the spread the change promises)."""
        n = 3 * PAGE_SIZE
        for N in range(1, 17):
            plan = SimpleNamespace(units=[SimpleNamespace(index=i, nbytes=n) for i in range(N)])
            for k in range(N + 1):
                host = policy.choose_host(plan, set(), set(), [n] * N, k * n / GiB)
                assert len(host) == k, (N, k, sorted(host))
                c = 0
                for m in range(1, N + 1):
                    c += (m - 1) in host
                    assert abs(c - k * m / N) <= 1, (N, k, sorted(host))


    @pytest.mark.xfail(strict=True, reason="known limitation (2026-12-01): the host tier spread over the execution order, "
                       "and the first-fit choice it falls back to, are not monotone in bytes when unit sizes differ a lot (a "
                       "larger budget can hold fewer bytes); bytes in the host tier matter only while reads bound the pass")
    def test_more_host_budget_never_puts_fewer_bytes_in_the_host_tier_huge_next_to_tiny(self):
        """Huge units next to tiny ones (an embedding or lm_head beside small layers): raising ``host_gb`` must never
        leave fewer bytes in the host tier (every byte there is a byte not read per pass: fewer is slower, and
        ``tiered inspect`` would predict a slower model for more memory). Budgets swept one page at a time."""
        sizes = [1846, 1_000_000, 4788, 2776, 3_000_000, 12288, 1_000_000, 3_000_000]
        drops = _drops(_host_bytes_sweep(sizes))
        worst = max(drops, key=lambda x: x[1] - x[3], default=None)
        assert not drops, (f"{len(drops)} budget steps of one page put fewer bytes in the host tier; worst: host_gb "
                           f"{worst[0]} B holds {worst[1]} B but {worst[2]} B holds {worst[3]} B")


    @pytest.mark.xfail(strict=True, reason="known limitation (2026-12-01): the host tier spread over the execution order, "
                       "and the first-fit choice it falls back to, are not monotone in bytes when unit sizes differ a lot (a "
                       "larger budget can hold fewer bytes); bytes in the host tier matter only while reads bound the pass")
    def test_more_host_budget_never_puts_fewer_bytes_in_the_host_tier_through_place(self, ckpts):
        """The same through ``place`` on the MoE checkpoint (units and whole blocks of experts, page-rounded), budgets
        swept one page at a time up to the streamed units' total."""
        d = ckpts["mixtral"]
        p0, plan0 = _place_cuda(d, embedding_rows=False)
        total = sum(page_up(plan0.units[i].nbytes) for i in p0.streamed)
        sweep = []
        for b in range(0, total + 2 * PAGE_SIZE, PAGE_SIZE):
            p, plan = _place_cuda(d, embedding_rows=False, host_gb=b / GiB)
            sweep.append((b, sum(page_up(plan.units[i].nbytes) for i in p.host) + p.host_expert_bytes))
            assert sweep[-1][1] <= b
        drops = _drops(sweep)
        assert not drops, f"more host_gb, fewer bytes in the host tier (budget, bytes, budget, bytes): {drops}"


    def test_place_with_zero_host_gb_takes_nothing_and_refuses_a_negative_one(self, ckpts):
        for host_gb in (0, 0.0, -0.0):
            p, _ = _place_cuda(ckpts["mixtral"], host_gb=host_gb)
            assert not p.host and p.host_bytes == 0 and p.host_expert_modules == 0 and p.host_expert_bytes == 0
        with pytest.raises(ConfigError, match="host_gb"):  # as tiered.load refuses it
            _place_cuda(ckpts["mixtral"], host_gb=-1.0)


    def test_a_budget_for_all_units_and_experts_takes_every_expert_block(self, ckpts):
        """A host budget holding every streamed unit and every routed block's experts (page-rounded) takes all of them;
        one byte less leaves one block of experts out (units come first)."""
        d = ckpts["mixtral"]
        p0, plan0 = _place_cuda(d)
        assert p0.expert_modules >= 2
        units = sum(page_up(plan0.units[i].nbytes) for i in p0.streamed)
        big, _ = _place_cuda(d, host_gb=64 * units / GiB)
        assert big.host_expert_modules == big.expert_modules
        everything = units + big.host_expert_bytes
        p, _ = _place_cuda(d, host_gb=everything / GiB)
        assert set(p.host) == set(p0.streamed) and p.host_expert_modules == p.expert_modules
        q, _ = _place_cuda(d, host_gb=(everything - 1) / GiB)
        assert set(q.host) == set(p0.streamed) and q.host_expert_modules == q.expert_modules - 1
        assert q.host_expert_bytes < p.host_expert_bytes



def test_inspect_prints_the_placement_load_builds(dirs):
    """`tiered inspect` (place_here on this machine) and tiered.stats(model).placement (what the load built) are the
    same value, field for field, for the same options."""
    d = dirs["mixtral"]
    for kw in ({"ring_gb": 0.001, "host_gb": 0.0005}, {"ring_gb": 1.0}, {"ring_gb": 0.001, "zero_copy": False}):
        with tiered.load(d, device="cpu", **kw) as m:
            built = tiered.stats(m).placement.as_dict()
        p, _ = _place(d, "cpu", **kw)
        assert p.as_dict() == built, kw


def test_cpu_with_an_index_is_placed_as_the_cpu(dirs):
    """device="cpu:0" (or torch.device("cpu", 0)) is the CPU: the same placement as "cpu" (zero copy, resident when the
    model fits the ring), never CUDA's pieces."""
    d = dirs["llama"]
    for ring_gb in (1.0, 0.0002):  # resident; streamed (a ring of two layers, not the model)
        got = []
        for device in ("cpu", "cpu:0", torch.device("cpu", 0)):
            with tiered.load(d, device=device, ring_gb=ring_gb) as m:
                got.append({k: v for k, v in tiered.stats(m).placement.as_dict().items() if k != "device"})
        assert got[0] == got[1] == got[2], ring_gb
        assert bool(got[0]["mapped"]) == (ring_gb < 1), got[0]


def test_compute_threads_policy() -> None:
    """``compute_threads``: None leaves torch's setting; "auto" takes the cores the readers leave where units stream on
    the CPU (the readers take at most half), at least 1; a number is kept; bad values are refused naming the option."""
    assert policy.compute_threads(None, 4, 2, True) is None
    assert policy.compute_threads("auto", 4, 2, True) == 1
    assert policy.compute_threads("auto", 4, 16, True) == 12
    assert policy.compute_threads("auto", 2, 16, True) == 14
    assert policy.compute_threads("auto", 4, 1, True) == 1
    assert policy.compute_threads("auto", 4, 16, False) is None  # nothing streams on the CPU: torch left alone
    assert policy.compute_threads("auto", 4, None, True) is None  # cores unknown
    assert policy.compute_threads(3, 4, 2, True) == 3
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigError) as e:
            tiered.Options(compute_threads=bad)
        assert e.value.option == "compute_threads"


def test_compute_threads_reach_torch_and_oversubscription_is_said(ckpts, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU model that streams: ``compute_threads="auto"`` lowers torch's threads to what the readers leave (never
    raises them) and the placement says so; the default leaves torch's setting (stock's bits in the same process) and
    warns, once, when the threads oversubscribe the cores, at the caller's line (not one inside tiered)."""
    import tiered.api as api

    d = ckpts["llama"]
    before = torch.get_num_threads()
    monkeypatch.setattr(api, "usable_cores", lambda: 2)
    monkeypatch.setattr(tiered.machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(api, "_warned_oversubscribed", [False])
    try:
        torch.set_num_threads(2)
        with pytest.warns(api.OversubscribedWarning, match="compute_threads='auto' \\(here 1\\)") as w:
            m = tiered.load(d, device="cpu", ring_gb=0.0002, threads=4)
        assert [x.filename for x in w if x.category is api.OversubscribedWarning] == [__file__]  # the user's line
        with m:
            assert torch.get_num_threads() == 2 and tiered.stats(m).placement.compute_threads is None
        with tiered.load(d, device="cpu", ring_gb=0.0002, threads=4, compute_threads="auto") as m:
            assert torch.get_num_threads() == 1 == tiered.stats(m).placement.compute_threads
        torch.set_num_threads(2)
        with tiered.load(d, device="cpu", ring_gb=1, compute_threads="auto") as m:  # stays whole: torch left alone
            assert not m._tiered.streamer.streamed
            assert torch.get_num_threads() == 2 and tiered.stats(m).placement.compute_threads is None
    finally:
        torch.set_num_threads(before)


def _two_cores() -> None:
    """preexec_fn: the child runs on (at most) two of this process's CPUs, the 2-core machine the warning is about."""
    import os

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def test_demo_part_a_streams_without_oversubscribing(minilm_dir: Path) -> None:
    """`make demo`'s part (a) (all-MiniLM-L6-v2 streamed on the CPU, compared with stock bit for bit) on two cores:
    torch's default threads beside the reader threads are what OversubscribedWarning is about (checked here first),
    so the demo asks for ``compute_threads="auto"`` and nothing warns; it stays bitwise equal to stock."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    probe = subprocess.run([sys.executable, "-c", "import torch; from tiered.machine import usable_cores; "
                            "print(torch.get_num_threads(), usable_cores())"], capture_output=True, text=True,
                           timeout=120, env=env, preexec_fn=_two_cores)
    have, cores = map(int, probe.stdout.split())
    # torch's default with tiered's default 4 reader threads: the case the warning names (tiered/api.py)
    assert have + min(policy.READER_THREADS, cores // 2) > cores, (have, cores)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py"), "--skip-b", "--skip-c"], capture_output=True,
                       text=True, timeout=600, env=env, preexec_fn=_two_cores)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bitwise equal to stock transformers: True" in r.stdout, r.stdout
    assert "OversubscribedWarning" not in r.stderr and "oversubscrib" not in r.stderr.lower(), r.stderr[-3000:]
