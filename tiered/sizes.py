"""Byte sizes written as text (``"5GB"``, ``"2GiB"``): torch-free, so the command line checks a size before
importing torch (``tiered reshard --max-shard-size``). Re-exported by :mod:`tiered.format`."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number and a unit (case-insensitive): ``"5GB"`` = 5e9 (decimal, as
    transformers' ``max_shard_size``), ``"2GiB"`` = 2 * 2**30, ``"500MB"``, ``"1.5GB"``.

    Raises:
        ValueError: unparsable, or not > 0.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"invalid size {size!r}; use a number and a unit, e.g. 5GB, 500MB, 2GiB")
        f = float(m.group(1)) * _SIZE_UNITS[unit]
        if not f < 2**63:  # (also inf: 400 digits); a size no disk has
            raise ValueError(f"size {size!r} is too large")
        value = int(f)
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {size!r}")
    return value
