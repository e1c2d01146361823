"""The supervisor's two last resorts.

* A taken /metrics port: checked before anything starts, one line naming the port, exit status 2.
  (It used to start telemetry five times in vain and then stop the whole service with exit 1; a
  telemetry process that fails after the start is restarted forever with capped backoff, while the
  cache keeps serving: ``tests/test_supervisor.py``.)
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


def test_a_taken_metrics_port_is_one_line_naming_it_before_anything_starts(controlled_services):
    """/metrics's port is taken by another listener: the supervisor exits 2 within seconds with exactly
    one stderr line naming --prometheus-port and the port, starts no child, and leaves no shared memory
    and no runtime dir behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = controlled_services("--workers", "1", *SMALL, "--prometheus-port", str(port))
        status = service.process.wait(30)
    service.stderr.close()
    lines = (service.runtime_dir.parent / "stderr.log").read_text().splitlines()

    assert 2 == status
    assert 1 == len(lines), lines
    assert "--prometheus-port" in lines[0] and f"port {port} " in lines[0]
    assert [] == service.lines("child.started")
    assert ([], False) == (service.shm_entries(), service.runtime_dir.exists())


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
