"""The telemetry process's checkpoint, in this process: a telemetry "process" (pump, bus, every metrics
subscriber, its own MeterProvider) that dies and one that goes on from the checkpoint export exactly what one that
never died exports, start times included; the checkpoint is written before anything exported shows it and
before the rings are released; what cannot be loaded is refused, logged once, counted, and is a reset."""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Histogram, HistogramDataPoint, InMemoryMetricReader, Sum

from mpcache.config import Config
from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.checkpoint import StateStore
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments
from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.checkpoint import Checkpoint, format_tag
from mpcache.telemetry.pump import Pump, RingSource
from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers, mrc

NOW = 1_800_000_000 * 10**9  # the pump's clock; events are published just before it, so nothing expires
SALTS = ("a", "b", "c")  # the cap is 2: "c" reads __overflow__ wherever it is capped


class Log:
    """The structlog calls the checkpoint makes, kept."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((level, event, fields))


def new_config(tmp_path, **changes: Any) -> Config:
    settings: dict[str, Any] = dict(
        instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir=str(tmp_path), workers=2,
        ring_capacity_cells=1 << 15, l1_size_bytes=1 << 16, chunk_bytes=1 << 16, prometheus_port=0, cache_salt_cap=2,
        mrc_sample_rate=1.0, mrc_half_life_s=0, telemetry_state_bytes=1 << 20, l2=[{"type": "mock", "capacity_gb": 1}],
        telemetry_checkpoint_interval_s=0,  # a record at every flush, unless a test says otherwise
        l1_policy="lru")  # LRU's curves, whose history is checkpointed (adaptive's miniatures restart empty)
    return Config(**(settings | changes))


@pytest.fixture
def provision(tmp_path) -> Iterator[Any]:
    """``provision(**config changes)``: an instance's shared memory, as the supervisor creates it."""
    made: list[Config] = []

    def make(**changes: Any) -> Config:
        made.append(new_config(tmp_path, **changes))
        create_segments(made[-1])
        return made[-1]

    yield make
    for config in made:
        unlink_segments(config)


class Telemetry:
    """One telemetry process's worth of objects over an instance's shared memory (never shut down: when it is
    dropped, it died)."""

    def __init__(self, config: Config) -> None:
        self.log = Log()
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.sources = [RingSource.attach(w, config.ring_name(w), max_batch_cells=64) for w in range(config.workers)]
        self.bus = EventBus(flush_interval_s=3600)  # flushed (and checkpointed) when a test says so
        self.pump = Pump(self.sources, self.bus, clock_ns=lambda: NOW)
        self.checkpoint = Checkpoint.open(config, self.log)
        build_metrics_subscribers(config, self.provider, pump=self.pump, bus=self.bus, gauge_reader=None,
                                  checkpoint=self.checkpoint)

    def drain(self) -> None:
        self.pump.drain()
        self.bus.flush()

    def points(self) -> dict[tuple[str, frozenset], Any]:
        """Every data point collected now, by (metric, attributes)."""
        out = {}
        for resource_metrics in self.reader.get_metrics_data().resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    for point in metric.data.data_points:
                        out[(metric.name, frozenset((point.attributes or {}).items()))] = point
        return out

    def value(self, name: str, **attributes: str) -> Any:
        point = self.points().get((name, frozenset(attributes.items())))
        return None if point is None else point.count if isinstance(point, HistogramDataPoint) else point.value

    def refusals(self) -> list[str]:
        return [fields["reason"] for level, event, fields in self.log.lines if event == "telemetry.checkpoint_refused"]


class Stream:
    """The cache processes' side: a seeded mix of every kind of record a metrics subscriber keeps state for."""

    def __init__(self, config: Config, seed: int) -> None:
        self._segments = [Segment.attach(config.ring_name(w), layout.HEADER_SIZE) for w in range(config.workers)]
        self._publishers = [Publisher(RingWriter(s), Interner(s.buf, read_geometry(s).intern_capacity))
                            for s in self._segments]
        self._rng = random.Random(seed)
        self._now = NOW - 10**9
        self._open: list[tuple[int, E, str]] = []

    def publish(self, records: int) -> None:
        rng, emit = self._rng, None
        for _ in range(records):
            worker = rng.randrange(len(self._publishers))
            emit = self._publishers[worker].emit
            self._now += 1000
            salt, model = rng.choice(SALTS), rng.choice(("m1", "m2"))
            key = (rng.randrange(40), salt, model)
            kind = rng.randrange(12)
            if kind < 3:
                etype = (E.L1_WRITE_FINISHED, E.L1_READ_FINISHED, E.L1_KEYS_EVICTED)[kind]
                emit(etype, salt_counts={(salt, model): rng.randint(1, 4)}, sampled=[key], timestamp_ns=self._now)
            elif kind < 5:
                etype = (E.SM_WRITE_FINISHED, E.SM_READ_PREFETCHED_FINISHED)[kind - 3]
                emit(etype, (0,), salt_counts={(salt, model): rng.randint(1, 4)}, sampled=[key], timestamp_ns=self._now)
            elif kind == 5:
                session = f"r{rng.randrange(6)}"
                if rng.random() < 0.5:
                    emit(E.MP_STORE_START, ("cpu", worker, model), session_id=session, timestamp_ns=self._now)
                else:
                    emit(E.MP_STORE_END, ("cpu", worker, model, 1, 4096, 256), session_id=session,
                         timestamp_ns=self._now)
            elif kind == 6:
                task = rng.randrange(5)
                if rng.random() < 0.5:
                    emit(E.L2_STORE_SUBMITTED, (0, task, "mock", 1, 4096), salt_counts={(salt, model): 1},
                         timestamp_ns=self._now)
                else:
                    emit(E.L2_STORE_COMPLETED, (0, task, "mock", 4096, 1, 0), salt_counts={(salt, model): 1},
                         timestamp_ns=self._now)
            elif kind == 7:
                request, block = f"q{rng.randrange(4)}", rng.randrange(8)
                if rng.random() < 0.7:
                    emit(E.MP_VLLM_BLOCK_ALLOCATION, (1, model, 1, 1), blocks=[(request, block, rng.randrange(3))],
                         timestamp_ns=self._now)
                else:
                    emit(E.MP_VLLM_END_SESSION, session_id=request, timestamp_ns=self._now)
            elif kind == 8:
                counts = [rng.randrange(3) for _ in range(15)]
                total = sum(counts) or 1
                counts[0] += total - sum(counts)
                emit(E.LMCACHE_REQUEST_TIMES, (rng.choice(("lookup", "store", "x")), total, 40_000 * total, 10_000,
                                               90_000, *counts))
            elif kind == 9:
                emit(E.MRC_STORE_SAMPLED, (model, salt, 1, 4096), sampled=[key])
            elif kind == 10:
                heads = [rng.randrange(40) for _ in MRC_HEAD_FIELDS + MRC_TAIL_MARK_FIELDS]
                emit(E.MRC_LOOKUP_SAMPLED, (model, salt, 1, rng.randrange(3), rng.randrange(2), 2, 0, 0, 0, *heads),
                     sampled=[key])
            else:
                emit(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, rng.random() < 0.5))

    def close(self) -> None:
        del self._publishers
        for segment in self._segments:
            segment.close()


def monotonic(telemetry: Telemetry) -> set[str]:
    """The names of the counters and histograms ``telemetry`` exports (not its gauges, which may go down)."""
    return {metric.name for resource_metrics in telemetry.reader.get_metrics_data().resource_metrics
            for scope_metrics in resource_metrics.scope_metrics for metric in scope_metrics.metrics
            if isinstance(metric.data, Histogram) or (isinstance(metric.data, Sum) and metric.data.is_monotonic)}


def same(expected: dict, got: dict) -> dict:
    """The points that differ (a float sum to its rounding: batches add in another order), but the size of the
    last checkpoint written."""
    def fields(point: Any) -> tuple:
        if isinstance(point, HistogramDataPoint):
            return point.count, tuple(point.bucket_counts), round(point.sum, 6), point.min, point.max
        return (round(point.value, 6),)

    keys = {key for key in set(expected) | set(got) if key[0] != "mpcache.telemetry_checkpoint_bytes"}
    return {key: (expected.get(key) and fields(expected[key]), got.get(key) and fields(got[key]))
            for key in keys if key not in expected or key not in got or fields(expected[key]) != fields(got[key])}


def test_a_restart_from_the_checkpoint_exports_what_an_uninterrupted_process_does(provision, monkeypatch):
    """Two instances get the same records.  One telemetry process reads them all.  In the other, a first
    process reads the first part and checkpoints, reads on past the checkpoint and dies; a second one loads the
    checkpoint, reads the rest (the part the first read after its checkpoint again).  Every point — counters,
    histograms (buckets, sums, extremes), the miss-ratio curves, the observable counters — is the same, and
    every stream the first process exported keeps its start time.  (The curves' history is taken at every
    checkpoint here; by default at most once a minute: see the next test.)"""
    monkeypatch.setattr(mrc, "HISTORY_EVERY_S", 0.0)
    straight, interrupted = provision(), provision()
    streams = [Stream(config, seed=1) for config in (straight, interrupted)]
    reference, first = Telemetry(straight), Telemetry(interrupted)
    for stream in streams:
        stream.publish(1500)
    reference.drain()
    first.drain()  # checkpointed
    for stream in streams:
        stream.publish(1500)
    for _ in range(5):
        first.pump.poll_once()  # read on past the checkpoint, then die
    started = {key: point.start_time_unix_nano for key, point in first.points().items()}
    second = Telemetry(interrupted)
    for stream in streams:
        stream.publish(500)
    reference.drain()
    second.drain()
    for stream in streams:
        stream.close()

    expected, got = reference.points(), second.points()
    assert {} == same(expected, got)
    assert {} == {key: (start, got[key].start_time_unix_nano) for key, start in started.items()
                  if getattr(got[key], "start_time_unix_nano", start) != start}
    assert ([], True) == (second.refusals(), len(started) > 100)


def test_the_curves_history_is_taken_at_most_every_history_interval(provision, monkeypatch):
    """Between two takes of the curves' history (the tracked and forgotten keys), checkpoints carry the last one
    taken: a restart then goes on from that older history, while the curves and the miss counters are those of
    the last checkpoint.  Nothing exported goes down."""
    monkeypatch.setattr(mrc, "HISTORY_EVERY_S", 3600.0)
    config = provision()
    stream, first = Stream(config, seed=6), Telemetry(config)  # its first checkpoint takes the (empty) history
    stream.publish(1500)
    first.drain()
    before = first.points()
    tracked = [s for s in first.bus.subscribers if isinstance(s, mrc.MissRatioSubscriber)][0].curves.tracked_keys
    second = Telemetry(config)
    restored = [s for s in second.bus.subscribers if isinstance(s, mrc.MissRatioSubscriber)][0].curves.tracked_keys
    stream.close()

    assert {} == same(before, second.points())
    assert (0, True) == (restored, tracked > 0)


def test_the_checkpoint_is_written_before_the_sdk_shows_it_and_before_the_rings_are_released(provision):
    """At the moment a record is written, what the SDK exports and the rings' release are still those of the
    record before; right after the flush, both follow."""
    config = provision()
    stream, telemetry = Stream(config, seed=2), Telemetry(config)
    segments = [source.segment for source in telemetry.sources]
    seen: list[tuple[Any, list[int]]] = []
    write = telemetry.checkpoint._store.write

    def spying(payload: bytes, tag: bytes) -> int:
        seen.append((telemetry.value("lmcache_mp.l1_eviction_loop_ticks"), [read_counters(s).tail for s in segments]))
        return write(payload, tag)

    telemetry.checkpoint._store.write = spying  # type: ignore[method-assign]
    stream.publish(800)
    telemetry.pump.drain()
    before = (telemetry.value("lmcache_mp.l1_eviction_loop_ticks"), [read_counters(s).tail for s in segments])
    telemetry.bus.flush()
    after = (telemetry.value("lmcache_mp.l1_eviction_loop_ticks"), [read_counters(s).tail for s in segments])
    stream.close()

    assert [before] == seen
    assert after[0] > before[0] and all(a > b for a, b in zip(after[1], before[1]))
    assert [read_counters(s).head for s in segments] == after[1]


def test_a_ring_is_released_once_a_quarter_of_it_is_held_and_at_every_poll_once_half_full(provision):
    """No flush and no checkpoint is due by time here: a ring holding a quarter of its cells read is released (a
    checkpoint is written, then the tail moves) and the rest held; a ring half full from its producer's side is
    released at every poll, so what was read never makes a backlog overflow."""
    config = provision(telemetry_checkpoint_interval_s=3600)
    telemetry = Telemetry(config)
    stream = Stream(config, seed=7)
    quarter = config.ring_capacity_cells // 4
    segment = telemetry.sources[0].segment
    for _ in range(quarter + 500):
        assert stream._publishers[0].emit(E.L1_EVICTION_LOOP_TICK, (0.5, 0.8, False))
    telemetry.pump.drain()
    counters = read_counters(segment)
    held = (quarter <= counters.tail < counters.head, telemetry.checkpoint._store._sequence)
    for _ in range(config.ring_capacity_cells // 2):
        assert stream._publishers[0].emit(E.L1_EVICTION_LOOP_TICK, (0.5, 0.8, False))
    telemetry.pump.poll_once()
    stream.close()

    assert (True, 2) == held  # the first checkpoint (at start) and the one a quarter asked for
    assert telemetry.sources[0].reader.position[0] == read_counters(segment).tail


def test_a_flush_exports_and_a_record_is_written_only_once_the_interval_has_passed(provision):
    """--telemetry-checkpoint-interval 10: the first flush writes a record; one 5 s later exports (the SDK shows
    every record read, each ring marks how far it was exported) but writes none and releases nothing; the one at
    10 s writes the next record and releases the rings up to it."""
    config = provision(telemetry_checkpoint_interval_s=10)
    stream, telemetry = Stream(config, seed=9), Telemetry(config)
    now = [0.0]
    telemetry.checkpoint._clock = lambda: now[0]
    telemetry.checkpoint._recorded_at = 0.0  # the record of the start, written at 0
    segments = [source.segment for source in telemetry.sources]

    def state() -> tuple[Any, int, list[int], list[int]]:
        words = [struct.unpack_from("<Q", segment.buf, layout.OFF_EXPORTED)[0] for segment in segments]
        return (telemetry.value("lmcache_mp.l1_eviction_loop_ticks"), telemetry.checkpoint._store._sequence,
                [read_counters(segment).tail for segment in segments], words)

    stream.publish(400)
    now[0] = 5.0
    telemetry.drain()
    between = state()
    read = [source.reader.position[0] for source in telemetry.sources]
    stream.publish(400)
    now[0] = 10.0
    telemetry.drain()
    after = state()
    stream.close()

    assert (1, [0, 0], read) == between[1:] and between[0] > 0
    assert (2, [read_counters(segment).head for segment in segments]) == (after[1], after[2]) == (2, after[3])
    assert after[0] > between[0]


def test_a_restart_between_checkpoints_reads_on_as_far_as_the_one_gone_exported_before_it_exports(provision):
    """One cache process (one ring: its records are read in one order, whatever the batches).  The first
    telemetry process checkpoints only at its start (interval 3600 s), exports twice, reads on and dies.  The
    second, once built (before anything of it is exported), shows no value below what the first exported, having
    read the ring again from the record's position; it then exports exactly what a process that never died does,
    with the first one's start times.  The ring was never released past the record."""
    straight = provision(workers=1)
    interrupted = provision(workers=1, telemetry_checkpoint_interval_s=3600)
    streams = [Stream(config, seed=10) for config in (straight, interrupted)]
    reference, first = Telemetry(straight), Telemetry(interrupted)
    for stream in streams:
        stream.publish(1000)
    first.drain()
    for stream in streams:
        stream.publish(1000)
    first.drain()
    exported = first.points()
    for stream in streams:
        stream.publish(500)
    for _ in range(5):
        first.pump.poll_once()  # read, aggregated, not exported: then killed
    tail = read_counters(first.sources[0].segment).tail
    second = Telemetry(interrupted)
    at_start = second.points()
    for stream in streams:
        stream.publish(300)
    reference.drain()
    second.drain()
    for stream in streams:
        stream.close()

    def count(point: Any) -> float:
        return point.count if isinstance(point, HistogramDataPoint) else point.value

    lower = {key: (count(point), at_start.get(key) and count(at_start[key])) for key, point in exported.items()
             if key[0] in monotonic(first) and (key not in at_start or count(at_start[key]) < count(point))}
    read_on = [fields["records"] for _, event, fields in second.log.lines if event == "telemetry.checkpoint_read_on"]
    assert ({}, 0, 1) == (lower, tail, first.checkpoint._store._sequence)
    assert len(read_on) == 1 and read_on[0] >= 2000
    assert {} == same(reference.points(), second.points())
    assert {} == {key: point.start_time_unix_nano for key, point in exported.items()
                  if getattr(point, "start_time_unix_nano", None) not in (None, getattr(
                      second.points().get(key), "start_time_unix_nano", None))}


def test_a_ring_that_fills_while_telemetry_is_down_loses_only_what_was_counted_as_dropped(provision):
    """The killed process had read past its checkpoint; then the producer fills the ring: it can only fill up
    to the checkpoint's position (nothing read after it was released), so the new process reads every record
    that was published, and what did not fit is counted as dropped — the ring's own count, in
    dropped_events_total."""
    config = provision(ring_capacity_cells=1024)
    first, stream = Telemetry(config), Stream(config, seed=8)
    publish = stream._publishers[0].emit
    published = sum(publish(E.L1_EVICTION_LOOP_TICK, (0.5, 0.8, True)) for _ in range(300))
    first.drain()
    published += sum(publish(E.L1_EVICTION_LOOP_TICK, (0.5, 0.8, True)) for _ in range(200))
    first.pump.poll_once()  # read, aggregated, not checkpointed: then killed
    attempts = 2000
    more = sum(publish(E.L1_EVICTION_LOOP_TICK, (0.5, 0.8, True)) for _ in range(attempts))
    second = Telemetry(config)
    second.drain()
    stream.close()

    assert (True, published + more) == (more < attempts, second.value("lmcache_mp.l1_eviction_loop_ticks"))
    assert attempts - more == second.value("lmcache_mp.event_bus.dropped_events_total") == read_counters(
        second.sources[0].segment).dropped


def _corrupt(config: Config) -> None:
    segment = Segment.attach(config.telemetry_state_name())
    for record in (0, 1):
        segment.buf[layout.state_record_offset(record, config.telemetry_state_bytes) + layout.REC_HEADER_SIZE] ^= 0xFF
    segment.close()


def _undecodable(config: Config) -> None:
    segment = Segment.attach(config.telemetry_state_name())
    store = StateStore(segment)
    store.latest(format_tag(config))
    store.write(msgpack.packb({"started": 1}), format_tag(config))
    segment.close()


def _released_past(config: Config) -> None:
    """Another reader consumes (and releases) what the checkpoint's positions still cover."""
    for worker in range(config.workers):
        segment = Segment.attach(config.ring_name(worker), layout.HEADER_SIZE)
        reader = RingReader(segment)
        while len(reader.read_batch()):
            pass
        del reader
        segment.close()


def _unformatted(config: Config) -> None:
    segment = Segment.attach(config.telemetry_state_name())
    segment.buf[0:8] = b"garbage!"
    segment.close()


@pytest.mark.parametrize("reason, damage", [("corrupt", _corrupt), ("invalid", _undecodable),
                                            ("stale", _released_past), ("format", _unformatted), ("foreign", None)])
def test_a_checkpoint_that_cannot_be_loaded_is_refused_logged_once_counted_and_a_reset(provision, reason, damage):
    """The next process logs one error line naming the reason, counts it in
    mpcache_telemetry_checkpoint_refused_total{reason}, and counts from zero; the one after it loads its
    checkpoint, the refusal still counted.  (foreign: a process of another configuration reads the record.)"""
    config = provision()
    stream = Stream(config, seed=3)
    stream.publish(600)
    first = Telemetry(config)
    first.drain()
    stream.publish(200)
    if damage is not None:
        damage(config)
    reader = config if damage is not None else dataclasses.replace(config, cache_salt_cap=3)
    second = Telemetry(reader)
    second.drain()
    stream.publish(100)
    third = Telemetry(reader)
    third.drain()
    stream.close()
    ticks = [t.value("lmcache_mp.l1_eviction_loop_ticks") for t in (first, second, third)]

    assert ([reason], [], 1) == (second.refusals(), third.refusals(),
                                 third.value("mpcache.telemetry_checkpoint_refused", reason=reason))
    assert 1 == len([line for line in second.log.lines if line[0] == "error"])
    assert ticks[1] < ticks[0] and ticks[1] <= ticks[2]  # a reset, then counting on from its checkpoint


def test_a_state_larger_than_a_record_is_counted_the_rings_released_anyway_and_a_restart_refuses(provision,
                                                                                                 monkeypatch):
    """The records hold 64 KiB and the state outgrows them: each flush counts a failure (logged once) and still
    releases the rings, so the producers never wait; the next process refuses the last record written as stale."""
    monkeypatch.setattr(mrc, "HISTORY_EVERY_S", 0.0)
    config = provision(telemetry_state_bytes=1 << 16, mrc_max_keys=1 << 16)
    stream, telemetry = Stream(config, seed=4), Telemetry(config)
    rng = random.Random(5)
    for _ in range(3):
        for publisher in stream._publishers:
            for _ in range(2000):
                publisher.emit(E.MRC_STORE_SAMPLED, ("m", "a", 1, 4096), sampled=[(rng.getrandbits(63), "a", "m")])
        telemetry.drain()
    segments = [source.segment for source in telemetry.sources]
    stream.publish(50)
    second = Telemetry(config)
    stream.close()

    assert (True, 1) == (telemetry.checkpoint.failures >= 3,
                         len([line for line in telemetry.log.lines if line[1] == "telemetry.checkpoint_failed"]))
    assert all(read_counters(s).head - 50 * 4 <= read_counters(s).tail for s in segments)
    assert ["stale"] == second.refusals()


def test_the_state_segment_layout_is_pinned(provision):
    """Header: MPCSTATE, version 1, 2 records, their capacity; a record: u64 number, u64 length, 16-byte tag,
    u64 wall-clock ns, u32 CRC-32 of those 40 bytes and the payload, at 64 + (64 + capacity) × index."""
    import zlib

    config = provision()
    segment = Segment.attach(config.telemetry_state_name())
    store = StateStore(segment)
    store.latest(b"t" * 16)
    store.write(b"payload", b"t" * 16)
    number, length, tag, _written = struct.unpack_from("<QQ16sQ", segment.buf, 64)
    (checksum,) = struct.unpack_from("<I", segment.buf, 104)

    assert b"MPCSTATE" + struct.pack("<IIQ", 1, 2, 1 << 20) == bytes(segment.buf[:24])
    assert (1, 7, b"t" * 16, b"payload") == (number, length, tag, bytes(segment.buf[128:135]))
    assert zlib.crc32(b"payload", zlib.crc32(bytes(segment.buf[64:104]))) == checksum
    assert 64 + 64 + (1 << 20) == layout.state_record_offset(1, 1 << 20)
    del store
    segment.close()
