"""Client errors logged without letting clients flood the log: a rate limit per second and per client and
kind (:class:`RateLimit`), and the ``client.error`` line both front ends write through it (:class:`ErrorLog`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mpcache.contract import protocol

MAX_TRACKED_CLIENTS = 4096  # clients whose log budget is tracked; more clear the table


class RateLimit:
    """At most ``per_second`` lines a second in all, and per client and kind (an operation) at most
    ``per_client`` lines per ``client_window_s``; :meth:`allow` also says how many were suppressed since."""

    def __init__(self, per_second: int = 10, per_client: int = 1, client_window_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._per_second = per_second
        self._per_client = per_client
        self._client_window_s = client_window_s
        self._clock = clock
        self._window = 0.0
        self._count = 0
        self._suppressed = 0
        self._clients: dict[tuple[bytes, str], list[float]] = {}  # (client, kind) → [window start, lines, suppressed]

    def allow(self, client: bytes | None, kind: str = "") -> dict[str, Any] | None:
        """None: suppress this line; else the fields it carries about earlier suppressed lines."""
        now = self._clock()
        if now - self._window >= 1.0:
            self._window = now
            self._count = 0
        state = None
        if client is not None:
            state = self._clients.get((client, kind))
            if state is None or now - state[0] >= self._client_window_s:
                if state is None and len(self._clients) >= MAX_TRACKED_CLIENTS:
                    self._clients.clear()
                state = self._clients[(client, kind)] = [now, 0, state[2] if state is not None else 0]
            if state[1] >= self._per_client:
                state[2] += 1
                return None
        if self._count >= self._per_second:
            self._suppressed += 1
            return None
        self._count += 1
        suppressed = self._suppressed
        self._suppressed = 0
        extra: dict[str, Any] = {}
        if state is not None:
            state[1] += 1
            extra["client"] = client.hex()[:32] if client else ""
            suppressed += int(state[2])
            state[2] = 0
        if suppressed:
            extra["suppressed"] = suppressed  # lines not logged since the last one (this client's, and any)
        return extra


class ErrorLog:
    """Client errors as ``client.error`` lines, rate-limited (:class:`RateLimit`), at ``level`` (warning;
    debug under ``--demo``, whose clients fail on purpose and count it themselves)."""

    def __init__(self, log: Any, per_second: int = 10, clock: Callable[[], float] = time.monotonic,
                 level: str = "warning") -> None:
        self._emit = getattr(log, level)
        self._limit = RateLimit(per_second, clock=clock)

    def __call__(self, op: str, error_type: str, message: str, client: bytes | None = None) -> None:
        extra = self._limit.allow(client, op)
        if extra is not None:
            self._emit("client.error", op=protocol.bounded(op)[:64], error_type=error_type,
                       error=protocol.bounded(message), **extra)
