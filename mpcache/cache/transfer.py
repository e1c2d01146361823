"""Copies between a client's KV buffer and L1 objects (byte ranges of the pool): numpy for shared memory, a
CUDA stream for GPU buffers (START/END stamped where the stream reached them, read back from CUDA events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from mpcache.errors import RequestError

Pairs = Sequence[tuple[int, int]]  # (block id in the client's buffer, byte offset of its L1 object)
Check = Callable[[], None]  # raises (a timeout) to abandon the copy; called before each block or batch

NO_CUDA = "register_cuda_buffer: this cache process has no CUDA (cupy not installed or no CUDA device)"
STAGING_BYTES = 64 << 20  # pinned staging per device; a request larger than this is copied in batches
CALIBRATE_EVERY_NS = 10 * 10**9  # re-anchor stream time to the wall clock this often
_MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyKind
_MEMCPY_DEVICE_TO_HOST = 2


def _no_check() -> None:
    return None


class Timing(NamedTuple):
    """Wall-clock ns at which the copy started and ended, as the stream saw them."""

    start_ns: int
    end_ns: int


class Transfer:
    """What the server's store and retrieve need from a client buffer."""

    device: str = "cpu"
    stream_timed: bool = False  # True: START/END come from the copy's Timing, published after it

    def to_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing | None:
        """Copy ``nbytes`` of each block into its L1 object (``pool[offset : offset + nbytes]``)."""
        raise NotImplementedError

    def from_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing | None:
        """Copy ``nbytes`` of each L1 object into its block."""
        raise NotImplementedError


class CpuTransfer(Transfer):
    """Blocks of a shared-memory buffer (``blocks[i]`` is block i), copied by numpy."""

    def __init__(self, blocks: np.ndarray) -> None:
        self._blocks = blocks

    def to_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> None:
        blocks = self._blocks
        for block, offset in pairs:
            check()
            pool[offset : offset + nbytes] = blocks[block]
        return None

    def from_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> None:
        blocks = self._blocks
        for block, offset in pairs:
            check()
            blocks[block] = pool[offset : offset + nbytes]
        return None


class ClosedTransfer(Transfer):
    """A closed buffer's transfer: it holds no reference to the buffer's memory and copies nothing."""

    def to_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing | None:
        raise RequestError("the buffer is closed")

    def from_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing | None:
        raise RequestError("the buffer is closed")


CLOSED = ClosedTransfer()


def cuda_device_count() -> int:
    """CUDA devices cupy can use here; 0 without cupy, a driver or a device."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA install raising on import
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - cupy raises CUDARuntimeError without a driver/device
        return 0


def open_cuda_buffer(handle: bytes, device_index: int, num_blocks: int, block_bytes: int, *,
                     clock_ns: Callable[[], int] = time.time_ns) -> CudaBuffer:
    """Open a client's GPU buffer from its IPC handle; RequestError (one line) if that cannot be done."""
    count = cuda_device_count()
    if count == 0:
        raise RequestError(NO_CUDA)
    if device_index >= count:
        raise RequestError(f"device_index: {device_index} is not one of this process's {count} CUDA devices")
    try:
        device = _CudaDevice.get(device_index, clock_ns)
        return CudaBuffer(device, handle, num_blocks, block_bytes)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError and friends become a request error
        raise RequestError(f"ipc_handle: cannot open it on cuda:{device_index}: {exc}") from None


class _CudaDevice:
    """Per device and process: the copy stream, the pinned staging buffer and the stream clock."""

    _devices: dict[int, _CudaDevice] = {}

    @classmethod
    def get(cls, index: int, clock_ns: Callable[[], int]) -> _CudaDevice:
        device = cls._devices.get(index)
        if device is None:
            device = cls._devices[index] = cls(index, clock_ns)
        return device

    def __init__(self, index: int, clock_ns: Callable[[], int]) -> None:
        import cupy
        import cupyx

        self.cupy = cupy
        self.index = index
        self.name = f"cuda:{index}"
        self._clock_ns = clock_ns
        with cupy.cuda.Device(index):
            self.stream = cupy.cuda.Stream(non_blocking=True)  # never the legacy default stream
            self.staging = cupyx.empty_pinned((STAGING_BYTES,), dtype=np.uint8)
            self._anchor = cupy.cuda.Event(block=True)
        self._anchor_ns = 0
        self._anchored_at = -CALIBRATE_EVERY_NS

    def use(self):
        return self.cupy.cuda.Device(self.index)

    def calibrate(self) -> None:
        """Anchor stream time to the wall clock (an idle stream, so the event completes at once)."""
        now = self._clock_ns()
        if now - self._anchored_at < CALIBRATE_EVERY_NS:
            return
        self._anchor.record(self.stream)
        self._anchor.synchronize()
        self._anchor_ns = self._clock_ns()
        self._anchored_at = self._anchor_ns

    def wall_ns(self, event) -> int:
        """When the stream reached ``event`` (completed), on the wall clock: anchor + elapsed time."""
        elapsed_ms = self.cupy.cuda.get_elapsed_time(self._anchor, event)
        return self._anchor_ns + int(round(elapsed_ms * 1e6))


class CudaBuffer:
    """A client's GPU KV buffer opened from a CUDA IPC handle; the server's buffer interface."""

    def __init__(self, device: _CudaDevice, handle: bytes, num_blocks: int, block_bytes: int) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._device = device
        runtime = device.cupy.cuda.runtime
        with device.use():
            self.ptr = runtime.ipcOpenMemHandle(handle)
        self.transfer: Transfer = CudaTransfer(device, self.ptr, block_bytes)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.transfer = CLOSED
            try:
                with self._device.use():
                    self._device.stream.synchronize()
                    self._device.cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception:  # noqa: BLE001 - closing at disconnect must not fail the loop
                pass


class CudaTransfer(Transfer):
    """Device blocks at ``base + block × block_bytes`` ⇄ L1 objects, through pinned staging, on one stream."""

    stream_timed = True

    def __init__(self, device: _CudaDevice, base: int, block_bytes: int) -> None:
        self.device = device.name
        self._dev = device
        self._base = base
        self._block_bytes = block_bytes

    def _batches(self, pairs: Pairs, nbytes: int) -> list[Pairs]:
        per = max(1, STAGING_BYTES // nbytes)
        return [pairs[i : i + per] for i in range(0, len(pairs), per)]

    def to_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing:
        def batch_copy(batch: Pairs, staging: np.ndarray, address: int, memcpy, stream, end) -> None:
            for i, (block, _) in enumerate(batch):
                memcpy(address + i * nbytes, self._base + block * self._block_bytes, nbytes,
                       _MEMCPY_DEVICE_TO_HOST, stream.ptr)
            end.record(stream)
            end.synchronize()  # the staging rows are complete (a blocking wait, not a callback)
            for i, (_, offset) in enumerate(batch):
                pool[offset : offset + nbytes] = staging[i * nbytes : (i + 1) * nbytes]

        return self._timed_copy(pairs, nbytes, check, batch_copy)

    def from_l1(self, pool: np.ndarray, pairs: Pairs, nbytes: int, check: Check = _no_check) -> Timing:
        def batch_copy(batch: Pairs, staging: np.ndarray, address: int, memcpy, stream, end) -> None:
            for i, (_, offset) in enumerate(batch):
                staging[i * nbytes : (i + 1) * nbytes] = pool[offset : offset + nbytes]
            for i, (block, _) in enumerate(batch):
                memcpy(self._base + block * self._block_bytes, address + i * nbytes, nbytes,
                       _MEMCPY_HOST_TO_DEVICE, stream.ptr)
            end.record(stream)
            end.synchronize()  # staging may be reused, and the client may read its blocks on reply

        return self._timed_copy(pairs, nbytes, check, batch_copy)

    def _timed_copy(self, pairs: Pairs, nbytes: int, check: Check, batch_copy) -> Timing:
        """Run ``batch_copy`` over staging-sized batches on the device's stream, between two CUDA
        events whose times (read back after the copy, never via a host callback) bracket it."""
        dev = self._dev
        cupy = dev.cupy
        with dev.use():
            dev.calibrate()
            stream = dev.stream
            start, end = cupy.cuda.Event(), cupy.cuda.Event(block=True)
            start.record(stream)
            for batch in self._batches(list(pairs), nbytes):
                check()
                batch_copy(batch, dev.staging, dev.staging.ctypes.data, cupy.cuda.runtime.memcpyAsync, stream, end)
            if not pairs:
                end.record(stream)
                end.synchronize()
            return Timing(dev.wall_ns(start), dev.wall_ns(end))
