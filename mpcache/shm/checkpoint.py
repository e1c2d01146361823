"""The telemetry process's checkpoints in shared memory: two records written in turn, each numbered and
checksummed, so a writer killed at any instant leaves the previous record whole (the supervisor creates and
owns the segment, so it outlives the writer).  The payload is opaque here; its format is named by a 16-byte tag
that a reader must match.  Shared bytes are untrusted: a record is taken only whole and checked.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass

from mpcache.errors import LayoutMismatchError
from mpcache.shm import layout
from mpcache.shm.segment import Segment

_HEADER = struct.Struct("<8sIIQ")
_RECORD = struct.Struct("<QQ16sQ")  # sequence, length, tag, written ns: the checksummed part of a record header
_CHECKSUM = struct.Struct("<I")
_SEQUENCE = struct.Struct("<Q")
TAG_BYTES = 16


class CheckpointRefused(Exception):
    """No checkpoint can be taken from the segment: ``reason`` is ``format`` (not a state segment of this
    build), ``corrupt`` (records were written but none is whole) or ``foreign`` (the newest whole record is
    of another payload format); the telemetry layer adds its own."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Record:
    sequence: int
    payload: bytes
    written_ns: int


def format_state_segment(segment: Segment, capacity: int) -> None:
    """Write a fresh header (no records) for records of ``capacity`` payload bytes: the owner does this once."""
    if capacity <= 0 or segment.size < layout.state_segment_size(capacity):
        raise ValueError(f"segment is {segment.size} bytes, records of {capacity} need "
                         f"{layout.state_segment_size(capacity)}")
    segment.buf[: layout.state_segment_size(capacity)] = bytes(layout.state_segment_size(capacity))
    _HEADER.pack_into(segment.buf, 0, layout.STATE_MAGIC, layout.STATE_LAYOUT_VERSION, layout.STATE_RECORDS, capacity)


def record_capacity(segment: Segment) -> int:
    """The payload bytes a record of ``segment`` holds; LayoutMismatchError if it is not a state segment of this
    layout."""
    magic, version, records, capacity = _HEADER.unpack_from(segment.buf, 0)
    if (magic, version, records) != (layout.STATE_MAGIC, layout.STATE_LAYOUT_VERSION, layout.STATE_RECORDS):
        raise LayoutMismatchError(f"{segment.name}: not a state segment of layout {layout.STATE_LAYOUT_VERSION} "
                                  f"(magic {magic!r}, version {version}, {records} records)")
    if capacity <= 0 or segment.size < layout.state_segment_size(capacity):
        raise LayoutMismatchError(f"{segment.name}: header claims records of {capacity} bytes in {segment.size}")
    return int(capacity)


class StateStore:
    """Reads the newest whole record and writes the next one into the other record's place.

    :meth:`latest` first (it learns which record to keep), then :meth:`write` as often as wanted: each write
    goes where the record last loaded or written is not, numbered after every number present, so a write
    cut short by a kill leaves that record the newest whole one.
    """

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.capacity = record_capacity(segment)
        self._buf = segment.buf
        self._sequence = 0  # the highest number any record header carries
        self._keep: int | None = None  # the record that must survive the next write

    def latest(self, tag: bytes) -> Record | None:
        """The newest whole record, None when none was ever written; CheckpointRefused when records exist
        but none is whole, or the newest whole one has another ``tag``."""
        found: list[tuple[int, int, Record, bytes]] = []  # (sequence, index, record, tag)
        written = False
        for index in range(layout.STATE_RECORDS):
            offset = layout.state_record_offset(index, self.capacity)
            header = bytes(self._buf[offset : offset + layout.REC_HEADER_SIZE])
            sequence, length, record_tag, written_ns = _RECORD.unpack_from(header)
            self._sequence = max(self._sequence, sequence)
            written = written or any(header)
            if sequence == 0 or length > self.capacity:
                continue  # being written when its writer died, or nonsense
            start = offset + layout.REC_HEADER_SIZE
            payload = bytes(self._buf[start : start + length])
            (checksum,) = _CHECKSUM.unpack_from(header, layout.REC_OFF_CHECKSUM)
            if zlib.crc32(payload, zlib.crc32(header[: layout.REC_OFF_CHECKSUM])) == checksum:
                found.append((sequence, index, Record(sequence, payload, written_ns), record_tag))
        if not found:
            if written:
                raise CheckpointRefused("corrupt", "records were written but none passes its checksum")
            return None
        _, index, record, record_tag = max(found, key=lambda entry: entry[0])
        if record_tag != tag:
            raise CheckpointRefused("foreign", f"record {record.sequence} has format {record_tag.hex()}, "
                                               f"this build writes {tag.hex()}")
        self._keep = index
        return record

    def write(self, payload: bytes, tag: bytes) -> int:
        """Store ``payload`` as the newest record; returns its number.  ValueError (nothing written) when it
        is larger than a record."""
        if len(payload) > self.capacity:
            raise ValueError(f"{len(payload)} bytes do not fit a record of {self.capacity}")
        if len(tag) != TAG_BYTES:
            raise ValueError(f"a tag is {TAG_BYTES} bytes, got {len(tag)}")
        index = 0 if self._keep is None else 1 - self._keep
        offset = layout.state_record_offset(index, self.capacity)
        sequence = self._sequence + 1
        head = _RECORD.pack(sequence, len(payload), tag, time.time_ns())
        checksum = _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(head)))  # before the record is touched
        _SEQUENCE.pack_into(self._buf, offset + layout.REC_OFF_SEQUENCE, 0)  # being written: the other one counts
        start = offset + layout.REC_HEADER_SIZE
        self._buf[start : start + len(payload)] = payload
        self._buf[offset + _RECORD.size : offset + layout.REC_OFF_CHECKSUM + _CHECKSUM.size] = checksum
        self._buf[offset : offset + _RECORD.size] = head  # the number last: the record is whole from here
        self._sequence, self._keep = sequence, index
        return sequence
