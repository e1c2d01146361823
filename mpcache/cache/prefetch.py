"""The prefetch controller: the part of a lookup L1 could not answer, looked up in L2 and loaded into L1
objects that stay read-locked for the job (steps and events: ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import NamedTuple

from mpcache.cache.l1 import L1Manager
from mpcache.cache.storage import StorageManager, Task
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey

_L2_PREFETCH_LOOKUP_SUBMITTED = EventType.L2_PREFETCH_LOOKUP_SUBMITTED
_L2_PREFETCH_LOOKUP_COMPLETED = EventType.L2_PREFETCH_LOOKUP_COMPLETED
_L2_PREFETCH_LOAD_SUBMITTED = EventType.L2_PREFETCH_LOAD_SUBMITTED
_L2_LOAD_TASK_SUBMITTED = EventType.L2_LOAD_TASK_SUBMITTED
_L2_LOAD_TASK_COMPLETED = EventType.L2_LOAD_TASK_COMPLETED
_L2_PREFETCH_LOAD_COMPLETED = EventType.L2_PREFETCH_LOAD_COMPLETED
_L2_PREFETCH_FAILED = EventType.L2_PREFETCH_FAILED
_L2_LOAD_ORIGIN = EventType.L2_LOAD_ORIGIN


class PrefetchOutcome(NamedTuple):
    """What a finished L2 prefetch adds to its job."""

    locked: int  # chunks right after the L1 prefix now read-locked for the job (contiguous)
    l1_hits: int  # of those, chunks that were already in L1 (no load)
    l2_hits: int  # of those, chunks loaded from L2
    landed: int  # every chunk loaded from L2 into L1 (an L1 write), contiguous or not


class _Prefetch:
    __slots__ = ("request_id", "model", "salt", "hashes", "token", "lookups_left", "held", "offsets", "loads_left",
                 "landed", "failed", "failed_by_reason", "generation")

    def __init__(self, request_id: int, model: str, salt: str, hashes: list[int], token: object,
                 adapters: int) -> None:
        self.request_id = request_id
        self.model = model
        self.salt = salt
        self.hashes = hashes  # the chunks after the L1 prefix
        self.token = token  # handed back to the owner with the outcome
        self.lookups_left = adapters
        self.held: list[list[bool] | None] = [None] * adapters  # per adapter: which chunks it holds
        self.offsets: list[int] = []  # per reserved chunk of the run: L1 byte offset, -1 = already in L1
        self.loads_left = 0
        self.landed: set[int] = set()  # positions in hashes loaded into L1
        self.failed = 0
        self.failed_by_reason: dict[str, int] = {}  # of ``failed``: not_found, integrity, l2_error, l1_lost
        self.generation = 0  # L1's when its space was reserved: loads that end at another one landed nothing


class PrefetchController:
    """L2 → L1 prefetches.  ``on_finished(token, outcome)`` is called once per started prefetch."""

    def __init__(
        self,
        storage: StorageManager,
        l1: L1Manager,
        publisher,
        on_finished: Callable[[object, PrefetchOutcome], None],
        *,
        max_pending: int = 1024,
    ) -> None:
        self._storage = storage
        self._l1 = l1
        self._pub = publisher
        self._on_finished = on_finished
        self._max_pending = max_pending
        self.pending = 0

    def start(self, request_id: int, model: str, salt: str, hashes: list[int], token: object) -> bool:
        """Ask every adapter about ``hashes`` (the chunks after the L1 prefix); False when L2 is not consulted."""
        storage = self._storage
        adapters = storage.adapters
        if not adapters or not hashes or self.pending >= self._max_pending:
            return False
        prefetch = _Prefetch(request_id, model, salt, list(hashes), token, len(adapters))
        keys = [ChunkKey(model, salt, chunk_hash) for chunk_hash in hashes]
        self.pending += 1
        self._pub.emit(_L2_PREFETCH_LOOKUP_SUBMITTED, (request_id, len(keys), len(adapters)),
                       salt_counts={(salt, model): len(keys)})
        for index, adapter in enumerate(adapters):
            task = Task("lookup", index, 0, lambda task, future, p=prefetch: self._lookup_done(p, task, future))
            storage.track(task, adapter.lookup(keys))
        return True

    # -- step 2: lookups answered ------------------------------------------------------------

    def _lookup_done(self, prefetch: _Prefetch, task: Task, future: concurrent.futures.Future) -> None:
        try:
            answers = list(future.result())
        except Exception:  # noqa: BLE001 - a lookup that failed (or a broken adapter) holds nothing
            answers = [None] * len(prefetch.hashes)
        unasked = sum(1 for answer in answers if answer is None)  # the tier (or a shard of it) was not reachable
        if unasked:
            self._pub.emit(_L2_PREFETCH_FAILED, ("lookup_error",),
                           salt_counts={(prefetch.salt, prefetch.model): unasked})
        held = [answer is not None and bool(answer) for answer in answers]
        if len(held) != len(prefetch.hashes):
            held = [False] * len(prefetch.hashes)
        prefetch.held[task.adapter_index] = held
        prefetch.lookups_left -= 1
        if prefetch.lookups_left == 0:
            self._load(prefetch)

    def _load(self, prefetch: _Prefetch) -> None:
        owners: list[int] = []  # per chunk of the run: the adapter it is loaded from
        for position in range(len(prefetch.hashes)):
            owner = next((index for index, held in enumerate(prefetch.held) if held is not None and held[position]),
                         None)
            if owner is None:
                break
            owners.append(owner)
        request_id, model, salt = prefetch.request_id, prefetch.model, prefetch.salt
        pub = self._pub
        pub.emit(_L2_PREFETCH_LOOKUP_COMPLETED, (request_id, len(owners)))
        if not owners:
            self._finish(prefetch)
            return
        prefetch.generation = self._l1.generation()
        reservation = self._l1.reserve_prefetch(model, salt, prefetch.hashes[: len(owners)])
        prefetch.offsets = reservation.offsets
        if reservation.failed:
            pub.emit(_L2_PREFETCH_FAILED, ("l1_oom",), salt_counts={(salt, model): reservation.failed})
        groups: dict[int, list[int]] = {}  # adapter -> positions it loads
        for position, offset in enumerate(reservation.offsets):
            if offset >= 0:
                groups.setdefault(owners[position], []).append(position)
        if not groups:
            self._finish(prefetch)
            return
        to_load = sum(len(positions) for positions in groups.values())
        pub.emit(_L2_PREFETCH_LOAD_SUBMITTED, (request_id, to_load, len(groups)), salt_counts={(salt, model): to_load})
        storage = self._storage
        pool_view = memoryview(self._l1.pool)  # type: ignore[arg-type]  # numpy arrays export the buffer
        chunk_bytes = self._l1.chunk_bytes
        prefetch.loads_left = len(groups)
        for index in sorted(groups):
            positions = groups[index]
            nbytes = len(positions) * chunk_bytes
            task = Task("load", index, storage.next_task_id(),
                        lambda task, future, p=prefetch, ps=positions: self._load_done(p, ps, task, future),
                        load_bytes=nbytes)
            pub.emit(_L2_LOAD_TASK_SUBMITTED, (request_id, index, task.task_id, storage.names[index], len(positions),
                                               nbytes))
            keys = [ChunkKey(model, salt, prefetch.hashes[p]) for p in positions]
            offsets = prefetch.offsets
            destinations = [pool_view[offsets[p] : offsets[p] + chunk_bytes] for p in positions]
            storage.track(task, storage.adapters[index].submit_load(keys, destinations))

    # -- step 5/6: loads finished -------------------------------------------------------------

    def _load_done(self, prefetch: _Prefetch, positions: list[int], task: Task,
                   future: concurrent.futures.Future) -> None:
        hashes, model, salt = prefetch.hashes, prefetch.model, prefetch.salt
        rejected: set[int] = set()
        errors: set[int] = set()
        peer = 0
        try:
            result = future.result()
            loaded_keys = {key.chunk_hash for key in result.loaded}
            rejected = {key.chunk_hash for key in result.rejected}
            errors = {key.chunk_hash for key in result.errors}
            peer = len(result.peer)
        except Exception:  # noqa: BLE001 - a broken adapter loaded nothing
            loaded_keys = set()
        l1 = self._l1
        if l1.lost_since(prefetch.generation, len(loaded_keys)):  # the pool was lost: the loads landed on nothing
            rejected, errors, lost, loaded_keys = set(), set(), set(loaded_keys), set()
        else:
            lost = set()
        loaded = [p for p in positions if hashes[p] in loaded_keys]
        failed = [p for p in positions if hashes[p] not in loaded_keys]
        for p in failed:
            reason = ("l1_lost" if hashes[p] in lost else "integrity" if hashes[p] in rejected
                      else "l2_error" if hashes[p] in errors else "not_found")
            prefetch.failed_by_reason[reason] = prefetch.failed_by_reason.get(reason, 0) + 1
        if loaded:
            l1.commit_prefetch(model, salt, [hashes[p] for p in loaded], l1.chunk_bytes)
        if failed:
            l1.abort_write(model, salt, [hashes[p] for p in failed])
        prefetch.landed.update(loaded)
        prefetch.failed += len(failed)
        name = self._storage.names[task.adapter_index]
        self._pub.emit(_L2_LOAD_TASK_COMPLETED, (prefetch.request_id, task.adapter_index, task.task_id, name,
                                                 len(loaded), len(failed)))
        for origin, count in (("self", len(loaded) - peer), ("peer", peer)):
            if count > 0:
                self._pub.emit(_L2_LOAD_ORIGIN, (task.adapter_index, name, origin, count))
        prefetch.loads_left -= 1
        if prefetch.loads_left == 0:
            self._pub.emit(_L2_PREFETCH_LOAD_COMPLETED, (prefetch.request_id, len(prefetch.landed), prefetch.failed),
                           salt_counts={(salt, model): len(prefetch.landed)} if prefetch.landed else None)
            for reason, count in sorted(prefetch.failed_by_reason.items()):
                self._pub.emit(_L2_PREFETCH_FAILED, (reason,), salt_counts={(salt, model): count})
            self._finish(prefetch)

    def _finish(self, prefetch: _Prefetch) -> None:
        """Keep the locks of the contiguous run, release the rest, report to the owner."""
        offsets, landed = prefetch.offsets, prefetch.landed
        run = 0
        while run < len(offsets) and (offsets[run] < 0 or run in landed):
            run += 1
        beyond = [prefetch.hashes[p] for p in range(run, len(offsets)) if offsets[p] < 0 or p in landed]
        if beyond:
            self._l1.release_read(prefetch.model, prefetch.salt, beyond)
        l1_hits = sum(1 for offset in offsets[:run] if offset < 0)
        self.pending -= 1
        self._on_finished(prefetch.token, PrefetchOutcome(run, l1_hits, run - l1_hits, len(landed)))
