"""The order in which L1 evicts (``--l1-policy``): which ready, unlocked object goes first when a store needs room.

* ``lru``: least recently used first, a request's chunks released head to tail (mpcache's order before the
  policy flag, and the one the miss-ratio curves model).
* ``arc``: Megiddo and Modha's adaptive replacement cache, which LMCache ships: objects seen once (T1) and seen
  again (T2) in two LRU lists; a miss on the ghost of what T1 evicted (B1) grows T1's target share, one on
  what T2 evicted (B2) shrinks it; a request's chunks released head to tail.
* ``adaptive`` (the default): ARC made prefix-aware.  A request's chunks are released tail to head, so within
  each list a prefix loses its tail before its head; and an object whose parent (the chunk before it in a
  request that stored or pinned it) is evicted is an orphan, worth nothing until its parent is back, so
  orphans go before anything else.  It adapts by ARC's ghost hits alone: nothing to tune per workload.

Sizes are bytes (objects of different models differ): T1's target and the ghosts' budget (L1's capacity, the
larger ghost list trimmed first) are bytes.  The state is bounded: the ghosts by that budget, the rest a list
slot, a tier and a parent per resident object.  :class:`~mpcache.cache.l1.L1Manager` calls ``new`` when it
reserves space for an object, ``put`` when an object enters the order (committed, or its last lock released),
``take`` when it leaves it (locked, or pinned by a store), ``victim`` to evict one, ``forget`` when a
reservation is given back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mpcache.config.derived import L1_POLICIES as POLICIES

PARENT_HINTS = 4096  # lookups whose next chunk a store may reserve; a store follows its lookup within moments


class LruOrder:
    """Least recently used first."""

    tail_first = False
    prefix_aware = False

    def __init__(self, capacity_bytes: int, entry_of: Callable[[Any], Any]) -> None:
        self._lru: OrderedDict[Any, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def new(self, key: Any, entry: Any) -> None:
        return None

    def put(self, key: Any, entry: Any) -> None:
        self._lru[key] = entry

    def take(self, key: Any, entry: Any) -> None:
        del self._lru[key]

    def victim(self) -> tuple[Any, Any] | None:
        return self._lru.popitem(last=False) if self._lru else None

    def forget(self, key: Any, entry: Any) -> None:
        return None

    def hint(self, key: Any, parent_key: Any) -> None:
        return None

    def link_store(self, keys: list[Any]) -> None:
        return None


class ArcOrder:
    """ARC over bytes; with ``prefix_aware``, orphans first and tails before heads (the ``adaptive`` policy)."""

    def __init__(self, capacity_bytes: int, entry_of: Callable[[Any], Any], prefix_aware: bool = False) -> None:
        self.capacity = capacity_bytes
        self.prefix_aware = self.tail_first = prefix_aware
        self._entry_of = entry_of
        self._t1: OrderedDict[Any, Any] = OrderedDict()  # seen once, least recently used first
        self._t2: OrderedDict[Any, Any] = OrderedDict()  # seen again
        self._orphans: OrderedDict[Any, Any] = OrderedDict()  # parent evicted: evicted first
        self._b1: OrderedDict[Any, int] = OrderedDict()  # ghosts of T1's victims: key → bytes
        self._b2: OrderedDict[Any, int] = OrderedDict()
        self._bytes = [0, 0, 0]  # T1, T2, orphans (evictable bytes)
        self._ghost_bytes = [0, 0]  # B1, B2
        self.target = 0.0  # T1's share, bytes
        self._hints: OrderedDict[Any, Any] = OrderedDict()  # the chunk after a lookup's prefix → its parent

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._orphans)

    def new(self, key: Any, entry: Any) -> None:
        """Space reserved for ``key``: it starts in T1, or in T2 after a ghost hit, which moves T1's target by
        the object's bytes times the other ghost list's weight over this one's (at least once)."""
        ghosts = self._ghost_bytes
        for tier, sign in ((0, 1.0), (1, -1.0)):
            size = (self._b1, self._b2)[tier].pop(key, None)
            if size is not None:
                step = entry.size * max(ghosts[1 - tier] / ghosts[tier], 1.0)
                ghosts[tier] -= size
                self.target = min(float(self.capacity), max(0.0, self.target + sign * step))
                entry.tier = 1
                return
        entry.tier = 0

    def put(self, key: Any, entry: Any) -> None:
        tier = 2 if entry.orphan else entry.tier
        (self._t1, self._t2, self._orphans)[tier][key] = entry
        self._bytes[tier] += entry.size

    def take(self, key: Any, entry: Any) -> None:
        """``key`` is locked or pinned: out of the order, and seen again (T2 when it comes back)."""
        tier = 2 if entry.orphan else entry.tier
        del (self._t1, self._t2, self._orphans)[tier][key]
        self._bytes[tier] -= entry.size
        entry.tier = 1
        entry.orphan = False

    def victim(self) -> tuple[Any, Any] | None:
        if self._orphans:
            key, entry = self._orphans.popitem(last=False)
            self._bytes[2] -= entry.size
        else:
            t1, t2 = self._t1, self._t2
            tier = 0 if t1 and (self._bytes[0] > self.target or not t2) else 1
            if not (t1 or t2):
                return None
            key, entry = (t1, t2)[tier].popitem(last=False)
            self._bytes[tier] -= entry.size
            ghosts = (self._b1, self._b2)[tier]
            ghosts[key] = entry.size
            self._ghost_bytes[tier] += entry.size
            self._trim_ghosts()
        if self.prefix_aware:
            self._orphan_children(key, entry)
        return key, entry

    def _trim_ghosts(self) -> None:
        counts = self._ghost_bytes
        while counts[0] + counts[1] > self.capacity:
            larger = 0 if counts[0] > counts[1] else 1
            _, size = (self._b1, self._b2)[larger].popitem(last=False)
            counts[larger] -= size

    def hint(self, key: Any, parent_key: Any) -> None:
        """``key`` comes right after a lookup's prefix: its parent is the prefix's last chunk, once a store
        reserves it (the newest :data:`PARENT_HINTS` are kept)."""
        hints = self._hints
        hints[key] = parent_key
        if len(hints) > PARENT_HINTS:
            hints.popitem(last=False)

    def link_store(self, keys: list[Any]) -> None:
        """A store's chunks in order: each one its predecessor's child, the first the child of the prefix its
        lookup found; an object is an orphan once its parent is evicted."""
        entry_of = self._entry_of
        parent_key = self._hints.pop(keys[0], None) if keys else None
        for key in keys:
            entry = entry_of(key)
            if entry is not None and parent_key is not None and entry.parent is None:
                parent = entry_of(parent_key)
                if parent is not None:
                    entry.parent = parent_key
                    if parent.children is None:
                        parent.children = set()
                    parent.children.add(key)
            parent_key = key

    def _orphan_children(self, key: Any, entry: Any) -> None:
        if entry.parent is not None:
            parent = self._entry_of(entry.parent)
            if parent is not None and parent.children:
                parent.children.discard(key)
        for child_key in entry.children or ():
            child = self._entry_of(child_key)
            if child is None or child.orphan:
                continue
            child.parent = None
            lists = (self._t1, self._t2)
            if child_key in lists[child.tier]:  # evictable: it goes first; a locked child is left alone
                del lists[child.tier][child_key]
                self._bytes[child.tier] -= child.size
                child.orphan = True
                self._orphans[child_key] = child
                self._bytes[2] += child.size

    def forget(self, key: Any, entry: Any) -> None:
        """A reservation given back: no longer its parent's child."""
        if entry.parent is not None:
            parent = self._entry_of(entry.parent)
            if parent is not None and parent.children:
                parent.children.discard(key)


def build(policy: str, capacity_bytes: int, entry_of: Callable[[Any], Any]) -> LruOrder | ArcOrder:
    """The order ``--l1-policy`` names."""
    if policy == "lru":
        return LruOrder(capacity_bytes, entry_of)
    if policy in ("arc", "adaptive"):
        return ArcOrder(capacity_bytes, entry_of, prefix_aware=policy == "adaptive")
    raise ValueError(f"unknown L1 policy {policy!r}: expected one of {', '.join(POLICIES)}")
