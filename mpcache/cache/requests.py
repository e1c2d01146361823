"""The request logic both front ends share (the native protocol's operations in :mod:`.ops.kv` and LMCache's
engine in :mod:`.lmcache`): reserving L1 for a store and handing it to L2, starting a lookup and publishing its
end, closing a session.  Each publishes the events its callers' operations list."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from mpcache.cache.context import CacheContext
from mpcache.cache.l1 import WriteReservation
from mpcache.cache.sessions import Job
from mpcache.contract.events import EventType

_MP_LOOKUP_PREFETCH_START = EventType.MP_LOOKUP_PREFETCH_START
_MP_LOOKUP_PREFETCH_END = EventType.MP_LOOKUP_PREFETCH_END


def reserve_store(ctx: CacheContext, model: str, salt: str, hashes: list[int], limit: int | None = None,
                  nbytes: int | None = None, label: str | None = None, store: Hashable | None = None
                  ) -> WriteReservation:
    """L1 space for a store's new chunks (:meth:`L1Manager.reserve_write`, ``store`` naming it across its TP ranks
    and KV cache groups), and the store's sampled access (under ``label`` where the curves key it apart from
    ``model``: a KV cache group of a hybrid model)."""
    reservation = ctx.l1.reserve_write(model, salt, hashes, limit, nbytes, store=store)
    ctx.accesses.store(label or model, salt, hashes, ctx.chunk_bytes if nbytes is None else nbytes)
    return reservation


def store_to_l2(ctx: CacheContext, model: str, salt: str, hashes: list[int], offsets: list[int]) -> None:
    """Hand freshly committed chunks (``chunk_bytes`` each, at these pool offsets) to every L2 tier.  The tasks
    get copies: the L1 objects stay readable (and evictable) while adapters write; none if the pool was lost
    under the copy."""
    if ctx.storage.adapters:
        l1 = ctx.l1
        pool, size, generation = l1.pool, ctx.chunk_bytes, l1.generation()
        chunks = [(chunk_hash, pool[offset : offset + size].tobytes()) for chunk_hash, offset in zip(hashes, offsets)]
        if l1.lost_since(generation, len(chunks)):  # a fault under the copy: zeros, not the chunks
            return
        ctx.storage.store(model, salt, chunks)


def start_lookup(ctx: CacheContext, request_id: str, model: str, salt: str, hashes: list[int], *, readers: int = 1,
                 ranks: int = 1, per_key: bool = False) -> Job:
    """MP_LOOKUP_PREFETCH_START, ``readers`` read locks on each key of the L1 prefix, an L2 prefetch of the
    rest.  With ``ranks`` > 1 the keys are a chunk's KV ranks in turn, and only whole chunks count;
    ``per_key`` counts the locks per key, for owners that give them back piecemeal."""
    ctx.sessions.open(request_id)
    ctx.publisher.emit(_MP_LOOKUP_PREFETCH_START, session_id=request_id)
    l1 = ctx.l1
    generation = l1.generation()
    found = l1.lock_prefix(model, salt, hashes)
    partial = found % ranks
    if partial:
        l1.release_read(model, salt, hashes[found - partial : found])
        found -= partial
    for _ in range(readers - 1):
        l1.lock_prefix(model, salt, hashes[:found])
    job = ctx.sessions.add_job(request_id, model, salt, hashes, found, readers, ranks, per_key)
    job.generation = generation
    if found < len(hashes) and ctx.prefetch.start(job.job_id, model, salt, hashes[found:], job):
        job.pending = True
    ctx.sessions.trim()
    return job


@dataclass(frozen=True, slots=True)
class LookupReport:
    """What an LMCache lookup's END counts beyond its job: the chunk size it was hashed at, the chunks below its
    start (the engine's own prefix cache holds them: neither requested nor hit, but part of the request's hit),
    the whole prompt's tokens and the engine's prefix-cache hit the client hinted; for a hybrid model, each KV
    cache group's window (its keys are sampled group by group)."""

    chunk_tokens: int
    covered_chunks: int
    prompt_tokens: int
    engine_hit_tokens: int
    windows: tuple[int, ...] = ()


def report_lookup(ctx: CacheContext, job: Job) -> None:
    """MP_LOOKUP_PREFETCH_END once a job is done (an expired job was abandoned: none), in chunks.  Beside the
    looked-up tokens and their hit, the request-level pair: the whole prompt, and the prefix of it the engine's
    prefix cache or this cache serves (the longer of the two, as LMCache counts it)."""
    if job.pending or job.reported or job.expired:
        return
    job.reported = True
    ranks = job.ranks
    chunks = job.found // ranks
    report: LookupReport | None = job.report
    windows = () if report is None else report.windows
    if ranks == 1 and not windows:
        l1_hits, l2_hits = job.l1_hits, job.l2_hits
    else:  # a chunk is an L2 hit when any of its ranks (or groups' objects) came from L2
        l2_hits = min(chunks, -(-job.l2_hits // ranks))
        l1_hits = chunks - l2_hits
    tokens = ctx.chunk_tokens if report is None else report.chunk_tokens
    requested, hit = len(job.hashes) // ranks * tokens, chunks * tokens
    if report is None:
        prompt, request_hit = requested, hit
    else:
        prompt = report.prompt_tokens
        request_hit = max(report.engine_hit_tokens, report.covered_chunks * tokens + hit)
    ctx.publisher.emit(
        _MP_LOOKUP_PREFETCH_END,
        (job.model, job.salt, chunks, requested, hit, l1_hits * tokens, l2_hits * tokens, "", prompt, request_hit,
         job.l1_hits, job.l2_hits),
        session_id=job.request_id,
    )
    if windows:
        ctx.accesses.lookup_groups(ctx.l1, job.model, job.salt, job.hashes, ranks, windows, chunks)
    else:
        ctx.accesses.lookup(ctx.l1, job.model, job.salt, job.hashes, ranks, job.l1_hits, job.found)


def close_session(ctx: CacheContext, request_id: str) -> bool:
    """CB_REQUEST_END, MP_VLLM_END_SESSION and MP_REQUEST_END as they apply; whether the request was known."""
    blended = ctx.blend.end_session(request_id)
    owned_blocks = ctx.l0.end_session(request_id)
    return ctx.sessions.end(request_id) or owned_blocks or blended
