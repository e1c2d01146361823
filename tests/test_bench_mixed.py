"""The mixed-object-size benchmark compares like with like: at each pressure both runs push the same bytes
through L1 (only object sizes differ), and its exact-LRU reference is a real LRU by bytes."""

from __future__ import annotations

from benchmarks import mixed_sizes


def _noise_bytes(rounds) -> int:
    return sum(len(hashes) * size for steps in rounds for model, hashes, size in steps if model != "good")


def test_uniform_and_mixed_streams_push_the_same_bytes_and_the_same_good_requests(monkeypatch) -> None:
    monkeypatch.setattr(mixed_sizes, "ROUNDS", 400)
    uniform = mixed_sizes._streams(1, False, 256 * 1024)
    mixed = mixed_sizes._streams(1, True, 256 * 1024)
    expected = 400 * mixed_sizes.NOISY * 256 * 1024
    for rounds in (uniform, mixed):  # within one object of each registration's share
        assert abs(_noise_bytes(rounds) - expected) <= sum(mixed_sizes.MIXED_SIZES)
    assert [steps[0] for steps in uniform] == [steps[0] for steps in mixed]
    assert {size for steps in mixed for model, _, size in steps if model != "good"} == set(mixed_sizes.MIXED_SIZES)


def test_the_ideal_lru_evicts_the_least_recently_used_bytes_first() -> None:
    lru = mixed_sizes._IdealLRU(10)
    lru.store("a", [1, 2], 4)
    assert 1 == lru.hits("a", [1, 9])  # 1 is now the most recent
    lru.store("b", [1], 4)  # 12 bytes wanted: a/2 (least recent) goes
    assert (1, 0, 1) == (lru.hits("a", [1]), lru.hits("a", [2]), lru.hits("b", [1]))
