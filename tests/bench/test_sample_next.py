"""The torch side of `make bench` samples as the engine does: tools/train/raster/lm_model.py's
sample_next against the rules engine/sampler.h states for sampler_next (greedy cases, top-k
on the logits, then softmax at the temperature, then top-p over what top-k kept, at least
one token). The draws are torch's, so the checks are on which tokens can come out and, over
many rows at once, how often (within five standard deviations; fixed seed).

    .venv-bench/bin/python tests/bench/test_sample_next.py     (make test-bench-smoke)
"""

import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "train", "raster"))
from lm_model import sample_next  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tests  # noqa: E402

ROWS = 20000


def draws(probs, temperature=1.0, top_k=0, top_p=1.0, seed=1):
    """Token counts of ROWS draws from logits log(probs), one row each."""
    logits = torch.tensor(probs, dtype=torch.float32).log().expand(ROWS, -1)
    gen = torch.Generator().manual_seed(seed)
    toks = sample_next(logits, temperature, top_k, top_p, gen)
    return torch.bincount(toks, minlength=len(probs)).tolist()


def close(counts, want):
    """counts match the distribution want (normalised here) within 5 sigma per token."""
    total = sum(want)
    for c, w in zip(counts, want):
        p = w / total
        if abs(c - ROWS * p) > 5 * math.sqrt(ROWS * p * (1 - p)) + 1e-9:
            return False
    return True


def test_greedy_at_temperature_zero_and_top_k_one():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, float("nan"), 1.0, 0.0]])
    for t, k in ((0.0, 0), (float("nan"), 0), (float("inf"), 0), (-1.0, 0), (1.0, 1)):
        got = sample_next(logits, t, k, 1.0).tolist()
        # the highest logit, the lowest id on ties; NaN counts as -inf
        assert got == [1, 0], (t, k, got)


def test_infinite_and_missing_logits():
    inf = float("inf")
    logits = torch.tensor([[-inf, inf, -inf, inf], [-inf, -inf, -inf, -inf],
                           [float("nan"), -inf, 0.0, -inf]]).repeat(ROWS // 4, 1)
    toks = sample_next(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(2)).view(-1, 3)
    # +inf logits share the mass; a row of -inf gives token 0; NaN never comes out
    assert set(toks[:, 0].tolist()) == {1, 3}, toks[:, 0].unique()
    assert set(toks[:, 1].tolist()) == {0}
    assert set(toks[:, 2].tolist()) == {2}


def test_temperature_scales_the_logits():
    probs = [0.6, 0.3, 0.1]
    assert close(draws(probs), probs)
    assert close(draws(probs, temperature=0.5), [p * p for p in probs])
    assert close(draws(probs, temperature=2.0), [math.sqrt(p) for p in probs])


def test_top_k_keeps_the_k_highest_logits():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    counts = draws(probs, top_k=3)
    assert counts[0] == counts[2] == 0, counts
    assert close(counts, [0, 0.4, 0, 0.3, 0.15]), counts
    assert close(draws(probs, top_k=5), probs)  # k >= vocab: off
    assert close(draws(probs, top_k=0), probs)


def test_top_p_keeps_the_shortest_prefix_that_reaches_it():
    probs = [0.125, 0.5, 0.125, 0.25]
    # 0.5 + 0.25 reaches 0.74: two tokens; 0.76 needs a third, the lower id of the tie
    assert close(draws(probs, top_p=0.74), [0, 0.5, 0, 0.25])
    assert close(draws(probs, top_p=0.76), [0.125, 0.5, 0, 0.25])
    assert draws(probs, top_p=0.0) == [0, ROWS, 0, 0]  # at least one token
    assert close(draws(probs, top_p=1.0), probs)
    assert close(draws(probs, top_p=float("nan")), probs)  # NaN: off


def test_top_k_comes_before_top_p():
    # top-k 2 leaves 0.5 and 0.3, i.e. 0.625 and 0.375: top-p 0.6 keeps one. Top-p on all
    # four first (0.5 < 0.6) would keep two.
    assert draws([0.5, 0.3, 0.1, 0.1], top_k=2, top_p=0.6) == [ROWS, 0, 0, 0]


def test_temperature_comes_before_top_p():
    # At temperature 0.5 the probabilities are 0.49 : 0.04 : 0.01 (0.907 for the first):
    # top-p 0.75 keeps one token. Top-p at temperature 1 (0.7 < 0.75) would keep two.
    assert draws([0.7, 0.2, 0.1], temperature=0.5, top_p=0.75) == [ROWS, 0, 0]


if __name__ == "__main__":
    sys.exit(bench_tests.run(globals()))
