"""The benchmark harness (benchmarks/run.py and friends) end to end on a tiny checkpoint, on the CPU.

One run of the quick suite, cut down to three systems on a ~13 MB checkpoint (tiered streamed through a
ring smaller than the model, tiered resident, stock transformers) plus the DeepSpeed row (not run on
CPU); then checks the files it writes and that the numbers are sane. Also: the cgroup runner's
OOM / timeout reporting against a fake cgroup tree, the report without matplotlib, the full plan.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import ceilings  # noqa: E402
import cgroup  # noqa: E402
import report  # noqa: E402

NEW_TOKENS = 3
RING_GB = 0.01  # 10.7 MB: smaller than the 12.6 MB checkpoint, larger than its biggest unit (4.2 MB)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out"
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "quick", "--arch", "llama-tall", "--layers", "4",
           "--scale", "0.125", "--dtype", "fp32", "--sweep-layers", "", "--ring-gb", str(RING_GB),
           "--new-tokens", str(NEW_TOKENS), "--slow-new-tokens", str(NEW_TOKENS), "--groups", "core,deepspeed",
           "--systems", "tiered,transformers,deepspeed", "--no-cold", "--no-limit", "--out-dir", str(out),
           "--cache-dir", str(tmp / "cache"), "--budget-s", "300", "--tag", "test"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    jsons = list(out.glob("*-quick-test.json"))
    assert len(jsons) == 1, list(out.iterdir())
    return {"out": out, "json": jsons[0], "res": json.loads(jsons[0].read_text()), "stderr": r.stderr}


def test_files_written(suite: dict) -> None:
    stem = suite["json"].with_suffix("")
    md = Path(f"{stem}.md").read_text()
    assert "| system |" in md and "tiered streamed" in md and "transformers (cpu)" in md
    assert Path(f"{stem}-logs.txt").is_file()
    pngs = [Path(f"{stem}-{k}.png") for k in ("rss", "spt", "gbps")]
    for p in pngs:
        assert p.is_file(), p
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 5_000 < p.stat().st_size < 200_000, (p, p.stat().st_size)
    assert suite["res"]["plots"] == [p.name for p in pngs]
    assert len(list(suite["out"].iterdir())) <= 8  # the device tool brings back at most 8 files


def test_machine_and_ceilings(suite: dict) -> None:
    res = suite["res"]
    m = res["machine"]
    assert m["cores"] >= 1 and m["ram_gib"] > 0 and m["versions"]["torch"] and m["versions"]["transformers"]
    assert m["disk"].get("mount") and m["disk"].get("fstype")
    c = res["ceilings"]
    assert c["memcpy_gbps"] > 0.1
    assert c["rounds"] == 3 and c["elapsed_s"] > 0  # the quick suite's default: 3 interleaved rounds
    for k in ("odirect_1t", "odirect_4t", "pagecache_1t", "pagecache_4t", "memcpy"):
        assert c.get(f"{k}_gbps", 0) > 0 or f"{k}_error" in c, k
        if f"{k}_gbps" in c:  # the old key is the median of the rounds, min and max beside it
            each = c[f"{k}_gbps_each"]
            assert c[f"{k}_n"] == len(each) == 3 - len(c.get(f"{k}_round_errors", [])), k
            assert c[f"{k}_gbps"] == statistics.median(each), k
            assert c[f"{k}_gbps_min"] == min(each) <= c[f"{k}_gbps"] <= max(each) == c[f"{k}_gbps_max"], k
    md = Path(f"{suite['json'].with_suffix('')}.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("**Ceilings**"))
    m = c["memcpy_gbps"], c["memcpy_gbps_min"], c["memcpy_gbps_max"], c["memcpy_n"]
    assert f"memcpy 1 thread {m[0]:.2f} ({m[1]:.2f}-{m[2]:.2f}, {m[3]} runs)" in line, line
    ck = res["checkpoints"]["main"]
    assert ck["status"] == "ok" and 12e6 < ck["bytes"] < 14e6


def test_settle_read_reads_every_byte_of_the_shards_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ceilings.settle_read` (run.py's read of a checkpoint before its first timed cold run): every byte of every
    shard read once, in slices of ``slice_bytes`` in file order, each slice's rate and the whole read's recorded; the
    report's checkpoint line gives them."""
    d = tmp_path / "ck"
    d.mkdir()
    sizes = [3 << 20, (5 << 20) + 4096, 1 << 20]
    for i, n in enumerate(sizes):
        (d / f"model-{i:05d}.safetensors").write_bytes(os.urandom(n))
    seen: list[tuple[str, int, int]] = []

    def parallel_read(reqs, threads, direct):  # every request, as the O_DIRECT pool would read it
        assert direct and threads == 2
        seen.extend((f.name, off, n) for f, off, n in reqs)
        return sum(n for _, _, n in reqs), 0.5

    monkeypatch.setattr(ceilings, "_parallel_read", parallel_read)
    r = ceilings.settle_read(d, threads=2, slice_bytes=4 << 20)
    total = sum(sizes)
    assert r["bytes"] == total and len(r["slices_gbps"]) == -(-total // (4 << 20)) == 3, r
    covered: dict[str, list[tuple[int, int]]] = {}
    for name, off, n in seen:
        covered.setdefault(name, []).append((off, off + n))
    for i, n in enumerate(sizes):  # each file read whole, no byte twice
        spans = sorted(covered[f"model-{i:05d}.safetensors"])
        gaps = [b[0] - a[1] for a, b in zip(spans[:-1], spans[1:], strict=True)]
        assert spans[0][0] == 0 and spans[-1][1] == n and not any(gaps), spans
    line = report._settle_txt(r)
    assert f"{r['gbps']:.2f} GB/s, per {4 / 1024:g} GiB: " in line, line
    assert all(f"{g:.2f}" in line for g in r["slices_gbps"]), line


def test_ceilings_measured_in_interleaved_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ceilings.measure(rounds=3)`: round 1 of every ceiling, then round 2 (in reverse order), then round 3; each
    ceiling's old key is its median, with min, max, each round and n beside it; a round that fails is left out and
    listed, a ceiling that fails every round is an error."""
    calls: list[str] = []
    rates = {"odirect_1t": [1.0, 3.0, 2.0], "odirect_4t": [4.0, 6.0, 5.0], "pagecache_1t": [7.0, 9.0, 8.0],
             "pagecache_4t": [12.0, 10.0, 11.0], "memcpy": [20.0, None, 30.0]}

    def figure(name: str) -> dict:
        r = sum(c == name for c in calls)
        calls.append(name)
        if name == "buffered_cold":
            raise OSError("no eviction here")
        v = rates[name][r]
        if v is None:
            raise RuntimeError("round failed")
        return {"gbps": v, "bytes": 100, "s": 100 / v / 1e9, "threads": 1}

    monkeypatch.setattr(ceilings, "odirect_read", lambda d, *, threads, max_bytes: figure(f"odirect_{threads}t"))
    monkeypatch.setattr(ceilings, "buffered_read", lambda d, *, threads, max_bytes, warm:
                        figure(f"pagecache_{threads}t" if warm else "buffered_cold"))
    monkeypatch.setattr(ceilings, "memcpy_gbps", lambda: figure("memcpy"))
    monkeypatch.setattr(ceilings, "_cuda_available", lambda: False)
    out = ceilings.measure("unused", max_bytes=100, threads=(1, 4), rounds=3)
    one = ["odirect_1t", "odirect_4t", "buffered_cold", "pagecache_1t", "pagecache_4t", "memcpy"]
    assert calls == one + one[::-1] + one
    assert out["rounds"] == 3
    assert (out["odirect_1t_gbps"], out["odirect_1t_gbps_min"], out["odirect_1t_gbps_max"]) == (2.0, 1.0, 3.0)
    assert out["odirect_1t_gbps_each"] == [1.0, 3.0, 2.0] and out["odirect_1t_n"] == 3
    assert out["pagecache_4t_gbps"] == 11.0 and out["pagecache_4t_gbps_max"] == 12.0
    assert out["odirect_4t_detail"]["s_each"] == pytest.approx([100 / r / 1e9 for r in (4.0, 6.0, 5.0)])
    assert out["memcpy_gbps"] == 25.0 and out["memcpy_n"] == 2 and out["memcpy_gbps_each"] == [20.0, 30.0]
    assert out["memcpy_round_errors"] == ["round 1: RuntimeError: round failed"] and "memcpy_error" not in out
    assert out["buffered_cold_error"] == "OSError: no eviction here" and "buffered_cold_gbps" not in out
    assert not any(k.endswith("_gbps") and k.startswith("buffered_cold") for k in out)
    with pytest.raises(ValueError):
        ceilings.measure("unused", rounds=0)


def _ceilings_3_rounds() -> dict:
    """Ceilings as ceilings.py writes them (page cache: 3 rounds) and as a file from before the rounds wrote them
    (O_DIRECT: one measurement, no min/max/n)."""
    return {"max_bytes": 1 << 29, "rounds": 3,
            "pagecache_1t_gbps": 7.0, "pagecache_1t_gbps_min": 6.0, "pagecache_1t_gbps_max": 8.0,
            "pagecache_1t_gbps_each": [6.0, 8.0, 7.0], "pagecache_1t_n": 3,
            "pagecache_4t_gbps": 10.0, "pagecache_4t_gbps_min": 9.0, "pagecache_4t_gbps_max": 11.0,
            "pagecache_4t_gbps_each": [9.0, 11.0, 10.0], "pagecache_4t_n": 3,
            "odirect_1t_gbps": 1.0, "memcpy_gbps": 12.0, "memcpy_gbps_min": 11.5, "memcpy_gbps_max": 12.5,
            "memcpy_n": 2, "buffered_cold_error": "OSError: x"}


def test_report_holds_each_figure_against_its_ceilings_max() -> None:
    """A figure between its ceiling's median and max is a share of the max; one above the max is flagged, never
    excused (the old allowance of 15% over a one-measurement ceiling is gone); ceilings print as median (min-max,
    n runs)."""
    c = _ceilings_3_rounds()
    warm = {"system": "accelerate", "cache": "warm", "io": "mmap", "model_gb": 0.6, "status": "ok"}
    assert report.ceiling_for(warm, c, "decode") == (11.0, "pagecache_4t")  # the highest max, not the median
    assert report._eff({**warm, "decode_gbps": 10.5}, c, "decode_gbps", "decode") == "10.50 (95% of pagecache 4t max)"
    assert report._eff({**warm, "decode_gbps": 11.2}, c, "decode_gbps", "decode") == \
        "**11.20 (above pagecache 4t max: 102%)**"
    cold = {**warm, "system": "transformers", "cache": "cold", "load_gbps": 1.03}
    assert report._eff(cold, c, "load_gbps", "load") == "**1.03 (above odirect 1t max: 103%; lazy load?)**"
    assert report._eff({**cold, "load_gbps": 0.9}, c, "load_gbps", "load") == "0.90 (90% of odirect 1t max)"
    tiered = {**warm, "system": "tiered", "read_gbps": 11.5, "h2d_gbps": None, "stats_total": {}}
    assert report._stage(tiered, c) == "**11.50 (above pagecache 4t max 11.00)** / –"
    assert report._stage({**tiered, "read_gbps": 10.9}, c) == "10.90 / –"
    assert report.ceiling_text(c, "pagecache_4t") == "10.00 (9.00-11.00, 3 runs)"
    assert report.ceiling_text(c, "odirect_1t") == "1.00 (1.00-1.00, 1 run)"
    assert report.ceiling_text(c, "buffered_cold") is None
    res = {"suite": "quick", "date": "2026-12-03T00:00:00", "machine": {"versions": {}, "disk": {}}, "ceilings": c,
           "runs": [{**tiered, "key": "main/tiered-streamed/original/mmap/warm", "label": "tiered streamed",
                     "decode_gbps": 10.2}]}
    md = report.markdown(res)
    line = next(ln for ln in md.splitlines() if ln.startswith("**Ceilings**"))
    assert "page cache 1 thread 7.00 (6.00-8.00, 3 runs); page cache 4 threads 10.00 (9.00-11.00, 3 runs)" in line
    assert "O_DIRECT 1 thread 1.00 (1.00-1.00, 1 run)" in line and "memcpy 1 thread 12.00 (11.50-12.50, 2 runs)" in line
    assert "buffered cold: OSError: x" in line
    row = next(ln for ln in md.splitlines() if ln.startswith("| tiered streamed |"))
    assert "| 10.20 (93% of pagecache 4t max) | **11.50 (above pagecache 4t max 11.00)** / – |" in row, row


def test_rows_sane(suite: dict) -> None:
    rows = {r["key"]: r for r in suite["res"]["runs"]}
    streamed = rows["main/tiered-streamed/original/mmap/warm"]
    resident = rows["main/tiered-resident/original/mmap/warm"]
    stock = rows["main/transformers-cpu/original/mmap/warm"]
    ds = rows["main/deepspeed-zero3-offload/original/mmap/warm"]
    for r in (streamed, resident, stock):
        assert r["status"] == "ok", (r["key"], r["status"], suite["stderr"][-2000:])
        assert r["tokens"] == NEW_TOKENS and len(r["tokens_out"]) == NEW_TOKENS
        assert r["tokens_match"] is True
        assert 0 < r["load_s"] < 120 and 0 < r["ttft_s"] < 60
        assert 0 < r["decode_s_per_token_median"] < 10 and r["tokens_per_s"] > 0.1
        assert 0.05 < r["rss_base_gb"] < r["peak_rss_gb"] < 8
        assert r["peak_rss_gb"] - r["rss_base_gb"] == pytest.approx(r["peak_rss_over_base_gb"])
        assert r["ru_maxrss_gb"] >= r["peak_rss_gb"] - 0.01  # the kernel's VmHWM record agrees
        assert r["child"]["status"] == "ok" and r["child"]["cgroup"] is None
    model_gb = streamed["model_gb"]
    assert streamed["resident_units"] == 0 and streamed["units"] >= 6
    # every pass streams every unit but the embedding through the ring, and the embedding's looked-up rows;
    # the cyclic lookahead may also have read the next pass's first units
    assert streamed["row_units"] == 1 and 0 < streamed["embedding_gb"] < model_gb - streamed["ring_units_gb"]
    assert streamed["ring_units_gb"] * 0.95 < streamed["streamed_gb_per_token"] < model_gb * 1.5
    assert streamed["read_gbps"] > 0 and streamed["decode_gbps"] > 0
    assert resident["resident_units"] == resident["units"] and resident["streamed_gb_per_token"] == 0
    assert resident["opts"]["ring_gb"] * (1 << 30) > model_gb * 1e9
    assert stock["streamed_gb_per_token"] == 0
    assert ds["status"].startswith("not run")


def test_report_without_matplotlib(suite: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    made, note = report.plots(suite["res"], tmp_path / "x")
    assert made == [] and "matplotlib" in note
    assert "| tiered streamed |" in report.markdown(suite["res"])


def _fake_cgroup_tree(tmp_path: Path) -> Path:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_cgroup_oom_reported(tmp_path: Path) -> None:
    """A child that the 'kernel' OOM-kills (simulated: memory.events says oom_kill 1, then SIGKILL)."""
    root = _fake_cgroup_tree(tmp_path)
    code = ("import glob, os, signal\n"
            f"g = glob.glob({str(root)!r} + '/tiered-bench-*')[0]\n"
            "open(g + '/memory.events', 'w').write('low 0\\nhigh 0\\nmax 3\\noom 1\\noom_kill 1\\n')\n"
            "open(g + '/memory.peak', 'w').write(str(256 << 20))\n"
            "x = bytearray(64 << 20)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = cgroup.run_child([sys.executable, "-c", code], timeout_s=60, mem_limit_bytes=256 << 20, cgroup_parent=root)
    assert r.status == "OOM-killed at limit 0.25 GiB" and r.oom_killed and r.returncode == -9
    assert r.ru_maxrss_bytes > 64 << 20
    assert r.cgroup["memory_peak"] == 256 << 20 and r.cgroup["events"]["oom_kill"] == 1
    (group,) = root.glob("tiered-bench-*")  # a fake tree keeps its files; a real one is removed
    assert (group / "memory.max").read_text() == str(256 << 20)
    assert (group / "cgroup.procs").read_text() == "0"  # the child moved itself in before exec
    assert (root / "cgroup.subtree_control").read_text() == "+memory"


@pytest.mark.skipif(os.geteuid() != 0, reason="creating cgroups needs root")
def test_cgroup_v1_group_reads_like_v2(tmp_path: Path) -> None:
    """A cgroup v1 memory hierarchy (fake tree): the limit goes to memory.limit_in_bytes (and memsw: no swap), and
    read() gives v2's keys: the peak from max_usage_in_bytes, max events from failcnt, oom_kill from oom_control."""
    root = tmp_path / "memory"
    root.mkdir()
    cg = cgroup.MemoryCgroup(1 << 30)
    path = cg._create_v1(root)
    assert cg.v1 and (path / "memory.limit_in_bytes").read_text() == str(1 << 30)
    (path / "memory.max_usage_in_bytes").write_text(str(700 << 20))
    (path / "memory.usage_in_bytes").write_text(str(600 << 20))
    (path / "memory.failcnt").write_text("12\n")
    (path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    got = cg.read()
    assert got["memory_peak"] == 700 << 20 and got["memory_current"] == 600 << 20
    assert got["events"] == {"max": 12, "oom_kill": 1}


def test_cgroup_v2_read_reports_reclaim_and_pressure(tmp_path: Path) -> None:
    """A v2 group (fake tree): read() gives memory.stat's major faults and file refaults and memory.pressure's
    stall totals in seconds, beside the peak and the events."""
    cg = cgroup.MemoryCgroup(1 << 30)
    cg.path, cg.v1 = tmp_path, False
    (tmp_path / "memory.peak").write_text(str(900 << 20))
    (tmp_path / "memory.current").write_text(str(800 << 20))
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 37\noom 0\noom_kill 0\n")
    (tmp_path / "memory.stat").write_text("anon 123\nfile 456\npgmajfault 789\nworkingset_refault_file 1011\n"
                                          "workingset_refault_anon 0\n")
    (tmp_path / "memory.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=2500000\n"
                                              "full avg10=0.00 avg60=0.00 avg300=0.00 total=1250000\n")
    got = cg.read()
    assert got["memory_peak"] == 900 << 20 and got["events"]["max"] == 37
    assert got["stat"] == {"pgmajfault": 789, "workingset_refault_file": 1011, "workingset_refault_anon": 0,
                           "file": 456, "anon": 123}
    assert got["pressure_some_s"] == 2.5 and got["pressure_full_s"] == 1.25


def test_cgroup_unavailable_and_timeout(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu pids\n")
    r = cgroup.run_child(["true"], timeout_s=10, mem_limit_bytes=1 << 30, cgroup_parent=root)
    assert r.status.startswith("not run: cgroup memory limit unavailable") and r.returncode is None
    r = cgroup.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert r.timed_out and r.status == "timeout after 0.5 s" and r.returncode == -9
    assert r.wall_s < 10


def test_full_plan_lists_without_cuda() -> None:
    r = subprocess.run([sys.executable, str(BENCH / "run.py"), "--suite", "full", "--list"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    keys = [line.split()[1] for line in r.stdout.splitlines()]
    for k in ("main/tiered-streamed/original/mmap/warm", "main/tiered-resident/original/mmap/warm",
              "main/transformers-cuda/original/mmap/warm", "main/accelerate-disk-offload/original/mmap/warm",
              "main/tiered-streamed/original/mmap/cold/limit", "main/accelerate-disk-offload/original/mmap/cold/limit",
              "main/tiered-streamed/resharded/mmap/warm", "main/deepspeed-zero3-offload/original/mmap/warm"):
        assert k in keys, k
    assert "'ring_gb': 1.0, 'gpu_gb': 2.0" in r.stdout


def test_repeat_runs_rounds_in_alternating_order_and_reports_medians() -> None:
    """`run.py --repeat 3`: each selected run three times, in rounds whose order alternates (drift hits all alike),
    and the report gives each run's median over its rounds and accelerate's median divided by it."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--groups", "limit,io",
           "--runs", "main/accelerate-*,main/tiered-streamed/original/direct/cold/limit", "--repeat", "3", "--list"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    keys = [line.split()[1] for line in r.stdout.splitlines()]
    acc, tie = "main/accelerate-disk-offload/original/mmap/cold/limit", "main/tiered-streamed/original/direct/cold/limit"
    assert keys == [f"{acc}#1", f"{tie}#1", f"{tie}#2", f"{acc}#2", f"{acc}#3", f"{tie}#3"]
    runs = []
    for key, spt in ((f"{acc}#1", 6.0), (f"{tie}#1", 5.0), (f"{tie}#2", 4.0), (f"{acc}#2", 7.0), (f"{acc}#3", 6.5),
                     (f"{tie}#3", 6.0)):
        runs.append({"key": key, "label": key.split("/")[1], "status": "ok", "decode_s_per_token_median": spt})
    runs[-1]["status"] = "failed (exit 1)"  # a failed round is left out of the median
    md = "\n".join(report._repeats(runs))
    line = next(ln for ln in md.splitlines() if ln.startswith("| tiered-streamed (main: "))
    assert "| 2/3 |" in line and "| 4.500 |" in line, line  # median of 5.0 and 4.0
    assert "1.44×" in line, line  # accelerate's median 6.5 / 4.5
    acc_line = next(ln for ln in md.splitlines() if ln.startswith("| accelerate-disk-offload (main: "))
    assert "| 6.500 |" in acc_line and acc_line.endswith("| – |"), acc_line


def test_repeat_ratio_compares_with_accelerate_on_the_same_checkpoint() -> None:
    """A sweep checkpoint's row is divided by its own accelerate median, not the main checkpoint's, and says which
    checkpoint it is (found by an adversarial review)."""

    def row(key: str, spt: float) -> dict:
        return {"key": key, "label": key.split("/")[1], "status": "ok", "decode_s_per_token_median": spt}

    runs = [row("main/accelerate-disk-offload/original/mmap/warm#1", 1.0),
            row("main/tiered-streamed/original/mmap/warm#1", 0.5),
            row("L14/accelerate-disk-offload/original/mmap/warm#1", 4.0),
            row("L14/tiered-streamed/original/mmap/warm#1", 2.0)]
    lines = report._repeats(runs)
    l14 = [ln for ln in lines if ln.startswith("| tiered-streamed (L14: ")]
    main = [ln for ln in lines if ln.startswith("| tiered-streamed (main: ")]
    assert len(l14) == 1 and "| 2.00× |" in l14[0], l14  # L14's accelerate 4.0 / 2.0
    assert len(main) == 1 and "| 2.00× |" in main[0], main  # main's 1.0 / 0.5


def test_scaling_plans_each_limit_and_reports_per_limit_medians(tmp_path: Path) -> None:
    """`run.py --scaling 2,none --repeat 2`: tiered with its defaults (no ring_gb/host_gb, io auto) and accelerate
    with max_memory cpu = limit - 1.2 GiB on CUDA, at each cgroup limit and with none, in alternating rounds; the
    report's scaling table gives per-limit medians over the rounds and accelerate's median divided by tiered's, and a
    failed round is left out; the scaling plot is written."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--gpu-gb", "3",
           "--scaling", "2,none", "--repeat", "2", "--list"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = [ln.split(None, 2) for ln in r.stdout.splitlines()]
    assert {ln[0] for ln in lines} == {"scaling"} and len(lines) == 8, r.stdout
    t2, a2 = "main/tiered-defaults/original/auto/cold/limit2", "main/accelerate-disk-offload/original/mmap/cold/limit2"
    tn, an = "main/tiered-defaults/original/auto/cold/nolimit", "main/accelerate-disk-offload/original/mmap/cold/nolimit"
    assert [ln[1] for ln in lines] == [f"{t2}#1", f"{a2}#1", f"{tn}#1", f"{an}#1", f"{an}#2", f"{tn}#2", f"{a2}#2",
                                       f"{t2}#2"]
    assert "'ring_gb': None" in lines[0][2] and "'cpu_gb': 0.8" in lines[1][2], lines[:2]

    def row(system: str, lim: float, spt: float, status: str = "ok") -> dict:
        return {"key": f"main/{system}-x/original/io/cold/limit{lim:g}#1", "group": "scaling", "system": system,
                "mem_gb": lim, "status": status, "decode_s_per_token_median": spt, "streamed_gb_per_token": 1.0,
                "peak_rss_over_base_gb": 1.0, "ring_gb_used": 0.5 if system == "tiered" else None,
                "host_gb_used": 0.25 if system == "tiered" else None, "label": system}

    runs = [row("tiered", 2, 3.0), row("tiered", 2, 5.0), row("tiered", 2, 1.0, "killed (OOM)"),
            row("accelerate", 2, 8.0), row("tiered", 0, 0.5), row("accelerate", 0, 1.0)]
    md = "\n".join(report._scaling(runs))
    t = next(ln for ln in md.splitlines() if ln.startswith("| 2 GiB | tiered |"))
    assert "3.000, 5.000 (killed (OOM))" in t and "| 4.000 | 2.00× |" in t and "0.50 + 0.25" in t, t
    assert next(ln for ln in md.splitlines() if ln.startswith("| none | tiered |")).count("2.00×") == 1
    made, note = report.plots({"suite": "s", "date": "2026-12-02", "runs": runs}, tmp_path / "x")
    assert note is not None or any(p.name == "x-scaling.png" and p.stat().st_size > 0 for p in made)


def _result_file(path: Path, date: str, arch: str, dtype: str, layers: int, runs: list[dict]) -> Path:
    """A ``run.py`` result file in the layout run.py writes (cut to the keys the reports read), on an H200."""
    res = {"suite": "quick", "date": date, "machine_label": "h200",
           "machine": {"gpus": ["NVIDIA H200, 143771 MiB, 580.159.04"], "cpu": "Intel(R) Xeon(R) Processor",
                       "drop_caches_permitted": True, "tiered_commit": "abc1234"},
           "config": {"arch": arch, "dtype": dtype, "layers": layers, "scale": 1.0, "max_shard_size": "200MB"},
           "cgroup": {"available": True}, "notes": [], "ceilings": {},
           "checkpoints": {"main": {"arch": arch, "dtype": dtype, "layers": layers, "scale": 1.0, "quant": None,
                                    "max_shard_size": "200MB", "bytes": 12_101_798_312}},
           "runs": runs}
    path.write_text(json.dumps(res))
    return path



def test_scaling_io_forces_the_read_backend_beside_the_defaults_and_is_held_against_accelerate(tmp_path: Path) -> None:
    """`run.py --scaling 2 --scaling-io direct,pread`: beside tiered's defaults (io auto) and accelerate, tiered's
    defaults with io forced to each backend at the same limit, in the same alternating rounds (group scaling-io, so the
    scaling table keeps one tiered row per limit); the rounds table holds each against accelerate at that limit; an
    unknown backend and --scaling-io without --scaling are refused."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--gpu-gb", "3",
           "--scaling", "2", "--scaling-io", "direct,pread", "--repeat", "2", "--list"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = [ln.split(None, 2) for ln in r.stdout.splitlines()]
    base = "main/tiered-defaults/original/{}/cold/limit2"
    acc = "main/accelerate-disk-offload/original/mmap/cold/limit2"
    first = [base.format("auto"), acc, base.format("direct"), base.format("pread")]
    assert [ln[1] for ln in lines] == [f"{k}#1" for k in first] + [f"{k}#2" for k in first[::-1]], r.stdout
    assert [ln[0] for ln in lines[:4]] == ["scaling", "scaling", "scaling-io", "scaling-io"]
    assert all("'ring_gb': None" in ln[2] for ln in lines if "tiered" in ln[1]), r.stdout

    def rec(key: str, group: str, spt: float) -> dict:
        return {"key": key, "group": group, "system": key.split("/")[1].split("-")[0], "mem_gb": 2.0, "status": "ok",
                "decode_s_per_token_median": spt, "label": key}
    runs = [rec(f"{base.format('auto')}#1", "scaling", 8.0), rec(f"{acc}#1", "scaling", 9.0),
            rec(f"{base.format('pread')}#1", "scaling-io", 7.5), rec(f"{base.format('pread')}#2", "scaling-io", 6.5),
            rec(f"{acc}#2", "scaling", 7.0), rec(f"{base.format('auto')}#2", "scaling", 10.0)]
    rows = report.scaling_rows(runs)
    assert [(x["system"], x["each"]) for x in rows] == [("accelerate", [9.0, 7.0]), ("tiered", [8.0, 10.0])]
    table = "\n".join(report._repeats(runs))
    pread = next(ln for ln in table.splitlines() if "/pread/" in ln)
    assert "| 7.000 |" in pread and f"{8.0 / 7.0:.2f}×" in pread, table
    for bad in (["--scaling-io", "odirect"], []):
        cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--list",
               *(["--scaling", "2"] if bad else []), *(bad or ["--scaling-io", "pread"])]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2 and "--scaling-io" in r.stderr, r.stderr


@pytest.mark.parametrize(("flag", "variant", "switch"), [
    ("--scaling-pieces-ring", "pieces-ring", "auto_ring_in_pieces"),  # the A/B of tiered.policy.PIECE_RING_BYTES
    ("--scaling-pieces-cut", "pieces-cut", "pieces_when_one_fits"),  # of tiered.policy.PIECES_WHEN_ONE_FITS
    ("--scaling-head-pieces", "head-pieces", "head_in_ring_pieces"),  # of tiered.policy.HEAD_IN_RING_PIECES
])
def test_scaling_pieces_variants_run_beside_the_defaults(flag: str, variant: str, switch: str) -> None:
    """`run.py --scaling 2 --scaling-pieces-ring` (the automatic ring of pieces) and `--scaling-pieces-cut` (units the
    ring holds once read in pieces): tiered's defaults with the switch the child sets in tiered.policy from the spec,
    in the same rounds as the defaults, in group scaling-io; without --scaling each is refused."""
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--gpu-gb", "3",
           "--scaling", "2", flag, "--repeat", "2", "--list"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = [ln.split(None, 2) for ln in r.stdout.splitlines()]
    key = f"main/tiered-defaults-{variant}/original/auto/cold/limit2"
    assert [ln[1] for ln in lines].count(f"{key}#1") == 1 and f"{key}#2" in [ln[1] for ln in lines], r.stdout
    row = next(ln for ln in lines if ln[1] == f"{key}#1")
    assert row[0] == "scaling-io" and f"'{switch}': True" in row[2] and "'ring_gb': None" in row[2], row
    assert f'"{switch}" in spec.extra' in (BENCH / "systems.py").read_text()  # the child applies it
    import run

    assert switch in run.SPEC_EXTRA  # and the spec carries it there (the twenty-third session's A/B lost it)
    r = subprocess.run([sys.executable, str(BENCH / "run.py"), "--suite", "full", "--device", "cuda", "--list", flag],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and f"{flag} needs --scaling" in r.stderr, r.stderr


def test_every_switch_the_child_reads_is_one_run_py_passes() -> None:
    """run.py passes a run's options in its spec's ``extra`` only where the key is in ``run.SPEC_EXTRA``; systems.py
    applies each ``"key" in spec.extra``. Both lists are the same (but twins.py's own ``merge_staged_reads``), so no
    A/B switch is dropped on the way to the child, as ``pieces_when_one_fits`` was."""
    import re

    import run

    src = (BENCH / "systems.py").read_text()
    read = set(re.findall(r'"(\w+)" in spec\.extra', src))
    read |= set(re.findall(r'"(\w+)"', re.search(r"^LOAD_EXTRA = \(([^)]*)\)", src, re.M).group(1)))
    assert read - {"merge_staged_reads"} == set(run.SPEC_EXTRA), (read, run.SPEC_EXTRA)


def _run(group: str, system: str, lim: float, spt: float | None, n: int, status: str = "ok", *, cache: str = "cold",
         variant: str | None = None, tokens_match: bool = True) -> dict:
    """One run record as run.py writes it: group scaling (``mem_gb``, key ``.../limitL#n`` or ``.../nolimit#n``) or
    limit (``mem_gb`` None, key ``.../limit#n``); ``lim`` 0: no cgroup limit."""
    variant = variant or ("defaults" if system == "tiered" else "disk-offload")
    tag = ("limit" if group != "scaling" else f"limit{lim:g}" if lim else "nolimit") + f"#{n}"
    r = {"key": f"main/{system}-{variant}/original/{'auto' if system == 'tiered' else 'mmap'}/{cache}/{tag}",
         "label": system, "group": group, "system": system, "variant": variant, "ckpt": "main", "layout": "original",
         "cache": cache, "limit": bool(lim), "mem_gb": lim if group == "scaling" else None,
         "mem_limit_gb": lim or None, "opts": {"gpu_gb": 3.0} | ({"ring_gb": None} if system == "tiered" else
                                                                 {"cpu_gb": round(max(lim - 1.2, 0.25), 2)}),
         "status": status, "decode_s_per_token_median": spt, "streamed_gb_per_token": 9.0 + n / 10,
         "decode_gbps": 1.0 + n / 10, "peak_rss_over_base_gb": 1.5 + n / 100, "cgroup_peak_gb": lim or None,
         "tokens_match": tokens_match if status == "ok" else None}
    if system == "tiered":
        r |= {"ring_gb_used": 0.5 + n / 100, "host_gb_used": 0.25}
    return r


def _md_row(md: str, file: str, limit: str) -> list[str]:
    """The cells of the merged table's one row of ``file`` at ``limit``."""
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in md.splitlines() if f"`{file}`" in ln]
    rows = [c for c in rows if c[1] == limit]
    assert len(rows) == 1, (file, limit, md)
    return rows[0]


def test_scaling_report_merges_invocations_with_ratios_only_within_a_file(tmp_path: Path) -> None:
    """benchmarks/scaling_report.py merges the scaling benchmark run over several invocations: per (checkpoint, limit,
    file) the medians over each system's ok rounds, accelerate ÷ tiered only from runs of the same file (blank for a
    file holding one system; a (checkpoint, limit) in two files gives two rows), runs of other groups, variants or a
    warm cache left out, the limits still missing of 2, 4, 8, 16, none per checkpoint, and the plot."""
    a = _result_file(tmp_path / "a-gptj-scaling-4g.json", "2026-12-03T17:01:29+00:00", "gptj-6b", "fp16", 28, [
        _run("scaling", "tiered", 4, 6.0, 1), _run("scaling", "accelerate", 4, 9.0, 1),
        _run("scaling", "accelerate", 4, 8.1, 2), _run("scaling", "tiered", 4, 7.5, 2),
        _run("scaling", "tiered", 4, 6.6, 3), _run("scaling", "accelerate", 4, None, 3, "failed (exit 1)"),
        # not taken: another variant, another group (the cold group's accelerate: max_memory cpu = the ring), warm
        _run("io", "tiered", 4, 0.5, 1, variant="streamed"), _run("cold", "accelerate", 0, 50.0, 1),
        _run("scaling", "tiered", 4, 0.7, 4, cache="warm")])
    b = _result_file(tmp_path / "b-gptj-2g.json", "2026-12-02T01:17:57+00:00", "gptj-6b", "fp16", 28, [
        _run("limit", "tiered", 2, 5.0, 1), _run("limit", "accelerate", 2, 7.0, 1)])
    c = _result_file(tmp_path / "c-gptj-4g-tiered-only.json", "2026-12-04T09:00:00+00:00", "gptj-6b", "fp16", 28, [
        _run("limit", "tiered", 4, 3.0, 1)])
    d = _result_file(tmp_path / "d-llama-scaling.json", "2026-12-02T03:54:24+00:00", "llama3-8b", "bf16", 32, [
        _run("scaling", "tiered", 0, 2.0, 1), _run("scaling", "accelerate", 0, 3.3, 1),
        _run("scaling", "tiered", 0, 2.4, 2), _run("scaling", "tiered", 2, 4.0, 1),
        _run("scaling", "accelerate", 2, 4.4, 1, tokens_match=False),
        _run("scaling", "tiered", 8, None, 1, "killed (OOM)"), _run("scaling", "accelerate", 8, 1.9, 1)])
    out = tmp_path / "merged" / "scaling"
    r = subprocess.run([sys.executable, str(BENCH / "scaling_report.py"), str(a), str(b), str(c), str(d), "--out",
                        str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    md = Path(f"{out}.md").read_text()
    # columns: 0 checkpoint, 1 limit, 2 machine, 3 file, 4/5 tiered each/median, 6/7 accelerate each/median, 8 ratio
    ra = _md_row(md, a.name, "4 GiB")
    assert ra[0] == "gptj-6b fp16 L28" and "h200 (NVIDIA H200), 2026-12-03 17:01" in ra[2], ra
    assert ra[4] == "6.000, 7.500, 6.600" and ra[5] == "6.600", ra  # the warm 0.7 and io-group 0.5 are not taken
    assert ra[6] == "9.000, 8.100 (failed (exit 1))" and ra[7] == "8.550", ra  # the failed round is not in the median
    assert ra[8] == "1.30×", ra  # 8.55 / 6.6, this file's runs only
    assert ra[14] == "0.52 + 0.25" and ra[15] == "2.8" and ra[16] == "yes (5 rounds)", ra
    assert _md_row(md, b.name, "2 GiB")[8] == "1.40×"  # 7.0 / 5.0
    rc = _md_row(md, c.name, "4 GiB")
    assert rc[5] == "3.000" and rc[7] == "–" and rc[8] == "", rc  # one system in the file: no ratio
    assert "2.85×" not in md and "2.70×" not in md  # never file a's accelerate over file c's tiered (or any pool)
    assert not [ln for ln in md.splitlines() if ln.startswith("| gptj-6b fp16 L28 | none |")]  # the cold group's
    rn = _md_row(md, d.name, "none")
    assert rn[0] == "llama3-8b bf16 L32" and rn[5] == "2.200" and rn[7] == "3.300" and rn[8] == "1.50×", rn
    assert _md_row(md, d.name, "2 GiB")[16].startswith("**no**"), md  # a round whose greedy ids differ
    r8 = _md_row(md, d.name, "8 GiB")
    assert r8[4] == "(killed (OOM))" and r8[7] == "1.900" and r8[8] == "", r8
    # order: checkpoint, then limit (none last), then date
    order = [(c[0], c[1], c[3]) for c in ([x.strip() for x in ln.split("|")[1:-1]] for ln in md.splitlines()
                                           if ln.startswith("| gptj") or ln.startswith("| llama"))]
    assert order == [("gptj-6b fp16 L28", "2 GiB", f"`{b.name}`"), ("gptj-6b fp16 L28", "4 GiB", f"`{a.name}`"),
                     ("gptj-6b fp16 L28", "4 GiB", f"`{c.name}`"), ("llama3-8b bf16 L32", "2 GiB", f"`{d.name}`"),
                     ("llama3-8b bf16 L32", "8 GiB", f"`{d.name}`"), ("llama3-8b bf16 L32", "none", f"`{d.name}`")]
    assert ("* gptj-6b fp16 L28 (`gptj-6b-fp16-L28-200MB`, 12.10 GB): still missing of 2, 4, 8, 16, none: "
            "8 GiB, 16 GiB, none") in md.splitlines(), md
    assert ("* llama3-8b bf16 L32 (`llama3-8b-bf16-L32-200MB`, 12.10 GB): still missing of 2, 4, 8, 16, none: "
            "4 GiB, 8 GiB, 16 GiB (one system only: 8 GiB)") in md.splitlines(), md
    png = Path(f"{out}.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    assert "![memory scaling](scaling.png)" in md


def test_fp8_checkpoints_run_against_stocks_dequantized_model(tmp_path: Path) -> None:
    """`run.py --quant fp8` (issue 24): the checkpoint is written in block FP8, tiered streams it, transformers loads
    it dequantized (FineGrainedFP8Config(dequantize=True)), and the greedy tokens agree."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "run.py"), "--suite", "quick", "--arch", "llama-tall", "--layers", "2",
           "--scale", "0.125", "--dtype", "bf16", "--quant", "fp8", "--sweep-layers", "", "--ring-gb", "0.01",
           "--new-tokens", "3", "--slow-new-tokens", "3", "--groups", "core", "--systems", "tiered,transformers",
           "--runs", "main/tiered-streamed/*,main/transformers-cpu/*", "--no-cold", "--no-limit", "--no-plots",
           "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--budget-s", "300", "--tag", "fp8"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(next(out.glob("*-quick-fp8.json")).read_text())
    ck = next(iter((tmp_path / "cache").glob("llama-tall-bf16-fp8-*")))
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    runs = {x["key"]: x for x in res["runs"]}
    assert set(runs) == {"main/tiered-streamed/original/mmap/warm", "main/transformers-cpu/original/mmap/warm"}
    assert all(x["status"] == "ok" and x["tokens_match"] for x in runs.values()), runs
    assert "fp8 (stock: dequantized at load)" in next(out.glob("*-quick-fp8.md")).read_text()


def _fake_twins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Two stand-in checkpoint directories (a config.json each) that ``twins._make`` returns instead of writing
    checkpoints: ``{"twin": ..., "q": ...}``."""
    import twins

    ck = {}
    for name in ("twin", "q"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"vocab_size": 97}))
        ck[name] = d
    monkeypatch.setattr(twins, "_make", lambda args, quant: ck["q" if quant else "twin"])
    return ck


def test_twins_variants_run_in_every_round_and_report_their_own_rows(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``twins.py --prefetch 2,5 --threads auto,4``: every combination runs in every round (reversed on odd rounds)
    and gets its own summary row, whose speed-up is that variant's twin median over its quantized median."""
    import twins

    ck = _fake_twins(tmp_path, monkeypatch)
    ran: list[tuple] = []

    def fake_s(spec: dict, r: int) -> float:  # a figure that differs per twin, variant and round
        return (1.0 if spec["model_dir"] == str(ck["twin"]) else 0.5) * spec["prefetch"] + (spec["threads"] or 0) + r / 10

    def fake_run(args, work, spec, limit):
        r = sum(1 for x in ran if x[:3] == (spec["model_dir"], spec["prefetch"], spec["threads"]))
        ran.append((spec["model_dir"], spec["prefetch"], spec["threads"]))
        return {"status": "ok", "decode_s_per_token_median": fake_s(spec, r)}

    monkeypatch.setattr(twins, "_run", fake_run)
    out = tmp_path / "out"
    assert twins.main(["--device", "cpu", "--modes", "warm", "--rounds", "2", "--prefetch", "2,5", "--threads",
                       "auto,4", "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)]) == 0
    combos = [(p, t) for p in (2, 5) for t in (None, 4)]
    first = [(str(ck[w]), p, t) for p, t in combos for w in ("twin", "q")]
    assert ran == first + first[::-1]
    (js,) = out.glob("*-twins-*.json")
    summary = json.loads(js.read_text())["summary"]
    assert set(summary) == {f"warm pf{p} t{t or 'auto'}" for p, t in combos}
    for p, t in combos:
        row = summary[f"warm pf{p} t{t or 'auto'}"]
        twin = [fake_s({"model_dir": str(ck["twin"]), "prefetch": p, "threads": t}, r) for r in (0, 1)]
        quant = [fake_s({"model_dir": str(ck["q"]), "prefetch": p, "threads": t}, r) for r in (0, 1)]
        assert row["speedup"] == pytest.approx(statistics.median(twin) / statistics.median(quant))
    (md,) = out.glob("*-twins-*.md")
    assert "| warm pf5 t4 |" in md.read_text()
    with pytest.raises(SystemExit):
        twins.main(["--prefetch", "0", "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)])


def test_twins_merge_reads_is_a_variant_that_reaches_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``twins.py --merge-reads off,on``: both run in every round, each tiered spec carries its
    ``merge_staged_reads`` (which systems.py sets as tiered.experts.MERGE_STAGED_READS), the rows are labelled by it;
    a value other than on/off is refused."""
    import twins

    ck = _fake_twins(tmp_path, monkeypatch)
    seen: list[tuple] = []

    def fake_run(args, work, spec, limit):
        seen.append((spec["model_dir"], spec["extra"]["merge_staged_reads"]))
        return {"status": "ok", "decode_s_per_token_median": 1.0 + spec["extra"]["merge_staged_reads"]}

    monkeypatch.setattr(twins, "_run", fake_run)
    out = tmp_path / "out"
    assert twins.main(["--device", "cpu", "--modes", "cold", "--rounds", "2", "--merge-reads", "off,on",
                       "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)]) == 0
    first = [(str(ck[w]), m) for m in (False, True) for w in ("twin", "q")]
    assert seen == first + first[::-1]
    (js,) = out.glob("*-twins-*.json")
    assert set(json.loads(js.read_text())["summary"]) == {"cold merge-off", "cold merge-on"}
    assert "merge_staged_reads" in (BENCH / "systems.py").read_text()
    with pytest.raises(SystemExit):
        twins.main(["--merge-reads", "maybe", "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)])


def _exp3_pair(tmp: Path) -> tuple[Path, Path]:
    """A small bf16 checkpoint and its ``reshard --compress --codec exp3`` (tensors small enough to code in chunks)."""
    import tiered
    from tiered import lossless

    plain, coded = tmp / "plain", tmp / "exp3"
    subprocess.run([sys.executable, str(BENCH / "make_checkpoint.py"), "--arch", "llama-tall", "--layers", "2",
                    "--scale", "0.25", "--quiet", str(plain)], check=True, timeout=300, cwd=REPO)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
        mp.setattr(lossless, "DEFAULT_CHUNK_BYTES", 64 << 10)
        tiered.reshard(plain, coded, compress="exp3", quiet=True)
    try:  # O_DIRECT: both scripts read that way
        os.close(os.open(next(plain.glob("*.safetensors")), os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    return plain, coded


def test_read_requests_and_read_trace_run_and_report(tmp_path: Path) -> None:
    """The two cold-read diagnostics (issue 25, eighth session) on a small exp3 pair: read_requests.py reports every
    variant (disk request sizes, the reader's plain and exp3 paths, whose exp3 runs grow with RAW_READ) with a rate;
    read_trace.py times the reads of CPU decode steps (requests seen, the disk busy part of the window)."""
    plain, coded = _exp3_pair(tmp_path)
    out = tmp_path / "rr.json"
    r = subprocess.run([sys.executable, str(BENCH / "read_requests.py"), str(plain), str(coded), "--sizes-mib", "1,4",
                        "--threads", "2", "--raw-mib", "0.25,1", "--chunk-mib", "1", "--max-gb", "0.004", "--rounds",
                        "2", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    want = {"disk 1MiB x2", "disk 4MiB x2", "reader plain chunk 1MiB", "reader exp3 raw 0.25MiB chunk 1MiB",
            "reader exp3 raw 1MiB chunk 1MiB"}
    assert set(res["summary"]) == want and all(v["min"] > 0 for v in res["summary"].values()), res["summary"]
    assert len(res["rows"]) == 2 * len(want)
    runs = {x["variant"]: x["mean_request_mib"] for x in res["rows"] if x["variant"].startswith("reader exp3")}
    assert 0 < runs["reader exp3 raw 0.25MiB chunk 1MiB"] < runs["reader exp3 raw 1MiB chunk 1MiB"] <= 1, runs
    out = tmp_path / "trace.json"
    r = subprocess.run([sys.executable, str(BENCH / "read_trace.py"), str(plain), str(coded), "--device", "cpu",
                        "--ring-gb", "0.006", "--threads", "2", "--tokens", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())["results"]
    assert set(got) == {str(plain), str(coded)}
    for s in got.values():
        assert s["reads"] > 0 and 0 < s["disk_busy"] <= 1 and s["s_per_token"] > 0 and s["read_gbps"] > 0, s


def test_machine_label_names_the_gpu_model_not_its_memory() -> None:
    """Result files are named by the GPU model: an H100 reports "NVIDIA H100 80GB HBM3" and was labelled "hbm3"
    (the name's last word) until 2026-12-05."""
    import run
    assert run.machine_label({"gpus": ["NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"]}) == "h100"
    assert run.machine_label({"gpus": ["NVIDIA H200, 143771 MiB, 580.159.04"] * 2}) == "2xh200"
    assert run.machine_label({"gpus": [], "cores": 2, "ram_gib": 23.5}) == "cpu-2c-24g"


def test_a_round_the_budget_cannot_fit_is_not_started(tmp_path: Path) -> None:
    """run.py gives each run the budget that is left as its timeout; a round whose earlier round took longer than that
    is not started (it used to start with a 21 s timeout and be killed, wasting device time), while a run with no
    earlier round, or one that fits, still is."""
    import argparse

    import run
    a = argparse.Namespace(budget_s=100.0, min_start_s=10.0, cache_dir=str(tmp_path), mem_limit_gb=None)
    runner = run.Runner(a, {"main": object()}, [], cuda=False)
    runner.t0 -= 40.0  # 60 s of the budget left, 50 s before the last start
    rd = run.RunDef(key="main/tiered-defaults/original/auto/cold/limit2#2", group="scaling", system="tiered",
                    variant="defaults", ckpt="main")
    runner.took["main/tiered-defaults/original/auto/cold/limit2"] = 75.0
    row = runner.run_one(rd, True, "")
    assert row["status"].startswith("not run:") and "took 75 s" in row["status"], row
    for took in (40.0, None):  # fits, or never ran: it goes on (and here stops at the dummy checkpoint)
        runner.took.clear()
        if took:
            runner.took["main/tiered-defaults/original/auto/cold/limit2"] = took
        with pytest.raises(AttributeError):
            runner.run_one(rd, True, "")


def test_disk_efficiency_is_held_against_the_ceiling_beside_the_run_and_the_invocations(tmp_path: Path) -> None:
    """Issue 23's disk efficiency: a cold tiered run's bytes read per second of decode over the better disk read
    ceiling, measured just before it (``ceilings.py --disk-only``, over bytes not read before) and at the start of
    the invocation; none for accelerate, a warm run, or one whose page-cache tier served reads. The scaling tables
    print each round's figure and the invocation's; the merged report computes it for files written before run.py
    did, from their own ceilings."""
    import run
    shard = tmp_path / "ck" / "model-00001-of-00001.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(os.urandom(3 << 20))
    res = ceilings.measure(shard.parent, max_bytes=1 << 20, threads=(1, 2), cuda=False, rounds=1, disk_only=True,
                           skip=2 << 20)
    names = {k.removesuffix("_gbps") for k in res if k.endswith("_gbps")} | {k.removesuffix("_error") for k in res
                                                                             if k.endswith("_error")}
    assert names == {"odirect_1t", "odirect_2t", "buffered_cold"}, res  # no page cache, memcpy or H2D figure
    assert res["skip"] == 2 << 20 and res["buffered_cold_gbps"] > 0, res
    assert ceilings.measure(shard.parent, max_bytes=2 << 20, threads=(1,), cuda=False, rounds=1, disk_only=True,
                            skip=2 << 20)["skip"] == 0  # fewer bytes than asked left: from the start again

    def row(system: str = "tiered", cold: bool = True, cache_units: int = 0, gbps: float = 1.2) -> dict:
        return {"system": system, "decode_gbps": gbps, "streamed_gb_per_token": 9.3, "spec": {"cold": cold},
                "stats_total": {"page_cache_units": cache_units},
                "adjacent_ceilings": {"odirect_1t_gbps": 1.5, "odirect_4t_gbps": 1.2, "buffered_cold_gbps": 1.0}}
    inv = {"odirect_1t_gbps": 1.7, "odirect_1t_gbps_max": 2.0, "odirect_4t_gbps_max": 1.6, "buffered_cold_gbps": 1.4,
           "pagecache_1t_gbps_max": 9.0}  # the page cache's figure is no disk ceiling
    eff = run.disk_efficiency(row(), inv)
    assert eff["disk_efficiency"] == pytest.approx(1.2 / 1.5) and eff["disk_efficiency_invocation"] == pytest.approx(
        1.2 / 2.0), eff
    assert run.disk_efficiency(row("accelerate"), inv) == {} and run.disk_efficiency(row(cold=False), inv) == {}
    assert run.disk_efficiency(row(cache_units=3), inv) == {}
    assert run.disk_efficiency(row() | {"streamed_gb_per_token": 0.0}, inv) == {}  # a host tier held every unit
    no_adj = row()
    del no_adj["adjacent_ceilings"]
    assert run.disk_efficiency(no_adj, inv) == {"disk_efficiency_invocation": pytest.approx(0.6)}

    runs = []
    for n, (gbps, spt) in enumerate([(1.2, 8.0), (1.35, 7.0)], 1):
        r = _run("scaling", "tiered", 2, spt, n) | row(gbps=gbps)
        runs.append(r | run.disk_efficiency(r, inv))
    runs.append(_run("scaling", "accelerate", 2, 9.0, 1))
    md = "\n".join(report._scaling(runs))
    t = next(ln for ln in md.splitlines() if ln.startswith("| 2 GiB | tiered |"))
    assert f"| 0.80, 0.90 ({statistics.median([0.6, 0.675]):.2f}) |" in t, t
    assert next(ln for ln in md.splitlines() if ln.startswith("| 2 GiB | accelerate |")).count("| – |") >= 1
    old = [{k: v for k, v in r.items() if not k.startswith("disk_efficiency") and k != "adjacent_ceilings"}
           for r in runs]  # a file from before: its ceilings only
    f = _result_file(tmp_path / "old.json", "2026-12-05T10:00:00+00:00", "gptj-6b", "fp16", 28, old)
    doc = json.loads(f.read_text())
    doc["ceilings"] = inv
    f.write_text(json.dumps(doc))
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, str(BENCH / "scaling_report.py"), str(f), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = _md_row(Path(f"{out}.md").read_text(), f.name, "2 GiB")
    assert cells[11] == f"– ({statistics.median([0.6, 0.675]):.2f})", cells
