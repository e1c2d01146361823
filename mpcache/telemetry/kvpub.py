"""The KV event feed published for routers that subscribe to cache nodes (llm-d's KV-cache indexer, Dynamo's KV
router): vLLM's KV-event wire format on a ZeroMQ PUB socket per cache process, with vLLM's replay (ROUTER)
socket for gaps, run as a thread of the telemetry process, never in a cache process.

The relay is a client of each cache process's ``subscribe_kv_events`` stream (every model: ``ALL_MODELS``), one
batch per credit like LMCache's worker, so a router that stops reading costs a cache process nothing: the PUB
socket drops past its high-water mark, and only the relay's own replay buffer holds what went out.  Each batch
becomes one ``[topic, seq (8 bytes, big-endian), KVEventBatch]`` message, the payload msgpack as vLLM's msgspec
encodes it (``[ts, events, data_parallel_rank]``, events as maps tagged ``type``): ``BlockStored`` and
``BlockRemoved`` per record, medium ``CPU`` for L1 and ``L2:<tier>`` for an L2 tier, a salted block's
``cache_salt`` as its extra key, and ``AllBlocksCleared`` before the snapshot that follows a cache-process
restart (a new incarnation) or a log overrun (``lost``), so an index built from the PUB feed alone stays exact.

Every loss is visible to a router as a gap in the sequence numbers: they go on past a restart of the relay
(microseconds at its start), and an empty batch goes out after ``HEARTBEAT_S`` without one, so a lost last
message shows within that.  A replay request ``[id, b"", start seq]`` on the ROUTER socket is answered with every
buffered message from that seq on, then vLLM's end marker (seq -1); a gap older than the buffer (its first
message comes after ``start``) cannot be filled: such a router drops its index and applies from the next
``AllBlocksCleared``, which the buffer holds or the relay then asks its cache process for (a new snapshot, at most
one at a time).

The stream is subscribed again on every new connection to the cache process (a restarted process forgot it:
the DEALER's monitor reports each handshake), when the process ends it, and when a subscription gets no first
batch within ``SUBSCRIBE_TIMEOUT_S`` (the wait doubling while unanswered); never merely because it is quiet.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

ALL_MODELS = "@all"  # subscribe_kv_events' model name for every model's records (mpcache.cache.lmcache.kvevents)

OP = msgpack.packb("subscribe_kv_events")
INSTANCE_ID = 0x6D70636B  # the relay's instance id at every cache process (a new subscription ends its old one)
SUBSCRIBE_TIMEOUT_S = 5.0  # a subscription unanswered this long is sent again (its first batch is free)
MAX_SUBSCRIBE_TIMEOUT_S = 60.0  # the wait doubles while subscriptions go unanswered (a loaded cache process)
HEARTBEAT_S = 1.0  # an empty batch after this long without a message: a lost last message shows as a gap
BUFFER_STEPS = 10_000  # messages kept for replay, vLLM's default
BUFFER_BYTES = 64 << 20  # and their payloads' bytes at the most (a full batch of long blocks is about a megabyte)
HWM = 100_000  # the PUB socket's high-water mark, vLLM's default
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_CLEARED = {"type": "AllBlocksCleared"}


def vllm_events(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``KVEventBatch`` of ``subscribe_kv_events`` as vLLM's events (msgspec's encoding of its structs)."""
    events: list[dict[str, Any]] = []
    for record in batch["events"]:
        if record["kind"] == "stored":
            salt = record.get("cache_salt")
            events.append({"type": "BlockStored", "block_hashes": record["block_hashes"],
                           "parent_block_hash": record["parent_block_hash"], "token_ids": record["token_ids"],
                           "block_size": len(record["token_ids"]), "lora_id": None, "medium": record["medium"],
                           "lora_name": None, "extra_keys": [[salt]] if salt else None})
        else:
            events.append({"type": "BlockRemoved", "block_hashes": record["block_hashes"],
                           "medium": record["medium"]})
    return events


class FeedCounts:
    """What one feed did (read by the metrics' callbacks: plain ints, each written by the relay thread only)."""

    __slots__ = ("messages", "records", "replays", "resyncs", "subscriptions", "subscribers")

    def __init__(self) -> None:
        self.messages = 0  # published on PUB (heartbeats included)
        self.records = 0  # BlockStored/BlockRemoved events published
        self.replays = 0  # replay requests answered: gaps routers saw
        self.resyncs = 0  # AllBlocksCleared published (new incarnation, lost log, or a gap past the buffer)
        self.subscriptions = 0  # subscribe_kv_events sent to the cache process
        self.subscribers = 0  # SUB connections now


class _Feed:
    """One cache process's stream and its PUB and replay sockets."""

    def __init__(self, context: zmq.Context[Any], worker: int, source: str, endpoint: str, replay: str,
                 topic: bytes) -> None:
        self.worker, self.topic, self.source = worker, topic, source
        self.counts = FeedCounts()
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, HWM)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.pub_monitor = self.pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.replay = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(replay)
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer_monitor = self.dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.dealer.connect(source)
        self.buffer: deque[tuple[int, bytes]] = deque()  # within BUFFER_STEPS messages and BUFFER_BYTES
        self.buffered_bytes = 0
        self.seqs = itertools.count(time.time_ns() // 1000)
        self.last_clear = -1  # the seq of the newest AllBlocksCleared published
        self.resync_asked = False  # a snapshot was asked for and its AllBlocksCleared has not gone out yet
        self.uids = itertools.count(1)
        self.uid = b""
        self.cursor = 0
        self.incarnation: int | None = None
        self.whole = True  # a resync's snapshot went out completely (else: subscribed again from scratch)
        self.sent_at = time.monotonic()  # of the last PUB message
        self.subscribed_at = 0.0
        self.answered = True  # the subscription got its first batch
        self.patience = SUBSCRIBE_TIMEOUT_S

    def sockets(self) -> tuple[zmq.Socket[Any], ...]:
        return self.dealer, self.dealer_monitor, self.replay, self.pub_monitor

    def on_readable(self, socket: zmq.Socket[Any]) -> None:
        if socket is self.dealer:
            self.receive()
        elif socket is self.replay:
            self.answer_replay()
        elif socket is self.dealer_monitor:
            if recv_monitor_message(socket)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.subscribe()  # a new connection: a restarted cache process knows no stream of ours
        else:
            event = recv_monitor_message(socket)["event"]
            self.counts.subscribers += 1 if event == zmq.EVENT_ACCEPTED else -1

    def subscribe(self) -> None:
        """A new subscription from the cursor (from scratch after a snapshot that stopped midway)."""
        self.patience = SUBSCRIBE_TIMEOUT_S if self.answered else min(2 * self.patience, MAX_SUBSCRIBE_TIMEOUT_S)
        self.answered = False
        self.subscribed_at = time.monotonic()
        self.uid = msgpack.packb(next(self.uids))
        if not self.whole:
            self.incarnation, self.cursor, self.whole = None, 0, True
        self.counts.subscriptions += 1
        try:
            self.dealer.send_multipart([self.uid, OP, msgpack.packb(INSTANCE_ID), msgpack.packb(ALL_MODELS),
                                        msgpack.packb(self.cursor), msgpack.packb(1024)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room toward the cache process: sent again when unanswered

    def resync(self) -> None:
        """Ask the cache process for everything again: AllBlocksCleared and a snapshot (or its whole log)."""
        if not self.resync_asked:
            self.resync_asked = True
            self.incarnation, self.cursor, self.whole = None, 0, True
            self.subscribe()

    def receive(self) -> None:
        """A reply on the stream: a batch is published and acknowledged; its end is a new subscription."""
        frames = self.dealer.recv_multipart()
        if len(frames) < 2 or frames[0] != self.uid or frames[1] != OP:
            return  # an ended stream's last replies
        if len(frames) != 3:  # the cache process ended the stream (another subscriber took its place)
            self.subscribe()
            return
        self.answered = True
        batch = msgpack.unpackb(frames[2], raw=False)
        if batch.get("enabled"):
            events = vllm_events(batch)
            if batch["incarnation"] != self.incarnation or batch["lost"]:
                events.insert(0, _CLEARED)
                self.incarnation = batch["incarnation"]
            # a resync's pages say lost on the first, a cursor on the last (an empty snapshot: one page, no events)
            self.whole = bool(batch["next_cursor"]) or (not batch["events"] if batch["lost"] else self.whole)
            if self.whole:
                self.cursor = batch["next_cursor"]
            if events:
                self.publish(events)
        try:
            self.dealer.send_multipart([self.uid, b"", b"ack"], zmq.NOBLOCK)
        except zmq.Again:
            self.answered = False  # the credit did not go: subscribed again when unanswered
            self.subscribed_at = time.monotonic()

    def publish(self, events: list[dict[str, Any]]) -> None:
        seq = next(self.seqs)
        payload = msgpack.packb([time.time(), events, self.worker])
        buffer = self.buffer
        buffer.append((seq, payload))
        self.buffered_bytes += len(payload)
        while len(buffer) > BUFFER_STEPS or (self.buffered_bytes > BUFFER_BYTES and len(buffer) > 1):
            self.buffered_bytes -= len(buffer.popleft()[1])  # the oldest: the newest is kept, however long
        counts = self.counts
        counts.messages += 1
        if events and events[0] is _CLEARED:
            self.last_clear, self.resync_asked = seq, False
            counts.resyncs += 1
            counts.records += len(events) - 1
        else:
            counts.records += len(events)
        self.sent_at = time.monotonic()
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)  # drops past HWM

    def answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        self.counts.replays += 1
        start = int.from_bytes(frames[2], "big")
        buffer = self.buffer
        if buffer and start < buffer[0][0] and self.last_clear < buffer[0][0]:
            self.resync()  # a gap older than the buffer, and no AllBlocksCleared in it to start again from
        for seq, payload in list(buffer):
            if seq >= start:
                self.replay.send_multipart([frames[0], b"", self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.replay.send_multipart([frames[0], b"", b"", END_SEQ, b""], zmq.NOBLOCK)

    def tick(self, now: float) -> None:
        if not self.answered and now - self.subscribed_at > self.patience:
            self.subscribe()
        if now - self.sent_at >= HEARTBEAT_S:
            self.publish([])

    def close(self) -> None:
        self.pub.disable_monitor()
        self.dealer.disable_monitor()
        for socket in (self.dealer, self.dealer_monitor, self.pub, self.pub_monitor, self.replay):
            socket.close(linger=0)


class KVEventRelay:
    """The relay thread: ``feeds`` is, per cache process, (its LMCache URL, the PUB endpoint, the replay one)."""

    def __init__(self, feeds: list[tuple[str, str, str]], topic: str = "", log: Any = None) -> None:
        self._context = zmq.Context()
        self._feeds = [_Feed(self._context, worker, *ends, topic.encode()) for worker, ends in enumerate(feeds)]
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

    @property
    def counts(self) -> list[FeedCounts]:
        return [feed.counts for feed in self._feeds]

    def start(self) -> None:
        self._thread.start()
        if self._log is not None:
            self._log.info("kvpub.started", feeds=[feed.source for feed in self._feeds])

    def _run(self) -> None:
        try:
            self._relay()
        except Exception as exc:
            if self._log is not None:
                self._log.error("kvpub.stopped", error=repr(exc))
            raise

    def _relay(self) -> None:
        poller = zmq.Poller()
        owners: dict[zmq.Socket[Any], _Feed] = {}
        for feed in self._feeds:
            for socket in feed.sockets():
                poller.register(socket, zmq.POLLIN)
                owners[socket] = feed
        while not self._stop.is_set():
            for socket, _ in poller.poll(int(HEARTBEAT_S * 250)):
                try:
                    owners[socket].on_readable(socket)
                except Exception as exc:  # noqa: BLE001 - a bad frame costs that message, never the relay
                    if self._log is not None:
                        self._log.warning("kvpub.error", error=repr(exc))
            now = time.monotonic()
            for feed in self._feeds:
                feed.tick(now)
        for feed in self._feeds:
            feed.close()
        self._context.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
