"""``python -m mpcache.cache`` as a real process: start-up, serving, logs, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest
from support.cache_harness import CHUNK_BYTES, MODEL
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.errors import ProtocolError
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.shm.segment import Segment


def test_cache_process_serves_logs_and_stops_cleanly_on_sigterm(provisioned, runtime_dir):
    """The module entry point serves on a 0600 socket, heartbeats in its gauge slot, logs start,
    client errors and stop as JSON lines (role cache, worker 0), and on SIGTERM removes its
    socket, zeroes its heartbeat and exits 0."""
    config = provisioned()
    config_path = os.path.join(runtime_dir, "config.json")
    with open(config_path, "w", encoding="utf-8") as handle:
        handle.write(config.to_json())
    stderr_path = os.path.join(runtime_dir, "cache0.stderr")
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "mpcache.cache", "--config", config_path, "--worker", "0"],
                                   stderr=stderr)
    board_segment = Segment.attach(config.gauge_board_name())
    board = GaugeBoardReader(board_segment)
    try:
        socket_path = config.socket_path(0)
        wait_for(lambda: os.path.exists(socket_path) or process.poll() is not None, timeout_s=30, what="the socket",
                 tolerate=())
        assert None is process.poll()
        assert 0o600 == stat.S_IMODE(os.stat(socket_path).st_mode)
        with CacheClient(socket_path) as client:
            kv = client.register_buffer(1, CHUNK_BYTES)
            assert 1 == client.store(kv, request_id="r", model_name=MODEL, chunk_hashes=[5],
                                     block_ids=[0]).stored
            with pytest.raises(ProtocolError):
                client.call("no_such_op")
            assert (process.pid, [0]) == (board.word(0, layout.G_PID), board.live_slots())
            process.send_signal(signal.SIGTERM)
            assert 0 == process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (0, False) == (board.word(0, layout.G_HEARTBEAT), os.path.exists(socket_path))
    del board
    board_segment.close()
    with open(stderr_path, encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle if line.startswith("{")]
    seen = [(line["event"], line["role"], line["worker"]) for line in lines]
    assert [("cache.start", "cache", 0), ("client.error", "cache", 0), ("cache.stop", "cache", 0)] == seen
    # start-up's objects are out of the collector's reach: at least as many as importing the process's module
    # leaves tracked in a bare interpreter (a bound, not the count: it cannot tell a freeze before the process was
    # built from one after)
    assert lines[0]["gc_frozen"] >= _tracked_after_importing("mpcache.cache.process") > 0


def _tracked_after_importing(module: str) -> int:
    """How many objects the cyclic collector tracks in a fresh interpreter that imported ``module``."""
    probe = f"import gc, {module}; gc.collect(); print(len(gc.get_objects()))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout)


def test_bad_configuration_is_one_line_and_exit_status_2(tmp_path):
    """A configuration file that does not parse ends the process at once with status 2 and one
    line naming the file."""
    path = tmp_path / "config.json"
    path.write_text('{"instance_id": "x", "supervisor_pid": 1, "runtime_dir": "/tmp", "workers": 0}')
    result = subprocess.run([sys.executable, "-m", "mpcache.cache", "--config", str(path), "--worker", "0"],
                            capture_output=True, text=True, timeout=60)
    assert (2, 1) == (result.returncode, len(result.stderr.strip().splitlines()))
    assert "--workers" in result.stderr
