"""One-off (nineteenth session, 2026-12-07): the CPU page-cache tier beside O_DIRECT copies, old vs new tiered.

    python THIS make OUT LAYERS                       # fp32 Llama, hidden 2048, intermediate 16384: 448 MiB layers
    PYTHONPATH=<a checkout> python THIS run OUT RING_GB

``run`` patches the page-cache room to just under the checkpoint (io="auto" -> O_DIRECT with a page-cache tier, as
tests/test_io_choice.py does), loads with ``ring_gb=RING_GB``, and prints s per forward (4 forwards of 8 tokens), the
mapped units, how often one ran without its ring room, and peak RSS growth (VmHWM - VmRSS before load, MiB; this
includes importing the Llama classes, ~180 MiB, which tests/test_rss.py imports before its baseline).
"""

import json
import sys
import time
from pathlib import Path

import torch


def make(out: Path, layers: int) -> None:
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=16384,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                   tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(7)
    save_file({k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}, str(out / "model.safetensors"))
    cfg.save_pretrained(out)


def run(d: str, ring_gb: float) -> None:
    import tiered
    import tiered.machine
    import tiered.policy
    from tiered.format import open_checkpoint
    from tiered.stats import proc_status

    total = open_checkpoint(d).nbytes
    tiered.machine.page_cache_room = lambda: (total - 1, "cgroup /x memory.max=1")
    tiered.policy.page_cache_reserve = lambda threads: 0
    ids = torch.arange(1, 9).unsqueeze(0)
    base = proc_status()["VmRSS"]
    m = tiered.load(d, device="cpu", ring_gb=ring_gb, host_gb=0, io="auto", compute_threads="auto")
    ts = []
    with torch.no_grad():
        for _ in range(4):
            t = time.perf_counter()
            m(ids)
            ts.append(time.perf_counter() - t)
    s = tiered.stats(m)
    print(json.dumps({"tiered": tiered.__file__, "s": [round(x, 3) for x in ts], "mapped": len(s.placement.mapped),
                      "unreserved": s.snapshot().get("mapped_unreserved"),
                      "room": getattr(m._tiered.streamer, "mapped_room", None) is not None,
                      "growth_mib": (proc_status()["VmHWM"] - base) >> 20}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        run(sys.argv[2], float(sys.argv[3]))
