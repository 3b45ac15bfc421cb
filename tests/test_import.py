"""Import is cheap and has no side effects: no CUDA initialisation, no threads, no transformers."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys, threading, torch
before = threading.active_count()
import tiered
assert not torch.cuda.is_initialized(), "import tiered initialised CUDA"
assert threading.active_count() == before, "import tiered started a thread"
assert "transformers" not in sys.modules, "import tiered imported transformers"
assert {"load", "attach", "close", "Options"} <= set(dir(tiered)), "dir(tiered) misses the lazy names"
assert "transformers" not in sys.modules, "dir(tiered) imported transformers"
assert callable(tiered.load) and callable(tiered.reshard)
print("ok")
"""


def test_import_has_no_side_effects() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
