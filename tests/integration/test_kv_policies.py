"""The planner's edge seen from outside: a KV pool too small for two
full-cache images admits two images concurrently under LineAR; the requests
ask for their policy through `kv_policy` / `kv_budget`.

Under the full cache a second image may still start before the first ends:
the planner admits it once the two trajectories (each growing by a token per
step) fit the pool together at every future step. So "concurrently" is read
from the queue: both LineAR requests start at once, while the second
full-cache one waits a good part of an image."""
import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import HTTP_TIMEOUT, SLOW_MODEL, png_size

GEN = "/v1/images/generations"
# The slow model (24x24 tokens, 4 layers x 4 heads x 64) holds about 9 MiB
# of KV per image with the full cache and about 2 MiB under LineAR at 1/6:
# a 12 MiB pool fits one full-cache image, or several LineAR ones.
POOL_MB = 12


def two_at_once(daemon, body):
    def one(seed):
        with httpx.Client(base_url=daemon.url, timeout=4 * HTTP_TIMEOUT) as c:
            return c.post(GEN, json=dict(body, seed=seed))

    before = daemon.metrics()
    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(one, (1, 2)))
    for r in responses:
        assert r.status_code == 200, r.text[:300]
    after = daemon.wait_metrics(lambda m: m.get("arserve_kv_pool_reserved_bytes") == 0,
                                timeout=10, what="the KV pool idle")
    waited = after.get("arserve_queue_wait_seconds_sum") - before.get("arserve_queue_wait_seconds_sum")
    shared = after.histogram_above("arserve_iteration_sequences", 2) - \
        before.histogram_above("arserve_iteration_sequences", 2)
    return responses, waited, shared, after


@pytest.mark.timeout(180)
def test_small_pool_runs_two_linear_images_at_once_but_one_full(start_daemon):
    d = start_daemon(model=SLOW_MODEL, args=("--kv-pool-mb", str(POOL_MB), "--threads", "1",
                                             "--max-running", "4"))
    # Full cache: the second image waits until the first is far enough on.
    responses, waited_full, _, _ = two_at_once(d, {"prompt": "a red circle", "kv_policy": "full"})
    steps = 24 * 24
    responses, waited_linear, shared, after = two_at_once(
        d, {"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 1 / 6})
    for r in responses:
        b64 = r.json()["data"][0]["b64_json"]
        assert png_size(base64.b64decode(b64)) == (96, 96)
    # Both LineAR images stepped together (the second arrives a few
    # iterations after the first: two client threads do not start at once).
    assert shared > steps // 2, f"only {shared} shared iterations:\n" + after.text
    assert waited_full > 0.5 + waited_linear, (waited_full, waited_linear)
    assert after.get("arserve_kv_plan_overruns_total") == 0


def test_policy_that_does_not_fit_the_grid_is_a_400_naming_it(start_daemon):
    d = start_daemon(model=SLOW_MODEL, args=("--threads", "1"))
    # 1/24 of 24 lines is one line: too small for one anchor and two recent lines.
    r = d.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "linear",
                                 "kv_budget": 1 / 24})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_policy" and "budget" in err["message"], err
