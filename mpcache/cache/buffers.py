"""Client KV buffers a cache process attached: per peer, by id, with the limits every buffer respects."""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from typing import Protocol

import numpy as np

from mpcache.cache import transfer
from mpcache.errors import RequestError
from mpcache.shm.segment import Segment

MAX_BUFFERS_PER_PEER = 64
MAX_BUFFER_BYTES = 1 << 40
_KINDS = ((stat.S_ISSOCK, "a socket"), (stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


class Buffer(Protocol):
    """A registered buffer the operations copy through (shared memory here, CUDA in transfer)."""

    num_blocks: int
    block_bytes: int
    transfer: transfer.Transfer

    def close(self) -> None: ...


class SharedMemoryBuffer:
    """A client's KV buffer, a memfd sealed against shrinking (:mod:`mpcache.shm.memfd`), mapped here: the
    seal is what makes the mapping safe, since pages the client could cut off would fault this process."""

    __slots__ = ("segment", "blocks", "num_blocks", "block_bytes", "transfer")

    def __init__(self, fd: int, num_blocks: int, block_bytes: int) -> None:
        """Map ``num_blocks × block_bytes`` of ``fd`` (the mapping keeps what it needs; the caller closes
        ``fd``); RequestError (one line) for a descriptor that is not a sealed memfd that large."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        needed = num_blocks * block_bytes
        check_sealed(fd, needed)
        try:
            mapping = mmap.mmap(fd, needed)
        except OSError as exc:
            raise RequestError(f"register_buffer: cannot map the memfd: {exc.strerror}") from None
        self.segment = Segment("memfd", mapping)
        self.blocks: np.ndarray | None = np.ndarray((num_blocks, block_bytes), dtype=np.uint8,
                                                    buffer=self.segment.buf)
        self.transfer: transfer.Transfer = transfer.CpuTransfer(self.blocks)

    def close(self) -> None:
        self.blocks, self.transfer = None, transfer.CLOSED  # drop the views, so that the mapping can go
        self.segment.close()


def check_sealed(fd: int, needed: int) -> None:
    """RequestError unless ``fd`` is a memfd (a regular file that takes seals) sealed against shrinking and
    at least ``needed`` bytes long."""
    info = os.fstat(fd)
    mode = info.st_mode
    for test, kind in _KINDS:
        if test(mode):
            raise RequestError(f"register_buffer: the descriptor is {kind}, not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = None
    if not stat.S_ISREG(mode) or seals is None:
        raise RequestError("register_buffer: the descriptor is not a memfd (it takes no seals)")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RequestError("register_buffer: the memfd is not sealed against shrinking (F_SEAL_SHRINK)")
    if info.st_size < needed:
        raise RequestError(f"register_buffer: the memfd is {info.st_size} bytes, num_blocks × block_bytes is "
                           f"{needed}")


def close_segment(segment: Segment) -> None:
    """Close a mapping; one whose views are still referenced goes with its last view."""
    try:
        segment.close()
    except BufferError:
        pass


class Peer:
    """One connected client: its buffers."""

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: dict[int, Buffer] = {}

    def buffer(self, buffer_id: int, block_ids: list[int]) -> Buffer:
        """The buffer ``buffer_id``, checked to hold every block of ``block_ids``."""
        buffer = self.known_buffer(buffer_id)
        highest = max(block_ids)
        if highest >= buffer.num_blocks:
            raise RequestError(f"block_ids: block {highest} is outside the buffer's {buffer.num_blocks} blocks")
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
