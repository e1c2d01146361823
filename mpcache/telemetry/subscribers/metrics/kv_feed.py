"""The KV event feed's metrics (the table's "KV events" section): each registered model's share of each tier
from the cache processes' KV_CAPACITY events (the newest per cache process, model and tier, forgotten
``STALE_S`` after it, so a process that stopped or a model no longer registered drops out), and the feed's
words of the gauge board per cache process, and the counts of the relay that publishes it to routers
(``--kv-events-endpoint``; none without it).  Callbacks run on the exporter's thread: the table is read under
a lock, never iterated while the pump's thread writes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.contract.events import SCHEMAS
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

RelayCounts = Callable[[], list[Any]]  # the KV event relay's FeedCounts per cache process (mpcache.telemetry.kvpub)
STALE_S = 5.0  # a cache process publishes every heartbeat (0.5 s)
MAX_ENTRIES = 4096  # (cache process, model, tier) kept; more is a misbehaving producer, and is not kept
_COLUMNS = [SCHEMAS[E.KV_CAPACITY].field_names.index(field) for field in ("model_name", "tier", "bytes", "tokens")]


class KVFeedSubscriber(Subscriber):
    event_types = (E.KV_CAPACITY,)

    def __init__(self, meter: MeterLike, board: GaugeBoardReader,
                 clock: Callable[[], float] = time.monotonic, relay: RelayCounts | None = None) -> None:
        self._board = board
        self._relay = relay
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: dict[tuple[int, str, str], tuple[int, int, float]] = {}  # → (bytes, tokens, when)
        create_instrument(meter, "mpcache.kv_capacity_bytes", [self._observe(0)])
        create_instrument(meter, "mpcache.kv_capacity_tokens", [self._observe(1)])
        for name, word in (("mpcache.kv_event_subscribers", layout.G_KV_SUBSCRIBERS),
                           ("mpcache.kv_event_lag_records", layout.G_KV_LAG),
                           ("mpcache.kv_event_records", layout.G_KV_RECORDS),
                           ("mpcache.kv_event_skipped_records", layout.G_KV_SKIPPED),
                           ("mpcache.kv_event_resyncs", layout.G_KV_RESYNCS)):
            create_instrument(meter, name, [self._per_slot(word)])
        for name in ("subscribers", "messages", "records", "replays", "resyncs"):
            create_instrument(meter, f"mpcache.kv_pub_{name}", [self._relay_count(name)])

    def on_batch(self, batch: EventBatch) -> None:
        name, now = batch.names.name, self._clock()
        rows = batch.fixed_fields(E.KV_CAPACITY)[:, _COLUMNS].tolist()
        with self._lock:
            latest = self._latest
            for model_id, tier_id, nbytes, tokens in rows:
                key = (batch.producer, name(model_id), name(tier_id))
                if key in latest or len(latest) < MAX_ENTRIES:
                    latest[key] = (nbytes, tokens, now)

    def on_tick(self, now_ns: int) -> None:
        oldest = self._clock() - STALE_S
        with self._lock:
            for key in [key for key, (_, _, when) in self._latest.items() if when < oldest]:
                del self._latest[key]

    def _observe(self, which: int) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            sums: dict[tuple[str, str], int] = {}
            with self._lock:
                for (_, model, tier), values in self._latest.items():
                    sums[(model, tier)] = sums.get((model, tier), 0) + int(values[which])
            return [Observation(value, {"model_name": model, "tier": tier}) for (model, tier), value in sums.items()]

        return observe

    def _relay_count(self, name: str) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            if self._relay is None:
                return []
            return [Observation(getattr(counts, name), {"worker": str(worker)})
                    for worker, counts in enumerate(self._relay())]

        return observe

    def _per_slot(self, word: int) -> Callable[[CallbackOptions], list[Observation]]:
        board = self._board

        def observe(_options: CallbackOptions) -> list[Observation]:
            return [Observation(board.word(slot, word), {"worker": str(slot)}) for slot in range(board.n_slots)]

        return observe
