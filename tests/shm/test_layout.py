"""Golden bytes: the shared-memory layout of :mod:`mpcache.shm.layout`, pinned.

Expected bytes are built here from literal numbers (never from the layout
module's constants), so any change to the layout fails one of these tests and
has to come with a layout version bump.
"""

from __future__ import annotations

import os
import struct

import pytest

from mpcache.contract.events import EventType as E
from mpcache.errors import LayoutMismatchError, RingCorruptError
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, format_gauge_board
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, format_event_segment, read_geometry
from mpcache.shm.ring_reader import RingReader

TS = 0x0102030405060708
CELLS_AT = 2432  # first cell of a ring whose intern table has 16 entries: 256 + 16 * 136, 64-aligned


def cell(seq: int, kind: int, etype: int, index: int, *slots: int) -> bytes:
    """One 64-byte cell: u32 seq, u8 kind, u8 etype, u16 index, seven i64 slots."""
    return struct.pack("<IBBH7q", seq, kind, etype, index, *slots, *[0] * (7 - len(slots)))


def text_cell(seq: int, etype: int, index: int, field: int, data: bytes) -> bytes:
    """A text cell: the prefix, u8 field number, u8 bytes used, 54 bytes of UTF-8 (zero padded)."""
    return struct.pack("<IBBHBB54s", seq, 6, etype, index, field, len(data), data)


def i64(u: int) -> int:
    """The signed slot value holding the bits of the unsigned 64-bit ``u``."""
    return u - (1 << 64) if u >= 1 << 63 else u


@pytest.fixture
def ring16(ring_factory):
    """A 64-cell ring with a 16-entry intern table (cells start at byte 2432)."""
    return ring_factory(capacity=64, intern_capacity=16)


def cells(ring, start: int, count: int) -> bytes:
    return bytes(ring.segment.buf[CELLS_AT + 64 * start : CELLS_AT + 64 * (start + count)])


def test_header_bytes(ring16):
    """The event segment header: magic, version 3, cell size 64, capacity, intern capacity, producer pid."""
    expected = b"MPCRING1" + struct.pack("<IIQQq", 3, 64, 64, 16, os.getpid())

    assert expected == bytes(ring16.segment.buf[:40])


def test_cells_offset_follows_intern_table():
    """Cell 0 starts after the 256-byte header and the 136-byte intern entries, rounded up to 64."""
    assert [2432, 448, 256] == [layout.cells_offset(16), layout.cells_offset(1), layout.cells_offset(0)]


def test_one_cell_record_golden_bytes(ring16):
    """An L1 event with one salt group is a single head cell with the group inline in slots 4-6."""
    ring16.publisher.emit(E.L1_WRITE_FINISHED, salt_counts={("tenantA", "llama"): 16}, timestamp_ns=TS)
    expected = bytes.fromhex(
        "00000000" "01" "04" "0100"  # seq 0, head cell, type 4, 1 cell
        "0807060504030201"  # timestamp
        + "00" * 24  # no fixed fields
        + "0200000000000000" "0300000000000000" "1000000000000000"  # salt id 2, model id 3, count 16
    )

    assert expected == cells(ring16, 0, 1)


def test_emit_salted_writes_the_same_bytes_as_emit(ring16):
    """The one-cell fast path produces exactly the record the general encoder produces."""
    pub = Publisher(ring16.writer, Interner(ring16.segment.buf, 16), clock_ns=lambda: TS)
    pub.emit(E.L1_WRITE_FINISHED, salt_counts={("tenantA", "llama"): 16})
    pub.emit_salted(E.L1_WRITE_FINISHED, "tenantA", "llama", 16)
    first, second = cells(ring16, 0, 1), cells(ring16, 1, 1)

    assert first[4:] == second[4:]
    assert (0, 1) == (struct.unpack_from("<I", first)[0], struct.unpack_from("<I", second)[0])


def test_fields_cell_golden_bytes(ring16):
    """Fixed fields beyond the sixth go to a FIELDS cell (kind 2) right after the head."""
    ring16.publisher.emit(E.CB_LOOKUP_END, (10, 20, 30, 40, 50, 60, True), timestamp_ns=TS)
    expected = cell(0, 1, 83, 2, TS, 10, 20, 30, 40, 50, 60) + cell(0, 2, 83, 1, 1)

    assert expected == cells(ring16, 0, 2)


def test_float_fields_are_f64_bits(ring16):
    """A float field is stored as the bits of its f64; a bool as 0/1."""
    ring16.publisher.emit(E.L1_EVICTION_LOOP_TICK, (0.5, -2.25, False), timestamp_ns=TS)
    bits = [struct.unpack("<q", struct.pack("<d", f))[0] for f in (0.5, -2.25)]
    expected = cell(0, 1, 7, 1, TS, *bits, 0)

    assert expected == cells(ring16, 0, 1)


def test_salt_cell_golden_bytes(ring16):
    """Salt groups after the inline first one are SALT cells (kind 3): salt id, model id, count."""
    ring16.publisher.emit(E.L1_KEYS_EVICTED, salt_counts={("a", "m"): 5, ("b", "m"): 7}, timestamp_ns=TS)
    expected = cell(0, 1, 6, 2, TS, 0, 0, 0, 2, 3, 5) + cell(0, 3, 6, 1, 4, 3, 7)

    assert expected == cells(ring16, 0, 2)


def test_salt_cells_of_a_type_without_inline_room(ring16):
    """A salted type with more than three fixed fields keeps every group in SALT cells."""
    ring16.publisher.emit(E.L2_KEYS_EVICTED, (1, "fs", 9), salt_counts={("a", "m"): 9}, timestamp_ns=TS)  # inline
    ring16.publisher.emit(E.L2_STORE_SUBMITTED, (0, 77, "fs", 9, 4096), salt_counts={("a", "m"): 9}, timestamp_ns=TS)
    expected = (
        cell(0, 1, 29, 1, TS, 1, 2, 9, 3, 4, 9)  # ids: fs=2, a=3, m=4
        + cell(1, 1, 20, 2, TS, 0, 77, 2, 9, 4096)
        + cell(1, 3, 20, 1, 3, 4, 9)
    )

    assert expected == cells(ring16, 0, 3)


def test_one_salt_group_with_fields_golden_bytes(ring16):
    """Fixed fields and one salt group make one head cell, the group in slots 4-6; a session id adds its TEXT
    cell.  The first record of new names takes the general encoder, later ones the compiled emitter."""
    pub = ring16.publisher
    for _ in range(2):
        pub.emit(E.SM_WRITE_FINISHED, (3,), salt_counts={("a", "m"): 8}, timestamp_ns=TS)
    pub.emit(E.L1_READ_FAILED, ("l1_retrieve", "not_found"), salt_counts={("a", "m"): 2}, session_id="r1",
             timestamp_ns=TS)
    pub.emit(E.L1_READ_FAILED, ("l1_retrieve", "not_found"), salt_counts={("a", "m"): 0}, timestamp_ns=TS)
    expected = (
        cell(0, 1, 10, 1, TS, 3, 0, 0, 2, 3, 8)  # ids: a=2, m=3
        + cell(1, 1, 10, 1, TS, 3, 0, 0, 2, 3, 8)
        + cell(2, 1, 9, 2, TS, 4, 5, 0, 2, 3, 2)  # l1_retrieve=4, not_found=5
        + text_cell(2, 9, 1, 0, b"r1")
        + cell(3, 1, 9, 1, TS, 4, 5, 0, 2, 3, 0)
    )

    assert expected == cells(ring16, 0, 5)


def test_sampled_cell_golden_bytes(ring16):
    """A sampled key is a SAMPLED cell (kind 4): the u64 hash bits, salt id, model id."""
    ring16.publisher.emit(
        E.L1_READ_FINISHED, salt_counts={("s", "m"): 1}, sampled=[(2**64 - 2, "s", "m")], timestamp_ns=TS
    )
    expected = cell(0, 1, 2, 2, TS, 0, 0, 0, 2, 3, 1) + cell(0, 4, 2, 1, i64(2**64 - 2), 2, 3)

    assert expected == cells(ring16, 0, 2)


def test_block_cell_golden_bytes(ring16):
    """A block is a BLOCK cell (kind 5) naming text field 16+i, whose TEXT cell carries the request id."""
    ring16.publisher.emit(E.MP_VLLM_BLOCK_ALLOCATION, (7, "llama", 1, 1), blocks=[("reqA", 5, 2**63)],
                          timestamp_ns=TS)
    expected = (
        cell(0, 1, 60, 3, TS, 7, 2, 1, 1)
        + cell(0, 5, 60, 1, 16, 5, i64(2**63))
        + text_cell(0, 60, 2, 16, b"reqA")
    )

    assert expected == cells(ring16, 0, 3)


def test_text_cells_golden_bytes(ring16):
    """Text is split into 54-byte TEXT cells (kind 6): session_id is field 0, schema texts follow from 1."""
    message = "x" * 60
    ring16.publisher.emit(E.TIMEOUT_RAISED, ("Timeout",), texts=(message, "tb"), session_id="r1", timestamp_ns=TS)
    expected = (
        cell(0, 1, 70, 5, TS, 2)
        + text_cell(0, 70, 1, 0, b"r1")
        + text_cell(0, 70, 2, 1, b"x" * 54)
        + text_cell(0, 70, 3, 1, b"x" * 6)
        + text_cell(0, 70, 4, 2, b"tb")
    )

    assert expected == cells(ring16, 0, 5)


def test_bookkeeping_words_offsets(ring16):
    """head at byte 64, dropped at 72, tail at 128, read at 144, exported at 152, intern count at 192, each a
    u64."""
    ring16.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, True))
    ring16.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, True, 8))  # wrong arity: dropped
    ring16.reader.read_batch()
    ring16.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, True))
    ring16.reader.read_batch(commit=False)  # read, not released
    ring16.reader.mark_exported(3)
    buf = ring16.segment.buf
    expected = {"head": 4, "dropped": 1, "torn": 0, "tail": 2, "malformed": 0, "read": 4, "exported": 3,
                "interned": 2}
    actual = {
        name: int.from_bytes(buf[offset : offset + 8], "little")
        for name, offset in [("head", 64), ("dropped", 72), ("torn", 80), ("tail", 128), ("malformed", 136),
                             ("read", 144), ("exported", 152), ("interned", 192)]
    }

    assert expected == actual


def test_intern_entry_bytes(ring16):
    """Intern entry i sits at 256 + 136 i: u32 length, 4 pad bytes, the UTF-8 bytes."""
    ring16.publisher.emit(E.MP_STORE_SUBMITTED, ("cuda:0",))
    expected = struct.pack("<I4x", 6) + b"cuda:0"

    assert expected == bytes(ring16.segment.buf[256 + 136 * 2 : 256 + 136 * 2 + 14])


def test_reserved_intern_entries(ring16):
    """Ids 0 and 1 are reserved for "" and "__overflow__"."""
    expected = struct.pack("<I4x", 0) + b"\0" * 128 + struct.pack("<I4x", 12) + b"__overflow__"

    assert expected == bytes(ring16.segment.buf[256 : 256 + 136 + 20])


# -- mismatches are named errors at attach ----------------------------------------------


@pytest.fixture
def formatted(segment_factory):
    """A zero-filled segment formatted as a 64-cell ring with a 16-entry intern table."""
    segment = segment_factory(layout.event_segment_size(64, 16))
    format_event_segment(segment, 64, 16)
    return segment


@pytest.mark.parametrize("attach", [RingWriter, RingReader, read_geometry])
def test_wrong_magic_is_a_layout_mismatch(formatted, attach):
    """A segment that does not start with MPCRING1 is refused with a message saying so."""
    formatted.buf[:8] = b"NOTARING"

    with pytest.raises(LayoutMismatchError, match=r"not an mpcache event ring \(magic b'NOTARING'\)"):
        attach(formatted)


@pytest.mark.parametrize("attach", [RingWriter, RingReader, read_geometry])
def test_other_layout_version_is_a_layout_mismatch(formatted, attach):
    """A ring written by another layout version names both versions in the error."""
    struct.pack_into("<I", formatted.buf, 8, 1)

    with pytest.raises(LayoutMismatchError, match=r"ring layout version 1 .*this build reads version 3"):
        attach(formatted)


def test_other_cell_size_is_a_layout_mismatch(formatted):
    """A ring whose cells are not 64 bytes is refused."""
    struct.pack_into("<I", formatted.buf, 12, 128)

    with pytest.raises(LayoutMismatchError, match=r"cell 128 B"):
        RingReader(formatted)


def test_unformatted_segment_is_a_layout_mismatch(segment_factory):
    """A zero-filled segment nobody formatted is not mistaken for an empty ring."""
    segment = segment_factory(layout.event_segment_size(64, 16))

    with pytest.raises(LayoutMismatchError, match="not an mpcache event ring"):
        RingReader(segment)


def test_segment_smaller_than_a_header_is_a_layout_mismatch(segment_factory):
    """A segment too small to hold a ring header is refused before anything is read."""
    segment = segment_factory(128)

    with pytest.raises(LayoutMismatchError, match="too small for a ring"):
        RingReader(segment)


@pytest.mark.parametrize("capacity", [0, 48, 1 << 20])
def test_impossible_capacity_is_ring_corrupt(formatted, capacity):
    """A header claiming a capacity that is not a power of two or does not fit is RingCorruptError."""
    struct.pack_into("<Q", formatted.buf, 16, capacity)

    with pytest.raises(RingCorruptError, match=f"capacity {capacity}"):
        RingReader(formatted)


def test_format_rejects_capacity_not_a_power_of_two(segment_factory):
    """The owner cannot format a ring whose capacity is not a power of two."""
    segment = segment_factory(layout.event_segment_size(64, 16))

    with pytest.raises(ValueError, match="power of two, got 48"):
        format_event_segment(segment, 48, 16)


def test_gauge_board_header_bytes(segment_factory):
    """The gauge board header: MPCGAUGE, gauge layout version 9, slot count, adapters per slot (8)."""
    segment = segment_factory(layout.gauge_board_size(3))
    format_gauge_board(segment, 3)
    expected = b"MPCGAUGE" + struct.pack("<III", 9, 3, 8)

    assert expected == bytes(segment.buf[:20])


def test_gauge_slot_word_offsets(segment_factory):
    """Slot s starts at 64 + 416 s (52 words); adapter a's words start at word 20 + 4 a."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    GaugeSlot(segment, 1).set_adapter(2, layout.G_L2_INFLIGHT_LOADS, 42)
    word = 20 + 4 * 2 + 2

    assert 42 == int.from_bytes(segment.buf[64 + 416 + 8 * word : 64 + 416 + 8 * word + 8], "little")


@pytest.mark.parametrize("attach", [GaugeSlot, GaugeBoardReader])
def test_gauge_board_version_mismatch(segment_factory, attach):
    """A gauge board of another layout version is refused with both versions named."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    struct.pack_into("<I", segment.buf, 8, 10)
    args = (segment, 0) if attach is GaugeSlot else (segment,)

    with pytest.raises(LayoutMismatchError, match="gauge board layout version 10, this build reads 9"):
        attach(*args)
