"""``--telemetry-nice N``: the telemetry process lowers its own priority; the cache processes keep theirs."""

from __future__ import annotations

import os

import psutil
from support.waiting import wait_for


def test_telemetry_process_runs_at_the_nice_increment_it_was_given(start_service):
    service = start_service("--workers", "1", "--telemetry-nice", "7")
    base = os.nice(0)  # children inherit ours; the increment is relative to it

    def started() -> dict | None:
        return next((line for line in service.log_lines() if line.get("event") == "telemetry.started"), None)

    line = wait_for(started, 60, "telemetry.started in the log")
    children = {" ".join(c.cmdline()): c for c in psutil.Process(service.process.pid).children()}
    [telemetry] = [c for cmd, c in children.items() if "mpcache.telemetry" in cmd]
    [cache] = [c for cmd, c in children.items() if "mpcache.cache" in cmd]
    assert (min(19, base + 7), min(19, base + 7), base) == (line["nice"], telemetry.nice(), cache.nice())
    assert 0 == service.stop()
