"""deploy/ checked against a live daemon and the tools that read its files: every YAML and the
Grafana dashboard parse; every metric name the alerts, the dashboard and the autoscalers use
is on a live daemon's /metrics; the probe paths answer there; ports and the image name agree
with the Dockerfile; `promtool` accepts the alert rules and the Prometheus config;
`systemd-analyze` verifies the unit. tests/python/test_deploy.py checks the rest without a
daemon (schemas, names, flags and variables, grace periods, the model loader)."""
import glob
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import HTTP_TIMEOUT, Daemon, TINY_MODEL, repo_path

DEPLOY = repo_path("deploy")
BIN = os.environ.get("ARSERVE_BIN") or repo_path("build/arserve")


def read(path):
    with open(os.path.join(DEPLOY, path)) as f:
        return f.read()


def yaml_files():
    return sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yml"), recursive=True) +
                  glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True))


def load(path):
    return [d for d in yaml.safe_load_all(read(path)) if d is not None]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A daemon's /metrics types and the routes it answers."""
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), TINY_MODEL, ["--threads", "1"])
    r = d.client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 1},
                      timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    text = d.client.get("/metrics").text
    codes = {p: d.client.get(p).status_code for p in ("/health", "/ready", "/metrics")}
    d.finish()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    return {"types": types, "codes": codes}


def test_every_yaml_and_the_dashboard_parse():
    files = yaml_files()
    assert len(files) >= 10, files
    for path in files:
        docs = load(os.path.relpath(path, DEPLOY))
        assert docs, f"{path} holds no document"
    dash = json.loads(read("compose/grafana/dashboards/arserve.json"))
    titles = {p["title"] for p in dash["panels"]}
    for want in ("Instances up", "Requests by status", "End-to-end latency", "Queue wait",
                 "Running and waiting requests", "KV pool", "KV policy mix", "Images per second",
                 "Iteration time", "Admissions refused by reason"):
        assert want in titles, (want, titles)


def test_metric_names_exist_on_a_live_daemon(live):
    types = live["types"]
    texts = [read("compose/alerts.yml"), read("compose/grafana/dashboards/arserve.json"),
             read("k8s/keda-scaledobject.yaml"), read("k8s/hpa.yaml")]
    used = set()
    for t in texts:
        used |= set(re.findall(r"\barserve_[a-z0-9_]+", t))
    assert len(used) >= 10, used
    for name in sorted(used):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", (name, sorted(types))
    # Every query's label values are ones the daemon writes.
    for reason in re.findall(r'reason="([a-z_]+)"', "".join(texts)):
        assert reason in ("queue_full", "too_large", "draining", "invalid_policy"), reason


def test_probe_paths_ports_and_image(live):
    dep = load("k8s/deployment.yaml")[0]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == {"/health", "/ready"}, paths
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    for p in paths:
        assert live["codes"][p] == 200, (p, live["codes"])
    dockerfile = open(repo_path("Dockerfile")).read()
    exposed = int(re.search(r"^EXPOSE (\d+)$", dockerfile, re.M).group(1))
    assert c["ports"][0]["containerPort"] == exposed
    assert "--port" in c["args"] and c["args"][c["args"].index("--port") + 1] == str(exposed)
    compose = load("compose/docker-compose.yml")[0]["services"]
    assert compose["arserve"]["ports"] == [f"{exposed}:{exposed}"]
    assert c["image"] == compose["arserve"]["image"] == "arserve:latest"
    assert "docker build -t arserve:latest" in read("compose/docker-compose.yml")
    prom = load("compose/prometheus.yml")[0]
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == [f"arserve:{exposed}"]
    assert prom["scrape_configs"][0]["metrics_path"] == "/metrics" and live["codes"]["/metrics"] == 200
    sec = c["securityContext"]
    assert sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])


def need(tool):
    path = shutil.which(tool)
    assert path, f"{tool} is not installed (make deps installs it)"
    return path


def test_promtool_accepts_the_rules_and_the_config(tmp_path):
    promtool = need("promtool")
    p = subprocess.run([promtool, "check", "rules", os.path.join(DEPLOY, "compose/alerts.yml")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "5 rules found" in p.stdout, p.stdout
    # The config names the rules where the container mounts them: point it here.
    cfg = read("compose/prometheus.yml").replace("/etc/prometheus/alerts.yml",
                                                 os.path.join(DEPLOY, "compose/alerts.yml"))
    (tmp_path / "prometheus.yml").write_text(cfg)
    p = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_systemd_analyze_verifies_the_unit(tmp_path):
    analyze = need("systemd-analyze")
    unit = read("systemd/arserve.service").replace("/usr/local/bin/arserve", os.path.abspath(BIN))
    (tmp_path / "arserve.service").write_text(unit)
    p = subprocess.run([analyze, "verify", str(tmp_path / "arserve.service")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                   "CapabilityBoundingSet=", "SystemCallFilter=@system-service"):
        assert re.search("^" + re.escape(option) + "$", unit, re.M), option
