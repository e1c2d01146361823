"""L2 failures: counted by kind on the adapters' threads (:class:`FailureCounts`), logged rate-limited on the
cache process's loop thread (:class:`FailureLog`); the kinds: ``docs/ARCHITECTURE.md``, "Failures"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_HINTS = {
    "integrity": "a record failed verification and was not loaded: it is corrupt, or was written by someone "
                 "without this deployment's L2 secret (possible forgery)",
}


class FailureCounts:
    """Failures of one adapter by kind: totals, and what is new since the last :meth:`take`.  Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self._new: dict[str, tuple[int, str]] = {}  # kind -> (count since take, latest detail)

    def note(self, kind: str, count: int = 1, detail: str = "") -> None:
        if count <= 0:
            return
        with self._lock:
            self._totals[kind] = self._totals.get(kind, 0) + count
            previous, previous_detail = self._new.get(kind, (0, ""))
            self._new[kind] = (previous + count, detail or previous_detail)

    def totals(self) -> dict[str, int]:
        """Every failure so far, by kind."""
        with self._lock:
            return dict(self._totals)

    def take(self) -> dict[str, tuple[int, str]]:
        """``{kind: (count, latest detail)}`` noted since the previous call (cheap when nothing is new)."""
        if not self._new:
            return {}
        with self._lock:
            new, self._new = self._new, {}
        return new


class FailureLog:
    """Logs adapters' failures at warning, at most one line per (adapter, kind) per ``interval_s``."""

    def __init__(self, logger: Any, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[int, str], float] = {}  # when a line was last logged
        self._held: dict[tuple[int, str], tuple[int, str]] = {}  # (count, detail) not yet logged

    def report(self, adapter_index: int, l2_name: str, counts: FailureCounts, *, flush: bool = False) -> None:
        """Fold in what ``counts`` has new; log what the rate limit allows (everything with ``flush``)."""
        for kind, (count, detail) in counts.take().items():
            held_count, held_detail = self._held.get((adapter_index, kind), (0, ""))
            self._held[adapter_index, kind] = (held_count + count, detail or held_detail)
        if not self._held:
            return
        now = self._clock()
        for slot in [slot for slot in self._held if slot[0] == adapter_index]:
            last = self._last.get(slot)
            if not flush and last is not None and now - last < self._interval_s:
                continue
            count, detail = self._held.pop(slot)
            self._last[slot] = now
            if self._log is None:
                continue
            kind = slot[1]
            event = "l2.record_rejected" if kind == "integrity" else "l2.failure"
            fields: dict[str, Any] = {"adapter_index": adapter_index, "l2_name": l2_name, "kind": kind,
                                      "count": count, "total": counts.totals().get(kind, count)}
            if detail:
                fields["detail"] = detail
            if kind in _HINTS:
                fields["hint"] = _HINTS[kind]
            self._log.warning(event, **fields)
