"""Captioned shapes: the palette, the scene specification, captions and the renderer.

A *spec* is what a caption says, as JSON (the scorer in tools/shapes_eval reads it):

    {"objects": [{"shape": "circle", "colour": "red", "size": "small",
                  "count": 2, "position": "left"}, ...],
     "relation": {"a": 0, "rel": "left_of", "b": 1},      # optional
     "total": 1}                                          # optional

Every key of an object but "shape" is optional. "count" (2 or 3) means exactly that many
objects match; without it at least one must. "position" is an absolute region of the image
(left, right, top, bottom, centre). "relation" relates some object matching objects[a] to
some object matching objects[b] (left_of, right_of, above, below). "total" is the exact
number of objects in the image.

A *scene* is what the renderer draws: a list of objects, each
{"shape", "colour", "size", "box": [x0, y0, x1, y1]} in pixels of the 128x128 image.
`realise(spec, rng)` draws a scene that satisfies a spec exactly (attributes the spec leaves
open are random, and there are no objects beyond those it describes); `render(scene)`
rasterises it; `caption(spec)` words it.

Geometry: every shape fills a square bounding box of side s (small: 20-28 px, large: 40-52
px): a circle of diameter s, an axis-aligned square, an isosceles triangle with its apex up
(base s, height s), a diamond (a square turned 45 degrees, s corner to corner). Objects do
not overlap (boxes at least GAP px apart). Rendering is 4x supersampled and box-filtered,
so edges are anti-aliased.
"""

import numpy as np
from PIL import Image, ImageDraw

SIZE = 128  # image side in pixels
BACKGROUND = (255, 255, 255)  # white

# Eight colours, pairwise at least 100 apart in RGB (Euclidean) and at least 200 from the
# background; the scorer segments by nearest palette colour.
PALETTE = {
    "red": (220, 30, 30),
    "orange": (250, 130, 20),
    "yellow": (240, 230, 40),
    "green": (30, 160, 60),
    "cyan": (30, 200, 220),
    "blue": (40, 70, 220),
    "purple": (140, 50, 180),
    "black": (25, 25, 25),
}
COLOURS = list(PALETTE)
SHAPES = ["circle", "square", "triangle", "diamond"]
PLURALS = {s: s + "s" for s in SHAPES}
SIZES = {"small": (20.0, 28.0), "large": (40.0, 52.0)}
SIZE_THRESHOLD = 34.0  # bounding-box side separating small from large
POSITIONS = ["left", "right", "top", "bottom", "centre"]
RELATIONS = ["left_of", "right_of", "above", "below"]
NUMBERS = {2: "two", 3: "three"}
GAP = 6.0  # minimum distance between two objects' boxes
MARGIN = 3.0  # minimum distance from a box to the image border
SUPERSAMPLE = 4

POSITION_PHRASE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "centre": "in the centre",
}
RELATION_PHRASE = {
    "left_of": "to the left of",
    "right_of": "to the right of",
    "above": "above",
    "below": "below",
}


def vocabulary():
    """Every word a caption can use, sorted (punctuation: ',' only)."""
    words = {"a", "an", "and", ","}
    words.update(COLOURS, SHAPES, PLURALS.values(), SIZES, NUMBERS.values())
    for phrase in list(POSITION_PHRASE.values()) + list(RELATION_PHRASE.values()):
        words.update(phrase.split())
    return sorted(words)


# ----------------------------------------------------------------------------- captions


def _noun_phrase(o, article=True):
    words = []
    if o.get("size"):
        words.append(o["size"])
    if o.get("colour"):
        words.append(o["colour"])
    n = o.get("count", 1)
    words.append(PLURALS[o["shape"]] if n > 1 else o["shape"])
    if n > 1:
        words.insert(0, NUMBERS[n])
    elif article:
        words.insert(0, "an" if words[0][0] in "aeiou" else "a")
    text = " ".join(words)
    if o.get("position"):
        text += " " + POSITION_PHRASE[o["position"]]
    return text


def caption(spec):
    """The caption of a spec: lowercase words separated by single spaces, ',' written
    after a word (a `Whitespace` pre-tokenizer splits it off), no final full stop."""
    objs = spec["objects"]
    rel = spec.get("relation")
    if rel:
        rest = [i for i in range(len(objs)) if i not in (rel["a"], rel["b"])]
        if rest:
            raise ValueError("a relation relates exactly the spec's two objects")
        return "%s %s %s" % (
            _noun_phrase(objs[rel["a"]]),
            RELATION_PHRASE[rel["rel"]],
            _noun_phrase(objs[rel["b"]]),
        )
    parts = [_noun_phrase(o) for o in objs]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


# ----------------------------------------------------------------------------- placement


def _region_ranges(position, s):
    """(x range, y range) of an object's centre for an absolute position."""
    lo, hi = s / 2 + MARGIN, SIZE - s / 2 - MARGIN
    mid = (0.38 * SIZE, 0.62 * SIZE)
    if position == "left":
        return (lo, 0.30 * SIZE), mid
    if position == "right":
        return (0.70 * SIZE, hi), mid
    if position == "top":
        return mid, (lo, 0.30 * SIZE)
    if position == "bottom":
        return mid, (0.70 * SIZE, hi)
    if position == "centre":
        return (0.44 * SIZE, 0.56 * SIZE), (0.44 * SIZE, 0.56 * SIZE)
    raise ValueError("unknown position %r" % position)


def relation_holds(rel, a, b):
    """Whether centre a = (x, y) is in relation rel to centre b: an offset of at least a
    tenth of the image along the relation's axis, and larger than the offset across it.
    The scorer uses the same test."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    if rel == "left_of":
        return dx > 0.1 * SIZE and abs(dx) > abs(dy)
    if rel == "right_of":
        return -dx > 0.1 * SIZE and abs(dx) > abs(dy)
    if rel == "above":
        return dy > 0.1 * SIZE and abs(dy) > abs(dx)
    if rel == "below":
        return -dy > 0.1 * SIZE and abs(dy) > abs(dx)
    raise ValueError("unknown relation %r" % rel)


def _relation_clear(rel, a, b):
    """Stricter than relation_holds, for drawing: at least 0.3 of the image along the axis
    and at most 0.12 across it."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    along, across = {"left_of": (dx, dy), "right_of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[rel]
    return along >= 0.3 * SIZE and abs(across) <= 0.12 * SIZE


def _apart(b1, b2):
    return (
        b1[2] + GAP <= b2[0]
        or b2[2] + GAP <= b1[0]
        or b1[3] + GAP <= b2[1]
        or b2[3] + GAP <= b1[1]
    )


def _box(cx, cy, s):
    return [cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2]


def realise(spec, rng, max_tries=2000):
    """A scene (list of objects) satisfying spec exactly. rng: numpy Generator."""
    objs = spec["objects"]
    rel = spec.get("relation")
    for attempt in range(max_tries):
        # Later attempts prefer small sizes where the spec leaves size open.
        p_large = 0.5 if attempt < max_tries // 2 else 0.15
        items = []  # (spec index, object dict without box, centre ranges)
        for i, o in enumerate(objs):
            for _ in range(o.get("count", 1)):
                size = o.get("size") or ("large" if rng.random() < p_large else "small")
                colour = o.get("colour") or COLOURS[rng.integers(len(COLOURS))]
                items.append((i, {"shape": o["shape"], "colour": colour, "size": size}))
        placed = []
        ok = True
        for i, item in items:
            s = float(rng.uniform(*SIZES[item["size"]]))
            pos = objs[i].get("position")
            for _ in range(200):
                if pos:
                    (x0, x1), (y0, y1) = _region_ranges(pos, s)
                else:
                    x0 = y0 = s / 2 + MARGIN
                    x1 = y1 = SIZE - s / 2 - MARGIN
                cx, cy = float(rng.uniform(x0, x1)), float(rng.uniform(y0, y1))
                box = _box(cx, cy, s)
                if all(_apart(box, p[1]["box"]) for p in placed):
                    placed.append((i, dict(item, box=box)))
                    break
            else:
                ok = False
                break
        if not ok:
            continue
        if rel:
            ca = [_centre(o["box"]) for i, o in placed if i == rel["a"]]
            cb = [_centre(o["box"]) for i, o in placed if i == rel["b"]]
            if not _relation_clear(rel["rel"], ca[0], cb[0]):
                continue
        scene = [o for _, o in placed]
        for o in scene:
            o["box"] = [round(v, 2) for v in o["box"]]
        return scene
    raise RuntimeError("could not place the objects of %r" % (spec,))


def _centre(box):
    return ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)


# ----------------------------------------------------------------------------- rendering


def _outline(shape, box, k):
    x0, y0, x1, y1 = (v * k for v in box)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    if shape == "square":
        return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    raise ValueError(shape)


def render(scene, background=BACKGROUND):
    """uint8 array (SIZE, SIZE, 3) of the scene."""
    k = SUPERSAMPLE
    im = Image.new("RGB", (SIZE * k, SIZE * k), background)
    d = ImageDraw.Draw(im)
    for o in scene:
        col = PALETTE[o["colour"]]
        if o["shape"] == "circle":
            x0, y0, x1, y1 = (v * k for v in o["box"])
            d.ellipse([x0, y0, x1 - 1, y1 - 1], fill=col)
        else:
            d.polygon(_outline(o["shape"], o["box"], k), fill=col)
    return np.asarray(im.reduce(k), dtype=np.uint8).copy()


# ----------------------------------------------------------------------------- sampling


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _maybe(rng, p, value):
    return value if rng.random() < p else None


def _clean(o):
    return {k: v for k, v in o.items() if v is not None}


# The kinds of training caption and their shares (sample_training_spec): one object, two
# joined by 'and' (the colour-attribute and two-object categories, and counts of two), two
# in a relation, a count, three objects, and one object named by its shape alone with
# perhaps its size (ShapesEval's single-object prompts; not in the default mix).
CAPTION_KINDS = ("one", "and", "relation", "count", "three", "plain")
DEFAULT_MIX = {"one": 0.30, "and": 0.20, "relation": 0.22, "count": 0.16, "three": 0.12}


def mix_thresholds(mix):
    """The cumulative shares of CAPTION_KINDS but the last, from a dict of non-negative
    weights (missing kinds weigh 0; normalised to sum 1). ValueError names a bad kind."""
    bad = sorted(set(mix) - set(CAPTION_KINDS))
    if bad:
        raise ValueError("unknown caption kind %r (kinds: %s)" % (bad[0], ", ".join(CAPTION_KINDS)))
    w = [float(mix.get(k, 0.0)) for k in CAPTION_KINDS]
    if any(x < 0 or x != x for x in w) or sum(w) <= 0:
        raise ValueError("caption mix weights must be >= 0 and not all 0: %r" % (mix,))
    total, acc, out = sum(w), 0.0, []
    for x in w[:-1]:
        acc += x
        out.append(acc / total)
    return out


def sample_training_spec(rng, mix=None):
    """(category, spec) from the training caption distribution: one object (with or
    without colour, size, position), two objects joined by 'and' or by a relation, a
    count of two or three, or three objects, in the shares of mix (DEFAULT_MIX when None;
    see mix_thresholds). Attributes a caption leaves out are drawn at random when the scene
    is realised."""
    t = (0.30, 0.50, 0.72, 0.88) if mix is None else mix_thresholds(mix)
    u = rng.random()
    if u < t[0]:  # one object
        o = _clean({
            "shape": _pick(rng, SHAPES),
            "colour": _maybe(rng, 0.85, _pick(rng, COLOURS)),
            "size": _maybe(rng, 0.3, _pick(rng, list(SIZES))),
            "position": _maybe(rng, 0.5, _pick(rng, POSITIONS)),
        })
        return ("position" if "position" in o else "single_object"), {"objects": [o], "total": 1}
    if u < t[1]:  # two objects, 'and'
        s1, s2 = rng.choice(len(SHAPES), 2, replace=rng.random() < 0.2)
        with_colour = rng.random() < 0.75
        c1, c2 = rng.choice(len(COLOURS), 2, replace=False)
        objs = []
        for s, c in ((s1, c1), (s2, c2)):
            objs.append(_clean({
                "shape": SHAPES[s],
                "colour": COLOURS[c] if with_colour else None,
                "size": _maybe(rng, 0.2, _pick(rng, list(SIZES))),
            }))
        if not with_colour and s1 == s2:
            objs = [dict(objs[0], count=2)]
            objs[0].pop("size", None)
            return "counting", {"objects": objs, "total": 2}
        if rng.random() < 0.15:  # opposite absolute positions
            pair = ("left", "right") if rng.random() < 0.5 else ("top", "bottom")
            if rng.random() < 0.5:
                pair = pair[::-1]
            for o, p in zip(objs, pair):
                o["position"] = p
        return ("color_attr" if with_colour else "two_object"), {"objects": objs, "total": 2}
    if u < t[2]:  # two objects in a relation
        s1, s2 = rng.choice(len(SHAPES), 2, replace=True)
        c1, c2 = rng.choice(len(COLOURS), 2, replace=False)
        with_colour = rng.random() < 0.85
        if not with_colour and s1 == s2:
            with_colour = True
        objs = [
            _clean({"shape": SHAPES[s], "colour": COLOURS[c] if with_colour else None,
                    "size": _maybe(rng, 0.15, _pick(rng, list(SIZES)))})
            for s, c in ((s1, c1), (s2, c2))
        ]
        return "position", {"objects": objs, "relation": {"a": 0, "rel": _pick(rng, RELATIONS), "b": 1},
                            "total": 2}
    if u < t[3]:  # counting
        n = 2 if rng.random() < 0.55 else 3
        o = _clean({
            "shape": _pick(rng, SHAPES),
            "colour": _maybe(rng, 0.7, _pick(rng, COLOURS)),
            "size": _maybe(rng, 0.2, "small" if n == 3 else _pick(rng, list(SIZES))),
            "count": n,
        })
        return "counting", {"objects": [o], "total": n}
    if len(t) > 4 and u >= t[4]:  # one object named by its shape alone, maybe its size
        o = _clean({"shape": _pick(rng, SHAPES), "size": _maybe(rng, 2 / 3, _pick(rng, list(SIZES)))})
        return "single_object", {"objects": [o], "total": 1}
    # three objects, distinct (shape, colour) pairs
    pairs = set()
    while len(pairs) < 3:
        pairs.add((_pick(rng, SHAPES), _pick(rng, COLOURS)))
    # A set iterates in hash order, which differs between processes: sort first, so each
    # pair draws its random key in the same order everywhere.
    objs = [{"shape": s, "colour": c} for s, c in sorted(sorted(pairs), key=lambda _: rng.random())]
    return "three_objects", {"objects": objs, "total": 3}


def _place_pair(spec, pair):
    """spec with two objects whose caption names no place and no relation (two objects, or
    one counted two) placed at pair's two places, in the caption's order; any other spec as
    it is."""
    objs = spec["objects"]
    if "relation" in spec or any("position" in o for o in objs):
        return spec
    if len(objs) == 2 and not any("count" in o for o in objs):
        two = objs
    elif len(objs) == 1 and objs[0].get("count") == 2:
        one = {k: v for k, v in objs[0].items() if k != "count"}
        two = [one, one]
    else:
        return spec
    return dict(spec, objects=[dict(o, position=p) for o, p in zip(two, pair)])


def sample_training_scene(rng, mix=None, default_colour=None, default_position=None, default_pair=None):
    """A training sample: dict(category, caption, spec, scene) and the image (mix: as
    sample_training_spec). default_colour: the colour of every object its caption leaves
    uncoloured (None: drawn at random); default_position: the place of a lone object whose
    caption names none (one object, no count, no relation; None: at random); default_pair:
    two places, where two objects whose caption names no place and no relation are drawn,
    the first named at the first (None: at random). A model that samples each bit or token
    of a scale independently cannot commit to one of eight colours, or one of many places
    or layouts, nobody asked for, and draws nothing or pieces: a default gives it one."""
    category, spec = sample_training_spec(rng, mix)
    drawn = spec
    if default_colour is not None:
        if default_colour not in COLOURS:
            raise ValueError("default colour %r is not one of %s" % (default_colour, ", ".join(COLOURS)))
        drawn = dict(drawn, objects=[dict(o) if "colour" in o else dict(o, colour=default_colour)
                                     for o in drawn["objects"]])
    if default_position is not None:
        if default_position not in POSITIONS:
            raise ValueError("default position %r is not one of %s" % (default_position, ", ".join(POSITIONS)))
        lone = drawn["objects"][0]
        if (len(drawn["objects"]) == 1 and "relation" not in drawn and "count" not in lone
                and "position" not in lone):
            drawn = dict(drawn, objects=[dict(lone, position=default_position)])
    if default_pair is not None:
        pair = tuple(default_pair)
        if len(pair) != 2 or pair[0] == pair[1] or any(p not in POSITIONS for p in pair):
            raise ValueError("default pair %r is not two different places of %s"
                             % (default_pair, ", ".join(POSITIONS)))
        drawn = _place_pair(drawn, pair)
    scene = realise(drawn, rng)
    return {"category": category, "caption": caption(spec), "spec": spec, "objects": scene}, render(scene)
