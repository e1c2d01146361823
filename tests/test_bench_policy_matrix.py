"""``python -m benchmarks.policy_matrix``'s command line: a held-out trace replayed alone, and bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.interrupted import sigterm_once_a_child_starts

from benchmarks import trace_gen
from benchmarks.policy_matrix import render
from benchmarks.trace_sim import load, wtinylfu


def test_a_trace_file_is_replayed_alone_with_no_kinds(tmp_path) -> None:
    """``--trace FILE --kinds`` (none) replays only the file, whole and its first requests, at three sizes; L1
    under ``lru`` finds what the offline LRU does (the same order, computed apart by ``trace_sim``)."""
    path = tmp_path / "held_out.jsonl"
    trace_gen.write(trace_gen.KINDS["conversations"](300, 7), str(path), 7)
    done = subprocess.run([sys.executable, "-m", "benchmarks.policy_matrix", "--trace", str(path), "--kinds",
                           "--requests", "300", "--first", "100", "--policies", "lru", "--json", "--jobs", "1"],
                          capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stderr
    rows = json.loads(done.stdout)
    assert {("held_out", 300), ("held_out", 100)} == {(row["trace"], row["requests"]) for row in rows}
    assert 6 == len(rows)
    assert [row["lru"] for row in rows] == [row["l1_lru"] for row in rows]
    requests = load(str(path), 300)  # W-TinyLFU beside them, computed from the same requests at the same sizes
    whole = [row for row in rows if row["requests"] == 300]
    assert [row["wtinylfu"] for row in whole] == [wtinylfu(requests, row["blocks"]).hit_ratio for row in whole]
    assert render(rows, ("lru",)).splitlines()[0] == ("| trace | requests | size | blocks | lru | arc | wtinylfu | "
                                                      "lmcache_sim | l1_lru | lru: below |")


@pytest.mark.parametrize("args, message", [
    (["--kinds"], "nothing to replay: no --trace file and no --kinds"),
    (["--kinds", "nosuch"], "argument --kinds: invalid choice: 'nosuch'"),
    (["--policies", "mru"], "argument --policies: invalid choice: 'mru'"),
    (["--requests", "0"], "--requests 0: expected at least 1"),
    (["--seed", "-3"], "argument --seed: -3: expected 0 or more"),
    (["--requests", "1000001"], "--requests 1000001: expected at most 1,000,000 (built in memory)"),
    # a file named as a kind was replaced by the generated trace without a word
    (["--trace", "{rag}", "--kinds", "rag"], "two traces named rag (a --trace file's name without .jsonl, or a "
                                             "--kinds kind): name each once"),
    (["--trace", "/nonexistent/held_out.jsonl", "--kinds"], "--trace: not a readable Mooncake-format trace: "
                                                             "/nonexistent/held_out.jsonl: No such file or directory"),
    (["--trace", "{junk}", "--kinds"], "junk.jsonl, line 2: not JSON"),
    (["--trace", "{empty}", "--kinds"], "empty.jsonl: no request in it")])
def test_a_bad_argument_is_one_line_and_exit_status_2(tmp_path, args: list[str], message: str) -> None:
    (tmp_path / "junk.jsonl").write_text('{"hash_ids": [1, 2]}\nnot json\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "rag.jsonl").write_text('{"hash_ids": [1, 2]}\n')
    args = [arg.format(junk=tmp_path / "junk.jsonl", empty=tmp_path / "empty.jsonl", rag=tmp_path / "rag.jsonl")
            for arg in args]
    done = subprocess.run([sys.executable, "-m", "benchmarks.policy_matrix", *args], capture_output=True, text=True,
                          timeout=60)
    assert 2 == done.returncode and message in done.stderr.strip().splitlines()[-1], done.stderr


def test_sigterm_ends_the_workers_and_removes_the_scratch_traces(tmp_path):
    """SIGTERM while the workers replay: status 130, the workers gone, no scratch folder left in TMPDIR (they ran
    on, orphaned, and the generated traces stayed)."""
    ended = sigterm_once_a_child_starts([sys.executable, "-m", "benchmarks.policy_matrix", "--kinds", "rag",
                                         "conversations", "--requests", "6000", "--jobs", "2"], tmp_path,
                                        "the pool's workers to start")
    status, stderr, alive = ended
    # its one line, after any progress line: no worker's traceback (they had printed KeyboardInterrupt's)
    assert (130, "[policy_matrix] interrupted: its workers and scratch files are gone", [], []) == (
        status, stderr[-1], alive, [line for line in stderr[:-1] if not line.endswith(" done")])
    assert [] == os.listdir(tmp_path)


_SIGTERM_AS_THE_POOL_STARTS_OR_STOPS = """
import multiprocessing, multiprocessing.pool, os, signal, sys
from benchmarks import policy_matrix

signal.signal(signal.SIGTERM, signal.default_int_handler)
built = []
Pool = multiprocessing.pool.Pool
if "{when}" == "starts":
    forking = Pool._repopulate_pool

    def repopulate_then_sigterm(self):  # inside Pool.__init__, its workers forked, its threads not yet started
        built.append(self)
        forking(self)
        os.kill(os.getpid(), signal.SIGTERM)

    Pool._repopulate_pool = repopulate_then_sigterm
else:
    terminating = Pool._terminate_pool.__func__

    # inside the termination a first Ctrl-C began, before it tells the pool's threads to stop: later, the thread
    # that keeps the pool could see that and have the workers told to exit, a race the count would read
    def sigterm_then_terminate(cls, *args):
        os.kill(os.getpid(), signal.SIGTERM)
        terminating(cls, *args)

    Pool._terminate_pool = classmethod(sigterm_then_terminate)
try:
    with {pool} as pool:
        built.append(pool)
        pool.map(abs, range(4))
        if "{when}" == "stops":
            raise KeyboardInterrupt
    print("not interrupted")
except KeyboardInterrupt:
    workers = [worker for pool in built for worker in pool._pool]
    print(len(workers), sum(worker.is_alive() for worker in workers), flush=True)
    for worker in workers:
        worker.kill()
    os._exit(0)  # a pool never terminated would hang the interpreter's exit, which joins it
"""


@pytest.mark.parametrize("when", ["starts", "stops"])
@pytest.mark.parametrize("pool, workers_left", [("multiprocessing.Pool(2)", 2), ("policy_matrix.worker_pool(2)", 0)])
def test_sigterm_as_the_pool_starts_or_stops_leaves_no_worker(when: str, pool: str, workers_left: int) -> None:
    """SIGTERM (as Ctrl-C) that comes while the replays' pool forks its workers, or while a first Ctrl-C terminates
    it: a pool built in the with statement itself leaves its 2 workers running (each waits on a queue whose writing
    end it holds too); ``worker_pool`` holds the signal back until the pool is whole and held, and while it is
    terminated, and no worker is left."""
    script = _SIGTERM_AS_THE_POOL_STARTS_OR_STOPS.format(when=when, pool=pool)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode and f"2 {workers_left}" == done.stdout.strip(), done.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_pool_forks_its_workers_whatever_the_default_start_method(method: str) -> None:
    """Another start method's resource tracker takes SIGINT and SIGTERM back while the pool starts (and Python 3.14
    makes forkserver Linux's default): the workers are forked whatever the default, their command line the parent's
(a spawned or forkserver worker runs multiprocessing's own)."""
    script = (f"import multiprocessing, os, psutil\nmultiprocessing.set_start_method({method!r})\n"
              "from benchmarks import policy_matrix\n"
              "with policy_matrix.worker_pool(1) as pool:\n"
              "    worker = psutil.Process(pool.apply(os.getpid))\n"
              "    print(worker.cmdline() == psutil.Process().cmdline(), multiprocessing.get_start_method())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode and f"True {method}" == done.stdout.strip(), done.stderr
