"""tiered: run models whose weights are larger than host RAM.

Weights stay in safetensors shards on disk; they are copied through one fixed-size ring of
(pinned) host memory and, on CUDA, to the GPU just before the layer that needs them runs.
Host RSS is bounded by the ring, not by the model.

    model = tiered.load("path/to/model_dir", ring_gb=4)
    print(tiered.stats(model))

Importing this package does no CUDA initialisation, starts no thread and allocates nothing.
"""

import sys as _sys
import types as _types
from importlib import import_module as _import_module
from typing import Any as _Any

# Torch-free at import (errors, stats, the reshard errors and summary), so `tiered --help` and usage
# errors never import torch; load/attach/close/Options and reshard are imported on first use.
from .errors import (
    CodecError,
    ConfigError,
    DuplicateTensorError,
    HeaderError,
    HostMemoryError,
    MissingTensorError,
    QuantizationError,
    RingTooSmallError,
    ShapeMismatchError,
    ShardChangedError,
    ShardNotFoundError,
    StreamedTensorError,
    StreamerError,
    TieredError,
    TruncatedShardError,
    UnsupportedDtypeError,
)
from .reshard.errors import (
    DestinationExistsError,
    DiskFullError,
    ReshardError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    VerifyError,
)
from .reshard.summary import ReshardSummary
from .stats import Stats

_LAZY = {"load": ".api", "attach": ".api", "close": ".api", "Options": ".options"}


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The names the package has, the lazily imported ones (``load``, ``attach``...) included: ``dir(tiered)`` and
    tab completion list them before their first use."""
    return sorted(set(globals()) | set(_LAZY))


def stats(model: _Any) -> Stats:
    """The :class:`Stats` of a model from :func:`load` or :func:`attach` (see :func:`tiered.api.stats`)."""
    from .api import stats as _stats

    return _stats(model)


class _Package(_types.ModuleType):
    """``tiered.reshard`` is the function :func:`tiered.reshard.reshard`, as it always was, although
    ``tiered.reshard`` is also a subpackage: importing the subpackage (which the import system records as
    an attribute of this package) must not replace the function."""

    @property
    def reshard(self) -> _Any:
        return _import_module(".reshard.convert", __name__).reshard

    @reshard.setter
    def reshard(self, value: _Any) -> None:
        pass  # the import system setting the subpackage: tiered.reshard stays the function


_sys.modules[__name__].__class__ = _Package

__version__ = "0.1.0"

__all__ = [
    "load",
    "attach",
    "stats",
    "close",
    "reshard",
    "ReshardSummary",
    "ReshardError",
    "DestinationExistsError",
    "DiskFullError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "VerifyError",
    "CodecError",
    "Options",
    "Stats",
    "TieredError",
    "HeaderError",
    "TruncatedShardError",
    "ShardNotFoundError",
    "MissingTensorError",
    "ShapeMismatchError",
    "DuplicateTensorError",
    "RingTooSmallError",
    "ConfigError",
    "StreamerError",
    "StreamedTensorError",
    "QuantizationError",
    "HostMemoryError",
    "ShardChangedError",
    "UnsupportedDtypeError",
]
