"""Hostile inputs for ``distributed=True`` (torchrun, gloo on the CPU), ``io="pread"`` and ``host_gb``.

Two torchrun jobs, each running many cases in one set of processes (a torchrun start costs ~10 s):

* job A (2 ranks): cases that must work (tied Llama, T5, units that cannot be cut, prefetch=0,
  embedding_rows=False, a ProcessGroup, resident units, odd offsets read with pread and a cast) —
  each rank's logits and greedy ``generate`` equal stock ``transformers`` bit for bit; then ranks
  that disagree (dtype, checkpoint, options) — a ConfigError on every rank; last, one rank raising
  mid-forward — the job must end (not hang);
* two short jobs: ring sizes that leave the resident set larger than a rank's ring.

Every case runs under a watchdog in the worker: a case that does not finish in its deadline writes
``Hang`` (plus a dump of every thread's stack to stderr) and ends the job, so a hang fails a test in
seconds instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import tiered
import tiered.reader
from tiered.format import encode_header, open_checkpoint
from tiered.hostmem import page_up
from tiered.meta import meta_model_from_dir
from tiered.plan import build_plan

HERE = Path(__file__).parent
GiB = 1 << 30

WORKER = r'''
"""One rank of test_dist_hostile's torchrun jobs: runs the cases of a JSON spec, in order."""
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


def ids_for(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, 256, (1 + rank, 5 + 2 * rank), generator=g)


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


def _ring_gb(path: Path, units: float = 3) -> float:
    """A ring that holds ~3 of the largest units but not the whole model (so units stream)."""
    plan = build_plan(meta_model_from_dir(path), open_checkpoint(path), align=64)
    big = page_up(plan.max_unit.nbytes)
    whole = sum(page_up(u.nbytes) for u in plan.units)
    ring = max(big, min(int(units * big), whole - 4096))
    assert ring < whole
    return ring / GiB


def _write_odd(src: Path, dst: Path) -> Path:
    """``src`` (one model.safetensors) rewritten with a 1-byte tensor first: every other tensor starts at an
    odd file offset."""
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    items = [("aaa_pad", torch.tensor([7], dtype=torch.uint8)), *sorted(sd.items())]
    hdr = encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in items],
                        {"format": "pt"})
    with open(dst / "model.safetensors", "wb") as f:
        f.write(hdr)
        for _, v in items:
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
    offs = [t.offset for k, t in open_checkpoint(dst).tensors.items() if k != "aaa_pad"]
    assert offs and all(o % 2 == 1 for o in offs)
    return dst


@pytest.fixture(scope="module")
def odd_ckpt(ckpts, tmp_path_factory) -> Path:
    return _write_odd(ckpts["llama_tied_single"], tmp_path_factory.mktemp("odd") / "model")


# ------------------------------------------------------------------------------------------ torchrun job A

#: case name -> (checkpoint, from_pretrained kwargs) for the cases whose outputs must equal stock transformers
OK_CASES = ["tied", "t5", "unplaced", "prefetch0", "norows_prefetch_differ", "group", "resident", "pread_odd_cast"]
MISMATCH_CASES = ["dtype_bf16_fp32", "arch_differ", "rows_differ", "dtype_fp16_bf16", "ckpt_differ_same_shapes"]


def _job_a_cases(ckpts, odd: Path) -> list[dict]:
    llama, tied, t5, mixtral, fp32 = (str(ckpts[n]) for n in ("llama", "llama_tied_single", "t5", "mixtral",
                                                               "llama_fp32"))
    ring = {n: _ring_gb(ckpts[n]) for n in ("llama", "llama_tied_single", "t5", "mixtral", "llama_fp32")}
    return [
        {"name": "tied", "path": tied, "kwargs": {"ring_gb": ring["llama_tied_single"]}},
        {"name": "t5", "path": t5, "kwargs": {"ring_gb": ring["t5"]}, "seq2seq": True},
        {"name": "unplaced", "path": mixtral, "kwargs": {"ring_gb": ring["mixtral"]}, "unplaced": True},
        {"name": "prefetch0", "path": llama, "kwargs": {"ring_gb": ring["llama"], "prefetch": 0}},
        {"name": "norows_prefetch_differ", "path": llama, "kwargs": {"ring_gb": ring["llama"], "embedding_rows": False},
         "rank_kwargs": {"0": {"prefetch": 0}, "1": {"prefetch": 3}}},
        {"name": "group", "path": fp32, "kwargs": {"ring_gb": ring["llama_fp32"]}, "group": True},
        {"name": "resident", "path": fp32, "kwargs": {"ring_gb": 1}},
        {"name": "pread_odd_cast", "path": str(odd), "kwargs": {"ring_gb": _ring_gb(odd), "dtype": "float32"},
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


def _stock(path: str, seq2seq: bool = False, dtype: str | None = None):
    cls = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    kw = {"dtype": getattr(torch, dtype)} if dtype else {}
    return cls.from_pretrained(path, **kw).eval()


@pytest.mark.parametrize("name", OK_CASES)
def test_two_ranks_equal_stock_transformers(job_a, name):
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
def test_ranks_that_disagree_get_a_config_error_on_every_rank(job_a, name):
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


def test_one_rank_failing_mid_forward_ends_the_job(job_a):
    """Rank 1 raises in layer 2 (after its all-gather); rank 0 then waits in layer 3's: the job must end, with
    rank 1's exception in the log, not hang until gloo's 30-minute timeout."""
    assert job_a["rc"] not in (0, "timeout"), job_a["log"][-4000:]
    res = _results(job_a, "raise")
    assert res[1]["error"][0] == "RuntimeError" and "hostile" in res[1]["error"][1]
    assert "forward_done" not in res[0], res[0]
    assert res[0].get("error", ["?"])[0] != "Hang", res[0]
    assert "hostile: rank 1 fails in model.layers.2" in job_a["log"]


# ------------------------------------------------------------------------------------------ torchrun job B

@pytest.mark.parametrize("name", ["exact_ring", "ring_differ"])
def test_resident_set_larger_than_a_rank_ring_does_not_hang(ckpts, tmp_path, name):
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
        case = {"name": name, "path": str(path), "rank_kwargs": {"0": {"ring_gb": 1}, "1": {"ring_gb": _ring_gb(path)}}}
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


# ------------------------------------------------------------------------------------------ in one process

def test_distributed_with_rank_env_but_no_rendezvous_is_a_config_error(ckpts, monkeypatch):
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


def test_distributed_true_outside_torchrun_and_bad_values(ckpts, monkeypatch):
    import torch.distributed as tdist

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for bad in (True, "yes", 1):
        with pytest.raises(tiered.ConfigError):
            tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", distributed=bad)
    assert not tdist.is_initialized()


def test_world_of_one_and_a_process_group(ckpts):
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
            with tiered.load(path, ring_gb=_ring_gb(path), device="cpu", distributed=d) as m:
                assert m._tiered.dist is None and tiered.stats(m).world_size == 1
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, want)
        for bad in ("yes", 1):
            with pytest.raises(tiered.ConfigError, match="distributed"):
                tiered.load(path, ring_gb=0.01, device="cpu", distributed=bad)
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_pread_odd_offsets_and_a_cast_equal_stock(odd_ckpt, dtype):
    ids = ids_for(1)
    kw = {"dtype": dtype} if dtype else {}
    ref = transformers.AutoModelForCausalLM.from_pretrained(odd_ckpt, **kw).eval()
    with torch.no_grad():
        want = ref(ids).logits
    assert want.dtype == (dtype or torch.bfloat16)
    with tiered.load(odd_ckpt, ring_gb=_ring_gb(odd_ckpt), device="cpu", io="pread", threads=3, **kw) as m:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(ids).logits, want)
        assert tiered.stats(m).units > 1 and m._tiered.streamer.resident_ids == set()


def test_pread_big_cast_zero_size_and_odd_offsets(tmp_path):
    """A plain module: a fp32 tensor larger than two pread staging chunks cast to bf16 (and a bf16 one cast up)
    at odd offsets, and zero-size tensors, read with io="pread" equal torch's own casts."""
    from torch import nn

    g = torch.Generator().manual_seed(3)
    big_n = (1 << 21) + (1 << 20) + 3  # fp32: more elements than DIRECT_CHUNK / 4, not a multiple of it
    src = {"a_pad": torch.tensor([5], dtype=torch.uint8), "big": torch.randn(big_n, generator=g),
           "empty": torch.empty(0, 4), "small": torch.randn(33, generator=g).to(torch.bfloat16),
           "z_empty16": torch.empty(4, 0, dtype=torch.bfloat16)}
    hdr = encode_header([(k, v.dtype, tuple(v.shape), v.numel() * v.element_size()) for k, v in src.items()])
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(hdr)
        for v in src.values():
            f.write(v.view(torch.uint8).numpy().tobytes())
    offs = {k: t.offset % 2 for k, t in open_checkpoint(tmp_path).tensors.items()}
    assert offs["big"] == offs["small"] == 1

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Parameter(torch.empty(big_n, dtype=torch.bfloat16))
            self.empty = nn.Parameter(torch.empty(0, 4, dtype=torch.float64))
            self.small = nn.Parameter(torch.empty(33, dtype=torch.float32))
            self.z_empty16 = nn.Parameter(torch.empty(4, 0, dtype=torch.bfloat16))

        def forward(self, x):
            return self.big * x, self.small * x, self.empty.sum() + x, self.z_empty16.shape

    with torch.device("meta"):
        m = M()
    with tiered.attach(m, tmp_path, ring_gb=0.05, device="cpu", io="pread", threads=3) as m:
        with torch.no_grad():
            b, s, e, z = m(torch.tensor(1.0))
    assert torch.equal(b, src["big"].to(torch.bfloat16)) and bool(b.float().abs().sum() > 0)
    assert torch.equal(s, src["small"].float())
    assert float(e) == 1.0 and tuple(z) == (4, 0)


def test_pread_truncated_shard_is_an_error(ckpts, tmp_path, monkeypatch):
    """A shard truncated under a loaded io="pread" model: TruncatedShardError naming it (caught by the shard
    check, and by the short read itself when the truncation races the check), never zeros or a hang."""
    d = ckpts.copy("llama", tmp_path / "m")
    ids = ids_for(0)
    ref = _stock(str(d))
    with torch.no_grad():
        want = ref(ids).logits
    shards = sorted(d.glob("*.safetensors"))
    victim = shards[len(shards) // 2]
    with tiered.load(d, ring_gb=_ring_gb(d), device="cpu", io="pread") as m:
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)
        monkeypatch.setattr(tiered.reader.ShardMap, "check", lambda self: None)  # the race: check passed, then
        os.truncate(victim, victim.stat().st_size - 100)
        with pytest.raises(tiered.TruncatedShardError, match=victim.name):
            with torch.no_grad():
                m(ids)
        monkeypatch.undo()
        with pytest.raises(tiered.TruncatedShardError, match="truncated"):
            with torch.no_grad():
                m(ids)
    with pytest.raises(tiered.TruncatedShardError):
        tiered.load(d, ring_gb=0.01, device="cpu", io="pread")


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "1", True, None, [1]])
def test_host_gb_invalid_values(ckpts, bad):
    with pytest.raises(tiered.ConfigError, match="host_gb"):
        tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", host_gb=bad)


@pytest.mark.parametrize("gb", [1, 0.5, 1e-9])
def test_host_gb_on_cpu_with_distributed_is_refused_before_anything_starts(ckpts, monkeypatch, gb):
    import torch.distributed as tdist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any rendezvous would be attempted
    with pytest.raises(tiered.ConfigError, match="host_gb"):
        tiered.load(ckpts["llama"], ring_gb=0.01, device="cpu", host_gb=gb, distributed=True)
    assert not tdist.is_initialized()


def test_host_gb_zero_on_cpu_is_fine(ckpts):
    path = ckpts["llama"]
    ids = ids_for(0)
    with torch.no_grad():
        want = _stock(str(path))(ids).logits
    with tiered.load(path, ring_gb=_ring_gb(path), device="cpu", host_gb=0, io="pread") as m:
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)
        assert tiered.stats(m).host_units == 0
