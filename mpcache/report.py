"""``mpcache-report``: the what-if table of a running service's miss-ratio curves (``GET /mrc``): per tier and
tenant, the hit ratio now, at ½×, 2× and 4× the capacity, and the capacity a target hit ratio needs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.request
from typing import Any

from mpcache import __version__

DEFAULT_URL = "http://127.0.0.1:9090"
WHAT_IF = (("now", 1.0), ("½×", 0.5), ("2×", 2.0), ("4×", 4.0))


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    """The ``/mrc`` document at ``url`` (the telemetry endpoint, with or without ``/mrc``)."""
    if not url.rstrip("/").endswith("/mrc"):
        url = url.rstrip("/") + "/mrc"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def hit_ratio_at(points: list[dict], capacity: float) -> float | None:
    """The curve's hit ratio at ``capacity`` (log-linear between points; None outside them)."""
    for low, high in zip(points, points[1:]):
        if low["capacity_bytes"] <= capacity <= high["capacity_bytes"]:
            span = math.log(high["capacity_bytes"] / low["capacity_bytes"])
            share = math.log(capacity / low["capacity_bytes"]) / span if span else 0.0
            return low["hit_ratio"] + share * (high["hit_ratio"] - low["hit_ratio"])
    return None


def capacity_for(points: list[dict], target: float) -> str:
    """The smallest capacity whose hit ratio reaches ``target``, or where it lies beyond the curve."""
    if not points:
        return "-"
    if points[0]["hit_ratio"] >= target:
        return "≤ " + human_bytes(points[0]["capacity_bytes"])
    for low, high in zip(points, points[1:]):
        if high["hit_ratio"] >= target:
            share = (target - low["hit_ratio"]) / (high["hit_ratio"] - low["hit_ratio"])
            return human_bytes(low["capacity_bytes"] * (high["capacity_bytes"] / low["capacity_bytes"]) ** share)
    return "> " + human_bytes(points[-1]["capacity_bytes"])


def human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render(document: dict[str, Any], target: float) -> str:
    """The report: one header line about the sampling, then one row per curve."""
    lines = [f"sample rate {document['sample_rate']:.6g} (configured {document['configured_sample_rate']:g}); "
             f"{document['tracked_keys']} of at most {document['max_keys']} keys tracked"]
    header = ("tier", "model_name", "cache_salt", "capacity", "sampled", *(name for name, _ in WHAT_IF),
              f"for {target:.0%}")
    rows = [header]
    for curve in document["curves"]:
        points, capacity = curve["points"], curve["capacity_bytes"]
        ratios = [hit_ratio_at(points, capacity * factor) for _, factor in WHAT_IF]
        rows.append((curve["tier"], curve["model_name"], curve["cache_salt"], human_bytes(capacity),
                     str(curve["sampled_accesses"]), *("-" if r is None else f"{r:.3f}" for r in ratios),
                     capacity_for(points, target)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if len(rows) == 1:
        lines.append("no curves yet: no sampled lookup has reached the telemetry process")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-report", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the telemetry HTTP endpoint, as for /metrics (default {DEFAULT_URL})")
    parser.add_argument("--target-hit-ratio", type=float, default=0.8,
                        help="the hit ratio to size for, in (0, 1] (default 0.8)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the endpoint (default 5)")
    parser.add_argument("--json", action="store_true", help="print the /mrc document as it came")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)
    if not 0 < args.target_hit_ratio <= 1:
        parser.error("--target-hit-ratio: expected a number in (0, 1]")
    try:
        document = fetch(args.url, args.timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"mpcache-report: cannot read the curves from {args.url}: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render(document, args.target_hit_ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
