#!/usr/bin/env python3
"""Held-out reconstruction check of a msvq checkpoint: PSNR (engine pixels) and the share
of reconstructions that ShapesEval's detector reads as exactly the drawn object (shape,
colour and size). Writes a strip of originals over reconstructions.

    .venv-tools/bin/python tools/train/var/check_recon.py --ckpt build/train_var/msvq/ckpt.pt \\
        --n 256 --png build/train_var/recon.png
"""

import argparse
import os
import sys

import numpy as np
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import data  # noqa: E402
from msvq import MSVQ, to_model_input, to_u8  # noqa: E402
from tools.shapes_eval import scorer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--png")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ck = torch.load(a.ckpt, map_location="cpu", weights_only=False)
    m = MSVQ(ck["config"])
    m.load_state_dict(ck["model"])
    m.eval()
    size = ck["config"].get("image_size", 128)
    ok, se, recs, origs = 0, [], [], []
    for s in range(0, a.n, 32):
        n = min(32, a.n - s)
        _, img = data.make_set(a.seed, n, start=s, size=size)
        with torch.no_grad():
            rec = to_u8(m.decode_fhat(m.fhat_from_codes(m.tokenize(to_model_input(img))))).numpy()
        se.extend(((rec.astype(np.float64) - img) ** 2).reshape(n, -1).mean(1).tolist())
        for k in range(n):
            o = data.sample(a.seed, s + k)[2][0]
            d = scorer.detect(rec[k])
            ok += len(d) == 1 and d[0]["shape"] == o["shape"] and d[0]["colour"] == o["colour"] and d[0]["size"] == o["size"]
        if s == 0:
            recs, origs = rec[:12], img[:12]
    print("step %s: PSNR %.2f dB on %d held-out images; detector exact on %.3f" % (
        ck.get("step"), 10 * np.log10(255.0 ** 2 / np.mean(se)), a.n, ok / a.n))
    if a.png:
        Image.fromarray(np.concatenate([np.concatenate(list(origs), 1), np.concatenate(list(recs), 1)], 0)).save(a.png)


if __name__ == "__main__":
    main()
