"""A code book made for the shapes world: one code for a white patch, and per palette colour
one code per coverage pattern.

    python -m tools.shapes.codebook --out build/codebook.npz --masks 33 [--images 2000] [--seed 1]

A token covers 8 x 8 pixels of a 128 x 128 image (the 16 x 16 grid of the demo model). Scenes
are flat palette colours on white, antialiased at their edges, so a patch is white, or one
colour over a part of it given by a coverage pattern (alpha per pixel, 0 white to 1 the colour;
the rare patch where two objects meet keeps its dominant colour). The coverage patterns are
--masks prototypes found by k-means over the patches of --images training scenes (seeded),
the full patch always among them. Code 0 is white; code 1 + c * masks + m is palette colour c
(scene.COLOURS order) over prototype m. With 8 colours, 33 masks give 265 codes and 65 masks
521.

`encode` maps an image to its tokens (each patch to its colour and nearest prototype),
`decode` paints tokens back. `python -m tools.shapes_eval codebook --codebook build/codebook.npz`
prints ShapesEval of true scenes encoded and decoded: the accuracy a model that predicts the
right tokens would get (the code book's upper bound), and the PSNR of the round trip (it lives in
tools/shapes_eval/codebook_bound.py: the shapes world does not import its scorer).

The output holds `masks` (float32 [masks, 8, 8]) and `palette` (uint8 [colours, 3]). Needs
numpy and Pillow.
"""

import argparse
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.shapes import dataset, scene  # noqa: E402

PATCH = 8
GRID = scene.SIZE // PATCH
WHITE = np.array(scene.BACKGROUND, np.float32)
PALETTE = np.array([scene.PALETTE[c] for c in scene.COLOURS], np.float32)
# A patch whose every pixel is within this alpha of white is white.
WHITE_ALPHA = 0.02


def patches(img):
    """uint8 (128, 128, 3) -> float32 (GRID * GRID, 8, 8, 3), row-major patches."""
    x = np.asarray(img, np.float32).reshape(GRID, PATCH, GRID, PATCH, 3)
    return x.transpose(0, 2, 1, 3, 4).reshape(GRID * GRID, PATCH, PATCH, 3)


def colour_and_alpha(p):
    """Patches (N, 8, 8, 3) -> dominant palette colour index per patch (N,) and alpha
    (N, 8, 8): each pixel's position between white and that colour, in [0, 1]."""
    # Each pixel's colour: the palette colour whose line from white passes closest to it (an
    # antialiased edge pixel lies on that line, often nearer another colour's own value).
    line = PALETTE - WHITE  # (colours, 3)
    t = np.clip(((p - WHITE)[..., None, :] * line).sum(-1) / (line ** 2).sum(-1), 0.0, 1.0)
    d2 = (((p - WHITE)[..., None, :] - t[..., None] * line) ** 2).sum(-1)  # (N, 8, 8, colours)
    nearest = d2.argmin(-1)
    ink = ((p - WHITE) ** 2).sum(-1) > 30.0 ** 2  # clearly not white
    votes = np.zeros((len(p), len(PALETTE)), np.int64)
    for c in range(len(PALETTE)):
        votes[:, c] = ((nearest == c) & ink).sum((1, 2))
    colour = votes.argmax(1)
    direction = PALETTE[colour] - WHITE  # (N, 3)
    alpha = ((p - WHITE) * direction[:, None, None, :]).sum(-1) / (direction ** 2).sum(-1)[:, None, None]
    return colour, np.clip(alpha, 0.0, 1.0)


def kmeans(x, k, seed, iters=30):
    """Rows of x into k centres; the first centre is fixed at all ones (a full patch)."""
    rng = np.random.default_rng(seed)
    centres = np.empty((k, x.shape[1]), np.float32)
    centres[0] = 1.0
    # k-means++ seeding for the rest
    d = ((x - centres[0]) ** 2).sum(1)
    for i in range(1, k):
        centres[i] = x[rng.choice(len(x), p=d / d.sum())] if d.sum() > 0 else x[rng.integers(len(x))]
        d = np.minimum(d, ((x - centres[i]) ** 2).sum(1))
    for _ in range(iters):
        assign = nearest_centre(x, centres)
        for i in range(1, k):
            members = x[assign == i]
            if len(members):
                centres[i] = members.mean(0)
    return centres


def nearest_centre(x, centres):
    d = (x ** 2).sum(1)[:, None] - 2 * x @ centres.T + (centres ** 2).sum(1)[None]
    return d.argmin(1)


def build(n_masks, n_images, seed):
    """(masks float32 [n_masks, 8, 8], palette uint8 [colours, 3])."""
    _, images = dataset.generate(seed, 0, n_images)
    alphas = []
    for img in images:
        _, a = colour_and_alpha(patches(img))
        alphas.append(a[a.max((1, 2)) > WHITE_ALPHA])
    x = np.concatenate(alphas).reshape(-1, PATCH * PATCH)
    centres = kmeans(x, n_masks, seed)
    return centres.reshape(n_masks, PATCH, PATCH), PALETTE.astype(np.uint8)


def encode(img, masks):
    """uint8 (128, 128, 3) -> int32 (GRID, GRID) codes."""
    colour, alpha = colour_and_alpha(patches(img))
    flat = alpha.reshape(len(alpha), -1)
    m = nearest_centre(flat, masks.reshape(len(masks), -1))
    codes = 1 + colour * len(masks) + m
    codes[alpha.max((1, 2)) <= WHITE_ALPHA] = 0
    return codes.reshape(GRID, GRID).astype(np.int32)


def decode(codes, masks):
    """int (GRID, GRID) codes -> uint8 (128, 128, 3)."""
    codes = np.asarray(codes, np.int64).reshape(-1)  # signed: codes - 1 of white is -1
    colour = np.maximum(codes - 1, 0) // len(masks)
    alpha = masks[np.maximum(codes - 1, 0) % len(masks)]
    alpha = np.where((codes == 0)[:, None, None], 0.0, alpha)
    p = WHITE + alpha[..., None] * (PALETTE[colour] - WHITE)[:, None, None, :]
    img = p.reshape(GRID, GRID, PATCH, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(scene.SIZE, scene.SIZE, 3)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def psnr(a, b):
    mse = ((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2).mean()
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--masks", type=int, default=33)
    ap.add_argument("--images", type=int, default=2000, help="training scenes the masks come from")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    masks, palette = build(a.masks, a.images, a.seed)
    np.savez(a.out, masks=masks, palette=palette)
    n_codes = 1 + len(palette) * len(masks)
    print("codebook.py: wrote %s: %d codes (white, %d colours x %d coverage masks)"
          % (a.out, n_codes, len(palette), len(masks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
