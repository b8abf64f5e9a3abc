"""Async jobs: POST /v1/images/generations with "async": true answers 202 at
once with a job, GET /v1/images/jobs/ID says its status (queued, running,
done, failed, cancelled, expired), queue position, progress and, once done,
the images; DELETE cancels one that has not ended (its KV freed at the next
iteration) or forgets one that has. Ended jobs are kept async_retention_s,
at most async_max_jobs at once; ids are 128 random bits; jobs obey the API
key. Every wait polls with a deadline (wait_job, wait_metrics)."""
import re
import shutil
import subprocess
import time
from collections import Counter

import httpx
import pytest

from conftest import SLOW_MODEL, b64_png_size, clean_env, scaled

GEN = "/v1/images/generations"
JOBS = "/v1/images/jobs/"
ID_RE = re.compile(r"^job_[0-9a-f]{32}$")
SLOW_ARGS = ["--threads", "1"]
# A slow-model job of 16 images fills the 16 running slots for seconds, so
# the jobs after it wait and it is seen running.
BUSY_ARGS = [*SLOW_ARGS, "--max-running", "16", "--max-n", "16"]
BUSY = {"prompt": "a red circle", "seed": 1, "n": 16}
JOB_KEYS = {"id", "object", "status", "created", "started", "completed", "queue_position",
            "progress", "poll_url", "result", "error"}
ENDED = {"done", "failed", "cancelled", "expired"}


def submit(d, body, headers=None, code=202):
    r = d.client.post(GEN, json={**body, "async": True}, headers=headers or {})
    assert r.status_code == code, r.text
    return r


def wait_job(d, job_id, pred, timeout=10.0, what="the job", headers=None):
    """Polls GET /v1/images/jobs/ID until pred(job dict) holds; returns it.
    timeout is in the reference machine's seconds (scaled here)."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        r = d.client.get(JOBS + job_id, headers=headers or {})
        assert r.status_code == 200, r.text
        job = r.json()
        if pred(job):
            return job
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {limit:.1f} s waiting for {what}; last: {job}")
        time.sleep(0.02)


def status_is(*states):
    return lambda job: job["status"] in states


def assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- done: the images, as the synchronous answer gives them ------------------

def test_async_answers_202_at_once_and_done_gives_the_sync_images(tiny_daemon, tiny_info):
    d = tiny_daemon
    body = {"prompt": "a red circle", "seed": 7, "n": 2}
    r = submit(d, body)
    job = r.json()
    assert set(job) == JOB_KEYS
    assert ID_RE.match(job["id"]), job["id"]
    assert job["object"] == "image.generation.job"
    assert job["status"] in ("queued", "running", "done")
    assert job["poll_url"] == JOBS + job["id"]
    assert r.headers["location"] == job["poll_url"]
    assert job["progress"]["steps_total"] == tiny_info["steps"]

    done = wait_job(d, job["id"], status_is(*ENDED), what="the job to end")
    assert done["status"] == "done", done
    assert done["error"] is None and done["queue_position"] == 0
    assert done["progress"] == {"steps_done": tiny_info["steps"],
                                "steps_total": tiny_info["steps"]}
    assert done["created"] <= done["started"] <= done["completed"]
    # The same request made synchronously: the same members and the same images.
    sync = d.client.post(GEN, json=body).json()
    result = done["result"]
    assert set(result) == set(sync)
    assert [x["b64_json"] for x in result["data"]] == [x["b64_json"] for x in sync["data"]]
    assert result["usage"] == sync["usage"]
    for x in result["data"]:
        assert b64_png_size(x["b64_json"]) == (tiny_info["width"], tiny_info["height"])
    # Read again: still there, still done.
    again = d.client.get(done["poll_url"])
    assert again.status_code == 200 and again.json()["status"] == "done"


# ---- queued and running: position and progress; DELETE cancels -------------

def test_queued_running_position_progress_and_cancel_frees_kv(start_daemon):
    d = start_daemon(SLOW_MODEL, BUSY_ARGS)
    a = submit(d, BUSY).json()
    running = wait_job(d, a["id"], lambda j: j["status"] == "running"
                       and j["progress"]["steps_done"] > 0, what="A running")
    assert running["queue_position"] == 0 and running["started"] is not None
    b = submit(d, {"prompt": "a blue square", "seed": 2}).json()
    c = submit(d, {"prompt": "a green triangle", "seed": 3}).json()
    assert d.client.get(JOBS + b["id"]).json()["queue_position"] == 1
    qc = d.client.get(JOBS + c["id"]).json()
    assert qc["status"] == "queued" and qc["queue_position"] == 2 and qc["started"] is None
    assert qc["progress"]["steps_done"] == 0

    # Progress only goes forward while A runs.
    later = wait_job(d, a["id"], lambda j: j["progress"]["steps_done"]
                     > running["progress"]["steps_done"], what="A to step on")
    assert later["status"] == "running"

    # Cancelling the queued B moves C up; B never started.
    r = d.client.delete(JOBS + b["id"])
    assert r.status_code == 200, r.text
    cb = wait_job(d, b["id"], status_is("cancelled"), what="B cancelled")
    assert cb["started"] is None and cb["result"] is None
    assert cb["error"]["code"] == "cancelled"
    assert d.client.get(JOBS + c["id"]).json()["queue_position"] == 1

    # Cancelling the running A frees its KV at the next iteration, and C starts.
    m = d.metrics()
    assert m.get("arserve_kv_pool_reserved_bytes") > 0
    r = d.client.delete(JOBS + a["id"])
    assert r.status_code == 200, r.text
    ca = wait_job(d, a["id"], status_is("cancelled"), what="A cancelled")
    assert ca["error"]["code"] == "cancelled" and ca["completed"] is not None
    wait_job(d, c["id"], status_is("running", "done"), what="C to start after A's KV is freed")
    d.client.delete(JOBS + c["id"])
    m = d.wait_idle(what="every cancelled job's KV freed")
    assert m.get("arserve_requests_cancelled_total") >= 2
    assert m.get("arserve_async_jobs", state="cancelled") >= 2
    # The cancelled jobs stay readable until their retention passes.
    assert d.client.get(JOBS + a["id"]).json()["status"] == "cancelled"


# ---- expired: the job's deadline -------------------------------------------

def test_job_past_its_deadline_is_expired(start_daemon):
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--request-timeout-s", "1", "--max-n", "8"])
    # Eight images: seconds of work against a one-second deadline.
    job = submit(d, {"prompt": "a red circle", "seed": 1, "n": 8}).json()
    ended = wait_job(d, job["id"], status_is(*ENDED), what="the job to end")
    assert ended["status"] == "expired", ended
    assert ended["error"]["code"] == "timeout" and ended["result"] is None
    d.wait_metrics(lambda m: m.get("arserve_kv_pool_reserved_bytes") == 0
                   and m.get("arserve_async_jobs", state="expired") == 1,
                   what="the expired job's KV freed and counted")


# ---- retention: forgotten after it, then 404 ---------------------------------

def test_ended_job_is_forgotten_after_retention_then_404(start_daemon):
    d = start_daemon(args=["--async-retention-s", "1"])
    job = submit(d, {"prompt": "a red circle"}).json()
    wait_job(d, job["id"], status_is("done"), what="the job done")
    limit = scaled(10)
    deadline = time.monotonic() + limit
    while (r := d.client.get(JOBS + job["id"])).status_code == 200:
        assert time.monotonic() < deadline, f"still kept {limit:.1f} s later: {r.text}"
        time.sleep(0.05)
    err = assert_error(r, 404, "job_not_found", "id")
    assert "async_retention_s" in err["message"]
    assert d.client.delete(JOBS + job["id"]).status_code == 404
    m = d.metrics()
    assert m.get("arserve_async_jobs_forgotten_total", reason="expired") == 1
    assert m.get("arserve_async_jobs", state="done") == 0


def test_delete_forgets_an_ended_job_at_once(tiny_daemon):
    d = tiny_daemon
    job = submit(d, {"prompt": "a red circle"}).json()
    wait_job(d, job["id"], status_is("done"), what="the job done")
    r = d.client.delete(JOBS + job["id"])
    assert r.status_code == 200, r.text
    assert r.json() == {"id": job["id"], "object": "image.generation.job", "status": "done",
                        "deleted": True}
    assert_error(d.client.get(JOBS + job["id"]), 404, "job_not_found")


# ---- the store's bound -----------------------------------------------------

def test_full_store_refuses_with_429_until_jobs_are_forgotten(start_daemon):
    d = start_daemon(SLOW_MODEL, [*BUSY_ARGS, "--async-max-jobs", "2",
                                  "--async-retention-s", "3", "--retry-after-s", "7"])
    a = submit(d, BUSY).json()
    b = submit(d, {"prompt": "a blue square", "seed": 2}).json()
    r = submit(d, {"prompt": "a green triangle"}, code=429)
    err = assert_error(r, 429, "job_store_full", "async")
    assert err["type"] == "rate_limit_error"
    assert "async_max_jobs" in err["message"] and "2 waiting or running" in err["message"]
    # A slot frees only once an ended job is forgotten: with none ended yet,
    # not before a whole retention (not --retry-after-s, the queue's hint).
    assert r.headers["retry-after"] == "3"
    assert "retry after 3 s" in err["message"]
    # Ended (here cancelled) jobs still hold their slots...
    for j in (a, b):
        assert d.client.delete(JOBS + j["id"]).status_code == 200
        wait_job(d, j["id"], status_is("cancelled"), what="the job cancelled")
    r = submit(d, {"prompt": "a green triangle"}, code=429)
    msg = r.json()["error"]["message"]
    assert "2 ended" in msg
    # ...and the answer says when the oldest is forgotten, in its header too.
    wait = int(r.headers["retry-after"])
    assert 1 <= wait <= 3 and f"the oldest ended one is forgotten in {wait} s" in msg, msg
    # ...until their retention passes: then there is room again.
    d.wait_metrics(lambda m: m.get("arserve_async_jobs_forgotten_total", reason="expired") == 2,
                   what="the cancelled jobs forgotten")
    c = submit(d, {"prompt": "a green triangle"}).json()
    d.client.delete(JOBS + c["id"])
    m = d.metrics()
    assert m.get("arserve_async_jobs_refused_total", reason="store_full") == 2
    assert m.get("arserve_async_jobs_max") == 2


# ---- ids -------------------------------------------------------------------

def test_ids_are_unguessable(tiny_daemon):
    d = tiny_daemon
    ids = [submit(d, {"prompt": "a red circle"}).json()["id"] for _ in range(40)]
    assert all(ID_RE.match(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    # 128 random bits: successive ids differ in about half of them, not in
    # the last few as a counter's would, and every hex digit turns up.
    bits = [bin(int(x[4:], 16) ^ int(y[4:], 16)).count("1") for x, y in zip(ids, ids[1:])]
    assert 48 < sum(bits) / len(bits) < 80, bits
    digits = Counter("".join(i[4:] for i in ids))
    assert len(digits) == 16 and max(digits.values()) < 3 * min(digits.values()), digits
    # Neighbours of a real id, and ids of another form, name nothing.
    real = ids[0]
    last = real[-1]
    for other in (real[:-1] + ("0" if last != "0" else "1"), real.upper(), real[4:], real + "0",
                  "job_" + "0" * 32, "1", "..%2F..%2Fhealth"):
        assert_error(d.client.get(JOBS + other), 404, "job_not_found")
    for i in ids:
        wait_job(d, i, status_is(*ENDED), what="the job to end")
        d.client.delete(JOBS + i)


# ---- refusals ----------------------------------------------------------------

def test_async_refusals_name_the_field(tiny_daemon):
    d = tiny_daemon
    err = assert_error(d.client.post(GEN, json={"prompt": "x", "async": True, "stream": True}),
                       400, "invalid_value", "async")
    assert "stream" in err["message"] and "async" in err["message"]
    assert_error(d.client.post(GEN, json={"prompt": "x", "async": "yes"}), 400, "invalid_type",
                 "async")
    assert_error(d.client.post(GEN, json={"prompt": "", "async": True}), 400,
                 "invalid_value", "prompt")
    r = d.client.post(JOBS + "job_" + "0" * 32, json={})
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET, HEAD, DELETE"
    assert_error(d.client.put(JOBS + "x"), 405, "method_not_allowed")
    assert_error(d.client.get(JOBS), 404, "job_not_found")


# ---- the API key ---------------------------------------------------------------

def test_jobs_obey_the_api_key(start_daemon):
    key = "s3cret-async"
    d = start_daemon(env={"ARSERVE_API_KEY": key})
    auth = {"Authorization": f"Bearer {key}"}
    wrong = {"Authorization": "Bearer nope"}
    assert_error(d.client.post(GEN, json={"prompt": "x", "async": True}), 401, "invalid_api_key")
    job = submit(d, {"prompt": "a red circle"}, headers=auth).json()
    for headers in ({}, wrong):
        assert_error(d.client.get(JOBS + job["id"], headers=headers), 401, "invalid_api_key")
        assert_error(d.client.delete(JOBS + job["id"], headers=headers), 401, "invalid_api_key")
    done = wait_job(d, job["id"], status_is("done"), headers=auth, what="the job done")
    assert done["result"]["data"]
    assert d.client.delete(JOBS + job["id"], headers=auth).status_code == 200


# ---- metrics ---------------------------------------------------------------------

def test_job_metrics_pass_promtool(start_daemon):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (Debian package 'prometheus'; `make deps`)")
    d = start_daemon(SLOW_MODEL, [*BUSY_ARGS, "--async-max-jobs", "3"])
    a = submit(d, BUSY).json()
    b = submit(d, {"prompt": "a blue square", "seed": 2}).json()
    wait_job(d, a["id"], status_is("running"), what="A running")
    m = d.wait_metrics(lambda m: m.get("arserve_async_jobs", state="running") == 1
                       and m.get("arserve_async_jobs", state="queued") == 1,
                       what="one running and one queued job counted")
    for state in ("done", "failed", "cancelled", "expired"):
        assert ("arserve_async_jobs", frozenset({("state", state)})) in m.samples
    assert m.get("arserve_async_jobs_created_total") == 2
    d.client.delete(JOBS + b["id"])
    wait_job(d, b["id"], status_is("cancelled"), what="B cancelled")
    text = d.client.get("/metrics").text
    p = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                       timeout=scaled(30), env=clean_env())
    out = (p.stdout + p.stderr).decode()
    assert p.returncode == 0 and not out.strip(), f"promtool:\n{out}\n--- metrics ---\n{text}"
    d.client.delete(JOBS + a["id"])


# ---- nothing leaks ---------------------------------------------------------------

def submit_many(d, n):
    """n async jobs on as many connections as fit; returns their ids."""
    with httpx.Client(base_url=d.url, timeout=d.client.timeout,
                      limits=httpx.Limits(max_connections=8)) as c:
        ids = []
        for i in range(n):
            r = c.post(GEN, json={"prompt": "a red circle", "seed": i, "async": True})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        return ids


def store_empty(expired):
    def pred(m):
        kept = sum(v for (name, _), v in m.samples.items() if name == "arserve_async_jobs")
        return kept == 0 and m.get("arserve_async_jobs_forgotten_total",
                                   reason="expired") == expired
    return pred


# A thousand images and two thousand requests: seconds on the release build.
# A sanitizer build (no jemalloc, so no allocator figures to hold) runs a
# hundred: what it adds is the race and leak checkers over the store and its
# sweeper, which a hundred jobs exercise as well (test_job_store.c counts a
# thousand through the store itself), at a tenth of ThreadSanitizer's two
# minutes.
@pytest.mark.timeout(120)
def test_thousand_expired_jobs_leave_nothing(start_daemon):
    d = start_daemon(args=["--async-retention-s", "1", "--async-max-jobs", "1024",
                           "--max-waiting", "1024"])
    alloc = "arserve_jemalloc_allocated_bytes"
    release = (alloc, frozenset()) in d.metrics().samples
    # The warm-up (the allocator's caches, the threads' stacks) is for the RSS
    # figures, which only the release build holds.
    warm = 100 if release else 0
    if warm:
        submit_many(d, warm)
        d.wait_metrics(store_empty(warm), timeout=60, what="the warm-up jobs forgotten")
        d.wait_idle()
    rss0 = d.rss_kib()
    m0 = d.metrics()
    n = 1000 if release else 100
    ids = submit_many(d, n)
    m = d.wait_metrics(store_empty(warm + n), timeout=100, what=f"{n} jobs forgotten")
    assert m.get("arserve_async_jobs_created_total") == warm + n
    for i in ids[:5] + ids[-5:]:
        assert_error(d.client.get(JOBS + i), 404, "job_not_found")
    d.wait_idle()
    if not release:
        return  # a sanitizer build: its allocator's RSS says nothing; the count above does
    # The store keeps nothing of a forgotten job: a thousand PNGs and job
    # records left behind would be megabytes.
    grown = d.metrics().get(alloc) - m0.get(alloc)
    assert grown < 2 << 20, f"jemalloc holds {grown} bytes more after a thousand jobs"
    growth = d.rss_kib() - rss0
    assert growth < 16 * 1024, f"RSS grew {growth} KiB over a thousand forgotten jobs"
    print(f"after a thousand forgotten jobs: {grown} bytes more allocated, RSS {growth:+d} KiB")
