#!/usr/bin/env python3
"""LMCache 0.5.7rc3's own vLLM adapters against a running mpcache: a hybrid model (a full-attention group, a
sliding-window group and a recurrent group) and a single-group model, stored, looked up and retrieved, through
the shared-memory pool or inline, every retrieved byte checked.

Run with the interpreter of ``.ci/lmcache057-env``'s venv (``lmcache``, ``torch``, ``pyzmq``; no mpcache)::

    python tests/lmcache/hybrid057.py --url tcp://127.0.0.1:PORT --model hybrid [--as-uid UID]

``--as-uid`` drops to that uid after the imports, before the first connection: the cache (started with
``--lmcache-allow-uid UID``) then answers ``shm_name ""`` and the worker moves its bytes inline.
``--no-shared-memory`` makes the pool impossible to open (as in a container without the shared ``/dev/shm``):
the worker falls back to inline transfer by itself.  The last
stdout line is a JSON summary; exit status 0 when every check passed.
"""

from __future__ import annotations

import os

os.environ.update(LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1")  # before lmcache

import argparse
import importlib
import json
import sys
import time
from multiprocessing import shared_memory

import torch
import zmq
from lmcache.integration.vllm import vllm_multi_process_adapter as adapters
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.token_codec import pack_token_ids

BLOCK = 16
HEADS, HEAD_SIZE = 2, 64
HINT = "lmcache.hint.engine_computed_tokens"
# (layers of the group, sliding window in tokens or -1, recurrent)
# imported lazily by the adapters: imported before --as-uid drops to a uid that cannot read this venv
LAZY_MODULES = ("lmcache.v1.multiprocess.transport.zmq_impl.client", "lmcache.v1.multiprocess.object_group_transfer",
                "lmcache.integration.request_telemetry.noop", "lmcache.v1.distributed.l2_adapters.factory",
                "lmcache.v1.distributed.serde.factory", "lmcache.v1.gpu_connector.gds_backends",
                "lmcache.v1.memory_allocators.lazy_memory_allocator", "lmcache.v1.multiprocess.transfer_context.inline",
                "zmq.asyncio", "zmq.utils.monitor")
MODELS = {"hybrid": [((0, 1), -1, False), ((2,), 128, False), ((3,), BLOCK, True)],
          "single": [((0, 1, 2, 3), -1, False)]}


def wait(what: str, poll, timeout_s: float = 30.0):
    """``poll()`` until it returns something other than None (bounded)."""
    deadline = time.monotonic() + timeout_s
    while (value := poll()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing within {timeout_s} s")
        time.sleep(0.002)
    return value


class Engine:
    """One scheduler adapter and one worker adapter (TP 1) over paged CPU KV tensors."""

    def __init__(self, url: str, model: str, chunks: int) -> None:
        self.groups = MODELS[model]
        context = zmq.Context.instance()
        config = {"lmcache.mp.mp_transfer_mode": "engine_driven", "lmcache.mp.mq_timeout": 20.0}
        strategy = adapters.ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                                    n_servers=1)
        name = f"rc3-check-{model}-{os.getpid()}"
        self.scheduler = adapters.LMCacheMPSchedulerAdapter(server_urls=[url], context=context, model_name=name,
                                                   vllm_block_size=BLOCK, parallel_strategy=strategy,
                                                   extra_config=config, required_chunk_alignment=BLOCK)
        self.worker = adapters.LMCacheMPWorkerAdapter(server_url=url, context=context, model_name=name,
                                             vllm_block_size=BLOCK, parallel_strategy=strategy, extra_config=config,
                                             required_chunk_alignment=BLOCK)
        self.chunk = self.scheduler.lmcache_tokens_per_chunk
        layers = sum(len(layers) for layers, _, _ in self.groups)
        blocks = 2 * chunks * self.chunk // BLOCK + 1  # a prompt's blocks to store from, as many to retrieve into
        self.kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, blocks, BLOCK, HEADS, HEAD_SIZE,
                                                                     dtype=torch.float16) for i in range(layers)}
        infos = [EngineGroupInfo(engine_group_id=g, layer_indices=layers, tokens_per_block=BLOCK,
                                 sw_size_tokens=window, recurrent_state=recurrent)
                 for g, (layers, window, recurrent) in enumerate(self.groups)]
        self.worker.register_kv_caches(self.kv, engine_group_infos=infos if len(infos) > 1 else [],
                                       layout_hints={"kv_layout": "NHD"})
        self.mode = type(self.worker.transfer_ctx._engine_driven_context).__name__
        self.next_block = [1] * len(self.groups)  # per group (each its own block ids); block 0 is the null block

    def blocks(self, group: int, count: int) -> list[int]:
        first = self.next_block[group]
        self.next_block[group] += count
        return list(range(first, first + count))

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[f"model.layers.{index}.self_attn.attn"]

    def kept(self, group: int, chunks: int) -> list[list[bool]]:
        """Per chunk, which of its blocks the engine still holds for a group (vLLM nulls the rest): a sliding
        window keeps the blocks within its window of the prompt's end, a recurrent group its last block only."""
        _, window, recurrent = self.groups[group]
        per_chunk = self.chunk // BLOCK
        total = chunks * per_chunk
        first = total - 1 if recurrent else (0 if window < 0 else total - window // BLOCK)
        return [[c * per_chunk + b >= first for b in range(per_chunk)] for c in range(chunks)]

    def op(self, tokens: list[int], block_ids: list[list[int]], end: int) -> adapters.LoadStoreOp:
        return adapters.LoadStoreOp(token_bytes=pack_token_ids(tokens), block_ids=block_ids, start=0, end=end)

    def store(self, rid: str, tokens: list[int], block_ids: list[list[int]], end: int) -> None:
        self.worker.batched_submit_store_requests([rid], [self.op(tokens, block_ids, end)], None, cache_salts=[""])
        wait("store", lambda: rid if rid in (self.worker.get_finished({rid})[0] or set()) else None)

    def lookup(self, rid: str, tokens: list[int]) -> int:
        assert self.scheduler.maybe_submit_lookup_request(rid, pack_token_ids(tokens), cache_salt="",
                                                          request_configs={HINT: 0}, start=0)
        hit = wait("lookup", lambda: self.scheduler.check_lookup_result(rid))
        self.scheduler.cleanup_lookup_result(rid)
        return hit

    def retrieve(self, rid: str, tokens: list[int], block_ids: list[list[int]], end: int) -> set[str]:
        self.worker.batched_submit_retrieve_requests([rid], [self.op(tokens, block_ids, end)], None,
                                                     cache_salts=[""])
        wait("retrieve", lambda: rid if rid in (self.worker.get_finished(set())[1] or set()) else None)
        return set(self.worker.get_failed_request_ids())


def served(engine: Engine, group: int, chunks: int) -> list[bool]:
    """Per block of the request, whether a retrieve writes it back: a windowed group returns its window's last
    chunks only, and of each the blocks it stores (its window's trailing tokens)."""
    _, window, recurrent = engine.groups[group]
    per_chunk = engine.chunk // BLOCK
    if window < 0:
        return [True] * chunks * per_chunk
    window_chunks = -(-window // engine.chunk)
    stored = min(engine.chunk, window) // BLOCK
    return [c >= chunks - window_chunks and b >= per_chunk - stored for c in range(chunks) for b in range(per_chunk)]


def run(engine: Engine, chunks: int) -> dict:
    """Store a prompt of ``chunks`` chunks (each group's null blocks left out, as vLLM's), look it up, retrieve it
    into fresh blocks: every block a retrieve must write holds the stored bytes, every other one stays zero."""
    per_chunk = engine.chunk // BLOCK
    tokens = [(7919 * i + 13) % 50_000 for i in range(chunks * engine.chunk + 17)]
    end = chunks * engine.chunk
    gen = torch.Generator().manual_seed(1)
    stored_ids, read_ids = [], []
    for group, (layers, _, _) in enumerate(engine.groups):
        kept = sum(engine.kept(group, chunks), [])
        stored_ids.append([block if keep else 0 for block, keep in zip(engine.blocks(group, chunks * per_chunk), kept)])
        read_ids.append(engine.blocks(group, chunks * per_chunk))
        for layer in layers:
            for block in stored_ids[-1]:
                if block:
                    engine.layer(layer)[:, block] = torch.randn(2, BLOCK, HEADS, HEAD_SIZE, generator=gen).half()
    began = time.perf_counter()
    engine.store("w", tokens, stored_ids, end)
    stored_at = time.perf_counter()
    hit = engine.lookup("r", tokens)
    looked_up = time.perf_counter()
    failed = engine.retrieve("r", tokens, read_ids, hit)
    seconds = {"store_s": round(stored_at - began, 4), "retrieve_s": round(time.perf_counter() - looked_up, 4)}
    engine.scheduler.end_session("w")
    engine.scheduler.end_session("r")
    checked = wrong = moved = 0
    for group, (layers, _, _) in enumerate(engine.groups):
        for layer in layers:
            tensor = engine.layer(layer)
            for source, target, back in zip(stored_ids[group], read_ids[group], served(engine, group, chunks)):
                want = tensor[:, source] if back and source else torch.zeros_like(tensor[:, target])
                checked += 1
                wrong += not torch.equal(tensor[:, target], want)
                moved += want.numel() * want.element_size() if back and source else 0
    return {"chunk_tokens": engine.chunk, "chunks": chunks, "hit_tokens": hit, "failed": sorted(failed),
            "blocks_checked": checked, "blocks_wrong": wrong, "bytes_retrieved": moved, **seconds}


def _no_pool(*args: object, **kwargs: object) -> None:
    raise FileNotFoundError("no shared /dev/shm here")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="hybrid")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--as-uid", type=int)
    parser.add_argument("--no-shared-memory", action="store_true")
    args = parser.parse_args()
    if args.no_shared_memory:
        shared_memory.SharedMemory = _no_pool  # type: ignore[misc]
    if args.as_uid is not None:
        for module in LAZY_MODULES:
            importlib.import_module(module)
        os.setgroups([])
        os.setgid(args.as_uid)
        os.setuid(args.as_uid)
    engine = Engine(args.url, args.model, args.chunks)
    result = {"model": args.model, "uid": os.getuid(), "transfer": engine.mode, **run(engine, args.chunks)}
    result["ok"] = (not result["failed"] and not result["blocks_wrong"] and result["bytes_retrieved"] > 0
                    and result["hit_tokens"] == args.chunks * engine.chunk)
    engine.worker.shutdown()
    engine.scheduler.shutdown()
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
