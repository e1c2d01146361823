"""start-cache's settings from a TOML file, MPCACHE_* variables and flags: precedence, L2 tiers as tables,
one-line errors naming the setting and where it came from (an unknown one: the nearest valid name), every
setting reachable the same way through all three from its one declaration, and --check-config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpcache.errors import ConfigError
from mpcache.supervisor import settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, text: str | None, argv: list[str], environ: dict[str, str] | None = None):
    argv = list(argv)
    if text is not None:
        path = tmp_path / "mpcache.toml"
        path.write_text(text)
        argv = ["--config", str(path), *argv]
    resolved = settings.parse(argv, environ or {})
    return settings.config_from_settings(resolved, 1, str(tmp_path / "run")), resolved


def test_a_file_alone_describes_a_two_tier_deployment(tmp_path):
    config, _ = _config(tmp_path, f'''
workers = 4
l1-size = "1GiB"
chunk-bytes = "2MiB"
lmcache-port = 5555
otlp-endpoint = "http://127.0.0.1:4317"

[[l2]]
type = "fs"
path = "{tmp_path / 'l2'}"
capacity_gb = 100

[[l2]]
type = "redis"
url = "redis://127.0.0.1:6379/0"
capacity_gb = 400
''', [])
    assert (4, 2**30, 2 * 2**20, 5555, "http://127.0.0.1:4317") == (
        config.workers, config.l1_size_bytes, config.chunk_bytes, config.lmcache_port, config.otlp_endpoint)
    assert [("fs", 100), ("redis", 400)] == [(spec["type"], spec["capacity_gb"]) for spec in config.l2]


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path):
    text = 'workers = 4\nl1-watermark = 0.5\nlog-level = "warning"\n'
    config, resolved = _config(tmp_path, text, ["--workers", "2"],
                               {"MPCACHE_WORKERS": "3", "MPCACHE_L1_WATERMARK": "0.7"})
    assert (2, 0.7, "warning") == (config.workers, config.l1_watermark, config.log_level)
    assert {"workers": "flag --workers", "l1-watermark": "environment MPCACHE_L1_WATERMARK",
            "log-level": f"file {tmp_path / 'mpcache.toml'}", "chunk-size": "default"} == \
        {name: resolved.sources[name] for name in ("workers", "l1-watermark", "log-level", "chunk-size")}


def test_a_deprecated_setting_given_by_any_source_is_one_warning_and_by_default_none(tmp_path):
    """--l1-watermark is still accepted (and checked) but ignored: given by a flag, the environment or the
    file, the start logs one warning naming it and its source; left at its default, none."""
    for argv, environ, text, source in ((["--l1-watermark", "0.8"], {}, None, "flag --l1-watermark"),
                                        ([], {"MPCACHE_L1_WATERMARK": "0.8"}, None,
                                         "environment MPCACHE_L1_WATERMARK"),
                                        ([], {}, "l1-watermark = 0.8\n", f"file {tmp_path / 'mpcache.toml'}")):
        _, resolved = _config(tmp_path, text, argv, environ)
        assert [("l1-watermark", source)] == [(w["setting"], w["source"]) for w in settings.deprecated_given(resolved)]
    _, resolved = _config(tmp_path, None, [], {})
    assert [] == settings.deprecated_given(resolved)


def test_a_start_with_the_deprecated_watermark_logs_one_warning_and_serves(tmp_path):
    """start-cache --l1-watermark 0.8 starts, serves for its --duration and exits 0, with exactly one
    supervisor.deprecated_setting line naming the flag."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MPCACHE_", "OTEL_"))}
    result = subprocess.run([sys.executable, os.path.join(REPO, "bin", "start-cache"), "--l1-watermark", "0.8",
                             "--workers", "1", "--l1-size", "8MiB", "--prometheus-port", "0", "--duration", "1"],
                            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    warnings = [line for line in result.stderr.splitlines() if "supervisor.deprecated_setting" in line]
    assert (0, 1) == (result.returncode, len(warnings)), result.stderr
    assert "flag --l1-watermark" in warnings[0]


def test_environment_alone_and_booleans(tmp_path):
    config, _ = _config(tmp_path, None, [], {"MPCACHE_DEMO": "true", "MPCACHE_LMCACHE_IPC": "1",
                                            "MPCACHE_L2": '[{"type": "mock", "capacity_gb": 1}]'})
    assert (True, True, ["mock"]) == (config.demo, config.lmcache_ipc, [spec["type"] for spec in config.l2])


@pytest.mark.parametrize(("text", "environ", "message"), [
    ("workers = 0\n", {}, "mpcache.toml: workers: expected an integer >= 1, got '0'"),
    ("no-such-setting = 1\n", {}, "mpcache.toml: unknown setting 'no-such-setting'"),
    ("l1-sise = 1\n", {}, "mpcache.toml: unknown setting 'l1-sise' (a flag name without its dashes; "
     "did you mean 'l1-size'?)"),
    (None, {"MPCACHE_WORKRES": "3"}, "MPCACHE_WORKRES: not a setting of start-cache (did you mean MPCACHE_WORKERS?)"),
    (None, {"MPCACHE_CONFG": "a.toml"}, "MPCACHE_CONFG: not a setting of start-cache (did you mean MPCACHE_CONFIG?)"),
    ("[service]\n", {}, "mpcache.toml: unknown setting 'service' (a flag name without its dashes; none is close: "
     "start-cache --help lists them)"),  # nothing near: no made-up suggestion
    (None, {"MPCACHE_QQQQQQQQQQQQQQQQQQQQQQQQQ": "1"},
     "MPCACHE_QQQQQQQQQQQQQQQQQQQQQQQQQ: not a setting of start-cache (none is close: start-cache --help lists them)"),
    ("workers = \n", {}, "not valid TOML"),
    (None, {"MPCACHE_LOG_LEVEL": "loud"}, "MPCACHE_LOG_LEVEL: expected one of debug, info, warning, error"),
    (None, {"MPCACHE_DEMO": "maybe"}, "MPCACHE_DEMO: expected true or false"),
    ("l1-watermark = 2\n", {}, "mpcache.toml: l1-watermark: expected a number in (0, 1], got '2'"),
    (None, {"MPCACHE_L1_WATERMARK": "0"}, "MPCACHE_L1_WATERMARK: expected a number in (0, 1], got '0'"),
    ("enable-tracing = true\n", {}, "--enable-tracing: needs --otlp-endpoint (spans are exported over OTLP) "
     "(set in file "),
])
def test_a_bad_setting_is_one_line_naming_it_and_its_source(tmp_path, text, environ, message):
    argv = []
    if text is not None:
        (tmp_path / "mpcache.toml").write_text(text)
        argv = ["--config", str(tmp_path / "mpcache.toml")]
    result = subprocess.run([sys.executable, os.path.join(REPO, "bin", "start-cache"), *argv],
                            capture_output=True, text=True, timeout=60, env={**os.environ, **environ}, cwd=tmp_path)
    assert 2 == result.returncode
    lines = result.stderr.strip().splitlines()
    assert 1 == len(lines) and message in lines[0], result.stderr


def test_allowed_lmcache_uids_from_flags_file_and_environment(tmp_path, capsys):
    """--lmcache-allow-uid is repeatable, a TOML list or a JSON list in MPCACHE_LMCACHE_ALLOW_UID, each
    entry parsed as the flag's; a bad entry is one line naming its source."""
    flags, _ = _config(tmp_path, None, ["--lmcache-allow-uid", "1000", "--lmcache-allow-uid", "1001"])
    from_file, _ = _config(tmp_path, "lmcache-allow-uid = [1000, 1001]\n", [])
    from_env, _ = _config(tmp_path, None, [], {"MPCACHE_LMCACHE_ALLOW_UID": "[1000, 1001]"})
    assert [1000, 1001] == flags.lmcache_allow_uids == from_file.lmcache_allow_uids == from_env.lmcache_allow_uids
    with pytest.raises(SystemExit):
        _config(tmp_path, None, [], {"MPCACHE_LMCACHE_ALLOW_UID": '["nobody"]'})
    assert "MPCACHE_LMCACHE_ALLOW_UID: expected an integer 0..4294967294, got 'nobody'" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "::"])
def test_a_non_loopback_lmcache_host_needs_allow_remote(tmp_path, host):
    """A non-loopback --lmcache-host is refused naming --lmcache-allow-remote; with it, accepted."""
    argv = ["--lmcache-port", "5555", "--lmcache-host", host]
    with pytest.raises(ConfigError, match="--lmcache-host: .* --lmcache-allow-remote"):
        _config(tmp_path, None, argv)
    config, _ = _config(tmp_path, None, [*argv, "--lmcache-allow-remote"])
    assert config.lmcache_allow_remote and config.lmcache_host == host


def test_the_kv_events_endpoint_is_loopback_tcp_with_two_ports_per_cache_process(tmp_path):
    """--kv-events-endpoint: cache process i's PUB on PORT+2i and its replay socket on PORT+2i+1; refused when
    malformed, without an LMCache front end or the KV event log, or off loopback without --lmcache-allow-remote."""
    base = ["--lmcache-port", "5555", "--workers", "2"]
    config, _ = _config(tmp_path, None, [*base, "--kv-events-endpoint", "tcp://127.0.0.1:6000"])
    assert [config.kv_events_endpoints(i) for i in (0, 1)] == [
        ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"), ("tcp://127.0.0.1:6002", "tcp://127.0.0.1:6003")]
    refusals = [([*base, "--kv-events-endpoint", "ipc:///tmp/x"], "expected tcp://HOST:PORT"),
                (["--kv-events-endpoint", "tcp://127.0.0.1:6000"], "needs --lmcache-port"),
                ([*base, "--kv-event-log-size", "0", "--kv-events-endpoint", "tcp://127.0.0.1:6000"], "needs"),
                ([*base, "--kv-events-endpoint", "tcp://192.0.2.1:6000"], "not a loopback address")]
    for argv, message in refusals:
        with pytest.raises(ConfigError, match=f"^--kv-events-endpoint: .*{message}"):
            _config(tmp_path, None, argv)
    config, _ = _config(tmp_path, None, [*base, "--lmcache-allow-remote", "--kv-events-endpoint",
                                         "tcp://192.0.2.1:6000"])
    assert config.kv_events_endpoints(1)[1] == "tcp://192.0.2.1:6003"


def test_a_file_describes_a_cluster_tier_shared_by_a_fleet(tmp_path):
    """[[l2]] with cluster = true and shards is the same tier as the --l2 JSON; a cluster URL with a db is one
    line naming --l2."""
    config, _ = _config(tmp_path, '''
instance-id = "node-7"

[[l2]]
type = "redis"
cluster = true
url = "redis://redis-0.cache:6379"
capacity_gb = 400
shards = 32
''', [])
    assert ("node-7", [{"type": "redis", "cluster": True, "url": "redis://redis-0.cache:6379", "capacity_gb": 400,
                        "shards": 32}]) == (config.instance_id, config.l2)
    with pytest.raises(ConfigError, match="^--l2: a redis cluster has database 0 only"):
        _config(tmp_path, '[[l2]]\ntype = "redis"\ncluster = true\nurl = "redis://h:1/3"\ncapacity_gb = 1\n', [])
