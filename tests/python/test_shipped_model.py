"""The shipped demo models load and draw, for a fixed prompt (or class) and seed on the CPU
backend, exactly the committed PNGs: models/shapes tests/golden/shapes/red_circle_left_seed1.png,
models/shapes-var tests/golden/shapes_var/red_circle_seed1.png, models/shapes-inf
tests/golden/shapes_inf/red_circle_seed1.png.

The command and its environment are tools/shapes_eval/make_expected.py's, which also
regenerates the PNG (`make expected-png`) when the model files change.

    ARSERVE_BIN=build/arserve python -m pytest tests/python/test_shipped_model.py -q
"""

import io
import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.shapes_eval import make_expected as E  # noqa: E402

ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))


def _why_different(m, got, want):
    """What changed, and what to do about it."""
    with open(os.path.join(ROOT, m.hashes)) as f:
        recorded = json.load(f)["files_sha256"]
    now = m.model_hashes()
    same_pixels = np.array_equal(np.asarray(Image.open(io.BytesIO(got)).convert("RGB")),
                                 np.asarray(Image.open(io.BytesIO(want)).convert("RGB")))
    head = "the PNG differs from %s (%s).\n" % (
        m.png, "same pixels, other PNG bytes: the PNG encoder or zlib changed"
        if same_pixels else "other pixels")
    if now != recorded:
        changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
        return head + (
            "The model files changed since it was made (%s): that is legitimate after "
            "retraining or re-exporting the model; regenerate it with `make expected-png` "
            "(tools/shapes_eval/make_expected.py) and commit the PNG and %s."
            % (", ".join(changed), m.hashes))
    if same_pixels:
        return head + (
            "The model files are the ones it was made from. If libpng or zlib differ from "
            "the CI image's (another distribution), that is the cause, not the engine.")
    return head + (
        "The model files are the ones it was made from, so the engine's output changed: "
        "a regression unless the change was meant. Only if it was, regenerate it with "
        "`make expected-png` and say why in the commit.")


@pytest.mark.parametrize("m", E.SHIPPED, ids=[m.model for m in E.SHIPPED])
def test_shipped_model_draws_the_expected_png(m, tmp_path):
    assert os.path.isfile(os.path.join(ROOT, m.model, "arserve.json")), \
        "%s/arserve.json is missing: the shipped model is not in this checkout" % m.model
    out = str(tmp_path / "out.png")
    r = m.generate(ARSERVE, out)
    assert r.returncode == 0, "%s failed (%d):\n%s" % (" ".join(m.command(ARSERVE, out)),
                                                        r.returncode, r.stderr)
    with open(out, "rb") as f:
        got = f.read()
    img = Image.open(io.BytesIO(got))
    assert (img.size, img.mode) == ((m.side, m.side), "RGB")
    with open(os.path.join(ROOT, m.png), "rb") as f:
        want = f.read()
    assert got == want, _why_different(m, got, want)
