"""The errors of ``tiered reshard``: one :class:`ReshardError` subclass per way it can refuse or fail.

Each is a :class:`~tiered.errors.TieredError`; whichever is raised, nothing of ``DST`` is left behind.
"""

from __future__ import annotations

from ..errors import TieredError

__all__ = [
    "ReshardError",
    "DestinationExistsError",
    "DiskFullError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "VerifyError",
]


class ReshardError(TieredError):
    """The converter could not produce ``DST`` (nothing of ``DST`` is left behind)."""


class DestinationExistsError(ReshardError, FileExistsError):
    """``DST`` exists (pass ``force=True`` / ``--force`` to replace it)."""


class DiskFullError(ReshardError, OSError):
    """The disk filled up (ENOSPC/EDQUOT) while writing; the partial output was removed."""


class UnsafePickleError(ReshardError, ValueError):
    """A PyTorch file needs pickle beyond plain tensors: ``torch.load(weights_only=True)`` refused it."""


class UnsupportedCheckpointError(ReshardError, ValueError):
    """A PyTorch file that loads safely but is not a mapping of names to plain tensors, or is unreadable."""


class VerifyError(ReshardError):
    """A tensor re-read from ``DST`` does not hash like the bytes that were written."""
