"""A cache or telemetry process started by a stand-in supervisor: a launcher that made the shared memory and the
configuration (naming itself as the supervisor) and started the child, so that a test can take the supervisor away
while the child serves, or before the child has got as far as asking who its parent is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from mpcache.config import Config
from mpcache.supervisor.provision import unlink_segments
from support.service import gone

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

LAUNCHER = """
import json, os, subprocess, sys, time
sys.path[:0] = sys.argv[1:3]
from support.cache_harness import make_config
from mpcache.supervisor.provision import create_segments, unlink_segments
runtime_dir, module, leave, overrides = sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6])
config = make_config(runtime_dir, **overrides)  # supervisor_pid: this launcher's
create_segments(config)
path = os.path.join(runtime_dir, "config.json")
with open(path, "w", encoding="utf-8") as handle:
    handle.write(config.to_json())
extra = ["--worker", "0"] if module == "mpcache.cache" else []
argv = [sys.executable, "-m", module, "--config", path, *extra, "--supervisor-pid", str(os.getpid())]
stderr_path = os.path.join(runtime_dir, "child.stderr")
if leave in ("swept", "segments_swept"):
    # the child runs only once this launcher is gone and its segments with it (and its config, for "swept"), as
    # a later run's start removes a dead run's: what it reads is missing, and it is another parent's already
    launcher = os.getpid()
    child = os.fork()
    if child == 0:
        deadline = time.monotonic() + 30
        while os.getppid() == launcher and time.monotonic() < deadline:
            time.sleep(0.01)
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.execv(sys.executable, argv)
    print(child, flush=True)
    print(json.dumps(json.loads(config.to_json())), flush=True)
    unlink_segments(config)
    if leave == "swept":
        os.unlink(path)
    os._exit(0)
with open(stderr_path, "wb") as stderr:
    child = subprocess.Popen(argv, stderr=stderr).pid
print(child, flush=True)
print(json.dumps(json.loads(config.to_json())), flush=True)
if leave == "at_once":
    os._exit(0)  # while the child still imports: it is left to another parent before it can ask for its own
time.sleep(300)
"""


class StandInSupervisor:
    """The launcher (``supervisor_pid`` in the child's config) and its child running ``module``; ``leave``:
    ``at_once`` (the launcher exits as soon as the child is started), ``segments_swept`` (it unlinks its segments
    and exits, and only then does the child run), ``swept`` (its config file too) or ``when_killed``."""

    def __init__(self, module: str, runtime_dir: str, leave: str, **overrides) -> None:
        self.runtime_dir = runtime_dir
        self.launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, REPO, TESTS, runtime_dir, module, leave,
                                          json.dumps(overrides)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.child_pid = int(self.launcher.stdout.readline())  # type: ignore[union-attr]
        # as the launcher printed it: in "swept" mode its file may be gone already
        self.config = Config.from_json(self.launcher.stdout.readline())  # type: ignore[union-attr]

    def kill(self) -> None:
        self.launcher.kill()
        self.launcher.wait()

    def child_gone(self) -> bool:
        return gone(self.child_pid)

    def child_stderr(self) -> str:
        """What the child wrote to its stderr (its log lines and anything else)."""
        with open(os.path.join(self.runtime_dir, "child.stderr"), encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def child_events(self, event: str) -> list[dict]:
        lines = [json.loads(line) for line in self.child_stderr().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == event]

    def close(self) -> None:
        """Kill whatever still runs and remove the shared memory the launcher made."""
        self.kill()
        self.launcher.stdout.close()  # type: ignore[union-attr]
        if not self.child_gone():
            os.kill(self.child_pid, signal.SIGKILL)
        unlink_segments(self.config)
