"""CPU per request in the LMCache benchmark (``benchmarks.lmcache``, issue 21): every server's processes,
mpcache's cache process against LMCache's server with and without telemetry, what publishing costs the cache
process (from each round's side-by-side run), server-side p99 per operation, and the targets' verdicts.
"""

from __future__ import annotations

import statistics
from typing import Any

# the cache process against LMCache's server, with and without telemetry; the telemetry process alone;
# what publishing costs the cache process (on over off - 1); server-side p99
TARGET_CACHE_CPU_OVER_LMCACHE = 0.25
TARGET_CACHE_AND_TELEMETRY_CPU_OVER_LMCACHE = 0.30
TARGET_TELEMETRY_CPU_MS = 0.1
TARGET_PUBLISH_CPU_COST = 0.03
TARGET_SERVER_P99_MS = 1.0
TIMED_OPS = ("lookup", "prepare_store", "prepare_retrieve")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _cpu_ratios(cache: float, telemetry: float, lmcache: float) -> dict[str, float]:
    """CPU per request of the cache and telemetry processes against LMCache's server."""
    return {
        "cache_cpu_over_lmcache": round(cache / lmcache, 4) if lmcache else 0.0,
        "cache_and_telemetry_cpu_over_lmcache": round((cache + telemetry) / lmcache, 4) if lmcache else 0.0,
    }


def _cpu_of(entry: dict[str, Any]) -> tuple[float, float]:
    return entry["server_cpu_ms_per_request"], entry["telemetry_cpu_ms_per_request"]


def cpu_report(servers: dict[str, Any], per_round: list[dict[str, Any]], tps: tuple[int, ...]) -> dict[str, Any]:
    """CPU per request per process (ms) for every server, the ratios from those medians, per TP, the same
    ratios paired within each round, publishing's cost (median over the rounds' side-by-side runs),
    server-side p99 per operation, and the verdicts of issue 21's targets."""

    def ratios(entries: dict[str, Any]) -> dict[str, float]:
        (cache, telemetry), (lmcache, _) = (_cpu_of(entries[k]) for k in ("mpcache", "lmcache"))
        return _cpu_ratios(cache, telemetry, lmcache)

    sides = [rd["side_by_side"] for rd in per_round]
    side_kinds = sides[0][f"tp{tps[0]}"]["cache_cpu_ms_per_request"] if sides else {}

    report: dict[str, Any] = {
        "cpu_ms_per_request": {kind: {"cache" if kind.startswith("mpcache") else "server": _cpu_of(servers[kind])[0],
                                      **({"telemetry": _cpu_of(servers[kind])[1]} if kind == "mpcache" else {})}
                               for kind in servers},
        **ratios(servers),
        "publish_cpu_cost": round(median([side["publish_cpu_cost"] for side in sides]), 4),
        "side_by_side": {f"tp{tp}": {kind: round(median([side[f"tp{tp}"]["cache_cpu_ms_per_request"][kind]
                                                         for side in sides]), 4) for kind in side_kinds}
                         for tp in tps},
    }
    for tp in tps:
        key = f"tp{tp}"
        report[key] = {**ratios({kind: servers[kind][key] for kind in servers}),
                       "publish_cpu_cost": round(median([side[key]["publish_cpu_cost"] for side in sides]), 4),
                       "telemetry_cpu_ms_per_request": servers["mpcache"][key]["telemetry_cpu_ms_per_request"],
                       "server_op_p99_ms": servers["mpcache"][key].get("server_op_p99_ms", {})}
    paired = [ratios(rd) for rd in per_round]
    report["paired"] = {name: round(median([p[name] for p in paired]), 4) for name in paired[0]} if paired else {}
    p99s = [report[f"tp{tp}"]["server_op_p99_ms"].get(op) for tp in tps for op in TIMED_OPS]
    telemetry_ms = servers["mpcache"]["telemetry_cpu_ms_per_request"]
    report["targets"] = {"cache_cpu_over_lmcache": f"<= {TARGET_CACHE_CPU_OVER_LMCACHE}",
                         "cache_and_telemetry_cpu_over_lmcache": f"<= {TARGET_CACHE_AND_TELEMETRY_CPU_OVER_LMCACHE}",
                         "telemetry_cpu_ms_per_request": f"<= {TARGET_TELEMETRY_CPU_MS}",
                         "publish_cpu_cost": f"<= +{TARGET_PUBLISH_CPU_COST:.0%}",
                         "server_p99_ms": f"<= {TARGET_SERVER_P99_MS} for {', '.join(TIMED_OPS)}, every TP"}
    report["targets_met"] = {
        "cache_cpu_over_lmcache": 0 < report["cache_cpu_over_lmcache"] <= TARGET_CACHE_CPU_OVER_LMCACHE,
        "cache_and_telemetry_cpu_over_lmcache":
            0 < report["cache_and_telemetry_cpu_over_lmcache"] <= TARGET_CACHE_AND_TELEMETRY_CPU_OVER_LMCACHE,
        "telemetry_cpu_ms_per_request": telemetry_ms <= TARGET_TELEMETRY_CPU_MS,
        "publish_cpu_cost": report["publish_cpu_cost"] <= TARGET_PUBLISH_CPU_COST,
        "server_p99_ms": all(p is not None and p <= TARGET_SERVER_P99_MS for p in p99s),
    }
    return report
