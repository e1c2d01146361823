"""``python -m benchmarks trace PATH``: a request trace of prefix block hashes (:mod:`benchmarks.trace_sim`)
replayed through a real one-process service with the native client, one request at a time as an engine does
(lookup; store what missed; end), at three L1 sizes derived from the trace: where an offline LRU reaches 1/3,
2/3 and 90 % of the infinite cache's hit ratio, once per ``--l1-policy`` (lru, the default; adaptive; arc).
Beside mpcache, at each size: the offline LRU and Belady's
MIN (the offline optimum) computed from the same trace, and LRU and ARC simulated on it touching a request's
blocks last to first (and ARC first to last): candidates for a policy that beats LRU.  Each reports its prefix-hit
ratio (blocks) and the prefill tokens it saved per GiB of L1, a block being ``BLOCK_TOKENS`` tokens of
``KV_BYTES_PER_TOKEN`` each (the service itself stores small stand-in objects: what is measured is which blocks
it holds).  And LMCache 0.5.6's own MP server at the same size in blocks (``lmcache_server``: its
``--l1-size-gb`` the blocks times the replay's object bytes, LRU), the trace replayed through LMCache's own
vLLM adapters (``benchmarks/harness/trace_replay.py``, in the LMCache venv), ``--repetitions`` times (its
result swings with the timing of its evictions: the median run, every run's hit ratio beside it); left out, saying
so, without that venv.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from benchmarks import mrc_traces
from benchmarks.children import kill_running
from benchmarks.lmcache_servers import LMCACHE_ENV, LMCacheEnvMissing, Server, lmcache_python
from benchmarks.trace_sim import (
    BLOCK_TOKENS,
    Outcome,
    TraceRequest,
    arc,
    belady,
    load,
    lru,
    lru_capacity_for,
    outcome,
)
from mpcache.config.derived import L1_POLICIES

SHARES = {"small": 1 / 3, "middle": 2 / 3, "large": 0.9}  # of the infinite cache's hit ratio, reached by LRU
KV_BYTES_PER_TOKEN = 128 * 1024  # Llama-3-8B in bf16: 32 layers × 8 KV heads × 128 dims × (K, V) × 2 bytes
STAND_IN_BYTES = 4096  # the service's object per block
MODEL = "trace-model"
MPCACHE = tuple(f"mpcache_{policy}" for policy in L1_POLICIES)  # the service replayed with each --l1-policy
LMCACHE_REPLAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "trace_replay.py")
LMCACHE_OBJECT_BYTES = 2 * 1 * 256 * 16 * 2  # the replay's chunk: K and V, 1 layer, 256 tokens, 1 head of 16, fp16
LMCACHE_REPLAY_TIMEOUT_S = 3600.0
ALLOCATION_FAILURES_SETTLE_S = 15.0


class TraceMissing(Exception):
    """``trace`` was run without a trace file (``report`` leaves it out)."""


def _columns(result: Outcome, l1_gib: float) -> dict[str, float]:
    return {"hit_ratio": round(result.hit_ratio, 4), "tokens_saved": result.tokens_saved,
            "tokens_saved_per_gib": round(result.tokens_saved / l1_gib)}


def mpcache_found(requests: list[TraceRequest], blocks: int, policy: str = "lru") -> list[int]:
    """The prefix mpcache found for each request, replayed through a fresh service whose L1 holds ``blocks``
    and evicts in ``policy``'s order."""
    replayed = mrc_traces.replay([(MODEL, "", r.hashes) for r in requests], blocks * STAND_IN_BYTES, 0.0,
                                 chunk_bytes=STAND_IN_BYTES, policy=policy)
    return replayed["found"]


def lmcache_found(requests: list[TraceRequest], blocks: int, python: str) -> tuple[list[int], int, int | None]:
    """The prefix LMCache's own server (L1 of ``blocks`` of the replay's chunks) found for each request, the trace
    replayed through LMCache's adapters; how many requests' stores it told the client it refused; and how many
    chunks its L1 failed to allocate (its own counter: a full L1 between its once-a-second evictions drops
    stores, told or not, so what it finds depends on timing; None where it could not be read)."""
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-trace-") as tmp:
        path = os.path.join(tmp, "requests.jsonl")
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r.hashes) + "\n" for r in requests)
        server = Server("lmcache", tmp, python, 0, blocks * LMCACHE_OBJECT_BYTES / 2**30)
        try:
            server.wait_ready()
            client = subprocess.Popen([python, LMCACHE_REPLAY, "--url", f"tcp://127.0.0.1:{server.port}",
                                       "--requests", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      stdin=subprocess.DEVNULL, env={**os.environ, **LMCACHE_ENV})
            try:
                out, _ = client.communicate(timeout=LMCACHE_REPLAY_TIMEOUT_S)
            finally:
                kill_running([client])
            try:
                failures: int | None = _allocation_failures(server.prometheus_port)
            except OSError:
                failures = None
            status = server.process.poll()
            state = (f"LMCache's server {'still ran' if status is None else f'exited {status}'}, its log ends: "
                     f"{server.log_tail()}")
        finally:
            server.stop()
    lines = out.decode("utf-8", "replace").strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {"reason": f"exited {client.returncode}"}
    if not result.get("ok"):
        raise RuntimeError(f"the trace replay against LMCache's server failed: {result.get('reason')}; {state}")
    if result["object_bytes"] != LMCACHE_OBJECT_BYTES:
        raise RuntimeError(f"the replay's chunk is {result['object_bytes']} bytes, not {LMCACHE_OBJECT_BYTES}")
    return result["found"], result["refused_store_requests"], failures


def _lmcache_server(requests: list[TraceRequest], blocks: int, python: str, l1_gib: float, runs: int,
                    progress: Callable[[str], None], prefix: str) -> dict[str, Any]:
    """LMCache's server's column: ``runs`` replays (its result swings with the timing of its evictions), the
    median run's columns (of an even count, the lower middle one's), every run's hit ratio and allocation failures
    beside them."""
    results: list[dict[str, Any]] = []
    for run_number in range(1, runs + 1):
        progress(f"{prefix}LMCache's server, the trace through its adapters (run {run_number} of {runs})")
        found, refused, failures = lmcache_found(requests, blocks, python)
        if failures is None:
            progress(f"{prefix}LMCache's server's allocation-failure counter could not be read")
        results.append({**_columns(outcome(requests, found), l1_gib), "refused_store_requests": refused,
                        "allocation_failures": failures})
    median = sorted(results, key=lambda result: result["hit_ratio"])[(runs - 1) // 2]
    return {**median, "runs": [{"hit_ratio": result["hit_ratio"], "allocation_failures": result["allocation_failures"]}
                               for result in results]}


def _allocation_failures(port: int) -> int:
    """LMCache's server's ``lmcache_mp.l1_allocation_failure`` (chunks), once two scrapes a second apart agree
    (its subscribers count from an event queue)."""
    previous, deadline = -1, time.monotonic() + ALLOCATION_FAILURES_SETTLE_S
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            page = response.read().decode("utf-8", "replace")
        count = round(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                          if line.startswith("lmcache_mp_l1_allocation_failure")))
        if count == previous or time.monotonic() > deadline:
            return count
        previous = count
        time.sleep(1.0)


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda _: None, path: str | None = None,
        limit: int | None = None, shares: dict[str, float] | None = None, lmcache: bool = True) -> dict[str, Any]:
    """The table's numbers as one JSON object.  mpcache's replay is deterministic; LMCache's server (with
    ``lmcache``) evicts once a second, so it is replayed ``repetitions`` times and its median run reported, each
    run's hit ratio beside it."""
    if path is None:
        raise TraceMissing("trace needs a trace file: python -m benchmarks trace PATH")
    requests = load(path, limit)
    python = None
    if lmcache:
        try:
            python = lmcache_python()
        except LMCacheEnvMissing as exc:
            progress(f"trace: leaving out LMCache's server: {exc}")
    infinite = lru(requests, math.inf)
    progress(f"trace: {len(requests)} requests, {sum(len(r.hashes) for r in requests)} blocks, infinite-cache "
             f"hit ratio {infinite.hit_ratio:.4f}")
    sizes: dict[str, Any] = {}
    for name, share in (shares or SHARES).items():
        blocks = lru_capacity_for(requests, share, infinite.hit_ratio)
        l1_gib = blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN / 2**30
        progress(f"trace: {name}: {blocks} blocks ({l1_gib:.1f} GiB of KV): offline LRU and Belady, then mpcache "
                 f"with each policy")
        sizes[name] = {"blocks": blocks, "l1_gib": round(l1_gib, 2), "share_of_infinite": round(share, 4),
                       "offline_lru": _columns(lru(requests, blocks), l1_gib),
                       "belady": _columns(belady(requests, blocks), l1_gib),
                       "lru_tail_first_simulated": _columns(lru(requests, blocks, tail_first=True), l1_gib),
                       "arc_simulated": _columns(arc(requests, blocks), l1_gib),
                       "arc_tail_first_simulated": _columns(arc(requests, blocks, tail_first=True), l1_gib),
                       **{f"mpcache_{policy}": _columns(outcome(requests, mpcache_found(requests, blocks, policy)),
                                                        l1_gib) for policy in L1_POLICIES}}
        if python is not None:
            sizes[name]["lmcache_server"] = _lmcache_server(requests, blocks, python, l1_gib, max(1, repetitions),
                                                            progress, f"trace: {name}: ")
    return {"trace": path, "requests": len(requests), "block_tokens": BLOCK_TOKENS,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "infinite_hit_ratio": round(infinite.hit_ratio, 4),
            "sizes": sizes,
            **{f"{policy}_over_offline_lru": {name: _ratio(size, policy, "offline_lru") for name, size in sizes.items()}
               for policy in ("belady", "lru_tail_first_simulated", "arc_simulated", "arc_tail_first_simulated",
                              *MPCACHE, *(("lmcache_server",) if python is not None else ()))}}


def _ratio(size: dict[str, Any], ours: str, theirs: str) -> float | None:
    base = size[theirs]["tokens_saved"]
    return round(size[ours]["tokens_saved"] / base, 3) if base else None


def render(result: dict[str, Any]) -> str:
    """The side-by-side table: per size, each policy's prefix-hit ratio and prefill tokens saved per GiB."""
    policies = ("offline_lru", "belady", "lru_tail_first_simulated", "arc_simulated", "arc_tail_first_simulated",
                *MPCACHE, *(("lmcache_server",) if "lmcache_server" in next(iter(result["sizes"].values())) else ()))
    lines = [f"{result['trace']}: {result['requests']} requests, infinite-cache hit ratio "
             f"{result['infinite_hit_ratio']:.3f}; a block is {result['block_tokens']} tokens of "
             f"{result['kv_bytes_per_token']} bytes",
             "",
             "| L1 | blocks (GiB) | " + " | ".join(f"{p} hit / tokens per GiB" for p in policies) + " |",
             "|---|---|" + "---|" * len(policies)]
    for name, size in result["sizes"].items():
        cells = [f"{size[p]['hit_ratio']:.3f} / {size[p]['tokens_saved_per_gib']:,}{_spread(size[p])}"
                 for p in policies]
        lines.append(f"| {name} | {size['blocks']:,} ({size['l1_gib']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(column: dict[str, Any]) -> str:
    """A column replayed more than once (LMCache's server): the median run's, then the runs' range."""
    runs = [run["hit_ratio"] for run in column.get("runs", ())]
    return f" (median of {len(runs)} runs, {min(runs):.4f}–{max(runs):.4f})" if len(runs) > 1 else ""
