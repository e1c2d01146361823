"""The typed sources of the metric table against the event catalogue.

Each metric is described once, by its row in ``metric_table``; these tests hold
that description to the event schemas (``mpcache.contract.events.SCHEMAS``).
"""

from __future__ import annotations

import pytest

from mpcache.contract.events import SCHEMAS, EventType, FieldKind
from mpcache.shm import layout
from mpcache.telemetry.metric_table import (
    ALL_METRICS,
    COUNTER,
    HISTOGRAM,
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    MetricSpec,
    Origin,
    Source,
)

D = Derivation
IDS = [spec.otel_name for spec in ALL_METRICS]
# The kind of field each derivation reads (None: it names no field).
FIELD_KIND = {
    D.FIELD_SUM: FieldKind.INT, D.POSITIVE_FIELD_SUM: FieldKind.INT, D.THROUGHPUT: FieldKind.INT,
    D.TRUE_COUNT: FieldKind.BOOL, D.FALSE_COUNT: FieldKind.BOOL,
}
INSTRUMENTS = {
    **{d: (COUNTER,) for d in D if d.table_driven},
    D.SAMPLED_KEY_SECONDS: (HISTOGRAM,), D.SAMPLED_KEY_ACCESSES: (HISTOGRAM,), D.BLOCK_SECONDS: (HISTOGRAM,),
    D.THROUGHPUT: (HISTOGRAM,), D.GAUGE_SUM: (OBSERVABLE_GAUGE,), D.GAUGE_RATIO: (OBSERVABLE_GAUGE,),
    D.BUS_STATE: (OBSERVABLE_GAUGE, OBSERVABLE_COUNTER),
}
# Where each attribute origin may appear.
LABEL_DERIVATIONS = {
    Origin.FIELD: {d for d in D if not d.observable},
    Origin.SALT_GROUP: {D.SALT_COUNT},
    Origin.SAMPLED_KEY: {D.SAMPLED_KEY_SECONDS, D.SAMPLED_KEY_ACCESSES},
    Origin.CONFIG: {D.GAUGE_SUM, D.GAUGE_RATIO},
    Origin.BUS: {D.BUS_STATE},
}


def field_schema(etype: EventType) -> dict[str, FieldKind]:
    return dict(SCHEMAS[etype].fields)


def read_from(source: Source, event: EventType | None) -> tuple[EventType, ...]:
    """The event types a field (or field attribute) is read from: the one named, else every value event."""
    return (event,) if event is not None else source.events


@pytest.mark.parametrize("spec", ALL_METRICS, ids=IDS)
def test_source_events_are_catalogue_events_and_fit_the_instrument(spec: MetricSpec):
    """Event-fed sources name known event types, each once; observable ones name state instead; the
    derivation fits the instrument, and every counter is table-driven."""
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
    problems += [] if source.since or source.derivation.table_driven or source.derivation.observable else ["no since"]
    problems += [] if not source.since or not source.derivation.table_driven else ["a counter with since"]
    problems += [] if spec.instrument in INSTRUMENTS[source.derivation] else [f"{spec.instrument} is not "
                                                                              f"{source.derivation.value}"]
    assert [] == problems


@pytest.mark.parametrize("spec", ALL_METRICS, ids=IDS)
def test_named_fields_exist_with_a_fitting_kind(spec: MetricSpec):
    """A summed or divided field is an int field, a tested one a bool field, of every event type it is read
    from; derivations that read no field name none."""
    source = spec.source
    kind = FIELD_KIND.get(source.derivation)
    if kind is None:
        assert ("", None) == (source.field, source.field_event)
        return
    assert source.field_event in (None, *source.all_events)
    kinds = {etype.name: field_schema(etype).get(source.field) for etype in read_from(source, source.field_event)}
    assert {name: kind for name in kinds} == kinds


@pytest.mark.parametrize("spec", ALL_METRICS, ids=IDS)
def test_salt_groups_sampled_keys_and_blocks_come_from_events_that_carry_them(spec: MetricSpec):
    """Salt-group counts (and access counts) only from events with salt groups, sampled-key histograms only
    from events with sampled keys, block histograms from an event with blocks."""
    source, schemas = spec.source, [SCHEMAS[etype] for etype in spec.source.all_events]
    if source.derivation in (D.SALT_COUNT, D.SAMPLED_KEY_ACCESSES):
        assert [] == [schema.dotted for schema in schemas if not schema.salt_counts]
    if source.derivation in (D.SAMPLED_KEY_SECONDS, D.SAMPLED_KEY_ACCESSES):
        assert [] == [schema.dotted for schema in schemas if not schema.sampled]
    if source.derivation is D.BLOCK_SECONDS:
        assert any(schema.blocks for schema in schemas)


@pytest.mark.parametrize("spec", ALL_METRICS, ids=IDS)
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


@pytest.mark.parametrize("spec", [s for s in ALL_METRICS if s.source.derivation.observable], ids=lambda s: s.otel_name)
def test_gauge_words_are_gauge_board_offsets(spec: MetricSpec):
    """Gauge-board sources name word offsets of mpcache.shm.layout: one to sum, or two for a ratio."""
    source = spec.source
    expected = {D.GAUGE_SUM: 1, D.GAUGE_RATIO: 2, D.BUS_STATE: 0}[source.derivation]
    assert (expected, True) == (len(source.words), all(
        word.startswith("G_") and isinstance(getattr(layout, word, None), int) for word in source.words))


def test_cache_salt_is_always_a_cache_salt():
    """Every cache_salt attribute (the one capped per metric) is read from a cache_salt: a field, a salt
    group's or a sampled key's."""
    sources = {(label.origin, label.field) for spec in ALL_METRICS for label in spec.source.labels
               if label.name == "cache_salt"}
    assert {(Origin.FIELD, "cache_salt"), (Origin.SALT_GROUP, "cache_salt"),
            (Origin.SAMPLED_KEY, "cache_salt")} >= sources
