"""The demo's chunk content: deterministic per hash, and any difference is caught."""

from __future__ import annotations

import numpy as np
import pytest

from mpcache.demo.chunks import chunk_matches, fill_chunk


@pytest.mark.parametrize("size", [64 * 1024, 13])
def test_filled_chunk_matches_only_its_own_hash(size):
    """A filled block matches its hash, not another hash, and not after one byte flips."""
    block = np.zeros(size, dtype=np.uint8)
    fill_chunk(block, 0x0123456789ABCDEF)
    own, other = chunk_matches(block, 0x0123456789ABCDEF), chunk_matches(block, 0x0123456789ABCDEE)
    block[size // 2] ^= 1
    assert (True, False, False) == (own, other, chunk_matches(block, 0x0123456789ABCDEF))
