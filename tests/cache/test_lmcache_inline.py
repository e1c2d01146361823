"""LMCache 0.5.7's typed inline transfer: the envelope codec against the client's own bytes and bounds, and
the cache process serving a worker that cannot map the pool (``shm_name ""``): stores that carry their objects,
retrieves that return them, nothing unpickled, no slot for a peer that could not have written it."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from support.lmcache_client import NO_RESULT, LMClient, key, packed_key, registration
from support.lmcache_inline import CHUNK, OBJECT, objects

from mpcache.cache.lmcache import inline, registrations
from mpcache.cache.lmcache.groups import layout
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey, chunk_hashes, rank_hashes
from mpcache.errors import ProtocolError

# LMCache 0.5.7rc3's tensor_wire.encode_tensors([a, a + 1]) and encode_grouped_tensors([([0, 2], [a, a + 1]),
# ([1], [arange(3, float32)])]), a = arange(8, dtype=float16).reshape(2, 4)
RC3_FLAT = bytes.fromhex(
    "82a776657273696f6e01a774656e736f72739283a56474797065a7666c6f61743136a57368617065920204a464617461c410000000"
    "3c00400042004400450046004783a56474797065a7666c6f61743136a57368617065920204a464617461c410003c004000420044"
    "0045004600470048")
RC3_GROUPED = bytes.fromhex(
    "82a776657273696f6e01a667726f7570739282ad6368756e6b5f696e6469636573920002a774656e736f72739283a56474797065"
    "a7666c6f61743136a57368617065920204a464617461c4100000003c00400042004400450046004783a56474797065a7666c6f61"
    "743136a57368617065920204a464617461c410003c004000420044004500460047004882ad6368756e6b5f696e64696365739101"
    "a774656e736f72739183a56474797065a7666c6f61743332a573686170659103a464617461c40c000000000000803f00000040")
SMALL = layout([2, 4], "half")
THREE = layout([3], "float32")
A = np.arange(8, dtype=np.float16).tobytes()
A1 = (np.arange(8, dtype=np.float16) + 1).tobytes()


def envelope(**change) -> bytes:
    tensor = {"dtype": "float16", "shape": [2, 4], "data": A}
    value = {"version": 1, "tensors": [tensor, {**tensor, "data": A1}], **change}
    return msgpack.packb({k: v for k, v in value.items() if v is not None}, use_bin_type=True)


def test_the_clients_envelopes_decode_and_ours_are_byte_for_byte_the_clients():
    assert [A, A1] == inline.decode(RC3_FLAT, SMALL, 2)
    assert [([0, 2], [A, A1]), ([1], [np.arange(3, dtype=np.float32).tobytes()])] == inline.decode_grouped(
        RC3_GROUPED, [(SMALL, 3), (THREE, 2)])
    assert RC3_FLAT == inline.encode(SMALL, [A, A1])
    assert RC3_GROUPED == inline.encode_grouped([(SMALL, [0, 2], [A, A1]),
                                                 (THREE, [1], [np.arange(3, dtype=np.float32).tobytes()])])


@pytest.mark.parametrize(("payload", "why"), [
    ("text", "expected bytes"),
    (RC3_FLAT[:-3], "not one bounded msgpack envelope"),
    (b"\x80\x04\x95pickled", "not one bounded msgpack envelope"),
    (envelope(extra=1), "unknown field 'extra'"),
    (envelope(tensors=None), "missing field 'tensors'"),
    (envelope(version=2), "version 2"),
    (envelope(version=True), "version True"),
    (envelope(tensors=[{"dtype": "float16", "shape": [2, 4], "data": A}]), "1 tensors for the request's 2 chunks"),
    (envelope(tensors=[{"dtype": "float16", "shape": [2, 4], "data": A, "stride": [4, 1]}] * 2),
     "unknown field 'stride'"),
    (envelope(tensors=[{"dtype": "float32", "shape": [2, 4], "data": A}] * 2), "this group's objects are float16"),
    (envelope(tensors=[{"dtype": "complex64", "shape": [2, 4], "data": A}] * 2), "not a supported torch dtype"),
    (envelope(tensors=[{"dtype": "float16", "shape": [4, 2], "data": A}] * 2), "shape: [4, 2]"),
    (envelope(tensors=[{"dtype": "float16", "shape": [1] * 17, "data": A}] * 2), "at most 16 sizes"),
    (envelope(tensors=[{"dtype": "float16", "shape": [2, 4], "data": A[:-1]}] * 2), "15 bytes for shape"),
    (envelope(tensors=[{"dtype": "float16", "shape": [2, 4], "data": "text"}] * 2), "str bytes for shape"),
    (msgpack.packb({"version": 1, "tensors": [msgpack.ExtType(1, b"x")] * 2}), "extension type 1"),
    (msgpack.packb({"version": 1, "tensors": [[]] * 60_000}), "more containers than 2 tensors need"),
])
def test_a_bad_envelope_is_one_error_naming_what_is_wrong(payload, why):
    with pytest.raises(ProtocolError, match="^data: .*" + why.replace("[", r"\[").replace("]", r"\]")):
        inline.decode(payload, SMALL, 2)


@pytest.mark.parametrize(("groups", "why"), [
    ([{"chunk_indices": [1, 0], "tensors": [{"dtype": "float16", "shape": [2, 4], "data": A}] * 2}], "increasing"),
    ([{"chunk_indices": [0, 0], "tensors": [{"dtype": "float16", "shape": [2, 4], "data": A}] * 2}], "increasing"),
    ([{"chunk_indices": [3], "tensors": [{"dtype": "float16", "shape": [2, 4], "data": A}]}], "below 3"),
    ([{"chunk_indices": [0, 1], "tensors": [{"dtype": "float16", "shape": [2, 4], "data": A}]}],
     "2 chunk positions for 1 tensors"),
    ([], "0 groups for the registration's 1"),
])
def test_a_bad_grouped_envelope_is_one_error_naming_what_is_wrong(groups, why):
    payload = msgpack.packb({"version": 1, "groups": groups}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=why):
        inline.decode_grouped(payload, [(SMALL, 3)])


def test_an_envelope_is_bounded_by_l1_and_the_clients_own_limits():
    assert 64 * inline.METADATA_BYTES_PER_TENSOR << 10 == inline.frame_bytes(0)
    assert inline.MAX_TOTAL_BYTES + (64 << 20) == inline.frame_bytes(1 << 50)


def test_only_the_pools_own_uid_and_root_map_it():
    assert registrations.can_map_pool(os.geteuid()) and registrations.can_map_pool(0)
    assert not registrations.can_map_pool(os.geteuid() + 4242)


# -- a worker that cannot map the pool ----------------------------------------------------------------


@pytest.fixture
def unmapped(lmcache, monkeypatch):
    """A cache process whose LMCache peers cannot map its pool (as another allowed uid), and a client."""
    monkeypatch.setattr(registrations, "can_map_pool", lambda owner: False)
    return lmcache()


def test_a_worker_that_cannot_map_the_pool_stores_and_retrieves_inline(unmapped, capsys):
    """``shm_name ""`` tells the 0.5.7 worker to move its bytes inline; its store carries every chunk of the
    request, its retrieve returns the chunks the lookup locked, byte for byte, and gives the locks back."""
    harness, client = unmapped
    assert {"shm_name": "", "pool_size": 0, "null_block_id": 0} == client.call("register", {
        **registration(1), "group_layouts": []})
    assert "transfer_mode='engine_driven (inline)'" in capsys.readouterr().out
    tokens = list(range(3 * CHUNK + 9))
    stored = packed_key(tokens, "w", worker_id=0)
    assert {"context": {}} == client.call("prepare_store", stored, 1, [])
    sent = objects(3, seed=1)
    harness.events.take()
    assert True is client.call("commit_store", stored, 1, inline.encode(OBJECT, sent))
    [end] = harness.events.take().events([E.MP_STORE_END])
    assert (3, 3 * OBJECT.object_bytes, 3 * CHUNK) == (end.fields["stored_count"], end.fields["total_bytes"],
                                                       end.fields["num_tokens"])
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 3 == client.call("query_prefetch_status", "r")
    got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert (True, {}) == (got["success"], got["context"])
    assert sent == inline.decode(got["data"], OBJECT, 3)
    keys = rank_hashes(chunk_hashes(tokens, CHUNK), 1, [0])
    assert [0, 0, 0] == [harness.server.l1.readers(ChunkKey("org/model", "", k)) for k in keys]  # given back
    assert True is client.call("commit_retrieve", packed_key(tokens, "r", worker_id=0), 1)


def test_an_inline_registration_gets_no_slot_so_commits_nothing_it_did_not_write(unmapped):
    """The hardening finding: a peer that cannot map the pool must not make readable a slot it never wrote (its
    bytes would be whatever the slot held before).  It gets no slot, and an empty commit stores nothing."""
    _, client = unmapped
    client.call("register", {**registration(1), "group_layouts": []})
    tokens = list(range(2 * CHUNK))
    assert {"context": {}} == client.call("prepare_store", packed_key(tokens, "w", worker_id=0), 1, [])
    assert False is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, b"")
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 0 == client.call("query_prefetch_status", "r")


@pytest.mark.parametrize("data", [b"\x80\x04\x95pickled", inline.encode(OBJECT, [b"\0" * OBJECT.object_bytes])])
def test_a_bad_inline_store_fails_alone_stores_nothing_and_the_process_keeps_serving(unmapped, data, capsys):
    _, client = unmapped
    client.call("register", {**registration(1), "group_layouts": []})
    tokens = list(range(2 * CHUNK))
    assert False is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, data)
    [error] = [line for line in capsys.readouterr().out.splitlines() if " client.error " in line]
    assert "op=commit_store" in error and "data: " in error
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 0 == client.call("query_prefetch_status", "r")


def test_a_hybrid_model_stores_and_retrieves_inline_group_by_group(unmapped):
    """The grouped envelope: each group carries the chunks it keeps; the retrieve returns each group's window."""
    harness, client = unmapped
    full = {"num_layers": 2, "hidden_dim_size": 64, "dtype_str": "float16", "tokens_per_block": 16}
    window = {**full, "num_layers": 1, "window_tokens": 64, "window_chunks": 1, "recurrent": True}
    client.call("register", {**registration(1), "group_layouts": [full, window]})
    small = layout([2, 1, 64, 64], "float16")
    tokens = list(range(3 * CHUNK))
    sent = objects(3, seed=2), objects(1, seed=3, size=small.object_bytes)
    data = inline.encode_grouped([(OBJECT, [0, 1, 2], sent[0]), (small, [2], sent[1])])
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, data)
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 3 == client.call("query_prefetch_status", "r")
    got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert [([0, 1, 2], sent[0]), ([2], sent[1])] == inline.decode_grouped(got["data"], [(OBJECT, 3), (small, 3)])


def test_an_inline_transfer_larger_than_the_default_frame_cap_goes_through(lmcache, monkeypatch):
    """32 objects of 256 KiB (8 MiB, over the 6 MiB cap of a frame of tokens): the connection that registered may
    send and be sent frames up to what L1 holds."""
    monkeypatch.setattr(registrations, "can_map_pool", lambda owner: False)
    _, client = lmcache(l1_size_bytes=64 << 20)
    client.call("register", {**registration(1, hidden=128), "group_layouts": []})
    big = layout([2, 2, CHUNK, 128], "float16")
    tokens = list(range(32 * CHUNK))
    sent = objects(32, seed=4, size=big.object_bytes)
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, inline.encode(big, sent))
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 32 == client.call("query_prefetch_status", "r")
    got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert sent == inline.decode(got["data"], big, 32)


def test_a_056_worker_that_cannot_map_the_pool_is_told_so_and_its_pickles_stay_refused(unmapped):
    _, client = unmapped
    assert {"shm_name": "", "pool_size": 0} == client.call("register", registration(1))
    tokens = list(range(CHUNK))
    assert False is client.call("commit_store", key(tokens, "w", worker_id=0), 1, b"\x80\x04\x95pickled")
    assert {"success": False, "data": b"", "context": {}} == client.call(
        "prepare_retrieve", key(tokens, "w", worker_id=0), 1)


def test_a_worker_given_the_pool_that_sends_its_objects_inline_is_served_inline_from_then_on(lmcache, capsys):
    """LMCache 0.5.7's worker falls back to inline transfer when it cannot open the pool it was told (a container
    without the shared /dev/shm): its inline store is taken, as LMCache's server takes it, and from then on its
    stores get no slot and its retrieves return their objects (a slot it cannot read would be a miss)."""
    _, client = lmcache()
    assert client.call("register", {**registration(1), "group_layouts": []})["shm_name"]
    tokens = list(range(2 * CHUNK))
    sent = objects(2, seed=5)
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1, inline.encode(OBJECT, sent))
    assert "transfer_mode='engine_driven (inline)'" in capsys.readouterr().out
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 2 == client.call("query_prefetch_status", "r")
    got = client.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert sent == inline.decode(got["data"], OBJECT, 2)
    assert {"context": {}} == client.call("prepare_store", packed_key(tokens + list(range(CHUNK)), "x", worker_id=0),
                                          1, [])


def test_an_inline_retrieve_larger_than_an_inline_frame_is_a_miss_that_gives_its_locks_back(unmapped, capsys):
    harness, client = unmapped
    client.call("register", {**registration(1), "group_layouts": []})
    tokens = list(range(2 * CHUNK))
    assert True is client.call("commit_store", packed_key(tokens, "w", worker_id=0), 1,
                               inline.encode(OBJECT, objects(2, seed=7)))
    assert NO_RESULT is client.call("lookup", packed_key(tokens, "r"), 1)
    assert 2 == client.call("query_prefetch_status", "r")
    harness.server.lmcache.engine.transfers._max_inline = OBJECT.object_bytes  # as if L1 held more than 16 GiB
    assert {"success": False, "data": b"", "context": {}} == client.call(
        "prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
    assert " lmcache.inline_retrieve_too_large " in capsys.readouterr().out
    keys = rank_hashes(chunk_hashes(tokens, CHUNK), 1, [0])
    assert [0, 0] == [harness.server.l1.readers(ChunkKey("org/model", "", k)) for k in keys]


def test_a_worker_that_reconnects_moves_large_objects_inline_on_its_new_connection(lmcache, monkeypatch):
    """The connection that registered is gone (LMCache's client reconnects by itself): the worker's next
    prepare_store on its new connection lets that one carry an 8 MiB commit and be sent as large a retrieve."""
    monkeypatch.setattr(registrations, "can_map_pool", lambda owner: False)
    harness, client = lmcache(l1_size_bytes=64 << 20)
    client.call("register", {**registration(1, hidden=128), "group_layouts": []})
    client.close()
    again = LMClient(harness.config.lmcache_urls(0)[0])
    try:
        big = layout([2, 2, CHUNK, 128], "float16")
        tokens = list(range(32 * CHUNK))
        sent = objects(32, seed=8, size=big.object_bytes)
        stored = packed_key(tokens, "w", worker_id=0)
        assert {"context": {}} == again.call("prepare_store", stored, 1, [])
        assert True is again.call("commit_store", stored, 1, inline.encode(big, sent))
        assert NO_RESULT is again.call("lookup", packed_key(tokens, "r"), 1)
        assert 32 == again.call("query_prefetch_status", "r")
        got = again.call("prepare_retrieve", packed_key(tokens, "r", worker_id=0), 1)
        assert sent == inline.decode(got["data"], big, 32)
    finally:
        again.close()
