"""The scripted cache-blending workload shared by tests/cache/'s blend, blend metrics,
op events and pool loss tests.

L1 has 32 slots; chunks are 16 tokens.  Documents: A (chunks a1 a2), B (b1), C (c1); Q is a question
chunk q1 plus 5 trailing tokens.  Every count below is worked out by hand in the comments.
"""

from __future__ import annotations

import numpy as np

from mpcache.errors import RequestError
from support.cache_harness import CHUNK_BYTES, CHUNK_TOKENS, MODEL, fill_blocks

SALT = "tenant-cb"
ENGINE = 7
WORKER = 3
L1_SLOTS = 32
MISSING_BUFFER = 999  # a buffer id the server never gave out


def documents() -> dict[str, list[int]]:
    rng = np.random.default_rng(42)
    make = lambda n: [int(t) for t in rng.integers(0, 32000, size=n)]  # noqa: E731
    return {"A": make(2 * CHUNK_TOKENS), "B": make(CHUNK_TOKENS), "C": make(CHUNK_TOKENS),
            "Q": make(CHUNK_TOKENS + 5)}


def run_script(harness) -> dict:
    """Run the workload; returns every reply (keyed by step) for the tests to check."""
    d = documents()
    A, B, C, Q = d["A"], d["B"], d["C"], d["Q"]
    client = harness.client()
    kv = client.register_buffer(32, CHUNK_BYTES)
    bulk = client.register_buffer(26, CHUNK_BYTES)
    fill_blocks(kv, seed=5)
    out: dict = {"kv": kv}

    # "pre": documents computed on their own.  a1 a2 (blocks 0 1) and b1 (block 2): 3 new fingerprints.
    out["pre_a"] = client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=A,
                                                block_ids=[0, 1], engine_id=ENGINE)
    out["pre_b"] = client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=B,
                                                block_ids=[2], engine_id=ENGINE)
    out["pre_a_again"] = client.cb_store_pre_computed(kv, request_id="pre", model_name=MODEL, cache_salt=SALT,
                                                      tokens=A, block_ids=[0, 1], engine_id=ENGINE)  # 0 new
    try:  # into a buffer this connection never registered: a failed pre-computed store
        client.cb_store_pre_computed(MISSING_BUFFER, request_id="pre", model_name=MODEL, cache_salt=SALT, tokens=C,
                                     block_ids=[3], engine_id=ENGINE)
    except RequestError as exc:
        out["pre_missing_error"] = str(exc)
    client.end_session("pre")

    # "r1": B A C Q (85 tokens, 5 whole chunks): b1 a1 a2 are fingerprint hits confirmed in L1, c1 q1 miss.
    r1 = B + A + C + Q
    out["r1_lookup"] = client.cb_lookup(request_id="r1", model_name=MODEL, cache_salt=SALT, tokens=r1)
    out["r1_retrieve"] = client.cb_retrieve(kv, request_id="r1", lookup_id=out["r1_lookup"].lookup_id,
                                            chunk_indices=[0, 1, 2], block_ids=[8, 9, 10], engine_id=ENGINE,
                                            worker_id=WORKER)
    # the finished request, blocks 8..12: 5 new prefix-chained objects; c1 and q1 newly indexed (b1 a1 a2 keep
    # their pre-computed objects)
    out["r1_final"] = client.cb_store_final(kv, request_id="r1", model_name=MODEL, cache_salt=SALT, tokens=r1,
                                            block_ids=[8, 9, 10, 11, 12], engine_id=ENGINE)
    try:  # 2 block ids for 5 whole chunks: a failed final store
        client.cb_store_final(kv, request_id="r1", model_name=MODEL, cache_salt=SALT, tokens=r1, block_ids=[8, 9],
                              engine_id=ENGINE)
    except RequestError as exc:
        out["r1_final_error"] = str(exc)
    client.end_session("r1")

    # "r2": C B: c1 → r1's final object, b1 → the pre-computed one (2 storage hits).
    out["r2_lookup"] = client.cb_lookup(request_id="r2", model_name=MODEL, cache_salt=SALT, tokens=C + B)
    try:  # into a missing buffer: CB_RETRIEVE_END success=false
        client.cb_retrieve(MISSING_BUFFER, request_id="r2", lookup_id=out["r2_lookup"].lookup_id,
                           chunk_indices=[0, 1], block_ids=[13, 14], engine_id=ENGINE)
    except RequestError as exc:
        out["r2_missing_error"] = str(exc)
    out["r2_retrieve"] = client.cb_retrieve(kv, request_id="r2", lookup_id=out["r2_lookup"].lookup_id,
                                            chunk_indices=[0, 1], block_ids=[13, 14], engine_id=ENGINE)
    client.end_session("r2")

    # Forced eviction: a plain store of 26 new chunks into L1 (8 of 32 slots used) evicts the 2 least recently
    # used objects, the pre-computed a1 and a2 (retrieves touch what they read: r2 read c1 and b1 last).
    out["evict_stored"] = client.store(bulk, request_id="evict", model_name=MODEL, cache_salt=SALT,
                                       chunk_hashes=list(range(1, 27)), block_ids=list(range(26))).stored
    client.end_session("evict")

    # "r3": A B: a1 and a2 are stale (entries removed, CB_CHUNKS_EVICTED 2), b1 a storage hit ...
    out["r3_lookup"] = client.cb_lookup(request_id="r3", model_name=MODEL, cache_salt=SALT, tokens=A + B)
    # ... and again: a1 and a2 are now plain misses
    out["r3_lookup_again"] = client.cb_lookup(request_id="r3", model_name=MODEL, cache_salt=SALT, tokens=A + B)
    # A recomputed: a1 a2 stored and newly indexed (L1 is full: r1's final b1 and a1 objects make room)
    out["r3_pre_a"] = client.cb_store_pre_computed(kv, request_id="r3", model_name=MODEL, cache_salt=SALT, tokens=A,
                                                   block_ids=[0, 1], engine_id=ENGINE)
    client.end_session("r3")

    # "r4": a client with no registered KV buffer has no GPU context
    bare = harness.client()
    out["r4_lookup"] = bare.cb_lookup(request_id="r4", model_name=MODEL, cache_salt=SALT, tokens=A + B)
    out["r4_known"] = bare.end_session("r4")
    return out


# What the script must publish, as (event name, fields, session_id), in order (CB events only).
def expected_cb_events() -> list[tuple[str, tuple, str]]:
    t = CHUNK_TOKENS
    return [
        ("CB_REQUEST_START", (), "pre"),
        ("CB_STORE_PRE_COMPUTED_START", (ENGINE, 2 * t), "pre"),
        ("CB_FINGERPRINTS_REGISTERED", (2, 2 * t), ""),
        ("CB_STORE_PRE_COMPUTED_END", (ENGINE, 2 * t, 2, True), "pre"),
        ("CB_STORE_PRE_COMPUTED_START", (ENGINE, t), "pre"),
        ("CB_FINGERPRINTS_REGISTERED", (1, t), ""),
        ("CB_STORE_PRE_COMPUTED_END", (ENGINE, t, 1, True), "pre"),
        ("CB_STORE_PRE_COMPUTED_START", (ENGINE, 2 * t), "pre"),
        ("CB_STORE_PRE_COMPUTED_END", (ENGINE, 2 * t, 0, True), "pre"),
        ("CB_STORE_PRE_COMPUTED_START", (ENGINE, t), "pre"),
        ("CB_STORE_PRE_COMPUTED_END", (ENGINE, t, 0, False), "pre"),
        ("CB_REQUEST_END", (), "pre"),
        ("CB_REQUEST_START", (), "r1"),
        ("CB_LOOKUP_START", (5 * t + 5,), "r1"),
        ("CB_LOOKUP_END", (5 * t + 5, 5 * t, 3 * t, 3, 3, 0, False), "r1"),
        ("CB_RETRIEVE_START", (ENGINE, 3, WORKER), "r1"),
        ("CB_RETRIEVE_END", (ENGINE, 3, True, WORKER), "r1"),
        ("CB_STORE_FINAL_START", (ENGINE, 5 * t + 5), "r1"),
        ("CB_FINGERPRINTS_REGISTERED", (2, 2 * t), ""),
        ("CB_STORE_FINAL_END", (ENGINE, 5 * t + 5, 5, True), "r1"),
        ("CB_STORE_FINAL_START", (ENGINE, 5 * t + 5), "r1"),
        ("CB_STORE_FINAL_END", (ENGINE, 5 * t + 5, 0, False), "r1"),
        ("CB_REQUEST_END", (), "r1"),
        ("CB_REQUEST_START", (), "r2"),
        ("CB_LOOKUP_START", (2 * t,), "r2"),
        ("CB_LOOKUP_END", (2 * t, 2 * t, 2 * t, 2, 2, 0, False), "r2"),
        ("CB_RETRIEVE_START", (ENGINE, 2, -1), "r2"),
        ("CB_RETRIEVE_END", (ENGINE, 2, False, -1), "r2"),
        ("CB_RETRIEVE_START", (ENGINE, 2, -1), "r2"),
        ("CB_RETRIEVE_END", (ENGINE, 2, True, -1), "r2"),
        ("CB_REQUEST_END", (), "r2"),
        ("CB_REQUEST_START", (), "r3"),
        ("CB_LOOKUP_START", (3 * t,), "r3"),
        ("CB_CHUNKS_EVICTED", (2,), ""),
        ("CB_LOOKUP_END", (3 * t, 3 * t, t, 3, 1, 2, False), "r3"),
        ("CB_LOOKUP_START", (3 * t,), "r3"),
        ("CB_LOOKUP_END", (3 * t, 3 * t, t, 1, 1, 0, False), "r3"),
        ("CB_STORE_PRE_COMPUTED_START", (ENGINE, 2 * t), "r3"),
        ("CB_FINGERPRINTS_REGISTERED", (2, 2 * t), ""),
        ("CB_STORE_PRE_COMPUTED_END", (ENGINE, 2 * t, 2, True), "r3"),
        ("CB_REQUEST_END", (), "r3"),
        ("CB_REQUEST_START", (), "r4"),
        ("CB_LOOKUP_START", (3 * t,), "r4"),
        ("CB_LOOKUP_END", (3 * t, 0, 0, 0, 0, 0, True), "r4"),
        ("CB_REQUEST_END", (), "r4"),
    ]


# The 18 lmcache_blend counters after the script, by hand from the events above.
EXPECTED_COUNTERS = {
    "lookup_requests": 5,  # r1, r2, r3 twice, r4
    "lookup_requested_tokens": 208,  # 80 + 32 + 48 + 48 + 0 (no GPU context reports zeros)
    "lookup_hit_tokens": 112,  # 48 + 32 + 16 + 16
    "lookup_fingerprint_hits": 9,  # 3 + 2 + 3 + 1
    "lookup_storage_hits": 7,  # 3 + 2 + 1 + 1
    "lookup_stale_chunks": 2,  # a1, a2 after the forced eviction
    "lookup_no_gpu_context_errors": 1,  # r4
    "retrieve_requests": 3,
    "retrieve_chunks": 7,  # 3 + 2 (into the missing buffer) + 2
    "retrieve_failures": 1,  # the missing buffer
    "store_pre_computed_requests": 5,
    "store_pre_computed_chunks": 5,  # 2 + 1 + 0 + 0 + 2
    "store_pre_computed_failures": 1,  # the missing buffer
    "store_final_requests": 2,
    "store_final_chunks": 5,
    "store_final_failures": 1,  # 2 block ids for 5 chunks
    "fingerprints_registered": 7,  # 2 + 1 + 2 + 2
    "chunks_evicted": 2,
}
