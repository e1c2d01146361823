"""``python -m benchmarks.regimes``: segments of generated workloads one after another on one L1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import regimes, trace_gen
from benchmarks.trace_sim import lru
from mpcache.eviction.order import ArcOrder


def test_segments_share_no_block_l1_under_lru_reads_the_offline_lru_and_every_phase_change_is_reported(
        monkeypatch) -> None:
    """The same workload twice: an LRU warm with the first segment's blocks finds in the second exactly what a
    cold one finds in that workload alone (no block carried over), offline and in L1 under ``lru``, whose column
    equals the offline LRU's in every row; ``adaptive``'s reported splits and joins are those its order made, and
    ``lru`` and ``arc``, which keep one order throughout, report none."""
    made: list[str] = []
    for name in ("split", "join"):
        real = getattr(ArcOrder, name)

        def spy(self, real=real, name=name) -> None:
            was = self.recency
            real(self)
            if self.recency != was:
                made.append(name)

        monkeypatch.setattr(ArcOrder, name, spy)
    policies = ["lru", "arc", "adaptive"]
    result = regimes.run(["agentic:3", "agentic:3", "scan:2"], 300, "large", policies)  # 2 splits, 2 joins
    first, second = result["rows"][:2]
    alone = trace_gen.KINDS["agentic"](300, 3)
    expected = sum(lru(alone, result["blocks"]).found) / sum(len(request.hashes) for request in alone)

    assert [("agentic:3", 0, 300), ("agentic:3", 300, 600), ("scan:2", 600, 900), ("whole", 0, 900)] == [
        (row["segment"], row["first"], row["end"]) for row in result["rows"]]
    assert expected == first["lru"] == second["lru"] == first["l1_lru"] == second["l1_lru"] > 0
    assert [row["lru"] for row in result["rows"]] == [row["l1_lru"] for row in result["rows"]]
    assert ["split", "join", "split", "join"] == made == [what for _, what in result["phase_changes"]["adaptive"]]
    assert [] == result["phase_changes"]["arc"] == result["phase_changes"]["lru"]  # one order throughout


@pytest.mark.parametrize("args, message", [(["agentic:1", "nosuch:2"], "'nosuch:2': expected KIND:SEED"),
                                           (["--requests", "0", "agentic:1"], "--requests 0: expected at least 1")])
def test_a_bad_argument_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.regimes", *args], capture_output=True, text=True,
                          timeout=60)
    assert 2 == done.returncode and message in done.stderr.strip().splitlines()[-1]
