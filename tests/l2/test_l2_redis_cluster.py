"""The redis adapter on a real Redis Cluster (3 masters + 3 replicas on loopback, a new one per test): shards
on every master, sharing between writers, the capacity split, a failover under load, a frozen master, a lost
slot range, and MOVED / ASK during a resharding.  Each test creates its cluster in about 2 s."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from support.cluster_nodes import REDIS_CLI, REDIS_NOT_YET, REDIS_SERVER, Cluster
from support.l2 import MAC_KEY, key, payload, wait
from support.waiting import wait_for

from mpcache.cache.l2.base import L2LookupError, key_digest
from mpcache.cache.l2.redis_adapter import RedisL2Adapter
from mpcache.cache.l2.spec import build_adapter

pytestmark = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                reason="redis-server and redis-cli are needed for the Redis Cluster tests")

PREFIX = "mpcache:l2:"


@pytest.fixture
def cluster(tmp_path):
    started = Cluster(["127.0.0.1"] * 6, str(tmp_path / "cluster"))
    try:
        started.create()
        yield started
    finally:
        started.stop()


@pytest.fixture
def make_cluster_adapter(cluster, closing):
    def make(capacity_bytes: int = 1_000_000, **options) -> RedisL2Adapter:
        options.setdefault("mac_key", MAC_KEY)
        options.setdefault("socket_timeout_s", 0.3)
        options.setdefault("connect_timeout_s", 0.3)
        options.setdefault("down_for_s", 0.2)
        return closing(RedisL2Adapter(cluster.url, capacity_bytes, cluster=True, **options))

    return make


def data_keys_by_master(cluster: Cluster) -> dict[str, set[str]]:
    """Every data key of the tier, by the master that holds it (asked of each master directly)."""
    held = {}
    for address, info in cluster.nodes_view().items():
        if "master" in info["flags"] and "fail" not in info["flags"]:
            with cluster.node(address).client() as client:
                held[address] = {name.decode() for name in client.scan_iter(match=f"{PREFIX}*c:*", count=1000)}
    return held


def load_bytes(adapter, keys, size=1000):
    buffers = [bytearray(size) for _ in keys]
    result = wait(adapter.submit_load(keys, [memoryview(b) for b in buffers]))
    return result, {k: bytes(b) for k, b in zip(keys, buffers) if k in result.loaded}


def test_a_chunk_one_writer_stores_is_a_hit_with_the_same_bytes_for_another_and_counts_as_a_peer_load(
        make_cluster_adapter, cluster):
    """Two adapters (two service instances) on one cluster: what A stores, B finds and loads byte for byte,
    as peer chunks, and A loads as its own; the 16 shards put data on every master, each shard's keys (index
    and data) in one hash slot."""
    host_a, host_b = make_cluster_adapter(writer="host-a"), make_cluster_adapter(writer="host-b")
    keys = [key(i) for i in range(48)]
    stored = wait(host_a.submit_store([(k, payload(i)) for i, k in enumerate(keys)]))

    found = wait(host_b.lookup(keys + [key(999)]))
    on_b, bytes_b = load_bytes(host_b, keys)
    on_a, _ = load_bytes(host_a, keys)
    held = data_keys_by_master(cluster)

    assert (len(keys), [True] * len(keys) + [False]) == (len(stored.stored), found)
    assert {k: payload(i) for i, k in enumerate(keys)} == bytes_b
    assert (keys, keys, []) == (on_b.loaded, on_b.peer, on_a.peer)
    assert 3 == len(held) and all(held.values()) and len(keys) == sum(map(len, held.values()))
    with cluster.nodes[0].client() as client:
        for shard in range(16):
            slots = {client.cluster("keyslot", f"{PREFIX}{{{shard}}}{suffix}")
                     for suffix in ("lru", "size", "name", "stats", "writer", "c:0123")}
            assert 1 == len(slots), shard


def test_the_capacity_is_split_over_the_shards_and_lru_evicts_within_one(make_cluster_adapter):
    """With 4 shards of 2000 bytes, a third 1000-byte chunk in a shard evicts that shard's least recently used
    chunk only; usage is the sum over the shards."""
    adapter = make_cluster_adapter(capacity_bytes=8000, shards=4)
    by_shard: dict[int, list] = {}
    index = 0
    while len(by_shard.get(0, [])) < 3 or len(by_shard) < 4:
        by_shard.setdefault(int(key_digest(key(index))[:8], 16) % 4, []).append(key(index))
        index += 1
    first, second, third = by_shard[0][:3]
    others = [by_shard[shard][0] for shard in (1, 2, 3)]
    wait(adapter.submit_store([(k, payload(1)) for k in (first, second, *others)]))
    wait(adapter.lookup([first]))  # first is now more recently used than second

    result = wait(adapter.submit_store([(third, payload(3))]))

    assert [second] == result.evicted
    assert [True, False, True, True, True, True] == wait(adapter.lookup([first, second, third, *others]))
    assert (5000, 5) == adapter.refresh_usage()[::2]


class Load:
    """Loads and lookups of ``keys`` in a loop on its own thread: every outcome, and anything raised."""

    def __init__(self, adapter, keys) -> None:
        self.adapter, self.keys = adapter, keys
        self.outcomes: list[tuple[float, int, int, int]] = []  # (time, loaded, failed, wrong bytes)
        self.raised: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                try:
                    wait(self.adapter.lookup(self.keys))
                except L2LookupError:
                    pass  # every shard asked was down: a miss for all, which is allowed
                result, got = load_bytes(self.adapter, self.keys)
                wrong = sum(1 for k, data in got.items() if data != payload(k.chunk_hash))
                self.outcomes.append((time.monotonic(), len(result.loaded), len(result.failed), wrong))
            except BaseException as exc:  # noqa: BLE001 - what the test asserts never happens
                self.raised.append(exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _replicated(cluster: Cluster) -> None:
    """Wait until every master's writes reached its replica (WAIT), so a failover loses nothing."""
    for address, info in cluster.nodes_view().items():
        if "master" in info["flags"]:
            with cluster.node(address).client() as client:
                assert 1 == client.execute_command("WAIT", 1, 5000)


def test_a_killed_master_fails_over_and_loads_stay_correct_during_and_after(make_cluster_adapter, cluster):
    """SIGKILL the master of a third of the shards under a load loop: nothing raises, every loaded chunk has
    its bytes, failures are counted; once the replica is master every chunk loads again, and stores work."""
    adapter = make_cluster_adapter()
    keys = [key(i) for i in range(32)]
    wait(adapter.submit_store([(k, payload(i)) for i, k in enumerate(keys)]))
    _replicated(cluster)
    victim = cluster.owner_of_key(f"{PREFIX}{{0}}lru")
    replica = cluster.replica_of(victim)
    load = Load(adapter, keys)
    wait_for(lambda: len(load.outcomes) >= 3, 10, "loads before the failure", tolerate=REDIS_NOT_YET)

    killed_at = time.monotonic()
    victim.kill()
    cluster.wait_master(replica)
    wait_for(lambda: any(t > killed_at and loaded == len(keys) for t, loaded, _, _ in load.outcomes[-3:])
               or load.raised, 20, "every chunk to load again after the failover", tolerate=REDIS_NOT_YET)
    load.stop()
    after = wait(adapter.submit_store([(key(100), payload(100))]))

    assert [] == load.raised
    assert 0 == sum(wrong for *_, wrong in load.outcomes)
    assert any(failed for t, _, failed, _ in load.outcomes if t > killed_at), "the failure was never seen"
    assert adapter.failures.totals().get("load_error", 0) > 0
    assert [key(100)] == after.stored


def test_a_frozen_master_costs_timeouts_on_its_shards_only(make_cluster_adapter, cluster):
    """A master that stops answering (SIGSTOP): lookups of other shards' chunks still hit, its shards' chunks
    are unanswered (None: misses counted as lookup_error) after the socket timeout (0.3 s) instead of waiting for
    the master (``wait`` fails the test after TIMEOUT_S, 10 s), and after the failover they hit again."""
    adapter = make_cluster_adapter()
    keys = [key(i) for i in range(32)]
    wait(adapter.submit_store([(k, payload(i)) for i, k in enumerate(keys)]))
    _replicated(cluster)
    victim = cluster.owner_of_key(f"{PREFIX}{{0}}lru")
    replica = cluster.replica_of(victim)
    on_victim = {k for k in keys if cluster.owner_of_key(f"{PREFIX}{{{int(key_digest(k)[:8], 16) % 16}}}lru")
                 is victim}
    victim.process.send_signal(signal.SIGSTOP)
    try:
        found = wait(adapter.lookup(keys))
        cluster.wait_master(replica)
        again = wait_for(lambda: (lambda f: f if all(f) else None)(wait(adapter.lookup(keys))), 20,
                           "every chunk to be found after the failover", tolerate=REDIS_NOT_YET)
    finally:
        victim.process.send_signal(signal.SIGCONT)

    assert 0 < len(on_victim) < len(keys)
    assert [None if k in on_victim else True for k in keys] == found  # None: its shard could not be asked
    assert adapter.failures.totals()["lookup_error"] >= len(on_victim)
    assert [True] * len(keys) == again


def test_a_lost_slot_range_misses_and_the_rest_serves(make_cluster_adapter, cluster):
    """A master and its replica both killed (no copy of that slot range left): its chunks are misses and
    failed loads, counted; the other shards' chunks hit and load with their bytes; stores there still work."""
    adapter = make_cluster_adapter()
    keys = [key(i) for i in range(32)]
    wait(adapter.submit_store([(k, payload(i)) for i, k in enumerate(keys)]))
    victim = cluster.owner_of_key(f"{PREFIX}{{0}}lru")
    replica = cluster.replica_of(victim)
    lost = {k for k in keys if cluster.owner_of_key(f"{PREFIX}{{{int(key_digest(k)[:8], 16) % 16}}}lru")
            is victim}
    replica.kill()
    victim.kill()

    def lost_range_failed():
        found = wait(adapter.lookup(keys))
        return found if found == [None if k in lost else True for k in keys] else None

    found = wait_for(lost_range_failed, 20, "the lost range to miss and the rest to hit", tolerate=REDIS_NOT_YET)
    result, got = load_bytes(adapter, keys)
    kept = [k for k in keys if k not in lost]

    assert 0 < len(lost) < len(keys)
    assert [None if k in lost else True for k in keys] == found
    assert (kept, {k: payload(k.chunk_hash) for k in kept}) == (result.loaded, got)
    assert set(result.errors) == lost
    assert adapter.failures.totals()["lookup_error"] > 0


def test_moved_and_ask_during_a_resharding_are_followed(make_cluster_adapter, cluster):
    """A shard's slot migrated by hand: with its keys already on the target but the slot still migrating the
    source answers ASK, then after the move MOVED; loads return the right bytes throughout and the data ends on
    the target."""
    adapter = make_cluster_adapter()
    keys = [key(i) for i in range(32)]
    wait(adapter.submit_store([(k, payload(i)) for i, k in enumerate(keys)]))
    in_shard = [k for k in keys if int(key_digest(k)[:8], 16) % 16 == 0]
    tag_key = f"{PREFIX}{{0}}lru"
    source = cluster.owner_of_key(tag_key)
    view = cluster.nodes_view()
    target = next(cluster.node(a) for a, info in view.items() if "master" in info["flags"] and a != source.address)
    with source.client() as src, target.client() as tgt:
        slot = src.cluster("keyslot", tag_key)
        tgt.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", view[source.address]["node_id"])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", view[target.address]["node_id"])
        names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *names)
        asked, asked_bytes = load_bytes(adapter, in_shard)
        for master in (a for a, info in view.items() if "master" in info["flags"]):
            with cluster.node(master).client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", view[target.address]["node_id"])
        moved, moved_bytes = load_bytes(adapter, keys)
        on_target = {name.decode() for name in tgt.scan_iter(match=f"{PREFIX}{{0}}*", count=1000)}
        left_on_source = list(src.scan_iter(match=f"{PREFIX}{{0}}*", count=1000))

    assert in_shard and len(names) == 5 + len(in_shard)  # lru, size, name, stats, writer + the data keys
    assert (in_shard, {k: payload(k.chunk_hash) for k in in_shard}) == (asked.loaded, asked_bytes)
    assert (keys, {k: payload(k.chunk_hash) for k in keys}) == (moved.loaded, moved_bytes)
    assert ({name.decode() for name in names}, []) == (on_target, left_on_source)


def test_a_cluster_that_wants_a_password_serves_only_with_it(tmp_path, closing):
    """Every node with requirepass: the tier built from a spec with password_file stores and loads; without
    the password every operation fails, counted, and nothing raises."""
    cluster = Cluster(["127.0.0.1"] * 6, str(tmp_path / "cluster"), password="cluster-pw-5e1b")
    try:
        cluster.create()
        password_file = tmp_path / "redis.pw"
        password_file.write_text("cluster-pw-5e1b\n")
        password_file.chmod(0o600)
        spec = {"type": "redis", "cluster": True, "url": cluster.url, "capacity_gb": 0.001, "shards": 4,
                "password_file": str(password_file)}
        with_password = closing(build_adapter(spec, 1000, MAC_KEY))
        without = closing(RedisL2Adapter(cluster.url, 100_000, mac_key=MAC_KEY, cluster=True, shards=4))
        stored = wait(with_password.submit_store([(key(1), payload(1))]))
        _, got = load_bytes(with_password, [key(1)])
        refused = wait(without.submit_store([(key(2), payload(2))]))
        with pytest.raises(L2LookupError):
            wait(without.lookup([key(1)]))
    finally:
        cluster.stop()

    assert ([key(1)], {key(1): payload(1)}) == (stored.stored, got)
    assert [key(2)] == refused.failed
    assert without.failures.totals()["store_error"] >= 1
