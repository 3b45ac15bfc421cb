"""Quantized checkpoints: which ``quantization_config`` tiered loads; block-scaled FP8 and MXFP4 decoded exactly.

Issue 24. A checkpoint whose ``config.json`` has a ``quantization_config`` stores codes, not weights: read as if they
were weights they give silently wrong numbers. So:

* :func:`check_config` runs while the plan is built (before any weight byte is read) and refuses, with a
  :class:`~tiered.errors.QuantizationError` naming the method and what would work, every method tiered does not
  decode. Decoded today: ``quant_method="fp8"`` (transformers' ``FineGrainedFP8Config``: DeepSeek-V3/R1 and
  Qwen3-*-FP8, e4m3 codes with a ``weight_scale_inv`` per block) and ``"mxfp4"`` (gpt-oss's experts:
  :func:`mxfp4_sources`, :func:`decode_mxfp4`, transformers' own ``convert_moe_packed_tensors`` per band of rows)
  and ``"compressed-tensors"`` (:func:`ct_groups`, :func:`ct_sources`, :func:`decode_ct`: int4/int8 pack-quantized,
  int8 and fp8 weights with tensor, channel or group scales, symmetric, weight-only or with dynamic input activations;
  the decode is the ``compressed-tensors`` package's own compressor, which stock uses too, run on bands of rows, and
  the activation quantization is the package's own forward, :func:`ct_forward`).
* :func:`attach_decodes` gives every copy of a plan whose checkpoint tensor ``X`` has a sibling ``X_scale_inv`` an
  :class:`Fp8Block` decode. A sibling scale without a ``quantization_config`` (a config stripped of it) is refused
  too: stock would load the codes as weights.
* :func:`decode_rows` is the arithmetic: what ``transformers.integrations.finegrained_fp8.Fp8Dequantize`` does when
  ``from_pretrained`` dequantizes (``FineGrainedFP8Config(dequantize=True)``, and on a machine without a GPU, where
  stock dequantizes by itself): ``(codes.to(float32) * scale.to(float32)).to(dtype)`` element by element, the scale
  being that of the element's block; a ``uint8`` scale (an E8M0 exponent) is ``2 ** (byte - 127)`` as there. It runs
  on row bands, so its float32 temporaries are one band's, never one tensor's; each element's product and rounding
  are the same, so the result is bitwise stock's.

Blocks. Stock 5.17 derives the block from the scale grid (``rows // grid_rows``), which is the block the checkpoint
was quantized with when the block divides the weight (every shape of DeepSeek-V3 and Qwen3 FP8 but DeepSeek's 576-row
``kv_a_proj_with_mqa``). Where it does not, the grid has ``ceil(rows / block)`` rows (DeepSeek's ``weight_dequant``
and the FP8 matmul kernels read it so), and stock either refuses (``rows`` not a multiple of the grid) or applies
some scales to the wrong rows. :func:`block_of` takes the config's ``weight_block_size`` where the grid is its
ceiling grid — equal to stock wherever stock is right — else stock's derivation, else refuses.

On the CPU the reader decodes into the ring slot (the slot holds the model dtype). On CUDA a unit with decoded copies
is laid out *stored* (:func:`tiered.plan.lay_out`): the disk, the page cache, the ring, the host tier and the H2D copy
carry the codes and scales, and :func:`decode_stored` (the device stage, on the copy stream) decodes them into the
unit's device buffer. Routed experts (:mod:`tiered.experts`) read one expert's codes as a :class:`CodedInfo` and
decode them the same way: on the CPU on the reader threads; on CUDA after the H2D copy, with every expert's scales kept
on the device; the CUDA host tier keeps them as stored (``ExpertSpec.stored``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import QuantizationError
from .tensor_info import TensorInfo

__all__ = ["Fp8Block", "CtWeight", "CodedInfo", "check_config", "attach_decodes", "block_of", "decode_rows",
           "decode_ct", "ct_sources", "STREAMED", "SCALE_SUFFIX"]

#: ``quant_method`` values tiered decodes.
STREAMED = ("fp8", "mxfp4", "compressed-tensors")
#: compressed-tensors formats tiered decodes (:class:`CtWeight`): the package's own ``decompress`` of each
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
#: compressed-tensors weight strategies whose scales go by rows (a band of rows decodes with the scale rows it uses)
CT_STRATEGIES = ("tensor", "channel", "group")
#: the checkpoint name of a tensor's block scales: ``X`` -> ``X + SCALE_SUFFIX`` (transformers' ``Fp8Dequantize``)
SCALE_SUFFIX = "_scale_inv"
#: float8 code dtypes an ``fp8`` checkpoint stores (``Fp8Dequantize`` casts any of them to float32)
CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: what stock does with each method, and what would work instead (the refusal's advice)
_ADVICE = {
    "bitsandbytes": "load the unquantized checkpoint it was made from (bitsandbytes quantizes at load time)",
}
_GENERIC = ("dequantize it once with transformers (from_pretrained, then model.dequantize() where the method has it, "
            "then save_pretrained) or use the unquantized checkpoint, and load that")


@dataclass(frozen=True)
class Fp8Block:
    """A copy's decode: the codes (the copy's ``src``) times the scale of their block.

    ``scale``: the checkpoint tensor of scales, shape ``(*lead, grid_rows, grid_cols)`` (or one scale: ``()`` or
    ``(1,)``), dtype float32, bfloat16, float16, float8_e8m0fnu or uint8 (an E8M0 exponent). ``block``: rows and
    columns of the codes one scale covers (the last block of a row or column may be short). ``row0``: for a band of
    rows (:func:`rows_of`), how far into its first block row it starts.
    """

    scale: TensorInfo
    block: tuple[int, int]
    row0: int = 0  # the codes' first row lies this many rows into the first block row of ``scale``


@dataclass(frozen=True)
class Mxfp4Block:
    """A copy's MXFP4 decode (gpt-oss experts): the copy's ``src`` is ``<name>_blocks`` ``(E, R, G, 16)`` uint8 (two
    e2m1 codes per byte), ``scale`` is ``<name>_scales`` ``(E, R, G)`` uint8 (E8M0 exponents, one per 32 codes); the
    target is ``(E, G * 32, R)``: transformers' ``convert_moe_packed_tensors`` (bf16), transposed, as stock's
    ``Mxfp4Dequantize`` produces it."""

    scale: TensorInfo


@dataclass(frozen=True)
class CtWeight:
    """A copy's compressed-tensors decode: the copy's ``src`` holds the codes (``X.weight_packed`` int32 for
    ``pack-quantized``, ``X.weight`` int8 or float8 otherwise), ``scale`` is ``X.weight_scale``; the target is the
    ``shape`` ``(rows, cols)`` weight. The arithmetic is the package's own compressor ``decompress`` for ``fmt`` with
    ``scheme`` (the config group's :class:`compressed_tensors.quantization.QuantizationScheme` as JSON), run on bands
    of rows (:func:`decode_ct`); ``block`` is ``(1, cols)``: every scale row belongs to one weight row (strategies
    :data:`CT_STRATEGIES`), so a band of rows decodes with its own scale rows. ``row0`` as in :class:`Fp8Block`."""

    scale: TensorInfo
    block: tuple[int, int]
    fmt: str
    scheme: str
    shape: tuple[int, int]
    row0: int = 0
    # a routed MoE expert's matrix (:func:`ct_experts`): decoded as stock's ``DecompressExperts`` does, the scale as
    # stored (float8: ``(codes.float() * scale.float()).to(bfloat16)``), then cast to the target's dtype
    expert: bool = False


@dataclass(frozen=True)
class CodedInfo(TensorInfo):
    """A range of float8 codes that carries its decode (a routed expert's slab: :mod:`tiered.expert_spec`): read and
    decoded as one piece (never merged with a neighbour nor split by bytes). ``nbytes`` are the codes';
    :attr:`stored_bytes` adds the scales."""

    decode: Any = None  # Fp8Block or Mxfp4Block

    @property
    def stored_bytes(self) -> int:
        return self.nbytes + (self.decode.scale.nbytes if self.decode is not None else 0)


def slab(codes: TensorInfo, dec: Fp8Block, j: int) -> CodedInfo:
    """Matrix ``j`` of a stacked ``(E, rows, cols)`` code tensor with its ``(E, gr, gc)`` scales, as a
    :class:`CodedInfo` of shape ``(rows, cols)``.

    Raises:
        QuantizationError: the scales are not one grid per matrix (a single scale for the whole stack).
    """
    rows, cols = codes.shape[-2:]
    sc = dec.scale
    if sc.numel == 1 or len(sc.shape) < 3:
        raise QuantizationError(f"{sc.file}: scale {sc.name!r} at offset {sc.offset} has shape {list(sc.shape)}: one "
                                f"scale for every expert of {codes.name!r}, which cannot be read one expert at a time")
    gr, gc = sc.shape[-2:]
    per, sper = rows * cols * codes.dtype.itemsize, gr * gc * sc.dtype.itemsize
    s = TensorInfo(f"{sc.name}[{j}]", sc.dtype, (gr, gc), sc.file, sc.offset + j * sper, sper)
    return CodedInfo(f"{codes.name}[{j}]", codes.dtype, (rows, cols), codes.file, codes.offset + j * per, per,
                     Fp8Block(s, dec.block))


def mxfp4_slab(blocks: TensorInfo, dec: Mxfp4Block, j: int) -> CodedInfo:
    """Expert ``j`` of gpt-oss's packed ``(E, R, G, 16)`` blocks with its ``(R, G)`` scales, as a :class:`CodedInfo` of
    shape ``(R, G, 16)``: it decodes to expert ``j``'s ``(G * 32, R)`` slab (:func:`decode_mxfp4`)."""
    E, R, G, _ = blocks.shape
    per, sper = R * G * 16, R * G
    sc = dec.scale
    s = TensorInfo(f"{sc.name}[{j}]", sc.dtype, (R, G), sc.file, sc.offset + j * sper, sper)
    return CodedInfo(f"{blocks.name}[{j}]", blocks.dtype, (R, G, 16), blocks.file, blocks.offset + j * per, per,
                     Mxfp4Block(s))  # type: ignore[arg-type]


def rows_of(info: CodedInfo, r0: int, r1: int) -> CodedInfo:
    """Rows ``[r0, r1)`` of a 2-D :class:`CodedInfo` with the scale rows they need (any ``r0``: a band that starts
    inside a block keeps its offset in :attr:`Fp8Block.row0`)."""
    rows, cols = info.shape
    dec = info.decode
    isz = info.dtype.itemsize
    name, off, nb = f"{info.name}[{r0}:{r1}]", info.offset + r0 * cols * isz, (r1 - r0) * cols * isz
    if dec is None or dec.scale.numel == 1:
        return CodedInfo(name, info.dtype, (r1 - r0, cols), info.file, off, nb, dec)
    return CodedInfo(name, info.dtype, (r1 - r0, cols), info.file, off, nb, band_block(dec, r0, r1))


def band_block(dec: Fp8Block, r0: int, r1: int) -> Fp8Block:
    """``dec`` (a 2-D grid) for rows ``[r0, r1)`` of its codes: the scale rows they use, and the offset of ``r0``
    into the first of them."""
    bm = dec.block[0]
    sc = dec.scale
    gc = sc.shape[-1]
    a0, a1 = dec.row0 + r0, dec.row0 + r1
    a, b = a0 // bm, -(-a1 // bm)
    sisz = sc.dtype.itemsize
    s = TensorInfo(sc.name, sc.dtype, (b - a, gc), sc.file, sc.offset + a * gc * sisz, (b - a) * gc * sisz)
    return dataclasses.replace(dec, scale=s, row0=a0 - a * bm)


def _qc_dict(qc: Any) -> dict | None:
    """A ``quantization_config`` (a dict, or a transformers config object) as a dict whose ``quant_method`` is a
    plain string (``QuantizationMethod.FP8`` -> ``"fp8"``)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        to_dict = getattr(qc, "to_dict", None)
        qc = to_dict() if callable(to_dict) else dict(vars(qc))
    m = qc.get("quant_method")
    if m is not None and hasattr(m, "value"):  # transformers' QuantizationMethod (a str Enum: str() is its name)
        qc = {**qc, "quant_method": str(m.value)}
    return qc


def config_of(model: Any, root: Path | None = None) -> dict | None:
    """The ``quantization_config`` of ``model.config`` (or of every sub-config), else of ``root/config.json``."""
    cfg = getattr(model, "config", None)
    qc = _qc_dict(getattr(cfg, "quantization_config", None))
    if qc is None and cfg is not None:
        for name in ("text_config", "language_config", "llm_config"):
            sub = getattr(cfg, name, None)
            qc = _qc_dict(getattr(sub, "quantization_config", None))
            if qc is not None:
                break
    if qc is None and root is not None:
        try:
            doc = json.loads((Path(root) / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if isinstance(doc, dict):
            qc = _qc_dict(doc.get("quantization_config"))
    return qc


def check_config(qc: dict | None, where: str) -> None:
    """Refuse a ``quantization_config`` (``where``: the config file, for the message) that tiered does not decode.

    Raises:
        QuantizationError: ``quant_method`` is not one of :data:`STREAMED`, or an ``fp8`` config asks for what the
            decode does not do (FP8 embeddings: ``modules_to_convert``).
    """
    if qc is None:
        return
    method = str(qc.get("quant_method", "")).lower() or "(no quant_method)"
    if method not in STREAMED:
        raise QuantizationError(
            f"{where}: quantization_config has quant_method={method!r}, which tiered does not decode (it decodes "
            f"{', '.join(STREAMED)}); its tensors are codes, and loading them as weights would give wrong numbers. "
            f"To run it: {_ADVICE.get(method, _GENERIC)}")
    if method == "compressed-tensors":
        ct_groups(qc, where)
        return
    if qc.get("modules_to_convert"):
        raise QuantizationError(
            f"{where}: quantization_config.modules_to_convert={qc['modules_to_convert']!r} keeps FP8 embedding tables "
            "(transformers' FP8Embedding), which tiered does not decode; dequantize it once with transformers "
            "(FineGrainedFP8Config(dequantize=True), then save_pretrained) and load that copy")


_CT_ADVICE = ("decompress it once with transformers (from_pretrained(dir, quantization_config="
              "CompressedTensorsConfig(dequantize=True)), then save_pretrained) and load that copy")


def _ct_refuse(where: str, what: str) -> QuantizationError:
    return QuantizationError(f"{where}: compressed-tensors {what}; tiered decodes weight-only and dynamic-activation "
                             f"schemes of the formats {', '.join(CT_FORMATS)} with strategies {', '.join(CT_STRATEGIES)}, "
                             f"symmetric, without act-order indices. To run it: {_CT_ADVICE}")


def ct_groups(qc: dict, where: str) -> list[tuple[str, dict, str]]:
    """A compressed-tensors ``quantization_config``'s config groups as (name, group, format), checked.

    Raises:
        QuantizationError: what the decode would not give exactly as stock does: a status other than
            ``compressed``; sparsity, transforms or a KV-cache scheme; a format not in :data:`CT_FORMATS`; a weight
            strategy not in :data:`CT_STRATEGIES`; asymmetric weights (zero points); act-order group indices; a
            ``scale_dtype``; static or output activations (stock reads their scales from the checkpoint and
            quantizes in its forward, which tiered does for dynamic input activations only).
    """
    status = str(qc.get("quantization_status") or "(none)").lower()  # (the package's default is "initialized")
    if status != "compressed":
        raise _ct_refuse(where, f"quantization_status={status!r} (stock fake-quantizes such weights in every forward)")
    for k in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(k):
            raise _ct_refuse(where, f"{k} is set")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _ct_refuse(where, "config without config_groups")
    out = []
    for name, g in groups.items():
        g = g if isinstance(g, dict) else {}
        fmt = str(g.get("format") or qc.get("format") or "")
        w = g.get("weights")
        if fmt not in CT_FORMATS:
            raise _ct_refuse(where, f"config group {name!r} has format {fmt!r}")
        if not isinstance(w, dict):
            raise _ct_refuse(where, f"config group {name!r} quantizes no weights")
        strategy, typ = str(w.get("strategy") or "tensor"), str(w.get("type") or "int")
        if strategy not in CT_STRATEGIES:
            raise _ct_refuse(where, f"config group {name!r} has weight strategy {strategy!r}")
        if w.get("symmetric", True) is not True:
            raise _ct_refuse(where, f"config group {name!r} has asymmetric weights (zero points)")
        if str(w.get("actorder") or "").lower() == "group":
            raise _ct_refuse(where, f"config group {name!r} has actorder='group' (weight_g_idx)")
        if w.get("scale_dtype") or w.get("zp_dtype") or w.get("block_structure"):
            raise _ct_refuse(where, f"config group {name!r} sets scale_dtype, zp_dtype or block_structure")
        if not {"pack-quantized": typ == "int", "int-quantized": typ == "int", "float-quantized": typ == "float",
                "naive-quantized": typ in ("int", "float")}[fmt]:
            raise _ct_refuse(where, f"config group {name!r} stores {typ} weights as {fmt!r}")
        if g.get("output_activations"):
            raise _ct_refuse(where, f"config group {name!r} quantizes output activations")
        a = g.get("input_activations")
        if a and (a.get("dynamic") is not True or a.get("symmetric", True) is not True):
            raise _ct_refuse(where, f"config group {name!r} quantizes input activations statically or "
                                    "asymmetrically (input_scale / input_zero_point)")
        if not isinstance(g.get("targets"), (list, str)) or not g.get("targets"):
            raise _ct_refuse(where, f"config group {name!r} has no targets")
        _ct_package(where)
        from compressed_tensors.quantization import QuantizationScheme

        try:  # the package's own validation, as stock's config parsing runs it
            QuantizationScheme.model_validate({k: g.get(k) for k in ("targets", "weights", "input_activations",
                                                                     "output_activations")})
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError (and what the validators raise)
            raise _ct_refuse(where, f"config group {name!r} does not validate ({str(e).strip()[:300]})") from None
        out.append((str(name), g, fmt))
    return out


def _ct_package(where: str):
    try:
        from compressed_tensors.utils.match import is_match
    except ImportError as e:
        raise QuantizationError(
            f"{where}: a compressed-tensors checkpoint needs the compressed-tensors package, which stock transformers "
            "uses for it too (pip install compressed-tensors, or tiered's [quant] extra)") from e
    return is_match


def ct_sources(qc: dict | None, model: Any, unused: list[str], tensors: dict[str, TensorInfo], sd: dict[str, Any],
               where: str, direct: dict[str, TensorInfo] | None = None,
               to_model: Any = None) -> dict[str, tuple[TensorInfo, CtWeight]]:
    """A compressed-tensors checkpoint's quantized weights: model key ``X.weight`` -> (its codes, its decode), for
    every ``nn.Linear`` ``X`` a config group targets, the group chosen as stock chooses it (the package's own
    ``is_match`` with the config's ``ignore``, then ``match_targets``' precedence: exact name, regex, class name; the
    first target's group); their ``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape`` leave ``unused``.
    Checkpoint names are found through ``direct`` (model key -> the checkpoint tensor it copies) and ``to_model``
    (a checkpoint name -> the model's name for it: transformers' renamings, e.g. a VLM's ``language_model.model.``
    prefix), as stock renames them. {} for any other checkpoint.

    Raises:
        QuantizationError: a targeted module without its codes or scale, codes or scales whose dtype or shape do
            not fit the module's weight, zero points or act-order indices in the checkpoint, or quantized tensors
            that no targeted module takes (e.g. per-expert codes a transformers conversion would stack, which tiered
            does not decode).
    """
    if qc is None or str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return {}
    groups = ct_groups(qc, where)
    is_match = _ct_package(where)
    from compressed_tensors.utils.match import match_targets

    ignore = qc.get("ignore") or []
    by_target: dict[str, tuple[str, dict, str]] = {}  # as stock's target_to_scheme: a later group's target wins
    for n, g, f in groups:
        for t in [g["targets"]] if isinstance(g["targets"], str) else g["targets"]:
            by_target[t] = (n, g, f)
    direct = direct or {}
    to_model = to_model or (lambda n: n)
    named = {to_model(n): n for n in tensors}  # the model's name of every checkpoint tensor -> its checkpoint name

    def find(name: str) -> TensorInfo | None:
        if name in direct:
            return direct[name]
        ck = named.get(name)
        return tensors[ck] if ck is not None else tensors.get(name)

    out: dict[str, tuple[TensorInfo, CtWeight]] = {}
    for mname, mod in model.named_modules():
        key = f"{mname}.weight" if mname else "weight"
        if key not in sd or not isinstance(mod, torch.nn.Linear):  # (stock quantizes Linear and Embedding; the
            continue  # package's Embedding path fails on stock's side, so tiered leaves embeddings alone)
        if not is_match(mname, mod, list(by_target), ignore):
            continue
        gname, g, fmt = by_target[match_targets(mname, mod, list(by_target))[0]]
        w = g["weights"]
        bits, strategy = int(w.get("num_bits") or 8), str(w.get("strategy") or "tensor")
        rows, cols = (int(x) for x in sd[key].shape)
        packed = fmt == "pack-quantized"
        codes = find(f"{mname}.weight_packed" if packed else key)
        scale = find(f"{mname}.weight_scale")
        for extra in ("weight_zero_point", "weight_g_idx"):
            e = find(f"{mname}.{extra}")
            if e is not None:
                raise QuantizationError(f"{e.file}: tensor {e.name!r} at offset {e.offset}: {extra} in a checkpoint "
                                        f"whose {where} config group {gname!r} is symmetric without act-order; "
                                        f"the checkpoint does not match its config. {_CT_ADVICE[0].upper()}{_CT_ADVICE[1:]}")
        if codes is None or scale is None:
            miss = f"{mname}.weight_packed" if packed and codes is None else (key if codes is None else f"{mname}.weight_scale")
            raise QuantizationError(f"{where}: config group {gname!r} quantizes {mname!r} ({fmt}), but the checkpoint "
                                    f"has no {miss!r}; the checkpoint does not match its config.json")
        typ = str(w.get("type") or "int")
        want_dt = (torch.int32,) if packed else (torch.int8,) if typ == "int" else (torch.float8_e4m3fn,)
        want_shape = (rows, -(-cols * bits // 32)) if packed else (rows, cols)
        if codes.dtype not in want_dt or tuple(codes.shape) != want_shape:
            raise QuantizationError(f"{codes.file}: tensor {codes.name!r} at offset {codes.offset} is {codes.dtype} "
                                    f"{list(codes.shape)}, but {fmt} {bits}-bit codes of {key!r} {[rows, cols]} are "
                                    f"{' or '.join(map(str, want_dt))} {list(want_shape)}; the checkpoint does not match "
                                    "its config.json")
        gs = int(w.get("group_size") or 0)
        if strategy == "group" and (gs <= 0 or cols % gs):
            raise QuantizationError(f"{where}: config group {gname!r} has group_size {gs}, which does not divide "
                                    f"{key!r}'s {cols} input features (stock's dequantize fails on it too); the "
                                    "checkpoint does not match its config.json")
        if packed:
            ws = find(f"{mname}.weight_shape")
            if ws is None or tuple(ws.shape) != (2,) or ws.dtype not in (torch.int64, torch.int32):
                raise QuantizationError(f"{where}: {fmt} codes of {mname!r} without their weight_shape (2 integers) "
                                        "in the checkpoint; the checkpoint is incomplete")
        want_sc = {"tensor": None, "channel": (rows, 1), "group": (rows, -(-cols // gs) if gs else -1)}[strategy]
        ok = scale.dtype.is_floating_point and scale.dtype.itemsize >= 2 and (
            scale.numel == 1 if want_sc is None else tuple(scale.shape) == want_sc)
        if not ok:
            raise QuantizationError(f"{scale.file}: tensor {scale.name!r} at offset {scale.offset} is {scale.dtype} "
                                    f"{list(scale.shape)}, which is not the {strategy} scale of {key!r} "
                                    f"{[rows, cols]}{f' (group_size {gs})' if gs else ''}; the checkpoint does not "
                                    "match its config.json")
        scheme = json.dumps({k: g.get(k) for k in ("targets", "weights", "input_activations", "output_activations")},
                            sort_keys=True)
        out[key] = (codes, CtWeight(scale, (1, cols), fmt, scheme, (rows, cols)))
    gone = {n for c, d in out.values() for n in (c.name, d.scale.name)}
    gone |= {named.get(k[: -len("weight")] + "weight_shape", k[: -len("weight")] + "weight_shape") for k in out}
    unused[:] = [n for n in unused if n not in gone]
    left = [n for n in unused if n.endswith((".weight_packed", ".weight_scale"))]
    if left:
        t = tensors[left[0]]
        raise QuantizationError(
            f"{t.file}: tensor {t.name!r} at offset {t.offset} (and {len(left) - 1} more) holds compressed-tensors "
            "codes or scales that no module the config targets takes (e.g. per-expert weights a transformers "
            f"conversion stacks, which tiered does not decode yet). {_CT_ADVICE[0].upper()}{_CT_ADVICE[1:]}")
    return out


_EXPERT = re.compile(r"\.experts\.\d+\.")


def _experts_group(groups: list[tuple[str, dict, str]]) -> tuple[str, dict, str]:
    """The config group that quantizes the MoE experts, chosen as stock's ``get_experts_scheme`` chooses it
    (transformers ``integrations/compressed_tensors.py``): the first whose ``re:`` targets mention ``experts``, else
    the first with a class-name target, else the first."""
    def targets(g: dict) -> list[str]:
        return [g["targets"]] if isinstance(g["targets"], str) else list(g["targets"])

    for grp in groups:
        if any(t.startswith("re:") and "experts" in t for t in targets(grp[1])):
            return grp
    for grp in groups:
        if any(not t.startswith("re:") for t in targets(grp[1])):
            return grp
    return groups[0]


def ct_expert_alias(qc: dict | None, tensors: dict[str, TensorInfo]) -> dict[str, str]:
    """A compressed-tensors checkpoint's packed per-expert codes under the name a transformers conversion matches:
    ``...experts.<j>.<proj>.weight`` -> ``...weight_packed`` (where the checkpoint has no ``.weight`` itself); {}
    for any other checkpoint. Names only: which of them feed a conversion decides :func:`ct_experts`."""
    if qc is None or str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return {}
    return {n[: -len("_packed")]: n for n in tensors
            if _EXPERT.search(n) and n.endswith(".weight_packed") and n[: -len("_packed")] not in tensors}


def ct_experts(qc: dict | None, tensors: dict[str, TensorInfo], where: str,
               feeding: set[str]) -> tuple[dict[str, CtWeight], set[str]]:
    """A compressed-tensors checkpoint's per-expert MoE matrices that feed a transformers conversion (``feeding``:
    the checkpoint names of every conversion's sources), stored ``...experts.<j>.<proj>.weight_packed`` or float8
    ``.weight``, with ``.weight_scale``: stock's ``DecompressExperts`` decodes them at load before the conversion
    stacks them into the model's fused expert tensors (experts a model holds as ``nn.Linear`` modules, e.g. remote
    code's ModuleList, are ordinary quantized Linears: :func:`ct_sources`). Returns ``(decodes, claimed)``:
    ``decodes`` each codes tensor's name to its :class:`CtWeight` (``expert=True``: stock's arithmetic for experts),
    ``claimed`` the scales and ``weight_shape`` tensors they take. Empty for any other checkpoint. Reads each
    ``weight_shape`` (two integers) from its shard.

    Raises:
        QuantizationError: experts stored in a form stock's expert decode does not read (``int-quantized``; float8
            with group scales, which its product does not broadcast), codes or scales that do not fit, a missing
            ``weight_shape``.
    """
    if qc is None or str(qc.get("quant_method", "")).lower() != "compressed-tensors":
        return {}, set()
    scales = sorted(n for n in tensors if _EXPERT.search(n) and n.endswith(".weight_scale") and (
        n[: -len("_scale")] in feeding or n[: -len("_scale")] + "_packed" in feeding))
    if not scales:
        return {}, set()
    gname, g, fmt = _experts_group(ct_groups(qc, where))
    w = g["weights"]
    bits, strategy, typ = int(w.get("num_bits") or 8), str(w.get("strategy") or "tensor"), str(w.get("type") or "int")
    fp8 = typ == "float" and bits == 8
    if not fp8 and fmt != "pack-quantized":
        raise _ct_refuse(where, f"MoE experts stored {fmt!r} (config group {gname!r}): stock transformers' expert "
                                "decode reads pack-quantized or float8 experts only, and fails on these too")
    if fp8 and strategy == "group":
        raise _ct_refuse(where, f"float8 MoE experts with group scales (config group {gname!r}): stock's expert decode "
                                "multiplies codes by scales that do not broadcast, and fails on these too")
    scheme = json.dumps({k: g.get(k) for k in ("targets", "weights", "input_activations", "output_activations")},
                        sort_keys=True)
    gs = int(w.get("group_size") or 0)
    decodes: dict[str, CtWeight] = {}
    claimed: set[str] = set()
    for sname in scales:
        base = sname[: -len("weight_scale")]
        scale = tensors[sname]
        if fp8:
            codes = tensors.get(base + "weight")
            if codes is None or codes.dtype != torch.float8_e4m3fn or len(codes.shape) != 2:
                got = "nothing" if codes is None else f"{codes.dtype} {list(codes.shape)}"
                raise QuantizationError(f"{scale.file}: tensor {sname!r} at offset {scale.offset} scales float8 expert "
                                        f"codes {base + 'weight'!r}, but the checkpoint holds {got} there; the "
                                        "checkpoint does not match its config.json")
            rows, cols = (int(x) for x in codes.shape)
        else:
            codes = tensors.get(base + "weight_packed")
            ws = tensors.get(base + "weight_shape")
            if codes is None or ws is None or tuple(ws.shape) != (2,) or ws.dtype not in (torch.int64, torch.int32):
                raise QuantizationError(f"{scale.file}: tensor {sname!r} at offset {scale.offset} scales packed expert "
                                        f"codes, but {base + 'weight_packed'!r} or its weight_shape (two integers) is "
                                        "missing; the checkpoint is incomplete")
            with open(ws.file, "rb") as f:
                f.seek(ws.offset)
                rows, cols = (int(x) for x in np.frombuffer(f.read(ws.nbytes), dtype="<i8" if ws.dtype == torch.int64
                                                            else "<i4"))
            if codes.dtype != torch.int32 or tuple(codes.shape) != (rows, -(-cols * bits // 32)):
                raise QuantizationError(f"{codes.file}: tensor {codes.name!r} at offset {codes.offset} is {codes.dtype} "
                                        f"{list(codes.shape)}, but {bits}-bit packed codes of a {[rows, cols]} expert "
                                        f"matrix are torch.int32 {[rows, -(-cols * bits // 32)]}; the checkpoint does "
                                        "not match its config.json")
            if strategy == "group" and (gs <= 0 or cols % gs):
                raise _ct_refuse(where, f"config group {gname!r} has group_size {gs}, which does not divide the "
                                        f"{cols} input features of {base + 'weight_packed'!r}")
            claimed.add(ws.name)
        want_sc = {"tensor": None, "channel": (rows, 1), "group": (rows, -(-cols // gs) if gs else -1)}[strategy]
        if not (scale.dtype.is_floating_point and (scale.numel == 1 if want_sc is None
                                                   else tuple(scale.shape) == want_sc)):
            raise QuantizationError(f"{scale.file}: tensor {sname!r} at offset {scale.offset} is {scale.dtype} "
                                    f"{list(scale.shape)}, which is not the {strategy} scale of the {[rows, cols]} "
                                    "expert matrix it scales; the checkpoint does not match its config.json")
        decodes[codes.name] = CtWeight(scale, (1, cols), "float-quantized" if fp8 else fmt, scheme, (rows, cols),
                                       expert=True)
        claimed.add(sname)
    return decodes, claimed


def ct_expert_dtype(dec: CtWeight) -> torch.dtype:
    """The dtype stock's expert decode gives (transformers ``DecompressExperts``): bfloat16 for float8 codes, else
    the package's ``decompress`` output, which is the scale's dtype."""
    return torch.bfloat16 if dec.fmt == "float-quantized" else dec.scale.dtype


@functools.cache
def _ct_scheme(fmt: str, scheme: str) -> tuple[Any, Any]:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    return BaseCompressor.get_value_from_registry(fmt), QuantizationScheme.model_validate(json.loads(scheme))


def decode_ct(codes: torch.Tensor, scale: torch.Tensor, dec: CtWeight, out: torch.Tensor) -> None:
    """Decode rows of a compressed-tensors weight into ``out`` ``(n, cols)`` (the model dtype, any device).

    ``codes``: those rows' codes, ``(n, packed cols)`` int32 or ``(n, cols)`` int8/float8; ``scale``: their scale
    rows ``(n, groups)`` (one scale: any shape of one element), as stored. The scale is first cast to ``out``'s dtype,
    as stock's ``weight_scale`` parameter holds it (the module's dtype), then the package's compressor
    ``decompress`` (``unpack_from_int32`` and ``dequantize``) runs on the band, element by element as on the whole
    tensor: bitwise what ``from_pretrained`` gives."""
    if dec.expert and dec.fmt == "float-quantized":  # stock's DecompressExperts: float32 product, then bfloat16
        out.copy_((codes.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16))
        return
    comp, scheme = _ct_scheme(dec.fmt, dec.scheme)
    n = out.shape[0]
    sd: dict[str, torch.Tensor] = {"weight_scale": scale if dec.expert else scale.to(out.dtype)}
    if dec.fmt == "pack-quantized":
        sd["weight_packed"] = codes
        sd["weight_shape"] = torch.tensor([n, dec.shape[1]])
    else:
        sd["weight"] = codes
    out.copy_(comp.decompress(sd, scheme)["weight"])


def ct_forward(model: Any, coded: dict[str, tuple[TensorInfo, Any]]) -> None:
    """Give each module whose weight decodes from a compressed-tensors scheme with dynamic input activations stock's
    forward: the package's ``set_forward_quantized`` with the module's scheme, status ``decompressed`` (its input is
    quantized and dequantized per call, as stock's model does; the weight is used as decoded). Imports the package
    only when some weight is a compressed-tensors one (a plain checkpoint loads without it)."""
    if not any(isinstance(dec, CtWeight) for _, dec in coded.values()):
        return
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized

    for key, (_, dec) in coded.items():
        if not isinstance(dec, CtWeight):
            continue
        scheme = _ct_scheme(dec.fmt, dec.scheme)[1]
        if not scheme.input_activations:
            continue
        mod = model.get_submodule(key[: -len(".weight")]) if key != "weight" else model
        mod.quantization_scheme = QuantizationScheme.model_validate(json.loads(dec.scheme))
        mod.quantization_status = QuantizationStatus.DECOMPRESSED
        set_forward_quantized(mod)


def block_of(codes: TensorInfo, scale: TensorInfo, config_block: Any) -> tuple[int, int]:
    """The (rows, cols) of codes each scale of ``scale`` covers (module docstring, "Blocks").

    Raises:
        QuantizationError: the codes are not a matrix (or a stack of them), or the scale grid fits neither the
            config's ``weight_block_size`` nor a whole division of the codes' shape.
    """
    if len(codes.shape) < 2:
        raise QuantizationError(f"{codes.file}: tensor {codes.name!r} at offset {codes.offset} has shape "
                                f"{list(codes.shape)} and a scale {scale.name!r}; only matrices are block-scaled")
    rows, cols = codes.shape[-2:]
    lead = codes.numel // max(1, rows * cols)
    if scale.numel == 1:
        return rows, cols  # one scale for the whole tensor (stock: a grid of 1 x 1)
    if len(scale.shape) < 2 or scale.numel // max(1, scale.shape[-2] * scale.shape[-1]) != lead:
        raise QuantizationError(
            f"{scale.file}: scale {scale.name!r} at offset {scale.offset} has shape {list(scale.shape)}, which is not a "
            f"grid of blocks over {codes.name!r} {list(codes.shape)}; the checkpoint is damaged or not block-scaled FP8")
    gr, gc = scale.shape[-2:]
    if config_block and len(config_block) == 2:
        bm, bn = int(config_block[0]), int(config_block[1])
        if bm > 0 and bn > 0 and gr == -(-rows // bm) and gc == -(-cols // bn):
            return bm, bn
    if gr and gc and rows % gr == 0 and cols % gc == 0:
        return rows // gr, cols // gc
    raise QuantizationError(
        f"{scale.file}: scale {scale.name!r} at offset {scale.offset} is a {gr} x {gc} grid over {codes.name!r} "
        f"({rows} x {cols}), which fits neither weight_block_size={config_block!r} nor a whole division of the "
        "shape; the checkpoint does not match its config.json")


def attach_decodes(targets: dict[str, Any], converts: list, unused: list[str], tensors: dict[str, TensorInfo],
                   qc: dict | None, where: str) -> list[str]:
    """Give each copy of ``targets`` (model key -> :class:`~tiered.plan.Target`) whose checkpoint tensor has a
    sibling scale (:data:`SCALE_SUFFIX`) an :class:`Fp8Block` decode, and take the scales out of ``unused``.
    Returns the ``fp8`` method's ``activation_scale`` tensors, which stock reads and drops (taken out of ``unused``
    too: they are not a sign of a config that does not match).

    Raises:
        QuantizationError: a sibling scale without an ``fp8`` quantization_config; codes that are not float8; a
            transformers conversion (``converts``) over codes; a scale grid that fits no block (:func:`block_of`).
    """
    fp8 = qc is not None and str(qc.get("quant_method", "")).lower() == "fp8"
    block = qc.get("weight_block_size") if fp8 else None
    used: set[str] = set()
    sources = {c.src.name for tgt in targets.values() for c in tgt.copies}
    for tgt in targets.values():
        for c in tgt.copies:
            scale = scale_of(c.src.name, tensors, fp8)
            if scale is None:
                continue
            s = c.src
            if scale.name in sources:  # the module holds its scales itself (an FP8Linear): its codes stay codes
                if tgt.dtype != s.dtype:
                    raise QuantizationError(
                        f"{s.file}: tensor {s.name!r} at offset {s.offset} is float8 codes whose scales "
                        f"{scale.name!r} are a parameter of the model, but {tgt.key!r} is {tgt.dtype}: the module "
                        "would compute on undecoded codes; give it a float8 weight or drop the scale parameter")
                continue
            if not fp8:
                raise QuantizationError(
                    f"{s.file}: tensor {s.name!r} at offset {s.offset} has block scales ({scale.name!r}) but "
                    f"{where} has no fp8 quantization_config: it holds FP8 codes, not weights. Use the checkpoint's "
                    "own config.json (with its quantization_config)")
            if s.dtype not in CODE_DTYPES:
                raise QuantizationError(
                    f"{s.file}: tensor {s.name!r} at offset {s.offset} has dtype {s.dtype} and block scales "
                    f"({scale.name!r}); tiered decodes float8 codes ({', '.join(map(str, CODE_DTYPES))}) only")
            c.decode = Fp8Block(scale, block_of(s, scale, block))
            used.add(scale.name)
    for conv, _key in converts:
        for infos in conv.sources.values():
            for s in infos:
                if scale_of(s.name, tensors, fp8) is not None:
                    raise QuantizationError(
                        f"{s.file}: tensor {s.name!r} at offset {s.offset} is FP8 codes feeding a transformers "
                        f"conversion of {conv.targets}, which tiered does not decode yet; dequantize the checkpoint "
                        "once with transformers (FineGrainedFP8Config(dequantize=True), then save_pretrained)")
    dropped = [n for n in unused if n.endswith("activation_scale")] if fp8 else []
    used.update(dropped)
    if used:
        unused[:] = [n for n in unused if n not in used]
    return dropped


def mxfp4_sources(qc: dict | None, unused: list[str], tensors: dict[str, TensorInfo], sd: dict[str, Any],
                  where: str) -> dict[str, tuple[TensorInfo, Mxfp4Block]]:
    """An ``mxfp4`` checkpoint's packed experts: model key -> (its ``_blocks`` tensor, its decode), for each pair
    ``<key>_blocks`` / ``<key>_scales`` of checkpoint tensors no model key takes (stock's ``Mxfp4Dequantize``
    converters) and no plain ``<key>`` tensor provides (stock then loads the plain one); the pairs leave ``unused``.
    {} for any other checkpoint.

    Raises:
        QuantizationError: a ``_blocks`` tensor without its ``_scales``, or shapes that do not fit the parameter.
    """
    if qc is None or str(qc.get("quant_method", "")).lower() != "mxfp4":
        return {}
    out: dict[str, tuple[TensorInfo, Mxfp4Block]] = {}
    for name in [n for n in unused if n.endswith("_blocks")]:
        key = name[: -len("_blocks")]
        if key not in sd or key in tensors:
            continue  # (a plain tensor of that name too: stock loads it and leaves the blocks unused; so here)
        b, s = tensors[name], tensors.get(key + "_scales")
        if s is None:
            raise QuantizationError(f"{b.file}: tensor {name!r} at offset {b.offset} holds MXFP4 codes but the "
                                    f"checkpoint has no {key + '_scales'!r}; the checkpoint is incomplete")
        want = tuple(sd[key].shape)
        ok = (len(b.shape) == 4 and b.shape[-1] == 16 and b.dtype == torch.uint8 and s.dtype == torch.uint8
              and tuple(s.shape) == tuple(b.shape[:-1]) and len(want) == 3
              and want == (b.shape[0], b.shape[2] * 32, b.shape[1]))
        if not ok:
            raise QuantizationError(
                f"{b.file}: tensor {name!r} at offset {b.offset} ({b.dtype} {list(b.shape)}) with {s.name!r} "
                f"({s.dtype} {list(s.shape)}) does not decode to {key!r} {list(want)} (blocks (E, R, G, 16) and scales "
                f"(E, R, G) uint8 give (E, G * 32, R)); {where} does not match the checkpoint")
        out[key] = (b, Mxfp4Block(s))
    if out:
        gone = {n for b, d in out.values() for n in (b.name, d.scale.name)}
        unused[:] = [n for n in unused if n not in gone]
    return out


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``blocks`` ``(1, r, G, 16)`` uint8 and ``scales`` ``(1, r, G)`` uint8 decoded into ``out`` ``(G * 32, r)``
    (any strides, any float dtype): transformers' own ``convert_moe_packed_tensors`` (a bf16 table of the 16 e2m1
    values, ``torch.ldexp`` by the exponent), then cast as ``from_pretrained`` casts it into the parameter. Its
    temporaries: a few copies of the ``r`` rows (bf16 and int32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out.copy_(convert_moe_packed_tensors(blocks, scales)[0])


def scale_of(name: str, tensors: dict[str, TensorInfo], fp8: bool) -> TensorInfo | None:
    """The block scales of checkpoint tensor ``name``: ``name + "_scale_inv"``, or (an ``fp8`` config: stock renames
    ``X.scale`` to ``X.weight_scale_inv``, DeepSeek-V4-Flash's naming) ``X.scale`` for ``X.weight``."""
    s = tensors.get(name + SCALE_SUFFIX)
    if s is None and fp8 and name.endswith(".weight"):
        alt = tensors.get(name[: -len("weight")] + "scale")
        if alt is not None and tensors[name].dtype in CODE_DTYPES:
            s = alt
    return s


def scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as float32, as ``Fp8Dequantize`` converts it (a uint8 is an E8M0 exponent: ``2 ** (byte - 127)``)."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def _blocks(n: int, row0: int, bm: int):
    """(first row, rows, scale row) of each run of ``n`` rows starting at row ``row0`` that one block row covers."""
    r = 0
    while r < n:
        g = (row0 + r) // bm
        k = min(n - r, (g + 1) * bm - (row0 + r))
        yield r, k, g
        r += k


_TABLES: dict[torch.dtype, torch.Tensor] = {}
_INT_VIEW = {2: torch.int16, 4: torch.int32}


def _table(dtype: torch.dtype) -> torch.Tensor:
    """float32 value of each of the 256 codes of ``dtype``, converted by torch as ``codes.to(float32)`` converts."""
    t = _TABLES.get(dtype)
    if t is None:
        t = _TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
    return t


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int,
                out: torch.Tensor) -> None:
    """Decode rows ``[row0, row0 + codes.shape[0])`` of one matrix into ``out``.

    Args:
        codes: ``(n, cols)`` float8 codes of those rows (CPU or CUDA).
        scale: float32 ``(grid_rows, grid_cols)`` scales (:func:`scale_f32`), same device: row ``r`` of ``codes``
            uses scale row ``(row0 + r) // block[0]``.
        block: (rows, cols) per scale; ``row0``: any row.
        out: ``(n, cols)`` of the model dtype; written, bitwise ``(codes.float() * scale_of_block).to(out.dtype)``.

    On the CPU, per block: the 256 values ``(code.to(float32) * scale).to(out.dtype)`` are computed with those
    same torch ops (a table), and each code is replaced by its entry (a numpy gather): every element is the same
    product rounded the same way, at 2-3x the speed of torch's float8 conversion (0.5 against 0.18 GB/s of codes per
    thread on the 2-core machine, 2026-12-02). Elsewhere (CUDA), the ops themselves run on the rows, with one float32
    temporary of the rows.
    """
    if codes.device.type == "cpu" and out.device.type == "cpu" and out.dtype.itemsize in _INT_VIEW \
            and codes.is_contiguous():
        _decode_rows_table(codes, scale, block, row0, out)
        return
    n, cols = codes.shape
    bm, bn = block
    q = codes.to(torch.float32)
    if scale.numel() == 1:  # one scale for the whole tensor
        q.mul_(scale.reshape(()))
        out.copy_(q)
        return
    gc = -(-cols // bn)
    gcf = cols // bn  # whole column blocks
    full = gcf * bn
    # each row's scale row, gathered on the device (one kernel): the products are those of stock's reshape into blocks
    s = scale[:, :gc].index_select(0, torch.arange(row0, row0 + n, device=scale.device).floor_divide_(bm))
    if gcf:
        q[:, :full].unflatten(1, (gcf, bn)).mul_(s[:, :gcf, None])
    if full < cols:
        q[:, full:].mul_(s[:, gcf:gcf + 1])
    out.copy_(q)


#: float32 bytes of one band decoded on a device after the H2D copy (:func:`decode_stored`): its temporaries
DEVICE_BAND = 64 << 20


def _decode_exp3(unit: Any, stored: torch.Tensor, base: torch.Tensor) -> int:
    """The exp3 tensors of a stored unit (:func:`tiered.plan.device_coded`): one Triton launch over all their chunks
    (:func:`tiered.expcode.decode_cuda`), on the current stream; returns the bytes written. The launch's chunk table
    is built once per unit and device (a few bytes per chunk) and kept on the unit."""
    from . import expcode

    cache = unit.__dict__.setdefault("_exp3_batch", {})
    key = str(stored.device)
    batch = cache.get(key)
    if batch is None:
        rows, n_out = [], 0
        for t in unit.targets:
            for c in t.copies:
                if c.at is None or c.decode is not None:
                    continue
                co = c.src.coded
                for k in range(co.count()):
                    start, length = co.chunk_span(k)
                    lo, hi = co.elements(k)
                    rows.append((c.at - unit.coded_at + start, t.offset // 2 + lo, hi - lo, length))
                n_out += t.nbytes
        batch = cache[key] = (expcode.DeviceBatch(rows, stored.device), n_out) if rows else (None, 0)
    if batch[0] is None:
        return 0
    expcode.decode_cuda(stored, batch[0], base.view(torch.int16))
    return batch[1]


def decode_stored(unit: Any, stored: torch.Tensor, base: torch.Tensor) -> int:
    """Decode a stored unit's codes (:func:`tiered.plan.lay_out`) into its device buffer; returns the bytes written.

    Args:
        unit: a :class:`~tiered.plan.Unit` with ``coded_at`` set.
        stored: ``(unit.nbytes - unit.coded_at,)`` uint8, the slot's coded region on the device (after the H2D copy).
        base: ``(unit.dev_bytes,)`` uint8, the unit's device buffer; the decoded targets are written at their offsets.

    Runs on the current stream (the device stage's copy stream), in bands of rows of at most :data:`DEVICE_BAND`
    float32 bytes; the arithmetic is :func:`decode_rows`' (FP8) and :func:`decode_mxfp4`'s (MXFP4), so the result is
    bitwise what the reader's decode into the slot gives, and stock's dequantize.
    """
    p0 = unit.coded_at
    done = _decode_exp3(unit, stored, base)
    for t in unit.targets:
        whole = None
        for c in t.copies:
            if c.at is None or c.decode is None:  # plain, or exp3 (done above)
                continue
            if whole is None:
                whole = base[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)
            dest = whole if c.place is None else c.place(whole)
            src, sc = c.src, c.decode.scale
            codes = stored[c.at - p0 : c.at - p0 + src.nbytes].view(src.dtype).view(src.shape)
            scales = stored[c.scale_at - p0 : c.scale_at - p0 + sc.nbytes].view(sc.dtype).view(sc.shape)
            if isinstance(c.decode, CtWeight):  # compressed-tensors: bands of rows, each with its scale rows
                rows = src.shape[0]
                band = max(1, DEVICE_BAND // max(1, dest.shape[-1] * 4))
                one = sc.numel == 1
                for r in range(0, rows, band):
                    r1 = min(rows, r + band)
                    decode_ct(codes[r:r1], scales if one else scales[r:r1], c.decode, dest[r:r1])
            elif isinstance(c.decode, Mxfp4Block):
                E, R, G, _ = src.shape
                band = max(1, DEVICE_BAND // (G * 32 * 4 * 4))
                for e in range(E):
                    for r in range(0, R, band):
                        r1 = min(R, r + band)
                        decode_mxfp4(codes[e : e + 1, r:r1], scales[e : e + 1, r:r1], dest[e][:, r:r1])
            else:
                try:
                    dv, temp = dest.view(src.shape), None
                except RuntimeError:  # strides that cannot take the codes' shape: through one temporary
                    dv = temp = torch.empty(src.shape, dtype=dest.dtype, device=dest.device)
                rows, cols = src.shape[-2:] if len(src.shape) >= 2 else (1, src.numel)
                mats = codes.reshape(-1, rows, cols)
                outs = dv.view(-1, rows, cols) if dv.is_contiguous() else None
                grid = scale_f32(scales)
                one = grid.numel() == 1
                grids = grid if one else grid.reshape(-1, *grid.shape[-2:])
                bm = c.decode.block[0]
                band = max(1, DEVICE_BAND // max(1, cols * 4))
                band = max(bm, band // bm * bm) if band >= bm else band
                lead = tuple(src.shape[:-2])
                for e in range(mats.shape[0]):
                    if outs is not None:
                        o = outs[e]
                    else:
                        o = dv[tuple(int(i) for i in np.unravel_index(e, lead))] if lead else dv
                    g = grids if one else grids[e]
                    for r in range(0, rows, band):
                        r1 = min(rows, r + band)
                        decode_rows(mats[e, r:r1], g, c.decode.block, r, o[r:r1])
                if temp is not None:
                    dest.copy_(temp.view(dest.shape))
            done += dest.numel() * dest.element_size()
    return done


def _decode_rows_table(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int,
                       out: torch.Tensor) -> None:
    """:func:`decode_rows` on the CPU by a table per block (its docstring). ``out`` may be a strided row slice."""
    n, cols = codes.shape
    bm, bn = block
    table = _table(codes.dtype)
    u = codes.view(torch.uint8).numpy()
    o = out.view(_INT_VIEW[out.dtype.itemsize]).numpy()
    if scale.numel() == 1:
        lut = (table * scale.reshape(())).to(out.dtype).view(_INT_VIEW[out.dtype.itemsize]).numpy()
        o[...] = lut[u]
        return
    gc = -(-cols // bn)
    coloff = (np.arange(cols, dtype=np.intp) // bn) * 256  # column -> its block's table, in the tables laid flat
    idx = np.empty((min(bm, n), cols), dtype=np.intp)
    for r, k, g in _blocks(n, row0, bm):
        s = scale[g, :gc]
        luts = (table[None, :] * s[:, None]).to(out.dtype).view(_INT_VIEW[out.dtype.itemsize]).numpy()  # (gc, 256)
        np.add(u[r : r + k], coloff, out=idx[:k])
        if o[r : r + k].flags.c_contiguous:
            np.take(luts.reshape(-1), idx[:k], out=o[r : r + k])
        else:
            o[r : r + k] = luts.reshape(-1)[idx[:k]]
