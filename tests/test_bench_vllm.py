"""``python -m benchmarks vllm``'s arithmetic and its report row (synthetic samples: no engine runs here; the
benchmark itself runs vLLM and is run by hand, docs/BENCHMARKS.md), and its one line without vLLM's venv."""

from __future__ import annotations

import os
import subprocess
import sys

from support.performance_docs import doc, raw_results

from benchmarks import __main__ as bench_main
from benchmarks import vllm


def sample(prefill_s: float, loaded: int) -> dict[str, float]:
    return {"ttft_s": prefill_s + 0.01, "prefill_s": prefill_s, "loaded_tokens": loaded,
            "computed_tokens": vllm.PROMPT_TOKENS - loaded}


def test_ratios_are_the_connector_less_medians_over_each_caches_medians(tmp_path) -> None:
    """Medians per engine over the repetitions, and the ratios of those medians; the work compares when both caches
    loaded the same tokens on every request."""
    samples = {"none": [sample(s, 0) for s in (0.7, 0.9, 0.8)],
               "mpcache": [sample(s, 1792) for s in (0.1, 0.3, 0.2)],
               "lmcache": [sample(s, 1792) for s in (0.4, 0.2, 0.25)]}
    first = {kind: sample(0.8, 0) for kind in vllm.KINDS}
    model = {"parameters": 110_000_000, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000}
    result = vllm._result(model, first, samples, 3, 0.5)
    assert {"none": 800.0, "mpcache": 200.0, "lmcache": 250.0} == {
        kind: result["median_ms"][kind]["prefill_s"] for kind in vllm.KINDS}
    assert (4.0, 3.2, 1.25) == (result["prefill_none_over_mpcache"], result["prefill_none_over_lmcache"],
                                result["prefill_lmcache_over_mpcache"])
    assert 10.0 == result["median_ms"]["mpcache"]["before_prefill_s"]  # every sample's ttft is its prefill + 10 ms
    assert {"none": 10.0, "mpcache": 10.0, "lmcache": 10.0} == result["longest_before_prefill_ms"]
    samples["mpcache"][2] = {**samples["mpcache"][2], "ttft_s": samples["mpcache"][2]["prefill_s"] + 0.05}
    waited = vllm._result(model, first, samples, 3, 0.5)
    assert (10.0, 50.0) == (waited["median_ms"]["mpcache"]["before_prefill_s"],
                            waited["longest_before_prefill_ms"]["mpcache"])
    assert [10.0, 10.0, 50.0] == waited["before_prefill_ms"]["mpcache"]  # each request's, in the order sent
    assert "before prefill   10.0 ms (longest 50.0)" in vllm.render(waited)
    assert result["comparable_work"] and [1792] == result["loaded_tokens_per_request"]["mpcache"]
    samples["lmcache"][1] = sample(0.2, 1536)
    assert not vllm._result(model, first, samples, 3, 0.5)["comparable_work"]

    path = tmp_path / "PERFORMANCE.md"
    bench_main.write_report({"vllm": result}, str(path))
    [row] = [line for line in path.read_text().splitlines() if line.startswith("| `vllm`")]
    assert "prefill no connector 800 ms, mpcache 200 ms, LMCache 250 ms" in row
    assert "(before prefill 10 / 10 / 10 ms)" in row
    assert "prefill 4.0× faster with mpcache, 3.2× with LMCache; LMCache / mpcache 1.25×" in row


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
    prose = " ".join(doc("PERFORMANCE.md").split())
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
