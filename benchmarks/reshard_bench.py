#!/usr/bin/env python
"""How fast is ``tiered.reshard`` next to a plain ``cp`` of the same bytes, in the same run?

Generates (once, cached) a checkpoint of several GiB at real model shapes with
``benchmarks/make_checkpoint.py``, then, ``--repeats`` times and alternating which goes first:

* ``cp SRC/*.safetensors OUT/`` followed by an ``fsync`` of every copied file (the reshard fsyncs
  its output before the rename, so the copy is timed to the same point: bytes on disk);
* ``tiered.reshard(SRC, DST)`` in this process (``transformers`` imported beforehand, as a user's
  interpreter would have it; the time includes building the unit plan on ``meta``).

Before every timed operation the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``)
when this process may do so (root), otherwise both run warm; the JSON says which. Throughput is
decimal GB/s (1e9 bytes/s) of shard bytes written; the median of the repeats is reported, with every
run. The target is ``ratio = reshard / cp >= 0.7``.

    python benchmarks/reshard_bench.py                      # ~3.1 GiB fp32 TinyLlama, 16 layers
    python benchmarks/reshard_bench.py --verify --dtype bf16
Prints one JSON line on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _drop_caches() -> bool:
    """sync + drop the page cache; False when not permitted (then nothing is dropped)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _fsync_all(d: Path) -> None:
    for p in d.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _time_cp(src_files: list[Path], out: Path, drop: bool) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if drop:
        _drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["cp", *map(str, src_files), str(out)], check=True)
    t1 = time.perf_counter()
    _fsync_all(out)
    t2 = time.perf_counter()
    nbytes = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {"bytes": nbytes, "cp_s": t1 - t0, "fsync_s": t2 - t1, "s": t2 - t0, "gbps": nbytes / (t2 - t0) / 1e9,
            "gbps_no_fsync": nbytes / (t1 - t0) / 1e9}


def _time_reshard(src: Path, out: Path, drop: bool, **kw) -> dict:
    from tiered.reshard import reshard
    from tiered.stats import proc_status

    shutil.rmtree(out, ignore_errors=True)
    if drop:
        _drop_caches()
    rss0 = proc_status().get("VmRSS", 0)
    s = reshard(src, out, quiet=True, **kw)
    nbytes = s.file_bytes
    hwm = proc_status().get("VmHWM", 0)
    shutil.rmtree(out)
    return {"bytes": nbytes, "s": s.seconds, "gbps": nbytes / s.seconds / 1e9, "shards": s.shards,
            "kernel_copy_bytes": s.kernel_copy_bytes, "rss_before_mib": rss0 / 2**20, "vmhwm_mib": hwm / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="tinyllama-1.1b", help="make_checkpoint arch (default tinyllama-1.1b)")
    p.add_argument("--ckpt-dtype", default="fp32", help="checkpoint dtype (default fp32)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16: ~3.1 GiB in fp32)")
    p.add_argument("--src-shard-size", default="2GB", help="input shard size (default 2GB)")
    p.add_argument("--max-shard-size", default="2GB", help="reshard output shard size (default 2GB)")
    p.add_argument("--dtype", default=None, help="reshard --dtype (default: none, a pure reshard)")
    p.add_argument("--verify", action="store_true", help="reshard --verify")
    p.add_argument("--repeats", type=int, default=3, help="timed pairs (default 3)")
    p.add_argument("--no-drop-caches", action="store_true", help="run warm even when caches could be dropped")
    p.add_argument("--cache", default=os.environ.get("TIERED_CACHE", str(ROOT / ".cache")),
                   help="where the checkpoint is generated and outputs written (default $TIERED_CACHE or .cache/)")
    a = p.parse_args(argv)

    import transformers  # noqa: F401 - the runtime, imported before timing, as in a user's session
    from make_checkpoint import make_checkpoint

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    name = f"bench-{a.arch}-{a.ckpt_dtype}-{a.layers}l-{a.src_shard_size}"
    src = make_checkpoint(cache / name, a.arch, dtype=a.ckpt_dtype, layers=a.layers,
                          max_shard_size=a.src_shard_size, quiet=True)
    getattr(transformers, json.loads((src / "config.json").read_text())["architectures"][0])  # resolve lazily
    files = sorted(src.glob("*.safetensors"))
    drop = not a.no_drop_caches and _drop_caches()
    kw = {"max_shard_size": a.max_shard_size, "dtype": a.dtype, "verify": a.verify}
    runs = []
    for i in range(a.repeats):
        order = ["cp", "reshard"] if i % 2 == 0 else ["reshard", "cp"]
        r: dict = {}
        for what in order:
            if what == "cp":
                r["cp"] = _time_cp(files, cache / "bench-cp-out", drop)
            else:
                r["reshard"] = _time_reshard(src, cache / "bench-reshard-out", drop, **kw)
            print(f"[run {i}] {what}: {r[what]['gbps']:.3f} GB/s ({r[what]['s']:.2f} s)", file=sys.stderr)
        runs.append(r)
    cp = statistics.median(r["cp"]["gbps"] for r in runs)
    rs = statistics.median(r["reshard"]["gbps"] for r in runs)
    out = {
        "bench": "reshard_vs_cp",
        "checkpoint": str(src), "arch": a.arch, "ckpt_dtype": a.ckpt_dtype, "layers": a.layers,
        "input_shards": len(files), "bytes": sum(f.stat().st_size for f in files),
        "reshard_options": kw,
        "caches": "dropped before each run" if drop else "warm (not dropped)",
        "cp_gbps": round(cp, 3),
        "cp_gbps_no_fsync": round(statistics.median(r["cp"]["gbps_no_fsync"] for r in runs), 3),
        "reshard_gbps": round(rs, 3),
        "ratio": round(rs / cp, 3),
        "target_ratio": 0.7,
        "reshard_rss_growth_mib": round(max(r["reshard"]["vmhwm_mib"] - r["reshard"]["rss_before_mib"]
                                            for r in runs), 1),
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
