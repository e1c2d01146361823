"""L1's pool truncated by a same-uid peer (issue 36, item 10) under an in-process cache process: a copy that
faulted in it, or a store whose space was reserved before it was lost, fails with its protocol's failure reply
and is counted; nothing it read or wrote is served as if it were the chunks.  The truncate is real (the SIGBUS
guard gives the pool its size back), so is the copy that meets it."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import numpy as np
import pytest
from support.blend_script import SALT, documents
from support.cache_harness import CHUNK_BYTES, MODEL, fill_blocks, fs_spec, l2_idle
from support.lmcache_client import NO_RESULT, packed_key, registration
from support.lmcache_inline import CHUNK, OBJECT, objects
from support.waiting import wait_for

from mpcache.cache.l1 import L1Manager
from mpcache.cache.lmcache import inline, registrations
from mpcache.cache.lmcache.transfers import RETRIEVE_MISS
from mpcache.cache.requests import store_to_l2
from mpcache.contract.events import EventType as E
from mpcache.errors import RequestError
from mpcache.shm import shrink_guard

pytestmark = pytest.mark.skipif(shrink_guard._busguard is None, reason="built without the C extension")


def _truncate(harness) -> str:
    path = "/dev/shm" + harness.config.l1_pool_name(0)
    os.truncate(path, 0)
    return path


def _found(client, tokens: list[int], request_id: str) -> int:
    assert NO_RESULT is client.call("lookup", packed_key(tokens, request_id), 1)
    return client.call("query_prefetch_status", request_id)


def test_a_native_store_whose_copy_faulted_fails_and_stores_nothing(cache):
    """Before: the store's bytes landed on the restored pool after the fault and the chunks were readable."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(2, CHUNK_BYTES)
    fill_blocks(kv, 1)
    _truncate(harness)
    with pytest.raises(RequestError, match="truncated by another process during the copy.*nothing was stored"):
        client.store(kv, request_id="s", model_name=MODEL, chunk_hashes=[1, 2], block_ids=[0, 1])
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, chunk_hashes=[1, 2])
    assert 0 == client.wait_prefetch(job).found_count
    assert 2 == harness.server.l1.lost_copies


def test_an_inline_copy_from_or_into_a_truncated_pool_fails_and_the_next_one_is_served(lmcache, monkeypatch):
    """An inline retrieve whose copy out of the pool faulted is a miss (before: a success carrying zeros), its
    locks given back; an inline store whose copy faulted is refused and not found (before: stored as zeros);
    both counted.  The pool has its size back and the next store and retrieve are byte for byte."""
    monkeypatch.setattr(registrations, "can_map_pool", lambda owner: False)
    harness, client = lmcache()
    l1 = harness.server.l1
    client.call("register", {**registration(1), "group_layouts": []})
    tokens = list(range(2 * CHUNK))
    sent = objects(2, seed=11)
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, inline.encode(OBJECT, sent))
    assert 2 == _found(client, tokens, "r")
    path = _truncate(harness)
    retrieved = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    size = os.stat(path).st_size
    _truncate(harness)
    stored = client.call("commit_store", packed_key(tokens, "w2", worker_id=0), 1, inline.encode(OBJECT, sent))
    assert (RETRIEVE_MISS, False, 0, l1.pool.nbytes, l1.pool.nbytes) == (
        retrieved, stored, _found(client, tokens, "r2"), size, os.stat(path).st_size)
    assert 4 == l1.lost_copies
    assert True is client.call("commit_store", packed_key(tokens, "w3", worker_id=0), 1, inline.encode(OBJECT, sent))
    assert 2 == _found(client, tokens, "r3")
    got = client.call("prepare_retrieve", packed_key(tokens, "r3", worker_id=0), 1)
    assert sent == inline.decode(got["data"], OBJECT, 2)


def test_a_store_prepared_before_the_pool_was_lost_is_refused_at_its_commit(lmcache):
    """The worker got its slots, then the pool was lost (found short at the heartbeat, no copy meeting it): its
    commit is refused and the objects are not found (before: committed, readable zeros), counted."""
    harness, client = lmcache()
    l1 = harness.server.l1
    client.call("register", {**registration(1), "group_layouts": []})
    tokens = list(range(2 * CHUNK))
    stored = packed_key(tokens, "w", worker_id=0)
    slots = client.call("prepare_store", stored, 1, [])["context"]["slots"]
    path = _truncate(harness)
    wait_for(lambda: os.stat(path).st_size == l1.pool.nbytes, 10, "the heartbeat giving the pool its size back")
    committed = client.call("commit_store", stored, 1, b"")
    assert (2, False, 0) == (len(slots), committed, _found(client, tokens, "r"))
    assert 2 == l1.lost_copies


def test_an_l2_prefetch_that_lands_in_a_truncated_pool_fails_as_l1_lost(cache, tmp_path):
    """Chunks L1 evicted come back from an fs tier into a pool truncated meanwhile: the L2 thread's copy faults,
    and the landing fails with reason l1_lost (before: found, their bytes zeros), counted."""
    harness = cache(l2=[fs_spec(tmp_path / "fs", chunks=100)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 5)
    client.store(kv, request_id="w1", model_name=MODEL, chunk_hashes=[1, 2, 3], block_ids=[0, 1, 2])
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, chunk_hashes=list(range(50, 58)), block_ids=list(range(8)))
    l2_idle(harness)  # 1..3 evicted from L1, held by L2
    harness.events.take()
    _truncate(harness)
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, chunk_hashes=[1, 2, 3])
    found = client.wait_prefetch(job).found_count
    failed = [(e.fields["reason"], e.salt_counts) for e in harness.events.take().events([E.L2_PREFETCH_FAILED])]
    assert (0, [("l1_lost", [("", MODEL, 3)])]) == (found, failed)
    assert 3 == harness.server.l1.lost_copies


@pytest.mark.parametrize("generations", [(0, 0), (0, 1)])
def test_chunks_copied_out_for_l2_are_written_only_if_the_pool_was_not_lost_under_the_copy(generations):
    """The copy for L2 reads the pool on the loop; a fault under it (the generation changes) means zeros, which
    must not be written to L2 as the chunks."""
    written: list[tuple] = []
    seen = iter(generations)
    l1 = SimpleNamespace(pool=np.arange(16, dtype=np.uint8), generation=lambda: next(seen), lost_copies=0)
    l1.lost_since = functools.partial(L1Manager.lost_since, l1)  # L1's own check, over the stub's generations
    ctx = SimpleNamespace(l1=l1, chunk_bytes=8, storage=SimpleNamespace(adapters=[object()],
                                                                        store=lambda *args: written.append(args)))
    store_to_l2(ctx, MODEL, "", [1, 2], [8, 0])
    lost = generations[0] != generations[1]
    assert ([] if lost else [(MODEL, "", [(1, bytes(range(8, 16))), (2, bytes(range(8)))])], 2 if lost else 0) == (
        written, l1.lost_copies)


def test_blend_copies_from_or_into_a_truncated_pool_fail_and_store_nothing(cache):
    """cb_retrieve whose copy faulted is an error (before: the blocks got zeros as a success); a pre-computed
    store whose copy faulted is an error and its chunks are no hits (before: stored as zeros); both counted."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    fill_blocks(kv, 7)
    d = documents()
    client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=d["A"],
                                 block_ids=[0, 1])
    lookup = client.cb_lookup(request_id="r", model_name=MODEL, cache_salt=SALT, tokens=d["A"])
    _truncate(harness)
    with pytest.raises(RequestError, match="truncated by another process during the copy"):
        client.cb_retrieve(kv, request_id="r", lookup_id=lookup.lookup_id, chunk_indices=[0, 1], block_ids=[2, 3])
    _truncate(harness)
    with pytest.raises(RequestError, match="truncated by another process during the copy"):
        client.cb_store_pre_computed(kv, request_id="pre2", model_name=MODEL, cache_salt=SALT, tokens=d["B"] + d["C"],
                                     block_ids=[0, 1])
    again = client.cb_lookup(request_id="r2", model_name=MODEL, cache_salt=SALT, tokens=d["B"] + d["C"])
    assert (2, 0, 4) == (lookup.fingerprint_hits + lookup.prefix_hits, again.fingerprint_hits + again.prefix_hits,
                         harness.server.l1.lost_copies)
