"""LMCache-protocol traffic moves the metrics: ``bin/start-cache --lmcache-ipc`` driven by a hand-framing
client, then /metrics compared with the workload (lookups, hits, L1 writes and reads, chunks loaded,
L0→L1 and L1→L0 throughput samples)."""

from __future__ import annotations

import collections
import mmap
import os
import time

import pytest
from support.lmcache_client import OPS, LMClient, key, registration
from support.waiting import wait_for

from mpcache.cache.lmcache.handlers import OPERATIONS

CHUNK = 256
OBJECT = 2 * 2 * CHUNK * 64 * 2  # 2 layers, hidden 64, fp16: 128 KiB


@pytest.mark.slow
def test_lmcache_traffic_shows_on_metrics(start_service):
    service = start_service("--workers", "1", "--lmcache-ipc", "--chunk-bytes", str(OBJECT), "--l1-size", "16MiB")
    url = "ipc://" + os.path.join(str(service.runtime_dir), "lmcache0.ipc")
    wait_for(lambda: os.path.exists(url[len("ipc://"):]), 30, "the LMCache socket")
    client = LMClient(url)
    sent: collections.Counter[str] = collections.Counter()  # requests per operation, as this client sent them
    round_trips: dict[str, list[float]] = collections.defaultdict(list)  # their round trips, measured here
    call = client.call

    def timed(op: str, *args):
        started = time.monotonic()
        try:
            return call(op, *args)
        finally:
            round_trips[op].append(time.monotonic() - started)
            sent[op] += 1

    client.call = timed
    try:
        pool_info = client.call("register", registration(1))
        fd = os.open(os.path.join("/dev/shm", pool_info["shm_name"]), os.O_RDWR)
        pool = mmap.mmap(fd, pool_info["pool_size"])
        os.close(fd)
        shared = list(range(2 * CHUNK))
        requests = [("cold", shared + list(range(7000, 7000 + CHUNK)), 0),  # 3 chunks, nothing cached
                    ("hit", shared + list(range(7000, 7000 + CHUNK)), 3),  # the same 3 chunks
                    ("partial", shared + list(range(8000, 8000 + CHUNK + 40)), 2)]  # 2 shared, 1 new, a tail
        for request, tokens, hits in requests:
            client.call("lookup", key(tokens, request), 1)
            assert hits == client.call("query_prefetch_status", request)
            worker = key(tokens, request, worker_id=0)
            if hits:
                retrieve = key(tokens, request, worker_id=0, end=hits * CHUNK)
                assert client.call("prepare_retrieve", retrieve, 1)["success"]
                assert client.call("commit_retrieve", retrieve, 1)
            prepared = client.call("prepare_store", worker, 1)
            for slot in prepared["context"]["slots"]:
                pool[slot["offset"] : slot["offset"] + slot["length"]] = b"\x01" * slot["length"]
            if prepared["context"]["slots"]:
                assert client.call("commit_store", worker, 1, b"")
            client.call("end_session", request)
        pool.close()
    finally:
        client.close()
    requested, hit_chunks, written, read = 9 * CHUNK, 5, 4, 5

    # one throughput sample per committed transfer: 3 stores (cold 3, hit 0 is no transfer, partial 1) and 2 loads
    expected = {"lmcache_mp_l1_write_chunks_total": written, "lmcache_mp_lookup_requested_tokens_total": requested,
                "lmcache_mp_lookup_hit_tokens_total": hit_chunks * CHUNK, "lmcache_mp_l1_read_chunks_total": read,
                "lmcache_mp_num_chunks_loaded_total": read, "lmcache_mp_l0_l1_store_throughput_GBs_count": 2,
                "lmcache_mp_l0_l1_load_throughput_GBs_count": 2, "lmcache_mp_event_bus_dropped_events_total": 0}

    def counted() -> dict[str, float]:
        scrape = service.scrape()
        return {name: scrape.total(name) for name in expected}

    # the counters come from different events: wait until all of them are counted, not only the L1 writes
    wait_for(lambda: counted() == expected, 30, f"/metrics to count {expected}")
    assert expected == counted()
    # every request timed server-side, receipt to reply sent: within what the client waited for each
    by_id = {row.wire_id: row.name for row in OPERATIONS.values()}
    names = {op: by_id[OPS[op]] for op in sent}  # the client's short names → the operations' names

    def timed_all():
        scrape = service.scrape()
        counted = [scrape.total("mpcache_lmcache_request_seconds_count", op=name) for name in names.values()]
        return scrape if counted == [sent[op] for op in names] else None

    service_times = wait_for(timed_all, 30, "every request's service time on /metrics")
    for op, name in names.items():
        total = service_times.total("mpcache_lmcache_request_seconds_sum", op=name)
        assert 0 < total <= sum(round_trips[op]), op
        within = [v for labels, v in service_times.samples["mpcache_lmcache_request_seconds_bucket"]
                  if labels["op"] == name and float(labels["le"]) >= max(round_trips[op])]
        assert within and min(within) == sent[op], f"{op}: a service time longer than its slowest round trip"
    assert 0 == service.stop()
