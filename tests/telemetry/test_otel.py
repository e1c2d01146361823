"""MeterProvider set-up: Prometheus names and target_info, port 0, OTLP push and a final export at shutdown, the
flush before a scrape."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.metrics import Observation

from mpcache.contract.events import EventType as E
from mpcache.telemetry import metric_table, otlp
from mpcache.telemetry.buffered import BufferedMeter, InstrumentBuffer
from mpcache.telemetry.bus import TELEMETRY_FLUSH_INTERVAL_S, EventBus, Subscriber
from mpcache.telemetry.otel import MetricsExport, create_instrument
from mpcache.telemetry.subscribers.metrics.counters import counter_subscribers

SPEC_TSV = Path(__file__).resolve().parents[2] / "spec" / "metrics.tsv"
HISTOGRAM_SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample_names(exposition: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and not line.startswith("#")}


def create_every_instrument_with_one_point(meter) -> None:
    """Every OTel instrument of the table but those MetricsExport creates itself."""
    for spec in metric_table.METRICS:
        if not spec.otel_name or spec.source.derivation.exporter_made:
            continue
        if spec.instrument in (metric_table.OBSERVABLE_GAUGE, metric_table.OBSERVABLE_COUNTER):
            create_instrument(meter, spec.otel_name, [lambda _options: [Observation(1)]])
        elif spec.instrument == metric_table.COUNTER:
            create_instrument(meter, spec.otel_name).add(1)
        else:
            create_instrument(meter, spec.otel_name).record(1.0)


@pytest.fixture
def export(config):
    started = MetricsExport.start(config)
    yield started
    started.shutdown()


def test_prometheus_names_are_exactly_the_spec_names(export):
    """With every instrument created from the table, /metrics serves exactly metrics.tsv's Prometheus names and
    those of the table's rows beyond the spec (its own series and the exporters' included), nothing else."""
    with SPEC_TSV.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    beyond = [spec for section in metric_table.SECTIONS if not section.specified for spec in section.rows]
    expected = set()
    for row in rows + [{"prometheus_name": s.prometheus_name, "instrument": s.instrument} for s in beyond]:
        if row["instrument"] == metric_table.HISTOGRAM:
            expected |= {row["prometheus_name"] + suffix for suffix in HISTOGRAM_SAMPLE_SUFFIXES}
        else:
            expected.add(row["prometheus_name"])
    create_every_instrument_with_one_point(export.meter_provider.get_meter("test"))
    assert sorted(expected) == sorted(sample_names(scrape(export.prometheus_port)))


def test_target_info_carries_the_instance_id_and_service_name(export, config):
    """The resource reaches Prometheus as target_info{host_name, service_instance_id, service_name}."""
    create_instrument(export.meter_provider.get_meter("test"), "lmcache_mp.l1_eviction_loop_ticks").add(0)
    lines = [line for line in scrape(export.prometheus_port).splitlines() if line.startswith("target_info{")]
    assert [f'target_info{{host_name="{socket.gethostname()}",service_instance_id="{config.instance_id}",'
            'service_name="mpcache"} 1.0'] == lines


def test_lifecycle_histogram_exposes_a_300s_bucket(export):
    """The explicit bucket advice reaches the exposition: a sample of 300 s lands in le="300.0"."""
    create_instrument(export.meter_provider.get_meter("test"), "lmcache_mp.l1_chunk_evict_reuse_gap").record(300.0)
    lines = [line for line in scrape(export.prometheus_port).splitlines()
             if line.startswith("lmcache_mp_l1_chunk_evict_reuse_gap_seconds_bucket{le=\"240.0\"")
             or line.startswith("lmcache_mp_l1_chunk_evict_reuse_gap_seconds_bucket{le=\"300.0\"")]
    assert [" 0.0", " 1.0"] == [line[line.rindex(" "):] for line in lines]


def test_port_zero_binds_a_free_port_and_shutdown_stops_serving(config):
    """With port 0 the bound port is reported; after shutdown nothing answers on it."""
    started = MetricsExport.start(config)
    port = started.prometheus_port
    url = started.metrics_url
    create_instrument(started.meter_provider.get_meter("test"), "lmcache_mp.l1_eviction_loop_ticks").add(0)
    reachable_before = "lmcache_mp_l1_eviction_loop_ticks_total" in scrape(port)
    started.shutdown()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert (True, f"http://127.0.0.1:{port}/metrics", True) == (port > 0, url, reachable_before)


def test_observable_instrument_without_callbacks_is_refused(metrics):
    """create_instrument insists that observable instruments get callbacks (and others do not)."""
    with pytest.raises(ValueError):
        create_instrument(metrics.meter, "lmcache_mp.event_bus.queue_depth")
    with pytest.raises(ValueError):
        create_instrument(metrics.meter, "lmcache_mp.l1_read", [lambda _options: []])


def test_http_endpoint_without_path_gets_v1_metrics(config):
    """A bare OTLP/HTTP base URL is completed with the standard /v1/metrics path."""
    exporter = otlp.build_exporter(dataclasses.replace(config, otlp_endpoint="http://collector:4318",
                                                       otlp_protocol="http"), otlp.METRICS)
    assert "http://collector:4318/v1/metrics" == exporter._endpoint


def exported_names(requests: list) -> tuple[set[str], set[str]]:
    """(metric names, service.instance.id values) in OTLP export requests."""
    names, instances = set(), set()
    for request in requests:
        for resource_metrics in request.resource_metrics:
            for attribute in resource_metrics.resource.attributes:
                if attribute.key == "service.instance.id":
                    instances.add(attribute.value.string_value)
            for scope_metrics in resource_metrics.scope_metrics:
                names |= {metric.name for metric in scope_metrics.metrics}
    return names, instances


def test_otlp_http_push_exports_once_more_at_shutdown(config, otlp_receiver):
    """With an OTLP/HTTP endpoint (interval far away), shutdown still exports: to /v1/metrics, with the resource."""
    collector = otlp_receiver("http")
    started = MetricsExport.start(dataclasses.replace(
        config, otlp_endpoint=collector.endpoint, otlp_protocol="http", otlp_interval_s=3600))
    create_instrument(started.meter_provider.get_meter("test"), "lmcache_mp.l1_read").add(3)
    started.shutdown()
    paths = {path for path, _ in collector.seen}
    names, instances = exported_names(collector.received())
    assert ({"/v1/metrics"}, True, {config.instance_id}) == (paths, "lmcache_mp.l1_read" in names, instances)


def test_otlp_grpc_push_exports_once_more_at_shutdown(config, otlp_receiver):
    """With an OTLP/gRPC endpoint, shutdown exports the counters with the resource to the collector."""
    collector = otlp_receiver("grpc")
    started = MetricsExport.start(dataclasses.replace(
        config, otlp_endpoint=f"http://{collector.endpoint}", otlp_protocol="grpc", otlp_interval_s=3600))
    create_instrument(started.meter_provider.get_meter("test"), "lmcache_mp.l1_write").add(2)
    started.shutdown()
    names, instances = exported_names(collector.received())
    assert (True, {config.instance_id}) == ("lmcache_mp.l1_write" in names, instances)


def test_the_resource_takes_otel_service_name_and_resource_attributes_but_keeps_the_instance_id(config, monkeypatch):
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES reach the Resource (the SDK's detector), host.name
    among them replacing this host's name; a service.instance.id among them does not replace the configured one."""
    from mpcache.telemetry.otel import build_resource

    monkeypatch.setenv("OTEL_SERVICE_NAME", "kv-cache")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,team=inference,"
                                                   "service.instance.id=spoofed,host.name=node-7")
    assert {"service.name": "kv-cache", "deployment.environment": "staging", "team": "inference",
            "host.name": "node-7", "service.instance.id": config.instance_id} == dict(build_resource(config).attributes)
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert {"service.name": "mpcache", "host.name": socket.gethostname(),
            "service.instance.id": config.instance_id} == dict(build_resource(config).attributes)


@contextlib.contextmanager
def running_pump(export, pipeline, *subscribers):
    """The table-driven counters (and ``subscribers``) on a buffered meter of ``export``'s provider, fed by a
    pump running as in the telemetry process, on a bus whose clock stands still, so that its periodic flush
    never comes; ``export``'s scrapes catch the pump up first, as the telemetry process's do."""
    bus = EventBus(flush_interval_s=TELEMETRY_FLUSH_INTERVAL_S, clock=lambda: 0.0)
    buffer = InstrumentBuffer()
    bus.add_flusher(buffer.flush)
    pipeline.bus = bus
    pipeline.subscribe(*counter_subscribers(BufferedMeter(export.meter_provider.get_meter("test"), buffer)),
                       *subscribers)
    pump = pipeline.pump()
    export.before_collect.append(pump.catch_up)
    stop = threading.Event()
    # it would sleep for an hour between polls: only a scrape's catch-up or the stop wakes it
    thread = threading.Thread(target=pump.run, args=(stop.is_set,), kwargs={"max_sleep_s": 3600.0})
    thread.start()
    try:
        yield pump
    finally:
        stop.set()
        pump.catch_up()  # wakes it: it sees the stop
        thread.join(30)


def _ticks(exposition: str) -> tuple[float, float]:
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in exposition.splitlines()
              if line.startswith("lmcache_mp_l1_eviction_loop_")}
    return (values.get("lmcache_mp_l1_eviction_loop_ticks_total", 0.0),
            values.get("lmcache_mp_l1_eviction_loop_triggered_total", 0.0))


def test_a_scrape_shows_every_record_published_before_it(export, pipeline):
    """/metrics wakes the pump, which polls the rings and flushes the buffered instruments before the
    collection: what was published just before a scrape is in it, exactly, though the pump sleeps
    between polls and the bus's own flush never comes."""
    with running_pump(export, pipeline):
        for triggered in (True, False, True, True, False):
            pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, triggered))
        first = _ticks(scrape(export.prometheus_port))
        pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, True))
        assert (first, _ticks(scrape(export.prometheus_port))) == ((5.0, 3.0), (6.0, 4.0))


def test_an_otlp_export_shows_every_record_published_before_it(config, otlp_receiver, pipeline):
    """Each OTLP export first catches the pump up, as a scrape does: with the bus's own flush never coming
    and no scrape, the exports still carry the records published before them, exactly."""
    collector = otlp_receiver("grpc")
    export = MetricsExport.start(dataclasses.replace(
        config, otlp_endpoint=f"http://{collector.endpoint}", otlp_protocol="grpc", otlp_interval_s=0.2))

    def ticks(receiver) -> list[float]:
        return [point.as_int for _, metric in receiver.metrics() if metric.name == "lmcache_mp.l1_eviction_loop_ticks"
                for point in metric.sum.data_points]

    try:
        with running_pump(export, pipeline):
            for triggered in (True, False, True):
                pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, triggered))
            arrived = collector.wait(lambda r: 3 in ticks(r), 30)
    finally:
        export.shutdown()
    assert (True, {3}) == (arrived, set(ticks(collector)) - {0})


def test_a_scrape_does_not_wait_for_a_stuck_subscriber(export, pipeline):
    """A poll that does not finish (a subscriber stuck in on_batch) holds a scrape up for CATCH_UP_WAIT_S
    at most: the scrape is answered with what the last flush left, and once the poll ends the next scrape
    has it; a pump that is not running holds no scrape up at all."""
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    class Stuck(Subscriber):
        event_types = (E.L1_EVICTION_LOOP_TICK,)

        def on_batch(self, batch) -> None:
            if armed.is_set():
                entered.set()
                release.wait(30)

    with running_pump(export, pipeline, Stuck()) as pump:
        pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, True))
        before = _ticks(scrape(export.prometheus_port))
        armed.set()
        pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, False))
        waker = threading.Thread(target=pump.catch_up)  # wakes the pump: its poll delivers the record and sticks
        waker.start()
        try:
            assert entered.wait(10)
            during = _ticks(scrape(export.prometheus_port))
        finally:
            release.set()
            waker.join(10)
        after = _ticks(scrape(export.prometheus_port))
    started = time.monotonic()
    stopped = pump.catch_up(timeout_s=60)
    assert (before, during, after, stopped, time.monotonic() - started < 30) == (
        (1.0, 1.0), (1.0, 1.0), (2.0, 1.0), False, True)
