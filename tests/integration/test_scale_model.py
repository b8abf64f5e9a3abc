"""A next-scale (VAR-architecture, class-conditional) model served end to end:
classes in /v1/models, class_label as an index or a name, a prompt that names
a class, clear 400s for everything else, SSE previews at scale ends, the
openai client, and the KV policies a next-scale model takes.

The model is ARSERVE_VAR_MODEL (`make test-integration` sets it), else the
shipped multiscale demo model, models/shapes-var."""
import base64
import io
import json
import re
import os

import openai
import pytest
from PIL import Image

from conftest import HTTP_TIMEOUT, Daemon, b64_png_size, capacity_cells, repo_path
from test_streaming import read_sse

GEN = "/v1/images/generations"
VAR_MODEL = repo_path(os.environ.get("ARSERVE_VAR_MODEL") or "models/shapes-var")


def var_info():
    with open(os.path.join(VAR_MODEL, "arserve.json")) as f:
        cfg = json.load(f)
    scales = cfg["image"]["scales"]
    side = scales[-1] * 2 ** (len(cfg["decoder"]["channel_multiplier"]) - 1)
    names = None
    if cfg["condition"].get("class_names"):
        with open(os.path.join(VAR_MODEL, cfg["condition"]["class_names"])) as f:
            names = f.read().splitlines()
    return {"model": cfg["name"], "side": side, "scales": scales,
            "tokens": sum(p * p for p in scales), "classes": names,
            "num_classes": cfg["condition"]["num_classes"]}


INFO = var_info()


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    daemon = Daemon(str(tmp_path_factory.mktemp("arserve")), VAR_MODEL, ["--threads", "1"])
    yield daemon
    daemon.finish()


def png_of(b64):
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def error_of(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_capacity_line_tells_policies_that_do_not_apply_from_budgets_too_small(d):
    """On a next-scale model LineAR and HeadKV (lines of tokens) do not apply at
    all. HeatKV's own budget, 0.1, cannot keep its 3 sink scales whole on the
    demo's scales ("budget too small"), so its card sets 1/6; the tiny model
    of test_api shows the "budget too small" cell."""
    cells = capacity_cells(d.stderr())
    for name in ("linear", "headkv"):
        assert cells[name] == f"{name} n/a (does not apply to next-scale models)", cells
    with open(os.path.join(VAR_MODEL, "arserve.json")) as f:
        heatkv = json.load(f).get("kv_budgets", {}).get("heatkv", 0.1)
    assert re.fullmatch(rf"heatkv@{heatkv:.3g} [0-9]+", cells["heatkv"]), cells
    assert re.fullmatch(r"amskv [0-9]+", cells["amskv"]), cells  # it takes no budget
    for name in ("streaming", "heatkv_binary", "amskv", "scalekv"):
        assert "does not apply" not in cells[name], cells


def test_models_lists_the_classes(d):
    m = d.client.get("/v1/models").json()["data"][0]
    assert m["id"] == INFO["model"]
    assert m["num_classes"] == INFO["num_classes"]
    assert m["classes"] == INFO["classes"]


def test_class_by_index_by_name_and_by_prompt_agree(d):
    name = INFO["classes"][1]
    bodies = [{"class_label": 1, "seed": 5}, {"class_label": name, "seed": 5},
              {"prompt": name, "seed": 5}]
    images = []
    for body in bodies:
        r = d.client.post(GEN, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert b64_png_size(out["data"][0]["b64_json"]) == (INFO["side"], INFO["side"])
        assert out["usage"]["output_tokens"] == INFO["tokens"]
        images.append(out["data"][0]["b64_json"])
    assert images[0] == images[1] == images[2]
    other = d.client.post(GEN, json={"class_label": 0, "seed": 5}).json()["data"][0]["b64_json"]
    assert other != images[0], "another class, the same seed: another image"


@pytest.mark.parametrize("value,code", [(INFO["num_classes"], "invalid_value"), (-1, "invalid_value"),
                                        (1.5, "invalid_type"), (True, "invalid_type"),
                                        ("no such class", "invalid_value")])
def test_bad_class_label_is_a_400_naming_it(d, value, code):
    e = error_of(d.client.post(GEN, json={"class_label": value}))
    assert e["param"] == "class_label" and e["code"] == code, e
    assert f"0 to {INFO['num_classes'] - 1}" in e["message"] and "/v1/models" in e["message"]


def test_prompt_that_is_not_a_class_is_a_400(d):
    e = error_of(d.client.post(GEN, json={"prompt": "a red circle on the left of a cat"}))
    assert e["param"] == "prompt" and "class names" in e["message"], e
    assert "/v1/models" in e["message"]


def test_class_and_prompt_together_or_neither(d):
    e = error_of(d.client.post(GEN, json={"class_label": 0, "prompt": INFO["classes"][0]}))
    assert e["param"] == "class_label" and "not both" in e["message"], e
    e = error_of(d.client.post(GEN, json={"seed": 1}))
    assert e["code"] == "missing_required_parameter" and "class_label" in e["message"], e


def test_stream_previews_at_scale_ends(d):
    body = {"class_label": 2, "seed": 9, "stream": True, "partial_images": 3}
    events = read_sse(d, body)
    names = [e for e, _ in events]
    progress = [p for e, p in events if e == "arserve.progress"]
    assert progress and all(p["steps_total"] == len(INFO["scales"]) for p in progress), names
    partials = [p for e, p in events if e == "image_generation.partial_image"]
    assert [p["partial_image_index"] for p in partials] == [0, 1, 2], names
    done = events[-1]
    assert done[0] == "image_generation.completed"
    assert done[1]["usage"]["output_tokens"] == INFO["tokens"]
    # Each preview decodes the scales so far: they sharpen towards the image.
    finals = [p["b64_json"] for p in partials] + [done[1]["b64_json"]]
    assert len(set(finals)) == 4, "every preview and the image differ"
    for b in finals:
        assert png_of(b).size == (INFO["side"], INFO["side"])
    plain = d.client.post(GEN, json={"class_label": 2, "seed": 9}).json()["data"][0]["b64_json"]
    assert plain == done[1]["b64_json"], "streaming does not change the image"


def test_openai_client_with_a_class_prompt(d):
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", timeout=HTTP_TIMEOUT,
                           max_retries=0)
    r = client.images.generate(model=INFO["model"], prompt=INFO["classes"][0], n=2,
                               extra_body={"seed": 3})
    assert len(r.data) == 2 and r.data[0].b64_json != r.data[1].b64_json
    assert png_of(r.data[0].b64_json).size == (INFO["side"], INFO["side"])
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(model=INFO["model"], prompt="a cat")
    assert "class names" in str(e.value)


def test_kv_policies_on_a_next_scale_model(d):
    r = d.client.post(GEN, json={"class_label": 0, "seed": 2, "kv_policy": "full"})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_cache"]
    assert kv["peak_bytes"] == kv["planned_peak_bytes"] > 0, kv
    r = d.client.post(GEN, json={"class_label": 0, "seed": 2, "kv_policy": "streaming"})
    assert r.status_code == 200, r.text
    s = r.json()["kv_cache"]
    assert s["peak_bytes"] == s["planned_peak_bytes"] <= kv["peak_bytes"], s
    e = error_of(d.client.post(GEN, json={"class_label": 0, "kv_policy": "linear"}))
    assert e["param"] in ("kv_policy", None, ""), e
    assert "scale" in e["message"], e


def test_amskv_runs_within_its_plan_and_gives_back_what_it_did_not_need(d):
    """AMS-KV is planned as if every layer expands; a layer that stays at
    C_min frees the difference, which the planner takes back at once."""
    before = d.metrics().get("arserve_kv_plan_released_bytes_total")
    # The lowest threshold: no layer ever expands, so the plan tightens.
    r = d.client.post(GEN, json={"class_label": 1, "seed": 3, "kv_policy": "amskv",
                                 "amskv_threshold": -1e6})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_cache"]
    assert 0 < kv["peak_bytes"] < kv["planned_peak_bytes"], kv
    after = d.wait_metrics(lambda m: m.get("arserve_kv_pool_reserved_bytes") == 0,
                           timeout=10, what="the KV pool idle")
    assert after.get("arserve_kv_plan_released_bytes_total") > before, after.text
    assert after.get("arserve_kv_plan_overruns_total") == 0
    # Threshold 0: every layer expands, exactly the plan.
    r = d.client.post(GEN, json={"class_label": 1, "seed": 3, "kv_policy": "amskv",
                                 "amskv_threshold": 0})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_cache"]
    assert kv["peak_bytes"] == kv["planned_peak_bytes"], kv
    e = error_of(d.client.post(GEN, json={"class_label": 1, "kv_policy": "amskv",
                                          "amskv_max_scales": 0}))
    assert e["param"] == "amskv_min_scales", e
    e = error_of(d.client.post(GEN, json={"class_label": 1, "kv_policy": "heatkv",
                                          "amskv_threshold": -0.01}))
    assert e["param"] == "amskv_threshold", e


def test_scalekv_and_heatkv_run_exactly_their_plans(d):
    for body in ({"kv_policy": "scalekv", "kv_budget": 0.3, "scalekv_drafters": 0.25},
                 {"kv_policy": "heatkv", "kv_budget": 0.2},
                 {"kv_policy": "streaming", "kv_budget": 0.2, "sink_scales": 1}):
        r = d.client.post(GEN, json=dict(body, class_label=2, seed=4))
        assert r.status_code == 200, (body, r.text)
        kv = r.json()["kv_cache"]
        assert kv["peak_bytes"] == kv["planned_peak_bytes"] > 0, (body, kv)
    e = error_of(d.client.post(GEN, json={"class_label": 2, "kv_policy": "scalekv",
                                          "kv_budget": 0.001}))
    assert e["param"] == "kv_budget", e
    e = error_of(d.client.post(GEN, json={"class_label": 2, "kv_policy": "amskv",
                                          "scalekv_drafters": 0.5}))
    assert e["param"] == "scalekv_drafters", e
