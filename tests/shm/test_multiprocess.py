"""Real processes: N writers, one concurrent reader, exact accounting; a writer killed mid-record.

Children are separate interpreters started with ``subprocess``; each attaches
to its own ring by name and reports back on stdout as JSON.  The parent reads
concurrently and asserts that what it received equals what the children say
they published.  Waits are bounded by deadlines; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.intern import Interner, NameTable
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, format_event_segment, recover_torn_record
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.telemetry.batch import EventBatch

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0

CHILD = r'''
import json, struct, sys
from mpcache.contract.events import EventType as E
from mpcache.shm.publish import Publisher
from mpcache.shm.intern import Interner
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.ring_reader import read_counters
from mpcache.shm.segment import Segment

mode, name, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
segment = Segment.attach(name)
geometry = read_geometry(segment)
writer = RingWriter(segment)
pub = Publisher(writer, Interner(segment.buf, geometry.intern_capacity))
TRACE = "trace\n" * 40


def publish(i):
    """Event i carries the value i + 1 in one of its fields; the mix includes 1-, 2-, 3- and 8-cell records."""
    v, r = i + 1, i % 20
    if r < 14:
        return pub.emit_salted(E.L1_WRITE_FINISHED, "tenant%d" % (i % 3), "llama", v)
    if r < 17:
        return pub.emit(E.L2_STORE_COMPLETED, (0, v, "fs", 4096, 3, 0),
                        salt_counts={("tenant0", "llama"): 1, ("tenant1", "llama"): 2})
    if r < 19:
        return pub.emit(E.CB_LOOKUP_END, (256, 256, 128, 2, 1, v, False))
    return pub.emit(E.TIMEOUT_RAISED, ("MpcacheTimeoutError",), texts=(str(v), TRACE), session_id="req-%d" % i)


if mode == "publish":
    # Publish until the ring first overflows (the parent is not reading yet), say so, wait for
    # "go", then publish the rest while the parent reads.
    ok = drops = checksum = 0
    waited = k == 0
    for i in range(k):
        if publish(i):
            ok += 1
            checksum += i + 1
        else:
            drops += 1
            if not waited:
                print("full", flush=True)
                sys.stdin.readline()
                waited = True
    print(json.dumps({"ok": ok, "drops": drops, "checksum": checksum}), flush=True)
elif mode == "torn":
    # Commit k records and wait until they are read; then write a 3-cell record without storing
    # head (where a writer may write: the reader has freed the cells), report, and block.
    for i in range(k):
        assert pub.emit(E.CB_LOOKUP_START, (i,))
    print("committed", flush=True)
    sys.stdin.readline()
    head = read_counters(segment).head
    assert head + 3 - read_counters(segment).tail <= geometry.capacity
    for i in range(3):
        kind, index = (1, 3) if i == 0 else (2, i)
        offset = geometry.cells_offset + ((head + i) % geometry.capacity) * 64
        struct.pack_into("<IBBH7q", segment.buf, offset, writer.seq, kind, int(E.CB_LOOKUP_END), index, *[7] * 7)
    print("torn", flush=True)
    sys.stdin.readline()
'''


def start_child(mode: str, name: str, k: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, name, str(k)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def read_line(child: subprocess.Popen, deadline: float) -> bytes:
    """The child's next stdout line, or a failure naming its stderr once the deadline passes."""
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([child.stdout], [], [], max(0.0, remaining))
    line = child.stdout.readline() if ready else b""
    if not line:
        child.kill()
        pytest.fail(f"child sent nothing before the deadline; stderr: {child.stderr.read().decode()[-2000:]}")
    return line


def tell(child: subprocess.Popen, text: bytes) -> None:
    child.stdin.write(text)
    child.stdin.flush()


def finish(child: subprocess.Popen, deadline: float) -> dict:
    """Wait for the child to exit and return its JSON report."""
    out, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert 0 == child.returncode, err.decode()[-2000:]
    return json.loads(out.decode().strip().splitlines()[-1])


class Tally:
    """What the parent received from one ring: records, checksum, head sequence numbers."""

    def __init__(self, segment, intern_capacity: int) -> None:
        self.segment = segment
        self.reader = RingReader(segment)
        self.names = NameTable(segment.buf, intern_capacity)
        self.records = 0
        self.checksum = 0
        self.seqs: list[np.ndarray] = []
        self.l2_salts: dict[tuple[str, str], int] = {}

    def drain_once(self) -> int:
        cells = self.reader.read_batch()
        if len(cells) == 0:
            return 0
        batch = EventBatch(0, cells, self.names)
        self.records += len(batch)
        self.seqs.append(cells["seq"][cells["kind"] == layout.CELL_HEAD])
        self.checksum += sum(batch.salt_totals([E.L1_WRITE_FINISHED]).values())
        self.checksum += int(batch.field_column(E.L2_STORE_COMPLETED, "task_id").sum())
        self.checksum += int(batch.field_column(E.CB_LOOKUP_END, "stale_chunks").sum())
        for event in batch.events([E.TIMEOUT_RAISED]):
            assert "trace\n" * 40 == event.texts["stacktrace"]
            self.checksum += int(event.texts["message"])
        for pair, count in batch.salt_totals([E.L2_STORE_COMPLETED]).items():
            self.l2_salts[pair] = self.l2_salts.get(pair, 0) + count
        return len(batch)

    def head_seqs(self) -> list[int]:
        return np.concatenate(self.seqs).tolist() if self.seqs else []


def make_ring(segment_factory, capacity: int, intern_capacity: int = 64):
    segment = segment_factory(layout.event_segment_size(capacity, intern_capacity))
    format_event_segment(segment, capacity, intern_capacity)
    return segment


N_WRITERS = 3
K = 50_000
RING_CELLS = 1024


def test_concurrent_writers_account_for_every_event(segment_factory):
    """With N writers and a concurrent reader on small rings, received + dropped = published, per ring."""
    segments = [make_ring(segment_factory, RING_CELLS) for _ in range(N_WRITERS)]
    tallies = [Tally(segment, 64) for segment in segments]
    deadline = time.monotonic() + TIMEOUT_S
    children = [start_child("publish", segment.name, K) for segment in segments]
    try:
        for child in children:  # every ring has overflowed once before anyone reads
            assert b"full\n" == read_line(child, deadline)
        for child in children:
            tell(child, b"go\n")
        while True:
            all_exited = all(child.poll() is not None for child in children)
            received = sum(tally.drain_once() for tally in tallies)
            if all_exited and received == 0:
                break
            assert time.monotonic() < deadline, "writers did not finish before the deadline"
        reports = [finish(child, deadline) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)

    for report, tally in zip(reports, tallies):
        seqs = tally.head_seqs()
        counters = read_counters(tally.segment)
        assert K == report["ok"] + report["drops"]
        assert report["drops"] >= 1  # back-pressure happened
        assert (report["ok"], report["checksum"]) == (tally.records, tally.checksum)
        assert (report["drops"], 0, 0) == (counters.dropped, counters.torn, counters.malformed)
        assert counters.head > 4 * RING_CELLS  # several laps of the ring
        assert sorted(set(seqs)) == seqs and seqs[-1] < K  # in order, no duplicates
        n_l2 = tally.l2_salts.get(("tenant0", "llama"), 0)
        assert {("tenant0", "llama"): n_l2, ("tenant1", "llama"): 2 * n_l2} == tally.l2_salts


def test_writer_killed_mid_record_stalls_nothing(segment_factory):
    """A writer SIGKILLed inside a record: other rings keep flowing, the torn record is counted once,
    and a new writer continues the sequence and is read correctly."""
    torn_ring = make_ring(segment_factory, 16)
    live_ring = make_ring(segment_factory, 256)
    torn, live = Tally(torn_ring, 64), Tally(live_ring, 64)
    deadline = time.monotonic() + TIMEOUT_S
    victim = start_child("torn", torn_ring.name, 14)  # head at 14: the torn record wraps to cell 0
    survivor = start_child("publish", live_ring.name, 5_000)
    try:
        assert b"committed\n" == read_line(victim, deadline)
        committed = torn.drain_once()
        tell(victim, b"go\n")
        assert b"torn\n" == read_line(victim, deadline)
        torn_visible = torn.drain_once()  # the begun record is invisible and holds nothing up
        victim.kill()
        victim.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert b"full\n" == read_line(survivor, deadline)
        tell(survivor, b"go\n")
        while True:
            exited = survivor.poll() is not None
            received = live.drain_once() + torn.drain_once()
            if exited and received == 0:
                break
            assert time.monotonic() < deadline, "the surviving writer did not finish before the deadline"
        report = finish(survivor, deadline)
    finally:
        for child in (victim, survivor):
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)

    assert (14, 0, list(range(14))) == (committed, torn_visible, torn.head_seqs())
    assert (report["ok"], report["checksum"]) == (live.records, live.checksum)
    assert 5_000 == report["ok"] + report["drops"]
    assert [True, False] == [recover_torn_record(torn_ring), recover_torn_record(torn_ring)]

    writer = RingWriter(torn_ring)
    publisher = Publisher(writer, Interner(torn_ring.buf, 64))
    next_seq = writer.seq
    for n in range(3):
        assert publisher.emit(E.CB_LOOKUP_END, (n, 0, 0, 0, 0, 0, True))
    events = EventBatch(0, torn.reader.read_batch(), torn.names).events()
    counters = read_counters(torn_ring)

    assert 14 == next_seq
    assert [(14, 0), (15, 1), (16, 2)] == [(ev.seq, ev.fields["num_tokens"]) for ev in events]
    assert (1, 0, 0) == (counters.torn, counters.malformed, counters.dropped)
