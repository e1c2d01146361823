"""The test harness's free ports (tests/support/ports.py): each pytest-xdist worker picks from a slice of its own."""

from __future__ import annotations

import pytest
from support.ports import LOWEST, ephemeral_low, free_ports, share

BUS_OFFSET = 10_000  # a Redis Cluster node's bus port


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_xdist_workers_pick_from_disjoint_slices_below_the_ephemeral_range(monkeypatch, workers: int) -> None:
    """The workers' slices do not overlap and lie below the ephemeral range; a worker's plain ports stay in its
    slice; a port with its bus port 10,000 above is found whatever the slice's width (in the slice when both fit)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    slices = []
    for index in range(workers):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        low, high = share()
        slices.append((low, high))
        assert all(low <= port <= high for port in free_ports(4)), (low, high)
        pairs = free_ports(2, also_offset=BUS_OFFSET)
        assert all(LOWEST <= port and port + BUS_OFFSET < ephemeral_low() for port in pairs)
        if high - low > BUS_OFFSET + 2:
            assert all(low <= port and port + BUS_OFFSET <= high for port in pairs), ((low, high), pairs)
    assert LOWEST == slices[0][0] and slices[-1][1] < ephemeral_low()
    assert all(high < next_low for (_, high), (next_low, _) in zip(slices, slices[1:]))


@pytest.mark.parametrize("worker, workers", [("gw0", "1"), ("master", "2"), ("gw1", "x"), ("gw2", "2")])
def test_without_a_worker_index_below_a_count_the_whole_range_is_picked_from(monkeypatch, worker, workers) -> None:
    """Outside xdist, with one worker, or a replacement worker (index not below the count)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    assert (LOWEST, ephemeral_low() - 1) == share()
