"""What the supervisor tells others about its children: the gauge board's state and restart words (read by
telemetry), ``status.json`` in the runtime dir (read by operators and probes), and systemd's status line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from typing import Any

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.boardfile import BoardFile, FileBeat, FileSlot, slot_offset
from mpcache.supervisor.children import Child, Role
from mpcache.systemd import Notifier

STATUS_FILE = "status.json"


class BoardWriter:
    """The supervisor's words in the gauge board: each cache process's state, restarts and segments
    recreated, telemetry's restarts (kept there so that telemetry exports them, mpcache_child_restarts_total,
    across its own restarts).  Read and written through a descriptor (:mod:`mpcache.shm.boardfile`), never a
    mapping, so a board truncated under it is never a SIGBUS here; :meth:`repair` restores a damaged one."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._board: BoardFile | None = None
        self._written: dict[int, int] = {}  # offset → what this supervisor last wrote there (restored with it)

    def _file(self) -> BoardFile | None:
        if self._board is None:
            try:
                self._board = BoardFile(self._config.gauge_board_name(), self._config.workers)
            except OSError:
                return None
        return self._board

    def slot(self, worker: int) -> FileSlot | None:
        board = self._file()
        return None if board is None else FileSlot(board, worker)

    def telemetry(self) -> FileBeat | None:
        """The telemetry process's heartbeat words (in the board's header)."""
        board = self._file()
        return None if board is None else FileBeat(board)

    def _keep(self, offset: int, value: int) -> None:
        board = self._file()
        if board is not None:
            self._written[offset] = value
            board.write(offset, value)

    def count_restarts(self, child: Child) -> None:
        if child.role is Role.CACHE:
            self._keep(slot_offset(child.index, layout.G_RESTARTS), child.spawns - 1)
        elif child.role is Role.TELEMETRY:
            self._keep(layout.GAUGE_OFF_TELEMETRY_RESTARTS, child.spawns - 1)

    def count_recreated(self, worker: int, count: int) -> None:
        """``count`` more of cache process ``worker``'s segments were found damaged and recreated."""
        slot = self.slot(worker)
        if slot is not None:
            self._keep(slot_offset(worker, layout.G_SEGMENTS_RECREATED), slot.get(layout.G_SEGMENTS_RECREATED) + count)

    def set_state(self, worker: int, state: str) -> None:
        self._keep(slot_offset(worker, layout.G_STATE), layout.CACHE_STATES.index(state))

    def clear(self, worker: int, state: str) -> None:
        """Zero a dead (or killed) cache process's words, heartbeat included: its usage no longer counts."""
        slot = self.slot(worker)
        if slot is not None:
            slot.clear()
            self.set_state(worker, state)

    def repair(self) -> str | None:
        """What is wrong with the board, after restoring it in place (its size, header and this supervisor's
        words; the children's other words are lost), or None when nothing is."""
        board = self._file()
        damage = None if board is None else board.damage()
        if board is None or damage is None:
            return None
        board.restore()
        for offset, value in self._written.items():
            board.write(offset, value)
        return damage

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None


def status(config: Config, children: Sequence[Child], stopping: bool) -> dict[str, Any]:
    """What the status file says: every child's state, and ``ready`` while any cache process serves."""
    caches = [{"worker": c.index, "state": c.state, "pid": c.process.pid if c.process else None,
               "socket": config.socket_path(c.index)} for c in children if c.role is Role.CACHE]
    others = {c.role.value: c.state for c in children if c.role is not Role.CACHE}
    return {"instance_id": config.instance_id, "supervisor_pid": os.getpid(),
            "ready": not stopping and any(c["state"] == "serving" for c in caches),
            "cache": caches, **others}


def status_line(children: Sequence[Child]) -> str:
    """systemctl status's one line: how many cache processes serve, and the others' states when they are not
    as they should be (telemetry starting, before its first heartbeat, is as it should be)."""
    caches = [child for child in children if child.role is Role.CACHE]
    serving = sum(child.state == "serving" for child in caches)
    others = [f"{child.label} {child.state}" for child in caches if child.state != "serving"]
    others += [f"{c.label} {c.state}" for c in children
               if c.role is not Role.CACHE and c.state not in ("running", "starting")]
    return f"{serving}/{len(caches)} cache processes serving" + (f"; {', '.join(others)}" if others else "")


def write_file_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` (0600): written to a fresh temporary name (never through a link), then renamed."""
    staging = f"{path}.{os.getpid()}.tmp"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise


class Reporter:
    """``status.json`` rewritten at every change, and systemd told (``$NOTIFY_SOCKET``) when its line changes."""

    def __init__(self, config: Config, log: Any) -> None:
        self._config = config
        self._log = log
        self._path = os.path.join(config.runtime_dir, STATUS_FILE)
        self.notifier = Notifier.from_environment()  # systemd's Type=notify; a no-op elsewhere
        self._notified_status = ""

    def write(self, children: Sequence[Child], stopping: bool, ready_announced: bool) -> None:
        try:
            write_file_atomically(self._path, json.dumps(status(self._config, children, stopping)) + "\n")
        except OSError as exc:  # the runtime dir is gone (stopping) or unwritable: the log still says it all
            self._log.debug("status.not_written", error=str(exc))
        line = status_line(children)
        if line != self._notified_status and ready_announced and not stopping:
            self.notify(STATUS=line)

    def notify(self, **fields: str) -> None:
        """Tell systemd; a failure is logged once until a send succeeds again."""
        if not self.notifier.enabled:
            return
        was_failing = self.notifier.failed is not None
        if self.notifier.notify(**fields):
            self._notified_status = fields.get("STATUS", self._notified_status)
        elif not was_failing:
            self._log.warning("systemd.notify_failed", error=self.notifier.failed, fields=sorted(fields))
