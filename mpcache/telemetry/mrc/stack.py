"""A byte-weighted LRU stack over keys of several strata: for each access, the bytes of the distinct keys of
each stratum touched since the key's previous access, in O(log n) with one Fenwick tree per stratum over
access slots (renumbered when the slots run out).
"""

from __future__ import annotations

from collections.abc import Hashable


class ReuseStack:
    """The keys touched so far, most recent last, each with its size in bytes and its stratum."""

    def __init__(self, max_keys: int, strata: int = 1) -> None:
        self._slots = 4 * max_keys + 16  # slots between renumberings: one renumbering per 3 × max_keys touches
        self._trees = [[0] * (self._slots + 1) for _ in range(strata)]
        self._slot_of: dict[Hashable, int] = {}
        self._entry: dict[Hashable, tuple[int, int]] = {}  # key -> (bytes, stratum)
        self._next = 1
        self.total_bytes = [0] * strata

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot_of

    def bytes_of(self, key: Hashable) -> int:
        return self._entry[key][0]

    def stratum_of(self, key: Hashable) -> int:
        return self._entry[key][1]

    def keys_in(self, stratum: int) -> list[Hashable]:
        return [key for key, (_, of) in self._entry.items() if of == stratum]

    def bytes_above(self, key: Hashable) -> list[int]:
        """Per stratum, the bytes of the other keys touched since ``key`` was (it must be in the stack)."""
        slot = self._slot_of[key]
        return [total - self._prefix(tree, slot) for tree, total in zip(self._trees, self.total_bytes)]

    def touch(self, key: Hashable, nbytes: int, stratum: int = 0) -> None:
        """``key`` (of ``nbytes``, in ``stratum``) becomes the most recently used."""
        self.remove(key)
        if self._next > self._slots:
            self._renumber()
        slot = self._next
        self._next += 1
        self._slot_of[key] = slot
        self._entry[key] = (nbytes, stratum)
        self._add(self._trees[stratum], slot, nbytes)
        self.total_bytes[stratum] += nbytes

    def remove(self, key: Hashable) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            nbytes, stratum = self._entry.pop(key)
            self._add(self._trees[stratum], slot, -nbytes)
            self.total_bytes[stratum] -= nbytes

    def prune(self, limit: float, weights: list[float]) -> list[tuple[Hashable, int]]:
        """Forget the keys deeper than ``limit``: those whose bytes above them and their own, each stratum's
        × its weight, exceed it (no capacity up to ``limit`` holds them).  Returns them with their strata."""
        order = sorted(self._slot_of, key=self._slot_of.__getitem__, reverse=True)
        depth = 0.0
        for index, key in enumerate(order):
            nbytes, stratum = self._entry[key]
            depth += nbytes * weights[stratum]
            if depth > limit:
                gone = [(old, self._entry[old][1]) for old in order[index:]]
                for old, _ in gone:
                    self.remove(old)
                return gone
        return []

    def _renumber(self) -> None:
        """Give the live keys slots 1..n in their order, and rebuild the trees (O(n))."""
        order = sorted(self._slot_of, key=self._slot_of.__getitem__)
        trees = [[0] * (self._slots + 1) for _ in self._trees]
        for slot, key in enumerate(order, start=1):
            self._slot_of[key] = slot
            nbytes, stratum = self._entry[key]
            trees[stratum][slot] = nbytes
        for tree in trees:  # the linear-time Fenwick build
            for slot in range(1, self._slots + 1):
                parent = slot + (slot & -slot)
                if parent <= self._slots:
                    tree[parent] += tree[slot]
        self._trees = trees
        self._next = len(order) + 1

    def _add(self, tree: list[int], slot: int, delta: int) -> None:
        size = self._slots
        while slot <= size:
            tree[slot] += delta
            slot += slot & -slot

    @staticmethod
    def _prefix(tree: list[int], slot: int) -> int:
        total = 0
        while slot > 0:
            total += tree[slot]
            slot -= slot & -slot
        return total
