"""Timeout errors that report themselves, and deadlines that raise them.

Every timeout an operation of a cache process hits is a
:class:`MpcacheTimeoutError`; constructing one publishes ``TIMEOUT_RAISED``
(exception_type = the class name, message, the formatted construction stack)
through the publisher registered for this process with
:func:`register_publisher`.  Construction never raises because of that: with
no publisher registered, or when publishing fails, the error is simply an
error.  Raise this class, never a bare ``TimeoutError``.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

from mpcache.events import TEXT_MAX_BYTES, EventType

_TIMEOUT_RAISED = EventType.TIMEOUT_RAISED
_STACK_LIMIT = 32  # innermost frames considered for the published stack trace
_STACK_MAX_BYTES = TEXT_MAX_BYTES["stacktrace"]

_publisher = None  # this process's mpcache.publish.Publisher, or None


def register_publisher(publisher) -> None:
    """Publish TIMEOUT_RAISED through ``publisher`` (None stops publishing)."""
    global _publisher
    _publisher = publisher


def registered_publisher():
    return _publisher


class MpcacheTimeoutError(TimeoutError):
    """An operation ran past its deadline.  Construction publishes TIMEOUT_RAISED."""

    def __init__(self, message: str, *, session_id: str = "") -> None:
        super().__init__(message)
        publisher = _publisher
        if publisher is None:
            return
        try:
            stack = _innermost(traceback.format_stack(limit=_STACK_LIMIT)[:-1])  # minus this constructor
            publisher.emit(_TIMEOUT_RAISED, (type(self).__name__,), session_id=session_id, texts=(message, stack))
        except Exception:  # noqa: BLE001 - reporting a timeout must never replace it
            pass


def _innermost(frames: list[str]) -> str:
    """The innermost frames that fit the published text (the event truncates from the end,
    which would keep the least useful, outermost frames)."""
    kept: list[str] = []
    size = 0
    for frame in reversed(frames):
        size += len(frame.encode("utf-8", "replace"))
        if size > _STACK_MAX_BYTES and kept:
            break
        kept.append(frame)
    return "".join(reversed(kept))


class Deadline:
    """A point on a monotonic clock; :meth:`check` raises once it has passed.

    ``timeout_s=None`` never expires.  ``timeout_s=0`` has already expired:
    an operation that still has work to do fails at its first check.
    """

    __slots__ = ("timeout_s", "_at", "_clock")

    def __init__(self, timeout_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._at = None if timeout_s is None else clock() + timeout_s

    def expired(self) -> bool:
        return self._at is not None and self._clock() >= self._at

    def check(self, what: str, *, session_id: str = "") -> None:
        """Raise MpcacheTimeoutError naming ``what`` if the deadline has passed."""
        if self._at is not None and self._clock() >= self._at:
            raise MpcacheTimeoutError(f"{what}: deadline of {self.timeout_s:g} s passed", session_id=session_id)
