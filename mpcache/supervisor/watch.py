"""The supervisor's loop: start the children, watch them (exits, heartbeats, readiness), restart them by
their role's policy, stop them in order and remove everything the run created.

Each role is its own failure domain: telemetry is restarted forever, a crash-looping or hung cache process
is restarted and given up alone, the demo is never restarted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.supervisor.children import STOP_ORDER, Child, Programs, Role, child_argv, spawn, stop_group
from mpcache.supervisor.front import Front, SupervisorState
from mpcache.supervisor.liveness import Heartbeat, Liveness
from mpcache.supervisor.logforward import LineForwarder
from mpcache.supervisor.provision import repair_cache_segments, unlink_segments
from mpcache.supervisor.restart import CACHE_POLICY, TELEMETRY_POLICY, RestartPolicy
from mpcache.supervisor.runtime import Marker, RuntimeDir, remove_runtime_files
from mpcache.supervisor.status import BoardWriter, Reporter, status_line

WATCH_INTERVAL_S = 0.1
POLICIES: Mapping[Role, RestartPolicy] = {Role.CACHE: CACHE_POLICY, Role.TELEMETRY: TELEMETRY_POLICY}


class Supervisor:
    def __init__(self, config: Config, config_path: str, log: Any, forwarder: LineForwarder,
                 runtime: RuntimeDir | None = None,
                 programs: Programs | None = None, policies: Mapping[Role, RestartPolicy] = POLICIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.runtime = runtime if runtime is not None else RuntimeDir(config.runtime_dir, created=False)
        self.locks: list[Marker] = []  # released last, once everything they claim is gone
        self.liveness = {Role.CACHE: Liveness(config.hang_timeout_s),
                         Role.TELEMETRY: Liveness(config.telemetry_hang_timeout_s)}
        self.config_path = config_path
        self.log = log
        self.forwarder = forwarder
        self.programs = programs if programs is not None else Programs()
        self.policies = policies
        self.clock = clock
        self.children: list[Child] = []
        self.exit_code = 0
        self._signal: int | None = None  # set by the signal handler, which does nothing else
        self._stopping = False
        self._ready_logged = False
        self.board = BoardWriter(config)
        self.reporter = Reporter(config, log)
        self.front: Front | None = None  # the HTTP front (none with --no-http), closed last at stop
        self.loop_at = clock()  # when the loop last ran: the front's /healthz

    # -- children --------------------------------------------------------------

    def _spawn(self, child: Child) -> None:
        child.process = spawn(child, self.forwarder)
        child.started_at = self.clock()
        child.spawns += 1
        if child.spawns > 1:
            self.board.count_restarts(child)
        if child.role is Role.CACHE:
            child.heartbeat = Heartbeat(started_at=child.started_at, beat_changed_at=child.started_at,
                                        stale_socket=_inode(self.config.socket_path(child.index)))
            child.state = "starting"
            self.board.set_state(child.index, "starting")
        elif child.role is Role.TELEMETRY:
            child.heartbeat = Heartbeat(started_at=child.started_at, beat_changed_at=child.started_at)
            child.state = "starting"
        else:
            child.state = "running"
        self.log.info("child.started", child_role=child.role.value, index=child.index, pid=child.process.pid)
        self._write_status()

    def _add(self, child: Child) -> None:
        self.children.append(child)
        self._spawn(child)

    def start(self) -> None:
        # its own pid on their command line too: a child that cannot read the config once it is gone says so
        supervisor = ("--supervisor-pid", str(self.config.supervisor_pid))
        if self.programs.telemetry is not None:
            self._add(Child(Role.TELEMETRY, 0, child_argv(self.programs.telemetry, self.config_path, *supervisor)))
        for worker in range(self.config.workers):
            self._add(Child(Role.CACHE, worker, child_argv(self.programs.cache, self.config_path,
                                                           "--worker", str(worker), *supervisor)))

    def _caches(self) -> list[Child]:
        return [child for child in self.children if child.role is Role.CACHE]

    def _watched(self) -> list[Child]:
        """The children whose heartbeat the watchdog follows: telemetry and the cache processes."""
        return [child for child in self.children if child.role in self.liveness]

    def _update_readiness(self) -> None:
        """A cache process serves once its loop heartbeats and its socket exists; the demo starts when all do.
        Telemetry runs once it heartbeats."""
        changed = False
        for child in self.children:
            if child.role is Role.TELEMETRY and child.state == "starting" and child.heartbeat.listening:
                child.state = "running"
                changed = True
        for child in self._caches():
            if child.state == "starting" and child.process is not None and child.heartbeat.listening:
                child.state = "serving"
                self.board.set_state(child.index, "serving")
                if self._ready_logged:
                    self.log.info("cache.serving", worker=child.index, pid=child.process.pid)
                changed = True
        caches = self._caches()
        if not self._ready_logged and caches and all(child.state == "serving" for child in caches):
            self._ready_logged = True
            self.log.info("cache.ready", workers=self.config.workers,
                          sockets=[self.config.socket_path(w) for w in range(self.config.workers)])
            self.reporter.notify(READY="1", STATUS=status_line(self.children))
            if self.config.demo:
                self._add(Child(Role.DEMO, 0, child_argv(self.programs.demo, self.config_path)))
        if changed:
            self._write_status()

    def _check_heartbeats(self, now: float) -> None:
        """Kill a cache process or telemetry whose heartbeat word stopped advancing (SIGSTOP, a deadlock, a
        stuck request or subscriber): it is restarted like one that died.  Its words are cleared at once, so
        that a dead cache process's slot is neither live nor read as an empty cache."""
        for child in self._watched():
            process = child.process
            words = self._heartbeat_words(child)
            if process is None or words is None or child.state not in ("starting", "serving", "running"):
                continue
            pid_word, beat, serving, clear = words
            silence = self.liveness[child.role].observe(child.heartbeat, process.pid, pid_word, beat, serving, now)
            if silence is None:
                continue
            fields = {"worker": child.index} if child.role is Role.CACHE else {}
            others = "" if child.role is Role.CACHE else "; the cache processes keep serving"
            self.log.error(f"{child.role.value}.unresponsive", pid=process.pid, silent_s=round(silence.silent_s, 1),
                           **fields,
                           message=f"{child.label} (pid {process.pid}): {silence.what} for {silence.silent_s:.1f} s "
                           f"(limit {silence.limit_s:g} s); killing it (SIGKILL) and restarting it{others}")
            child.state = "unresponsive"
            clear()
            process.kill()
            self._write_status()

    def _heartbeat_words(self, child: Child) -> tuple[int, int, Callable[[], bool], Callable[[], None]] | None:
        """A watched child's pid and heartbeat words, whether it serves yet and how its words are cleared (a
        cache process's whole slot); None while the gauge board cannot be read."""
        if child.role is Role.CACHE:
            slot = self.board.slot(child.index)
            if slot is None:
                return None
            serving = functools.partial(_replaced, self.config.socket_path(child.index), child.heartbeat.stale_socket)
            return (slot.get(layout.G_PID), slot.get(layout.G_HEARTBEAT), serving,
                    functools.partial(self.board.clear, child.index, "unresponsive"))
        beat = self.board.telemetry()
        return None if beat is None else (beat.pid, beat.heartbeat, _always, beat.clear)

    def _reap(self, child: Child, status: int) -> None:
        assert child.process is not None
        now = self.clock()
        # a child that failed or was killed (a negative status: the signal) is an error; journalctl -p err shows it
        log = self.log.info if status == 0 else self.log.error
        log("child.exited", child_role=child.role.value, index=child.index, pid=child.process.pid,
            exit_status=status)
        child.process = None
        if child.role is Role.DEMO:
            # A client: never restarted (its tally covers one run); its failure never stops the cache.
            child.state = "finished" if status == 0 else "failed"
            if status != 0:
                self.log.error("demo.failed", exit_status=status,
                               message="the demo failed and is not restarted; the cache keeps serving, and the "
                                       "supervisor's exit status will be 1")
                self.exit_code = 1
            self._write_status()
            return
        if child.role is Role.TELEMETRY and (words := self.board.telemetry()) is not None:
            words.clear()
        if child.role is Role.CACHE:
            self._repair_board()
            self._repair_segments(child.index)
            self.board.clear(child.index, "restarting")
            _remove_socket(self.config.socket_path(child.index))  # clients get "no such file", not a dead socket
        policy = self.policies[child.role]
        decision = policy.after_exit(child.exits, child.started_at, now)
        child.exits = decision.history
        if decision.give_up:
            self._give_up(child, status, policy)
            return
        backoff = decision.backoff_s
        child.restart_at = now + backoff
        child.state = "restarting"
        if child.role is Role.TELEMETRY:
            self.log.error("telemetry.down", exit_status=status, failures=child.exits.failures, restart_in_s=backoff,
                           message=f"the telemetry process exited (status {status}); restarting it in {backoff:g} s. "
                                   "The cache processes keep serving; metrics are not served or pushed meanwhile")
        self.log.warning("child.restart_scheduled", child_role=child.role.value, index=child.index, in_s=backoff)
        self._write_status()

    def _repair_segments(self, worker: int) -> None:
        """A dead cache process's ring and L1 pool: its torn record counted, a damaged one recreated (and
        counted, mpcache_segments_recreated_total), so that the restart does not die of the same damage."""
        repair = repair_cache_segments(self.config, worker)
        if repair.torn:
            self.log.warning("ring.torn_record", worker=worker,
                             detail="a record begun by the dead process was counted as dropped")
        for name, damage in repair.recreated:
            self.log.error("segment.recreated", worker=worker, segment=name, damage=damage,
                           message="a shared-memory segment of this cache process was damaged (truncated, resized "
                                   "or overwritten by a process sharing the IPC namespace): recreated empty, so "
                                   "this cache process's L1 is lost")
        for name, damage, error in repair.failed:
            self.log.error("segment.recreate_failed", worker=worker, segment=name, damage=damage, error=error)
        if repair.recreated:
            self.board.count_recreated(worker, len(repair.recreated))

    def _repair_board(self) -> None:
        """A gauge board truncated or overwritten under the service (a process sharing the IPC namespace) is
        restored in place before anything reads it again; the children that died of it are restarted as any."""
        try:
            damage = self.board.repair()
        except OSError as exc:
            self.log.error("segment.recreate_failed", segment=self.config.gauge_board_name(), error=str(exc))
            return
        if damage is not None:
            self.log.error("segment.recreated", segment=self.config.gauge_board_name(), damage=damage,
                           message="the gauge board was damaged (truncated or overwritten by a process sharing the "
                                   "IPC namespace): restored where it is; the cache processes' counters in it are "
                                   "lost, and a child that faulted on it is restarted")

    def _give_up(self, child: Child, status: int, policy: RestartPolicy) -> None:
        """A crash-looping cache process is given up alone; the supervisor stops once none is left."""
        child.state = "given_up"
        self.board.set_state(child.index, "given_up")
        serving = [c.index for c in self._caches() if c.state != "given_up"]
        self.log.error(
            "cache.given_up", worker=child.index, exit_status=status, still_serving=serving,
            message=f"giving up on {child.label}: it exited {len(child.exits.exits)} times in "
                    f"{policy.crash_window_s:.0f} s (last exit status {status}); its socket stays unserved"
                    + (f", cache processes {serving} keep serving" if serving else ""),
        )
        self._write_status()
        if not serving:
            self.log.error("supervisor.giving_up",
                           message=f"giving up: every cache process ({len(self._caches())}) crash-looped")
            self.exit_code = 1
            self._stopping = True

    def _write_status(self) -> None:
        self.reporter.write(self.children, self._stopping, self._ready_logged)

    def front_state(self) -> SupervisorState:
        """What the HTTP front answers from (called on its thread: reads, never changes, the loop's state)."""
        telemetry = next((child for child in self.children if child.role is Role.TELEMETRY), None)
        if telemetry is None:
            return SupervisorState(self.loop_at, self._stopping or self._signal is not None, "off", None, 0)
        process = telemetry.process
        return SupervisorState(self.loop_at, self._stopping or self._signal is not None, telemetry.state,
                               process.pid if process is not None else None, max(0, telemetry.spawns - 1))

    # -- the loop ------------------------------------------------------------------------------

    def watch(self) -> int:
        started = self.clock()
        while self._signal is None and not self._stopping:
            now = self.loop_at = self.clock()
            self._repair_board()
            for child in self.children:
                if child.done:
                    continue
                if child.process is None:
                    if now >= child.restart_at:
                        self._spawn(child)
                    continue
                status = child.process.poll()
                if status is not None:
                    self._reap(child, status)
            self._check_heartbeats(self.clock())
            self._update_readiness()
            if self.config.duration_s and self.clock() - started >= self.config.duration_s:
                self.log.info("supervisor.duration_reached", duration_s=self.config.duration_s)
                break
            time.sleep(WATCH_INTERVAL_S)
        if self._signal is not None:
            self.log.info("supervisor.signal", signal=signal.Signals(self._signal).name)
        return self.exit_code

    def request_stop(self, signum: int, _frame: object) -> None:
        """Signal handler (SIGTERM, SIGINT, SIGHUP): only records the signal; :meth:`watch` logs it and returns.
        (Logging here could deadlock on a lock the interrupted main thread holds.)"""
        self._signal = signum

    def stop(self) -> None:
        """Demo, then cache processes, then telemetry (so it drains what they published last); then every
        segment and runtime file of the run, and its locks last."""
        self._stopping = True
        self.reporter.notify(STOPPING="1", STATUS="stopping: demo, cache processes, then telemetry")
        for role in STOP_ORDER:
            stop_group([c for c in self.children if c.role is role], self.log)
        self.board.close()
        removed = unlink_segments(self.config)
        kept = remove_runtime_files(self.runtime.path, remove_dir=self.runtime.created)
        if kept:
            self.log.warning("runtime_dir.kept", runtime_dir=self.runtime.path, entries=kept,
                             reason="not created by mpcache")
        if self.front is not None:
            self.front.close()
        for lock in self.locks:
            lock.release()
        self.log.info("supervisor.stopped", exit_code=self.exit_code, segments_removed=len(removed),
                      log_lines_dropped=self.forwarder.dropped_total)


def _remove_socket(path: str) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _replaced(path: str, stale: int | None) -> bool:
    """A cache process serves once its socket file exists and is not its predecessor's (``stale`` inode)."""
    inode = _inode(path)
    return inode is not None and inode != stale


def _always() -> bool:
    """Telemetry serves from its first heartbeat: it writes none before its pump loop runs."""
    return True


def _inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None
