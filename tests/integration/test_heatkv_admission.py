"""HeatKV's point seen from outside: a KV pool too small for two full-cache
images runs several HeatKV images at once. One daemon serves the next-scale demo
model (ARSERVE_VAR_MODEL, else models/shapes-var) in a pool of the least
whole MiB that holds one full-cache image at its peak (`arserve plan`): for
the shipped model 3 MiB, one image holding 2548 KiB of fp32 KV at its peak
with the full cache and 506 KiB under HeatKV at budget 0.2, so the pool fits
one full-cache peak, not two, and five HeatKV ones.

Admission plans whole KV trajectories (engine/batcher.h): an image starts
once the running ones leave room for its trajectory at every future step.
So full-cache images still overlap in their small early scales: in 3 MiB the
second of two starts when the first is four scales in (they share 3 of 7
iterations), and at most two ever share an iteration. Both bounds are
computed here from the planner's trajectories (`arserve plan`), and the
test checks:

  full:   two requests sent together share no more iterations than that
          (the second waits for the first's peak to pass), but some (they
          were in flight together);
  heatkv: five requests sent together run more images in one iteration
          than the full cache ever could in this pool; all 200 with valid
          PNGs and their measured KV peak equal to the planned one.

From /metrics: arserve_iteration_sequences (a histogram of the sequences,
two per image, each engine iteration advanced: an exact record of how many
images ran together), arserve_iterations_total and
arserve_kv_plan_overruns_total (iterations whose KV use passed the
planner's reservation), and arserve_kv_pool_{reserved,used}_bytes polled
while the requests run, never above the pool.

There is no knob to slow the daemon, and an image takes tens of
milliseconds, so "sent together" is made tight instead: every client first
opens a kept-alive connection (the daemon gives each a thread), then the
daemon is stopped (SIGSTOP), every client sends, and once every request
sits in the daemon's socket buffers it is continued (SIGCONT). The engine
starts on the first request it sees; the others are admitted with it or an
iteration or two later."""
import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import (ARSERVE_BIN, HTTP_TIMEOUT, Daemon, Metrics, b64_png_size, clean_env, repo_path,
                      scaled, tcp_sockets)

GEN = "/v1/images/generations"
VAR_MODEL = repo_path(os.environ.get("ARSERVE_VAR_MODEL") or "models/shapes-var")
HEATKV_BUDGET = 0.2
N_FULL = 2
N_HEATKV = 5
# arserve_iteration_sequences' bucket bounds (server/scheduler.c).
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def var_info():
    with open(os.path.join(VAR_MODEL, "arserve.json")) as f:
        cfg = json.load(f)
    side = cfg["image"]["scales"][-1] * 2 ** (len(cfg["decoder"]["channel_multiplier"]) - 1)
    return {"side": side, "steps": len(cfg["image"]["scales"])}


INFO = var_info()


def plan(policy, budget=None, pool_mb=None):
    """One image's KV bytes in the pool at each step, from `arserve plan`
    (the daemon's planner): the trajectory table's last column, in KiB."""
    # fp32, as the test daemons store K and V (conftest's Daemon).
    argv = [ARSERVE_BIN, "plan", "--model", VAR_MODEL, "--kv-dtype", "f32", "--policy", policy,
            "--pool-mb", str(pool_mb or POOL_MB)]
    if budget is not None:
        argv += ["--budget", str(budget)]
    out = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=scaled(30))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "side"])
    traj = []
    for line in lines[at + 1:]:
        m = re.match(r"^(\d+)\s+\d+\s+\d+\s+\d+\s+\d+ / ([0-9.]+)$", line.strip())
        if not m:
            break
        assert int(m.group(1)) == len(traj), line
        traj.append(round(float(m.group(2)) * 1024))
    assert len(traj) == INFO["steps"], out.stdout
    return traj


# A pool for one full-cache image at its peak, not two: the least whole MiB
# that holds one.
POOL_MB = -(-max(plan("full", pool_mb=64)) // (1 << 20))
POOL_BYTES = POOL_MB << 20


def fits(traj, steps_done, pool):
    """Whether images that have done steps_done steps of traj (one entry per
    image) fit pool together at every iteration from now on: the planner's
    invariant for any set of images running at once."""
    return all(sum(traj[s + t] for s in steps_done if s + t < len(traj)) <= pool
               for t in range(len(traj)))


def max_together(traj, pool, limit=8):
    """The most images of trajectory traj (up to limit) that can ever run in
    one iteration in pool, whatever the order they came in."""
    k = 0
    while k < limit and any(fits(traj, c, pool) for c in
                            itertools.combinations_with_replacement(range(len(traj)), k + 1)):
        k += 1
    return k


def max_shared(traj, pool):
    """How many iterations two images of traj sent together share at most:
    the second starts once the first has done o steps, the least o that
    fits."""
    o = next(o for o in range(len(traj) + 1) if fits(traj, (o, 0), pool))
    return len(traj) - o


def requests_buffered(port):
    """Connections to the daemon at port with bytes in the kernel that the
    daemon has not read yet (None: no /proc/net/tcp to read)."""
    sockets = tcp_sockets(port)
    return None if sockets is None else sum(1 for state, n in sockets if state == "01" and n)


def wait_stopped(pid, timeout=10):
    """Waits until every thread of pid is stopped (kill returns before
    they are)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that just ended
        if all(s in "tT" for s in states):
            return
        assert time.monotonic() < deadline, f"arserve's threads did not stop: {states}"
        time.sleep(0.001)


class Poller(threading.Thread):
    """Scrapes /metrics in a loop until halted, keeping every scrape's KV
    gauges."""
    GAUGES = ("arserve_kv_pool_reserved_bytes", "arserve_kv_pool_used_bytes")

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url = url
        self.halt = threading.Event()
        self.samples = []
        self.error = None

    def run(self):
        try:
            with httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT) as c:
                while not self.halt.is_set():
                    r = c.get("/metrics")
                    assert r.status_code == 200, r.text
                    m = Metrics(r.text)
                    self.samples.append({g: m.get(g) for g in self.GAUGES})
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def max(self, gauge):
        return max(s[gauge] for s in self.samples)


def send_together(d, bodies):
    """Posts bodies together (the module's docstring says how), polls
    /metrics until every answer is in, and returns (responses, the metrics
    before, the metrics once idle, the poller)."""
    before = d.metrics()
    n = len(bodies)
    connected, sent = threading.Barrier(n + 1), threading.Barrier(n + 1)

    def one(body):
        with httpx.Client(base_url=d.url, timeout=HTTP_TIMEOUT) as c:
            assert c.get("/health").status_code == 200
            connected.wait(timeout=HTTP_TIMEOUT)
            sent.wait(timeout=HTTP_TIMEOUT)
            return c.post(GEN, json=body)

    poller = Poller(d.url)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, b) for b in bodies]
        try:
            connected.wait(timeout=HTTP_TIMEOUT)
            d.proc.send_signal(signal.SIGSTOP)
            try:
                wait_stopped(d.proc.pid)
                sent.wait(timeout=HTTP_TIMEOUT)
                deadline = time.monotonic() + scaled(10)
                while (requests_buffered(d.port) or 0) < n and time.monotonic() < deadline:
                    time.sleep(0.005)
                buffered = requests_buffered(d.port)
            finally:
                d.proc.send_signal(signal.SIGCONT)
        except BaseException:
            connected.abort()  # no client waits out its barrier's timeout
            sent.abort()
            raise
        poller.start()
        responses = [f.result(timeout=2 * HTTP_TIMEOUT) for f in futures]
    poller.halt.set()
    poller.join(timeout=scaled(10))
    assert buffered is None or buffered >= n, \
        f"only {buffered} of {n} requests reached the daemon while it was stopped"
    assert poller.error is None, f"polling /metrics failed: {poller.error!r}"
    ok = before.get("arserve_images_total", status="ok")
    n_ok = sum(r.status_code == 200 for r in responses)
    after = d.wait_metrics(
        lambda m: m.get("arserve_images_total", status="ok") - ok >= n_ok
        and m.get("arserve_kv_pool_reserved_bytes") == 0,
        timeout=10, what=f"{n_ok} images counted and the KV pool idle")
    return responses, before, after, poller


def iterations_above(before, after, images):
    """Engine iterations between two scrapes that advanced more than
    `images` images (two sequences each); images * 2 must be a bucket."""
    bound = 2 * images
    return after.histogram_above("arserve_iteration_sequences", bound) - \
        before.histogram_above("arserve_iteration_sequences", bound)


def check_kv_bounded(before, after, poller, what):
    """No iteration used more KV than planned, and the KV reserved and in
    use stayed within the pool in every scrape while the requests ran."""
    assert after.get("arserve_kv_plan_overruns_total") == \
        before.get("arserve_kv_plan_overruns_total"), \
        f"{what}: an iteration used more KV than planned:\n{after.text}"
    assert poller.samples, f"{what}: no /metrics scrape while the requests ran"
    for g in Poller.GAUGES:
        assert poller.max(g) <= POOL_BYTES, \
            f"{what}: {g} reached {poller.max(g)} in a {POOL_MB} MiB pool"


def check_images(responses, policy, budget=None):
    """Every response a 200 with one valid PNG of the model's size, its
    kv_cache the policy asked for with the measured peak equal to the
    planned one; returns the planned peak (the same for all)."""
    assert [r.status_code for r in responses] == [200] * len(responses), \
        [(r.status_code, r.text[:300]) for r in responses]
    peaks = set()
    images = set()
    for r in responses:
        out = r.json()
        assert len(out["data"]) == 1
        assert b64_png_size(out["data"][0]["b64_json"]) == (INFO["side"], INFO["side"])
        images.add(out["data"][0]["b64_json"])
        kv = out["kv_cache"]
        assert kv["policy"] == policy, kv
        if budget is not None:
            assert kv["budget"] == pytest.approx(budget), kv
        assert kv["peak_bytes"] == kv["planned_peak_bytes"] > 0, kv
        peaks.add(kv["planned_peak_bytes"])
    assert len(images) == len(responses), "different seeds gave identical images"
    assert len(peaks) == 1, peaks
    return peaks.pop()


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    daemon = Daemon(str(tmp_path_factory.mktemp("arserve")), VAR_MODEL,
                    ["--kv-pool-mb", str(POOL_MB), "--threads", "1"])
    yield daemon
    daemon.finish()


def test_the_pool_holds_one_full_image_but_many_heatkv_ones(d):
    cap = d.metrics().get("arserve_kv_pool_capacity_bytes")
    assert cap == POOL_BYTES, f"the pool is {cap} bytes, not {POOL_MB} MiB"
    full, heat = max(plan("full")), max(plan("heatkv", HEATKV_BUDGET))
    assert full <= cap < 2 * full, (full, cap)
    assert N_HEATKV * heat <= cap, (N_HEATKV, heat, cap)


def test_full_cache_images_wait_for_each_other(d):
    traj = plan("full")
    shared_max = max_shared(traj, POOL_BYTES)
    bodies = [{"class_label": i, "seed": 100 + i, "kv_policy": "full"} for i in range(N_FULL)]
    responses, before, after, poller = send_together(d, bodies)
    assert check_images(responses, "full") == max(traj), "the daemon plans as `arserve plan`"
    shared = iterations_above(before, after, 1)
    # Sent together: had the pool room for both, they would share every
    # iteration. It has not: the second waits for the first's peak to pass.
    assert shared <= shared_max, \
        (f"{N_FULL} full-cache images shared {shared} iterations of {INFO['steps']}; the plan "
         f"allows {shared_max} in a {POOL_MB} MiB pool:\n{after.text}")
    assert shared > 0, "the two requests never overlapped: they were not sent together"
    check_kv_bounded(before, after, poller, "full")


def test_heatkv_images_run_together_in_a_pool_for_one_full_image(d):
    full_max = max_together(plan("full"), POOL_BYTES)
    # The least bucket bound that only more images than the full cache
    # ever fits at once pass; the heatkv requests must be able to pass it.
    bound = next(b for b in SEQ_BUCKETS if b >= 2 * full_max)
    assert 2 * N_HEATKV > bound, (N_HEATKV, bound)
    traj = plan("heatkv", HEATKV_BUDGET)
    bodies = [{"class_label": i, "seed": 200 + i, "kv_policy": "heatkv",
               "kv_budget": HEATKV_BUDGET} for i in range(N_HEATKV)]
    responses, before, after, poller = send_together(d, bodies)
    peak = check_images(responses, "heatkv", HEATKV_BUDGET)
    assert peak == max(traj), "the daemon plans as `arserve plan`"
    together = iterations_above(before, after, bound // 2)
    assert together > 0, \
        (f"no iteration ran more than {bound // 2} of {N_HEATKV} heatkv images (the full cache "
         f"fits at most {full_max} in this pool):\n{after.text}")
    check_kv_bounded(before, after, poller, "heatkv")
