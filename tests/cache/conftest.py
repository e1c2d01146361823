"""Fixtures for cache-process tests: a small instance's shared memory, an in-process server on a thread
(support/cache_harness.py), one serving LMCache's protocol, and a raw connection for hostile input."""

from __future__ import annotations

import os
import tempfile

import pytest
from support.bad_requests import BLOCKS
from support.cache_harness import CHUNK_BYTES, Harness, make_config
from support.lmcache_client import OBJECT_BYTES, LMClient
from support.raw_frames import RawConn

from mpcache.cache.process import CacheProcess
from mpcache.config import Config
from mpcache.shm.memfd import create_sealed
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments


@pytest.fixture
def runtime_dir(tmp_path):
    """tmp_path, unless its socket path would not fit in sun_path (108 bytes)."""
    if len(os.path.join(str(tmp_path), "cache0.sock")) < 100:
        yield str(tmp_path)
        return
    short = tempfile.mkdtemp(prefix="mpc")
    yield short
    for name in os.listdir(short):
        os.unlink(os.path.join(short, name))
    os.rmdir(short)


@pytest.fixture
def provisioned(runtime_dir):
    """Factory: a Config (overrides as keywords) whose segments exist; unlinked at teardown."""
    made: list[tuple[Config, list[Segment]]] = []

    def make(**overrides) -> Config:
        config = make_config(runtime_dir, **overrides)
        made.append((config, create_segments(config)))
        return config

    yield make
    for config, segments in made:
        for segment in segments:
            segment.close()
        unlink_segments(config)


@pytest.fixture
def cache(provisioned):
    """Factory: start an in-process server (config overrides and server keywords); stopped at teardown."""
    started: list[Harness] = []

    def start(server_kwargs: dict | None = None, **overrides) -> Harness:
        config = provisioned(**overrides)
        harness = Harness(config, CacheProcess(config, 0, **(server_kwargs or {})))
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.stop()


@pytest.fixture
def lmcache(cache):
    """Factory: an in-process cache process serving LMCache's protocol on ipc://, and a client to it."""
    made: list[LMClient] = []

    def start(**overrides) -> tuple[object, LMClient]:
        values = dict(chunk_size_tokens=256, chunk_bytes=OBJECT_BYTES, l1_size_bytes=64 * OBJECT_BYTES,
                      lmcache_ipc=True)
        values.update(overrides)
        harness = cache(**values)
        client = LMClient(harness.config.lmcache_urls(0)[0])
        made.append(client)
        return harness, client

    yield start
    for client in made:
        client.close()


@pytest.fixture
def raw(cache):
    """A running server, a raw connection with one registered 4-block buffer, and a bystander client."""
    harness = cache()
    conn = RawConn(harness.config.socket_path(0))
    fd = create_sealed("rawtest", BLOCKS * CHUNK_BYTES)
    reply = conn.request({"op": "register_buffer", "id": 1, "num_blocks": BLOCKS, "block_bytes": CHUNK_BYTES}, [fd])
    os.close(fd)
    assert True is reply["ok"], reply
    bystander = harness.client()
    bystander_kv = bystander.register_buffer(1, CHUNK_BYTES)
    yield harness, conn, reply["buffer_id"], bystander, bystander_kv
    conn.close()
