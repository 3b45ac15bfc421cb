"""The ``tiered`` command: ``generate`` and ``inspect``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

__all__ = ["main", "inspect_dir"]

GiB = 1 << 30


def _plan_for(model_dir: Path, dtype: str | None, device: str):
    from .format import open_checkpoint
    from .meta import meta_model_from_dir
    from .plan import build_plan

    model = meta_model_from_dir(model_dir, dtype=dtype)
    ckpt = open_checkpoint(model_dir)
    return model.config, ckpt, build_plan(model, ckpt, align=512 if device.startswith("cuda") else 64)


def inspect_dir(model_dir: str | Path, *, dtype: str | None = None, device: str = "cpu") -> dict:
    """What ``tiered inspect`` prints, as a dict (bytes are exact; GiB = 2**30 bytes)."""
    from .hostmem import page_up
    from .plan import layer_index

    model_dir = Path(model_dir)
    config, ckpt, plan = _plan_for(model_dir, dtype, device)
    dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in ckpt.tensors.values())
    # Stream order on disk: do units' spans appear in execution order and contiguous?
    spans = []
    for u in plan.units:
        offs = [(str(c.src.file), c.src.offset, c.src.offset + c.src.nbytes) for t in u.targets for c in t.copies]
        spans.append(offs)
    contiguous = 0
    for offs in spans:
        files = {f for f, _, _ in offs}
        if len(files) == 1:
            lo, hi = min(o[1] for o in offs), max(o[2] for o in offs)
            if hi - lo == sum(o[2] - o[1] for o in offs):
                contiguous += 1
    aligned = all((s.data_start % 4096) == 0 for s in ckpt.shards)
    # Stream-ordered: each unit's first byte comes after the previous unit's, in shard order.
    shard_rank = {str(s.path): i for i, s in enumerate(ckpt.shards)}
    starts = [min((shard_rank[f], lo) for f, lo, _ in offs) for offs in spans if offs]
    ordered = all(a <= b for a, b in zip(starts, starts[1:], strict=False))
    big = plan.max_unit
    return {
        "model_dir": str(model_dir),
        "architecture": (config.architectures or ["?"])[0],
        "shards": [{"file": s.path.name, "bytes": s.file_size, "tensors": len(s.tensors), "data_start": s.data_start}
                   for s in ckpt.shards],
        "tensors": len(ckpt.tensors),
        "checkpoint_bytes": ckpt.nbytes,
        "dtypes": dict(dtypes),
        "units": [{"name": u.name, "bytes": u.nbytes, "tensors": len(u.targets),
                   "layer": layer_index(u.name + ".")} for u in plan.units],
        "model_bytes": plan.nbytes,
        "largest_unit": {"name": big.name, "bytes": big.nbytes},
        # as the ring allocates them: whole pages per unit (the same figures RingTooSmallError gives)
        "ring_min_gb": page_up(big.nbytes) / GiB,
        "ring_recommended_gb": 3 * page_up(big.nbytes) / GiB,  # the running unit + prefetch=2
        "ring_resident_gb": sum(page_up(u.nbytes) for u in plan.units) / GiB,
        "units_contiguous_on_disk": contiguous,
        "stream_ordered": ordered,
        "data_aligned_4k": aligned,
        "unused_checkpoint_tensors": plan.unused,
        "skipped_tensors": {n: f"{t.dtype_name} {list(t.shape)}: {t.reason}" for n, t in ckpt.skipped.items()},
        "index_names_missing_from_shards": ckpt.index_missing,
    }


def _need_model_dir(path: str) -> Path | None:
    d = Path(path)
    if not (d / "config.json").is_file():
        what = "does not exist" if not d.exists() else "has no config.json"
        print(f"tiered: error: {d} {what}; pass a local Hugging Face model directory", file=sys.stderr)
        return None
    return d


def _cmd_inspect(a: argparse.Namespace) -> int:
    if _need_model_dir(a.model_dir) is None:
        return 2
    from .ring import gib_up

    info = inspect_dir(a.model_dir, dtype=a.dtype, device=a.device)
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['model_dir']}: {info['architecture']}, {info['tensors']} tensors, "
          f"{info['checkpoint_bytes'] / GiB:.3f} GiB in {len(info['shards'])} shard(s), dtypes {info['dtypes']}")
    for s in info["shards"]:
        print(f"  shard {s['file']}: {s['bytes'] / GiB:.3f} GiB, {s['tensors']} tensors, data at byte {s['data_start']}")
    print(f"units ({len(info['units'])}, in execution order):")
    units = info["units"]
    show = units if len(units) <= 12 or a.all else units[:5] + [None] + units[-4:]
    for u in show:
        print("  ..." if u is None else f"  {u['name']:<40} {u['bytes'] / 2**20:10.1f} MiB  {u['tensors']} tensors")
    print(f"ring needed: >= {gib_up(info['ring_min_gb'] * GiB)} GiB (largest unit {info['largest_unit']['name']}); "
          f"{gib_up(info['ring_recommended_gb'] * GiB)} GiB to prefetch 2 units; "
          f"{gib_up(info['ring_resident_gb'] * GiB)} GiB holds the whole model (CPU: loaded once)")
    print(f"layout: {'stream-ordered' if info['stream_ordered'] else 'not in execution order'}; "
          f"{info['units_contiguous_on_disk']}/{len(units)} units contiguous on disk; data sections "
          f"{'' if info['data_aligned_4k'] else 'not '}4 KiB-aligned"
          + ("" if info["units_contiguous_on_disk"] == len(units) and info["data_aligned_4k"] and info["stream_ordered"]
             else " (`tiered reshard` writes a layout that streams each unit as one span)"))
    if info["unused_checkpoint_tensors"]:
        print(f"unused checkpoint tensors: {info['unused_checkpoint_tensors'][:5]}")
    for name, why in list(info["skipped_tensors"].items())[:5]:
        print(f"skipped (torch cannot hold it; the model does not use it): {name} {why}")
    if info["index_names_missing_from_shards"]:
        print(f"the index names tensors no shard holds: {info['index_names_missing_from_shards'][:5]}")
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    import torch

    import tiered

    if _need_model_dir(a.model_dir) is None:
        return 2
    model_dir = Path(a.model_dir)
    tok = None
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    model = tiered.load(model_dir, ring_gb=a.ring_gb, device=a.device, dtype=a.dtype, prefetch=a.prefetch,
                        gpu_gb=a.gpu_gb, threads=a.threads, io=a.io)
    load_s = time.perf_counter() - t0
    with model:
        if not callable(getattr(model, "generate", None)) or not model.can_generate():
            print(f"tiered: error: {type(model).__name__} cannot generate text (not a causal LM); "
                  "use the Python API for its forward", file=sys.stderr)
            return 2
        if tok is not None and not a.ids:
            inputs = tok(a.prompt, return_tensors="pt").to(model.device)
        else:
            try:
                ids = [int(x) for x in a.prompt.replace(",", " ").split()]
            except ValueError:
                ids = None
            vocab = getattr(model.config, "vocab_size", None)
            if not ids or (vocab and not all(0 <= i < vocab for i in ids)):
                print(f"tiered: error: --prompt must be token ids in [0, {vocab}) such as '1 2 3'"
                      + ("" if tok is not None else " (no tokenizer in MODEL_DIR)"), file=sys.stderr)
                return 2
            inputs = {"input_ids": torch.tensor([ids], device=model.device)}
        if inputs["input_ids"].shape[1] == 0:
            print("tiered: error: the prompt is empty", file=sys.stderr)
            return 2
        n_in = inputs["input_ids"].shape[1]
        before = tiered.stats(model).read_bytes
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=a.max_new_tokens, do_sample=False)
        gen_s = time.perf_counter() - t1
        new = out[0, n_in:]
        s = tiered.stats(model)
        print(tok.decode(new, skip_special_tokens=True) if tok is not None and not a.ids else " ".join(map(str, new.tolist())))
        n = max(1, len(new))
        streamed = s.read_bytes - before
        print(f"[tiered] load {load_s:.2f} s; {n} tokens in {gen_s:.2f} s = {n / gen_s:.2f} tokens/s "
              f"({gen_s / n:.3f} s/token); streamed {streamed / 1e9:.2f} GB at {streamed / gen_s / 1e9:.2f} GB/s "
              "end to end", file=sys.stderr)
        print(f"[tiered] {s}", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tiered",
        description="Run Hugging Face models whose weights are larger than host RAM: weights stream from "
        "safetensors shards through a fixed host ring (RSS ~ ring size), to the GPU when there is one.",
    )
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("tiered")
    except PackageNotFoundError:  # run from a source tree that is not installed
        ver = "unknown (not installed)"
    p.add_argument("--version", action="version", version=f"tiered {ver}")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="greedy generation from a model directory, with streaming stats")
    g.add_argument("model_dir", help="Hugging Face model directory (config.json + *.safetensors)")
    g.add_argument("--prompt", default="Hello", help="text (needs a tokenizer in MODEL_DIR) or token ids '1 2 3'")
    g.add_argument("--ids", action="store_true", help="treat --prompt as token ids even if a tokenizer exists")
    g.add_argument("--max-new-tokens", type=_positive_int, default=20, help="tokens to generate (default 20)")
    g.add_argument("--ring-gb", type=float, default=4.0,
                   help="host ring size in GiB; peak RSS ~ ring + runtime (default 4)")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: config.json's dtype)")
    g.add_argument("--gpu-gb", type=float, default=None,
                   help="GiB of GPU memory for units kept resident (default: free memory - 4 GiB)")
    g.add_argument("--prefetch", type=int, default=2, help="units loaded ahead of the running one (default 2)")
    g.add_argument("--threads", type=int, default=4, help="reader threads (default 4)")
    g.add_argument("--io", choices=["mmap", "direct", "auto"], default="mmap",
                   help="mmap: through the page cache (default); direct: O_DIRECT, bypasses the page cache; "
                   "auto: direct when the model does not fit in the page cache (RAM or cgroup memory.max)")
    g.set_defaults(fn=_cmd_generate)

    i = sub.add_parser("inspect", help="shards, units, bytes, dtypes and the ring size a model needs")
    i.add_argument("model_dir")
    i.add_argument("--dtype", default=None, help="plan for this dtype (default: config.json's)")
    i.add_argument("--device", default="cpu", help="plan alignment for this device (cuda: 512 B, cpu: 64 B)")
    i.add_argument("--all", action="store_true", help="list every unit")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(fn=_cmd_inspect)

    from .reshard import add_parser as add_reshard_parser

    add_reshard_parser(sub)

    a = p.parse_args(argv)
    from .errors import TieredError

    try:
        return a.fn(a)
    except TieredError as e:
        print(f"tiered: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tiered: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
