"""A ``transformers`` conversion that splits one checkpoint tensor into several parameters along its first dimension
(``WeightConverter(["attn.Wqkv"] -> q_proj, k_proj, v_proj, Chunk(dim=0))``: NomicBert, Jina-Embeddings-v3), read as
what it is: each parameter is a contiguous run of the source's rows, so it is a plain source of its own — a byte range
of the file (:func:`chunk_sources`), copied or mapped (zero copy) like any tensor, bit for bit ``torch.chunk``'s.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .tensor_info import TensorInfo

__all__ = ["chunk_sources"]


def chunk_sources(converter: Any, key: str, info: TensorInfo, sd: dict[str, Any]) -> dict[str, TensorInfo] | None:
    """Model key -> the rows of ``info`` it holds, when ``converter`` (``transformers.core_model_loading
    .WeightConverter``) is one source pattern and one ``Chunk(dim=0)`` into its target patterns, ``key`` (the renamed
    source) names one of them, every sibling key is in ``sd`` and the rows divide evenly (``torch.chunk``'s equal
    chunks); else None (the conversion runs as transformers runs it)."""
    ops = list(getattr(converter, "operations", None) or [])
    if len(ops) != 1 or type(ops[0]).__name__ != "Chunk" or getattr(ops[0], "dim", None) != 0 \
            or getattr(ops[0], "num_shards_attribute", None) is not None:
        return None
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    mine = [t for t in targets if t in key]
    if len(sources) != 1 or len(mine) != 1 or not info.shape:
        return None
    keys = [key.replace(mine[0], t) for t in targets]
    n, rows = len(keys), info.shape[0]
    if any(k not in sd for k in keys) or rows % n:
        return None
    per = rows // n
    row_el = math.prod(info.shape[1:])
    if getattr(info, "coded", None) is not None:  # losslessly coded (tiered.lossless): the chunks covering the rows
        from .lossless import window

        return {k: replace(window(info, i * per * row_el, (i + 1) * per * row_el, (per, *info.shape[1:])),
                           name=f"{info.name}[{i * per}:{(i + 1) * per}]") for i, k in enumerate(keys)}
    row_bytes = row_el * info.dtype.itemsize
    return {k: replace(info, name=f"{info.name}[{i * per}:{(i + 1) * per}]", shape=(per, *info.shape[1:]),
                       offset=info.offset + i * per * row_bytes, nbytes=per * row_bytes) for i, k in enumerate(keys)}
