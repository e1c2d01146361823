"""benchmarks.l1_counted: each counted side runs the requests it is given between its two lines, refuses to count an
L1 not yet full, and the benchmark's ratios are each policy's count over lru's on the same workload and size."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.interrupted import sigterm_once_a_child_starts

from benchmarks import l1_counted
from mpcache.eviction.returns import LARGE_STORE_SHARE


def _side(policy: str, objects: int, workload: str, requests: int, warmup: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.l1_counted", "--child", policy, str(objects), workload,
                           "--requests", str(requests), "--warmup", str(warmup)],
                          input="go\nexit\n", capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("objects", [32, 2048])
@pytest.mark.parametrize("policy", ["lru", "arc", "adaptive"])
def test_a_side_finds_what_its_workload_holds_between_ready_and_done(policy, objects):
    """Every chunk of ``unique`` is new, so its lookups find none; ``shared``'s 4 prefixes of 3 chunks are each
    used every fourth request, which an L1 of 2,048 objects holds under any order, and one of 32 too (the 32 objects
    a prefix's use and its next one touch): 3 found a request, so no evicted chunk is asked for again.  420 warm-up
    requests of 5 new chunks fill either L1."""
    sides = {workload: _side(policy, objects, workload, 20, 420) for workload in ("unique", "shared")}

    assert {"unique": (0, "ready\ndone 0\n"), "shared": (0, "ready\ndone 60\n")} == {
        workload: (done.returncode, done.stdout) for workload, done in sides.items()}


@pytest.mark.parametrize("policy", ["lru", "arc", "adaptive"])
def test_a_tenants_side_is_two_tenants_and_the_larger_l1_holds_both_tenants_prefixes(policy):
    """``tenants``: requests 9, 19, ... are the second tenant's (its own keys: its prefixes 1 and 3 are found only
    where it stored them, 20 requests before), the rest the first's; 2,048 objects hold both tenants' prefixes, so
    every request finds its 3 chunks."""
    assert [("", 0), ("", 3), ("b", 1), ("", 2), ("b", 3)] == [
        (l1_counted._request("tenants", number)[0], l1_counted._request("tenants", number)[1][0] // 3)
        for number in (0, 3, 9, 10, 19)]
    done = _side(policy, 2048, "tenants", 20, 420)

    assert (0, "ready\ndone 60\n") == (done.returncode, done.stdout)


def test_a_side_whose_warm_up_leaves_l1_not_full_says_so_and_counts_nothing():
    """100 requests of 5 new chunks fill a quarter of 2,048 objects: no ``ready``, one line, exit status 2."""
    done = _side("lru", 2048, "unique", 20, 100)

    assert (2, "") == (done.returncode, done.stdout)
    assert ["benchmarks.l1_counted: error: 100 warm-up requests leave L1 of 2048 objects 24% full: give more "
            "(--warmup)"] == done.stderr.strip().splitlines()


@pytest.mark.parametrize("args, message", [
    (["--policies", "arc,adaptive"], "--policies arc,adaptive: each order once, lru among them (the ratios' baseline)"),
    (["--policies", "lru,lru"], "--policies lru,lru: each order once, lru among them (the ratios' baseline)"),
    (["--policies", "lru,fifo"], "unknown policy fifo: expected some of adaptive, lru, arc"),
    (["--requests", "0"], "--requests and --jobs must be at least 1, --warmup at least 0"),
    # at parse time, status 2: it was found by the run, status 1
    (["--warmup", "10"], "10 warm-up requests store at most 50 new chunks, too few to fill an L1 of 2,048 objects: "
                         "give more (--warmup)")])
def test_a_bad_flag_is_one_line_and_exit_status_2(args, message):
    done = subprocess.run([sys.executable, "-m", "benchmarks.l1_counted", *args], capture_output=True, text=True,
                          timeout=60)

    assert (2, "") == (done.returncode, done.stdout)
    assert done.stderr.strip().splitlines()[-1].endswith(f"error: {message}")


def test_a_warm_up_too_short_for_the_larger_l1_is_refused_before_any_side_starts(monkeypatch):
    started = []
    monkeypatch.setattr(l1_counted, "require_valgrind", lambda: None)
    monkeypatch.setattr(l1_counted, "count", lambda *side: started.append(side))

    with pytest.raises(RuntimeError, match="100 warm-up requests store at most 500 new chunks, too few to fill an "
                                           "L1 of 2,048 objects: give more"):
        l1_counted.run(requests=10, warmup=100)
    assert [] == started


def test_a_failed_side_leaves_the_sides_not_yet_started_uncounted(monkeypatch):
    """The first side fails at once while a second, started beside it, is still counting: the run raises that
    failure, and of the other ten sides at most the one its worker took up before the run saw the failure starts."""
    started, release = [], threading.Event()

    def count(policy, objects, workload, requests, warmup, directory):
        started.append((policy, objects, workload))
        if len(started) == 1:
            raise RuntimeError("the counted side said '' where 'ready' was due")
        release.wait(30)
        return {"policy": policy, "objects": objects, "workload": workload, "instructions_per_request": 1,
                "found_per_request": 0.0}

    monkeypatch.setattr(l1_counted, "require_valgrind", lambda: None)
    monkeypatch.setattr(l1_counted, "count", count)
    threading.Timer(1.0, release.set).start()
    with pytest.raises(RuntimeError, match="where 'ready' was due"):
        l1_counted.run(requests=10, warmup=420, jobs=2)

    assert 2 <= len(started) <= 3


def test_the_ratios_are_each_policy_s_count_over_lru_s_on_the_same_workload_and_size(monkeypatch):
    counts = {"lru": 200_000, "arc": 230_000, "adaptive": 250_000}

    def count(policy, objects, workload, requests, warmup, directory):
        return {"policy": policy, "objects": objects, "workload": workload,
                "instructions_per_request": counts[policy] + objects + (7 if workload == "shared" else 0),
                "found_per_request": 0.0}

    monkeypatch.setattr(l1_counted, "require_valgrind", lambda: None)
    monkeypatch.setattr(l1_counted, "count", count)
    result = l1_counted.run(requests=10, warmup=420, jobs=1)

    assert 3 * 2 * 3 == len(result["rows"])  # policies, sizes, workloads
    assert {"arc": round(230_032 / 200_032, 4), "adaptive": round(250_032 / 200_032, 4)} == result["over_lru"][
        "unique_32_objects"]
    assert {"arc": round(232_055 / 202_055, 4), "adaptive": round(252_055 / 202_055, 4)} == result["over_lru"][
        "shared_2048_objects"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_a_side_counted_twice_counts_the_same_instructions(tmp_path):
    """The count holds everything but the order still: the same side counted twice executes the same instructions
    (to within a few hundred a request: callgrind's own control calls land in the window)."""
    first, second = (l1_counted.count("adaptive", 32, "shared", 100, 100, str(tmp_path)) for _ in range(2))

    assert first["found_per_request"] == second["found_per_request"] > 0
    assert abs(first["instructions_per_request"] - second["instructions_per_request"]) < 300


def test_benchmarks_md_states_the_sizes_and_workloads_the_module_runs():
    """docs/BENCHMARKS.md's numbers are the module's: its L1 sizes, from how many new chunks a store is large in
    the smaller one (:data:`~mpcache.eviction.returns.LARGE_STORE_SHARE`), and the workloads' chunks."""
    small, large = l1_counted.L1_OBJECTS
    largest_small_store = max(n for n in range(small) if n <= LARGE_STORE_SHARE * small)
    prose = " ".join((Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md").read_text().split())

    assert (f"L1 size ({small} objects, where a store of more than {largest_small_store} new chunks is large, and "
            f"{large:,}) and workload (`unique`: {l1_counted.NEW_CHUNKS} new chunks a request; `shared`: one of "
            f"{l1_counted.SHARED_PREFIXES} prefixes of {l1_counted.PREFIX_CHUNKS} chunks in turn, then "
            f"{l1_counted.NEW_CHUNKS} new; `tenants`: `shared` with every {l1_counted.TENANT_CYCLE}th request another "
            f"tenant's,") in prose
    docstring = " ".join((l1_counted.__doc__ or "").split())
    assert "an L1 of 32 objects, where a store of more than 3 new chunks is large" in docstring
    assert (small, largest_small_store) == (32, 3)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_sigterm_ends_the_counted_sides_and_leaves_no_dump(tmp_path):
    """SIGTERM while a side counts: status 130, its valgrind gone with it, nothing left in TMPDIR (the side ran on,
    orphaned, and its callgrind dump stayed)."""
    ended = sigterm_once_a_child_starts([sys.executable, "-m", "benchmarks.l1_counted", "--policies", "lru", "--jobs",
                                         "1", "--requests", "100000"], tmp_path, "a counted side to start")
    status, stderr, alive = ended
    assert (130, ["benchmarks.l1_counted: interrupted: its counted sides and their dumps are gone"], []) == (
        status, [line for line in stderr if "instructions a request" not in line], alive)
    assert [] == os.listdir(tmp_path)
