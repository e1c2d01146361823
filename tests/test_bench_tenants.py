"""``python -m benchmarks.tenants``: generated workloads as tenants sharing one L1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import tenants, trace_gen
from benchmarks.regimes import SEGMENT_SHIFT
from mpcache.cache.l1 import L1Manager


def test_tenants_interleave_their_own_requests_by_weight_and_l1_under_lru_reads_the_offline_lru(monkeypatch) -> None:
    """Each tenant's requests are its ``trace_gen`` trace in order, its blocks its own; the draw follows the weights
    (1:3 of 4,000: within 5 % of 1,000); every request reaches L1 under its own tenant's salt (the one-tenant column
    under none), and L1 under ``lru`` equals the offline LRU (another implementation) for every tenant and the
    whole."""
    trace, owners = tenants.tenants(["conversations:1:1", "scan:2:3"], 4000)
    assert len(trace) == len(owners) == 4000
    assert abs(owners.count(0) - 1000) < 50
    for index, (kind, seed) in enumerate([("conversations", 1), ("scan", 2)]):
        shift = (index + 1) << SEGMENT_SHIFT
        own = [request.hashes for request, owner in zip(trace, owners) if owner == index]
        assert own == [[block + shift for block in request.hashes]
                       for request in trace_gen.KINDS[kind](owners.count(index), seed)]

    salts: dict[str, list[str]] = {}
    lookup = L1Manager.lock_prefix

    def spy(self, model, salt, hashes, *args, **kwargs):
        salts.setdefault(self.policy, []).append(salt)
        return lookup(self, model, salt, hashes, *args, **kwargs)

    monkeypatch.setattr(L1Manager, "lock_prefix", spy)
    result = tenants.run(["conversations:1:1", "scan:2:3"], 1500, "small", ["lru", "adaptive"])
    _, owners = tenants.tenants(["conversations:1:1", "scan:2:3"], 1500)
    assert ["conversations:1:1", "scan:2:3", "whole"] == [row["tenant"] for row in result["rows"]]
    assert [row["lru"] for row in result["rows"]] == [row["l1_lru"] for row in result["rows"]]
    assert salts["lru"] == [f"tenant-{owner}" for owner in owners]
    assert salts["adaptive"] == [f"tenant-{owner}" for owner in owners] + [""] * 1500  # then as one tenant
    assert result["rows"][-1]["l1_adaptive"] > result["rows"][-1]["lru"]


@pytest.mark.parametrize("args, message", [
    (["agentic:1:1", "nosuch:2:1"], "'nosuch:2:1': expected KIND:SEED:WEIGHT"),
    (["agentic:1:1", "rag:2:0"], "'rag:2:0': expected KIND:SEED:WEIGHT (WEIGHT at least 1)"),
    (["agentic:1:1", "rag:2:1:9"], "'rag:2:1:9': expected KIND:SEED:WEIGHT"),
    (["agentic:1:1", "rag:²:1"], "'rag:²:1': expected KIND:SEED:WEIGHT"),
    (["agentic:1:1"], "expected two tenants or more"),
    (["--requests", "0", "agentic:1:1", "rag:1:1"], "--requests 0: expected at least 1")])
def test_a_bad_argument_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.tenants", *args], capture_output=True, text=True,
                          timeout=60)
    assert 2 == done.returncode and message in done.stderr.strip().splitlines()[-1]
