"""The gauge board as the supervisor reads and writes it: through a descriptor (``pread``/``pwrite``), never a
mapping.  A process sharing the IPC namespace can truncate the board; a mapping of it then faults (SIGBUS) on
the next access, which killed the supervisor within a second.  A read of a truncated file is only short: read
here as zeros, and :meth:`BoardFile.damage` says what is wrong, so the supervisor restores the board in place
(:meth:`BoardFile.restore`: its size and header again; the words it keeps itself it writes back).
"""

from __future__ import annotations

import os
import struct

from mpcache.shm import layout
from mpcache.shm.gauges import KEPT_WORDS, formatted_by_this_build, gauge_header
from mpcache.shm.segment import SHM_DIR

_WORD = struct.Struct("<q")


class BoardFile:
    """Words of the gauge board ``name`` (of ``n_slots`` slots) by byte offset."""

    def __init__(self, name: str, n_slots: int) -> None:
        self.name = name
        self.n_slots = n_slots
        self.size = layout.gauge_board_size(n_slots)
        self._fd = os.open(SHM_DIR + name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def read(self, offset: int) -> int:
        """The word at ``offset``; 0 where the board is shorter (truncated)."""
        data = os.pread(self._fd, 8, offset)
        return _WORD.unpack(data)[0] if len(data) == 8 else 0

    def write(self, offset: int, value: int) -> None:
        """Set the word at ``offset``, unless the board is shorter than that (never grows it)."""
        if os.fstat(self._fd).st_size >= offset + 8:
            os.pwrite(self._fd, _WORD.pack(int(value)), offset)

    def damage(self) -> str | None:
        """What is wrong with the board (its size, its header), or None."""
        found = os.fstat(self._fd).st_size
        if found != self.size:
            return f"it is {found} bytes, not {self.size}"
        header = os.pread(self._fd, 20, 0)
        if not formatted_by_this_build(header):
            return "its header is not this build's gauge board"
        if struct.unpack_from("<I", header, 12)[0] != self.n_slots:
            return "its header claims another number of slots"
        return None

    def restore(self) -> None:
        """Give the board its size and header again, in place (the same file: its lock and every mapping of it
        stay); words lost to a truncation read as zeros."""
        if os.fstat(self._fd).st_size != self.size:
            os.ftruncate(self._fd, self.size)
        os.pwrite(self._fd, gauge_header(self.n_slots), 0)

    def close(self) -> None:
        os.close(self._fd)


def slot_offset(worker: int, word: int) -> int:
    return layout.GAUGE_HEADER_SIZE + (worker * layout.GAUGE_SLOT_WORDS + word) * 8


class FileSlot:
    """A cache process's slot, read and written through :class:`BoardFile` (the supervisor's words in it)."""

    def __init__(self, board: BoardFile, worker: int) -> None:
        self._board = board
        self._worker = worker

    def get(self, word: int) -> int:
        return self._board.read(slot_offset(self._worker, word))

    def set(self, word: int, value: int) -> None:
        self._board.write(slot_offset(self._worker, word), value)

    def clear(self) -> None:
        """Zero the slot, except the counters kept across restarts (as :meth:`GaugeSlot.clear`)."""
        for word in range(layout.GAUGE_SLOT_WORDS):
            if word not in KEPT_WORDS:
                self.set(word, 0)


class FileBeat:
    """The telemetry process's heartbeat words in the board's header."""

    def __init__(self, board: BoardFile) -> None:
        self._board = board

    @property
    def pid(self) -> int:
        return self._board.read(layout.GAUGE_OFF_TELEMETRY_PID)

    @property
    def heartbeat(self) -> int:
        return self._board.read(layout.GAUGE_OFF_TELEMETRY_HEARTBEAT)

    def clear(self) -> None:
        self._board.write(layout.GAUGE_OFF_TELEMETRY_PID, 0)
        self._board.write(layout.GAUGE_OFF_TELEMETRY_HEARTBEAT, 0)
