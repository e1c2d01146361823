"""LMCache's engine_driven operations on a cache context: workers copy KV straight into and out of L1 objects.

The server hashes whole chunks of a request's tokens itself (prefix-chained) and folds
(world_size, rank) into each chunk's key, and for a hybrid model the KV cache group (:mod:`.groups`), so
every KV rank's piece of every group is its own L1 object.  A lookup hit is the longest prefix every group
can serve, each under its own window (full attention: every chunk of it; a sliding-window or recurrent
group: its last chunks), with every rank; it takes ``num_kv_readers`` read locks on each object a group
needs for that prefix, and each worker's retrieve gives one back (free_lookup_locks a range, end_session
the rest).  A lookup that starts past the chunks the engine's own prefix cache holds (LMCache 0.5.7's
``key.start``) refreshes those chunks for eviction without locking or prefetching them, and its hit counts
them.  A lookup of one group also prefetches from L2; a hybrid model's lookup reads L1 only.  Stores and
retrieves are :mod:`.transfers`'; registrations :mod:`.registrations`'.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import groups, wire
from mpcache.cache.lmcache.groups import GroupLayout
from mpcache.cache.lmcache.keycache import KeyCache
from mpcache.cache.lmcache.registrations import CLIENT_057, Registrations
from mpcache.cache.lmcache.transfers import Transfers
from mpcache.cache.requests import LookupReport, close_session, report_lookup, start_lookup
from mpcache.cache.sessions import Job
from mpcache.contract.events import EventType
from mpcache.errors import ProtocolError, RequestError

_MP_LOOKUP_PREFETCH_START = EventType.MP_LOOKUP_PREFETCH_START
MAX_LOOKUPS = 65536  # requests whose lookup result or locks are kept
MAX_EXTRA_RANGES = 64  # free_lookup_locks: abandoned lookups' ranges named in one request
NULL_BLOCK_ID = 0  # the engine block id LMCache 0.5.7 clients treat as absent KV (its servers' default)


@dataclass(slots=True)
class _Lookup:
    job_id: int
    start_chunk: int = 0  # chunks below the lookup's start: the engine holds them, not locked here
    groups: int = 1  # KV cache groups: each chunk's keys are groups × ranks, group-major
    answered: bool = False


class EngineDriven:
    """LMCache engine_driven semantics over one cache process's L1 (single-threaded, like its loop)."""

    def __init__(self, ctx: CacheContext, pending_ttl_s: float = 60.0) -> None:
        self._ctx = ctx
        self.registrations = Registrations(ctx)
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self.keys = KeyCache(ctx.config.lmcache_max_tokens, self.registrations.chunk_tokens)
        self.transfers = Transfers(ctx, self.registrations, self._keys, self.keys.prefix_hash, self._held_by,
                                   pending_ttl_s)

    @property
    def chunk_tokens(self) -> int:
        return self.registrations.chunk_tokens

    # -- registration ----------------------------------------------------------------------

    def negotiate_chunk_size(self, alignment: int) -> int:
        """LMCache 0.5.7's chunk-size negotiation (:meth:`Registrations.negotiate_chunk_size`)."""
        busy = bool(self._lookups) or self.transfers.busy
        chunk = self.registrations.negotiate_chunk_size(alignment, busy)
        if chunk != self.keys.chunk_tokens:
            self.keys.rechunk(chunk)
        return chunk

    def register(self, payload: Any, owner: int) -> dict:
        """Describe the pool a worker maps (any object sizes), or ``shm_name ""`` to one whose peer cannot map it:
        LMCache 0.5.7's sign for inline transfer (0.5.6 falls back to pickles, which are refused)."""
        registration = self.registrations.register(payload, owner)
        ctx = self._ctx
        reply: dict[str, Any] = {"shm_name": ctx.config.l1_pool_name(ctx.worker).lstrip("/"),
                                 "pool_size": len(ctx.l1.pool)}
        if registration.inline:
            reply = {"shm_name": "", "pool_size": 0}
        if registration.client == CLIENT_057:
            reply["null_block_id"] = NULL_BLOCK_ID
        return reply

    def unregister(self, instance_id: int, owner: int) -> None:
        """Forget an instance and give back what its uncommitted stores and retrieves hold."""
        if self.registrations.forget(instance_id, owner, "unregistered by its worker"):
            self.transfers.forget(instance_id)

    def _keys(self, key: wire.Key, first: int, last: int, ranks: tuple[int, ...], groups: int = 1) -> list[int]:
        return self.keys.chunk_keys(key, ranks, first, last, groups)

    # -- lookups -----------------------------------------------------------------------------

    def lookup(self, key: wire.Key) -> None:
        """Lock what every group needs for the longest prefix they can all serve (``num_kv_readers`` locks per
        object), prefetch the rest of a one-group prefix; the chunks below ``key.start`` (the engine holds them)
        are only refreshed for eviction."""
        if key.num_kv_readers < 1:
            raise ProtocolError("key.num_kv_readers: this server needs clients that send it (LMCache 0.5.5+)")
        ctx = self._ctx
        previous = self._lookups.pop(key.request_id, None)
        if previous is not None:  # an abandoned lookup: its locks go now (a later free names them in extra_ranges)
            self._drop_job(previous.job_id)
        layouts = self.registrations.groups_of(key.model_name, key.world_size)
        chunk, ranks, count = self.chunk_tokens, key.world_size, 1 if layouts is None else len(layouts)
        stride = ranks * count
        last = min(key.end, key.num_tokens) // chunk
        start_chunk = min(key.start // chunk, last)
        keys = self._keys(key, 0, last, tuple(range(ranks)), count)
        covered = keys[: start_chunk * stride]
        if covered and layouts is not None:  # a window leaves gaps: refresh each object L1 holds
            covered = [k for k in covered if ctx.l1.contains((key.model_name, key.cache_salt, k))]
        if covered:  # most recently used, without a lock: a read lock taken and given back at once
            ctx.l1.release_read(key.model_name, key.cache_salt,
                                covered[: ctx.l1.lock_prefix(key.model_name, key.cache_salt, covered, publish=False)])
        if layouts is None:
            job = start_lookup(ctx, key.request_id, key.model_name, key.cache_salt, keys[start_chunk * stride :],
                               readers=key.num_kv_readers, ranks=ranks, per_key=True)
        else:
            job = self._grouped_lookup(key, keys[start_chunk * stride :], layouts)
        windows = () if layouts is None else tuple(layout.window for layout in layouts)
        job.report = LookupReport(chunk, start_chunk, key.num_tokens, key.engine_hit_tokens, windows)
        self._lookups[key.request_id] = _Lookup(job.job_id, start_chunk, count)
        while len(self._lookups) > MAX_LOOKUPS:
            _, oldest = self._lookups.popitem(last=False)
            self._drop_job(oldest.job_id)

    def _grouped_lookup(self, key: wire.Key, keys: list[int], layouts: tuple[GroupLayout, ...]) -> Job:
        """A hybrid model's lookup of ``keys`` (chunk-major, then group, then rank), from L1: the hit is
        :func:`.groups.hit_length` of what L1 holds, and each group read-locks the chunks it needs for it."""
        ctx, model, salt, readers = self._ctx, key.model_name, key.cache_salt, key.num_kv_readers
        ctx.sessions.open(key.request_id)
        ctx.publisher.emit(_MP_LOOKUP_PREFETCH_START, session_id=key.request_id)
        ranks, count = key.world_size, len(layouts)
        stride = ranks * count
        held = [ctx.l1.contains((model, salt, chunk_key)) for chunk_key in keys]
        present = [[all(held[chunk * stride + group * ranks : chunk * stride + (group + 1) * ranks])
                    for chunk in range(len(keys) // stride)] for group in range(count)]
        length = groups.hit_length(present, [layout.window for layout in layouts])
        retained = [chunk * stride + group * ranks + rank for chunk in range(length)
                    for group, layout in enumerate(layouts) if chunk >= groups.window_start(length, layout.window)
                    for rank in range(ranks)]
        for _ in range(readers):
            ctx.l1.lock_prefix(model, salt, [keys[position] for position in retained])
        job = ctx.sessions.add_job(key.request_id, model, salt, keys, length * stride, readers, stride, per_key=True)
        job.l1_hits = len(retained)  # the objects hit: those a window leaves out hold no lock
        if job.held is not None:
            kept = set(retained)
            for position in range(length * stride):
                if position not in kept:
                    job.held[position] = 0
        ctx.sessions.trim()
        return job

    def _job(self, request_id: str) -> tuple[_Lookup, Job] | None:
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return None
        try:
            return lookup, self._ctx.sessions.job(lookup.job_id)
        except RequestError:  # expired and dropped
            del self._lookups[request_id]
            return None

    def _held_by(self, key: wire.Key, count: int, spans: list[tuple[int, int, int]]) -> tuple[Job | None, list[int]]:
        """The lookup job holding ``key``'s request's locks, and the places in it of each span's objects
        (chunks ``[first, last)`` at one (group, rank) offset); none when it was made for another number of
        KV cache groups."""
        found = self._job(key.request_id)
        if found is None or found[0].groups != count:
            return None, []
        lookup, job = found
        return job, [position for first, last, offset in spans
                     for position in _positions(job, lookup.start_chunk, first, last, (offset,))]

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
        """Give back every lock the lookup holds on the key's whole chunks (one rank of every group, or all with
        no worker_id).  The lookup locked nothing below its start; ``extra_ranges`` name abandoned lookups'
        locks, which this server gave back when the next lookup replaced them, so there is nothing left to
        release for them."""
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
        ranks = job.ranks // lookup.groups
        offsets = range(job.ranks) if key.worker_id is None else [
            group * ranks + key.worker_id for group in range(lookup.groups)]
        self._ctx.sessions.release_positions(job, _positions(job, lookup.start_chunk, first, last, offsets),
                                             every_lock=True)

    def end_session(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self.keys.forget(request_id)
        close_session(self._ctx, request_id)

    # -- transfers ---------------------------------------------------------------------------

    def prepare_store(self, key: wire.Key, instance_id: int, owner: int, skipped: Any = None,
                      connection: bytes = b"") -> dict:
        return self.transfers.prepare_store(key, instance_id, owner, skipped, connection)

    def commit_store(self, key: wire.Key, instance_id: int, data: Any, owner: int) -> bool:
        return self.transfers.commit_store(key, instance_id, data, owner)

    def prepare_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> dict:
        return self.transfers.prepare_retrieve(key, instance_id, owner)

    def commit_retrieve(self, key: wire.Key, instance_id: int, owner: int) -> bool:
        return self.transfers.commit_retrieve(key, instance_id, owner)

    def expire(self) -> int:
        """Drop silent registrations, abandon transfers past their deadline (oldest first); how many transfers."""
        for instance_id in self.registrations.reap():
            self.transfers.forget(instance_id)
        return self.transfers.expire()

    def close(self) -> None:
        self.transfers.close()


def _positions(job: Job, start_chunk: int, first: int, last: int, offsets: Iterable[int]) -> list[int]:
    """Where chunks ``[first, last)`` at these (group, rank) offsets stand in a lookup's job, which begins at
    ``start_chunk`` and holds what it found (the chunks outside hold no lock of it)."""
    first, last = max(first, start_chunk), min(last, start_chunk + job.found // job.ranks)
    return [(chunk - start_chunk) * job.ranks + offset for chunk in range(first, last) for offset in offsets]
