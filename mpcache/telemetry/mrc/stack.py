"""A byte-weighted LRU stack: for each access, the bytes of the distinct keys touched since the key's
previous access, in O(log n) with a Fenwick tree over access slots (renumbered when the slots run out).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator


class ReuseStack:
    """The keys touched so far, most recent last, each with its size in bytes."""

    def __init__(self, max_keys: int) -> None:
        self._slots = 4 * max_keys + 16  # slots between renumberings: one renumbering per 3 × max_keys touches
        self._tree = [0] * (self._slots + 1)
        self._slot_of: dict[Hashable, int] = {}
        self._bytes_of: dict[Hashable, int] = {}
        self._next = 1
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot_of

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._slot_of)

    def bytes_of(self, key: Hashable) -> int:
        return self._bytes_of[key]

    def bytes_above(self, key: Hashable) -> int:
        """Bytes of the other keys touched since ``key`` was (it must be in the stack)."""
        return self.total_bytes - self._prefix(self._slot_of[key])

    def touch(self, key: Hashable, nbytes: int) -> None:
        """``key`` (of ``nbytes``) becomes the most recently used."""
        self.remove(key)
        if self._next > self._slots:
            self._renumber()
        slot = self._next
        self._next += 1
        self._slot_of[key] = slot
        self._bytes_of[key] = nbytes
        self._add(slot, nbytes)
        self.total_bytes += nbytes

    def remove(self, key: Hashable) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            nbytes = self._bytes_of.pop(key)
            self._add(slot, -nbytes)
            self.total_bytes -= nbytes

    def _renumber(self) -> None:
        """Give the live keys slots 1..n in their order, and rebuild the tree (O(n))."""
        order = sorted(self._slot_of, key=self._slot_of.__getitem__)
        tree = [0] * (self._slots + 1)
        for slot, key in enumerate(order, start=1):
            self._slot_of[key] = slot
            tree[slot] = self._bytes_of[key]
        for slot in range(1, self._slots + 1):  # the linear-time Fenwick build
            parent = slot + (slot & -slot)
            if parent <= self._slots:
                tree[parent] += tree[slot]
        self._tree = tree
        self._next = len(order) + 1

    def _add(self, slot: int, delta: int) -> None:
        tree, size = self._tree, self._slots
        while slot <= size:
            tree[slot] += delta
            slot += slot & -slot

    def _prefix(self, slot: int) -> int:
        tree, total = self._tree, 0
        while slot > 0:
            total += tree[slot]
            slot -= slot & -slot
        return total
