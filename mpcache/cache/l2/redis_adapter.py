"""An L2 adapter on a Redis server, the tier several hosts can share: every operation is one Lua script, so
data, index and capacity move together; MAC'd records, AUTH/ACL and TLS from the URL and spec, short
timeouts.  A single server, not Redis Cluster.
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from mpcache.cache.l2.base import (
    L2LookupError,
    LoadResult,
    PooledAdapter,
    StoreResult,
    Usage,
    byte_view,
    check_mac_key,
    check_record,
    decode_name,
    encode_name,
    key_digest,
    record_header,
)
from mpcache.cache.l2.failures import FailureCounts
from mpcache.contract.keys import ChunkKey

# KEYS: lru, size, name, stats, data key.  ARGV: capacity, data prefix, digest, name, size, record.
# Reply: {status (0 stored, 1 present, 2 no room), used, count, clock, evicted names...}
_STORE = """
local clock = redis.call('HINCRBY', KEYS[4], 'clock', 1)
local used = tonumber(redis.call('HGET', KEYS[4], 'used') or '0')
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  redis.call('ZADD', KEYS[1], clock, ARGV[3])
  return {1, used, redis.call('ZCARD', KEYS[1]), clock}
end
local capacity = tonumber(ARGV[1])
local size = tonumber(ARGV[5])
if size > capacity then
  return {2, used, redis.call('ZCARD', KEYS[1]), clock}
end
local reply = {0, 0, 0, clock}
while used + size > capacity do
  local victim = redis.call('ZPOPMIN', KEYS[1])
  if #victim == 0 then
    used = 0
    break
  end
  local digest = victim[1]
  used = used - tonumber(redis.call('HGET', KEYS[2], digest) or '0')
  reply[#reply + 1] = redis.call('HGET', KEYS[3], digest) or ''
  redis.call('HDEL', KEYS[2], digest)
  redis.call('HDEL', KEYS[3], digest)
  redis.call('DEL', ARGV[2] .. digest)
end
redis.call('SET', KEYS[5], ARGV[6])
redis.call('ZADD', KEYS[1], clock, ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], size)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
used = used + size
redis.call('HSET', KEYS[4], 'used', used)
reply[2] = used
reply[3] = redis.call('ZCARD', KEYS[1])
return reply
"""

# KEYS: lru, stats.  ARGV: digests.  Reply: {used, count, clock, 1/0 per digest}.
_LOOKUP = """
local clock = redis.call('HINCRBY', KEYS[2], 'clock', 1)
local reply = {0, 0, 0}
for i = 1, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    clock = redis.call('HINCRBY', KEYS[2], 'clock', 1)
    redis.call('ZADD', KEYS[1], clock, ARGV[i])
    reply[i + 3] = 1
  else
    reply[i + 3] = 0
  end
end
reply[1] = tonumber(redis.call('HGET', KEYS[2], 'used') or '0')
reply[2] = redis.call('ZCARD', KEYS[1])
reply[3] = clock
return reply
"""

# KEYS: lru, size, name, stats, data keys...  ARGV: digests.
# Reply: {used, count, clock, record or nil per key}.  A key whose record is gone (the server
# evicted or someone deleted it) leaves the index; one that has its record is touched.
_LOAD = """
local clock = redis.call('HINCRBY', KEYS[4], 'clock', 1)
local used = tonumber(redis.call('HGET', KEYS[4], 'used') or '0')
local reply = {0, 0, 0}
for i = 1, #ARGV do
  local record = false
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    record = redis.call('GET', KEYS[i + 4])
    if record then
      clock = redis.call('HINCRBY', KEYS[4], 'clock', 1)
      redis.call('ZADD', KEYS[1], clock, ARGV[i])
    else
      redis.call('ZREM', KEYS[1], ARGV[i])
      used = used - tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
      redis.call('HDEL', KEYS[2], ARGV[i])
      redis.call('HDEL', KEYS[3], ARGV[i])
      redis.call('HSET', KEYS[4], 'used', used)
    end
  end
  reply[i + 3] = record
end
reply[1] = used
reply[2] = redis.call('ZCARD', KEYS[1])
reply[3] = clock
return reply
"""

# KEYS: lru, size, name, stats.  ARGV: data prefix, digests...  Reply: {used, count, clock, removed}.
_DELETE = """
local clock = redis.call('HINCRBY', KEYS[4], 'clock', 1)
local used = tonumber(redis.call('HGET', KEYS[4], 'used') or '0')
local removed = 0
for i = 2, #ARGV do
  local digest = ARGV[i]
  if redis.call('ZREM', KEYS[1], digest) == 1 then
    used = used - tonumber(redis.call('HGET', KEYS[2], digest) or '0')
    removed = removed + 1
  end
  redis.call('HDEL', KEYS[2], digest)
  redis.call('HDEL', KEYS[3], digest)
  redis.call('DEL', ARGV[1] .. digest)
end
local count = redis.call('ZCARD', KEYS[1])
if count == 0 or used < 0 then
  used = 0
end
redis.call('HSET', KEYS[4], 'used', used)
return {used, count, clock, removed}
"""

_USAGE = """
local clock = redis.call('HINCRBY', KEYS[2], 'clock', 1)
return {tonumber(redis.call('HGET', KEYS[2], 'used') or '0'), redis.call('ZCARD', KEYS[1]), clock}
"""


class RedisL2Adapter(PooledAdapter):
    """Chunk records on a Redis server under ``key_prefix``, LRU-evicted at ``capacity_bytes``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        mac_key: bytes,
        key_prefix: str = "mpcache:l2:",
        threads: int = 4,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
        retries: int = 1,
        down_for_s: float = 1.0,
        password: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.key_prefix = key_prefix
        self.failures = FailureCounts()
        self._mac_key = check_mac_key(mac_key)
        self._down_for_s = down_for_s
        self._down_until = 0.0  # time.monotonic() before which the server is taken as down
        options: dict[str, Any] = {}
        if password is not None:
            options["password"] = password
        if url.startswith("rediss://"):
            options.update(ssl_cert_reqs="required", ssl_check_hostname=True)
            for name, value in (("ssl_ca_certs", tls_ca_file), ("ssl_certfile", tls_cert_file),
                                ("ssl_keyfile", tls_key_file)):
                if value:
                    options[name] = value
        elif tls_ca_file or tls_cert_file or tls_key_file:
            raise ValueError("tls_ca_file, tls_cert_file and tls_key_file need a rediss:// URL")
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            # a refused or dropped connection is retried (a restarted server); a timeout is not (it would double)
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries, supported_errors=(redis.ConnectionError,)),
            max_connections=threads + 1,
            **options,
        )
        self._keys = [key_prefix + suffix for suffix in ("lru", "size", "name", "stats")]
        self._data_prefix = key_prefix + "c:"
        self._store_script = self._client.register_script(_STORE)
        self._lookup_script = self._client.register_script(_LOOKUP)
        self._load_script = self._client.register_script(_LOAD)
        self._delete_script = self._client.register_script(_DELETE)
        self._usage_script = self._client.register_script(_USAGE)
        self._usage_lock = threading.Lock()
        self._usage = Usage(0, capacity_bytes, 0)
        self._usage_clock = -1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-redis")
        self._pool.submit(self.refresh_usage)

    # -- the interface -------------------------------------------------------------------------

    def get_usage(self) -> Usage:
        return self._usage

    def refresh_usage(self) -> Usage:
        """Ask the server for the tier's usage now (blocking; other adapters' writes included)."""
        if self._is_down("usage_error"):
            return self._usage
        try:
            used, count, clock = self._usage_script(keys=[self._keys[0], self._keys[3]])
        except redis.RedisError as exc:
            self._failed("usage_error", exc)
            return self._usage
        self._note_usage(used, count, clock)
        return self._usage

    def close(self) -> None:
        super().close()
        self._client.connection_pool.disconnect()

    # -- worker side ---------------------------------------------------------------------------

    def _is_down(self, kind: str, count: int = 1) -> bool:
        """True (and ``count`` failures of ``kind`` noted) while the server is taken as down."""
        if time.monotonic() >= self._down_until:
            return False
        self.failures.note(kind, count, "server taken as down after a connection error or timeout; not asked")
        return True

    def _failed(self, kind: str, exc: Exception, count: int = 1) -> None:
        """Count a failed operation; a connection error or timeout takes the server as down for a while."""
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            self._down_until = time.monotonic() + self._down_for_s
        self.failures.note(kind, count, f"{type(exc).__name__}: {exc}")

    def _note_usage(self, used: int, count: int, clock: int) -> None:
        with self._usage_lock:
            if clock > self._usage_clock:
                self._usage_clock = clock
                self._usage = Usage(int(used), self.capacity_bytes, int(count))

    def _store(self, items: list[tuple[ChunkKey, memoryview]]) -> StoreResult:
        stored: list[ChunkKey] = []
        skipped: list[ChunkKey] = []
        failed: list[ChunkKey] = []
        evicted: list[ChunkKey] = []
        written = 0
        calls = []
        if self._is_down("store_error", len(items)):
            return StoreResult([], [], [key for key, _ in items], 0, [])
        pipe = self._client.pipeline(transaction=False)
        for key, data in items:
            try:
                record = record_header(key, data, self._mac_key) + data
            except (ValueError, OverflowError, struct.error):  # a name or hash a record cannot hold
                failed.append(key)
                continue
            digest = key_digest(key)
            self._store_script(
                keys=[*self._keys, self._data_prefix + digest],
                args=[self.capacity_bytes, self._data_prefix, digest, encode_name(key), len(data), record],
                client=pipe,
            )
            calls.append((key, len(data)))
        if calls:
            try:
                replies = pipe.execute(raise_on_error=False)
            except redis.RedisError as exc:
                self._failed("store_error", exc, len(calls))
                replies = [None] * len(calls)
            finally:
                pipe.reset()
            for (key, size), reply in zip(calls, replies):
                if not isinstance(reply, list):  # an error reply, or the connection failed
                    if isinstance(reply, Exception):
                        self._failed("store_error", reply)
                    failed.append(key)
                    continue
                status, used, count, clock, *victims = reply
                self._note_usage(used, count, clock)
                evicted.extend(decode_name(name) for name in victims if name)
                if status == 0:
                    stored.append(key)
                    written += size
                elif status == 1:
                    skipped.append(key)
                else:
                    failed.append(key)
        return StoreResult(stored, skipped, failed, written, evicted)

    def _lookup(self, keys: list[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        if self._is_down("lookup_error", len(keys)):
            raise L2LookupError("redis taken as down after a connection error or timeout")
        try:
            used, count, clock, *flags = self._lookup_script(
                keys=[self._keys[0], self._keys[3]], args=[key_digest(key) for key in keys])
        except redis.RedisError as exc:
            self._failed("lookup_error", exc, len(keys))
            raise L2LookupError(f"{type(exc).__name__}: {exc}") from None
        self._note_usage(used, count, clock)
        return [flag == 1 for flag in flags]

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult:
        result = LoadResult()
        if not keys:
            return result
        if self._is_down("load_error", len(keys)):
            return LoadResult([], list(keys), [], list(keys))
        digests = [key_digest(key) for key in keys]
        try:
            used, count, clock, *records = self._load_script(
                keys=[*self._keys, *(self._data_prefix + digest for digest in digests)],
                args=digests)
        except redis.RedisError as exc:
            self._failed("load_error", exc, len(keys))
            return LoadResult([], list(keys), [], list(keys))
        self._note_usage(used, count, clock)
        records += [None] * (len(keys) - len(records))  # trailing nils may be dropped from the reply
        bad = []
        for key, digest, destination, record in zip(keys, digests, destinations, records):
            if record is None:
                result.failed.append(key)
                continue
            checked = check_record(record, self._mac_key)
            if checked.status != "ok" or checked.key != key or checked.payload is None:
                # corrupt, or written without our key (a forgery): never returned; drop it so nobody tries again
                reason = {"bad_mac": "MAC mismatch", "malformed": "malformed record"}.get(checked.status,
                                                                                         "a record of another chunk")
                self.failures.note("integrity", detail=f"{reason} at {self._data_prefix}{digest}")
                bad.append(digest)
                result.failed.append(key)
                result.rejected.append(key)
                continue
            payload = checked.payload
            try:
                target = byte_view(destination)
                if len(target) != len(payload):
                    result.failed.append(key)
                    continue
                target[:] = payload
            except (TypeError, ValueError):  # read-only or non-contiguous destination
                result.failed.append(key)
                continue
            result.loaded.append(key)
        if bad:
            self._delete_digests(bad)
        return result

    def _delete(self, keys: list[ChunkKey]) -> int:
        return self._delete_digests([key_digest(key) for key in keys]) if keys else 0

    def _delete_digests(self, digests: list[str]) -> int:
        if self._is_down("delete_error", len(digests)):
            return 0
        try:
            used, count, clock, removed = self._delete_script(keys=self._keys, args=[self._data_prefix, *digests])
        except redis.RedisError as exc:
            self._failed("delete_error", exc, len(digests))
            return 0
        self._note_usage(used, count, clock)
        return int(removed)
