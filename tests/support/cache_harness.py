"""The in-process cache server the cache-process tests drive: its small config, a running server on a thread
with its event log and gauge board, a logger that keeps warnings, and reproducible block contents."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np

from mpcache.cache.process import CacheProcess
from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.shm.segment import Segment
from support.ring_events import EventLog
from support.waiting import wait_for

CHUNK_BYTES = 4096
CHUNK_TOKENS = 16
MODEL = "org/model-7b"


class CapturedLog:
    """A structlog-like logger for the in-process server that keeps its warning and info lines."""

    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []
        self.infos: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))

    def info(self, event: str, **fields) -> None:
        self.infos.append((event, fields))

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


def fill_blocks(buffer, seed: int) -> None:
    """Distinct, reproducible bytes in every block of ``buffer``."""
    rng = np.random.default_rng(seed)
    buffer.blocks[:] = rng.integers(0, 256, size=buffer.blocks.shape, dtype=np.uint8)


def fs_spec(path, chunks: int) -> dict:
    """An fs L2 tier at ``path`` with room for ``chunks`` of the harness's chunks."""
    return {"type": "fs", "path": str(path), "capacity_gb": chunks * CHUNK_BYTES / 1e9}


def l2_idle(harness) -> None:
    """Wait until the server has handled every L2 completion."""
    storage = harness.server.storage
    wait_for(lambda: storage.inflight == 0 and not storage.has_completions, 10, "L2 tasks to finish", tolerate=())
