"""Stops a benchmark's child processes whatever ends the run: an error, Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def kill_running(processes: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every process still running (load generators: nothing of theirs needs a clean exit)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
