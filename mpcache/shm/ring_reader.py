"""The event ring's consumer side (the telemetry process): committed records copied out in batches, the
cursor advanced, and the ring's bookkeeping words read.  Shared bytes are untrusted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpcache.shm import layout
from mpcache.shm.ring import read_geometry
from mpcache.shm.segment import Segment


@dataclass(frozen=True)
class RingCounters:
    """The ring's bookkeeping words, as one consistent-enough snapshot."""

    head: int
    tail: int
    dropped: int
    torn: int
    malformed: int
    producer_pid: int

    @property
    def pending_cells(self) -> int:
        return max(0, self.head - self.tail)


_HEAD, _TAIL, _READ = layout.OFF_HEAD // 8, layout.OFF_TAIL // 8, layout.OFF_READ // 8
_EXPORTED = layout.OFF_EXPORTED // 8
_MALFORMED = layout.OFF_MALFORMED // 8


def read_counters(segment: Segment) -> RingCounters:
    words = segment.buf[: layout.HEADER_SIZE].cast("Q")
    return RingCounters(
        head=words[layout.OFF_HEAD // 8],
        tail=words[layout.OFF_TAIL // 8],
        dropped=words[layout.OFF_DROPPED // 8],
        torn=words[layout.OFF_TORN // 8],
        malformed=words[layout.OFF_MALFORMED // 8],
        producer_pid=words[layout.OFF_PRODUCER_PID // 8],
    )


class RingReader:
    """Consumer side: copies committed records out in batches, and releases what was read by advancing
    ``tail``.

    It reads ahead of ``tail`` from a cursor of its own (published in the ``read`` word for observers): what
    was read stays in the ring until :meth:`commit` or :meth:`release` gives it back to the producer, so a
    consumer that keeps its state elsewhere (the telemetry process's checkpoint) releases a range only once
    that state covers it.  Shared bytes are untrusted: a header that makes no sense or records whose
    cells disagree are skipped and counted in ``malformed_records``, never raised into the caller.
    """

    def __init__(self, segment: Segment, max_batch_cells: int = 65536) -> None:
        geometry = read_geometry(segment)
        self.segment = segment
        self._cells: np.ndarray = np.ndarray(
            (geometry.capacity,), dtype=layout.CELL_DTYPE, buffer=segment.buf, offset=geometry.cells_offset
        )
        self._words = segment.buf[: layout.HEADER_SIZE].cast("Q")
        self.capacity = geometry.capacity
        self._mask = geometry.capacity - 1
        self._max_batch = max_batch_cells
        # what was read and found malformed, not yet released: tail and malformed_records as they will be
        self._read = self._words[_TAIL]
        self._malformed = self._words[_MALFORMED]
        self.intern_capacity = geometry.intern_capacity

    def cell_kinds(self) -> np.ndarray:
        """A live view of every cell's kind byte (for counting pending records)."""
        kinds: np.ndarray = self._cells["kind"]
        return kinds

    def pending_cells(self) -> int:
        """Cells committed and not yet read (by the consumer: its ``read`` word)."""
        return max(0, self._words[_HEAD] - self._words[_READ])

    def unreleased_cells(self) -> int:
        """Cells this reader read and has not released yet."""
        return max(0, self._read - self._words[_TAIL])

    def oldest_pending_timestamp_ns(self) -> int | None:
        """Timestamp of the oldest committed record the consumer has not read (None when there is none)."""
        head = self._words[_HEAD]
        read = self._words[_READ]
        if head <= read or head - read > self.capacity:
            return None
        cell = self._cells[read & self._mask]
        if cell["kind"] != layout.CELL_HEAD:
            return None
        return int(cell["slots"][0])

    @property
    def position(self) -> tuple[int, int]:
        """(cursor, malformed records): where this reader is, as :meth:`release` and :meth:`resume` take it."""
        return self._read, self._malformed

    def read_batch(self, commit: bool = True) -> np.ndarray:
        """Committed whole records after the read cursor (a copy), possibly empty; the cursor moves past them.

        With ``commit=False`` the range stays in the ring until :meth:`commit` or :meth:`release`: the
        telemetry process releases it only once a checkpoint covers it, so one killed before reads it again
        after its restart instead of losing it.
        """
        head = self._words[_HEAD]
        read = self._read
        empty: np.ndarray
        if head == read:
            empty = self._cells[:0].copy()
            return empty
        if head < read or head - self._words[_TAIL] > self.capacity:
            # Nonsense cursors: skip to head and count; never raise into the pump.
            self._malformed += 1
            self._read = head
            self._words[_READ] = head
            self._words[_MALFORMED] = self._malformed
            self._words[_TAIL] = head
            empty = self._cells[:0].copy()
            return empty
        n = min(head - read, self._max_batch)
        start = read & self._mask
        first = self._cells[start]
        if first["kind"] == layout.CELL_HEAD and n < first["index"] <= head - read:
            n = int(first["index"])  # a record longer than the batch limit is still read whole
        if start + n <= self.capacity:
            batch = self._cells[start : start + n].copy()
        else:
            batch = np.concatenate((self._cells[start:], self._cells[: n - (self.capacity - start)]))
        batch, consumed, malformed = _whole_valid_records(batch, at_head=(read + n == head))
        self._malformed += malformed
        self._read = read + consumed
        self._words[_READ] = self._read
        if commit:
            self.commit()
        return batch

    def commit(self) -> None:
        """Release everything read so far (the producer may reuse it)."""
        self.release(*self.position)

    def release(self, cursor: int, malformed: int) -> None:
        """Release the ring up to ``cursor``, a :attr:`position` this reader was at (ignored when not past the
        tail); ``malformed_records`` becomes ``malformed``, what it was there."""
        if self._words[_TAIL] < cursor <= self._read:
            self._words[_MALFORMED] = malformed
            self._words[_TAIL] = cursor

    def mark_exported(self, cursor: int) -> None:
        """What was read up to ``cursor`` (a :attr:`position`) is about to be exported: the next reader exports
        nothing before it has read this far again (:meth:`exported`)."""
        self._words[_EXPORTED] = cursor

    def exported(self) -> int:
        """How far the next export must have read: the last exported cursor where it lies between this reader's
        cursor and ``head``, else the cursor itself (nothing to read first: nothing, or nonsense, was marked)."""
        exported = self._words[_EXPORTED]
        return exported if self._read <= exported <= self._words[_HEAD] else self._read

    def resumable(self, cursor: int) -> bool:
        """Whether the ring still holds everything from ``cursor`` (a :attr:`position` an earlier reader saved)
        to ``head``: it was not released past it, and it lies within ``capacity`` before ``head``."""
        tail, head = self._words[_TAIL], self._words[_HEAD]
        return tail <= cursor <= head and head - tail <= self.capacity

    def resume(self, cursor: int, malformed: int) -> None:
        """Read on from ``cursor``, a :meth:`resumable` position an earlier reader saved (``malformed``: what
        it had counted there), and release the ring up to it."""
        self._read = cursor
        self._words[_READ] = cursor
        self._malformed = max(malformed, self._words[_MALFORMED])
        self._words[_MALFORMED] = self._malformed
        self._words[_TAIL] = cursor


_KIND_SHIFT, _INDEX_SHIFT = 32, 48
_SEQ_AND_ETYPE = np.uint64(0x0000_FF00_FFFF_FFFF)  # a cell's first word without its kind and index


def _whole_valid_records(batch: np.ndarray, at_head: bool) -> tuple[np.ndarray, int, int]:
    """Split ``batch`` into complete, self-consistent records.

    Returns (valid cells, cells consumed, malformed records).  A record cut by
    the batch limit is left for the next call; cells that do not form a
    well-formed record (wrong seq, type, position or length) are dropped and
    counted, one per record.  Works on each cell's first 8 bytes as one
    integer (seq | kind << 32 | etype << 40 | index << 48): one contiguous
    column instead of four strided ones.
    """
    word = np.ascontiguousarray(batch.view(np.uint64).reshape(len(batch), layout.CELL_SIZE // 8)[:, 0])
    is_head = ((word >> np.uint64(_KIND_SHIFT)) & np.uint64(0xFF)) == layout.CELL_HEAD
    heads = np.flatnonzero(is_head)
    if len(heads) == 0:
        return batch[:0], len(batch), 1
    malformed = 1 if heads[0] != 0 else 0  # leading cells that belong to no head
    lengths = (word[heads] >> np.uint64(_INDEX_SHIFT)).astype(np.int64)
    consumed = len(batch)
    if heads[-1] + lengths[-1] > consumed and not at_head and heads[-1] > 0:
        consumed = int(heads[-1])  # cut by the batch limit: read it next time
        heads, lengths = heads[:-1], lengths[:-1]
        if len(heads) == 0:
            return batch[:0], consumed, malformed
    word = word[:consumed]
    owner = np.cumsum(is_head[:consumed]) - 1
    in_record = owner >= 0
    owner[~in_record] = 0
    position = np.arange(consumed, dtype=np.int64) - heads[owner]
    expected = (word[heads] & _SEQ_AND_ETYPE)[owner] | (position.astype(np.uint64) << np.uint64(_INDEX_SHIFT))
    ok = in_record & ((position == 0) | ((word & ~(np.uint64(0xFF) << np.uint64(_KIND_SHIFT))) == expected))
    cells_per_record = np.bincount(owner[in_record], minlength=len(heads))
    bad_per_record = np.bincount(owner[in_record & ~ok], minlength=len(heads))
    record_ok = (bad_per_record == 0) & (cells_per_record == lengths) & (lengths >= 1)
    bad_records = int(np.count_nonzero(~record_ok))
    if bad_records == 0 and malformed == 0:
        return batch[:consumed], consumed, 0
    return batch[:consumed][in_record & record_ok[owner]], consumed, malformed + bad_records
