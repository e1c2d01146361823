"""The engine_driven registrations of one cache process, and the chunk size its LMCache clients agreed on.

A registration (instance id) belongs to the peer uid that made it: only that uid transfers through it.
Each is logged once when it comes and once when it goes (instance, model, world size, object layout,
transfer mode, client version), at info, as LMCache's server logs its workers.  One that is silent (no ping,
no transfer) for ``REAP_AFTER_S`` is dropped, as LMCache 0.5.7's server reaps its workers: an engine killed
without unregistering holds nothing for good.  Each registration's events name its engine by a slot (the
lowest free one, freed when it goes), not by its instance id, which is random at every engine start: an engine
restarted in place continues its series instead of leaving new ones behind.

The chunk size follows LMCache 0.5.7's negotiation: ``--chunk-size`` is the smallest chunk; the first
``negotiate_chunk_size(alignment)`` rounds it up to a multiple of the alignment and binds it, as does the
first ``get_chunk_size`` (older clients) without rounding; once bound, a compatible alignment gets the bound
size and an incompatible one is refused, as is a change after requests have started.
"""

from __future__ import annotations

import heapq

from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import wire
from mpcache.errors import RequestError

MAX_INSTANCES = 1024
REAP_AFTER_S = 120.0  # LMCache 0.5.7's worker_reap_timeout_seconds: more than 3 missed 10 s heartbeats
TRANSFER_MODE = "engine_driven (shared-memory pool)"


class Registrations:
    """Instance id → registration and owner uid, and the bound chunk size (:attr:`chunk_tokens`)."""

    def __init__(self, ctx: CacheContext) -> None:
        self._ctx = ctx
        self._configured_chunk = ctx.chunk_tokens
        self.chunk_tokens = ctx.chunk_tokens
        self._chunk_bound = False
        self._by_id: dict[int, wire.Registration] = {}
        self._owners: dict[int, int] = {}  # instance id → the peer uid that registered it
        self._told_unknown: set[int] = set()
        self._seen: dict[int, float] = {}  # instance id → when it last pinged, registered or transferred
        self._slots: dict[int, int] = {}  # instance id → the engine label its events carry
        self._free_slots: list[int] = []  # a heap: the lowest free slot is taken first
        self._warned_too_large: set[tuple[str, int]] = set()  # (model, object bytes) warned about

    # -- the chunk size -------------------------------------------------------------------

    def bind_chunk_size(self) -> int:
        """``get_chunk_size``: the chunk size, bound from now on."""
        self._chunk_bound = True
        return self.chunk_tokens

    def negotiate_chunk_size(self, alignment: int, busy: bool) -> int:
        """The chunk size for a client that needs a multiple of ``alignment`` tokens (bound from now on);
        RequestError when it cannot be one (``busy``: requests have started, so it cannot change)."""
        chunk = self.chunk_tokens
        if self._chunk_bound:
            if chunk % alignment:
                raise RequestError(f"chunk size {chunk} is not a multiple of the required alignment {alignment}: "
                                   "another client has bound it; models that need incompatible alignments need "
                                   "separate cache services")
            return chunk
        resolved = -(-self._configured_chunk // alignment) * alignment
        limit = self._ctx.config.lmcache_max_tokens
        if resolved > limit:
            raise RequestError(f"a chunk of {resolved} tokens (--chunk-size {self._configured_chunk} rounded up to a "
                               f"multiple of {alignment}) exceeds --lmcache-max-tokens {limit}")
        if resolved != chunk and busy:
            raise RequestError(f"the chunk size cannot change from {chunk} to {resolved} after requests have started")
        self.chunk_tokens = resolved
        self._chunk_bound = True
        if resolved != self._configured_chunk:
            self._ctx.log.info("lmcache.chunk_size_negotiated", chunk_tokens=resolved,
                               configured=self._configured_chunk, alignment=alignment)
        return resolved

    # -- registrations --------------------------------------------------------------------

    def register(self, payload: object, owner: int) -> wire.Registration:
        """Validate and keep a registration; an instance id another uid registered is refused.  An object
        larger than the whole L1 gets one warning naming the sizes and the flag."""
        registration = wire.parse_registration(payload, self.chunk_tokens)
        instance = registration.instance_id
        if self._owners.get(instance, owner) != owner:
            raise RequestError(f"instance_id {instance} is registered by another user")
        if instance not in self._by_id and len(self._by_id) >= MAX_INSTANCES:
            raise RequestError(f"at most {MAX_INSTANCES} registered instances per cache process")
        self._chunk_bound = True
        self._warn_if_too_large(registration)
        self._by_id[instance] = registration
        self._owners[instance] = owner
        self._told_unknown.discard(instance)
        self._seen[instance] = self._ctx.clock()
        if instance not in self._slots:
            self._slots[instance] = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
        self._ctx.log.info("lmcache.engine_registered", instance_id=instance, model=registration.model_name,
                           world_size=registration.world_size, shape=registration.shape, dtype=registration.dtype,
                           object_bytes=registration.object_bytes, transfer_mode=TRANSFER_MODE,
                           client_version=registration.client, uid=owner, chunk_tokens=self.chunk_tokens,
                           engine_slot=self._slots[instance])
        return registration

    def forget(self, instance_id: int, owner: int, reason: str) -> bool:
        """Drop ``owner``'s registration of ``instance_id``; whether there was one."""
        if self._owners.get(instance_id) != owner:
            return False
        del self._owners[instance_id]
        del self._seen[instance_id]
        heapq.heappush(self._free_slots, self._slots.pop(instance_id))
        registration = self._by_id.pop(instance_id)
        self._ctx.log.info("lmcache.engine_unregistered", instance_id=instance_id, model=registration.model_name,
                           world_size=registration.world_size, uid=owner, reason=reason)
        return True

    def owned(self, instance_id: int, owner: int) -> bool:
        return self._owners.get(instance_id) == owner

    def of(self, instance_id: int, owner: int) -> wire.Registration:
        """``owner``'s registration of ``instance_id``; RequestError if it has none."""
        registration = self._by_id.get(instance_id)
        if registration is None or self._owners[instance_id] != owner:
            raise RequestError(f"instance {instance_id} has no engine_driven context registered with this server")
        self._seen[instance_id] = self._ctx.clock()
        return registration

    def slot(self, instance_id: int) -> int:
        """The engine label of a registered instance's events."""
        return self._slots[instance_id]

    def reap(self) -> list[int]:
        """Drop the registrations silent for ``REAP_AFTER_S``; their instance ids."""
        silent_since = self._ctx.clock() - REAP_AFTER_S
        silent = [instance for instance, seen in self._seen.items() if seen < silent_since]
        for instance in silent:
            self.forget(instance, self._owners[instance], f"silent for {REAP_AFTER_S:g} s (no ping, no transfer)")
        return silent

    def ping(self, instance_id: int | None, owner: int) -> bool:
        """True, except once for a worker this process does not know (it was restarted since the worker
        registered): the worker then sees its server recover and registers again."""
        if instance_id is not None and self._owners.get(instance_id) == owner:
            self._seen[instance_id] = self._ctx.clock()
            return True
        if instance_id is None or instance_id in self._told_unknown:
            return True
        if len(self._told_unknown) >= MAX_INSTANCES:
            self._told_unknown.clear()
        self._told_unknown.add(instance_id)
        return False

    def _warn_if_too_large(self, registration: wire.Registration) -> None:
        l1_bytes, size, warned = self._ctx.l1.max_object_bytes, registration.object_bytes, self._warned_too_large
        if size <= l1_bytes or (registration.model_name, size) in warned:
            return
        if len(warned) >= MAX_INSTANCES:
            warned.clear()
        warned.add((registration.model_name, size))
        self._ctx.log.warning(
            "lmcache.object_larger_than_l1", model=registration.model_name, object_bytes=size,
            shape=registration.shape, dtype=registration.dtype, l1_bytes=l1_bytes,
            fix=f"every store of this model fails: one KV chunk object is {size} bytes but L1 holds {l1_bytes} "
                f"bytes; start the cache with --l1-size {-(-size // 2**20)}MiB or more")
