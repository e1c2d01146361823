"""A shared-memory segment damaged under a running service — as a same-uid engine sharing the IPC namespace
(the documented container topology) can.  One ``truncate`` of a cache process's event ring kills that cache
process (SIGBUS) and used to stop the whole service (a truncated ring killed the supervisor, every restart
died on the same segment); now the supervisor recreates the segment, counts it, and the service serves on
with that cache process's L1 lost.  A truncate of the L1 pool used to kill the cache process the same way at
its next copy; now the copy is survived and the cache process itself gives the pool its size back."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from support.service import CHUNK, SMALL
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.client.connection import RequestError

pytestmark = pytest.mark.slow


def _store(client: CacheClient, kv, request_id: str) -> int:
    return client.store(kv, request_id=request_id, model_name="m", chunk_hashes=[1, 2], block_ids=[0, 1]).stored


def test_a_truncated_segment_costs_one_cache_processes_l1_not_the_service(start_service) -> None:
    """Truncate worker 0's event ring to 0 bytes and store again: the cache process dies, the supervisor stays
    up, logs ``segment.recreated`` at error naming it, restarts the cache process on a whole segment, and
    ``mpcache_segments_recreated_total{worker="0"}`` is 1; a store then succeeds and SIGTERM exits 0."""
    service = start_service("--workers", "1", *SMALL)
    service.ready(1)
    client = CacheClient(service.socket(0), reconnect_timeout_s=30)
    try:
        kv = client.register_buffer(2, CHUNK)
        kv.blocks[:] = np.random.default_rng(1).integers(0, 256, kv.blocks.shape, dtype=np.uint8)
        assert 2 == _store(client, kv, "before")
        [path] = glob.glob(f"/dev/shm/mpcache.{service.process.pid}.*.events0")
        os.truncate(path, 0)
        with pytest.raises(ConnectionError):  # the cache process dies of SIGBUS under the call
            client.store(kv, request_id="during", model_name="m", chunk_hashes=[3, 4], block_ids=[0, 1])
        [recreated] = wait_for(lambda: service.lines("segment.recreated", worker=0), 30, "segment.recreated")
        assert 2 == wait_for(lambda: _store(client, kv, "after"), 30, "a store on the restarted cache process",
                             tolerate=(ConnectionError,))
    finally:
        client.close()
    assert (path[len("/dev/shm"):], "error", None) == (recreated["segment"], recreated["level"],
                                                       service.process.poll())
    wait_for(lambda: service.scrape().total("mpcache_segments_recreated_total", worker="0") == 1, 30,
             "the recreation counted in /metrics")
    assert 0 == service.stop()


def test_a_copy_from_a_truncated_l1_pool_is_survived_and_the_next_request_answered(start_service) -> None:
    """Store two chunks, look them up (locked), truncate the pool to 0 bytes from this process, then retrieve
    them: the copy reads past the pool's new end, which was a SIGBUS that killed the cache process.  Now the
    retrieve is one error reply, the same cache process (no second ``cache.start``) logs ``segment.recreated``
    at error, counts it in ``mpcache_segments_recreated_total{worker="0"}`` (and the two chunks the copy read
    in ``mpcache_l1_lost_copies_total``), has given the pool its size back,
    has lost its L1 (the chunks are no longer found) and serves the next store and retrieve byte for byte."""
    service = start_service("--workers", "1", *SMALL)
    service.ready(1)
    client = CacheClient(service.socket(0))
    try:
        kv = client.register_buffer(4, CHUNK)
        kv.blocks[:] = np.random.default_rng(3).integers(0, 256, kv.blocks.shape, dtype=np.uint8)
        assert 2 == _store(client, kv, "before")
        job = client.lookup_prefetch(request_id="r", model_name="m", chunk_hashes=[1, 2])
        assert 2 == client.wait_prefetch(job).found_count
        [path] = glob.glob(f"/dev/shm/mpcache.{service.process.pid}.*.l1pool0")
        size = os.stat(path).st_size
        os.truncate(path, 0)
        with pytest.raises(RequestError, match="truncated by another process during the copy"):
            client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3])
        client.end_session("r")
        lost = client.lookup_prefetch(request_id="lost", model_name="m", chunk_hashes=[1, 2])
        kv.blocks[2:] = 0
        stored = client.store(kv, request_id="again", model_name="m", chunk_hashes=[5, 6], block_ids=[0, 1]).stored
        job = client.lookup_prefetch(request_id="r2", model_name="m", chunk_hashes=[5, 6])
        retrieved = client.retrieve(kv, request_id="r2", job_id=job, block_ids=[2, 3]).retrieved
        assert (0, 2, 2, True) == (client.wait_prefetch(lost).found_count, stored, retrieved,
                                   bool(np.array_equal(kv.blocks[:2], kv.blocks[2:])))
    finally:
        client.close()
    # logged after the reply, not before it: waited for, as the other two tests here do
    [recreated] = wait_for(lambda: service.lines("segment.recreated", worker=0), 30, "segment.recreated")
    assert (path[len("/dev/shm"):], "error", "truncated under a copy", size, 1) == (
        recreated["segment"], recreated["level"], recreated["damage"], os.stat(path).st_size,
        len(service.lines("cache.start")))
    wait_for(lambda: [service.scrape().total(name, worker="0") for name in (
        "mpcache_segments_recreated_total", "mpcache_l1_lost_copies_total")] == [1, 2], 30,
             "the recreation and the two chunks the faulted copy read counted in /metrics")
    assert 0 == service.stop()


def test_a_truncated_gauge_board_is_restored_and_the_supervisor_serves_on(start_service) -> None:
    """Truncate the gauge board to 0 bytes: the supervisor, which reads every child's heartbeat from it, used
    to die of SIGBUS within a second (and every cache process of it, restarted onto a 0-byte board).  Now it
    restores the board where it is (its size, its header, its own words; the children's counters are lost),
    logs ``segment.recreated`` at error naming it, and the service serves on: a store succeeds, /metrics
    answers, and SIGTERM exits 0."""
    service = start_service("--workers", "1", *SMALL)
    service.ready(1)
    [path] = glob.glob(f"/dev/shm/mpcache.{service.process.pid}.*.gauges")
    size = os.stat(path).st_size
    client = CacheClient(service.socket(0), reconnect_timeout_s=30)
    try:
        kv = client.register_buffer(2, CHUNK)
        kv.blocks[:] = np.random.default_rng(2).integers(0, 256, kv.blocks.shape, dtype=np.uint8)
        os.truncate(path, 0)
        [recreated] = wait_for(lambda: service.lines("segment.recreated"), 30, "segment.recreated")
        assert 2 == wait_for(lambda: _store(client, kv, "after"), 30, "a store after the board was restored",
                             tolerate=(ConnectionError,))
    finally:
        client.close()
    assert (path[len("/dev/shm"):], "error", None, size) == (recreated["segment"], recreated["level"],
                                                             service.process.poll(), os.stat(path).st_size)
    wait_for(lambda: service.scrape().total("mpcache_cache_processes") == 1, 30, "/metrics served")
    assert 0 == service.stop()
