"""One frozen configuration, built once by the supervisor from its flags and handed to the children as a
JSON file; every check raises a :class:`~mpcache.errors.ConfigError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from dataclasses import dataclass, field

from mpcache.contract.events import MRC_HEAD_FIELDS
from mpcache.errors import ConfigError
from mpcache.shm.layout import MAX_ADAPTERS
from mpcache.shm.segment import shm_name

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_L2_SECRET_RE = re.compile(r"[0-9a-f]{64}")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def parse_size(text: str, flag: str) -> int:
    """'256MiB', '1GB', '4096' → bytes; ConfigError naming ``flag`` otherwise."""
    match = _SIZE_RE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag}: expected a size such as 512MiB, 2GB or 1048576, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


SHARED_L2_TYPES = frozenset({"redis"})  # L2 adapter types every cache process shares (others: one per process)
L2_GB = 10**9  # capacity_gb's unit


@dataclass(frozen=True)
class Config:
    instance_id: str
    supervisor_pid: int
    runtime_dir: str
    workers: int = 2
    # L1 and chunks: L1 holds objects of any size (LMCache's, per registration) by bytes; chunk_bytes is the
    # native protocol's chunk (its clients' largest block, L2 records, prefetch landings) and the slab unit
    l1_size_bytes: int = 256 * 2**20
    chunk_bytes: int = 64 * 2**10
    chunk_size_tokens: int = 256
    l1_watermark: float = 0.8
    eviction_interval_s: float = 1.0
    prefetch_job_ttl_s: float = 60.0  # an unretrieved prefetch releases its read locks after this
    # event rings
    ring_capacity_cells: int = 1 << 18
    intern_capacity: int = 4096
    # telemetry
    disable_metrics: bool = False
    disable_logging: bool = False
    enable_tracing: bool = False
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9090
    no_http: bool = False  # no /metrics, /healthz, /ready: OTLP push only
    otlp_endpoint: str = ""
    otlp_protocol: str = "grpc"
    otlp_interval_s: float = 10.0
    metrics_sample_rate: float = 0.01
    cache_salt_cap: int = 1000
    metric_series_cap: int = 1500  # attribute sets per metric before cache_salt/model_name read __overflow__
    # miss-ratio curves (docs/MRC.md): the chunk keys sampled (SHARDS), the keys tracked per curve (the rate
    # is lowered below mrc_sample_rate to stay within it), and the half-life of the curves' access counts
    mrc_sample_rate: float = 0.01
    mrc_exact_chunks: int = 4  # a lookup's first chunks (hot keys: system prompts) are all tracked
    mrc_max_keys: int = 8192
    mrc_half_life_s: float = 3600.0
    # the telemetry process lowers its own scheduling priority by this nice increment at start (0: as the
    # cache processes), so that on a contended machine it yields the CPU to the data path and lags instead
    telemetry_nice: int = 0
    # logging
    log_level: str = "info"
    log_file: str = ""
    # demo
    demo: bool = False
    demo_seconds: float = 0.0
    duration_s: float = 0.0
    demo_tally_file: str = ""
    # where cache processes send events: "ring" (the product), or for benchmarks only "none" (telemetry
    # off) and "inprocess" (LMCache's design, mpcache.bench.reference: a bus and OTel calls in the cache process)
    event_sink: str = "ring"
    # LMCache MP-protocol front end: cache process i listens on tcp://lmcache_host:(lmcache_port + i)
    # when lmcache_port > 0, and/or on ipc://<runtime_dir>/lmcache<i>.ipc with lmcache_ipc
    lmcache_port: int = 0
    lmcache_host: str = "127.0.0.1"
    lmcache_ipc: bool = False
    lmcache_allow_uids: list = field(default_factory=list)  # besides the service's own uid
    lmcache_allow_remote: bool = False  # a non-loopback lmcache_host: remote peers accepted unchecked
    lmcache_allow_clear: bool = False  # clear over the LMCache protocol empties L1 (else refused)
    lmcache_max_tokens: int = 1 << 20  # the longest token list a request may carry; derives the frame cap
    # L2 adapters, in --l2 order (the position is adapter_index); each a dict with at least "type"
    l2: list = field(default_factory=list)
    # the key fs and redis tiers MAC their records with (64 hex digits; "" with no such tier), never logged;
    # and where it came from ("--l2-secret-file PATH", "fs PATH", "per-run"), which may be
    l2_secret: str = field(default="", repr=False)
    l2_secret_source: str = ""

    def __post_init__(self) -> None:
        checks = [
            (self.workers >= 1, "--workers: expected an integer >= 1"),
            (bool(_INSTANCE_ID_RE.fullmatch(self.instance_id)),  # its first 8 characters name shared memory
             "--instance-id: expected 1 to 128 characters from A-Z a-z 0-9 . _ : -"),
            (0 < self.l1_watermark <= 1, "--l1-watermark: expected a number in (0, 1]"),
            (self.chunk_bytes > 0, "--chunk-bytes: expected a positive size"),
            (self.l1_size_bytes >= self.chunk_bytes, "--l1-size: must hold at least one chunk (--chunk-bytes)"),
            (self.chunk_size_tokens > 0, "--chunk-size: expected a positive number of tokens"),
            (self.eviction_interval_s > 0, "--eviction-interval: expected seconds > 0"),
            (0 < self.prefetch_job_ttl_s < float("inf"), "--prefetch-job-ttl: expected seconds > 0"),
            (self.ring_capacity_cells >= 1024 and not self.ring_capacity_cells & (self.ring_capacity_cells - 1),
             "--ring-cells: expected a power of two >= 1024"),
            (0 < self.metrics_sample_rate <= 1, "--metrics-sample-rate: expected a number in (0, 1]"),
            (0 <= self.mrc_sample_rate <= 1, "--mrc-sample-rate: expected a number in [0, 1] (0: no curves)"),
            (0 <= self.mrc_exact_chunks <= len(MRC_HEAD_FIELDS),
             f"--mrc-exact-chunks: expected an integer 0..{len(MRC_HEAD_FIELDS)}"),
            (64 <= self.mrc_max_keys <= 1 << 22, "--mrc-max-keys: expected an integer 64..4194304"),
            (0 <= self.mrc_half_life_s < float("inf"), "--mrc-half-life: expected seconds >= 0 (0: no decay)"),
            (0 <= self.prometheus_port <= 65535, "--prometheus-port: expected a port number 0..65535"),
            (self.lmcache_port == 0 or 1 <= self.lmcache_port <= 65535 - self.workers + 1,
             "--lmcache-port: expected a port number so that port + workers - 1 is at most 65535"),
            (1 << 8 <= self.lmcache_max_tokens <= 1 << 26, "--lmcache-max-tokens: expected 256..67108864"),
            (all(type(uid) is int and 0 <= uid < 2**32 - 1 for uid in self.lmcache_allow_uids),
             "--lmcache-allow-uid: expected a uid 0..4294967294"),
            (self.otlp_protocol in ("grpc", "http", "http/protobuf"),
             "--otlp-protocol: expected grpc, http/protobuf or http"),
            (self.otlp_interval_s > 0, "--otlp-interval: expected seconds > 0"),
            (self.event_sink in ("ring", "none", "inprocess"), "--event-sink: expected ring, none or inprocess"),
            (self.cache_salt_cap >= 1, "--cache-salt-cap: expected an integer >= 1"),
            (self.metric_series_cap >= 1, "--metric-series-cap: expected an integer >= 1"),
            (0 <= self.telemetry_nice <= 19, "--telemetry-nice: expected an integer 0..19"),
            (self.log_level in ("debug", "info", "warning", "error"),
             "--log-level: expected debug, info, warning or error"),
            (not self.enable_tracing or bool(self.otlp_endpoint),
             "--enable-tracing: needs --otlp-endpoint (spans are exported over OTLP)"),
            (self.demo_seconds >= 0 and self.duration_s >= 0, "--duration/--demo-seconds: expected seconds >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.lmcache_port and not self.lmcache_allow_remote and not _is_loopback(self.lmcache_host):
            raise ConfigError(
                f"--lmcache-host: {self.lmcache_host} is not a loopback address; LMCache clients share this host's "
                "memory (engine_driven transfer maps the L1 pool), so they run here: use 127.0.0.1, or pass "
                "--lmcache-allow-remote to accept peers on other hosts without any identity check")
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

    def socket_path(self, worker: int) -> str:
        return os.path.join(self.runtime_dir, f"cache{worker}.sock")

    def lmcache_urls(self, worker: int) -> list[str]:
        """Where cache process ``worker`` serves LMCache's MP protocol (empty: it does not)."""
        urls = []
        if self.lmcache_port:
            host = f"[{self.lmcache_host}]" if ":" in self.lmcache_host else self.lmcache_host
            urls.append(f"tcp://{host}:{self.lmcache_port + worker}")
        if self.lmcache_ipc:
            urls.append(f"ipc://{os.path.join(self.runtime_dir, f'lmcache{worker}.ipc')}")
        return urls

    def all_segment_names(self) -> list[str]:
        names = [self.gauge_board_name()]
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
