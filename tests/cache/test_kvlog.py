"""The KV event log's bounds: a full log overwrites its oldest records; token lists are held within the budget,
a run of records sharing one list counts it once (and passes it on when its first record goes), and a list
larger than the whole budget is not kept."""

from __future__ import annotations

from mpcache.cache.kvlog import REMOVED, STORED, Detail, KVEventLog
from mpcache.contract.keys import ChunkKey


def _detail(tokens: bytes, first: int, n: int) -> Detail:
    """A store of ``n`` chunks from chunk ``first`` (one group), keys 100 + chunk index."""
    return Detail(tokens, 2, first, range(n), [0] * n, [100 + first + c for c in range(n)], 1, None, 0)


def test_a_full_log_overwrites_its_oldest_records():
    log = KVEventLog(4)
    log.stored("m", "", [1, 2, 3], None)
    log.removed([ChunkKey("m", "s", 1)])
    log.removed([ChunkKey("m", "", 2)])
    assert (log.first, log.last, log.dropped) == (2, 5, 1)
    assert [(r.seq, r.kind, r.salt, r.key) for r in map(log.record, range(2, 6))] == [
        (2, STORED, "", 2), (3, STORED, "", 3), (4, REMOVED, "s", 1), (5, REMOVED, "", 2)]


def test_token_lists_stay_within_the_budget_and_a_run_counts_its_list_once():
    log = KVEventLog(100, token_budget=3 * 32)
    lists = [bytes([n]) * 32 for n in range(4)]  # 4 tokens (2 chunks of 2) each
    for n, tokens in enumerate(lists[:3]):
        log.stored("m", "", [10 * n, 10 * n + 1], _detail(tokens, 0, 2))
    assert (log.token_bytes, log.first) == (96, 1)
    assert log.record(2).tokens is lists[0] and log.record(2).chunk == 1
    log.stored("m", "", [30, 31], _detail(lists[3], 0, 2))  # a fourth list: the first run goes
    assert (log.token_bytes, log.first) == (96, 3)
    assert [log.record(seq).key for seq in range(3, 9)] == [10, 11, 20, 21, 30, 31]


def test_a_run_whose_first_record_is_overwritten_still_counts_its_list():
    log = KVEventLog(3, token_budget=1000)
    tokens = bytes(48)
    log.stored("m", "", [1, 2, 3], _detail(tokens, 5, 3))
    log.removed([ChunkKey("m", "", 9)])  # overwrites the run's first record: the second now accounts for the list
    assert (log.first, log.token_bytes) == (2, 48)
    assert log.record(2).tokens is tokens and log.record(2).chunk == 6
    log.removed([ChunkKey("m", "", 8)])
    log.removed([ChunkKey("m", "", 7)])  # the run's last record goes: its list is no longer held
    assert (log.first, log.token_bytes) == (4, 0)


def test_a_list_larger_than_the_budget_is_not_kept():
    log = KVEventLog(10, token_budget=16)
    tokens = bytes(32)
    log.stored("m", "", [1], _detail(tokens, 0, 1))
    log.stored("m", "", [2], _detail(tokens, 1, 1))  # the same list again: still not kept
    assert [(r.kind, r.key, r.tokens) for r in map(log.record, (1, 2))] == [(STORED, 1, None), (STORED, 2, None)]
    assert log.token_bytes == 0


def test_records_are_made_per_chunk_from_one_row_per_call():
    """A commit's row gives a record per chunk: its own sequence number, its key, its parent (the group's key
    of the chunk before, the keys before the store for its first chunk) and its chunk's place in the tokens;
    a reader may start inside a row, and a row outlives its overwritten first records."""
    log = KVEventLog(5)
    tokens = bytes(8 * 2 * 8)  # 8 chunks of 2 tokens
    # A store of chunks 4..6 in two groups (keys chunk-major, group-minor), committed as one run per group.
    keys = [40, 41, 50, 51, 60, 61]
    whole = Detail(tokens, 2, 4, [0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1], keys, 2, [30, 31], 0)
    log.stored("m", "s", [40, 50, 60], whole)
    log.stored("m", "s", [41, 51, 61], whole._replace(at=3))
    assert log.token_bytes == len(tokens)  # the runs share one list
    assert [(r.seq, r.key, r.parent, r.chunk, r.salt) for r in log.records()] == [
        (2, 50, 40, 5, "s"), (3, 60, 50, 6, "s"), (4, 41, 31, 4, "s"), (5, 51, 41, 5, "s"), (6, 61, 51, 6, "s")]
    assert [r.key for r in log.records(4)] == [51, 61]
    log.removed([ChunkKey("m", "s", 40)])
    assert (log.first, log.token_bytes) == (3, len(tokens))  # the second run still holds the list
    log.stored("m", "", [7, 8], None)
    assert (log.first, log.token_bytes) == (5, len(tokens))
    assert [(r.seq, r.kind, r.key) for r in log.records(2)] == [
        (5, STORED, 51), (6, STORED, 61), (7, REMOVED, 40), (8, STORED, 7), (9, STORED, 8)]
    log.stored("m", "", [9], None)
    assert (log.first, log.token_bytes, log.record(6).key) == (6, len(tokens), 61)
    log.stored("m", "", [10], None)  # the second run's last record goes: its list is no longer held
    assert (log.first, log.token_bytes) == (7, 0)
