"""What docs/PERFORMANCE.md, CHANGELOG.md and benchmarks/HISTORY.md say of ``adaptive``'s age floor is computed from
PERFORMANCE.json's ``admission_floor`` (and the runs it names) and the code's constants."""

from __future__ import annotations

import os

from support.performance_docs import REPO, doc, flattened, history, raw_results

from benchmarks.policy_matrix import TOLERANCE
from mpcache.eviction import admission

SECTION = "### `adaptive` under an age floor: the coding-agent sessions again"
ORDER = {"small": 0, "middle": 1, "large": 2}


def _changelog() -> str:
    with open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8") as handle:
        return flattened(handle.read())


def _key(row: dict) -> tuple:
    return row["trace"], row["requests"], row["size"]


def _kept() -> tuple[dict, dict, dict]:
    """The kept run, the session streams' kept facts and the rows before the change, by trace, length and size."""
    raw = raw_results()
    kept, sessions = raw["admission_floor"], raw["held_out_sessions_and_arxiv_head"]["sessions"]
    assert kept["sessions"]["before"] == "held_out_sessions_and_arxiv_head.sessions.policy_matrix_resplit_cap"
    before = {_key(row): row["l1_adaptive"] for row in sessions["policy_matrix_resplit_cap"]}
    return kept, sessions, before


def _small(rows: list[dict], length: int, found: dict | None = None) -> str:
    ratios = [(found[_key(r)] if found else r["l1_adaptive"]) / r["lru"] for r in rows
              if r["requests"] == length and r["size"] == "small"]
    return f"{min(ratios):.3f}–{max(ratios):.3f}×"


def _signed(value: float) -> str:
    return f"{value:+.4f}".replace("-", "−")


def test_performance_md_s_section_is_the_kept_runs():
    kept, sessions, before = _kept()
    page = doc("PERFORMANCE.md")
    section = page[page.index(SECTION):page.index("\n### ", page.index(SECTION) + 1)]
    prose = flattened(section)
    after = kept["sessions"]["after"]
    assert len(after) == len(before) == 48 and {_key(row) for row in after} == set(before)
    for row in sorted((r for r in after if r["requests"] == 4000),
                      key=lambda r: (sessions["traces"][r["trace"]]["gap_s"], sessions["traces"][r["trace"]]["seed"],
                                     ORDER[r["size"]])):
        trace = sessions["traces"][row["trace"]]
        line = (f"| {row['trace']} ({trace['gap_s']} s, {trace['seed']}) | {row['size']} | {row['blocks']:,} | "
                f"{row['lru']:.4f} | {row['arc']:.4f} | {row['lmcache_sim']:.4f} | {before[_key(row)]:.4f} | "
                f"{row['l1_adaptive']:.4f} | {row['l1_adaptive'] / row['lru']:.3f}× |")
        assert line in section, line
    assert (f"`adaptive` saves {_small(after, 4000)} the offline LRU's prefill ({_small(after, 1500)} over the first "
            f"1,500 requests), where it saved {_small(after, 4000, before)} ({_small(after, 1500, before)})") in prose
    flagged = [r for r in after if r["l1_adaptive"] < max(r["lru"], r["arc"]) - TOLERANCE]
    assert not flagged and not [r for r in after if before[_key(r)] < max(r["lru"], r["arc"]) - TOLERANCE]
    moved = {_key(r): r["l1_adaptive"] - before[_key(r)] for r in after}
    worst, best = min(moved, key=moved.__getitem__), max(moved, key=moved.__getitem__)
    assert (f"None of the 48 rows is more than {TOLERANCE} below the offline LRU or ARC, as before; the 48 rows' hit "
            f"ratios are {_signed(sum(moved.values()))} in sum (from {_signed(moved[worst])}, `{worst[0]}` "
            f"{worst[2]}, to {_signed(moved[best])}, `{best[0]}` {best[2]})") in prose
    below = [r["lmcache_sim"] - before[_key(r)] for r in after if before[_key(r)] < r["lmcache_sim"]]
    above = [r["l1_adaptive"] - r["lmcache_sim"] for r in after]
    assert min(above) > 0
    assert (f"{len(below)} of the 48 rows before, by up to {max(below):.4f}; none now, the nearest "
            f"{min(above):.4f} above it") in prose
    server = sessions["server"]
    runs = server["sizes"]["small"]["lmcache_server_runs"]
    small = (server["trace"], 4000, "small")
    now = next(r["l1_adaptive"] for r in after if _key(r) == small)
    assert before[small] < min(runs) and max(runs) < now
    assert (f"At the small size of `{server['trace']}` LMCache's own server read {min(runs):.4f}–{max(runs):.4f} in "
            f"the section below's two runs, above `adaptive` then ({before[small]:.4f}) and below it now "
            f"({now:.4f})") in prose
    service = kept["server"]["trace"]
    sizes = service["sizes"]
    ours = [sizes[name]["mpcache_adaptive"]["hit_ratio"] for name in ORDER]
    theirs = [sizes[name]["lmcache_server"]["hit_ratio"] for name in ORDER]
    failures = [sizes[name]["lmcache_server"]["allocation_failures"] for name in ORDER]
    in_process = [round(next(r["l1_adaptive"] for r in after if _key(r) == (server["trace"], 4000, name)), 4)
                  for name in ORDER]
    assert ours == in_process and all(server_found < found for server_found, found in zip(theirs, ours))
    assert len(sizes["small"]["lmcache_server"]["runs"]) == 1 and service["requests"] == 4000
    assert (f"`adaptive` read {' / '.join(f'{x:.4f}' for x in ours)} at the small / middle / large size, as in "
            f"process, and LMCache's server {' / '.join(f'{x:.4f}' for x in theirs)} (its allocation failures "
            f"{' / '.join(f'{x:,}' for x in failures)} chunks)") in prose


def test_the_generated_kinds_and_public_traces_cross_no_bar():
    kept, _, _ = _kept()
    raw = raw_results()
    spread = kept["seed_spread"]
    assert spread["before"] == "seed_spread_resplit_cap"
    capped = raw["seed_spread_resplit_cap"]
    assert spread["totals"] == capped["totals"]
    earlier = {(r["trace"], r["seed"], r["requests"], r["size"]): r["adaptive"] for r in raw["seed_spread"]["rows"]}
    earlier.update({(r["trace"], r["seed"], r["requests"], r["size"]): r["adaptive"]
                    for r in capped["rows_moved_from_seed_spread"]})
    moved = spread["moved"]
    assert all(earlier[(r["trace"], r["seed"], r["requests"], r["size"])] == r["before"] != r["after"] for r in moved)
    steps = {(r["trace"], r["seed"], r["size"]): r["after"] - r["before"] for r in moved}
    worst, best = min(steps, key=steps.__getitem__), max(steps, key=steps.__getitem__)
    totals = spread["totals"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"{len(moved)} of the {2 * totals['4000']['rows']:,} rows moved, {_signed(sum(steps.values()))} in sum "
            f"(from {_signed(steps[worst])}, `{worst[0]}` seed {worst[1]} {worst[2]}, to {_signed(steps[best])}, "
            f"`{best[0]}` seed {best[1]} {best[2]}), none across a bar: {totals['4000']['adaptive_below_best']} and "
            f"{totals['1500']['adaptive_below_best']} flagged, {totals['4000']['adaptive_below_sim']} and "
            f"{totals['1500']['adaptive_below_sim']} below the simulated server, as before") in prose
    for row in moved:
        for found in (row["before"], row["after"]):
            assert (found < max(row["lru"], row["arc"]) - TOLERANCE) == (row["after"] < max(row["lru"], row["arc"])
                                                                        - TOLERANCE)
            assert (found < row["lmcache_sim"]) == (row["after"] < row["lmcache_sim"])
    public = kept["generated_and_public"]
    assert [(_key(r), r["l1_adaptive"]) for r in public["after"]] == [(_key(r), r["l1_adaptive"])
                                                                      for r in public["before"]]
    distinct = {_key(r) for r in public["after"]}
    whole = [r for r in public["after"] if r["requests"] < 1500]
    assert {r["trace"] for r in whole} == {"mooncake_arxiv_slice", "mooncake_arxiv_head1000_dynamo"}
    assert (f"the same in all {len(public['after'])} rows ({len(distinct)} distinct: the arXiv slices have "
            f"{whole[0]['requests']:,} requests, so their first 1,500 are the whole)") in prose


def test_the_cost_is_the_counted_runs():
    kept, _, _ = _kept()
    counted = kept["counted"]
    before = {(r["policy"], r["objects"], r["workload"]): r["instructions_per_request"] for r in counted["before"]}
    after = {(r["objects"], r["workload"]): r["instructions_per_request"] for r in counted["after"]}
    whole = raw_results()["isolation_engine_path"]["runs"]["policies"]["result"]["tp1"][0]["per_request"][
        "mpcache_adaptive"]["instructions"]
    cost = {objects: after[(objects, "unique")] - before[("adaptive", objects, "unique")]
            for objects in (512, 1024, 2048)}
    prose = flattened(doc("PERFORMANCE.md"))
    assert (f"an L1 of 2,048 objects, whose trial now keeps a third LRU and each key's last use, +{cost[2048]:,} "
            f"instructions a request ({after[(2048, 'unique')] / before[('adaptive', 2048, 'unique')]:.3f}×); one of "
            f"1,024 objects, which had no trial, +{cost[1024]:,} "
            f"({after[(1024, 'unique')] / before[('adaptive', 1024, 'unique')]:.3f}×); one of 512, +{cost[512]:,} "
            f"({after[(512, 'unique')] / before[('adaptive', 512, 'unique')]:.3f}×)") in prose
    assert (f"({round(whole):,} instructions under `adaptive` at TP 1, PERFORMANCE.json's "
            f"`isolation_engine_path.runs.policies`) that is {cost[2048] / whole:.1%}, {cost[1024] / whole:.1%} and "
            f"{cost[512] / whole:.1%}").replace("%", " %") in prose
    assert all(after[(objects, "shared")] > before[("adaptive", objects, "shared")] for objects in (512, 1024, 2048))
    assert 1024 < admission.TRIAL_MIN_KEYS << admission.TRIAL_HALVINGS  # "which had no trial" before
    changelog = _changelog()
    assert f"+{cost[2048]:,} instructions a request at 2,048 objects and +{cost[512]:,} at 512" in changelog


def test_changelog_and_history_state_the_code_s_constants_and_the_kept_numbers():
    kept, _, before = _kept()
    after = kept["sessions"]["after"]
    changelog = _changelog()
    assert admission.FLOOR_AGES == 2.0 and admission.RULES == ("every", "by_chance", "floored")
    assert "refuses a store whose room would evict an object used within twice the age at which such an LRU" in (
        changelog)
    below_before = sum(1 for r in after if before[_key(r)] < r["lmcache_sim"])
    below_now = sum(1 for r in after if r["l1_adaptive"] < r["lmcache_sim"])
    assert (f"the rows below the simulated LMCache server {below_before} → {below_now} of {len(after)} and "
            f"{_small(after, 4000, before)} → {_small(after, 4000)} the offline LRU's prefill at the small size") in (
        changelog)
    moved = kept["seed_spread"]["moved"]
    assert (f"({len(moved)} of 2,688 rows moved, {_signed(sum(r['after'] - r['before'] for r in moved))} in sum)"
            in changelog)
    notes = flattened(history())
    total = sum(r["l1_adaptive"] - before[_key(r)] for r in after)
    assert (f"on the {len(after)} session rows none below `lmcache_sim` ({below_before} before), none flagged (none "
            f"before), {_signed(total)} in sum; {len(moved)} of the 2,688 rows of the 64 generated seeds moved, none "
            "across a bar") in notes and below_now == 0
    assert f"**Landed** (`FLOOR_AGES` {admission.FLOOR_AGES:g})" in notes
    assert f"**Landed** (`TRIAL_MIN_HALVINGS` {admission.TRIAL_MIN_HALVINGS})" in notes
    minimum = admission.TRIAL_MIN_KEYS << admission.TRIAL_MIN_HALVINGS
    assert f"Below {minimum} objects (h under {admission.TRIAL_MIN_HALVINGS})" in notes
    small = next(r for r in after if _key(r) == ("cc_g60_s2", 4000, "small"))
    assert (f"`cc_g60_s2` at the small size ({small['blocks']:,} objects, no trial before) reads "
            f"{before[_key(small)]:.4f} → {small['l1_adaptive']:.4f}") in notes


def test_the_curves_errors_are_the_kept_runs():
    kept, _, _ = _kept()
    runs = kept["mrc_accuracy"]
    prose = flattened(doc("PERFORMANCE.md"))

    def error(run: str, trace: str, size: str) -> float:
        return runs[run]["traces"][f"{trace}/{size}"]["adaptive"]["32768 keys, rate 0.01"]["max_half_to_double"]

    def errors(run: str, trace: str) -> str:
        return " / ".join(f"{error(run, trace, size):.4f}" for size in ORDER)

    assert (f"its largest error there is {errors('after', 'cc_g30_s1')} at the small / middle / large size of "
            f"`cc_g30_s1` ({errors('before', 'cc_g30_s1')} before) and {errors('after', 'cc_g60_s2')} on `cc_g60_s2` "
            f"({errors('before', 'cc_g60_s2')} before)") in prose
    above = [(trace, size) for trace in ("cc_g30_s1", "cc_g60_s2") for size in ORDER
             if error("after", trace, size) > 0.02 >= error("before", trace, size)]
    assert above == [("cc_g60_s2", "middle"), ("cc_g60_s2", "large")]
    assert "above the issue's 0.02 at the middle and large sizes of `cc_g60_s2`, where it was within it" in prose
