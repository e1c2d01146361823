"""A ``bin/start-cache`` process tree whose children a test may stop, kill or freeze (end-to-end helpers).

:class:`ControlledService` is :class:`mpcache_service.Service` plus what tests that signal children
need: the log lines of one event, the pids the supervisor started per child, the cache sockets and the
instance's configuration.  :func:`started_services` backs conftest's ``controlled_services`` fixture: at
teardown it kills the supervisor and every child it logged — SIGSTOPped ones too, which would never
notice that they were orphaned — and removes whatever shared memory or runtime dir they left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
from mpcache_service import REPO, START_CACHE, Scrape, Service, free_port, wait_for

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.ring_reader import RingCounters, read_counters
from mpcache.shm.segment import Segment

SMALL = ("--chunk-bytes", "4KiB", "--l1-size", "8MiB")  # 2048 slots per cache process: cheap to run
CHUNK = 4096


class ControlledService(Service):
    def __init__(self, directory: Path, *flags: str) -> None:
        """Start ``bin/start-cache *flags`` with its log, stderr and runtime dir under ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tally_path = directory / "tally.json"
        self.log_path = directory / "service.log"
        self.runtime_dir = directory / "run"
        self.stderr = open(directory / "stderr.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, START_CACHE, "--prometheus-port", str(self.port), "--runtime-dir", str(self.runtime_dir),
             "--log-file", str(self.log_path), *flags],
            stdout=subprocess.DEVNULL, stderr=self.stderr, cwd=REPO,
        )

    def socket(self, worker: int) -> str:
        return str(self.runtime_dir / f"cache{worker}.sock")

    def ready(self, workers: int, metrics: bool = True) -> Scrape | None:
        """Wait until every cache socket exists (and /metrics serves, unless ``metrics`` is False)."""
        wait_for(lambda: all(Path(self.socket(w)).exists() for w in range(workers)), 60, "the cache sockets")
        return wait_for(self.scrape, 60, "/metrics") if metrics else None

    def config(self) -> Config:
        return Config.load(str(self.runtime_dir / "config.json"))

    def ring_counters(self, worker: int) -> RingCounters:
        """The ring's own bookkeeping words, read from shared memory."""
        segment = Segment.attach(self.config().ring_name(worker), layout.HEADER_SIZE)
        try:
            return read_counters(segment)
        finally:
            segment.close()

    def shm_entries(self) -> list[str]:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"mpcache.{self.process.pid}."))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def started_services(tmp_path: Path) -> Iterator[Callable[..., ControlledService]]:
    """Yields ``start(*flags)`` → a :class:`ControlledService`; then kills everything they started."""
    started: list[ControlledService] = []

    def start(*flags: str) -> ControlledService:
        service = ControlledService(tmp_path / f"service{len(started)}", *flags)
        started.append(service)
        return service

    yield start
    for service in started:
        children = [line["pid"] for line in service.lines("child.started")]
        service.kill()
        for pid in children:
            if not gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in service.shm_entries():
            Segment.unlink("/" + name)
        shutil.rmtree(service.runtime_dir, ignore_errors=True)
