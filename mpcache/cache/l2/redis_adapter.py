"""An L2 adapter on a Redis server or a Redis Cluster, the tier several hosts share.

The index is split into shards (one on a single server by default); every operation is one Lua script per
shard it touches (``redis_scripts``), so a shard's data, index and capacity move together, also between
cluster nodes.  MAC'd records, AUTH/ACL and TLS from the URL and spec, short timeouts; a shard whose node
could not be reached is taken as down for a while and its chunks are misses.  Each record's writer (the
service instance) is kept in the index, so loads tell chunks this instance stored from a peer's.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from mpcache.cache.l2 import redis_scripts as scripts
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
from mpcache.cache.l2.redis_calls import UNREACHABLE, Call, ClusterCalls, ServerCalls
from mpcache.contract.keys import ChunkKey

_DOWN = "shard taken as down after a connection error or timeout; not asked"


def _client_options(url: str, password: str | None, tls: tuple[str | None, str | None, str | None]) -> dict:
    options: dict[str, Any] = {}
    if password is not None:
        options["password"] = password
    if url.startswith("rediss://"):
        options.update(ssl_cert_reqs="required", ssl_check_hostname=True)
        for name, value in zip(("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"), tls):
            if value:
                options[name] = value
    elif any(tls):
        raise ValueError("tls_ca_file, tls_cert_file and tls_key_file need a rediss:// URL")
    return options


class RedisL2Adapter(PooledAdapter):
    """Chunk records under ``key_prefix`` on a server (or, with ``cluster``, a Redis Cluster found from the
    seed ``url``), the index in ``shards`` shards of ``capacity_bytes // shards`` each, LRU-evicted within a
    shard.  ``writer`` is this service instance's id, kept with every record it stores."""

    name = "redis"

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        mac_key: bytes,
        key_prefix: str = "mpcache:l2:",
        cluster: bool = False,
        shards: int | None = None,
        writer: str = "",
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
        shards = shards if shards is not None else (16 if cluster else 1)
        if shards < 1 or capacity_bytes < shards:
            raise ValueError(f"need 1 <= shards <= capacity_bytes, got {shards} shards of {capacity_bytes} bytes")
        if cluster and ("{" in key_prefix or "}" in key_prefix):
            raise ValueError("a cluster tier's key_prefix must not hold '{' or '}' (the shards' hash tags follow it)")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.shard_capacity = capacity_bytes // shards
        self.key_prefix = key_prefix
        self.cluster = cluster
        self.writer = writer.encode("utf-8")
        self.failures = FailureCounts()
        self._mac_key = check_mac_key(mac_key)
        self._shards = scripts.shard_layout(key_prefix, shards)
        self._down_for_s = down_for_s
        self._down_until = [0.0] * shards  # per shard: time.monotonic() before which it is taken as down
        options = _client_options(url, password, (tls_ca_file, tls_cert_file, tls_key_file))
        # a refused or dropped connection is retried (a restarted server); a timeout is not (it would double)
        retry = Retry(ExponentialBackoff(cap=0.1, base=0.01), retries, supported_errors=(redis.ConnectionError,))
        common = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                      max_connections=threads + 1, **options)
        self._calls: ServerCalls | ClusterCalls
        if cluster:
            # the slot map comes from the seed; a slot range no node serves is a miss, not a client that fails
            self._calls = ClusterCalls(lambda: redis.RedisCluster.from_url(
                url, require_full_coverage=False, retry=retry, **common))
        else:
            self._calls = ServerCalls(redis.Redis.from_url(url, retry=retry, **common))
        self._usage_lock = threading.Lock()
        self._shard_usage = [(0, 0, -1)] * shards  # per shard: used bytes, keys, clock of the reply
        self._notes = [0] * shards  # per shard: how many replies have been taken into _shard_usage
        self._usage = Usage(0, capacity_bytes, 0)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-redis")
        self._pool.submit(self.refresh_usage)

    # -- the interface -------------------------------------------------------------------------

    def get_usage(self) -> Usage:
        return self._usage

    def refresh_usage(self) -> Usage:
        """Ask the tier for its usage now (blocking; other adapters' writes included)."""
        shards = [index for index in range(len(self._shards)) if not self._is_down(index, "usage_error")]
        calls = [Call(scripts.USAGE, [self._shards[i].lru, self._shards[i].stats], []) for i in shards]
        asked = list(self._notes)
        for index, reply in zip(shards, self._calls.run(calls)):
            if self._ok(index, "usage_error", reply):
                self._note_usage(index, *reply, force_unless_noted_since=asked[index])
        return self._usage

    def close(self) -> None:
        super().close()
        self._calls.close()

    # -- worker side ---------------------------------------------------------------------------

    def _is_down(self, shard: int, kind: str, count: int = 1) -> bool:
        """True (and ``count`` failures of ``kind`` noted) while ``shard`` is taken as down."""
        if time.monotonic() >= self._down_until[shard]:
            return False
        self.failures.note(kind, count, _DOWN)
        return True

    def _ok(self, shard: int, kind: str, reply: Any, count: int = 1) -> bool:
        """True for a script's reply; for an error, count it (an unreachable node takes the shard as down)."""
        if isinstance(reply, list):
            return True
        if isinstance(reply, UNREACHABLE):
            self._down_until[shard] = time.monotonic() + self._down_for_s
        detail = f"{type(reply).__name__}: {reply}" if isinstance(reply, Exception) else f"reply {reply!r}"
        self.failures.note(kind, count, detail)
        return False

    def _note_usage(self, shard: int, used: int, count: int, clock: int, *,
                    force_unless_noted_since: int | None = None) -> None:
        """Keep the newest usage reply per shard.  A refresh is taken whatever its clock (a restarted server
        counts from 0 again), unless another reply was noted while it was asked: that one is newer news."""
        with self._usage_lock:
            forced = force_unless_noted_since is not None and self._notes[shard] == force_unless_noted_since
            if forced or clock > self._shard_usage[shard][2]:
                self._notes[shard] += 1
                self._shard_usage[shard] = (int(used), int(count), int(clock))
                self._usage = Usage(sum(u[0] for u in self._shard_usage), self.capacity_bytes,
                                    sum(u[1] for u in self._shard_usage))

    def _by_shard(self, digests: Iterable[str]) -> dict[int, list[int]]:
        """Positions of ``digests`` grouped by index shard, in order."""
        groups: dict[int, list[int]] = {}
        for position, digest in enumerate(digests):
            groups.setdefault(scripts.shard_of(digest, len(self._shards)), []).append(position)
        return groups

    def _store(self, items: list[tuple[ChunkKey, memoryview]]) -> StoreResult:
        stored: list[ChunkKey] = []
        skipped: list[ChunkKey] = []
        failed: list[ChunkKey] = []
        evicted: list[ChunkKey] = []
        written = 0
        calls, sent = [], []
        for key, data in items:
            digest = key_digest(key)
            index = scripts.shard_of(digest, len(self._shards))
            if self._is_down(index, "store_error"):
                failed.append(key)
                continue
            try:
                record = record_header(key, data, self._mac_key) + data
            except (ValueError, OverflowError, struct.error):  # a name or hash a record cannot hold
                failed.append(key)
                continue
            shard = self._shards[index]
            calls.append(Call(scripts.STORE, [*shard.index_keys, shard.data_prefix + digest],
                              [self.shard_capacity, shard.data_prefix, digest, encode_name(key), len(data), record,
                               self.writer]))
            sent.append((key, index, len(data)))
        for (key, index, size), reply in zip(sent, self._calls.run(calls)):
            if not self._ok(index, "store_error", reply):
                failed.append(key)
                continue
            status, used, count, clock, *victims = reply
            self._note_usage(index, used, count, clock)
            evicted.extend(self._evicted_names(index, victims))
            if status == 0:
                stored.append(key)
                written += size
            elif status == 1:
                skipped.append(key)
            else:
                failed.append(key)
        return StoreResult(stored, skipped, failed, written, evicted)

    def _evicted_names(self, shard: int, names: list[bytes]) -> list[ChunkKey]:
        """The chunks a store's eviction names; a name that does not decode (the index was written by someone
        else) is skipped and counted as ``index``: its chunk is gone either way."""
        keys = []
        for name in names:
            if not name:
                continue
            try:
                keys.append(decode_name(name))
            except (struct.error, UnicodeDecodeError, ValueError) as exc:
                self.failures.note("index", detail=f"an evicted chunk's name in {self._shards[shard].name} does not "
                                                   f"decode ({exc})")
        return keys

    def _lookup(self, keys: list[ChunkKey]) -> list[bool | None]:
        if not keys:
            return []
        digests = [key_digest(key) for key in keys]
        found: list[bool | None] = [None] * len(keys)  # None: its shard could not be asked
        groups = {index: positions for index, positions in self._by_shard(digests).items()
                  if not self._is_down(index, "lookup_error", len(positions))}
        shards = list(groups)
        calls = [Call(scripts.LOOKUP, [self._shards[i].lru, self._shards[i].stats], [digests[p] for p in groups[i]])
                 for i in shards]
        answered, last_error = 0, "every shard of these keys is taken as down"
        for index, reply in zip(shards, self._calls.run(calls)):
            positions = groups[index]
            if not self._ok(index, "lookup_error", reply, len(positions)):
                last_error = f"{type(reply).__name__}: {reply}"
                continue
            answered += 1
            used, count, clock, *flags = reply
            self._note_usage(index, used, count, clock)
            for position, flag in zip(positions, flags):
                found[position] = flag == 1
        if answered == 0:  # no shard could be asked: the tier, not the chunks, is missing
            raise L2LookupError(f"redis: no index shard of these keys could be asked ({last_error})")
        return found

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> LoadResult:
        result = LoadResult()
        if not keys:
            return result
        digests = [key_digest(key) for key in keys]
        records: list[Any] = [None] * len(keys)
        writers: list[Any] = [None] * len(keys)
        groups = self._by_shard(digests)
        shards = [index for index in groups if not self._is_down(index, "load_error", len(groups[index]))]
        calls = []
        for index in shards:
            shard, wanted = self._shards[index], [digests[p] for p in groups[index]]
            calls.append(Call(scripts.LOAD, [*shard.index_keys, *(shard.data_prefix + d for d in wanted)], wanted))
        unasked = {p for index in groups if index not in shards for p in groups[index]}
        for index, reply in zip(shards, self._calls.run(calls)):
            positions = groups[index]
            if not self._ok(index, "load_error", reply, len(positions)):
                unasked.update(positions)
                continue
            used, count, clock, *pairs = reply
            self._note_usage(index, used, count, clock)
            pairs += [None] * (2 * len(positions) - len(pairs))  # trailing nils may be dropped from the reply
            for n, position in enumerate(positions):
                records[position], writers[position] = pairs[2 * n], pairs[2 * n + 1]
        bad = []
        for position, (key, digest, destination, record) in enumerate(zip(keys, digests, destinations, records)):
            if position in unasked:
                result.failed.append(key)
                result.errors.append(key)
                continue
            if record is None:
                result.failed.append(key)
                continue
            checked = check_record(record, self._mac_key)
            if checked.status != "ok" or checked.key != key or checked.payload is None:
                # corrupt, or written without our key (a forgery): never returned; drop it so nobody tries again
                reason = {"bad_mac": "MAC mismatch", "malformed": "malformed record"}.get(checked.status,
                                                                                         "a record of another chunk")
                shard = self._shards[scripts.shard_of(digest, len(self._shards))]
                self.failures.note("integrity", detail=f"{reason} at {shard.data_prefix}{digest}")
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
            if writers[position] != self.writer:
                result.peer.append(key)
        if bad:
            self._delete_digests(bad)
        return result

    def _delete(self, keys: list[ChunkKey]) -> int:
        return self._delete_digests([key_digest(key) for key in keys]) if keys else 0

    def _delete_digests(self, digests: list[str]) -> int:
        groups = self._by_shard(digests)
        shards = [index for index in groups if not self._is_down(index, "delete_error", len(groups[index]))]
        calls = [Call(scripts.DELETE, self._shards[i].index_keys,
                      [self._shards[i].data_prefix, *(digests[p] for p in groups[i])]) for i in shards]
        removed = 0
        for index, reply in zip(shards, self._calls.run(calls)):
            if self._ok(index, "delete_error", reply, len(groups[index])):
                used, count, clock, gone = reply
                self._note_usage(index, used, count, clock)
                removed += int(gone)
        return removed

