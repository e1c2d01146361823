"""deploy/: the Grafana dashboard, the Prometheus scrape config and alerts, the OTel Collector config, the
Docker image and compose file, and the systemd unit.

Everything here is static: PromQL is checked for the metric names it uses (only those of the
specification's table, ``spec/metrics.tsv``, and the metric table's rows beyond it), and, when ``promtool`` is installed
(Debian package ``prometheus``), for syntax.  The collector and compose configs are parsed by a minimal
reader of the YAML subset they are written in (PyYAML is not a dependency), cross-checked against PyYAML
when that happens to be installed; ``docker compose config`` (or ``docker-compose``) and
``systemd-analyze verify`` check them further where installed, skipping, saying so, where not.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpcache.supervisor.children import STOP_GRACE_S
from mpcache.telemetry import metric_table

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mpcache-dashboard.json"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
COLLECTOR_YAML = DEPLOY / "otel-collector" / "config.yaml"
DOCKER = DEPLOY / "docker"
COMPOSE_YAML = DOCKER / "compose.yaml"
COMPOSE_PROMETHEUS_YML = DOCKER / "prometheus.yml"
DOCKERFILE = DOCKER / "Dockerfile"
UNIT = DEPLOY / "systemd" / "mpcache.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SPEC_TSV = REPO / "spec" / "metrics.tsv"
EXTRAS = {"lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total"}
# The fleet row: L2 loads by origin, and target_info (host.name) to split series by host.
FLEET = {"mpcache_l2_load_chunks_total", "target_info"}
# Series of the metric table that no panel needs to show: the telemetry process's own process_* (the
# exporter's convention), and the LMCache front end's service time (its numbers are in docs/PERFORMANCE.md).
OFF_THE_DASHBOARD = {"process_cpu_seconds_total", "process_max_fds", "process_open_fds",
                     "process_resident_memory_bytes", "process_start_time_seconds", "process_virtual_memory_bytes",
                     # the Compatibility section: LMCache's server's own names for what panels already show
                     *(spec.prometheus_name for spec in metric_table.SECTIONS_BY_KEY["Compatibility"].rows)}
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
    "Service",
    "Capacity planning and miss reasons",
    "Fleet (shared L2)",
    "KV events for cache-aware routers",
]
# Panels that must exist (title → the metrics its queries must use): the hit rates the spec asks for.
REQUIRED_PANELS = {
    "Lookup hit rate (L1 + L2)": {"lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per model": {"lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per tier (L1 / L2)": EXTRAS | {"lmcache_mp_lookup_requested_tokens_total"},
    "Lookup hit rate per cache_salt (top 10 by traffic)": {
        "lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"},
    "Blend token hit rate": {"lmcache_blend_lookup_hit_tokens_total", "lmcache_blend_lookup_requested_tokens_total"},
    "Lookup hit rate per host": {"lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total",
                                 "target_info"},
    "Shared L2 usage": {"lmcache_mp_l2_usage_bytes", "target_info"},
    "L2 loads by origin per host": FLEET,
}
# What the alerts must watch.
ALERTED = {
    "lmcache_mp_event_bus_dropped_events_total",
    "lmcache_mp_event_bus_drain_lag_seconds",
    "lmcache_mp_event_bus_subscriber_exceptions_total",
    "lmcache_mp_timeouts_total",
    "lmcache_mp_l1_allocation_failure_chunks_total",
    "mpcache_child_restarts_total",
    "mpcache_cache_processes_ready",
}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
                   "group_left", "group_right",
                   # aggregation operators: ``sum by (x) (...)`` puts the grouping between name and "("
                   "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                   "count_values"}


def spec_rows() -> list[tuple[str, str]]:
    """(prometheus_name, instrument) for every row of spec/metrics.tsv."""
    with SPEC_TSV.open(newline="") as f:
        return [(row["prometheus_name"], row["instrument"]) for row in csv.DictReader(f, delimiter="\t")]


def known_series() -> dict[str, str]:
    """Every series name a query may use → the metric it belongs to (histograms by _bucket/_sum/_count): the
    spec's, and those of the metric table's rows beyond the spec (mpcache's own, declared nowhere else)."""
    out: dict[str, str] = {}
    beyond = [(spec.prometheus_name, spec.instrument) for section in metric_table.SECTIONS if not section.specified
              for spec in section.rows]
    for name, instrument in spec_rows() + beyond:
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
    """A reader for the YAML the collector and compose configs are written in: nested block mappings
    (2-space indents), plain and quoted scalars, ``[a, b]`` flow lists, ``- scalar`` block sequences and
    comments.  Anything else raises ValueError."""
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
            items = re.findall(r"""\s*("(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|[^,]+?)\s*(?:,|$)""", value[1:-1])
            return [scalar(item) for item in items if item]
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return json.loads(value)  # the escapes used here (\\, \") are JSON's too
        if len(value) >= 2 and value[0] == value[-1] == "'":
            return value[1:-1].replace("''", "'")
        if value in ("true", "false"):
            return value == "true"
        if re.fullmatch(r"-?\d+", value):
            return int(value)
        if re.search(r"[\[\]{}&*!|>'\"%@`]", value[:1]) or ": " in value:
            raise ValueError(f"unsupported scalar {value!r}")
        return value

    def sequence(start: int, indent: int) -> tuple[list, int]:
        items, i = [], start
        while i < len(lines) and lines[i][1] == indent and lines[i][2].startswith("- "):
            item = lines[i][2][2:].strip()
            if re.fullmatch(r"[A-Za-z0-9_./-]+:(\s.*)?", item):
                raise ValueError(f"line {lines[i][0]}: mappings in sequences are not supported")
            items.append(scalar(item))
            i += 1
        return items, i

    def block(start: int, indent: int) -> tuple[dict | list, int]:
        if lines[start][2].startswith("- "):
            return sequence(start, indent)
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
    _bucket/_sum/_count) or of the metric table's rows beyond it, and every such metric but those left off the
    dashboard appears in some panel."""
    known = known_series()
    exprs = dashboard_exprs(load_dashboard())
    unknown = sorted({(title, name) for title, expr in exprs for name in metric_names(expr) if name not in known})
    used = {known[name] for _, expr in exprs for name in metric_names(expr) if name in known}
    assert ([], set()) == (unknown, set(known.values()) - OFF_THE_DASHBOARD - used)


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


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_the_l1_allocation_alert_fires_on_a_full_l1_not_on_the_stores_the_eviction_order_refuses(tmp_path):
    """``promtool test rules`` on the shipped alerts.yml, 15 minutes into these counters (chunks a minute):
    failures that are all the order's refusals (two workers' worth, or shown a scrape late) fire nothing; failures
    with no refusal fire at
    10 chunks/s; 900 failures of which 600 refused fire at 5; an instance with no refusal counter (a build before it)
    fires; and L2 prefetch failures fire whatever the stores' refusals."""
    failures = 'lmcache_mp_l1_allocation_failure_chunks_total{{instance="{}", during="{}", model_name="m"}}'
    refused = 'mpcache_l1_refused_chunks_total{{instance="{}", worker="{}"}}'
    series = [(failures.format("all_refused", "l1_store"), 600), (refused.format("all_refused", 0), 250),
              (refused.format("all_refused", 1), 350),
              (failures.format("refusals_late", "l1_store"), 600), (refused.format("refusals_late", 0), "0 0+600x29"),
              (failures.format("full", "l1_store"), 600), (refused.format("full", 0), 0),
              (failures.format("both", "l1_store"), 900), (refused.format("both", 0), 600),
              (failures.format("older_build", "l1_store"), 600),
              (failures.format("prefetch", "l1_store"), 600), (failures.format("prefetch", "l2_prefetch"), 600),
              (refused.format("prefetch", 0), 600)]
    text = ALERTS_YML.read_text()
    description = json.loads(re.search(r'- alert: MpcacheL1AllocationFailures\n(?:.*\n)*?\s+description: (".*")',
                                       text).group(1))
    expected = [{"exp_labels": {"severity": "warning", "instance": instance, "during": during},
                 "exp_annotations": {"summary": f"mpcache L1 has no room for {during} writes ({rate} chunks/s) on "
                                                f"{instance}", "description": description,
                                     "runbook_url": f"http://{instance}/runbook#mpcachel1allocationfailures"}}
                for instance, during, rate in (("full", "l1_store", 10), ("both", "l1_store", 5),
                                               ("older_build", "l1_store", 10), ("prefetch", "l2_prefetch", 10))]
    tests = {"rule_files": [str(ALERTS_YML)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": name, "values": step if isinstance(step, str) else f"0+{step}x30"}
                                        for name, step in series],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "MpcacheL1AllocationFailures",
                             "exp_alerts": expected}]}]}
    (tmp_path / "tests.yml").write_text(json.dumps(tests))  # JSON is YAML
    run = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yml")], capture_output=True, text=True)
    assert 0 == run.returncode, run.stdout + run.stderr


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


# --- the collector's traces, the Docker image and compose file, the systemd unit ----------------------------------

def load_yaml(path: Path):
    """``path`` read by parse_yaml_subset, and equal to PyYAML's reading when PyYAML is installed."""
    text = path.read_text()
    parsed = parse_yaml_subset(text)
    try:
        import yaml
    except ImportError:
        return parsed
    assert yaml.safe_load(text) == parsed
    return parsed


def test_collector_config_has_a_traces_pipeline_from_otlp_next_to_the_metrics_one():
    """The collector config has both pipelines: metrics (above) and traces, the spans of --enable-tracing,
    from the otlp receiver through defined processors to a defined exporter."""
    config = load_yaml(COLLECTOR_YAML)
    pipelines = config["service"]["pipelines"]
    traces = pipelines.get("traces", {})
    undefined = [(kind, name) for kind in ("receivers", "processors", "exporters")
                 for name in traces.get(kind, []) if name not in config.get(kind, {})]
    assert ({"metrics", "traces"}, ["otlp"], True, []) == (
        set(pipelines), traces.get("receivers"), bool(traces.get("exporters")), undefined)


def compose_size(text: str) -> int:
    """A compose byte value (``1gb``, ``512m``, ``2147483648``): units are powers of 1024."""
    match = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(text).strip().lower())
    assert match, f"not a compose byte value: {text!r}"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def compose_seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert match, f"not a duration: {text!r}"
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def image_environment() -> dict[str, str]:
    """The final stage's ENV settings (``ENV A=1 B=2``, continuation lines joined)."""
    env: dict[str, str] = {}
    for instruction, rest in dockerfile_stages()[-1]:
        if instruction == "ENV":
            env.update(word.split("=", 1) for word in rest.split())
    return env


def compose_default(text: str) -> str:
    """A compose value with every ``${NAME:-default}`` replaced by its default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_compose_gives_mpcache_a_dev_shm_that_holds_its_segments_and_shares_it():
    """compose.yaml runs mpcache, Prometheus and an OTel Collector (and an engine example under a profile);
    mpcache's /dev/shm (shm_size, not Docker's 64 MiB) holds the L1 pools and event rings its settings (the
    image's MPCACHE_* environment, then the service's) ask for, its IPC namespace is shareable (the engine
    joins it with ipc: "service:mpcache"), /metrics binds 0.0.0.0 on port 9090, it pushes OTLP with tracing to
    the collector service, and it is given longer than the supervisor's stop to stop."""
    from mpcache.supervisor import settings

    compose = load_yaml(COMPOSE_YAML)
    services = compose["services"]
    mpcache = services["mpcache"]
    assert "command" not in mpcache  # settings in the environment: `run ... FLAGS` adds to them
    environ = {**image_environment(), **mpcache["environment"]}
    values = settings.parse([], environ=environ).values
    needed = values["workers"] * (values["l1-size"] + values["ring-cells"] * 64)
    assert ({"mpcache", "prometheus", "otel-collector", "engine-example", "vllm"}, "shareable", True, True) == (
        set(services), mpcache.get("ipc"), compose_size(mpcache.get("shm_size", "64m")) >= needed > 64 * 2**20,
        compose_seconds(mpcache["stop_grace_period"]) > 3 * STOP_GRACE_S)
    assert ("0.0.0.0", 9090, "otel-collector:4317", True, ["127.0.0.1:9090:9090"]) == (
        values["prometheus-host"], values["prometheus-port"], values["otlp-endpoint"], values["enable-tracing"],
        [compose_default(port) for port in mpcache["ports"]])
    engine = services["engine-example"]
    assert (["engine-example"], "service:mpcache", "10001:10001", ["mpcache-run:/run/mpcache"],
            "service_healthy") == (engine["profiles"], engine["ipc"], engine["user"], engine["volumes"],
                                   engine["depends_on"]["mpcache"]["condition"])


def test_compose_mounts_files_that_exist_and_builds_from_the_repository():
    """Every bind mount of compose.yaml names an existing file (relative to deploy/docker), Prometheus gets
    the compose scrape config and the shared alert rules, the collector gets deploy/otel-collector/config.yaml,
    and mpcache is built from the repository root with deploy/docker/Dockerfile."""
    compose = load_yaml(COMPOSE_YAML)
    services = compose["services"]
    mounts = {name: [volume.split(":")[:2] for volume in service.get("volumes", [])]
              for name, service in services.items()}
    binds = [(source, target) for volumes in mounts.values() for source, target in volumes
             if source.startswith((".", "/"))]
    missing = [source for source, _ in binds if not (DOCKER / source).is_file()]
    named = {source for volumes in mounts.values() for source, _ in volumes if not source.startswith((".", "/"))}
    build = services["mpcache"]["build"]
    assert ([], set(compose.get("volumes") or {}), True) == (
        missing, named, (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE)
    assert ([["./prometheus.yml", "/etc/prometheus/prometheus.yml"],
             ["../prometheus/alerts.yml", "/etc/prometheus/alerts.yml"]],
            ["../otel-collector/config.yaml"]) == (
        mounts["prometheus"], [s for s, _ in mounts["otel-collector"]])
    command = services["otel-collector"]["command"]
    assert f"--config={mounts['otel-collector'][0][1]}" == command[0]


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_accepts_the_compose_file():
    """``docker compose config`` (or the standalone ``docker-compose``) accepts compose.yaml."""
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` (the Compose plugin) nor `docker-compose` is installed; "
                    "compose.yaml was only checked by the tests above")
    result = subprocess.run([*command, "-f", str(COMPOSE_YAML), "config", "--quiet"], capture_output=True,
                            text=True, timeout=60)
    assert (0, "") == (result.returncode, result.stderr)


def test_compose_prometheus_config_is_the_shared_one_aimed_at_the_mpcache_service():
    """deploy/docker/prometheus.yml is deploy/prometheus/prometheus.yml with its target moved from
    127.0.0.1:9090 to mpcache:9090 (the compose service), comments aside."""
    def lines(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    shared = [line.replace('"127.0.0.1:9090"', '"mpcache:9090"') for line in lines(PROMETHEUS_YML)]
    assert shared == lines(COMPOSE_PROMETHEUS_YML)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_compose_prometheus_config(tmp_path):
    """``promtool check config`` accepts deploy/docker/prometheus.yml next to alerts.yml, as mounted."""
    shutil.copy(COMPOSE_PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copy(ALERTS_YML, tmp_path / "alerts.yml")
    result = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                            text=True)
    assert 0 == result.returncode, result.stdout + result.stderr


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped), one list per stage."""
    stages: list[list[tuple[str, str]]] = []
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                              if not line.lstrip().startswith("#")))
    for line in logical.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            if instruction.upper() == "FROM":
                stages.append([])
            if stages:
                stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def test_dockerfile_builds_the_extension_and_runs_start_cache_with_a_healthcheck():
    """The image: both stages FROM the BASE_IMAGE argument (python:3.11-slim by default); no syntax line
    (BuildKit would fetch a frontend image) and nothing the classic builder rejects (RUN --mount,
    COPY --chmod); pip index and CA build arguments in the build stage only; the build stage installs gcc
    and fails unless _ringfast was compiled; the final stage runs as a non-root user, exposes 9090, sets
    its settings as MPCACHE_* variables, checks health with healthcheck.py and has start-cache as its
    entry point with no CMD; every COPY source exists."""
    text = DOCKERFILE.read_text()
    stages = dockerfile_stages()
    build, final = stages[0], stages[-1]

    def get(stage: list[tuple[str, str]], name: str) -> list[str]:
        return [rest for instruction, rest in stage if instruction == name]

    copies = [source for stage in stages for rest in get(stage, "COPY") if "--from" not in rest
              for source in [word for word in rest.split() if not word.startswith("--")][:-1]]
    assert ([], [], True, "python:3.11-slim") == (
        re.findall(r"^# *syntax=", text, re.MULTILINE), re.findall(r"RUN --mount|COPY --chmod", text),
        all(get(stage, "FROM")[0].split()[0] == "${BASE_IMAGE}" for stage in stages),
        re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE).group(1))
    assert ({"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "EXTRA_CA_CERTS"}, []) == (
        set(get(build, "ARG")), get(final, "ARG"))
    assert (True, True, True, [], ["9090"]) == (
        any("gcc" in rest for rest in get(build, "RUN")), any("_ringfast" in rest for rest in get(build, "RUN")),
        get(final, "USER")[-1] not in ("root", "0"),
        [source for source in copies if not (REPO / source).exists()], get(final, "EXPOSE"))
    environment = image_environment()
    assert ("0.0.0.0", "/run/mpcache/service") == (environment["MPCACHE_PROMETHEUS_HOST"],
                                                  environment["MPCACHE_RUNTIME_DIR"])
    assert (["start-cache"], [], ["python3", "/opt/mpcache/healthcheck.py"]) == (
        json.loads(get(final, "ENTRYPOINT")[0]), get(final, "CMD"),
        json.loads(get(final, "HEALTHCHECK")[0].split("CMD", 1)[1]))


def test_both_builders_read_the_dockerignore_at_the_context_root():
    """The classic builder reads only .dockerignore at the root of the context (the repository root): a
    checkout's .venv and compiled extension for the host's Python stay out of the build."""
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ({".git", "**/.venv", "**/*.so", "**/__pycache__"} <= set(ignored),
            list(DOCKER.glob("*.dockerignore"))) == (True, [])


def test_healthcheck_asks_where_the_run_serves_and_refuses_loopback(tmp_path):
    """healthcheck.py reads the run's config.json: no file yet, or /healthz bound to loopback (a published
    port reaches nothing there), is unhealthy with one line; the real endpoint is covered in
    tests/docker."""
    env = dict(os.environ, MPCACHE_RUNTIME_DIR=str(tmp_path))
    script = [sys.executable, str(DOCKER / "healthcheck.py")]
    missing = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)
    (tmp_path / "config.json").write_text(json.dumps({"prometheus_host": "127.0.0.1", "prometheus_port": 9,
                                                      "no_http": False}))
    loopback = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)
    assert (1, 1, True, "MPCACHE_PROMETHEUS_HOST=0.0.0.0" in loopback.stdout) == (
        missing.returncode, loopback.returncode, "has not written" in missing.stdout, True)


def unit_settings() -> dict[str, list[str]]:
    """Key → the values it is given in deploy/systemd/mpcache.service (all sections)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line.strip() and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_has_a_stable_runtime_dir_a_long_enough_stop_and_keeps_dev_shm():
    """The unit: Type=notify; ExecStart /usr/local/bin/start-cache with --runtime-dir a directory *under*
    RuntimeDirectory=mpcache (start-cache makes it; /run/mpcache itself exists at start), mode 0700;
    KillMode=mixed, Restart=on-failure, a RestartSec, TimeoutStopSec longer than the supervisor's three
    stop graces; a dedicated non-root user; NoNewPrivileges, ProtectSystem=strict, and no PrivateDevices
    (it would hide the GPUs) or RemoveIPC (it would remove the engines' segments)."""
    unit = unit_settings()
    one = {key: values[-1] for key, values in unit.items()}
    exec_start = one["ExecStart"].split()
    runtime_dir = exec_start[exec_start.index("--runtime-dir") + 1] if "--runtime-dir" in exec_start else ""
    assert ("notify", "/usr/local/bin/start-cache", "mpcache", "0700", True) == (
        one.get("Type"), exec_start[0], one.get("RuntimeDirectory"), one.get("RuntimeDirectoryMode"),
        os.path.dirname(runtime_dir.rstrip("/")) == "/run/mpcache")
    assert ("mixed", "on-failure", True, True, True) == (
        one.get("KillMode"), one.get("Restart"), compose_seconds(one.get("RestartSec", "0s")) > 0,
        compose_seconds(one.get("TimeoutStopSec", "0s")) > 3 * STOP_GRACE_S,
        one.get("User", "root") not in ("root", "0") and "Group" in one)
    assert ("yes", "strict", "no", "no") == (
        one.get("NoNewPrivileges"), one.get("ProtectSystem"), one.get("PrivateDevices", "no"),
        one.get("RemoveIPC", "no"))


def test_systemd_unit_reads_its_config_file_and_does_not_restart_on_a_configuration_error(tmp_path):
    """--config /etc/mpcache/mpcache.toml, docs/DEPLOYMENT.md's example of which start-cache accepts as it is;
    start-cache's exit status for a configuration error (a missing config file here) is the unit's
    RestartPreventExitStatus; readiness is notified by the main process only."""
    from mpcache.supervisor import settings

    one = {key: values[-1] for key, values in unit_settings().items()}
    exec_start = one["ExecStart"].split()
    assert ("/etc/mpcache/mpcache.toml", "main") == (
        exec_start[exec_start.index("--config") + 1], one.get("NotifyAccess"))
    values = settings.parse(["--config", str(DEPLOY / "systemd" / "mpcache.toml")], environ={}).values
    assert (2, 256 * 2**20, "127.0.0.1", 9090) == (values["workers"], values["l1-size"], values["prometheus-host"],
                                                   values["prometheus-port"])
    missing = subprocess.run([str(REPO / "bin" / "start-cache"), "--config", str(tmp_path / "absent.toml")],
                             capture_output=True, text=True, timeout=60)
    assert (one["RestartPreventExitStatus"], 1) == (str(missing.returncode), len(missing.stderr.splitlines()))
    assert "absent.toml" in missing.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: systemd)")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """``systemd-analyze verify`` accepts the unit without a word, its ExecStart pointed at an executable that
    exists here (start-cache is installed in /usr/local/bin on the target host, not necessarily here)."""
    copy = tmp_path / "mpcache.service"
    copy.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/start-cache ",
                                             f"ExecStart={shutil.which('true')} "))
    assert copy.read_text() != UNIT.read_text()
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", str(copy)], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert (0, "", "") == (result.returncode, result.stdout, result.stderr)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: systemd)")
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path):
    """``systemd-analyze security --offline`` rates the unit's exposure at most 4.0 ("OK")."""
    result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", "--threshold=40", "--no-pager",
                             str(UNIT)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    if "--offline" in result.stderr and ("unrecognized" in result.stderr or "Unknown" in result.stderr):
        pytest.skip(f"systemd-analyze has no --offline (systemd 252 and later): {result.stderr.strip()}")
    assert 0 == result.returncode, result.stdout[-2000:] + result.stderr


# --- the dashboard's job and instance variables, the alerts' runbooks --------------------------------------------

def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its label matchers) for every series selector of a PromQL expression."""
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    return [(match.group(1), match.group(2) or "") for match in
            re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?(?!\s*\()", text)
            if match.group(1) in metric_names(expr)]


def test_every_dashboard_query_selects_the_job_and_instance_variables():
    """The dashboard has job and instance variables (multi-valued, All = every value, from mpcache_build_info,
    instance within the chosen jobs), and every series selector of every panel matches both."""
    dashboard = load_dashboard()
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert ("label_values(mpcache_build_info, job)", 'label_values(mpcache_build_info{job=~"$job"}, instance)') == (
        variables["job"]["query"]["query"], variables["instance"]["query"]["query"])
    assert all((v["multi"], v["includeAll"], v["allValue"]) == (True, True, ".*") for v in
               (variables["job"], variables["instance"]))
    unfiltered = [(title, name) for title, expr in dashboard_exprs(dashboard) for name, matchers in selectors(expr)
                  if 'job=~"$job"' not in matchers or 'instance=~"$instance"' not in matchers]
    assert ([], True) == (unfiltered, len(dashboard_exprs(dashboard)) > 50)


def operations_sections() -> dict[str, str]:
    """deploy/OPERATIONS.md's ### sections: GitHub's anchor of the heading → the section's text."""
    sections: dict[str, str] = {}
    anchor = None
    for line in (DEPLOY / "OPERATIONS.md").read_text().splitlines():
        if line.startswith("#"):
            anchor = re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-") \
                if line.startswith("### ") else None
            if anchor:
                sections[anchor] = ""
        elif anchor:
            sections[anchor] += line + "\n"
    return sections


RUNBOOK_BASE = ("{{ with $externalLabels.mpcache_runbook_base }}{{ . }}{{ else }}http://{{ $labels.instance }}"
                "/runbook{{ end }}")


def test_every_alert_has_a_runbook_url_to_a_section_of_operations_that_says_what_to_do():
    """Every alert links to its section of the runbook: by default the page the service itself serves at the
    alert's instance (/runbook, an absolute URL that works wherever mpcache runs), else the external label
    mpcache_runbook_base; the section says more than when the alert fires."""
    text = ALERTS_YML.read_text()
    alerts = re.findall(r"- alert: (\S+)\n(?:(?!\n\s*- alert:).)*?runbook_url: \"([^\"]+)\"", text, re.DOTALL)
    sections = operations_sections()
    assert len(alerts) == text.count("- alert:") == len(alert_exprs()) >= 10
    for name, url in alerts:
        base, _, anchor = url.partition("#")
        assert (RUNBOOK_BASE, name.lower()) == (base, anchor)
        assert anchor in sections and len(sections[anchor].split()) > 15, name  # more than its fires-when line


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
@pytest.mark.parametrize("base", ["", "https://ops.example/mpcache/runbook"])
def test_promtool_fires_the_descriptor_alert_with_a_working_runbook_url(tmp_path, base):
    """promtool's rule unit test on the shipped alerts.yml: a cache process at 90 % of its descriptor limit
    (telemetry at 1 %) is pending at 4 minutes and firing at 6 for that process alone, and its runbook_url is
    the service's own /runbook section — or under the external label mpcache_runbook_base when it is set."""
    labels = 'instance="a:9090", job="mpcache"'
    series = [(f'mpcache_process_open_fds{{{labels}, role="cache", worker="0"}}', "900x10"),
              (f'mpcache_process_max_fds{{{labels}, role="cache", worker="0"}}', "1000x10"),
              (f'mpcache_process_open_fds{{{labels}, role="telemetry"}}', "10x10"),
              (f'mpcache_process_max_fds{{{labels}, role="telemetry"}}', "1000x10")]
    fired = {"exp_labels": {"severity": "warning", "instance": "a:9090", "role": "cache", "worker": "0"},
             "exp_annotations": {
                 "summary": "mpcache cache0 uses 90% of its file descriptors on a:9090",
                 "description": alert_annotation("MpcacheDescriptorsNearLimit", "description"),
                 "runbook_url": f"{base or 'http://a:9090/runbook'}#mpcachedescriptorsnearlimit"}}
    group: dict = {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                   "alert_rule_test": [
                       {"eval_time": "4m", "alertname": "MpcacheDescriptorsNearLimit", "exp_alerts": []},
                       {"eval_time": "6m", "alertname": "MpcacheDescriptorsNearLimit", "exp_alerts": [fired]}]}
    if base:
        group["external_labels"] = {"mpcache_runbook_base": base}
    path = tmp_path / "alerts-test.yml"
    path.write_text(json.dumps({"rule_files": [str(ALERTS_YML)], "evaluation_interval": "1m", "tests": [group]}))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert 0 == result.returncode, result.stdout + result.stderr


def alert_annotation(alert: str, name: str) -> str:
    """One annotation of one alert of alerts.yml, as written there (a double-quoted one-line value)."""
    text = ALERTS_YML.read_text()
    block = text[text.index(f"- alert: {alert}\n"):].split("\n\n")[0]
    return json.loads(re.search(rf'^\s+{name}: (".*")$', block, re.MULTILINE).group(1))


def test_the_packaged_runbook_is_the_alerts_section_of_operations():
    """mpcache/supervisor/runbook/runbook.md, which the service serves at /runbook, is OPERATIONS.md's alerts
    section as it stands (python -m mpcache.supervisor.runbook deploy/OPERATIONS.md rewrites it)."""
    from mpcache.supervisor import runbook

    assert runbook.extract((DEPLOY / "OPERATIONS.md").read_text()) == runbook.packaged()
