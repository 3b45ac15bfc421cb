"""Soak: many streamed decode steps on one loaded model, host RSS sampled throughout.

Every unit streams on every step (``ring_gb`` below the model, ``gpu_gb=0`` on CUDA), so each
step allocates and frees ring slots, device buffers and load jobs: a leak of any of them shows up
as RSS growth (or a hang, or an error). Greedy ids are checked against stock ``transformers`` on
the first round. Prints one JSON line: steps, s/step, RSS after warm-up and at the end (bytes,
VmRSS sampled every 50 ms by a thread), growth, and the ring's allocated bytes once idle.

    python benchmarks/soak.py [MODEL_DIR] --steps 1000 [--device cpu|cuda] [--out results.jsonl]

Without MODEL_DIR a small Llama-shaped checkpoint (8 layers, hidden 256, fp32) is generated in a
temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import tiered  # noqa: E402
from tiered.stats import proc_status  # noqa: E402

GiB = 1 << 30
ROUND = 50  # decode steps per generate() call; the KV cache restarts each round


def _checkpoint(tmp: Path) -> Path:
    from models import save_model

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return save_model(transformers.LlamaForCausalLM(cfg), tmp / "soak-llama", seed=11, dtype=torch.float32,
                      max_shard_size="2MB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, nargs="?", default=None)
    p.add_argument("--steps", type=int, default=1000, help="decode steps in all (default 1000)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ring-units", type=float, default=3.0, help="ring size in units of the largest unit (default 3)")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line here")
    a = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        d = a.model_dir or _checkpoint(Path(tmp))
        with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
            plan = probe._tiered.plan
        ring_gb = a.ring_units * plan.max_unit.nbytes / GiB
        extra = {"gpu_gb": 0} if a.device.startswith("cuda") else {}
        ids = torch.randint(0, 200, (1, 8)).to(a.device)
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, device_map=a.device).eval()
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=ROUND, do_sample=False, pad_token_id=0)
        del ref
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter(), proc_status().get("VmRSS", 0)))
                stop.wait(0.05)

        model = tiered.load(d, device=a.device, ring_gb=ring_gb, **extra)
        assert tiered.stats(model).resident_units == 0, "the soak must stream every unit"
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        times: list[float] = []
        rss_rounds: list[int] = []
        steps = 0
        with torch.no_grad():
            while steps < a.steps:
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=ROUND, do_sample=False, pad_token_id=0)
                times.append((time.perf_counter() - t0) / ROUND)
                if steps == 0 and not torch.equal(out, want):
                    print("greedy ids differ from stock transformers", file=sys.stderr)
                    return 1
                steps += ROUND
                rss_rounds.append(proc_status()["VmRSS"])
        stop.set()
        sampler.join()
        s = tiered.stats(model)
        model._tiered.streamer.stop()  # no more prefetches: what the ring still holds is a leak
        for f in list(model._tiered.streamer.pending.values()):
            model._tiered.streamer.loader.discard(f)
        time.sleep(0.2)
        if a.device.startswith("cuda"):
            model._tiered.streamer.stage.retire(block=True)
        idle_used = model._tiered.ring.used - sum(
            ld.slot.size for ld in model._tiered.streamer.resident.values() if ld.slot is not None)
        model.close()
        warm = rss_rounds[1] if len(rss_rounds) > 1 else rss_rounds[0]
        row = {
            "device": a.device, "steps": steps, "model_bytes": plan.nbytes, "ring_bytes": s.ring_bytes,
            "units_streamed": s.units_streamed, "read_gb": s.read_bytes / 1e9,
            "s_per_step_median": statistics.median(times),
            "rss_after_round2": warm, "rss_end": rss_rounds[-1], "rss_growth": rss_rounds[-1] - warm,
            "rss_max_sampled": max(r for _, r in samples), "rss_samples": len(samples),
            "rss_round_median_first5": statistics.median(rss_rounds[1:6]) if len(rss_rounds) > 5 else warm,
            "rss_round_median_last5": statistics.median(rss_rounds[-5:]),
            "ring_used_when_idle": idle_used,
        }
    line = json.dumps(row)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0 if idle_used == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
