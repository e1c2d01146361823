"""The key path's one cache: what it gives for a frame is what the ordinary parse gives, and its chunk keys what
hashing from scratch gives, whatever frames came before (repeats, near twins, other salts, other scopes, both
spellings); it reuses only within a salt; and what it keeps stays within its one byte bound."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.lmcache_client import key, packed_key

from mpcache.cache.lmcache import keycache, keyscan, wire
from mpcache.cache.lmcache.keycache import KeyCache
from mpcache.contract.keys import chunk_hashes, rank_hashes

MAX_TOKENS = 1 << 16
CHUNK = 4
compiled = pytest.mark.skipif(keyscan.split_key is None, reason="mpcache.cache.lmcache._keyscan was not built")


def _frame(tokens: list[int], request_id: str = "r1", packed: bool = False, **fields) -> bytes:
    build = packed_key if packed else key
    return msgpack.packb(build(tokens, request_id, **fields), use_bin_type=True)


def _parsed(frame: bytes) -> wire.Key:
    """The ordinary path: msgpack's decode and the field checks, nothing kept."""
    return wire.parse_key(msgpack.unpackb(frame, raw=False), MAX_TOKENS)


def _expected(tokens: list[int], world_size: int, ranks: tuple[int, ...], first: int, last: int) -> list[int]:
    return rank_hashes(chunk_hashes(tokens[: last * CHUNK], CHUNK)[first:last], world_size, ranks)


@compiled
def test_a_repeated_frame_gets_the_key_parsed_before_and_near_twins_their_own() -> None:
    tokens = list(range(1000, 3000))
    frames = [_frame(tokens), _frame(tokens[:-1] + [2998]), _frame(tokens, "r2"), _frame(tokens, start=256),
              _frame(tokens, worker_id=1, world_size=2), _frame(tokens, "r5", packed=True),
              _frame(tokens, "r3", packed=True, engine_hit=256)]
    assert len({len(frame) for frame in frames[:3]}) == 1  # same length: only the bytes tell them apart
    cache = KeyCache(MAX_TOKENS, CHUNK)
    for index, frame in enumerate(frames):
        got = cache.key(frame)
        assert got == _parsed(frame)
        again = cache.key(bytes(bytearray(frame)))  # an equal frame, not the same object
        assert again == got
        assert (again is got) == (index < len(frames) - 1)  # kept, but for a lookup's hint (a map): parsed again


@compiled
def test_a_token_list_is_reused_within_its_salt_only() -> None:
    """The same tokens under another salt (or none) are read and hashed anew; under the same salt, for another
    request, their int64s are the ones read before."""
    tokens = list(range(5000, 5600))
    cache = KeyCache(MAX_TOKENS, CHUNK)
    tenant_a = cache.key(_frame(tokens, salt="a"))
    same_salt = cache.key(_frame(tokens, "r2", salt="a"))
    others = [cache.key(_frame(tokens, salt="b")), cache.key(_frame(tokens, "r2")),
              cache.key(_frame(tokens, "r4", packed=True, salt="b"))]
    assert same_salt.tokens is tenant_a.tokens
    assert all(other.tokens is not tenant_a.tokens for other in others)
    assert [other.cache_salt for other in others] == ["b", "", "b"]
    for got in (tenant_a, same_salt, *others):
        assert cache.chunk_keys(got, (0,), 0, 150) == _expected(tokens, 1, (0,), 0, 150)


def test_scopes_keep_their_own_request_ids() -> None:
    """The same frame from two uids (request ids kept per uid): each gets its own, every time."""
    cache = KeyCache(MAX_TOKENS, CHUNK)
    frame = _frame(list(range(64)))
    for _ in range(2):
        assert [cache.key(frame, scope).request_id for scope in ("1/", "2/", "")] == ["1/r1", "2/r1", "r1"]


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 9), max_size=20),
                          st.sampled_from(["", "s"]), st.booleans(), st.integers(1, 3), st.integers(0, 6),
                          st.integers(0, 6)), max_size=30))
@settings(max_examples=200, deadline=None)
def test_keys_are_what_parsing_and_hashing_give_whatever_came_before(calls):
    """Requests whose token lists change, grow or repeat, under two salts, both spellings, several layouts and
    ranges, with a bound that keeps only a few: every key is the ordinary parse's and every chunk key equals
    hashing from scratch (nothing reused is ever stale)."""
    cache = KeyCache(MAX_TOKENS, CHUNK, max_bytes=3 * keycache.ENTRY_BYTES)
    for request, tokens, salt, packed, world_size, a, b in calls:
        frame = _frame(tokens, request, packed, salt=salt, world_size=world_size)
        got = cache.key(frame)
        assert got == _parsed(frame)
        whole = len(tokens) // CHUNK
        first, last = min(a, b, whole), min(max(a, b), whole)
        for ranks in (tuple(range(world_size)), (world_size - 1,)):
            assert cache.chunk_keys(got, ranks, first, last) == _expected(tokens, world_size, ranks, first, last)
        assert cache.bytes_kept <= cache.max_bytes


def test_what_is_kept_is_held_to_one_byte_bound() -> None:
    """Entries go oldest first to stay within the bound; a layout that would take one request past it is computed
    each time and not kept; a request's entry goes with its end_session."""
    tokens = list(range(40))
    bound = 3 * (keycache.ENTRY_BYTES + 8 * len(tokens)) + 2048
    cache = KeyCache(MAX_TOKENS, CHUNK, max_bytes=bound)
    for index in range(6):
        cache.chunk_keys(cache.key(_frame(tokens, f"r{index}")), (0,), 0, 10)
        assert cache.bytes_kept <= bound
    assert 0 < len(cache) < 6
    wide = tuple(range(4096))  # 10 chunks x 4096 ranks: far more than the bound
    big = cache.key(_frame(tokens, "r5", world_size=4096))
    assert cache.chunk_keys(big, wide, 9, 10) == _expected(tokens, 4096, wide, 9, 10)
    assert cache.bytes_kept <= bound
    assert np.frombuffer(big.tokens, dtype="<i8").tolist() == tokens
    kept = len(cache)
    cache.forget("r5")
    cache.forget("r5")
    assert len(cache) == kept - 1


def test_a_layout_s_ranks_are_charged_with_its_keys() -> None:
    """A client may ask for one request's keys under every TP size up to 4,096, with a key too short for a whole
    chunk (no L1 key to keep): what each layout keeps is its ranks, up to 4,096 numbers, and that is charged, so the
    ranks kept stay within the bound (charged nothing, every layout was kept: gigabytes under a 64 MiB bound)."""
    bound = 1 << 20
    cache = KeyCache(MAX_TOKENS, CHUNK, max_bytes=bound)
    for world_size in range(1, 4097):
        short = cache.key(_frame([7], "r1", world_size=world_size))
        assert [] == cache.chunk_keys(short, tuple(range(world_size)), 0, 1)
    ranks_kept = sum(len(ranks) for entry in cache._entries.values() for _, ranks, _ in entry.ranked)
    assert 0 < ranks_kept and keycache.INT_BYTES * ranks_kept <= cache.bytes_kept <= bound


def test_what_a_bound_keeps_is_about_what_it_charges() -> None:
    """Layouts of one rank (as stores ask for them) under every TP size and worker, of a key too short for a whole
    chunk: the memory they take stays within twice the bound (charged per key and rank alone, a layout's own
    dict slot and tuples were free: five and a half times the bound)."""
    import dataclasses
    import tracemalloc

    bound = 1 << 20
    cache = KeyCache(MAX_TOKENS, CHUNK, max_bytes=bound)
    short = cache.key(_frame([7], "r1"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for world_size in range(1, 257):
            for worker in range(world_size):
                cache.chunk_keys(dataclasses.replace(short, world_size=world_size), (worker,), 0, 1)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.bytes_kept <= bound and grown <= 2 * bound
