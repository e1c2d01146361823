"""deploy/: the Grafana dashboard, the Prometheus scrape config and alerts, and the OTel Collector config.

Everything here is static: PromQL is checked for the metric names it uses (only those of
``spec/metrics.tsv`` plus mpcache's two lookup-tier extras), and, when ``promtool`` is installed
(Debian package ``prometheus``), for syntax.  The collector config is parsed by a minimal reader of
the YAML subset it is written in (PyYAML is not a dependency), cross-checked against PyYAML when
that happens to be installed.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mpcache.telemetry import metric_table

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mpcache-dashboard.json"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
COLLECTOR_YAML = DEPLOY / "otel-collector" / "config.yaml"
SPEC_TSV = REPO.parent / "shared" / "spec" / "metrics.tsv"
EXTRAS = {"lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total"}
PROMTOOL = shutil.which("promtool")

# The dashboard's rows: one per section of the specification, plus the lookup hit rates up front.
SECTIONS = [
    "Lookup hit rates",
    "L1",
    "L1 chunk lifecycle (sampled)",
    "Failures and timeouts",
    "L2 store",
    "L2 prefetch",
    "L2 eviction",
    "L1 ↔ L2 throughput",
    "L2 state",
    "L0 ↔ L1 throughput",
    "L0 block lifecycle (sampled)",
    "Cache blending",
    "Event bus health",
]
# Panels that must exist (title → the metrics its queries must use): the hit rates the spec asks for.
REQUIRED_PANELS = {
    "Lookup hit rate (L1 + L2)": {"lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per model": {"lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per tier (L1 / L2)": EXTRAS | {"lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per cache_salt (top 10 by traffic)": {
        "lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Blend token hit rate": {"lmcache_blend_lookup_hit_tokens_total", "lmcache_blend_lookup_requested_tokens_total"},
}
# What the alerts must watch.
ALERTED = {
    "lmcache_mp_event_bus_dropped_events_total",
    "lmcache_mp_event_bus_drain_lag_seconds",
    "lmcache_mp_event_bus_subscriber_exceptions_total",
    "lmcache_mp_timeouts_total",
    "lmcache_mp_l1_allocation_failure_chunks_total",
}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
                   "group_left", "group_right",
                   # aggregation operators: ``sum by (x) (...)`` puts the grouping between name and "("
                   "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                   "count_values"}


def spec_rows() -> list[tuple[str, str]]:
    """(prometheus_name, instrument) for every row of metrics.tsv; the metric table (held row for row
    to the tsv by tests/telemetry/test_metric_table.py) stands in when the spec is not next to the repo."""
    if not SPEC_TSV.exists():
        return [(m.prometheus_name, m.instrument) for m in metric_table.METRICS]
    with SPEC_TSV.open(newline="") as f:
        return [(row["prometheus_name"], row["instrument"]) for row in csv.DictReader(f, delimiter="\t")]


def known_series() -> dict[str, str]:
    """Every series name a query may use → the metric it belongs to (histograms by _bucket/_sum/_count)."""
    out = {name: name for name in EXTRAS}
    for name, instrument in spec_rows():
        if instrument == "histogram":
            out.update({name + suffix: name for suffix in ("_bucket", "_sum", "_count")})
        else:
            out[name] = name
    return out


def metric_names(expr: str) -> set[str]:
    """The metric (series) names a PromQL expression selects: identifiers outside strings, label
    matchers, ranges and grouping clauses that are neither functions nor keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables ($__rate_interval, ${datasource})
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end():].lstrip().startswith("(") or match.group() in PROMQL_KEYWORDS:
            continue
        names.add(match.group())
    return names


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[tuple[str, dict]]:
    """(row title, panel) for every non-row panel, in layout order (rows may be collapsed or not)."""
    out, row = [], ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            out.extend((row, inner) for inner in panel.get("panels", []))
        else:
            out.append((row, panel))
    return out


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for _, panel in dashboard_panels(dashboard)
            for target in panel.get("targets", [])]


def alert_exprs() -> dict[str, str]:
    """alert name → expr, read from alerts.yml (written with one-line ``alert:`` / ``expr:`` entries)."""
    out, name = {}, None
    for line in ALERTS_YML.read_text().splitlines():
        stripped = line.strip().removeprefix("- ")
        if stripped.startswith("alert:"):
            name = stripped.split(":", 1)[1].strip()
        elif stripped.startswith("expr:") and name:
            out[name] = stripped.split(":", 1)[1].strip()
    return out


def parse_yaml_subset(text: str):
    """A reader for the YAML the collector config is written in: nested block mappings (2-space
    indents), plain scalars, ``[a, b]`` flow lists and comments.  Anything else raises ValueError."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw:
            raise ValueError(f"line {number}: tab")
        body = re.sub(r"\s+#.*$", "", raw) if not raw.lstrip().startswith("#") else ""
        if body.strip():
            indent = len(body) - len(body.lstrip(" "))
            if indent % 2:
                raise ValueError(f"line {number}: odd indent")
            lines.append((number, indent, body.strip()))

    def scalar(value: str):
        if value.startswith("[") and value.endswith("]"):
            return [scalar(item.strip()) for item in value[1:-1].split(",") if item.strip()]
        if value in ("true", "false"):
            return value == "true"
        if re.fullmatch(r"-?\d+", value):
            return int(value)
        if re.search(r"[\[\]{}&*!|>'\"%@`]", value[:1]) or ": " in value:
            raise ValueError(f"unsupported scalar {value!r}")
        return value

    def block(start: int, indent: int) -> tuple[dict, int]:
        mapping, i = {}, start
        while i < len(lines):
            number, line_indent, body = lines[i]
            if line_indent < indent:
                break
            if line_indent > indent:
                raise ValueError(f"line {number}: unexpected indent")
            match = re.fullmatch(r"([A-Za-z0-9_./-]+):(?:\s+(.*))?", body)
            if not match:
                raise ValueError(f"line {number}: not a 'key: value' line: {body!r}")
            key, value = match.group(1), match.group(2)
            if key in mapping:
                raise ValueError(f"line {number}: duplicate key {key!r}")
            if value is None:
                if i + 1 < len(lines) and lines[i + 1][1] > indent:
                    mapping[key], i = block(i + 1, lines[i + 1][1])
                    continue
                mapping[key] = None
            else:
                mapping[key] = scalar(value)
            i += 1
        return mapping, i

    parsed, end = block(0, 0)
    if end != len(lines):
        raise ValueError(f"line {lines[end][0]}: unexpected dedent")
    return parsed


def test_dashboard_queries_name_only_metrics_of_the_spec():
    """Every PromQL expr of the Grafana dashboard selects only metrics of metrics.tsv (histograms via
    _bucket/_sum/_count) or the two lookup-tier extras, and every such metric appears in some panel."""
    known = known_series()
    exprs = dashboard_exprs(load_dashboard())
    unknown = sorted({(title, name) for title, expr in exprs for name in metric_names(expr) if name not in known})
    used = {known[name] for _, expr in exprs for name in metric_names(expr) if name in known}
    assert ([], set()) == (unknown, set(known.values()) - used)


def test_dashboard_has_a_row_with_panels_for_every_spec_section_and_the_hit_rates():
    """The dashboard has exactly the rows of SECTIONS, each holding at least one panel with a query, and
    the required hit-rate panels (aggregate, per model, per tier, per cache_salt, blend) use their counters."""
    dashboard = load_dashboard()
    panels = dashboard_panels(dashboard)
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    with_queries = {row for row, panel in panels if panel.get("targets")}
    by_title = {panel["title"]: panel for _, panel in panels}
    required = {title: set().union(*(metric_names(t["expr"]) for t in by_title[title]["targets"])) >= names
                for title, names in REQUIRED_PANELS.items() if title in by_title}
    assert (SECTIONS, set(SECTIONS), {title: True for title in REQUIRED_PANELS}) == (rows, with_queries, required)


def test_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    """The dashboard is a Grafana dashboard: a title, unique panel ids, a gridPos on every panel, a
    ``datasource`` template variable of type datasource/prometheus, and every panel and query using it."""
    dashboard = load_dashboard()
    variables = {v["name"]: (v["type"], v["query"]) for v in dashboard["templating"]["list"]}
    panels = [p for p in dashboard["panels"]] + [
        p for _, p in dashboard_panels(dashboard) if p not in dashboard["panels"]]
    ids = [p["id"] for p in panels]
    sources = {json.dumps(p["datasource"], sort_keys=True) for _, p in dashboard_panels(dashboard)}
    sources |= {json.dumps(t["datasource"], sort_keys=True) for _, p in dashboard_panels(dashboard)
                for t in p["targets"]}
    assert ("mpcache", ("datasource", "prometheus"), len(ids), True) == (
        dashboard["title"], variables.get("datasource"), len(set(ids)), all("gridPos" in p for p in panels))
    assert {json.dumps({"type": "prometheus", "uid": "${datasource}"}, sort_keys=True)} == sources


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool accepts every dashboard expr (with $__rate_interval as 1m) as a recording rule."""
    exprs = [expr.replace("$__rate_interval", "1m") for _, expr in dashboard_exprs(load_dashboard())]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert (0, "") == (result.returncode, result.stderr)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_prometheus_config_and_alert_rules():
    """``promtool check config`` accepts deploy/prometheus/prometheus.yml (which loads alerts.yml) and
    ``promtool check rules`` accepts alerts.yml."""
    config = subprocess.run([PROMTOOL, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    rules = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS_YML)], capture_output=True, text=True)
    assert (0, 0) == (config.returncode, rules.returncode), config.stdout + config.stderr + rules.stdout + rules.stderr


def test_prometheus_config_scrapes_mpcache_on_its_default_port_and_alerts_watch_the_health_metrics():
    """prometheus.yml scrapes 127.0.0.1:9090 (mpcache's default /metrics) and loads alerts.yml, whose
    alert exprs name only spec metrics (or ``up``) and cover dropped events, drain lag, subscriber
    exceptions, timeouts and L1 allocation failures."""
    config = PROMETHEUS_YML.read_text()
    known = set(known_series()) | {"up"}
    alerts = alert_exprs()
    named = {name for expr in alerts.values() for name in metric_names(expr)}
    assert (True, True, set(), set()) == (
        '"127.0.0.1:9090"' in config, "- alerts.yml" in config, named - known, ALERTED - named)


def test_collector_config_routes_otlp_to_a_prometheus_exporter_with_resource_attributes():
    """deploy/otel-collector/config.yaml parses as YAML; its metrics pipeline goes from the otlp receiver
    (grpc and http) to the prometheus exporter, which has resource_to_telemetry_conversion enabled."""
    text = COLLECTOR_YAML.read_text()
    config = parse_yaml_subset(text)
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        assert yaml.safe_load(text) == config
    pipeline = config["service"]["pipelines"]["metrics"]
    undefined = [(kind, name) for kind in ("receivers", "processors", "exporters")
                 for name in pipeline.get(kind, []) if name not in config.get(kind, {})]
    assert (["otlp"], ["prometheus"], {"grpc", "http"}, True, []) == (
        pipeline["receivers"], pipeline["exporters"], set(config["receivers"]["otlp"]["protocols"]),
        config["exporters"]["prometheus"]["resource_to_telemetry_conversion"]["enabled"], undefined)


def test_metric_name_extraction_sees_through_promql_syntax():
    """metric_names (what the checks above rely on) returns exactly the selected series of a query that
    uses functions, grouping, label matchers, ranges, Grafana variables, numbers and keywords."""
    expr = ('histogram_quantile(0.9, sum by (le, l2_name) (rate(a_bucket{l2_name="fs"}[$__rate_interval])))'
            ' / on (x) group_left sum(b_total offset 5m) and topk(10, c) > 1e9 or sum(d) by (model_name)')
    assert {"a_bucket", "b_total", "c", "d"} == metric_names(expr)
