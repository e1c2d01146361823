"""Miniature simulations (Waldspurger et al., ATC 2017) of an eviction order that is not a stack algorithm (ARC,
``adaptive``): one L1 per curve capacity, fed the history's tracked keys only (a lookup's first chunks and the
hash-sampled rest), each key standing for its bytes ÷ its stratum's rate, so that a miniature of the full
capacity holds the head keys as they are and a sample of the others; run by the order
:mod:`mpcache.eviction.order` builds for L1 itself; the weighted share of tracked accesses each one hits is the
curve at its capacity.

A lookup's resident keys are taken out of the order (promoted as L1's lookup does), its missing keys are then
stored (as the engine stores what it did not find: each after the key before it, the parent a prefix-aware order
links), and the keys found go back last (tail first where the order wants it), as L1 releases its read locks where
a request's store commits first (an engine that releases them before it stores puts them back first).  A store's
keys not resident are stored too, but for those a lookup's store did not store (the order refused them, or every
object it could evict was the lookup's own): the store that follows a lookup is the one its misses already made,
and storing them again would have the order admit them as refused before, or evict the lookup's found prefix,
which the miniature holds through the store as L1 does a read-locked prefix whose store commits first (the flow
the replays model; an engine that gives the locks back before it stores, as a retrieve does, lets its store evict
that prefix where L1 holds about one request).  Memory: each miniature holds at most its capacity in scaled bytes
of resident keys, as much again in ghosts, its order's shadow LRU and its admission trial's two (at most
:data:`~mpcache.eviction.shadow.SHADOW_KEYS` keys each, and the keys the trial's refusals remember within the
capacity's bytes, and the stores it watches for their return, as many as its capacity in scaled bytes) and
:data:`UNSTORED_KEYS` keys unstored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from mpcache.eviction import order as eviction_order
from mpcache.eviction.admission import TRIAL_HALVINGS

Key = tuple[Hashable, float]  # (key, bytes it stands for)
UNSTORED_KEYS = 4096  # the newest keys lookups' stores did not store, whose store event may yet come: within moments


def parents(keys: Sequence[Key]) -> dict[Hashable, Hashable]:
    """Each key of a lookup or store mapped to the key before it (a repeated key: before its last time)."""
    sequence = [key for key, _ in keys]
    return dict(zip(sequence[1:], sequence[:-1]))


def _stable_code(key: Any) -> int:
    """A key's number for the order's sketch and samples, the same in every process (a string's hash is not): a
    row's chunk hash, a segment's number (any other key: its hash)."""
    if type(key) is tuple and len(key) > 1:
        return key[0] if type(key[0]) is int else hash(key[1])  # as L1 numbers a chunk: its hash
    return hash(key)


class _Entry:
    """What the order reads and writes of a resident object (L1's entry, less the pool's fields)."""

    __slots__ = ("size", "tier", "access", "used", "store", "parent", "children")

    def __init__(self, size: float) -> None:
        self.size = size
        self.tier = 0
        self.access = self.used = 0
        self.store: object = None  # a miniature's stores are never named
        self.parent: _Entry | None = None
        self.children: Any = None


class MiniCache:
    """One miniature L1 of ``capacity_bytes`` under ``policy``."""

    def __init__(self, policy: str, capacity_bytes: float, trial: int | None = TRIAL_HALVINGS,
                 first_sight: bool = True) -> None:
        self.capacity = capacity_bytes
        self.used = 0.0
        self.entries: dict[Hashable, _Entry] = {}
        self.order = eviction_order.build(policy, int(capacity_bytes), self.entries.get, _stable_code,
                                          trial=trial, first_sight=first_sight)
        self.unstored: OrderedDict[Hashable, None] = OrderedDict()  # keys a lookup's store did not store

    def lookup(self, keys: Sequence[Key], parents: Mapping[Hashable, Hashable] | None = None) -> list[bool]:
        """Whether each key was resident; afterwards every key is (as far as it fits).  ``parents``: each key's
        key before it in ``keys`` (:func:`parents`; given once for many miniatures, else made here)."""
        order, entries = self.order, self.entries
        lists, again = order.lists, order.again
        asked = order.asked if order.prefix_aware else None  # as L1 counts what its lookups find
        if order.new is not None:
            order.access += 1  # a lookup begins an access
        found: list[tuple[Hashable, _Entry]] = []
        hits: list[bool] = []
        missing: list[Key] = []
        for item in keys:
            key = item[0]
            entry = entries.get(key)
            if entry is None:  # a key repeated in the lookup is judged as its first time: still missing
                hits.append(False)
                missing.append(item)
                continue
            if lists[entry.tier].pop(key, None) is not None:  # out of the order already: a repeat, judged a hit
                if entry.tier != again:
                    order.promote(entry)
                else:
                    order.reused = True  # as L1's lookup tells its order
                found.append((key, entry))
                if asked is not None:
                    asked((key,), entry.size, True)
            hits.append(True)
        if missing:
            unstored = self.unstored  # what this lookup's store did not store, its earlier ones' forgotten
            for key, _ in missing:
                unstored.pop(key, None)
            for key in self._store(missing, parents if parents is not None else self.parents(keys)):
                unstored[key] = None
            while len(unstored) > UNSTORED_KEYS:
                unstored.popitem(False)
        while self.used > self.capacity and (chosen := order.victim()) is not None:  # a merge grew a segment
            del entries[chosen[0]]
            self.used -= chosen[1].size
        for key, entry in reversed(found) if order.tail_first else found:
            entry.used = order.access
            lists[entry.tier][key] = entry
        return hits

    def store(self, keys: Sequence[Key], parents: Mapping[Hashable, Hashable] | None = None) -> None:
        """A store's keys: those not resident are given space, but for those a lookup's store did not store (this
        store is the one that lookup made), each skipped once."""
        entries, unstored = self.entries, self.unstored
        missing = [key for key in keys if key[0] not in entries and unstored.pop(key[0], True)]  # None: skipped
        if missing:
            self._store(missing, parents if parents is not None else self.parents(keys))

    def parents(self, keys: Sequence[Key]) -> Mapping[Hashable, Hashable]:
        """Each key's key before it in ``keys``, for an order that links a stored key to its parent (else none)."""
        return parents(keys) if self.order.prefix_aware else {}

    def _store(self, missing: Sequence[Key], parents: Mapping[Hashable, Hashable]) -> list[Hashable]:
        """Space for each of ``missing`` (in order, each linked to its key in ``parents``), evicting in the
        order's turn until it fits (one larger than what can be evicted is not stored, as L1 fails the
        allocation); the keys stored join the order once all have space.  Returns the keys it did not store (the
        order refused them, or nothing it could evict was left)."""
        order, entries = self.order, self.entries
        new, victim, capacity = order.new, order.victim, self.capacity
        stored, unstored = [], []
        if order.prefix_aware:  # as L1 counts what a store reserves
            for key, nbytes in missing:
                order.asked((key,), nbytes, False)
        # the order may refuse the store, as L1's does
        order.admitting([key for key, _ in missing], [nbytes for _, nbytes in missing])
        placed = {key: nbytes for key, nbytes in missing if key not in entries}
        if placed and order.refuses(sum(placed.values()) - (capacity - self.used)):
            order.admitting(None)
            return list(placed)  # refused whole, as L1 refuses it
        for key, nbytes in missing:
            if key in entries:
                continue  # repeated: stored once, as L1 writes a repeated hash once
            while self.used + nbytes > capacity:
                chosen = victim()
                if chosen is None:
                    unstored.append(key)
                    break
                del entries[chosen[0]]
                self.used -= chosen[1].size
            else:
                entries[key] = entry = _Entry(nbytes)
                self.used += nbytes
                if new is not None:
                    new(key, entry, entries.get(parents.get(key)))
                stored.append((key, entry))
        order.admitting(None)
        lists = order.lists
        for key, entry in reversed(stored) if order.tail_first else stored:
            lists[entry.tier][key] = entry
        return unstored

    def merge(self, first: Hashable, second: Hashable, second_bytes: float) -> None:
        """Two adjacent tail segments become one under ``first``'s key, of ``second_bytes`` more where ``second``
        is not resident: where both are, one entry of both their bytes at ``first``'s place in the order; where
        only ``first`` is (the rest of its tail evicted), it grows by ``second_bytes``, the room made by the
        lookup that follows (:meth:`lookup`: with its own keys out of the order, as the store of the rest would
        make it; the objects ``second`` stood for are found once); where only ``second`` is, neither (the lookup
        stores the merged segment whole, and ``second``'s children are evicted first)."""
        entries, order = self.entries, self.order
        kept, other = entries.get(first), entries.get(second)
        if kept is not None and other is not None:
            del entries[second], order.lists[other.tier][second]
            order.merge(first, kept, second, other)
        elif kept is not None:
            order.grow(first, kept, second_bytes)
            self.used += second_bytes
        elif other is not None:
            self._forget(second, other)

    def keep(self, admits: Callable[[Any], bool]) -> None:
        """A stratum's rate dropped: forget the resident keys ``admits`` no longer passes.  The others keep the
        bytes they were stored with, as the weights recorded at the old rate stay."""
        for key in [key for key in self.entries if not admits(key)]:
            self._forget(key, self.entries[key])

    def _forget(self, key: Hashable, entry: _Entry) -> None:
        """``key`` is no longer resident, and not a ghost either: gone from the miniature's accounts."""
        order = self.order
        del self.entries[key], order.lists[entry.tier][key]
        if order.new is not None:
            order.forget(key, entry)
        self.used -= entry.size
