#!/usr/bin/env python
"""How well the next MoE block's experts can be guessed before its router runs (diagnostic; stock transformers).

Speculative expert prefetch (issue 8: copy block ``i + 1``'s experts while block ``i`` computes) pays only if the
guess is right often: a wrong guess costs link time, the bottleneck of routed experts from the host tier. The
guess tried here is the published one (Eliseev & Mazur, "Fast inference of mixture-of-experts language models
with offloading", 2023): block ``i + 1``'s router weights applied to block ``i``'s experts input (the hidden
state after block ``i``'s attention and post-attention norm), top-k. The script runs greedy ``generate`` with
stock ``transformers`` on the CPU, records every experts call's input and ``top_k_index``, and prints, over the
decode steps, the fraction of each block's routed experts the guess contained (chance is k / E).

    python benchmarks/moe_predict.py MODEL_DIR [--new-tokens 16] [--prompt-len 16]

One JSON line. A model with a router whose ``weight`` is ``(E, hidden)`` (Mixtral, Qwen2/3-MoE, OLMoE, ...).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import greedy, parser  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    m = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    blocks = [getattr(layer, "block_sparse_moe", None) or layer.mlp for layer in m.model.layers]
    blocks = [b for b in blocks if hasattr(b, "experts") and hasattr(b, "gate")]
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, []).append((args[0].detach().clone(), args[1].detach().clone()))
        return hook

    for i, b in enumerate(blocks):
        b.experts.register_forward_pre_hook(record(i), with_kwargs=True)
    ids = torch.randint(100, m.config.vocab_size - 1, (1, a.prompt_len), generator=torch.Generator().manual_seed(a.seed))
    greedy(m, ids, a.new_tokens)
    k = m.config.num_experts_per_tok
    E = blocks[0].gate.weight.shape[0]
    hit = total = 0
    for i in range(len(blocks) - 1):
        w = blocks[i + 1].gate.weight
        for (x, _), (_, actual) in zip(seen[i][1:], seen[i + 1][1:], strict=True):  # decode steps, not the prefill
            guess = torch.nn.functional.linear(x, w).topk(k, dim=-1).indices
            g, r = set(guess.flatten().tolist()), set(actual.flatten().tolist())
            hit += len(g & r)
            total += len(r)
    print(json.dumps({"model_dir": a.model_dir, "blocks": len(blocks), "experts": E, "top_k": k,
                      "decode_steps": a.new_tokens - 1, "guessed_fraction": hit / max(1, total), "chance": k / E,
                      "routed_experts_counted": total}))


if __name__ == "__main__":
    main()
