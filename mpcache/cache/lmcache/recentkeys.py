"""The last few key frames and the keys parsed from them.

LMCache sends the commit of a store or a retrieve with the very key frame of its prepare (and a
scheduler's lookup locks are freed with its lookup's), so about half of all key frames repeat one of
the last few byte for byte; such a frame's key is the one parsed before (keys are immutable), found
by a length check and one comparison instead of scanning and validating the frame again.
"""

from __future__ import annotations

from mpcache.cache.lmcache.wire import Key

RECENT = 8
MAX_KEPT_FRAME_BYTES = 1 << 20  # a longer frame is parsed each time, not kept


class RecentKeys:
    """``get(frame)``: the key of a byte-identical frame among the last ``RECENT`` kept, or None; ``put``
    keeps one (oldest out)."""

    __slots__ = ("_frames", "_keys", "_next")

    def __init__(self) -> None:
        self._frames: list[bytes] = [b""] * RECENT
        self._keys: list[Key | None] = [None] * RECENT
        self._next = 0

    def get(self, frame: bytes) -> Key | None:
        size = len(frame)
        for index, held in enumerate(self._frames):
            if len(held) == size and held == frame:
                return self._keys[index]
        return None

    def put(self, frame: bytes, key: Key) -> None:
        if len(frame) > MAX_KEPT_FRAME_BYTES:
            return
        self._frames[self._next] = frame
        self._keys[self._next] = key
        self._next = (self._next + 1) % RECENT
