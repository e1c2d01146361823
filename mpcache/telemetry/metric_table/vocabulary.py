"""The words the metric table's rows are written in: a row (``_m``), an attribute read from a field (``_f``) or
from elsewhere (the constants), and each kind of source a row's value is computed from."""

from __future__ import annotations

from mpcache.contract.events import EventType
from mpcache.telemetry.metric_table.model import Derivation, Label, MetricSpec, Origin, Source, State


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


def _failed(etype: EventType, failed: bool) -> Source:
    """Per l2_name, the tasks of ``etype`` with (``failed``) or without a failed chunk."""
    return Source(Derivation.NONZERO_COUNT if failed else Derivation.ZERO_COUNT, (etype,), field="failed_count",
                  labels=(_f("l2_name"),))


def _salts(etypes: tuple[EventType, ...], *labels: Label) -> Source:
    return Source(Derivation.SALT_COUNT, etypes, labels=labels)


def _state(derivation: Derivation, state: State, *words: str, labels: tuple[Label, ...] = ()) -> Source:
    return Source(derivation, state=state, words=words, labels=labels)


def _per_worker(state: State, word: str) -> Source:
    """The gauge-board word ``word`` of every slot, live or not, by worker."""
    return _state(Derivation.SLOT_WORD, state, word, labels=(Label("worker", Origin.SLOT),))
