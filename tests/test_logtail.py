"""``bin/mpcache-logs``: filtering, output formats, following across rotation/truncation, clean exits.

Everything runs the real launcher in a subprocess.  Output of a following
tail is awaited with select() and a deadline, never with sleeps.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpcache.tools.logtail import parse_since

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = str(ROOT / "bin" / "mpcache-logs")
DEADLINE_S = 10.0


def _line(event: str, level: str = "debug", timestamp: str = "2026-11-29T18:00:00.123456Z", **extra) -> str:
    record = {"event": event, "level": level, "timestamp": timestamp, "role": "telemetry", "instance_id": "i-1",
              **extra}
    return json.dumps(record)


EVICTED = _line("l1.keys.evicted", worker=0, event_timestamp_ns=1,
                salt_counts=[["tenant-a", "llama", 12], ["tenant-b", "llama", 3], ["tenant-a", "qwen", 1]])
STORE_END = _line("mp.store.end", worker=1, session_id="req-7",
                  fields={"device": "cpu", "model_name": "llama", "stored_count": 4})
LOOKUP_END = _line("mp.lookup_prefetch.end", worker=1, session_id="req-8",
                   fields={"cache_salt": "tenant-c", "hit_tokens": 256})
PREFETCH = _line("l2.prefetch.lookup.completed", worker=0, fields={"request_id": 99, "prefix_hit_count": 2})
TIMEOUT = _line("timeout.raised", level="warning", worker=0, session_id="req-9", exception_type="MpcacheTimeoutError",
                message="retrieve: deadline passed", stack="Traceback:\n  File \"server.py\", line 1\n")
STARTED = _line("supervisor.started", level="info", role="supervisor", workers=2, runtime_dir="/tmp/x y")
ERROR = _line("demo.failed", level="error", role="demo", exit_status=1)
L10 = _line("l10.other")  # shares a string prefix with l1 but not a dotted one

ALL = [EVICTED, STORE_END, LOOKUP_END, PREFETCH, TIMEOUT, STARTED, ERROR, L10]


def run_tail(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LAUNCHER, *args], input=stdin, capture_output=True, text=True,
                          timeout=DEADLINE_S)


@pytest.fixture
def log_file(tmp_path) -> Path:
    path = tmp_path / "mpcache.jsonl"
    path.write_text("not json at all\n" + "\n".join(ALL[:4]) + "\n[1, 2]\n{broken\n" + "\n".join(ALL[4:]) + "\n")
    return path


def test_readable_lines_and_non_json_skipped(log_file):
    """Each JSON line prints as TIMESTAMP LEVEL SOURCE EVENT salt=count... key=value... (workers as
    cache[N], a stack indented below); lines that are not JSON objects are skipped; exit 0."""
    result = run_tail(str(log_file))
    expected = "\n".join([
        "2026-11-29T18:00:00Z DEBUG cache[0] l1.keys.evicted tenant-a=13 tenant-b=3",
        "2026-11-29T18:00:00Z DEBUG cache[1] mp.store.end device=cpu model_name=llama stored_count=4 session_id=req-7",
        "2026-11-29T18:00:00Z DEBUG cache[1] mp.lookup_prefetch.end cache_salt=tenant-c hit_tokens=256 "
        "session_id=req-8",
        "2026-11-29T18:00:00Z DEBUG cache[0] l2.prefetch.lookup.completed request_id=99 prefix_hit_count=2",
        '2026-11-29T18:00:00Z WARNING cache[0] timeout.raised session_id=req-9 exception_type=MpcacheTimeoutError '
        'message="retrieve: deadline passed"',
        "    Traceback:",
        '      File "server.py", line 1',
        '2026-11-29T18:00:00Z INFO  supervisor supervisor.started workers=2 runtime_dir="/tmp/x y"',
        "2026-11-29T18:00:00Z ERROR demo demo.failed exit_status=1",
        "2026-11-29T18:00:00Z DEBUG telemetry l10.other",
    ]) + "\n"
    assert (0, expected, "") == (result.returncode, result.stdout, result.stderr)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--event", "l1.keys.evicted"], [EVICTED]),
    (["--event", "l1."], [EVICTED]),
    (["--event", "l1"], [EVICTED]),
    (["--event", "mp.", "--event", "timeout.raised"], [STORE_END, LOOKUP_END, TIMEOUT]),
    (["--level", "warning"], [TIMEOUT, ERROR]),
    (["--level", "ERROR"], [ERROR]),
    (["--salt", "tenant-b"], [EVICTED]),
    (["--salt", "tenant-c"], [LOOKUP_END]),
    (["--request", "req-7"], [STORE_END]),
    (["--request", "99", "--request", "req-9"], [PREFETCH, TIMEOUT]),
    (["--event", "mp.", "--request", "req-8"], [LOOKUP_END]),
    (["-n", "2"], [ERROR, L10]),
])
def test_filters_with_json_output(log_file, flags, expected):
    """--event (exact or dotted prefix, repeatable), --level (that level and above), --salt (salt counts
    or a cache_salt field), --request (session id or request_id field) and -n combine; --json prints
    the matching lines verbatim."""
    result = run_tail(str(log_file), "--json", *flags)
    assert (0, "\n".join(expected) + "\n") == (result.returncode, result.stdout)


def test_since_relative_and_iso(tmp_path):
    """--since 5m keeps lines of the last five minutes; --since with an ISO timestamp keeps lines at or
    after it; lines without a timestamp never pass --since."""
    now = dt.datetime.now(dt.timezone.utc)
    old = _line("old", timestamp=(now - dt.timedelta(hours=1)).isoformat().replace("+00:00", "Z"))
    recent = _line("recent", timestamp=(now - dt.timedelta(seconds=10)).isoformat().replace("+00:00", "Z"))
    untimed = json.dumps({"event": "child.output", "role": "cache", "line": "hello"})
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([old, recent, untimed]) + "\n")
    iso = (now - dt.timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M:%S")
    results = [run_tail(str(path), "--json", "--since", since) for since in ("5m", "300s", iso, iso + "Z", "2h")]
    assert [recent, recent, recent, recent, old + "\n" + recent] == [r.stdout.rstrip("\n") for r in results]


def test_parse_since_units():
    """30s/5m/2h/1d count back from now; a naive ISO timestamp is UTC."""
    now = dt.datetime(2026, 11, 29, 18, 0, tzinfo=dt.timezone.utc)
    assert [dt.datetime(2026, 11, 29, 17, 59, 30, tzinfo=dt.timezone.utc),
            dt.datetime(2026, 11, 29, 17, 55, tzinfo=dt.timezone.utc),
            dt.datetime(2026, 11, 29, 16, 0, tzinfo=dt.timezone.utc),
            dt.datetime(2026, 11, 28, 18, 0, tzinfo=dt.timezone.utc),
            dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)] == [
        parse_since(text, now) for text in ("30s", "5m", "2h", "1d", "2026-11-29T12:00:00")]


def test_standard_input(log_file):
    """'-' reads standard input."""
    result = run_tail("-", "--json", "--level", "error", stdin=log_file.read_text())
    assert (0, ERROR + "\n") == (result.returncode, result.stdout)


@pytest.mark.parametrize("flags", [
    ["--level", "loud"], ["--since", "yesterday"], ["--bogus"], ["-n", "-3"], [],
])
def test_bad_flags_are_one_line_and_exit_2(log_file, flags):
    """A bad flag or a missing path: one line on stderr, naming the program, exit status 2, no output."""
    result = run_tail(*([str(log_file)] if flags else []), *flags)
    assert (2, "", 1, True) == (result.returncode, result.stdout, result.stderr.count("\n"),
                                result.stderr.startswith("mpcache-logs: error: "))


def test_missing_file_without_follow_is_one_line_exit_2(tmp_path):
    """Reading a file that does not exist (without --follow) is one error line and status 2."""
    result = run_tail(str(tmp_path / "nope.jsonl"))
    assert (2, f"mpcache-logs: error: no such file: {tmp_path / 'nope.jsonl'}\n") == (result.returncode, result.stderr)


# Runs the launcher as a terminal would: with Ctrl-C's default meaning.  A test runner started in the
# background (`pytest &`) has SIGINT ignored, and an ignored SIGINT is inherited by its children, in
# which Python then installs no KeyboardInterrupt handler.
WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


class Tail:
    """A running ``mpcache-logs``, its stdout read with select() against a deadline."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, LAUNCHER, *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        self._buffers = {"stdout": b"", "stderr": b""}

    def read_lines(self, count: int, deadline_s: float = DEADLINE_S, stream: str = "stdout") -> list[str]:
        """The next ``count`` lines of ``stream``; fails if they do not arrive before the deadline."""
        deadline = time.monotonic() + deadline_s
        fd = getattr(self.process, stream).fileno()
        while self._buffers[stream].count(b"\n") < count:
            left = deadline - time.monotonic()
            assert left > 0, f"waited {deadline_s} s for {count} lines, have {self._buffers[stream]!r}"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                assert chunk, f"tail exited early: {self._buffers}"
                self._buffers[stream] += chunk
        lines = self._buffers[stream].split(b"\n")
        self._buffers[stream] = b"\n".join(lines[count:])
        return [line.decode() for line in lines[:count]]

    def interrupt(self) -> tuple[int, str]:
        """SIGINT (Ctrl-C); returns (exit status, stderr)."""
        self.process.send_signal(signal.SIGINT)
        _, stderr = self.process.communicate(timeout=DEADLINE_S)
        return self.process.returncode, stderr.decode()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture
def tails():
    started: list[Tail] = []

    def start(*args: str) -> Tail:
        tail = Tail(*args)
        started.append(tail)
        return tail

    yield start
    for tail in started:
        tail.kill()


def _append(path: Path, *lines: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))


def test_follow_survives_append_rotation_and_truncation(tmp_path, tails):
    """-f prints appended lines; after the file is renamed away and recreated it prints what was written
    to the old file before the rename and then the new file from its start; after truncation it starts
    again from the top; filters still apply; SIGINT ends it with status 0 and nothing on stderr."""
    path = tmp_path / "mpcache.jsonl"
    lines = [_line(f"l1.step{i}", worker=0) for i in range(8)]
    path.write_text(lines[0] + "\n")
    tail = tails(str(path), "-f", "--json", "--event", "l1.")
    assert [lines[0]] == tail.read_lines(1)
    _append(path, lines[1], "garbage", _line("mp.request.start"), lines[2])
    assert [lines[1], lines[2]] == tail.read_lines(2)
    # Rotation, as RotatingFileHandler does it: last lines to the old file, rename, new file.
    _append(path, lines[3])
    os.rename(path, tmp_path / "mpcache.jsonl.1")
    path.write_text(lines[4] + "\n")
    assert [lines[3], lines[4]] == tail.read_lines(2)
    _append(path, lines[5])
    assert [lines[5]] == tail.read_lines(1)
    # Truncation: the file starts over, shorter than what was read from it.
    path.write_text(lines[6] + "\n")
    assert [lines[6]] == tail.read_lines(1)
    _append(path, lines[7])
    assert [lines[7]] == tail.read_lines(1)
    assert (0, "") == tail.interrupt()


def test_follow_waits_for_a_file_that_does_not_exist_yet(tmp_path, tails):
    """-f on a path that does not exist yet says it waits, and prints its lines once it is created."""
    path = tmp_path / "later.jsonl"
    tail = tails(str(path), "-f", "--json")
    assert [f"mpcache-logs: {path} does not exist yet: waiting for it"] == tail.read_lines(1, stream="stderr")
    path.write_text(EVICTED + "\n")
    assert [EVICTED] == tail.read_lines(1)
    assert (0, "") == tail.interrupt()


def test_follow_partial_lines_wait_for_their_newline(tmp_path, tails):
    """A line written in two pieces is printed once, whole, when its newline arrives."""
    path = tmp_path / "mpcache.jsonl"
    path.write_text(STORE_END + "\n")
    tail = tails(str(path), "-f", "--json")
    assert [STORE_END] == tail.read_lines(1)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(EVICTED[:20])
        handle.flush()
        handle.write(EVICTED[20:] + "\n" + ERROR + "\n")
    assert [EVICTED, ERROR] == tail.read_lines(2)
    assert (0, "") == tail.interrupt()


def test_closed_pipe_exits_0_without_traceback(tmp_path):
    """Like `mpcache-logs big.jsonl | head -1`: once the reader has gone, exit status 0, nothing on stderr."""
    path = tmp_path / "big.jsonl"
    path.write_text((EVICTED + "\n") * 20000)
    result = subprocess.run(f"'{sys.executable}' '{LAUNCHER}' '{path}' 2>'{tmp_path / 'err'}' | head -1; "
                            "echo \"status=${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert ("2026-11-29T18:00:00Z DEBUG cache[0] l1.keys.evicted tenant-a=13 tenant-b=3\nstatus=0\n", "") == (
        result.stdout, (tmp_path / "err").read_text())


def test_closed_pipe_while_following_exits_0(tmp_path, tails):
    """Following, when the reader closes the pipe, the next line written ends the tail with status 0 and
    no traceback."""
    path = tmp_path / "mpcache.jsonl"
    path.write_text(EVICTED + "\n")
    tail = tails(str(path), "-f", "--json")
    assert [EVICTED] == tail.read_lines(1)
    tail.process.stdout.close()
    _append(path, *([ERROR] * 5000))  # more than a pipe buffer, whatever the timing
    _, stderr = tail.process.communicate(timeout=DEADLINE_S)
    assert (0, b"") == (tail.process.returncode, stderr)


def test_follow_keeps_up_with_the_supervisors_rotating_writer(tmp_path, tails):
    """The supervisor's single writer (LineForwarder with --log-max-bytes/--log-backups) rotates the file
    again and again while -f follows it; at most one rotation between the tail's reads (the writer waits
    for each 10 lines to be printed), the tail prints every line exactly once, in order (the header line
    each new file begins with is left out by --event)."""
    from mpcache.supervisor import settings
    from mpcache.supervisor.logforward import LineForwarder

    path = tmp_path / "mpcache.jsonl"
    values = settings.parse(["--log-file", str(path), "--log-max-bytes", "2KiB", "--log-backups", "2"], {}).values
    assert (2048, 2) == (values["log-max-bytes"], values["log-backups"])
    tail = tails(str(path), "-f", "--json", "--event", "l1.keys.evicted")
    forwarder = LineForwarder(str(path), values["log-max-bytes"], values["log-backups"])
    lines = [_line("l1.keys.evicted", worker=i % 2, seq=i) for i in range(300)]  # ~150 bytes each
    received = []
    stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # the forwarder copies each line to our stderr too
    try:
        for start in range(0, len(lines), 10):
            for line in lines[start : start + 10]:
                forwarder.write(line)
            received += tail.read_lines(10)
    finally:
        sys.stderr.close()
        sys.stderr = stderr
    assert (lines, ["mpcache.jsonl", "mpcache.jsonl.1", "mpcache.jsonl.2"]) == (
        received, sorted(p.name for p in tmp_path.iterdir()))
    assert (0, "") == tail.interrupt()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("follow", [False, True])
def test_a_path_that_is_not_a_regular_file_is_one_line_and_exit_2(tmp_path, kind, follow):
    """A directory, or a pipe (which cannot be followed by position, and without a writer would block the open):
    one line, status 2, before anything is read (they were tracebacks, or a hang)."""
    path = tmp_path / "log"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    result = run_tail(str(path), *(["-f"] if follow else []))
    assert (2, "") == (result.returncode, result.stdout)
    hint = " (a pipe is read as standard input: - )" if kind == "fifo" else ""
    assert result.stderr == f"mpcache-logs: error: {path} is not a regular file{hint}\n"


@pytest.mark.parametrize("flags, expected", [
    (["--since", "99999999999d"], "reaches back before year 1"),
    (["-n", "100000000000000000000000"], "expected an integer 0..1,000,000,000"),
])
def test_values_past_what_a_date_or_a_count_holds_are_one_line(log_file, flags, expected):
    result = run_tail(str(log_file), *flags)
    assert (2, 1, True) == (result.returncode, result.stderr.count("\n"), expected in result.stderr), result.stderr


def test_fields_of_unexpected_types_and_a_line_nested_too_deeply_are_shown_or_skipped_not_fatal(tmp_path):
    """salt_counts, block_request_ids and fields of other types, and a line nested 100,000 deep, with every
    filter on: each was a traceback that ended the tail (one bad line stopped a -f)."""
    odd = [_line("a.odd", salt_counts=5, block_request_ids=5, fields=7, worker=[1], cache_salt=None),
           _line("b.odd", salt_counts=[5, [None], ["t", "m", "x"]], block_request_ids={"a": 1}, session_id=True)]
    path = tmp_path / "mpcache.jsonl"
    path.write_text("\n".join([*odd, "{" + '"a":' * 100_000 + "1" + "}" * 100_000, ERROR]) + "\n")
    for flags in ([], ["--salt", "None"], ["--request", "True"], ["--request", "r1", "--salt", "t"]):
        result = run_tail(str(path), *flags)
        assert (0, "") == (result.returncode, result.stderr), result.stderr
    assert ["a.odd", "b.odd", "demo.failed"] == [line.split()[3] for line in run_tail(str(path)).stdout.splitlines()]
    assert "" == run_tail(str(path), "--salt", "None").stdout  # a null salt is no salt named "None"


def test_control_characters_in_any_field_are_escaped_and_cannot_forge_a_line(tmp_path):
    """A terminal escape (set the title, clear the screen), a carriage return and a newline in the event, a source,
    a key, a value, a salt and a stack: printed escaped, one line per record (plus the stack's)."""
    esc = "\x1b]0;pwned\x07\x1b[2J"
    record = _line(f"l1.evict{esc}\nFORGED", worker=f"0\r{esc}", salt_counts=[[f"ten{esc}ant", "m", 1]],
                   fields={f"k{esc}": f"v\n{esc}"}, stack=f"Traceback:\n  line {esc}\n")
    path = tmp_path / "mpcache.jsonl"
    path.write_text(record + "\n")
    out = run_tail(str(path)).stdout
    assert [] == [c for c in out if not c.isprintable() and c != "\n"]
    lines = out.splitlines()
    assert 3 == len(lines) and ["    Traceback:", "      line \\u001b]0;pwned\\u0007\\u001b[2J"] == lines[1:]
    assert '"l1.evict\\u001b]0;pwned\\u0007\\u001b[2J\\nFORGED"' in lines[0]


def test_a_record_nested_deeper_than_it_prints_field_by_field_is_printed_as_its_line(tmp_path):
    """Parsed, but deeper than MAX_FIELD_DEPTH (printing field by field recursed, and near the parser's own limit
    went past Python's): the line itself, escaped, and the tail reads on."""
    from mpcache.tools.logtail import MAX_FIELD_DEPTH

    depth = MAX_FIELD_DEPTH + 1
    deep = '{"event":"deep","x":' + "[" * depth + "]" * depth + "}"
    path = tmp_path / "mpcache.jsonl"
    path.write_text(deep + "\n" + ERROR + "\n")
    result = run_tail(str(path))
    assert (0, "") == (result.returncode, result.stderr)
    assert [deep, "2026-11-29T18:00:00Z ERROR demo demo.failed exit_status=1"] == result.stdout.splitlines()


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_a_line_over_the_bound_is_skipped_whole_even_where_its_head_is_a_record(tmp_path, source):
    """A record followed by 1 MiB of padding on one line: not printed (its first 1 MiB had been, as a record), on
    standard input as in a file (which held a line whole)."""
    from mpcache.tools.logtail import MAX_LINE_BYTES

    forged = _line("cut.forged") + " " * MAX_LINE_BYTES + "NOT JSON"
    path = tmp_path / "mpcache.jsonl"
    path.write_text(forged + "\n" + ERROR + "\n")
    result = run_tail(str(path), "--json") if source == "file" else run_tail("-", "--json", stdin=path.read_text())
    assert (0, ERROR + "\n") == (result.returncode, result.stdout)


def test_a_line_too_long_to_keep_is_skipped_and_the_next_one_read(tmp_path):
    """64 MiB with no newline (a sparse file cut short), then a line: the long one is kept to MAX_LINE_BYTES and
    skipped as not JSON, the next printed; each read searched the bytes kept so far again, which took minutes."""
    from mpcache.tools.logtail import MAX_LINE_BYTES

    path = tmp_path / "mpcache.jsonl"
    with open(path, "wb") as handle:
        handle.write(b"{")
        handle.truncate(64 << 20)
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n" + ERROR.encode() + b"\n")
    assert 64 << 20 > 4 * MAX_LINE_BYTES
    result = run_tail(str(path), "--json")
    assert (0, ERROR + "\n") == (result.returncode, result.stdout)
