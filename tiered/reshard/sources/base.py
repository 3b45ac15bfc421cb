"""The :class:`Source` interface: what the converter needs from an input checkpoint, whatever its format.

A source is created by an *opener* (``opener(root, files, index) -> Source``, registered by file
suffix in :data:`tiered.reshard.sources.OPENERS`) that validates the whole input — every header,
index, pickle — before any tensor data is read. The converter then reads only the attributes below
to plan and lay out the output, and asks for bytes one tensor at a time with :meth:`Source.byte_view`.

To add a format: subclass :class:`Source`, call ``super().__init__`` with the attributes, implement
:meth:`~Source.byte_view`, override the optional hooks where the format can do better, and register
its opener by suffix in ``OPENERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ...format import Checkpoint, TensorInfo

__all__ = ["Source", "Opener", "Drop"]

#: ``drop(lo, hi)``: the caller is done with bytes ``[lo, hi)`` of a :meth:`Source.byte_view`; release
#: their pages if the source can (``madvise(MADV_DONTNEED)`` on a file mapping), else do nothing.
Drop = Callable[[int, int], None]


class Source:
    """An input checkpoint: a :class:`~tiered.format.TensorInfo` per tensor, and the bytes of each.

    Attributes (all read by the converter):
        root: the checkpoint's directory; its non-weight files (config, tokenizer) are copied, and its
            ``config.json`` orders the output (unless ``generated_files`` has one).
        kind: the format's name, reported as ``ReshardSummary.input_format`` (``"safetensors"``, ``"torch"``).
        files: the weight files read, in order (never copied into the output).
        infos: tensor name -> :class:`~tiered.format.TensorInfo`, in source order: the checkpoint's own
            names, and the dtype and shape its bytes are written with (``nbytes = numel * itemsize``).
            ``file`` names the file it comes from (messages); ``offset`` may be 0 when unknown.
        keep_dtype: names not cast by ``dtype`` (set by the planner: the model keeps them in float32).
        notes: lines for the summary (what was read differently, what was skipped).
        generated_files: file name -> bytes that the source synthesises into the output directory (a
            GGUF file's ``config.json``). Written with the output, listed in the summary's copied files,
            used for the plan when it holds ``config.json``, and preferred over a file of the same name
            in ``root``. Empty for safetensors and PyTorch checkpoints.

    Required of every source: the attributes above and :meth:`checkpoint`, :meth:`byte_view`,
    :meth:`same_storage`, :meth:`close` (a subclass inherits all but ``byte_view``). Optional hooks,
    used only when present: :meth:`storage_groups`, :meth:`file_range`. A source need not subclass
    this class: the converter relies on nothing else (duck typing).
    """

    def __init__(self, root: Path, kind: str, files: list[Path], infos: dict[str, TensorInfo],
                 notes: list[str] | None = None, generated_files: dict[str, bytes] | None = None) -> None:
        self.root = root
        self.kind = kind
        self.files = files
        self.infos = infos
        self.keep_dtype: set[str] = set()
        self.notes = notes if notes is not None else []
        self.generated_files = generated_files if generated_files is not None else {}

    def checkpoint(self) -> Checkpoint:
        """A :class:`~tiered.format.Checkpoint` view for :func:`~tiered.plan.build_plan` (names, dtypes, shapes)."""
        return Checkpoint(root=self.root, shards=[], tensors=dict(self.infos))

    def byte_view(self, name: str) -> tuple[torch.Tensor, Drop]:
        """(all bytes of tensor ``name`` as a flat uint8 tensor, a :data:`Drop` function for them).

        The converter reads the view front to back in chunks of ``CHUNK_BYTES`` and calls ``drop(lo, hi)``
        after each, so a view of a file mapping costs no more than a chunk of RSS. Memory beyond that
        (a tensor that must be converted to be read) is the source's to bound.
        """
        raise NotImplementedError(f"{type(self).__name__}.byte_view")

    def same_storage(self, a: str, b: str) -> bool:
        """True when tensors ``a`` and ``b`` are one and the same data in the file (tied there)."""
        return False

    def storage_groups(self) -> list[list[str]]:
        """Groups (two names or more, source order) of tensors that share storage in the file; noted in the
        summary when no model says they are tied, since each is then written."""
        return []

    def file_range(self, name: str) -> tuple[int, int] | None:
        """``(fd, offset)`` where the bytes of ``name`` lie verbatim in a file opened read-only, for
        ``copy_file_range`` (no user-space pages); None when they do not (the default)."""
        return None

    def close(self) -> None:
        """Release mappings and file descriptors (the converter calls it once, at the end)."""


#: ``opener(root, files, index) -> Source``: ``root`` is the checkpoint's directory; ``files`` the weight
#: files to read, in order (``[SRC]`` for a single weight file; empty when the format finds its own files
#: in ``root``, as safetensors does through its index); ``index`` the index that names them, or None.
Opener = Callable[[Path, list[Path], Path | None], Source]
