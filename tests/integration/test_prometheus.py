"""/metrics as Prometheus sees it: `promtool check metrics` accepts it, and a
real Prometheus server on loopback scrapes the daemon with the target up.
Both come from Debian's `prometheus` package (`make deps` installs it)."""
import os
import shutil
import subprocess
import time

import httpx
import pytest

from conftest import clean_env, free_port, scaled

GEN = "/v1/images/generations"


def need(binary):
    path = shutil.which(binary)
    if not path:
        msg = (f"{binary} is not installed (Debian package 'prometheus'; `make deps` "
               "installs it)")
        print(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="module")
def busy_daemon(tiny_daemon):
    """The tiny daemon after traffic that fills every kind of series:
    images, a budget range, a stream, errors, a 404, a 405."""
    c = tiny_daemon.client
    assert c.post(GEN, json={"prompt": "a red circle", "n": 2}).status_code == 200
    assert c.post(GEN, json={"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 1,
                             "kv_budget_min": 0.5}).status_code == 200
    with c.stream("POST", GEN, json={"prompt": "a red circle", "stream": True,
                                     "partial_images": 1}) as r:
        r.read()
    assert c.post(GEN, json={"prompt": ""}).status_code == 400
    assert c.get("/nope").status_code == 404
    assert c.get(GEN).status_code == 405
    return tiny_daemon


def test_promtool_check_metrics_accepts_metrics(busy_daemon):
    promtool = need("promtool")
    text = busy_daemon.client.get("/metrics").text
    p = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                       timeout=scaled(30), env=clean_env())
    out = (p.stdout + p.stderr).decode()
    # promtool prints nothing and exits 0 when the exposition is clean; lint
    # findings (names, units, HELP) are reported and fail the check too.
    assert p.returncode == 0 and not out.strip(), f"promtool:\n{out}\n--- metrics ---\n{text}"


def test_metrics_names_and_types(busy_daemon):
    """The families the issue lists exist, with base units and _total counters."""
    text = busy_daemon.client.get("/metrics").text
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    want = {
        "arserve_http_requests_total": "counter",
        "arserve_images_total": "counter",
        "arserve_requests_running": "gauge",
        "arserve_requests_waiting": "gauge",
        "arserve_queue_wait_seconds": "histogram",
        "arserve_time_to_first_step_seconds": "histogram",
        "arserve_request_duration_seconds": "histogram",
        "arserve_iteration_duration_seconds": "histogram",
        "arserve_iteration_sequences": "histogram",
        "arserve_image_tokens_generated_total": "counter",
        "arserve_kv_pool_capacity_bytes": "gauge",
        "arserve_kv_pool_reserved_bytes": "gauge",
        "arserve_kv_plan_released_bytes_total": "counter",
        "arserve_images_admitted_total": "counter",
        "arserve_kv_pool_used_bytes": "gauge",
        "arserve_admissions_refused_total": "counter",
        "arserve_requests_cancelled_total": "counter",
        "arserve_build_info": "gauge",
        "arserve_backend_healthy": "gauge",
        "arserve_kv_admitted_budget_ratio": "histogram",
        "arserve_kv_budget_below_max_total": "counter",
    }
    missing = {n: k for n, k in want.items() if types.get(n) != k}
    assert not missing, f"missing or mistyped: {missing}\n{text}"
    for name, kind in types.items():
        assert name.startswith("arserve_"), name
        assert (kind == "counter") == name.endswith("_total"), name
    assert 'arserve_http_requests_total{route="/v1/images/generations",code="200"}' in text
    assert 'arserve_http_requests_total{route="other",code="404"}' in text
    assert 'backend="cpu"' in text and 'model="tiny-random"' in text
    assert "\narserve_backend_healthy 1\n" in text  # the CPU backend never dies
    assert 'arserve_images_admitted_total{policy="full"}' in text
    # Budgets by policy: full counts as the whole cache; the range ran at its top (idle).
    assert 'arserve_kv_admitted_budget_ratio_bucket{policy="full",le="0.9"} 0\n' in text
    assert 'arserve_kv_admitted_budget_ratio_bucket{policy="linear",le="0.9"} 0\n' in text
    assert 'arserve_kv_admitted_budget_ratio_count{policy="linear"} 1\n' in text


def test_prometheus_scrapes_daemon_target_up(busy_daemon, tmp_path):
    prometheus = need("prometheus")
    port = free_port()
    target = f"127.0.0.1:{busy_daemon.port}"
    config = tmp_path / "prometheus.yml"
    every = f"{max(1, round(scaled(1)))}s"  # a scrape of a slower build takes longer
    config.write_text(
        f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n"
        "scrape_configs:\n  - job_name: arserve\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n")
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
            cwd=tmp_path)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + scaled(40)
        last = None
        while True:
            assert proc.poll() is None, \
                f"prometheus exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                r = httpx.get(f"{api}/targets", timeout=scaled(2))
                if r.status_code == 200:
                    active = r.json()["data"]["activeTargets"]
                    last = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in active]
                    mine = [t for t in active if t["labels"].get("instance") == target]
                    if mine and mine[0]["health"] == "up":
                        break
                    # A failing scrape says why: fail at once rather than time out.
                    assert not (mine and mine[0]["health"] == "down"), last
            except httpx.HTTPError as e:
                last = repr(e)
            assert time.monotonic() < deadline, f"target not up within {scaled(40):.0f} s: {last}"
            time.sleep(0.25)
        # And the samples arrived: build info reads 1 with the daemon's labels.
        r = httpx.get(f"{api}/query", params={"query": "arserve_build_info"},
                      timeout=scaled(5))
        result = r.json()["data"]["result"]
        assert len(result) == 1, result
        assert result[0]["metric"]["job"] == "arserve"
        assert result[0]["metric"]["backend"] == "cpu"
        assert result[0]["value"][1] == "1"
        # Prometheus' own view of the scrape: no samples dropped or rejected.
        r = httpx.get(f"{api}/query", params={"query": "scrape_samples_scraped"},
                      timeout=scaled(5))
        assert float(r.json()["data"]["result"][0]["value"][1]) > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(15))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=scaled(10))
    assert os.path.exists(tmp_path / "data")
