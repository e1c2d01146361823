"""The client after its cache process restarts: reconnect, register again, say what failed.

The cache process runs in-process on a thread (``Harness``); a restart is the old one stopping (its
connections close) and a new one starting on the same socket path and shared memory, like the
supervisor's restart of a killed process.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.cache_harness import CHUNK_BYTES, MODEL, Harness, fill_blocks

from mpcache.cache.process import CacheProcess
from mpcache.client import CacheClient


def restart_later(config, old: Harness, delay_s: float, started: list[Harness],
                  sooner: threading.Event | None = None) -> threading.Thread:
    """Stop ``old`` now; start a new cache process on the same config after ``delay_s``, or once ``sooner`` is
    set if that comes first."""
    old.stop()

    def start() -> None:
        if sooner is None:
            time.sleep(delay_s)
        else:
            sooner.wait(delay_s)
        started.append(Harness(config, CacheProcess(config, 0)))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def restarts(provisioned):
    """``(config, first harness, list that restarts append to)``; every harness stopped at teardown."""
    config = provisioned()
    started = [Harness(config, CacheProcess(config, 0))]
    yield config, started
    for harness in started:
        if harness.thread.is_alive():
            harness.stop()


def test_an_operation_cut_by_a_restart_raises_naming_it_and_the_client_works_on(restarts) -> None:
    """The cache process restarts while the client is idle (the new one comes up 0.3 s later): the next
    call, ``store``, raises a ConnectionError that names ``store`` as the operation that failed and says
    it reconnected; after it the client has registered its buffer again, a store puts 2 chunks into the
    new process and a prefetch + retrieve brings the same bytes back, and ``generation`` is 1."""
    config, started = restarts
    client = CacheClient(config.socket_path(0))  # reconnects for up to 10 s by default
    try:
        kv = client.register_buffer(4, CHUNK_BYTES)
        fill_blocks(kv, seed=1)
        before = client.store(kv, request_id="before", model_name=MODEL, chunk_hashes=[11, 12], block_ids=[0, 1])
        assert 2 == before.stored
        restarter = restart_later(config, started[0], 0.3, started)

        with pytest.raises(ConnectionError) as lost:
            client.store(kv, request_id="cut", model_name=MODEL, chunk_hashes=[21, 22], block_ids=[0, 1])
        restarter.join(10)
        stored = client.store(kv, request_id="after", model_name=MODEL, chunk_hashes=[31, 32], block_ids=[0, 1]).stored
        job = client.lookup_prefetch(request_id="read", model_name=MODEL, chunk_hashes=[31, 32])
        found = client.wait_prefetch(job).found_count
        got = client.retrieve(kv, request_id="read", job_id=job, block_ids=[2, 3]).retrieved
        same = bool(np.array_equal(kv.blocks[:2], kv.blocks[2:]))
        generation = getattr(client, "generation", None)
        del kv
    finally:
        client.close()

    assert ("store", True) == (getattr(lost.value, "op", None), getattr(lost.value, "reconnected", None))
    assert str(lost.value).startswith("store failed:") and "not retried" in str(lost.value)
    assert (2, 2, 2, True, 1) == (stored, found, got, same, generation)


def test_a_process_that_does_not_come_back_in_time_is_reported_and_the_next_call_reconnects(restarts) -> None:
    """The cache process is gone for longer than the client's 0.5 s reconnect budget: ``ping`` raises
    after trying for that long, saying it could not reconnect (reconnected False); once a new process serves,
    the next call reconnects by itself (no error: nothing of it had been sent) and the buffer works there.  The
    new process starts once ``ping`` gave up, or after 10 s (20 budgets) if it never does: a client that kept
    trying past its budget would reconnect to it instead of raising."""
    config, started = restarts
    client = CacheClient(config.socket_path(0), reconnect_timeout_s=0.5)
    gave_up = threading.Event()
    try:
        kv = client.register_buffer(2, CHUNK_BYTES)
        fill_blocks(kv, seed=2)
        restarter = restart_later(config, started[0], 10.0, started, sooner=gave_up)
        began = time.monotonic()
        with pytest.raises(ConnectionError) as lost:
            client.ping()
        gave_up_after = time.monotonic() - began
        gave_up.set()
        restarter.join(10)
        stored = client.store(kv, request_id="back", model_name=MODEL, chunk_hashes=[41, 42], block_ids=[0, 1]).stored
        del kv
    finally:
        gave_up.set()
        client.close()

    assert ("ping", False) == (getattr(lost.value, "op", None), getattr(lost.value, "reconnected", None))
    assert "could not reconnect within 0.5 s" in str(lost.value)
    assert 0.4 <= gave_up_after
    assert 2 == stored
