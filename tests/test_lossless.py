"""Losslessly compressed shards (issue 25, tiered/lossless.py): every dtype's bytes come back exactly, chunk by
chunk; corrupted or truncated data and malformed tables are refused naming the chunk and plane; `tiered.load` of
`tiered reshard --compress` output equals stock on the plain checkpoint bit for bit. (The converter's own tests:
tests/test_reshard.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

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


# ---------------------------------------------------------------------------------------------- loading coded shards
# tiered.load on `tiered reshard --compress` output: every kind of unit, io backend, tier and cast gives stock's
# logits on the plain source bit for bit; the bytes read are the coded ones; corruption is an error naming the place.

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import transformers  # noqa: E402
from conftest import STOCK, logits_of, make_ids, streaming_ring_gb  # noqa: E402

import tiered  # noqa: E402
from tiered import lossless  # noqa: E402
from tiered.errors import TieredError  # noqa: E402
from tiered.format import open_checkpoint  # noqa: E402
from tiered.lossless import META_KEY, VERSION_KEY, LosslessInfo, logical_shard  # noqa: E402


def _compressed(ckpts, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """``tiered reshard --compress`` of session checkpoint ``name`` (written once per session)."""
    out = tmp_path_factory.getbasetemp() / f"lossless-{name}"
    if not out.exists():
        with pytest.MonkeyPatch.context() as mp:  # the test models' tensors are small: code them, in several chunks
            mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
            mp.setattr(lossless, "DEFAULT_CHUNK_BYTES", 4096)
            tiered.reshard(ckpts[name], out, compress=True, quiet=True)
    return out


def _coded(d: Path) -> list[LosslessInfo]:
    return [t for t in open_checkpoint(d).tensors.values() if isinstance(t, LosslessInfo)]


def _ring(path: Path) -> float:
    """A ring (GiB) that streams ``path``'s model (:func:`conftest.streaming_ring_gb` of a probe load)."""
    with tiered.load(path) as probe:
        return streaming_ring_gb(probe)


@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream"}, {"ring_gb": "stream", "io": "direct"},
                                {"ring_gb": "stream", "io": "pread"}, {"ring_gb": "stream", "host_gb": 0.0002}],
                         ids=["resident", "streamed-mmap", "streamed-direct", "streamed-pread", "host-tier"])
@pytest.mark.parametrize("name", ["llama", "mixtral", "gptj", "llama_tied_single"])
def test_compressed_shards_load_bitwise_equal_to_stock(ckpts, tmp_path_factory, name: str, kw: dict) -> None:
    """Coded tensors are decoded on the reader threads into the ring slot (or the host tier's), whatever the unit:
    dense layers, a row-read embedding (kept plain by the converter), MoE experts (routed when the ring is small: each
    expert's chunks alone), tied weights; stock's logits on the plain checkpoint, bit for bit."""
    d = _compressed(ckpts, tmp_path_factory, name)
    assert len(_coded(d)) >= 5  # most weights are coded: a decode that went wrong would show
    ids = make_ids(1, (2, 9))
    ref = logits_of(STOCK(ckpts[name]), ids)
    kw = {**kw, "ring_gb": _ring(d)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(d, **kw) as m:
        got = logits_of(m, ids)
        st = tiered.stats(m)
    assert torch.equal(got, ref)
    if kw.get("ring_gb") and "host_gb" not in kw:  # every pass read the coded bytes, not the plain ones
        coded = {t.name: t for t in _coded(d)}
        assert 0 < st.streamed_bytes < sum(t.nbytes for t in open_checkpoint(d).tensors.values())
        assert sum(t.stored_bytes for t in coded.values()) <= st.streamed_bytes + sum(
            t.nbytes for t in open_checkpoint(d).tensors.values() if not isinstance(t, LosslessInfo))


def test_a_row_read_embedding_stays_plain_and_is_read_by_rows(ckpts, tmp_path_factory) -> None:
    """``reshard --compress`` leaves an embedding ``tiered.load`` reads by rows plain (a token reads a few KiB of
    it): streamed, it is read by rows, not decoded whole; an untied head stays coded."""
    d = _compressed(ckpts, tmp_path_factory, "llama")
    coded = {t.name for t in _coded(d)}
    assert "model.embed_tokens.weight" not in coded and "lm_head.weight" in coded
    with tiered.load(d, ring_gb=_ring(d), device="cpu") as m:
        assert [rg.unit.name for rg in m._tiered.rows] == ["model.embed_tokens"]
        assert torch.equal(logits_of(m, make_ids(4, (1, 5))), logits_of(STOCK(ckpts["llama"]), make_ids(4, (1, 5))))


def test_a_ring_too_small_for_a_coded_unit_says_it_is_compressed(ckpts, tmp_path_factory) -> None:
    """CPU zero copy computes plain units on the file mapping; a coded one must be decoded into the ring, and a ring
    too small for it is refused saying so (not "cast or converted"), with the ring_gb that would run."""
    from tiered.errors import RingTooSmallError

    d = _compressed(ckpts, tmp_path_factory, "llama")
    with pytest.raises(RingTooSmallError, match=r"stored losslessly compressed: the reader threads decode it into "
                                                r"the ring\); pass ring_gb >= "):
        tiered.load(d, device="cpu", ring_gb=1e-6, io="mmap")


@pytest.mark.parametrize(("name", "kw"), [("llama", {}), ("llama_fp32", {"dtype": torch.bfloat16}),
                                          ("mixtral", {"routed_experts": False})], ids=["bf16", "cast", "mixtral"])
def test_coded_units_cut_into_pieces_read_every_byte(ckpts, tmp_path_factory, name: str, kw: dict) -> None:
    """A coded unit cut into pieces (tiered.dist.split_unit: CUDA units larger than the ring, ranks of a job): each
    run of a coded tensor is a window of the chunks covering it, a chunk cut by a piece's edge decoded by both
    pieces; the pieces put together equal the unit read whole, whatever the slots held before, and a piece reads only
    the coded bytes of its chunks."""
    from tiered.dist import split_unit

    d = _compressed(ckpts, tmp_path_factory, name)
    with tiered.load(d, ring_gb=1.0, zero_copy=False, **kw) as m:
        h = m._tiered
        units = [u for u in h.plan.units if any(isinstance(c.src, LosslessInfo) for t in u.targets for c in t.copies)]
        assert len(units) >= 3
        for u in units:
            whole = torch.zeros(u.nbytes, dtype=torch.uint8)
            h.reader.read_unit(u, whole)
            assert whole.any()
            stored = sum(c.nbytes for t in u.targets for c in t.copies)
            for n in (2, 3, 7, 64):
                got = torch.full((u.nbytes,), 0xA5, dtype=torch.uint8)
                read = 0
                for k in range(n):
                    piece, chunk = split_unit(u, k, n, h.plan.align)
                    if k * chunk >= u.nbytes:
                        continue
                    slot = torch.full((chunk,), 0x5A, dtype=torch.uint8)
                    assert h.reader.read_unit(piece, slot) == piece.src_bytes
                    read += piece.src_bytes
                    span = min(chunk, u.nbytes - k * chunk)
                    for t in piece.targets:  # only the targets' bytes are defined (the rest is alignment padding)
                        got[k * chunk + t.offset: k * chunk + t.offset + t.nbytes] = slot[t.offset: t.offset + t.nbytes]
                    assert all(t.offset + t.nbytes <= span for t in piece.targets)
                for t in u.targets:
                    assert torch.equal(got[t.offset: t.offset + t.nbytes], whole[t.offset: t.offset + t.nbytes]), \
                        f"{u.name} in {n} pieces: {t.key}"
                most = max(c.src.coded.chunk_span(i)[1] for t in u.targets for c in t.copies
                           if isinstance(c.src, LosslessInfo) for i in c.src.chunks)
                assert stored <= read <= stored + (n - 1) * most  # an edge chunk is read by both sides


def test_a_window_of_a_coded_tensor_decodes_its_elements_only(ckpts, tmp_path_factory) -> None:
    """:func:`tiered.lossless.window`: any element range, cut mid-chunk or not, decodes to the plain tensor's same
    elements; its ``stored`` counts the covering chunks only."""
    import safetensors.torch

    from tiered.reader import Reader

    d = _compressed(ckpts, tmp_path_factory, "llama")
    info = max(_coded(d), key=lambda t: len(t.coded.lens))
    plain = next(f[info.name] for f in map(safetensors.torch.load_file, Path(ckpts["llama"]).glob("*.safetensors"))
                 if info.name in f).reshape(-1)
    assert len(info.coded.lens) >= 4
    n, per = plain.numel(), info.coded.chunk
    g = torch.Generator().manual_seed(7)
    cuts = [(0, n), (0, 1), (n - 1, n), (per - 1, per + 1), (per, 2 * per), (3, n - 5)]
    cuts += [tuple(sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())) for _ in range(12)]
    r = Reader(open_checkpoint(d), threads=2)
    try:
        for lo, hi in cuts:
            w = lossless.window(info, lo, hi)
            assert w.stored == sum(info.coded.chunk_span(c)[1] for c in w.chunks)
            assert torch.equal(r.decode_whole(w), plain[lo:hi]), (lo, hi)
            ww = lossless.window(w, 1, max(1, hi - lo - 1)) if hi - lo >= 2 else w  # a window of a window
            assert torch.equal(r.decode_whole(ww).reshape(-1), plain[lo:hi][1: max(1, hi - lo - 1)] if hi - lo >= 2
                               else plain[lo:hi])
    finally:
        r.close()
    with pytest.raises(ValueError):
        lossless.window(info, 0, n + 1)


def test_reader_threads_default_grows_for_a_coded_checkpoint(ckpts, tmp_path_factory, monkeypatch) -> None:
    """The readers decode coded chunks: with ``threads`` not given, a coded checkpoint gets more reader threads (cores
    less two on CUDA, half on the CPU, 4 to 16); a plain one 4; a given number is kept."""
    from tiered import policy

    assert policy.reader_threads(None, False, False, 16) == (4, "automatic: the default")
    assert policy.reader_threads(None, True, False, 16)[0] == 14
    assert policy.reader_threads(None, True, True, 16)[0] == 8
    assert policy.reader_threads(None, True, True, 2)[0] == 4 and policy.reader_threads(None, True, False, 64)[0] == 16
    assert "4, the floor, on 2 cores" in policy.reader_threads(None, True, True, 2)[1]  # never "4 of 2 cores"
    assert "8 of 16 cores" in policy.reader_threads(None, True, True, 16)[1]
    assert "4, the floor, on 6 cores" in policy.reader_threads(None, True, True, 6)[1]  # 3 wanted, raised to 4
    assert policy.reader_threads(3, True, False, 16) == (3, "given (threads)")
    seen = []
    real = policy.reader_threads
    monkeypatch.setattr(policy, "reader_threads", lambda *a: seen.append(a[:2]) or real(*a))
    for d, coded in ((_compressed(ckpts, tmp_path_factory, "llama"), True), (ckpts["llama"], False)):
        with tiered.load(d, ring_gb=_ring(d), device="cpu") as m:
            pl = tiered.stats(m).placement
            assert seen[-1] == (None, coded) and pl.threads == m._tiered.reader.pool._max_workers
            assert ("losslessly coded" in pl.threads_why) == coded
    with tiered.load(ckpts["llama"], threads=2) as m:
        assert tiered.stats(m).placement.threads == 2 and m._tiered.reader.pool._max_workers == 2


@pytest.mark.parametrize("group", [1 << 16, 1 << 30], ids=["64KiB", "whole"])
def test_consecutive_chunks_read_in_one_request_decode_in_place(ckpts, tmp_path_factory, monkeypatch,
                                                                group: int) -> None:
    """``reader.LOSSLESS_READ``: a task reads a run of consecutive chunks in one request and decodes each into its
    place (a cast, pieces' windows too); stock's logits bit for bit."""
    from tiered import reader

    monkeypatch.setattr(reader, "LOSSLESS_READ", group)
    ids = make_ids(8, (2, 7))
    for name, kw in (("llama", {}), ("llama_fp32", {"dtype": torch.bfloat16})):
        d = _compressed(ckpts, tmp_path_factory, name)
        ref = logits_of(STOCK(ckpts[name], **({"dtype": kw["dtype"]} if kw else {})), ids)
        with tiered.load(d, ring_gb=_ring(d), io="direct", **kw) as m:
            assert torch.equal(logits_of(m, ids), ref)


@pytest.mark.parametrize("kw", [{}, {"host_gb": 1.0}], ids=["streamed", "host-tier"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_compressed_routed_experts_read_only_their_chunks(ckpts, tmp_path_factory, name: str, kw: dict) -> None:
    """Routed MoE experts of a compressed checkpoint (tiered/experts.py): each expert's bytes are the chunks of its
    own tensor, or a window of a stacked ``(E, ...)`` tensor's (the converter's chunks never cross an expert), read
    and decoded alone; logits and greedy generate equal stock's on the plain checkpoint bit for bit, and an expert
    read counts its coded bytes."""
    from conftest import ring_below_layer

    d = _compressed(ckpts, tmp_path_factory, name)
    ref = STOCK(ckpts[name], impl="grouped_mm")
    ids = make_ids(9, (2, 7))
    with torch.no_grad():
        want, want_gen = ref(ids).logits, ref.generate(ids[:1], max_new_tokens=5, do_sample=False)
    with tiered.load(d, ring_gb=ring_below_layer(ref), device="cpu", **kw) as m:
        st = tiered.stats(m)
        specs = st.placement.specs
        assert st.expert_modules >= 2 and specs
        coded = [sp for sp in specs if any(isinstance(info, LosslessInfo) for p in sp.parts for info, _ in p.per[0])]
        assert coded and all(sp.expert_src_bytes < sp.expert_bytes for sp in coded)
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids[:1], max_new_tokens=5, do_sample=False), want_gen)
        s = tiered.stats(m).snapshot()
        assert (s["experts_read"] > 0) == (not kw)


def test_a_coded_fused_tensor_chunked_into_parameters_equals_stock(tmp_path) -> None:
    """NomicBert's fused ``attn.Wqkv``, which transformers splits into q/k/v with ``Chunk(dim=0)`` (tiered/chunks.py):
    coded, each parameter is a window of its rows' chunks (chunks of 24 rows here, so the q/k/v edges cut them);
    streamed, equal to stock on the plain checkpoint bit for bit."""
    import models
    from conftest import make_ids

    models.nomic_bert(tmp_path / "nomic", seed=27)
    d = tmp_path / "z"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
        mp.setattr(lossless, "DEFAULT_CHUNK_BYTES", 24 * 64 * 2)
        tiered.reshard(tmp_path / "nomic", d, compress=True, quiet=True)
    assert any(t.name.endswith("attn.Wqkv.weight") for t in _coded(d))
    ref = transformers.AutoModel.from_pretrained(tmp_path / "nomic").eval()
    ids = make_ids(11, (2, 7))
    with torch.no_grad():
        want = ref(ids).last_hidden_state
        for kw in ({}, {"ring_gb": _ring(d)}):
            with tiered.load(d, **kw) as t:
                assert torch.equal(t(ids).last_hidden_state, want)


def test_the_extra_reader_threads_buffers_are_left_out_of_the_ring_and_host_tier(ckpts, tmp_path_factory) -> None:
    """With more reader threads for a coded checkpoint, the automatic ring and host tier leave their decode buffers
    out (``policy.extra_reader_bytes``: 20 MiB a thread beyond the default 4), on a machine of 16 cores whose memory
    limit makes the ring and host tier share what is left; a plain checkpoint's default threads take nothing more."""
    from tiered import policy
    from tiered.inspection import _plan_for
    from tiered.machine import Machine
    from tiered.options import Options
    from tiered.placement import place

    def placed(d: Path, left: int):
        config, ckpt, plan = _plan_for(d, None, "cpu")
        m = Machine(policy.headroom(False) + left, "test cgroup", 1 << 40, "test", cores=16)
        return place(plan, Options(device="cpu", io="mmap"), m, ckpt_bytes=ckpt.nbytes, config=config)

    zd = _compressed(ckpts, tmp_path_factory, "llama")
    z, p = placed(zd, 1 << 30), placed(ckpts["llama"], 1 << 30)
    assert (z.threads, p.threads) == (8, 4)
    assert policy.extra_reader_bytes(8) == 4 * policy.DECODE_THREAD_BYTES and policy.extra_reader_bytes(4) == 0
    assert round((p.ring_gb - z.ring_gb) * (1 << 30)) == policy.extra_reader_bytes(8)  # the automatic ring asked
    assert "extra reader threads" in z.ring_why and "reader threads" not in p.ring_why
    # little memory: fewer extra threads (their buffers at most 1/8 of what is left), never a refused load
    small = placed(zd, 100 << 20)
    assert small.threads == 4 and "capped by memory" in small.threads_why and small.ring_bytes > 0
    assert placed(zd, 400 << 20).threads == 4 + (400 << 20) // 8 // policy.DECODE_THREAD_BYTES


def test_compressed_shards_cast_at_load_equal_stock(ckpts, tmp_path_factory) -> None:
    """A coded fp32 checkpoint run in bf16: each chunk is decoded, then cast into the slot (stock's ``.to``)."""
    d = _compressed(ckpts, tmp_path_factory, "llama_fp32")
    ids = make_ids(2, (2, 7))
    ref = logits_of(STOCK(ckpts["llama_fp32"], dtype=torch.bfloat16), ids)
    with tiered.load(d, dtype=torch.bfloat16, ring_gb=_ring(d)) as m:
        assert torch.equal(logits_of(m, ids), ref)


def test_compressed_encoder_and_conversion_models_equal_stock(ckpts, tmp_path_factory) -> None:
    """An encoder (BERT, fp32) and a MoE whose experts transformers converts at load (Qwen3-MoE per-expert tensors
    stacked by a WeightConverter: the conversion decodes its coded sources whole)."""
    d = _compressed(ckpts, tmp_path_factory, "bert")
    ids = make_ids(3, (2, 6))
    with torch.no_grad():
        ref = STOCK(ckpts["bert"], auto=transformers.AutoModel)(ids).last_hidden_state
        with tiered.load(d) as m:
            assert torch.equal(m(ids).last_hidden_state, ref)
    d = _compressed(ckpts, tmp_path_factory, "qwen3_moe")
    ref = logits_of(STOCK(ckpts["qwen3_moe"]), ids)
    with tiered.load(d, ring_gb=_ring(d), device="cpu") as m:
        assert torch.equal(logits_of(m, ids), ref)


def test_a_corrupted_chunk_is_an_error_naming_file_tensor_and_offset(ckpts, tmp_path_factory, tmp_path) -> None:
    d = Path(shutil.copytree(_compressed(ckpts, tmp_path_factory, "llama"), tmp_path / "bad"))
    t = max(_coded(d), key=lambda t: t.stored_bytes)
    start, length = t.coded.chunk_span(0)
    with open(t.file, "r+b") as f:  # one flipped bit in the middle of the first chunk
        f.seek(t.offset + start + length // 2)
        b = f.read(1)
        f.seek(t.offset + start + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CodecError, match=rf"{t.file.name}: tensor '{t.name}'.*chunk 0 .*{t.offset + start}"):
        with tiered.load(d, ring_gb=_ring(d), device="cpu") as m:
            logits_of(m, make_ids(0, (1, 4)))


def test_unknown_version_and_bad_tables_are_refused_before_any_read(ckpts, tmp_path_factory) -> None:
    shard = next(s for s in open_checkpoint(_compressed(ckpts, tmp_path_factory, "llama")).shards
                 if any(isinstance(t, LosslessInfo) for t in s.tensors.values()))
    from tiered.format import read_header

    raw = read_header(shard.path)
    with pytest.raises(CodecError, match="format version '2'"):
        logical_shard(dataclasses.replace(raw, metadata={**raw.metadata, VERSION_KEY: "2"}))
    tables = json.loads(raw.metadata[META_KEY])
    name = next(iter(tables))
    tables[name]["shape"] = [s + 1 for s in tables[name]["shape"]]
    with pytest.raises(CodecError, match=f"tensor '{name}'.*plain"):
        logical_shard(dataclasses.replace(raw, metadata={**raw.metadata, META_KEY: json.dumps(tables)}))


def _no_zstandard(monkeypatch) -> object:
    """Make ``import zstandard`` fail from now on (as on a machine without it); returns the real ``__import__``."""
    import builtins

    real = builtins.__import__

    def no_zstd(name, *a, **k):
        if name == "zstandard":
            raise ImportError("no zstandard")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    return real


def test_without_zstandard_the_load_says_what_to_install(ckpts, tmp_path_factory, monkeypatch) -> None:
    d = _compressed(ckpts, tmp_path_factory, "llama")
    _no_zstandard(monkeypatch)
    with pytest.raises(TieredError, match=r"tiered\[compress\]"):
        tiered.load(d)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream", "io": "direct"}, {"ring_gb": "stream", "host_gb": 0.0002}],
                         ids=["resident", "streamed", "host-tier"])
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_cuda_compressed_shards_equal_stock_on_the_gpu(ckpts, tmp_path_factory, name: str, kw: dict) -> None:
    """On the GPU: coded chunks decoded on the reader threads into the pinned ring slot, then the H2D copy; against
    stock on the same GPU, bit for bit."""
    d = _compressed(ckpts, tmp_path_factory, name)
    ids = make_ids(3, (2, 8))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ckpts[name]).eval().to("cuda")
    ref = logits_of(ref_model, ids.cuda())
    del ref_model
    kw = {**kw, "ring_gb": _ring(d)} if kw.get("ring_gb") == "stream" else kw
    with tiered.load(d, device="cuda", gpu_gb=0 if kw else None, **kw) as m:
        got = logits_of(m, ids.cuda())
    assert torch.equal(got, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_cuda_coded_units_larger_than_the_ring_stream_in_pieces(io: str, tmp_path: Path, monkeypatch) -> None:
    """A compressed checkpoint whose layers and untied head are each larger than the ring: each coded unit is read
    in pieces (windows of its chunks) through the ring into one device buffer; logits and greedy generate equal stock
    on the GPU bit for bit, and the pieces read about the coded bytes, not the plain ones."""
    src, d = _small_llama_coded(tmp_path, True)
    monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 32 << 10)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval().to("cuda")
    ids = make_ids(6, (2, 9)).cuda()
    with torch.no_grad():
        want, want_gen = ref(ids).logits, ref.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    del ref
    with tiered.load(d, device="cuda", ring_gb=(256 << 10) / (1 << 30), gpu_gb=0, io=io) as m, torch.no_grad():
        h = m._tiered
        big = [u for u in h.plan.units if u.nbytes > h.ring.size and u.index not in {rg.unit.index for rg in h.rows}]
        assert len(big) >= 4 and tiered.stats(m).piece_units == len(big)  # 3 layers and the head
        assert all(any(isinstance(c.src, LosslessInfo) for t in u.targets for c in t.copies) for u in big)
        before = tiered.stats(m).streamed_bytes
        assert torch.equal(m(ids).logits, want)
        per_pass = tiered.stats(m).streamed_bytes - before
        assert per_pass < 0.85 * sum(u.nbytes for u in big)  # coded bytes moved (bf16 N(0, 0.02): ~0.7)
        assert torch.equal(m.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0), want_gen)
        assert h.ring.high_water <= h.ring.size


def test_quantized_codes_are_never_read_coded(tmp_path) -> None:
    """FP8 codes and scales are read by byte ranges to be dequantized: `--compress` of a quantized checkpoint is
    refused, and a compressed directory whose codes are coded anyway (its config stripped while converting) is refused
    at load, before any read — never decoded as if plain."""
    import models

    from tiered.reshard.errors import UnsupportedCheckpointError

    fp8 = models.fp8_block(models.llama(tmp_path / "bf16"), tmp_path / "fp8")
    with pytest.raises(UnsupportedCheckpointError, match="--compress of quantized codes"):
        tiered.reshard(fp8, tmp_path / "no", compress=True, quiet=True)
    assert not (tmp_path / "no").exists()
    cfg = json.loads((fp8 / "config.json").read_text())
    stripped = Path(shutil.copytree(fp8, tmp_path / "stripped"))
    (stripped / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    out = tmp_path / "coded"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
        tiered.reshard(stripped, out, compress=True, quiet=True)
    (out / "config.json").write_text(json.dumps(cfg))
    assert any(t.dtype == torch.float8_e4m3fn for t in _coded(out))
    with pytest.raises(CodecError, match="quantized codes or scales that are also losslessly compressed"):
        tiered.load(out)


# ---------------------------------------------------------------------------------------------- exp3-bf16 (GPU code)


def _exp3_inputs() -> list[np.ndarray]:
    """bf16 bit patterns: every one of the 65,536 (NaN payloads, +-Inf, subnormals, -0: escape-heavy), random-normal
    weights at several lengths around the block and byte edges, and weights with a few outliers."""
    from tiered import expcode

    every = np.arange(1 << 16, dtype=np.uint16)
    np.random.default_rng(3).shuffle(every)
    mixed = (torch.randn(32 << 16, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    mixed = mixed.view(torch.int16).numpy().view(np.uint16).copy()
    mixed[::32] = every  # every bit pattern once, among weights: a coded chunk with ~3% escapes
    out = [mixed, every]
    for n in (1, 7, 8, 9, expcode.BLOCK - 1, expcode.BLOCK, expcode.BLOCK + 1, 3 * expcode.BLOCK + 17):
        w = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(torch.bfloat16)
        out.append(w.view(torch.int16).numpy().view(np.uint16).copy())
    spiky = out[-1].copy()
    spiky[::97] = every[: spiky[::97].size]  # a coded chunk with ~1% escapes
    out.append(spiky)
    return out


#: the CPU decoders of exp3 chunks: numpy (the reference), and the C decoder's AVX2 and scalar paths (tiered.native)
CPU_DECODERS = ("numpy", "c-simd", "c-scalar")


def _cpu_decoder(name: str):
    import functools

    from tiered import expcode, native

    if name == "numpy":
        return expcode.decode_np
    if native.exp3() is None:
        pytest.skip(f"the C decoder could not be built here: {native.why_not}")
    return functools.partial(expcode.decode_cpu, simd=name == "c-simd")


@pytest.mark.parametrize("decoder", CPU_DECODERS)
def test_exp3_round_trips_every_bit_pattern_on_the_cpu(decoder: str) -> None:
    """``exp3-bf16``: every bf16 bit pattern, and random-normal weights at lengths around the block and byte edges,
    decode (numpy, and the C decoder's SIMD and scalar paths) to the input bit for bit; normal weights code smaller
    than plain."""
    from tiered import expcode

    decode = _cpu_decoder(decoder)
    inputs = _exp3_inputs()
    given = len(inputs)
    for n in (31, 32, 33, 63, 65, 4 * expcode.BLOCK + 40):  # around the SIMD path's 32-element step and its tail
        w = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(torch.bfloat16)
        w = w.view(torch.int16).numpy().view(np.uint16).copy()
        w[::29] = inputs[1][: w[::29].size]  # escapes in the tail too
        inputs.append(w)
    for i, u in enumerate(inputs):
        body = expcode.encode_chunk(u)
        if i < given:
            assert (len(body) == u.nbytes) == (i == 1 or u.size < 64)  # raw: random bits, chunks too short to shrink
        out = np.full(u.size, 0xA5A5, dtype=np.uint16)
        decode(body, u.size, out)
        assert np.array_equal(out, u), u.size
    assert expcode.encode_chunk(np.zeros(0, np.uint16)) == b""


def test_exp3_c_decoder_agrees_with_numpy_on_every_corrupted_chunk() -> None:
    """One flipped bit anywhere in a coded chunk (table, block starts, code planes, sign-and-mantissa, escapes): the C
    decoder (both paths) refuses it exactly when numpy does, and otherwise writes numpy's bits; it never reads past
    the chunk (an escape section cut short is refused, not read beyond)."""
    from tiered import expcode

    decoders = [_cpu_decoder(d) for d in CPU_DECODERS]
    u = _exp3_inputs()[0][: 3 * expcode.BLOCK + 100]
    body = expcode.encode_chunk(u)
    rng = np.random.default_rng(5)
    refused = 0
    for _ in range(300):
        bad = bytearray(body)
        bad[int(rng.integers(len(bad)))] ^= 1 << int(rng.integers(8))
        seen = []
        for decode in decoders:
            out = np.zeros(u.size, np.uint16)
            try:
                decode(bytes(bad), u.size, out)
                seen.append(out.tobytes())
            except CodecError:
                seen.append(None)
        assert seen[1] == seen[0] and seen[2] == seen[0]
        refused += seen[0] is None
    assert 0 < refused < 300  # both kinds of flip were drawn


def test_exp3_without_a_compiler_decodes_with_numpy_and_says_so(tmp_path: Path) -> None:
    """Where the C decoder cannot be built (no compiler), loading falls back to numpy with one UserWarning naming
    the cause; ``TIERED_NATIVE=0`` turns it off without a warning; either way the bits are the input's."""
    code = ("import warnings, numpy as np, torch\n"
            "warnings.simplefilter('always')\n"
            "from tiered import expcode, native\n"
            "u = (torch.randn(9000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)\n"
            "u = u.view(torch.int16).numpy().view(np.uint16)\n"
            "out = np.empty(u.size, np.uint16)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    expcode.decode_cpu(expcode.encode_chunk(u), u.size, out)\n"
            "assert np.array_equal(out, u)\n"
            "print('lib', native.exp3() is not None, '|', native.why_not, '|', [str(x.message) for x in w])\n")
    env = {**os.environ, "TIERED_CACHE_DIR": str(tmp_path / "cache"), "CC": "no-such-cc"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "lib False" in r.stdout and "no C compiler 'no-such-cc'" in r.stdout and "decoding with numpy" in r.stdout
    env = {**env, "TIERED_NATIVE": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "lib False | TIERED_NATIVE=0 | []" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("decoder", CPU_DECODERS)
def test_exp3_truncated_or_padded_chunk_is_refused(decoder: str) -> None:
    """A chunk whose escape section is short or long (truncated or corrupted) raises CodecError naming the place,
    never decodes to other numbers (numpy, and the C decoder's two paths)."""
    from tiered import expcode

    decode = _cpu_decoder(decoder)
    u = _exp3_inputs()[0][:5000]
    body = expcode.encode_chunk(u)
    assert len(body) < u.nbytes
    out = np.empty(u.size, np.uint16)
    for bad in (body[:-1], body + b"\0", body[:100]):
        with pytest.raises(CodecError, match="shard.safetensors: tensor 'w'"):
            decode(bad, u.size, out, where="shard.safetensors: tensor 'w'")
    # block escape starts that disagree with the codes (what the GPU decoder indexes by): refused by both checks
    u = _exp3_inputs()[0][: 3 * expcode.BLOCK]
    body = bytearray(expcode.encode_chunk(u))
    blocks = expcode.chunk_layout(u.size)[0]
    good = np.frombuffer(bytes(body[blocks: blocks + 12]), "<u4")
    assert good[0] == 0 and good[1] > 0
    body[blocks + 4: blocks + 8] = np.array([good[1] - 1], "<u4").tobytes()  # still non-decreasing: only decode sees it
    with pytest.raises(CodecError, match="disagree with its codes"):
        decode(bytes(body), u.size, np.empty(u.size, np.uint16), where="f")
    body[blocks + 4: blocks + 8] = np.array([good[2] + 1], "<u4").tobytes()  # decreasing after it
    with pytest.raises(CodecError, match="do not fit"):
        expcode.check_starts(np.frombuffer(bytes(body), np.uint8), u.size, where="f")


def test_exp3_tables_that_do_not_fit_are_refused() -> None:
    """An exp3 table whose chunk lengths are shorter than the chunk's fixed sections, or of non-bf16 elements, is
    refused when the shard is opened (before any read), naming the tensor."""
    good = Coded(2, 2 * 8192, 8192, 8192, [[11300]], [1], codec=lossless.EXP3).to_json()
    assert Coded.from_json(good, "f").lens == [[11300]]  # fixed sections 11,280 + 20 escapes
    for bad in ({**good, "chunks": [[1, 16]]}, {**good, "chunks": [[1, 16384 + 1]]},
                {**good, "itemsize": 4, "nbytes": 4 * 8192, "chunks": [[1, 11300]]}):
        with pytest.raises(CodecError, match="f: tensor 'w'"):
            Coded.from_json(bad, "f: tensor 'w'")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_exp3_decoder_equals_the_input() -> None:
    """The Triton decoder, one launch over chunks of every input at their offsets in one coded buffer (as a unit's
    staging holds them), writes the input's bits exactly, and nothing outside the chunks."""
    from tiered import expcode

    chunks, parts, want, at, o = [], [], [], 0, 0
    for u in _exp3_inputs():
        b = expcode.encode_chunk(u)
        chunks.append((at, o, u.size, len(b)))
        parts.append(b)
        want.append(u)
        at, o = at + len(b), o + u.size + 5  # a gap between chunks' outputs: must stay untouched
        want.append(np.full(5, 0x7777, np.uint16))
    buf = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).cuda()
    out = torch.full((o,), 0x7777, dtype=torch.int16, device="cuda")
    expcode.decode_cuda(buf, expcode.DeviceBatch(chunks, "cuda"), out)
    assert np.array_equal(out.cpu().numpy().view(np.uint16), np.concatenate(want))


def _small_llama_coded(tmp_path: Path, compress: bool | str) -> tuple[Path, Path]:
    """A bf16 Llama (untied head, 3 layers) and its `reshard --compress` output (``compress``: True for zstd, "exp3"),
    with small chunks and thresholds so that every weight is coded."""
    import models

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=704, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    src = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=11, dtype=torch.bfloat16,
                            max_shard_size=None, std=0.02)
    d = tmp_path / "x"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
        mp.setattr(lossless, "DEFAULT_CHUNK_BYTES", 16 << 10)
        tiered.reshard(src, d, compress=compress, quiet=True)
    return src, d


def _exp3_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    return _small_llama_coded(tmp_path, "exp3")


def test_exp3_checkpoint_round_trips_and_loads_on_the_cpu(tmp_path: Path) -> None:
    """`reshard --compress --codec exp3`: the bf16 tensors are coded exp3 and smaller; `reshard` back writes shards
    byte-identical to a plain reshard of the source; `tiered.load` on the CPU (exp3 decoded on the reader threads)
    gives stock's logits bit for bit, resident and streamed."""
    import filecmp

    from safetensors import safe_open

    src, d = _exp3_checkpoint(tmp_path)
    tables = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            tables.update(json.loads(s.metadata()[META_KEY]))
    assert tables and {t["codec"] for t in tables.values()} == {lossless.EXP3}
    tiered.reshard(d, tmp_path / "back", quiet=True)
    tiered.reshard(src, tmp_path / "plain", quiet=True)
    for f in (tmp_path / "plain").glob("*.safetensors"):
        assert filecmp.cmp(f, tmp_path / "back" / f.name, shallow=False)
    ids = make_ids(6, (2, 9))
    want = logits_of(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    for kw in ({}, {"ring_gb": _ring(d)}):
        with tiered.load(d, device="cpu", **kw) as m:  # the CPU path also on a GPU machine
            assert torch.equal(logits_of(m, ids), want)


def test_cuda_placement_names_the_exp3_units_the_readers_decode(tmp_path: Path, monkeypatch) -> None:
    """A CUDA placement of an exp3 checkpoint (``tiered inspect --device cuda``, here without a GPU) names the units
    whose coded tensors the reader threads decode instead of the GPU, and why: every coded unit where there is no
    Triton; with Triton, none when a stored unit larger than the ring is cut into pieces of whole coded chunks
    (tiered/pieces.py: what a cold 2 GiB cgroup needs for Llama-3-8B's lm_head, benchmarks/NOTES.md, issue 25, eighth
    session), and each unit with a coded chunk larger than a piece's room, with a ring_gb that keeps it on the GPU
    (which, passed, does)."""
    from tiered import placement
    from tiered.hostmem import page_up
    from tiered.inspection import inspect_dir

    _, d = _exp3_checkpoint(tmp_path)
    info = inspect_dir(d)  # the converter's layout, measured on the coded spans: every unit one span on disk
    assert info["units_contiguous_on_disk"] == len(info["units"]), info["units_contiguous_on_disk"]
    monkeypatch.setattr(placement, "_triton_here", lambda: False)
    pl = inspect_dir(d, device="cuda", placement={"ring_gb": 1.0, "gpu_gb": 1e-4})["placement"]
    coded = set(pl["reader_decoded"])
    assert {"lm_head", "model.layers.0"} <= coded and "model.embed_tokens" not in coded  # (read by rows: plain)
    assert set(pl["reader_decoded"].values()) == {"no Triton here: no GPU decoder"}
    monkeypatch.setattr(placement, "_triton_here", lambda: True)
    monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 4 << 10)
    units = inspect_dir(d, device="cuda")["units"]
    stored = {u["name"]: u["bytes"] for u in units if u["name"] in coded}
    index = {u["name"]: i for i, u in enumerate(units)}
    assert len(set(map(page_up, stored.values()))) > 1, stored
    ring = (min(map(page_up, stored.values())) + max(map(page_up, stored.values()))) // 2
    pl = inspect_dir(d, device="cuda", placement={"ring_gb": ring / 2**30, "gpu_gb": 1e-4})["placement"]
    big = {n for n, b in stored.items() if page_up(b) > ring}
    assert big and big != coded and pl["reader_decoded"] == {} and not pl["refused"], pl
    assert {index[n] for n in big} <= {int(i) for i in pl["pieces"]}, pl["pieces"]  # stored, in pieces
    tiny = 48 << 10  # a piece's room (a third, less a page) below one 16 KiB coded chunk
    pl = inspect_dir(d, device="cuda", placement={"ring_gb": tiny / 2**30, "gpu_gb": 1e-4})["placement"]
    assert set(pl["reader_decoded"]) == coded, pl["reader_decoded"]
    for n in coded:
        why = pl["reader_decoded"][n]
        assert "one of its coded chunks is larger than a piece" in why, why
        advice = float(why.rsplit("ring_gb >= ", 1)[1].split()[0])
        again = inspect_dir(d, device="cuda", placement={"ring_gb": advice, "gpu_gb": 1e-4})["placement"]
        assert n not in again["reader_decoded"], (n, advice, again["reader_decoded"])
    pl = inspect_dir(d, device="cuda", placement={"ring_gb": 1.0, "gpu_gb": 1e-4})["placement"]
    assert pl["reader_decoded"] == {}


def test_exp3_checkpoint_needs_no_zstandard_and_refuses_other_dtypes(tmp_path: Path, monkeypatch) -> None:
    """An exp3-only checkpoint loads (stock's logits bit for bit) and decompresses without the zstandard package,
    which only zstd-coded tensors need; exp3 with a target dtype other than bf16 (nothing it could code) is refused
    by the API and is a usage error (exit 2) on the command line, before anything is written."""
    import builtins

    from tiered.reshard import ReshardError

    src, d = _exp3_checkpoint(tmp_path)
    want = logits_of(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), make_ids(6, (2, 9)))
    real = _no_zstandard(monkeypatch)
    with tiered.load(d, ring_gb=_ring(d), device="cpu") as m:
        assert torch.equal(logits_of(m, make_ids(6, (2, 9))), want)
    tiered.reshard(d, tmp_path / "back", decompress=True, quiet=True)
    monkeypatch.setattr(builtins, "__import__", real)
    with tiered.load(tmp_path / "back", device="cpu") as m:
        assert torch.equal(logits_of(m, make_ids(6, (2, 9))), want)
    for dt in ("fp16", "fp32"):
        with pytest.raises(ReshardError, match="compress='exp3' codes bf16"):
            tiered.reshard(src, tmp_path / f"x-{dt}", compress="exp3", dtype=dt, quiet=True)
        assert not (tmp_path / f"x-{dt}").exists()
        r = subprocess.run([sys.executable, "-m", "tiered.cli", "reshard", str(src), str(tmp_path / f"y-{dt}"), "--compress",
                            "--codec", "exp3", "--dtype", dt], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--codec exp3 codes bf16" in r.stderr, r.stderr
        assert not (tmp_path / f"y-{dt}").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"ring_gb": "stream"}, {"ring_gb": "stream", "host_gb": 0.002},
                                {"ring_gb": "small", "io": "direct"}],
                         ids=["resident", "streamed", "host-tier", "head-in-pieces"])
def test_cuda_exp3_decoded_on_the_gpu_equals_stock(tmp_path: Path, kw: dict, monkeypatch) -> None:
    """On the GPU, an exp3 checkpoint's coded chunks go through the ring (and host tier) and the H2D copy as stored
    and the Triton decoder writes the weights (``Stats.decoded_bytes``); a unit larger than the ring is read in pieces
    of whole coded chunks into its buffer's stored region and decoded after the last (tiered/pieces.py). Logits and
    greedy generate equal stock on the same GPU bit for bit."""
    src, d = _exp3_checkpoint(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval().to("cuda")
    ids = make_ids(6, (2, 9)).cuda()
    with torch.no_grad():
        want, want_gen = ref(ids).logits, ref.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    del ref
    if kw.get("ring_gb") == "stream":
        kw = {**kw, "ring_gb": _ring(d)}
    elif kw.get("ring_gb") == "small":  # holds the coded head (~0.37 MB), not a coded layer (~0.45 MB): pieces
        monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 32 << 10)
        kw = {**kw, "ring_gb": 0.42 / 1024, "prefetch": 1}
    with tiered.load(d, device="cuda", gpu_gb=0 if kw else None, **kw) as m:
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)
            assert torch.equal(m.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0), want_gen)
        assert tiered.stats(m).decoded_bytes > 0
        if kw.get("prefetch") == 1:
            assert tiered.stats(m).piece_units >= 3  # the three layers, stored, in pieces
            assert tiered.stats(m).placement.reader_decoded == {}  # all decoded on the GPU


@pytest.mark.parametrize("group", [1, 3 * (16 << 10)])
def test_exp3_stored_read_carries_the_coded_bytes_and_checks_every_chunk(tmp_path: Path, group: int,
                                                                          monkeypatch) -> None:
    """The reader's side of a CUDA load of exp3 (the stored layout, ``build_plan(stored=True)``): a unit's slot gets
    each coded tensor's chunks byte for byte as the file holds them, read in requests of up to
    ``reader.RAW_READ`` bytes (``group``: one chunk per request, or about three); a chunk corrupted inside a request
    fails its CRC-32 with an error naming the file, tensor, chunk and offset."""
    from tiered import reader as _reader
    from tiered.meta import meta_model_from_dir
    from tiered.plan import build_plan
    from tiered.reader import Reader

    monkeypatch.setattr(_reader, "RAW_READ", group)
    _, d = _exp3_checkpoint(tmp_path)
    model, ckpt = meta_model_from_dir(d), open_checkpoint(d)
    plan = build_plan(model, ckpt, align=512, stored=True)
    u = next(u for u in plan.units if u.name == "model.layers.0")
    assert u.coded_at is not None
    coded = [c for t in u.targets for c in t.copies if c.at is not None and c.decode is None]
    assert coded and max(len(c.src.chunks) for c in coded) >= 4
    slot = torch.full((u.nbytes,), 0x5A, dtype=torch.uint8)
    r = Reader(ckpt, threads=2)
    try:
        r.read_unit(u, slot)
        for c in coded:
            raw = Path(c.src.file).read_bytes()[c.src.offset: c.src.offset + c.src.stored_bytes]
            assert bytes(slot[c.at: c.at + c.src.stored_bytes].numpy()) == raw, c.src.name
    finally:
        r.close()
    # one byte of a middle chunk of the largest tensor flipped on disk
    c = max(coded, key=lambda c: len(c.src.chunks))
    k = c.src.chunks[len(c.src.chunks) // 2]
    at, n = c.src.coded.chunk_span(k)
    path = Path(c.src.file)
    data = bytearray(path.read_bytes())
    data[c.src.offset + at + n // 2] ^= 0x10
    path.write_bytes(bytes(data))
    ckpt = open_checkpoint(d)
    r = Reader(ckpt, threads=2)
    try:
        with pytest.raises(CodecError, match=rf"{path.name}: tensor '{c.src.name}': chunk {k} .*CRC-32"):
            r.read_unit(u, slot)
    finally:
        r.close()


@pytest.mark.parametrize("case", ["ring", "ring-chunk", "no-triton", "distributed"])
def test_exp3_units_the_gpu_decoder_cannot_take_are_laid_out_plain(tmp_path: Path, case: str, monkeypatch) -> None:
    """A CUDA placement keeps a unit stored (its exp3 chunks decoded on the GPU) where that can run, also when it is
    larger than the ring (read in pieces of whole chunks); a unit with a coded chunk larger than a piece, every unit of
    a distributed load (ranks read chunks of the plain layout) and every unit without Triton are laid out plain again
    (decoded on the reader threads, cut into pieces or rank chunks)."""
    from tiered import dist as _dist
    from tiered import placement
    from tiered.machine import Machine
    from tiered.meta import meta_model_from_dir
    from tiered.options import Options
    from tiered.plan import build_plan

    _, d = _exp3_checkpoint(tmp_path)
    model, ckpt = meta_model_from_dir(d), open_checkpoint(d)
    plan = build_plan(model, ckpt, align=512, stored=True)
    stored = {u.name: u.nbytes for u in plan.units if u.coded_at is not None}
    assert {"model.layers.0", "lm_head"} <= set(stored)
    job = None
    ring = 64 << 20
    if case in ("ring", "ring-chunk"):  # with Triton, which CI does not install
        # holds the coded head, not a coded layer: the layers are cut into pieces of whole chunks and stay stored;
        # ring-chunk: a piece's room is below one 16 KiB coded chunk: every unit is laid out plain
        ring = (stored["lm_head"] + stored["model.layers.0"]) // 2 if case == "ring" else 48 << 10
        monkeypatch.setattr(tiered.policy, "MIN_PIECE_BYTES", 4 << 10)
        monkeypatch.setattr(placement, "_triton_here", lambda: True)
    elif case == "no-triton":
        monkeypatch.setattr(placement, "_triton_here", lambda: False)
    else:
        class Job:  # two ranks, as torchrun's job would agree
            shared = _dist.Dist(None, 0, 2, "")

            def min(self, v):
                return v

            def agree(self, v):
                return v

        job = Job()
    opts = Options(device="cuda:0", ring_gb=ring / (1 << 30), gpu_gb=0.0001, distributed=job is not None)
    machine = Machine(64 << 30, "test", 16 << 30, "test", gpu_free=1 << 30)
    placement.place(plan, opts, machine, ckpt_bytes=ckpt.nbytes, config=model.config, job=job)
    left = {u.name for u in plan.units if u.coded_at is not None}
    assert left == (set(stored) if case == "ring" else set())
    assert all(u.nbytes > stored[u.name] for u in plan.units if u.name in stored and u.name not in left)


def test_routed_experts_without_triton_leave_no_unit_for_the_gpu_decoder(tmp_path: Path, monkeypatch) -> None:
    """An exp3 MoE placed for CUDA where Triton is absent: routing the experts out lays their layers out again, and
    those layers too stay plain (decoded on the reader threads), named in ``reader_decoded``; no unit is left stored
    for a GPU decoder the machine lacks."""
    import models

    from tiered import placement
    from tiered.inspection import _plan_for

    src = models.qwen3_moe(tmp_path / "m", dtype=torch.bfloat16)
    d = tmp_path / "x"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "MIN_CODED_BYTES", 1024)
        mp.setattr(lossless, "DEFAULT_CHUNK_BYTES", 4096)
        tiered.reshard(src, d, compress="exp3", quiet=True)
    monkeypatch.setattr(placement, "_triton_here", lambda: False)
    _, ckpt, plan = _plan_for(d, None, "cuda", False)
    layers = {u.name for u in plan.units if u.coded_at is not None and u.name.startswith("model.layers.")}
    assert layers, "the plan stores the coded layers for the GPU decoder"
    pl = placement.place_here(plan, device="cuda", ckpt_bytes=ckpt.nbytes, strict=False,
                              ring_gb=2 * max(u.nbytes for u in plan.units) / 2**30, gpu_gb=1e-4)
    assert pl.routed, "the experts are routed (the model does not fit the GPU budget)"
    assert [u.name for u in plan.units if u.coded_at is not None] == []
    assert layers <= set(pl.reader_decoded) and set(pl.reader_decoded.values()) == {"no Triton here: no GPU decoder"}
    monkeypatch.setattr(placement, "_triton_here", lambda: True)  # with the decoder: the routed experts' reads
    _, ckpt, plan = _plan_for(d, None, "cuda", False)
    pl = placement.place_here(plan, device="cuda", ckpt_bytes=ckpt.nbytes, strict=False,
                              ring_gb=2 * max(u.nbytes for u in plan.units) / 2**30, gpu_gb=1e-4)
    routed = {plan.units[i].name for i in pl.routed}
    assert routed and {n for n, why in pl.reader_decoded.items() if "routed experts" in why} == routed


def _header_spans(f: Path) -> dict[str, tuple[str, int]]:
    """A safetensors file's tensors, from its JSON header alone: name -> (header dtype, bytes of its data section)."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], v["data_offsets"][1] - v["data_offsets"][0]) for k, v in head.items() if k != "__metadata__"}


def test_reshard_and_inspect_print_the_same_compression_ratios(tmp_path: Path) -> None:
    """`tiered reshard --compress` and `tiered inspect` of its output print the same labelled ratios, stored over
    plain bytes over all tensors and over the coded ones only, and both are the files' own: stored bytes from the
    output's headers (a coded tensor is a U8 blob there), plain bytes from the source's."""
    import models

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    src = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "src", seed=25, dtype=torch.bfloat16,
                            max_shard_size="600KB", std=0.02)  # tensors of 64-512 KiB: coded by the default rule
    dst = tmp_path / "z"
    cmd = [sys.executable, "-m", "tiered.cli"]
    r = subprocess.run([*cmd, "reshard", str(src), str(dst), "--compress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    i = subprocess.run([*cmd, "inspect", str(dst)], capture_output=True, text=True, timeout=120)
    assert i.returncode == 0, i.stderr
    pattern = r"stored/plain bytes: all tensors ([0-9.]+), coded tensors ([0-9.]+)"
    said = [re.findall(pattern, out) for out in (r.stdout, i.stdout)]
    assert len(said[0]) == len(said[1]) == 1 and said[0] == said[1], (r.stdout, i.stdout)
    plain = {k: nb for f in src.glob("*.safetensors") for k, (_, nb) in _header_spans(f).items()}
    stored = {k: v for f in dst.glob("*.safetensors") for k, v in _header_spans(f).items()}
    assert set(plain) == set(stored)
    coded = {k for k, (dt, _) in stored.items() if dt == "U8"}
    assert 0 < len(coded) < len(stored)  # some coded, some plain (the embedding read by rows stays plain)
    want_all = sum(nb for _, nb in stored.values()) / sum(plain.values())
    want_coded = sum(stored[k][1] for k in coded) / sum(plain[k] for k in coded)
    assert said[0][0] == (f"{want_all:.3f}", f"{want_coded:.3f}"), (said, want_all, want_coded)
    assert want_coded < want_all < 1  # two different figures: the label matters


def test_the_crc32_in_use_gives_zlibs_checksums() -> None:
    """The chunk checksum (ISA-L's where ``isal`` is installed) is zlib's CRC-32 on every length and buffer kind the
    reader passes (bytes, memoryview, numpy), so checkpoints written with either check with either."""
    import zlib

    rng = np.random.default_rng(7)
    for n in (0, 1, 15, 16, 17, 4095, 1 << 20, (3 << 20) + 5):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        want = zlib.crc32(b.tobytes())
        assert lossless.crc32(b) == want and lossless.crc32(memoryview(b)) == want
        assert lossless.crc32(b.tobytes()) == want


@pytest.mark.parametrize("decoder", CPU_DECODERS)
def test_exp3_out_must_be_writable_contiguous_memory_and_may_sit_at_any_address(decoder: str) -> None:
    """A read-only ``out`` or one ``reshape`` would copy (2-D, not C-contiguous) is a ValueError, never a write into
    an immutable buffer nor a decode into a copy that is thrown away; an ``out`` at an odd address (a ``uint8`` view of
    a slot) gets the input's bits; a chunk of 0 elements with coded bytes is refused."""
    from tiered import expcode

    decode = _cpu_decoder(decoder)
    u = _exp3_inputs()[0][:4096]
    body = expcode.encode_chunk(u)
    frozen = bytes(u.nbytes)
    with pytest.raises(ValueError, match="read-only"):
        decode(body, u.size, np.frombuffer(frozen, np.uint16))
    assert frozen == bytes(u.nbytes)
    with pytest.raises(ValueError, match="C-contiguous"):
        decode(body, u.size, np.zeros((64, 128), np.uint16)[:, :64])
    buf = np.zeros(u.nbytes + 1, np.uint8)
    decode(body, u.size, buf[1:])
    assert np.array_equal(buf[1:].view(np.uint16), u) and buf[0] == 0
    with pytest.raises(CodecError, match="0 elements has 8 bytes"):
        decode(bytes(8), 0, np.empty(0, np.uint16))


def test_exp3_c_decoder_rebuilds_a_damaged_cache_and_leaves_a_library_others_can_load(tmp_path: Path) -> None:
    """A file at the cache path that is not the decoder (garbage left by a crash or another version) is rebuilt, not
    a reason to fall back to numpy for good; the library is readable by the cache's other users (0755 less the
    umask, not mkstemp's 0600); ``CC`` may carry arguments."""
    code = ("import os, stat, warnings, numpy as np, torch\n"
            "warnings.simplefilter('error')\n"
            "from tiered import expcode, native\n"
            "u = (torch.randn(9000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)\n"
            "u = u.view(torch.int16).numpy().view(np.uint16)\n"
            "out = np.empty(u.size, np.uint16)\n"
            "expcode.decode_cpu(expcode.encode_chunk(u), u.size, out)\n"
            "assert np.array_equal(out, u) and native.exp3() is not None, native.why_not\n"
            "(lib,) = list((native.cache_dir() / 'native').glob('*/libtiered_exp3.so'))\n"
            "print(oct(stat.S_IMODE(os.stat(lib).st_mode)), lib)\n")
    env = {**os.environ, "TIERED_CACHE_DIR": str(tmp_path / "cache"), "CC": "cc -O2"}
    env.pop("TIERED_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    if r.returncode != 0 and "no C compiler" in r.stderr:
        pytest.skip("no C compiler here")
    assert r.returncode == 0, r.stderr
    mode, lib = r.stdout.split()
    umask = os.umask(0)
    os.umask(umask)
    assert int(mode, 8) == 0o755 & ~umask
    Path(lib).write_bytes(b"not a library")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert Path(lib).read_bytes()[:4] == b"\x7fELF"


def test_exp3_on_a_checkpoint_without_bf16_says_every_tensor_went_zstd(minilm_dir: Path, tmp_path: Path) -> None:
    """`--compress --codec exp3` on an fp32 checkpoint (no --dtype): nothing is exp3-coded, and the summary says so
    and what to pass, instead of naming exp3 for an output that has none."""
    import tiered

    s = tiered.reshard(minilm_dir, tmp_path / "e", compress="exp3", quiet=True)
    assert s.coded_tensors > 0
    assert any("has none: every coded tensor is bytegroup-zstd1 (pass --dtype bf16" in n for n in s.notes), s.notes
    s = tiered.reshard(minilm_dir, tmp_path / "b", compress="exp3", dtype="bf16", quiet=True)
    assert not any("has none" in n for n in s.notes)
