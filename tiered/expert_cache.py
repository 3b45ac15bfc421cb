"""A cache of routed experts in device memory, shared by a model's experts modules (issue 8, capability 4).

Routed experts (:mod:`tiered.experts`) read the experts a call's router picked. With room left in the GPU
budget, the experts read are also kept in fixed-size *slots* of one device tensor, and a later call that picks
a cached expert copies it from there (device to device) instead of reading the disk or page cache and copying
it over PCIe. Outputs never depend on the cache: a hit gives the same bytes a read would.

Policy (``"layer"``, the default). A decoder runs its MoE blocks in a fixed cycle, block 0 to ``L - 1``, token
after token. Just after block ``p`` ran, the expert of block ``p`` that was not used is the one needed furthest
ahead (a whole cycle away), so Belady's rule — evict what is needed furthest in the future — says: a full cache
takes an expert of block ``p`` only in place of another expert of block ``p``, and only one that was used less
often (a frequency count per expert); otherwise the new expert is not cached. Free slots are filled first. So
the cache fills with whatever the first tokens route to and then changes only where routing shows a hotter
expert. LRU does the opposite on this cycle: its least recently used entries are the blocks about to run, so
once the cache is smaller than one token's experts (``L x k``) it evicts each expert just before it is needed
and hits almost never (``benchmarks/moe_cache_sim.py``: hit rates of both on the same traces).

``"lru"`` is kept to measure against. Under uniformly random routing (random weights), no policy that does
not predict routing beats ``slots / (L x E)``; the ``"layer"`` policy reaches it, LRU falls below it.

Threads: every method runs under the caller's lock (the model's staging lock on CUDA, which serialises all
experts reads); copies into and out of slots are issued on the caller's current CUDA stream, so a slot is
never overwritten before the copies that read it (stream order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ExpertCache", "POLICIES", "slot_view"]

POLICIES = ("layer", "lru")
#: The policy a loaded model's cache uses (the comparison with ``"lru"``: benchmarks/NOTES.md).
POLICY = "layer"


def slot_view(store: torch.Tensor, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Row ``slot`` of a ``(slots, slot_bytes)`` uint8 ``store``, from byte ``offset``, as a tensor of ``shape`` and
    ``dtype`` (one part of the expert kept there)."""
    n = 1
    for d in shape:
        n *= d
    return store[slot, offset:offset + n * dtype.itemsize].view(dtype).view(shape)


class ExpertCache:
    """``slots`` experts of at most ``slot_bytes`` bytes each, in one ``(slots, slot_bytes)`` uint8 tensor on
    ``device``; keys are ``(block, expert)``: the experts module's position in the forward order and the expert id.

    Args:
        slot_bytes: bytes of the largest expert (all its parts, each aligned to 512 bytes).
        slots: number of experts kept.
        device: where the slots live (CUDA: device memory; the CPU is accepted for tests and ``expert_cache_gb``).
        policy: ``"layer"`` or ``"lru"`` (see the module docstring).

    Raises:
        ValueError: an unknown policy or a negative size.
    """

    def __init__(self, slot_bytes: int, slots: int, device: torch.device, policy: str = "layer") -> None:
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {POLICIES}, got {policy!r}")
        if slot_bytes < 0 or slots < 0:
            raise ValueError(f"expert cache size must be >= 0, got {slots} slots of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.policy = policy
        self.store = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=device)
        self.where: dict[tuple[int, int], int] = {}  # (block, expert) -> slot
        self.key: list[tuple[int, int] | None] = [None] * slots
        self.last: list[int] = [0] * slots  # LRU: the tick of each slot's last use
        self.uses: dict[tuple[int, int], int] = {}  # calls that picked each expert (cached or not)
        self.tick = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def lookup(self, block: int, experts: Sequence[int]) -> list[int | None]:
        """For each expert of ``experts`` (picked by one call of ``block``), its slot or None; counts hits,
        misses and uses."""
        self.tick += 1
        out: list[int | None] = []
        for j in experts:
            k = (block, j)
            self.uses[k] = self.uses.get(k, 0) + 1
            s = self.where.get(k)
            if s is None:
                self.misses += 1
            else:
                self.hits += 1
                self.last[s] = self.tick
            out.append(s)
        return out

    def admit(self, block: int, j: int, keep: set[int] = frozenset()) -> int | None:  # type: ignore[assignment]
        """A slot to store expert ``j`` of ``block`` in, or None to not cache it. ``keep``: slots this call reads
        from (never given away). The slot is emptied (its expert evicted) but not yet ``j``'s: the caller copies
        the expert there, then calls :meth:`commit`; a call cut short between the two leaves the slot free, never
        one that a lookup would serve with the wrong bytes."""
        k = (block, j)
        if k in self.where or not self.slots:
            return None
        free = next((s for s in range(self.slots) if self.key[s] is None), None)
        if free is None:
            cand = [s for s in range(self.slots) if s not in keep]
            if self.policy == "lru":
                free = min(cand, key=lambda s: self.last[s], default=None)
            else:  # "layer": only a less used expert of the same block
                same = [s for s in cand if self.key[s][0] == block]  # type: ignore[index]
                free = min(same, key=lambda s: self.uses.get(self.key[s], 0), default=None)  # type: ignore[arg-type]
                if free is not None and self.uses.get(self.key[free], 0) >= self.uses.get(k, 0):  # type: ignore[arg-type]
                    free = None
            if free is None:
                return None
            del self.where[self.key[free]]  # type: ignore[arg-type]
            self.key[free] = None
        return free

    def commit(self, block: int, j: int, slot: int) -> None:
        """``slot`` (from :meth:`admit`) now holds expert ``j`` of ``block``: later lookups find it."""
        k = (block, j)
        if self.key[slot] is not None or k in self.where:  # pragma: no cover - admit hands out empty slots only
            raise RuntimeError(f"expert cache slot {slot} is not free for {k}")
        self.key[slot] = k
        self.where[k] = slot
        self.last[slot] = self.tick

    def view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The bytes of one part of the expert in ``slot`` at ``offset``, as a tensor of ``shape`` and ``dtype``."""
        return slot_view(self.store, slot, offset, shape, dtype)

    def clear(self) -> None:
        self.where.clear()
        self.key = [None] * self.slots

    def close(self) -> None:
        """Let go of the slots' memory. Idempotent."""
        self.clear()
        self.slots = 0
        self.store = torch.empty((0, 0), dtype=torch.uint8)
