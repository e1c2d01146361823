"""LMCache's MP protocol on the wire: the captured conversations of LMCache 0.5.6's own client and server
replayed against mpcache, every operation's reply shape, and hostile frames (no LMCache, no torch)."""

from __future__ import annotations

import gzip
import json
import os
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.lmcache_client import NO_RESULT, OBJECT_BYTES, REPLY_TIMEOUT_S, LMClient, key, registration

from mpcache.cache.slabs import ALIGN

FRAMES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "lmcache_frames")


def _conversation(name: str) -> list[tuple[str, str, list]]:
    with gzip.open(os.path.join(FRAMES, name), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    return [(row["dir"], row["client"], [bytes.fromhex(frame) for frame in row["frames"]]) for row in rows]


def _same_shape(theirs: object, ours: object, op: int) -> None:
    """Replies agree: exact values where the server's choice is not free (hits, flags, chunk indices,
    slot shapes), only the form where it is (pool name and size, byte offsets)."""
    if op == 14:  # registration: our pool, not theirs (0.5.7 adds null_block_id, the same in both)
        assert theirs.get("null_block_id") == ours.get("null_block_id")
        assert set(theirs) == set(ours) and ours["shm_name"] and ours["pool_size"] > 0
    elif op in (16, 18):
        assert set(theirs) == set(ours)
        their_slots, our_slots = theirs["context"].get("slots", []), ours["context"].get("slots", [])
        strip = [{k: v for k, v in slot.items() if k != "offset"} for slot in their_slots]
        assert strip == [{k: v for k, v in slot.items() if k != "offset"} for slot in our_slots]
        assert all(slot["offset"] % ALIGN == 0 for slot in our_slots)  # byte offsets, cache-line aligned
        assert theirs["context"].get("chunk_indices") == ours["context"].get("chunk_indices")
        assert theirs.get("success") == ours.get("success")
    else:
        assert theirs == ours


@pytest.mark.parametrize("capture", ["tp2-engine-driven.jsonl.gz", "tp1-prefix-cache.jsonl.gz",
                                     "0.5.7rc3/tp2-engine-driven.jsonl.gz", "0.5.7rc3/tp1-prefix-cache.jsonl.gz",
                                     "0.5.7rc3/tp1-lookup-start.jsonl.gz"])
def test_a_captured_lmcache_conversation_gets_the_same_replies(lmcache, capture):
    """Every request LMCache's adapters (0.5.6, and 0.5.7rc3: packed tokens, chunk-size negotiation, lookups
    past the engine's prefix cache, the trailing arguments) sent to LMCache's own server of the same version,
    replayed in order, gets a reply of the same form from mpcache: the same frames, the same hit counts, slots
    of the same shapes for the same chunk indices.  The captured servers recorded no KV events (their
    ``get_experimental`` said ``[]``), so neither does this one."""
    harness, _ = lmcache(kv_event_log_size=0)
    url = harness.config.lmcache_urls(0)[0]
    clients: dict[str, LMClient] = {}
    replies: dict[tuple[str, bytes], list[bytes]] = {}
    compared = 0
    try:
        for direction, who, frames in _conversation(capture):
            if direction == "request":
                client = clients.setdefault(who, LMClient(url))
                replies[(who, frames[0])] = client.send_raw(frames)
                continue
            ours = replies.pop((who, frames[0]))
            assert frames[:2] == ours[:2] and len(frames) == len(ours), (frames[:2], ours)
            if len(frames) == 3:
                _same_shape(msgpack.unpackb(frames[2], raw=False), msgpack.unpackb(ours[2], raw=False),
                            msgpack.unpackb(frames[1]))
            compared += 1
    finally:
        for client in clients.values():
            client.close()
    assert compared >= 50  # the whole conversation, not a prefix of it


def test_every_served_operation_answers_with_lmcaches_reply_shape(lmcache):
    """One call of each operation the engine_driven connector uses, checked against LMCache's types."""
    _, client = lmcache()
    assert 256 == client.call("get_chunk_size")
    assert ["kv_event_stream"] == client.call("get_experimental")  # on by default (--kv-event-log-size 32768)
    assert "OK" == client.call("noop")
    assert True is client.call("ping", None)  # the scheduler's probe
    reply = client.call("register", registration(7, hidden=128))
    assert True is client.call("ping", 7)
    assert (reply["pool_size"], reply["shm_name"]) == (64 * OBJECT_BYTES, harness_pool_name(reply))
    tokens = list(range(700))
    assert NO_RESULT is client.call("lookup", key(tokens, "r1", end=512), 1)
    assert 0 == client.call("query_prefetch_status", "r1")  # cold
    assert 0 == client.call("query_prefetch_status", "r1")  # consumed: unknown from now on
    prepared = client.call("prepare_store", key(tokens, "r1", worker_id=0, end=512), 7)
    assert [0, 1] == prepared["context"]["chunk_indices"]
    assert True is client.call("commit_store", key(tokens, "r1", worker_id=0, end=512), 7, b"")
    assert NO_RESULT is client.call("end_session", "r1")
    assert NO_RESULT is client.call("lookup", key(tokens, "r2", end=512), 1)
    assert 2 == client.call("wait_prefetch_status", "r2", 1.0)
    retrieve = client.call("prepare_retrieve", key(tokens, "r2", worker_id=0, end=512), 7)
    assert (True, b"", 2) == (retrieve["success"], retrieve["data"], len(retrieve["context"]["slots"]))
    assert True is client.call("commit_retrieve", key(tokens, "r2", worker_id=0, end=512), 7)
    assert NO_RESULT is client.call("free_lookup_locks", key(tokens, "r2", end=256), 1)
    assert NO_RESULT is client.call("report_block_allocation", 7, "org/model",
                                    [{"req_id": "r2", "new_block_ids": [1, 2], "new_token_ids": [5] * 32}])
    assert NO_RESULT is client.call("end_session", "r2")
    assert NO_RESULT is client.call("clear", False)
    assert NO_RESULT is client.call("unregister", 7)


def test_a_worker_this_process_does_not_know_is_told_once_so_that_it_registers_again(lmcache):
    """After a cache process restarts, a worker's heartbeat gets one False (its adapter turns unhealthy,
    then re-registers on the next, True, ping); a registered worker's pings are always True."""
    _, client = lmcache()
    assert [False, True, True] == [client.call("ping", 41) for _ in range(3)]
    client.call("register", registration(42))
    assert [True, True] == [client.call("ping", 42) for _ in range(2)]


def harness_pool_name(reply: dict) -> str:
    """The pool is named so that Python's multiprocessing.shared_memory opens it (no leading slash)."""
    name = reply["shm_name"]
    assert not name.startswith("/") and os.path.exists(os.path.join("/dev/shm", name))
    return name


@pytest.mark.parametrize(("op", "args", "expected"), [
    ("register_kv_cache", [1, [], "m", 1, "vllm", None, []], NO_RESULT),
    ("store", [key([1] * 256, "x", worker_id=0), 1, [[0]], b""], [b"", False]),
    ("retrieve", [key([1] * 256, "x", worker_id=0), 1, [[0]], b"", 0], [b"", False]),
    (33, ["0.5.6"], [0, False]),  # cb_protocol_handshake
    (29, [], NO_RESULT),  # p2p_lookup_and_lock
])
def test_unsupported_operations_fail_fast_with_one_warning_per_client(lmcache, op, args, expected, capsys):
    """lmcache_driven transfers, blending and p2p get LMCache's failure value (or an empty
    reply) at once, and the log says once per client what to change."""
    _, client = lmcache()
    assert expected == client.call(op, *args)
    assert expected == client.call(op, *args)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "lmcache.unsupported_operation" in line]
    assert 1 == len(warnings)
    if op == "register_kv_cache":
        assert '"lmcache.mp.mp_transfer_mode": "engine_driven"' in warnings[0].replace("\\", "")
    assert True is client.call("ping", None)


def test_a_client_is_warned_once_also_when_the_warned_table_starts_over(lmcache, monkeypatch, capsys):
    """The table of clients warned is bounded (``MAX_WARNED_CLIENTS``): the client whose warning starts it over is
    still warned once, not again at its next call."""
    from mpcache.cache.lmcache import frontend

    monkeypatch.setattr(frontend, "MAX_WARNED_CLIENTS", 1)
    harness, first = lmcache()
    second = LMClient(harness.config.lmcache_urls(0)[0])
    try:
        for client in (first, second, second):
            assert NO_RESULT == client.call(29)  # p2p_lookup_and_lock: unsupported
    finally:
        second.close()
    warnings = [line for line in capsys.readouterr().out.splitlines() if "lmcache.unsupported_operation" in line]
    assert 2 == len(warnings)


@pytest.mark.parametrize(("op", "args", "failure"), [
    ("prepare_store", [key([1] * 256, "x", worker_id=0), 99], {"context": {}}),  # instance never registered
    ("prepare_retrieve", [key([1] * 256, "x", worker_id=0), 99], {"success": False, "data": b"", "context": {}}),
    ("commit_store", [key([1] * 256, "x", worker_id=0), 99, b"\x80\x04\x95pickle"], False),
    ("commit_store", [{"model_name": "m"}, 99, b""], False),  # key without its fields
    ("query_prefetch_status", [17], 0),  # wrong type
    ("lookup", [key([1] * 256, "x", readers=0), 1], NO_RESULT),  # pre-0.5.5 client: no num_kv_readers
    ("lookup", [key([1] * 256, "x", salt="a/b"), 1], NO_RESULT),  # forbidden character in the salt
    ("register", [registration(1, dtype="complex128")], {"shm_name": "", "pool_size": 0}),
    ("get_chunk_size", [1, 2, 3], NO_RESULT),  # arguments it does not take
    (99, [], NO_RESULT),  # unknown operation id
    ("no_such_operation", [], NO_RESULT),
])
def test_a_refused_request_gets_the_failure_value_and_the_server_keeps_serving(lmcache, op, args, failure):
    _, client = lmcache()
    assert failure == client.call(op, *args)
    assert 256 == client.call("get_chunk_size")


def test_objects_larger_than_the_native_chunk_are_stored_at_byte_offsets(lmcache):
    """An object twice --chunk-bytes registers (the pool is offered) and its store gets slots of its own
    length at distinct, aligned byte offsets inside the pool."""
    _, client = lmcache()
    reply = client.call("register", registration(1, hidden=256))
    assert reply["shm_name"] and reply["pool_size"] == 64 * OBJECT_BYTES
    slots = client.call("prepare_store", key(list(range(512)), "big", worker_id=0), 1)["context"]["slots"]
    assert [2 * OBJECT_BYTES] * 2 == [slot["length"] for slot in slots]
    offsets = sorted(slot["offset"] for slot in slots)
    assert offsets[1] - offsets[0] >= 2 * OBJECT_BYTES and offsets[1] + 2 * OBJECT_BYTES <= reply["pool_size"]
    assert all(offset % ALIGN == 0 for offset in offsets)


def test_an_object_larger_than_l1_warns_once_and_every_store_fails_at_once(lmcache, capsys):
    """A registration whose object exceeds the whole L1 is accepted (the worker maps the pool, so it never
    pickles KV into a frame), logs one warning naming both sizes and --l1-size, and each prepare_store
    answers at once with no slots (the worker's store fails; its commit finds nothing)."""
    _, client = lmcache()
    big = registration(1, hidden=1 << 14)  # 2 x 2 x 256 x 16384 x 2 bytes = 32 MiB > 64 objects of 128 KiB
    object_bytes = 2 * 2 * 256 * (1 << 14) * 2
    assert client.call("register", big)["pool_size"] > 0
    assert client.call("register", registration(2, hidden=1 << 14))["pool_size"] > 0  # a second rank: no 2nd line
    for request in ("a", "b"):
        started = time.monotonic()
        stored = key(list(range(256)), request, worker_id=0)
        assert {"context": {}} == client.call("prepare_store", stored, 1)
        assert False is client.call("commit_store", stored, 1, b"")
        # at once, not waiting for space (in vain: the object never fits) until the client gives up: two round
        # trips take milliseconds, so only a stall of seconds reaches half the client's reply deadline
        assert time.monotonic() - started < REPLY_TIMEOUT_S / 2
    lines = [line for line in capsys.readouterr().out.splitlines() if "lmcache.object_larger_than_l1" in line]
    assert 1 == len(lines)
    assert f"object_bytes={object_bytes}" in lines[0] and f"l1_bytes={64 * OBJECT_BYTES}" in lines[0]
    assert "--l1-size 32MiB" in lines[0]


def test_malformed_frames_are_answered_or_dropped_and_nothing_is_unpickled(lmcache):
    """Not msgpack, an extension type (CUDA IPC wrappers), too few frames: the server answers what it can
    address and keeps serving."""
    _, client = lmcache()
    uid = msgpack.packb(5)
    assert [uid, b"\xc1"] == client.send_raw([uid, b"\xc1"])  # 0xc1 is never valid msgpack
    ext = msgpack.packb(msgpack.ExtType(1, b"\0" * 64))
    assert [uid, msgpack.packb(8)] == client.send_raw([uid, msgpack.packb(8), ext, msgpack.packb(1)])
    client.socket.send_multipart([uid])  # no operation frame: nothing to answer to
    assert 256 == client.call("get_chunk_size")


_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
                       | st.binary(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.integers(0, 40) | st.sampled_from(["lookup", "subscribe_kv_events", ""]),
       args=st.lists(_VALUES, max_size=4), junk=st.binary(max_size=16))
def test_fuzzed_requests_each_get_exactly_one_reply(lmcache_server, op, args, junk):
    """Any op id and any msgpack arguments (and a raw junk frame) get one reply echoing uid and op; the
    server answers a ping afterwards."""
    client = lmcache_server
    frames = [msgpack.packb(1), msgpack.packb(op)] + [msgpack.packb(arg, use_bin_type=True) for arg in args]
    for sent in (frames, frames + [junk]):
        reply = client.send_raw(sent)
        assert sent[:2] == reply[:2] and len(reply) in (2, 3)
        assert not client.socket.poll(0), "exactly one reply"
    assert True is client.call("ping", None)


@pytest.fixture
def lmcache_server(lmcache):
    _, client = lmcache()
    client.call("register", registration(1))
    return client
