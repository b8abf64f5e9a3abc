"""The README's pictures of the demo models are what the shipped models draw now, and its
table's counts are what ShapesEval's scorer gives: every example of
tools/shapes_eval/examples.py is generated at seeds 1..8 with build/arserve and scored; seed
1's PNG (and the first right seed's, where seed 1 is wrong) must equal the committed
docs/examples/ file byte for byte, and the README's row must give the count of right seeds
and the first right one. `make examples` remakes the PNGs and prints the counts.

Bytes, not pixels within a tolerance: the command pins the CPU backend, and the PNGs were
the same on the AVX-512, AVX2 and portable kernels (ARSERVE_ISA), on one and two threads and
under other OpenBLAS kernels (each output element is one chain of multiply-adds in order,
docs/cpu-kernels.md). A failure says whether the pixels differ or only the encoding.

    ARSERVE_BIN=build/arserve python -m pytest tests/python/test_readme_examples.py -q
"""

import io
import os
import re
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.shapes_eval import examples as E  # noqa: E402

ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))
IDS = [ex.stem for ex in E.EXAMPLES]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """{stem: Drawn}: every example at every seed, generated once for the module."""
    folder = str(tmp_path_factory.mktemp("examples"))
    return {ex.stem: E.draw(ex, ARSERVE, folder) for ex in E.EXAMPLES}


def readme_row(ex):
    """The cells of the README table's row whose seed-1 picture is ex.png."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("|") and "(%s)" % ex.png in line]
    assert len(rows) == 1, "README.md has %d table rows showing %s, not one" % (len(rows), ex.png)
    return [c.strip() for c in rows[0].strip().strip("|").split("|")]


def _why(rel, got_path):
    with open(got_path, "rb") as f:
        got = f.read()
    with open(os.path.join(ROOT, rel), "rb") as f:
        want = f.read()
    if got == want:
        return None
    same = np.array_equal(np.asarray(Image.open(io.BytesIO(got)).convert("RGB")),
                          np.asarray(Image.open(io.BytesIO(want)).convert("RGB")))
    return ("%s is not what the model draws now (%s): if the model files changed, remake it "
            "with `make examples` and check the README's table; if they did not, the engine's "
            "output changed" % (rel, "same pixels, other PNG bytes: the PNG encoder or zlib "
                                "changed" if same else "other pixels"))


@pytest.mark.parametrize("ex", E.EXAMPLES, ids=IDS)
def test_the_committed_pictures_are_what_the_model_draws(ex, drawn):
    d = drawn[ex.stem]
    wanted = E.wanted_files(d)
    for rel, got in wanted.items():
        assert os.path.isfile(os.path.join(ROOT, rel)), "%s is missing: `make examples`" % rel
        why = _why(rel, got)
        assert why is None, why
    if ex.first_right_png not in wanted:
        assert not os.path.exists(os.path.join(ROOT, ex.first_right_png)), \
            "%s is stale: seed 1 is right now (`make examples` removes it)" % ex.first_right_png


@pytest.mark.parametrize("ex", E.EXAMPLES, ids=IDS)
def test_the_readme_row_gives_the_scorers_count(ex, drawn):
    d = drawn[ex.stem]
    cells = readme_row(ex)
    assert len(cells) == 6, cells
    model, prompt, _, _, count, first = cells
    assert model == "`%s`" % os.path.basename(ex.model), cells
    assert prompt.startswith(ex.condition), cells
    m = re.match(r"(\d+) of (\d+)\b", count)
    assert m, "the count cell %r does not read 'K of N'" % count
    assert (int(m.group(1)), int(m.group(2))) == (d.count, len(E.SEEDS)), (
        "README says %s right for %r on %s; ShapesEval counts %d of %d (%s)"
        % (count, ex.condition, ex.model, d.count, len(E.SEEDS),
           ", ".join("seed %d %s" % (s, "right" if d.right[s] else "wrong: " + d.reason[s])
                     for s in E.SEEDS)))
    if d.right[1]:
        assert first == "seed 1", cells
    elif d.first_right is None:
        assert first == "none", cells
    else:
        assert "(%s)" % ex.first_right_png in first and first.endswith("seed %d" % d.first_right), \
            "README's first right seed %r; ShapesEval's is seed %d" % (first, d.first_right)


def test_docs_examples_holds_only_the_tables_pictures(drawn):
    want = set()
    for d in drawn.values():
        want |= {os.path.basename(p) for p in E.wanted_files(d)}
    have = {f for f in os.listdir(os.path.join(ROOT, E.OUT_DIR)) if f.endswith(".png")}
    assert have == want, "docs/examples/ has %s and lacks %s" % (sorted(have - want),
                                                                 sorted(want - have))
