"""The KV operations: store, lookup_prefetch, query_prefetch_status, retrieve and end_session, with the
request-flow events ``docs/PROTOCOL.md`` lists.
"""

from __future__ import annotations

from mpcache.cache.buffers import Buffer, Peer
from mpcache.cache.context import CacheContext
from mpcache.cache.l1 import POOL_LOST
from mpcache.cache.native.ops.registry import Args, Reply, operation
from mpcache.cache.requests import close_session, report_lookup, reserve_store, start_lookup, store_to_l2
from mpcache.cache.timeouts import Deadline
from mpcache.cache.transfer import Transfer
from mpcache.contract import protocol as p
from mpcache.contract.events import EventType
from mpcache.errors import ProtocolError, RequestError

_MP_STORE_SUBMITTED = EventType.MP_STORE_SUBMITTED
_MP_RETRIEVE_SUBMITTED = EventType.MP_RETRIEVE_SUBMITTED
_MP_STORE_START = EventType.MP_STORE_START
_MP_STORE_END = EventType.MP_STORE_END
_MP_RETRIEVE_START = EventType.MP_RETRIEVE_START
_MP_RETRIEVE_END = EventType.MP_RETRIEVE_END
_MP_LOOKUP_PREFETCH_START = EventType.MP_LOOKUP_PREFETCH_START
_MP_LOOKUP_PREFETCH_END = EventType.MP_LOOKUP_PREFETCH_END
_MRC_LOOKUP_SAMPLED = EventType.MRC_LOOKUP_SAMPLED
_MRC_STORE_SAMPLED = EventType.MRC_STORE_SAMPLED
_SM_WRITE_FINISHED = EventType.SM_WRITE_FINISHED
_SM_READ_PREFETCHED_FINISHED = EventType.SM_READ_PREFETCHED_FINISHED
# Declared below, published elsewhere: by the sessions, the blend state, the L0 reporter, the dispatcher.
_MP_REQUEST_START = EventType.MP_REQUEST_START
_MP_REQUEST_END = EventType.MP_REQUEST_END
_CB_REQUEST_END = EventType.CB_REQUEST_END
_MP_VLLM_END_SESSION = EventType.MP_VLLM_END_SESSION
_TIMEOUT_RAISED = EventType.TIMEOUT_RAISED

_REQUIRED = p.REQUIRED


def begin_copy(ctx: CacheContext, buffer: Buffer, request_id: str, submitted: EventType, start: EventType,
               engine: int, model: str) -> Transfer:
    """Open a copy between a client buffer and L1: the session, SUBMITTED, and START — unless the
    copy runs on a CUDA stream (``stream_timed``), whose START is stamped where the stream got to it.
    Returns the buffer's mover (CPU shared memory or CUDA)."""
    ctx.sessions.open(request_id)
    mover = buffer.transfer
    ctx.publisher.emit(submitted, (mover.device,), session_id=request_id)
    if not mover.stream_timed:
        ctx.publisher.emit(start, (mover.device, engine, model), session_id=request_id)
    return mover


@operation("store",
           ("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED), ("model_name", p.MODEL, _REQUIRED),
           ("cache_salt", p.SALT, ""), ("chunk_hashes", p.HASHES, _REQUIRED), ("block_ids", p.BLOCK_IDS, _REQUIRED),
           ("engine_id", p.ENGINE, 0),
           replies=("stored_count", "skipped_count", "failed_count"),
           events=(_MP_REQUEST_START, _MP_STORE_SUBMITTED, _MP_STORE_START, _MP_STORE_END, _SM_WRITE_FINISHED,
                   _MRC_STORE_SAMPLED))
def store(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Copy block ``block_ids[i]`` into L1 as chunk ``chunk_hashes[i]``, and hand the new chunks to every
    L2 tier in the background.  Chunks already cached are skipped; chunks L1 has no room for (every object
    read-locked or being written) fail."""
    hashes, block_ids = args["chunk_hashes"], args["block_ids"]
    if len(block_ids) != len(hashes):
        raise ProtocolError(f"block_ids: {len(block_ids)} entries for {len(hashes)} chunk_hashes")
    buffer = peer.buffer(args["buffer_id"], block_ids)
    request_id, model, salt, engine = args["request_id"], args["model_name"], args["cache_salt"], args["engine_id"]
    pub = ctx.publisher
    mover = begin_copy(ctx, buffer, request_id, _MP_STORE_SUBMITTED, _MP_STORE_START, engine, model)
    device = mover.device
    l1 = ctx.l1
    generation = l1.generation()
    reservation = reserve_store(ctx, model, salt, hashes)
    committed = [hashes[i] for i in reservation.positions]
    nbytes = buffer.block_bytes
    try:
        timing = mover.to_l1(l1.pool, [(block_ids[i], offset) for i, offset in zip(reservation.positions,
                                                                                    reservation.offsets)], nbytes)
        if l1.lost_since(generation, len(committed)):
            raise RequestError(f"{POOL_LOST}; nothing was stored: store the chunks again")
    except BaseException:
        l1.abort_write(model, salt, committed)
        pub.emit(_MP_STORE_END, (device, engine, model, 0, 0, 0), session_id=request_id)
        raise
    if timing is not None:  # where the stream reached the copy's start
        pub.emit(_MP_STORE_START, (device, engine, model), session_id=request_id, timestamp_ns=timing.start_ns)
    sampled = l1.commit_write(model, salt, committed, nbytes)
    stored = len(committed)
    tokens = ctx.chunk_tokens
    pub.emit(_MP_STORE_END, (device, engine, model, stored, stored * nbytes, stored * tokens),
             session_id=request_id, timestamp_ns=None if timing is None else timing.end_ns)
    pub.emit(_SM_WRITE_FINISHED, (reservation.failed,),
             salt_counts={(salt, model): stored} if stored else None, sampled=sampled)
    if stored and nbytes == ctx.chunk_bytes:
        store_to_l2(ctx, model, salt, [hashes[i] for i in reservation.positions], reservation.offsets)
    return {"stored_count": stored, "skipped_count": reservation.present, "failed_count": reservation.failed}


@operation("lookup_prefetch",
           ("request_id", p.REQUEST_ID, _REQUIRED), ("model_name", p.MODEL, _REQUIRED), ("cache_salt", p.SALT, ""),
           ("chunk_hashes", p.HASHES, _REQUIRED),
           replies=("job_id",), events=(_MP_REQUEST_START, _MP_LOOKUP_PREFETCH_START))
def lookup_prefetch(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Read-lock the contiguous prefix of ``chunk_hashes`` that L1 holds and, with L2 tiers, start loading
    the run after it from L2 into L1.  Returns a prefetch job to poll with ``query_prefetch_status``."""
    job = start_lookup(ctx, args["request_id"], args["model_name"], args["cache_salt"], args["chunk_hashes"])
    return {"job_id": job.job_id}


@operation("query_prefetch_status", ("job_id", p.ID, _REQUIRED),
           replies=("done", "found_count", "requested_count", "hit_tokens", "l1_hit_tokens", "l2_hit_tokens",
                    "l2_loaded_count", "expired"),
           events=(_MP_LOOKUP_PREFETCH_END, _MRC_LOOKUP_SAMPLED))
def query_prefetch_status(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """A prefetch job's progress; never blocks.  ``done`` is false while its L2 prefetch runs;
    ``found_count`` chunks (a contiguous prefix) are then ready to retrieve, their tokens split by tier
    into ``l1_hit_tokens`` and ``l2_hit_tokens``.  The first read of a done job publishes its END."""
    job = ctx.sessions.job(args["job_id"])
    tokens = ctx.chunk_tokens
    done = not job.pending
    report_lookup(ctx, job)
    return {"done": done, "found_count": job.found, "requested_count": len(job.hashes),
            "hit_tokens": job.found * tokens, "l1_hit_tokens": job.l1_hits * tokens,
            "l2_hit_tokens": job.l2_hits * tokens, "l2_loaded_count": job.l2_landed, "expired": job.expired}


@operation("retrieve",
           ("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED), ("job_id", p.ID, _REQUIRED),
           ("block_ids", p.BLOCK_IDS, _REQUIRED), ("engine_id", p.ENGINE, 0), ("timeout_s", p.TIMEOUT, None),
           replies=("retrieved_count", "failed_count"),
           events=(_MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START, _MP_RETRIEVE_END, _SM_READ_PREFETCHED_FINISHED,
                   _TIMEOUT_RAISED))
def retrieve(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Copy the first ``len(block_ids)`` chunks the job found into those blocks and release the job's read
    locks.  Chunks evicted since (only possible once the job expired) are counted as failed."""
    block_ids, request_id, engine = args["block_ids"], args["request_id"], args["engine_id"]
    buffer = peer.buffer(args["buffer_id"], block_ids)
    job = ctx.sessions.job(args["job_id"])
    if job.request_id != request_id:
        raise RequestError(f"job_id: prefetch job {job.job_id} belongs to another request")
    if job.pending:
        raise RequestError(f"job_id: prefetch job {job.job_id} is still loading from L2; wait until "
                           "query_prefetch_status says done")
    if job.retrieved or job.found == 0:
        raise RequestError(f"job_id: prefetch job {job.job_id} found nothing or was already retrieved")
    wanted = len(block_ids)
    if wanted > job.found:
        raise RequestError(f"block_ids: {wanted} blocks, but prefetch job {job.job_id} found {job.found} chunks")
    model, salt = job.model, job.salt
    pub = ctx.publisher
    mover = begin_copy(ctx, buffer, request_id, _MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START, engine, model)
    device = mover.device
    deadline = Deadline(args["timeout_s"], ctx.clock)
    l1 = ctx.l1
    nbytes = buffer.block_bytes
    try:
        reads = l1.read(model, salt, job.hashes[:wanted])
        for _, size in reads:
            if size != nbytes:
                raise RequestError(f"chunks were stored from {size}-byte blocks; this buffer has {nbytes}-byte blocks")
        timing = mover.from_l1(l1.pool, [(block, offset) for (offset, _), block in zip(reads, block_ids)], nbytes,
                               lambda: deadline.check("retrieve", session_id=request_id))
        if l1.lost_since(job.generation, len(reads)):  # lost since the lookup locked them, or under the copy
            raise RequestError(f"{POOL_LOST}; the blocks do not hold the chunks: store them again")
    except BaseException:
        pub.emit(_MP_RETRIEVE_END, (device, engine, model, salt, 0, 0, 0), session_id=request_id)
        raise  # the job keeps its locks: the client may retry or end the session
    if timing is not None:  # where the stream reached the copy's start
        pub.emit(_MP_RETRIEVE_START, (device, engine, model), session_id=request_id, timestamp_ns=timing.start_ns)
    retrieved = len(reads)
    locked = job.locked
    sampled = l1.finish_read(model, salt, job.hashes[:retrieved], unlock=locked)
    if locked:
        l1.release_read(model, salt, job.hashes[retrieved : job.found])
        ctx.sessions.mark_unlocked(job)
    job.retrieved = True
    pub.emit(_MP_RETRIEVE_END,
             (device, engine, model, salt, retrieved, retrieved * nbytes, retrieved * ctx.chunk_tokens),
             session_id=request_id, timestamp_ns=None if timing is None else timing.end_ns)
    pub.emit(_SM_READ_PREFETCHED_FINISHED, (wanted - retrieved,),
             salt_counts={(salt, model): retrieved} if retrieved else None, sampled=sampled)
    return {"retrieved_count": retrieved, "failed_count": wanted - retrieved}


@operation("end_session", ("request_id", p.REQUEST_ID, _REQUIRED), replies=("known",),
           events=(_CB_REQUEST_END, _MP_VLLM_END_SESSION, _MP_REQUEST_END))
def end_session(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """End a request: release its read locks and close its session, blend and L0 bookkeeping.
    ``known`` is false for a request id this process never saw."""
    return {"known": close_session(ctx, args["request_id"])}
