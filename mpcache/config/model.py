"""The one frozen configuration of a run, and the table of start-cache's settings: every setting is a field
here, declared once (kind, default, help; see :mod:`mpcache.config.setting`), from which the flags, the
``MPCACHE_*`` variables and the TOML keys are derived. The supervisor builds it once and hands it to the
children as a JSON file; every check raises a :class:`~mpcache.errors.ConfigError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass, field

from mpcache.config import derived
from mpcache.config.kinds import (
    Choice,
    Integer,
    JsonObject,
    Number,
    OffOrSeconds,
    Port,
    Repeated,
    Seconds,
    Size,
    Switch,
    Text,
)
from mpcache.config.setting import Setting, setting, settings_of, shown
from mpcache.contract.events import MRC_HEAD_FIELDS
from mpcache.errors import ConfigError
from mpcache.shm.layout import CELL_SIZE, MAX_ADAPTERS
from mpcache.shm.segment import shm_name

_L2_SECRET_RE = re.compile(r"[0-9a-f]{64}")
_MIB = 2**20
CHECKPOINT_INTERVAL_S = 10.0  # --telemetry-checkpoint-interval's default (the benchmark of its cost reads it)

SHARED_L2_TYPES = frozenset({"redis"})  # L2 adapter types every cache process shares (others: one per process)
L2_GB = 10**9  # capacity_gb's unit
NICE_MAX = 19  # the largest nice increment (POSIX)
MIN_MRC_HALF_LIFE_S = 1.0  # --mrc-half-life, when not 0: the curves decay at each pump tick, up to a second apart
_DEMO_L1 = (f"{shown(Size(), derived.DEMO_L1_SIZE)} with --demo, "
            f"{shown(Size(), derived.DEMO_L1_SIZE_WITH_L2)} with --demo and --l2")

SERVICE, TELEMETRY, LOGGING, DEMO = "service", "telemetry", "logging", "demo"
LMCACHE = "LMCache clients (vLLM's LMCacheMPConnector, engine_driven transfer)"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True, kw_only=True)
class Config:
    supervisor_pid: int
    # -- service ------------------------------------------------------------------
    workers: int = setting(Integer(1), 2, "cache processes to run (default {default})", group=SERVICE)
    instance_id: str = setting(  # its first 8 characters name shared memory
        Text(r"[A-Za-z0-9._:-]{1,128}", "1 to 128 characters from A-Z a-z 0-9 . _ : -", blank_is_default=True), "",
        "service.instance.id on every metric (default: a new UUID4)", group=SERVICE, derive=derived.new_instance_id)
    # L1 holds objects of any size (LMCache's, per registration) by bytes; chunk_bytes is the native
    # protocol's chunk (its clients' largest block, L2 records, prefetch landings) and the slab unit
    l1_size_bytes: int = setting(
        Size(blank_is_default=True), 256 * _MIB, "L1 pool per cache process, e.g. 512MiB "
        f"(default {{default}}; {_DEMO_L1})", group=SERVICE, name="l1-size",
        derive=derived.demo_l1_size)
    chunk_bytes: int = setting(
        Size(1), 64 * 2**10, "the native protocol's chunk: its clients' largest block, L2 records and the unit "
        "L1's slabs are made of (default {default}); LMCache objects of any size need no flag", group=SERVICE)
    chunk_size_tokens: int = setting(Integer(1), 256, "tokens per chunk (default {default})", group=SERVICE,
                                     name="chunk-size")
    l1_policy: str = setting(Choice(derived.L1_POLICIES), "adaptive",
                             "the order L1 evicts in, and the miss-ratio curves model: adaptive (LRU until what "
                             "was seen again proves likelier to return, then ARC made prefix-aware: orphans, then "
                             "tails, first; a store seen once may not evict what was seen again until it is stored "
                             "a second time, nor then while what it would evict is asked for more often and that "
                             "has proved the better bet; with no L2 tier, a store seen once is refused alike, and "
                             "admitted by chance (mpcache_l1_admission_chance), or refused where its room would "
                             "evict what was used lately, where that would find more (the cache.l1_admission log "
                             "line names the rule)), lru or "
                             "arc (default {default})",
                             group=SERVICE)
    l1_watermark: float = setting(Number(0, 1, low_open=True), 1.0,  # DEPRECATED: read, checked, unused
                                  "deprecated and ignored (one warning at start when set): a store evicts what "
                                  "it needs when L1 is full", group=SERVICE)
    eviction_interval_s: float = setting(Seconds(0.01), 1.0,  # below 10 ms the loop only burns CPU
                                         "seconds between eviction-loop ticks, which report L1 usage and "
                                         "whether stores evicted (default {default})", group=SERVICE,
                                         name="eviction-interval")
    prefetch_job_ttl_s: float = setting(  # an unretrieved prefetch releases its read locks after this
        Seconds(0, math.inf, low_open=True, high_open=True), 60.0,
        "seconds an unretrieved prefetch keeps its chunks locked (default {default}; "
        f"{shown(Seconds(), derived.DEMO_PREFETCH_JOB_TTL_S)} with --demo)", group=SERVICE,
        name="prefetch-job-ttl", derive=derived.with_demo(derived.DEMO_PREFETCH_JOB_TTL_S))
    ring_capacity_cells: int = setting(
        Integer(1024, power_of_two=True), 1 << 18,
        f"event ring size per cache process, in {CELL_SIZE}-byte cells, a power of two (default {{default}})",
        group=SERVICE,
        name="ring-cells")
    runtime_dir: str = setting(  # the supervisor puts the directory it claimed here
        Text(), "", "where sockets and the child config live: absent (it is created) or an empty "
        "directory of ours (default $TMPDIR/mpcache-<uid>/<pid>)", group=SERVICE)
    # L2 adapters, in --l2 order (the position is adapter_index); each a dict with at least "type"
    l2: list = setting(
        Repeated(JsonObject()), [],
        "an L2 adapter, as a JSON object; repeat for several (adapter_index is the order given). "
        'fs: {"type": "fs", "path": DIR, "capacity_gb": N, "threads"?: N} (each cache process uses DIR/worker-<i>); '
        'mock: {"type": "mock", "capacity_gb": N, "latency_ms"?, "bandwidth_gbps"?, "failure_rate"? in [0,1], '
        '"seed"?}; '
        'redis: {"type": "redis", "url": "redis[s]://[user[:password]@]host:port/db", "capacity_gb": N, '
        '"key_prefix"?, "threads"?, "socket_timeout_s"? (1), "connect_timeout_s"? (1), "password_file"?, '
        '"tls_ca_file"?, "tls_cert_file"?, "tls_key_file"?} '
        "(shared by every cache process). GB = 10**9 bytes. Default: no L2", group=SERVICE, metavar="JSON")
    l2_secret_file: str = setting(
        Text(), "", "the secret fs and redis tiers key their records' MACs with (a regular file of ours, mode 0600, "
        ">= 32 bytes; the same on every host sharing a redis tier). Default: $MPCACHE_L2_SECRET_FILE, else the first "
        "fs tier's PATH/.mpcache-l2-secret (created once), else a new one per run (redis records are then "
        "unreadable after a restart)", group=SERVICE, metavar="FILE")
    idle_timeout_s: float = setting(  # 1,024 idle connections would otherwise lock out new clients for good
        Seconds(0, math.inf, high_open=True), 600.0,
        "seconds a connection to a cache process's Unix socket may send nothing before it is closed (the client "
        "reconnects by itself at its next call); 0 never closes one (default {default})", group=SERVICE,
        name="idle-timeout")
    hang_timeout_s: float = setting(
        Seconds(1, math.inf, high_open=True), 10.0,
        "seconds a cache process's heartbeat may stand still before it is killed and restarted (default {default})",
        group=SERVICE, name="hang-timeout")
    duration_s: float = setting(
        Seconds(0), 0.0,
        "stop by itself after this many seconds and exit 0 (default: run until SIGINT/SIGTERM)", group=SERVICE,
        name="duration")
    # -- telemetry ----------------------------------------------------------------
    prometheus_host: str = setting(Text(), "127.0.0.1", "address /metrics, /healthz and /ready bind to "
                                   "(default {default})", group=TELEMETRY)
    prometheus_port: int = setting(Port(), 9090, "port of /metrics, /healthz and /ready (default {default})",
                                   group=TELEMETRY)
    no_http: bool = setting(Switch(), False,
                            "serve no HTTP endpoint (no /metrics, /healthz, /ready): OTLP push only", group=TELEMETRY)
    otlp_endpoint: str = setting(
        Text(), "", "OTLP collector, e.g. http://127.0.0.1:4317 (push every --otlp-interval s; default "
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no push)", group=TELEMETRY,
        derive=derived.otlp_endpoint)
    otlp_protocol: str = setting(
        Choice(derived.OTLP_PROTOCOLS), "grpc", "OTLP transport: grpc or http/protobuf (http is the same); default "
        "OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL, else {default}", group=TELEMETRY, derive=derived.otlp_protocol)
    otlp_interval_s: float = setting(
        Seconds(0.1), 10.0,  # an export takes longer than a shorter interval: collections would time out
        "seconds between OTLP exports (default OTEL_METRIC_EXPORT_INTERVAL in ms, else {default})", group=TELEMETRY,
        name="otlp-interval", derive=derived.otlp_interval)
    metrics_sample_rate: float = setting(
        Number(0, 1, low_open=True), 0.01,
        "fraction of chunks, in (0, 1], tracked by lifecycle histograms (default {default}; "
        f"{derived.DEMO_METRICS_SAMPLE_RATE} with --demo)", group=TELEMETRY,
        derive=derived.with_demo(derived.DEMO_METRICS_SAMPLE_RATE))
    # miss-ratio curves (docs/MRC.md): the chunk keys sampled (SHARDS), the keys tracked per curve (the rate
    # is lowered below mrc_sample_rate to stay within it), and the half-life of the curves' access counts
    mrc_sample_rate: float = setting(
        Number(0, 1), 0.01, "fraction of chunk keys, in [0, 1], whose lookups and stores feed the miss-ratio "
        "curves and miss reasons (SHARDS spatial sampling; 1 = every access, exact; 0 = no curves; "
        "default {default})", group=TELEMETRY)
    mrc_exact_chunks: int = setting(
        Integer(0, len(MRC_HEAD_FIELDS)), 16, f"the first chunks of every lookup (0..{len(MRC_HEAD_FIELDS)}) that "
        "the curves track whatever the sample rate, within --mrc-max-keys: a prefix cache's hottest keys, such as "
        "system prompts and shared documents (default {default})",
        group=TELEMETRY)
    mrc_max_keys: int = setting(
        Integer(64, 1 << 22), 32768, "sampled keys the miss-ratio curves track, split among the cache processes; "
        "beyond it a process's history lowers its own rate (SHARDS fixed-size; default {default})", group=TELEMETRY)
    mrc_half_life_s: float = setting(  # much shorter than a tick, each decay would empty the curves
        OffOrSeconds(MIN_MRC_HALF_LIFE_S, math.inf, high_open=True), 3600.0,
        "seconds after which an access weighs half in the miss-ratio curves, so they follow "
        "a changing workload (0: never decay; default {default})", group=TELEMETRY, name="mrc-half-life")
    cache_salt_cap: int = setting(Integer(1), 1000,
                                  "distinct cache_salt values per metric before __overflow__ (default {default})",
                                  group=TELEMETRY)
    metric_series_cap: int = setting(
        Integer(1), 1500, "attribute sets per metric before new client-chosen values (cache_salt, model_name, "
        "engine, instance and worker ids, device) read __overflow__ (default {default}, below the OpenTelemetry "
        "SDK's 2000)", group=TELEMETRY)
    # the telemetry process's checkpoints (two of them, in a shared-memory segment the supervisor owns) hold its
    # counters, histograms and subscriber state with the ring cursors they cover, so a restart goes on counting
    telemetry_state_bytes: int = setting(
        Size(1 << 16), 4 * _MIB, "room for one checkpoint of the telemetry process's state, which lets a "
        "restarted telemetry process go on counting exactly where the last one stopped (the supervisor keeps "
        "two in shared memory; default {default}). A state that outgrows it is logged and counted, and a restart "
        "until it fits again starts every counter from zero", group=TELEMETRY, name="telemetry-state-size")
    # how often a checkpoint is written: every flush (each scrape and OTLP export) exports, but a record is written
    # only this long after the last one or when a ring needs releasing; a restart reads on from the record
    telemetry_checkpoint_interval_s: float = setting(
        Seconds(0, math.inf, high_open=True), CHECKPOINT_INTERVAL_S,
        "seconds between two checkpoints of the telemetry process's state (0: one at every flush, that is every "
        "scrape and OTLP export); the rings hold what came after the last one, which a restarted telemetry "
        "process reads again (default {default})", group=TELEMETRY, name="telemetry-checkpoint-interval")
    # the telemetry process lowers its own scheduling priority by this nice increment at start (0: as the
    # cache processes), so that on a contended machine it yields the CPU to the data path and lags instead
    telemetry_nice: int = setting(
        Integer(0, NICE_MAX), 0, f"nice increment (0..{NICE_MAX}) the telemetry process applies to itself, so that "
        "on a busy machine the cache processes get the CPU first and the drain lags instead (default {default})",
        group=TELEMETRY)
    telemetry_hang_timeout_s: float = setting(
        Seconds(1, math.inf, high_open=True), 10.0,
        "seconds the telemetry process's heartbeat may stand still before it is killed and restarted; the "
        "cache processes serve on meanwhile (default {default})", group=TELEMETRY, name="telemetry-hang-timeout")
    disable_metrics: bool = setting(
        Switch(), False, "run no metrics subscribers and no exporters (/healthz and /ready still answer)",
        group=TELEMETRY, derive=derived.otel_sdk_disabled)
    disable_logging: bool = setting(Switch(), False, "run no logging subscribers", group=TELEMETRY)
    enable_tracing: bool = setting(Switch(), False, "export request spans over OTLP (needs --otlp-endpoint)",
                                   group=TELEMETRY)
    # -- logging ------------------------------------------------------------------
    log_level: str = setting(Choice(("debug", "info", "warning", "error")), "info", "default {default}", group=LOGGING)
    log_file: str = setting(Text(), "", "also write the JSON log lines here (size-rotated)", group=LOGGING)
    log_format: str = setting(
        Choice(("auto", "console", "json")), "auto", "stderr: one readable line per event (console) or JSON lines; "
        "auto (default): console on a terminal, JSON otherwise. --log-file is always JSON", group=LOGGING)
    log_max_bytes: int = setting(Size(), 50 * _MIB,
                                 "rotate --log-file at this size, e.g. 100MiB; 0 never rotates (default {default})",
                                 group=LOGGING)
    log_backups: int = setting(Integer(0), 5, "rotated --log-file copies kept: FILE.1 .. FILE.N (default {default})",
                               group=LOGGING)
    # -- LMCache MP-protocol front end: cache process i listens on tcp://lmcache_host:(lmcache_port + i)
    # when lmcache_port > 0, and/or on ipc://<runtime_dir>/lmcache<i>.ipc with lmcache_ipc
    lmcache_port: int = setting(
        Port(), 0, "serve LMCache's MP protocol over ZeroMQ: cache process i listens on tcp://HOST:PORT+i "
        "(default: off)", group=LMCACHE)
    lmcache_host: str = setting(Text(), "127.0.0.1", "address for --lmcache-port (default {default})", group=LMCACHE)
    lmcache_ipc: bool = setting(
        Switch(), False, "also serve it on ipc://RUNTIME_DIR/lmcache<i>.ipc (mode 0600: same-user clients only)",
        group=LMCACHE)
    lmcache_allow_uids: list = setting(  # besides the service's own uid
        Repeated(Integer(0, 2**32 - 2)), [], "also accept LMCache clients running as this uid (repeatable; "
        "default: only the service's own uid)", group=LMCACHE, name="lmcache-allow-uid", metavar="UID")
    lmcache_allow_remote: bool = setting(
        Switch(), False, "allow a non-loopback --lmcache-host: peers on other hosts are then accepted unchecked",
        group=LMCACHE)
    lmcache_allow_clear: bool = setting(
        Switch(), False, "let LMCache clients empty L1 with clear (an operator action; default: refused)",
        group=LMCACHE)
    kv_event_log_size: int = setting(
        Integer(0, 1 << 22), 32768,  # LMCache's default
        "records of L1 changes each cache process keeps for subscribe_kv_events (cache-aware routers, through "
        "the engines' KV-event publishers; default {default}, LMCache's size); 0 disables the stream",
        group=LMCACHE)
    kv_events_endpoint: str = setting(
        Text(), "", "also publish the KV event feed in vLLM's format from the telemetry process: ZeroMQ PUB on "
        "tcp://HOST:PORT (cache process i on PORT+2i, its replay ROUTER on PORT+2i+1; HOST loopback unless "
        "--lmcache-allow-remote); needs --lmcache-port or --lmcache-ipc, and pyzmq (pip install "
        "'mpcache[kv-events]') (default: off)",
        group=LMCACHE)
    lmcache_max_tokens: int = setting(  # derives the frame cap
        Integer(1 << 8, 1 << 26), 1 << 20,
        "the longest token list a request may carry; bounds every frame (default {default})", group=LMCACHE)
    # -- demo ---------------------------------------------------------------------
    demo: bool = setting(Switch(), False, "also run the built-in load generator", group=DEMO)
    demo_seconds: float = setting(
        Seconds(0), 0.0,
        "stop the load after this many seconds; the service keeps serving (default: until shutdown)", group=DEMO)
    demo_tally_file: str = setting(
        Text(), "", "write the demo's own counts (per cache_salt) here as JSON when it finishes", group=DEMO,
        name="demo-tally")
    # -- not settings: derived by the supervisor ----------------------------------------
    intern_capacity: int = 4096  # the ring's name table
    # the key fs and redis tiers MAC their records with (64 hex digits; "" with no such tier), never logged;
    # and where it came from ("--l2-secret-file PATH", "fs PATH", "per-run"), which may be
    l2_secret: str = field(default="", repr=False)
    l2_secret_source: str = ""

    def __post_init__(self) -> None:
        for item in SETTINGS:
            problem = item.kind.problem(getattr(self, item.field))
            if problem:
                raise ConfigError(f"{item.flag}: {problem}")
        checks = [
            (self.l1_size_bytes >= self.chunk_bytes, "--l1-size: must hold at least one chunk (--chunk-bytes)"),
            (self.lmcache_port == 0 or self.lmcache_port <= 65535 - self.workers + 1,
             "--lmcache-port: expected a port number so that port + workers - 1 is at most 65535"),
            (not self.enable_tracing or bool(self.otlp_endpoint),
             "--enable-tracing: needs --otlp-endpoint (spans are exported over OTLP)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.lmcache_port and not self.lmcache_allow_remote and not _is_loopback(self.lmcache_host):
            raise ConfigError(
                f"--lmcache-host: {self.lmcache_host} is not a loopback address; LMCache clients share this host's "
                "memory (engine_driven transfer maps the L1 pool), so they run here: use 127.0.0.1, or pass "
                "--lmcache-allow-remote to accept peers on other hosts without any identity check")
        if self.kv_events_endpoint:
            self.kv_events_endpoints(self.workers - 1)  # refuses a malformed one
            if importlib.util.find_spec("zmq") is None:
                raise ConfigError("--kv-events-endpoint: needs pyzmq, which is not installed (pip install "
                                  "'mpcache[kv-events]')")
        if self.l2_secret and not _L2_SECRET_RE.fullmatch(self.l2_secret):
            raise ConfigError("l2_secret: expected 64 hex digits (the supervisor's resolved L2 key)")
        if len(self.l2) > MAX_ADAPTERS:
            raise ConfigError(f"--l2: at most {MAX_ADAPTERS} adapters, got {len(self.l2)}")

    def l2_name(self, adapter_index: int) -> str:
        """The l2_name attribute of an adapter: its type name."""
        return str(self.l2[adapter_index]["type"])

    # -- derived names ---------------------------------------------------------

    @property
    def l1_pool_bytes(self) -> int:
        """Bytes of each cache process's L1 pool segment: --l1-size, down to a whole number of chunks."""
        return self.l1_size_bytes // self.chunk_bytes * self.chunk_bytes

    def tier_capacities(self) -> dict[str, int]:
        """Configured bytes of L1 over every cache process ("l1") and, with L2 tiers, of L1 plus every L2
        tier ("l1_l2": a shared tier once, a per-process one per process)."""
        l1 = self.l1_pool_bytes * self.workers
        if not self.l2:
            return {"l1": l1}
        l2 = sum(int(spec.get("capacity_gb", 0) * L2_GB) * (1 if spec["type"] in SHARED_L2_TYPES else self.workers)
                 for spec in self.l2)
        return {"l1": l1, "l1_l2": l1 + l2}

    def ring_name(self, worker: int) -> str:
        return shm_name(self.supervisor_pid, self.instance_id, f"events{worker}")

    def l1_pool_name(self, worker: int) -> str:
        return shm_name(self.supervisor_pid, self.instance_id, f"l1pool{worker}")

    def gauge_board_name(self) -> str:
        return shm_name(self.supervisor_pid, self.instance_id, "gauges")

    def telemetry_state_name(self) -> str:
        """The telemetry process's checkpoints (:mod:`mpcache.shm.checkpoint`)."""
        return shm_name(self.supervisor_pid, self.instance_id, "telemetry")

    def socket_path(self, worker: int) -> str:
        return os.path.join(self.runtime_dir, f"cache{worker}.sock")

    def telemetry_socket_path(self) -> str:
        """Where the telemetry process serves /metrics for the supervisor's front to forward to."""
        return os.path.join(self.runtime_dir, "telemetry.sock")

    def lmcache_urls(self, worker: int) -> list[str]:
        """Where cache process ``worker`` serves LMCache's MP protocol (empty: it does not)."""
        urls = []
        if self.lmcache_port:
            host = f"[{self.lmcache_host}]" if ":" in self.lmcache_host else self.lmcache_host
            urls.append(f"tcp://{host}:{self.lmcache_port + worker}")
        if self.lmcache_ipc:
            urls.append(f"ipc://{os.path.join(self.runtime_dir, f'lmcache{worker}.ipc')}")
        return urls

    def kv_events_endpoints(self, worker: int) -> tuple[str, str]:
        """Where the telemetry process publishes cache process ``worker``'s KV events, and its replay socket."""
        endpoint = self.kv_events_endpoint
        if not self.lmcache_urls(worker) or not self.kv_event_log_size:
            raise ConfigError("--kv-events-endpoint: needs --lmcache-port or --lmcache-ipc, and a KV event log")
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not endpoint.startswith("tcp://") or not port.isdigit() or not host:
            raise ConfigError(f"--kv-events-endpoint: expected tcp://HOST:PORT, got {endpoint!r}")
        if not self.lmcache_allow_remote and not _is_loopback(host):
            raise ConfigError(f"--kv-events-endpoint: {host} is not a loopback address (--lmcache-allow-remote "
                              "publishes to other hosts, unauthenticated)")
        first = int(port) + 2 * worker
        if first + 1 > 65535:
            raise ConfigError("--kv-events-endpoint: PORT + 2 × workers goes past 65535")
        return f"tcp://{host}:{first}", f"tcp://{host}:{first + 1}"

    def all_segment_names(self) -> list[str]:
        names = [self.gauge_board_name(), self.telemetry_state_name()]
        for worker in range(self.workers):
            names += [self.ring_name(worker), self.l1_pool_name(worker)]
        return names

    # -- serialisation -----------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"configuration file has unknown keys: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str) -> Config:
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(handle.read())


SETTINGS: tuple[Setting, ...] = settings_of(Config)  # every setting of start-cache, in the order of --help
