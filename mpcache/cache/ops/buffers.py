"""Registering client KV buffers: shared memory named after the client's pid, or CUDA IPC."""

from __future__ import annotations

from mpcache.cache import transfer
from mpcache.cache.buffers import Peer, SharedMemoryBuffer
from mpcache.cache.context import CacheContext
from mpcache.cache.ops.registry import Args, Reply, operation
from mpcache.contract import protocol as p
from mpcache.errors import LayoutMismatchError, RequestError
from mpcache.shm.segment import Segment

_REQUIRED = p.REQUIRED


@operation("register_buffer",
           ("shm_name", p.SHM_NAME, _REQUIRED), ("num_blocks", p.COUNT, _REQUIRED), ("block_bytes", p.BYTES, _REQUIRED),
           replies=("buffer_id",))
def register_buffer(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Attach a shared-memory buffer the client created (0600, named after its own pid) as
    ``num_blocks`` blocks of ``block_bytes``."""
    name, num_blocks, block_bytes = args["shm_name"], args["num_blocks"], args["block_bytes"]
    match = p.KV_SHM_NAME.match(name)
    if match is None or int(match.group(1)) != peer.pid:
        raise RequestError(f"shm_name: {name} is not named after the client's pid {peer.pid}")
    if name in ctx.config.all_segment_names():
        raise RequestError(f"shm_name: {name} is not a client buffer")
    peer.check_room(num_blocks, block_bytes, ctx.chunk_bytes)
    try:
        segment = Segment.attach(name, num_blocks * block_bytes)
    except LayoutMismatchError as exc:
        raise RequestError(f"shm_name: {exc}") from None
    except OSError as exc:
        raise RequestError(f"shm_name: cannot attach {name}: {exc.strerror}") from None
    buffer_id = ctx.new_buffer_id()
    peer.buffers[buffer_id] = SharedMemoryBuffer(segment, num_blocks, block_bytes)
    return {"buffer_id": buffer_id}


@operation("unregister_buffer", ("buffer_id", p.ID, _REQUIRED))
def unregister_buffer(ctx: CacheContext, peer: Peer, args: Args) -> Reply:
    """Detach a buffer this connection registered (shared memory or CUDA)."""
    buffer = peer.buffers.pop(args["buffer_id"], None)
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
    peer.buffers[buffer_id] = buffer
    return {"buffer_id": buffer_id, "device": buffer.transfer.device}
