"""A request's L1 keys, hashed once: LMCache sends a request's whole token list with every operation
(lookup, prepare and commit of store and retrieve, free_lookup_locks), so the chunk hashes of the
last token list seen per request id are kept and reused while the next frame's tokens are the same bytes.

Reuse needs byte-equal tokens, so a hit gives exactly what hashing would.  Bounded by entries and by
token bytes (oldest first), and per entry by rank layouts and their keys (a client naming ever other
world sizes or ranks, or a lookup of thousands of ranks, is answered without keeping them); an entry goes
with its request's end_session.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mpcache.cache.lmcache.groups import group_keys
from mpcache.contract.keys import chunk_hashes, rank_hashes

MAX_REQUESTS = 4096
MAX_TOKEN_BYTES = 64 << 20  # the token lists kept, in all
MAX_LAYOUTS = 16  # (world size, ranks, groups) kept per request: a TP group's ranks and its lookup's
MAX_LAYOUT_KEYS = 1 << 16  # a layout with more keys than this is computed each time, not kept


class _Entry:
    __slots__ = ("tokens", "hashes", "ranked")

    def __init__(self, tokens: bytes, hashes: list[int]) -> None:
        self.tokens = tokens
        self.hashes = hashes  # prefix-chained hashes of every whole chunk
        # (world size, ranks, KV cache groups) → every chunk's keys
        self.ranked: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


class ChunkKeys:
    """``keys(request_id, tokens, world_size, ranks, first, last, groups)``: the L1 keys of chunks
    ``[first, last)`` for each of ``groups`` KV cache groups and each of ``ranks``, chunk-major and rank-minor
    (:func:`~mpcache.contract.keys.rank_hashes`, then :func:`.groups.group_keys`)."""

    def __init__(self, chunk_tokens: int, max_requests: int = MAX_REQUESTS,
                 max_token_bytes: int = MAX_TOKEN_BYTES) -> None:
        self.chunk_tokens = chunk_tokens
        self._max_requests = max_requests
        self._max_token_bytes = max_token_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._token_bytes = 0

    def keys(self, request_id: str, tokens: bytes, world_size: int, ranks: tuple[int, ...], first: int,
             last: int, groups: int = 1) -> list[int]:
        entry = self._entry(request_id, tokens)
        layout = (world_size, ranks, groups)
        ranked = entry.ranked.get(layout)
        if ranked is None:
            ranked = rank_hashes(entry.hashes, world_size, ranks)
            if groups > 1:
                ranked = group_keys(ranked, len(ranks), groups)
            if len(ranked) <= MAX_LAYOUT_KEYS:
                if len(entry.ranked) >= MAX_LAYOUTS:
                    entry.ranked.clear()
                entry.ranked[layout] = ranked
        per = len(ranks) * groups
        return ranked[first * per : last * per]

    def _entry(self, request_id: str, tokens: bytes) -> _Entry:
        entries = self._entries
        entry = entries.get(request_id)
        if entry is not None and entry.tokens == tokens:
            return entry
        if entry is not None:
            self.forget(request_id)
        entry = _Entry(tokens, chunk_hashes(np.frombuffer(tokens, dtype="<i8"), self.chunk_tokens))
        entries[request_id] = entry
        self._token_bytes += len(tokens)
        while entries and (len(entries) > self._max_requests or self._token_bytes > self._max_token_bytes):
            _, oldest = entries.popitem(last=False)
            self._token_bytes -= len(oldest.tokens)
        return entry

    def forget(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._token_bytes -= len(entry.tokens)

    def __len__(self) -> int:
        return len(self._entries)
