"""LMCache's engine_driven operations on a cache context: workers copy KV straight into and out of L1 objects.

The server hashes whole chunks of a request's tokens itself (prefix-chained) and folds (world_size, rank) into each
chunk's key, so every KV rank's piece is its own L1 object.  A lookup hit is the prefix of chunks that every rank
has; it takes ``num_kv_readers`` read locks per object, and each worker's commit_retrieve gives one back
(free_lookup_locks a range, end_session the rest).
A lookup that starts past the chunks the engine's own prefix cache holds (LMCache 0.5.7's ``key.start``)
refreshes those chunks for eviction without locking or prefetching them, and its hit counts them.
Stores are two-phase: prepare_store reserves L1 space and names it (byte offsets into the pool, each object the
registration's size), commit_store makes it readable; a prepared store or retrieve left uncommitted gives its space
or locks back after ``pending_ttl_s``.
Each operation publishes the events its mpcache-protocol twin publishes; store and retrieve are timed
from prepare to commit.  A registration (:mod:`.registrations`) holds at most a quarter of L1's bytes (or one
object) in uncommitted stores; one whose object is larger than all of L1 fails each store at prepare_store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import wire
from mpcache.cache.lmcache.chunkkeys import ChunkKeys
from mpcache.cache.lmcache.registrations import Registrations
from mpcache.cache.ops.kv import LookupReport, close_session, report_lookup, reserve_store, start_lookup, store_to_l2
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
MAX_LOOKUPS = 65536  # requests whose lookup result or locks are kept
MAX_EXTRA_RANGES = 64  # free_lookup_locks: abandoned lookups' ranges named in one request
NULL_BLOCK_ID = 0  # the engine block id LMCache 0.5.7 clients treat as absent KV (its servers' default)
PENDING_SHARE = 4  # a registration holds at most 1/PENDING_SHARE of L1's bytes in prepared, uncommitted stores


@dataclass(slots=True)
class _Pending:
    """A prepared store (space reserved, not readable) or retrieve (keys read-locked) awaiting its commit."""

    instance_id: int
    request_id: str
    model: str
    salt: str
    keys: list[int]  # the L1 keys reserved (store) or locked (retrieve)
    positions: list[int] = field(default_factory=list)  # retrieve: the keys' positions in the lookup's job
    job: Job | None = None
    device: str = "cpu:0"  # the worker's rank: START and END pair per (request, device)
    engine: int = 0  # the registration's engine slot, its events' engine_id
    failed: int = 0  # store: chunks that got no space
    nbytes: int = 0
    deadline: float = 0.0


@dataclass(slots=True)
class _Lookup:
    job_id: int
    start_chunk: int = 0  # chunks below the lookup's start: the engine holds them, not locked here
    answered: bool = False


TransferKey = tuple[int, str, int | None, int, int, str, str, int]


def _transfer_key(key: wire.Key, instance_id: int) -> TransferKey:
    return (instance_id, key.request_id, key.worker_id, key.start, key.end, key.model_name, key.cache_salt,
            key.world_size)


class EngineDriven:
    """LMCache engine_driven semantics over one cache process's L1 (single-threaded, like its loop)."""

    def __init__(self, ctx: CacheContext, pending_ttl_s: float = 60.0) -> None:
        self._ctx = ctx
        self._pending_ttl_s = pending_ttl_s
        self.registrations = Registrations(ctx)
        self._held: dict[int, int] = {}  # instance id → bytes its uncommitted stores reserve
        self._max_held = ctx.l1.capacity_bytes // PENDING_SHARE
        self._stores: OrderedDict[TransferKey, _Pending] = OrderedDict()
        self._retrieves: OrderedDict[TransferKey, _Pending] = OrderedDict()
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._chunk_keys = ChunkKeys(self.registrations.chunk_tokens)
        self._emit = {etype: ctx.publisher.fields_emitter(etype) for etype in (  # bound once: a dozen a request
            _MP_STORE_SUBMITTED, _MP_STORE_START, _MP_STORE_END, _MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START,
            _MP_RETRIEVE_END)}

    @property
    def chunk_tokens(self) -> int:
        return self.registrations.chunk_tokens

    # -- registration ----------------------------------------------------------------------

    def negotiate_chunk_size(self, alignment: int) -> int:
        """LMCache 0.5.7's chunk-size negotiation (:meth:`Registrations.negotiate_chunk_size`)."""
        busy = bool(self._lookups or self._stores or self._retrieves)
        chunk = self.registrations.negotiate_chunk_size(alignment, busy)
        if chunk != self._chunk_keys.chunk_tokens:
            self._chunk_keys = ChunkKeys(chunk)
        return chunk

    def register(self, payload: Any, owner: int) -> dict:
        """Describe the pool a worker maps (any object size)."""
        registration = self.registrations.register(payload, owner)
        ctx = self._ctx
        reply = {"shm_name": ctx.config.l1_pool_name(ctx.worker).lstrip("/"), "pool_size": len(ctx.l1.pool)}
        return {**reply, "null_block_id": NULL_BLOCK_ID} if registration.client == wire.CLIENT_057 else reply

    def unregister(self, instance_id: int, owner: int) -> None:
        """Forget an instance and give back what its uncommitted stores and retrieves hold."""
        if self.registrations.forget(instance_id, owner, "unregistered by its worker"):
            self._drop_transfers(instance_id)

    def _drop_transfers(self, instance_id: int) -> None:
        self._held.pop(instance_id, None)
        for table in (self._stores, self._retrieves):
            for tkey in [tkey for tkey in table if tkey[0] == instance_id]:
                self._abandon(table, tkey)

    def _registration(self, instance_id: int, key: wire.Key, owner: int) -> wire.Registration:
        registration = self.registrations.of(instance_id, owner)
        if key.worker_id is None:
            raise ProtocolError("key.worker_id: a worker's transfer names its rank")
        return registration

    def _rank_keys(self, key: wire.Key, first: int, last: int, ranks: tuple[int, ...]) -> list[int]:
        return self._chunk_keys.keys(key.request_id, key.tokens, key.world_size, ranks, first, last)

    # -- lookups -----------------------------------------------------------------------------

    def lookup(self, key: wire.Key) -> None:
        """Lock the prefix of chunks every rank has (``num_kv_readers`` locks per object), prefetch the rest; the
        chunks below ``key.start`` (the engine holds them) are only refreshed for eviction."""
        if key.num_kv_readers < 1:
            raise ProtocolError("key.num_kv_readers: this server needs clients that send it (LMCache 0.5.5+)")
        ctx = self._ctx
        previous = self._lookups.pop(key.request_id, None)
        if previous is not None:  # an abandoned lookup: its locks go now (a later free names them in extra_ranges)
            self._drop_job(previous.job_id)
        chunk, ranks = self.chunk_tokens, key.world_size
        last = min(key.end, key.num_tokens) // chunk
        start_chunk = min(key.start // chunk, last)
        keys = self._rank_keys(key, 0, last, tuple(range(ranks)))
        covered = keys[: start_chunk * ranks]
        if covered:  # most recently used, without a lock: a read lock taken and given back at once
            ctx.l1.release_read(key.model_name, key.cache_salt,
                                covered[: ctx.l1.lock_prefix(key.model_name, key.cache_salt, covered, publish=False)])
        job = start_lookup(ctx, key.request_id, key.model_name, key.cache_salt, keys[start_chunk * ranks :],
                           readers=key.num_kv_readers, ranks=ranks, per_key=True)
        job.report = LookupReport(chunk, start_chunk, key.num_tokens, key.engine_hit_tokens)
        self._lookups[key.request_id] = _Lookup(job.job_id, start_chunk)
        while len(self._lookups) > MAX_LOOKUPS:
            _, oldest = self._lookups.popitem(last=False)
            self._drop_job(oldest.job_id)

    def _job(self, request_id: str) -> tuple[_Lookup, Job] | None:
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return None
        try:
            return lookup, self._ctx.sessions.job(lookup.job_id)
        except RequestError:  # expired and dropped
            del self._lookups[request_id]
            return None

    def _drop_job(self, job_id: int) -> None:
        try:
            self._ctx.sessions.drop(self._ctx.sessions.job(job_id))
        except RequestError:
            pass

    def prefetch_status(self, request_id: str) -> int | None:
        """Hit chunks once, counting those below the lookup's start (then 0, as LMCache's exactly-once status),
        None while the L2 prefetch runs."""
        found = self._job(request_id)
        if found is None:
            return 0
        lookup, job = found
        if job.pending:
            return None
        if lookup.answered:
            return 0
        lookup.answered = True
        report_lookup(self._ctx, job)
        return lookup.start_chunk + job.found // job.ranks

    def is_pending(self, request_id: str) -> bool:
        found = self._job(request_id)
        return found is not None and found[1].pending

    def free_lookup_locks(self, key: wire.Key, extra_ranges: list[tuple[int, int]]) -> None:
        """Give back every lock the lookup holds on the key's whole chunks (one rank, or all with no worker_id).
        The lookup locked nothing below its start; ``extra_ranges`` name abandoned lookups' locks, which this
        server gave back when the next lookup replaced them, so there is nothing left to release for them."""
        if len(extra_ranges) > MAX_EXTRA_RANGES:
            raise ProtocolError(f"extra_ranges: at most {MAX_EXTRA_RANGES} ranges")
        found = self._job(key.request_id)
        if found is None or found[1].pending:
            return
        lookup, job = found
        if not lookup.answered:  # LMCache hands the result over first; a later status query says 0
            lookup.answered = True
            report_lookup(self._ctx, job)
        first, last = wire.chunk_range(key, self.chunk_tokens)
        ranks = range(job.ranks) if key.worker_id is None else (key.worker_id,)
        self._ctx.sessions.release_positions(job, _positions(job, lookup.start_chunk, first, last, ranks),
                                             every_lock=True)

    def end_session(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._chunk_keys.forget(request_id)
        close_session(self._ctx, request_id)

    # -- stores ------------------------------------------------------------------------------

    def prepare_store(self, key: wire.Key, instance_id: int, owner: int) -> dict:
        """Reserve L1 space for the key's chunks not cached yet and describe it (no more than the
        registration's share of L1 left: the chunks beyond get none).  A registration whose object can never
        fit gets no context: the worker skips its copy into L1 and its commit fails at once."""
        ctx = self._ctx
        registration = self._registration(instance_id, key, owner)
        tkey = _transfer_key(key, instance_id)
        if tkey in self._stores:
            self._abandon(self._stores, tkey)
        self._check_room()
        first, last = wire.chunk_range(key, self.chunk_tokens)
        keys = self._rank_keys(key, first, last, (key.worker_id or 0,))
        request_id, model, salt = key.request_id, key.model_name, key.cache_salt
        ctx.sessions.open(request_id)
        device = f"cpu:{key.worker_id or 0}"  # a worker's transfers are on its own device
        self._emit[_MP_STORE_SUBMITTED]((device,), request_id)
        engine = self.registrations.slot(instance_id)
        self._emit[_MP_STORE_START]((device, engine, model), request_id)
        held = self._held.get(instance_id, 0)
        size = registration.object_bytes
        limit = (self._max_held - held) // size if held else max(1, self._max_held // size)
        reservation = reserve_store(ctx, model, salt, keys, limit=limit, nbytes=size)
        pending = _Pending(instance_id, request_id, model, salt, [keys[i] for i in reservation.positions],
                           device=device, engine=engine, failed=reservation.failed,
                           nbytes=registration.object_bytes, deadline=ctx.clock() + self._pending_ttl_s)
        if not reservation.positions:  # nothing to copy: the worker will not commit
            self._finish_store(pending, [])
            if size > ctx.l1.max_object_bytes and reservation.failed:
                return {"context": {}}  # no slots: the worker's store fails (its commit finds nothing prepared)
            return {"context": {"slots": [], "chunk_indices": []}}
        self._stores[tkey] = pending
        self._held[instance_id] = held + len(pending.keys) * size
        slots = [{"offset": offset, "length": size, "shape": registration.shape, "dtype": registration.dtype}
                 for offset in reservation.offsets]
        return {"context": {"slots": slots, "chunk_indices": reservation.positions}}

    def commit_store(self, key: wire.Key, instance_id: int, data: Any, owner: int) -> bool:
        """Make the prepared objects readable: only the uid, registration and key that prepared them can;
        a non-empty ``data`` (pickled tensors) is refused, never read."""
        tkey = _transfer_key(key, instance_id)
        if type(data) is not bytes:
            raise ProtocolError("data: expected bytes")
        if not self.registrations.owned(instance_id, owner):
            return False
        if data:
            if tkey in self._stores:
                self._abandon(self._stores, tkey)
            raise RequestError("commit_store with inline data (pickled tensors) is refused: the worker must map the "
                               "shared-memory pool (same user, same /dev/shm)")
        pending = self._stores.pop(tkey, None)
        if pending is None:
            return False
        self._release_held(pending)
        sampled = self._ctx.l1.commit_write(pending.model, pending.salt, pending.keys, pending.nbytes)
        self._finish_store(pending, sampled)
        return True

    def _finish_store(self, pending: _Pending, sampled: list) -> None:
        ctx = self._ctx
        stored, nbytes, model, salt = len(pending.keys), pending.nbytes, pending.model, pending.salt
        self._emit[_MP_STORE_END]((pending.device, pending.engine, model, stored, stored * nbytes,
                                   stored * self.chunk_tokens), pending.request_id)
        ctx.publisher.emit(_SM_WRITE_FINISHED, (pending.failed,),
                           salt_counts={(salt, model): stored} if stored else None, sampled=sampled)
        if stored and nbytes == ctx.chunk_bytes and ctx.storage.adapters:
            offsets = [offset for offset, _ in ctx.l1.read(model, salt, pending.keys)]
            store_to_l2(ctx, model, salt, pending.keys[: len(offsets)], offsets)

    # -- retrieves ---------------------------------------------------------------------------

    def prepare_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> dict:
        """Lock the key's chunks for this rank while the worker copies them out; all of them or a failure."""
        ctx = self._ctx
        registration = self._registration(instance_id, key, owner)
        tkey = _transfer_key(key, instance_id)
        if tkey in self._retrieves:
            self._abandon(self._retrieves, tkey)
        self._check_room()
        first, last = wire.chunk_range(key, self.chunk_tokens)
        rank = key.worker_id or 0
        keys = self._rank_keys(key, first, last, (rank,))
        found = self._job(key.request_id)
        job = found[1] if found is not None else None
        positions = [] if found is None else _positions(found[1], found[0].start_chunk, first, last, (rank,))
        request_id, model, salt, l1 = key.request_id, key.model_name, key.cache_salt, ctx.l1
        locked = l1.lock_prefix(model, salt, keys, publish=False)  # held only while the worker copies
        reads = l1.read(model, salt, keys)  # publishes L1_READ_FAILED for what is missing
        if locked < len(keys) or not keys or any(size != registration.object_bytes for _, size in reads):
            l1.release_read(model, salt, keys[:locked])
            if job is not None:  # as LMCache: a failed retrieve gives back the lookup's locks on these chunks
                ctx.sessions.release_positions(job, positions, every_lock=False)
            return {"success": False, "data": b"", "context": {}}
        ctx.sessions.open(request_id)
        device = f"cpu:{key.worker_id or 0}"  # a worker's transfers are on its own device
        self._emit[_MP_RETRIEVE_SUBMITTED]((device,), request_id)
        engine = self.registrations.slot(instance_id)
        self._emit[_MP_RETRIEVE_START]((device, engine, model), request_id)
        self._retrieves[tkey] = _Pending(instance_id, request_id, model, salt, keys, positions, job, device, engine,
                                         nbytes=registration.object_bytes, deadline=ctx.clock() + self._pending_ttl_s)
        return {"success": True, "data": b"", "context": {"slots": [
            {"offset": offset, "length": size, "shape": registration.shape, "dtype": registration.dtype}
            for offset, size in reads]}}

    def commit_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> bool:
        """The worker has copied: drop this transfer's locks and one of the lookup's per object."""
        if not self.registrations.owned(instance_id, owner):
            return True  # as for a transfer never prepared
        pending = self._retrieves.pop(_transfer_key(key, instance_id), None)
        if pending is None:
            return True  # as LMCache: nothing was prepared (or the prepare failed)
        ctx = self._ctx
        model, salt, count = pending.model, pending.salt, len(pending.keys)
        sampled = ctx.l1.finish_read(model, salt, pending.keys, unlock=True)
        if pending.job is not None:
            ctx.sessions.release_positions(pending.job, pending.positions, every_lock=False)
        self._emit[_MP_RETRIEVE_END]((pending.device, pending.engine, model, salt, count, count * pending.nbytes,
                                      count * self.chunk_tokens), pending.request_id)
        ctx.publisher.emit(_SM_READ_PREFETCHED_FINISHED, (0,), salt_counts={(salt, model): count}, sampled=sampled)
        return True

    # -- housekeeping ------------------------------------------------------------------------

    def _check_room(self) -> None:
        if len(self._stores) + len(self._retrieves) >= MAX_PENDING:
            raise RequestError(f"more than {MAX_PENDING} prepared transfers are waiting for their commit")

    def _abandon(self, table: OrderedDict[TransferKey, _Pending], tkey: TransferKey) -> None:
        """Give back what an uncommitted transfer holds; its END event says nothing moved."""
        pending = table.pop(tkey)
        ctx = self._ctx
        if table is self._stores:
            self._release_held(pending)
            ctx.l1.abort_write(pending.model, pending.salt, pending.keys)
            self._emit[_MP_STORE_END]((pending.device, pending.engine, pending.model, 0, 0, 0), pending.request_id)
        else:
            ctx.l1.release_read(pending.model, pending.salt, pending.keys)
            self._emit[_MP_RETRIEVE_END]((pending.device, pending.engine, pending.model, pending.salt, 0, 0, 0),
                                         pending.request_id)

    def _release_held(self, pending: _Pending) -> None:
        held = self._held.get(pending.instance_id, 0) - len(pending.keys) * pending.nbytes
        if held > 0:
            self._held[pending.instance_id] = held
        else:
            self._held.pop(pending.instance_id, None)

    def expire(self) -> int:
        """Drop silent registrations, abandon transfers past their deadline (oldest first); how many transfers."""
        for instance_id in self.registrations.reap():
            self._drop_transfers(instance_id)
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


def _positions(job: Job, start_chunk: int, first: int, last: int, ranks: Iterable[int]) -> list[int]:
    """Where chunks ``[first, last)`` of these ranks stand in a lookup's job, which begins at ``start_chunk`` and
    holds what it found (the chunks outside hold no lock of it)."""
    first, last = max(first, start_chunk), min(last, start_chunk + job.found // job.ranks)
    return [(chunk - start_chunk) * job.ranks + rank for chunk in range(first, last) for rank in ranks]
