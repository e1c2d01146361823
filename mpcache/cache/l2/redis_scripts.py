"""The redis tier's Lua scripts and where an index shard keeps its keys.

Each script touches the keys of one index shard only: its LRU zset, its size, name and writer hashes, its
stats hash and its chunks' data keys.  On Redis Cluster the shard's keys share one hash tag, so they live in
one hash slot and a script runs on one node; data, index and capacity of a shard move together.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

# What every script reads from the index checked first: a field someone overwrote with what is not a number (the
# index is writable by whoever can write the server) is repaired, never arithmetic on nil that fails the shard.
# ``tick``: the shard's clock, advanced (one that is not an integer starts again at 0).  ``number``: a size or
# ``used``, 0 if not a number.  ``used_of``: the shard's bytes, recomputed from its chunks' sizes when missing,
# not a number or negative.
_CHECKED = """
local function tick(stats)
  local clock = redis.call('HGET', stats, 'clock')
  if clock and not string.match(clock, '^%-?%d+$') then
    redis.call('HSET', stats, 'clock', 0)
  end
  return redis.call('HINCRBY', stats, 'clock', 1)
end
local function number(value)
  return tonumber(value) or 0
end
local function used_of(stats, sizes)
  local used = tonumber(redis.call('HGET', stats, 'used'))
  if used == nil or used < 0 then
    used = 0
    for _, size in ipairs(redis.call('HVALS', sizes)) do
      used = used + number(size)
    end
    redis.call('HSET', stats, 'used', used)
  end
  return used
end
"""

# KEYS: lru, size, name, stats, writer, data key.  ARGV: capacity, data prefix, digest, name, size, record, writer.
# Reply: {status (0 stored, 1 present, 2 no room), used, count, clock, evicted names...}
_STORE = _CHECKED + """
local clock = tick(KEYS[4])
local used = used_of(KEYS[4], KEYS[2])
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
  used = used - number(redis.call('HGET', KEYS[2], digest))
  reply[#reply + 1] = redis.call('HGET', KEYS[3], digest) or ''
  redis.call('HDEL', KEYS[2], digest)
  redis.call('HDEL', KEYS[3], digest)
  redis.call('HDEL', KEYS[5], digest)
  redis.call('DEL', ARGV[2] .. digest)
end
redis.call('SET', KEYS[6], ARGV[6])
redis.call('ZADD', KEYS[1], clock, ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], size)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[5], ARGV[3], ARGV[7])
used = used + size
redis.call('HSET', KEYS[4], 'used', used)
reply[2] = used
reply[3] = redis.call('ZCARD', KEYS[1])
return reply
"""

# KEYS: lru, stats.  ARGV: digests.  Reply: {used, count, clock, 1/0 per digest}.
_LOOKUP = _CHECKED + """
local clock = tick(KEYS[2])
local reply = {0, 0, 0}
for i = 1, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    clock = tick(KEYS[2])
    redis.call('ZADD', KEYS[1], clock, ARGV[i])
    reply[i + 3] = 1
  else
    reply[i + 3] = 0
  end
end
reply[1] = number(redis.call('HGET', KEYS[2], 'used'))
reply[2] = redis.call('ZCARD', KEYS[1])
reply[3] = clock
return reply
"""

# KEYS: lru, size, name, stats, writer, data keys...  ARGV: digests.
# Reply: {used, count, clock, then per key: record or nil, writer or nil}.  A key whose record is gone (the
# server evicted or someone deleted it) leaves the index; one that has its record is touched.
_LOAD = _CHECKED + """
local clock = tick(KEYS[4])
local used = used_of(KEYS[4], KEYS[2])
local reply = {0, 0, 0}
for i = 1, #ARGV do
  local record = false
  local writer = false
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    record = redis.call('GET', KEYS[i + 5])
    if record then
      clock = tick(KEYS[4])
      redis.call('ZADD', KEYS[1], clock, ARGV[i])
      writer = redis.call('HGET', KEYS[5], ARGV[i])
    else
      redis.call('ZREM', KEYS[1], ARGV[i])
      used = used - number(redis.call('HGET', KEYS[2], ARGV[i]))
      redis.call('HDEL', KEYS[2], ARGV[i])
      redis.call('HDEL', KEYS[3], ARGV[i])
      redis.call('HDEL', KEYS[5], ARGV[i])
      redis.call('HSET', KEYS[4], 'used', used)
    end
  end
  reply[2 * i + 2] = record
  reply[2 * i + 3] = writer
end
reply[1] = used
reply[2] = redis.call('ZCARD', KEYS[1])
reply[3] = clock
return reply
"""

# KEYS: lru, size, name, stats, writer.  ARGV: data prefix, digests...  Reply: {used, count, clock, removed}.
_DELETE = _CHECKED + """
local clock = tick(KEYS[4])
local used = used_of(KEYS[4], KEYS[2])
local removed = 0
for i = 2, #ARGV do
  local digest = ARGV[i]
  if redis.call('ZREM', KEYS[1], digest) == 1 then
    used = used - number(redis.call('HGET', KEYS[2], digest))
    removed = removed + 1
  end
  redis.call('HDEL', KEYS[2], digest)
  redis.call('HDEL', KEYS[3], digest)
  redis.call('HDEL', KEYS[5], digest)
  redis.call('DEL', ARGV[1] .. digest)
end
local count = redis.call('ZCARD', KEYS[1])
if count == 0 or used < 0 then
  used = 0
end
redis.call('HSET', KEYS[4], 'used', used)
return {used, count, clock, removed}
"""

# KEYS: lru, stats.  Reply: {used, count, clock}.
_USAGE = _CHECKED + """
local clock = tick(KEYS[2])
return {number(redis.call('HGET', KEYS[2], 'used')), redis.call('ZCARD', KEYS[1]), clock}
"""


class Script(NamedTuple):
    """A Lua script and its SHA1 (what EVALSHA names it by)."""

    text: str
    sha: str


def _script(text: str) -> Script:
    return Script(text, hashlib.sha1(text.encode("utf-8")).hexdigest())  # Redis names scripts by SHA1


STORE, LOOKUP, LOAD, DELETE, USAGE = (_script(text) for text in (_STORE, _LOOKUP, _LOAD, _DELETE, _USAGE))


class Shard(NamedTuple):
    """The keys of one index shard: ``lru``, ``size``, ``name``, ``stats``, ``writer``, and its data prefix."""

    lru: str
    size: str
    name: str
    stats: str
    writer: str
    data_prefix: str

    @property
    def index_keys(self) -> list[str]:
        """The five index keys, in the order the scripts take them."""
        return [self.lru, self.size, self.name, self.stats, self.writer]


def shard_layout(key_prefix: str, shards: int) -> list[Shard]:
    """Where each of ``shards`` index shards keeps its keys.  One unsharded index keeps the single server's
    names (``<prefix>lru``, ``<prefix>c:<digest>``); shard ``i`` of several puts the hash tag ``{i}`` after
    the prefix (``<prefix>{i}lru``, ``<prefix>{i}c:<digest>``), so all its keys share one cluster hash slot."""
    if shards == 1:
        bases = [key_prefix]
    else:
        bases = [f"{key_prefix}{{{index}}}" for index in range(shards)]
    return [Shard(*(base + suffix for suffix in ("lru", "size", "name", "stats", "writer", "c:"))) for base in bases]


def shard_of(digest: str, shards: int) -> int:
    """The index shard of a chunk by its key digest (hex): uniform over the shards."""
    return int(digest[:8], 16) % shards
