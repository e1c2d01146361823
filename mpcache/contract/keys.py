"""Chunk keys, stable content hashes (blake2b-64, never Python's salted ``hash()``) and the sampling gate,
so every process and every restart agrees on a chunk's key and on whether it is sampled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

SAMPLE_MODULUS = 1_000_003


class ChunkKey(NamedTuple):
    """What L1 and L2 index by: the same tokens under another model or salt are another chunk."""

    model_name: str
    cache_salt: str
    chunk_hash: int


def chunk_hashes(tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[int]:
    """Prefix-chained 64-bit hashes of the whole chunks of ``tokens``.

    Chunk i's hash covers chunk i and, through the previous hash, every chunk
    before it, so equal hashes mean equal prefixes.  A trailing partial chunk
    is not hashed (it cannot be cached).
    """
    array = np.ascontiguousarray(tokens, dtype=np.int64)
    hashes = []
    previous = b"\0" * 8
    for start in range(0, len(array) - chunk_size + 1, chunk_size):
        digest = hashlib.blake2b(previous + array[start : start + chunk_size].tobytes(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return hashes


def rank_hashes(hashes: Sequence[int], world_size: int, ranks: Sequence[int]) -> list[int]:
    """Each chunk's hash folded with (world_size, rank), for every rank in turn: one KV object per rank,
    and the same tokens under another tensor-parallel layout are other objects."""
    suffixes = [world_size.to_bytes(4, "little") + rank.to_bytes(4, "little") for rank in ranks]
    blake2b = hashlib.blake2b
    return [int.from_bytes(blake2b(chunk_hash.to_bytes(8, "little") + suffix, digest_size=8).digest(), "little")
            for chunk_hash in hashes for suffix in suffixes]


def token_hash(tokens: Iterable[int]) -> int:
    """Stable 64-bit hash of a block's token ids (position-independent)."""
    data = np.fromiter(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class SampleGate:
    """``chunk_hash mod 1_000_003 < rate × 1_000_003``: the same answer everywhere."""

    def __init__(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {rate}")
        self.rate = rate
        self._threshold = rate * SAMPLE_MODULUS

    def __call__(self, value: int) -> bool:
        return value % SAMPLE_MODULUS < self._threshold
