"""Every byte mpcache shares between processes: offsets, sizes, magic words and cell kinds, as constants
(drawn in ``docs/ARCHITECTURE.md``, Shared-memory layout).  The C writer gets every offset from here.
"""

from __future__ import annotations

import numpy as np

LAYOUT_VERSION = 3  # 2: the consumer's read cursor (OFF_READ) beside its tail; 3: its exported cursor (OFF_EXPORTED)

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
# Cells the consumer has read (>= tail): [tail, read) is aggregated but not yet covered by a checkpoint of the
# telemetry process, so the producer may not reuse it.  Advisory (what an observer measures the drain by); the
# consumer never reads it back.
OFF_READ = 144
# Cells whose counts the consumer has exported (tail <= exported <= read, while one consumer reads): a telemetry
# process may export more than its last checkpoint covers, and the next one exports nothing before it has read
# this far again, so that no exported value goes down across a restart.
OFF_EXPORTED = 152
OFF_INTERN_COUNT = 192
OFF_INTERN_EPOCH = 200  # bumped when a new producer empties a full table (consumers drop cached names)
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
INLINE_SALT_SLOT = 4  # head slots 4-6 hold the first salt group when the schema allows (has_inline_salt)

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

# Gauge board.
GAUGE_HEADER_SIZE = 64
MAX_ADAPTERS = 8
GAUGE_FIXED_WORDS = 20
GAUGE_LAYOUT_VERSION = 9  # the gauge board's own version (3: telemetry's heartbeat; 4: word 9 counts unidentified
#                           LMCache connections; 5: word 10 counts segments recreated; 6: word 11 buffers refused;
#                           7: words 12-16, the KV feed; 8: word 17 counts copies L1's loss voided; 9: words 18-19,
#                           L1's admission)
GAUGE_ADAPTER_WORDS = 4
GAUGE_SLOT_WORDS = GAUGE_FIXED_WORDS + GAUGE_ADAPTER_WORDS * MAX_ADAPTERS

G_HEARTBEAT = 0
G_PID = 1
G_L1_USED = 2
G_L1_CAPACITY = 3
G_ACTIVE_PREFETCH = 4
G_STATE = 5  # written by the supervisor: an index into CACHE_STATES
G_RESTARTS = 6  # written by the supervisor: times this cache process was restarted (kept across restarts)
G_LMCACHE_REFUSED = 7  # LMCache connections this slot's cache processes refused (kept across restarts)
G_L1_FRAGMENTATION = 8  # bytes L1's allocator holds in slabs that no object uses
G_LMCACHE_UNIDENTIFIED = 9  # LMCache connections closed by their peer before it was identified (kept across restarts)
G_SEGMENTS_RECREATED = 10  # this slot's ring or L1 pool found damaged and recreated (supervisor or cache process)
G_BUFFERS_REFUSED = 11  # client buffers refused by a budget (a connection's, or the process's; kept across restarts)
G_KV_SUBSCRIBERS = 12  # subscribe_kv_events streams open
G_KV_LAG = 13  # records the furthest-behind stream has yet to read
G_KV_RECORDS = 14  # records appended to the KV event log (kept across restarts)
G_KV_SKIPPED = 15  # records streams never got: the log let them go before they read them (kept across restarts)
G_KV_RESYNCS = 16  # lost batches sent: resyncs from a snapshot (kept across restarts)
G_L1_LOST_COPIES = 17  # objects whose copy or reservation L1's pool's loss voided (a peer truncated it)
G_L1_ADMITTING = 18  # L1's capacity (bytes) times the chance it admits a store seen first while it needs room
G_L1_REFUSED = 19  # chunks of stores L1's eviction order refused where room could be made (kept across restarts)
GAUGE_OFF_TELEMETRY_RESTARTS = 24  # header word, written by the supervisor: times telemetry was restarted
GAUGE_OFF_TELEMETRY_HEARTBEAT = 32  # header word, written by telemetry: its heartbeat (ns), read by the supervisor
GAUGE_OFF_TELEMETRY_PID = 40  # header word, written by telemetry: the pid that wrote the heartbeat
CACHE_STATES = ("unknown", "starting", "serving", "restarting", "unresponsive", "given_up")
G_L2_USAGE = 0  # per-adapter word offsets, relative to GAUGE_FIXED_WORDS + 4 * adapter
G_L2_INFLIGHT_STORES = 1
G_L2_INFLIGHT_LOADS = 2
G_L2_INFLIGHT_LOAD_BYTES = 3


# Telemetry state segment (one per instance): the telemetry process's checkpoints, two records written in
# turn, so the one not being written is always whole.  Header, then the records, each 64-aligned.
STATE_MAGIC = b"MPCSTATE"
STATE_LAYOUT_VERSION = 1
STATE_OFF_MAGIC = 0
STATE_OFF_VERSION = 8  # u32
STATE_OFF_RECORDS = 12  # u32: records in the segment (STATE_RECORDS)
STATE_OFF_CAPACITY = 16  # u64: payload bytes a record holds
STATE_HEADER_SIZE = 64
STATE_RECORDS = 2
# A record: this header, then ``length`` payload bytes.
REC_OFF_SEQUENCE = 0  # u64: 0 = never written, or being written now; else the checkpoint's number
REC_OFF_LENGTH = 8  # u64: payload bytes
REC_OFF_TAG = 16  # 16 bytes: the writer's payload format (a hash); another format's record is refused
REC_OFF_WRITTEN_NS = 32  # u64: wall clock when it was written
REC_OFF_CHECKSUM = 40  # u32: CRC-32 of bytes 0..39 of this header, then the payload
REC_HEADER_SIZE = 64


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


def state_record_offset(record: int, capacity: int) -> int:
    """Byte offset of record ``record`` (0 or 1) of a state segment whose records hold ``capacity`` bytes."""
    return STATE_HEADER_SIZE + record * (REC_HEADER_SIZE + (capacity + CELL_SIZE - 1) // CELL_SIZE * CELL_SIZE)


def state_segment_size(capacity: int) -> int:
    return state_record_offset(STATE_RECORDS, capacity)
