"""The KV event records an L2 tier's changes become: a tier that keeps its own index here is logged as it holds
its chunks when the feed attaches (a restarted cache process's fs tier), and store tasks completing out of order
(one evicting what another stored, its completion handled first) leave the feed's last record of each key equal to
what the tier holds."""

from __future__ import annotations

from concurrent.futures import Future

from mpcache.cache.kvlog import STORED, KVEventLog
from mpcache.cache.l2.base import L2Adapter, LruIndex, StoreResult, Usage
from mpcache.cache.l2.failures import FailureCounts
from mpcache.cache.storage import StorageManager
from mpcache.contract.keys import ChunkKey

SIZE = 64  # bytes per chunk


class _Tier(L2Adapter):
    """A tier of two chunks whose store tasks run when the test says and complete when it says."""

    name = "fake"

    def __init__(self) -> None:
        self.capacity_bytes = 2 * SIZE
        self.failures = FailureCounts()
        self.listing = LruIndex(self.capacity_bytes)
        self.futures: list[Future] = []

    def submit_store(self, items):
        self.futures.append(Future())
        return self.futures[-1]

    def run(self, keys: list[ChunkKey]) -> StoreResult:
        """What a store task of ``keys`` does to the index (as fs and mock do): its result, not yet delivered."""
        evicted = []
        for key in keys:
            evicted += [victim for victim, _ in self.listing.reserve(key, SIZE).evicted]
            self.listing.commit(key)
        return StoreResult(list(keys), [], [], SIZE * len(keys), evicted)

    def lookup(self, keys):
        raise NotImplementedError

    def submit_load(self, keys, destinations):
        raise NotImplementedError

    def delete(self, keys):
        raise NotImplementedError

    def get_usage(self) -> Usage:
        return self.listing.usage()

    def close(self) -> None:
        pass


class _Quiet:
    """The publisher and gauges the storage manager writes to, kept nowhere."""

    def emit(self, *args, **kwargs) -> None:
        pass

    def set_adapter(self, *args) -> None:
        pass


def _held_by_feed(log: KVEventLog) -> set[ChunkKey]:
    """What the log's records of the tier say it holds, applied in order."""
    held: set[ChunkKey] = set()
    for record in log.records():
        key = ChunkKey(record.model, record.salt, record.key)
        if record.kind == STORED:
            held.add(key)
        else:
            held.discard(key)
    return held


def test_the_feed_holds_what_the_tier_holds_through_out_of_order_completions():
    tier = _Tier()
    kept = ChunkKey("m", "", 1)  # held since before the feed attached (an fs tier across a restart)
    tier.listing.add(kept, SIZE)
    storage = StorageManager([tier], ["fake"], _Quiet(), _Quiet(), lambda: None, chunk_bytes=SIZE)
    log = KVEventLog(100)
    storage.attach_feed(log)
    assert storage.held("m") == [("L2:fake", [kept])] and storage.held("other") == [("L2:fake", [])]
    assert _held_by_feed(log) == {kept}

    first, second, third = (ChunkKey("m", "s", n) for n in (2, 3, 4))
    storage.store("m", "s", [(2, bytes(SIZE))])
    storage.store("m", "s", [(3, bytes(SIZE)), (4, bytes(SIZE))])
    stored_first = tier.run([first])  # evicts ``kept``
    stored_after = tier.run([second, third])  # evicts ``first``: the tier holds second and third
    tier.futures[1].set_result(stored_after)  # the later task's completion is handled first
    tier.futures[0].set_result(stored_first)
    assert storage.poll() == 2
    assert set(tier.listing.keys_lru()) == {second, third}
    assert _held_by_feed(log) == {second, third}
