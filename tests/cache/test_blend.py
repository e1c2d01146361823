"""Cache blending in the cache process: fingerprints, cb_* operations and the CB events they publish."""

from __future__ import annotations

import numpy as np
import pytest
from support.blend_script import L1_SLOTS, SALT, documents, expected_cb_events, run_script
from support.cache_harness import CHUNK_BYTES, CHUNK_TOKENS, MODEL

from mpcache.cache.blend import FingerprintTable
from mpcache.client import BlendStoreResult, RetrieveResult
from mpcache.contract.blending import (
    FINGERPRINT_HIT,
    MISS,
    PREFIX_HIT,
    STALE,
    chunk_fingerprints,
    fingerprint,
)
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes
from mpcache.errors import ProtocolError, RequestError

CB_TYPES = [e for e in E if e.name.startswith("CB_")]


def cb_events(batch) -> list[tuple[str, tuple, str]]:
    return [(e.etype.name, tuple(e.fields.values()), e.session_id) for e in batch.events(CB_TYPES)]


@pytest.fixture
def scripted(cache):
    harness = cache(l1_size_bytes=L1_SLOTS * CHUNK_BYTES, l1_policy="lru")  # the script's evictions are LRU's
    harness.events.take()
    out = run_script(harness)
    return harness, out, harness.events.take()


def test_fingerprint_is_position_independent_and_differs_from_prefix_hashes():
    """The same chunk at another position has the same fingerprint; its prefix-chained hash differs."""
    d = documents()
    a, b = d["A"][:CHUNK_TOKENS], d["B"]
    assert (chunk_fingerprints(a + b, CHUNK_TOKENS)[::-1], True, False) == (
        chunk_fingerprints(b + a, CHUNK_TOKENS),
        chunk_hashes(a + b, CHUNK_TOKENS)[0] != chunk_hashes(b + a, CHUNK_TOKENS)[1],
        fingerprint(a) in chunk_hashes(a, CHUNK_TOKENS))


def test_scripted_workload_publishes_exactly_these_cb_events(scripted):
    """Every CB event of the script, in order, with its exact fields and session id."""
    _, _, batch = scripted
    assert expected_cb_events() == cb_events(batch)


def test_scripted_workload_replies(scripted):
    """Per-chunk statuses, counts, stored/registered chunks and error replies are what the script says."""
    _, out, _ = scripted
    t = CHUNK_TOKENS
    got = {
        "pre_a": out["pre_a"], "pre_a_again": out["pre_a_again"],
        "r1": (out["r1_lookup"].chunks, out["r1_lookup"].hit_tokens, out["r1_retrieve"], out["r1_final"]),
        "r2": (out["r2_lookup"].chunks, out["r2_retrieve"]),
        "r3": (out["r3_lookup"].chunks, out["r3_lookup"].stale_chunks, out["r3_lookup_again"].chunks,
               out["r3_pre_a"]),
        "r4": (out["r4_lookup"].no_gpu_context, out["r4_lookup"].lookup_id, out["r4_known"]),
        "errors": ("unknown buffer 999" in out["pre_missing_error"], "2 entries for 5 whole chunks" in
                   out["r1_final_error"], "unknown buffer 999" in out["r2_missing_error"]),
        "evicted_store": out["evict_stored"],
    }
    assert {
        "pre_a": BlendStoreResult(stored=2, skipped=0, failed=0, registered=2, replaced=0),
        "pre_a_again": BlendStoreResult(stored=0, skipped=2, failed=0, registered=0, replaced=0),
        "r1": ((FINGERPRINT_HIT,) * 3 + (MISS,) * 2, 3 * t, RetrieveResult(retrieved=3, failed=0),
               BlendStoreResult(stored=5, skipped=0, failed=0, registered=2, replaced=0)),
        "r2": ((FINGERPRINT_HIT,) * 2, RetrieveResult(retrieved=2, failed=0)),
        "r3": ((STALE, STALE, FINGERPRINT_HIT), 2, (MISS, MISS, FINGERPRINT_HIT),
               BlendStoreResult(stored=2, skipped=0, failed=0, registered=2, replaced=0)),
        "r4": (True, None, True),
        "errors": (True, True, True),
        "evicted_store": 26,
    } == got


def test_retrieved_blocks_hold_the_blended_chunks(scripted):
    """r1 got b1 a1 a2 from their pre-computed blocks (2, 0, 1); r2 got c1 from r1's final block 11, b1 from 2."""
    _, out, _ = scripted
    kv = out["kv"].blocks
    # blocks 0 1 were rewritten by nothing (the eviction store used another buffer)
    np.testing.assert_array_equal(kv[[2, 0, 1, 11, 2]], kv[[8, 9, 10, 13, 14]])


def test_the_forced_eviction_evicted_exactly_the_two_stale_objects(scripted):
    """L1 evicted pre-computed a1 a2 (L1_KEYS_EVICTED 2) for the 26-chunk store, and 2 more objects (r1's final
    b1 a1) for r3's recomputed A; every chunk of r1 (b1 a1 a2 c1 q1) is indexed at the end."""
    harness, _, batch = scripted
    d = documents()
    fps = chunk_fingerprints(d["A"] + d["B"] + d["C"] + d["Q"], CHUNK_TOKENS)
    table = harness.server.ctx.blend.table
    assert ([2, 2], [True] * 5) == (
        [e.salt_counts[0][2] for e in batch.events([E.L1_KEYS_EVICTED])],
        [ChunkKey(MODEL, SALT, fp) in table for fp in fps])


def test_retrieve_of_a_chunk_evicted_since_the_lookup_is_a_partial_failure(cache):
    """No read locks: a hit evicted before cb_retrieve is an L1 read failure (not_found), the rest is copied,
    and CB_RETRIEVE_END says success=false."""
    harness = cache(l1_size_bytes=4 * CHUNK_BYTES)
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    d = documents()
    client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=d["A"],
                                 block_ids=[0, 1])
    lookup = client.cb_lookup(request_id="r", model_name=MODEL, cache_salt=SALT, tokens=d["A"])
    client.store(kv, request_id="evict", model_name=MODEL, cache_salt=SALT, chunk_hashes=[1, 2, 3],
                 block_ids=[2, 3, 4])  # 2 free slots, 3 new: evicts a1
    harness.events.take()
    reply = client.cb_retrieve(kv, request_id="r", lookup_id=lookup.lookup_id, chunk_indices=[0, 1],
                               block_ids=[5, 6])
    batch = harness.events.take()
    assert (RetrieveResult(retrieved=1, failed=1), [("l1_retrieve", "not_found")],
            [(2, False, -1)]) == (
        reply, [(e.fields["during"], e.fields["reason"]) for e in batch.events([E.L1_READ_FAILED])],
        [(e.fields["num_chunks"], e.fields["success"],
          e.fields["worker_id"]) for e in batch.events([E.CB_RETRIEVE_END])])


def test_final_store_replaces_a_stale_entry_and_counts_it_evicted(cache):
    """A fingerprint whose object is gone is replaced by a store's new object: newly registered and
    CB_CHUNKS_EVICTED 1 (the stale entry was removed on discovery)."""
    harness = cache(l1_size_bytes=4 * CHUNK_BYTES)
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    b = documents()["B"]
    client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=b, block_ids=[0])
    client.store(kv, request_id="evict", model_name=MODEL, cache_salt=SALT, chunk_hashes=[1, 2, 3, 4],
                 block_ids=[1, 2, 3, 4])  # evicts b1
    harness.events.take()
    reply = client.cb_store_final(kv, request_id="r", model_name=MODEL, cache_salt=SALT, tokens=b, block_ids=[5])
    events = [(e.etype.name, tuple(e.fields.values())) for e in harness.events.take().events(
        [E.CB_FINGERPRINTS_REGISTERED, E.CB_CHUNKS_EVICTED])]
    assert ((1, 1), [("CB_FINGERPRINTS_REGISTERED", (1, CHUNK_TOKENS)), ("CB_CHUNKS_EVICTED", (1,))]) == (
        (reply.registered, reply.replaced), events)


def test_prefix_hits_come_before_the_fingerprint_table(cache):
    """A finished request looked up again is all prefix hits (hit_tokens count them, fingerprint_hits do not)."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    d = documents()
    tokens = d["B"] + d["C"]
    client.cb_store_final(kv, request_id="r1", model_name=MODEL, cache_salt=SALT, tokens=tokens, block_ids=[0, 1])
    reply = client.cb_lookup(request_id="r2", model_name=MODEL, cache_salt=SALT, tokens=tokens + [1, 2, 3])
    assert ((PREFIX_HIT, PREFIX_HIT), 2, 0, 2 * CHUNK_TOKENS, 2 * CHUNK_TOKENS) == (
        reply.chunks, reply.prefix_hits, reply.fingerprint_hits, reply.hit_tokens, reply.requested_tokens)


def test_other_model_or_salt_does_not_see_the_fingerprint(cache):
    """Fingerprints are indexed per (model_name, cache_salt)."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    b = documents()["B"]
    client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=b, block_ids=[0])
    assert ((MISS,), (MISS,), (FINGERPRINT_HIT,)) == (
        client.cb_lookup(request_id="x", model_name=MODEL, cache_salt="other-salt", tokens=b).chunks,
        client.cb_lookup(request_id="y", model_name="other/model", cache_salt=SALT, tokens=b).chunks,
        client.cb_lookup(request_id="z", model_name=MODEL, cache_salt=SALT, tokens=b).chunks)


def test_retrieve_refuses_chunks_that_were_not_hits(cache):
    """chunk_indices must name hits of that request's lookup; the refusal is a failed retrieve."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    d = documents()
    client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=d["B"], block_ids=[0])
    lookup = client.cb_lookup(request_id="r", model_name=MODEL, cache_salt=SALT, tokens=d["B"] + d["C"])
    harness.events.take()
    with pytest.raises(RequestError, match="chunk 1 was not a hit"):
        client.cb_retrieve(kv, request_id="r", lookup_id=lookup.lookup_id, chunk_indices=[1], block_ids=[2])
    with pytest.raises(RequestError, match="unknown lookup"):
        client.cb_retrieve(kv, request_id="other-request", lookup_id=lookup.lookup_id, chunk_indices=[0],
                           block_ids=[2])
    ends = [e.fields["success"] for e in harness.events.take().events([E.CB_RETRIEVE_END])]
    assert [False, False] == ends


def test_the_hits_kept_for_retrieves_are_bounded_across_sessions(cache, monkeypatch):
    """Each lookup keeps its hits for the retrieve that follows, until the request ends; a client that never ends
    its requests made them grow with every lookup.  At most ``MAX_HITS_KEPT`` hits are kept over all sessions: the
    oldest lookups give way, and a retrieve of one is an unknown lookup, while the newest are retrieved."""
    from mpcache.cache import blend

    monkeypatch.setattr(blend, "MAX_HITS_KEPT", 4)
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    tokens = documents()["B"] + documents()["C"]
    client.cb_store_final(kv, request_id="w", model_name=MODEL, cache_salt=SALT, tokens=tokens, block_ids=[0, 1])
    lookups = [client.cb_lookup(request_id=f"r{number}", model_name=MODEL, cache_salt=SALT, tokens=tokens)
               for number in range(5)]  # two hits each: the newest two lookups fit
    assert [2] * 5 == [lookup.prefix_hits for lookup in lookups]
    for number in range(3):
        with pytest.raises(RequestError, match="unknown lookup"):
            client.cb_retrieve(kv, request_id=f"r{number}", lookup_id=lookups[number].lookup_id, chunk_indices=[0],
                               block_ids=[2])
    for number in (3, 4):
        assert RetrieveResult(retrieved=2, failed=0) == client.cb_retrieve(
            kv, request_id=f"r{number}", lookup_id=lookups[number].lookup_id, chunk_indices=[0, 1],
            block_ids=[2, 3])


def test_protocol_rejects_malformed_cb_requests(cache):
    """Field validation of the cb_* ops happens before any event: a protocol error, nothing published."""
    harness = cache()
    client = harness.client()
    harness.events.take()
    with pytest.raises(ProtocolError, match="tokens"):
        client.call("cb_lookup", request_id="r", model_name=MODEL, tokens=[])
    with pytest.raises(ProtocolError, match="worker_id"):
        client.call("cb_retrieve", buffer_id=1, request_id="r", lookup_id=1, chunk_indices=[0], block_ids=[0],
                    worker_id=-2)
    assert 0 == harness.events.take().count(CB_TYPES)


def test_fingerprint_table_is_bounded_lru():
    """At capacity the least recently used entry gives way (counted as dropped, not as a stale eviction)."""
    table = FingerprintTable(2)
    keys = [ChunkKey(MODEL, SALT, h) for h in (1, 2, 3)]
    always = lambda key: True  # noqa: E731
    results = [table.register(keys[0], keys[0], always), table.register(keys[1], keys[1], always)]
    table.get(keys[0])  # touched: keys[1] is now the oldest
    results.append(table.register(keys[2], keys[2], always))
    assert ([(True, False)] * 3, [True, False, True], 1) == (
        results, [k in table for k in keys], table.dropped)
