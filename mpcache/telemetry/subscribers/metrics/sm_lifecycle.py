"""``real_reuse_gap`` and ``real_reuse_gap_objects`` {cache_salt} from storage-manager events.

Per cache_salt an access counter advances by every chunk read or written
(the events' salt_counts, sampled or not).  A record's accesses sit at the
counter value before the record; for each sampled key of a read, the time and
the counter distance since that key's previous access (read or write) are
recorded; a write only moves the key's anchor.  The counter positions of the
sampled records are computed column-wise (prefix sums of the salt rows), so
records without sampled keys cost no Python work at all.  A key listed twice
in one record (tensor-parallel fan-out) counts once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from mpcache.contract.events import EventType as E
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber, run_all
from mpcache.telemetry.cardinality import SaltCap
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.subscribers.metrics._views import SampledRow, salt_rows, sampled_rows

DEFAULT_MAX_TRACKED = 100_000
_READ = int(E.SM_READ_PREFETCHED_FINISHED)


class SMLifecycleSubscriber(Subscriber):
    event_types = (E.SM_WRITE_FINISHED, E.SM_READ_PREFETCHED_FINISHED)

    def __init__(self, meter: MeterLike, salt_cap: int, *, max_tracked: int = DEFAULT_MAX_TRACKED) -> None:
        self._gap_seconds = create_instrument(meter, "lmcache_mp.real_reuse_gap")
        self._gap_objects = create_instrument(meter, "lmcache_mp.real_reuse_gap_objects")
        self._seconds_cap = SaltCap(salt_cap)
        self._objects_cap = SaltCap(salt_cap)
        self._max_tracked = max_tracked
        self._accesses: dict[str, int] = {}  # cache_salt -> chunk accesses so far
        # (chunk_hash, cache_salt, model_name) -> (last access ns, counter position); LRU order
        self._last: OrderedDict[tuple[int, str, str], tuple[int, int]] = OrderedDict()

    def on_batch(self, batch: EventBatch) -> None:
        heads, salt_ids, counts = salt_rows(batch, self.event_types)
        samples = sampled_rows(batch, self.event_types)
        if samples:
            self._record(batch, samples, heads, salt_ids, counts)
        if len(counts):
            distinct, inverse = np.unique(salt_ids, return_inverse=True)
            totals = np.bincount(inverse, weights=counts)
            for salt_id, total in zip(distinct.tolist(), totals.tolist()):
                salt = batch.names.name(salt_id)
                self._accesses[salt] = self._accesses.get(salt, 0) + int(total)

    def save_state(self) -> object:
        """Per cache_salt its access count, the last access of each tracked key (least recent first), and the
        cache_salt values each histogram admitted."""
        return {"accesses": list(self._accesses.items()), "last": list(self._last.items()),
                "seconds_cap": self._seconds_cap.save_state(), "objects_cap": self._objects_cap.save_state()}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, accesses="l", last="l", seconds_cap="l", objects_cap="l")
        accesses = dict(statecheck.rows(saved["accesses"], "si"))
        last = OrderedDict(statecheck.entries(saved["last"], "iss", "ii"))
        if len(last) > self._max_tracked:
            raise ValueError("more keys than this subscriber tracks")
        caps = (self._seconds_cap.load_state(saved["seconds_cap"]), self._objects_cap.load_state(saved["objects_cap"]))

        def adopt() -> None:
            self._accesses, self._last = accesses, last
            run_all(caps)
        return adopt

    def _record(self, batch: EventBatch, samples: list[SampledRow], heads: np.ndarray, salt_ids: np.ndarray,
                counts: np.ndarray) -> None:
        positions: dict[tuple[int, str], int] = {}  # (head, cache_salt) -> counter value before that record
        sampled_heads: dict[str, set[int]] = {}  # cache_salt -> the heads of its sampled rows
        for row in samples:
            sampled_heads.setdefault(row.cache_salt, set()).add(row.head)
        # each salt's rows, in ring order, from one stable sort (a mask per salt cost rows x salts)
        order = np.argsort(salt_ids, kind="stable")
        distinct, starts = np.unique(salt_ids[order], return_index=True)
        for salt_id, start, end in zip(distinct.tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)]):
            salt = batch.names.name(salt_id)
            wanted = sampled_heads.get(salt)
            if not wanted:
                continue
            mine = order[start:end]
            salt_heads, cumulative = heads[mine], np.cumsum(counts[mine])
            base = self._accesses.get(salt, 0)
            for head in wanted:
                before = int(np.searchsorted(salt_heads, head, side="left"))
                positions[head, salt] = base + (int(cumulative[before - 1]) if before else 0)
        seen: set[tuple[int, int, str, str]] = set()
        last = self._last
        for row in samples:
            dedup = (row.head, row.chunk_hash, row.cache_salt, row.model_name)
            if dedup in seen:
                continue
            seen.add(dedup)
            key = dedup[1:]
            position = positions.get((row.head, row.cache_salt), self._accesses.get(row.cache_salt, 0))
            previous = last.pop(key, None)
            if previous is not None and row.etype == _READ:
                self._gap_seconds.record(
                    max(0, row.timestamp_ns - previous[0]) / 1e9, {"cache_salt": self._seconds_cap(row.cache_salt)}
                )
                self._gap_objects.record(
                    max(0, position - previous[1]), {"cache_salt": self._objects_cap(row.cache_salt)}
                )
            last[key] = (row.timestamp_ns, position)
            if len(last) > self._max_tracked:
                last.popitem(last=False)
