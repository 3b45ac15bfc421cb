"""The ``tiered`` command: ``generate``, ``inspect`` and ``reshard`` (:mod:`tiered.reshard`).

Every argument is checked before any weight is read, and before torch or transformers is imported
where the check does not need them (this module imports neither at import time; building the parser
and the option checks are pure Python): option ranges, ``--device``'s form, the model directory and
its ``config.json``, then the tokenizer and chat template (which need transformers), then the load.

Exit status: 0 done; 1 a runtime error (a :class:`~tiered.errors.TieredError`: a bad shard, ...),
printed as ``tiered: error: ...``; 2 a usage error (a bad option value, a missing model directory or
tokenizer), printed by argparse as ``tiered <command>: error: ...`` and naming the flag (``--ring-gb``,
never ``ring_gb``: errors ``tiered.load`` raises about its options are translated); 130 interrupted.

Figures: bytes moved in GB (1e9), rates in GB/s, memory sizes in GiB (2**30) (see :mod:`tiered.stats`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

from .stats import GiB, gb, gbps, gib, proc_status, sig3

__all__ = ["main", "inspect_dir", "build_parser"]


# ---------------------------------------------------------------------------------------------- inspect


def _plan_for(model_dir: Path, dtype: str | None, device: str):
    from .format import open_checkpoint
    from .meta import meta_model_from_dir
    from .plan import build_plan

    model = meta_model_from_dir(model_dir, dtype=dtype)
    ckpt = open_checkpoint(model_dir)
    return model.config, ckpt, build_plan(model, ckpt, align=512 if device.startswith("cuda") else 64)


def inspect_dir(model_dir: str | Path, *, dtype: str | None = None, device: str = "cpu",
                placement: dict | None = None) -> dict:
    """What ``tiered inspect`` prints, as a dict (bytes are exact; GiB = 2**30 bytes).

    ``placement``: ``tiered.load`` options (``ring_gb``, ``gpu_gb``, ``host_gb``, ``prefetch``, ``io``) and ``gbps``
    (bandwidths, :data:`tiered.placement.GBPS`'s keys): adds ``"placement"`` (where each unit goes; ``"io"``: the
    backend, ``"auto"`` resolved) and ``"predicted"`` (decode s/token, warm and cold; CUDA only) from
    :mod:`tiered.placement`."""
    from .hostmem import page_up
    from .plan import layer_index

    model_dir = Path(model_dir)
    config, ckpt, plan = _plan_for(model_dir, dtype, device)
    placed = None
    if placement is not None:
        from .placement import place_here, predict

        opts = {k: v for k, v in placement.items() if k != "gbps"}
        _, fresh_ckpt, fresh = _plan_for(model_dir, dtype, device)  # place() routes experts out of its plan's units
        pl = place_here(fresh, device=device, ckpt_bytes=fresh_ckpt.nbytes, config=config, strict=False, **opts)
        placed = {"options": opts, **pl.as_dict(),
                  # resident: on the GPU on CUDA; on the CPU in the ring, which then holds the whole model
                  "units": {u.name: (("gpu" if device.startswith("cuda") else "ring") if u.index in pl.resident
                                     else "host" if u.index in pl.host
                                     else "rows" if u.index in pl.rows else "streamed") for u in fresh.units},
                  "predicted": predict(pl, placement.get("gbps")) if device.startswith("cuda") else None}
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
    seen: set[tuple[str, int]] = set()
    starts = []
    for offs in spans:  # a unit's own bytes: a tied head reads the embedding's, which lie earlier
        own = [(shard_rank[f], lo) for f, lo, _ in offs if (f, lo) not in seen]
        seen.update((f, lo) for f, lo, _ in offs)
        if own:
            starts.append(min(own))
    ordered = all(a <= b for a, b in zip(starts, starts[1:], strict=False))
    big = plan.max_unit
    # CPU defaults (io="mmap", zero copy, embedding rows): units that compute on views of the file mapping and
    # embeddings that read their rows need no ring; only the others (cast or converted) are copied into it
    from .reader import zero_copy_eligible
    from .rows import row_eligible

    in_ring = [u for u in plan.units if not row_eligible(u) and not (device == "cpu" and zero_copy_eligible(u))]
    return {
        "placement": placed,
        "experts": _experts_info(config, plan),
        "model_dir": str(model_dir),
        "architecture": (config.architectures or ["?"])[0],
        "shards": [{"file": s.path.name, "bytes": s.file_size, "tensors": len(s.tensors), "data_start": s.data_start}
                   for s in ckpt.shards],
        "tensors": len(ckpt.tensors),
        "checkpoint_bytes": ckpt.nbytes,
        "dtypes": dict(dtypes),
        "units": [{"name": u.name, "bytes": u.nbytes, "tensors": len(u.targets),
                   "layer": layer_index(u.name + ".")} for u in plan.units],
        "model_bytes": plan.weight_bytes,  # distinct weights (a tied head is not counted twice)
        "layout_bytes": plan.nbytes,  # every unit's aligned layout (a tied head is a unit of its own)
        "largest_unit": {"name": big.name, "bytes": big.nbytes},
        # as the ring allocates them: whole pages per unit (the same figures RingTooSmallError gives)
        "ring_min_gb": page_up(big.nbytes) / GiB,
        # the running unit + prefetch=2, never more than the whole model
        "ring_recommended_gb": min(3 * page_up(big.nbytes), sum(page_up(u.nbytes) for u in plan.units)) / GiB,
        "ring_resident_gb": sum(page_up(u.nbytes) for u in plan.units) / GiB,
        # with the defaults, the largest unit the ring must hold (0: none; CPU zero copy and embedding rows)
        "ring_min_default_gb": max((page_up(u.nbytes) for u in in_ring), default=0) / GiB,
        "ring_free_units": len(plan.units) - len(in_ring),
        "units_contiguous_on_disk": contiguous,
        "stream_ordered": ordered,
        "data_aligned_4k": aligned,
        "unused_checkpoint_tensors": plan.unused,
        "skipped_tensors": {n: f"{t.dtype_name} {list(t.shape)}: {t.reason}" for n, t in ckpt.skipped.items()},
        "index_names_missing_from_shards": ckpt.index_missing,
    }


def _expert_layout(spec) -> tuple[int, int]:
    """(ranges of the file, reader requests) for each expert of ``spec`` — the most over its experts.

    Ranges: the expert's source bytes merged where adjacent in one file. Requests: as
    :func:`tiered.experts.merge_adjacent` groups them (adjacent in the file *and* in one destination tensor),
    worked out on ``meta`` tensors (no memory).
    """
    import torch

    slabs = [torch.empty(p.slab_shape, dtype=p.target.dtype, device="meta") for p in spec.parts]
    most_spans = most_reads = 0
    for j in range(spec.num_experts):
        items = []
        for k, (p, slab) in enumerate(zip(spec.parts, slabs, strict=True)):
            for info, dest in p.per[j]:
                d = slab if dest is None else dest(slab)
                items.append((str(info.file), info.offset, info.nbytes, info.dtype, k, d.storage_offset(), d.numel()))
        items.sort(key=lambda i: (i[0], i[1]))
        spans = reads = 0
        prev = None
        for it in items:
            adjacent = prev is not None and prev[0] == it[0] and it[1] == prev[1] + prev[2]
            spans += not adjacent
            reads += not (adjacent and prev[3] == it[3] and prev[4] == it[4] and it[5] == prev[5] + prev[6])
            prev = it
        most_spans, most_reads = max(most_spans, spans), max(most_reads, reads)
    return most_spans, most_reads


def _experts_info(config, plan) -> dict | None:
    """MoE blocks whose experts can be routed (``tiered/experts.py``): their layout on disk and the bytes a decode
    token of batch 1 needs when routed (dense part + top-k experts per block) against all of them. None if none.

    ``spans_per_expert``: the most ranges of the file one expert's bytes take (1: contiguous, one read);
    ``reads_per_expert``: the requests the reader makes for one expert (adjacent ranges that land in two
    different stacked parameters are two copies); ``layout``: ``"per-expert"`` (checkpoint tensors per expert,
    as Mixtral's ``experts.j.w1``), ``"stacked"`` (``(E, ...)`` tensors: one range per stacked tensor, which
    ``tiered reshard`` keeps) or ``"mixed"``.
    """
    from .experts import find_experts

    specs = [s for u in plan.units for s in find_experts(u)]
    if not specs:
        return None
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1
    spans = reads = 0
    for s in specs:
        a, b = _expert_layout(s)
        spans, reads = max(spans, a), max(reads, b)
    kinds = {dest is None for s in specs for p in s.parts for per in p.per for _, dest in per}
    layout = "mixed" if len(kinds) > 1 else "stacked" if kinds == {True} else "per-expert"
    from .rows import row_eligible

    experts_total = sum(s.num_experts * s.expert_src_bytes for s in specs)
    rows = [u for u in plan.units if row_eligible(u)]  # streamed, an embedding reads only its looked-up rows
    row_bytes = sum(u.src_bytes // max(1, u.module.num_embeddings) for u in rows)  # one row each at batch 1
    everything = sum(u.src_bytes for u in plan.units)
    dense = everything - sum(u.src_bytes for u in rows) - experts_total
    routed = sum(min(k, s.num_experts) * s.expert_src_bytes for s in specs)
    # a MoE block's unit once its experts are routed out (tiered.experts.route_out's layout, not applied here)
    from .experts import _align

    gone = {id(p.target) for s in specs for p in s.parts}
    left = 0
    for u in {id(s.unit): s.unit for s in specs}.values():
        off = 0
        for t in u.targets:
            if id(t) not in gone:
                off = _align(off, plan.align) + t.nbytes
        left = max(left, _align(off, plan.align))
    return {"routed_unit_max_bytes": left,"blocks": len(specs), "experts_per_block": specs[0].num_experts, "top_k": k,
            "expert_bytes": specs[0].expert_src_bytes, "layout": layout, "spans_per_expert": spans,
            "experts_contiguous": spans == 1, "reads_per_expert": reads,
            "dense_bytes": dense, "experts_bytes": experts_total, "routed_experts_bytes": routed,
            "embedding_row_bytes": row_bytes, "all_bytes": everything,
            "routed_bytes_per_token": dense + row_bytes + routed}


def _cmd_inspect(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_model_dir(parser, a.model_dir)
    placement = None
    if a.ring_gb is not None or a.gpu_gb is not None or a.host_gb or a.io is not None:
        from .placement import GBPS

        gbps = {k: v for k, v in (("disk", a.disk_gbps), ("page_cache", a.cache_gbps), ("h2d", a.h2d_gbps))
                if v is not None}
        placement = {"ring_gb": a.ring_gb if a.ring_gb is not None else 4.0, "gpu_gb": a.gpu_gb,
                     "host_gb": a.host_gb, "prefetch": a.prefetch, "io": a.io or "mmap", "gbps": {**GBPS, **gbps}}
    with _option_errors_as_usage(parser):
        info = inspect_dir(a.model_dir, dtype=a.dtype, device=a.device, placement=placement)
    from .ring import gib_up

    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['model_dir']}: {info['architecture']}, {info['tensors']} tensors, "
          f"{gib(info['checkpoint_bytes'])} in {len(info['shards'])} shard(s), dtypes {info['dtypes']}")
    for s in info["shards"]:
        print(f"  shard {s['file']}: {gib(s['bytes'])}, {s['tensors']} tensors, data at byte {s['data_start']}")
    print(f"units ({len(info['units'])}, in execution order):")
    units = info["units"]
    show = units if len(units) <= 12 or a.all else units[:5] + [None] + units[-4:]
    where = (info["placement"] or {}).get("units", {})  # with placement options: each unit's tier
    for u in show:
        print("  ..." if u is None else f"  {u['name']:<40} {u['bytes'] / 2**20:10.1f} MiB  {u['tensors']} tensors"
              + (f"  -> {where[u['name']]}" if u["name"] in where else ""))
    if info["ring_free_units"] and info["ring_min_default_gb"] < info["ring_min_gb"]:
        cpu = a.device == "cpu"
        why = ("compute on views of the file mapping (zero copy) or read embedding rows" if cpu
               else "read embedding rows")
        need = (f">= {gib_up(info['ring_min_default_gb'] * GiB)} GiB" if info["ring_min_default_gb"]
                else "any size (a small one bounds RSS best)")
        print(f"ring needed with the defaults: {need}: {info['ring_free_units']} of {len(units)} units {why} and "
              f"need no ring slot" + ("" if cpu else "; units larger than the ring are read in pieces when they can be cut"))
        print(f"ring to copy every unit into it ({'zero_copy=False, ' if cpu else ''}embedding_rows=False): "
              f">= {gib_up(info['ring_min_gb'] * GiB)} GiB (largest unit {info['largest_unit']['name']}); "
              f"{gib_up(info['ring_recommended_gb'] * GiB)} GiB to prefetch 2 units; "
              f"{gib_up(info['ring_resident_gb'] * GiB)} GiB holds the whole model"
              + (" (loaded once)" if a.device == "cpu" else ""))
    else:
        print(f"ring needed: >= {gib_up(info['ring_min_gb'] * GiB)} GiB (largest unit {info['largest_unit']['name']}); "
              f"{gib_up(info['ring_recommended_gb'] * GiB)} GiB to prefetch 2 units; "
              f"{gib_up(info['ring_resident_gb'] * GiB)} GiB holds the whole model"
              + (" (loaded once)" if a.device == "cpu" else ""))
    print(f"layout: {'stream-ordered' if info['stream_ordered'] else 'not in execution order'}; "
          f"{info['units_contiguous_on_disk']}/{len(units)} units contiguous on disk; data sections "
          f"{'' if info['data_aligned_4k'] else 'not '}4 KiB-aligned"
          + ("" if info["units_contiguous_on_disk"] == len(units) and info["data_aligned_4k"] and info["stream_ordered"]
             else " (`tiered reshard` writes a layout that streams each unit as one span)"))
    ex = info["experts"]
    if ex:
        print(f"experts: {ex['blocks']} MoE blocks x {ex['experts_per_block']} experts (top-{ex['top_k']}), "
              f"{ex['expert_bytes'] / 2**20:.2f} MiB per expert; when the model does not fit they are routed: a decode "
              f"token of batch 1 reads about {ex['routed_bytes_per_token'] / 1e9:.3g} GB (dense "
              f"{ex['dense_bytes'] / 1e9:.3g} GB"
              + (f" + embedding rows {ex['embedding_row_bytes'] / 1e6:.3g} MB" if ex["embedding_row_bytes"] else "")
              + f" + {ex['top_k']}/{ex['experts_per_block']} of the experts' "
              f"{ex['experts_bytes'] / 1e9:.3g} GB) instead of {ex['all_bytes'] / 1e9:.3g} GB")
        where = f"{ex['spans_per_expert']} span(s) on disk, {ex['reads_per_expert']} read(s)"
        if ex["layout"] == "stacked":
            note = ("stacked (E, ...) tensors: an expert is one range of each; `tiered reshard` keeps them "
                    "(per-expert tensors would need transformers' load-time conversion)")
        elif ex["experts_contiguous"]:
            note = "per-expert tensors, each expert's adjacent: contiguous"
        else:
            note = "per-expert tensors, not contiguous (`tiered reshard` writes each expert's tensors adjacent)"
        print(f"expert layout: {ex['layout']}, {where} per expert; {note}")
        print(f"routed, a MoE block's unit without its experts takes {gib_up(ex['routed_unit_max_bytes'])} GiB of the "
              f"ring at most (the experts are read into compact tensors of their own, not the ring)")
    pl = info["placement"]
    if pl:
        o = pl["options"]
        gpu = ("n/a" if pl["device"] == "cpu" else "free memory - 4 GiB") if o["gpu_gb"] is None else f"{o['gpu_gb']} GiB"
        io = o["io"] if o["io"] == pl["io"] else f"{o['io']} -> {pl['io']}"  # "auto" as tiered.load resolves it here
        print(f"placement ({pl['device']}, ring_gb={o['ring_gb']}, gpu_gb={gpu}, host_gb={o['host_gb']}, "
              f"prefetch={o['prefetch']}, io={io}): {len(pl['resident'])} units resident ({pl['resident_bytes'] / GiB:.3g} GiB), "
              f"{len(pl['host'])} in the host tier ({pl['host_bytes'] / GiB:.3g} GiB), {len(pl['streamed'])} streamed "
              f"({pl['streamed_bytes'] / 1e9:.3g} GB per token"
              + (f"; {o['prefetch'] + 1} device buffers, {pl['device_buffer_bytes'] / GiB:.3g} GiB"
                 if pl["device_buffer_bytes"] else "") + ")"
              + (f", {len(pl['rows'])} embedding(s) read by rows" if pl["rows"] else ""))
        if pl["pieces"]:
            held = pl["host_pieces"]
            print(f"  {len(pl['pieces'])} streamed units are larger than the ring: each streams in pieces "
                  f"({sum(pl['pieces'].values())} in all, a third of the ring each at most) into one device buffer"
                  + (f"; the host tier holds the first {sum(held.values())} pieces of {len(held)} of them "
                     f"({pl['host_piece_bytes'] / GiB:.3g} GiB pinned, not read per token)" if held else ""))
        if pl["device"] == "cpu" and pl["streamed"]:
            n, k = len(pl["mapped"]), len(pl["streamed"])
            why = "" if pl["io"] == "mmap" or pl["page_cache"] else " (zero copy needs io=mmap)"
            print(f"  io={pl['io']}: {n} of the {k} streamed units compute on views of the file mapping (zero copy, "
                  f"no ring copy), {k - n} are copied into the ring{why}"
                  + (f"; {len(pl['page_cache'])} of them are io=auto's page-cache tier (kept in the page cache "
                     f"between passes, the rest read O_DIRECT)" if pl["page_cache"] else ""))
        if pl["ring_need_bytes"] > pl["ring_bytes"]:
            print(f"  note: tiered.load refuses this ring: the largest unit copied into it needs "
                  f"{gib_up(pl['ring_need_bytes'])} GiB (RingTooSmallError); pass --ring-gb >= "
                  f"{gib_up(pl['ring_need_bytes'])}" + ("" if pl["io"] == "mmap" else " or --io mmap"))
        elif pl["refused"]:
            for why in pl["refused"]:
                print(f"  note: tiered.load refuses these options here: {flags_for_options(why)}")
        if pl["device"] != "cpu" and o["gpu_gb"] is not None and pl["device_buffer_bytes"] and \
                pl["resident_bytes"] + pl["device_buffer_bytes"] > o["gpu_gb"] * GiB:
            one = pl["device_buffer_bytes"] // (o["prefetch"] + 1)
            print(f"  note: the GPU holds {(pl['resident_bytes'] + pl['device_buffer_bytes']) / GiB:.3g} GiB, more than "
                  f"gpu_gb: gpu_gb counts the resident units and one device buffer ({one / GiB:.3g} GiB, as accelerate's "
                  f"max_memory counts one offloaded layer); the other {o['prefetch']} prefetch buffers come on top "
                  f"(--prefetch lowers them)")
        if pl["expert_modules"]:
            print(f"  routed experts: {pl['expert_modules']} blocks, {pl['routed_expert_bytes'] / 1e9:.3g} GB per decode "
                  f"token"
                  + (f"; expert cache {pl['expert_cache_slots']} of {pl['experts_total']} experts (hit rate "
                     f"{pl['expert_hit_rate']:.0%} if routing is uniform)" if pl["device"] != "cpu" else "")
                  + (f"; {pl['host_expert_modules']} blocks' experts in the host tier "
                     f"({pl['host_expert_bytes'] / GiB:.3g} GiB{' pinned' if pl['device'] != 'cpu' else ''}, copied "
                     f"from there)"
                     if pl["host_expert_modules"] else ""))
        pr = pl["predicted"]
        if pr and pl["io"] == "direct":
            g = placement["gbps"]  # type: ignore[index]
            print(f"  predicted decode, batch 1, streaming only (a lower bound: compute not counted): "
                  f"{pr['cold_s_per_token']:.3g} s/token, warm or cold: io=direct bypasses the page cache, every "
                  f"pass reads from the disk ({g['disk']:g} GB/s; {g['h2d']:g} GB/s H2D); set yours with "
                  f"--disk-gbps, --h2d-gbps")
        elif pr:
            g = placement["gbps"]  # type: ignore[index]
            print(f"  predicted decode, batch 1, streaming only (a lower bound: compute not counted): "
                  f"{pr['warm_s_per_token']:.3g} s/token from a warm page cache ({g['page_cache']:g} GB/s page "
                  f"cache->ring, {g['h2d']:g} GB/s H2D), {pr['cold_s_per_token']:.3g} s/token from a cold disk "
                  f"({g['disk']:g} GB/s); set yours with --cache-gbps, --h2d-gbps, --disk-gbps")
    if info["unused_checkpoint_tensors"]:
        print(f"unused checkpoint tensors: {info['unused_checkpoint_tensors'][:5]}")
    for name, why in list(info["skipped_tensors"].items())[:5]:
        print(f"skipped (torch cannot hold it; the model does not use it): {name} {why}")
    if info["index_names_missing_from_shards"]:
        print(f"the index names tensors no shard holds: {info['index_names_missing_from_shards'][:5]}")
    return 0


# ---------------------------------------------------------------------------------------------- checks
# Pure Python: nothing here imports torch or transformers.

#: Names ``tiered.load`` accepts for ``dtype`` (tiered.meta.parse_dtype, which needs torch to import).
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # as tiered.format.check_model_dir recognises one
#: Files one of which a tokenizer needs (AutoTokenizer reads tokenizer_config.json or builds from the others).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")
#: Where a chat template can be: tokenizer_config.json's "chat_template", or a file of its own.
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _number(kind: type, *, low: float | None = None, low_open: bool = False, high: float | None = None,
            unit: str = "") -> Any:
    """An argparse ``type`` parsing ``kind`` within [low, high] (``low_open``: low excluded); argparse names the flag."""
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (v <= low if low_open else v < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {kind(low)}{unit}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {kind(high)}{unit}, got {text}")
        return v

    return parse


def _device(text: str) -> str:
    if not _DEVICE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N")
    return text.strip()


def _dtype(text: str) -> str:
    name = text.strip().lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of bf16, fp16, fp32 (or bfloat16, float16, float32)")
    return _DTYPES[name]


def _check_model_dir(parser: argparse.ArgumentParser, path: str) -> Path:
    """MODEL_DIR is a directory with a config.json, else a usage error saying what it is instead (the
    checks of tiered.format.check_model_dir, without importing torch)."""
    d = Path(path)
    if not d.is_dir():
        if d.exists():
            hint = (f" (for a lone weight file, put it in a directory with its config.json: pass {str(d.parent)!r})"
                    if d.suffix in (".safetensors", ".bin", ".pt") else "")
            if d.suffix == ".gguf":
                hint = (f" (a GGUF file: convert it once into a model directory, then pass that: tiered reshard {d} "
                        f"{d.with_suffix('')}-tiered --dtype bf16)")
            parser.error(f"MODEL_DIR {d} is a file, not a directory; pass the directory that holds config.json and "
                         f"the weights{hint}")
        if _HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
            parser.error(f"MODEL_DIR {path!r} is not a local directory; it looks like a Hugging Face Hub id. tiered "
                         "reads local directories and downloads nothing: fetch it first, e.g. "
                         f"huggingface_hub.snapshot_download({path!r}), and pass the directory it returns")
        parser.error(f"MODEL_DIR {d}: no such directory; pass a local Hugging Face model directory")
    if not (d / "config.json").is_file():
        parser.error(f"MODEL_DIR {d} has no config.json; pass a Hugging Face model directory "
                     "(config.json + *.safetensors)")
    return d


#: ``tiered.load``'s option names as they appear in its messages ("ring_gb=0.5", "pass ring_gb >= 1",
#: "device 'tpu' is not", "io must"), and the flags that set them.
_OPTION_NAME = re.compile(
    r"(?<![\w.-])(ring_gb|gpu_gb|host_gb|expert_cache_gb|prefetch|threads|io|device|dtype)(?:=| (?=['\"\d<>]|must\b|but\b))"
)


def flags_for_options(message: str) -> str:
    """``message`` with ``tiered.load``'s option names written as the CLI flags that set them."""
    return _OPTION_NAME.sub(lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


class _option_errors_as_usage:
    """Inside: a ConfigError / RingTooSmallError / HostMemoryError that names an option becomes a usage error
    (exit 2) in flag names; any other TieredError is re-raised with option names translated."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type | None, e: BaseException | None, tb: object) -> bool:
        from .errors import ConfigError, HostMemoryError, RingTooSmallError, TieredError

        if e is None or not isinstance(e, TieredError):
            return False
        msg = str(e)
        said = flags_for_options(msg)
        if said != msg and isinstance(e, (ConfigError, RingTooSmallError, HostMemoryError)):
            self.parser.error(said)
        return False  # main() prints it, in flag names too


def _read_config(parser: argparse.ArgumentParser, d: Path) -> dict:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        parser.error(f"MODEL_DIR {d}: config.json cannot be read as JSON ({e})")
    if not isinstance(cfg, dict):
        parser.error(f"MODEL_DIR {d}: config.json is not a JSON object")
    return cfg


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg, cfg.get("text_config") or {}, cfg.get("decoder") or {}):
        v = c.get("vocab_size") if isinstance(c, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def _check_length(a: argparse.Namespace, parser: argparse.ArgumentParser, cfg: dict, n_prompt: int) -> None:
    """Models with a learned table of absolute positions (GPT-2's ``n_positions``) cannot go past it: the
    embedding lookup fails. (RoPE models can, so ``max_position_embeddings`` alone is not a limit.)"""
    limit = cfg.get("n_positions") if isinstance(cfg.get("n_positions"), int) else None
    if limit is not None and n_prompt + a.max_new_tokens > limit:
        _fail(parser, f"--prompt ({n_prompt} tokens) plus --max-new-tokens ({a.max_new_tokens}) is more than the "
                      f"{limit} positions this model has (config.json's n_positions); shorten the prompt or lower "
                      "--max-new-tokens")


def _has_chat_template_file(d: Path) -> bool:
    if any((d / f).is_file() for f in _CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def _check_generate_args(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-option checks (argparse has checked each value's form and range)."""
    if not a.do_sample:
        given = [f for f, v in (("--temperature", a.temperature), ("--top-p", a.top_p), ("--top-k", a.top_k),
                                ("--seed", a.seed)) if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            _fail(parser, f"{', '.join(given)} {verb} only when sampling: add --do-sample (the default is greedy)")
    if a.chat and a.ids:
        _fail(parser, "--chat formats text with the tokenizer's chat template; it cannot be used with --ids")
    if a.gpu_gb is not None and a.device == "cpu":
        _fail(parser, "--gpu-gb is a GPU budget; it does not apply with --device cpu")


def _prompt_inputs(a: argparse.Namespace, parser: argparse.ArgumentParser, d: Path, cfg: dict) -> tuple[Any, Any]:
    """(tokenizer or None, {"input_ids": [[...]], ...} as lists or tensors) — everything checked, no weight read."""
    if a.ids:
        try:
            ids = [int(x) for x in a.prompt.replace(",", " ").split()]
        except ValueError:
            _fail(parser, f"--ids: --prompt must be token ids such as '1 2 3', got {a.prompt!r}")
        vocab = _vocab_size(cfg)
        if not ids:
            _fail(parser, "--ids: --prompt has no token ids; pass some, e.g. --prompt '1 2 3'")
        bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            want = f"in [0, {vocab}) (config.json's vocab_size)" if vocab is not None else ">= 0"
            _fail(parser, f"--ids: token ids must be {want}, got {bad[:5]}")
        return None, {"input_ids": [ids]}
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        _fail(parser, f"MODEL_DIR {d} has no tokenizer (no {', '.join(_TOKENIZER_FILES[:2])}), so --prompt cannot be "
                      "text; pass --ids with token ids, e.g. --ids --prompt '1 2 3'")
    if a.chat and not _has_chat_template_file(d):
        _fail(parser, f"--chat: the tokenizer in {d} has no chat template (no chat_template in tokenizer_config.json, "
                      "no chat_template.jinja); drop --chat to continue the prompt as plain text")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d)
    except Exception as e:  # noqa: BLE001 - any failure to build it is the same advice
        _fail(parser, f"MODEL_DIR {d}: its tokenizer does not load ({type(e).__name__}: {e}); pass --ids with token "
                      "ids instead, e.g. --ids --prompt '1 2 3'")
    if a.chat:
        if not getattr(tok, "chat_template", None):
            _fail(parser, f"--chat: the tokenizer in {d} has no chat template; drop --chat to continue the prompt as "
                          "plain text")
        try:
            enc = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                          return_dict=True)
        except Exception as e:  # noqa: BLE001 - a template that fails to render is the template's problem
            _fail(parser, f"--chat: the chat template of {d} fails on this prompt ({type(e).__name__}: {e})")
    else:
        enc = tok(a.prompt)
    enc = {k: [list(v)] for k, v in dict(enc).items() if k in ("input_ids", "attention_mask")}
    if not enc.get("input_ids") or not enc["input_ids"][0]:
        _fail(parser, f"--prompt {a.prompt!r} encodes to no tokens; pass some text")
    return tok, enc


# ---------------------------------------------------------------------------------------------- generate


def _cmd_generate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_generate_args(a, parser)
    d = _check_model_dir(parser, a.model_dir)
    cfg = _read_config(parser, d)
    tok, enc = _prompt_inputs(a, parser, d, cfg)
    _check_length(a, parser, cfg, len(enc["input_ids"][0]))

    import torch
    import transformers

    # transformers imports lazily: pull in what load() uses (its config and model classes) before the clock starts
    # and before load() measures "before load" RSS, whether or not a tokenizer was loaded already
    archs = cfg.get("architectures")
    for name in ("AutoConfig", *(archs[:1] if isinstance(archs, list) else [])):
        if isinstance(name, str):
            getattr(transformers, name, None)

    from .api import load, stats

    if a.device is not None and a.device.startswith("cuda:"):  # (no CUDA at all: tiered.load says so)
        n_dev, index = torch.cuda.device_count(), int(a.device.partition(":")[2])
        if 0 < n_dev <= index:
            _fail(parser, f"--device {a.device}: this machine has {n_dev} CUDA device(s), cuda:0 to cuda:{n_dev - 1}")
    t0 = time.perf_counter()
    with _option_errors_as_usage(parser):
        model = load(d, ring_gb=a.ring_gb, device=a.device, dtype=a.dtype, prefetch=a.prefetch, gpu_gb=a.gpu_gb,
                     threads=a.threads, io=a.io, host_gb=a.host_gb, expert_cache_gb=a.expert_cache_gb)
    load_s = time.perf_counter() - t0
    with model:
        if not callable(getattr(model, "generate", None)) or not model.can_generate():
            _fail(parser, f"MODEL_DIR {d}: {type(model).__name__} cannot generate text (not a causal LM); use the "
                          "Python API (tiered.load) for its forward")
        inputs = {k: torch.tensor(v, device=model.device) for k, v in enc.items()}
        n_in = inputs["input_ids"].shape[1]
        kw: dict[str, Any] = {"max_new_tokens": a.max_new_tokens, "do_sample": a.do_sample}
        for k in ("temperature", "top_p", "top_k"):
            if getattr(a, k) is not None:
                kw[k] = getattr(a, k)
        streamer = None
        if tok is not None:
            from transformers import TextStreamer

            streamer = kw["streamer"] = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        if a.seed is not None:
            from transformers import set_seed

            set_seed(a.seed)
        before = stats(model).snapshot()
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, **kw)
        gen_s = time.perf_counter() - t1
        new = out[0, n_in:].tolist()
        if streamer is None:
            print(" ".join(map(str, new)))
        sys.stdout.flush()
        after = stats(model).snapshot()
        for line in _summary(d, model, before, after, n_new=len(new), load_s=load_s, gen_s=gen_s):
            print(f"[tiered] {line}", file=sys.stderr)
        print(f"[tiered] {stats(model)}", file=sys.stderr)
    return 0


def _summary(d: Path, model: Any, before: dict, after: dict, *, n_new: int, load_s: float, gen_s: float) -> list[str]:
    """What ``tiered generate`` says after the text: GB and GB/s for bytes moved, GiB for memory."""
    plan = model._tiered.plan
    n_units, n_res = after["units"], after["resident_units"]
    where = "the GPU" if model.device.type == "cuda" else "the ring"
    ring = f"ring {gib(after['ring_bytes'])}"
    asked = model._tiered.opts.ring_gb
    if asked * 2**30 > after["ring_bytes"] + 4096:  # tiered.load caps the ring at the (page-aligned) model
        what = "the units that go through it fit" if after["expert_modules"] else "the whole model fits"
        ring += f" (--ring-gb {asked:g} capped: {what} in less)"
    lines = [f"{d}: {type(model).__name__}, {n_units} units, model {gib(after['model_bytes'])}, "
             f"{ring}, device {model.device}; loaded in {load_s:.2f} s"]
    n = max(1, n_new)
    rate = f"{n_new} tokens in {gen_s:.2f} s: {sig3(n_new / gen_s) if gen_s > 0 else 'n/a'} tokens/s " \
           f"({sig3(gen_s / n)} s/token)"
    streamed = after["streamed_bytes"] - before["streamed_bytes"]
    if n_res == n_units and not after["expert_modules"]:
        lines.append(f"{rate}; all {n_units} units resident in {where} (read once, at load: "
                     f"{gb(after['load_bytes'])}); nothing streamed per token")
    else:
        st = model._tiered.streamer
        ring_units = [i for i in st.streamed if i not in st.host_ids]  # read each pass (row-read embeddings apart)
        src = sum(plan.units[i].src_bytes for i in ring_units)
        part = f"the {len(ring_units)} streamed units are {gb(src)}" if ring_units else "no unit streams whole"
        if st.host_ids:
            part += (f" ({len(st.host_ids)} more in the host tier: {gib(after['host_bytes'])}, read once at load, "
                     f"{gb(after['host_used_bytes'] - before['host_used_bytes'])} used by the passes)")
        if after["row_units"]:
            rows = after["embedding_bytes"] - before["embedding_bytes"]
            part += f", plus {gb(rows)} of embedding rows in all ({after['row_units']} embedding read by row)"
        if after["mapped_units"]:
            part += f"; {after['mapped_units']} of them compute on the file mapping (zero copy)"
        if after["page_cache_units"]:
            part += (f", {after['page_cache_units']} of those ({gb(after['page_cache_bytes'])}) kept in the page cache "
                     f"between tokens (io=auto: the room the memory limit leaves; the rest read O_DIRECT)")
        if after["expert_modules"]:
            ex = after["expert_bytes"] - before["expert_bytes"]
            part += (f", plus {gb(ex)} of routed experts ({after['expert_modules']} MoE blocks read only the "
                     "experts their router picked")
            if after["expert_cache_slots"]:
                hits = after["expert_cache_hits"] - before["expert_cache_hits"]
                looked = hits + after["expert_cache_misses"] - before["expert_cache_misses"]
                part += (f"; the expert cache holds {after['expert_cache_slots']} experts, "
                         f"{hits / max(1, looked):.0%} of picks found there")
            part += ")"
        if n_res:
            part += f"; {n_res} units resident in {where}"
        lines.append(f"{rate}; streamed {gb(streamed)} ({gb(streamed / n)}/token; {part}) at "
                     f"{gbps(streamed, gen_s)} end to end; stalls {after['stall_s'] - before['stall_s']:.2f} s")
    st = proc_status()
    if st.get("VmHWM"):
        lines.append(f"peak RSS {gib(st['VmHWM'])} ({gib(after['rss_before_load'])} before load); "
                     f"ring {gib(after['ring_bytes'])}, model {gib(after['model_bytes'])}")
    return lines


# ---------------------------------------------------------------------------------------------- parser

_GENERATE_DESCRIPTION = """\
Generate text from a local Hugging Face model directory whose weights stream from its safetensors
shards through a fixed host ring (peak RSS ~ --ring-gb + the runtime, whatever the model size).

--prompt is encoded with the model's own tokenizer (--chat first applies its chat template) and the
new text is printed to stdout as it is generated; greedy unless --do-sample. Timing, bytes streamed
and peak RSS go to stderr afterwards, so stdout is only the text. --ids takes and prints raw token ids
instead (for a model directory without a tokenizer). Every option is checked before a weight is read."""

_GENERATE_EPILOG = """\
examples:
  tiered generate ~/models/TinyLlama-1.1B-Chat --prompt "The capital of France is" --max-new-tokens 20
  tiered generate ~/models/TinyLlama-1.1B-Chat --chat --prompt "Write a haiku about disks" --ring-gb 1
  tiered generate ~/models/llama --do-sample --temperature 0.7 --top-p 0.9 --seed 0 --prompt "Once upon a time"
  tiered generate ~/models/llama --ids --prompt "1 15043 29892"      (token ids in, token ids out)
  tiered generate ~/models/llama --prompt "Hello" 2>/dev/null        (only the text)

units: --ring-gb, --gpu-gb and --host-gb in GiB (2**30 bytes); bytes streamed in GB (1e9 bytes), rates in GB/s.
exit status: 0 done, 1 runtime error (a bad shard...), 2 usage error (a bad option, no tokenizer...), 130 interrupted
"""

_INSPECT_DESCRIPTION = """\
Show what streaming a model directory involves, reading only the safetensors headers (no weight):
its shards, tensors and dtypes; its units (one per decoder layer, one per other module) in execution
order with their sizes; the ring size it needs (--ring-gb); and whether the layout on disk streams
each unit as one span (else `tiered reshard` writes one that does)."""

_INSPECT_EPILOG = """\
examples:
  tiered inspect ~/models/llama-3-8b
  tiered inspect ~/models/llama-3-8b --dtype bf16 --device cuda --all
  tiered inspect ~/models/llama-3-8b --json | jq .ring_min_gb
  tiered inspect ~/models/llama-3-8b --device cuda --ring-gb 1 --gpu-gb 8 --host-gb 4

sizes in GiB (2**30 bytes) and MiB (2**20 bytes).
exit status: 0 done, 1 runtime error (a bad shard...), 2 usage error
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``tiered`` argument parser (imports neither torch nor transformers)."""
    p = argparse.ArgumentParser(
        prog="tiered",
        description="Run Hugging Face models whose weights are larger than host RAM: weights stream from\n"
        "safetensors shards through a fixed host ring (RSS ~ ring size), to the GPU when there is one.",
        epilog="examples:\n  tiered inspect ~/models/llama\n  tiered generate ~/models/llama --prompt \"Hello\" "
        "--ring-gb 1\n  tiered reshard ~/models/llama ~/models/llama.tiered\n\n"
        "`tiered COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tiered {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a model directory, streaming its weights",
                       description=_GENERATE_DESCRIPTION, epilog=_GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model_dir", metavar="MODEL_DIR",
                   help="local Hugging Face model directory: config.json, *.safetensors (and a tokenizer for text)")
    t = g.add_argument_group("prompt")
    t.add_argument("--prompt", default="Hello", metavar="TEXT",
                   help="the prompt, encoded with MODEL_DIR's tokenizer (default: %(default)r)")
    t.add_argument("--chat", action="store_true",
                   help="wrap --prompt as a user message in the tokenizer's chat template (with the assistant's "
                   "generation prompt)")
    t.add_argument("--ids", action="store_true",
                   help="--prompt is token ids ('1 2 3'), and token ids are printed; needs no tokenizer")
    s = g.add_argument_group("generation (greedy unless --do-sample)")
    s.add_argument("--max-new-tokens", type=_number(int, low=1), default=20, metavar="N",
                   help="tokens to generate, at most (default %(default)s)")
    s.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    s.add_argument("--temperature", type=_number(float, low=0, low_open=True), default=None, metavar="T",
                   help="sampling temperature > 0 (default: the model's generation_config, else 1.0)")
    s.add_argument("--top-p", type=_number(float, low=0, low_open=True, high=1), default=None, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P, 0 < P <= 1")
    s.add_argument("--top-k", type=_number(int, low=0), default=None, metavar="K",
                   help="keep the K most likely tokens (0: no limit)")
    s.add_argument("--seed", type=_number(int, low=0, high=2**32 - 1), default=None, metavar="S",
                   help="seed the random generators, for a reproducible sample")
    r = g.add_argument_group("streaming")
    r.add_argument("--ring-gb", type=_number(float, low=0, low_open=True, unit=" GiB"), default=4.0, metavar="GiB",
                   help="host ring size in GiB; peak RSS ~ ring + runtime (default %(default)s; "
                   "`tiered inspect` says the least that works)")
    r.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    r.add_argument("--dtype", type=_dtype, default=None, metavar="{bf16,fp16,fp32}",
                   help="compute dtype, cast while streaming (default: config.json's)")
    r.add_argument("--gpu-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                   help="GiB of GPU memory for units kept resident plus the running unit's buffer, as accelerate's "
                   "max_memory counts; the prefetch buffers come on top (default: free memory - 4 GiB, all inside)")
    r.add_argument("--host-gb", type=_number(float, low=0, unit=" GiB"), default=0.0, metavar="GiB",
                   help="GiB of host memory holding streamed units, read once and kept: on CUDA pinned and copied to "
                   "the GPU every token (then routed MoE blocks' experts too), on the CPU computed in place (as "
                   "accelerate's max_memory['cpu']); no disk read for them after load (default 0: none; host RSS "
                   "grows by it)")
    r.add_argument("--expert-cache-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                   help="MoE models: GiB of routed experts kept on the device between tokens (default: on CUDA what "
                   "--gpu-gb leaves; 0: none)")
    r.add_argument("--prefetch", type=_number(int, low=0), default=2, metavar="N",
                   help="units loaded ahead of the one running (default %(default)s)")
    r.add_argument("--threads", type=_number(int, low=1), default=4, metavar="N",
                   help="reader threads (default %(default)s)")
    r.add_argument("--io", choices=["mmap", "pread", "direct", "auto"], default="mmap",
                   help="mmap: through the page cache (default); pread: the page cache copied by read(2), "
                   "nothing mapped; direct: O_DIRECT, bypasses the page cache; "
                   "auto: direct when the model does not fit in the page cache (RAM or cgroup memory.max)")
    g.set_defaults(fn=_cmd_generate, cli_parser=g)

    i = sub.add_parser("inspect", help="shards, units, bytes, dtypes and the ring size a model needs",
                       description=_INSPECT_DESCRIPTION, epilog=_INSPECT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory (config.json + "
                   "*.safetensors)")
    i.add_argument("--dtype", type=_dtype, default=None, metavar="{bf16,fp16,fp32}",
                   help="plan for this compute dtype (default: config.json's)")
    i.add_argument("--device", type=_device, default="cpu",
                   help="plan alignment for this device (cuda: 512 B, cpu: 64 B; default %(default)s)")
    i.add_argument("--all", action="store_true", help="list every unit (default: the first 5 and the last 4)")
    pg = i.add_argument_group("placement", "with any of --ring-gb, --gpu-gb, --host-gb, --io: where tiered.load puts "
                              "each unit with those options, and (--device cuda) the decode time that predicts")
    pg.add_argument("--ring-gb", type=_number(float, low=0, low_open=True, unit=" GiB"), default=None, metavar="GiB",
                    help="host ring, GiB (default 4, tiered.load's)")
    pg.add_argument("--gpu-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                    help="GPU budget, GiB (default: the free memory of this machine's GPU - 4 GiB)")
    pg.add_argument("--host-gb", type=_number(float, low=0, unit=" GiB"), default=0.0, metavar="GiB",
                    help="host tier, GiB (default 0; pinned on CUDA)")
    pg.add_argument("--prefetch", type=_number(int, low=0), default=2, metavar="N", help="units of lookahead (default 2)")
    pg.add_argument("--io", choices=["mmap", "pread", "direct", "auto"], default=None,
                    help="the reader backend, as tiered generate's --io (default mmap, tiered.load's; auto is "
                    "resolved against this machine's page cache). On the CPU only mmap lets streamed units compute "
                    "on the file mapping (no ring copy; auto: units larger than the ring and its page-cache tier); "
                    "on CUDA direct bypasses the page cache, so the warm prediction is the disk's")
    pg.add_argument("--disk-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="cold disk read rate (default 1.5: O_DIRECT on the project's H200 machine)")
    pg.add_argument("--cache-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="page cache -> pinned ring copy rate (default 30, measured there)")
    pg.add_argument("--h2d-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="pinned host -> GPU copy rate (default 55, measured there)")
    i.add_argument("--json", action="store_true", help="print JSON (bytes exact; *_gb in GiB)")
    i.set_defaults(fn=_cmd_inspect, cli_parser=i)

    from .reshard import add_parser as add_reshard_parser

    add_reshard_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from .errors import TieredError

    try:
        if getattr(a, "cli_parser", None) is not None:
            return a.fn(a, a.cli_parser)
        return a.fn(a)
    except TieredError as e:
        print(f"tiered: error: {flags_for_options(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntiered: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tiered ... | head`: the reader left; say nothing more on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
