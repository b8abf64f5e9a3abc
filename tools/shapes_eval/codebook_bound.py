"""ShapesEval's upper bound for a code book made by tools/shapes/codebook.py: true scenes for
the prompts' specs, encoded and decoded through the code book, then scored. That is the
accuracy a model that predicts the right tokens would get; the PSNR of the round trip too.

    python -m tools.shapes_eval codebook --codebook build/codebook.npz
        [--prompts tools/shapes_eval/prompts.jsonl] [--seed 1]

It lives here, above the shapes world, so that tools/shapes/ does not import its scorer.
"""

import os

import numpy as np

from tools.shapes import codebook, scene
from tools.shapes_eval import scorer


def upper_bound(prompts, masks, seed):
    """ShapesEval of true scenes for the prompts' specs after a round trip through the code
    book: (overall, per-category table, mean PSNR, codes used)."""
    rng = np.random.default_rng(seed)
    results, psnrs, used = [], [], set()
    for p in prompts:
        img = scene.render(scene.realise(p["spec"], rng))
        codes = codebook.encode(img, masks)
        used.update(codes.reshape(-1).tolist())
        back = codebook.decode(codes, masks)
        psnrs.append(codebook.psnr(img, back))
        ok, _, _ = scorer.score_image(back, p["spec"])
        results.append({"category": p["category"], "correct": ok})
    table, overall, _ = scorer.summarise(results)
    return overall, table, float(np.mean(psnrs)), len(used)


def add_arguments(ap):
    ap.add_argument("--codebook", required=True, help="the .npz tools/shapes/codebook.py wrote")
    ap.add_argument("--prompts", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"))
    ap.add_argument("--seed", type=int, default=1, help="seed of the scenes drawn for the specs")


def codebook_cli(a):
    with np.load(a.codebook) as f:
        masks, palette = f["masks"], f["palette"]
    n_codes = 1 + len(palette) * len(masks)
    overall, table, mean_psnr, used = upper_bound(scorer.load_prompts(a.prompts), masks, a.seed)
    print("round trip of true scenes: ShapesEval %.3f, PSNR %.1f dB, %d of %d codes used"
          % (overall, mean_psnr, used, n_codes))
    for cat in scorer.CATEGORIES:
        if cat in table:
            c, n, acc = table[cat]
            print("  %-14s %3d / %3d  %.3f" % (cat, c, n, acc))
    return 0
