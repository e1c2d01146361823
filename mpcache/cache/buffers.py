"""Client KV buffers a cache process attached: per peer, by id, with the limits every buffer respects."""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from mpcache.cache import transfer
from mpcache.errors import RequestError
from mpcache.shm.segment import SHM_DIR, Segment

MAX_BUFFERS_PER_PEER = 64
MAX_BUFFER_BYTES = 1 << 40


class Buffer(Protocol):
    """A registered buffer the operations copy through (shared memory here, CUDA in transfer)."""

    num_blocks: int
    block_bytes: int
    transfer: transfer.Transfer

    def check_intact(self) -> None: ...

    def close(self) -> None: ...


class SharedMemoryBuffer:
    """A client's shared-memory KV buffer, attached by name."""

    __slots__ = ("segment", "blocks", "num_blocks", "block_bytes", "path", "needed", "transfer")

    def __init__(self, segment: Segment, num_blocks: int, block_bytes: int) -> None:
        self.segment = segment
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.needed = num_blocks * block_bytes
        self.blocks: np.ndarray | None = np.ndarray((num_blocks, block_bytes), dtype=np.uint8, buffer=segment.buf)
        self.path = os.path.join(SHM_DIR, segment.name.lstrip("/"))
        self.transfer: transfer.Transfer = transfer.CpuTransfer(self.blocks)

    def check_intact(self) -> None:
        """Refuse a buffer whose object was removed or shrunk since registration (the
        mapping of a shrunk object would fault on access)."""
        try:
            size = os.stat(self.path).st_size
        except OSError:
            raise RequestError(f"buffer {self.segment.name} no longer exists") from None
        if size < self.needed:
            raise RequestError(f"buffer {self.segment.name} shrank to {size} bytes, needs {self.needed}")

    def close(self) -> None:
        self.blocks, self.transfer = None, transfer.CLOSED  # drop the views, so that the mapping can go
        close_segment(self.segment)


def close_segment(segment: Segment) -> None:
    """Close a mapping; one whose views are still referenced goes with its last view."""
    try:
        segment.close()
    except BufferError:
        pass


class Peer:
    """One connected client: its process id (from the socket's credentials) and its buffers."""

    __slots__ = ("pid", "buffers")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.buffers: dict[int, Buffer] = {}

    def buffer(self, buffer_id: int, block_ids: list[int]) -> Buffer:
        """The buffer ``buffer_id``, checked to hold every block of ``block_ids`` and to be intact."""
        buffer = self.known_buffer(buffer_id)
        highest = max(block_ids)
        if highest >= buffer.num_blocks:
            raise RequestError(f"block_ids: block {highest} is outside the buffer's {buffer.num_blocks} blocks")
        buffer.check_intact()
        return buffer

    def known_buffer(self, buffer_id: int) -> Buffer:
        buffer = self.buffers.get(buffer_id)
        if buffer is None:
            raise RequestError(f"buffer_id: unknown buffer {buffer_id} on this connection")
        return buffer

    def check_room(self, num_blocks: int, block_bytes: int, chunk_bytes: int) -> None:
        """What every registered buffer, shared memory or CUDA, must respect."""
        if block_bytes > chunk_bytes:
            raise RequestError(f"block_bytes: {block_bytes} is larger than the chunk size {chunk_bytes}")
        if num_blocks * block_bytes > MAX_BUFFER_BYTES:
            raise RequestError(f"num_blocks × block_bytes is larger than {MAX_BUFFER_BYTES} bytes")
        if len(self.buffers) >= MAX_BUFFERS_PER_PEER:
            raise RequestError(f"at most {MAX_BUFFERS_PER_PEER} buffers per connection")

    def close(self) -> None:
        for buffer in self.buffers.values():
            buffer.close()
        self.buffers.clear()
