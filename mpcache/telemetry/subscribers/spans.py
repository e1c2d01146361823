"""The tracing subscribers' bounded state: open roots by session (least recently active first, capped), their
open children keyed for FIFO pairing (capped), expiry, and the ends of spans that get no END event.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import Span

INCOMPLETE = "mpcache.incomplete"  # why a span was ended without its END event


@dataclass
class OpenChild:
    """A child span opened by a START, waiting for its END."""

    span: Span
    start_ns: int


@dataclass
class Root:
    """An open root span (MP ``request`` or ``cb.request``) and the session state around it."""

    session_id: str
    span: Span | None = None  # None until REQUEST_START or a child START (SUBMITTED alone opens nothing)
    context: Context | None = None
    last_event_ns: int = 0  # latest event timestamp of this session: where an expired root ends
    active_ns: int = 0  # max(event timestamp, last tick) of the latest event: what expiry measures
    end_ns: int | None = None  # the saved REQUEST_END time while copies are still in flight
    in_flight: dict[str, int] = field(default_factory=lambda: {"store": 0, "retrieve": 0})
    producers: set[int] = field(default_factory=set)  # REQUEST_START seen, REQUEST_END not yet
    children: dict[tuple[object, ...], collections.deque[OpenChild]] = field(default_factory=dict)
    n_children: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    early_exit_reason: str = ""

    def touch(self, timestamp_ns: int, tick_ns: int) -> None:
        self.last_event_ns = max(self.last_event_ns, timestamp_ns)
        self.active_ns = max(self.active_ns, timestamp_ns, tick_ns)


class Roots:
    """Open roots of one component by session id, least recently active first, with a cap."""

    def __init__(self, max_sessions: int, max_children: int, on_drop: Callable[[Root, str], None]) -> None:
        self._roots: collections.OrderedDict[str, Root] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self._max_children = max_children
        self._on_drop = on_drop
        self.tick_ns = 0  # the latest on_tick time

    def __len__(self) -> int:
        return len(self._roots)

    def get(self, session_id: str) -> Root | None:
        return self._roots.get(session_id)

    def touch(self, session_id: str, timestamp_ns: int) -> Root:
        """The session's state (created if needed), marked active at ``timestamp_ns``."""
        root = self._roots.get(session_id)
        if root is None:
            root = self._roots[session_id] = Root(session_id)
            while len(self._roots) > self._max_sessions:
                _, oldest = self._roots.popitem(last=False)
                self._on_drop(oldest, "evicted")
        else:
            self._roots.move_to_end(session_id)
        root.touch(timestamp_ns, self.tick_ns)
        return root

    def remove(self, root: Root) -> None:
        if self._roots.get(root.session_id) is root:
            del self._roots[root.session_id]

    def push_child(self, root: Root, key: tuple[object, ...], child: OpenChild) -> None:
        root.children.setdefault(key, collections.deque()).append(child)
        root.n_children += 1
        if root.n_children > self._max_children:  # the oldest pending START gives way
            oldest_key = min(root.children, key=lambda k: root.children[k][0].start_ns)
            victim = self.pop_child(root, oldest_key)
            if victim is not None:
                end_incomplete(victim.span, "evicted", max(victim.start_ns, root.last_event_ns))

    def pop_child(self, root: Root, key: tuple[object, ...]) -> OpenChild | None:
        queue = root.children.get(key)
        if not queue:
            return None
        child = queue.popleft()
        if not queue:
            del root.children[key]
        root.n_children -= 1
        return child

    def expire(self, now_ns: int, ttl_ns: int) -> int:
        self.tick_ns = now_ns
        stale = [root for root in self._roots.values() if now_ns - root.active_ns >= ttl_ns]
        for root in stale:
            del self._roots[root.session_id]
            self._on_drop(root, "expired")
        return len(stale)

    def drain(self, reason: str) -> None:
        while self._roots:
            _, root = self._roots.popitem(last=False)
            self._on_drop(root, reason)


def end_incomplete(span: Span, reason: str, end_ns: int) -> None:
    span.set_attribute(INCOMPLETE, reason)
    span.end(end_time=end_ns)


def end_children(root: Root, reason: str, end_ns: int) -> None:
    for queue in root.children.values():
        for child in queue:
            end_incomplete(child.span, reason, max(child.start_ns, end_ns))
    root.children.clear()
    root.n_children = 0


def drop_root(root: Root, reason: str) -> None:
    """End a root (and its open children) that will get no regular end: expiry, cap or shutdown."""
    end_ns = root.end_ns if root.end_ns is not None else root.last_event_ns
    end_children(root, reason, end_ns)
    if root.span is not None:
        end_incomplete(root.span, reason, end_ns)
