"""Writes N captioned shapes samples, seeded, as npz shards (default) or PNG files.

    python -m tools.shapes.dataset --out build/shapes/train --n 20000 --seed 1
    python -m tools.shapes.dataset --out build/shapes/val --n 512 --seed 2
    python -m tools.shapes.dataset --out /tmp/pngs --n 16 --seed 3 --png
    python -m tools.shapes.dataset --out build/shapes/mix --n 20000 --seed 1 \
        --mix one=0.15,and=0.4,relation=0.15,count=0.2,three=0.1

npz layout: DIR/shard-00000.npz holds `images`, uint8 [n, 128, 128, 3], and
DIR/shard-00000.jsonl one record per image, in order:
    {"id": 0, "category": "position", "caption": "a red circle on the left",
     "spec": {...}, "objects": [{"shape", "colour", "size", "box": [x0, y0, x1, y1]}]}
(spec and objects: see tools/shapes/scene.py). With --png: DIR/00000000.png and
DIR/records.jsonl (each record also names its "file").

Shard k is drawn from numpy's default_rng([seed, k]), so a shard's content depends only
on the seed, the shard index and --shard-size; DIR/meta.json records the arguments. A shard's
two files are written through temporary names, the npz last, so a killed run leaves whole
shards only; with --resume the shards already there are kept (an interrupted run continues,
a finished one costs nothing), provided meta.json records the same arguments.
Needs numpy and Pillow.
"""

import argparse
import json
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.shapes import scene  # noqa: E402


def generate(seed, shard, n, mix=None):
    """n samples of shard `shard`: (records, images uint8 [n, 128, 128, 3]); mix: the
    caption kinds' shares (scene.sample_training_spec), None for the default."""
    rng = np.random.default_rng([seed, shard])
    records, images = [], np.zeros((n, scene.SIZE, scene.SIZE, 3), np.uint8)
    for i in range(n):
        rec, images[i] = scene.sample_training_scene(rng, mix)
        records.append(rec)
    return records, images


def load_shards(directory):
    """(records, images) of every npz shard in directory, in order."""
    names = sorted(f for f in os.listdir(directory)
                   if f.startswith("shard-") and f.endswith(".npz") and not f.endswith(".tmp.npz"))
    records, images = [], []
    for name in names:
        with np.load(os.path.join(directory, name)) as z:
            images.append(z["images"])
        with open(os.path.join(directory, name[:-4] + ".jsonl")) as f:
            records.extend(json.loads(line) for line in f)
    if not images:
        raise FileNotFoundError("no shard-*.npz in %s" % directory)
    return records, np.concatenate(images)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--png", action="store_true", help="write PNG files and records.jsonl")
    ap.add_argument("--resume", action="store_true",
                    help="keep the npz shards already in OUT (written by the same arguments)")
    ap.add_argument("--mix", default="",
                    help="shares of the caption kinds, KIND=WEIGHT,... (kinds: %s; default %s; "
                         "missing kinds weigh 0)" % (", ".join(scene.CAPTION_KINDS), ",".join(
                             "%s=%g" % kv for kv in scene.DEFAULT_MIX.items())))
    a = ap.parse_args(argv)
    mix = None
    if a.mix:
        try:
            mix = {k: float(v) for k, v in (part.split("=", 1) for part in a.mix.split(","))}
            scene.mix_thresholds(mix)
        except ValueError as e:
            ap.error("--mix %r: %s" % (a.mix, e if "=" in a.mix else "expected KIND=WEIGHT,..."))
    if a.resume and a.png:
        ap.error("--resume works on npz shards, not with --png")
    if a.n < 1 or a.shard_size < 1:
        ap.error("--n and --shard-size must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    meta = {"n": a.n, "seed": a.seed, "shard_size": a.shard_size, "png": a.png,
            "generator": "tools/shapes/dataset.py"}
    if mix is not None:
        meta["mix"] = mix
    meta_path = os.path.join(a.out, "meta.json")
    if a.resume and os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if old != meta:
            sys.exit("dataset.py: %s holds a dataset made with %s, not %s; use another --out"
                     % (a.out, json.dumps(old), json.dumps(meta)))
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    from PIL import Image

    done = 0
    jl = open(os.path.join(a.out, "records.jsonl"), "w") if a.png else None
    for shard in range((a.n + a.shard_size - 1) // a.shard_size):
        n = min(a.shard_size, a.n - done)
        base = os.path.join(a.out, "shard-%05d" % shard)
        if a.resume and os.path.exists(base + ".npz") and os.path.exists(base + ".jsonl"):
            done += n
            continue
        records, images = generate(a.seed, shard, n, mix)
        for i, r in enumerate(records):
            r["id"] = done + i
        if a.png:
            for r, im in zip(records, images):
                r["file"] = "%08d.png" % r["id"]
                Image.fromarray(im).save(os.path.join(a.out, r["file"]))
                jl.write(json.dumps(r) + "\n")
        else:
            with open(base + ".jsonl.tmp", "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
            np.savez_compressed(base + ".tmp.npz", images=images)
            os.replace(base + ".jsonl.tmp", base + ".jsonl")
            os.replace(base + ".tmp.npz", base + ".npz")
        done += n
        print("wrote %d / %d" % (done, a.n), flush=True)
    if jl:
        jl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
