"""Every byte mpcache shares between processes, in one place.

Two kinds of shared-memory segment exist; both start with a magic word and a
layout version so that a reader of another build fails with
:class:`~mpcache.errors.LayoutMismatchError` instead of decoding garbage.
All integers are little-endian.  The compiled writer (``_ringfast.c``, given
every offset it uses from here by :mod:`mpcache.shm.ring`) commits with a
release store; the pure-Python writer and the numpy reader rely on x86-64
keeping plain stores in order (weakly ordered CPUs are not supported as
written).

Event segment (one per cache process: one writer, one reader)
==============================================================

====== ====== ======================================================================
offset  size  field
====== ====== ======================================================================
0       8     magic ``b"MPCRING1"``
8       4     layout version (u32, :data:`LAYOUT_VERSION`)
12      4     cell size in bytes (u32, always 64)
16      8     ring capacity in cells (u64, a power of two)
24      8     intern table capacity in entries (u64)
32      8     pid of the producer that attached last (i64)
64      8     ``head``: cells committed so far (u64, producer-owned, monotonic)
72      8     ``dropped_records``: records not published because the ring was full
80      8     ``torn_records``: records a dead producer began but never committed
128     8     ``tail``: cells consumed so far (u64, consumer-owned, monotonic)
136     8     ``malformed_records``: records the consumer found invalid and skipped
192     8     intern table: entries published (u64, producer-owned)
256     ...   intern entries, :data:`INTERN_ENTRY_SIZE` bytes each:
              u32 byte length, 4 pad bytes, up to 128 bytes of UTF-8
...     ...   ring cells, ``capacity`` × 64 bytes
====== ====== ======================================================================

The producer, tail and head words sit on separate cache lines.

Commit protocol: a record is a run of consecutive cells.  The producer writes
all of them, then stores ``head += ncells``; that single aligned store is the
commit.  The consumer copies ``[tail, head)`` out, validates it, then stores
``tail``.  The producer never writes past ``tail + capacity``, so a copied
range cannot be overwritten while it is read; a full ring drops the new record
and counts it.  A producer killed mid-record never stored ``head``: its cells
are invisible, the reader never waits on them, and whoever re-attaches a
writer (the supervisor after reaping it) finds the cell at ``head`` carrying
the next sequence number and counts one torn record.

Cell (64 bytes)
---------------

====== ====== ============================================================
offset  size  field
====== ====== ============================================================
0       4     ``seq``: the record's sequence number, low 32 bits (every cell)
4       1     ``kind``: one of the ``CELL_*`` constants
5       1     ``etype``: the event type id (every cell)
6       2     ``index``: head cell → number of cells in the record;
              continuation → its position in the record (1 …)
8       56    payload: seven 8-byte slots, meaning set by ``kind``
====== ====== ============================================================

Payload by kind:

* ``CELL_HEAD`` (always first): slot 0 = timestamp, ns since the epoch (i64);
  slots 1–6 = the event's first six fixed fields.  Event types that carry
  salt_counts and have at most three fixed fields keep their first salt group
  *inline* in head slots 4–6 (cache_salt id, model_name id, count; count 0 =
  no group), so the commonest events (L1, storage manager) are one cell.
* ``CELL_FIELDS``: seven more fixed fields.
* ``CELL_SALT``: slot 0 = cache_salt id, slot 1 = model_name id, slot 2 = count.
* ``CELL_SAMPLED``: slot 0 = chunk hash (u64 bits), slot 1 = cache_salt id,
  slot 2 = model_name id.
* ``CELL_BLOCK``: slot 0 = index of the request-id text field, slot 1 = block
  id, slot 2 = token hash (u64 bits).
* ``CELL_TEXT``: byte 8 = text field number, byte 9 = bytes used (≤ 54),
  bytes 10–63 = UTF-8.  A text field spans as many cells as it needs.

A fixed field is an i64 (``int``, ``bool``, interned ``name`` id) or the bits
of an f64 (``float``).

Gauge board segment (one for the whole instance)
================================================

====== ====== ===========================================================
offset  size  field
====== ====== ===========================================================
0       8     magic ``b"MPCGAUGE"``
8       4     layout version (u32)
12      4     number of slots (u32, one per cache process)
16      4     adapters per slot (u32, :data:`MAX_ADAPTERS`)
64      ...   slots, :data:`GAUGE_SLOT_WORDS` × 8 bytes each
====== ====== ===========================================================

Slot words (i64): 0 heartbeat ns (0 = not running), 1 pid, 2 L1 used bytes,
3 L1 capacity bytes, 4 active prefetch jobs, 5 the supervisor's state of this cache process
(:data:`CACHE_STATES`; written by the supervisor only), 6–7 reserved, then per adapter
``a``: 8+4a usage bytes, 9+4a in-flight store tasks, 10+4a in-flight load
tasks, 11+4a in-flight load bytes.  Each word is written with one aligned
8-byte store, so a reader sees either the old or the new value.
"""

from __future__ import annotations

import struct

import numpy as np

LAYOUT_VERSION = 1

RING_MAGIC = b"MPCRING1"
GAUGE_MAGIC = b"MPCGAUGE"

CELL_SIZE = 64
SLOTS_PER_CELL = 7
TEXT_BYTES_PER_CELL = 54

# Event segment header offsets.
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_CELL_SIZE = 12
OFF_CAPACITY = 16
OFF_INTERN_CAPACITY = 24
OFF_PRODUCER_PID = 32
OFF_HEAD = 64
OFF_DROPPED = 72
OFF_TORN = 80
OFF_TAIL = 128
OFF_MALFORMED = 136
OFF_INTERN_COUNT = 192
HEADER_SIZE = 256

INTERN_ENTRY_SIZE = 136
INTERN_MAX_BYTES = 128

# Cell kinds.
CELL_EMPTY = 0
CELL_HEAD = 1
CELL_FIELDS = 2
CELL_SALT = 3
CELL_SAMPLED = 4
CELL_BLOCK = 5
CELL_TEXT = 6

CELL_OFF_SEQ = 0  # byte offsets within a cell
CELL_OFF_SLOTS = 8
TEXT_OFF_LENGTH = 9  # within a CELL_TEXT cell: bytes used, then the UTF-8
TEXT_OFF_DATA = 10

HEAD_FIELD_SLOTS = 6  # fixed fields carried in the head cell
INLINE_SALT_SLOT = 4  # head slots 4-6 hold the first salt group when the schema allows
INLINE_SALT_MAX_FIELDS = 3

# Reserved intern ids.
NAME_EMPTY_ID = 0  # ""
NAME_OVERFLOW_ID = 1  # the table is full: "__overflow__"
RESERVED_NAMES = ("", "__overflow__")

CELL_DTYPE = np.dtype(
    [
        ("seq", "<u4"),
        ("kind", "u1"),
        ("etype", "u1"),
        ("index", "<u2"),
        ("slots", "<i8", (SLOTS_PER_CELL,)),
    ]
)
assert CELL_DTYPE.itemsize == CELL_SIZE

# struct formats: cell prefix (seq, kind, etype, index) and a whole cell.
CELL_PREFIX = "<IBBH"
CELL_INTS = CELL_PREFIX + "7q"
CELL_TEXT_FMT = CELL_PREFIX + "BB54s"
TEXT_CELL = struct.Struct(CELL_TEXT_FMT)

# Gauge board.
GAUGE_HEADER_SIZE = 64
MAX_ADAPTERS = 8
GAUGE_FIXED_WORDS = 8
GAUGE_ADAPTER_WORDS = 4
GAUGE_SLOT_WORDS = GAUGE_FIXED_WORDS + GAUGE_ADAPTER_WORDS * MAX_ADAPTERS

G_HEARTBEAT = 0
G_PID = 1
G_L1_USED = 2
G_L1_CAPACITY = 3
G_ACTIVE_PREFETCH = 4
G_STATE = 5  # written by the supervisor: an index into CACHE_STATES
CACHE_STATES = ("unknown", "starting", "serving", "restarting", "unresponsive", "given_up")
G_L2_USAGE = 0  # per-adapter word offsets, relative to 8 + 4 * adapter
G_L2_INFLIGHT_STORES = 1
G_L2_INFLIGHT_LOADS = 2
G_L2_INFLIGHT_LOAD_BYTES = 3


def event_segment_size(capacity_cells: int, intern_capacity: int) -> int:
    """Bytes needed for an event segment with these capacities."""
    return cells_offset(intern_capacity) + capacity_cells * CELL_SIZE


def cells_offset(intern_capacity: int) -> int:
    """Offset of cell 0: after the header and the intern table, 64-aligned."""
    end = HEADER_SIZE + intern_capacity * INTERN_ENTRY_SIZE
    return (end + CELL_SIZE - 1) // CELL_SIZE * CELL_SIZE


def slot_offset(slot: int) -> int:
    """Byte offset, within a cell, of payload slot ``slot`` (0 … 6)."""
    return CELL_OFF_SLOTS + 8 * slot


def intern_entry_offset(entry_id: int) -> int:
    return HEADER_SIZE + entry_id * INTERN_ENTRY_SIZE


def gauge_board_size(n_slots: int) -> int:
    return GAUGE_HEADER_SIZE + n_slots * GAUGE_SLOT_WORDS * 8


def gauge_adapter_word(adapter_index: int, which: int) -> int:
    """Word index, within a slot, of one per-adapter gauge."""
    return GAUGE_FIXED_WORDS + GAUGE_ADAPTER_WORDS * adapter_index + which
