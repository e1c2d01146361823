"""``python -m benchmarks trace``: its offline LRU is L1's own order, Belady's MIN, ARC and W-TinyLFU are what they
claim, and the benchmark replays a trace (``trace_gen``'s conversations) through a real service."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from support.performance_docs import NUMBER_WORDS, doc, flattened, raw_results

from benchmarks import __main__ as bench_main
from benchmarks import mrc_traces, trace, trace_gen
from benchmarks.lmcache_servers import LMCacheEnvMissing, lmcache_python
from benchmarks.policy_matrix import LMCACHE_PERIODS, TOLERANCE, l1_found, lmcache_sim
from benchmarks.trace import SHARES
from benchmarks.trace_sim import TraceRequest, _WTinyLfu, arc, belady, load, lru, lru_capacity_for, outcome, wtinylfu
from mpcache.eviction import phases as order_phases
from mpcache.eviction.returns import LARGE_STORE_SHARE
from mpcache.eviction.verdicts import STORE_VERDICTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_offline_lru_finds_exactly_what_l1_finds_request_by_request():
    """The same trace through L1 (--l1-policy lru) and through the offline LRU of N blocks: the same prefix
    found for every request."""
    requests = trace_gen.conversations(600, seed=1)
    for blocks in (6, 20, 60):
        assert l1_found(requests, blocks, "lru") == lru(requests, blocks).found


@pytest.fixture
def join_at_3_sigmas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order the runs kept before 2026-12-07's join at 2 standard deviations ran: its join at 3, and at 3.5 from
    L1's highest lead, and its split after a join on every ghost hit of an access, so that replaying their rows in
    process finds what they kept."""
    monkeypatch.setattr(order_phases, "JOIN_SIGMAS", 3.0)
    monkeypatch.setattr(order_phases, "JOIN_FALL_SIGMAS", 3.5)
    monkeypatch.setattr(order_phases, "RESPLIT_HITS_PER_ACCESS", float("inf"))


def test_adaptive_undoes_its_split_where_a_large_l1_is_better_served_by_lru(monkeypatch):
    """``trace_gen``'s agentic seed 8 at the large size: kept split (``join`` a no-op), ARC's lists trail the offline
    LRU by more than issue 39's tolerance; ``adaptive`` ends ARC's phase once L1 trails its shadow LRU, and stays
    within it."""
    from mpcache.eviction.order import ArcOrder

    requests = trace_gen.agentic(6000, seed=8)
    blocks = lru_capacity_for(requests, SHARES["large"], lru(requests, math.inf).hit_ratio)
    offline = lru(requests, blocks).hit_ratio
    joined = outcome(requests, l1_found(requests, blocks, "adaptive")).hit_ratio
    monkeypatch.setattr(ArcOrder, "join", lambda order: None)
    kept_split = outcome(requests, l1_found(requests, blocks, "adaptive")).hit_ratio
    assert kept_split < offline - TOLERANCE <= joined


def test_lmcache_sim_trims_to_80_percent_on_its_period_and_drops_a_store_it_has_no_room_for():
    """Two blocks: [1, 2] fills them; before the second request the trim takes the oldest (2, as a store's chunks
    are kept head last-used); [3, 4] has no room beside 1 and is dropped, so [1, 2] finds 1 only.  With room for
    everything it finds what the infinite LRU does."""
    requests = [TraceRequest([1, 2], 1024), TraceRequest([3, 4], 1024), TraceRequest([1, 2], 1024)]
    assert [0, 0, 1] == lmcache_sim(requests, 2, 1).found
    conversations = trace_gen.conversations(300, seed=3)
    assert lru(conversations, math.inf).found == lmcache_sim(conversations, 10**6, 1).found


def test_belady_is_never_below_lru_and_an_infinite_cache_finds_every_repeat():
    """Belady's MIN holds at least LRU's blocks at every size; with room for everything both find every
    block seen before (a one-turn trace where each request repeats the previous one: all but the first)."""
    requests = trace_gen.conversations(600, seed=2)
    for blocks in (4, 10, 30, 100):
        assert belady(requests, blocks).hit_ratio >= lru(requests, blocks).hit_ratio
    repeated = [TraceRequest([1, 2, 3], 1536)] * 5
    assert [0, 3, 3, 3, 3] == lru(repeated, math.inf).found == belady(repeated, 1000).found


def test_lru_tail_first_evicts_a_prefix_from_its_tail():
    """Room for three blocks: [1, 2] then [3, 4] (its store makes room for 4). First to last, the head 1 goes
    and [1, 2] finds nothing after; last to first, the tail 2 goes and [1, 2] still finds 1."""
    requests = [TraceRequest([1, 2], 1024), TraceRequest([3, 4], 1024), TraceRequest([1, 2], 1024)]
    assert ([0, 0, 0], [0, 0, 1]) == (lru(requests, 3).found, lru(requests, 3, tail_first=True).found)


def test_belady_keeps_the_block_used_soonest():
    """Room for one block: Belady keeps block 1, asked for again before block 2, and does not store 2; LRU
    replaces 1 with 2 and then 2 with 1, finding nothing."""
    requests = [TraceRequest([1], 512), TraceRequest([2], 512), TraceRequest([1], 512), TraceRequest([2], 512)]
    assert ([0, 0, 1, 0], [0, 0, 0, 0]) == (belady(requests, 1).found, lru(requests, 1).found)


def test_arc_keeps_what_was_seen_twice_through_a_scan_that_lru_lets_flush_it():
    """Room for three blocks: 1 and 2 are asked for twice, then a scan of one-off blocks, then 1 and 2 again.
    ARC keeps the twice-seen blocks in T2 and finds them; LRU has evicted them for the scan."""
    requests = [TraceRequest([h], 512) for h in (1, 2, 1, 2, 10, 11, 12, 13, 1, 2)]
    assert (2, 0) == (sum(arc(requests, 3).found[8:]), sum(lru(requests, 3).found[8:]))


def test_wtinylfu_keeps_what_is_asked_for_often_through_a_scan_that_lru_lets_flush_it():
    """Room for four blocks (a window of one, a main area of three): 1 and 2 are asked for three times each, then
    ten one-off blocks, then 1 and 2 again.  Each one-off block the window lets go was asked for once, less often
    than 1 and 2, so the main area keeps them and W-TinyLFU finds both; LRU has evicted them for the scan."""
    requests = [TraceRequest([h], 512) for h in (1, 2, 1, 2, 1, 2, *range(10, 20), 1, 2)]
    assert (2, 0) == (sum(wtinylfu(requests, 4).found[16:]), sum(lru(requests, 4).found[16:]))


def test_wtinylfu_holds_at_most_its_capacity_and_never_evicts_what_a_request_found():
    """On generated conversations at several sizes, after every request W-TinyLFU holds at most its capacity, and
    every block a request found or had is still held once it is done; with room for every block it finds what the
    infinite LRU does."""
    requests = trace_gen.conversations(800, seed=4)
    for capacity in (4, 10, 30, 100):
        cache = _WTinyLfu(capacity)
        for request in requests:
            held, mine = {block for block in request.hashes if block in cache}, set(request.hashes)
            for block in reversed(request.hashes):
                cache.touch(block, mine)
            assert len(cache.window) + len(cache.probation) + len(cache.protected) <= capacity
            assert all(block in cache for block in held)
    everything = len({block for request in requests for block in request.hashes})
    assert wtinylfu(requests, everything + 100).found == lru(requests, math.inf).found


def test_every_generated_kind_is_a_trace_the_benchmark_reads(tmp_path):
    """Each kind writes requests whose blocks repeat across requests (something to cache) and reads back
    as written."""
    for kind, make in trace_gen.KINDS.items():
        requests = make(200, 1)
        path = tmp_path / f"{kind}.jsonl"
        trace_gen.write(requests, str(path))
        assert requests == load(str(path))
        assert 0 < lru(requests, math.inf).hit_ratio < 1, kind


BAD_TRACES = {
    "not_json": (b'{"hash_ids": [1, 2]}\n{"hash_ids": [1,\n', "bad.jsonl, line 2: not JSON"),
    "text_hashes": (b'{"hash_ids": ["1", 2]}\n', 'bad.jsonl, line 1: hash_ids must be a list of integers'),
    "negative_hash": (b'{"hash_ids": [1, -2]}\n', "hash_ids must be a list of integers in 0..2**64-1, not [1, -2]"),
    "hash_past_64_bits": (b'{"hash_ids": [18446744073709551616]}\n', "integers in 0..2**64-1"),
    "boolean_hash": (b'{"hash_ids": [true]}\n', "not [true]"),
    "float_input_length": (b'{"hash_ids": [1], "input_length": 2.5}\n', "input_length must be a non-negative "
                                                                         "integer, not 2.5"),
    "a_list": (b"[1, 2]\n", "bad.jsonl, line 1: a JSON list, not an object"),
    "binary": (b"\xb9\x00\xff", "bad.jsonl: not UTF-8 text"),
    "empty": (b"\n\n", "bad.jsonl: no request in it"),
    "nested_too_deeply": (b"[" * 100_000 + b"\n", "bad.jsonl, line 1: JSON nested too deeply"),
}


@pytest.mark.parametrize("kind", sorted(BAD_TRACES))
def test_an_unreadable_trace_is_one_line_naming_the_line_and_exit_status_2(tmp_path, kind: str) -> None:
    """``python -m benchmarks trace`` and ``report`` read the file before anything runs, and say what is wrong
    with it and where: no traceback, nothing started."""
    content, message = BAD_TRACES[kind]
    (tmp_path / "bad.jsonl").write_bytes(content)
    for name in ("trace", "report"):
        output = ["--output", str(tmp_path / "report.md")] if name == "report" else []
        done = subprocess.run([sys.executable, "-m", "benchmarks", name, str(tmp_path / "bad.jsonl"), *output],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        last = done.stderr.strip().splitlines()[-1]
        assert (2, True, False) == (done.returncode, message in last, "Traceback" in done.stderr), done.stderr
        assert last.startswith("python -m benchmarks: error: not a readable Mooncake-format trace: ")
    assert ["bad.jsonl"] == os.listdir(tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl: No such file or directory"),
    (["trace", "{good}", "--trace-requests", "0"], "argument --trace-requests: expected a whole number >= 1, got '0'"),
    # the path after the flags is the trace's (it was "unrecognized arguments"): the flag is what is refused
    (["trace", "--json", "--trace-requests", "0", "{good}"], "argument --trace-requests: expected a whole number")])
def test_a_missing_trace_or_no_requests_asked_is_one_line_and_exit_status_2(tmp_path, argv, message) -> None:
    trace_gen.write(trace_gen.conversations(5, seed=1), str(tmp_path / "good.jsonl"))
    argv = [arg.format(good=tmp_path / "good.jsonl") for arg in argv]
    done = subprocess.run([sys.executable, "-m", "benchmarks", *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert (2, True) == (done.returncode, message in done.stderr.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("argv, message", [
    (["--requests", "0"], "--requests 0: expected 1 to 1,000,000"),
    (["--requests", "1000001"], "--requests 1000001: expected 1 to 1,000,000"),
    (["--rates", "nan"], "--rates nan: expected a rate in (0, 1]"),  # printed NaN into its JSON
    (["--rates", "7"], "--rates 7.0: expected a rate in (0, 1]"),
    (["--max-keys", "-5"], "--max-keys -5: expected an integer 64..4194304, as --mrc-max-keys takes"),
    (["--policies", "bogus"], "argument --policies: invalid choice: 'bogus'"),
    (["--only", "nosuch"], "--only nosuch: no such trace; expected some of kv, long, conversations"),  # printed {}
    (["--trace", "{kv}"], "two traces named kv: rename the --trace file"),
])
def test_the_mrc_accuracy_benchmark_refuses_what_it_cannot_measure_in_one_line(tmp_path, argv, message) -> None:
    trace_gen.write(trace_gen.conversations(5, seed=1), str(tmp_path / "kv.jsonl"))
    done = subprocess.run([sys.executable, "-m", "benchmarks.mrc_accuracy",
                           *[arg.format(kv=tmp_path / "kv.jsonl") for arg in argv]],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (2, True) == (done.returncode, done.stderr.strip().splitlines()[-1].split("error: ", 1)[1].startswith(
        message)), done.stderr


def test_the_mrc_accuracy_benchmark_refuses_an_unreadable_trace_in_one_line(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_bytes(BAD_TRACES["negative_hash"][0])
    done = subprocess.run([sys.executable, "-m", "benchmarks.mrc_accuracy", "--trace", str(tmp_path / "bad.jsonl")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (2, "Traceback" in done.stderr) == (done.returncode, False), done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("bad.jsonl, line 1: hash_ids must be a list of integers in "
                                                         "0..2**64-1, not [1, -2]")


def _trace_gen(*args: str, **options: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.trace_gen", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, **options)


def test_trace_gen_makes_a_new_file_of_mode_0600_and_writes_through_nothing_it_did_not_make(tmp_path) -> None:
    """An existing file, a link to one (another's file) and a pipe are refused, left as they were; a new trace
    is 0600 and reads back as the kind's requests."""
    (tmp_path / "theirs").write_text("precious\n")
    os.symlink(tmp_path / "theirs", tmp_path / "link")
    os.mkfifo(tmp_path / "pipe")
    for name in ("theirs", "link", "pipe"):
        done = _trace_gen("rag", "5", str(tmp_path / name))
        assert (2, f"error: {tmp_path / name} exists already: remove it or name a new file") == (
            done.returncode, done.stderr.strip().split("trace_gen: ", 1)[1]), done.stderr
    assert "precious\n" == (tmp_path / "theirs").read_text()
    done = _trace_gen("rag", "5", str(tmp_path / "new.jsonl"), "--seed", "4")
    assert 0 == done.returncode, done.stderr
    assert 0o600 == os.stat(tmp_path / "new.jsonl").st_mode & 0o777
    assert trace_gen.rag(5, 4) == load(str(tmp_path / "new.jsonl"))


def test_trace_gen_removes_what_it_wrote_when_a_write_fails(tmp_path) -> None:
    """A file-size limit of 8 KiB stands in for a full disk: one line, status 2, no part-written trace left."""
    import resource

    done = _trace_gen("production", "2000", str(tmp_path / "big.jsonl"),
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192)))
    assert (2, []) == (done.returncode, os.listdir(tmp_path)), done.stderr
    assert done.stderr.strip().endswith(f"cannot write {tmp_path / 'big.jsonl'}: File too large; nothing was left")


def test_trace_gen_interrupted_mid_write_leaves_nothing_and_a_rerun_writes_the_trace(tmp_path) -> None:
    """Ctrl-C after 300 of 500 requests (an iterator that raises stands in for it): no part-written trace that a
    rerun would then be refused for."""
    requests = trace_gen.rag(500, 1)

    def interrupted():
        yield from requests[:300]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trace_gen.write(interrupted(), str(tmp_path / "t.jsonl"))  # type: ignore[arg-type]
    assert [] == os.listdir(tmp_path)
    trace_gen.write(requests, str(tmp_path / "t.jsonl"))
    assert (["t.jsonl"], requests) == (os.listdir(tmp_path), load(str(tmp_path / "t.jsonl")))


@pytest.mark.parametrize("argv, message", [
    (["rag", "0"], f"argument count: 0: expected 1 to {trace_gen.MAX_COUNT:,}"),
    (["rag", str(trace_gen.MAX_COUNT + 1)], f"argument count: {trace_gen.MAX_COUNT + 1}: expected 1 to "),
    (["rag", "5", "--seed", "-1"], "argument --seed: -1: expected 0 or more"),
    (["rag", "x"], "argument count: 'x': expected a whole number of requests"),
    (["rag", "5", "--seed", "abc"], "argument --seed: 'abc': expected a whole number")])
def test_trace_gen_refuses_a_count_out_of_range_and_a_negative_seed(tmp_path, argv, message) -> None:
    done = _trace_gen(*argv[:2], str(tmp_path / "t.jsonl"), *argv[2:])
    assert (2, True, []) == (done.returncode, message in done.stderr.strip().splitlines()[-1],
                             os.listdir(tmp_path)), done.stderr


def test_random_draws_seed_minus_one_as_seed_one_which_is_why_it_is_refused() -> None:
    assert trace_gen.conversations(50, -1) == trace_gen.conversations(50, 1)


def test_production_kind_mixes_one_off_long_prompts_with_sessions_behind_shared_prompts():
    """``production``: every request starts with the platform's prompt; about 35 % are one-off long prompts
    (20 to 80 blocks after the prompt that no other request asks for) and about 40 % a session's next turn
    (an earlier request's blocks, extended)."""
    requests = trace_gen.production(2000, 1)
    platform = requests[0].hashes[:2]
    assert all(r.hashes[:2] == platform for r in requests)
    seen: dict[int, int] = {}
    for r in requests:
        for h in r.hashes:
            seen[h] = seen.get(h, 0) + 1
    one_off = [r for r in requests if sum(seen[h] == 1 for h in r.hashes) >= 20]
    previous: set[tuple[int, ...]] = set()
    turns = 0
    for r in requests:
        turns += any(tuple(r.hashes[:n]) in previous for n in range(len(r.hashes) - 1, 2, -1))
        previous.add(tuple(r.hashes))
    assert 0.3 < len(one_off) / len(requests) < 0.4
    assert 0.35 < turns / len(requests) < 0.45


def test_trace_benchmark_replays_through_the_service_and_matches_the_offline_lru(tmp_path):
    """At the three sizes it derives, mpcache with --l1-policy lru finds exactly the offline LRU's blocks and
    with adaptive and arc exactly what L1 in process finds with that order (adaptive, somewhere, not LRU's), Belady
    at least as many as LRU; the table shows every policy at every size, and the report's row every size."""
    path = tmp_path / "trace.jsonl"
    requests = trace_gen.conversations(300, seed=3)
    trace_gen.write(requests, str(path))
    assert 300 == len(load(str(path)))
    result = trace.run(path=str(path), lmcache=False)
    assert ["small", "middle", "large"] == list(result["sizes"])
    blocks = [size["blocks"] for size in result["sizes"].values()]
    assert blocks == sorted(blocks) and blocks[0] > 0
    for size in result["sizes"].values():
        assert size["mpcache_lru"] == size["offline_lru"]
        for policy in ("adaptive", "arc"):
            expected = outcome(requests, l1_found(requests, size["blocks"], policy)).tokens_saved
            assert expected == size[f"mpcache_{policy}"]["tokens_saved"], (policy, size["blocks"])
        assert size["belady"]["tokens_saved"] >= size["offline_lru"]["tokens_saved"] > 0
    assert any(s["mpcache_adaptive"] != s["mpcache_lru"] for s in result["sizes"].values())
    table = trace.render(result)
    assert 3 == sum(line.startswith(("| small", "| middle", "| large")) for line in table.splitlines())
    assert {"lru_tail_first_simulated", "arc_simulated", "arc_tail_first_simulated"} <= set(result["sizes"]["small"])
    report = tmp_path / "PERFORMANCE.md"
    bench_main.write_report({"trace": result}, str(report))
    [row] = [line for line in report.read_text().splitlines() if line.startswith("| `trace`")]
    assert all(f"{name} L1 ({size['blocks']:,} blocks)" in row for name, size in result["sizes"].items())


def test_trace_benchmark_without_a_file_is_one_clear_line():
    """No trace file: exit status 2 and one line saying how to give one."""
    bench = subprocess.run([sys.executable, "-m", "benchmarks", "trace"], capture_output=True, text=True,
                           timeout=60)
    assert (2, "") == (bench.returncode, bench.stdout)
    assert 1 == len(bench.stderr.strip().splitlines()) and "trace PATH" in bench.stderr


def test_lmcache_server_column_replays_through_lmcache_s_adapters_and_finds_every_repeat_with_room():
    """LMCache's own server, the trace replayed through LMCache's adapters, with room for twice the trace's
    blocks: every request finds exactly the blocks an infinite cache finds (none it never stored, none lost), no
    store is refused and its L1 never fails an allocation; with room for 6 blocks its L1 fails allocations, and
    the client is told of none."""
    try:
        python = lmcache_python()
    except LMCacheEnvMissing as exc:
        if os.environ.get("MPCACHE_TEST_REQUIRE_LMCACHE") == "1":
            pytest.fail(f"MPCACHE_TEST_REQUIRE_LMCACHE=1, but LMCache 0.5.6 is unusable: {exc}", pytrace=False)
        pytest.skip(f"LMCache 0.5.6 not available: {exc}")
    requests = trace_gen.conversations(150, seed=4)
    distinct = len({h for request in requests for h in request.hashes})
    expected = lru(requests, math.inf).found
    assert sum(expected) > 0
    assert (expected, 0, 0) == trace.lmcache_found(requests, 2 * distinct, python)
    _, refused, failures = trace.lmcache_found(requests, 6, python)  # three requests' worth: full all the time
    assert (0, True) == (refused, failures > 0)  # it drops stores it cannot place, and tells the client nothing


def test_lmcache_server_column_is_its_median_run_with_every_run_beside_it(monkeypatch):
    """LMCache's server replayed three times (its result swings with timing): the column is the middle run's
    (hit ratio, tokens saved, failures), every run listed in order, and the table shows their range."""
    requests = [TraceRequest(hashes=[1, 2, 3, 4], input_tokens=4 * 512)] * 2
    runs = iter([([0, 2], 0, 30), ([0, 4], 0, 10), ([0, 1], 1, 40)])  # found per request, refused, failures
    monkeypatch.setattr(trace, "lmcache_found", lambda *_: next(runs))
    progress: list[str] = []
    column = trace._lmcache_server(requests, 6, "python", 1.0, 3, progress.append, "trace: small: ")
    assert (0.25, 2 * 512, 0, 30) == (column["hit_ratio"], column["tokens_saved"], column["refused_store_requests"],
                                      column["allocation_failures"])
    assert [(0.25, 30), (0.5, 10), (0.125, 40)] == [(run["hit_ratio"], run["allocation_failures"])
                                                     for run in column["runs"]]
    assert "trace: small: LMCache's server, the trace through its adapters (run 3 of 3)" == progress[-1]
    assert " (median of 3 runs, 0.1250–0.5000)" == trace._spread(column)
    assert "" == trace._spread({**column, "runs": column["runs"][:1]})


def test_a_replay_cut_off_by_its_cache_process_going_away_says_how_it_went(monkeypatch):
    """The cache process killed mid-replay (SIGKILL): the replay's error carries the service's log, which names
    the exit and its status (what a cut-off benchmark run needs to be explained)."""
    engine_steps = mrc_traces._engine_steps

    def killed_midway(client, cache, *args):
        cache.kill()
        cache.wait(30)
        return engine_steps(client, cache, *args)

    monkeypatch.setattr(mrc_traces, "_engine_steps", killed_midway)
    with pytest.raises(RuntimeError) as failed:
        mrc_traces.replay([("m", "", [1, 2, 3])], 64 * 4096, 0.0)
    assert "child.exited" in str(failed.value) and "-9" in str(failed.value)


def _table_rows(header: str, section: str | None = None) -> list[list[str]]:
    """The cells of each row of docs/PERFORMANCE.md's table under ``header`` (its separator line skipped), the first
    such table after the heading line ``section`` where given."""
    lines = doc("PERFORMANCE.md").splitlines()
    start = lines.index(header, lines.index(section) if section else 0) + 2
    return [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in itertools.takewhile(lambda line: line.startswith("| "), lines[start:])]


def test_performance_md_trace_gen_table_is_the_benchmark_s_raw_output():
    """Each row of docs/PERFORMANCE.md's table of trace_gen's traces reads the numbers docs/PERFORMANCE.json
    keeps from ``python -m benchmarks trace PATH --json`` (every trace, every size, no row without its run)."""
    raw = raw_results()["trace_gen"]
    rows = _table_rows(TRACE_GEN_HEADER)
    expected = []
    for kind, result in raw.items():
        for name, size in result["sizes"].items():
            expected.append([f"{kind} ({result['requests']:,})", name, f"{size['blocks']:,}",
                             *(f"{size[c]['hit_ratio']:.4f}" if c in size else "—" for c in TRACE_GEN_COLUMNS),
                             str(result["mpcache_adaptive_over_offline_lru"][name])])
    assert len(expected) == 3 * len(raw) >= 21
    assert sorted(expected) == sorted(rows)


TRACE_GEN_COLUMNS = ("offline_lru", "belady", "arc_simulated", "mpcache_adaptive", "mpcache_lru", "lmcache_server")
TRACE_GEN_HEADER = ("| trace (requests) | L1 | blocks | " + " | ".join(TRACE_GEN_COLUMNS)
                    + " | adaptive × offline LRU's prefill |")


def test_performance_md_policy_matrix_tables_and_held_out_prose_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's ``policy_matrix`` tables (seed 1 and the held-out seeds 2 and 3) are rendered from the
    rows docs/PERFORMANCE.json keeps, and the held-out paragraph's numbers are computed from them."""
    from benchmarks.policy_matrix import render

    seeds = raw_results()["policy_matrix"]
    text = doc("PERFORMANCE.md")
    policies = ("adaptive", "arc", "lru")
    assert all(render(rows, policies) in text for rows in seeds.values()) and len(seeds) == 3
    held = seeds["2"] + seeds["3"]
    prose = flattened(text)
    flagged = [sum(1 for row in held if row[f"flags_{policy}"]) for policy in policies]
    assert (f"`adaptive` is flagged in {flagged[0]} of {len(held)} rows, `arc` in {flagged[1]} and `lru` in "
            f"{flagged[2]}.") in prose

    def row(seed: str, trace: str, requests: int, size: str) -> dict:
        [found] = [r for r in seeds[seed] if (r["trace"], r["requests"], r["size"]) == (trace, requests, size)]
        return found

    def gain(seed: str, trace: str, requests: int, size: str) -> float:
        found = row(seed, trace, requests, size)
        return found["l1_adaptive"] / found["lru"]

    def below(seed: str, trace: str, requests: int, size: str) -> str:
        found = row(seed, trace, requests, size)
        return f"{found['lru'] - found['l1_adaptive']:.4f}"

    for seed in ("2", "3"):
        ratios = " / ".join(f"{gain(seed, 'production', 6000, size):.2f}×" for size in ("small", "middle", "large"))
        assert f"{ratios} (seed {seed})" in prose
    assert all(r["l1_adaptive"] > r["lmcache_sim"] for r in held if r["trace"] == "production")
    cold = [below(seed, "multitenant", 1500, "large") for seed in ("2", "3")]
    assert f"({cold[0]} and {cold[1]} below the offline LRU on seeds 2 and 3)" in prose
    whole = row("2", "multitenant", 6000, "large")
    assert f"reads {whole['l1_adaptive']:.4f} against the offline LRU's {whole['lru']:.4f} over seed 2's" in prose
    conversations = max(r["lru"] - r["l1_adaptive"] for r in held
                        if r["trace"] == "conversations" and r["size"] != "small")
    assert f"(up to {conversations:.4f} below the LRU" in prose
    sim = max(r["lmcache_sim"] - r["l1_adaptive"] for r in held if r["trace"] in ("scan", "conversations"))
    assert f"`lmcache_sim`, the best of its 7 periods, on `scan` and `conversations` (up to {sim:.4f})." in prose


def test_performance_md_half_and_double_predictions_are_the_benchmark_s_raw_output():
    """The ½× / 2× predictions docs/PERFORMANCE.md states for ``trace_gen``'s multitenant and rag are the errors
    docs/PERFORMANCE.json keeps from ``mrc._one_workload`` (each within issue 39's 0.02); docs/MRC.md gives them as
    2026-12-06's, beside today's (tests/test_bench_mrc_accuracy.py)."""
    runs = raw_results()["mrc_half_double"]
    texts = [flattened(doc(page)) for page in ("PERFORMANCE.md", "MRC.md")]
    pairs = []
    for name in ("multitenant", "rag"):
        run = runs[name]
        assert max(run["half_error"], run["double_error"]) <= 0.02
        assert f"{run['mae_online_vs_exact']:.4f} / {run['max_error_online_vs_exact']:.4f} ({name})" in texts[0]
        pairs.append(f"{run['half_error']:.4f} / {run['double_error']:.4f}")
        assert f"{pairs[-1]} ({name})" in texts[0]
    assert f"({pairs[0]} and {pairs[1]} on 2026-12-06;" in texts[1]


def test_performance_md_trace_gen_prose_is_computed_from_the_raw_output():
    """The paragraph under docs/PERFORMANCE.md's table of trace_gen's traces states what docs/PERFORMANCE.json's
    runs show: the worst point against the offline LRU and ARC, the points above LMCache's server, and the one
    below it."""
    raw = raw_results()["trace_gen"]
    prose = flattened(doc("PERFORMANCE.md"))
    points = [(kind, name, size) for kind, result in raw.items() for name, size in result["sizes"].items()]

    def hit(size: dict, column: str) -> float:
        return size[column]["hit_ratio"]

    assert all(hit(size, "mpcache_adaptive") >= hit(size, "arc_simulated") for _, _, size in points)
    kind, name, worst = min(points, key=lambda p: hit(p[2], "mpcache_adaptive") - hit(p[2], "offline_lru"))
    gap = hit(worst, "offline_lru") - hit(worst, "mpcache_adaptive")
    assert f"below the offline LRU by at most {gap:.4f} (`{kind}` {name})" in prose
    below = [(k, n, s) for k, n, s in points if hit(s, "mpcache_adaptive") < hit(s, "lmcache_server")]
    assert f"above LMCache's server at {len(points) - len(below)} of the {len(points)} points" in prose
    [(kind, name, size)] = below
    assert (f"at `{kind}` {name} ({size['blocks']} blocks) the server read {hit(size, 'lmcache_server'):.4f} "
            f"against {hit(size, 'mpcache_adaptive'):.4f}") in prose
    assert f"{size['lmcache_server']['allocation_failures']:,} chunks dropped in this one" in prose
    production, gain = raw["production"]["sizes"]["small"], raw["production"]["mpcache_adaptive_over_offline_lru"]
    assert (f"`adaptive` reads {hit(production, 'mpcache_adaptive'):.4f} against the server's "
            f"{hit(production, 'lmcache_server'):.4f}: {gain['small']}× the offline LRU's prefill") in prose
    assert f"({production['lmcache_server']['allocation_failures']:,} chunks at `production` small" in prose


def test_performance_md_isolation_rerun_prose_is_the_benchmark_s_raw_output():
    """The isolation rerun's paragraph in docs/PERFORMANCE.md states what docs/PERFORMANCE.json keeps of
    ``python -m benchmarks isolation --policies lru,adaptive`` (each workload, and the older tree measured beside),
    the like-for-like ratio within issue 39's 5 %, and the machine's factor over the earlier run it names."""
    runs = {name: run["tp1"][0] for name, run in raw_results()["isolation_policies"].items()}
    prose = flattened(doc("PERFORMANCE.md"))

    def instructions(run: dict, policy: str) -> str:
        return f"{run['net_per_request'][f'mpcache_{policy}']['instructions']:,.0f}"

    unique, mixed, older = runs["unique"], runs["mixed"], runs["unique_at_a567282"]
    assert unique["instructions_over_first"]["mpcache_adaptive"] <= 1.05
    assert (f"`adaptive` {instructions(unique, 'adaptive')} against `lru` {instructions(unique, 'lru')} instructions "
            f"per request, **{unique['instructions_over_first']['mpcache_adaptive']}×**") in prose
    assert (f"The default mix ({mixed['requests']} requests): {instructions(mixed, 'adaptive')} against "
            f"{instructions(mixed, 'lru')}, {mixed['instructions_over_first']['mpcache_adaptive']}×, with chunk hit "
            f"ratios {mixed['hit_chunk_ratio']['mpcache_adaptive']} against {mixed['hit_chunk_ratio']['mpcache_lru']} "
            f"and {mixed['server_calls_per_request']['mpcache_adaptive']['prepare_retrieve']} against "
            f"{mixed['server_calls_per_request']['mpcache_lru']['prepare_retrieve']} `prepare_retrieve` calls") in prose
    assert (f"gave `lru` {instructions(older, 'lru')} and `adaptive` {instructions(older, 'adaptive')} "
            f"({older['instructions_over_first']['mpcache_adaptive']}×, {older['requests']} requests)") in prose
    earlier = 1_464_424  # the like-for-like `lru` count of the earlier run, as the page states it
    assert "1,464,424 against 1,501,003, **1.025×**" in prose
    factor = unique["net_per_request"]["mpcache_lru"]["instructions"] / earlier
    assert f"about {factor:.1f} times the instructions per request" in prose
    recency = runs["unique_recency_phase"]
    assert recency["instructions_over_first"]["mpcache_adaptive"] <= 1.05
    assert (f"with the recency phase: `adaptive` {instructions(recency, 'adaptive')} against `lru` "
            f"{instructions(recency, 'lru')}, **{recency['instructions_over_first']['mpcache_adaptive']}×** "
            f"({recency['requests']} requests)") in prose


def test_performance_md_trace_gen_rerun_prose_is_the_benchmark_s_raw_output():
    """The rerun of ``conversations`` the trace_gen paragraph cites reads, at the small size, what
    docs/PERFORMANCE.json keeps of it, and ``adaptive`` the same as in the table's run at every size."""
    rerun, first = raw_results()["trace_gen_reruns"]["conversations"], raw_results()["trace_gen"]["conversations"]
    small = rerun["sizes"]["small"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"with named stores, the server read {small['lmcache_server']['hit_ratio']:.4f} against "
            f"{small['mpcache_adaptive']['hit_ratio']:.4f}, `adaptive` the same at every size") in prose
    assert all(rerun["sizes"][size]["mpcache_adaptive"]["hit_ratio"] == first["sizes"][size]["mpcache_adaptive"][
        "hit_ratio"] for size in first["sizes"])


RECENCY_HEADER = ("| trace (requests) | L1 | blocks | offline_lru | arc_simulated | mpcache_adaptive | before the "
                  "recency phase | lmcache_server (the run above) | adaptive × offline LRU's prefill |")


def test_performance_md_recency_phase_table_and_prose_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of trace_gen's traces rerun with the recency phase reads what docs/PERFORMANCE.json
    keeps of ``python -m benchmarks trace PATH --json --no-lmcache`` beside the run above (``adaptive`` before, and
    LMCache's server, whose code the phase does not touch), and its paragraph states the worst point against the
    offline LRU and the points against that server, computed from them."""
    rerun, before = raw_results()["trace_gen_recency_phase"], raw_results()["trace_gen"]
    rows = _table_rows(RECENCY_HEADER)
    expected, points = [], []
    for kind, result in rerun.items():
        for name, size in result["sizes"].items():
            old = before[kind]["sizes"][name]
            assert (size["blocks"], size["offline_lru"]) == (old["blocks"], old["offline_lru"])  # the same trace
            expected.append([f"{kind} ({result['requests']:,})", name, f"{size['blocks']:,}",
                             *(f"{size[c]['hit_ratio']:.4f}" for c in ("offline_lru", "arc_simulated",
                                                                         "mpcache_adaptive")),
                             f"{old['mpcache_adaptive']['hit_ratio']:.4f}", f"{old['lmcache_server']['hit_ratio']:.4f}",
                             str(result["mpcache_adaptive_over_offline_lru"][name])])
            points.append((kind, name, size["mpcache_adaptive"]["hit_ratio"], size["offline_lru"]["hit_ratio"],
                           old["lmcache_server"]["hit_ratio"]))
    assert len(expected) == 21 and sorted(expected) == sorted(rows)
    prose = flattened(doc("PERFORMANCE.md"))
    kind, name, ours, lru, _ = min(points, key=lambda p: p[2] - p[3])
    gap = max(lru - ours, 0)
    assert f"below the offline LRU by at most {gap:.4f} (`{kind}` {name}) with the recency phase" in prose
    above = sum(1 for point in points if point[2] > point[4])
    assert f"above the server's column at {above} of the 21 points" in prose


def test_performance_md_synthetic_trace_table_and_ratios_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the synthetic trace is ``python -m benchmarks trace``'s own rendering of the
    run docs/PERFORMANCE.json keeps, and the line under it states that run's gains over the offline LRU and
    LMCache's server, at or above 1.05× the offline LRU's prefill at the small size (issue 39)."""
    from benchmarks.trace import render

    result = raw_results()["trace_synthetic"]
    text = doc("PERFORMANCE.md")
    assert render(result) in text
    sizes = ("small", "middle", "large")

    def gain(theirs: str) -> str:
        hits = [(result["sizes"][s]["mpcache_adaptive"]["hit_ratio"], result["sizes"][s][theirs]["hit_ratio"])
                for s in sizes]
        return " / ".join(f"{ours - other:+.3f}" for ours, other in hits)

    ratios = " / ".join(f"{result['mpcache_adaptive_over_offline_lru'][s]:.3f}×" for s in sizes)
    prose = flattened(text)
    assert result["mpcache_adaptive_over_offline_lru"]["small"] >= 1.05
    assert (f"over the offline LRU: {gain('offline_lru')} hit ratio at the small / middle / large size, "
            f"{ratios}") in prose
    assert f"over LMCache's server {gain('lmcache_server')}." in prose


def _instructions(run: dict) -> tuple[int, int]:
    """An isolation run's instructions per request net of idle, ``adaptive``'s and ``lru``'s."""
    net = run["net_per_request"]
    return round(net["mpcache_adaptive"]["instructions"]), round(net["mpcache_lru"]["instructions"])


GATE_HEADER = ("| trace (requests) | L1 | blocks | offline_lru | mpcache_adaptive | before the gate | "
               "lmcache_server (the runs below) | adaptive × offline LRU's prefill |")


def _gate_rows() -> list[tuple[list[str], dict[str, float]]]:
    """The frequency gate's table as docs/PERFORMANCE.json's runs give it: each row's cells, and its values."""
    raw = raw_results()
    rows = []
    for kind, result in raw["frequency_gate"]["trace"].items():
        before, server = ((raw["trace_synthetic"], raw["trace_synthetic"]) if kind == "synthetic_trace" else
                          (raw["trace_gen_recency_phase"][kind], raw["trace_gen"][kind]))
        for name, size in result["sizes"].items():
            assert (size["blocks"], size["offline_lru"]) == (before["sizes"][name]["blocks"],
                                                            before["sizes"][name]["offline_lru"])  # the same trace
            values = {"ours": size["mpcache_adaptive"]["hit_ratio"], "lru": size["offline_lru"]["hit_ratio"],
                      "before": before["sizes"][name]["mpcache_adaptive"]["hit_ratio"],
                      "server": server["sizes"][name]["lmcache_server"]["hit_ratio"],
                      "gain": result["mpcache_adaptive_over_offline_lru"][name]}
            rows.append(([f"{kind} ({result['requests']:,})", name, f"{size['blocks']:,}", f"{values['lru']:.4f}",
                          f"{values['ours']:.4f}", f"{values['before']:.4f}", f"{values['server']:.4f}",
                          str(values["gain"])], values))
    return rows


def test_performance_md_frequency_gate_table_and_prose_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the runs with the frequency gate reads what docs/PERFORMANCE.json keeps of
    them beside the runs before the gate and LMCache's server; its paragraph states the `rag` small gain, the
    points below the offline LRU and the engine-path cost, computed from them."""
    rows = _gate_rows()
    assert sorted(cells for cells, _ in rows) == sorted(_table_rows(GATE_HEADER))
    values = {(cells[0].split()[0], cells[1]): value for cells, value in rows}
    rag = values[("rag", "small")]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"`rag` small {rag['ours']:.4f} against {rag['before']:.4f} before the gate, {rag['gain']}× the offline "
            f"LRU's prefill") in prose
    below = max(value["lru"] - value["ours"] for _, value in rows)
    assert (f"below the offline LRU by at most {below:.4f}" if below > 0 else "never below the offline LRU") in prose
    requests = raw_results()["frequency_gate"]["trace"]["rag"]["requests"]  # trace_gen's rag, seed 1
    documents = Counter(request.hashes[2] for request in trace_gen.rag(requests, seed=1)).most_common(2)
    assert ("the gate keeps the one asked for by {} % of the requests from the one asked for by {} %".format(
        *(round(100 * count / requests) for _, count in documents))) in prose
    above = sum(value["ours"] > value["server"] for _, value in rows)
    assert f"above LMCache's server at {above} of the {len(rows)} points" in prose
    run = raw_results()["frequency_gate"]["isolation"]["tp1"][0]
    ours, theirs = _instructions(run)
    assert (f"`adaptive` {ours:,} against `lru` {theirs:,} instructions per request net of idle "
            f"({run['requests']} requests), **{run['instructions_over_first']['mpcache_adaptive']}×**") in prose
    assert run["instructions_over_first"]["mpcache_adaptive"] <= 1.05


def test_performance_md_states_lmcache_s_server_spread_against_adaptive_from_the_raw_output():
    """The five runs of LMCache's server at `conversations` small that docs/PERFORMANCE.md cites: their range,
    their median (the column's value) and how many `adaptive`'s hit ratio is above, from docs/PERFORMANCE.json."""
    small = raw_results()["frequency_gate"]["lmcache_server_repeated"]["sizes"]["small"]
    runs = [run["hit_ratio"] for run in small["lmcache_server"]["runs"]]
    ours, median = small["mpcache_adaptive"]["hit_ratio"], small["lmcache_server"]["hit_ratio"]
    assert 5 == len(runs) and median == sorted(runs)[2] and min(runs) <= ours <= max(runs)
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"LMCache's own server reads {min(runs):.4f}–{max(runs):.4f} over five runs (median {median:.4f}; "
            "`python -m benchmarks trace conversations.jsonl --json --repetitions 5`") in prose
    assert (f"against `adaptive`'s {ours:.4f}: within the server's spread, above {sum(ours > r for r in runs)} of "
            "its 5 runs") in prose


JOIN_HEADER = ("| trace (requests) | L1 | blocks | offline_lru | lru_tail_first_simulated | arc_simulated | "
               "mpcache_arc | mpcache_adaptive |")
JOIN_SECTION = "### `trace`, 2026-12-04, late night (`adaptive` undoes a split that does not pay)"
JOIN_SOONER_SECTION = "### `trace`, 2026-12-05 (`adaptive` undoes a split sooner)"
JOIN_FROM_PEAK_SECTION = "### `trace`, 2026-12-05, later (`adaptive` joins from its highest lead)"
JOIN_COLUMNS = ("offline_lru", "lru_tail_first_simulated", "arc_simulated", "mpcache_arc", "mpcache_adaptive")


def _moved(runs: dict[str, Any], before: dict[str, Any], columns: tuple[str, ...]) -> set[tuple[str, str, str]]:
    """The (trace, size, column) points of ``runs`` whose hit ratio differs from ``before``'s (traces in both)."""
    return {(kind, name, column) for kind, result in runs.items() if kind in before
            for name, size in result["sizes"].items() for column in columns
            if size[column]["hit_ratio"] != before[kind]["sizes"][name][column]["hit_ratio"]}


def _table_is_the_raw_output(runs: dict[str, Any], section: str) -> None:
    """The table under ``section`` (``JOIN_HEADER``'s columns) reads what ``runs`` keeps."""
    expected = [[f"{kind} ({result['requests']:,})", name, f"{size['blocks']:,}"]
                + [f"{size[column]['hit_ratio']:.4f}" for column in JOIN_COLUMNS]
                for kind, result in runs.items() for name, size in result["sizes"].items()]
    assert sorted(expected) == sorted(_table_rows(JOIN_HEADER, section))


def test_performance_md_join_table_and_isolation_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the runs where ``adaptive`` undoes its split reads what docs/PERFORMANCE.json
    keeps of them (``shadow_join``), and the engine-path counts its paragraph states are those runs'."""
    raw = raw_results()["shadow_join"]
    _table_is_the_raw_output(raw["trace"], JOIN_SECTION)
    large = raw["trace"]["agentic"]["sizes"]["large"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"`adaptive` at `agentic` large reads {large['mpcache_adaptive']['hit_ratio']:.4f} against the offline "
            f"LRU's {large['offline_lru']['hit_ratio']:.4f}") in prose
    stated = ("`adaptive` {ours:,} against `lru` {theirs:,} instructions per request net of idle ({requests} "
              "requests), **{ratio}×**", "{ours:,} against {theirs:,}, {ratio}× ({requests} requests)",
              "{ours:,} against {theirs:,}, {ratio}×", "{ours:,} against {theirs:,}, {ratio}× ({requests} requests)")
    keys = ("isolation", "isolation_before", "isolation_first_variant_python_fallbacks", "isolation_sketch_count")
    for key, sentence in zip(keys, stated):
        run = raw[key]["tp1"][0]
        ours, theirs = _instructions(run)
        assert sentence.format(ours=ours, theirs=theirs, requests=run["requests"],
                               ratio=run["instructions_over_first"]["mpcache_adaptive"]) in prose


SKETCH_HEADER = "| the frequency sketch | `adaptive` | `lru` | requests | `adaptive` × `lru` |"


def test_performance_md_compiled_sketch_table_and_counts_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of engine-path counts with the compiled and the Python frequency sketch reads
    the isolation runs docs/PERFORMANCE.json keeps (``sketch_compiled``), in the order they ran, and its in-process
    counts are the ones kept there."""
    raw = raw_results()["sketch_compiled"]
    names = {"isolation": "compiled (`_sketch.c`)", "isolation_python_sketch": "Python (`FrequencySketchReference`)",
             "isolation_again": "compiled, again"}
    expected = []
    for key, name in names.items():
        run = raw[key]["tp1"][0]
        ours, theirs = _instructions(run)
        ratio = run["instructions_over_first"]["mpcache_adaptive"]
        expected.append([name, f"{ours:,}", f"{theirs:,}", str(run["requests"]),
                         f"**{ratio}×**" if ratio <= 1.05 else f"{ratio}×"])
    assert expected == _table_rows(SKETCH_HEADER)
    counts = raw["l1_in_process"]["instructions_per_request"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"`adaptive` takes {counts['adaptive_compiled_sketch']:,} instructions a request with the compiled "
            f"sketch and {counts['adaptive_python_sketch']:,} with the Python one, against `lru`'s "
            f"{counts['lru']:,}") in prose


def test_performance_md_join_sooner_table_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the runs where ``adaptive`` undoes a split sooner reads what
    docs/PERFORMANCE.json keeps of them (``join_sooner``), and its prose states those runs' large points beside the
    runs before (``shadow_join``)."""
    raw = raw_results()
    runs, before = raw["join_sooner"]["trace"], raw["shadow_join"]["trace"]
    _table_is_the_raw_output(runs, JOIN_SOONER_SECTION)
    moved = _moved(runs, before, JOIN_COLUMNS)
    assert {("agentic", "large", "mpcache_adaptive"), ("multitenant", "large", "mpcache_adaptive")} == moved
    prose = flattened(doc("PERFORMANCE.md"))
    assert "no other point moves" in prose
    large, large_before = runs["agentic"]["sizes"]["large"], before["agentic"]["sizes"]["large"]
    tenants, tenants_before = runs["multitenant"]["sizes"]["large"], before["multitenant"]["sizes"]["large"]
    assert (f"`adaptive` at `agentic` large reads {large['mpcache_adaptive']['hit_ratio']:.4f}, above the offline "
            f"LRU's {large['offline_lru']['hit_ratio']:.4f} ({large_before['mpcache_adaptive']['hit_ratio']:.4f} in "
            f"that section), and at `multitenant` large {tenants['mpcache_adaptive']['hit_ratio']:.4f} "
            f"({tenants_before['mpcache_adaptive']['hit_ratio']:.4f})") in prose


def test_performance_md_join_from_peak_table_is_the_benchmark_s_raw_output_and_l1_s_replay():
    """docs/PERFORMANCE.md's table of the runs where ``adaptive`` joins from its highest lead reads what
    docs/PERFORMANCE.json keeps of them (``join_from_peak``), only ``agentic``'s large point moved from the runs
    before (``join_sooner``), and its prose states them and the in-process run of the order before that it keeps."""
    raw = raw_results()
    kept = raw["join_from_peak"]
    runs, before = kept["trace"], raw["join_sooner"]["trace"]
    _table_is_the_raw_output(runs, JOIN_FROM_PEAK_SECTION)
    assert {("agentic", "large", "mpcache_adaptive")} == _moved(runs, before, JOIN_COLUMNS)
    prose = flattened(doc("PERFORMANCE.md"))
    middle = runs["conversations"]["sizes"]["middle"]
    [in_process_before] = [row["l1_adaptive"] for row in kept["policy_matrix_conversations_seed14"]["before"]
                           if row["size"] == "middle"]
    [in_process_after] = [row["l1_adaptive"] for row in kept["policy_matrix_conversations_seed14"]["after"]
                          if row["size"] == "middle"]
    assert round(in_process_after, 4) == middle["mpcache_adaptive"]["hit_ratio"]
    gap = middle["offline_lru"]["hit_ratio"] - middle["mpcache_adaptive"]["hit_ratio"]
    assert (f"`conversations` middle reads {middle['mpcache_adaptive']['hit_ratio']:.4f}, {gap:.4f} below the "
            f"offline LRU, where the order before read {in_process_before:.4f}") in prose
    large, large_before = runs["agentic"]["sizes"]["large"], before["agentic"]["sizes"]["large"]
    assert (f"`agentic` large reads {large['mpcache_adaptive']['hit_ratio']:.4f} "
            f"({large_before['mpcache_adaptive']['hit_ratio']:.4f} in the section below); no other point of the two "
            "6,000-request traces moves") in prose


CHANCE_SECTION = "### `trace`, 2026-12-05, 18:10–18:12 UTC (`adaptive` admits by chance where it pays)"


def test_performance_md_admission_by_chance_table_is_the_benchmark_s_raw_output_and_l1_s_replay():
    """docs/PERFORMANCE.md's table of the runs with admission by chance reads what docs/PERFORMANCE.json keeps of
    them (``admission_by_chance``), and of ``adaptive``'s points only the one its prose names moved from the runs
    before (``join_from_peak``)."""
    raw = raw_results()
    runs, before = raw["admission_by_chance"]["trace"], raw["join_from_peak"]["trace"]
    _table_is_the_raw_output(runs, CHANCE_SECTION)
    moved = {point for point in _moved(runs, before, JOIN_COLUMNS) if point[2] == "mpcache_adaptive"}
    assert moved == {("conversations", "large", "mpcache_adaptive")}
    large, large_before = runs["conversations"]["sizes"]["large"], before["conversations"]["sizes"]["large"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"only `conversations` large moves, from {large_before['mpcache_adaptive']['hit_ratio']:.4f} to "
            f"{large['mpcache_adaptive']['hit_ratio']:.4f}") in prose


FREQUENCY_SECTION = "### `trace`, 2026-12-05, 21:16–21:18 UTC (first-sight stores judged by the frequency gate)"


def test_performance_md_first_sight_frequency_table_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the runs with first-sight stores judged by the frequency gate reads what
    docs/PERFORMANCE.json keeps of them (``first_sight_frequency``), and its prose names every ``adaptive`` point that
    moved from the runs before (``admission_by_chance``), and only those."""
    raw = raw_results()
    runs, before = raw["first_sight_frequency"]["trace"], raw["admission_by_chance"]["trace"]
    _table_is_the_raw_output(runs, FREQUENCY_SECTION)
    _moved_points_are_named(runs, before)


GATE_ROOM_SECTION = ("### `trace`, 2026-12-06, 00:25–00:28 UTC (the frequency gate's decisions bounded to the room a "
                     "store needs)")


def test_performance_md_gate_room_table_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the runs with the frequency gate's decisions bounded to the room a store needs
    reads what docs/PERFORMANCE.json keeps of them (``gate_room``), and its prose names every ``adaptive`` point that
    moved from the runs before (``first_sight_frequency``), and only those."""
    raw = raw_results()
    runs, before = raw["gate_room"]["trace"], raw["first_sight_frequency"]["trace"]
    _table_is_the_raw_output(runs, GATE_ROOM_SECTION)
    _moved_points_are_named(runs, before)


LARGE_STORES_SECTION = ("### `trace`, 2026-12-06, 05:54–06:00 UTC (large stores refused while they return less "
                        "often)")


@pytest.mark.usefixtures("join_at_3_sigmas")
def test_performance_md_large_stores_table_is_the_benchmark_s_raw_output_and_l1_s_replay():
    """docs/PERFORMANCE.md's table of the runs with large stores refused while they return less often reads what
    docs/PERFORMANCE.json keeps of them (``large_stores``), every ``mpcache_adaptive`` equals L1 replayed in process
    on the same trace, and its prose names every ``adaptive`` point that moved from the runs before (``gate_room``),
    and only those."""
    raw = raw_results()
    runs, before = raw["large_stores"]["trace"], raw["gate_room"]["trace"]
    _table_is_the_raw_output(runs, LARGE_STORES_SECTION)
    for kind, seed in (("agentic", 8), ("multitenant", 1), ("conversations", 14)):
        requests = getattr(trace_gen, kind)(runs[kind]["requests"], seed=seed)
        for size in runs[kind]["sizes"].values():
            replayed = outcome(requests, l1_found(requests, size["blocks"], "adaptive")).tokens_saved
            assert size["mpcache_adaptive"]["tokens_saved"] == replayed
    _moved_points_are_named(runs, before)


def _moved_points_are_named(runs: dict[str, Any], before: dict[str, Any]) -> None:
    """docs/PERFORMANCE.md names every ``mpcache_adaptive`` point of ``runs`` that moved from ``before``, in order."""
    moved = sorted(point[:2] for point in _moved(runs, before, JOIN_COLUMNS) if point[2] == "mpcache_adaptive")
    prose = flattened(doc("PERFORMANCE.md"))
    named = "; ".join(f"`{kind}` {name} {before[kind]['sizes'][name]['mpcache_adaptive']['hit_ratio']:.4f} → "
                      f"{runs[kind]['sizes'][name]['mpcache_adaptive']['hit_ratio']:.4f}"
                      for kind in runs for name in runs[kind]["sizes"] if (kind, name) in moved)
    points = "1 point moves" if len(moved) == 1 else f"{len(moved)} points move"
    assert f"Of `mpcache_adaptive`, {points}: {named}; L1 replayed" in prose


def test_performance_md_later_isolation_runs_are_the_benchmark_s_raw_output():
    """The ratios docs/PERFORMANCE.md states for the later isolation runs of the compiled sketch are the runs
    docs/PERFORMANCE.json keeps (``sketch_compiled.isolation_later``), in order, and so are the counts of the one
    over target."""
    runs = [run["tp1"][0] for run in raw_results()["sketch_compiled"]["isolation_later"]]
    ratios = [f"{run['instructions_over_first']['mpcache_adaptive']}×" for run in runs]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"read {ratios[0]} (5dac5d5, 02:00 UTC, beside other benchmarks: {runs[0]['requests']} requests), then, "
            f"on 8c6ebfa") in prose
    assert f"{ratios[1]}, {ratios[2]} and {ratios[3]} (02:34–02:41 UTC)" in prose
    [over] = [run for run in runs if run["instructions_over_first"]["mpcache_adaptive"] > 1.05]
    ours, theirs = _instructions(over)
    assert (f"In the {ratios[1]} run `adaptive` counted {ours:,} instructions a request against `lru`'s "
            f"{theirs:,}") in prose
    raw = raw_results()["sketch_compiled"]
    compiled = runs + [raw[key]["tp1"][0] for key in ("isolation", "isolation_again")]
    met = sum(run["instructions_over_first"]["mpcache_adaptive"] <= 1.05 for run in compiled)
    assert f"met in {met} of the {len(compiled)} compiled runs, not in that one" in prose


COLLECTOR_SECTION = "### `isolation`, 2026-12-05, morning (the cache process's collector)"
COLLECTOR_HEADER = ("| code | `adaptive` | `lru` | requests | collections | collector's instructions a request | "
                    "`adaptive` × `lru` | outside the collector |")


def test_performance_md_collector_table_and_verdicts_are_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's table of the engine-path counts with start-up frozen and verdicts untracked, and before
    (53b61bb), reads the isolation runs docs/PERFORMANCE.json keeps (``collector_frozen``), this code's first; the
    prose's verdicts, ranges and collector counts are theirs, and the verdicts it names are kept for as many named
    stores as the order keeps."""
    raw = raw_results()["collector_frozen"]
    runs = {"start-up frozen, verdicts untracked": [run["tp1"][0] for run in raw["after"]],
            "53b61bb": [run["tp1"][0] for run in raw["before"]]}
    expected = []
    for name, measured in runs.items():
        for run in measured:
            ours, theirs = _instructions(run)
            collector = run["collector"]
            expected.append([name, f"{ours:,}", f"{theirs:,}", str(run["requests"]),
                             f"{collector['mpcache_adaptive']['collections']} / "
                             f"{collector['mpcache_lru']['collections']}",
                             f"{round(collector['mpcache_adaptive']['instructions_per_request']):,} / "
                             f"{round(collector['mpcache_lru']['instructions_per_request']):,}",
                             f"{run['instructions_over_first']['mpcache_adaptive']}×",
                             f"{run['instructions_over_first_outside_collector']['mpcache_adaptive']}×"])
    assert expected == _table_rows(COLLECTOR_HEADER, COLLECTOR_SECTION)
    after, before = runs["start-up frozen, verdicts untracked"], runs["53b61bb"]
    ratios = [run["instructions_over_first"]["mpcache_adaptive"] for run in after]
    outside = {name: [run["instructions_over_first_outside_collector"]["mpcache_adaptive"] for run in measured]
               for name, measured in runs.items()}
    over = [run for run in before if run["instructions_over_first"]["mpcache_adaptive"] > 1.05]
    prose = flattened(doc("PERFORMANCE.md"))
    assert max(ratios) <= 1.05 and len(over) == 2
    assert f"met in all three runs of this code, {min(ratios)}–{max(ratios)}×" in prose
    assert (f"two of three runs were over it, {over[0]['instructions_over_first']['mpcache_adaptive']}× and "
            f"{over[1]['instructions_over_first']['mpcache_adaptive']}×") in prose
    assert (f"executed {round(over[0]['collector']['mpcache_adaptive']['instructions_per_request']):,} and "
            f"{round(over[1]['collector']['mpcache_adaptive']['instructions_per_request']):,} instructions a request "
            f"in `adaptive`'s window against "
            f"{round(over[0]['collector']['mpcache_lru']['instructions_per_request']):,} and "
            f"{round(over[1]['collector']['mpcache_lru']['instructions_per_request']):,} in `lru`'s") in prose
    now, then = outside["start-up frozen, verdicts untracked"], outside["53b61bb"]
    assert f"({min(now)}–{max(now)}× now, {min(then)}–{max(then)}× before)" in prose
    assert f"What remains between runs of this code, {round(max(ratios) - min(ratios), 4)}," in prose
    assert f"kept for the newest {STORE_VERDICTS:,} stores" in prose


def test_performance_md_public_production_trace_section_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's section on the public production trace is ``trace.render`` of the run
    docs/PERFORMANCE.json keeps, and the numbers its prose and *What is missed* state are computed from the three
    runs kept (LMCache's server's runs from all; ``adaptive`` before admission by chance from the one before; the
    service's ``arc`` equal to the offline ARC in the last)."""
    from benchmarks.trace import render

    raw = raw_results()["trace_public_conversation"]
    final, before, first = raw["final"], raw["before_chance"], raw["arc_before_ghost_bounds"]
    text = doc("PERFORMANCE.md")
    assert render(final) in text
    prose = flattened(text)
    ours, belady = final["mpcache_adaptive_over_offline_lru"], final["belady_over_offline_lru"]["small"]
    earlier = before["mpcache_adaptive_over_offline_lru"]
    assert f"{ours['small']}× / {ours['middle']}× / {ours['large']}× its prefill" in prose
    assert f"{earlier['small']}× / {earlier['middle']}× / {earlier['large']}× before it admitted by chance" in prose
    assert f"Belady's MIN {belady}× at the small size" in prose
    runs = [run["hit_ratio"] for result in (first, before, final)
            for run in result["sizes"]["small"]["lmcache_server"]["runs"]]
    found = final["sizes"]["small"]["mpcache_adaptive"]["hit_ratio"]
    above = sum(found > run for run in runs)
    assert (f"read {min(runs):.4f}–{max(runs):.4f} over the {len(runs)} runs of the three benchmark runs; "
            f"`adaptive`'s {found:.4f} is above {above} of them") in prose
    assert all(size["mpcache_arc"] == size["arc_simulated"] for size in final["sizes"].values())
    arc_first = " / ".join(f"{first['sizes'][name]['mpcache_arc']['hit_ratio']:.4f}"
                           for name in ("small", "middle", "large"))
    assert f"({arc_first} before it kept ARC's ghost bounds)" in prose


def _rendered(run: dict) -> str:
    """docs/PERFORMANCE.md, which holds ``trace.render`` of the kept ``run``: its prose, flattened."""
    from benchmarks.trace import render

    text = doc("PERFORMANCE.md")
    assert render(run) in text
    return flattened(text)


def _server_runs(run: dict) -> dict[str, list[float]]:
    """LMCache's server's hit ratio in each of its runs, by L1 size, in a kept ``trace`` run."""
    return {name: [entry["hit_ratio"] for entry in size["lmcache_server"]["runs"]]
            for name, size in run["sizes"].items()}


def _public_trace_section(name: str, before_name: str, where: str) -> tuple[dict, dict, str, list[float], float]:
    """The public production trace's run ``name`` that docs/PERFORMANCE.json keeps: ``trace.render`` of it is in
    docs/PERFORMANCE.md, whose prose states its ratios beside those of run ``before_name`` (``where``).  Returns the
    two runs, the prose, LMCache's server's runs at the small size and ``adaptive``'s hit ratio there."""
    raw = raw_results()["trace_public_conversation"]
    run, before = raw[name], raw[before_name]
    prose = _rendered(run)
    ours, earlier = run["mpcache_adaptive_over_offline_lru"], before["mpcache_adaptive_over_offline_lru"]
    assert (f"{ours['small']}× / {ours['middle']}× / {ours['large']}× its prefill at the small / middle / large size "
            f"({earlier['small']}× / {earlier['middle']}× / {earlier['large']}× {where}") in prose
    return run, before, prose, _server_runs(run)["small"], run["sizes"]["small"]["mpcache_adaptive"]["hit_ratio"]


def _ratios(values: list[float]) -> str:
    return " / ".join(f"{value}×" for value in values)


def test_performance_md_public_production_trace_with_the_frequency_gate_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's section on the public production trace with the frequency gate is ``trace.render`` of
    the run docs/PERFORMANCE.json keeps (``frequency``), and its prose states that run's ratios, the one before's,
    LMCache's server's runs and the in-process replays it keeps beside them."""
    run, _, prose, runs, found = _public_trace_section("frequency", "final", "in the section below)")
    above = sum(found > entry for entry in runs)
    assert (f"read {min(runs):.4f}–{max(runs):.4f} over its {len(runs)} runs; `adaptive`'s {found:.4f} is above "
            f"{above} of them") in prose
    later, whole = run["in_process"]["requests_4001_12031"], run["in_process"]["whole_trace"]
    assert (f"never looked at for this change, read {_ratios(later['after'])} ({_ratios(later['before'])} before), "
            f"and the whole trace {_ratios(whole['after'])} ({_ratios(whole['before'])} before)") in prose


def test_performance_md_public_production_trace_with_the_gate_bounded_to_room_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's latest section on the public production trace is ``trace.render`` of the run
    docs/PERFORMANCE.json keeps (``gate_room``), and its prose and *What is missed* state that run's ratios, the
    frequency gate's run's, LMCache's server's runs and the in-process replays kept beside them."""
    where = "in the section of 2026-12-05, 20:43–20:57 UTC"
    run, before, prose, runs, found = _public_trace_section("gate_room", "frequency", where)
    assert "### `trace` on a public production trace, 2026-12-05, 20:43–20:57 UTC" in doc("PERFORMANCE.md")
    ours = run["mpcache_adaptive_over_offline_lru"]
    assert f"saves {ours['small']}× the offline LRU's prefill at the small size" in prose
    assert f"(Belady's MIN: {run['belady_over_offline_lru']['small']}×)" in prose
    earlier_runs = [entry["hit_ratio"] for name, kept in raw_results()["trace_public_conversation"].items()
                    if name != "gate_room" for entry in kept["sizes"]["small"]["lmcache_server"]["runs"]]
    assert max(runs) < min(earlier_runs) and (f"read {min(runs):.4f}–{max(runs):.4f} over its {len(runs)} runs, below "
                                              f"its runs of the earlier sections") in prose
    above = sum(found > entry for entry in runs)
    assert f"`adaptive`'s {found:.4f} is above {above} of them" in prose
    assert f"Above LMCache's server in {above} of its {len(runs)} runs there" in prose
    later, whole = run["in_process"]["requests_4001_12031"], run["in_process"]["whole_trace"]
    assert (f"never looked at for this change, read {_ratios(later['after'])} ({_ratios(later['before'])} at "
            f"5ec2b58, the order before the change), and the whole trace {_ratios(whole['after'])} "
            f"({_ratios(whole['before'])})") in prose
    gate_before = before["in_process"]["whole_trace"]["before"][1]
    assert (f"never looked at for this, read {later['after'][0]}× in process; the whole trace {whole['after'][0]}×, "
            f"but {whole['after'][1]}× at the middle size ({gate_before}× before the frequency gate") in prose
    assert ours["large"] >= 0.995 and f"at the large size ({ours['large']}×)" in prose


def test_performance_md_held_out_production_trace_section_is_the_benchmark_s_raw_output():
    """docs/PERFORMANCE.md's section on the second, held-out production trace is ``trace.render`` of the run
    docs/PERFORMANCE.json keeps (``trace_public_arxiv_slice``), and what its prose and *What is missed* say of it (the
    source, the ratios, LMCache's server's runs against ``adaptive`` at each size, the in-process rows and phases) is
    computed from that run and its repeat (``adaptive`` finding the same in both); the in-process rows are the
    service's own finds for its three policies."""
    kept = raw_results()["trace_public_arxiv_slice"]
    run, rows, phases = kept["trace"], {row["size"]: row for row in kept["policy_matrix"]}, kept["adaptive_phases"]
    prose = _rendered(run)
    source, measured = kept["source"], kept["measured"]
    assert run["requests"] == source["requests"] == 1000
    assert (f"### `trace` on a second public production trace, held out, {measured['date']}, {measured['trace']}"
            in doc("PERFORMANCE.md"))
    runs = _server_runs(run)
    assert (f"`python -m benchmarks trace mooncake_arxiv_slice.jsonl --json --repetitions {len(runs['large'])}` on a "
            "production trace") in prose and f"--repetitions {len(runs['large'])}" in kept["command"]
    assert (f"1,000 requests in Mooncake's format, the `{source['path']}` of a public fork of NVIDIA Dynamo "
            f"({source['repository']}, commit {source['commit'][:8]}; {source['bytes']:,} bytes, sha256 "
            f"{source['sha256'][:8]}…), by its name, ids and timestamps ({source['first_timestamp_ms']:,}–"
            f"{source['last_timestamp_ms']:,} ms)") in prose
    assert f"It is a quarter of the issue's {4 * source['requests']:,}-request replay" in prose
    ours, sizes = run["mpcache_adaptive_over_offline_lru"], run["sizes"]
    assert (f"`adaptive` over the offline LRU: {ours['small']}× / {ours['middle']}× / {ours['large']}× its prefill at "
            f"the small / middle / large size") in prose
    assert ours["small"] >= 1.2 and f"≥ 1.2×; Belady's MIN {run['belady_over_offline_lru']['small']}×" in prose
    found = {name: size["mpcache_adaptive"]["hit_ratio"] for name, size in sizes.items()}
    assert {runs["small"][0]} == set(runs["small"]) and all(
        found[name] > entry for name in ("small", "middle") for entry in runs[name])
    assert (f"LMCache's server read {runs['small'][0]:.4f} in each of its {len(runs['small'])} runs at the small size "
            f"and {min(runs['middle']):.4f}–{max(runs['middle']):.4f} at the middle one, below `adaptive` in all of "
            "them") in prose
    large, above = runs["large"], [entry for entry in runs["large"] if entry > found["large"]]
    assert (f"At the large size it read {min(large):.4f}–{max(large):.4f}, above `adaptive`'s {found['large']:.4f} in "
            f"{len(above)} of its {len(large)} runs, by up to {max(large) - found['large']:.4f}") in prose
    repeat = kept["trace_repeat"]
    again = _server_runs(repeat)
    assert all(size["mpcache_adaptive"] == sizes[name]["mpcache_adaptive"] for name, size in repeat["sizes"].items())
    assert all(entry < found["middle"] for entry in again["middle"])
    assert (f"the same command again ({measured['trace_repeat']}, `trace_repeat`: `adaptive` found the same at every "
            f"size) read {min(again['large']):.4f}–{max(again['large']):.4f} there, above it in "
            f"{sum(entry > found['large'] for entry in again['large'])} of {len(again['large'])} again, and "
            f"{min(again['middle']):.4f}–{max(again['middle']):.4f} at the middle size, below it") in prose
    both = large + again["large"]
    assert all(entry > found["large"] for entry in both)
    assert (f"({found['large']:.4f}) and LMCache's server read {min(both):.4f}–{max(both):.4f}: `adaptive` is below "
            f"the server in all {len(both)} of its runs over two benchmark runs, by up to "
            f"{max(both) - found['large']:.4f}.") in prose
    assert (f"{ours['small']}× at the small size and {ours['middle']}× at the middle one, but at the large size "
            "`adaptive` finds what the offline LRU finds") in prose
    assert sizes["large"]["mpcache_adaptive"] == sizes["large"]["offline_lru"]
    big = rows["large"]
    assert min(big["lmcache_sim"], big["wtinylfu"]) > big["lru"] == big["l1_adaptive"]
    assert (f"the simulated server (`lmcache_sim`, an LRU that drops a store it has no room for, the best of its "
            f"{NUMBER_WORDS[len(LMCACHE_PERIODS)]} trim periods) {big['lmcache_sim']:.4f} and W-TinyLFU "
            f"{big['wtinylfu']:.4f}; `adaptive` enters ARC's phase in the "
            f"{phases['large']['arc_phase_from_request']}th request of the 1,000 and does not admit by chance within "
            "them") in prose
    assert all(phase["admits_by_chance_from_request"] is None for phase in phases.values())
    middle = rows["middle"]
    assert middle["flags_adaptive"] == ["lmcache_sim"] and (
        f"At the middle size the simulated server reads {middle['lmcache_sim']:.4f} against `adaptive`'s "
        f"{middle['l1_adaptive']:.4f} in process (flagged: below it)") in prose
    assert all(row["wtinylfu"] > row["l1_adaptive"] for row in rows.values()) and (
        "W-TinyLFU is above `adaptive` at every size (" + " / ".join(
            f"{rows[name]['wtinylfu']:.4f}" for name in ("small", "middle", "large")) + ")") in prose
    for name, row in rows.items():
        assert (round(row["l1_adaptive"], 4), round(row["l1_lru"], 4), round(row["l1_arc"], 4)) == tuple(
            sizes[name][policy]["hit_ratio"] for policy in ("mpcache_adaptive", "mpcache_lru", "mpcache_arc"))


def test_mrc_md_public_production_trace_errors_are_the_benchmark_s_raw_output():
    """The curves' errors docs/MRC.md states for the public production trace are those docs/PERFORMANCE.json keeps
    from ``benchmarks.mrc_accuracy`` (each within issue 39's 0.01), and the ``adaptive`` curve's of the run before."""
    [result] = raw_results()["mrc_accuracy_public_conversation"]["traces"].values()
    lru, adaptive = (result[policy]["32768 keys, rate 0.01"] for policy in ("lru", "adaptive"))
    prose = flattened(doc("MRC.md"))
    assert (f"LRU curve {lru['mae']:.4f}, `adaptive` curve {adaptive['mae']:.4f} (largest point of ½×–2× "
            f"{lru['max_half_to_double']:.4f} and {adaptive['max_half_to_double']:.4f})") in prose
    assert max(lru["mae"], adaptive["mae"]) <= 0.01
    before = result["adaptive_frequency_gate"]["32768 keys, rate 0.01"]
    assert (f"({before['mae']:.4f} and {before['max_half_to_double']:.4f} before, `adaptive_frequency_gate`)"
            in prose)


def _gap(row: dict) -> float:
    """How far L1 under ``adaptive`` is below the better of the offline LRU and ARC on a policy-matrix row."""
    return max(row["lru"], row["arc"]) - row["l1_adaptive"]


def _judged_matrix(key: str, seeds: range) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """The rows PERFORMANCE.json keeps under ``key`` (every seed of ``seeds``, 7 traces by 3 sizes each), judged here
    per length (4,000 and 1,500 requests): those more than 0.005 below the offline LRU or ARC (issue 39's bar), and
    those below the simulated server, each with its seed."""
    kept = raw_results()[key]["seeds"]
    assert sorted(kept, key=int) == [str(seed) for seed in seeds]
    rows = [dict(row, seed=int(seed)) for seed, seed_rows in kept.items() for row in seed_rows]
    below, under_sim = {}, {}
    for requests in (4000, 1500):
        span = [row for row in rows if row["requests"] == requests]
        assert len(span) == len(seeds) * 7 * 3
        below[requests] = [row for row in span if _gap(row) > 0.005]
        under_sim[requests] = [row for row in span if row["l1_adaptive"] < row["lmcache_sim"]]
    return below, under_sim


@pytest.mark.usefixtures("join_at_3_sigmas")
def test_performance_md_policy_matrix_prose_is_the_16_seeds_raw_output_and_its_worst_row_replays():
    """*What is missed*'s ``policy_matrix`` numbers are counted from the 16 seeds' rows docs/PERFORMANCE.json keeps
    (``policy_matrix_adaptive``), each row judged here against issue 39's bar (0.005 below the offline LRU or ARC)
    and the simulated server, not by the flags the run wrote; the worst row of 4,000 requests replays (its trace
    regenerated from its seed, the offline LRU, ARC and L1 under ``adaptive`` find what the run kept), and seed 1's
    row replays with the phases the prose gives it."""
    below, under_sim = _judged_matrix("policy_matrix_adaptive", range(1, 17))
    prose = flattened(doc("PERFORMANCE.md"))
    whole, first = below[4000], below[1500]
    assert {(row["trace"], row["size"]) for row in whole} == {("conversations", "middle")}
    assert (f"{len(whole)} of the 336 rows of 4,000 requests, the length of the issue's production replay, are below "
            f"the offline LRU or ARC by more than 0.005, all `conversations` middle (up to "
            f"{max(map(_gap, whole)):.4f}).") in prose
    by_seed = {row["seed"]: row for row in whole}
    assert sorted(by_seed) == [1, 10, 13]
    assert {f"{by_seed[seed]['arc'] - by_seed[seed]['lru']:.3f}" for seed in (10, 13)} == {"0.009"}
    assert "On seeds 10 and 13 ARC is ahead of the LRU by 0.009" in prose
    phases: list[tuple[int, bool]] = []
    seed_1 = trace_gen.conversations(4000, 1)

    def follow(index: int, l1: Any) -> None:
        if not phases or phases[-1][1] != l1._order.recency:
            phases.append((index, l1._order.recency))

    assert outcome(seed_1, l1_found(seed_1, by_seed[1]["blocks"], "adaptive", after=follow)).hit_ratio == (
        pytest.approx(by_seed[1]["l1_adaptive"], abs=1e-12))
    assert phases == [(0, True), (1085, False)]  # ARC's lists from the 1,086th request, never joined
    assert (f"on seed 1 ARC's phase, from request 1,086 on, is never undone, and `adaptive` ends "
            f"{by_seed[1]['lru'] - by_seed[1]['l1_adaptive']:.4f} below the LRU itself") in prose
    kinds = Counter((row["trace"], row["size"]) for row in first)

    def worst(trace: str, size: str) -> str:
        return f"{max(_gap(row) for row in first if (row['trace'], row['size']) == (trace, size)):.4f}"

    assert (f"Over the first 1,500 requests {len(first)} of 336 are, {kinds['multitenant', 'large']} of them "
            f"`multitenant` large (up to {worst('multitenant', 'large')}:") in prose
    assert (f"and {kinds['conversations', 'middle']} `conversations` middle (up to {worst('conversations', 'middle')})"
            ) in prose
    sim_whole, sim_first = under_sim[4000], under_sim[1500]
    scan_small = sum(1 for row in sim_whole if (row["trace"], row["size"]) == ("scan", "small"))
    assert (f"{len(sim_whole)} rows of 4,000 requests, by up to "
            f"{max(row['lmcache_sim'] - row['l1_adaptive'] for row in sim_whole):.4f}, {scan_small} of them `scan` "
            f"small; {len(sim_first)} rows of 1,500, by up to "
            f"{max(row['lmcache_sim'] - row['l1_adaptive'] for row in sim_first):.4f}.") in prose
    row = max(whole, key=_gap)
    requests = trace_gen.KINDS[row["trace"]](4000, row["seed"])
    assert lru(requests, row["blocks"]).hit_ratio == pytest.approx(row["lru"], abs=1e-12)
    assert arc(requests, row["blocks"]).hit_ratio == pytest.approx(row["arc"], abs=1e-12)
    assert outcome(requests, l1_found(requests, row["blocks"], "adaptive")).hit_ratio == pytest.approx(
        row["l1_adaptive"], abs=1e-12)


@pytest.mark.usefixtures("join_at_3_sigmas")
def test_performance_md_states_the_unseen_seeds_rows_as_kept_and_their_worst_row_replays():
    """The rows of seeds 25–32 (``policy_matrix_adaptive_unseen``), judged here against issue 39's bar and the
    simulated server as *What is missed* states them; the worst row of 4,000 requests below the simulated server
    replays (its trace regenerated from its seed, L1 under ``adaptive`` finds what the run kept)."""
    kept = raw_results()["policy_matrix_adaptive_unseen"]
    below, under_sim = _judged_matrix("policy_matrix_adaptive_unseen", range(25, 33))
    prose = flattened(doc("PERFORMANCE.md"))
    large = [row for row in below[1500] if (row["trace"], row["size"]) == ("multitenant", "large")]
    worst_large = max(map(_gap, large))
    sim_gaps = [max(row["lmcache_sim"] - row["l1_adaptive"] for row in under_sim[requests])
                for requests in (4000, 1500)]
    assert not below[4000]  # hence "none"
    assert (f"On seeds 25–32, which no change before this round's join was tuned or checked on (PERFORMANCE.json's "
            f"`policy_matrix_adaptive_unseen`, {kept['measured'][11:16]}–{kept['measured'][-9:-4]} UTC), "
            f"none of the 168 rows of 4,000 requests is below the offline LRU or ARC by more than 0.005, and "
            f"{len(below[1500])} of the 168 over the first 1,500 are ({len(large)} "
            f"`multitenant` large, up to {worst_large:.4f}); below the simulated server, {len(under_sim[4000])} and "
            f"{len(under_sim[1500])} (by up to {sim_gaps[0]:.4f} and {sim_gaps[1]:.4f}).") in prose
    row = max(under_sim[4000], key=lambda row: row["lmcache_sim"] - row["l1_adaptive"])
    requests = trace_gen.KINDS[row["trace"]](4000, row["seed"])
    assert outcome(requests, l1_found(requests, row["blocks"], "adaptive")).hit_ratio == pytest.approx(
        row["l1_adaptive"], abs=1e-12)


def _two_runs(runs: list[dict]) -> str:
    """How PERFORMANCE.md states two ``isolation`` runs: both ratios, then both sides' counts and requests."""
    (first, first_lru), (second, second_lru) = map(_instructions, runs)
    ratios = [run["instructions_over_first"]["mpcache_adaptive"] for run in runs]
    return (f"{ratios[0]}× and {ratios[1]}× ({first:,} and {second:,} against {first_lru:,} and {second_lru:,}; "
            f"{runs[0]['requests']} and {runs[1]['requests']} requests).")


def test_performance_md_states_the_engine_path_runs_as_kept():
    """The engine-path ratios and counts are the runs docs/PERFORMANCE.json keeps (``engine_path``): two with ARC's
    ghost lists compiled (c19a53a) and two after the review's mend (49a65f7), two of fb4d283 with 58053df's between
    them and two of 8c24924, and the in-process counts beside them (``l1_counted_ghosts_compiled``, ``l1_counted``,
    and ``l1_counted_arc_bounds_compiled``, fewer for ``arc`` in every case); the changelog's figures are theirs."""
    kept = raw_results()["engine_path"]
    ours, before = [run["tp1"][0] for run in kept["runs"]["fb4d283"]], kept["runs"]["58053df"]["tp1"][0]
    prose = flattened(doc("PERFORMANCE.md"))
    (first, first_lru), (second, second_lru) = map(_instructions, ours)
    before_adaptive, before_lru = _instructions(before)
    ratios = [run["instructions_over_first"]["mpcache_adaptive"] for run in ours]
    assert (f"{ratios[0]}× and {ratios[1]}× in two runs of fb4d283 (`adaptive` {first:,} and {second:,} instructions "
            f"a request against `lru`'s {first_lru:,} and {second_lru:,}; {ours[0]['requests']} and "
            f"{ours[1]['requests']} requests), {before['instructions_over_first']['mpcache_adaptive']}× for 58053df's "
            f"order run between them ({before_adaptive:,} against {before_lru:,}, {before['requests']} requests;"
            ) in prose
    assert max(ratios) > 1.05  # hence "at the target, not clearly under it"
    fewer = round(before_adaptive - (first + second) / 2, -3), round(before_lru - (first_lru + second_lru) / 2, -3)
    assert (f"`adaptive` counts about {fewer[0]:,.0f} fewer a request than 58053df's and `lru` about {fewer[1]:,.0f} "
            f"fewer. Those were at the target, not clearly under it:") in prose
    later = [run["tp1"][0] for run in kept["runs"]["8c24924"]]
    assert (f"Two runs of 8c24924 (the phase tests in a module of their own, no change in behaviour; 10:48–10:51 UTC) "
            f"read {_two_runs(later)}") in prose
    compiled = [run["tp1"][0] for run in kept["runs"]["c19a53a"]]
    (fifth, fifth_lru), (sixth, sixth_lru) = map(_instructions, compiled)
    met = [run["instructions_over_first"]["mpcache_adaptive"] for run in compiled]
    assert max(met) < 1.05  # hence "met since c19a53a"
    assert (f"met since c19a53a, which compiles ARC's ghost lists (`mpcache/eviction/_ghosts.c`, no change in "
            f"behaviour): {met[0]}× and {met[1]}× in two runs (`adaptive` {fifth:,} and {sixth:,} instructions a "
            f"request against `lru`'s {fifth_lru:,} and {sixth_lru:,}; {compiled[0]['requests']} and "
            f"{compiled[1]['requests']} requests; `{kept['command']}`") in prose
    mended = [run["tp1"][0] for run in kept["runs"]["49a65f7"]]
    assert max(run["instructions_over_first"]["mpcache_adaptive"] for run in mended) < 1.05
    assert (f"Two runs of 49a65f7 (the review's mend: the compiled lists refuse a change while a key is compared; "
            f"14:52–14:58 UTC) read {_two_runs(mended)}") in prose
    counted, now = raw_results()["l1_counted"], raw_results()["l1_counted_ghosts_compiled"]
    bounded = raw_results()["l1_counted_arc_bounds_compiled"]
    count, count_now, count_bounded = ({(row["workload"], row["objects"], row["policy"]):
                                        row["instructions_per_request"] for row in kept_counts["rows"]}
                                       for kept_counts in (counted, now, bounded))
    unique = {policy: (count["unique", 32, policy], count["unique", 2048, policy])
              for policy in ("adaptive", "lru", "arc")}
    unique_now = {policy: (count_now["unique", 32, policy], count_now["unique", 2048, policy])
                  for policy in ("adaptive", "lru", "arc")}
    over_lru = [round(count["shared", objects, "adaptive"] / count["shared", objects, "lru"], 4)
                for objects in (32, 2048)]
    over_lru_now = [round(count_now["shared", objects, "adaptive"] / count_now["shared", objects, "lru"], 4)
                    for objects in (32, 2048)]
    over_arc = sorted(100 * (count[workload, objects, "adaptive"] / count[workload, objects, "arc"] - 1)
                      for workload in ("unique", "shared") for objects in (32, 2048))
    under_arc_now = sorted(100 * (1 - count_now[workload, objects, "adaptive"] / count_now[workload, objects, "arc"])
                           for workload in ("unique", "shared") for objects in (32, 2048))
    assert (f"In process (`python -m benchmarks.l1_counted --json`, PERFORMANCE.json's `l1_counted_ghosts_compiled`: "
            f"L1 alone, the same {now['requests']:,} requests counted), `adaptive` takes {unique_now['adaptive'][0]:,} "
            f"instructions a request in an L1 of 32 objects and {unique_now['adaptive'][1]:,} in one of 2,048, where "
            f"no store is large, against `lru`'s {unique_now['lru'][0]:,} and {unique_now['lru'][1]:,} and `arc`'s "
            f"{unique_now['arc'][0]:,} and {unique_now['arc'][1]:,}; on 8c24924 (`l1_counted`) it took "
            f"{unique['adaptive'][0]:,} and {unique['adaptive'][1]:,}, `arc` {unique['arc'][0]:,} and "
            f"{unique['arc'][1]:,}. ARC's own lists are most of what `adaptive` adds to `lru`'s count; `adaptive` "
            f"counted {under_arc_now[0]:.1f}–{under_arc_now[-1]:.1f} % less than `arc`, whose ghosts ARC's bounds "
            f"trimmed in Python (in its recency phase, where these workloads keep it). With lookups that find a shared "
            f"prefix, {over_lru_now[0]}× and {over_lru_now[1]}× `lru`'s ({over_lru[0]}× and {over_lru[1]}× on "
            f"8c24924).") in prose
    cases = [(workload, objects) for workload in ("unique", "shared") for objects in (32, 2048)]
    over_arc_bounded = sorted(100 * (count_bounded[case + ("adaptive",)] / count_bounded[case + ("arc",)] - 1)
                              for case in cases)
    arc_bounded = [count_bounded[case + ("arc",)] for case in cases]
    assert all(count_bounded[case + ("arc",)] < count_now[case + ("arc",)] for case in cases)
    assert (f"Since {bounded['code'][:7]} the compiled lists trim `arc`'s ghosts too (`trim_as_arc`; no change in what "
            f"`arc` decides): `arc` counts {arc_bounded[0]:,} and {arc_bounded[1]:,} (PERFORMANCE.json's "
            f"`l1_counted_arc_bounds_compiled`, {bounded['measured'][11:16]}–{bounded['measured'][-9:-4]} UTC; "
            f"{arc_bounded[2]:,} and {arc_bounded[3]:,} with a shared prefix), and `adaptive` "
            f"{over_arc_bounded[0]:.1f}–{over_arc_bounded[-1]:.1f} % more than it.") in prose
    all_over_lru = sorted(counted["over_lru"][f"{workload}_{objects}_objects"]["adaptive"]
                          for workload in ("unique", "shared") for objects in (32, 2048))
    changelog = flattened(open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8").read())
    assert (f"It reads `adaptive` at {all_over_lru[0]:.2f}–{all_over_lru[-1]:.2f}× `lru` and "
            f"{over_arc[0]:.1f}–{over_arc[-1]:.1f} % above `arc`") in changelog
    all_over_lru_now = sorted(now["over_lru"][f"{workload}_{objects}_objects"]["adaptive"]
                              for workload in ("unique", "shared") for objects in (32, 2048))
    before_ghosts = [run["instructions_over_first"]["mpcache_adaptive"] for run in later]
    assert (f"`isolation` reads {met[0]}× and {met[1]}× `lru`'s instructions a request ({before_ghosts[0]}× and "
            f"{before_ghosts[1]}× before); "
            f"`python -m benchmarks.l1_counted` reads `adaptive` at {all_over_lru_now[0]:.2f}–"
            f"{all_over_lru_now[-1]:.2f}× `lru` (was {all_over_lru[0]:.2f}–{all_over_lru[-1]:.2f}×)") in changelog
    arc_fewer = sorted(count_now[case + ("arc",)] - count_bounded[case + ("arc",)] for case in cases)
    assert (f"it counts {round(arc_fewer[0], -2):,}–{round(arc_fewer[-1], -2):,} fewer instructions a request in "
            f"`l1_counted`, deciding the same.") in changelog
    assert counted["over_lru"]["unique_32_objects"]["adaptive"] == round(unique["adaptive"][0] / unique["lru"][0], 4)
    objects = round(kept["runs"]["fb4d283"][0]["l1_gb"] * 2**30) // (2 << 20)  # the workload's 2 MiB objects
    large_from = next(chunks for chunks in range(1, objects) if chunks > LARGE_STORE_SHARE * objects)
    average = sorted(run["stored_chunks_per_request"]["mpcache_adaptive"] for run in ours)
    assert (objects, large_from) == (32, 4) and all(large_from < chunks < large_from + 1 for chunks in average)
    assert (f"in this run's L1 of {objects} objects of 2 MiB a store of {large_from} new chunks is large (more than a "
            f"tenth of L1) and the stores average {average[0]}–{average[1]}") in prose


def test_performance_md_isolation_of_the_tail_marks_is_the_benchmark_s_raw_output():
    """PERFORMANCE.md's 2026-12-07 isolation paragraph: each count and ratio from PERFORMANCE.json's
    ``isolation_2026_12_07`` runs (and the table's run of 2026-12-02 it is compared with)."""
    from support.performance_docs import doc, flattened, raw_results

    runs = raw_results()["isolation_2026_12_07"]["runs"]
    marks, before = runs["with_the_marks"]["result"], runs["before_the_marks"]["result"]
    table = raw_results()["isolation"]
    policies = {tp: runs["policies"]["result"][tp][0] for tp in ("tp1", "tp2")}

    def on(run: dict, tp: str) -> str:
        return f"{run[tp]['per_request']['mpcache']['instructions']:,.0f}"

    def pair(run: dict) -> str:
        return f"{on(run, 'tp1')} and {on(run, 'tp2')}"

    def net(tp: str, policy: str) -> str:
        return f"{policies[tp]['net_per_request'][f'mpcache_{policy}']['instructions']:,.0f}"

    def ratios(run: dict) -> str:
        return f"{run['tp1']['on_over_off']['instructions']} and {run['tp2']['on_over_off']['instructions']}"

    def over(tp: str) -> float:
        return policies[tp]["instructions_over_first"]["mpcache_adaptive"]

    ours, theirs = marks["cache_instructions_over_lmcache"], before["cache_instructions_over_lmcache"]
    page = flattened(doc("PERFORMANCE.md"))
    assert (f"the publishing cache process executes {pair(marks)} instructions a request at TP 1 and 2, publishing on "
            f"over off {ratios(marks)}; before them (aaa0f7f, run from a worktree right after) {pair(before)}, "
            f"{ratios(before)}. Both runs are far from the table's run of 2026-12-02 ({pair(table)}): the cache "
            f"process over LMCache's server, net of idle, is {ours} at TP 2 ({theirs} before the marks; "
            f"{table['cache_instructions_over_lmcache']} then), above its 0.25.") in page
    assert marks["tp2"]["cache_over_lmcache"]["instructions"] == ours > 0.25
    middle = runs["midpoint"]["result"]
    window = [run[tp]["requests"] for run in (marks, before, middle) for tp in ("tp1", "tp2")]
    served = f"{table['tp1']['requests']} and {table['tp2']['requests']}"
    assert (f"At 5dac5d5 (2026-12-05 01:54, the midpoint of the commits between; 10:50–10:59 UTC) it read "
            f"{pair(middle)}, {middle['cache_instructions_over_lmcache']}, within its target: most of the growth at "
            "each TP came before it, and a third of TP 2's after it (where issue 39's admission and phase commits "
            f"lie), which took the ratio past 0.25. The run of 2026-12-02 served {served} requests in its window, "
            f"today's {min(window[::2])}–{max(window[::2])} and {min(window[1::2])}–{max(window[1::2])}") in page
    assert middle["cache_instructions_over_lmcache"] <= 0.25 < before["cache_instructions_over_lmcache"]
    counts = {tp: [run[tp]["per_request"]["mpcache"]["instructions"] for run in (table, middle, before)]
              for tp in ("tp1", "tp2")}
    assert all(between - then > now - between for then, between, now in counts.values())  # most before the midpoint
    then, between, now = counts["tp2"]
    assert round(3 * (now - between) / (now - then)) == 1  # a third of TP 2's after it
    hits = [policies[tp]["hit_chunk_ratio"] for tp in ("tp1", "tp2")]
    assert all(len(set(policies[tp][key].values())) == 1 for tp in policies
               for key in ("hit_chunk_ratio", "evicted_chunks_per_request"))
    assert (f"found): `adaptive` {over('tp1')}× `lru`'s instructions a request net of idle at TP 1 "
            f"({net('tp1', 'adaptive')} against {net('tp1', 'lru')}; {policies['tp1']['requests']} requests), "
            f"{over('tp2')}× at TP 2 ({net('tp2', 'adaptive')} against {net('tp2', 'lru')}; "
            f"{policies['tp2']['requests']} requests)") in page
    assert (f"the same hit ratio and evictions under both: {hits[0]['mpcache_lru']} and {hits[1]['mpcache_lru']} of "
            "the chunks") in page
