"""deploy/kubernetes against the Kubernetes API's own schemas, offline (kubernetes-validate bundles them), and
against mpcache: the settings of the ConfigMap fit the /dev/shm emptyDir and the memory limit, the probes
ask /ready and /healthz on the published port, the PodMonitor finds the pods, the secret is a file of the
service's own."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from mpcache.config import parse_size
from mpcache.supervisor import settings
from mpcache.supervisor.provision import SHM_MARGIN_BYTES, segment_sizes

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# The oldest release the manifests are meant for (native sidecars are on by default from 1.29) and the
# newest schema kubernetes-validate bundles.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}  # no schema in kubernetes-validate: checked below
MIB = 2**20


def documents() -> list[dict]:
    docs = [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    return [doc for doc in docs if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def workloads() -> list[dict]:
    return by_kind("DaemonSet") + by_kind("Deployment")


def mpcache_container(workload: dict) -> dict:
    pod = workload["spec"]["template"]["spec"]
    [container] = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "mpcache"]
    return container


def quantity(text: str) -> int:
    return parse_size(text.replace("Mi", "MiB").replace("Gi", "GiB"), "quantity")


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
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def shm_needed(tmp_path: Path) -> int:
    """Bytes start-cache's preflight wants in /dev/shm for the ConfigMap's settings (its own arithmetic)."""
    [configmap] = by_kind("ConfigMap")
    (tmp_path / "mpcache.toml").write_text(configmap["data"]["mpcache.toml"])
    resolved = settings.parse(["--config", str(tmp_path / "mpcache.toml")], environ={})
    config = settings.config_from_settings(resolved, 1, "/run/mpcache/service")
    page = 4096
    return sum(-(-size // page) * page for size in segment_sizes(config).values()) + SHM_MARGIN_BYTES


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["kind"])
def test_dev_shm_is_a_memory_emptydir_that_holds_the_configured_l1_and_fits_the_memory_limit(workload, tmp_path):
    pod = workload["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    container = mpcache_container(workload)
    [dshm] = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    empty_dir = volumes[dshm]["emptyDir"]
    size = quantity(empty_dir["sizeLimit"])
    limit = quantity(container["resources"]["limits"]["memory"])
    assert ("Memory", True, True) == (empty_dir.get("medium"), size >= shm_needed(tmp_path) > 1024 * MIB,
                                      limit >= size + 256 * MIB)


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["kind"])
def test_probes_settings_secret_and_user(workload):
    """Readiness on /ready, liveness on /healthz, on the port the PodMonitor scrapes; the settings from the
    ConfigMap (MPCACHE_CONFIG) and the L2 key from a private copy of the Secret; uid 10001, non-root."""
    pod = workload["spec"]["template"]["spec"]
    container = mpcache_container(workload)
    env = {item["name"]: item.get("value") for item in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    [port] = container["ports"]
    assert (("/ready", port["name"]), ("/healthz", port["name"]), 9090) == (
        tuple(container["readinessProbe"]["httpGet"].values()), tuple(container["livenessProbe"]["httpGet"].values()),
        port["containerPort"])
    assert "mpcache-config" == volumes[mounts[str(Path(env["MPCACHE_CONFIG"]).parent)]]["configMap"]["name"]
    secret_dir = str(Path(env["MPCACHE_L2_SECRET_FILE"]).parent)
    assert "emptyDir" in volumes[mounts[secret_dir]]  # the copy: a Secret volume's files are root's symlinks
    [copier] = [c for c in pod["initContainers"] if c["name"] == "l2-secret"]
    assert (["install", "-m", "0600"], env["MPCACHE_L2_SECRET_FILE"]) == (copier["command"][:3], copier["command"][-1])
    user = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert (10001, True, False) == (user["runAsUser"], user["runAsNonRoot"], container["securityContext"][
        "allowPrivilegeEscalation"])


def test_podmonitor_selects_both_shapes_on_their_metrics_port():
    [monitor] = by_kind("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert endpoint["port"] == mpcache_container(workload)["ports"][0]["name"]
    assert ("/metrics", [{"targetLabel": "job", "replacement": "mpcache"}]) == (
        endpoint["path"], endpoint["relabelings"])


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
