"""The KV event relay (``mpcache.telemetry.kvpub``) against a stand-in cache process (a pyzmq ROUTER answering
``subscribe_kv_events`` by hand) and a router's SUB: each way a message can be lost shows as a gap or a resync."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from support.ports import free_ports
from support.waiting import wait_for

from mpcache.telemetry import kvpub

pytestmark = pytest.mark.timeout(60)


class FakeCache:
    """A ROUTER that records the relay's subscriptions and answers them with the batches the test gives."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(url)
        self.subscriptions: list[tuple[bytes, bytes, int]] = []  # (identity, uid, cursor)
        self.acks = 0

    def serve(self) -> None:
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            if frames[2] == b"":
                self.acks += frames[3] == b"ack"
            else:
                assert frames[2] == kvpub.OP and msgpack.unpackb(frames[4]) == kvpub.ALL_MODELS
                self.subscriptions.append((frames[0], frames[1], msgpack.unpackb(frames[5])))

    def wait_subscription(self, count: int) -> tuple[bytes, bytes, int]:
        wait_for(lambda: self.serve() or len(self.subscriptions) >= count, 10, f"subscription {count}")
        return self.subscriptions[count - 1]

    def send(self, events: list[dict], *, cursor: int, lost: bool = False, incarnation: int = 1) -> None:
        identity, uid, _ = self.subscriptions[-1]
        batch = {"enabled": True, "incarnation": incarnation, "next_cursor": cursor, "lost": lost, "events": events}
        self.router.send_multipart([identity, uid, kvpub.OP, msgpack.packb(batch)])

    def end(self) -> None:
        identity, uid, _ = self.subscriptions[-1]
        self.router.send_multipart([identity, uid, kvpub.OP])

    def close(self) -> None:
        self.router.close(linger=0)


def started_relay(tmp_path) -> tuple[FakeCache, kvpub.KVEventRelay, int, int]:
    """A stand-in cache process and a relay of it, started: (cache, relay, PUB port, replay port)."""
    pub_port, replay_port = free_ports(2, run=True)
    cache = FakeCache(f"ipc://{tmp_path}/cache.ipc")
    relay = kvpub.KVEventRelay([(cache.url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")])
    relay.start()
    return cache, relay, pub_port, replay_port


def stored(block: bytes, salt: str = "") -> dict:
    return {"seq": 1, "kind": "stored", "medium": "CPU", "model_name": "m", "block_hashes": [block],
            "parent_block_hash": None, "token_ids": [1, 2], "cache_salt": salt}


def test_losses_show_as_gaps_and_resyncs(monkeypatch, tmp_path):
    """The relay subscribes on each connection (a restarted cache process), again when its stream is ended and
    never merely because it is quiet; an empty batch follows a quiet ``HEARTBEAT_S``, so a SUB that joined after
    the last message sees the gap; a replay older than the buffer gets what it holds and makes the relay ask the
    cache process for everything again (cursor 0), published after AllBlocksCleared."""
    monkeypatch.setattr(kvpub, "BUFFER_STEPS", 12)
    monkeypatch.setattr(kvpub, "HEARTBEAT_S", 0.25)
    cache, relay, pub_port, replay_port = started_relay(tmp_path)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert cache.wait_subscription(1)[2] == 0
        cache.send([stored(b"a" * 8, "tenant")], cursor=1)  # published before any SUB: lost to it
        wait_for(lambda: cache.serve() or cache.acks == 1, 10, "the first ack")
        base, payload = replay(replay_port, 0)[0]
        events = msgpack.unpackb(payload)[1]
        assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]  # a new incarnation's first
        assert events[1]["extra_keys"] == [["tenant"]] and events[1]["medium"] == "CPU"
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        _, seq, payload = wait_for(lambda: sub.poll(100) and sub.recv_multipart(), 10, "a heartbeat")
        assert int.from_bytes(seq, "big") > base and msgpack.unpackb(payload)[1] == []  # the missed one: a gap
        assert replay(replay_port, base)[0][0] == base  # ... which replay fills
        wait_for(lambda: relay.counts[0].subscribers == 1, 10, "the SUB counted")
        assert len(cache.subscriptions) == 1  # quiet, never subscribed again for it

        wait_for(lambda: relay.counts[0].messages > kvpub.BUFFER_STEPS + 1, 10, "heartbeats past the buffer")
        assert replay(replay_port, base)[0][0] > base  # older than the buffer: what it holds
        _, _, cursor = cache.wait_subscription(2)  # ... and everything again from the cache process
        assert cursor == 0
        cache.send([stored(b"b" * 8)], cursor=5, lost=True)
        wait_for(lambda: any(msgpack.unpackb(p)[1][:1] == [{"type": "AllBlocksCleared"}]
                             for _, p in replay(replay_port, 0)), 10, "AllBlocksCleared after the resync")

        cache.end()  # the cache process ended the stream (another subscriber took its place)
        assert cache.wait_subscription(3)[2] == 5
        cache.close()  # a restarted cache process: subscribed again on the new connection, from the cursor
        cache = FakeCache(cache.url)
        assert cache.wait_subscription(1)[2] == 5
        counts = relay.counts[0]
        assert counts.resyncs == 2 and counts.records == 2 and counts.replays >= 4 and counts.subscriptions == 4
    finally:
        sub.close(linger=0)
        relay.stop()
        cache.close()


def replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message vLLM's replay socket answers for ``start``."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.connect(f"tcp://127.0.0.1:{port}")
    out = []
    try:
        socket.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            _, _, seq, payload = socket.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) < 0:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        socket.close(linger=0)


def test_the_replay_buffer_holds_at_most_its_bytes(monkeypatch, tmp_path):
    """Batches of long blocks fill the replay buffer by bytes long before its count of messages: it keeps the newest
    within ``BUFFER_BYTES`` (a count alone let full batches hold gigabytes per cache process), and a replay from the
    start gets those."""
    monkeypatch.setattr(kvpub, "BUFFER_BYTES", 4096)
    monkeypatch.setattr(kvpub, "HEARTBEAT_S", 60.0)
    cache, relay, _, replay_port = started_relay(tmp_path)
    try:
        cache.wait_subscription(1)
        for number in range(6):
            long_block = {**stored(bytes([number]) * 8), "token_ids": list(range(1000, 1600))}  # ~1.8 kB a batch
            cache.send([long_block], cursor=number + 1)
            wait_for(lambda done=number + 1: cache.serve() or cache.acks == done, 10, f"ack {number + 1}")
        kept = replay(replay_port, 0)
        assert 6 == relay.counts[0].messages
        assert 1 < len(kept) < 6 and sum(len(payload) for _, payload in kept) <= 4096
        assert [seq for seq, _ in kept] == list(range(kept[0][0], kept[0][0] + len(kept)))  # the newest, in order
        assert msgpack.unpackb(kept[-1][1])[1][0]["block_hashes"] == [bytes([5]) * 8]
    finally:
        relay.stop()
        cache.close()
