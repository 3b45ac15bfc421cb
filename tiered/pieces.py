"""CUDA, one process: a unit larger than the ring, cut into pieces that go through the ring one after another.

A piece is a byte range ``[lo, hi)`` of the unit's slot layout (:func:`tiered.plan.lay_out`), read into a ring slot of
its own and copied (H2D, copy stream) to its place in the unit's one device buffer
(:class:`tiered.sources.PiecesSource`). Two kinds of unit are cut:

* laid out plain: the layout is cut into ``n`` equal, ``align``-multiple ranges (:func:`tiered.dist.split_unit`, the
  same cut the ranks of a distributed load make); a piece lands at the same offset of the device buffer;
* *stored* (``Unit.coded_at`` set; only whole ``exp3-bf16`` tensors, :func:`tiered.plan.device_coded`, in the coded
  region): the plain region ``[0, coded_at)`` is cut on ``align`` multiples, the coded region only where a coded
  chunk, or a tensor's coded bytes, start, so each piece carries whole chunks as they lie in the file (the reader
  checks each one's CRC-32 and block starts, and decodes nothing). A coded piece lands in the buffer's stored region
  (``dev_bytes + lo - coded_at``: the staging after the decoded layout, :attr:`tiered.plan.Unit.buf_bytes`); after the
  last piece's copy, one :func:`tiered.quant.decode_stored` on the decode stream writes the decoded tensors. So
  PCIe carries the coded bytes of a head larger than the ring too, and the reader threads only read
  (benchmarks/NOTES.md, issue 25: decoded on the readers, a 0.68 GiB coded head held the disk idle 42% of a token).
  Units whose stored region holds float8 codes and scales (:mod:`tiered.quant`) are not cut: they decode whole.

Piece ``k`` of ``n`` of a stored unit is ``[b(k), b(k + 1))``, ``b(k)`` the first legal cut at or after ``k * s``
(``s = align_up(ceil(nbytes / n))``), so a piece exceeds ``s`` by less than the largest distance between two legal
cuts (:func:`count` takes that into account).
"""

from __future__ import annotations

import bisect
import math

from .dist import _align, plain_runs, split_unit
from .hostmem import page_up
from .lossless import window
from .plan import Copy, Target, Unit

__all__ = ["Piece", "cuttable", "count", "cut_all", "slot_bytes", "slot_sizes"]

#: ``(piece, at, nbytes)``: the piece (a :class:`~tiered.plan.Unit` of 1-D targets at offsets from its start, no
#: module), where its ``nbytes`` bytes go in the unit's device buffer (pool buffers: :attr:`Unit.buf_bytes` bytes)
Piece = tuple[Unit, int, int]


def _coded_cuts(u: Unit) -> list[int] | None:
    """A stored unit's legal cuts in ``[coded_at, nbytes]``: where each exp3 tensor's coded bytes and each of its
    chunks start, and the ends. None: the stored region holds codes decoded whole (float8, MXFP4)."""
    assert u.coded_at is not None
    cuts = {u.coded_at, u.nbytes}
    for t in u.targets:
        for c in t.copies:
            if c.at is None:
                continue
            if c.decode is not None:
                return None
            co = c.src.coded
            cuts.update(c.at + co.starts[k] for k in range(co.count()))
            cuts.add(c.at + c.src.stored_bytes)
    return sorted(cuts)


def _plain_ok(u: Unit) -> bool:
    targets = [t for t in u.targets if all(c.at is None for c in t.copies)]
    return plain_runs(targets, 0, 0) is not None


def cuttable(u: Unit) -> bool:
    """Whether ``u`` can be read in pieces: laid out plain, no whole-tensor conversion, no float8 codes decoded whole,
    no stacked source in a non-contiguous slice (:func:`tiered.dist.split_unit`); stored, exp3 tensors only in its
    coded region."""
    if u.coded_at is None:
        return split_unit(u, 0, 2, 64) is not None
    return not u.converts and _coded_cuts(u) is not None and _plain_ok(u)


def _bounds(u: Unit, n: int, align: int, cuts: list[int]) -> list[tuple[int, int]]:
    """The ranges of stored ``u``'s pieces cut for ``n``, in order, none empty: about ``n`` of them — fewer where two
    cuts meet at one legal cut, one more where ``coded_at`` (where a piece's destination changes to the stored
    region) falls inside one."""
    s = _align(max(1, math.ceil(u.nbytes / n)), align)

    def at_or_after(x: int) -> int:
        if x >= u.nbytes:
            return u.nbytes
        if x <= u.coded_at:  # type: ignore[operator]
            return min(u.coded_at, _align(x, align))  # type: ignore[type-var]
        return cuts[bisect.bisect_left(cuts, x)]

    b = sorted({0, u.coded_at, u.nbytes, *(at_or_after(k * s) for k in range(1, n))})  # type: ignore[arg-type]
    return list(zip(b[:-1], b[1:], strict=True))


def _largest_gap(u: Unit, align: int, cuts: list[int]) -> int:
    return max([align] + [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])


def count(u: Unit, room: int, align: int) -> int | None:
    """How many pieces ``u`` is read in so that each piece's slot (page-rounded) is at most ``room`` bytes; None: it
    cannot be cut (:func:`cuttable`), or a stored unit has a chunk (with alignment) larger than ``room``."""
    if u.coded_at is None:
        if split_unit(u, 0, 2, align) is None or room <= align:
            return None
        return math.ceil(u.nbytes / (room - align))
    if not cuttable(u):
        return None
    cuts = _coded_cuts(u)
    assert cuts is not None
    gap = _largest_gap(u, align, cuts)
    if page_up(gap) > room - align:
        return None
    n = max(1, math.ceil(u.nbytes / max(1, room - gap - align)))
    while max(page_up(b - a) for a, b in _bounds(u, n, align, cuts)) > room:  # rare: rounding; a few steps at most
        n += 1
    return n


def slot_bytes(u: Unit, n: int, align: int) -> int:
    """Bytes of the ring (or host-tier) slot the largest of ``u``'s ``n`` pieces takes (page-rounded)."""
    if u.coded_at is None:
        return page_up(_align(max(1, math.ceil(u.nbytes / n)), align))
    cuts = _coded_cuts(u)
    assert cuts is not None
    return max(page_up(b - a) for a, b in _bounds(u, n, align, cuts))


def _stored_piece(u: Unit, lo: int, hi: int) -> Piece:
    """The piece of stored ``u`` that fills slot bytes ``[lo, hi)`` (both legal cuts)."""
    p0 = u.coded_at
    assert p0 is not None
    if hi <= p0:  # the plain region: element runs, landing at the same offsets of the device buffer
        runs = plain_runs([t for t in u.targets if all(c.at is None for c in t.copies)], lo, hi)
        assert runs is not None
        piece = Unit(u.index, u.name, None, runs, nbytes=hi - lo,  # type: ignore[arg-type]
                     src_bytes=sum(r.copies[0].nbytes for r in runs))
        return piece, lo, hi - lo
    runs = []
    for t in u.targets:
        for c in t.copies:
            if c.at is None:
                continue
            co = c.src.coded
            ks = [k for k in range(co.count()) if lo <= c.at + co.starts[k] < hi]
            if not ks:
                continue
            e0, e1 = co.elements(ks[0])[0], co.elements(ks[-1])[1]
            w = window(c.src, e0, e1)  # whole chunks: read as they lie, CRC-checked, not decoded
            runs.append(Target(f"{t.key}[{e0}:{e1}]", None, t.attr, t.is_param, (e1 - e0,), t.dtype,  # type: ignore[arg-type]
                               copies=[Copy(w, at=c.at + co.starts[ks[0]] - lo)], offset=0))
    piece = Unit(u.index, u.name, None, runs, nbytes=hi - lo,  # type: ignore[arg-type]
                 src_bytes=sum(r.copies[0].nbytes for r in runs))
    return piece, u.dev_bytes + lo - p0, hi - lo


def cut_all(u: Unit, n: int, align: int) -> list[Piece]:
    """``u`` read in ``n`` pieces (:func:`count`): its non-empty pieces in layout order — at most ``n`` for a unit laid
    out plain (the layout may end before the last), about ``n`` for a stored one (:func:`_bounds`)."""
    if u.coded_at is None:
        out = []
        for k in range(n):
            got = split_unit(u, k, n, align)
            assert got is not None, f"unit {u.name!r} cannot be cut"
            piece, chunk = got
            if k * chunk < u.nbytes:
                out.append((piece, k * chunk, min(chunk, u.nbytes - k * chunk)))
        return out
    cuts = _coded_cuts(u)
    assert cuts is not None, f"unit {u.name!r} cannot be cut"
    return [_stored_piece(u, lo, hi) for lo, hi in _bounds(u, n, align, cuts)]


def slot_sizes(u: Unit, n: int, align: int) -> list[int]:
    """The ring (or host-tier) slot bytes (page-rounded) of each of ``u``'s non-empty pieces when read in ``n``
    (:func:`cut_all`'s pieces, in order): what holding its first ``k`` pieces in the host tier takes."""
    if u.coded_at is None:
        chunk = _align(max(1, math.ceil(u.nbytes / n)), align)
        return [page_up(chunk) for k in range(n) if k * chunk < u.nbytes]
    cuts = _coded_cuts(u)
    assert cuts is not None
    return [page_up(b - a) for a, b in _bounds(u, n, align, cuts)]
