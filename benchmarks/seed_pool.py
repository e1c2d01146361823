"""What the seeded replays (``phase_ablation``, ``seed_spread``) share: their command line (seeds, kinds, two
lengths, jobs), each job's traces and their references, and their worker pool, one job per kind and seed spread
over processes, a line per job done, and Ctrl-C or SIGTERM ending the workers with one line."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import trace_gen
from benchmarks.arguments import whole_number
from benchmarks.policy_matrix import lmcache_best, sizes, worker_pool
from benchmarks.trace_sim import TraceRequest, arc, lru

Job = tuple[str, int, int, int]  # kind, seed, requests, first


def seeded_arguments(parser: argparse.ArgumentParser, seeds: tuple[int, int], requests: int, first: int,
                     what_json_prints: str) -> None:
    """``parser``'s ``--seeds``, ``--kinds``, ``--requests``, ``--first``, ``--jobs`` and ``--json``, with these
    defaults."""
    parser.add_argument("--seeds", nargs=2, type=trace_gen.seed_argument, default=list(seeds),
                        metavar=("FIRST", "LAST"),
                        help=f"the generated traces' seeds, FIRST to LAST (default {seeds[0]} {seeds[1]})")
    parser.add_argument("--kinds", nargs="+", choices=sorted(trace_gen.KINDS), default=list(trace_gen.KINDS))
    parser.add_argument("--requests", type=whole_number(1), default=requests, help=f"default {requests:,}")
    parser.add_argument("--first", type=whole_number(1), default=first, help=f"also the first N (default {first:,})")
    parser.add_argument("--jobs", type=whole_number(1), default=2)
    parser.add_argument("--json", action="store_true", help=f"print {what_json_prints} as JSON")


def work_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Job]:
    """The jobs ``args`` (parsed by a parser given :func:`seeded_arguments`) ask for, kind by kind and seed by seed;
    ``parser`` exits with one line where they do not fit together."""
    first_seed, last_seed = args.seeds
    if last_seed < first_seed:
        parser.error(f"--seeds {first_seed} {last_seed}: the last seed is below the first")
    if args.requests > trace_gen.MAX_COUNT:
        parser.error(f"--requests {args.requests}: expected at most {trace_gen.MAX_COUNT:,}")
    if args.first >= args.requests:
        parser.error(f"--first {args.first}: expected fewer than --requests {args.requests}")
    return [(kind, seed, args.requests, args.first) for kind in args.kinds
            for seed in range(first_seed, last_seed + 1)]


def referenced(job: Job) -> Iterator[tuple[list[TraceRequest], dict[str, Any]]]:
    """The job's trace, whole and its first requests, at each of ``bench trace``'s sizes: the requests and a row
    of the references (the offline LRU and ARC, ``lmcache_sim``)."""
    kind, seed, requests, first = job
    whole = trace_gen.KINDS[kind](requests, seed)
    for limit in (requests, first):
        trace = whole[:limit]
        for size, blocks in sizes(trace):
            yield trace, {"trace": kind, "seed": seed, "requests": len(trace), "size": size, "blocks": blocks,
                          "lru": lru(trace, blocks).hit_ratio, "arc": arc(trace, blocks).hit_ratio,
                          "lmcache_sim": lmcache_best(trace, blocks)}


def seeded_replay(name: str, doc: str, defaults: tuple[tuple[int, int], int, int], what_json_prints: str,
                  rows_of: Callable[[Job], list[dict[str, Any]]], argv: list[str] | None,
                  progress: Callable[[str], None] | None) -> tuple[argparse.Namespace, list[dict[str, Any]] | None]:
    """``argv`` parsed as ``python -m benchmarks.<name>`` (described by the first sentence of its module's ``doc``
    after the synopsis; :func:`seeded_arguments`, ``defaults``: seeds, requests, first), and the jobs it asks for
    replayed (:func:`replayed`; ``progress``: where its lines go, stderr by default): the arguments and the rows, None
    where the run was stopped."""
    described = doc.split("``: ", 1)[1].split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=described)
    seeded_arguments(parser, *defaults, what_json_prints)
    args = parser.parse_args(argv)
    work = work_of(parser, args)
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    return args, replayed(name, rows_of, work, args.jobs, say)


def replayed(name: str, rows_of: Callable[[Job], list[dict[str, Any]]], work: list[Job], jobs: int,
             say: Callable[[str], None]) -> list[dict[str, Any]] | None:
    """Every job of ``work`` through ``rows_of`` on at most ``jobs`` processes: their rows in ``work``'s order, or
    None where Ctrl-C or SIGTERM stopped the run (its workers gone; ``name`` in what is said)."""
    rows: list[dict[str, Any]] = []
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the workers go too
    try:
        with worker_pool(min(jobs, len(work))) as pool:
            for done, job_rows in enumerate(pool.imap(rows_of, work), 1):
                rows.extend(job_rows)
                say(f"[{name}] {job_rows[0]['trace']} seed {job_rows[0]['seed']} done ({done}/{len(work)})")
    except KeyboardInterrupt:
        say(f"[{name}] interrupted: its workers are gone")
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return rows
