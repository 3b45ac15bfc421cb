"""Several processes (issue 11): each rank reads 1/N of every unit; the unit is all-gathered.

* In one process: every rank's piece (``tiered.dist.split_unit``), read with the real reader, put
  side by side, equals the whole unit read at once, byte for byte, for dense, tied, cast, MoE
  (stacked experts), encoder-decoder and DeepSeek checkpoints, N = 2, 3, 4, both io backends.
* Under ``torchrun --nproc-per-node 2`` with gloo on the CPU (``tests/dist_worker.py``): each rank
  runs its own ids; logits and greedy ``generate`` equal stock ``transformers`` bit for bit; each rank
  reads about half of what one process reads, and together the ranks read it once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import streaming_ring_gb

import tiered
from tiered.dist import split_unit
from tiered.format import open_checkpoint
from tiered.meta import meta_model_from_dir
from tiered.plan import build_plan
from tiered.reader import Reader

HERE = Path(__file__).parent


def _read_whole_and_pieces(path: Path, world: int, *, dtype=None, io="mmap", align=64):
    """(plan, per unit: (whole bytes, assembled bytes) or None when the unit is not cut)."""
    model = meta_model_from_dir(path, dtype=dtype)
    ckpt = open_checkpoint(path)
    plan = build_plan(model, ckpt, align=align)
    reader = Reader(ckpt, threads=2, io=io)
    out = []
    try:
        for u in plan.units:
            whole = torch.full((u.nbytes,), 0xAB, dtype=torch.uint8)
            reader.read_unit(u, whole)
            cuts = [split_unit(u, r, world, align) for r in range(world)]
            if cuts[0] is None:
                assert all(c is None for c in cuts)
                out.append(None)
                continue
            chunk = cuts[0][1]
            assert all(c[1] == chunk for c in cuts) and chunk % align == 0 and world * chunk >= u.nbytes
            got = torch.full((world * chunk,), 0xCD, dtype=torch.uint8)
            read = 0
            for r, (piece, _) in enumerate(cuts):
                read += reader.read_unit(piece, got[r * chunk : (r + 1) * chunk])
            assert read == u.src_bytes, (u.name, read, u.src_bytes)  # together: each byte once
            out.append((u, whole, got))
    finally:
        reader.close()
    return plan, out


def _target_bytes(u, buf: torch.Tensor) -> list[torch.Tensor]:
    return [buf[t.offset : t.offset + t.nbytes] for t in u.targets]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", ["llama", "llama_tied_single", "gpt2", "mixtral", "qwen2_moe", "t5", "deepseek_v3"])
def test_pieces_side_by_side_equal_the_whole_unit(ckpts, name, world):
    plan, out = _read_whole_and_pieces(ckpts[name], world)
    cut = [x for x in out if x is not None]
    assert len(cut) >= len(plan.units) - 1, f"{name}: only {len(cut)} of {len(plan.units)} units were cut"
    for u, whole, got in cut:
        for t, a, b in zip(u.targets, _target_bytes(u, whole), _target_bytes(u, got), strict=True):
            assert torch.equal(a, b), f"{name} world={world}: {t.key} differs after assembly"
        assert any(bool(a.any()) for a in _target_bytes(u, whole))  # not all-zero data


@pytest.mark.parametrize("io", ["direct", "pread"])
def test_pieces_with_a_cast_and_o_direct(ckpts, io):
    """bf16 checkpoint run in fp32 (cast inside each piece's copy), read with O_DIRECT or pread, CUDA's 512-byte
    alignment."""
    try:
        plan, out = _read_whole_and_pieces(ckpts["llama"], 2, dtype=torch.float32, io=io, align=512)
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    for x in out:
        assert x is not None
        u, whole, got = x
        for a, b in zip(_target_bytes(u, whole), _target_bytes(u, got), strict=True):
            assert torch.equal(a, b)


def test_pieces_split_the_bytes_evenly(ckpts):
    """Each rank reads about 1/N of a unit's checkpoint bytes (chunks are equal up to alignment)."""
    model = meta_model_from_dir(ckpts["llama_fp32"])
    plan = build_plan(model, open_checkpoint(ckpts["llama_fp32"]), align=64)
    layer = next(u for u in plan.units if "layers.1" in u.name)
    shares = [split_unit(layer, r, 4, 64)[0].src_bytes for r in range(4)]
    assert sum(shares) == layer.src_bytes
    assert max(shares) - min(shares) <= 4 * 64 + 64 * 4  # the padding between targets shifts a little


def test_distributed_outside_torchrun_is_a_clear_error(ckpts, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(tiered.ConfigError, match="torchrun"):
        tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", distributed=True)


def test_bad_host_gb_is_refused(ckpts):
    with pytest.raises(tiered.ConfigError, match="host_gb"):
        tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", host_gb=-1)


def torchrun(tmp_path: Path, *args: str, nproc: int = 2) -> list[dict]:
    """Run ``tests/dist_worker.py`` on ``nproc`` ranks; each rank's JSON (its ``.pt`` lies beside it)."""
    # same intra-op threads as this process: a CPU GEMM's blocking (and so its rounding) depends on them
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), NCCL_NVLS_ENABLE="0",
               PYTHONPATH=str(HERE.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(HERE / "dist_worker.py"), *args, "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("name", ["llama_fp32", "mixtral"])
def test_two_ranks_under_torchrun_equal_stock_transformers(ckpts, tmp_path, name):
    path = ckpts[name]
    with tiered.load(path, ring_gb=1, device="cpu") as probe:
        ring = streaming_ring_gb(probe)  # streams: the whole model does not fit
    res = torchrun(tmp_path, str(path), "--ring-gb", repr(ring))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    one = tiered.load(path, ring_gb=ring, device="cpu")
    for r, got in enumerate(res):
        assert got["world_size"] == 2 and got["rank"] == r
        d = torch.load(tmp_path / f"rank{r}.pt")
        ids = d["ids"]
        with torch.no_grad():
            want = ref(ids).logits
            want_gen = ref.generate(ids, max_new_tokens=got["max_new_tokens"], do_sample=False)
        assert torch.equal(d["logits"], want), f"rank {r}: logits differ from stock transformers"
        assert torch.equal(d["generated"], want_gen), f"rank {r}: generate differs"
    # the two ranks ran different ids and different lengths (synced_gpus kept the shorter one running)
    assert res[0]["max_new_tokens"] != res[1]["max_new_tokens"]
    # bytes: one forward pass on one process reads S; each rank reads about S/2; together S
    b = tiered.stats(one).snapshot()
    with torch.no_grad():
        one(torch.load(tmp_path / "rank0.pt")["ids"])
    e = tiered.stats(one).snapshot()  # units through the ring (embedding rows and routed experts depend on the ids)
    s = e["dense_bytes"] - b["dense_bytes"]
    one.close()
    shares = [g["forward_streamed_bytes"] for g in res]
    assert sum(shares) == s, (shares, s)
    assert all(0.4 * s <= x <= 0.6 * s for x in shares), (shares, s)
    assert all(g["gathered_bytes"] > 0 for g in res)
    for g in res:  # each rank's RSS in the passes: its own ring (+ activations, the collectives' buffers)
        assert g["peak_rss_growth_in_passes"] <= g["ring_bytes"] + (64 << 20), g


@pytest.mark.parametrize("io", ["mmap", "pread", "direct"])
def test_pipelined_piece_reads_equal_the_whole_unit(ckpts, io):
    """CUDA's pieces path queues a piece's reads (Reader.start_unit) before the previous piece's are waited for
    (Reader.finish): every piece of every unit in flight two at a time, assembled, equals the whole unit read at once.
    A failing copy is raised by finish only once all of that piece's copies are done; cancel leaves no copy running."""
    from tiered import faults

    path = ckpts["llama"]
    plan = build_plan(meta_model_from_dir(path), open_checkpoint(path), align=512)
    try:
        reader = Reader(open_checkpoint(path), threads=3, io=io)
    except tiered.ConfigError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(str(e))
    checked = False
    try:
        for u in plan.units:
            whole = torch.full((u.nbytes,), 0xAB, dtype=torch.uint8)
            reader.read_unit(u, whole)
            n = 3
            cuts = [split_unit(u, r, n, 512) for r in range(n)]
            if cuts[0] is None:
                continue
            chunk = cuts[0][1]
            got = torch.full((n * chunk,), 0xCD, dtype=torch.uint8)
            inflight = []
            for r, (piece, _) in enumerate(cuts):
                inflight.append(reader.start_unit(piece, got[r * chunk:(r + 1) * chunk]))
                if len(inflight) == 2:
                    reader.finish(inflight.pop(0))
            for jobs in inflight:
                reader.finish(jobs)
            for a, b in zip(_target_bytes(u, whole), _target_bytes(u, got), strict=True):  # padding is never read
                assert torch.equal(a, b), u.name
            checked = True
        assert checked
        layer = next(u for u in plan.units if "layers.0" in u.name)
        piece, chunk = split_unit(layer, 0, 1, 512)
        buf = torch.zeros(chunk, dtype=torch.uint8)
        calls = {"n": 0}

        def boom(**info):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError("injected: the disk went away")

        with faults.inject("read", boom):
            jobs = reader.start_unit(piece, buf)
            with pytest.raises(OSError, match="injected"):
                reader.finish(jobs)
        assert all(f.done() for f in jobs)  # raised only once every copy of the piece had finished
        jobs = reader.start_unit(piece, buf)
        reader.cancel(jobs)
        assert all(f.done() for f in jobs)  # cancelled or finished: nothing writes into buf any more
        import dataclasses

        converted = dataclasses.replace(layer, converts=[object()])  # runs on the caller's thread: read_unit only
        with pytest.raises(ValueError, match="conversion"):
            reader.start_unit(converted, torch.zeros(layer.nbytes, dtype=torch.uint8))
    finally:
        reader.close()
