"""Hybrid models over LMCache 0.5.7's engine_driven protocol: a registration of several KV cache groups (full
attention, sliding window, recurrent), objects keyed and sized per group, stores that skip what a group does
not keep, lookups whose hit is the longest prefix every group can serve under its window (LMCache's
fold/unfold), retrieves of each group's in-window suffix, and an explicit failure for what is not served."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.lmcache_client import NO_RESULT, LMClient, key, map_pool, packed_key, read_slots, registration, write_slots

from mpcache.cache.lmcache import groups
from mpcache.cache.slabs import MIN_SPOT_BYTES
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes

CHUNK = 256
MODEL = "org/model"
FULL = {"num_layers": 2, "hidden_dim_size": 64, "dtype_str": "float16", "tokens_per_block": 16, "window_tokens": 0,
        "kv_size": 2, "window_chunks": 0, "recurrent": False}
SLIDING = {"num_layers": 1, "hidden_dim_size": 64, "dtype_str": "bfloat16", "tokens_per_block": 16,
           "window_tokens": 128, "kv_size": 2, "window_chunks": 2, "recurrent": False}
RECURRENT = {"num_layers": 1, "hidden_dim_size": 32, "dtype_str": "float32", "tokens_per_block": 16,
             "window_tokens": 16, "kv_size": 1, "window_chunks": 1, "recurrent": True}
LAYOUTS = [FULL, SLIDING, RECURRENT]
OBJECT_BYTES = [2 * 2 * CHUNK * 64 * 2, 2 * 1 * 128 * 64 * 2, 1 * 16 * 32 * 4]
SHAPES = [[2, 2, CHUNK, 64], [2, 1, 128, 64], [1, 16, 32]]


def hybrid(instance_id: int, layouts: list[dict] = LAYOUTS, **fields) -> dict:
    """A registration as LMCache 0.5.7's worker sends one for a hybrid model (group 0's layout on top)."""
    return {**registration(instance_id, hidden=64, slots=CHUNK), "group_layouts": layouts, **fields}


def object_keys(tokens: list[int], chunks: range, group: int, rank: int = 0, world_size: int = 1,
                count: int = 3) -> list[int]:
    ranked = rank_hashes(chunk_hashes(tokens, CHUNK), world_size, [rank])
    every = groups.group_keys(ranked, 1, count)
    return [every[chunk * count + group] for chunk in chunks]


def logged(capsys, event: str) -> list[str]:
    """The log lines (console format) of ``event`` written so far."""
    return [line for line in capsys.readouterr().out.splitlines() if f" {event} " in line]


def readers(harness, tokens: list[int], group: int, chunks: int) -> list[int]:
    return [harness.server.l1.readers(ChunkKey(MODEL, "", k)) for k in object_keys(tokens, range(chunks), group)]


def store(client: LMClient, pool, stored: dict, skipped: list[list[int]], seed: int) -> dict[tuple[int, int], bytes]:
    """Prepare, fill and commit a hybrid store; the bytes written per (group, chunk)."""
    context = client.call("prepare_store", stored, 1, skipped)["context"]
    written = write_slots(pool, context["slots"], seed)
    assert True is client.call("commit_store", stored, 1, b"")
    return dict(zip(zip(context["group_ids"], context["chunk_indices"]), written))


@pytest.fixture
def served(lmcache):
    harness, client = lmcache()
    assert 256 == client.call("negotiate_chunk_size", 16)
    reply = client.call("register", hybrid(1))
    pool = map_pool(reply)
    yield harness, client, pool, reply
    pool.close()


def test_a_hybrid_registration_is_served_through_the_pool_and_logged_per_group(capsys, served):
    _, _, _, reply = served
    assert reply["shm_name"] and reply["pool_size"] > 0 and 0 == reply["null_block_id"]
    [line] = logged(capsys, "lmcache.engine_registered")
    for field in (f"shape={SHAPES}", "dtype=['float16', 'bfloat16', 'float32']", f"object_bytes={OBJECT_BYTES}",
                  "window_chunks=[-1, 2, 1]", "recurrent=[False, False, True]", "client_version=0.5.7"):
        assert field in line


def test_each_group_stores_what_it_keeps_in_objects_of_its_own_layout_and_serves_its_window(served):
    """A sliding-window group of 2 chunks and a recurrent group skip the chunks a 4-chunk prompt's blocks left
    null; every object has its group's shape, dtype and bytes; the lookup hits all 4 chunks (the groups need
    only their window) and locks exactly what each group needs; the retrieve returns each group's in-window
    suffix, byte for byte, and gives the locks back."""
    harness, client, pool, _ = served
    tokens = list(range(10_000, 10_000 + 4 * CHUNK + 30))
    context = client.call("prepare_store", packed_key(tokens, "w", worker_id=0), 1, [[], [0, 1], [0, 1, 2]])["context"]
    assert ([0, 0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 2, 3, 3]) == (context["group_ids"], context["chunk_indices"])
    assert [(OBJECT_BYTES[g], SHAPES[g]) for g in context["group_ids"]] == [
        (slot["length"], slot["shape"]) for slot in context["slots"]]
    assert ["float16"] * 4 + ["bfloat16"] * 2 + ["float32"] == [slot["dtype"] for slot in context["slots"]]
    written = dict(zip(zip(context["group_ids"], context["chunk_indices"]), write_slots(pool, context["slots"], 1)))
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, b"")
    client.call("end_session", "w")

    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 4 == client.call("query_prefetch_status", "r")
    assert ([1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]) == tuple(readers(harness, tokens, g, 4) for g in range(3))
    got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert True is got["success"]
    placed = list(zip(got["context"]["group_ids"], got["context"]["chunk_indices"]))
    assert [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)] == placed
    assert [written[place] for place in placed] == read_slots(pool, got["context"]["slots"])
    assert True is client.call("commit_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert all(count == 0 for g in range(3) for count in readers(harness, tokens, g, 4))


def test_a_group_of_objects_under_the_smallest_spot_is_served_each_taking_the_spot(lmcache):
    """A recurrent group of 960-byte objects (1 layer x 16 tokens x 15 x 4 bytes, one of K and V) is served, byte
    for byte, each of its objects taking the smallest spot of L1: a client's tiny layout cannot fill the pool with
    more objects, and their bookkeeping, than that allows."""
    harness, client = lmcache()
    assert 256 == client.call("negotiate_chunk_size", 16)
    pool = map_pool(client.call("register", hybrid(1, layouts=[FULL, {**RECURRENT, "hidden_dim_size": 15}])))
    try:
        tokens = list(range(20_000, 20_000 + 2 * CHUNK))
        context = client.call("prepare_store", packed_key(tokens, "w", worker_id=0), 1, [[], [0]])["context"]
        assert [OBJECT_BYTES[0], OBJECT_BYTES[0], 960] == [slot["length"] for slot in context["slots"]]
        written = write_slots(pool, context["slots"], 3)
        assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, b"")
        assert {MIN_SPOT_BYTES: (1, 1)} == {spot: held for spot, held in harness.server.l1.allocator.classes().items()
                                            if spot < OBJECT_BYTES[0]}
        assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
        got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
        assert written[2] == read_slots(pool, got["context"]["slots"])[-1]
        assert True is client.call("commit_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    finally:
        pool.close()


def test_a_retrieve_past_the_engines_prefix_returns_each_groups_window_of_the_rest(served):
    """With vLLM's own prefix cache holding the first chunk, the retrieve of chunks 1..3 names positions within
    that range: the sliding-window group its last 2, the recurrent group its last one."""
    _, client, pool, _ = served
    tokens = list(range(4 * CHUNK))
    written = store(client, pool, packed_key(tokens, "w", worker_id=0), [[], [0, 1], [0, 1, 2]], seed=2)
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r", start=CHUNK), 1)
    assert 4 == client.call("query_prefetch_status", "r")
    wanted = packed_key(tokens, "r", worker_id=0, start=CHUNK)
    got = client.call("prepare_retrieve", wanted, 1)["context"]
    assert ([0, 0, 0, 1, 1, 2], [0, 1, 2, 1, 2, 2]) == (got["group_ids"], got["chunk_indices"])
    assert [written[(g, c + 1)] for g, c in zip(got["group_ids"], got["chunk_indices"])] == read_slots(
        pool, got["slots"])
    assert True is client.call("commit_retrieve", wanted, 1)


def test_the_hit_is_the_longest_prefix_every_group_can_serve_not_the_first_gap(served):
    """The recurrent group holds chunk 1 (from a 2-chunk prompt) but not chunk 3 of the 4-chunk one: every group
    can serve 2 chunks, none can serve 3 or 4 together, so the hit is 2, with the recurrent group locking chunk
    1 only; a retrieve of all 4 chunks (what the hit does not cover) fails and gives its locks back."""
    harness, client, pool, _ = served
    tokens = list(range(20_000, 20_000 + 4 * CHUNK))
    store(client, pool, packed_key(tokens[: 2 * CHUNK], "short", worker_id=0), [[], [], [0]], seed=3)
    store(client, pool, packed_key(tokens, "long", worker_id=0), [[], [0, 1], [0, 1, 2, 3]], seed=4)
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 2 == client.call("query_prefetch_status", "r")
    assert ([1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0]) == tuple(readers(harness, tokens, g, 4) for g in range(3))
    assert {"success": False, "data": b"", "context": {}} == client.call(
        "prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "r", end=2 * CHUNK), 1, [])
    assert all(count == 0 for g in range(3) for count in readers(harness, tokens, g, 4))


def test_free_lookup_locks_gives_back_every_groups_locks_on_its_range(served):
    harness, client, pool, _ = served
    tokens = list(range(30_000, 30_000 + 3 * CHUNK))
    store(client, pool, packed_key(tokens, "w", worker_id=0), [[], [0], [0, 1]], seed=5)
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 3 == client.call("query_prefetch_status", "r")
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "r", end=CHUNK), 1, [])
    assert ([0, 1, 1], [0, 1, 1], [0, 0, 1]) == tuple(readers(harness, tokens, g, 3) for g in range(3))
    assert NO_RESULT is client.call("free_lookup_locks", packed_key(tokens, "r"), 1, [])
    assert all(count == 0 for g in range(3) for count in readers(harness, tokens, g, 3))


def test_groups_are_keyed_apart_and_group_0_as_a_model_of_one_group():
    ranked = rank_hashes(chunk_hashes(list(range(2 * CHUNK)), CHUNK), 2, [0, 1])
    keyed = groups.group_keys(ranked, 2, 3)
    assert ranked[:2] == keyed[:2] and ranked[2:] == keyed[6:8]
    assert 12 == len(set(keyed))


def test_the_curves_key_each_group_apart_with_its_own_object_size(served):
    """MRC_STORE_SAMPLED per group under ``model`` (group 0) and ``model@g<group>``, each with its object size;
    the lookup is sampled once per group, the chunks its window needs."""
    harness, client, pool, _ = served
    tokens = list(range(40_000, 40_000 + 3 * CHUNK))
    harness.events.take()
    store(client, pool, packed_key(tokens, "w", worker_id=0), [[], [0], [0, 1]], seed=6)
    stores = harness.events.take().events([E.MRC_STORE_SAMPLED])
    assert [(MODEL, 3, OBJECT_BYTES[0]), (f"{MODEL}@g1", 2, OBJECT_BYTES[1]), (f"{MODEL}@g2", 1, OBJECT_BYTES[2])] == [
        (event.fields["model_name"], event.fields["stored"], event.fields["object_bytes"]) for event in stores]
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 3 == client.call("query_prefetch_status", "r")
    lookups = harness.events.take().events([E.MRC_LOOKUP_SAMPLED])
    assert [(MODEL, 3), (f"{MODEL}@g1", 2), (f"{MODEL}@g2", 1)] == [
        (event.fields["model_name"], event.fields["found"]) for event in lookups]


@pytest.mark.parametrize(("change", "why"), [
    ({"group_layouts": [FULL] * 65}, "at most 64"),
    ({"group_layouts": [FULL, {**SLIDING, "window_tokens": 2 * CHUNK}]}, "window_tokens"),
    ({"num_physical_slots": 128}, "num_physical_slots"),
    ({"group_layouts": [FULL, {**SLIDING, "dtype_str": "complex64"}]}, "dtype_str"),
    ({"group_layouts": [FULL, {**SLIDING, "kv_size": 3}]}, "kv_size"),
    ({"group_layouts": [FULL, {**SLIDING, "window_chunks": -1}]}, "window_chunks"),
    ({"group_layouts": [FULL, {k: v for k, v in SLIDING.items() if k != "hidden_dim_size"}]}, "hidden_dim_size"),
    ({"group_layouts": [FULL, "sliding"]}, "expected a map"),
])
def test_a_hybrid_registration_that_cannot_be_served_gets_the_failure_reply_naming_why(lmcache, change, why,
                                                                                         capsys):
    _, client = lmcache()
    assert {"shm_name": "", "pool_size": 0} == client.call("register", hybrid(1, **change))
    errors = logged(capsys, "client.error")
    assert 1 == len(errors) and why in errors[0]
    assert NO_RESULT is client.call("lookup", key(list(range(CHUNK)), "r"), 1)  # still serving


@pytest.mark.parametrize(("skipped", "why"), [
    ([[], []], "one list of chunk positions per registered group (3)"),
    ([[], [2], []], "skipped_chunks[1]"),
    ([[], [-1], []], "skipped_chunks[1]"),
    ("all", "one list"),
])
def test_skipped_chunks_must_name_each_groups_positions_of_the_key(served, skipped, why, capsys):
    _, client, _, _ = served
    assert {"context": {}} == client.call("prepare_store", packed_key(list(range(2 * CHUNK)), "w", worker_id=0), 1,
                                          skipped)
    assert why in logged(capsys, "client.error")[-1]


def test_an_instance_registered_again_under_another_model_leaves_no_groups_behind(lmcache):
    """One instance registered again under another model or TP size: its KV cache groups are the new registration's
    alone; the old model and TP size are served as one group again, as before it registered, and unregistering leaves
    none (a client re-registering one instance under ever new names kept every name's groups, and a lookup of an old
    name took the hybrid path with layouts nobody had registered)."""
    harness, client = lmcache()
    assert 256 == client.call("negotiate_chunk_size", 16)
    registrations = harness.server.lmcache.engine.registrations
    client.call("register", hybrid(1))
    assert 3 == len(registrations.groups_of(MODEL, 1))
    for number, world_size in ((1, 1), (2, 2)):
        client.call("register", {**hybrid(1), "model_name": f"org/other-{number}", "world_size": world_size})
    assert [None, None, 3] == [None if found is None else len(found) for found in (
        registrations.groups_of(MODEL, 1), registrations.groups_of("org/other-1", 1),
        registrations.groups_of("org/other-2", 2))]
    client.call("unregister", 1)
    assert registrations.groups_of("org/other-2", 2) is None


def test_a_one_group_registration_may_send_no_skips_and_gets_no_group_ids(lmcache):
    _, client = lmcache()
    client.call("register", {**registration(1, hidden=128), "group_layouts": []})
    context = client.call("prepare_store", packed_key(list(range(2 * CHUNK)), "w", worker_id=0), 1, [])["context"]
    assert {"slots", "chunk_indices"} == set(context)
    assert {"context": {}} == client.call("prepare_store", packed_key(list(range(2 * CHUNK)), "x", worker_id=0), 1,
                                          [[0]])


@given(st.lists(st.tuples(st.integers(-1, 4), st.lists(st.booleans(), min_size=6, max_size=6)), min_size=1,
                max_size=4))
@settings(max_examples=300, deadline=None)
def test_hit_length_is_the_longest_prefix_every_group_serves(rows):
    """Against the definition: a prefix of L chunks is served by a group of window w when its last min(w, L)
    chunks are present (all of them for full attention, w <= 0)."""
    windows = [0 if window == 0 else window for window, _ in rows]
    present = [row for _, row in rows]

    def serves(length: int) -> bool:
        return all(all(row[groups.window_start(length, window) : length]) for window, row in zip(windows, present))

    assert max(length for length in range(7) if serves(length)) == groups.hit_length(present, windows)


def test_a_tensor_parallel_hybrid_model_locks_and_returns_each_ranks_objects(lmcache):
    """World size 2: each rank stores its own objects of every group; the scheduler's lookup needs both ranks
    of every group's window; each rank's retrieve returns its own bytes."""
    harness, client = lmcache()
    pool = map_pool(client.call("register", hybrid(1, world_size=2)))
    client.call("register", hybrid(2, world_size=2))
    tokens = list(range(50_000, 50_000 + 2 * CHUNK))
    written = {}
    for rank, instance in ((0, 1), (1, 2)):
        stored = packed_key(tokens, f"w{rank}", worker_id=rank, world_size=2)
        context = client.call("prepare_store", stored, instance, [[], [], [0]])["context"]
        written[rank] = write_slots(pool, context["slots"], 10 + rank)
        assert True is client.call("commit_store", stored, instance, b"")
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r", world_size=2), 1)
    assert 2 == client.call("query_prefetch_status", "r")
    for rank, instance in ((0, 1), (1, 2)):
        wanted = packed_key(tokens, "r", worker_id=rank, world_size=2)
        got = client.call("prepare_retrieve", wanted, instance)
        assert written[rank] == read_slots(pool, got["context"]["slots"])
        assert True is client.call("commit_retrieve", wanted, instance)
    counts = [harness.server.l1.readers(ChunkKey(MODEL, "", k)) for rank, group in itertools.product((0, 1), range(3))
              for k in object_keys(tokens, range(2), group, rank, 2)]
    assert not any(counts)
    pool.close()


def test_a_hybrid_store_s_groups_get_one_admission_verdict(lmcache):
    """Two full-attention groups, L1's 16 objects four prompts' (2 chunks × 2 groups), each looked up twice (seen
    again, and in use).  A new prompt's store would evict them: the adaptive order refuses group 0's objects,
    and group 1's of the same store with them (admitted, they would evict another prompt's object for objects no
    lookup can use without group 0's).  With the frequency gate off (its decisions proved wrong), the same prompt
    stored by a later request is admitted whole (second sight)."""
    harness, client = lmcache(l1_size_bytes=16 * OBJECT_BYTES[0], chunk_bytes=OBJECT_BYTES[0])
    harness.server.l1._order.split()  # past the recency phase: ARC's lists and second-sight admission
    assert 256 == client.call("negotiate_chunk_size", 16)
    pool = map_pool(client.call("register", hybrid(1, [FULL, FULL])))
    prompts = [list(range(base, base + 2 * CHUNK)) for base in (10_000, 20_000, 30_000, 40_000)]
    for n, tokens in enumerate(prompts):
        assert 4 == len(store(client, pool, packed_key(tokens, f"s{n}", worker_id=0), [[], []], seed=n))

    def found(tokens: list[int], request: str) -> int:
        assert NO_RESULT is client.call("lookup", packed_key(tokens, request), 1)
        hit = client.call("query_prefetch_status", request)
        client.call("end_session", request)
        return hit

    for round_ in range(2):
        assert [2] * 4 == [found(tokens, f"l{round_}-{n}") for n, tokens in enumerate(prompts)]
    new = list(range(50_000, 50_000 + 2 * CHUNK))
    assert [] == client.call("prepare_store", packed_key(new, "e", worker_id=0), 1, [[], []])["context"]["slots"]
    assert [2] * 4 == [found(tokens, f"after-{n}") for n, tokens in enumerate(prompts)]
    harness.server.l1._order.gate.score = -1  # the refusal's decision, settled by those lookups, had turned it on
    assert 4 == len(store(client, pool, packed_key(new, "f", worker_id=0), [[], []], seed=9))
    assert 2 == found(new, "g")
    pool.close()
