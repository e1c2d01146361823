"""``python -m benchmarks mixed``: what mixed object sizes cost a well-behaved client, told apart from plain
eviction pressure.

One 64 MiB L1 (the allocator this build ships, driven through :class:`~mpcache.cache.l1.L1Manager`), a
well-behaved client (``GOOD_OBJECT`` objects, prompts of ``GOOD_CHUNKS`` chunks drawn by Zipf popularity from
``GOOD_DOCS``: looked up, the misses stored) and ``NOISY`` registrations storing unique prefixes (never read
again) beside it.  Every round each noisy registration stores the same bytes of new objects (at each of the
``PRESSURES``), so the bytes pushed through L1 are the same in both runs; only their object sizes differ: all
the mean of ``MIXED_SIZES`` (uniform), or each registration its own size from ``MIXED_SIZES``, 64 KiB to 4 MiB
(mixed).  Reported per pressure: the client's hit ratio in each, its difference (the cost of mixed sizes; the
bound is 0.05 at every pressure), the same streams under an ideal allocator (exact LRU by bytes, no slabs: the
hit ratio eviction pressure alone leaves), the mean fragmentation and the bytes compaction moved per byte
stored (a counted measure of what the allocator's compaction costs the cache loop).  No pool byte is written
but by compaction's moves.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager

KIB, MIB = 1024, 1024 * 1024
L1_BYTES = 64 * MIB
GOOD_OBJECT = 256 * KIB
GOOD_DOCS, GOOD_CHUNKS = 64, 4
MIXED_SIZES = (64 * KIB, 96 * KIB, 160 * KIB, 256 * KIB, 384 * KIB, 640 * KIB, MIB, 3 * MIB // 2, 5 * MIB // 2,
               4 * MIB)
NOISY = len(MIXED_SIZES)
PRESSURES = (64 * KIB, 256 * KIB, MIB)  # new bytes per noisy registration and round
ROUNDS = 6000
TARGET_COST = 0.05


def _uniform_size() -> int:
    return (sum(MIXED_SIZES) // NOISY) // (4 * KIB) * (4 * KIB)


class _IdealLRU:
    """Exact LRU by bytes with no allocator: an object fits when the bytes do."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._used = 0
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()

    def hits(self, model: str, hashes: list[int]) -> int:
        found = 0
        for chunk in hashes:
            if (model, chunk) not in self._entries:
                break
            self._entries.move_to_end((model, chunk))
            found += 1
        return found

    def store(self, model: str, hashes: list[int], size: int) -> None:
        for chunk in hashes:
            while self._used + size > self._capacity and self._entries:
                self._used -= self._entries.popitem(last=False)[1]
            self._entries[(model, chunk)] = size
            self._used += size


def _streams(seed: int, mixed: bool, noise_bytes: int) -> list[list[tuple[str, list[int], int]]]:
    """Per round: the good client's prompt, then each noisy registration's new objects (model, hashes, size)."""
    rng = np.random.default_rng(seed)
    docs = np.minimum(rng.zipf(1.3, size=ROUNDS), GOOD_DOCS) - 1
    sizes = MIXED_SIZES if mixed else (_uniform_size(),) * NOISY
    credit = [0.0] * NOISY
    serial = [0] * NOISY
    rounds = []
    for index in range(ROUNDS):
        doc = int(docs[index])
        steps = [("good", [doc * 100 + chunk for chunk in range(GOOD_CHUNKS)], GOOD_OBJECT)]
        for noisy, size in enumerate(sizes):
            credit[noisy] += noise_bytes / size
            count = int(credit[noisy])
            credit[noisy] -= count
            if count:
                steps.append((f"noisy{noisy}", list(range(serial[noisy], serial[noisy] + count)), size))
                serial[noisy] += count
        rounds.append(steps)
    return rounds


def _replay(rounds: list[list[tuple[str, list[int], int]]]) -> dict[str, float]:
    l1 = L1Manager(np.zeros(L1_BYTES, dtype=np.uint8), NullPublisher(), 1.0, GOOD_OBJECT)
    ideal = _IdealLRU(L1_BYTES)
    hit = ideal_hit = wanted = stored = 0
    fragmentation: list[float] = []
    for index, steps in enumerate(rounds):
        for model, hashes, size in steps:
            if model == "good":
                found = l1.lock_prefix(model, "", hashes, publish=False)
                l1.release_read(model, "", hashes[:found])
                ideal_found = ideal.hits(model, hashes)
                if index >= ROUNDS // 10:  # warmed up
                    hit, ideal_hit, wanted = hit + found, ideal_hit + ideal_found, wanted + len(hashes)
                missing, ideal_missing = hashes[found:], hashes[ideal_found:]
            else:
                missing = ideal_missing = hashes
            reservation = l1.reserve_write(model, "", missing, nbytes=size)
            l1.commit_write(model, "", [missing[p] for p in reservation.positions], size)
            stored += len(reservation.positions) * size
            ideal.store(model, ideal_missing, size)
        if index % 50 == 0:
            fragmentation.append(l1.fragmentation_bytes / L1_BYTES)
    return {"hit_ratio": round(hit / wanted, 4), "ideal_lru_hit_ratio": round(ideal_hit / wanted, 4),
            "fragmentation_fraction": round(statistics.mean(fragmentation), 4),
            "moved_per_stored_byte": round(l1.allocator.moved_bytes / stored, 4)}


def _pressure(noise_bytes: int, repetitions: int, progress: Callable[[str], None]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"uniform": [], "mixed": []}
    for repetition in range(repetitions):
        for kind in runs:
            progress(f"mixed: {noise_bytes >> 10} KiB per registration and round, repetition "
                     f"{repetition + 1}/{repetitions}, {kind} object sizes")
            runs[kind].append(_replay(_streams(23 + repetition, kind == "mixed", noise_bytes)))
    result: dict[str, Any] = {
        kind: {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}
        for kind, results in runs.items()}
    result["cost_of_mixed"] = round(result["uniform"]["hit_ratio"] - result["mixed"]["hit_ratio"], 4)
    result["cost_of_mixed_ideal_lru"] = round(result["uniform"]["ideal_lru_hit_ratio"]
                                              - result["mixed"]["ideal_lru_hit_ratio"], 4)
    return result


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    pressures = {f"{noise >> 10}KiB": _pressure(noise, repetitions, progress) for noise in PRESSURES}
    worst = max(pressure["cost_of_mixed"] for pressure in pressures.values())
    return {"pressures": pressures, "l1_bytes": L1_BYTES, "uniform_object_bytes": _uniform_size(),
            "mixed_object_bytes": MIXED_SIZES, "rounds": ROUNDS, "worst_cost_of_mixed": worst,
            "targets_met": {"cost_of_mixed": worst <= TARGET_COST}}
