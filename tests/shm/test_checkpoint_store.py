"""The telemetry process's checkpoint records (mpcache.shm.checkpoint): a write cut short at any instant leaves
the previous record the one read; a record that is corrupt, of another format or too large is never taken."""

from __future__ import annotations

import os
import random
import signal
import struct
import time
import zlib

import pytest

from mpcache.errors import LayoutMismatchError
from mpcache.shm import layout
from mpcache.shm.checkpoint import CheckpointRefused, StateStore, format_state_segment, record_capacity

TAG = b"format-tag-00001"
OTHER_TAG = b"format-tag-00002"
CAPACITY = 1 << 20


@pytest.fixture
def segment(segment_factory):
    segment = segment_factory(layout.state_segment_size(CAPACITY))
    format_state_segment(segment, CAPACITY)
    return segment


def payload_of(sequence: int, size: int = 4096) -> bytes:
    """What the writers here store as record ``sequence``: its number repeated, so a record read back says
    whether it is whole."""
    return sequence.to_bytes(8, "little") * (size // 8)


def header(segment, record: int) -> tuple[int, int]:
    """(sequence, length) of record 0 or 1."""
    return struct.unpack_from("<QQ", segment.buf, layout.state_record_offset(record, CAPACITY))


def torn(segment) -> bool:
    """Whether a record that was written is not whole now (its number zeroed, or not what its checksum says)."""
    for record in (0, 1):
        offset = layout.state_record_offset(record, CAPACITY)
        head = bytes(segment.buf[offset : offset + layout.REC_HEADER_SIZE])
        sequence, length = struct.unpack_from("<QQ", head)
        payload = bytes(segment.buf[offset + layout.REC_HEADER_SIZE : offset + layout.REC_HEADER_SIZE + length])
        if length and (sequence == 0 or zlib.crc32(payload, zlib.crc32(head[:40])) != struct.unpack_from(
                "<I", head, 40)[0]):
            return True
    return False


def test_records_are_written_in_turn_and_the_newest_is_read(segment):
    """Three writes: numbered 1, 2, 3 into records 0, 1, 0; a fresh reader takes number 3; an empty segment has
    none."""
    assert StateStore(segment).latest(TAG) is None
    store = StateStore(segment)
    numbers = [store.write(payload_of(n), TAG) for n in (1, 2, 3)]
    record = StateStore(segment).latest(TAG)

    assert ([1, 2, 3], (3, 2)) == (numbers, (header(segment, 0)[0], header(segment, 1)[0]))
    assert (3, payload_of(3)) == (record.sequence, record.payload)


@pytest.mark.parametrize("tear", ["number zeroed", "payload half written", "header half written"])
def test_a_write_cut_short_leaves_the_previous_record(segment, tear):
    """The newest record torn as a kill leaves it — its number zeroed when the write began, or a payload or
    header not matching the checksum — is passed over for the one before; the next write goes where the torn
    one was, numbered after every number present, and the one before stays until that write is whole."""
    store = StateStore(segment)
    store.write(payload_of(1), TAG)
    store.write(payload_of(2), TAG)
    offset = layout.state_record_offset(1, CAPACITY)
    if tear == "number zeroed":
        struct.pack_into("<Q", segment.buf, offset, 0)
    elif tear == "payload half written":
        segment.buf[offset + layout.REC_HEADER_SIZE + 100] ^= 0xFF
    else:
        struct.pack_into("<Q", segment.buf, offset + layout.REC_OFF_WRITTEN_NS, 12345)

    reader = StateStore(segment)
    record = reader.latest(TAG)
    written = reader.write(payload_of(3), TAG)

    assert (1, payload_of(1)) == (record.sequence, record.payload)
    assert (written, 1) == (header(segment, 1)[0], header(segment, 0)[0]) and written > 1
    assert (written, payload_of(3)) == (lambda r: (r.sequence, r.payload))(StateStore(segment).latest(TAG))


def test_no_whole_record_is_refused_as_corrupt(segment):
    store = StateStore(segment)
    store.write(payload_of(1), TAG)
    store.write(payload_of(2), TAG)
    for record in (0, 1):
        segment.buf[layout.state_record_offset(record, CAPACITY) + layout.REC_HEADER_SIZE] ^= 0xFF

    with pytest.raises(CheckpointRefused) as refused:
        StateStore(segment).latest(TAG)
    assert "corrupt" == refused.value.reason


def test_a_record_of_another_format_is_refused_as_foreign(segment):
    """The newest whole record names another payload format: refused, even though an older one of this format
    is whole (it is older than what the other writer saved)."""
    store = StateStore(segment)
    store.write(payload_of(1), TAG)
    store.write(payload_of(2), OTHER_TAG)

    with pytest.raises(CheckpointRefused) as refused:
        StateStore(segment).latest(TAG)
    assert ("foreign", True) == (refused.value.reason, OTHER_TAG.hex() in refused.value.detail)


def test_a_segment_of_another_layout_is_a_layout_mismatch(segment):
    segment.buf[0:8] = b"MPCRING1"
    with pytest.raises(LayoutMismatchError, match="not a state segment"):
        StateStore(segment)
    with pytest.raises(LayoutMismatchError, match="not a state segment"):
        record_capacity(segment)


def test_a_payload_larger_than_a_record_is_not_written(segment):
    """ValueError, and the newest record is still the one before."""
    store = StateStore(segment)
    store.write(payload_of(1), TAG)

    with pytest.raises(ValueError, match="do not fit"):
        store.write(b"x" * (CAPACITY + 1), TAG)
    assert 1 == StateStore(segment).latest(TAG).sequence


def test_kill_9_of_a_writer_at_random_instants_never_loses_an_acknowledged_record(segment):
    """A forked writer stores 1 MiB records as fast as it can, acknowledging each number once ``write``
    returned; SIGKILLed 20 times — at random instants, or the moment a record is seen being written — and a
    new writer each time goes on from what it reads.  Every time the record read is whole (its payload is its
    number's) and is the last one acknowledged or the one in flight; and kills did cut writes short."""
    rng = random.Random(7)
    size = 1 << 20
    acknowledged, cut_short = 0, 0
    for kill in range(20):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: never returns
            os.close(read_end)
            store = StateStore(segment)
            record = store.latest(TAG)
            number = record.sequence if record else 0
            while True:
                number = store.write(payload_of(number + 1, size), TAG)
                os.write(write_end, struct.pack("<Q", number))
        os.close(write_end)
        with os.fdopen(read_end, "rb") as acks:
            first = acks.read(8)  # it is writing now
            if kill % 2:  # the moment a record is seen being written (or after 10 s)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not any(
                        sequence == 0 and length for sequence, length in (header(segment, 0), header(segment, 1))):
                    pass
            else:
                time.sleep(rng.uniform(0, 0.02))  # a random instant (nothing waits on it)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rest = first + acks.read()
        acknowledged = max(acknowledged, *struct.unpack(f"<{len(rest) // 8}Q", rest[: len(rest) // 8 * 8]))
        cut_short += torn(segment)
        record = StateStore(segment).latest(TAG)
        assert record.sequence in (acknowledged, acknowledged + 1)
        assert payload_of(record.sequence, size) == record.payload
        acknowledged = record.sequence
    assert cut_short >= 1, "no kill landed in the middle of a write"
