"""Whether a cache or telemetry process has lost its supervisor.

The supervisor starts them as its own children, so its pid is their parent's until it dies; then the kernel
hands them to another (init or a subreaper) and nothing is left to restart or stop them: they exit.  The pid
compared is the one the supervisor named (``--supervisor-pid``, and the configuration's ``supervisor_pid``),
never the parent found at start, which is another already if the supervisor died before the child looked.
"""

from __future__ import annotations

import os

SUPERVISOR_PID_HELP = ("the supervisor's pid, which it passes: a configuration that cannot be read once that "
                       "process is gone (the next run's start removes a dead run's files) is told as orphaned")


def supervisor_gone(supervisor_pid: int | None) -> bool:
    """The supervisor of pid ``supervisor_pid`` is no longer this process's parent (None: none was named)."""
    return supervisor_pid is not None and os.getppid() != supervisor_pid
