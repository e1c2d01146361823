"""``start-cache``: flags to one Config, the checks, the runtime dir and every shared-memory object, then the
:class:`~mpcache.supervisor.watch.Supervisor` over the children until a signal, ``--duration`` or giving up.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import posix_ipc

from mpcache.cache.l2.trust import SECRET_FILE_ENV
from mpcache.config import Config
from mpcache.errors import ConfigError, SharedMemoryFullError
from mpcache.logs import configure_logging, console_renderer
from mpcache.shm.ring import PUBLISH_PATH, PUBLISH_PYTHON_NOT_BUILT
from mpcache.shm.segment import Segment, shm_name
from mpcache.supervisor import settings
from mpcache.supervisor.checks import check_endpoints, check_socket_path_length
from mpcache.supervisor.children import Programs
from mpcache.supervisor.front import Front
from mpcache.supervisor.logforward import ForwardingHandler, LineForwarder
from mpcache.supervisor.provision import check_shm_space, create_segments, unlink_segments
from mpcache.supervisor.runtime import (
    Marker,
    RuntimeDir,
    claim_default,
    claim_given,
    default_base,
    prepare_base,
    remove_runtime_files,
    segment_is_stale,
    segments_with_prefix,
    sweep,
    sweep_orphan_segments,
    sweep_segments,
)
from mpcache.supervisor.watch import Supervisor
from mpcache.systemd import error_line, journal_prefixed, stderr_is_journal


def _stderr_renderer(log_format: str) -> Callable[[str], str] | None:
    """How stderr shows log lines: console lines (coloured on a terminal), or JSON as they are (None)."""
    tty = sys.stderr.isatty()
    render = None if log_format == "json" or (log_format == "auto" and not tty) else console_renderer(colors=tty)
    # The journal: each line's level as its priority (journalctl -p warning; -o cat still shows the line)
    return journal_prefixed(render) if stderr_is_journal() else render


def _error(message: str) -> int:
    sys.stderr.write(error_line(f"start-cache: error: {message}"))
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
    sweep_segments(swept)  # dead runs whose runtime dir (and marker) is gone
    sweep_orphan_segments(swept)  # segments of no run (a benchmark's, a tool's) whose owner died
    runtime = claim_given(requested) if requested else claim_default(base, pid)
    lines = [("leftover.removed", fields) for fields in swept.removed]
    lines += [("leftover.kept", fields) for fields in swept.kept]
    return runtime, lines


def _create_segments(config: Config, log: Any) -> None:
    """Create every segment (the gauge board locked until they are unlinked).  A segment of our exact name
    (same supervisor pid and --instance-id: a container's PID 1 restarted) whose gauge board no live run
    holds is a leftover of ours, replaced; one held by a live run is a one-line ConfigError."""
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


def main(argv: list[str] | None = None, programs: Programs | None = None) -> int:
    """Run the service; ``programs`` replaces the children's programs (a benchmark's own cache process)."""
    resolved = settings.parse(argv)
    pid = os.getpid()
    requested = resolved.values["runtime-dir"]
    try:
        base = default_base()
    except ConfigError as exc:
        if not requested:
            return _error(settings.where(resolved, str(exc)))
        base = ""  # no temporary directory, so no earlier run of ours left anything in one
    planned = os.path.abspath(requested) if requested else os.path.join(base, str(pid))
    if resolved.check_only:
        return settings.check_config(resolved, pid, planned)
    os.umask(0o077)  # everything this service and its children create (logs, files of the fs tier) is private
    try:
        config = settings.config_from_settings(resolved, pid, planned)
        check_socket_path_length(config)
        check_endpoints(config)
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
                            runtime=runtime, programs=programs)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, supervisor.request_stop)
    try:
        supervisor.locks.append(Marker.create(runtime, config.instance_id, pid, config.all_segment_names()))
        fd = os.open(supervisor.config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(config.to_json())
        _create_segments(config, log)
        if not config.no_http:
            supervisor.front = _open_front(config, log, supervisor)
    except (ConfigError, SharedMemoryFullError, OSError) as exc:
        unlink_segments(config)
        remove_runtime_files(runtime.path, remove_dir=runtime.created)
        for lock in supervisor.locks:
            lock.release()
        forwarder.close()
        return _error(str(exc))
    _log_started(log, config, pid, runtime, supervisor.front)
    for fields in settings.deprecated_given(resolved):
        log.warning("supervisor.deprecated_setting", **fields)
    try:
        if supervisor.front is not None:
            supervisor.front.start()
        supervisor.start()
        supervisor.watch()
    finally:
        supervisor.stop()
        forwarder.close()  # at most a few seconds: a stuck reader of our stderr must not keep us (or it)
    return supervisor.exit_code


def _open_front(config: Config, log: Any, supervisor: Supervisor) -> Front:
    """The HTTP front on its port; a port taken since the start-up check is the same one-line error."""
    try:
        return Front(config, log, supervisor.front_state)
    except OSError as exc:
        raise ConfigError(f"--prometheus-port: port {config.prometheus_port} on {config.prometheus_host} is not "
                          f"available ({exc.strerror})") from None


def _log_started(log: Any, config: Config, pid: int, runtime: RuntimeDir, front: Front | None) -> None:
    """The start line with every URL, and a warning for each degraded mode the operator can fix."""
    base = None
    if front is not None:
        host = f"[{config.prometheus_host}]" if ":" in config.prometheus_host else config.prometheus_host
        base = f"http://{host}:{front.server.server_port}"
    log.info("supervisor.started", pid=pid, workers=config.workers, runtime_dir=runtime.path,
             metrics=None if config.disable_metrics or base is None else f"{base}/metrics",
             health=None if base is None else f"{base}/healthz",
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
