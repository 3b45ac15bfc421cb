"""Where does host RSS go? Step-by-step VmRSS/RssAnon/RssFile and the largest mappings (``/proc/self/smaps``).

    python benchmarks/rss_diag.py MODEL_DIR --ring-gb 1 --gpu-gb 2 [--io direct]

Prints one JSON line per step (after imports, after CUDA init, after load, after each forward) with the
ten mappings holding the most RSS at that point, so an RSS figure above the ring can be attributed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiered  # noqa: E402
from tiered.stats import proc_status  # noqa: E402

MiB = 1 << 20


def top_mappings(n: int = 10) -> list[tuple[int, str]]:
    """(Rss MiB, mapping name) of the n mappings with the most RSS."""
    out: list[tuple[int, str]] = []
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else f"[anon {parts[0]}]"
            elif parts[0] == "Rss:":
                kb = int(parts[1])
                if kb:
                    out.append((kb // 1024, name))
    merged: dict[str, int] = {}
    for mb, nm in out:
        merged[nm] = merged.get(nm, 0) + mb
    return sorted(((v, k) for k, v in merged.items()), reverse=True)[:n]


def step(label: str) -> None:
    st = {k: v // MiB for k, v in proc_status().items()}
    print(json.dumps({"step": label, **st, "top": top_mappings()}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ring-gb", type=float, default=1.0)
    p.add_argument("--gpu-gb", type=float, default=None)
    p.add_argument("--io", default="mmap")
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    step("imports")
    if torch.cuda.is_available():
        x = torch.ones(256, 256, device="cuda", dtype=torch.float16)
        (x @ x).sum().item()
        step("cuda-init")
    m = tiered.load(a.model_dir, ring_gb=a.ring_gb, gpu_gb=a.gpu_gb, io=a.io, threads=a.threads)
    step("loaded")
    ids = torch.randint(100, 1000, (1, 16), device=m.device)
    with torch.no_grad():
        for i in range(2):
            m(ids)
            if m.device.type == "cuda":
                torch.cuda.synchronize()
            step(f"forward-{i}")
    print(tiered.stats(m), flush=True)
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
