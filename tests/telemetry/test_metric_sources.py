"""The typed sources of the metric table: against the event catalogue, the subscribers and the data.

Each metric is described once, by its row in ``metric_table``; these tests hold
that description to the event schemas (``mpcache.contract.events.SCHEMAS``), to
the subscribers that compute the metrics (each consumes exactly the events its
metrics' sources name) and, for the table-driven counters, to the values:
every counter of the table computed from random events equals what its source
says, evaluated event by event on the decoded events.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from mpcache.config import Config
from mpcache.contract.events import SCHEMAS, EventType, FieldKind
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, format_gauge_board
from mpcache.telemetry.bus import EventBus, Subscriber
from mpcache.telemetry.kvpub import FeedCounts
from mpcache.telemetry.metric_table import (
    COUNTER,
    HISTOGRAM,
    METRICS,
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    Label,
    MetricSpec,
    Origin,
    Source,
)
from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers
from mpcache.telemetry.subscribers.metrics.counters import (
    COUNTER_SECTIONS,
    TableCountersSubscriber,
    counter_subscribers,
)
from mpcache.telemetry.subscribers.metrics.event_bus import EventBusSelfMetricsSubscriber
from mpcache.telemetry.subscribers.metrics.gauges import L1StateGaugesSubscriber
from mpcache.telemetry.subscribers.metrics.kv_feed import KVFeedSubscriber
from mpcache.telemetry.subscribers.metrics.l0_l1_throughput import L0L1ThroughputSubscriber
from mpcache.telemetry.subscribers.metrics.l0_lifecycle import L0LifecycleSubscriber
from mpcache.telemetry.subscribers.metrics.l1_lifecycle import L1LifecycleSubscriber
from mpcache.telemetry.subscribers.metrics.l2_gauges import L2StateGaugesSubscriber
from mpcache.telemetry.subscribers.metrics.l2_throughput import L2ThroughputSubscriber
from mpcache.telemetry.subscribers.metrics.lmcache_requests import LMCacheRequestTimesSubscriber
from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber
from mpcache.telemetry.subscribers.metrics.processes import ProcessesSubscriber
from mpcache.telemetry.subscribers.metrics.service import ServiceStateSubscriber
from mpcache.telemetry.subscribers.metrics.sm_lifecycle import SMLifecycleSubscriber

D = Derivation
IDS = [spec.prometheus_name for spec in METRICS]
# The kind of field each derivation reads (None: it names no field).
FIELD_KIND = {
    D.FIELD_SUM: FieldKind.INT, D.POSITIVE_FIELD_SUM: FieldKind.INT, D.THROUGHPUT: FieldKind.INT,
    D.TRUE_COUNT: FieldKind.BOOL, D.FALSE_COUNT: FieldKind.BOOL, D.NONZERO_COUNT: FieldKind.INT,
    D.ZERO_COUNT: FieldKind.INT, D.LATEST_FIELD: FieldKind.INT,
}
INSTRUMENTS = {
    **{d: (COUNTER,) for d in D if d.table_driven},
    D.SAMPLED_KEY_SECONDS: (HISTOGRAM,), D.SAMPLED_KEY_ACCESSES: (HISTOGRAM,), D.BLOCK_SECONDS: (HISTOGRAM,),
    D.THROUGHPUT: (HISTOGRAM,), D.PRODUCER_BUCKETS: (HISTOGRAM,), D.GAUGE_SUM: (OBSERVABLE_GAUGE,),
    D.GAUGE_RATIO: (OBSERVABLE_GAUGE,), D.BUS_STATE: (OBSERVABLE_GAUGE, OBSERVABLE_COUNTER),
    D.CHECKPOINT: (OBSERVABLE_GAUGE, OBSERVABLE_COUNTER),
    D.MRC_HIT_RATIO: (OBSERVABLE_GAUGE,), D.SAMPLED_MISSES: (COUNTER,),
    D.SLOT_COUNT: (OBSERVABLE_GAUGE,), D.LIVE_SLOT_COUNT: (OBSERVABLE_GAUGE,), D.RESTART_COUNT: (OBSERVABLE_COUNTER,),
    D.SLOT_WORD: (OBSERVABLE_COUNTER, OBSERVABLE_GAUGE), D.LATEST_FIELD: (OBSERVABLE_GAUGE,),
    D.KV_RELAY: (OBSERVABLE_COUNTER, OBSERVABLE_GAUGE),
    D.BUILD: (OBSERVABLE_GAUGE,), D.RESOURCE: (OBSERVABLE_GAUGE,),
    D.PROCESS: (OBSERVABLE_GAUGE, OBSERVABLE_COUNTER), D.PROCESS_SAMPLE: (OBSERVABLE_GAUGE, OBSERVABLE_COUNTER),
}
# Where each attribute origin may appear.
LABEL_DERIVATIONS = {
    Origin.FIELD: {d for d in D if not d.observable},
    Origin.SALT_GROUP: {D.SALT_COUNT},
    Origin.SAMPLED_KEY: {D.SAMPLED_KEY_SECONDS, D.SAMPLED_KEY_ACCESSES, D.MRC_HIT_RATIO, D.SAMPLED_MISSES},
    Origin.CONFIG: {D.GAUGE_SUM, D.GAUGE_RATIO},
    Origin.BUS: {D.BUS_STATE},
    Origin.CHECKPOINT: {D.CHECKPOINT},
    Origin.ANALYSIS: {D.MRC_HIT_RATIO, D.SAMPLED_MISSES},
    Origin.SLOT: {D.SLOT_WORD, D.PROCESS_SAMPLE, D.KV_RELAY},
    Origin.CHILD: {D.RESTART_COUNT, D.PROCESS_SAMPLE},
    Origin.BUILD: {D.BUILD},
    Origin.RESOURCE: {D.RESOURCE},
}


def field_schema(etype: EventType) -> dict[str, FieldKind]:
    return dict(SCHEMAS[etype].fields)


def read_from(source: Source, event: EventType | None) -> tuple[EventType, ...]:
    """The event types a field (or field attribute) is read from: the one named, else every value event."""
    return (event,) if event is not None else source.events


@pytest.mark.parametrize("spec", METRICS, ids=IDS)
def test_source_events_are_catalogue_events_and_fit_the_instrument(spec: MetricSpec):
    """Event-fed sources name known event types, each once; observable ones name state instead; the
    derivation fits the instrument, and every counter is table-driven but the sampled miss estimates."""
    source = spec.source
    problems = [etype for etype in source.all_events + source.listed if etype not in SCHEMAS]
    if source.derivation.observable:
        problems += [f"observable with events {source.all_events}"] if source.all_events else []
        problems += [] if source.state is not None else ["observable without state"]
    else:
        problems += [] if source.events else ["no events"]
        problems += [] if source.state is None and not source.words else ["events and state"]
    problems += [f"repeated in {part}" for part in (source.events, source.since, source.listed)
                 if len(set(part)) != len(part)]
    problems += [] if set(source.listed) <= set(source.all_events) else [f"listed {source.listed} not all read"]
    counted_elsewhere = source.derivation.table_driven or source.derivation.observable or (
        source.derivation in (D.PRODUCER_BUCKETS, D.LATEST_FIELD))  # the producer measured it; a value, no interval
    problems += [] if source.since or counted_elsewhere else ["no since"]
    problems += [] if not source.since or not source.derivation.table_driven else ["a counter with since"]
    problems += [] if spec.instrument in INSTRUMENTS[source.derivation] else [f"{spec.instrument} is not "
                                                                              f"{source.derivation.value}"]
    assert [] == problems


@pytest.mark.parametrize("spec", METRICS, ids=IDS)
def test_named_fields_exist_with_a_fitting_kind(spec: MetricSpec):
    """A summed or divided field is an int field, a tested one a bool field, of every event type it is read
    from; derivations that read no field name none."""
    source = spec.source
    if source.derivation is D.KV_RELAY:  # the field names one of the relay's counts, not an event's field
        assert source.field in FeedCounts.__slots__ and source.field_event is None
        return
    kind = FIELD_KIND.get(source.derivation)
    if kind is None:
        assert ("", None) == (source.field, source.field_event)
        return
    assert source.field_event in (None, *source.all_events)
    kinds = {etype.name: field_schema(etype).get(source.field) for etype in read_from(source, source.field_event)}
    assert {name: kind for name in kinds} == kinds


@pytest.mark.parametrize("spec", METRICS, ids=IDS)
def test_salt_groups_sampled_keys_and_blocks_come_from_events_that_carry_them(spec: MetricSpec):
    """Salt-group counts (and access counts) only from events with salt groups, sampled-key histograms only
    from events with sampled keys, block histograms from an event with blocks."""
    source, schemas = spec.source, [SCHEMAS[etype] for etype in spec.source.all_events]
    if source.derivation in (D.SALT_COUNT, D.SAMPLED_KEY_ACCESSES):
        assert [] == [schema.dotted for schema in schemas if not schema.salt_counts]
    if source.derivation in (D.SAMPLED_KEY_SECONDS, D.SAMPLED_KEY_ACCESSES, D.MRC_HIT_RATIO, D.SAMPLED_MISSES):
        assert [] == [schema.dotted for schema in schemas if not schema.sampled]
    if source.derivation is D.BLOCK_SECONDS:
        assert any(schema.blocks for schema in schemas)


@pytest.mark.parametrize("spec", METRICS, ids=IDS)
def test_attributes_come_from_where_their_origin_says(spec: MetricSpec):
    """Field attributes are name or int fields of the events they are read from; salt-group and sampled-key
    attributes are a cache_salt or a model_name of sources that have them; configuration and bus attributes
    only on the observable instruments that read that state; no attribute twice."""
    source = spec.source
    problems: list[str] = []
    for label in source.labels:
        if source.derivation not in LABEL_DERIVATIONS[label.origin]:
            problems.append(f"{label.name}: {label.origin.value} attribute on a {source.derivation.value}")
        if label.origin is Origin.FIELD:
            if label.event not in (None, *source.all_events):
                problems.append(f"{label.name}: read from {label.event}, not an event of the source")
            for etype in read_from(source, label.event):
                if field_schema(etype).get(label.field) not in (FieldKind.NAME, FieldKind.INT):
                    problems.append(f"{label.name}: no name or int field {label.field!r} in {etype.name}")
        elif label.origin in (Origin.SALT_GROUP, Origin.SAMPLED_KEY):
            if label.field not in ("cache_salt", "model_name") or label.event is not None:
                problems.append(f"{label.name}: {label.field!r} of a {label.origin.value}")
        elif label.field or label.event is not None:
            problems.append(f"{label.name}: {label.origin.value} attributes name no field")
    if len(set(spec.attributes)) != len(spec.attributes):
        problems.append(f"repeated attribute in {spec.attributes}")
    assert [] == problems


@pytest.mark.parametrize("spec", [s for s in METRICS if s.source.derivation.observable],
                         ids=lambda s: s.prometheus_name)
def test_gauge_words_are_gauge_board_offsets(spec: MetricSpec):
    """Gauge-board sources name word offsets of mpcache.shm.layout: one to sum or read, two for a ratio, none
    for the other state."""
    source = spec.source
    expected = {D.GAUGE_SUM: 1, D.GAUGE_RATIO: 2, D.LIVE_SLOT_COUNT: 1, D.RESTART_COUNT: 1, D.SLOT_WORD: 1}.get(
        source.derivation, 0)
    assert (expected, True) == (len(source.words), all(
        word.startswith("G_") and isinstance(getattr(layout, word, None), int) for word in source.words))


def test_cache_salt_is_always_a_cache_salt():
    """Every cache_salt attribute (the one capped per metric) is read from a cache_salt: a field, a salt
    group's or a sampled key's."""
    sources = {(label.origin, label.field) for spec in METRICS for label in spec.source.labels
               if label.name == "cache_salt"}
    assert {(Origin.FIELD, "cache_salt"), (Origin.SALT_GROUP, "cache_salt"),
            (Origin.SAMPLED_KEY, "cache_salt")} >= sources


# -- the subscribers against the table ---------------------------------------------------------------------


class _Instrument:
    def add(self, amount: float, attributes: Any = None) -> None:
        pass

    def record(self, value: float, attributes: Any = None) -> None:
        pass


class RecordingMeter:
    """Creates no-op instruments and remembers their names."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def _create(self, name: str, **_kwargs: Any) -> _Instrument:
        self.created.append(name)
        return _Instrument()

    create_counter = create_histogram = create_observable_gauge = create_observable_counter = _create


@pytest.fixture
def board(segment_factory) -> GaugeBoardReader:
    segment = segment_factory(layout.gauge_board_size(1))
    format_gauge_board(segment, 1)
    return GaugeBoardReader(segment, stale_after_s=5.0)


def subscribers_and_metrics(pipeline, board) -> list[tuple[Subscriber, list[str]]]:
    """Every metrics subscriber class, each built on its own meter, with the metrics it creates."""
    bus = EventBus()
    factories = [lambda meter, section=section: TableCountersSubscriber(meter, section, 10, ["fs"])
                 for section in COUNTER_SECTIONS] + [
        lambda meter: ServiceStateSubscriber(meter, board), lambda meter: ProcessesSubscriber(meter, board),
        lambda meter: KVFeedSubscriber(meter, board),
        L1LifecycleSubscriber, lambda meter: SMLifecycleSubscriber(meter, 10), L0L1ThroughputSubscriber,
        L2ThroughputSubscriber, L0LifecycleSubscriber, LMCacheRequestTimesSubscriber,
        lambda meter: EventBusSelfMetricsSubscriber(meter, pipeline.pump(), bus),
        lambda meter: L1StateGaugesSubscriber(meter, board),
        lambda meter: L2StateGaugesSubscriber(meter, board, ["fs"]),
        lambda meter: MissRatioSubscriber(meter, Config(instance_id="t", supervisor_pid=1, runtime_dir="/nonexistent")),
    ]
    out = []
    for factory in factories:
        meter = RecordingMeter()
        out.append((factory(meter), meter.created))
    return out


def test_the_subscribers_create_every_metric_of_the_table_once(pipeline, board, metrics, config):
    """Over the subscribers that build_metrics_subscribers builds, every OTel instrument of the table but the
    exporter's own is created exactly once, and table-driven derivations are exactly what the table-driven
    subscribers compute."""
    built = build_metrics_subscribers(config, metrics.provider, pump=pipeline.pump(), bus=pipeline.bus,
                                      gauge_reader=board, readiness=board)
    pairs = subscribers_and_metrics(pipeline, board)
    created = Counter(name for _, names in pairs for name in names)
    by_name = {spec.otel_name: spec for spec in METRICS if spec.otel_name and not spec.source.derivation.exporter_made}
    table_driven = {name for subscriber, names in pairs if isinstance(subscriber, TableCountersSubscriber)
                    for name in names}
    assert (sorted(s.name for s in built), {name: 1 for name in by_name}, table_driven) == (
        sorted(s.name for s, _ in pairs), dict(created),
        {name for name, spec in by_name.items() if spec.source.derivation.table_driven})


def test_each_subscriber_consumes_exactly_the_events_of_its_metrics_sources(pipeline, board):
    """A subscriber's event_types are the union of the events its metrics' sources name (none for the
    observable instruments): hand-written subscribers cannot drift from the table unnoticed."""
    by_name = {spec.otel_name: spec for spec in METRICS}
    mismatches = {}
    for subscriber, names in subscribers_and_metrics(pipeline, board):
        declared = {etype for name in names for etype in by_name[name].source.all_events}
        if set(subscriber.event_types) != declared:
            mismatches[subscriber.name] = (sorted(e.name for e in subscriber.event_types),
                                                     sorted(e.name for e in declared))
    assert {} == mismatches


# -- the table-driven counters against their sources, event by event --------------------------------------

COUNTERS = [spec for spec in METRICS if spec.source.derivation.table_driven]
COUNTER_EVENTS = sorted({etype for spec in COUNTERS for etype in spec.source.events})
NAMES = ("x", "y", "z")


def random_event(rng: random.Random, etype: EventType) -> tuple[tuple[Any, ...], dict[tuple[str, str], int] | None]:
    values: list[Any] = []
    for _name, kind in SCHEMAS[etype].fields:
        values.append({FieldKind.INT: lambda: rng.choice((0, 0, 1, 2, 5, 17)), FieldKind.FLOAT: rng.random,
                       FieldKind.BOOL: lambda: rng.random() < 0.5, FieldKind.NAME: lambda: rng.choice(NAMES),
                       FieldKind.HASH: lambda: rng.getrandbits(64)}[kind]())
    salts = None
    if SCHEMAS[etype].salt_counts:
        salts = {(rng.choice(NAMES), rng.choice(NAMES)): rng.randint(1, 9) for _ in range(rng.randint(1, 3))}
    return tuple(values), salts


def expected_series(source: Source, events: list[Any]) -> dict[frozenset, int]:
    """What ``source`` says the counter reads after ``events`` (decoded), computed one event at a time."""
    totals: Counter[tuple[str, ...]] = Counter()

    def attribute(label: Label, event: Any, salt: str = "", model: str = "") -> str:
        if label.origin is Origin.SALT_GROUP:
            return salt if label.field == "cache_salt" else model
        value = event.fields[label.field]
        return value if isinstance(value, str) else str(value)

    for event in events:
        if event.etype not in source.events:
            continue
        if source.derivation is D.SALT_COUNT:
            for salt, model, count in event.salt_counts:
                totals[tuple(attribute(label, event, salt, model) for label in source.labels)] += count
            continue
        value = event.fields.get(source.field)
        if source.derivation is D.POSITIVE_FIELD_SUM and value <= 0:
            continue
        weight = {D.EVENT_COUNT: 1, D.FIELD_SUM: value, D.POSITIVE_FIELD_SUM: value,
                  D.TRUE_COUNT: int(value is True), D.FALSE_COUNT: int(value is False),
                  D.NONZERO_COUNT: int(value != 0), D.ZERO_COUNT: int(value == 0)}[source.derivation]
        totals[tuple(attribute(label, event) for label in source.labels)] += weight
    if not source.labels:
        return {frozenset(): totals[()]}
    return {frozenset(zip(source.attributes, key)): total for key, total in totals.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_table_driven_counter_equals_its_source_evaluated_per_event(pipeline, metrics, seed):
    """Random events of every counter's source types, in several batches: each counter's series equal its
    typed source evaluated on the decoded events (the vectorised group-by against plain Python)."""
    from mpcache.telemetry.batch import EventBatch

    rng = random.Random(seed)
    decoded: list[Any] = []

    class Decoder(Subscriber):
        event_types = tuple(COUNTER_EVENTS)

        def on_batch(self, batch: EventBatch) -> None:
            decoded.extend(batch.events(self.event_types))

    pipeline.subscribe(*counter_subscribers(metrics.meter, 1000, ()), Decoder())
    for _ in range(3):
        for _ in range(60):
            etype = rng.choice(COUNTER_EVENTS)
            fields, salts = random_event(rng, etype)
            pipeline.publish(etype, fields, salt_counts=salts)
        pipeline.deliver()
    wrong = {spec.otel_name: (metrics.series(spec.otel_name), expected_series(spec.source, decoded))
             for spec in COUNTERS if metrics.series(spec.otel_name) != expected_series(spec.source, decoded)}
    assert (len(decoded) > 150, {}) == (True, wrong)
