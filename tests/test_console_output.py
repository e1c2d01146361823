"""Log output for people and machines: on a terminal one readable line per event (children's and the
supervisor's alike), JSON otherwise or with --log-format json; a child's plain-text lines (tracebacks,
library warnings) carry a level and a timestamp either way."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import time

import pytest

from mpcache.logs import console_renderer
from mpcache.supervisor.logforward import LineForwarder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z \[(debug|info|warning|error)\s*\] \S+")


def _run_on_a_terminal(tmp_path, *flags: str) -> list[str]:
    """start-cache with its stderr on a pseudo-terminal; the lines it wrote there, colours removed."""
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, os.path.join(REPO, "bin", "start-cache"), "--duration", "2",
                                "--prometheus-port", "0", "--runtime-dir", str(tmp_path / "run"), *flags],
                               stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert 0 == process.wait(30)
    return [ANSI.sub("", line) for line in b"".join(chunks).decode("utf-8", "replace").splitlines() if line.strip()]


@pytest.mark.slow
def test_a_terminal_gets_one_readable_line_per_event(tmp_path):
    lines = _run_on_a_terminal(tmp_path)
    assert [] == [line for line in lines if not CONSOLE_LINE.match(line)]
    events = {line.split("] ", 1)[1].split()[0] for line in lines}
    assert {"supervisor.started", "cache.start", "telemetry.started", "supervisor.stopped"} <= events


@pytest.mark.slow
def test_log_format_json_keeps_json_on_a_terminal(tmp_path):
    lines = _run_on_a_terminal(tmp_path, "--log-format", "json")
    assert all(isinstance(json.loads(line), dict) for line in lines)


def test_a_childs_plain_text_lines_get_a_level_and_a_timestamp(tmp_path):
    """A traceback's lines are errors up to the exception's line; other plain text is a warning."""
    written = []
    forwarder = LineForwarder("", stderr=sys.stderr)
    forwarder.write = written.append  # what would go to stderr and the file
    stream = io.BytesIO(b"a library printed this\n"
                        b"Traceback (most recent call last):\n"
                        b'  File "x.py", line 1, in <module>\n'
                        b"ZeroDivisionError: division by zero\n"
                        b"after it\n"
                        b'{"event": "cache.start", "level": "info"}\n')
    forwarder.forward("cache", 1, stream)
    lines = [json.loads(line) for line in written]
    assert ["warning", "error", "error", "error", "warning", "info"] == [line["level"] for line in lines]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT", line["timestamp"]) for line in lines[:5])
    assert {("cache", 1)} == {(line["role"], line["index"]) for line in lines[:5]}


def test_the_console_renderer_leaves_other_text_alone():
    render = console_renderer(colors=False)
    line = render(json.dumps({"event": "cache.start", "level": "info", "timestamp": "2026-01-01T00:00:00Z",
                              "pid": 7}))
    assert CONSOLE_LINE.match(line) and "pid=7" in line
    assert "[demo 5.0s] 300 req/s" == render("[demo 5.0s] 300 req/s")
