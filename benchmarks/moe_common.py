"""What ``moe_predict.py`` and ``moe_profile.py`` share: their parser's frame and the greedy decode they time.

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


def greedy(model: Any, ids: Any, n: int, streamer: Any = None) -> Any:
    """``model.generate`` of exactly ``n`` greedy new tokens after ``ids`` (no grad; pad id 0), as both scripts run it."""
    import torch

    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer,
                              pad_token_id=0)
