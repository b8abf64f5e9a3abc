#!/usr/bin/env python3
"""Assembles the shapes demo model directory (models/shapes) from the trained parts.

    python tools/train/raster/export_lm.py --lm build/train/lm/ckpt.pt \\
        --tokenizer build/train/lm/tokenizer.json --vq build/train/vq/export --out models/shapes

Writes OUT/arserve.json, OUT/lm.safetensors (language-model matrices and embedding in BF16,
the image path in F16, norms in F32), OUT/vq.safetensors (copied from the VQ export),
OUT/tokenizer.json, and prints the total size. --cfg/--temperature/--top-k set the
model's default sampling (what a request gets when it names none).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import safetensors_write  # noqa: E402
from train_lm import TEMPLATE  # noqa: E402


def bf16(a):
    """float32 array -> ('BF16', uint16 array), rounding to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return ("BF16", u)


def lm_tensors(state):
    out = {}
    for name, t in state.items():
        a = t.detach().float().numpy()
        if a.ndim == 1 and name.endswith("norm.weight"):
            out[name] = a.astype(np.float32)
        elif name.startswith("llm."):
            out[name] = bf16(a)
        else:
            out[name] = a.astype(np.float16)
    return out


def model_config(ck, vq_frag, sampling, name):
    image = dict(vq_frag["image"])
    for k in ("codebook_size", "embed_dim", "grid_height", "grid_width"):
        if ck["image"][k] != image[k]:
            sys.exit("the LM's image.%s (%r) differs from the VQ export's (%r)" % (k, ck["image"][k], image[k]))
    image.update(aligner_layers=ck["image"]["aligner_layers"], head_hidden_size=ck["image"]["head_hidden_size"])
    return {
        "format_version": 1, "name": name, "family": "raster", "architecture": "janus",
        "weights": ["lm.safetensors", "vq.safetensors"], "tokenizer": "tokenizer.json",
        "llm": ck["llm"], "image": image, "decoder": vq_frag["decoder"],
        "prompt": {"template": TEMPLATE, "bos_token": "<bos>", "pad_token": "<pad>",
                   "image_start_token": "<begin_of_image>"},
        "sampling": sampling,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", required=True, help="train_lm.py checkpoint")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vq", required=True, help="directory written by export_vq.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="shapes")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args(argv)

    ck = torch.load(a.lm, map_location="cpu", weights_only=False)
    with open(os.path.join(a.vq, "vq.json")) as f:
        vq_frag = json.load(f)
    sampling = {"cfg": a.cfg, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
    os.makedirs(a.out, exist_ok=True)
    safetensors_write.write(os.path.join(a.out, "lm.safetensors"), lm_tensors(ck["model"]), metadata={
        "made_by": "tools/train/raster/export_lm.py", "checkpoint_step": str(ck["step"])})
    shutil.copyfile(os.path.join(a.vq, "vq.safetensors"), os.path.join(a.out, "vq.safetensors"))
    shutil.copyfile(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "arserve.json"), "w") as f:
        json.dump(model_config(ck, vq_frag, sampling, a.name), f, indent=2)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(a.out, n)) for n in os.listdir(a.out))
    print("wrote %s (LM step %d, %.2f MB in all)" % (a.out, ck["step"], total / 1e6))


if __name__ == "__main__":
    main()
