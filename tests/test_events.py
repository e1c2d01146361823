"""Every event type survives publish → ring → EventBatch unchanged (property tests).

Each example gets a fresh ring, so sequence numbers and intern ids start over
and the examples cannot influence one another.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpcache.contract.events import (
    BLOCK_REQUEST_ID_MAX_BYTES,
    SCHEMAS,
    SESSION_ID_MAX_BYTES,
    TEXT_MAX_BYTES,
    EventType,
    FieldKind,
)
from mpcache.shm import layout
from mpcache.shm.intern import Interner, NameTable
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, format_event_segment
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment
from mpcache.telemetry.batch import Event, EventBatch

TS = 1_712_345_678_901_234_567
PRODUCER = 7
CAPACITY = 256
INTERN_CAPACITY = 256

PROPERTY = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def fresh_ring() -> Iterator[tuple[Publisher, RingReader, NameTable]]:
    """A ring of its own for one example, closed and unlinked afterwards."""
    name = f"/mpcache.{os.getpid()}.{uuid.uuid4().hex[:8]}.events"
    segment = Segment.create(name, layout.event_segment_size(CAPACITY, INTERN_CAPACITY))
    try:
        format_event_segment(segment, CAPACITY, INTERN_CAPACITY)
        publisher = Publisher(RingWriter(segment), Interner(segment.buf, INTERN_CAPACITY), clock_ns=lambda: TS)
        yield publisher, RingReader(segment), NameTable(segment.buf, INTERN_CAPACITY)
    finally:
        segment.close()
        Segment.unlink(name)


def truncated(text: str, max_bytes: int) -> str:
    """What the decoder returns for ``text`` after the producer's byte truncation."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", "replace")


def utf8_prefix(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` within ``max_bytes`` UTF-8 bytes, cut at a character boundary."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")


names = st.text(st.characters(codec="utf-8"), max_size=160).map(lambda s: utf8_prefix(s, layout.INTERN_MAX_BYTES))
int64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
counts = st.integers(1, 2**63 - 1)  # a group with count 0 means "no group" in the inline slots

FIELD_VALUES = {
    FieldKind.INT: int64,
    FieldKind.FLOAT: st.floats(allow_nan=False, allow_infinity=False),
    FieldKind.BOOL: st.booleans(),
    FieldKind.NAME: names,
    FieldKind.HASH: u64,
}


def salt_count_maps(count_values=counts):
    return st.dictionaries(st.tuples(names, names), count_values, max_size=5)


@st.composite
def published_events(draw, etype: EventType) -> dict:
    """Keyword arguments for Publisher.emit of one random, valid ``etype`` event."""
    schema = SCHEMAS[etype]
    return {
        "fields": tuple(draw(FIELD_VALUES[kind]) for _, kind in schema.fields),
        "salt_counts": draw(salt_count_maps()) if schema.salt_counts else None,
        "sampled": draw(st.lists(st.tuples(u64, names, names), max_size=4)) if schema.sampled else [],
        "session_id": draw(st.text(st.characters(codec="utf-8"), max_size=200)),
        "texts": tuple(draw(st.text(st.characters(codec="utf-8"), max_size=TEXT_MAX_BYTES[t] // 2 + 50))
                       for t in schema.texts),
        "blocks": draw(st.lists(st.tuples(st.text(st.characters(codec="utf-8"), max_size=140), int64, u64),
                                max_size=4)) if schema.blocks else [],
    }


def expected_event(etype: EventType, kw: dict) -> Event:
    schema = SCHEMAS[etype]
    return Event(
        etype=etype,
        timestamp_ns=TS,
        producer=PRODUCER,
        seq=0,
        session_id=truncated(kw["session_id"], SESSION_ID_MAX_BYTES),
        fields=dict(zip(schema.field_names, kw["fields"])),
        salt_counts=[(salt, model, count) for (salt, model), count in (kw["salt_counts"] or {}).items()],
        sampled=list(kw["sampled"]),
        texts={name: truncated(text, TEXT_MAX_BYTES[name]) for name, text in zip(schema.texts, kw["texts"])},
        blocks=[(truncated(rid, BLOCK_REQUEST_ID_MAX_BYTES), block_id, th) for rid, block_id, th in kw["blocks"]],
    )


@pytest.mark.parametrize("etype", list(EventType), ids=lambda e: e.name)
@PROPERTY
@given(data=st.data())
def test_round_trip_every_event_type(etype, data):
    """Whatever valid values an event carries, the telemetry side decodes exactly what was published."""
    kw = data.draw(published_events(etype))
    with fresh_ring() as (publisher, reader, names_table):
        published = publisher.emit(etype, **kw)
        decoded = EventBatch(PRODUCER, reader.read_batch(), names_table).events()

    assert published
    assert [expected_event(etype, kw)] == decoded


@pytest.mark.parametrize(
    "session_id, expected",
    [
        ("é" * 100, "é" * 64),  # 200 bytes, cut at a character boundary
        ("a" + "é" * 100, "a" + "é" * 63 + "\ufffd"),  # cut inside a character
        ("🦙" * 40, "🦙" * 32),
        ("r" * 128, "r" * 128),
    ],
)
def test_session_id_truncated_to_max_bytes(session_id, expected):
    """A session id longer than SESSION_ID_MAX_BYTES keeps its first 128 bytes and still decodes."""
    with fresh_ring() as (publisher, reader, names_table):
        publisher.emit(EventType.MP_REQUEST_START, session_id=session_id)
        (event,) = EventBatch(PRODUCER, reader.read_batch(), names_table).events()

    assert expected == event.session_id


def test_event_sequence_numbers_follow_publish_order():
    """Decoded events carry the per-ring sequence numbers in the order they were published."""
    with fresh_ring() as (publisher, reader, names_table):
        for etype in EventType:
            publisher.emit(etype, tuple(0 if k is not FieldKind.NAME else "x" for _, k in SCHEMAS[etype].fields))
        decoded = EventBatch(PRODUCER, reader.read_batch(), names_table).events()

    assert [(i, etype) for i, etype in enumerate(EventType)] == [(ev.seq, ev.etype) for ev in decoded]


SALTED = [etype for etype in EventType if SCHEMAS[etype].salt_counts]
small_counts = st.integers(1, 2**40)  # sums stay exact however the aggregate is computed


@st.composite
def salted_events(draw) -> list[tuple[EventType, dict]]:
    """A list of salted events: (type, keyword arguments for emit)."""
    out = []
    for etype in draw(st.lists(st.sampled_from(SALTED), max_size=12)):
        schema = SCHEMAS[etype]
        fields = tuple(draw(FIELD_VALUES[kind]) for _, kind in schema.fields)
        out.append((etype, {"fields": fields, "salt_counts": draw(salt_count_maps(small_counts))}))
    return out


def summed(events: list[tuple[EventType, dict]], etypes) -> dict[tuple[str, str], int]:
    total: Counter = Counter()
    for etype, kw in events:
        if etype in etypes:
            total.update(kw["salt_counts"])
    return dict(total)


@settings(max_examples=30, deadline=None)
@given(events=salted_events())
def test_salt_totals_equal_sum_of_published_salt_counts(events):
    """salt_totals over every salted type equals the sum of the published salt_counts per (salt, model)."""
    with fresh_ring() as (publisher, reader, names_table):
        for etype, kw in events:
            assert publisher.emit(etype, **kw)
        totals = EventBatch(PRODUCER, reader.read_batch(), names_table).salt_totals(SALTED)

    assert summed(events, SALTED) == totals


@settings(max_examples=30, deadline=None)
@given(events=salted_events(), chosen=st.sets(st.sampled_from(SALTED), min_size=1))
def test_salt_totals_only_count_the_requested_types(events, chosen):
    """salt_totals for a subset of types sums only the records of those types."""
    with fresh_ring() as (publisher, reader, names_table):
        for etype, kw in events:
            publisher.emit(etype, **kw)
        totals = EventBatch(PRODUCER, reader.read_batch(), names_table).salt_totals(sorted(chosen))

    assert summed(events, chosen) == totals


def test_emit_salted_matches_salt_totals():
    """Events published on the one-cell fast path are counted by salt_totals like any other."""
    with fresh_ring() as (publisher, reader, names_table):
        for n in range(1, 11):
            publisher.emit_salted(EventType.L1_WRITE_FINISHED, "tenantA" if n % 2 else "tenantB", "llama", n)
        totals = EventBatch(PRODUCER, reader.read_batch(), names_table).salt_totals([EventType.L1_WRITE_FINISHED])
        dropped = read_counters(reader.segment).dropped

    assert ({("tenantA", "llama"): 25, ("tenantB", "llama"): 30}, 0) == (totals, dropped)
