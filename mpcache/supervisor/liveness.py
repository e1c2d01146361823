"""Liveness of the cache processes: serving once its socket replaced any predecessor's, unresponsive once
silent too long.

A cache process's heartbeat word (written every 0.5 s by its loop) must keep advancing once it listens:
silent for ``hang_timeout_s`` it is killed and restarted; one whose loop never starts within
``start_timeout_s`` too (until its socket appears it may rebuild an fs tier's index).  Pure: the caller
reads the gauge board and the socket, and hands the values in with the time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START_TIMEOUT_S = 120.0


@dataclass
class Heartbeat:
    """What is known of one cache process's liveness since it was (re)started."""

    started_at: float = 0.0
    stale_socket: int | None = None  # inode of a socket file left by the previous process, at spawn
    listening: bool = False  # this process's socket replaced any stale one: its loop runs from here on
    beat: int = 0  # the last heartbeat word this process wrote
    beat_changed_at: float = 0.0  # when the heartbeat word last changed


@dataclass(frozen=True)
class Silence:
    """Why a cache process is declared unresponsive."""

    silent_s: float
    limit_s: float
    what: str


@dataclass(frozen=True)
class Liveness:
    hang_timeout_s: float  # --hang-timeout
    start_timeout_s: float = START_TIMEOUT_S

    def observe(self, heartbeat: Heartbeat, pid: int, pid_word: int, beat: int,
                socket_inode: Callable[[], int | None], now: float) -> Silence | None:
        """Update ``heartbeat`` with the slot's pid and heartbeat words seen at ``now``; the silence that
        makes the process (``pid``) unresponsive, or None."""
        if pid_word == pid and beat != heartbeat.beat:
            heartbeat.beat, heartbeat.beat_changed_at = beat, now
        if not heartbeat.listening:
            # Its socket appears (replacing a predecessor's) just before its loop starts: from then on
            # its heartbeat is due every 0.5 s.
            inode = socket_inode()
            if pid_word == pid and inode is not None and inode != heartbeat.stale_socket:
                heartbeat.listening, heartbeat.beat_changed_at = True, now
                return None
            silence = Silence(now - heartbeat.started_at, self.start_timeout_s, "it never started serving")
        else:
            silence = Silence(now - heartbeat.beat_changed_at, self.hang_timeout_s,
                              "its heartbeat stopped advancing")
        return silence if silence.silent_s > silence.limit_s else None
