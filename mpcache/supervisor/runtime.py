"""The supervisor's own files: its runtime dir, the marker that claims it, and the sweep of stale runs.

Only its own files.  The supervisor

* uses ``--runtime-dir DIR`` only if DIR is absent (it creates it, 0700) or an empty directory of
  ours (not a symlink); at stop it removes the files it created there, and DIR itself only if it
  created DIR;
* by default creates ``<tmp>/mpcache-<uid>`` with ``mkdir`` (exclusive) or, if it exists, uses it
  only after checking that it is a directory, not a symlink, owned by us and mode 0700; then
  creates its own ``<pid>`` directory in it, exclusively (another name if that one is taken);
* writes a marker, ``instance.json``, into its runtime dir (``O_EXCL | O_NOFOLLOW``, 0600): instance
  id, supervisor pid, boot id (``/proc/sys/kernel/random/boot_id``), PID-namespace inode
  (``/proc/self/ns/pid``), uid and the names of its shared-memory segments; and holds an exclusive
  ``flock`` on it for as long as it runs.

A run is stale when its marker's lock is free: the kernel drops a lock with the last descriptor of
the process that held it, whatever PID namespace that process was in.  So a live instance in
another PID namespace (whose pid means nothing here) is never touched, and a supervisor that was
PID 1 of a container, died and came back as PID 1 of a new namespace still recognises its own
leftovers.  A stale run's segments (the names in its marker, nothing else) and its runtime files are
removed at the next start.  Directories without a marker are never touched: PID liveness alone
cannot tell whose they are.  The boot id and namespace inode only explain, in the log line, why a run
is stale (an inode number is reused once its namespace is gone, so it cannot decide anything).

The segments do not depend on the marker, which goes with the runtime dir (systemd's
``RuntimeDirectory=`` removes it at every stop, ``kill -9`` included): :func:`sweep_segments` finds dead
runs in ``/dev/shm`` itself.  A run's gauge board (``mpcache.<pid>.<instance>.gauges``) is locked by its
supervisor before it is formatted and until its last segment is unlinked, so a board of this user,
formatted by this build and locked by nobody, is provably a dead run's: its segments (``<prefix><what>``,
``what`` a name without a dot such as ``events0``, this user's files) are removed, the board last.  Boards of another
user, of another build (not provably ours) or held by a live run (in whatever PID namespace) are never
touched.

A segment of our name (``mpcache.<pid>.<instance>.<what>``, ``instance`` at most 8 characters) that belongs to no run
(no gauge board of its prefix: a run's board is created first and unlinked last, so only a benchmark's or tool's own
segment is ever without one) is an orphan of a dead owner when its pid is not a live process here and it is a
regular file of this user, mode 0600, as :meth:`~mpcache.shm.segment.Segment.create` makes them
(:func:`sweep_orphan_segments`): a ``kill -9`` left it.  A live pid's, another user's, another mode's, a name not
ours are never touched, nor any where a pid cannot be judged: from a PID namespace of its own sharing the host's
IPC namespace (and /dev/shm), whose pids are not the other namespaces'.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mpcache.errors import ConfigError
from mpcache.shm.gauges import formatted_by_this_build
from mpcache.shm.layout import GAUGE_HEADER_SIZE
from mpcache.shm.segment import NAME_PREFIX, SHM_DIR, Segment

MARKER_FILE = "instance.json"
BOARD_SUFFIX = ".gauges"  # a run's gauge board: /dev/shm/mpcache.<pid>.<instance>.gauges
MARKER_FORMAT = "mpcache-instance/1"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# Everything a run of ours creates in its runtime dir (sockets and their staging names, telemetry's socket, the
# child configuration, the status file and its staging names, LMCache ipc sockets, the marker).
_OUR_FILES = re.compile(r"(config\.json|status\.json|instance\.json|cache\d+\.sock|telemetry\.sock|lmcache\d+\.ipc"
                        r"|\.cache\d+\.sock\.\d+|[a-z]+\.json\.\d+\.tmp)")


def boot_id() -> str:
    """This boot's id ('' where /proc does not say)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    return _namespace("pid") or 0


def _namespace(kind: str) -> int | None:
    """The inode of this process's namespace of ``kind`` (``pid``, ``ipc``); None where /proc does not say."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return None


def default_base() -> str:
    """``<temporary directory>/mpcache-<uid>``; ConfigError when no temporary directory is usable (a read-only
    root filesystem without a writable /tmp), which a --runtime-dir on a volume makes no matter."""
    try:
        return os.path.join(tempfile.gettempdir(), f"mpcache-{os.getuid()}")
    except FileNotFoundError:  # tempfile found none of $TMPDIR, /tmp, /var/tmp, /usr/tmp, the cwd writable
        raise ConfigError("--runtime-dir: no usable temporary directory for the default (a read-only root "
                          "filesystem?): pass --runtime-dir DIR on a writable volume, or set TMPDIR") from None


@dataclass
class RuntimeDir:
    """The directory a run uses, and whether the run created it (then it removes it at stop)."""

    path: str
    created: bool


@dataclass
class Swept:
    """What the sweep of stale runs found and removed (logged once logging is set up)."""

    removed: list[dict[str, Any]] = field(default_factory=list)  # leftover.removed lines
    kept: list[dict[str, Any]] = field(default_factory=list)  # leftover.kept lines (not ours to remove)


def _describe(st: os.stat_result) -> str | None:
    """Why a directory with this lstat may not be used (None: it is a private directory of ours)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not {os.getuid()}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def prepare_base(base: str) -> None:
    """Create ``base`` (0700, exclusively) or check that the one there is a private directory of ours."""
    try:
        os.mkdir(base, 0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"runtime dir base {base}: cannot create it ({exc.strerror}); pass --runtime-dir") from None
    problem = _describe(os.lstat(base))
    if problem:
        raise ConfigError(f"runtime dir base {base} {problem}: refusing to use it (remove it, or pass --runtime-dir)")


def claim_default(base: str, pid: int) -> RuntimeDir:
    """Create this run's directory in ``base``: ``<pid>``, or ``<pid>-<random>`` if that name is taken."""
    path = os.path.join(base, str(pid))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # a live run of the same pid in another PID namespace, or a directory not ours
        path = tempfile.mkdtemp(prefix=f"{pid}-", dir=base)
    return RuntimeDir(path, created=True)


def claim_given(path: str) -> RuntimeDir:
    """``--runtime-dir``: created here if absent; otherwise it must be an empty private directory of ours."""
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            os.mkdir(path, 0o700)
        except OSError as exc:
            raise ConfigError(f"--runtime-dir: cannot create {path} ({exc.strerror})") from None
        return RuntimeDir(path, created=True)
    problem = _describe(st)
    if problem and not problem.startswith("has mode"):
        raise ConfigError(f"--runtime-dir: {path} {problem}")
    entries = os.listdir(path)
    if entries:
        raise ConfigError(f"--runtime-dir: {path} is not empty ({len(entries)} entries, e.g. {sorted(entries)[0]!r}); "
                          "give an empty or absent directory: at stop the service removes what it created there")
    os.chmod(path, 0o700)
    return RuntimeDir(path, created=False)


class Marker:
    """This run's claim on its runtime dir and segments: ``instance.json``, flocked while the run lives."""

    def __init__(self, fd: int, path: str, data: dict[str, Any]) -> None:
        self._fd: int | None = fd
        self.path = path
        self.data = data

    @classmethod
    def create(cls, runtime: RuntimeDir, instance_id: str, pid: int, segments: Iterable[str]) -> Marker:
        data = {"format": MARKER_FORMAT, "instance_id": instance_id, "supervisor_pid": pid, "boot_id": boot_id(),
                "pid_namespace": pid_namespace(), "uid": os.getuid(), "runtime_dir": runtime.path,
                "created_dir": runtime.created, "segments": list(segments)}
        path = os.path.join(runtime.path, MARKER_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # before any content: a sweeper never sees a complete unlocked marker
            os.write(fd, (json.dumps(data) + "\n").encode())
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, data)

    def release(self) -> None:
        """Drop the lock (at the very end of a clean stop, after the marker file itself is gone)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock_if_free(path: str) -> int | None:
    """A descriptor of ``path`` holding its exclusive lock, if it is a regular file of ours that no live process
    holds locked (in whatever PID namespace); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # EWOULDBLOCK: held, its holder is alive
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _stale_marker(directory: str) -> tuple[int, dict[str, Any]] | None:
    """(locked descriptor, contents) of the marker in ``directory`` if its run is over; None otherwise
    (no marker, not ours, unreadable, or its lock is held: that run is alive, in whatever namespace)."""
    fd = _lock_if_free(os.path.join(directory, MARKER_FILE))
    if fd is None:
        return None
    try:
        data = json.loads(os.read(fd, 1 << 20).decode())
        if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT or data.get("uid") != os.getuid():
            raise ValueError("not a marker of ours")
        return fd, data
    except (OSError, ValueError):
        os.close(fd)
        return None


def _why_stale(data: dict[str, Any]) -> str:
    pid = data.get("supervisor_pid")
    if data.get("boot_id") != boot_id():
        return f"left by supervisor pid {pid} before the last boot"
    if data.get("pid_namespace") == pid_namespace():
        return f"its supervisor (pid {pid}) is gone"
    return f"its supervisor (pid {pid} in PID namespace {data.get('pid_namespace')}) is gone"


def remove_runtime_files(path: str, remove_dir: bool) -> list[str]:
    """Remove the files a run of ours creates in ``path`` (and ``path`` itself if ``remove_dir`` and it is
    then empty); returns the names left because they are not ours."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    kept = []
    for name in entries:
        if _OUR_FILES.fullmatch(name):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                os.unlink(os.path.join(path, name))
        else:
            kept.append(name)
    if remove_dir and not kept:
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return sorted(kept)


def _sweep_one(directory: str, swept: Swept) -> None:
    found = _stale_marker(directory)
    if found is None:
        return
    fd, data = found
    try:
        reason = _why_stale(data)
        names = [n for n in data.get("segments", []) if isinstance(n, str) and n.startswith("/mpcache.")]
        # The same names may belong to a live run now (same pid and --instance-id, another PID namespace):
        # its gauge board is locked then, and nothing of that name is touched.
        in_use = [n for n in names if n.endswith(".gauges") and os.path.exists(SHM_DIR + n) and not segment_is_stale(n)]
        if in_use:
            swept.kept.append({"segments": names, "reason": f"{in_use[0]} is held by a live run"})
            names = []
        for name in names:
            if Segment.unlink(name):
                swept.removed.append({"segment": name, "reason": reason})
        kept = remove_runtime_files(directory, remove_dir=bool(data.get("created_dir", True)))
        swept.removed.append({"runtime_dir": directory, "reason": reason})
        if kept:
            swept.kept.append({"runtime_dir": directory, "entries": kept, "reason": "not created by mpcache"})
    finally:
        os.close(fd)


def sweep(base: str, also: str | None = None) -> Swept:
    """Remove the leftovers of every stale run of ours whose runtime dir is in ``base`` (or is ``also``)."""
    swept = Swept()
    candidates = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    candidates.append(entry.path)
    if also and os.path.abspath(also) not in candidates:
        with contextlib.suppress(OSError):
            st = os.lstat(also)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                candidates.append(os.path.abspath(also))
    for directory in sorted(candidates):
        _sweep_one(directory, swept)
    return swept


def sweep_segments(swept: Swept) -> None:
    """Remove the segments of every dead run of ours found in /dev/shm: those whose gauge board is this user's,
    formatted by this build and locked by no live supervisor."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return
    for board in entries:
        if board.startswith(NAME_PREFIX) and board.endswith(BOARD_SUFFIX):
            prefix = board[:-len(BOARD_SUFFIX) + 1]  # mpcache.<pid>.<instance>.
            fd = _dead_board(board)
            if fd is None:
                continue
            try:
                reason = f"no live run holds its gauge board (supervisor pid {prefix.split('.')[1]} is gone)"
                # <what> has no dot (events0, l1pool0, ...): a longer instance id's names never match
                run = re.compile(re.escape(prefix) + r"[a-z][a-z0-9]*")
                for name in [e for e in entries if run.fullmatch(e) and e != board] + [board]:
                    if _owned_file(name) and Segment.unlink("/" + name):
                        swept.removed.append({"segment": "/" + name, "reason": reason})
            finally:
                os.close(fd)


# mpcache.<owner pid>.<instance id's first 8 characters>.<what>: shm_name's names, nothing longer
_OUR_SEGMENT = re.compile(re.escape(NAME_PREFIX) + r"([1-9][0-9]{0,9})\.([A-Za-z0-9._:-]{1,8})\.([a-z][a-z0-9]*)")


# The inode numbers the kernel gives the initial PID and IPC namespaces (include/linux/proc_ns.h)
_INITIAL_PID_NS, _INITIAL_IPC_NS = 0xEFFFFFFC, 0xEFFFFFFF


def sweep_orphan_segments(swept: Swept) -> None:
    """Remove the segments of ours that no run holds and whose owner died (see the module's docstring); where a
    pid cannot be judged from here (:func:`pids_judge_shared_memory`), keep them, each in a leftover.kept line."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return
    present = set(entries)
    judged = pids_judge_shared_memory()
    for name in entries:
        match = _OUR_SEGMENT.fullmatch(name)
        if match is None or match[3] == BOARD_SUFFIX[1:]:
            continue
        pid, instance = int(match[1]), match[2]
        in_a_run = f"{NAME_PREFIX}{pid}.{instance}{BOARD_SUFFIX}" in present
        if in_a_run or _pid_alive(pid) or not _owned_file(name, private=True):
            continue
        if not judged:
            swept.kept.append({"segment": "/" + name, "reason": f"no run holds it, but whether its owner pid {pid} "
                               "is gone cannot be told here: this PID namespace is not the host's, whose IPC "
                               "namespace (and so /dev/shm) this process shares"})
            continue
        if Segment.unlink("/" + name):
            swept.removed.append({"segment": "/" + name,
                                  "reason": f"no run holds it (no gauge board) and its owner pid {pid} is gone"})


def pids_judge_shared_memory() -> bool:
    """Whether a pid that is not alive here is a dead owner of a segment in /dev/shm: not where this process shares
    the host's IPC namespace, and so its /dev/shm (a hostIPC pod, an ``--ipc=host`` container), from a PID
    namespace of its own, which does not see the processes of the others."""
    pid_ns, ipc_ns = _namespace("pid"), _namespace("ipc")
    return pid_ns is not None and ipc_ns is not None and (pid_ns == _INITIAL_PID_NS or ipc_ns != _INITIAL_IPC_NS)


def _pid_alive(pid: int) -> bool:
    """A process of this pid exists in this PID namespace (whoever's it is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a pid this kernel cannot have: never ours to judge
    return True


def _dead_board(name: str) -> int | None:
    """A descriptor holding the lock of gauge board ``name`` if it is a dead run's of ours (see the module's
    docstring); None otherwise (a live run's, another user's, another build's, one being created)."""
    fd = _lock_if_free(os.path.join(SHM_DIR, name))
    if fd is None:
        return None
    try:
        if formatted_by_this_build(os.pread(fd, GAUGE_HEADER_SIZE, 0)):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _owned_file(name: str, private: bool = False) -> bool:
    """``/dev/shm/name`` is a regular file of this user (not a link, not another user's); if ``private``, also of
    mode 0600 (what Segment.create makes)."""
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
            and (not private or stat.S_IMODE(st.st_mode) == 0o600))


class SegmentLock:
    """An exclusive flock on one of this run's shared-memory objects (the gauge board), held while it runs:
    a segment with our exact name that nobody holds is a leftover of a dead run, ours to replace."""

    def __init__(self, name: str) -> None:
        self._fd: int | None = os.open(SHM_DIR + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def segment_is_stale(name: str) -> bool:
    """True if the shared-memory object ``name`` is ours (same uid) and no live run holds its lock."""
    fd = _lock_if_free(SHM_DIR + name)
    if fd is None:
        return False
    os.close(fd)
    return True


def segments_with_prefix(prefix: str) -> list[str]:
    """Names (``/mpcache.<pid>.<instance>.…``) of the shared-memory objects that start with ``prefix``."""
    bare = prefix.lstrip("/")
    try:
        return sorted("/" + entry for entry in os.listdir(SHM_DIR) if entry.startswith(bare))
    except OSError:
        return []
