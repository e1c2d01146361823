"""What every operation works on: L1, L2, sessions, the publisher, the clocks; front ends hand it and the
calling peer to operations, which know nothing about sockets or frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpcache.cache.blend import BlendState
from mpcache.cache.l0 import BlockReporter
from mpcache.cache.l1 import L1Manager
from mpcache.cache.mrc.accesses import AccessSampler
from mpcache.cache.prefetch import PrefetchController
from mpcache.cache.sessions import SessionRegistry
from mpcache.cache.storage import StorageManager
from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.publish import EventPublisher


@dataclass(eq=False)
class CacheContext:
    """One cache process's state, shared by its front ends (single-threaded: no locks)."""

    config: Config
    worker: int
    log: Any  # a structlog logger
    publisher: EventPublisher
    l1: L1Manager
    gauges: GaugeSlot
    storage: StorageManager
    prefetch: PrefetchController
    sessions: SessionRegistry
    l0: BlockReporter
    blend: BlendState
    accesses: AccessSampler
    clock: Callable[[], float] = time.monotonic
    clock_ns: Callable[[], int] = time.time_ns
    _next_buffer_id: int = field(default=1, repr=False)
    _refused_shown: int = field(default=0, repr=False)  # the L1 refusals added to the gauge board so far
    _gauged: tuple[Any, ...] = field(default=(), repr=False)  # what update_gauges last wrote its gauges from

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_size_tokens

    @property
    def chunk_bytes(self) -> int:
        return self.config.chunk_bytes

    def new_buffer_id(self) -> int:
        """Buffer ids are unique per process, so a stale id from another connection never matches."""
        buffer_id = self._next_buffer_id
        self._next_buffer_id += 1
        return buffer_id

    def update_gauges(self, rewrite: bool = False) -> None:
        """L1's and the prefetch gauges, written again where what they show moved since the last call: it comes
        after every operation, and most move none of them (a lookup, a poll), so it compares first.  ``rewrite``:
        written whatever moved (the loop's timer, so that words the supervisor restored, or anyone overwrote, show
        the truth again within an eviction interval)."""
        l1 = self.l1
        allocator = l1.allocator
        now = (allocator.used_bytes, allocator.carved_bytes, l1.lost_copies, l1.admission_chance, l1.refused_chunks,
               self.sessions.active_jobs)  # (L1's capacity, which the admitting gauge also reads, never changes)
        if now == self._gauged and not rewrite:
            return
        self._gauged = now
        used, _, lost, chance, refused_total, jobs = now
        self.gauges.set(layout.G_L1_USED, used)
        self.gauges.set(layout.G_L1_FRAGMENTATION, l1.fragmentation_bytes)
        self.gauges.set(layout.G_L1_LOST_COPIES, lost)
        self.gauges.set(layout.G_L1_ADMITTING, round(l1.capacity_bytes * chance))
        refused = refused_total - self._refused_shown
        if refused:  # added: the word keeps the counts of this slot's earlier cache processes
            self.gauges.add(layout.G_L1_REFUSED, refused)
            self._refused_shown += refused
        self.gauges.set(layout.G_ACTIVE_PREFETCH, jobs)
