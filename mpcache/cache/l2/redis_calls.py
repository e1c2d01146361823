"""Running a batch of script calls on a Redis server or a Redis Cluster, each call's reply or error apart.

A batch goes out pipelined: to the one server, or to each cluster node as one pipeline of the calls whose
first key its hash slot puts there (redis-py's slot map).  A call answered with a redirection (``MOVED``,
``ASK``), ``TRYAGAIN`` or ``NOSCRIPT`` is sent again on its own through redis-py's cluster client, which
follows redirections and updates its slot map; a call whose node could not be reached, or whose slot no node
serves (``CLUSTERDOWN``), is not (it would wait for the same timeout again): the slot map is refreshed once
and the error returned, so the adapter takes that shard as down for a while.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    TryAgainError,
)

from mpcache.cache.l2.redis_scripts import Script

ERRORS = (redis.RedisError, RedisClusterException, OSError)  # what a call can fail with
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException)
_SEND_AGAIN = (MovedError, AskError, TryAgainError, NoScriptError)


class Call(NamedTuple):
    script: Script
    keys: list[str]
    args: list[Any]

    def evalsha(self) -> tuple:
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def eval(self) -> tuple:
        return ("EVAL", self.script.text, len(self.keys), *self.keys, *self.args)


def _pipelined(client: redis.Redis, calls: list[Call]) -> list[Any]:
    """Replies (or exceptions) of ``calls`` through one pipeline of ``client``; a script the server does not
    know yet is sent again whole (EVAL), which also caches it there."""
    pipe = client.pipeline(transaction=False)
    try:
        for call in calls:
            pipe.execute_command(*call.evalsha())
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except ERRORS as exc:
            return [exc] * len(calls)
        missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for index in missing:
                pipe.execute_command(*calls[index].eval())
            try:
                again = pipe.execute(raise_on_error=False)
            except ERRORS as exc:
                again = [exc] * len(missing)
            for index, reply in zip(missing, again):
                replies[index] = reply
        return replies
    finally:
        pipe.reset()


class ServerCalls:
    """Batches on one Redis server."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def run(self, calls: list[Call]) -> list[Any]:
        return _pipelined(self.client, calls) if calls else []

    def close(self) -> None:
        self.client.connection_pool.disconnect()


class ClusterCalls:
    """Batches on a Redis Cluster: one pipeline per node, redirected calls sent again through the cluster
    client (see the module's docstring).  The client is made by ``connect()`` (it asks the seed for the slot
    map), at the first batch and again at each batch until that succeeds: a cluster down at start-up fails
    its batches (its shards are taken as down), never the cache process."""

    def __init__(self, connect: Callable[[], redis.RedisCluster]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self.client: redis.RedisCluster | None = None

    def _connected(self) -> redis.RedisCluster:
        with self._lock:
            if self.client is None:
                self.client = self._connect()
            return self.client

    def run(self, calls: list[Call]) -> list[Any]:
        if not calls:
            return []
        try:
            client = self._connected()
        except ERRORS as exc:
            return [exc] * len(calls)
        results: list[Any] = [None] * len(calls)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for index, call in enumerate(calls):
            try:
                node = client.get_node_from_key(call.keys[0])
            except ERRORS as exc:  # no node serves the slot (as far as the slot map knows)
                results[index] = exc
                continue
            if node is None:
                results[index] = ClusterDownError("no node serves the slot")
                continue
            by_node.setdefault(node.name, (node, []))[1].append(index)
        for node, indexes in by_node.values():
            try:
                replies = _pipelined(client.get_redis_connection(node), [calls[index] for index in indexes])
            except ERRORS as exc:
                replies = [exc] * len(indexes)
            for index, reply in zip(indexes, replies):
                results[index] = reply
        if any(isinstance(reply, UNREACHABLE) for reply in results):
            self._refresh(client)
        for index, reply in enumerate(results):
            if isinstance(reply, _SEND_AGAIN):
                try:
                    results[index] = client.execute_command(*calls[index].eval())
                except ERRORS as exc:
                    results[index] = exc
        return results

    @staticmethod
    def _refresh(client: redis.RedisCluster) -> None:
        """Ask the cluster for its slot map again (after a node could not be reached: it may have failed over)."""
        try:
            client.nodes_manager.initialize()
        except ERRORS:
            pass  # the next batch tries again

    def close(self) -> None:
        with self._lock:
            if self.client is not None:
                self.client.close()
