"""``mpcache-report``: the what-if table of a running service's miss-ratio curves (``GET /mrc``): per tier and
tenant, the hit ratio the lookups measured beside the one predicted now, at ½×, 2× and 4× the capacity, and the
capacity a target hit ratio needs, each for the whole service and per cache process (what ``--l1-size`` takes).
Where the curves model another order than the ``--l1-policy`` L1 runs, the report says so and predicts nothing.

Whatever the endpoint answers is checked before it is used: an answer that cannot be had (no server, an HTTP
error, too large, not whole within ``--timeout``) or is not a /mrc document (not JSON, nested too deeply, a
field missing or of the wrong type, a number that is not finite, a byte count that is not a whole number) is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mpcache import __version__
from mpcache.httpserver import is_loopback

DEFAULT_URL = "http://127.0.0.1:9090"
WHAT_IF = (("now", 1.0), ("½×", 0.5), ("2×", 2.0), ("4×", 4.0))
MAX_DOCUMENT_BYTES = 16 << 20  # /mrc is at most ~100 curves of 29 points, a few hundred kB
MAX_PROCESSES = 65535  # cache processes a service can run at most: each listens on a port of its own
READ_BYTES = 1 << 16
MAX_BYTES = 1 << 64  # a capacity in bytes at most (a curve's or a point's)
MAX_TIMEOUT_S = 86_400.0


class Unusable(Exception):
    """The endpoint cannot be reached, or its answer is not a /mrc document; the message says which."""


def mrc_url(url: str) -> str:
    """``url``'s ``/mrc``: the endpoint as given for ``/metrics`` (its root, ``/metrics`` or ``/mrc``, a trailing
    slash or not), its query kept, its fragment dropped."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError as exc:
        raise Unusable(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Unusable("expected an http:// or https:// URL")
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[:-len("/metrics")]
    if not path.endswith("/mrc"):
        path += "/mrc"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch(url: str, timeout_s: float) -> bytes:
    """The body of ``GET /mrc`` at ``url`` (:func:`mrc_url`): at most MAX_DOCUMENT_BYTES, had within ``timeout_s``
    in all, the connection, the answer's head and its body together (a server that trickles any of them is cut
    off).  A loopback endpoint is asked directly: a proxy named in the environment could answer for it."""
    url = mrc_url(url)
    outcome: list[bytes | Unusable] = []
    reader = threading.Thread(target=lambda: outcome.append(_read(url, timeout_s)), daemon=True,
                              name="mpcache-report-fetch")
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():  # still reading: left behind, a daemon thread, as the command exits
        raise Unusable(f"the answer took longer than {timeout_s:g} s")
    if isinstance(outcome[0], Unusable):
        raise outcome[0]
    return outcome[0]


def _read(url: str, timeout_s: float) -> bytes | Unusable:
    """The body, or why there is none (returned, not raised: this runs in the reader thread, within the deadline,
    as does the name lookup that tells a loopback endpoint)."""
    body = bytearray()
    try:
        direct = [urllib.request.ProxyHandler({})] if is_loopback(urllib.parse.urlsplit(url).hostname or "") else []
        with urllib.request.build_opener(*direct).open(url, timeout=timeout_s) as response:
            while chunk := response.read1(READ_BYTES):
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    return Unusable(f"the answer is larger than {MAX_DOCUMENT_BYTES} bytes")
    except urllib.error.HTTPError as exc:
        return Unusable(f"HTTP {exc.code} {exc.reason}")
    except urllib.error.URLError as exc:
        return Unusable(str(exc.reason))
    except (OSError, http.client.HTTPException, ValueError) as exc:  # a reset, a timeout, a broken HTTP answer
        return Unusable(str(exc) or type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 - whatever else the HTTP stack raises is still one line, not a thread's
        return Unusable(f"{type(exc).__name__}: {exc}")
    return bytes(body)


def _number(value: Any, where: str, low: float = 0.0, high: float = math.inf) -> float:
    """``value`` if it is a finite number in [low, high] (a JSON bool is not one), else Unusable."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond a float
            number = math.inf
        if math.isfinite(number) and low <= number <= high:
            return number
    bounds = f"[{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
    raise Unusable(f"{where}: expected a number {bounds}, got {_shown(value)}")


def _count(value: Any, where: str, high: int | None = None) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (high is None or value <= high):
        return value
    bounds = ">= 0" if high is None else f"in [0, {high}]"
    raise Unusable(f"{where}: expected an integer {bounds}, got {_shown(value)}")


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    raise Unusable(f"{where}: expected text, got {_shown(value)}")


def _field(table: Any, key: str, where: str) -> Any:
    if not isinstance(table, dict):
        raise Unusable(f"{where}: expected an object, got {_shown(table)}")
    if key not in table:
        raise Unusable(f"{where}: no {key!r}")
    return table[key]


def _shown(value: Any) -> str:
    """``value``'s type, and the value itself when short: for an error line."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__


def _points(value: Any, where: str) -> list[tuple[float, float]]:
    """The curve's points as (capacity_bytes, hit_ratio), capacities never decreasing."""
    if not isinstance(value, list):
        raise Unusable(f"{where}: expected a list, got {_shown(value)}")
    points: list[tuple[float, float]] = []
    for index, point in enumerate(value):
        at = f"{where}[{index}]"
        capacity = _count(_field(point, "capacity_bytes", at), f"{at}.capacity_bytes", MAX_BYTES)
        ratio = _number(_field(point, "hit_ratio", at), f"{at}.hit_ratio", 0.0, 1.0)
        if points and capacity < points[-1][0]:
            raise Unusable(f"{at}.capacity_bytes: smaller than the point before it")
        points.append((capacity, ratio))
    return points


def load(body: bytes) -> Any:
    """``body`` as JSON (NaN and Infinity allowed: :func:`check` refuses them where it reads a number)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise Unusable("not a /mrc document: JSON nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of too many digits
        raise Unusable(f"not a /mrc document: {str(exc).partition(';')[0]}") from None


def check(document: Any) -> dict[str, Any]:
    """The fields of a /mrc document the report reads, each checked (types, finite numbers, ratios in
    [0, 1], points in order): Unusable naming the first that is not.  Other fields are ignored."""
    curves = _field(document, "curves", "/mrc")
    if not isinstance(curves, list):
        raise Unusable(f"curves: expected a list, got {_shown(curves)}")
    checked: dict[str, Any] = {
        "sample_rate": _number(_field(document, "sample_rate", "/mrc"), "sample_rate", 0.0, 1.0),
        "configured_sample_rate": _number(_field(document, "configured_sample_rate", "/mrc"),
                                          "configured_sample_rate", 0.0, 1.0),
        "tracked_keys": _count(_field(document, "tracked_keys", "/mrc"), "tracked_keys"),
        # absent: a server from before it was said, which modelled the service as one cache
        "processes": max(1, _count(document.get("processes", 1), "processes", MAX_PROCESSES)),
        "max_keys": _count(_field(document, "max_keys", "/mrc"), "max_keys"),
        # absent: a server from before they were said, taken as running lru (its default then)
        **{key: _text(document.get(key, "lru"), key) for key in ("curves_model", "l1_policy")},
        "curves": [],
    }
    for index, curve in enumerate(curves):
        at = f"curves[{index}]"
        checked["curves"].append({
            **{key: _text(_field(curve, key, at), f"{at}.{key}") for key in ("tier", "model_name", "cache_salt")},
            "capacity_bytes": _count(_field(curve, "capacity_bytes", at), f"{at}.capacity_bytes", MAX_BYTES),
            "sampled_accesses": _count(_field(curve, "sampled_accesses", at), f"{at}.sampled_accesses"),
            "measured_hit_ratio": _measured(curve, at),
            "points": _points(_field(curve, "points", at), f"{at}.points"),
        })
    return checked


def _measured(curve: Any, where: str) -> float | None:
    """The curve's measured hit ratio: None where not measured yet (null) or not said (an older server)."""
    value = curve.get("measured_hit_ratio") if isinstance(curve, dict) else None
    return None if value is None else _number(value, f"{where}.measured_hit_ratio", 0.0, 1.0)


def hit_ratio_at(points: list[tuple[float, float]], capacity: float) -> float | None:
    """The curve's hit ratio at ``capacity`` (log-linear between points; None outside them)."""
    for (low, low_ratio), (high, high_ratio) in zip(points, points[1:]):
        if low <= capacity <= high:
            share = math.log(capacity / low) / math.log(high / low) if 0 < low < high else 0.0
            return low_ratio + share * (high_ratio - low_ratio)
    return None


def capacity_for(points: list[tuple[float, float]], target: float) -> tuple[str, float] | None:
    """(bound, capacity): the smallest capacity whose hit ratio reaches ``target`` ("" bound), at most the
    first point ("≤ "), or beyond the last ("> "); None without points."""
    if not points:
        return None
    if points[0][1] >= target:
        return "≤ ", points[0][0]
    for (low, low_ratio), (high, high_ratio) in zip(points, points[1:]):
        if high_ratio >= target:
            if low <= 0:
                return "≤ ", high
            share = (target - low_ratio) / (high_ratio - low_ratio)
            return "", low * (high / low) ** share
    return "> ", points[-1][0]


def _bound(needed: tuple[str, float]) -> str:
    return needed[0] + human_bytes(needed[1])


def human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cell(text: str) -> str:
    """``text`` for one line on a terminal: control and other unprintable characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def render(document: dict[str, Any], target: float) -> str:
    """The report of a checked document: a header about the sampling and the capacities, then one row per
    curve."""
    processes = document["processes"]
    lines = [f"sample rate {document['sample_rate']:.6g} (configured {document['configured_sample_rate']:g}); "
             f"{document['tracked_keys']} of at most {document['max_keys']} keys tracked",
             f"capacity: the whole service's ({processes} cache process{'es' if processes > 1 else ''}); "
             "per process: each one's own cache (tier l1: what --l1-size takes)",
             "measured: the share of the same sampled chunks the lookups found (a usable prefix); now … 4×: predicted"]
    model, policy = document["curves_model"], document["l1_policy"]
    predicts = model == policy
    if not predicts:  # a server whose curves model another order than L1's: no prediction shown as one
        lines.append(_cell(f"the curves model --l1-policy {model}; L1 runs --l1-policy {policy}: no hit ratio or "
                           f"capacity is predicted (restart with --l1-policy {model} for a prediction)"))
    header = ("tier", "model_name", "cache_salt", "capacity", "per process", "sampled", "measured",
              *(name for name, _ in WHAT_IF), f"for {target:.0%}", "per process")
    rows = [header]
    for curve in document["curves"]:
        points, capacity = curve["points"], curve["capacity_bytes"]
        ratios = [hit_ratio_at(points, capacity * factor) if predicts else None for _, factor in WHAT_IF]
        needed = capacity_for(points, target) if predicts else None
        measured = curve["measured_hit_ratio"]
        rows.append((*(_cell(curve[key]) for key in ("tier", "model_name", "cache_salt")), human_bytes(capacity),
                     human_bytes(capacity / processes), str(curve["sampled_accesses"]),
                     "-" if measured is None else f"{measured:.3f}",
                     *("-" if r is None else f"{r:.3f}" for r in ratios),
                     "-" if needed is None else _bound(needed),
                     "-" if needed is None else _bound((needed[0], needed[1] / processes))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if len(rows) == 1:
        lines.append("no curves yet: no sampled lookup has reached the telemetry process")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-report", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the telemetry HTTP endpoint, as for /metrics, or its /metrics or /mrc (default "
                        f"{DEFAULT_URL})")
    parser.add_argument("--target-hit-ratio", type=float, default=0.8,
                        help="the hit ratio to size for, in (0, 1] (default 0.8)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the endpoint's whole answer (default 5)")
    parser.add_argument("--json", action="store_true", help="print the /mrc document as it came")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)
    if not 0 < args.target_hit_ratio <= 1:
        parser.error("--target-hit-ratio: expected a number in (0, 1]")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN too
        parser.error(f"--timeout: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    try:
        document = load(fetch(args.url, args.timeout))
        checked = check(document)
    except Unusable as exc:
        # escaped: the reason may quote what the server sent
        print(_cell(f"mpcache-report: error: cannot read the curves from {args.url}: {exc}"), file=sys.stderr)
        return 2
    print(json.dumps(document, indent=2) if args.json else render(checked, args.target_hit_ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
