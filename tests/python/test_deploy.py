"""deploy/ checked without a cluster or Docker: every Kubernetes manifest against the API's
schemas (kubernetes-validate, offline) and the KEDA ScaledObject against a schema of the fields
it uses; the names that tie the manifests together; ports, probe paths, flags and ARSERVE_*
variables against the daemon; the grace periods against the drain; the files compose mounts;
the docker and kubectl lines of deploy/README.md against the Dockerfile and the manifests; and
the model loader's script (model-loader-job.yaml) run on the shipped models, good and broken.
tests/integration/test_deploy.py checks the rest against a live daemon."""
import functools
import glob
import hashlib
import http.server
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import tarfile
import threading

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
BIN = os.path.abspath(os.environ.get("ARSERVE_BIN") or os.path.join(ROOT, "build", "arserve"))

# The oldest Kubernetes the manifests are written for (the preStop sleep action is on by
# default from 1.30) and the newest whose schemas kubernetes-validate bundles.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

# The routes the daemon answers probes and scrapes on (server/http.c).
PROBE_PATHS = {"/health", "/ready", "/metrics"}


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def load(path):
    return [d for d in yaml.safe_load_all(read(path)) if d is not None]


def k8s_files():
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(K8S, "*.y*ml")))


def manifest(kind):
    """The one manifest of this kind under deploy/k8s."""
    found = [d for f in k8s_files() for d in load(f) if d.get("kind") == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def pod_spec(kind):
    return manifest(kind)["spec"]["template"]["spec"]


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@functools.lru_cache(maxsize=None)
def serve_help():
    assert os.access(BIN, os.X_OK), f"{BIN} is not built (make)"
    p = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True,
                       timeout=scaled(30))
    assert p.returncode == 0 and "env ARSERVE_MODEL" in p.stdout, p.stdout + p.stderr
    return p.stdout


def accepted_variables():
    """Every ARSERVE_* variable `arserve serve --help` names: the settings (`env NAME`) and
    ARSERVE_API_KEY, which server/config.c reads beside them."""
    return set(re.findall(r"\bARSERVE_[A-Z0-9_]+\b", serve_help()))


# KEDA's ScaledObject (keda.sh/v1alpha1) is a custom resource, so kubernetes-validate has no
# schema for it: this one holds the fields of KEDA's CRD (config/crd/bases/
# keda.sh_scaledobjects.yaml) with their types, rejects any other (a misspelt field is
# otherwise ignored by the API server and the autoscaler silently does something else), and
# asks a prometheus trigger for what KEDA's scaler needs.
INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
KEDA_SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string",
                                    "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {k: {"type": "string"} for k in
                                   ("name", "kind", "apiVersion", "envSourceContainerName")},
                },
                **{k: INT32 for k in ("pollingInterval", "cooldownPeriod",
                                      "initialCooldownPeriod", "idleReplicaCount",
                                      "minReplicaCount", "maxReplicaCount")},
                "advanced": {"type": "object"},
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "useCachedMetrics": {"type": "boolean"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                            "metadata": {"type": "object",
                                         "additionalProperties": {"type": "string"}},
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": {
                            "required": ["serverAddress", "query", "threshold"],
                            "properties": {
                                "serverAddress": {"pattern": "^https?://[^/]+"},
                                "threshold": {"pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                "activationThreshold": {"pattern": r"^[0-9]+(\.[0-9]+)?$"},
                            },
                        }}},
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("path", k8s_files())
def test_each_kubernetes_manifest_validates(path):
    docs = load(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        if doc.get("apiVersion", "").startswith("keda.sh/"):
            jsonschema.validate(doc, KEDA_SCALED_OBJECT)
            continue
        for version in K8S_VERSIONS:
            # strict: a field the API does not have is an error, not ignored.
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_kind_deploy_needs_is_there():
    kinds = {d["kind"] for f in k8s_files() for d in load(f)}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                     "ScaledObject", "PersistentVolumeClaim", "Job"}, kinds


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_the_manifests_name_each_other():
    dep, pvc, job = manifest("Deployment"), manifest("PersistentVolumeClaim"), manifest("Job")
    name = dep["metadata"]["name"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels)

    # The claim: the Deployment reads it where ARSERVE_MODEL points, the Job fills it where
    # MODEL_DIR points, as the same user, with the same image's arserve.
    claims = {}
    for kind, env_name in (("Deployment", "ARSERVE_MODEL"), ("Job", "MODEL_DIR")):
        spec = pod_spec(kind)
        vol = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
        claims[kind] = vol["persistentVolumeClaim"]["claimName"]
        (c,) = spec["containers"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
        assert env_of(c)[env_name] == mount["mountPath"], (kind, env_name, mount)
        assert mount.get("readOnly", False) == (kind == "Deployment"), (kind, mount)
    assert claims == {"Deployment": pvc["metadata"]["name"], "Job": pvc["metadata"]["name"]}
    assert pvc["spec"]["accessModes"][0] in ("ReadWriteOnce", "ReadWriteMany")
    dep_spec, job_spec = pod_spec("Deployment"), pod_spec("Job")
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        assert dep_spec["securityContext"][key] == job_spec["securityContext"][key], key
    assert dep_spec["containers"][0]["image"] == job_spec["containers"][0]["image"]
    assert job_spec["restartPolicy"] == "Never"

    # The Service and the PDB pick the Deployment's pods, and not the loader's.
    svc, pdb = manifest("Service"), manifest("PodDisruptionBudget")
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    for selector in (svc["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert selects(selector, pod_labels), (selector, pod_labels)
        assert not selects(selector, job_labels), (selector, job_labels)
    port_names = {p["name"] for p in dep_spec["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    # A node drain can evict one replica and keep the PDB.
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]

    # The autoscalers scale this Deployment.
    hpa, keda = manifest("HorizontalPodAutoscaler"), manifest("ScaledObject")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": name}
    ref = keda["spec"]["scaleTargetRef"]
    assert ref["name"] == name and ref.get("kind", "Deployment") == "Deployment", ref
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert keda["spec"]["minReplicaCount"] <= keda["spec"]["maxReplicaCount"]


def test_ports_and_probe_paths_are_the_daemons():
    # The routes server/http.c answers.
    known = re.search(r"KNOWN_ROUTES\[\] = \{([^}]*)\}", read("server/http.c"))
    assert known, "server/http.c's KNOWN_ROUTES"
    routes = set(re.findall(r'"(/[^"]*)"', known.group(1)))
    assert PROBE_PATHS <= routes, routes

    spec = pod_spec("Deployment")
    (c,) = spec["containers"]
    args = c["args"]
    port = int(args[args.index("--port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert [p["containerPort"] for p in c["ports"]] == [port]
    http_port = c["ports"][0]["name"]
    probes = {p: c[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p: g["path"] for p, g in probes.items()} == {
        "startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    assert {g["port"] for g in probes.values()} == {http_port}
    notes = manifest("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/port"] == str(port) and notes["prometheus.io/path"] == "/metrics"

    dockerfile = read("Dockerfile")
    assert re.search(r"^EXPOSE (\d+)$", dockerfile, re.M).group(1) == str(port)
    assert re.search(r"^CMD .*\"--port\", \"(\d+)\"", dockerfile, re.M).group(1) == str(port)
    assert f"http://127.0.0.1:{port}/health" in dockerfile
    compose = load("deploy/compose/docker-compose.yml")[0]["services"]
    assert compose["arserve"]["ports"] == [f"{port}:{port}"]
    cmd = compose["arserve"]["command"]
    assert cmd[cmd.index("--port") + 1] == str(port)
    assert f"http://127.0.0.1:{port}/health" in compose["arserve"]["healthcheck"]["test"]
    prom = load("deploy/compose/prometheus.yml")[0]["scrape_configs"][0]
    assert prom["metrics_path"] == "/metrics"
    assert prom["static_configs"][0]["targets"] == [f"arserve:{port}"]


def arserve_command_lines():
    """Every command line that runs `arserve serve`, as argument lists."""
    out = [load("deploy/compose/docker-compose.yml")[0]["services"]["arserve"]["command"],
           pod_spec("Deployment")["containers"][0]["args"]]
    cmd = re.search(r"^CMD (\[.*\])$", read("Dockerfile"), re.M).group(1)
    out.append(yaml.safe_load(cmd))
    for path in ("deploy/systemd/arserve.service", "deploy/nginx/nginx.conf"):
        for m in re.finditer(r"arserve serve([^&\n]*)", read(path)):
            out.append(["arserve", "serve"] + m.group(1).split())
    return out


def environment_names():
    """Every ARSERVE_* variable deploy/ and the Dockerfile set for the daemon."""
    names = set(load("deploy/compose/docker-compose.yml")[0]["services"]["arserve"]["environment"])
    for kind in ("Deployment", "Job"):
        for c in pod_spec(kind)["containers"]:
            names |= {n for n in env_of(c) if n.startswith("ARSERVE_")}
    names |= set(re.findall(r"^Environment=(ARSERVE_[A-Z0-9_]+)=",
                            read("deploy/systemd/arserve.service"), re.M))
    for line in docker_lines("Dockerfile") + docker_lines("deploy/README.md"):
        names |= set(docker_run(line)["env"]) if line[1] == "run" else set()
    return names


def test_flags_and_variables_are_ones_the_daemon_takes():
    text = serve_help()
    lines = arserve_command_lines()
    assert len(lines) >= 5, lines
    for args in lines:
        assert args[:2] == ["arserve", "serve"], args
        for a in args:
            if a.startswith("--"):
                assert re.search(r"^\s+" + re.escape(a) + r"\b", text, re.M), (a, args)
    names = environment_names()
    assert {"ARSERVE_MODEL", "ARSERVE_DRAIN_TIMEOUT_S", "ARSERVE_API_KEY"} <= names, names
    unknown = names - accepted_variables()
    assert not unknown, f"arserve serve --help lists no {sorted(unknown)}"


def test_grace_periods_cover_the_drain():
    dep = manifest("Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    drain = int(env_of(c)["ARSERVE_DRAIN_TIMEOUT_S"])
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    m = re.search(r"preStop sleep \((\d+) s.*\n.*"
                  r"drain timeout \(ARSERVE_DRAIN_TIMEOUT_S, (\d+) s\) \+ buffer \((\d+) s\) = (\d+) s", read("deploy/k8s/deployment.yaml"))
    assert m, "deployment.yaml's comment on the grace period"
    a, b, buf, total = map(int, m.groups())
    assert (a, b) == (pre, drain), ((a, b), (pre, drain))
    assert buf > 0 and a + b + buf == total == spec["terminationGracePeriodSeconds"]
    compose = load("deploy/compose/docker-compose.yml")[0]["services"]["arserve"]
    assert int(compose["environment"]["ARSERVE_DRAIN_TIMEOUT_S"]) == drain
    assert int(compose["stop_grace_period"].rstrip("s")) > drain
    unit = read("deploy/systemd/arserve.service")
    assert int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1)) > \
        int(re.search(r"^Environment=ARSERVE_DRAIN_TIMEOUT_S=(\d+)$", unit, re.M).group(1))


def compose_value(text):
    """A compose string with ${VAR:-default} and ${VAR-default} read as their defaults."""
    return re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", text)


def test_compose_file():
    path = os.path.join(DEPLOY, "compose", "docker-compose.yml")
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=scaled(30)).returncode == 0:
        p = subprocess.run([docker, "compose", "-f", path, "config", "--quiet"],
                           capture_output=True, text=True, timeout=scaled(60))
        assert p.returncode == 0, p.stdout + p.stderr
    else:
        print("docker compose is not installed: docker-compose.yml is checked by reading it "
              "(mounts, names), not by `docker compose config`")
    services = load("deploy/compose/docker-compose.yml")[0]["services"]
    mounts = {}
    for name, svc in services.items():
        assert "image" in svc, name
        for dep in svc.get("depends_on", []):
            assert dep in services, (name, dep)
        for vol in svc.get("volumes", []):
            src, dst, *mode = compose_value(vol).split(":")
            assert src.startswith((".", "/")), f"{name}: {vol} is not a bind mount"
            if src.startswith("."):
                full = os.path.normpath(os.path.join(os.path.dirname(path), src))
                assert os.path.exists(full), f"{name} mounts {src}, which does not exist"
            assert mode == ["ro"], f"{name}: {vol} is not read-only"
            mounts.setdefault(name, {})[dst] = src
    # The daemon finds its model where compose mounts one (the demo model by default).
    model = services["arserve"]["environment"]["ARSERVE_MODEL"]
    assert model in mounts["arserve"], (model, mounts["arserve"])
    assert os.path.isfile(os.path.join(DEPLOY, "compose", mounts["arserve"][model], "arserve.json"))
    assert services["arserve"]["image"] == pod_spec("Deployment")["containers"][0]["image"]
    # Prometheus reads its rules, and Grafana its dashboards and Prometheus, where compose
    # puts them.
    for rules in load("deploy/compose/prometheus.yml")[0]["rule_files"]:
        assert rules in mounts["prometheus"], rules
    prov = os.path.join("deploy/compose/grafana/provisioning")
    dash = load(os.path.join(prov, "dashboards/dashboards.yml"))[0]["providers"][0]
    assert dash["options"]["path"] in mounts["grafana"], dash
    source = load(os.path.join(prov, "datasources/prometheus.yml"))[0]["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]


def shell_lines(path):
    """The command lines of a file: a README's ```sh blocks, or a Dockerfile's comment lines
    indented as commands, with continuation lines joined."""
    text = read(path)
    if path.endswith(".md"):
        body = "\n".join(re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S))
    else:
        body = "\n".join(m.group(1) for m in re.finditer(r"^#   (.*)$", text, re.M))
    return [" ".join(line.split()) for line in re.sub(r"\\\n\s*", " ", body).splitlines()
            if line.strip()]


def docker_lines(path):
    return [shlex.split(line) for line in shell_lines(path) if line.startswith("docker ")]


def docker_run(args):
    """A `docker run` line's image, published ports, mounts and -e variables."""
    out = {"gpus": None, "ports": [], "mounts": [], "env": {}, "image": None, "after": []}
    i = 2
    while i < len(args) and args[i].startswith("-"):
        opt, val = args[i], args[i + 1]
        if opt == "--gpus":
            out["gpus"] = val
        elif opt == "-p":
            out["ports"].append(val)
        elif opt == "-v":
            out["mounts"].append(val.split(":"))
        elif opt == "-e":
            name, _, value = val.partition("=")
            out["env"][name] = value if "=" in val else None
        else:
            pytest.fail(f"an option this test does not read: {opt} in {args}")
        i += 2
    out["image"], out["after"] = args[i], args[i + 1:]
    return out


def test_the_docker_lines_agree_with_the_dockerfile():
    port = re.search(r"^EXPOSE (\d+)$", read("Dockerfile"), re.M).group(1)
    image = pod_spec("Deployment")["containers"][0]["image"]
    model_runs = {}
    for path in ("Dockerfile", "deploy/README.md"):
        lines = docker_lines(path)
        builds = [a for a in lines if a[1] == "build"]
        assert [b[b.index("-t") + 1] for b in builds] == [image], (path, builds)
        assert builds[0][-1] == ".", "built from the repository's root"
        runs = [docker_run(a) for a in lines if a[1] == "run"]
        assert runs, f"{path} has no docker run line"
        for r in runs:
            assert r["gpus"] == "all" and r["ports"] == [f"{port}:{port}"], r
            assert r["image"] == image, r
        # The line that serves a mounted model directory: read-only, where ARSERVE_MODEL
        # points, with the API key taken from the caller's environment.
        with_model = [r for r in runs if r["mounts"]]
        assert len(with_model) == 1, (path, runs)
        r = with_model[0]
        (src, dst, mode), = r["mounts"]
        assert r["env"]["ARSERVE_MODEL"] == dst and mode == "ro", r
        assert "ARSERVE_API_KEY" in r["env"] and r["env"]["ARSERVE_API_KEY"] is None, r
        model_runs[path] = r
    assert model_runs["Dockerfile"] == model_runs["deploy/README.md"]
    readme = shell_lines("deploy/README.md")
    assert any(re.match(r"export ARSERVE_API_KEY=", line) for line in readme), readme
    assert any('-H "Authorization: Bearer $ARSERVE_API_KEY"' in line for line in readme), readme


def test_the_readme_applies_every_manifest_in_order():
    applied = []
    for line in shell_lines("deploy/README.md"):
        if line.startswith("kubectl ") and " -f " in line:
            applied += [os.path.basename(f) for f in re.findall(r"-f (deploy/k8s/\S+)", line)]
            for f in re.findall(r"-f (deploy/\S+)", line):
                assert os.path.isfile(os.path.join(ROOT, f)), f
    assert applied.index("pvc.yaml") < applied.index("model-loader-job.yaml") < \
        applied.index("deployment.yaml"), applied
    text = read("deploy/README.md")
    for f in k8s_files():
        assert os.path.basename(f) in text, f"deploy/README.md does not name {f}"
    job = manifest("Job")
    assert f"kubectl wait --for=condition=complete --timeout=2h job/{job['metadata']['name']}" in \
        shell_lines("deploy/README.md")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert "loader=IMAGE" in text and c["name"] == "loader"


# The model loader: the Job's script run here, arserve on PATH, with the Job's environment
# but for where the claim (MODEL_DIR) and the image's model (MODEL_SOURCE_DIR) are.

def loader_job():
    (c,) = pod_spec("Job")["containers"]
    assert c["command"] == ["/bin/bash", "-c"], c["command"]
    return c["args"][0], env_of(c)


@pytest.fixture
def loader(tmp_path):
    script, job_env = loader_job()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "arserve").symlink_to(BIN)
    dest = tmp_path / "claim"
    dest.mkdir()

    def run(**env):
        full = {k: v for k, v in job_env.items() if v is not None}
        full.update(PATH=f"{bindir}:/usr/bin:/bin", HOME=str(tmp_path), MODEL_DIR=str(dest))
        full.update(env)
        return subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True,
                              timeout=scaled(120))

    run.dest = dest
    return run


def listing(d):
    """A directory's files and their bytes' digests."""
    out = {}
    for root, dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = hashlib.sha256(fh.read()).hexdigest()
        out.update({os.path.relpath(os.path.join(root, x), d) + "/": "" for x in dirs})
    return out


def model_copy(tmp_path, name, into="source"):
    dst = tmp_path / into
    shutil.copytree(os.path.join(ROOT, "models", name), dst)
    return dst


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_dir(tmp_path):
    """A folder served over HTTP on loopback: (folder, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    t.join()


def test_loader_copies_the_images_model_over_the_old_one(loader, tmp_path):
    # shapes-var: several weight files and class names, no tokenizer.
    src = model_copy(tmp_path, "shapes-var")
    weights = json.loads((src / "arserve.json").read_text())["weights"]
    assert len(weights) > 1
    (loader.dest / "lm.safetensors").write_text("the old model")
    (loader.dest / "lost+found").mkdir()
    p = loader(MODEL_SOURCE_DIR=str(src))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "checked arserve.json and %s classes.txt" % " ".join(weights) in p.stdout, p.stdout
    assert listing(loader.dest) == {**listing(src), "lost+found/": ""}


def test_loader_fetches_an_archive_checks_it_and_loads_it(loader, tmp_path, http_dir):
    # An archive with the model in one folder, from a URL whose query is a credential,
    # checked against its SHA-256, then loaded by arserve on the CPU.
    www, base = http_dir
    with tarfile.open(www / "shapes.tar.gz", "w:gz") as tar:
        tar.add(os.path.join(ROOT, "models", "shapes"), arcname="shapes")
    digest = hashlib.sha256((www / "shapes.tar.gz").read_bytes()).hexdigest()
    p = loader(MODEL_URL=f"{base}/shapes.tar.gz?X-Amz-Signature=s3cr3t", MODEL_SHA256=digest,
               VERIFY_LOAD="1", VERIFY_PORT=str(free_port()))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "arserve loaded it" in p.stdout and "s3cr3t" not in out, out
    assert listing(loader.dest) == listing(os.path.join(ROOT, "models", "shapes"))


def truncate(path, n):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - n)


def overwrite_tail(path, n, byte):
    with open(path, "r+b") as f:
        f.seek(-n, os.SEEK_END)
        f.write(bytes([byte]) * n)


def edit_json(path, change):
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg, indent=2))


BROKEN = {
    "a truncated weight file": (
        "shapes", lambda d: truncate(d / "vq.safetensors", 100),
        "vq.safetensors: its tensors end at byte"),
    "a weight file that is not safetensors": (
        "shapes", lambda d: (d / "lm.safetensors").write_text("<html>403 Forbidden</html>"),
        "lm.safetensors: a header of"),
    "no tokenizer": (
        "shapes", lambda d: (d / "tokenizer.json").unlink(),
        "needs tokenizer.json (arserve.json), which is missing"),
    "no tokenizer, named by default": (
        "shapes", lambda d: (edit_json(d / "arserve.json", lambda c: c.pop("tokenizer")),
                             (d / "tokenizer.json").unlink()),
        "needs tokenizer.json (arserve.json), which is missing"),
    "no class names": (
        "shapes-var", lambda d: (d / "classes.txt").unlink(),
        "needs classes.txt (arserve.json), which is missing"),
    "an arserve.json arserve refuses": (
        "shapes-inf",
        lambda d: edit_json(d / "arserve.json", lambda c: c.update(bogus=1)),
        "unknown key 'bogus'", "arserve.json does not load"),
    "no arserve.json": (
        "shapes", lambda d: (d / "arserve.json").unlink(),
        "no model: set MODEL_URL"),
    # NaN weights pass the quick checks; with VERIFY_LOAD=1 arserve loads them and refuses.
    "weights that are not finite, VERIFY_LOAD=1": (
        "shapes-inf", lambda d: overwrite_tail(d / "model.safetensors", 64, 0xFF),
        "arserve could not load the model"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_loader_refuses_a_broken_model_and_keeps_the_old_one(loader, tmp_path, case):
    model, breaks, *messages = BROKEN[case]
    old = model_copy(tmp_path, "shapes-inf", into="old")
    shutil.copytree(old, loader.dest, dirs_exist_ok=True)
    src = model_copy(tmp_path, model)
    breaks(src)
    verify = "1" if "VERIFY_LOAD=1" in case else "0"
    p = loader(MODEL_SOURCE_DIR=str(src), VERIFY_LOAD=verify, VERIFY_PORT=str(free_port()))
    assert p.returncode != 0, p.stdout + p.stderr
    for m in messages:
        assert m in p.stderr, p.stdout + p.stderr
    assert listing(loader.dest) == listing(old)


def test_loader_refuses_an_archive_with_the_wrong_checksum(loader, tmp_path, http_dir):
    www, base = http_dir
    with tarfile.open(www / "shapes.tar", "w") as tar:
        tar.add(os.path.join(ROOT, "models", "shapes"), arcname=".")
    p = loader(MODEL_URL=f"{base}/shapes.tar", MODEL_SHA256="0" * 64)
    assert p.returncode != 0 and "MODEL_SHA256 says 0000" in p.stderr, p.stdout + p.stderr
    assert listing(loader.dest) == {}
    p = loader(MODEL_URL=f"{base}/missing.tar")
    assert p.returncode != 0 and "fetching or unpacking" in p.stderr, p.stdout + p.stderr
    p = loader(MODEL_URL=f"{base}/shapes.zip")
    assert p.returncode != 0 and "must name a .tar or .tar.gz" in p.stderr, p.stderr
