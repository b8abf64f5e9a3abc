"""ShapesEval scorer validation (numpy + Pillow only, no torch; a few seconds).

The scorer must accept the renderer's own images of the standard prompt set (>= 99%),
and reject scenes that are wrong in colour, count, position or shape.

    python -m pytest tests/python/test_shapes_eval.py -q
"""

import copy
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.shapes import dataset  # noqa: E402
from tools.shapes import scene as S  # noqa: E402
from tools.shapes_eval import scorer  # noqa: E402
from tools.shapes_eval import make_prompts  # noqa: E402
from tools.shapes_eval.__main__ import main as cli_main  # noqa: E402

PROMPTS = os.path.join(ROOT, "tools", "shapes_eval", "prompts.jsonl")


@pytest.fixture(scope="module")
def prompts():
    return scorer.load_prompts(PROMPTS)


def _score(scene, spec):
    return scorer.score_image(S.render(scene), spec)[0]


def test_prompt_set_is_the_committed_seeded_set(prompts):
    assert prompts == json.loads(json.dumps(make_prompts.make(0, 50)))
    assert len(prompts) == 300
    for c in scorer.CATEGORIES:
        assert sum(p["category"] == c for p in prompts) == 50
    for p in prompts:
        assert p["prompt"] == S.caption(p["spec"])


def test_sweep_set_leaves_out_the_standard_captions_where_a_category_has_others(prompts):
    standard = {p["prompt"] for p in prompts}
    sweep = make_prompts.make(1, 16, standard)
    assert len(sweep) == 96
    shared = {c: sum(p["category"] == c and p["prompt"] in standard for p in sweep) for c in scorer.CATEGORIES}
    # single_object (12 candidates) and colors (32) are wholly inside the standard 50 each.
    assert shared == {c: (16 if c in ("single_object", "colors") else 0) for c in scorer.CATEGORIES}
    assert len({p["prompt"] for p in sweep if p["category"] == "counting"}) == 16


def test_scorer_accepts_ground_truth(prompts):
    rng = np.random.default_rng(7)
    results = []
    for p in prompts:
        ok = _score(S.realise(p["spec"], rng), p["spec"])
        results.append({"category": p["category"], "correct": ok})
    table, overall, images = scorer.summarise(results)
    assert images >= 0.99, scorer.format_table(table, overall, images)
    for c in scorer.CATEGORIES:
        assert table[c][2] >= 0.96, scorer.format_table(table, overall, images)


def test_scorer_accepts_training_scenes():
    """Training samples, checked against their own captions' specs."""
    records, images = dataset.generate(seed=11, shard=0, n=120)
    correct = sum(scorer.score_image(im, r["spec"])[0] for r, im in zip(records, images))
    assert correct >= 0.99 * len(records)


def test_detections_match_the_scene():
    rng = np.random.default_rng(3)
    for _ in range(40):
        _, spec = S.sample_training_spec(rng)
        scene = S.realise(spec, rng)
        dets = scorer.detect(S.render(scene))
        got = sorted((d["shape"], d["colour"], d["size"]) for d in dets)
        want = sorted((o["shape"], o["colour"], o["size"]) for o in scene)
        assert got == want
        for o in scene:  # each object's box centre within 1.5 px of a detection's
            c = ((o["box"][0] + o["box"][2]) / 2, (o["box"][1] + o["box"][3]) / 2)
            assert min(np.hypot(d["centre"][0] - c[0], d["centre"][1] - c[1]) for d in dets) < 1.5


def _other(seq, value, rng):
    return [v for v in seq if v != value][int(rng.integers(len(seq) - 1))]


def test_rejects_wrong_colour(prompts):
    rng = np.random.default_rng(8)
    n = 0
    for p in prompts:
        spec = p["spec"]
        o = spec["objects"][0]
        if "colour" not in o:
            continue
        scene = S.realise(spec, rng)
        scene[0]["colour"] = _other(S.COLOURS, o["colour"], rng)
        assert not _score(scene, spec), p["prompt"]
        n += 1
    assert n >= 100


def test_rejects_wrong_shape(prompts):
    rng = np.random.default_rng(9)
    for p in prompts:
        spec = p["spec"]
        scene = S.realise(spec, rng)
        if sum(1 for o in scene if o["shape"] == scene[0]["shape"]) > 1 and "count" not in spec["objects"][0]:
            continue  # another object still satisfies the spec
        scene[0]["shape"] = _other(S.SHAPES, scene[0]["shape"], rng)
        assert not _score(scene, spec), p["prompt"]


def test_rejects_wrong_count(prompts):
    rng = np.random.default_rng(10)
    n = 0
    for p in prompts:
        spec = p["spec"]
        if p["category"] == "counting":
            for delta in (-1, 1):
                wrong = copy.deepcopy(spec)
                wrong["objects"][0]["count"] += delta
                wrong["objects"][0].setdefault("size", "small")
                scene = S.realise(wrong, rng)
                assert not _score(scene, spec), (p["prompt"], delta)
                n += 1
        elif "total" in spec:
            # one object too many: an extra object of a shape the spec does not name
            scene = S.realise(spec, rng)
            named = {o["shape"] for o in spec["objects"]}
            extra = {"objects": [{"shape": [s for s in S.SHAPES if s not in named][0], "size": "small"}]
                     + [dict(o) if "size" in o else dict(o, size="small") for o in spec["objects"]]}
            scene = S.realise(extra, rng)
            assert not _score(scene, spec), p["prompt"]
            # and one too few
            if len(spec["objects"]) > 1:
                scene = S.realise(spec, rng)[1:]
                assert not _score(scene, spec), p["prompt"]
            n += 1
    assert n >= 150


OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def test_rejects_swapped_positions(prompts):
    rng = np.random.default_rng(11)
    n_rel = n_abs = 0
    for p in prompts:
        spec = p["spec"]
        if spec.get("relation"):
            scene = S.realise(spec, rng)
            a, b = scene[0]["box"], scene[1]["box"]
            ca = ((a[0] + a[2]) / 2, (a[1] + a[3]) / 2)
            cb = ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2)
            ha, hb = (a[2] - a[0]) / 2, (b[2] - b[0]) / 2
            scene[0]["box"] = [cb[0] - ha, cb[1] - ha, cb[0] + ha, cb[1] + ha]
            scene[1]["box"] = [ca[0] - hb, ca[1] - hb, ca[0] + hb, ca[1] + hb]
            assert not _score(scene, spec), p["prompt"]
            n_rel += 1
        elif "position" in spec["objects"][0]:
            pos = spec["objects"][0]["position"]
            wrong = copy.deepcopy(spec)
            if pos == "centre":
                wrong["objects"][0]["position"] = ["left", "right", "top", "bottom"][int(rng.integers(4))]
            else:
                wrong["objects"][0]["position"] = OPPOSITE[pos]
            assert not _score(S.realise(wrong, rng), spec), p["prompt"]
            n_abs += 1
    assert n_rel >= 20 and n_abs >= 20


def test_components_8_connected():
    lab = np.zeros((6, 6), int)
    lab[0, 0] = lab[1, 1] = 1  # diagonal neighbours: one component
    lab[4, 4] = lab[4, 5] = 1  # another
    lab[0, 5] = 2  # another colour
    lab[1, 5] = 1  # touching colour 2 but a different colour: separate
    comp = scorer.components(lab)
    roots = {r for r in np.unique(comp) if r >= 0}
    assert len(roots) == 4
    assert comp[0, 0] == comp[1, 1] == 0
    assert comp[4, 4] == comp[4, 5]
    assert comp[0, 5] != comp[1, 5]
    assert (comp[lab == 0] == -1).all()


def test_specks_and_noise_are_ignored():
    rng = np.random.default_rng(12)
    spec = {"objects": [{"shape": "circle", "colour": "red"}, {"shape": "square", "colour": "blue"}]}
    img = S.render(S.realise(spec, rng)).astype(np.int16)
    img = img + rng.integers(-12, 13, img.shape)  # mild noise
    img[5:8, 5:8] = S.PALETTE["green"]  # a 9-pixel speck
    assert scorer.score_image(np.clip(img, 0, 255).astype(np.uint8), spec)[0]


def test_vocabulary_and_dataset():
    vocab = set(S.vocabulary())
    assert len(vocab) < 100
    rng = np.random.default_rng(13)
    for _ in range(2000):
        _, spec = S.sample_training_spec(rng)
        words = S.caption(spec).replace(",", " , ").split()
        assert set(words) <= vocab, words
    r1, i1 = dataset.generate(5, 2, 8)
    r2, i2 = dataset.generate(5, 2, 8)
    assert r1 == r2 and np.array_equal(i1, i2)
    assert i1.shape == (8, 128, 128, 3) and i1.dtype == np.uint8


def test_cli(tmp_path, capsys):
    from PIL import Image

    plist = scorer.load_prompts(PROMPTS)[:12]
    ptxt = tmp_path / "prompts.jsonl"
    ptxt.write_text("".join(json.dumps(p) + "\n" for p in plist))
    rng = np.random.default_rng(14)
    for p in plist[:11]:  # the last prompt has no image
        Image.fromarray(S.render(S.realise(p["spec"], rng))).save(tmp_path / ("%05d.png" % p["id"]))
    out_json = tmp_path / "r.json"
    assert cli_main(["score", "--images", str(tmp_path), "--prompts", str(ptxt), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "overall" in text
    r = json.loads(out_json.read_text())
    assert r["images"] == pytest.approx(11 / 12)


def test_colour_recall_counts_named_colours_whatever_the_shape():
    spec = {"objects": [{"shape": "circle", "colour": "red"}, {"shape": "square", "colour": "blue"}]}
    red_blob = [{"shape": "unknown", "colour": "red"}]
    assert scorer.colours_found(spec, red_blob) == 0.5
    assert scorer.colours_found(spec, red_blob + [{"shape": "triangle", "colour": "blue"}]) == 1.0
    assert scorer.colours_found(spec, []) == 0.0
    assert scorer.colours_found({"objects": [{"shape": "circle"}]}, red_blob) is None
    results = [{"colours_found": 0.5}, {"colours_found": None}, {"colours_found": 1.0}]
    assert scorer.colour_recall(results) == 0.75
    assert scorer.colour_recall([{"colours_found": None}]) == 0.0
