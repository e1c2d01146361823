"""Waiting on a condition with a deadline: the tests' one polling loop (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# What a condition may raise while the thing it watches is not there yet (a port not yet listening, a log
# file half written, a key not yet present): retried until the deadline, and named in the failure.
NOT_YET: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError)
FIRST_INTERVAL_S = 0.005


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2,
             tolerate: tuple[type[BaseException], ...] = NOT_YET) -> T:
    """``condition()``'s first truthy value; AssertionError naming ``what`` (and the last tolerated error) once
    ``timeout_s`` passed.  Polls every 5 ms at first, backing off to ``interval_s``, so a quick condition is
    seen at once and a slow one does not load the machine.  Exceptions other than ``tolerate`` propagate."""
    deadline = time.monotonic() + timeout_s
    pause = min(FIRST_INTERVAL_S, interval_s)
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except tolerate as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last_error!r})")
        time.sleep(pause)
        pause = min(interval_s, pause * 2)
