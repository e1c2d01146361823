"""``bin/start-cache``: the configuration, every shared-memory object, and the child processes (telemetry,
cache, demo), each kind its own failure domain: telemetry restarted forever, a crash-looping or hung cache
process restarted and given up alone, the demo never restarted; stopped in order, leaving nothing behind.
"""

from __future__ import annotations

import argparse
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
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import posix_ipc

from mpcache import __version__, settings
from mpcache.cache.l2.spec import parse_l2_spec
from mpcache.cache.l2.trust import SECRET_FILE_ENV, ensure_private_dir, resolve_l2_key
from mpcache.config import L2_GB, Config, parse_size
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

# Restart policy (module constants, so tests can shorten them).  A child that exits is restarted after
# BACKOFF_INITIAL_S, doubling per consecutive quick exit up to the role's cap; a cache process that exits
# MAX_CRASHES_IN_WINDOW times within CRASH_WINDOW_S is given up alone; telemetry is never given up.
CRASH_WINDOW_S = 30.0
MAX_CRASHES_IN_WINDOW = 5
BACKOFF_INITIAL_S = 0.5
CACHE_BACKOFF_MAX_S = 8.0
TELEMETRY_BACKOFF_MAX_S = 30.0
# Liveness: a cache process whose heartbeat word (written every 0.5 s by its loop) stops advancing for
# HANG_TIMEOUT_S is killed and restarted; one whose loop never starts within START_TIMEOUT_S too.
HANG_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0
WATCH_INTERVAL_S = 0.1
STOP_GRACE_S = 10.0
STATUS_FILE = "status.json"
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


def _seconds_at_least(minimum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(text)
        if not minimum <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number of seconds >= {minimum:g}, got {text!r}")
        return value
    return parse


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
    parser.add_argument("--version", action="version", version=f"start-cache (mpcache) {__version__}")
    service = parser.add_argument_group("service")
    service.add_argument("--workers", type=_int_at_least(1), default=2, help="cache processes to run (default 2)")
    service.add_argument("--instance-id", default="", help="service.instance.id on every metric (default: a new UUID4)")
    service.add_argument("--l1-size", default="",
                         help="L1 pool per cache process, e.g. 512MiB "
                              "(default 256MiB; 32MiB with --demo, 8MiB with --demo and --l2)")
    service.add_argument("--chunk-bytes", default="64KiB",
                         help="the native protocol's chunk: its clients' largest block, L2 records and the unit "
                              "L1's slabs are made of (default 64KiB); LMCache objects of any size need no flag")
    service.add_argument("--chunk-size", type=_int_at_least(1), default=256, help="tokens per chunk (default 256)")
    service.add_argument("--l1-watermark", type=_number, default=0.8,
                         help="L1 usage in (0, 1] above which the eviction loop evicts (default 0.8)")
    service.add_argument("--eviction-interval", type=_number, default=1.0,
                         help="seconds between eviction-loop runs (default 1)")
    service.add_argument("--prefetch-job-ttl", type=_number, default=None,
                         help="seconds an unretrieved prefetch keeps its chunks locked (default 60; 3 with --demo)")
    service.add_argument("--ring-cells", type=_int_at_least(1024), default=1 << 18,
                         help="event ring size per cache process, in 64-byte cells, a power of two (default 262144)")
    service.add_argument("--runtime-dir", default="",
                         help="where sockets and the child config live: absent (it is created) or an empty "
                         "directory of ours (default $TMPDIR/mpcache-<uid>/<pid>)")
    service.add_argument(
        "--l2", action="append", default=[], metavar="JSON",
        help="an L2 adapter, as a JSON object; repeat for several (adapter_index is the order given). "
        'fs: {"type": "fs", "path": DIR, "capacity_gb": N, "threads"?: N} (each cache process uses DIR/worker-<i>); '
        'mock: {"type": "mock", "capacity_gb": N, "latency_ms"?, "bandwidth_gbps"?, "failure_rate"? in [0,1], '
        '"seed"?}; '
        'redis: {"type": "redis", "url": "redis[s]://[user[:password]@]host:port/db", "capacity_gb": N, '
        '"key_prefix"?, "threads"?, "socket_timeout_s"? (1), "connect_timeout_s"? (1), "password_file"?, '
        '"tls_ca_file"?, "tls_cert_file"?, "tls_key_file"?} '
        "(shared by every cache process). GB = 10**9 bytes. Default: no L2")
    service.add_argument(
        "--l2-secret-file", default=None, metavar="FILE",
        help="the secret fs and redis tiers key their records' MACs with (a regular file of ours, mode 0600, "
        f">= 32 bytes; the same on every host sharing a redis tier). Default: ${SECRET_FILE_ENV}, else the first "
        "fs tier's PATH/.mpcache-l2-secret (created once), else a new one per run (redis records are then "
        "unreadable after a restart)")
    service.add_argument("--hang-timeout", type=_seconds_at_least(1.0), default=HANG_TIMEOUT_S,
                         help="seconds a cache process's heartbeat may stand still before it is killed and restarted "
                         f"(default {HANG_TIMEOUT_S:g})")
    service.add_argument("--duration", type=_number, default=0.0,
                         help="stop by itself after this many seconds and exit 0 (default: run until SIGINT/SIGTERM)")
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument("--prometheus-host", default="127.0.0.1",
                           help="address /metrics binds to (default 127.0.0.1)")
    telemetry.add_argument("--prometheus-port", type=_port, default=9090, help="port of /metrics (default 9090)")
    telemetry.add_argument("--no-http", action="store_true",
                           help="serve no HTTP endpoint (no /metrics, /healthz, /ready): OTLP push only")
    telemetry.add_argument("--otlp-endpoint", default=None,
                           help="OTLP collector, e.g. http://127.0.0.1:4317 (push every --otlp-interval s; default "
                           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no push)")
    telemetry.add_argument("--otlp-protocol", choices=("grpc", "http/protobuf", "http"), default=None,
                           help="OTLP transport: grpc or http/protobuf (http is the same); default "
                           "OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL, else grpc")
    telemetry.add_argument("--otlp-interval", type=_number, default=None,
                           help="seconds between OTLP exports (default OTEL_METRIC_EXPORT_INTERVAL in ms, else 10)")
    telemetry.add_argument("--metrics-sample-rate", type=_number, default=None,
                           help="fraction of chunks, in (0, 1], tracked by lifecycle histograms "
                                "(default 0.01; 0.1 with --demo)")
    telemetry.add_argument("--mrc-sample-rate", type=_number, default=0.01,
                           help="fraction of chunk keys, in [0, 1], whose lookups and stores feed the miss-ratio "
                           "curves and miss reasons (SHARDS spatial sampling; 1 = every access, exact; 0 = no curves; "
                           "default 0.01)")
    telemetry.add_argument("--mrc-exact-chunks", type=int, default=4,
                           help="the first chunks of every lookup (0..4) that the curves track whatever the sample "
                           "rate: a prefix cache's hottest keys, such as system prompts (default 4)")
    telemetry.add_argument("--mrc-max-keys", type=_int_at_least(64), default=8192,
                           help="sampled keys tracked per miss-ratio curve; beyond it the curve lowers its own rate "
                           "(SHARDS fixed-size; default 8192)")
    telemetry.add_argument("--mrc-half-life", type=_number, default=3600.0,
                           help="seconds after which an access weighs half in the miss-ratio curves, so they follow "
                           "a changing workload (0: never decay; default 3600)")
    telemetry.add_argument("--cache-salt-cap", type=_int_at_least(1), default=1000,
                           help="distinct cache_salt values per metric before __overflow__ (default 1000)")
    telemetry.add_argument("--metric-series-cap", type=_int_at_least(1), default=1500,
                           help="attribute sets per metric before new cache_salt/model_name values read __overflow__ "
                           "(default 1500, below the OpenTelemetry SDK's 2000)")
    telemetry.add_argument("--telemetry-nice", type=int, default=0,
                           help="nice increment (0..19) the telemetry process applies to itself, so that on a busy "
                           "machine the cache processes get the CPU first and the drain lags instead (default 0)")
    telemetry.add_argument("--disable-metrics", action="store_true", help="run no metrics subscribers and no exporters")
    telemetry.add_argument("--disable-logging", action="store_true", help="run no logging subscribers")
    telemetry.add_argument("--enable-tracing", action="store_true",
                           help="export request spans over OTLP (needs --otlp-endpoint)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="default info")
    logs.add_argument("--log-file", default="", help="also write the JSON log lines here (size-rotated)")
    logs.add_argument("--log-format", choices=("auto", "console", "json"), default="auto",
                      help="stderr: one readable line per event (console) or JSON lines; auto (default): console "
                      "on a terminal, JSON otherwise. --log-file is always JSON")
    logs.add_argument("--log-max-bytes", type=_size, default=50 * 2**20,
                      help="rotate --log-file at this size, e.g. 100MiB; 0 never rotates (default 50MiB)")
    logs.add_argument("--log-backups", type=_int_at_least(0), default=5,
                      help="rotated --log-file copies kept: FILE.1 .. FILE.N (default 5)")
    lmcache = parser.add_argument_group("LMCache clients (vLLM's LMCacheMPConnector, engine_driven transfer)")
    lmcache.add_argument("--lmcache-port", type=_port, default=0,
                         help="serve LMCache's MP protocol over ZeroMQ: cache process i listens on tcp://HOST:PORT+i "
                         "(default: off)")
    lmcache.add_argument("--lmcache-host", default="127.0.0.1", help="address for --lmcache-port (default 127.0.0.1)")
    lmcache.add_argument("--lmcache-ipc", action="store_true",
                         help="also serve it on ipc://RUNTIME_DIR/lmcache<i>.ipc (mode 0600: same-user clients only)")
    lmcache.add_argument("--lmcache-allow-uid", action="append", type=_int_at_least(0), default=[], metavar="UID",
                         help="also accept LMCache clients running as this uid (repeatable; default: only the "
                         "service's own uid)")
    lmcache.add_argument("--lmcache-allow-remote", action="store_true",
                         help="allow a non-loopback --lmcache-host: peers on other hosts are then accepted unchecked")
    lmcache.add_argument("--lmcache-allow-clear", action="store_true",
                         help="let LMCache clients empty L1 with clear (an operator action; default: refused)")
    lmcache.add_argument("--lmcache-max-tokens", type=_int_at_least(256), default=1 << 20,
                         help="the longest token list a request may carry; bounds every frame (default 1048576)")
    bench = parser.add_argument_group("benchmarking")
    bench.add_argument("--event-sink", choices=("ring", "none", "inprocess"), default="ring",
                       help="where cache processes send events: ring (default, the telemetry process reads them); "
                       "none (telemetry off) and inprocess (LMCache's design, an in-process bus) exist to "
                       "measure against")
    demo = parser.add_argument_group("demo")
    demo.add_argument("--demo", action="store_true", help="also run the built-in load generator")
    demo.add_argument("--demo-seconds", type=_number, default=0.0,
                      help="stop the load after this many seconds; the service keeps serving (default: until shutdown)")
    demo.add_argument("--demo-tally", default="",
                      help="write the demo's own counts (per cache_salt) here as JSON when it finishes")
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


def _otel_setting(flag_value: str | None, what: str, default: str) -> str:
    """A flag given on the command line, else OTEL_EXPORTER_OTLP_METRICS_<what>, else OTEL_EXPORTER_OTLP_<what>."""
    if flag_value is not None:
        return flag_value
    for name in (f"OTEL_EXPORTER_OTLP_METRICS_{what}", f"OTEL_EXPORTER_OTLP_{what}"):
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    return default


def _otlp_protocol(flag_value: str | None) -> str:
    protocol = _otel_setting(flag_value, "PROTOCOL", "grpc")
    if protocol not in ("grpc", "http/protobuf", "http"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: expected grpc or http/protobuf, got {protocol!r}")
    return protocol


def _otlp_interval_s(flag_value: float | None) -> float:
    if flag_value is not None:
        return flag_value
    text = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if not text:
        return 10.0
    try:
        milliseconds = float(text)
    except ValueError:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds, got {text!r}") from None
    if not milliseconds > 0:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds > 0, got {text!r}")
    return milliseconds / 1000


def _otel_sdk_disabled() -> bool:
    """OTEL_SDK_DISABLED=true: no metrics subscribers or exporters (as --disable-metrics)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def config_from_args(args: argparse.Namespace, supervisor_pid: int, runtime_dir: str) -> Config:
    # the demo's L1 is small so that it evicts; smaller still with L2, so that prefetches come from L2
    l1_size = args.l1_size or (("8MiB" if args.l2 else "32MiB") if args.demo else "256MiB")
    chunk_bytes = parse_size(args.chunk_bytes, "--chunk-bytes")
    l2 = _l2_specs(args.l2, chunk_bytes)
    for spec in l2:
        if spec["type"] == "fs":  # ours, not a symlink, not writable by others: before its secret is read from it
            ensure_private_dir(spec["path"], "--l2: fs path")
    secret_file = getattr(args, "l2_secret_file", None) or os.environ.get(SECRET_FILE_ENV, "")
    l2_key = resolve_l2_key(l2, secret_file)
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
        disable_metrics=args.disable_metrics or _otel_sdk_disabled(),
        disable_logging=args.disable_logging,
        enable_tracing=args.enable_tracing,
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
        no_http=args.no_http,
        otlp_endpoint=_otel_setting(args.otlp_endpoint, "ENDPOINT", ""),
        otlp_protocol=_otlp_protocol(args.otlp_protocol),
        otlp_interval_s=_otlp_interval_s(args.otlp_interval),
        metrics_sample_rate=_default(args.metrics_sample_rate, demo=0.1, normal=0.01, is_demo=args.demo),
        cache_salt_cap=args.cache_salt_cap,
        mrc_sample_rate=args.mrc_sample_rate,
        mrc_exact_chunks=args.mrc_exact_chunks,
        mrc_max_keys=args.mrc_max_keys,
        mrc_half_life_s=args.mrc_half_life,
        metric_series_cap=args.metric_series_cap,
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
        lmcache_allow_uids=args.lmcache_allow_uid,
        lmcache_allow_remote=args.lmcache_allow_remote,
        lmcache_allow_clear=args.lmcache_allow_clear,
        lmcache_max_tokens=args.lmcache_max_tokens,
        l2=l2,
        l2_secret=l2_key.key.hex() if l2_key else "",
        l2_secret_source=l2_key.source if l2_key else "",
    )


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
        if self.config.event_sink == "ring":  # otherwise nothing reads the rings
            telemetry = Child("telemetry", 0, self._argv("mpcache.telemetry"))
            self.children.append(telemetry)
            self._spawn(telemetry)
        # --event-sink inprocess (benchmarks): cache processes publishing through LMCache's in-process bus
        module = "mpcache.bench.reference_cache" if self.config.event_sink == "inprocess" else "mpcache.cache"
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
    return env


def _check_endpoints(config: Config) -> None:
    """Addresses the telemetry process would otherwise fail on at start (restart loop) or at export time."""
    if not config.disable_metrics and not config.no_http:
        try:
            socket.getaddrinfo(config.prometheus_host, config.prometheus_port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(f"--prometheus-host: cannot resolve {config.prometheus_host!r} "
                              f"({exc.strerror})") from None
        if config.prometheus_port and not config.no_http:  # taken, telemetry could only fail (and restart) in vain
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
    if log_format == "json" or (log_format == "auto" and not tty):
        return None
    return console_renderer(colors=tty)


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
    args = settings.parse_args(build_parser(), argv)
    os.umask(0o077)  # everything this service and its children create (logs, files of the fs tier) is private
    pid = os.getpid()
    base = default_base()
    planned = os.path.abspath(args.runtime_dir) if args.runtime_dir else os.path.join(base, str(pid))
    try:
        config = config_from_args(args, pid, planned)
        _check_socket_path_length(config)
        _check_endpoints(config)
        check_shm_space(config)  # before anything is created: one line, never a SIGBUS later
        forwarder = LineForwarder(config.log_file, args.log_max_bytes, args.log_backups,
                                  render=_stderr_renderer(args.log_format))
    except ConfigError as exc:
        return _error(settings.where(args, str(exc)))
    except OSError as exc:  # the --log-file cannot be opened
        return _error(f"--log-file: cannot open {args.log_file!r}: {exc.strerror}")
    try:
        runtime, swept = _claim_runtime_dir(args.runtime_dir, base, pid)
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
                            hang_timeout_s=args.hang_timeout, runtime=runtime)
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
