"""``subscribe_kv_events``: LMCache's KV event stream over the cache process's :class:`~mpcache.cache.kvlog.KVEventLog`.

A subscription is answered by batches (``KVEventBatch{enabled, incarnation, next_cursor, lost, events}``), each a
reply frame to the subscribing request: the first is sent at once, every next one only for a credit the client
grants with a control frame ``[uid, b"", b"ack"]`` (LMCache's client holds one batch at a time); ``b"cancel"`` ends
it. The server ends a stream with a reply that has no batch frame, only once the client has read the batch before it
(a client drops a batch still queued when its stream ends). A batch carries the records after the cursor, of the
subscription's model only (every model's for ``ALL_MODELS``: mpcache's own relay); with none, nothing is sent until
there are some (a credit waits). A cursor outside the log's window (records overwritten before the client read them,
or a cursor from elsewhere) is answered with ``lost`` and a snapshot: a ``stored`` record for every object L1 holds
readable now, after which the log goes on from where the snapshot was taken, so a client that drops what it knew at
``lost`` (LMCache's worker does) and applies the records knows exactly what is readable. Nothing here runs on the
data path: the log is read only for a client with credit, and a client that stops reading costs nothing but its
place here.

A record's ``block_hashes`` is its object's key (8 bytes, big-endian; with a ``cache_salt``, blake2b-64 of the
salt and those bytes, so one tenant's chunk is never another's), its ``parent_block_hash`` the key of the same
rank's object for the chunk before, its ``token_ids`` the chunk's tokens where the store said them.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from mpcache.cache.kvlog import CPU, STORED, Detail, KVEventLog, Record
from mpcache.cache.l1 import L1Manager
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot

MAX_SUBSCRIPTIONS = 64  # per cache process; a new one past it ends the one silent longest
MAX_EVENTS = 1024  # LMCache's own bound on a batch
ALL_MODELS = "@all"  # a subscription to every model's records (mpcache's PUB relay; "@" is in no model name)
CAPABILITY = "kv_event_stream"  # what get_experimental says (LMCache 0.5.6 subscribes only then)
_KINDS = {STORED: "stored", 1: "removed"}

Send = Callable[[list[bytes], Any], bool]  # (prefix, batch or None) → False when the connection is gone
CapacityOf = Callable[[str], dict[str, dict[str, int]]]  # model → tier → {"bytes", "tokens"} (:mod:`.capacity`)


class _Subscription:
    __slots__ = ("prefix", "instance_id", "model", "cursor", "max_events", "credit", "started", "snapshot",
                 "snapshot_sent", "snapshot_at", "snapshot_lost")

    def __init__(self, prefix: list[bytes], instance_id: int, model: str, cursor: int, max_events: int) -> None:
        self.prefix = prefix
        self.instance_id = instance_id
        self.model = model
        self.cursor = cursor
        self.max_events = max_events
        self.credit = True  # the first batch is free
        self.started = False
        self.snapshot: list[Record] | None = None  # the snapshot's records (made into events page by page)
        self.snapshot_sent = 0  # how many of them went out
        self.snapshot_at = 0  # the last record the snapshot covers
        self.snapshot_lost = False  # its next page is the first (says lost)


def block_hash(key: int, salt: str) -> bytes:
    raw = key.to_bytes(8, "big")
    return raw if not salt else hashlib.blake2b(salt.encode() + b"\0" + raw, digest_size=8).digest()


def _event(record: Record, seq: int, salted: bool = False) -> dict:
    """A KVEventRecord (``salted``: with its ``cache_salt``, a key only mpcache's own relay asks for)."""
    tokens = [] if record.tokens is None else np.frombuffer(
        record.tokens, dtype="<i8", count=record.token_count, offset=record.chunk * record.token_count * 8).tolist()
    event = {"seq": seq, "kind": _KINDS[record.kind], "medium": record.medium, "model_name": record.model,
             "block_hashes": [block_hash(record.key, record.salt)],
             "parent_block_hash": None if record.parent is None else block_hash(record.parent, record.salt),
             "token_ids": tokens}
    if salted:
        event["cache_salt"] = record.salt
    return event


class KVEventStreams:
    """The subscriptions of one cache process (``log`` None: the stream is off, and says so once)."""

    def __init__(self, log: KVEventLog | None, l1: L1Manager, send: Send, capacity: CapacityOf) -> None:
        self._log = log
        self._l1 = l1
        self._send = send
        self._capacity = capacity
        self._incarnation = log.incarnation if log is not None else time.time_ns()
        self._subs: OrderedDict[tuple[bytes, bytes], _Subscription] = OrderedDict()  # oldest activity first
        self.published = 0  # batches sent
        self.resyncs = 0  # lost batches sent (snapshots started)
        self.skipped = 0  # records streams never got: the log let them go before they read them
        self._reported = (0, 0, 0)  # (records, skipped, resyncs) as last added to the gauge board

    @property
    def enabled(self) -> bool:
        return self._log is not None

    def __len__(self) -> int:
        return len(self._subs)

    def lag(self) -> int:
        """Records the furthest-behind subscription has yet to read (0 with none)."""
        log = self._log
        if log is None or not self._subs:
            return 0
        return max(log.last - min(sub.cursor, log.last) for sub in self._subs.values())

    def report(self, gauges: GaugeSlot) -> None:
        """The feed's gauge-board words: streams open and their lag, and what was appended, skipped and resynced
        since the last report (added: those words outlive the process)."""
        log = self._log
        gauges.set(layout.G_KV_SUBSCRIBERS, len(self._subs))
        gauges.set(layout.G_KV_LAG, self.lag())
        now = (log.last if log is not None else 0, self.skipped, self.resyncs)
        for word, value, before in zip((layout.G_KV_RECORDS, layout.G_KV_SKIPPED, layout.G_KV_RESYNCS), now,
                                       self._reported):
            if value != before:
                gauges.add(word, value - before)
        self._reported = now

    def subscribe(self, prefix: list[bytes], instance_id: int, model: str, cursor: int, max_events: int) -> None:
        """A new subscription (one per instance id: a worker's new one ends its old one)."""
        for stream, sub in list(self._subs.items()):
            if sub.instance_id == instance_id:
                self._end(stream)
        while len(self._subs) >= MAX_SUBSCRIPTIONS:
            self._end(next(iter(self._subs)))
        self._subs[(prefix[0], prefix[1])] = _Subscription(prefix, instance_id, model, cursor,
                                                           min(max_events, MAX_EVENTS))

    def control(self, identity: bytes, uid: bytes, action: bytes) -> None:
        """A control frame: ``b"ack"`` grants a credit, ``b"cancel"`` ends the stream (anything else: ignored)."""
        stream = (identity, uid)
        sub = self._subs.get(stream)
        if sub is None:
            return
        if action == b"ack":
            sub.credit = True
            self._subs.move_to_end(stream)
        elif action == b"cancel":
            self._end(stream)

    def pump(self) -> None:
        """Send a batch to every subscription that has a credit and something to read."""
        if not self._subs:
            return
        last = self._log.last if self._log is not None else -1  # -1: no log, so never "nothing new"
        for stream, sub in list(self._subs.items()):
            if not sub.credit or (sub.started and sub.snapshot is None and sub.cursor == last):
                continue  # nothing to send (the common case: a worker waiting with its credit)
            if self._log is None and sub.started:  # it was told the stream is off; ended once it has read that
                self._end(stream)
                continue
            batch = self._batch(sub)
            if batch is None:
                continue
            sub.credit = False
            sub.started = True
            self.published += 1
            if not self._send(sub.prefix, batch):
                del self._subs[stream]

    def close(self) -> None:
        for stream in list(self._subs):
            self._end(stream)

    def _end(self, stream: tuple[bytes, bytes]) -> None:
        sub = self._subs.pop(stream)
        self._send(sub.prefix, None)

    def _batch(self, sub: _Subscription) -> dict | None:
        log = self._log
        if log is None:
            return self._wrap(sub, False, 0, False, [])
        if sub.snapshot is not None and log.first > sub.snapshot_at + 1:
            sub.snapshot = None  # the log moved past the snapshot's point while it went out: take another
            sub.cursor = 0
        if sub.snapshot is None:
            lost = sub.cursor + 1 < log.first or sub.cursor > log.last
            if lost:
                if sub.cursor + 1 < log.first:
                    self.skipped += log.first - 1 - sub.cursor
                self._take_snapshot(sub, log)
            else:
                events, sub.cursor = self._read(sub, log)
                return self._wrap(sub, True, sub.cursor, False, events) if events or not sub.started else None
        snapshot, start = sub.snapshot, sub.snapshot_sent
        assert snapshot is not None
        salted = sub.model == ALL_MODELS
        page = [_event(record, sub.snapshot_at, salted) for record in snapshot[start : start + sub.max_events]]
        sub.snapshot_sent = start + len(page)
        lost, sub.snapshot_lost = sub.snapshot_lost, False
        if sub.snapshot_sent >= len(snapshot):
            sub.snapshot = None
            sub.cursor = sub.snapshot_at
        return self._wrap(sub, True, sub.cursor if sub.snapshot is None else 0, lost, page)

    def _wrap(self, sub: _Subscription, enabled: bool, next_cursor: int, lost: bool, events: list[dict]) -> dict:
        """A KVEventBatch; ``capacity`` (what the tiers hold of the subscription's model) is a key LMCache's
        client does not know and passes over."""
        return {"enabled": enabled, "incarnation": self._incarnation, "next_cursor": next_cursor, "lost": lost,
                "events": events, "capacity": self._capacity(sub.model)}

    def _read(self, sub: _Subscription, log: KVEventLog) -> tuple[list[dict], int]:
        """The subscription's model's records after its cursor, at most a batch of them; and the new cursor."""
        events: list[dict] = []
        cursor = min(sub.cursor, log.last)
        for record in log.records(sub.cursor):
            cursor = record.seq
            if sub.model in (record.model, ALL_MODELS):
                events.append(_event(record, record.seq, sub.model == ALL_MODELS))
                if len(events) == sub.max_events:
                    break
        return events, cursor

    def _take_snapshot(self, sub: _Subscription, log: KVEventLog) -> None:
        """``stored`` records of everything readable now (tokens and parents where the log still has them)."""
        self.resyncs += 1
        latest: dict[tuple[str, int], Record] = {}
        for record in log.records():
            if record.kind == STORED and record.medium == CPU and sub.model in (record.model, ALL_MODELS):
                latest[(record.salt, record.key)] = record
        seq = sub.snapshot_at = log.last
        snapshot = []
        for key in self._l1.readable("" if sub.model == ALL_MODELS else sub.model):
            known = latest.get((key.cache_salt, key.chunk_hash))
            if known is None:
                known = Record(seq, STORED, CPU, key.model_name, key.cache_salt, key.chunk_hash, None, None, 0, 0)
            snapshot.append(known)
        sub.snapshot, sub.snapshot_sent, sub.snapshot_lost = snapshot, 0, True


def feed_of(key: Any, chunk_tokens: int, first: int, keys: list[int], chunks: list[int], group_ids: list[int],
            groups: int, keys_of: Callable[..., list[int]]) -> Detail:
    """What a store's stored records will need, taken when its keys are known: ``key`` its wire key, ``keys``
    the keys of its chunks [first, last) chunk-major and group-minor, ``chunks`` and ``group_ids`` each reserved
    key's chunk index relative to ``first`` and its group (none of them changed afterwards: the log keeps them)."""
    before = keys_of(key, first - 1, first, (key.worker_id or 0,), groups) if first else None
    return Detail(key.tokens, chunk_tokens, first, chunks, group_ids, keys, groups, before, 0)


def details(feed: Detail, sizes: list[tuple[int, int]]) -> list[Detail]:
    """The :class:`Detail` of each run of a store's keys (one run per KV cache group) from :func:`feed_of`: the
    same references, each from where its run begins (parents are worked out only when a record is read)."""
    out = []
    at = 0
    for count, _ in sizes:
        out.append(feed._replace(at=at) if at else feed)
        at += count
    return out
