"""The golden record of what ``tiered.attach`` decides (issue 21: the redesign must change none of it).

For every test model builder and a grid of options, load the model and write down, from the objects the load built
(not from a prediction), what went where: per unit resident / host tier / embedding rows / file mapping / ring,
pieces, the host tier's pieces and experts, routed experts, expert-cache slots, device buffer bytes, the ring's size
and the reader's backend — or the error class when the load refuses. The machine facts a decision reads (host
memory available, page-cache room) are pinned per case, so the record does not depend on the machine it is made on.

``tests/golden/placement-cpu.json`` was recorded on the CPU machine and ``placement-cuda.json`` on the H200 (CUDA,
explicit ``gpu_gb``), both at commit 80d9cd1, before the redesign::

    python tests/placement_golden.py --device cpu --out tests/golden/placement-cpu.json
    python tests/placement_golden.py --device cuda --out tests/golden/placement-cuda.json

``tests/test_placement.py`` replays every case and compares. A case whose decisions changed on purpose says so in its
``"changed"`` field (why, and the decisions before): issue 22 item 11 (the CPU ring bounds mapped units) turned 32
CPU cases with a ring below the largest mapped unit into RingTooSmallError; the CPU file was re-recorded then. On
2026-12-07 (issue 23: CPU targets in file order, packed at their file residue modulo 64) the recorded cases were
replayed and their decisions updated in place, each changed one noting the fields before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402

GiB = 1 << 30
PAGE = 4096
HOST_AVAIL = 64 * GiB  # pinned machine facts (bytes); "big": room for the whole checkpoint in the page cache
ROOM_BIG = 16 * GiB

NAMES = [*models.BUILDERS, *models.EXTRA_BUILDERS]


def build(name: str, root: Path) -> Path:
    builder, kwargs = (models.BUILDERS.get(name) or models.EXTRA_BUILDERS[name])[:2]
    return builder(root / name / "model", **kwargs)


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def sizes(d: Path, device: str) -> dict[str, int]:
    """Bytes that size the grid: the largest unit, and the whole model, as units are laid out when experts are
    routed out (so that a ring between them streams)."""
    from conftest import routed_unit_sizes

    from tiered.cli import _plan_for

    _, ckpt, plan = _plan_for(d, None, device)
    out = routed_unit_sizes(plan)
    return {"big": _page(max(out)), "whole": sum(_page(n) for n in out), "ckpt": ckpt.nbytes}


def cases(name: str, d: Path, device: str) -> list[dict[str, Any]]:
    """Option grids: each a dict of ``tiered.load`` keywords plus ``machine`` (pinned facts) and ``world``/``rank``
    (distributed, computed in one process)."""
    s = sizes(d, device)
    big, whole = s["big"], s["whole"]
    ring = max(big, min(3 * big, whole - PAGE)) / GiB  # streams: holds the largest unit, not the whole model
    ring2 = 2 * big / GiB
    host = 0.4 * whole / GiB
    m = {"host_avail": HOST_AVAIL, "page_cache_room": ROOM_BIG}
    small_room = {"host_avail": HOST_AVAIL, "page_cache_room": max(PAGE, s["ckpt"] // 2)}
    if device == "cpu":
        g = [
            {"ring_gb": 1.0},
            {"ring_gb": ring},
            {"ring_gb": ring, "zero_copy": False},
            {"ring_gb": ring, "zero_copy": False, "host_gb": host},
            {"ring_gb": ring, "host_gb": host},
            {"ring_gb": ring, "io": "direct"},
            {"ring_gb": ring, "io": "pread", "zero_copy": False, "host_gb": 2 * host},
            {"ring_gb": ring, "embedding_rows": False, "routed_experts": False, "zero_copy": False},
            {"ring_gb": ring, "io": "auto", "machine": small_room},
            {"ring_gb": ring, "io": "auto", "zero_copy": False},
            {"ring_gb": ring, "expert_cache_gb": 0.0005},
            {"ring_gb": big / 2 / GiB},  # below the largest unit: zero copy / rows / refusal
            {"ring_gb": big / 2 / GiB, "io": "auto", "machine": small_room},
            {"ring_gb": ring, "world": 2, "rank": 0},
            {"ring_gb": ring, "world": 2, "rank": 1},
            {"ring_gb": ring, "world": 3, "rank": 2, "embedding_rows": False},
        ]
    else:
        g = [
            {"ring_gb": 1.0, "gpu_gb": 1.0},
            {"ring_gb": ring, "gpu_gb": 0},
            {"ring_gb": ring, "gpu_gb": 0.3 * whole / GiB},
            {"ring_gb": ring, "gpu_gb": 0.3 * whole / GiB, "prefetch": 1},
            {"ring_gb": ring, "gpu_gb": 0, "host_gb": host},
            {"ring_gb": ring, "gpu_gb": 0.3 * whole / GiB, "host_gb": 2 * host},
            {"ring_gb": ring, "gpu_gb": 0, "embedding_rows": False, "routed_experts": False},
            {"ring_gb": ring, "gpu_gb": 0.6 * whole / GiB, "expert_cache_gb": 0},
            {"ring_gb": ring2 / 4, "gpu_gb": 0},  # below the largest unit: refused (pieces need 2 x 4 MiB)
            {"ring_gb": ring2 / 4, "gpu_gb": 0, "min_piece_bytes": PAGE},  # pieces
            {"ring_gb": ring2 / 4, "gpu_gb": 0, "host_gb": host, "min_piece_bytes": PAGE},  # the host tier's pieces
            {"ring_gb": ring2 / 4, "gpu_gb": 0.3 * whole / GiB, "host_gb": 0.2 * host, "min_piece_bytes": PAGE},
            {"ring_gb": ring, "gpu_gb": 0, "expert_cache_gb": 0.0005},
            {"ring_gb": ring, "gpu_gb": 0.9 * whole / GiB},
            {"ring_gb": ring, "gpu_gb": 0, "io": "auto", "machine": small_room},
            {"ring_gb": ring, "gpu_gb": 0.6 * whole / GiB, "host_gb": 4 * host, "expert_prefetch": True},
        ]
    out = []
    for i, c in enumerate(g):
        c = {"machine": m, **c}
        out.append({"id": f"{name}/{device}/{i}", "model": name, "device": device, **c})
    return out


@contextlib.contextmanager
def pinned(machine: dict[str, int], world: int | None = None, rank: int | None = None, min_piece: int | None = None):
    """The machine facts of a case (host memory available, page-cache room) and, for ``world``, a process's view of a
    distributed job of that many ranks in which every rank agrees (no collective is run: nothing is all-gathered
    while loading with a ring below the model); ``min_piece``: the smallest piece (bytes; the default 4 MiB is larger
    than these models' units)."""
    from unittest import mock

    import tiered.dist as dist
    import tiered.machine as machine_mod
    import tiered.policy as policy

    avail = (machine["host_avail"], "golden")
    room = (machine["page_cache_room"], "golden cgroup")
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(machine_mod, "host_memory_available", lambda: avail))
        st.enter_context(mock.patch.object(machine_mod, "page_cache_room", lambda: room))
        if min_piece is not None:
            st.enter_context(mock.patch.object(policy, "MIN_PIECE_BYTES", min_piece))
        if world is not None:
            fake = dist.Dist(None, rank, world, "gloo")
            st.enter_context(mock.patch.object(dist, "resolve", lambda d, dev: fake if d else dist.SINGLE))
            st.enter_context(mock.patch.object(dist, "min_over_ranks", lambda _d, v: v))
            st.enter_context(mock.patch.object(dist, "from_rank0", lambda _d, v: v))
            st.enter_context(mock.patch.object(dist, "check_same_plan", lambda *a: None))
        yield


def decisions(model: Any) -> dict[str, Any]:
    """What the load built, read from the built objects."""
    import tiered

    h = model._tiered
    st = h.streamer
    s = tiered.stats(model)
    return {
        "units": [u.name for u in h.plan.units],
        "unit_bytes": [u.nbytes for u in h.plan.units],
        "ring_bytes": h.ring.size,
        "io": s.io,
        "resident": sorted(st.resident_ids),
        "host": sorted(st.host_ids),
        "rows": sorted(rg.unit.index for rg in h.rows),
        "mapped": sorted(st.loader.mapped),
        "page_cache_units": s.page_cache_units,
        "pieces": {str(i): len(c) for i, c in sorted(st._cut.items())},
        "host_pieces": {str(i): k for i, k in sorted(st.host_pieces.items())},
        "host_ring_bytes": h.host_ring.size if h.host_ring is not None else 0,
        "routed": [eg.spec.name for eg in h.experts],
        "host_experts": [eg.spec.name for eg in h.experts if eg.host is not None],
        "expert_cache_slots": s.expert_cache_slots,
        "device_buffer_bytes": s.device_buffer_bytes,
        "speculator": False,  # expert_prefetch's speculator: removed (issue 21)
    }


def placed(case: dict[str, Any], d: Path) -> dict[str, Any]:
    """The decisions :func:`tiered.placement.place` makes for ``case`` — pure: no load, no GPU (CUDA cases have an
    explicit ``gpu_gb``) — in the shape of :func:`decisions`."""
    import tiered
    from tiered.format import open_checkpoint
    from tiered.machine import Machine
    from tiered.meta import meta_model_from_dir
    from tiered.options import Options
    from tiered.placement import place
    from tiered.plan import build_plan

    kw = {k: case[k] for k in LOAD_KEYS if k in case}
    world = case.get("world")
    m = case["machine"]
    machine = Machine(m["host_avail"], "golden", m["page_cache_room"], "golden cgroup")
    model = meta_model_from_dir(d)
    ckpt = open_checkpoint(d)
    plan = build_plan(model, ckpt, align=512 if case["device"] == "cuda" else 64)
    opts = Options(device=case["device"], distributed=world is not None, **kw)
    with pinned(case["machine"], world, case.get("rank"), case.get("min_piece_bytes")):
        from tiered import dist

        job = dist.Dist(None, case["rank"], world, "gloo") if world else dist.SINGLE  # its collectives: pinned's
        try:
            p = place(plan, opts, machine, ckpt_bytes=ckpt.nbytes, config=model.config, job=job)
        except tiered.TieredError as e:
            return {"error": type(e).__name__}
    return {
        "units": [u.name for u in plan.units], "unit_bytes": [u.nbytes for u in plan.units],
        "ring_bytes": p.ring_bytes, "io": p.io, "resident": p.resident, "host": p.host, "rows": p.rows,
        "mapped": p.mapped, "page_cache_units": len(p.page_cache),
        "pieces": {str(i): n for i, n in sorted(p.pieces.items())},
        "host_pieces": {str(i): k for i, k in sorted(p.host_pieces.items())},
        "host_ring_bytes": p.host_ring_bytes, "routed": [sp.name for sp in p.specs],
        "host_experts": [p.specs[i].name for i in p.host_experts], "expert_cache_slots": p.expert_cache_slots,
        "device_buffer_bytes": p.device_buffer_bytes, "speculator": False,  # removed (issue 21)
    }


LOAD_KEYS = ("ring_gb", "gpu_gb", "host_gb", "prefetch", "io", "zero_copy", "embedding_rows", "routed_experts",
             "expert_cache_gb", "expert_prefetch")


def run_case(case: dict[str, Any], d: Path) -> dict[str, Any]:
    """Load ``d`` as ``case`` says and return its decisions, or ``{"error": class name}``."""
    import tiered

    kw = {k: case[k] for k in LOAD_KEYS if k in case}
    world = case.get("world")
    if world is not None:
        kw["distributed"] = True
    with pinned(case["machine"], world, case.get("rank"), case.get("min_piece_bytes")), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m = tiered.load(d, device=case["device"], **kw)
        except tiered.TieredError as e:
            return {"error": type(e).__name__}
        try:
            return decisions(m)
        finally:
            m.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        records = []
        for name in NAMES:
            d = build(name, Path(tmp))
            for case in cases(name, d, a.device):
                got = run_case(case, d)
                records.append({"case": case, "decisions": got})
                print(case["id"], got.get("error") or f"ring {got['ring_bytes']} resident {len(got['resident'])}",
                      flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"{len(records)} cases -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
