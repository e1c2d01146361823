"""``python -m benchmarks vllm``'s arithmetic and its report row (synthetic samples: no engine runs here; the
benchmark itself runs vLLM and is run by hand, docs/BENCHMARKS.md), and its one line without vLLM's venv."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import psutil
from support.performance_docs import doc, flattened, raw_results

from benchmarks import __main__ as bench_main
from benchmarks import vllm


def sample(prefill_s: float, loaded: int) -> dict[str, float]:
    return {"ttft_s": prefill_s + 0.01, "prefill_s": prefill_s, "loaded_tokens": loaded,
            "computed_tokens": vllm.PROMPT_TOKENS - loaded, "others_cpu_s": prefill_s / 100}


def test_ratios_are_the_connector_less_medians_over_each_caches_medians(tmp_path) -> None:
    """Medians per engine over the repetitions, and the ratios of those medians; the work compares when both caches
    loaded the same tokens on every request."""
    samples = {"none": [sample(s, 0) for s in (0.7, 0.9, 0.8)],
               "mpcache": [sample(s, 1792) for s in (0.1, 0.3, 0.2)],
               "lmcache": [sample(s, 1792) for s in (0.4, 0.2, 0.25)]}
    first = {kind: sample(0.8, 0) for kind in vllm.KINDS}
    model = {"parameters": 110_000_000, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000}
    result = vllm._result(model, first, samples, 3, 0.5, 0)
    assert {"none": 800.0, "mpcache": 200.0, "lmcache": 250.0} == {
        kind: result["median_ms"][kind]["prefill_s"] for kind in vllm.KINDS}
    assert (4.0, 3.2, 1.25) == (result["prefill_none_over_mpcache"], result["prefill_none_over_lmcache"],
                                result["prefill_lmcache_over_mpcache"])
    assert 10.0 == result["median_ms"]["mpcache"]["before_prefill_s"]  # every sample's ttft is its prefill + 10 ms
    assert {"none": 10.0, "mpcache": 10.0, "lmcache": 10.0} == result["longest_before_prefill_ms"]
    samples["mpcache"][2] = {**samples["mpcache"][2], "ttft_s": samples["mpcache"][2]["prefill_s"] + 0.05}
    waited = vllm._result(model, first, samples, 3, 0.5, 0)
    assert (10.0, 50.0) == (waited["median_ms"]["mpcache"]["before_prefill_s"],
                            waited["longest_before_prefill_ms"]["mpcache"])
    assert [10.0, 10.0, 50.0] == waited["before_prefill_ms"]["mpcache"]  # each request's, in the order sent
    assert [1, 3, 2] == waited["others_cpu_ms"]["mpcache"] and 0 == waited["not_quiet"]
    assert "before prefill   10.0 ms (longest 50.0)" in vllm.render(waited)
    assert result["comparable_work"] and [1792] == result["loaded_tokens_per_request"]["mpcache"]
    samples["lmcache"][1] = sample(0.2, 1536)
    assert not vllm._result(model, first, samples, 3, 0.5, 0)["comparable_work"]

    path = tmp_path / "PERFORMANCE.md"
    bench_main.write_report({"vllm": result}, str(path))
    [row] = [line for line in path.read_text().splitlines() if line.startswith("| `vllm`")]
    assert "prefill no connector 800 ms, mpcache 200 ms, LMCache 250 ms" in row
    assert "(before prefill 10 / 10 / 10 ms)" in row
    assert "prefill 4.0× faster with mpcache, 3.2× with LMCache; LMCache / mpcache 1.25×" in row


SPIN = ("import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
        "print('stopped', flush=True)\ntime.sleep(60)")  # spins for argv[1] seconds of its CPU, says so, then sleeps


def _spinner(seconds: float) -> subprocess.Popen:
    """A child that spins for ``seconds`` of CPU (however loaded the machine), then says so and sleeps."""
    return subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)], stdout=subprocess.PIPE, text=True)


def test_a_request_waits_until_the_other_processes_stop_spinning() -> None:
    """vLLM's worker spins for a second after each step: ``wait_quiet`` returns once a spinning process has stopped
    (it said so before the wait ended), not before."""
    child = _spinner(1.0)
    try:
        quiet = vllm.wait_quiet(lambda: vllm.tree_cpu_times([child.pid]))
        said, _, _ = select.select([child.stdout], [], [], 0)
        assert quiet and said
    finally:
        child.kill()
        child.wait()


def test_a_process_that_never_stops_is_waited_for_until_the_timeout() -> None:
    """A process that spins throughout is never quiet: the wait ends at its timeout, saying so."""
    child = _spinner(20.0)
    try:
        started = time.monotonic()
        assert not vllm.wait_quiet(lambda: vllm.tree_cpu_times([child.pid]), timeout_s=0.5)
        assert 0.5 <= time.monotonic() - started < 5.0
    finally:
        child.kill()
        child.wait()


def test_a_process_gone_or_started_between_readings_is_no_quiet_window() -> None:
    """CPU used is counted per process (pid and start time): one that exits, taking its seconds out of the sum,
    does not hide another's spin, and one started since counts all it used (fake readings, no process)."""
    spinning, exited, started = (10, 1.0), (11, 1.0), (12, 5.0)
    assert 0.5 == vllm.cpu_used({spinning: 2.0, exited: 9.0}, {spinning: 2.5})
    assert 0.3 == vllm.cpu_used({spinning: 2.0}, {spinning: 2.0, started: 0.3})
    assert 0.0 == vllm.cpu_used({(10, 1.0): 2.0}, {(10, 7.0): 0.0})  # the pid used again, by a new process
    readings = iter([{spinning: 2.0, exited: 9.0}] + [{spinning: 2.0 + step / 10} for step in range(1, 100)])
    assert not vllm.wait_quiet(lambda: next(readings), window_s=0.01, timeout_s=0.2)


def test_the_quiet_windows_must_follow_one_another() -> None:
    """One quiet window between two busy ones is not quiet enough (a spinning process between two ticks)."""
    clock = iter([0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0])
    assert vllm.wait_quiet(lambda: {(1, 0.0): next(clock)}, window_s=0.01, timeout_s=5.0)
    assert [] == list(clock)  # it read until two windows in a row were quiet: the last two


def test_a_process_tree_s_cpu_counts_its_children_and_nothing_of_the_gone() -> None:
    """The CPU of a process includes its descendants' (vLLM's engine core and worker run under its front end), each
    counted once however often named; a pid that is gone counts nothing."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', sys.argv[1], '0.3'])\ntime.sleep(60)", SPIN])
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = psutil.Process(parent.pid).children()
        while sum(child.cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        times = vllm.tree_cpu_times([parent.pid, parent.pid, child.pid])
        assert {parent.pid, child.pid} == {pid for pid, _ in times}
        assert times[(child.pid, child.create_time())] >= 0.3
    finally:
        for process in psutil.Process(parent.pid).children():
            process.kill()
        parent.kill()
        parent.wait()
    assert {} == vllm.tree_cpu_times([parent.pid])


def test_without_vllms_venv_the_benchmark_says_so_in_one_line(tmp_path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "MPCACHE_TEST_VLLM_PYTHON"}
    env["MPCACHE_TEST_VLLM_VENV"] = str(tmp_path / "no-venv")
    bench = subprocess.run([sys.executable, "-m", "benchmarks", "vllm", "--json"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert (2, "") == (bench.returncode, bench.stdout)
    assert 1 == len(bench.stderr.strip().splitlines()) and ".ci/vllm-env" in bench.stderr


def test_performance_md_before_prefill_prose_is_the_benchmark_s_raw_output() -> None:
    """docs/PERFORMANCE.md's numbers of the runs kept as ``vllm_before_prefill`` are read from their raw output: the
    medians of the time before prefill, the differences of the medians beside them, the longest waits, the last run's
    waits in the order sent, and each run's medians."""
    runs = raw_results()["vllm_before_prefill"]["runs"]
    prose = flattened(doc("PERFORMANCE.md"))
    assert [run["repetitions"] for run in runs] == [5, 11, 11, 11]

    def listed(values: list[str]) -> str:
        return ", ".join(values[:-1]) + " and " + values[-1]

    def medians(kind: str, field: str) -> str:
        return listed([f"{run['median_ms'][kind][field]:.1f}" for run in runs])

    def gaps(kind: str) -> str:
        return listed([f"{run['median_ms'][kind]['ttft_s'] - run['median_ms'][kind]['prefill_s']:.1f}" for run in runs])

    def longest(kind: str) -> str:
        return listed([f"{run['longest_before_prefill_ms'][kind]:.1f}" for run in runs[2:]])

    def triples(field: str) -> str:
        return listed([" / ".join(f"{run['median_ms'][kind][field]:.0f}" for kind in vllm.KINDS) for run in runs])

    last = runs[-1]["before_prefill_ms"]
    assert (f"read a median of {medians('mpcache', 'before_prefill_s')} ms before prefill with mpcache against "
            f"LMCache's {medians('lmcache', 'before_prefill_s')} ms ({medians('none', 'before_prefill_s')} ms with no "
            f"connector), and differences of the medians of {gaps('mpcache')} ms for mpcache (LMCache "
            f"{gaps('lmcache')})") in prose
    assert (f"longest waits were {longest('mpcache')} ms with mpcache, {longest('lmcache')} ms with LMCache and "
            f"{longest('none')} ms with no connector") in prose
    assert (f"mpcache's requests waited {', '.join(f'{v:.1f}' for v in last['mpcache'])} ms, and LMCache's "
            f"{', '.join(f'{v:.1f}' for v in last['lmcache'])} ms") in prose
    over = [sum(1 for v in last[kind] if v > 50) for kind in ("mpcache", "lmcache")]
    assert f"waited more than 50 ms in {over[0]} and {over[1]} of the {len(last['mpcache'])} requests" in prose
    assert f"Prefill no connector / mpcache / LMCache {triples('prefill_s')} ms" in prose
    assert f"time to first token {triples('ttft_s')} ms" in prose
    assert all(run["loaded_tokens_per_request"] == {"none": [0], "mpcache": [1792], "lmcache": [1792]} for run in runs)


def test_performance_md_quiet_run_prose_is_the_benchmark_s_raw_output() -> None:
    """docs/PERFORMANCE.md's numbers of the run kept as ``vllm`` (each request once the others were quiet) are read
    from its raw output."""
    run = raw_results()["vllm"]
    prose = flattened(doc("PERFORMANCE.md"))
    waits, medians, others = run["before_prefill_ms"], run["median_ms"], run["others_cpu_ms"]
    assert 0 == run["not_quiet"] and run["comparable_work"]
    assert (f"(`others_cpu_ms`): at most {max(max(values) for values in others.values())} ms in this run, and no "
            f"request was sent before they were quiet (`not_quiet` {run['not_quiet']}).") in prose

    def spread(kind: str) -> str:
        return f"{min(waits[kind]):.1f}–{max(waits[kind]):.1f} ms"

    assert (f"mpcache waited {spread('mpcache')} (median {medians['mpcache']['before_prefill_s']:.1f}), LMCache's "
            f"server {spread('lmcache')} (median {medians['lmcache']['before_prefill_s']:.1f}), with no connector "
            f"{spread('none')}:") in prose
    prefill = {kind: f"{medians[kind]['prefill_s']:.0f}" for kind in medians}
    loaded = run["loaded_tokens_per_request"]["mpcache"][0]
    assert (f"Prefill took {prefill['mpcache']} ms with mpcache, {prefill['lmcache']} "
            f"ms with LMCache and {prefill['none']} ms without a connector (medians): "
            f"{run['prefill_none_over_mpcache']}× and {run['prefill_none_over_lmcache']}× shorter with a cache, "
            f"LMCache over mpcache {run['prefill_lmcache_over_mpcache']}× (time to first token "
            f"{run['ttft_lmcache_over_mpcache']}×). Both caches loaded {loaded:,} "
            f"of the {run['prompt_tokens']:,} tokens per request.") in prose
    assert f"with no connector {spread('none')}: no wait of either cache reached 30 ms." in prose
    assert max(waits["mpcache"] + waits["lmcache"]) < 30


def test_performance_md_spin_probe_prose_is_the_probe_s_raw_output() -> None:
    """The probe behind the quiet wait, kept as ``vllm_spin_probe``: the others' CPU during a request, the servers',
    and the long waits it saw with both caches, as docs/PERFORMANCE.md says."""
    probe = raw_results()["vllm_spin_probe"]
    requests = probe["requests"]
    prose = flattened(doc("PERFORMANCE.md"))
    others = [sum(ms for name, ms in r["cpu_ms"].items()
                  if name.startswith("engine-") and name != f"engine-{r['kind']}") for r in requests]
    servers = [sum(ms for name, ms in r["cpu_ms"].items() if name.startswith("server-")) for r in requests]
    long = [r for r in requests if r["wait_ms"] > 100]
    assert 3 + 3 * 7 == len(requests) and "7 repetitions" in probe["measured"]
    assert (f"saw the other engines use {min(others):,}–{max(others):,} ms of CPU during a request and the servers "
            f"{min(servers)}–{max(servers)} ms; its waits of more than 100 ms ({min(r['wait_ms'] for r in long)}–"
            f"{max(r['wait_ms'] for r in long)} ms) came with both caches.") in prose
    assert {"mpcache", "lmcache"} == {r["kind"] for r in long}
    changelog = flattened((Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text())
    assert f"a request sent meanwhile waited up to {max(r['wait_ms'] for r in long):.0f} ms for that core" in changelog


def test_performance_md_s_vllm_row_and_date_are_the_kept_run_s() -> None:
    """The table's ``vllm`` row is rendered from PERFORMANCE.json's ``vllm``, and the section names its time."""
    run = raw_results()["vllm"]
    page = doc("PERFORMANCE.md")
    assert "| `vllm` | " + " | ".join(bench_main._row("vllm", run)) + " |" in page.splitlines()
    assert run["measured"].startswith("2026-12-07 02:01 to 02:09 UTC")
    assert "### `vllm`, 2026-12-07, 02:01–02:09 UTC" in page and "`vllm` 2026-12-07, 02:01–02:09 UTC" in page
