"""CudaTransfer's logic on a machine without CUDA, against a stand-in ``cupy`` that copies host memory.

This pins what the server does with a stream-timed transfer — staging batches, which slots and blocks
are copied, START/END published after the copy with the stream's timestamps, device ``cuda:0``, and the
throughput the L0↔L1 subscriber computes from them — not CUDA itself (tests/gpu does that on a GPU).
The stand-in stream has a clock that copies advance at 1 byte/ns, so stream timestamps are exact.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.cache_harness import CHUNK_BYTES, MODEL, fill_blocks

from mpcache.cache import transfer
from mpcache.contract.events import EventType as E
from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.subscribers.metrics.l0_l1_throughput import (
    L0L1ThroughputSubscriber,
)

T0 = 1_700_000_000 * 10**9


class FakeCuda:
    """Just enough of cupy/cupyx for mpcache.cache.transfer: IPC handles name host arrays here."""

    def __init__(self) -> None:
        self.stream_ms = 0.0  # the fake stream's clock
        self.exported: dict[bytes, np.ndarray] = {}
        self.copies: list[tuple[int, int]] = []  # (size, kind)
        self.callbacks = 0
        fake = self

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.t = None

            def record(self, stream=None):
                self.t = fake.stream_ms

            def synchronize(self):
                assert self.t is not None

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False):
                assert non_blocking, "copies must not run on the legacy default stream"
                self.ptr = 1234

            def synchronize(self):
                pass

            def launch_host_func(self, *args):  # never to be used: the GIL deadlock
                fake.callbacks += 1

        class Device:
            def __init__(self, index=0):
                self.index = index

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        def memcpy_async(dst, src, size, kind, stream):
            ctypes.memmove(dst, src, size)
            fake.copies.append((size, kind))
            fake.stream_ms += size / 1e6  # 1 byte/ns

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: 1,
            ipcOpenMemHandle=lambda handle, flags=1: fake.exported[handle].ctypes.data,
            ipcCloseMemHandle=lambda ptr: None,
            memcpyAsync=memcpy_async,
        )
        self.cupy = types.ModuleType("cupy")
        self.cupy.cuda = types.SimpleNamespace(
            runtime=runtime, Event=Event, Stream=Stream, Device=Device,
            get_elapsed_time=lambda a, b: b.t - a.t,
        )
        self.cupyx = types.ModuleType("cupyx")
        self.cupyx.empty_pinned = lambda shape, dtype: np.zeros(shape, dtype=dtype)

    def export(self, array: np.ndarray) -> str:
        handle = bytes([len(self.exported) + 1]) * 64
        self.exported[handle] = array
        return handle.hex()


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", fake.cupy)
    monkeypatch.setitem(sys.modules, "cupyx", fake.cupyx)
    monkeypatch.setattr(transfer._CudaDevice, "_devices", {})
    return fake


def test_store_and_retrieve_through_a_stream_timed_transfer(cache, fake_cuda):
    """A 'GPU' buffer registered by handle stores 3 blocks and retrieves them into 3 others, byte-exact;
    START/END are published after each copy, stamped where the stream reached them (one anchor at the
    server clock's T0, then 3 × 4096 bytes at 1 byte/ns per copy), on device cuda:0, so both throughput
    histograms get exactly 1 GB/s."""
    harness = cache({"clock_ns": lambda: T0})
    client = harness.client()
    gpu = np.zeros((8, CHUNK_BYTES), dtype=np.uint8)
    fill = types.SimpleNamespace(blocks=gpu[:3])
    fill_blocks(fill, seed=5)
    reply = client.call("register_cuda_buffer", ipc_handle=fake_cuda.export(gpu), device_index=0, num_blocks=8,
                        block_bytes=CHUNK_BYTES)
    buffer_id = reply["buffer_id"]
    harness.events.take()

    stored = client.store(buffer_id, request_id="s", model_name=MODEL, chunk_hashes=[1, 2, 3], block_ids=[0, 1, 2],
                          engine_id=4).stored
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, chunk_hashes=[1, 2, 3])
    retrieved = client.retrieve(buffer_id, request_id="r", job_id=job, block_ids=[5, 6, 7], engine_id=4).retrieved
    batch = harness.events.take()

    assert ({"buffer_id": buffer_id, "device": "cuda:0"}, 3, 3) == (reply, stored, retrieved)
    np.testing.assert_array_equal(gpu[0:3], gpu[5:8])
    span = 3 * CHUNK_BYTES
    assert [(E.MP_STORE_START, T0), (E.MP_STORE_END, T0 + span), (E.MP_RETRIEVE_START, T0 + span),
            (E.MP_RETRIEVE_END, T0 + 2 * span)] == [
        (e.etype, e.timestamp_ns)
        for e in batch.events([E.MP_STORE_START, E.MP_STORE_END, E.MP_RETRIEVE_START, E.MP_RETRIEVE_END])]
    assert [E.MP_REQUEST_START, E.MP_STORE_SUBMITTED, E.L1_WRITE_RESERVED, E.MRC_STORE_SAMPLED, E.MP_STORE_START,
            E.L1_WRITE_FINISHED, E.MP_STORE_END, E.SM_WRITE_FINISHED] == [e.etype for e in batch.events()][:8]
    assert {"cuda:0"} == {e.fields["device"] for e in batch.events([E.MP_STORE_SUBMITTED, E.MP_STORE_START,
                                                                    E.MP_STORE_END, E.MP_RETRIEVE_SUBMITTED])}
    assert ([(CHUNK_BYTES, 2)] * 3 + [(CHUNK_BYTES, 1)] * 3, 0) == (fake_cuda.copies, fake_cuda.callbacks)

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    bus = EventBus()
    bus.subscribe(L0L1ThroughputSubscriber(provider.get_meter("test")))
    bus.dispatch(batch)
    points = {(m.name, p.attributes["device"]): (p.count, p.sum)
              for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics for p in m.data.data_points}
    provider.shutdown()
    assert {("lmcache_mp.l0_l1_store_throughput", "cuda:0"): (1, 1.0),
            ("lmcache_mp.l0_l1_load_throughput", "cuda:0"): (1, 1.0)} == points


def test_copies_larger_than_the_staging_buffer_go_in_batches(fake_cuda, monkeypatch):
    """With room for 2 blocks in staging, 5 blocks are copied in batches of 2, 2 and 1 — each checked
    first — and every block lands at its byte offset (32 bytes apart), both ways."""
    monkeypatch.setattr(transfer, "STAGING_BYTES", 2 * 16)
    gpu = np.arange(6 * 16, dtype=np.uint8).reshape(6, 16)
    buffer = transfer.open_cuda_buffer(bytes.fromhex(fake_cuda.export(gpu)), 0, 6, 16, clock_ns=lambda: T0)
    pool = np.zeros(5 * 32, dtype=np.uint8)
    checks = []
    buffer.transfer.to_l1(pool, [(b, 32 * (4 - b)) for b in range(5)], 16, lambda: checks.append("in"))
    expected_pool = pool.reshape(5, 32)[:, :16].copy()
    gpu[:] = 0
    buffer.transfer.from_l1(pool, [(b, 32 * (4 - b)) for b in range(5)], 16, lambda: checks.append("out"))

    assert [list(range(16 * (4 - s), 16 * (5 - s))) for s in range(5)] == expected_pool.tolist()
    assert (np.arange(5 * 16).reshape(5, 16).tolist(), [0] * 16) == (gpu[:5].tolist(), gpu[5].tolist())
    assert ["in"] * 3 + ["out"] * 3 == checks


def test_open_cuda_buffer_refuses_a_device_that_is_not_there(fake_cuda):
    """device_index beyond the devices this process sees is a one-line request error."""
    with pytest.raises(transfer.RequestError) as raised:
        transfer.open_cuda_buffer(b"\1" * 64, 3, 1, 16)
    assert "device_index: 3 is not one of this process's 1 CUDA devices" == str(raised.value)
