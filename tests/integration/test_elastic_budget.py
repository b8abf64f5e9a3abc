"""Elastic KV budgets seen from outside: a request with a budget range
(`kv_budget_min` up to `kv_budget`) is admitted at the largest budget of it
whose whole KV trajectory fits the pool beside the running requests' plans,
so it runs at its top when the daemon is idle and below it when the pool is
busy, instead of waiting. The response's kv_cache says the budget it ran at
and the range; a stream says it in its first progress event, before any
step; /metrics counts admitted budgets per policy and admissions below the
top. Then the refusals, each a 400 naming kv_budget_min (or kv_policy), and
`kv_policy: "auto"`.

The busy case on the slow model (24 x 24 lines, 576 steps): a pool of about
1.6 full-cache images. A first ranged LineAR request [1/6, 1] arrives idle
and runs at 1 (the whole cache, a full-cache trajectory). A second, sent
once the first has run a few dozen steps, cannot run at 1: the two
trajectories would hold about 2 images' KV near the first's end. It fits at
some budget of about 0.6 or less (the first's remaining growth plus the
second's LineAR cache stay within 1.6 images), so it starts at once, below
its top, well before the first ends."""
import json
import subprocess
import threading

import httpx
import pytest

from conftest import (ARSERVE_BIN, HTTP_TIMEOUT, SLOW_MODEL, TINY_MODEL, clean_env,
                      full_image_kv_bytes, scaled)
from test_streaming import read_sse

GEN = "/v1/images/generations"
RANGE = {"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 1, "kv_budget_min": 1 / 6}


def pool_mb_for(model, low, high):
    """A whole-MiB pool between low and high full-cache images of model, or a skip."""
    image = full_image_kv_bytes(model)
    mb = -(-int(low * image) // (1 << 20))
    if (mb << 20) >= high * image:
        pytest.skip(f"no whole MiB pool lies between {low} and {high} images of {image} bytes")
    return mb


@pytest.mark.timeout(180)
def test_range_runs_at_its_top_when_idle_and_below_it_when_busy(start_daemon):
    d = start_daemon(model=SLOW_MODEL,
                     args=("--kv-pool-mb", str(pool_mb_for(SLOW_MODEL, 1.55, 1.75)),
                           "--threads", "1", "--max-running", "4"))
    first = {}

    def run_first():
        with httpx.Client(base_url=d.url, timeout=4 * HTTP_TIMEOUT) as c:
            first["r"] = c.post(GEN, json=dict(RANGE, seed=1))

    t = threading.Thread(target=run_first)
    t.start()
    try:
        # The first has been admitted and has run some steps: the pool is busy.
        d.wait_metrics(lambda m: m.get("arserve_requests_running") == 1
                       and m.get("arserve_iterations_total") >= 40,
                       timeout=30, what="the first request running")
        events = read_sse(d, dict(RANGE, seed=2, stream=True))
    finally:
        t.join(timeout=scaled(120))
    a = first["r"]
    assert a.status_code == 200, a.text[:300]
    top = a.json()["kv_cache"]
    assert top["policy"] == "linear" and top["budget"] == 1, top
    assert top["budget_range"] == [pytest.approx(1 / 6), 1], top

    progress = [p for e, p in events if e == "arserve.progress"]
    done = [p for e, p in events if e == "image_generation.completed"]
    assert len(done) == 1, [e for e, _ in events]
    kv = done[0]["kv_cache"]
    # Admitted below its top, not at its floor only because the floor fits:
    # the largest budget that fitted, somewhere inside the range.
    assert 1 / 6 <= kv["budget"] < 1, kv
    assert kv["budget_range"] == [pytest.approx(1 / 6), 1], kv
    assert kv["peak_bytes"] == kv["planned_peak_bytes"] < top["planned_peak_bytes"], (kv, top)
    # The stream said that budget before its first step.
    assert progress[0]["steps_done"] == 0, progress[0]
    assert progress[0]["kv_cache"] == {"policy": "linear", "budget": kv["budget"]}, progress[0]
    # It did not wait for the first to finish: it started at once.
    assert done[0]["timings"]["queue_s"] < a.json()["timings"]["run_s"] / 4, \
        (done[0]["timings"], a.json()["timings"])

    m = d.wait_idle()
    assert m.get("arserve_kv_budget_below_max_total", policy="linear") == 1, m.text
    assert m.get("arserve_kv_admitted_budget_ratio_count", policy="linear") == 2, m.text
    assert m.get("arserve_kv_admitted_budget_ratio_bucket", policy="linear", le="0.9") == 1, m.text
    assert m.get("arserve_kv_plan_overruns_total") == 0


@pytest.mark.parametrize("body, param, words", [
    # the floor below what LineAR's default knobs (1 anchor + 2 recent of 8 lines) take
    ({"kv_policy": "linear", "kv_budget": 1, "kv_budget_min": 0.1}, "kv_budget_min",
     "least budget linear takes"),
    ({"kv_policy": "linear", "kv_budget": 0.5, "kv_budget_min": 0.75}, "kv_budget_min",
     "above the range's top"),
    ({"kv_policy": "full", "kv_budget_min": 0.5}, "kv_budget_min", "full takes no budget"),
    ({"kv_policy": "linear", "kv_budget_min": 0}, "kv_budget_min", "greater than 0"),
    ({"kv_policy": "linear", "kv_budget_min": 2}, "kv_budget_min", "at most 1"),
])
def test_bad_ranges_are_400s_naming_the_field(tiny_daemon, body, param, words):
    r = tiny_daemon.client.post(GEN, json=dict(body, prompt="a red circle"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_one_point_range_runs_at_that_budget(tiny_daemon):
    """kv_budget_min equal to kv_budget: a range of one budget, not one whose
    floor is above its top."""
    r = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "linear",
                                           "kv_budget": 0.5, "kv_budget_min": 0.5})
    assert r.status_code == 200, r.text[:300]
    kv = r.json()["kv_cache"]
    assert kv["budget"] == 0.5 and kv["budget_range"] == [0.5, 0.5], kv


def test_auto_is_the_models_compressed_policy_from_its_least_budget_to_full(tiny_daemon):
    card = tiny_daemon.client.get("/v1/models").json()["data"][0]["arserve"]
    assert card["kv_policy_auto"] == "linear", card
    r = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "auto"})
    assert r.status_code == 200, r.text[:300]
    kv = r.json()["kv_cache"]
    # Idle: the top of the range, the whole cache; the floor is the least
    # LineAR takes on this request: a floor just below it is refused.
    assert kv["policy"] == "linear" and kv["budget"] == 1, kv
    least = kv["budget_range"][0]
    assert 0 < least < 1 and kv["budget_range"][1] == 1, kv
    body = {"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 1}
    r = tiny_daemon.client.post(GEN, json=dict(body, kv_budget_min=least))
    assert r.status_code == 200 and r.json()["kv_cache"]["budget_range"] == [least, 1], r.text[:300]
    r = tiny_daemon.client.post(GEN, json=dict(body, kv_budget_min=least - 0.01))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget_min", r.text
    # A range without its top given runs up to the policy's own budget:
    # linear's, 1/6, is below this floor.
    r = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "linear",
                                           "kv_budget_min": least})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget_min", r.text


def test_config_gives_each_policy_a_range(start_daemon):
    d = start_daemon(args=("--kv-policy", "linear", "--kv-budget", "1", "--kv-budget-min", "0.5",
                           "--kv-budget-ranges", "streaming=0.5:0.75"))
    r = d.client.post(GEN, json={"prompt": "a red circle"})
    assert r.status_code == 200, r.text[:300]
    kv = r.json()["kv_cache"]
    assert kv["policy"] == "linear" and kv["budget"] == 1 and kv["budget_range"] == [0.5, 1], kv
    # Naming the policy is the same as running it by default.
    kv = d.client.post(GEN, json={"prompt": "a red circle",
                                  "kv_policy": "linear"}).json()["kv_cache"]
    assert kv["budget"] == 1 and kv["budget_range"] == [0.5, 1], kv
    # Another policy's range, from kv_budget_ranges; its own floor up to the range's top.
    kv = d.client.post(GEN, json={"prompt": "a red circle",
                                  "kv_policy": "streaming"}).json()["kv_cache"]
    assert kv["policy"] == "streaming" and kv["budget"] == 0.75, kv
    assert kv["budget_range"] == [0.5, 0.75], kv
    kv = d.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "streaming",
                                  "kv_budget_min": 0.6}).json()["kv_cache"]
    assert kv["budget_range"] == [0.6, 0.75], kv
    # A request that sets its own budget has no range unless it asks.
    kv = d.client.post(GEN, json={"prompt": "a red circle", "kv_budget": 0.75}).json()["kv_cache"]
    assert kv["budget"] == 0.75 and "budget_range" not in kv, kv
    # GET /v1/models says each policy's range.
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    ranges = {p["name"]: p.get("budget_range") for p in card["kv_policies"]}
    assert ranges["linear"] == [0.5, 1] and ranges["streaming"] == [0.5, 0.75], ranges
    assert ranges["full"] is None and ranges["headkv"] is None, ranges


@pytest.mark.parametrize("args, words", [
    (("--kv-policy", "linear", "--kv-budget", "1", "--kv-budget-min", "0.1"),
     "kv_budget_min 0.1 does not suit model"),
    (("--kv-budget-ranges", "linear=0.1:1"), "kv_budget_ranges: linear=0.1:1 does not suit model"),
    (("--kv-budget-ranges", "streaming=0.9:0.5"), "streaming's MIN 0.9 is above its MAX 0.5"),
])
def test_config_range_the_policy_cannot_run_at_stops_start_up(tmp_path, args, words):
    p = subprocess.run([ARSERVE_BIN, "serve", "--model", TINY_MODEL, "--port", "0", *args],
                       capture_output=True, text=True, env=clean_env(), cwd=tmp_path,
                       timeout=scaled(60))
    assert p.returncode == 2, p.stderr
    assert words in p.stderr, p.stderr
