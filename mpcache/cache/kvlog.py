"""The cache process's KV event log: every L1 object that became readable (``stored``) and every one that stopped
being readable (``removed``: eviction, ``clear``), and what its L2 store tasks wrote and evicted (medium
``L2:<tier>``), in order, for LMCache's ``subscribe_kv_events`` (cache-aware routers, through the engines'
KV-event publishers).

Append-only and fixed-size, so the data path allocates nothing per chunk and never waits for a reader: a record
is a row of preallocated columns holding references to objects that exist already (the key's hash, the model
and salt strings, the request's token bytes), overwritten oldest first.  A stored record keeps its request's
token bytes alive, ``token_budget`` bytes in all (oldest records dropped past it), so the log's memory is bounded
by its capacity and that budget.  Sequence numbers count from 1 in each incarnation (a fresh one per start of
the process); a reader whose cursor fell out of the window is told it ``lost`` records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from mpcache.contract.keys import ChunkKey

STORED, REMOVED = 0, 1
_TIER = 2  # added to the kind of an L2 tier's record
CPU = "CPU"  # L1's medium, as LMCache names it; an L2 tier's is "L2:<its name>"
TOKEN_BYTES_PER_RECORD = 1024  # the token budget, per record of capacity (32 MiB at the default 32,768)


class Detail(NamedTuple):
    """What a stored chunk's record says besides its key, aligned with the committed hashes: the request's
    token ids (little-endian int64 bytes), tokens per chunk, each hash's chunk index in them (``first`` plus
    its entry of ``chunks``: the objects the request already holds, so a record allocates none) and its parent
    (the same rank's and group's key of the chunk before; None for the first)."""

    tokens: bytes
    chunk_tokens: int
    first: int
    chunks: Sequence[int]
    parents: Sequence[int | None]


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


class KVEventLog:
    """At most ``capacity`` records (> 0) and ``token_budget`` bytes of token lists.

    A record writes only the columns its kind reads: its kind; its scope (an L1 store's ``(model, salt)``, made
    once per call; a removal's or an L2 record's ``ChunkKey`` itself); a store's key and parent; and the run of a
    store that said its tokens (``(tokens, first chunk, tokens per chunk)``, once per call), its chunk's place
    in it and the token bytes it accounts for (the first record of a run sharing one list).  An L1 removal is
    three list stores."""

    __slots__ = ("capacity", "token_budget", "incarnation", "first", "next", "_kind", "_scope", "_key", "_parent",
                 "_run", "_at", "_held", "_medium", "_token_bytes", "_last_tokens")

    def __init__(self, capacity: int, token_budget: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a KV event log holds at least one record")
        self.capacity = capacity
        self.token_budget = capacity * TOKEN_BYTES_PER_RECORD if token_budget is None else token_budget
        self.incarnation = time.time_ns()
        self.first = 1  # the oldest record held
        self.next = 1  # the next record's sequence number
        self._kind = [0] * capacity  # STORED or REMOVED in L1; + _TIER in an L2 tier (whose name is _medium's)
        self._scope: list[tuple] = [("", "")] * capacity
        self._key = [0] * capacity
        self._parent: list[int | None] = [None] * capacity
        self._run: list[tuple[bytes, int, int] | None] = [None] * capacity
        self._at = [0] * capacity
        self._held = [0] * capacity
        self._medium = [CPU] * capacity
        self._token_bytes = 0
        self._last_tokens: bytes | None = None

    @property
    def last(self) -> int:
        return self.next - 1

    @property
    def token_bytes(self) -> int:
        """Bytes of token lists the records held account for."""
        return self._token_bytes

    @property
    def dropped(self) -> int:
        """Records no longer held (overwritten or dropped for the token budget)."""
        return self.first - 1

    def stored(self, model: str, salt: str, hashes: Sequence[int], detail: Detail | None) -> None:
        """Chunks that became readable (``detail`` None: their tokens are not known here)."""
        capacity = self.capacity
        kinds, scopes, keys, parents, runs = self._kind, self._scope, self._key, self._parent, self._run
        scope = (model, salt)
        if detail is None:
            for key in hashes:
                seq = self.next
                if seq - self.first >= capacity:
                    self._drop_oldest()
                i = seq % capacity
                kinds[i] = STORED
                scopes[i] = scope
                keys[i] = key
                parents[i] = None
                runs[i] = None
                self.next = seq + 1
            return
        held = 0
        run: tuple[bytes, int, int] | None = (detail.tokens, detail.first, detail.chunk_tokens)
        if detail.tokens is not self._last_tokens:
            self._last_tokens = detail.tokens
            held = len(detail.tokens)
            if held > self.token_budget:  # not kept (nor taken for kept by the next call naming it)
                run, held, self._last_tokens = None, 0, None
        places, helds = self._at, self._held
        for key, chunk, parent in zip(hashes, detail.chunks, detail.parents):
            seq = self.next
            if seq - self.first >= capacity:
                self._drop_oldest()
            if held:
                self._make_room(held, seq)
            i = seq % capacity
            kinds[i] = STORED
            scopes[i] = scope
            keys[i] = key
            parents[i] = parent
            runs[i] = run
            places[i] = chunk
            helds[i] = held
            held = 0
            self.next = seq + 1

    def removed(self, key: ChunkKey) -> None:
        """One L1 object no longer readable."""
        seq = self.next
        if seq - self.first >= self.capacity:
            self._drop_oldest()
        i = seq % self.capacity
        self._kind[i] = REMOVED
        self._scope[i] = key
        self._run[i] = None
        self.next = seq + 1

    def tier_changed(self, medium: str, stored: Sequence[ChunkKey], removed: Sequence[ChunkKey]) -> None:
        """What one L2 store task wrote and evicted (the evictions first: they made its room)."""
        for kind, keys in ((REMOVED, removed), (STORED, stored)):
            for key in keys:
                seq = self.next
                if seq - self.first >= self.capacity:
                    self._drop_oldest()
                i = seq % self.capacity
                self._kind[i] = kind + _TIER
                self._scope[i] = key
                self._run[i] = None
                self._medium[i] = medium
                self.next = seq + 1

    def _make_room(self, nbytes: int, seq: int) -> None:
        """Account for a token list the next record ``seq`` holds, dropping the oldest records past the budget."""
        self._token_bytes += nbytes
        while self._token_bytes > self.token_budget and self.first < seq:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forget the oldest record; a token list it accounted for passes to the next record sharing it."""
        seq = self.first
        i = seq % self.capacity
        run = self._run[i]
        if run is not None and self._held[i]:
            held, tokens = self._held[i], run[0]
            following = (seq + 1) % self.capacity
            after = self._run[following] if seq + 1 < self.next else None
            if after is not None and after[0] is tokens:
                self._held[following] = held
            else:
                self._token_bytes -= held
                if tokens is self._last_tokens:
                    self._last_tokens = None  # no record holds it any more: the next use counts it again
            self._held[i] = 0
        self._run[i] = None
        self.first = seq + 1
        if self.first == self.next:
            self._last_tokens = None

    def record(self, seq: int) -> Record:
        """The record ``seq`` (which must be held)."""
        i = seq % self.capacity
        kind, scope, run = self._kind[i], self._scope[i], self._run[i]
        if kind != STORED:  # an L1 removal, or an L2 tier's record: the scope is its ChunkKey
            medium = CPU if kind < _TIER else self._medium[i]
            return Record(seq, kind % _TIER, medium, scope[0], scope[1], scope[2], None, None, 0, 0)
        if run is None:
            return Record(seq, STORED, CPU, scope[0], scope[1], self._key[i], self._parent[i], None, 0, 0)
        tokens, first, count = run
        return Record(seq, STORED, CPU, scope[0], scope[1], self._key[i], self._parent[i], tokens,
                      first + self._at[i], count)

    def model_of(self, seq: int) -> str:
        return self._scope[seq % self.capacity][0]
