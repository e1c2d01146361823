"""The KV event log's bounds: a full log overwrites its oldest records; token lists are held within the budget,
a run of records sharing one list counts it once (and passes it on when its first record goes), and a list
larger than the whole budget is not kept."""

from __future__ import annotations

from mpcache.cache.kvlog import REMOVED, STORED, Detail, KVEventLog
from mpcache.contract.keys import ChunkKey


def _detail(tokens: bytes, first: int, n: int) -> Detail:
    return Detail(tokens, 2, first, range(n), [None] * n)


def test_a_full_log_overwrites_its_oldest_records():
    log = KVEventLog(4)
    log.stored("m", "", [1, 2, 3], None)
    log.removed(ChunkKey("m", "s", 1))
    log.removed(ChunkKey("m", "", 2))
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
    log.removed(ChunkKey("m", "", 9))  # overwrites the run's first record: the second now accounts for the list
    assert (log.first, log.token_bytes) == (2, 48)
    assert log.record(2).tokens is tokens and log.record(2).chunk == 6
    log.removed(ChunkKey("m", "", 8))
    log.removed(ChunkKey("m", "", 7))  # the run's last record goes: its list is no longer held
    assert (log.first, log.token_bytes) == (4, 0)


def test_a_list_larger_than_the_budget_is_not_kept():
    log = KVEventLog(10, token_budget=16)
    tokens = bytes(32)
    log.stored("m", "", [1], _detail(tokens, 0, 1))
    log.stored("m", "", [2], _detail(tokens, 1, 1))  # the same list again: still not kept
    assert [(r.kind, r.key, r.tokens) for r in map(log.record, (1, 2))] == [(STORED, 1, None), (STORED, 2, None)]
    assert log.token_bytes == 0
