"""Fixtures for cache-process tests: a small instance's shared memory, an
in-process server on a thread, and a reader of the events it published."""

from __future__ import annotations

import os
import tempfile
import threading
import uuid

import numpy as np
import pytest
from support.lmcache_client import OBJECT_BYTES, LMClient
from support.ring_events import EventLog

from mpcache.cache.process import CacheProcess
from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments

CHUNK_BYTES = 4096
CHUNK_TOKENS = 16
MODEL = "org/model-7b"


class CapturedLog:
    """A structlog-like logger for the in-process server that keeps its warning lines."""

    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None  # info, debug, exception, ...


TEST_L2_SECRET = "5e" * 32  # a fixed L2 record key (hex), so fs tiers survive a harness restart


def make_config(runtime_dir: str, **overrides) -> Config:
    values = dict(
        instance_id=uuid.uuid4().hex,
        supervisor_pid=os.getpid(),
        runtime_dir=runtime_dir,
        workers=1,
        l1_size_bytes=8 * CHUNK_BYTES,
        chunk_bytes=CHUNK_BYTES,
        chunk_size_tokens=CHUNK_TOKENS,
        ring_capacity_cells=1 << 14,
        intern_capacity=256,
        metrics_sample_rate=1.0,
        eviction_interval_s=3600.0,  # tests that want the loop ask for a short interval
        l2_secret=TEST_L2_SECRET,  # what the supervisor resolves for fs and redis tiers (the fs tier's secret file)
    )
    values.update(overrides)
    return Config(**values)


class Harness:
    """A running in-process cache server, its config and its event log."""

    def __init__(self, config: Config, server: CacheProcess) -> None:
        self.config = config
        self.server = server
        self.events = EventLog(config)
        self.thread = threading.Thread(target=server.run, name="cache-server", daemon=True)
        self.thread.start()
        self.clients: list[CacheClient] = []
        self._board_segment = Segment.attach(config.gauge_board_name())
        self.board = GaugeBoardReader(self._board_segment)

    def client(self) -> CacheClient:
        client = CacheClient(self.config.socket_path(0))
        self.clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server thread did not stop"
        self.events.close()
        self.board = None
        self._board_segment.close()


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


def fill_blocks(buffer, seed: int) -> None:
    """Distinct, reproducible bytes in every block of ``buffer``."""
    rng = np.random.default_rng(seed)
    buffer.blocks[:] = rng.integers(0, 256, size=buffer.blocks.shape, dtype=np.uint8)


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
