"""Per-producer intern table in the event segment: low-cardinality strings travel in records as small ids;
a full table maps new strings to ``__overflow__``, until the next producer starts on a drained ring and
empties it (:func:`reclaim_if_drained`).
"""

from __future__ import annotations

import struct

from mpcache.shm import layout

_ENTRY_LEN = struct.Struct("<I")


class Interner:
    """Producer side: str → id, appending unseen strings to shared memory."""

    def __init__(self, buf: memoryview, capacity: int) -> None:
        self._buf = buf
        self._words = buf[: layout.HEADER_SIZE].cast("Q")
        self._capacity = capacity
        self._ids: dict[str, int] = {}
        self.ids = self._ids  # read-only view for hot paths: a hit needs no method call
        for entry_id, name in enumerate(read_entries(buf, self._words[layout.OFF_INTERN_COUNT // 8])):
            self._ids.setdefault(name, entry_id)
        if not self._ids:
            for name in layout.RESERVED_NAMES:
                self._append(name)

    def id_of(self, name: str) -> int:
        """The id of ``name``; appends it on first use.  Never raises."""
        try:
            return self._ids[name]
        except KeyError:
            return self._append(name)

    def _append(self, name: str) -> int:
        count = self._words[layout.OFF_INTERN_COUNT // 8]
        if count >= self._capacity:
            return layout.NAME_OVERFLOW_ID
        data = name.encode("utf-8", "replace")[: layout.INTERN_MAX_BYTES]
        offset = layout.intern_entry_offset(count)
        _ENTRY_LEN.pack_into(self._buf, offset, len(data))
        self._buf[offset + 8 : offset + 8 + len(data)] = data
        self._words[layout.OFF_INTERN_COUNT // 8] = count + 1  # publish after the bytes
        self._ids[name] = count
        return count


def reclaim_if_drained(buf: memoryview, capacity: int, fill: float = 0.75) -> bool:
    """At a producer's start: empty a table at least ``fill`` full when the ring holds no record left to
    consume (none can name an old id), and bump its epoch so the consumer drops the names it cached.
    The names a previous producer's clients brought in (a burst of model names, say) so do not stay
    for the life of the segment.  Returns whether it did."""
    words = buf[: layout.HEADER_SIZE].cast("Q")
    if words[layout.OFF_INTERN_COUNT // 8] < fill * capacity:
        return False
    if words[layout.OFF_HEAD // 8] != words[layout.OFF_TAIL // 8]:
        return False
    words[layout.OFF_INTERN_COUNT // 8] = 0
    words[layout.OFF_INTERN_EPOCH // 8] += 1
    return True


def read_entries(buf: memoryview, count: int, start: int = 0) -> list[str]:
    """Entries ``start .. count-1`` as strings; a corrupt length reads as ``__corrupt__``."""
    names = []
    for entry_id in range(start, count):
        offset = layout.intern_entry_offset(entry_id)
        (length,) = _ENTRY_LEN.unpack_from(buf, offset)
        if length > layout.INTERN_MAX_BYTES:
            names.append("__corrupt__")
            continue
        names.append(bytes(buf[offset + 8 : offset + 8 + length]).decode("utf-8", "replace"))
    return names


class NameTable:
    """Consumer side: id → str, refreshed from shared memory on a miss."""

    UNKNOWN = "__unknown__"

    def __init__(self, buf: memoryview, capacity: int) -> None:
        self._buf = buf
        self._words = buf[: layout.HEADER_SIZE].cast("Q")
        self._capacity = capacity
        self._names: list[str] = []
        self._epoch = self._words[layout.OFF_INTERN_EPOCH // 8]

    def sync(self) -> None:
        """Forget the cached names when a new producer emptied the table (call after reading a batch,
        before decoding it: the producer bumps the epoch before it writes a record)."""
        epoch = self._words[layout.OFF_INTERN_EPOCH // 8]
        if epoch != self._epoch:
            self._epoch = epoch
            self._names = []

    def refresh(self) -> None:
        count = min(self._words[layout.OFF_INTERN_COUNT // 8], self._capacity)
        if count > len(self._names):
            self._names.extend(read_entries(self._buf, count, len(self._names)))

    def name(self, name_id: int) -> str:
        if not 0 <= name_id < len(self._names):
            self.refresh()
            if not 0 <= name_id < len(self._names):
                return self.UNKNOWN
        return self._names[name_id]

    def names(self) -> list[str]:
        """All names known so far (index = id)."""
        self.refresh()
        return self._names
