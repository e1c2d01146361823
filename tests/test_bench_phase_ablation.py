"""``python -m benchmarks.phase_ablation``: its variants against references computed apart, its counting, its patches
put back, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.interrupted import sigterm_once_a_child_starts
from support.performance_docs import doc, flattened, history, raw_results

from benchmarks import phase_ablation, trace_gen
from benchmarks.policy_matrix import TOLERANCE, l1_found
from benchmarks.policy_matrix import sizes as policy_matrix_sizes
from benchmarks.trace_sim import lru, outcome
from mpcache.eviction import order, phases


def test_the_held_recency_phase_is_the_offline_tail_first_lru_and_shipped_is_the_matrix_s_replay() -> None:
    """On ``conversations`` (no store large enough to be refused) the order held in its recency phase finds what
    ``trace_sim``'s LRU releasing a request's chunks tail first does, at every size and length; ``shipped`` is
    ``policy_matrix``'s own replay of the order, unpatched; ``oracle`` the better of the two held phases; each duel
    the replay of the switches it makes from the recency phase held and ARC's phase from the first request."""
    rows = phase_ablation._rows(("conversations", 2, 300, 100))
    whole = trace_gen.KINDS["conversations"](300, 2)
    assert 6 == len(rows) and {300, 100} == {row["requests"] for row in rows}
    for row in rows:
        trace = whole[:row["requests"]]
        assert row["never_split"] == lru(trace, row["blocks"], tail_first=True).hit_ratio
        assert row["shipped"] == outcome(trace, l1_found(trace, row["blocks"], "adaptive")).hit_ratio
        assert row["oracle"] == max(row["never_split"], row["split_at_once"])
        with phase_ablation.patched(phase_ablation.VARIANTS["never_split"][1]):
            recency_found = l1_found(trace, row["blocks"], "adaptive")
        arc_found = phase_ablation.duel_found(trace, row["blocks"], [0])
        assert row["arc_from_first"] == outcome(trace, arc_found).hit_ratio
        for name, (_, arc_first) in phase_ablation.DUELS.items():
            switches = phase_ablation.duel_switches(recency_found, arc_found, arc_first)
            assert row[f"{name}_switches"] == switches
            assert row[name] == outcome(trace, phase_ablation.duel_found(trace, row["blocks"], switches)).hit_ratio
        assert [0] == row["duel_from_arc_switches"][:1] and 0 not in row["duel_from_recency_switches"]
    assert any(row["never_split"] != row["split_at_once"] for row in rows)  # the two phases differ here


@pytest.mark.parametrize("recency, arc, arc_first, switches", [
    ([0] * 30, [1] * 30, False, [9]),  # ARC's lead of n after n requests is over 3 √n once n is 10
    ([1] * 30, [0] * 30, True, [0, 9]),  # the same the other way round, after ARC's phase from the first request
    ([0] * 20 + [1] * 40, [1] * 20 + [0] * 40, False, [9, 29]),  # 10 requests after the lead turns
    ([0] * 60, [1] * 20 + [0] * 40, False, [9]),  # a lead that stops growing is not lost
    ([0, 5, 0, 5, 0, 5], [5, 0, 5, 0, 5, 0], False, []),  # 5 up, 5 down: never 3 deviations from the lowest
    ([0] * 30, [2] * 30, False, [9]),  # whatever a step's size
    ([0] * 10, [0] * 9 + [4], False, [])])  # one step alone is never over 3 deviations
def test_a_duel_switches_once_the_other_phase_leads_by_its_sigmas(recency: list[int], arc: list[int],
                                                                  arc_first: bool, switches: list[int]) -> None:
    """The requests after which a duel changes phase, worked out by hand from each request's finds."""
    assert switches == phase_ablation.duel_switches(recency, arc, arc_first)


def test_a_duel_s_replay_changes_phase_at_its_switches_and_nowhere_else(monkeypatch) -> None:
    """With no switch the replay is the recency phase held (on ``conversations``, where no store is large enough to
    be refused: the offline tail-first LRU); with a split after the first request and a join after request 150 the
    order splits once and joins once, and finds what the replay that only splits finds up to request 150, and differs
    after."""
    calls: list[str] = []
    for name in ("split", "join"):
        original = getattr(order.ArcOrder, name)
        monkeypatch.setattr(order.ArcOrder, name, lambda self, _name=name, _original=original: (
            calls.append(_name), _original(self))[1])
    trace = trace_gen.KINDS["conversations"](400, 2)
    for _, blocks in policy_matrix_sizes(trace):
        calls.clear()
        assert outcome(trace, phase_ablation.duel_found(trace, blocks, [])).found == lru(trace, blocks,
                                                                                         tail_first=True).found
        assert [] == calls
        split = phase_ablation.duel_found(trace, blocks, [0])
        assert ["split"] == calls
        joined = phase_ablation.duel_found(trace, blocks, [0, 150])
        assert ["split", "split", "join"] == calls
        assert split[:151] == joined[:151] and split != joined


def test_a_duel_asks_for_at_least_one_deviation() -> None:
    """Below one standard deviation a single request could change the phase twice at once."""
    with pytest.raises(ValueError, match="sigmas 0.5: expected at least 1"):
        phase_ablation.duel_switches([0, 1], [1, 0], True, sigmas=0.5)


def test_the_patches_are_put_back_however_the_block_ends() -> None:
    """A variant's patches hold inside the block and are undone after it, also when it raises."""
    _, patches = phase_ablation.VARIANTS["never_join"]
    before = (phases.JOIN_SIGMAS, phases.JOIN_FALL_SIGMAS)
    with pytest.raises(RuntimeError), phase_ablation.patched(patches):
        assert (float("inf"), float("inf")) == (phases.JOIN_SIGMAS, phases.JOIN_FALL_SIGMAS)
        raise RuntimeError("a replay failed")
    assert before == (phases.JOIN_SIGMAS, phases.JOIN_FALL_SIGMAS)


def test_every_variant_s_patches_change_what_the_order_finds() -> None:
    """Each variant's patches reach the L1 the replay builds: on two short traces every variant finds a different
    prefix from the shipped order's in some row (a patch that missed its target would read as shipped, and its rule
    as one that flags nothing)."""
    rows = phase_ablation._rows(("agentic", 1, 400, 200)) + phase_ablation._rows(("loop", 1, 400, 200))
    assert [] == [name for name in phase_ablation.VARIANTS
                  if name != "shipped" and all(row[name] == row["shipped"] for row in rows)]


def test_the_summary_counts_flags_as_the_policy_matrix_does() -> None:
    """Per variant: the sum of its hit ratios, the rows more than the tolerance below the offline LRU or ARC, and
    those below ``lmcache_sim``, per length (rows made up here: each variant's values its own, each chosen to fall
    on one side of a bar)."""
    base = {"trace": "t", "seed": 1, "size": "small", "blocks": 10, "lru": 0.50, "arc": 0.40, "lmcache_sim": 0.45}
    names = (*phase_ablation.VARIANTS, "oracle", *phase_ablation.DUELS)
    below_both = {name: 0.40 + index / 1000 for index, name in enumerate(names)}  # under 0.45: both bars
    rows = [{**base, "requests": 40, **below_both},
            {**base, "requests": 40, **dict.fromkeys(names, 0.50 - TOLERANCE / 5)},  # within the tolerance
            {**base, "requests": 20, **dict.fromkeys(names, 0.46)},  # below LRU only
            {**base, "requests": 20, "shipped": 0.44, **{name: 0.47 for name in names if name != "shipped"}}]
    counted = phase_ablation.summary(rows, 40, 20)
    for name in names:
        others = 0.44 + 0.46 if name == "shipped" else 0.47 + 0.46
        assert {"hit_ratio_sum": round(below_both[name] + 0.50 - TOLERANCE / 5 + others, 3),
                "below_lru_or_arc_40": 1, "below_lmcache_sim_40": 1, "below_lru_or_arc_20": 2,
                "below_lmcache_sim_20": 1 if name == "shipped" else 0} == counted[name], name
    table = phase_ablation.render(counted, 40, 20).splitlines()
    assert len(table) == 2 + len(phase_ablation.VARIANTS) + 1 + len(phase_ablation.DUELS)
    assert table[-3].startswith("| `oracle` | per row, the better of never_split and split_at_once |")
    assert table[-1].startswith("| `duel_from_arc` | the phase chosen online by a duel of the two held phases, from "
                                "ARC's phase |")


def test_a_small_run_prints_its_summary_and_rows_as_json() -> None:
    """One kind, one seed, short lengths: every variant counted over the 6 rows, each row with every variant."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.phase_ablation", "--seeds", "3", "3", "--kinds", "loop",
                           "--requests", "200", "--first", "80", "--jobs", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stderr
    result = json.loads(done.stdout)
    assert [*phase_ablation.VARIANTS, "oracle", *phase_ablation.DUELS] == list(result["summary"])
    assert 6 == len(result["rows"]) and all(set(phase_ablation.VARIANTS) <= set(row) for row in result["rows"])
    assert "[phase_ablation] loop seed 3 done (1/1)" == done.stderr.strip()


@pytest.mark.parametrize("args, message", [
    (["--seeds", "5", "3"], "--seeds 5 3: the last seed is below the first"),
    (["--seeds", "-1", "3"], "argument --seeds: -1: expected 0 or more"),
    (["--first", "4000"], "--first 4000: expected fewer than --requests 4000"),
    (["--jobs", "0"], "argument --jobs: expected a whole number >= 1, got '0'"),
    (["--requests", "abc"], "argument --requests: expected a whole number >= 1, got 'abc'"),
    (["--requests", "1000001"], "--requests 1000001: expected at most 1,000,000"),
    (["--kinds", "nosuch"], "argument --kinds: invalid choice: 'nosuch'")])
def test_a_bad_argument_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.phase_ablation", *args], capture_output=True, text=True,
                          timeout=60)
    assert 2 == done.returncode and message in done.stderr.strip().splitlines()[-1], done.stderr


def test_sigterm_ends_the_workers(tmp_path) -> None:
    """SIGTERM while the workers replay: status 130, one line, no worker left running or printing a traceback."""
    status, stderr, alive = sigterm_once_a_child_starts(
        [sys.executable, "-m", "benchmarks.phase_ablation", "--kinds", "rag", "conversations", "--jobs", "2"],
        tmp_path, "the pool's workers to start")
    assert (130, "[phase_ablation] interrupted: its workers are gone", [], []) == (
        status, stderr[-1], alive, [line for line in stderr[:-1] if " done (" not in line])


def test_history_s_table_and_numbers_are_the_kept_run_s_raw_output() -> None:
    """benchmarks/HISTORY.md's table of the run kept as PERFORMANCE.json's ``phase_ablation`` is rendered from its
    summary, the summary is counted from its rows, and the rows the prose names read what it says."""
    kept = raw_results()["phase_ablation"]
    rows = kept["rows"]
    assert 672 == len(rows) and kept["summary"] == phase_ablation.summary(rows, 4000, 1500)
    notes = history()
    assert phase_ablation.render(kept["summary"], 4000, 1500) in notes
    prose = flattened(notes)

    def row(trace: str, seed: int, requests: int, size: str) -> dict:
        [found] = [r for r in rows
                   if (r["trace"], r["seed"], r["requests"], r["size"]) == (trace, seed, requests, size)]
        return found

    [flagged] = [r for r in rows if phase_ablation.flags(r, "oracle")[0]]
    assert (flagged["trace"], flagged["seed"], flagged["requests"], flagged["size"]) == ("multitenant", 15, 1500,
                                                                                         "middle")
    assert (f"seed 15: {flagged['oracle']:.4f} against ARC's {flagged['arc']:.4f}, where the shipped order reads "
            f"{flagged['shipped']:.4f} and is not flagged") in prose
    assert not phase_ablation.flags(flagged, "shipped")[0]
    seed_1 = row("conversations", 1, 4000, "middle")
    assert (f"the recency phase held reads {seed_1['never_split']:.4f}, ARC's phase from the first ghost hit "
            f"{seed_1['split_at_once']:.4f}, and the shipped order") in prose
    assert f"never joins, {seed_1['shipped']:.4f}." in prose
    page = flattened(doc("PERFORMANCE.md"))
    oracle, lengths = kept["summary"]["oracle"], {r["requests"] for r in rows}
    per_length = len(rows) // len(lengths)
    assert (f"flagged in {oracle['below_lru_or_arc_4000']} of the {per_length} rows of 4,000 requests and "
            f"{oracle['below_lru_or_arc_1500']} of the {per_length} of 1,500") in page
    def flagged(name: str, requests: int) -> set[tuple[str, int, str]]:
        return {(r["trace"], r["seed"], r["size"]) for r in rows
                if r["requests"] == requests and phase_ablation.flags(r, name)[0]}

    rules = ("gate_never_refuses", "no_chance_trial", "no_first_sight", "no_second_sight_admission")
    assert all(flagged(name, 4000) == flagged("shipped", 4000) for name in rules)  # "the same rows of 4,000"
    assert [set(), set(), set(), {("agentic", 13, "large")}] == [flagged(name, 1500) ^ flagged("shipped", 1500)
                                                                 for name in rules]  # "the same of 1,500 but one"
    assert "unflags (`agentic` large, seed 13)" in prose


def test_the_duels_prose_is_the_kept_run_s() -> None:
    """What benchmarks/HISTORY.md and docs/PERFORMANCE.md say of the duels is counted from the kept run's rows."""
    kept = raw_results()["phase_ablation"]
    rows, counted = kept["rows"], kept["summary"]
    prose = flattened(history())
    page = flattened(doc("PERFORMANCE.md"))
    shipped, from_arc, from_recency = counted["shipped"], counted["duel_from_arc"], counted["duel_from_recency"]

    def flagged(name: str, requests: int) -> list[dict]:
        return [r for r in rows if r["requests"] == requests and phase_ablation.flags(r, name)[0]]

    assert (f"`duel_from_arc` reads {from_arc['hit_ratio_sum'] - shipped['hit_ratio_sum']:.3f} more than the shipped "
            f"order in sum, and is below `lmcache_sim` in {from_arc['below_lmcache_sim_4000']} rows of 4,000 requests "
            f"against {shipped['below_lmcache_sim_4000']}.") in prose
    assert (f"is flagged in {from_recency['below_lru_or_arc_4000']} rows of 4,000 requests and "
            f"{from_recency['below_lru_or_arc_1500']} of 1,500.") in prose
    assert from_arc["below_lru_or_arc_4000"] == shipped["below_lru_or_arc_4000"] == 3
    assert [("conversations", 2, "middle"), ("conversations", 10, "middle"), ("multitenant", 9, "large")] == [
        (r["trace"], r["seed"], r["size"]) for r in flagged("duel_from_arc", 4000)]
    c2, c10, m9 = flagged("duel_from_arc", 4000)
    assert (f"seed 2 ({c2['duel_from_arc']:.4f} against ARC's {c2['arc']:.4f}) and seed 10 "
            f"({c10['duel_from_arc']:.4f} against {c10['arc']:.4f}), and `multitenant` large seed 9 "
            f"({m9['duel_from_arc']:.4f} against the LRU's {m9['lru']:.4f})") in prose
    early = flagged("duel_from_arc", 1500)
    large = [r for r in early if (r["trace"], r["size"]) == ("multitenant", "large")]
    joins = [r["duel_from_arc_switches"][1] for r in rows
             if (r["trace"], r["requests"], r["size"]) == ("multitenant", 1500, "large")]
    assert (f"is flagged in {len(early)} rows against {shipped['below_lru_or_arc_1500']}, {len(large)} of them "
            f"`multitenant` large, where it joins after request {min(joins)} to {max(joins):,}") in prose
    losses = {kind: sum(r["duel_from_recency"] - r["shipped"] for r in rows if r["trace"] == kind)
              for kind in ("rag", "scan", "loop", "production", "multitenant")}
    assert "(0.26 to 0.50 in sum each)" in prose and all(-0.50 <= loss <= -0.26 for loss in losses.values())
    assert (f"than 3 standard deviations is flagged in {from_arc['below_lru_or_arc_4000']} rows of 4,000 requests "
            f"and {from_arc['below_lru_or_arc_1500']} of 1,500.") in page
