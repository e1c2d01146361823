"""The health routes' answers, from a pump clock and a gauge board known to the test."""

from __future__ import annotations

from mpcache.telemetry.health import health_routes


class _Board:
    def __init__(self, n_slots: int, live: list[int]) -> None:
        self.n_slots = n_slots
        self.live = live

    def live_slots(self) -> list[int]:
        return self.live


def test_healthz_turns_503_when_the_pump_stops_polling():
    now = [100.0]
    routes = health_routes(lambda: 98.0, _Board(1, [0]), stall_after_s=5.0, clock=lambda: now[0])
    assert 200 == routes["/healthz"]()[0]
    now[0] = 104.0
    assert (503, b"telemetry pump stalled for 6.0 s\n") == routes["/healthz"]()[:2]


def test_ready_names_every_cache_process_that_is_not_serving():
    board = _Board(3, [1])
    routes = health_routes(lambda: 0.0, board, clock=lambda: 0.0)
    assert (503, b"not ready: cache[0], cache[2] not serving\n") == routes["/ready"]()[:2]
    board.live = [0, 1, 2]
    assert (200, b"ready: 3 cache processes serving\n") == routes["/ready"]()[:2]
