"""subscribe_kv_events against an in-process cache process, framed by hand as LMCache's client frames it: the
capability answer, the free first batch, one batch per credit, cancel, stored records (hash, parent, tokens) on
the engine_driven path, removed records for evictions and clear, lost with a snapshot past the log's window, and
an index built from the feed alone equal to what L1 holds."""

from __future__ import annotations

import msgpack
import pytest
from support.kv_feed import Index, Stream, block_hash
from support.lmcache_client import OBJECT_BYTES, LMClient, key, map_pool, registration, write_slots
from support.waiting import wait_for

from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes

CHUNK = 256
MODEL = "org/model"


@pytest.fixture
def served(cache):
    """Factory: a cache process serving LMCache's protocol (16 objects in L1 unless told), a registered worker
    and its mapped pool."""
    made = []

    def start(hidden: int = 64, **overrides):
        values = dict(chunk_size_tokens=CHUNK, chunk_bytes=OBJECT_BYTES, lmcache_ipc=True, lmcache_allow_clear=True,
                      l1_size_bytes=8 * OBJECT_BYTES,  # 16 of the registration's objects (half the size)
                      kv_event_log_size=32768)  # LMCache's size, the default
        values.update(overrides)
        harness = cache(**values)
        client = LMClient(harness.config.lmcache_urls(0)[0])
        pool = map_pool(client.call("register", registration(1, hidden=hidden)))
        made.append((client, pool))
        return harness, client, pool

    yield start
    for client, pool in made:
        client.close()
        pool.close()


def _store(client: LMClient, pool, tokens: list[int], request: str, salt: str = "") -> int:
    stored = key(tokens, request, worker_id=0, salt=salt)
    prepared = client.call("prepare_store", stored, 1)
    write_slots(pool, prepared["context"]["slots"], seed=len(tokens))
    assert True is client.call("commit_store", stored, 1, b"")
    client.call("end_session", request)
    return len(prepared["context"]["slots"])


def _keys(tokens: list[int], salt: str = "") -> list[ChunkKey]:
    return [ChunkKey(MODEL, salt, k) for k in rank_hashes(chunk_hashes(tokens, CHUNK), 1, [0])]


def _held(harness) -> set[tuple[str, bytes]]:
    """What L1 holds readable, as the feed names it (read while the server is idle: after a reply)."""
    return {block_hash(k) for k in harness.server.l1.readable(MODEL)}


def test_the_capability_is_answered_and_a_disabled_stream_says_so_once_then_ends(served):
    harness, client, _ = served()
    assert ["kv_event_stream"] == client.call("get_experimental")
    off, off_client, _ = served(kv_event_log_size=0)
    assert [] == off_client.call("get_experimental")
    stream = Stream(off.config.lmcache_urls(0)[0], MODEL)
    first = stream.next()
    assert first is not None and first["enabled"] is False and first["events"] == []
    assert stream.next() is None  # ended once its client had read the batch before
    stream.close()


def test_stored_records_carry_hash_parent_and_tokens_and_come_one_batch_per_credit(served):
    harness, client, pool = served()
    stream = Stream(harness.config.lmcache_urls(0)[0], MODEL)
    first = stream.next()
    # the capacity LMCache's client passes over: L1's 16 objects of this model, 256 tokens each
    assert first == {"enabled": True, "incarnation": first["incarnation"], "next_cursor": 0, "lost": False,
                     "events": [], "capacity": {"L1": {"bytes": 8 * OBJECT_BYTES, "tokens": 16 * CHUNK}}}
    tokens = list(range(5000, 5000 + 3 * CHUNK + 40))
    assert 3 == _store(client, pool, tokens, "a")
    # no credit: nothing is sent, so the reply to a ping on the same connection comes first
    assert msgpack.unpackb(stream.ping()[1]) == 22
    batch = stream.next()
    hashes = [block_hash(k)[1] for k in _keys(tokens)]
    assert [(e["seq"], e["kind"], e["medium"], e["model_name"]) for e in batch["events"]] == [
        (1, "stored", "CPU", MODEL), (2, "stored", "CPU", MODEL), (3, "stored", "CPU", MODEL)]
    assert [e["block_hashes"] for e in batch["events"]] == [[h] for h in hashes]
    assert [e["parent_block_hash"] for e in batch["events"]] == [None, hashes[0], hashes[1]]
    assert [e["token_ids"] for e in batch["events"]] == [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert (batch["next_cursor"], batch["lost"], batch["incarnation"]) == (3, False, first["incarnation"])
    # a store of a longer prompt from chunk 3 on: its first record's parent is chunk 2's key
    longer = tokens[: 3 * CHUNK] + list(range(9000, 9000 + CHUNK))
    assert 1 == _store(client, pool, longer, "b")
    batch = stream.next()
    assert [(e["seq"], e["parent_block_hash"], e["token_ids"]) for e in batch["events"]] == [
        (4, hashes[2], longer[3 * CHUNK :])]
    stream.cancel()
    assert stream.receive()[2:] == []  # the end of the stream: a reply without a batch
    stream.close()


def test_evictions_and_clear_are_removed_records_and_the_feed_names_exactly_what_l1_holds(served):
    harness, client, pool = served()
    stream = Stream(harness.config.lmcache_urls(0)[0], MODEL)
    index = Index()
    log = harness.server.l1.feed
    for n in range(12):  # 24 objects into 16: the oldest are evicted on demand
        _store(client, pool, list(range(n * 10_000, n * 10_000 + 2 * CHUNK)), f"r{n}", salt="t" if n % 3 else "")
        index.catch_up(stream, log.last)
        assert index.blocks.keys() == _held(harness)
    assert index.removed_unknown == 0 and log.last == 24 + 8
    client.call("clear")
    index.catch_up(stream, log.last)
    assert {} == index.blocks and set() == _held(harness)
    assert index.resyncs == 0 and index.removed_unknown == 0
    stream.close()


def test_a_reader_past_the_log_gets_lost_and_a_snapshot_of_what_l1_holds(served):
    harness, client, pool = served(kv_event_log_size=8)
    stream = Stream(harness.config.lmcache_urls(0)[0], MODEL, max_events=5)
    index = Index()
    index.catch_up(stream, 0)
    log = harness.server.l1.feed
    for n in range(10):  # 20 objects, 16 held, 20 + 4 records: the log's 8 are the last of them
        _store(client, pool, list(range(n * 10_000, n * 10_000 + 2 * CHUNK)), f"r{n}")
    assert log.first == log.last - 7
    before = index.resyncs
    index.catch_up(stream, log.last)  # the snapshot comes in pages of 5
    assert index.resyncs == before + 1
    assert index.blocks.keys() == _held(harness) and len(index.blocks) == 16
    with_tokens = [e for e in index.blocks.values() if e["token_ids"]]
    assert len(with_tokens) >= 4  # the stores the log still holds keep their tokens in the snapshot
    _store(client, pool, list(range(500_000, 500_000 + CHUNK)), "late")
    index.catch_up(stream, log.last)
    assert index.blocks.keys() == _held(harness)
    stream.close()



def test_l2_writes_and_evictions_are_records_of_the_tier(served):
    """A store's objects of L2's chunk size go on to the L2 tier: what each store task wrote is a ``stored`` record
    of medium ``L2:<tier>``, what it evicted to make room a ``removed`` one, so the feed's view of the tier is
    what the tier holds (asked by key), and a resync's snapshot lists what the tier holds."""
    harness, client, pool = served(hidden=128, l1_size_bytes=32 * OBJECT_BYTES,
                                   l2=[{"type": "mock", "capacity_gb": 6.5 * OBJECT_BYTES / 1e9, "failure_rate": 0.0,
                                        "seed": 1}])
    medium = f"L2:{harness.server.storage.names[0]}"
    stream = Stream(harness.config.lmcache_urls(0)[0], MODEL)
    index = Index()
    index.catch_up(stream, 0)
    prompts = [list(range(n * 10_000, n * 10_000 + 2 * CHUNK)) for n in range(5)]
    for n, tokens in enumerate(prompts):
        assert 2 == _store(client, pool, tokens, f"l2-{n}")
    wait_for(lambda: harness.server.storage.inflight == 0, 30, "the tier's store tasks (on its own threads)")
    keys = [key for tokens in prompts for key in _keys(tokens)]
    present = harness.server.storage.adapters[0].lookup(keys).result(timeout=10)
    assert sum(present) == 6  # 6.5 objects of room: four were evicted
    in_tier = {block_hash(key) for key, there in zip(keys, present) if there}
    while set(index.tiers.get(medium, {})) != in_tier:  # a batch within 10 s each, or the test fails
        batch = stream.next()
        index.apply(batch)
    assert index.blocks.keys() == _held(harness) and len(index.blocks) == 10
    assert index.removed_unknown == 0
    assert batch["capacity"][medium]["tokens"] == 6 * CHUNK  # 6.5 objects of room: 6 chunks of this model
    stream.close()
    resynced = Index()  # a cursor the log does not cover: lost, and a snapshot that lists the tier too
    stream = Stream(harness.config.lmcache_urls(0)[0], MODEL, instance_id=8, cursor=1 << 40)
    resynced.catch_up(stream, harness.server.l1.feed.last)
    assert set(resynced.tiers[medium]) == in_tier and resynced.blocks.keys() == _held(harness)
    stream.close()
