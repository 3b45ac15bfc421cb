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
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import STOCK, ids_for, plan_ring_gb, streaming_ring_gb

import tiered
from tiered.dist import split_unit
from tiered.format import open_checkpoint
from tiered.hostmem import page_up
from tiered.meta import meta_model_from_dir
from tiered.plan import build_plan
from tiered.reader import Reader

HERE = Path(__file__).parent
GiB = 1 << 30


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


# ---------------------------------------------------------------------------------------------- hostile


WORKER = r'''
"""One rank of the torchrun jobs of test_dist.py's TestHostile: runs the cases of a JSON spec, in order."""
import faulthandler, json, os, sys, threading, traceback
from pathlib import Path

import torch
import torch.distributed as tdist

import tiered
import tiered.plan


def ids_for(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, 256, (1 + rank, 5 + 2 * rank), generator=g)


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the test process: same GEMM rounding
    rank = int(os.environ["RANK"])

    def write(name, res, tensors=None):
        if tensors is not None:
            torch.save(tensors, out / f"{name}_rank{rank}.pt")
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(res))

    for case in spec["cases"]:
        name = case["name"]
        res = {"rank": rank}
        kw = dict(case.get("kwargs", {}))
        kw.update(case.get("rank_kwargs", {}).get(str(rank), {}))
        if "dtype" in kw:
            kw["dtype"] = getattr(torch, kw["dtype"])
        path = case["paths"][rank] if "paths" in case else case["path"]
        deadline = case.get("deadline_s", 60)

        def hung(name=name, res=res, deadline=deadline):
            sys.stderr.write(f"[rank{rank}] case {name!r} hung; stacks:\n")
            faulthandler.dump_traceback(all_threads=True)
            res["error"] = ["Hang", f"case {name!r} did not finish in {deadline} s"]
            write(name, res)
            os._exit(4)

        dog = threading.Timer(deadline, hung)
        dog.daemon = True
        dog.start()
        dist_arg = True
        if case.get("group"):
            if not tdist.is_initialized():
                tdist.init_process_group("gloo")
            dist_arg = tdist.new_group(list(range(tdist.get_world_size())), backend="gloo")
        orig = tiered.plan._place_converter
        if case.get("unplaced"):  # every stack/concat conversion runs transformers' own ops: split_unit -> None
            tiered.plan._place_converter = lambda *a, **k: None
        try:
            m = tiered.load(path, device="cpu", distributed=dist_arg, **kw)
        except tiered.ConfigError as e:  # refused on this rank: the next case can run
            dog.cancel()
            res["error"] = ["ConfigError", str(e)]
            write(name, res)
            tdist.barrier()
            continue
        except BaseException as e:
            res["error"] = [type(e).__name__, str(e)]
            write(name, res)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
        finally:
            tiered.plan._place_converter = orig
        try:
            sp = m._tiered.streamer
            res["units"] = len(sp.units)
            res["gathered_units"] = sum(p.gathered for p in sp.io_plans) if sp.io_plans else 0
            res["resident_units"] = len(sp.resident_ids)
            res["world_size"] = tiered.stats(m).world_size
            for mod, who in case.get("raise_at", {}).items():
                if int(who) == rank:
                    def boom(*a, mod=mod, **k):
                        raise RuntimeError(f"hostile: rank {rank} fails in {mod}")
                    m.get_submodule(mod).register_forward_pre_hook(boom)
            ids = ids_for(rank)
            t = {"ids": ids}
            with torch.no_grad():
                if case.get("seq2seq"):
                    t["logits"] = m(input_ids=ids, decoder_input_ids=ids[:, :3]).logits
                else:
                    t["logits"] = m(ids).logits
                res["forward_done"] = True
                if case.get("generate", True):
                    res["max_new_tokens"] = 3 + 3 * rank
                    t["generated"] = m.generate(ids, max_new_tokens=3 + 3 * rank, do_sample=False)
            res["gathered_bytes"] = tiered.stats(m).gathered_bytes
            write(name, res, t)
            m.close()
        except BaseException as e:
            res["error"] = [type(e).__name__, str(e)]
            write(name, res)
            if case.get("propagate"):  # as a plain script would: the exception ends this rank
                raise
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
        dog.cancel()
        tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def _torchrun(tmp: Path, cases: list[dict], nproc: int, timeout: float = 300) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "worker.py").write_text(WORKER)
    (tmp / "spec.json").write_text(json.dumps({"cases": cases}))
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=str(HERE.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(tmp / "worker.py"), str(tmp / "spec.json"), str(out)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, log = p.returncode, p.stdout[-4000:] + p.stderr[-12000:]
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", f"torchrun did not end in {timeout} s: {str(e.stderr)[-8000:]}"
    return {"rc": rc, "log": log, "wall_s": time.monotonic() - t0, "out": out, "nproc": nproc}


def _results(job: dict, name: str) -> list[dict]:
    """Each rank's JSON for case ``name``; a clear failure when some rank has none (the job ended before)."""
    files = [job["out"] / f"{name}_rank{r}.json" for r in range(job["nproc"])]
    got = [json.loads(f.read_text()) if f.is_file() else None for f in files]
    if any(g is None for g in got):
        seen = {r: g.get("error") for r, g in enumerate(got) if g is not None}
        pytest.fail(f"case {name!r}: no result from ranks {[r for r, g in enumerate(got) if g is None]} (the job "
                    f"ended there or earlier, rc={job['rc']}); the others' errors: {seen}\n" + job["log"][-5000:])
    return got



def _stock(path: str, seq2seq: bool = False, dtype: str | None = None):
    return STOCK(path, auto=transformers.AutoModelForSeq2SeqLM if seq2seq else None,
                 dtype=getattr(torch, dtype) if dtype else None)


#: case name -> (checkpoint, from_pretrained kwargs) for the cases whose outputs must equal stock transformers
OK_CASES = ["tied", "t5", "unplaced", "prefetch0", "norows_prefetch_differ", "group", "resident", "pread_odd_cast"]
MISMATCH_CASES = ["dtype_bf16_fp32", "arch_differ", "rows_differ", "dtype_fp16_bf16", "ckpt_differ_same_shapes"]


def _job_a_cases(ckpts, odd: Path) -> list[dict]:
    llama, tied, t5, mixtral, fp32 = (str(ckpts[n]) for n in ("llama", "llama_tied_single", "t5", "mixtral",
                                                               "llama_fp32"))
    ring = {n: plan_ring_gb(ckpts[n]) for n in ("llama", "llama_tied_single", "t5", "mixtral", "llama_fp32")}
    return [
        {"name": "tied", "path": tied, "kwargs": {"ring_gb": ring["llama_tied_single"]}},
        {"name": "t5", "path": t5, "kwargs": {"ring_gb": ring["t5"]}, "seq2seq": True},
        {"name": "unplaced", "path": mixtral, "kwargs": {"ring_gb": ring["mixtral"]}, "unplaced": True},
        {"name": "prefetch0", "path": llama, "kwargs": {"ring_gb": ring["llama"], "prefetch": 0}},
        {"name": "norows_prefetch_differ", "path": llama, "kwargs": {"ring_gb": ring["llama"], "embedding_rows": False},
         "rank_kwargs": {"0": {"prefetch": 0}, "1": {"prefetch": 3}}},
        {"name": "group", "path": fp32, "kwargs": {"ring_gb": ring["llama_fp32"]}, "group": True},
        {"name": "resident", "path": fp32, "kwargs": {"ring_gb": 1}},
        {"name": "pread_odd_cast", "path": str(odd), "kwargs": {"ring_gb": plan_ring_gb(odd), "dtype": "float32"},
         "rank_kwargs": {"0": {"io": "pread"}, "1": {"io": "mmap"}}},
        # ranks that disagree: a ConfigError on every rank
        {"name": "dtype_bf16_fp32", "path": llama, "kwargs": {"ring_gb": 0.01},
         "rank_kwargs": {"0": {"dtype": "bfloat16"}, "1": {"dtype": "float32"}}},
        {"name": "arch_differ", "paths": [llama, mixtral], "kwargs": {"ring_gb": 0.01}},
        {"name": "rows_differ", "path": llama, "kwargs": {"ring_gb": ring["llama"]},
         "rank_kwargs": {"0": {"embedding_rows": True}, "1": {"embedding_rows": False}}},
        # same unit names and byte sizes, different contents: fp16 vs bf16 (2 bytes each) ...
        {"name": "dtype_fp16_bf16", "path": llama, "kwargs": {"ring_gb": ring["llama"]},
         "rank_kwargs": {"0": {"dtype": "float16"}, "1": {"dtype": "bfloat16"}}},
        # ... and two different checkpoints of one architecture (bf16 seed 1 vs fp32 seed 7), both run in fp32
        {"name": "ckpt_differ_same_shapes", "paths": [llama, fp32],
         "kwargs": {"ring_gb": ring["llama_fp32"], "dtype": "float32"}},
        # last (it ends the job): rank 1 raises in layer 2's forward; rank 0 waits in layer 3's all-gather
        {"name": "raise", "path": llama, "kwargs": {"ring_gb": ring["llama"]}, "raise_at": {"model.layers.2": 1},
         "propagate": True, "deadline_s": 200},
    ]


@pytest.fixture(scope="module")
def job_a(ckpts, odd_ckpt, tmp_path_factory) -> dict:
    cases = _job_a_cases(ckpts, odd_ckpt)
    job = _torchrun(tmp_path_factory.mktemp("job_a"), cases, nproc=2)
    job["cases"] = {c["name"]: c for c in cases}
    return job


class TestHostile:
    """``distributed=True`` under torchrun (gloo on the CPU), hostile inputs. Job A (2 ranks, many cases in one set
    of processes; a torchrun start costs ~10 s): cases that must work (tied Llama, T5, units that cannot be cut,
    prefetch=0, embedding_rows=False, a ProcessGroup, resident units, odd offsets read with pread and a cast) equal
    stock ``transformers`` bit for bit on each rank; ranks that disagree (dtype, checkpoint, options) get a
    ConfigError on every rank; one rank raising mid-forward ends the job (no hang). Two short jobs: ring sizes that
    leave the resident set larger than a rank's ring. Every case runs under a watchdog in the worker: a hang writes
    ``Hang`` (and every thread's stack) and fails a test in seconds. Then the same options in one process."""

    @pytest.mark.parametrize("name", OK_CASES)
    def test_two_ranks_equal_stock_transformers(self, job_a, name):
        case = job_a["cases"][name]
        res = _results(job_a, name)
        for r, got in enumerate(res):
            assert "error" not in got, f"rank {r}: {got['error']}\n" + job_a["log"][-4000:]
            assert got["world_size"] == 2
        ref = _stock(case["path"], case.get("seq2seq", False), case.get("kwargs", {}).get("dtype"))
        for r in range(2):
            d = torch.load(job_a["out"] / f"{name}_rank{r}.pt")
            ids = d["ids"]
            assert torch.equal(ids, ids_for(r))
            with torch.no_grad():
                if case.get("seq2seq"):
                    want = ref(input_ids=ids, decoder_input_ids=ids[:, :3]).logits
                else:
                    want = ref(ids).logits
                want_gen = ref.generate(ids, max_new_tokens=3 + 3 * r, do_sample=False)
            assert bool(want.abs().sum() > 0)
            assert torch.equal(d["logits"], want), f"{name} rank {r}: logits differ from stock transformers"
            assert torch.equal(d["generated"], want_gen), f"{name} rank {r}: generate differs from stock transformers"
        if name == "unplaced":  # the layers (fused experts) are read whole by each rank, the rest is cut
            assert 0 < res[0]["gathered_units"] < res[0]["units"], res[0]
        elif name == "resident":
            assert res[0]["resident_units"] == res[0]["units"] and res[0]["gathered_bytes"] > 0
        else:
            assert res[0]["gathered_units"] == res[0]["units"] and res[0]["gathered_bytes"] > 0


    @pytest.mark.parametrize("name", MISMATCH_CASES)
    def test_ranks_that_disagree_get_a_config_error_on_every_rank(self, job_a, name):
        res = _results(job_a, name)
        errs = [g.get("error") for g in res]
        if not any(errs):  # show what happened instead: the ranks ran with each other's bytes
            case = job_a["cases"][name]
            r = 0
            path = case["paths"][r] if "paths" in case else case["path"]
            dtype = case.get("rank_kwargs", {}).get(str(r), {}).get("dtype") or case["kwargs"].get("dtype")
            d = torch.load(job_a["out"] / f"{name}_rank{r}.pt")
            with torch.no_grad():
                same = torch.equal(d["logits"], _stock(path, dtype=dtype)(d["ids"]).logits)
            pytest.fail(f"{name}: no error on any rank; the job ran on (rank 0's logits equal its own stock model: {same})")
        for r, e in enumerate(errs):
            assert e is not None and e[0] == "ConfigError", f"{name} rank {r}: {e}"
            assert "rank" in e[1] and "plan" in e[1], e


    def test_one_rank_failing_mid_forward_ends_the_job(self, job_a):
        """Rank 1 raises in layer 2 (after its all-gather); rank 0 then waits in layer 3's: the job must end, with
        rank 1's exception in the log, not hang until gloo's 30-minute timeout."""
        assert job_a["rc"] not in (0, "timeout"), job_a["log"][-4000:]
        res = _results(job_a, "raise")
        assert res[1]["error"][0] == "RuntimeError" and "hostile" in res[1]["error"][1]
        assert "forward_done" not in res[0], res[0]
        assert res[0].get("error", ["?"])[0] != "Hang", res[0]
        assert "hostile: rank 1 fails in model.layers.2" in job_a["log"]


    @pytest.mark.parametrize("name", ["exact_ring", "ring_differ"])
    def test_resident_set_larger_than_a_rank_ring_does_not_hang(self, ckpts, tmp_path, name):
        """CPU: whether every unit is resident is decided from the ring (rank 0's decision is used on every rank),
        then loaded through each rank's own ring, where resident slots are never freed. Each must load and equal
        stock transformers, not hang in load_resident.

        exact_ring: 3 ranks (world 3: a unit's distributed slot, ``world * chunk`` bytes, can be a page larger than
        ``Unit.nbytes``), every rank ring_gb = the units' page-rounded ``nbytes``. ring_differ: 2 ranks, rank 0's
        ring holds the whole model, rank 1's streams."""
        path = ckpts["llama"]
        plan = build_plan(meta_model_from_dir(path), open_checkpoint(path), align=64)
        if name == "exact_ring":
            exact = sum(page_up(u.nbytes) for u in plan.units) / GiB
            case = {"name": name, "path": str(path), "kwargs": {"ring_gb": exact}}
            nproc = 3
        else:
            case = {"name": name, "path": str(path), "rank_kwargs": {"0": {"ring_gb": 1}, "1": {"ring_gb": plan_ring_gb(path)}}}
            nproc = 2
        job = _torchrun(tmp_path, [dict(case, generate=False, deadline_s=20)], nproc=nproc)
        res = _results(job, name)
        errs = {r: got["error"] for r, got in enumerate(res) if "error" in got}
        assert not errs, f"{name}: errors by rank: {errs}\n" + job["log"][-3000:]
        ref = _stock(str(path))
        for r in range(nproc):
            d = torch.load(job["out"] / f"{name}_rank{r}.pt")
            with torch.no_grad():
                assert torch.equal(d["logits"], ref(ids_for(r)).logits), f"{name} rank {r}"


    def test_distributed_with_rank_env_but_no_rendezvous_is_a_config_error(self, ckpts, monkeypatch):
        """RANK/WORLD_SIZE exported (a stale shell, a SLURM step) but not under torchrun: a ConfigError, not
        torch's raw ValueError from the env:// rendezvous."""
        import torch.distributed as tdist

        for k in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        try:
            with pytest.raises(tiered.ConfigError, match="torchrun|MASTER_ADDR"):
                tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", distributed=True)
        finally:
            if tdist.is_initialized():
                tdist.destroy_process_group()


    def test_distributed_true_outside_torchrun_and_bad_values(self, ckpts, monkeypatch):
        import torch.distributed as tdist

        for k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k, raising=False)
        for bad in (True, "yes", 1):
            with pytest.raises(tiered.ConfigError):
                tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", distributed=bad)
        assert not tdist.is_initialized()


    def test_world_of_one_and_a_process_group(self, ckpts):
        """An initialised world of one (distributed=True or its ProcessGroup) runs as one process: stock outputs.
        A value that is neither a bool nor a ProcessGroup is a ConfigError."""
        import torch.distributed as tdist

        path = ckpts["llama"]
        ref = _stock(str(path))
        ids = ids_for(1)
        with torch.no_grad():
            want = ref(ids).logits
        assert not tdist.is_initialized()
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
        try:
            group = tdist.new_group([0], backend="gloo")
            for d in (True, group):
                with tiered.load(path, ring_gb=plan_ring_gb(path), device="cpu", distributed=d) as m:
                    assert m._tiered.dist is None and tiered.stats(m).world_size == 1
                    with torch.no_grad():
                        assert torch.equal(m(ids).logits, want)
            for bad in ("yes", 1):
                with pytest.raises(tiered.ConfigError, match="distributed"):
                    tiered.load(path, ring_gb=0.01, device="cpu", distributed=bad)
        finally:
            tdist.destroy_process_group()



class _ThreadJob:
    """One rank of a job whose ranks are threads of this process: ``min`` and ``agree`` are collectives over a barrier,
    as torch.distributed's are over the ranks (tiered.dist.Dist's strategy, without processes)."""

    def __init__(self, rank: int, world: int, box: list, barrier) -> None:
        from tiered.dist import Dist

        self.rank, self.world, self.box, self.barrier = rank, world, box, barrier
        self.shared = Dist(None, rank, world, "gloo")

    def _exchange(self, value):
        self.box[self.rank] = value
        self.barrier.wait()
        got = list(self.box)
        self.barrier.wait()
        return got

    def min(self, value: int) -> int:
        return min(self._exchange(value))

    def agree(self, value):
        return self._exchange(value)[0]

    def check_same_plan(self, plan, extra) -> None:
        return None


@pytest.mark.parametrize(("name", "per_rank"), [
    ("llama", [{"gpu_gb": 0.0004}, {"gpu_gb": 0.0001}]),
    ("llama", [{"gpu_gb": 0.0003, "prefetch": 0}, {"gpu_gb": None, "prefetch": 4}]),
    ("mixtral", [{"gpu_gb": 1.0}, {"gpu_gb": 0.0003}]),
    ("llama", [{"gpu_gb": 0.0003, "ring_gb": 0.001}, {"gpu_gb": 0.0003, "ring_gb": 0.0002}]),
])
def test_ranks_with_different_options_place_the_same_units(ckpts, name, per_rank):
    """Ranks that pass different gpu_gb, prefetch or ring_gb still stream the same units (the same resident set and
    the same routed experts): every rank's all-gathers must match, or the job hangs. place() asks the job for the
    smallest budget and ring, whether the model fits everywhere, and rank 0's resident set."""
    import threading

    from tiered.cli import _plan_for
    from tiered.machine import Machine
    from tiered.options import Options
    from tiered.placement import place

    d = ckpts[name]
    world = len(per_rank)
    box, barrier, out = [None] * world, threading.Barrier(world), [None] * world

    def rank(r: int) -> None:
        config, ckpt, plan = _plan_for(d, None, "cuda")
        kw = {"ring_gb": 0.001, **per_rank[r]}
        opts = Options(device="cuda:0", distributed=True, **kw)
        machine = Machine(64 << 30, "test", 16 << 30, "test", gpu_free=1 << 30)
        out[r] = place(plan, opts, machine, ckpt_bytes=ckpt.nbytes, config=config, job=_ThreadJob(r, world, box, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(p is not None for p in out)
    assert out[0].resident == out[1].resident and out[0].rows == out[1].rows
    assert [sp.name for sp in out[0].specs] == [sp.name for sp in out[1].specs]
    assert out[0].gpu_budget == out[1].gpu_budget
