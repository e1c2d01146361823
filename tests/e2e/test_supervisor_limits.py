"""The supervisor's two last resorts (issue 12, item 2).

* Give-up: a child that keeps dying is restarted with backoff 0.5, 1, 2, 4 s; at its 5th exit within
  30 s the supervisor logs ``supervisor.giving_up``, stops everything and exits 1.  Provoked the way it
  happens in production: the telemetry process cannot bind its /metrics port because something else
  listens there, so every start fails.
* Kill after the grace period: on SIGTERM a child that does not exit within 10 s is SIGKILLed.
  Provoked with a SIGSTOPped (hung) cache process: SIGTERM stays pending, SIGKILL still works.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from mpcache_service import wait_for
from service_control import SMALL, gone

pytestmark = pytest.mark.slow

GRACE_S = 10.0  # documented: children get 10 s after SIGTERM
CRASHES, WINDOW_S = 5, 30.0  # documented: 5 exits within 30 s


def test_telemetry_that_cannot_start_makes_the_supervisor_give_up_and_exit_1(controlled_services):
    """/metrics's port is taken by another listener: the telemetry process exits at every start; the
    supervisor starts it 5 times (5 pids), schedules restarts after 0.5, 1, 2 and 4 s, logs one
    ``supervisor.giving_up`` naming telemetry and its 5 exits in 30 s, stops the cache processes cleanly
    (exit 0, none killed), removes its segments and exits with status 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = controlled_services("--workers", "1", *SMALL, "--prometheus-port", str(port))
        started = time.monotonic()
        status = service.process.wait(CRASHES * 2 + WINDOW_S)  # far past 7.5 s of backoff plus 5 starts
        elapsed = time.monotonic() - started

    assert 1 == status
    pids = service.pids("telemetry")
    assert CRASHES == len(set(pids)) == len(pids)
    crash_statuses = [line["exit_status"] for line in service.lines("child.exited", child_role="telemetry")]
    assert CRASHES == len(crash_statuses) and all(s != 0 for s in crash_statuses)
    assert [0.5, 1.0, 2.0, 4.0] == [line["in_s"] for line in service.lines("child.restart_scheduled")]
    [giving_up] = service.lines("supervisor.giving_up")
    assert giving_up["message"].startswith(f"giving up: telemetry exited {CRASHES} times in 30 s")
    assert elapsed < WINDOW_S + 5
    assert [0] == [line["exit_status"] for line in service.lines("child.exited", child_role="cache")]
    assert [] == service.lines("child.killed")
    assert [1] == [line["exit_code"] for line in service.lines("supervisor.stopped")]
    assert [] == service.shm_entries()


def test_a_hung_cache_process_is_killed_after_the_grace_period(controlled_services):
    """cache[0] is SIGSTOPped, then the supervisor gets SIGTERM: it waits the 10 s grace period for
    cache[0] (no sooner: the exit takes at least 10 s), logs ``child.killed`` for its pid, SIGKILLs it
    (exit status -9), while cache[1] and telemetry exit 0; the supervisor exits 0 well before a second
    grace period has passed, and the hung process and the segments are gone."""
    service = controlled_services("--workers", "2", *SMALL)
    service.ready(2)
    [hung] = service.pids("cache", 0)
    try:
        os.kill(hung, signal.SIGSTOP)
        wait_for(lambda: _state(hung) == "T", 5, "cache[0] to be stopped")
        started = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        status = service.process.wait(3 * GRACE_S)
        elapsed = time.monotonic() - started
    finally:
        if not gone(hung):
            os.kill(hung, signal.SIGCONT)
    exits = {(line["child_role"], line["index"]): line["exit_status"] for line in service.lines("child.exited")}

    assert 0 == status
    assert GRACE_S <= elapsed < 2 * GRACE_S, f"exited {elapsed:.1f} s after SIGTERM"
    assert [(hung, GRACE_S)] == [(line["pid"], line["waited_s"]) for line in service.lines("child.killed")]
    assert {("cache", 0): -signal.SIGKILL, ("cache", 1): 0, ("telemetry", 0): 0} == exits
    assert gone(hung)
    assert [] == service.shm_entries()


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
