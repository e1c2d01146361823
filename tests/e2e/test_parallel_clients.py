"""Several clients at once on one cache process.

Six threads, each with its own connection, buffer and cache_salt, run store → lookup_prefetch →
retrieve round trips at the same time.  Every thread uses the same chunk hashes with its own random
bytes, so a server that mixed up salts, connections or buffers would skip stores, return another
thread's bytes or count under the wrong cache_salt.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from mpcache_service import wait_for
from service_control import CHUNK, SMALL

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

MODEL = "org/parallel-model"
CLIENTS = 6
ROUNDS = 15
CHUNKS = 4  # per round
CHUNK_TOKENS = 16  # --chunk-size


def client_rounds(socket_path: str, salt: str, seed: int, start: threading.Barrier) -> dict:
    """ROUNDS verified round trips under ``salt``; returns the counts the server replied."""
    rng = np.random.default_rng(seed)
    counts = {"stored": 0, "found": 0, "retrieved": 0}
    with CacheClient(socket_path) as client:
        kv = client.register_buffer(2 * CHUNKS, CHUNK)
        start.wait(30)
        for n in range(ROUNDS):
            data = rng.integers(0, 256, (CHUNKS, CHUNK), dtype=np.uint8)
            kv.blocks[:CHUNKS] = data
            kv.blocks[CHUNKS:] = 0
            hashes = [(n << 8) | i for i in range(CHUNKS)]  # the same in every thread
            counts["stored"] += client.store(kv, request_id=f"{salt}-s{n}", model_name=MODEL, cache_salt=salt,
                                             chunk_hashes=hashes, block_ids=list(range(CHUNKS))).stored
            job = client.lookup_prefetch(request_id=f"{salt}-r{n}", model_name=MODEL, cache_salt=salt,
                                         chunk_hashes=hashes)
            counts["found"] += client.wait_prefetch(job).found_count
            counts["retrieved"] += client.retrieve(kv, request_id=f"{salt}-r{n}", job_id=job,
                                                   block_ids=list(range(CHUNKS, 2 * CHUNKS))).retrieved
            assert np.array_equal(data, kv.blocks[CHUNKS:]), f"{salt} round {n}: other bytes came back"
            client.end_session(f"{salt}-s{n}")
            client.end_session(f"{salt}-r{n}")
        del kv
    return counts


def test_parallel_clients_each_get_their_own_bytes_and_are_counted_per_salt(controlled_services):
    """All six threads succeed; each stored, found and retrieved 4 chunks per round (60 each) and got its
    own bytes back every time; /metrics counts per cache_salt exactly that: 60 chunks written to L1,
    read from L1 and loaded into client buffers, and 60 × 16 tokens looked up and hit."""
    service = controlled_services("--workers", "1", *SMALL, "--chunk-size", str(CHUNK_TOKENS))
    service.ready(1)
    salts = [f"tenant-{i}" for i in range(CLIENTS)]
    start = threading.Barrier(CLIENTS)
    with ThreadPoolExecutor(CLIENTS) as pool:
        jobs = [pool.submit(client_rounds, service.socket(0), salt, seed, start) for seed, salt in enumerate(salts)]
        results = [job.result(timeout=120) for job in jobs]

    per_client = ROUNDS * CHUNKS
    assert [{"stored": per_client, "found": per_client, "retrieved": per_client}] * CLIENTS == results
    expected = {salt: float(per_client) for salt in salts}
    tokens = {salt: float(per_client * CHUNK_TOKENS) for salt in salts}

    wanted = {"lmcache_mp_l1_write_chunks_total": expected, "lmcache_mp_l1_read_chunks_total": expected,
              "lmcache_mp_num_chunks_loaded_total": expected, "lmcache_mp_lookup_requested_tokens_total": tokens,
              "lmcache_mp_lookup_hit_tokens_total": tokens}

    def counted(scrape) -> dict:
        return {name: scrape.by_label(name, "cache_salt") for name in wanted}

    def all_counted():
        scrape = service.scrape()
        return scrape if counted(scrape) == wanted else None

    try:
        scrape = wait_for(all_counted, 30, "the counts on /metrics")
    except AssertionError:
        assert wanted == counted(service.scrape())
        raise
    assert 0 == scrape.total("lmcache_mp_event_bus_dropped_events_total")
    assert 0 == service.stop()
