"""An engine stopped by ``benchmarks.vllm_engine.Engine.stop`` leaves nothing in /dev/shm: a stand-in for vLLM's
processes (no vLLM needed) whose front end exits when asked while the children it spawned, which created a
``SharedMemory`` and a semaphore through Python's ``multiprocessing``, outlive it, as vLLM's engine core and worker
do."""

from __future__ import annotations

import os
import sys

from support.waiting import wait_for

from benchmarks.vllm_engine import Engine

# The front end (engine.py's protocol: a ready line, then {"op": "exit"} on stdin) spawns two children, each
# creating a SharedMemory and a Lock (psm_*, sem.mp-*) that Python's resource tracker unlinks once its users are
# gone: one dies of SIGTERM; one ignores it (only SIGKILL ends it) and has taken its SharedMemory off the tracker's
# list, as LMCache's and vLLM's processes do with segments they attach, so only Engine.stop can find it.  The names
# come back on the ready line, the untracked SharedMemory's first.
STAND_IN = r"""
import json, multiprocessing, os, signal, sys, time
from multiprocessing import resource_tracker, shared_memory

def child(stubborn, names):
    lock = multiprocessing.get_context("spawn").Lock()
    segment = shared_memory.SharedMemory(create=True, size=4096)
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        resource_tracker.unregister("/" + segment.name, "shared_memory")
    names.put((stubborn, [segment.name, lock._semlock.name.lstrip("/").replace("mp-", "sem.mp-", 1)]))
    while True:
        time.sleep(60)

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    names = spawn.Queue()
    for stubborn in (False, True):
        spawn.Process(target=child, args=(stubborn, names)).start()
    made = sorted((names.get(timeout=120), names.get(timeout=120)), reverse=True)
    print(json.dumps({"ready": True, "names": made[0][1] + made[1][1]}), flush=True)
    sys.stdin.readline()
    os._exit(0)  # at once, without waiting for its children
"""


def test_stop_leaves_none_of_the_multiprocessing_segments_its_outliving_children_made(tmp_path) -> None:
    """The front end exits at once; its children outlive it (one until SIGTERM, one until SIGKILL), and
    Engine.stop still leaves none of the 2 psm_* and 2 sem.mp-* segments they created, and no process: the
    resource tracker, spared, unlinked what it knew of; Engine.stop the untracked one (and only that one)."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    engine = Engine("python", tmp_path / "model", tmp_path / "stderr", launcher=[sys.executable, str(script)])
    names = engine.wait_ready(120)["names"]
    assert 4 == len(names) and all(os.path.exists(f"/dev/shm/{name}") for name in names), names
    assert 0 == engine.stop(timeout_s=1)
    assert [names[0]] == engine.swept
    assert [] == [name for name in names if os.path.exists(f"/dev/shm/{name}")], engine.stderr_tail()

    def group_gone() -> bool:  # its killed processes are reaped by whoever inherited them, soon after
        try:
            os.killpg(engine.process.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(group_gone, 30, "the engine's process group to be reaped")
