"""The ``--log-file``: written only if the service created it or can prove it is its own.

A file the service creates begins with a header line (``log.file_created``, a JSON log line).  An existing
file is appended to only when it is a regular file with one link, owned by the service's uid, not writable
by group or others, reached without a symbolic link, and begins with that header: anything else (another
user's file, a root-owned one, ``/etc/passwd`` when run as root, a hard link to some file, a planted symlink)
is refused before a byte is written.  Rotation renames and replaces only files that pass the same proof, so
it never moves or overwrites a file it did not create.  One writer (the forwarder's file sink) uses it.
"""

from __future__ import annotations

import datetime
import json
import os
import stat

from mpcache.errors import ConfigError

HEADER_EVENT = "log.file_created"
WRITER = "mpcache"
MAX_HEADER_BYTES = 4096  # the header is one short line: a longer first line is not ours
_OPEN_EXISTING = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotOurs(Exception):
    """A path holds something the service did not create; the message says why."""


def header() -> bytes:
    """The first line of every log file the service creates (a JSON log line like any other)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return (json.dumps({"event": HEADER_EVENT, "writer": WRITER, "role": "supervisor", "level": "info",
                        "timestamp": now, "message": "a log file of mpcache: it appends only to files that "
                        "begin with this line"}) + "\n").encode()


def _begins_with_header(fd: int) -> bool:
    first = os.pread(fd, MAX_HEADER_BYTES, 0).split(b"\n", 1)
    if len(first) < 2:
        return False
    try:
        line = json.loads(first[0])
    except ValueError:
        return False
    return isinstance(line, dict) and line.get("event") == HEADER_EVENT and line.get("writer") == WRITER


def _why_not_ours(fd: int) -> str | None:
    """Why the open file ``fd`` is not a log file of this service's, or None if it is."""
    info = os.fstat(fd)
    uid = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} hard links"
    if info.st_uid != uid:
        return f"it belongs to uid {info.st_uid}, not to the service's uid {uid}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if not _begins_with_header(fd):
        return "it does not begin with the header line of a log file the service created"
    return None


def open_ours(path: str) -> int:
    """A read-write append descriptor of the existing log file ``path``, proven ours; FileNotFoundError if
    there is none, :class:`NotOurs` if it is not ours."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):  # checked before open: a device or FIFO is never opened
        raise NotOurs("it is a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        raise NotOurs("it is not a regular file")
    fd = os.open(path, _OPEN_EXISTING)
    reason = _why_not_ours(fd)
    if reason is not None:
        os.close(fd)
        raise NotOurs(reason)
    os.set_blocking(fd, True)
    return fd


def _check_absent_or_ours(path: str) -> None:
    try:
        os.close(open_ours(path))
    except FileNotFoundError:
        pass


def backups(path: str, count: int) -> list[str]:
    """The rotated copies' names, oldest last: ``path.1`` .. ``path.<count>``."""
    return [f"{path}.{index}" for index in range(1, count + 1)]


def refusal(option: str, path: str, reason: str) -> ConfigError:
    """The one-line refusal of ``path`` (named by ``option``), saying why and what to do."""
    return ConfigError(f"{option}: refusing to write {path!r}: {reason} (the service writes only log files "
                       "it created; name a new file, or move this one away)")


def check(path: str, backup_count: int) -> None:
    """Refuse (ConfigError) a ``--log-file`` or a rotated copy of it that exists and is not ours; writes
    nothing (``--check-config`` and the start both ask)."""
    for name in [path, *backups(path, backup_count)]:
        try:
            _check_absent_or_ours(name)
        except NotOurs as exc:
            raise refusal("--log-file", name, str(exc)) from None


class LogFile:
    """The log file, opened (created, or proven ours) at construction; :meth:`write` appends a line and
    rotates at ``max_bytes`` (0: never) keeping ``backup_count`` copies.  Not thread-safe: one writer."""

    def __init__(self, path: str, max_bytes: int, backup_count: int) -> None:
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        check(self.path, backup_count)
        self._fd, self._fresh = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> tuple[int, bool]:
        """Create the file with its header (True: fresh), or append to it if it exists and is ours."""
        try:
            fd = os.open(self.path, _CREATE, 0o600)
        except FileExistsError:
            try:
                return open_ours(self.path), False
            except NotOurs as exc:
                raise refusal("--log-file", self.path, str(exc)) from None
        self._write_all(fd, header())
        return fd, True

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        while data:
            data = data[os.write(fd, data):]

    def write(self, line: str) -> None:
        """Append one line (its newline added), rotating first when it would reach ``max_bytes``."""
        data = (line + "\n").encode("utf-8", "replace")
        if self.max_bytes and self._size + len(data) >= self.max_bytes and not self._fresh:
            self._rotate()  # a fresh file (its header alone) takes even a line longer than max_bytes
        self._write_all(self._fd, data)
        self._size += len(data)
        self._fresh = False

    def _rotate(self) -> None:
        """Shift ``path`` → ``path.1`` → … → ``path.N`` (the oldest replaced) and start a new file; every
        name it moves or replaces must hold a log file of ours, else it raises and leaves them all as they
        are (the file sink then stops, saying why)."""
        held = os.fstat(self._fd)
        current = os.lstat(self.path)
        if (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
            raise refusal("--log-file", self.path, "it is no longer the file the service opened")
        check(self.path, self.backup_count)
        names = [self.path, *backups(self.path, self.backup_count)]
        os.close(self._fd)
        if self.backup_count == 0:
            os.unlink(self.path)
        for source, target in reversed(list(zip(names, names[1:]))):
            if os.path.lexists(source):
                os.rename(source, target)
        self._fd, self._fresh = self._open()
        self._size = os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)
