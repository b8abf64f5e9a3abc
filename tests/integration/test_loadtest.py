"""deploy/loadtest/ for real, briefly: the locustfile and the wrk script run against a
tiny-model daemon on loopback. Their requests succeed and the daemon's /metrics counted
them; locust groups its statistics by KV policy (from a mix file); the wrk script's done()
summary prints. With a waiting queue of one, both tools report the 429s by their error
code, as a user reading their output needs."""
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import SLOW_MODEL, clean_env, repo_path, scaled

# Sanitizer passes skip these: the daemon routes they drive are covered without them.
pytestmark = pytest.mark.clients

GEN = "/v1/images/generations"
LOCUSTFILE = repo_path("deploy/loadtest/locustfile.py")
WRK_SCRIPT = repo_path("deploy/loadtest/arserve.lua")
# A mix file as a user writes one. Budgets of 1/2: the tiny model's 8 x 8 grid is
# too small for LineAR's and streaming's default budgets with their default knobs
# (a 400 naming kv_budget).
MIX = [
    {"prompt": "a red circle", "kv_policy": "full"},
    {"prompt": "two green triangles", "kv_policy": "linear", "kv_budget": 0.5},
    {"prompt": "a blue square", "kv_policy": "streaming", "kv_budget": 0.5},
]


def locust_bin():
    path = os.path.join(os.path.dirname(sys.executable), "locust")
    assert os.access(path, os.X_OK), f"{path} is missing: run `make deps` (tests/requirements.txt)"
    return path


def wrk_bin():
    path = shutil.which("wrk")
    if not path:
        pytest.fail("wrk is not installed: run `make deps` (it installs the Debian package wrk)")
    return path


def window(seconds):
    """A load tool's run time: seconds of the reference machine, stretched by this one's
    measured speed (whole seconds, as locust and wrk take them). A fixed window on a loaded
    machine can end before a client has sent its first request."""
    return math.ceil(scaled(seconds))


def run_locust(url, tmp_path, users, seconds, env=None):
    """Runs the locustfile headless for window(seconds); returns (exit status, output, rows
    of its stats CSV by name, rows of its failures CSV). Locust writes the CSV once a
    second, so its counts may miss the last second's requests: the daemon's counts are at
    least these."""
    prefix = str(tmp_path / "locust")
    seconds = window(seconds)
    p = subprocess.run([locust_bin(), "-f", LOCUSTFILE, "--headless", "-u", str(users),
                        "-r", str(users), "-t", f"{seconds}s", "--csv", prefix, "--only-summary",
                        "--host", url],
                       capture_output=True, text=True, timeout=seconds + scaled(30),
                       env=clean_env(env), cwd=str(tmp_path))
    out = p.stdout + p.stderr
    with open(prefix + "_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    with open(prefix + "_failures.csv") as f:
        failures = list(csv.DictReader(f))
    return p.returncode, out, stats, failures


def run_wrk(wrk, url, connections, seconds):
    """Runs the wrk script for window(seconds); returns (output, requests wrk counted)."""
    seconds = window(seconds)
    p = subprocess.run([wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "-s", WRK_SCRIPT,
                        url + GEN], capture_output=True, text=True, timeout=seconds + scaled(30),
                       env=clean_env())
    out = p.stdout + p.stderr
    m = re.search(r"^\s*(\d+) requests in ", out, re.M)
    assert p.returncode == 0 and m, out
    return out, int(m.group(1))


def gen_count(daemon, code):
    return daemon.metrics().get("arserve_http_requests_total", route=GEN, code=code)


def test_locust_and_wrk_requests_succeed_and_the_daemon_counts_them(start_daemon, tmp_path):
    """What a user of either tool sees on a healthy daemon: only successes, and no more than
    the daemon's own counters show (they also count requests cut off as a tool stops)."""
    wrk = wrk_bin()  # before anything runs: without it the test fails at once
    daemon = start_daemon(args=("--threads", "1"))
    mix = tmp_path / "mix.jsonl"
    mix.write_text("".join(json.dumps(m) + "\n" for m in MIX))
    before = daemon.metrics()
    rc, out, stats, failures = run_locust(daemon.url, tmp_path, users=2, seconds=5,
                                          env={"LOADTEST_MIX": str(mix)})
    assert rc == 0, out
    total = stats.pop("Aggregated")
    count = int(total["Request Count"])
    assert count > 0 and int(total["Failure Count"]) == 0, out
    assert failures == [], failures
    # One line of statistics per policy of the mix, named by policy and budget.
    assert set(stats) == {f"{GEN} [full]", f"{GEN} [linear 0.5]", f"{GEN} [streaming 0.5]"}, stats
    assert sum(int(r["Request Count"]) for r in stats.values()) == count
    after = daemon.metrics()
    for name, labels in (("arserve_http_requests_total", {"route": GEN, "code": "200"}),
                         ("arserve_images_total", {"status": "ok"})):
        counted = after.get(name, **labels) - before.get(name, **labels)
        assert counted >= count, (name, counted, count)

    before = gen_count(daemon, "200")
    out, requests = run_wrk(wrk, daemon.url, connections=2, seconds=3)
    assert requests > 0, out
    assert f"arserve: {requests} requests, 0 not 200" in out, out
    assert "Non-2xx" not in out and "arserve: status" not in out, out
    assert gen_count(daemon, "200") - before >= requests, out


def test_a_full_queue_is_reported_by_its_code(start_daemon, tmp_path):
    """One image at a time and one waiting: most requests of four busy clients get 429.
    The slow model's images keep the slots full whatever the clients' pace (with the
    tiny model's milliseconds, clients slowed by a busy machine never filled them)."""
    wrk = wrk_bin()
    d = start_daemon(SLOW_MODEL, ("--threads", "1", "--max-running", "1", "--max-waiting", "1"))
    before = gen_count(d, "429")
    rc, out, stats, failures = run_locust(d.url, tmp_path, users=4, seconds=2)
    assert rc == 1, out  # locust's exit status when requests failed
    failed = int(stats["Aggregated"]["Failure Count"])
    assert failed > 0, out
    assert [f["Error"] for f in failures] == ["CatchResponseError('429 queue_full')"], failures
    assert sum(int(f["Occurrences"]) for f in failures) == failed, failures

    out, requests = run_wrk(wrk, d.url, connections=4, seconds=2)
    m = re.search(r"^arserve: (\d+) requests, (\d+) not 200$", out, re.M)
    assert m and int(m.group(1)) == requests, out
    refused = int(m.group(2))
    assert refused > 0, out
    assert re.findall(r"^arserve: status (.*)$", out, re.M) == [f"429 queue_full: {refused}"], out
    assert f"Non-2xx or 3xx responses: {refused}" in out, out
    assert gen_count(d, "429") - before >= failed + refused
