"""What the tiers of this cache process hold of each registered model, for routers that size their model of a
node: per model, one chunk's bytes here (every registration's objects of it: its KV ranks and cache groups), and
per tier (L1, each L2 tier) the tier's bytes and the tokens of that model alone they would hold.  L2 tiers keep
objects of ``--chunk-bytes`` only, so they hold a model's tokens only when all its objects are that size; a tier
every cache process shares (redis) is reported by cache process 0 alone, so sums over processes stay true.
Published once a heartbeat (``KV_CAPACITY``) and carried in every KV event batch (``capacity``).
"""

from __future__ import annotations

from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache.registrations import Registrations
from mpcache.config import SHARED_L2_TYPES
from mpcache.contract.events import EventType

_KV_CAPACITY = EventType.KV_CAPACITY
L1 = "L1"


class Capacity:
    def __init__(self, ctx: CacheContext, registrations: Registrations) -> None:
        self._ctx = ctx
        self._registrations = registrations

    def of(self, model: str) -> dict[str, dict[str, int]]:
        """Tier → {"bytes", "tokens"} for ``model`` (empty when it has no registration here)."""
        sizes = [layout.object_bytes for registration in self._registrations.registered()
                 if registration.model_name == model for layout in registration.layouts]
        if not sizes:
            return {}
        ctx, tokens = self._ctx, self._registrations.chunk_tokens
        l1 = ctx.l1.capacity_bytes
        tiers = {L1: {"bytes": l1, "tokens": l1 // sum(sizes) * tokens}}
        storage = ctx.storage
        for name, adapter in zip(storage.names, storage.adapters):
            if ctx.worker != 0 and adapter.name in SHARED_L2_TYPES:
                continue
            fits = all(size == ctx.chunk_bytes for size in sizes)
            held = adapter.capacity_bytes // (len(sizes) * ctx.chunk_bytes) * tokens if fits else 0
            tiers[f"L2:{name}"] = {"bytes": adapter.capacity_bytes, "tokens": held}
        return tiers

    def publish(self) -> None:
        """One ``KV_CAPACITY`` per registered model and tier."""
        emit = self._ctx.publisher.emit
        for model in sorted({registration.model_name for registration in self._registrations.registered()}):
            for tier, held in self.of(model).items():
                emit(_KV_CAPACITY, (model, tier, held["bytes"], held["tokens"]))
