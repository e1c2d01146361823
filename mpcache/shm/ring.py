"""The event ring: one writer (a cache process), one reader (telemetry, :mod:`mpcache.shm.ring_reader`),
committed by one store of ``head``.  Here: its format and geometry, the writer, and the recovery of a record
torn by a dead writer.  The writer exists in C (``_ringfast``, where it was built) and in Python, with the same
bytes.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mpcache.errors import LayoutMismatchError, RingCorruptError
from mpcache.shm import layout
from mpcache.shm.segment import Segment

if TYPE_CHECKING:
    from mpcache.shm._ringfast import FieldsEmitter, OneCellEmitter, WriterCore

_HEADER_INIT = struct.Struct("<8sIIQQq")
_HEAD_WORD = layout.OFF_HEAD // 8
_TAIL_WORD = layout.OFF_TAIL // 8
_DROPPED_WORD = layout.OFF_DROPPED // 8
_EMPTY_CELL = struct.pack(layout.CELL_INTS, 0, layout.CELL_EMPTY, 0, 0, *[0] * layout.SLOTS_PER_CELL)
"""What overwrites a head cell whose pack failed (whatever the pack began), and a torn record's."""
_PACK_ERRORS = (struct.error, TypeError, ValueError, OverflowError)


def format_event_segment(segment: Segment, capacity_cells: int, intern_capacity: int) -> None:
    """Write a fresh header into a zero-filled segment (the owner does this once)."""
    if capacity_cells <= 0 or capacity_cells & (capacity_cells - 1):
        raise ValueError(f"ring capacity must be a power of two, got {capacity_cells}")
    needed = layout.event_segment_size(capacity_cells, intern_capacity)
    if segment.size < needed:
        raise ValueError(f"segment is {segment.size} bytes, needs {needed}")
    _HEADER_INIT.pack_into(
        segment.buf, 0, layout.RING_MAGIC, layout.LAYOUT_VERSION, layout.CELL_SIZE,
        capacity_cells, intern_capacity, 0,
    )


@dataclass(frozen=True)
class RingGeometry:
    capacity: int
    intern_capacity: int
    cells_offset: int


def read_geometry(segment: Segment) -> RingGeometry:
    """Validate the header and return the ring's geometry."""
    if segment.size < layout.HEADER_SIZE:
        raise LayoutMismatchError(f"{segment.name}: {segment.size} bytes is too small for a ring")
    magic, version, cell_size, capacity, intern_capacity, _pid = _HEADER_INIT.unpack_from(segment.buf, 0)
    if magic != layout.RING_MAGIC:
        raise LayoutMismatchError(f"{segment.name}: not an mpcache event ring (magic {magic!r})")
    if version != layout.LAYOUT_VERSION or cell_size != layout.CELL_SIZE:
        raise LayoutMismatchError(
            f"{segment.name}: ring layout version {version} (cell {cell_size} B), "
            f"this build reads version {layout.LAYOUT_VERSION} (cell {layout.CELL_SIZE} B)"
        )
    if (capacity <= 0 or capacity & (capacity - 1)
            or segment.size < layout.event_segment_size(capacity, intern_capacity)):
        raise RingCorruptError(f"{segment.name}: header claims capacity {capacity}, intern {intern_capacity}")
    return RingGeometry(capacity, intern_capacity, layout.cells_offset(intern_capacity))


class _PythonWriterCore:
    """The producer's state and append protocol in pure Python; ``_ringfast.WriterCore``
    is the same in C (same constructor, members and methods).

    Not thread-safe by itself: the caller serialises ``append`` (the
    :class:`~mpcache.shm.publish.Publisher` holds a lock only when several threads
    of one process share the ring).  ``seq`` is the sequence number the next
    record must carry in every cell; it advances on every append, published or
    dropped, so a gap in sequence numbers is a drop.
    """

    __slots__ = ("_buf", "_capacity", "_mask", "_cells_off", "_cell_size", "_header", "_head_word",
                 "_tail_word", "_dropped_word", "_empty", "_head", "_limit", "seq")

    def __init__(self, buffer: memoryview, cells_offset: int, capacity: int, cell_size: int, head_offset: int,
                 tail_offset: int, dropped_offset: int, empty_cell: bytes) -> None:
        self._buf = buffer
        self._capacity = capacity
        self._mask = capacity - 1
        self._cells_off = cells_offset
        self._cell_size = cell_size
        self._header = buffer[: max(head_offset, tail_offset, dropped_offset) + 8].cast("Q")
        self._head_word, self._tail_word = head_offset // 8, tail_offset // 8
        self._dropped_word = dropped_offset // 8
        self._empty = empty_cell
        self._head = self._limit = self.seq = 0

    def append(self, record: struct.Struct, ncells: int, args: list[Any]) -> bool:
        """Publish one record of ``ncells`` cells packed by ``record`` from ``args``
        (which carry ``seq & 0xFFFFFFFF`` in every cell).  Never raises: False,
        and counted, when the ring is full or the values do not pack."""
        head = self._head
        if head + ncells > self._limit and not self._has_room(ncells):
            return False
        self.seq += 1
        pos = head & self._mask
        offset = self._cells_off + pos * self._cell_size
        try:
            if pos + ncells <= self._capacity:
                record.pack_into(self._buf, offset, *args)
            else:
                self._write_wrapped(pos, record.pack(*args))
        except _PACK_ERRORS:
            self._drop_bad_value(offset)
            return False
        self._head = head + ncells
        self._header[self._head_word] = head + ncells  # the commit
        return True

    def _has_room(self, ncells: int) -> bool:
        """Re-read the consumer's tail; count a drop (spending a seq) if still full."""
        self._limit = self._header[self._tail_word] + self._capacity
        if self._head + ncells <= self._limit:
            return True
        self.count_drop()
        return False

    def count_drop(self) -> None:
        """Count a record the caller could not even encode (its sequence number is spent)."""
        self.seq += 1
        self._header[self._dropped_word] += 1

    def _drop_bad_value(self, head_offset: int) -> None:
        self._buf[head_offset : head_offset + self._cell_size] = self._empty  # pack may have begun the cell
        self._header[self._dropped_word] += 1

    def _write_wrapped(self, pos: int, data: bytes) -> None:
        first = (self._capacity - pos) * self._cell_size
        start = self._cells_off + pos * self._cell_size
        self._buf[start : start + first] = data[:first]
        self._buf[self._cells_off : self._cells_off + len(data) - first] = data[first:]


PUBLISH_COMPILED = "compiled"
PUBLISH_PYTHON_BY_CHOICE = "python (MPCACHE_PURE_PYTHON is set)"
PUBLISH_PYTHON_NOT_BUILT = "python (mpcache.shm._ringfast was not built)"


def _writer_implementation() -> tuple[str, type[WriterCore] | type[_PythonWriterCore],
                                      type[OneCellEmitter] | None, type[FieldsEmitter] | None]:
    """(how this process publishes, writer core class, compiled emitter types or None), chosen once."""
    if os.environ.get("MPCACHE_PURE_PYTHON", "") not in ("", "0"):
        return PUBLISH_PYTHON_BY_CHOICE, _PythonWriterCore, None, None
    try:
        from mpcache.shm._ringfast import FieldsEmitter, OneCellEmitter, WriterCore
    except ImportError:
        return PUBLISH_PYTHON_NOT_BUILT, _PythonWriterCore, None, None
    return PUBLISH_COMPILED, WriterCore, OneCellEmitter, FieldsEmitter


PUBLISH_PATH, _WriterCore, _CompiledOneCellEmitter, _CompiledFieldsEmitter = _writer_implementation()
"""How this process publishes: one of the three PUBLISH_* strings (the supervisor logs it at start)."""
COMPILED_PUBLISH = PUBLISH_PATH == PUBLISH_COMPILED

if TYPE_CHECKING:
    # What the type checker sees: the compiled core (_ringfast.pyi).  _PythonWriterCore has the same
    # constructor, members and methods; the pure-Python branch of one_cell_emitter says when it has it.
    _WriterBase = WriterCore
else:
    _WriterBase = _WriterCore


class RingWriter(_WriterBase):
    """Producer side of one ring: attach, recover, then append records.

    Attaching validates the header, counts a record that a dead predecessor
    began but never committed, and resumes its head and sequence numbers.
    """

    __slots__ = ()

    def __init__(self, segment: Segment) -> None:
        geometry = read_geometry(segment)
        super().__init__(segment.buf, geometry.cells_offset, geometry.capacity, layout.CELL_SIZE,
                         layout.OFF_HEAD, layout.OFF_TAIL, layout.OFF_DROPPED, _EMPTY_CELL)
        recover_torn_record(segment)
        words = segment.buf[: layout.HEADER_SIZE].cast("Q")
        self._head = words[_HEAD_WORD]
        self._limit = words[_TAIL_WORD] + geometry.capacity  # head may grow up to here (last tail seen)
        self.seq = _next_seq(segment.buf, geometry.cells_offset, geometry.capacity - 1, self._head)
        words[layout.OFF_PRODUCER_PID // 8] = os.getpid()
        words.release()

    def one_cell_emitter(self, record: struct.Struct, etype: int,
                         clock_ns: Callable[[], int]) -> Callable[[int, int, int], bool]:
        """The hottest publish, specialised once per event type: ``emit(a, b, c)``.

        It packs one head cell ``record`` holding the timestamp and, in its
        inline salt slots, the integers ``a``, ``b``, ``c``, then commits it.
        Compiled, it is one C object; in Python it is the whole append protocol
        inlined with its constants bound as closure variables, because on this
        path every attribute load and call is a measurable share of the cost.
        Never raises for bad values.
        """
        if _CompiledOneCellEmitter is not None:
            first_value = layout.slot_offset(layout.INLINE_SALT_SLOT)
            return _CompiledOneCellEmitter(
                core=self, template=record.pack(0, layout.CELL_HEAD, etype, 1, 0, 0, 0, 0),
                seq_offset=layout.CELL_OFF_SEQ, timestamp_offset=layout.slot_offset(0),
                value_offsets=(first_value, first_value + 8, first_value + 16),
                clock=None if clock_ns is time.time_ns else clock_ns,
            )
        writer = cast(_PythonWriterCore, self)  # a _PythonWriterCore: only it has no compiled emitter
        buf, header, head_word = writer._buf, writer._header, writer._head_word
        mask, cells_off, head_kind = writer._mask, writer._cells_off, layout.CELL_HEAD

        def emit(a: int, b: int, c: int) -> bool:
            head = writer._head
            if head >= writer._limit and not writer._has_room(1):
                return False
            seq = writer.seq
            writer.seq = seq + 1
            offset = cells_off + ((head & mask) << 6)
            try:
                record.pack_into(buf, offset, seq & 0xFFFFFFFF, head_kind, etype, 1, clock_ns(), a, b, c)
            except _PACK_ERRORS:
                writer._drop_bad_value(offset)
                return False
            writer._head = head + 1
            header[head_word] = head + 1  # the commit
            return True

        return emit

    def fields_emitter(self, *, head_templates: tuple[bytes, bytes], fields_templates: tuple[bytes, ...],
                       text_template: bytes, field_slots: tuple[tuple[int, int, str], ...], ids: dict[str, int],
                       clock_ns: Callable[[], int], fallback: Callable[..., bool]) -> Callable[..., bool]:
        """``emit(fields, session_id, timestamp_ns=None)`` for records of fixed fields and an optional
        one-cell text.

        The compiled emitter stamps the templates (head without / with the
        text cell, each FIELDS cell, the text cell) with the sequence
        number, the timestamp (``timestamp_ns``, or the clock's), each field
        at its ``(cell, byte offset, kind)`` slot (kind ``q`` int64, ``Q`` uint64, ``d``
        float64, ``n`` a name looked up in ``ids``) and the text; it hands every
        call that is not that regular case to ``fallback``, the Python emitter,
        before writing anything.
        Without the extension this returns ``fallback`` itself.
        """
        if _CompiledFieldsEmitter is None:
            return fallback
        return _CompiledFieldsEmitter(
            core=self, head_templates=head_templates, fields_templates=fields_templates, text_template=text_template,
            field_slots=field_slots, seq_offset=layout.CELL_OFF_SEQ, timestamp_offset=layout.slot_offset(0),
            text_length_offset=layout.TEXT_OFF_LENGTH, text_data_offset=layout.TEXT_OFF_DATA, ids=ids,
            clock=None if clock_ns is time.time_ns else clock_ns, fallback=fallback,
        )


def _next_seq(buf: memoryview, cells_off: int, mask: int, head: int) -> int:
    """The sequence number after the last committed record (0 for an empty ring)."""
    if head == 0:
        return 0
    last: int
    (last,) = struct.unpack_from("<I", buf, cells_off + ((head - 1) & mask) * 64)
    return last + 1


def _clear_cell(buf: memoryview, offset: int) -> None:
    buf[offset : offset + layout.CELL_SIZE] = _EMPTY_CELL


def recover_torn_record(segment: Segment) -> bool:
    """After a writer died: count a record it began but never committed.

    Run by the supervisor when it reaps a cache process, and by every writer on
    attach.  The cell at ``head`` is a head cell carrying the next sequence
    number only if a record was being written there (the next plus the records
    dropped since, which spent sequence numbers too; a cell left from an earlier
    lap carries an older one).  The cell is cleared so the record is counted once.
    """
    geometry = read_geometry(segment)
    words = segment.buf[: layout.HEADER_SIZE].cast("Q")
    head = words[layout.OFF_HEAD // 8]
    mask = geometry.capacity - 1
    offset = geometry.cells_offset + (head & mask) * 64
    seq, kind = struct.unpack_from("<IB", segment.buf, offset)
    expected = _next_seq(segment.buf, geometry.cells_offset, mask, head) & 0xFFFFFFFF
    if kind != layout.CELL_HEAD or (seq - expected) & 0xFFFFFFFF > words[_DROPPED_WORD]:
        return False
    _clear_cell(segment.buf, offset)
    words[layout.OFF_TORN // 8] += 1
    return True
