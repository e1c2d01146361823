"""``bin/start-cache``: the configuration, every shared-memory object, and the child processes (telemetry,
cache, demo), each kind its own failure domain: telemetry restarted forever, a crash-looping or hung cache
process restarted and given up alone, the demo never restarted; stopped in order, leaving nothing behind.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import posix_ipc

from mpcache.cache.l2.trust import SECRET_FILE_ENV
from mpcache.config import Config
from mpcache.errors import ConfigError, LayoutMismatchError, SharedMemoryFullError
from mpcache.logforward import ForwardingHandler, LineForwarder
from mpcache.logs import configure_logging, console_renderer
from mpcache.runtime import (
    Marker,
    RuntimeDir,
    SegmentLock,
    claim_default,
    claim_given,
    default_base,
    prepare_base,
    remove_runtime_files,
    segment_is_stale,
    segments_with_prefix,
    sweep,
)
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.provision import check_shm_space, create_segments, recover_ring, unlink_segments
from mpcache.shm.ring import PUBLISH_PATH, PUBLISH_PYTHON_NOT_BUILT
from mpcache.shm.segment import Segment, shm_name
from mpcache.supervisor import settings
from mpcache.supervisor.liveness import HANG_TIMEOUT_S, START_TIMEOUT_S
from mpcache.systemd import Notifier, journal_prefixed, stderr_is_journal

# Restart policy (module constants, so tests can shorten them).  A child that exits is restarted after
# BACKOFF_INITIAL_S, doubling per consecutive quick exit up to the role's cap; a cache process that exits
# MAX_CRASHES_IN_WINDOW times within CRASH_WINDOW_S is given up alone; telemetry is never given up.
CRASH_WINDOW_S = 30.0
MAX_CRASHES_IN_WINDOW = 5
BACKOFF_INITIAL_S = 0.5
CACHE_BACKOFF_MAX_S = 8.0
TELEMETRY_BACKOFF_MAX_S = 30.0
WATCH_INTERVAL_S = 0.1
STOP_GRACE_S = 10.0
STATUS_FILE = "status.json"
DEMO_L1_SIZE = 32 * 2**20


@dataclass
class Child:
    role: str  # "telemetry", "cache" or "demo"
    index: int
    argv: list[str]
    process: subprocess.Popen | None = None
    crashes: collections.deque = field(default_factory=collections.deque)  # exit times within CRASH_WINDOW_S
    failures: int = 0  # consecutive exits after runs shorter than CRASH_WINDOW_S: the backoff's exponent
    restart_at: float = 0.0
    started_at: float = 0.0
    # starting, serving, restarting, unresponsive (cache); finished, failed (demo); given_up (cache)
    state: str = "starting"
    # cache processes: liveness
    stale_socket: int | None = None  # inode of a socket file left by the previous process, at spawn
    listening: bool = False  # this process's socket replaced any stale one: its loop runs from here on
    beat: int = 0  # the last heartbeat word this process wrote
    beat_changed_at: float = 0.0  # monotonic time the heartbeat word last changed
    spawns: int = 0  # times started: every one after the first is a restart

    @property
    def label(self) -> str:
        return self.role if self.role != "cache" else f"cache[{self.index}]"

    @property
    def done(self) -> bool:
        """Never (re)started again: the demo ended, or a cache process was given up."""
        return self.state in ("finished", "failed", "given_up")


class Supervisor:
    def __init__(self, config: Config, config_path: str, log: Any, forwarder: LineForwarder,
                 hang_timeout_s: float = HANG_TIMEOUT_S, runtime: RuntimeDir | None = None) -> None:
        self.config = config
        self.runtime = runtime if runtime is not None else RuntimeDir(config.runtime_dir, created=False)
        self.locks: list[Marker | SegmentLock] = []  # released last, once everything they claim is gone
        self.hang_timeout_s = hang_timeout_s
        self.config_path = config_path
        self.log = log
        self.forwarder = forwarder
        self.children: list[Child] = []
        self.exit_code = 0
        self._signal: int | None = None  # set by the signal handler, which does nothing else
        self._stopping = False
        self._ready_logged = False
        self._gauge_board: Segment | None = None
        self._slots: dict[int, GaugeSlot] = {}
        self._status_path = os.path.join(config.runtime_dir, STATUS_FILE)
        self.notifier = Notifier.from_environment()  # systemd's Type=notify; a no-op elsewhere
        self._notified_status = ""

    # -- children --------------------------------------------------------------

    def _argv(self, module: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", module, "--config", self.config_path, *extra]

    def _spawn(self, child: Child) -> None:
        # Its own session: a terminal's SIGINT/SIGHUP reach the supervisor alone, which stops the
        # children in order (demo, cache, telemetry) instead of all at once.
        child.process = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         stdin=subprocess.DEVNULL, env=_child_env(), start_new_session=True)
        child.started_at = time.monotonic()
        child.listening, child.beat, child.beat_changed_at = False, 0, child.started_at
        child.spawns += 1
        if child.spawns > 1:
            self._count_restart(child)
        if child.role == "cache":
            child.stale_socket = _inode(self.config.socket_path(child.index))
            child.state = "starting"
            self._set_cache_state(child.index, "starting")
        else:
            child.state = "running"
        # Both pipes are always drained (the forwarder never blocks), so a child never waits on its logging.
        for stream, log_lines in ((child.process.stderr, True), (child.process.stdout, False)):
            threading.Thread(target=self.forwarder.forward, args=(child.role, child.index, stream),
                             kwargs={"log_lines": log_lines}, daemon=True).start()
        self.log.info("child.started", child_role=child.role, index=child.index, pid=child.process.pid)
        self._write_status()

    def start(self) -> None:
        telemetry = Child("telemetry", 0, self._argv("mpcache.telemetry"))
        self.children.append(telemetry)
        self._spawn(telemetry)
        module = "mpcache.cache"
        for worker in range(self.config.workers):
            cache = Child("cache", worker, self._argv(module, "--worker", str(worker)))
            self.children.append(cache)
            self._spawn(cache)

    def _caches(self) -> list[Child]:
        return [child for child in self.children if child.role == "cache"]

    def _update_readiness(self) -> None:
        """A cache process serves once its loop heartbeats and its socket exists; the demo starts when all do."""
        changed = False
        for child in self._caches():
            if child.state == "starting" and child.process is not None and child.listening:
                child.state = "serving"
                self._set_cache_state(child.index, "serving")
                if self._ready_logged:
                    self.log.info("cache.serving", worker=child.index, pid=child.process.pid)
                changed = True
        caches = self._caches()
        if not self._ready_logged and caches and all(child.state == "serving" for child in caches):
            self._ready_logged = True
            self.log.info("cache.ready", workers=self.config.workers,
                          sockets=[self.config.socket_path(w) for w in range(self.config.workers)])
            self._notify(READY="1", STATUS=self._status_line())
            if self.config.demo:
                demo = Child("demo", 0, self._argv("mpcache.demo"))
                self.children.append(demo)
                self._spawn(demo)
        if changed:
            self._write_status()

    def _check_heartbeats(self, now: float) -> None:
        """Kill a cache process whose heartbeat word stopped advancing (SIGSTOP, a deadlock, a stuck
        request): it is restarted like one that died.  Its gauges are cleared at once, so that the dead
        slot is neither live nor read as an empty cache."""
        for child in self._caches():
            process = child.process
            slot = self._slot(child.index)
            if process is None or slot is None or child.state not in ("starting", "serving"):
                continue
            pid_word, beat = slot.get(layout.G_PID), slot.get(layout.G_HEARTBEAT)
            if pid_word == process.pid and beat != child.beat:
                child.beat, child.beat_changed_at = beat, now
            if not child.listening:
                # Its socket appears (replacing a predecessor's) just before its loop starts: from then
                # on its heartbeat is due every 0.5 s.  Until then it may rebuild an fs tier's index.
                inode = _inode(self.config.socket_path(child.index))
                if pid_word == process.pid and inode is not None and inode != child.stale_socket:
                    child.listening, child.beat_changed_at = True, now
                    continue
                silent, limit, what = now - child.started_at, START_TIMEOUT_S, "it never started serving"
            else:
                silent, limit = now - child.beat_changed_at, self.hang_timeout_s
                what = "its heartbeat stopped advancing"
            if silent <= limit:
                continue
            self.log.error("cache.unresponsive", worker=child.index, pid=process.pid, silent_s=round(silent, 1),
                           message=f"{child.label} (pid {process.pid}): {what} for {silent:.1f} s "
                           f"(limit {limit:g} s); killing it (SIGKILL) and restarting it")
            child.state = "unresponsive"
            self._clear_gauge_slot(child.index, "unresponsive")
            process.kill()
            self._write_status()

    def _reap(self, child: Child, status: int) -> None:
        assert child.process is not None
        now = time.monotonic()
        assert child.process is not None
        self.log.info("child.exited", child_role=child.role, index=child.index, pid=child.process.pid,
                      exit_status=status)
        child.process = None
        if child.role == "demo":
            # A client: never restarted (its tally covers one run); its failure never stops the cache.
            child.state = "finished" if status == 0 else "failed"
            if status != 0:
                self.log.error("demo.failed", exit_status=status,
                               message="the demo failed and is not restarted; the cache keeps serving, and the "
                                       "supervisor's exit status will be 1")
                self.exit_code = 1
            self._write_status()
            return
        if child.role == "cache":
            if recover_ring(self.config, child.index):
                self.log.warning("ring.torn_record", worker=child.index,
                                 detail="a record begun by the dead process was counted as dropped")
            self._clear_gauge_slot(child.index, "restarting")
            _remove_socket(self.config.socket_path(child.index))  # clients get "no such file", not a dead socket
        child.failures = child.failures + 1 if now - child.started_at < CRASH_WINDOW_S else 1
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > CRASH_WINDOW_S:
            child.crashes.popleft()
        if child.role == "cache" and len(child.crashes) >= MAX_CRASHES_IN_WINDOW:
            self._give_up(child, status)
            return
        cap = TELEMETRY_BACKOFF_MAX_S if child.role == "telemetry" else CACHE_BACKOFF_MAX_S
        backoff = min(cap, BACKOFF_INITIAL_S * 2 ** (child.failures - 1))
        child.restart_at = now + backoff
        child.state = "restarting"
        if child.role == "telemetry":
            self.log.error("telemetry.down", exit_status=status, failures=child.failures, restart_in_s=backoff,
                           message=f"the telemetry process exited (status {status}); restarting it in {backoff:g} s. "
                                   "The cache processes keep serving; metrics are not served or pushed meanwhile")
        self.log.warning("child.restart_scheduled", child_role=child.role, index=child.index, in_s=backoff)
        self._write_status()

    def _give_up(self, child: Child, status: int) -> None:
        """A crash-looping cache process is given up alone; the supervisor stops once none is left."""
        child.state = "given_up"
        self._set_cache_state(child.index, "given_up")
        serving = [c.index for c in self._caches() if c.state != "given_up"]
        self.log.error(
            "cache.given_up", worker=child.index, exit_status=status, still_serving=serving,
            message=f"giving up on {child.label}: it exited {len(child.crashes)} times in {CRASH_WINDOW_S:.0f} s "
                    f"(last exit status {status}); its socket stays unserved"
                    + (f", cache processes {serving} keep serving" if serving else ""),
        )
        self._write_status()
        if not serving:
            self.log.error("supervisor.giving_up",
                           message=f"giving up: every cache process ({len(self._caches())}) crash-looped")
            self.exit_code = 1
            self._stopping = True

    # -- shared state: the gauge board's state words and the status file ------------------------

    def _board(self) -> Segment | None:
        if self._gauge_board is None:
            try:
                self._gauge_board = Segment.attach(self.config.gauge_board_name())
            except LayoutMismatchError:
                return None
        return self._gauge_board

    def _slot(self, worker: int) -> GaugeSlot | None:
        slot = self._slots.get(worker)
        if slot is None:
            board = self._board()
            if board is None:
                return None
            slot = self._slots[worker] = GaugeSlot(board, worker)
        return slot

    def _count_restart(self, child: Child) -> None:
        """Restarts live in the gauge board, so telemetry exports them (mpcache_child_restarts_total) even
        across its own restarts."""
        if child.role == "cache":
            slot = self._slot(child.index)
            if slot is not None:
                slot.set(layout.G_RESTARTS, child.spawns - 1)
        elif child.role == "telemetry":
            board = self._board()
            if board is not None:
                board.buf[:layout.GAUGE_HEADER_SIZE].cast("q")[layout.GAUGE_OFF_TELEMETRY_RESTARTS // 8] = \
                    child.spawns - 1

    def _set_cache_state(self, worker: int, state: str) -> None:
        slot = self._slot(worker)
        if slot is not None:
            slot.set(layout.G_STATE, layout.CACHE_STATES.index(state))

    def _clear_gauge_slot(self, worker: int, state: str) -> None:
        """Zero a dead (or killed) cache process's words, heartbeat included: its usage no longer counts."""
        slot = self._slot(worker)
        if slot is not None:
            slot.clear()
            slot.set(layout.G_STATE, layout.CACHE_STATES.index(state))

    def status(self) -> dict[str, Any]:
        """What the status file says: every child's state, and ``ready`` while any cache process serves."""
        caches = [{"worker": c.index, "state": c.state, "pid": c.process.pid if c.process else None,
                   "socket": self.config.socket_path(c.index)} for c in self._caches()]
        others = {c.role: c.state for c in self.children if c.role != "cache"}
        return {"instance_id": self.config.instance_id, "supervisor_pid": os.getpid(),
                "ready": not self._stopping and any(c["state"] == "serving" for c in caches),
                "cache": caches, **others}

    def _write_status(self) -> None:
        try:
            _write_file_atomically(self._status_path, json.dumps(self.status()) + "\n")
        except OSError as exc:  # the runtime dir is gone (stopping) or unwritable: the log still says it all
            self.log.debug("status.not_written", error=str(exc))
        line = self._status_line()
        if line != self._notified_status and self._ready_logged and not self._stopping:
            self._notify(STATUS=line)

    def _status_line(self) -> str:
        """systemctl status's one line: how many cache processes serve, and the others' states."""
        caches = self._caches()
        serving = sum(child.state == "serving" for child in caches)
        others = [f"{child.label} {child.state}" for child in caches if child.state != "serving"]
        others += [f"{c.role} {c.state}" for c in self.children if c.role != "cache" and c.state != "running"]
        return f"{serving}/{len(caches)} cache processes serving" + (f"; {', '.join(others)}" if others else "")

    def _notify(self, **fields: str) -> None:
        """Tell systemd (``$NOTIFY_SOCKET``); a failure is logged once until a send succeeds again."""
        if not self.notifier.enabled:
            return
        was_failing = self.notifier.failed is not None
        if self.notifier.notify(**fields):
            self._notified_status = fields.get("STATUS", self._notified_status)
        elif not was_failing:
            self.log.warning("systemd.notify_failed", error=self.notifier.failed, fields=sorted(fields))

    # -- the loop ------------------------------------------------------------------------------

    def watch(self) -> int:
        started = time.monotonic()
        while self._signal is None and not self._stopping:
            now = time.monotonic()
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
            self._check_heartbeats(time.monotonic())
            self._update_readiness()
            if self.config.duration_s and time.monotonic() - started >= self.config.duration_s:
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
        """Demo, then cache processes, then telemetry (so it drains what they published last)."""
        self._stopping = True
        self._notify(STOPPING="1", STATUS="stopping: demo, cache processes, then telemetry")
        for role in ("demo", "cache", "telemetry"):
            group = [c for c in self.children if c.role == role and c.process is not None and c.process.poll() is None]
            for child in group:
                assert child.process is not None
                child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                assert child.process is not None
                try:
                    status = child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log.warning("child.killed", child_role=child.role, index=child.index, pid=child.process.pid,
                                     waited_s=STOP_GRACE_S)
                    child.process.kill()
                    status = child.process.wait()
                self.log.info("child.exited", child_role=child.role, index=child.index, pid=child.process.pid,
                              exit_status=status)
        self._slots.clear()  # views into the board go before its mapping
        if self._gauge_board is not None:
            self._gauge_board.close()
            self._gauge_board = None
        removed = unlink_segments(self.config)
        kept = remove_runtime_files(self.runtime.path, remove_dir=self.runtime.created)
        if kept:
            self.log.warning("runtime_dir.kept", runtime_dir=self.runtime.path, entries=kept,
                             reason="not created by mpcache")
        for lock in self.locks:
            lock.release()
        self.log.info("supervisor.stopped", exit_code=self.exit_code, segments_removed=len(removed),
                      log_lines_dropped=self.forwarder.dropped_total)


def _child_env() -> dict[str, str]:
    """Children import mpcache from wherever we did, installed or not."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)  # the supervisor alone speaks for the service (NotifyAccess=main)
    return env


def _check_endpoints(config: Config) -> None:
    """Addresses the telemetry process would otherwise fail on at start (restart loop) or at export time."""
    if not config.no_http:  # the listener serves /healthz and /ready even with metrics off
        try:
            socket.getaddrinfo(config.prometheus_host, config.prometheus_port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(f"--prometheus-host: cannot resolve {config.prometheus_host!r} "
                              f"({exc.strerror})") from None
        if config.prometheus_port:  # taken, telemetry could only fail (and restart) in vain
            _check_port_free("--prometheus-port", config.prometheus_host, config.prometheus_port)
    for worker in range(config.workers if config.lmcache_port else 0):
        _check_port_free("--lmcache-port", config.lmcache_host, config.lmcache_port + worker)
    if config.otlp_endpoint:
        endpoint = config.otlp_endpoint if "://" in config.otlp_endpoint else f"http://{config.otlp_endpoint}"
        parts = urllib.parse.urlsplit(endpoint)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or (config.otlp_protocol == "grpc" and not port):
            raise ConfigError(f"--otlp-endpoint: expected host:port or http(s)://host:port[/path], "
                              f"got {config.otlp_endpoint!r}")


def _stderr_renderer(log_format: str) -> Callable[[str], str] | None:
    """How stderr shows log lines: console lines (coloured on a terminal), or JSON as they are (None)."""
    tty = sys.stderr.isatty()
    render = None if log_format == "json" or (log_format == "auto" and not tty) else console_renderer(colors=tty)
    # The journal: each line's level as its priority (journalctl -p warning; -o cat still shows the line)
    return journal_prefixed(render) if stderr_is_journal() else render


def _check_port_free(flag: str, host: str, port: int) -> None:
    """A port a child will listen on must be free now: otherwise it would fail and be restarted in vain.

    The probe sets SO_REUSEADDR like the listeners do, so connections of an earlier run still in
    TIME_WAIT do not count as taken; a socket listening there does."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"{flag}: cannot resolve {host!r} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"{flag}: port {port} on {host} is not available ({exc.strerror})") from None


def _check_socket_path_length(config: Config) -> None:
    """Refuse a runtime dir too long for the cache processes' socket paths up front (each would fail to
    start and be restarted until the supervisor gives up): the longest is the staging name
    ``.cache<worker>.<pid>`` (pid <= 2**22), and sun_path holds 107 bytes."""
    longest = os.path.join(config.runtime_dir, f".cache{config.workers - 1}.{2**22}")
    if len(os.fsencode(longest)) > 107:
        raise ConfigError(f"--runtime-dir: too long for Unix socket paths under it ({len(os.fsencode(longest))} "
                          "bytes, at most 107)")


def _remove_socket(path: str) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _write_file_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` (0600): written to a fresh temporary name (never through a link), then renamed."""
    staging = f"{path}.{os.getpid()}.tmp"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise


def _error(message: str) -> int:
    sys.stderr.write(f"start-cache: error: {message}\n")
    return 2


def _claim_runtime_dir(requested: str, base: str, pid: int) -> tuple[RuntimeDir, list[tuple[str, dict]]]:
    """Check the default base, sweep stale runs of ours, claim this run's directory; ConfigError if unsafe.
    Returns the directory and the lines to log once logging is set up."""
    if not requested:
        prepare_base(base)
    elif not os.path.isdir(os.path.dirname(os.path.abspath(requested))):
        raise ConfigError(f"--runtime-dir: {os.path.dirname(os.path.abspath(requested))} does not exist")
    safe_base = os.path.isdir(base) and not os.path.islink(base)
    swept = sweep(base if safe_base else "", also=requested or None)
    runtime = claim_given(requested) if requested else claim_default(base, pid)
    lines = [("leftover.removed", fields) for fields in swept.removed]
    lines += [("leftover.kept", fields) for fields in swept.kept]
    return runtime, lines


def _create_segments(config: Config, log: Any) -> SegmentLock:
    """Create every segment and lock the gauge board.  A segment of our exact name (same supervisor pid and
    --instance-id: a container's PID 1 restarted) whose gauge board no live run holds is a leftover of
    ours, replaced; one held by a live run is a one-line ConfigError."""
    try:
        create_segments(config)
    except posix_ipc.ExistentialError:
        gauges = config.gauge_board_name()
        if not segment_is_stale(gauges):
            raise ConfigError(f"--instance-id: shared memory {gauges} exists and a live run holds it "
                              "(the same --instance-id and supervisor pid in another PID namespace?)") from None
        for name in segments_with_prefix(shm_name(config.supervisor_pid, config.instance_id, "")):
            if Segment.unlink(name):
                log.warning("leftover.removed", segment=name, reason="has this run's name and no live run holds it")
        create_segments(config)
    return SegmentLock(config.gauge_board_name())


def main(argv: list[str] | None = None) -> int:
    resolved = settings.parse(argv)
    pid = os.getpid()
    base = default_base()
    requested = resolved.values["runtime-dir"]
    planned = os.path.abspath(requested) if requested else os.path.join(base, str(pid))
    if resolved.check_only:
        return settings.check_config(resolved, pid, planned)
    os.umask(0o077)  # everything this service and its children create (logs, files of the fs tier) is private
    try:
        config = settings.config_from_settings(resolved, pid, planned)
        _check_socket_path_length(config)
        _check_endpoints(config)
        check_shm_space(config)  # before anything is created: one line, never a SIGBUS later
        forwarder = LineForwarder(config.log_file, config.log_max_bytes, config.log_backups,
                                  render=_stderr_renderer(config.log_format))
    except ConfigError as exc:
        return _error(settings.where(resolved, str(exc)))
    except OSError as exc:  # the --log-file cannot be opened
        return _error(f"--log-file: cannot open {resolved.values['log-file']!r}: {exc.strerror}")
    try:
        runtime, swept = _claim_runtime_dir(requested, base, pid)
    except ConfigError as exc:
        return _error(str(exc))
    if runtime.path != config.runtime_dir:  # <base>/<pid> was taken: another name
        config = dataclasses.replace(config, runtime_dir=runtime.path)
    forwarder.context["instance_id"] = config.instance_id
    log = configure_logging("supervisor", config.instance_id, config.log_level,
                            handlers=[ForwardingHandler(forwarder)])
    for event, fields in swept:
        log.warning(event, **fields)
    supervisor = Supervisor(config, os.path.join(runtime.path, "config.json"), log, forwarder,
                            hang_timeout_s=config.hang_timeout_s, runtime=runtime)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, supervisor.request_stop)
    try:
        supervisor.locks.append(Marker.create(runtime, config.instance_id, pid, config.all_segment_names()))
        fd = os.open(supervisor.config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(config.to_json())
        supervisor.locks.insert(0, _create_segments(config, log))
    except (ConfigError, SharedMemoryFullError, OSError) as exc:
        remove_runtime_files(runtime.path, remove_dir=runtime.created)
        for lock in supervisor.locks:
            lock.release()
        forwarder.close()
        return _error(str(exc))
    log.info("supervisor.started", pid=pid, workers=config.workers, runtime_dir=runtime.path,
             metrics=None if config.disable_metrics or config.no_http
             else f"http://{config.prometheus_host}:{config.prometheus_port}/metrics",
             health=None if config.no_http else f"http://{config.prometheus_host}:{config.prometheus_port}/healthz",
             otlp_endpoint=config.otlp_endpoint or None, publish_path=PUBLISH_PATH,
             lmcache_urls=[url for worker in range(config.workers) for url in config.lmcache_urls(worker)] or None)
    if config.l2_secret_source == "per-run":
        log.warning("supervisor.l2_secret_per_run",
                    message="no --l2-secret-file and no fs tier: the redis tier's records are keyed with a secret "
                            "made for this run, so they will not be readable after a restart; "
                            f"--l2-secret-file FILE (or ${SECRET_FILE_ENV}) fixes that")
    if PUBLISH_PATH == PUBLISH_PYTHON_NOT_BUILT:
        log.warning("supervisor.slow_publish_path", publish_path=PUBLISH_PATH,
                    hint="no C compiler or Python headers when mpcache was installed: cache processes publish "
                         "through the pure-Python writer, about 7x the cost per event; install gcc and "
                         "python3-dev, then reinstall mpcache")
    try:
        supervisor.start()
        supervisor.watch()
    finally:
        supervisor.stop()
        forwarder.close()  # at most a few seconds: a stuck reader of our stderr must not keep us (or it)
    return supervisor.exit_code


if __name__ == "__main__":
    sys.exit(main())
