"""A cache process: attaches its shared memory, builds the cache context, runs its front end and timers on
one selectors loop (so neither L1 nor the ring needs a lock), and stops when orphaned.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from mpcache.cache.blend import BlendState
from mpcache.cache.buffers import BufferBudget, close_segment
from mpcache.cache.context import CacheContext
from mpcache.cache.kvlog import KVEventLog
from mpcache.cache.l0 import BlockReporter
from mpcache.cache.l1 import L1Manager
from mpcache.cache.mrc.accesses import AccessSampler
from mpcache.cache.native.dispatch import Dispatcher
from mpcache.cache.native.ops import OPERATIONS
from mpcache.cache.native.transport import MAX_CONNECTIONS, PARTIAL_FRAME_TIMEOUT_S, UnixTransport
from mpcache.cache.prefetch import PrefetchController
from mpcache.cache.sessions import SessionRegistry
from mpcache.cache.slabs import smallest_spot
from mpcache.cache.storage import StorageManager, build_adapters
from mpcache.config import Config
from mpcache.errors import ConfigError
from mpcache.parentage import supervisor_gone
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.intern import Interner, reclaim_if_drained
from mpcache.shm.publish import EventPublisher, Publisher
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import Segment
from mpcache.shm.shrink_guard import ShrinkGuard

if TYPE_CHECKING:
    from mpcache.cache.lmcache.frontend import LMCacheFrontEnd

# A publisher other than the ring's (the benchmarks' in-process reference): (publisher, stop).
PublisherFactory = Callable[[], tuple[EventPublisher, Callable[[], None]]]


class CacheProcess:
    """One cache process's state and loop.  Construct (attaches and listens), then :meth:`run`."""

    def __init__(
        self,
        config: Config,
        worker: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        clock_ns: Callable[[], int] = time.time_ns,
        job_ttl_s: float = 60.0,
        max_jobs: int = 4096,
        max_job_hashes: int = 1 << 20,
        max_sessions: int = 65536,
        heartbeat_interval_s: float = 0.5,
        parent_pid: int | None = None,
        publisher_factory: PublisherFactory | None = None,
        max_connections: int = MAX_CONNECTIONS,
        partial_frame_timeout_s: float = PARTIAL_FRAME_TIMEOUT_S,
        logger: Any = None,
    ) -> None:
        if not 0 <= worker < config.workers:
            raise ConfigError(f"--worker: expected 0..{config.workers - 1}, got {worker}")
        self.config = config
        self.worker = worker
        self.log = logger if logger is not None else structlog.get_logger("mpcache.cache")
        self._heartbeat_interval_s = min(heartbeat_interval_s, 1.0)
        self._parent_pid = parent_pid  # stop when reparented: the supervisor is gone
        self._stopping = False
        self._closed = False
        self._stop_publisher: Callable[[], None] | None = None
        self._segments: list[Segment] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self.ctx: CacheContext | None = None
        self._pool_guard: ShrinkGuard | None = None
        self._transport: UnixTransport | None = None
        self.lmcache: LMCacheFrontEnd | None = None
        try:
            self.ctx = self._build_context(clock, clock_ns, job_ttl_s, (max_jobs, max_job_hashes), max_sessions,
                                           publisher_factory)
            dispatcher = Dispatcher(self.ctx, OPERATIONS)
            gauges = self.ctx.gauges
            self._transport = UnixTransport(config.socket_path(worker), self._selector, dispatcher,
                                            dispatcher.client_error, self.log, lambda: self._stopping,
                                            max_connections=max_connections,
                                            partial_frame_timeout_s=partial_frame_timeout_s,
                                            idle_timeout_s=config.idle_timeout_s,
                                            budget=BufferBudget(lambda: gauges.add(layout.G_BUFFERS_REFUSED, 1)))
            urls = config.lmcache_urls(worker)
            if urls:
                from mpcache.cache.lmcache.frontend import LMCacheFrontEnd  # only where it is served

                self.lmcache = LMCacheFrontEnd(self.ctx, urls, self._selector)
        except BaseException:
            self.close()
            raise

    @property
    def socket_path(self) -> str:
        return self.config.socket_path(self.worker)

    @property
    def shed_connections(self) -> int:
        """Connections closed at accept (over the cap, or out of file descriptors)."""
        return self._transport.shed if self._transport is not None else 0

    @property
    def l1(self) -> L1Manager:
        assert self.ctx is not None
        return self.ctx.l1

    @property
    def storage(self) -> StorageManager:
        assert self.ctx is not None
        return self.ctx.storage

    # -- set-up and tear-down ---------------------------------------------------------

    def _attach(self, name: str, size: int, keep_fd: bool = False) -> Segment:
        segment = Segment.attach(name, size, keep_fd)
        self._segments.append(segment)
        return segment

    def _build_context(self, clock: Callable[[], float], clock_ns: Callable[[], int], job_ttl_s: float,
                       job_limits: tuple[int, int], max_sessions: int,
                       publisher_factory: PublisherFactory | None) -> CacheContext:
        config, worker = self.config, self.worker
        ring = self._attach(config.ring_name(worker), layout.HEADER_SIZE)
        publisher: EventPublisher
        if publisher_factory is not None:
            publisher, self._stop_publisher = publisher_factory()
        else:
            intern_capacity = read_geometry(ring).intern_capacity
            if reclaim_if_drained(ring.buf, intern_capacity):
                self.log.info("cache.names_reclaimed", capacity=intern_capacity)
            publisher = Publisher(RingWriter(ring), Interner(ring.buf, intern_capacity),
                                  threadsafe=False, clock_ns=clock_ns)
        pool_seg = self._attach(config.l1_pool_name(worker), config.l1_pool_bytes, keep_fd=True)
        pool = np.ndarray((config.l1_pool_bytes,), dtype=np.uint8, buffer=pool_seg.buf)
        self._pool_guard = guard = ShrinkGuard(pool_seg, pool)
        l1 = L1Manager(pool, publisher, config.metrics_sample_rate, config.chunk_bytes, policy=config.l1_policy,
                       first_sight=not config.l2,  # a store L1 refuses reaches no L2 tier either
                       min_spot=smallest_spot(config.chunk_bytes))
        l1.pool_faults = lambda: guard.faults
        if config.kv_event_log_size and config.lmcache_urls(worker):
            l1.feed = KVEventLog(config.kv_event_log_size)
        board = self._attach(config.gauge_board_name(), layout.gauge_board_size(config.workers))
        gauges = GaugeSlot(board, worker)
        gauges.set(layout.G_L1_CAPACITY, l1.capacity_bytes)
        gauges.set(layout.G_L1_USED, 0)
        gauges.set(layout.G_L1_FRAGMENTATION, 0)
        gauges.set(layout.G_L1_LOST_COPIES, 0)
        gauges.set(layout.G_L1_ADMITTING, l1.capacity_bytes)  # every store admitted, until adaptive's trial says
        gauges.set(layout.G_ACTIVE_PREFETCH, 0)
        gauges.heartbeat(os.getpid())
        sessions = SessionRegistry(l1, publisher, job_ttl_s=job_ttl_s, max_jobs=job_limits[0],
                                   max_job_hashes=job_limits[1], max_sessions=max_sessions,
                                   clock=clock)
        names = [config.l2_name(index) for index in range(len(config.l2))]
        storage = StorageManager(build_adapters(config, worker), names, publisher, gauges, self._wake, worker=worker,
                                 chunk_bytes=config.chunk_bytes, logger=self.log)
        storage.attach_feed(l1.feed)
        prefetch = PrefetchController(storage, l1, publisher, sessions.prefetch_finished)  # type: ignore[arg-type]
        blend = BlendState(l1, publisher, config.chunk_size_tokens,
                           table_capacity=max(1024, 4 * (config.l1_pool_bytes // config.chunk_bytes)))
        return CacheContext(config=config, worker=worker, log=self.log, publisher=publisher, l1=l1, gauges=gauges,
                            storage=storage, prefetch=prefetch, sessions=sessions,
                            l0=BlockReporter(publisher, config.metrics_sample_rate), blend=blend,
                            accesses=AccessSampler(publisher, config.mrc_sample_rate, config.mrc_exact_chunks),
                            clock=clock, clock_ns=clock_ns)

    def _pool_damaged(self, damage: str) -> None:
        """L1's pool was truncated by a peer and its size given back (by the fault handler, or by the heartbeat
        that found it short): its bytes are lost, so are L1's objects; counted and logged, and serving goes on."""
        ctx, guard = self.ctx, self._pool_guard
        assert ctx is not None and guard is not None
        guard.seen = guard.faults
        lost = ctx.l1.lose_all()
        ctx.gauges.add(layout.G_SEGMENTS_RECREATED, 1)
        ctx.update_gauges()
        self.log.error("segment.recreated", worker=self.worker, segment=guard.name, damage=damage, objects_lost=lost,
                       message="L1's shared-memory pool was truncated by a process sharing the IPC namespace: its "
                               "size was given back, and this cache process's L1 is lost")

    def _wake(self) -> None:
        """Make the loop's select return (any thread; L2 adapter threads call it when a task completes)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is already pending) or closed at shutdown
            pass

    def _on_wake(self, mask: int) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass
        ctx = self.ctx
        if ctx is not None and ctx.storage.has_completions:
            ctx.storage.poll()
            ctx.update_gauges()

    def stop(self) -> None:
        """Ask the loop to stop after the request in hand (safe from a signal handler or another thread)."""
        self._stopping = True
        self._wake()

    def close(self) -> None:
        """Stop accepting, drop every client, finish L2 work, zero the heartbeat, detach (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            self._transport.close()
        if self.lmcache is not None:
            self.lmcache.close()
            self.lmcache = None
        ctx = self.ctx
        if ctx is not None:
            if not ctx.storage.drain():  # finish in-flight L2 tasks (publishing their events), then close
                self.log.warning("l2.drain_timeout", inflight=ctx.storage.inflight)
            ctx.storage.close()
            ctx.sessions.close()
            ctx.gauges.set(layout.G_ACTIVE_PREFETCH, 0)
            ctx.gauges.set(layout.G_HEARTBEAT, 0)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._stop_publisher is not None:
            self._stop_publisher()
        self.ctx = None  # views into the segments must go before the mappings can be closed
        if self._pool_guard is not None:
            self._pool_guard.close()
        for segment in self._segments:
            close_segment(segment)
        self._segments.clear()

    # -- the loop ---------------------------------------------------------------------

    def run(self, install_signals: bool = False, freeze: bool = False) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT with ``install_signals``), then :meth:`close`.  ``freeze``:
        first move what start-up made out of the cyclic collector's reach (:func:`gc.freeze`: modules,
        configuration, the pool's bookkeeping live as long as the process, and every full collection would walk them
        on the data path, milliseconds at moments no request chooses); the process's entry point asks for it, an
        in-process harness shares its collector and does not."""
        if freeze:
            gc.collect()
            gc.freeze()
        if install_signals:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.stop())
            signal.signal(signal.SIGINT, lambda signum, frame: self.stop())
        ctx = self.ctx
        assert ctx is not None and self._transport is not None
        lmcache = self.lmcache
        self.log.info("cache.start", pid=os.getpid(), socket=self.socket_path, l1_bytes=ctx.l1.capacity_bytes,
                      slab_bytes=ctx.l1.allocator.slab_bytes, chunk_bytes=self.config.chunk_bytes,
                      lmcache_urls=lmcache.urls if lmcache else [], gc_frozen=gc.get_freeze_count())
        now = time.monotonic()
        next_evict = now + self.config.eviction_interval_s
        next_beat = now + self._heartbeat_interval_s
        admitting = ctx.l1.admission  # logged on each change: an operator sees when L1 refuses by chance or floor
        select = self._selector.select
        guard = self._pool_guard
        assert guard is not None
        try:
            while not self._stopping:
                wake_at = min(next_evict, next_beat)
                if lmcache is not None:
                    wake_at = min(wake_at, lmcache.next_deadline() or wake_at)
                for key, mask in select(max(0.0, wake_at - time.monotonic())):
                    key.data(mask)
                    if guard.faults != guard.seen:
                        self._pool_damaged("truncated under a copy")
                    if self._stopping:
                        break
                if lmcache is not None and not self._stopping:
                    lmcache.service()  # its descriptor is edge-triggered: what arrived meanwhile
                    if guard.faults != guard.seen:
                        self._pool_damaged("truncated under a copy")
                now = time.monotonic()
                if now >= next_evict and not self._stopping:
                    ctx.l1.evict_tick()
                    ctx.update_gauges(rewrite=True)
                    next_evict = now + self.config.eviction_interval_s
                if now >= next_beat:
                    if supervisor_gone(self._parent_pid):
                        self.log.warning("cache.orphaned", parent_pid=self._parent_pid)
                        break
                    if guard.shrunk():
                        self._pool_damaged("truncated")
                    ctx.sessions.expire()
                    self._transport.expire(now)
                    if lmcache is not None:
                        lmcache.tick()
                    ctx.storage.refresh_usage()
                    ctx.storage.report_failures()  # held L2 failure counts, once their rate limit allows
                    if ctx.l1.admission != admitting:
                        admitting = ctx.l1.admission
                        self.log.info("cache.l1_admission", rule=admitting, chance=ctx.l1.admission_chance,
                                      floor_accesses=round(ctx.l1.admission_floor), policy=ctx.l1.policy)
                    ctx.gauges.heartbeat(os.getpid())
                    next_beat = now + self._heartbeat_interval_s
        finally:
            self.log.info("cache.stop", pid=os.getpid(), clients=self._transport.connections)
            self.close()
