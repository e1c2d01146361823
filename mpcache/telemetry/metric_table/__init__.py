"""The metric table: every series mpcache exports, one row each, grouped in sections (:mod:`.rows`).

A row says what a series is called (OTel and Prometheus), what kind of instrument it is, its unit, where its
value and attributes come from (a typed :class:`Source`), what it means and, for a histogram, its bucket
boundaries.  What is derived from the rows:

* every OTel instrument the service exports is created from its row
  (:func:`mpcache.telemetry.otel.create_instrument`);
* a plain counter (a count, field sum or salt-group count of events) is computed from its row alone, by its
  section's table-driven subscriber (:mod:`mpcache.telemetry.subscribers.metrics.counters`);
* ``docs/METRICS.md`` is rendered from the rows (:mod:`.markdown`):
  ``python -m mpcache.telemetry.metric_table --markdown > docs/METRICS.md``.

What is not: the histograms, gauges and the other observable instruments are computed by hand-written
subscribers (and the exporters), whose event types, created instruments and exported names tests hold to
the rows; the tests also hold every source to the event catalogue and the specification's rows to
``spec/metrics.tsv``.  The Prometheus name is not computed here either: it is what the OTel Prometheus
exporter derives from the OTel name and unit (dots → underscores, the unit as a suffix, ``_total`` for
counters), written out so that a test can hold the exporter to it.
"""

from __future__ import annotations

from mpcache.telemetry.metric_table.grids import (
    LIFECYCLE_SECONDS_BUCKETS,
    REQUEST_SECONDS_BUCKETS,
    REUSE_GAP_OBJECTS_BUCKETS,
    THROUGHPUT_GBS_BUCKETS,
)
from mpcache.telemetry.metric_table.model import (
    COUNTER,
    HISTOGRAM,
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    Label,
    MetricSpec,
    Origin,
    Section,
    Source,
    State,
)
from mpcache.telemetry.metric_table.rows import SECTIONS

__all__ = [
    "BY_NAME", "COUNTER", "HISTOGRAM", "LIFECYCLE_SECONDS_BUCKETS", "METRICS", "OBSERVABLE_COUNTER",
    "OBSERVABLE_GAUGE", "REQUEST_SECONDS_BUCKETS", "REUSE_GAP_OBJECTS_BUCKETS", "SECTIONS", "SECTIONS_BY_KEY",
    "SPECIFIED", "THROUGHPUT_GBS_BUCKETS", "Derivation", "Label", "MetricSpec", "Origin", "Section", "Source",
    "State",
]

METRICS: tuple[MetricSpec, ...] = tuple(spec for section in SECTIONS for spec in section.rows)
SPECIFIED: tuple[MetricSpec, ...] = tuple(spec for section in SECTIONS if section.specified for spec in section.rows)
SECTIONS_BY_KEY: dict[str, Section] = {section.key: section for section in SECTIONS}
# The OTel instruments, by OTel name (the Prometheus-only series have none).
BY_NAME: dict[str, MetricSpec] = {spec.otel_name: spec for spec in METRICS if spec.otel_name}
assert len(SECTIONS_BY_KEY) == len(SECTIONS), "duplicate section key in the metric table"
assert len(BY_NAME) == sum(1 for spec in METRICS if spec.otel_name), "duplicate OTel name in the metric table"
assert len({spec.prometheus_name for spec in METRICS}) == len(METRICS), "duplicate Prometheus name in the table"
