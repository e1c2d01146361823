"""Liveness of the children that heartbeat: serving once they say so, unresponsive once silent too long.

The one watchdog of cache processes and telemetry.  A child writes its pid and a heartbeat word into shared
memory the supervisor owns (a cache process into its gauge-board slot every 0.5 s, from its loop; telemetry
into the board's header at least once a second, from its pump loop).  Once it serves (a cache process: its
socket replaced any predecessor's; telemetry: its first heartbeat) that word must keep advancing: silent for
``hang_timeout_s`` it is killed and restarted; one that never starts serving within ``start_timeout_s`` too
(a cache process may rebuild an fs tier's index first).  Pure: the caller reads the words and hands them in
with the time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START_TIMEOUT_S = 120.0


@dataclass
class Heartbeat:
    """What is known of one child's liveness since it was (re)started."""

    started_at: float = 0.0
    stale_socket: int | None = None  # inode of a socket file left by the previous process, at spawn
    listening: bool = False  # it serves (a cache process: its socket replaced any stale one): its loop runs
    beat: int = 0  # the last heartbeat word this process wrote
    beat_changed_at: float = 0.0  # when the heartbeat word last changed


@dataclass(frozen=True)
class Silence:
    """Why a child is declared unresponsive."""

    silent_s: float
    limit_s: float
    what: str


@dataclass(frozen=True)
class Liveness:
    hang_timeout_s: float  # --hang-timeout, --telemetry-hang-timeout
    start_timeout_s: float = START_TIMEOUT_S

    def observe(self, heartbeat: Heartbeat, pid: int, pid_word: int, beat: int,
                serving: Callable[[], bool], now: float) -> Silence | None:
        """Update ``heartbeat`` with the pid and heartbeat words seen at ``now``; the silence that makes the
        process (``pid``) unresponsive, or None.  ``serving()`` says whether it serves yet, once its own pid is
        in the words: from then on its heartbeat is due."""
        if pid_word == pid and beat != heartbeat.beat:
            heartbeat.beat, heartbeat.beat_changed_at = beat, now
        if not heartbeat.listening:
            if pid_word == pid and serving():
                heartbeat.listening, heartbeat.beat_changed_at = True, now
                return None
            silence = Silence(now - heartbeat.started_at, self.start_timeout_s, "it never started serving")
        else:
            silence = Silence(now - heartbeat.beat_changed_at, self.hang_timeout_s,
                              "its heartbeat stopped advancing")
        return silence if silence.silent_s > silence.limit_s else None
