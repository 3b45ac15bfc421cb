"""The ring allocator: slots never overlap, stay inside the ring, and back-pressure wakes on free."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tiered.errors import RingTooSmallError
from tiered.ring import Ring

PAGE = 4096


def test_random_fifo_and_out_of_order_frees_never_overlap() -> None:
    ring = Ring(64 * PAGE)
    rng = random.Random(0)
    live = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or ring.used > 48 * PAGE):
            # mostly FIFO, sometimes out of order (a discarded prefetch)
            slot = live.pop(0 if rng.random() < 0.8 else rng.randrange(len(live)))
            ring.free(slot)
        else:
            n = rng.randint(1, 16) * PAGE - rng.randint(0, PAGE - 1)
            try:
                slot = ring.alloc(n, wait=False)
            except RingTooSmallError:
                continue
            assert slot.size >= n and slot.start % PAGE == 0 and slot.start + slot.size <= ring.size
            for other in live:
                assert slot.start + slot.size <= other.start or other.start + other.size <= slot.start
            slot.view.fill_(len(live) % 251)  # the view is writable ring memory
            live.append(slot)
        assert ring.used == sum(s.size for s in live) <= ring.size
    assert ring.high_water <= ring.size
    ring.close()


def test_alloc_waits_until_a_free() -> None:
    ring = Ring(8 * PAGE)
    a = ring.alloc(6 * PAGE)
    got = []

    def reader() -> None:
        got.append(ring.alloc(6 * PAGE))  # blocks: only 2 pages are free

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    assert not got
    ring.free(a)
    t.join(timeout=5)
    assert got and got[0].size == 6 * PAGE
    ring.close()


def test_unit_larger_than_ring_names_it() -> None:
    ring = Ring(4 * PAGE)
    with pytest.raises(RingTooSmallError, match="model.layers.7"):
        ring.alloc(5 * PAGE, "model.layers.7")
    ring.close()
