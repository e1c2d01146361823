"""L1Manager on its own (64-byte chunks, `slots` of them): space, locks, LRU order, eviction, events."""

from __future__ import annotations

import numpy as np
import pytest
from support.ring_events import EventLog

from mpcache.cache.l1 import L1Manager
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import Segment

M, S = "m", "salt-a"


@pytest.fixture
def l1_env(provisioned):
    """Factory: an L1Manager with ``slots`` slots publishing into a real ring, and its EventLog."""
    opened = []

    def make(slots: int = 4, sample_rate: float = 1.0):
        config = provisioned(metrics_sample_rate=sample_rate)
        ring = Segment.attach(config.ring_name(0))
        publisher = Publisher(RingWriter(ring), Interner(ring.buf, read_geometry(ring).intern_capacity))
        l1 = L1Manager(np.zeros(slots * 64, dtype=np.uint8), publisher, sample_rate, 64, policy="lru")
        log = EventLog(config)
        opened.append((ring, log))
        return l1, log

    yield make
    for ring, log in opened:
        log.close()
        ring.close()


def _store(l1: L1Manager, hashes, model=M, salt=S) -> None:
    reservation = l1.reserve_write(model, salt, hashes)
    l1.commit_write(model, salt, [hashes[p] for p in reservation.positions], 64)


def test_allocation_without_free_slot_evicts_least_recently_used(l1_env):
    """With L1 full, a new chunk evicts the least recently used unlocked entry and publishes
    L1_KEYS_EVICTED with that key counted and sampled."""
    l1, log = l1_env(slots=4)
    _store(l1, [1, 2, 3, 4])
    assert 1 == l1.lock_prefix(M, S, [1])
    l1.finish_read(M, S, [1])  # chunk 1 was read: now the most recently used
    log.take()
    _store(l1, [5])
    batch = log.take()
    assert [False, True, True, True, True] == [l1.contains(ChunkKey(M, S, h)) for h in (2, 1, 3, 4, 5)]
    assert {(S, M): 1} == batch.salt_totals([E.L1_KEYS_EVICTED])
    assert [[(2, S, M)]] == [event.sampled for event in batch.events([E.L1_KEYS_EVICTED])]


def test_allocation_fails_when_every_entry_is_read_locked(l1_env):
    """A store into a full L1 whose entries are all read-locked evicts nothing and publishes
    L1_ALLOCATION_FAILED(during=l1_store) for every chunk it could not place."""
    l1, log = l1_env(slots=2)
    _store(l1, [1, 2])
    assert 2 == l1.lock_prefix(M, S, [1, 2])
    log.take()
    reservation = l1.reserve_write(M, S, [7, 8, 9])
    batch = log.take()
    assert (0, 3) == (len(reservation.positions), reservation.failed)
    assert {(S, M): 3} == batch.salt_totals([E.L1_ALLOCATION_FAILED])
    assert ["l1_store"] == [event.fields["during"] for event in batch.events([E.L1_ALLOCATION_FAILED])]
    assert 0 == batch.count([E.L1_KEYS_EVICTED, E.L1_WRITE_RESERVED])


def test_store_larger_than_l1_places_a_prefix_and_fails_the_rest(l1_env):
    """Ten new chunks into a four-slot L1: the first four get slots, the other six fail."""
    l1, log = l1_env(slots=4)
    reservation = l1.reserve_write(M, S, list(range(100, 110)))
    batch = log.take()
    assert ([0, 1, 2, 3], 6) == (reservation.positions, reservation.failed)
    assert {(S, M): 4} == batch.salt_totals([E.L1_WRITE_RESERVED])
    assert {(S, M): 6} == batch.salt_totals([E.L1_ALLOCATION_FAILED])


def test_chunks_already_present_are_not_rewritten_and_not_evicted_by_their_own_store(l1_env):
    """Re-storing a present chunk alongside new ones keeps it (it is pinned while the store
    allocates) and reserves slots only for the new chunks."""
    l1, log = l1_env(slots=2)
    _store(l1, [1, 2])
    log.take()
    reservation = l1.reserve_write(M, S, [1, 3])
    assert ([1], 1, 0) == (reservation.positions, reservation.present, reservation.failed)
    assert (True, False) == (l1.contains(ChunkKey(M, S, 1)), l1.contains(ChunkKey(M, S, 2)))


def test_a_full_l1_stays_full_and_the_tick_evicts_nothing(l1_env):
    """Eviction happens on demand only: the tick of a full L1 evicts nothing and reports the usage it
    measured with watermark 1.0; triggered says whether a store evicted since the previous tick."""
    l1, log = l1_env(slots=4)
    _store(l1, [1, 2, 3, 4])
    log.take()
    assert (1.0, False) == l1.evict_tick()  # filled without evicting
    _store(l1, [5])
    assert (1.0, True) == l1.evict_tick()
    assert (1.0, False) == l1.evict_tick()
    batch = log.take()
    assert 4 == len(l1)
    assert {(S, M): 1} == batch.salt_totals([E.L1_KEYS_EVICTED])
    ticks = [event.fields for event in batch.events([E.L1_EVICTION_LOOP_TICK])]
    assert [{"usage": 1.0, "watermark": 1.0, "triggered": t} for t in (False, True, False)] == ticks


def test_a_store_into_a_full_l1_evicts_one_lru_entry_per_new_chunk_skipping_locked_ones(l1_env):
    """Three new chunks into a full L1 whose oldest entry is read-locked evict exactly the three least
    recently used unlocked entries, no more: L1 stays full."""
    l1, log = l1_env(slots=6)
    _store(l1, [1, 2, 3, 4, 5, 6])
    assert 1 == l1.lock_prefix(M, S, [1])
    log.take()
    reservation = l1.reserve_write(M, S, [7, 8, 9])
    assert ([0, 1, 2], 0) == (reservation.positions, reservation.failed)
    assert {(S, M): 3} == log.take().salt_totals([E.L1_KEYS_EVICTED])
    assert [True, False, False, False, True, True] == [l1.contains(ChunkKey(M, S, h)) for h in range(1, 7)]
    assert (6, 1.0) == (len(l1), l1.usage)


def test_read_of_missing_or_unfinished_chunk_publishes_read_failed(l1_env):
    """read() of chunks that are gone (not_found) or reserved but not committed (write_locked)
    publishes one L1_READ_FAILED per reason, during=l1_retrieve, and returns only the prefix before them."""
    l1, log = l1_env(slots=4)
    _store(l1, [1])
    l1.reserve_write(M, S, [2])  # never committed
    log.take()
    assert [(0, 64)] == l1.read(M, S, [1, 2, 3])
    batch = log.take()
    failed = {(e.fields["during"], e.fields["reason"]): e.salt_counts for e in batch.events([E.L1_READ_FAILED])}
    assert {("l1_retrieve", "not_found"): [(S, M, 1)], ("l1_retrieve", "write_locked"): [(S, M, 1)]} == failed


def test_events_group_keys_by_salt_and_sample_by_the_gate(l1_env):
    """Eviction of mixed keys groups salt_counts per (salt, model); sampled lists only keys whose
    chunk_hash passes the gate (rate 0.5: hash mod 1_000_003 < 500_001)."""
    l1, log = l1_env(slots=3, sample_rate=0.5)
    _store(l1, [10, 900_000], salt="a")
    _store(l1, [20], salt="b")
    log.take()
    assert 3 == l1.clear()
    evicted = log.take().events([E.L1_KEYS_EVICTED])
    assert 1 == len(evicted)
    assert {("a", M, 2), ("b", M, 1)} == set(evicted[0].salt_counts)
    assert {(10, "a", M), (20, "b", M)} == set(evicted[0].sampled)
