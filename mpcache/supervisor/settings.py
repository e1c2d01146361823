"""``start-cache``'s flags, the Config they make, and where their values come from: a TOML file, ``MPCACHE_*``
environment variables, flags.

Later sources win: file < environment < command line.  Every setting is a flag's long name
(``--l1-size`` → ``l1-size`` in the file, ``MPCACHE_L1_SIZE`` in the environment) and goes through
the flag's own parser, so a bad value is one line naming the setting and where it came from.  L2
tiers are a list of tables in the file (``[[l2]]``) or a JSON list in ``MPCACHE_L2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from mpcache import __version__
from mpcache.cache.l2.spec import parse_l2_spec
from mpcache.cache.l2.trust import SECRET_FILE_ENV, ensure_private_dir, resolve_l2_key
from mpcache.config import L2_GB, Config, parse_size
from mpcache.errors import ConfigError
from mpcache.supervisor.liveness import HANG_TIMEOUT_S

ENV_PREFIX = "MPCACHE_"
CONFIG_ENV = "MPCACHE_CONFIG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NOT_SETTINGS = {"help", "version", "config"}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser``'s flags, defaulted from ``--config FILE`` (or ``$MPCACHE_CONFIG``) and ``MPCACHE_*``."""
    environ = os.environ if environ is None else environ
    parser.add_argument("--config", metavar="FILE", default=environ.get(CONFIG_ENV, ""),
                        help="a TOML file of settings (flag names as keys, [[l2]] tables for L2 tiers); "
                        "MPCACHE_* environment variables override it, flags override both")
    actions = {action.dest: action for action in parser._actions if action.dest not in _NOT_SETTINGS}
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=environ.get(CONFIG_ENV, ""))
    known, _ = first.parse_known_args(argv)
    defaults: dict[str, tuple[Any, str]] = {}
    try:
        if known.config:
            defaults.update(_from_file(known.config, actions))
        defaults.update(_from_environment(environ, actions))
    except ConfigError as exc:
        parser.error(str(exc))
    parser.set_defaults(**{dest: value for dest, (value, _) in defaults.items()})
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    args.setting_sources = {f"--{dest.replace('_', '-')}": source for dest, (_, source) in defaults.items()
                            if dest not in given}
    return args


def where(args: argparse.Namespace, message: str) -> str:
    """``message`` (which names a flag first) with where that flag's value came from, when not a flag."""
    flag = message.split(":", 1)[0].split("/", 1)[0]
    source = getattr(args, "setting_sources", {}).get(flag)
    return f"{message} (set in {source})" if source else message


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The settings the command line itself sets (they win over file and environment)."""
    words = sys.argv[1:] if argv is None else list(argv)
    given = set()
    for action in parser._actions:
        if any(word == option or word.startswith(option + "=") for option in action.option_strings
               for word in words):
            given.add(action.dest)
    return given


def _from_file(path: str, actions: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r} ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    values = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"{path}: unknown setting {key!r} (a flag name without its dashes)")
        values[dest] = (_value(action, value, f"{path}: {key}"), path)
    return values


def _from_environment(environ: Mapping[str, str],
                      actions: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    values = {}
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            text = environ[name]
            value: Any = text
            if isinstance(action, argparse._AppendAction):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{name}: expected a JSON list ({exc.msg})") from None
            values[dest] = (_value(action, value, name), name)
    return values


def _value(action: argparse.Action, value: Any, source: str) -> Any:
    """``value`` as the flag's parser would give it; ConfigError naming ``source`` otherwise."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE + _FALSE:
            return text in _TRUE
        raise ConfigError(f"{source}: expected true or false, got {value!r}")
    if isinstance(action, argparse._AppendAction):  # a list: --l2's tables (or JSON texts), or typed items
        if not isinstance(value, list):
            raise ConfigError(f"{source}: expected a list")
        if action.type is None:
            return [item if isinstance(item, str) else json.dumps(item) for item in value]
        return [_typed(action, str(item), source) for item in value]
    text = value if isinstance(value, str) else str(value)
    if action.choices is not None and text not in action.choices:
        raise ConfigError(f"{source}: expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    if action.type is None:
        return text
    return _typed(action, text, source)


def _typed(action: argparse.Action, text: str, source: str) -> Any:
    try:
        return action.type(text)  # type: ignore[misc,operator]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


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
    telemetry.add_argument("--disable-metrics", action="store_true",
                           help="run no metrics subscribers and no exporters (/healthz and /ready still answer)")
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
    """OTEL_SDK_DISABLED=true: no metrics subscribers or exporters (as --disable-metrics); /healthz and /ready
    still answer."""
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
