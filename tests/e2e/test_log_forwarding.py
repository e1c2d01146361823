"""Logging never blocks the data path.

The supervisor's stderr is a pipe this test holds: first nobody reads it (``start-cache ... 2>&1 |
sleep 400``) and then it is read again; in the second test its reader is gone for good (EPIPE).  With
``--log-level debug`` the telemetry process logs a line per event, so 1000 stores make about 2 MiB of
log lines: past the pipe (64 KiB) and the stderr queue (1 MiB).  The cache process must keep serving,
and the supervisor must keep restarting what dies and clean up at SIGTERM.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import termios
import threading
import time

import numpy as np
import psutil
import pytest
from support.service import CHUNK, SMALL, Service
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.supervisor.logfile import HEADER_EVENT

pytestmark = pytest.mark.slow

NOTES = ("log.lines_dropped", "log.sink_failed", "log.sink_stalled")


def store_many(socket_path: str, requests: int) -> int:
    """``requests`` stores of 4 fresh chunks each; returns the chunks stored."""
    base = secrets.randbits(40) << 20
    stored = 0
    with CacheClient(socket_path) as client:
        kv = client.register_buffer(4, CHUNK)
        kv.blocks[:] = np.random.default_rng().integers(0, 256, kv.blocks.shape)
        for n in range(requests):
            hashes = [base + 4 * n + i for i in range(4)]
            stored += client.store(kv, request_id=f"log-{base}-{n}", model_name="org/m", chunk_hashes=hashes,
                                   block_ids=[0, 1, 2, 3]).stored
            client.end_session(f"log-{base}-{n}")
        del kv
    return stored


def cache_children(service: Service) -> set[int]:
    """The pids of the supervisor's cache processes, from the process table (not from its log)."""
    try:
        children = psutil.Process(service.process.pid).children()
    except psutil.NoSuchProcess:
        return set()
    pids = set()
    for child in children:
        try:
            if "mpcache.cache" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def pipe_is_full(reader) -> bool:
    capacity = fcntl.fcntl(reader.fileno(), fcntl.F_GETPIPE_SZ)
    available = int.from_bytes(fcntl.ioctl(reader.fileno(), termios.FIONREAD, b"\0" * 4), "little")
    return available > capacity - 4096


def restarted_after_kill(service: Service) -> int:
    """kill -9 the cache process; wait (15 s) for the supervisor to start a new one; returns its pid."""
    [victim] = cache_children(service)
    os.kill(victim, signal.SIGKILL)
    [new] = wait_for(lambda: cache_children(service) - {victim}, 15, "the supervisor to restart the cache process")
    return new


def json_lines(text: str) -> list[dict]:
    out = []
    for raw in text.splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            pass
    return out


def test_an_unread_stderr_blocks_neither_the_cache_nor_restarts_and_drops_are_counted(start_service) -> None:
    """Nobody reads the supervisor's stderr while 1000 stores make about 2 MiB of debug lines: the
    stores all complete, the pipe is full, and the cache process, killed with -9, is still restarted
    and serves 100 more stores.  Once stderr is read again it carries ``log.lines_dropped`` and every
    line is accounted for: the lines stderr delivered plus the drops it reported equal the lines of the
    log file after its header, which dropped none.  SIGTERM then exits 0."""
    service = start_service("--workers", "1", *SMALL, "--disable-metrics", "--log-level", "debug", stderr_pipe=True)
    service.ready(1, metrics=False)
    stored = store_many(service.socket(0), 1000)
    wait_for(lambda: pipe_is_full(service.reader), 30, "the unread stderr pipe to fill")
    restarted = restarted_after_kill(service)
    wait_for(lambda: os.path.exists(service.socket(0)) and store_many(service.socket(0), 100), 30,
             "the restarted cache process to serve")

    delivered: list[bytes] = []
    reading = threading.Thread(target=lambda: delivered.extend(service.reader), daemon=True)
    reading.start()  # stderr recovers
    wait_for(lambda: any(b"log.lines_dropped" in line for line in list(delivered)), 30, "log.lines_dropped on stderr")
    assert 0 == service.stop()
    reading.join(30)

    on_stderr = json_lines(b"".join(delivered).decode())
    header, *in_file = service.log_lines()  # the file's own first line, never forwarded
    assert HEADER_EVENT == header["event"]
    reported = [line["dropped"] for line in on_stderr if line.get("event") == "log.lines_dropped"]
    assert 4000 == stored
    assert restarted in service.pids("cache", 0)
    assert reported and all(count > 0 for count in reported)
    assert {"stderr"} == {line["sink"] for line in in_file if line.get("event") in NOTES}
    assert 1 <= len([line for line in in_file if line.get("event") == "log.sink_stalled"]) == len(reported)
    [stopped] = [line for line in in_file if line.get("event") == "supervisor.stopped"]
    assert {"stderr": sum(reported), "stdout": 0, "log-file": 0} == stopped["log_lines_dropped"]
    assert len([line for line in on_stderr if line.get("event") not in NOTES]) + sum(reported) == len(
        [line for line in in_file if line.get("event") not in NOTES])


def test_a_closed_stderr_stops_neither_restarts_nor_the_clean_up(start_service) -> None:
    """The reader of the supervisor's stderr goes away (EPIPE on every write): a cache process killed
    with -9 is still restarted and serves, the log file says ``log.sink_failed`` for stderr and keeps
    receiving lines, and SIGTERM stops everything within 15 s with exit status 0, unlinking the shared
    memory and removing the runtime dir."""
    service = start_service("--workers", "1", *SMALL, "--disable-metrics", stderr_pipe=True)
    service.ready(1, metrics=False)
    service.reader.close()
    restarted = restarted_after_kill(service)
    wait_for(lambda: os.path.exists(service.socket(0)) and store_many(service.socket(0), 10), 30,
             "the restarted cache process to serve")

    started = time.monotonic()
    status = service.stop(30)

    assert 0 == status and time.monotonic() - started < 15
    assert restarted in service.pids("cache", 0)
    assert ["stderr"] == [line["sink"] for line in service.lines("log.sink_failed")]
    assert [0] == [line["exit_code"] for line in service.lines("supervisor.stopped")]
    assert ([], False) == (service.shm_entries(), service.runtime_dir.exists())
