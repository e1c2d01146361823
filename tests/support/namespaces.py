"""Scenarios in a private mount namespace with their own /dev/shm (``tests/e2e/pidns_driver.py``), and the mark
that skips them where ``unshare`` may not create namespaces (not root, or a container that forbids it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.private_shm import in_mount_namespace
from support.service import REPO

DRIVER = os.path.join(REPO, "tests", "e2e", "pidns_driver.py")


def can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--pid", "--fork", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(not can_unshare(), reason="unshare cannot create mount and PID namespaces here")


def run_driver(scenario: str, workdir: Path) -> dict:
    """``pidns_driver.py SCENARIO WORKDIR`` in a private mount namespace: its last stdout line, as JSON."""
    return in_mount_namespace([sys.executable, DRIVER, scenario, str(workdir)], 240)
