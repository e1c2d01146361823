"""The GPU data path: a client's CUDA buffer, shared by IPC, copied GPU ⇄ L1 on the cache process's own stream.

Needs cupy and a CUDA device; skipped otherwise.  On a GPU machine::

    pip install -e '.[test,gpu]'
    python -m pytest -m gpu tests/gpu -v

The cache server runs in this process (its loop on a thread); the client runs in a child process, because
a CUDA IPC handle cannot be opened by the process that exported it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import uuid

import pytest
from support.ring_events import EventLog

from mpcache.cache import transfer
from mpcache.cache.process import CacheProcess
from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.contract.events import EventType as E
from mpcache.errors import RequestError
from mpcache.supervisor.provision import create_segments, unlink_segments
from mpcache.telemetry.batch import EventBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(transfer.cuda_device_count() == 0, reason="no CUDA device / cupy not installed"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK_BYTES = 64 * 1024
MODEL = "gpu-model"

CHILD = r'''
import json, sys
import cupy
from mpcache.client import CacheClient

socket_path, block_bytes, hashes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
client = CacheClient(socket_path)
kv = client.register_cuda_buffer(8, block_bytes, device_index=0)
kv.blocks[:] = cupy.random.randint(0, 256, size=kv.blocks.shape, dtype=cupy.uint8)
cupy.cuda.runtime.deviceSynchronize()  # the blocks are written before the server copies them
stored = client.store(kv, request_id="gpu-store", model_name="gpu-model", chunk_hashes=hashes, block_ids=[0, 1, 2],
                      engine_id=3).stored
job = client.lookup_prefetch(request_id="gpu-load", model_name="gpu-model", chunk_hashes=hashes)
found = client.query_prefetch_status(job).found_count
retrieved = client.retrieve(kv, request_id="gpu-load", job_id=job, block_ids=[5, 6, 7], engine_id=3).retrieved
equal = bool(cupy.array_equal(kv.blocks[0:3], kv.blocks[5:8]))
device = kv.device
client.end_session("gpu-store")
client.end_session("gpu-load")
kv.close()
client.close()
print(json.dumps({"stored": stored, "found": found, "retrieved": retrieved, "equal": equal, "device": device}))
'''


class Server:
    """An in-process cache server for one worker, and a reader of the events it published."""

    def __init__(self, runtime_dir: str) -> None:
        self.config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir=runtime_dir,
                             workers=1, l1_size_bytes=16 * CHUNK_BYTES, chunk_bytes=CHUNK_BYTES,
                             chunk_size_tokens=16, ring_capacity_cells=1 << 14, intern_capacity=256,
                             metrics_sample_rate=1.0, eviction_interval_s=3600.0)
        self.segments = create_segments(self.config)
        self.server = CacheProcess(self.config, 0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.events = EventLog(self.config)

    def take(self) -> EventBatch:
        return self.events.take()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.events.close()
        for segment in self.segments:
            segment.close()
        unlink_segments(self.config)


@pytest.fixture
def server():
    runtime_dir = tempfile.mkdtemp(prefix="mpcgpu")
    made = Server(runtime_dir)
    yield made
    made.stop()
    for name in os.listdir(runtime_dir):
        os.unlink(os.path.join(runtime_dir, name))
    os.rmdir(runtime_dir)


def test_store_retrieve_round_trip_through_cuda_ipc_is_byte_exact_and_stream_timed(server, monkeypatch):
    """A child process registers a GPU buffer by IPC, stores 3 blocks and retrieves them into 3 others:
    the bytes match, the copies are reported on device cuda:0, and every MP_STORE/RETRIEVE START and END
    timestamp is the wall-clock instant computed from a CUDA event (anchor + cudaEventElapsedTime)."""
    stream_times: list[int] = []
    wall_ns = transfer._CudaDevice.wall_ns

    def spy(self, event):
        stream_times.append(wall_ns(self, event))
        return stream_times[-1]

    monkeypatch.setattr(transfer._CudaDevice, "wall_ns", spy)
    hashes = [11, 22, 33]
    server.take()
    child = subprocess.run([sys.executable, "-c", CHILD, server.config.socket_path(0), str(CHUNK_BYTES),
                            json.dumps(hashes)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert 0 == child.returncode, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    batch = server.take()

    assert {"stored": 3, "found": 3, "retrieved": 3, "equal": True, "device": "cuda:0"} == result
    timed = batch.events([E.MP_STORE_START, E.MP_STORE_END, E.MP_RETRIEVE_START, E.MP_RETRIEVE_END])
    assert [(E.MP_STORE_START, "cuda:0"), (E.MP_STORE_END, "cuda:0"), (E.MP_RETRIEVE_START, "cuda:0"),
            (E.MP_RETRIEVE_END, "cuda:0")] == [(e.etype, e.fields["device"]) for e in timed]
    assert stream_times == [e.timestamp_ns for e in timed]
    assert [3 * CHUNK_BYTES, 3 * CHUNK_BYTES] == [e.fields["total_bytes"] for e in timed[1::2]]
    assert all(start.timestamp_ns <= end.timestamp_ns for start, end in zip(timed[::2], timed[1::2]))
    assert ["cuda:0", "cuda:0"] == [e.fields["device"] for e in batch.events([E.MP_STORE_SUBMITTED,
                                                                             E.MP_RETRIEVE_SUBMITTED])]


def test_a_handle_that_does_not_open_is_a_one_line_request_error(server):
    """64 zero bytes are no IPC handle: the server says so in one line and keeps serving."""
    client = CacheClient(server.config.socket_path(0))
    try:
        with pytest.raises(RequestError) as raised:
            client.call("register_cuda_buffer", ipc_handle="00" * 64, device_index=0, num_blocks=1,
                        block_bytes=CHUNK_BYTES)
        assert (True, 1) == (str(raised.value).startswith("ipc_handle: cannot open it on cuda:0: "),
                             len(str(raised.value).splitlines()))
        assert 0 == client.ping().worker
    finally:
        client.close()
