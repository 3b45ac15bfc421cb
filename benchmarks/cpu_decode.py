#!/usr/bin/env python
"""CPU decode rates of the lossless codes (issue 25, item 3: "on the CPU, at least the cold disk's rate with the reader
threads tiered uses by default").

    python benchmarks/cpu_decode.py [--mib 256] [--threads 1,2,4] [--rounds 3] [--out results.json]

Random-normal bf16 weights (std 0.02) are coded in the converter's 4 MiB chunks (``tiered.lossless.encode``: the
checkpoint's own layout, with a CRC-32 per chunk), then decoded into one output buffer by each decoder, with each
thread count (threads take every T-th chunk), the way the reader threads decode them (``tiered.lossless.decode_into``,
one chunk a call, CRC-32 checked first):

* ``zstd`` — ``bytegroup-zstd1`` (the ``--compress`` default);
* ``exp3-c`` — ``exp3-bf16`` with the C decoder (``tiered.native``: AVX2 where the CPU has it);
* ``exp3-c-scalar`` — the C decoder's scalar path (CPUs without AVX2);
* ``exp3-numpy`` — ``exp3-bf16`` with numpy (``TIERED_NATIVE=0``, or no C compiler);
* ``crc32`` — ``tiered.lossless.crc32`` (ISA-L's where ``isal`` is installed, else zlib's) of the exp3 chunks alone
  (part of every decode above);
* ``memcpy`` — ``numpy.copyto`` of the plain bytes (what reading a plain checkpoint from the page cache costs at least).

Rows are GB/s of plain (decoded) bytes, except ``crc32`` (coded bytes); every decode is checked bitwise against the
input. Decoders alternate within a round, reversed on odd rounds; the summary gives median, min and max.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiered import expcode, lossless, native  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    n = a.mib << 19  # bf16 elements
    w = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    raw = w.view(torch.uint8).numpy()
    blobs = {c: lossless.encode(raw, 2, codec=c) for c in (lossless.CODEC, lossless.EXP3)}
    lib = native.exp3()
    info = {"ratio_zstd": len(blobs[lossless.CODEC][0]) / raw.size, "ratio_exp3": len(blobs[lossless.EXP3][0]) / raw.size,
            "c_decoder": lib is not None, "c_simd": bool(lib.tiered_exp3_simd()) if lib else False,
            "why_not": native.why_not, "crc32": f"{lossless.crc32.__module__}.crc32"}
    print(json.dumps(info), flush=True)
    out = np.empty_like(raw)

    def decode(codec: str, chunks: range) -> None:
        blob, coded = blobs[codec]
        for c in chunks:
            lossless.decode_into(blob, coded, out, range(c, c + 1))

    def crc(chunks: range) -> None:
        blob, coded = blobs[lossless.EXP3]
        mv = memoryview(blob)
        for c in chunks:
            s, ln = coded.chunk_span(c)
            lossless.crc32(mv[s: s + ln])

    def copy(chunks: range) -> None:
        step = lossless.DEFAULT_CHUNK_BYTES
        for c in chunks:
            np.copyto(out[c * step: (c + 1) * step], raw[c * step: (c + 1) * step])

    nchunks = len(blobs[lossless.EXP3][1].lens)
    ways = {"zstd": functools.partial(decode, lossless.CODEC), "exp3-c": functools.partial(decode, lossless.EXP3),
            "exp3-c-scalar": None, "exp3-numpy": None, "crc32": crc, "memcpy": copy}
    scalar = functools.partial(expcode.decode_cpu, simd=False)

    def run(name: str, t: int) -> float:
        saved = expcode.decode_cpu
        if name == "exp3-c-scalar":
            expcode.decode_cpu = scalar
        elif name == "exp3-numpy":
            expcode.decode_cpu = expcode.decode_np
        try:
            fn = ways[name] or functools.partial(decode, lossless.EXP3)
            out.fill(0)
            parts = [range(k, nchunks, t) for k in range(t)]
            with ThreadPoolExecutor(t) as ex:
                t0 = time.perf_counter()
                list(ex.map(fn, parts))
                dt = time.perf_counter() - t0
        finally:
            expcode.decode_cpu = saved
        if name not in ("crc32",):
            assert np.array_equal(out, raw), name
        size = len(blobs[lossless.EXP3][0]) if name == "crc32" else raw.size
        return size / dt / 1e9

    names = [k for k in ways if lib is not None or not k.startswith("exp3-c")]
    rows = []
    for r in range(a.rounds):
        for t in threads:
            for name in (names if r % 2 == 0 else names[::-1]):
                g = run(name, t)
                rows.append({"round": r, "way": name, "threads": t, "gbps": g})
                print(f"round {r} {name:<14} x{t}: {g:6.2f} GB/s", flush=True)
    summary = {}
    for name in names:
        for t in threads:
            v = [x["gbps"] for x in rows if x["way"] == name and x["threads"] == t]
            summary[f"{name} x{t}"] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), **info, "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
