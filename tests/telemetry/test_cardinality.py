"""The per-metric cache_salt cap."""

from __future__ import annotations

import pytest

from mpcache.telemetry.cardinality import OVERFLOW_SALT, SaltCap


def test_salts_beyond_the_cap_become_overflow_and_admitted_ones_stay():
    """The first ``cap`` distinct salts pass through, later ones map to __overflow__, admitted ones keep passing."""
    cap = SaltCap(2)
    assert ["a", "b", OVERFLOW_SALT, "a", OVERFLOW_SALT] == [cap(s) for s in ("a", "b", "c", "a", "d")]


def test_cap_below_one_is_rejected():
    """A cap of 0 would send everything to __overflow__, so it is refused."""
    with pytest.raises(ValueError):
        SaltCap(0)


def test_a_metric_admits_series_up_to_its_cap_then_folds_client_labels_into_overflow():
    """Past the cap, a new attribute set keeps its service labels and reports cache_salt and model_name as
    __overflow__; admitted sets keep passing unchanged."""
    from mpcache.telemetry.cardinality import SeriesCap

    cap = SeriesCap(("during", "model_name", "cache_salt"), 2)
    assert [("l1", "m1", "a"), ("l1", "m2", "a"), ("l2", OVERFLOW_SALT, OVERFLOW_SALT), ("l1", "m1", "a")] == [
        cap(v) for v in (("l1", "m1", "a"), ("l1", "m2", "a"), ("l2", "m3", "b"), ("l1", "m1", "a"))]


def test_thousands_of_model_names_stay_below_the_sdks_series_limit(pipeline, ring_factory, metrics):
    """4200 distinct model names through a lookup counter: at most cap + 1 series, the later names counted under
    __overflow__ (nothing lost), never OpenTelemetry's attribute-less otel_metric_overflow."""
    from mpcache.contract.events import EventType as E
    from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
    from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber

    pipeline = type(pipeline)(ring_factory(capacity=1 << 14, intern_capacity=8192))  # room for 4200 names
    lookups = SECTIONS_BY_KEY["Lookup"]
    pipeline.subscribe(TableCountersSubscriber(metrics.provider.get_meter("t"), lookups, 10_000, (), 1500))
    for i in range(4200):
        pipeline.publish(E.MP_LOOKUP_PREFETCH_END, (f"m{i}", "tenant", 1, 256, 256, 256, 0, "", 256, 256, 1, 0),
                         session_id=f"r{i}")
        if i % 500 == 499:
            pipeline.deliver()
    pipeline.deliver()
    series = metrics.series("lmcache_mp.lookup_requested")
    assert len(series) == 1501
    assert 4200 * 256 == sum(series.values())
    assert (4200 - 1500) * 256 == metrics.value("lmcache_mp.lookup_requested", model_name=OVERFLOW_SALT,
                                                cache_salt=OVERFLOW_SALT)


def test_numbers_and_devices_clients_choose_fold_past_the_cap_too():
    """An engine id, an instance id and a worker id are any number a client sends, and a device names the worker's
    rank: past the cap they read __overflow__ with the model and salt, so a client sending a new engine id per
    request cannot grow a metric's series (nor the checkpoint that keeps them)."""
    from mpcache.telemetry.cardinality import SeriesCap

    engines = SeriesCap(("engine_id", "device", "model_name"), 1)
    assert [("7", "cpu:0", "m"), (OVERFLOW_SALT,) * 3, ("7", "cpu:0", "m")] == [
        engines(v) for v in (("7", "cpu:0", "m"), ("8", "cpu:1", "m"), ("7", "cpu:0", "m"))]
    instances = SeriesCap(("instance_id", "model_name"), 1)
    assert [("2", "m"), (OVERFLOW_SALT,) * 2] == [instances(("2", "m")), instances(("3", "m"))]


def test_thousands_of_engine_ids_stay_within_the_series_cap(pipeline, metrics):
    """1,000 engine ids, each delivering chunks: ``num_chunks_loaded`` keeps at most cap + 1 series, the later
    engines counted under __overflow__ (nothing lost)."""
    from mpcache.contract.events import EventType as E
    from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
    from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber

    pipeline.subscribe(TableCountersSubscriber(metrics.provider.get_meter("t"), SECTIONS_BY_KEY["Engine"], 10_000,
                                               (), 50))
    for engine in range(1000):
        pipeline.publish(E.MP_RETRIEVE_END, ("cpu:0", engine, "m", "t", 2, 8192, 512), session_id=f"r{engine}")
        if engine % 200 == 199:
            pipeline.deliver()
    series = metrics.series("lmcache_mp.num_chunks_loaded")
    assert len(series) == 51 and 2000 == sum(series.values())
    assert (1000 - 50) * 2 == metrics.value("lmcache_mp.num_chunks_loaded", worker_id=OVERFLOW_SALT,
                                            model_name=OVERFLOW_SALT, cache_salt=OVERFLOW_SALT)
