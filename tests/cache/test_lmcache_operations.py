"""The LMCache operation table: one row per operation of LMCache's frozen id table and of its by-name
operations, each served by a handler or refused with a reason."""

from __future__ import annotations

import msgpack
import pytest

from mpcache.cache.lmcache.handlers import OPERATIONS, LMCacheHandlers
from mpcache.cache.lmcache.operations import OperationFrames
from mpcache.errors import ProtocolError

# LMCache's LEGACY_OPERATION_IDS (lmcache/v1/multiprocess/transport/zmq_impl/wire.py, 0.5.3 to 0.5.7rc3), as
# published: frozen, id 11 retired.
LMCACHE_IDS = {
    "register_kv_cache": 1, "unregister_kv_cache": 2, "register_q_cache": 3, "unregister_q_cache": 4,
    "store_q": 5, "store": 6, "retrieve": 7, "lookup": 8, "query_prefetch_status": 9, "wait_prefetch_status": 10,
    "free_lookup_locks": 12, "end_session": 13, "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15, "prepare_store": 16, "commit_store": 17,
    "prepare_retrieve": 18, "commit_retrieve": 19, "clear": 20, "get_chunk_size": 21, "ping": 22,
    "report_block_allocation": 23, "noop": 24, "cb_register_rope": 25, "cb_unregister_rope": 26,
    "cb_retrieve_pre_computed": 27, "cb_unified_lookup": 28, "p2p_lookup_and_lock": 29,
    "p2p_query_lookup_results": 30, "p2p_unlock_objects": 31, "get_experimental": 32, "cb_protocol_handshake": 33,
}
# The RPC methods LMCache 0.5.7rc3's RequestClient declares that have no id: sent by name.
LMCACHE_NAMED = {"negotiate_chunk_size", "cb_reorder_plan", "subscribe_kv_events", "server_module_call",
                 "server_module_affinity_call"}


def test_every_frozen_id_has_exactly_one_row_under_its_name():
    by_id = {}
    for row in OPERATIONS.values():
        if row.wire_id is not None:
            assert row.wire_id not in by_id, row
            by_id[row.wire_id] = row.name
    assert {wire_id: name for name, wire_id in LMCACHE_IDS.items()} == by_id


def test_every_operation_has_a_row_and_every_row_a_handler_or_a_reason():
    assert set(LMCACHE_IDS) | LMCACHE_NAMED == set(OPERATIONS)
    for row in OPERATIONS.values():
        assert (row.handler is None) != (row.unsupported is None), row
        if row.handler is not None:
            assert getattr(LMCacheHandlers, row.handler.__name__) is row.handler, row
            fewest, most = row.arguments
            assert 0 <= fewest <= most, row


@pytest.mark.parametrize("name", sorted(LMCACHE_IDS))
def test_an_operation_is_found_by_its_id_in_any_encoding_and_by_its_name(name):
    frames = OperationFrames()
    assert name == frames(msgpack.packb(LMCACHE_IDS[name])).name
    assert name == frames(b"\xcc" + bytes([LMCACHE_IDS[name]])).name  # uint8, not a fixint
    assert name == frames(msgpack.packb(name)).name


@pytest.mark.parametrize("frame", [msgpack.packb(11), msgpack.packb(34), msgpack.packb("no_such_op"),
                                   msgpack.packb(True), msgpack.packb([8]), b"\xc1", b""])
def test_anything_else_is_refused_by_name(frame):
    with pytest.raises(ProtocolError, match="op: "):
        OperationFrames()(frame)
