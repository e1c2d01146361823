"""The engine_driven registrations of one cache process, and the chunk size its LMCache clients agreed on.

A registration (instance id) belongs to the peer uid that made it: only that uid transfers through it.
It describes one object per KV cache group (:mod:`.groups`: one for most models, several for a hybrid
model's ``group_layouts``) and how its bytes move: through the shared-memory pool where the peer can map
it (the service's own uid, or root), else inline in the requests (LMCache 0.5.7's typed envelopes,
:mod:`.inline`), which is what ``shm_name ""`` in the reply tells the worker.  Each is logged once when it
comes and once when it goes (instance, model, world size, object layout, transfer mode, client version),
at info, as LMCache's server logs its workers.  One that is silent (no ping, no transfer) for ``REAP_AFTER_S``
is dropped, as LMCache 0.5.7's server reaps its workers: an engine killed without unregistering holds nothing
for good.  Each registration's events name its engine by a slot (the lowest free one, freed when it goes),
not by its instance id, which is random at every engine start: an engine restarted in place continues its
series instead of leaving new ones behind.

The chunk size follows LMCache 0.5.7's negotiation: ``--chunk-size`` is the smallest chunk; the first
``negotiate_chunk_size(alignment)`` rounds it up to a multiple of the alignment and binds it, as does the
first ``get_chunk_size`` (older clients) without rounding; once bound, a compatible alignment gets the bound
size and an incompatible one is refused, as is a change after requests have started.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, replace
from typing import Any

from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import groups, wire
from mpcache.cache.lmcache.groups import GroupLayout
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError

MAX_INSTANCES = 1024
REAP_AFTER_S = 120.0  # LMCache 0.5.7's worker_reap_timeout_seconds: more than 3 missed 10 s heartbeats
SHARED_MEMORY = "engine_driven (shared-memory pool)"
INLINE = "engine_driven (inline)"
CLIENT_056 = "0.5.3-0.5.6"
CLIENT_057 = "0.5.7"
_SLOTS = protocol.int_range(1, 1 << 24)


@dataclass(frozen=True, slots=True)
class Registration:
    """A worker's engine_driven registration: one object layout per KV cache group (``grouped``: it sent
    ``group_layouts``, so its transfers name groups), the client version its payload shows (``CLIENT_057``
    sends ``group_layouts``, empty or not), and whether its bytes move ``inline`` (its peer cannot map the pool)."""

    instance_id: int
    model_name: str
    world_size: int
    layouts: tuple[GroupLayout, ...]
    grouped: bool
    client: str
    inline: bool = False

    @property
    def transfer_mode(self) -> str:
        return INLINE if self.inline else SHARED_MEMORY


def parse_registration(value: Any, chunk_tokens: int, inline: bool) -> Registration:
    """A RegisterEngineDrivenContextPayload as LMCache's server reads it: one object ``[2,] layers, slots,
    hidden`` without ``group_layouts``, one per group with (:func:`.groups.parse_group_layouts`), whose chunk
    must be this server's (``num_physical_slots``)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"payload: expected a map, got {type(value).__name__}")
    for required in ("instance_id", "model_name", "world_size", "num_layers", "hidden_dim_size", "dtype_str",
                     "use_mla"):
        if required not in value:
            raise ProtocolError(f"{required}: missing")
    instance = wire.instance_id(value["instance_id"])
    model = protocol.MODEL(value["model_name"], "model_name")
    world_size = protocol.int_range(1, wire.MAX_WORLD_SIZE)(value["world_size"], "world_size")
    layers = protocol.int_range(1, 1 << 16)(value["num_layers"], "num_layers")
    hidden = protocol.int_range(1, 1 << 24)(value["hidden_dim_size"], "hidden_dim_size")
    dtype = groups.check_dtype(value["dtype_str"], "dtype_str")
    use_mla = value["use_mla"]
    if type(use_mla) is not bool:
        raise ProtocolError("use_mla: expected a boolean")
    slots = value.get("num_physical_slots")
    slots = chunk_tokens if slots is None else _SLOTS(slots, "num_physical_slots")
    block_size = value.get("block_size")
    if block_size is not None:
        protocol.int_range(1, 1 << 20)(block_size, "block_size")
    listed = value.get("group_layouts")
    client = CLIENT_056 if listed is None else CLIENT_057
    if listed is None or listed == []:
        shape = [layers, slots, hidden] if use_mla else [2, layers, slots, hidden]
        return Registration(instance, model, world_size, (groups.layout(shape, dtype),), False, client, inline)
    layouts = groups.parse_group_layouts(listed, use_mla, chunk_tokens)
    if slots != chunk_tokens:
        raise RequestError(f"num_physical_slots: a chunk of {slots} tokens, but this server's chunk is "
                           f"{chunk_tokens} tokens (negotiate_chunk_size binds it before a registration)")
    return Registration(instance, model, world_size, layouts, True, client, inline)


def can_map_pool(owner: int) -> bool:
    """Whether a peer of uid ``owner`` can map the 0600 L1 pool: the service's own uid, or root."""
    return owner in (os.geteuid(), 0)


class Registrations:
    """Instance id → registration and owner uid, and the bound chunk size (:attr:`chunk_tokens`)."""

    def __init__(self, ctx: CacheContext) -> None:
        self._ctx = ctx
        self._configured_chunk = ctx.chunk_tokens
        self.chunk_tokens = ctx.chunk_tokens
        self._chunk_bound = False
        self._by_id: dict[int, Registration] = {}
        self._owners: dict[int, int] = {}  # instance id → the peer uid that registered it
        self._told_unknown: set[int] = set()
        self._seen: dict[int, float] = {}  # instance id → when it last pinged, registered or transferred
        self._slots: dict[int, int] = {}  # instance id → the engine label its events carry
        self._free_slots: list[int] = []  # a heap: the lowest free slot is taken first
        self._grouped: dict[tuple[str, int], tuple[GroupLayout, ...]] = {}  # (model, world size) → its groups
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

    def register(self, payload: object, owner: int) -> Registration:
        """Validate and keep a registration (inline unless ``owner`` can map the pool); an instance id another
        uid registered is refused.  An object larger than the whole L1 gets one warning naming the sizes and
        the flag."""
        registration = parse_registration(payload, self.chunk_tokens, inline=not can_map_pool(owner))
        instance = registration.instance_id
        if self._owners.get(instance, owner) != owner:
            raise RequestError(f"instance_id {instance} is registered by another user")
        if instance not in self._by_id and len(self._by_id) >= MAX_INSTANCES:
            raise RequestError(f"at most {MAX_INSTANCES} registered instances per cache process")
        self._chunk_bound = True
        self._warn_if_too_large(registration)
        replaced = self._by_id.get(instance)
        self._by_id[instance] = registration
        self._owners[instance] = owner
        self._index_groups(registration.model_name, registration.world_size)
        if replaced is not None and (replaced.model_name, replaced.world_size) != (registration.model_name,
                                                                                   registration.world_size):
            self._index_groups(replaced.model_name, replaced.world_size)  # its groups, unless another holds them
        self._told_unknown.discard(instance)
        self._seen[instance] = self._ctx.clock()
        if instance not in self._slots:
            self._slots[instance] = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
        layouts = registration.layouts
        self._ctx.log.info("lmcache.engine_registered", instance_id=instance, model=registration.model_name,
                           world_size=registration.world_size, shape=[list(g.shape) for g in layouts],
                           dtype=[g.dtype for g in layouts], object_bytes=[g.object_bytes for g in layouts],
                           window_chunks=[g.window for g in layouts], recurrent=[g.recurrent for g in layouts],
                           transfer_mode=registration.transfer_mode, client_version=registration.client,
                           uid=owner, chunk_tokens=self.chunk_tokens, engine_slot=self._slots[instance])
        return registration

    def forget(self, instance_id: int, owner: int, reason: str) -> bool:
        """Drop ``owner``'s registration of ``instance_id``; whether there was one."""
        if self._owners.get(instance_id) != owner:
            return False
        del self._owners[instance_id]
        del self._seen[instance_id]
        heapq.heappush(self._free_slots, self._slots.pop(instance_id))
        registration = self._by_id.pop(instance_id)
        self._index_groups(registration.model_name, registration.world_size)
        self._ctx.log.info("lmcache.engine_unregistered", instance_id=instance_id, model=registration.model_name,
                           world_size=registration.world_size, uid=owner, reason=reason)
        return True

    def registered(self) -> list[Registration]:
        return list(self._by_id.values())

    def groups_of(self, model: str, world_size: int) -> tuple[GroupLayout, ...] | None:
        """The KV cache groups of a model's latest grouped registration at this world size (a lookup names no
        instance); None when none is registered: one group."""
        return self._grouped.get((model, world_size))

    def _index_groups(self, model: str, world_size: int) -> None:
        layouts = [r.layouts for r in self._by_id.values()
                   if r.grouped and (r.model_name, r.world_size) == (model, world_size)]
        if layouts:
            self._grouped[(model, world_size)] = layouts[-1]
        else:
            self._grouped.pop((model, world_size), None)

    def went_inline(self, registration: Registration) -> Registration:
        """A worker given the pool sent its objects inline (LMCache 0.5.7's worker does when it cannot open the
        pool, e.g. in a container without the shared ``/dev/shm``): it is served inline from now on."""
        inline = self._by_id[registration.instance_id] = replace(registration, inline=True)
        self._ctx.log.info("lmcache.transfer_mode_changed", instance_id=registration.instance_id,
                           model=registration.model_name, transfer_mode=inline.transfer_mode,
                           reason="the worker sent its objects inline: it cannot map the pool")
        return inline

    def owned(self, instance_id: int, owner: int) -> bool:
        return self._owners.get(instance_id) == owner

    def of(self, instance_id: int, owner: int) -> Registration:
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

    def _warn_if_too_large(self, registration: Registration) -> None:
        l1_bytes, warned = self._ctx.l1.max_object_bytes, self._warned_too_large
        size = max(group.object_bytes for group in registration.layouts)
        if size <= l1_bytes or (registration.model_name, size) in warned:
            return
        if len(warned) >= MAX_INSTANCES:
            warned.clear()
        warned.add((registration.model_name, size))
        self._ctx.log.warning(
            "lmcache.object_larger_than_l1", model=registration.model_name, object_bytes=size,
            shape=[list(g.shape) for g in registration.layouts], dtype=[g.dtype for g in registration.layouts],
            l1_bytes=l1_bytes,
            fix=f"every store of this model fails: one KV chunk object is {size} bytes but L1 holds {l1_bytes} "
                f"bytes; start the cache with --l1-size {-(-size // 2**20)}MiB or more")
