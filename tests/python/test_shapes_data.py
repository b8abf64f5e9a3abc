"""The shapes dataset is a function of its seed: the same seed gives the same bytes in any
process, whatever Python's string hash seed (PYTHONHASHSEED) is there."""
import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Digest of a shard's records and images, printed by a fresh interpreter.
DIGEST = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from tools.shapes import dataset
records, images = dataset.generate(7, 0, 400)
h = hashlib.sha256(json.dumps(records, sort_keys=True).encode())
h.update(images.tobytes())
print(h.hexdigest(), sum(r["category"] == "three_objects" for r in records))
"""


def digest(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    out = subprocess.run([sys.executable, "-c", DIGEST, ROOT], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


def test_same_seed_same_bytes_across_hash_seeds():
    runs = [digest(s) for s in (1, 2, 3)]
    assert runs[0][1] > 10, "the sample must hold three-object scenes (the order-sensitive case)"
    assert len({d for d, _ in runs}) == 1, runs
    assert hashlib.sha256(b"").hexdigest() not in {d for d, _ in runs}


def test_resume_keeps_whole_shards_and_remakes_missing_ones(tmp_path):
    """dataset.py --resume (the training pipeline's data stage): shards already written are
    kept as they are, a missing one is drawn again to the same bytes, a leftover temporary
    file is not read as a shard, and a directory made with other arguments is refused."""
    sys.path.insert(0, ROOT)
    from tools.shapes import dataset

    out = str(tmp_path / "d")
    args = ["--out", out, "--n", "5", "--seed", "3", "--shard-size", "2"]
    assert dataset.main(args) == 0
    _, first = dataset.load_shards(out)
    kept = os.path.join(out, "shard-00000.npz")
    stamp = os.stat(kept).st_mtime_ns
    os.remove(os.path.join(out, "shard-00001.npz"))
    open(os.path.join(out, "shard-00002.tmp.npz"), "wb").close()  # what a kill leaves
    assert dataset.main(args + ["--resume"]) == 0
    assert os.stat(kept).st_mtime_ns == stamp, "a whole shard was written again"
    _, again = dataset.load_shards(out)
    assert again.shape == (5, 128, 128, 3) and (again == first).all()
    try:
        dataset.main(["--out", out, "--n", "5", "--seed", "4", "--shard-size", "2", "--resume"])
    except SystemExit as e:
        assert "made with" in str(e.code), e.code
    else:
        raise AssertionError("--resume into a dataset of another seed was not refused")


def test_caption_mix_shares_and_default():
    """--mix (issue 40's data mix): the default mix draws exactly what no mix draws (the
    shipped model's data stays reproducible), and a mix weighted towards 'and' captions and
    counts yields those categories in about its shares; bad mixes are refused by name."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import pytest

    from tools.shapes import scene

    def categories(mix, n=3000):
        rng = np.random.default_rng(5)
        return [scene.sample_training_spec(rng, mix)[0] for _ in range(n)]

    assert categories(None, 500) == categories(dict(scene.DEFAULT_MIX), 500)
    base, mixed = categories(None), categories({"and": 3, "count": 1})
    share = lambda cats, names: sum(c in names for c in cats) / len(cats)  # noqa: E731
    # 'and' captions are color_attr, two_object or counting; counts are counting
    assert share(mixed, ("color_attr", "two_object", "counting")) == 1.0
    assert share(mixed, ("two_object",)) > 2.5 * share(base, ("two_object",))
    assert abs(share(mixed, ("color_attr",)) - 0.75 * 0.75) < 0.04  # with colour: 3 in 4
    assert share(mixed, ("single_object", "position", "three_objects")) == 0.0
    # 'plain': one object, its shape and perhaps its size, never a colour or a place
    rng = np.random.default_rng(6)
    plain = [scene.sample_training_spec(rng, {"plain": 1}) for _ in range(300)]
    assert {c for c, _ in plain} == {"single_object"}
    assert all(set(sp["objects"][0]) <= {"shape", "size"} for _, sp in plain)
    assert 0.55 < sum("size" in sp["objects"][0] for _, sp in plain) / 300 < 0.8
    assert share(categories({"one": 1, "plain": 1}), ("single_object",)) > 0.5
    for bad, word in (({"four": 1}, "four"), ({"one": -1}, ">= 0"), ({"one": 0}, "not all 0")):
        with pytest.raises(ValueError, match=word):
            scene.mix_thresholds(bad)


def test_default_colour_draws_uncoloured_objects_in_it():
    """sample_training_scene(default_colour=...): objects the caption leaves uncoloured are
    drawn in that colour, named colours stay, the caption is the same words; None draws them
    at random as before."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import pytest

    from tools.shapes import scene

    uncoloured = named = 0
    for i in range(200):
        rec, _ = scene.sample_training_scene(np.random.default_rng([9, i]), {"plain": 1, "and": 1}, "black")
        plain, _ = scene.sample_training_scene(np.random.default_rng([9, i]), {"plain": 1, "and": 1})
        assert rec["caption"] == plain["caption"] and rec["spec"] == plain["spec"]
        for want, got in zip(rec["spec"]["objects"], rec["objects"]):
            if "colour" in want:
                named += 1
                assert got["colour"] == want["colour"], rec
            else:
                uncoloured += 1
                assert got["colour"] == "black", rec
    assert uncoloured > 100 and named > 50, (uncoloured, named)
    colours = {o["colour"] for i in range(100) for o in scene.sample_training_scene(
        np.random.default_rng([9, i]), {"plain": 1})[0]["objects"]}
    assert len(colours) > 4, colours  # without a default, at random
    with pytest.raises(ValueError, match="mauve"):
        scene.sample_training_scene(np.random.default_rng(1), None, "mauve")


def test_default_position_places_a_lone_object_without_one():
    """default_position: a lone object whose caption names no place is drawn there (the centre:
    its box's centre within the centre's jitter); named places, counts and relations keep
    theirs; an unknown place is refused."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import pytest

    from tools.shapes import scene

    placed = kept = 0
    for i in range(300):
        rec, _ = scene.sample_training_scene(np.random.default_rng([4, i]), {"plain": 1, "one": 1, "count": 1},
                                             None, "centre")
        base, _ = scene.sample_training_scene(np.random.default_rng([4, i]), {"plain": 1, "one": 1, "count": 1})
        assert rec["caption"] == base["caption"]
        objs = rec["spec"]["objects"]
        if len(rec["objects"]) == 1 and "position" not in objs[0]:
            placed += 1
            x0, y0, x1, y1 = rec["objects"][0]["box"]
            assert abs((x0 + x1) / 2 - 64) < 16 and abs((y0 + y1) / 2 - 64) < 16, rec
        else:
            kept += 1
            assert rec["objects"] == base["objects"], (rec, base)
    assert placed > 80 and kept > 80, (placed, kept)
    with pytest.raises(ValueError, match="middle"):
        scene.sample_training_scene(np.random.default_rng(1), None, None, "middle")


def test_default_pair_places_two_objects_without_places():
    """default_pair=(a, b): two objects whose caption names no place and no relation ('and'
    captions, a count of two) are drawn the first at a, the second at b (caption order); a
    caption with places, a relation or three objects keeps its scene; a bad pair is refused."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import pytest

    from tools.shapes import scene

    mix = {"and": 2, "count": 1, "relation": 1}
    placed = kept = counts = 0
    for i in range(300):
        rec, _ = scene.sample_training_scene(np.random.default_rng([6, i]), mix, None, None, ("left", "right"))
        base, _ = scene.sample_training_scene(np.random.default_rng([6, i]), mix)
        assert rec["caption"] == base["caption"] and rec["spec"] == base["spec"]
        spec = rec["spec"]
        if (len(rec["objects"]) == 2 and "relation" not in spec
                and not any("position" in o for o in spec["objects"])):
            placed += 1
            counts += len(spec["objects"]) == 1
            (a0, _, a1, _), (b0, _, b1, _) = (o["box"] for o in rec["objects"])
            assert (a0 + a1) / 2 < 0.31 * 128 and (b0 + b1) / 2 > 0.69 * 128, rec
            for want, got in zip([o for o in spec["objects"] for _ in range(o.get("count", 1))], rec["objects"]):
                assert got["shape"] == want["shape"] and got["colour"] == want.get("colour", got["colour"]), rec
        else:
            kept += 1
            assert rec["objects"] == base["objects"], (rec, base)
    assert placed > 60 and counts > 10 and kept > 60, (placed, counts, kept)
    for bad in (("left", "left"), ("left", "middle"), ("left",)):
        with pytest.raises(ValueError, match="default pair"):
            scene.sample_training_scene(np.random.default_rng(1), None, None, None, bad)


def test_dataset_mix_flag(tmp_path):
    """dataset.py --mix is recorded in meta.json (so --resume refuses another mix) and a
    malformed one is a usage error naming the flag."""
    import json

    out = tmp_path / "d"
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "tools.shapes.dataset", "--out", str(out), "--n", "8", "--seed", "1",
         "--shard-size", "8", "--resume", *extra], cwd=ROOT, capture_output=True, text=True)
    assert run("--mix", "and=1").returncode == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mix"] == {"and": 1.0}
    with open(out / "shard-00000.jsonl") as f:
        cats = {json.loads(line)["category"] for line in f}
    assert cats <= {"color_attr", "two_object", "counting"}, cats
    again = run("--mix", "one=1")
    assert again.returncode != 0 and "holds a dataset made with" in again.stderr
    bad = run("--mix", "one")
    assert bad.returncode == 2 and "--mix" in bad.stderr, bad.stderr
