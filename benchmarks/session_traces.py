"""``python -m benchmarks.session_traces SOURCE PATH [--gap-s S] [--seed N]``: real coding-agent sessions as one
request stream in Mooncake's format (:mod:`benchmarks.trace_sim`), for ``python -m benchmarks trace`` and
``benchmarks.policy_matrix``.

``SOURCE`` is a folder of session files as WEKA's public kv-cache-tester publishes them (``traces/trace_*.json``:
Claude Code sessions recorded through a proxy, each a list of requests with the hashes of its prompt's 64-token
blocks, local to the session; a sub-agent's requests inside the request that started it, timed from it).  Each
session's requests become 512-token blocks: a block's id stands for its 8 small blocks and the block before it
(a prefix, as an engine's chunk hash is), the session and the model (sessions share nothing: their hashes are
local), and a prompt's last partial block is left out, as an engine stores none.  The sessions are shuffled by
``--seed`` and start one after another at Poisson arrivals ``--gap-s`` apart on average, each request at its
session's start plus its own time in the session: the smaller the gap, the more sessions at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.trace_gen import TraceNotWritten, seed_argument, write_records
from benchmarks.trace_sim import BLOCK_TOKENS

GAP_S = 60.0  # seconds between two sessions' starts, on average


class SessionUnreadable(ValueError):
    """A session file that cannot be read as one: the file, and what is wrong with it."""


class Blocks:
    """Ids of 512-token blocks, fresh integers from 0, one per (session, model, block before, small blocks)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, ...], int] = {}

    def of(self, session: str, model: str, hashes: list[int], small_tokens: int) -> list[int]:
        """The ids of a prompt's whole 512-token blocks, its ``hashes`` being those of its ``small_tokens`` blocks."""
        per_block = BLOCK_TOKENS // small_tokens
        ids, parent = [], -1
        for start in range(0, len(hashes) - per_block + 1, per_block):
            key = (session, model, parent, tuple(hashes[start:start + per_block]))
            parent = self._ids.setdefault(key, len(self._ids))
            ids.append(parent)
        return ids


def session_requests(path: str) -> tuple[str, int, list[tuple[float, dict[str, Any]]]]:
    """A session file's id, its small blocks' tokens and its requests with their times in the session (seconds), a
    sub-agent's at the time of the request that started it plus its own, in time order."""
    try:
        with open(path, encoding="utf-8") as handle:
            session = json.load(handle)
    except OSError as exc:
        raise SessionUnreadable(f"{path}: {exc.strerror or exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise SessionUnreadable(f"{path}: not a JSON document ({exc})") from None
    if not isinstance(session, dict) or not isinstance(session.get("requests"), list):
        raise SessionUnreadable(f"{path}: not a session (a JSON object with a list of requests)")
    small = session.get("block_size")
    if type(small) is not int or small <= 0 or BLOCK_TOKENS % small:
        raise SessionUnreadable(f"{path}: block_size must divide {BLOCK_TOKENS}, not {small!r}")
    timed: list[tuple[float, dict[str, Any]]] = []
    for request in session["requests"]:
        if not isinstance(request, dict):
            raise SessionUnreadable(f"{path}: a request that is not a JSON object")
        start = _seconds(request, path)
        if request.get("type") != "subagent":
            if "hash_ids" in request:
                timed.append((start, request))
            continue
        inner = request.get("requests")
        timed.extend((start + _seconds(each, path), each) for each in (inner if isinstance(inner, list) else ())
                     if isinstance(each, dict) and "hash_ids" in each)
    timed.sort(key=lambda pair: pair[0])
    return str(session.get("id", os.path.basename(path))), small, timed


def _seconds(request: dict[str, Any], path: str) -> float:
    value = request.get("t", 0.0)
    if type(value) not in (int, float) or not 0 <= value < 1e9:
        raise SessionUnreadable(f"{path}: a request's time t must be seconds from 0 to 1e9, not {value!r}")
    return float(value)


def _hashes(request: dict[str, Any], path: str) -> list[int]:
    hashes = request["hash_ids"]
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise SessionUnreadable(f"{path}: hash_ids must be a list of integers")
    return hashes


def stream(paths: list[str], gap_s: float, seed: int,
           progress: Callable[[str], None] = lambda _: None) -> Iterator[dict[str, Any]]:
    """The sessions in ``paths`` as one stream of Mooncake records, in time order (see the module)."""
    rng = random.Random(seed)
    order = sorted(paths)
    rng.shuffle(order)
    blocks, timed, start = Blocks(), [], 0.0
    for number, path in enumerate(order, 1):
        session, small, requests = session_requests(path)
        start += rng.expovariate(1.0 / gap_s)
        first = requests[0][0] if requests else 0.0
        for at, request in requests:
            ids = blocks.of(session, str(request.get("model", "")), _hashes(request, path), small)
            timed.append((round((start + at - first) * 1000), {
                "input_length": int(request.get("in", len(ids) * BLOCK_TOKENS)),
                "output_length": int(request.get("out", 1)), "hash_ids": ids}))
        if number % 100 == 0 or number == len(order):
            progress(f"session_traces: {number} of {len(order)} sessions read, {len(timed):,} requests")
    timed.sort(key=lambda pair: pair[0])
    for at, record in timed:
        yield {"timestamp": at, **record}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.session_traces", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a folder of kv-cache-tester session files (trace_*.json)")
    parser.add_argument("path", help="a new file (an existing one is refused)")
    parser.add_argument("--gap-s", type=_gap, default=GAP_S, help=f"seconds between sessions' starts on average "
                                                                  f"(default {GAP_S:g})")
    parser.add_argument("--seed", type=seed_argument, default=1)
    args = parser.parse_args(argv)
    try:
        paths = sorted(os.path.join(args.source, name) for name in os.listdir(args.source)
                       if name.startswith("trace_") and name.endswith(".json"))
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: {args.source}: {exc.strerror or exc}\n")
    if not paths:
        parser.exit(2, f"{parser.prog}: error: {args.source}: no trace_*.json session file in it\n")
    try:
        write_records(stream(paths, args.gap_s, args.seed, lambda line: print(line, file=sys.stderr, flush=True)),
                      args.path)
    except (SessionUnreadable, TraceNotWritten) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0


def _gap(text: str) -> float:
    try:
        gap = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds") from None
    if not 0 < gap <= 86_400:
        raise argparse.ArgumentTypeError(f"{gap:g}: expected more than 0 and at most 86,400 seconds")
    return gap


if __name__ == "__main__":
    sys.exit(main())
