"""The order policy: which streamed units to load next, learned from what actually ran.

The first guess is the plan order, cyclic (after the last unit comes the first: the next decoding
step). Each time a unit runs, the unit that ran before it records it as its successor, so
encoder–decoder models, early exits and routing are predicted from what they did the last time.
A wrong guess only costs a miss (the unit is loaded on demand); it never changes a result.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["OrderPolicy"]


class OrderPolicy:
    """Successor map over unit indices. Caller thread only.

    Args:
        streamed: indices of the units that stream, in plan order.
    """

    def __init__(self, streamed: list[int]) -> None:
        self.successor = dict(zip(streamed, streamed[1:] + streamed[:1], strict=True))
        self.last: int | None = None

    def record(self, i: int) -> None:
        """Unit ``i`` runs now: it follows the unit that ran before it."""
        if self.last is not None and self.last != i:
            self.successor[self.last] = i
        self.last = i

    def ahead(self, i: int, k: int) -> list[int]:
        """Up to ``k`` distinct units predicted to run after ``i``, nearest first (never ``i`` itself)."""
        out: list[int] = []
        for j in self.after(i):
            if len(out) >= k:
                break
            out.append(j)
        return out

    def after(self, i: int) -> Iterator[int]:
        """The distinct units predicted to run after ``i``, nearest first, lazily (each step O(1): the streamer stops
        when the device pool's bytes are spent)."""
        seen = {i}
        j = self.successor.get(i, i)
        while j not in seen:
            yield j
            seen.add(j)
            j = self.successor.get(j, j)
