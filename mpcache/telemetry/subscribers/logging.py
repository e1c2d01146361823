"""Logging subscribers: events → structlog JSON lines (at debug; timeouts at warning).  Below the
configured level a subscriber declares no event types and costs nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from mpcache.config import Config
from mpcache.contract.events import SCHEMAS, EventType
from mpcache.logs import LEVELS
from mpcache.telemetry.batch import Event, EventBatch
from mpcache.telemetry.bus import Subscriber


def _types_with_prefix(prefix: str) -> tuple[EventType, ...]:
    return tuple(etype for etype, schema in SCHEMAS.items() if schema.dotted.startswith(prefix))


def event_line(event: Event) -> dict[str, Any]:
    """The key/values of one event's log line (everything but ``event``, level, timestamp and context)."""
    line: dict[str, Any] = {"worker": event.producer, "event_timestamp_ns": event.timestamp_ns}
    if event.session_id:
        line["session_id"] = event.session_id
    if event.fields:
        line["fields"] = event.fields
    if event.salt_counts:
        line["salt_counts"] = [list(group) for group in event.salt_counts]
    if event.blocks:
        line["block_request_ids"] = sorted({request_id for request_id, _block, _hash in event.blocks})
    texts = {name: text for name, text in event.texts.items() if text}
    if texts:
        line["texts"] = texts
    return line


# The components whose events are logged at debug, by dotted-name prefix.
COMPONENTS: dict[str, str] = {"server": "mp.", "l1": "l1.", "storage_manager": "sm.", "l2": "l2.", "cb": "cb.",
                              "mrc": "mrc."}


class EventLoggingSubscriber(Subscriber):
    """Logs every event of the given components at debug, one line per event, in ring order.

    One subscriber for all components rather than one each, so that a request's
    lines (mp.request.start, l1.read.reserved, ..., mp.request.end) come out in
    the order they were published, from a single decoding pass per batch.
    """

    level = logging.DEBUG

    def __init__(self, logger: Any, threshold: int, components: tuple[str, ...] = tuple(COMPONENTS)) -> None:
        self._log = logger
        self.components = components
        self.enabled = self.level >= threshold
        types = tuple(etype for component in components for etype in _types_with_prefix(COMPONENTS[component]))
        # Disabled: no event types, so the bus skips us before any per-event work.
        self.event_types = types if self.enabled else ()

    def on_batch(self, batch: EventBatch) -> None:
        if not self.enabled:
            return
        debug = self._log.debug
        for event in batch.events(self.event_types):
            debug(SCHEMAS[event.etype].dotted, **event_line(event))


class TimeoutLoggingSubscriber(Subscriber):
    """``timeout.raised`` at warning: exception_type, message and stack (plus worker and session_id)."""

    def __init__(self, logger: Any, threshold: int, level: int = logging.WARNING) -> None:
        """``level``: warning, or debug under ``--demo``, whose timeouts are deliberate (and counted by the demo)."""
        self._log = logger
        self.level = level
        self.enabled = level >= threshold
        self.event_types = (EventType.TIMEOUT_RAISED,) if self.enabled else ()

    def on_batch(self, batch: EventBatch) -> None:
        if not self.enabled:
            return
        for event in batch.events(self.event_types):
            line: dict[str, Any] = {"worker": event.producer, "event_timestamp_ns": event.timestamp_ns}
            if event.session_id:
                line["session_id"] = event.session_id
            self._log.log(
                self.level, SCHEMAS[event.etype].dotted,
                exception_type=event.fields.get("exception_type", ""),
                message=event.texts.get("message", ""),
                stack=event.texts.get("stacktrace", ""),
                **line,
            )


def build_logging_subscribers(config: Config, logger: Any) -> list[Subscriber]:
    """The logging subscribers, gated by ``config.log_level``; the caller subscribes them to the bus."""
    threshold = LEVELS[config.log_level]
    timeouts = logging.DEBUG if config.demo else logging.WARNING
    return [EventLoggingSubscriber(logger, threshold), TimeoutLoggingSubscriber(logger, threshold, timeouts)]
