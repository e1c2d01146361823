"""A prepared LMCache transfer awaiting its commit (:mod:`.transfers`): what it holds, and the key that names it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpcache.cache.lmcache import kvevents, wire
from mpcache.cache.lmcache.groups import GroupLayout
from mpcache.cache.sessions import Job

TransferKey = tuple[int, str, int | None, int, int, str, str, int]


@dataclass(slots=True)
class Pending:
    """A prepared store (space reserved, not readable) or retrieve (keys read-locked) awaiting its commit:
    its keys group by group, ``sizes`` the (count, bytes) of each group's run of them."""

    instance_id: int
    request_id: str
    model: str
    salt: str
    device: str  # the worker's rank: START and END pair per (request, device)
    engine: int  # the registration's engine slot, its events' engine_id
    keys: list[int] = field(default_factory=list)
    sizes: list[tuple[int, int]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # retrieve: the keys' places in the lookup's job
    job: Job | None = None
    chunks: int = 0  # chunk positions it covers (its tokens: chunks × chunk size)
    feed: kvevents.Detail | None = None  # store, where L1 has a feed: what its stored records say
    failed: int = 0  # store: objects that got no space
    deadline: float = 0.0
    peer: tuple[int, bytes] = (0, b"")  # store: the uid and connection its reserved bytes are charged to
    generation: int = 0  # L1's when its space was reserved or its keys locked: at another one its bytes are lost

    @property
    def nbytes(self) -> int:
        return sum(count * size for count, size in self.sizes)

    def add(self, keys: list[int], size: int) -> None:
        self.keys.extend(keys)
        self.sizes.append((len(keys), size))


def transfer_key(key: wire.Key, instance_id: int) -> TransferKey:
    return (instance_id, key.request_id, key.worker_id, key.start, key.end, key.model_name, key.cache_salt,
            key.world_size)


def slot(offset: int, layout: GroupLayout) -> dict[str, Any]:
    return {"offset": offset, "length": layout.object_bytes, "shape": list(layout.shape), "dtype": layout.dtype}
