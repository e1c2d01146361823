"""A byte-weighted LRU stack over keys of several strata: for each access, the bytes of the distinct keys of
each stratum touched since the key's previous access, in O(log n) with one Fenwick tree per stratum over
access slots (renumbered when the slots run out; the tree steps are compiled where ``_fenwick`` was built).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable

from mpcache.telemetry.mrc import fenwick


def _empty_tree(slots: int) -> array[int]:
    return array("q", bytes(8 * (slots + 1)))


class ReuseStack:
    """The keys touched so far, most recent last, each with its size in bytes and its stratum."""

    def __init__(self, max_keys: int, strata: int = 1) -> None:
        self._slots = 4 * max_keys + 16  # slots between renumberings: one renumbering per 3 × max_keys touches
        self._trees = [_empty_tree(self._slots) for _ in range(strata)]
        self._entry: dict[Hashable, tuple[int, int, int]] = {}  # key -> (slot, bytes, stratum)
        self._next = 1
        self.total_bytes = [0] * strata

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entry

    def get(self, key: Hashable) -> tuple[int, int, int] | None:
        """``(slot, bytes, stratum)`` of ``key``, or None when it is not in the stack."""
        return self._entry.get(key)

    def weighted_above(self, slot: int, weights: list[float]) -> float:
        """The bytes of the keys touched since the one in ``slot`` was, each stratum's × its weight."""
        prefix = fenwick.prefix
        return sum((total - prefix(tree, slot)) * weight
                   for tree, total, weight in zip(self._trees, self.total_bytes, weights))

    def bytes_of(self, key: Hashable) -> int:
        return self._entry[key][1]

    def stratum_of(self, key: Hashable) -> int:
        return self._entry[key][2]

    def stratum_of_or(self, key: Hashable, default: int = -1) -> int:
        entry = self._entry.get(key)
        return default if entry is None else entry[2]

    def keys_in(self, stratum: int) -> list[Hashable]:
        return [key for key, (_, _, of) in self._entry.items() if of == stratum]

    def entries(self) -> Iterable[tuple[Hashable, tuple[int, int, int]]]:
        """Every key with its (slot, bytes, stratum), least recently used first (every touch re-inserts its
        key with the next slot, and a renumbering keeps their order)."""
        return self._entry.items()

    def load(self, entries: Iterable[tuple[Hashable, int, int]]) -> None:
        """Replace the keys with ``entries`` ((key, bytes, stratum), least recently used first)."""
        self._trees = [_empty_tree(self._slots) for _ in self._trees]
        self._entry = {}
        self._next = 1
        self.total_bytes = [0] * len(self._trees)
        for key, nbytes, stratum in entries:
            self.touch(key, nbytes, stratum)

    def touch(self, key: Hashable, nbytes: int, stratum: int = 0) -> None:
        """``key`` (of ``nbytes``, in ``stratum``) becomes the most recently used."""
        self.remove(key)
        if self._next > self._slots:
            self._renumber()
        slot = self._next
        self._next += 1
        self._entry[key] = (slot, nbytes, stratum)
        fenwick.add(self._trees[stratum], slot, nbytes)
        self.total_bytes[stratum] += nbytes

    def restratum(self, key: Hashable, stratum: int) -> None:
        """``key`` moves to ``stratum`` where it is in the stack, keeping its place and bytes."""
        entry = self._entry.get(key)
        if entry is not None and entry[2] != stratum:
            slot, nbytes, old = entry
            fenwick.add(self._trees[old], slot, -nbytes)
            self.total_bytes[old] -= nbytes
            fenwick.add(self._trees[stratum], slot, nbytes)
            self.total_bytes[stratum] += nbytes
            self._entry[key] = (slot, nbytes, stratum)

    def remove(self, key: Hashable) -> None:
        entry = self._entry.pop(key, None)
        if entry is not None:
            slot, nbytes, stratum = entry
            fenwick.add(self._trees[stratum], slot, -nbytes)
            self.total_bytes[stratum] -= nbytes

    def prune(self, limit: float, weights: list[float]) -> list[tuple[Hashable, int]]:
        """Forget the keys deeper than ``limit``: those whose distance, the bytes above them (each stratum's
        × its weight) and their own, exceeds it (no capacity up to ``limit`` holds them).  Returns them with
        their strata.  Weights are at least 1 (or 0: a stratum that admits nothing)."""
        if sum(total * weight for total, weight in zip(self.total_bytes, weights)) <= limit:
            return []  # no key's distance passes every key's weighted bytes: none is past the limit (no sort)
        entries = self._entry
        order = sorted(entries, key=lambda key: entries[key][0], reverse=True)
        depth = 0.0  # the weighted bytes above the key
        for index, key in enumerate(order):
            _, nbytes, stratum = entries[key]
            if depth + nbytes > limit:
                gone = [(old, entries[old][2]) for old in order[index:]]
                for old, _ in gone:
                    self.remove(old)
                return gone
            depth += nbytes * weights[stratum]
        return []

    def _renumber(self) -> None:
        """Give the live keys slots 1..n in their order, and rebuild the trees (O(n))."""
        entries = self._entry
        order = sorted(entries, key=lambda key: entries[key][0])
        trees = [[0] * (self._slots + 1) for _ in self._trees]
        for slot, key in enumerate(order, start=1):
            _, nbytes, stratum = entries[key]
            entries[key] = (slot, nbytes, stratum)
            trees[stratum][slot] = nbytes
        for tree in trees:  # the linear-time Fenwick build
            for slot in range(1, self._slots + 1):
                parent = slot + (slot & -slot)
                if parent <= self._slots:
                    tree[parent] += tree[slot]
        self._trees = [array("q", tree) for tree in trees]
        self._next = len(order) + 1
