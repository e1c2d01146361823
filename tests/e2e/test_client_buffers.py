"""Client KV buffers passed by descriptor, against a real ``bin/start-cache``: a client
cannot fault the cache process by shrinking its buffer, a client in another PID namespace registers one,
and a client killed with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from support.namespaces import needs_namespaces
from support.service import REPO
from support.waiting import wait_for

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

MODEL = "org/buffer-model"
CLIENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "buffer_client.py")
BIG_CHUNK = 1 << 20
BIG_BLOCKS = 16


def _serving(start_service, *flags: str):
    service = start_service("--workers", "1", "--disable-metrics", *flags)
    socket_path = str(service.runtime_dir / "cache0.sock")
    wait_for(lambda: service.lines("cache.ready"), 60, "the cache process to serve")
    return service, socket_path


def test_a_client_shrinking_its_buffer_during_copies_cannot_fault_the_cache_process(start_service) -> None:
    """While a client stores and retrieves 16 MiB per request, a thread of it tries again and again to
    truncate its buffer to nothing: every attempt fails with EPERM (the buffer is sealed against shrinking),
    every round trip brings back the exact bytes, and the same cache process (same pid) serves to the end."""
    service, socket_path = _serving(start_service, "--chunk-bytes", "1MiB", "--l1-size", "64MiB")
    stop = threading.Event()
    attempts: list[int] = []

    with CacheClient(socket_path) as client:
        kv = client.register_buffer(2 * BIG_BLOCKS, BIG_CHUNK)
        pid_before = client.ping().pid

        def shrink(fd: int) -> None:
            while not stop.is_set():
                try:
                    os.ftruncate(fd, 0)
                    attempts.append(0)
                except OSError as exc:
                    attempts.append(exc.errno)

        shrinker = threading.Thread(target=shrink, args=(kv.fd,), daemon=True)
        shrinker.start()
        rng = np.random.default_rng(5)
        rounds = []
        try:
            for n in range(8):
                kv.blocks[:BIG_BLOCKS] = rng.integers(0, 256, (BIG_BLOCKS, BIG_CHUNK), dtype=np.uint8)
                hashes = [secrets.randbits(63) for _ in range(BIG_BLOCKS)]
                stored = client.store(kv, request_id=f"w{n}", model_name=MODEL, chunk_hashes=hashes,
                                      block_ids=range(BIG_BLOCKS)).stored
                job = client.lookup_prefetch(request_id=f"r{n}", model_name=MODEL, chunk_hashes=hashes)
                got = client.retrieve(kv, request_id=f"r{n}", job_id=job,
                                      block_ids=range(BIG_BLOCKS, 2 * BIG_BLOCKS)).retrieved
                rounds.append((stored, got, bool(np.array_equal(kv.blocks[:BIG_BLOCKS], kv.blocks[BIG_BLOCKS:]))))
                client.end_session(f"w{n}")
                client.end_session(f"r{n}")
        finally:
            stop.set()
            shrinker.join(10)
        pid_after = client.ping().pid
        generation = client.generation
        del kv

    assert attempts and {errno.EPERM} == set(attempts)
    assert [(BIG_BLOCKS, BIG_BLOCKS, True)] * 8 == rounds
    assert (pid_before, 0, [pid_before]) == (pid_after, generation, service.pids("cache"))


@needs_namespaces
def test_a_client_in_another_pid_namespace_registers_a_buffer_and_round_trips(start_service) -> None:
    """A client that is PID 1 of its own PID namespace (``unshare -p -f --mount-proc``), talking to a cache
    process outside it, registers a buffer and gets the exact bytes of a store back through a retrieve."""
    _, socket_path = _serving(start_service, "--chunk-bytes", "4KiB", "--l1-size", "2MiB")
    child = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, CLIENT, "round_trip", socket_path],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert 0 == child.returncode, child.stderr[-2000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert {"pid": 1, "stored": 2, "found": 2, "retrieved": 2, "equal": True} == result


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as handle:
        return handle.read()


def test_a_client_killed_with_sigkill_leaves_nothing_and_the_cache_process_unmaps_its_buffer(start_service) -> None:
    """A client that registered a buffer and stored from it is killed with SIGKILL: nothing of it is in
    /dev/shm, and the cache process, which mapped the buffer while the client lived, unmaps it once the
    connection is gone; the cache process serves on."""
    _, socket_path = _serving(start_service, "--chunk-bytes", "4KiB", "--l1-size", "2MiB")
    with CacheClient(socket_path) as probe:
        cache_pid = probe.ping().pid
    child = subprocess.Popen([sys.executable, CLIENT, "hold", socket_path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        held = json.loads(child.stdout.readline())
        buffer = held["name"].lstrip("/")
        mapped_while_alive = buffer in _maps(cache_pid)
        child.send_signal(signal.SIGKILL)
        assert -signal.SIGKILL == child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"mpcache.{held['pid']}.") or buffer in n]
    wait_for(lambda: buffer not in _maps(cache_pid), 10, "the cache process to unmap the dead client's buffer")
    with CacheClient(socket_path) as probe:
        assert cache_pid == probe.ping().pid
    assert (1, True, []) == (held["stored"], mapped_while_alive, left)
