"""docs/ARCHITECTURE.md's byte tables agree with the constants the code reads."""

from __future__ import annotations

import re
from pathlib import Path

from mpcache.cache.l2 import base
from mpcache.shm import layout

REPO = Path(__file__).resolve().parents[1]


def _table_after(heading: str) -> list[tuple[str, str, str]]:
    """(offset, size, field) rows of the first offset/size/field table after ``heading``."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rest = text[text.index(heading):]
    table = rest[rest.index("| offset | size | field |"):].split("\n\n")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return [(o.strip(), s.strip(), f.strip()) for o, s, f in rows]


def test_event_segment_table_matches_the_layout_constants():
    """Every header word of the event segment is documented at the offset and size layout.py gives it."""
    rows = {field.replace("`", "").split(":")[0].split(" (")[0]: (offset, size) for offset, size, field in
            _table_after("**Event segment**")}
    words = {"magic MPCRING1": (layout.OFF_MAGIC, 8), "layout version": (layout.OFF_VERSION, 4),
             "cell size": (layout.OFF_CELL_SIZE, 4), "ring capacity in cells": (layout.OFF_CAPACITY, 8),
             "intern table capacity in entries": (layout.OFF_INTERN_CAPACITY, 8),
             "pid of the producer that attached last": (layout.OFF_PRODUCER_PID, 8), "head": (layout.OFF_HEAD, 8),
             "dropped_records": (layout.OFF_DROPPED, 8), "torn_records": (layout.OFF_TORN, 8),
             "tail": (layout.OFF_TAIL, 8), "malformed_records": (layout.OFF_MALFORMED, 8),
             "intern entries published": (layout.OFF_INTERN_COUNT, 8)}

    assert {name: (str(off), str(size)) for name, (off, size) in words.items()} == {
        name: rows.get(name) for name in words}
    assert (b"MPCRING1", str(layout.HEADER_SIZE)) == (layout.RING_MAGIC, rows["intern entries, 136 bytes each"][0])
    assert (136, 64) == (layout.INTERN_ENTRY_SIZE, layout.CELL_SIZE)


def test_chunk_record_table_matches_the_record_struct():
    """The L2 chunk record's documented fixed fields end where the struct and MAC end (44 bytes)."""
    rows = _table_after("fs files and redis values")
    assert ["0", "4", "6", "8", "10", "12", "20", "28", "44"] == [offset for offset, _, _ in rows][:9]
    assert (b"MPL2", 2, 28) == (base.RECORD_MAGIC, base.RECORD_VERSION, base._FIXED.size)


def test_gauge_board_words_match_the_layout_constants():
    """The gauge slot's documented word numbers are layout.py's."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    board = " ".join(text[text.index("**Gauge board**"):].split("\n\n")[0].split())
    fixed = dict((name, int(number)) for number, name in re.findall(r"(\d) (heartbeat|pid|L1 bytes used|L1 capacity"
                                                                     r"|active prefetch jobs)", board))
    assert {"heartbeat": layout.G_HEARTBEAT, "pid": layout.G_PID, "L1 bytes used": layout.G_L1_USED,
            "L1 capacity": layout.G_L1_CAPACITY, "active prefetch jobs": layout.G_ACTIVE_PREFETCH} == fixed
    assert "20+4a bytes held, 21+4a in-flight store tasks, 22+4a in-flight load tasks, 23+4a" in board
    assert (20, 4, 8) == (layout.GAUGE_FIXED_WORDS, layout.GAUGE_ADAPTER_WORDS, layout.MAX_ADAPTERS)
