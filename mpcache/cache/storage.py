"""The storage manager: a cache process's L2 adapters, their in-flight tasks and gauges, and the store
controller.  Adapter threads only queue completions; everything else runs on the loop thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import time
from collections.abc import Callable, Iterable

from mpcache.cache.kvlog import KVEventLog
from mpcache.cache.l2.base import L2Adapter, StoreResult
from mpcache.cache.l2.failures import FailureLog
from mpcache.cache.l2.spec import build_adapter
from mpcache.cache.l2.trust import key_from_hex
from mpcache.config import SHARED_L2_TYPES, Config
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey
from mpcache.shm import layout

_L2_STORE_SUBMITTED = EventType.L2_STORE_SUBMITTED
_L2_STORE_COMPLETED = EventType.L2_STORE_COMPLETED
_L2_KEYS_EVICTED = EventType.L2_KEYS_EVICTED


def adapter_specs(config: Config, worker: int) -> list[dict]:
    """This cache process's adapter specs: an fs adapter gets its own subdirectory ``path/worker-<i>``
    (an fs index belongs to one process); other types are used as given."""
    specs = []
    for spec in config.l2:
        spec = dict(spec)
        if spec["type"] == "fs":
            spec["path"] = os.path.join(spec["path"], f"worker-{worker}")
        specs.append(spec)
    return specs


def build_adapters(config: Config, worker: int) -> list[L2Adapter]:
    """The configured adapters, in ``--l2`` order; closes the ones built if a later one fails."""
    adapters: list[L2Adapter] = []
    mac_key = key_from_hex(config.l2_secret) if config.l2_secret else None
    try:
        for spec in adapter_specs(config, worker):
            adapters.append(build_adapter(spec, config.chunk_bytes, mac_key, config.instance_id))
    except BaseException:
        for adapter in adapters:
            adapter.close()
        raise
    return adapters


def salt_groups(keys: Iterable[ChunkKey]) -> dict[tuple[str, str], int] | None:
    """``{(cache_salt, model_name): count}`` of ``keys``; None when there are none (no salt cells)."""
    groups: collections.Counter[tuple[str, str]] = collections.Counter()
    for key in keys:
        groups[(key.cache_salt, key.model_name)] += 1
    return dict(groups) or None


class Task:
    """One adapter operation in flight.  ``on_done(task, future)`` runs on the loop thread."""

    __slots__ = ("kind", "adapter_index", "task_id", "future", "on_done", "load_bytes")

    def __init__(self, kind: str, adapter_index: int, task_id: int, on_done: Callable, load_bytes: int = 0) -> None:
        self.kind = kind  # "store", "lookup" or "load"
        self.adapter_index = adapter_index
        self.task_id = task_id
        self.on_done = on_done
        self.load_bytes = load_bytes
        self.future: concurrent.futures.Future | None = None


class StorageManager:
    """Adapters of one cache process, the completion queue their threads feed, and the store controller."""

    def __init__(
        self,
        adapters: list[L2Adapter],
        names: list[str],
        publisher,
        gauges,
        wake: Callable[[], None],
        *,
        worker: int = 0,
        chunk_bytes: int,
        max_inflight_stores: int = 64,
        logger=None,
        failure_log_interval_s: float = 10.0,
    ) -> None:
        self.adapters = adapters
        self.names = names
        self._pub = publisher
        self._gauges = gauges
        self._wake = wake
        self._chunk_bytes = chunk_bytes
        self._max_inflight_stores = max_inflight_stores
        self._log = logger
        self._failure_log = FailureLog(logger, failure_log_interval_s)
        self._report_usage = [worker == 0 or adapter.name not in SHARED_L2_TYPES for adapter in adapters]
        self._done: collections.deque[Task] = collections.deque()  # appended by adapter threads
        self._inflight: dict[int, Task] = {}  # id(task) -> task
        self.inflight_stores = [0] * len(adapters)
        self.inflight_loads = [0] * len(adapters)
        self.inflight_load_bytes = [0] * len(adapters)
        self.stores_dropped = [0] * len(adapters)
        self._next_task_id = 1
        self.feed: KVEventLog | None = None  # told what each store task wrote and evicted (:meth:`attach_feed`)
        self.refresh_usage()

    def __len__(self) -> int:
        return len(self.adapters)

    # -- the KV event feed ------------------------------------------------------------------

    def attach_feed(self, feed: KVEventLog | None) -> None:
        """Log what each listable tier holds already (an fs tier keeps its chunks across a restart: a new
        incarnation's log starts from them), then every store task's changes."""
        self.feed = feed
        if feed is not None:
            for medium, keys in self.held(""):
                feed.tier_changed(medium, keys, ())

    def held(self, model: str) -> list[tuple[str, list[ChunkKey]]]:
        """``(medium, keys)`` of ``model`` ("": every model) in each tier that keeps its own index here (fs,
        mock; not a shared redis): the feed's resync snapshot lists them."""
        held = []
        for index, adapter in enumerate(self.adapters):
            if adapter.listing is not None:
                keys = adapter.listing.keys_lru()
                held.append((f"L2:{self.names[index]}", [key for key in keys if key.model_name == model]
                             if model else keys))
        return held

    # -- tasks ---------------------------------------------------------------------------

    def next_task_id(self) -> int:
        task_id = self._next_task_id
        self._next_task_id += 1
        return task_id

    def track(self, task: Task, future: concurrent.futures.Future) -> None:
        """Follow ``future``: when it completes, ``task.on_done`` runs in the next :meth:`poll`."""
        task.future = future
        self._inflight[id(task)] = task
        self._count_inflight(task, +1)
        future.add_done_callback(lambda _future: self._completed(task))

    def _count_inflight(self, task: Task, delta: int) -> None:
        """One more (``+1``) or one fewer (``-1``) in-flight task of its adapter, on the gauge board too."""
        index = task.adapter_index
        if task.kind == "store":
            self.inflight_stores[index] += delta
            self._gauges.set_adapter(index, layout.G_L2_INFLIGHT_STORES, self.inflight_stores[index])
        elif task.kind == "load":
            self.inflight_loads[index] += delta
            self.inflight_load_bytes[index] += delta * task.load_bytes
            self._gauges.set_adapter(index, layout.G_L2_INFLIGHT_LOADS, self.inflight_loads[index])
            self._gauges.set_adapter(index, layout.G_L2_INFLIGHT_LOAD_BYTES, self.inflight_load_bytes[index])

    def _completed(self, task: Task) -> None:
        """Runs on an adapter thread (or inline, if the future was already done): queue and wake, nothing else."""
        self._done.append(task)
        self._wake()

    @property
    def has_completions(self) -> bool:
        return bool(self._done)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def poll(self) -> int:
        """On the loop thread: handle every completed task; returns how many."""
        done = self._done
        handled = 0
        usage_changed = False
        while done:
            task = done.popleft()
            if self._inflight.pop(id(task), None) is None:
                continue
            handled += 1
            self._count_inflight(task, -1)
            usage_changed = usage_changed or task.kind == "store"
            try:
                task.on_done(task, task.future)
            except Exception:  # noqa: BLE001 - one bad completion must not stop the loop
                if self._log is not None:
                    self._log.exception("l2.completion_failed", kind=task.kind, adapter_index=task.adapter_index)
        if usage_changed:
            self.refresh_usage()
        if handled:
            self.report_failures()
        return handled

    def report_failures(self, flush: bool = False) -> None:
        """Log the adapters' new failures, rate-limited (all that are held, with ``flush``); loop thread only."""
        for index, adapter in enumerate(self.adapters):
            counts = getattr(adapter, "failures", None)
            if counts is not None:
                self._failure_log.report(index, self.names[index], counts, flush=flush)

    def refresh_usage(self) -> None:
        """Copy every adapter's usage into the gauge board (cheap: adapters answer from memory)."""
        for index, adapter in enumerate(self.adapters):
            if self._report_usage[index]:
                self._gauges.set_adapter(index, layout.G_L2_USAGE, adapter.get_usage().used_bytes)

    # -- store controller ----------------------------------------------------------------

    def store(self, model: str, salt: str, chunks: list[tuple[int, bytes]]) -> int:
        """Submit ``chunks`` ((chunk_hash, bytes) just committed to L1) to every adapter; returns tasks submitted."""
        chunks = [(h, data) for h, data in chunks if len(data) == self._chunk_bytes]
        if not chunks or not self.adapters:
            return 0
        keys = [ChunkKey(model, salt, chunk_hash) for chunk_hash, _ in chunks]
        items: list[tuple[ChunkKey, bytes | memoryview]] = [(key, data) for key, (_, data) in zip(keys, chunks)]
        total = sum(len(data) for _, data in chunks)
        groups = {(salt, model): len(keys)}
        submitted = 0
        for index, adapter in enumerate(self.adapters):
            if self.inflight_stores[index] >= self._max_inflight_stores:
                self.stores_dropped[index] += 1
                if self._log is not None:
                    self._log.warning("l2.store_dropped", adapter_index=index, l2_name=self.names[index],
                                      inflight=self.inflight_stores[index], keys=len(keys))
                continue
            task = Task("store", index, self.next_task_id(), functools.partial(self._store_done, keys=len(keys)))
            self._pub.emit(_L2_STORE_SUBMITTED, (index, task.task_id, self.names[index], len(keys), total),
                           salt_counts=groups)
            self.track(task, adapter.submit_store(items))
            submitted += 1
        return submitted

    def _store_done(self, task: Task, future: concurrent.futures.Future, *, keys: int) -> None:
        """Publish how the store task of ``keys`` chunks ended: one that raised stored none of them."""
        index = task.adapter_index
        name = self.names[index]
        try:
            result: StoreResult | None = future.result()
        except Exception as exc:  # noqa: BLE001 - adapters should not raise; if one does, nothing was stored
            if self._log is not None:
                self._log.warning("l2.store_raised", adapter_index=index, error=f"{type(exc).__name__}: {exc}")
            result = None
        if result is None:
            self._pub.emit(_L2_STORE_COMPLETED, (index, task.task_id, name, 0, 0, keys))
            return
        succeeded = result.stored + result.skipped
        self._pub.emit(_L2_STORE_COMPLETED,
                       (index, task.task_id, name, result.bytes_written, len(succeeded), len(result.failed)),
                       salt_counts=salt_groups(succeeded))
        if self.feed is not None and (result.stored or result.evicted):
            self._log_changes(self.feed, self.adapters[index], f"L2:{name}", result.stored, result.evicted)
        if result.evicted:
            self._pub.emit(_L2_KEYS_EVICTED, (index, name, len(result.evicted)),
                           salt_counts=salt_groups(result.evicted))

    @staticmethod
    def _log_changes(feed: KVEventLog, adapter: L2Adapter, medium: str, stored: list[ChunkKey],
                     evicted: list[ChunkKey]) -> None:
        """Log a store task's changes as its tier holds them now: tasks run concurrently and complete in any
        order (one may evict what another stored after), so each says only what is still true, and the last
        record of a key is its state (a tier with no index here: as the task said)."""
        listing = adapter.listing
        if listing is not None:
            held = listing.present([*stored, *evicted])  # one look under the index's lock
            evicted = [key for key, now in zip(evicted, held[len(stored):]) if not now]
            stored = [key for key, now in zip(stored, held) if now]
        feed.tier_changed(medium, stored, evicted)

    # -- shutdown ------------------------------------------------------------------------

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait for in-flight tasks (and the tasks their completions submit) up to ``timeout_s``,
        handling completions as they come; True when nothing is left in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if not self._inflight:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            futures = [task.future for task in self._inflight.values() if task.future is not None]
            concurrent.futures.wait(futures, timeout=remaining, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Close every adapter (each waits for its own in-flight work) and zero this process's L2 gauges."""
        self.report_failures(flush=True)
        for adapter in self.adapters:
            try:
                adapter.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                if self._log is not None:
                    self._log.exception("l2.close_failed", l2_name=adapter.name)
        for index in range(len(self.adapters)):
            for which in (layout.G_L2_USAGE, layout.G_L2_INFLIGHT_STORES, layout.G_L2_INFLIGHT_LOADS,
                          layout.G_L2_INFLIGHT_LOAD_BYTES):
                self._gauges.set_adapter(index, which, 0)
        self.adapters = []
