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


def test_an_operation_lost_with_its_cache_process_is_counted_in_doubt_not_in_the_tally() -> None:
    """A store of 4 chunks for tenant-a whose cache process dies under it: the tally counts nothing for it,
    ``in_doubt`` gets 4 L1 writes for tenant-a and 4 allocation failures, ``lost_operations`` the store;
    a later-retrieve job left on the reconnected client is forgotten, one on the other client kept."""
    from types import SimpleNamespace

    from mpcache.client import CacheConnectionLost
    from mpcache.demo.run import Demo, Tally

    demo = Demo.__new__(Demo)  # no cache processes: only the bookkeeping
    demo.tally, demo.log = Tally(), SimpleNamespace(warning=lambda *args, **kwargs: None)
    demo.clients = [SimpleNamespace(generation=1), SimpleNamespace(generation=0)]
    demo.late = [(0, "r0", 7, 2, "tenant-a", "m", 0.0, 0), (1, "r1", 8, 2, "tenant-b", "m", 0.0, 0)]
    demo._doubt("tenant-a", l1_write=4, l1_allocation_failure=4)

    demo._connection_lost(CacheConnectionLost("store failed: ...", "store", reconnected=True))

    tally = demo.tally.as_dict()
    assert {"l1_write": {"tenant-a": 4}, "l1_allocation_failure": {"": 4}} == tally["in_doubt"]
    assert ({"store": 1}, {}) == (tally["lost_operations"], tally["stored_chunks"])
    assert ["r1"] == [entry[1] for entry in demo.late]
