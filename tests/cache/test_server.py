"""The cache server in-process (its loop on a thread) driven by the real client over its socket;
every assertion on telemetry reads back the events the server actually published to its ring."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from support.cache_harness import CHUNK_BYTES, CHUNK_TOKENS, MODEL, fill_blocks
from support.waiting import wait_for

from mpcache.client import CacheTimeoutError, PrefetchStatus
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes
from mpcache.errors import RequestError
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.segment import Segment

SALT = "tenant-a"


def _hashes(n: int, seed: int = 0) -> list[int]:
    return chunk_hashes(np.arange(seed, seed + n * CHUNK_TOKENS), CHUNK_TOKENS)


def _mp_fields(batch, etype):
    return [(event.session_id, event.fields) for event in batch.events([etype])]


def test_store_lookup_retrieve_round_trip_is_byte_exact_with_exact_events(cache):
    """Store 3 chunks, look up 4 (3 found), retrieve them into other blocks: the bytes match
    and every event of the path is published once, with per-salt counts of 3 chunks."""
    harness = cache()
    client = harness.client()
    source = client.register_buffer(8, CHUNK_BYTES)
    target = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(source, seed=1)
    hashes = _hashes(4)
    harness.events.take()

    assert 3 == client.store(source, request_id="req-store", model_name=MODEL, cache_salt=SALT,
                             chunk_hashes=hashes[:3], block_ids=[0, 1, 2], engine_id=7).stored
    job = client.lookup_prefetch(request_id="req-load", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    status = client.query_prefetch_status(job)
    assert 3 == client.retrieve(target, request_id="req-load", job_id=job, block_ids=[5, 6, 7], engine_id=7).retrieved
    assert (True, True) == (client.end_session("req-store"), client.end_session("req-load"))
    batch = harness.events.take()

    assert PrefetchStatus(done=True, found_count=3, requested_count=4, hit_tokens=3 * CHUNK_TOKENS,
                          l1_hit_tokens=3 * CHUNK_TOKENS, l2_hit_tokens=0, l2_loaded_count=0,
                          expired=False) == status
    np.testing.assert_array_equal(source.blocks[0:3], target.blocks[5:8])
    keys3 = {(SALT, MODEL): 3}
    for etype in (E.L1_WRITE_RESERVED, E.L1_WRITE_FINISHED, E.SM_WRITE_FINISHED, E.L1_READ_RESERVED,
                  E.L1_READ_FINISHED, E.SM_READ_PREFETCHED_FINISHED):
        assert (etype, keys3) == (etype, batch.salt_totals([etype]))
    assert 0 == batch.count([E.L1_KEYS_EVICTED, E.L1_ALLOCATION_FAILED, E.L1_READ_FAILED, E.TIMEOUT_RAISED])
    once = [E.MP_STORE_SUBMITTED, E.MP_STORE_START, E.MP_STORE_END, E.MP_LOOKUP_PREFETCH_START,
            E.MP_LOOKUP_PREFETCH_END, E.MP_RETRIEVE_SUBMITTED, E.MP_RETRIEVE_START, E.MP_RETRIEVE_END]
    assert [1] * len(once) == [batch.count([etype]) for etype in once]
    assert (2, 2) == (batch.count([E.MP_REQUEST_START]), batch.count([E.MP_REQUEST_END]))
    chunk_bytes_3 = 3 * CHUNK_BYTES
    assert [("req-store", {"device": "cpu", "engine_id": 7, "model_name": MODEL, "stored_count": 3,
                           "total_bytes": chunk_bytes_3, "num_tokens": 3 * CHUNK_TOKENS})] == _mp_fields(batch,
                                                                                                         E.MP_STORE_END)
    assert [("req-load", {"device": "cpu", "engine_id": 7, "model_name": MODEL, "cache_salt": SALT,
                          "retrieved_count": 3, "total_bytes": chunk_bytes_3,
                          "num_tokens": 3 * CHUNK_TOKENS})] == _mp_fields(batch, E.MP_RETRIEVE_END)
    assert [("req-load", {"model_name": MODEL, "cache_salt": SALT, "found_count": 3,
                          "requested_tokens": 4 * CHUNK_TOKENS, "hit_tokens": 3 * CHUNK_TOKENS,
                          "l1_hit_tokens": 3 * CHUNK_TOKENS, "l2_hit_tokens": 0,
                          "early_exit_reason": "", "prompt_tokens": 4 * CHUNK_TOKENS,
                          "request_hit_tokens": 3 * CHUNK_TOKENS, "l1_hit_keys": 3,
                          "l2_hit_keys": 0})] == _mp_fields(batch, E.MP_LOOKUP_PREFETCH_END)
    assert [[0], [0]] == [[e.fields["failed_count"]] for e in batch.events([E.SM_WRITE_FINISHED,
                                                                             E.SM_READ_PREFETCHED_FINISHED])]
    sampled = [(h, SALT, MODEL) for h in hashes[:3]]  # rate 1.0 samples every key
    assert [sampled] * 4 == [e.sampled for e in batch.events([E.L1_WRITE_FINISHED, E.SM_WRITE_FINISHED,
                                                             E.L1_READ_FINISHED, E.SM_READ_PREFETCHED_FINISHED])]


def test_store_publishes_its_events_in_order_with_the_request_id(cache):
    """One store publishes, in this order: MP_REQUEST_START, MP_STORE_SUBMITTED, MP_STORE_START,
    L1_WRITE_RESERVED, MRC_STORE_SAMPLED, L1_WRITE_FINISHED, MP_STORE_END, SM_WRITE_FINISHED; MP_* carry the
    request id."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(2, CHUNK_BYTES)
    harness.events.take()
    client.store(kv, request_id="r-1", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(2), block_ids=[0, 1])
    events = harness.events.take().events()
    assert [E.MP_REQUEST_START, E.MP_STORE_SUBMITTED, E.MP_STORE_START, E.L1_WRITE_RESERVED, E.MRC_STORE_SAMPLED,
            E.L1_WRITE_FINISHED, E.MP_STORE_END, E.SM_WRITE_FINISHED] == [event.etype for event in events]
    assert ["r-1"] * 4 == [e.session_id for e in events if e.etype.name.startswith("MP_")]


def test_counts_are_grouped_per_salt(cache):
    """The same chunk hashes under two salts are two sets of keys: a lookup under one salt finds
    and counts only that salt's chunks."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    hashes = _hashes(2)
    client.store(kv, request_id="s1", model_name=MODEL, cache_salt="a", chunk_hashes=hashes, block_ids=[0, 1])
    client.store(kv, request_id="s2", model_name=MODEL, cache_salt="b", chunk_hashes=hashes[:1], block_ids=[2])
    job = client.lookup_prefetch(request_id="l1", model_name=MODEL, cache_salt="b", chunk_hashes=hashes)
    assert 1 == client.query_prefetch_status(job).found_count
    batch = harness.events.take()
    assert {("a", MODEL): 2, ("b", MODEL): 1} == batch.salt_totals([E.L1_WRITE_FINISHED])
    assert {("b", MODEL): 1} == batch.salt_totals([E.L1_READ_RESERVED])


def test_lookup_prefetch_end_is_published_once_on_first_status_read(cache):
    """MP_LOOKUP_PREFETCH_END appears when the client first reads the job's status, and never again
    for that job, however often it asks."""
    harness = cache()
    client = harness.client()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(3))
    assert 0 == harness.events.take().count([E.MP_LOOKUP_PREFETCH_END])
    for _ in range(3):
        assert 0 == client.query_prefetch_status(job).found_count
    batch = harness.events.take()
    assert [("r", 0, 3 * CHUNK_TOKENS, 0)] == [
        (e.session_id, e.fields["found_count"], e.fields["requested_tokens"], e.fields["hit_tokens"])
        for e in batch.events([E.MP_LOOKUP_PREFETCH_END])
    ]


def test_end_session_releases_unconsumed_read_locks_without_a_read(cache):
    """A prefetch that is never retrieved holds read locks until end_session, which releases them
    without L1_READ_FINISHED, publishes MP_REQUEST_END, and never MP_LOOKUP_PREFETCH_END."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(2, CHUNK_BYTES)
    hashes = _hashes(2)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0, 1])
    client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    l1 = harness.server.l1
    assert [1, 1] == [l1.readers(ChunkKey(MODEL, SALT, h)) for h in hashes]
    harness.events.take()
    assert True is client.end_session("r")
    batch = harness.events.take()
    assert [0, 0] == [l1.readers(ChunkKey(MODEL, SALT, h)) for h in hashes]
    assert ([E.MP_REQUEST_END], ["r"]) == ([e.etype for e in batch.events()], [e.session_id for e in batch.events()])
    assert False is client.end_session("never-seen")


def test_abandoned_prefetch_job_expires_releases_its_locks_and_then_goes(cache):
    """A job unretrieved job_ttl_s after its lookup releases its read locks (active_prefetch_jobs
    drops to 0) and answers status as expired without MP_LOOKUP_PREFETCH_END; one TTL later it is gone."""
    now = [1000.0]
    harness = cache(server_kwargs={"clock": lambda: now[0], "job_ttl_s": 30.0})
    client = harness.client()
    kv = client.register_buffer(1, CHUNK_BYTES)
    hashes = _hashes(1)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    board = harness.board
    assert 1 == board.word(0, layout.G_ACTIVE_PREFETCH)
    now[0] += 30.0
    status = client.query_prefetch_status(job)
    assert (True, 1) == (status.expired, status.found_count)
    assert (0, 0) == (harness.server.l1.readers(ChunkKey(MODEL, SALT, hashes[0])),
                      board.word(0, layout.G_ACTIVE_PREFETCH))
    assert 0 == harness.events.take().count([E.MP_LOOKUP_PREFETCH_END])
    now[0] += 30.0
    with pytest.raises(RequestError, match="unknown or expired prefetch job"):
        client.query_prefetch_status(job)


def test_late_retrieve_of_an_expired_job_reports_chunks_evicted_meanwhile_as_read_failures(cache):
    """After a job expired (locks released) and new stores evicted its chunks, a late retrieve
    copies nothing and publishes L1_READ_FAILED(l1_retrieve, not_found) for the chunks lookup had
    reported present, SM_READ_PREFETCHED_FINISHED with them as failed, and a zero MP_RETRIEVE_END."""
    now = [1000.0]
    harness = cache(server_kwargs={"clock": lambda: now[0], "job_ttl_s": 30.0})
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    hashes = _hashes(2)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0, 1])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    now[0] += 30.0
    client.ping()  # any request runs expiry
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(8, seed=50_000),
                 block_ids=list(range(8)))  # evicts the unlocked two
    harness.events.take()
    assert 0 == client.retrieve(kv, request_id="r", job_id=job, block_ids=[0, 1]).retrieved
    batch = harness.events.take()
    assert [("l1_retrieve", "not_found", [(SALT, MODEL, 2)])] == [
        (e.fields["during"], e.fields["reason"], e.salt_counts) for e in batch.events([E.L1_READ_FAILED])]
    assert [2] == [e.fields["failed_count"] for e in batch.events([E.SM_READ_PREFETCHED_FINISHED])]
    assert [(0, 0)] == [(e.fields["retrieved_count"],
                         e.fields["total_bytes"]) for e in batch.events([E.MP_RETRIEVE_END])]
    assert 0 == batch.count([E.L1_READ_FINISHED])


def test_late_retrieve_of_an_expired_job_copies_chunks_still_in_l1(cache):
    """An expired job whose chunks are still in L1 retrieves them without read locks, byte-exact,
    with L1_READ_FINISHED counting the read."""
    now = [1000.0]
    harness = cache(server_kwargs={"clock": lambda: now[0], "job_ttl_s": 30.0})
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    fill_blocks(kv, seed=5)
    hashes = _hashes(2)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0, 1])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    now[0] += 30.0
    client.ping()
    harness.events.take()
    assert 2 == client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3]).retrieved
    np.testing.assert_array_equal(kv.blocks[0:2], kv.blocks[2:4])
    assert ({(SALT, MODEL): 2}, [0, 0]) == (harness.events.take().salt_totals([E.L1_READ_FINISHED]),
                                            [harness.server.l1.readers(ChunkKey(MODEL, SALT, h)) for h in hashes])


def test_store_beyond_l1_capacity_publishes_allocation_failure(cache):
    """Twelve chunks into an eight-slot L1: eight are stored, four fail; SM_WRITE_FINISHED carries
    failed_count=4 and L1_ALLOCATION_FAILED counts the four."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(12, CHUNK_BYTES)
    harness.events.take()
    assert 8 == client.store(kv, request_id="big", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(12),
                             block_ids=list(range(12))).stored
    batch = harness.events.take()
    assert {(SALT, MODEL): 4} == batch.salt_totals([E.L1_ALLOCATION_FAILED])
    assert ([4], {(SALT, MODEL): 8}) == ([e.fields["failed_count"] for e in batch.events([E.SM_WRITE_FINISHED])],
                                         batch.salt_totals([E.SM_WRITE_FINISHED]))
    assert [8 * CHUNK_BYTES] == [e.fields["total_bytes"] for e in batch.events([E.MP_STORE_END])]


def test_store_into_full_l1_evicts_least_recently_used_chunks(cache):
    """When L1 is full, a new store evicts the least recently used chunks (L1_KEYS_EVICTED) and a
    chunk read in between survives (--l1-policy lru)."""
    harness = cache(l1_policy="lru")
    client = harness.client()
    kv = client.register_buffer(10, CHUNK_BYTES)
    old = _hashes(8)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt=SALT, chunk_hashes=old, block_ids=list(range(8)))
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=old[:1])
    client.retrieve(kv, request_id="r", job_id=job, block_ids=[9])  # chunk 0 is now the most recently used
    harness.events.take()
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(2, seed=10_000),
                 block_ids=[8, 9])
    batch = harness.events.take()
    assert {(SALT, MODEL): 2} == batch.salt_totals([E.L1_KEYS_EVICTED])
    assert [{(old[1], SALT, MODEL),
             (old[2], SALT, MODEL)}] == [set(e.sampled) for e in batch.events([E.L1_KEYS_EVICTED])]
    assert harness.server.l1.contains(ChunkKey(MODEL, SALT, old[0]))


def test_eviction_loop_runs_as_a_timer_and_keeps_gauges_current(cache):
    """With a short eviction interval the loop publishes L1_EVICTION_LOOP_TICK on its own and evicts
    nothing: a full L1 stays full, triggered once a store evicted to make room, and the gauge slot shows
    the bytes used, the capacity and a heartbeat."""
    harness = cache(eviction_interval_s=0.05)
    client = harness.client()
    kv = client.register_buffer(9, CHUNK_BYTES)
    hashes = _hashes(9)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes[:8],
                 block_ids=list(range(8)))
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes[8:], block_ids=[8])
    board = harness.board
    events: list = []

    def triggered_tick() -> bool:
        events.extend(harness.events.take().events([E.L1_EVICTION_LOOP_TICK, E.L1_KEYS_EVICTED]))
        return any(e.etype == E.L1_EVICTION_LOOP_TICK and e.fields["triggered"] for e in events)

    wait_for(triggered_tick, timeout_s=5, what="a tick after the store evicted", tolerate=())
    assert [(SALT, MODEL, 1)] == [c for e in events if e.etype == E.L1_KEYS_EVICTED for c in e.salt_counts]
    wait_for(lambda: board.word(0, layout.G_L1_USED) == 8 * CHUNK_BYTES, timeout_s=5, what="the gauge", tolerate=())
    assert 8 * CHUNK_BYTES == board.word(0, layout.G_L1_CAPACITY)
    assert [0] == board.live_slots()


def test_gauge_words_zeroed_under_a_serving_process_show_its_l1_again_within_an_eviction_interval(cache):
    """The supervisor restores a truncated board in place (zeros): a cache process that writes its gauges only where
    what they show moved still writes them all on its loop's timer, so L1's bytes read right again while it serves
    nothing that moves them."""
    harness = cache(eviction_interval_s=0.05)
    client = harness.client()
    kv = client.register_buffer(3, CHUNK_BYTES)
    hashes = _hashes(3)
    client.store(kv, request_id="z", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0, 1, 2])
    board = harness.board
    wait_for(lambda: board.word(0, layout.G_L1_USED) == 3 * CHUNK_BYTES, timeout_s=5, what="the gauge", tolerate=())
    segment = Segment.attach(harness.config.gauge_board_name())
    try:
        GaugeSlot(segment, 0).set(layout.G_L1_USED, 0)
        client.ping()  # served, and moves nothing
        wait_for(lambda: board.word(0, layout.G_L1_USED) == 3 * CHUNK_BYTES, timeout_s=5, what="the rewritten gauge",
                 tolerate=())
    finally:
        segment.close()


def test_retrieve_timeout_publishes_timeout_raised_and_the_server_keeps_serving(cache):
    """A retrieve whose deadline passes before its copy is done fails with a timeout error reply,
    publishes TIMEOUT_RAISED (class name, message, construction stack) and a zero MP_RETRIEVE_END;
    the job keeps its locks, so a retry without deadline then succeeds."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    fill_blocks(kv, seed=3)
    hashes = _hashes(2)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes, block_ids=[0, 1])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    harness.events.take()
    with pytest.raises(CacheTimeoutError, match="timeout: retrieve: deadline of 0 s passed"):
        client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3], timeout_s=0)
    batch = harness.events.take()
    raised = batch.events([E.TIMEOUT_RAISED])
    assert [("MpcacheTimeoutError", "retrieve: deadline of 0 s passed", "r")] == [
        (e.fields["exception_type"], e.texts["message"], e.session_id) for e in raised]
    assert "in retrieve" in raised[0].texts["stacktrace"]
    assert [(0, 0, 0)] == [(e.fields["retrieved_count"], e.fields["total_bytes"], e.fields["num_tokens"])
                           for e in batch.events([E.MP_RETRIEVE_END])]
    assert 0 == batch.count([E.L1_READ_FINISHED, E.SM_READ_PREFETCHED_FINISHED])
    assert 2 == client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3]).retrieved
    np.testing.assert_array_equal(kv.blocks[0:2], kv.blocks[2:4])


def test_retrieve_of_more_blocks_than_found_is_refused_and_the_job_survives(cache):
    """Asking to retrieve more chunks than the prefetch found is a request error published as
    nothing; the same job then retrieves what it found."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    hashes = _hashes(2)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes[:1], block_ids=[0])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt=SALT, chunk_hashes=hashes)
    harness.events.take()
    with pytest.raises(RequestError, match="found 1 chunks"):
        client.retrieve(kv, request_id="r", job_id=job, block_ids=[1, 2])
    assert 0 == len(harness.events.take())
    assert 1 == client.retrieve(kv, request_id="r", job_id=job, block_ids=[1]).retrieved
    with pytest.raises(RequestError, match="already retrieved"):
        client.retrieve(kv, request_id="r", job_id=job, block_ids=[1])


def test_socket_is_private_to_the_user(cache):
    """The cache socket is created with mode 0600."""
    harness = cache()
    assert 0o600 == stat.S_IMODE(os.stat(harness.config.socket_path(0)).st_mode)


def _mappings_of(name: str) -> int:
    """How many mappings of the memfd ``name`` this process (client and in-process server) holds."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(f"/memfd:{name} (deleted)"))


def test_client_buffer_is_a_private_memfd_mapped_by_both_sides_until_the_client_closes(cache):
    """A registered KV buffer is a 0600 memfd, mapped by the client and by the server; closing the client
    unmaps it on both sides and closes its descriptor."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(2, CHUNK_BYTES)
    mode, mapped = stat.S_IMODE(os.fstat(kv.fd).st_mode), _mappings_of(kv.name)
    client.close()
    assert (0o600, 2, 0, -1) == (mode, mapped, _mappings_of(kv.name), kv.fd)


def test_l1_pool_is_shared_memory_other_processes_can_see(cache):
    """Stored bytes land in the L1 pool segment named by the config (not in private memory)."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(1, CHUNK_BYTES)
    kv.blocks[0] = 0xAB
    client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(1), block_ids=[0])
    pool = Segment.attach(harness.config.l1_pool_name(0))
    try:
        slots = np.frombuffer(pool.buf, dtype=np.uint8).reshape(-1, CHUNK_BYTES)
        assert [True] == [bool((slot == 0xAB).all()) for slot in slots if slot.any()]
        del slots
    finally:
        pool.close()


def test_buffer_used_as_context_manager_is_unregistered_and_removed(cache):
    """Leaving a ``with client.register_buffer(...)`` block detaches the server from the buffer and
    frees it (no mapping of it is left on either side); the client keeps working."""
    harness = cache()
    client = harness.client()
    with client.register_buffer(2, CHUNK_BYTES) as kv:
        assert 1 == client.store(kv, request_id="w", model_name=MODEL, cache_salt=SALT, chunk_hashes=_hashes(1),
                                 block_ids=[0]).stored
    assert 0 == _mappings_of(kv.name)
    with pytest.raises(RequestError, match="unknown buffer"):
        client.call("unregister_buffer", buffer_id=kv.buffer_id)
    kv.close()  # idempotent
    assert 0 == client.ping().worker


def test_client_error_lines_are_rate_limited_and_count_what_they_dropped():
    """At most 10 client-error lines a second are logged; the first line of the next second says how
    many were suppressed."""
    from mpcache.cache.client_errors import ErrorLog as _ErrorLog

    class Recorder:
        def __init__(self):
            self.lines = []

        def warning(self, event, **fields):
            self.lines.append((event, fields.get("suppressed", 0)))

    now = [0.0]
    recorder = Recorder()
    log = _ErrorLog(recorder, per_second=10, clock=lambda: now[0])
    for _ in range(15):
        log("store", "request", "bad")
    now[0] = 1.0
    log("store", "request", "bad")
    assert [("client.error", 0)] * 10 + [("client.error", 5)] == recorder.lines
