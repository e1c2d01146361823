"""Tracing subscribers (``--enable-tracing``): spans rebuilt after the fact from START/END events with the
producer's timestamps; request roots, ``mp.*``/``cb.*`` children and timeout spans, with bounded state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode, Tracer, TracerProvider

from mpcache.config import Config
from mpcache.contract.events import EventType
from mpcache.telemetry.batch import Event
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.subscribers.spans import OpenChild, Root, Roots, drop_root, end_children

E = EventType
log = structlog.get_logger("mpcache.telemetry.tracing")

TRACER_MP = "mpcache.server"
TRACER_BLEND = "mpcache.blend"
TRACER_TIMEOUT = "mpcache.timeout"

DEFAULT_TTL_S = 120.0
DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_MAX_CHILDREN = 256

ROOT_INFERRED = "mpcache.root_inferred"  # the root was opened by a child, REQUEST_START never came

# START type → (op, span name, fields that tell concurrent operations of one session apart)
_MP_STARTS = {
    E.MP_STORE_START: ("store", "mp.store", ("device",)),
    E.MP_RETRIEVE_START: ("retrieve", "mp.retrieve", ("device",)),
    E.MP_LOOKUP_PREFETCH_START: ("lookup_prefetch", "mp.lookup_prefetch", ()),
}
_MP_ENDS = {E.MP_STORE_END: E.MP_STORE_START, E.MP_RETRIEVE_END: E.MP_RETRIEVE_START,
            E.MP_LOOKUP_PREFETCH_END: E.MP_LOOKUP_PREFETCH_START}
_IN_FLIGHT = {E.MP_STORE_SUBMITTED: "store", E.MP_RETRIEVE_SUBMITTED: "retrieve",
              E.MP_STORE_END: "store", E.MP_RETRIEVE_END: "retrieve"}

_CB_STARTS = {
    E.CB_LOOKUP_START: ("lookup", "cb.lookup", ()),
    E.CB_RETRIEVE_START: ("retrieve", "cb.retrieve", ("instance_id", "worker_id")),
    E.CB_STORE_PRE_COMPUTED_START: ("store_pre_computed", "cb.store_pre_computed", ("instance_id",)),
    E.CB_STORE_FINAL_START: ("store_final", "cb.store_final", ("instance_id",)),
}
_CB_ENDS = {E.CB_LOOKUP_END: E.CB_LOOKUP_START, E.CB_RETRIEVE_END: E.CB_RETRIEVE_START,
            E.CB_STORE_PRE_COMPUTED_END: E.CB_STORE_PRE_COMPUTED_START,
            E.CB_STORE_FINAL_END: E.CB_STORE_FINAL_START}


def _attributes(fields: dict[str, Any]) -> dict[str, Any]:
    """Event fields as span attributes, native types kept (int, float, bool, str)."""
    return {name: value for name, value in fields.items() if isinstance(value, (bool, int, float, str))}


def _rate(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator > 0 else 0.0


class _Component:
    """What MP-server and blend tracing share: a child span per START, under the session's root
    (opened lazily when the request's own START never came), keyed so concurrent ops pair FIFO."""

    _starts: dict[E, tuple[str, str, tuple[str, ...]]]  # START type -> (op, span name, key fields)
    roots: Roots
    tracer: Tracer

    def _open_root(self, root: Root, timestamp_ns: int, inferred: bool) -> None:
        raise NotImplementedError

    def _child_start(self, event: Event) -> None:
        op, name, key_fields = self._starts[event.etype]
        root = self.roots.touch(event.session_id, event.timestamp_ns)
        if root.span is None:
            self._open_root(root, event.timestamp_ns, inferred=True)
        attributes = _attributes(event.fields)
        attributes["producer"] = event.producer
        span = self.tracer.start_span(name, context=root.context, start_time=event.timestamp_ns,
                                      attributes=attributes)
        key = (event.producer, op, *(event.fields[f] for f in key_fields))
        self.roots.push_child(root, key, OpenChild(span, event.timestamp_ns))


class MPServerTracing(_Component):
    """``request`` roots and ``mp.store``/``mp.retrieve``/``mp.lookup_prefetch`` children."""

    _starts = _MP_STARTS
    event_types = (E.MP_REQUEST_START, E.MP_REQUEST_END, E.MP_STORE_SUBMITTED, E.MP_RETRIEVE_SUBMITTED,
                   *_MP_STARTS, *_MP_ENDS)

    def __init__(self, tracer: Tracer, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 max_children: int = DEFAULT_MAX_CHILDREN) -> None:
        self.tracer = tracer
        self.roots = Roots(max_sessions, max_children, drop_root)
        self._handlers = {E.MP_REQUEST_START: self._request_start, E.MP_REQUEST_END: self._request_end,
                          E.MP_STORE_SUBMITTED: self._submitted, E.MP_RETRIEVE_SUBMITTED: self._submitted}
        self._handlers.update({etype: self._child_start for etype in _MP_STARTS})
        self._handlers.update({etype: self._child_end for etype in _MP_ENDS})

    def root_context(self, session_id: str) -> Context | None:
        """The open ``request`` root of this session as a parent context, or None."""
        root = self.roots.get(session_id)
        return root.context if root is not None else None

    def touch(self, session_id: str, timestamp_ns: int) -> None:
        """Another component saw activity of this session: keep its root from expiring."""
        if self.roots.get(session_id) is not None:
            self.roots.touch(session_id, timestamp_ns)

    def on_event(self, event: Event) -> None:
        if event.session_id:
            self._handlers[event.etype](event)

    # -- root ------------------------------------------------------------------------

    def _open_root(self, root: Root, timestamp_ns: int, inferred: bool) -> None:
        attributes: dict[str, Any] = {"session_id": root.session_id}
        if inferred:
            attributes[ROOT_INFERRED] = True
        root.span = self.tracer.start_span("request", context=Context(), start_time=timestamp_ns,
                                           attributes=attributes)
        root.context = trace.set_span_in_context(root.span, Context())

    def _request_start(self, event: Event) -> None:
        root = self.roots.touch(event.session_id, event.timestamp_ns)
        root.producers.add(event.producer)
        if root.span is None:
            self._open_root(root, event.timestamp_ns, inferred=False)

    def _request_end(self, event: Event) -> None:
        root = self.roots.get(event.session_id)
        if root is None:
            return
        self.roots.touch(event.session_id, event.timestamp_ns)
        root.producers.discard(event.producer)
        root.end_ns = event.timestamp_ns
        self._close_if_done(root)

    def _close_if_done(self, root: Root) -> None:
        if root.end_ns is None or root.producers or any(root.in_flight.values()):
            return
        self.roots.remove(root)
        end_children(root, "session_ended", root.end_ns)  # e.g. a lookup whose result was never read
        if root.span is not None:
            root.span.end(end_time=root.end_ns)

    def _submitted(self, event: Event) -> None:
        root = self.roots.touch(event.session_id, event.timestamp_ns)
        root.in_flight[_IN_FLIGHT[event.etype]] += 1

    # -- children ----------------------------------------------------------------------

    def _child_end(self, event: Event) -> None:
        root = self.roots.get(event.session_id)
        if root is None:
            log.debug("tracing.end_without_session", event_name=event.name, session_id=event.session_id)
            return
        self.roots.touch(event.session_id, event.timestamp_ns)
        op, _, key_fields = _MP_STARTS[_MP_ENDS[event.etype]]
        child = self.roots.pop_child(root, (event.producer, op, *(event.fields[f] for f in key_fields)))
        if child is None:
            log.debug("tracing.end_without_start", event_name=event.name, session_id=event.session_id)
        else:
            child.span.set_attributes(_attributes(event.fields))
            child.span.end(end_time=event.timestamp_ns)
        if event.etype is E.MP_LOOKUP_PREFETCH_END:
            self._hit_rate(root, event.fields)
        if op in root.in_flight:
            root.in_flight[op] = max(0, root.in_flight[op] - 1)
        self._close_if_done(root)

    def _hit_rate(self, root: Root, fields: dict[str, Any]) -> None:
        hits = root.hits
        for name in ("hit_tokens", "requested_tokens", "l1_hit_tokens", "l2_hit_tokens"):
            hits[name] = hits.get(name, 0) + int(fields[name])
        if fields["early_exit_reason"]:
            root.early_exit_reason = fields["early_exit_reason"]
        if root.span is None:
            return
        requested = hits["requested_tokens"]
        root.span.set_attributes({
            **hits,
            "hit_rate": _rate(hits["hit_tokens"], requested),
            "l1_hit_rate": _rate(hits["l1_hit_tokens"], requested),
            "l2_hit_rate": _rate(hits["l2_hit_tokens"], requested),
            "early_exit_reason": root.early_exit_reason,
        })


class BlendTracing(_Component):
    """``cb.request`` roots (under the MP ``request`` root when open) and their four kinds of children."""

    _starts = _CB_STARTS
    event_types = (E.CB_REQUEST_START, E.CB_REQUEST_END, *_CB_STARTS, *_CB_ENDS)

    def __init__(self, tracer: Tracer, mp: MPServerTracing, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 max_children: int = DEFAULT_MAX_CHILDREN) -> None:
        self.tracer = tracer
        self.mp = mp
        self.roots = Roots(max_sessions, max_children, drop_root)

    def root_context(self, session_id: str) -> Context | None:
        root = self.roots.get(session_id)
        return root.context if root is not None else None

    def on_event(self, event: Event) -> None:
        if not event.session_id:
            return
        self.mp.touch(event.session_id, event.timestamp_ns)
        etype = event.etype
        root: Root | None
        if etype is E.CB_REQUEST_START:
            root = self.roots.touch(event.session_id, event.timestamp_ns)
            if root.span is None:
                self._open_root(root, event.timestamp_ns, inferred=False)
        elif etype is E.CB_REQUEST_END:
            root = self.roots.get(event.session_id)
            if root is not None:
                self.roots.touch(event.session_id, event.timestamp_ns)
                root.end_ns = event.timestamp_ns
                self._close_if_done(root)
        elif etype in _CB_STARTS:
            self._child_start(event)
        else:
            self._child_end(event)

    def _open_root(self, root: Root, timestamp_ns: int, inferred: bool) -> None:
        attributes: dict[str, Any] = {"session_id": root.session_id}
        if inferred:
            attributes[ROOT_INFERRED] = True
        parent = self.mp.root_context(root.session_id) or Context()
        root.span = self.tracer.start_span("cb.request", context=parent, start_time=timestamp_ns,
                                           attributes=attributes)
        root.context = trace.set_span_in_context(root.span, Context())

    def _close_if_done(self, root: Root) -> None:
        if root.end_ns is None or root.n_children:
            return
        self.roots.remove(root)
        if root.span is not None:
            root.span.end(end_time=root.end_ns)

    def _child_end(self, event: Event) -> None:
        op, _, key_fields = _CB_STARTS[_CB_ENDS[event.etype]]
        root = self.roots.get(event.session_id)
        child = None
        if root is not None:
            self.roots.touch(event.session_id, event.timestamp_ns)
            child = self.roots.pop_child(root, (event.producer, op, *(event.fields[f] for f in key_fields)))
        if root is None or child is None:  # (child is None whenever root is)
            log.debug("tracing.end_without_start", event_name=event.name, session_id=event.session_id)
            return
        child.span.set_attributes(_attributes(event.fields))
        if event.fields.get("success") is False:
            child.span.set_status(Status(StatusCode.ERROR, f"{event.name}: success=false"))
        child.span.end(end_time=event.timestamp_ns)
        self._close_if_done(root)


class TimeoutTracing:
    """Zero-length ``timeout`` spans with an ``exception`` event and ERROR status."""

    event_types = (E.TIMEOUT_RAISED,)

    def __init__(self, tracer: Tracer, mp: MPServerTracing, blend: BlendTracing) -> None:
        self.tracer = tracer
        self.mp = mp
        self.blend = blend

    def on_event(self, event: Event) -> None:
        timestamp = event.timestamp_ns
        exception_type = event.fields["exception_type"]
        message = event.texts.get("message", "")
        parent = None
        if event.session_id:
            self.mp.touch(event.session_id, timestamp)
            parent = self.mp.root_context(event.session_id) or self.blend.root_context(event.session_id)
        attributes: dict[str, Any] = {"exception_type": exception_type, "producer": event.producer}
        if event.session_id:
            attributes["session_id"] = event.session_id
        span = self.tracer.start_span("timeout", context=parent or Context(), start_time=timestamp,
                                      attributes=attributes)
        span.add_event("exception", {
            "exception.type": exception_type,
            "exception.message": message,
            "exception.stacktrace": event.texts.get("stacktrace", ""),
        }, timestamp=timestamp)
        span.set_status(Status(StatusCode.ERROR, message or exception_type))
        span.end(end_time=timestamp)


class TracingSubscriber(Subscriber):
    """The three tracing components behind one subscriber, fed in ring order."""

    def __init__(self, tracer_provider: TracerProvider, *, ttl_s: float = DEFAULT_TTL_S,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, max_children: int = DEFAULT_MAX_CHILDREN) -> None:
        if ttl_s <= 0 or max_sessions < 1 or max_children < 1:
            raise ValueError("tracing: ttl_s must be > 0, max_sessions and max_children >= 1")
        self.mp = MPServerTracing(tracer_provider.get_tracer(TRACER_MP), max_sessions, max_children)
        self.blend = BlendTracing(tracer_provider.get_tracer(TRACER_BLEND), self.mp, max_sessions, max_children)
        self.timeout = TimeoutTracing(tracer_provider.get_tracer(TRACER_TIMEOUT), self.mp, self.blend)
        self.ttl_ns = int(ttl_s * 1e9)
        self.expired_roots = 0
        self._route: dict[EventType, Callable[[Event], None]] = {}
        for component in (self.mp, self.blend, self.timeout):
            self._route.update({etype: component.on_event for etype in component.event_types})
        self.event_types = tuple(self._route)

    def on_event(self, event: Event) -> None:
        self._route[event.etype](event)

    def on_tick(self, now_ns: int) -> None:
        """End roots (and their open children) of sessions idle for ``ttl_s``, marked ``expired``."""
        self.expired_roots += self.mp.roots.expire(now_ns, self.ttl_ns)
        self.expired_roots += self.blend.roots.expire(now_ns, self.ttl_ns)

    def shutdown(self) -> None:
        """End every open span (``mpcache.incomplete`` = ``shutdown``) so that the final flush exports it."""
        self.blend.roots.drain("shutdown")
        self.mp.roots.drain("shutdown")

    @property
    def open_sessions(self) -> int:
        return len(self.mp.roots) + len(self.blend.roots)


def build_tracing_subscribers(config: Config, tracer_provider: TracerProvider) -> Iterable[Subscriber]:
    """The subscribers ``--enable-tracing`` adds to the bus."""
    del config  # nothing configurable yet beyond the provider; kept for symmetry with the other builders
    return [TracingSubscriber(tracer_provider)]
