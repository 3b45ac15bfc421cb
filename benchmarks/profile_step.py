"""Where a decode step's time goes: tiered against stock ``transformers``, both loaded in one process.

Usage::

    python benchmarks/profile_step.py MODEL_DIR [--ring-gb G] [--tokens N] [--rounds R] [--out FILE]

Loads MODEL_DIR with ``AutoModelForCausalLM.from_pretrained(dtype="auto")`` and with ``tiered.load`` (``--ring-gb``
defaults to the checkpoint's size + 64 MiB: every unit resident on the CPU), checks their greedy tokens are equal,
then times ``--rounds`` rounds of one ``generate`` of ``--tokens`` tokens each, alternating which model goes first, and
prints the median decode s/token (min-max) of each. Last, one ``torch.profiler`` trace of a ``generate`` per model:
the top ops by self CPU time, and the per-step Python cost outside torch ops (``cProfile``'s top functions by total
time), so that a gap shows as ops one side runs and the other does not, or as Python time. Results as JSON lines on
stdout and in ``--out``. Used for issue 22's bf16 resident gap (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class _Clock:
    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _decode(model: Any, ids: Any, tokens: int) -> tuple[float, list[int]]:
    import torch

    clock = _Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, streamer=clock, pad_token_id=0)
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:], strict=False)]
    return statistics.median(steps), out[0, ids.shape[1]:].tolist()


def _steps(models: dict[str, Any], ids: Any, n: int) -> list[dict[str, Any]]:
    """One-token decode steps after the prompt, ``n`` per model, alternating models step by step (so a noisy
    neighbour slows both alike): each model's KV cache is cropped back to the prompt after every step."""
    import torch

    state = {}
    with torch.no_grad():
        for k, m in models.items():
            out = m(ids, use_cache=True)
            state[k] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
        t: dict[str, list[float]] = {k: [] for k in models}
        for r in range(n):
            for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
                pkv, tok = state[k]
                t0 = time.perf_counter()
                models[k](tok, past_key_values=pkv, use_cache=True)
                t[k].append(time.perf_counter() - t0)
                pkv.crop(ids.shape[1])
    first = next(iter(models))
    return [{"kind": "steps", "model": k, "n": n, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
             "p25_s": statistics.quantiles(v, n=4)[0], "p75_s": statistics.quantiles(v, n=4)[2],
             "ratio_to_first": statistics.median(v) / statistics.median(t[first])} for k, v in t.items()]


def _profile(model: Any, ids: Any, tokens: int, top: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _decode(model, ids, tokens)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    pr = cProfile.Profile()
    pr.enable()
    _decode(model, ids, tokens)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    ev = prof.key_averages()
    return {"ops": table, "python": s.getvalue(), "op_count": sum(e.count for e in ev),
            "self_cpu_ms": sum(e.self_cpu_time_total for e in ev) / 1e3, "threads": torch.get_num_threads()}


def _linear_weights(model: Any, ids: Any) -> list[Any]:
    """The weight each ``nn.Linear`` computes with, in call order (read in a forward pre-hook: bound there)."""
    import torch

    seen: list[Any] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(ids[:, :1])
    for h in hooks:
        h.remove()
    return seen


def _weights_bench(models: dict[str, Any], ids: Any, reps: int) -> list[dict[str, Any]]:
    """Each model's linear weights alone: one-row ``F.linear`` over all of them, ``reps`` rounds, alternating models.
    Equal times here and unequal decode times put the gap outside the weights' memory."""
    import torch
    import torch.nn.functional as F

    ws = {k: _linear_weights(m, ids) for k, m in models.items()}
    w0 = next(iter(ws.values()))[0]
    x = torch.randn(1, 1, w0.shape[1], dtype=w0.dtype)
    t: dict[str, list[float]] = {k: [] for k in models}
    with torch.no_grad():
        for r in range(reps):
            for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
                t0 = time.perf_counter()
                for w in ws[k]:
                    F.linear(x if w.shape[1] == x.shape[-1] else x.new_ones(1, 1, w.shape[1]), w)
                t[k].append(time.perf_counter() - t0)
    return [{"kind": "weights", "model": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
             "ptr_mod_4096": sorted({w.data_ptr() % 4096 for w in ws[k]})[:4]} for k, v in t.items()]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name (/proc/self/task/*/stat)."""
    import os

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc/self/task").iterdir():
        try:
            st = (d / "stat").read_text()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[f"{name}:{d.name}"] = (int(f[11]) + int(f[12])) / tick
    return out


def _cloned(model: Any) -> Any:
    """A probe, not a mode of tiered: every bound (resident) parameter replaced by a ``torch`` allocation holding the
    same bytes (as stock's ``from_pretrained`` leaves them), so that a gap that stays is not where the weights live."""
    import torch

    from tiered.placeholder import is_placeholder

    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is not None and not is_placeholder(p):
                mod._parameters[k] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ring-gb", type=float, default=None)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--steps", type=int, default=0, help="also this many one-token decode steps per model, alternating")
    p.add_argument("--no-rewarm", action="store_true",
                   help="skip evicting and re-reading the shards first (benchmarks/run.py warm_page_cache)")
    p.add_argument("--weights", action="store_true", help="also time each model's linear weights alone (resident models)")
    p.add_argument("--models", default="stock,tiered",
                   help="comma list of: stock, tiered, tiered-copy (zero_copy=False), tiered-clone (resident weights cloned into "
                        "torch allocations: a probe), accelerate (disk offload with "
                        "max_memory={'cpu': --cpu-gb}); the first is the reference for tokens_equal")
    p.add_argument("--cpu-gb", type=float, default=None, help="accelerate's max_memory['cpu'] (default: the ring)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import tiered
    from benchmarks.run import warm_page_cache

    if not a.no_rewarm:
        warm_page_cache(a.model_dir)

    size = sum(f.stat().st_size for f in a.model_dir.glob("*.safetensors"))
    ring = a.ring_gb if a.ring_gb is not None else (size * 1.02 + (64 << 20)) / 2**30
    makers = {
        "stock": lambda: AutoModelForCausalLM.from_pretrained(a.model_dir, dtype="auto").eval(),
        "tiered": lambda: tiered.load(a.model_dir, ring_gb=ring, device="cpu"),
        "tiered-copy": lambda: tiered.load(a.model_dir, ring_gb=ring, device="cpu", zero_copy=False),
        "tiered-clone": lambda: _cloned(tiered.load(a.model_dir, ring_gb=ring, device="cpu")),
        "accelerate": lambda: AutoModelForCausalLM.from_pretrained(
            a.model_dir, dtype="auto", device_map="auto", offload_folder=str(a.model_dir / "offload-profile"),
            max_memory={"cpu": f"{a.cpu_gb if a.cpu_gb is not None else ring}GiB"}).eval(),
    }
    models = {k: makers[k]() for k in a.models.split(",")}
    ids = torch.tensor([[1, 450, 7483, 310, 3444, 338, 263, 4086]], dtype=torch.long)
    toks = {k: _decode(m, ids, a.tokens)[1] for k, m in models.items()}  # also the warm-up
    rows: list[dict[str, Any]] = [{"kind": "setup", "ring_gb": ring, "threads": torch.get_num_threads(),
                                   "tokens_equal": all(t == next(iter(toks.values())) for t in toks.values()),
                                   "torch": torch.__version__}]
    rows[0]["smaps_rollup"] = Path("/proc/self/smaps_rollup").read_text().split("\n", 1)[1]
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(a.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for k in order:
            times[k].append(_decode(models[k], ids, a.tokens)[0])
    for k, v in times.items():
        rows.append({"kind": "decode", "model": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)})
    if a.steps:
        rows += _steps(models, ids, a.steps)
    if a.weights:
        rows += _weights_bench(models, ids, max(5, a.rounds))
    before = _thread_cpu()
    _decode(models.get("tiered", next(iter(models.values()))), ids, a.tokens)
    after = _thread_cpu()
    rows.append({"kind": "thread_cpu_tiered_generate", **{k: round(v - before.get(k, 0.0), 3) for k, v in after.items()
                                                          if v - before.get(k, 0.0) > 0}})
    if not a.no_profile:
        for k, m in models.items():
            rows.append({"kind": "profile", "model": k, **_profile(m, ids, a.tokens, a.top)})
    for row in rows:
        if row["kind"] == "profile":
            print(f"== {row['model']}: {row['op_count']} ops, {row['self_cpu_ms']:.1f} ms self CPU\n{row['ops']}\n"
                  f"{row['python']}")
        else:
            print(json.dumps(row))
    if a.out:
        a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in models:
        if k.startswith("tiered"):
            models[k].close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
