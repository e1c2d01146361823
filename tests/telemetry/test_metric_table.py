"""The metric table against spec/metrics.tsv and the generated docs/METRICS.md."""

from __future__ import annotations

import csv
from pathlib import Path

from mpcache.contract import request_times
from mpcache.telemetry import metric_table
from mpcache.telemetry.metric_table import HISTOGRAM, LIFECYCLE_SECONDS_BUCKETS

REPO = Path(__file__).resolve().parents[2]
SPEC_TSV = REPO / "spec" / "metrics.tsv"


def spec_rows() -> list[tuple[str, ...]]:
    with SPEC_TSV.open(encoding="utf-8") as handle:
        return [tuple(row) for row in csv.reader(handle, delimiter="\t")][1:]


def test_table_matches_spec_row_for_row():
    """Every row of metrics.tsv, in order, is a row of the metric table with the same six columns."""
    assert spec_rows() == [spec.tsv_row for spec in metric_table.METRICS]


def test_extra_rows_are_the_lookup_hit_split_l2_loads_by_origin_and_the_lmcache_service_time():
    """The only rows beyond the spec are the L1/L2 split of lookup_hit, as token counters, L2 loads by
    origin, and the LMCache front end's service time per operation."""
    expected = [
        ("lmcache_mp.lookup_hit_l1", "lmcache_mp_lookup_hit_l1_tokens_total", "counter", "tokens",
         "model_name,cache_salt", "MP_LOOKUP_PREFETCH_END"),
        ("lmcache_mp.lookup_hit_l2", "lmcache_mp_lookup_hit_l2_tokens_total", "counter", "tokens",
         "model_name,cache_salt", "MP_LOOKUP_PREFETCH_END"),
        ("mpcache.l2_load", "mpcache_l2_load_chunks_total", "counter", "chunks", "l2_name,origin", "L2_LOAD_ORIGIN"),
        ("mpcache.lmcache.request", "mpcache_lmcache_request_seconds", "histogram", "seconds", "op",
         "LMCACHE_REQUEST_TIMES"),
    ]
    assert expected == [spec.tsv_row for spec in metric_table.EXTRA_METRICS]


def test_exactly_histograms_have_increasing_buckets():
    """Histograms, and only histograms, carry explicit, strictly increasing bucket boundaries."""
    for spec in metric_table.ALL_METRICS:
        has_buckets = spec.buckets is not None and list(spec.buckets) == sorted(set(spec.buckets))
        assert (spec.instrument == HISTOGRAM, spec.otel_name) == (has_buckets, spec.otel_name)


def test_seconds_histograms_share_the_lifecycle_grid_with_a_300s_edge():
    """Every lifecycle seconds histogram uses the lifecycle grid, which has 300 s (the evict→reuse cap) as an
    edge; the LMCache service time has its own, from 50 µs to 1 s."""
    seconds = {spec.otel_name: spec.buckets for spec in metric_table.ALL_METRICS
               if spec.unit == "seconds" and spec.otel_name != "mpcache.lmcache.request"}
    assert request_times.BUCKETS_S == metric_table.BY_NAME["mpcache.lmcache.request"].buckets
    assert {name: LIFECYCLE_SECONDS_BUCKETS for name in seconds} == seconds
    assert 300.0 in LIFECYCLE_SECONDS_BUCKETS


def test_every_metric_has_a_one_sentence_meaning():
    """Each row explains itself in one sentence ending with a full stop."""
    unclear = [spec.otel_name for spec in metric_table.ALL_METRICS
               if not spec.meaning.endswith(".") or spec.meaning.count(". ") > 0]
    assert [] == unclear


def test_docs_metrics_md_is_generated_from_the_table():
    """docs/METRICS.md is exactly what ``--markdown`` prints (regenerate it after editing the table)."""
    assert metric_table.render_markdown() == (REPO / "docs" / "METRICS.md").read_text(encoding="utf-8")


def test_markdown_explains_the_l2_evicted_deviation():
    """The generated reference names both the spec's OTel name and the one mpcache uses for L2 evictions."""
    text = metric_table.render_markdown()
    assert (True, True) == ("lmcache_mp.l2_evicted_objects" in text, "`lmcache_mp.l2_evicted`" in text)
