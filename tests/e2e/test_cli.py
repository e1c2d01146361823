"""The supervisor's command line: bad flags are one clear line and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_CACHE = os.path.join(REPO, "bin", "start-cache")


def run_start_cache(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, START_CACHE, *flags], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--workers", "zero"], "--workers"),
        (["--workers", "0"], "--workers"),
        (["--l1-size", "12XB"], "--l1-size"),
        (["--l1-watermark", "1.5"], "--l1-watermark"),
        (["--metrics-sample-rate", "0"], "--metrics-sample-rate"),
        (["--prometheus-port", "70000"], "--prometheus-port"),
        (["--otlp-protocol", "carrier-pigeon"], "--otlp-protocol"),
        (["--enable-tracing"], "--enable-tracing"),
        (["--ring-cells", "3000"], "--ring-cells"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--prometheus-host", "no.such.host.invalid"], "--prometheus-host"),
        (["--otlp-endpoint", "not a url"], "--otlp-endpoint"),
        (["--l2", "not json"], "--l2"),
        (["--l2", '{"type": "fs"}'], "--l2"),
        (["--l2", '{"type": "tape", "capacity_gb": 1}'], "--l2"),
        (["--log-max-bytes", "lots"], "--log-max-bytes"),
        (["--log-backups", "-1"], "--log-backups"),
        (["--log-file", "/nonexistent-dir/mpcache.log"], "--log-file"),
        (["--cache-salt-cap", "0"], "--cache-salt-cap"),
        (["--telemetry-nice", "20"], "--telemetry-nice"),
        (["--chunk-bytes", "12XB"], "--chunk-bytes"),
        (["--eviction-interval", "nan"], "--eviction-interval"),
        (["--duration", "-5"], "--duration"),
        (["--instance-id", "a/b"], "--instance-id"),
        (["--runtime-dir", "/tmp/" + "d" * 100], "--runtime-dir"),
    ],
)
def test_bad_flag_is_one_line_naming_it(flags: list[str], named: str) -> None:
    """Each invalid flag exits 2 with exactly one stderr line that names the flag.  The metrics port is a free one
    (unless the flag under test is it): the default, 9090, may be another process's (CI failed that way while a
    demo ran on the machine), and a port in use is reported first."""
    port = [] if "--prometheus-port" in flags else ["--prometheus-port", str(free_port())]
    result = run_start_cache(*port, *flags)
    lines = result.stderr.strip().splitlines()
    assert (2, 1) == (result.returncode, len(lines))
    assert named in lines[0]


def test_help_lists_every_documented_flag() -> None:
    """--help exits 0 and mentions the flags the README and docs/CONFIGURATION.md document."""
    result = run_start_cache("--help")
    assert 0 == result.returncode
    for flag in ("--workers", "--l1-size", "--prometheus-port", "--otlp-endpoint", "--demo", "--duration",
                 "--metrics-sample-rate", "--instance-id", "--log-file"):
        assert flag in result.stdout


@pytest.mark.parametrize("script", ["start-cache", "mpcache-logs"])
def test_version_prints_the_installed_version(script):
    """--version prints the program and the installed package's version (pyproject's), and exits 0."""
    import importlib.metadata

    result = subprocess.run([sys.executable, os.path.join(REPO, "bin", script), "--version"], capture_output=True,
                            text=True, timeout=60)
    assert (0, f"{script} (mpcache) {importlib.metadata.version('mpcache')}\n") == (result.returncode, result.stdout)
