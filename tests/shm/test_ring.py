"""The event ring: commit protocol, wraparound, back-pressure, untrusted bytes, torn records."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, recover_torn_record
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.telemetry.batch import EventBatch


def head_seqs(cells: np.ndarray) -> list[int]:
    """Sequence numbers of the records in a batch, in ring order."""
    return cells["seq"][cells["kind"] == layout.CELL_HEAD].tolist()


def read_all(ring, max_calls: int = 100) -> np.ndarray:
    """Every committed record, over as many read_batch calls as it takes."""
    parts = []
    for _ in range(max_calls):
        batch = ring.reader.read_batch()
        if len(batch) == 0:
            break
        parts.append(batch)
    return np.concatenate(parts) if parts else ring.reader.read_batch()


def events(ring, cells: np.ndarray):
    return EventBatch(0, cells, ring.names).events()


def emit_three_cells(ring, n: int) -> bool:
    """One 3-cell record (a head with an inline group plus two SALT cells) carrying ``n``."""
    return ring.publisher.emit(E.L1_KEYS_EVICTED, salt_counts={("a", "m"): n, ("b", "m"): n, ("c", "m"): n})


def cell_bytes(seq: int, kind: int, etype: int, index: int, *slots: int) -> bytes:
    return struct.pack("<IBBH7q", seq, kind, etype, index, *slots, *[0] * (7 - len(slots)))


def write_uncommitted(ring, seq: int, ncells: int, etype: int = int(E.CB_LOOKUP_END)) -> None:
    """What a writer killed mid-record leaves: cells at ``head`` onwards, ``head`` not stored."""
    head = read_counters(ring.segment).head
    for i in range(ncells):
        kind, index = (layout.CELL_HEAD, ncells) if i == 0 else (layout.CELL_FIELDS, i)
        offset = ring.cells_offset + ((head + i) % ring.capacity) * 64
        ring.segment.buf[offset : offset + 64] = cell_bytes(seq, kind, etype, index, 1, 2, 3)


# -- the commit protocol ------------------------------------------------------------------


def test_committed_record_is_read_once(ring):
    """A published record is returned by exactly one read_batch call."""
    ring.publisher.emit(E.CB_LOOKUP_START, (128,))

    assert ([0], []) == (head_seqs(ring.reader.read_batch()), head_seqs(ring.reader.read_batch()))


def test_uncommitted_batch_is_read_again_by_a_restarted_reader(ring):
    """read_batch(commit=False) leaves the cursor: a new reader (a restarted telemetry process)
    gets the same records; after commit() it gets none."""
    for count in (1, 2, 3):
        ring.publisher.emit_salted(E.L1_WRITE_FINISHED, "a", "m", count)
    first = ring.reader.read_batch(commit=False)
    again = RingReader(ring.segment).read_batch(commit=False)
    ring.reader.commit()
    after_commit = RingReader(ring.segment).read_batch()
    assert (3, first.tobytes(), 0) == (len(first), again.tobytes(), len(after_commit))


def test_reader_advances_tail_to_head(ring):
    """After a read, tail equals head: the consumed cells are handed back to the producer."""
    ring.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, True))
    ring.reader.read_batch()
    counters = read_counters(ring.segment)

    assert (2, 2, 0) == (counters.head, counters.tail, counters.pending_cells)


def test_read_counters_snapshot(ring):
    """read_counters reports head, tail, drops, torn, malformed, producer pid and pending cells."""
    ring.publisher.emit(E.CB_LOOKUP_START, (1,))
    ring.publisher.emit(E.CB_LOOKUP_START, ("not an int",))
    c = read_counters(ring.segment)

    assert (1, 0, 1, 0, 0, 1) == (c.head, c.tail, c.dropped, c.torn, c.malformed, c.pending_cells)


def test_oldest_pending_timestamp(ring):
    """The oldest unconsumed record's timestamp is visible to the reader; None once drained."""
    ring.publisher.emit(E.CB_LOOKUP_START, (1,), timestamp_ns=111)
    ring.publisher.emit(E.CB_LOOKUP_START, (1,), timestamp_ns=222)
    before = ring.reader.oldest_pending_timestamp_ns()
    ring.reader.read_batch()

    assert (111, None) == (before, ring.reader.oldest_pending_timestamp_ns())


def test_reattached_writer_continues_the_sequence(ring):
    """A writer attached to a ring with committed records carries on after the last sequence number."""
    for n in range(5):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))

    assert 5 == RingWriter(ring.segment).seq


# -- wraparound and back-pressure -----------------------------------------------------------


def test_record_straddling_the_end_of_the_ring(ring_factory):
    """A record that does not fit before the end continues at cell 0 and reads back whole."""
    ring = ring_factory(capacity=16)
    for n in range(5):  # 15 cells: the sixth record starts at cell 15 and wraps
        emit_three_cells(ring, n)
    ring.reader.read_batch()
    emit_three_cells(ring, 99)
    kinds = ring.reader.cell_kinds()
    wrapped_at_end = (kinds[15], kinds[0], kinds[1]) == (layout.CELL_HEAD, layout.CELL_SALT, layout.CELL_SALT)
    expected = [[("a", "m", 99), ("b", "m", 99), ("c", "m", 99)]]

    assert wrapped_at_end
    assert expected == [ev.salt_counts for ev in events(ring, ring.reader.read_batch())]


def test_many_laps_deliver_every_record_in_order(ring_factory):
    """Over many laps of a small ring, reading between bursts delivers every record once, in order."""
    ring = ring_factory(capacity=16)
    received = []
    for n in range(200):
        assert emit_three_cells(ring, n + 1)
        if n % 4 == 3:
            received += [ev.salt_counts[0][2] for ev in events(ring, ring.reader.read_batch())]

    assert list(range(1, 201)) == received


def test_full_ring_drops_and_counts(ring_factory):
    """When the reader is behind by a whole ring, append returns False and dropped_records counts it."""
    ring = ring_factory(capacity=16)
    results = [ring.publisher.emit(E.CB_LOOKUP_START, (n,)) for n in range(20)]

    assert [True] * 16 + [False] * 4 == results
    assert 4 == read_counters(ring.segment).dropped


def test_emit_salted_drops_when_full(ring_factory):
    """The one-cell fast path respects back-pressure and counts its drops too."""
    ring = ring_factory(capacity=16)
    ring.publisher.emit(E.L1_WRITE_FINISHED, salt_counts={("s", "m"): 1})  # interns the names
    results = [ring.publisher.emit_salted(E.L1_WRITE_FINISHED, "s", "m", 1) for _ in range(17)]

    assert [True] * 15 + [False] * 2 == results
    assert 2 == read_counters(ring.segment).dropped


def test_sequence_gap_equals_drops(ring_factory):
    """Every dropped record spends a sequence number, so the reader sees a gap of exactly the drops."""
    ring = ring_factory(capacity=16)
    for n in range(21):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
    first = head_seqs(ring.reader.read_batch())
    ring.publisher.emit(E.CB_LOOKUP_START, (99,))
    second = head_seqs(ring.reader.read_batch())

    assert (list(range(16)), [21]) == (first, second)
    assert 5 == read_counters(ring.segment).dropped == second[0] - first[-1] - 1


def test_writer_resumes_after_reader_advances_tail(ring_factory):
    """Once the reader frees cells, the same writer publishes again without any reset."""
    ring = ring_factory(capacity=16)
    for n in range(17):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
    ring.reader.read_batch()
    resumed = [ring.publisher.emit(E.CB_LOOKUP_START, (n,)) for n in range(100, 116)]

    assert [True] * 16 == resumed
    assert [{"num_tokens": n} for n in range(100, 116)] == [ev.fields for ev in events(ring, read_all(ring))]


def test_multi_cell_record_needs_room_for_all_its_cells(ring_factory):
    """A record is dropped whole when only some of its cells would fit."""
    ring = ring_factory(capacity=16)
    results = [emit_three_cells(ring, n) for n in range(6)]  # 5 fit (15 cells); the sixth needs 3

    assert [True] * 5 + [False] == results
    assert 15 == read_counters(ring.segment).head


def test_record_larger_than_the_ring_is_dropped(ring_factory):
    """A record with more cells than the ring holds is dropped and counted, never written."""
    ring = ring_factory(capacity=16)
    many = {(f"s{i}", "m"): 1 for i in range(20)}

    assert (False, 1, 0) == (
        ring.publisher.emit(E.L1_WRITE_FINISHED, salt_counts=many),
        read_counters(ring.segment).dropped,
        read_counters(ring.segment).head,
    )


@pytest.mark.parametrize(
    "etype, fields",
    [
        (E.CB_LOOKUP_START, (2**63,)),  # does not fit an i64
        (E.CB_LOOKUP_START, ()),  # wrong arity
        (E.CB_LOOKUP_START, (None,)),  # wrong type
        (E.L1_EVICTION_LOOP_TICK, ("high", 0.5, True)),  # not a float
    ],
)
def test_unencodable_event_is_dropped_not_raised(ring, etype, fields):
    """An event whose values cannot be encoded returns False, counts a drop and commits nothing."""
    published = ring.publisher.emit(etype, fields)
    ok_after = ring.publisher.emit(E.CB_LOOKUP_START, (7,))

    assert (False, True) == (published, ok_after)
    assert [{"num_tokens": 7}] == [ev.fields for ev in events(ring, ring.reader.read_batch())]
    assert 1 == read_counters(ring.segment).dropped


# -- the batch limit -------------------------------------------------------------------------


def test_batch_limit_cuts_only_between_records(ring_factory):
    """A batch limit that falls inside a record ends the batch before that record."""
    ring = ring_factory(capacity=64, max_batch_cells=5)
    for n in range(4):
        emit_three_cells(ring, n + 1)  # 3 cells each: a 5-cell limit fits one whole record
    sizes = [len(ring.reader.read_batch()) for _ in range(5)]

    assert [3, 3, 3, 3, 0] == sizes
    assert 0 == read_counters(ring.segment).malformed


def test_record_longer_than_the_batch_limit_is_read_whole(ring_factory):
    """A record longer than the batch limit is still delivered whole, not discarded as malformed."""
    ring = ring_factory(capacity=64, max_batch_cells=2)
    emit_three_cells(ring, 5)
    emit_three_cells(ring, 6)
    counts = [[c for _, _, c in ev.salt_counts] for ev in events(ring, read_all(ring))]

    assert [[5, 5, 5], [6, 6, 6]] == counts
    assert 0 == read_counters(ring.segment).malformed


# -- untrusted bytes -------------------------------------------------------------------------


def corrupt(ring, cell: int, fmt: str, offset: int, value: int) -> None:
    struct.pack_into(fmt, ring.segment.buf, ring.cells_offset + cell * 64 + offset, value)


@pytest.mark.parametrize(
    "what, fmt, offset, value",
    [
        ("continuation seq", "<I", 0, 12345),
        ("continuation etype", "<B", 5, int(E.L1_READ_FINISHED)),
        ("continuation index", "<H", 6, 2),
    ],
)
def test_malformed_record_is_skipped_and_counted(ring, what, fmt, offset, value):
    """A record whose cells disagree is skipped and counted in malformed_records; its neighbours survive."""
    for n in (1, 2, 3):
        emit_three_cells(ring, n)
    corrupt(ring, 4, fmt, offset, value)  # the second record occupies cells 3-5
    survivors = [ev.salt_counts[0][2] for ev in events(ring, ring.reader.read_batch())]

    assert [1, 3] == survivors
    assert 1 == read_counters(ring.segment).malformed


@pytest.mark.parametrize("length", [0, 2, 4, 1000])
def test_head_with_wrong_length_is_skipped_and_counted(ring, length):
    """A head cell whose record length disagrees with its cells is one malformed record."""
    for n in (1, 2, 3):
        emit_three_cells(ring, n)
    corrupt(ring, 3, "<H", 6, length)
    survivors = [ev.salt_counts[0][2] for ev in events(ring, read_all(ring))]

    assert [1, 3] == survivors
    assert 1 == read_counters(ring.segment).malformed


def test_last_record_claiming_cells_beyond_head_is_malformed(ring):
    """A record at head whose length runs past the committed cells is counted, not waited for."""
    emit_three_cells(ring, 1)
    corrupt(ring, 0, "<H", 6, 9)

    assert 0 == len(ring.reader.read_batch())
    assert (1, 3) == (read_counters(ring.segment).malformed, read_counters(ring.segment).tail)


def test_tail_inside_a_record_skips_to_the_next_head(ring):
    """Cells before the first head of a batch belong to no record: skipped and counted once (a reader starts
    at the tail it finds)."""
    for n in (1, 2):
        emit_three_cells(ring, n)
    struct.pack_into("<Q", ring.segment.buf, layout.OFF_TAIL, 1)

    assert [2] == [ev.salt_counts[0][2] for ev in events(ring, RingReader(ring.segment).read_batch())]
    assert 1 == read_counters(ring.segment).malformed


def test_tail_beyond_head_is_reset_and_counted(ring):
    """A tail ahead of head is nonsense: the reader jumps to head, counts it and returns nothing."""
    ring.publisher.emit(E.CB_LOOKUP_START, (1,))
    struct.pack_into("<Q", ring.segment.buf, layout.OFF_TAIL, 40)
    batch = RingReader(ring.segment).read_batch()
    c = read_counters(ring.segment)

    assert (0, 1, 1) == (len(batch), c.malformed, c.tail)


def test_tail_more_than_a_ring_behind_is_reset_and_counted(ring_factory):
    """A tail more than a ring's capacity behind head is nonsense: jump to head, count, keep serving."""
    ring = ring_factory(capacity=16)
    for n in range(40):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
        ring.reader.read_batch()
    struct.pack_into("<Q", ring.segment.buf, layout.OFF_TAIL, 0)
    reader = RingReader(ring.segment)
    skipped = len(reader.read_batch())
    ring.publisher.emit(E.CB_LOOKUP_START, (77,))

    assert (0, 1) == (skipped, read_counters(ring.segment).malformed)
    assert [{"num_tokens": 77}] == [ev.fields for ev in events(ring, reader.read_batch())]


def test_batch_without_any_head_is_counted_once(ring):
    """Committed cells none of which is a head are one malformed record, consumed, never raised."""
    emit_three_cells(ring, 1)
    corrupt(ring, 0, "<B", 4, layout.CELL_SALT)

    assert 0 == len(ring.reader.read_batch())
    assert (1, 3) == (read_counters(ring.segment).malformed, read_counters(ring.segment).tail)


# -- torn records ----------------------------------------------------------------------------


def test_uncommitted_cells_are_invisible(ring):
    """Cells written without storing head are never returned, and the reader does not wait for them."""
    ring.publisher.emit(E.CB_LOOKUP_START, (1,))
    write_uncommitted(ring, seq=1, ncells=2)
    batches = [head_seqs(ring.reader.read_batch()) for _ in range(2)]

    assert [[0], []] == batches
    assert 0 == ring.reader.pending_cells()


def test_recover_counts_one_torn_record_once(ring):
    """recover_torn_record counts a begun-but-uncommitted record exactly once, however often it runs."""
    ring.publisher.emit(E.CB_LOOKUP_START, (1,))
    write_uncommitted(ring, seq=1, ncells=2)
    calls = [recover_torn_record(ring.segment) for _ in range(3)]

    assert [True, False, False] == calls
    assert 1 == read_counters(ring.segment).torn


def test_torn_record_at_the_start_of_an_empty_ring(ring):
    """A producer killed in its very first record leaves a torn record with sequence number 0."""
    write_uncommitted(ring, seq=0, ncells=2)

    assert (True, 1) == (recover_torn_record(ring.segment), read_counters(ring.segment).torn)


def test_new_writer_continues_after_a_torn_record(ring):
    """A writer attached after a torn record counts it and continues at the next sequence number."""
    for n in range(3):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
    write_uncommitted(ring, seq=3, ncells=2)
    writer = RingWriter(ring.segment)
    Publisher(writer, Interner(ring.segment.buf, ring.intern_capacity)).emit(E.CB_LOOKUP_START, (42,))
    cells = ring.reader.read_batch()

    assert ([0, 1, 2, 3], 1) == (head_seqs(cells), read_counters(ring.segment).torn)
    assert {"num_tokens": 42} == events(ring, cells)[-1].fields


def test_stale_cell_from_a_previous_lap_is_not_torn(ring_factory):
    """After wraparound the cell at head holds an old record: that is not a torn record."""
    ring = ring_factory(capacity=16)
    for n in range(40):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
        ring.reader.read_batch()

    assert (False, 0) == (recover_torn_record(ring.segment), read_counters(ring.segment).torn)


def test_clean_ring_has_no_torn_record(ring):
    """A ring whose writer committed everything it began has nothing to recover."""
    for n in range(3):
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))

    assert (False, 0) == (recover_torn_record(ring.segment), read_counters(ring.segment).torn)


def test_torn_record_after_drops_is_counted(ring_factory):
    """A record begun after some drops carries a sequence number past the last commit; it is still torn."""
    ring = ring_factory(capacity=16)
    for n in range(18):  # 16 committed, 2 dropped: the writer's next sequence number is 18
        ring.publisher.emit(E.CB_LOOKUP_START, (n,))
    ring.reader.read_batch()
    write_uncommitted(ring, seq=ring.writer.seq, ncells=2)

    assert (True, 1) == (recover_torn_record(ring.segment), read_counters(ring.segment).torn)


def test_unencodable_record_is_not_counted_again_as_torn(ring):
    """A record dropped because a value did not pack leaves no head cell behind for recovery to count."""
    ring.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, 2**70))  # the FIELDS cell fails to pack
    RingWriter(ring.segment)  # a restarted producer attaches
    c = read_counters(ring.segment)

    assert (1, 0) == (c.dropped, c.torn)


def test_emit_salted_unencodable_count_is_not_counted_again_as_torn(ring):
    """The one-cell fast path also clears the cell it could not finish."""
    ring.publisher.emit(E.L1_WRITE_FINISHED, salt_counts={("s", "m"): 1})
    ring.reader.read_batch()
    ring.publisher.emit_salted(E.L1_WRITE_FINISHED, "s", "m", 2**64)
    RingWriter(ring.segment)
    c = read_counters(ring.segment)

    assert (1, 0) == (c.dropped, c.torn)
