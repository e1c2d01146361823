"""A hand-framing client of LMCache's ``subscribe_kv_events`` stream (pyzmq + msgpack, no LMCache), and the index a
router builds from it: what a test compares with what the cache holds."""

from __future__ import annotations

import hashlib
import itertools

import msgpack

from mpcache.contract.keys import ChunkKey
from support.zmq_sockets import dealer

OP = msgpack.packb("subscribe_kv_events")


def block_hash(key: ChunkKey) -> tuple[str, bytes]:
    """What the feed calls an L1 object (by its model): its key's 8 bytes, big-endian; with a salt, blake2b-64 of
    the salt, a zero byte and those bytes."""
    raw = key.chunk_hash.to_bytes(8, "big")
    if key.cache_salt:
        raw = hashlib.blake2b(key.cache_salt.encode() + b"\0" + raw, digest_size=8).digest()
    return key.model_name, raw


class Stream:
    """One subscription on its own DEALER connection: :meth:`next` acknowledges the batch before (from the second
    on) and returns the next; a reply with no batch frame is returned as None (the stream's end)."""

    def __init__(self, url: str, model: str, *, instance_id: int = 7, cursor: int = 0, max_events: int = 1024,
                 timeout_s: float = 10.0) -> None:
        self.socket = dealer(timeout_ms=int(timeout_s * 1000))
        self.socket.connect(url)
        self._timeout_ms = int(timeout_s * 1000)
        self._uids = itertools.count(1000)
        self.uid = msgpack.packb(next(self._uids))
        self.started = False
        self.socket.send_multipart([self.uid, OP, msgpack.packb(instance_id), msgpack.packb(model),
                                    msgpack.packb(cursor), msgpack.packb(max_events)])

    def ack(self) -> None:
        self.socket.send_multipart([self.uid, b"", b"ack"])

    def cancel(self) -> None:
        self.socket.send_multipart([self.uid, b"", b"cancel"])

    def receive(self) -> list[bytes]:
        assert self.socket.poll(self._timeout_ms), f"nothing within {self._timeout_ms} ms"
        return self.socket.recv_multipart()

    def next(self) -> dict | None:
        if self.started:
            self.ack()
        self.started = True
        frames = self.receive()
        assert frames[:2] == [self.uid, OP], f"not this stream's reply: {frames[:2]!r}"
        return msgpack.unpackb(frames[2], raw=False) if len(frames) == 3 else None

    def ping(self) -> list[bytes]:
        """A ping on the stream's own connection; the first frames that come back (whatever they answer)."""
        uid = msgpack.packb(next(self._uids))
        self.socket.send_multipart([uid, msgpack.packb(22), msgpack.packb(None)])
        return self.receive()

    def close(self) -> None:
        self.socket.close(linger=0)


class Index:
    """What a router knows from the feed: (model, block hash) of each readable L1 object, with its record
    (``blocks``), and of each object an L2 tier holds, by the tier's medium (``tiers``)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, bytes], dict] = {}
        self.tiers: dict[str, dict[tuple[str, bytes], dict]] = {}
        self.incarnation: int | None = None
        self.resyncs = 0
        self.removed_unknown = 0  # removals of blocks the index did not hold (a feed out of order shows here)
        self.cursor = 0
        self.records = 0  # stored and removed records applied

    def apply(self, batch: dict) -> None:
        assert batch["enabled"]
        if self.incarnation != batch["incarnation"] or batch["lost"]:
            if self.incarnation is not None:
                self.resyncs += 1
            self.blocks.clear()
            self.tiers.clear()
            self.incarnation = batch["incarnation"]
        self.records += len(batch["events"])
        for event in batch["events"]:
            assert len(event["block_hashes"]) == 1
            medium = event["medium"]
            held = self.blocks if medium == "CPU" else self.tiers.setdefault(medium, {})
            block = (event["model_name"], event["block_hashes"][0])
            if event["kind"] == "stored":
                held[block] = event
            else:
                assert event["kind"] == "removed", event
                if held.pop(block, None) is None:
                    self.removed_unknown += 1

    def catch_up(self, stream: Stream, last: int) -> None:
        """Read batches until the stream's cursor reaches ``last`` (the log's last record of the stream's model)."""
        if not stream.started:
            self._take(stream)
        while self.cursor < last:
            self._take(stream)

    def _take(self, stream: Stream) -> None:
        batch = stream.next()
        assert batch is not None, "the stream ended"
        self.apply(batch)
        self.cursor = batch["next_cursor"]


class PubIndex:
    """What a router subscribed to mpcache's vLLM-format PUB socket knows: (model-less) block hashes of what L1
    holds (``blocks``) and of what each L2 tier holds (``tiers``, by medium), from
    ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``.  A gap in the sequence numbers is filled through the
    replay socket; one the replay cannot fill (its first message comes after the gap's start: older than the
    relay's buffer, or from before a restarted relay) drops the index, which is built again from the next
    ``AllBlocksCleared`` (vLLM's resync).  ``drop_next`` throws the next message away, unread: a forced gap.  Every
    payload applied is kept (``payloads``) for vLLM's own decoder to read afterwards."""

    def __init__(self, endpoint: str, replay: str) -> None:
        import zmq

        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.blocks: set[bytes] = set()
        self.tiers: dict[str, set[bytes]] = {}
        self.expected = -1  # the next sequence number to apply (-1: none came yet)
        self.synced = False  # the index follows an AllBlocksCleared it applied (else: waiting for one)
        self.drop_next = False
        self.replays = 0
        self.resyncs = 0  # gaps the replay could not fill
        self.dropped = 0
        self.cleared = 0
        self.payloads: list[bytes] = []

    def close(self) -> None:
        self.sub.close(linger=0)

    def take(self, timeout_ms: int) -> bool:
        """Apply the next message (and what replay gives for a gap before it); False when none came in time."""
        if not self.sub.poll(timeout_ms):
            return False
        _, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if self.drop_next and self.expected >= 0 and self.sub.poll(0):  # with a message after it, showing the gap
            self.drop_next = False
            self.dropped += 1
        elif seq > self.expected:  # a gap (the first message: everything before it) filled through replay
            self._replay(max(self.expected, 0))
        elif seq == self.expected:
            self._apply(seq, payload)
        return True

    def _replay(self, start: int) -> None:
        socket = dealer()
        socket.connect(self.replay_endpoint)
        first = None
        try:
            socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                _, _, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    break
                if first is None:
                    first = seq
                    if seq > start:  # the gap cannot be filled: start again from the next AllBlocksCleared
                        self.synced = False
                        self.resyncs += 1
                if seq >= self.expected:
                    self._apply(seq, payload)
        finally:
            socket.close(linger=0)
        self.replays += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        _, events, _ = msgpack.unpackb(payload, raw=False)
        if events and events[0]["type"] == "AllBlocksCleared":
            self.synced = True
        if not self.synced:
            return
        self.payloads.append(payload)
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.blocks.clear()
                self.tiers.clear()
                self.cleared += 1
                continue
            held = self.blocks if event["medium"] == "CPU" else self.tiers.setdefault(event["medium"], set())
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            else:
                assert event["type"] == "BlockRemoved", event
                held.difference_update(event["block_hashes"])
