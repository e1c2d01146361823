#!/usr/bin/env python3
"""Replay a trace of prefix block hashes through LMCache 0.5.6's own vLLM adapters, one request at a time.

Run with the interpreter of the venv that ``.ci/lmcache-env`` builds, against any LMCache-compatible MP
server (``benchmarks.trace`` runs it against LMCache's own server)::

    "$(.ci/lmcache-env | tail -n1)/bin/python" benchmarks/harness/trace_replay.py \
        --url tcp://127.0.0.1:5555 --requests REQUESTS.jsonl

``REQUESTS.jsonl`` holds one JSON list of block hashes per request.  Each trace block becomes one LMCache
chunk whose tokens are drawn from a generator seeded by its hash (so equal hash prefixes are equal token
prefixes, and distinct ones differ), and every prompt ends with one more token, a partial chunk that is never
stored.  Per request, as ``driver.py``'s ``Engine`` plays vLLM's connector: lookup, retrieve the hit prefix,
store the chunks past it, end the session.  A store the server refuses (LMCache's full L1) is counted, not an
error.  The geometry is the smallest the adapters take (1 layer, 1 KV head of 16, float16): a 16 KiB object
per chunk.

The LAST line of stdout is one JSON object: ``ok``, ``found`` (the hit prefix per request, in chunks),
``object_bytes``, ``refused_store_requests``; exit status 0 ok, 1 an error (``reason``).
"""

from __future__ import annotations

import os

# Before anything imports lmcache: no usage reports leave this machine.
os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse
import json
import sys
import traceback
from typing import Any

import driver
import numpy as np
from driver import Counters, Deadline, Engine, Request, ScenarioFailure

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 1, 1, 16, 16, "float16"
VOCAB = 150_000
OP_TIMEOUT_S = 60.0


def block_tokens(block_hash: int, chunk: int, memo: dict[int, list[int]]) -> list[int]:
    tokens = memo.get(block_hash)
    if tokens is None:
        tokens = memo[block_hash] = np.random.default_rng(block_hash & (2**64 - 1)).integers(
            1, VOCAB, chunk).tolist()
    return tokens


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", required=True, help="one JSON list of block hashes per line")
    args = ap.parse_args(argv)
    with open(args.requests, encoding="utf-8") as handle:
        requests = [json.loads(line) for line in handle if line.strip()]
    longest = max((len(hashes) for hashes in requests), default=1)
    engine_args = argparse.Namespace(
        url=[args.url], layers=LAYERS, kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE, dtype=DTYPE,
        num_blocks=(longest + 1) * 256 // BLOCK_SIZE + 1, tp=1, mla=False, model_name="", mq_timeout=20.0,
        heartbeat_interval=10.0, chunk_alignment=BLOCK_SIZE, seed=1)
    result: dict[str, Any] = {"ok": False}
    engine = None
    try:
        engine = Engine(engine_args, Counters())
        chunk = engine.chunk
        if engine_args.num_blocks * BLOCK_SIZE < (longest + 1) * chunk:
            raise ScenarioFailure(f"the server's chunk of {chunk} tokens needs more paged blocks")
        memo: dict[int, list[int]] = {}
        found, refused = [], 0
        for number, hashes in enumerate(requests):
            tokens = [t for h in hashes for t in block_tokens(h, chunk, memo)] + [1]
            req = Request(rid=engine.new_rid("trace"), tokens=tokens)
            engine.alloc(req)
            deadline = Deadline(OP_TIMEOUT_S, f"request {number}")
            [hit] = engine.lookup_many([req], deadline)
            if engine.after_alloc(req):
                engine.retrieve_many([req], deadline)
            try:
                engine.store_many([req], deadline)
            except ScenarioFailure:  # commit_store answered False: the server did not keep them
                refused += 1
            engine.end_session(req)
            engine.release(req)
            found.append(hit)
        engine.check_health()
        result.update(ok=True, found=found, object_bytes=engine.geo.object_bytes(chunk), chunk_tokens=chunk,
                      refused_store_requests=refused)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        traceback.print_exc(file=sys.stderr)
        result["reason"] = f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            engine.shutdown()
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    driver.POLL_S = 0.0005
    sys.exit(main(sys.argv[1:]))
