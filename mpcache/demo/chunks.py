"""Deterministic chunk contents, so every chunk the demo stores can be verified after a retrieve."""

from __future__ import annotations

import numpy as np


def _chunk_pattern(block: np.ndarray, chunk_hash: int) -> tuple[int, np.uint64, np.ndarray]:
    words = len(block) // 8
    tail = np.frombuffer(chunk_hash.to_bytes(8, "little"), dtype=np.uint8)[: len(block) - words * 8]
    return words * 8, np.uint64(chunk_hash), tail


def fill_chunk(block: np.ndarray, chunk_hash: int) -> None:
    """Deterministic content, so every stored chunk can be verified after a retrieve: each 8 bytes
    hold the chunk's hash (written as 64-bit words: filling is not what the demo should spend on)."""
    cut, word, tail = _chunk_pattern(block, chunk_hash)
    block[:cut].view(np.uint64)[:] = word
    block[cut:] = tail


def chunk_matches(block: np.ndarray, chunk_hash: int) -> bool:
    """Whether ``block`` holds what :func:`fill_chunk` wrote for ``chunk_hash``."""
    cut, word, tail = _chunk_pattern(block, chunk_hash)
    return bool(np.all(block[:cut].view(np.uint64) == word)) and np.array_equal(block[cut:], tail)
