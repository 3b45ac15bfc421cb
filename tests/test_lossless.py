"""Lossless coding of tensor bytes (issue 25, tiered/lossless.py): every dtype's bytes come back exactly, chunk by
chunk; corrupted or truncated data and malformed tables are refused naming the chunk and plane."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("zstandard")

from tiered.errors import CodecError  # noqa: E402
from tiered.lossless import CODEC, Coded, decode_into, encode  # noqa: E402

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def _bits(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` with uniformly random bits (NaN payloads, infinities, subnormals, both zeros: every
    pattern is as likely as any other), plus the special values written in at the front."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * isz,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype)
    if dtype.is_floating_point and n >= 6:
        t[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40]).to(dtype)
    return t


def _roundtrip(t: torch.Tensor, chunk_bytes: int) -> tuple[bytes, Coded]:
    raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)
    blob, coded = encode(raw, t.element_size(), chunk_bytes=chunk_bytes)
    out = np.full(raw.size, 0xA5, dtype=np.uint8)
    decode_into(blob, Coded.from_json(coded.to_json(), "t"), out)
    assert np.array_equal(out, raw)
    return blob, coded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4099])
def test_every_dtype_round_trips_bitwise(dtype: torch.dtype, n: int) -> None:
    t = _bits(dtype, n, seed=n)
    blob, coded = _roundtrip(t, chunk_bytes=1024)  # small chunks: many chunks, a short last one
    step = coded.chunk * t.element_size()
    assert coded.nbytes == t.numel() * t.element_size() and step <= 1024
    assert len(coded.planes) == -(-coded.nbytes // step) and len(blob) == coded.coded_bytes


def test_chunks_decode_alone_into_their_place() -> None:
    """Any subset of chunks decodes into its own byte range and touches nothing else (reader threads decode bands)."""
    t = (torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy()
    blob, coded = encode(raw, 2, chunk_bytes=4096)
    out = np.zeros(raw.size, dtype=np.uint8)
    decode_into(blob, coded, out, range(1, 3))
    lo, hi = coded.chunk_range(1)[0], coded.chunk_range(2)[1]
    assert np.array_equal(out[lo:hi], raw[lo:hi]) and not out[:lo].any() and not out[hi:].any()


def test_bf16_weights_shrink_in_the_exponent_plane_only() -> None:
    """Normal weights in bf16: the sign-and-exponent plane is zstd-coded and shrinks; the mantissa plane is kept raw
    (zstd does not make it smaller). The ratio itself is measured in benchmarks/codecs.py."""
    t = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    blob, coded = _roundtrip(t, chunk_bytes=1 << 20)
    (lo_plane, hi_plane), = coded.planes
    assert hi_plane[2] and hi_plane[1] < 0.5 * t.numel()  # the high byte (sign, exponent) is coded
    assert not lo_plane[2] and lo_plane[1] == t.numel()  # the mantissa byte stays raw
    assert len(blob) == coded.coded_bytes < t.numel() * 2


def test_corrupted_and_truncated_data_are_refused_naming_the_chunk() -> None:
    t = (torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy()
    blob, coded = encode(raw, 2, chunk_bytes=16384)
    out = np.zeros(raw.size, dtype=np.uint8)
    c, i = 2, 1  # a zstd-coded plane (the exponent plane) of chunk 2
    off, ln, zs = coded.planes[c][i]
    assert zs
    bad = bytearray(blob)
    bad[off + ln // 2] ^= 0x40
    with pytest.raises(CodecError, match=f"f.safetensors: chunk {c} .*CRC-32"):
        decode_into(bytes(bad), coded, out, where="f.safetensors")
    lo_raw = coded.planes[c][0]  # the raw mantissa plane: no zstd checksum, the chunk's CRC-32 still catches it
    bad = bytearray(blob)
    bad[lo_raw[0]] ^= 0x01
    with pytest.raises(CodecError, match=f"chunk {c} .*corrupted"):
        decode_into(bytes(bad), coded, out)
    with pytest.raises(CodecError, match="truncated"):
        decode_into(blob[: len(blob) // 2], coded, out)


@pytest.mark.parametrize("table", [{"codec": "lz77"}, {"codec": CODEC, "itemsize": 2}, {
    "codec": CODEC, "itemsize": 2, "nbytes": 8, "chunk": 2, "slice": 4, "chunks": [[0, 1, 1]]}, {
    "codec": CODEC, "itemsize": 2, "nbytes": 8, "chunk": 4, "slice": 4, "chunks": [[0, 1, 9]]}, {
    "codec": CODEC, "itemsize": 2, "nbytes": 8, "chunk": 4, "slice": 4, "chunks": [[-1, 1, 1]]}, {
    "codec": CODEC, "itemsize": 2, "nbytes": 8, "chunk": 4, "slice": 4, "chunks": [[0, 1.5, 1]]}], ids=[
    "unknown-codec", "missing-keys", "chunks-do-not-cover", "plane-longer-than-plain", "bad-crc", "float-length"])
def test_malformed_tables_are_refused(table: dict) -> None:
    with pytest.raises(CodecError, match="model.safetensors: .*(codec|table)"):
        Coded.from_json(table, "model.safetensors: tensor 'w'")


def test_chunks_never_cross_a_slice_so_one_expert_decodes_alone() -> None:
    """A stacked (E, rows, cols) tensor coded with one slice per expert: every chunk lies inside one expert, and the
    chunks covering expert j decode exactly its bytes (a routed expert's read)."""
    t = (torch.randn(5, 37, 11, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy().reshape(-1)
    per = 37 * 11
    blob, coded = encode(raw, 2, chunk_bytes=2 * 100, slice_elems=per)  # 100-element chunks: 5 per expert, the last short
    assert coded.count() == 5 * 5 == len(coded.lens)
    for c in range(coded.count()):
        lo, hi = coded.elements(c)
        assert lo // per == (hi - 1) // per
    j = 3
    out = np.zeros(raw.size, dtype=np.uint8)
    decode_into(blob, coded, out, coded.covering(j * per, (j + 1) * per))
    assert np.array_equal(out[j * per * 2:(j + 1) * per * 2], raw[j * per * 2:(j + 1) * per * 2])
    assert not out[: j * per * 2].any() and not out[(j + 1) * per * 2:].any()
    assert list(coded.covering(0, coded.numel)) == list(range(coded.count()))
