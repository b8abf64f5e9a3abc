"""ShapesEval: scores images of the captioned-shapes world against their prompts' specs.

Pipeline, per image (numpy only; Pillow reads the PNGs):
1. Segment: each pixel takes the nearest of the background and the eight palette colours
   (tools/shapes/scene.py) if it lies within `threshold` (Euclidean RGB) of it, else none.
2. Connected components of equal colour (8-connectivity), by min-label propagation with
   pointer jumping; components under `min_area` pixels are dropped as specks.
3. Each component's shape is classified from its geometry: fill of its bounding box, how
   full the top and bottom corners of the box are, the height of its centroid, and the
   widths of the rows at a quarter and three quarters of its height, compared with the
   same features of the renderer's own shapes (nearest prototype). A component far from
   every prototype, or much wider than high (or the reverse), is "unknown".
   Size: small if the box's longer side is under 34 px (scaled to 128 px), else large.
4. The spec is checked GenEval-style (see `check`).

Categories (prompts.jsonl): single_object, two_object, counting, colors, position,
color_attr. Overall accuracy is the mean of the per-category accuracies, as in GenEval.
"""

import json
import os

import numpy as np

from tools.shapes import scene as S

THRESHOLD = 60.0  # max RGB distance from a palette colour
MIN_AREA = 40  # components smaller than this (px, at 128x128) are specks
MAX_PROTOTYPE_DISTANCE = 0.45
MAX_ASPECT = 1.6

COLOUR_NAMES = ["background"] + S.COLOURS
_COLOURS = np.array([S.BACKGROUND] + [S.PALETTE[c] for c in S.COLOURS], np.float32)


def segment(img, threshold=THRESHOLD):
    """img uint8 (H, W, 3) -> int labels (H, W): 0 background, 1..8 palette colours in
    scene.COLOURS order, -1 none."""
    x = np.asarray(img, np.float32)[..., :3]
    d2 = ((x[:, :, None, :] - _COLOURS[None, None]) ** 2).sum(-1)
    lab = d2.argmin(-1)
    best = np.take_along_axis(d2, lab[..., None], -1)[..., 0]
    lab[best > threshold * threshold] = -1
    return lab


def components(colour):
    """Connected components (8-connectivity) of equal positive labels.
    colour: int (H, W). Returns int (H, W): -1 outside, else the flat index of the
    component's first pixel (its smallest index)."""
    h, w = colour.shape
    inside = colour > 0
    big = h * w
    lab = np.where(inside, np.arange(big).reshape(h, w), big)
    pc = np.pad(colour, 1, constant_values=-2)
    shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
    same = [pc[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] == colour for dy, dx in shifts]
    while True:
        pl = np.pad(lab, 1, constant_values=big)
        new = lab.copy()
        for (dy, dx), sm in zip(shifts, same):
            nb = pl[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]
            np.minimum(new, np.where(sm, nb, big), out=new)
        new = np.where(inside, new, big)
        # Pointer jumping: a label is a pixel of the same component with a smaller
        # index; following it twice stays in the component.
        flat = new.ravel()
        for _ in range(4):
            m = flat < big
            flat[m] = flat[flat[m]]
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(inside, lab, -1)


def _features(mask):
    """Shape features of a component cropped to its bounding box (bool (h, w))."""
    h, w = mask.shape
    area = mask.sum()
    fill = area / float(h * w)
    ch, cw = max(1, int(round(h * 0.25))), max(1, int(round(w * 0.25)))
    top = (mask[:ch, :cw].mean() + mask[:ch, -cw:].mean()) / 2
    bottom = (mask[-ch:, :cw].mean() + mask[-ch:, -cw:].mean()) / 2
    ys = np.nonzero(mask)[0]
    cy = (ys.mean() + 0.5) / h

    def row_width(frac):
        lo = int(np.floor(h * (frac - 0.05)))
        hi = max(lo + 1, int(np.ceil(h * (frac + 0.05))))
        return mask[max(0, lo) : min(h, hi)].sum(1).mean() / w

    return np.array([fill, top, bottom, cy, row_width(0.25), row_width(0.75)])


_PROTOTYPES = None


def prototypes():
    """{shape: mean feature vector} over the renderer's own shapes at several sizes."""
    global _PROTOTYPES
    if _PROTOTYPES is None:
        out = {}
        for shape in S.SHAPES:
            feats = []
            for s in (20.0, 24.0, 28.0, 40.0, 46.0, 52.0):
                for off in (0.0, 0.37):
                    c = 64.0 + off
                    img = S.render([{"shape": shape, "colour": "blue", "size": "small",
                                     "box": [c - s / 2, c - s / 2, c + s / 2, c + s / 2]}])
                    lab = segment(img)
                    ys, xs = np.nonzero(lab > 0)
                    feats.append(_features((lab > 0)[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]))
            out[shape] = np.mean(feats, 0)
        _PROTOTYPES = out
    return _PROTOTYPES


def classify(mask):
    """(shape or 'unknown', distance to the nearest prototype) of a cropped component."""
    h, w = mask.shape
    if max(h, w) > MAX_ASPECT * min(h, w):
        return "unknown", float("inf")
    f = _features(mask)
    best, dist = "unknown", float("inf")
    for shape, p in prototypes().items():
        d = float(np.sqrt(((f - p) ** 2).sum()))
        if d < dist:
            best, dist = shape, d
    return (best if dist <= MAX_PROTOTYPE_DISTANCE else "unknown"), dist


def detect(img, threshold=THRESHOLD, min_area=MIN_AREA):
    """Objects in an image (uint8 (H, W, 3)): list of dicts with shape, colour, size,
    box [x0, y0, x1, y1] (pixel edges, scaled to a 128 px image), centre, area."""
    img = np.asarray(img)
    h, w = img.shape[:2]
    scale = S.SIZE / float(max(h, w))
    colour = segment(img, threshold)
    comp = components(colour)
    roots, inverse, counts = np.unique(comp.ravel(), return_inverse=True, return_counts=True)
    ys, xs = np.divmod(np.arange(h * w), w)
    out = []
    for k, root in enumerate(roots):
        if root < 0 or counts[k] * scale * scale < min_area:
            continue
        sel = inverse == k
        y, x = ys[sel], xs[sel]
        y0, y1, x0, x1 = y.min(), y.max() + 1, x.min(), x.max() + 1
        crop = (comp[y0:y1, x0:x1] == root)
        shape, dist = classify(crop)
        box = [float(v) * scale for v in (x0, y0, x1, y1)]
        side = max(box[2] - box[0], box[3] - box[1])
        out.append({
            "shape": shape,
            "colour": COLOUR_NAMES[colour.ravel()[root]],
            "size": "large" if side >= S.SIZE_THRESHOLD else "small",
            "box": box,
            "centre": [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2],
            "area": int(counts[k]),
            "shape_distance": round(dist, 3),
        })
    out.sort(key=lambda d: (d["box"][1], d["box"][0]))
    return out


def in_region(position, centre):
    """The scorer's absolute regions (centres in a 128 px frame): left of 0.4 of the width,
    right of 0.6, above 0.4 of the height, below 0.6, or within 0.15 of the middle on
    both axes for centre."""
    x, y = centre[0] / S.SIZE, centre[1] / S.SIZE
    return {
        "left": x < 0.4,
        "right": x > 0.6,
        "top": y < 0.4,
        "bottom": y > 0.6,
        "centre": abs(x - 0.5) < 0.15 and abs(y - 0.5) < 0.15,
    }[position]


def _matches(det, o):
    return (
        det["shape"] == o["shape"]
        and ("colour" not in o or det["colour"] == o["colour"])
        and ("size" not in o or det["size"] == o["size"])
    )


def check(spec, dets):
    """(correct, reason) of detections against a spec:
    - each spec object: the detections of its shape (and colour and size where given)
      number exactly `count` when given, else at least one; with a position, some
      (with count: all) of them lie in that region;
    - relation: some detection of objects[a] and some other of objects[b] satisfy it
      (scene.relation_holds: at least 0.1 of the image apart along the axis, and more
      than across it);
    - total: the image holds exactly that many objects (unknown shapes included)."""
    matched = []
    for i, o in enumerate(spec["objects"]):
        m = [d for d in dets if _matches(d, o)]
        if "count" in o:
            if len(m) != o["count"]:
                return False, "object %d: %d %s found, %d wanted" % (i, len(m), _describe(o), o["count"])
            if "position" in o and not all(in_region(o["position"], d["centre"]) for d in m):
                return False, "object %d: not all %s on the %s" % (i, _describe(o), o["position"])
        else:
            if not m:
                return False, "object %d: no %s found" % (i, _describe(o))
            if "position" in o:
                m = [d for d in m if in_region(o["position"], d["centre"])]
                if not m:
                    return False, "object %d: no %s in region %s" % (i, _describe(o), o["position"])
        matched.append(m)
    rel = spec.get("relation")
    if rel:
        ok = any(
            da is not db and S.relation_holds(rel["rel"], da["centre"], db["centre"])
            for da in matched[rel["a"]]
            for db in matched[rel["b"]]
        )
        if not ok:
            return False, "relation %s does not hold" % rel["rel"]
    if "total" in spec and len(dets) != spec["total"]:
        return False, "%d objects found, %d wanted" % (len(dets), spec["total"])
    return True, "ok"


def _describe(o):
    return " ".join(v for v in (o.get("size"), o.get("colour"), o["shape"]) if v)


def score_image(img, spec, threshold=THRESHOLD, min_area=MIN_AREA):
    """(correct, reason, detections)."""
    dets = detect(img, threshold, min_area)
    ok, why = check(spec, dets)
    return ok, why, dets


CATEGORIES = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def load_prompts(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def image_files(directory, prompt_id):
    """Images of one prompt: DIR/<id>.png or DIR/<id>_<n>.png, id as 5 digits."""
    stem = "%05d" % int(prompt_id)
    names = sorted(
        n for n in os.listdir(directory)
        if n.endswith(".png") and (n == stem + ".png" or n.startswith(stem + "_"))
    )
    return [os.path.join(directory, n) for n in names]


def summarise(results):
    """results: list of dicts with category and correct. Returns
    {category: (correct, n, accuracy)}, overall (mean of category accuracies), and the
    accuracy over all images."""
    per = {}
    for r in results:
        c, n = per.get(r["category"], (0, 0))
        per[r["category"]] = (c + bool(r["correct"]), n + 1)
    table = {k: (c, n, c / n) for k, (c, n) in per.items()}
    overall = float(np.mean([v[2] for v in table.values()])) if table else 0.0
    images = sum(v[0] for v in table.values()) / max(1, sum(v[1] for v in table.values()))
    return table, overall, images


def colours_found(spec, dets):
    """Fraction of the colours a spec names that some detected object has, whatever its
    shape, size or place; None when the spec names no colour. A partial-credit signal:
    a model that draws the right colours in the wrong shapes scores here and not above."""
    want = {o["colour"] for o in spec["objects"] if o.get("colour")}
    if not want:
        return None
    have = {d["colour"] for d in dets}
    return len(want & have) / len(want)


def colour_recall(results):
    """Mean of colours_found over the scored images that name a colour (0.0 if none)."""
    v = [r["colours_found"] for r in results if r.get("colours_found") is not None]
    return float(np.mean(v)) if v else 0.0


def score_dir(images, prompts, threshold=THRESHOLD, min_area=MIN_AREA):
    """Scores DIR against a prompts.jsonl (a path, or its prompts as a list);
    missing images count as wrong."""
    from PIL import Image

    results = []
    for p in load_prompts(prompts) if isinstance(prompts, (str, os.PathLike)) else prompts:
        files = image_files(images, p["id"])
        if not files:
            results.append({"id": p["id"], "category": p["category"], "prompt": p["prompt"],
                            "file": None, "correct": False, "reason": "no image"})
        for fn in files:
            img = np.asarray(Image.open(fn).convert("RGB"))
            ok, why, dets = score_image(img, p["spec"], threshold, min_area)
            results.append({"id": p["id"], "category": p["category"], "prompt": p["prompt"],
                            "file": os.path.basename(fn), "correct": ok, "reason": why,
                            "colours_found": colours_found(p["spec"], dets), "detections": dets})
    return results


def format_table(table, overall, images):
    lines = ["%-14s %8s %6s" % ("category", "accuracy", "n")]
    for c in CATEGORIES + sorted(set(table) - set(CATEGORIES)):
        if c in table:
            lines.append("%-14s %8.3f %6d" % (c, table[c][2], table[c][1]))
    lines.append("%-14s %8.3f %6d" % ("overall", overall, sum(v[1] for v in table.values())))
    lines.append("(overall: mean of the categories; all images together: %.3f)" % images)
    return "\n".join(lines)
