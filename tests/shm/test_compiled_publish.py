"""The compiled writer (``mpcache.shm._ringfast``) against the pure-Python writer it replaces.

The differential test runs one seeded workload under each and compares every
shared byte; the rest drive the compiled writer in-process and check what
landed in shared memory: cells, the timestamp against the wall clock, and the
head, drop and sequence bookkeeping.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from mpcache.contract.events import SCHEMAS
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm import ring as ring_module
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring_reader import read_counters
from mpcache.telemetry.batch import EventBatch

compiled_only = pytest.mark.skipif(
    not ring_module.COMPILED_PUBLISH, reason="mpcache.shm._ringfast is not built (or MPCACHE_PURE_PYTHON is set)"
)
DIFFERENTIAL = Path(__file__).with_name("differential_publish.py")
TS_SLOT = slice(layout.slot_offset(0), layout.slot_offset(1))


def wall_clock_publisher(ring) -> Publisher:
    return Publisher(ring.writer, Interner(ring.segment.buf, ring.intern_capacity))


def cell_at(ring, index: int) -> bytes:
    offset = ring.cells_offset + (index % ring.capacity) * layout.CELL_SIZE
    return bytes(ring.segment.buf[offset : offset + layout.CELL_SIZE])


def bookkeeping(ring) -> tuple[int, int, int]:
    counters = read_counters(ring.segment)
    return counters.head, counters.dropped, ring.writer.seq


def run_differential(pure_python: bool, seeds: int) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "MPCACHE_PURE_PYTHON"}
    if pure_python:
        env["MPCACHE_PURE_PYTHON"] = "1"
    out = subprocess.run([sys.executable, str(DIFFERENTIAL), "0", str(seeds)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert 0 == out.returncode, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert {"compiled": not pure_python} == lines[0]
    return lines[1:]




@compiled_only
def test_differential_every_shared_byte_matches_the_pure_python_writer():
    """200 seeded workloads (every record shape, bad values, drops, wraps): identical segments and results."""
    compiled, python = run_differential(False, 200), run_differential(True, 200)

    assert 200 == len(compiled) == len(python)
    for c, p in zip(compiled, python):
        assert p == c
    outcomes = [r for run in compiled for r in run["results"] if isinstance(r, bool)]
    assert True in outcomes and False in outcomes  # the workload really published and really dropped


@compiled_only
def test_publisher_hands_out_compiled_emitters(ring):
    """With the extension, every one-cell emitter is compiled, whatever the clock, on the compiled core, and
    so is every fixed-field emitter, up to the widest event (a head cell and three FIELDS cells)."""
    assert "OneCellEmitter" == type(wall_clock_publisher(ring).salted_emitter(E.L1_WRITE_FINISHED)).__name__
    assert "OneCellEmitter" == type(ring.publisher.salted_emitter(E.L1_WRITE_FINISHED)).__name__  # fixed clock
    assert "WriterCore" == type(ring.writer).__mro__[1].__name__
    plain = wall_clock_publisher(ring)._plain_emitters
    assert {"FieldsEmitter"} == {type(emit).__name__ for emit in plain.values()}
    assert E.MRC_LOOKUP_SAMPLED in plain and len(SCHEMAS[E.MRC_LOOKUP_SAMPLED].fields) > 20


@compiled_only
def test_wall_clock_timestamp_is_read_in_the_call(ring):
    """Without an injected clock the compiled emitter stamps CLOCK_REALTIME, what time.time_ns() reads."""
    publisher = wall_clock_publisher(ring)
    emit = publisher.salted_emitter(E.L1_WRITE_FINISHED)
    before = time.time_ns()
    assert emit(2, 3, 16)
    after = time.time_ns()

    assert before <= struct.unpack("<q", cell_at(ring, 0)[TS_SLOT])[0] <= after
    [event] = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert (0, E.L1_WRITE_FINISHED) == (event.seq, event.etype)


@compiled_only
@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, "7", None, 2**64])
def test_a_value_that_is_not_int64_is_dropped_and_counted(ring, bad):
    """A bad value returns False, counts a drop and spends a sequence number; nothing is raised."""
    emit = ring.publisher.salted_emitter(E.L1_WRITE_FINISHED)

    assert [True, False, True] == [emit(1, 2, 3), emit(1, bad, 3), emit(4, 5, 6)]
    assert (2, 1, 3) == bookkeeping(ring)
    events = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert [0, 2] == [event.seq for event in events]  # the dropped record's seq is spent: a visible gap


@compiled_only
def test_a_multi_cell_record_that_does_not_pack_is_dropped_and_counted(ring):
    """The compiled append turns pack errors into a counted drop; the next record is published."""
    assert ring.publisher.emit(E.CB_LOOKUP_END, (1, 2**70, 3, 4, 5, 6, True)) is False
    assert ring.publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, True)) is True

    assert (2, 1, 2) == bookkeeping(ring)
    [event] = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert (1, (1, 2, 3, 4, 5, 6, True)) == (event.seq, tuple(event.fields.values()))


@compiled_only
def test_full_ring_drops_then_resumes_after_the_reader_consumes(ring_factory):
    """A full ring drops (counted, seq spent) until the reader frees cells; then publishing resumes."""
    ring = ring_factory(capacity=16)
    emit = ring.publisher.salted_emitter(E.L1_WRITE_FINISHED)

    assert [True] * 16 + [False, False] == [emit(i, 0, 1) for i in range(18)]
    assert (16, 2, 18) == bookkeeping(ring)
    assert 16 == len(ring.reader.read_batch())
    assert emit(99, 0, 1) is True
    events = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert [18] == [event.seq for event in events]


@compiled_only
def test_one_cell_and_multi_cell_records_share_one_cursor(ring):
    """Interleaved one-cell emits and appended multi-cell records keep one sequence and one head."""
    publisher = wall_clock_publisher(ring)
    emit = publisher.salted_emitter(E.L1_WRITE_FINISHED)
    salt, model = publisher.name_id("s"), publisher.name_id("m")
    for n in range(1, 6):
        assert emit(salt, model, n)
        assert publisher.emit(E.L1_KEYS_EVICTED, salt_counts={("s", "m"): n, ("t", "m"): n, ("u", "m"): n})

    events = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert list(range(10)) == [event.seq for event in events]
    assert [1, 3, 2, 6, 3, 9, 4, 12, 5, 15] == [sum(count for _, _, count in event.salt_counts) for event in events]
    assert 5 * 1 + 5 * 3 == read_counters(ring.segment).head


@compiled_only
def test_wrong_arity_is_a_type_error_like_the_python_closure(ring):
    """A call-site bug (wrong number of arguments) raises TypeError, as the Python closure does."""
    with pytest.raises(TypeError):
        ring.publisher.salted_emitter(E.L1_WRITE_FINISHED)(1, 2)


@compiled_only
def test_emitter_keeps_the_mapping_alive_after_the_segment_is_closed(ring):
    """No use after unmap: the writer holds a buffer export, so close() leaves the mapping in place."""
    emit = ring.publisher.salted_emitter(E.L1_WRITE_FINISHED)
    ring.segment.close()

    assert emit(1, 2, 3) is True
    assert 1 == ring.writer._head


@compiled_only
def test_regular_fixed_field_events_never_reach_the_python_emitter(ring, monkeypatch):
    """Known names, int/bool/float values and a one-cell session id are published in C; a new name
    or a longer session id goes to the Python emitter; either way the reader gets the same event."""
    fallbacks = []
    python_emitter = Publisher._make_python_plain_emitter

    def spying(self, shape):
        emit = python_emitter(self, shape)
        return lambda *args: fallbacks.append(E(shape.etype)) or emit(*args)

    monkeypatch.setattr(Publisher, "_make_python_plain_emitter", spying)
    publisher = wall_clock_publisher(ring)
    publisher.name_id("cpu"), publisher.name_id("llama")
    assert publisher.emit(E.L1_EVICTION_LOOP_TICK, (0.5, 1, True))
    assert publisher.emit(E.MP_STORE_START, ("cpu", 3, "llama"), session_id="req-é")
    assert publisher.emit(E.CB_LOOKUP_END, (1, 2, 3, 4, 5, 6, False), session_id="r" * 54, timestamp_ns=77)
    many = ("llama", "cpu", *range(len(SCHEMAS[E.MRC_LOOKUP_SAMPLED].fields) - 2))  # three FIELDS cells
    assert publisher.emit(E.MRC_LOOKUP_SAMPLED, many)
    assert [] == fallbacks
    assert publisher.emit(E.MP_STORE_START, ("gpu", 3, "llama"), session_id="req-2")
    assert publisher.emit(E.MP_REQUEST_START, session_id="r" * 55)
    assert [E.MP_STORE_START, E.MP_REQUEST_START] == fallbacks

    events = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert [(0.5, 1.0, True), ("cpu", 3, "llama"), (1, 2, 3, 4, 5, 6, False), many, ("gpu", 3, "llama"), ()] == [
        tuple(event.fields.values()) for event in events]
    assert ["", "req-é", "r" * 54, "", "req-2", "r" * 55] == [event.session_id for event in events]
    assert list(range(6)) == [event.seq for event in events]
    assert 77 == events[2].timestamp_ns


def test_a_dropped_publisher_is_collected_with_its_emitters(ring):
    """Publisher → emitters → fallback closure → Publisher is a cycle; the compiled emitters take part
    in garbage collection, so it is collected (and the writer's hold on the mapping goes with it)."""
    publisher = wall_clock_publisher(ring)
    collected = weakref.ref(publisher)
    del publisher
    gc.collect()

    assert collected() is None


@pytest.mark.parametrize(("environment", "block_extension", "expected"), [
    ({}, False, ring_module.PUBLISH_COMPILED),
    ({"MPCACHE_PURE_PYTHON": "1"}, False, ring_module.PUBLISH_PYTHON_BY_CHOICE),
    ({}, True, ring_module.PUBLISH_PYTHON_NOT_BUILT),
])
def test_publish_path_says_which_writer_runs_and_why(environment, block_extension, expected):
    """The writer is chosen once at import: compiled, Python by choice, or Python because the
    extension is missing (simulated by blocking its import) — the reason the supervisor logs."""
    if expected == ring_module.PUBLISH_COMPILED and not ring_module.COMPILED_PUBLISH:
        pytest.skip("mpcache.shm._ringfast is not built here")
    block = "sys.modules['mpcache.shm._ringfast'] = None; " if block_extension else ""
    script = f"import sys; {block}from mpcache.shm import ring; print(ring.PUBLISH_PATH, ring.COMPILED_PUBLISH)"
    env = {key: value for key, value in os.environ.items() if key != "MPCACHE_PURE_PYTHON"} | environment
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)

    assert f"{expected} {expected == ring_module.PUBLISH_COMPILED}" == out.stdout.strip(), out.stderr


def test_a_name_whose_hash_empties_the_fields_list_cannot_make_the_emitter_read_freed_fields(ring):
    """The compiled emitter reads a list's items in place; a name field of a str subclass runs Python code
    (its ``__hash__``) in the middle, which may empty the list.  Only exact str names are looked up there:
    the rest go to the Python emitter, which copies the fields first."""
    publisher = ring.publisher
    publisher.name_id("cpu"), publisher.name_id("llama")
    fields: list = []

    class Emptying(str):
        def __hash__(self):
            fields.clear()
            fields.extend(object() for _ in range(3))  # the freed items' memory is reused
            return str.__hash__(self)

    for _ in range(50):  # a 64-cell ring
        fields[:] = [Emptying("cpu"), 3, "llama"]
        assert publisher.emit(E.MP_STORE_START, fields)
    events = EventBatch(0, ring.reader.read_batch(), ring.names).events()
    assert [("cpu", 3, "llama")] * 50 == [tuple(event.fields.values()) for event in events]
