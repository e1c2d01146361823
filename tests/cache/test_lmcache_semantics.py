"""LMCache engine_driven semantics, byte for byte through the shared-memory pool (no LMCache, no torch):
bytes written into prepared slots come back from another request's slots, hits need every KV rank,
read locks are counted per reader and released exactly, abandoned transfers give their slots back."""

from __future__ import annotations

import mmap
import os

import pytest
from support.lmcache_client import NO_RESULT, LMClient, key, read_slots, registration, write_slots
from support.waiting import wait_for

from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes

CHUNK = 256
LAYERS, HIDDEN = 2, 64
OBJECT = 2 * LAYERS * CHUNK * HIDDEN * 2  # fp16
MODEL = "org/model"


@pytest.fixture
def served(cache):
    """An in-process cache process serving LMCache's protocol, its client, and the pool mapped as a worker maps it."""
    harness = cache(chunk_size_tokens=CHUNK, chunk_bytes=OBJECT, l1_size_bytes=16 * OBJECT, lmcache_ipc=True,
                    prefetch_job_ttl_s=0.3)
    client = LMClient(harness.config.lmcache_urls(0)[0])
    reply = client.call("register", registration(1, layers=LAYERS, hidden=HIDDEN))
    fd = os.open(os.path.join("/dev/shm", reply["shm_name"]), os.O_RDWR)
    pool = mmap.mmap(fd, reply["pool_size"])
    os.close(fd)
    yield harness, client, pool
    client.close()
    pool.close()


def _store(client: LMClient, pool: mmap.mmap, tokens: list[int], request: str, *, seed: int, worker: int = 0,
           world_size: int = 1, instance: int = 1, salt: str = "") -> list[bytes]:
    stored = key(tokens, request, worker_id=worker, world_size=world_size, salt=salt)
    prepared = client.call("prepare_store", stored, instance)
    written = write_slots(pool, prepared["context"]["slots"], seed)
    assert True is client.call("commit_store", stored, instance, b"")
    return written


def _locks(harness, tokens: list[int], world_size: int = 1, salt: str = "") -> list[int]:
    keys = rank_hashes(chunk_hashes(tokens, CHUNK), world_size, list(range(world_size)))
    return [harness.server.l1.readers(ChunkKey(MODEL, salt, k)) for k in keys]


def test_bytes_stored_through_slots_come_back_through_another_requests_slots(served):
    """prepare_store names slots, the worker fills them, commit_store publishes them; a later request's
    lookup hits and prepare_retrieve points at exactly those bytes."""
    harness, client, pool = served
    tokens = list(range(3 * CHUNK + 17))  # a trailing partial chunk is never stored
    client.call("lookup", key(tokens, "a"), 1)
    assert 0 == client.call("query_prefetch_status", "a")
    written = _store(client, pool, tokens, "a", seed=1)
    assert 3 == len(written)
    client.call("end_session", "a")
    client.call("lookup", key(tokens, "b"), 1)
    assert 3 == client.call("query_prefetch_status", "b")
    retrieved = client.call("prepare_retrieve", key(tokens, "b", worker_id=0), 1)
    assert written == read_slots(pool, retrieved["context"]["slots"])
    assert True is client.call("commit_retrieve", key(tokens, "b", worker_id=0), 1)
    assert [0, 0, 0] == _locks(harness, tokens)
    batch = harness.events.take()
    assert [(3, 3 * OBJECT)] == [(e.fields["stored_count"], e.fields["total_bytes"])
                                 for e in batch.events([E.MP_STORE_END])]
    assert [3] == [e.fields["retrieved_count"] for e in batch.events([E.MP_RETRIEVE_END])]


def test_a_hit_needs_every_kv_rank_and_each_rank_reads_its_own_bytes(served):
    """TP=2: a chunk only rank 0 stored is no hit; once rank 1 stores too, each rank retrieves its own piece."""
    harness, client, pool = served
    client.call("register", registration(2, layers=LAYERS, hidden=HIDDEN, world_size=2))
    tokens = list(range(1000, 1000 + 2 * CHUNK))
    rank0 = _store(client, pool, tokens, "s", seed=2, worker=0, world_size=2, instance=1)
    client.call("lookup", key(tokens, "q1", world_size=2), 1)
    assert 0 == client.call("query_prefetch_status", "q1")
    rank1 = _store(client, pool, tokens, "s", seed=3, worker=1, world_size=2, instance=2)
    client.call("lookup", key(tokens, "q2", world_size=2), 1)
    assert 2 == client.call("query_prefetch_status", "q2")
    for worker, instance, expected in ((0, 1, rank0), (1, 2, rank1)):
        got = client.call("prepare_retrieve", key(tokens, "q2", worker_id=worker, world_size=2), instance)
        assert expected == read_slots(pool, got["context"]["slots"])
        client.call("commit_retrieve", key(tokens, "q2", worker_id=worker, world_size=2), instance)
    assert [0] * 4 == _locks(harness, tokens, world_size=2)


def _found_and_released(client: LMClient, tokens: list[int], request: str, world_size: int) -> int:
    """The chunks a lookup finds on every rank, its read locks given back as each rank's retrieve would."""
    client.call("lookup", key(tokens, request, world_size=world_size), 1)
    found = client.call("query_prefetch_status", request)
    client.call("end_session", request)
    return found


def test_a_request_s_tp_ranks_get_one_admission_verdict(served):
    """TP=2, L1's 16 objects four requests' (2 chunks × 2 ranks), each looked up twice (seen again, and in use).
    A new prompt's store would evict them: the adaptive order refuses rank 0's, and rank 1's store of the same
    request is refused with it (admitted, it would evict another request's object for objects no lookup can use
    without rank 0's).  With the frequency gate off (its decisions proved wrong), the same prompt stored by a later
    request is admitted on both ranks (second sight)."""
    harness, client, pool = served
    harness.server.l1._order.split()  # past the recency phase: ARC's lists and second-sight admission
    client.call("register", registration(2, layers=LAYERS, hidden=HIDDEN, world_size=2))
    ranks = ((0, 1), (1, 2))  # (worker, instance)
    prompts = [list(range(base, base + 2 * CHUNK)) for base in (10_000, 20_000, 30_000, 40_000)]
    for n, tokens in enumerate(prompts):
        for worker, instance in ranks:
            _store(client, pool, tokens, f"s{n}", seed=n, worker=worker, world_size=2, instance=instance)
    for round_ in range(2):
        assert [2] * 4 == [_found_and_released(client, t, f"l{round_}-{n}", 2) for n, t in enumerate(prompts)]
    new = list(range(50_000, 50_000 + 2 * CHUNK))
    refused = [client.call("prepare_store", key(new, "e", worker_id=worker, world_size=2), instance)["context"]
               for worker, instance in ranks]
    assert [[], []] == [context["slots"] for context in refused]
    assert [2] * 4 == [_found_and_released(client, t, f"after-{n}", 2) for n, t in enumerate(prompts)]
    harness.server.l1._order.gate.score = -1  # the refusal's decision, settled by those lookups, had turned it on
    for worker, instance in ranks:
        assert 2 == len(_store(client, pool, new, "f", seed=9, worker=worker, world_size=2, instance=instance))
    assert 2 == _found_and_released(client, new, "g", 2)


def test_a_store_of_one_part_keeps_no_verdict_and_a_tp_store_s_ranks_share_one(served):
    """A TP=1 store of one KV cache group has no other part to take its verdict: L1's order keeps none for it (a
    verdict kept per store would cost every store); a TP=2 request's ranks share one name and one verdict."""
    harness, client, pool = served
    named = harness.server.l1._order.named
    _store(client, pool, list(range(10_000, 10_000 + 2 * CHUNK)), "one", seed=1)
    assert not named.verdicts
    client.call("register", registration(2, layers=LAYERS, hidden=HIDDEN, world_size=2))
    tokens = list(range(20_000, 20_000 + 2 * CHUNK))
    for worker, instance in ((0, 1), (1, 2)):
        _store(client, pool, tokens, "two", seed=2, worker=worker, world_size=2, instance=instance)
    assert [(True, 2)] == [(kept[0], len(kept) - 1) for kept in named.verdicts.values()]  # admitted, both ranks


@pytest.mark.parametrize("second_prompt, second_world_size", [(200_000, 1), (100_000, 2)])
def test_two_engines_of_one_user_requests_of_one_id_get_verdicts_of_their_own(served, second_prompt,
                                                                              second_world_size):
    """Two engines of one uid send request id "r" over the same chunk range (vLLM's offline request ids start at
    "0" in every engine), with other prompts, or the same prompt at another TP size.  L1 full of prompts seen
    again and in use: engine 1's store is refused, and engine 2's is judged on its own, admitted as T2 was not
    used since."""
    harness, client, pool = served
    harness.server.l1._order.split()  # past the recency phase: ARC's lists and second-sight admission
    client.call("register", registration(2, layers=LAYERS, hidden=HIDDEN, world_size=second_world_size))
    prompts = [list(range(base, base + 2 * CHUNK)) for base in range(10_000, 90_000, 10_000)]
    for n, tokens in enumerate(prompts):
        _store(client, pool, tokens, f"s{n}", seed=n)
    for round_ in range(2):
        assert [2] * 8 == [_found_and_released(client, t, f"l{round_}-{n}", 1) for n, t in enumerate(prompts)]
    slots = [len(client.call("prepare_store", key(tokens, "r", worker_id=0, world_size=world_size),
                             instance)["context"]["slots"])
             for tokens, world_size, instance in (
                 (list(range(100_000, 100_000 + 2 * CHUNK)), 1, 1),
                 (list(range(second_prompt, second_prompt + 2 * CHUNK)), second_world_size, 2))]
    assert [0, 2] == slots


def test_mla_readers_each_release_one_lock(served):
    """MLA: one stored copy read by num_kv_readers workers; the lookup takes that many locks per chunk and
    each commit_retrieve gives back one."""
    harness, client, pool = served
    tokens = list(range(5000, 5000 + CHUNK))
    _store(client, pool, tokens, "w", seed=4)
    client.call("lookup", key(tokens, "m", readers=2), 1)
    assert 1 == client.call("query_prefetch_status", "m")
    assert [2] == _locks(harness, tokens)
    for remaining in (1, 0):
        client.call("prepare_retrieve", key(tokens, "m", worker_id=0, readers=2), 1)
        client.call("commit_retrieve", key(tokens, "m", worker_id=0, readers=2), 1)
        assert [remaining] == _locks(harness, tokens)


def test_free_lookup_locks_then_a_retrieve_after_chunk_zero(served):
    """vLLM's own prefix cache holds chunk 0: free_lookup_locks gives chunk 0's locks back (a range that
    ends inside a chunk frees nothing of it), the retrieve of chunks 1-2 releases theirs."""
    harness, client, pool = served
    tokens = list(range(9000, 9000 + 3 * CHUNK))
    written = _store(client, pool, tokens, "w", seed=5)
    client.call("lookup", key(tokens, "p"), 1)
    assert 3 == client.call("query_prefetch_status", "p")
    client.call("free_lookup_locks", key(tokens, "p", end=CHUNK - 10), 1)
    assert [1, 1, 1] == _locks(harness, tokens)
    client.call("free_lookup_locks", key(tokens, "p", end=CHUNK), 1)
    assert [0, 1, 1] == _locks(harness, tokens)
    tail = key(tokens, "p", worker_id=0, start=CHUNK)
    got = client.call("prepare_retrieve", tail, 1)
    assert written[1:] == read_slots(pool, got["context"]["slots"])
    client.call("commit_retrieve", tail, 1)
    assert [0, 0, 0] == _locks(harness, tokens)


def test_end_session_leaves_no_read_lock(served):
    harness, client, pool = served
    tokens = list(range(20000, 20000 + 2 * CHUNK))
    _store(client, pool, tokens, "w", seed=6)
    client.call("lookup", key(tokens, "e", readers=3), 1)
    assert 2 == client.call("query_prefetch_status", "e")
    assert [3, 3] == _locks(harness, tokens)
    assert NO_RESULT is client.call("end_session", "e")
    assert [0, 0] == _locks(harness, tokens)


def test_two_cache_salts_are_kept_apart(served):
    _, client, pool = served
    tokens = list(range(30000, 30000 + CHUNK))
    _store(client, pool, tokens, "w", seed=7, salt="tenant-a")
    client.call("lookup", key(tokens, "x", salt="tenant-b"), 1)
    assert 0 == client.call("query_prefetch_status", "x")
    client.call("lookup", key(tokens, "y", salt="tenant-a"), 1)
    assert 1 == client.call("query_prefetch_status", "y")


def test_an_abandoned_prepared_store_gives_its_slots_back(served):
    """A worker that prepares and never commits: after the deadline the slots are free again, the chunk is
    no hit, and a new store of it gets slots."""
    harness, client, pool = served
    tokens = list(range(40000, 40000 + 2 * CHUNK))
    used_before = harness.server.l1.used_bytes
    prepared = client.call("prepare_store", key(tokens, "gone", worker_id=0), 1)
    assert 2 == len(prepared["context"]["slots"])
    wait_for(lambda: harness.server.l1.used_bytes == used_before, timeout_s=5, what="the slots to come back",
             tolerate=())
    assert False is client.call("commit_store", key(tokens, "gone", worker_id=0), 1, b"")
    assert 2 == len(_store(client, pool, tokens, "again", seed=8))


def test_a_stored_chunk_is_skipped_and_a_retrieve_of_a_missing_chunk_fails(served):
    harness, client, pool = served
    tokens = list(range(50000, 50000 + 2 * CHUNK))
    _store(client, pool, tokens[:CHUNK], "w", seed=9)
    prepared = client.call("prepare_store", key(tokens, "w2", worker_id=0), 1)
    assert [1] == prepared["context"]["chunk_indices"]  # chunk 0 is cached already
    client.call("commit_store", key(tokens, "w2", worker_id=0), 1, b"")
    missing = list(range(60000, 60000 + CHUNK))
    assert {"success": False, "data": b"", "context": {}} == client.call(
        "prepare_retrieve", key(missing, "z", worker_id=0), 1)
    assert True is client.call("commit_retrieve", key(missing, "z", worker_id=0), 1)


def test_wait_prefetch_status_answers_without_blocking_the_loop(served):
    """An unknown request answers 0 at once: though it may wait a minute, it is answered within the client's
    reply deadline (REPLY_TIMEOUT_S, 5 s), which a wait for its timeout would outlast."""
    _, client, _ = served
    assert 0 == client.call("wait_prefetch_status", "never-looked-up", 60.0)


def test_chunks_evicted_from_l1_come_back_from_l2_with_their_bytes(cache, tmp_path):
    """With an fs L2 tier and slots the size of the object, a committed store also goes to L2; after L1
    is cleared a lookup prefetches the chunks back (status None until they landed) and the bytes match."""
    harness = cache(chunk_size_tokens=CHUNK, chunk_bytes=OBJECT, l1_size_bytes=16 * OBJECT, lmcache_ipc=True,
                    l2=[{"type": "fs", "path": str(tmp_path / "fs"), "capacity_gb": 1.0}])
    client = LMClient(harness.config.lmcache_urls(0)[0])
    try:
        reply = client.call("register", registration(1, layers=LAYERS, hidden=HIDDEN))
        fd = os.open(os.path.join("/dev/shm", reply["shm_name"]), os.O_RDWR)
        pool = mmap.mmap(fd, reply["pool_size"])
        os.close(fd)
        tokens = list(range(70000, 70000 + 2 * CHUNK))
        written = _store(client, pool, tokens, "w", seed=10)
        storage = harness.server.storage
        wait_for(lambda: storage.inflight == 0 and not storage.has_completions, timeout_s=5,
                 what="the L2 stores to finish", tolerate=())
        assert NO_RESULT is client.call("clear", False)
        client.call("lookup", key(tokens, "back"), 1)
        statuses = []
        wait_for(lambda: statuses.append(client.call("query_prefetch_status", "back")) or statuses[-1] is not NO_RESULT,
                 timeout_s=5, what="the L2 prefetch", tolerate=())
        assert 2 == statuses[-1] and set(statuses[:-1]) <= {NO_RESULT}  # None (no result frame) while loading
        got = client.call("prepare_retrieve", key(tokens, "back", worker_id=0), 1)
        assert written == read_slots(pool, got["context"]["slots"])
        client.call("commit_retrieve", key(tokens, "back", worker_id=0), 1)
        pool.close()
    finally:
        client.close()
