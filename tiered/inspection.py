"""``tiered inspect``: what a checkpoint holds (shards, units, layout, experts) and, with placement options, where
:func:`tiered.load` puts each unit on this machine — the same :class:`~tiered.placement.Placement`, computed by
:func:`tiered.placement.place` — and the decode time that predicts. Imports neither torch nor transformers at
import time.

Two reports: :func:`inspect_headers` (plain ``tiered inspect``) reads ``config.json`` and the safetensors headers
only and never imports torch or transformers (a fraction of a second); :func:`inspect_dir` (``--units``, and every
option that needs the plan) builds the model on the meta device for its units, the ring they need and the placement
(seconds: torch and transformers import). The figures both give (tensors, bytes, shards, dtypes) are the same.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from .errors import QuantizationError
from .stats import GiB, compression_ratios, gib

__all__ = ["inspect_dir", "print_inspect", "inspect_headers", "print_headers", "flags_for_options"]


def gib_up(n: float) -> float:
    from .ring import gib_up as _gib_up

    return _gib_up(n)


def _plan_for(model_dir: Path, dtype: str | None, device: str, trust_remote_code: bool = False):
    from .format import open_checkpoint
    from .meta import meta_model_from_dir
    from .plan import build_plan

    model = meta_model_from_dir(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    ckpt = open_checkpoint(model_dir)
    return model.config, ckpt, build_plan(model, ckpt, align=512 if device.startswith("cuda") else 64,
                                          stored=device.startswith("cuda"))


def inspect_dir(model_dir: str | Path, *, dtype: str | None = None, device: str = "cpu",
                placement: dict | None = None, trust_remote_code: bool = False) -> dict:
    """What ``tiered inspect`` prints, as a dict (bytes are exact; GiB = 2**30 bytes).

    ``placement``: ``tiered.load`` options (``ring_gb``, ``gpu_gb``, ``host_gb``, ``prefetch``, ``io``) and ``gbps``
    (bandwidths, :data:`tiered.placement.GBPS`'s keys): adds ``"placement"`` (where each unit goes; ``"io"``: the
    backend, ``"auto"`` resolved) and ``"predicted"`` (decode s/token, warm and cold; CUDA only) from
    :mod:`tiered.placement`. ``trust_remote_code``: build a model of the directory's own code (``auto_map``), as
    :func:`tiered.load` does."""
    from .hostmem import page_up
    from .plan import layer_index
    from .policy import resident_ring_bytes

    model_dir = Path(model_dir)
    config, ckpt, plan = _plan_for(model_dir, dtype, device, trust_remote_code)
    placed = None
    if placement is not None:
        from .placement import place_here, predict

        opts = {k: v for k, v in placement.items() if k != "gbps"}
        # place() routes experts out of its plan's units
        _, fresh_ckpt, fresh = _plan_for(model_dir, dtype, device, trust_remote_code)
        pl = place_here(fresh, device=device, ckpt_bytes=fresh_ckpt.nbytes, config=config, strict=False, **opts)
        placed = {"options": opts, **pl.as_dict(),
                  # resident: on the GPU on CUDA; on the CPU in the ring, which then holds the whole model
                  "units": {u.name: (("gpu" if device.startswith("cuda") else "ring") if u.index in pl.resident
                                     else "host" if u.index in pl.host
                                     else "rows" if u.index in pl.rows
                                     else "pieces of rows" if u.index in pl.linear_pieces
                                     else "pieces of rows, ring slots of its own" if u.index in pl.head_pieces
                                     else "streamed")
                            for u in fresh.units},
                  "predicted": predict(pl, placement.get("gbps")) if device.startswith("cuda") else None}
    dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in ckpt.tensors.values())
    dtype_bytes: Counter[str] = Counter()
    for t in ckpt.tensors.values():
        dtype_bytes[str(t.dtype).removeprefix("torch.")] += t.nbytes
    contiguous, aligned, ordered = _disk_layout(plan, ckpt)
    big = plan.max_unit
    # CPU defaults (io="mmap", zero copy, embedding rows): units that compute on views of the file mapping and
    # embeddings that read their rows need no ring; only the others (cast or converted) are copied into it
    from .rows import row_eligible

    # CPU zero copy computes on the file mapping, but the pages of the unit running count against the ring as a copy
    # does (the bound load() promises): only embedding rows need no ring
    in_ring = [u for u in plan.units if not row_eligible(u)]
    # CPU: a linear unit on the mapping (a head) larger than the ring computes in pieces of rows (tiered/linear_pieces.py),
    # so it never sets the least ring that runs: the defaults' ring need hold only the largest of the others
    from .linear_pieces import linear_piece_eligible

    in_pieces = [u for u in in_ring if not device.startswith("cuda") and linear_piece_eligible(u)]
    whole = [u for u in in_ring if u not in in_pieces]
    # the largest of those: what the defaults' ring must hold (a row-read embedding as large or larger never enters it)
    big_in_ring = max(whole, key=lambda u: u.nbytes, default=None)
    pieces_above = [u for u in in_pieces if big_in_ring is None or u.nbytes > big_in_ring.nbytes]
    from .plan import same_bytes

    twins = same_bytes(plan.units)
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
        "bytes_by_dtype": dict(dtype_bytes),
        "units": [{"name": u.name, "bytes": u.nbytes, "stored_bytes": u.src_bytes, "tensors": len(u.targets),
                   "layer": layer_index(u.name + "."),
                   # a tied head: reads the same checkpoint bytes as this earlier unit (no bytes of its own)
                   "same_bytes_as": plan.units[twins[u.index]].name if u.index in twins else None}
                  for u in plan.units],
        "quantized": _quant_info(ckpt, plan),
        "model_bytes": plan.weight_bytes,  # distinct weights (a tied head is not counted twice)
        "layout_bytes": plan.nbytes,  # every unit's aligned layout (a tied head is a unit of its own)
        "largest_unit": {"name": big.name, "bytes": big.nbytes},
        # as the ring allocates them: whole pages per unit (the same figures RingTooSmallError gives)
        "ring_min_gb": page_up(big.nbytes) / GiB,
        # the running unit + prefetch=2, never more than the whole model
        "ring_recommended_gb": min(3 * page_up(big.nbytes), resident_ring_bytes(plan)) / GiB,
        # every unit at once; a tied head bound to its embedding's tensors takes no slot (tiered.policy)
        "ring_resident_gb": resident_ring_bytes(plan) / GiB,
        # with the defaults, the largest unit the ring must hold (0: none; CPU zero copy and embedding rows)
        "ring_min_default_gb": page_up(big_in_ring.nbytes) / GiB if big_in_ring else 0.0,
        "largest_ring_unit": {"name": big_in_ring.name, "bytes": big_in_ring.nbytes} if big_in_ring else None,
        "ring_free_units": len(plan.units) - len(in_ring),
        # CPU: linear units larger than that ring, computed in pieces of rows on the file mapping below their size
        "linear_pieces_units": [{"name": u.name, "bytes": u.nbytes} for u in pieces_above],
        # what ring_gb=None picks on this machine, and why (beside the host tier asked for)
        "default_ring": _default_ring(model_dir, dtype, device, trust_remote_code,
                                      {k: v for k, v in (placement or {}).items()
                                       if k in ("host_gb", "gpu_gb", "prefetch") and v is not None}),
        "units_contiguous_on_disk": contiguous,
        "stream_ordered": ordered,
        "data_aligned_4k": aligned,
        "unused_checkpoint_tensors": plan.unused,
        "skipped_tensors": {n: f"{t.dtype_name} {list(t.shape)}: {t.reason}" for n, t in ckpt.skipped.items()},
        "index_names_missing_from_shards": ckpt.index_missing,
    }


def _quant_info(ckpt: Any, plan: Any) -> dict | None:
    """A quantized checkpoint's decoded tensors (issue 24): the method, how many, their stored bytes (codes and
    scales) and the bytes they decode to; None when nothing is decoded."""
    from .quant import config_of

    dec = [(t, c) for u in plan.units for t in u.targets for c in t.copies if c.decode is not None]
    if not dec:
        return None
    qc = config_of(None, ckpt.root) or {}
    return {"method": qc.get("quant_method"), "block": qc.get("weight_block_size"), "tensors": len(dec),
            "stored_bytes": sum(c.nbytes for _, c in dec), "decoded_bytes": sum(t.nbytes for t, _ in dec),
            "dtype": str(dec[0][0].dtype).removeprefix("torch.")}


def _disk_layout(plan: Any, ckpt: Any) -> tuple[int, bool, bool]:
    """(units whose spans are contiguous in one shard, data sections 4 KiB-aligned, units in execution order on disk)."""
    # Stream order on disk: do units' spans appear in execution order and contiguous?
    spans = []
    for u in plan.units:
        # a losslessly coded tensor's span is its coded bytes (LosslessInfo.stored), not the plain size
        offs = [(str(c.src.file), c.src.offset, c.src.offset + (getattr(c.src, "stored", 0) or c.src.nbytes))
                for t in u.targets for c in t.copies]
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
    return contiguous, aligned, ordered


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
    from .expert_spec import top_k_of
    from .experts import find_experts

    specs = [s for u in plan.units for s in find_experts(u)]
    if not specs:
        return None
    k = top_k_of(config)
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


#: ``tiered.load``'s option names as they appear in its messages ("ring_gb=0.5", "pass ring_gb >= 1",
#: "device 'tpu' is not", "io must"), and the flags that set them.
_OPTION_NAME = re.compile(
    r"(?<![\w.-])(ring_gb|gpu_gb|host_gb|expert_cache_gb|prefetch|threads|io|device|dtype)(?:=| (?=['\"\d<>]|must\b|but\b))"
)


def flags_for_options(message: str) -> str:
    """``message`` with ``tiered.load``'s option names written as the CLI flags that set them."""
    return _OPTION_NAME.sub(lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


def _default_ring(model_dir: Path, dtype: str | None, device: str, trust_remote_code: bool, given: dict) -> dict:
    """What ``tiered.load`` takes here when ``ring_gb`` (and ``host_gb``, unless given) is not given, from this
    machine's ``MemAvailable`` and cgroup limits now, with the options ``given`` (``host_gb``, ``gpu_gb``,
    ``prefetch``): ``{"gb", "why"}`` the ring (:func:`tiered.policy.auto_ring_bytes` beside ``host_gb``) and, where
    the default placement can be made here (the CPU, or CUDA on a machine with a GPU), ``host_gb``/``host_why``
    (:func:`tiered.policy.auto_split`) and ``io`` (``"auto"`` resolved), as :func:`tiered.placement.place` makes them;
    ``error``: why a load with the defaults would refuse."""
    from .errors import TieredError
    from .hostmem import host_memory_available
    from .placement import place_here
    from .policy import auto_ring_bytes

    avail, where = host_memory_available()
    ring, why = auto_ring_bytes(avail, where, device.startswith("cuda"), int((given.get("host_gb") or 0) * GiB))
    out: dict = {"gb": ring / GiB, "why": why}
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return out
    config, ckpt, plan = _plan_for(model_dir, dtype, device, trust_remote_code)
    try:
        pl = place_here(plan, device=device, ckpt_bytes=ckpt.nbytes, config=config, strict=False, **given)
    except TieredError as e:
        return {**out, "error": f"{type(e).__name__}: {e}"}
    out.update(gb=pl.ring_gb, why=pl.ring_why.removeprefix("automatic: "), host_gb=pl.host_gb, host_why=pl.host_why,
               io=pl.io, io_probe=pl.io_probe, threads=pl.threads, threads_why=pl.threads_why, refused=pl.refused)
    return out


def print_inspect(info: dict, a: Any, placement: dict | None) -> None:
    """Print ``info`` (:func:`inspect_dir`) as ``tiered inspect`` does; ``a``: its arguments (``all``, ``device``)."""
    _print_checkpoint(info, a)
    _print_experts(info)
    _print_placement(info, placement)
    _print_notes(info)


def _print_checkpoint(info: dict, a: Any) -> None:
    print(f"{info['model_dir']}: {info['architecture']}, {info['tensors']} tensors, "
          f"{gib(info['checkpoint_bytes'])} in {len(info['shards'])} shard(s), dtypes {info['dtypes']}")
    for s in info["shards"]:
        print(f"  shard {s['file']}: {gib(s['bytes'])}, {s['tensors']} tensors, data at byte {s['data_start']}")
    q = info.get("quantized")
    if q:
        print(f"quantized: {q['method']}{_quant_how(q)}, {q['tensors']} tensors of codes: "
              f"{gib(q['stored_bytes'])} stored (codes and scales), decoded after the read to {gib(q['decoded_bytes'])} "
              f"of {q['dtype']} exactly as transformers dequantizes them; disk and page cache carry the stored bytes")
    print(f"units ({len(info['units'])}, in execution order):")
    units = info["units"]
    show = units if len(units) <= 12 or a.all else units[:5] + [None] + units[-4:]
    where = (info["placement"] or {}).get("units", {})  # with placement options: each unit's tier
    for u in show:
        print("  ..." if u is None else f"  {u['name']:<40} {u['bytes'] / 2**20:10.1f} MiB  {u['tensors']} tensors"
              + (f" (tied: {u['same_bytes_as']}'s bytes)" if u.get("same_bytes_as") else "")
              + (f"  -> {where[u['name']]}" if u["name"] in where else ""))
    lin = info["linear_pieces_units"]
    if (info["ring_free_units"] or lin) and info["ring_min_default_gb"] < info["ring_min_gb"]:
        cpu = a.device == "cpu"
        why = "read embedding rows"
        need = (f">= {gib_up(info['ring_min_default_gb'] * GiB)} GiB" if info["ring_min_default_gb"]
                else "any size (a small one bounds RSS best)")
        if info["largest_ring_unit"]:
            need += f" (largest unit through the ring {info['largest_ring_unit']['name']})"
        free = (f"{info['ring_free_units']} of {len(units)} units {why} and need no ring slot; "
                if info["ring_free_units"] else "")
        if lin:
            names = ", ".join(u["name"] for u in lin[:3]) + (", ..." if len(lin) > 3 else "")
            free += (f"{len(lin)} linear {'unit' if len(lin) == 1 else 'units'} ({names}, up to "
                     f"{gib_up(max(u['bytes'] for u in lin))} GiB) {'computes' if len(lin) == 1 else 'compute'} in "
                     "pieces of rows on the file mapping when larger than the ring; ")
        print(f"ring needed with the defaults: {need}: {free}" + (
            "the rest compute on views of the file mapping (zero copy), and the ring bounds the pages of the unit "
            "running" if cpu else "units larger than the ring are read in pieces when they can be cut"))
        print(f"ring to copy every unit into it ({'zero_copy=False, ' if cpu else ''}embedding_rows=False): "
              f">= {gib_up(info['ring_min_gb'] * GiB)} GiB (largest unit {info['largest_unit']['name']}); "
              f"{gib_up(info['ring_recommended_gb'] * GiB)} GiB to prefetch 2 units; "
              f"{gib_up(info['ring_resident_gb'] * GiB)} GiB holds the whole model"
              + (" (loaded once)" if a.device == "cpu" else ""))
    else:
        # the same figure as the largest unit's, but name one that goes through the ring: a row-read embedding as
        # large (an untied head's twin) never does
        print(f"ring needed: >= {gib_up(info['ring_min_gb'] * GiB)} GiB (largest unit through the ring "
              f"{info['largest_ring_unit']['name']}); "
              f"{gib_up(info['ring_recommended_gb'] * GiB)} GiB to prefetch 2 units; "
              f"{gib_up(info['ring_resident_gb'] * GiB)} GiB holds the whole model"
              + (" (loaded once)" if a.device == "cpu" else ""))
    dr = info["default_ring"]
    given = getattr(a, "ring_gb", None) is not None  # what the defaults would pick; the placement below uses --ring-gb
    head = f"default ring here (ring_gb not given{'; not used: --ring-gb given' if given else ''})"
    print(f"{head}: {dr['gb']:.3g} GiB ({dr['why']})" if dr["gb"] else
          f"{head}: none, too little memory: {dr['why']}")
    if "host_gb" in dr:
        print(f"default host tier here: {dr['host_gb']:.3g} GiB ({dr['host_why']}); io=auto reads with "
              f"{dr['io']} here, {dr['threads']} reader threads ({dr['threads_why']})"
              + (f"; {_auto_measures(dr['threads'])}" if dr.get("io_probe") else "")
              + "".join(f"; a load with the defaults would refuse: {r}" for r in dr["refused"]))
    elif "error" in dr:
        print(f"a load with the defaults would refuse here: {dr['error']}")
    print(f"layout: {'stream-ordered' if info['stream_ordered'] else 'not in execution order'}; "
          f"{info['units_contiguous_on_disk']}/{len(units)} units contiguous on disk; data sections "
          f"{'' if info['data_aligned_4k'] else 'not '}4 KiB-aligned"
          + ("" if info["units_contiguous_on_disk"] == len(units) and info["data_aligned_4k"] and info["stream_ordered"]
             else " (`tiered reshard` writes a layout that streams each unit as one span)"))


def _auto_measures(threads: int) -> str:
    from .reader import auto_measures

    return auto_measures(threads)


def _print_experts(info: dict) -> None:
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


def _print_placement(info: dict, placement: dict | None) -> None:
    pl = info["placement"]
    if pl:
        o = pl["options"]
        gpu = ("n/a" if pl["device"] == "cpu" else "free memory - 4 GiB") if o["gpu_gb"] is None else f"{o['gpu_gb']} GiB"
        io = o["io"] if o["io"] == pl["io"] else f"{o['io']} -> {pl['io']}"  # "auto" as tiered.load resolves it here
        ring = f"{pl['ring_gb']:.4g}" if o["ring_gb"] is not None else f"{pl['ring_gb']:.4g} ({pl['ring_why']})"
        host = f"{pl['host_gb']:.4g}" if o["host_gb"] is not None else f"{pl['host_gb']:.4g} ({pl['host_why']})"
        print(f"placement ({pl['device']}, ring_gb={ring}, gpu_gb={gpu}, host_gb={host}, "
              f"prefetch={o['prefetch']}, io={io}): {len(pl['resident'])} units resident ({pl['resident_bytes'] / GiB:.3g} GiB), "
              f"{len(pl['host'])} in the host tier ({pl['host_bytes'] / GiB:.3g} GiB), {len(pl['streamed'])} streamed "
              f"({pl['streamed_bytes'] / 1e9:.3g} GB per token"
              + (f"; device pool {o['prefetch'] + 1} slots, {pl['device_buffer_bytes'] / GiB:.3g} GiB"
                 if pl["device_buffer_bytes"] else "") + ")"
              + (f", {len(pl['rows'])} embedding(s) read by rows" if pl["rows"] else ""))
        if pl.get("io_probe"):
            print(f"  io=auto -> direct, {_auto_measures(pl['threads'])}")
        in_pieces = {i: n for i, n in (pl.get("piece_counts") or pl["pieces"]).items() if i in set(pl["streamed"])}
        if in_pieces:  # (a resident unit larger than the ring is copied to the GPU in pieces once, at load)
            held = pl["host_pieces"]
            print(f"  {len(in_pieces)} streamed units are larger than the ring: each streams in pieces "
                  f"({sum(in_pieces.values())} in all, each at most a third of the ring, half of a small one) into one "
                  "device buffer"
                  + (f"; the host tier holds the first {sum(held.values())} pieces of {len(held)} of them "
                     f"({pl['host_piece_bytes'] / GiB:.3g} GiB pinned, not read per token)" if held else ""))
        by_why: dict[str, list[str]] = {}
        for name, why in (pl.get("reader_decoded") or {}).items():
            by_why.setdefault(why, []).append(name)
        for why, names in by_why.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            print(f"  exp3-coded, decoded on the reader threads (the C decoder, numpy where none builds) instead of "
                  f"the GPU: {shown}: {why}")
        if pl["device"] == "cpu" and pl["streamed"]:
            n, k = len(pl["mapped"]), len(pl["streamed"])
            why = "" if pl["io"] == "mmap" or pl["page_cache"] else " (zero copy needs io=mmap)"
            print(f"  io={pl['io']}: {n} of the {k} streamed units compute on views of the file mapping (zero copy, "
                  f"no ring copy), {k - n} are copied into the ring{why}"
                  + (f"; {len(pl['page_cache'])} of them are io=auto's page-cache tier (kept in the page cache "
                     f"between passes, the rest read O_DIRECT)" if pl["page_cache"] else ""))
            if pl["linear_pieces"]:
                print(f"  {len(pl['linear_pieces'])} linear unit(s) larger than the ring are computed in pieces of "
                      f"{', '.join(str(r) for r in pl['linear_pieces'].values())} output rows on the mapping (one "
                      "piece in RSS at a time; tiered.load checks at load that the pieces give the whole product's bits)")
            if pl.get("head_pieces"):
                print(f"  {len(pl['head_pieces'])} head the ring holds but not beside a layer is read in pieces of "
                      f"{', '.join(str(r) for r in pl['head_pieces'].values())} output rows through ring slots of its "
                      "own (tiered.policy.HEAD_IN_RING_PIECES; the pieces' exactness is checked at load)")
        if pl["ring_need_bytes"] > pl["ring_bytes"]:
            print(f"  note: tiered.load refuses this ring: the largest unit (copied into it, or run on the mapping) needs "
                  f"{gib_up(pl['ring_need_bytes'])} GiB (RingTooSmallError); pass --ring-gb >= "
                  f"{gib_up(pl['ring_need_bytes'])}")
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


def _print_notes(info: dict) -> None:
    if info["unused_checkpoint_tensors"]:
        print(f"unused checkpoint tensors: {info['unused_checkpoint_tensors'][:5]}")
    for name, why in list(info["skipped_tensors"].items())[:5]:
        print(f"skipped (torch cannot hold it; the model does not use it): {name} {why}")
    if info["index_names_missing_from_shards"]:
        print(f"the index names tensors no shard holds: {info['index_names_missing_from_shards'][:5]}")


# ---------------------------------------------------------------------------------------------- from headers only

#: The dtypes of a quantized checkpoint's float8 codes (tiered.quant.CODE_DTYPES, by their safetensors names).
_FP8_CODES = ("F8_E4M3", "F8_E5M2")
_I64_MAX = 2**63 - 1


def _read_json(path: Path) -> dict:
    """``path`` as a JSON object, or ``{}`` (missing, unreadable: the command line checked config.json before)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _config_qc(cfg: dict) -> dict | None:
    """config.json's ``quantization_config``, or a sub-config's (as :func:`tiered.quant.config_of` finds it)."""
    for c in (cfg, *(cfg.get(k) for k in ("text_config", "language_config", "llm_config"))):
        qc = c.get("quantization_config") if isinstance(c, dict) else None
        if isinstance(qc, dict):
            return qc
    return None


def _coded_pairs(method: str, dtypes: dict[str, str]) -> list[tuple[str, str]]:
    """(codes, scales) tensor names a quantized checkpoint stores, by the names :mod:`tiered.quant` reads them by:
    ``X`` and ``X_scale_inv`` (``fp8``; also ``X.weight`` float8 and ``X.scale``), ``X_blocks`` and ``X_scales``
    (``mxfp4``), ``X.weight_packed`` or ``X.weight`` and ``X.weight_scale`` (``compressed-tensors``)."""
    pairs = []
    for n, dt in dtypes.items():
        if n + "_scale_inv" in dtypes:
            pairs.append((n, n + "_scale_inv"))
        elif method == "fp8" and n.endswith(".weight") and dt in _FP8_CODES and n[:-len("weight")] + "scale" in dtypes:
            pairs.append((n, n[:-len("weight")] + "scale"))
        elif method == "mxfp4" and n.endswith("_blocks") and n[:-len("_blocks")] + "_scales" in dtypes:
            pairs.append((n, n[:-len("_blocks")] + "_scales"))
        elif method == "compressed-tensors" and n.endswith((".weight_packed", ".weight")):
            scale = n.rpartition(".")[0] + ".weight_scale"
            if scale in dtypes and not (n.endswith(".weight") and n.rpartition(".")[0] + ".weight_packed" in dtypes):
                pairs.append((n, scale))
    return pairs


#: ``quant_method`` values tiered decodes: :data:`tiered.quant.STREAMED`, here without importing torch (a test keeps
#: the two equal)
DECODED_METHODS = ("fp8", "mxfp4", "compressed-tensors")


def _quant_headers(cfg: dict, dtypes: dict[str, str], nbytes: dict[str, int], where: str = "config.json") -> dict | None:
    """The ``quantization_config`` summary from config.json and the headers: the method, ``weight_block_size``, the
    tensors of codes found with their scales and the bytes those store (codes and scales; what :func:`inspect_dir`'s
    ``"quantized"`` counts); None when config.json has none and no tensor has ``_scale_inv`` scales."""
    qc = _config_qc(cfg)
    method = (str(qc.get("quant_method", "")).lower() or None) if qc is not None else None
    if qc is not None and method not in DECODED_METHODS:  # refused as tiered.load refuses it (tiered.quant)
        raise QuantizationError(
            f"{where}: quantization_config has quant_method={method or '(none)'!r}, which tiered does not decode (it "
            f"decodes {', '.join(DECODED_METHODS)}); its tensors are codes, and loading them as weights would give "
            "wrong numbers (`tiered inspect --units` says what would work)")
    pairs = _coded_pairs(method or "", dtypes)
    if qc is None and not pairs:
        return None
    return {"method": method, "block": qc.get("weight_block_size") if qc else None, "tensors": len(pairs),
            "stored_bytes": sum(nbytes[c] + nbytes[s] for c, s in pairs)}


def _block_of(name: str) -> tuple[str, int] | None:
    """``("model.layers.", 3)`` for ``model.layers.3.mlp.up_proj.weight``: a tensor's first numbered module (a
    decoder layer, a block), or None."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isascii() and p.isdigit():  # ('²'.isdigit() is True and int('²') fails; torch names use ASCII digits)
            return ".".join(parts[:i]) + ".", int(p)
    return None


def _block_layout(spans: dict[str, tuple[int, int, int]]) -> dict:
    """Layout facts of the numbered blocks (decoder layers...) by tensor name, from ``spans`` (name -> (shard rank,
    first byte, end byte) in the file): how many blocks, how many lie in one shard as one span (no other tensor
    between), and whether each stack's blocks lie in index order."""
    blocks: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for name, span in spans.items():
        key = _block_of(name)
        if key is not None:
            blocks.setdefault(key, []).append(span)
    contiguous = 0
    for sp in blocks.values():
        if len({r for r, _, _ in sp}) == 1 and max(e for _, _, e in sp) - min(b for _, b, _ in sp) == \
                sum(e - b for _, b, e in sp):
            contiguous += 1
    ordered = True
    for prefix in {p for p, _ in blocks}:
        starts = [min((r, b) for r, b, _ in blocks[k]) for k in sorted(k for k in blocks if k[0] == prefix)]
        ordered &= all(x <= y for x, y in zip(starts, starts[1:], strict=False))
    stacks = sorted({p for p, _ in blocks}, key=lambda p: -sum(k[0] == p for k in blocks))
    return {"blocks": len(blocks), "blocks_contiguous_on_disk": contiguous, "blocks_in_order": ordered,
            "block_names": [p + "N" for p in stacks]}


def _lossless_tables(meta: dict | None, path: Path, bad: list[str]
                     ) -> dict[str, tuple[str, tuple[int, ...], int, str]]:
    """A compressed shard's coded tensors (``tiered reshard --compress``, :mod:`tiered.lossless`'s format): name ->
    (dtype as safetensors names it, shape, plain bytes, codec), from ``__metadata__`` alone (torch-free). A table this cannot
    read is named in ``bad`` (``tiered.load`` refuses it with the reason) and its tensors stay ``U8``."""
    import json
    import math

    from .spec_dtypes import SPEC_DTYPE_BITS, SPEC_DTYPE_TORCH_NAMES

    raw = (meta or {}).get("tiered_lossless")  # tiered.lossless.META_KEY (that module imports numpy)
    if raw is None:
        return {}
    out = {}
    try:
        for name, e in json.loads(raw).items():
            dt, shape = e["dtype"], tuple(int(x) for x in e["shape"])
            if dt not in SPEC_DTYPE_TORCH_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dt!r} is not one torch holds")
            out[name] = (dt, shape, math.prod(shape) * SPEC_DTYPE_BITS[dt] // 8, str(e.get("codec")))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        bad.append(f"{path.name}: {type(e).__name__}: {e}")
        return {}
    return out


def inspect_headers(model_dir: str | Path, *, device: str = "cpu") -> dict:
    """What plain ``tiered inspect`` prints, as a dict, from ``config.json`` and the safetensors headers only: never
    imports torch or transformers (bytes exact; GiB = 2**30 bytes).

    The keys :func:`inspect_dir` also has mean the same there, figure for figure: ``model_dir``, ``architecture``,
    ``shards``, ``tensors``, ``checkpoint_bytes``, ``dtypes``, ``bytes_by_dtype`` (tensors torch can hold: a packed
    ``F4``/``F6_*`` one is in ``skipped_tensors``), ``data_aligned_4k``, ``skipped_tensors``,
    ``index_names_missing_from_shards``. Beside them: ``quantized`` (config.json's ``quantization_config``: method,
    block, the tensors of codes found with their scales and their stored bytes; what they decode to needs the model:
    :func:`inspect_dir`), ``layout`` (the numbered blocks by tensor name: contiguous, in order),
    ``tensors_not_in_index`` (shard tensors the index omits: loaded all the same), ``compressed`` (a ``tiered reshard
    --compress`` output: its coded tensors, counted above as the dtype and bytes they decode to, their stored and
    plain bytes, and ``all_stored_bytes``/``all_plain_bytes`` over every tensor; None otherwise), and ``default_ring``
    (``{"gb", "why"}``: the ring ``ring_gb`` not given takes on ``device`` here when the model fits in it:
    :func:`tiered.policy.auto_ring_bytes`; the split with a host tier needs the units).

    Raises:
        ShardNotFoundError / ConfigError / HeaderError / TruncatedShardError / DuplicateTensorError: as
            :func:`tiered.checkpoint.open_checkpoint`.
    """
    from .checkpoint import weight_files
    from .errors import DuplicateTensorError
    from .header import scan_header
    from .hostmem import host_memory_available
    from .policy import auto_ring_bytes
    from .spec_dtypes import SPEC_DTYPE_BITS, SPEC_DTYPE_TORCH_NAMES

    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json")
    files = weight_files(model_dir)
    shards, skipped = [], {}
    where: dict[str, tuple[Path, int]] = {}  # every tensor: (file, absolute offset)
    dtypes: dict[str, str] = {}  # every tensor: its header dtype
    nbytes: dict[str, int] = {}
    spans: dict[str, tuple[int, int, int]] = {}
    # stored/plain_bytes: the coded tensors'; all_stored/all_plain_bytes: every tensor's (a plain one in both)
    coded = {"tensors": 0, "stored_bytes": 0, "plain_bytes": 0, "all_stored_bytes": 0, "all_plain_bytes": 0,
             "unreadable": [], "codecs": {}}
    for rank, p in enumerate(files.paths):
        size, start, meta, entries = scan_header(p)
        tables = _lossless_tables(meta, p, coded["unreadable"])
        held = 0
        for begin, end, name, dt, shape in entries:
            prev = where.get(name)
            if prev is not None:
                raise DuplicateTensorError(f"tensor {name!r} is in both {prev[0]} (offset {prev[1]}) and {p} (offset "
                                           f"{start + begin}); remove one copy")
            entry = tables.get(name)
            coded["all_stored_bytes"] += end - begin
            coded["all_plain_bytes"] += entry[2] if entry is not None and dt == "U8" else end - begin
            if entry is not None and dt == "U8":  # a coded tensor (tiered.lossless): seen as what it decodes to
                coded["tensors"] += 1
                coded["stored_bytes"] += end - begin
                coded["plain_bytes"] += entry[2]
                coded["codecs"][entry[3]] = coded["codecs"].get(entry[3], 0) + 1
                dt, shape = entry[0], entry[1]
                where[name], dtypes[name], nbytes[name] = (p, start + begin), dt, entry[2]
                spans[name] = (rank, start + begin, start + end)
                held += 1
                continue
            where[name], dtypes[name], nbytes[name] = (p, start + begin), dt, end - begin
            spans[name] = (rank, start + begin, start + end)
            bits = SPEC_DTYPE_BITS[dt]
            if dt not in SPEC_DTYPE_TORCH_NAMES or any(d > _I64_MAX for d in shape):
                why = (f"dtype {dt} packs {bits}-bit elements, which torch has no unpacked dtype for" if bits < 8
                       else f"torch has no dtype for {dt}" if dt not in SPEC_DTYPE_TORCH_NAMES
                       else f"shape {list(shape)} has a dimension above torch's limit of 2**63 - 1")
                skipped[name] = f"{dt} {list(shape)}: {why}"
            else:
                held += 1
        shards.append({"file": p.name, "bytes": size, "tensors": held, "data_start": start})
    held_names = [n for n in dtypes if n not in skipped]
    counts: Counter[str] = Counter()
    dtype_bytes: Counter[str] = Counter()
    for n in held_names:
        counts[SPEC_DTYPE_TORCH_NAMES[dtypes[n]]] += 1
        dtype_bytes[SPEC_DTYPE_TORCH_NAMES[dtypes[n]]] += nbytes[n]
    wm = files.weight_map
    avail, why = host_memory_available()
    ring, ring_why = auto_ring_bytes(avail, why, device.startswith("cuda"), 0)
    archs = cfg.get("architectures")
    return {
        "model_dir": str(model_dir),
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else "?",
        "model_type": cfg.get("model_type"),
        "shards": shards,
        "tensors": len(held_names),
        "checkpoint_bytes": sum(nbytes[n] for n in held_names),
        "dtypes": dict(counts),
        "bytes_by_dtype": dict(dtype_bytes),
        "quantized": _quant_headers(cfg, dtypes, nbytes, str(model_dir / "config.json")),
        "compressed": coded if coded["tensors"] or coded["unreadable"] else None,
        "layout": _block_layout(spans),
        "data_aligned_4k": all(s["data_start"] % 4096 == 0 for s in shards),
        "default_ring": {"gb": ring / GiB, "why": ring_why},
        "skipped_tensors": skipped,
        "index_names_missing_from_shards": sorted(n for n in wm if n not in dtypes) if wm is not None else [],
        "tensors_not_in_index": sorted(n for n in dtypes if n not in wm) if wm is not None else [],
    }


def _quant_how(q: dict) -> str:
    """`` (weight_block_size [128, 128])``: how a method's codes are scaled, for the ``quantized:`` line."""
    how = (f"weight_block_size {q['block']}" if q["method"] == "fp8"
           else "32 e2m1 codes per E8M0 scale" if q["method"] == "mxfp4" else "")
    return f" ({how})" if how else ""


def print_headers(info: dict) -> None:
    """Print ``info`` (:func:`inspect_headers`) as plain ``tiered inspect`` does."""
    print(f"{info['model_dir']}: {info['architecture']}, {info['tensors']} tensors, "
          f"{gib(info['checkpoint_bytes'])} in {len(info['shards'])} shard(s), dtypes {info['dtypes']}")
    for s in info["shards"]:
        print(f"  shard {s['file']}: {gib(s['bytes'])}, {s['tensors']} tensors, data at byte {s['data_start']}")
    print("bytes by dtype: " + ", ".join(f"{k} {gib(v) if v >= 2**20 else f'{v} bytes'}" for k, v in
                                         sorted(info["bytes_by_dtype"].items(), key=lambda kv: -kv[1])))
    q = info["quantized"]
    if q and q["method"] is None:
        print(f"quantized: {q['tensors']} tensors have _scale_inv block scales but config.json has no "
              "quantization_config: they hold codes, not weights, and tiered.load refuses them")
    elif q:
        print(f"quantized: {q['method']}{_quant_how(q)}, {q['tensors']} tensors of codes: {gib(q['stored_bytes'])} "
              f"stored (codes and scales); disk and page cache carry the stored bytes (--units: what they decode to)")
    z = info.get("compressed")
    if z:
        ratios = compression_ratios(z["all_stored_bytes"], z["all_plain_bytes"], z["stored_bytes"], z["plain_bytes"])
        print(f"compressed (tiered reshard --compress): {z['tensors']} tensors stored in {gib(z['stored_bytes'])} for "
              f"{gib(z['plain_bytes'])} of plain bytes"
              + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(z.get('codecs', {}).items()))})" if z.get("codecs") else "")
              + f"; {ratios}"  # the figures `tiered reshard --compress` prints
              + "; tiered.load decodes them on its reader threads"
              + (" (exp3-bf16 ones on the GPU after the H2D copy when it loads to CUDA)"
                 if "exp3-bf16" in z.get("codecs", {}) else "")
              + "".join(f"; unreadable lossless table in {b} (tiered.load refuses it)" for b in z["unreadable"]))
    lay = info["layout"]
    blocks = (f"{lay['blocks_contiguous_on_disk']}/{lay['blocks']} numbered blocks ({', '.join(lay['block_names'])}) "
              f"contiguous on disk, {'in' if lay['blocks_in_order'] else 'not in'} order; " if lay["blocks"] else "")
    good = lay["blocks_contiguous_on_disk"] == lay["blocks"] and lay["blocks_in_order"] and info["data_aligned_4k"]
    print(f"layout: {blocks}data sections {'' if info['data_aligned_4k'] else 'not '}4 KiB-aligned"
          + ("" if good else " (`tiered reshard` writes a layout that streams each unit as one span)"))
    dr = info["default_ring"]
    print((f"default ring here (ring_gb not given): {dr['gb']:.3g} GiB ({dr['why']})" if dr["gb"] else
           f"default ring here (ring_gb not given): none, too little memory: {dr['why']}")
          + "; a model that does not fit in it gets a smaller ring and a host tier (--units says how much)")
    for name, why in list(info["skipped_tensors"].items())[:5]:
        print(f"skipped (torch cannot hold it; a model that needs it is refused): {name} {why}")
    if info["index_names_missing_from_shards"]:
        print(f"the index names tensors no shard holds: {info['index_names_missing_from_shards'][:5]}")
    if info["tensors_not_in_index"]:
        print(f"tensors the index does not name (loaded all the same): {info['tensors_not_in_index'][:5]}")
    print("units in execution order, the ring they need, the default host tier, unused tensors: add --units "
          "(builds the model on the meta device: imports torch and transformers)")
