"""``benchmarks.session_traces``: coding-agent sessions (kv-cache-tester's files) as one Mooncake stream."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
from support.performance_docs import NUMBER_WORDS, doc, flattened, raw_results

from benchmarks import session_traces
from benchmarks.trace_sim import load
from mpcache.eviction import phases as order_phases

SMALL = 64  # tokens of the sessions' small blocks: 8 to a 512-token block


def _session(folder, name: str, requests: list, block_size: int = SMALL) -> str:
    path = folder / f"trace_{name}.json"
    path.write_text(json.dumps({"id": name, "block_size": block_size, "requests": requests}))
    return str(path)


def test_a_session_s_prompts_become_whole_512_token_blocks_each_standing_for_its_prefix(tmp_path):
    """Two turns of one session: the second repeats the first's 16 small blocks and adds 9 (one whole block and
    one small block over): it shares the first's two blocks, gets one new one, and its partial block is left out.
    A prompt of 7 small blocks has no whole block."""
    first = list(range(1, 17))
    second = first + list(range(17, 26))
    path = _session(tmp_path, "a", [
        {"t": 0.0, "type": "n", "model": "m", "in": 16 * SMALL, "out": 5, "hash_ids": first},
        {"t": 2.5, "type": "n", "model": "m", "in": 25 * SMALL, "out": 6, "hash_ids": second},
        {"t": 3.0, "type": "n", "model": "m", "in": 7 * SMALL, "out": 1, "hash_ids": first[:7]}])
    records = list(session_traces.stream([path], gap_s=10.0, seed=1))
    assert [r["hash_ids"] for r in records] == [[0, 1], [0, 1, 2], []]
    assert [(r["input_length"], r["output_length"]) for r in records] == [(1024, 5), (1600, 6), (448, 1)]
    start = random.Random(1)
    start.shuffle([path])
    begin = round(start.expovariate(1 / 10.0) * 1000)
    assert [r["timestamp"] for r in records] == [begin, begin + 2500, begin + 3000]


def test_the_same_small_blocks_in_another_session_model_or_after_another_block_are_another_block(tmp_path):
    """Hashes are local to a session, so two sessions share no block; nor do two models of one session; and a
    block after a different block is a different prefix."""
    eight = list(range(1, 9))
    other = list(range(101, 109))
    a = _session(tmp_path, "a", [{"t": 0, "model": "m", "hash_ids": eight},
                                 {"t": 1, "model": "small", "hash_ids": eight},
                                 {"t": 2, "model": "m", "hash_ids": other + eight}])
    b = _session(tmp_path, "b", [{"t": 0, "model": "m", "hash_ids": eight}])
    records = list(session_traces.stream([a, b], gap_s=1.0, seed=3))
    ids = [tuple(r["hash_ids"]) for r in records]
    assert len(ids) == 4
    blocks = [block for request in ids for block in request]
    assert len(blocks) == len(set(blocks)) == 5  # 1 + 1 + 2 + 1 blocks, none shared


def test_a_sub_agent_s_requests_are_timed_from_the_request_that_started_it(tmp_path):
    path = _session(tmp_path, "a", [
        {"t": 0.0, "type": "n", "model": "m", "hash_ids": list(range(8))},
        {"t": 10.0, "type": "subagent", "agent_id": "x", "requests": [
            {"t": 1.0, "model": "m", "hash_ids": list(range(50, 58))},
            {"t": 4.0, "model": "m", "hash_ids": list(range(50, 66))}]},
        {"t": 12.0, "type": "n", "model": "m", "hash_ids": list(range(16))}])
    records = list(session_traces.stream([path], gap_s=1.0, seed=1))
    begin = records[0]["timestamp"]
    assert [(r["timestamp"] - begin, len(r["hash_ids"])) for r in records] == [
        (0, 1), (11000, 1), (12000, 2), (14000, 2)]
    assert records[2]["hash_ids"][0] == records[0]["hash_ids"][0]  # the session's own prefix again
    assert records[3]["hash_ids"][0] == records[1]["hash_ids"][0]  # the sub-agent's


def test_the_command_writes_a_trace_the_benchmarks_read_in_time_order_in_a_new_0600_file(tmp_path):
    source = tmp_path / "sessions"
    source.mkdir()
    for name in ("a", "b", "c"):
        _session(source, name, [{"t": float(t), "model": "m", "hash_ids": list(range(8 * (t + 1)))}
                                for t in range(4)])
    (source / "README.md").write_text("not a session")
    out = tmp_path / "stream.jsonl"
    assert session_traces.main([str(source), str(out), "--gap-s", "0.5", "--seed", "2"]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12 and [r["timestamp"] for r in lines] == sorted(r["timestamp"] for r in lines)
    requests = load(str(out))
    assert sorted(len(r.hashes) for r in requests) == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    with pytest.raises(SystemExit) as refused:
        session_traces.main([str(source), str(out)])
    assert refused.value.code == 2 and out.read_text().count("\n") == 12  # an existing file is refused, kept


@pytest.mark.parametrize(("content", "says"), [
    ("{", "not a JSON document"),
    (json.dumps([1]), "not a session"),
    (json.dumps({"block_size": 48, "requests": []}), "block_size must divide 512"),
    (json.dumps({"block_size": 64, "requests": [{"t": -1, "hash_ids": []}]}), "time t must be"),
    (json.dumps({"block_size": 64, "requests": [{"t": 0, "hash_ids": ["x"]}]}), "hash_ids must be"),
])
def test_an_unreadable_session_is_one_clear_error_and_leaves_no_file(tmp_path, capsys, content, says):
    source = tmp_path / "sessions"
    source.mkdir()
    (source / "trace_bad.json").write_text(content)
    out = tmp_path / "stream.jsonl"
    with pytest.raises(SystemExit) as failed:
        session_traces.main([str(source), str(out)])
    assert failed.value.code == 2
    err = capsys.readouterr().err
    assert "trace_bad.json" in err and says in err
    assert not out.exists() and os.listdir(tmp_path) == ["sessions"]


def test_a_folder_without_sessions_and_a_bad_gap_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        session_traces.main([str(tmp_path), str(tmp_path / "out.jsonl")])
    assert "no trace_*.json session file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session_traces.main([str(tmp_path), str(tmp_path / "out.jsonl"), "--gap-s", "0"])
    assert "expected more than 0" in capsys.readouterr().err


def test_the_benchmarks_page_states_the_default_gap_the_code_uses():
    page = flattened(doc("BENCHMARKS.md"))
    assert f"`--gap-s` seconds apart on average (default {session_traces.GAP_S:g})" in page


SECTION = "### Held-out checks: the head of Mooncake's arXiv trace, and real coding-agent sessions"


def test_performance_md_held_out_checks_are_the_kept_runs():
    """docs/PERFORMANCE.md's section on the arXiv trace's head and the coding-agent sessions: its two tables are
    ``trace.render`` of the kept run and the kept ``policy_matrix`` rows, and every number its prose states is
    computed from PERFORMANCE.json's ``held_out_sessions_and_arxiv_head``."""
    from benchmarks import trace
    from benchmarks.policy_matrix import TOLERANCE

    kept = raw_results()["held_out_sessions_and_arxiv_head"]
    page = doc("PERFORMANCE.md")
    section = page[page.index(SECTION):page.index("\n### ", page.index(SECTION) + 1)]
    prose = flattened(section)
    head = kept["arxiv_head"]["trace"]
    for line in trace.render(head).splitlines():
        assert line in section, line
    ours, sizes = head["mpcache_adaptive_over_offline_lru"], head["sizes"]
    runs = {name: [run["hit_ratio"] for run in size["lmcache_server"]["runs"]] for name, size in sizes.items()}
    found = {name: size["mpcache_adaptive"]["hit_ratio"] for name, size in sizes.items()}
    middle = {row["size"]: row for row in kept["arxiv_head"]["policy_matrix"]}["middle"]
    source = kept["arxiv_head"]["source"]
    for fact in (f"({source['repository']}, commit {source['commit'][:8]}; {source['bytes']:,} bytes, sha256 "
                 f"{source['sha256'][:8]}…; timestamps {source['first_timestamp_ms']}–"
                 f"{source['last_timestamp_ms']:,} ms)",
                 f"{ours['small']}× / {ours['middle']}× / {ours['large']}× its prefill at the small / middle / large "
                 f"size (Belady's MIN {head['belady_over_offline_lru']['small']}× at the small)",
                 f"LMCache's server read {runs['small'][0]:.4f} in each of its {len(runs['small'])} runs at the small "
                 f"size and {min(runs['large']):.4f}–{max(runs['large']):.4f} at the large one, below `adaptive` in "
                 "all",
                 f"at the middle size {min(runs['middle']):.4f}–{max(runs['middle']):.4f}, above `adaptive`'s "
                 f"{found['middle']:.4f} in {len(runs['middle'])} of its {len(runs['middle'])} runs, by up to "
                 f"{max(runs['middle']) - found['middle']:.4f} (in process, `lmcache_sim` {middle['lmcache_sim']:.4f} "
                 f"and W-TinyLFU {middle['wtinylfu']:.4f} there)"):
        assert fact in prose, fact
    after = {row["size"]: row["l1_adaptive"] for row in kept["arxiv_head"]["policy_matrix_resplit_cap"]}
    assert after == {row["size"]: row["l1_adaptive"] for row in kept["arxiv_head"]["policy_matrix"]}
    assert "the arXiv trace's head still is (the change moves none of its rows)" in prose
    slice_start = raw_results()["trace_public_arxiv_slice"]["source"]["first_timestamp_ms"]
    assert f"the slice of the section below is from its {slice_start // 60_000 + 1}th minute" in prose
    assert set(runs["small"]) == {runs["small"][0]} and min(runs["middle"]) > found["middle"]
    assert all(run < found[name] for name in ("small", "large") for run in runs[name])

    sessions = kept["sessions"]
    rows, now = sessions["policy_matrix"], sessions["policy_matrix_resplit_cap"]
    now_of = {(r["trace"], r["requests"], r["size"]): r["l1_adaptive"] for r in now}
    for row in (r for r in rows if r["requests"] == 4000):
        gap, seed = (sessions["traces"][row["trace"]][key] for key in ("gap_s", "seed"))
        found = now_of[(row["trace"], 4000, row["size"])]
        line = (f"| {row['trace']} ({gap} s, {seed}) | {row['size']} | {row['blocks']:,} | {row['lru']:.4f} | "
                f"{row['arc']:.4f} | {row['lmcache_sim']:.4f} | {row['l1_adaptive']:.4f} | {found:.4f} | "
                f"{found / row['lru']:.3f}× |")
        assert line in section, line
    source = sessions["source"]
    assert (f"the {source['sessions']} Claude Code sessions of WEKA's public kv-cache-tester (commit "
            f"{source['commit'][:8]}, `traces/trace_*.json`; {source['sessions_listed']} listed, "
            f"{source['sessions_listed'] - source['sessions']} too large for the snapshot fetched), "
            f"{source['requests']:,} requests of {source['blocks_per_request_tenth_to_ninetieth_percentile'][0]}–"
            f"{source['blocks_per_request_tenth_to_ninetieth_percentile'][1]} blocks (a tenth to nine tenths; median "
            f"{source['blocks_per_request_median']:g}), as {NUMBER_WORDS[len(sessions['traces'])]} streams") in prose

    def small(kept_rows: list[dict], length: int) -> str:
        ratios = [r["l1_adaptive"] / r["lru"] for r in kept_rows if r["requests"] == length and r["size"] == "small"]
        return f"{min(ratios):.3f}–{max(ratios):.3f}×"

    def flagged(kept_rows: list[dict], length: int) -> list[dict]:
        return [r for r in kept_rows
                if r["requests"] == length and r["l1_adaptive"] < max(r["lru"], r["arc"]) - TOLERANCE]

    def below(kept_rows: list[dict], length: int) -> list[float]:
        return [r["lmcache_sim"] - r["l1_adaptive"] for r in kept_rows if r["requests"] == length
                and r["l1_adaptive"] < r["lmcache_sim"]]

    before = flagged(rows, 4000)
    assert {r["size"] for r in before} == {"large"} and not flagged(rows, 1500)
    assert {sessions["traces"][r["trace"]]["gap_s"] for r in before} == {30, 60}
    worst = max(max(r["lru"], r["arc"]) - r["l1_adaptive"] for r in before)
    assert (f"`adaptive` saved {small(rows, 4000)} the offline LRU's prefill at the small size ({small(rows, 1500)} "
            f"over the first 1,500 requests), and was more than {TOLERANCE} below the offline LRU in {len(before)} of "
            f"the 24 rows, all at the large size with sessions 30 and 60 s apart, by up to {worst:.4f} (none over the "
            "first 1,500 requests)") in prose
    changes = sessions["large_phase_changes"]
    assert set(changes) == {r["trace"] for r in before}
    gaps = [later[0] - earlier[0] for one in changes.values() for earlier, later in zip(one["phase_changes"],
                                                                                       one["phase_changes"][1:])
            if earlier[1] == "join"]
    splits = [f"{at:,}" for at, what in changes["cc_g30_s1"]["phase_changes"] if what == "split"]
    assert (f"split again within {min(gaps)} to {max(gaps)} requests (`cc_g30_s1`: splits in requests "
            f"{', '.join(splits[:-1])} and {splits[-1]}, each undone)") in prose
    assert changes["cc_g30_s1"]["phase_changes"][-1][1] == "join"
    moved = [now_of[(r["trace"], r["requests"], r["size"])] - r["l1_adaptive"] for r in rows]
    assert not flagged(now, 4000) and not flagged(now, 1500) and len(now) == len(rows) == 48
    assert (f"counts at most {order_phases.RESPLIT_HITS_PER_ACCESS} of an access's ghost hits "
            f"(`RESPLIT_HITS_PER_ACCESS`; benchmarks/HISTORY.md, *Real coding-agent sessions*): {small(now, 4000)} at "
            f"the small size ({small(now, 1500)}), none of the 48 rows more than {TOLERANCE} below the offline LRU or "
            f"ARC, the 48 rows' hit ratios {sum(moved):+.4f} in sum (from {min(moved):+.4f} to {max(moved):+.4f} a "
            "row)").replace("(from -", "(from −") in prose
    spread, capped = raw_results()["seed_spread"]["totals"], raw_results()["seed_spread_resplit_cap"]["totals"]
    assert (f"{capped['4000']['adaptive_below_best']} of 1,344 rows of 4,000 requests are flagged, as before, and "
            f"{capped['1500']['adaptive_below_best']} of 1,500 ({spread['1500']['adaptive_below_best']}), "
            f"{capped['4000']['adaptive_below_sim']} and {capped['1500']['adaptive_below_sim']} below the simulated "
            f"server ({spread['4000']['adaptive_below_sim']} and {spread['1500']['adaptive_below_sim']})") in prose
    assert capped["4000"]["adaptive_below_best"] == spread["4000"]["adaptive_below_best"]
    assert (f"With the split after a join counting at most {order_phases.RESPLIT_HITS_PER_ACCESS} of an access's "
            "ghost hits (this round; PERFORMANCE.json's `seed_spread_resplit_cap`), the 64 seeds read "
            f"{capped['4000']['adaptive_below_best']} and {capped['1500']['adaptive_below_best']} flagged, "
            f"{capped['4000']['adaptive_below_sim']} and {capped['1500']['adaptive_below_sim']} below the simulated "
            "server.") in flattened(page)
    for length, words in ((4000, "in {} rows before, by up to {}"), (1500, "and in {} of the first 1,500 requests', "
                                                                           "by up to {}")):
        assert words.format(len(below(rows, length)), f"{max(below(rows, length)):.4f}") in prose
    assert (f"now in {len(below(now, 4000))} and {len(below(now, 1500))}, by as much" in prose
            and max(below(now, 4000)) == max(below(rows, 4000)) and max(below(now, 1500)) == max(below(rows, 1500)))
    server = sessions["server"]
    by_size = {r["size"]: r["l1_adaptive"] for r in rows if r["trace"] == server["trace"] and r["requests"] == 4000}
    small_runs, middle, large = (server["sizes"][name]["lmcache_server_runs"] for name in ("small", "middle", "large"))
    assert min(small_runs) > by_size["small"] and max(middle) < by_size["middle"] and max(large) < by_size["large"]
    assert (f"read {min(small_runs):.4f}–{max(small_runs):.4f} at the small size, above `adaptive`'s "
            f"{by_size['small']:.4f} "
            f"({now_of[(server['trace'], 4000, 'small')]:.4f} now), {min(middle):.4f}–{max(middle):.4f} at the middle "
            f"size and {min(large):.4f}–{max(large):.4f} at the large one, below it") in prose
    assert min(small_runs) > now_of[(server["trace"], 4000, "small")]
    assert all(server["sizes"][name]["offline_lru"] == round(next(
        r["lru"] for r in rows if r["trace"] == server["trace"] and r["requests"] == 4000 and r["size"] == name), 4)
        for name in ("small", "middle", "large"))
