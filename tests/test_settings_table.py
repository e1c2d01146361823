"""The one table of settings: every setting declared once on Config reaches the run the same way as a flag,
an MPCACHE_* variable and a TOML key; the same kinds check a Config built by code or read from JSON; every
MPCACHE_* name the project uses is a setting or declared as something else; --check-config."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from mpcache.config import FOREIGN_PREFIXES, OTHER_VARIABLES, SETTINGS, Config
from mpcache.config.kinds import Choice, Integer, JsonObject, Number, Repeated, Size, Switch, Text
from mpcache.errors import ConfigError
from mpcache.supervisor import settings
from mpcache.supervisor.sources import resolve

REPO = Path(__file__).resolve().parent.parent
START_CACHE = [sys.executable, str(REPO / "bin" / "start-cache")]
MOCK_TIER = {"type": "mock", "capacity_gb": 1}
MISSPELT_HERE = ("test_settings.py", "test_settings_table.py", "CONFIGURATION.md")  # misspelt on purpose


def _sample(item) -> tuple[object, object]:
    """A value of ``item``'s kind other than its default, as given (text or a TOML value) and as it must arrive."""
    kind = item.kind
    if isinstance(kind, Switch):
        return "true", True
    if isinstance(kind, Size):
        return "2MiB", 2 * 2**20
    if isinstance(kind, Integer):
        value = next(v for v in ((kind.low * 2, kind.low * 4) if kind.power_of_two else (kind.low + 1, kind.low + 2))
                     if v != item.default)
        return str(value), value
    if isinstance(kind, Number):
        value = (kind.low + kind.high) / 2 if math.isfinite(kind.high) else kind.low + 1.5
        value = value if value != item.default else value / 2
        return repr(value), value
    if isinstance(kind, Choice):
        value = next(option for option in kind.options if option != item.default)
        return value, value
    if isinstance(kind, Text):
        return "node-7", "node-7"
    if isinstance(kind, Repeated) and isinstance(kind.item, JsonObject):
        return [MOCK_TIER], [MOCK_TIER]
    if isinstance(kind, Repeated):
        return [1000, 1001], [1000, 1001]
    raise AssertionError(f"no sample for {kind!r}")


def _toml_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(entry) for entry in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml_value(entry)}" for key, entry in value.items()) + "}"
    return json.dumps(value)


def _flag_words(item, given) -> list[str]:
    if isinstance(item.kind, Switch):
        return [item.flag]
    if isinstance(given, list):
        return [word for entry in given for word in (item.flag, json.dumps(entry) if isinstance(entry, dict)
                                                      else str(entry))]
    return [item.flag, str(given)]


@pytest.mark.parametrize("item", SETTINGS, ids=lambda item: item.name)
def test_each_setting_reads_the_same_from_a_flag_a_variable_and_a_file(item, tmp_path):
    given, expected = _sample(item)
    assert expected != item.default
    toml = tmp_path / "mpcache.toml"
    toml.write_text(f"{item.name} = {_toml_value(given)}\n")
    from_flag = settings.parse(_flag_words(item, given), {})
    from_env = settings.parse([], {item.env: json.dumps(given) if isinstance(given, list) else str(given)})
    from_file = settings.parse(["--config", str(toml)], {})
    assert [expected] * 3 == [resolved.values[item.name] for resolved in (from_flag, from_env, from_file)]
    assert [f"flag --{item.name}", f"environment MPCACHE_{item.name.upper().replace('-', '_')}", f"file {toml}"] == [
        resolved.sources[item.name] for resolved in (from_flag, from_env, from_file)]


def test_the_help_lists_every_setting_once_under_its_flag():
    text = subprocess.run([*START_CACHE, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    flags = re.findall(r"^  (?:-[a-z], )?(--[a-z0-9-]+)", text, re.MULTILINE)
    assert sorted([item.flag for item in SETTINGS] + ["--check-config", "--config", "--help", "--version"]) == \
        sorted(flags)


@pytest.mark.parametrize(("values", "message"), [
    ({"workers": 0}, "--workers: expected an integer >= 1"),
    ({"ring_capacity_cells": 3000}, "--ring-cells: expected a power of two >= 1024"),
    ({"mrc_exact_chunks": 17}, "--mrc-exact-chunks: expected an integer 0..16"),
    ({"l1_watermark": 0.0}, "--l1-watermark: expected a number in (0, 1]"),
    ({"log_level": "loud"}, "--log-level: expected one of debug, info, warning, error"),
    ({"lmcache_allow_uids": [-1]}, "--lmcache-allow-uid: expected a list, each entry an integer 0..4294967294"),
    ({"hang_timeout_s": math.inf}, "--hang-timeout: expected finite seconds >= 1"),
    # a half-life just above 0 would empty the curves at every decay
    ({"mrc_half_life_s": 5e-324}, "--mrc-half-life: expected 0 (off) or finite seconds >= 1"),
    ({"mrc_half_life_s": 0.5}, "--mrc-half-life: expected 0 (off) or finite seconds >= 1"),
    ({"mrc_half_life_s": -1.0}, "--mrc-half-life: expected 0 (off) or finite seconds >= 1"),
    ({"mrc_half_life_s": True}, "--mrc-half-life: expected 0 (off) or finite seconds >= 1"),
])
def test_a_config_built_by_code_or_read_from_json_is_checked_by_its_settings_kinds(values, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Config(supervisor_pid=1, instance_id="i", **values)
    good = Config(supervisor_pid=1, instance_id="i")
    data = {**json.loads(good.to_json()), **values}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Config.from_json(json.dumps(data))


def test_a_half_life_of_0_is_off_and_one_of_a_second_or_more_is_taken() -> None:
    assert [0, 0.0, 1.0, 7200] == [Config(supervisor_pid=1, instance_id="i", mrc_half_life_s=value).mrc_half_life_s
                                   for value in (0, 0.0, 1.0, 7200)]


def test_every_mpcache_variable_the_project_names_is_a_setting_or_declared_as_another():
    """A variable the tests, CI, the deployment files or the code use must not be refused as a misspelt
    setting when it is in start-cache's environment."""
    named: set[str] = set()
    for folder in ("mpcache", "bin", "deploy", "tests", ".ci", "docs"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix not in (".pyc", ".so", ".png") and path.name not in MISSPELT_HERE:
                named |= set(re.findall(r"\bMPCACHE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    named |= set(re.findall(r"\bMPCACHE_[A-Z0-9_]*[A-Z0-9]\b", (REPO / "README.md").read_text()))
    tests_and_ci = {name for name in named if name.startswith(FOREIGN_PREFIXES)}
    assert {"MPCACHE_TEST_LMCACHE_PYTHON", "MPCACHE_CI_CACHE"} <= tests_and_ci  # the scan sees .ci and tests
    assert set() == named - {item.env for item in SETTINGS} - set(OTHER_VARIABLES) - tests_and_ci
    assert set() == set(OTHER_VARIABLES) & {item.env for item in SETTINGS}
    assert [] == [item.env for item in SETTINGS if item.env.startswith(FOREIGN_PREFIXES)]
    assert [] == [name for name in OTHER_VARIABLES if name.startswith(FOREIGN_PREFIXES)]
    resolved = settings.parse([], {**{name: "1" for name in OTHER_VARIABLES if name != "MPCACHE_CONFIG"},
                                   **dict.fromkeys(tests_and_ci, "1")})
    assert all(source == "default" or source.startswith("default") for source in resolved.sources.values())


def _check_config(tmp_path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    """``start-cache --check-config`` in a clean environment; its port probe on a port nothing else can hold
    (port 0) unless the test names one: 9090 may be taken on a shared machine."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_"))}
    return subprocess.run([*START_CACHE, "--check-config", *argv], capture_output=True, text=True, timeout=60,
                          env={**env, "MPCACHE_PROMETHEUS_PORT": "0", **environ}, cwd=tmp_path)


def test_check_config_prints_every_setting_with_its_source_as_a_file_that_gives_the_same_settings(tmp_path):
    toml = tmp_path / "mpcache.toml"
    toml.write_text('workers = 4\nl1-size = "1GiB"\n[[l2]]\ntype = "mock"\ncapacity_gb = 1\n')
    result = _check_config(tmp_path, "--config", str(toml), "--log-level", "debug", "--demo",
                           MPCACHE_LMCACHE_PORT="5555", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317",
                           MPCACHE_TEST_LMCACHE_PYTHON="/nonexistent/python")
    assert (0, "") == (result.returncode, result.stderr)
    printed = tomllib.loads(result.stdout)
    assert [item.name for item in SETTINGS] == list(printed)
    sources = dict(re.findall(r"^([a-z0-9-]+) = .*  # (.*)$", result.stdout, re.MULTILINE))
    assert {"workers": f"file {toml}", "l2": f"file {toml}", "log-level": "flag --log-level",
            "lmcache-port": "environment MPCACHE_LMCACHE_PORT", "demo": "flag --demo",
            "otlp-endpoint": "environment OTEL_EXPORTER_OTLP_ENDPOINT", "metrics-sample-rate": "default with --demo",
            "prefetch-job-ttl": "default with --demo", "chunk-size": "default"} == {
        name: sources[name] for name in ("workers", "l2", "log-level", "lmcache-port", "demo", "otlp-endpoint",
                                         "metrics-sample-rate", "prefetch-job-ttl", "chunk-size")}
    assert (4, 2**30, [MOCK_TIER], "debug", 5555, 0.1, 3.0, "http://127.0.0.1:4317") == (
        printed["workers"], printed["l1-size"], printed["l2"], printed["log-level"], printed["lmcache-port"],
        printed["metrics-sample-rate"], printed["prefetch-job-ttl"], printed["otlp-endpoint"])
    (tmp_path / "printed.toml").write_text(result.stdout)
    again = _check_config(tmp_path, "--config", str(tmp_path / "printed.toml"))
    assert (0, printed) == (again.returncode, tomllib.loads(again.stdout))
    assert not list(tmp_path.glob("run*")) and "runtime-dir" in printed  # nothing started, nothing created


def test_check_config_exits_2_with_one_line_and_hides_passwords(tmp_path):
    bad = _check_config(tmp_path, "--l1-size", "32KiB", MPCACHE_CHUNK_BYTES="64KiB")
    assert (2, "", ["start-cache: error: --l1-size: must hold at least one chunk (--chunk-bytes)"]) == (
        bad.returncode, bad.stdout, bad.stderr.splitlines())
    unknown = _check_config(tmp_path, MPCACHE_L1_SIZ="1GiB")
    assert (2, ["start-cache: error: MPCACHE_L1_SIZ: not a setting of start-cache (did you mean MPCACHE_L1_SIZE?)"]) \
        == (unknown.returncode, unknown.stderr.splitlines())
    tier = {"type": "redis", "url": "redis://mpcache:hunter2@127.0.0.1:6379/0", "capacity_gb": 1}
    shown = _check_config(tmp_path, "--l2", json.dumps(tier))
    assert (0, False, True) == (shown.returncode, "hunter2" in shown.stdout,
                                "redis://mpcache:(hidden)@127.0.0.1:6379/0" in shown.stdout)
    malformed = _check_config(tmp_path, "--l2", json.dumps(tier)[:-1])  # not JSON: not echoed either
    assert (2, 1, False) == (malformed.returncode, len(malformed.stderr.splitlines()), "hunter2" in malformed.stderr)


def test_opentelemetry_variables_fill_only_the_otlp_settings_not_given():
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_METRIC_EXPORT_INTERVAL": "2500", "OTEL_SDK_DISABLED": "true"}
    derived = settings.parse([], environ)
    given = settings.parse(["--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol", "grpc",
                            "--otlp-interval", "5"], {**environ, "MPCACHE_DISABLE_METRICS": "false"})
    names = ("otlp-endpoint", "otlp-protocol", "otlp-interval", "disable-metrics")
    assert ["http://collector:4318", "http/protobuf", 2.5, True] == [derived.values[name] for name in names]
    # OTEL_SDK_DISABLED turns metrics off whatever --disable-metrics says, as the SDK would
    assert ["http://127.0.0.1:4317", "grpc", 5.0, True] == [given.values[name] for name in names]
    assert "environment OTEL_SDK_DISABLED" == given.sources["disable-metrics"]
    with pytest.raises(ConfigError, match="^OTEL_EXPORTER_OTLP_PROTOCOL: expected grpc or http/protobuf"):
        resolve({}, "", {"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"})


def test_the_configuration_page_lists_every_setting_as_the_table_declares_it():
    """docs/CONFIGURATION.md's reference is the table's own rendering (python -m mpcache.config.reference)."""
    from mpcache.config import reference

    text = (REPO / "docs" / "CONFIGURATION.md").read_text()
    block = text[text.index(reference.BEGIN):text.index(reference.END) + len(reference.END)]
    assert reference.markdown() == block
    assert all(f"`{item.flag}" in block and f"`{item.env}`" in block for item in SETTINGS)
