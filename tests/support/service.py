"""``bin/start-cache`` as a real process tree, what it serves, and the one teardown that leaves nothing behind.

:class:`Service` starts the supervisor with its log, stderr and runtime dir in a directory of the test's and
reads what it serves (/metrics, its JSON log, the demo's tally, shared memory).  :class:`Started` backs the
``start_service`` fixture (tests/conftest.py): at teardown it kills every supervisor and every child it logged
— SIGSTOPped ones too, which would never notice that they were orphaned — and removes whatever shared memory
or runtime dir they left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.ring_reader import RingCounters, read_counters
from mpcache.shm.segment import Segment
from support.ports import free_port
from support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
START_CACHE = str(REPO / "bin" / "start-cache")
SMALL = ("--chunk-bytes", "4KiB", "--l1-size", "8MiB")  # 2048 slots per cache process: cheap to run
CHUNK = 4096
PORT_TAKEN = "is not available"  # start-cache's one line when a port it was given is taken meanwhile
PORT_RETRIES = 3


class Scrape:
    """One parsed /metrics page: samples by name, each a list of (labels, value)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name].append((dict(sample.labels), sample.value))

    def total(self, name: str, **labels: str) -> float:
        return sum(v for have, v in self.samples.get(name, []) if all(have.get(k) == x for k, x in labels.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.samples.get(name, []):
            out[labels.get(label, "")] += value
        return dict(out)


def gone(pid: int) -> bool:
    """The process exited (or is a zombie waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Service:
    """``bin/start-cache --prometheus-port <free> --log-file <dir>/service.log *flags``.

    ``runtime_dir=False`` leaves the runtime dir to the supervisor's default (``<tmp>/mpcache-<uid>/<pid>``);
    ``umask`` starts it under that umask; ``stderr_pipe`` makes its stderr a pipe whose read end is
    ``self.reader``; ``host``/``port`` put /metrics on that address (``--prometheus-host`` when a host is
    given); ``launcher`` wraps the argv (a network namespace's ``ip netns exec``); ``env`` replaces the
    environment.  ``--demo`` gets ``--demo-tally <dir>/tally.json`` unless the flags name one."""

    def __init__(self, directory: Path, *flags: str, runtime_dir: bool = True, umask: int | None = None,
                 stderr_pipe: bool = False, host: str | None = None, port: int | None = None,
                 launcher: Callable[[list[str]], list[str]] | None = None, env: dict[str, str] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.flags: Sequence[str] = flags
        self.host = host or "127.0.0.1"
        self._fixed_port = port
        self.tally_path = directory / "tally.json"
        self.log_path = directory / "service.log"
        self.stderr_path = directory / "stderr.log"
        self._placed_runtime_dir = runtime_dir
        self._umask, self._stderr_pipe, self._launcher, self._env = umask, stderr_pipe, launcher, env
        self.reader: IO[bytes] | None = None
        self._launch()

    def _launch(self) -> None:
        self.port = self._fixed_port if self._fixed_port is not None else free_port(self.host)
        argv = [sys.executable, START_CACHE, "--prometheus-port", str(self.port), "--log-file", str(self.log_path)]
        if self.host != "127.0.0.1":
            argv += ["--prometheus-host", self.host]
        if self._placed_runtime_dir:
            argv += ["--runtime-dir", str(self.directory / "run")]
        if "--demo" in self.flags and "--demo-tally" not in self.flags:
            argv += ["--demo-tally", str(self.tally_path)]
        argv += list(self.flags)
        if self._launcher is not None:
            argv = self._launcher(argv)
        write_end = None
        if self._stderr_pipe:
            read_end, write_end = os.pipe()
            self.reader = os.fdopen(read_end, "rb")
            self.stderr: IO[bytes] = open(os.devnull, "wb")
            stderr: Any = write_end
        else:
            self.stderr = stderr = open(self.stderr_path, "wb")
        options: dict[str, Any] = {} if self._umask is None else {"umask": self._umask}
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO, env=self._env,
                                        **options)
        if write_end is not None:
            os.close(write_end)
        self.runtime_dir = (self.directory / "run") if self._placed_runtime_dir else Path(
            tempfile.gettempdir(), f"mpcache-{os.getuid()}", str(self.process.pid))

    def _port_was_taken(self) -> bool:
        """It exited 2 at start because a port it was given was taken between the choice and its check."""
        if self.process.poll() != 2 or self._stderr_pipe or self._fixed_port is not None:
            return False
        return PORT_TAKEN in self.stderr_tail()

    # -- waiting for it -----------------------------------------------------------------------------

    def ready(self, workers: int = 1, metrics: bool = True) -> Scrape | None:
        """Wait until every cache socket exists (and /metrics serves, unless ``metrics`` is False); the first
        scrape.  Started again on new ports (up to 3 times) where start-cache reports a port taken."""
        for attempt in range(PORT_RETRIES + 1):
            wait_for(lambda: self.process.poll() is not None
                     or all(Path(self.socket(w)).exists() for w in range(workers)), 60, "the cache sockets")
            if not self._port_was_taken() or attempt == PORT_RETRIES:
                break
            self.stderr.close()
            self._launch()
        assert self.process.poll() is None, f"start-cache exited {self.process.returncode}: {self.stderr_tail()}"
        return wait_for(self.scrape, 60, "/metrics") if metrics else None

    # -- what it serves and logs --------------------------------------------------------------------

    def scrape(self) -> Scrape:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics", timeout=5) as response:
            return Scrape(response.read().decode())

    def tally(self) -> dict:
        return json.loads(self.tally_path.read_text())

    def log_lines(self) -> list[dict]:
        lines = []
        for raw in self.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                pass
        return lines

    def lines(self, event: str, **fields: Any) -> list[dict]:
        """The log lines of ``event`` whose fields include ``fields``, in order."""
        if not self.log_path.exists():
            return []
        return [line for line in self.log_lines()
                if line.get("event") == event and all(line.get(k) == v for k, v in fields.items())]

    def pids(self, role: str, index: int | None = 0) -> list[int]:
        """Every pid the supervisor started for this child (any index where ``index`` is None), in order."""
        fields: dict[str, Any] = {"child_role": role} if index is None else {"child_role": role, "index": index}
        return [line["pid"] for line in self.lines("child.started", **fields)]

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:] if self.stderr_path.exists() else ""

    def socket(self, worker: int) -> str:
        return str(self.runtime_dir / f"cache{worker}.sock")

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

    # -- stopping it --------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        finally:
            self.stderr.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stderr.close()

    def _children(self) -> set[int]:
        """Every child it logged, and any still in the process table (one started but not logged yet)."""
        logged = {line["pid"] for line in self.lines("child.started")} if self.log_path.exists() else set()
        try:
            listed = {child.pid for child in psutil.Process(self.process.pid).children()}
        except psutil.NoSuchProcess:
            listed = set()
        return logged | listed

    def teardown(self) -> None:
        """Kill the supervisor and every child it started (SIGSTOPped ones too) — a pid only while it is still
        an mpcache process, never one the kernel reused — and remove its shared memory and runtime dir."""
        children = self._children()
        self.kill()
        for pid in children:
            try:
                process = psutil.Process(pid)
                if process.status() != psutil.STATUS_ZOMBIE and "mpcache" in " ".join(process.cmdline()):
                    process.kill()
            except psutil.Error:
                pass
        for name in self.shm_entries():
            Segment.unlink("/" + name)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self.reader is not None and not self.reader.closed:
            self.reader.close()


class Started:
    """``start(*flags, kind=Service, **options)`` → a service in ``<directory>/service<n>``; :meth:`teardown`
    tears every one of them down."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.services: list[Service] = []

    def __call__(self, *flags: str, kind: type[Service] = Service, **options: Any) -> Any:
        service = kind(self.directory / f"service{len(self.services)}", *flags, **options)
        self.services.append(service)
        return service

    def teardown(self) -> None:
        for service in self.services:
            service.teardown()
