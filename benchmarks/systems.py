#!/usr/bin/env python
"""The benchmarked systems, one function each; one run = one child process (``run.py`` starts it).

    python benchmarks/systems.py SPEC.json

``SPEC.json`` is a :class:`Spec` as JSON. The child imports torch and transformers, records the RSS
(the baseline of ANCHORS.md: "after ``import torch, transformers``"), initialises CUDA and cuBLAS
when the run is on the GPU (their host RSS is paid by every system: recorded apart), drops the page
cache when the spec asks for a cold run, loads the model with the system under test, generates
``new_tokens`` greedy tokens from the given prompt ids with a streamer that timestamps every new
token, and prints one line ``BENCH_RESULT {json}`` on stdout (``BENCH_PARTIAL {json}`` after the
load, so a run killed later still has its load time).

Systems (``Spec.system``):

* ``tiered`` — ``tiered.load(model_dir, ring_gb=, device=, gpu_gb=, threads=, prefetch=, io=)``;
  "streamed" passes a small ``gpu_gb`` (CUDA) or a ring smaller than the model (CPU), "resident" lets
  the whole model stay on the GPU (CUDA) or uses a ring that holds it (CPU). Adds tiered's stats.
* ``transformers`` — ``AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")``, with
  ``device_map="cuda"`` on the GPU (only when the checkpoint fits in free GPU memory), plain CPU otherwise.
* ``accelerate`` — the same with ``device_map="auto"``, ``max_memory={0: "<gpu_gb>GiB", "cpu":
  "<cpu_gb>GiB"}`` (no ``0`` on CPU) and ``offload_folder``: what does not fit is offloaded to disk.
  Bytes moved per token = the parameters placed on "cpu" or "disk" (GPU run) or on "disk" (CPU run).
* ``deepspeed`` — ZeRO-3 inference with ``offload_param: cpu`` (the public report's configuration,
  ``HfDeepSpeedConfig`` + ``deepspeed.initialize``), single process; GPU only.

Figures (sizes in GiB = 2**30 bytes, rates in decimal GB/s): ``load_s``, ``ttft_s`` (generate() call
to first new token), ``decode_s_per_token_median`` (median gap between consecutive new tokens),
``tokens_per_s``, ``peak_rss_gb`` (VmHWM), ``peak_rss_over_base_gb`` (base: the RSS once torch, transformers and
the model's transformers modules are imported, before CUDA init and the load; ``rss_import_gb`` is the RSS
right after ``import torch, transformers``), ``peak_rss_over_cuda_base_gb``,
``gpu_peak_gb`` (``torch.cuda.max_memory_allocated``), ``streamed_gb_per_token``, ``decode_gbps``
(= streamed per token / s per token), and for tiered ``read_gbps`` (disk->ring) / ``h2d_gbps``
(ring->GPU) of the generate phase.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The keys of a spec's ``extra`` passed to ``tiered.load`` as they are (the others are module switches, set below)
LOAD_EXTRA = ("drop_page_cache", "host_gb", "zero_copy")
GiB = 1 << 30

__all__ = ["Spec", "SYSTEMS", "main"]


@dataclass
class Spec:
    """One run. Sizes in GiB (2**30 bytes)."""

    system: str  # "tiered" | "transformers" | "accelerate" | "deepspeed"
    model_dir: str  # the checkpoint
    prompt_ids: list[int]  # the same for every system (greedy, so outputs are comparable)
    new_tokens: int  # generated with min_new_tokens = max_new_tokens
    device: str = "cpu"  # "cpu" or "cuda"
    cold: bool = False  # drop the page cache after the imports, just before the load (root)
    ring_gb: float | None = 1.0  # tiered: host ring (None: tiered's default, chosen from what the host leaves)
    gpu_gb: float | None = None  # tiered: GPU budget for resident units (None: all that fits); accelerate: max_memory[0]
    cpu_gb: float = 1.0  # accelerate: max_memory["cpu"]
    threads: int | None = None  # tiered: reader threads (None: tiered's default)
    prefetch: int = 2  # tiered: units of lookahead
    io: str = "mmap"  # tiered: "mmap", "pread", "direct" or "auto"
    offload_folder: str | None = None  # accelerate / deepspeed scratch
    extra: dict[str, Any] = field(default_factory=dict)  # tiered: drop_page_cache, host_gb


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _emit(tag: str, d: dict) -> None:
    sys.stdout.write(f"{tag} {json.dumps(d)}\n")
    sys.stdout.flush()


def json_line(res: dict, out: Any = None) -> None:
    """Print ``res`` as one JSON line on stdout and, with ``out`` (a path), append it there too."""
    line = json.dumps(res)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Clock:
    """A ``generate()`` streamer: ``put`` is called once with the prompt, then once per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: Any) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class NotRun(Exception):
    """The system cannot run here (missing package, does not fit...): reported as 'not run: <why>'."""


class Bench:
    """The measuring frame shared by every system: baseline RSS, CUDA init, cold cache, load, generate."""

    def __init__(self, spec: Spec) -> None:
        import torch
        import transformers

        self.torch = torch
        self.spec = spec
        self.res: dict[str, Any] = {"system": spec.system, "versions": {"torch": torch.__version__,
                                                                         "transformers": transformers.__version__}}
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except Exception:  # noqa: BLE001
            pass
        self.res["rss_import_gb"] = _status()["VmRSS"] / GiB  # ANCHORS.md's base: after import torch, transformers
        # transformers imports its model modules lazily, on first use (seconds on a slow CPU): import
        # them for every system before the load timer starts, so load_s compares loading, not importing.
        config = transformers.AutoConfig.from_pretrained(spec.model_dir)
        for name in getattr(config, "architectures", None) or []:
            getattr(transformers, name, None)
        transformers.AutoModelForCausalLM  # noqa: B018 - the lazy import is the point
        self.base = _status()["VmRSS"]
        self.res["rss_base_gb"] = self.base / GiB
        self.cuda = spec.device.startswith("cuda")
        self.cuda_base: int | None = None
        if self.cuda:
            if not torch.cuda.is_available():
                raise NotRun("CUDA not available")
            x = torch.ones(256, 256, device="cuda", dtype=torch.float16)
            (x @ x).sum().item()  # CUDA context + cuBLAS: host RSS every system pays
            self.cuda_base = _status()["VmRSS"]
            self.res["rss_cuda_base_gb"] = self.cuda_base / GiB
            self.res["gpu"] = torch.cuda.get_device_name()
            torch.cuda.reset_peak_memory_stats()
        self.res["cold_cache"] = _drop_caches() if spec.cold else False
        if spec.cold and not self.res["cold_cache"]:
            self.res["notes"] = ["drop_caches not permitted: the run is not cold"]
        self.t_load0 = 0.0

    def start_load(self) -> None:
        self.t_load0 = time.perf_counter()

    def end_load(self, model: Any) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        self.res["load_s"] = time.perf_counter() - self.t_load0
        self.res["rss_after_load_gb"] = _status()["VmRSS"] / GiB
        _emit("BENCH_PARTIAL", {"load_s": self.res["load_s"], "rss_after_load_gb": self.res["rss_after_load_gb"]})

    def generate(self, model: Any, device: Any) -> None:
        torch = self.torch
        s = self.spec
        ids = torch.tensor([s.prompt_ids], dtype=torch.long, device=device)
        clock = Clock()
        cfg = getattr(model, "generation_config", None)
        pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            eos = getattr(cfg, "eos_token_id", None)
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.new_tokens,
                                 min_new_tokens=s.new_tokens, do_sample=False, streamer=clock, pad_token_id=pad)
        if self.cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        med = statistics.median(steps) if steps else None
        r = self.res
        r["tokens"] = int(out.shape[1] - ids.shape[1])
        r["generate_s"] = total
        r["ttft_s"] = clock.times[0] - t0 if clock.times else None
        r["decode_s_per_token_median"] = med
        r["decode_steps_s"] = steps
        r["tokens_per_s"] = 1.0 / med if med else None
        r["tokens_out"] = out[0, ids.shape[1]:].tolist()

    def finish(self) -> dict[str, Any]:
        st = _status()
        r = self.res
        r["peak_rss_gb"] = st["VmHWM"] / GiB
        r["peak_rss_over_base_gb"] = (st["VmHWM"] - self.base) / GiB
        r["peak_rss_over_cuda_base_gb"] = (st["VmHWM"] - self.cuda_base) / GiB if self.cuda_base else None
        if self.cuda:
            r["gpu_peak_gb"] = self.torch.cuda.max_memory_allocated() / GiB
            r["gpu_reserved_peak_gb"] = self.torch.cuda.max_memory_reserved() / GiB
        gbt, spt = r.get("streamed_gb_per_token"), r.get("decode_s_per_token_median")
        r["decode_gbps"] = gbt / spt if gbt and spt else (0.0 if gbt == 0 else None)
        return r


def _param_bytes(module: Any) -> int:
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel() * p.element_size()
    return n


def _checkpoint_bytes(model_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------------


def run_tiered(spec: Spec) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    b = Bench(spec)
    import tiered
    from tiered.errors import ConfigError

    if "merge_staged_reads" in spec.extra:  # twins.py --merge-reads: how routed experts read their staging batches
        import tiered.experts

        tiered.experts.MERGE_STAGED_READS = bool(spec.extra["merge_staged_reads"])
    if "direct_chunk_mib" in spec.extra:  # run.py --scaling-direct-chunk-mib: the O_DIRECT request size (an A/B)
        import tiered.reader

        tiered.reader.DIRECT_CHUNK = int(float(spec.extra["direct_chunk_mib"]) * (1 << 20)) // 4096 * 4096
    if "slot_direct" in spec.extra:  # run.py --scaling-staged: O_DIRECT straight into the slot, or staged (an A/B)
        import tiered.reader

        tiered.reader.SLOT_DIRECT = bool(spec.extra["slot_direct"])
    if "read_shapes" in spec.extra and not spec.extra["read_shapes"]:  # run.py --scaling-fixed-shape (an A/B)
        import tiered.reader

        tiered.reader.SHAPES = tiered.reader.SHAPES[:1]
    if "auto_ring_in_pieces" in spec.extra:  # run.py --scaling-whole-ring: the automatic ring's rule (an A/B switch)
        import tiered.policy

        tiered.policy.AUTO_RING_IN_PIECES = bool(spec.extra["auto_ring_in_pieces"])
    if "pieces_when_one_fits" in spec.extra:  # run.py --scaling-pieces-cut (an A/B switch)
        import tiered.policy

        tiered.policy.PIECES_WHEN_ONE_FITS = bool(spec.extra["pieces_when_one_fits"])
    if "head_in_ring_pieces" in spec.extra:  # run.py --scaling-head-pieces (an A/B switch)
        import tiered.policy

        tiered.policy.HEAD_IN_RING_PIECES = bool(spec.extra["head_in_ring_pieces"])
    b.start_load()
    try:
        model = tiered.load(spec.model_dir, ring_gb=spec.ring_gb, device=spec.device, gpu_gb=spec.gpu_gb,
                            threads=spec.threads, prefetch=spec.prefetch, io=spec.io,
                            **{k: v for k, v in spec.extra.items() if k in LOAD_EXTRA})
    except ConfigError as e:
        if "io=" in str(e):
            raise NotRun(f"io={spec.io!r} not available in this tiered: {e}") from e
        raise
    b.end_load(model)
    st = tiered.stats(model)
    s0 = st.snapshot()
    b.generate(model, model.device)
    s1 = tiered.stats(model).snapshot()
    r = b.res
    n = max(1, r["tokens"])
    streamed = s1["read_bytes"] - s0["read_bytes"]
    rd_s, h2d_b, h2d_s = s1["read_s"] - s0["read_s"], s1["h2d_bytes"] - s0["h2d_bytes"], s1["h2d_s"] - s0["h2d_s"]
    r.update({
        "model_gb": s1["model_bytes"] / 1e9,
        "io_used": s1.get("io") or model._tiered.opts.io,  # what io="auto" resolved to (and then measured: below)
        "io_choice": s1.get("io_choice"),  # io="auto" on O_DIRECT: both backends' copy rates and the one kept
        "units": s1["units"],
        "resident_units": s1["resident_units"],
        "ring_gb": spec.ring_gb,
        "ring_gb_used": model._tiered.opts.ring_gb,  # ring_gb=None resolved (tiered's default)
        "ring_why": getattr(st.placement, "ring_why", None),
        "host_gb_used": getattr(st.placement, "host_gb", None),  # host_gb=None resolved (tiered's default)
        "host_why": getattr(st.placement, "host_why", None),
        "threads_used": getattr(st.placement, "threads", None),  # reader threads (threads=None resolved) and why
        "threads_why": getattr(st.placement, "threads_why", None),
        "prefetch_used": model._tiered.opts.prefetch,
        "ring_high_water_gb": s1["ring_high_water"] / GiB,
        "load_gbps": s0["read_bytes"] / r["load_s"] / 1e9 if r["load_s"] and s0["read_bytes"] else None,
        "load_read_gbps": s0["read_gbps"] or None,
        "streamed_gb": streamed / 1e9,
        "streamed_gb_per_token": streamed / 1e9 / n,
        "read_gbps": streamed / rd_s / 1e9 if rd_s > 0 else None,
        "h2d_gbps": h2d_b / h2d_s / 1e9 if h2d_s > 0 else None,
        # bytes per generated token over PCIe from the ring and the host tier (stored bytes for a stored unit), out
        # of the host tier's routed experts, and decoded from stored codes (issue 24)
        "h2d_gb_per_token": h2d_b / 1e9 / n,
        "host_expert_gb_per_token": (s1.get("host_expert_bytes", 0) - s0.get("host_expert_bytes", 0)) / 1e9 / n,
        "decoded_gb_per_token": (s1.get("decoded_bytes", 0) - s0.get("decoded_bytes", 0)) / 1e9 / n,
        # O_DIRECT bytes read straight into ring slots, no staging copy (issue 23, seventeenth session)
        "slot_direct_gb_per_token": (s1.get("slot_direct_bytes", 0) - s0.get("slot_direct_bytes", 0)) / 1e9 / n,
        "stall_s": s1["stall_s"] - s0["stall_s"],
        "hits": s1["hits"] - s0["hits"],
        "misses": s1["misses"] - s0["misses"],
        "stats_total": {k: v for k, v in s1.items() if isinstance(v, (int, float))},
        # what streams through the ring each pass (a row-read embedding reads only its rows: embedding_gb)
        "ring_units_gb": sum(model._tiered.plan.units[i].src_bytes for i in model._tiered.streamer.streamed) / 1e9,
        "row_units": s1["row_units"],
        "embedding_gb": (s1["embedding_bytes"] - s0["embedding_bytes"]) / 1e9,
    })
    model.close()
    return b.finish()


def run_transformers(spec: Spec) -> dict[str, Any]:
    b = Bench(spec)
    from transformers import AutoModelForCausalLM

    size = _checkpoint_bytes(spec.model_dir)
    kw: dict[str, Any] = {"dtype": "auto", **_dequantize_kw(spec.model_dir)}
    if b.cuda:
        free, _ = b.torch.cuda.mem_get_info()
        if size + 2 * GiB > free:
            raise NotRun(f"checkpoint {size / GiB:.1f} GiB does not fit in free GPU memory {free / GiB:.1f} GiB")
        kw["device_map"] = "cuda"
    b.start_load()
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, **kw)
    model.eval()
    b.end_load(model)
    b.generate(model, model.device)
    b.res.update({"model_gb": size / 1e9, "streamed_gb_per_token": 0.0,
                  "load_gbps": size / b.res["load_s"] / 1e9 if b.res["load_s"] else None})
    return b.finish()


def _dequantize_kw(model_dir: str) -> dict[str, Any]:
    """``from_pretrained`` keywords for a block-FP8 checkpoint (``quant_method: "fp8"``): stock's own dequantize
    (``FineGrainedFP8Config(dequantize=True)``: bf16 weights at load), the one FP8 path stock has offline on the GPU
    machine (its FP8 kernels are fetched from the hub); {} for any other checkpoint."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss: stock's own dequantize of the experts (bf16 at load)
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if method != "fp8":
        return {}
    from transformers import FineGrainedFP8Config

    return {"quantization_config": FineGrainedFP8Config(dequantize=True)}


def run_accelerate(spec: Spec) -> dict[str, Any]:
    b = Bench(spec)
    try:
        import accelerate  # noqa: F401
    except ImportError as e:
        raise NotRun(f"accelerate not importable: {e}") from e
    from transformers import AutoModelForCausalLM

    if not spec.offload_folder:
        raise NotRun("no offload_folder in the spec")
    os.makedirs(spec.offload_folder, exist_ok=True)
    max_memory: dict[Any, str] = {"cpu": f"{spec.cpu_gb}GiB"}
    if b.cuda:
        max_memory[0] = f"{spec.gpu_gb if spec.gpu_gb is not None else 2}GiB"
    size = _checkpoint_bytes(spec.model_dir)
    b.start_load()
    asked = {str(k): v for k, v in max_memory.items()}  # from_pretrained rewrites the dict in place
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype="auto", device_map="auto",
                                                 max_memory=max_memory, offload_folder=spec.offload_folder,
                                                 **_dequantize_kw(spec.model_dir))
    model.eval()
    b.end_load(model)
    dmap: dict[str, Any] = dict(getattr(model, "hf_device_map", {}) or {})
    moved = {"cpu", "disk"} if b.cuda else {"disk"}
    placed: dict[str, int] = {}
    for name, dev in dmap.items():
        sub = model.get_submodule(name) if name else model
        key = str(dev)
        placed[key] = placed.get(key, 0) + _param_bytes(sub)
    per_token = sum(v for k, v in placed.items() if k in moved)
    first = next(iter(dmap.values()), "cpu")
    device = b.torch.device(f"cuda:{first}" if isinstance(first, int) else ("cpu" if first == "disk" else first))
    b.generate(model, device)
    b.res.update({
        "model_gb": size / 1e9,
        "max_memory": asked,
        "placement_gb": {k: v / 1e9 for k, v in placed.items()},
        "streamed_gb_per_token": per_token / 1e9,
        "load_gbps": None,
    })
    return b.finish()


def run_deepspeed(spec: Spec) -> dict[str, Any]:
    b = Bench(spec)
    if not b.cuda:
        raise NotRun("DeepSpeed ZeRO-3 inference needs CUDA")
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - ImportError or a broken build
        raise NotRun(f"deepspeed not importable: {e}") from e
    torch = b.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:  # older layout
        from transformers.deepspeed import HfDeepSpeedConfig  # type: ignore[no-redef]

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(29500 + os.getpid() % 1000)}.items():
        os.environ.setdefault(k, v)
    config = AutoConfig.from_pretrained(spec.model_dir)
    h = int(getattr(config, "hidden_size", None) or config.n_embd)
    dtype = getattr(config, "dtype", None) or torch.float16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    ds_config = {  # the public report's script; int() because current DeepSpeed rejects the float
        "fp16": {"enabled": dtype == torch.float16},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        },
        "steps_per_print": 2000,
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "wall_clock_breakdown": False,
    }
    b.start_load()
    deepspeed.init_distributed()
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must be alive while from_pretrained runs (zero.Init)
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=dtype, **_dequantize_kw(spec.model_dir))
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    b.end_load(engine.module)
    b.generate(engine.module, torch.device("cuda", 0))
    size = _checkpoint_bytes(spec.model_dir)
    b.res.update({"model_gb": size / 1e9, "streamed_gb_per_token": size / 1e9, "load_gbps": None,
                  "deepspeed": deepspeed.__version__})
    return b.finish()


SYSTEMS = {"tiered": run_tiered, "transformers": run_transformers, "accelerate": run_accelerate,
           "deepspeed": run_deepspeed}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = Spec(**json.loads(Path(argv[0]).read_text()))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        res = SYSTEMS[spec.system](spec)
    except NotRun as e:
        _emit("BENCH_RESULT", {"system": spec.system, "status": f"not run: {e}"})
        return 0
    res["status"] = "ok"
    res["spec"] = asdict(spec) | {"prompt_ids": None}
    _emit("BENCH_RESULT", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
