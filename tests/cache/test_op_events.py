"""The request-flow events each operation declares (and docs/PROTOCOL.md lists) are the ones it publishes."""

from __future__ import annotations

from collections import defaultdict

import pytest
from support.blend_script import documents
from support.cache_harness import CHUNK_BYTES, MODEL

from mpcache.cache.native.ops import OPERATIONS
from mpcache.client import CacheTimeoutError
from mpcache.contract.events import EventType
from mpcache.errors import RequestError

TIER_PREFIXES = ("L1_", "L2_")  # the chunk tiers' own events, not declared per operation


def test_every_operation_publishes_exactly_its_declared_events(cache):
    """A script that drives every operation into every declared event: per operation, what it published
    (L1/L2 events aside) is within its declaration, and every declared event was published at least once."""
    harness = cache(l1_size_bytes=4 * CHUNK_BYTES)
    client = harness.client()
    seen: dict[str, set[EventType]] = defaultdict(set)
    evictions = iter(range(1000, 10_000, 10))

    def run(op: str, call, raises: type[Exception] | None = None):
        harness.events.take()
        if raises is None:
            result = call()
        else:
            with pytest.raises(raises):
                call()
            result = None
        seen[op] |= {e.etype for e in harness.events.take().events() if not e.etype.name.startswith(TIER_PREFIXES)}
        return result

    def evict_all() -> None:  # four new chunks fill the four-slot L1: everything unlocked before is evicted
        first = next(evictions)
        run("store", lambda: client.store(kv, request_id=f"evict-{first}", model_name=MODEL,
                                          chunk_hashes=list(range(first, first + 4)), block_ids=[4, 5, 6, 7]))

    b = documents()["B"]  # one chunk
    run("ping", client.ping)
    kv = run("register_buffer", lambda: client.register_buffer(8, CHUNK_BYTES))
    run("register_cuda_buffer", lambda: client.call("register_cuda_buffer", ipc_handle="00" * 64, device_index=0,
                                                    num_blocks=1, block_bytes=CHUNK_BYTES), raises=RequestError)
    run("report_block_allocations", lambda: client.report_block_allocations(
        instance_id=1, model_name=MODEL, records=[("l0", [1], [5])]))
    run("store", lambda: client.store(kv, request_id="s", model_name=MODEL, chunk_hashes=[1], block_ids=[0]))
    job = run("lookup_prefetch", lambda: client.lookup_prefetch(request_id="r", model_name=MODEL, chunk_hashes=[1]))
    run("query_prefetch_status", lambda: client.query_prefetch_status(job))
    run("retrieve", lambda: client.retrieve(kv, request_id="r", job_id=job, block_ids=[1], timeout_s=0),
        raises=CacheTimeoutError)
    run("retrieve", lambda: client.retrieve(kv, request_id="r", job_id=job, block_ids=[1]))
    # B's fingerprint points at a final object, then (stale) at a pre-computed one, then (stale) at a final one
    for step, op in enumerate(("cb_store_final", "cb_store_pre_computed", "cb_store_final")):
        evict_all()
        run(op, lambda op=op, step=step: getattr(client, op)(kv, request_id=f"cb-{step}", model_name=MODEL, tokens=b,
                                                              block_ids=[2]))
    evict_all()
    run("cb_lookup", lambda: client.cb_lookup(request_id="cb-stale", model_name=MODEL, tokens=b))
    run("cb_store_pre_computed", lambda: client.cb_store_pre_computed(kv, request_id="cb-3", model_name=MODEL,
                                                                      tokens=b, block_ids=[2]))
    lookup = run("cb_lookup", lambda: client.cb_lookup(request_id="cb-hit", model_name=MODEL, tokens=b))
    run("cb_retrieve", lambda: client.cb_retrieve(kv, request_id="cb-hit", lookup_id=lookup.lookup_id,
                                                  chunk_indices=[0], block_ids=[3]))
    run("cb_retrieve", lambda: client.cb_retrieve(kv, request_id="cb-other", lookup_id=lookup.lookup_id,
                                                  chunk_indices=[0], block_ids=[3]), raises=RequestError)
    for request_id in ("cb-0", "l0", "r"):
        run("end_session", lambda request_id=request_id: client.end_session(request_id))
    run("unregister_buffer", kv.close)

    published = {op: sorted(e.name for e in events) for op, events in seen.items()}
    declared = {op: sorted(e.name for e in OPERATIONS[op].events) for op in seen}
    assert sorted(OPERATIONS) == sorted(seen)
    assert declared == published
