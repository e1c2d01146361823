"""The spec's PromQL, run by a real Prometheus server scraping ``bin/start-cache --demo`` every second.

The ``prometheus`` binary (Debian package ``prometheus``; ``.ci/run`` installs it) runs on loopback
with its TSDB in ``tmp_path`` and a generated scrape config.  The test waits, polling Prometheus's
HTTP API against a deadline, until it has scraped the demo a few times, then runs the queries of
``spec/METRICS.seed.txt`` through ``/api/v1/query`` and checks what comes back.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support.ports import free_port
from support.prometheus import PROMETHEUS, PrometheusServer
from support.silent import silent_listener
from support.waiting import wait_for

pytestmark = pytest.mark.slow

MODELS = {"llama-3-8b", "qwen-2-7b"}  # mpcache.demo.MODELS: the demo's two models
SCRAPES_BEFORE_QUERYING = 6  # samples per series in the [1m] window before rates are asked for

AGGREGATE_HIT_RATE = (
    "sum(rate(lmcache_mp_lookup_hit_tokens_total[1m])) / sum(rate(lmcache_mp_lookup_requested_tokens_total[1m]))")
PER_MODEL_HIT_RATE = (
    "sum by (model_name) (rate(lmcache_mp_lookup_hit_tokens_total[1m]))"
    " / sum by (model_name) (rate(lmcache_mp_lookup_requested_tokens_total[1m]))")
L2_STORE_RATE = "sum by (l2_name) (rate(lmcache_mp_l2_store_completed_requests_total[1m]))"
BLEND_REQUESTED_RATE = "sum(rate(lmcache_blend_lookup_requested_tokens_total[1m]))"
BLEND_HIT_RATE = (
    "sum(rate(lmcache_blend_lookup_hit_tokens_total[1m])) / " + BLEND_REQUESTED_RATE)


@pytest.fixture
def prometheus_server(tmp_path):
    """Starts PrometheusServers on demand; stops them all at teardown.  Skips when there is no binary."""
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus)")
    started: list[PrometheusServer] = []

    def start(target: str, rule_files: tuple[str, ...] = ()) -> PrometheusServer:
        server = PrometheusServer(tmp_path, target, rule_files)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def by_label(result: list[dict], label: str) -> dict[str, float]:
    return {series["metric"].get(label, ""): float(series["value"][1]) for series in result}


def test_spec_promql_on_a_real_prometheus_gives_hit_rates_in_range(start_service, prometheus_server, tmp_path):
    """Prometheus scraping the demo (fs + mock L2) every second answers the spec's queries with numbers
    in range: the aggregate and blend lookup hit rates are single values in [0, 1], the per-model hit
    rate has exactly one series per demo model, each in [0, 1], and the L2 store rate has one series
    per l2_name (fs, mock), each > 0."""
    fs = '{"type": "fs", "path": "%s", "capacity_gb": 0.008}' % (tmp_path / "l2fs")
    mock = '{"type": "mock", "capacity_gb": 0.05, "failure_rate": 0.1, "seed": 3}'
    service = start_service("--demo", "--workers", "2", "--duration", "55", "--l2", fs, "--l2", mock)
    wait_for(service.scrape, 20, "the demo's /metrics")
    prometheus = prometheus_server(f"127.0.0.1:{service.port}")
    wait_for(prometheus.ready, 15, "prometheus to be ready")

    def scraped_enough():
        samples = prometheus.scalar('min(count_over_time(up{job="mpcache"}[1m]))')
        healthy = prometheus.scalar('min(up{job="mpcache"})')
        return samples is not None and samples >= SCRAPES_BEFORE_QUERYING and healthy == 1.0

    wait_for(scraped_enough, 25, f"{SCRAPES_BEFORE_QUERYING} successful scrapes of the demo")

    aggregate = prometheus.scalar(AGGREGATE_HIT_RATE)
    per_model = by_label(prometheus.query(PER_MODEL_HIT_RATE), "model_name")
    l2_stores = by_label(prometheus.query(L2_STORE_RATE), "l2_name")
    blend_requested = prometheus.scalar(BLEND_REQUESTED_RATE)
    blend = prometheus.scalar(BLEND_HIT_RATE)
    print(f"hit rate {aggregate}, per model {per_model}, L2 stores/s {l2_stores}, "
          f"blend hit rate {blend} (blend requested tokens/s {blend_requested})")

    assert aggregate is not None and 0.0 <= aggregate <= 1.0, aggregate
    assert MODELS == set(per_model)
    assert [] == [m for m, rate in per_model.items() if not 0.0 <= rate <= 1.0]
    assert {"fs", "mock"} == set(l2_stores)
    assert [] == [name for name, rate in l2_stores.items() if not rate > 0]
    # The demo's RAG load (mpcache.demo.rag) drives blend lookups, so the denominator moves and the
    # ratio is a number; were it ever 0, Prometheus would answer NaN (0/0), which this names.
    assert blend_requested is not None and blend_requested > 0, f"blend lookups not moving: {blend_requested}"
    assert blend is not None and not math.isnan(blend) and 0.0 <= blend <= 1.0, blend
    check_dashboard_variables(prometheus, f"127.0.0.1:{service.port}")
    assert 0 == service.stop()


def check_dashboard_variables(prometheus: PrometheusServer, instance: str) -> None:
    """The Grafana dashboard's job and instance variables on this Prometheus: their label_values queries
    find this scrape's job and instance, every panel query evaluates with them substituted as Grafana does
    (one value, or All as .*), and the aggregate hit rate filtered to this instance is the unfiltered one
    (the only target), while another job's selects nothing."""
    import pathlib

    dashboard = json.loads((pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" /
                            "mpcache-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for inner in [panel, *panel.get("panels", [])]
             for target in inner.get("targets", [])]
    values = {}
    for name, label in (("job", "job"), ("instance", "instance")):
        url = f"http://127.0.0.1:{prometheus.port}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
            {"match[]": "mpcache_build_info"})
        with urllib.request.urlopen(url, timeout=5) as response:
            values[name] = json.loads(response.read())["data"]
    assert {"job": ["mpcache"], "instance": [instance]} == values

    def substituted(expr: str, job: str, chosen: str) -> str:
        return expr.replace("$__rate_interval", "1m").replace("$job", job).replace("$instance", chosen)

    hit_rate = next(expr for expr in exprs if expr.startswith("sum(rate(lmcache_mp_lookup_hit_tokens_total{"))
    for job, chosen in (("mpcache", instance), (".*", ".*")):
        for expr in exprs:
            prometheus.query(substituted(expr, job, chosen))  # asserts status success
        assert prometheus.scalar(substituted(hit_rate, job, chosen)) == pytest.approx(
            prometheus.scalar(AGGREGATE_HIT_RATE), rel=0.05)
    assert [] == prometheus.query(substituted(hit_rate, "other", ".*"))


ALERTS_YML = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
HOLD_S = 5  # MpcacheL2Failing's for: in the test's copy of the rules


def test_the_shipped_l2_alert_fires_on_an_unreachable_then_hung_redis(start_service, prometheus_server, tmp_path):
    """The demo with a redis tier where nothing listens, scraped every second by a real Prometheus evaluating the
    shipped deploy/prometheus/alerts.yml (every rule as shipped, MpcacheL2Failing's ``for:`` shortened to
    HOLD_S: Prometheus's own timer, not the rule, is what a longer one would wait on): MpcacheL2Failing goes
    pending, then fires once its ``for:`` has passed, and no other alert of the file fires; its runbook_url opens
    the runbook's section on the service itself. Then a server comes up on that port that accepts connections and
    never answers: the tier connects to it, the failure counters go on moving, nothing completes, and the alert
    stays firing."""
    assert _for_seconds("MpcacheL2Failing", ALERTS_YML.read_text()) > HOLD_S
    rules = tmp_path / "alerts.yml"
    rules.write_text(_with_for("MpcacheL2Failing", ALERTS_YML.read_text(), f"{HOLD_S}s"))
    hold_s = _for_seconds("MpcacheL2Failing", rules.read_text())
    port = free_port()
    tier = json.dumps({"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "capacity_gb": 0.01,
                       "socket_timeout_s": 0.3, "connect_timeout_s": 0.3})
    service = start_service("--demo", "--workers", "1", "--duration", str(hold_s + 180), "--l2", tier)
    wait_for(service.scrape, 30, "the demo's /metrics")
    prometheus = prometheus_server(f"127.0.0.1:{service.port}", (str(rules),))
    wait_for(prometheus.ready, 15, "prometheus to be ready")
    pending = wait_for(lambda: prometheus.alerts().get("MpcacheL2Failing"), 60, "MpcacheL2Failing to be active")
    firing = wait_for(lambda: (alerts := prometheus.alerts()).get("MpcacheL2Failing", {}).get("state") == "firing"
                      and alerts, hold_s + 30, "MpcacheL2Failing to fire")
    runbook_url = firing["MpcacheL2Failing"]["annotations"]["runbook_url"]
    with urllib.request.urlopen(runbook_url, timeout=5) as response:
        runbook = response.read().decode()
    failed = "sum(mpcache_l2_store_failed_requests_total)"
    unreachable = prometheus.scalar(failed)
    accepted: list = []
    with silent_listener(port, accepted):
        hung = wait_for(lambda: accepted and prometheus.scalar(failed) > unreachable + 1 and prometheus.scalar(failed),
                        60, "store failures against the hung server")
        still = prometheus.alerts().get("MpcacheL2Failing", {}).get("state")
        completed = prometheus.scalar("sum(lmcache_mp_l2_store_completed_requests_total)")
        assert 0 == service.stop()

    assert "pending" == pending["state"] or hold_s == 0
    assert ["MpcacheL2Failing"] == [name for name, alert in firing.items() if alert["state"] == "firing"]
    assert f"http://127.0.0.1:{service.port}/runbook#mpcachel2failing" == runbook_url
    assert 'id="mpcachel2failing"' in runbook
    assert (True, True, "firing", 0.0) == (unreachable is not None and unreachable > 0, hung > unreachable, still,
                                           completed)


def _for_seconds(alert: str, text: str) -> int:
    """The ``for:`` of ``alert`` in a rule file's ``text``, in seconds (written as Nm or Ns)."""
    block = text[text.index(f"- alert: {alert}\n"):].split("\n\n")[0]
    value = re.search(r"^\s+for: (\d+)([ms])$", block, re.MULTILINE)
    assert value is not None, block
    return int(value.group(1)) * (60 if value.group(2) == "m" else 1)


def _with_for(alert: str, text: str, hold: str) -> str:
    """``text`` with the ``for:`` of ``alert``'s rule (and no other line) set to ``hold``."""
    start = text.index(f"- alert: {alert}\n")
    end = start + len(text[start:].split("\n\n")[0])
    block, count = re.subn(r"^(\s+for: )\S+$", lambda match: match.group(1) + hold, text[start:end], flags=re.MULTILINE)
    assert 1 == count, text[start:end]
    return text[:start] + block + text[end:]
