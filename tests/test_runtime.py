"""Which leftovers are a run's own: the marker, its lock, and the sweep.

Every test works in its own base directory and creates its own uniquely named segments, unlinked at
teardown (``segment_factory``).  The two that leave a dead run's or an orphan's segments for a sweep of
/dev/shm run in a /dev/shm of their own (``support.private_shm``): a ``start-cache`` that another test starts
at the same time sweeps the machine's /dev/shm, and would remove them first.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from support.namespaces import needs_namespaces
from support.private_shm import in_private_shm

from mpcache.shm import layout
from mpcache.shm.gauges import format_gauge_board
from mpcache.shm.segment import SHM_DIR, Segment
from mpcache.supervisor import runtime
from mpcache.supervisor.runtime import (
    MARKER_FILE,
    Marker,
    RuntimeDir,
    SegmentLock,
    Swept,
    boot_id,
    pid_namespace,
    remove_runtime_files,
    sweep,
    sweep_orphan_segments,
    sweep_segments,
)

HOLDER = """
import sys, time
from mpcache.supervisor.runtime import Marker, RuntimeDir
Marker.create(RuntimeDir(sys.argv[1], created=True), "held", 4242, sys.argv[2:])
print("locked", flush=True)
time.sleep(120)
"""


def segments(segment_factory, count: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [segment_factory(4096, f"/mpcache.{os.getpid()}.{tag}.s{i}").name for i in range(count)]


def exists(name: str) -> bool:
    return os.path.exists(SHM_DIR + name)


def test_a_run_that_holds_its_marker_is_never_swept_and_is_once_it_has_died(tmp_path, segment_factory) -> None:
    """A live process holds the marker of run dir ``base/7`` (naming 2 segments): the sweep removes
    nothing; after that process is SIGKILLed, the sweep removes exactly those 2 segments and the dir,
    saying its supervisor is gone — the marker's pid (4242) says nothing about liveness."""
    names = segments(segment_factory, 2)
    run = tmp_path / "7"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), *names], stdout=subprocess.PIPE, text=True)
    try:
        assert "locked" == holder.stdout.readline().strip()
        while_alive = sweep(str(tmp_path))
        present_while_alive = [exists(n) for n in names] + [run.exists()]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    after = sweep(str(tmp_path))

    assert ([], [True, True, True]) == (while_alive.removed, present_while_alive)
    assert sorted(names) == sorted(line["segment"] for line in after.removed if "segment" in line)
    assert [str(run)] == [line["runtime_dir"] for line in after.removed if "runtime_dir" in line]
    assert {"its supervisor (pid 4242) is gone"} == {line["reason"] for line in after.removed}
    assert ([False, False], False) == ([exists(n) for n in names], run.exists())


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("boot_id", "an-earlier-boot", "left by supervisor pid 4242 before the last boot"),
    ("pid_namespace", 1, "its supervisor (pid 4242 in PID namespace 1) is gone"),
])
def test_a_stale_marker_says_why(tmp_path, segment_factory, field: str, value: object, reason: str) -> None:
    """An unlocked marker from an earlier boot, or from another PID namespace, is swept with a reason that
    says so."""
    names = segments(segment_factory, 1)
    run = tmp_path / "run"
    run.mkdir()
    data = {"format": "mpcache-instance/1", "instance_id": "x", "supervisor_pid": 4242, "boot_id": boot_id(),
            "pid_namespace": pid_namespace(), "uid": os.getuid(), "runtime_dir": str(run), "created_dir": True,
            "segments": names, field: value}
    (run / MARKER_FILE).write_text(json.dumps(data))

    swept = sweep(str(tmp_path))

    assert [reason, reason] == [line["reason"] for line in swept.removed]
    assert (False, False) == (exists(names[0]), run.exists())


def test_directories_without_a_marker_of_ours_are_never_touched(tmp_path, segment_factory) -> None:
    """A dead pid's directory without a marker (what an older version left, or someone else's), and one
    whose marker is not valid JSON, keep every file; no segment is removed."""
    names = segments(segment_factory, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    bare = tmp_path / dead.stdout.strip()
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MARKER_FILE).write_text("not json")

    swept = sweep(str(tmp_path))

    assert ([], [], True) == (swept.removed, swept.kept, exists(names[0]))
    assert (["config.json"], [MARKER_FILE]) == (os.listdir(bare), os.listdir(broken))


def test_a_stale_marker_whose_segment_names_a_live_run_holds_removes_none_of_them(tmp_path, segment_factory) -> None:
    """A dead run's marker names segments that a live run (same pid and --instance-id in another PID
    namespace) now holds — its gauge board is locked: none is removed, and the sweep says why."""
    tag = uuid.uuid4().hex[:8]
    names = [segment_factory(4096, f"/mpcache.{os.getpid()}.{tag}.{what}").name for what in ("gauges", "events0")]
    live = tmp_path / "live"
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.replace(
        "Marker.create(",
        "from mpcache.supervisor.runtime import SegmentLock; SegmentLock(sys.argv[2]); Marker.create("),
        str(live), *names], stdout=subprocess.PIPE, text=True)
    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / MARKER_FILE).write_text(json.dumps({
        "format": "mpcache-instance/1", "supervisor_pid": 1, "boot_id": boot_id(), "pid_namespace": 1,
        "uid": os.getuid(), "created_dir": True, "segments": names}))
    try:
        assert "locked" == holder.stdout.readline().strip()
        swept = sweep(str(tmp_path))
        present = [exists(n) for n in names]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()

    assert [True, True] == present
    assert [] == [line for line in swept.removed if "segment" in line]
    assert [names] == [line["segments"] for line in swept.kept]


def runs_of_every_kind_swept() -> dict:
    """In test_segments_of_a_dead_run_are_found_in_dev_shm_and_only_provably_dead_ones_of_ours's private
    /dev/shm: each kind of run's segments, what sweep_segments removed, and which segments are left."""
    pid = 4_000_000 + uuid.uuid4().int % 100_000  # above pid_max's default: no live process of this pid here

    def run(instance: str, *, version: int | None = layout.GAUGE_LAYOUT_VERSION) -> list[str]:
        """A run's board (formatted with ``version``; None: not yet), ring and L1 pool."""
        segments = [Segment.create(f"/mpcache.{pid}.{instance}.{what}", 4096) for what in ("gauges", "events0",
                                                                                            "l1pool0")]
        if version is not None:
            format_gauge_board(segments[0], 1)
            segments[0].buf[8:12] = version.to_bytes(4, "little")
        return [segment.name for segment in segments]

    runs = {"dead": run("d"), "live": run("l"), "older": run("o", version=2), "unformatted": run("u", version=None),
            "foreign": run("f")}
    runs["longer"] = [Segment.create(f"/mpcache.{pid}.d.x.events0", 4096).name]  # instance id "d.x..."
    os.chown(SHM_DIR + runs["foreign"][0], 65534, 65534)
    holder = SegmentLock(runs["live"][0])
    swept = Swept()
    try:
        sweep_segments(swept)
    finally:
        holder.release()
    return {"pid": pid, "runs": runs, "removed": swept.removed, "left": sorted("/" + n for n in os.listdir(SHM_DIR))}


@needs_namespaces
def test_segments_of_a_dead_run_are_found_in_dev_shm_and_only_provably_dead_ones_of_ours() -> None:
    """No marker anywhere (its runtime dir is gone): the sweep of /dev/shm removes the ring and L1 pool of the run
    whose gauge board is ours, formatted by this build and locked by nobody, the board last, saying its
    supervisor is gone; it leaves a live run's (board locked), another build's (layout version 2), a board
    not yet formatted (a run being created), another user's, and a longer instance id sharing the dead run's
    name prefix.  In a /dev/shm of its own: a start-cache elsewhere would sweep the dead run first."""
    seen = in_private_shm(runs_of_every_kind_swept)

    dead = seen["runs"].pop("dead")
    assert [dead[1], dead[2], dead[0]] == [line["segment"] for line in seen["removed"]]
    assert {f"no live run holds its gauge board (supervisor pid {seen['pid']} is gone)"} == {
        line["reason"] for line in seen["removed"]}
    assert sorted(name for names in seen["runs"].values() for name in names) == seen["left"]


def test_at_stop_only_the_files_a_run_creates_are_removed(tmp_path) -> None:
    """remove_runtime_files removes sockets, staging names, the configuration, status and marker files,
    keeps anything else, and removes the directory only when told it created it and it is empty."""
    ours = ["cache0.sock", ".cache1.sock.4194304", "config.json", "status.json", "status.json.12.tmp",
            "instance.json", "lmcache0.ipc"]
    for directory in ("mixed", "pure"):
        (tmp_path / directory).mkdir()
        for name in ours:
            (tmp_path / directory / name).write_text("")
    (tmp_path / "mixed" / "notes.txt").write_text("someone's")

    kept = remove_runtime_files(str(tmp_path / "mixed"), remove_dir=True)
    kept_pure = remove_runtime_files(str(tmp_path / "pure"), remove_dir=True)

    assert (["notes.txt"], ["notes.txt"]) == (kept, os.listdir(tmp_path / "mixed"))
    assert ([], False) == (kept_pure, (tmp_path / "pure").exists())


def test_the_marker_is_created_once_never_through_a_link_and_locked(tmp_path) -> None:
    """Marker.create refuses an existing marker (or a symlink planted in its place), writes 0600, and holds
    a lock another open of the file cannot take until release()."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / MARKER_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        Marker.create(RuntimeDir(str(planted), created=False), "x", 1, [])
    assert not (tmp_path / "elsewhere").exists()

    marker = Marker.create(RuntimeDir(str(tmp_path), created=False), "x", os.getpid(), ["/mpcache.1.x.gauges"])
    fd = os.open(marker.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        marker.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the lock were still held
    finally:
        os.close(fd)
    assert 0o600 == os.stat(marker.path).st_mode & 0o777
    assert ["/mpcache.1.x.gauges"] == json.loads(open(marker.path).read())["segments"]


def an_orphan_swept(pid_ns: int | None, ipc_ns: int) -> dict:
    """In test_an_orphan_is_kept_where_its_owner_pid_cannot_be_judged's private /dev/shm, with /proc saying
    these namespaces: whether pids judge shared memory, the orphan's name, and what the sweep did with it."""
    runtime._namespace = {"pid": pid_ns, "ipc": ipc_ns}.get  # the child process is this test's alone
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: no process of this pid here now
    name = f"/mpcache.{dead.pid}.o{uuid.uuid4().hex[:6]}.mrc"
    Segment.create(name, 4096).close()
    swept = Swept()
    sweep_orphan_segments(swept)
    return {"judged": runtime.pids_judge_shared_memory(), "name": name, "exists": exists(name),
            "kept": [line["segment"] for line in swept.kept], "removed": [line["segment"] for line in swept.removed]}


@needs_namespaces
@pytest.mark.parametrize("pid_ns, ipc_ns, judged", [
    (0xEFFFFFFC, 0xEFFFFFFF, True),  # the host's namespaces
    (4026532500, 4026532501, True),  # a container's own (docker's default): its /dev/shm is its own too
    (4026532500, 0xEFFFFFFF, False),  # a hostIPC pod, an --ipc=host container: the host's /dev/shm, not its pids
    (None, 0xEFFFFFFF, False),  # /proc does not say
])
def test_an_orphan_is_kept_where_its_owner_pid_cannot_be_judged(pid_ns, ipc_ns, judged) -> None:
    """A segment of no run whose pid is not alive here is removed at start-up only where that pid says something:
    not from a PID namespace of its own that shares the host's IPC namespace (and /dev/shm), where the owner may
    live in another namespace.  There it stays, in a leftover.kept line.  In a /dev/shm of its own: a start-cache
    elsewhere would remove the orphan first."""
    seen = in_private_shm(an_orphan_swept, pid_ns, ipc_ns)

    assert judged is seen["judged"]
    assert (not judged, [] if judged else [seen["name"]], [seen["name"]] if judged else []) == (
        seen["exists"], seen["kept"], seen["removed"])
