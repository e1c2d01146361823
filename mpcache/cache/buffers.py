"""Client KV buffers a cache process attached: per peer, by id, with the limits every buffer respects."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable
from typing import NoReturn, Protocol

import numpy as np

from mpcache.cache import transfer
from mpcache.errors import RequestError
from mpcache.shm import fdless
from mpcache.shm.segment import Segment

MAX_BUFFERS_PER_PEER = 64
MAX_BUFFER_BYTES = 1 << 40
MAX_PEER_BYTES = 1 << 40  # one connection's buffers together
MAX_BUFFERS = 4096  # a cache process's buffers, every connection's together: each is a mapping (vm.max_map_count)
MAX_BYTES = 16 << 40  # and their bytes: an eighth of x86-64's 128 TiB of user address space
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
    seal is what makes the mapping safe, since pages the client could cut off would fault this process.  The
    mapping keeps no descriptor (:mod:`mpcache.shm.fdless`)."""

    __slots__ = ("blocks", "num_blocks", "block_bytes", "transfer")

    def __init__(self, fd: int, num_blocks: int, block_bytes: int) -> None:
        """Map ``num_blocks × block_bytes`` of ``fd`` (the caller closes ``fd``); RequestError (one line) for a
        descriptor that is not a sealed memfd that large."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        needed = num_blocks * block_bytes
        check_sealed(fd, needed)
        try:
            mapping = fdless.map_shared(fd, needed)
        except OSError as exc:
            raise RequestError(f"register_buffer: cannot map the memfd: {exc.strerror}") from None
        self.blocks: np.ndarray | None = mapping.reshape(num_blocks, block_bytes)
        self.transfer: transfer.Transfer = transfer.CpuTransfer(self.blocks)

    def close(self) -> None:
        """Drop this buffer's views: the mapping goes with the last of them."""
        self.blocks, self.transfer = None, transfer.CLOSED


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


class BufferBudget:
    """What the buffers of every connection of a cache process may hold together (``MAX_BUFFERS`` mappings of
    ``MAX_BYTES``), and how many registrations a budget refused."""

    __slots__ = ("count", "nbytes", "refused", "_on_refused")

    def __init__(self, on_refused: Callable[[], None] = lambda: None) -> None:
        self.count = 0
        self.nbytes = 0
        self.refused = 0
        self._on_refused = on_refused

    def refuse(self, message: str) -> NoReturn:
        self.refused += 1
        self._on_refused()
        raise RequestError(message)


class Peer:
    """One connected client: its buffers, charged to its own budget and to the process's."""

    __slots__ = ("buffers", "budget", "nbytes", "_sizes")

    def __init__(self, budget: BufferBudget | None = None) -> None:
        self.buffers: dict[int, Buffer] = {}
        self.budget = BufferBudget() if budget is None else budget
        self.nbytes = 0
        self._sizes: dict[int, int] = {}

    def add(self, buffer_id: int, buffer: Buffer) -> None:
        """Keep a buffer :meth:`check_room` made room for."""
        size = buffer.num_blocks * buffer.block_bytes
        self.buffers[buffer_id] = buffer
        self._sizes[buffer_id] = size
        self.nbytes += size
        self.budget.count += 1
        self.budget.nbytes += size

    def remove(self, buffer_id: int) -> Buffer | None:
        """Forget a buffer (the caller closes it); None when this connection has none of that id."""
        buffer = self.buffers.pop(buffer_id, None)
        if buffer is not None:
            size = self._sizes.pop(buffer_id)
            self.nbytes -= size
            self.budget.count -= 1
            self.budget.nbytes -= size
        return buffer

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
        size, budget = num_blocks * block_bytes, self.budget
        if len(self.buffers) >= MAX_BUFFERS_PER_PEER:
            budget.refuse(f"at most {MAX_BUFFERS_PER_PEER} buffers per connection: unregister one first")
        if self.nbytes + size > MAX_PEER_BYTES:
            budget.refuse(f"a connection's buffers hold at most {MAX_PEER_BYTES >> 30} GiB together, "
                          f"{self.nbytes >> 20} MiB are registered: unregister one first")
        if budget.count >= MAX_BUFFERS or budget.nbytes + size > MAX_BYTES:
            budget.refuse(f"this cache process holds its most buffers ({MAX_BUFFERS}, {MAX_BYTES >> 40} TiB "
                          "together, every connection's): unregister buffers, or use another worker")

    def close(self) -> None:
        for buffer_id in list(self.buffers):
            buffer = self.remove(buffer_id)
            if buffer is not None:
                buffer.close()
