"""The one table of every metric mpcache exports.

Each row says what an instrument is called (OTel and Prometheus), what kind of
instrument it is, its unit, where its value and attributes come from (a typed
:class:`Source`) and, for histograms, its explicit bucket boundaries.  The
table is the only description of a metric:

* instruments are created from it (:func:`mpcache.telemetry.otel.create_instrument`);
* the plain counters are computed from it: one table-driven subscriber
  (:mod:`mpcache.telemetry.subscribers.metrics.counters`) reads each counter's
  :class:`Source` and aggregates the batch accordingly; the histograms and
  observable instruments have hand-written subscribers, whose event types a
  test holds to the sources declared here;
* a test checks every source against the event catalogue
  (:data:`mpcache.contract.events.SCHEMAS`: the events exist, the named fields
  exist with a fitting kind, salt groups are read only from events that carry
  them, ...) and, where the specification is next to the repository, the
  rows against ``spec/metrics.tsv`` (the attributes and the "source events"
  column are rendered from the sources);
* ``docs/METRICS.md`` is generated from it::

    python -m mpcache.telemetry.metric_table --markdown > docs/METRICS.md

The Prometheus name is not computed here: it is what the OTel Prometheus
exporter derives from the OTel name and unit (dots → underscores, the unit as
a suffix, ``_total`` for counters), written out so that a test can hold the
exporter to it.
"""

from __future__ import annotations

import argparse
import enum
import sys
from dataclasses import dataclass

from mpcache.contract import request_times
from mpcache.contract.events import EventType
from mpcache.contract.events import EventType as E

COUNTER = "counter"
HISTOGRAM = "histogram"
OBSERVABLE_GAUGE = "observable_gauge"
OBSERVABLE_COUNTER = "observable_counter"

# Seconds-scale lifecycle buckets.  300 s is an edge because the L1
# evict→reuse gap is capped there ("not reused within 5 minutes" is recorded
# as exactly 300 s); without the edge those samples smear into (250, 500] and
# quantiles interpolate up to 500 s.
LIFECYCLE_SECONDS_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0, 240.0,
    300.0, 600.0, 1800.0, 3600.0, 14400.0, 86400.0,
)
# GB/s: from a slow network adapter to host↔GPU copies over PCIe 5 / NVLink-C2C.
THROUGHPUT_GBS_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 100.0, 200.0, 400.0,
)
# Chunk accesses of one cache_salt between two accesses of the same chunk.
REUSE_GAP_OBJECTS_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1_000.0, 2_000.0, 5_000.0, 10_000.0, 20_000.0,
    50_000.0, 100_000.0, 200_000.0, 500_000.0, 1_000_000.0, 10_000_000.0,
)


class Derivation(enum.Enum):
    """How a metric's value is derived from its source."""

    # Counters, computed by the table-driven counter subscriber from ``Source.events``:
    EVENT_COUNT = "event count"  # +1 per event
    FIELD_SUM = "field sum"  # + the int field ``Source.field`` of each event
    POSITIVE_FIELD_SUM = "positive field sum"  # the same, over the events whose field is > 0 only
    TRUE_COUNT = "true count"  # +1 per event whose bool field is true
    FALSE_COUNT = "false count"  # +1 per event whose bool field is false
    SALT_COUNT = "salt-group count"  # + the count of each salt group of each event
    # Histograms, computed by hand-written subscribers with per-key state: a sample is
    # recorded at one of ``Source.events`` and measured from one of ``Source.since``.
    SAMPLED_KEY_SECONDS = "sampled-key seconds"  # seconds between events of the same sampled chunk
    SAMPLED_KEY_ACCESSES = "sampled-key accesses"  # salt-group counts of the chunk's cache_salt in between
    BLOCK_SECONDS = "block seconds"  # seconds between events of the same client GPU block
    THROUGHPUT = "throughput"  # the byte field over the time from a ``since`` event to its ``events`` one
    PRODUCER_BUCKETS = "producer buckets"  # bucket counts, sum and extremes a cache process counted, added as they are
    # Miss-ratio curves and miss reasons (mpcache.telemetry.mrc), from the sampled keys of ``events`` (lookups)
    # against the history that they and ``since`` (stores) build; scaled by 1 / the sampling rate:
    MRC_HIT_RATIO = "miss-ratio curve"  # the curve's hit ratio at a capacity, read at collection time
    SAMPLED_MISSES = "sampled misses"  # + 1/rate per sampled lookup key of the kind the metric counts
    # Observable instruments, read at collection time:
    GAUGE_SUM = "gauge sum"  # gauge-board word(s) ``Source.words`` summed over live cache processes
    GAUGE_RATIO = "gauge ratio"  # the sum of the first word over the sum of the second
    BUS_STATE = "bus state"  # ring and event-bus state

    @property
    def table_driven(self) -> bool:
        """Computed by the table-driven counter subscriber from the source alone."""
        return self in _TABLE_DRIVEN

    @property
    def observable(self) -> bool:
        return self in (Derivation.GAUGE_SUM, Derivation.GAUGE_RATIO, Derivation.BUS_STATE)


_TABLE_DRIVEN = frozenset({
    Derivation.EVENT_COUNT, Derivation.FIELD_SUM, Derivation.POSITIVE_FIELD_SUM, Derivation.TRUE_COUNT,
    Derivation.FALSE_COUNT, Derivation.SALT_COUNT,
})


class Origin(enum.Enum):
    """Where an attribute's value comes from."""

    FIELD = "field"  # a fixed field of the event (``Label.field``: NAME values as is, INT as decimal)
    SALT_GROUP = "salt group"  # the cache_salt or model_name of a salt group (``Label.field``)
    SAMPLED_KEY = "sampled key"  # the cache_salt or model_name of a sampled chunk key (``Label.field``)
    CONFIG = "configuration"  # the configured L2 adapters: their type name or position
    BUS = "event bus"  # a subscriber's class name
    ANALYSIS = "sampled-history analysis"  # a tier, a capacity ratio or a miss reason (docs/MRC.md)


class State(enum.Enum):
    """The state an observable instrument reads, as ``spec/metrics.tsv`` names it."""

    L1 = "L1 state"
    L2 = "L2 state"
    SERVER = "server state"
    BUS = "bus state"


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
      from ``field_event`` when given, else from every type of ``events``;
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

    def describe(self) -> str:
        """One line for ``docs/METRICS.md``: how the value and the attributes are derived."""
        d = Derivation
        field = f"`{self.field}`"
        if self.field_event is not None:
            field += f" of {self.field_event.name}"
        value = {
            d.EVENT_COUNT: "+1 per event",
            d.FIELD_SUM: f"+ {field}",
            d.POSITIVE_FIELD_SUM: f"+ {field} where it is > 0",
            d.TRUE_COUNT: f"+1 per event whose {field} is true",
            d.FALSE_COUNT: f"+1 per event whose {field} is false",
            d.SALT_COUNT: "+ the count of each salt group",
            d.SAMPLED_KEY_SECONDS: f"seconds from {_names(self.since)} to {_names(self.events)} of a sampled chunk",
            d.SAMPLED_KEY_ACCESSES: (f"chunks of the cache_salt accessed from {_names(self.since)} to "
                                     f"{_names(self.events)} of a sampled chunk"),
            d.BLOCK_SECONDS: f"seconds from {_names(self.since)} to {_names(self.events)} of a GPU block",
            d.THROUGHPUT: f"{field} over the time from {_names(self.since)} to {_names(self.events)}",
            d.PRODUCER_BUCKETS: (f"the bucket counts, sum and extremes each {_names(self.events)} carries (the cache "
                                 "process counts every request in this grid)"),
            d.MRC_HIT_RATIO: (f"share of the sampled {_names(self.events)} keys whose LRU reuse distance (bytes, "
                              f"scaled by 1/rate, after {_names(self.since)} / lookups) fits the capacity"),
            d.SAMPLED_MISSES: f"+ 1/rate per sampled {_names(self.events)} key of that kind, per chunk",
            d.GAUGE_SUM: " + ".join(f"`{word}`" for word in self.words) + ", summed over live processes",
            d.GAUGE_RATIO: " over ".join(f"`{word}`" for word in self.words) + ", each summed over live processes",
            d.BUS_STATE: "read from the rings and the bus",
        }[self.derivation]
        origins = [_origin(label) for label in self.labels]
        return "; ".join([value] + [o for o in origins if o])


def _names(etypes: tuple[EventType, ...]) -> str:
    return " / ".join(etype.name for etype in etypes)


def _origin(label: Label) -> str:
    if label.origin is Origin.FIELD:
        return f"{label.name} from `{label.field}`" if label.field != label.name else ""
    if label.origin is Origin.CONFIG:
        return f"{label.name} per configured adapter"
    if label.origin is Origin.BUS:
        return f"{label.name} per subscriber"
    return f"{label.name} of the {label.origin.value}"


@dataclass(frozen=True)
class MetricSpec:
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


def _m(otel: str, prom: str, kind: str, unit: str, source: Source, meaning: str,
       buckets: tuple[float, ...] | None = None) -> MetricSpec:
    return MetricSpec(otel, prom, kind, unit, source, meaning, buckets)


# -- attributes ----------------------------------------------------------------------------------


def _f(name: str, field: str = "", event: EventType | None = None) -> Label:
    """An attribute read from a fixed field (of that name unless ``field`` says otherwise)."""
    return Label(name, Origin.FIELD, field or name, event)


_SALT = Label("cache_salt", Origin.SALT_GROUP, "cache_salt")  # the salt group's cache_salt
_GROUP_MODEL = Label("model_name", Origin.SALT_GROUP, "model_name")  # the salt group's model_name
_KEY_SALT = Label("cache_salt", Origin.SAMPLED_KEY, "cache_salt")  # the sampled key's cache_salt
_KEY_MODEL = Label("model_name", Origin.SAMPLED_KEY, "model_name")  # the sampled key's model_name
_L2_NAME = Label("l2_name", Origin.CONFIG)
_ADAPTER = Label("adapter_index", Origin.CONFIG)

# -- sources -------------------------------------------------------------------------------------


def _count(etype: EventType, *labels: Label) -> Source:
    return Source(Derivation.EVENT_COUNT, (etype,), labels=labels)


def _sum(etype: EventType, field: str, *labels: Label) -> Source:
    return Source(Derivation.FIELD_SUM, (etype,), field=field, labels=labels)


def _true(etype: EventType, field: str) -> Source:
    return Source(Derivation.TRUE_COUNT, (etype,), field=field)


def _false(etype: EventType, field: str) -> Source:
    return Source(Derivation.FALSE_COUNT, (etype,), field=field)


def _salts(etypes: tuple[EventType, ...], *labels: Label) -> Source:
    return Source(Derivation.SALT_COUNT, etypes, labels=labels)


def _state(derivation: Derivation, state: State, *words: str, labels: tuple[Label, ...] = ()) -> Source:
    return Source(derivation, state=state, words=words, labels=labels)


_BUS = Source(Derivation.BUS_STATE, state=State.BUS)
_L1R, _L1W, _L1WR, _L1E = (E.L1_READ_FINISHED, E.L1_WRITE_FINISHED, E.L1_WRITE_FINISHED_AND_READ_RESERVED,
                           E.L1_KEYS_EVICTED)
_SMR, _SMW = E.SM_READ_PREFETCHED_FINISHED, E.SM_WRITE_FINISHED
_L0 = (E.MP_VLLM_BLOCK_ALLOCATION, E.MP_VLLM_END_SESSION)
_L0_SOURCE = Source(Derivation.BLOCK_SECONDS, (E.MP_VLLM_BLOCK_ALLOCATION,), since=_L0,
                    labels=(_f("instance_id", event=E.MP_VLLM_BLOCK_ALLOCATION),
                            _f("model_name", event=E.MP_VLLM_BLOCK_ALLOCATION)))
_LOOKUP_LABELS = (_f("model_name"), _f("cache_salt"))
_L0_L1_LABELS = (_f("engine_id"), _f("device"), _f("model_name"))
_PER_ADAPTER = (_L2_NAME, _ADAPTER)

_S, _G, _O = LIFECYCLE_SECONDS_BUCKETS, THROUGHPUT_GBS_BUCKETS, REUSE_GAP_OBJECTS_BUCKETS

METRICS: tuple[MetricSpec, ...] = (
    # L1 counters
    _m("lmcache_mp.l1_read", "lmcache_mp_l1_read_chunks_total", COUNTER, "chunks", _salts((_L1R,), _SALT),
       "Chunks read from L1 (counted when the read locks are released)."),
    _m("lmcache_mp.l1_write", "lmcache_mp_l1_write_chunks_total", COUNTER, "chunks", _salts((_L1W, _L1WR), _SALT),
       "Chunks committed to L1, by client stores and by L2→L1 prefetch alike."),
    _m("lmcache_mp.l1_evicted", "lmcache_mp_l1_evicted_chunks_total", COUNTER, "chunks", _salts((_L1E,), _SALT),
       "Chunks removed from L1 by eviction."),
    _m("lmcache_mp.l1_eviction_loop_ticks", "lmcache_mp_l1_eviction_loop_ticks_total", COUNTER, "",
       _count(E.L1_EVICTION_LOOP_TICK), "Iterations of the L1 eviction loop (shows the loop is alive)."),
    _m("lmcache_mp.l1_eviction_loop_triggered", "lmcache_mp_l1_eviction_loop_triggered_total", COUNTER, "",
       _true(E.L1_EVICTION_LOOP_TICK, "triggered"),
       "Eviction-loop iterations that found usage above the watermark and evicted."),
    _m("lmcache_mp.l1_usage_ratio", "lmcache_mp_l1_usage_ratio", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_RATIO, State.L1, "G_L1_USED", "G_L1_CAPACITY"),
       "L1 bytes in use over L1 capacity, over all live cache processes, at scrape time."),
    _m("lmcache_mp.l1_allocation_failure", "lmcache_mp_l1_allocation_failure_chunks_total", COUNTER, "chunks",
       _salts((E.L1_ALLOCATION_FAILED,), _f("during"), _GROUP_MODEL),
       "Chunks L1 had no room for, split by whether a client store or an L2 prefetch asked."),
    _m("lmcache_mp.l1_read_failure", "lmcache_mp_l1_read_failure_chunks_total", COUNTER, "chunks",
       _salts((E.L1_READ_FAILED,), _f("during"), _f("reason"), _GROUP_MODEL),
       "Chunks that lookup reported present but could not be read (a race or unexpected eviction, not a miss)."),
    _m("lmcache_mp.timeouts", "lmcache_mp_timeouts_total", COUNTER, "", _count(E.TIMEOUT_RAISED, _f("exception_type")),
       "Timeout errors raised, by exception class."),
    # L1 chunk lifecycle (sampled)
    _m("lmcache_mp.l1_chunk_lifetime", "lmcache_mp_l1_chunk_lifetime_seconds", HISTOGRAM, "seconds",
       Source(Derivation.SAMPLED_KEY_SECONDS, (_L1E,), since=(_L1W, _L1WR), listed=(_L1E,)),
       "Eviction time minus allocation time of each sampled L1 chunk.", _S),
    _m("lmcache_mp.l1_chunk_idle_before_evict", "lmcache_mp_l1_chunk_idle_before_evict_seconds", HISTOGRAM,
       "seconds", Source(Derivation.SAMPLED_KEY_SECONDS, (_L1E,), since=(_L1R, _L1W, _L1WR), listed=(_L1E,)),
       "Eviction time minus last access time of each sampled L1 chunk.", _S),
    _m("lmcache_mp.l1_chunk_reuse_gap", "lmcache_mp_l1_chunk_reuse_gap_seconds", HISTOGRAM, "seconds",
       Source(Derivation.SAMPLED_KEY_SECONDS, (_L1R, _L1W, _L1WR), since=(_L1R, _L1W, _L1WR)),
       "Time between consecutive touches (read or write) of a sampled live L1 chunk.", _S),
    _m("lmcache_mp.l1_chunk_evict_reuse_gap", "lmcache_mp_l1_chunk_evict_reuse_gap_seconds", HISTOGRAM, "seconds",
       Source(Derivation.SAMPLED_KEY_SECONDS, (_L1W, _L1WR), since=(_L1E,), listed=(_L1E, _L1W)),
       "Time from a sampled chunk's eviction to its next write into L1, capped at 300 s (never rewritten = 300 s).",
       _S),
    _m("lmcache_mp.real_reuse_gap", "lmcache_mp_real_reuse_gap_seconds", HISTOGRAM, "seconds",
       Source(Derivation.SAMPLED_KEY_SECONDS, (_SMR,), since=(_SMR, _SMW), labels=(_KEY_SALT,)),
       "Time between a sampled chunk's previous access (read or write) and its next read, per cache_salt.", _S),
    _m("lmcache_mp.real_reuse_gap_objects", "lmcache_mp_real_reuse_gap_objects_chunks", HISTOGRAM, "chunks",
       Source(Derivation.SAMPLED_KEY_ACCESSES, (_SMR,), since=(_SMR, _SMW), labels=(_KEY_SALT,)),
       "Chunk accesses of the same cache_salt between a sampled chunk's previous access and its next read.", _O),
    # L2 counters
    _m("lmcache_mp.l2_store_submitted", "lmcache_mp_l2_store_submitted_requests_total", COUNTER, "requests",
       _count(E.L2_STORE_SUBMITTED), "Store tasks submitted to L2 adapters."),
    _m("lmcache_mp.l2_store_submitted_objects", "lmcache_mp_l2_store_submitted_objects_chunks_total", COUNTER,
       "chunks", _salts((E.L2_STORE_SUBMITTED,), _SALT), "Chunks in store tasks submitted to L2 adapters."),
    _m("lmcache_mp.l2_store_completed", "lmcache_mp_l2_store_completed_requests_total", COUNTER, "requests",
       _count(E.L2_STORE_COMPLETED, _f("l2_name")), "Store tasks an L2 adapter finished, by adapter type."),
    _m("lmcache_mp.l2_store_completed_objects", "lmcache_mp_l2_store_completed_objects_chunks_total", COUNTER,
       "chunks", _salts((E.L2_STORE_COMPLETED,), _SALT), "Chunks an L2 adapter stored successfully."),
    _m("lmcache_mp.l2_prefetch_lookup", "lmcache_mp_l2_prefetch_lookup_requests_total", COUNTER, "requests",
       _count(E.L2_PREFETCH_LOOKUP_SUBMITTED), "Prefetch lookups that asked the L2 adapters which keys they hold."),
    _m("lmcache_mp.l2_prefetch_lookup_objects", "lmcache_mp_l2_prefetch_lookup_objects_chunks_total", COUNTER,
       "chunks", _salts((E.L2_PREFETCH_LOOKUP_SUBMITTED,), _SALT), "Chunks asked about by prefetch lookups."),
    _m("lmcache_mp.l2_prefetch_hit", "lmcache_mp_l2_prefetch_hit_chunks_total", COUNTER, "chunks",
       _sum(E.L2_PREFETCH_LOOKUP_COMPLETED, "prefix_hit_count"),
       "Chunks of the contiguous prefix that prefetch lookups found in L2."),
    _m("lmcache_mp.l2_prefetch_load_submitted", "lmcache_mp_l2_prefetch_load_submitted_requests_total", COUNTER,
       "requests", _sum(E.L2_PREFETCH_LOAD_SUBMITTED, "adapter_count"),
       "Per-adapter load tasks submitted for prefetches."),
    _m("lmcache_mp.l2_prefetch_load_submitted_objects", "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total",
       COUNTER, "chunks", _salts((E.L2_PREFETCH_LOAD_SUBMITTED,), _SALT), "Chunks submitted for loading from L2."),
    _m("lmcache_mp.l2_prefetch_load_completed", "lmcache_mp_l2_prefetch_load_completed_chunks_total", COUNTER,
       "chunks", _salts((E.L2_PREFETCH_LOAD_COMPLETED,), _SALT), "Chunks loaded from L2 into L1 by prefetches."),
    _m("lmcache_mp.l2_load_completed", "lmcache_mp_l2_load_completed_requests_total", COUNTER, "requests",
       _count(E.L2_LOAD_TASK_COMPLETED, _f("l2_name")), "Load tasks an L2 adapter finished, by adapter type."),
    _m("lmcache_mp.l2_evicted", "lmcache_mp_l2_evicted_chunks_total", COUNTER, "chunks",
       _salts((E.L2_KEYS_EVICTED,), _SALT), "Chunks removed from L2 adapters by L2 eviction."),
    # lookup hit rate
    _m("lmcache_mp.lookup_requested", "lmcache_mp_lookup_requested_tokens_total", COUNTER, "tokens",
       _sum(E.MP_LOOKUP_PREFETCH_END, "requested_tokens", *_LOOKUP_LABELS),
       "Chunk-aligned tokens asked for by completed lookups."),
    _m("lmcache_mp.lookup_hit", "lmcache_mp_lookup_hit_tokens_total", COUNTER, "tokens",
       _sum(E.MP_LOOKUP_PREFETCH_END, "hit_tokens", *_LOOKUP_LABELS),
       "Tokens of the contiguous prefix that completed lookups found in L1 or L2."),
    _m("lmcache_mp.l2_prefetch_failure", "lmcache_mp_l2_prefetch_failure_chunks_total", COUNTER, "chunks",
       _salts((E.L2_PREFETCH_FAILED,), _f("reason"), _GROUP_MODEL),
       "Chunks an L2 prefetch could not land in L1, by reason: l1_oom, not_found, integrity (a record that "
       "failed its MAC check: corrupt or forged), l2_error (a load's I/O error or timeout) or lookup_error "
       "(a lookup that could not ask its tier)."),
    # L0 block lifecycle (sampled)
    _m("lmcache_mp.l0_block_lifetime", "lmcache_mp_l0_block_lifetime_seconds", HISTOGRAM, "seconds", _L0_SOURCE,
       "Time from a sampled GPU block's allocation to the reallocation that evicted its contents.", _S),
    _m("lmcache_mp.l0_block_idle_before_evict", "lmcache_mp_l0_block_idle_before_evict_seconds", HISTOGRAM,
       "seconds", _L0_SOURCE,
       "Time from a sampled GPU block's last access to the reallocation that evicted its contents.", _S),
    _m("lmcache_mp.l0_block_reuse_gap", "lmcache_mp_l0_block_reuse_gap_seconds", HISTOGRAM, "seconds", _L0_SOURCE,
       "Time between consecutive uses of a sampled GPU block's cached contents.", _S),
    # throughput
    _m("lmcache_mp.l0_l1_store_throughput", "lmcache_mp_l0_l1_store_throughput_GBs", HISTOGRAM, "GBs",
       Source(Derivation.THROUGHPUT, (E.MP_STORE_END,), since=(E.MP_STORE_START,), field="total_bytes",
              labels=_L0_L1_LABELS),
       "Bytes over duration of each client KV buffer → L1 copy, in GB/s.", _G),
    _m("lmcache_mp.l0_l1_load_throughput", "lmcache_mp_l0_l1_load_throughput_GBs", HISTOGRAM, "GBs",
       Source(Derivation.THROUGHPUT, (E.MP_RETRIEVE_END,), since=(E.MP_RETRIEVE_START,), field="total_bytes",
              labels=_L0_L1_LABELS),
       "Bytes over duration of each L1 → client KV buffer copy, in GB/s.", _G),
    _m("lmcache_mp.l2_store_throughput", "lmcache_mp_l2_store_throughput_GBs", HISTOGRAM, "GBs",
       Source(Derivation.THROUGHPUT, (E.L2_STORE_COMPLETED,), since=(E.L2_STORE_SUBMITTED,),
              field="bytes_transferred", labels=(_f("l2_name", event=E.L2_STORE_COMPLETED),)),
       "Bytes actually written over submit→complete time of each L2 store task, in GB/s (end to end).", _G),
    _m("lmcache_mp.l2_load_throughput", "lmcache_mp_l2_load_throughput_GBs", HISTOGRAM, "GBs",
       Source(Derivation.THROUGHPUT, (E.L2_LOAD_TASK_COMPLETED,), since=(E.L2_LOAD_TASK_SUBMITTED,),
              field="total_bytes", field_event=E.L2_LOAD_TASK_SUBMITTED,
              labels=(_f("l2_name", event=E.L2_LOAD_TASK_COMPLETED),)),
       "Submitted bytes over submit→complete time of each L2 load task, in GB/s (end to end).", _G),
    _m("lmcache_mp.num_chunks_loaded", "lmcache_mp_num_chunks_loaded_total", COUNTER, "",
       Source(Derivation.POSITIVE_FIELD_SUM, (E.MP_RETRIEVE_END,), field="retrieved_count",
              labels=(_f("worker_id", "engine_id"), _f("model_name"), _f("cache_salt"))),
       "Chunks delivered into each client worker's KV buffer."),
    # bus self-monitoring
    _m("lmcache_mp.event_bus.queue_depth", "lmcache_mp_event_bus_queue_depth", OBSERVABLE_GAUGE, "", _BUS,
       "Event records published but not yet consumed, over all rings."),
    _m("lmcache_mp.event_bus.drain_lag_seconds", "lmcache_mp_event_bus_drain_lag_seconds", OBSERVABLE_GAUGE, "", _BUS,
       "Age of the oldest unconsumed event record (0 when every ring is drained)."),
    _m("lmcache_mp.event_bus.dropped_events_total", "lmcache_mp_event_bus_dropped_events_total", OBSERVABLE_COUNTER,
       "", _BUS, "Event records lost: ring full at the producer, torn by a dead producer, or malformed."),
    _m("lmcache_mp.event_bus.subscriber_exceptions", "lmcache_mp_event_bus_subscriber_exceptions_total",
       OBSERVABLE_COUNTER, "", Source(Derivation.BUS_STATE, state=State.BUS, labels=(Label("subscriber_name", Origin.BUS),)),
       "Subscriber callbacks that raised, by class name."),
    # state gauges
    _m("lmcache_mp.active_prefetch_jobs", "lmcache_mp_active_prefetch_jobs", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_SUM, State.SERVER, "G_ACTIVE_PREFETCH"),
       "Prefetch jobs in flight, over all live cache processes."),
    _m("lmcache_mp.l1_memory_usage_bytes", "lmcache_mp_l1_memory_usage_bytes", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_SUM, State.L1, "G_L1_USED"), "Bytes held in L1, over all live cache processes."),
    _m("lmcache_mp.l2_usage_bytes", "lmcache_mp_l2_usage_bytes", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_SUM, State.L2, "G_L2_USAGE", labels=(_L2_NAME,)),
       "Bytes held by each L2 adapter type."),
    _m("lmcache_mp.num_inflight_l2_stores", "lmcache_mp_num_inflight_l2_stores", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_STORES", labels=_PER_ADAPTER),
       "L2 store tasks in flight, per adapter."),
    _m("lmcache_mp.num_inflight_l2_loads", "lmcache_mp_num_inflight_l2_loads", OBSERVABLE_GAUGE, "",
       _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_LOADS", labels=_PER_ADAPTER),
       "L2 load tasks in flight, per adapter."),
    _m("lmcache_mp.inflight_load_memory_usage_bytes", "lmcache_mp_inflight_load_memory_usage_bytes",
       OBSERVABLE_GAUGE, "", _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_LOAD_BYTES", labels=_PER_ADAPTER),
       "L1 bytes reserved by in-flight L2 loads, per adapter."),
    # cache blending
    _m("lmcache_blend.lookup_requests", "lmcache_blend_lookup_requests_total", COUNTER, "",
       _count(E.CB_LOOKUP_START), "Blend lookups started."),
    _m("lmcache_blend.lookup_requested_tokens", "lmcache_blend_lookup_requested_tokens_total", COUNTER, "",
       _sum(E.CB_LOOKUP_END, "requested_tokens"), "Chunk-aligned tokens asked for by finished blend lookups."),
    _m("lmcache_blend.lookup_hit_tokens", "lmcache_blend_lookup_hit_tokens_total", COUNTER, "",
       _sum(E.CB_LOOKUP_END, "hit_tokens"), "Tokens finished blend lookups could serve."),
    _m("lmcache_blend.lookup_fingerprint_hits", "lmcache_blend_lookup_fingerprint_hits_total", COUNTER, "",
       _sum(E.CB_LOOKUP_END, "fingerprint_hits"), "Chunks blend lookups matched in the fingerprint table."),
    _m("lmcache_blend.lookup_storage_hits", "lmcache_blend_lookup_storage_hits_total", COUNTER, "",
       _sum(E.CB_LOOKUP_END, "storage_hits"), "Fingerprint matches that blend lookups confirmed in storage."),
    _m("lmcache_blend.lookup_stale_chunks", "lmcache_blend_lookup_stale_chunks_total", COUNTER, "",
       _sum(E.CB_LOOKUP_END, "stale_chunks"), "Fingerprint matches whose chunks were gone from storage (stale)."),
    _m("lmcache_blend.lookup_no_gpu_context_errors", "lmcache_blend_lookup_no_gpu_context_errors_total", COUNTER, "",
       _true(E.CB_LOOKUP_END, "no_gpu_context"), "Blend lookups that found no GPU context."),
    _m("lmcache_blend.retrieve_requests", "lmcache_blend_retrieve_requests_total", COUNTER, "",
       _count(E.CB_RETRIEVE_START), "Blend retrieves started."),
    _m("lmcache_blend.retrieve_chunks", "lmcache_blend_retrieve_chunks_total", COUNTER, "",
       _sum(E.CB_RETRIEVE_START, "num_chunks"), "Chunks asked for by blend retrieves."),
    _m("lmcache_blend.retrieve_failures", "lmcache_blend_retrieve_failures_total", COUNTER, "",
       _false(E.CB_RETRIEVE_END, "success"), "Blend retrieves that failed."),
    _m("lmcache_blend.store_pre_computed_requests", "lmcache_blend_store_pre_computed_requests_total", COUNTER, "",
       _count(E.CB_STORE_PRE_COMPUTED_START), "Pre-computed blend stores started."),
    _m("lmcache_blend.store_pre_computed_chunks", "lmcache_blend_store_pre_computed_chunks_total", COUNTER, "",
       _sum(E.CB_STORE_PRE_COMPUTED_END, "stored_chunks"), "Chunks written by pre-computed blend stores."),
    _m("lmcache_blend.store_pre_computed_failures", "lmcache_blend_store_pre_computed_failures_total", COUNTER, "",
       _false(E.CB_STORE_PRE_COMPUTED_END, "success"), "Pre-computed blend stores that failed."),
    _m("lmcache_blend.store_final_requests", "lmcache_blend_store_final_requests_total", COUNTER, "",
       _count(E.CB_STORE_FINAL_START), "Final blend stores started."),
    _m("lmcache_blend.store_final_chunks", "lmcache_blend_store_final_chunks_total", COUNTER, "",
       _sum(E.CB_STORE_FINAL_END, "stored_chunks"), "Chunks committed by final blend stores."),
    _m("lmcache_blend.store_final_failures", "lmcache_blend_store_final_failures_total", COUNTER, "",
       _false(E.CB_STORE_FINAL_END, "success"), "Final blend stores that failed."),
    _m("lmcache_blend.fingerprints_registered", "lmcache_blend_fingerprints_registered_total", COUNTER, "",
       _sum(E.CB_FINGERPRINTS_REGISTERED, "num_chunks"), "Chunks newly indexed into the blend fingerprint table."),
    _m("lmcache_blend.chunks_evicted", "lmcache_blend_chunks_evicted_total", COUNTER, "",
       _sum(E.CB_CHUNKS_EVICTED, "num_chunks"), "Stale entries removed from the blend fingerprint table."),
)

# Not in spec/metrics.tsv: the L1 / L2 split of lookup_hit, which the reference
# system also exports (lookup_hit = lookup_hit_l1 + lookup_hit_l2), L2 loads by
# origin, what sharing a tier between hosts buys, and the LMCache front end's service
# time per operation.
EXTRA_METRICS: tuple[MetricSpec, ...] = (
    _m("lmcache_mp.lookup_hit_l1", "lmcache_mp_lookup_hit_l1_tokens_total", COUNTER, "tokens",
       _sum(E.MP_LOOKUP_PREFETCH_END, "l1_hit_tokens", *_LOOKUP_LABELS),
       "Tokens of completed lookups' hits that were in L1."),
    _m("lmcache_mp.lookup_hit_l2", "lmcache_mp_lookup_hit_l2_tokens_total", COUNTER, "tokens",
       _sum(E.MP_LOOKUP_PREFETCH_END, "l2_hit_tokens", *_LOOKUP_LABELS),
       "Tokens of completed lookups' hits that were in L2."),
    _m("mpcache.l2_load", "mpcache_l2_load_chunks_total", COUNTER, "chunks",
       _sum(E.L2_LOAD_ORIGIN, "chunk_count", _f("l2_name"), _f("origin")),
       "Chunks loaded from L2, by who stored them: origin self (this service instance) or peer (another one)."),
    _m("mpcache.lmcache.request", "mpcache_lmcache_request_seconds", HISTOGRAM, "seconds",
       Source(Derivation.PRODUCER_BUCKETS, (E.LMCACHE_REQUEST_TIMES,), labels=(_f("op"),)),
       "Server-side service time of each LMCache-protocol request, from its receipt to its reply sent, by "
       "operation (`invalid`: a request naming no known operation; `wait_prefetch_status` includes its wait).",
       request_times.BUCKETS_S),
)

_MRC_KEY = (_KEY_MODEL, _KEY_SALT)
MRC_METRICS: tuple[MetricSpec, ...] = (
    _m("mpcache.mrc_hit_ratio", "mpcache_mrc_hit_ratio", OBSERVABLE_GAUGE, "",
       Source(Derivation.MRC_HIT_RATIO, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,),
              labels=(Label("tier", Origin.ANALYSIS), *_MRC_KEY, Label("capacity_ratio", Origin.ANALYSIS))),
       "Hit ratio an LRU tier of capacity_ratio × its configured capacity would have had on the sampled "
       "lookups (tier l1: L1 of all cache processes; l1_l2: L1 plus every L2 tier); model_name and "
       "cache_salt \"*\": every lookup."),
    _m("mpcache.lookup_miss", "mpcache_lookup_miss_chunks_total", COUNTER, "chunks",
       Source(Derivation.SAMPLED_MISSES, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,),
              labels=(Label("reason", Origin.ANALYSIS), *_MRC_KEY)),
       "Chunks a lookup asked for and did not get, by reason: cold (never stored in the sampled history), "
       "evicted (stored before, gone), after_gap (in L1 but past the first missing chunk); estimates at a "
       "sample rate below 1, exact at 1."),
    _m("mpcache.l1_evicted_reused", "mpcache_l1_evicted_reused_chunks_total", COUNTER, "chunks",
       Source(Derivation.SAMPLED_MISSES, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,), labels=_MRC_KEY),
       "Chunks a lookup asked for after L1 had evicted them (found in L2 or missed): eviction regret."),
)

ALL_METRICS: tuple[MetricSpec, ...] = METRICS + EXTRA_METRICS + MRC_METRICS
BY_NAME: dict[str, MetricSpec] = {spec.otel_name: spec for spec in ALL_METRICS}
assert len(BY_NAME) == len(ALL_METRICS), "duplicate OTel name in the metric table"

_DEVIATION_NOTE = """\
**Deliberate deviation from the specification's text.** The specification's row for L2
eviction names the OTel instrument `lmcache_mp.l2_evicted_objects` but the Prometheus series
`lmcache_mp_l2_evicted_chunks_total`; no unit turns the first name into the second (unit
`chunks` on `l2_evicted_objects` would give `lmcache_mp_l2_evicted_objects_chunks_total`).
Dashboards and alerts use the Prometheus name, so mpcache keeps it and names the OTel
instrument `lmcache_mp.l2_evicted` (unit `chunks`). OTLP consumers see `lmcache_mp.l2_evicted`.
"""


_HEADER = "| OTel name | Prometheus name | Instrument | Unit | Attributes | Source events | Computed as | Meaning |"
_RULE = "|---|---|---|---|---|---|---|---|"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "—"


def render_markdown() -> str:
    """The text of ``docs/METRICS.md``."""
    lines = [
        "# mpcache metrics",
        "",
        "Generated by `python -m mpcache.telemetry.metric_table --markdown` from",
        "`mpcache/telemetry/metric_table.py`; do not edit by hand.",
        "",
        "Every metric is computed in the telemetry process from the events of `spec/EVENTS.md`",
        "(or, for observable instruments, from bus and gauge-board state at collection time);",
        "\"Computed as\" says how, from the table's typed source of each metric.",
        "Every datapoint carries the resource attributes `service.name=mpcache` and",
        "`service.instance.id` (on Prometheus: the `target_info` series). Counters without",
        "attributes are exported from start-up with value 0. Lifecycle histograms are sampled",
        "(`--metrics-sample-rate`, default 1 %); counters count every event. `cache_salt` is capped",
        "per metric (`--cache-salt-cap`): values beyond the cap are reported as `__overflow__`.",
        "",
        _DEVIATION_NOTE,
        _HEADER,
        _RULE,
    ]
    for spec in METRICS:
        lines.append(_row(spec))
    lines += [
        "",
        "## Additional metrics (not in the specification's table)",
        "",
        _HEADER,
        _RULE,
    ]
    lines += [_row(spec) for spec in EXTRA_METRICS + MRC_METRICS]
    lines += ["", "## Histogram buckets", ""]
    grids = {LIFECYCLE_SECONDS_BUCKETS: "seconds (lifecycle; 300 s, the evict→reuse cap, is an edge)",
             THROUGHPUT_GBS_BUCKETS: "GB/s (throughput)",
             REUSE_GAP_OBJECTS_BUCKETS: "chunks (reuse gap in accesses)",
             request_times.BUCKETS_S: "seconds (request service time)"}
    for grid, label in grids.items():
        users = ", ".join(f"`{spec.otel_name}`" for spec in ALL_METRICS if spec.buckets == grid)
        lines += [f"- {label}: {', '.join(f'{edge:g}' for edge in grid)} — {users}"]
    return "\n".join(lines) + "\n"


def _row(spec: MetricSpec) -> str:
    cells = (f"`{spec.otel_name}`", f"`{spec.prometheus_name}`", spec.instrument.replace("_", " "), spec.unit,
             ", ".join(spec.attributes), spec.source_events.replace(",", ", "), spec.source.describe(), spec.meaning)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.telemetry.metric_table", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/METRICS.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
