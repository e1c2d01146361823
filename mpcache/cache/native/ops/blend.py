"""The cache-blending operations ``cb_store_pre_computed``, ``cb_store_final``, ``cb_lookup`` and
``cb_retrieve``; their state and logic are :class:`mpcache.cache.blend.BlendState`'s.
"""

from __future__ import annotations

from mpcache.cache.buffers import Peer
from mpcache.cache.context import CacheContext
from mpcache.cache.native.ops.registry import Args, Reply, operation
from mpcache.contract import protocol as p
from mpcache.contract.events import EventType as E

_REQUIRED = p.REQUIRED
_STORE_FIELDS = (("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED),
                 ("model_name", p.MODEL, _REQUIRED), ("cache_salt", p.SALT, ""), ("tokens", p.TOKENS, _REQUIRED),
                 ("block_ids", p.OPTIONAL_BLOCK_IDS, _REQUIRED), ("engine_id", p.ENGINE, 0))
_STORE_REPLIES = ("stored_count", "skipped_count", "failed_count", "registered_count", "replaced_count")


def _store_events(start: E, end: E) -> tuple[E, ...]:
    return (E.CB_REQUEST_START, start, E.SM_WRITE_FINISHED, E.CB_FINGERPRINTS_REGISTERED, E.CB_CHUNKS_EVICTED, end)


@operation("cb_store_pre_computed", *_STORE_FIELDS, replies=_STORE_REPLIES,
           events=_store_events(E.CB_STORE_PRE_COMPUTED_START, E.CB_STORE_PRE_COMPUTED_END))
def cb_store_pre_computed(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Store chunks computed without their context (block ``block_ids[i]`` holds whole chunk i of
    ``tokens``) under their position-independent fingerprints, and index those."""
    return ctx.blend.store(peer, args, final=False)


@operation("cb_store_final", *_STORE_FIELDS, replies=_STORE_REPLIES,
           events=_store_events(E.CB_STORE_FINAL_START, E.CB_STORE_FINAL_END))
def cb_store_final(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Store a finished request's whole chunks under their prefix-chained keys and index their
    fingerprints (an entry whose object is gone is replaced: ``replaced_count``)."""
    return ctx.blend.store(peer, args, final=True)


@operation("cb_lookup",
           ("request_id", p.REQUEST_ID, _REQUIRED), ("model_name", p.MODEL, _REQUIRED), ("cache_salt", p.SALT, ""),
           ("tokens", p.TOKENS, _REQUIRED),
           replies=("lookup_id", "no_gpu_context", "chunks", "requested_tokens", "hit_tokens", "prefix_hits",
                    "fingerprint_hits", "storage_hits", "stale_chunks"),
           events=(E.CB_REQUEST_START, E.CB_LOOKUP_START, E.CB_CHUNKS_EVICTED, E.CB_LOOKUP_END))
def cb_lookup(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Classify each whole chunk of ``tokens`` (``chunks``, `mpcache.contract.blending`): a prefix hit, a
    fingerprint hit confirmed in L1, stale (the fingerprint's object is gone: the entry is dropped) or a
    miss.  ``lookup_id`` is nil without hits; ``no_gpu_context`` is true for a connection without a buffer."""
    return ctx.blend.lookup(peer, args)


@operation("cb_retrieve",
           ("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED), ("lookup_id", p.ID, _REQUIRED),
           ("chunk_indices", p.CHUNK_INDICES, _REQUIRED), ("block_ids", p.OPTIONAL_BLOCK_IDS, _REQUIRED),
           ("engine_id", p.ENGINE, 0), ("worker_id", p.WORKER_ID, -1),
           replies=("retrieved_count", "failed_count"),
           events=(E.CB_REQUEST_START, E.CB_RETRIEVE_START, E.SM_READ_PREFETCHED_FINISHED, E.CB_RETRIEVE_END))
def cb_retrieve(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Copy hit chunk ``chunk_indices[i]`` of a ``cb_lookup`` into block ``block_ids[i]``; hits evicted
    since the lookup fail."""
    return ctx.blend.retrieve(peer, args)
