"""The test suite never hangs: the project's pytest configuration bounds every test, so a hang is a failure
with a traceback and the run goes on; the tests' ZeroMQ sockets time out instead of waiting for a peer that
never comes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from support import zmq_sockets
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
