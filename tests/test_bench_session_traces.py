"""``benchmarks.session_traces``: coding-agent sessions (kv-cache-tester's files) as one Mooncake stream."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
from support.performance_docs import doc, flattened

from benchmarks import session_traces
from benchmarks.trace_sim import load

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
