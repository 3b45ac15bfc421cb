"""tiered: run models whose weights are larger than host RAM.

Weights stay in safetensors shards on disk; they are copied through one fixed-size ring of
(pinned) host memory and, on CUDA, to the GPU just before the layer that needs them runs.
Host RSS is bounded by the ring, not by the model.

    model = tiered.load("path/to/model_dir", ring_gb=4)
    print(tiered.stats(model))

Importing this package does no CUDA initialisation, starts no thread and allocates nothing.
"""

from .api import Options, attach, close, load, stats
from .errors import (
    ConfigError,
    DuplicateTensorError,
    HeaderError,
    HostMemoryError,
    MissingTensorError,
    RingTooSmallError,
    ShapeMismatchError,
    ShardChangedError,
    ShardNotFoundError,
    StreamerError,
    TieredError,
    TruncatedShardError,
    UnsupportedDtypeError,
)
from .reshard import (
    DestinationExistsError,
    DiskFullError,
    ReshardError,
    ReshardSummary,
    UnsafePickleError,
    UnsupportedCheckpointError,
    VerifyError,
    reshard,
)
from .stats import Stats

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
    "HostMemoryError",
    "ShardChangedError",
    "UnsupportedDtypeError",
]
