"""The ``TieredError`` family: one subclass per failure mode.

Every message names the file, tensor and byte offset involved where there is one, and
says how to fix the problem. Catch ``TieredError`` to catch them all.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "TieredError",
    "CodecError",
    "HeaderError",
    "TruncatedShardError",
    "ShardNotFoundError",
    "MissingTensorError",
    "ShapeMismatchError",
    "DuplicateTensorError",
    "RingTooSmallError",
    "ConfigError",
    "StreamerError",
    "ShardChangedError",
    "HostMemoryError",
    "UnsupportedDtypeError",
    "StreamedTensorError",
    "QuantizationError",
]


class TieredError(Exception):
    """Base class of every error raised by ``tiered``."""


class HeaderError(TieredError, ValueError):
    """A safetensors header is malformed (bad length, bad JSON, bad offsets, bad dtype)."""


class TruncatedShardError(HeaderError):
    """A shard file is shorter than its safetensors header says (an interrupted download or copy)."""


class ShardNotFoundError(TieredError, FileNotFoundError):
    """A shard named by ``model.safetensors.index.json`` is missing or points outside ``model_dir``."""


class MissingTensorError(TieredError, KeyError):
    """The model has a parameter that no checkpoint tensor provides."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(TieredError, ValueError):
    """A checkpoint tensor's shape differs from the parameter the config builds."""


class DuplicateTensorError(TieredError, ValueError):
    """The same tensor name appears in two shards."""


class RingTooSmallError(TieredError, ValueError):
    """A unit does not fit in the ring (or the ring cannot hold what must be held at once)."""


class ConfigError(TieredError, ValueError):
    """``config.json`` is missing or names an architecture ``transformers`` does not know."""


class StreamerError(TieredError, RuntimeError):
    """A reader or copy thread failed; the original exception is chained as ``__cause__``."""


class ShardChangedError(TieredError, RuntimeError):
    """A shard file was replaced, truncated or rewritten while a model streaming from it was loaded."""


class HostMemoryError(TieredError, MemoryError):
    """The ring (or a host buffer) is larger than the memory this process may still take
    (``MemAvailable`` or a cgroup's ``memory.max``): refused before allocating, instead of an OOM kill."""



class UnsupportedDtypeError(TieredError, TypeError):
    """The model needs a checkpoint tensor whose dtype torch cannot compute with here (``F4``, ``F6_*``, or
    complex data for a real parameter)."""


class CodecError(TieredError, ValueError):
    """Losslessly coded tensor bytes that do not decode to what their table says: corrupted or truncated data, or a
    malformed table (:mod:`tiered.lossless`)."""


class QuantizationError(TieredError, ValueError):
    """A quantized checkpoint tiered cannot load exactly: a ``quantization_config`` method it does not decode, codes
    without their config, or scales that do not fit their codes (:mod:`tiered.quant`)."""


class StreamedTensorError(TieredError, RuntimeError):
    """Model code read or changed the values of a streamed tensor outside the forward that binds it, or asked for what
    a streamed model cannot do as stock does (``.half()``, ``.to(another device)``, ``save_pretrained``): raised
    before anything changes (:mod:`tiered.placeholder`)."""


def caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel that names the first frame outside the ``tiered`` package (the user's call of
    :func:`tiered.load`, however deep inside tiered the warning is raised), counted from the caller of this function."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    f, level = sys._getframe(2), 2  # the function that calls warnings.warn is level 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg):
        f, level = f.f_back, level + 1
    return level
