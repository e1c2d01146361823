"""An L2 outage counted as one: ``bin/start-cache`` with a redis tier where nothing listens, or where a server
accepts connections and never answers.  Every store task and lookup fails; /metrics must say so exactly —
no store task counted as completed, the failure counters equal to what the client did."""

from __future__ import annotations

import json
import secrets

import numpy as np
import pytest
from support.ports import free_port
from support.service import CHUNK, SMALL
from support.silent import silent_listener
from support.waiting import wait_for

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

STORES, CHUNKS_PER_STORE, LOOKUPS, CHUNKS_PER_LOOKUP = 6, 3, 4, 5


def redis_tier(port: int) -> str:
    """A redis tier on ``port`` with short timeouts (a hung server fails an operation in 0.3 s)."""
    return json.dumps({"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "capacity_gb": 0.01,
                       "socket_timeout_s": 0.3, "connect_timeout_s": 0.3})


def drive(socket_path: str) -> list[int]:
    """Store STORES times CHUNKS_PER_STORE new chunks (each store one L2 store task), then look up LOOKUPS
    times CHUNKS_PER_LOOKUP chunks L1 has never seen (each chunk asked of L2); the chunks found."""
    found = []
    with CacheClient(socket_path, connect_timeout_s=5) as client:
        kv = client.register_buffer(CHUNKS_PER_STORE, CHUNK)
        kv.blocks[:] = np.random.default_rng().integers(0, 256, kv.blocks.shape)
        for store in range(STORES):
            hashes = [secrets.randbits(63) for _ in range(CHUNKS_PER_STORE)]
            assert CHUNKS_PER_STORE == client.store(kv, request_id=f"s{store}", model_name="org/outage",
                                                    chunk_hashes=hashes, block_ids=list(range(CHUNKS_PER_STORE))).stored
            client.end_session(f"s{store}")
        for lookup in range(LOOKUPS):
            job = client.lookup_prefetch(request_id=f"l{lookup}", model_name="org/outage",
                                         chunk_hashes=[secrets.randbits(63) for _ in range(CHUNKS_PER_LOOKUP)])
            found.append(client.wait_prefetch(job).found_count)
            client.end_session(f"l{lookup}")
        del kv
    return found


@pytest.mark.parametrize("outage", ["nothing listening", "a server that never answers"])
def test_an_l2_outage_moves_the_failure_counters_and_completes_nothing(start_service, outage) -> None:
    """Every store task fails (6 of 6, 18 chunks) and every lookup asks nothing (20 chunks, lookup_error): the
    store-completed counters stay 0 while the failure counters equal what the client did, per l2_name."""
    with silent_listener() as silent:
        port = free_port() if outage == "nothing listening" else silent
        service = start_service("--workers", "1", *SMALL, "--l2", redis_tier(port))
        service.ready(1)
        found = drive(service.socket(0))

        def settled():
            scrape = service.scrape()
            done = (scrape.total("lmcache_mp_num_inflight_l2_stores") == 0
                    and scrape.total("lmcache_mp_l2_store_submitted_requests_total") == STORES
                    and scrape.total("mpcache_l2_store_failed_requests_total") == STORES)
            return scrape if done else None

        scrape = wait_for(settled, 30, "every L2 store task to end")
        assert 0 == service.stop()

    assert [0] * LOOKUPS == found
    assert {"redis": 0.0} == scrape.by_label("lmcache_mp_l2_store_completed_requests_total", "l2_name")
    assert 0.0 == scrape.total("lmcache_mp_l2_store_completed_objects_chunks_total")
    assert ({"redis": STORES}, {"redis": STORES * CHUNKS_PER_STORE}) == (
        scrape.by_label("mpcache_l2_store_failed_requests_total", "l2_name"),
        scrape.by_label("mpcache_l2_store_failed_chunks_total", "l2_name"))
    assert {"lookup_error": LOOKUPS * CHUNKS_PER_LOOKUP} == scrape.by_label(
        "lmcache_mp_l2_prefetch_failure_chunks_total", "reason")
    assert (0.0, 0.0) == (scrape.total("lmcache_mp_l2_prefetch_hit_chunks_total"),
                          scrape.total("lmcache_mp_l2_load_completed_requests_total"))
