"""One measured ``tiered`` generation run, printed as one JSON line (and appended to --out).

Figures: load s, time to first token, decode s/token (median over steps), bytes streamed per
token, GB/s per stage (disk->ring, ring->GPU), stalls, peak host RSS (VmHWM) over the RSS measured
just before ``tiered.load`` (after ``import torch, transformers``), peak GPU memory.

    python benchmarks/stream_run.py MODEL_DIR --ring-gb 1 --gpu-gb 2 --new-tokens 8 [--drop-caches]

Several GPUs (issue 11; each rank streams half of every unit, all-gathered over NVLink):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/stream_run.py MODEL_DIR \
        --distributed --ring-gb 1 --gpu-gb 2

Each rank decodes its own batch (data parallel) and writes its own line; rank 0's line also has
the aggregate H2D GB/s (every rank's ring->GPU bytes over the slowest rank's generate time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiered  # noqa: E402
from tiered.stats import proc_status  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from systems import Clock as _Clock  # noqa: E402
from systems import _drop_caches as drop_caches  # noqa: E402
from systems import json_line  # noqa: E402

GiB = 1 << 30


def _cuda_warmup(a: argparse.Namespace) -> int:
    """Run the model's architecture with one decoder layer (random weights created on the GPU, no host copy)
    through ``generate`` with the run's batch, prompt length and new tokens, free it, and reset VmHWM
    (``/proc/self/clear_refs``). Returns the RSS then: the CUDA runtime with this model's kernels loaded (cuBLAS,
    attention, sampling), which grows the RSS by about 1 GiB on the first forward whatever holds the weights."""
    import gc

    cfg = transformers.AutoConfig.from_pretrained(a.model_dir)
    for k in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, k):
            setattr(cfg, k, 1)
    dtype = getattr(cfg, "dtype", None) or torch.bfloat16
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(100, min(cfg.vocab_size, 30000), (a.batch, a.prompt_len), device="cuda")
    with torch.no_grad():
        m.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
    del m
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status()["VmRSS"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ring-gb", type=float, default=1.0)
    p.add_argument("--gpu-gb", type=float, default=None, help="GiB for resident units (default: all that fits)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--io", choices=["mmap", "pread", "direct", "auto"], default="mmap")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded at once (tokens/s counts all of them)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="first run a generate of this many tokens, not measured: the decode then starts from a process "
                        "that has already streamed")
    p.add_argument("--warmup-prompt-len", type=int, default=None,
                   help="the warm-up's prompt length (default: the measured prompt's, which makes the measured decode "
                        "repeat the warm-up's sequence lengths: anything cached per shape, e.g. cuDNN attention "
                        "graphs, is then warm; a different length keeps those shapes new, as in one long generation)")
    p.add_argument("--drop-caches", action="store_true", help="echo 3 > /proc/sys/vm/drop_caches first (root)")
    p.add_argument("--no-embedding-rows", action="store_true",
                   help="stream the embedding whole through the ring (embedding_rows=False), as before issue 8")
    p.add_argument("--no-routed-experts", action="store_true",
                   help="stream MoE experts whole with their layer (routed_experts=False), as before issue 8")
    p.add_argument("--expert-cache-gb", type=float, default=None,
                   help="GiB of routed experts kept on the GPU (default: what --gpu-gb leaves; 0: none)")
    p.add_argument("--host-gb", type=float, default=0.0, help="GiB of pinned host tier (CUDA; default 0: none)")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: tiered.load(distributed=True), one GPU per rank (cuda:$LOCAL_RANK)")
    p.add_argument("--cuda-warmup", action="store_true",
                   help="before loading, run the same architecture (one layer, random weights already on the GPU) "
                        "through generate with the same shapes, then reset VmHWM: peak_rss_over_cuda_model_base_gb is "
                        "then the RSS the weights' path adds over a CUDA runtime that has run this model's kernels")
    p.add_argument("--no-cudnn-sdp", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False) first: SDPA without cuDNN, whose graph build at "
                        "every new sequence length costs 40-53 ms of host time on the H200 (benchmarks/NOTES.md)")
    p.add_argument("--label", default="tiered")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    a = p.parse_args()
    if a.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)

    cold = drop_caches() if a.drop_caches else False
    rank = 0
    if a.distributed:
        import os

        rank = int(os.environ.get("RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(rank)  # each rank its own prompt (data parallel)
    base = proc_status()["VmRSS"]  # after import torch, transformers (ANCHORS.md's baseline)
    cuda_base = None
    if a.device != "cpu" and torch.cuda.is_available():
        # the CUDA context and cuBLAS cost host RSS whatever loads the weights: measure them apart
        x = torch.ones(256, 256, device="cuda", dtype=torch.float16)
        (x @ x).sum().item()
        cuda_base = proc_status()["VmRSS"]
    model_base = None
    if a.cuda_warmup and cuda_base is not None:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):  # the prompt stays the same
            model_base = _cuda_warmup(a)
    t0 = time.perf_counter()
    model = tiered.load(a.model_dir, ring_gb=a.ring_gb, device=a.device, dtype=a.dtype, prefetch=a.prefetch,
                        gpu_gb=a.gpu_gb, threads=a.threads, io=a.io, distributed=a.distributed, host_gb=a.host_gb,
                        expert_cache_gb=a.expert_cache_gb,
                        **({"embedding_rows": False} if a.no_embedding_rows else {}),
                        **({"routed_experts": False} if a.no_routed_experts else {}))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    if a.distributed:  # start together: load times differ by rank
        torch.distributed.barrier()
    ids = torch.randint(100, min(vocab, 30000), (a.batch, a.prompt_len), device=model.device)
    if a.warmup_tokens:
        wids = ids
        if a.warmup_prompt_len and a.warmup_prompt_len != a.prompt_len:
            wids = torch.randint(100, min(vocab, 30000), (a.batch, a.warmup_prompt_len), device=model.device,
                                 generator=torch.Generator(device=model.device).manual_seed(12345))
        with torch.no_grad():
            model.generate(wids, max_new_tokens=a.warmup_tokens, min_new_tokens=a.warmup_tokens, do_sample=False,
                           pad_token_id=0)
    clock = _Clock()
    s0 = tiered.stats(model).read_bytes
    used0 = tiered.stats(model).snapshot()
    t1 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                             streamer=clock, pad_token_id=0)
    total = time.perf_counter() - t1
    s = tiered.stats(model)
    snap = s.snapshot()
    h2d = snap["h2d_bytes"] - used0["h2d_bytes"]
    agg = None
    if a.distributed:
        import torch.distributed as tdist

        per: list[object] = [None] * tdist.get_world_size()
        tdist.all_gather_object(per, (h2d, total))
        agg = sum(b for b, _ in per) / max(t for _, t in per) / 1e9  # type: ignore[misc]
    steps = [b - a_ for a_, b in zip(clock.times, clock.times[1:], strict=False)]
    n = out.shape[1] - ids.shape[1]
    res = {
        "label": a.label,
        "rank": rank,
        "world_size": snap.get("world_size", 1),
        "h2d_gb_per_token": h2d / 1e9 / max(1, out.shape[1] - ids.shape[1]),
        "gathered_gb": snap.get("gathered_bytes", 0) / 1e9,
        "host_gb": a.host_gb,
        "host_units": snap.get("host_units", 0),
        "host_pinned_gb": snap.get("host_bytes", 0) / GiB,
        "host_expert_modules": snap.get("host_expert_modules", 0),
        # bytes the passes copied to the GPU from the host tier (units, and routed experts: no read)
        "host_used_gb_per_token": (snap.get("host_used_bytes", 0) - used0.get("host_used_bytes", 0)) / 1e9 / max(1, n),
        "host_expert_gb_per_token": (snap.get("host_expert_bytes", 0) - used0.get("host_expert_bytes", 0)) / 1e9
        / max(1, n),
        "aggregate_h2d_gbps": agg,
        "model_dir": str(a.model_dir),
        "device": str(model.device),
        "gpu": torch.cuda.get_device_name() if model.device.type == "cuda" else None,
        "cold_cache": cold,
        "ring_gb": a.ring_gb,
        "gpu_gb": a.gpu_gb,
        "threads": a.threads,
        "io": a.io,
        "prefetch": a.prefetch,
        "model_gb": snap["model_bytes"] / 1e9,
        "units": snap["units"],
        "resident_units": snap["resident_units"],
        "load_s": load_s,
        "ttft_s": clock.times[0] - t1 if clock.times else None,
        "decode_s_per_token_median": statistics.median(steps) if steps else None,
        "tokens": n,
        "batch": a.batch,
        "tokens_per_s": a.batch / statistics.median(steps) if steps else None,
        "piece_units": snap.get("piece_units", 0),
        "generate_s": total,
        "streamed_gb": (snap["read_bytes"] - s0) / 1e9,
        "streamed_gb_per_token": (snap["read_bytes"] - s0) / 1e9 / max(1, n),
        # bytes the passes used (no idle read-ahead), and of those the embedding rows (tiered/rows.py)
        "used_gb_per_token": (snap.get("streamed_bytes", 0) - used0.get("streamed_bytes", 0)) / 1e9 / max(1, n),
        "embedding_gb": (snap.get("embedding_bytes", 0) - used0.get("embedding_bytes", 0)) / 1e9,
        "row_units": snap.get("row_units", 0),
        # routed experts (tiered/experts.py): bytes per token, experts read per call of a MoE block
        "expert_modules": snap.get("expert_modules", 0),
        "expert_gb_per_token": (snap.get("expert_bytes", 0) - used0.get("expert_bytes", 0)) / 1e9 / max(1, n),
        "dense_gb_per_token": (snap.get("dense_bytes", 0) - used0.get("dense_bytes", 0)) / 1e9 / max(1, n),
        "expert_cache_slots": snap.get("expert_cache_slots", 0),
        "expert_cache_gb": snap.get("expert_cache_bytes", 0) / GiB,
        "expert_cache_hit_rate": ((snap.get("expert_cache_hits", 0) - used0.get("expert_cache_hits", 0))
                                  / max(1, snap.get("expert_cache_hits", 0) + snap.get("expert_cache_misses", 0)
                                        - used0.get("expert_cache_hits", 0) - used0.get("expert_cache_misses", 0))),
        "experts_per_call": ((snap.get("experts_read", 0) + snap.get("experts_from_host", 0)
                              - used0.get("experts_read", 0) - used0.get("experts_from_host", 0))
                             / max(1, snap.get("expert_calls", 0) - used0.get("expert_calls", 0))),
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "read_gbps": snap["read_gbps"],
        "h2d_gbps": snap["h2d_gbps"],
        "end_to_end_gbps": (snap["read_bytes"] - s0) / total / 1e9,
        "stall_s": snap["stall_s"],
        "hits": snap["hits"],
        "misses": snap["misses"],
        "ring_high_water_gb": snap["ring_high_water"] / GiB,
        "rss_base_gb": base / GiB,
        "peak_rss_over_base_gb": (snap["peak_rss"] - base) / GiB,
        "peak_rss_gb": snap["peak_rss"] / GiB,
        "rss_cuda_base_gb": cuda_base / GiB if cuda_base else None,
        "peak_rss_over_cuda_base_gb": (snap["peak_rss"] - cuda_base) / GiB if cuda_base else None,
        "rss_cuda_model_base_gb": model_base / GiB if model_base else None,
        "peak_rss_over_cuda_model_base_gb": (snap["peak_rss"] - model_base) / GiB if model_base else None,
        "gpu_peak_gb": torch.cuda.max_memory_allocated() / GiB if model.device.type == "cuda" else None,
        "tokens_out": out[0, ids.shape[1]:].tolist(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    model.close()
    if a.distributed:
        torch.distributed.destroy_process_group()
    json_line(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
