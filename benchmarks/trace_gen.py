"""``python -m benchmarks.trace_gen KIND COUNT PATH [--seed N]``: a request trace of our own in Mooncake's
format (:mod:`benchmarks.trace_sim`), for ``python -m benchmarks trace``.  Block ids are fresh integers;
a request repeats the ids of the prefix it shares.  Kinds:

* ``conversations``: one of four shared system prompts and a question; half the requests are a turn of an
  earlier conversation, which extends its own prefix;
* ``agentic``: sessions behind one system prompt that come back within seconds with a tool result (the
  most recent sessions most often), a new session one request in ten;
* ``multitenant``: 20 tenants of Pareto popularity, each with five system prompts; a third of the requests
  continue one of the last 300 conversations;
* ``rag``: one of 2,000 documents of Zipf popularity (2 to 30 blocks) behind a shared system prompt, and a
  fresh question; no request continues another;
* ``scan`` (adversarial for LRU): the conversations above, with two requests in five a one-off long prompt (20 to
  60 blocks, never seen again) that pushes them out;
* ``loop`` (adversarial for LRU): 150 documents of 10 to 30 blocks behind a shared system prompt, asked for in
  the same cyclic order over and over (LRU, holding less than the cycle, finds only the system prompt), one
  request in four a conversation's turn instead;
* ``production`` (LRU leaves much on the table): 30 tenants of Pareto popularity, each with three system
  prompts behind one platform-wide prompt; 35 % of requests a one-off long prompt (20 to 80 blocks, a pasted
  document, never seen again) behind a tenant's prompt, 25 % a new session, 40 % the next turn of one of the
  last 400 sessions (the most recent most often).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from benchmarks.trace_sim import BLOCK_TOKENS, TraceRequest


def conversations(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(1)
    systems = [[next(fresh) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    live: list[list[int]] = []
    out = []
    for _ in range(count):
        if live and rng.random() < 0.5:
            index = rng.randrange(len(live))
            live[index] = live[index] + [next(fresh) for _ in range(rng.randint(1, 3))]
            hashes = live[index]
        else:
            hashes = rng.choice(systems) + [next(fresh) for _ in range(rng.randint(1, 6))]
            live.append(hashes)
        out.append(TraceRequest(list(hashes), len(hashes) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)))
    return out


def agentic(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(1)
    system = [next(fresh) for _ in range(8)]
    live: list[list[int]] = []
    out = []
    for _ in range(count):
        if not live or rng.random() < 0.1:
            live = [*live[-39:], system + [next(fresh) for _ in range(rng.randint(2, 10))]]
            index = len(live) - 1
        else:
            index = len(live) - 1 - min(int(rng.expovariate(0.2)), len(live) - 1)
            live[index] = live[index] + [next(fresh) for _ in range(rng.randint(1, 4))]
            if len(live[index]) > 200:  # the context is full: the agent starts over
                live[index] = system + [next(fresh)]
        out.append(TraceRequest(list(live[index]), len(live[index]) * BLOCK_TOKENS))
    return out


def multitenant(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(1)
    tenants = [[[next(fresh) for _ in range(rng.randint(2, 20))] for _ in range(5)] for _ in range(20)]
    live: list[list[int]] = []
    out = []
    for _ in range(count):
        if live and rng.random() < 0.35:
            index = rng.randrange(max(0, len(live) - 300), len(live))
            live[index] = live[index] + [next(fresh) for _ in range(rng.randint(1, 6))]
            hashes = live[index]
        else:
            tenant = tenants[min(int(rng.paretovariate(1.0)) - 1, len(tenants) - 1)]
            hashes = rng.choice(tenant) + [next(fresh) for _ in range(rng.randint(1, 30))]
            live.append(hashes)
        out.append(TraceRequest(list(hashes), len(hashes) * BLOCK_TOKENS))
    return out


def rag(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(1)
    system = [next(fresh) for _ in range(2)]
    documents = [[next(fresh) for _ in range(rng.randint(2, 30))] for _ in range(2000)]
    out = []
    for _ in range(count):
        document = documents[min(int(rng.paretovariate(0.8)) - 1, len(documents) - 1)]
        hashes = system + document + [next(fresh)]
        out.append(TraceRequest(hashes, len(hashes) * BLOCK_TOKENS))
    return out


def scan(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(10**9)
    chat = iter(conversations(count, seed))
    out = []
    for _ in range(count):
        if rng.random() < 0.4:
            hashes = [next(fresh) for _ in range(rng.randint(20, 60))]
            out.append(TraceRequest(hashes, len(hashes) * BLOCK_TOKENS))
        else:
            out.append(next(chat))
    return out


def loop(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(10**9)
    system = [next(fresh) for _ in range(2)]
    documents = [system + [next(fresh) for _ in range(rng.randint(10, 30))] for _ in range(150)]
    chat = iter(conversations(count, seed))
    out = []
    turn = 0
    for _ in range(count):
        if rng.random() < 0.25:
            out.append(next(chat))
        else:
            hashes = documents[turn % len(documents)] + [next(fresh)]
            turn += 1
            out.append(TraceRequest(hashes, len(hashes) * BLOCK_TOKENS))
    return out


def production(count: int, seed: int) -> list[TraceRequest]:
    rng, fresh = random.Random(seed), itertools.count(1)
    platform = [next(fresh) for _ in range(2)]
    tenants = [[platform + [next(fresh) for _ in range(rng.randint(2, 10))] for _ in range(3)] for _ in range(30)]
    live: list[list[int]] = []
    out = []
    for _ in range(count):
        draw = rng.random()
        if live and draw < 0.4:
            index = len(live) - 1 - min(int(rng.expovariate(1 / 60)), len(live) - 1)
            live[index] = live[index] + [next(fresh) for _ in range(rng.randint(1, 4))]
            hashes = live[index]
        else:
            prompt = rng.choice(tenants[min(int(rng.paretovariate(1.0)) - 1, len(tenants) - 1)])
            if draw < 0.75:
                hashes = prompt + [next(fresh) for _ in range(rng.randint(20, 80))]
            else:
                hashes = prompt + [next(fresh) for _ in range(rng.randint(1, 6))]
                live = [*live[-399:], hashes]
        out.append(TraceRequest(list(hashes), len(hashes) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)))
    return out


KINDS: dict[str, Callable[[int, int], list[TraceRequest]]] = {
    "conversations": conversations, "agentic": agentic, "multitenant": multitenant, "rag": rag,
    "scan": scan, "loop": loop, "production": production}


MAX_COUNT = 1_000_000  # requests a trace is made of at most: every request is built in memory before it is written


class TraceNotWritten(OSError):
    """The trace's file could not be made: it exists already, or creating or writing it failed."""


def write(requests: list[TraceRequest], path: str, seed: int = 0) -> None:
    """The trace as JSON lines, Poisson arrivals of one request per 100 ms on average, in a new file
    (:func:`write_records`)."""
    def records() -> Iterator[dict[str, Any]]:
        rng, now = random.Random(seed), 0.0
        for request in requests:
            yield {"timestamp": int(now), "input_length": request.input_tokens, "output_length": 1,
                   "hash_ids": request.hashes}
            now += rng.expovariate(1 / 100)

    write_records(records(), path)


def write_records(records: Iterable[dict[str, Any]], path: str) -> None:
    """``records`` as JSON lines in a new file of mode 0600.  It is written whole to a file of its own beside
    ``path`` first and then linked in, which never replaces what is there: an existing path (a file, a link, a
    pipe) is refused, and a write that fails or is interrupted leaves nothing behind."""
    if os.path.lexists(path):
        raise TraceNotWritten(f"{path} exists already: remove it or name a new file")
    try:
        fd, draft = tempfile.mkstemp(prefix=".trace_gen-", suffix=".partial", dir=os.path.dirname(path) or ".")
    except OSError as exc:
        raise TraceNotWritten(f"cannot create {path}: {exc.strerror or exc}") from exc
    try:
        with open(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        os.link(draft, path)
    except FileExistsError as exc:  # made meanwhile by someone else: theirs, left as it is
        raise TraceNotWritten(f"{path} exists already: remove it or name a new file") from exc
    except OSError as exc:
        raise TraceNotWritten(f"cannot write {path}: {exc.strerror or exc}; nothing was left") from exc
    finally:
        os.unlink(draft)


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of requests") from None
    if not 1 <= count <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{count}: expected 1 to {MAX_COUNT:,}")
    return count


def seed_argument(text: str) -> int:
    """A seed of 0 or more: ``random.Random`` seeds with an int's absolute value, so -1 would draw seed 1's trace."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"{seed}: expected 0 or more (a negative seed draws the same as its "
                                         "absolute value)")
    return seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_gen")
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("count", type=_count, help=f"requests, 1 to {MAX_COUNT:,}")
    parser.add_argument("path", help="a new file (an existing one is refused)")
    parser.add_argument("--seed", type=seed_argument, default=1)
    args = parser.parse_args(argv)
    try:
        write(KINDS[args.kind](args.count, args.seed), args.path, args.seed)
    except TraceNotWritten as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
