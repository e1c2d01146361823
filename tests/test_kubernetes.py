"""deploy/kubernetes against the Kubernetes API's own schemas, offline (kubernetes-validate bundles them), and
against mpcache and vLLM: each ConfigMap's settings are flags start-cache has and fit the /dev/shm and the
memory limits beside them (by start-cache's own arithmetic), every sum the comments state is that arithmetic's,
vLLM's connector names exactly the endpoints its mpcache serves and runs as a uid mpcache admits, ports agree
across containers, probes and PodMonitors, GPU pods tolerate GPU nodes' taint, the secret is a file of the
service's own.  vLLM's own parser reads the vLLM command lines where a vLLM venv is at hand."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.image_env import image_environment
from support.vllm_args import parse_with_vllm

from mpcache.config import parse_size
from mpcache.supervisor import settings
from mpcache.supervisor.provision import SHM_MARGIN_BYTES, segment_sizes

REPO = Path(__file__).resolve().parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
# The oldest release the manifests are meant for (native sidecars are on by default from 1.29) and the
# newest schema kubernetes-validate bundles.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}  # no schema in kubernetes-validate: checked below
MIB = 2**20
# vLLM's own /dev/shm: what vLLM's Kubernetes guide (docs/deployment/k8s.md) gives it, a 2Gi memory emptyDir.
VLLM_SHM = 2048 * MIB
# Bytes beyond its segments that mpcache's memory limit leaves its processes.
CACHE_PROCESS_BYTES = 256 * MIB
GPU = "nvidia.com/gpu"


def documents() -> list[dict]:
    docs = [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    return [doc for doc in docs if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def workloads() -> list[dict]:
    return by_kind("DaemonSet") + by_kind("Deployment")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    pod = pod_spec(workload)
    return pod.get("initContainers", []) + pod["containers"]


def mpcache_container(workload: dict) -> dict | None:
    found = [c for c in containers(workload) if c["name"] == "mpcache"]
    return found[0] if found else None


def vllm_containers(workload: dict) -> list[dict]:
    return [c for c in pod_spec(workload)["containers"] if c["name"] == "vllm"]


def mpcache_workloads() -> list[dict]:
    return [w for w in workloads() if mpcache_container(w)]


def vllm_workloads() -> list[dict]:
    return [w for w in workloads() if vllm_containers(w)]


def name(workload: dict) -> str:
    return workload["metadata"]["name"]


def quantity(text: str) -> int:
    return parse_size(text.replace("Mi", "MiB").replace("Gi", "GiB"), "quantity")


def configmap_named(config_name: str) -> dict:
    [configmap] = [c for c in by_kind("ConfigMap") if c["metadata"]["name"] == config_name]
    return configmap


def mpcache_settings(workload: dict, tmp_path: Path) -> settings.Resolved:
    """The settings the workload's mpcache container starts with: its ConfigMap (MPCACHE_CONFIG), its
    MPCACHE_* environment over the image's, its arguments, parsed by start-cache's own parser (which refuses
    an unknown key, variable or flag)."""
    container = mpcache_container(workload)
    assert container is not None
    env = {item["name"]: item.get("value", "from-field") for item in container.get("env", [])}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
    config = Path(env["MPCACHE_CONFIG"])
    configmap = configmap_named(volumes[mounts[str(config.parent)]]["configMap"]["name"])
    path = tmp_path / f"{name(workload)}.toml"
    path.write_text(configmap["data"][config.name])
    environ = {**image_environment(), **env, "MPCACHE_CONFIG": str(path)}
    return settings.parse(container.get("args", []), environ=environ)


def shm_needed(resolved: settings.Resolved) -> int:
    """Bytes start-cache's preflight wants in /dev/shm for these settings (its own arithmetic)."""
    config = settings.config_from_settings(resolved, 1, "/run/mpcache/service")
    page = 4096
    return sum(-(-size // page) * page for size in segment_sizes(config).values()) + SHM_MARGIN_BYTES


def kv_transfer_config(container: dict) -> dict:
    args = container["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def vllm_flag(container: dict, flag: str, default: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else default


def uid(workload: dict, container: dict) -> int:
    return {**pod_spec(workload).get("securityContext", {}), **container.get("securityContext", {})}["runAsUser"]


def mpcache_for(workload: dict) -> dict:
    """The workload whose mpcache serves this vLLM workload: its own pod's, else the hostIPC DaemonSet's."""
    if mpcache_container(workload):
        return workload
    [daemonset] = [d for d in by_kind("DaemonSet") if pod_spec(d).get("hostIPC")]
    return daemonset


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    docs = documents()
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in docs}
    assert {("v1", "ConfigMap"), ("v1", "Secret"), ("apps/v1", "DaemonSet"), ("apps/v1", "Deployment"),
            ("monitoring.coreos.com/v1", "PodMonitor")} == kinds
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRDS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any unknown or bad field


def test_a_bad_manifest_is_refused():
    """The validator is not a no-op: a probe on a misspelt field fails."""
    daemonset = by_kind("DaemonSet")[0]
    pod_spec(daemonset)["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_the_shapes_are_there():
    """Engines of mpcache's own client per node; vLLM with a sidecar; vLLM pods sharing a hostIPC DaemonSet."""
    shapes = {(w["kind"], name(w), bool(mpcache_container(w)), len(vllm_containers(w)),
               bool(pod_spec(w).get("hostIPC"))) for w in workloads()}
    assert {("DaemonSet", "mpcache", True, 0, False), ("Deployment", "vllm", True, 1, False),
            ("DaemonSet", "mpcache-node", True, 0, True), ("Deployment", "vllm-node-cache", False, 1, True)} == shapes


@pytest.mark.parametrize("workload", mpcache_workloads(), ids=name)
def test_mpcache_settings_are_flags_start_cache_has(workload, tmp_path):
    """Every key of the ConfigMap, MPCACHE_* variable and argument is a flag of `start-cache --help`."""
    help_text = settings.build_parser(environ={}).format_help()
    container = mpcache_container(workload)
    resolved = mpcache_settings(workload, tmp_path)  # start-cache's parser: exits 2 on an unknown one
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config_volume = {v["name"]: v for v in pod_spec(workload)["volumes"]}[mounts["/etc/mpcache"]]
    toml_text = configmap_named(config_volume["configMap"]["name"])["data"]["mpcache.toml"]
    keys = re.findall(r"^([a-z0-9-]+) *=", toml_text, re.MULTILINE)
    variables = [item["name"] for item in container["env"] if item["name"].startswith("MPCACHE_")]
    flags = [f"--{key}" for key in keys] + [f"--{v[len('MPCACHE_'):].lower().replace('_', '-')}" for v in variables]
    flags += [word for word in container.get("args", []) if word.startswith("--")]
    assert ([], True) == ([flag for flag in flags if not re.search(rf"\[{flag}[ \]]", help_text)],
                          resolved.values["workers"] >= 1)


def test_the_flag_check_sees_a_flag_start_cache_lacks(tmp_path):
    """The check above is not a no-op: a ConfigMap key start-cache does not have stops the parse."""
    [sidecar] = [w for w in workloads() if name(w) == "vllm"]
    configmap = configmap_named("mpcache-vllm-sidecar")
    configmap["data"]["mpcache.toml"] += "lmcache-allow-uids = [0]\n"
    path = tmp_path / "bad.toml"
    path.write_text(configmap["data"]["mpcache.toml"])
    with pytest.raises(SystemExit):
        settings.parse([], environ={**image_environment(), "MPCACHE_CONFIG": str(path)})
    assert "--lmcache-allow-uid " in settings.build_parser(environ={}).format_help() and mpcache_container(sidecar)


def test_every_sum_a_configmap_states_is_start_caches_own(tmp_path):
    """configmap.yaml's comment above each ConfigMap states its /dev/shm need as `= N MiB`: N is what
    start-cache's preflight computes for those settings (rounded up to a MiB)."""
    text = (KUBERNETES / "configmap.yaml").read_text()
    stated, computed = {}, {}
    for part in text.split("\n---\n"):
        doc = yaml.safe_load(part)
        path = tmp_path / f"{doc['metadata']['name']}.toml"
        path.write_text(doc["data"]["mpcache.toml"])
        resolved = settings.parse([], environ={**image_environment(), "MPCACHE_CONFIG": str(path)})
        stated[doc["metadata"]["name"]] = [int(n) for n in re.findall(r"= (\d+) MiB", part)]
        computed[doc["metadata"]["name"]] = [math.ceil(shm_needed(resolved) / MIB)]
    assert computed == stated


@pytest.mark.parametrize("workload", mpcache_workloads(), ids=name)
def test_dev_shm_holds_mpcache_and_its_engines_and_the_limits_hold_their_pages(workload, tmp_path):
    """A pod of its own IPC namespace: /dev/shm is a memory emptyDir, mounted by mpcache and by every vLLM
    container, that holds mpcache's segments plus vLLM's 2Gi each.  A hostIPC pod: no emptyDir on /dev/shm
    (its segments go to the node's).  Either way mpcache's memory limit holds its segments (allocated when it
    starts, so charged to it) plus its processes, and the file states the need it was sized for."""
    need = shm_needed(mpcache_settings(workload, tmp_path))
    pod = pod_spec(workload)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mpcache = mpcache_container(workload)
    shm_mounts = {c["name"]: m["name"] for c in containers(workload) for m in c.get("volumeMounts", [])
                  if m["mountPath"] == "/dev/shm"}
    engines = [c["name"] for c in vllm_containers(workload)]
    limit = quantity(mpcache["resources"]["limits"]["memory"])
    assert limit >= need + CACHE_PROCESS_BYTES
    if pod.get("hostIPC"):
        assert {} == shm_mounts
    else:
        [dshm] = set(shm_mounts.values())
        empty_dir = volumes[dshm]["emptyDir"]
        room = quantity(empty_dir["sizeLimit"]) - len(engines) * VLLM_SHM
        assert ({"mpcache", *engines}, "Memory", True) == (set(shm_mounts), empty_dir.get("medium"), room >= need)
    [text] = [path.read_text() for path in KUBERNETES.glob("*.yaml")
              if f"kind: {workload['kind']}\nmetadata:\n  name: {name(workload)}\n" in path.read_text()]
    assert f"{math.ceil(need / MIB)} MiB" in text


@pytest.mark.parametrize("workload", vllm_workloads(), ids=name)
def test_vllm_memory_limit_holds_its_dev_shm(workload):
    for container in vllm_containers(workload):
        assert quantity(container["resources"]["limits"]["memory"]) >= VLLM_SHM + 4096 * MIB


@pytest.mark.parametrize("workload", vllm_workloads(), ids=name)
def test_vllm_connector_names_exactly_the_endpoints_its_mpcache_serves(workload, tmp_path):
    """LMCacheMPConnector, engine_driven, one server URL per cache process: tcp://<lmcache-host>:<port + i>
    on the pod's loopback for a sidecar, ipc://<runtime dir>/lmcache<i>.ipc through the same host directory
    for the DaemonSet; a world size that is a multiple of the number of servers."""
    server = mpcache_for(workload)
    values = mpcache_settings(server, tmp_path).values
    runtime_dir = image_environment()["MPCACHE_RUNTIME_DIR"]
    if server is workload:
        assert (values["lmcache-host"], values["lmcache-ipc"]) == ("127.0.0.1", False)
        expected = [f"tcp://127.0.0.1:{values['lmcache-port'] + i}" for i in range(values["workers"])]
    else:
        def host_dir(pod: dict, container: dict) -> tuple[str, str]:
            volumes = {v["name"]: v for v in pod["volumes"]}
            [mount] = [m for m in container["volumeMounts"] if runtime_dir.startswith(m["mountPath"] + "/")]
            return volumes[mount["name"]]["hostPath"]["path"], mount["mountPath"]
        assert (values["lmcache-port"], values["lmcache-ipc"]) == (0, True)
        for container in vllm_containers(workload):
            assert host_dir(pod_spec(server), mpcache_container(server)) == host_dir(pod_spec(workload), container)
        expected = [f"ipc://{runtime_dir}/lmcache{i}.ipc" for i in range(values["workers"])]
    for container in vllm_containers(workload):
        config = kv_transfer_config(container)
        extra = config["kv_connector_extra_config"]
        world = int(vllm_flag(container, "--tensor-parallel-size", "1")) * int(
            vllm_flag(container, "--pipeline-parallel-size", "1"))
        assert ("LMCacheMPConnector", "kv_both", expected, "engine_driven", 0) == (
            config["kv_connector"], config["kv_role"], extra["lmcache.mp.server_urls"],
            extra["lmcache.mp.mp_transfer_mode"], world % len(expected))


@pytest.mark.parametrize("workload", vllm_workloads(), ids=name)
def test_vllm_runs_as_a_uid_mpcache_admits_and_can_map_the_pool(workload, tmp_path):
    """vLLM runs as root, as its images do: mpcache admits uid 0 (lmcache-allow-uid) and root keeps the
    capability that opens mpcache's 0600 pool (CAP_DAC_OVERRIDE, the runtime's default).  A hostIPC engine
    pod shares the node's IPC namespace with the DaemonSet; a sidecar pod shares /dev/shm inside the pod."""
    server = mpcache_for(workload)
    values = mpcache_settings(server, tmp_path).values
    mpcache_uid = uid(server, mpcache_container(server))
    for container in vllm_containers(workload):
        engine_uid = uid(workload, container)
        capabilities = container.get("securityContext", {}).get("capabilities", {})
        keeps_dac_override = "ALL" not in capabilities.get("drop", []) or "DAC_OVERRIDE" in capabilities.get("add", [])
        assert (0, True, True, False) == (engine_uid, engine_uid in values["lmcache-allow-uid"] + [mpcache_uid],
                                          keeps_dac_override, engine_uid == mpcache_uid)
    assert bool(pod_spec(workload).get("hostIPC")) == bool(pod_spec(server).get("hostIPC")) == (server is not workload)
    assert 10001 == mpcache_uid


@pytest.mark.parametrize("workload", vllm_workloads(), ids=name)
def test_vllm_ports_agree_with_its_probes_and_the_podmonitor(workload):
    [monitor] = [m for m in by_kind("PodMonitor") if m["metadata"]["name"] == "vllm"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    for container in vllm_containers(workload):
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        probes = [container[probe]["httpGet"] for probe in ("startupProbe", "livenessProbe", "readinessProbe")]
        assert (int(vllm_flag(container, "--port", "8000")), [("/health", "http")] * 3, True) == (
            ports["http"], [(probe["path"], probe["port"]) for probe in probes],
            endpoint["port"] in ports and monitor["spec"]["selector"]["matchLabels"].items() <= labels.items())


@pytest.mark.parametrize("workload", mpcache_workloads(), ids=name)
def test_mpcache_probes_settings_secret_and_user(workload, tmp_path):
    """Readiness on /ready, liveness on /healthz, on the port the PodMonitor scrapes and the settings serve;
    the settings from a ConfigMap (MPCACHE_CONFIG) and the L2 key from a private copy of the Secret; uid
    10001, non-root."""
    pod = pod_spec(workload)
    container = mpcache_container(workload)
    env = {item["name"]: item.get("value") for item in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    [port] = container["ports"]
    assert (("/ready", port["name"]), ("/healthz", port["name"]), mpcache_settings(workload, tmp_path).values[
        "prometheus-port"]) == (tuple(container["readinessProbe"]["httpGet"].values()),
                                tuple(container["livenessProbe"]["httpGet"].values()), port["containerPort"])
    assert "configMap" in volumes[mounts[str(Path(env["MPCACHE_CONFIG"]).parent)]]
    secret_dir = str(Path(env["MPCACHE_L2_SECRET_FILE"]).parent)
    assert "emptyDir" in volumes[mounts[secret_dir]]  # the copy: a Secret volume's files are root's symlinks
    [copier] = [c for c in pod["initContainers"] if c["name"] == "l2-secret"]
    assert (["install", "-m", "0600"], env["MPCACHE_L2_SECRET_FILE"]) == (copier["command"][:3], copier["command"][-1])
    user = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert (10001, True, False) == (user["runAsUser"], user["runAsNonRoot"], container["securityContext"][
        "allowPrivilegeEscalation"])


def test_podmonitor_selects_every_mpcache_pod_on_its_metrics_port():
    [monitor] = [m for m in by_kind("PodMonitor") if m["metadata"]["name"] == "mpcache"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        container = mpcache_container(workload)
        assert (selector.items() <= labels.items()) == bool(container)
        assert container is None or endpoint["port"] == container["ports"][0]["name"]
    assert ("/metrics", [{"targetLabel": "job", "replacement": "mpcache"}]) == (
        endpoint["path"], endpoint["relabelings"])


@pytest.mark.parametrize("workload", vllm_workloads() + [d for d in by_kind("DaemonSet") if pod_spec(d).get("hostIPC")],
                         ids=name)
def test_gpu_pods_ask_for_gpus_and_tolerate_gpu_nodes(workload):
    """Each vLLM container asks for one GPU per tensor-parallel rank; GPU pods (and the DaemonSet that must
    run beside them) tolerate the nvidia.com/gpu taint; the DaemonSet and its engines select the same nodes."""
    pod = pod_spec(workload)
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for container in vllm_containers(workload):
        gpus = int(vllm_flag(container, "--tensor-parallel-size", "1")) * int(
            vllm_flag(container, "--pipeline-parallel-size", "1"))
        resources = container["resources"]
        assert (str(gpus), str(gpus)) == (resources["requests"][GPU], resources["limits"][GPU])
    if pod.get("hostIPC"):
        assert pod_spec(mpcache_for(workload))["nodeSelector"] == pod["nodeSelector"]


def test_the_shipped_secret_is_refused_by_start_cache(tmp_path):
    """secret.yaml's empty key must never run: start-cache refuses a key under 32 bytes."""
    from mpcache.cache.l2.trust import read_private_file
    from mpcache.errors import ConfigError

    [secret] = by_kind("Secret")
    path = tmp_path / "l2-secret"
    path.write_text(secret["stringData"]["l2-secret"])
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 32"):
        read_private_file(str(path), "--l2-secret-file")


@pytest.mark.slow
def test_vllms_own_parser_reads_every_vllm_command_line():
    """vLLM 0.32's `serve` parser accepts every vLLM container's arguments and resolves them to what the
    checks above read from them (port, parallel sizes, the connector config); it refuses a misspelt flag."""
    commands = [c for w in vllm_workloads() for c in vllm_containers(w)]
    assert all(c["command"] == ["vllm", "serve"] for c in commands)
    parsed = parse_with_vllm([c["args"] for c in commands] + [[*commands[0]["args"], "--tensor-paralel-size", "2"]])
    expected = [{"port": int(vllm_flag(c, "--port", "8000")),
                 "tensor_parallel_size": int(vllm_flag(c, "--tensor-parallel-size", "1")),
                 "pipeline_parallel_size": int(vllm_flag(c, "--pipeline-parallel-size", "1")),
                 "kv_transfer_config": kv_transfer_config(c)} for c in commands]
    assert expected == [{key: p.get(key) for key in expected[0]} for p in parsed[:-1]]
    assert "unrecognized arguments: --tensor-paralel-size 2" in parsed[-1]["error"]


def test_operations_states_the_sizes_the_vllm_shapes_have(tmp_path):
    """deploy/OPERATIONS.md's choice between the vLLM shapes states each one's mpcache need and /dev/shm as
    the manifests have them."""
    text = (REPO / "deploy" / "OPERATIONS.md").read_text()
    section = text[text.index("## Next to vLLM"):text.index("## Collecting metrics")]
    stated = []
    for workload in vllm_workloads():
        server = mpcache_for(workload)
        stated.append(f"{math.ceil(shm_needed(mpcache_settings(server, tmp_path)) / MIB)} MiB")
        volumes = {volume["name"]: volume for volume in pod_spec(server)["volumes"]}
        stated += [volumes[m["name"]]["emptyDir"]["sizeLimit"] for m in mpcache_container(server)["volumeMounts"]
                   if m["mountPath"] == "/dev/shm"]
    assert (len(stated) == 3, [size for size in stated if size not in section]) == (True, [])
