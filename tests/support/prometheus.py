"""A real ``prometheus`` server (Debian package ``prometheus``; ``.ci/run`` installs it) on loopback, its TSDB in
a test's directory, scraping one target: what a test asks PromQL (and the alerts of rule files) of."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request

from support.ports import free_port

PROMETHEUS = shutil.which("prometheus")


class PrometheusServer:
    """A real ``prometheus`` on 127.0.0.1:<free port> scraping one target every ``interval`` (1s)."""

    def __init__(self, tmp_path, target: str, rule_files: tuple[str, ...] = (), interval: str = "1s") -> None:
        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        # JSON is YAML: no YAML library needed to write the config.
        config.write_text(json.dumps({
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": "mpcache", "static_configs": [{"targets": [target]}]}],
            "rule_files": list(rule_files),
        }))
        self.log = open(tmp_path / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )

    def ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
            return response.status == 200

    def query(self, promql: str) -> list[dict]:
        """The instant vector ``promql`` evaluates to now: a list of {"metric": labels, "value": [t, "v"]}."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert ("success", "vector") == (body["status"], body["data"]["resultType"]), body
        return body["data"]["result"]

    def alerts(self) -> dict[str, dict]:
        """Alert name → the alert (its state, pending or firing, labels and annotations) of those active now."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/alerts", timeout=5) as response:
            body = json.loads(response.read())
        return {alert["labels"]["alertname"]: alert for alert in body["data"]["alerts"]}

    def scalar(self, promql: str) -> float | None:
        """The one value ``promql`` gives, or None when the result is empty."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def label_values(self, label: str, match: str) -> list[str]:
        """The values ``label`` takes in the series ``match`` selects."""
        url = f"http://127.0.0.1:{self.port}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": match})
        with urllib.request.urlopen(url, timeout=5) as response:
            values: list[str] = json.loads(response.read())["data"]
        return values

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
