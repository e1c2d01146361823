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
    """Consumer side: copies committed records out in batches and advances ``tail``.

    Shared bytes are untrusted: a header that makes no sense or records whose
    cells disagree are skipped and counted in ``malformed_records``, never
    raised into the caller.
    """

    def __init__(self, segment: Segment, max_batch_cells: int = 65536) -> None:
        geometry = read_geometry(segment)
        self.segment = segment
        self._cells: np.ndarray = np.ndarray(
            (geometry.capacity,), dtype=layout.CELL_DTYPE, buffer=segment.buf, offset=geometry.cells_offset
        )
        self._words = segment.buf[: layout.HEADER_SIZE].cast("Q")
        self._capacity = geometry.capacity
        self._mask = geometry.capacity - 1
        self._max_batch = max_batch_cells
        self._uncommitted: int | None = None  # cursor after the last batch read, not yet stored
        self.intern_capacity = geometry.intern_capacity

    def cell_kinds(self) -> np.ndarray:
        """A live view of every cell's kind byte (for counting pending records)."""
        kinds: np.ndarray = self._cells["kind"]
        return kinds

    def pending_cells(self) -> int:
        return max(0, self._words[layout.OFF_HEAD // 8] - self._words[layout.OFF_TAIL // 8])

    def oldest_pending_timestamp_ns(self) -> int | None:
        """Timestamp of the oldest committed, unconsumed record (None when empty)."""
        head = self._words[layout.OFF_HEAD // 8]
        tail = self._words[layout.OFF_TAIL // 8]
        if head <= tail or head - tail > self._capacity:
            return None
        cell = self._cells[tail & self._mask]
        if cell["kind"] != layout.CELL_HEAD:
            return None
        return int(cell["slots"][0])

    def read_batch(self, commit: bool = True) -> np.ndarray:
        """Committed whole records after the consumer cursor (a copy), possibly empty.

        With ``commit=False`` the cursor stays where it was until :meth:`commit`:
        the telemetry process commits only after the batch went through the
        subscribers, so one killed mid-batch reads that batch again after its
        restart instead of losing it (at least once, not at most once).
        """
        head = self._words[layout.OFF_HEAD // 8]
        tail = self._words[layout.OFF_TAIL // 8]
        empty: np.ndarray
        if head == tail:
            empty = self._cells[:0].copy()
            return empty
        if head < tail or head - tail > self._capacity:
            # Nonsense cursors: skip to head and count; never raise into the pump.
            self._words[layout.OFF_MALFORMED // 8] += 1
            self._words[layout.OFF_TAIL // 8] = head
            empty = self._cells[:0].copy()
            return empty
        n = min(head - tail, self._max_batch)
        start = tail & self._mask
        first = self._cells[start]
        if first["kind"] == layout.CELL_HEAD and n < first["index"] <= head - tail:
            n = int(first["index"])  # a record longer than the batch limit is still read whole
        if start + n <= self._capacity:
            batch = self._cells[start : start + n].copy()
        else:
            batch = np.concatenate((self._cells[start:], self._cells[: n - (self._capacity - start)]))
        batch, consumed, malformed = _whole_valid_records(batch, at_head=(tail + n == head))
        if malformed:
            self._words[layout.OFF_MALFORMED // 8] += malformed
        self._uncommitted = tail + consumed
        if commit:
            self.commit()
        return batch

    def commit(self) -> None:
        """Advance the shared consumer cursor past the last batch read (the producer may reuse it)."""
        if self._uncommitted is not None:
            self._words[layout.OFF_TAIL // 8] = self._uncommitted
            self._uncommitted = None


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
