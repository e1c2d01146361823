"""``bin/start-cache``: configuration, shared-memory ownership, and the child processes.

The supervisor builds the one :class:`~mpcache.config.Config`, creates every
shared-memory segment (mode 0600), removes leftovers of crashed earlier runs,
starts the telemetry process first and then the cache processes (and the demo
load generator with ``--demo``), restarts a child that dies with exponential
backoff, gives up with one clear message after repeated fast crashes, and on
SIGINT/SIGTERM (or after ``--duration``) stops the cache processes, lets
telemetry drain and export a final time, and unlinks everything.

Children's stderr is forwarded line by line through the supervisor, so the log
file has exactly one writer and rotates safely.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import logging.handlers
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

import psutil

from mpcache.cache.l2.spec import GB as L2_GB
from mpcache.cache.l2.spec import parse_l2_spec
from mpcache.config import Config, parse_size
from mpcache.errors import ConfigError
from mpcache.logs import configure_logging
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.provision import create_segments, recover_ring, unlink_segments
from mpcache.shm.ring import PUBLISH_PATH, PUBLISH_PYTHON_NOT_BUILT
from mpcache.shm.segment import Segment, leftover_segments

CRASH_WINDOW_S = 30.0
MAX_CRASHES_IN_WINDOW = 5
STOP_GRACE_S = 10.0
DEMO_L1_SIZE = 32 * 2**20


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments"):
            message += f" (run {self.prog} --help for the accepted flags)"
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text, "size")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected a size such as 50MiB, 1GB or 1048576, got {text!r}") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="start-cache",
        description="Run mpcache: cache processes serving KV chunks, plus a telemetry process "
        "exporting their metrics (Prometheus /metrics and/or OTLP).",
    )
    service = parser.add_argument_group("service")
    service.add_argument("--workers", type=_int_at_least(1), default=2, help="cache processes to run (default 2)")
    service.add_argument("--instance-id", default="", help="service.instance.id on every metric (default: a new UUID4)")
    service.add_argument("--l1-size", default="", help="L1 pool per cache process, e.g. 512MiB (default 256MiB; 32MiB with --demo, 8MiB with --demo and --l2)")
    service.add_argument("--chunk-bytes", default="64KiB", help="bytes per KV chunk slot (default 64KiB)")
    service.add_argument("--chunk-size", type=_int_at_least(1), default=256, help="tokens per chunk (default 256)")
    service.add_argument("--l1-watermark", type=_number, default=0.8, help="L1 usage in (0, 1] above which the eviction loop evicts (default 0.8)")
    service.add_argument("--eviction-interval", type=_number, default=1.0, help="seconds between eviction-loop runs (default 1)")
    service.add_argument("--prefetch-job-ttl", type=_number, default=None, help="seconds an unretrieved prefetch keeps its chunks locked (default 60; 3 with --demo)")
    service.add_argument("--ring-cells", type=_int_at_least(1024), default=1 << 18, help="event ring size per cache process, in 64-byte cells, a power of two (default 262144)")
    service.add_argument("--runtime-dir", default="", help="where sockets and the child config live (default /tmp/mpcache-<uid>/<pid>)")
    service.add_argument(
        "--l2", action="append", default=[], metavar="JSON",
        help="an L2 adapter, as a JSON object; repeat for several (adapter_index is the order given). "
        'fs: {"type": "fs", "path": DIR, "capacity_gb": N, "threads"?: N} (each cache process uses DIR/worker-<i>); '
        'mock: {"type": "mock", "capacity_gb": N, "latency_ms"?, "bandwidth_gbps"?, "failure_rate"? in [0,1], "seed"?}; '
        'redis: {"type": "redis", "url": "redis://host:port/db", "capacity_gb": N, "key_prefix"?, "threads"?} '
        "(shared by every cache process). GB = 10**9 bytes. Default: no L2")
    service.add_argument("--duration", type=_number, default=0.0, help="stop by itself after this many seconds and exit 0 (default: run until SIGINT/SIGTERM)")
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument("--prometheus-host", default="127.0.0.1", help="address /metrics binds to (default 127.0.0.1)")
    telemetry.add_argument("--prometheus-port", type=_port, default=9090, help="port of /metrics (default 9090)")
    telemetry.add_argument("--otlp-endpoint", default="", help="OTLP collector, e.g. http://127.0.0.1:4317 (push every --otlp-interval s)")
    telemetry.add_argument("--otlp-protocol", choices=("grpc", "http"), default="grpc", help="OTLP transport (default grpc)")
    telemetry.add_argument("--otlp-interval", type=_number, default=10.0, help="seconds between OTLP exports (default 10)")
    telemetry.add_argument("--metrics-sample-rate", type=_number, default=None, help="fraction of chunks, in (0, 1], tracked by lifecycle histograms (default 0.01; 0.1 with --demo)")
    telemetry.add_argument("--cache-salt-cap", type=_int_at_least(1), default=1000, help="distinct cache_salt values per metric before __overflow__ (default 1000)")
    telemetry.add_argument("--telemetry-nice", type=int, default=0,
                           help="nice increment (0..19) the telemetry process applies to itself, so that on a busy "
                           "machine the cache processes get the CPU first and the drain lags instead (default 0)")
    telemetry.add_argument("--disable-metrics", action="store_true", help="run no metrics subscribers and no exporters")
    telemetry.add_argument("--disable-logging", action="store_true", help="run no logging subscribers")
    telemetry.add_argument("--enable-tracing", action="store_true", help="export request spans over OTLP (needs --otlp-endpoint)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="default info")
    logs.add_argument("--log-file", default="", help="also write the JSON log lines here (size-rotated)")
    logs.add_argument("--log-max-bytes", type=_size, default=50 * 2**20, help="rotate --log-file at this size, e.g. 100MiB; 0 never rotates (default 50MiB)")
    logs.add_argument("--log-backups", type=_int_at_least(0), default=5, help="rotated --log-file copies kept: FILE.1 .. FILE.N (default 5)")
    lmcache = parser.add_argument_group("LMCache clients (vLLM's LMCacheMPConnector, engine_driven transfer)")
    lmcache.add_argument("--lmcache-port", type=_port, default=0,
                         help="serve LMCache's MP protocol over ZeroMQ: cache process i listens on tcp://HOST:PORT+i "
                         "(default: off)")
    lmcache.add_argument("--lmcache-host", default="127.0.0.1", help="address for --lmcache-port (default 127.0.0.1)")
    lmcache.add_argument("--lmcache-ipc", action="store_true",
                         help="also serve it on ipc://RUNTIME_DIR/lmcache<i>.ipc (mode 0600: same-user clients only)")
    bench = parser.add_argument_group("benchmarking")
    bench.add_argument("--event-sink", choices=("ring", "none", "inprocess"), default="ring",
                       help="where cache processes send events: ring (default, the telemetry process reads them); "
                       "none (telemetry off) and inprocess (the reference design, an in-process bus) exist to "
                       "measure against")
    demo = parser.add_argument_group("demo")
    demo.add_argument("--demo", action="store_true", help="also run the built-in load generator")
    demo.add_argument("--demo-seconds", type=_number, default=0.0, help="stop the load after this many seconds; the service keeps serving (default: until shutdown)")
    demo.add_argument("--demo-tally", default="", help="write the demo's own counts (per cache_salt) here as JSON when it finishes")
    return parser


def _default(given: float | None, *, demo: float, normal: float, is_demo: bool) -> float:
    """A flag's value, else its default — the demo uses a few defaults that show more, sooner."""
    if given is not None:
        return given
    return demo if is_demo else normal


def _l2_specs(texts: list[str], chunk_bytes: int) -> list[dict]:
    """Every ``--l2`` value, checked (ConfigError naming --l2 on the first bad one)."""
    specs = []
    for text in texts:
        spec = parse_l2_spec(text)
        if int(spec["capacity_gb"] * L2_GB) < chunk_bytes:
            raise ConfigError(f"--l2: {spec['type']} capacity_gb {spec['capacity_gb']!r} is smaller than one chunk "
                              f"(--chunk-bytes, {chunk_bytes} bytes)")
        specs.append(spec)
    return specs


def config_from_args(args: argparse.Namespace, supervisor_pid: int, runtime_dir: str) -> Config:
    # the demo's L1 is small so that it evicts; smaller still with L2, so that prefetches come from L2
    l1_size = args.l1_size or (("8MiB" if args.l2 else "32MiB") if args.demo else "256MiB")
    chunk_bytes = parse_size(args.chunk_bytes, "--chunk-bytes")
    l2 = _l2_specs(args.l2, chunk_bytes)
    return Config(
        instance_id=args.instance_id or str(uuid.uuid4()),
        supervisor_pid=supervisor_pid,
        runtime_dir=runtime_dir,
        workers=args.workers,
        l1_size_bytes=parse_size(l1_size, "--l1-size"),
        chunk_bytes=parse_size(args.chunk_bytes, "--chunk-bytes"),
        chunk_size_tokens=args.chunk_size,
        l1_watermark=args.l1_watermark,
        eviction_interval_s=args.eviction_interval,
        prefetch_job_ttl_s=_default(args.prefetch_job_ttl, demo=3.0, normal=60.0, is_demo=args.demo),
        ring_capacity_cells=args.ring_cells,
        disable_metrics=args.disable_metrics,
        disable_logging=args.disable_logging,
        enable_tracing=args.enable_tracing,
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
        otlp_endpoint=args.otlp_endpoint,
        otlp_protocol=args.otlp_protocol,
        otlp_interval_s=args.otlp_interval,
        metrics_sample_rate=_default(args.metrics_sample_rate, demo=0.1, normal=0.01, is_demo=args.demo),
        cache_salt_cap=args.cache_salt_cap,
        telemetry_nice=args.telemetry_nice,
        log_level=args.log_level,
        log_file=args.log_file,
        demo=args.demo,
        demo_seconds=args.demo_seconds,
        duration_s=args.duration,
        demo_tally_file=args.demo_tally,
        event_sink=args.event_sink,
        lmcache_port=args.lmcache_port,
        lmcache_host=args.lmcache_host,
        lmcache_ipc=args.lmcache_ipc,
        l2=l2,
    )


@dataclass
class Child:
    role: str  # "telemetry", "cache" or "demo"
    index: int
    argv: list[str]
    process: subprocess.Popen | None = None
    crashes: collections.deque = field(default_factory=collections.deque)
    restart_at: float = 0.0
    finished: bool = False  # exited on purpose (the demo's load ended); not restarted

    @property
    def label(self) -> str:
        return self.role if self.role != "cache" else f"cache[{self.index}]"


class LineForwarder:
    """Copies children's stderr lines to our stderr and the log file (one writer, so rotation is safe)."""

    def __init__(self, log_file: str, max_bytes: int = 50 * 2**20, backup_count: int = 5) -> None:
        self._lock = threading.Lock()
        self._file_handler = None
        if log_file:
            self._file_handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=backup_count)

    def forward(self, child: Child, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not line.startswith("{"):
                line = json.dumps({"event": "child.output", "role": child.role, "index": child.index, "line": line})
            self.write(line)
        stream.close()

    def write(self, line: str) -> None:
        with self._lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            if self._file_handler is not None:
                self._file_handler.emit(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))


class Supervisor:
    def __init__(self, config: Config, config_path: str, log, forwarder: LineForwarder) -> None:
        self.config = config
        self.config_path = config_path
        self.log = log
        self.forwarder = forwarder
        self.children: list[Child] = []
        self._stop_requested = threading.Event()
        self.exit_code = 0
        self._gauge_board: Segment | None = None

    # -- children --------------------------------------------------------------

    def _argv(self, module: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", module, "--config", self.config_path, *extra]

    def _spawn(self, child: Child) -> None:
        child.process = subprocess.Popen(child.argv, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_child_env())
        threading.Thread(target=self.forwarder.forward, args=(child, child.process.stderr), daemon=True).start()
        self.log.info("child.started", child_role=child.role, index=child.index, pid=child.process.pid)

    def start(self) -> None:
        if self.config.event_sink == "ring":  # otherwise nothing reads the rings
            telemetry = Child("telemetry", 0, self._argv("mpcache.telemetry"))
            self.children.append(telemetry)
            self._spawn(telemetry)
        # --event-sink inprocess (benchmarks): cache processes publishing through the reference design's bus
        module = "mpcache.bench.reference_cache" if self.config.event_sink == "inprocess" else "mpcache.cache"
        for worker in range(self.config.workers):
            cache = Child("cache", worker, self._argv(module, "--worker", str(worker)))
            self.children.append(cache)
            self._spawn(cache)
        self._wait_for_sockets()
        if self.config.demo:
            demo = Child("demo", 0, self._argv("mpcache.demo"))
            self.children.append(demo)
            self._spawn(demo)

    def _wait_for_sockets(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in range(self.config.workers):
            path = self.config.socket_path(worker)
            while not os.path.exists(path):
                if time.monotonic() > deadline or self._stop_requested.is_set():
                    self.log.error("cache.not_ready", worker=worker, socket=path, waited_s=timeout_s)
                    return
                time.sleep(0.05)
        self.log.info("cache.ready", workers=self.config.workers, sockets=[self.config.socket_path(w) for w in range(self.config.workers)])

    def _reap(self, child: Child, status: int) -> None:
        now = time.monotonic()
        self.log.info("child.exited", child_role=child.role, index=child.index, pid=child.process.pid, exit_status=status)
        if child.role == "demo":
            child.finished = True
            if status != 0:
                self.log.error("demo.failed", exit_status=status)
                self.exit_code = 1
                self._stop_requested.set()
            return
        if child.role == "cache":
            if recover_ring(self.config, child.index):
                self.log.warning("ring.torn_record", worker=child.index, detail="a record begun by the dead process was counted as dropped")
            self._clear_gauge_slot(child.index)
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > CRASH_WINDOW_S:
            child.crashes.popleft()
        if len(child.crashes) >= MAX_CRASHES_IN_WINDOW:
            self.log.error(
                "supervisor.giving_up",
                message=f"giving up: {child.label} exited {len(child.crashes)} times in {CRASH_WINDOW_S:.0f} s "
                f"(last exit status {status})",
            )
            self.exit_code = 1
            self._stop_requested.set()
            return
        backoff = min(8.0, 0.5 * 2 ** (len(child.crashes) - 1))
        child.restart_at = now + backoff
        self.log.warning("child.restart_scheduled", child_role=child.role, index=child.index, in_s=backoff)

    def _clear_gauge_slot(self, worker: int) -> None:
        if self._gauge_board is None:
            self._gauge_board = Segment.attach(self.config.gauge_board_name())
        GaugeSlot(self._gauge_board, worker).clear()

    def watch(self) -> int:
        started = time.monotonic()
        while not self._stop_requested.is_set():
            for child in self.children:
                if child.finished:
                    continue
                if child.process is None:
                    if time.monotonic() >= child.restart_at:
                        self._spawn(child)
                    continue
                status = child.process.poll()
                if status is not None:
                    self._reap(child, status)
                    if not child.finished:
                        child.process = None
            if self.config.duration_s and time.monotonic() - started >= self.config.duration_s:
                self.log.info("supervisor.duration_reached", duration_s=self.config.duration_s)
                break
            self._stop_requested.wait(0.1)
        return self.exit_code

    def request_stop(self, signum: int, _frame: object) -> None:
        self.log.info("supervisor.signal", signal=signal.Signals(signum).name)
        self._stop_requested.set()

    def stop(self) -> None:
        """Demo, then cache processes, then telemetry (so it drains what they published last)."""
        for role in ("demo", "cache", "telemetry"):
            group = [c for c in self.children if c.role == role and c.process is not None and c.process.poll() is None]
            for child in group:
                child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                try:
                    status = child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log.warning("child.killed", child_role=child.role, index=child.index, pid=child.process.pid, waited_s=STOP_GRACE_S)
                    child.process.kill()
                    status = child.process.wait()
                self.log.info("child.exited", child_role=child.role, index=child.index, pid=child.process.pid, exit_status=status)
        if self._gauge_board is not None:
            self._gauge_board.close()
        removed = unlink_segments(self.config)
        shutil.rmtree(self.config.runtime_dir, ignore_errors=True)
        self.log.info("supervisor.stopped", exit_code=self.exit_code, segments_removed=len(removed))


def _child_env() -> dict[str, str]:
    """Children import mpcache from wherever we did, installed or not."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _remove_leftovers(runtime_base: str, log) -> None:
    for name in leftover_segments(psutil.pid_exists):
        Segment.unlink(name)
        log.warning("leftover.removed", segment=name)
    if os.path.isdir(runtime_base):
        for entry in os.listdir(runtime_base):
            if entry.isdigit() and not psutil.pid_exists(int(entry)):
                shutil.rmtree(os.path.join(runtime_base, entry), ignore_errors=True)
                log.warning("leftover.removed", runtime_dir=os.path.join(runtime_base, entry))


def _check_endpoints(config: Config) -> None:
    """Addresses the telemetry process would otherwise fail on at start (restart loop) or at export time."""
    if not config.disable_metrics:
        try:
            socket.getaddrinfo(config.prometheus_host, config.prometheus_port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(f"--prometheus-host: cannot resolve {config.prometheus_host!r} ({exc.strerror})") from None
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


def _check_port_free(flag: str, host: str, port: int) -> None:
    """A port a cache process will listen on must be free now: otherwise it would fail and be restarted in vain."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"{flag}: cannot resolve {host!r} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"{flag}: port {port} on {host} is not available ({exc.strerror})") from None


def _runtime_paths(requested: str) -> tuple[str, str]:
    """(base holding every instance's runtime dir, this instance's runtime dir)."""
    base = os.path.join(tempfile.gettempdir(), f"mpcache-{os.getuid()}")
    return base, requested or os.path.join(base, str(os.getpid()))


def _check_socket_path_length(config: Config) -> None:
    """Refuse a runtime dir too long for the cache processes' socket paths up front (each would fail to
    start and be restarted until the supervisor gives up): the longest is the staging name
    ``.cache<worker>.<pid>`` (pid <= 2**22), and sun_path holds 107 bytes."""
    longest = os.path.join(config.runtime_dir, f".cache{config.workers - 1}.{2**22}")
    if len(os.fsencode(longest)) > 107:
        raise ConfigError(f"--runtime-dir: too long for Unix socket paths under it ({len(os.fsencode(longest))} "
                          "bytes, at most 107)")


def _make_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.umask(0o077)  # everything this service and its children create (logs, files of the fs tier) is private
    pid = os.getpid()
    base, runtime_dir = _runtime_paths(args.runtime_dir)
    try:
        config = config_from_args(args, pid, runtime_dir)
        _check_socket_path_length(config)
        _check_endpoints(config)
        forwarder = LineForwarder(config.log_file, args.log_max_bytes, args.log_backups)
    except ConfigError as exc:
        sys.stderr.write(f"start-cache: error: {exc}\n")
        return 2
    except OSError as exc:  # the --log-file cannot be opened
        sys.stderr.write(f"start-cache: error: --log-file: cannot open {args.log_file!r}: {exc.strerror}\n")
        return 2
    if not args.runtime_dir:
        _make_private_dir(base)
    _make_private_dir(runtime_dir)
    log = configure_logging("supervisor", config.instance_id, config.log_level,
                            handlers=[_ForwardingHandler(forwarder)])
    _remove_leftovers(base, log)
    config_path = os.path.join(runtime_dir, "config.json")
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(config.to_json())
    create_segments(config)
    supervisor = Supervisor(config, config_path, log, forwarder)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    log.info("supervisor.started", pid=pid, workers=config.workers, runtime_dir=runtime_dir,
             metrics=None if config.disable_metrics else f"http://{config.prometheus_host}:{config.prometheus_port}/metrics",
             otlp_endpoint=config.otlp_endpoint or None, publish_path=PUBLISH_PATH,
             lmcache_urls=[url for worker in range(config.workers) for url in config.lmcache_urls(worker)] or None)
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
    return supervisor.exit_code


class _ForwardingHandler(logging.Handler):
    def __init__(self, forwarder: LineForwarder) -> None:
        super().__init__()
        self._forwarder = forwarder

    def emit(self, record: logging.LogRecord) -> None:
        self._forwarder.write(record.getMessage())


if __name__ == "__main__":
    sys.exit(main())
