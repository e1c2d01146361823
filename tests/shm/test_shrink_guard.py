"""A segment truncated by another process under a copy: with the guard, the copy goes on over the restored
(zero-filled) size and the fault is counted; without it, or for a SIGBUS that is not such a fault, the process
dies of SIGBUS as before.  Each case runs in a child process, which is what a SIGBUS would kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from mpcache.shm import shrink_guard

pytestmark = pytest.mark.skipif(shrink_guard._busguard is None, reason="built without the C extension")

_CHILD = r"""
import json, os, signal, sys
import numpy as np
from mpcache.shm.segment import Segment
from mpcache.shm.shrink_guard import ShrinkGuard
name, size = sys.argv[1], 1 << 20
Segment.create(name, size).close()
segment = Segment.attach(name, size, keep_fd=True)
view = np.ndarray((size,), dtype=np.uint8, buffer=segment.buf)
view[:] = 7
guard = ShrinkGuard(segment, view)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # the parent truncates the segment to one page meanwhile
copy = view.copy()  # reads past the new end
print(json.dumps({"faults": guard.faults, "head": int(copy[0]), "tail": int(copy[-1]),
                  "size": os.fstat(segment.fd).st_size}), flush=True)
os.kill(os.getpid(), signal.SIGBUS)  # not a fault in the guarded mapping: the previous disposition
"""


def test_a_copy_past_a_truncated_end_is_survived_and_any_other_sigbus_is_not():
    name = f"/mpcache-test-guard.{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert {"ready": True} == json.loads(child.stdout.readline())
        os.truncate(f"/dev/shm{name}", 4096)
        child.stdin.write("\n")
        child.stdin.flush()
        copied = json.loads(child.stdout.readline())
        assert ({"faults": 1, "head": 7, "tail": 0, "size": 1 << 20}, -signal.SIGBUS) == (copied, child.wait(30))
    finally:
        child.kill()
        child.wait(30)
        os.unlink(f"/dev/shm{name}")
