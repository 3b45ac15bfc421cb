"""The output layout: which tensors go to which shard, in which order, at which offset.

* Units: the unit plan of :func:`tiered.plan.build_plan` — the one the loader streams, from a model
  built on ``meta`` from ``config.json`` — in *execution order*, so every unit is one contiguous span
  inside one shard. Without ``config.json``, or with an architecture ``transformers`` does not know,
  units are ordered by the layer index in tensor names (``…layers.12.…``, ``…h.12.…``) and a note says so.
  A tensor read by two units is written with the first; tensors the model does not use are written last.
* Experts (a MoE block's experts module that :mod:`tiered.experts` routes): written last in their unit, so
  the dense part is one span when the experts are read one at a time; per-expert tensors expert by expert
  (``experts.j.w1, w3, w2`` adjacent: one expert is one range of the file); stacked ``(E, ...)`` tensors as
  they are (:func:`_expert_order`).
* Shards ``model-0000i-of-0000N.safetensors``: a shard boundary falls only between units; a unit larger
  than ``max_shard_size`` gets a shard of its own.
* Every shard's data section starts on a :data:`DATA_ALIGN` (4 KiB) boundary: the JSON header is padded
  with spaces, which the safetensors spec allows ("Format" section); the spec forbids holes between
  tensors, so tensors stay packed.
* Dtypes: with ``dtype``, floating tensors (F16/BF16/F32/F64) are written cast, except those the model
  keeps in float32 at that dtype (``_keep_in_fp32_modules``), as ``from_pretrained`` does.
* Compressed output (``compress``): the same shards and order; tensors of at least
  :data:`~tiered.lossless.MIN_CODED_BYTES` are candidates for coding, and since their coded sizes are known only
  once written, each shard reserves room for the largest header it can have (:func:`_coded_header_bound`) and gets
  its real one, space-padded to that room, last (:func:`_coded_header`).
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import lossless
from ..errors import ConfigError, TieredError
from ..format import TensorInfo, dtype_name, encode_header
from ..lossless import FORMAT_VERSION, META_KEY, VERSION_KEY, Coded, chunk_geometry, table_entry
from .sources import Source

#: Alignment of every output shard's data section (bytes): one page, what mmap and O_DIRECT need.
DATA_ALIGN = 4096
_CASTABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


# ---------------------------------------------------------------------------------------------- the order


@dataclass
class _Unit:
    """One streaming unit of the output: checkpoint tensor names, in the order they are written."""

    name: str
    tensors: list[str] = field(default_factory=list)
    nbytes: int = 0  # output bytes (after a cast)
    rows: bool = False  # an embedding tiered.load reads by rows (tiered/rows.py): never coded by --compress


_LAYER_PREFIX = re.compile(r"^(?P<prefix>(?:.*?\.)?(?:layers|layer|h|blocks|block))\.(?P<idx>\d+)\.")
_EMBED = re.compile(r"embed|wte|wpe|tok_|word_|position_|patch_")


def _units_by_layer(names: list[str]) -> list[_Unit]:
    """Units when there is no plan: embedding-like modules, each stack's layers by index, the rest.

    Layer tensors are grouped by (stack prefix, layer index); stacks in order of first appearance.
    Other tensors are grouped by module (the name without its last component).
    """
    head: dict[str, _Unit] = {}
    layers: dict[tuple[str, int], _Unit] = {}
    tail: dict[str, _Unit] = {}
    stacks: dict[str, int] = {}
    for n in names:
        m = _LAYER_PREFIX.match(n)
        if m:
            key = (m["prefix"], int(m["idx"]))
            stacks.setdefault(m["prefix"], len(stacks))
            layers.setdefault(key, _Unit(f"{key[0]}.{key[1]}")).tensors.append(n)
        else:
            mod = n.rpartition(".")[0] or n
            group = head if _EMBED.search(mod) else tail
            group.setdefault(mod, _Unit(mod)).tensors.append(n)
    ordered = sorted(layers.items(), key=lambda kv: (stacks[kv[0][0]], kv[0][1]))
    return list(head.values()) + [u for _, u in ordered] + list(tail.values())


def _plan_units(source: Source, notes: list[str],
                dtype: torch.dtype | None = None) -> tuple[list[_Unit], str | None, dict[str, str]]:
    """(units in execution order, architecture or None, tied pairs {checkpoint name: name it duplicates}).

    Uses the loader's own plan (:func:`~tiered.plan.build_plan` on a model built on ``meta`` from
    ``config.json``, at ``dtype``): the source's generated ``config.json`` if it has one, else the one
    in ``source.root``. Falls back to :func:`_units_by_layer` and says why in ``notes``.
    Sets ``source.keep_dtype``: checkpoint tensors that ``from_pretrained`` keeps in float32 at ``dtype``
    (``_keep_in_fp32_modules``; T5's ``wo`` in fp16), which are therefore not cast.
    """
    generated = source.generated_files.get("config.json")
    if generated is not None:  # built from a private copy: the model is built from a directory
        with tempfile.TemporaryDirectory(prefix="tiered-reshard-config-") as d:
            (Path(d) / "config.json").write_bytes(generated)
            return _plan_from(Path(d), f"the config.json the {source.kind} source generates", source, notes, dtype)
    cfg = source.root / "config.json"
    if not cfg.is_file():
        return _fallback(source, notes, f"no config.json in {source.root}")
    return _plan_from(source.root, str(cfg), source, notes, dtype)


def _fallback(source: Source, notes: list[str], why: str) -> tuple[list[_Unit], None, dict[str, str]]:
    notes.append(f"{why}: units ordered by the layer index in tensor names")
    return _units_by_layer(list(source.infos)), None, {}


def _plan_from(config_dir: Path, cfg: str, source: Source, notes: list[str],
               dtype: torch.dtype | None) -> tuple[list[_Unit], str | None, dict[str, str]]:
    """:func:`_plan_units` with the model of ``config_dir/config.json`` (``cfg`` names it in notes)."""
    try:
        from ..meta import meta_model_from_dir
        from ..plan import build_plan

        model = meta_model_from_dir(config_dir, dtype=dtype or torch.float32)  # the dtype plan needs it
        plan = build_plan(model, source.checkpoint())
    except ConfigError as e:
        return _fallback(source, notes, str(e))
    except TieredError as e:
        return _fallback(source, notes, f"config.json does not match the checkpoint ({e})")
    except Exception as e:  # the order is an optimisation: any failure to build the plan falls back
        return _fallback(source, notes, f"cannot build the {cfg} model on meta ({type(e).__name__}: {e})")

    # Checkpoint names each model key reads (a tied parameter absent from the checkpoint reads its source's).
    reads: dict[str, list[str]] = {}
    units: list[_Unit] = []
    from ..rows import row_eligible

    for u in plan.units:
        unit = _Unit(u.name, rows=row_eligible(u, coded=True))
        experts, expert_targets = _expert_order(u)
        for t in u.targets:
            reads[t.key] = list(dict.fromkeys(_ckpt_name(c.src.name, source.infos) for c in t.copies))
            if id(t) not in expert_targets:
                unit.tensors += reads[t.key]
                unit.tensors += [c.decode.scale.name for c in t.copies if c.decode is not None]  # FP8 block scales
        for conv in u.converts:
            unit.tensors += [s.name for ss in conv.sources.values() for s in ss]
        unit.tensors += experts  # last: the unit's dense part stays one span when its experts are routed
        units.append(unit)
    if dtype is not None and dtype != torch.float32:  # transformers' dtype plan: these stay float32
        source.keep_dtype = {c.src.name for u in plan.units for t in u.targets if t.dtype == torch.float32
                             for c in t.copies}
        if source.keep_dtype:
            notes.append(f"{len(source.keep_dtype)} tensors kept in their dtype: {type(model).__name__} keeps them "
                         f"in float32 at {dtype} (_keep_in_fp32_modules), as from_pretrained does")
    if plan.unused or plan.dropped:
        units.append(_Unit(f"(not used by {type(model).__name__})", list(plan.unused) + list(plan.dropped)))
        notes.append(f"{len(plan.unused)} tensors not used by {type(model).__name__} written last "
                     f"({', '.join(plan.unused[:3])}{', ...' if len(plan.unused) > 3 else ''})")
    tied: dict[str, str] = {}
    for dup_key, keep_key in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        dup, keep = reads.get(dup_key, []), reads.get(keep_key, [])
        if len(dup) == 1 and len(keep) == 1 and dup[0] != keep[0]:
            tied[dup[0]] = keep[0]
    return units, type(model).__name__, tied


def _ckpt_name(name: str, infos: dict) -> str:
    """The checkpoint tensor a plan source ``name`` reads: itself, or for rows of a fused tensor split into parameters
    (tiered/chunks.py: ``"...Wqkv.weight[0:64]"``) the fused tensor."""
    if name in infos or not name.endswith("]"):
        return name
    base = name[: name.rfind("[")]
    return base if base in infos else name


def _with_scale(name: str, decode) -> list[str]:
    """``name``, then the name of its block scales when it holds float8 codes (``decode``: a ``tiered.quant.Fp8Block``)."""
    return [name] if decode is None else [name, decode.scale.name]


def _expert_order(unit) -> tuple[list[str], set[int]]:
    """The checkpoint tensors of ``unit``'s routable experts modules (:func:`tiered.experts.find_experts`) in the
    order they are written, and the ids of those modules' targets ({} and [] when there are none).

    Per-expert tensors (Mixtral's ``experts.j.w1/w3/w2``, Qwen's ``experts.j.gate_proj/up_proj/down_proj``) are
    written expert by expert, each expert's in the order :class:`~tiered.experts.ExpertGather` reads them
    (``w1, w3, w2``), so one expert's bytes are one range of the file. Stacked ``(E, ...)`` tensors are written
    as they are (expert ``j`` is then one range of each stacked tensor: ``gate_up_proj[j]``, ``down_proj[j]``):
    the output's tensors stay the input's, names and bytes, and ``from_pretrained`` loads them without a
    conversion (see ``tiered inspect``'s experts line).
    """
    from ..experts import find_experts

    names: list[str] = []
    targets: set[int] = set()
    for spec in find_experts(unit):
        per_expert: list[str] = []
        stacked: list[str] = []
        for p in spec.parts:
            stacked += [n for c in p.target.copies if c.place is None for n in _with_scale(c.src.name, c.decode)]
        for j in range(spec.num_experts):  # an FP8 expert's codes then their block scales (tiered.quant)
            per_expert += [n for p in spec.parts for info, dest in p.per[j] if dest is not None
                           for n in _with_scale(info.name, getattr(info, "decode", None))]
        every = [n for p in spec.parts for c in p.target.copies for n in _with_scale(c.src.name, c.decode)]
        if sorted(per_expert + stacked) != sorted(every):  # pragma: no cover - find_experts places every copy
            continue  # written in plan order, with the rest of the unit
        targets.update(id(p.target) for p in spec.parts)
        names += per_expert + stacked
    return names, targets


# ---------------------------------------------------------------------------------------------- the shards


@dataclass
class _Out:
    """One output tensor: its source name, output dtype and bytes, and where it lies in its shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int = 0  # relative to the shard's data section (compressed: set as the shard is written)
    cast: bool = False
    code: bool = False  # compressed output: a candidate for coding (at least MIN_CODED_BYTES)
    coded: Coded | None = None  # compressed output: the table, once written coded (None: written plain)

    @property
    def stored(self) -> int:
        """Bytes of the tensor in the file: its coded length when written coded, else :attr:`nbytes`."""
        return self.coded.coded_bytes if self.coded is not None else self.nbytes


@dataclass
class _Shard:
    name: str
    units: list[_Unit]
    tensors: list[_Out]
    header: bytes = b""  # plain output: the header; compressed: written last, once the coded sizes are known
    data_start: int = 0  # compressed output: bytes reserved for the header (:func:`_coded_header_bound`)
    metadata: dict[str, str] = field(default_factory=dict)  # the header's __metadata__ (compressed: before tables)

    @property
    def compressed(self) -> bool:
        return self.data_start > 0

    @property
    def data_bytes(self) -> int:
        """Plain bytes of the tensors (the index's ``total_size``)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the data section: :attr:`data_bytes` less what coding saved (an upper bound before writing)."""
        return sum(t.stored for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return (self.data_start or len(self.header)) + self.stored_bytes


def _header(tensors: list[_Out], metadata: dict[str, str]) -> bytes:
    """The header in write order, padded so the data starts at a DATA_ALIGN boundary."""
    assert [t.data_offset for t in tensors] == list(itertools.accumulate((t.nbytes for t in tensors[:-1]), initial=0))
    return encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata, align=DATA_ALIGN)


def _out_dtype(info: TensorInfo, dtype: torch.dtype | None, keep: set[str]) -> torch.dtype:
    """The dtype ``info`` is written in: ``dtype`` for floating tensors, unless the model keeps it (``keep``)."""
    cast = dtype is not None and info.dtype in _CASTABLE and info.name not in keep
    return dtype if cast else info.dtype  # type: ignore[return-value]


def _out_nbytes(info: TensorInfo, dtype: torch.dtype | None, keep: set[str]) -> int:
    return info.numel * _out_dtype(info, dtype, keep).itemsize


def _layout(units: list[_Unit], source: Source, dtype: torch.dtype | None, max_bytes: int,
            order: str, compress: bool = False) -> list[_Shard]:
    """Pack units into shards in order: a new shard starts when the next unit would pass ``max_bytes`` (plain
    bytes, also with ``compress``: the shards of a compressed output are those of the plain one, each smaller).
    With ``compress``, tensors of at least :data:`~tiered.lossless.MIN_CODED_BYTES` are marked for coding (not an
    embedding ``tiered.load`` reads by rows: a token reads a few KiB of it by byte range, and coding would make it
    read and decode whole chunks) and each shard's header space is reserved (:func:`_coded_header_bound`) instead of
    rendered."""
    groups: list[list[_Unit]] = []
    size = 0
    for u in units:
        if not groups or (groups[-1] and size + u.nbytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.nbytes
    shards = []
    least = lossless.MIN_CODED_BYTES  # read here, not at import: a test may lower it to code a tiny model
    for i, group in enumerate(groups):
        outs: list[_Out] = []
        off = 0
        for u in group:
            for n in u.tensors:
                info = source.infos[n]
                dt = _out_dtype(info, dtype, source.keep_dtype)
                cast = dt != info.dtype
                nbytes = info.numel * dt.itemsize
                code = compress and nbytes >= least and not u.rows  # rows: a few KiB a token, read by byte range
                outs.append(_Out(n, dt, info.shape, nbytes, off, cast, code=code))
                off += nbytes
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = _Shard(name, group, outs, metadata={"format": "pt", "tiered_order": order})
        if compress:
            shard.data_start = -(-_coded_header_bound(outs, shard.metadata) // DATA_ALIGN) * DATA_ALIGN
        else:
            shard.header = _header(outs, shard.metadata)
        shards.append(shard)
    return shards


def _place(units: list[_Unit], source: Source, dropped: dict[str, str], dtype: torch.dtype | None) -> list[_Unit]:
    """The units to write: each tensor in the first unit that reads it (a tied source read by two units),
    the duplicates in ``dropped`` in none, any tensor the plan missed in a last unit; empty units
    removed; ``nbytes`` set (after a cast)."""
    placed: set[str] = set(dropped)
    for u in units:
        own = []
        for n in u.tensors:
            if n not in placed:
                placed.add(n)
                own.append(n)
        u.tensors = own
    rest = [n for n in source.infos if n not in placed]
    if rest:  # pragma: no cover - the plan and the fallback place every tensor
        units.append(_Unit("(other)", rest))
    units = [u for u in units if u.tensors]
    for u in units:
        u.nbytes = sum(_out_nbytes(source.infos[n], dtype, source.keep_dtype) for n in u.tensors)
    return units


# ---------------------------------------------------------------------------------------------- compressed shards
# A compressed shard (tiered/lossless.py "The file format") is written in one pass: the coded sizes are known only
# once a tensor is coded, so the data section starts after room reserved for the largest header the shard can have,
# and the real header, padded with spaces to fill that room (the safetensors spec allows trailing spaces), is
# written last.

_MAX_CRC = 0xFFFFFFFF


def _coded_metadata(tensors: list[_Out], metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` with the format version and the tables of the coded tensors (:data:`~tiered.lossless.META_KEY`)."""
    tables = {t.name: table_entry(dtype_name(t.dtype), t.shape, t.coded) for t in tensors if t.coded is not None}
    return {**metadata, VERSION_KEY: FORMAT_VERSION,
            META_KEY: json.dumps(tables, separators=(",", ":"), ensure_ascii=False)}


def _worst_table(t: _Out) -> Coded:
    """The table of ``t`` with every number at its largest: each plane raw (its plain length), each CRC 2^32 - 1."""
    isz = t.dtype.itemsize
    chunk, sl = chunk_geometry(t.shape, isz)
    c = Coded(isz, t.nbytes, chunk, sl)
    for k in range(c.count()):
        lo, hi = c.elements(k)
        c.lens.append([hi - lo] * isz)
        c.crc.append(_MAX_CRC)
    return c


def _coded_header_bound(tensors: list[_Out], metadata: dict[str, str]) -> int:
    """An upper bound of the header's length (its 8-byte size included) once the shard is written compressed.

    Rendered by :func:`~tiered.format.encode_header` itself with every number at its largest: offsets at the plain
    layout's (a coded tensor is never longer than its plain bytes, so every real offset is at most that), each
    candidate both with its table (:func:`_worst_table`) and with whichever of its two entries (``U8 [plain bytes]``
    or its own dtype and shape) renders longer. Lengths only grow with their digits, so the real header fits.
    """
    def entry(dt: torch.dtype, shape: tuple[int, ...]) -> int:
        return len(json.dumps({"dtype": dtype_name(dt), "shape": list(shape)}, separators=(",", ":")))

    rows = []
    for t in tensors:
        if t.code and entry(torch.uint8, (t.nbytes,)) > entry(t.dtype, t.shape):
            rows.append((t.name, torch.uint8, (t.nbytes,), t.nbytes))
        else:
            rows.append((t.name, t.dtype, t.shape, t.nbytes))
    worst = [_Out(t.name, t.dtype, t.shape, t.nbytes, coded=_worst_table(t) if t.code else None) for t in tensors]
    return len(encode_header(rows, _coded_metadata(worst, metadata), align=1))


def _coded_header(shard: _Shard) -> bytes:
    """The header of a written compressed shard (coded tensors as ``U8`` entries of their coded length, plain ones
    as they are), padded with spaces to exactly :attr:`_Shard.data_start` bytes.

    Raises:
        ReshardError: it does not fit the room reserved (a bug in :func:`_coded_header_bound`; nothing is installed).
    """
    from .errors import ReshardError

    rows = [(t.name, torch.uint8, (t.stored,), t.stored) if t.coded is not None else (t.name, t.dtype, t.shape, t.nbytes)
            for t in shard.tensors]
    text = encode_header(rows, _coded_metadata(shard.tensors, shard.metadata), align=1)[8:]
    room = shard.data_start - 8
    if len(text) > room:  # pragma: no cover - the bound is an upper bound by construction
        raise ReshardError(f"{shard.name}: the header ({len(text)} bytes) does not fit the {room} bytes reserved "
                           "for it; this is a bug in tiered: report it")
    return struct.pack("<Q", room) + text + b" " * (room - len(text))
