"""The KV event feed published for routers that subscribe to cache nodes (llm-d's KV-cache indexer, Dynamo's KV
router): vLLM's KV-event wire format on a ZeroMQ PUB socket per cache process, with vLLM's replay (ROUTER)
socket for gaps, run as a thread of the telemetry process, never in a cache process.

The relay is a client of each cache process's ``subscribe_kv_events`` stream (every model: ``ALL_MODELS``), one
batch per credit like LMCache's worker, so a router that stops reading costs a cache process nothing: the PUB
socket drops past its high-water mark, and only the relay's own replay buffer holds what went out.  Each batch
becomes one ``[topic, seq (8 bytes, big-endian), KVEventBatch]`` message, the payload msgpack as vLLM's msgspec
encodes it (``[ts, events, data_parallel_rank]``, events as maps tagged ``type``): ``BlockStored`` and
``BlockRemoved`` per record, medium ``CPU`` for L1 and ``L2:<tier>`` for an L2 tier, and ``AllBlocksCleared``
before the snapshot that follows a cache-process restart (a new incarnation) or a log overrun (``lost``), so an
index built from the PUB feed alone stays exact.  A replay request ``[id, b"", start seq]`` on the ROUTER socket
is answered with every buffered message from that seq on, then vLLM's end marker (seq -1).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

ALL_MODELS = "@all"  # subscribe_kv_events' model name for every model's records (mpcache.cache.lmcache.kvevents)

OP = msgpack.packb("subscribe_kv_events")
INSTANCE_ID = 0x6D70636B  # the relay's instance id at every cache process (a new subscription ends its old one)
RESUBSCRIBE_S = 2.0  # a stream silent this long is subscribed again from its cursor (its cache process restarted)
MAX_PATIENCE_S = 30.0  # the wait doubles while a subscription goes unanswered (a loaded cache process), up to this
BUFFER_STEPS = 10_000  # messages kept for replay, vLLM's default
HWM = 100_000  # the PUB socket's high-water mark, vLLM's default
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def vllm_events(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``KVEventBatch`` of ``subscribe_kv_events`` as vLLM's events (msgspec's encoding of its structs)."""
    events: list[dict[str, Any]] = []
    for record in batch["events"]:
        if record["kind"] == "stored":
            events.append({"type": "BlockStored", "block_hashes": record["block_hashes"],
                           "parent_block_hash": record["parent_block_hash"], "token_ids": record["token_ids"],
                           "block_size": len(record["token_ids"]), "lora_id": None, "medium": record["medium"],
                           "lora_name": None})
        else:
            events.append({"type": "BlockRemoved", "block_hashes": record["block_hashes"],
                           "medium": record["medium"]})
    return events


class _Feed:
    """One cache process's stream and its PUB and replay sockets."""

    def __init__(self, context: zmq.Context[Any], worker: int, source: str, endpoint: str, replay: str,
                 topic: bytes) -> None:
        self.worker, self.topic = worker, topic
        self.source = source
        self.dealer: zmq.Socket[Any] | None = None
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, HWM)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.replay = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(replay)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        # Sequence numbers go on past a restart of the relay (microseconds at its start: it publishes fewer than a
        # million batches a second), so a router sees the restart as a gap and replays what the new relay has
        # sent, which starts with AllBlocksCleared and the snapshot.
        self.seqs = itertools.count(time.time_ns() // 1000)
        self.uids = itertools.count(1)
        self.uid = b""
        self.cursor = 0
        self.incarnation: int | None = None
        self.whole = True  # a resync's snapshot went out completely (else: subscribed again from scratch)
        self.heard = 0.0
        self.answered = True  # the last subscription got a batch
        self.patience = RESUBSCRIBE_S  # the silence after which it is subscribed again

    def subscribe(self, context: zmq.Context[Any]) -> None:
        """A new subscription from the cursor (a stream a restarted process forgot), on the one connection (which
        reconnects by itself); while one goes unanswered, the next waits twice as long."""
        if self.dealer is None:
            self.dealer = context.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.SNDTIMEO, 0)
            self.dealer.connect(self.source)
        self.patience = RESUBSCRIBE_S if self.answered else min(2 * self.patience, MAX_PATIENCE_S)
        self.answered = False
        self.uid = msgpack.packb(next(self.uids))
        self.heard = time.monotonic()
        if not self.whole:  # the snapshot's pages stopped midway: a new incarnation, all cleared again
            self.incarnation, self.cursor = None, 0
        try:
            self.dealer.send_multipart([self.uid, OP, msgpack.packb(INSTANCE_ID), msgpack.packb(ALL_MODELS),
                                        msgpack.packb(self.cursor), msgpack.packb(1024)])
        except zmq.Again:
            pass  # not connected yet: tried again after RESUBSCRIBE_S

    def receive(self) -> None:
        """A reply on the stream: a batch is published and acknowledged; anything else is passed over."""
        assert self.dealer is not None
        frames = self.dealer.recv_multipart()
        if len(frames) != 3 or frames[0] != self.uid or frames[1] != OP:
            return  # an ended stream's last reply, or another stream's
        self.heard, self.answered = time.monotonic(), True
        batch = msgpack.unpackb(frames[2], raw=False)
        if batch.get("enabled"):
            events = vllm_events(batch)
            if batch["incarnation"] != self.incarnation or batch["lost"]:
                events.insert(0, {"type": "AllBlocksCleared"})
                self.incarnation = batch["incarnation"]
            # a resync's pages say lost on the first, a cursor on the last (an empty snapshot: one page, no events)
            self.whole = bool(batch["next_cursor"]) or (
                not batch["events"] if batch["lost"] else self.whole)
            if batch["next_cursor"]:
                self.cursor = batch["next_cursor"]
            if events:
                self.publish(events)
        try:
            self.dealer.send_multipart([self.uid, b"", b"ack"])
        except zmq.Again:
            pass

    def publish(self, events: list[dict[str, Any]]) -> None:
        seq = next(self.seqs)
        payload = msgpack.packb([time.time(), events, self.worker])
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber keeps up: it recovers through replay

    def answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        start = int.from_bytes(frames[2], "big")
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart([frames[0], b"", self.topic, seq.to_bytes(8, "big"), payload])
        self.replay.send_multipart([frames[0], b"", b"", END_SEQ, b""])

    def close(self) -> None:
        for socket in (self.dealer, self.pub, self.replay):
            if socket is not None:
                socket.close(linger=0)


class KVEventRelay:
    """The relay thread: ``feeds`` is, per cache process, (its LMCache URL, the PUB endpoint, the replay one)."""

    def __init__(self, feeds: list[tuple[str, str, str]], topic: str = "", log: Any = None) -> None:
        self._context = zmq.Context()
        self._feeds = [_Feed(self._context, worker, *ends, topic.encode()) for worker, ends in enumerate(feeds)]
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

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
        for feed in self._feeds:
            feed.subscribe(self._context)
            poller.register(feed.replay, zmq.POLLIN)
        dealers = {feed.dealer: feed for feed in self._feeds}
        for socket in dealers:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(200):
                try:
                    if socket in dealers:
                        dealers[socket].receive()
                    else:
                        next(f for f in self._feeds if f.replay is socket).answer_replay()
                except Exception as exc:  # noqa: BLE001 - a bad frame costs that message, never the relay
                    if self._log is not None:
                        self._log.warning("kvpub.error", error=repr(exc))
            now = time.monotonic()
            for feed in self._feeds:
                if now - feed.heard > feed.patience:
                    feed.subscribe(self._context)
        for feed in self._feeds:
            feed.close()
        self._context.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
