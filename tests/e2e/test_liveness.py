"""Signals and liveness of a real ``bin/start-cache`` process tree.

* SIGHUP (a closed terminal, ``kill -HUP``) stops the service cleanly, like SIGTERM, instead of
  killing the supervisor and leaving its shared memory and children behind.
* A cache process that stops answering (SIGSTOP stands in for a deadlock) is found by its gauge-board
  heartbeat standing still for more than 5 s, killed and restarted, while the other keeps serving.
* The telemetry process alike, by the heartbeat its pump loop writes into the gauge board's header: found,
  killed, restarted and counted, with the cache processes untouched.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time

import numpy as np
import pytest
from support.service import CHUNK, SMALL, gone
from support.waiting import wait_for

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 5.0  # given as --hang-timeout (the default, 10 s, would only make the test slower)
TELEMETRY_HANG_TIMEOUT_S = 2.0  # given as --telemetry-hang-timeout (default 10 s)
TELEMETRY_BEAT_S = 1.0  # telemetry beats once per pump loop, at least this often (pump.MAX_SLEEP_S)
# how long after the hang timeout a stopped process may still go undetected: the supervisor looks every 0.1 s, so
# only a watchdog that does not fire (or a stall no loaded machine has) gets near it
DETECT_SLACK_S = 10.0


def round_trip(socket_path: str, chunks: int = 3) -> bool:
    """A fresh client stores ``chunks`` random chunks, prefetches and retrieves them into other blocks;
    True if the bytes came back equal."""
    with CacheClient(socket_path, connect_timeout_s=5) as client:
        kv = client.register_buffer(2 * chunks, CHUNK)
        kv.blocks[:chunks] = np.random.default_rng().integers(0, 256, (chunks, CHUNK))
        hashes = [secrets.randbits(63) for _ in range(chunks)]
        request = f"rt-{hashes[0]}"
        stored = client.store(kv, request_id=request, model_name="org/liveness", chunk_hashes=hashes,
                              block_ids=list(range(chunks))).stored
        job = client.lookup_prefetch(request_id=request + "-r", model_name="org/liveness", chunk_hashes=hashes)
        found = client.wait_prefetch(job).found_count
        got = client.retrieve(kv, request_id=request + "-r", job_id=job,
                              block_ids=list(range(chunks, 2 * chunks))).retrieved
        equal = bool(np.array_equal(kv.blocks[:chunks], kv.blocks[chunks:]))
        client.end_session(request)
        client.end_session(request + "-r")
        del kv
    return (stored, found, got, equal) == (chunks, chunks, chunks, True)


def test_sighup_stops_the_service_cleanly_like_sigterm(start_service) -> None:
    """SIGHUP to the supervisor: it logs ``supervisor.signal`` SIGHUP, every child exits 0 (none killed),
    the supervisor exits 0 within 15 s, and its shared memory and runtime dir are gone."""
    service = start_service("--workers", "1", *SMALL)
    service.ready(1)
    children = [line["pid"] for line in service.lines("child.started")]

    service.process.send_signal(signal.SIGHUP)
    status = service.process.wait(15)

    assert 0 == status
    assert ["SIGHUP"] == [line["signal"] for line in service.lines("supervisor.signal")]
    exits = {(line["child_role"], line["index"]): line["exit_status"] for line in service.lines("child.exited")}
    assert {("telemetry", 0): 0, ("cache", 0): 0} == exits
    assert [] == service.lines("child.killed")
    assert ([], False) == (service.shm_entries(), service.runtime_dir.exists())
    assert all(gone(pid) for pid in children)


def test_a_stopped_cache_process_is_found_by_its_heartbeat_killed_and_restarted(start_service) -> None:
    """cache[0] is SIGSTOPped: once --hang-timeout (5 s) has passed since its last heartbeat (not before, and
    within DETECT_SLACK_S more) the supervisor logs ``cache.unresponsive`` (error level, naming its pid, silent
    for at least 5 s), kills it (exit status -9) and starts a new cache[0] that serves a byte-exact round trip;
    cache[1] served round trips throughout and was never restarted; SIGTERM then stops everything with exit 0."""
    service = start_service("--workers", "2", "--hang-timeout", str(HANG_TIMEOUT_S), *SMALL)
    service.ready(2, metrics=False)
    assert round_trip(service.socket(0))
    [victim] = service.pids("cache", 0)

    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    survivor_trips = []
    while not service.lines("cache.unresponsive") and time.monotonic() - stopped_at < HANG_TIMEOUT_S + DETECT_SLACK_S:
        survivor_trips.append(round_trip(service.socket(1)))
    detected_after = time.monotonic() - stopped_at
    assert service.lines("cache.unresponsive"), f"cache[0] not found unresponsive {detected_after:.1f} s after SIGSTOP"
    [restarted] = wait_for(lambda: [p for p in service.pids("cache", 0) if p != victim], 15, "a new cache[0]")
    wait_for(lambda: service.lines("cache.start", worker=0, pid=restarted), 15, "the new cache[0] to serve")

    [unresponsive] = service.lines("cache.unresponsive")
    assert ("error", 0, victim) == (unresponsive["level"], unresponsive["worker"], unresponsive["pid"])
    # silent since its last heartbeat, which came up to one heartbeat interval (0.5 s) before the SIGSTOP
    assert HANG_TIMEOUT_S <= unresponsive["silent_s"] and HANG_TIMEOUT_S - 0.7 <= detected_after
    assert [-signal.SIGKILL] == [line["exit_status"] for line in service.lines("child.exited", index=0)]
    assert survivor_trips and all(survivor_trips)
    assert round_trip(service.socket(0))
    assert 1 == len(service.pids("cache", 1))
    assert gone(victim)
    assert 0 == service.stop()


def test_a_stopped_telemetry_process_is_found_by_its_heartbeat_killed_restarted_and_counted(start_service) -> None:
    """Telemetry is SIGSTOPped: once --telemetry-hang-timeout (2 s) has passed since its last heartbeat (which
    came up to one pump loop, 1 s, before the SIGSTOP; not before, and within DETECT_SLACK_S more) the supervisor
    logs ``telemetry.unresponsive`` at error level naming its pid, kills it (exit status -9) and starts a new
    one, which heartbeats (status.json says running) and exports ``mpcache_child_restarts_total{role="telemetry"}
    1``; the cache processes are the ones started first, and served round trips throughout."""
    service = start_service("--workers", "2", "--telemetry-hang-timeout", str(TELEMETRY_HANG_TIMEOUT_S), *SMALL)
    service.ready(2)
    caches = service.pids("cache", None)
    [victim] = service.pids("telemetry")
    wait_for(lambda: json.loads((service.runtime_dir / "status.json").read_text())["telemetry"] == "running", 30,
             "telemetry to heartbeat")

    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    trips = []
    while (not service.lines("telemetry.unresponsive")
           and time.monotonic() - stopped_at < TELEMETRY_HANG_TIMEOUT_S + DETECT_SLACK_S):
        trips.append(round_trip(service.socket(len(trips) % 2)))
    detected_after = time.monotonic() - stopped_at
    assert service.lines("telemetry.unresponsive"), f"telemetry not unresponsive {detected_after:.1f} s after SIGSTOP"
    [restarted] = wait_for(lambda: [p for p in service.pids("telemetry") if p != victim], 15, "a new telemetry")
    restarts = wait_for(lambda: service.scrape().by_label("mpcache_child_restarts_total", "role"), 30,
                        "the new telemetry's /metrics")
    wait_for(lambda: json.loads((service.runtime_dir / "status.json").read_text())["telemetry"] == "running", 30,
             "the new telemetry to heartbeat")
    print(f"telemetry SIGSTOPped: unresponsive logged after {detected_after:.2f} s "
          f"(--telemetry-hang-timeout {TELEMETRY_HANG_TIMEOUT_S:g} s)")

    [unresponsive] = service.lines("telemetry.unresponsive")
    assert ("error", victim) == (unresponsive["level"], unresponsive["pid"])
    assert TELEMETRY_HANG_TIMEOUT_S <= unresponsive["silent_s"]
    assert TELEMETRY_HANG_TIMEOUT_S - TELEMETRY_BEAT_S - 0.2 <= detected_after
    assert [-signal.SIGKILL] == [line["exit_status"] for line in service.lines("child.exited", child_role="telemetry")]
    assert {"cache": 0.0, "telemetry": 1.0} == restarts
    assert (caches, [victim, restarted]) == (service.pids("cache", None), service.pids("telemetry"))
    assert trips and all(trips)
    assert gone(victim)
    assert 0 == service.stop()
