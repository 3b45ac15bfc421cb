"""One rank of ``tests/test_dist.py``'s torchrun job (run by ``python -m torch.distributed.run``).

Each rank runs its own ids (the rank picks them) through ``tiered.load(..., distributed=True)`` on
the CPU (gloo): a forward pass and a greedy ``generate`` whose length differs per rank (so
``synced_gpus`` must keep the shorter one running). Writes ``rank{R}.pt`` (ids, logits, generated) and
``rank{R}.json`` (stats) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import tiered
from tiered.stats import proc_status


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--ring-gb", type=float, default=0.01)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="cpu (gloo), or cuda: cuda:$LOCAL_RANK (nccl)")
    ap.add_argument("--gpu-gb", type=float, default=None)
    ap.add_argument("--host-gb", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))  # as the test process
    rss0 = proc_status()["VmRSS"]
    model = tiered.load(a.model_dir, ring_gb=a.ring_gb, device=None if a.device == "cuda" else a.device,
                        gpu_gb=a.gpu_gb, host_gb=a.host_gb, distributed=True)
    import torch.distributed as dist

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 256, (1 + rank, 5 + 2 * rank), generator=g).to(model.device)
    st = tiered.stats(model)
    rss1 = proc_status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS: measure the passes' peak alone
        f.write("5")
    with torch.no_grad():
        b = st.snapshot()
        logits = model(ids).logits
        e = st.snapshot()  # units through the ring only: embedding rows depend on each rank's own ids
        fwd = e["dense_bytes"] - b["dense_bytes"]  # units through the ring: not embedding rows, not routed experts
        n = 3 + 3 * rank
        generated = model.generate(ids, max_new_tokens=n, do_sample=False)
    torch.save({"ids": ids.cpu(), "logits": logits.cpu(), "generated": generated.cpu()}, a.out / f"rank{rank}.pt")
    s = st.snapshot()
    info = {"rank": rank, "device": str(model.device),
            "world_size": s["world_size"], "max_new_tokens": n, "forward_streamed_bytes": fwd,
            "gathered_bytes": s["gathered_bytes"], "host_units": s["host_units"],
            "read_bytes": s["read_bytes"], "ring_bytes": s["ring_bytes"],
            "load_rss_growth": rss1 - rss0,
            "peak_rss_growth_in_passes": proc_status()["VmHWM"] - rss1}
    (a.out / f"rank{rank}.json").write_text(json.dumps(info))
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
