"""A LlamaGen-architecture (raster family, class-to-image) model served end to end: the
golden tiny model of tests/golden/llamagen_tiny (random weights from the official classes),
given class names in a copy of its directory. Classes in /v1/models, the class as an index,
a name or a prompt naming it (as VAR models take it), every raster KV policy, and a clear
400 for a class outside the model's."""
import json
import os
import shutil

import pytest

from conftest import Daemon, b64_png_size, repo_path

GEN = "/v1/images/generations"
GOLDEN = repo_path("tests/golden/llamagen_tiny")
NAMES = ["tench", "goldfish", "white shark", "tiger shark", "hammerhead", "electric ray",
         "stingray", "cock", "hen", "ostrich"]


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    model = tmp_path_factory.mktemp("llamagen-model")
    with open(os.path.join(GOLDEN, "arserve.json")) as f:
        cfg = json.load(f)
    cfg["condition"]["class_names"] = "classes.txt"
    (model / "arserve.json").write_text(json.dumps(cfg))
    (model / "classes.txt").write_text("\n".join(NAMES) + "\n")
    shutil.copyfile(os.path.join(GOLDEN, "model.safetensors"), model / "model.safetensors")
    daemon = Daemon(str(tmp_path_factory.mktemp("arserve")), str(model), ["--threads", "1"])
    yield daemon
    daemon.finish()


def test_models_lists_the_classes(d):
    m = d.client.get("/v1/models").json()["data"][0]
    assert m["id"] == "llamagen-tiny-random"
    assert m["num_classes"] == 10 and m["classes"] == NAMES


def test_class_by_index_by_name_and_by_prompt_agree(d):
    images = []
    for body in ({"class_label": 3, "seed": 5}, {"class_label": NAMES[3], "seed": 5},
                 {"prompt": NAMES[3], "seed": 5}):
        r = d.client.post(GEN, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert b64_png_size(out["data"][0]["b64_json"]) == (32, 32)
        assert out["usage"]["output_tokens"] == 64
        images.append(out["data"][0]["b64_json"])
    assert images[0] == images[1] == images[2]
    other = d.client.post(GEN, json={"class_label": 4, "seed": 5}).json()["data"][0]["b64_json"]
    assert other != images[0], "another class, the same seed: another image"


@pytest.mark.parametrize("policy", ["full", "streaming", "linear", "headkv"])
def test_every_raster_policy_serves(d, policy):
    body = {"class_label": 1, "seed": 2, "kv_policy": policy}
    if policy != "full":
        body["kv_budget"] = 0.75  # an 8-line grid: the papers' budgets hold too few lines
    r = d.client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    assert b64_png_size(r.json()["data"][0]["b64_json"]) == (32, 32)


def test_a_class_outside_the_model_is_a_400(d):
    r = d.client.post(GEN, json={"class_label": 10})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "class_label"
    r = d.client.post(GEN, json={"prompt": "a red cat"})
    assert r.status_code == 400 and "class names" in r.json()["error"]["message"], r.text
