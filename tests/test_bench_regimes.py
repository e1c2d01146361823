"""``python -m benchmarks.regimes``: segments of generated workloads one after another on one L1."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import regimes, trace_gen
from benchmarks.trace_sim import lru


def test_segments_share_no_block_and_l1_under_lru_reads_the_offline_lru_in_each() -> None:
    """The same workload twice: an LRU warm with the first segment's blocks finds in the second exactly what a
    cold one finds in that workload alone (no block carried over), offline and in L1 under ``lru``; the whole row
    covers every request; ``adaptive``'s phase changes alternate, a split first, in request order."""
    result = regimes.run(["agentic:3", "agentic:3", "scan:2"], 300, "small", ["lru", "adaptive"])
    first, second, third, whole = result["rows"]
    alone = trace_gen.KINDS["agentic"](300, 3)
    cold = lru(alone, result["blocks"])
    expected = sum(cold.found) / sum(len(request.hashes) for request in alone)

    assert [("agentic:3", 0, 300), ("agentic:3", 300, 600), ("scan:2", 600, 900), ("whole", 0, 900)] == [
        (row["segment"], row["first"], row["end"]) for row in result["rows"]]
    assert expected == first["lru"] == second["lru"] == first["l1_lru"] == second["l1_lru"] > 0
    assert [row["lru"] for row in result["rows"]] == [row["l1_lru"] for row in result["rows"]]
    changes = result["phase_changes"]["adaptive"]
    assert changes and [index for index, _ in changes] == sorted(index for index, _ in changes)
    assert [what for what, _ in zip(["split", "join"] * len(changes), changes)] == [what for _, what in changes]
    assert [] == result["phase_changes"]["lru"]
    assert min(row["l1_lru"] for row in (first, second, third)) <= whole["l1_lru"] <= max(
        row["l1_lru"] for row in (first, second, third))


def test_a_segment_that_names_no_kind_is_one_line_and_exit_status_2() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.regimes", "agentic:1", "nosuch:2"], capture_output=True,
                          text=True, timeout=60)
    assert 2 == done.returncode and "'nosuch:2': expected KIND:SEED" in done.stderr.strip().splitlines()[-1]
