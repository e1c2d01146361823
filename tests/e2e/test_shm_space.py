"""Shared memory that fits: a /dev/shm too small is one clear error at start, never a
SIGBUS later.

Two real ones, in a private mount namespace with a small tmpfs on /dev/shm (``pidns_driver.py``;
skipped where ``unshare`` may not create namespaces), and one where the supervisor is told (a patched
``os.statvfs``) that /dev/shm has 40 MiB free, which runs anywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support.namespaces import needs_namespaces, run_driver
from support.ports import free_port
from support.service import REPO

pytestmark = pytest.mark.slow

FAKE_FREE = """
import os, sys
real = os.statvfs
class Small:
    def __init__(self, st):
        self.f_frsize, self.f_bsize, self.f_bavail, self.f_bfree = st.f_frsize, st.f_bsize, 0, 0
        self.f_bavail = self.f_bfree = 40 * 2**20 // st.f_frsize
def statvfs(path):
    st = real(path)
    return Small(st) if os.path.realpath(path) == "/dev/shm" else st
os.statvfs = statvfs
sys.path.insert(0, sys.argv[1])
from mpcache.supervisor import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_dev_shm_with_too_little_room_is_one_line_naming_the_size_and_shm_size(tmp_path) -> None:
    """/dev/shm reports 40 MiB free; 2 cache processes with 32 MiB of L1 each need 2 x 32 MiB + rings +
    the telemetry process's 2 x 4 MiB + a 16 MiB margin: exit 2 at once with one stderr line naming /dev/shm,
    the MiB needed (between 88 + 1 and 88 + 4 for the rings and gauges) and Docker's --shm-size; no segment,
    no runtime dir."""
    runtime_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", FAKE_FREE, REPO, "--workers", "2", "--l1-size", "32MiB",
                                "--ring-cells", "4096", "--prometheus-port", str(free_port()), "--runtime-dir",
                                str(runtime_dir), "--duration", "1"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd=REPO)
    _, stderr = process.communicate(timeout=60)
    lines = stderr.strip().splitlines()

    assert (2, 1) == (process.returncode, len(lines)), stderr[-2000:]
    needs = float(re.search(r"needs ([0-9.]+) MiB", lines[0]).group(1))
    assert "/dev/shm has 40.0 MiB free" in lines[0] and "--shm-size" in lines[0]
    assert 89 <= needs <= 92
    assert not runtime_dir.exists()
    assert [] == [n for n in os.listdir("/dev/shm") if n.startswith(f"mpcache.{process.pid}.")]


@needs_namespaces
def test_a_real_dev_shm_smaller_than_l1_is_one_line_at_start(tmp_path) -> None:
    """A 24 MiB /dev/shm and a 32 MiB L1 pool: the supervisor exits 2 at start with one line naming the
    MiB needed and --shm-size, and leaves nothing in /dev/shm (it used to start, and the cache process
    died of SIGBUS once its L1 filled)."""
    result = run_driver("small_shm", tmp_path)

    assert (2, 2) == (result["exited_at_start"], result["status"]), result
    [line] = result["stderr"]
    needs = float(re.search(r"needs ([0-9.]+) MiB", line).group(1))
    assert 56 < needs < 57  # 32 MiB of L1, 8 MiB of telemetry state, a 16 MiB margin, a ring and the gauges
    assert "/dev/shm has 24.0 MiB free" in line and "--shm-size=64m" in line and "sizeLimit: 64Mi" in line
    assert [] == result["left"]


@needs_namespaces
def test_a_segment_that_does_not_fit_fails_at_creation_not_with_sigbus_at_first_write(tmp_path) -> None:
    """In a 1 MiB /dev/shm, creating a 4 MiB segment raises SharedMemoryFullError naming it, its size and
    --shm-size (the process exits 3 as told), instead of succeeding and dying of SIGBUS when it writes
    the page that does not fit; nothing is left in /dev/shm."""
    result = run_driver("segment_too_big", tmp_path)

    assert 3 == result["status"], result
    assert "no room for /mpcache." in result["stdout"] and "4.0 MiB" in result["stdout"]
    assert "--shm-size" in result["stdout"]
    assert [] == result["left"]
