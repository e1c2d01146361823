"""The client's registered KV buffers: the interface every kind offers, and the shared-memory kind (a
sealed memfd, :mod:`mpcache.shm.memfd`)."""

from __future__ import annotations

import mmap
import os
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from mpcache.shm import memfd
from mpcache.shm.segment import Segment

_B = TypeVar("_B", bound="RegisteredBuffer")


class BufferOwner(Protocol):
    """What a buffer needs of the client it is registered with (:class:`~mpcache.client.core.CacheClient`):
    a request, and its own unregistration."""

    def call(self, op: str, **args: Any) -> dict[str, Any]: ...

    def unregister_buffer(self, buffer: RegisteredBuffer) -> None: ...


@runtime_checkable
class BlockBuffer(Protocol):
    """What the client's calls accept as a KV buffer: shared memory (:class:`KVBuffer`) or GPU memory
    (:class:`~mpcache.client.cuda.CudaKVBuffer`).  ``blocks[i]`` is block i, ``block_bytes`` long
    (None once closed)."""

    buffer_id: int
    num_blocks: int
    block_bytes: int
    blocks: Any

    def close(self) -> None: ...


class RegisteredBuffer:
    """What every registered KV buffer shares: :meth:`close` (or leaving a ``with`` block)
    unregisters it once; the client then calls its ``_release``."""

    _client: BufferOwner
    buffer_id: int
    num_blocks: int
    block_bytes: int
    blocks: Any

    def close(self) -> None:
        """Unregister from the server and free the buffer (idempotent)."""
        if self.blocks is not None:
            self._client.unregister_buffer(self)

    def _registration(self) -> tuple[str, dict[str, Any], list[int]]:
        """The request that registers this buffer with a cache process, and the descriptors sent with it
        (sent again after a reconnect)."""
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVBuffer(RegisteredBuffer):
    """A registered shared-memory KV buffer: ``blocks[i]`` is block i (``block_bytes`` uint8).

    The memory is a memfd sealed against shrinking (``fd``, named ``name`` in ``/proc/<pid>/maps``), sent to
    the cache process with each registration.  :meth:`close` (or leaving a ``with`` block) unregisters it
    and frees it; closing its client does the same for every buffer left, and so does this process's exit.
    """

    def __init__(self, client: BufferOwner, name: str, num_blocks: int, block_bytes: int) -> None:
        self._client = client
        self.name = name
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.buffer_id = -1  # until registered
        size = num_blocks * block_bytes
        self.fd = memfd.create_sealed(name, size)
        try:
            self.segment = Segment(name, mmap.mmap(self.fd, size))
        except BaseException:
            os.close(self.fd)
            raise
        self.blocks = np.ndarray((num_blocks, block_bytes), dtype=np.uint8, buffer=self.segment.buf)

    def _registration(self) -> tuple[str, dict[str, Any], list[int]]:
        return "register_buffer", {"num_blocks": self.num_blocks, "block_bytes": self.block_bytes}, [self.fd]

    def _release(self) -> None:
        """Close the descriptor and drop this process's mapping (if no view of it is still held; the memory
        goes with the last descriptor or mapping of it, here or in the cache process)."""
        if self.fd < 0:
            return
        self.blocks = None
        os.close(self.fd)
        self.fd = -1
        self.segment.close()
