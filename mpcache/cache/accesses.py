"""Sampled chunk accesses, the cache process's whole share of the miss-ratio curves and miss reasons
(``docs/MRC.md``): a key is sampled when ``chunk_hash mod 1_000_003 < rate × 1_000_003`` (SHARDS' spatial
rule, the same in every process and after every restart).  Each finished lookup publishes one
``MRC_LOOKUP_SAMPLED`` and each store one ``MRC_STORE_SAMPLED``; the telemetry process does the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpcache.cache.l1 import L1Manager
from mpcache.contract.events import EventType
from mpcache.contract.keys import SAMPLE_MODULUS, ChunkKey
from mpcache.shm.publish import EventPublisher

_MRC_LOOKUP_SAMPLED = EventType.MRC_LOOKUP_SAMPLED
_MRC_STORE_SAMPLED = EventType.MRC_STORE_SAMPLED


class AccessSampler:
    """Publishes what lookups and stores did to the sampled keys (``rate`` in (0, 1])."""

    def __init__(self, publisher: EventPublisher, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {rate}")
        self._pub = publisher
        self._threshold = rate * SAMPLE_MODULUS

    def lookup(self, l1: L1Manager, model: str, salt: str, hashes: Sequence[int], ranks: int, l1_hits: int,
               found: int) -> None:
        """A finished lookup of ``hashes`` (``ranks`` objects per chunk): ``hashes[:l1_hits]`` were in L1,
        ``hashes[l1_hits:found]`` came from L2.  A sampled missing key past the first missing chunk that L1
        holds is "after the gap"; the telemetry process tells cold from evicted for the other misses."""
        threshold = self._threshold
        l1_rows: list[tuple[int, str, str]] = []
        l2_rows: list[tuple[int, str, str]] = []
        gap_rows: list[tuple[int, str, str]] = []
        miss_rows: list[tuple[int, str, str]] = []
        gap_chunk = found // ranks
        for position, chunk_hash in enumerate(hashes):
            if chunk_hash % SAMPLE_MODULUS < threshold:
                row = (chunk_hash, salt, model)
                if position < l1_hits:
                    l1_rows.append(row)
                elif position < found:
                    l2_rows.append(row)
                elif position // ranks > gap_chunk and l1.contains(ChunkKey(model, salt, chunk_hash)):
                    gap_rows.append(row)
                else:
                    miss_rows.append(row)
        self._pub.emit(_MRC_LOOKUP_SAMPLED,
                       (model, salt, ranks, len(hashes), found, len(l1_rows), len(l2_rows), len(gap_rows)),
                       sampled=l1_rows + l2_rows + gap_rows + miss_rows)

    def store(self, model: str, salt: str, hashes: Sequence[int], object_bytes: int) -> None:
        """A store of ``hashes`` (objects of ``object_bytes``): written now or already held, all touched."""
        threshold = self._threshold
        self._pub.emit(_MRC_STORE_SAMPLED, (model, salt, len(hashes), object_bytes),
                       sampled=[(h, salt, model) for h in hashes if h % SAMPLE_MODULUS < threshold])
