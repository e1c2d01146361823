"""A cache or telemetry process whose supervisor dies without stopping it exits instead of running forever, whether
the supervisor died once it served or while it was still starting (before it could ask who its parent is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest
from support.cache_harness import make_config
from support.stand_in_supervisor import REPO, StandInSupervisor
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
@pytest.mark.parametrize("leave", ["when_killed", "at_once", "segments_swept", "swept"])
def test_a_child_whose_supervisor_is_gone_logs_it_and_exits(runtime_dir, module: str, leave: str) -> None:
    """``when_killed``: the supervisor is SIGKILLed once the child is up (its heartbeat in the gauge board);
    ``at_once``: it exits while the child still imports, which leaves the child to another parent before it looks;
    ``segments_swept``: its segments are gone too before the child runs (a sweep of dead runs' segments), so the
    child cannot attach them; ``swept``: its config file as well (the next run's start removes a dead run's
    files): either is still told as orphaned (naming the start error), not as a failed start.
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


@pytest.mark.parametrize("module", sorted(CHILDREN))
def test_a_child_whose_segments_are_missing_while_its_supervisor_lives_says_so_once(runtime_dir, module: str) -> None:
    """With its supervisor (here: this test process) alive, missing shared memory is a failed start: one error
    line naming the segment, exit status 2, and no traceback."""
    config = make_config(runtime_dir)  # names this process as the supervisor; no segment is created
    path = os.path.join(runtime_dir, "config.json")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(config.to_json())
    extra = ["--worker", "0"] if module == "mpcache.cache" else []
    done = subprocess.run([sys.executable, "-m", module, "--config", path, *extra], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    role = module.split(".")[1]
    assert (done.returncode, [line["event"] for line in lines if line["level"] in ("error", "warning")]) == (
        2, [f"{role}.start_failed"]), done.stderr
    assert config.ring_name(0) in lines[-1]["error"] and "Traceback" not in done.stderr


def test_the_supervisor_names_itself_on_its_cache_and_telemetry_processes_command_lines(start_service) -> None:
    """So that a child which cannot read its configuration (the next run's start removed it with the dead run's
    files) can still tell that its supervisor is gone."""
    service = start_service("--workers", "1")
    service.ready()
    supervisor = str(service.config().supervisor_pid)
    for role in ("cache", "telemetry"):
        argv = psutil.Process(service.pids(role)[-1]).cmdline()
        assert supervisor == argv[argv.index("--supervisor-pid") + 1] == str(service.process.pid), argv
