"""A shared-memory segment damaged under a running service — as a same-uid engine sharing the IPC namespace
(the documented container topology) can: one ``truncate`` of a cache process's L1 pool or event ring kills
that cache process (SIGBUS), and used to stop the whole service (every restart died on the same 0-byte
pool; a truncated ring killed the supervisor).  Now the supervisor recreates the segment, counts it, and the
service serves on with that cache process's L1 lost."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from support.service import CHUNK, SMALL
from support.waiting import wait_for

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow


def _store(client: CacheClient, kv, request_id: str) -> int:
    return client.store(kv, request_id=request_id, model_name="m", chunk_hashes=[1, 2], block_ids=[0, 1]).stored


@pytest.mark.parametrize("segment", ["l1pool", "events"])
def test_a_truncated_segment_costs_one_cache_processes_l1_not_the_service(start_service, segment) -> None:
    """Truncate worker 0's segment to 0 bytes and store again: the cache process dies, the supervisor stays
    up, logs ``segment.recreated`` at error naming it, restarts the cache process on a whole segment, and
    ``mpcache_segments_recreated_total{worker="0"}`` is 1; a store then succeeds and SIGTERM exits 0."""
    service = start_service("--workers", "1", *SMALL)
    service.ready(1)
    client = CacheClient(service.socket(0), reconnect_timeout_s=30)
    try:
        kv = client.register_buffer(2, CHUNK)
        kv.blocks[:] = np.random.default_rng(1).integers(0, 256, kv.blocks.shape, dtype=np.uint8)
        assert 2 == _store(client, kv, "before")
        [path] = glob.glob(f"/dev/shm/mpcache.{service.process.pid}.*.{segment}0")
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
