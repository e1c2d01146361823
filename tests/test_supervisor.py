"""The supervisor's failure domains, driven with stand-in children.

Each test runs :meth:`Supervisor.watch` on a thread over children that are tiny Python processes
(one that exits at once with a given status, one that sleeps), with the restart policy's times
shortened through the policies it is given.  The instance's shared memory is real (its gauge board is
where the supervisor reads heartbeats and writes each cache process's state); everything is stopped
and unlinked at teardown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.waiting import wait_for

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot
from mpcache.shm.ring import read_geometry
from mpcache.shm.segment import Segment
from mpcache.supervisor.children import Child, Role
from mpcache.supervisor.logforward import LineForwarder
from mpcache.supervisor.provision import create_segments, repair_cache_segments, unlink_segments
from mpcache.supervisor.restart import RestartPolicy
from mpcache.supervisor.watch import Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def exits(status: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({status})"]


class RecordingLog:
    """Stands in for the structlog logger: keeps (level, event, fields) of every call."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def _record(self, level: str, event: str, **fields: Any) -> None:
        with self._lock:
            self.lines.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._record("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._record("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._record("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._record("error", event, **fields)

    def events(self, event: str, level: str | None = None, **match: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [fields for lvl, name, fields in self.lines if name == event and (level is None or lvl == level)
                    and all(fields.get(k) == v for k, v in match.items())]


class Running:
    """A supervisor whose watch loop runs on a thread, over the children a test gave it."""

    def __init__(self, config: Config, children: list[Child], hang_timeout_s: float | None = None,
                 policies: dict[Role, RestartPolicy] | None = None) -> None:
        self.config = config
        self.log = RecordingLog()
        if hang_timeout_s is not None:
            config = dataclasses.replace(config, hang_timeout_s=hang_timeout_s)
            self.config = config
        kwargs: dict[str, Any] = {}
        if policies is not None:
            kwargs["policies"] = policies
        self.supervisor = Supervisor(config, os.path.join(config.runtime_dir, "config.json"), self.log,
                                     LineForwarder(""), **kwargs)
        self.supervisor.children.extend(children)
        for child in children:
            self.supervisor._spawn(child)
        self.loops = 0  # watch-loop iterations completed: each ends with the heartbeat check
        check_heartbeats = self.supervisor._check_heartbeats

        def counted(now: float) -> None:
            check_heartbeats(now)
            self.loops += 1

        self.supervisor._check_heartbeats = counted  # type: ignore[method-assign]
        self.result: list[int] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.supervisor.watch()), daemon=True)
        self.thread.start()

    def pids(self, role: str, index: int = 0) -> list[int]:
        return [f["pid"] for f in self.log.events("child.started", child_role=role, index=index)]

    def wait_loops(self, count: int) -> None:
        """Until the watch loop has completed ``count`` more iterations (each sleeps the watch interval): what
        it would have done by then — a restart it scheduled, a start — it did."""
        target = self.loops + count
        wait_for(lambda: self.loops >= target or not self.thread.is_alive(), 30, f"{count} watch-loop iterations",
                 tolerate=())

    def alive(self, child: Child) -> bool:
        return child.process is not None and child.process.poll() is None

    def finish(self) -> None:
        self.supervisor.request_stop(signal.SIGTERM, None)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the watch loop did not return"
        self.supervisor.stop()


@pytest.fixture
def instance(tmp_path) -> Iterator[Callable[..., Config]]:
    """``make(workers)``: a Config whose segments exist (unlinked at teardown)."""
    made: list[tuple[Config, list[Segment]]] = []

    def make(workers: int = 2) -> Config:
        config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir=str(tmp_path),
                        workers=workers, l1_size_bytes=64 * 4096, chunk_bytes=4096, ring_capacity_cells=1024,
                        intern_capacity=64)
        made.append((config, create_segments(config)))
        return config

    yield make
    for config, segments in made:
        for segment in segments:
            segment.close()
        unlink_segments(config)


@pytest.fixture
def supervised(instance) -> Iterator[Callable[..., Running]]:
    """``start(children, workers=2, hang_timeout_s=None, policies=None)``: a running supervisor, stopped at
    teardown."""
    started: list[Running] = []

    def start(children: list[Child], workers: int = 2, hang_timeout_s: float | None = None,
              policies: dict[Role, RestartPolicy] | None = None) -> Running:
        running = Running(instance(workers), children, hang_timeout_s, policies)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.finish()
        for child in running.supervisor.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()


@pytest.fixture
def fast_policy() -> dict[Role, RestartPolicy]:
    """Backoff from 10 ms, telemetry's capped at 80 ms; 5 exits within 30 s still give a cache process up."""
    return {Role.CACHE: RestartPolicy(backoff_max_s=8.0, give_up_after=5, crash_window_s=30.0, backoff_initial_s=0.01),
            Role.TELEMETRY: RestartPolicy(backoff_max_s=0.08, give_up_after=None, crash_window_s=30.0,
                                          backoff_initial_s=0.01)}


def test_telemetry_that_keeps_failing_is_restarted_forever_with_capped_backoff_and_the_cache_keeps_running(
        supervised, fast_policy) -> None:
    """A telemetry process that exits 1 at every start is restarted again and again — 12 starts, far past
    the 5 exits that give a cache process up — with backoff doubling from 10 ms to its 80 ms cap; every exit
    is logged at error level (``telemetry.down``); the two cache processes are never touched (one start
    each, still running) and the supervisor keeps watching (no ``supervisor.giving_up``)."""
    caches = [Child(Role.CACHE, w, SLEEPER) for w in range(2)]
    running = supervised([Child(Role.TELEMETRY, 0, exits(1)), *caches], policies=fast_policy)

    wait_for(lambda: len(running.pids("telemetry")) >= 12 or not running.thread.is_alive(), 30, "12 telemetry starts",
             tolerate=())
    down = running.log.events("telemetry.down", level="error")
    backoffs = [f["in_s"] for f in running.log.events("child.restart_scheduled", child_role="telemetry")]

    assert running.thread.is_alive(), f"the supervisor stopped: {running.log.events('supervisor.giving_up')}"
    assert [] == running.log.events("supervisor.giving_up")
    assert [0.01, 0.02, 0.04, 0.08, 0.08, 0.08] == backoffs[:6]
    assert len(down) >= 11 and all(f["exit_status"] == 1 for f in down)
    assert [True, True] == [running.alive(c) for c in caches]
    assert [1, 1] == [len(running.pids("cache", w)) for w in range(2)]


def test_a_crash_looping_cache_process_is_given_up_alone(supervised, fast_policy) -> None:
    """cache[0] exits 3 at every start: after its 5th exit it is given up (``cache.given_up`` at error
    level naming it, no 6th start, its gauge-board state word and the status file say ``given_up``) while
    cache[1] and telemetry keep running with one start each, and the supervisor keeps watching with exit
    code 0."""
    others = [Child(Role.TELEMETRY, 0, SLEEPER), Child(Role.CACHE, 1, SLEEPER)]
    running = supervised([others[0], Child(Role.CACHE, 0, exits(3)), others[1]], policies=fast_policy)

    wait_for(lambda: running.log.events("cache.given_up") or not running.thread.is_alive(), 30,
             "cache[0] to be given up", tolerate=())
    running.wait_loops(3)  # past twice the watch interval (and the 160 ms backoff): a sixth start would be done
    [given_up] = running.log.events("cache.given_up", level="error")
    board = Segment.attach(running.config.gauge_board_name())
    try:
        state = layout.CACHE_STATES[GaugeSlot(board, 0).get(layout.G_STATE)]
    finally:
        board.close()
    status = json.loads(open(os.path.join(running.config.runtime_dir, "status.json")).read())

    assert running.thread.is_alive(), "the supervisor stopped everything"
    assert (0, 3, [1]) == (given_up["worker"], given_up["exit_status"], given_up["still_serving"])
    assert "cache[0]" in given_up["message"]
    assert 5 == len(running.pids("cache", 0))
    assert [True, True] == [running.alive(c) for c in others]
    assert [1, 1] == [len(running.pids("telemetry")), len(running.pids("cache", 1))]
    assert "given_up" == state
    assert ["given_up", "starting"] == [entry["state"] for entry in status["cache"]]
    assert [] == running.log.events("supervisor.giving_up")
    running.finish()
    assert [0] == running.result


def test_the_supervisor_exits_1_once_every_cache_process_is_given_up(supervised, fast_policy) -> None:
    """Both cache processes crash-loop: each is given up after 5 exits; only then does the watch loop
    return exit code 1, with one ``supervisor.giving_up`` line; telemetry was started once."""
    running = supervised([Child(Role.TELEMETRY, 0, SLEEPER), Child(Role.CACHE, 0, exits(1)),
                          Child(Role.CACHE, 1, exits(2))], policies=fast_policy)

    running.thread.join(30)

    assert not running.thread.is_alive()
    assert [1] == running.result
    assert [0, 1] == sorted(f["worker"] for f in running.log.events("cache.given_up"))
    assert [5, 5, 1] == [len(running.pids("cache", 0)), len(running.pids("cache", 1)), len(running.pids("telemetry"))]
    assert 1 == len(running.log.events("supervisor.giving_up", level="error"))
    running.supervisor.stop()


def test_a_failing_demo_is_not_restarted_and_does_not_stop_the_cache(supervised, fast_policy) -> None:
    """The demo (a client) exits 1: it is logged (``demo.failed`` at error level) and not restarted,
    the cache processes and telemetry keep running, and the exit code at stop is 1."""
    children = [Child(Role.TELEMETRY, 0, SLEEPER), Child(Role.CACHE, 0, SLEEPER), Child(Role.CACHE, 1, SLEEPER)]
    running = supervised([*children, Child(Role.DEMO, 0, exits(1))], policies=fast_policy)

    wait_for(lambda: running.log.events("demo.failed") or not running.thread.is_alive(), 30, "the demo to fail",
             tolerate=())
    running.wait_loops(3)  # past twice the watch interval (and the 10 ms backoff): a restart would be done

    assert running.thread.is_alive(), "the demo's failure stopped the service"
    assert 1 == len(running.pids("demo"))
    assert [True, True, True] == [running.alive(c) for c in children]
    assert 1 == len(running.log.events("demo.failed", level="error"))
    running.finish()
    assert [1] == running.result


def test_a_cache_process_whose_heartbeat_stops_is_killed_restarted_and_its_gauges_cleared(supervised) -> None:
    """A cache process that serves (its socket file exists; the test writes its pid and heartbeats every
    50 ms into its gauge slot, plus 12345 bytes of L1 usage) and then falls silent is killed once the
    hang timeout (1 s) has passed, not before (``cache.unresponsive`` at error level, exit status -9; a
    watchdog that never fires fails the wait for that line, ten hang timeouts), restarted (a second pid),
    and its slot is zeroed — heartbeat, pid and L1 usage read 0 until the new process writes them — so
    telemetry neither counts it as live nor shows its usage.  The other cache process, which keeps
    beating, is left alone."""
    caches = [Child(Role.CACHE, 0, SLEEPER), Child(Role.CACHE, 1, SLEEPER)]
    running = supervised([Child(Role.TELEMETRY, 0, SLEEPER), *caches], hang_timeout_s=1.0)
    [victim] = running.pids("cache", 0)
    board = Segment.attach(running.config.gauge_board_name())
    slots = [GaugeSlot(board, w) for w in range(2)]
    stop_beating = threading.Event()

    def beat(worker: int, pid: int, until: Callable[[], bool]) -> None:
        while not until():
            slots[worker].set(layout.G_PID, pid)
            slots[worker].set(layout.G_HEARTBEAT, time.time_ns())
            time.sleep(0.05)

    slots[0].set(layout.G_L1_USED, 12345)
    survivor = caches[1].process.pid
    beaters = [threading.Thread(target=beat, args=(0, victim, lambda: stop_beating.is_set()), daemon=True),
               threading.Thread(target=beat, args=(1, survivor, lambda: not running.thread.is_alive()), daemon=True)]
    try:
        for worker in range(2):
            open(running.config.socket_path(worker), "w").close()
        for thread in beaters:
            thread.start()
        wait_for(lambda: caches[0].state == "serving", 10, "cache[0] to serve", tolerate=())
        stop_beating.set()
        beaters[0].join()
        silent_from = time.monotonic()
        [unresponsive] = wait_for(lambda: running.log.events("cache.unresponsive"), 10, "cache.unresponsive",
                                  tolerate=())
        detected_after = time.monotonic() - silent_from
        wait_for(lambda: len(running.pids("cache", 0)) == 2, 10, "cache[0] to be restarted", tolerate=())
        words = [slots[0].get(w) for w in (layout.G_HEARTBEAT, layout.G_PID, layout.G_L1_USED)]
        exit_status = running.log.events("child.exited", child_role="cache", index=0)[0]["exit_status"]
        survivor_alive = running.alive(caches[1])
        running.finish()
    finally:
        stop_beating.set()
        for thread in beaters:
            thread.join(5)
        slots.clear()
        board.close()

    assert (0, victim) == (unresponsive["worker"], unresponsive["pid"])
    assert 0.9 <= detected_after
    assert -signal.SIGKILL == exit_status
    assert [0, 0, 0] == words
    assert survivor_alive and [survivor] == running.pids("cache", 1)


DAMAGES_ITS_SEGMENTS_ONCE = """
import os, sys, time
marker, ring, pool = sys.argv[1:]
if not os.path.exists(marker):
    open(marker, "w").close()
    os.truncate("/dev/shm" + ring, 0)  # as a process sharing the IPC namespace can
    os.truncate("/dev/shm" + pool, 4096)
    sys.exit(1)
time.sleep(120)
"""


def test_a_cache_process_whose_segments_were_truncated_gets_them_recreated_and_the_supervisor_lives_on(
        instance, fast_policy, tmp_path) -> None:
    """cache[0]'s event ring is truncated to 0 bytes and its L1 pool to 4 KiB, then it exits: the supervisor
    (which died of ``LayoutMismatchError`` from the torn-record check) recreates both at their sizes, the ring
    formatted, logs ``segment.recreated`` at error for each, counts 2 in the slot's segments-recreated word,
    and restarts the cache process, which keeps running."""
    config = instance(1)
    cache = Child(Role.CACHE, 0, [sys.executable, "-c", DAMAGES_ITS_SEGMENTS_ONCE, str(tmp_path / "damaged"),
                                  config.ring_name(0), config.l1_pool_name(0)])
    running = Running(config, [Child(Role.TELEMETRY, 0, SLEEPER), cache], policies=fast_policy)
    try:
        wait_for(lambda: len(running.pids("cache")) == 2 or not running.thread.is_alive(), 30, "the restart",
                 tolerate=())
        recreated = running.log.events("segment.recreated", level="error")
        ring, board = Segment.attach(config.ring_name(0)), Segment.attach(config.gauge_board_name())
        try:
            geometry = read_geometry(ring)
            sizes = (ring.size, os.stat("/dev/shm" + config.l1_pool_name(0)).st_size)
            counted = GaugeBoardReader(board).word(0, layout.G_SEGMENTS_RECREATED)
        finally:
            ring.close()
            board.close()
        assert running.thread.is_alive()
        ring_bytes = layout.event_segment_size(1024, 64)
        assert [(config.ring_name(0), f"it is 0 bytes, not {ring_bytes}"),
                (config.l1_pool_name(0), f"it is 4096 bytes, not {config.l1_pool_bytes}")] == [
            (line["segment"], line["damage"]) for line in recreated]
        assert (ring_bytes, config.l1_pool_bytes) == sizes
        assert (1024, 64, 2) == (geometry.capacity, geometry.intern_capacity, counted)
        running.wait_loops(2)
        assert running.alive(cache)
    finally:
        running.finish()
        for child in running.supervisor.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()


@pytest.mark.parametrize(("damage", "expected"), [
    ("none", []),
    ("ring_overwritten", [("ring", "not an mpcache event ring")]),
    ("ring_gone", [("ring", "it is gone")]),
    ("pool_grown", [("pool", "it is 266240 bytes, not 262144")]),
])
def test_repair_recreates_exactly_the_damaged_segments(instance, damage, expected) -> None:
    """After a cache process died: an intact ring and pool are left as they are (a torn record aside); a ring
    whose header was overwritten or that is gone, or a pool of another size, is recreated and named with
    what was wrong."""
    config = instance(1)
    names = {"ring": config.ring_name(0), "pool": config.l1_pool_name(0)}
    if damage == "ring_overwritten":
        ring = Segment.attach(names["ring"])
        ring.buf[:8] = b"garbage!"
        ring.close()
    elif damage == "ring_gone":
        Segment.unlink(names["ring"])
    elif damage == "pool_grown":
        os.truncate("/dev/shm" + names["pool"], config.l1_pool_bytes + 4096)
    repair = repair_cache_segments(config, 0)
    assert ([], [names[what] for what, _ in expected]) == (repair.failed, [name for name, _ in repair.recreated])
    assert all(fragment in said for (_, fragment), (_, said) in zip(expected, repair.recreated))
    ring = Segment.attach(names["ring"])
    try:
        assert (1024, os.stat("/dev/shm" + names["pool"]).st_size) == (read_geometry(ring).capacity,
                                                                        config.l1_pool_bytes)
    finally:
        ring.close()

def test_the_status_line_names_children_that_are_not_as_they_should_be() -> None:
    """systemd's STATUS= line: telemetry starting (before its first heartbeat, as at READY) or running is not
    named; telemetry restarting or unresponsive is, as a cache process not serving is."""
    from mpcache.supervisor.status import status_line

    def children(telemetry: str, cache1: str) -> list[Child]:
        return [Child(Role.TELEMETRY, 0, [], state=telemetry), Child(Role.CACHE, 0, [], state="serving"),
                Child(Role.CACHE, 1, [], state=cache1)]

    assert ["2/2 cache processes serving", "2/2 cache processes serving",
            "2/2 cache processes serving; telemetry unresponsive",
            "1/2 cache processes serving; cache[1] restarting, telemetry restarting"] == [
        status_line(children("starting", "serving")), status_line(children("running", "serving")),
        status_line(children("unresponsive", "serving")), status_line(children("restarting", "restarting"))]
