"""GGUF in: a converter source that dequantizes a llama.cpp GGUF file tensor by tensor.

``tiered reshard MODEL.gguf DST [--dtype bf16|fp16|fp32]`` reads one GGUF file with the ``gguf``
package (``gguf.GGUFReader`` maps the file; nothing is read until a tensor is asked for) and maps it
to a Hugging Face model with ``transformers``' own GGUF support, so that the result is what
``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=...)`` builds:

* the config: ``AutoConfig.from_pretrained(dir, gguf_file=...)`` (architecture -> ``model_type``,
  GGUF keys -> config keys), with ``architectures`` set to the causal-LM class and ``dtype`` to
  float32 (what dequantization yields; ``--dtype`` then rewrites it as for any checkpoint);
* ``generation_config.json``: ``GenerationConfig.from_model_config(config)``, as ``from_pretrained``
  derives it when the GGUF holds none;
* the tokenizer files: ``AutoTokenizer.from_pretrained(dir, gguf_file=...).save_pretrained(...)``
  (``tokenizer.json``, ``tokenizer_config.json``, the chat template);
* tensor names: ``transformers.modeling_gguf_pytorch_utils.get_gguf_hf_weights_map`` on the model
  built on ``meta`` from that config; per-architecture processing (the reverse of llama.cpp's q/k
  row permutation for Llama-family attention) with the same ``TENSOR_PROCESSORS`` class;
* tensor values: ``gguf.dequantize`` (float32, numpy), exactly as ``load_gguf_checkpoint`` does;
  the converter casts float32 -> ``--dtype`` with ``Tensor.copy_`` (round to nearest even, the same
  as the ``tensor.to(dtype)`` transformers applies). So logits of the output equal transformers'
  GGUF loading at the same dtype, bit for bit (``tests/test_gguf.py``).

Memory: one tensor at a time, dequantized to float32 (plus ``gguf``'s temporaries for that tensor);
the file's mapped pages are dropped after each tensor (``MADV_DONTNEED``), so RSS never grows with
the file. The largest tensor of a Llama-3-8B (the 128256 x 4096 embedding) is 2.1 GB in float32.

Architectures: those whose GGUF tensors map one to one onto Hugging Face tensors — the Llama family
(``llama``: Llama, SmolLM, TinyLlama, Mistral; ``qwen2``; ``qwen3``). A ``llama`` GGUF whose
``general.name`` is exactly "mistral" becomes ``MistralForCausalLM`` (transformers' rule); transformers
5.17 itself then fails (it looks up a "mistral" tensor-name table that gguf-py does not have), while
tiered names the tensors by the file's own architecture, so it converts. Others raise
:class:`~tiered.reshard.UnsupportedCheckpointError` naming the architecture. Split GGUF files
(``-00001-of-0000N.gguf``) are refused: ``transformers`` cannot load them either.
"""

from __future__ import annotations

import json
import mmap
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...format import TensorInfo
from ...hostmem import PAGE_SIZE, page_up
from ..errors import UnsupportedCheckpointError
from .base import Drop, Source

__all__ = ["GGUFSource", "SUPPORTED", "open_gguf", "open_gguf_files"]

# GGUF ``general.architecture`` -> transformers ``model_type``: the tensor names map one to one (tested).
# (transformers' load_gguf_checkpoint makes a "llama" file MistralForCausalLM when its general.name is
# "mistral"; the config here comes from that same code, so the choice is the same.)
SUPPORTED = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _unsupported(msg: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(msg)


class GGUFSource(Source):
    """A converter source over one GGUF file (see the module docstring).

    Attributes follow the converter's source interface: ``root`` (the file's directory), ``kind``
    (``"gguf"``), ``files`` (``[path]``), ``infos`` (Hugging Face name -> :class:`TensorInfo`, dtype
    float32, shape as in the HF model, ``offset`` = the tensor's absolute offset in the GGUF file,
    ``nbytes`` = its float32 size), ``keep_dtype``, ``notes``, ``generated_files`` (file name ->
    bytes: ``config.json``, ``generation_config.json``, tokenizer files) and ``config`` (the
    ``transformers`` config object the plan is built from).
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path.parent, "gguf", [path], {})
        self.path = path
        self.config: Any = None
        self.architecture = ""
        self.quant_types: dict[str, int] = {}
        self._tensors: dict[str, Any] = {}  # HF name -> gguf ReaderTensor
        self._gguf_names: dict[str, str] = {}  # HF name -> GGUF name (processing is by GGUF name)
        self._processor: Any = None
        self._reader: Any = None

    # -------------------------------------------------------------------------------- the interface

    def byte_view(self, name: str) -> tuple[torch.Tensor, Drop]:
        """(the dequantized, processed float32 tensor ``name`` as a flat uint8 tensor, a no-op drop).

        Memory: this tensor in float32 (the caller holds it until it is written). The GGUF file's
        pages read for it are dropped before returning.

        Raises:
            UnsupportedCheckpointError: ``gguf`` cannot dequantize the tensor's type (names the tensor,
                its GGUF type and offset).
        """
        from gguf import dequantize

        t = self._tensors[name]
        info = self.infos[name]
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise _unsupported(
                f"{self.path}: tensor {t.name!r} ({name}) at offset {info.offset} has GGUF type "
                f"{t.tensor_type.name}, which the gguf package cannot dequantize ({e}); upgrade gguf or "
                "convert from the original checkpoint") from None
        w = self._processor.process(weights=w, name=t.name, tensor_key_mapping={}, parsed_parameters={}).weights
        arr = np.array(w, dtype=np.float32, order="C", copy=True)  # F32 tensors dequantize to a view of the file
        self._drop(t)
        flat = torch.from_numpy(arr.reshape(-1)).view(torch.uint8) if arr.size else torch.empty(0, dtype=torch.uint8)
        if tuple(arr.shape) != info.shape or flat.numel() != info.nbytes:  # pragma: no cover - a gguf/transformers change
            raise _unsupported(f"{self.path}: tensor {t.name!r} dequantized to shape {tuple(arr.shape)}, "
                               f"expected {info.shape}")
        return flat, lambda lo, hi: None

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None  # the last reference to gguf's np.memmap unmaps the file

    # -------------------------------------------------------------------------------- internals

    def _drop(self, t: Any) -> None:
        """Drop the pages of tensor ``t``'s bytes from this process (the mapping is read-only, shared)."""
        mm = getattr(self._reader.data, "_mmap", None)
        if not isinstance(mm, mmap.mmap) or t.n_bytes == 0:
            return
        lo = t.data_offset // PAGE_SIZE * PAGE_SIZE
        hi = min(page_up(t.data_offset + t.n_bytes), len(mm))
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError, AttributeError):  # an optimisation only
                pass


def _field(reader: Any, key: str) -> list[Any]:
    from transformers.modeling_gguf_pytorch_utils import read_field

    return read_field(reader, key)


def _top_level_map(state: dict[str, Any], arch: str, n_layers: int, processor: Any) -> dict[str, str]:
    """GGUF name -> HF name for every key of ``state`` that gguf's name table maps (as transformers does)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, n_layers)
    out: dict[str, str] = {}
    for hf in state:
        name = processor.preprocess_name(hf)
        base, suffix = name, ""
        if name.endswith((".weight", ".bias")):
            base, suffix = name.rsplit(".", 1)
            suffix = "." + suffix
        g = table.get_name(base)
        if g is not None:
            out[g + suffix] = hf
    return out


def _open_reader(path: Path, src: GGUFSource) -> tuple[Any, str, str]:
    """``(gguf.GGUFReader of path, general.architecture, general.name)``, the reader and architecture set on ``src``;
    refuses a split GGUF and an architecture not in :data:`SUPPORTED`."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError / struct.error / OSError on a bad file
        raise _unsupported(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None
    src._reader = reader
    arch = (_field(reader, "general.architecture") or [""])[0]
    src.architecture = arch
    split = _field(reader, "split.count")
    if split and int(split[0]) > 1:
        raise _unsupported(f"{path}: part of a split GGUF ({split[0]} files); merge it first with llama.cpp's "
                           "`llama-gguf-split --merge` (transformers cannot load split GGUF files either)")
    name = (_field(reader, "general.name") or [""])[0]
    if arch not in SUPPORTED:
        raise _unsupported(f"{path}: GGUF architecture {arch!r} is not supported by tiered reshard yet; supported: "
                           f"{', '.join(sorted(SUPPORTED))} (the Llama family, whose GGUF tensors map one to one "
                           "onto transformers'); convert the original Hugging Face checkpoint instead")
    return reader, arch, name


def _build_config(path: Path) -> tuple[Any, dict[str, Any], Any, str]:
    """``(config, the parsed GGUF config dict, the causal-LM class, its name)`` as ``AutoConfig.from_pretrained(dir,
    gguf_file=...)`` builds them, with ``architectures`` and ``dtype`` (float32) set."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:  # what AutoConfig.from_pretrained(dir, gguf_file=...) does (AutoTokenizer parses the metadata again)
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        config = transformers.CONFIG_MAPPING[parsed["model_type"]].from_dict(dict(parsed))
    except Exception as e:
        raise _unsupported(f"{path}: transformers cannot build a config from its metadata ({type(e).__name__}: {e})"
                           ) from None
    cls_name = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, cls_name or "", None)
    if cls is None:  # pragma: no cover - every SUPPORTED type has one
        raise _unsupported(f"{path}: no causal-LM class for model_type {config.model_type!r}")
    config.architectures = [cls_name]
    config.dtype = torch.float32
    return config, parsed, cls, cls_name


def _map_tensors(path: Path, src: GGUFSource, reader: Any, model: Any, arch: str, cls_name: str) -> list[str]:
    """Fill ``src``'s infos, tensors, GGUF names and quant-type counts from the file's tensors that ``model`` (built
    on ``meta``) has; returns the GGUF names of the others."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    # GGUF names follow the file's own architecture (a Mistral GGUF says "llama"; gguf-py has no "mistral"
    # name table, so transformers itself fails on one; the tensors are named as Llama's). What
    # get_gguf_hf_weights_map does at the top level, once: its recursion into every submodule builds
    # gguf's name table again for each (~10 s here); it is used only if a name is left unmapped.
    state = model.state_dict()
    key_map = _top_level_map(state, arch, src.config.num_hidden_layers, src._processor)
    if len(key_map) < len({k for k in state if not k.endswith("rotary_emb.inv_freq")}):
        key_map = {**get_gguf_hf_weights_map(model, src._processor, model_type=arch), **key_map}

    unused = []
    for t in reader.tensors:
        hf = key_map.get(t.name)
        if hf is None or hf not in state:
            unused.append(t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = tuple(state[hf].shape)
        if shape != want:
            raise _unsupported(f"{path}: tensor {t.name!r} ({hf}) at offset {t.data_offset} has shape {shape}, "
                               f"but {cls_name} from this file's metadata wants {want}; the file is inconsistent")
        numel = int(np.prod(shape)) if shape else 1
        src.infos[hf] = TensorInfo(hf, torch.float32, shape, path, int(t.data_offset), numel * 4)
        src._tensors[hf] = t
        src._gguf_names[hf] = t.name
        qt = t.tensor_type.name
        src.quant_types[qt] = src.quant_types.get(qt, 0) + 1
    return unused


def _write_tokenizer(path: Path, src: GGUFSource) -> None:
    """The tokenizer files ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` saves, into ``src.generated_files``
    (a note instead when transformers cannot read one)."""
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(src.root, gguf_file=path.name)
    except Exception as e:  # a model without a usable tokenizer is still a model
        src.notes.append(f"no tokenizer written: transformers could not read one from the GGUF ({type(e).__name__}: {e})")
        return
    with tempfile.TemporaryDirectory(prefix="tiered-gguf-tok-") as d:
        tok.save_pretrained(d)
        for p in sorted(Path(d).iterdir()):
            if p.is_file():
                src.generated_files[p.name] = p.read_bytes()
    tc = json.loads(src.generated_files.get("tokenizer_config.json", b"{}"))
    tj = json.loads(src.generated_files.get("tokenizer.json", b"{}"))
    if tc.get("clean_up_tokenization_spaces") and (tj.get("model") or {}).get("type") == "BPE":
        # transformers ignores it for BPE tokenizers, with a warning on every decode: say False instead
        tc["clean_up_tokenization_spaces"] = False
        src.generated_files["tokenizer_config.json"] = (json.dumps(tc, indent=2, ensure_ascii=False) + "\n").encode()


def open_gguf(path: Path, notes_sink: list[str] | None = None) -> GGUFSource:
    """Validate ``path`` (header, architecture, every tensor's name and type) and build its source.

    Reads the GGUF header and metadata and writes the config, generation config and tokenizer
    files into memory; reads no tensor data.

    Raises:
        ImportError: the ``gguf`` package is missing (``pip install gguf``).
        UnsupportedCheckpointError: not a GGUF file, a split GGUF, an architecture ``transformers``
            cannot map one to one, or tensors that do not fit the model the config describes.
    """
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("reading GGUF needs the gguf package: pip install gguf") from None
    import transformers
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from ...meta import build_meta_model

    src = GGUFSource(path)
    reader, arch, name = _open_reader(path, src)
    config, parsed, cls, cls_name = _build_config(path)
    src.config = config

    processor_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    src._processor = processor_cls(config=parsed)
    model = build_meta_model(cls, config, torch.float32)
    unused = _map_tensors(path, src, reader, model, arch, cls_name)
    from ...errors import TieredError
    from ...plan import build_plan

    try:  # every parameter the model needs must come from the file (stock transformers would leave it random)
        build_plan(model, src.checkpoint())
    except TieredError as e:
        raise _unsupported(f"{path}: the GGUF does not hold every tensor {cls_name} needs: {e}; the file is "
                           "incomplete or not a standard llama.cpp conversion") from None
    if unused:
        src.notes.append(f"{len(unused)} GGUF tensors not used by {cls_name} (transformers skips them too): "
                         f"{', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}")
    src.notes.append(f"GGUF {arch} ({name or 'unnamed'}): {len(src.infos)} tensors dequantized to float32 from "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(src.quant_types.items())))

    src.generated_files["config.json"] = (config.to_json_string(use_diff=True)).encode()
    gen = transformers.GenerationConfig.from_model_config(config)
    src.generated_files["generation_config.json"] = gen.to_json_string(use_diff=True).encode()
    _write_tokenizer(path, src)

    if notes_sink is not None:
        notes_sink.extend(src.notes)
    json.loads(src.generated_files["config.json"])  # sanity: valid JSON
    return src


def open_gguf_files(root: Path, files: list[Path], index: Path | None) -> GGUFSource:
    """The :data:`~tiered.reshard.sources.Opener` for ``.gguf``: exactly one GGUF file (a directory with
    several is ambiguous: name the file)."""
    if len(files) != 1:
        raise _unsupported(f"{root}: {len(files)} GGUF files ({', '.join(p.name for p in files[:4])}); pass the one "
                           "to convert as SRC (split GGUF files must be merged first: llama-gguf-split --merge)")
    return open_gguf(files[0])
