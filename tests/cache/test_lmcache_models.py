"""Several models on one L1 at once: LMCache registrations of three object sizes (one of them TP=2) and a
native-protocol client, storing and retrieving concurrently through the same shared-memory pool."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
from support.lmcache_client import LMClient, key, registration

from mpcache.contract.events import EventType as E
from mpcache.shm import layout

CHUNK = 256
KIB, MIB = 2**10, 2**20
# name → (instance ids per rank, registration fields, object bytes per rank)
MODELS = {
    "org/small": ((1,), dict(layers=2, hidden=64), 2 * 2 * CHUNK * 64 * 2),  # 128 KiB
    "org/mla": ((2,), dict(layers=3, hidden=576, mla=True), 3 * CHUNK * 576 * 2),  # 864 KiB: a 2-slab run
    "org/tp2": ((3, 4), dict(layers=4, hidden=256, world_size=2), 2 * 4 * CHUNK * 256 * 2),  # 1 MiB per rank
}
ROUNDS = 8


def _data(model: str, round_: int, rank: int, chunk: int, length: int) -> bytes:
    seed = [ord(c) for c in model] + [round_, rank, chunk]
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


def _tokens(model: str, round_: int) -> list[int]:
    base = (sum(map(ord, model)) * 1000 + round_) * 4 * CHUNK
    return list(range(base, base + 2 * CHUNK))


@pytest.fixture
def shared(cache):
    """An 8 MiB LRU L1 (16 slabs of 512 KiB; native chunk 64 KiB) serving LMCache on ipc://, and the pool mapped."""
    # LRU: every store must get its slots and evict across object sizes; the default order may refuse a store
    # seen once where only objects seen again could give room, which is not what this tests.
    harness = cache(chunk_size_tokens=CHUNK, chunk_bytes=64 * KIB, l1_size_bytes=8 * MIB, lmcache_ipc=True,
                    l1_policy="lru")
    url = harness.config.lmcache_urls(0)[0]
    setup = LMClient(url)
    for model, (instances, fields, _) in MODELS.items():
        for instance in instances:
            reply = setup.call("register", registration(instance, model=model, **fields))
    fd = os.open(os.path.join("/dev/shm", reply["shm_name"]), os.O_RDWR)
    pool = mmap.mmap(fd, reply["pool_size"])
    os.close(fd)
    yield harness, url, pool
    setup.close()
    pool.close()


def _lmcache_worker(url: str, pool: mmap.mmap, model: str, outcome: dict) -> None:
    """Per round: store 2 chunks on every rank, then read back this round and an older one (if still a hit)."""
    instances, fields, size = MODELS[model]
    world = fields.get("world_size", 1)
    client = LMClient(url)
    try:
        for round_ in range(ROUNDS):
            tokens = _tokens(model, round_)
            for rank, instance in enumerate(instances):
                stored = key(tokens, f"{model}-s{round_}-{rank}", model=model, worker_id=rank, world_size=world)
                prepared = client.call("prepare_store", stored, instance)["context"]
                assert [size, size] == [slot["length"] for slot in prepared["slots"]]
                for chunk, slot in zip(prepared["chunk_indices"], prepared["slots"]):
                    pool[slot["offset"] : slot["offset"] + size] = _data(model, round_, rank, chunk, size)
                assert True is client.call("commit_store", stored, instance, b"")
            for old in sorted({round_, round_ // 2}, reverse=True):
                request = f"{model}-r{round_}-{old}"
                tokens = _tokens(model, old)
                client.call("lookup", key(tokens, request, model=model, world_size=world), instances[0])
                hits = client.call("query_prefetch_status", request)
                if hits == 2:
                    for rank, instance in enumerate(instances):
                        wanted = key(tokens, request, model=model, worker_id=rank, world_size=world)
                        reply = client.call("prepare_retrieve", wanted, instance)
                        assert reply["success"], (model, old, rank)
                        for chunk, slot in enumerate(reply["context"]["slots"]):
                            got = pool[slot["offset"] : slot["offset"] + slot["length"]]
                            assert _data(model, old, rank, chunk, size) == got, (model, old, rank, chunk)
                        assert True is client.call("commit_retrieve", wanted, instance)
                    outcome["verified"] = outcome.get("verified", 0) + 2 * len(instances)
                else:
                    outcome["missed"] = outcome.get("missed", 0) + 1
                client.call("end_session", request)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        outcome["error"] = exc
    finally:
        client.close()


def _native_worker(harness, outcome: dict) -> None:
    """mpcache's own protocol on the same pool: 64 KiB blocks stored, looked up, retrieved and compared."""
    try:
        with harness.client() as client, client.register_buffer(4, 64 * KIB) as buffer:
            for round_ in range(ROUNDS):
                hashes = [10_000 + round_ * 4 + i for i in range(4)]
                blocks = np.frombuffer(b"".join(_data("native", round_, 0, i, 64 * KIB) for i in range(4)),
                                       dtype=np.uint8).reshape(4, 64 * KIB)
                buffer.blocks[:] = blocks
                result = client.store(buffer, request_id=f"n{round_}", model_name="native", chunk_hashes=hashes,
                                      block_ids=range(4))
                assert 4 == result.stored
                buffer.blocks[:] = 0
                job = client.lookup_prefetch(request_id=f"n{round_}", model_name="native", chunk_hashes=hashes)
                found = client.query_prefetch_status(job).found_count
                if found:  # the LMCache writers may have evicted all four since the store
                    got = client.retrieve(buffer, request_id=f"n{round_}", job_id=job, block_ids=range(found))
                    assert np.array_equal(blocks[: got.retrieved], buffer.blocks[: got.retrieved])
                    outcome["verified"] = outcome.get("verified", 0) + got.retrieved
                client.end_session(f"n{round_}")
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        outcome["error"] = exc


def test_three_models_and_a_native_client_share_l1_with_verified_bytes_and_evictions(shared):
    """Three LMCache models (128 KiB, 864 KiB and 2 x 1 MiB objects per chunk) and a native client store
    and retrieve at once into an 8 MiB L1 they overfill several times: every object read back holds
    exactly the bytes its writer wrote, objects of every size are evicted (LRU across sizes), and the
    gauges show bytes used and fragmentation exactly as the allocator counts them."""
    harness, url, pool = shared
    outcomes: dict[str, dict] = {name: {} for name in [*MODELS, "native"]}
    threads = [threading.Thread(target=_lmcache_worker, args=(url, pool, model, outcomes[model]))
               for model in MODELS]
    threads.append(threading.Thread(target=_native_worker, args=(harness, outcomes["native"])))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    for name, outcome in outcomes.items():
        assert "error" not in outcome, (name, outcome["error"])
        assert outcome.get("verified", 0) > 0, name
    evicted = harness.events.take().salt_totals([E.L1_KEYS_EVICTED])
    assert {("", model) for model in MODELS} <= {group for group, count in evicted.items() if count}
    l1 = harness.server.l1
    assert 0 < l1.used_bytes <= l1.capacity_bytes == 8 * MIB
    gauges = harness.server.ctx.gauges
    assert (l1.used_bytes, l1.fragmentation_bytes) == (gauges.get(layout.G_L1_USED),
                                                         gauges.get(layout.G_L1_FRAGMENTATION))
    assert l1.fragmentation_bytes == l1.allocator.carved_bytes - l1.used_bytes
