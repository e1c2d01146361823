"""The client's registered KV buffers: the interface every kind offers, and the shared-memory kind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from mpcache.shm.segment import Segment

if TYPE_CHECKING:
    from mpcache.client.core import CacheClient

_B = TypeVar("_B", bound="RegisteredBuffer")


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

    _client: CacheClient
    buffer_id: int
    num_blocks: int
    block_bytes: int
    blocks: Any

    def close(self) -> None:
        """Unregister from the server and free the buffer (idempotent)."""
        if self.blocks is not None:
            self._client.unregister_buffer(self)

    def _registration(self) -> tuple[str, dict[str, Any]]:
        """The request that registers this buffer with a cache process (sent again after a reconnect)."""
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVBuffer(RegisteredBuffer):
    """A registered shared-memory KV buffer: ``blocks[i]`` is block i (``block_bytes`` uint8).

    :meth:`close` (or leaving a ``with`` block) unregisters it and removes the
    shared-memory object; closing its client does the same for every buffer left.
    """

    def __init__(self, client: CacheClient, segment: Segment, buffer_id: int, num_blocks: int,
                 block_bytes: int) -> None:
        self._client = client
        self.segment = segment
        self.name = segment.name
        self.buffer_id = buffer_id
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.blocks = np.ndarray((num_blocks, block_bytes), dtype=np.uint8, buffer=segment.buf)

    def _registration(self) -> tuple[str, dict[str, Any]]:
        return "register_buffer", {"shm_name": self.name, "num_blocks": self.num_blocks,
                                   "block_bytes": self.block_bytes}

    def _release(self) -> None:
        """Unlink the object and drop this process's mapping (if no view of it is still held)."""
        self.blocks = None
        Segment.unlink(self.name)
        try:
            self.segment.close()
        except BufferError:  # the caller still holds a view; the mapping goes when it does
            pass
