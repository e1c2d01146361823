"""The KV event feed replayed against what the cache holds: a mixed workload of more than 10⁵ chunk events through
``bin/start-cache`` (stores of fresh and repeated chunks in two tenants into a small L1, so every store evicts;
``clear``; ``kill -9`` of the cache process, and of the telemetry process, which this stream never touches), and an
index a router builds from ``subscribe_kv_events`` alone equals L1's actual contents at every checkpoint: every
block it holds is found by one lookup on the native socket (0 stale) and it holds as many blocks as L1's bytes
in use hold objects (0 missing).  A router's index built from the vLLM-format PUB feed the telemetry process
relays (``--kv-events-endpoint``) equals it too at every checkpoint, through a dropped message every third
checkpoint (filled through the replay socket), both cache restarts and the relay's own ``kill -9``; vLLM's own
``KVEventBatch`` decoder reads every message it applied as the same events."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import msgpack
from support.kv_feed import Index, PubIndex, Stream, block_hash
from support.lmcache_client import LMClient
from support.ports import free_ports
from support.vllm_args import vllm_python
from support.waiting import wait_for

from mpcache.cache.lmcache import kvevents
from mpcache.client import CacheClient
from mpcache.contract.keys import ChunkKey
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.shm.segment import Segment
from mpcache.telemetry import kvpub

CHUNK = 4096  # bytes per object (the native protocol's chunks)
SLOTS = 256  # L1 objects
BATCH = 64  # chunks per store
MODEL = "org/replay"
SALTS = ("", "tenant-b")
EVENTS = 100_000


class Cache:
    """The service's cache process 0 as the test reaches it: a native client with a buffer, an LMCache client
    (for clear), a subscription to its feed and the gauge board."""

    def __init__(self, service, board: GaugeBoardReader) -> None:
        self.service, self.board = service, board
        self.native = CacheClient(service.socket(0))
        self.buffer = self.native.register_buffer(BATCH, CHUNK)
        url = service.config().lmcache_urls(0)[0]
        self.lmcache = LMClient(url)
        self.stream = Stream(url, MODEL)

    def close(self) -> None:
        self.native.close()
        self.lmcache.close()
        self.stream.close()

    def objects(self) -> int:
        used = self.board.word(0, layout.G_L1_USED)
        assert used % CHUNK == 0
        return used // CHUNK


def _kill_and_wait(service, role: str) -> None:
    """``kill -9`` the child and wait until its successor serves (a cache process: its socket answers)."""
    pids = service.pids(role)
    os.kill(pids[-1], signal.SIGKILL)
    wait_for(lambda: len(service.pids(role)) > len(pids) and (
        role != "cache" or service.lines("cache.start", pid=service.pids(role)[-1])), 60, f"a new {role} process")


def test_an_index_built_from_the_feed_equals_l1_at_every_checkpoint(start_service, tmp_path):
    service = start_service("--workers", "1", "--lmcache-ipc", "--lmcache-allow-clear", "--chunk-bytes", str(CHUNK),
                            "--l1-size", str(SLOTS * CHUNK), "--chunk-size", "16", "--kv-event-log-size", "32768",
                            "--kv-events-endpoint", f"tcp://127.0.0.1:{free_ports(2, run=True)[0]}")
    service.ready(metrics=False)
    segment = Segment.attach(service.config().gauge_board_name())
    board = GaugeBoardReader(segment)
    rng = random.Random(38)
    known: dict[tuple[str, bytes], ChunkKey] = {}  # what the test stored, by the feed's name for it
    recent: list[tuple[str, int]] = []
    cache = Cache(service, board)
    index = Index()
    pub = PubIndex(*service.config().kv_events_endpoints(0))
    checkpoints = restarts = marker_seq = 0
    try:
        for step in range(2_000):
            if index.records >= EVENTS and restarts >= 2:
                break
            salt = SALTS[step % 2]
            hashes = [rng.getrandbits(63) for _ in range(BATCH)]
            if step % 5 == 0:  # repeats: those still held are touched, evicted ones are stored again
                again = [h for s, h in recent if s == salt]
                hashes[: BATCH // 2] = rng.sample(again, min(BATCH // 2, len(again)))
                hashes = list(dict.fromkeys(hashes))
            for h in hashes:
                known[block_hash(ChunkKey(MODEL, salt, h))] = ChunkKey(MODEL, salt, h)
            recent = (recent + [(salt, h) for h in hashes])[-4 * SLOTS:]
            cache.native.store(cache.buffer, request_id=f"s{step}", model_name=MODEL, cache_salt=salt,
                                        chunk_hashes=hashes, block_ids=list(range(len(hashes))))
            cache.native.end_session(f"s{step}")
            if step % 97 == 96:
                cache.lmcache.call("clear")
            if step % 331 == 330:
                _kill_and_wait(service, "telemetry")  # the stream does not go through it; the PUB feed does
            if step % 40 == 39 or step % 97 == 96:
                marker_seq += 1
                pub.drop_next = checkpoints % 3 == 0  # a forced gap, filled through the replay socket
                _checkpoint(cache, index, known, marker_seq, pub)
                checkpoints += 1
            if step in (450, 900):  # kill -9 the cache process: the feed's next incarnation starts from nothing
                _checkpoint(cache, index, known, marker_seq + 1000, pub)
                cache.close()
                _kill_and_wait(service, "cache")
                restarts += 1
                cache = Cache(service, board)
                before = index.resyncs
                _checkpoint(cache, index, known, marker_seq + 2000, pub)
                assert index.resyncs == before + 1  # the new incarnation
        _checkpoint(cache, index, known, marker_seq + 3000, pub)
        assert index.records >= EVENTS and restarts == 2 and checkpoints >= 20
        assert index.removed_unknown == 0
        assert pub.dropped >= 5 and pub.replays >= pub.dropped and pub.cleared >= 3  # gaps filled; restarts resynced
        # the relay's own metrics: this router's SUB, what it published, the gaps it filled
        scrape = wait_for(service.scrape, 30, "/metrics")
        assert scrape.total("mpcache_kv_pub_subscribers", worker="0") == 1
        assert scrape.total("mpcache_kv_pub_records_total") > 0 and scrape.total("mpcache_kv_pub_replays_total") > 0
        decoded_by_vllm(pub.payloads, tmp_path)
        assert kvpub.ALL_MODELS == kvevents.ALL_MODELS  # the relay's subscription, named in two layers
    finally:
        pub.close()
        cache.close()
        board = None
        segment.close()


def _checkpoint(cache: Cache, index: Index, known: dict, marker: int, pub: PubIndex) -> None:
    """Store a marker chunk, read the feed until its stored record, and hold the index against L1."""
    marker_hash = (1 << 63) | marker
    key = ChunkKey(MODEL, "", marker_hash)
    known[block_hash(key)] = key
    cache.native.store(cache.buffer, request_id=f"m{marker}", model_name=MODEL, chunk_hashes=[marker_hash],
                       block_ids=[0])
    cache.native.end_session(f"m{marker}")
    wanted = block_hash(key)
    while wanted not in index.blocks:
        batch = cache.stream.next()
        assert batch is not None, "the stream ended"
        index.apply(batch)
    assert set(index.blocks) <= set(known), "the feed names a block nobody stored"
    for salt in SALTS:
        held = [known[block].chunk_hash for block in index.blocks if known[block].cache_salt == salt]
        if held:
            job = cache.native.lookup_prefetch(request_id=f"probe{marker}{salt}", model_name=MODEL, cache_salt=salt,
                                               chunk_hashes=held)
            found = cache.native.wait_prefetch(job).found_count
            cache.native.end_session(f"probe{marker}{salt}")
            assert found == len(held), f"stale: {len(held) - found} of {len(held)} blocks of {salt!r} not in L1"
    assert len(index.blocks) == cache.objects(), "missing: L1 holds objects the feed never announced"
    expected = {block for _, block in index.blocks}  # what L1 holds, just checked

    def caught_up() -> bool:
        while pub.take(0):
            pass
        return pub.synced and pub.blocks == expected

    try:
        wait_for(caught_up, 60, "the PUB feed's index to equal L1's contents")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {len(pub.payloads)} messages applied (next {pub.expected}), "
                             f"{len(pub.blocks - expected)} stale, {len(expected - pub.blocks)} missing: "
                             f"replays {pub.replays}, cleared {pub.cleared}, resyncs {pub.resyncs}, "
                             f"synced {pub.synced}") from None


DECODE = """import json, sys, msgpack, msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
batches = [decoder.decode(p) for p in msgpack.unpackb(open(sys.argv[1], "rb").read())]
print(json.dumps([[[type(e).__name__, [h.hex() for h in getattr(e, "block_hashes", [])], getattr(e, "medium", None)]
                   for e in b.events] for b in batches]))
"""


def decoded_by_vllm(payloads: list[bytes], tmp_path) -> None:
    """vLLM's own decoder (``KVEventBatch`` of vllm.distributed.kv_events) reads every payload the PUB index
    applied as the same events."""
    python = vllm_python()
    if python is None:
        assert os.environ.get("MPCACHE_TEST_REQUIRE_VLLM") != "1", "MPCACHE_TEST_REQUIRE_VLLM=1: no vLLM venv"
        return
    path = tmp_path / "payloads.msgpack"
    path.write_bytes(msgpack.packb(payloads))
    done = subprocess.run([python, "-c", DECODE, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    ours = [[[e["type"], [h.hex() for h in e.get("block_hashes", [])], e.get("medium")] for e in
             msgpack.unpackb(p, raw=False)[1]] for p in payloads]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ours
