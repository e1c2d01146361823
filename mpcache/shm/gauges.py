"""The gauge board: current values (L1 usage, prefetch jobs, L2 work) each cache process keeps in its slot of
shared memory, with a heartbeat, for the telemetry process to read at scrape time.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from mpcache.errors import LayoutMismatchError
from mpcache.shm import layout
from mpcache.shm.segment import Segment

_HEADER = struct.Struct("<8sIII")


# a slot's counters kept across its cache process's restarts (clear() leaves them)
KEPT_WORDS = (layout.G_RESTARTS, layout.G_LMCACHE_REFUSED, layout.G_LMCACHE_UNIDENTIFIED, layout.G_SEGMENTS_RECREATED,
              layout.G_BUFFERS_REFUSED, layout.G_KV_RECORDS, layout.G_KV_SKIPPED, layout.G_KV_RESYNCS,
              layout.G_L1_REFUSED)


def gauge_header(n_slots: int) -> bytes:
    """A board's first bytes: magic, layout version, slots, adapters per slot."""
    return _HEADER.pack(layout.GAUGE_MAGIC, layout.GAUGE_LAYOUT_VERSION, n_slots, layout.MAX_ADAPTERS)


def format_gauge_board(segment: Segment, n_slots: int) -> None:
    segment.buf[:_HEADER.size] = gauge_header(n_slots)


def formatted_by_this_build(header: bytes) -> bool:
    """Whether ``header`` (a board's first bytes) is a gauge board of this build's layout: the supervisor
    writes it after locking the board, so only a board that a supervisor of this build locked says so."""
    if len(header) < _HEADER.size:
        return False
    magic, version, _, adapters = _HEADER.unpack_from(header, 0)
    return (magic, version, adapters) == (layout.GAUGE_MAGIC, layout.GAUGE_LAYOUT_VERSION, layout.MAX_ADAPTERS)


def _validate(segment: Segment) -> int:
    n_slots: int
    magic, version, n_slots, adapters = _HEADER.unpack_from(segment.buf, 0)
    if magic != layout.GAUGE_MAGIC:
        raise LayoutMismatchError(f"{segment.name}: not an mpcache gauge board (magic {magic!r})")
    if version != layout.GAUGE_LAYOUT_VERSION or adapters != layout.MAX_ADAPTERS:
        raise LayoutMismatchError(
            f"{segment.name}: gauge board layout version {version}, this build reads {layout.GAUGE_LAYOUT_VERSION}"
        )
    if segment.size < layout.gauge_board_size(n_slots):
        raise LayoutMismatchError(f"{segment.name}: too small for {n_slots} slots")
    return n_slots


class GaugeSlot:
    """A cache process's writable view of its own slot."""

    def __init__(self, segment: Segment, slot: int, clock_ns: Callable[[], int] = time.time_ns) -> None:
        n_slots = _validate(segment)
        if not 0 <= slot < n_slots:
            raise ValueError(f"gauge slot {slot} out of range 0..{n_slots - 1}")
        start = layout.GAUGE_HEADER_SIZE + slot * layout.GAUGE_SLOT_WORDS * 8
        self._words = segment.buf[start : start + layout.GAUGE_SLOT_WORDS * 8].cast("q")
        self._clock_ns = clock_ns

    def get(self, word: int) -> int:
        return self._words[word]

    def set(self, word: int, value: int) -> None:
        self._words[word] = int(value)

    def add(self, word: int, delta: int) -> None:
        """Only the owning process writes its slot, so read-modify-write is safe
        as long as that process serialises its own updates (callers hold a lock)."""
        self._words[word] += int(delta)

    def set_adapter(self, adapter_index: int, which: int, value: int) -> None:
        self._words[layout.gauge_adapter_word(adapter_index, which)] = int(value)

    def add_adapter(self, adapter_index: int, which: int, delta: int) -> None:
        self._words[layout.gauge_adapter_word(adapter_index, which)] += int(delta)

    def heartbeat(self, pid: int) -> None:
        self._words[layout.G_PID] = pid
        self._words[layout.G_HEARTBEAT] = self._clock_ns()

    def clear(self) -> None:
        """Zero the slot (a dead process's usage no longer counts), except the counters kept across restarts."""
        kept = {word: self._words[word] for word in KEPT_WORDS}
        for i in range(layout.GAUGE_SLOT_WORDS):
            self._words[i] = 0
        for word, value in kept.items():
            self._words[word] = value


def set_telemetry_restarts(segment: Segment, count: int) -> None:
    """The header word counting the telemetry process's restarts (the supervisor's to write)."""
    segment.buf[:layout.GAUGE_HEADER_SIZE].cast("q")[layout.GAUGE_OFF_TELEMETRY_RESTARTS // 8] = int(count)


class TelemetryBeat:
    """The telemetry process's heartbeat in the board's header: its pid and a time word it advances from its
    pump loop, which the supervisor's watchdog reads as it reads a cache process's slot (``pid`` and ``beat``,
    :meth:`clear` once that process is gone)."""

    def __init__(self, segment: Segment, clock_ns: Callable[[], int] = time.time_ns) -> None:
        _validate(segment)
        self._header = segment.buf[:layout.GAUGE_HEADER_SIZE].cast("q")
        self._clock_ns = clock_ns

    def beat(self, pid: int) -> None:
        self._header[layout.GAUGE_OFF_TELEMETRY_PID // 8] = pid
        self._header[layout.GAUGE_OFF_TELEMETRY_HEARTBEAT // 8] = self._clock_ns()

    @property
    def pid(self) -> int:
        return self._header[layout.GAUGE_OFF_TELEMETRY_PID // 8]

    @property
    def heartbeat(self) -> int:
        return self._header[layout.GAUGE_OFF_TELEMETRY_HEARTBEAT // 8]

    def clear(self) -> None:
        self._header[layout.GAUGE_OFF_TELEMETRY_PID // 8] = 0
        self._header[layout.GAUGE_OFF_TELEMETRY_HEARTBEAT // 8] = 0


class GaugeBoardReader:
    """The telemetry process's read-only view of every slot."""

    def __init__(self, segment: Segment, stale_after_s: float = 5.0,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._n_slots = _validate(segment)
        start = layout.GAUGE_HEADER_SIZE
        self._words = segment.buf[start : start + self._n_slots * layout.GAUGE_SLOT_WORDS * 8].cast("q")
        self._header = segment.buf[:start].cast("q")
        self._stale_ns = int(stale_after_s * 1e9)
        self._clock_ns = clock_ns

    @property
    def n_slots(self) -> int:
        return self._n_slots

    def live_slots(self) -> list[int]:
        """Slots whose heartbeat is recent."""
        now = self._clock_ns()
        live = []
        for slot in range(self._n_slots):
            beat = self._words[slot * layout.GAUGE_SLOT_WORDS + layout.G_HEARTBEAT]
            if beat > 0 and now - beat <= self._stale_ns:
                live.append(slot)
        return live

    def restarts(self) -> dict[str, int]:
        """Restarts of the children, by role, since the supervisor started (written by it)."""
        telemetry = self._header[layout.GAUGE_OFF_TELEMETRY_RESTARTS // 8]
        return {"cache": sum(self.word(slot, layout.G_RESTARTS) for slot in range(self._n_slots)),
                "telemetry": telemetry}

    def word(self, slot: int, word: int) -> int:
        return self._words[slot * layout.GAUGE_SLOT_WORDS + word]

    def adapter_word(self, slot: int, adapter_index: int, which: int) -> int:
        return self.word(slot, layout.gauge_adapter_word(adapter_index, which))

    def total(self, word: int) -> int:
        """Sum of one word over the live slots."""
        return sum(self.word(slot, word) for slot in self.live_slots())
