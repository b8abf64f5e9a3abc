#!/usr/bin/env python3
"""Golden data for T5's relative-position buckets (engine/family/infinity.c,
inf_t5_bucket): the bucket PyPI transformers' T5Attention gives every relative
position from -600 to 600, bidirectional, for Infinity's text encoder
(flan-t5-xl: 32 buckets, max distance 128) and one other configuration.
tests/unit/test_golden_infinity.c checks arserve gives the same.

    .venv-bench/bin/python tests/golden/t5_buckets/gen.py   # writes buckets.json beside it
"""
import json
import os

import torch
from transformers.models.t5.modeling_t5 import T5Attention

SPAN = 600
CONFIGS = [(32, 128), (64, 256)]


def main():
    rel = torch.arange(-SPAN, SPAN + 1)
    out = {"span": SPAN, "configs": []}
    for n_buckets, max_distance in CONFIGS:
        b = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=n_buckets,
                                                  max_distance=max_distance)
        out["configs"].append({"num_buckets": n_buckets, "max_distance": max_distance,
                               "buckets": b.tolist()})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "buckets.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
