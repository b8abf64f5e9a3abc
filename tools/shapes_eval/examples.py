"""The README's pictures of the shipped demo models (docs/examples/*.png) and the counts
beside them, remade from the models with build/arserve:

    make examples        # or: python tools/shapes_eval/examples.py [--arserve BIN]

The rule (the README states it above its table): each prompt is drawn at seeds 1..8 with the
model's defaults; the picture is seed 1's, not selected, and beside it stands how many of the
eight images ShapesEval's scorer counts right, by the rule of the ShapesEval category the
prompt's caption belongs to (`make_prompts.candidates`). Where seed 1 is wrong, the first
right seed of 1..8 is shown too (docs/examples/<stem>_first_right.png). The prompts were
chosen before their images were seen: the three the README always showed, the class of
models/shapes-var nearest the first ("a red circle": it has no positions) and the first
prompt again on models/shapes-inf.

It writes the PNGs, removes any other PNG of docs/examples/, and prints the table rows'
facts; the words saying what each picture shows are the README's, written by looking.
tests/python/test_readme_examples.py regenerates every image and checks the PNGs' bytes and
the README's counts and seeds against this module.

The command pins the CPU backend, one thread and OpenBLAS's kernel, as make_expected.py's
does; the bytes were the same on the AVX-512, AVX2 and portable kernels (ARSERVE_ISA), on one
and two threads and under other OpenBLAS kernels.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.shapes import scene as S  # noqa: E402
from tools.shapes_eval import make_prompts, scorer  # noqa: E402
from tools.shapes_eval.make_expected import ENV  # noqa: E402

SEEDS = range(1, 9)
OUT_DIR = "docs/examples"
# make_prompts' candidate lists, each with the ShapesEval category it scores under.
CANDIDATES = [("single_object", "single_object"), ("two_object", "two_object"),
              ("counting", "counting"), ("colors", "colors"),
              ("position_absolute", "position"), ("position_relative", "position"),
              ("color_attr", "color_attr")]


def spec_for(caption):
    """(category, spec) of the ShapesEval candidate whose caption is `caption`."""
    for name, category in CANDIDATES:
        for spec in make_prompts.candidates(name):
            if S.caption(spec) == caption:
                return category, spec
    raise ValueError("no ShapesEval prompt reads %r" % caption)


class Example:
    """One row of the README's table: `flag` is --prompt or --class."""

    def __init__(self, model, flag, condition, stem):
        self.model, self.flag, self.condition, self.stem = model, flag, condition, stem
        self.category, self.spec = spec_for(condition)

    @property
    def png(self):
        """Seed 1's picture, relative to the root."""
        return "%s/%s.png" % (OUT_DIR, self.stem)

    @property
    def first_right_png(self):
        """The first right seed's picture, where seed 1 is wrong."""
        return "%s/%s_first_right.png" % (OUT_DIR, self.stem)

    def command(self, arserve, seed, out):
        return [arserve, "generate", "--model", self.model, self.flag, self.condition,
                "--seed", str(seed), "--threads", "1", "--backend", "cpu", "-q", "-o", out]

    def generate(self, arserve, seed, out, timeout=120):
        """Runs command() in the root with make_expected's ENV; raises on failure."""
        r = subprocess.run(self.command(arserve, seed, out), cwd=ROOT,
                           env=dict(os.environ, **ENV), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError("%s exited with %d:\n%s" % (
                " ".join(self.command(arserve, seed, out)), r.returncode, r.stderr))


EXAMPLES = [
    Example("models/shapes", "--prompt", "a red circle on the left", "red_circle_left"),
    Example("models/shapes", "--prompt", "two green triangles", "two_green_triangles"),
    Example("models/shapes", "--prompt", "a blue square above a yellow diamond",
            "blue_square_above_yellow_diamond"),
    Example("models/shapes-var", "--class", "a red circle", "shapes_var_red_circle"),
    Example("models/shapes-inf", "--prompt", "a red circle on the left",
            "shapes_inf_red_circle_left"),
]


class Drawn:
    """An example's eight images (`files[seed]`, in a folder of the caller's) and their
    scores: `right[seed]`, `reason[seed]`, `found[seed]` (the objects detected)."""

    def __init__(self, example, files):
        self.example, self.files = example, files
        self.right, self.reason, self.found = {}, {}, {}
        for seed, path in files.items():
            img = np.asarray(Image.open(path).convert("RGB"))
            ok, why, dets = scorer.score_image(img, example.spec)
            self.right[seed], self.reason[seed] = ok, why
            self.found[seed] = "; ".join("%s %s at (%.0f, %.0f)" % (
                d["colour"], d["shape"], d["centre"][0], d["centre"][1]) for d in dets) or "nothing"

    @property
    def count(self):
        return sum(self.right.values())

    @property
    def first_right(self):
        """The first right seed, or None."""
        return next((s for s in SEEDS if self.right[s]), None)


def draw(example, arserve, folder):
    """Generates the example at every seed into folder; its Drawn."""
    files = {}
    for seed in SEEDS:
        files[seed] = os.path.join(folder, "%s_seed%d.png" % (example.stem, seed))
        example.generate(arserve, seed, files[seed])
    return Drawn(example, files)


def wanted_files(drawn):
    """{path relative to the root: the generated file it must hold} for one example."""
    out = {drawn.example.png: drawn.files[1]}
    if not drawn.right[1] and drawn.first_right is not None:
        out[drawn.example.first_right_png] = drawn.files[drawn.first_right]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arserve", default="build/arserve",
                    help="the arserve binary, relative to the root (default build/arserve)")
    a = ap.parse_args(argv)
    os.makedirs(os.path.join(ROOT, OUT_DIR), exist_ok=True)
    keep = set()
    with tempfile.TemporaryDirectory() as tmp:
        for ex in EXAMPLES:
            d = draw(ex, a.arserve, tmp)
            for rel, src in wanted_files(d).items():
                shutil.copyfile(src, os.path.join(ROOT, rel))
                keep.add(os.path.basename(rel))
            print("%s, %r [%s]: right %d of %d; seed 1 %s; first right seed %s"
                  % (ex.model, ex.condition, ex.category, d.count, len(SEEDS),
                     "right" if d.right[1] else "wrong", d.first_right))
            for seed in SEEDS:
                print("  seed %d: %s (%s) %s" % (seed, "right" if d.right[seed] else "wrong",
                                                 d.reason[seed], d.found[seed]))
    for name in sorted(os.listdir(os.path.join(ROOT, OUT_DIR))):
        if name.endswith(".png") and name not in keep:
            os.remove(os.path.join(ROOT, OUT_DIR, name))
            print("removed %s/%s" % (OUT_DIR, name))
    print("wrote %s; the README's table must give these counts and seeds" % ", ".join(sorted(keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
