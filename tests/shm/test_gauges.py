"""The gauge board: each cache process's slot of current values, read at scrape time."""

from __future__ import annotations

import pytest

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, TelemetryBeat, format_gauge_board, set_telemetry_restarts

NOW = 1_000_000_000_000


class Clock:
    """A settable nanosecond clock."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def board(segment_factory):
    """A formatted 3-slot gauge board."""
    segment = segment_factory(layout.gauge_board_size(3))
    format_gauge_board(segment, 3)
    return segment


def test_written_words_are_read_back(board):
    """What a slot sets, adds and sets per adapter, the reader reads."""
    slot = GaugeSlot(board, 1)
    slot.set(layout.G_L1_USED, 4096)
    slot.add(layout.G_L1_USED, 1024)
    slot.set(layout.G_L1_CAPACITY, 1 << 30)
    slot.set_adapter(3, layout.G_L2_USAGE, 777)
    slot.add_adapter(3, layout.G_L2_INFLIGHT_STORES, 2)
    slot.add_adapter(3, layout.G_L2_INFLIGHT_STORES, -1)
    reader = GaugeBoardReader(board)
    actual = (
        reader.word(1, layout.G_L1_USED),
        reader.word(1, layout.G_L1_CAPACITY),
        reader.adapter_word(1, 3, layout.G_L2_USAGE),
        reader.adapter_word(1, 3, layout.G_L2_INFLIGHT_STORES),
        reader.word(0, layout.G_L1_USED),
    )

    assert (5120, 1 << 30, 777, 1, 0) == actual


def test_slots_do_not_overlap(board):
    """Writing every word of one slot leaves the neighbouring slots untouched."""
    slot = GaugeSlot(board, 1)
    for word in range(layout.GAUGE_SLOT_WORDS):
        slot.set(word, -1)
    reader = GaugeBoardReader(board)

    assert [0, -1, 0] == [reader.adapter_word(s, layout.MAX_ADAPTERS - 1, 3) for s in range(3)]
    assert [0, -1, 0] == [reader.word(s, 0) for s in range(3)]


def test_heartbeat_writes_pid_and_clock(board):
    """A heartbeat stores the process's pid and the injected clock's time."""
    GaugeSlot(board, 2, clock_ns=Clock(NOW)).heartbeat(4321)
    reader = GaugeBoardReader(board)

    assert (NOW, 4321) == (reader.word(2, layout.G_HEARTBEAT), reader.word(2, layout.G_PID))


def test_stale_heartbeat_is_excluded(board):
    """Only slots whose heartbeat is within stale_after_s of now are live; never-started slots are not."""
    GaugeSlot(board, 0, clock_ns=Clock(NOW)).heartbeat(10)
    GaugeSlot(board, 1, clock_ns=Clock(NOW - 6_000_000_000)).heartbeat(11)
    reader = GaugeBoardReader(board, stale_after_s=5.0, clock_ns=Clock(NOW + 1_000_000_000))

    assert [0] == reader.live_slots()


def test_total_sums_live_slots_only(board):
    """total() adds a word over the live slots, ignoring stale and unstarted ones."""
    for index, (beat, used) in enumerate([(NOW, 100), (NOW - 10**10, 1000), (0, 10000)]):
        slot = GaugeSlot(board, index, clock_ns=Clock(beat))
        slot.set(layout.G_L1_USED, used)
        if beat:
            slot.heartbeat(100 + index)
    reader = GaugeBoardReader(board, stale_after_s=5.0, clock_ns=Clock(NOW))

    assert 100 == reader.total(layout.G_L1_USED)


def test_clear_zeroes_the_slot(board):
    """clear() zeroes every word of the slot, so it stops reporting."""
    slot = GaugeSlot(board, 0, clock_ns=Clock(NOW))
    slot.heartbeat(1)
    slot.set(layout.G_ACTIVE_PREFETCH, 3)
    slot.clear()
    reader = GaugeBoardReader(board, clock_ns=Clock(NOW))

    assert ([], 0) == (reader.live_slots(), reader.word(0, layout.G_ACTIVE_PREFETCH))


def test_clear_keeps_the_counters_kept_across_restarts(board):
    """Restarts, the LMCache connections refused and unidentified, the segments recreated, the buffers refused and
    the chunks L1's order refused survive clear() (a restart's); usage does not."""
    slot = GaugeSlot(board, 0, clock_ns=Clock(NOW))
    kept = {layout.G_RESTARTS: 2, layout.G_LMCACHE_REFUSED: 3, layout.G_LMCACHE_UNIDENTIFIED: 4,
            layout.G_SEGMENTS_RECREATED: 6, layout.G_BUFFERS_REFUSED: 7, layout.G_L1_REFUSED: 8}
    for word, value in {**kept, layout.G_L1_USED: 5}.items():
        slot.set(word, value)
    slot.clear()
    assert {**kept, layout.G_L1_USED: 0} == {word: slot.get(word) for word in (*kept, layout.G_L1_USED)}


@pytest.mark.parametrize("slot", [-1, 3])
def test_slot_out_of_range(board, slot):
    """A slot index outside the board is a ValueError naming the range."""
    with pytest.raises(ValueError, match=r"out of range 0\.\.2"):
        GaugeSlot(board, slot)


def test_reader_reports_slot_count(board):
    """The reader takes the slot count from the header."""
    assert 3 == GaugeBoardReader(board).n_slots


def test_telemetry_beat_is_two_header_words_that_leave_the_restart_count_alone(board):
    """Telemetry's heartbeat: its pid at header byte 40 and the time at byte 32, read back by another view (the
    supervisor's); clearing them keeps the restart count (byte 24) and every slot."""
    set_telemetry_restarts(board, 3)
    GaugeSlot(board, 0).heartbeat(pid=11)
    TelemetryBeat(board, clock_ns=Clock(NOW)).beat(pid=4242)
    supervisor = TelemetryBeat(board)
    seen = (supervisor.pid, supervisor.heartbeat, int.from_bytes(board.buf[32:40], "little"),
            int.from_bytes(board.buf[40:48], "little"))
    supervisor.clear()

    assert (4242, NOW, NOW, 4242) == seen
    assert (0, 0, {"cache": 0, "telemetry": 3}) == (supervisor.pid, supervisor.heartbeat,
                                                    GaugeBoardReader(board).restarts())
    assert 11 == GaugeBoardReader(board).word(0, layout.G_PID)
