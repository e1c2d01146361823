"""systemd integration of the supervisor, each part a no-op outside systemd: readiness and status
notifications over ``$NOTIFY_SOCKET`` (``Type=notify``), and journal priorities on stderr lines when
stderr is the journal (``$JOURNAL_STREAM``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping

# syslog priorities journald reads from a "<N>" line prefix (SyslogLevelPrefix=, on by default)
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}
_DEFAULT_PRIORITY = PRIORITIES["info"]


class Notifier:
    """Sends ``KEY=VALUE`` lines to systemd's notification socket; never raises, never blocks."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.failed: str | None = None  # why the last send failed (the log says it once)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str) -> bool:
        """One datagram with every field (``READY="1"``, ``STATUS="..."``); False if none was sent."""
        if self.address is None:
            return False
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address  # abstract socket
        message = "\n".join(f"{key}={value.replace(chr(10), ' ')}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(message, address)
        except OSError as exc:
            self.failed = f"{self.address}: {exc.strerror or exc}"
            return False
        self.failed = None
        return True


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """Whether ``fd`` is the stream systemd connected to the journal (``JOURNAL_STREAM=dev:inode``)."""
    environ = os.environ if environ is None else environ
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def error_line(text: str) -> str:
    """``text`` as one stderr line of error priority: prefixed for the journal when stderr is the journal, so
    that ``journalctl -p err`` shows why a start failed (a line without a prefix is info to journald)."""
    return f"<{PRIORITIES['error']}>{text}\n" if stderr_is_journal() else f"{text}\n"


def journal_prefixed(render: Callable[[str], str] | None) -> Callable[[str], str]:
    """``render`` (None: the JSON line as it is) with the line's level as a journal priority prefix."""
    def prefixed(line: str) -> str:
        return f"<{priority(line)}>{render(line) if render is not None else line}"
    return prefixed


def priority(line: str) -> int:
    """The syslog priority of a JSON log line's ``level`` (info for anything else)."""
    try:
        level = json.loads(line).get("level")
    except (ValueError, AttributeError):
        return _DEFAULT_PRIORITY
    return PRIORITIES.get(level, _DEFAULT_PRIORITY) if isinstance(level, str) else _DEFAULT_PRIORITY
