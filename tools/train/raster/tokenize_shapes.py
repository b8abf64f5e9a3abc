#!/usr/bin/env python3
"""Turns a shapes dataset (npz shards from tools/shapes/dataset.py) into VQ token grids
with the trained encoder (or the fixed code book a checkpoint trained with --codebook
holds), for language-model training.

    OMP_NUM_THREADS=1 nice -n 10 python tools/train/raster/tokenize_shapes.py \\
        --ckpt build/train/vq/ckpt.pt --data build/shapes/train --out build/shapes/train/tokens.npz

--codebook NPZ instead of --ckpt takes the code book's tokens straight from its file
(tools/shapes/codebook.py): the same tokens as a checkpoint trained on it, with no decoder
needed, so a language model can be trained again on new data for a shipped decoder.

OUT holds `tokens`, uint16 [N, 16, 16] (raster order: row by row), aligned with the
records of the shards in order, and `captions` (the records' captions). Shows the
reconstruction PSNR of the first images as a check (with --codebook, of the code book
painted back, no decoder). The encoder runs on --device (F32
there too: the tokens are the same on every machine, up to ties); a code-book checkpoint's
tokens come from numpy on the CPU, in --workers processes. OUT is written whole or not at
all (through a temporary file). Needs torch and numpy.
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tools/train: train_util
sys.path.insert(0, ROOT)
from export_vq import load_model  # noqa: E402
from train_util import pick_device, worker_pool  # noqa: E402
from vq_model import codebook_grids, to_u8, tokenize_u8  # noqa: E402
from tools.shapes import codebook as shapes_codebook  # noqa: E402
from tools.shapes.dataset import load_shards  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="a VQ checkpoint (train_vq.py): its encoder, or its code book")
    src.add_argument("--codebook", help="a code book (tools/shapes/codebook.py): its tokens, no checkpoint")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1,
                    help="processes that encode with a code-book checkpoint's code book")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a = ap.parse_args(argv)
    if a.workers < 1:
        ap.error("--workers must be >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    with worker_pool(a.workers) as pool:
        return tokenize(a, pool)


def tokenize(a, pool):
    torch.set_num_threads(a.threads)
    records, images = load_shards(a.data)
    if a.codebook:
        return tokenize_with_codebook(a, pool, records, images)
    model, ck = load_model(a.ckpt)
    model.to(pick_device(a.device))
    toks = np.zeros((len(images),) + (images.shape[1] >> (len(ck["config"]["channel_multiplier"]) - 1),) * 2,
                    np.uint16)
    t0 = time.time()
    with torch.no_grad():
        for i in range(0, len(images), a.batch):
            toks[i : i + a.batch] = tokenize_u8(model, images[i : i + a.batch], ck.get("codebook_masks"), pool).cpu().numpy()
            if i // a.batch % 20 == 0:
                print("%d / %d (%.0f s)" % (i, len(images), time.time() - t0), flush=True)
        n = min(64, len(images))
        idx = torch.from_numpy(toks[:n].astype(np.int64)).to(model.codebook.weight.device)
        rec = to_u8(model.decode_indices(idx)).cpu().numpy()
    write(a.out, toks, records, rec, images[:n])


def tokenize_with_codebook(a, pool, records, images):
    with np.load(a.codebook) as z:
        masks = z["masks"]
    t0 = time.time()
    toks = np.zeros((len(images), shapes_codebook.GRID, shapes_codebook.GRID), np.uint16)
    for i in range(0, len(images), a.batch):
        toks[i : i + a.batch] = codebook_grids(images[i : i + a.batch], masks, pool)
        if i // a.batch % 20 == 0:
            print("%d / %d (%.0f s)" % (i, len(images), time.time() - t0), flush=True)
    n = min(64, len(images))
    write(a.out, toks, records, np.stack([shapes_codebook.decode(t, masks) for t in toks[:n]]), images[:n])


def write(out, toks, records, rec, images):
    """OUT (through a temporary file) and the summary line with the PSNR of rec against images."""
    mse = ((rec.astype(np.float64) - images) ** 2).mean()
    tmp = out + ".tmp.npz"
    np.savez_compressed(tmp, tokens=toks, captions=np.array([r["caption"] for r in records]))
    os.replace(tmp, out)
    print("wrote %s: %d token grids %s, %d distinct codes; PSNR of the first %d: %.2f dB" % (
        out, len(toks), toks.shape[1:], len(np.unique(toks)), len(images), 10 * math.log10(255.0 ** 2 / mse)))


if __name__ == "__main__":
    sys.exit(main())
