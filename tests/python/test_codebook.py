"""tools/shapes/codebook.py: white is one code, a flat colour patch is its colour's full-mask
code and paints back exactly, the masks are a function of the seed, and true scenes survive a
round trip through even a small code book."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.shapes import codebook as C  # noqa: E402
from tools.shapes import scene as S  # noqa: E402


@pytest.fixture(scope="module")
def masks():
    m, palette = C.build(9, 120, seed=3)
    assert m.shape == (9, 8, 8) and palette.shape == (len(S.COLOURS), 3)
    return m


def test_white_is_one_code_and_paints_back_white(masks):
    white = np.full((S.SIZE, S.SIZE, 3), 255, np.uint8)
    codes = C.encode(white, masks)
    assert codes.shape == (C.GRID, C.GRID) and not codes.any()
    assert (C.decode(codes, masks) == 255).all()


def test_an_antialiased_edge_is_not_white(masks):
    img = np.full((S.SIZE, S.SIZE, 3), 255, np.uint8)
    red = np.array(S.PALETTE["red"], np.float32)
    img[8:16, 15] = np.rint(255 + 0.3 * (red - 255)).astype(np.uint8)  # a 30% column of red
    codes = C.encode(img, masks)
    assert (codes[1, 1] - 1) // len(masks) == S.COLOURS.index("red"), codes[1, 1]
    assert codes.sum() == codes[1, 1]


def test_flat_colour_patches_are_the_full_mask_code_and_exact(masks):
    img = np.full((S.SIZE, S.SIZE, 3), 255, np.uint8)
    img[16:40, 8:32] = S.PALETTE["blue"]  # 3 x 3 whole patches
    codes = C.encode(img, masks)
    blue = S.COLOURS.index("blue")
    assert (codes[2:5, 1:4] == 1 + blue * len(masks)).all(), codes[1:6, 0:5]
    assert (np.delete(codes.reshape(-1), [r * C.GRID + c for r in range(2, 5) for c in range(1, 4)]) == 0).all()
    assert (C.decode(codes, masks) == img).all()


def test_masks_depend_only_on_the_seed(masks):
    again, _ = C.build(9, 120, seed=3)
    other, _ = C.build(9, 120, seed=4)
    assert np.array_equal(masks, again)
    assert not np.array_equal(masks, other)
    assert (masks[0] == 1).all(), "the full patch is always a prototype"


def test_true_scenes_round_trip(masks):
    rng = np.random.default_rng(0)
    worst = np.inf
    for _ in range(8):
        _, spec = S.sample_training_spec(rng)
        img = S.render(S.realise(spec, rng))
        codes = C.encode(img, masks)
        assert codes.min() >= 0 and codes.max() < 1 + len(S.COLOURS) * len(masks)
        worst = min(worst, C.psnr(img, C.decode(codes, masks)))
    assert worst > 20, worst


def test_the_shapes_world_does_not_import_its_scorer():
    """tools/shapes is below tools/shapes_eval (the scorer reads scene.py): nothing in it may
    import the scorer back, at the top of a file or inside a function."""
    import ast

    here = os.path.join(ROOT, "tools", "shapes")
    for name in sorted(os.listdir(here)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(here, name)) as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                assert not m.startswith("tools.shapes_eval"), \
                    "tools/shapes/%s:%d imports %s" % (name, node.lineno, m)


def test_codebook_upper_bound_on_true_scenes(masks, tmp_path, capsys):
    """python -m tools.shapes_eval codebook: true scenes of one prompt per category, through a
    small code book, mostly score right, and every category is printed."""
    from tools.shapes_eval.__main__ import main as cli_main

    path = tmp_path / "codebook.npz"
    np.savez(path, masks=masks, palette=C.PALETTE.astype(np.uint8))
    prompts = os.path.join(ROOT, "tools", "shapes_eval", "prompts.jsonl")
    with open(prompts) as f:
        first = [line for line in f if line.strip()][:6]
    (tmp_path / "p.jsonl").write_text("".join(first))
    assert cli_main(["codebook", "--codebook", str(path), "--prompts", str(tmp_path / "p.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("round trip of true scenes: ShapesEval "), out
    assert "of %d codes used" % (1 + len(S.COLOURS) * len(masks)) in out, out
    for cat in ("single_object", "two_object", "counting", "colors", "position", "color_attr"):
        assert "\n  %-14s " % cat in out, out
    assert float(out.split("ShapesEval ")[1].split(",")[0]) >= 0.5, out
