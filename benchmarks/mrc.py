"""Miss-ratio curves against the truth: two deterministic workloads through the real service (the demo's,
and a KV-shaped synthetic one), each

* replayed offline by an exact simulation of the default ``--l1-policy`` (for LRU a stack-distance computation,
  ``mrc_traces``, independent of ``mpcache.telemetry.mrc``; otherwise its order run at full size over every key)
  against the service's online curve at the default settings: mean absolute error over the points;
* re-run under that policy with L1 at ½× and 2×: the hit ratio the 1× curve predicted there against the one
  measured (prefix lookups, eviction on demand and all);
* the same traces fed straight to the telemetry's curve code at rates 0.01, 0.1 and 1 (and with 4 or no exact
  head chunks), and a third, long-prompt trace whose accesses lie mostly past the exact chunks: the error
  that sampling alone costs;
* sampling's cost (``mrc_cost``): the cache process's CPU per request at the default rate against
  ``--mrc-sample-rate 0``, in interleaved pairs, and the sampling calls alone; and the telemetry memory of a
  curve set filled to ``--mrc-max-keys``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.mrc_accuracy import exact_policy_curve, feed
from benchmarks.mrc_cost import curve_memory, sampling_cost
from benchmarks.mrc_traces import (
    CHUNK_BYTES,
    Request,
    demo_requests,
    exact_curve,
    exact_distances,
    kv_requests,
    long_requests,
    median_reuse_bytes,
    replay,
    share_past,
)
from mpcache.config import Config
from mpcache.tools.report import hit_ratio_at


def _overall(document: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in document["curves"] if c["tier"] == "l1" and (c["model_name"], c["cache_salt"]) == ("*", "*"))


# -- the benchmark -------------------------------------------------------------------------------------------------


def _one_workload(name: str, requests: list[Request], rate: float, progress: Callable[[str], None],
                  policy: str) -> dict[str, Any]:
    distances = exact_distances(requests)
    l1 = median_reuse_bytes(distances)
    progress(f"mrc: {name}: {len(requests)} requests, {len(distances)} lookup accesses, L1 {l1 >> 10} KiB, "
             f"--l1-policy {policy}")
    runs = {factor: replay(requests, int(l1 * factor) // CHUNK_BYTES * CHUNK_BYTES, rate, policy=policy)
            for factor in (1, 0.5, 2)}
    curve = _overall(runs[1]["mrc"])
    capacities = [point["capacity_bytes"] for point in curve["points"]]
    exact = exact_policy_curve(requests, policy, capacities)
    online = [point["hit_ratio"] for point in curve["points"]]
    configured = curve["capacity_bytes"]  # the allocator's capacity may sit a slab below --l1-size

    def predicted(factor: float) -> float:
        return float(hit_ratio_at(list(zip(capacities, online)), configured * factor) or 0.0)

    out: dict[str, Any] = {
        "policy": policy, "curves_model": runs[1]["mrc"]["curves_model"], "requests": len(requests),
        "lookup_accesses": len(distances), "l1_bytes": l1,
        "sample_rate": runs[1]["mrc"]["sample_rate"], "sampled_accesses": curve["sampled_accesses"],
        "mae_online_vs_exact": round(float(np.mean(np.abs(np.subtract(online, exact)))), 4),
        "max_error_online_vs_exact": round(float(np.max(np.abs(np.subtract(online, exact)))), 4),
    }
    for factor, label in ((0.5, "half"), (2, "double")):
        measured = runs[factor]["hit_ratio"]
        out[f"{label}_measured"] = round(measured, 4)
        out[f"{label}_predicted"] = round(predicted(factor), 4)
        out[f"{label}_error"] = round(abs(predicted(factor) - measured), 4)
    out["one_measured"] = round(runs[1]["hit_ratio"], 4)
    out["one_predicted"] = round(predicted(1), 4)
    for factor, label in ((0.5, "half"), (1, "one"), (2, "double")):  # what an exact curve would predict
        out[f"{label}_exact"] = round(float(hit_ratio_at(list(zip(capacities, exact)), configured * factor) or 0.0),
                                      4)
    return out


def replay_mae(requests: list[Request], rate: float, exact_chunks: int, max_keys: int) -> float:
    """The curve the telemetry process would build from ``requests`` sampled at ``rate`` (fed straight to a
    :class:`~mpcache.telemetry.mrc.curves.CurveSet`, no service) against the exact one: mean absolute error."""
    from mpcache.telemetry.mrc.curves import POINT_RATIOS, CurveSet

    distances = exact_distances(requests)
    finite = sorted(d for d in distances if d != float("inf"))
    capacity = int(finite[len(finite) // 2])  # not rounded to whole chunks: the replay has no slabs
    curves = CurveSet(rate, max_keys, {"l1": capacity})
    feed(curves, requests, rate, exact_chunks)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == ("*", "*")]
    exact = exact_curve(distances, [round(capacity * ratio) for ratio in POINT_RATIOS])
    return round(float(np.mean(np.abs(np.subtract([p["hit_ratio"] for p in curve["points"]], exact)))), 4)


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None,
        requests: int = 40_000) -> dict[str, Any]:
    defaults = Config(instance_id="b", supervisor_pid=0, runtime_dir="/x")
    rate, exact, max_keys = defaults.mrc_sample_rate, defaults.mrc_exact_chunks, defaults.mrc_max_keys
    workloads = {"demo": demo_requests(requests), "kv": kv_requests(requests)}
    results: dict[str, Any] = {name: _one_workload(name, reqs, rate, progress, defaults.l1_policy)
                               for name, reqs in workloads.items()}
    replayed = workloads | {"long (replay only)": long_requests(requests // 2)}
    results["replay_mae_by_rate"] = {
        name: {"share of accesses past the exact chunks": share_past(reqs, exact)} | {
            f"{rate:g}": replay_mae(reqs, rate, exact, max_keys) for rate in (0.01, 0.1, 1.0)} | {
            f"0.01 with {chunks} exact chunks": replay_mae(reqs, 0.01, chunks, max_keys) for chunks in (4, 0)}
        for name, reqs in replayed.items()}
    progress(f"mrc: replayed MAE by rate {results['replay_mae_by_rate']}")
    results["sampling_cost"] = sampling_cost(workloads["kv"][: requests // 4], repetitions, progress)
    results["max_keys"] = max_keys
    results["curve_set_bytes_at_max_keys"] = curve_memory(max_keys)
    results["targets_met"] = {
        "MAE ≤ 0.01": all(results[n]["mae_online_vs_exact"] <= 0.01 for n in workloads),
        "prediction within 0.02": all(results[n][f"{x}_error"] <= 0.02 for n in workloads for x in ("half", "double")),
        "sampling ≤ +1 % CPU": results["sampling_cost"]["sampler_share"] <= 0.01,
    }
    return results
