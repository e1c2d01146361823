"""What L1 holds (an :class:`Entry` per object), what its reservations hand back and what one operation evicted."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from mpcache.contract.keys import ChunkKey


class Entry:
    """One L1 object: its byte range, locks, and its place in the eviction order."""

    __slots__ = ("offset", "size", "nbytes", "readers", "ready", "tier", "access", "used", "store", "parent",
                 "children", "group")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset  # byte offset in the pool, fixed while the entry lives
        self.size = size  # bytes the allocator holds for it
        self.nbytes = 0  # bytes written (at most size)
        self.readers = 0
        self.ready = False
        self.tier = 0  # the eviction order's list (ARC: 0 seen once, 1 seen again)
        self.access = 0  # the lookup that preceded its reservation (ARC orders: one access is never split)
        self.used = 0  # the lookup before it last went (back) into the order (ARC orders: T1 and T2 joined by it)
        self.store: object = None  # the name of the store that reserved it, if named (its other ranks spare it)
        self.parent: Entry | None = None  # the chunk before it in a request, while resident (prefix-aware order)
        self.children: ChunkKey | dict[ChunkKey, None] | None = None  # the one child's key, or several, in store order
        self.group: list[Any] | None = None  # its group's count in the order's fair shares, where a store counted it


class WriteReservation(NamedTuple):
    """Outcome of :meth:`L1Manager.reserve_write` for one request's chunk hashes."""

    positions: list[int]  # index into the request's hashes of each reserved chunk, in order
    offsets: list[int]  # the byte offset in the pool reserved for each of them
    present: int  # chunks already in L1 (not rewritten)
    failed: int  # chunks that got no space


class PrefetchReservation(NamedTuple):
    """Outcome of :meth:`L1Manager.reserve_prefetch` for the chunks an L2 prefetch wants to land."""

    offsets: list[int]  # per covered chunk, in order: its landing offset, or -1 when it was already ready (now locked)
    failed: int  # chunks that needed space and got none (L1_ALLOCATION_FAILED, during=l2_prefetch)
    stopped: int  # chunks not covered because one of them is being written by someone else (or repeats)


class Evicted:
    """What one operation evicted, published as one ``L1_KEYS_EVICTED`` (and, where L1 has a feed, as one row
    of removals: ``keys``)."""

    __slots__ = ("count", "groups", "sampled", "keys")

    def __init__(self) -> None:
        self.count = 0
        self.groups: Counter[tuple[str, str]] = Counter()
        self.sampled: list[tuple[int, str, str]] = []
        self.keys: list[ChunkKey] = []
