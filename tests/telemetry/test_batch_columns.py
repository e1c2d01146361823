"""EventBatch's column views agree with fully decoded events; group_sums, the one group-by."""

from __future__ import annotations

import random
import struct

import numpy as np

from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS, SCHEMAS, FieldKind
from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch, group_sums, rows_of


def test_session_ids_match_decoded_events(ring):
    """session_ids() returns each record's session id — short, empty, non-ASCII and multi-cell alike."""
    sessions = ["req-1", "", "rëq-ünïcode", "x" * 54, "y" * 55, "z" * 128, "req-7"]
    for i, session in enumerate(sessions):
        ring.publisher.emit(E.MP_STORE_START, ("cpu", i, "m"), session_id=session)
        ring.publisher.emit_salted(E.L1_WRITE_FINISHED, "a", "m", 1)  # records without a session in between
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    heads = batch.heads_of([E.MP_STORE_START])
    decoded = [event.session_id for event in batch.events([E.MP_STORE_START])]
    assert (sessions, sessions) == ([s.decode() for s in batch.session_ids(heads)], decoded)


def test_table_columns_match_decoded_events(ring):
    """table() gives, in ring order, the type, timestamp and fields (0 where a type lacks one)."""
    ring.publisher.emit(E.MP_STORE_START, ("cpu", 3, "m"), session_id="s")
    ring.publisher.emit(E.MP_STORE_END, ("cpu", 3, "m", 2, 4096, 512), session_id="s")
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    etypes, timestamps, columns = batch.table([E.MP_STORE_START, E.MP_STORE_END], ("engine_id", "total_bytes"))
    expected = ([int(E.MP_STORE_START), int(E.MP_STORE_END)], [ring.timestamp_ns] * 2,
                {"engine_id": [3, 3], "total_bytes": [0, 4096]})
    assert expected == (etypes, timestamps, columns)


def test_group_sums_groups_lexicographically_with_exact_sums():
    """Groups by several int columns come in ascending order of (first, second, ...) — negative values
    included — with integer sums per weight column; bool weights count the true rows."""
    first = np.array([2, -1, 2, 2, -1], dtype=np.int64)
    second = np.array([7, 9, 3, 7, 9], dtype=np.int64)
    big = np.array([2**60, 1, 2**60, 1, 0], dtype=np.int64)
    flags = np.array([True, False, True, True, True])
    assert {(-1, 9): [1, 1], (2, 3): [2**60, 1], (2, 7): [2**60 + 1, 2]} == group_sums((first, second), (big, flags))


def test_group_sums_without_keys_or_rows():
    """No key columns: one group () over all rows; no rows: no groups."""
    weights = np.array([3, 4], dtype=np.int64)
    empty = np.array([], dtype=np.int64)
    assert ({(): [7, 2]}, {}, {}) == (group_sums((), (weights, np.ones(2, dtype=bool))), group_sums((), (empty,)),
                                      group_sums((empty,), (empty,)))


def test_salt_groups_carry_their_records_fields(ring):
    """salt_groups() gives every salt group with the fixed fields of its record, inline groups and
    groups in their own cells alike; salt_totals() sums them per (cache_salt, model_name)."""
    ring.publisher.emit(E.L1_READ_FAILED, ("l1_retrieve", "not_found"), salt_counts={("a", "m"): 2, ("b", "m"): 3})
    ring.publisher.emit(E.L1_WRITE_FINISHED, salt_counts={("a", "m"): 100})  # another type in between
    ring.publisher.emit(E.L1_READ_FAILED, ("l1_retrieve", "write_locked"), salt_counts={("a", "n"): 5})
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    salts, models, counts, fields = batch.salt_groups([E.L1_READ_FAILED], ("reason",))
    name = batch.names.name
    rows = sorted(zip(map(name, salts.tolist()), map(name, models.tolist()), counts.tolist(),
                      map(name, fields["reason"].tolist())))
    assert ([("a", "m", 2, "not_found"), ("a", "n", 5, "write_locked"), ("b", "m", 3, "not_found")],
            {("a", "m"): 2, ("b", "m"): 3, ("a", "n"): 5}) == (rows, batch.salt_totals([E.L1_READ_FAILED]))


def test_table_and_field_columns_match_decoded_events_for_every_layout(ring):
    """table() and field_column() agree with decoded events over types whose fields sit in different places:
    float fields (read back truncated to ints by table()), a field in a continuation cell, a field only
    some of the types have, one type alone and several together, a type that is not in the batch."""
    for i in range(3):
        ring.publisher.emit(E.MP_STORE_END, ("cpu", i, "m", i, 4096 * i, 512 + i), session_id=f"r{i}")
        ring.publisher.emit(E.L1_EVICTION_LOOP_TICK, (0.5 + i, 0.8, i % 2 == 0))
        ring.publisher.emit(E.MP_RETRIEVE_END, ("cuda:0", 7, "m", "s", i, 2048 * i, 300 + i), session_id=f"q{i}")
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    wanted = [E.MP_STORE_END, E.L1_EVICTION_LOOP_TICK, E.MP_RETRIEVE_END, E.MP_STORE_START]
    names = ("engine_id", "total_bytes", "num_tokens", "usage", "triggered")
    events = batch.events(wanted)

    def value(event, name):
        field = event.fields.get(name, 0)
        return int(field) if isinstance(field, (bool, float)) else field

    expected = ([int(e.etype) for e in events], [e.timestamp_ns for e in events],
                {name: [value(e, name) for e in events] for name in names})
    alone = [e for e in events if e.etype == E.MP_RETRIEVE_END]
    ticks = [e for e in events if e.etype == E.L1_EVICTION_LOOP_TICK]
    assert (expected, ([int(E.MP_RETRIEVE_END)] * 3, [e.timestamp_ns for e in alone],
                       {name: [value(e, name) for e in alone] for name in names}),
            {name: [value(e, name) for e in ticks] for name in ("usage", "triggered")},
            [e.fields["usage"] for e in ticks], [e.fields["num_tokens"] for e in alone]) == (
        batch.table(wanted, names), batch.table([E.MP_RETRIEVE_END, E.MP_STORE_START], names),
        batch.table([E.L1_EVICTION_LOOP_TICK], ("usage", "triggered"))[2],
        batch.field_column(E.L1_EVICTION_LOOP_TICK, "usage").tolist(),
        batch.field_column(E.MP_RETRIEVE_END, "num_tokens").tolist())


def test_fixed_fields_match_decoded_events_for_every_layout(ring):
    """fixed_fields() gives every fixed field of every record of a type, in ring order, as the decoded events
    have them (names as ids, floats as their bits, hashes as signed slots): a type whose fields fit the head
    cell, one with exactly the head's six, ones with one and three continuation cells, records with salt,
    sampled-key and session cells between them, and a type that is not in the batch."""
    rng = random.Random(11)
    times_fields = len(SCHEMAS[E.LMCACHE_REQUEST_TIMES].fields)
    for i in range(4):
        ring.publisher.emit(E.L1_EVICTION_LOOP_TICK, (0.5 + i, 0.8, i % 2 == 0))
        ring.publisher.emit(E.MP_STORE_END, ("cpu", i, "m", i, 4096 * i, 512 + i), session_id=f"r{i}")
        ring.publisher.emit(E.MP_RETRIEVE_END, ("cuda:0", 7, "m", "s", i, 2048 * i, 300 + i), session_id=f"q{i}")
        ring.publisher.emit(E.MRC_LOOKUP_SAMPLED, ("m", f"s{i}", 2, 3, 1, 4 + 32 * i, 1, 0, 1,
                                                   *(rng.getrandbits(64) for _ in (*MRC_HEAD_FIELDS,
                                                                                    *MRC_TAIL_MARK_FIELDS))),
                            sampled=[(rng.getrandbits(64), f"s{i}", "m")] * i)
        ring.publisher.emit(E.LMCACHE_REQUEST_TIMES, (f"op{i}", *range(i, i + times_fields - 1)))
    batch = EventBatch(0, ring.reader.read_batch(), ring.names)
    name = batch.names.name

    def raw(event, field, kind):
        value = event.fields[field]
        if kind is FieldKind.NAME:
            return value
        if kind is FieldKind.FLOAT:
            return struct.unpack("<q", struct.pack("<d", value))[0]
        if kind is FieldKind.HASH:
            return value - (1 << 64) if value >= 1 << 63 else value
        return int(value)

    for etype in (E.L1_EVICTION_LOOP_TICK, E.MP_STORE_END, E.MP_RETRIEVE_END, E.MRC_LOOKUP_SAMPLED,
                  E.LMCACHE_REQUEST_TIMES, E.MP_STORE_START):
        schema = SCHEMAS[etype]
        expected = [[raw(event, field, kind) for field, kind in schema.fields] for event in batch.events([etype])]
        rows = batch.fixed_fields(etype).tolist()
        got = [[name(value) if kind is FieldKind.NAME else value for value, (_, kind) in zip(row, schema.fields)]
               for row in rows]
        assert (etype, 0 if etype == E.MP_STORE_START else 4, expected) == (etype, len(got), got)


def test_fixed_fields_never_read_a_short_record_s_fields_from_the_record_after_it(ring):
    """A record whose length leaves out FIELDS cells its schema has (a buggy producer) is not in the batch: no
    fields read from the record after it, which the batch keeps."""
    ring.publisher.emit(E.LMCACHE_REQUEST_TIMES, ("lookup", *range(len(SCHEMAS[E.LMCACHE_REQUEST_TIMES].fields) - 1)))
    ring.publisher.emit(E.MP_STORE_END, ("cpu", 1, "m", 2, 4096, 512))
    cells = ring.reader.read_batch()
    short = np.concatenate((cells[:1], cells[cells["etype"] == E.MP_STORE_END]))
    short["index"][0] = 1
    batch = EventBatch(0, short, ring.names)
    assert (1, 0, 1) == (batch.unknown_records, len(batch.fixed_fields(E.LMCACHE_REQUEST_TIMES)),
                         batch.count([E.MP_STORE_END]))
    assert 1 == len(EventBatch(0, cells, ring.names).fixed_fields(E.LMCACHE_REQUEST_TIMES))


def test_rows_of_is_isin():
    """rows_of() selects the same rows as np.isin for any event-type bytes, known types or not."""
    rng = np.random.default_rng(7)
    column = rng.integers(0, 256, 5000).astype(np.uint8)
    for wanted in ([], [int(E.MP_STORE_END)], [int(e) for e in E], rng.integers(0, 256, 40).tolist()):
        assert np.array_equal(np.isin(column, wanted), rows_of(column, wanted))


def test_a_record_shorter_than_its_type_s_fields_is_dropped_and_counted_not_the_batch(ring):
    """A record whose cells cannot hold its type's fixed fields (corrupt shared memory, or a writer that broke off)
    is left out of the batch and counted with the records of unknown types; the rest of the batch reads as it would
    without it (a subscriber reading the type's fields whole lost the whole batch to it)."""
    pad = (0,) * (len(MRC_HEAD_FIELDS) - 1 + len(MRC_TAIL_MARK_FIELDS))
    for number in range(4):
        ring.publisher.emit(E.MRC_LOOKUP_SAMPLED, ("m", "", 1, 1, 1, 1, 0, 0, 0, number + 1, *pad))
    cells = ring.reader.read_batch()
    whole = EventBatch(0, cells, ring.names)
    heads = np.flatnonzero(cells["kind"] == cells["kind"][0])
    short = cells[heads[0]:heads[0] + 1].copy()
    short["index"] = 1  # a record of its head cell alone, where the type needs more
    spliced = np.concatenate((cells[:heads[2]], short, cells[heads[2]:]))
    batch = EventBatch(0, spliced, ring.names)
    assert (0, 1, 4) == (whole.unknown_records, batch.unknown_records, len(batch))
    assert whole.fixed_fields(E.MRC_LOOKUP_SAMPLED).tolist() == batch.fixed_fields(E.MRC_LOOKUP_SAMPLED).tolist()
    assert [event.fields for event in whole.events([E.MRC_LOOKUP_SAMPLED])] == [
        event.fields for event in batch.events([E.MRC_LOOKUP_SAMPLED])]
