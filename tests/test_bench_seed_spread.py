"""``python -m benchmarks.seed_spread``: its rows against references computed apart, its counting per cell and in
total, and its command line."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from support.performance_docs import REPO, doc, flattened, history, raw_results

from benchmarks import seed_spread, trace_gen
from benchmarks.policy_matrix import LMCACHE_PERIODS, TOLERANCE, l1_found, lmcache_sim
from benchmarks.policy_matrix import sizes as policy_matrix_sizes
from benchmarks.trace_sim import arc, lru, outcome
from mpcache.eviction import phases


def test_a_row_holds_the_offline_references_and_the_matrix_s_replay_of_adaptive() -> None:
    """Per length and size: ``trace_sim``'s LRU and ARC, the best of the simulated server's trim periods, and the
    order replayed as ``policy_matrix`` replays it."""
    rows = seed_spread._rows(("scan", 4, 300, 120))
    whole = trace_gen.KINDS["scan"](300, 4)
    assert [(300, "small"), (300, "middle"), (300, "large"), (120, "small"), (120, "middle"), (120, "large")] == [
        (row["requests"], row["size"]) for row in rows]
    for row in rows:
        trace = whole[:row["requests"]]
        assert row["blocks"] == dict(policy_matrix_sizes(trace))[row["size"]]
        assert row["lru"] == lru(trace, row["blocks"]).hit_ratio
        assert row["arc"] == arc(trace, row["blocks"]).hit_ratio
        assert row["lmcache_sim"] == max(lmcache_sim(trace, row["blocks"], period).hit_ratio
                                       for period in LMCACHE_PERIODS)
        assert row["adaptive"] == outcome(trace, l1_found(trace, row["blocks"], "adaptive")).hit_ratio


def test_a_cell_counts_each_policy_s_flagged_seeds_by_the_matrix_s_bar() -> None:
    """Two kinds' cells, made up so each policy falls on a known side of each bar.  ``t``: LRU more than the tolerance
    below ARC in seeds 1 and 2, ARC in seed 3; ``adaptive`` within the tolerance of the better in seeds 1 and 3 and
    below it by more in seed 2, and below the simulated server in seed 3 only (LRU in seeds 1 and 3, ARC in 3).
    ``u``: ARC flagged in both seeds, ``adaptive`` exactly the tolerance below the LRU (not more: not flagged) and
    below the simulated server, as LRU and ARC are."""
    def row(kind: str, seed: int, lru_ratio: float, arc_ratio: float, sim: float, adaptive: float) -> dict:
        return {"trace": kind, "seed": seed, "requests": 40, "size": "small", "blocks": 10, "lru": lru_ratio,
                "arc": arc_ratio, "lmcache_sim": sim, "adaptive": adaptive}

    rows = [row("t", 1, 0.40, 0.50, 0.45, 0.50 - TOLERANCE / 2), row("u", 1, 0.50, 0.40, 0.60, 0.50 - TOLERANCE),
            row("t", 2, 0.30, 0.40, 0.20, 0.30), row("u", 2, 0.50, 0.40, 0.60, 0.50 - TOLERANCE),
            row("t", 3, 0.60, 0.50, 0.61, 0.60 - TOLERANCE / 2)]
    t, u = seed_spread.cells(rows)
    gaps = [0.10, 0.10, -0.10]
    assert (t["trace"], t["seeds"], u["trace"], u["seeds"]) == ("t", 3, "u", 2)
    assert t["arc_minus_lru_mean"] == pytest.approx(statistics.fmean(gaps))
    assert t["arc_minus_lru_sd"] == pytest.approx(statistics.stdev(gaps))
    assert (2, 1, 1) == (t["lru_below_best"], t["arc_below_best"], t["adaptive_below_best"])
    assert (2, 1, 1) == (t["lru_below_sim"], t["arc_below_sim"], t["adaptive_below_sim"])
    assert 1 == t["fixed"]
    assert t["adaptive_minus_best_mean"] == pytest.approx((-TOLERANCE - 0.10) / 3)
    assert t["lru_minus_best_mean"] == pytest.approx(-0.20 / 3)
    assert (0, 2, 0, 0) == (u["lru_below_best"], u["arc_below_best"], u["adaptive_below_best"], u["fixed"])
    assert (2, 2, 2) == (u["lru_below_sim"], u["arc_below_sim"], u["adaptive_below_sim"])
    assert (u["arc_minus_lru_mean"], u["arc_minus_lru_sd"]) == (pytest.approx(-0.10), pytest.approx(0.0))


def test_the_totals_sum_the_cells_of_a_length_and_name_those_where_adaptive_trails_the_fixed_choice() -> None:
    """Two cells of 40 requests and one of 20: the sums per length, and the one cell of 40 where ``adaptive`` is
    flagged in more seeds than the better of LRU and ARC held for the whole cell would be."""
    def cell(kind: str, requests: int, lru_flags: int, arc_flags: int, adaptive_flags: int) -> dict:
        return {"trace": kind, "requests": requests, "size": "middle", "seeds": 5, "lru_below_best": lru_flags,
                "arc_below_best": arc_flags, "adaptive_below_best": adaptive_flags, "lru_below_sim": 1,
                "arc_below_sim": 2, "adaptive_below_sim": 3, "fixed": min(lru_flags, arc_flags)}

    counted = [cell("a", 40, 3, 1, 1), cell("b", 40, 0, 4, 2), cell("a", 20, 5, 0, 4)]
    assert {"rows": 10, "lru_below_best": 3, "arc_below_best": 5, "adaptive_below_best": 3, "lru_below_sim": 2,
            "arc_below_sim": 4, "adaptive_below_sim": 6, "fixed": 1,
            "adaptive_behind_fixed": ["b middle"]} == seed_spread.totals(counted, 40)
    assert ["a middle"] == seed_spread.totals(counted, 20)["adaptive_behind_fixed"]


def test_a_small_run_prints_its_cells_totals_and_rows_as_json_and_its_table() -> None:
    """One kind, two seeds, short lengths: 6 cells of 2 seeds each, the totals per length, a line per job done; the
    table has a line per cell."""
    argv = [sys.executable, "-m", "benchmarks.seed_spread", "--seeds", "3", "4", "--kinds", "loop", "--requests",
            "200", "--first", "80", "--jobs", "1"]
    done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stderr
    result = json.loads(done.stdout)
    assert 12 == len(result["rows"]) and [2] * 6 == [cell["seeds"] for cell in result["cells"]]
    assert {"200", "80"} == set(result["totals"]) and 6 == result["totals"]["80"]["rows"]
    assert ["[seed_spread] loop seed 3 done (1/2)", "[seed_spread] loop seed 4 done (2/2)"] == (
        done.stderr.strip().splitlines())
    table = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert 0 == table.returncode and seed_spread.render(result["cells"], 2) == table.stdout.strip()
    assert 2 + 6 == len(table.stdout.strip().splitlines())


@pytest.mark.parametrize("args, message", [
    (["--seeds", "9", "3"], "--seeds 9 3: the last seed is below the first"),
    (["--first", "5000", "--requests", "5000"], "--first 5000: expected fewer than --requests 5000"),
    (["--jobs", "-1"], "argument --jobs: expected a whole number >= 1, got '-1'")])
def test_a_bad_argument_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.seed_spread", *args], capture_output=True, text=True,
                          timeout=60)
    assert 2 == done.returncode and message in done.stderr.strip().splitlines()[-1], done.stderr


def test_benchmarks_md_states_the_default_seeds_and_the_bar_as_the_code_has_them() -> None:
    page = flattened(doc("BENCHMARKS.md"))
    first, last = seed_spread.SEEDS
    assert (f"the same replay at seeds {first} to {last} by default, and per kind, length and size the seeds where the "
            f"offline LRU, ARC and `adaptive` are each more than {TOLERANCE} below the better of LRU and ARC") in page


BEFORE, AFTER = "seed_spread_join_at_3_sigmas", "seed_spread"  # the kept runs, the join at 3 and at 2 deviations


@pytest.mark.parametrize("key", [BEFORE, AFTER])
def test_a_kept_run_s_cells_and_totals_are_its_rows_and_its_references_the_other_s(key: str) -> None:
    """PERFORMANCE.json's two runs: cells and totals counted from their rows; the references (LRU, ARC, the
    simulated server) of each row what the other run, another replay, found."""
    kept = raw_results()[key]
    rows = kept["rows"]
    assert 64 * 7 * 6 == len(rows) and kept["cells"] == seed_spread.cells(rows)
    assert {length: seed_spread.totals(kept["cells"], int(length)) for length in ("4000", "1500")} == kept["totals"]
    other = raw_results()[AFTER if key == BEFORE else BEFORE]["rows"]
    assert [(r["trace"], r["seed"], r["requests"], r["size"], r["lru"], r["arc"], r["lmcache_sim"]) for r in rows] == [
        (r["trace"], r["seed"], r["requests"], r["size"], r["lru"], r["arc"], r["lmcache_sim"]) for r in other]


def test_the_run_before_the_join_s_change_is_history_s_table_and_its_seeds_1_to_16_the_ablation_s() -> None:
    """The run of the join at 3 deviations: its table in benchmarks/HISTORY.md rendered from its cells, and its
    rows of seeds 1 to 16 what ``phase_ablation``'s kept run (the same order) found as shipped."""
    rows = raw_results()[BEFORE]["rows"]
    assert seed_spread.render(raw_results()[BEFORE]["cells"], 64) in history()
    ablation = {(r["trace"], r["seed"], r["requests"], r["size"]): r for r in raw_results()["phase_ablation"]["rows"]}
    early = [r for r in rows if r["seed"] <= 16]
    assert len(ablation) == len(early)
    for row in early:
        other = ablation[(row["trace"], row["seed"], row["requests"], row["size"])]
        assert (other["shipped"], other["lru"], other["arc"], other["lmcache_sim"]) == (
            row["adaptive"], row["lru"], row["arc"], row["lmcache_sim"])


def test_history_s_reading_of_the_run_before_the_join_s_change_is_counted_from_it() -> None:
    kept = raw_results()[BEFORE]
    at = {(c["trace"], c["requests"], c["size"]): c for c in kept["cells"]}
    t4, t1 = kept["totals"]["4000"], kept["totals"]["1500"]
    notes = flattened(history())
    assert (f"`adaptive` is flagged in {t4['adaptive_below_best']} of {t4['rows']:,} rows, where the better of LRU "
            f"and ARC chosen after the fact per cell would be in {t4['fixed']}, the LRU in {t4['lru_below_best']} and "
            f"ARC in {t4['arc_below_best']}. Below `lmcache_sim`: {t4['adaptive_below_sim']}, against the LRU's "
            f"{t4['lru_below_sim']} and ARC's {t4['arc_below_sim']}.") in notes
    middle = at[("conversations", 4000, "middle")]
    assert ["conversations middle"] == t4["adaptive_behind_fixed"]
    assert (middle["adaptive_below_best"], middle["fixed"], middle["lru_below_best"], middle["arc_below_best"]) == (
        7, 6, 7, 6)
    assert (f"ARC − LRU is {middle['arc_minus_lru_mean']:+.4f} with a standard deviation of "
            f"{middle['arc_minus_lru_sd']:.4f} over the seeds") in notes
    matrix = raw_results()["phase_ablation"]["rows"]
    assert {("conversations", "middle")} == {(r["trace"], r["size"]) for r in matrix if r["requests"] == 4000
                                             and r["shipped"] < max(r["lru"], r["arc"]) - TOLERANCE}
    large = at[("multitenant", 1500, "large")]
    assert (large["adaptive_below_best"], large["arc_below_best"], large["seeds"]) == (43, 64, 64)
    assert (f"`adaptive` is flagged in {t1['adaptive_below_best']} rows against the fixed choice's {t1['fixed']}. "
            "43 of them are `multitenant` large, where ARC is more than 0.005 below the LRU in all 64 seeds") in notes


def test_performance_md_s_reading_of_both_runs_is_counted_from_them() -> None:
    """docs/PERFORMANCE.md's *What is missed*: today's order from the run after the change, the run before it in
    brief."""
    after, before = raw_results()[AFTER], raw_results()[BEFORE]
    at = {(c["trace"], c["requests"], c["size"]): c for c in after["cells"]}
    t4, t1 = after["totals"]["4000"], after["totals"]["1500"]
    middle, large = at[("conversations", 4000, "middle")], at[("multitenant", 1500, "large")]
    page = flattened(doc("PERFORMANCE.md"))
    assert (f"`adaptive` is more than {TOLERANCE} below the offline LRU or ARC in {t4['adaptive_below_best']} of "
            f"{t4['rows']:,} rows of 4,000 requests, the length of the issue's production replay, where the better of "
            f"LRU and ARC, chosen after the fact per kind, length and size, would be in {t4['fixed']} (the LRU in "
            f"{t4['lru_below_best']}, ARC in {t4['arc_below_best']}). {middle['adaptive_below_best']} of the "
            f"{t4['adaptive_below_best']} are `conversations` middle, where LRU and ARC trade places from seed to seed "
            f"(ARC − LRU {middle['arc_minus_lru_mean']:+.4f}, standard deviation {middle['arc_minus_lru_sd']:.4f}) and "
            f"each is flagged itself in {middle['lru_below_best']} and {middle['arc_below_best']} seeds") in page
    assert large["arc_below_best"] == large["seeds"]  # "ARC is below the LRU in every seed"
    assert (f"Over the first 1,500 requests it is flagged in {t1['adaptive_below_best']} rows against {t1['fixed']}, "
            f"{large['adaptive_below_best']} of them `multitenant` large") in page
    assert (f"{t4['adaptive_below_sim']} rows of 4,000 requests (the LRU {t4['lru_below_sim']}, ARC "
            f"{t4['arc_below_sim']}) and {t1['adaptive_below_sim']} of 1,500") in page
    mixed = at[("multitenant", 1500, "middle")]
    assert mixed["lru_below_best"] == mixed["seeds"]  # "ARC is ahead of it in every seed"
    assert (f"and {mixed['adaptive_below_best']} `multitenant` middle, where ARC is ahead of it in every seed: those "
            "gaps are the order's.") in page
    unseen = {n: [r for r in after["rows"] if 25 <= r["seed"] <= 32 and r["requests"] == n] for n in (4000, 1500)}
    flagged = {n: [r for r in rows if r["adaptive"] < max(r["lru"], r["arc"]) - TOLERANCE]
               for n, rows in unseen.items()}
    large_unseen = [r for r in flagged[1500] if (r["trace"], r["size"]) == ("multitenant", "large")]
    below = {n: sum(1 for r in rows if r["adaptive"] < r["lmcache_sim"]) for n, rows in unseen.items()}
    worst = max(max(r["lru"], r["arc"]) - r["adaptive"] for r in large_unseen)
    assert (f"With today's join (`seed_spread`) those seeds read {len(flagged[4000])} and {len(flagged[1500])} flagged "
            f"({len(large_unseen)} `multitenant` large, up to {worst:.4f}) and {below[4000]} and {below[1500]} below "
            "the simulated server.") in page
    b4, b1 = before["totals"]["4000"], before["totals"]["1500"]
    assert (f"{b4['adaptive_below_best']} and {b1['adaptive_below_best']} flagged, {b4['adaptive_below_sim']} and "
            f"{b1['adaptive_below_sim']} below the simulated server") in page


def _seed_groups_table(before: list[dict], after: list[dict]) -> str:
    """HISTORY.md's table of the join's change per group of seeds, counted apart from its prose."""
    groups = ((1, 16, "1–16 (the policy matrix's)"), (17, 32, "17–32 (looked at before)"),
              (33, 64, "33–64 (never looked at for a change)"), (1, 64, "1–64"))
    lines = ["| seeds | 4,000 requests: flagged / below `lmcache_sim` | 1,500 requests: flagged / below `lmcache_sim` "
             "| sum of hit ratios |", "|---|---|---|---|"]
    for first, last, name in groups:
        counted = []
        for rows in (before, after):
            part = [r for r in rows if first <= r["seed"] <= last]
            flagged = {n: sum(1 for r in part if r["requests"] == n and r["adaptive"] < max(r["lru"], r["arc"])
                              - TOLERANCE) for n in (4000, 1500)}
            below = {n: sum(1 for r in part if r["requests"] == n and r["adaptive"] < r["lmcache_sim"])
                     for n in (4000, 1500)}
            counted.append((flagged, below, sum(r["adaptive"] for r in part)))
        (fb, bb, sb), (fa, ba, sa) = counted
        cols = [f"{fb[n]} → {fa[n]} / {bb[n]} → {ba[n]}" for n in (4000, 1500)]
        lines.append(f"| {name} | {cols[0]} | {cols[1]} | {sb:.3f} → {sa:.3f} |")
    return "\n".join(lines)


def test_history_s_entry_on_the_join_is_the_two_runs_and_the_code_s_constants() -> None:
    """The join's constants as the entry states them; its table per group of seeds and each cell it names counted
    from the two kept runs; the curves' errors from PERFORMANCE.json's ``mrc_accuracy_join``."""
    assert (phases.JOIN_SIGMAS, phases.JOIN_FALL_SIGMAS) == (2.0, 2.5)
    before, after = raw_results()[BEFORE], raw_results()[AFTER]
    notes = history()
    assert _seed_groups_table(before["rows"], after["rows"]) in notes
    prose = flattened(notes)
    assert "3 and 3.5 → 2 and 2.5:" in prose
    old = {(c["trace"], c["requests"], c["size"]): c for c in before["cells"]}
    new = {(c["trace"], c["requests"], c["size"]): c for c in after["cells"]}

    def moved(kind: str, requests: int, size: str, column: str = "adaptive_below_best") -> str:
        return f"{old[(kind, requests, size)][column]} → {new[(kind, requests, size)][column]}"

    assert (f"Over 1,500 requests, flagged: `multitenant` large {moved('multitenant', 1500, 'large')}, `conversations` "
            f"middle {moved('conversations', 1500, 'middle')} and large {moved('conversations', 1500, 'large')}, "
            f"`agentic` large {moved('agentic', 1500, 'large')}, `multitenant` middle "
            f"{moved('multitenant', 1500, 'middle')}.") in prose
    large = new[("conversations", 4000, "large")]
    middle = new[("conversations", 4000, "middle")]
    below_sim = moved("conversations", 4000, "middle", "adaptive_below_sim")
    assert (f"Over 4,000 requests, flagged: `conversations` large {moved('conversations', 4000, 'large')}, where the "
            f"LRU and ARC are flagged themselves in {large['lru_below_best']} and {large['arc_below_best']} seeds. "
            f"Below `lmcache_sim`: `conversations` middle {below_sim} "
            f"(the LRU {middle['lru_below_sim']}, ARC {middle['arc_below_sim']}), `multitenant` middle "
            f"{moved('multitenant', 4000, 'middle', 'adaptive_below_sim')}.") in prose
    changed = {key for key in old if (old[key]["adaptive_below_best"], old[key]["adaptive_below_sim"]) != (
        new[key]["adaptive_below_best"], new[key]["adaptive_below_sim"])}
    named = {("multitenant", 1500, "large"), ("conversations", 1500, "middle"), ("conversations", 1500, "large"),
             ("agentic", 1500, "large"), ("multitenant", 1500, "middle"), ("conversations", 4000, "large"),
             ("conversations", 4000, "middle"), ("multitenant", 4000, "middle")}
    assert changed - named == {("agentic", 1500, "middle")}  # below the server only, 5 → 2: in the table's sums
    curves = raw_results()["mrc_accuracy_join"]
    at3, at2 = curves["join_at_3_sigmas"], curves["join_at_2_sigmas"]
    assert (f"mean absolute error `multitenant` {at3['multitenant']['mae']} → {at2['multitenant']['mae']}, KV-shaped "
            f"{at3['kv']['mae']} → {at2['kv']['mae']}, `conversations` {at3['conversations']['mae']} → "
            f"{at2['conversations']['mae']}, `agentic` {at3['agentic']['mae']} → {at2['agentic']['mae']}, the others "
            "unchanged") in prose
    assert [name for name in at3 if at3[name]["mae"] != at2[name]["mae"]] == ["kv", "conversations", "multitenant",
                                                                               "agentic"]
    assert (f"2× L1 is {at2['multitenant']['max_half_to_double']} on `multitenant` either way, above the issue's "
            "0.02") in prose and at3["multitenant"]["max_half_to_double"] == at2["multitenant"]["max_half_to_double"]


@pytest.mark.parametrize("module, sentence", [("seed_spread", "how often issue 39's per-row bar flags the references "
                                                              "themselves, seed by seed."),
                                              ("phase_ablation", "where ``adaptive``'s flagged policy-matrix rows come "
                                                                 "from.")])
def test_help_describes_the_benchmark_in_its_docstring_s_first_sentence(module: str, sentence: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert 0 == done.returncode and sentence in flattened(done.stdout), done.stdout


@pytest.mark.parametrize("key, constants", [(BEFORE, (3.0, 3.5)),
                                            (AFTER, (phases.JOIN_SIGMAS, phases.JOIN_FALL_SIGMAS))])
def test_rows_of_each_kept_run_replay_with_its_join(monkeypatch, key: str, constants: tuple[float, float]) -> None:
    """Rows the change moved most, and one it moved not, replayed in process with the run's join: L1 under
    ``adaptive`` finds what the run kept (the run after the change is today's join, with the split after a join
    counting every ghost hit of an access, as both runs' order did)."""
    monkeypatch.setattr(phases, "JOIN_SIGMAS", constants[0])
    monkeypatch.setattr(phases, "JOIN_FALL_SIGMAS", constants[1])
    monkeypatch.setattr(phases, "RESPLIT_HITS_PER_ACCESS", float("inf"))
    rows = {(r["trace"], r["seed"], r["requests"], r["size"]): r for r in raw_results()[key]["rows"]}
    for kind, seed, requests, size in (("multitenant", 1, 1500, "large"), ("multitenant", 36, 4000, "middle"),
                                       ("conversations", 23, 4000, "middle"), ("rag", 2, 1500, "small")):
        row = rows[(kind, seed, requests, size)]
        trace = trace_gen.KINDS[kind](4000, seed)[:requests]
        assert outcome(trace, l1_found(trace, row["blocks"], "adaptive")).hit_ratio == row["adaptive"]


def test_history_s_row_by_row_reading_of_the_join_is_counted_from_the_runs() -> None:
    before, after = raw_results()[BEFORE]["rows"], raw_results()[AFTER]["rows"]
    prose = flattened(history())
    pairs = list(zip(before, after))
    assert all((b["trace"], b["seed"], b["requests"], b["size"]) == (a["trace"], a["seed"], a["requests"], a["size"])
               for b, a in pairs)
    gained = sum(1 for b, a in pairs if a["adaptive"] > b["adaptive"])
    lost = sum(1 for b, a in pairs if a["adaptive"] < b["adaptive"])
    b, a = min(pairs, key=lambda pair: pair[1]["adaptive"] - pair[0]["adaptive"])
    assert (a["trace"], a["seed"], a["requests"], a["size"]) == ("multitenant", 36, 4000, "middle")
    assert max(a["lru"], a["arc"]) - TOLERANCE <= a["adaptive"] < min(a["lru"], a["lmcache_sim"])
    assert (f"Row by row, {gained} of the {len(pairs):,} rows gain and {lost} lose, the most `multitenant` middle seed "
            f"36 over 4,000 requests, {b['adaptive']:.4f} → {a['adaptive']:.4f} ({a['lru'] - a['adaptive']:.4f} below "
            "the LRU, not flagged, and below `lmcache_sim`).") in prose

    def flagged(row: dict) -> bool:
        return row["adaptive"] < max(row["lru"], row["arc"]) - TOLERANCE

    def turned(requests: int, now: bool) -> list[tuple[str, str, int]]:
        return sorted((a["trace"], a["size"], a["seed"]) for b, a in pairs
                      if a["requests"] == requests and flagged(a) == now and flagged(b) != now)

    assert [("conversations", "large", 18), ("conversations", "middle", 23), ("conversations", "middle", 45),
            ("conversations", "middle", 58)] == turned(4000, True)
    assert [("conversations", "middle", 1), ("conversations", "middle", 22), ("conversations", "middle", 56)] == (
        turned(4000, False))
    assert ("Over 4,000 requests 4 rows are newly flagged and 3 no longer, all `conversations`: middle seeds 23, 45 "
            "and 58 and large seed 18 in, middle seeds 1, 22 and 56 out.") in prose
    out = turned(1500, False)
    assert [("conversations", "middle", 53), ("multitenant", "middle", 62)] == turned(1500, True)
    assert (f"Over 1,500 requests {len(out)} rows are no longer flagged and 2 are newly (`conversations` middle seed "
            f"53, `multitenant` middle seed 62). {sum(1 for row in out if row[:2] == ('multitenant', 'large'))} of the "
            f"{len(out)} are `multitenant` large") in prose


def test_the_public_traces_the_curves_and_the_changelog_read_as_the_kept_runs() -> None:
    """The public traces' rows in process are the same at both joins and their small-size ratios the prose's; the
    curves' errors in docs/MRC.md and docs/PERFORMANCE.md, and CHANGELOG's numbers, from the kept runs."""
    public = raw_results()["policy_matrix_public_join"]
    assert public["join_at_3_sigmas"] == public["join_at_2_sigmas"] and len(public["join_at_2_sigmas"]) == 18
    small = [f"{row['l1_adaptive'] / row['lru']:.3f}×" for row in public["join_at_2_sigmas"]
             if row["size"] == "small" and row["requests"] != 1500]
    assert ["1.326×", "1.364×", "1.089×"] == small
    assert "(1.326×, 1.364× and 1.089× the offline LRU's hit ratio at the small size)" in flattened(history())
    curves = raw_results()["mrc_accuracy_join"]
    at3, at2 = curves["join_at_3_sigmas"], curves["join_at_2_sigmas"]
    mrc = flattened(doc("MRC.md"))
    assert (f"the error reads {at2['multitenant']['mae']} on `multitenant` ({at3['multitenant']['mae']} at 3; largest "
            f"point of ½×–2× {at2['multitenant']['max_half_to_double']} at either), {at2['rag']['mae']:.4f} on `rag`, "
            f"{at2['agentic']['mae']} on `agentic`, {at2['synthetic_trace']['mae']} on the synthetic trace, "
            f"{at2['long']['mae']} on long prompts, {at2['kv']['mae']} KV-shaped and {at2['conversations']['mae']:.4f} "
            "on `conversations`.") in mrc
    assert at3["multitenant"]["max_half_to_double"] == at2["multitenant"]["max_half_to_double"]
    page = flattened(doc("PERFORMANCE.md"))
    assert (f"`adaptive`'s curve reads {at2['multitenant']['mae']} on `multitenant` ({at3['multitenant']['mae']} with "
            f"the join at 3 in the same hour) and {at2['rag']['mae']:.4f} on `rag`, and its largest error at ½×, 1× "
            f"and 2× L1 is {at2['multitenant']['max_half_to_double']} on `multitenant` with either join") in page
    b, a = raw_results()[BEFORE]["totals"], raw_results()[AFTER]["totals"]
    cells = {(c["trace"], c["requests"], c["size"]): c for c in raw_results()[AFTER]["cells"]}
    before_cells = {(c["trace"], c["requests"], c["size"]): c for c in raw_results()[BEFORE]["cells"]}
    key = ("multitenant", 1500, "large")
    changelog = flattened(open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8").read())
    assert (f"flagged rows over the first 1,500 requests {b['1500']['adaptive_below_best']} → "
            f"{a['1500']['adaptive_below_best']} (`multitenant` large {before_cells[key]['adaptive_below_best']} → "
            f"{cells[key]['adaptive_below_best']}), of 4,000 requests {b['4000']['adaptive_below_best']} → "
            f"{a['4000']['adaptive_below_best']} (`conversations` rows, where LRU and ARC trade places); below the "
            f"simulated LMCache server {b['1500']['adaptive_below_sim']} → {a['1500']['adaptive_below_sim']} and "
            f"{b['4000']['adaptive_below_sim']} → {a['4000']['adaptive_below_sim']}") in changelog
    assert (f"The `adaptive` miss-ratio curve's error on `multitenant` {at3['multitenant']['mae']} → "
            f"{at2['multitenant']['mae']}.") in changelog
