"""When a child that exited is started again, and when a crash-looping one is given up.

Pure: a policy reads a child's exit history and the time it is given, and returns the next history with
its decision, so that it is tested without processes or clocks.  A child that exits is restarted after
``backoff_initial_s``, doubling per consecutive quick exit (a run shorter than ``crash_window_s``) up to
``backoff_max_s``; one that exits ``give_up_after`` times within ``crash_window_s`` is given up
(``None``: never, as telemetry).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitHistory:
    """What a policy remembers of one child: its exit times within the window, its quick exits in a row."""

    exits: tuple[float, ...] = ()
    failures: int = 0  # consecutive exits after runs shorter than the window: the backoff's exponent


@dataclass(frozen=True)
class Decision:
    history: ExitHistory
    give_up: bool
    backoff_s: float  # restart this long after the exit (0 when given up)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_max_s: float
    give_up_after: int | None  # exits within crash_window_s that give the child up; None: never
    crash_window_s: float = 30.0
    backoff_initial_s: float = 0.5

    def after_exit(self, history: ExitHistory, started_at: float, now: float) -> Decision:
        """The decision for a child started at ``started_at`` that exited at ``now``."""
        failures = history.failures + 1 if now - started_at < self.crash_window_s else 1
        exits = tuple(t for t in (*history.exits, now) if now - t <= self.crash_window_s)
        after = ExitHistory(exits, failures)
        if self.give_up_after is not None and len(exits) >= self.give_up_after:
            return Decision(after, give_up=True, backoff_s=0.0)
        return Decision(after, give_up=False,
                        backoff_s=min(self.backoff_max_s, self.backoff_initial_s * 2 ** (failures - 1)))


CACHE_POLICY = RestartPolicy(backoff_max_s=8.0, give_up_after=5)
TELEMETRY_POLICY = RestartPolicy(backoff_max_s=30.0, give_up_after=None)
