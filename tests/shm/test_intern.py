"""The per-producer intern table: stable ids, overflow, and the reader's refresh."""

from __future__ import annotations

import struct

from mpcache.shm import layout
from mpcache.shm.intern import Interner, NameTable


def test_reserved_ids(ring):
    """A fresh table maps "" to id 0 and "__overflow__" to id 1; new names start at 2."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)

    assert [0, 1, 2, 3] == [interner.id_of(n) for n in ("", "__overflow__", "llama", "tenantA")]


def test_same_name_same_id(ring):
    """Interning a name twice returns the same id and appends nothing."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    first = interner.id_of("llama")
    count = int.from_bytes(ring.segment.buf[layout.OFF_INTERN_COUNT : layout.OFF_INTERN_COUNT + 8], "little")

    assert (first, count) == (interner.id_of("llama"), 3)


def test_ids_stable_across_reattach(ring):
    """A re-attached Interner (a restarted producer) sees the existing ids and continues after them."""
    first = Interner(ring.segment.buf, ring.intern_capacity)
    ids = [first.id_of(n) for n in ("llama", "tenantA", "cuda:0")]
    second = Interner(ring.segment.buf, ring.intern_capacity)

    assert ids == [second.id_of(n) for n in ("llama", "tenantA", "cuda:0")]
    assert 5 == second.id_of("tenantB")


def test_overflow_id_when_full(ring_factory):
    """When the table is full, new names get the reserved overflow id; known names keep theirs."""
    ring = ring_factory(intern_capacity=4)
    interner = Interner(ring.segment.buf, 4)
    ids = [interner.id_of(n) for n in ("a", "b", "c", "d", "a")]

    assert [2, 3, 1, 1, 2] == ids
    assert "__overflow__" == NameTable(ring.segment.buf, 4).name(interner.id_of("c"))


def test_reader_refreshes_on_unknown_id(ring):
    """A name table created before a name was interned finds it on its first lookup of the new id."""
    names = NameTable(ring.segment.buf, ring.intern_capacity)
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    early = names.name(0)
    late_id = interner.id_of("tenantB")

    assert ("", "tenantB") == (early, names.name(late_id))


def test_unknown_id_reads_as_unknown(ring):
    """An id the producer never published decodes as "__unknown__" instead of raising."""
    names = NameTable(ring.segment.buf, ring.intern_capacity)

    assert ["__unknown__", "__unknown__"] == [names.name(40), names.name(-1)]


def test_names_lists_the_table(ring):
    """names() returns every published name, indexed by id."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    interner.id_of("llama")

    assert ["", "__overflow__", "llama"] == NameTable(ring.segment.buf, ring.intern_capacity).names()


def test_long_name_is_truncated_to_128_bytes(ring):
    """A name longer than 128 UTF-8 bytes is stored truncated, decoded with replacement."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    name_id = interner.id_of("é" * 100)  # 200 bytes; byte 128 ends a whole "é"

    assert "é" * 64 == NameTable(ring.segment.buf, ring.intern_capacity).name(name_id)


def test_non_ascii_name_round_trips(ring):
    """A UTF-8 name within the limit reads back exactly."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    name_id = interner.id_of("модель-🦙")

    assert "модель-🦙" == NameTable(ring.segment.buf, ring.intern_capacity).name(name_id)


def test_corrupt_entry_length_reads_as_corrupt(ring):
    """An entry whose length word exceeds 128 decodes as "__corrupt__"; its neighbours are unharmed."""
    interner = Interner(ring.segment.buf, ring.intern_capacity)
    ids = [interner.id_of(n) for n in ("a", "b", "c")]
    struct.pack_into("<I", ring.segment.buf, layout.intern_entry_offset(ids[1]), 5000)

    assert ["a", "__corrupt__", "c"] == [NameTable(ring.segment.buf, ring.intern_capacity).name(i) for i in ids]


def test_reader_ignores_count_beyond_capacity(ring_factory):
    """A garbage entry count larger than the table is clamped to the capacity."""
    ring = ring_factory(intern_capacity=4)
    Interner(ring.segment.buf, 4).id_of("a")
    struct.pack_into("<Q", ring.segment.buf, layout.OFF_INTERN_COUNT, 10**9)

    assert 4 == len(NameTable(ring.segment.buf, 4).names())


def test_a_full_table_stays_full_for_a_restarted_producer_until_the_ring_is_drained(ring_factory):
    """A burst of client names fills the table; a producer started while records are unread keeps it (their
    ids must still decode); once the ring is drained, the next producer starts with an empty table, new names
    get real ids again, and the consumer, told by the epoch, decodes them under their own names."""
    from mpcache.contract.events import EventType as E
    from mpcache.shm.intern import reclaim_if_drained
    from mpcache.shm.publish import Publisher
    from mpcache.telemetry.batch import EventBatch

    ring = ring_factory(capacity=1024, intern_capacity=16)
    for i in range(40):  # more distinct model names than the table holds
        ring.publisher.emit(E.MP_STORE_START, ("cpu", 0, f"junk-{i}"), session_id="r")
    assert layout.NAME_OVERFLOW_ID == ring.publisher.name_id("new-model")
    assert not reclaim_if_drained(ring.segment.buf, 16)  # 40 records unread: old ids are still needed
    old = EventBatch(0, ring.reader.read_batch(), ring.names)
    assert "junk-0" == old.events([E.MP_STORE_START])[0].fields["model_name"]
    assert reclaim_if_drained(ring.segment.buf, 16)
    restarted = Publisher(ring.writer, Interner(ring.segment.buf, 16), clock_ns=lambda: 0)
    restarted.emit(E.MP_STORE_START, ("cpu", 0, "llama-3-8b"), session_id="r")
    cells = ring.reader.read_batch()
    ring.names.sync()
    assert ["llama-3-8b"] == [e.fields["model_name"] for e in EventBatch(0, cells, ring.names).events()]
    assert not reclaim_if_drained(ring.segment.buf, 16)  # not full any more
