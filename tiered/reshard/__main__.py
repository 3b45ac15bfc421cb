"""``python -m tiered.reshard SRC DST ...``: the same command as ``tiered reshard``."""

import sys

from .cli import main

sys.exit(main())
