"""Only its own files: the runtime dir, its default base, and leftovers of other runs.

The default runtime base is ``$TMPDIR/mpcache-<uid>``; every test here points TMPDIR at its own
directory, so nothing outside it is touched.  The PID-namespace scenarios run in a private mount
namespace with their own /dev/shm (``pidns_driver.py``) and are skipped where ``unshare`` may not
create namespaces (not root, or a container that forbids it).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.namespaces import needs_namespaces, run_driver
from support.ports import free_port
from support.service import REPO, START_CACHE
from support.waiting import wait_for

pytestmark = pytest.mark.slow

SMALL = ["--workers", "1", "--chunk-bytes", "4KiB", "--l1-size", "2MiB", "--ring-cells", "4096", "--disable-metrics"]


def start_cache(tmpdir: Path, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``bin/start-cache`` to the end (``--duration 1``) with TMPDIR=``tmpdir``."""
    env = dict(os.environ, TMPDIR=str(tmpdir))
    return subprocess.run([sys.executable, START_CACHE, *SMALL, "--prometheus-port", str(free_port()),
                           "--duration", "1", *flags], capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=REPO)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory of the scenario's own under a short path: its supervisors' default runtime base is beneath it,
    and ``<base>/mpcache-<uid>/<pid>/cache0.sock`` must fit in sun_path's 108 bytes, which an xdist worker's
    tmp_path (one directory deeper, ``popen-gwN/``) did not leave room for."""
    path = Path(tempfile.mkdtemp(prefix="pidns-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_namespaces
def test_a_live_instance_in_another_pid_namespace_is_never_touched(workdir) -> None:
    """Instance A runs; instance B starts in a new PID namespace (where A's pid does not exist) with the
    same runtime base and /dev/shm: B removes nothing, A's 4 segments and runtime dir are still there, and
    both serve a byte-exact round trip — B to a client outside its namespace, whose pid there is 0; both
    stop with exit 0 and leave nothing."""
    result = run_driver("live_instance_in_another_namespace", workdir)

    assert 4 == len(result["a_segments_before"])
    assert result["a_segments_before"] == result["a_segments_after_b"]
    assert (True, True, True) == (result["a_runtime_dir_exists"], result["a_serves"], result["b_serves"])
    assert [] == result["b_removed"]
    assert (0, 0, []) == (result["a_status"], result["b_status"], result["left"])


@needs_namespaces
def test_a_restarted_pid_1_with_a_fixed_instance_id_replaces_its_own_leftovers(workdir) -> None:
    """A supervisor that is PID 1 of a PID namespace, with a fixed --instance-id, is SIGKILLed and started
    again as PID 1 of a new namespace (a container restarted): the same segment names.  The second start
    finds the first's marker, removes exactly its 4 segments and its runtime dir, saying that supervisor
    (pid 1) is gone, and serves; the third, whose predecessor ran in a --runtime-dir it cannot see, recognises
    the 4 segments of its own name by their free lock, replaces them and serves; nothing is left at the end."""
    result = run_driver("pid1_restarted", workdir)
    names = sorted(f"mpcache.1.{result['instance'][:8]}.{what}" for what in ("events0", "gauges", "l1pool0",
                                                                              "telemetry"))

    assert result["first_serves"] and names == result["left_by_first"] == result["left_by_second"]
    assert result["second_serves"] and names == result["second_segments"]
    removed = dict(result["second_removed"])
    assert {"/" + name for name in names} | {str(workdir / "tmp" / f"mpcache-{os.getuid()}" / "1")} == set(removed)
    # "(pid 1 in PID namespace N) is gone" — or without the namespace, when the kernel gave the new namespace
    # the dead one's inode number: the marker's free lock is what tells, not the inode.
    assert all(reason.startswith("its supervisor (pid 1") and reason.endswith("is gone") for reason in removed.values())
    assert result["third_serves"]
    assert sorted("/" + name for name in names) == sorted(name for name, _ in result["third_removed"])
    assert (0, []) == (result["third_status"], result["left"])


@needs_namespaces
def test_killed_runs_leave_nothing_whatever_removed_their_runtime_dir(workdir) -> None:
    """In a /dev/shm of their own (no other start on the machine may sweep first): A, killed whole (kill -9 of
    the tree) and its runtime dir wiped as systemd's RuntimeDirectory= does, leaves its 4 segments; a process
    that made a segment of no run (a benchmark's ``mpcache.<pid>.<tag>.mrc``) is killed -9 and leaves it.  B's
    start removes exactly those 5: A's found by their unlocked gauge board, the orphan because its owner is gone
    (saying so); it leaves a live pid's segment, and of the dead pid another user's, a 0644 one, a run's whose
    gauge board is there and names not of our pattern; B serves.  B's supervisor alone killed, its children exit
    and leave B's 4 segments; C's start removes exactly those; C stops with exit 0 and nothing is left."""
    result = run_driver("killed_runs_leave_nothing", workdir)
    [orphan] = result["orphans"]["killed"]
    pid = orphan.split(".")[1]

    assert 4 == len(result["a_left"]) and 4 == len(result["b_left"]) and 7 == len(result["orphans"]["kept"])
    assert sorted("/" + name for name in [*result["a_left"], orphan]) == sorted(result["b_removed"])
    assert f"no run holds it (no gauge board) and its owner pid {pid} is gone" == result["b_reasons"]["/" + orphan]
    assert result["orphans"]["kept"] == result["kept_after_b"]
    assert not set(result["a_left"]) & set(result["b_left"])
    assert sorted("/" + name for name in result["b_left"]) == sorted(result["c_removed"])
    assert (True, True, True, True) == (result["a_serves"], result["b_serves"], result["b_children_exited"],
                                        result["c_serves"])
    assert (0, []) == (result["c_status"], result["left"])


def test_a_symlinked_default_runtime_base_is_refused(tmp_path) -> None:
    """``$TMPDIR/mpcache-<uid>`` is a symlink to a directory someone else prepared: the supervisor exits 2
    with one line naming the base and the symlink, and the target directory is left as it was (empty,
    mode 0755): no runtime dir, no socket, no chmod in it."""
    target = tmp_path / "prepared"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    (tmp_path / f"mpcache-{os.getuid()}").symlink_to(target)

    result = start_cache(tmp_path)

    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr[-2000:]
    assert f"mpcache-{os.getuid()}" in lines[0] and "symbolic link" in lines[0]
    assert ([], 0o755) == (os.listdir(target), stat.S_IMODE(os.stat(target).st_mode))


@pytest.mark.parametrize("problem", ["mode 0777", "owned by another uid"])
def test_a_default_runtime_base_open_to_others_or_not_ours_is_refused(tmp_path, problem: str) -> None:
    """``$TMPDIR/mpcache-<uid>`` exists but is writable by others (0777), or belongs to another user: exit 2
    with one line naming it and what is wrong; nothing is created in it."""
    base = tmp_path / f"mpcache-{os.getuid()}"
    base.mkdir()
    if problem == "mode 0777":
        base.chmod(0o777)
        expected = "mode 0777"
    else:
        if os.getuid() != 0:
            pytest.skip("only root can give a directory to another user")
        base.chmod(0o700)
        os.chown(base, 65534, 65534)
        expected = "owned by uid 65534"

    result = start_cache(tmp_path)

    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr[-2000:]
    assert str(base) in lines[0] and expected in lines[0]
    assert [] == os.listdir(base)


def test_a_runtime_dir_that_is_not_empty_is_refused_and_left_as_it_was(tmp_path) -> None:
    """``--runtime-dir`` names a directory with someone's file in it: exit 2, one line naming the flag and
    saying it is not empty, and the file is still there, unchanged."""
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "precious.txt").write_text("keep me")

    result = start_cache(tmp_path, "--runtime-dir", str(directory))

    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr[-2000:]
    assert "--runtime-dir" in lines[0] and "not empty" in lines[0]
    assert ["precious.txt"] == os.listdir(directory)
    assert "keep me" == (directory / "precious.txt").read_text()


def test_an_existing_empty_runtime_dir_is_used_and_only_what_the_service_created_is_removed(tmp_path) -> None:
    """``--runtime-dir`` names an existing empty directory: the service runs in it (its marker names the
    instance, this boot and PID namespace) and at stop removes what it created but keeps the directory
    (it did not create it) and a file someone else put there meanwhile, logging ``runtime_dir.kept``."""
    directory = tmp_path / "given"
    directory.mkdir()
    log = tmp_path / "service.log"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    process = subprocess.Popen([sys.executable, START_CACHE, *SMALL, "--prometheus-port", str(free_port()),
                                "--runtime-dir", str(directory), "--log-file", str(log)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        marker = directory / "instance.json"
        wait_for(lambda: (directory / "cache0.sock").exists(), 30, "the cache socket")
        data = json.loads(marker.read_text())
        (directory / "theirs.txt").write_text("not the service's")
        process.terminate()
        status = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    kept = [json.loads(line) for line in log.read_text().splitlines() if '"runtime_dir.kept"' in line]

    assert 0 == status
    assert ["theirs.txt"] == os.listdir(directory)
    assert [["theirs.txt"]] == [line["entries"] for line in kept]
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    assert (process.pid, boot, os.stat("/proc/self/ns/pid").st_ino, False) == (
        data["supervisor_pid"], data["boot_id"], data["pid_namespace"], data["created_dir"])


def test_a_log_file_path_that_is_a_symlink_is_refused(tmp_path) -> None:
    """``--log-file`` names a symlink someone planted (pointing at a file of ours): exit 2 with one line
    naming --log-file, and the file it points at is unchanged."""
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    link = tmp_path / "mpcache.log"
    link.symlink_to(victim)

    result = start_cache(tmp_path, "--log-file", str(link))

    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr[-2000:]
    assert "--log-file" in lines[0]
    assert "untouched\n" == victim.read_text()
