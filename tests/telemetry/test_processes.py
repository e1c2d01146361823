"""The service's processes, sampled outside them: a real child process stands in for cache process 0 (its pid
in slot 0 of a real gauge board, its descriptor limit lowered from outside), this test process for telemetry
and its parent for the supervisor; each series is checked against /proc read independently of psutil."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from support.waiting import wait_for

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, format_gauge_board
from mpcache.telemetry.subscribers.metrics.processes import ProcessesSubscriber

CACHE0 = frozenset({("role", "cache"), ("worker", "0")})
TELEMETRY = frozenset({("role", "telemetry")})
SUPERVISOR = frozenset({("role", "supervisor")})
EXTRA_FDS = 20
HOLDER = (f"import os, sys; fds = [os.open('/dev/null', os.O_RDONLY) for _ in range({EXTRA_FDS})]; "
          "print(1, flush=True); sys.stdin.read()")


def _state(pid: int) -> str:
    """The process's state letter from /proc/PID/stat (after the parenthesised command name)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def cache0():
    """A process holding 20 extra descriptors until its stdin closes, its soft descriptor limit lowered to 77."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert b"1\n" == process.stdout.readline()
    _, hard = psutil.Process(process.pid).rlimit(psutil.RLIMIT_NOFILE)
    psutil.Process(process.pid).rlimit(psutil.RLIMIT_NOFILE, (77, hard))
    yield process
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)  # stopped by a test that needs its counters to hold still
    process.stdin.close()
    process.wait(10)
    process.stdout.close()


@pytest.fixture
def board(segment_factory):
    """Two slots; only slot 0 heartbeats (slot 1 is not live: no series)."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    return segment


def test_each_process_is_reported_by_role_and_worker_with_proc_s_own_numbers(metrics, board, cache0):
    # stopped, its context switches hold still between the collection and /proc's read (running, it could still
    # be on its way into the read it blocks in: CI once saw 1 voluntary switch in /proc where 0 were collected)
    os.kill(cache0.pid, signal.SIGSTOP)
    wait_for(lambda: _state(cache0.pid) == "T", 30, "the stand-in cache process to stop")
    GaugeSlot(board, 0).heartbeat(pid=cache0.pid)
    ProcessesSubscriber(metrics.meter, GaugeBoardReader(board, stale_after_s=60.0))
    collected = metrics.collect()
    open_fds = len(os.listdir(f"/proc/{cache0.pid}/fd"))
    with open(f"/proc/{cache0.pid}/status", encoding="ascii") as handle:
        switches = {line.split(":")[0]: int(line.split()[1]) for line in handle if "ctxt_switches" in line}
    own_limit = psutil.Process().rlimit(psutil.RLIMIT_NOFILE)[0]

    assert {CACHE0, TELEMETRY, SUPERVISOR} == set(collected["mpcache.process_open_fds"])
    assert (open_fds, 77, own_limit) == (collected["mpcache.process_open_fds"][CACHE0],
                                         collected["mpcache.process_max_fds"][CACHE0],
                                         collected["mpcache.process_max_fds"][TELEMETRY])
    assert open_fds >= EXTRA_FDS + 3
    assert (switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]) == (
        collected["mpcache.process_voluntary_context_switches"][CACHE0],
        collected["mpcache.process_involuntary_context_switches"][CACHE0])
    assert all(value > 0 for value in collected["mpcache.process_resident_memory"].values())
    assert collected["mpcache.process_cpu"][TELEMETRY] > 0


def test_a_process_that_is_gone_is_left_out(metrics, board, cache0):
    GaugeSlot(board, 0).heartbeat(pid=cache0.pid)
    ProcessesSubscriber(metrics.meter, GaugeBoardReader(board, stale_after_s=60.0))
    assert CACHE0 in metrics.series("mpcache.process_open_fds")
    cache0.kill()
    cache0.wait(10)

    assert {TELEMETRY, SUPERVISOR} == set(metrics.series("mpcache.process_open_fds"))  # reaped: no such process
