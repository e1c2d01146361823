"""The repeatable ``--l2`` flag: one JSON object per adapter (fs, mock or redis), checked once at start-up;
a problem is one :class:`~mpcache.errors.ConfigError` naming ``--l2`` and the accepted form.
"""

from __future__ import annotations

import json
import math
from urllib.parse import urlsplit

from mpcache.cache.l2.base import L2Adapter
from mpcache.config import L2_GB
from mpcache.errors import ConfigError

SHARDS, CLUSTER_SHARDS, MAX_SHARDS = 1, 16, 1024  # a redis tier's index shards: default, default on a cluster, most

ACCEPTED = (
    'a JSON object such as {"type": "fs", "path": "/var/cache/mpcache", "capacity_gb": 4}; '
    "fs {path, capacity_gb, threads?}, "
    "mock {capacity_gb, latency_ms?, bandwidth_gbps?, failure_rate? in [0,1], seed?}, "
    "redis {url: redis[s]://[user[:password]@]host:port/db, capacity_gb, cluster? (the url a seed node, db 0), "
    f"shards? (1..{MAX_SHARDS}; default {SHARDS}, {CLUSTER_SHARDS} with cluster), key_prefix?, threads?, "
    "socket_timeout_s?, connect_timeout_s?, password_file?, tls_ca_file?, tls_cert_file?, tls_key_file?}"
)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _redis_url(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    db = parts.path.lstrip("/")
    return (parts.scheme in ("redis", "rediss") and bool(parts.hostname) and (db == "" or db.isdigit())
            and not parts.query and not parts.fragment)


# key -> (check, what it must be)
_CAPACITY = (lambda v: _number(v) and 0 < v * L2_GB < 2**63, "a number > 0 whose bytes (GB = 10**9) are below 2**63")
_THREADS = (lambda v: _integer(v) and v >= 1, "an integer >= 1")
_SECONDS = (lambda v: _number(v) and v > 0, "a number of seconds > 0")
_PATH = (lambda v: isinstance(v, str) and v != "", "a non-empty path")
_KEYS: dict[str, dict[str, tuple]] = {
    "fs": {
        "path": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        "capacity_gb": _CAPACITY,
        "threads": _THREADS,
    },
    "mock": {
        "capacity_gb": _CAPACITY,
        "latency_ms": (lambda v: _number(v) and v >= 0, "a number >= 0"),
        "bandwidth_gbps": (lambda v: _number(v) and v > 0, "a number > 0"),
        "failure_rate": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
        "seed": (_integer, "an integer"),
    },
    "redis": {
        "url": (_redis_url, "a URL redis[s]://[user[:password]@]host:port/db without a query"),
        "capacity_gb": _CAPACITY,
        "key_prefix": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
        "cluster": (lambda v: isinstance(v, bool), "true or false"),
        "shards": (lambda v: _integer(v) and 1 <= v <= MAX_SHARDS, f"an integer in 1..{MAX_SHARDS}"),
        "threads": _THREADS,
        "socket_timeout_s": _SECONDS,
        "connect_timeout_s": _SECONDS,
        "password_file": _PATH,
        "tls_ca_file": _PATH,
        "tls_cert_file": _PATH,
        "tls_key_file": _PATH,
    },
}
_REQUIRED = {"fs": ("path", "capacity_gb"), "mock": ("capacity_gb",), "redis": ("url", "capacity_gb")}


def _fail(problem: str) -> ConfigError:
    return ConfigError(f"--l2: {problem}; expected {ACCEPTED}")


def parse_l2_spec(text: str) -> dict:
    """One ``--l2`` value → its checked spec (a plain dict, as given)."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError) as error:
        raise _fail(f"not valid JSON ({str(error).splitlines()[0]})") from None
    check_l2_spec(spec)
    return spec


def check_l2_spec(spec) -> None:
    """Raise :class:`ConfigError` unless ``spec`` is an acceptable adapter spec."""
    if not isinstance(spec, dict):
        raise _fail(f"got a JSON {type(spec).__name__}, not an object")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise _fail(f"unknown or missing type {kind!r}")
    allowed = _KEYS[kind]
    unknown = sorted(set(spec) - set(allowed) - {"type"})
    if unknown:
        raise _fail(f"type {kind!r} has no key(s) {', '.join(map(repr, unknown))}")
    missing = [key for key in _REQUIRED[kind] if key not in spec]
    if missing:
        raise _fail(f"type {kind!r} needs {', '.join(map(repr, missing))}")
    for key, value in spec.items():
        if key == "type":
            continue
        check, wanted = allowed[key]
        if not check(value):
            shown = "(hidden)" if key == "url" and isinstance(value, str) and "@" in value else repr(value)
            raise _fail(f"{kind} {key!r} must be {wanted}, got {shown}")
    if kind == "redis":
        tls = [key for key in ("tls_ca_file", "tls_cert_file", "tls_key_file") if key in spec]
        if tls and not spec["url"].startswith("rediss://"):
            raise _fail(f"redis {', '.join(map(repr, tls))} need a rediss:// URL")
        if ("tls_cert_file" in spec) != ("tls_key_file" in spec):
            raise _fail("redis 'tls_cert_file' and 'tls_key_file' go together")
        if spec.get("cluster"):
            if urlsplit(spec["url"]).path.lstrip("/") not in ("", "0"):
                raise _fail("a redis cluster has database 0 only: give the seed's url without /db or with /0")
            if "{" in spec.get("key_prefix", "") or "}" in spec.get("key_prefix", ""):
                raise _fail("a redis cluster's 'key_prefix' must not hold '{' or '}' (the shards' hash tags)")


def build_adapter(spec: dict, chunk_bytes: int, mac_key: bytes | None = None, writer: str = "") -> L2Adapter:
    """The adapter ``spec`` describes; its capacity (each index shard's, for redis) must hold at least one
    chunk.  fs and redis tiers need ``mac_key``, the deployment's L2 record key (``Config.l2_secret``); a redis
    tier keeps ``writer`` (the service instance id) with each record this process stores."""
    check_l2_spec(spec)
    kind = spec["type"]
    capacity = int(spec["capacity_gb"] * L2_GB)
    if capacity < chunk_bytes:
        raise _fail(f"{kind} capacity_gb {spec['capacity_gb']!r} is smaller than one chunk ({chunk_bytes} bytes)")
    shards = spec.get("shards", CLUSTER_SHARDS if spec.get("cluster") else SHARDS) if kind == "redis" else 1
    if capacity // shards < chunk_bytes:
        raise _fail(f"redis capacity_gb {spec['capacity_gb']!r} split over {shards} shards holds less than one "
                    f"chunk ({chunk_bytes} bytes) per shard")
    if kind == "mock":
        from mpcache.cache.l2.mock import MockL2Adapter

        return MockL2Adapter(
            capacity,
            latency_s=spec.get("latency_ms", 0) / 1000.0,
            bandwidth_bytes_per_s=spec.get("bandwidth_gbps", 0) * L2_GB,
            failure_rate=float(spec.get("failure_rate", 0.0)),
            seed=spec.get("seed", 0),
        )
    if mac_key is None:
        raise ConfigError(f"--l2: a {kind} tier needs the deployment's L2 key, and none was given "
                          "(the supervisor resolves it: see --l2-secret-file)")
    if kind == "fs":
        from mpcache.cache.l2.fs import FsL2Adapter

        return FsL2Adapter(spec["path"], capacity, mac_key=mac_key, threads=spec.get("threads", 4))
    from mpcache.cache.l2.redis_adapter import (
        RedisL2Adapter,  # imports redis-py only when used
    )
    from mpcache.cache.l2.trust import read_private_file

    password = None
    if "password_file" in spec:
        password = read_private_file(spec["password_file"], "--l2: redis password_file", min_bytes=1).decode()
    given = {name: spec[name] for name in ("key_prefix", "cluster", "threads", "socket_timeout_s", "connect_timeout_s",
                                           "tls_ca_file", "tls_cert_file", "tls_key_file") if name in spec}
    return RedisL2Adapter(spec["url"], capacity, mac_key=mac_key, shards=shards, writer=writer, password=password,
                          **given)  # the fields not given take the adapter's defaults
