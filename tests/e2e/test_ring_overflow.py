"""A ring overflow end to end, counted in ``lmcache_mp_event_bus_dropped_events_total``.

The cache process's ring is the smallest allowed (1024 cells) and the telemetry process is SIGSTOPped,
so nothing is consumed while a client stores far more than the ring holds.  What was lost is computed
from the ring's cells, not from its drop counter: every record carries its writer's sequence number, which
advances on every record the writer attempts (published or dropped), so the records attempted between two
committed records are the difference of their sequence numbers, and the records committed are the head
cells between them.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from support.service import CHUNK, SMALL, Service
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.contract.events import EventType
from mpcache.shm import layout
from mpcache.shm.ring import read_geometry
from mpcache.shm.segment import Segment

pytestmark = pytest.mark.slow

MODEL = "org/overflow-model"
RING_CELLS = 1024
STORES = 600  # one-chunk stores while nothing is consumed: several cells each, far more than 1024 in all
DROPPED = "lmcache_mp_event_bus_dropped_events_total"
L1_WRITES = "lmcache_mp_l1_write_chunks_total"


def ring_cells(service: Service) -> np.ndarray:
    """A copy of cache[0]'s ring cells (numbered by position: record at counter ``n`` is cell ``n % capacity``)."""
    segment = Segment.attach(service.config().ring_name(0), layout.HEADER_SIZE)
    try:
        geometry = read_geometry(segment)
        view = np.ndarray((geometry.capacity,), dtype=layout.CELL_DTYPE, buffer=segment.buf,
                          offset=geometry.cells_offset)
        cells = view.copy()
        del view
        return cells
    finally:
        segment.close()


def drained(service: Service) -> int:
    """Wait until the telemetry process consumed and released everything in cache[0]'s ring (a scrape makes it
    read on and checkpoint, which releases what it read); returns its head."""
    counters = wait_for(lambda: service.scrape() and (c := service.ring_counters(0)).tail == c.head and c, 30,
                        "the ring to drain")
    return counters.head


def store(client: CacheClient, kv, salt: str, chunk_hash: int) -> int:
    return client.store(kv, request_id=f"{salt}-{chunk_hash}", model_name=MODEL, cache_salt=salt,
                        chunk_hashes=[chunk_hash], block_ids=[0]).stored


def test_overflow_while_telemetry_is_stopped_is_counted_exactly_in_dropped_events(start_service):
    """With telemetry SIGSTOPped, 600 one-chunk stores (every one stored: the ring's state never fails a
    request) overflow the 1024-cell ring.  After telemetry resumes and drains: /metrics's
    ``dropped_events_total`` equals the records lost according to the sequence numbers in the ring's cells
    (and the ring's own drop counter), which is more than zero; and ``l1_write_chunks_total`` for the
    overflow's cache_salt equals what the L1_WRITE_FINISHED records that made it into the ring carried —
    fewer than the 600 chunks stored — while the stores before and after are counted in full."""
    service = start_service("--workers", "1", *SMALL, "--ring-cells", str(RING_CELLS))
    service.ready(1)
    telemetry = service.pids("telemetry")[0]
    with CacheClient(service.socket(0)) as client:
        kv = client.register_buffer(1, CHUNK)
        kv.blocks[:] = 7
        assert 1 == store(client, kv, "before", 1)
        first = drained(service)  # every record up to here is consumed
        before = ring_cells(service)
        os.kill(telemetry, signal.SIGSTOP)
        try:
            stored = sum(store(client, kv, "overflow", 1000 + n) for n in range(STORES))
            frozen = service.ring_counters(0)
            during = ring_cells(service)
        finally:
            os.kill(telemetry, signal.SIGCONT)
        service.scrape()  # wakes the pump now rather than when its sleep ends (up to a second)
        drained(service)
        assert 1 == store(client, kv, "after", 2)  # its first record is committed right after the overflow's
        last = drained(service)
        after = ring_cells(service)
        del kv

    capacity = len(during)
    assert (STORES, first) == (stored, frozen.tail)  # nothing consumed while telemetry was stopped
    assert last - frozen.head <= capacity  # the first record after the overflow was not overwritten since
    window = [during[n % capacity] for n in range(first, frozen.head)]
    heads = [cell for cell in window if cell["kind"] == layout.CELL_HEAD]
    seq_before = int(before[(first - 1) % capacity]["seq"])  # the last record before the stop
    seq_after = int(after[frozen.head % capacity]["seq"])  # the first one after it
    attempted = (seq_after - seq_before - 1) & 0xFFFFFFFF
    lost = attempted - len(heads)
    l1_writes = [cell for cell in heads if cell["etype"] == EventType.L1_WRITE_FINISHED]
    counted_overflow = sum(int(cell["slots"][layout.INLINE_SALT_SLOT + 2]) for cell in l1_writes)

    scrape = wait_for(lambda: (s := service.scrape()).total(L1_WRITES, cache_salt="after") == 1 and s, 30,
                      "the store after the overflow on /metrics")
    assert 0 < lost
    assert capacity - frozen.head + first < 64, "the ring was full when the stores ended"
    # the ring stays full until the pump polls: a record the cache process attempted after `frozen` was read
    # (its 1 Hz eviction tick) may be lost too, and is in `lost` and in the final counter
    assert lost == scrape.total(DROPPED) == service.ring_counters(0).dropped
    assert frozen.dropped <= lost
    assert 0 < counted_overflow < STORES
    assert {"before": 1.0, "overflow": float(counted_overflow), "after": 1.0} == scrape.by_label(
        L1_WRITES, "cache_salt")
    assert 0 == service.stop()
