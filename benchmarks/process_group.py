"""A process group stopped without leaving shared memory behind (a vLLM engine's: its front end, engine core,
workers and Python's resource tracker).

Python's ``multiprocessing`` names what it creates ``/dev/shm/psm_*`` (``SharedMemory``) and ``/dev/shm/sem.mp-*``
(semaphores); the group's resource tracker unlinks whatever its users leave once they have all exited.  A SIGKILL
to the whole group kills the tracker with them, and those segments stay until reboot (vLLM's two message queues
per engine, hundreds of MiB).  So the group is given time to exit, then SIGTERM (the tracker ignores it), then
SIGKILL for all but the tracker, which cleans up after them and exits, and only then for whatever is left; what
the group's processes had mapped of those names and is still there after that is unlinked here (names read from
the processes themselves, never a glob of /dev/shm).
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time

from mpcache.shm.segment import SHM_DIR

# What multiprocessing creates: SharedMemory's psm_<hex>, a named semaphore's sem.mp-<random>
MULTIPROCESSING_NAME = re.compile(r"(psm_[0-9a-f]+|sem\.mp-[a-z0-9_]+)")
POLL_S = 0.05
KILLED_WAIT_S = 10.0


def members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def multiprocessing_segments(pids: list[int]) -> set[str]:
    """The multiprocessing segments (``psm_*``, ``sem.mp-*``) these processes have mapped and that still exist."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""  # an anonymous mapping names no file
            directory, _, name = path.rpartition("/")
            if directory == SHM_DIR and MULTIPROCESSING_NAME.fullmatch(name):
                names.add(name)
    return names


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _signal(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def stop_group(pgid: int, grace_s: float, started_at: float) -> list[str]:
    """End process group ``pgid`` (already asked to exit): ``grace_s`` to exit, SIGTERM and ``grace_s`` more,
    then SIGKILL; then unlink the multiprocessing segments its processes had mapped (when this was called or
    when they were killed) that are still there, ours and created since ``started_at`` (``time.time()`` when the
    group started).  Returns the names it unlinked: empty when the group cleaned up after itself."""
    mapped = multiprocessing_segments(members(pgid))
    if not _wait_gone(pgid, grace_s):
        _signal(pgid, signal.SIGTERM)
        if not _wait_gone(pgid, grace_s):
            mapped |= _kill_sparing_trackers(pgid)
    return [name for name in sorted(mapped) if _left_by_group(name, started_at)]


def _kill_sparing_trackers(pgid: int) -> set[str]:
    """SIGKILL the group's processes but its resource trackers, which then unlink what their users left and
    exit; then SIGKILL whatever is left.  Returns the segments the killed processes had mapped."""
    pids = members(pgid)
    mapped = multiprocessing_segments(pids)
    for pid in pids:
        if not _is_resource_tracker(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not _wait_gone(pgid, KILLED_WAIT_S):
        _signal(pgid, signal.SIGKILL)
        _wait_gone(pgid, KILLED_WAIT_S)
    return mapped


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.resource_tracker" in handle.read()
    except OSError:
        return False


def _left_by_group(name: str, started_at: float) -> bool:
    """Unlink ``name`` if it is a regular file of ours created since ``started_at``; True if it did."""
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_ctime < started_at:
            return False
        os.unlink(path)
    except OSError:
        return False
    return True
