""":func:`reshard`: the converter's one pass, from the checked arguments to the installed output.

1. Check the arguments; recover from and clean up after interrupted runs; refuse an existing ``DST``
   (:mod:`.install`).
2. Open the source, validating every header, index and pickle before any data is read (:mod:`.sources`).
3. Plan the units in execution order, drop duplicates of tied weights, pack units into shards
   (:mod:`.layout`); check the free space.
4. Write shards, index, copied and generated files into the temporary directory (with ``compress``, the
   shards coded, :mod:`.compress`); with ``verify``, re-read and compare every tensor (:mod:`.writer`).
5. Install it as ``DST`` (:mod:`.install`) and return a :class:`~tiered.reshard.ReshardSummary`.
A failure at any step removes the temporary directory; a full disk raises :class:`DiskFullError`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from .. import lossless
from ..checkpoint import LOSSLESS_INDEX_NAME
from ..errors import ConfigError, ShardNotFoundError, TieredError
from ..format import INDEX_NAME
from ..format import parse_size as _parse_size
from ..meta import parse_dtype
from ..quant import CODE_DTYPES, SCALE_SUFFIX, STREAMED
from .compress import _Coder, _write_coded_shard
from .errors import DiskFullError, ReshardError, UnsupportedCheckpointError
from .install import _commit, _fsync_path, _make_tmp, _prepare
from .layout import _layout, _place, _plan_units
from .sources import Source, _open_source
from .summary import ReshardSummary
from .writer import (
    CHUNK_BYTES,
    _config_dtype,
    _Copier,
    _copy_file,
    _files_to_copy,
    _index_bytes,
    _verify,
    _write_file,
    _write_generated,
    _write_shard,
)

__all__ = ["reshard", "parse_size"]

#: The dtypes ``dtype`` may name (``bf16``, ``fp16``, ``fp32``; names as :data:`tiered.meta.DTYPE_NAMES`).
_TARGET_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def parse_size(size: int | str) -> int:
    """Bytes in ``size`` (see :func:`tiered.format.parse_size`). Raises ReshardError when unparsable or not > 0."""
    try:
        return _parse_size(size)
    except ValueError as e:
        raise ReshardError(f"max_shard_size: {e}") from None


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The torch dtype to cast to (any case of a :data:`tiered.meta.DTYPE_NAMES` name); bf16, fp16 or fp32 only."""
    if dtype is None:
        return None
    try:
        d = parse_dtype(dtype.lower() if isinstance(dtype, str) else dtype)
    except ConfigError:
        d = None
    if d not in _TARGET_DTYPES:
        raise ReshardError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    return d


def _check_paths(src: Path, dst: Path) -> None:
    if not src.exists():
        raise ShardNotFoundError(f"{src}: no such file or directory; pass a model directory or a weight file")
    from .install import overlap

    why = overlap(src, dst)
    if why:
        raise ReshardError(f"{why}; SRC is never modified: choose another DST")


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GB",
    dtype: torch.dtype | str | None = None,
    verify: bool = False,
    force: bool = False,
    quiet: bool = False,
    compress: bool | str = False,
    decompress: bool = False,
) -> ReshardSummary:
    """Rewrite the checkpoint in ``src`` into ``dst`` in stream order (see :mod:`tiered.reshard`).

    Args:
        src: a model directory (safetensors or PyTorch weights, plus config/tokenizer files), or one
            weight file (``.safetensors``, ``.bin``, ``.pt``); never modified.
        dst: the directory to create; must not exist unless ``force``. Its parent is created if needed.
        max_shard_size: largest output shard in bytes, or a string (``"2GB"`` = 2e9 bytes, decimal as
            transformers; ``"2GiB"``). Units are never split: a larger unit gets a shard of its own.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (or the torch dtype): cast floating tensors
            (F16/BF16/F32/F64; integer and fp8 tensors are kept) and set ``config.json``'s dtype.
        verify: re-read every written tensor from disk and compare BLAKE2b hashes before the rename
            (bytes are then copied through user space, to hash them on the way).
        force: replace an existing ``dst`` (only once the new one is complete).
        quiet: no progress bar (tqdm, stderr).
        compress: write the shards losslessly compressed (issue 25; the format is :mod:`tiered.lossless`'s):
            every output tensor of at least 64 KiB is cut into chunks of about 4 MiB (whole rows; one expert of a
            stacked ``(E, ...)`` tensor per slice), each chunk's byte planes zstd-coded (or kept raw) with a CRC-32
            per chunk, and kept coded when that made it smaller. Casting, order, shards and tied weights are as
            without it; the index is ``model.lossless.index.json`` (no ``model.safetensors.index.json``, so stock
            ``from_pretrained`` refuses the directory); ``tiered.load`` reads it. Needs ``zstandard``. Coding
            runs on up to 4 threads; the bytes counted on the progress bar are plain ones. ``compress="exp3"``:
            bf16 tensors in :mod:`tiered.expcode`'s code instead (about 0.70 of their bytes; a CUDA load decodes them
            on the GPU after the H2D copy), other dtypes as with ``True`` (``"zstd"``).
        decompress: ``src`` must be a compressed checkpoint; it is written plain, bit-equal to what ``reshard``
            of the original without ``compress`` writes. (A compressed ``src`` is decoded whenever ``compress``
            is not given; this flag only says that it must be one.)

    Returns:
        a :class:`ReshardSummary` (``print`` it for the human-readable summary).

    Memory: chunks of :data:`CHUNK_BYTES` (64 MiB); peak RSS growth is a few chunks plus, for a
    non-contiguous tensor in a ``.bin``, that tensor. ``compress`` adds the chunks in flight on the coder threads
    (about 60 MiB with 4 threads; 121 MiB growth in all measured on 0.94 GB of bf16 on 2 cores); a compressed
    ``src`` is decoded one window at a time (79 MiB growth measured there).

    Raises:
        DestinationExistsError: ``dst`` exists and not ``force``.
        DiskFullError: ENOSPC/EDQUOT, or not enough free space up front; nothing is left behind.
        ShardNotFoundError: no weights in ``src``, or an index names a missing shard.
        DuplicateTensorError: a tensor name in two shards.
        HeaderError / TruncatedShardError: a malformed safetensors header or index.
        UnsafePickleError: a PyTorch file needs pickle beyond tensors (``weights_only=True`` refused it).
        UnsupportedCheckpointError: a PyTorch file that is not a state dict of dense tensors, or is damaged.
        VerifyError: with ``verify``, a tensor read back from disk differs.
        CodecError: a coded tensor of a compressed ``src`` is corrupted (fails its CRC-32 or does not decode);
            the message names the file, the tensor and the chunk's file offset.
        ReshardError: bad arguments (``dst`` inside ``src``, an unknown ``dtype``, a bad size, ``compress``
            with ``decompress``, ``decompress`` of a ``src`` that is not compressed, no ``zstandard``).
    """
    t0 = time.perf_counter()
    src_p, dst_p = Path(src).absolute(), Path(dst).absolute()
    max_bytes = parse_size(max_shard_size)
    out_dtype = _parse_dtype(dtype)
    if compress not in (False, True, "zstd", "exp3"):
        raise ReshardError(f"compress={compress!r}: pass True (or 'zstd') or 'exp3'")
    if compress == "exp3" and out_dtype not in (None, torch.bfloat16):
        raise ReshardError(f"compress='exp3' codes bf16 tensors, and dtype={dtype!r} leaves none: pass dtype='bf16', "
                           "or compress=True (zstd) for fp16/fp32")
    if compress and decompress:
        raise ReshardError("compress and decompress exclude each other: pass one (decompress writes plain shards)")
    if compress:
        _need_zstandard("compress")
    _check_paths(src_p, dst_p)
    notes = _prepare(dst_p, force)  # recovery, strays, an existing DST, a writable parent
    if not quiet and src_p.suffix == ".gguf":  # the metadata phase is long and has no progress of its own
        print(f"reshard: reading {src_p.name}'s metadata, config and tokenizer with transformers' GGUF code "
              "(10-60 s for a 50k-token vocabulary on a 2-core machine)...", file=sys.stderr, flush=True)
    source = _open_source(src_p)  # every header, index and pickle validated; no tensor data read
    try:
        coded_src = bool(getattr(source, "compressed", False))  # an optional attribute of the source interface
        if decompress and not coded_src:
            raise ReshardError(f"SRC {src_p} is not a compressed checkpoint (no {LOSSLESS_INDEX_NAME}, no coded "
                               "shard): there is nothing to decompress; reshard it without --decompress")
        if coded_src and any(isinstance(i, lossless.LosslessInfo) and i.coded.codec != lossless.EXP3
                             for i in source.infos.values()):
            _need_zstandard("decode the compressed SRC")  # an exp3-only SRC decodes with numpy
        return _reshard(source, src_p, dst_p, t0, max_bytes, out_dtype, verify, force, quiet, notes, compress)
    finally:
        source.close()


def _need_zstandard(what: str) -> None:
    """Raises ReshardError when ``zstandard`` (the codec of :mod:`tiered.lossless`) is not installed."""
    import importlib.util

    if importlib.util.find_spec("zstandard") is None:
        raise ReshardError(f"to {what}, tiered needs the zstandard package: pip install 'tiered[compress]'")


def _quant_config(source: Source) -> dict | None:
    """The source's ``quantization_config`` (of the config.json it generates, else of ``source.root``'s; the top
    level's, else a language sub-config's, as :func:`tiered.quant.config_of` reads it), or None."""
    gen = source.generated_files.get("config.json")
    try:
        doc = json.loads(gen) if gen is not None else json.loads((source.root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    for d in (doc, *(doc.get(k) for k in ("text_config", "language_config", "llm_config"))):
        qc = d.get("quantization_config") if isinstance(d, dict) else None
        if isinstance(qc, dict):
            return qc
    return None


def _scales_of_codes(source: Source, *, fp8: bool) -> set[str]:
    """The scale tensors of float8 codes in ``source``: ``X_scale_inv`` and ``X.scale`` beside float8 ``X`` /
    ``X.weight`` (with or without a ``quantization_config``: a stripped config must not get its scales rounded), and,
    for an fp8 config, its ``activation_scale`` tensors."""
    infos = source.infos

    def codes(name: str) -> bool:
        return name in infos and infos[name].dtype in CODE_DTYPES

    out = set()
    for n in infos:
        if (n.endswith(SCALE_SUFFIX) and codes(n[: -len(SCALE_SUFFIX)])) \
                or (n.endswith(".scale") and codes(n[: -len("scale")] + "weight")) \
                or (fp8 and n.endswith("activation_scale")):
            out.add(n)
    return out


def _same_bytes(source: Source, a: str, b: str) -> bool:
    """True when tensors ``a`` and ``b`` have the same dtype, shape and bytes (read in chunks)."""
    ia, ib = source.infos[a], source.infos[b]
    if (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
        return False
    if source.same_storage(a, b):
        return True
    va, drop_a = source.byte_view(a)
    vb, drop_b = source.byte_view(b)
    for lo in range(0, ia.nbytes, CHUNK_BYTES):
        hi = min(ia.nbytes, lo + CHUNK_BYTES)
        same = torch.equal(va[lo:hi], vb[lo:hi])
        drop_a(lo, hi)
        drop_b(lo, hi)
        if not same:
            return False
    return True


def _disk_full(e: OSError, dst: Path, where: str) -> DiskFullError:
    free = shutil.disk_usage(dst.parent).free
    return DiskFullError(f"{dst}: disk full while writing {where} ({os.strerror(e.errno or errno.ENOSPC)}); "
                         f"{free / 1e9:.2f} GB free on {dst.parent}; the partial output was removed: "
                         "free space or choose a DST on another disk")


def _reshard(source: Source, src: Path, dst: Path, t0: float, max_bytes: int, dtype: torch.dtype | None,
             verify: bool, force: bool, quiet: bool, notes: list[str], compress: bool = False) -> ReshardSummary:
    from tqdm.auto import tqdm

    notes += source.notes
    qc = _quant_config(source)
    if qc is not None and compress:  # tiered.load cannot dequantize coded codes yet (tiered/plan.py refuses them)
        raise UnsupportedCheckpointError(
            f"{source.root / 'config.json'}: a quant_method={str(qc.get('quant_method', '')).lower()!r} checkpoint; "
            "--compress of quantized codes is not supported yet (tiered.load could not dequantize them): reshard it "
            "without --compress")
    if qc is not None and dtype is not None:
        method = str(qc.get("quant_method", "")).lower()
        if method not in STREAMED or method == "compressed-tensors":  # (its scales are in the model's dtype)
            raise UnsupportedCheckpointError(
                f"{source.root / 'config.json'}: a quant_method={method!r} checkpoint; --dtype would cast its scales "
                "and change what it decodes to. Reshard it without --dtype (its tensors are then copied bit for bit)")
    units, arch, tied = _plan_units(source, notes, dtype)
    if dtype is not None:  # float8 codes are not castable; their scales stay exact too, config or not (tiered.quant)
        scales = _scales_of_codes(source, fp8=qc is not None)
        source.keep_dtype = set(getattr(source, "keep_dtype", None) or ()) | scales
        if scales:
            notes.append(f"{len(scales)} FP8 scale tensors kept in their dtype (the decode reads them as they are)")
    dropped = {dup: keep for dup, keep in tied.items() if _same_bytes(source, dup, keep)}
    groups = getattr(source, "storage_groups", None)  # an optional hook of the source interface
    if arch is None and groups is not None:
        shared = [" = ".join(names) for names in groups()]
        if shared:
            notes.append("tensors share storage in the checkpoint, but without a model nothing says they are tied, "
                         f"so each is written: {', '.join(shared[:3])}")
    # the loader's unit count (as `tiered inspect` and tiered.stats give it): a unit that reads a tied
    # tensor written with an earlier one has no bytes of its own, but the loader still counts it
    plan_units = sum(1 for u in units if not u.name.startswith("(not used by")) if arch else None
    units = _place(units, source, dropped, dtype)
    shards = _layout(units, source, dtype, max_bytes, "plan" if arch else "layer-index", compress)
    written = [t.name for s in shards for t in s.tensors]
    files = _files_to_copy(source, src, notes)
    generated = source.generated_files
    need = (sum(s.file_bytes for s in shards) + sum(p.stat().st_size for p in files)  # compressed: plain bytes
            + sum(len(b) for b in generated.values()))
    if need > shutil.disk_usage(dst.parent).free:
        raise DiskFullError(f"{dst}: needs {need / 1e9:.2f} GB but {dst.parent} has "
                            f"{shutil.disk_usage(dst.parent).free / 1e9:.2f} GB free; free space or choose another DST")
    total = sum(s.data_bytes for s in shards)

    tmp, lock_fd = _make_tmp(dst)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"reshard {dst.name}",
               file=sys.stderr, disable=quiet, dynamic_ncols=True, mininterval=0.25)
    where = "the index"
    hashes: dict[str, bytes] | None = {} if verify else None
    copier = _Copier(source, bar, hashes)
    coder = _Coder(codec="exp3" if compress == "exp3" else "zstd") if compress else None
    index_name = LOSSLESS_INDEX_NAME if compress else INDEX_NAME
    t_write = time.perf_counter()
    try:
        for s in shards:
            where = s.name
            if coder is not None:
                _write_coded_shard(tmp / s.name, s, copier, coder)
            else:
                _write_shard(tmp / s.name, s, copier)
        where = index_name
        if compress == "exp3" and not any(t.coded is not None and t.coded.codec == lossless.EXP3
                                          for s in shards for t in s.tensors):
            notes.append("--codec exp3 codes bf16 tensors and this output has none: every coded tensor is "
                         "bytegroup-zstd1 (pass --dtype bf16 for exp3)")
        _write_file(tmp / index_name, _index_bytes(shards, compress))
        for p in files:
            rel = p.relative_to(source.root)
            where = str(rel)
            _copy_file(p, tmp / rel, dtype, notes, top=len(rel.parts) == 1)
        for d in sorted({tmp / q for p in files for q in p.relative_to(source.root).parents if q != Path(".")},
                        key=lambda d: -len(d.parts)):  # subdirectories' entries, deepest first (tmp: at commit)
            _fsync_path(d)
        for name, data in generated.items():
            where = name
            _write_generated(tmp / name, data, dtype, notes)
        bar.close()
        write_s = time.perf_counter() - t_write
        if hashes is not None:
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"verify {dst.name}",
                      file=sys.stderr, disable=quiet, dynamic_ncols=True, mininterval=0.25) as vbar:
                _verify(tmp, shards, hashes, vbar)
        _commit(tmp, dst, force)
    except BaseException as e:
        bar.close()
        if coder is not None:
            coder.close()
        copier.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, TieredError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(e, dst, where) from e
        raise
    finally:
        os.close(lock_fd)
    copier.close()
    if coder is not None:
        coder.close()
        if coder.plain:
            notes.append(f"{coder.plain} tensors of {lossless.MIN_CODED_BYTES} bytes or more written plain: coding "
                         "did not make them smaller")
    src_order = [n for n in source.infos if n not in dropped]
    return ReshardSummary(
        src=src, dst=dst, input_format=source.kind, input_files=len(source.files), shards=len(shards),
        tensors=len(written), data_bytes=total, file_bytes=sum(s.file_bytes for s in shards),
        seconds=time.perf_counter() - t0, write_seconds=write_s, order="plan" if arch else "layer-index", architecture=arch,
        units=plan_units if plan_units is not None else len(units), reordered=written != src_order,
        cast=sum(t.cast for s in shards for t in s.tensors),
        dtype=_config_dtype(dtype) if dtype is not None else None, dropped_tied=dropped,
        copied_files=tuple(sorted([str(p.relative_to(source.root)) for p in files] + list(generated))), verified=verify,
        kernel_copy_bytes=copier.kernel_copied, notes=tuple(notes),
        stored_bytes=sum(s.stored_bytes for s in shards) if compress else None,
        coded_tensors=coder.coded if coder is not None else 0,
        coded_plain_bytes=sum(t.nbytes for s in shards for t in s.tensors if t.coded is not None),
        coded_stored_bytes=sum(t.coded.coded_bytes for s in shards for t in s.tensors if t.coded is not None),
        codec="exp3-bf16 for bf16 tensors, bytegroup-zstd1 for others" if compress == "exp3" else "bytegroup-zstd1",
    )
