"""A command sent SIGTERM once it has started a child: how it ended, and what it left running."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil

from support.waiting import wait_for


def sigterm_once_a_child_starts(argv: list[str], tmpdir: Path, what: str) -> tuple[int, list[str], list[int]]:
    """Run ``argv`` with ``TMPDIR=tmpdir``, SIGTERM it as soon as it has a child (``what``, for the wait's
    message): its exit status, its lines on stderr, and the pids of its children still running after it."""
    command = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        children = wait_for(lambda: psutil.Process(command.pid).children(), 60, what)
        command.send_signal(signal.SIGTERM)
        _, stderr = command.communicate(timeout=60)
    finally:
        command.kill()
    alive = [child.pid for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    return command.returncode, stderr.decode().strip().splitlines(), alive
