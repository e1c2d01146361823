"""What docs/BENCHMARKS.md says of vLLM's worker, why ``python -m benchmarks vllm`` waits before each request, read
from the vLLM the benchmark runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from benchmarks.vllm_engine import ENGINE_ENV, REPO


def test_vllm_s_worker_spins_for_the_second_the_benchmark_s_docs_say(vllm_python) -> None:
    """The default ``busy_loop_s`` of vLLM's shared-memory message queue, read from its source (not imported: an
    import takes the engine's start-up), is the second docs/BENCHMARKS.md names, in the vLLM version it names."""
    located = subprocess.run([vllm_python, "-c", "import importlib.util as u; "
                              "print(u.find_spec('vllm').submodule_search_locations[0])"],
                             env=dict(os.environ, **ENGINE_ENV), capture_output=True, text=True, timeout=120)
    assert 0 == located.returncode, located.stderr
    package = Path(located.stdout.strip())
    assert re.search(r"^__version__ = version = '0\.32\.", (package / "_version.py").read_text(), re.MULTILINE)
    source = (package / "distributed" / "device_communicators" / "shm_broadcast.py").read_text()
    [default] = re.findall(r"busy_loop_s: float = ([\d.]+)", source)
    assert 1.0 == float(default)
    docs = " ".join((REPO / "docs" / "BENCHMARKS.md").read_text().split())
    assert "worker spins after each step, for its `busy_loop_s`, a second in vLLM 0.32," in docs
