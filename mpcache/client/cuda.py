"""A client KV buffer in GPU memory, shared with the cache process by a CUDA IPC handle (needs cupy here and
a CUDA device on both sides; cupy is imported only when one is registered).
"""

from __future__ import annotations

from typing import Any

from mpcache.client.buffers import BufferOwner, RegisteredBuffer


class CudaKVBuffer(RegisteredBuffer):
    """A registered GPU KV buffer: ``blocks[i]`` is block i (a cupy uint8 array of ``block_bytes``).

    :meth:`close` unregisters it (the server closes its IPC mapping) and then frees the memory.
    """

    def __init__(self, client: BufferOwner, memory, buffer_id: int, num_blocks: int, block_bytes: int,
                 device_index: int, device: str) -> None:
        import cupy

        self._client = client
        self._memory = memory
        self.buffer_id = buffer_id
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.device_index = device_index
        self.device = device  # as the server names it, e.g. "cuda:0"
        self.blocks = cupy.ndarray((num_blocks, block_bytes), dtype=cupy.uint8,
                                   memptr=cupy.cuda.MemoryPointer(memory, 0))

    def _registration(self) -> tuple[str, dict[str, Any], list[int]]:
        import cupy

        with cupy.cuda.Device(self.device_index):
            handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        return "register_cuda_buffer", {"ipc_handle": bytes(handle).hex(), "device_index": self.device_index,
                                        "num_blocks": self.num_blocks, "block_bytes": self.block_bytes}, []

    def _release(self) -> None:
        self.blocks = None
        self._memory = None  # freed when the last view of it goes


def register_cuda_buffer(client: BufferOwner, num_blocks: int, block_bytes: int,
                         device_index: int = 0) -> CudaKVBuffer:
    """Allocate ``num_blocks × block_bytes`` on ``cuda:device_index`` and register it with the server."""
    try:
        import cupy
    except ImportError:
        raise RuntimeError("register_cuda_buffer needs cupy (pip install 'mpcache[gpu]')") from None
    if num_blocks < 1 or block_bytes < 1:
        raise ValueError(f"num_blocks and block_bytes must be >= 1, got {num_blocks} and {block_bytes}")
    with cupy.cuda.Device(device_index):
        memory = cupy.cuda.Memory(num_blocks * block_bytes)  # cudaMalloc: the buffer starts its allocation
        handle = cupy.cuda.runtime.ipcGetMemHandle(memory.ptr)
    reply = client.call("register_cuda_buffer", ipc_handle=bytes(handle).hex(), device_index=device_index,
                        num_blocks=num_blocks, block_bytes=block_bytes)
    return CudaKVBuffer(client, memory, reply["buffer_id"], num_blocks, block_bytes, device_index, reply["device"])
