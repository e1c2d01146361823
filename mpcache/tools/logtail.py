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
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from mpcache import __version__

POLL_INTERVAL_S = 0.05
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
        return now - dt.timedelta(seconds=float(match.group(1)) * _SECONDS[match.group(2).lower()])
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
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
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


def _salts(record: dict) -> set[str]:
    salts = set()
    for group in record.get("salt_counts") or ():
        if isinstance(group, (list, tuple)) and group:
            salts.add(str(group[0]))
    fields = record.get("fields")
    if isinstance(fields, dict) and "cache_salt" in fields:
        salts.add(str(fields["cache_salt"]))
    if "cache_salt" in record:
        salts.add(str(record["cache_salt"]))
    return salts


def _request_ids(record: dict) -> set[str]:
    ids = {str(record[key]) for key in ("session_id", "request_id") if key in record}
    fields = record.get("fields")
    if isinstance(fields, dict) and "request_id" in fields:
        ids.add(str(fields["request_id"]))
    ids.update(str(i) for i in record.get("block_request_ids") or ())
    return ids


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
    if isinstance(value, str):
        return value if value and not any(c.isspace() or c in '"=' for c in value) else json.dumps(value)
    return json.dumps(value, separators=(",", ":"))


def format_record(record: dict) -> str:
    """``TIMESTAMP LEVEL SOURCE EVENT salt=count ... key=value ...`` (+ an indented stack, if any)."""
    timestamp = record.get("timestamp")
    if isinstance(timestamp, str) and (match := _TS_SECONDS_RE.match(timestamp)):
        timestamp = match.group(1) + ("Z" if match.group(2) in (None, "Z", "+00:00") else match.group(2))
    level = str(record.get("level", "-")).upper()
    if "worker" in record:
        source = f"cache[{record['worker']}]"
    else:
        source = str(record.get("role", "-"))
    parts = [str(timestamp or "-"), f"{level:<5}", source, str(record.get("event", "-"))]
    per_salt: dict[str, int | float] = {}
    for group in record.get("salt_counts") or ():
        if isinstance(group, (list, tuple)) and len(group) >= 3 and isinstance(group[2], (int, float)):
            per_salt[str(group[0])] = per_salt.get(str(group[0]), 0) + group[2]
    parts += [f"{_value(salt)}={count}" for salt, count in per_salt.items()]
    fields = record.get("fields")
    if isinstance(fields, dict):
        parts += [f"{key}={_value(value)}" for key, value in fields.items()]
    parts += [f"{key}={_value(value)}" for key, value in record.items() if key not in _COLUMN_KEYS]
    text = " ".join(parts)
    for key in ("stack", "exception"):
        trace = record.get(key)
        if isinstance(trace, str) and trace.strip():
            text += "\n" + "\n".join("    " + line for line in trace.rstrip("\n").splitlines())
    return text


# -- reading -----------------------------------------------------------------------


class Follower:
    """Lines of a file as it grows, across rotation (rename + recreate) and truncation.

    :meth:`lines` yields every complete line available now; ``None`` between
    polls means "nothing new yet" (the caller flushes and waits).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: IO[bytes] | None = None
        self._partial = b""
        self._open()

    def _open(self) -> None:
        try:
            self._handle = open(self.path, "rb")
        except FileNotFoundError:
            self._handle = None
        self._partial = b""

    def _read_available(self) -> Iterator[bytes]:
        if self._handle is None:
            return
        while True:
            chunk = self._handle.read(1 << 16)
            if not chunk:
                return
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            yield from complete

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
        if self._partial:
            yield self._partial
            self._partial = b""

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
                self._partial = b""
            elif change == "appeared":
                self._open()
            else:
                yield None

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
        except ValueError:
            continue
        if isinstance(record, dict) and keep(record):
            yield line, record


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    keep = build_filter(args)

    def render(line: bytes, record: dict) -> str:
        return line.decode("utf-8", "replace") if args.json else format_record(record)

    if args.path == "-":
        follower = None
        existing: Iterator[bytes] = (line.rstrip(b"\n") for line in sys.stdin.buffer)
    else:
        if not args.follow and not os.path.exists(args.path):
            sys.stderr.write(f"mpcache-logs: error: no such file: {args.path}\n")
            return 1
        follower = Follower(args.path)
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
