"""Registering client KV buffers: a sealed memfd sent with the request, or CUDA IPC."""

from __future__ import annotations

from mpcache.cache import transfer
from mpcache.cache.buffers import Peer, SharedMemoryBuffer
from mpcache.cache.context import CacheContext
from mpcache.cache.native.ops.registry import Args, Reply, operation
from mpcache.contract import protocol as p
from mpcache.errors import RequestError

_REQUIRED = p.REQUIRED


@operation("register_buffer", ("num_blocks", p.COUNT, _REQUIRED), ("block_bytes", p.BYTES, _REQUIRED),
           replies=("buffer_id",), descriptor=True)
def register_buffer(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Map the client's buffer, a memfd sealed against shrinking whose descriptor comes with the request, as
    ``num_blocks`` blocks of ``block_bytes``.  A descriptor that is not a memfd, not sealed with
    F_SEAL_SHRINK or smaller than the buffer is refused, and so is a buffer past the connection's budget or the
    cache process's (every connection's buffers together), counted in ``mpcache_buffers_refused_total``."""
    num_blocks, block_bytes = args["num_blocks"], args["block_bytes"]
    peer.check_room(num_blocks, block_bytes, ctx.chunk_bytes)
    buffer = SharedMemoryBuffer(args["fd"], num_blocks, block_bytes)
    buffer_id = ctx.new_buffer_id()
    peer.add(buffer_id, buffer)
    return {"buffer_id": buffer_id}


@operation("unregister_buffer", ("buffer_id", p.ID, _REQUIRED))
def unregister_buffer(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Detach a buffer this connection registered (shared memory or CUDA)."""
    buffer = peer.remove(args["buffer_id"])
    if buffer is None:
        raise RequestError(f"buffer_id: unknown buffer {args['buffer_id']} on this connection")
    buffer.close()
    return {}


@operation("register_cuda_buffer",
           ("ipc_handle", p.IPC_HANDLE, _REQUIRED), ("device_index", p.DEVICE_INDEX, _REQUIRED),
           ("num_blocks", p.COUNT, _REQUIRED), ("block_bytes", p.BYTES, _REQUIRED),
           replies=("buffer_id", "device"))
def register_cuda_buffer(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Open a client's GPU buffer from its CUDA IPC handle; copies then run on this process's own CUDA
    stream.  Refused by a cache process without cupy or a CUDA device."""
    num_blocks, block_bytes = args["num_blocks"], args["block_bytes"]
    peer.check_room(num_blocks, block_bytes, ctx.chunk_bytes)
    buffer = transfer.open_cuda_buffer(args["ipc_handle"], args["device_index"], num_blocks, block_bytes,
                                       clock_ns=ctx.clock_ns)
    buffer_id = ctx.new_buffer_id()
    peer.add(buffer_id, buffer)
    return {"buffer_id": buffer_id, "device": buffer.transfer.device}
