#!/usr/bin/env python3
"""Checks that the engine runs the exported language model as torch trained it.

    python tools/train/raster/check_lm_engine.py --model models/shapes --vq-ckpt build/train/vq/ckpt.pt \\
        --prompt "a red circle on the left" [--cfg 3]

Loads OUT/lm.safetensors into lm_model.JanusLM (so torch sees the exported, rounded
weights), generates greedily with classifier-free guidance (no KV cache: the whole
sequence is recomputed every step), decodes with the VQ checkpoint, and compares with
the engine: it writes golden data for the prompt (prompt ids, greedy tokens, teacher-forced
logits of both rows, decoded pixels) beside a copy of the model directory and runs the
engine's golden test (build/tests/test_golden, `make test-unit` builds it) on it, which
holds the engine to 1e-5 of the largest logit (at least 1e-4) on the logits, the same
greedy tokens and pixels within 1/255.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tools/train: train_util
sys.path.insert(0, os.path.join(ROOT, "tools"))
import safetensors_write  # noqa: E402
from export_vq import load_model  # noqa: E402
from lm_model import JanusLM  # noqa: E402
from train_lm import encode_prompts  # noqa: E402
from train_util import load_weights  # noqa: E402
from vq_model import to_u8  # noqa: E402


def load_lm(model_dir):
    with open(os.path.join(model_dir, "arserve.json")) as f:
        cfg = json.load(f)
    model = JanusLM(cfg["llm"], cfg["image"]).eval()
    model.load_state_dict(load_weights(os.path.join(model_dir, "lm.safetensors")))
    return model, cfg


@torch.no_grad()
def greedy(model, cond, uncond, n, cfg_w):
    ids = torch.tensor([cond, uncond])
    valid = torch.ones_like(ids, dtype=torch.bool)
    toks = []
    for _ in range(n):
        image = torch.tensor([toks + [0], toks + [0]])
        logits = model(ids, valid, image)[:, -1]
        mixed = logits[1] + cfg_w * (logits[0] - logits[1])
        toks.append(int(mixed.argmax()))
    return toks


def vq_from_export(ckpt, model_dir):
    """The VQ model of the checkpoint with the exported (F16-rounded) decoder weights."""
    vq, _ = load_model(ckpt)
    sd = vq.state_dict()
    for k, v in load_weights(os.path.join(model_dir, "vq.safetensors")).items():
        sd[k[len("vq."):]] = v
    vq.load_state_dict(sd)
    return vq


@torch.no_grad()
def row_logits(model, row, toks):
    ids = torch.tensor([row])
    return model(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([toks]))[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "shapes"))
    ap.add_argument("--vq-ckpt", required=True)
    ap.add_argument("--prompt", default="a red circle on the left")
    ap.add_argument("--cfg", type=float, default=None, help="default: the model's")
    ap.add_argument("--test", default=os.path.join(ROOT, "build", "tests", "test_golden"))
    ap.add_argument("--keep", help="write the golden directory here instead of a temporary one")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    model, cfg = load_lm(a.model)
    cfg_w = cfg["sampling"]["cfg"] if a.cfg is None else a.cfg
    with open(os.path.join(a.model, "tokenizer.json")) as f:
        tok_json = json.load(f)
    (cond,), (uncond,) = encode_prompts(tok_json, [a.prompt])
    n = cfg["image"]["grid_height"] * cfg["image"]["grid_width"]
    toks = greedy(model, cond, uncond, n, cfg_w)
    lc, lu = row_logits(model, cond, toks), row_logits(model, uncond, toks)
    vq = vq_from_export(a.vq_ckpt, a.model)
    grid = torch.tensor(toks).view(1, cfg["image"]["grid_height"], cfg["image"]["grid_width"])
    with torch.no_grad():
        f32 = vq.decode_indices(grid)
    golden = {
        "cond_ids": np.array(cond, np.int32), "uncond_ids": np.array(uncond, np.int32),
        "greedy_tokens": np.array(toks, np.int32),
        "cond_logits": lc.numpy().astype(np.float32), "uncond_logits": lu.numpy().astype(np.float32),
        "pixels_f32": f32[0].numpy().astype(np.float32), "pixels": to_u8(f32).numpy()[0],
    }
    tmp = tempfile.TemporaryDirectory()
    out = a.keep or tmp.name
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(a.model):
        shutil.copyfile(os.path.join(a.model, name), os.path.join(out, name))
    safetensors_write.write(os.path.join(out, "golden.safetensors"), golden,
                            metadata={"cfg_weight": repr(cfg_w), "prompt": a.prompt})
    print("torch: %d prompt tokens, %d distinct of %d greedy tokens, logits in [%.1f, %.1f]" % (
        len(cond), len(set(toks)), n, float(lc.min()), float(lc.max())), flush=True)
    # float32 rounding grows with the logits' size: 1e-5 of the largest, at least 1e-4.
    tol = max(1e-4, 1e-5 * float(max(lc.abs().max(), lu.abs().max())))
    print("logit tolerance %.2g" % tol, flush=True)
    r = subprocess.run([a.test], env=dict(os.environ, ARSERVE_GOLDEN_DIR=out, ARSERVE_GOLDEN_LOGIT_TOL=repr(tol)))
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
