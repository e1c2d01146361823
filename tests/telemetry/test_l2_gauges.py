"""L2 state gauges from the gauge board: per-adapter sums over live slots, usage per adapter type."""

from __future__ import annotations

import pytest

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, format_gauge_board
from mpcache.telemetry.subscribers.metrics.l2_gauges import L2StateGaugesSubscriber

NOW = 1_700_000_100 * 10**9
NAMES = ["fs", "mock", "fs"]  # adapters 0, 1, 2 in --l2 order
WORDS = (layout.G_L2_USAGE, layout.G_L2_INFLIGHT_STORES, layout.G_L2_INFLIGHT_LOADS, layout.G_L2_INFLIGHT_LOAD_BYTES)


def adapter(name: str, index: int) -> frozenset:
    return frozenset({("l2_name", name), ("adapter_index", str(index))})


@pytest.fixture
def board(segment_factory):
    """3 slots: 0 and 1 alive, 2 stale.  Per adapter: (usage, stores, loads, load bytes) per slot."""
    segment = segment_factory(layout.gauge_board_size(3))
    format_gauge_board(segment, 3)
    values = {
        0: {0: (1000, 2, 1, 4096), 1: (50, 0, 3, 300), 2: (7, 1, 0, 0)},
        1: {0: (500, 1, 0, 0), 2: (3, 0, 2, 100)},
        2: {0: (10**9, 99, 99, 99), 1: (10**9, 99, 99, 99)},
    }
    beats = {0: NOW, 1: NOW - 1, 2: NOW - 60 * 10**9}
    for slot, adapters in values.items():
        writer = GaugeSlot(segment, slot, clock_ns=lambda beat=beats[slot]: beat)
        for index, words in adapters.items():
            for which, value in zip(WORDS, words):
                writer.set_adapter(index, which, value)
        writer.heartbeat(pid=1000 + slot)
    return GaugeBoardReader(segment, stale_after_s=5.0, clock_ns=lambda: NOW)


def test_usage_sums_live_slots_and_adapters_of_one_type(board, metrics):
    """fs = adapters 0 and 2 over slots 0 and 1 (1000+500+7+3); mock = 50; the stale slot is left out."""
    L2StateGaugesSubscriber(metrics.meter, board, NAMES)
    assert {frozenset({("l2_name", "fs")}): 1510, frozenset({("l2_name", "mock")}): 50} == metrics.series(
        "lmcache_mp.l2_usage_bytes")


def test_inflight_gauges_have_one_series_per_configured_adapter(board, metrics):
    """Stores, loads and load bytes are summed over live slots per (l2_name, adapter_index)."""
    L2StateGaugesSubscriber(metrics.meter, board, NAMES)
    assert ({adapter("fs", 0): 3, adapter("mock", 1): 0, adapter("fs", 2): 1},
            {adapter("fs", 0): 1, adapter("mock", 1): 3, adapter("fs", 2): 2},
            {adapter("fs", 0): 4096, adapter("mock", 1): 300, adapter("fs", 2): 100}) == (
        metrics.series("lmcache_mp.num_inflight_l2_stores"), metrics.series("lmcache_mp.num_inflight_l2_loads"),
        metrics.series("lmcache_mp.inflight_load_memory_usage_bytes"))


def test_configured_adapters_read_zero_before_any_cache_process_runs(segment_factory, metrics):
    """With no live slot, every configured adapter is still reported, with 0."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    L2StateGaugesSubscriber(metrics.meter, GaugeBoardReader(segment, clock_ns=lambda: NOW), ["fs", "mock"])
    assert ({frozenset({("l2_name", "fs")}): 0, frozenset({("l2_name", "mock")}): 0},
            {adapter("fs", 0): 0, adapter("mock", 1): 0}) == (
        metrics.series("lmcache_mp.l2_usage_bytes"), metrics.series("lmcache_mp.num_inflight_l2_loads"))


def test_no_configured_adapter_means_no_series(board, metrics):
    """Without --l2 adapters the L2 gauges export nothing (words of unconfigured adapters are ignored)."""
    L2StateGaugesSubscriber(metrics.meter, board, [])
    assert ({}, {}) == (metrics.series("lmcache_mp.l2_usage_bytes"),
                        metrics.series("lmcache_mp.num_inflight_l2_stores"))
