"""The cache-blending operations: cb_store_pre_computed, cb_store_final, cb_lookup, cb_retrieve.

Their logic and state live in :class:`mpcache.cache.blend.BlendState`; ``tokens`` are the request's
token ids, ``block_ids`` one block per whole chunk (stores) or per retrieved chunk (cb_retrieve,
with ``chunk_indices`` into the lookup's chunks).
"""

from __future__ import annotations

from mpcache.cache.buffers import Peer
from mpcache.cache.context import CacheContext
from mpcache.cache.ops.registry import Args, Reply, operation
from mpcache.contract import protocol as p

_REQUIRED = p.REQUIRED
_STORE_FIELDS = (("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED),
                 ("model_name", p.MODEL, _REQUIRED), ("cache_salt", p.SALT, ""), ("tokens", p.TOKENS, _REQUIRED),
                 ("block_ids", p.OPTIONAL_BLOCK_IDS, _REQUIRED), ("engine_id", p.ENGINE, 0))
_STORE_REPLIES = ("stored_count", "skipped_count", "failed_count", "registered_count", "replaced_count")


@operation("cb_store_pre_computed", *_STORE_FIELDS, replies=_STORE_REPLIES)
def cb_store_pre_computed(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Store chunks computed without context under their position-independent fingerprints."""
    return ctx.blend.store(peer, args, final=False)


@operation("cb_store_final", *_STORE_FIELDS, replies=_STORE_REPLIES)
def cb_store_final(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Store a finished request's chunks under their prefix-chained keys and index their fingerprints."""
    return ctx.blend.store(peer, args, final=True)


@operation("cb_lookup",
           ("request_id", p.REQUEST_ID, _REQUIRED), ("model_name", p.MODEL, _REQUIRED), ("cache_salt", p.SALT, ""),
           ("tokens", p.TOKENS, _REQUIRED),
           replies=("lookup_id", "no_gpu_context", "chunks", "requested_tokens", "hit_tokens", "prefix_hits",
                    "fingerprint_hits", "storage_hits", "stale_chunks"))
def cb_lookup(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Classify each chunk: prefix hit, fingerprint hit confirmed in L1, stale, or miss."""
    return ctx.blend.lookup(peer, args)


@operation("cb_retrieve",
           ("buffer_id", p.ID, _REQUIRED), ("request_id", p.REQUEST_ID, _REQUIRED), ("lookup_id", p.ID, _REQUIRED),
           ("chunk_indices", p.CHUNK_INDICES, _REQUIRED), ("block_ids", p.OPTIONAL_BLOCK_IDS, _REQUIRED),
           ("engine_id", p.ENGINE, 0), ("worker_id", p.WORKER_ID, -1),
           replies=("retrieved_count", "failed_count"))
def cb_retrieve(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Copy hit chunks of a cb_lookup into blocks of a registered buffer."""
    return ctx.blend.retrieve(peer, args)
