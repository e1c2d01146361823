"""Tracing subscribers: spans rebuilt from events published through a real ring, read from an in-memory exporter.

Every event carries an explicit timestamp, and every span time is asserted to
be exactly the timestamp of the event that opened or closed it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.log_lines import LogLines, logging_restored

from mpcache.contract.events import EventType as E
from mpcache.errors import ConfigError
from mpcache.logs import configure_logging
from mpcache.telemetry import otlp
from mpcache.telemetry.subscribers.spans import INCOMPLETE
from mpcache.telemetry.subscribers.tracing import (
    ROOT_INFERRED,
    TracingSubscriber,
    build_tracing_subscribers,
)
from mpcache.telemetry.tracing import TracingExport

T0 = 1_700_000_000 * 10**9
MS = 10**6
S = 10**9


class Spans:
    """The finished spans of one test, by name, with their parent links."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def names(self) -> list[str]:
        return sorted(span.name for span in self.all())

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.all() if span.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert 1 == len(found), f"expected one {name!r} span, got {self.names()}"
        return found[0]


@pytest.fixture
def spans(config, pipeline):
    """An in-memory exporter behind the real TracingExport, and the tracing subscriber on the pipeline."""
    exporter = InMemorySpanExporter()
    export = TracingExport.start(replace(config, enable_tracing=True, otlp_endpoint="127.0.0.1:1"),
                                 processor=SimpleSpanProcessor(exporter))
    (subscriber,) = build_tracing_subscribers(config, export.tracer_provider)
    pipeline.subscribe(subscriber)
    recorded = Spans(exporter)
    recorded.subscriber = subscriber
    yield recorded
    export.shutdown()


def at(ms: int) -> int:
    return T0 + ms * MS


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def times(span: ReadableSpan) -> tuple[int, int]:
    return span.start_time, span.end_time


def store(pipeline, session: str, start_ms: int, end_ms: int, device: str = "cpu", stored: int = 2,
          submitted: bool = True) -> None:
    if submitted:
        pipeline.publish(E.MP_STORE_SUBMITTED, (device,), session_id=session, timestamp_ns=at(start_ms))
    pipeline.publish(E.MP_STORE_START, (device, 7, "llama"), session_id=session, timestamp_ns=at(start_ms))
    pipeline.publish(E.MP_STORE_END, (device, 7, "llama", stored, stored * 4096, stored * 256), session_id=session,
                     timestamp_ns=at(end_ms))


def test_request_end_with_nothing_in_flight_closes_the_root_at_its_own_time(pipeline, spans):
    """REQUEST_START opens a root ``request`` span; REQUEST_END with no copy in flight ends it at once,
    and its start/end are exactly the two events' timestamps."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.deliver()
    assert [] == spans.names()  # open, not exported yet
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(30))
    pipeline.deliver()
    root = spans.one("request")
    assert ((at(0), at(30)), None, {"session_id": "r1"}) == (times(root), root.parent, dict(root.attributes))
    assert 0 == spans.subscriber.open_sessions


@pytest.fixture
def debug_log():
    """The telemetry process's logging at debug, as ``configure_logging`` sets it, and put back after."""
    with logging_restored():
        lines = LogLines()
        configure_logging("telemetry", "test-instance", "debug", handlers=[lines])
        yield lines


def test_an_end_without_its_start_costs_only_itself(pipeline, spans, debug_log):
    """An END whose session the subscriber no longer holds (evicted past the cap, expired, or opened before a
    telemetry restart), and one whose session holds no START of it, are skipped and logged at debug with the event's
    name: the request after them in the same batch still becomes spans, and the subscriber raises nothing."""
    pipeline.publish(E.MP_STORE_END, ("cpu", 7, "llama", 1, 4096, 256), session_id="gone", timestamp_ns=at(0))
    pipeline.publish(E.MP_REQUEST_START, session_id="held", timestamp_ns=at(1))
    pipeline.publish(E.MP_RETRIEVE_END, ("cpu", 7, "llama", "", 1, 4096, 256), session_id="held",
                     timestamp_ns=at(2))
    pipeline.publish(E.MP_REQUEST_END, session_id="held", timestamp_ns=at(3))
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(4))
    store(pipeline, "r1", 5, 9)
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(10))
    pipeline.deliver()
    assert {} == pipeline.bus.subscriber_exception_counts()
    assert ["mp.store", "request", "request"] == spans.names()
    assert [(at(5), at(9))] == [times(span) for span in spans.named("mp.store")]
    logged = [json.loads(line) for line in debug_log.lines]
    assert [("tracing.end_without_session", "mp.store.end", "gone"),
            ("tracing.end_without_start", "mp.retrieve.end", "held")] == [
        (record["event"], record["event_name"], record["session_id"]) for record in logged
        if record["event"].startswith("tracing.end_without")]


def test_store_becomes_a_child_with_native_typed_attributes(pipeline, spans):
    """A STORE START/END pair becomes an ``mp.store`` child of the session root, timed by the two events,
    with the START and END fields as attributes of their native types."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    store(pipeline, "r1", 5, 25, device="cuda:0", stored=3)
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(40))
    pipeline.deliver()
    root, child = spans.one("request"), spans.one("mp.store")
    expected = {"device": "cuda:0", "engine_id": 7, "model_name": "llama", "stored_count": 3,
                "total_bytes": 3 * 4096, "num_tokens": 3 * 256, "producer": 0}
    assert ((at(5), at(25)), root.context.span_id, root.context.trace_id, expected) == (
        times(child), parent_id(child), child.context.trace_id, dict(child.attributes))
    assert (at(0), at(40)) == times(root)


def test_root_waits_for_the_store_in_flight_and_keeps_the_request_end_time(pipeline, spans):
    """REQUEST_END while a submitted store is in flight defers the root; the store's END closes it,
    stamped with the saved REQUEST_END time (not the later END time)."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_STORE_SUBMITTED, ("cpu",), session_id="r1", timestamp_ns=at(1))
    pipeline.publish(E.MP_STORE_START, ("cpu", 7, "llama"), session_id="r1", timestamp_ns=at(2))
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(10))
    pipeline.deliver()
    assert [] == spans.names()
    pipeline.publish(E.MP_STORE_END, ("cpu", 7, "llama", 1, 4096, 256), session_id="r1", timestamp_ns=at(50))
    pipeline.deliver()
    root, child = spans.one("request"), spans.one("mp.store")
    assert ((at(0), at(10)), (at(2), at(50)), root.context.span_id) == (times(root), times(child), parent_id(child))


def test_root_waits_for_the_retrieve_in_flight(pipeline, spans):
    """The same deferral holds for retrieves: the root ends only after RETRIEVE_END, at REQUEST_END's time."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_RETRIEVE_SUBMITTED, ("cpu",), session_id="r1", timestamp_ns=at(3))
    pipeline.publish(E.MP_RETRIEVE_START, ("cpu", 7, "llama"), session_id="r1", timestamp_ns=at(4))
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(9))
    pipeline.deliver()
    assert [] == spans.names()
    pipeline.publish(E.MP_RETRIEVE_END, ("cpu", 7, "llama", "tenant", 2, 8192, 512), session_id="r1",
                     timestamp_ns=at(20))
    pipeline.deliver()
    root, child = spans.one("request"), spans.one("mp.retrieve")
    assert ((at(0), at(9)), (at(4), at(20)), root.context.span_id, "tenant", 2) == (
        times(root), times(child), parent_id(child), child.attributes["cache_salt"],
        child.attributes["retrieved_count"])


def test_two_concurrent_stores_of_one_request_are_both_children(pipeline, spans):
    """Two stores of one request in flight at once become two ``mp.store`` children, paired FIFO; the root
    stays open until the second END."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_STORE_SUBMITTED, ("cpu",), session_id="r1", timestamp_ns=at(1))
    pipeline.publish(E.MP_STORE_SUBMITTED, ("cpu",), session_id="r1", timestamp_ns=at(2))
    pipeline.publish(E.MP_STORE_START, ("cpu", 7, "llama"), session_id="r1", timestamp_ns=at(3))
    pipeline.publish(E.MP_STORE_START, ("cpu", 7, "llama"), session_id="r1", timestamp_ns=at(4))
    pipeline.publish(E.MP_STORE_END, ("cpu", 7, "llama", 1, 4096, 256), session_id="r1", timestamp_ns=at(10))
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(12))
    pipeline.deliver()
    assert ["mp.store"] == spans.names()
    pipeline.publish(E.MP_STORE_END, ("cpu", 7, "llama", 2, 8192, 512), session_id="r1", timestamp_ns=at(20))
    pipeline.deliver()
    root = spans.one("request")
    children = sorted((times(s), parent_id(s), s.attributes["stored_count"]) for s in spans.named("mp.store"))
    assert [((at(3), at(10)), root.context.span_id, 1), ((at(4), at(20)), root.context.span_id, 2)] == children
    assert (at(0), at(12)) == times(root)


def test_store_only_session_gets_a_lazy_root(pipeline, spans):
    """Without REQUEST_START, the first child START opens the root (marked as inferred, starting at that
    START); REQUEST_END still closes it."""
    store(pipeline, "r2", 5, 15)
    pipeline.publish(E.MP_REQUEST_END, session_id="r2", timestamp_ns=at(20))
    pipeline.deliver()
    root, child = spans.one("request"), spans.one("mp.store")
    assert ((at(5), at(20)), {"session_id": "r2", ROOT_INFERRED: True}, root.context.span_id) == (
        times(root), dict(root.attributes), parent_id(child))


def test_lookup_prefetch_end_puts_hit_rate_attributes_on_the_root(pipeline, spans):
    """LOOKUP_PREFETCH_END (from a later RPC) closes ``mp.lookup_prefetch`` and sets hit_tokens,
    requested_tokens and the precomputed float hit_rate (plus the L1/L2 split) on the root."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_START, session_id="r1", timestamp_ns=at(1))
    pipeline.deliver()
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("llama", "tenant", 3, 1024, 768, 512, 256, "", 1100, 768, 2, 1),
                     session_id="r1", timestamp_ns=at(8))
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(9))
    pipeline.deliver()
    root, lookup = spans.one("request"), spans.one("mp.lookup_prefetch")
    expected_root = {"session_id": "r1", "hit_tokens": 768, "requested_tokens": 1024, "hit_rate": 0.75,
                     "l1_hit_tokens": 512, "l2_hit_tokens": 256, "l1_hit_rate": 0.5, "l2_hit_rate": 0.25,
                     "early_exit_reason": ""}
    assert (expected_root, (at(1), at(8)), root.context.span_id, 3) == (
        dict(root.attributes), times(lookup), parent_id(lookup), lookup.attributes["found_count"])


def test_timeout_is_a_zero_length_error_span_with_an_exception_event_under_the_root(pipeline, spans):
    """TIMEOUT_RAISED of an open session becomes a zero-length ``timeout`` child of its root, with ERROR
    status and an ``exception`` span event carrying type, message and stack trace."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.TIMEOUT_RAISED, ("MpcacheTimeoutError",), session_id="r1", timestamp_ns=at(7),
                     texts=("retrieve: deadline passed", "File x.py, line 1"))
    pipeline.publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(9))
    pipeline.deliver()
    root, timeout = spans.one("request"), spans.one("timeout")
    (event,) = timeout.events
    assert ((at(7), at(7)), root.context.span_id, StatusCode.ERROR, "retrieve: deadline passed") == (
        times(timeout), parent_id(timeout), timeout.status.status_code, timeout.status.description)
    assert ("exception", at(7), {"exception.type": "MpcacheTimeoutError",
                                 "exception.message": "retrieve: deadline passed",
                                 "exception.stacktrace": "File x.py, line 1"}) == (
        event.name, event.timestamp, dict(event.attributes))


def test_timeout_without_open_session_is_its_own_trace(pipeline, spans):
    """A timeout whose session has no open root is exported as a parentless ``timeout`` span."""
    pipeline.publish(E.TIMEOUT_RAISED, ("MpcacheTimeoutError",), timestamp_ns=at(7), texts=("l2 read", ""))
    pipeline.deliver()
    assert (None, StatusCode.ERROR) == (spans.one("timeout").parent, spans.one("timeout").status.status_code)


def test_blend_request_nests_under_the_mp_root_with_its_children(pipeline, spans):
    """``cb.request`` opens under the session's open MP ``request`` root; ``cb.lookup``, ``cb.retrieve``,
    ``cb.store_pre_computed`` and ``cb.store_final`` are its children, and a failed one has ERROR status."""
    publish = pipeline.publish
    publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    publish(E.CB_REQUEST_START, session_id="r1", timestamp_ns=at(1))
    publish(E.CB_LOOKUP_START, (512,), session_id="r1", timestamp_ns=at(2))
    publish(E.CB_LOOKUP_END, (512, 512, 256, 2, 1, 0, False), session_id="r1", timestamp_ns=at(3))
    publish(E.CB_RETRIEVE_START, (1, 4, -1), session_id="r1", timestamp_ns=at(4))
    publish(E.CB_RETRIEVE_END, (1, 4, False, -1), session_id="r1", timestamp_ns=at(5))
    publish(E.CB_STORE_PRE_COMPUTED_START, (1, 256), session_id="r1", timestamp_ns=at(6))
    publish(E.CB_STORE_PRE_COMPUTED_END, (1, 256, 1, True), session_id="r1", timestamp_ns=at(7))
    publish(E.CB_STORE_FINAL_START, (1, 512), session_id="r1", timestamp_ns=at(8))
    publish(E.CB_REQUEST_END, session_id="r1", timestamp_ns=at(9))
    publish(E.CB_STORE_FINAL_END, (1, 512, 2, True), session_id="r1", timestamp_ns=at(11))
    publish(E.MP_REQUEST_END, session_id="r1", timestamp_ns=at(12))
    pipeline.deliver()
    mp_root, cb_root = spans.one("request"), spans.one("cb.request")
    assert ((at(1), at(9)), mp_root.context.span_id, mp_root.context.trace_id) == (
        times(cb_root), parent_id(cb_root), cb_root.context.trace_id)
    children = {s.name: (times(s), parent_id(s), s.status.status_code) for s in spans.all()
                if s.name not in ("request", "cb.request")}
    unset, error = StatusCode.UNSET, StatusCode.ERROR
    expected = {"cb.lookup": ((at(2), at(3)), cb_root.context.span_id, unset),
                "cb.retrieve": ((at(4), at(5)), cb_root.context.span_id, error),
                "cb.store_pre_computed": ((at(6), at(7)), cb_root.context.span_id, unset),
                "cb.store_final": ((at(8), at(11)), cb_root.context.span_id, unset)}
    assert expected == children
    assert (256, False) == (spans.one("cb.lookup").attributes["hit_tokens"],
                            spans.one("cb.lookup").attributes["no_gpu_context"])


def test_never_ended_root_expires_on_tick_marked_expired(pipeline, spans):
    """A root whose REQUEST_END never comes is kept until a tick ``ttl`` after its last event; then it and its
    open child end at that last event time, marked ``mpcache.incomplete = expired``."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_STORE_SUBMITTED, ("cpu",), session_id="r1", timestamp_ns=at(1))
    pipeline.publish(E.MP_STORE_START, ("cpu", 7, "llama"), session_id="r1", timestamp_ns=at(2))
    pipeline.deliver()
    spans.subscriber.on_tick(at(2) + 119 * S)
    assert ([], 1) == (spans.names(), spans.subscriber.open_sessions)
    spans.subscriber.on_tick(at(2) + 120 * S)
    root, child = spans.one("request"), spans.one("mp.store")
    assert ((at(0), at(2)), "expired", (at(2), at(2)), "expired", root.context.span_id, 0, 1) == (
        times(root), root.attributes[INCOMPLETE], times(child), child.attributes[INCOMPLETE], parent_id(child),
        spans.subscriber.open_sessions, spans.subscriber.expired_roots)


def test_pending_sessions_are_capped_oldest_first(config, pipeline):
    """Beyond ``max_sessions`` open roots, the least recently active one is ended, marked ``evicted``."""
    exporter = InMemorySpanExporter()
    export = TracingExport.start(replace(config, enable_tracing=True, otlp_endpoint="127.0.0.1:1"),
                                 processor=SimpleSpanProcessor(exporter))
    subscriber = TracingSubscriber(export.tracer_provider, max_sessions=2)
    pipeline.subscribe(subscriber)
    for n, session in enumerate(("a", "b", "c")):
        pipeline.publish(E.MP_REQUEST_START, session_id=session, timestamp_ns=at(n))
    pipeline.deliver()
    (evicted,) = exporter.get_finished_spans()
    assert ("a", "evicted", 2) == (evicted.attributes["session_id"], evicted.attributes[INCOMPLETE],
                                   subscriber.open_sessions)
    export.shutdown()


def test_shutdown_ends_open_spans_so_they_are_exported(pipeline, spans):
    """At shutdown every open root is ended at its last event time, marked ``shutdown``."""
    pipeline.publish(E.MP_REQUEST_START, session_id="r1", timestamp_ns=at(0))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_START, session_id="r1", timestamp_ns=at(4))
    pipeline.deliver()
    pipeline.bus.shutdown()
    assert [("mp.lookup_prefetch", (at(4), at(4)), "shutdown"), ("request", (at(0), at(4)), "shutdown")] == sorted(
        (s.name, times(s), s.attributes[INCOMPLETE]) for s in spans.all())


def test_enable_tracing_without_endpoint_is_refused(config):
    """``--enable-tracing`` without ``--otlp-endpoint`` is a ConfigError naming both flags."""
    with pytest.raises(ConfigError, match="--enable-tracing: needs --otlp-endpoint"):
        replace(config, enable_tracing=True)


@pytest.mark.parametrize(("protocol", "endpoint", "expected"), [
    ("grpc", "127.0.0.1:4317", ("OTLPSpanExporter", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")),
    ("http", "http://127.0.0.1:4318", ("OTLPSpanExporter", "opentelemetry.exporter.otlp.proto.http.trace_exporter")),
])
def test_span_exporter_follows_otlp_protocol(config, protocol, endpoint, expected):
    """``--otlp-protocol`` picks the gRPC or the HTTP OTLP span exporter."""
    exporter = otlp.build_exporter(replace(config, enable_tracing=True, otlp_endpoint=endpoint, otlp_protocol=protocol),
                                   otlp.TRACES)
    try:
        assert expected == (type(exporter).__name__, type(exporter).__module__)
    finally:
        exporter.shutdown()


def test_http_span_exporter_gets_the_standard_traces_path(config):
    """A bare HTTP endpoint gets ``/v1/traces``; an explicit path is kept."""
    bare = otlp.build_exporter(replace(config, enable_tracing=True, otlp_endpoint="http://127.0.0.1:4318",
                                       otlp_protocol="http"), otlp.TRACES)
    explicit = otlp.build_exporter(replace(config, enable_tracing=True, otlp_protocol="http",
                                           otlp_endpoint="http://127.0.0.1:4318/custom/traces"), otlp.TRACES)
    assert ("http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/custom/traces") == (
        bare._endpoint, explicit._endpoint)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(("variable", "signal", "honoured"), [
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", otlp.TRACES, True),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", otlp.TRACES, True),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", otlp.METRICS, True),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", otlp.METRICS, False),  # the other signal's variable
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", otlp.TRACES, False),
])
def test_each_signal_honours_its_own_otlp_timeout_variable(config, monkeypatch, protocol, variable, signal, honoured):
    """The exporter of each signal takes ``OTEL_EXPORTER_OTLP_TIMEOUT`` and its own signal's variable, as
    docs/CONFIGURATION.md says; the other signal's variable leaves it at the bound it was built with."""
    for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                 "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "3")
    endpoint = "127.0.0.1:4317" if protocol == "grpc" else "http://127.0.0.1:4318"
    exporter = otlp.build_exporter(replace(config, otlp_endpoint=endpoint, otlp_protocol=protocol), signal,
                                   bound_s=7.0)
    try:
        timeout_s = exporter._timeout if protocol == "grpc" else exporter._client._timeout  # the SDK's own field
        assert (3.0 if honoured else 7.0) == timeout_s
    finally:
        exporter.shutdown()
