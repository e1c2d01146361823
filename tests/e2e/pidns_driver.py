"""Scenarios that need a /dev/shm of their own: supervisors in other PID namespaces, a /dev/shm too small,
runs killed whose leftovers no other start on the machine may remove first.

``unshare --mount --propagation private python pidns_driver.py SCENARIO WORKDIR`` mounts a fresh tmpfs
on /dev/shm (512 MiB, or what the scenario needs: so nothing here can touch, or be touched by, shared
memory of anyone else on the machine, whatever version of mpcache runs), points TMPDIR at
``WORKDIR/tmp`` (the supervisors' default runtime base), runs the scenario and prints one JSON object
with what it observed; ``test_runtime_isolation`` and ``test_shm_space`` assert on it.  Supervisors in
other PID namespaces are started with ``unshare --pid --kill-child``: killing that ``unshare`` process
kills the supervisor, which takes its namespace's children with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from support.private_shm import mount_shm  # noqa: E402
from support.waiting import wait_for as wait_or_fail  # noqa: E402

from mpcache.client import CacheClient  # noqa: E402
from mpcache.errors import MpcacheError  # noqa: E402

START_CACHE = os.path.join(REPO, "bin", "start-cache")
SMALL = ["--workers", "1", "--chunk-bytes", "4KiB", "--l1-size", "2MiB", "--ring-cells", "4096", "--disable-metrics",
         "--no-http"]  # no listener: several of these run at once, and /healthz would answer even without metrics


def shm() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("mpcache."))


def wait_for(condition, timeout_s: float = 30.0) -> Any:
    """``condition()``'s first truthy value within ``timeout_s``, or None: the scenario reports what it saw."""
    try:
        return wait_or_fail(condition, timeout_s, "a scenario's condition", tolerate=())
    except AssertionError:
        return None


def log_lines(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as handle:
            for raw in handle:
                try:
                    out.append(json.loads(raw))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
RUNS: list[Run] = []  # every supervisor started, killed at the end whatever happened
# how long a run may take to serve: a start on CI's two loaded cores once took more than 30 s, and a scenario
# starts at most three runs within run_driver's 240 s
READY_S = 60.0


def _die_with_the_driver() -> None:
    """In the child before exec: SIGKILL it when the driver dies (a crashed or timed-out driver leaks
    nothing: a supervisor in its own PID namespace takes that namespace with it)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Run:
    """One supervisor, in this PID namespace or (``pidns``) in a new one, logging to ``log``."""

    def __init__(self, workdir: str, name: str, *flags: str, pidns: bool = False) -> None:
        self.pidns = pidns
        self.log = os.path.join(workdir, f"{name}.log")
        prefix = ["unshare", "--pid", "--kill-child"] if pidns else []
        command = [*prefix, sys.executable, START_CACHE, *SMALL, "--log-file", self.log, *flags]
        with open(os.path.join(workdir, f"{name}.err"), "wb") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                            preexec_fn=_die_with_the_driver)
        RUNS.append(self)

    def events(self, event: str) -> list[dict]:
        return [line for line in log_lines(self.log) if line.get("event") == event]

    def runtime_dir(self) -> str | None:
        started = self.events("supervisor.started")
        return started[0]["runtime_dir"] if started else None

    def socket(self) -> str | None:
        ready = wait_for(lambda: self.events("cache.ready"), READY_S)
        return ready[0]["sockets"][0] if ready else None

    def supervisor_pid(self) -> int:
        """The supervisor's pid here (with ``pidns``, the child ``unshare`` forked)."""
        if not self.pidns:
            return self.process.pid
        children = wait_for(lambda: psutil.Process(self.process.pid).children(), 10)
        return children[0].pid

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` to the supervisor itself; its exit status (unshare passes it on)."""
        if self.process.poll() is None:
            os.kill(self.supervisor_pid(), sig)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return None


def round_trip(socket_path: str | None) -> bool:
    """Store 2 random chunks, prefetch and retrieve them: True if the bytes come back."""
    if socket_path is None:
        return False
    try:
        with CacheClient(socket_path, connect_timeout_s=5) as client:
            kv = client.register_buffer(4, 4096)
            kv.blocks[:2] = np.random.default_rng().integers(0, 256, (2, 4096))
            hashes = [secrets.randbits(63) for _ in range(2)]
            client.store(kv, request_id="w", model_name="org/m", chunk_hashes=hashes, block_ids=[0, 1])
            job = client.lookup_prefetch(request_id="r", model_name="org/m", chunk_hashes=hashes)
            found = client.wait_prefetch(job).found_count
            got = client.retrieve(kv, request_id="r", job_id=job, block_ids=[2, 3]).retrieved
            equal = bool(np.array_equal(kv.blocks[:2], kv.blocks[2:]))
            client.end_session("w")
            client.end_session("r")
            del kv
        return (found, got, equal) == (2, 2, True)
    except (OSError, ConnectionError, MpcacheError) as exc:
        print(f"round trip on {socket_path}: {exc!r}", file=sys.stderr)
        return False


def pings(socket_path: str | None) -> bool:
    """The cache process answers a ping."""
    if socket_path is None:
        return False
    try:
        with CacheClient(socket_path, connect_timeout_s=5) as client:
            client.ping()
        return True
    except (OSError, ConnectionError, MpcacheError) as exc:
        print(f"ping on {socket_path}: {exc!r}", file=sys.stderr)
        return False


def live_instance_in_another_namespace(workdir: str) -> dict:
    """A runs here; B starts in a new PID namespace, where A's pid does not exist.  What of A is left?"""
    a = Run(workdir, "a")
    a_socket = a.socket()
    a_segments = shm()
    a_dir = a.runtime_dir()
    b = Run(workdir, "b", pidns=True)
    b_socket = b.socket()
    result = {
        "a_segments_before": a_segments,
        "a_segments_after_b": [n for n in shm() if n in a_segments],
        "a_runtime_dir_exists": bool(a_dir and os.path.isdir(a_dir)),
        "a_serves": round_trip(a_socket),
        "b_serves": round_trip(b_socket),
        "b_removed": [line.get("segment") or line.get("runtime_dir") for line in b.events("leftover.removed")],
    }
    result["b_status"], result["a_status"] = b.stop(), a.stop()
    result["left"] = shm()
    return result


def pid1_restarted(workdir: str) -> dict:
    """A supervisor that is PID 1 of its namespace, with a fixed --instance-id, is killed and started again
    as PID 1 of a new namespace, twice: the second finds the first's marker in the default runtime base;
    the second ran in a --runtime-dir of its own, and the third in another, so the third has no marker to
    find: the gauge board's lock tells it the segments of its name are a dead run's."""
    instance = f"pid1-{secrets.token_hex(4)}"
    result: dict = {"instance": instance}
    first = Run(workdir, "first", "--instance-id", instance, pidns=True)
    result["first_serves"] = pings(first.socket())
    first.stop(signal.SIGKILL)  # unshare's --kill-child SIGKILLs the supervisor; the namespace goes with it
    result["left_by_first"] = shm()
    second = Run(workdir, "second", "--instance-id", instance, "--runtime-dir", os.path.join(workdir, "second-run"),
                 pidns=True)
    result["second_serves"] = pings(second.socket())
    result["second_removed"] = [(line.get("segment") or line.get("runtime_dir"), line.get("reason"))
                                for line in second.events("leftover.removed")]
    result["second_segments"] = shm()
    second.stop(signal.SIGKILL)
    result["left_by_second"] = shm()
    third = Run(workdir, "third", "--instance-id", instance, "--runtime-dir", os.path.join(workdir, "third-run"),
                pidns=True)
    result["third_serves"] = pings(third.socket())
    result["third_removed"] = [(line.get("segment"), line.get("reason")) for line in third.events("leftover.removed")]
    result["third_status"] = third.stop()
    result["left"] = shm()
    return result


ORPHAN = ("import os, sys\nfrom mpcache.shm.segment import Segment, shm_name\n"
          "Segment.create(shm_name(os.getpid(), sys.argv[1], 'mrc'), 4096)\nprint(os.getpid(), flush=True)\n"
          "sys.stdin.read()\n")


def orphans(workdir: str) -> dict[str, list[str]]:
    """A process that made a segment of its own (``mpcache.<pid>.<tag>.mrc``, as a benchmark does) is killed -9:
    ``killed`` names it.  ``kept`` names segments a start must leave: one of a live pid (this driver's), and of the
    dead pid one of another user, one of mode 0644, one whose run has a gauge board, two not of our names."""
    tag = secrets.token_hex(4)
    child = subprocess.Popen([sys.executable, "-c", ORPHAN, tag], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                             preexec_fn=_die_with_the_driver)
    pid = int(child.stdout.readline())  # type: ignore[union-attr]
    child.kill()
    child.wait(10)
    dead = f"mpcache.{pid}."
    # the other instances' first letters are not hex digits: never the killed one's tag
    kept = {f"mpcache.{os.getpid()}.{tag}.mrc": 0o600, f"{dead}u{tag[1:]}.mrc": 0o600, f"{dead}m{tag[1:]}.mrc": 0o644,
            f"{dead}r{tag[1:]}.gauges": 0o600, f"{dead}r{tag[1:]}.events0": 0o600,
            f"{dead}{tag}.x.mrc": 0o600, f"{dead}{tag}.MRC": 0o600}
    for name, mode in kept.items():
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
        os.fchmod(fd, mode)
        os.close(fd)
    os.chown(f"/dev/shm/{dead}u{tag[1:]}.mrc", 65534, 65534)
    return {"killed": [f"{dead}{tag}.mrc"], "kept": sorted(kept)}


def killed_runs_leave_nothing(workdir: str) -> dict:
    """systemd's topology: A, with a --runtime-dir, is killed whole (kill -9 of the supervisor and every child
    at once) and its runtime dir removed (RuntimeDirectory= does that at every stop), marker included; a process
    that made a segment of no run is killed -9 too (:func:`orphans`).  B starts: what does it remove, and which
    of the segments it must leave are still there?  Then B's supervisor alone is killed (its children exit by
    themselves) and C starts: what does it remove, and what is left once C stops (the kept ones removed here)?"""
    a = Run(workdir, "a", "--runtime-dir", os.path.join(workdir, "a-run"))
    result: dict = {"a_serves": pings(a.socket())}
    tree = [a.process.pid, *(line["pid"] for line in a.events("child.started"))]
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    a.process.wait(10)
    wait_for(lambda: all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                         for pid in tree), 10)
    result["a_left"] = shm()
    subprocess.run(["rm", "-rf", os.path.join(workdir, "a-run")], check=True)
    result["orphans"] = orphans(workdir)
    b = Run(workdir, "b")
    result["b_serves"] = pings(b.socket())
    result["b_removed"] = [line.get("segment") for line in b.events("leftover.removed") if "segment" in line]
    result["b_reasons"] = {line["segment"]: line["reason"] for line in b.events("leftover.removed")
                           if "segment" in line}
    result["kept_after_b"] = [name for name in result["orphans"]["kept"] if os.path.exists(f"/dev/shm/{name}")]
    for name in result["kept_after_b"]:
        os.unlink(f"/dev/shm/{name}")
    children = [line["pid"] for line in b.events("child.started")]
    b.process.kill()
    b.process.wait(10)
    result["b_children_exited"] = bool(wait_for(lambda: not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in children), 15))
    result["b_left"] = shm()
    c = Run(workdir, "c")
    result["c_serves"] = pings(c.socket())
    result["c_removed"] = [line.get("segment") for line in c.events("leftover.removed") if "segment" in line]
    result["c_status"] = c.stop()
    result["left"] = shm()
    return result


SMALL_SHM = "24m"  # /dev/shm of the small_shm scenario: less than its 32 MiB L1 pool


def small_shm(workdir: str) -> dict:
    """A /dev/shm of 24 MiB and an L1 pool of 32 MiB.  If the service starts anyway, a client fills L1 (what
    a busy service does): where does the missing memory show?"""
    run = Run(workdir, "small", "--l1-size", "32MiB", "--chunk-bytes", "64KiB", "--runtime-dir",
              os.path.join(workdir, "small-run"))
    status = wait_for(lambda: run.process.poll() is not None or run.events("cache.ready"), 30)
    result: dict = {"exited_at_start": run.process.poll()}
    if result["exited_at_start"] is None and status:
        socket_path = run.events("cache.ready")[0]["sockets"][0]
        try:
            with CacheClient(socket_path, connect_timeout_s=5) as client:
                kv = client.register_buffer(8, 65536)
                for n in range(64):  # 64 x 8 chunks of 64 KiB: 32 MiB, more than fits
                    client.store(kv, request_id=f"fill-{n}", model_name="org/m",
                                 chunk_hashes=[n * 8 + i + 1 for i in range(8)], block_ids=list(range(8)))
                del kv
        except (OSError, ConnectionError, MpcacheError) as exc:
            result["client_error"] = repr(exc)
        wait_for(lambda: run.events("child.exited"), 10)
        result["cache_exits"] = [line["exit_status"] for line in run.events("child.exited")]
        run.stop()
    with open(os.path.join(workdir, "small.err"), encoding="utf-8") as handle:
        result["stderr"] = handle.read().strip().splitlines()
    result["status"] = run.process.returncode
    result["left"] = shm()
    return result


def segment_too_big(workdir: str) -> dict:
    """A /dev/shm of 1 MiB: a child process creates a 4 MiB segment and writes all of it."""
    code = ("import os, sys\nfrom mpcache.shm.segment import Segment\n"
            "from mpcache.errors import SharedMemoryFullError\n"
            "try:\n    segment = Segment.create(f'/mpcache.{os.getpid()}.toobig.s0', 4 * 2**20)\n"
            "except SharedMemoryFullError as exc:\n    print(exc)\n    sys.exit(3)\n"
            "segment.buf[:] = b'\\1' * len(segment.buf)\nprint('written')\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO))
    return {"status": child.returncode, "stdout": child.stdout.strip(), "left": shm()}


SCENARIOS = {"live_instance_in_another_namespace": (live_instance_in_another_namespace, "512m"),
             "pid1_restarted": (pid1_restarted, "512m"),
             "killed_runs_leave_nothing": (killed_runs_leave_nothing, "512m"),
             "small_shm": (small_shm, SMALL_SHM),
             "segment_too_big": (segment_too_big, "1m")}


def main() -> int:
    scenario, workdir = sys.argv[1], sys.argv[2]
    run, size = SCENARIOS[scenario]
    mount_shm(size)
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    os.environ["TMPDIR"] = tmp
    try:
        result = run(workdir)
    finally:
        for started in RUNS:  # a scenario that failed half-way leaves nothing running
            if started.process.poll() is None:
                with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                    os.kill(started.supervisor_pid(), signal.SIGKILL)
                started.process.kill()
                started.process.wait()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
