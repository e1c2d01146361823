"""The L1 tier: fixed-size chunk slots in the process's shared-memory pool, with read locks and O(1) LRU
eviction; every state change publishes its L1 event.  Single-threaded, so lock-free.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey, SampleGate

_L1_READ_RESERVED = EventType.L1_READ_RESERVED
_L1_READ_FINISHED = EventType.L1_READ_FINISHED
_L1_WRITE_RESERVED = EventType.L1_WRITE_RESERVED
_L1_WRITE_FINISHED = EventType.L1_WRITE_FINISHED
_L1_WRITE_FINISHED_AND_READ_RESERVED = EventType.L1_WRITE_FINISHED_AND_READ_RESERVED
_L1_KEYS_EVICTED = EventType.L1_KEYS_EVICTED
_L1_EVICTION_LOOP_TICK = EventType.L1_EVICTION_LOOP_TICK
_L1_ALLOCATION_FAILED = EventType.L1_ALLOCATION_FAILED
_L1_READ_FAILED = EventType.L1_READ_FAILED


class _Entry:
    __slots__ = ("slot", "nbytes", "readers", "ready")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.nbytes = 0
        self.readers = 0
        self.ready = False


class WriteReservation(NamedTuple):
    """Outcome of :meth:`L1Manager.reserve_write` for one request's chunk hashes."""

    positions: list[int]  # index into the request's hashes of each reserved chunk, in order
    slots: list[int]  # the slot reserved for each of them
    present: int  # chunks already in L1 (not rewritten)
    failed: int  # chunks that got no slot


class PrefetchReservation(NamedTuple):
    """Outcome of :meth:`L1Manager.reserve_prefetch` for the chunks an L2 prefetch wants to land."""

    slots: list[int]  # per covered chunk, in order: its landing slot, or -1 when it was already ready (now read-locked)
    failed: int  # chunks that needed a slot and got none (L1_ALLOCATION_FAILED, during=l2_prefetch)
    stopped: int  # chunks not covered because one of them is being written by someone else (or repeats)


class L1Manager:
    """Slots, entries, locks and LRU order of one L1 pool."""

    def __init__(self, pool: np.ndarray, publisher, sample_rate: float, watermark: float) -> None:
        if pool.ndim != 2 or pool.dtype != np.uint8:
            raise ValueError("the L1 pool must be a (slots, chunk_bytes) uint8 array")
        self.pool = pool
        self.capacity = pool.shape[0]
        self.chunk_bytes = pool.shape[1]
        self.watermark = watermark
        self._pub = publisher
        self._gate = SampleGate(sample_rate)
        self._entries: dict[ChunkKey, _Entry] = {}
        self._lru: OrderedDict[ChunkKey, _Entry] = OrderedDict()  # ready, unlocked; oldest first
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out slot 0 first

    # -- state --------------------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return self.capacity - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_slots / self.capacity

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def readers(self, key: ChunkKey) -> int:
        entry = self._entries.get(key)
        return entry.readers if entry is not None else 0

    # -- writes -------------------------------------------------------------------

    def reserve_write(self, model: str, salt: str, hashes: Sequence[int], limit: int | None = None) -> WriteReservation:
        """Reserve a slot for every chunk not yet in L1, evicting LRU entries when no slot is free.

        Chunks already present are touched (most recently used) and not
        reserved again.  Chunks get slots in order; when nothing more can be
        evicted, or ``limit`` slots are reserved, the remaining new chunks fail
        (``L1_ALLOCATION_FAILED``, during=l1_store).
        """
        entries = self._entries
        lru = self._lru
        new: list[int] = []
        pinned: list[tuple[ChunkKey, _Entry]] = []
        seen: set[ChunkKey] = set()
        for position, chunk_hash in enumerate(hashes):
            key = ChunkKey(model, salt, chunk_hash)
            if key in seen:
                continue  # a repeated hash within one request: written once
            seen.add(key)
            entry = entries.get(key)
            if entry is None:
                new.append(position)
            elif lru.pop(key, None) is not None:
                pinned.append((key, entry))  # kept out of eviction's reach during this call
        present = len(seen) - len(new)
        wanted = len(new) if limit is None else max(0, min(limit, len(new)))
        shortfall = wanted - len(self._free)
        if shortfall > 0:
            self._evict(shortfall)
        for key, entry in pinned:
            lru[key] = entry  # touched: now the most recently used
        positions = new[: min(wanted, len(self._free))]
        failed = len(new) - len(positions)
        slots = []
        free = self._free
        for position in positions:
            entry = _Entry(free.pop())
            entries[ChunkKey(model, salt, hashes[position])] = entry
            slots.append(entry.slot)
        self._report_reserved(model, salt, len(positions), failed, "l1_store")
        return WriteReservation(positions, slots, present, failed)

    def _report_reserved(self, model: str, salt: str, reserved: int, failed: int, during: str) -> None:
        """``L1_WRITE_RESERVED`` for the slots handed out, ``L1_ALLOCATION_FAILED`` for the chunks that got none."""
        if reserved:
            self._pub.emit_salted(_L1_WRITE_RESERVED, salt, model, reserved)
        if failed:
            self._pub.emit(_L1_ALLOCATION_FAILED, (during,), salt_counts={(salt, model): failed})

    def commit_write(self, model: str, salt: str, hashes: Sequence[int], nbytes: int) -> list[tuple[int, str, str]]:
        """Make reserved chunks readable (``L1_WRITE_FINISHED``); they become the most recently used.

        Returns the sampled subset published with the event (callers reuse it)."""
        entries = self._entries
        lru = self._lru
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries[key]
            entry.ready = True
            entry.nbytes = nbytes
            lru[key] = entry
        return self._emit_keys(_L1_WRITE_FINISHED, model, salt, hashes) if hashes else []

    def abort_write(self, model: str, salt: str, hashes: Sequence[int]) -> None:
        """Give back reserved slots whose data never arrived (publishes nothing)."""
        for chunk_hash in hashes:
            entry = self._entries.pop(ChunkKey(model, salt, chunk_hash), None)
            if entry is not None:
                self._free.append(entry.slot)

    # -- L2 -> L1 prefetch landings -------------------------------------------------

    def reserve_prefetch(self, model: str, salt: str, hashes: Sequence[int]) -> PrefetchReservation:
        """Landing slots for chunks an L2 prefetch will load, in the order of ``hashes``.

        The walk stops before the first chunk that is being written (another
        prefetch or store owns it) or that repeats (``stopped`` counts what is
        left).  A chunk already ready in L1 is read-locked instead (slot -1).
        Missing chunks get slots, evicting LRU entries as needed; from the
        first one that gets none, every missing chunk fails
        (``L1_ALLOCATION_FAILED``, during=l2_prefetch) and ready ones after it
        are unlocked again.  Reserved slots are not readable until
        :meth:`commit_prefetch` (or given back with :meth:`abort_write`).
        """
        entries = self._entries
        lru = self._lru
        covered: list[tuple[ChunkKey, _Entry | None]] = []
        seen: set[ChunkKey] = set()
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if key in seen or (entry is not None and not entry.ready):
                break
            seen.add(key)
            covered.append((key, entry))
        stopped = len(hashes) - len(covered)
        missing = 0
        for key, entry in covered:  # pin what is ready first, so making room cannot evict it
            if entry is None:
                missing += 1
            else:
                if entry.readers == 0:
                    del lru[key]
                entry.readers += 1
        shortfall = missing - len(self._free)
        if shortfall > 0:
            self._evict(shortfall)
        free = self._free
        slots: list[int] = []
        failed = 0
        for index, (key, entry) in enumerate(covered):
            if entry is not None:
                slots.append(-1)
                continue
            if not free:
                rest = covered[index:]
                failed = sum(1 for _, e in rest if e is None)
                self._unlock(model, salt, [k.chunk_hash for k, e in rest if e is not None])
                break
            new = entries[key] = _Entry(free.pop())
            slots.append(new.slot)
        self._report_reserved(model, salt, sum(1 for slot in slots if slot >= 0), failed, "l2_prefetch")
        return PrefetchReservation(slots, failed, stopped)

    def commit_prefetch(self, model: str, salt: str, hashes: Sequence[int], nbytes: int) -> list[tuple[int, str, str]]:
        """Chunks landed from L2 in their reserved slots: readable, each holding one read lock for the
        prefetch (``L1_WRITE_FINISHED_AND_READ_RESERVED``, which counts as a write).  Returns the sampled subset."""
        entries = self._entries
        for chunk_hash in hashes:
            entry = entries[ChunkKey(model, salt, chunk_hash)]
            entry.ready = True
            entry.nbytes = nbytes
            entry.readers = 1  # locked, so not in the LRU order until released
        return self._emit_keys(_L1_WRITE_FINISHED_AND_READ_RESERVED, model, salt, hashes) if hashes else []

    # -- reads --------------------------------------------------------------------

    def lock_prefix(self, model: str, salt: str, hashes: Sequence[int], publish: bool = True) -> int:
        """Read-lock the longest prefix of ``hashes`` that is ready in L1 (``L1_READ_RESERVED`` unless
        ``publish`` is False: a lock held only for the length of one copy).

        Returns its length in chunks.  The locks keep those chunks from being
        evicted until :meth:`finish_read` or :meth:`release_read`.
        """
        entries = self._entries
        lru = self._lru
        found = 0
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if entry is None or not entry.ready:
                break
            if entry.readers == 0:
                del lru[key]
            entry.readers += 1
            found += 1
        if found and publish:
            self._pub.emit_salted(_L1_READ_RESERVED, salt, model, found)
        return found

    def read(self, model: str, salt: str, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(slot, nbytes) of the longest readable prefix of chunks that lookup reported present.

        A chunk that is missing (``not_found``) or still being written
        (``write_locked``) is an anomaly, not a miss: every such chunk from the
        first one on is counted in ``L1_READ_FAILED`` (during=l1_retrieve, one
        event per reason).  Readable chunks after the gap are not returned
        either (a prefix cannot use them) but are not read failures.
        """
        entries = self._entries
        out = []
        for chunk_hash in hashes:
            entry = entries.get(ChunkKey(model, salt, chunk_hash))
            if entry is None or not entry.ready:
                break
            out.append((entry.slot, entry.nbytes))
        if len(out) < len(hashes):
            reasons: Counter[str] = Counter()
            for chunk_hash in hashes[len(out):]:
                entry = entries.get(ChunkKey(model, salt, chunk_hash))
                if entry is None:
                    reasons["not_found"] += 1
                elif not entry.ready:
                    reasons["write_locked"] += 1
            for reason, count in sorted(reasons.items()):
                self._pub.emit(_L1_READ_FAILED, ("l1_retrieve", reason), salt_counts={(salt, model): count})
        return out

    def finish_read(self, model: str, salt: str, hashes: Sequence[int],
                    unlock: bool = True) -> list[tuple[int, str, str]]:
        """Chunks were read: drop one read lock per chunk (unless the read held none, ``unlock=False``)
        and publish ``L1_READ_FINISHED``; returns the sampled subset."""
        if not hashes:
            return []
        if unlock:
            self._unlock(model, salt, hashes)
        return self._emit_keys(_L1_READ_FINISHED, model, salt, hashes)

    def release_read(self, model: str, salt: str, hashes: Sequence[int]) -> None:
        """Drop read locks of chunks that were never read (publishes nothing)."""
        self._unlock(model, salt, hashes)

    def _unlock(self, model: str, salt: str, hashes: Sequence[int]) -> None:
        entries = self._entries
        lru = self._lru
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if entry is None or entry.readers == 0:
                continue
            entry.readers -= 1
            if entry.readers == 0:
                lru[key] = entry  # most recently used

    # -- eviction -----------------------------------------------------------------

    def evict_tick(self) -> tuple[float, bool]:
        """One iteration of the eviction loop: at or above the watermark, evict
        LRU entries until usage is below it.  Publishes ``L1_KEYS_EVICTED`` (if
        any) and ``L1_EVICTION_LOOP_TICK``; returns (usage before, triggered)."""
        usage = self.usage
        triggered = usage >= self.watermark
        if triggered:
            # smallest number of used slots that is below the watermark
            target = int(self.watermark * self.capacity)
            if target / self.capacity >= self.watermark:
                target -= 1
            self._evict(self.used_slots - max(target, 0))
        self._pub.emit(_L1_EVICTION_LOOP_TICK, (usage, self.watermark, triggered))
        return usage, triggered

    def clear(self) -> int:
        """Evict every entry that is neither locked nor being written (LMCache's ``clear``); returns how many."""
        return self._evict(len(self._lru))

    def _evict(self, count: int) -> int:
        """Evict up to ``count`` least recently used unlocked entries; returns how many."""
        lru = self._lru
        entries = self._entries
        free = self._free
        gate = self._gate
        groups: Counter[tuple[str, str]] = Counter()
        sampled = []
        evicted = 0
        while evicted < count and lru:
            key, entry = lru.popitem(last=False)
            del entries[key]
            free.append(entry.slot)
            groups[(key.cache_salt, key.model_name)] += 1
            if gate(key.chunk_hash):
                sampled.append((key.chunk_hash, key.cache_salt, key.model_name))
            evicted += 1
        if evicted:
            self._pub.emit(_L1_KEYS_EVICTED, salt_counts=groups, sampled=sampled)
        return evicted

    def _emit_keys(self, etype: EventType, model: str, salt: str, hashes: Sequence[int]) -> list[tuple[int, str, str]]:
        gate = self._gate
        sampled = [(h, salt, model) for h in hashes if gate(h)]
        if sampled:
            self._pub.emit(etype, salt_counts={(salt, model): len(hashes)}, sampled=sampled)
        else:
            self._pub.emit_salted(etype, salt, model, len(hashes))
        return sampled
