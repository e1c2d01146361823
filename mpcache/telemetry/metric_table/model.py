"""What a row of the metric table is: names, instrument, unit, a typed :class:`Source`, meaning, buckets; and the
:class:`Section` that groups rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mpcache.contract.events import EventType

COUNTER = "counter"
HISTOGRAM = "histogram"
OBSERVABLE_GAUGE = "observable_gauge"
OBSERVABLE_COUNTER = "observable_counter"


class Derivation(enum.Enum):
    """How a metric's value is derived from its source."""

    # Counters, computed by the table-driven counter subscriber from ``Source.events``:
    EVENT_COUNT = "event count"  # +1 per event
    FIELD_SUM = "field sum"  # + the int field ``Source.field`` of each event
    POSITIVE_FIELD_SUM = "positive field sum"  # the same, over the events whose field is > 0 only
    TRUE_COUNT = "true count"  # +1 per event whose bool field is true
    FALSE_COUNT = "false count"  # +1 per event whose bool field is false
    NONZERO_COUNT = "nonzero count"  # +1 per event whose int field is not 0 (a task with failed keys)
    ZERO_COUNT = "zero count"  # +1 per event whose int field is 0 (a task without one)
    SALT_COUNT = "salt-group count"  # + the count of each salt group of each event
    # Histograms, computed by hand-written subscribers with per-key state: a sample is
    # recorded at one of ``Source.events`` and measured from one of ``Source.since``.
    SAMPLED_KEY_SECONDS = "sampled-key seconds"  # seconds between events of the same sampled chunk
    SAMPLED_KEY_ACCESSES = "sampled-key accesses"  # salt-group counts of the chunk's cache_salt in between
    BLOCK_SECONDS = "block seconds"  # seconds between events of the same client GPU block
    THROUGHPUT = "throughput"  # the byte field over the time from a ``since`` event to its ``events`` one
    PRODUCER_BUCKETS = "producer buckets"  # bucket counts, sum and extremes a cache process counted, added as they are
    # Gauges from events: the int field ``Source.field`` of the newest event per cache process and attribute set
    # (forgotten a few seconds after its last), summed over cache processes, read at collection time:
    LATEST_FIELD = "latest field"
    # Miss-ratio curves and miss reasons (mpcache.telemetry.mrc), from the sampled keys of ``events`` (lookups)
    # against the history that they and ``since`` (stores) build; scaled by 1 / the sampling rate:
    MRC_HIT_RATIO = "miss-ratio curve"  # the curve's hit ratio at a capacity, read at collection time
    SAMPLED_MISSES = "sampled misses"  # + 1/rate per sampled lookup key of the kind the metric counts
    # Observable instruments, read at collection time:
    GAUGE_SUM = "gauge sum"  # gauge-board word(s) ``Source.words`` summed over live cache processes
    GAUGE_RATIO = "gauge ratio"  # the sum of the first word over the sum of the second
    BUS_STATE = "bus state"  # ring and event-bus state
    CHECKPOINT = "checkpoint"  # the telemetry process's checkpoint (mpcache.telemetry.checkpoint)
    SLOT_COUNT = "slot count"  # the gauge board's slots: one per configured cache process
    LIVE_SLOT_COUNT = "live slot count"  # the slots whose heartbeat is fresh
    RESTART_COUNT = "restart count"  # the supervisor's restart counts, per child role
    SLOT_WORD = "slot word"  # the word ``Source.words`` of every slot, live or not
    KV_RELAY = "kv relay"  # the telemetry process's KV event relay (--kv-events-endpoint): its count ``Source.field``
    BUILD = "build"  # 1, with this build's version
    # Created by the exporters themselves, not from events or shared memory:
    RESOURCE = "resource"  # the OTel resource, as Prometheus's target_info
    PROCESS = "process"  # prometheus_client's process collector: /proc of the telemetry process
    PROCESS_SAMPLE = "process sample"  # psutil of the service's processes (by role and worker), at collection

    @property
    def table_driven(self) -> bool:
        """Computed by the table-driven counter subscriber from the source alone."""
        return self in _TABLE_DRIVEN

    @property
    def observable(self) -> bool:
        """Read from shared memory or the bus at collection time, not computed from events."""
        return self in _OBSERVABLE

    @property
    def outlives_telemetry(self) -> bool:
        """An observable counter whose value a telemetry restart keeps (in shared memory or the telemetry
        process's checkpoint): its series start when the supervisor's first telemetry process did."""
        return self in (Derivation.BUS_STATE, Derivation.CHECKPOINT, Derivation.RESTART_COUNT, Derivation.SLOT_WORD)

    @property
    def exporter_made(self) -> bool:
        """Exported by the exporters (:class:`mpcache.telemetry.otel.MetricsExport`), not by a subscriber."""
        return self in (Derivation.BUILD, Derivation.RESOURCE, Derivation.PROCESS)


_TABLE_DRIVEN = frozenset({
    Derivation.EVENT_COUNT, Derivation.FIELD_SUM, Derivation.POSITIVE_FIELD_SUM, Derivation.TRUE_COUNT,
    Derivation.FALSE_COUNT, Derivation.NONZERO_COUNT, Derivation.ZERO_COUNT, Derivation.SALT_COUNT,
})
_OBSERVABLE = frozenset({
    Derivation.GAUGE_SUM, Derivation.GAUGE_RATIO, Derivation.BUS_STATE, Derivation.CHECKPOINT, Derivation.SLOT_COUNT,
    Derivation.LIVE_SLOT_COUNT, Derivation.RESTART_COUNT, Derivation.SLOT_WORD, Derivation.KV_RELAY, Derivation.BUILD,
    Derivation.RESOURCE, Derivation.PROCESS, Derivation.PROCESS_SAMPLE,
})


class Origin(enum.Enum):
    """Where an attribute's value comes from."""

    FIELD = "field"  # a fixed field of the event (``Label.field``: NAME values as is, INT as decimal)
    SALT_GROUP = "salt group"  # the cache_salt or model_name of a salt group (``Label.field``)
    SAMPLED_KEY = "sampled key"  # the cache_salt or model_name of a sampled chunk key (``Label.field``)
    CONFIG = "configuration"  # the configured L2 adapters: their type name or position
    BUS = "event bus"  # a subscriber's name
    CHECKPOINT = "checkpoint"  # why a checkpoint was refused
    ANALYSIS = "sampled-history analysis"  # a tier, a capacity ratio or a miss reason (docs/MRC.md)
    SLOT = "gauge-board slot"  # the slot's index, which is the cache process's worker index
    CHILD = "child process"  # the role of a child of the supervisor (cache, telemetry), or the supervisor
    BUILD = "build"  # the mpcache version, the ring writer in use
    RESOURCE = "resource"  # an attribute of the OTel resource


class State(enum.Enum):
    """The state an observable instrument reads, as ``spec/metrics.tsv`` names it (from SUPERVISOR on: mpcache's)."""

    L1 = "L1 state"
    L2 = "L2 state"
    SERVER = "server state"
    BUS = "bus state"
    SUPERVISOR = "supervisor state"
    TELEMETRY = "telemetry state"
    BUILD = "build"
    RESOURCE = "resource"
    PROCESS = "process state"
    PROCESSES = "the service's processes"


@dataclass(frozen=True)
class Label:
    """One attribute of a metric: its name and where its value comes from.

    ``field`` names the event field (``Origin.FIELD``) or the part of a salt
    group or sampled key (``"cache_salt"`` / ``"model_name"``); ``event``,
    for a field, is the one event type of the source that it is read from
    (None: it is read from every type of ``Source.events``).
    """

    name: str
    origin: Origin
    field: str = ""
    event: EventType | None = None


@dataclass(frozen=True)
class Source:
    """Where one metric's value and attributes come from.

    * ``events``: the event types the value is taken at (counted, summed, or a
      histogram sample recorded);
    * ``since``: for histograms, the event types the measured interval starts
      at (or that otherwise move the per-key state the sample is taken from);
    * ``field``: the event field summed, tested or (throughput) divided, read
      from ``field_event`` when given, else from every type of ``events``
      (``KV_RELAY``: the relay's count, an attribute of ``kvpub.FeedCounts``);
    * ``labels``: the attributes, in the order the table lists them;
    * ``state`` / ``words``: for observable instruments, what they read
      (``words``: names of gauge-board word offsets in :mod:`mpcache.shm.layout`);
    * ``listed``: the event types ``spec/metrics.tsv`` lists as the source,
      where it names fewer than :attr:`all_events` (it lists some lifecycle
      histograms by the event a sample is recorded at only).
    """

    derivation: Derivation
    events: tuple[EventType, ...] = ()
    since: tuple[EventType, ...] = ()
    field: str = ""
    field_event: EventType | None = None
    labels: tuple[Label, ...] = ()
    state: State | None = None
    words: tuple[str, ...] = ()
    listed: tuple[EventType, ...] = ()

    @property
    def all_events(self) -> tuple[EventType, ...]:
        """Every event type the metric is computed from, ``since`` first, each once."""
        return tuple(dict.fromkeys(self.since + self.events))

    @property
    def attributes(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)

    @property
    def source_text(self) -> str:
        """The "source events" column of ``spec/metrics.tsv``."""
        if self.state is not None:
            return f"({self.state.value})"
        return ",".join(etype.name for etype in (self.listed or self.all_events))


@dataclass(frozen=True)
class MetricSpec:
    """One exported series.  ``otel_name`` is empty for a series that only Prometheus serves (target_info,
    ``process_*``)."""

    otel_name: str
    prometheus_name: str
    instrument: str
    unit: str
    source: Source
    meaning: str
    buckets: tuple[float, ...] | None = None

    @property
    def attributes(self) -> tuple[str, ...]:
        return self.source.attributes

    @property
    def source_events(self) -> str:
        """As in metrics.tsv: comma-separated event types, or "(… state)"."""
        return self.source.source_text

    @property
    def tsv_row(self) -> tuple[str, ...]:
        """This row in the column order of ``spec/metrics.tsv``."""
        return (self.otel_name, self.prometheus_name, self.instrument, self.unit, ",".join(self.attributes),
                self.source_events)


@dataclass(frozen=True)
class Section:
    """Rows that belong together: one heading of ``docs/METRICS.md``, and one subscriber computing the
    section's table-driven counters (:attr:`counters_subscriber`, the name its exceptions are counted under).

    ``specified``: the rows are rows of ``spec/metrics.tsv`` (in its order); otherwise they are mpcache's own.
    """

    key: str
    title: str
    specified: bool
    rows: tuple[MetricSpec, ...]

    @property
    def counters(self) -> tuple[MetricSpec, ...]:
        """The rows computed by the table-driven counter subscriber."""
        return tuple(spec for spec in self.rows if spec.source.derivation.table_driven)

    @property
    def counters_subscriber(self) -> str:
        """The name of the subscriber that computes :attr:`counters`."""
        return f"{self.key}CountersSubscriber"
