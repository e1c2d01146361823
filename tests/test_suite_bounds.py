"""The test suite never hangs: the project's pytest configuration bounds every test, so a hang is a failure
with a traceback and the run goes on; the tests' ZeroMQ sockets time out instead of waiting for a peer that
never comes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from support import scheduling, zmq_sockets
from support.lmcache_client import LMClient

REPO = Path(__file__).resolve().parent.parent

HANGING = '''
import threading


def test_hangs():
    threading.Event().wait()  # blocked for good


def test_after_it():
    pass
'''


def test_a_test_that_hangs_fails_with_its_traceback_and_the_run_goes_on(tmp_path) -> None:
    """Under pyproject.toml's pytest configuration (the bound shortened to 2 s), a test blocked forever fails
    with a timeout naming the line it was blocked on, and the next test still runs and passes."""
    (tmp_path / "test_inner.py").write_text(HANGING)
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                          str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Timeout (>2.0s)" in run.stdout
    assert "threading.Event().wait()  # blocked for good" in run.stdout
    assert "1 failed, 1 passed" in run.stdout


UNDER_XDIST = '''
import os
import signal
import threading
import time

STARTED = {started!r}


def test_hangs():
    open(STARTED, "w").close()
    threading.Event().wait()  # blocked for good


def test_kills_its_worker():
    deadline = time.monotonic() + 60
    while not os.path.exists(STARTED) and time.monotonic() < deadline:  # the other worker is in test_hangs
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
'''


def test_under_xdist_a_hang_and_a_killed_worker_each_fail_their_test_by_name_and_the_run_ends(tmp_path) -> None:
    """With the test command's ``-n 2`` and pyproject.toml's options, one worker blocked for good and the other
    killed mid-test: the hang fails with its timeout and the line it was blocked on, the killed worker's test
    fails naming the worker and the test, and the run ends with exit status 1 (xdist 3.8 can hang replacing a
    killed worker under scope scheduling, which tests/conftest.py's is: --max-worker-restart 0 ends the run).
    Its temporary files are its own (``--basetemp``): what another run left in pytest's shared folder, which
    pytest warns it cannot remove, is not this run's."""
    (tmp_path / "test_inner.py").write_text(UNDER_XDIST.format(started=str(tmp_path / "hang-started")))
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                          str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2", "-n", "2",
                          "--basetemp", str(tmp_path / "inner-tmp"), str(tmp_path)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Timeout (>2.0s)" in run.stdout and "threading.Event().wait()  # blocked for good" in run.stdout
    assert re.search(r"worker 'gw[01]' crashed while running 'test_inner.py::test_kills_its_worker'", run.stdout)
    assert "2 failed in" in run.stdout, run.stdout[-3000:]


class _Item:
    """What support.scheduling reads of a collected test: its node id and its `slow` mark."""

    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return name == "slow" and self.slow or None


def test_each_file_is_one_unit_the_engine_files_one_and_the_units_go_heaviest_first() -> None:
    """The engine-starting files first (in collection order), then files by how many slow tests they have,
    ties in collection order, each file's tests together; a test's unit is ``engines`` or its file."""
    collected = [_Item("tests/a.py::t1"), _Item("tests/vllm/test_e.py::t1", slow=True), _Item("tests/b.py::t1"),
                 _Item("tests/b.py::t2", slow=True), _Item("tests/c.py::t1", slow=True),
                 _Item("tests/c.py::t2[x::y]", slow=True), _Item("tests/docker/test_c.py::t1"), _Item("tests/d.py::t1")]
    items = list(collected)
    scheduling.order(items)

    assert ["tests/vllm/test_e.py::t1", "tests/docker/test_c.py::t1", "tests/c.py::t1", "tests/c.py::t2[x::y]",
            "tests/b.py::t1", "tests/b.py::t2", "tests/a.py::t1", "tests/d.py::t1"] == [i.nodeid for i in items]
    assert ["tests/a.py", "engines", "tests/b.py", "tests/b.py", "tests/c.py", "tests/c.py", "engines",
            "tests/d.py"] == [scheduling.group_of(item.nodeid) for item in collected]


def test_a_dealer_with_no_peer_fails_its_send_and_receive_instead_of_waiting_forever() -> None:
    """A DEALER without a pipe (never connected, or dropped by libzmq after a failed handshake) blocks a send
    until a peer comes; the tests' DEALERs raise ``zmq.Again`` after their timeout instead."""
    dealer = zmq_sockets.dealer(timeout_ms=200)
    try:
        started = time.monotonic()
        with pytest.raises(zmq.Again):
            dealer.send_multipart([b"\x00", b"\x18"])
        with pytest.raises(zmq.Again):
            dealer.recv_multipart()
        assert time.monotonic() - started < 5
    finally:
        dealer.close()


def test_the_lmcache_test_client_is_bounded_by_its_timeout(tmp_path) -> None:
    """LMClient's socket sends and receives within its ``timeout_s`` and does not linger at close."""
    client = LMClient(f"ipc://{tmp_path}/nobody.ipc", timeout_s=1.5)
    try:
        options = [client.socket.getsockopt(option) for option in (zmq.SNDTIMEO, zmq.RCVTIMEO, zmq.LINGER)]
        assert options == [1500, 1500, 0]
    finally:
        client.close()
