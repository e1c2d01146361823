"""The metric table against the specification's table (spec/metrics.tsv) and the generated docs/METRICS.md."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from mpcache.contract import request_times
from mpcache.telemetry import metric_table
from mpcache.telemetry.metric_table import HISTOGRAM, LIFECYCLE_SECONDS_BUCKETS, SECTIONS
from mpcache.telemetry.metric_table.markdown import render_markdown

REPO = Path(__file__).resolve().parents[2]
SPEC_TSV = REPO / "spec" / "metrics.tsv"


def spec_rows() -> list[tuple[str, ...]]:
    with SPEC_TSV.open(encoding="utf-8") as handle:
        return [tuple(row) for row in csv.reader(handle, delimiter="\t")][1:]


def test_table_matches_spec_row_for_row():
    """The rows of the table's specified sections, in order, are the rows of metrics.tsv, all six columns."""
    assert spec_rows() == [spec.tsv_row for spec in metric_table.SPECIFIED]


def test_rows_beyond_the_spec_are_named_mpcache():
    """A series the specification does not list is named ``mpcache.*`` (Prometheus ``mpcache_*``), but for those
    LMCache's server exports under its prefix (the L1/L2 split of lookup_hit, 0.5.7's request-level hit rate, and
    the Compatibility section, each a name LMCache's own code registers) and the exporters' standard series:
    target_info and prometheus_client's process collector."""
    beyond = [spec for section in SECTIONS if not section.specified for spec in section.rows]
    otherwise = [spec.otel_name or spec.prometheus_name for spec in beyond
                 if not (spec.otel_name.startswith("mpcache.") and spec.prometheus_name.startswith("mpcache_"))]
    lmcache = ["lmcache_mp.lookup_hit_l1", "lmcache_mp.lookup_hit_l2", "lmcache_mp.lookup_prompt",
               "lmcache_mp.lookup_request_hit", "lmcache_mp.lookups", "lmcache_mp.lookup_hit_l1_keys",
               "lmcache_mp.lookup_hit_l2_keys", "lmcache_mp.l2_evicted_objects", "lmcache_mp.num_submitted_stores",
               "lmcache_mp.num_finished_stores", "lmcache_mp.num_submitted_retrieves",
               "lmcache_mp.num_finished_retrieves"]
    assert lmcache + ["target_info", "process_cpu_seconds_total", "process_max_fds", "process_open_fds",
                      "process_resident_memory_bytes", "process_start_time_seconds",
                      "process_virtual_memory_bytes"] == otherwise


def test_exactly_histograms_have_increasing_buckets():
    """Histograms, and only histograms, carry explicit, strictly increasing bucket boundaries."""
    for spec in metric_table.METRICS:
        has_buckets = spec.buckets is not None and list(spec.buckets) == sorted(set(spec.buckets))
        assert (spec.instrument == HISTOGRAM, spec.otel_name) == (has_buckets, spec.otel_name)


def test_seconds_histograms_share_the_lifecycle_grid_with_a_300s_edge():
    """Every lifecycle seconds histogram uses the lifecycle grid, which has 300 s (the evict→reuse cap) as an
    edge; the LMCache service time has its own, from 50 µs to 1 s."""
    seconds = {spec.otel_name: spec.buckets for spec in metric_table.METRICS if spec.instrument == HISTOGRAM
               and spec.unit == "seconds" and spec.otel_name != "mpcache.lmcache.request"}
    assert request_times.BUCKETS_S == metric_table.BY_NAME["mpcache.lmcache.request"].buckets
    assert {name: LIFECYCLE_SECONDS_BUCKETS for name in seconds} == seconds
    assert 300.0 in LIFECYCLE_SECONDS_BUCKETS


def test_every_metric_has_a_one_sentence_meaning():
    """Each row explains itself in one sentence ending with a full stop."""
    unclear = [spec.prometheus_name for spec in metric_table.METRICS
               if not spec.meaning.endswith(".") or spec.meaning.count(". ") > 0]
    assert [] == unclear


def test_docs_metrics_md_is_generated_from_the_table():
    """docs/METRICS.md is exactly what ``--markdown`` prints (regenerate it after editing the table)."""
    assert render_markdown(SECTIONS) == (REPO / "docs" / "METRICS.md").read_text(encoding="utf-8")


def test_the_command_prints_the_reference():
    """``python -m mpcache.telemetry.metric_table --markdown`` (what the file is regenerated with) prints it."""
    result = subprocess.run([sys.executable, "-m", "mpcache.telemetry.metric_table", "--markdown"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (0, render_markdown(SECTIONS)) == (result.returncode, result.stdout)


def test_markdown_explains_the_l2_evicted_deviation():
    """The generated reference names both the spec's OTel name and the one mpcache uses for L2 evictions."""
    text = render_markdown(SECTIONS)
    assert (True, True) == ("lmcache_mp.l2_evicted_objects" in text, "`lmcache_mp.l2_evicted`" in text)
