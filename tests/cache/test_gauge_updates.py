"""CacheContext.update_gauges runs after every operation: it writes L1's and the prefetch gauges where what they
show moved, and writes nothing where nothing did (most operations: a lookup, a poll)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.null_cache import NullPublisher
from mpcache.cache.context import CacheContext
from mpcache.cache.l1 import L1Manager
from mpcache.shm import layout

OBJECT_BYTES = 64
OBJECTS = 8


class RecordedGauges:
    """A gauge slot that keeps every write, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, int]] = []

    def set(self, word: int, value: int) -> None:
        self.writes.append(("set", word, int(value)))

    def add(self, word: int, delta: int) -> None:
        self.writes.append(("add", word, int(delta)))

    def take(self) -> dict[tuple[str, int], int]:
        written = {(how, word): value for how, word, value in self.writes}
        self.writes.clear()
        return written


@pytest.fixture
def context():
    l1 = L1Manager(np.zeros(OBJECTS * OBJECT_BYTES, dtype=np.uint8), NullPublisher(), 1.0, OBJECT_BYTES,
                   policy="adaptive")
    none = None
    return CacheContext(config=none, worker=0, log=none, publisher=none, l1=l1, gauges=RecordedGauges(),
                        storage=none, prefetch=none, sessions=SimpleNamespace(active_jobs=0), l0=none, blend=none,
                        accesses=none)


def test_the_first_call_writes_every_gauge_and_one_that_moves_nothing_writes_none(context):
    context.update_gauges()
    assert {("set", layout.G_L1_USED): 0, ("set", layout.G_L1_FRAGMENTATION): 0, ("set", layout.G_L1_LOST_COPIES): 0,
            ("set", layout.G_L1_ADMITTING): OBJECTS * OBJECT_BYTES, ("set", layout.G_ACTIVE_PREFETCH): 0} == (
        context.gauges.take())
    context.l1.lock_prefix("m", "", [1, 2])  # a lookup that finds nothing
    context.update_gauges()
    assert {} == context.gauges.take()


@pytest.mark.parametrize("change, word, expected", [
    (lambda ctx: ctx.l1.reserve_write("m", "", [1, 2, 3]), ("set", layout.G_L1_USED), 3 * OBJECT_BYTES),
    (lambda ctx: setattr(ctx.sessions, "active_jobs", 2), ("set", layout.G_ACTIVE_PREFETCH), 2),
    (lambda ctx: setattr(ctx.l1, "lost_copies", 1), ("set", layout.G_L1_LOST_COPIES), 1),
    (lambda ctx: setattr(ctx.l1, "refused_chunks", 5), ("add", layout.G_L1_REFUSED), 5),
    (lambda ctx: setattr(ctx.l1.order, "chance", 0.25), ("set", layout.G_L1_ADMITTING), OBJECTS * OBJECT_BYTES // 4),
])
def test_each_thing_a_gauge_shows_is_written_once_it_moves(context, change, word, expected):
    context.update_gauges()
    context.gauges.take()
    change(context)
    context.update_gauges()

    assert expected == context.gauges.take()[word]


def test_a_rewrite_writes_every_gauge_though_nothing_moved(context):
    """The loop's timer rewrites: words the supervisor restored (zeros) or anyone overwrote show the truth again."""
    context.l1.reserve_write("m", "", [1, 2, 3])
    context.update_gauges()
    context.gauges.take()
    context.update_gauges(rewrite=True)

    assert {("set", layout.G_L1_USED): 3 * OBJECT_BYTES, ("set", layout.G_L1_FRAGMENTATION): 0,
            ("set", layout.G_L1_LOST_COPIES): 0, ("set", layout.G_L1_ADMITTING): OBJECT_BYTES * OBJECTS,
            ("set", layout.G_ACTIVE_PREFETCH): 0} == context.gauges.take()
