"""L2 → L1 prefetch landings: the space an L2 prefetch loads chunks into, readable and read-locked once they
landed.  A part of :class:`~mpcache.cache.l1.L1Manager` (its base class), kept apart for size; what it uses
of the manager is declared below."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpcache.cache.kvlog import KVEventLog
from mpcache.cache.l1_entries import Entry, Evicted, PrefetchReservation
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey

_L1_WRITE_FINISHED_AND_READ_RESERVED = EventType.L1_WRITE_FINISHED_AND_READ_RESERVED


class PrefetchLandings:
    """:meth:`reserve_prefetch` and :meth:`commit_prefetch` of L1Manager."""

    chunk_bytes: int
    feed: KVEventLog | None
    _entries: dict[ChunkKey, Entry]
    _at: dict[int, ChunkKey]
    _order: Any
    _asked: Callable[[Sequence[ChunkKey], float, bool], None] | None
    _take: Callable[[ChunkKey, Entry], None]
    _unlock: Callable[[str, str, Sequence[int]], None]
    _allocate: Callable[[int, Evicted], int | None]
    _publish_evicted: Callable[[Evicted], None]
    _report_reserved: Callable[[str, str, int, int, str], None]
    _emit_keys: Callable[[EventType, str, str, Sequence[int]], list[tuple[int, str, str]]]

    def reserve_prefetch(self, model: str, salt: str, hashes: Sequence[int]) -> PrefetchReservation:
        """Landing space (``chunk_bytes`` each) for chunks an L2 prefetch will load, in the order of ``hashes``.

        The walk stops before the first chunk that is being written (another prefetch or store owns it) or that
        repeats (``stopped`` counts what is left).  A chunk already ready in L1 is read-locked instead (offset
        -1).  Missing chunks get space, evicting in the policy's order as needed; from the first one that gets
        none, every missing chunk fails (``L1_ALLOCATION_FAILED``, during=l2_prefetch) and ready ones after it
        are unlocked again.  Reserved space is not readable until :meth:`commit_prefetch` (or given back with
        :meth:`abort_write`)."""
        entries = self._entries
        covered: list[tuple[ChunkKey, Entry | None]] = []
        seen: set[ChunkKey] = set()
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if key in seen or (entry is not None and not entry.ready):
                break
            seen.add(key)
            covered.append((key, entry))
        stopped = len(hashes) - len(covered)
        for key, entry in covered:  # pin what is ready first, so making room cannot evict it
            if entry is not None:
                if entry.readers == 0:
                    self._take(key, entry)
                entry.readers += 1
        size = self.chunk_bytes
        asked = self._asked
        if asked is not None:  # what lands was asked for and missed, as a store's new chunks are
            asked([key for key, entry in covered if entry is None], size, False)
        offsets: list[int] = []
        failed = 0
        evicted = Evicted()
        for index, (key, entry) in enumerate(covered):
            if entry is not None:
                offsets.append(-1)
                continue
            offset = self._allocate(size, evicted)
            if offset is None:
                rest = covered[index:]
                failed = sum(1 for _, e in rest if e is None)
                self._unlock(model, salt, [k.chunk_hash for k, e in rest if e is not None])
                break
            entries[key] = landing = Entry(offset, size)
            self._at[offset] = key
            if self._order.new is not None:
                self._order.new(key, landing, None)
            offsets.append(offset)
        self._publish_evicted(evicted)
        self._report_reserved(model, salt, sum(1 for offset in offsets if offset >= 0), failed, "l2_prefetch")
        return PrefetchReservation(offsets, failed, stopped)

    def commit_prefetch(self, model: str, salt: str, hashes: Sequence[int], nbytes: int) -> list[tuple[int, str, str]]:
        """Chunks landed from L2 in their reserved space: readable, each holding one read lock for the
        prefetch (``L1_WRITE_FINISHED_AND_READ_RESERVED``, which counts as a write).  Returns the sampled subset."""
        entries = self._entries
        for chunk_hash in hashes:
            entry = entries[ChunkKey(model, salt, chunk_hash)]
            entry.ready = True
            entry.nbytes = nbytes
            entry.readers = 1  # locked, so not in the LRU order until released
        if self.feed is not None:
            self.feed.stored(model, salt, hashes, None)
        return self._emit_keys(_L1_WRITE_FINISHED_AND_READ_RESERVED, model, salt, hashes) if hashes else []
