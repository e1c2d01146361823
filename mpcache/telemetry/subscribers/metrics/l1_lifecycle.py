"""L1 chunk lifecycle histograms from the sampled keys of L1 events.

Producers ship only sampled keys (the deterministic hash gate of
``spec/EVENTS.md``), so every key seen here is tracked; a key is
(chunk_hash, cache_salt, model_name).  Per key:

* a write of an untracked key starts tracking (allocation = last access = now);
* a read or write of a tracked key records ``l1_chunk_reuse_gap`` (now − last
  access) and moves the last access; a write also restarts the allocation;
* an eviction of a tracked key records ``l1_chunk_lifetime`` and
  ``l1_chunk_idle_before_evict``; every evicted key (tracked or not) then
  waits for its next write, which records ``l1_chunk_evict_reuse_gap``
  = min(now − eviction, cap).  Keys not rewritten within the cap are recorded
  at exactly the cap when :meth:`on_tick` expires them.

Writes are both write events: a chunk that L2→L1 prefetch brings back
(``L1_WRITE_FINISHED_AND_READ_RESERVED``) is as much a reuse of an evicted
chunk as a client's store.  Every map is bounded (least recently touched
entries go first), and expiry pops a heap ordered by eviction time, so the
work per key and per tick is O(log n), never a scan.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from mpcache.contract.events import EventType as E
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.subscribers.metrics._views import sampled_rows

ChunkKey = tuple[int, str, str]  # (chunk_hash, cache_salt, model_name)

DEFAULT_EVICT_REUSE_CAP_S = 300.0
DEFAULT_MAX_TRACKED = 100_000

_READ = int(E.L1_READ_FINISHED)
_EVICT = int(E.L1_KEYS_EVICTED)


class L1LifecycleSubscriber(Subscriber):
    event_types = (E.L1_READ_FINISHED, E.L1_WRITE_FINISHED, E.L1_WRITE_FINISHED_AND_READ_RESERVED, E.L1_KEYS_EVICTED)

    def __init__(
        self,
        meter: MeterLike,
        *,
        evict_reuse_cap_s: float = DEFAULT_EVICT_REUSE_CAP_S,
        max_tracked: int = DEFAULT_MAX_TRACKED,
    ) -> None:
        if evict_reuse_cap_s <= 0:
            raise ValueError(f"evict_reuse_cap_s must be > 0, got {evict_reuse_cap_s}")
        self._lifetime = create_instrument(meter, "lmcache_mp.l1_chunk_lifetime")
        self._idle = create_instrument(meter, "lmcache_mp.l1_chunk_idle_before_evict")
        self._reuse_gap = create_instrument(meter, "lmcache_mp.l1_chunk_reuse_gap")
        self._evict_reuse_gap = create_instrument(meter, "lmcache_mp.l1_chunk_evict_reuse_gap")
        self._cap_s = evict_reuse_cap_s
        self._cap_ns = int(evict_reuse_cap_s * 1e9)
        self._max_tracked = max_tracked
        # live key -> [allocated_ns, last_access_ns]; order = least recently touched first
        self._live: OrderedDict[ChunkKey, list[int]] = OrderedDict()
        # evicted key -> eviction ns; the heap holds (eviction ns, key), stale entries skipped on pop
        self._evicted_at: dict[ChunkKey, int] = {}
        self._expiry: list[tuple[int, ChunkKey]] = []

    @property
    def tracked(self) -> int:
        """Live plus evicted-and-waiting keys held right now."""
        return len(self._live) + len(self._evicted_at)

    def on_batch(self, batch: EventBatch) -> None:
        for row in sampled_rows(batch, self.event_types):
            key = (row.chunk_hash, row.cache_salt, row.model_name)
            if row.etype == _EVICT:
                self._evicted(key, row.timestamp_ns)
            elif row.etype == _READ:
                self._touched(key, row.timestamp_ns, is_write=False)
            else:
                self._touched(key, row.timestamp_ns, is_write=True)

    def on_tick(self, now_ns: int) -> None:
        """Record every eviction older than the cap at exactly the cap, and forget it."""
        expiry, evicted_at = self._expiry, self._evicted_at
        while expiry and expiry[0][0] + self._cap_ns <= now_ns:
            evicted_ns, key = heapq.heappop(expiry)
            if evicted_at.get(key) == evicted_ns:
                del evicted_at[key]
                self._evict_reuse_gap.record(self._cap_s)

    def save_state(self) -> object:
        """The tracked keys, least recently touched first, and the evictions waiting for a rewrite."""
        return {"live": list(self._live.items()), "evicted": list(self._evicted_at.items())}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, live="l", evicted="l")
        live = OrderedDict((key, list(times)) for key, times in statecheck.entries(saved["live"], "iss", "ii"))
        evicted = dict(statecheck.entries(saved["evicted"], "iss", "i"))
        if max(len(live), len(evicted)) > self._max_tracked:
            raise ValueError("more keys than this subscriber tracks")

        def adopt() -> None:
            self._live, self._evicted_at = live, evicted
            self._expiry = [(evicted_ns, key) for key, evicted_ns in evicted.items()]
            heapq.heapify(self._expiry)
        return adopt

    def _touched(self, key: ChunkKey, now_ns: int, *, is_write: bool) -> None:
        if is_write:
            evicted_ns = self._evicted_at.pop(key, None)
            if evicted_ns is not None:
                self._evict_reuse_gap.record(min(max(0, now_ns - evicted_ns) / 1e9, self._cap_s))
        state = self._live.get(key)
        if state is None:
            if is_write:
                self._live[key] = [now_ns, now_ns]
                if len(self._live) > self._max_tracked:
                    self._live.popitem(last=False)
            return
        self._reuse_gap.record(max(0, now_ns - state[1]) / 1e9)
        state[1] = now_ns
        if is_write:
            state[0] = now_ns
        self._live.move_to_end(key)

    def _evicted(self, key: ChunkKey, now_ns: int) -> None:
        state = self._live.pop(key, None)
        if state is not None:
            self._lifetime.record(max(0, now_ns - state[0]) / 1e9)
            self._idle.record(max(0, now_ns - state[1]) / 1e9)
        self._evicted_at[key] = now_ns
        heapq.heappush(self._expiry, (now_ns, key))
        if len(self._evicted_at) > self._max_tracked:
            self._drop_oldest_eviction()
        if len(self._expiry) > 2 * self._max_tracked + 1024:
            # Entries superseded by a rewrite stay in the heap until they come due; rebuilding
            # after this many pushes keeps the heap bounded at amortised O(1) per eviction.
            self._expiry = [(evicted_ns, k) for k, evicted_ns in self._evicted_at.items()]
            heapq.heapify(self._expiry)

    def _drop_oldest_eviction(self) -> None:
        """Over the bound: forget the oldest waiting eviction without a sample (it is unknown
        whether it will be reused), skipping heap entries already superseded."""
        while self._expiry:
            evicted_ns, key = heapq.heappop(self._expiry)
            if self._evicted_at.get(key) == evicted_ns:
                del self._evicted_at[key]
                return
