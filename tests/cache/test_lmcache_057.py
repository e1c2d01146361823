"""LMCache 0.5.7's protocol beside 0.5.6's on one cache process: packed tokens, chunk-size negotiation,
lookups that start past the engine's own prefix cache, the trailing arguments, the request-level counts."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from support.lmcache_client import NO_RESULT, LMClient, key, map_pool, packed_key, read_slots, registration, write_slots
from support.waiting import wait_for

from mpcache.cache.lmcache.registrations import REAP_AFTER_S
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes

CHUNK = 256
MODEL = "org/model"


def store(client: LMClient, pool: mmap.mmap, stored: dict, seed: int) -> list[bytes]:
    prepared = client.call("prepare_store", stored, 1)
    written = write_slots(pool, prepared["context"]["slots"], seed)
    assert True is client.call("commit_store", stored, 1, b"")
    return written


def readers(harness, tokens: list[int], chunk: int = CHUNK) -> list[int]:
    keys = rank_hashes(chunk_hashes(tokens, chunk), 1, [0])
    return [harness.server.l1.readers(ChunkKey(MODEL, "", k)) for k in keys]


def lookup_ends(harness) -> list[dict]:
    return [event.fields for event in harness.events.take().events([E.MP_LOOKUP_PREFETCH_END])]


def test_packed_and_listed_tokens_name_the_same_chunks(lmcache):
    """A 0.5.6 worker stores with token_ids; a 0.5.7 scheduler and worker find and read the same chunks with
    token_bytes (and the other way round): the bytes written are the bytes read."""
    harness, old = lmcache()
    new = LMClient(harness.config.lmcache_urls(0)[0])
    try:
        pool = map_pool(old.call("register", registration(1, hidden=128)))
        assert 256 == new.call("negotiate_chunk_size", 16)
        tokens = list(range(50_000, 50_000 + 3 * CHUNK))
        written = store(old, pool, key(tokens, "w", worker_id=0), seed=1)
        assert NO_RESULT is new.call("lookup", packed_key(tokens, "r", engine_hit=0), 1)
        assert 3 == new.call("query_prefetch_status", "r")
        got = new.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
        assert written == read_slots(pool, got["context"]["slots"])
        assert True is new.call("commit_retrieve", packed_key(tokens, "r", worker_id=0), 1)
        more = list(range(90_000, 90_000 + 2 * CHUNK))
        written = store(new, pool, packed_key(more, "w2", worker_id=0), seed=2)
        assert NO_RESULT is old.call("lookup", key(more, "r2"), 1)
        assert 2 == old.call("query_prefetch_status", "r2")
        got = old.call("prepare_retrieve", key(more, "r2", worker_id=0), 1)
        assert written == read_slots(pool, got["context"]["slots"])
        pool.close()
    finally:
        new.close()


@pytest.mark.parametrize(("field", "value"), [("token_bytes", b"\0\0\1"), ("token_bytes", "text"),
                                              ("token_ids", [1, 2])])
def test_a_ragged_packing_or_two_token_spellings_are_refused_by_name(lmcache, field, value, capsys):
    _, client = lmcache()
    client.call("register", registration(1, hidden=128))
    bad = {**packed_key(list(range(CHUNK)), "r", worker_id=0), field: value}
    assert {"context": {}} == client.call("prepare_store", bad, 1)
    assert "key.token_bytes" in capsys.readouterr().out or field == "token_ids"
    assert 256 == client.call("get_chunk_size")  # still serving


def test_chunk_size_negotiation_rounds_the_configured_size_up_binds_it_and_refuses_what_does_not_fit(lmcache,
                                                                                                    capsys):
    """As LMCache 0.5.7's server: --chunk-size is the smallest chunk, the first negotiation rounds it up to a
    multiple of the alignment and binds it, a compatible alignment later gets the bound size, an incompatible
    one gets it too (the client's own check refuses it) and one warning naming both numbers."""
    _, client = lmcache()
    assert 640 == client.call("negotiate_chunk_size", 640)
    assert 640 == client.call("get_chunk_size")
    assert 640 == client.call("negotiate_chunk_size", 16)
    assert 640 == client.call("negotiate_chunk_size", 300)
    refused = [line for line in capsys.readouterr().out.splitlines() if "lmcache.chunk_size_refused" in line]
    assert 1 == len(refused) and "640" in refused[0] and "300" in refused[0]
    assert NO_RESULT is client.call("negotiate_chunk_size", 0)  # not an alignment: refused by name
    pool = map_pool(client.call("register", registration(1, hidden=128, slots=640)))
    tokens = list(range(2 * 640 + 100))
    written = store(client, pool, key(tokens, "w", worker_id=0), seed=3)
    assert 2 == len(written) and all(len(data) == 2 * 2 * 640 * 128 * 2 for data in written)
    assert NO_RESULT is client.call("lookup", key(tokens, "r"), 1)
    assert 2 == client.call("query_prefetch_status", "r")
    pool.close()


def test_a_size_bound_by_an_older_client_is_kept(lmcache):
    _, client = lmcache()
    assert 256 == client.call("get_chunk_size")  # 0.5.6's first request binds the size as it is
    assert 256 == client.call("negotiate_chunk_size", 640)  # 256 is no multiple of 640: the client refuses it
    assert 256 == client.call("negotiate_chunk_size", 128)


def test_a_lookup_past_the_engines_prefix_neither_locks_nor_requests_it_but_counts_it_as_hit(lmcache):
    """0.5.7's start-aware lookup (LMCache's rc3 server is the reference): the chunks below key.start are the
    engine's; the hit the client reads includes them, nothing is locked on them, and the counters leave them out
    of lookup_requested / lookup_hit but count them in the request-level pair."""
    harness, client = lmcache()
    pool = map_pool(client.call("register", registration(1, hidden=128)))
    tokens = list(range(7_000, 7_000 + 3 * CHUNK + 40))
    written = store(client, pool, packed_key(tokens, "w", worker_id=0), seed=4)
    client.call("end_session", "w")
    harness.events.take()
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r", start=CHUNK, engine_hit=480), 1)
    assert 3 == client.call("query_prefetch_status", "r")
    assert [0, 1, 1] == readers(harness, tokens)
    [end] = lookup_ends(harness)
    assert (2 * CHUNK, 2 * CHUNK, 3 * CHUNK + 40, 3 * CHUNK) == (
        end["requested_tokens"], end["hit_tokens"], end["prompt_tokens"], end["request_hit_tokens"])
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "r", end=480), 1, [])
    assert [0, 1, 1] == readers(harness, tokens)  # the lookup locked nothing below its start
    wanted = packed_key(tokens, "r", worker_id=0, start=CHUNK, end=3 * CHUNK)
    got = client.call("prepare_retrieve", wanted, 1)
    assert written[1:] == read_slots(pool, got["context"]["slots"])
    assert True is client.call("commit_retrieve", wanted, 1)
    assert [0, 0, 0] == readers(harness, tokens)
    pool.close()


def test_the_engines_hint_is_the_request_hit_when_it_is_longer(lmcache):
    harness, client = lmcache()
    harness.events.take()
    tokens = list(range(1_000))
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r", engine_hit=900), 1)
    assert 0 == client.call("query_prefetch_status", "r")
    assert NO_RESULT is client.call("lookup", key(tokens, "old"), 1)  # 0.5.6: no hint, the whole list is the prompt
    assert 0 == client.call("query_prefetch_status", "old")
    assert [(3 * CHUNK, 0, 1_000, 900), (3 * CHUNK, 0, 1_000, 0)] == [
        (end["requested_tokens"], end["hit_tokens"], end["prompt_tokens"], end["request_hit_tokens"])
        for end in lookup_ends(harness)]


def test_the_trailing_arguments_are_taken_and_checked(lmcache):
    """prepare_store's skipped_chunks (only several KV cache groups skip) and free_lookup_locks' extra_ranges."""
    _, client = lmcache()
    client.call("register", registration(1, hidden=128))
    tokens = list(range(2 * CHUNK))
    assert 2 == len(client.call("prepare_store", packed_key(tokens, "a", worker_id=0), 1, [])["context"]["slots"])
    assert {"context": {}} == client.call("prepare_store", packed_key(tokens, "b", worker_id=0), 1, [[0]])
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "c"), 1)
    assert 0 == client.call("query_prefetch_status", "c")
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "c"), 1, [[0, CHUNK]])
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "c"), 1, "not ranges")
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "c"), 1, [[0, CHUNK]], "one too many")
    assert 256 == client.call("get_chunk_size")


def test_a_registration_says_null_block_id_to_a_057_worker_only(lmcache):
    _, client = lmcache()
    old = client.call("register", registration(1, hidden=128))
    new = client.call("register", {**registration(2, hidden=128), "group_layouts": []})
    assert ("null_block_id" not in old, 0) == (True, new["null_block_id"])
    assert {"shm_name": "", "pool_size": 0} == client.call("register", {**registration(4), "block_size": 0})


def _store_one(client: LMClient, instance: int, seed: int) -> None:
    tokens = list(range(seed * 10_000, seed * 10_000 + CHUNK))
    stored = key(tokens, f"w{seed}", worker_id=0)
    assert 1 == len(client.call("prepare_store", stored, instance)["context"]["slots"])
    assert True is client.call("commit_store", stored, instance, b"")


def engine_labels(harness) -> set[int]:
    batch = harness.events.take()
    return {event.fields["engine_id"] for event in batch.events([E.MP_STORE_START, E.MP_STORE_END])}


def test_an_engine_restarted_fifty_times_keeps_one_engine_label(lmcache, capsys):
    """Every engine start brings a new random instance id; its events name the engine by the lowest free slot,
    so fifty restarts in place leave one series, not fifty, and each start and stop is logged once."""
    harness, client = lmcache()
    rng = np.random.default_rng(5)
    for restart in range(50):
        instance = int(rng.integers(1, 2**63 - 1))
        client.call("register", registration(instance, hidden=128))
        _store_one(client, instance, restart)
        assert NO_RESULT is client.call("unregister", instance)
    assert {0} == engine_labels(harness)
    out = capsys.readouterr().out
    assert (50, 50) == (out.count("lmcache.engine_registered"), out.count("lmcache.engine_unregistered"))


def test_an_engine_killed_without_unregistering_is_reaped_and_its_slot_reused(lmcache, capsys):
    """A registration silent for REAP_AFTER_S (no ping, no transfer) goes, as LMCache 0.5.7's server reaps its
    workers: its slot is free for the next engine; a live one that pings stays."""
    now = [1000.0]
    harness, client = lmcache(server_kwargs={"clock": lambda: now[0]})
    client.call("register", registration(11, hidden=128))  # killed: never heard of again
    client.call("register", registration(12, hidden=128))  # alive: pings
    _store_one(client, 12, 1)
    now[0] += REAP_AFTER_S - 1
    assert True is client.call("ping", 12)
    now[0] += 2
    registrations = harness.server.lmcache.engine.registrations
    wait_for(lambda: not registrations.owned(11, os.geteuid()), 10, "the silent registration to be reaped")
    assert registrations.owned(12, os.geteuid())
    assert "reason='silent for 120 s (no ping, no transfer)'" in capsys.readouterr().out.replace('"', "'")
    assert False is client.call("ping", 11)  # told once that it is unknown: it would register again
    client.call("register", registration(13, hidden=128))  # the next engine takes the reaped one's slot
    _store_one(client, 13, 2)
    _store_one(client, 12, 3)
    assert {0, 1} == engine_labels(harness)
