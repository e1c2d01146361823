"""``python -m benchmarks.chance_trial``: its replays against the policy matrix's, its patches reaching the trial and
put back, its counting, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.performance_docs import doc, flattened, history, raw_results

from benchmarks import chance_trial, trace_gen
from benchmarks.policy_matrix import TOLERANCE, l1_found
from benchmarks.policy_matrix import sizes as policy_matrix_sizes
from benchmarks.trace_sim import lru, outcome
from mpcache.eviction import admission


def test_shipped_is_the_matrix_s_replay_and_the_other_two_reach_the_trial() -> None:
    """On ``multitenant`` (600 requests, seed 1) the middle and large sizes are large enough for a trial (at least
    TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS objects); at the large one ``shipped`` is
    ``policy_matrix``'s own replay, unpatched, its evidence counting once L1 has missed its capacity's worth of
    blocks (at least that many requests' new blocks, which the offline LRU's misses bound); sampling every key moves
    the trial's standing, and admitting by chance from the first request moves what L1 finds; the sampling's patch
    is put back after."""
    trace = trace_gen.KINDS["multitenant"](600, 1)
    halvings = admission.TRIAL_HALVINGS
    rows = chance_trial.rows_of("multitenant", trace, 1)
    assert halvings == admission.TRIAL_HALVINGS
    assert [size for size, _ in policy_matrix_sizes(trace)] == [row["size"] for row in rows]
    assert [False, True, True] == [row["runs_a_trial"] for row in rows] == [
        row["blocks"] >= admission.TRIAL_MIN_KEYS << admission.TRIAL_MIN_HALVINGS for row in rows]
    for row in rows:
        assert row["lru"] == lru(trace, row["blocks"]).hit_ratio
        assert row["runs_a_trial"] or "shipped" not in row
    large = rows[-1]
    assert large["shipped"]["hit_ratio"] == outcome(trace, l1_found(trace, large["blocks"], "adaptive")).hit_ratio
    missed, evidence_from = 0, large["shipped"]["evidence_from"]
    for request in trace[:evidence_from + 1]:
        missed += len(request.hashes)
    assert missed >= large["blocks"]
    assert large["every_key"]["lead"] != large["shipped"]["lead"]
    assert large["by_chance_from_first"] != large["shipped"]["hit_ratio"]


def test_the_summary_counts_rows_with_a_trial_as_the_policy_matrix_flags_them() -> None:
    """Rows made up here, each on one side of a bar: the rows without a trial are not counted."""
    def row(shipped: float, from_first: float, switches: list[int], flags_shipped: list[str],
            flags_first: list[str]) -> dict:
        return {"runs_a_trial": True, "shipped": {"hit_ratio": shipped, "switches": switches},
                "by_chance_from_first": from_first, "flags_shipped": flags_shipped,
                "flags_by_chance_from_first": flags_first}

    rows = [row(0.30, 0.30 + 2 * TOLERANCE, [], ["lmcache_sim"], []),
            row(0.30, 0.30 + TOLERANCE / 2, [5], [], []),
            row(0.30, 0.30 - 2 * TOLERANCE, [], [], ["lru", "lmcache_sim"]),
            {"runs_a_trial": False}]
    assert {"rows_with_a_trial": 3, "trial_switched": 1, "from_first_above_shipped": 1, "from_first_below_shipped": 1,
            "shipped_flagged": 1, "from_first_flagged": 1} == chance_trial.summary(rows)


def test_a_trace_file_s_rows_print_as_json_and_as_a_table(tmp_path) -> None:
    """A trace file written by ``trace_gen``: JSON with every row and the summary counted from them; the table a
    line per row, the rows without a trial saying so, and the summary under it; a line on stderr per trace."""
    path = tmp_path / "mt.jsonl"
    trace_gen.write(trace_gen.KINDS["multitenant"](600, 1), str(path), 1)
    command = [sys.executable, "-m", "benchmarks.chance_trial", str(path)]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stderr
    result = json.loads(done.stdout)
    assert 3 == len(result["rows"]) and result["summary"] == chance_trial.summary(result["rows"])
    assert ["mt"] * 3 == [row["trace"] for row in result["rows"]]
    assert "[chance_trial] mt (600 requests)" == done.stderr.strip()
    table = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = table.stdout.strip().splitlines()
    assert 0 == table.returncode and 2 + 3 + 2 == len(lines)
    assert 1 == sum("(no trial: L1 too small)" in line for line in lines)
    assert lines[-1].startswith("rows with a trial: 2, trial switched: ")


@pytest.mark.parametrize("args, message", [
    ([], "nothing to replay: no trace file and no --kinds"),
    (["--kinds", "loop", "--seeds", "3", "1"], "--seeds 3 1: the last seed is below the first"),
    (["--kinds", "loop", "--requests", "0"], "--requests 0: expected 1 to 1,000,000"),
    (["--kinds", "nosuch"], "argument --kinds: invalid choice: 'nosuch'"),
    (["/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl: not a readable Mooncake-format trace")])
def test_a_bad_argument_is_one_line_and_exit_status_2(capsys, args: list[str], message: str) -> None:
    """Each refused before any replay: argparse's usage, then the one line that says why."""
    with pytest.raises(SystemExit) as exited:
        chance_trial.main(args)
    stderr = capsys.readouterr().err
    assert 2 == exited.value.code and message in stderr.strip().splitlines()[-1], stderr


def test_benchmarks_md_s_numbers_are_the_module_s() -> None:
    """docs/BENCHMARKS.md's paragraph on the benchmark states its defaults and the trial's bar as the code has them."""
    page = flattened(doc("BENCHMARKS.md"))
    first, last = chance_trial.SEEDS
    assert (f"on `trace_gen` kinds ({chance_trial.REQUESTS:,} requests, seeds {first} to {last} by default)") in page
    assert f"at the end (it switches once both pass {admission.CHANCE_SIGMAS:g})." in page


def test_history_and_performance_md_read_the_kept_runs() -> None:
    """Every number the HISTORY.md entry and docs/PERFORMANCE.md's bullet state of the runs kept as PERFORMANCE.json's
    ``chance_trial`` is read from them, and each kept summary is counted from its rows."""
    kept = raw_results()["chance_trial"]
    files, kinds = kept["files"], kept["kinds"]
    for run in (files, kinds):
        assert run["summary"] == chance_trial.summary(run["rows"])

    def row(rows: list[dict], trace: str, size: str) -> dict:
        [found] = [r for r in rows if (r["trace"], r["size"]) == (trace, size)]
        return found

    held_out = row(files["rows"], "mooncake_arxiv_slice", "large")
    shipped, every = held_out["shipped"], held_out["every_key"]
    assert [] == shipped["switches"] == every["switches"]
    assert shipped["lead"]["sigmas"] == shipped["gain"]["sigmas"] and every["lead"]["sigmas"] == every["gain"]["sigmas"]
    middle, large = row(files["rows"], "mooncake_conversation_trace", "middle"), row(files["rows"], "synthetic_trace",
                                                                                      "large")
    synthetic_middle = row(files["rows"], "synthetic_trace", "middle")
    notes = flattened(history())
    among, public = kinds["summary"], files["summary"]
    for fact in (f"({held_out['blocks']:,} blocks) `adaptive` finds what the offline LRU finds, {held_out['lru']:.4f}",
                 f"from the first request reads {held_out['by_chance_from_first']:.4f}, above",
                 f"`lmcache_sim` ({held_out['lmcache_sim']:.4f})",
                 f"its evidence counted from request {shipped['evidence_from']} (L1",
                 f"when the slice ended each of its two sums stood {shipped['lead']['sigmas']} standard deviations "
                 f"above its lowest, where it switches at {admission.CHANCE_SIGMAS:g}; sampling every key, "
                 f"{every['lead']['sigmas']}.",
                 f"of the {among['rows_with_a_trial']} rows with a trial, admitting by chance from the first "
                 f"request finds more than the order as shipped by over {TOLERANCE} in "
                 f"{among['from_first_above_shipped']}, less in {among['from_first_below_shipped']}, "
                 f"and is flagged by `policy_matrix`'s bar in {among['from_first_flagged']}, the order as "
                 f"shipped in {among['shipped_flagged']}. The trial switched in "
                 f"{among['trial_switched']} row.",
                 f"of the {public['rows_with_a_trial']} rows with a trial, admitting by chance from the first "
                 f"request finds more in {public['from_first_above_shipped']} and less in "
                 f"{public['from_first_below_shipped']}, and is flagged in "
                 f"{public['from_first_flagged']} (the conversation trace's middle size, "
                 f"{middle['by_chance_from_first']:.4f} against the offline LRU's {middle['lru']:.4f}",
                 f"the order as shipped is flagged in {public['shipped_flagged']}, the slice's large size.",
                 f"the slice's {held_out['by_chance_from_first'] - shipped['hit_ratio']:.4f} with a loss of over "
                 f"{TOLERANCE} in {among['from_first_below_shipped']} of those "
                 f"{among['rows_with_a_trial']} generated rows ({among['from_first_flagged']} "
                 "flagged)",
                 f"(admitting by chance from the start: {synthetic_middle['by_chance_from_first']:.4f} against "
                 f"{synthetic_middle['shipped']['hit_ratio']:.4f} as shipped; the trial's LRU admitting by chance led "
                 f"the LRU admitting every store by {synthetic_middle['shipped']['gain']['sigmas']} standard "
                 "deviations)"):
        assert fact in notes, fact
    assert middle["flags_by_chance_from_first"] and large["flags_by_chance_from_first"]
    assert [held_out] == [r for r in files["rows"] if r["runs_a_trial"] and r["flags_shipped"]]
    seeds = sorted({r["seed"] for r in kinds["rows"]})
    assert {4000} == {r["requests"] for r in kinds["rows"]}
    assert f"seeds {seeds[0]}–{seeds[-1]}, 4,000 requests" in notes
    page = flattened(doc("PERFORMANCE.md"))
    assert (f"Admitting by chance from the first request would read {held_out['by_chance_from_first']:.4f} there, but "
            f"the admission trial's evidence stood {shipped['lead']['sigmas']} standard deviations above its lowest "
            f"when the slice ended (it switches at {admission.CHANCE_SIGMAS:g}; {every['lead']['sigmas']} sampling "
            "every key), and on the generated kinds admitting so without that evidence finds less than the order as "
            f"shipped by over {TOLERANCE} in {among['from_first_below_shipped']} of the "
            f"{among['rows_with_a_trial']} rows with a trial") in page
