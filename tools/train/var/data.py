"""Class-labelled single-object scenes of the captioned-shapes world (tools/shapes).

The classes are the exact single-object captions that ShapesEval's prompts use for one
object without a position, so that a prompt names a class verbatim:

  - single_object prompts: "a circle", "a small circle", "a large circle", ... (4 shapes x
    {any, small, large} = 12 classes);
  - colors prompts: "a red circle", "an orange square", ... (4 shapes x 8 colours = 32).

44 classes in all (CLASS_NAMES, the order of classes.txt). A class's attributes are fixed
by its caption; what the caption leaves open (colour, size, position) is drawn at random
by tools/shapes/scene.realise, so "a circle" covers circles of every colour and size.

Only single objects are rendered (scene.realise of a one-object spec draws its object
without iterating a set, so a sample depends only on the rng). Sample i of a stream with
seed s comes from numpy's default_rng([s, i]): any sample is reproducible on its own.
"""

import os
import sys

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools.shapes import scene as S  # noqa: E402


def class_specs():
    """[(name, spec)] in class order."""
    out = []
    for shape in S.SHAPES:
        for size in (None, "small", "large"):
            o = {"shape": shape}
            if size:
                o["size"] = size
            out.append({"objects": [o], "total": 1})
    for shape in S.SHAPES:
        for colour in S.COLOURS:
            out.append({"objects": [{"shape": shape, "colour": colour}], "total": 1})
    return [(S.caption(sp), sp) for sp in out]


CLASSES = class_specs()
CLASS_NAMES = [n for n, _ in CLASSES]
NUM_CLASSES = len(CLASSES)


def sample(seed, i, label=None, size=S.SIZE, default_colour=None):
    """(label, uint8 image (size, size, 3), scene) of sample i of stream `seed`; the class
    is uniform over the classes unless given. size < 128: the 128 px render box-filtered
    down (PIL Image.reduce); scene boxes stay in 128 px units. default_colour: the colour of
    a class that names none (None: at random; see scene.sample_training_scene)."""
    rng = np.random.default_rng([seed, i])
    if label is None:
        label = int(rng.integers(NUM_CLASSES))
    spec = CLASSES[label][1]
    if default_colour is not None and "colour" not in spec["objects"][0]:
        spec = dict(spec, objects=[dict(spec["objects"][0], colour=default_colour)])
    scene = S.realise(spec, rng)
    img = S.render(scene)
    if size != S.SIZE:
        img = np.asarray(Image.fromarray(img).reduce(S.SIZE // size))
    return label, img, scene


def make_set(seed, n, start=0, size=S.SIZE, default_colour=None):
    """(labels int64 [n], images uint8 [n, size, size, 3]) of samples start..start+n-1."""
    labels = np.zeros(n, np.int64)
    images = np.zeros((n, size, size, 3), np.uint8)
    for k in range(n):
        labels[k], images[k], _ = sample(seed, start + k, size=size, default_colour=default_colour)
    return labels, images


if __name__ == "__main__":
    for k, n in enumerate(CLASS_NAMES):
        print(k, n)
