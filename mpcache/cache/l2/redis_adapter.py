"""An L2 adapter on a Redis server: the tier several cache hosts can share.

Values are chunk records (header, name, payload: see :mod:`mpcache.cache.l2.base`),
so a load checks the checksum and the key just as fs does.  Everything under
``key_prefix`` (default ``mpcache:l2:``) belongs to the tier; adapters with the
same server and prefix share it, whichever process or host they run in:

=========================== ==== =========================================================
name                        type holds
=========================== ==== =========================================================
``<prefix>c:<digest>``      str  the chunk record (``digest``: 32 hex of blake2b(key))
``<prefix>lru``             zset digest → access clock (lowest = least recently used)
``<prefix>size``            hash digest → payload bytes
``<prefix>name``            hash digest → encoded key (to report evicted keys)
``<prefix>stats``           hash ``used`` (payload bytes), ``clock`` (access counter)
=========================== ==== =========================================================

Each store, lookup, load and delete runs as a Lua script, so the index, the
byte counter and the data move together atomically and capacity holds across
processes (a store evicts least-recently-used chunks of *any* adapter sharing
the prefix).  Stores pipeline one script call per chunk.  The scripts name data
keys they derive from the prefix, so this targets a single server, not Redis
Cluster.

Connection errors, timeouts and server errors make keys ``failed`` (lookups
report misses, deletes 0); nothing raises out of an operation.  ``get_usage``
answers from the latest figures any of this adapter's scripts returned (each
carries the server's clock, so a late reply never overwrites a newer one); a
background refresh at start-up seeds it.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from mpcache.cache.l2.base import (
    LoadResult,
    PooledAdapter,
    StoreResult,
    Usage,
    byte_view,
    decode_name,
    decode_record,
    encode_name,
    key_digest,
    record_header,
)
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
        key_prefix: str = "mpcache:l2:",
        threads: int = 4,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retries: int = 1,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.key_prefix = key_prefix
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries),
            max_connections=threads + 1,
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
        try:
            used, count, clock = self._usage_script(keys=[self._keys[0], self._keys[3]])
        except redis.RedisError:
            return self._usage
        self._note_usage(used, count, clock)
        return self._usage

    def close(self) -> None:
        super().close()
        self._client.connection_pool.disconnect()

    # -- worker side ---------------------------------------------------------------------------

    def _note_usage(self, used: int, count: int, clock: int) -> None:
        with self._usage_lock:
            if clock > self._usage_clock:
                self._usage_clock = clock
                self._usage = Usage(int(used), self.capacity_bytes, int(count))

    def _store(self, items: list[tuple[ChunkKey, memoryview]]) -> StoreResult:
        evicted: list[ChunkKey]
        stored, skipped, failed, evicted = [], [], [], []
        written = 0
        calls = []
        pipe = self._client.pipeline(transaction=False)
        for key, data in items:
            try:
                record = record_header(key, data) + data
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
            except redis.RedisError:
                replies = [None] * len(calls)
            finally:
                pipe.reset()
            for (key, size), reply in zip(calls, replies):
                if not isinstance(reply, list):  # an error reply, or the connection failed
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
        try:
            used, count, clock, *flags = self._lookup_script(
                keys=[self._keys[0], self._keys[3]], args=[key_digest(key) for key in keys])
        except redis.RedisError:
            return [False] * len(keys)
        self._note_usage(used, count, clock)
        return [flag == 1 for flag in flags]

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult:
        result = LoadResult()
        if not keys:
            return result
        digests = [key_digest(key) for key in keys]
        try:
            used, count, clock, *records = self._load_script(
                keys=[*self._keys, *(self._data_prefix + digest for digest in digests)],
                args=digests)
        except redis.RedisError:
            result.failed.extend(keys)
            return result
        self._note_usage(used, count, clock)
        records += [None] * (len(keys) - len(records))  # trailing nils may be dropped from the reply
        bad = []
        for key, digest, destination, record in zip(keys, digests, destinations, records):
            decoded = decode_record(record) if record is not None else None
            if decoded is None or decoded[0] != key:
                if record is not None:  # corrupt: drop it so nobody tries again
                    bad.append(digest)
                result.failed.append(key)
                continue
            payload = decoded[1]
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
        try:
            used, count, clock, removed = self._delete_script(keys=self._keys, args=[self._data_prefix, *digests])
        except redis.RedisError:
            return 0
        self._note_usage(used, count, clock)
        return int(removed)
