"""Reusing the key of a repeated key frame gives exactly what parsing the frame gives: frames that differ in
one token or one field (same length) are never taken for each other, and only the last few are kept."""

from __future__ import annotations

import msgpack
from support.lmcache_client import key

from mpcache.cache.lmcache import wire
from mpcache.cache.lmcache.recentkeys import RECENT, RecentKeys

MAX_TOKENS = 1 << 16


def _frame(tokens: list[int], request_id: str = "r1", **fields) -> bytes:
    return msgpack.packb(dict(key(tokens, request_id, worker_id=0), **fields), use_bin_type=True)


def _parsed(frame: bytes) -> wire.Key:
    return wire.parse_key_frame(frame, MAX_TOKENS, wire.Decoder(MAX_TOKENS))


def test_a_repeated_frame_gets_the_key_parsed_before_and_near_twins_their_own() -> None:
    tokens = list(range(1000, 3000))
    frames = [_frame(tokens), _frame(tokens[:-1] + [2998]), _frame(tokens, "r2"), _frame(tokens, start=256),
              _frame(tokens, worker_id=1, world_size=2)]
    assert len({len(frame) for frame in frames[:3]}) == 1  # same length: only the bytes tell them apart
    recent = RecentKeys()
    for frame in frames:
        assert recent.get(frame) is None
        recent.put(frame, _parsed(frame))
    for frame in reversed(frames):
        assert recent.get(bytes(frame)) == _parsed(frame)  # an equal frame, not the same object


def test_only_the_last_few_frames_are_kept() -> None:
    recent = RecentKeys()
    frames = [_frame([index] * 300) for index in range(RECENT + 1)]
    for frame in frames:
        recent.put(frame, _parsed(frame))
    assert recent.get(frames[0]) is None
    assert [recent.get(frame) for frame in frames[1:]] == [_parsed(frame) for frame in frames[1:]]
