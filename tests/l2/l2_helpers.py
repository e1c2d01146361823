"""Keys, payloads and a bounded wait shared by the L2 tests (imported as ``l2_helpers``)."""

from __future__ import annotations

from concurrent.futures import Future

from mpcache.contract.keys import ChunkKey

TIMEOUT_S = 10.0  # the most any future in these tests may take


def key(index: int, model: str = "model-a", salt: str = "salt-a") -> ChunkKey:
    """The ``index``-th test key (chunk_hash = index)."""
    return ChunkKey(model, salt, index)


def payload(index: int, size: int = 1000) -> bytes:
    """``size`` bytes that differ for every index and at every position."""
    return bytes((index * 131 + position * 7 + (position >> 8)) & 0xFF for position in range(size))


def wait(future: Future):
    """The future's result, failing the test (not hanging it) after :data:`TIMEOUT_S`."""
    return future.result(timeout=TIMEOUT_S)
