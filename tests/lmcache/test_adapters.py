"""LMCache's own client code against ``bin/start-cache --lmcache-port``: the vLLM adapters of LMCache 0.5.6
and of 0.5.7rc3 (``driver.py``, which plays whichever is installed) and 0.5.6's load client (``lmcache
bench server``), each checked against /metrics; and, as the harness's own check, the rc3 driver against
rc3's own server.

The LMCache code runs in its own virtual environments (torch, lmcache), never in mpcache's: the tests
start it as a subprocess.  The interpreters are ``$MPCACHE_TEST_LMCACHE_PYTHON`` (0.5.6) and
``$MPCACHE_TEST_LMCACHE057_PYTHON`` (0.5.7rc3); when one is unset, the venv ``.ci/lmcache-env`` or
``.ci/lmcache057-env`` builds is used if it is already complete (rc3's own server:
``.ci/lmcache057-server-env``'s).  Without one the tests that need it skip, saying how to get it; with
``MPCACHE_TEST_REQUIRE_LMCACHE=1`` (CI sets it) they fail.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.ports import free_ports
from support.service import Scrape, Service
from support.waiting import wait_for

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DRIVER = REPO / "benchmarks" / "harness" / "driver.py"
BENCH = HERE / "run_bench_client.py"
CACHE = Path.home() / ".cache" / "mpcache"
# Every process that imports lmcache: no usage reports leave the machine.
NO_TRACKING = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
CHUNK = 256  # tokens per chunk (mpcache's default --chunk-size, what the adapters read)
SLOTS = 64  # L1 slots per cache process: small, so the driver's eviction scenario overfills it quickly
# Finds the packages without importing them (importing torch and lmcache costs seconds; an import
# that fails anyway fails the driver, loudly).
IMPORT_CHECK = ("import sys, importlib.util as u; "
                "missing = [m for m in ('torch', 'zmq', 'lmcache') if u.find_spec(m) is None]; "
                "sys.exit('missing: ' + ', '.join(missing)) if missing else print(sys.prefix)")

# -- the LMCache client environments -----------------------------------------------------------------------


@dataclass(frozen=True)
class ClientEnv:
    """Where one LMCache version's client venv comes from."""

    version: str  # what the driver reports (lmcache.__version__) starts with this
    python_var: str  # names its interpreter explicitly
    venv_var: str  # names where the build script keeps it
    default_venv: Path
    script: Path  # builds it; --reuse-only validates it, building nothing
    bench: bool  # its bin/lmcache (``lmcache bench server``) is used too


LMCACHE056 = ClientEnv("0.5.6", "MPCACHE_TEST_LMCACHE_PYTHON", "MPCACHE_TEST_LMCACHE_VENV",
                       CACHE / "lmcache-0.5.6-venv", REPO / ".ci" / "lmcache-env", bench=True)
LMCACHE057 = ClientEnv("0.5.7rc3", "MPCACHE_TEST_LMCACHE057_PYTHON", "MPCACHE_TEST_LMCACHE057_VENV",
                       CACHE / "lmcache-0.5.7rc3-venv", REPO / ".ci" / "lmcache057-env", bench=False)
CLIENTS = {client.version: client for client in (LMCACHE056, LMCACHE057)}
CLIENT_PARAMS = [pytest.param(LMCACHE056.version, id="lmcache-0.5.6"),
                 pytest.param(LMCACHE057.version, id="lmcache-0.5.7rc3")]


def _lmcache_unavailable(what: str, reason: str, how: str):
    if os.environ.get("MPCACHE_TEST_REQUIRE_LMCACHE") == "1":
        pytest.fail(f"MPCACHE_TEST_REQUIRE_LMCACHE=1, but {what} is unusable: {reason}", pytrace=False)
    pytest.skip(f"{what} not available: {reason} ({how})")


def reuse_venv(script: Path, what: str, how: str) -> Path:
    """The venv ``script --reuse-only`` names: it validates the marker's hash and the imports, building
    nothing."""
    try:
        found = subprocess.run([str(script), "--reuse-only"], env=dict(os.environ, **NO_TRACKING),
                               capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        _lmcache_unavailable(what, f"{script} --reuse-only did not finish within 180 s", how)
    if found.returncode != 0 or not found.stdout.strip():
        _lmcache_unavailable(what, f"{script} --reuse-only exited {found.returncode}: "
                             f"{found.stderr.strip()[-800:]}", how)
    return Path(found.stdout.strip().splitlines()[-1])


def client_venv(client: ClientEnv) -> Path:
    """The client venv's prefix (its ``bin/python`` runs the driver, 0.5.6's ``bin/lmcache`` the bench)."""
    what = f"LMCache {client.version}'s client environment"
    how = (f"build it with {client.script.relative_to(REPO)}, minutes and the package index; or point "
           f"{client.python_var} at its python")
    python = os.environ.get(client.python_var)
    if not python:
        venv = Path(os.environ.get(client.venv_var) or client.default_venv)
        if not (venv / ".complete").is_file():
            _lmcache_unavailable(what, f"no complete venv at {venv} (no .complete marker) and {client.python_var} "
                                 "unset", how)
        python = str(reuse_venv(client.script, what, how) / "bin" / "python")
    try:
        checked = subprocess.run([python, "-c", IMPORT_CHECK], env=dict(os.environ, **NO_TRACKING),
                                 capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _lmcache_unavailable(what, f"{python} does not run: {exc}", how)
    if checked.returncode != 0:
        _lmcache_unavailable(what, f"{python} lacks LMCache's packages: {checked.stderr.strip()[-800:]}", how)
    prefix = Path(checked.stdout.strip().splitlines()[-1])
    if client.bench and not (prefix / "bin" / "lmcache").exists():
        _lmcache_unavailable(what, f"{prefix}/bin/lmcache missing (the `lmcache bench server` client)", how)
    return prefix


@pytest.fixture(scope="session")
def lmcache_venv() -> Path:
    """LMCache 0.5.6's client venv."""
    return client_venv(LMCACHE056)


@pytest.fixture(scope="session")
def lmcache057_venv() -> Path:
    """LMCache 0.5.7rc3's client venv."""
    return client_venv(LMCACHE057)


@pytest.fixture
def client(request) -> str:
    """The client version a test is parametrized with (``CLIENT_PARAMS``)."""
    return request.param


@pytest.fixture
def client_prefix(request, client) -> Path:
    """That version's client venv."""
    return request.getfixturevalue("lmcache_venv" if client == LMCACHE056.version else "lmcache057_venv")


# -- services --------------------------------------------------------------------------------------


class LMService(Service):
    """``bin/start-cache --lmcache-port`` with ``workers`` cache processes; ``urls[i]`` is cache process i.
    ``--lmcache-allow-clear``: the driver's scenarios reveal leftover read locks with a CLEAR."""

    def __init__(self, tmp_path: Path, workers: int, chunk_bytes: int | None, *flags: str, slots: int = SLOTS) -> None:
        self.workers = workers
        self.chunk_bytes = chunk_bytes
        # chunk_bytes None: no size flag at all (the default L1); else an L1 of `slots` such objects (SLOTS: the
        # driver's eviction scenario overfills it quickly)
        self.l1_bytes = 256 * 2**20 if chunk_bytes is None else slots * chunk_bytes
        sizes = () if chunk_bytes is None else ("--chunk-bytes", str(chunk_bytes), "--l1-size", str(self.l1_bytes))
        base = free_ports(workers, run=True)[0]  # cache process i listens on base + i
        self.urls = [f"tcp://127.0.0.1:{base + i}" for i in range(workers)]
        super().__init__(tmp_path, "--workers", str(workers), "--lmcache-port", str(base), "--lmcache-allow-clear",
                         *sizes, *flags)

    def serving(self, index: int, pid: int) -> bool:
        """Cache process ``pid`` is past its start-up: its LMCache socket is bound (``cache.start``)."""
        return any(line.get("lmcache_urls") == [self.urls[index]]
                   for line in self.lines("cache.start", worker=index, pid=pid))

    def ready(self) -> Scrape:
        def every_cache_serving() -> bool:
            return all(pids and self.serving(i, pids[-1])
                       for i, pids in ((i, self.pids("cache", i)) for i in range(self.workers)))

        wait_for(lambda: self.process.poll() is not None or every_cache_serving(), 60,
                 "every cache process to listen on its LMCache port")
        assert self.process.poll() is None, f"start-cache exited {self.process.returncode}: {self.stderr_tail()}"
        return wait_for(self.scrape, 60, "/metrics")


@pytest.fixture
def start_lmcache_service(start_service):
    """``start(workers, chunk_bytes, *flags, slots=SLOTS)`` → a ready :class:`LMService`, torn down by
    ``start_service``."""

    def start(workers: int, chunk_bytes: int | None, *flags: str, slots: int = SLOTS) -> LMService:
        service = start_service(workers, chunk_bytes, *flags, kind=LMService, slots=slots)
        service.ready()
        return service

    return start


# -- the driver ------------------------------------------------------------------------------------


def object_bytes(tp: int, mla: bool, layers: int = 2, kv_heads: int = 2, head_size: int | None = None) -> int:
    """One KV rank's chunk object, fp16 (the driver's defaults): 2 (K, V; 1 for MLA) x layers x 256 x width."""
    if mla:
        return layers * CHUNK * (head_size or 576) * 2
    return 2 * layers * CHUNK * (kv_heads // tp) * (head_size or 64) * 2


def driver_command(venv: Path, l1_bytes: int, urls: list[str], tp: int, mla: bool, scenario: str,
                   *extra: str) -> list[str]:
    cmd = [str(venv / "bin" / "python"), str(DRIVER), "--url", *urls, "--scenario", scenario, "--tp", str(tp),
           "--l1-size-gb", repr(l1_bytes / 2**30), "--concurrency", "4", "--mq-timeout", "20",
           "--scenario-timeout", "120", "--timeout", "280", *extra]
    return cmd + (["--mla"] if mla else [])


def driver_verdict(stdout: str, returncode: int, stderr_path: Path, client: str) -> dict:
    """The driver's JSON verdict; AssertionError, with its reasons and stderr, unless every scenario passed
    under the client version the test meant to run."""
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        result = None
    stderr = stderr_path.read_text(errors="replace")[-3000:] if stderr_path.exists() else ""
    if result is None or returncode != 0 or not result.get("ok"):
        failed = {name: entry.get("reason") for name, entry in (result or {}).get("scenarios", {}).items()
                  if not entry.get("pass")}
        raise AssertionError(
            f"driver exited {returncode}: {(result or {}).get('reason')!r}; failed scenarios {failed}\n"
            f"last stdout line: {lines[-1] if lines else ''!r}\ndriver stderr (tail):\n{stderr}")
    assert result["lmcache_version"].startswith(client), f"the driver ran LMCache {result['lmcache_version']}"
    return result


def start_driver(venv: Path, l1_bytes: int, urls: list[str], tp: int, mla: bool, scenario: str,
                 stderr_path: Path, *extra: str) -> subprocess.Popen:
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen(driver_command(venv, l1_bytes, urls, tp, mla, scenario, *extra),
                                env=dict(os.environ, **NO_TRACKING), stdout=subprocess.PIPE, stderr=stderr,
                                stdin=subprocess.DEVNULL, text=True, cwd=REPO)


def wait_driver(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[str, int]:
    """(stdout, exit status) of a driver :func:`start_driver` started, killed at the deadline."""
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
    return stdout, proc.returncode


def run_driver(venv: Path, client: str, l1_bytes: int, urls: list[str], tp: int, mla: bool, scenario: str,
               tmp_path: Path, *extra: str) -> dict:
    stderr_path = tmp_path / "driver.stderr"
    proc = start_driver(venv, l1_bytes, urls, tp, mla, scenario, stderr_path, *extra)
    return driver_verdict(*wait_driver(proc), stderr_path, client)


# -- /metrics against the driver's counts ----------------------------------------------------------

REQUESTED = "lmcache_mp_lookup_requested_tokens_total"
HIT = "lmcache_mp_lookup_hit_tokens_total"
L1_WRITE = "lmcache_mp_l1_write_chunks_total"
L1_READ = "lmcache_mp_l1_read_chunks_total"
LOADED = "lmcache_mp_num_chunks_loaded_total"
STORE_SAMPLES = "lmcache_mp_l0_l1_store_throughput_GBs_count"
LOAD_SAMPLES = "lmcache_mp_l0_l1_load_throughput_GBs_count"
DROPPED = "lmcache_mp_event_bus_dropped_events_total"
READ_FAILED = "lmcache_mp_l1_read_failure_chunks_total"
ALLOC_FAILED = "lmcache_mp_l1_allocation_failure_chunks_total"


def expected_metrics(totals: dict) -> dict[str, float]:
    """The metrics that follow exactly from what the driver's adapters were told.

    Every lookup RPC is answered by one server, whose status the scheduler adapter consumes exactly
    once: one lookup record per RPC, requesting the key's whole chunks and hitting what that server
    answered (``server_hit_chunks`` sums the per-server answers; ``hit_chunks`` is their minimum per
    lookup, so it undercounts with two servers).  A 0.5.7 start-aware lookup never looks up the chunks
    below its start, which the server answers as hit: they count in neither (``covered_chunks``), as
    LMCache 0.5.7rc3's own server counts them.  An L1 object is one (chunk, KV rank) piece: every
    object a prepare_store reserved was committed (the driver fails on a False commit), every slot a
    prepare_retrieve handed out was committed back.  One throughput sample per transfer that moved
    bytes: a prepare_store with at least one slot, or a prepare_retrieve with at least one slot.
    """
    expected = {
        REQUESTED: totals["requested_chunks"] * CHUNK,
        HIT: totals["server_hit_chunks"] * CHUNK,
        L1_WRITE: totals["stored_objects"],
        L1_READ: totals["retrieved_objects"],
        LOADED: totals["retrieved_objects"],
        STORE_SAMPLES: totals["store_transfers"],
        LOAD_SAMPLES: totals["retrieve_transfers"],
        DROPPED: 0,
        READ_FAILED: 0,
    }
    return expected


def settled_scrape(scrape_now: Callable[[], Scrape], expected: dict[str, float], timeout_s: float = 30) -> Scrape:
    """The first scrape showing every expected value (metrics are counted asynchronously), or, at the
    deadline, the last one, for the assertions to report on."""
    last: list[Scrape] = []

    def matches():
        scrape = scrape_now()
        last[:] = [scrape]
        return scrape if all(scrape.total(name) == value for name, value in expected.items()) else None

    try:
        return wait_for(matches, timeout_s, "/metrics to show the driver's counts")
    except AssertionError:
        return last[0] if last else scrape_now()


def check_driver_totals(totals: dict, servers: int) -> None:
    """The driver's own bookkeeping is consistent with what the servers answered: a lookup's hit is the
    minimum over the servers (covered chunks included), so each server answered at least that."""
    answered = totals["server_hit_chunks"] + totals["covered_chunks"]
    if servers == 1:
        assert answered == totals["hit_chunks"]
    else:
        assert answered >= servers * totals["hit_chunks"]
    assert totals["requested_chunks"] >= totals["server_hit_chunks"] > 0
    assert totals["stored_objects"] > 0 and totals["verified_chunks"] == totals["retrieved_objects"] > 0


def check_metrics(service: LMService, result: dict, servers: int) -> Scrape:
    totals = result["totals"]
    expected = expected_metrics(totals)
    scrape = settled_scrape(service.scrape, expected)
    got = {name: scrape.total(name) for name in expected}
    print(f"\n/metrics {got}\nload samples {scrape.total(LOAD_SAMPLES)}, driver totals {totals}")
    assert got == expected, f"/metrics vs the driver's counts (totals {totals})"
    check_driver_totals(totals, servers)
    assert totals["retrieve_failures"] == 0 and totals["store_commit_failures"] == 0
    # A store the server refused for lack of room (the eviction scenario) shows as skipped objects, but
    # so does a rank's chunk that was already cached while the prefix missed on another rank; so the
    # allocation failures can only be bounded by the skipped objects, not equated with them.
    assert scrape.total(ALLOC_FAILED, during="l1_store") <= totals["store_skipped_objects"]
    return scrape


# -- the tests -------------------------------------------------------------------------------------

CASES = {  # id: (cache processes, TP, MLA); the driver's TP ranks spread evenly over the servers
    "tp1": (1, 1, False),
    "tp2-one-server": (1, 2, False),
    "tp2-two-servers": (2, 2, False),
    "mla": (1, 1, True),
    "mla-tp2": (1, 2, True),
}


@pytest.mark.parametrize("client", CLIENT_PARAMS, indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_lmcache_adapters_against_mpcache(case, client, client_prefix, start_lmcache_service, tmp_path) -> None:
    """LMCache's vLLM scheduler and worker adapters (0.5.6's, and 0.5.7rc3's with its negotiated chunk size,
    packed keys and start-aware lookups) run every driver scenario against ``--lmcache-port`` with
    byte-exact retrieves (``all`` plus ``lock_release``: after a retrieve or a lock free and ``end_session``
    no read lock is left, which a non-forced CLEAR would reveal), and /metrics agrees with what the adapters
    were told: lookup requested/hit tokens, L1 writes and reads, chunks loaded, one throughput sample per
    transfer, nothing dropped."""
    workers, tp, mla = CASES[case]
    # LRU: the driver's scenarios share one L1 and expect a prompt stored once into the L1 its eviction scenario
    # filled with objects seen again to be readable, which the adaptive order admits on second sight only.
    service = start_lmcache_service(workers, object_bytes(tp, mla), "--l1-policy", "lru")
    urls = service.urls[:workers]
    result = run_driver(client_prefix, client, service.l1_bytes, urls, tp, mla, "all,lock_release", tmp_path)
    eviction = result["scenarios"]["eviction"]["eviction"]
    assert eviction["hit_chunks_after_fill"] < eviction["requests"] * eviction["chunks_per_request"]
    check_metrics(service, result, workers)
    assert 0 == service.stop()


@pytest.mark.parametrize("client", CLIENT_PARAMS, indirect=True)
def test_lmcaches_worker_consumes_the_kv_event_stream_and_announces_exactly_what_l1_holds(
        client, client_prefix, start_lmcache_service, tmp_path) -> None:
    """LMCache's own worker (0.5.6's through the ``kv_event_stream`` capability, 0.5.7rc3's by vLLM's
    ``enable_kv_cache_events`` alone) subscribes to ``subscribe_kv_events`` and re-publishes it as vLLM's cache
    events: stored events with each chunk's tokens and its parent, removals for what L1 evicted (30 prompts of 4
    chunks into 64 objects).  What it still announces at the end is exactly what L1 holds: every announced block
    is found by a lookup on the native socket, and there are as many as L1's bytes in use hold objects; /metrics
    counts the 120 + 56 records appended, none skipped."""
    service = start_lmcache_service(1, object_bytes(1, False), "--kv-event-log-size", "32768")  # the default, named
    result = run_driver(client_prefix, client, service.l1_bytes, service.urls, 1, False, "kv_events", tmp_path,
                        "--kv-events")
    summary = result["scenarios"]["kv_events"]["kv_events"]
    assert summary["stored"] == 120 and summary["removed"] == 120 - SLOTS
    announced = [int(block, 16) for block in summary["announced"]]
    assert len(announced) == SLOTS
    native = CacheClient(service.socket(0))
    try:
        for index, block in enumerate(announced):
            job = native.lookup_prefetch(request_id=f"probe{index}", model_name=summary["model_name"],
                                         chunk_hashes=[block])
            assert 1 == native.wait_prefetch(job).found_count, f"announced block {block:016x} is not in L1"
            native.end_session(f"probe{index}")
    finally:
        native.close()
    used = service.scrape().total("lmcache_mp_l1_memory_usage_bytes")
    assert used == len(announced) * object_bytes(1, False)
    # the feed's own series: every record appended (the worker got them all: none skipped, no resync)
    feed = ("mpcache_kv_event_records_total", "mpcache_kv_event_skipped_records_total",
            "mpcache_kv_event_resyncs_total")
    wait_for(lambda: [service.scrape().total(name) for name in feed] == [176, 0, 0], 30,
             "the feed's counts on /metrics")
    assert 0 == service.stop()


# Scenarios that leave another client's chunks alone (no CLEAR, no eviction): two drivers at once.
SHARING = "cold_miss_then_store,full_hit,partial_hit,prefix_cache_skip,two_salts,concurrent"


def test_lmcache_056_and_057_clients_share_one_mpcache(lmcache_venv, lmcache057_venv, start_lmcache_service,
                                                       tmp_path) -> None:
    """LMCache 0.5.6's and 0.5.7rc3's adapters (TP 2 each, the same model) at the same time against one cache
    process, each speaking its own protocol on the same port: every retrieve of both is byte-exact (rc3 adds its
    start-aware lookups), and /metrics counts exactly the sum of what both were told."""
    service = start_lmcache_service(1, object_bytes(2, False), slots=1024)  # room for both: nothing evicted
    runs = {LMCACHE056.version: (lmcache_venv, SHARING),
            LMCACHE057.version: (lmcache057_venv, SHARING + ",lookup_start")}
    stderr_paths = {version: tmp_path / f"driver-{version}.stderr" for version in runs}
    started = {version: start_driver(venv, service.l1_bytes, service.urls, 2, False, scenarios, stderr_paths[version])
               for version, (venv, scenarios) in runs.items()}
    outputs = {version: wait_driver(proc) for version, proc in started.items()}  # both end before either is judged
    results = {version: driver_verdict(*output, stderr_paths[version], version) for version, output in outputs.items()}
    totals = {name: sum(result["totals"][name] for result in results.values())
              for name in results[LMCACHE056.version]["totals"]}
    check_metrics(service, {"totals": totals}, 1)
    assert 0 == service.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_lmcache_bench_server_against_mpcache(tp, lmcache_venv, start_lmcache_service, tmp_path) -> None:
    """LMCache 0.5.6's own load client, ``lmcache bench server`` (engine_driven, CPU) with its *default* KV shape
    (32 layers, 8 KV heads of 128, fp16: a 32 MiB object per chunk at TP 1), passes against a default
    ``start-cache --lmcache-port`` (no size flag): every sequence a cold miss then a stored store, a warm full
    hit, a retrieve and a checksum match (``run_bench_client.py`` judges it); /metrics counts exactly its
    chunks."""
    requests, chunks = 3, 2  # --num-tokens 512; 3 x 2 x 32 MiB stays below the 80% watermark of 256 MiB
    # LRU: at TP 2 the third sequence's store needs room that only the first two's objects, seen again by their warm
    # hits, can give, and the adaptive order refuses a store seen once there; the protocol is what this tests.
    service = start_lmcache_service(1, None, "--l1-policy", "lru")
    bench = subprocess.run(
        [sys.executable, str(BENCH), "--rpc-url", service.urls[0], "--venv", str(lmcache_venv), "--tp", str(tp),
         "--requests", str(requests), "--num-tokens", str(chunks * CHUNK), "--default-shape", "--timeout", "400"],
        env=dict(os.environ, **NO_TRACKING), capture_output=True, text=True, timeout=450,
        stdin=subprocess.DEVNULL, cwd=REPO)
    lines = bench.stdout.strip().splitlines()
    verdict = json.loads(lines[-1]) if lines else {}
    assert bench.returncode == 0 and verdict.get("ok"), (
        f"bench verdict {verdict.get('reason')!r} {verdict.get('problems')}\n{bench.stderr[-3000:]}")
    objects = requests * chunks * tp
    expected = {REQUESTED: 2 * requests * chunks * CHUNK, HIT: requests * chunks * CHUNK, L1_WRITE: objects,
                L1_READ: objects, LOADED: objects, DROPPED: 0}
    scrape = settled_scrape(service.scrape, expected)
    assert expected == {name: scrape.total(name) for name in expected}
    assert scrape.total(STORE_SAMPLES) > 0 and scrape.total(LOAD_SAMPLES) > 0
    assert 0 == service.stop()


STORE_LINE = re.compile(r"STORE: (\w+) \((\d+) tokens, ([\d.]+) ms")


def test_a_model_larger_than_l1_fails_every_store_at_once_with_one_warning(lmcache_venv, start_lmcache_service,
                                                                           tmp_path) -> None:
    """``lmcache bench server`` whose 128 KiB object exceeds a 64 KiB L1: registration succeeds (the worker maps
    the pool, so nothing is pickled into an oversized frame that would be dropped unanswered), every store
    fails in under 100 ms instead of waiting out the client's RPC timeout, and the service logs one
    ``lmcache.object_larger_than_l1`` warning naming both sizes and --l1-size."""
    service = start_lmcache_service(1, None, "--l1-size", "64KiB")
    bench = subprocess.run(
        [sys.executable, str(BENCH), "--rpc-url", service.urls[0], "--venv", str(lmcache_venv), "--tp", "1",
         "--requests", "3", "--num-tokens", str(CHUNK), "--timeout", "240"],
        env=dict(os.environ, **NO_TRACKING), capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL, cwd=REPO)
    stores = [match.groups() for match in map(STORE_LINE.search, bench.stderr.splitlines()) if match]
    assert len(stores) >= 3, bench.stderr[-3000:]  # the cold requests, and the warm ones that missed
    assert all(status == "store_failed" and float(ms) < 100 for status, _, ms in stores), stores
    warnings = wait_for(lambda: service.lines("lmcache.object_larger_than_l1") or None, 10, "the warning")
    assert 1 == len(warnings)
    assert (object_bytes(1, False), 65536) == (warnings[0]["object_bytes"], warnings[0]["l1_bytes"])
    assert "--l1-size 1MiB" in warnings[0]["fix"]
    assert 0 == service.stop()


class _Lines:
    """A child's stdout, read line by line on a thread, so the test waits on it with a deadline."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                return False
            if line is None:
                return False
            self.lines.append(line)
            if line.rstrip("\n") == text:
                return True
        return False

    def rest(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)


RESTART_CASES = {  # id: (cache processes, TP, the cache process to kill)
    "tp1": (1, 1, 0),
    "tp2-two-servers": (2, 2, 1),
}


@pytest.mark.parametrize("client", CLIENT_PARAMS, indirect=True)
@pytest.mark.parametrize("case", list(RESTART_CASES))
def test_adapters_recover_after_a_cache_process_is_killed(case, client, client_prefix, start_lmcache_service,
                                                          tmp_path) -> None:
    """A cache process kill -9ed under running LMCache adapters (heartbeat 1 s) is restarted by the
    supervisor; the adapters recover within the driver's deadline (each worker of that server is
    answered one ping False by the new process, turns unhealthy, and re-registers on the next ping;
    0.5.7rc3's adapters also negotiate the chunk size again),
    and then complete verified store and full-hit retrieve round trips on new tokens; after their
    end_sessions no read lock is left (a CLEAR empties the cache).  /metrics still agrees exactly with
    the driver's counts across the restart, and nothing was dropped."""
    workers, tp, victim_index = RESTART_CASES[case]
    service = start_lmcache_service(workers, object_bytes(tp, False))
    stderr_path = tmp_path / "driver.stderr"
    stderr = open(stderr_path, "w")
    driver = subprocess.Popen(
        driver_command(client_prefix, service.l1_bytes, service.urls, tp, False, "survive_restart",
                       "--heartbeat-interval", "1", "--restart-wait", "90", "--recovery-timeout", "30"),
        env=dict(os.environ, **NO_TRACKING), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        text=True, cwd=REPO)
    try:
        out = _Lines(driver.stdout)
        if not out.wait_for("[driver] survive_restart: READY for the server restart", 120):
            driver.kill()
            raise AssertionError(f"the driver never got ready for the restart: {out.rest(5)!r}\n"
                                 f"{stderr_path.read_text(errors='replace')[-3000:]}")
        # Everything published so far is counted before the kill (the comparison below is exact).
        wait_for(lambda: service.scrape().total("lmcache_mp_event_bus_queue_depth") == 0, 30,
                 "the event rings to drain before the kill")
        [victim] = service.pids("cache", victim_index)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        restarted = wait_for(lambda: [pid for pid in service.pids("cache", victim_index) if pid != victim], 30,
                             "the supervisor to restart the killed cache process")[0]
        wait_for(lambda: service.serving(victim_index, restarted), 30, "the restarted cache process to listen")
        restart_s = time.monotonic() - killed_at
        driver.stdin.write(f"restarted {service.urls[victim_index]}\n")
        driver.stdin.flush()
        driver.wait(timeout=150)
        stdout = out.rest(10)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        stderr.close()
    result = driver_verdict(stdout, driver.returncode, stderr_path, client)
    recovery = result["scenarios"]["survive_restart"]["restart"]
    print(f"\n[{case}] kill -9 -> restarted process listening: {restart_s:.2f} s; "
          f"go-ahead -> adapters recovered (re-registered, healthy): {recovery['recovery_seconds']:.2f} s")
    assert recovery["reregistered_ranks"] == [r for r in range(tp) if r // (tp // workers) == victim_index]
    # The designed path: the new process did not know the workers and told each one so, once.
    told = {line["instance_id"] for line in service.lines("lmcache.unknown_instance", worker=victim_index)}
    assert len(told) == len(recovery["reregistered_ranks"]), (
        f"the restarted process answers one ping False to each worker it does not know "
        f"(lmcache.unknown_instance); it logged that for instances {sorted(told)}, expected one per re-registered "
        f"rank {recovery['reregistered_ranks']}")
    assert [victim, restarted] == service.pids("cache", victim_index)
    check_metrics(service, result, workers)
    assert 0 == service.stop()


# -- the harness's own check, independent of mpcache: the rc3 driver against LMCache 0.5.7rc3's own server --

LMCACHE057_SERVER_ENV = REPO / ".ci" / "lmcache057-server-env"
REFERENCE_L1_BYTES = 2**28  # 0.25 GiB per server: the driver's eviction scenario overfills it in seconds


@pytest.fixture(scope="session")
def lmcache057_server_venv(lmcache057_venv) -> Path:
    """The venv that runs LMCache 0.5.7rc3's own server (``.ci/lmcache057-server-env``), validated, not built."""
    return reuse_venv(LMCACHE057_SERVER_ENV, "LMCache 0.5.7rc3's own server environment",
                      "build it with .ci/lmcache057-server-env, a minute and the package index")


class ReferenceServer:
    """LMCache 0.5.7rc3's own MP server on CPU (engine_driven), on LMCache 0.5.6's compiled core through the
    server venv's import hook; ready once it logs that it is running."""

    def __init__(self, venv: Path, directory: Path) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.shm_name = f"mpcache-ref-{os.getpid()}-{self.port}"
        self.log_path = directory / f"lmcache-server-{self.port}.log"
        env = dict(os.environ, **NO_TRACKING, PYTHONPATH=str(venv / "hook"),
                   LMCACHE056_NATIVE_SO=str(venv / "lmcache056" / "lmcache_native.cpython-311-x86_64-linux-gnu.so"))
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [str(venv / "bin" / "python"), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
                 "--port", str(self.port), "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name,
                 "--l1-size-gb", repr(REFERENCE_L1_BYTES / 2**30), "--no-l1-use-lazy", "--eviction-policy", "LRU",
                 "--max-workers", "2", "--prometheus-port", str(self.metrics_port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=directory)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self) -> None:
        wait_for(lambda: self.process.poll() is not None or "LMCache cache server is running" in self.log_tail(),
                 120, f"LMCache's server on port {self.port} to run")
        assert self.process.poll() is None, f"LMCache's server exited {self.process.returncode}: {self.log_tail()}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self) -> None:
        """SIGTERM (it unlinks its shared memory on the way out), SIGKILL after 30 s; its segment goes either way."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)


@pytest.fixture
def reference_servers(lmcache057_server_venv, tmp_path) -> Iterator[Callable[[int], list[ReferenceServer]]]:
    """``start(n)`` → n ready :class:`ReferenceServer` s, stopped at the end."""
    started: list[ReferenceServer] = []

    def start(n: int) -> list[ReferenceServer]:
        servers = [ReferenceServer(lmcache057_server_venv, tmp_path) for _ in range(n)]
        started.extend(servers)
        for server in servers:
            server.wait_ready()
        return servers

    yield start
    for server in started:
        server.stop()


REFERENCE_CASES = {"tp1": (1, 1), "tp2-two-servers": (2, 2)}  # id: (servers, TP)


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_lmcache057_driver_against_lmcache057s_own_server(case, lmcache057_venv, reference_servers,
                                                          tmp_path) -> None:
    """The rc3 driver is right independently of mpcache: against LMCache 0.5.7rc3's own server it passes every
    scenario (``all``, with ``lookup_start``, plus ``lock_release`` with its abandoned start-aware lookup) with
    byte-exact retrieves, and that server's own metrics equal the driver's counts of looked-up and hit tokens
    (the engine-covered chunks left out of both) and of stored objects."""
    n, tp = REFERENCE_CASES[case]
    servers = reference_servers(n)
    result = run_driver(lmcache057_venv, LMCACHE057.version, REFERENCE_L1_BYTES, [s.url for s in servers], tp,
                        False, "all,lock_release", tmp_path)
    totals = result["totals"]
    check_driver_totals(totals, n)
    assert totals["covered_chunks"] > 0 and totals["retrieve_failures"] == 0
    expected = {REQUESTED: totals["requested_chunks"] * CHUNK, HIT: totals["server_hit_chunks"] * CHUNK,
                L1_WRITE: totals["stored_objects"]}
    scrape = settled_scrape(lambda: Scrape("".join(s.metrics_text() for s in servers)), expected)
    assert expected == {name: scrape.total(name) for name in expected}, f"driver totals {totals}"


# -- LMCache 0.5.7's hybrid models and inline transfer, by its own worker adapter -----------------------------------

HYBRID_CHECK = HERE / "hybrid057.py"
NOBODY = 65534


@pytest.mark.parametrize(("model", "transfer"), [("hybrid", "pool"), ("hybrid", "inline"), ("hybrid", "fallback"),
                                                 ("single", "inline")])
def test_lmcache057_hybrid_models_and_inline_transfer_round_trip(model, transfer, lmcache057_venv,
                                                                  start_lmcache_service) -> None:
    """LMCache 0.5.7rc3's own adapters store, look up and retrieve a hybrid model (a full-attention, a 128-token
    sliding-window and a recurrent group) and a one-group model: through the pool; inline as another allowed uid
    (told shm_name ""); inline by the worker's own fallback when it cannot open the pool (a container without the
    shared /dev/shm). Every retrieved block is compared with what was stored; the whole prompt is a hit."""
    if transfer == "inline" and os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    flags = ("--lmcache-allow-uid", str(NOBODY)) if transfer == "inline" else ()
    service = start_lmcache_service(1, None, *flags)
    extra = {"pool": [], "inline": ["--as-uid", str(NOBODY)], "fallback": ["--no-shared-memory"]}[transfer]
    checked = subprocess.run([str(lmcache057_venv / "bin" / "python"), str(HYBRID_CHECK), "--url", service.urls[0],
                              "--model", model, *extra], env=dict(os.environ, **NO_TRACKING), capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL)
    summary = json.loads(checked.stdout.strip().splitlines()[-1]) if checked.stdout.strip() else {}
    assert 0 == checked.returncode and summary.get("ok"), (summary, checked.stderr[-3000:])
    assert summary["transfer"].endswith("Shm" if transfer == "pool" else "Inline"), summary
