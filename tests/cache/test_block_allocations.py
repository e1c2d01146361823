"""Block allocation reports (L0 shadow monitoring): the server op → the exact events it publishes."""

from __future__ import annotations

import pytest
from support.cache_harness import CHUNK_BYTES, MODEL

from mpcache.cache.l0 import (
    MAX_BLOCKS_PER_EVENT,
    MAX_CELLS_PER_EVENT,
    block_sample_hash,
    split_tokens,
)
from mpcache.client import BlockReport
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import SampleGate, token_hash
from mpcache.errors import ProtocolError

ALLOC = E.MP_VLLM_BLOCK_ALLOCATION
END = E.MP_VLLM_END_SESSION


def _allocations(batch):
    """(fields, blocks) of every MP_VLLM_BLOCK_ALLOCATION in ring order."""
    return [(e.fields, e.blocks) for e in batch.events([ALLOC])]


def test_report_publishes_one_event_with_totals_and_per_block_token_hashes(cache):
    """Three records (one without new blocks): one event with the totals (3 records, 4 blocks) and,
    per new block, its request id, block id and the hash of its share of the record's tokens."""
    harness = cache()
    client = harness.client()
    tokens_a = list(range(100, 132))
    reply = client.report_block_allocations(instance_id=42, model_name=MODEL,
                                            records=[("A", [3, 4], tokens_a), ("B", [], [1, 2]),
                                                     ("C", [9, 10], [7, 8, 9])])
    batch = harness.events.take()

    assert BlockReport(records=3, blocks=4, sampled=4, events=1) == reply
    assert [({"instance_id": 42, "model_name": MODEL, "record_count": 3, "block_count": 4},
             [("A", 3, token_hash(tokens_a[:16])), ("A", 4, token_hash(tokens_a[16:])),
              ("C", 9, token_hash([7])), ("C", 10, token_hash([8, 9]))])] == _allocations(batch)
    assert [ALLOC] == [e.etype for e in batch.events()]


def test_tokens_are_split_evenly_and_the_last_block_takes_the_remainder():
    """10 tokens over 3 blocks: 3, 3 and 4; no blocks: nothing; fewer tokens than blocks: the last has them."""
    assert ([[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]], [], [[], [], [1, 2]]) == (
        split_tokens([1, 2, 3], list(range(10))), split_tokens([], [1]), split_tokens([1, 2, 3], [1, 2]))


def test_blocks_are_sampled_by_the_stable_gate_on_instance_and_block(cache):
    """At rate 0.1, exactly the blocks whose blake2b-64 hash of (instance_id, block_id) passes the gate
    are shipped — every time they are reported — while the counts cover all 600 blocks."""
    harness = cache(metrics_sample_rate=0.1)
    client = harness.client()
    gate = SampleGate(0.1)
    records = [(f"r{i}", list(range(i * 100, (i + 1) * 100)), list(range(1600))) for i in range(6)]
    expected = [(rid, b) for rid, blocks, _ in records for b in blocks if gate(block_sample_hash(7, b))]
    client.report_block_allocations(instance_id=7, model_name=MODEL, records=records)
    client.report_block_allocations(instance_id=7, model_name=MODEL, records=records)
    batch = harness.events.take()

    shipped = [[(rid, b) for rid, b, _ in blocks] for _, blocks in _allocations(batch)]
    assert [expected, expected] == shipped
    assert [(6, 600), (6, 600)] == [(f["record_count"], f["block_count"]) for f, _ in _allocations(batch)]
    assert 30 < len(expected) < 100  # about a tenth: the gate is neither all nor nothing


def test_a_report_without_sampled_blocks_still_publishes_its_counts(cache):
    """Counters count every block: a report whose blocks all fail the gate is one event with no blocks."""
    harness = cache(metrics_sample_rate=0.01)
    client = harness.client()
    gate = SampleGate(0.01)
    unsampled = [b for b in range(50) if not gate(block_sample_hash(1, b))][:3]
    reply = client.report_block_allocations(instance_id=1, model_name=MODEL,
                                            records=[("A", unsampled, list(range(48)))])

    assert (BlockReport(records=1, blocks=3, sampled=0, events=1),
            [({"instance_id": 1, "model_name": MODEL, "record_count": 1, "block_count": 3}, [])]) == (
        reply, _allocations(harness.events.take()))


def test_an_empty_report_publishes_nothing(cache):
    """A step without records is answered with zeros and publishes no event."""
    harness = cache()
    client = harness.client()
    assert (BlockReport(records=0, blocks=0, sampled=0, events=0), 0) == (
        client.report_block_allocations(instance_id=1, model_name=MODEL, records=[]), len(harness.events.take()))


def test_a_large_report_is_split_and_only_the_first_event_carries_the_totals(cache):
    """450 sampled blocks with short request ids: events of 200, 200 and 50 blocks, in order; the totals
    ride on the first event only, so counters summing the events count each block once."""
    harness = cache()
    client = harness.client()
    records = [("req", list(range(450)), list(range(450)))]
    reply = client.report_block_allocations(instance_id=5, model_name=MODEL, records=records)
    events = _allocations(harness.events.take())

    assert BlockReport(records=1, blocks=450, sampled=450, events=3) == reply
    assert [(1, 450, 200), (0, 0, 200), (0, 0, 50)] == [
        (f["record_count"], f["block_count"], len(blocks)) for f, blocks in events]
    assert [("req", b, token_hash([b])) for b in range(450)] == [blk for _, blocks in events for blk in blocks]


def test_long_request_ids_cut_events_by_ring_cells(cache):
    """A 128-byte request id takes 3 text cells besides its block cell: at most 512 cells, so 128 blocks,
    go in one event (and the request id survives whole)."""
    harness = cache()
    client = harness.client()
    rid = "x" * 128
    client.report_block_allocations(instance_id=5, model_name=MODEL, records=[(rid, list(range(130)), [])])
    events = _allocations(harness.events.take())

    assert [MAX_CELLS_PER_EVENT // 4, 130 - MAX_CELLS_PER_EVENT // 4] == [len(blocks) for _, blocks in events]
    assert {rid} == {r for _, blocks in events for r, _, _ in blocks}
    assert MAX_CELLS_PER_EVENT // 4 < MAX_BLOCKS_PER_EVENT


def test_end_session_publishes_vllm_end_session_for_a_request_owning_sampled_blocks(cache):
    """end_session of a request with reported blocks publishes MP_VLLM_END_SESSION (session id = request
    id) once; a request that also stored publishes MP_REQUEST_END too; an unknown one publishes nothing."""
    harness = cache()
    client = harness.client()
    kv = client.register_buffer(1, CHUNK_BYTES)
    client.report_block_allocations(instance_id=1, model_name=MODEL, records=[("A", [1], [5]), ("B", [2], [6])])
    client.store(kv, request_id="B", model_name=MODEL, chunk_hashes=[123], block_ids=[0])
    harness.events.take()

    known = [client.end_session("A"), client.end_session("A"), client.end_session("B"), client.end_session("Z")]
    batch = harness.events.take()

    assert [True, False, True, False] == known
    assert [(END, "A"), (END, "B"), (E.MP_REQUEST_END, "B")] == [(e.etype, e.session_id) for e in batch.events()]


@pytest.mark.parametrize(("records", "error"), [
    ("nope", "records: expected a list of [request_id, block_ids, token_ids], got str"),
    ([["A", [1]]], "records[0]: expected [request_id, block_ids, token_ids]"),
    ([["A", [1], [2]], {"a": 1}], "records[1]: expected [request_id, block_ids, token_ids]"),
    ([["", [1], [2]]], "records[0].request_id: expected a non-empty string"),
    ([[7, [1], [2]]], "records[0].request_id: expected a non-empty string"),
    ([["A", 1, [2]]], "records[0].block_ids: expected a list of integers, got int"),
    ([["A", [1, -1], [2]]], "records[0].block_ids: every entry must be an integer in 0..2**63-1"),
    ([["A", [1], [2.5]]], "records[0].token_ids: every entry must be an integer in 0..2**63-1"),
    ([["A", list(range(40000)), []], ["B", list(range(30000)), []]],
     "records: more than 65536 block ids in one report"),
])
def test_malformed_reports_are_refused_with_one_line_naming_the_field(cache, records, error):
    """Every part of a report is checked before anything is published; the reply names the field."""
    harness = cache()
    client = harness.client()
    with pytest.raises(ProtocolError) as raised:
        client.call("report_block_allocations", instance_id=1, model_name=MODEL, records=records)
    assert (error, 0) == (str(raised.value), len(harness.events.take()))


@pytest.mark.parametrize(("args", "error"), [
    ({"model_name": MODEL, "records": []}, "instance_id: missing (required by report_block_allocations)"),
    ({"instance_id": "1", "model_name": MODEL, "records": []}, "instance_id: expected an integer, got str"),
    ({"instance_id": 1, "model_name": "a@b", "records": []},
     "model_name: contains a forbidden character (@ \\, NUL or a control character)"),
    ({"instance_id": 1, "model_name": MODEL, "records": [], "extra": 1},
     "unexpected field(s) for report_block_allocations: extra"),
])
def test_report_arguments_are_validated(cache, args, error):
    """instance_id, model_name and the argument set itself are checked like every other op's."""
    harness = cache()
    with pytest.raises(ProtocolError) as raised:
        harness.client().call("report_block_allocations", **args)
    assert error == str(raised.value)
