"""A lossless bf16 code a GPU decodes at memory speed (issue 25, item 2): ``exp3``.

Why another code beside ``bytegroup-zstd1`` (:mod:`tiered.lossless`): zstd's entropy coder is sequential within a
frame, so a GPU decodes it only with a library (nvCOMP), measured at 0.66x the H200's pinned H2D rate
(`benchmarks/NOTES.md`, "Issue 25: compressed shards wired in"), too slow to decode after the copy. Nearly all the
information a bf16 weight does not carry sits in its 8 exponent bits (about 2.6 bits of entropy, DFloat11 and ZipNN
measure the same); ``exp3`` removes most of it with a fixed-width code, so every element decodes independently but
for one prefix sum per block.

One chunk of ``n`` bf16 elements (bit 15 sign, bits 14..7 exponent, bits 6..0 mantissa) is stored as, in order:

======================  =====================  ==============================================================
section                 bytes                  content
======================  =====================  ==============================================================
table                   8                      the chunk's 7 most frequent exponents (codes 0..6); byte 7 is 0
block escape starts     4 * ceil(n / BLOCK)    little-endian uint32: escapes in the chunk before block ``b``
code bit planes         3 * ceil(n / 8)        plane ``p``, byte ``j``, bit ``k``: bit ``p`` of element ``8j+k``'s code
sign and mantissa       n                      ``sign << 7 | mantissa`` per element
escapes                 (elements of code 7)   the exponent byte of every element whose code is 7, in order
======================  =====================  ==============================================================

A chunk this code would not make smaller (random bits: every exponent escapes) is stored *raw*, its ``2n`` plain bytes;
a chunk's stored length is ``2n`` exactly when it is raw (a coded body of that length is stored raw instead).

Code ``k < 7`` means exponent ``table[k]``; code 7 (an *escape*) means the next exponent of the escapes section. So
``11/16 = 0.6875`` of the plain bytes plus one byte per escape plus 4 bytes per :data:`BLOCK` elements: 0.69-0.70 on
bf16 weights (measured in `benchmarks/NOTES.md`). Exact by construction for every bit pattern (NaN payloads, Inf,
subnormals, -0): the sign and mantissa bits are kept verbatim and every exponent is either in the table or escaped.

Decoders: :func:`decode_np` (numpy, any thread; the reference), :func:`decode_cpu` (the CPU path: a C decoder built
on first use, :mod:`tiered.native`, numpy where none can be built) and :func:`decode_cuda` (a Triton
kernel, one program per block of :data:`BLOCK` elements: three bit-plane loads, a table gather, an exclusive prefix
sum of the block's escapes, one 16-bit store per element). Both give the same bits; the tests compare them with the
input on random, special-value and escape-heavy data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import CodecError

__all__ = ["CODEC", "BLOCK", "encode_chunk", "decode_np", "decode_cpu", "chunk_layout", "DeviceBatch", "decode_cuda"]

#: the codec's name in a lossless table (:class:`tiered.lossless.Coded`)
CODEC = "exp3-bf16"
#: elements per block: the unit of the GPU decoder's prefix sum and of the block escape starts
BLOCK = 4096
#: the escape code
ESC = 7


def chunk_layout(n: int) -> tuple[int, int, int, int]:
    """Byte offsets of one chunk of ``n`` elements' sections after the table: ``(blocks, codes, sm, esc)`` (the table
    is at 0). The chunk's length is ``esc + escapes``."""
    nb = -(-n // BLOCK)
    blocks = 8
    codes = blocks + 4 * nb
    sm = codes + 3 * (-(-n // 8))
    return blocks, codes, sm, sm + n


def encode_chunk(u: np.ndarray) -> bytes:
    """Code one chunk: ``u`` is 1-D ``uint16`` (the bf16 bit patterns), any length >= 0. Runs on the caller's thread;
    temporaries of a few bytes per element."""
    u = np.ascontiguousarray(u, dtype=np.uint16).reshape(-1)
    n = u.size
    e = ((u >> 7) & 0xFF).astype(np.uint8)
    sm = (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
    counts = np.bincount(e, minlength=256)
    order = np.argsort(-counts, kind="stable")[:ESC]
    order = order[counts[order] > 0]
    table = np.zeros(8, dtype=np.uint8)
    table[: order.size] = order
    lut = np.full(256, ESC, dtype=np.uint8)
    lut[order] = np.arange(order.size, dtype=np.uint8)
    code = lut[e]
    esc_mask = code == ESC
    esc = e[esc_mask]
    nb = -(-n // BLOCK)
    per_block = np.bincount(np.flatnonzero(esc_mask) // BLOCK, minlength=nb)
    if chunk_layout(n)[3] + esc.size >= 2 * n:  # no smaller: raw (its length, 2n, says so)
        return u.tobytes()
    starts = (np.cumsum(per_block) - per_block).astype("<u4")
    planes = [np.packbits((code >> p) & 1, bitorder="little") for p in range(3)]
    return b"".join([table.tobytes(), starts.tobytes(), *(pl.tobytes() for pl in planes), sm.tobytes(),
                     esc.tobytes()])


def check_starts(body: np.ndarray, n: int, *, where: str = "") -> None:
    """Check a coded chunk's block escape starts: the first is 0, none decreases, the last lies within the escapes
    section (so that the GPU decoder's escape reads stay inside the chunk). Cheap (4 bytes per :data:`BLOCK`
    elements); the reader runs it on every chunk it carries to the GPU, after the CRC-32. Raises CodecError."""
    if body.size == 2 * n or not n:
        return
    blocks, codes, _, esco = chunk_layout(n)
    starts = body[blocks:codes].view("<u4").astype(np.int64)
    n_esc = body.size - esco
    if starts[0] != 0 or (starts.size > 1 and bool((np.diff(starts) < 0).any())) or starts[-1] > n_esc:
        raise CodecError(f"{where}: exp3 chunk of {n} elements: its block escape starts do not fit its {n_esc} "
                         "escapes (a malformed chunk); re-run `tiered reshard --compress` on the source checkpoint")


def decode_np(body: memoryview | bytes | np.ndarray, n: int, out: np.ndarray, *, where: str = "") -> None:
    """Decode one chunk of ``n`` elements from ``body`` (exactly its bytes) into ``out`` (``n`` ``uint16``, or ``2n``
    ``uint8``). Runs on the caller's thread (a reader thread). Raises CodecError: a body whose length does not match
    its escape count (truncated or corrupted; the caller checks the chunk's CRC-32 first)."""
    src = _body_view(body)
    o = _out_view(out, n, "decode_np")
    if src.size == 2 * n:  # raw
        o[:] = src.view(np.uint16)
        return
    blocks, codes, smo, esco = chunk_layout(n)
    if src.size < esco or not n:
        raise CodecError(f"{where}: exp3 chunk of {n} elements has {src.size} bytes, fewer than its fixed "
                         f"{esco} (truncated)" if n else f"{where}: exp3 chunk of 0 elements has {src.size} bytes, not 0")
    nb8 = -(-n // 8)
    # the codes, 8 at a time: each plane's byte expanded to 8 one-bit bytes (one uint64), shifted to its bit, or-ed
    c64 = _EXPAND[src[codes : codes + nb8]]
    c64 |= _EXPAND[src[codes + nb8 : codes + 2 * nb8]] << np.uint64(1)
    c64 |= _EXPAND[src[codes + 2 * nb8 : codes + 3 * nb8]] << np.uint64(2)
    code = c64.view(np.uint8)[:n]
    esc = np.flatnonzero(code == ESC)
    if src.size != esco + esc.size:
        raise CodecError(f"{where}: exp3 chunk of {n} elements has {src.size - esco} escape bytes, its codes say "
                         f"{esc.size} (corrupted or truncated)")
    starts = src[blocks:codes].view("<u4")
    per_block = np.bincount(esc // BLOCK, minlength=starts.size)
    if not np.array_equal(starts, np.cumsum(per_block) - per_block):  # what the GPU decoder would index by
        raise CodecError(f"{where}: exp3 chunk of {n} elements: its block escape starts disagree with its codes (a "
                         "malformed chunk); re-run `tiered reshard --compress` on the source checkpoint")
    sm = src[smo : smo + n]
    exp7 = src[:8].astype(np.uint16) << 7  # code -> exponent bits in place (code 7's entry is overwritten below)
    np.bitwise_or(exp7.take(code), _SIGN_MANT.take(sm), out=o)
    o[esc] = _SIGN_MANT[sm[esc]] | (src[esco:].astype(np.uint16) << 7)


def decode_cpu(body: memoryview | bytes | np.ndarray, n: int, out: np.ndarray, *, where: str = "",
               simd: bool = True) -> None:
    """:func:`decode_np`'s contract and bits, with the C decoder (:mod:`tiered.native`) where it could be built
    (numpy otherwise). Runs on the caller's thread with the GIL released; reads only ``body``, writes only ``out``.
    ``simd=False`` forces the C decoder's scalar path (tests compare both). Raises CodecError as :func:`decode_np`."""
    from . import native

    lib = native.exp3()
    src = _body_view(body)
    o = _out_view(out, n, "decode_cpu")
    if lib is None or src.size == 2 * n or not n:
        decode_np(src, n, o, where=where)
        return
    esco = chunk_layout(n)[3]
    if src.size < esco:
        raise CodecError(f"{where}: exp3 chunk of {n} elements has {src.size} bytes, fewer than its fixed "
                         f"{esco} (truncated)")
    dst = o if o.ctypes.data % 2 == 0 else np.empty(n, np.uint16)  # the C code stores whole, aligned uint16s
    k = lib.tiered_exp3_decode(src.ctypes.data, src.size, n, dst.ctypes.data, 1 if simd else 0)
    if dst is not o:
        o[:] = dst
    if k == -2:
        raise CodecError(f"{where}: exp3 chunk of {n} elements: its block escape starts disagree with its codes (a "
                         "malformed chunk); re-run `tiered reshard --compress` on the source checkpoint")
    if k < 0 or k != src.size - esco:
        raise CodecError(f"{where}: exp3 chunk of {n} elements has {src.size - esco} escape bytes, its codes say "
                         f"{'more' if k < 0 else k} (corrupted or truncated)")


def _body_view(body: memoryview | bytes | np.ndarray) -> np.ndarray:
    """A chunk's coded bytes as one contiguous 1-D ``uint8`` array (a copy only for a strided view)."""
    src = np.frombuffer(body, dtype=np.uint8) if not isinstance(body, np.ndarray) else body.reshape(-1).view(np.uint8)
    return np.ascontiguousarray(src)


def _out_view(out: np.ndarray, n: int, who: str) -> np.ndarray:
    """``out`` as ``n`` ``uint16`` sharing its memory. Raises ValueError: read-only, not C-contiguous (``reshape`` would
    copy it, and the decode would go to the copy) or of another size."""
    if not out.flags.writeable:
        raise ValueError(f"{who}: out is read-only")
    if not out.flags.c_contiguous:
        raise ValueError(f"{who}: out must be C-contiguous")
    o = out.reshape(-1).view(np.uint16)
    if o.size != n:
        raise ValueError(f"{who}: out holds {o.size} elements, the chunk {n}")
    return o


#: byte -> its 8 bits as 8 bytes (bit k in byte k), one little-endian uint64 per byte value
_EXPAND = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").copy().view("<u8").reshape(256)
#: sign-and-mantissa byte -> its bits in place in a bf16 (sign to bit 15, mantissa to bits 6..0)
_SIGN_MANT = (((np.arange(256) & 0x80) << 8) | (np.arange(256) & 0x7F)).astype(np.uint16)

# ---------------------------------------------------------------------------------------------- the GPU decoder


class DeviceBatch:
    """The chunks one :func:`decode_cuda` call decodes: per chunk ``(byte offset in the coded buffer, element offset
    in the output, elements, stored length)`` (a length of ``2 * elements``: a raw chunk). Built once per unit (host
    lists, then two small device tensors: 5 int64 per chunk and one int32 per block)."""

    def __init__(self, chunks: list[tuple[int, int, int, int]], device: Any) -> None:
        import torch

        rows, owner = [], []
        for i, (at, out0, n, length) in enumerate(chunks):
            rows.append((at, out0, n, len(owner), length))
            owner += [i] * (-(-n // BLOCK))
        self.blocks = len(owner)
        meta = torch.tensor(rows or [(0, 0, 0, 0, 0)], dtype=torch.int64)
        own = torch.tensor(owner or [0], dtype=torch.int32)
        if torch.device(device).type == "cuda":  # pinned and non-blocking: never waits for the stream's queued work
            meta, own = meta.pin_memory(), own.pin_memory()
            self._host = (meta, own)  # alive until the copies ran (kept with the batch)
        self.meta = meta.to(device, non_blocking=True)
        self.owner = own.to(device, non_blocking=True)


_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def exp3_decode(buf, out, meta, owner, BLK: tl.constexpr):
        g = tl.program_id(0)
        c = tl.load(owner + g).to(tl.int64)
        at = tl.load(meta + c * 5)
        out0 = tl.load(meta + c * 5 + 1)
        n = tl.load(meta + c * 5 + 2)
        j = g - tl.load(meta + c * 5 + 3)
        length = tl.load(meta + c * 5 + 4)
        raw = length == 2 * n
        n_coded = tl.where(raw, 0, n)  # elements read from the coded sections (none for a raw chunk)
        n_raw = n - n_coded
        nb = (n + BLK - 1) // BLK
        nb8 = (n + 7) // 8
        codes = at + 8 + 4 * nb
        smo = codes + 3 * nb8
        esco = smo + n
        idx = j * BLK + tl.arange(0, BLK)
        m = idx < n
        mc = idx < n_coded  # a raw chunk reads none of the coded sections
        sm = tl.load(buf + smo + idx, mask=mc, other=0).to(tl.int32)
        byte = idx >> 3
        bit = (idx & 7).to(tl.int32)
        c0 = (tl.load(buf + codes + byte, mask=mc, other=0).to(tl.int32) >> bit) & 1
        c1 = (tl.load(buf + codes + nb8 + byte, mask=mc, other=0).to(tl.int32) >> bit) & 1
        c2 = (tl.load(buf + codes + 2 * nb8 + byte, mask=mc, other=0).to(tl.int32) >> bit) & 1
        code = c0 | (c1 << 1) | (c2 << 2)
        tab = tl.load(buf + at + code, mask=mc, other=0).to(tl.int32)
        isesc = (code == 7) & mc
        s = at + 8 + 4 * j
        k4 = tl.arange(0, 4)
        b4 = tl.load(buf + s + k4, mask=k4 < tl.where(raw, 0, 4), other=0).to(tl.int64)
        base = tl.sum(b4 << (8 * k4), axis=0)  # the block's first escape (little-endian uint32)
        e1 = isesc.to(tl.int32)
        pos = tl.cumsum(e1, axis=0) - e1
        n_esc = length - (esco - at)
        ev = tl.load(buf + esco + base + pos, mask=isesc & (base + pos < n_esc), other=0).to(tl.int32)
        e = tl.where(isesc, ev, tab)
        u = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
        lo = tl.load(buf + at + 2 * idx, mask=idx < n_raw, other=0).to(tl.int32)  # a raw chunk: its bytes as they are
        hi = tl.load(buf + at + 2 * idx + 1, mask=idx < n_raw, other=0).to(tl.int32)
        u = tl.where(raw, lo | (hi << 8), u)
        tl.store(out + out0 + idx, u.to(tl.int16), mask=m)

    _KERNEL = exp3_decode
    return _KERNEL


def decode_cuda(buf: Any, batch: DeviceBatch, out: Any, *, num_warps: int = 8) -> None:
    """Decode ``batch``'s chunks from ``buf`` (1-D ``uint8`` on the GPU: the coded bytes after the H2D copy) into
    ``out`` (1-D ``int16``/``bfloat16`` on the same device; each chunk at its element offset). Enqueued on the current
    stream; no host synchronisation. The caller has checked every chunk's CRC-32 on the host (the reader does, as the
    bytes arrive): the kernel trusts the escape counts."""
    import torch

    if not batch.blocks:
        return
    o = out.view(torch.int16) if out.dtype != torch.int16 else out
    _kernel()[(batch.blocks,)](buf, o, batch.meta, batch.owner, BLK=BLOCK, num_warps=num_warps)


def ratio(n_elems: int, coded_bytes: int) -> float:
    """Coded bytes per plain byte."""
    return coded_bytes / max(1, 2 * n_elems)


__all__ += ["ratio"]
