#!/usr/bin/env python3
"""Drive an LMCache-compatible MP server through LMCache's own vLLM adapters (0.5.6 or 0.5.7rc3).

Run with the interpreter of the venv that ``.ci/lmcache-env`` (LMCache 0.5.6) or
``.ci/lmcache057-env`` (LMCache 0.5.7rc3) builds (it needs ``lmcache``, ``torch`` and
``pyzmq``; it never imports mpcache or pytest)::

    "$(.ci/lmcache-env | tail -n1)/bin/python" benchmarks/harness/driver.py \
        --url tcp://127.0.0.1:5555 --scenario all [--tp 2] [--mla]

The installed client decides the protocol: 0.5.7rc3 (recognised by its token codec) gets
keys of packed tokens, negotiates the chunk size with ``--chunk-alignment`` and sends
start-aware lookups with the ``lmcache.hint.engine_computed_tokens`` hint, as rc3's
connector does; its ``all`` adds the ``lookup_start`` scenario.

It plays the part vLLM's ``LMCacheMPConnector`` plays
(``lmcache/integration/vllm/lmcache_mp_connector.py``): one
``LMCacheMPSchedulerAdapter`` for lookups, lock releases and sessions, and one
``LMCacheMPWorkerAdapter`` per tensor-parallel rank holding paged CPU KV
tensors, registered with ``register_kv_caches`` and moved with
``submit_store_request`` / ``submit_retrieve_request`` / ``get_finished`` in the
engine-driven (shared-memory) transfer mode.  Every chunk's bytes are a
deterministic function of (token prefix, cache salt, layer, rank), so whatever
a retrieve writes into zeroed blocks is checked byte for byte.

The LAST line of stdout is one JSON object: ``ok``, per-scenario ``pass`` /
``reason`` / ``counts``, and ``totals`` (lookups, requested chunks, hit chunks
overall and per server, stored and retrieved chunks, objects and transfers) to
compare with the server's own metrics (``tests/lmcache/test_adapters.py`` does).
The ``survive_restart`` scenario (not in ``all``) prints ``RESTART_READY`` on a
line of its own first and then waits for a line on stdin.  Exit
status: 0 when every scenario passed, 1 when one failed, 2 on a usage or setup
error, 3 when the whole run overran ``--timeout``.
"""

from __future__ import annotations

import os

# Before anything imports lmcache: no usage reports leave this machine.
os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse
import functools
import hashlib
import json
import math
import random
import select
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import lmcache
import torch
import zmq
from lmcache.integration.vllm.kv_cache_groups import (
    create_engine_group_infos_from_vllm,
)
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    CacheRemoveEvent,
    CacheStoreEvent,
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

# LMCache 0.5.7rc3 changed the adapters' API with the wire protocol; it is recognised by its token
# codec (keys carry tokens packed as big-endian uint32 instead of a list of ints).
try:
    from lmcache.v1.multiprocess.token_codec import pack_token_ids
except ImportError:  # LMCache 0.5.6
    pack_token_ids = None
CLIENT_057 = pack_token_ids is not None
# rc3's connector puts vLLM's prefix-cache hit into every lookup's request_configs under this name.
ENGINE_COMPUTED_HINT = "lmcache.hint.engine_computed_tokens"

SCENARIOS = (
    "cold_miss_then_store",
    "full_hit",
    "partial_hit",
    "prefix_cache_skip",
    "two_salts",
    "concurrent",
    "eviction",
)
# Part of "all" with LMCache 0.5.7rc3 only: lookups that start past vLLM's prefix cache.
SCENARIOS_057 = ("lookup_start",)
# Not part of "all": lock_release clears the server's whole cache (a non-forced CLEAR);
# survive_restart waits for someone to kill and restart a server (see its docstring); kv_events
# needs --kv-events (the workers consume the server's KV event stream).
EXTRA_SCENARIOS = ("lock_release", "survive_restart", "kv_events")
# survive_restart prints this line on stdout when the servers may be killed and restarted.
RESTART_READY = "[driver] survive_restart: READY for the server restart"

DTYPES = {
    "float16": (torch.float16, torch.int16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "float32": (torch.float32, torch.int32),
}

SENTINEL = 0x5A5A  # int16 pattern written where a retrieve must not write
POLL_S = 0.002


class ScenarioFailure(Exception):
    """A check failed; the message is the human-readable reason."""


class Deadline:
    def __init__(self, seconds: float, what: str) -> None:
        self.end = time.monotonic() + seconds
        self.what = what

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, doing: str) -> None:
        if time.monotonic() > self.end:
            raise ScenarioFailure(f"{self.what}: deadline passed while {doing}")


def poll(fn: Callable[[], Any], deadline: Deadline, doing: str) -> Any:
    """Call fn until it returns something other than None, within the deadline."""
    while True:
        value = fn()
        if value is not None:
            return value
        deadline.check(doing)
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------

COUNTER_NAMES = (
    "lookups",  # scheduler lookups (each goes to every server)
    "lookup_rpcs",  # lookups x servers
    "requested_chunks",  # per lookup RPC: whole chunks of the key from its start (what each server looks up)
    "hit_chunks",  # sum of the hit chunk counts the scheduler adapter returned
    "server_hit_chunks",  # per lookup RPC: the hit chunks that server answered past the start (sum over servers)
    "covered_chunks",  # per lookup RPC: chunks below a start-aware lookup's start (answered as hit, not looked up)
    "free_lookup_locks",  # free_lookup_locks calls (each goes to every server)
    "end_sessions",
    "store_requests",  # per writing rank, submit_store_request calls that reached the server
    "stored_chunks",  # token chunks covered by store requests (logical, once per request)
    "stored_objects",  # per rank: chunk objects the server reserved (prepare_store chunk_indices)
    "store_transfers",  # per rank: prepare_store calls that reserved at least one object
    "store_skipped_objects",  # per rank: chunk objects asked for but not reserved
    "store_commit_failures",  # per rank: commit_store answered False / timed out
    "retrieve_requests",  # per rank
    "retrieved_chunks",  # token chunks covered by retrieves (logical, once per request)
    "retrieved_objects",  # per rank: slots prepare_retrieve handed out
    "retrieve_transfers",  # per rank: prepare_retrieve calls that handed out at least one slot
    "retrieve_failures",  # per rank: prepare_retrieve miss / failed scatter
    "verified_chunks",  # (chunk, rank) pairs whose bytes were compared and matched
)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = {name: 0 for name in COUNTER_NAMES}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


# ---------------------------------------------------------------------------
# Deterministic KV content
# ---------------------------------------------------------------------------


def prefix_hashes(tokens: list[int], chunk: int) -> list[bytes]:
    """Client-side prefix-chained identity of each full chunk (independent of the server)."""
    out: list[bytes] = []
    prev = b"\0" * 16
    for start in range(0, len(tokens) - len(tokens) % chunk, chunk):
        h = hashlib.blake2b(digest_size=16)
        h.update(prev)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[start : start + chunk]))
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class Geometry:
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    num_blocks: int
    tp: int
    mla: bool

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.tp

    def layer_shape(self) -> tuple[int, ...]:
        if self.mla:  # vLLM's MLA paged layout: [num_blocks, block_size, head_dim]
            return (self.num_blocks, self.block_size, self.head_size)
        return (2, self.num_blocks, self.block_size, self.heads_per_rank, self.head_size)

    def chunk_block_shape(self, blocks: int) -> tuple[int, ...]:
        if self.mla:
            return (blocks, self.block_size, self.head_size)
        return (2, blocks, self.block_size, self.heads_per_rank, self.head_size)

    def object_bytes(self, chunk_tokens: int) -> int:
        itemsize = torch.empty((), dtype=DTYPES[self.dtype][0]).element_size()
        planes = 1 if self.mla else 2
        width = self.head_size if self.mla else self.heads_per_rank * self.head_size
        return planes * self.layers * chunk_tokens * width * itemsize


def expected_chunk(
    geo: Geometry, chunk_id: bytes, salt: str, layer: int, rank: int, blocks: int
) -> torch.Tensor:
    """The integer view of one chunk's blocks for one layer on one rank."""
    h = hashlib.blake2b(digest_size=8)
    h.update(chunk_id)
    h.update(salt.encode())
    h.update(layer.to_bytes(4, "little"))
    h.update(rank.to_bytes(4, "little"))
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    int_dtype = DTYPES[geo.dtype][1]
    info = torch.iinfo(int_dtype)
    return torch.randint(
        info.min, info.max, geo.chunk_block_shape(blocks), dtype=int_dtype, generator=gen
    )


# ---------------------------------------------------------------------------
# The engine: one scheduler adapter, one worker adapter per TP rank
# ---------------------------------------------------------------------------


def load_store_op(req: Request, blocks: list[int], start: int, end: int, skip: int = 0) -> LoadStoreOp:
    """A store or retrieve of [start, end) into one KV group's blocks, in this client's key form."""
    tokens = {"token_bytes" if CLIENT_057 else "token_ids": req.key_tokens}
    return LoadStoreOp(**tokens, block_ids=[blocks], start=start, end=end, skip_first_n_tokens=skip)


@dataclass
class Request:
    rid: str
    tokens: list[int]
    salt: str = ""
    blocks: list[int] = field(default_factory=list)
    vllm_hit_tokens: int = 0  # tokens vLLM's own prefix cache already holds
    lmcache_hit_tokens: int = 0
    content_salt: str | None = None  # salt mixed into the fill (defaults to salt)
    # 0.5.7rc3's connector: where the last lookup started, whether the next one must start at 0 (vLLM's
    # cached prefix shrank below an earlier start), and the ranges abandoned lookups left locked.
    lookup_start: int = 0
    need_full_lookup: bool = False
    pending_free_ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def fill_salt(self) -> str:
        return self.salt if self.content_salt is None else self.content_salt

    @functools.cached_property
    def key_tokens(self) -> list[int] | bytes:
        """The tokens as this client's keys carry them: packed (0.5.7rc3) or a list (0.5.6)."""
        return self.tokens if pack_token_ids is None else pack_token_ids(self.tokens)


class Engine:
    """What a vLLM instance with LMCacheMPConnector does, minus the model."""

    def __init__(self, args: argparse.Namespace, counters: Counters) -> None:
        self.args = args
        self.counters = counters
        self.urls: list[str] = list(args.url)
        self.geo = Geometry(
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            tp=args.tp,
            mla=args.mla,
        )
        self.model_name = args.model_name or (
            f"mpcache-harness-L{args.layers}-H{args.kv_heads}-D{args.head_size}-"
            f"{args.dtype}-{'mla' if args.mla else 'mha'}"
        )
        self.extra_config = {
            "lmcache.mp.mq_timeout": args.mq_timeout,
            "lmcache.mp.heartbeat_interval": args.heartbeat_interval,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        }
        # 0.5.7rc3's connector always asks the server for a chunk size aligned to its block size.
        self.alignment = (
            {"required_chunk_alignment": args.chunk_alignment or None} if CLIENT_057 else {}
        )
        self.zmq_context = zmq.Context.instance()
        n_servers = len(self.urls)
        self.strategies = [
            ParallelStrategy(
                mla_only=args.mla,
                vllm_world_size=args.tp,
                vllm_worker_id=rank,
                tp_size=args.tp,
                pp_size=1,
                n_servers=n_servers,
            )
            for rank in range(args.tp)
        ]
        # vLLM's scheduler connector: every server, worker id of rank 0's strategy
        # (the scheduler only reads world size / readers from it).
        self.scheduler = LMCacheMPSchedulerAdapter(
            server_urls=self.urls,
            context=self.zmq_context,
            model_name=self.model_name,
            vllm_block_size=args.block_size,
            parallel_strategy=self.strategies[0],
            extra_config=self.extra_config,
            **self.alignment,
        )
        self.chunk = self.scheduler.lmcache_tokens_per_chunk
        self.blocks_per_chunk = self.chunk // args.block_size
        ranks_per_server = self.ranks_per_server = args.tp // n_servers
        self.workers: list[LMCacheMPWorkerAdapter] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        self._probed: list[Any] = []
        self.layout_hints = {} if args.mla else {"kv_layout": "NHD"}
        for rank in range(args.tp):
            worker = LMCacheMPWorkerAdapter(
                server_url=self.urls[rank // ranks_per_server],
                context=self.zmq_context,
                model_name=self.model_name,
                vllm_block_size=args.block_size,
                parallel_strategy=self.strategies[rank],
                extra_config=self.extra_config,
                enable_kv_events=getattr(args, "kv_events", False),  # workload.py builds its own args
                **self.alignment,
            )
            self.workers.append(worker)
            self.kv.append(
                {
                    f"model.layers.{layer}.self_attn.attn": torch.zeros(
                        self.geo.layer_shape(), dtype=DTYPES[args.dtype][0]
                    )
                    for layer in range(args.layers)
                }
            )
            self._probed.append(None)
        # register_kv_caches, as LMCacheMPConnector.register_kv_caches does it.
        for rank, worker in enumerate(self.workers):
            infos = create_engine_group_infos_from_vllm(
                None, self.kv[rank], layout_hints=self.layout_hints
            )
            worker.register_kv_caches(
                self.kv[rank], engine_group_infos=infos, layout_hints=self.layout_hints
            )
            self._install_probe(rank)
        self._block_lock = threading.Lock()
        self.reset_blocks()
        self.pool = ThreadPoolExecutor(max_workers=max(1, args.tp), thread_name_prefix="rank")
        self._rid_counter = 0

    # -- observation of the worker's engine-driven context (no behaviour change) --

    def _install_probe(self, rank: int) -> None:
        transfer = self.workers[rank].transfer_ctx
        ctx = getattr(transfer, "_engine_driven_context", None)
        if ctx is None or ctx is self._probed[rank]:
            return
        kind = type(ctx).__name__
        if kind != "EngineDrivenContextShm":
            raise ScenarioFailure(
                f"rank {rank}: worker fell back to {kind} (the shared-memory pool named in "
                "the registration reply could not be mapped); a compatible server must "
                "hand out a mappable pool"
            )
        counters = self.counters
        prepare_store, commit_store = ctx.prepare_store, ctx.commit_store
        prepare_retrieve = ctx.prepare_retrieve

        def probe_prepare_store(key: Any, instance_id: int) -> Any:
            result = prepare_store(key, instance_id)
            asked = (key.end // self.chunk) - (key.start // self.chunk)
            got = 0 if result is None else len(result[1])
            counters.add("stored_objects", got)
            if got:
                counters.add("store_transfers")
            counters.add("store_skipped_objects", asked - got)
            return result

        def probe_commit_store(key: Any, instance_id: int, chunks: Any) -> bool:
            ok = commit_store(key, instance_id, chunks)
            if not ok:
                counters.add("store_commit_failures")
            return ok

        def probe_prepare_retrieve(key: Any, instance_id: int, *expected_count: int) -> Any:
            result = prepare_retrieve(key, instance_id, *expected_count)  # rc3 passes expected_count
            if result is None:
                counters.add("retrieve_failures")
            else:
                counters.add("retrieved_objects", len(result))
                if len(result):
                    counters.add("retrieve_transfers")
            return result

        ctx.prepare_store = probe_prepare_store
        ctx.commit_store = probe_commit_store
        ctx.prepare_retrieve = probe_prepare_retrieve
        self._probed[rank] = ctx

    # -- requests and blocks --

    def new_rid(self, tag: str) -> str:
        self._rid_counter += 1
        return f"{tag}-{self.args.seed}-{self._rid_counter}"

    def reset_blocks(self) -> None:
        """Every block free again (no request outlives its scenario, even a failed one)."""
        with self._block_lock:
            self.free_blocks = list(range(self.geo.num_blocks))
            random.Random(self.args.seed).shuffle(self.free_blocks)

    def alloc(self, req: Request) -> None:
        n = math.ceil(len(req.tokens) / self.geo.block_size)
        with self._block_lock:
            if n > len(self.free_blocks):
                raise ScenarioFailure(
                    f"driver out of paged blocks ({n} wanted, {len(self.free_blocks)} free); "
                    "raise --num-blocks"
                )
            req.blocks = [self.free_blocks.pop() for _ in range(n)]

    def release(self, req: Request) -> None:
        with self._block_lock:
            self.free_blocks.extend(req.blocks)
        req.blocks = []

    def fill_rank(self, rank: int) -> int:
        """The rank whose bytes a TP rank holds (MLA replicates rank 0's)."""
        return 0 if self.geo.mla else rank

    def _layer_view(self, rank: int, layer: int) -> torch.Tensor:
        tensor = self.kv[rank][f"model.layers.{layer}.self_attn.attn"]
        return tensor.view(DTYPES[self.geo.dtype][1])

    def _index(self, blocks: list[int]) -> tuple[Any, ...]:
        idx = torch.tensor(blocks, dtype=torch.long)
        return (idx,) if self.geo.mla else (slice(None), idx)

    def write_blocks(self, req: Request, first_chunk: int, last_chunk: int) -> None:
        """'Compute' chunks [first_chunk, last_chunk) of a request into its blocks."""
        ids = prefix_hashes(req.tokens, self.chunk)
        for rank in range(self.geo.tp):
            for c in range(first_chunk, last_chunk):
                blocks = req.blocks[c * self.blocks_per_chunk : (c + 1) * self.blocks_per_chunk]
                for layer in range(self.geo.layers):
                    data = expected_chunk(
                        self.geo, ids[c], req.fill_salt, layer, self.fill_rank(rank), len(blocks)
                    )
                    self._layer_view(rank, layer)[self._index(blocks)] = data

    def set_blocks(self, req: Request, first_block: int, last_block: int, value: int) -> None:
        blocks = req.blocks[first_block:last_block]
        if not blocks:
            return
        for rank in range(self.geo.tp):
            for layer in range(self.geo.layers):
                self._layer_view(rank, layer)[self._index(blocks)] = value

    def check_blocks_equal(
        self, req: Request, first_block: int, last_block: int, value: int, what: str
    ) -> None:
        blocks = req.blocks[first_block:last_block]
        if not blocks:
            return
        for rank in range(self.geo.tp):
            for layer in range(self.geo.layers):
                got = self._layer_view(rank, layer)[self._index(blocks)]
                if not bool((got == value).all()):
                    raise ScenarioFailure(
                        f"{req.rid}: {what} (blocks {first_block}..{last_block - 1}, rank {rank}, "
                        f"layer {layer}) changed; it must keep the value {value:#x}"
                    )

    def verify_chunks(
        self, req: Request, first_chunk: int, last_chunk: int, skip_tokens: int = 0
    ) -> None:
        """Compare the request's blocks for chunks [first, last) with the expected bytes.

        The first ``skip_tokens`` tokens of the range are excluded (they belong to
        vLLM's own prefix cache and are checked separately).
        """
        ids = prefix_hashes(req.tokens, self.chunk)
        skip_blocks = skip_tokens // self.geo.block_size
        for rank in range(self.geo.tp):
            for c in range(first_chunk, last_chunk):
                lo = c * self.blocks_per_chunk
                blocks = req.blocks[lo : lo + self.blocks_per_chunk]
                offset = max(0, first_chunk * self.blocks_per_chunk + skip_blocks - lo)
                if offset >= len(blocks):
                    continue
                for layer in range(self.geo.layers):
                    want = expected_chunk(
                        self.geo, ids[c], req.fill_salt, layer, self.fill_rank(rank), len(blocks)
                    )
                    got = self._layer_view(rank, layer)[self._index(blocks)]
                    if offset:
                        want = want[:, offset:] if not self.geo.mla else want[offset:]
                        got = got[:, offset:] if not self.geo.mla else got[offset:]
                    if not torch.equal(got, want):
                        bad = (got != want).sum().item()
                        raise ScenarioFailure(
                            f"{req.rid}: retrieved bytes differ from the stored ones in chunk {c} "
                            f"(rank {rank}, layer {layer}, {bad} of {want.numel()} elements)"
                        )
                self.counters.add("verified_chunks")

    # -- scheduler side --

    def lookup_many(self, reqs: list[Request], deadline: Deadline) -> list[int]:
        """maybe_submit_lookup_request for all, then poll check_lookup_result for all."""
        for req in reqs:
            self.submit_lookup(req)
            self.counters.add("lookups")
            self.counters.add("lookup_rpcs", len(self.urls))
        hits: dict[str, int] = {}
        while len(hits) < len(reqs):
            for req in reqs:
                if req.rid in hits:
                    continue
                r = self.scheduler.check_lookup_result(req.rid)
                if r is not None:
                    hits[req.rid] = r
            if len(hits) < len(reqs):
                deadline.check(f"waiting for lookup results ({len(hits)}/{len(reqs)})")
                time.sleep(POLL_S)
        out = []
        for req in reqs:
            self._count_server_hits(req)
            req.lmcache_hit_tokens = hits[req.rid]
            if req.lmcache_hit_tokens % self.chunk:
                raise ScenarioFailure(
                    f"{req.rid}: lookup answered {req.lmcache_hit_tokens} tokens, not a chunk multiple"
                )
            self.counters.add("hit_chunks", req.lmcache_hit_tokens // self.chunk)
            out.append(req.lmcache_hit_tokens // self.chunk)
        if not self.scheduler.is_healthy:
            raise ScenarioFailure("scheduler adapter marked a server unhealthy during lookup")
        return out

    def submit_lookup(self, req: Request) -> None:
        """One lookup, as this client version's connector sends it.

        0.5.7rc3: the lookup starts at vLLM's prefix-cache hit floored to a chunk (0 after
        that hit shrank below an earlier start) and carries the hit as a hint.
        """
        if not CLIENT_057:
            self.scheduler.maybe_submit_lookup_request(req.rid, req.tokens, cache_salt=req.salt)
            return
        req.lookup_start = 0 if req.need_full_lookup else req.vllm_hit_tokens // self.chunk * self.chunk
        if not self.scheduler.maybe_submit_lookup_request(
            req.rid,
            req.key_tokens,
            cache_salt=req.salt,
            request_configs={ENGINE_COMPUTED_HINT: req.vllm_hit_tokens},
            start=req.lookup_start,
        ):
            raise ScenarioFailure(f"{req.rid}: the scheduler adapter sent no LOOKUP")

    def _server_hits(self, rid: str) -> list[int] | None:
        """Each server's answer to a lookup, from the scheduler adapter's private per-request
        state (kept until ``cleanup_lookup_result``): 0.5.6's ``_per_server_hits``, 0.5.7rc3's
        ``_lookups`` (a ``LookupState`` with one ``_Server`` per URL)."""
        if CLIENT_057:
            lookup = self.scheduler._lookups.get(rid)
            return None if lookup is None else [s.hit_chunks for s in lookup._servers.values()]
        per_server = getattr(self.scheduler, "_per_server_hits", {}).get(rid)
        return None if per_server is None else [int(v) for v in per_server.values()]

    def _count_server_hits(self, req: Request) -> None:
        """What each server answered for this lookup (the adapter reports only the minimum): the
        numbers a server's own lookup metrics are made of.  Chunks below a start-aware lookup's
        start are answered as hit but never looked up, so they count apart from both."""
        per_server = self._server_hits(req.rid)
        if per_server is None or len(per_server) != len(self.urls):
            raise ScenarioFailure(
                f"{req.rid}: the scheduler adapter holds no per-server hit counts "
                f"({per_server!r}); the driver cannot count what each server answered"
            )
        covered = req.lookup_start // self.chunk
        if min(per_server) < covered:
            raise ScenarioFailure(
                f"{req.rid}: a server answered {min(per_server)} hit chunks for a lookup starting at chunk "
                f"{covered}; the chunks below the start count as hit"
            )
        self.counters.add("server_hit_chunks", sum(per_server) - covered * len(self.urls))
        self.counters.add("covered_chunks", covered * len(self.urls))
        self.counters.add("requested_chunks", len(self.urls) * (len(req.tokens) // self.chunk - covered))

    def after_alloc(self, req: Request) -> bool:
        """update_state_after_alloc: drop lookup state, free locks vLLM won't consume.

        Returns whether a retrieve follows.
        """
        self.scheduler.cleanup_lookup_result(req.rid)
        needs_retrieve = req.lmcache_hit_tokens > req.vllm_hit_tokens
        free_end = 0
        if req.lmcache_hit_tokens > 0:
            free_end = req.vllm_hit_tokens if needs_retrieve else req.lmcache_hit_tokens
        if free_end > 0 or req.pending_free_ranges:
            self.free_lookup_locks(req, free_end)
        return needs_retrieve

    def free_lookup_locks(self, req: Request, end: int) -> None:
        """free_lookup_locks(0, end); with 0.5.7rc3 also the ranges abandoned lookups left locked."""
        if CLIENT_057:
            self.scheduler.free_lookup_locks(
                packed_token_ids=req.key_tokens,
                start=0,
                end=end,
                request_id=req.rid,
                cache_salt=req.salt,
                extra_ranges=tuple(req.pending_free_ranges),
            )
            req.pending_free_ranges = []
        else:
            self.scheduler.free_lookup_locks(
                token_ids=req.tokens, start=0, end=end, request_id=req.rid, cache_salt=req.salt
            )
        self.counters.add("free_lookup_locks")

    def end_session(self, req: Request) -> None:
        self.scheduler.end_session(req.rid)
        self.counters.add("end_sessions")

    # -- worker side (each rank in its own thread, as vLLM runs one process per rank) --

    def _on_ranks(self, fn: Callable[[int], Any], deadline: Deadline, doing: str) -> list[Any]:
        futures = [self.pool.submit(fn, rank) for rank in range(self.geo.tp)]
        results = []
        for rank, fut in enumerate(futures):
            try:
                results.append(fut.result(timeout=max(0.1, deadline.left())))
            except TimeoutError:
                raise ScenarioFailure(f"rank {rank}: {doing} did not finish before the deadline") from None
        return results

    def retrieve_many(self, reqs: list[Request], deadline: Deadline) -> None:
        """start_load_kv for a step: one batched retrieve per rank, then get_finished."""
        ops, ids, salts = [], [], []
        for req in reqs:
            start = req.vllm_hit_tokens // self.chunk * self.chunk
            end = req.lmcache_hit_tokens
            if end <= start:
                continue
            bs = self.geo.block_size
            ops.append(
                load_store_op(
                    req, req.blocks[start // bs : end // bs], start, end, skip=req.vllm_hit_tokens - start
                )
            )
            ids.append(req.rid)
            salts.append(req.salt)
            self.counters.add("retrieved_chunks", (end - start) // self.chunk)
        if not ops:
            return

        def run(rank: int) -> set[str]:
            worker = self.workers[rank]
            event = worker.create_recorded_event()
            worker.batched_submit_retrieve_requests(ids, ops, event, cache_salts=salts)
            self.counters.add("retrieve_requests", len(ids))
            done: set[str] = set()
            while not done.issuperset(ids):
                _, finished = worker.get_finished(set())
                done |= finished or set()
                if not done.issuperset(ids):
                    deadline.check(f"rank {rank} waiting for retrieves to finish")
                    time.sleep(POLL_S)
            return set(worker.get_failed_request_ids())

        failed = set().union(*self._on_ranks(run, deadline, "retrieve"))
        if failed:
            raise ScenarioFailure(f"retrieve reported failed for {sorted(failed)}")

    def store_many(self, reqs: list[Request], deadline: Deadline) -> None:
        """wait_for_save for a step: one batched store per rank, then get_finished."""
        ops, ids, salts = [], [], []
        for req in reqs:
            start = req.lmcache_hit_tokens  # num_stored_tokens starts at the LMCache hit
            end = len(req.tokens) // self.chunk * self.chunk
            if end <= start:
                continue
            bs = self.geo.block_size
            ops.append(load_store_op(req, req.blocks[start // bs : end // bs], start, end))
            ids.append(req.rid)
            salts.append(req.salt)
            self.counters.add("stored_chunks", (end - start) // self.chunk)
        if not ops:
            return
        before = self.counters.snapshot()["store_commit_failures"]

        def run(rank: int) -> None:
            worker = self.workers[rank]
            event = worker.create_recorded_event()
            worker.batched_submit_store_requests(ids, ops, event, cache_salts=salts)
            if worker.is_kv_writer:
                self.counters.add("store_requests", len(ids))
            # The requests finish in the engine; the worker reports the stores once done.
            done: set[str] = set()
            while not done.issuperset(ids):
                finished, _ = worker.get_finished(set(ids))
                done |= finished or set()
                if not done.issuperset(ids):
                    deadline.check(f"rank {rank} waiting for stores to finish")
                    time.sleep(POLL_S)

        self._on_ranks(run, deadline, "store")
        if self.counters.snapshot()["store_commit_failures"] != before:
            raise ScenarioFailure(f"commit_store answered False for one of {ids}")

    def worker_url(self, rank: int) -> str:
        return self.urls[rank // self.ranks_per_server]

    def engine_driven_context(self, rank: int) -> Any:
        """The worker's current engine-driven context (a re-registration builds a new one)."""
        return getattr(self.workers[rank].transfer_ctx, "_engine_driven_context", None)

    def check_health(self) -> None:
        for rank, worker in enumerate(self.workers):
            if not worker.is_healthy:
                raise ScenarioFailure(f"rank {rank}: worker adapter marked its server unhealthy")
            self._install_probe(rank)  # a re-registration builds a new context
        if not self.scheduler.is_healthy:
            raise ScenarioFailure("scheduler adapter marked a server unhealthy")

    def shutdown(self) -> None:
        for worker in self.workers:
            try:
                worker.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                traceback.print_exc(file=sys.stderr)
        try:
            self.scheduler.shutdown()
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
        self.pool.shutdown(wait=False)


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------


class Scenarios:
    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.e = engine
        self.args = args
        self.rng = random.Random(args.seed)
        self.chunk = engine.chunk

    # helpers

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 150_000) for _ in range(n)]

    def prompt(self, full_chunks: int, tail: int = 17) -> list[int]:
        return self.tokens(full_chunks * self.chunk + tail)

    def req(self, tag: str, tokens: list[int], salt: str = "") -> Request:
        r = Request(rid=self.e.new_rid(tag), tokens=tokens, salt=salt)
        self.e.alloc(r)
        self.e.set_blocks(r, 0, len(r.blocks), 0)
        return r

    def expect(self, what: str, got: Any, want: Any) -> None:
        if got != want:
            raise ScenarioFailure(f"{what}: expected {want}, got {got}")

    def clear(self) -> None:
        """A non-forced CLEAR (the scheduler adapter's reset_cache): drops what no read lock holds."""
        if not self.e.scheduler.reset_cache():
            raise ScenarioFailure("CLEAR (force=False) was not answered")

    def apc_request(self, tag: str, tokens: list[int], dl: Deadline, vllm_hit: int, want_hits: int,
                    want_retrieve: bool) -> Request:
        """A request whose first ``vllm_hit`` tokens vLLM's prefix cache already holds (their blocks
        carry a sentinel a retrieve must leave alone): lookup, free the locks vLLM will not use, and
        retrieve and verify LMCache's hit past them.  The caller ends it (or stores it first)."""
        e = self.e
        r = self.req(tag, tokens)
        r.vllm_hit_tokens = vllm_hit
        vllm_blocks = vllm_hit // e.geo.block_size
        e.set_blocks(r, 0, vllm_blocks, SENTINEL)
        [hits] = e.lookup_many([r], dl)
        self.expect(f"{r.rid} lookup hit chunks", hits, want_hits)
        self.expect(f"{r.rid} retrieve follows", e.after_alloc(r), want_retrieve)
        if want_retrieve:
            self.retrieve_past_apc(r, dl)
        e.check_blocks_equal(r, 0, vllm_blocks, SENTINEL, "vLLM prefix-cache blocks")
        return r

    def retrieve_past_apc(self, r: Request, dl: Deadline) -> None:
        """Retrieve from the chunk holding vLLM's hit on (its first tokens skipped) and verify it."""
        self.e.retrieve_many([r], dl)
        self.e.verify_chunks(r, r.vllm_hit_tokens // self.chunk, r.lmcache_hit_tokens // self.chunk,
                             skip_tokens=r.vllm_hit_tokens % self.chunk)

    def cold_store(self, tag: str, tokens: list[int], dl: Deadline, salt: str = "",
                   content_salt: str | None = None) -> int:
        """A request nobody cached yet: lookup (miss), compute, store, finish."""
        r = self.req(tag, tokens, salt)
        r.content_salt = content_salt
        [hits] = self.e.lookup_many([r], dl)
        self.e.after_alloc(r)
        self.e.write_blocks(r, hits, len(tokens) // self.chunk)
        self.e.store_many([r], dl)
        self.e.end_session(r)
        self.e.release(r)
        return hits

    def warm(self, tag: str, tokens: list[int], dl: Deadline, want_hits: int | None,
             salt: str = "", content_salt: str | None = None, vllm_hit_tokens: int = 0,
             store: bool = True) -> int:
        """A request that should hit: lookup, retrieve into zeroed blocks, verify, store rest."""
        r = self.req(tag, tokens, salt)
        r.content_salt = content_salt
        r.vllm_hit_tokens = vllm_hit_tokens
        [hits] = self.e.lookup_many([r], dl)
        if want_hits is not None:
            self.expect(f"{r.rid} lookup hit chunks", hits, want_hits)
        retrieve = self.e.after_alloc(r)
        if retrieve:
            self.e.retrieve_many([r], dl)
            self.e.verify_chunks(r, 0, hits)
        full = len(tokens) // self.chunk
        # Blocks after the hit prefix are untouched by the retrieve (still zero).
        self.e.check_blocks_equal(
            r, hits * self.e.blocks_per_chunk, len(r.blocks), 0, "blocks past the hit prefix"
        )
        if store:
            self.e.write_blocks(r, hits, full)
            self.e.store_many([r], dl)
        self.e.end_session(r)
        self.e.release(r)
        return hits

    # scenarios

    def cold_miss_then_store(self, dl: Deadline) -> None:
        tokens = self.prompt(4)
        before = self.e.counters.snapshot()["stored_objects"]
        hits = self.cold_store("cold", tokens, dl)
        self.expect("cold lookup hit chunks", hits, 0)
        writers = sum(1 for w in self.e.workers if w.is_kv_writer)
        self.expect("chunk objects the server reserved for the store",
                    self.e.counters.snapshot()["stored_objects"] - before, 4 * writers)
        # The stored prefix is visible to a later lookup; nothing is retrieved, so the
        # scheduler frees every lock it took (vLLM's "no retrieve needed" path).
        r = self.req("cold-check", tokens)
        [hits] = self.e.lookup_many([r], dl)
        self.expect("lookup after store: hit chunks", hits, 4)
        r.vllm_hit_tokens = r.lmcache_hit_tokens  # as if vLLM's own cache held it all
        self.e.after_alloc(r)
        self.e.end_session(r)
        self.e.release(r)

    def full_hit(self, dl: Deadline) -> None:
        tokens = self.prompt(4)
        self.expect("cold lookup hit chunks", self.cold_store("full-a", tokens, dl), 0)
        before = self.e.counters.snapshot()["stored_objects"]
        self.warm("full-b", tokens, dl, want_hits=4)
        self.expect("objects stored by a full hit", self.e.counters.snapshot()["stored_objects"],
                    before)

    def partial_hit(self, dl: Deadline) -> None:
        p = self.prompt(4)
        self.cold_store("part-p", p, dl)
        # Q shares P's first 600 tokens (2 full chunks + 88 tokens), then differs.
        q = p[:600] + self.tokens(4 * self.chunk + 40 - 600)
        self.warm("part-q", q, dl, want_hits=2)  # retrieves 2 chunks, stores chunks 2..3
        self.warm("part-q2", q, dl, want_hits=4, store=False)
        self.warm("part-p2", p, dl, want_hits=4, store=False)  # P's own chunks 2..3 intact

    def prefix_cache_skip(self, dl: Deadline) -> None:
        e = self.e
        bs = e.geo.block_size
        p = self.prompt(4)
        self.cold_store("apc-p", p, dl)
        for vllm_hit in (self.chunk + 2 * bs, 7 * bs):
            # free_lookup_locks(0, vllm_hit): the server frees the whole chunks below
            # vllm_hit (floor), the retrieve then starts at the chunk containing vllm_hit.
            r = self.apc_request("apc", p, dl, vllm_hit, want_hits=4, want_retrieve=True)
            e.end_session(r)
            e.release(r)
        # vLLM holds everything LMCache has: no retrieve, every lock freed.
        r = self.apc_request("apc-all", p, dl, 4 * self.chunk, want_hits=4, want_retrieve=False)
        e.end_session(r)
        e.release(r)
        # The same prompt can still be looked up and retrieved in full afterwards.
        self.warm("apc-after", p, dl, want_hits=4, store=False)

    def two_salts(self, dl: Deadline) -> None:
        p = self.prompt(3)
        self.expect("salt A cold hit chunks", self.cold_store("salt-a", p, dl, salt="tenant-a"), 0)
        # Same tokens under another salt: a miss; store B's own bytes.
        self.expect("salt B cold hit chunks", self.cold_store("salt-b", p, dl, salt="tenant-b"), 0)
        # No salt at all: a miss too (nothing stored unsalted); free the nothing it locked.
        r = self.req("salt-none", p)
        [hits] = self.e.lookup_many([r], dl)
        self.expect("unsalted lookup of salted data: hit chunks", hits, 0)
        self.e.after_alloc(r)
        self.e.end_session(r)
        self.e.release(r)
        self.warm("salt-a2", p, dl, want_hits=3, salt="tenant-a", store=False)
        self.warm("salt-b2", p, dl, want_hits=3, salt="tenant-b", store=False)

    def concurrent(self, dl: Deadline) -> None:
        e = self.e
        n = self.args.concurrency
        prompts = [self.prompt(1 + i % 4, tail=5 + i) for i in range(n)]
        # Wave 1: every lookup in flight before any result is read; one store step for all.
        wave1 = [self.req("conc-1", t) for t in prompts]
        hits = e.lookup_many(wave1, dl)
        self.expect("wave 1 hit chunks", hits, [0] * n)
        for r in wave1:
            e.after_alloc(r)
            e.write_blocks(r, 0, len(r.tokens) // self.chunk)
        e.store_many(wave1, dl)
        for r in wave1:
            e.end_session(r)
            e.release(r)
        # Wave 2: the same prompts again plus prompts extending them by one chunk,
        # all in flight together; one retrieve step, verify, one store step.
        extended = [t[: len(t) // self.chunk * self.chunk] + self.tokens(self.chunk + 9)
                    for t in prompts[: max(1, n // 2)]]
        wave2 = [self.req("conc-2", t) for t in prompts + extended]
        hits = e.lookup_many(wave2, dl)
        want = [len(t) // self.chunk for t in prompts] + [
            len(t) // self.chunk - 1 for t in extended
        ]
        self.expect("wave 2 hit chunks", hits, want)
        for r in wave2:
            self.expect(f"{r.rid} retrieve follows", e.after_alloc(r), True)
        e.retrieve_many(wave2, dl)
        for r, h in zip(wave2, hits):
            e.verify_chunks(r, 0, h)
            e.write_blocks(r, h, len(r.tokens) // self.chunk)
        e.store_many(wave2, dl)
        for r in wave2:
            e.end_session(r)
            e.release(r)
        # The extensions' new chunks landed.
        for t in extended:
            self.warm("conc-3", t, dl, want_hits=len(t) // self.chunk, store=False)

    def lookup_start(self, dl: Deadline) -> None:
        """0.5.7rc3's start-aware lookups: vLLM's prefix cache holds a chunk-aligned prefix, so the
        lookup starts there (the server locks and prefetches only the rest) and the server answers
        the covered chunks as hit, whether it holds them or not; the retrieve starts at the start."""
        e = self.e
        p = self.prompt(4)
        self.cold_store("start-p", p, dl)
        # vLLM holds chunks 0..1: lookup [512, 1024) answered 2 covered + 2 found, free(0, 512),
        # retrieve chunks 2..3; then all 4: the lookup starts at its aligned end, nothing to retrieve.
        for covered, retrieve in ((2, True), (4, False)):
            r = self.apc_request("start-p", p, dl, covered * self.chunk, want_hits=4, want_retrieve=retrieve)
            e.end_session(r)
            e.release(r)
        # vLLM holds chunk 0 of a prompt the server never saw: answered as hit all the same, so
        # the connector stores from chunk 1 on and the server never gets chunk 0 ...
        q = self.prompt(3)
        r = self.apc_request("start-new", q, dl, self.chunk, want_hits=1, want_retrieve=False)
        e.write_blocks(r, 1, 3)
        e.store_many([r], dl)
        e.end_session(r)
        e.release(r)
        # ... so a lookup from 0 stops at chunk 0, while one past it finds chunks 1..2.
        for covered, want_hits in ((0, 0), (1, 3)):
            r = self.apc_request("start-new", q, dl, covered * self.chunk, want_hits, want_retrieve=want_hits > 0)
            e.end_session(r)
            e.release(r)

    def eviction(self, dl: Deadline) -> None:
        e = self.e
        chunks_per_req = max(1, min(16, (e.geo.num_blocks // 2) // e.blocks_per_chunk))
        writers = sum(1 for w in e.workers if w.is_kv_writer)
        per_chunk_all_ranks = e.geo.object_bytes(self.chunk) * writers
        # Every server has an L1 of --l1-size-gb; the ranks spread over them evenly.
        budget = self.args.l1_size_gb * (1 << 30) * len(e.urls) * self.args.eviction_overfill
        n_req = max(2, math.ceil(budget / (per_chunk_all_ranks * chunks_per_req)))
        if n_req > self.args.eviction_max_requests:
            raise ScenarioFailure(
                f"eviction needs {n_req} requests of {chunks_per_req} chunks to overfill "
                f"{self.args.l1_size_gb} GiB; raise --eviction-max-requests or shrink --l1-size-gb"
            )
        prompts = [self.prompt(chunks_per_req) for _ in range(n_req)]
        before = e.counters.snapshot()
        for t in prompts:
            self.cold_store("evict-fill", t, dl)
        mid = e.counters.snapshot()
        skipped = mid["store_skipped_objects"] - before["store_skipped_objects"]
        # Read everything back (each hit prefix is retrieved and checked, which also
        # releases its locks).
        total_hits = 0
        hit_list = []
        for t in prompts:
            h = self.warm("evict-read", t, dl, want_hits=None, store=False)
            hit_list.append(h)
            total_hits += h
        asked = n_req * chunks_per_req
        if total_hits >= asked:
            raise ScenarioFailure(
                f"stored {asked} chunks ({asked * per_chunk_all_ranks / (1 << 20):.0f} MiB over "
                f"{writers} rank(s)) into a {self.args.l1_size_gb} GiB L1 and every one still "
                "hits: nothing was evicted or refused (is the server's L1 bigger than "
                "--l1-size-gb?)"
            )
        self.evict_summary = {
            "requests": n_req,
            "chunks_per_request": chunks_per_req,
            "hit_chunks_after_fill": total_hits,
            "objects_refused_during_fill": skipped,
            "fully_hit_requests": sum(1 for h in hit_list if h == chunks_per_req),
            "first_hits": hit_list[:4],
            "last_hits": hit_list[-4:],
        }
        # The cache keeps accepting: a fresh prompt becomes fully readable once space is
        # reclaimed (LMCache's evictor runs on a 1 s tick; poll within the deadline).
        t = self.prompt(chunks_per_req)
        attempts = 0
        while True:
            attempts += 1
            self.cold_store("evict-new", t, dl)
            r = self.req("evict-new-check", t)
            [hits] = e.lookup_many([r], dl)
            if hits == chunks_per_req:
                r.vllm_hit_tokens = 0
                e.after_alloc(r)
                e.retrieve_many([r], dl)
                e.verify_chunks(r, 0, hits)
                e.end_session(r)
                e.release(r)
                break
            r.vllm_hit_tokens = r.lmcache_hit_tokens
            e.after_alloc(r)
            e.end_session(r)
            e.release(r)
            if dl.left() < 5:
                raise ScenarioFailure(
                    f"after the overfill a fresh {chunks_per_req}-chunk prompt never became "
                    f"fully readable ({attempts} tries; last hit {hits})"
                )
            time.sleep(0.5)
            t = self.prompt(chunks_per_req)
        self.evict_summary["recovery_tries"] = attempts


    def kv_events(self, dl: Deadline) -> None:
        """LMCache's own worker consumes the server's KV event stream (``--kv-events``): every chunk stored comes
        back as one stored event carrying exactly that chunk's tokens and the previous chunk's hash as its parent,
        and every hash removed was announced before.  Once every store's event is in (a removal precedes the
        store that evicted it), the hashes still announced are reported, for the caller to hold against what
        the server holds."""
        e = self.e
        if not self.args.kv_events:
            raise ScenarioFailure("kv_events needs --kv-events")
        worker = e.workers[0]  # the elected subscriber of its server (rank 0)
        announced: dict[bytes, CacheStoreEvent] = {}
        by_tokens: dict[tuple[int, ...], bytes] = {}
        seen = {"stored": 0, "removed": 0, "unknown_removals": 0}

        def drain() -> None:
            for event in worker.get_kv_events():  # the first call starts the subscription
                if isinstance(event, CacheStoreEvent):
                    for block in event.block_hashes:
                        seen["stored"] += 1
                        announced[block] = event
                        by_tokens[tuple(event.token_ids)] = block
                elif isinstance(event, CacheRemoveEvent):
                    for block in event.block_hashes:
                        seen["removed"] += 1
                        if announced.pop(block, None) is None:
                            seen["unknown_removals"] += 1

        drain()
        prompts = [self.prompt(4) for _ in range(self.args.kv_events_prompts)]
        before = e.counters.snapshot()["stored_objects"]
        for index, tokens in enumerate(prompts):
            self.cold_store(f"kv{index}", tokens, dl)
        stored = e.counters.snapshot()["stored_objects"] - before

        def all_stores_in() -> bool | None:
            drain()
            return True if seen["stored"] >= stored else None

        poll(all_stores_in, dl, f"the stored events of {stored} objects")
        self.expect("stored events", seen["stored"], stored)
        self.expect("removals of hashes never announced", seen["unknown_removals"], 0)
        for index, tokens in enumerate(prompts):
            blocks = [by_tokens.get(tuple(tokens[c * self.chunk : (c + 1) * self.chunk])) for c in range(4)]
            if None in blocks:
                raise ScenarioFailure(f"prompt {index}: no stored event carries the tokens of chunk "
                                      f"{blocks.index(None)}")
            for c in range(1, 4):
                event = announced.get(blocks[c])
                if event is not None and event.parent_block_hash != blocks[c - 1]:
                    raise ScenarioFailure(f"prompt {index} chunk {c}: parent {event.parent_block_hash!r}, "
                                          f"expected chunk {c - 1}'s hash {blocks[c - 1]!r}")
        self.kv_summary = {"model_name": e.model_name, "stored": seen["stored"], "removed": seen["removed"],
                           "announced": sorted(block.hex() for block in announced)}

    def survive_restart(self, dl: Deadline) -> None:
        """A server killed and restarted under a running engine; the adapters must recover.

        Run with a short ``--heartbeat-interval`` (1 s).  Stores and verifies a
        round trip, prints ``RESTART_READY`` on stdout and waits (``--restart-wait``)
        for one line on stdin: the URLs of the servers that were restarted since
        (none named = all of them).  Then, within ``--recovery-timeout``: every
        worker of a restarted server must have re-registered (the heartbeat's
        recover callback builds a new engine-driven context) and every adapter
        must be healthy.  After that the restarted servers hold nothing (no
        persistence), new prompts go through verified store and full-hit
        retrieve round trips, and a non-forced CLEAR at the end shows that no
        read lock outlived its request's end_session.
        """
        e = self.e
        old = self.prompt(3)
        self.expect("cold hit chunks before the restart", self.cold_store("rs-old", old, dl), 0)
        self.warm("rs-old-check", old, dl, want_hits=3, store=False)
        e.check_health()
        old_contexts = [e.engine_driven_context(rank) for rank in range(e.geo.tp)]

        sys.stdout.write(RESTART_READY + "\n")
        sys.stdout.flush()
        wait = Deadline(min(self.args.restart_wait, dl.left()), "survive_restart")
        line = None
        while line is None:
            ready, _, _ = select.select([sys.stdin], [], [], max(0.0, min(1.0, wait.left())))
            if ready:
                line = sys.stdin.readline()
                if not line:
                    raise ScenarioFailure("stdin closed before the go-ahead after the server restart")
            else:
                wait.check("waiting on stdin for the go-ahead after the server restart")
        named = [word for word in line.split() if "://" in word]
        unknown = [url for url in named if url not in e.urls]
        if unknown:
            raise ScenarioFailure(f"go-ahead names servers this engine does not use: {unknown}")
        restarted = set(named or e.urls)
        affected = [rank for rank in range(e.geo.tp) if e.worker_url(rank) in restarted]

        t0 = time.monotonic()
        recovery = Deadline(min(self.args.recovery_timeout, dl.left()), "survive_restart recovery")
        while True:
            stale = [rank for rank in affected
                     if e.engine_driven_context(rank) in (None, old_contexts[rank])]
            unhealthy = [rank for rank, w in enumerate(e.workers) if not w.is_healthy]
            if not stale and not unhealthy and e.scheduler.is_healthy:
                break
            recovery.check(
                f"recovering: ranks not re-registered {stale}, unhealthy ranks {unhealthy}, "
                f"scheduler healthy {e.scheduler.is_healthy}"
            )
            time.sleep(0.01)
        recovered_s = time.monotonic() - t0
        e.check_health()  # also watches the new contexts' transfers

        # The restarted servers start empty, so the old prompt is a miss now.
        r = self.req("rs-old-after", old)
        [hits] = e.lookup_many([r], dl)
        self.expect("hit chunks of the pre-restart prompt after the restart", hits, 0)
        e.after_alloc(r)
        e.end_session(r)
        e.release(r)
        # New prompts: verified store + full-hit retrieve round trips, nothing refused.
        for i in range(2):
            t = self.prompt(3, tail=11 + i)
            before = e.counters.snapshot()
            self.expect(f"round trip {i}: cold hit chunks", self.cold_store("rs-new", t, dl), 0)
            writers = sum(1 for w in e.workers if w.is_kv_writer)
            self.expect(f"round trip {i}: chunk objects stored",
                        e.counters.snapshot()["stored_objects"] - before["stored_objects"],
                        3 * writers)
            self.warm("rs-new-check", t, dl, want_hits=3, store=False)
        # Every request above ended with end_session after its retrieve or lock frees: a
        # non-forced CLEAR drops everything that is not read-locked, so nothing may hit.
        self.clear()
        r = self.req("rs-after-clear", t)
        [hits] = e.lookup_many([r], dl)
        r.vllm_hit_tokens = r.lmcache_hit_tokens
        e.after_alloc(r)
        e.end_session(r)
        e.release(r)
        self.expect("hit chunks after CLEAR (a read lock outlived its end_session)", hits, 0)
        self.restart_summary = {
            "restarted": sorted(restarted),
            "reregistered_ranks": affected,
            "recovery_seconds": round(recovered_s, 3),
        }

    def lock_release(self, dl: Deadline) -> None:
        """Read locks are taken by lookup and given back by retrieve / free_lookup_locks.

        A non-forced CLEAR (the scheduler adapter's reset_cache) drops every object
        nobody holds a read lock on and keeps the locked ones, so it shows which
        chunks are still locked.  Destructive: it clears the server's whole cache.
        """
        e = self.e
        p, q = self.prompt(4), self.prompt(2)
        self.clear()  # room for P and Q whatever the scenarios before left and whatever L1's eviction order
        self.cold_store("lock-p", p, dl)
        self.cold_store("lock-q", q, dl)
        held = self.req("lock-held", p)  # looks up P and keeps its locks for now
        [hits] = e.lookup_many([held], dl)
        self.expect("held lookup hit chunks", hits, 4)
        freed = self.req("lock-freed", q)  # looks up Q and frees every lock at once
        [hits] = e.lookup_many([freed], dl)
        self.expect("freed lookup hit chunks", hits, 2)
        freed.vllm_hit_tokens = freed.lmcache_hit_tokens
        e.after_alloc(freed)
        e.end_session(freed)
        e.release(freed)
        self.clear()

        def probe(tag: str, tokens: list[int]) -> int:
            r = self.req(tag, tokens)
            [h] = e.lookup_many([r], dl)
            r.vllm_hit_tokens = r.lmcache_hit_tokens  # free whatever it locked
            e.after_alloc(r)
            e.end_session(r)
            e.release(r)
            return h

        self.expect("after CLEAR, chunks whose locks were all freed: hit chunks",
                    probe("lock-q-after", q), 0)
        self.expect("after CLEAR, chunks a pending lookup still locks: hit chunks",
                    probe("lock-p-after", p), 4)
        # The held request now retrieves (each rank's commit_retrieve gives back its lock).
        e.after_alloc(held)
        e.retrieve_many([held], dl)
        e.verify_chunks(held, 0, 4)
        e.end_session(held)
        e.release(held)
        self.clear()
        self.expect("after retrieving and a second CLEAR, P's hit chunks (locks all given back)",
                    probe("lock-p-final", p), 0)
        if CLIENT_057:
            self.abandoned_lookup_locks(dl, probe)

    def abandoned_lookup_locks(self, dl: Deadline, probe: Callable[[str, list[int]], int]) -> None:
        """0.5.7rc3: vLLM's cached prefix shrinks below a start-aware lookup's start, so the
        connector abandons that lookup, looks up again from 0, and gives the first lookup's
        locks back as ``extra_ranges`` of the one free_lookup_locks; a CLEAR then drops it all."""
        e = self.e
        p = self.prompt(4)
        self.cold_store("shrink-p", p, dl)
        r = self.req("shrink", p)
        r.vllm_hit_tokens = 2 * self.chunk
        [hits] = e.lookup_many([r], dl)  # locks chunks 2..3
        self.expect(f"{r.rid} start-aware lookup hit chunks", hits, 4)
        r.pending_free_ranges.append((r.lookup_start, r.lmcache_hit_tokens))
        e.scheduler.cleanup_lookup_result(r.rid)
        r.vllm_hit_tokens, r.need_full_lookup = self.chunk, True
        e.set_blocks(r, 0, e.blocks_per_chunk, SENTINEL)
        [hits] = e.lookup_many([r], dl)  # locks chunks 0..3
        self.expect(f"{r.rid} lookup from 0 after the shrink: hit chunks", hits, 4)
        self.expect(f"{r.rid} retrieve follows", e.after_alloc(r), True)
        self.retrieve_past_apc(r, dl)
        e.check_blocks_equal(r, 0, e.blocks_per_chunk, SENTINEL, "vLLM prefix-cache blocks")
        e.end_session(r)
        e.release(r)
        self.clear()
        self.expect("after CLEAR, the abandoned and the retrieved lookup's chunks: hit chunks",
                    probe("shrink-after", p), 0)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", nargs="+", required=True, action="extend",
                    help="server URL(s), e.g. tcp://127.0.0.1:5555; several = one per server")
    ap.add_argument("--scenario", default="all",
                    help=f"one of {', '.join(SCENARIOS + SCENARIOS_057)}, 'all' (those, in that order; "
                    f"{', '.join(SCENARIOS_057)} only with LMCache 0.5.7), or a comma-separated list; "
                    "also lock_release (not in 'all': it clears the server's cache) and "
                    "survive_restart (not in 'all': it waits for a server restart) and kv_events (not in 'all': "
                    "it needs --kv-events)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--mla", action="store_true", help="MLA model: one replicated KV plane")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads in total (split over TP)")
    ap.add_argument("--head-size", type=int, default=None,
                    help="head size; default 64, or 576 (DeepSeek's latent width) with --mla")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-alignment", type=int, default=None,
                    help="LMCache 0.5.7rc3: the alignment the adapters negotiate the chunk size with "
                    "(default the block size, as vLLM's connector; 0: ask get_chunk_size instead)")
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--num-blocks", type=int, default=1024, help="paged blocks per rank")
    ap.add_argument("--model-name", default="", help="default derives from the geometry")
    ap.add_argument("--seed", type=int, default=None,
                    help="token/content seed (default: fresh per run, so runs never collide)")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--l1-size-gb", type=float, default=0.25,
                    help="the server's L1 size; the eviction scenario overfills it")
    ap.add_argument("--eviction-overfill", type=float, default=1.5)
    ap.add_argument("--eviction-max-requests", type=int, default=400)
    ap.add_argument("--mq-timeout", type=float, default=20.0,
                    help="lmcache.mp.mq_timeout for the adapters (vLLM's default is 300)")
    ap.add_argument("--heartbeat-interval", type=float, default=10.0)
    ap.add_argument("--restart-wait", type=float, default=120.0,
                    help="survive_restart: how long to wait on stdin for the go-ahead")
    ap.add_argument("--recovery-timeout", type=float, default=60.0,
                    help="survive_restart: how long the adapters may take to recover")
    ap.add_argument("--kv-events", action="store_true",
                    help="the workers consume the server's KV event stream (vLLM's enable_kv_cache_events)")
    ap.add_argument("--kv-events-prompts", type=int, default=30,
                    help="kv_events: prompts of 4 chunks stored (enough to overfill the L1 the test gives)")
    ap.add_argument("--scenario-timeout", type=float, default=180.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="whole run")
    args = ap.parse_args(argv)
    if args.head_size is None:
        args.head_size = 576 if args.mla else 64
    if args.seed is None:
        args.seed = (time.time_ns() ^ (os.getpid() << 20)) % 1_000_000_007
    if args.chunk_alignment is None:
        args.chunk_alignment = args.block_size
    elif not CLIENT_057:
        ap.error("--chunk-alignment needs LMCache 0.5.7's adapters (0.5.6 only asks get_chunk_size)")
    version_scenarios = SCENARIOS_057 if CLIENT_057 else ()
    args.scenarios = []
    for name in (s.strip() for s in args.scenario.split(",")):
        if name == "all":
            args.scenarios.extend(SCENARIOS + version_scenarios)
        elif name:
            args.scenarios.append(name)
    known = SCENARIOS + version_scenarios + EXTRA_SCENARIOS
    unknown = [s for s in args.scenarios if s not in known]
    if unknown or not args.scenarios:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(known)} or all"
                 + ("" if CLIENT_057 else f" ({list(SCENARIOS_057)} need LMCache 0.5.7)"))
    if args.tp % len(args.url):
        ap.error("--tp must be a multiple of the number of --url servers (as vLLM requires)")
    if not args.mla and args.kv_heads % args.tp:
        ap.error("--kv-heads must be divisible by --tp")
    return args


def emit(result: dict[str, Any]) -> None:
    sys.stderr.flush()
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    base: dict[str, Any] = {
        "ok": False,
        "lmcache_version": lmcache.__version__,
        "urls": args.url,
        "tp": args.tp,
        "mla": args.mla,
        "seed": args.seed,
        "geometry": {
            "layers": args.layers, "kv_heads": args.kv_heads, "head_size": args.head_size,
            "block_size": args.block_size, "dtype": args.dtype, "num_blocks": args.num_blocks,
        },
        "scenarios": {},
    }
    emitted = threading.Event()
    emit_lock = threading.Lock()

    def emit_once(result: dict[str, Any]) -> bool:
        with emit_lock:
            if emitted.is_set():
                return False
            emitted.set()
            emit(result)
            return True

    def watchdog() -> None:
        if not emitted.wait(args.timeout):
            base["reason"] = f"driver overran --timeout {args.timeout}s"
            if emit_once(base):
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="watchdog").start()

    counters = Counters()
    try:
        engine = Engine(args, counters)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        traceback.print_exc(file=sys.stderr)
        base["reason"] = f"setup failed: {type(exc).__name__}: {exc}"
        emit_once(base)
        return 2
    base["model_name"] = engine.model_name
    base["chunk_size"] = engine.chunk
    scenarios = Scenarios(engine, args)
    all_ok = True
    try:
        for name in args.scenarios:
            dl = Deadline(args.scenario_timeout, name)
            before = counters.snapshot()
            t0 = time.monotonic()
            entry: dict[str, Any] = {"pass": False, "reason": None}
            try:
                engine.reset_blocks()
                engine.check_health()
                getattr(scenarios, name)(dl)
                engine.check_health()
                entry["pass"] = True
            except ScenarioFailure as exc:
                entry["reason"] = str(exc)
            except Exception as exc:  # noqa: BLE001 - one scenario's crash is its failure
                traceback.print_exc(file=sys.stderr)
                entry["reason"] = f"{type(exc).__name__}: {exc}"
            entry["seconds"] = round(time.monotonic() - t0, 3)
            entry["counts"] = diff(counters.snapshot(), before)
            if name == "eviction" and hasattr(scenarios, "evict_summary"):
                entry["eviction"] = scenarios.evict_summary
            if name == "kv_events" and hasattr(scenarios, "kv_summary"):
                entry["kv_events"] = scenarios.kv_summary
            if name == "survive_restart" and hasattr(scenarios, "restart_summary"):
                entry["restart"] = scenarios.restart_summary
            base["scenarios"][name] = entry
            all_ok &= entry["pass"]
            print(f"[driver] {name}: {'PASS' if entry['pass'] else 'FAIL'}"
                  f"{'' if entry['pass'] else ' - ' + str(entry['reason'])}", file=sys.stderr)
    finally:
        engine.shutdown()
    base["ok"] = all_ok
    base["totals"] = counters.snapshot()
    base["seconds"] = round(time.monotonic() - started, 3)
    if not all_ok:
        failed = [n for n, v in base["scenarios"].items() if not v["pass"]]
        base["reason"] = f"failed: {', '.join(failed)}"
    emit_once(base)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
