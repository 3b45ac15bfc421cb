"""Embedding rows: a streamed embedding reads only the rows its input looks up, never the table.

An ``nn.Embedding`` (or a subclass whose forward goes through ``nn.Embedding.forward``, such as a
scaled embedding) whose weight streams is not a ring unit. On each call (its ``forward`` is wrapped by
:class:`~tiered.guard.CallGuard`), before the module's own forward,

1. takes the ids (the first positional argument, or ``input`` / ``input_ids``), moves them to the CPU
   and computes ``torch.unique(ids, return_inverse=True)``: ``U`` distinct ids, sorted;
2. reads those ``U`` rows from the checkpoint with ``os.preadv`` — one read per run of consecutive
   ids, into one host tensor of shape ``(U, embedding_dim)`` in the checkpoint dtype — casts it to
   the model dtype (``Tensor.to``: the same rounding as casting the table) and copies it to the device;
3. binds that ``(U, D)`` tensor as the module's weight and replaces the ids with their inverse
   indices (``ids.shape``, values in ``[0, U)``), and sets ``padding_idx`` to None for the call
   (it only affects gradients; ``F.embedding`` refuses a ``padding_idx >= U``).

The module's own forward then computes ``F.embedding(inverse, rows)``, which is ``table[ids]`` element
for element: outputs are bitwise equal to the whole table's, in any dtype.

Eligibility is also decided per call: a call whose input is floating point (not ids: Ovis2's visual table
multiplies "soft tokens" by its weight) binds the whole table for that call (:meth:`RowGather.table`, read in
chunks) and leaves the input as it is. Then the ``meta`` placeholder
and ``padding_idx`` are restored, however the call ended.

Bytes read per call: ``U x embedding_dim x itemsize`` (a decode step of batch ``B``: at most ``B`` rows),
counted in ``Stats.embedding_bytes`` and ``Stats.read_bytes``. Reads are plain buffered ``preadv``
(a few KiB each, through the page cache whatever ``io`` is), after the shard's
:meth:`~tiered.reader.ShardMap.check` (a shard replaced or rewritten under the model raises
:class:`~tiered.errors.ShardChangedError`); a short read raises
:class:`~tiered.errors.TruncatedShardError` naming the file, tensor and offset — never SIGBUS.

Not eligible (streamed whole, as before): ``max_norm`` set (the forward renormalises rows in place),
sparse gradients, a weight assembled from several checkpoint tensors, an instance ``forward`` already set (another
library's wrapper, which would see the renumbered ids), or a subclass that overrides
``forward`` without calling ``nn.Embedding.forward`` on its input (detected: the class's ``forward``
must be ``nn.Embedding.forward`` or call ``super().forward``).

Threads: the rows are read and bound on the calling thread, inside the embedding's own call
(:class:`~tiered.guard.CallGuard` wraps its ``forward``): concurrent calls of one embedding are serialised by
its lock, and the placeholder is restored however the call ends (``KeyboardInterrupt`` included).
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .binding import follow_requires_grad
from .errors import TruncatedShardError
from .guard import foreign_forward
from .plan import Unit
from .reader import ShardMap

__all__ = ["RowGather", "row_eligible", "TABLE_CHUNK_BYTES"]

#: A call whose input is not integer ids reads the whole table in chunks of this many bytes (64 MiB).
TABLE_CHUNK_BYTES = 64 << 20


def _calls_embedding_forward(cls: type) -> bool:
    """True when ``cls.forward`` is ``nn.Embedding.forward``, or takes the ids as its first argument and hands
    them to it unchanged (``super().forward(input_ids)``: a scaled embedding). Not OPT's or Bart's positional
    embeddings, whose first argument is a mask or a shape and which compute the ids themselves."""
    for klass in cls.__mro__:
        if klass is nn.Embedding:
            return True
        if "forward" in klass.__dict__:
            fn = klass.__dict__["forward"]
            try:
                src = inspect.getsource(fn)
                params = list(inspect.signature(fn).parameters)
            except (OSError, TypeError, ValueError):
                return False
            return len(params) >= 2 and f"super().forward({params[1]})" in src.replace(" ", "")
    return False


def row_eligible(unit: Unit, *, coded: bool = False) -> bool:
    """True when ``unit`` is one embedding table read from one checkpoint tensor of the same shape (``coded``: also
    when that tensor is losslessly coded, as ``tiered reshard --compress`` of a compressed source asks: it writes the
    table plain, and then it is row-read)."""
    m = unit.module
    if not isinstance(m, nn.Embedding) or len(unit.targets) != 1 or unit.converts or getattr(unit, "readers", None):
        return False
    t = unit.targets[0]
    if t.module is not m or t.attr != "weight" or len(t.copies) != 1 or t.copies[0].place is not None \
            or t.copies[0].decode is not None:
        return False
    src = t.copies[0].src
    if tuple(src.shape) != tuple(t.shape) or len(t.shape) != 2 or src.dtype.is_complex != t.dtype.is_complex:
        return False
    if getattr(src, "coded", None) is not None and not coded:  # losslessly coded (tiered.lossless): read and decoded whole
        return False
    if m.max_norm is not None or m.sparse:
        return False
    if foreign_forward(m):  # another library's wrapper would see the renumbered ids (tiered/guard.py)
        return False
    return _calls_embedding_forward(type(m))


class RowGather:
    """Reads embedding rows on demand for one streamed embedding unit (see the module docstring).

    Args:
        unit: a :func:`row_eligible` unit.
        device: where the rows are used (they are read on the host, then copied).
        stats: the model's :class:`~tiered.stats.Stats` (``embedding_bytes``, ``read_bytes`` are added to).
    """

    def __init__(self, unit: Unit, device: torch.device, stats: Any) -> None:
        self.unit = unit
        self.target = unit.targets[0]
        self.src = self.target.copies[0].src
        self.device = device
        self.stats = stats
        self.rows, self.dim = self.src.shape
        self.row_bytes = self.dim * self.src.dtype.itemsize
        # the shard, opened once: its fd for preadv, its check() before each read (a file truncated, replaced or
        # rewritten under the model is an error, as for every other unit)
        self.shard = ShardMap(self.src.file, sequential=False)
        self.lock = threading.Lock()  # held for each call by its CallGuard
        self.placeholder = unit.module._parameters["weight"]
        self.padding_idx = unit.module.padding_idx
        self.closed = False

    # ----------------------------------------------------------------------------------- reading

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D int64, sorted, distinct, in range) as a ``(len(ids), D)`` tensor, checkpoint dtype.

        Raises:
            TruncatedShardError: the file ends before a row (names file, tensor and offset).
        """
        n = ids.numel()
        out = torch.empty((n, self.dim), dtype=self.src.dtype)
        if n == 0 or self.dim == 0:
            return out
        self.shard.check()
        fd = self.shard.fd
        buf = out.view(-1).view(torch.uint8).numpy()
        idx = ids.tolist()
        i = 0
        while i < n:  # one read per run of consecutive ids
            j = i + 1
            while j < n and idx[j] == idx[j - 1] + 1:
                j += 1
            off = self.src.offset + idx[i] * self.row_bytes
            want = (j - i) * self.row_bytes
            view = memoryview(buf)[i * self.row_bytes:j * self.row_bytes]
            got = 0
            while got < want:
                try:
                    k = os.preadv(fd, [view[got:]], off + got)
                except OSError:
                    if self.closed:
                        from .errors import StreamerError

                        raise StreamerError("this model was closed while its embedding was reading rows; "
                                            "load it again") from None
                    raise
                if k <= 0:
                    raise TruncatedShardError(
                        f"{self.src.file}: tensor {self.src.name!r} row {idx[i] + got // self.row_bytes} at offset "
                        f"{off + got} is past the end of the file ({os.fstat(fd).st_size} bytes): the shard "
                        "is truncated; re-download or re-convert it")
                got += k
            i = j
        self.stats.add_rows(n * self.row_bytes)
        return out

    def table(self) -> torch.Tensor:
        """The whole table, ``(rows, D)`` in the model dtype on the device, read in chunks of at most
        :data:`TABLE_CHUNK_BYTES` (host memory beyond the table: one chunk; on the CPU the table itself is host
        memory for the call). For a call whose input is not ids (decided per call, see :meth:`bind`)."""
        out = torch.empty((self.rows, self.dim), dtype=self.target.dtype, device=self.device)
        step = max(1, TABLE_CHUNK_BYTES // max(1, self.row_bytes))
        for a in range(0, self.rows, step):
            b = min(self.rows, a + step)
            out[a:b].copy_(self.read(torch.arange(a, b)).to(self.target.dtype))
        return out

    # ----------------------------------------------------------------------------------- the call

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Read the rows ``ids`` look up, bind them as the weight and renumber ``ids`` (``CallGuard``: the
        embedding's lock is held and :meth:`restore` follows whatever happens)."""
        module = self.unit.module
        if self.closed:
            from .errors import StreamerError

            raise StreamerError("this model was closed (tiered.close / end of its with-block); load it again")
        if args:
            ids, where = args[0], ("args", 0)
        else:
            key = "input" if "input" in kwargs else "input_ids"
            ids, where = kwargs.get(key), ("kwargs", key)
        if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex()):
            # not ids: a forward that computes with the table itself (Ovis2's visual table multiplies soft tokens by
            # it): the whole table for this call, the input untouched
            module._parameters["weight"] = follow_requires_grad(nn.Parameter(self.table(), requires_grad=False),
                                                                self.placeholder)
            return args, kwargs
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            # stock's own error for these ids (F.embedding's: a RuntimeError naming the dtypes it takes, or a
            # TypeError for a non-tensor), raised by the same check on a one-element table
            F.embedding(ids, torch.zeros((1, 1), dtype=self.target.dtype))
            raise TypeError(f"{type(module).__name__}: expected integer ids (LongTensor/IntTensor), got "
                            f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else ids.dtype}")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        uniq, inv = torch.unique(flat, sorted=True, return_inverse=True)
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.rows):
            bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
            raise IndexError(f"index {bad} is out of range for {self.unit.name!r} ({self.rows} rows)")
        rows = self.read(uniq).to(self.target.dtype)
        if self.device.type != "cpu":
            rows = rows.pin_memory().to(self.device, non_blocking=False) if rows.numel() else rows.to(self.device)
        module._parameters["weight"] = follow_requires_grad(nn.Parameter(rows, requires_grad=False), self.placeholder)
        module.padding_idx = None
        new_ids = inv.reshape(ids.shape).to(ids.device)
        if where[0] == "args":
            args = (new_ids, *args[1:])
        else:
            kwargs = {**kwargs, where[1]: new_ids}
        return args, kwargs

    def restore(self) -> None:
        """Put the placeholder weight and ``padding_idx`` back (idempotent; ``CallGuard`` calls it after every call)."""
        self.unit.module._parameters["weight"] = self.placeholder
        self.unit.module.padding_idx = self.padding_idx

    def close(self) -> None:
        """Idempotent: later calls of the embedding raise StreamerError."""
        self.closed = True
        self.shard.close()
