"""LMCache's engine_driven stores and retrieves over one cache process's L1: a worker's KV objects (one per
chunk, KV rank and KV cache group) move through the shared-memory pool or inline in the requests.

Through the pool, stores are two-phase: prepare_store reserves L1 space and names it (byte offsets, each
object its group's size; none for the chunks a group skips), commit_store makes it readable; prepare_retrieve
read-locks the objects and names them, commit_retrieve gives the locks back.  Inline (:mod:`.inline`, for a peer
that cannot map the pool), commit_store carries the objects and prepare_retrieve returns them, each in one
request; an inline registration gets no slot, so it cannot make readable what it did not write.  A retrieve
returns each group's in-window suffix of the request's chunks, all of them or nothing.  Uncommitted stores are
charged to their peer, the connection (of one uid) they came on: at most a quarter of L1's bytes (or one
object), whatever instance ids it registers; a transfer left uncommitted gives its space or locks back after
``pending_ttl_s``.  Each publishes its mpcache-protocol twin's events, timed from prepare to commit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from mpcache.cache.context import CacheContext
from mpcache.cache.l1 import POOL_LOST
from mpcache.cache.lmcache import inline, kvevents, wire
from mpcache.cache.lmcache.groups import parse_skipped, window_start
from mpcache.cache.lmcache.pending import Pending, TransferKey, slot, transfer_key
from mpcache.cache.lmcache.registrations import CLIENT_057, Registration, Registrations
from mpcache.cache.mrc.accesses import group_label
from mpcache.cache.requests import reserve_store, store_to_l2
from mpcache.cache.sessions import Job
from mpcache.contract.events import EventType
from mpcache.errors import ProtocolError, RequestError

_MP_STORE_SUBMITTED = EventType.MP_STORE_SUBMITTED
_MP_STORE_START = EventType.MP_STORE_START
_MP_STORE_END = EventType.MP_STORE_END
_MP_RETRIEVE_SUBMITTED = EventType.MP_RETRIEVE_SUBMITTED
_MP_RETRIEVE_START = EventType.MP_RETRIEVE_START
_MP_RETRIEVE_END = EventType.MP_RETRIEVE_END
_SM_WRITE_FINISHED, _SM_READ_PREFETCHED_FINISHED = EventType.SM_WRITE_FINISHED, EventType.SM_READ_PREFETCHED_FINISHED

MAX_PENDING = 4096  # prepared, uncommitted stores plus retrieves
CONNECTION_SHARE = 4  # a connection holds at most 1/CONNECTION_SHARE of L1's bytes in prepared, uncommitted stores
RETRIEVE_MISS = {"success": False, "data": b"", "context": {}}

KeysOf = Callable[[wire.Key, int, int, tuple[int, ...], int], list[int]]  # key, first, last, ranks, groups
PrefixOf = Callable[[wire.Key, int], int]  # key, last: the hash of its first ``last`` chunks' tokens
# the lookup holding a request's locks, and the places in it of (first chunk, last chunk, (group, rank) offset)
HeldBy = Callable[[wire.Key, int, list[tuple[int, int, int]]], tuple[Job | None, list[int]]]


class Transfers:
    """The prepared stores and retrieves of one cache process's registrations (single-threaded, like its loop)."""

    def __init__(self, ctx: CacheContext, registrations: Registrations, keys_of: KeysOf, prefix_of: PrefixOf,
                 held_by: HeldBy, pending_ttl_s: float) -> None:
        self._ctx = ctx
        self._registrations = registrations
        self._keys_of = keys_of
        self._prefix_of = prefix_of
        self._held_by = held_by
        self._pending_ttl_s = pending_ttl_s
        self._held: dict[tuple[int, bytes], int] = {}  # (uid, connection) → uncommitted bytes it reserves
        self._max_held = ctx.l1.capacity_bytes // CONNECTION_SHARE
        self._max_inline = inline.frame_bytes(ctx.l1.capacity_bytes)
        self._stores: OrderedDict[TransferKey, Pending] = OrderedDict()
        self._retrieves: OrderedDict[TransferKey, Pending] = OrderedDict()
        self._emit = {etype: ctx.publisher.fields_emitter(etype) for etype in (  # bound once: a dozen a request
            _MP_STORE_SUBMITTED, _MP_STORE_START, _MP_STORE_END, _MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START,
            _MP_RETRIEVE_END)}

    @property
    def busy(self) -> bool:
        return bool(self._stores or self._retrieves)

    def _registration(self, instance_id: int, key: wire.Key, owner: int) -> Registration:
        registration = self._registrations.of(instance_id, owner)
        if key.worker_id is None:
            raise ProtocolError("key.worker_id: a worker's transfer names its rank")
        return registration

    def _make_room(self, table: OrderedDict[TransferKey, Pending], tkey: TransferKey) -> None:
        """Give back the transfer this one replaces; RequestError when too many wait for their commit."""
        if tkey in table:
            self._abandon(table, tkey)
        if len(self._stores) + len(self._retrieves) >= MAX_PENDING:
            raise RequestError(f"more than {MAX_PENDING} prepared transfers are waiting for their commit")

    def _start(self, key: wire.Key, instance_id: int, submitted: EventType, start: EventType) -> Pending:
        """A transfer under way: its session, SUBMITTED and START."""
        self._ctx.sessions.open(key.request_id)
        device = f"cpu:{key.worker_id or 0}"  # a worker's transfers are on its own device
        engine = self._registrations.slot(instance_id)
        self._emit[submitted]((device,), key.request_id)
        self._emit[start]((device, engine, key.model_name), key.request_id)
        return Pending(instance_id, key.request_id, key.model_name, key.cache_salt, device, engine,
                        deadline=self._ctx.clock() + self._pending_ttl_s, generation=self._ctx.l1.generation())

    def _lost(self, pending: Pending) -> bool:
        """Whether L1's pool was lost since ``pending`` reserved or locked its objects (they are counted then)."""
        return self._ctx.l1.lost_since(pending.generation, len(pending.keys))

    def _refuse_store(self, pending: Pending) -> bool:
        """A store whose bytes were lost: its space given back, its END saying nothing moved; False (refused)."""
        self._ctx.l1.abort_write(pending.model, pending.salt, pending.keys)
        self._emit[_MP_STORE_END]((pending.device, pending.engine, pending.model, 0, 0, 0), pending.request_id)
        self._ctx.log.warning("lmcache.store_refused", request_id=pending.request_id, objects=len(pending.keys),
                              reason=POOL_LOST)
        return False

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(self, key: wire.Key, instance_id: int, owner: int, skipped: Any, connection: bytes = b"") -> dict:
        """Reserve L1 space for the key's objects not cached yet, less the chunks each group skips, and describe
        it (within its connection's share of L1: the objects beyond get none).  An inline registration gets no
        space (its objects come with commit_store); one whose object never fits gets no context."""
        registration = self._registration(instance_id, key, owner)
        first, last = wire.chunk_range(key, self._registrations.chunk_tokens)
        skips = parse_skipped(skipped, len(registration.layouts) if registration.grouped else 0, last - first)
        if registration.inline:
            return {"context": {}}
        layouts, ctx = registration.layouts, self._ctx
        self._make_room(self._stores, transfer_key(key, instance_id))
        keys = self._keys_of(key, first, last, (key.worker_id or 0,), len(layouts))
        pending = self._start(key, instance_id, _MP_STORE_SUBMITTED, _MP_STORE_START)
        peer = (owner, connection)
        pending.peer = peer
        held = self._held.get(peer, 0)
        slots: list[dict[str, Any]] = []
        indices: list[int] = []
        group_ids: list[int] = []
        never_fits = False
        store = self._store_name(owner, key, first, last, len(layouts))
        for group, layout in enumerate(layouts):
            wanted = [chunk for chunk in range(last - first) if chunk not in skips[group]]
            size = layout.object_bytes
            limit = max(0, self._max_held - held) // size if held else max(1, self._max_held // size)
            reservation = reserve_store(ctx, key.model_name, key.cache_salt,
                                        [keys[chunk * len(layouts) + group] for chunk in wanted], limit=limit,
                                        nbytes=size, label=group_label(key.model_name, group), store=store)
            pending.add([keys[wanted[p] * len(layouts) + group] for p in reservation.positions], size)
            pending.failed += reservation.failed
            never_fits |= size > ctx.l1.max_object_bytes and bool(reservation.failed)
            held += len(reservation.positions) * size
            slots.extend(slot(offset, layout) for offset in reservation.offsets)
            indices.extend(wanted[p] for p in reservation.positions)
            group_ids.extend([group] * len(reservation.positions))
        pending.chunks = len(set(indices))
        if ctx.l1.feed is not None and pending.keys:
            pending.feed = kvevents.feed_of(key, self._registrations.chunk_tokens, first, keys, indices, group_ids,
                                            len(layouts), self._keys_of)
        context: dict[str, Any] = {"slots": slots, "chunk_indices": indices}
        if registration.grouped:
            context["group_ids"] = group_ids
        if not pending.keys:  # nothing to copy: the worker will not commit
            self._finish_store(pending, [])
            return {"context": {}} if never_fits else {"context": context}
        self._stores[transfer_key(key, instance_id)] = pending
        self._held[peer] = held
        return {"context": context}

    def commit_store(self, key: wire.Key, instance_id: int, data: Any, owner: int) -> bool:
        """Make the prepared objects readable: only the uid, registration and key that prepared them can.  A
        non-empty ``data`` is a 0.5.7 worker's inline objects (stored now), or a 0.5.6 worker's pickled
        tensors (refused, never read)."""
        if type(data) is not bytes:
            raise ProtocolError("data: expected bytes")
        if not self._registrations.owned(instance_id, owner):
            return False
        tkey = transfer_key(key, instance_id)
        if data:
            if tkey in self._stores:
                self._abandon(self._stores, tkey)
            return self._store_inline(key, self._registration(instance_id, key, owner), data, owner)
        pending = self._stores.pop(tkey, None)
        if pending is None:
            return False
        self._release_held(pending)
        if self._lost(pending):  # reserved before the pool was lost: what the worker wrote is gone
            return self._refuse_store(pending)
        self._commit(pending)
        return True

    def _store_inline(self, key: wire.Key, registration: Registration, data: bytes, owner: int) -> bool:
        """Store the objects of an inline envelope, each group's at its chunk positions: every object checked
        against its group's layout before any is written; objects L1 holds already are kept as they are."""
        if registration.client != CLIENT_057:
            raise RequestError("commit_store with inline data (pickled tensors) is refused: the worker must map the "
                               "shared-memory pool (same user, same /dev/shm), or use LMCache 0.5.7's inline transfer")
        if not registration.inline:
            registration = self._registrations.went_inline(registration)
        layouts, ctx = registration.layouts, self._ctx
        first, last = wire.chunk_range(key, self._registrations.chunk_tokens)
        if registration.grouped:
            groups = inline.decode_grouped(data, [(layout, last - first) for layout in layouts])
        else:
            groups = [(list(range(last - first)), inline.decode(data, layouts[0], last - first))]
        keys = self._keys_of(key, first, last, (key.worker_id or 0,), len(layouts))
        self._make_room(self._stores, transfer_key(key, registration.instance_id))
        pending = self._start(key, registration.instance_id, _MP_STORE_SUBMITTED, _MP_STORE_START)
        pool = ctx.l1.pool
        stored: set[int] = set()
        chunks: list[int] = []
        group_ids: list[int] = []
        store = self._store_name(owner, key, first, last, len(layouts))
        for group, (layout, (positions, objects)) in enumerate(zip(layouts, groups)):
            size = layout.object_bytes
            reservation = reserve_store(ctx, key.model_name, key.cache_salt,
                                        [keys[chunk * len(layouts) + group] for chunk in positions], nbytes=size,
                                        label=group_label(key.model_name, group), store=store)
            for index, offset in zip(reservation.positions, reservation.offsets):
                pool[offset : offset + size] = np.frombuffer(objects[index], dtype=np.uint8)
            pending.add([keys[positions[p] * len(layouts) + group] for p in reservation.positions], size)
            pending.failed += reservation.failed
            stored.update(positions[p] for p in reservation.positions)
            chunks.extend(positions[p] for p in reservation.positions)
            group_ids.extend([group] * len(reservation.positions))
        pending.chunks = len(stored)
        if self._lost(pending):  # a fault under the copy
            return self._refuse_store(pending)
        if ctx.l1.feed is not None and pending.keys:
            pending.feed = kvevents.feed_of(key, self._registrations.chunk_tokens, first, keys, chunks, group_ids,
                                            len(layouts), self._keys_of)
        self._commit(pending)
        return True

    def _store_name(self, owner: int, key: wire.Key, first: int, last: int, groups: int) -> tuple | None:
        """What names one store across its TP ranks' and KV cache groups' reservations, so that L1's order admits
        or refuses them alike: the client's uid, the request's model, salt, id, TP size and chunk range, and the
        hash of its tokens up to the range's end (not the rank: another engine's or a later request of the same id
        and range names its own, unless it stores the same tokens at the same TP size).  None for a store of one
        part (TP 1, one group of ``groups``): it has no other part to share a verdict with, and a name costs the
        order a verdict kept per store."""
        if key.world_size == 1 and groups == 1:
            return None
        return (owner, key.model_name, key.cache_salt, key.request_id, key.world_size, first, last,
                self._prefix_of(key, last))

    def _commit(self, pending: Pending) -> None:
        sampled: list[tuple[int, str, str]] = []
        feed = kvevents.details(pending.feed, pending.sizes) if pending.feed is not None else None
        at = 0
        for run, (count, size) in enumerate(pending.sizes):
            sampled += self._ctx.l1.commit_write(pending.model, pending.salt, pending.keys[at : at + count], size,
                                                 feed[run] if feed is not None else None)
            at += count
        self._finish_store(pending, sampled)

    def _finish_store(self, pending: Pending, sampled: list) -> None:
        ctx = self._ctx
        stored, model, salt = len(pending.keys), pending.model, pending.salt
        self._emit[_MP_STORE_END]((pending.device, pending.engine, model, stored, pending.nbytes,
                                   pending.chunks * self._registrations.chunk_tokens), pending.request_id)
        ctx.publisher.emit(_SM_WRITE_FINISHED, (pending.failed,),
                           salt_counts={(salt, model): stored} if stored else None, sampled=sampled)
        at = 0
        for count, size in pending.sizes:
            if count and size == ctx.chunk_bytes and ctx.storage.adapters:
                keys = pending.keys[at : at + count]
                offsets = [offset for offset, _ in ctx.l1.read(model, salt, keys)]
                store_to_l2(ctx, model, salt, keys[: len(offsets)], offsets)
            at += count

    # -- retrieves ---------------------------------------------------------------------------

    def prepare_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> dict:
        """Lock each group's in-window suffix of the key's chunks for this rank while the worker copies them out
        (all of them or a failure), and name them; inline, return them (and give the locks back now)."""
        registration = self._registration(instance_id, key, owner)
        layouts, ctx, l1 = registration.layouts, self._ctx, self._ctx.l1
        self._make_room(self._retrieves, transfer_key(key, instance_id))
        first, last = wire.chunk_range(key, self._registrations.chunk_tokens)
        rank, groups = key.worker_id or 0, len(layouts)
        keys = self._keys_of(key, first, last, (rank,), groups)
        starts = [first + window_start(last - first, layout.window) for layout in layouts]
        job, positions = self._held_by(key, groups, [(start, last, group * key.world_size + rank)
                                                     for group, start in enumerate(starts)])
        spans = [(group, chunk) for group, start in enumerate(starts) for chunk in range(start, last)]
        wanted = [keys[(chunk - first) * groups + group] for group, chunk in spans]
        model, salt = key.model_name, key.cache_salt
        generation = l1.generation()
        pickles_only = registration.inline and registration.client != CLIENT_057  # a 0.5.6 worker off the pool
        locked = 0 if pickles_only else l1.lock_prefix(model, salt, wanted, publish=False, lookup=False)  # copying
        reads = [] if pickles_only else l1.read(model, salt, wanted)  # L1_READ_FAILED for what is missing
        if (pickles_only or locked < len(wanted) or not wanted
                or any(size != layouts[group].object_bytes for (_, size), (group, _) in zip(reads, spans))):
            l1.release_read(model, salt, wanted[:locked])
            if job is not None:  # as LMCache: a failed retrieve gives back the lookup's locks on these chunks
                ctx.sessions.release_positions(job, positions, every_lock=False)
            return RETRIEVE_MISS
        pending = self._start(key, instance_id, _MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START)
        pending.positions, pending.job, pending.chunks = positions, job, last - min(starts)
        pending.generation = generation
        for group, layout in enumerate(layouts):
            pending.add(wanted[len(pending.keys) : len(pending.keys) + last - starts[group]], layout.object_bytes)
        offsets = [offset for offset, _ in reads]
        if registration.inline:
            return self._retrieve_inline(pending, registration, offsets, starts, first)
        self._retrieves[transfer_key(key, instance_id)] = pending
        context: dict[str, Any] = {"slots": [slot(offset, layouts[group]) for offset, (group, _) in
                                             zip(offsets, spans)]}
        if registration.grouped:
            context["group_ids"] = [group for group, _ in spans]
            context["chunk_indices"] = [chunk - first for _, chunk in spans]
        return {"success": True, "data": b"", "context": context}

    def _retrieve_inline(self, pending: Pending, registration: Registration, offsets: list[int],
                         starts: list[int], first: int) -> dict:
        """The locked objects as an inline envelope, the transfer finished at once; a miss if it is larger than
        an inline transfer may be."""
        pool, layouts = self._ctx.l1.pool, registration.layouts
        parts, at = [], 0
        for (count, size), layout, start in zip(pending.sizes, layouts, starts):
            views = [pool[offset : offset + size].data for offset in offsets[at : at + count]]
            parts.append((layout, range(start - first, start - first + count), views))
            at += count
        if pending.nbytes > self._max_inline:  # a miss, as a failed retrieve: the lookup's locks go too
            self._ctx.log.warning("lmcache.inline_retrieve_too_large", request_id=pending.request_id,
                                  object_bytes=pending.nbytes, most=self._max_inline)
            return self._fail_retrieve(pending)
        data = inline.encode_grouped(parts) if registration.grouped else inline.encode(layouts[0], parts[0][2])
        if self._lost(pending):  # the copy read zeros, not the objects
            self._ctx.log.warning("lmcache.retrieve_failed", request_id=pending.request_id, reason=POOL_LOST)
            return self._fail_retrieve(pending)
        self._finish_retrieve(pending)
        return {"success": True, "data": data, "context": {}}

    def _fail_retrieve(self, pending: Pending) -> dict:
        """A prepared retrieve that fails: its locks and the lookup's on its objects given back; a miss."""
        self._abandon_retrieve(pending)
        if pending.job is not None:
            self._ctx.sessions.release_positions(pending.job, pending.positions, every_lock=False)
        return RETRIEVE_MISS

    def commit_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> bool:
        """The worker has copied: drop this transfer's locks and one of the lookup's per object."""
        if not self._registrations.owned(instance_id, owner):
            return True  # as for a transfer never prepared
        pending = self._retrieves.pop(transfer_key(key, instance_id), None)
        if pending is not None:  # else as LMCache: nothing was prepared (or it failed, or it was inline)
            self._finish_retrieve(pending)
        return True

    def _finish_retrieve(self, pending: Pending) -> None:
        ctx = self._ctx
        model, salt, count = pending.model, pending.salt, len(pending.keys)
        sampled = ctx.l1.finish_read(model, salt, pending.keys, unlock=True)
        if pending.job is not None:
            ctx.sessions.release_positions(pending.job, pending.positions, every_lock=False)
        self._emit[_MP_RETRIEVE_END]((pending.device, pending.engine, model, salt, count, pending.nbytes,
                                      pending.chunks * self._registrations.chunk_tokens), pending.request_id)
        ctx.publisher.emit(_SM_READ_PREFETCHED_FINISHED, (0,), salt_counts={(salt, model): count}, sampled=sampled)

    # -- housekeeping ------------------------------------------------------------------------

    def forget(self, instance_id: int) -> None:
        """Give back what an unregistered instance's uncommitted stores and retrieves hold."""
        for table in (self._stores, self._retrieves):
            for tkey in [tkey for tkey in table if tkey[0] == instance_id]:
                self._abandon(table, tkey)

    def _abandon(self, table: OrderedDict[TransferKey, Pending], tkey: TransferKey) -> None:
        """Give back what an uncommitted transfer holds; its END event says nothing moved."""
        pending = table.pop(tkey)
        if table is self._stores:
            self._release_held(pending)
            self._ctx.l1.abort_write(pending.model, pending.salt, pending.keys)
            self._emit[_MP_STORE_END]((pending.device, pending.engine, pending.model, 0, 0, 0), pending.request_id)
        else:
            self._abandon_retrieve(pending)

    def _abandon_retrieve(self, pending: Pending) -> None:
        self._ctx.l1.release_read(pending.model, pending.salt, pending.keys)
        self._emit[_MP_RETRIEVE_END]((pending.device, pending.engine, pending.model, pending.salt, 0, 0, 0),
                                     pending.request_id)

    def _release_held(self, pending: Pending) -> None:
        held = self._held.get(pending.peer, 0) - pending.nbytes
        if held > 0:
            self._held[pending.peer] = held
        else:
            self._held.pop(pending.peer, None)

    def expire(self) -> int:
        """Abandon prepared transfers past their deadline (oldest first); returns how many."""
        now = self._ctx.clock()
        expired = 0
        for table in (self._stores, self._retrieves):
            while table:
                tkey, pending = next(iter(table.items()))
                if pending.deadline > now:
                    break
                self._abandon(table, tkey)
                expired += 1
        return expired

    def close(self) -> None:
        for table in (self._stores, self._retrieves):
            while table:
                self._abandon(table, next(iter(table)))

