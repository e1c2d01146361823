"""``kill -9`` of the telemetry process at random instants — some while it writes its checkpoint — and nothing it
counted is lost or counted twice.

The test is the cache processes here: it publishes a known workload into the rings the supervisor's provisioning
made, tallying what it published (never what telemetry reports), and runs the telemetry process itself, so it
can kill and restart it at once (under the supervisor a crash-looping telemetry process waits up to 30 s).
Most processes run with the default --telemetry-checkpoint-interval (10 s), so they export (at every scrape and
OTLP export) far past their last checkpoint and the next one reads the rings on from it; every third one writes
a checkpoint at every flush, and is killed while writing one.
After every restart, with the workload paused, every exported counter and histogram count equals the tally —
on /metrics and in the last OTLP export — and over the whole run no value ever went down between two scrapes
or two exports, no OTLP stream changed its start time, and a real Prometheus scraping throughout (when its
binary is installed) counts no reset: ``resets()`` is 0 for every series.  The workload crosses every
restart: chunks written before a kill are evicted after it (their lifetime histograms need the lifecycle
state), copies started before a kill end after it (the throughput histogram needs the pending STARTs), and
bursts are published while the telemetry process is down.
"""

from __future__ import annotations

import collections
import http.server
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_port
from support.prometheus import PROMETHEUS, PrometheusServer
from support.service import Scrape
from support.waiting import wait_for

from mpcache.config import Config
from mpcache.contract.events import EventType as E
from mpcache.httpserver import get_unix
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments

pytestmark = pytest.mark.slow

KILLS = 21
WORKERS = 2
SALTS = ("tenant-a", "tenant-b", "tenant-c")
MODEL = "org/checkpoint-model"
LIFETIME_NS = 2 * 10**9  # every sampled chunk is evicted 2 s (producer time) after its write: bucket le=2.5
COPY_BYTES, COPY_NS = 1 << 20, 10**6  # every store copy: 1 MiB in 1 ms = 1.048576 GB/s: bucket le=2.0
# one LMCACHE_REQUEST_TIMES event: two requests of 0.4 ms (bucket le=0.0005) and one of 4 ms (le=0.005)
REQUEST_TIMES = ("lookup", 3, 4_800_000, 400_000, 4_000_000, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)
HISTOGRAMS = ("lmcache_mp_l1_chunk_lifetime_seconds", "lmcache_mp_l1_chunk_idle_before_evict_seconds",
              "lmcache_mp_l1_chunk_evict_reuse_gap_seconds", "lmcache_mp_l0_l1_store_throughput_GBs",
              "mpcache_lmcache_request_seconds")
# what an OTLP receiver calls the tallied Prometheus samples (a counter's value, a histogram's count)
OTEL_NAMES = {"lmcache_mp_l1_write_chunks_total": "lmcache_mp.l1_write",
              "lmcache_mp_l1_evicted_chunks_total": "lmcache_mp.l1_evicted",
              "lmcache_mp_l1_chunk_lifetime_seconds_count": "lmcache_mp.l1_chunk_lifetime",
              "lmcache_mp_l1_chunk_idle_before_evict_seconds_count": "lmcache_mp.l1_chunk_idle_before_evict",
              "lmcache_mp_l1_chunk_evict_reuse_gap_seconds_count": "lmcache_mp.l1_chunk_evict_reuse_gap",
              "lmcache_mp_l0_l1_store_throughput_GBs_count": "lmcache_mp.l0_l1_store_throughput",
              "mpcache_lmcache_request_seconds_count": "mpcache.lmcache.request"}


def per_process(name: str) -> bool:
    """The service's processes' own CPU and context switches (prometheus_client's process_* and the Processes
    section's): a new telemetry process counts its own from 0, and they are not what the workload published."""
    return name == "process_cpu_seconds_total" or name.startswith("mpcache_process_")


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


class Workload:
    """The cache processes' side: records published into the rings, and what they add up to."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self._segments = [Segment.attach(config.ring_name(w), layout.HEADER_SIZE) for w in range(WORKERS)]
        self._publishers = [Publisher(RingWriter(s), Interner(s.buf, read_geometry(s).intern_capacity))
                            for s in self._segments]
        self._rng = rng
        self._now = time.time_ns() - 3600 * 10**9  # L1's clock, an hour ago: evictions pass the 300 s reuse cap
        self._hash = 1
        self._live: list[list[tuple[int, str, int]]] = [[] for _ in range(WORKERS)]  # (chunk, salt, written ns)
        self._open: list[list[tuple[str, int]]] = [[] for _ in range(WORKERS)]  # (session, started ns)
        self.expected: collections.Counter[tuple[str, frozenset[tuple[str, str]]]] = collections.Counter()

    def _emit(self, worker: int, etype: E, *args: object, **kwargs: object) -> None:
        assert self._publishers[worker].emit(etype, *args, **kwargs), "a record was dropped: the rings are too small"

    def burst(self, requests: int) -> None:
        """``requests`` requests' records, each on a random cache process: a store that writes a new sampled
        chunk, the eviction of a chunk written earlier (before a kill, often), a copy whose START may wait for
        a later burst, and LMCache service times."""
        for _ in range(requests):
            worker, salt = self._rng.randrange(WORKERS), self._rng.choice(SALTS)
            self._now += 10**6
            chunks = self._rng.randint(1, 8)
            self._hash += 1
            self._emit(worker, E.L1_WRITE_FINISHED, salt_counts={(salt, MODEL): chunks},
                       sampled=[(self._hash, salt, MODEL)], timestamp_ns=self._now)
            self._live[worker].append((self._hash, salt, self._now))
            self.expected[_key("lmcache_mp_l1_write_chunks_total", cache_salt=salt)] += chunks
            if len(self._live[worker]) > 50 and self._rng.random() < 0.8:
                chunk, evicted_salt, written = self._live[worker].pop(self._rng.randrange(50))
                self._emit(worker, E.L1_KEYS_EVICTED, salt_counts={(evicted_salt, MODEL): 1},
                           sampled=[(chunk, evicted_salt, MODEL)], timestamp_ns=written + LIFETIME_NS)
                self.expected[_key("lmcache_mp_l1_evicted_chunks_total", cache_salt=evicted_salt)] += 1
                for name, le in (("lmcache_mp_l1_chunk_lifetime_seconds", "2.5"),
                                 ("lmcache_mp_l1_chunk_idle_before_evict_seconds", "2.5"),
                                 ("lmcache_mp_l1_chunk_evict_reuse_gap_seconds", "300.0")):
                    self.expected[_key(f"{name}_count")] += 1
                    self.expected[_key(f"{name}_bucket", le=le)] += 1
            if self._open[worker] and self._rng.random() < 0.5:
                session, started = self._open[worker].pop(0)
                self._emit(worker, E.MP_STORE_END, ("cpu", worker, MODEL, 1, COPY_BYTES, 256), session_id=session,
                           timestamp_ns=started + COPY_NS)
                labels = {"engine_id": str(worker), "device": "cpu", "model_name": MODEL}
                self.expected[_key("lmcache_mp_num_finished_stores_total", device="cpu")] += 1
                self.expected[_key("lmcache_mp_l0_l1_store_throughput_GBs_count", **labels)] += 1
                self.expected[_key("lmcache_mp_l0_l1_store_throughput_GBs_bucket", **labels, le="2.0")] += 1
            else:  # at the wall clock's time: a START older than a minute is given up on
                session, started = f"s{self._hash}", time.time_ns()
                self._emit(worker, E.MP_STORE_START, ("cpu", worker, MODEL), session_id=session, timestamp_ns=started)
                self._open[worker].append((session, started))
            if self._rng.random() < 0.2:
                self._emit(worker, E.LMCACHE_REQUEST_TIMES, REQUEST_TIMES, timestamp_ns=self._now)
                self.expected[_key("mpcache_lmcache_request_seconds_count", op="lookup")] += 3
                self.expected[_key("mpcache_lmcache_request_seconds_bucket", op="lookup", le="0.0005")] += 2
                self.expected[_key("mpcache_lmcache_request_seconds_bucket", op="lookup", le="0.005")] += 3

    def read_ahead(self) -> bool:
        """Whether the telemetry process holds records it read and has not released yet (no checkpoint covers
        them: its next one will)."""
        return any(struct.unpack_from("<Q", s.buf, layout.OFF_READ) > struct.unpack_from("<Q", s.buf, layout.OFF_TAIL)
                   for s in self._segments)

    def trickle(self, stop: threading.Event) -> None:
        """Bursts of a few requests, about a thousand records a second, until ``stop``."""
        while not stop.is_set():
            self.burst(5)
            stop.wait(0.002)

    def close(self) -> None:
        del self._publishers
        for segment in self._segments:
            segment.close()


def differences(scrape: Scrape, expected: collections.Counter) -> dict[tuple, tuple[float, float]]:
    """(got, expected) of every counter and histogram count that is not what was published: the tallied ones,
    every other counter (0), and the histogram families (only those the workload feeds have samples)."""
    got: dict[tuple, float] = {}
    for name, samples in scrape.samples.items():
        if per_process(name):
            continue
        for labels, value in samples:
            key = (name, frozenset(labels.items()))
            if name.endswith("_total") or name.endswith("_count") or key in expected:
                got[key] = value
    wrong = {key: (got.get(key, 0.0), want) for key, want in expected.items() if got.get(key) != want}
    wrong |= {key: (value, 0) for key, value in got.items() if key not in expected and value != 0}
    families = {name.removesuffix("_count") for name, _ in got if name.endswith("_count")}
    if families != set(HISTOGRAMS):
        wrong[("histogram families", frozenset())] = (len(families), len(HISTOGRAMS))
    return wrong


class Telemetry:
    """``python -m mpcache.telemetry`` on the test's configuration: started, scraped, killed, restarted."""

    def __init__(self, config_path: Path, socket_path: str, stderr: Path) -> None:
        self._argv = [sys.executable, "-m", "mpcache.telemetry", "--config", str(config_path)]
        self.socket_path = socket_path  # its endpoint, which the supervisor's front would forward to
        self._stderr = stderr
        self.process: subprocess.Popen[bytes] | None = None
        self.last: dict[tuple, float] = {}  # the highest value of every monotonic sample scraped so far
        self.scrapes = 0

    def start(self) -> None:
        with open(self._stderr, "ab") as stderr:
            self.process = subprocess.Popen(self._argv, stderr=stderr, stdout=subprocess.DEVNULL)
        wait_for(self.scrape, 30, "/metrics of the new telemetry process")

    def scrape(self) -> Scrape:
        """One scrape, checked against every one before: no counter, bucket, count or sum went down."""
        status, body = get_unix(self.socket_path, "/metrics", 5)
        if status != 200:
            raise OSError(f"/metrics answered {status}")
        scrape = Scrape(body.decode())
        for name, samples in scrape.samples.items():
            if per_process(name) or not name.endswith(("_total", "_bucket", "_count", "_sum")):
                continue
            for labels, value in samples:
                key = (name, frozenset(labels.items()))
                assert value >= self.last.get(key, 0.0), f"{name}{labels} went down: {self.last[key]} -> {value}"
                self.last[key] = value
        self.scrapes += 1
        return scrape

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class StateRecords:
    """The state segment's two record headers, read the way a killer watching for a write in progress does."""

    def __init__(self, config: Config) -> None:
        self._segment = Segment.attach(config.telemetry_state_name())
        self._offsets = [layout.state_record_offset(i, config.telemetry_state_bytes) for i in range(2)]

    def being_written(self) -> bool:
        """A record written before is being written again: its number is 0, its length still the old one's."""
        for offset in self._offsets:
            sequence, length = struct.unpack_from("<QQ", self._segment.buf, offset)
            if sequence == 0 and length:
                return True
        return False

    def close(self) -> None:
        self._segment.close()


def kill_during_a_checkpoint(telemetry: Telemetry, records: StateRecords, workload: Workload) -> bool:
    """Make the telemetry process checkpoint again and again (each scrape flushes, which writes one) and kill it
    the moment a record is seen half written while it holds records read and not released (the checkpoint being
    written is the first to cover them); whether that moment came."""
    stop = threading.Event()

    def scrape_on() -> None:
        while not stop.is_set():
            try:
                telemetry.scrape()
            except OSError:
                return  # killed

    scraper = threading.Thread(target=scrape_on, daemon=True)
    scraper.start()
    deadline = time.monotonic() + 10
    caught = False
    while not caught and time.monotonic() < deadline:
        caught = records.being_written() and workload.read_ahead()
    telemetry.kill()
    stop.set()
    scraper.join(10)
    return caught


def settled(telemetry: Telemetry, expected: collections.Counter) -> dict[tuple, tuple[float, float]]:
    """Scrape until every value is what was published (the workload paused; a new telemetry process reads the
    rings again from its checkpoint's positions); the differences left after 30 s."""
    last: dict[tuple, tuple[float, float]] = {}

    def matches() -> bool:
        last.clear()
        last.update(differences(telemetry.scrape(), expected))
        return not last

    try:
        wait_for(matches, 30, "the counters to equal what was published")
    except AssertionError:
        pass
    return last


def otlp_streams(receiver) -> dict[tuple, list[tuple[int, float]]]:
    """(start time, value or count) of every monotonic sum and histogram stream but the processes' own (each
    telemetry process starts those), in the order they arrived."""
    streams: dict[tuple, list[tuple[int, float]]] = collections.defaultdict(list)
    for _, metric in receiver.metrics():
        kind = metric.WhichOneof("data")
        if metric.name.startswith("mpcache.process_"):
            continue
        if kind == "sum" and metric.sum.is_monotonic:
            points = [(p, p.as_int if p.WhichOneof("value") == "as_int" else p.as_double)
                      for p in metric.sum.data_points]
        elif kind == "histogram":
            points = [(p, p.count) for p in metric.histogram.data_points]
        else:
            continue
        for point, value in points:
            attributes = frozenset((kv.key, kv.value.string_value) for kv in point.attributes)
            streams[(metric.name, attributes)].append((point.start_time_unix_nano, value))
    return streams


def latest(streams: dict[tuple, list[tuple[int, float]]], keys) -> dict[tuple, float]:
    """The last value received of each of ``keys`` that has arrived."""
    return {key: streams[key][-1][1] for key in keys if streams.get(key)}


class Front:
    """What the supervisor's front does for ``/metrics``: a TCP listener on loopback forwarding each request to
    the telemetry process's socket (a 503 while there is none), for Prometheus to scrape."""

    def __init__(self, socket_path: str) -> None:
        class Forward(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's method name
                try:
                    status, body = get_unix(socket_path, self.path, 5)
                except OSError:
                    status, body = 503, b"no telemetry process\n"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture
def provisioned(tmp_path) -> Iterator[tuple[Config, Path]]:
    """The supervisor's shared memory for a 2-process instance (rings, gauge board, telemetry state) and the
    configuration file the telemetry process reads; removed at the end."""
    config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir=str(tmp_path),
                    workers=WORKERS, ring_capacity_cells=1 << 17, l1_size_bytes=1 << 16, chunk_bytes=1 << 16,
                    prometheus_port=free_port("127.0.0.1"), disable_logging=True, log_level="warning",
                    telemetry_state_bytes=4 << 20)
    create_segments(config)
    try:
        yield config, tmp_path
    finally:
        unlink_segments(config)


# every counter and histogram family of the service's own (per_process ones left out below)
MONOTONIC = '{__name__=~"(lmcache|mpcache)_.+(_total|_bucket|_count|_sum)"}'


def prometheus_resets(prometheus: PrometheusServer) -> dict[str, float]:
    """Per family, the counter resets Prometheus saw over the run, and how many series it had."""
    out = {}
    for name in prometheus.label_values("__name__", MONOTONIC):
        if per_process(name):
            continue
        out[name] = prometheus.scalar(f"sum(resets({name}[10m]))") or 0.0
        out[f"{name} series"] = prometheus.scalar(f"count({name})") or 0.0
    return out


def test_kill_9_at_random_instants_loses_nothing_and_counts_nothing_twice(provisioned, otlp_receiver):
    config, directory = provisioned
    front = Front(config.telemetry_socket_path()) if PROMETHEUS else None
    prometheus = PrometheusServer(directory, front.address, interval="500ms") if front else None
    receiver = otlp_receiver("grpc")
    config = Config(**{**config.__dict__, "otlp_endpoint": receiver.endpoint, "otlp_interval_s": 0.2,
                        "log_level": "info"})
    config_path = directory / "config.json"

    def configure(kill: int) -> None:
        """The next process's configuration: a checkpoint at every flush where it is to be killed writing one."""
        interval = 0.0 if kill % 3 == 2 else config.telemetry_checkpoint_interval_s
        config_path.write_text(Config(**{**config.__dict__, "telemetry_checkpoint_interval_s": interval}).to_json())

    rng = random.Random(35)
    workload = Workload(config, rng)
    telemetry = Telemetry(config_path, config.telemetry_socket_path(), directory / "telemetry.stderr")
    records = StateRecords(config)
    caught = 0
    try:
        configure(0)
        telemetry.start()
        if prometheus is not None:
            wait_for(lambda: prometheus.scalar('sum(up{job="mpcache"})'), 30, "prometheus's first scrape")
        for kill in range(KILLS):
            workload.burst(rng.randint(200, 1500))
            stop = threading.Event()
            producer = threading.Thread(target=workload.trickle, args=(stop,))
            producer.start()  # the telemetry process reads, aggregates and checkpoints while it is killed
            try:
                if kill % 3 == 2:
                    caught += kill_during_a_checkpoint(telemetry, records, workload)
                else:
                    for _ in range(rng.randint(0, 3)):  # a scrape flushes, so checkpoints happen in between too
                        telemetry.scrape()
                    time.sleep(rng.uniform(0, 0.3))  # a random instant: mid-batch, mid-flush or idle
                    telemetry.kill()
            finally:
                stop.set()
                producer.join()
            workload.burst(rng.randint(0, 500))  # published while nothing reads the rings
            configure(kill + 1)
            telemetry.start()
            assert {} == settled(telemetry, workload.expected)
        in_otlp = {(OTEL_NAMES[name], labels): value for (name, labels), value in workload.expected.items()
                   if name in OTEL_NAMES}
        assert receiver.wait(lambda r: latest(otlp_streams(r), in_otlp) == in_otlp, 30), (
            latest(otlp_streams(receiver), in_otlp), in_otlp)
        if prometheus is not None:  # a scrape after the last restart, then the whole run's resets
            scraped = prometheus.scalar('count_over_time(up{job="mpcache"}[10m])')
            wait_for(lambda: prometheus.scalar('count_over_time(up{job="mpcache"}[10m])') > scraped + 1, 30,
                     "prometheus to scrape the last telemetry process")
            resets = prometheus_resets(prometheus)
            series = sum(value for name, value in resets.items() if name.endswith(" series"))
            assert ({}, True) == ({name: value for name, value in resets.items()
                                   if value and not name.endswith(" series")}, series > 50)
    finally:
        telemetry.stop()
        records.close()
        workload.close()
        if prometheus is not None and front is not None:
            prometheus.stop()
            front.close()

    streams = otlp_streams(receiver)
    moved = {key: points for key, points in streams.items() if len({start for start, _ in points}) != 1}
    went_down = {key: points for key, points in streams.items()
                 if any(later < earlier for (_, earlier), (_, later) in zip(points, points[1:]))}
    assert ({}, {}) == (moved, went_down)

    # the restarts that read on past their checkpoint (the process gone had exported past it): those after the
    # kills of processes that checkpoint every 10 s, all but a few of which exported at least once (every 0.2 s)
    read_on = (directory / "telemetry.stderr").read_text().count('"event": "telemetry.checkpoint_read_on"')
    assert read_on >= KILLS // 2, read_on
    assert telemetry.scrapes > KILLS  # at least one scrape settled each restart (how many more depends on the pace)
    assert caught >= KILLS // 6, f"only {caught} kills landed while a checkpoint was being written"
