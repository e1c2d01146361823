"""Operations about the process and the engine's scheduler: ping, report_block_allocations."""

from __future__ import annotations

import os

from mpcache.cache.buffers import Peer
from mpcache.cache.context import CacheContext
from mpcache.cache.native.ops.registry import Args, Reply, operation
from mpcache.contract import protocol as p
from mpcache.contract.events import EventType

_REQUIRED = p.REQUIRED


@operation("ping", replies=("pid", "worker"))
def ping(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Liveness: this cache process's pid and worker index."""
    return {"pid": os.getpid(), "worker": ctx.worker}


@operation("report_block_allocations",
           ("instance_id", p.ENGINE, _REQUIRED), ("model_name", p.MODEL, _REQUIRED),
           ("records", p.BLOCK_RECORDS, _REQUIRED),
           replies=("record_count", "block_count", "sampled_count", "event_count"),
           events=(EventType.MP_VLLM_BLOCK_ALLOCATION,))
def report_block_allocations(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """A scheduler step's newly allocated GPU KV (L0) blocks, for L0 shadow monitoring.  A record's tokens
    are split evenly over its new blocks (the last takes the remainder); blocks are sampled on
    (instance_id, block_id).  End each request on the same cache process."""
    return ctx.l0.report(args["instance_id"], args["model_name"], args["records"])
