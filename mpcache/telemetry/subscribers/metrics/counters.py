"""The plain counters, computed from the metric table: one table-driven subscriber per section, no per-metric
code.

Every counter whose :class:`~mpcache.telemetry.metric_table.Source` has a
table-driven derivation (event count, field sum, true/false or zero/nonzero
count, salt-group count) is computed here from its row of the table alone.  Per batch, the
counters that read the same rows (the records of the same event types, or
their salt groups) by the same attributes share one
:func:`~mpcache.telemetry.batch.group_sums` over cell columns — no decoding —
and each gets one ``add`` per attribute set of the batch:

* attributes come from fixed fields of the record (NAME values as is, INT ones
  as decimal strings) or from the salt group (its cache_salt or model_name);
  ``cache_salt`` is capped per metric (:class:`~mpcache.telemetry.cardinality.SaltCap`),
  admitting values in the order of their intern ids within a batch;
* an attribute set is reported when the batch has rows for it (a sum of 0
  included); an unlabelled counter only when its total is not 0, since it
  is exported as 0 from start-up; a counter labelled by ``l2_name`` alone
  starts at 0 for every configured adapter type.

A table-driven counter is one row of the table and nothing else: each section of the table that has such
rows gets one subscriber (:func:`counter_subscribers`), which computes them all and is named after the
section (the name ``event_bus.subscriber_exceptions`` reports).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpcache.contract.events import SCHEMAS, EventType, FieldKind
from mpcache.telemetry.batch import EventBatch, group_sums
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber, run_all
from mpcache.telemetry.cardinality import CLIENT_LABELS, DEFAULT_SERIES_CAP, SaltCap, SeriesCap
from mpcache.telemetry.metric_table import SECTIONS, Derivation, Label, Origin, Section, Source
from mpcache.telemetry.otel import create_instrument

DEFAULT_SALT_CAP = 1000
_D = Derivation


class _Counter:
    """One table-driven counter: its instrument, what it sums and how its attributes are capped."""

    __slots__ = ("name", "instrument", "derivation", "field", "names", "caps", "series")

    def __init__(self, name: str, instrument: Any, source: Source, salt_cap: int, series_cap: int) -> None:
        self.name = name
        self.instrument = instrument
        self.derivation = source.derivation
        self.field = source.field
        self.names = source.attributes
        self.caps = [SaltCap(salt_cap) if name == "cache_salt" else None for name in self.names]
        self.series = SeriesCap(self.names, series_cap) if CLIENT_LABELS & set(self.names) else None


class _Plan:
    """The counters that read the same rows by the same attributes: one group-by per batch.

    Rows are the records of ``events`` (for counts and sums; only those whose
    ``positive`` field is > 0 when that is set) or their salt groups.
    """

    def __init__(self, source: Source) -> None:
        self.events = source.events
        self.etype_ids = frozenset(int(etype) for etype in source.events)
        self.salt_groups = source.derivation is _D.SALT_COUNT
        self.positive = source.field if source.derivation is _D.POSITIVE_FIELD_SUM else ""
        self.keys = source.labels
        self.fields = [label.field for label in source.labels if label.origin is Origin.FIELD]
        # how each key column is decoded: True = an interned name, False = an int
        self.named = [label.origin is not Origin.FIELD or _field_kind(source, label) is FieldKind.NAME
                      for label in source.labels]
        self.counters: list[_Counter] = []

    @staticmethod
    def key(source: Source) -> tuple[object, ...]:
        positive = source.field if source.derivation is _D.POSITIVE_FIELD_SUM else ""
        keys = tuple((label.origin, label.field) for label in source.labels)
        return source.derivation is _D.SALT_COUNT, source.events, keys, positive

    def run(self, batch: EventBatch) -> None:
        if self.salt_groups:
            salts, models, counts, fields = batch.salt_groups(self.events, self.fields)
            keys = [fields[label.field] if label.origin is Origin.FIELD
                    else salts if label.field == "cache_salt" else models for label in self.keys]
            weights = [counts] * len(self.counters)
        else:
            keys, weights = self._event_rows(batch)
        groups = group_sums(keys, weights)
        if not groups:
            return
        if not self.keys:
            for counter, total in zip(self.counters, groups[()]):
                if total:
                    counter.instrument.add(total)
            return
        name = batch.names.name
        named = self.named
        labelled = [
            (tuple(name(v) if is_name else str(v) for v, is_name in zip(group, named)), sums)
            for group, sums in groups.items()
        ]
        for index, counter in enumerate(self.counters):
            caps, series = counter.caps, counter.series
            folded: dict[tuple[str, ...], int] = {}
            for values, sums in labelled:
                values = tuple(cap(v) if cap else v for v, cap in zip(values, caps))
                if series is not None:
                    values = series(values)
                folded[values] = folded.get(values, 0) + sums[index]
            names = counter.names
            for values, total in folded.items():
                counter.instrument.add(total, dict(zip(names, values)))

    def _event_rows(self, batch: EventBatch) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Key and weight columns over the records of ``events`` (per type, concatenated)."""
        parts: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
        present = batch.etypes_present
        for etype in self.events:
            if int(etype) not in present:
                continue
            keep = batch.field_column(etype, self.positive) > 0 if self.positive else None
            keys = [batch.field_column(etype, field) for field in self.fields]
            weights = [_weight(batch, etype, counter) for counter in self.counters]
            if keep is not None:
                keys = [column[keep] for column in keys]
                weights = [column[keep] for column in weights]
            parts.append((keys, weights))
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return [], []
        return ([np.concatenate(columns) for columns in zip(*(keys for keys, _ in parts))],
                [np.concatenate(columns) for columns in zip(*(weights for _, weights in parts))])


def _weight(batch: EventBatch, etype: EventType, counter: _Counter) -> np.ndarray:
    """What each record of ``etype`` adds to ``counter``."""
    derivation = counter.derivation
    if derivation is _D.EVENT_COUNT:
        return np.ones(len(batch.heads_of((etype,))), dtype=np.int64)
    column = batch.field_column(etype, counter.field)
    if derivation is _D.TRUE_COUNT or derivation is _D.NONZERO_COUNT:  # a bool field is 0 or 1
        tested: np.ndarray = column != 0
        return tested
    if derivation is _D.FALSE_COUNT or derivation is _D.ZERO_COUNT:
        tested = column == 0
        return tested
    return column


def _field_kind(source: Source, label: Label) -> FieldKind:
    etype = label.event or source.events[0]
    return dict(SCHEMAS[etype].fields)[label.field]


class TableCountersSubscriber(Subscriber):
    """The table-driven counters of one section of the metric table.

    ``salt_cap``: distinct cache_salt values per metric; ``series_cap``: attribute sets per metric
    (:mod:`mpcache.telemetry.cardinality`); ``l2_names``: the configured adapters' type names, exported as 0
    until they complete a task.
    """

    def __init__(self, meter: MeterLike, section: Section, salt_cap: int = DEFAULT_SALT_CAP,
                 l2_names: Sequence[str] = (), series_cap: int = DEFAULT_SERIES_CAP) -> None:
        if not section.counters:
            raise ValueError(f"section {section.key} has no table-driven counter")
        self._section = section
        plans: dict[tuple[object, ...], _Plan] = {}
        for spec in section.counters:
            counter = _Counter(spec.otel_name, create_instrument(meter, spec.otel_name), spec.source, salt_cap,
                               series_cap)
            plans.setdefault(_Plan.key(spec.source), _Plan(spec.source)).counters.append(counter)
            if not counter.names:
                counter.instrument.add(0)
            elif counter.names == ("l2_name",):
                for l2_name in dict.fromkeys(l2_names):
                    counter.instrument.add(0, {"l2_name": l2_name})
        self._plans = list(plans.values())
        self.event_types = tuple(dict.fromkeys(etype for plan in self._plans for etype in plan.events))
        # the counters whose attribute values are capped: what a checkpoint saves of this subscriber
        self._capped = {counter.name: counter for plan in self._plans for counter in plan.counters
                        if counter.series is not None or any(counter.caps)}

    @property
    def name(self) -> str:
        return self._section.counters_subscriber

    def on_batch(self, batch: EventBatch) -> None:
        present = batch.etypes_present
        for plan in self._plans:
            if not plan.etype_ids.isdisjoint(present):
                plan.run(batch)

    def save_state(self) -> object:
        """Per capped counter, the cache_salt values (per attribute) and attribute sets it admitted."""
        return {name: [[cap.save_state() if cap else None for cap in counter.caps],
                       counter.series.save_state() if counter.series else None]
                for name, counter in self._capped.items()}

    def load_state(self, state: object) -> Callable[[], None]:
        if type(state) is not dict or set(state) != set(self._capped):
            raise ValueError("not the capped counters of this section")
        steps: list[Callable[[], None]] = []
        for name, counter in self._capped.items():
            entry = state[name]
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not list:
                raise ValueError(f"{name}: not a counter's caps")
            caps, series = entry
            if len(caps) != len(counter.caps) or (series is None) != (counter.series is None):
                raise ValueError(f"{name}: not its caps")
            for cap, saved in zip(counter.caps, caps):
                if (cap is None) != (saved is None):
                    raise ValueError(f"{name}: not its caps")
                if cap is not None:
                    steps.append(cap.load_state(saved))
            if counter.series is not None:
                steps.append(counter.series.load_state(series))
        return lambda: run_all(steps)


COUNTER_SECTIONS: tuple[Section, ...] = tuple(section for section in SECTIONS if section.counters)


def counter_subscribers(meter: MeterLike, salt_cap: int = DEFAULT_SALT_CAP, l2_names: Sequence[str] = (),
                        series_cap: int = DEFAULT_SERIES_CAP) -> list[TableCountersSubscriber]:
    """One subscriber per section with table-driven counters: every plain counter of the table."""
    return [TableCountersSubscriber(meter, section, salt_cap, l2_names, series_cap) for section in COUNTER_SECTIONS]
