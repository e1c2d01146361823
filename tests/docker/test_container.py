"""The image under a real Docker daemon: built with BuildKit and with the classic builder, run with the
flags of docs/DEPLOYMENT.md, an engine-side container (mpcache's client, another PID namespace, the same IPC
namespace and socket volume) doing verified round trips, ``docker stop``, a killed container started
again, Docker's default 64 MiB /dev/shm, and compose.yaml.

Skipped, saying why, where no Docker daemon answers or no base image is at hand (``.ci/run`` starts
the daemon and makes the base image with ``.ci/docker-base``; ``MPCACHE_TEST_REQUIRE_DOCKER=1`` turns those
skips into failures).  ``MPCACHE_TEST_DOCKER_BASE_IMAGE`` names the base image (default python:3.11-slim).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from support.ports import free_port
from support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
COMPOSE_YAML = REPO / "deploy" / "docker" / "compose.yaml"
DOCKER = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
TAG = uuid.uuid4().hex[:8]

# Image builds (up to 1200 s each) and compose runs bound each step; the test as a whole gets their sum.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("MPCACHE_TEST_REQUIRE_DOCKER") == "1":
        pytest.fail(f"MPCACHE_TEST_REQUIRE_DOCKER=1: {reason}")
    pytest.skip(reason)


def docker(*args: str, check: bool = True, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    assert DOCKER is not None
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: exit {result.returncode}\n{result.stdout}{result.stderr}")
    return result


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def build_args() -> list[str]:
    """BASE_IMAGE, and as EXTRA_CA_CERTS the CA certificates this host trusts beyond Debian's own
    (/usr/local/share/ca-certificates: a TLS-intercepting proxy's, here), so pip in the build trusts them too."""
    args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    extra = "".join(Path(path).read_text() for path in sorted(glob.glob("/usr/local/share/ca-certificates/*.crt")))
    if extra:
        args += ["--build-arg", f"EXTRA_CA_CERTS={extra}"]
    return args


BASE_IMAGE = os.environ.get("MPCACHE_TEST_DOCKER_BASE_IMAGE", "python:3.11-slim")


@pytest.fixture(scope="module")
def image():
    if DOCKER is None:
        _skip_or_fail("no docker client installed (Debian: apt-get install docker.io)")
    info = subprocess.run([DOCKER, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=60)
    if info.returncode != 0:
        _skip_or_fail(f"no Docker daemon answers: {info.stderr.strip()[:200]}")
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        _skip_or_fail(f"the base image {BASE_IMAGE} is not here (.ci/docker-base makes one; its name goes in "
                      "MPCACHE_TEST_DOCKER_BASE_IMAGE)")
    name = f"mpcache-test:{TAG}"
    docker("build", "-q", "-f", str(DOCKERFILE), *build_args(), "-t", name, str(REPO), timeout=1200,
           env={**os.environ, "DOCKER_BUILDKIT": "1"})
    yield name
    docker("rmi", "-f", name, check=False)


@pytest.fixture
def names(request):
    """A fresh name prefix; every container and volume under it is removed at teardown."""
    prefix = f"mpcache-test-{TAG}-{request.node.name[5:25].replace('[', '-').strip('_-')}"
    yield prefix
    containers = docker("ps", "-aq", "--filter", f"name={prefix}", check=False).stdout.split()
    if containers:
        docker("rm", "-f", *containers, check=False)
    volumes = docker("volume", "ls", "-q", "--filter", f"name={prefix}", check=False).stdout.split()
    if volumes:
        docker("volume", "rm", "-f", *volumes, check=False)


def documented_docker_run() -> list[str]:
    """The `docker run` line of docs/DEPLOYMENT.md's build-and-run block (the one after `docker build`), as
    words."""
    deployment = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    [line] = re.findall(r"^docker build .*\n(docker run .*)$", deployment, re.MULTILINE)
    return line.split("#")[0].split()


def published_port(container: str) -> int:
    return int(docker("port", container, "9090/tcp").stdout.split()[0].rsplit(":", 1)[1])


def health(container: str) -> str:
    return docker("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip()


def test_image_builds_with_the_classic_builder_too(image):
    """The same Dockerfile with DOCKER_BUILDKIT=0 (no RUN --mount, no COPY --chmod, no syntax line): the
    image runs start-cache of this checkout's version."""
    name = f"mpcache-test-classic:{TAG}"
    try:
        docker("build", "-q", "-f", str(DOCKERFILE), *build_args(), "-t", name, str(REPO), timeout=1200,
               env={**os.environ, "DOCKER_BUILDKIT": "0"})
        version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
        assert f"start-cache (mpcache) {version}" == docker("run", "--rm", name, "--version").stdout.strip()
    finally:
        docker("rmi", "-f", name, check=False)


def test_container_serves_an_engine_container_and_stops_clean(image, names):
    """docs/DEPLOYMENT.md's docker run line, with flags after the image (they add to the image's MPCACHE_*
    settings): the published port answers /healthz, /ready and /metrics, Docker's health check turns
    healthy; an engine container in another PID namespace, sharing the IPC namespace and the socket
    volume, completes verified round trips with both cache processes; `docker stop` exits 0 and leaves
    no segment in the /dev/shm the engine still sees; a killed container started again serves."""
    words = documented_docker_run()
    assert (["docker", "run"], "mpcache") == (words[:2], words[-1])
    mpcache, volume = f"{names}-mpcache", f"{names}-run"
    flags = []
    for word in words[2:-1]:
        if word == "--rm":
            flags += ["-d", "--name", mpcache]
        elif word.endswith(":9090:9090"):
            flags.append("127.0.0.1::9090")  # any free host port: the machine is shared
        else:
            flags.append(word)
    assert {"--init", "--shm-size=1g", "-p"} <= set(flags)
    docker("run", *flags, "--ipc", "shareable", "-v", f"{volume}:/run/mpcache", image, "--workers", "2",
           "--l1-size", "128MiB")
    base = f"http://127.0.0.1:{published_port(mpcache)}"
    status, ready = wait_for(lambda: (answer := get(base + "/ready"))[0] == 200 and answer, 60,
                             "/ready on the published port")
    assert (True, 2) == (json.loads(ready)["ready"], json.loads(ready)["serving"])
    assert (200, "ok") == ((healthz := get(base + "/healthz"))[0], json.loads(healthz[1])["status"])
    status, metrics = wait_for(lambda: (answer := get(base + "/metrics"))[0] == 200 and answer, 60,
                               "/metrics from telemetry, through the front")
    assert 200 == status and re.search(r"^mpcache_cache_processes_ready(\{[^}]*\})? 2\.0$", metrics, re.MULTILINE)
    assert "healthy" == wait_for(lambda: (state := health(mpcache)) != "starting" and state, 60,
                                 "the first health check")
    config = json.loads(docker("exec", mpcache, "cat", "/run/mpcache/service/config.json").stdout)
    assert ("0.0.0.0", 128 * 2**20) == (config["prometheus_host"], config["l1_size_bytes"])  # env and flag

    engine = f"{names}-engine"
    docker("run", "-d", "-i", "--name", engine, "--ipc", f"container:{mpcache}", "--user", "10001:10001",
           "-v", f"{volume}:/run/mpcache", "--entrypoint", "python3", image, "/opt/mpcache/engine_example.py",
           "20", "--hold")
    report = wait_for(lambda: (out := docker("logs", engine).stdout.strip()) and json.loads(out), 60,
                      "the engine's report")
    mpcache_pidns = docker("exec", mpcache, "readlink", "/proc/self/ns/pid").stdout.strip()
    mpcache_ipcns = docker("exec", mpcache, "readlink", "/proc/self/ns/ipc").stdout.strip()
    assert (2, [20, 20], [20, 20]) == (len(report["results"]), [r["verified"] for r in report["results"]],
                                       [r["rounds"] for r in report["results"]])
    assert (True, mpcache_ipcns, 10001) == (report["pid_namespace"] != mpcache_pidns, report["ipc_namespace"],
                                            report["uid"])
    in_shm = docker("exec", engine, "ls", "-a", "/dev/shm").stdout.split()
    assert 6 == len([name for name in in_shm if name.startswith("mpcache.")]), in_shm  # board, telemetry state,
    # 2 rings, 2 pools

    docker("stop", mpcache, timeout=120)
    assert "0" == docker("inspect", "-f", "{{.State.ExitCode}}", mpcache).stdout.strip()
    assert [".", ".."] == sorted(docker("exec", engine, "ls", "-a", "/dev/shm").stdout.split())
    assert "supervisor.stopped" in docker("logs", mpcache).stderr.splitlines()[-1]
    docker("rm", "-f", engine)

    docker("start", mpcache)
    wait_for(lambda: get(f"http://127.0.0.1:{published_port(mpcache)}/ready")[0] == 200, 60, "/ready after start")
    docker("kill", mpcache)  # SIGKILL: its sockets, marker and segments are left behind
    docker("start", mpcache)
    base = f"http://127.0.0.1:{published_port(mpcache)}"
    wait_for(lambda: get(base + "/ready")[0] == 200, 60, "/ready after a kill and a start")
    assert "leftover.removed" in docker("logs", mpcache).stderr


def test_dockers_default_dev_shm_is_refused_with_one_line(image, names):
    """Without --shm-size (Docker's 64 MiB /dev/shm): exit status 2, one line saying what is needed."""
    result = docker("run", "--name", f"{names}-small", image, check=False, timeout=120)
    lines = result.stderr.splitlines()
    assert (2, 1) == (result.returncode, len(lines)), result.stderr
    assert lines[0].startswith("start-cache: error: /dev/shm has 64.0 MiB free") and "--shm-size=" in lines[0]


def compose_command() -> list[str] | None:
    if subprocess.run([DOCKER or "docker", "compose", "version"], capture_output=True).returncode == 0:
        return [DOCKER or "docker", "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def compose_runner(command: list[str], env: dict[str, str]):
    """``run(*args)``: the compose command with ``args`` under ``env``; a non-zero exit raises unless
    ``check=False``."""
    def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: exit {result.returncode}\n{result.stdout}{result.stderr}")
        return result
    return run


HOST_PORTS = ("MPCACHE_METRICS_PORT", "MPCACHE_PROMETHEUS_UI_PORT", "MPCACHE_COLLECTOR_PORT")


def up_on_free_ports(run, env: dict[str, str], attempts: int = 3, choose_port=free_port) -> None:
    """``compose up`` on host ports newly chosen by ``choose_port``.  A port probed free can be taken by another
    test's listener before Docker binds it (CI failed that way); then the project comes down and goes up again
    on new ports."""
    for attempt in range(1, attempts + 1):
        env.update({variable: str(choose_port()) for variable in HOST_PORTS})
        result = run("up", "-d", "--no-build", check=False, timeout=600)
        if result.returncode == 0:
            return
        output = result.stdout + result.stderr
        if "address already in use" not in output or attempt == attempts:
            raise AssertionError(f"compose up -d --no-build: exit {result.returncode}\n{output}")
        run("down", "-v", "--remove-orphans", check=False, timeout=300)


def test_compose_up_starts_again_on_new_ports_when_a_port_was_taken_in_the_gap(image, names, tmp_path):
    """A host port taken after it was probed free (here by this test's listener) fails one `compose up`, as
    it failed CI; with attempts left, the project comes down and goes up on new ports."""
    compose = compose_command()
    if compose is None:
        _skip_or_fail("neither `docker compose` nor `docker-compose` is installed (Debian: docker-compose)")
    spec = tmp_path / "compose.yaml"
    spec.write_text('services:\n  listener:\n    image: ${MPCACHE_IMAGE}\n    entrypoint: ["sleep", "600"]\n'
                    '    ports:\n      - "127.0.0.1:${MPCACHE_METRICS_PORT}:9090"\n')
    env = {**os.environ, "MPCACHE_IMAGE": image}
    run = compose_runner([*compose, "-f", str(spec), "-p", names.replace("_", "-").lower()], env)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]

        def held_port_first():
            choices = iter([held])
            return lambda: next(choices, 0) or free_port()
        try:
            with pytest.raises(AssertionError, match="address already in use"):
                up_on_free_ports(run, env, attempts=1, choose_port=held_port_first())
            run("down", "-v", check=False)
            up_on_free_ports(run, env, attempts=3, choose_port=held_port_first())
            listener = run("ps", "-q", "listener").stdout.strip()
            published = int(docker("port", listener, "9090/tcp").stdout.split()[0].rsplit(":", 1)[1])
            assert held != published == int(env["MPCACHE_METRICS_PORT"])
        finally:
            run("down", "-v", check=False)


def test_compose_runs_mpcache_prometheus_the_collector_and_the_engine_example(image, names):
    """compose.yaml as shipped, on this checkout's image: mpcache turns healthy, Prometheus scrapes it
    (target up), its OTLP push reaches the collector, the engine example completes verified round trips,
    and `stop` exits mpcache 0.  Where prom/prometheus and the collector cannot be pulled, local images stand
    in for them (tests/docker/compose.local-images.yaml) and the test says so."""
    compose = compose_command()
    if compose is None:
        _skip_or_fail("neither `docker compose` nor `docker-compose` is installed (Debian: docker-compose)")
    spec = COMPOSE_YAML.read_text()
    upstream = dict(re.findall(r"^  (prometheus|otel-collector):\n    image: (\S+)$", spec, re.MULTILINE))
    env = {**os.environ, "MPCACHE_IMAGE": image}
    files = ["-f", str(COMPOSE_YAML)]
    stand_ins = []
    for service, upstream_image in upstream.items():
        if docker("image", "inspect", upstream_image, check=False).returncode == 0 or \
                docker("pull", "-q", upstream_image, check=False, timeout=120).returncode == 0:
            continue
        local = f"mpcache-test-{service}:{TAG}"
        dockerfile = HERE / ("Dockerfile.prometheus" if service == "prometheus" else "Dockerfile.otlp-standin")
        docker("build", "-q", "-f", str(dockerfile), "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
               "--build-arg", f"MPCACHE_IMAGE={image}", "-t", local, str(HERE), timeout=900)
        env["MPCACHE_TEST_PROMETHEUS_IMAGE" if service == "prometheus" else "MPCACHE_TEST_COLLECTOR_IMAGE"] = local
        stand_ins.append(f"{service}: {upstream_image} cannot be pulled, {local} stands in")
    if stand_ins:
        files += ["-f", str(HERE / "compose.local-images.yaml")]
        env.setdefault("MPCACHE_TEST_PROMETHEUS_IMAGE", upstream["prometheus"])
        env.setdefault("MPCACHE_TEST_COLLECTOR_IMAGE", upstream["otel-collector"])
        print("compose test:", "; ".join(stand_ins))
    run = compose_runner([*compose, *files, "-p", names.replace("_", "-").lower()], env)
    try:
        up_on_free_ports(run, env)
        mpcache = run("ps", "-q", "mpcache").stdout.strip()
        assert "healthy" == wait_for(lambda: (state := health(mpcache)) != "starting" and state, 90,
                                     "mpcache's first health check")
        base = f"http://127.0.0.1:{env['MPCACHE_METRICS_PORT']}"
        assert 200 == get(base + "/ready")[0]

        def target_up() -> bool:
            status, body = get(f"http://127.0.0.1:{env['MPCACHE_PROMETHEUS_UI_PORT']}/api/v1/targets")
            targets = json.loads(body)["data"]["activeTargets"] if status == 200 else []
            return any(t["labels"].get("job") == "mpcache" and t["health"] == "up" for t in targets)
        wait_for(target_up, 120, "Prometheus's mpcache target to be up")

        def pushed() -> bool:
            status, body = get(f"http://127.0.0.1:{env['MPCACHE_COLLECTOR_PORT']}/metrics")
            # the stand-in counts what it received; the real collector re-exports mpcache's series
            return status == 200 and bool(re.search(r"^otlp_metric_points_received_total [1-9]", body, re.M)
                                          or re.search(r"^mpcache_cache_processes_ready", body, re.M))
        wait_for(pushed, 60, "mpcache's OTLP push to reach the collector")

        engine = run("--profile", "engine-example", "run", "--rm", "-T", "engine-example", "10", timeout=300)
        report = json.loads(engine.stdout.strip().splitlines()[-1])
        assert [10, 10] == [result["verified"] for result in report["results"]], report
        run("stop", "-t", "45", "mpcache", timeout=120)
        assert "0" == docker("inspect", "-f", "{{.State.ExitCode}}", mpcache).stdout.strip()
    finally:
        run("--profile", "engine-example", "down", "-v", "--remove-orphans", check=False, timeout=300)
        for variable in ("MPCACHE_TEST_PROMETHEUS_IMAGE", "MPCACHE_TEST_COLLECTOR_IMAGE"):
            if env.get(variable, "").startswith("mpcache-test-"):
                docker("rmi", "-f", env[variable], check=False)
