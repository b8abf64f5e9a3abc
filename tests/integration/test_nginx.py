"""deploy/nginx/nginx.conf for real: two daemons behind Debian's nginx on loopback. Requests
spread over both replicas, and a replica drained under load loses no request (its running
requests finish; what it refuses while draining, nginx retries on the other)."""
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import HTTP_TIMEOUT, SLOW_MODEL, Daemon, free_port, repo_path, scaled

# nginx adds a proxy, not a daemon path the drain tests miss: the release build only.
pytestmark = pytest.mark.release_build

GEN = "/v1/images/generations"


@pytest.fixture
def fleet(tmp_path):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    assert nginx, "nginx is not installed (make deps installs it)"
    daemons = [Daemon(str(tmp_path / f"d{i}"), SLOW_MODEL, ["--threads", "1"], drain_timeout_s=60)
               for i in range(2) if not os.makedirs(tmp_path / f"d{i}")]
    port = free_port()
    conf = open(repo_path("deploy/nginx/nginx.conf")).read()
    conf = conf.replace("127.0.0.1:8081", f"127.0.0.1:{daemons[0].port}")
    conf = conf.replace("127.0.0.1:8082", f"127.0.0.1:{daemons[1].port}")
    conf = conf.replace("listen 127.0.0.1:8080", f"listen 127.0.0.1:{port}")
    conf = conf.replace("/tmp/arserve-nginx", str(tmp_path / "nginx"))
    assert conf.count(str(tmp_path / "nginx")) == 3, conf
    os.chmod(tmp_path, 0o755)  # nginx's workers may run as another user
    (tmp_path / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                             "-e", str(tmp_path / "nginx-error.log"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + scaled(10)
    while True:
        try:
            if httpx.get(url + "/health", timeout=scaled(1)).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("nginx did not come up: " + proc.stderr.read().decode(errors="replace"))
        time.sleep(0.05)
    yield url, daemons
    proc.send_signal(signal.SIGQUIT)
    try:
        proc.wait(timeout=scaled(10))
    except subprocess.TimeoutExpired:
        proc.kill()
    for d in daemons:
        d.finish()


def post(url, seed):
    with httpx.Client(base_url=url, timeout=4 * HTTP_TIMEOUT) as c:
        return c.post(GEN, json={"prompt": "a red circle", "seed": seed})


def served(d):
    return d.metrics().get("arserve_images_total", status="ok")


@pytest.mark.timeout(240)
def test_requests_spread_over_both_replicas(fleet):
    url, daemons = fleet
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda s: post(url, s), range(6)))
    assert [r.status_code for r in rs] == [200] * 6, [r.text[:200] for r in rs]
    counts = [served(d) for d in daemons]
    assert sum(counts) == 6 and min(counts) >= 1, counts


@pytest.mark.timeout(300)
def test_a_replica_drained_under_load_loses_no_request(fleet):
    url, (a, b) = fleet
    with ThreadPoolExecutor(10) as pool:
        first = [pool.submit(post, url, s) for s in range(4)]
        # Wait until the replica to drain is generating, then SIGTERM it.
        a.wait_metrics(lambda m: m.get("arserve_requests_running") >= 1, timeout=60,
                       what="a running request on the replica to drain")
        a.signal(signal.SIGTERM)
        deadline = time.monotonic() + scaled(5)
        while a.client.get("/ready").status_code != 503:  # the drain has begun
            assert time.monotonic() < deadline, "the drained replica's /ready stayed 200"
            time.sleep(0.02)
        later = [pool.submit(post, url, 100 + s) for s in range(6)]
        rs = [f.result() for f in first + later]
    assert [r.status_code for r in rs] == [200] * 10, [(r.status_code, r.text[:200]) for r in rs]
    # The drained replica finished what it had started, and exited cleanly.
    assert a.proc.wait(timeout=scaled(90)) == 0, a.stderr()[-2000:]
    assert "draining" in a.stderr()
    assert served(b) >= 6, "the requests after the drain went to the other replica"
