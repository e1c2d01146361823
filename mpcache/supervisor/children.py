"""The supervisor's children: the program each role runs, starting one with both pipes forwarded, and
stopping a group of them within a grace period.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mpcache.supervisor.liveness import Heartbeat
from mpcache.supervisor.logforward import LineForwarder
from mpcache.supervisor.restart import ExitHistory

STOP_GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL


class Role(str, enum.Enum):
    """What a child is: its restart policy, its liveness checks and its place in the stop order follow."""

    TELEMETRY = "telemetry"
    CACHE = "cache"
    DEMO = "demo"


STOP_ORDER = (Role.DEMO, Role.CACHE, Role.TELEMETRY)  # telemetry last: it drains what the others published


@dataclass(frozen=True)
class Programs:
    """The module each role runs as ``python -m MODULE --config PATH``: the product's by default.  A
    benchmark passes its own cache process, and ``telemetry=None`` when nothing is to read the rings."""

    cache: str = "mpcache.cache"
    telemetry: str | None = "mpcache.telemetry"
    demo: str = "mpcache.demo"


def child_argv(module: str, config_path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", module, "--config", config_path, *extra]


@dataclass
class Child:
    role: Role
    index: int
    argv: list[str]
    process: subprocess.Popen | None = None
    exits: ExitHistory = field(default_factory=ExitHistory)  # what the restart policy remembers
    restart_at: float = 0.0
    started_at: float = 0.0
    # starting, serving, restarting, unresponsive (cache); starting, running, restarting, unresponsive
    # (telemetry); running, finished, failed (demo); given_up (cache)
    state: str = "starting"
    heartbeat: Heartbeat = field(default_factory=Heartbeat)  # cache processes and telemetry: liveness
    spawns: int = 0  # times started: every one after the first is a restart

    @property
    def label(self) -> str:
        return self.role.value if self.role is not Role.CACHE else f"cache[{self.index}]"

    @property
    def done(self) -> bool:
        """Never (re)started again: the demo ended, or a cache process was given up."""
        return self.state in ("finished", "failed", "given_up")


def child_env() -> dict[str, str]:
    """Children import mpcache from wherever we did, installed or not."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)  # the supervisor alone speaks for the service (NotifyAccess=main)
    return env


def spawn(child: Child, forwarder: LineForwarder) -> subprocess.Popen:
    """Start ``child``'s program in its own session (a terminal's SIGINT/SIGHUP reach the supervisor alone,
    which stops the children in order instead of all at once), both pipes always drained by ``forwarder``
    (which never blocks), so that a child never waits on its logging."""
    process = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True)
    for stream, log_lines in ((process.stderr, True), (process.stdout, False)):
        threading.Thread(target=forwarder.forward, args=(child.role.value, child.index, stream),
                         kwargs={"log_lines": log_lines}, daemon=True).start()
    return process


def stop_group(group: list[Child], log: Any, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every running child of ``group``, then wait for them all; one still running after ``grace_s``
    is killed."""
    running = [c for c in group if c.process is not None and c.process.poll() is None]
    for child in running:
        assert child.process is not None
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in running:
        assert child.process is not None
        try:
            status = child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("child.killed", child_role=child.role.value, index=child.index, pid=child.process.pid,
                        waited_s=grace_s)
            child.process.kill()
            status = child.process.wait()
        log.info("child.exited", child_role=child.role.value, index=child.index, pid=child.process.pid,
                 exit_status=status)
