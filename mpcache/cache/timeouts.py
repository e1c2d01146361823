"""Deadlines that raise :class:`MpcacheTimeoutError`, and TIMEOUT_RAISED for one that was caught (by the
dispatcher, with the innermost frames of where it was raised).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from mpcache.contract.events import TEXT_MAX_BYTES, EventType
from mpcache.shm.publish import EventPublisher

_TIMEOUT_RAISED = EventType.TIMEOUT_RAISED
_STACK_MAX_BYTES = TEXT_MAX_BYTES["stacktrace"]


class MpcacheTimeoutError(TimeoutError):
    """An operation ran past its deadline; ``session_id`` names its request (may be empty)."""

    def __init__(self, message: str, *, session_id: str = "") -> None:
        super().__init__(message)
        self.session_id = session_id


def publish_timeout(publisher: EventPublisher, error: MpcacheTimeoutError) -> None:
    """Publish TIMEOUT_RAISED for a caught timeout (never raises: the publisher does not)."""
    stack = _innermost(traceback.format_tb(error.__traceback__))
    publisher.emit(_TIMEOUT_RAISED, (type(error).__name__,), session_id=error.session_id,
                   texts=(str(error), stack))


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
