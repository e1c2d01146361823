"""Fault injection against a real ``bin/start-cache`` process tree.

Every test kills or breaks something on purpose, then asserts numbers: what the clients were told was
stored equals what /metrics counts, and whatever could not be delivered is counted in
``lmcache_mp_event_bus_dropped_events_total`` (the ring's own counters are read from shared memory too,
so the metric is checked against the source it reports).  Every process started here is killed at
teardown, also when a test fails.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import secrets
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from support.service import CHUNK, SMALL, Scrape, Service, gone
from support.waiting import wait_for

from mpcache.client import CacheClient
from mpcache.contract.events import EventType
from mpcache.shm import layout
from mpcache.shm.ring import read_geometry
from mpcache.shm.ring_reader import read_counters
from mpcache.shm.segment import Segment

pytestmark = pytest.mark.slow

MODEL = "org/fault-model"


# -- a client workload with known counts --------------------------------------------------------------


_hash_bases = itertools.count(1)


class Load:
    """One client on one cache process, storing fresh 4-chunk requests from a thread and counting, per
    cache_salt, the chunks the server said it stored (``stored_count`` of each reply).

    ``tolerate_disconnect``: a lost connection ends the load quietly (for the tests that stop or kill the
    process it talks to); any other failure is recorded in ``errors``."""

    def __init__(self, socket_path: str, salts: tuple[str, ...], tolerate_disconnect: bool = False) -> None:
        self.client = CacheClient(socket_path)
        self.kv = self.client.register_buffer(4, CHUNK)
        self.kv.blocks[:] = np.random.default_rng(next(_hash_bases)).integers(0, 256, self.kv.blocks.shape)
        self.salts = itertools.cycle(salts)
        self.base = (secrets.randbits(40) << 20) | (next(_hash_bases) << 60)
        self.stored: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.errors: list[str] = []
        self.disconnected = False
        self._tolerate = tolerate_disconnect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            salt = next(self.salts)
            hashes = [self.base + 4 * n + i for i in range(4)]
            try:
                stored = self.client.store(self.kv, request_id=f"load-{self.base}-{n}", model_name=MODEL,
                                           cache_salt=salt, chunk_hashes=hashes, block_ids=[0, 1, 2, 3]).stored
            except (ConnectionError, BrokenPipeError) as exc:
                self.disconnected = True
                if not self._tolerate:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - recorded and asserted empty by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            self.stored[salt] += stored
            self.requests += 1

    def wait_requests(self, count: int, timeout_s: float = 30) -> None:
        wait_for(lambda: self.requests >= count or self.errors or self.disconnected, timeout_s,
                 f"{count} requests from the load")
        assert [] == self.errors

    def stop(self) -> Load:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load thread is stuck"
        try:
            self.client.close()
        except OSError:
            pass
        return self


def total(*loads: Load) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for load in loads:
        out.update(load.stored)
    return {salt: float(count) for salt, count in out.items() if count}


def drained_to(service: Service, expected: dict[str, float], timeout_s: float = 30) -> Scrape:
    """Wait until telemetry has drained every ring and L1 writes per cache_salt equal ``expected``."""

    def check():
        scrape = service.scrape()
        done = (scrape.total("lmcache_mp_event_bus_queue_depth") == 0
                and scrape.by_label("lmcache_mp_l1_write_chunks_total", "cache_salt") == expected)
        return scrape if done else None

    try:
        return wait_for(check, timeout_s, f"/metrics to count {expected}")
    except AssertionError:
        scrape = service.scrape()
        assert expected == scrape.by_label("lmcache_mp_l1_write_chunks_total", "cache_salt")
        raise


def ring_counters(service: Service, worker: int):
    """The ring's own bookkeeping words, read from shared memory."""
    segment = Segment.attach(service.config().ring_name(worker), layout.HEADER_SIZE)
    try:
        return read_counters(segment)
    finally:
        segment.close()


def round_trip(socket_path: str, salt: str, chunks: int = 3) -> int:
    """A fresh client stores ``chunks`` random chunks, prefetches and retrieves them into other blocks,
    and checks the bytes; returns the chunks stored."""
    with CacheClient(socket_path) as client:
        kv = client.register_buffer(2 * chunks, CHUNK)
        kv.blocks[:chunks] = np.random.default_rng().integers(0, 256, (chunks, CHUNK))
        hashes = [secrets.randbits(63) for _ in range(chunks)]
        stored = client.store(kv, request_id=f"rt-{hashes[0]}", model_name=MODEL, cache_salt=salt, chunk_hashes=hashes,
                              block_ids=list(range(chunks))).stored
        job = client.lookup_prefetch(request_id=f"rt-{hashes[0]}-r", model_name=MODEL, cache_salt=salt,
                                     chunk_hashes=hashes)
        assert chunks == client.wait_prefetch(job).found_count
        assert chunks == client.retrieve(kv, request_id=f"rt-{hashes[0]}-r", job_id=job,
                                         block_ids=list(range(chunks, 2 * chunks))).retrieved
        assert np.array_equal(kv.blocks[:chunks], kv.blocks[chunks:])
        client.end_session(f"rt-{hashes[0]}")
        client.end_session(f"rt-{hashes[0]}-r")
        del kv
    return stored


# -- the tests --------------------------------------------------------------------------------------


def test_telemetry_killed_under_load_loses_nothing_published_while_it_was_down(start_service) -> None:
    """kill -9 of the telemetry process while clients store: the supervisor starts a new one (a second
    ``child.started`` for telemetry, another pid), the cache processes keep serving without a single
    error, and after the load ends the new process's ``lmcache_mp_l1_write_chunks_total`` per cache_salt
    equals exactly what the clients stored over the whole run — before the kill, through the outage and
    after the restart: it went on from the killed one's checkpoint in the supervisor's state segment, no
    reset — with no ring overflow (0 dropped, on /metrics and in the rings) and no checkpoint refused.

    Method: the first phase is drained and checked, then the telemetry process is SIGSTOPped (nothing it
    read after its last checkpoint is released to the producers) and SIGKILLed while the load runs."""
    service = start_service("--workers", "2", *SMALL)
    service.ready(2)
    salts = ("tenant-a", "tenant-b", "tenant-c")
    phase1 = [Load(service.socket(w), salts).start() for w in range(2)]
    for load in phase1:
        load.wait_requests(30)
    drained_to(service, total(*[load.stop() for load in phase1]))
    [old] = service.pids("telemetry")

    os.kill(old, signal.SIGSTOP)
    loads = [Load(service.socket(w), salts).start() for w in range(2)]
    for load in loads:
        load.wait_requests(50)  # published while telemetry consumes nothing
    os.kill(old, signal.SIGKILL)
    new = wait_for(lambda: [p for p in service.pids("telemetry") if p != old], 30, "a new telemetry process")
    wait_for(service.scrape, 30, "/metrics from the new telemetry process")
    at_restart = [load.requests for load in loads]
    for load, before in zip(loads, at_restart):
        load.wait_requests(before + 50)  # and more after the restart
    expected = total(*phase1, *[load.stop() for load in loads])

    scrape = drained_to(service, expected)
    assert 0 == scrape.total("mpcache_telemetry_checkpoint_refused_total")
    assert [[], []] == [load.errors for load in loads]
    assert 2 == len(service.pids("telemetry")) and old not in new
    assert [-signal.SIGKILL] == [line["exit_status"] for line in service.lines("child.exited", child_role="telemetry")]
    assert (1, 1) == (len(service.pids("cache", 0)), len(service.pids("cache", 1)))
    assert 0 == scrape.total("lmcache_mp_event_bus_dropped_events_total")
    assert [(0, 0, 0), (0, 0, 0)] == [(c.dropped, c.torn, c.malformed) for c in map(
        lambda w: ring_counters(service, w), range(2))]
    assert 0 == service.stop()


def _write_torn_record(service: Service, worker: int) -> int:
    """Write the three cells of a record at the stopped writer's ``head`` without committing it (what a
    cache process killed between its cell writes and its head store leaves behind); returns ``head``."""
    segment = Segment.attach(service.config().ring_name(worker), layout.HEADER_SIZE)
    try:
        geometry = read_geometry(segment)
        counters = read_counters(segment)
        head, mask = counters.head, geometry.capacity - 1
        assert head + 3 - counters.tail <= geometry.capacity
        last_seq = int.from_bytes(segment.buf[geometry.cells_offset + ((head - 1) & mask) * 64:][:4], "little")
        seq = (last_seq + 1) & 0xFFFFFFFF  # the next record's sequence number (no drops: checked by the test)
        for i in range(3):
            kind, index = (layout.CELL_HEAD, 3) if i == 0 else (layout.CELL_FIELDS, i)
            offset = geometry.cells_offset + ((head + i) & mask) * 64
            segment.buf[offset:offset + 64] = (seq.to_bytes(4, "little") + bytes([kind, int(EventType.CB_LOOKUP_END)])
                                               + index.to_bytes(2, "little") + (7).to_bytes(8, "little") * 7)
        return head
    finally:
        segment.close()


def test_cache_process_killed_mid_record_is_restarted_and_the_torn_record_counted_once(start_service) -> None:
    """A cache process killed in the middle of publishing a record: the supervisor restarts it (a new
    pid), ``lmcache_mp_event_bus_dropped_events_total`` is exactly 1 (the torn record, also 1 in the ring's
    ``torn_records``), the other cache process's client kept storing without an error during the kill and
    restart, the restarted process serves a byte-exact store→retrieve, and every chunk any client was told
    it stored is counted per cache_salt.

    Method: the process is SIGSTOPped (so it cannot publish), the cells of a 3-cell record are written at
    its ring's head without storing head — what the writer does before its commit store — and it is
    SIGKILLed."""
    service = start_service("--workers", "2", *SMALL)
    service.ready(2)
    before_kill = round_trip(service.socket(0), "victim")
    survivor = Load(service.socket(1), ("bystander",)).start()
    survivor.wait_requests(20)
    [victim] = service.pids("cache", 0)
    os.kill(victim, signal.SIGSTOP)
    assert 0 == ring_counters(service, 0).dropped
    _write_torn_record(service, 0)
    os.kill(victim, signal.SIGKILL)
    at_kill = survivor.requests
    [restarted] = wait_for(lambda: [p for p in service.pids("cache", 0) if p != victim], 30,
                           "a new cache[0] process")
    wait_for(lambda: service.lines("cache.start", worker=0, pid=restarted), 30, "cache[0] to serve again")
    during_outage = survivor.requests - at_kill
    after_restart = round_trip(service.socket(0), "victim")
    survivor.wait_requests(survivor.requests + 20)
    expected = total(survivor.stop())
    expected["victim"] = float(before_kill + after_restart)

    scrape = drained_to(service, expected)
    assert [] == survivor.errors
    assert 0 < during_outage
    assert (3, 3) == (before_kill, after_restart)
    assert 1 == scrape.total("lmcache_mp_event_bus_dropped_events_total")
    assert [(0, 1, 0), (0, 0, 0)] == [(c.dropped, c.torn, c.malformed) for c in map(
        lambda w: ring_counters(service, w), range(2))]
    assert 1 == len(service.lines("ring.torn_record", worker=0))
    assert ([victim, restarted], 1) == (service.pids("cache", 0), len(service.pids("cache", 1)))
    assert 0 == service.stop()


def test_sigterm_under_load_exits_0_quickly_and_leaves_nothing_behind(start_service) -> None:
    """SIGTERM to the supervisor while clients store: exit status 0 within 15 s, every child exited 0
    (none had to be killed), the 6 segments of a 2-worker instance were unlinked (nothing of its pid is
    left in /dev/shm), and the runtime dir with its sockets is gone."""
    service = start_service("--workers", "2", *SMALL)
    service.ready(2)
    loads = [Load(service.socket(w), ("a", "b"), tolerate_disconnect=True).start() for w in range(2)]
    for load in loads:
        load.wait_requests(30)
    sockets = [Path(service.socket(w)) for w in range(2)]
    assert 6 == len(service.shm_entries())

    started = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    status = service.process.wait(30)
    elapsed = time.monotonic() - started
    for load in loads:
        load.stop()

    assert 0 == status
    assert elapsed <= 15.0, f"took {elapsed:.1f} s"
    assert [[], []] == [load.errors for load in loads]
    assert [] == service.shm_entries()
    assert [False, False, False] == [p.exists() for p in (*sockets, service.runtime_dir)]
    exits = {(line["child_role"], line["index"]): line["exit_status"] for line in service.lines("child.exited")}
    assert {("telemetry", 0): 0, ("cache", 0): 0, ("cache", 1): 0} == exits
    assert [] == service.lines("child.killed")
    assert [6] == [line["segments_removed"] for line in service.lines("supervisor.stopped")]


def test_supervisor_killed_children_exit_and_the_next_start_cleans_up(start_service) -> None:
    """kill -9 of the supervisor: its telemetry and cache processes notice they were orphaned and exit
    within 10 s (a client still connected); once the next start serves, nothing of the old pid is left in
    /dev/shm (its 5 segments, removed by that start or by any other start of this user on the machine:
    tests/e2e/test_runtime_isolation.py shows the next start removing them in a /dev/shm of its own), its
    runtime dir is gone, and the new instance serves /metrics and a byte-exact round trip."""
    old = start_service("--workers", "2", *SMALL, runtime_dir=False)
    old.ready(2)
    config = old.config()  # before the kill: its runtime dir goes at the next start
    children = [line["pid"] for line in old.lines("child.started")]
    with CacheClient(old.socket(0)) as client:
        client.register_buffer(1, CHUNK)
        old.process.kill()
        old.process.wait(10)
        wait_for(lambda: all(gone(pid) for pid in children), 10, "the orphaned children to exit")
    left = old.shm_entries()
    assert set(left) <= {name.lstrip("/") for name in config.all_segment_names()}

    new = start_service("--workers", "2", *SMALL, runtime_dir=False)
    new.ready(2)
    assert ([], False) == (old.shm_entries(), old.runtime_dir.exists())
    assert 3 == round_trip(new.socket(1), "after-crash")
    assert {"after-crash": 3.0} == drained_to(new, {"after-crash": 3.0}).by_label(
        "lmcache_mp_l1_write_chunks_total", "cache_salt")
    assert 0 == new.stop()


def test_failing_fs_tier_counts_failed_stores_and_l1_keeps_serving(start_service, tmp_path) -> None:
    """An fs L2 tier that cannot write: its store tasks end and are counted as failed, never as completed
    (``mpcache_l2_store_failed_requests_total`` moves by one per failed task, with its chunks in
    ``mpcache_l2_store_failed_chunks_total``; ``lmcache_mp_l2_store_completed_requests_total`` by one for the
    healthy task only), the keys they failed to write are not counted as stored (``l2_store_completed_objects``
    stays below ``l2_store_submitted_objects`` by exactly the failed chunks), and clients keep storing and
    retrieving byte-exact from L1 with the same cache process (no restart).

    Root-proof methods (tests run as root, so file modes stop nothing): (1) "disk full" — the cache
    process's soft RLIMIT_FSIZE is set to 0 with prlimit(2), so every chunk write fails with EFBIG, exactly as
    a write to a full disk fails with ENOSPC (Python ignores SIGXFSZ); (2) "unwritable directory" — after
    the limit is lifted, the adapter's directory is replaced by a regular file, so every path under it
    fails with ENOTDIR."""
    l2_dir = tmp_path / "l2"
    spec = json.dumps({"type": "fs", "path": str(l2_dir), "capacity_gb": 0.01})
    service = start_service("--workers", "1", *SMALL, "--l2", spec)
    service.ready(1)
    [cache_pid] = service.pids("cache", 0)
    socket_path = service.socket(0)

    def settled(submitted_requests: int) -> Scrape:
        def check():
            scrape = service.scrape()
            ended = (scrape.total("lmcache_mp_l2_store_completed_requests_total", l2_name="fs")
                     + scrape.total("mpcache_l2_store_failed_requests_total", l2_name="fs"))
            idle = (scrape.total("lmcache_mp_num_inflight_l2_stores") == 0
                    and scrape.total("lmcache_mp_event_bus_queue_depth") == 0
                    and ended == submitted_requests)
            return scrape if idle else None
        return wait_for(check, 30, f"{submitted_requests} L2 store tasks to end")

    assert 3 == round_trip(socket_path, "healthy")
    settled(1)
    cache = psutil.Process(cache_pid)
    _, hard = cache.rlimit(psutil.RLIMIT_FSIZE)
    cache.rlimit(psutil.RLIMIT_FSIZE, (0, hard))  # the soft limit: no privilege needed to lower or restore it
    assert 3 == round_trip(socket_path, "disk-full")
    settled(2)
    cache.rlimit(psutil.RLIMIT_FSIZE, (hard, hard))
    worker_dir = l2_dir / "worker-0"
    shutil.rmtree(worker_dir)
    worker_dir.write_bytes(b"not a directory")
    assert 3 == round_trip(socket_path, "dir-gone")
    scrape = settled(3)

    assert 3.0 == scrape.total("lmcache_mp_l2_store_submitted_requests_total")
    assert (1.0, 2.0, 6.0) == (scrape.total("lmcache_mp_l2_store_completed_requests_total", l2_name="fs"),
                               scrape.total("mpcache_l2_store_failed_requests_total", l2_name="fs"),
                               scrape.total("mpcache_l2_store_failed_chunks_total", l2_name="fs"))
    assert {"healthy": 3.0, "disk-full": 3.0, "dir-gone": 3.0} == scrape.by_label(
        "lmcache_mp_l2_store_submitted_objects_chunks_total", "cache_salt")
    assert 3.0 == scrape.total("lmcache_mp_l2_store_completed_objects_chunks_total")
    assert 3.0 == scrape.total("lmcache_mp_l2_store_completed_objects_chunks_total", cache_salt="healthy")
    assert {"healthy": 3.0, "disk-full": 3.0, "dir-gone": 3.0} == scrape.by_label(
        "lmcache_mp_l1_write_chunks_total", "cache_salt")
    assert ([cache_pid], 0.0) == (service.pids("cache", 0), scrape.total("lmcache_mp_event_bus_dropped_events_total"))
    assert 0 == service.stop()
