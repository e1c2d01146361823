"""The copy interface of store/retrieve on a machine without CUDA: the CPU transfer, and the GPU op's refusals.

The GPU path itself is exercised by tests/gpu (marked ``gpu``; skipped without cupy and a CUDA device).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from support.cache_harness import CHUNK_BYTES

from mpcache.cache import transfer
from mpcache.errors import ProtocolError, RequestError

NO_CUDA_HERE = transfer.cuda_device_count() == 0
HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_cpu_transfer_copies_blocks_to_and_from_byte_offsets_and_checks_before_each_block():
    """to_l1 fills the pool at the named byte offsets from the named blocks, from_l1 the other way; neither
    returns a stream timing (the server stamps START/END itself), and the check runs once per block."""
    blocks = np.arange(4 * 8, dtype=np.uint8).reshape(4, 8)
    pool = np.zeros(48, dtype=np.uint8)
    mover = transfer.CpuTransfer(blocks)
    checks = []
    timings = (mover.to_l1(pool, [(2, 0), (0, 32)], 8, lambda: checks.append("in")),
               mover.from_l1(pool, [(1, 0)], 8, lambda: checks.append("out")))

    assert ("cpu", False, (None, None)) == (mover.device, mover.stream_timed, timings)
    assert [blocks[2].tolist(), [0] * 8, blocks[0].tolist()] == pool.reshape(3, 16)[:, :8].tolist()
    assert (blocks[2].tolist(), ["in", "in", "out"]) == (blocks[1].tolist(), checks)


@pytest.mark.skipif(not NO_CUDA_HERE, reason="this machine has CUDA; tests/gpu covers register_cuda_buffer")
def test_register_cuda_buffer_on_a_cpu_only_server_is_a_clear_one_line_error(cache):
    """Without cupy or a CUDA device the server refuses the op, saying why, and goes on serving."""
    harness = cache()
    client = harness.client()
    with pytest.raises(RequestError) as raised:
        client.call("register_cuda_buffer", ipc_handle="ab" * 64, device_index=0, num_blocks=4,
                    block_bytes=CHUNK_BYTES)
    assert (transfer.NO_CUDA, 0) == (str(raised.value), client.ping().worker)


@pytest.mark.parametrize(("args", "error"), [
    ({"ipc_handle": "ab" * 63, "device_index": 0, "num_blocks": 1, "block_bytes": 1},
     "ipc_handle: expected 128 hex digits (a CUDA IPC memory handle)"),
    ({"ipc_handle": "zz" * 64, "device_index": 0, "num_blocks": 1, "block_bytes": 1},
     "ipc_handle: expected 128 hex digits (a CUDA IPC memory handle)"),
    ({"ipc_handle": "ab" * 64, "device_index": -1, "num_blocks": 1, "block_bytes": 1},
     "device_index: -1 is outside 0..1023"),
    ({"ipc_handle": "ab" * 64, "device_index": 0, "num_blocks": 0, "block_bytes": 1},
     "num_blocks: 0 is outside 1..16777216"),
])
def test_register_cuda_buffer_arguments_are_validated(cache, args, error):
    """The handle must be 64 bytes in hex, the device index and sizes in range — checked before any CUDA call."""
    harness = cache()
    with pytest.raises(ProtocolError) as raised:
        harness.client().call("register_cuda_buffer", **args)
    assert error == str(raised.value)


def test_a_cuda_buffer_larger_than_a_chunk_per_block_is_refused(cache):
    """As for shared-memory buffers, a block may not be larger than an L1 chunk."""
    harness = cache()
    with pytest.raises(RequestError) as raised:
        harness.client().call("register_cuda_buffer", ipc_handle="ab" * 64, device_index=0, num_blocks=1,
                              block_bytes=CHUNK_BYTES + 1)
    assert f"block_bytes: {CHUNK_BYTES + 1} is larger than the chunk size {CHUNK_BYTES}" == str(raised.value)


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here")
def test_the_client_says_that_cuda_buffers_need_cupy(cache):
    """Without cupy, CacheClient.register_cuda_buffer raises before it sends anything."""
    harness = cache()
    with pytest.raises(RuntimeError) as raised:
        harness.client().register_cuda_buffer(4, CHUNK_BYTES)
    assert "register_cuda_buffer needs cupy (pip install 'mpcache[gpu]')" == str(raised.value)
