"""Miss-ratio curves and miss reasons (``docs/MRC.md``): feeds the sampled lookups and stores of each batch
to the service's :class:`~mpcache.telemetry.mrc.curves.CurveSet` in ring order, exports
``mpcache_mrc_hit_ratio`` at collection time and the miss-reason counters per batch, and decays the
curves once a second.  Per batch the work is O(records) column reads plus O(1) per sampled key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack
from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.config import Config
from mpcache.contract.events import (
    MRC_EXACT_GAP_SHIFT,
    MRC_EXACT_TAIL_SHIFT,
    MRC_HEAD_FIELDS,
    MRC_TAIL_MARK_FIELDS,
    SCHEMAS,
    EventType,
)
from mpcache.eviction.admission import trial_halvings
from mpcache.httpserver import Route
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.mrc.curves import (
    AFTER_GAP,
    HEAD,
    L1_HIT,
    L2_HIT,
    MAX_TENANT_CURVES,
    MISS,
    SAMPLED,
    Access,
    CurveSet,
    Row,
)
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.subscribers.metrics._views import sampled_rows

_LOOKUP, _STORE = EventType.MRC_LOOKUP_SAMPLED, EventType.MRC_STORE_SAMPLED
_LOOKUP_FIELDS = ("model_name", "cache_salt", "ranks", "found", "l1_hits", "exact", "sampled_l1_hits",
                  "sampled_l2_hits", "sampled_after_gap", *MRC_HEAD_FIELDS, *MRC_TAIL_MARK_FIELDS)
_LOOKUP_COLUMNS = [SCHEMAS[_LOOKUP].field_names.index(field) for field in _LOOKUP_FIELDS]
_STORE_COLUMNS = [SCHEMAS[_STORE].field_names.index(field) for field in ("model_name", "object_bytes")]
_MASK64 = (1 << 64) - 1
# The curves' history (tracked, stored and forgotten keys: up to 4 x --mrc-max-keys rows, milliseconds to pack) is
# checkpointed at most this often; the curves and the counts, at every checkpoint.
HISTORY_EVERY_S = 60.0


def _in_ring_order(lookups: list[int], stores: list[int]) -> Iterator[tuple[bool, int]]:
    """(is a lookup, its index) of every lookup and store, by head position (both lists ascend)."""
    if not stores:
        yield from ((True, index) for index in range(len(lookups)))
        return
    if not lookups:
        yield from ((False, index) for index in range(len(stores)))
        return
    merged = sorted([(head, True, index) for index, head in enumerate(lookups)]
                    + [(head, False, index) for index, head in enumerate(stores)])
    yield from ((is_lookup, index) for _, is_lookup, index in merged)


def lookup_accesses(model: str, salt: str, rows: list[Row], fields: dict[str, int]) -> list[Access]:
    """A lookup event's keys with their stratum, what the lookup found of each and how many objects each
    stands for: the first chunks (one key for the chunk's ``ranks`` objects), then the sampled keys."""
    ranks = max(1, fields["ranks"])  # a corrupt record cannot make a weight negative or divide by zero
    found, l1_hits = fields["found"], fields["l1_hits"]
    gap_chunk, mask = found // ranks, fields["exact"] >> MRC_EXACT_GAP_SHIFT
    out: list[Access] = []
    for chunk, head in enumerate(MRC_HEAD_FIELDS[: fields["exact"] & (1 << MRC_EXACT_GAP_SHIFT) - 1]):
        end = (chunk + 1) * ranks
        kind = (L1_HIT if end <= l1_hits else L2_HIT if end <= found
                else AFTER_GAP if chunk > gap_chunk and mask >> chunk & 1 else MISS)
        out.append(((fields[head] & _MASK64, salt, model), HEAD, kind, ranks))
    l1_end = fields["sampled_l1_hits"]
    l2_end = l1_end + fields["sampled_l2_hits"]
    gap_end = l2_end + fields["sampled_after_gap"]
    for index, row in enumerate(rows):
        kind = L1_HIT if index < l1_end else L2_HIT if index < l2_end else AFTER_GAP if index < gap_end else MISS
        out.append((row, SAMPLED, kind, 1))
    return out


def lookup_tail(fields: dict[str, int]) -> tuple[int, tuple[int, int]]:
    """A lookup event's objects past its head chunks, and of them those found in L1 and in L2 (the found ones
    are a prefix: the counts place them)."""
    head = (fields["exact"] & (1 << MRC_EXACT_GAP_SHIFT) - 1) * max(1, fields["ranks"])
    tail = max(0, fields["exact"] >> MRC_EXACT_TAIL_SHIFT)
    found = max(0, fields["found"])
    in_l1 = max(0, min(fields["l1_hits"], found) - head)
    return tail, (in_l1, max(0, found - head - in_l1))


class MissRatioSubscriber(Subscriber):
    """``mpcache.mrc_hit_ratio``, ``mpcache.lookup_miss`` and ``mpcache.l1_evicted_reused``."""

    event_types = (_LOOKUP, _STORE)

    def __init__(self, meter: MeterLike, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.curves = CurveSet(config.mrc_sample_rate, config.mrc_max_keys, config.tier_capacities(),
                               max_tenants=min(MAX_TENANT_CURVES, config.cache_salt_cap), policy=config.l1_policy,
                               processes=config.workers,  # admitting as the cache processes' L1 does
                               first_sight=not config.l2,
                               trial=trial_halvings(config.l1_pool_bytes, config.chunk_bytes))
        self.l1_policy = config.l1_policy
        self._half_life_s = config.mrc_half_life_s
        self._clock = clock
        self._decayed_at = clock()
        self._history: bytes | None = None  # the curves' history as the last checkpoint took it, packed
        self._history_at = 0.0
        create_instrument(meter, "mpcache.mrc_hit_ratio", [self._hit_ratios])
        self._misses = create_instrument(meter, "mpcache.lookup_miss")
        self._regret = create_instrument(meter, "mpcache.l1_evicted_reused")

    def on_batch(self, batch: EventBatch) -> None:
        present = batch.etypes_present
        if _LOOKUP not in present and _STORE not in present:
            return
        name = batch.names.name
        rows_by_head: dict[int, list[tuple[int, str, str]]] = {}
        for row in sampled_rows(batch, self.event_types):
            rows_by_head.setdefault(row.head, []).append((row.chunk_hash, row.cache_salt, row.model_name))
        lookups: list[int] = []
        lookup_values: list[list[int]] = []
        if _LOOKUP in present:  # every field of every lookup in one gather per cell (27 fields, 4 cells)
            lookups = batch.heads_of((_LOOKUP,)).tolist()
            lookup_values = batch.fixed_fields(_LOOKUP)[:, _LOOKUP_COLUMNS].tolist()
        stores: list[int] = []
        store_values: list[list[int]] = []
        if _STORE in present:
            stores = batch.heads_of((_STORE,)).tolist()
            store_values = batch.fixed_fields(_STORE)[:, _STORE_COLUMNS].tolist()
        curves = self.curves
        with curves.lock:
            for is_lookup, index in _in_ring_order(lookups, stores):
                if is_lookup:
                    fields = dict(zip(_LOOKUP_FIELDS, lookup_values[index]))
                    rows = rows_by_head.get(lookups[index], [])
                    if rows or fields["exact"]:
                        model, salt = name(fields["model_name"]), name(fields["cache_salt"])
                        curves.lookup(model, salt, max(1, fields["ranks"]), lookup_accesses(model, salt, rows, fields),
                                      batch.producer, *lookup_tail(fields),
                                      tuple(fields[mark] & _MASK64 for mark in MRC_TAIL_MARK_FIELDS))
                else:  # a store: sampled keys, or only its model's object size
                    model_id, object_bytes = store_values[index]
                    curves.store(name(model_id), max(0, object_bytes), rows_by_head.get(stores[index], ()),
                                 batch.producer)
            misses, regret = curves.take_counts()
        for (reason, model, salt), value in misses.items():
            self._misses.add(value, {"reason": reason, "model_name": model, "cache_salt": salt})
        for (model, salt), value in regret.items():
            self._regret.add(value, {"model_name": model, "cache_salt": salt})

    def on_tick(self, now_ns: int) -> None:
        now = self._clock()
        if self._half_life_s > 0 and now > self._decayed_at:
            with self.curves.lock:
                self.curves.decay(0.5 ** ((now - self._decayed_at) / self._half_life_s))
        self._decayed_at = now

    def save_state(self) -> object:
        """The curves, the history the next accesses are judged against (taken again at most every
        ``HISTORY_EVERY_S``: between two, checkpoints carry the last one taken), and when the curves last
        decayed (wall clock: a restart decays them over the time it took too)."""
        now = self._clock()
        with self.curves.lock:
            if self._history is None or now - self._history_at >= HISTORY_EVERY_S:
                self._history = msgpack.packb(self.curves.save_history(), use_bin_type=True)
                self._history_at = now
            curves = self.curves.save_curves()
        return {"curves": curves, "history": self._history,
                "decayed_at_ns": time.time_ns() - int((now - self._decayed_at) * 1e9)}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, curves="d", history="b", decayed_at_ns="i")
        curves = self.curves.load_state(saved["curves"], statecheck.unpack(saved["history"]))

        def adopt() -> None:
            with self.curves.lock:
                curves()
            self._history = None  # taken at the first checkpoint: what was loaded is older than the curves
            self._decayed_at = self._clock() - max(0, time.time_ns() - saved["decayed_at_ns"]) / 1e9
        return adopt

    def _hit_ratios(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self.curves.lock:
            points = self.curves.gauge_points()
        return [Observation(value, attributes) for value, attributes in points]


def mrc_document(curves: CurveSet, l1_policy: str | None = None) -> dict[str, Any]:
    """The ``GET /mrc`` answer: the sampling state, the order the curves model beside the one L1 runs
    (``--l1-policy``, by default the modelled one: the curves predict the cache only where they are the same),
    the cache processes a tier's capacity is shared by (each process's share is its own cache), and every
    curve."""
    with curves.lock:
        return {"curves_model": curves.policy, "l1_policy": curves.policy if l1_policy is None else l1_policy,
                "sample_rate": curves.rate, "configured_sample_rate": curves.configured_rate,
                "head_sample_rate": curves.head_rate, "processes": curves.processes,
                "tracked_keys": curves.tracked_keys, "max_keys": curves.max_keys, "curves": curves.curves()}


def _mrc_route(curves: CurveSet, l1_policy: str) -> Route:
    return lambda: (200, json.dumps(mrc_document(curves, l1_policy)).encode(), "application/json")


def mrc_routes(subscribers: Iterable[Subscriber]) -> dict[str, Route]:
    """``/mrc`` over the miss-ratio subscriber among ``subscribers`` (none without one)."""
    for subscriber in subscribers:
        if isinstance(subscriber, MissRatioSubscriber):
            return {"/mrc": _mrc_route(subscriber.curves, subscriber.l1_policy)}
    return {}
