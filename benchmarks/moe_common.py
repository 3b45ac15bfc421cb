"""What ``moe_predict.py``, ``moe_profile.py`` and ``moe_lengths.py`` share: their parser's frame, the greedy decode
they time, and the streamer that times it.

Imported as ``moe_common`` (each script's own directory is on ``sys.path`` when run as ``python benchmarks/X.py``).
"""

from __future__ import annotations

import argparse
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The script's parser: its docstring as the description (kept as written) and the ``model_dir`` argument."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    return p


def budget_args(p: argparse.ArgumentParser, *, new_tokens: int, host_gb: float) -> None:
    """The load and decode options both timing scripts take: ``--gpu-gb`` (2), ``--ring-gb`` (6), ``--threads`` (4),
    ``--new-tokens`` and ``--host-gb`` (their defaults given)."""
    p.add_argument("--gpu-gb", type=float, default=2.0)
    p.add_argument("--ring-gb", type=float, default=6.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--host-gb", type=float, default=host_gb)


def greedy(model: Any, ids: Any, n: int, streamer: Any = None) -> Any:
    """``model.generate`` of exactly ``n`` greedy new tokens after ``ids`` (no grad; pad id 0), as both scripts run it."""
    import torch

    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer,
                              pad_token_id=0)


class Clock:
    """A ``generate`` streamer that records ``time.perf_counter()`` after each token, once the GPU is done with it
    (``torch.cuda.synchronize``): consecutive differences after the first two are decode seconds per token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        import time

        import torch

        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
