"""`arserve generate --tokens-out / --teacher-force / --logits-out`: what a
comparison with a reference implementation needs. A run's tokens fed back
as teacher-forced tokens give the same image and, step for step, the same
logits; the files have the documented layout; bad input is refused with a
message naming the flag."""
import json
import os
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))
SHAPES = os.path.join(ROOT, "models", "shapes")
SHAPES_VAR = os.path.join(ROOT, "models", "shapes-var")


def generate(model, ask, tmp, name, *extra):
    png = os.path.join(tmp, name + ".png")
    p = subprocess.run([ARSERVE, "generate", "--model", model, *ask, "--seed", "3", "--threads",
                        "1", "-q", "-o", png, *extra], capture_output=True, text=True,
                       timeout=120)
    return p, png


def card(model):
    with open(os.path.join(model, "arserve.json")) as f:
        return json.load(f)


def test_raster_tokens_fed_back_give_the_same_image_and_logits(tmp_path):
    t, l1, l2 = (str(tmp_path / n) for n in ("tokens.bin", "run.f32", "forced.f32"))
    ask = ["--prompt", "a red circle"]
    p, png = generate(SHAPES, ask, tmp_path, "run", "--tokens-out", t, "--logits-out", l1)
    assert p.returncode == 0, p.stderr
    cfg = card(SHAPES)
    steps = cfg["image"]["grid_height"] * cfg["image"]["grid_width"]
    vocab = cfg["image"]["codebook_size"]
    tokens = np.fromfile(t, dtype="<i4")
    assert tokens.shape == (steps,) and tokens.min() >= 0 and tokens.max() < vocab
    logits = np.fromfile(l1, dtype="<f4").reshape(steps, 2, vocab)
    assert np.isfinite(logits).all() and not np.array_equal(logits[:, 0], logits[:, 1])
    q, forced_png = generate(SHAPES, ask, tmp_path, "forced", "--teacher-force", t,
                             "--logits-out", l2)
    assert q.returncode == 0, q.stderr
    assert open(png, "rb").read() == open(forced_png, "rb").read()
    assert open(l1, "rb").read() == open(l2, "rb").read()


def test_next_scale_teacher_forced_logits_have_every_scale(tmp_path):
    t, lg = str(tmp_path / "tokens.bin"), str(tmp_path / "forced.f32")
    ask = ["--class", "a red circle"]
    p, png = generate(SHAPES_VAR, ask, tmp_path, "run", "--tokens-out", t)
    assert p.returncode == 0, p.stderr
    cfg = card(SHAPES_VAR)
    per_scale = [s * s for s in cfg["image"]["scales"]]
    tokens = np.fromfile(t, dtype="<i4")
    assert tokens.shape == (sum(per_scale),)
    q, forced_png = generate(SHAPES_VAR, ask, tmp_path, "forced", "--teacher-force", t,
                             "--logits-out", lg)
    assert q.returncode == 0, q.stderr
    assert open(png, "rb").read() == open(forced_png, "rb").read()
    vocab = cfg["image"]["codebook_size"]
    logits = np.fromfile(lg, dtype="<f4")
    assert logits.size == 2 * sum(per_scale) * vocab
    # the last scale's two rows, each its own (the guidance row is not the conditional one)
    last = logits[-2 * per_scale[-1] * vocab:].reshape(2, per_scale[-1], vocab)
    assert np.isfinite(last).all() and not np.array_equal(last[0], last[1])


@pytest.mark.parametrize("model, ask, extra, want", [
    (SHAPES, ["--prompt", "a"], ["--teacher-force", "/nonexistent/t.bin"],
     "--teacher-force (as --tokens-out writes them): /nonexistent/t.bin: cannot open token file"),
    (SHAPES_VAR, ["--class", "1"], ["--logits-out", "x.f32"],
     "--logits-out: a next-scale model keeps a scale's logits only with --teacher-force"),
])
def test_bad_trace_flags_are_refused(tmp_path, model, ask, extra, want):
    p, _ = generate(model, ask, tmp_path, "x", *extra)
    assert p.returncode == 2 and want in p.stderr, p.stderr


def test_a_short_or_negative_token_file_is_refused(tmp_path):
    short = tmp_path / "short.bin"
    np.arange(10, dtype="<i4").tofile(short)
    p, _ = generate(SHAPES, ["--prompt", "a"], tmp_path, "x", "--teacher-force", str(short))
    assert p.returncode == 2, p.stderr
    assert f"{short} holds 40 bytes, fewer than the image's 256 int32 token values" in p.stderr
    long = tmp_path / "long.bin"
    np.zeros(257, dtype="<i4").tofile(long)
    p, _ = generate(SHAPES, ["--prompt", "a"], tmp_path, "x", "--teacher-force", str(long))
    assert p.returncode == 2 and "token file is 1028 bytes, more than the 1024" in p.stderr
    bad = tmp_path / "bad.bin"
    v = np.zeros(256, dtype="<i4")
    v[7] = -1
    v.tofile(bad)
    p, _ = generate(SHAPES, ["--prompt", "a"], tmp_path, "x", "--teacher-force", str(bad))
    assert p.returncode == 2 and "value 7 is -1, outside [0, 521)" in p.stderr, p.stderr
    v[7] = 521  # one past the codebook: it would index past the embedding
    v.tofile(bad)
    p, _ = generate(SHAPES, ["--prompt", "a"], tmp_path, "x", "--teacher-force", str(bad))
    assert p.returncode == 2 and "value 7 is 521, outside [0, 521)" in p.stderr, p.stderr
