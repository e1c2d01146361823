"""The telemetry process's read loop: rings → batches → EventBus, with an adaptive sleep, the rings released
after delivery (or, with a checkpoint, once it covers them), a 1 Hz tick, a poll and flush on demand (before a
scrape), and the bus's self-monitoring from ring state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpcache.shm import layout
from mpcache.shm.intern import NameTable
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import EventBus

CATCH_UP_WAIT_S = 0.5  # how long a scrape waits for the pump's poll and flush before it collects anyway
# The longest sleep between polls.  At an engine's request rates (tens to hundreds of records a second) the
# pump sleeps this long, and most of its CPU is per poll, not per record: each poll costs ~1-2 ms of numpy
# calls and a wake-up on this project's 2-vCPU hosts, so 1 s instead of 0.5 s halves the telemetry process's
# CPU at those rates (benchmarks/HISTORY.md, issue 21, sixth pass).  A scrape does not wait for it (catch_up).
MAX_SLEEP_S = 1.0


@dataclass
class RingSource:
    producer: int
    segment: Segment
    reader: RingReader
    names: NameTable

    @classmethod
    def attach(cls, producer: int, name: str, max_batch_cells: int = 16384) -> RingSource:
        """16 Ki cells (1 MiB) per batch: large enough that numpy amortises, small enough that a
        backlog does not balloon the telemetry process's memory with per-batch temporaries."""
        segment = Segment.attach(name, layout.HEADER_SIZE)
        reader = RingReader(segment, max_batch_cells)
        if reader.resumable(reader.position[0]):
            reader.resume(*reader.position)  # the consumer now: a dead one's read-ahead is read again
        return cls(producer, segment, reader, NameTable(segment.buf, reader.intern_capacity))


class Pump:
    def __init__(
        self,
        sources: list[RingSource],
        bus: EventBus,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        tick_interval_s: float = 1.0,
    ) -> None:
        self.sources = sources
        self.bus = bus
        # With a checkpoint (telemetry.checkpoint) the rings are released by release() once it covers them;
        # else after every poll.  See _release_due for when a poll asks for a flush (which writes it).
        self.holds_rings = False
        self._clock_ns = clock_ns
        self._tick_ns = int(tick_interval_s * 1e9)
        self._next_tick = 0
        self.unknown_records = 0
        self.unknown_released = 0  # unknown_records as of the rings' release: what dropped_events() counts
        # catch_up(): polls run() started and finished, by number; a flush asked for; the wake-up of its sleep
        self._progress = threading.Condition()
        self._running = False
        self._polls_started = 0
        self._polls_done = 0
        self._flush_wanted = False
        self._wake = threading.Event()

    def poll_once(self) -> int:
        """One batch from every ring (up to its batch limit); returns records delivered.

        One batch per ring, not until empty: draining a ring while its producer
        keeps writing would chase ever smaller batches and never sleep.
        """
        delivered = 0
        for source in self.sources:
            cells = source.reader.read_batch(commit=False)
            if len(cells):
                source.names.sync()
                batch = EventBatch(source.producer, cells, source.names)
                self.unknown_records += batch.unknown_records
                self.bus.dispatch(batch)
                delivered += len(batch)
            if not self.holds_rings:
                source.reader.commit()  # only now: a crash before this re-reads the batch after a restart
        if not self.holds_rings:
            self.unknown_released = self.unknown_records
        elif self.release_due():
            self.bus.flush()
        now = self._clock_ns()
        if now >= self._next_tick:
            self._next_tick = now + self._tick_ns
            self.bus.tick(now)
        return delivered

    def drain(self) -> int:
        """Poll until every ring is empty; returns records delivered."""
        total = 0
        while delivered := self.poll_once():
            total += delivered
        return total

    def run(
        self,
        should_stop: Callable[[], bool],
        target_batch: int = 4096,
        min_sleep_s: float = 0.001,
        max_sleep_s: float = MAX_SLEEP_S,
    ) -> None:
        """Poll until ``should_stop()``; then one final drain so nothing committed is left.

        Every batch costs about the same fixed work whatever its size (numpy
        calls and a wake-up: see ``MAX_SLEEP_S``), so the pump sleeps long
        enough for about ``target_batch`` records
        to accumulate at the rate it just saw: at low rates it polls once a
        second (the drain lag stays under ``max_sleep_s``), at high rates every
        few milliseconds; a poll that finds nothing doubles the last sleep, up to
        ``max_sleep_s``.  The rate counts every record since the last sleep, those
        of the polls that read a backlog without sleeping too (counting only the
        last poll's made the sleep after a backlog the longest one).  The
        telemetry process so leaves the CPU to the cache
        processes instead of spinning on small batches.  A scrape does not wait
        for the sleep: :meth:`catch_up` wakes the pump.
        """
        last = time.monotonic()
        sleep = max_sleep_s
        since_last = 0  # records delivered since ``last``, backlog polls included
        with self._progress:
            self._running = True
        try:
            while not should_stop():
                with self._progress:
                    self._polls_started += 1
                    number, flush = self._polls_started, self._flush_wanted
                    self._flush_wanted = False
                    self._wake.clear()
                since_last += self.poll_once()
                if flush:
                    self.bus.flush()
                with self._progress:
                    self._polls_done = number
                    self._progress.notify_all()
                if any(source.reader.pending_cells() > target_batch for source in self.sources):
                    continue  # a backlog: read on without sleeping
                now = time.monotonic()
                rate = since_last / max(now - last, 1e-3)
                last, since_last = now, 0
                # nothing came: back off gradually (a lull in a busy stream is not idleness)
                sleep = min(max_sleep_s, max(min_sleep_s, target_batch / rate) if rate else 2 * sleep)
                self._wake.wait(sleep)
        finally:
            with self._progress:
                self._running = False
                self._progress.notify_all()
        self.drain()

    def catch_up(self, timeout_s: float = CATCH_UP_WAIT_S) -> bool:
        """From another thread (before a scrape): wake :meth:`run` and wait until a poll that started after
        this call went through the subscribers and the bus was flushed, so that what is collected next holds
        every record published before the call (up to one batch per ring).  Returns False at once when
        :meth:`run` is not running, and after ``timeout_s`` when its poll does not finish (a stuck
        subscriber): the caller collects what the last flush left."""
        with self._progress:
            if not self._running:
                return False
            target = self._polls_started + 1
            self._flush_wanted = True
            self._wake.set()
            self._progress.wait_for(lambda: self._polls_done >= target or not self._running, timeout_s)
            return self._polls_done >= target

    # -- the checkpoint's side --------------------------------------------------

    def positions(self) -> list[tuple[int, int]]:
        """Where each ring's reader is: what a checkpoint covers (see ``RingReader.position``)."""
        return [source.reader.position for source in self.sources]

    def release(self, positions: list[tuple[int, int]], unknown_records: int) -> None:
        """Give the rings back up to ``positions`` (a checkpoint covers them now); ``unknown_records``: the count
        the checkpoint holds."""
        for source, (cursor, malformed) in zip(self.sources, positions):
            source.reader.release(cursor, malformed)
        self.unknown_released = unknown_records

    def release_due(self) -> bool:
        """Whether a ring held for the checkpoint needs releasing now (see ``_release_due``)."""
        return any(_release_due(source.reader) for source in self.sources)

    def mark_exported(self, positions: list[tuple[int, int]]) -> None:
        """What was read up to ``positions`` is about to be exported (see :meth:`read_exported`)."""
        for source, (cursor, _) in zip(self.sources, positions):
            source.reader.mark_exported(cursor)

    def read_exported(self) -> int:
        """Poll until every ring is read as far as the last process exported from it (what it exported may run
        ahead of its checkpoint: a process that resumed from that checkpoint reads it again before it exports
        anything, so no exported value goes down); returns the records read."""
        targets = [source.reader.exported() for source in self.sources]
        total = 0
        while any(source.reader.position[0] < target for source, target in zip(self.sources, targets)):
            before = self.positions()
            total += self.poll_once()
            if self.positions() == before:  # nothing whole left to read: the ring's own counts say why
                break
        return total

    def resumable(self, positions: list[tuple[int, int]]) -> bool:
        """Whether every ring still holds what lies after its position in ``positions`` (none was released
        past it); see :meth:`resume`."""
        return len(positions) == len(self.sources) and all(
            source.reader.resumable(cursor) for source, (cursor, _) in zip(self.sources, positions))

    def resume(self, positions: list[tuple[int, int]], unknown_records: int) -> None:
        """Read on from a checkpoint's positions (each :meth:`resumable`) with its count of unknown records."""
        for source, (cursor, malformed) in zip(self.sources, positions):
            source.reader.resume(cursor, malformed)
        self.unknown_records = self.unknown_released = unknown_records

    # -- self-monitoring -----------------------------------------------------

    def queue_depth(self) -> int:
        """Records committed but not yet read, over all rings."""
        depth = 0
        for source in self.sources:
            cursor = source.reader.position[0]
            pending = read_counters(source.segment).head - cursor
            if pending > 0:
                depth += _count_heads(source.reader, cursor, pending)
        return depth

    def drain_lag_seconds(self) -> float:
        """Now minus the timestamp of the oldest unconsumed record (0 when all are drained)."""
        oldest = [ts for s in self.sources if (ts := s.reader.oldest_pending_timestamp_ns()) is not None]
        if not oldest:
            return 0.0
        return max(0.0, (self._clock_ns() - min(oldest)) / 1e9)

    def dropped_events(self) -> int:
        """Records lost: ring full at the producer, torn by a dead producer, or malformed (those read up to the
        rings' release)."""
        total = self.unknown_released
        for source in self.sources:
            counters = read_counters(source.segment)
            total += counters.dropped + counters.torn + counters.malformed
        return total


def _release_due(reader: RingReader) -> bool:
    """Whether a ring held for the checkpoint is to be released now: it holds a quarter of its cells read and not
    released, or it is half full from its producer's side (a backlog is growing, and what was read must not be
    what makes it overflow)."""
    unreleased = reader.unreleased_cells()
    return unreleased >= reader.capacity // 4 or (
        unreleased > 0 and reader.pending_cells() + unreleased >= reader.capacity // 2)


def _count_heads(reader: RingReader, tail: int, pending: int) -> int:
    kinds = reader.cell_kinds()
    capacity = len(kinds)
    pending = min(pending, capacity)
    start = tail & (capacity - 1)
    if start + pending <= capacity:
        return int(np.count_nonzero(kinds[start : start + pending] == layout.CELL_HEAD))
    return int(
        np.count_nonzero(kinds[start:] == layout.CELL_HEAD)
        + np.count_nonzero(kinds[: pending - (capacity - start)] == layout.CELL_HEAD)
    )
