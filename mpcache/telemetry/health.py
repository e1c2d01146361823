"""``/healthz`` and ``/ready`` next to ``/metrics``: is telemetry draining, is every cache process serving.

``/healthz`` is 200 while the pump has polled the rings within ``stall_after_s``; ``/ready`` is 200
while every cache process's gauge-board heartbeat is fresher than ``stale_after_s`` (a killed, stopped
or restarting cache process turns it 503).  Both answer with one short line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.http import Route

_TEXT = "text/plain; charset=utf-8"


def health_routes(polled_at: Callable[[], float], board: GaugeBoardReader, *, stall_after_s: float = 5.0,
                  clock: Callable[[], float] = time.monotonic) -> dict[str, Route]:
    def healthz() -> tuple[int, bytes, str]:
        age = clock() - polled_at()
        if age <= stall_after_s:
            return 200, b"ok\n", _TEXT
        return 503, f"telemetry pump stalled for {age:.1f} s\n".encode(), _TEXT

    def ready() -> tuple[int, bytes, str]:
        live = set(board.live_slots())
        missing = [worker for worker in range(board.n_slots) if worker not in live]
        if not missing:
            return 200, f"ready: {board.n_slots} cache processes serving\n".encode(), _TEXT
        names = ", ".join(f"cache[{worker}]" for worker in missing)
        return 503, f"not ready: {names} not serving\n".encode(), _TEXT

    return {"/healthz": healthz, "/ready": ready}
