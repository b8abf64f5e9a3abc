"""arserve_image_tokens_generated_total counts the image tokens generated: per
image, what each of its steps sampled. A raster step samples one token; a
next-scale step a whole scale, so n images of either family count n times the
model's image tokens (CFG's unconditional sequence only steers those tokens
and is not counted).

The next-scale model is ARSERVE_VAR_MODEL, else models/shapes-var."""
import json
import os

import pytest

from conftest import TINY_MODEL, repo_path

GEN = "/v1/images/generations"
VAR_MODEL = repo_path(os.environ.get("ARSERVE_VAR_MODEL") or "models/shapes-var")
TOKENS = "arserve_image_tokens_generated_total"


def image_tokens(model_dir):
    """An image's tokens from the model's arserve.json: a scale of side p holds
    p * p tokens; a raster grid grid_width * grid_height."""
    with open(os.path.join(model_dir, "arserve.json")) as f:
        image = json.load(f)["image"]
    if "scales" in image:
        return sum(p * p for p in image["scales"])
    return image["grid_width"] * image["grid_height"]


@pytest.mark.parametrize("model, body", [
    (VAR_MODEL, {"class_label": 1, "seed": 3}),
    (TINY_MODEL, {"prompt": "a red circle", "seed": 3}),
], ids=["next-scale", "raster"])
def test_tokens_counter_counts_every_image_token(start_daemon, model, body):
    n = 8
    d = start_daemon(model, ["--threads", "1", "--max-n", str(n)])
    before = d.metrics()
    r = d.client.post(GEN, json={**body, "n": n})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == n
    ok = before.get("arserve_images_total", status="ok")
    after = d.wait_metrics(lambda m: m.get("arserve_images_total", status="ok") - ok >= n,
                           timeout=10, what=f"{n} images counted ok")
    want = n * image_tokens(model)
    assert after.get(TOKENS) - before.get(TOKENS) == want, \
        f"{n} images of {image_tokens(model)} tokens each:\n{after.text}"
