"""Running ``bin/start-cache`` as a real process tree and reading what it serves (end-to-end test helpers)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_CACHE = os.path.join(REPO, "bin", "start-cache")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except (OSError, ValueError, KeyError) as exc:
            last_error = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last_error!r})")


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


class Service:
    def __init__(self, tmp_path, *flags: str) -> None:
        self.port = free_port()
        self.tally_path = tmp_path / "tally.json"
        self.log_path = tmp_path / "service.log"
        self.runtime_dir = tmp_path / "run"
        self.stderr = open(tmp_path / "stderr.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, START_CACHE, "--prometheus-port", str(self.port), "--runtime-dir", str(self.runtime_dir),
             "--demo-tally", str(self.tally_path), "--log-file", str(self.log_path), *flags],
            stdout=subprocess.DEVNULL, stderr=self.stderr, cwd=REPO,
        )

    def scrape(self) -> Scrape:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
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

    def lines(self, event: str, **fields) -> list[dict]:
        """The log lines of ``event`` whose fields include ``fields``, in order."""
        if not self.log_path.exists():
            return []
        return [line for line in self.log_lines()
                if line.get("event") == event and all(line.get(k) == v for k, v in fields.items())]

    def pids(self, role: str, index: int = 0) -> list[int]:
        """Every pid the supervisor started for this child, in order."""
        return [line["pid"] for line in self.lines("child.started", child_role=role, index=index)]

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


