"""The test harness's free ports (tests/support/ports.py): each pytest-xdist worker picks from a slice of its own."""

from __future__ import annotations

import pytest
from support.ports import LOWEST, ephemeral_low, free_ports, share


def test_xdist_workers_pick_from_disjoint_slices_below_the_ephemeral_range(monkeypatch) -> None:
    """Two workers' slices do not overlap and lie below the ephemeral range; a worker's ports (a Redis Cluster
    node's bus port, 10,000 above, included) stay in its slice; outside xdist the whole range is one's."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert (LOWEST, ephemeral_low() - 1) == share()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(share())
        low, high = slices[-1]
        ports = free_ports(8, also_offset=10_000)
        assert all(low <= port and port + 10_000 <= high for port in ports), (slices[-1], ports)
    (low0, high0), (low1, high1) = slices
    assert LOWEST == low0 <= high0 < low1 <= high1 < ephemeral_low()


@pytest.mark.parametrize("worker, workers", [("gw0", "1"), ("master", "2"), ("gw1", "x")])
def test_without_a_worker_index_and_count_the_whole_range_is_picked_from(monkeypatch, worker, workers) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    assert (LOWEST, ephemeral_low() - 1) == share()
