"""``python -m benchmarks {publish,drain,e2e,soak,checkpoint,scrape,lmcache,isolation,l1,mixed,l2,mrc,
mrc_policy,trace,peers,vllm,report} [--json]``; ``report`` runs them all and writes ``docs/PERFORMANCE.md`` (or
``--output``) and its raw results beside it (``docs/PERFORMANCE.json``);
``lmcache`` and ``isolation`` need LMCache's venv (``.ci/lmcache-env``), ``isolation`` valgrind too, ``peers`` root
(it makes a second local user), ``vllm`` vLLM's venv (``.ci/vllm-env``) and LMCache's, ``trace`` a trace file
(``trace PATH``), and each is left out of the report, saying so, without them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import stat
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks import (
    checkpoint,
    drain,
    e2e,
    isolation,
    l1,
    l2,
    lmcache,
    lmcache_servers,
    mixed_sizes,
    mrc,
    mrc_policy,
    peers,
    publish,
    scrape,
    soak,
    trace,
    trace_sim,
    vllm,
)
from benchmarks.arguments import whole_number
from mpcache.config.derived import L1_POLICIES
from mpcache.config.model import NICE_MAX

BENCHMARKS = {"publish": publish, "drain": drain, "e2e": e2e, "soak": soak, "checkpoint": checkpoint,
              "scrape": scrape, "lmcache": lmcache, "isolation": isolation, "l1": l1, "mixed": mixed_sizes, "l2": l2,
              "mrc": mrc, "mrc_policy": mrc_policy, "trace": trace, "peers": peers, "vllm": vllm}
DEFAULT_REPETITIONS = 3
# a benchmark cannot run
MISSING = (lmcache_servers.LMCacheEnvMissing, l2.RedisMissing, isolation.ValgrindMissing, trace.TraceMissing,
           peers.SecondUserMissing, vllm.VllmEnvMissing)


def _machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} vCPU ({model}), Python {platform.python_version()}, "
            f"{platform.system()} {platform.machine()}")


def _row(name: str, result: dict[str, Any]) -> list[str]:
    met = result.get("targets_met", {})
    verdict = ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()) or "—"
    if name == "publish":
        return [f"ours {result['ring_ns']:.0f} ns/event ({result['publish_path']} writer; by name "
                f"{result['ring_by_name_ns']:.0f}; Python floor "
                f"{result['floor_ns']:.0f}); in-process bus {result['inprocess_bus_ns']:.0f}; mp.Queue "
                f"{result['mp_queue_ns']:.0f}", f"{result['ratio_inprocess_over_ring']}× / "
                f"{result['ratio_mp_queue_over_ring']}× cheaper", "≤ 400 ns; ≥ 3×; ≥ 10×", verdict]
    if name == "drain":
        return [f"ours {result['events_per_s']:,} events/s; reference {result['reference_events_per_s']:,}",
                f"{result['ratio']}×", "≥ 1,000,000/s; ≥ 6×", verdict]
    if name == "e2e":
        cpu = result["cache_cpu_us_per_op"]
        return [f"off {result['off_ops_per_s']:,.0f}; rings {result['rings_ops_per_s']:,.0f}; in-process "
                f"{result['inprocess_ops_per_s']:,.0f} ops/s; cache processes' CPU per op {cpu['none']} / "
                f"{cpu['ring']} / {cpu['inprocess']} µs", f"rings/off {result['rings_over_off']}; "
                f"in-process/off {result['inprocess_over_off']}", "rings ≥ 0.97 of off; rings > in-process", verdict]
    if name == "soak":
        return [f"{result['achieved_events_per_s']:,} events/s for {result['seconds']:.0f} s; drops {result['drops']}; "
                f"lag p50 {result['lag_p50_s'] * 1000:.1f} ms, p99 {result['lag_p99_s'] * 1000:.1f} ms; memory "
                f"{result['rss_start_mb']} → {result['rss_end_mb']} MiB", "—", "0 drops; p99 < 50 ms; flat memory",
                verdict]
    if name == "checkpoint":
        parts, shares = [], []
        for every in ("15", "1"):
            entry = result[f"scraped every {every} s"]
            parts.append(f"scraped every {every} s: {entry['on_us_per_event']} µs per event with checkpoints every "
                         f"{result['checkpoint_interval_s']:g} s ({entry['on_checkpoints_per_repetition']:.0f} per "
                         f"repetition), {entry['every_flush_us_per_event']} µs with one at every flush, "
                         f"{entry['off_us_per_event']} µs without")
            shares.append(f"{every} s: {entry['on_over_off']} ({entry['every_flush_over_off']} at every flush)")
        counted = result["counted"]
        if counted is not None:
            shares.append(f"counted {counted['on_over_off']} ({counted['every_flush_over_off']} at every flush)")
        return [f"the demo's stream at its rate ({result['events_per_s']:,} events/s), side by side; "
                + "; ".join(parts), "on/off " + "; ".join(shares), "≤ 1.03", verdict]
    if name == "lmcache":
        cpu = result["cpu"]
        ms = cpu["cpu_ms_per_request"]
        p99 = "; ".join(f"TP={tp} " + ", ".join(f"{op} {v:.2f}" for op, v in cpu[f"tp{tp}"]["server_op_p99_ms"].items()
                                                 if op in ("lookup", "prepare_store", "prepare_retrieve"))
                        for tp in result["tp"])
        return [f"mpcache {result['mpcache_rps']:,.1f} req/s (telemetry off {result['mpcache_off_rps']:,.1f}); "
                f"LMCache {result['lmcache_rps']:,.1f} (observability off {result['lmcache_off_rps']:,.1f}); "
                f"TP {result['tp']}, {result['object_bytes_per_rank'] >> 20} MiB chunk objects; CPU per request: "
                f"cache {ms['mpcache']['cache']:.3f} ms + telemetry {ms['mpcache']['telemetry']:.3f} ms, LMCache's "
                f"server {ms['lmcache']['server']:.3f} ms; side by side, cache with / without publishing "
                + ", ".join(f"TP={tp} {side['mpcache']:.3f} / {side['mpcache_off']:.3f} ms"
                            for tp, side in ((tp, cpu["side_by_side"][f"tp{tp}"]) for tp in result["tp"]))
                + f"; server-side p99 ms {p99}",
                f"vs LMCache {result['ratio_vs_lmcache']}×; on/off {result['telemetry_on_over_off']}; cache CPU "
                f"{cpu['cache_cpu_over_lmcache']}× LMCache's, with telemetry "
                f"{cpu['cache_and_telemetry_cpu_over_lmcache']}×; "
                f"publishing {cpu['publish_cpu_cost']:+.1%}",
                "≥ 1.0× LMCache; on ≥ 0.97 of off; CPU ≤ 0.25× (≤ 0.30× with telemetry); telemetry ≤ 0.1 ms; "
                "publishing ≤ +3 %; p99 ≤ 1 ms", verdict]
    if name == "isolation":
        cells = []
        for tp in result["tp"]:
            entry = result[f"tp{tp}"]
            on, off = entry["per_request"]["mpcache"], entry["per_request"]["mpcache_off"]
            cells.append(f"TP={tp}: {on['instructions']:,.0f} / {off['instructions']:,.0f} instructions per request, "
                         f"L1 data misses {on['l1_data_misses']:,.0f} / {off['l1_data_misses']:,.0f}, last-level "
                         f"{on['last_level_misses']:,.0f} / {off['last_level_misses']:,.0f} ({entry['requests']} "
                         "requests)")
        versus = []
        for tp in result["tp"]:
            net = result[f"tp{tp}"]["net_per_request"]
            versus.append(f"TP={tp}: {net['mpcache']['instructions']:,.0f} / {net['lmcache']['instructions']:,.0f}")
        return ["cache process publishing on / off (callgrind): " + "; ".join(cells) + "; publishing cache process / "
                "LMCache's server, instructions per request net of idle: " + "; ".join(versus),
                f"publishing {result['instructions_cost']:+.2%} instructions; cache "
                f"{result['cache_instructions_over_lmcache']:.4f}× LMCache's server (worst TP)",
                "≤ +3 %; ≤ 0.25×", verdict]
    if name == "peers":
        phases = [f"{phase}: p99 {result[phase]['p99_ms']} ms, fresh registrations ≤ {result[phase]['fresh_max_s']} s"
                  for phase in ("alone", "held", "flood")]
        return ["; ".join(phases) + f" ({result['held']['foreign_connections']:,} foreign connections held, "
                f"{result['flood']['foreign_connections']:,} flooded)",
                f"p99 held/alone {result['held_p99_over_alone']}×, flood/alone {result['flood_p99_over_alone']}×",
                "p99 ≤ 50 ms; fresh ≤ 1 s", verdict]
    if name == "mixed":
        pressures = "; ".join(
            f"{name} a round: uniform {p['uniform']['hit_ratio']}, mixed {p['mixed']['hit_ratio']} (exact LRU "
            f"{p['uniform']['ideal_lru_hit_ratio']} / {p['mixed']['ideal_lru_hit_ratio']})"
            for name, p in result["pressures"].items())
        return [f"a well-behaved client's hit ratio beside {len(result['mixed_object_bytes'])} registrations pushing "
                f"the same bytes through {result['l1_bytes'] >> 20} MiB of L1 per registration: {pressures}",
                f"cost of mixed sizes at worst {result['worst_cost_of_mixed']}", "≤ 0.05", verdict]
    if name == "l1":
        return [f"hit ratio {result['bytes']['hit_ratio']:.3f} by bytes, {result['slots']['hit_ratio']:.3f} in "
                f"largest-model slots; resident objects fill {result['bytes']['resident_object_fraction']:.0%} vs "
                f"{result['slots']['resident_object_fraction']:.0%} of L1; store {result['bytes_store_us']} µs vs "
                f"{result['slot_store_us']} µs per chunk",
                f"hit {result['hit_ratio_bytes_over_slots']}×; bytes {result['resident_bytes_over_slots']}×; "
                f"CPU {result['cpu_ratio_bytes_over_slots']}×", "hit > 1×; CPU ≤ 1.5× slots", verdict]
    if name == "l2":
        single, cluster = result["single"], result["cluster"]
        return [f"single: store {single['ours']['store_GBps']:.2f} GB/s, load {single['ours']['load_GBps']:.2f} GB/s, "
                f"lookup p50 {single['ours']['lookup_p50_us']:.0f} µs p99 {single['ours']['lookup_p99_us']:.0f} µs; "
                f"cluster: store {cluster['ours']['store_GBps']:.2f}, load {cluster['ours']['load_GBps']:.2f} GB/s, "
                f"lookup p50 {cluster['ours']['lookup_p50_us']:.0f} µs p99 {cluster['ours']['lookup_p99_us']:.0f} µs; "
                f"hit ratio {result['hit_ratio']['sharded_16']:.3f} (16 shards) vs "
                f"{result['hit_ratio']['unsharded']:.3f} (1)",
                f"vs raw pipeline: single store {single['ratio']['store_GBps']}×, "
                f"load {single['ratio']['load_GBps']}×; "
                f"cluster store {cluster['ratio']['store_GBps']}×, load {cluster['ratio']['load_GBps']}×; hit "
                f"{result['hit_ratio_sharded_over_unsharded']}×", "—", "—"]
    if name == "trace":
        cells = [f"{n} L1 ({s['blocks']:,} blocks): hit ratio offline LRU {s['offline_lru']['hit_ratio']:.3f}, "
                 f"Belady {s['belady']['hit_ratio']:.3f}, mpcache adaptive / lru / arc "
                 f"{s['mpcache_adaptive']['hit_ratio']:.3f} / {s['mpcache_lru']['hit_ratio']:.3f} / "
                 f"{s['mpcache_arc']['hit_ratio']:.3f}"
                 + (f", LMCache's server {s['lmcache_server']['hit_ratio']:.3f}" if "lmcache_server" in s else "")
                 for n, s in result["sizes"].items()]
        ratios = ", ".join(f"{n} {v}" for n, v in result["mpcache_adaptive_over_offline_lru"].items())
        return ["; ".join(cells), f"mpcache (adaptive) / offline LRU tokens saved: {ratios}", "—", "—"]
    if name == "vllm":
        ms = result["median_ms"]
        return [f"{result['model_parameters'] / 1e6:.0f}M-parameter Llama on CPU, a {result['prompt_tokens']:,}-token "
                f"prompt repeated ({result['repetitions']} times, medians): prefill no connector "
                f"{ms['none']['prefill_s']:.0f} ms, mpcache {ms['mpcache']['prefill_s']:.0f} ms, LMCache "
                f"{ms['lmcache']['prefill_s']:.0f} ms; time to first token {ms['none']['ttft_s']:.0f} / "
                f"{ms['mpcache']['ttft_s']:.0f} / {ms['lmcache']['ttft_s']:.0f} ms"
                + ("" if "before_prefill_s" not in ms["mpcache"] else
                   f" (before prefill {ms['none']['before_prefill_s']:.0f} / {ms['mpcache']['before_prefill_s']:.0f}"
                   f" / {ms['lmcache']['before_prefill_s']:.0f} ms)")
                + "; tokens loaded per request "
                f"{result['loaded_tokens_per_request']['mpcache']} / {result['loaded_tokens_per_request']['lmcache']}",
                f"prefill {result['prefill_none_over_mpcache']}× faster with mpcache, "
                f"{result['prefill_none_over_lmcache']}× with LMCache; LMCache / mpcache "
                f"{result['prefill_lmcache_over_mpcache']}× (time to first token "
                f"{result['ttft_lmcache_over_mpcache']}×)",
                "—", "—"]
    if name == "mrc":
        demo, kv = result["demo"], result["kv"]
        long = result["replay_mae_by_rate"]["long (replay only)"]
        return [f"MAE vs exact {kv['policy']}: demo {demo['mae_online_vs_exact']}, kv {kv['mae_online_vs_exact']} "
                f"(rate "
                f"{kv['sample_rate']:g}); predicted − measured at ½×/2× L1: demo {demo['half_error']}/"
                f"{demo['double_error']}, kv {kv['half_error']}/{kv['double_error']}; long prompts (replayed, "
                f"{long['share of accesses past the exact chunks']:.0%} of accesses sampled at 1 %): MAE "
                f"{long['0.01']}, {long['0.1']} at rate 0.1; curve set "
                f"{result['curve_set_bytes_at_max_keys'] / 2**20:.1f} MiB at {result['max_keys']} keys",
                f"CPU sampling on/off {result['sampling_cost']['cpu_on_over_off']}; sampling calls "
                f"{result['sampling_cost']['sampler_share']:.2%} of a request's CPU",
                "MAE ≤ 0.01; within 0.02; ≤ 1.01", verdict]
    if name == "mrc_policy":
        rates = [key for key in result if key.startswith("rate ")]
        numbers = "; ".join(f"{key}: " + ", ".join(
            f"{policy} {value:,} records/s ({result[key]['bytes_held'][policy] / 2**20:.1f} MiB)"
            for policy, value in result[key]["records_per_s"].items()) for key in rates)
        ratios = "; ".join(f"{key}: " + ", ".join(
            f"{policy}/lru {value}" for policy, value in result[key]["over_lru"].items() if policy != "lru")
            for key in rates)
        return [numbers, ratios, "—", verdict]
    return [f"{result['scrape_s'] * 1000:.0f} ms (max {result['scrape_max_s'] * 1000:.0f} ms), "
            f"{result['page_bytes'] / 1024:.0f} KiB", "—", "—", verdict]


ANALYSIS_HEADING = "## Analysis"
RAW_HEADING = "## Raw results"


def raw_results_path(path: str) -> str:
    """Where the report's raw results go: beside the page, as JSON (docs/PERFORMANCE.md → docs/PERFORMANCE.json),
    so that the page stays short."""
    return os.path.splitext(path)[0] + ".json"


def write_report(results: dict[str, dict[str, Any]], path: str) -> None:
    """Write the table, and the raw results to :func:`raw_results_path`; the hand-written section from
    ``## Analysis`` up to the raw results is kept."""
    analysis = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            existing = handle.read()
        if ANALYSIS_HEADING in existing:
            analysis = existing[existing.index(ANALYSIS_HEADING):]
            analysis = analysis.split("\n" + RAW_HEADING, 1)[0]
    lines = [
        "# Performance",
        "",
        f"Measured {datetime.date.today().isoformat()} on {_machine()}, by `python -m benchmarks report` "
        "(each benchmark measures our way and its comparison in the same run; the machine is shared, so the "
        "ratios are the numbers to trust).",
        "",
        "| benchmark | numbers | ratio | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        lines.append(f"| `{name}` | " + " | ".join(_row(name, result)) + " |")
    raw = raw_results_path(path)
    lines += ["", analysis.rstrip() + "\n" if analysis else "", RAW_HEADING, "",
              f"Every number of the table above, as the benchmarks returned it: [{os.path.basename(raw)}]"
              f"({os.path.basename(raw)}).", ""]
    _replace(raw, json.dumps(results, indent=1, sort_keys=True) + "\n")
    _replace(path, "\n".join(lines))


def _replace(path: str, text: str) -> None:
    """``path`` now holds ``text``: written whole to a new 0600 file beside it, then renamed over it, so that a
    link at ``path`` is replaced, never written through, and an interrupted write leaves the old file as it was."""
    fd, draft = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial",
                                 dir=os.path.dirname(path) or ".")
    try:
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(draft, path)
    except BaseException:
        os.unlink(draft)
        raise


def report_output_problem(path: str) -> str | None:
    """Why the report cannot be written to ``path`` and its raw results beside it (checked before any benchmark
    runs, hours before they are written), or None."""
    raw = raw_results_path(path)
    if os.path.abspath(raw) == os.path.abspath(path):
        return f"{path}: the raw results go to {raw}, the page itself: name a page that does not end in .json"
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    for name in (path, raw):
        if os.path.lexists(name) and not stat.S_ISREG(os.lstat(name).st_mode):
            return f"{name} is there and not a regular file (a link or a directory is not replaced)"
    return None


# The benchmarks each flag is for (``report`` passes each to them all); given to another, it is refused, not ignored
FLAG_USERS = {"PATH": {"trace"}, "--trace-requests": {"trace"}, "--no-lmcache": {"trace"},
              "--seconds": {"soak", "lmcache", "isolation", "peers"}, "--warmup": {"lmcache", "isolation"},
              "--l1-gb": {"lmcache", "isolation", "vllm"}, "--policies": {"isolation"}, "--tp": {"isolation"},
              "--workload": {"isolation"}, "--telemetry-nice": {"lmcache"}, "--rate": {"soak"}, "--output": set()}
FLAG_DESTS = {flag: "path" if flag == "PATH" else flag.lstrip("-").replace("-", "_") for flag in FLAG_USERS}


def _finite(above_zero: bool, noun: str = "seconds") -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (``above_zero``) or at least 0."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
            raise argparse.ArgumentTypeError(f"expected finite {noun} {'> 0' if above_zero else '>= 0'}, got {text!r}")
        return value
    return number


def _tps(text: str) -> tuple[int, ...]:
    tps = tuple(whole_number(1)(part) for part in text.split(","))
    if len(set(tps)) < len(tps):
        raise argparse.ArgumentTypeError(f"a TP named twice in {text!r}")
    return tps


def _policies(text: str) -> tuple[str, ...]:
    policies = tuple(text.split(","))
    unknown = [policy for policy in policies if policy not in L1_POLICIES]
    if unknown or len(set(policies)) < len(policies):
        raise argparse.ArgumentTypeError(f"expected distinct ones of {', '.join(L1_POLICIES)}, comma-separated, "
                                         f"got {text!r}")
    return policies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("name", choices=sorted(BENCHMARKS) + ["report"], help="which benchmark to run")
    parser.add_argument("path", nargs="?", default=None,
                        help="trace (and report): a trace file of prefix block hashes, one JSON object a line")
    parser.add_argument("--trace-requests", type=whole_number(1), default=None,
                        help="trace: replay only the trace's first N requests (default: all)")
    parser.add_argument("--no-lmcache", action="store_true",
                        help="trace: leave out LMCache's own server (its column needs the LMCache venv)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repetitions", type=whole_number(1), default=None,
                        help="repetitions; medians are reported (default 3; publish uses at least 5; isolation "
                        "reports the worst; vllm 19; trace: LMCache's server's runs, mpcache's replay being "
                        "deterministic)")
    parser.add_argument("--seconds", type=_finite(above_zero=True), default=None,
                        help="soak: how long the producers run (default 60); lmcache: measured seconds per server "
                        "and TP (default 10); isolation: counted seconds per TP (default 60); peers: per phase "
                        "(default 20)")
    parser.add_argument("--warmup", type=_finite(above_zero=False), default=None,
                        help="lmcache: seconds of load before measuring (default 3); isolation: uncounted seconds "
                        "per TP (default 15)")
    parser.add_argument("--l1-gb", type=_finite(above_zero=True, noun="GiB"), default=None,
                        help="lmcache: every server's L1 in GiB (default 0.25); isolation: the same (default 4); "
                        "vllm: the same (default 0.5)")
    parser.add_argument("--policies", type=_policies, default=None,
                        help="isolation: compare these --l1-policy values (comma-separated; e.g. lru,adaptive) "
                        "instead of publishing's cost and LMCache's server")
    parser.add_argument("--tp", type=_tps, default=None,
                        help="isolation: the TPs to run, comma-separated (default 1,2)")
    parser.add_argument("--workload", default="mixed", choices=sorted(isolation.WORKLOADS),
                        help="isolation: the request mix (default mixed; unique: every prompt new, so nothing is "
                        "found and a full L1 evicts a chunk per chunk stored: policies compared like for like)")
    parser.add_argument("--telemetry-nice", type=whole_number(0, NICE_MAX), default=0,
                        help="lmcache: start-cache --telemetry-nice for mpcache with telemetry (default 0)")
    parser.add_argument("--rate", type=whole_number(1), default=250_000,
                        help="soak: events/s per producer (default 250000)")
    parser.add_argument("--output", default="docs/PERFORMANCE.md",
                        help="report: where to write (default docs/PERFORMANCE.md)")
    args = parser.parse_intermixed_args(argv)  # trace --json PATH, as well as trace PATH --json

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def one(name: str) -> dict[str, Any]:
        module = BENCHMARKS[name]
        options: dict[str, Any] = {}
        if module is soak:
            options = {"seconds": 60.0 if args.seconds is None else args.seconds, "rate": args.rate}
        elif module is lmcache:
            options = {"seconds": lmcache.SECONDS if args.seconds is None else args.seconds,
                       "warmup_s": lmcache.WARMUP_S if args.warmup is None else args.warmup,
                       "l1_gb": lmcache.L1_GB if args.l1_gb is None else args.l1_gb,
                       "telemetry_nice": args.telemetry_nice}
        elif module is isolation:
            options = {"seconds": isolation.SECONDS if args.seconds is None else args.seconds,
                       "warmup_s": isolation.WARMUP_S if args.warmup is None else args.warmup,
                       "l1_gb": isolation.L1_GB if args.l1_gb is None else args.l1_gb,
                       "policies": args.policies or (),
                       "tps": args.tp or isolation.TPS,
                       "workload": args.workload}
        elif module is vllm:
            options = {"l1_gb": vllm.L1_GB if args.l1_gb is None else args.l1_gb}
        elif module is trace:
            options = {"path": args.path, "limit": args.trace_requests, "lmcache": not args.no_lmcache}
        elif module is peers:
            options = {"seconds": peers.SECONDS if args.seconds is None else args.seconds}
        repetitions = args.repetitions or (vllm.REPETITIONS if module is vllm else DEFAULT_REPETITIONS)
        return module.run(repetitions=repetitions, progress=progress, **options)

    if args.name != "report" and (unused := sorted(
            flag for flag, dest in FLAG_DESTS.items()
            if getattr(args, dest) != parser.get_default(dest) and args.name not in FLAG_USERS[flag])):
        parser.error(f"{' and '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing for {args.name}: "
                     + "; ".join(f"{flag} is for {', '.join(sorted(FLAG_USERS[flag] | {'report'}))}"
                                 for flag in unused))
    if args.name == "report" and (problem := report_output_problem(args.output)):
        parser.error(f"--output: {problem}")
    if args.path is not None and args.name in ("trace", "report"):
        try:  # before anything runs: a report would otherwise fail on it after the benchmarks before it
            trace_sim.load(args.path, args.trace_requests)
        except trace_sim.TraceUnreadable as exc:
            parser.error(f"not a readable Mooncake-format trace: {exc}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: children and segments go too
    try:
        return _run(args, one, progress)
    except KeyboardInterrupt:
        progress("interrupted: the benchmark's child processes and shared memory were cleaned up")
        return 130
    except MISSING as exc:
        progress(f"python -m benchmarks {args.name}: error: {exc}")
        return 2


def _run(args: argparse.Namespace, one: Callable[[str], dict[str, Any]], progress: Callable[[str], None]) -> int:
    if args.name == "report":
        results = {}
        for name in BENCHMARKS:
            try:
                result = one(name)
            except MISSING as exc:
                progress(f"report: leaving out {name}: {exc}")
                continue
            results[name] = getattr(BENCHMARKS[name], "for_report", lambda r: r)(result)  # what the file keeps
        write_report(results, args.output)
        progress(f"wrote {args.output} and {raw_results_path(args.output)}")
        return 0
    result = one(args.name)
    render = getattr(BENCHMARKS[args.name], "render", None)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif render is not None:
        print(render(result))
    else:
        for key, value in result.items():
            print(f"{key:>32}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
