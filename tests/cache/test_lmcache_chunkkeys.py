"""A request's chunk keys, hashed once: what ChunkKeys gives is what hashing gives, for any tokens, layout and
range, and what it keeps is bounded however a client varies them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.cache.lmcache import chunkkeys
from mpcache.cache.lmcache.chunkkeys import ChunkKeys
from mpcache.contract.keys import chunk_hashes, rank_hashes

CHUNK = 4


def _expected(tokens: list[int], world_size: int, ranks: tuple[int, ...], first: int, last: int) -> list[int]:
    return rank_hashes(chunk_hashes(tokens[: last * CHUNK], CHUNK)[first:last], world_size, ranks)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 9), max_size=20),
                          st.integers(1, 3), st.integers(0, 6), st.integers(0, 6)), max_size=30))
@settings(max_examples=200, deadline=None)
def test_keys_are_what_hashing_gives_whatever_came_before(calls):
    """Requests whose token lists change, grow or repeat, under several layouts and ranges: every answer
    equals hashing from scratch (a reused entry is never stale)."""
    keys = ChunkKeys(CHUNK)
    for request, tokens, world_size, a, b in calls:
        whole = len(tokens) // CHUNK
        first, last = min(a, b, whole), min(max(a, b), whole)
        for ranks in (tuple(range(world_size)), (world_size - 1,)):
            got = keys.keys(request, np.array(tokens, dtype="<i8").tobytes(), world_size, ranks, first, last)
            assert _expected(tokens, world_size, ranks, first, last) == got


def test_what_is_kept_is_bounded_by_requests_token_bytes_and_layouts(monkeypatch):
    monkeypatch.setattr(chunkkeys, "MAX_LAYOUT_KEYS", 8)
    keys = ChunkKeys(CHUNK, max_requests=3, max_token_bytes=3 * 8 * 8)
    tokens = np.arange(8, dtype="<i8").tobytes()  # two chunks
    for index in range(5):
        keys.keys(f"r{index}", tokens, 1, (0,), 0, 2)
    assert 3 == len(keys)
    keys.keys("big", np.arange(20, dtype="<i8").tobytes(), 1, (0,), 0, 5)  # 160 bytes: the others go
    assert 1 == len(keys)
    entry = keys._entries["big"]
    for world_size in range(1, 40):
        keys.keys("big", np.arange(20, dtype="<i8").tobytes(), world_size, (0,), 0, 5)
    assert len(entry.ranked) <= chunkkeys.MAX_LAYOUTS
    keys.keys("big", np.arange(20, dtype="<i8").tobytes(), 2, (0, 1), 0, 5)  # 10 keys > 8: not kept
    assert (2, (0, 1)) not in entry.ranked
    keys.forget("big")
    assert 0 == len(keys)
