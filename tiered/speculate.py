"""Speculative prefetch of the next MoE block's routed experts from the host tier (CUDA; issue 8, capability 4).

Why. A routed experts call (:mod:`tiered.experts`) knows which experts to copy only after its router ran, so the
host waits for the GPU there (the ids), and the copies start after. Whatever the host does between one block's
copies and the next block's router then decides whether the copy engine idles. Measured on the H200
(``benchmarks/sdpa_build_probe.py``, ``benchmarks/moe_lengths.py``, 2026-12-01): SDPA's cuDNN backend builds an
execution graph for every new key length (40-53 ms of host time for one, in a probe), and the build first waits for
the whole device (an 8 GiB H2D queued on another stream delayed it by the copy's full 158 ms). In one long
generation every decode step has a new length, so attention waits for the previous block's expert
copies and then builds with the GPU idle: a Mixtral-shaped routed decode took 0.118-0.149 s/token against 0.084
when the lengths had been seen before (and the resident model 0.080 against 0.017: stock pays it too).

What. When block ``b`` (an experts module whose every expert is in the host tier) is called, the next block's
router weight (``(E, D)``, found beside its experts module; used only if it is on the GPU, i.e. resident) is
applied to block ``b``'s input rows, and its top-``k`` experts — the guess — are handed to this module's one
thread. That thread waits (on the host) until block ``b``'s own experts have been copied, so that a graph build
that began waiting for the device meanwhile does not wait for the guess too, then copies the guessed experts on
its own CUDA stream into a fixed device buffer of ``capacity`` expert slots. When block ``b + 1`` is called, the
experts it routed to that were guessed are copied from that buffer (device to device, after the compute stream
waits for the fill's event) instead of from the host; the others are copied as without it. Published anchor:
pre-gating with the next layer's router on the current hidden state is right for most experts (>80% reported for
Mixtral; ``benchmarks/moe_predict.py`` measured 75% on random weights at Mixtral's shape).

Measured (H200, Mixtral-8x7B shape, 6 layers, bf16, ``host_gb=20``, ``gpu_gb=2``, batch 1; ``benchmarks/moe_lengths.py
--compare-prefetch``, 2026-12-01): **slower**, so ``expert_prefetch`` is off by default. New sequence lengths: 0.147
s/token with it against 0.122 without; lengths seen before: 0.113 against 0.084. 58% of the guessed experts were
used (490 guessed, 285 used), so each token copied about 1.5 GB more than it saved, on a decode bound by the bytes
it copies; and the graph build still left the copy engine mostly idle (the fill, queued once the previous copies
were done, appears to be waited for too). It would pay with a better guess or where the copy engine idles for
other reasons; the mechanism is exact and tested, and kept for that.

Exactness: a guess decides only where bytes come from. The buffer holds the exact host-tier bytes of the experts it
lists, a fill is waited for (event) before they are read, and the next fill waits (host) for every read of the
previous one; a wrong guess costs its copy, never a different output.

Cost: ``capacity x`` (one expert slot's bytes) of device memory, inside ``gpu_gb``; a wrong guess is a wasted H2D
(``Stats.expert_prefetch_bytes`` counts every prefetched byte, ``expert_prefetch_hits`` the experts served).

Threads: the caller's thread computes the guess and serves from the buffer (under :attr:`Speculator.lock`); one
daemon thread per model issues the fills on its own stream and holds no module.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from .expert_cache import slot_view

__all__ = ["Speculator", "find_router"]


def find_router(model: torch.nn.Module, experts_name: str, num_experts: int) -> torch.nn.Parameter | None:
    """The router weight of the MoE block that holds the experts module ``experts_name``: the parameter of shape
    ``(num_experts, D)`` of its parent module, outside the experts module (``gate.weight`` in Mixtral, Qwen2/3-MoE,
    DeepSeek-V2/V3, OLMoE); None if there is not exactly one."""
    parent_name, _, leaf = experts_name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return None
    found = [p for n, p in parent.named_parameters() if not n.startswith(leaf + ".") and p.dim() == 2
             and p.shape[0] == num_experts]
    return found[0] if len(found) == 1 else None


class Speculator:
    """A device buffer of ``capacity`` expert slots of ``slot_bytes`` each, and the thread that fills it.

    Args:
        slot_bytes: the largest expert's bytes (every part, each 512-aligned: ``experts.slot_layout``).
        capacity: experts per guess (the router's top-k at batch 1).
        device: the CUDA device.
        stats: the model's :class:`~tiered.stats.Stats`.

    Raises:
        torch.OutOfMemoryError: the buffer does not fit on the device.
    """

    def __init__(self, slot_bytes: int, capacity: int, device: torch.device, stats: Any) -> None:
        self.slot_bytes = slot_bytes
        self.capacity = capacity
        self.device = device
        self.stats = stats
        self.store = torch.empty((capacity, slot_bytes), dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)
        self.lock = threading.Lock()  # the fields below, between callers; the thread only sets `filled` and `ready`
        self._state = threading.Lock()  # `seq`, `filled`, `ready` and `block` between the callers and the thread
        self.seq = 0  # the number of the latest request; the thread publishes a fill only if it is that one's
        self.block: int | None = None  # which block's guess the buffer holds (or is being filled with)
        self.ids: list[int] = []
        self.filled: torch.cuda.Event | None = None  # recorded on self.stream after the fill; None: the fill failed
        self.ready = threading.Event()  # the fill for `block` was issued (or failed)
        self.ready.set()
        self.reads: list[torch.cuda.Event] = []  # reads of the buffer since the last fill (the next fill waits)
        self.closed = False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tiered-expert-prefetch", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slot_bytes

    # ------------------------------------------------------------------------------ caller's thread

    def guess(self, hidden: torch.Tensor, router: torch.Tensor, k: int) -> torch.Tensor | None:
        """The next block's likely experts for the rows of ``hidden`` (``(..., D)``): top-``k`` of ``hidden @
        router.T``, as a device int64 tensor (queued on the current stream; read it after the call's own sync).
        None when ``router`` is not on the device (its unit is streamed) or the shapes do not match."""
        if router.device != hidden.device or router.shape[-1] != hidden.shape[-1] or router.is_meta:
            return None
        h = hidden.detach().reshape(-1, hidden.shape[-1])
        logits = torch.nn.functional.linear(h.to(router.dtype), router.detach())
        return torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices.reshape(-1)

    def request(self, block: int, ids: list[int], host: list[torch.Tensor], offsets: list[int],
                after: torch.cuda.Event) -> bool:
        """Fill the buffer with experts ``ids`` (distinct) of ``block`` from its host-tier parts ``host`` (each
        ``(E, ...)``, pinned), each part at ``offsets`` in a slot, once ``after`` (recorded after the current call's
        own copies) has completed. False (nothing queued) if there are more than ``capacity`` ids or it is closed."""
        if self.closed or not ids or len(ids) > self.capacity:
            return False
        with self.lock:
            self.ready.wait()  # the previous fill was issued: this one follows it on self.stream
            waits = [after, *self.reads]
            try:
                with self._state:
                    self.seq += 1
                    self.block, self.ids, self.filled = block, list(ids), None
                    self.ready.clear()
                self._q.put((self.seq, list(ids), host, offsets, waits))
                self.reads = []
            except BaseException:  # e.g. Ctrl-C here: no caller may wait for, or serve from, this fill
                with self._state:
                    self.seq += 1  # the fill, if it was queued, is not published
                    self.block = None
                    self.ready.set()
                raise
        return True

    def serve(self, block: int, todo: list[tuple[int, int]], parts: list[Any], offsets: list[int],
              out: list[torch.Tensor]) -> set[int]:
        """For each ``(u, j)`` of ``todo`` whose expert ``j`` the buffer holds for ``block``, copy it into row ``u`` of
        each ``out[p]`` (device to device, on the current stream, after the fill's event); the rows ``u`` served."""
        with self.lock:
            if self.closed or self.block != block:
                return set()
            self.ready.wait()
            if self.filled is None:
                return set()
            where = {j: s for s, j in enumerate(self.ids)}
            rows = [(u, where[j]) for u, j in todo if j in where]
            if not rows:
                return set()
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.filled)
            for u, s in rows:
                for p, off, t in zip(parts, offsets, out, strict=True):
                    t[u].copy_(self._view(s, off, p.slab_shape, p.target.dtype))
            ev = torch.cuda.Event()
            ev.record(stream)
            # the next fill waits for these; without a new fill (no guess at batch > 1) drop the finished ones
            self.reads = [e for e in self.reads if not e.query()] + [ev]
        return {u for u, _ in rows}

    def _view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return slot_view(self.store, slot, offset, shape, dtype)

    # ------------------------------------------------------------------------------ the fill thread

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            seq, ids, host, offsets, waits = item
            filled = None
            try:
                for ev in waits:
                    ev.synchronize()  # the call's own copies are done; the buffer's last readers too
                with torch.cuda.stream(self.stream):
                    for s, j in enumerate(ids):
                        for h, off in zip(host, offsets, strict=True):
                            src = h[j]
                            self._view(s, off, tuple(src.shape), src.dtype).copy_(src, non_blocking=True)
                    filled = torch.cuda.Event()
                    filled.record(self.stream)
                self.stats.add_expert_prefetch(len(ids) * sum(h[0].numel() * h.element_size() for h in host), len(ids))
            except BaseException:  # noqa: BLE001 - a failed guess is no guess: the callers copy from the host
                filled = None
            finally:
                with self._state:
                    if seq == self.seq:  # else a later request (or an interrupted one) owns `filled` and `ready`
                        self.filled = filled
                        self.ready.set()
                del item, host, waits

    def close(self) -> None:
        """Stop the thread, wait for its copies, let go of the buffer (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._q.put(None)
        self._thread.join(timeout=10)
        got = self.lock.acquire(timeout=10)  # a serve still running (close gave up waiting for a forward) ends first
        try:
            torch.cuda.synchronize(self.device)  # the fills and the reads of the buffer are done
        except RuntimeError:  # pragma: no cover - a CUDA error at teardown
            pass
        finally:
            self.store = torch.empty((0, 0), dtype=torch.uint8)
            if got:
                self.lock.release()
