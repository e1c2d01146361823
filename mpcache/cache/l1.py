"""The L1 tier: objects of any size in the process's shared-memory pool (byte ranges of a
:class:`~mpcache.cache.slabs.SlabAllocator`), read locks, and eviction across every size in the order of
``--l1-policy`` (:mod:`mpcache.eviction.order`): an object that gets no space evicts unlocked objects in that
order until the allocator places it, only then and only what is needed; before each eviction it lets the
allocator compact where that could free a slab (move ready, unlocked objects out of a class's emptiest slab: a
mix of object sizes would otherwise strand space in partly used slabs).  Every state change publishes its L1
event.  Single-threaded, so lock-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import cast

import numpy as np

from mpcache.cache.kvlog import Detail, KVEventLog
from mpcache.cache.l1_entries import Entry, Evicted, WriteReservation
from mpcache.cache.l1_landings import PrefetchLandings
from mpcache.cache.slabs import ALIGN, SlabAllocator, default_slab_bytes
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey, SampleGate
from mpcache.eviction import order as l1_order
from mpcache.eviction.admission import RULES, trial_halvings
from mpcache.eviction.lru_order import LruOrder

_L1_READ_RESERVED = EventType.L1_READ_RESERVED
_L1_READ_FINISHED = EventType.L1_READ_FINISHED
_L1_WRITE_RESERVED = EventType.L1_WRITE_RESERVED
_L1_WRITE_FINISHED = EventType.L1_WRITE_FINISHED
_L1_KEYS_EVICTED = EventType.L1_KEYS_EVICTED
_L1_EVICTION_LOOP_TICK = EventType.L1_EVICTION_LOOP_TICK
_L1_ALLOCATION_FAILED = EventType.L1_ALLOCATION_FAILED
_L1_READ_FAILED = EventType.L1_READ_FAILED


POOL_LOST = ("the L1 pool was truncated by another process during the copy: this cache process's L1 is lost "
             "and the copy holds no valid bytes")


def _no_faults() -> int:
    return 0


# a chunk's number for the eviction order's frequency sketch and samples: its hash, not its key's (whose strings
# hash differently in each process), so that the order decides the same in every run; given as its field's index,
# which the compiled sketch reads without a call for each key asked for
_CHUNK_CODE_ITEM = ChunkKey._fields.index("chunk_hash")


class L1Manager(PrefetchLandings):
    """Entries, byte ranges, locks and eviction order of one L1 pool (``pool``: its bytes, one-dimensional
    uint8).  ``chunk_bytes``: the native protocol's (and L2 landings') object size, the default; ``slab_bytes``:
    the allocator's slab (default :func:`~mpcache.cache.slabs.default_slab_bytes`); ``policy``: the eviction
    order, one of :data:`~mpcache.eviction.order.POLICIES`; ``first_sight``: whether ``adaptive`` may refuse a store
    seen first (by frequency, and by chance where L1 is large enough for its trial), False where a store L1 refuses
    would reach no L2 tier either."""

    def __init__(self, pool: np.ndarray, publisher, sample_rate: float, chunk_bytes: int,
                 slab_bytes: int | None = None, policy: str = "lru", first_sight: bool = True,
                 min_spot: int = ALIGN) -> None:
        if pool.ndim != 1 or pool.dtype != np.uint8:
            raise ValueError("the L1 pool must be a one-dimensional uint8 array")
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.allocator = SlabAllocator(len(pool), slab_bytes or default_slab_bytes(len(pool), chunk_bytes), min_spot)
        self.capacity_bytes = self.allocator.capacity_bytes
        self._pub = publisher
        self._gate = SampleGate(sample_rate)
        self._entries: dict[ChunkKey, Entry] = {}
        self._at: dict[int, ChunkKey] = {}  # offset → the object there (compaction moves objects by offset)
        self.entry_of = cast(Callable[[tuple[str, str, int]], "Entry | None"], self._entries.get)
        self._order = order = l1_order.build(policy, self.capacity_bytes, self._entries.get, _CHUNK_CODE_ITEM,
                                             fair=True, first_sight=first_sight,
                                             trial=trial_halvings(self.capacity_bytes, chunk_bytes))
        self._lists = order.lists  # ready, unlocked entries: each in lists[entry.tier]
        self._again, self._promote = order.again, order.promote  # an entry taken out is used again
        self._tail_first, self._counts_accesses = order.tail_first, order.new is not None  # ARC: lookups counted
        self._hints = order.hints  # the chunk after a lookup's prefix → that prefix's last chunk
        self._asked = order.asked if order.prefix_aware else None  # counts what lookups find and stores reserve
        self.policy = policy
        self.pool_faults: Callable[[], int] = _no_faults  # set by the cache process: faults survived in the pool
        self._losses = 0  # lose_all calls
        self.lost_copies = 0  # objects whose copy or reservation spanned a loss (:meth:`lost_since`)
        self.refused_chunks = 0  # chunks of stores the eviction order refused where room could be made
        self._made_room = False  # whether an allocation evicted since the last evict_tick
        self.feed: KVEventLog | None = None  # told of every object made readable and every one evicted

    # -- state --------------------------------------------------------------------

    @property
    def order(self) -> LruOrder | l1_order.ArcOrder:
        """The eviction order (:mod:`mpcache.eviction.order`): read by a benchmark that follows its phases."""
        return self._order

    @property
    def admission_chance(self) -> float:
        """The chance a first-sight store is admitted while L1 needs room: below 1 while ``adaptive`` admits by
        chance (:mod:`mpcache.eviction.admission`), else 1."""
        return self._order.chance

    @property
    def admission(self) -> str:
        """The rule L1 admits by, of :data:`~mpcache.eviction.admission.RULES`: ``every`` store, but where
        ``adaptive``'s trial found that admitting ``by_chance`` or under an age floor (``floored``) pays."""
        order = self._order
        return RULES[2] if order.floor else RULES[1] if order.chance < 1.0 else RULES[0]

    @property
    def admission_floor(self) -> float:
        """The age floor in accesses while L1 admits under it (:mod:`mpcache.eviction.admission`), else 0."""
        return self._order.floor

    @property
    def used_bytes(self) -> int:
        """Bytes held by objects (reserved or readable)."""
        return self.allocator.used_bytes

    @property
    def fragmentation_bytes(self) -> int:
        """Bytes the allocator holds in slabs that no object uses (free spots, padding, slab tails)."""
        return self.allocator.fragmentation_bytes

    @property
    def max_object_bytes(self) -> int:  # the largest object L1 can ever hold: all of it
        return self.capacity_bytes

    @property
    def usage(self) -> float:
        return self.used_bytes / self.capacity_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: tuple[str, str, int]) -> bool:
        """A ChunkKey or its plain tuple (same hash, same equality); ``entry_of``: the lookup, for many probes."""
        entry = self._entries.get(cast(ChunkKey, key))
        return entry is not None and entry.ready

    def readers(self, key: ChunkKey) -> int:
        entry = self._entries.get(key)
        return entry.readers if entry is not None else 0

    def readable(self, model: str) -> list[ChunkKey]:
        """Every readable object of ``model`` ("": of every model; what the feed's resync snapshot lists)."""
        return [key for key, entry in self._entries.items() if entry.ready and (not model or key.model_name == model)]

    # -- writes -------------------------------------------------------------------

    def reserve_write(self, model: str, salt: str, hashes: Sequence[int], limit: int | None = None,
                      nbytes: int | None = None, chained: bool = True, store: Hashable | None = None
                      ) -> WriteReservation:
        """Reserve ``nbytes`` (default ``chunk_bytes``) for every chunk not yet in L1, evicting entries (of any
        size, in the policy's order) until each fits.

        ``chained``: each chunk's hash names its prefix (False: position-independent chunks, which the
        prefix-aware order must not treat as a prefix).  ``store``: a name the store's other reservations share
        (its request's other TP ranks, other KV cache groups), so that the order admits or refuses them alike.
        Chunks already present are touched (used again) and not reserved again.  Chunks get space in order; when
        nothing more can be evicted, or ``limit`` chunks are reserved, the remaining new chunks fail
        (``L1_ALLOCATION_FAILED``, during=l1_store)."""
        size = self.chunk_bytes if nbytes is None else nbytes
        entries = self._entries
        lists, again, joined, hints = self._lists, self._again, self._order.new, self._hints
        new: list[int] = []
        new_keys: list[ChunkKey] = []  # at those positions
        keys: list[ChunkKey] = []  # by position
        pinned: list[tuple[ChunkKey, Entry]] = []
        seen: set[ChunkKey] = set()
        for position, chunk_hash in enumerate(hashes):
            key = ChunkKey(model, salt, chunk_hash)
            keys.append(key)
            if key in seen:
                continue  # a repeated hash within one request: written once
            seen.add(key)
            entry = entries.get(key)
            if entry is None:
                new.append(position)
                new_keys.append(key)
            elif entry.ready and entry.readers == 0:
                del lists[entry.tier][key]
                if entry.tier != again:
                    self._promote(entry)
                pinned.append((key, entry))  # kept out of eviction's reach during this call
        present = len(seen) - len(new)
        asked = self._asked
        if asked is not None:
            asked(new_keys, size, False)
        wanted = len(new) if limit is None else max(0, min(limit, len(new)))
        positions: list[int] = []
        offsets: list[int] = []
        evicted = Evicted()
        linked = chained and self._order.prefix_aware
        made, made_entry = -1, None  # the position reserved last, and its entry
        self._order.admitting(keys, size, store, new)  # the order may refuse it, if what it evicts is worth more
        allocator = self.allocator
        allowed = wanted
        if wanted and self._order.refuses(wanted * size - (allocator.capacity_bytes - allocator.used_bytes)):
            wanted = 0  # refused whole, before any of it evicts
        for position in new[:wanted]:
            offset = self._allocate(size, evicted)
            if offset is None:
                break
            key = keys[position]
            parent = None  # linked: the chunk before it (often the one just reserved), or its lookup's prefix
            if linked:
                parent = made_entry if position and position == made + 1 else entries.get(
                    keys[position - 1] if position else hints.pop(key, None))
            entries[key] = entry = Entry(offset, size)
            self._at[offset] = key
            if joined is not None:
                joined(key, entry, parent)
                made, made_entry = position, entry
            positions.append(position)
            offsets.append(offset)
        if len(positions) < allowed and self._order.refusing and size <= self.capacity_bytes and any(self._lists):
            self.refused_chunks += allowed - len(positions)  # kept out by the order, where room could be made
        self._order.admitting(None)
        self._publish_evicted(evicted)
        access = self._order.access
        for key, entry in reversed(pinned) if self._tail_first else pinned:
            entry.used = access
            lists[entry.tier][key] = entry  # touched: used again
        failed = len(new) - len(positions)
        self._report_reserved(model, salt, len(positions), failed, "l1_store")
        return WriteReservation(positions, offsets, present, failed)

    def _report_reserved(self, model: str, salt: str, reserved: int, failed: int, during: str) -> None:
        """``L1_WRITE_RESERVED`` for the chunks given space, ``L1_ALLOCATION_FAILED`` for the chunks that got none."""
        if reserved:
            self._pub.emit_salted(_L1_WRITE_RESERVED, salt, model, reserved)
        if failed:
            self._pub.emit(_L1_ALLOCATION_FAILED, (during,), salt_counts={(salt, model): failed})

    def commit_write(self, model: str, salt: str, hashes: Sequence[int], nbytes: int,
                     detail: Detail | None = None) -> list[tuple[int, str, str]]:
        """Make reserved chunks readable (``L1_WRITE_FINISHED``, and ``stored`` in the feed with ``detail``), just
        used in the eviction order.  Returns the sampled subset published with the event (callers reuse it)."""
        entries = self._entries
        lists = self._lists
        access = self._order.access
        for chunk_hash in reversed(hashes) if self._tail_first else hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries[key]
            entry.ready = True
            entry.nbytes = nbytes
            entry.used = access
            lists[entry.tier][key] = entry
        if self.feed is not None:
            self.feed.stored(model, salt, hashes, detail)
        return self._emit_keys(_L1_WRITE_FINISHED, model, salt, hashes) if hashes else []

    def abort_write(self, model: str, salt: str, hashes: Sequence[int]) -> None:
        """Give back reserved space whose data never arrived (publishes nothing)."""
        for chunk_hash in hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._order.forget(key, entry)
                del self._at[entry.offset]
                self.allocator.free(entry.offset, entry.size)

    # -- reads --------------------------------------------------------------------

    def lock_prefix(self, model: str, salt: str, hashes: Sequence[int], publish: bool = True,
                    lookup: bool = True) -> int:
        """Read-lock the longest prefix of ``hashes`` that is ready in L1 (``L1_READ_RESERVED`` unless
        ``publish`` is False: a lock held only for the length of one copy).  Returns its length in chunks.  The
        locks keep those chunks from being evicted until :meth:`finish_read` or :meth:`release_read`.  A lookup
        begins a new access for the eviction order (``lookup`` False: locks for a copy or a landing, which do not)."""
        if lookup and self._counts_accesses:
            self._order.access += 1
        entries, lists, again = self._entries, self._lists, self._again
        asked = self._asked if lookup else None
        found, key, reused = 0, None, False
        for chunk_hash in hashes:
            previous, key = key, ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if entry is None or not entry.ready:
                if found and self._order.prefix_aware:
                    self._order.hint(key, previous)
                break
            if entry.readers == 0:
                del lists[entry.tier][key]
                if entry.tier != again:
                    self._promote(entry)
                else:
                    reused = True
            entry.readers += 1
            found += 1
            if asked is not None:
                asked((key,), entry.size, True)
        if reused:
            self._order.reused = True  # an object seen again is used: the order may refuse a store for it
        if found and publish:
            self._pub.emit_salted(_L1_READ_RESERVED, salt, model, found)
        return found

    def read(self, model: str, salt: str, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(byte offset, nbytes) of the longest readable prefix of chunks that lookup reported present.

        A chunk that is missing (``not_found``) or still being written (``write_locked``) is an anomaly, not a
        miss: every such chunk from the first one on is counted in ``L1_READ_FAILED`` (during=l1_retrieve, one
        event per reason).  Readable chunks after the gap are not returned either (a prefix cannot use them)
        but are not read failures."""
        entries = self._entries
        out = []
        for chunk_hash in hashes:
            entry = entries.get(ChunkKey(model, salt, chunk_hash))
            if entry is None or not entry.ready:
                break
            out.append((entry.offset, entry.nbytes))
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

    def _take(self, key: ChunkKey, entry: Entry) -> None:
        """Out of the eviction order (locked or pinned): used again."""
        del self._lists[entry.tier][key]
        if entry.tier != self._again:
            self._promote(entry)

    def _unlock(self, model: str, salt: str, hashes: Sequence[int]) -> None:
        entries = self._entries
        lists = self._lists
        access = self._order.access
        for chunk_hash in reversed(hashes) if self._tail_first else hashes:
            key = ChunkKey(model, salt, chunk_hash)
            entry = entries.get(key)
            if entry is None or entry.readers == 0:
                continue
            entry.readers -= 1
            if entry.readers == 0:
                if entry.ready:
                    entry.used = access
                    lists[entry.tier][key] = entry  # used again
                else:  # lost while it was locked (lose_all): gone now
                    evicted = Evicted()
                    self._order.forget(key, entry)
                    self._drop(key, entry, evicted)
                    self._publish_evicted(evicted)

    # -- eviction -----------------------------------------------------------------

    def evict_tick(self) -> tuple[float, bool]:
        """One iteration of the eviction loop.  It evicts nothing (a store evicts what it needs, when it needs
        it): it publishes ``L1_EVICTION_LOOP_TICK`` with the usage now, watermark 1.0 (L1 evicts only when
        full) and triggered = whether allocations evicted since the previous tick; returns (usage, triggered)."""
        usage, triggered = self.usage, self._made_room
        self._made_room = False
        self._pub.emit(_L1_EVICTION_LOOP_TICK, (usage, 1.0, triggered))
        return usage, triggered

    def clear(self) -> int:
        """Evict every entry that is neither locked nor being written (LMCache's ``clear``); returns how many."""
        return self._evict(len(self._order))

    def generation(self) -> int:
        """Changes whenever the pool's bytes may have been lost (a fault in it, :meth:`lose_all`): a copy or a
        reservation that began at another generation holds no valid bytes and must fail."""
        return self._losses + self.pool_faults()

    def lost_since(self, generation: int, objects: int) -> bool:
        """Whether the pool was lost since ``generation`` (a copy or reservation begun then holds no valid
        bytes); if so, its ``objects`` are counted as lost copies."""
        if self.generation() == generation:
            return False
        self.lost_copies += objects
        return True

    def lose_all(self) -> int:
        """The pool's bytes were lost (a peer truncated it): every readable object goes, evicted at once if it
        is unlocked, else made unreadable now and evicted when its last reader lets go (its offset stays valid
        meanwhile).  Space being written keeps its reservation until its writer, finding :meth:`generation`
        changed, gives it back.  Returns how many objects were lost."""
        self._losses += 1
        lost = self.clear()
        for entry in self._entries.values():
            if entry.ready:  # read-locked
                entry.ready = False
                lost += 1
        return lost

    def _evict(self, count: int) -> int:
        """Evict up to ``count`` unlocked entries in the policy's order (one L1_KEYS_EVICTED); returns how many."""
        evicted = Evicted()
        while evicted.count < count and self._evict_one(evicted):
            pass
        self._publish_evicted(evicted)
        return evicted.count

    def _allocate(self, size: int, evicted: Evicted) -> int | None:
        """Space for one object: let the allocator compact, else evict unlocked entries in the policy's order,
        until the allocator places it (None, evicting nothing, for an object larger than the pool)."""
        allocator = self.allocator
        offset = allocator.alloc(size)
        if offset is None and size <= self.capacity_bytes:
            # compaction frees a slab only where a class's free spots add up to over half a slab, which the
            # allocator's free bytes then exceed: below that, no call (the common case: one object size)
            half_slab, victim = allocator.slab_bytes // 2, self._order.victim
            while offset is None:
                if (allocator.carved_bytes - allocator.used_bytes <= half_slab
                        or not allocator.compact(self._movable, self._move)):
                    chosen = victim()
                    if chosen is None:  # every entry is locked or being written
                        break
                    self._drop(chosen[0], chosen[1], evicted)
                    self._made_room = True
                offset = allocator.alloc(size)
        return offset

    def _movable(self, offset: int) -> bool:
        """Whether the object at ``offset`` may move: ready and unlocked, so no one holds its offset (readers
        and writers are given offsets under a read lock or a write reservation)."""
        entry = self._entries[self._at[offset]]
        return entry.ready and not entry.readers

    def _move(self, old: int, new: int) -> None:
        """Move the object at ``old`` to ``new``: its bytes and its entry."""
        key = self._at.pop(old)
        entry = self._entries[key]
        pool = self.pool
        pool[new : new + entry.nbytes] = pool[old : old + entry.nbytes]
        entry.offset = new
        self._at[new] = key

    def _evict_one(self, evicted: Evicted) -> bool:
        """Evict the policy's next victim; False when every entry is locked or being written."""
        chosen = self._order.victim()
        if chosen is None:
            return False
        key, entry = chosen
        self._drop(key, entry, evicted)
        return True

    def _drop(self, key: ChunkKey, entry: Entry, evicted: Evicted) -> None:
        """Evict one entry already out of the eviction order: its space freed, counted in ``evicted``."""
        del self._entries[key]
        del self._at[entry.offset]
        self.allocator.free(entry.offset, entry.size)
        evicted.groups[(key.cache_salt, key.model_name)] += 1
        if self.feed is not None:
            evicted.keys.append(key)
        if self._gate(key.chunk_hash):
            evicted.sampled.append((key.chunk_hash, key.cache_salt, key.model_name))
        evicted.count += 1

    def _publish_evicted(self, evicted: Evicted) -> None:
        if evicted.count:
            self._pub.emit(_L1_KEYS_EVICTED, salt_counts=evicted.groups, sampled=evicted.sampled)
            if evicted.keys and self.feed is not None:
                self.feed.removed(evicted.keys)

    def _emit_keys(self, etype: EventType, model: str, salt: str, hashes: Sequence[int]) -> list[tuple[int, str, str]]:
        gate = self._gate
        sampled = [(h, salt, model) for h in hashes if gate(h)]
        if sampled:
            self._pub.emit(etype, salt_counts={(salt, model): len(hashes)}, sampled=sampled)
        else:
            self._pub.emit_salted(etype, salt, model, len(hashes))
        return sampled
