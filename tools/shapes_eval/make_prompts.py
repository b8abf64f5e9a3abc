"""Writes the standard ShapesEval prompt set (seeded), one JSON object per line:

    {"id": 0, "category": "single_object", "prompt": "a small circle",
     "spec": {"objects": [{"shape": "circle", "size": "small"}], "total": 1}}

    python tools/shapes_eval/make_prompts.py --seed 0 --per-category 50 \\
        --out tools/shapes_eval/prompts.jsonl

Categories (GenEval's six): single_object (one object of a shape, optionally sized, and
nothing else), two_object (two different shapes, optionally sized, and nothing else),
counting (exactly two or three of a shape, optionally coloured), colors (one object of a
shape and colour, nothing else), position (half absolute: a coloured shape in a region;
half relative: a coloured shape left of / right of / above / below another), color_attr
(two different shapes with two different colours, each bound to its own shape).
Prompts cycle through the categories (id % 6 follows the order above), so any prefix of
6k prompts has k of each. Within a category, every candidate spec is listed, shuffled
with the seed, and taken in order (cycling if the category has fewer candidates).
Prompt text is tools/shapes/scene.caption(spec).
"""

import argparse
import itertools
import json
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.shapes import scene as S  # noqa: E402
from tools.shapes_eval.scorer import CATEGORIES  # noqa: E402

SIZE_OPTS = [None, "small", "large"]


def _o(**kw):
    return {k: v for k, v in kw.items() if v is not None}


def candidates(category):
    if category == "single_object":
        return [{"objects": [_o(shape=s, size=z)], "total": 1} for s in S.SHAPES for z in SIZE_OPTS]
    if category == "two_object":
        return [{"objects": [_o(shape=a, size=za), _o(shape=b, size=zb)], "total": 2}
                for a, b in itertools.permutations(S.SHAPES, 2) for za in SIZE_OPTS for zb in SIZE_OPTS]
    if category == "counting":
        return [{"objects": [_o(shape=s, colour=c, count=n)]}
                for s in S.SHAPES for n in (2, 3) for c in [None] + S.COLOURS]
    if category == "colors":
        return [{"objects": [{"shape": s, "colour": c}], "total": 1} for s in S.SHAPES for c in S.COLOURS]
    if category == "position_absolute":
        return [{"objects": [{"shape": s, "colour": c, "position": p}]}
                for s in S.SHAPES for c in S.COLOURS for p in S.POSITIONS]
    if category == "position_relative":
        return [{"objects": [{"shape": a, "colour": ca}, {"shape": b, "colour": cb}],
                 "relation": {"a": 0, "rel": r, "b": 1}}
                for a in S.SHAPES for b in S.SHAPES for ca, cb in itertools.permutations(S.COLOURS, 2)
                for r in S.RELATIONS]
    if category == "color_attr":
        return [{"objects": [{"shape": a, "colour": ca}, {"shape": b, "colour": cb}]}
                for a, b in itertools.permutations(S.SHAPES, 2) for ca, cb in itertools.permutations(S.COLOURS, 2)]
    raise ValueError(category)


def make(seed, per_category, exclude=()):
    """per_category prompts of each category; captions in `exclude` are left out of a
    category's candidates unless that would leave it none (single_object and colors have
    fewer candidates than the standard set takes, so it holds them all)."""
    rng = np.random.default_rng(seed)
    exclude = set(exclude)

    def candidates_left(category):
        cand = candidates(category)
        kept = [s for s in cand if S.caption(s) not in exclude]
        return kept or cand

    pools = {}
    for c in CATEGORIES:
        if c == "position":
            absolute, relative = candidates_left("position_absolute"), candidates_left("position_relative")
            rng.shuffle(absolute)
            rng.shuffle(relative)
            # alternate: absolute, relative, absolute, ...
            pools[c] = [(absolute, relative)[i % 2][i // 2] for i in range(per_category)]
        else:
            cand = candidates_left(c)
            rng.shuffle(cand)
            pools[c] = [cand[i % len(cand)] for i in range(per_category)]
    out = []
    for i in range(per_category):
        for c in CATEGORIES:
            spec = pools[c][i]
            out.append({"id": len(out), "category": c, "prompt": S.caption(spec), "spec": spec})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-category", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"))
    ap.add_argument("--exclude", default=None,
                    help="a prompts.jsonl whose captions to leave out where a category has others "
                         "(a sweep set apart from the standard prompts)")
    a = ap.parse_args(argv)
    exclude = []
    if a.exclude:
        with open(a.exclude) as f:
            exclude = [json.loads(line)["prompt"] for line in f if line.strip()]
    prompts = make(a.seed, a.per_category, exclude)
    with open(a.out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print("wrote %d prompts to %s" % (len(prompts), a.out))


if __name__ == "__main__":
    main()
