#!/usr/bin/env python
"""Reshard a checkpoint for streaming, from a checkout: ``python tools/reshard.py SRC DST [options]``.

The same command as ``tiered reshard`` (see ``--help``); the code lives in :mod:`tiered.reshard` (the
command line in :mod:`tiered.reshard.cli`). Exit status: 0 done, 1 error, 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tiered, installed or not

from tiered.reshard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
