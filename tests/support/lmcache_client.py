"""A hand-framing LMCache MP-protocol client for tests (pyzmq + msgpack, no LMCache, no torch)."""

from __future__ import annotations

import itertools
import mmap
import os
from typing import Any

import msgpack
import numpy as np
import zmq

from support.zmq_sockets import dealer

OBJECT_BYTES = 2 * 2 * 256 * 128 * 2  # the KV object of the captured conversations' model (fp16, chunk 256)
HINT = "lmcache.hint.engine_computed_tokens"
NO_RESULT = object()  # a reply without a result frame (the operation's result was None)
REPLY_TIMEOUT_S = 5.0  # how long a call waits for its reply, unless told otherwise

OPS = {"register_kv_cache": 1, "store": 6, "retrieve": 7, "lookup": 8, "query_prefetch_status": 9,
       "wait_prefetch_status": 10, "free_lookup_locks": 12, "end_session": 13, "register": 14, "unregister": 15,
       "prepare_store": 16, "commit_store": 17, "prepare_retrieve": 18, "commit_retrieve": 19, "clear": 20,
       "get_chunk_size": 21, "ping": 22, "report_block_allocation": 23, "noop": 24, "get_experimental": 32}


class LMClient:
    """One DEALER connection; :meth:`call` sends ``[uid, op, args…]`` and returns the decoded result."""

    def __init__(self, url: str, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self._timeout_ms = int(timeout_s * 1000)
        self.socket = dealer(timeout_ms=self._timeout_ms)
        self.socket.connect(url)
        self._uids = itertools.count()

    def send_raw(self, frames: list[bytes]) -> list[bytes]:
        """Send frames as they are; the reply's frames (AssertionError when they cannot be sent or no reply
        comes in time)."""
        try:
            self.socket.send_multipart(frames)
        except zmq.Again:
            raise AssertionError(f"could not send {frames[:2]!r} within {self._timeout_ms} ms") from None
        assert self.socket.poll(self._timeout_ms), f"no reply within {self._timeout_ms} ms to {frames[:2]!r}"
        return self.socket.recv_multipart()

    def call(self, op: str | int, *args: Any) -> Any:
        uid = next(self._uids)
        op_value = OPS.get(op, op) if isinstance(op, str) else op
        reply = self.send_raw([msgpack.packb(uid), msgpack.packb(op_value)]
                              + [msgpack.packb(arg, use_bin_type=True) for arg in args])
        assert [msgpack.packb(uid), msgpack.packb(op_value)] == reply[:2], "the reply must echo uid and op"
        assert len(reply) in (2, 3), f"a reply has 2 or 3 frames, got {len(reply)}"
        return NO_RESULT if len(reply) == 2 else msgpack.unpackb(reply[2], raw=False)

    def close(self) -> None:
        self.socket.close(linger=0)


def key(tokens: list[int], request_id: str, *, model: str = "org/model", world_size: int = 1,
        worker_id: int | None = None, start: int = 0, end: int | None = None, salt: str = "",
        readers: int = 1) -> dict:
    """An IPCCacheServerKey map as LMCache's client sends it."""
    return {"model_name": model, "world_size": world_size, "worker_id": worker_id, "token_ids": tokens,
            "start": start, "end": len(tokens) if end is None else end, "request_id": request_id,
            "cache_salt": salt, "request_configs": None, "num_kv_readers": readers}


def packed_key(tokens: list[int], request_id: str, *, engine_hit: int | None = None, **fields) -> dict:
    """A key as LMCache 0.5.7 sends it: ``token_bytes`` (big-endian uint32 per token), the engine's prefix-cache
    hit in ``request_configs``."""
    listed = key(tokens, request_id, **fields)
    del listed["token_ids"]
    listed["token_bytes"] = np.asarray(tokens, dtype=">u4").tobytes()
    if engine_hit is not None:
        listed["request_configs"] = {HINT: engine_hit}
    return listed


def map_pool(reply: dict) -> mmap.mmap:
    """The L1 pool a registration reply names, mapped as a worker maps it."""
    fd = os.open(os.path.join("/dev/shm", reply["shm_name"]), os.O_RDWR)
    try:
        return mmap.mmap(fd, reply["pool_size"])
    finally:
        os.close(fd)


def registration(instance_id: int, *, model: str = "org/model", world_size: int = 1, layers: int = 2,
                 hidden: int = 64, dtype: str = "float16", mla: bool = False, slots: int = 256) -> dict:
    return {"instance_id": instance_id, "model_name": model, "world_size": world_size, "block_size": 16,
            "num_layers": layers, "hidden_dim_size": hidden, "dtype_str": dtype, "use_mla": mla,
            "num_physical_slots": slots}


def write_slots(pool, slots: list[dict], seed: int) -> list[bytes]:
    """Fill each prepared slot of a mapped L1 pool with reproducible bytes (as a worker copies KV in)."""
    written = []
    for index, slot in enumerate(slots):
        data = np.random.default_rng(seed * 1000 + index).integers(0, 256, slot["length"], dtype=np.uint8).tobytes()
        pool[slot["offset"] : slot["offset"] + slot["length"]] = data
        written.append(data)
    return written


def read_slots(pool, slots: list[dict]) -> list[bytes]:
    """The bytes of each slot of a mapped L1 pool (as a worker copies KV out)."""
    return [pool[slot["offset"] : slot["offset"] + slot["length"]] for slot in slots]
