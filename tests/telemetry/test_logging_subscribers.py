"""Logging subscribers: events → JSON log lines of the telemetry process, gated by --log-level.

Lines are captured as the real structlog configuration renders them
(:func:`mpcache.logs.configure_logging` with a handler that keeps them in a
list) and asserted as parsed JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from support.log_lines import LogLines, logging_restored

from mpcache.contract.events import EventType as E
from mpcache.logs import configure_logging
from mpcache.telemetry.subscribers.logging import (
    COMPONENTS,
    EventLoggingSubscriber,
    TimeoutLoggingSubscriber,
    build_logging_subscribers,
)

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z$")


class Captured:
    """The telemetry process's logger, and what it wrote, parsed."""

    def __init__(self) -> None:
        self.handler = LogLines()
        self.logger = None

    def configure(self, level: str):
        self.logger = configure_logging("telemetry", "inst-1", level, handlers=[self.handler])
        return self.logger

    def records(self) -> list[dict]:
        """Every line as parsed JSON, ``timestamp`` checked to be ISO UTC and then removed."""
        out = []
        for line in self.handler.lines:
            record = json.loads(line)
            assert ISO_UTC.match(record.pop("timestamp")), line
            out.append(record)
        return out


@pytest.fixture
def captured():
    with logging_restored():
        yield Captured()


def _subscribe(pipeline, config, captured, level):
    logger = captured.configure(level)
    subscribers = build_logging_subscribers(dataclasses.replace(config, log_level=level), logger)
    pipeline.subscribe(*subscribers)
    return subscribers


FIXED_NS = 1_700_000_000_123_456_789  # what the fixture publisher's clock returns (tests/conftest.py)


def _context(level: str, event: str, worker: int = 0) -> dict:
    return {"role": "telemetry", "instance_id": "inst-1", "level": level, "event": event, "worker": worker,
            "event_timestamp_ns": FIXED_NS}


def test_debug_logs_one_line_per_event_with_name_fields_salts_and_session(pipeline, config, captured):
    """At debug every event is one line, in ring order: its dotted name, its fields (nested under
    ``fields``), its salt counts as [cache_salt, model_name, count], its session/request id, the
    publishing worker, and the process context (role, instance_id, level, timestamp)."""
    _subscribe(pipeline, config, captured, "debug")
    pipeline.publish(E.L1_KEYS_EVICTED, salt_counts={("tenant-a", "llama"): 12, ("tenant-b", "qwen"): 3})
    pipeline.publish(E.MP_STORE_END, ("cpu", 7, "llama", 4, 4096, 1024), session_id="req-7")
    pipeline.publish(E.SM_WRITE_FINISHED, (1,), salt_counts={("tenant-a", "llama"): 4})
    pipeline.publish(E.L2_STORE_COMPLETED, (0, 42, "fs", 8192, 2, 0), salt_counts={("tenant-c", "llama"): 2})
    pipeline.publish(E.CB_LOOKUP_END, (512, 512, 256, 1, 0, 0, True), session_id="req-8")
    pipeline.publish(E.MP_VLLM_BLOCK_ALLOCATION, (3, "llama", 2, 2), session_id="req-9",
                     blocks=[("req-9", 10, 1), ("req-10", 11, 2)])
    pipeline.deliver()
    assert FIXED_NS == pipeline.ring.timestamp_ns
    expected = [
        {**_context("debug", "l1.keys.evicted"),
         "salt_counts": [["tenant-a", "llama", 12], ["tenant-b", "qwen", 3]]},
        {**_context("debug", "mp.store.end"), "session_id": "req-7",
         "fields": {"device": "cpu", "engine_id": 7, "model_name": "llama", "stored_count": 4,
                    "total_bytes": 4096, "num_tokens": 1024}},
        {**_context("debug", "sm.write.finished"), "fields": {"failed_count": 1},
         "salt_counts": [["tenant-a", "llama", 4]]},
        {**_context("debug", "l2.store.completed"),
         "fields": {"adapter_index": 0, "task_id": 42, "l2_name": "fs", "bytes_transferred": 8192,
                    "succeeded_count": 2, "failed_count": 0},
         "salt_counts": [["tenant-c", "llama", 2]]},
        {**_context("debug", "cb.lookup.end"), "session_id": "req-8",
         "fields": {"num_tokens": 512, "requested_tokens": 512, "hit_tokens": 256, "fingerprint_hits": 1,
                    "storage_hits": 0, "stale_chunks": 0, "no_gpu_context": True}},
        {**_context("debug", "mp.vllm.block_allocation"), "session_id": "req-9",
         "fields": {"instance_id": 3, "model_name": "llama", "record_count": 2, "block_count": 2},
         "block_request_ids": ["req-10", "req-9"]},
    ]
    assert expected == captured.records()


def test_every_event_type_is_logged_by_exactly_one_subscriber(config, captured):
    """At debug the event subscriber (server, L1, storage manager, L2, CB) and the timeout subscriber
    together cover every event type, none twice."""
    subscribers = build_logging_subscribers(dataclasses.replace(config, log_level="debug"), captured.configure("debug"))
    owners = [etype for subscriber in subscribers for etype in subscriber.event_types]
    assert (("server", "l1", "storage_manager", "l2", "cb", "mrc"), sorted(E), len(E)) == (
        tuple(COMPONENTS), sorted(owners), len(owners))


class _CountingBatch:
    """Stands in for an EventBatch and counts how often anything asked it to decode."""

    def __init__(self) -> None:
        self.events_calls = 0

    def events(self, etypes=None):
        self.events_calls += 1
        return []

    def __len__(self) -> int:
        return 1000


@pytest.mark.parametrize(("level", "decodes"), [("debug", 1), ("info", 0), ("warning", 0), ("error", 0)])
def test_event_subscriber_does_not_decode_at_info_and_above(config, captured, level, decodes):
    """At info and above the debug event subscriber declares no event types (the bus never calls it)
    and its on_batch returns without asking the batch for a single event; at debug (the control) it
    asks once per batch."""
    logger = captured.configure(level)
    (events,) = [s for s in build_logging_subscribers(dataclasses.replace(config, log_level=level), logger)
                 if isinstance(s, EventLoggingSubscriber)]
    batch = _CountingBatch()
    events.on_batch(batch)
    assert (bool(decodes), decodes) == (bool(events.event_types), batch.events_calls)


def test_info_level_logs_no_event_lines(pipeline, config, captured):
    """Through a real bus at info, ordinary events produce no log line at all."""
    _subscribe(pipeline, config, captured, "info")
    pipeline.publish(E.L1_KEYS_EVICTED, salt_counts={("tenant-a", "llama"): 12})
    pipeline.publish(E.MP_REQUEST_START, session_id="req-1")
    assert (2, []) == (pipeline.deliver(), captured.records())


def test_timeout_is_logged_at_warning_with_type_message_and_stack(pipeline, config, captured):
    """timeout.raised is a warning line (so visible at the default info level) carrying exception_type,
    message, stack, the request id and the worker."""
    _subscribe(pipeline, config, captured, "info")
    stack = 'Traceback (most recent call last):\n  File "server.py", line 724, in retrieve\n'
    pipeline.publish(E.TIMEOUT_RAISED, ("MpcacheTimeoutError",), session_id="req-3",
                     texts=("retrieve: deadline of 0.5 s passed", stack))
    pipeline.deliver()
    expected = [{**_context("warning", "timeout.raised"), "session_id": "req-3",
                 "exception_type": "MpcacheTimeoutError", "message": "retrieve: deadline of 0.5 s passed",
                 "stack": stack}]
    assert expected == captured.records()


def test_timeouts_are_not_decoded_at_error_level(config, captured):
    """At --log-level error even the timeout subscriber is off and decodes nothing."""
    logger = captured.configure("error")
    (timeouts,) = [s for s in build_logging_subscribers(dataclasses.replace(config, log_level="error"), logger)
                   if isinstance(s, TimeoutLoggingSubscriber)]
    batch = _CountingBatch()
    timeouts.on_batch(batch)
    assert ((), 0) == (timeouts.event_types, batch.events_calls)
