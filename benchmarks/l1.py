"""L1 by bytes vs fixed slots: a mixed-model workload's hit ratio and resident bytes, and CPU per store;
eviction on demand vs the once-a-second trim below a 0.8 watermark it replaced.

Three models share one 2 GiB L1 (objects of 32 MiB, like Llama-3-8B at TP 1; 8.4 MiB, MLA-like; 1.5 MiB, a
small model).  Requests pick a model, then a prompt prefix by Zipf popularity; a lookup locks the cached
prefix (hit chunks), the rest is stored.  The same request stream runs against L1 allocated by bytes (this
build) and against fixed slots sized for the largest model (what one ``--chunk-bytes`` for every model
amounted to).  CPU per store: :class:`~mpcache.cache.l1.L1Manager`'s reserve+commit per chunk (evicting
once full) with the slab allocator, and with the slot allocator it replaced (a free list of slot numbers,
reproduced here as ``_SlotAllocator``) in its place, on native 64 KiB chunks.  The old trim (reproduced
here: every ``TRIM_EVERY`` requests, LRU objects evicted until usage is below 0.8) runs the same stream beside
eviction on demand: hit ratio, fragmentation (bytes carved into slabs that no object uses) and objects a
store evicts, what the watermark's headroom was keeping low.
No pool byte is touched: the allocators only hand out offsets.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager

MIB = 2**20
L1_BYTES = 2 * 2**30
MODELS = {"llama-8b": 32 * MIB, "mla": 8 * MIB + 384 * 1024, "small": 3 * MIB // 2}
WEIGHTS = {"llama-8b": 0.4, "mla": 0.3, "small": 0.3}
DOCS, CHUNKS_PER_DOC, REQUESTS = 400, 4, 6000
TRIM_EVERY, OLD_WATERMARK = 50, 0.8  # the replaced loop: 1 Hz at 50 requests a second


def _requests(seed: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    names = list(MODELS)
    models = rng.choice(len(names), size=REQUESTS, p=[WEIGHTS[n] for n in names])
    docs = np.minimum(rng.zipf(1.2, size=REQUESTS), DOCS) - 1
    return [(names[m], int(d)) for m, d in zip(models, docs)]


def _l1(slot_for_largest: bool) -> L1Manager:
    largest = max(MODELS.values())
    pool = np.zeros(L1_BYTES, dtype=np.uint8)  # calloc'd: never touched, never resident
    return L1Manager(pool, NullPublisher(), 1.0, 64 * 1024, slab_bytes=largest if slot_for_largest else None)


def _replay(l1: L1Manager, requests: list[tuple[str, int]], slot_for_largest: bool,
            trim: bool = False) -> dict[str, float]:
    largest = max(MODELS.values())
    hit = wanted = 0
    resident: list[float] = []
    fragmentation: list[float] = []
    evicted_per_store: list[int] = []
    live_bytes: dict[tuple[str, int], int] = {}
    for index, (model, doc) in enumerate(requests):
        if trim and index % TRIM_EVERY == 0:
            while l1.usage >= OLD_WATERMARK and l1._evict(1):
                pass
        hashes = [doc * 100 + chunk for chunk in range(CHUNKS_PER_DOC)]
        found = l1.lock_prefix(model, "", hashes, publish=False)
        l1.release_read(model, "", hashes[:found])
        hit, wanted = hit + found, wanted + len(hashes)
        size = MODELS[model]
        before = len(l1)
        reservation = l1.reserve_write(model, "", hashes[found:], nbytes=largest if slot_for_largest else size)
        l1.commit_write(model, "", [hashes[found + p] for p in reservation.positions], size)
        if reservation.positions:
            evicted_per_store.append(before + len(reservation.positions) - len(l1))
        if index % 50 == 0:  # bytes the resident objects hold, whatever the allocator reserves for them
            live = [(key.model_name, key.chunk_hash) for key in l1._entries]
            live_bytes = {k: MODELS[k[0]] for k in live}
            resident.append(sum(live_bytes.values()) / L1_BYTES)
            fragmentation.append(l1.fragmentation_bytes / L1_BYTES)
    return {"hit_ratio": round(hit / wanted, 4), "resident_object_fraction": round(statistics.mean(resident), 4),
            "objects": len(live_bytes), "fragmentation_fraction": round(statistics.mean(fragmentation), 4),
            "evicted_per_store_mean": round(statistics.mean(evicted_per_store), 3),
            "evicted_per_store_p99": float(np.percentile(evicted_per_store, 99))}


class _SlotAllocator:
    """The slot allocator this build replaced, behind the allocator's interface: ``pool_bytes // chunk`` slots
    of ``chunk`` bytes on a free list (slot 0 first); every object takes one slot."""

    def __init__(self, pool_bytes: int, chunk: int) -> None:
        self._chunk = chunk
        self._free = list(range(pool_bytes // chunk - 1, -1, -1))
        self.capacity_bytes = pool_bytes // chunk * chunk
        self.used_bytes = 0

    def alloc(self, size: int) -> int | None:
        if not self._free or size > self._chunk:
            return None
        self.used_bytes += size
        return self._free.pop() * self._chunk

    def free(self, offset: int, size: int) -> None:
        self.used_bytes -= size
        self._free.append(offset // self._chunk)


def _cpu_per_store(repetitions: int) -> dict[str, float]:
    chunk = 64 * 1024
    rounds = 20000
    hashes = [[i * 4 + j for j in range(4)] for i in range(rounds)]  # every store new: L1 fills, then evicts

    def bytes_run(slots: bool = False) -> float:
        l1 = L1Manager(np.zeros(256 * MIB, dtype=np.uint8), NullPublisher(), 1.0, chunk)
        if slots:  # the same L1Manager path; only the allocator differs
            l1.allocator = _SlotAllocator(256 * MIB, chunk)  # type: ignore[assignment]
        start = time.perf_counter()
        for batch in hashes:
            reservation = l1.reserve_write("m", "", batch)
            l1.commit_write("m", "", [batch[p] for p in reservation.positions], chunk)
        return (time.perf_counter() - start) / (4 * rounds)

    def slot_run() -> float:
        return bytes_run(slots=True)

    pairs = [(bytes_run(), slot_run()) for _ in range(repetitions)]  # interleaved: the same machine state
    ours = statistics.median(pair[0] for pair in pairs)
    slots = statistics.median(pair[1] for pair in pairs)
    return {"bytes_store_us": round(ours * 1e6, 2), "slot_store_us": round(slots * 1e6, 2),
            "cpu_ratio_bytes_over_slots": round(ours / slots, 2)}


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    requests = _requests(seed=19)
    progress("l1: mixed-model workload, L1 by bytes")
    by_bytes = _replay(_l1(False), requests, False)
    progress("l1: the same workload, fixed slots sized for the largest model")
    by_slots = _replay(_l1(True), requests, True)
    progress(f"l1: the same workload, L1 by bytes with the old trim below {OLD_WATERMARK} every {TRIM_EVERY} requests")
    trimmed = _replay(_l1(False), requests, False, trim=True)
    progress("l1: CPU per store (native 64 KiB chunks), bytes vs slots")
    cpu = _cpu_per_store(repetitions)
    result: dict[str, Any] = {
        "models": {name: size for name, size in MODELS.items()}, "l1_bytes": L1_BYTES, "requests": REQUESTS,
        "bytes": by_bytes, "slots": by_slots, "bytes_with_old_trim": trimmed,
        "hit_ratio_bytes_over_slots": round(by_bytes["hit_ratio"] / by_slots["hit_ratio"], 2),
        "resident_bytes_over_slots": round(by_bytes["resident_object_fraction"]
                                           / by_slots["resident_object_fraction"], 2),
        **cpu,
    }
    result["on_demand_over_old_trim"] = {
        key: round(by_bytes[key] / trimmed[key], 2) if trimmed[key] else None
        for key in ("hit_ratio", "fragmentation_fraction", "evicted_per_store_mean")}
    result["targets_met"] = {"hit_ratio": result["hit_ratio_bytes_over_slots"] > 1.0,
                             "on_demand_hit_ratio": by_bytes["hit_ratio"] >= trimmed["hit_ratio"],
                             "on_demand_fragmentation": by_bytes["fragmentation_fraction"]
                             <= trimmed["fragmentation_fraction"] + 0.01,
                             "cpu_per_store": result["cpu_ratio_bytes_over_slots"] <= 1.5}
    return result
