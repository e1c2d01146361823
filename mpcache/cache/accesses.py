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


MAX_EXACT_ROWS = 63  # the head rows' after-gap flags travel as one int64 bit mask


class AccessSampler:
    """Publishes what lookups and stores did to the sampled keys: a lookup's first ``exact_chunks`` chunks
    (its hot keys) always, every other key when its hash passes ``rate`` in [0, 1] (0: publishes nothing)."""

    def __init__(self, publisher: EventPublisher, rate: float, exact_chunks: int = 4) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sample rate must be in [0, 1], got {rate}")
        self._pub = publisher
        self._threshold = rate * SAMPLE_MODULUS
        self._exact_chunks = exact_chunks
        self.enabled = rate > 0

    def lookup(self, l1: L1Manager, model: str, salt: str, hashes: Sequence[int], ranks: int, l1_hits: int,
               found: int) -> None:
        """A finished lookup of ``hashes`` (``ranks`` objects per chunk): ``hashes[:l1_hits]`` were in L1,
        ``hashes[l1_hits:found]`` came from L2.  A missing key past the first missing chunk that L1 holds is
        "after the gap"; the telemetry process tells cold from evicted for the other misses."""
        if not self.enabled:
            return
        exact = min(self._exact_chunks * ranks, len(hashes), MAX_EXACT_ROWS)
        gap_chunk = found // ranks
        gap_mask = 0
        for position in range(max(found, 0), exact):
            if position // ranks > gap_chunk and l1.contains(ChunkKey(model, salt, hashes[position])):
                gap_mask |= 1 << position
        threshold = self._threshold
        head_rows = [(chunk_hash, salt, model) for chunk_hash in hashes[:exact]]
        l1_rows: list[tuple[int, str, str]] = []
        l2_rows: list[tuple[int, str, str]] = []
        gap_rows: list[tuple[int, str, str]] = []
        miss_rows: list[tuple[int, str, str]] = []
        for position in range(exact, len(hashes)):
            chunk_hash = hashes[position]
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
                       (model, salt, ranks, len(hashes), found, l1_hits, exact, gap_mask, len(l1_rows), len(l2_rows),
                        len(gap_rows)),
                       sampled=head_rows + l1_rows + l2_rows + gap_rows + miss_rows)

    def store(self, model: str, salt: str, hashes: Sequence[int], object_bytes: int) -> None:
        """A store of ``hashes`` (objects of ``object_bytes``): written now or already held, all touched."""
        if not self.enabled:
            return
        threshold = self._threshold
        self._pub.emit(_MRC_STORE_SAMPLED, (model, salt, len(hashes), object_bytes),
                       sampled=[(h, salt, model) for h in hashes if h % SAMPLE_MODULUS < threshold])
