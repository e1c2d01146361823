"""A seeded publish workload whose every shared byte is fingerprinted (run as a script).

``python differential_publish.py FIRST_SEED COUNT`` runs COUNT seeded scripts of
publishes — one-cell emits with good and bad values, names seen for the first
time, fixed-field events with short and long session ids, fixed fields with one
salt group, multi-cell records (salt groups, sampled keys, blocks, texts),
values that do not pack, a ring
that fills and drops, reads that free it, records that wrap — into a 16-cell
ring with a deterministic clock, and prints one JSON line per seed: the return
values, the reader's (seq, etype) list, and a hash of the whole segment with
the producer pid zeroed.  tests/shm/test_compiled_publish.py runs it once with
the compiled writer and once with ``MPCACHE_PURE_PYTHON=1`` and compares.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys
import uuid

from mpcache.contract.events import SCHEMAS
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import COMPILED_PUBLISH, RingWriter, format_event_segment
from mpcache.shm.ring_reader import RingReader
from mpcache.shm.segment import Segment, shm_name

CAPACITY, INTERN = 16, 16
ONE_CELL = [E.L1_WRITE_FINISHED, E.L1_READ_RESERVED, E.L1_KEYS_EVICTED]
BAD_VALUES = [2**63, -(2**63) - 1, 1.5, "7", None]


SESSIONS = ["", "s" * 5, "s" * 54, "s" * 55, "s" * 130, "é" * 27, "é" * 28, "\ud800", None, b"bytes"]
FLOATS = [0.5, -2.25, 3, True, 2**1100, "x", float("inf")]


def fixed_field_step(rng: random.Random, publisher: Publisher) -> bool:
    """Fixed-field events (the compiled fields emitter and its Python fallback): every field kind,
    names old and new, session ids at and past one text cell, values that are not the regular case."""
    choice = rng.randrange(5)
    if choice == 0:
        fields = (rng.choice(FLOATS), rng.choice(FLOATS), rng.choice([True, False, 1, 2**64]))
        return publisher.emit(E.L1_EVICTION_LOOP_TICK, fields)
    if choice == 1:
        fields = ["model", f"salt{rng.randrange(8)}", 3, 4, 5, 6, 7, rng.choice(["none", "l1_miss", 9]), 8, 9, 10, 11]
        if rng.random() < 0.1:
            fields = fields[:-1]  # the wrong number of fields
        return publisher.emit(E.MP_LOOKUP_PREFETCH_END, tuple(fields) if rng.random() < 0.5 else fields,
                              session_id=rng.choice(SESSIONS))
    if choice == 2:
        return publisher.emit(E.MP_REQUEST_START, session_id=rng.choice(SESSIONS),
                              timestamp_ns=rng.choice([None, None, 1_600_000_000_000_000_000, 2**64, "x"]))
    if choice == 3:  # the most fields: a head cell and three FIELDS cells, ints then 64-bit hashes
        hashes = len(SCHEMAS[E.MRC_LOOKUP_SAMPLED].fields) - 9
        fields = ["model", f"salt{rng.randrange(8)}", *(rng.choice([0, -1, 2**63 - 1, -(2**63), 7]) for _ in range(7)),
                  *(rng.choice([0, 2**63, 2**64 - 1, rng.getrandbits(64)]) for _ in range(hashes))]
        if rng.random() < 0.2:  # one value that does not fit its slot: the Python emitter drops the record
            fields[rng.randrange(2, len(fields))] = rng.choice([-1, 2**64, 2**63, 1.5, "x"])
        return publisher.emit(E.MRC_LOOKUP_SAMPLED, tuple(fields), session_id=rng.choice(SESSIONS))
    return publisher.emit(E.CB_RETRIEVE_END, (rng.randrange(3), rng.randrange(9), rng.random() < 0.5, 0),
                          session_id=rng.choice(SESSIONS))


def one_group_step(rng: random.Random, publisher: Publisher) -> bool:
    """Fixed fields and one salt group (the salted fields emitter and its fallback): int and name fields, salt
    names old and new, counts that do not pack, session ids at and past one text cell, given timestamps."""
    group = {(f"salt{rng.randrange(6)}", rng.choice(["model", "model2"])): rng.choice([0, 5, 2**40, 2**63, "x"])}
    session, stamp = rng.choice(SESSIONS[:5]), rng.choice([None, 1_600_000_000_000_000_000, "x"])
    choice = rng.randrange(3)
    if choice == 0:
        fields: tuple = (rng.choice([0, 3, -1, 2**64, None]),)
        etype = E.SM_WRITE_FINISHED
    elif choice == 1:
        fields, etype = ("l1_retrieve", rng.choice(["not_found", "write_locked", 7])), E.L1_READ_FAILED
    else:
        fields, etype = tuple(rng.randrange(9) for _ in range(rng.choice([3, 3, 2]))), E.L2_PREFETCH_LOAD_COMPLETED
    return publisher.emit(etype, fields, salt_counts=group, session_id=session, timestamp_ns=stamp)


def one_step(rng: random.Random, publisher: Publisher, reader: RingReader, ids: list[int]) -> object:
    choice = rng.randrange(14)
    if choice == 13:
        return one_group_step(rng, publisher)
    if choice >= 11:
        return fixed_field_step(rng, publisher)
    if choice <= 3:
        values = [rng.choice(ids), rng.choice(ids), rng.randrange(-5, 1 << 40)]
        if rng.random() < 0.1:
            values[rng.randrange(3)] = rng.choice(BAD_VALUES)
        return publisher.salted_emitter(rng.choice(ONE_CELL))(*values)
    if choice == 4:
        return publisher.emit_salted(E.L1_WRITE_FINISHED, f"salt{rng.randrange(6)}", "model", rng.randrange(100))
    if choice == 5:
        session = "s" * rng.choice([0, 5, 54, 55, 130])
        return publisher.emit(E.MP_STORE_START, ("cpu", rng.randrange(4), f"model{rng.randrange(3)}"),
                              session_id=session)
    if choice == 6:
        fields = (rng.randrange(9), rng.choice([1, 2**70, "x"]), rng.randrange(9), rng.randrange(9), 0, 0, True)
        return publisher.emit(E.CB_LOOKUP_END, fields)
    if choice == 7:
        groups = {(f"salt{i}", "model"): i + 1 for i in range(rng.choice([1, 2, 4, 12]))}  # 12: > 64 pack args
        sampled = [(rng.getrandbits(64), "salt0", "model") for _ in range(rng.randrange(3))]
        return publisher.emit(E.L1_READ_FINISHED, salt_counts=groups, sampled=sampled)
    if choice == 8:
        blocks = [(f"req{i}", i, rng.getrandbits(64)) for i in range(rng.randrange(1, 3))]
        return publisher.emit(E.MP_VLLM_BLOCK_ALLOCATION, (1, "model", len(blocks), len(blocks)), blocks=blocks)
    if choice == 9:
        return publisher.emit(E.TIMEOUT_RAISED, ("CacheTimeoutError",), texts=("late " * rng.randrange(30), "trace"))
    return [(int(cell["seq"]), int(cell["etype"])) for cell in reader.read_batch()
            if cell["kind"] == layout.CELL_HEAD]


def run(seed: int) -> dict:
    name = shm_name(os.getpid(), uuid.uuid4().hex, "diff")
    segment = Segment.create(name, layout.event_segment_size(CAPACITY, INTERN))
    try:
        format_event_segment(segment, CAPACITY, INTERN)
        clock = itertools.count(1_700_000_000_000_000_000, 7)
        publisher = Publisher(RingWriter(segment), Interner(segment.buf, INTERN), clock_ns=lambda: next(clock))
        reader = RingReader(segment)
        ids = [publisher.name_id(f"salt{i}") for i in range(3)] + [publisher.name_id("model")]
        rng = random.Random(seed)
        results = [one_step(rng, publisher, reader, ids) for _ in range(120)]
        image = bytearray(segment.buf)
        image[layout.OFF_PRODUCER_PID : layout.OFF_PRODUCER_PID + 8] = bytes(8)
        return {"seed": seed, "results": results, "segment_sha256": hashlib.sha256(image).hexdigest()}
    finally:
        Segment.unlink(name)


if __name__ == "__main__":
    first, count = int(sys.argv[1]), int(sys.argv[2])
    print(json.dumps({"compiled": COMPILED_PUBLISH}))
    for seed in range(first, first + count):
        print(json.dumps(run(seed)))
