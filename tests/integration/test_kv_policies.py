"""The planner's edge seen from outside: a KV pool too small for two
full-cache images admits two images concurrently under LineAR; the requests
ask for their policy through `kv_policy` / `kv_budget`. Then the policy
knobs: each a request field that reaches the planner and the engine (the
response's `kv_cache` reports the planned and the measured peak), bad values
and knobs of another policy are 400s naming the field, and the daemon's
config sets the default policy, budget and knobs.

Under the full cache a second image may still start before the first ends:
the planner admits it once the two trajectories (each growing by a token per
step) fit the pool together at every future step. So "concurrently" is read
from the queue: both LineAR requests start at once, while the second
full-cache one waits a good part of an image."""
import base64
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import (ARSERVE_BIN, HTTP_TIMEOUT, SLOW_MODEL, TINY_MODEL, clean_env,
                      one_image_pool_mb, png_size, scaled)

GEN = "/v1/images/generations"


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
    # A pool that holds one full-cache image with 10-50% to spare (the slow
    # model's 24x24 grid holds about a fifth of that under LineAR at 1/6), so
    # it fits several LineAR images at once.
    pool_mb = one_image_pool_mb(SLOW_MODEL)
    d = start_daemon(model=SLOW_MODEL, args=("--kv-pool-mb", str(pool_mb), "--threads", "1",
                                             "--max-running", "4"))
    # Full cache: the second image waits until the first is far enough on:
    # two growing full-cache trajectories fit the pool only when the second
    # starts more than half of the first's 576 steps later, so they share
    # fewer than half of the 576 iterations.
    responses, waited_full, shared_full, _ = two_at_once(
        d, {"prompt": "a red circle", "kv_policy": "full"})
    steps = 24 * 24
    responses, waited_linear, shared, after = two_at_once(
        d, {"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 1 / 6})
    for r in responses:
        b64 = r.json()["data"][0]["b64_json"]
        assert png_size(base64.b64decode(b64)) == (96, 96)
    # Both LineAR images stepped together (the second arrives a few
    # iterations after the first: two client threads do not start at once).
    assert shared > steps // 2, f"only {shared} shared iterations:\n" + after.text
    # Counted in iterations, not seconds: how long an iteration takes is
    # the machine's business.
    assert shared_full < steps // 2, f"{shared_full} shared iterations under the full cache"
    assert waited_full > waited_linear, (waited_full, waited_linear)
    assert after.get("arserve_kv_plan_overruns_total") == 0


def test_policy_that_does_not_fit_the_grid_is_a_400_naming_it(start_daemon):
    d = start_daemon(model=SLOW_MODEL, args=("--threads", "1"))
    # 1/24 of 24 lines is one line: too small for one anchor and two recent lines.
    r = d.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "linear",
                                 "kv_budget": 1 / 24})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_budget" and "budget" in err["message"], err
    assert "anchor_lines" in err["message"] and "recent_lines" in err["message"], err


def tiny_bytes_per_token():
    """KV bytes one cached token costs an image of the tiny model: K and V,
    fp32, every layer and head, both rows of the CFG pair. Its pool blocks
    hold one token each (an 8 x 8 grid), so the peak counts tokens exactly."""
    with open(os.path.join(TINY_MODEL, "arserve.json")) as f:
        llm = json.load(f)["llm"]
    return 2 * llm["num_layers"] * llm["num_kv_heads"] * llm["head_dim"] * 2 * 4


def kv_cache(r):
    assert r.status_code == 200, r.text
    return r.json()["kv_cache"]


def test_knobs_reach_the_planner_and_the_engine(start_daemon):
    d = start_daemon(args=("--threads", "1"))
    # HeadKV on the 8 x 8 grid at 1/2: 32 image tokens per global head, so a
    # grouping length above that is the peak (every head holds it before
    # the first compression): 10 more tokens there, 10 more per head.
    base = {"prompt": "a red circle", "seed": 3, "kv_policy": "headkv", "kv_budget": 0.5,
            "headkv_local_window": 16}
    a = kv_cache(d.client.post(GEN, json=dict(base, headkv_group_tokens=40)))
    b = kv_cache(d.client.post(GEN, json=dict(base, headkv_group_tokens=50)))
    assert a["policy"] == "headkv" and a["budget"] == 0.5, a
    assert a["headkv_group_tokens"] == 40 and b["headkv_group_tokens"] == 50, (a, b)
    assert a["headkv_local_window"] == 16 and a["headkv_buffer"] == 8, a
    for k in (a, b):  # what the engine held is what the planner reserved
        assert k["peak_bytes"] == k["planned_peak_bytes"] > 0, k
    assert b["peak_bytes"] - a["peak_bytes"] == 10 * tiny_bytes_per_token(), (a, b)

    # LineAR at 1/4 of 8 lines keeps 2: too few for the default 1 anchor +
    # 2 recent lines, enough for 0 + 1.
    small = {"prompt": "a red circle", "seed": 3, "kv_policy": "linear", "kv_budget": 0.25}
    r = d.client.post(GEN, json=small)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget", r.text
    k = kv_cache(d.client.post(GEN, json=dict(small, anchor_lines=0, recent_lines=1)))
    assert (k["anchor_lines"], k["recent_lines"]) == (0, 1), k
    assert k["peak_bytes"] == k["planned_peak_bytes"], k
    full = kv_cache(d.client.post(GEN, json={"prompt": "a red circle", "seed": 3}))
    assert full["policy"] == "full" and "budget" not in full, full
    assert k["peak_bytes"] < full["peak_bytes"] == full["planned_peak_bytes"], (k, full)
    assert d.metrics().get("arserve_kv_plan_overruns_total") == 0


BAD_KNOBS = [
    ({"kv_policy": "headkv", "headkv_alpha": 2}, "headkv_alpha", "invalid_value"),
    ({"kv_policy": "headkv", "headkv_threshold": 0}, "headkv_threshold", "invalid_value"),
    ({"kv_policy": "headkv", "headkv_buffer": 1.5}, "headkv_buffer", "invalid_type"),
    ({"kv_policy": "headkv", "headkv_group_tokens": "100"}, "headkv_group_tokens", "invalid_type"),
    ({"kv_policy": "linear", "anchor_lines": -1}, "anchor_lines", "invalid_value"),
    ({"kv_policy": "streaming", "sink_tokens": 70000}, "sink_tokens", "invalid_value"),
    # a knob of another policy than the request's (or, without kv_policy, the default: full)
    ({"kv_policy": "linear", "sink_tokens": 4}, "sink_tokens", "invalid_value"),
    ({"recent_lines": 1}, "recent_lines", "invalid_value"),
    # values in range that do not suit the model: the scheduler names the knob
    ({"kv_policy": "headkv", "kv_budget": 0.5, "headkv_local_window": 30},
     "headkv_local_window", "invalid_value"),
]


@pytest.mark.parametrize("extra,param,code", BAD_KNOBS, ids=[b[1] + "-" + str(i) for i, b in
                                                            enumerate(BAD_KNOBS)])
def test_bad_knob_is_a_400_naming_it(tiny_daemon, extra, param, code):
    r = tiny_daemon.client.post(GEN, json=dict({"prompt": "a red circle"}, **extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert param in err["message"], err


def test_config_sets_the_default_policy_budget_and_knobs(start_daemon, tmp_path):
    config = tmp_path / "arserve.json"
    config.write_text(json.dumps({"kv_policy": "linear", "kv_budget": 0.25, "anchor_lines": 0,
                                  "recent_lines": 1}))
    d = start_daemon(args=("--config", str(config), "--threads", "1"),
                     env={"ARSERVE_HEADKV_GROUP_TOKENS": "40"})
    k = kv_cache(d.client.post(GEN, json={"prompt": "a red circle", "seed": 1}))
    assert (k["policy"], k["budget"], k["anchor_lines"], k["recent_lines"]) == \
        ("linear", 0.25, 0, 1), k
    k = kv_cache(d.client.post(GEN, json={"prompt": "a red circle", "recent_lines": 2,
                                          "kv_budget": 0.5}))
    assert (k["budget"], k["anchor_lines"], k["recent_lines"]) == (0.5, 0, 2), k
    # Another policy takes the config's budget and its own knobs from the config.
    k = kv_cache(d.client.post(GEN, json={"prompt": "a red circle", "kv_policy": "headkv",
                                          "kv_budget": 0.5, "headkv_local_window": 16}))
    assert k["headkv_group_tokens"] == 40 and k["peak_bytes"] == k["planned_peak_bytes"], k
    r = d.client.post(GEN, json={"prompt": "a red circle", "sink_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sink_tokens", r.text
    assert "default is linear" in r.json()["error"]["message"], r.text
    assert 'policy="linear"' in d.metrics().text  # arserve_build_info


def test_default_policy_that_does_not_fit_the_model_stops_start_up():
    p = subprocess.run([ARSERVE_BIN, "serve", "--model", TINY_MODEL, "--port", "0",
                        "--kv-policy", "linear", "--kv-budget", "1/4"],
                       env=clean_env(), capture_output=True, text=True, timeout=scaled(30))
    assert p.returncode == 2, p.stderr
    assert "kv_budget" in p.stderr and "anchor_lines" in p.stderr, p.stderr
