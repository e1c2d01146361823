"""The metric table's section on the KV event feed (``subscribe_kv_events``, for cache-aware routers): what each
registered model's chunks take of each tier, and the feed's own state per cache process."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.metric_table.model import (
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    Label,
    Origin,
    Section,
    Source,
    State,
)
from mpcache.telemetry.metric_table.vocabulary import _f, _m, _per_worker


def _capacity(field: str) -> Source:
    return Source(Derivation.LATEST_FIELD, (E.KV_CAPACITY,), field=field,
                  labels=(_f("model_name"), _f("tier")))


def _relay(count: str) -> Source:
    return Source(Derivation.KV_RELAY, field=count, state=State.TELEMETRY, labels=(Label("worker", Origin.SLOT),))


KV_EVENTS = Section("KVEvents", "KV events for cache-aware routers", False, (
    _m("mpcache.kv_capacity_bytes", "mpcache_kv_capacity_bytes", OBSERVABLE_GAUGE, "", _capacity("bytes"),
       "Bytes of each tier (L1, or L2:<name>) of the cache processes serving a registered model, per model: what "
       "a router sizes its model of this cache by (a tier every cache process shares is counted once)."),
    _m("mpcache.kv_capacity_tokens", "mpcache_kv_capacity_tokens", OBSERVABLE_GAUGE, "", _capacity("tokens"),
       "Tokens of the model alone each tier would hold: its bytes over one chunk's objects (every KV rank and "
       "cache group registered there) times the chunk size; 0 for an L2 tier the model's objects do not fit."),
    _m("mpcache.kv_event_subscribers", "mpcache_kv_event_subscribers", OBSERVABLE_GAUGE, "",
       _per_worker(State.SERVER, "G_KV_SUBSCRIBERS"), "subscribe_kv_events streams open, per cache process."),
    _m("mpcache.kv_event_lag_records", "mpcache_kv_event_lag_records", OBSERVABLE_GAUGE, "",
       _per_worker(State.SERVER, "G_KV_LAG"),
       "Records of the KV event log the furthest-behind stream has yet to read, per cache process."),
    _m("mpcache.kv_event_records", "mpcache_kv_event_records_total", OBSERVABLE_COUNTER, "",
       _per_worker(State.SERVER, "G_KV_RECORDS"), "Records appended to the KV event log (stored and removed, L1 "
       "and L2), per cache process (kept across its restarts)."),
    _m("mpcache.kv_event_skipped_records", "mpcache_kv_event_skipped_records_total", OBSERVABLE_COUNTER, "",
       _per_worker(State.SERVER, "G_KV_SKIPPED"), "Records a stream never got because the log (--kv-event-log-size) "
       "let them go before it read them, per cache process (kept across its restarts)."),
    _m("mpcache.kv_event_resyncs", "mpcache_kv_event_resyncs_total", OBSERVABLE_COUNTER, "",
       _per_worker(State.SERVER, "G_KV_RESYNCS"), "Batches sent with lost (a resync from a snapshot of L1): each "
       "makes LMCache's worker withdraw what it announced, per cache process (kept across its restarts)."),
    _m("mpcache.kv_pub_subscribers", "mpcache_kv_pub_subscribers", OBSERVABLE_GAUGE, "", _relay("subscribers"),
       "Connections to the PUB socket of --kv-events-endpoint (routers' SUBs), per cache process relayed."),
    _m("mpcache.kv_pub_messages", "mpcache_kv_pub_messages_total", OBSERVABLE_COUNTER, "", _relay("messages"),
       "KVEventBatch messages published on it, heartbeats included, per cache process (since the telemetry "
       "process started)."),
    _m("mpcache.kv_pub_records", "mpcache_kv_pub_records_total", OBSERVABLE_COUNTER, "", _relay("records"),
       "BlockStored and BlockRemoved events published on it, per cache process."),
    _m("mpcache.kv_pub_replays", "mpcache_kv_pub_replays_total", OBSERVABLE_COUNTER, "", _relay("replays"),
       "Replay requests answered: gaps routers saw (a PUB drops silently, so this is how drops show), per cache "
       "process."),
    _m("mpcache.kv_pub_resyncs", "mpcache_kv_pub_resyncs_total", OBSERVABLE_COUNTER, "", _relay("resyncs"),
       "AllBlocksCleared published (a new cache incarnation, a lost log, or a router's gap older than the replay "
       "buffer): each makes the routers rebuild their index of that cache process."),
))
