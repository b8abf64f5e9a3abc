"""An Infinity-architecture model (text-to-image next-scale: T5 encoder,
cross-attention, bitwise tokens, a schedule per aspect ratio) served end to
end: its sizes in /v1/models, two aspect ratios and a negative prompt in one
batch with each image's planned KV peak equal to what it held, each image
equal to itself alone, and clear 400s for a size, a prompt or a negative
prompt the model cannot take.

The model is ARSERVE_INFINITY_MODEL, else the golden tiny random model
(tests/golden/infinity_tiny: the official code's configuration, so its
images are noise; what is checked is the serving)."""
import base64
import json
import os
import shutil
import subprocess

import openai
import pytest

from conftest import ARSERVE_BIN, HTTP_TIMEOUT, Daemon, b64_png_size, clean_env, repo_path
from test_heatkv_admission import iterations_above, send_together
from test_streaming import read_sse

GEN = "/v1/images/generations"
MODEL = repo_path(os.environ.get("ARSERVE_INFINITY_MODEL") or "tests/golden/infinity_tiny")


def model_sizes():
    """Each size's name, pixels and image tokens, the default first, as
    arserve.json lists them."""
    with open(os.path.join(MODEL, "arserve.json")) as f:
        cfg = json.load(f)
    im, up = cfg["image"], 2 if cfg["image"]["spatial_patchify"] else 1
    stride = up * 2 ** (len(cfg["decoder"]["channel_multiplier"]) - 1)
    sizes = {}
    for z in im["sizes"]:
        h, w = z["scales"][-1]
        sizes[z["name"]] = {"width": w * stride, "height": h * stride,
                            "tokens": sum(a * b for a, b in z["scales"])}
    default = im["default_size"]
    order = [default] + [n for n in sizes if n != default]
    return cfg, {n: sizes[n] for n in order}


CFG, SIZES = model_sizes()
DEFAULT = next(iter(SIZES))
# Two sizes of different aspect ratios: the default and the widest.
WIDE = max(SIZES, key=lambda n: SIZES[n]["width"] / SIZES[n]["height"])


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    daemon = Daemon(str(tmp_path_factory.mktemp("arserve")), MODEL, ["--threads", "1"])
    yield daemon
    daemon.finish()


def error_of(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_models_lists_every_size_the_default_first(d):
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    assert card["conditioning"] == "text"
    assert card["sizes"] == list(SIZES)
    assert (card["width"], card["height"]) == (SIZES[DEFAULT]["width"], SIZES[DEFAULT]["height"])


def test_policies_that_need_a_calibration_are_not_listed_without_one(d):
    """The model without a calibration: HeatKV and ScaleKV run at none of its sizes, so its
    card leaves them out; the others run everywhere and name no sizes."""
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    names = [p["name"] for p in card["kv_policies"]]
    assert "full" in names and "streaming" in names, names
    assert "heatkv" not in names and "scalekv" not in names, names
    assert all("sizes" not in p for p in card["kv_policies"]), card["kv_policies"]


def test_two_sizes_and_a_negative_prompt_in_one_batch(d):
    """Three requests sent together (two aspect ratios, one with a negative
    prompt) run in shared iterations; each PNG has its size's pixels, each
    response its size's tokens, each image's planned KV peak is the peak it
    held, and each image is what it is alone."""
    bodies = [{"prompt": "a dog", "size": DEFAULT, "seed": 1},
              {"prompt": "a dog", "size": WIDE, "seed": 2},
              {"prompt": "a golden dragon", "size": WIDE, "seed": 3,
               "negative_prompt": "dark blurry"}]
    responses, before, after, _ = send_together(d, bodies)
    assert [r.status_code for r in responses] == [200] * 3, [r.text[:300] for r in responses]
    assert iterations_above(before, after, 1) > 0, \
        "no iteration advanced two images at once:\n" + after.text
    assert after.get("arserve_kv_plan_overruns_total") == \
        before.get("arserve_kv_plan_overruns_total")
    tokens = 0
    for body, r in zip(bodies, responses):
        j, z = r.json(), SIZES[body["size"]]
        assert j["size"] == body["size"]
        assert b64_png_size(j["data"][0]["b64_json"]) == (z["width"], z["height"])
        assert j["usage"]["output_tokens"] == z["tokens"]
        kv = j["kv_cache"]
        assert kv["planned_peak_bytes"] == kv["peak_bytes"] > 0, kv
        tokens += z["tokens"]
    assert after.get("arserve_image_tokens_generated_total") - \
        before.get("arserve_image_tokens_generated_total") == tokens
    # Each image is what it is alone: the batch changes nothing.
    for body, r in zip(bodies, responses):
        alone = d.client.post(GEN, json=body)
        assert alone.status_code == 200, alone.text
        assert base64.b64decode(alone.json()["data"][0]["b64_json"]) == \
            base64.b64decode(r.json()["data"][0]["b64_json"]), f"{body} differs alone"


def test_a_size_the_model_lacks_is_a_400_listing_its_sizes(d):
    e = error_of(d.client.post(GEN, json={"prompt": "a dog", "size": "65x65"}))
    assert e["param"] == "size"
    assert all(name in e["message"] for name in SIZES), e["message"]
    # A size it does not have is answered with the nearest it has: the
    # closest aspect ratio, then the closest area.
    for asked, nearest in (("65x65", "64x64"), ("80x40", "88x44"), ("30x100", "36x108")):
        e = error_of(d.client.post(GEN, json={"prompt": "a dog", "size": asked}))
        assert f"the nearest is {nearest};" in e["message"], (asked, e["message"])


def test_a_prompt_past_the_text_limit_is_a_400_naming_it(d):
    limit = CFG["text"]["max_tokens"]
    # Past the model's limit, and past the rows a raster prompt may have
    # (1024; 2,000 one-letter words fit the 4,096-byte prompt): either way the
    # limit named is the text encoder's.
    for prompt in (" ".join(["dragon"] * (4 * limit)), " ".join(["a"] * 2000)):
        e = error_of(d.client.post(GEN, json={"prompt": prompt}))
        assert e["param"] == "prompt"
        assert f"more than the model's limit {limit}" in e["message"], e["message"]
    e = error_of(d.client.post(GEN, json={"prompt": "a dog",
                                          "negative_prompt": " ".join(["blurry"] * (4 * limit))}))
    assert e["param"] == "negative_prompt" and f"limit {limit}" in e["message"], e


def test_negative_prompt_is_refused_by_a_model_without_one(tiny_daemon):
    e = error_of(tiny_daemon.client.post(GEN, json={"prompt": "a red circle",
                                                    "negative_prompt": "blue"}))
    assert e["param"] == "negative_prompt"
    assert "takes none" in e["message"]


def test_stream_previews_at_a_wide_size_and_the_openai_client(d):
    """Previews decode the scales so far at the request's own size; the
    official openai client passes size and negative_prompt through."""
    body = {"prompt": "a dog", "size": WIDE, "seed": 9, "stream": True, "partial_images": 3}
    events = read_sse(d, body)
    names = [e for e, _ in events]
    partials = [p for e, p in events if e == "image_generation.partial_image"]
    assert [p["partial_image_index"] for p in partials] == [0, 1, 2], names
    done = events[-1]
    assert done[0] == "image_generation.completed", names
    assert done[1]["usage"]["output_tokens"] == SIZES[WIDE]["tokens"]
    z = SIZES[WIDE]
    for b in [p["b64_json"] for p in partials] + [done[1]["b64_json"]]:
        assert b64_png_size(b) == (z["width"], z["height"])
    plain = d.client.post(GEN, json={k: v for k, v in body.items()
                                     if k not in ("stream", "partial_images")})
    assert plain.json()["data"][0]["b64_json"] == done[1]["b64_json"]
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", timeout=HTTP_TIMEOUT,
                           max_retries=0)
    r = client.images.generate(model=CFG["name"], prompt="a dog", size=WIDE,
                               extra_body={"seed": 9, "negative_prompt": "dark blurry"})
    assert b64_png_size(r.data[0].b64_json) == (z["width"], z["height"])
    assert r.data[0].b64_json != plain.json()["data"][0]["b64_json"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A copy of the model calibrated by `arserve calibrate` from two text
    prompts, served."""
    root = tmp_path_factory.mktemp("calibrated")
    model = root / "model"
    model.mkdir()
    for name in os.listdir(MODEL):
        if name.endswith((".json", ".safetensors")) and name != "golden.safetensors":
            shutil.copy(os.path.join(MODEL, name), model / name)
    (model / "kv_calibration.json").unlink(missing_ok=True)
    prompts = root / "prompts.txt"
    prompts.write_text("a dog\n# a comment\na golden dragon\n")
    out = subprocess.run([ARSERVE_BIN, "calibrate", "--model", str(model), "--prompts",
                          str(prompts), "--threads", "1"], env=clean_env(), capture_output=True,
                         text=True, timeout=HTTP_TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert "2 generations, 3 sink scales" in out.stdout, out.stdout
    daemon = Daemon(str(root), str(model), ["--threads", "1"])
    yield daemon
    daemon.finish()


def test_a_calibrated_model_serves_heatkv_and_scalekv(calibrated):
    """HeatKV (both variants) and ScaleKV on Infinity with its calibration:
    each image's measured KV peak is its plan and under the full cache's; a
    size the calibration lacks is refused, saying how to add it."""
    full = calibrated.client.post(GEN, json={"prompt": "a dog", "seed": 1})
    assert full.status_code == 200, full.text
    full_peak = full.json()["kv_cache"]["peak_bytes"]
    for policy in ("heatkv", "heatkv_binary", "scalekv"):
        r = calibrated.client.post(GEN, json={"prompt": "a dog", "seed": 1, "kv_policy": policy,
                                              "kv_budget": 0.4})
        assert r.status_code == 200, (policy, r.text)
        j = r.json()
        kv = j["kv_cache"]
        assert kv["policy"] == policy, kv
        assert kv["planned_peak_bytes"] == kv["peak_bytes"] < full_peak, (policy, kv, full_peak)
        assert b64_png_size(j["data"][0]["b64_json"]) == \
            (SIZES[DEFAULT]["width"], SIZES[DEFAULT]["height"])
    if WIDE == DEFAULT:
        return  # a model of one size (models/shapes-inf): no other size to refuse
    # The model card says where they run: the calibrated size only.
    card = calibrated.client.get("/v1/models").json()["data"][0]["arserve"]
    where = {p["name"]: p.get("sizes") for p in card["kv_policies"]}
    assert where["heatkv"] == where["scalekv"] == [DEFAULT] and where["full"] is None, where
    r = calibrated.client.post(GEN, json={"prompt": "a dog", "size": WIDE, "kv_policy": "heatkv",
                                          "kv_budget": 0.4})
    e = error_of(r)
    assert e["param"] == "kv_policy" and "calibration at this image size" in e["message"] and \
        "arserve calibrate" in e["message"] and "--size" in e["message"], e
