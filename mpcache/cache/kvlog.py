"""The cache process's KV event log: every L1 object that became readable (``stored``) and every one that stopped
being readable (``removed``: eviction, ``clear``), and what its L2 store tasks wrote and evicted (medium
``L2:<tier>``), in order, for LMCache's ``subscribe_kv_events`` (cache-aware routers, through the engines'
KV-event publishers).

Append-only and bounded, and as cheap on the data path as a reference: each call appends one row, a tuple of
objects that exist already (the committed hashes' list and the store's :class:`Detail`, or the ``ChunkKey``
list of what one operation evicted), whatever its number of chunks; the records a reader gets (one per chunk,
each its own sequence number) are made from the rows when read.  At most ``capacity`` records are held (the
oldest go first, a row once all of its records went) and ``token_budget`` bytes of token lists (oldest rows
dropped past it).  Sequence numbers count from 1 in each incarnation (a fresh one per start of the process); a
reader whose cursor fell out of the window is told it ``lost`` records.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice
from operator import itemgetter
from typing import NamedTuple

from mpcache.contract.keys import ChunkKey

STORED, REMOVED = 0, 1
_KEYED = 2  # added to the kind of a row of ChunkKeys (removals, an L2 tier's stores)
CPU = "CPU"  # L1's medium, as LMCache names it; an L2 tier's is "L2:<its name>"
TOKEN_BYTES_PER_RECORD = 1024  # the token budget, per record of capacity (32 MiB at the default 32,768)


class Detail(NamedTuple):
    """What a store's stored records say besides their keys, as the store already holds it: the request's token
    ids (little-endian int64 bytes), tokens per chunk, the first chunk's index in them, each reserved key's
    chunk (relative to ``first``) and KV cache group, the store's keys (chunk-major, group-minor, ``groups`` per
    chunk) and the keys of the chunk before ``first`` (per group; None at the request's start).  A commit's
    hashes are the reserved keys from ``at`` on; a hash's parent is its group's key of the chunk before."""

    tokens: bytes
    chunk_tokens: int
    first: int
    chunks: Sequence[int]
    group_ids: Sequence[int]
    keys: Sequence[int]
    groups: int
    before: Sequence[int] | None
    at: int

    def parent(self, index: int) -> int | None:
        """The parent of the commit's ``index``-th hash."""
        chunk, group = self.chunks[self.at + index], self.group_ids[self.at + index]
        if chunk:
            return self.keys[(chunk - 1) * self.groups + group]
        return None if self.before is None else self.before[group]


class Record(NamedTuple):
    seq: int
    kind: int
    medium: str
    model: str
    salt: str
    key: int
    parent: int | None
    tokens: bytes | None
    chunk: int  # the chunk's index in ``tokens``
    token_count: int  # tokens per chunk


# A row: (first seq, records, kind, scope, keys, detail, token bytes held).  Its scope is an L1 store's
# (model, salt) (keys its hashes), or a keyed row's medium (keys its ChunkKeys).
_START = itemgetter(0)


class KVEventLog:
    """At most ``capacity`` records (> 0) and ``token_budget`` bytes of token lists."""

    __slots__ = ("capacity", "token_budget", "incarnation", "first", "next", "_rows", "_token_bytes")

    def __init__(self, capacity: int, token_budget: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a KV event log holds at least one record")
        self.capacity = capacity
        self.token_budget = capacity * TOKEN_BYTES_PER_RECORD if token_budget is None else token_budget
        self.incarnation = time.time_ns()
        self.first = 1  # the oldest record held
        self.next = 1  # the next record's sequence number
        self._rows: deque[tuple] = deque()
        self._token_bytes = 0

    @property
    def last(self) -> int:
        return self.next - 1

    @property
    def token_bytes(self) -> int:
        """Bytes of token lists the rows held account for."""
        return self._token_bytes

    @property
    def dropped(self) -> int:
        """Records no longer held (overwritten or dropped for the token budget)."""
        return self.first - 1

    def stored(self, model: str, salt: str, hashes: Sequence[int], detail: Detail | None) -> None:
        """Chunks that became readable (``detail`` None: their tokens are not known here).  ``hashes`` is kept,
        not copied: the caller never changes it."""
        count = len(hashes)
        if not count:
            return
        held = 0
        if detail is not None:
            rows = self._rows
            if not rows or rows[-1][5] is None or rows[-1][5].tokens is not detail.tokens:  # else: counted there
                held = len(detail.tokens)
                if held > self.token_budget:  # never kept
                    detail, held = None, 0
                else:
                    self._make_room(held)
        seq = self.next
        self._rows.append((seq, count, STORED, (model, salt), hashes, detail, held))
        self.next = seq + count
        if seq + count - self.first > self.capacity:
            self._forget_before(seq + count - self.capacity)

    def removed(self, keys: Sequence[ChunkKey], medium: str = CPU) -> None:
        """Objects no longer readable in ``medium`` (kept, not copied: the caller never changes the list)."""
        self._keyed(REMOVED, medium, keys)

    def tier_changed(self, medium: str, stored: Sequence[ChunkKey], removed: Sequence[ChunkKey]) -> None:
        """What one L2 store task wrote and evicted (the evictions first: they made its room)."""
        self._keyed(REMOVED, medium, removed)
        self._keyed(STORED, medium, stored)

    def _keyed(self, kind: int, medium: str, keys: Sequence[ChunkKey]) -> None:
        count = len(keys)
        if count:
            seq = self.next
            self._rows.append((seq, count, kind + _KEYED, medium, keys, None, 0))
            self.next = seq + count
            if seq + count - self.first > self.capacity:
                self._forget_before(seq + count - self.capacity)

    def _make_room(self, nbytes: int) -> None:
        """Account for a token list the next row holds, dropping the oldest rows past the budget."""
        rows = self._rows
        while rows and self._token_bytes + nbytes > self.token_budget:
            self._forget_before(rows[0][0] + rows[0][1])
        self._token_bytes += nbytes

    def _forget_before(self, seq: int) -> None:
        """Forget the records before ``seq``, and every row all of whose records went; a token list a row
        accounted for passes to the next row when that one shares it."""
        rows = self._rows
        while rows and rows[0][0] + rows[0][1] <= seq:
            row = rows.popleft()
            if row[6]:
                after = rows[0] if rows else None
                if after is not None and after[5] is not None and after[5].tokens is row[5].tokens:
                    rows[0] = after[:6] + (row[6],)
                else:
                    self._token_bytes -= row[6]
        self.first = max(self.first, seq)

    def records(self, after: int = 0) -> Iterator[Record]:
        """The records held after sequence number ``after``, oldest first (the log must not change while they
        are read: it is read between the loop's steps only)."""
        rows, start = self._rows, max(after + 1, self.first)
        if start >= self.next:
            return
        for row in islice(rows, bisect.bisect_right(rows, start, key=_START) - 1, None):
            for offset in range(max(0, start - row[0]), row[1]):
                yield _record(row, offset)

    def record(self, seq: int) -> Record:
        """The record ``seq`` (which must be held)."""
        if not self.first <= seq < self.next:
            raise IndexError(f"record {seq} is not held ({self.first}..{self.last})")
        return next(self.records(seq - 1))


def _record(row: tuple, offset: int) -> Record:
    seq, _, kind, scope, keys, detail, _ = row
    seq += offset
    if kind >= _KEYED:  # the scope is the medium
        key = keys[offset]
        return Record(seq, kind - _KEYED, scope, key[0], key[1], key[2], None, None, 0, 0)
    model, salt = scope
    if detail is None:
        return Record(seq, STORED, CPU, model, salt, keys[offset], None, None, 0, 0)
    return Record(seq, STORED, CPU, model, salt, keys[offset], detail.parent(offset), detail.tokens,
                  detail.first + detail.chunks[detail.at + offset], detail.chunk_tokens)
