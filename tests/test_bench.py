"""The benchmarks run and report what they promise (tiny sizes: no timing is asserted here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from mpcache.bench import __main__ as bench_main
from mpcache.bench import drain, publish
from mpcache.shm.ring import COMPILED_PUBLISH


def test_publish_reports_every_promised_key():
    """publish returns the three medians, the ratios and the verdicts, all from real measurements."""
    result = publish.run(repetitions=5, events=2_000)
    assert {"ring_ns", "inprocess_bus_ns", "mp_queue_ns", "ring_by_name_ns", "floor_ns"} <= set(result)
    assert ("compiled" if COMPILED_PUBLISH else "python") == result["publish_path"]
    assert 5 == len(result["samples_ns"]["ring"])
    assert all(result[key] > 0 for key in ("ring_ns", "inprocess_bus_ns", "mp_queue_ns"))


def test_drain_delivers_every_published_event(monkeypatch):
    """drain publishes from producer processes and the pipeline delivers exactly that many records."""
    monkeypatch.setattr(drain, "REQUESTS_PER_PRODUCER", 300)
    result = drain.run(repetitions=1)
    assert 2 * 300 * drain.EVENTS_PER_REQUEST == result["events_per_repetition"]
    assert result["events_per_s"] > 0 and result["reference_events_per_s"] > 0


def test_report_writes_a_row_per_benchmark(tmp_path):
    """The report has one table row per benchmark, with its target and verdict."""
    results = {
        "publish": {"publish_path": "compiled", "ring_ns": 500.0, "ring_by_name_ns": 600.0, "floor_ns": 300.0,
                    "inprocess_bus_ns": 2000.0,
                    "mp_queue_ns": 9000.0, "ratio_inprocess_over_ring": 4.0, "ratio_mp_queue_over_ring": 18.0,
                    "targets_met": {"ring_ns": False}},
        "scrape": {"scrape_s": 0.2, "scrape_max_s": 0.3, "page_bytes": 2048},
    }
    path = tmp_path / "PERFORMANCE.md"
    bench_main.write_report(results, str(path))
    rows = [line for line in path.read_text().splitlines() if line.startswith("| `")]
    assert ["| `publish` ", "| `scrape` "] == [row.split("|", 2)[0] + "|" + row.split("|", 2)[1] for row in rows]
    assert "ring_ns MISSED" in rows[0]


def test_report_keeps_the_hand_written_analysis(tmp_path):
    """Re-running the report replaces the table but keeps the section from '## Analysis' on."""
    path = tmp_path / "PERFORMANCE.md"
    path.write_text("# Performance\n\nold table\n\n## Analysis\n\nwhy the numbers are what they are\n")
    bench_main.write_report({"scrape": {"scrape_s": 0.2, "scrape_max_s": 0.3, "page_bytes": 2048}}, str(path))
    text = path.read_text()
    assert ("old table" in text, "why the numbers are what they are" in text) == (False, True)


def test_report_rewrites_the_raw_results_instead_of_keeping_them(tmp_path):
    """The raw results after the analysis are replaced on every run, never kept and appended to."""
    path = tmp_path / "PERFORMANCE.md"
    scrape = {"scrape": {"scrape_s": 0.2, "scrape_max_s": 0.3, "page_bytes": 2048}}
    path.write_text("# Performance\n\n## Analysis\n\nwhy\n")
    bench_main.write_report(scrape, str(path))
    bench_main.write_report(scrape, str(path))
    text = path.read_text()
    assert (1, 1, 1) == (text.count("## Analysis"), text.count("## Raw results"), text.count("\nwhy\n"))


def test_sigterm_stops_a_benchmark_with_its_children_and_shared_memory():
    """SIGTERM mid-soak: exit status 130, every child process gone, no segment of the run left."""
    bench = subprocess.Popen([sys.executable, "-m", "mpcache.bench", "soak", "--seconds", "30", "--rate", "20000"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        children: list[psutil.Process] = []
        while len(children) < 3:  # the telemetry process and two producers
            assert time.monotonic() < deadline and bench.poll() is None, "the soak did not start its children"
            children = psutil.Process(bench.pid).children(recursive=True)
            time.sleep(0.05)
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    _, alive = psutil.wait_procs(children, timeout=10)

    assert 130 == bench.returncode, stderr
    assert [] == alive
    assert [] == [name for name in os.listdir("/dev/shm") if name.startswith(f"mpcache.{bench.pid}.")]
