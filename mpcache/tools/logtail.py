"""``mpcache-logs``: read, filter and follow mpcache's JSON log lines, like ``tail -f`` across rotation and
truncation; filters by event, level, cache_salt, request and time.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import itertools
import json
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from mpcache import __version__

POLL_INTERVAL_S = 0.05
MAX_LINE_BYTES = 1 << 20  # of one line, kept at most: a longer one (none of ours) is skipped whole
MAX_LINES = 10**9  # --lines at most
MAX_FIELD_DEPTH = 100  # lists and objects within a record printed field by field; a deeper one is printed as its line
LEVEL_ORDER = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TS_SECONDS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:\d\d)?$")
# Keys shown in the fixed columns (or not at all) of a readable line.
_COLUMN_KEYS = frozenset({"timestamp", "level", "event", "role", "instance_id", "worker", "fields", "salt_counts",
                          "event_timestamp_ns", "stack", "exception"})


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """'30s', '5m', '2h', '1d' (before ``now``) or an ISO timestamp (UTC when it has no offset)."""
    match = _DURATION_RE.match(text)
    if match:
        now = now or dt.datetime.now(dt.timezone.utc)
        try:
            return now - dt.timedelta(seconds=float(match.group(1)) * _SECONDS[match.group(2).lower()])
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text.strip()!r} reaches back before year 1") from None
    try:
        moment = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 30s, 5m, 2h, 1d or an ISO timestamp, got {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _level(text: str) -> str:
    level = text.strip().lower()
    if level not in LEVEL_ORDER:
        raise argparse.ArgumentTypeError(f"expected debug, info, warning, error or critical, got {text!r}")
    return level


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_LINES:
        raise argparse.ArgumentTypeError(f"expected an integer 0..{MAX_LINES:,}, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="mpcache-logs", description="Read, filter and follow mpcache JSON log lines.")
    parser.add_argument("--version", action="version", version=f"mpcache-logs (mpcache) {__version__}")
    parser.add_argument("path", help="log file (the supervisor's --log-file), or - for standard input")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep reading as the file grows; survives rotation and truncation")
    parser.add_argument("-n", "--lines", type=_count, default=None,
                        help="of what the file already holds, print only the last N matching lines")
    parser.add_argument("--event", action="append", default=[], metavar="NAME",
                        help="dotted event name or prefix, e.g. l1.keys.evicted or l1. (repeatable)")
    parser.add_argument("--level", type=_level, default=None, help="this level and above, e.g. warning")
    parser.add_argument("--salt", action="append", default=[], metavar="CACHE_SALT",
                        help="events whose salt counts or fields name this cache_salt (repeatable)")
    parser.add_argument("--request", action="append", default=[], metavar="ID",
                        help="events of this session/request id (repeatable)")
    parser.add_argument("--since", type=parse_since, default=None,
                        help="lines at or after this time: 30s, 5m, 2h, 1d ago, or an ISO timestamp")
    parser.add_argument("--json", action="store_true", help="print the matching JSON lines as they are")
    return parser


# -- filtering ---------------------------------------------------------------------


def _parse_timestamp(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _event_matches(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if name == pattern or name.startswith(pattern if pattern.endswith(".") else pattern + "."):
            return True
    return False


def _list(record: dict, key: str) -> list:
    """``record[key]`` if it is a list, else an empty one: a field of another type is not ours to iterate."""
    value = record.get(key)
    return value if isinstance(value, list) else []


def _fields(record: dict) -> dict:
    fields = record.get("fields")
    return fields if isinstance(fields, dict) else {}


def _salts(record: dict) -> set[str]:
    named = [group[0] for group in _list(record, "salt_counts") if isinstance(group, list) and group]
    named += [_fields(record).get("cache_salt"), record.get("cache_salt")]
    return {salt for salt in named if isinstance(salt, str)}


def _request_ids(record: dict) -> set[str]:
    named = [record.get("session_id"), record.get("request_id"), _fields(record).get("request_id"),
             *_list(record, "block_request_ids")]
    return {str(name) for name in named if isinstance(name, (str, int)) and not isinstance(name, bool)}


def build_filter(args: argparse.Namespace) -> Callable[[dict], bool]:
    """A predicate over parsed records: every filter given must match."""
    checks: list[Callable[[dict], bool]] = []
    if args.event:
        events = list(args.event)
        checks.append(lambda r: _event_matches(str(r.get("event", "")), events))
    if args.level:
        minimum = LEVEL_ORDER[args.level]
        checks.append(lambda r: LEVEL_ORDER.get(str(r.get("level", "")).lower(), -1) >= minimum)
    if args.salt:
        salts = set(args.salt)
        checks.append(lambda r: not salts.isdisjoint(_salts(r)))
    if args.request:
        requests = set(args.request)
        checks.append(lambda r: not requests.isdisjoint(_request_ids(r)))
    if args.since:
        since = args.since

        def after(record: dict) -> bool:
            moment = _parse_timestamp(record.get("timestamp"))
            return moment is not None and moment >= since

        checks.append(after)
    return lambda record: all(check(record) for check in checks)


# -- rendering ---------------------------------------------------------------------


def _value(value: Any) -> str:
    """A field's value: a string as it is where it reads as one word, else quoted with every character that is not
    printable escaped (a terminal escape in a field cannot reach the terminal, nor a newline forge a line)."""
    if isinstance(value, str):
        plain = value and all(c.isprintable() and not c.isspace() and c not in '"=' for c in value)
        return value if plain else json.dumps(value)
    return json.dumps(value, separators=(",", ":"))


def _printable(text: str) -> str:
    """``text`` with every character that is not printable (a tab aside) escaped, as a line of a stack."""
    return "".join(c if c.isprintable() or c == "\t" else json.dumps(c)[1:-1] for c in text)


def format_record(record: dict) -> str:
    """``TIMESTAMP LEVEL SOURCE EVENT salt=count ... key=value ...`` (+ an indented stack, if any)."""
    timestamp = record.get("timestamp")
    if isinstance(timestamp, str) and (match := _TS_SECONDS_RE.match(timestamp)):
        timestamp = match.group(1) + ("Z" if match.group(2) in (None, "Z", "+00:00") else match.group(2))
    level = record.get("level", "-")
    level = level.upper() if isinstance(level, str) else level
    source = f"cache[{_value(record['worker'])}]" if "worker" in record else _value(record.get("role", "-"))
    parts = [_value(timestamp or "-"), f"{_value(level):<5}", source, _value(record.get("event", "-"))]
    per_salt: dict[str, int | float] = {}
    for group in _list(record, "salt_counts"):
        if isinstance(group, list) and len(group) >= 3 and isinstance(group[2], (int, float)):
            salt = _value(group[0])
            per_salt[salt] = per_salt.get(salt, 0) + group[2]
    parts += [f"{salt}={count}" for salt, count in per_salt.items()]
    parts += [f"{_value(key)}={_value(value)}" for key, value in _fields(record).items()]
    parts += [f"{_value(key)}={_value(value)}" for key, value in record.items() if key not in _COLUMN_KEYS]
    text = " ".join(parts)
    for key in ("stack", "exception"):
        trace = record.get(key)
        if isinstance(trace, str) and trace.strip():
            text += "\n" + "\n".join("    " + _printable(line) for line in trace.rstrip("\n").splitlines())
    return text


# -- reading -----------------------------------------------------------------------


class LogUnreadable(Exception):
    """The log path names something that cannot be read as a log file; the message says what."""


class LineSplitter:
    """Complete lines out of chunks of bytes, each line searched for only in the bytes that are new; a line longer
    than MAX_LINE_BYTES (none of ours) is dropped whole at its newline, so memory stays bounded."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []  # of the line whose newline has not come yet
        self._kept = 0
        self._overlong = False

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line = self._take(chunk[start:end])
            if line is not None:
                yield line
            start = end + 1
        self._keep(chunk[start:])

    def rest(self) -> Iterator[bytes]:
        """A last line without its newline, when reading stops here."""
        if self._pieces or self._overlong:
            line = self._take(b"")
            if line:
                yield line

    def reset(self) -> None:
        self._pieces, self._kept, self._overlong = [], 0, False

    def _keep(self, piece: bytes) -> None:
        if self._kept + len(piece) > MAX_LINE_BYTES:
            self._pieces, self._kept, self._overlong = [], 0, True
        elif piece and not self._overlong:
            self._pieces.append(piece)
            self._kept += len(piece)

    def _take(self, end: bytes) -> bytes | None:
        self._keep(end)
        line = None if self._overlong else b"".join(self._pieces)
        self.reset()
        return line


class Follower:
    """Lines of a file as it grows, across rotation (rename + recreate) and truncation: :meth:`existing` what it
    holds now, :meth:`follow` what comes after, ``None`` between polls meaning "nothing new yet" (the caller
    flushes and waits)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: IO[bytes] | None = None
        self._lines = LineSplitter()
        self._open()

    def _open(self) -> None:
        """Open the path if it exists; LogUnreadable if it is not a regular file we may read (a directory, a
        pipe, which cannot be followed by position, or another user's file)."""
        self._lines.reset()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe without a writer: no wait
        except FileNotFoundError:
            self._handle = None
            return
        except OSError as exc:
            raise LogUnreadable(f"cannot read {self.path}: {exc.strerror}") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise LogUnreadable(f"{self.path} is not a regular file" + (
                " (a pipe is read as standard input: - )" if stat.S_ISFIFO(mode) else ""))
        os.set_blocking(fd, True)
        self._handle = os.fdopen(fd, "rb")

    def _read_available(self) -> Iterator[bytes]:
        if self._handle is None:
            return
        while chunk := self._handle.read(1 << 16):
            yield from self._lines.feed(chunk)

    def _changed(self) -> str:
        """'rotated' (the path names another file now), 'truncated' (ours shrank), 'appeared' or ''."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return ""  # renamed away and not recreated yet: keep reading what we have
        if self._handle is None:
            return "appeared"
        ours = os.fstat(self._handle.fileno())
        if (on_disk.st_ino, on_disk.st_dev) != (ours.st_ino, ours.st_dev):
            return "rotated"
        if on_disk.st_size < self._handle.tell():
            return "truncated"
        return ""

    def existing(self) -> Iterator[bytes]:
        """The complete lines the file holds now."""
        yield from self._read_available()

    def remainder(self) -> Iterator[bytes]:
        """A last line without its newline, when reading stops here."""
        yield from self._lines.rest()

    def follow(self) -> Iterator[bytes | None]:
        """New lines forever; ``None`` each time nothing new is available."""
        while True:
            yield from self._read_available()
            change = self._changed()
            if change == "rotated":
                # Lines the writer added to the old file just before renaming it come first.
                yield from self._read_available()
                yield from self.remainder()
                self._handle.close()  # type: ignore[union-attr]
                self._open()
            elif change == "truncated":
                self._handle.seek(0)  # type: ignore[union-attr]
                self._lines.reset()
            elif change == "appeared":
                self._open()
            else:
                yield None

    @property
    def opened(self) -> bool:
        """Whether the path existed when last opened (otherwise the file is waited for)."""
        return self._handle is not None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def _records(lines: Iterator[bytes | None], keep: Callable[[dict], bool]) -> Iterator[tuple[bytes, dict] | None]:
    for raw in lines:
        if raw is None:
            yield None
            continue
        line = raw.rstrip(b"\r")
        if not line.startswith(b"{"):
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser follows: not ours
            continue
        if isinstance(record, dict) and keep(record):
            yield line, record


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` deep (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _stdin_lines() -> Iterator[bytes]:
    """Standard input's lines, to its end, bounded as a file's are."""
    lines = LineSplitter()
    while chunk := os.read(sys.stdin.fileno(), 1 << 16):
        yield from lines.feed(chunk)
    yield from lines.rest()


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    keep = build_filter(args)

    def render(line: bytes, record: dict) -> str:
        if args.json:
            return line.decode("utf-8", "replace")
        if _deeper_than(record, MAX_FIELD_DEPTH):  # printing it field by field could recurse past Python's limit
            return _printable(line.decode("utf-8", "replace"))
        return format_record(record)

    if args.path == "-":
        follower = None
        existing: Iterator[bytes] = _stdin_lines()
    else:
        if not args.follow and not os.path.exists(args.path):
            sys.stderr.write(f"mpcache-logs: error: no such file: {args.path}\n")
            return 2
        follower = Follower(args.path)
        if not follower.opened:
            sys.stderr.write(f"mpcache-logs: {args.path} does not exist yet: waiting for it\n")
        existing = follower.existing()
    if follower is not None and not args.follow:
        existing = itertools.chain(existing, follower.remainder())
    matches = _records(iter(existing), keep)
    if args.lines is not None:
        matches = iter(collections.deque(matches, maxlen=args.lines))
    for item in matches:
        out.write(render(*item) + "\n")  # type: ignore[misc]
    out.flush()
    if follower is None or not args.follow:
        return 0
    for item in _records(follower.follow(), keep):
        if item is None:
            out.flush()
            time.sleep(POLL_INTERVAL_S)
        else:
            out.write(render(*item) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C
    try:
        return _run(args, sys.stdout)
    except LogUnreadable as exc:  # at the start, or when a rotation left something else at the path
        sys.stderr.write(f"mpcache-logs: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (| head): nothing more to say.  Point stdout at /dev/null so the
        # interpreter's final flush does not fail again and print a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
