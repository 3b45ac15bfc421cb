#!/usr/bin/env python
"""Why a routed-experts decode is slower in a fresh process (diagnostic; one process, CUDA).

    python benchmarks/moe_lengths.py MODEL_DIR [--host-gb 20] [--gpu-gb 2] [--ring-gb 6] [--new-tokens 12]
        [--resident] [--profile-new]

Loads the model once (routed experts, ``host_gb``) and runs greedy decodes, each timed token by token
(``torch.cuda.synchronize`` per token), in this order:

1. ``A``: prompt A (16 tokens) — the process's first decode: new lengths, new routing;
2. ``A-again``: the same prompt — the same lengths and the same routing;
3. ``B-same-len``: prompt B (16 other tokens) — seen lengths, other routing;
4. ``C-new-len``: prompt C (40 tokens) — new lengths (40 and up), other routing;
5. ``C-again``;
6. ``D-new-len-no-cudnn``: prompt D (80 tokens) with ``torch.backends.cuda.enable_cudnn_sdp(False)`` — new
   lengths, attention on another SDPA backend (this run's tokens are not compared with anything);
7. ``E-new-len-cudnn``: prompt E (96 tokens), cuDNN back on — new lengths once more, late in the process.

If 2 and 3 are fast and 4 and 7 slow, the cost is per sequence length; if 6 is fast too, it is cuDNN's.
``--resident`` repeats 1, 2, 4 and 6 on a second, all-resident load (``gpu_gb=100``), each prompt 200 tokens
longer (lengths new to the process): whether stock compute pays it too. ``--profile-new``: a ``torch.profiler``
CPU table of 4 new-length tokens (prompt F, 120 tokens) on stderr; ``--trace PATH``: a Chrome trace of 3 more
(prompt G, 150 tokens), to read where the host waits and where the copy engine idles.
``--compare-prefetch``: the whole series again on a second routed load with ``expert_prefetch`` flipped
(the first has it as ``--expert-prefetch`` says), prompts 400 tokens longer. Prints one JSON line per decode: label,
median s/token, and each token's seconds; and one with each routed load's ``tiered.stats`` line.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import tiered

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import Clock, budget_args, greedy, parser  # noqa: E402


def _prompt(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (1, n), generator=g).cuda()


def _run(model, label: str, ids: torch.Tensor, n: int, extra: dict) -> None:
    c = Clock()
    greedy(model, ids, n, streamer=c)
    steps = [b - a for a, b in zip(c.times[1:], c.times[2:], strict=False)]  # after the prefill
    print(json.dumps({"label": label, "prompt_len": ids.shape[1], "median_s": statistics.median(steps),
                      "steps_s": [round(s, 4) for s in steps], **extra}), flush=True)


def _series(model, n: int, extra: dict, full: bool, shift: int = 0) -> None:
    a = _prompt(1, 16 + shift)
    _run(model, "A", a, n, extra)
    _run(model, "A-again", a, n, extra)
    if full:
        _run(model, "B-same-len", _prompt(2, 16 + shift), n, extra)
    c = _prompt(3, 40 + shift)
    _run(model, "C-new-len", c, n, extra)
    if full:
        _run(model, "C-again", c, n, extra)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        _run(model, "D-new-len-no-cudnn", _prompt(4, 80 + shift), n, extra)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    if full:
        _run(model, "E-new-len-cudnn", _prompt(5, 96 + shift), n, extra)


def main() -> int:
    p = parser(__doc__)
    budget_args(p, new_tokens=12, host_gb=20.0)
    p.add_argument("--resident", action="store_true", help="also the all-resident load (gpu_gb=100)")
    p.add_argument("--expert-prefetch", action="store_true", help="expert_prefetch=True in the routed load")
    p.add_argument("--compare-prefetch", action="store_true",
                   help="then the same series on a second routed load with the other expert_prefetch setting "
                        "(prompts 400 tokens longer: lengths new to the process)")
    p.add_argument("--profile-new", action="store_true", help="profile 4 new-length tokens (CPU table on stderr)")
    p.add_argument("--trace", default=None,
                   help="write a torch.profiler Chrome trace (JSON) of 3 new-length tokens (prompt G, 150) to this path")
    a = p.parse_args()
    pf = a.expert_prefetch
    with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=a.gpu_gb, threads=a.threads, host_gb=a.host_gb,
                     expert_prefetch=pf) as m:
        _series(m, a.new_tokens, {"load": "routed+host", "expert_prefetch": pf}, full=True)
        print(json.dumps({"label": "stats", "load": "routed+host", "expert_prefetch": pf,
                          "stats": str(tiered.stats(m))}), flush=True)
        if a.profile_new:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _run(m, "F-new-len-profiled", _prompt(6, 120), 4, {"load": "routed+host"})
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), file=sys.stderr)
        if a.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _run(m, "G-new-len-traced", _prompt(7, 150), 3, {"load": "routed+host"})
            prof.export_chrome_trace(a.trace)
    if a.compare_prefetch:
        torch.cuda.empty_cache()
        with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=a.gpu_gb, threads=a.threads, host_gb=a.host_gb,
                         expert_prefetch=not pf) as m:
            _series(m, a.new_tokens, {"load": "routed+host", "expert_prefetch": not pf}, full=True, shift=400)
            print(json.dumps({"label": "stats", "load": "routed+host", "expert_prefetch": not pf,
                              "stats": str(tiered.stats(m))}), flush=True)
    if a.resident:
        torch.cuda.empty_cache()
        with tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=100, threads=a.threads) as m:
            _series(m, a.new_tokens, {"load": "resident"}, full=False, shift=200)  # lengths new to the process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
