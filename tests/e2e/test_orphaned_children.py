"""A cache or telemetry process whose supervisor dies without stopping it exits instead of running forever, whether
the supervisor died once it served or while it was still starting (before it could ask who its parent is)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from support.stand_in_supervisor import StandInSupervisor
from support.waiting import wait_for

CHILDREN = {"mpcache.cache": ("cache.orphaned", "parent_pid"),
            "mpcache.telemetry": ("telemetry.orphaned", "supervisor_pid")}


@pytest.fixture
def runtime_dir():
    """A directory short enough for the cache process's socket path (sun_path is 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="mpc")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("module", sorted(CHILDREN))
@pytest.mark.parametrize("leave", ["when_killed", "at_once"])
def test_a_child_whose_supervisor_is_gone_logs_it_and_exits(runtime_dir, module: str, leave: str) -> None:
    """``when_killed``: the supervisor is SIGKILLed once the child is up (its heartbeat in the gauge board);
    ``at_once``: it exits while the child still imports, which leaves the child to another parent before it looks.
    Either way the child logs that it was orphaned, naming the supervisor's pid, and exits within its heartbeat
    interval; a cache process removes its socket."""
    event, field = CHILDREN[module]
    stand_in = StandInSupervisor(module, runtime_dir, leave, disable_metrics=True)
    try:
        if leave == "when_killed":
            up = (lambda: os.path.exists(stand_in.config.socket_path(0))) if module == "mpcache.cache" else (
                lambda: stand_in.child_events("telemetry.started"))
            wait_for(lambda: up() or stand_in.child_gone(), timeout_s=30, what=f"{module} to start", tolerate=())
            assert not stand_in.child_gone()
            stand_in.kill()
        wait_for(stand_in.child_gone, timeout_s=30, what=f"the orphaned {module} to exit", tolerate=())
        assert [stand_in.launcher.pid] == [line[field] for line in stand_in.child_events(event)], (
            stand_in.child_stderr()[-3000:])
        assert not os.path.exists(stand_in.config.socket_path(0))
    finally:
        stand_in.close()
