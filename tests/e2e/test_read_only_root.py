"""The service on a read-only root filesystem (``docker run --read-only``, Kubernetes'
``readOnlyRootFilesystem``), here a private mount namespace whose ``/`` is remounted read-only: with its
runtime dir on a writable volume it runs and stops cleanly, needing no /tmp; without one it says in one line
what to mount instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
START_CACHE = str(REPO / "bin" / "start-cache")
SMALL = ["--workers", "1", "--chunk-bytes", "4KiB", "--l1-size", "2MiB", "--ring-cells", "4096"]
CANNOT = 97  # the namespace could not be set up here

# $1: where to mount the volume (a tmpfs); then / is read-only and the command runs from / (not writable).
READ_ONLY_ROOT = f'''
mount -t tmpfs -o mode=0700 mpcache-volume "$1" || exit {CANNOT}
mount -o remount,bind,ro / || exit {CANNOT}
shift
cd /
exec "$@"
'''


def _run_read_only(volume: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_", "TMPDIR"))}
    try:
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh",
                                 str(volume), sys.executable, START_CACHE, *SMALL, *flags], capture_output=True,
                                text=True, timeout=120, env=env)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if result.returncode == CANNOT or "unshare failed" in result.stderr:
        pytest.skip(f"cannot make / read-only in a private mount namespace here: {result.stderr.strip()[-300:]}")
    return result


def test_the_service_runs_on_a_read_only_root_with_its_runtime_dir_on_a_volume(tmp_path) -> None:
    """--runtime-dir on the volume: exit 0 after --duration, no warning or error line (it used to stop with
    ``FileNotFoundError: No usable temporary directory found`` from the default it did not need)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    result = _run_read_only(volume, "--runtime-dir", str(volume / "service"), "--prometheus-port",
                            str(free_port()), "--duration", "2")
    assert 0 == result.returncode, result.stderr[-3000:]
    assert [] == [line for line in result.stderr.splitlines() if '"level": "warning"' in line
                  or '"level": "error"' in line or "Traceback" in line]
    assert '"event": "supervisor.stopped"' in result.stderr


def test_without_a_runtime_dir_a_read_only_root_is_one_line_saying_what_to_mount(tmp_path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    result = _run_read_only(volume, "--prometheus-port", str(free_port()), "--duration", "2")
    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr[-3000:]
    assert lines[0].startswith("start-cache: error: --runtime-dir: no usable temporary directory") and \
        "pass --runtime-dir DIR on a writable volume" in lines[0]
