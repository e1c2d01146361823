"""Cache blending: position-independent chunk fingerprints (a chunk's own tokens, blake2b-64) and the
statuses of a ``cb_lookup``; shared by the client and the cache process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_PERSON = b"mpcache.cb.fp"

# Per chunk of a cb_lookup, in the reply's ``chunks`` list:
MISS = 0  # neither a prefix hit nor a fingerprint in the table
PREFIX_HIT = 1  # the prefix-chained key is in L1 (same tokens at the same position after the same prefix)
FINGERPRINT_HIT = 2  # the fingerprint is in the table and its object was confirmed present (a storage hit)
STALE = 3  # the fingerprint was in the table but its object is gone: the entry was removed
STATUS_NAMES = {MISS: "miss", PREFIX_HIT: "prefix", FINGERPRINT_HIT: "fingerprint", STALE: "stale"}
HITS = (PREFIX_HIT, FINGERPRINT_HIT)


def fingerprint(chunk_tokens: Sequence[int] | np.ndarray) -> int:
    """Stable, position-independent 64-bit fingerprint of one chunk's token ids."""
    data = np.ascontiguousarray(chunk_tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def chunk_fingerprints(tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[int]:
    """Fingerprints of the whole chunks of ``tokens`` (a trailing partial chunk has none)."""
    array = np.ascontiguousarray(tokens, dtype=np.int64)
    return [fingerprint(array[start : start + chunk_size])
            for start in range(0, len(array) - chunk_size + 1, chunk_size)]
