"""The supervisor's log forwarding: children's lines and its own, to stderr, stdout and the log file.

Logging must never block the data path.  A reader of the supervisor's stderr that is slow or gone
(``start-cache ... 2>&1 | sleep 400``, a closed terminal, a stuck journald) must stop neither the
cache processes, which write their log lines into pipes the supervisor reads, nor the supervisor's
own loop, which restarts children and cleans up at SIGTERM.  So:

* one thread per child pipe only *reads* lines (at most :data:`MAX_LINE_BYTES` each) and hands them
  to the sinks; it never writes anything itself, so a child's pipe is always drained;
* each destination (stderr, stdout, the ``--log-file``) is a :class:`Sink`: a bounded queue
  (:data:`MAX_QUEUED_BYTES`, :data:`MAX_FILE_QUEUED_BYTES`) written by its own thread.  Handing a
  line over never blocks: a full queue drops the line and counts it.  When the queue drains again,
  the sink writes one ``log.lines_dropped`` line saying how many lines it lost; the log file records
  that too, and also when the dropping began (``log.sink_stalled``);
* a sink whose reader went away (EPIPE) or whose writes fail stops writing and counts every further
  line as dropped, and nothing raises into the caller; :meth:`LineForwarder.close` waits for the
  queues at most ``timeout_s``.

The log file keeps a single writer (the file sink's thread), so it rotates safely.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from mpcache.supervisor.logfile import LogFile

MAX_QUEUED_BYTES = 2**20  # per sink (stderr, stdout)
MAX_FILE_QUEUED_BYTES = 8 * 2**20  # the log file: the record, worth more room
MAX_LINE_BYTES = 64 * 2**10  # a longer line arrives in pieces
CLOSE_TIMEOUT_S = 2.0


class Sink:
    """One destination, written by its own daemon thread from a bounded queue; :meth:`put` never blocks."""

    def __init__(self, name: str, write: Callable[[str], None], *, max_bytes: int = MAX_QUEUED_BYTES,
                 on_drops: Callable[[str], None] | None = None, context: dict[str, Any] | None = None) -> None:
        self.name = name
        self.context = context if context is not None else {}  # fields of this sink's own notes
        self._write = write
        self._max_bytes = max_bytes
        self._on_drops = on_drops  # also told about drops (the file sink, so the log file has the record)
        self._queue: collections.deque[str] = collections.deque()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self.dropped = 0  # lines dropped since the last report
        self.dropped_total = 0
        self.dead: str | None = None  # why this sink stopped writing for good
        threading.Thread(target=self._run, name=f"log-sink-{name}", daemon=True).start()

    def put(self, line: str) -> None:
        """Queue one line (without its newline); drop and count it if the queue is full or the sink dead."""
        with self._lock:
            if self.dead is not None or self._queued_bytes + len(line) > self._max_bytes:
                self.dropped += 1
                self.dropped_total += 1
                stalled = self.dropped == 1 and self.dead is None  # the first drop of an episode
            else:
                self._queue.append(line)
                self._queued_bytes += len(line)
                self._idle.clear()
                stalled = None
        if stalled is None:
            self._wake.set()
        elif stalled and self._on_drops is not None:
            message = f"{self.name} does not keep up: lines are dropped (and counted) until it does"
            self._on_drops(_note("log.sink_stalled", self.context, sink=self.name, message=message))

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued is written (or the sink died); False at the deadline."""
        return self._idle.wait(timeout_s)

    def _take(self) -> str | None:
        with self._lock:
            if not self._queue:
                self._idle.set()
                return None
            line = self._queue.popleft()
            self._queued_bytes -= len(line)
            return line

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while (line := self._take()) is not None:
                if self.dead is None:
                    self._emit(line)
                if self.dead is None and self._queue_empty() and self.dropped:
                    self._report_drops()

    def _queue_empty(self) -> bool:
        with self._lock:
            return not self._queue

    def _emit(self, line: str) -> None:
        try:
            self._write(line)
        except Exception as exc:  # noqa: BLE001 - EPIPE, EIO, ENOSPC, a closed file: this sink stops, nothing else
            with self._lock:
                self.dead = f"{type(exc).__name__}: {exc}"
                self.dropped += 1 + len(self._queue)
                self.dropped_total += 1 + len(self._queue)
            if self._on_drops is not None:
                self._on_drops(_note("log.sink_failed", self.context, sink=self.name, error=self.dead,
                                     message=f"no more log lines go to {self.name}"))

    def _report_drops(self) -> None:
        with self._lock:
            count, self.dropped = self.dropped, 0
        note = _note("log.lines_dropped", self.context, sink=self.name, dropped=count,
                     message=f"{count} log lines were dropped: {self.name} could not keep up")
        self._emit(note)
        if self._on_drops is not None:
            self._on_drops(note)


def _note(event: str, context: dict[str, Any], **fields: Any) -> str:
    """A log line of the supervisor's own, in the JSON form every process writes."""
    return json.dumps({**fields, "event": event, "role": "supervisor", **context, "level": "warning",
                       "timestamp": _now()})


def _fd_writer(fd: int) -> Callable[[str], None]:
    def write(line: str) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        while data:
            written = os.write(fd, data)  # blocks this sink's thread only
            data = data[written:]
    return write


def _rendered(write: Callable[[str], None], render: Callable[[str], str]) -> Callable[[str], None]:
    def write_rendered(line: str) -> None:
        write(render(line))
    return write_rendered


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class LineForwarder:
    """Copies children's output lines and the supervisor's own lines to stderr, stdout and the log file,
    without ever blocking the caller (see the module docstring)."""

    def __init__(self, log_file: str, max_bytes: int = 50 * 2**20, backup_count: int = 5, *,
                 stderr: IO[str] | None = None, stdout: IO[str] | None = None,
                 max_queued_bytes: int = MAX_QUEUED_BYTES,
                 max_file_queued_bytes: int = MAX_FILE_QUEUED_BYTES,
                 render: Callable[[str], str] | None = None) -> None:
        """``render``: how stderr shows a JSON line (a terminal's console format); the file keeps JSON."""
        self.context: dict[str, Any] = {}  # fields of the forwarder's own notes (instance_id, once known)
        self.file: Sink | None = None
        if log_file:  # opened here: a file that is not ours raises ConfigError, one that cannot be opened OSError
            # its own failures (a refused rotation, a full disk) are said on stderr, the other's on the file
            self.file = Sink("log-file", LogFile(log_file, max_bytes, backup_count).write,
                             max_bytes=max_file_queued_bytes, on_drops=lambda note: self.stderr.put(note),
                             context=self.context)
        on_drops = self.file.put if self.file is not None else None
        write_stderr = _fd_writer((stderr or sys.stderr).fileno())
        if render is not None:  # rendered on the sink's own thread: the caller never waits for it
            write_stderr = _rendered(write_stderr, render)
        self.stderr = Sink("stderr", write_stderr, max_bytes=max_queued_bytes, on_drops=on_drops,
                           context=self.context)
        self.stdout = Sink("stdout", _fd_writer((stdout or sys.stdout).fileno()), max_bytes=max_queued_bytes,
                           on_drops=on_drops, context=self.context)

    def write(self, line: str) -> None:
        """One log line (JSON, no newline) to stderr and the log file; never blocks, never raises."""
        self.stderr.put(line)
        if self.file is not None:
            self.file.put(line)

    def forward(self, role: str, index: int, stream: IO[bytes], *, log_lines: bool = True) -> None:
        """Read ``stream`` (a child's stderr, or with ``log_lines=False`` its stdout) until EOF.

        stderr lines that are not JSON are wrapped in a ``child.output`` line with a level (error inside a
        traceback, else warning: a child writes plain text only when something went wrong) and a
        timestamp; stdout lines (the demo's progress) go to our stdout as they are."""
        in_traceback = False
        try:
            for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if not log_lines:
                    self.stdout.put(line)
                    continue
                if not line.startswith("{"):
                    if line.startswith("Traceback (most recent call last)"):
                        in_traceback = True
                    level = "error" if in_traceback else "warning"
                    if in_traceback and line and not line[0].isspace() and not line.startswith("Traceback"):
                        in_traceback = False  # the exception's own line ends the traceback
                    line = json.dumps({"event": "child.output", "role": role, "index": index, "line": line,
                                       "level": level, "timestamp": _now()})
                self.write(line)
        except (OSError, ValueError):  # the pipe was closed under us
            pass
        finally:
            stream.close()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait up to ``timeout_s`` in all for the queues to be written; False if some could not be."""
        deadline = time.monotonic() + timeout_s
        done = True
        for sink in (self.stderr, self.stdout, self.file):
            if sink is not None:
                done = sink.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    @property
    def dropped_total(self) -> dict[str, int]:
        return {sink.name: sink.dropped_total for sink in (self.stderr, self.stdout, self.file) if sink is not None}


class ForwardingHandler(logging.Handler):
    """The supervisor's own logging: every record goes through :meth:`LineForwarder.write`."""

    def __init__(self, forwarder: LineForwarder) -> None:
        super().__init__()
        self._forwarder = forwarder

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._forwarder.write(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise into the supervisor's loop or its stop
            pass
