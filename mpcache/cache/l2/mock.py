"""An in-memory L2 adapter with latency, bandwidth and seeded failures decided at submission (so the keys
that fail depend only on the seed and the order of submissions).  For tests and the demo.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from mpcache.cache.l2.base import (
    L2Adapter,
    LoadResult,
    LruIndex,
    StoreResult,
    Usage,
    byte_view,
    check_load_args,
)
from mpcache.cache.l2.failures import FailureCounts
from mpcache.contract.keys import ChunkKey


class MockL2Adapter(L2Adapter):
    """Chunks in a dict, LRU-evicted at ``capacity_bytes``."""

    name = "mock"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float = 0.0,
        failure_rate: float = 0.0,
        seed: int = 0,
        threads: int = 4,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be in [0, 1], got {failure_rate}")
        self.capacity_bytes = capacity_bytes
        self.latency_s = latency_s
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s  # 0: unlimited
        self.failure_rate = failure_rate
        self._sleep = sleep
        self.failures = FailureCounts()  # stays empty: injected failures are the point, not news
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._index = self.listing = LruIndex(capacity_bytes)
        self._data: dict[ChunkKey, bytes] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-mock")

    # -- the interface -------------------------------------------------------------------------

    def submit_store(self, items: list[tuple[ChunkKey, bytes | memoryview]]) -> Future[StoreResult]:
        views = [(key, byte_view(data)) for key, data in items]
        return self._pool.submit(self._store, views, self._draw(len(views)))

    def lookup(self, keys: list[ChunkKey]) -> Future[list[bool | None]]:
        return self._pool.submit(self._lookup, list(keys))

    def submit_load(self, keys: list[ChunkKey], destinations: list[memoryview]) -> Future[LoadResult]:
        check_load_args(keys, destinations)
        return self._pool.submit(self._load, list(keys), list(destinations), self._draw(len(keys)))

    def delete(self, keys: list[ChunkKey]) -> Future[int]:
        return self._pool.submit(self._delete, list(keys))

    def get_usage(self) -> Usage:
        return self._index.usage()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- worker side ---------------------------------------------------------------------------

    def _draw(self, count: int) -> list[bool]:
        with self._rng_lock:
            return [self._rng.random() < self.failure_rate for _ in range(count)]

    def _pause(self, nbytes: int) -> None:
        delay = self.latency_s
        if self.bandwidth_bytes_per_s > 0:
            delay += nbytes / self.bandwidth_bytes_per_s
        if delay > 0:
            self._sleep(delay)

    def _store(self, items: list[tuple[ChunkKey, memoryview]], fails: list[bool]) -> StoreResult:
        self._pause(sum(len(data) for _, data in items))
        evicted: list[ChunkKey]
        stored, skipped, failed, evicted = [], [], [], []
        written = 0
        for (key, data), fail in zip(items, fails):
            if self._index.touch([key])[0]:
                skipped.append(key)
                continue
            if fail:
                failed.append(key)
                continue
            reservation = self._index.reserve(key, len(data), on_evict=self._data.pop)
            evicted.extend(victim for victim, _ in reservation.evicted)
            if reservation.outcome == "present":
                skipped.append(key)
            elif reservation.outcome == "no_room":
                failed.append(key)
            else:
                self._data[key] = bytes(data)
                self._index.commit(key)
                stored.append(key)
                written += len(data)
        return StoreResult(stored, skipped, failed, written, evicted)

    def _lookup(self, keys: list[ChunkKey]) -> list[bool | None]:
        self._pause(0)
        return list(self._index.touch(keys))

    def _load(self, keys: list[ChunkKey], destinations: list[memoryview], fails: list[bool]) -> LoadResult:
        targets = [byte_view(dest) for dest in destinations]
        self._pause(sum(len(target) for target in targets))
        present = self._index.touch(keys)
        result = LoadResult()
        for key, target, hit, fail in zip(keys, targets, present, fails):
            data = self._data.get(key) if hit and not fail else None
            if data is None or len(data) != len(target):
                result.failed.append(key)
                continue
            try:
                target[:] = data
            except (TypeError, ValueError):  # a read-only destination
                result.failed.append(key)
                continue
            result.loaded.append(key)
        return result

    def _delete(self, keys: list[ChunkKey]) -> int:
        return sum(self._index.remove(key, on_remove=self._data.pop) for key in keys)
