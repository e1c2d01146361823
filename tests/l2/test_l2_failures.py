"""L2 failures: a full device (fs evicts and retries once), a hung redis (short timeouts, the server taken as
down for a while), and the rate-limited log lines every failure ends up in."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from concurrent.futures import wait as wait_all
from pathlib import Path

import pytest
from support.l2 import MAC_KEY, TIMEOUT_S, key, payload, wait
from support.silent import silent_listener
from support.waiting import wait_for

from mpcache.cache.l2.base import L2LookupError, LoadResult, StoreResult
from mpcache.cache.l2.failures import FailureCounts, FailureLog
from mpcache.cache.l2.fs import FsL2Adapter
from mpcache.cache.l2.spec import build_adapter

CHUNK = 200_000  # bytes per chunk in the full-device tests: five fit in 1 MiB with their headers, six do not


# -- a full device ----------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (mode 0700) mounted for the test; skipped where we may not mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8); see the monkeypatched ENOSPC test instead")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    completed = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)],
                               capture_output=True, text=True)
    if completed.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {completed.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_full_tmpfs_evicts_the_oldest_chunks_and_stores_succeed(small_tmpfs):
    """With a capacity far above the device (1 GB on 1 MiB), every store still succeeds: a write that meets
    ENOSPC evicts the least recently used chunks and retries once.  The chunks kept load byte-exact, the
    evicted ones are reported and gone from disk, and nothing is counted as a failure."""
    adapter = FsL2Adapter(str(small_tmpfs / "l2"), 10**9, mac_key=MAC_KEY)
    results = [wait(adapter.submit_store([(key(i), payload(i, CHUNK))])) for i in range(12)]
    evicted = [k for result in results for k in result.evicted]
    kept = [i for i in range(12) if key(i) not in evicted]
    buffers = {i: bytearray(CHUNK) for i in kept}
    loaded = wait(adapter.submit_load([key(i) for i in kept], [memoryview(buffers[i]) for i in kept]))
    on_disk = sorted(int(p.stem, 16) for p in small_tmpfs.rglob("*.chunk"))
    adapter.close()

    assert [[key(i)] for i in range(12)] == [result.stored for result in results]
    assert ([key(i) for i in range(len(evicted))], kept, on_disk) == (evicted, list(range(len(evicted), 12)), kept)
    assert 0 < len(evicted) and 4 <= len(kept)
    assert (LoadResult([key(i) for i in kept]), True) == (loaded, all(bytes(buffers[i]) == payload(i, CHUNK)
                                                                      for i in kept))
    assert {} == adapter.failures.totals()


def test_a_chunk_bigger_than_the_device_fails_and_is_counted(small_tmpfs):
    """A record that cannot fit even on the emptied device fails (after evicting and one retry), is counted
    as no_space, and leaves no temp file."""
    adapter = FsL2Adapter(str(small_tmpfs / "l2"), 10**9, mac_key=MAC_KEY)
    wait(adapter.submit_store([(key(1), payload(1, CHUNK))]))

    result = wait(adapter.submit_store([(key(2), payload(2, 2 * 2**20))]))
    files = [p.name for p in small_tmpfs.rglob("*") if p.is_file()]
    adapter.close()

    assert StoreResult([], [], [key(2)], 0, [key(1)]) == result
    assert ({"no_space": 1}, []) == (adapter.failures.totals(), files)


def test_enospc_evicts_and_retries_once_without_a_real_device(make_fs, monkeypatch):
    """The same path without mounting anything: the first write of a chunk raises ENOSPC, the adapter evicts
    the least recently used chunk(s) worth the record's size and writes again; a second ENOSPC fails the key."""
    adapter = make_fs(capacity_bytes=10_000)
    wait(adapter.submit_store([(key(i), payload(i)) for i in (1, 2, 3)]))
    real_write = FsL2Adapter._write
    fail_next: list[int] = []

    def flaky_write(self, path, header, data):
        if fail_next and fail_next.pop():
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, path, header, data)

    monkeypatch.setattr(FsL2Adapter, "_write", flaky_write)
    fail_next[:] = [0, 1]  # popped from the end: first write fails, the retry succeeds
    retried = wait(adapter.submit_store([(key(4), payload(4))]))
    fail_next[:] = [1, 1]  # both fail
    failed = wait(adapter.submit_store([(key(5), payload(5))]))

    assert StoreResult([key(4)], [], [], 1000, [key(1), key(2)]) == retried  # 1000 + header needs two chunks
    assert StoreResult([], [], [key(5)], 0, [key(3), key(4)]) == failed
    assert ({"no_space": 1}, [False] * 5) == (adapter.failures.totals(),
                                               wait(adapter.lookup([key(i) for i in range(1, 6)])))


# -- a hung redis ------------------------------------------------------------------------------------------


@pytest.fixture
def hung_redis():
    """``redis://`` of a TCP listener that accepts connections and never answers (closed after the test)."""
    with silent_listener() as port:
        yield f"redis://127.0.0.1:{port}/0"


def test_a_hung_redis_cannot_make_lookups_take_seconds(make_redis, hung_redis):
    """Twelve lookups at once against a server that never answers (four worker threads) all fail, each as an
    L2LookupError counted as a lookup_error, and only the lookups the threads took at once ask the server (and
    wait its 1 s socket timeout): it is then taken as down, and the lookups queued behind them fail without
    asking instead of each waiting for the timeout in turn (5 s each, queued: 20 s before).  The down period is
    a minute here, so that no stall of a loaded machine ends it before the queued lookups are taken; ``wait_all``
    bounds the batch above (a lookup without a socket timeout would wait for good)."""
    adapter = make_redis(url=hung_redis, down_for_s=60.0)
    started = time.monotonic()
    futures = [adapter.lookup([key(i)]) for i in range(12)]
    done, _ = wait_all(futures, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert 12 == len(done), f"{12 - len(done)} lookups still waiting after {TIMEOUT_S} s"
    errors = [future.exception() for future in futures]
    asked = [error for error in errors if "Timeout" in str(error)]
    not_asked = [error for error in errors if "taken as down" in str(error)]

    assert [L2LookupError] * 12 == [type(error) for error in errors]
    assert 12 == adapter.failures.totals()["lookup_error"]
    assert 12 == len(asked) + len(not_asked), errors
    assert 1 <= len(asked) <= 4, errors  # one a thread at most: the first timeout took the server as down
    assert 0.9 <= elapsed, elapsed  # the lookups that asked waited for the socket timeout


def test_a_hung_redis_is_asked_again_once_its_down_period_is_over(make_redis):
    """Once the down period (1 s) that the start-up usage refresh's timeout began is over, the next lookup asks
    the server again: one connection, whose socket timeout (1 s) it waits for, not retried (it would wait
    twice); ``wait`` bounds it above (TIMEOUT_S)."""
    accepted: list = []
    with silent_listener(accepted=accepted) as port:
        adapter = make_redis(url=f"redis://127.0.0.1:{port}/0")
        failed_at = wait_for(lambda: adapter.failures.totals().get("usage_error") and time.monotonic(), TIMEOUT_S,
                             "the start-up usage refresh to fail", tolerate=())
        time.sleep(max(0.0, failed_at + 1.0 - time.monotonic()))  # the down period, measured from its observed start
        connections = wait_for(lambda: len(accepted), TIMEOUT_S, "the usage refresh's connection", tolerate=())
        started = time.monotonic()
        with pytest.raises(L2LookupError, match="Timeout"):
            wait(adapter.lookup([key(1)]))
        waited = time.monotonic() - started
        wait_for(lambda: len(accepted) > connections, TIMEOUT_S, "the lookup's connection", tolerate=())

    assert 0.9 <= waited, waited
    assert connections + 1 == len(accepted), "a timed-out call was sent again"


def test_a_hung_redis_fails_stores_and_loads_within_the_timeout(make_redis, hung_redis):
    """Stores and loads against a server that never answers fail their keys (loads as errors) after the 1 s
    socket timeout instead of waiting for good: ``wait`` fails the test if either takes TIMEOUT_S (ten socket
    timeouts)."""
    adapter = make_redis(url=hung_redis)
    stored = wait(adapter.submit_store([(key(1), payload(1))]))
    loaded = wait(adapter.submit_load([key(1)], [memoryview(bytearray(1000))]))

    assert (StoreResult([], [], [key(1)], 0, []), LoadResult([], [key(1)], [], [key(1)])) == (stored, loaded)


def test_the_socket_timeout_comes_from_the_spec(hung_redis, closing):
    """``socket_timeout_s`` in the --l2 JSON sets how long a silent server is waited for: twice the adapter's
    default (1 s), so the lookup's time tells them apart by a lower bound, which load cannot break (it only
    lengthens waits); ``wait`` bounds it above (TIMEOUT_S)."""
    timeout_s = 2.0
    adapter = closing(build_adapter({"type": "redis", "url": hung_redis, "capacity_gb": 1,
                                     "socket_timeout_s": timeout_s, "key_prefix": "t:"}, 65536, MAC_KEY))
    # the start-up usage refresh times out and takes the server as down for 1 s from then: wait until it is
    # counted (under load it may come late), then until 1 s after that has passed
    failed_at = wait_for(lambda: adapter.failures.totals().get("usage_error") and time.monotonic(), TIMEOUT_S,
                         "the start-up usage refresh to fail", tolerate=())
    time.sleep(max(0.0, failed_at + 1.0 - time.monotonic()))  # the down period, measured from its observed start
    started = time.monotonic()

    with pytest.raises(L2LookupError, match="Timeout"):
        wait(adapter.lookup([key(1)]))
    assert timeout_s <= time.monotonic() - started  # the server was asked, and waited for the spec's timeout


# -- rate-limited log lines -------------------------------------------------------------------------------


class Lines:
    """A logger that keeps (event, fields) of its warning lines."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def test_failures_are_logged_at_most_once_per_interval_with_their_count():
    """The first failure of a kind is logged at once; more within 10 s are held and come out, counted, in the
    next line after the interval (or at a flush); kinds are limited separately; totals keep growing."""
    now = [100.0]
    lines = Lines()
    log = FailureLog(lines, interval_s=10.0, clock=lambda: now[0])
    counts = FailureCounts()

    counts.note("load_error", 2, "Timeout reading from socket")
    log.report(0, "redis", counts)
    counts.note("load_error", 3, "Timeout reading from socket")
    counts.note("integrity", 1, "MAC mismatch at p:c:00")
    now[0] = 105.0
    log.report(0, "redis", counts)
    counts.note("load_error", 1, "Connection refused")
    now[0] = 110.5
    log.report(0, "redis", counts)
    counts.note("load_error", 4)
    log.report(0, "redis", counts)
    log.report(0, "redis", counts, flush=True)

    base = {"adapter_index": 0, "l2_name": "redis"}
    hint = ("a record failed verification and was not loaded: it is corrupt, or was written by someone without "
            "this deployment's L2 secret (possible forgery)")
    assert [
        ("l2.failure", {**base, "kind": "load_error", "count": 2, "total": 2, "detail": "Timeout reading from socket"}),
        ("l2.record_rejected", {**base, "kind": "integrity", "count": 1, "total": 1, "detail": "MAC mismatch at p:c:00",
                                "hint": hint}),
        ("l2.failure", {**base, "kind": "load_error", "count": 4, "total": 6, "detail": "Connection refused"}),
        ("l2.failure", {**base, "kind": "load_error", "count": 4, "total": 10}),  # noted without a detail
    ] == lines.lines


def test_failure_lines_never_carry_the_key(make_redis, hung_redis):
    """What an adapter notes (and so what is logged) does not contain the L2 key, raw or hex."""
    adapter = make_redis(url=hung_redis)
    wait(adapter.submit_store([(key(1), payload(1))]))
    lines = Lines()
    FailureLog(lines).report(0, "redis", adapter.failures, flush=True)

    text = repr(lines.lines)
    assert (True, False, False) == (bool(lines.lines), MAC_KEY.hex() in text, repr(MAC_KEY) in text)


def test_nothing_is_left_behind_by_a_failed_store(make_fs, tmp_path, monkeypatch):
    """A store whose write fails with EIO is a store_error; no temp file stays in the directory."""
    adapter = make_fs()

    def broken_replace(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", broken_replace)
    result = wait(adapter.submit_store([(key(1), payload(1))]))
    monkeypatch.undo()

    assert StoreResult([], [], [key(1)], 0, []) == result
    assert ({"store_error": 1}, []) == (adapter.failures.totals(),
                                        [p.name for p in Path(tmp_path / "l2").rglob("*") if p.is_file()])
