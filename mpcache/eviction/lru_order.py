"""``lru``'s eviction order: one list, least recently used first, a request's chunks released head to tail (one
pass over the reuse distances gives its miss-ratio curve at every size)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class LruOrder:
    """Least recently used first: one list, every object in tier 0."""

    tail_first = False
    prefix_aware = False
    chance = 1.0  # it admits every store
    floor = 0.0  # under no age floor
    again = 0  # the tier of an object used again: its own, so promote is never called

    new: Callable[[Any, Any, Any], None] | None = None  # LRU keeps no history of what it held
    reused = False  # set by lookups, read by no one: LRU admits every store
    refusing = False  # LRU refuses no store

    access = 0  # not counted: LRU evicts the newest objects last, so it never splits an access

    def __init__(self, capacity_bytes: int, entry_of: Callable[[Any], Any]) -> None:
        self.lists: tuple[OrderedDict[Any, Any], ...] = (OrderedDict(),)
        self.hints: dict[Any, Any] = {}  # never hinted: LRU is not prefix-aware

    def __len__(self) -> int:
        return len(self.lists[0])

    def hint(self, key: Any, parent_key: Any) -> None:
        return None

    def promote(self, entry: Any) -> None:
        return None

    def asked(self, keys: Sequence[Any], nbytes: float, found: bool) -> None:
        return None  # LRU counts nothing

    def admitting(self, keys: Sequence[Any] | None, nbytes: Sequence[float] | float = 0, store: Any = None,
                  new: Sequence[int] | None = None) -> None:
        return None  # LRU admits every store

    def refuses(self, need: float) -> bool:
        return False  # LRU admits every store

    def victim(self) -> tuple[Any, Any] | None:
        return self.lists[0].popitem(False) if self.lists[0] else None  # last=False, positional: no keyword parse

    def forget(self, key: Any, entry: Any) -> None:
        return None

    def grow(self, key: Any, entry: Any, nbytes: float) -> None:
        entry.size += nbytes  # LRU keeps no sizes of its own

    def merge(self, key: Any, entry: Any, other_key: Any, other: Any) -> None:
        self.grow(key, entry, other.size)
