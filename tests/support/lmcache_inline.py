"""The objects an LMCache 0.5.7 worker that cannot map the pool sends inline: the chunk size and object layout
of ``support.lmcache_client.registration(hidden=64)``, and reproducible object bytes."""

from __future__ import annotations

import numpy as np

from mpcache.cache.lmcache.groups import layout

CHUNK = 256
OBJECT = layout([2, 2, CHUNK, 64], "float16")  # registration(hidden=64)'s object


def objects(count: int, seed: int, size: int = OBJECT.object_bytes) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
