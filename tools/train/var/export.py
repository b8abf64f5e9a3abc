#!/usr/bin/env python3
"""Writes the model directory of the shapes VAR model from the training checkpoints:
arserve.json, model-0000K-of-0000N.safetensors (every tensor the engine's `var` / `msvq` path
loads, docs/model-format.md "The `scale` family"; matrices and convolutions in F16, vectors
-- biases, norms, level multipliers -- in F32; in shards of at most SHARD_BYTES, name order)
and classes.txt (one class name per line, the
order of tools/train/var/data.py).

    .venv-tools/bin/python tools/train/var/export.py --vq build/train_var/msvq/ckpt.pt \\
        --var build/train_var/var/ckpt.pt --out models/shapes-var \\
        --cfg 3.0 --temperature 1.0 --top-k 0 --top-p 1.0

Tensor names: the VAR modules of var_model.py are named as the `var.*` tensors (module
name = tensor name after `var.`); of the tokenizer, `vq.codebook.weight`,
`vq.phi.{k}.{weight,bias}` (msvq.Phi.conv), `vq.post_quant_conv.*` (3x3) and
`vq.decoder.*` (the vq16 decoder names).
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
import data  # noqa: E402
import safetensors_write  # noqa: E402
from msvq import MSVQ  # noqa: E402
from train_util import load_weights  # noqa: E402
from var_model import VAR  # noqa: E402


def vq_tensors(vq):
    out = {}
    for k, v in vq.state_dict().items():
        if k.startswith("encoder."):
            continue
        if k.startswith("phi."):
            i, _, rest = k[len("phi."):].partition(".conv.")
            name = "vq.phi.%s.%s" % (i, rest)
        else:
            name = "vq." + k
        out[name] = stored(v)
    return out


SHARD_BYTES = 8_000_000


def shards(tensors):
    """[(file name, {name: array})], tensors in name order, each shard at most SHARD_BYTES."""
    groups, cur, size = [], {}, 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if cur and size + n > SHARD_BYTES:
            groups.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += n
    groups.append(cur)
    return [("model-%05d-of-%05d.safetensors" % (i + 1, len(groups)), g)
            for i, g in enumerate(groups)]


def load_exported(model_dir):
    """An exported model directory's tensors back under the modules' names: (the MSVQ's
    decoder, post_quant_conv, codebook and Phi; the VAR's), as vq_tensors and var_tensors
    named them, in F32 (8-bit weights times their scales)."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        sys.exit("--init %s: no *.safetensors (an export.py model directory?)" % model_dir)
    vq, var = {}, {}
    for f in files:
        for name, t in load_weights(os.path.join(model_dir, f)).items():
            if name.startswith("vq.phi."):
                i, _, rest = name[len("vq.phi."):].partition(".")
                vq["phi.%s.conv.%s" % (i, rest)] = t
            elif name.startswith("vq."):
                vq[name[len("vq."):]] = t
            elif name.startswith("var."):
                var[name[len("var."):]] = t
    return vq, var


def load_into(module, tensors, where, leave=()):
    """module.load_state_dict(tensors), every name but those starting with `leave` required;
    exits naming the first tensor that is missing, extra or of another shape."""
    want = {k: v for k, v in module.state_dict().items() if not k.startswith(tuple(leave))}
    bad = sorted(set(want) ^ set(tensors)) or [k for k in want if want[k].shape != tensors[k].shape]
    if bad:
        sys.exit("--init %s: %s differs from this run's model (--config as it was trained)" % (where, bad[0]))
    module.load_state_dict(tensors, strict=False)


def stored(v):
    """F16 for matrices and convolutions (2 or more dims), F32 for vectors."""
    a = v.detach().float().numpy()
    if a.ndim >= 2:
        assert np.abs(a).max() < 65504, "a weight outside F16's range"
        return a.astype(np.float16)
    return a.astype(np.float32)


def var_tensors(var):
    return {"var." + k: stored(v) for k, v in var.state_dict().items()}


def config(vq, var, name, sampling, files):
    vc, mc = vq.cfg, var.cfg
    return {
        "format_version": 1,
        "name": name,
        "family": "scale",
        "architecture": "var",
        "weights": files,
        "llm": {"hidden_size": mc["width"], "num_layers": mc["depth"], "num_heads": mc["heads"],
                "head_dim": mc["width"] // mc["heads"], "intermediate_size": mc["ffn"],
                "norm_eps": 1e-6, "shared_adaln": bool(mc.get("shared_adaln", False))},
        "image": {"scales": list(vc["scales"]), "codebook_size": vc["codebook_size"],
                  "embed_dim": vc["embed_dim"], "phi_count": vc["phi_count"], "phi_ratio": vc["phi_ratio"]},
        "condition": {"num_classes": mc["num_classes"], "class_names": "classes.txt"},
        "decoder": {"type": "msvq", "latent_channels": vc["embed_dim"], "base_channels": vc["base_channels"],
                    "channel_multiplier": list(vc["channel_multiplier"]), "num_res_blocks": vc["num_res_blocks"],
                    "out_channels": vc["out_channels"]},
        "sampling": sampling,
    }


def load_ckpts(vq_path, var_path):
    ck = torch.load(vq_path, map_location="cpu", weights_only=False)
    vq = MSVQ(ck["config"])
    vq.load_state_dict(ck["model"])
    ck = torch.load(var_path, map_location="cpu", weights_only=False)
    var = VAR(ck["config"])
    var.load_state_dict(ck["model"])
    return vq.eval(), var.eval()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vq", required=True)
    ap.add_argument("--var", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="shapes-var")
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args(argv)
    vq, var = load_ckpts(a.vq, a.var)
    assert var.cfg["num_classes"] == data.NUM_CLASSES
    os.makedirs(a.out, exist_ok=True)
    files = shards({**vq_tensors(vq), **var_tensors(var)})
    for name, t in files:
        safetensors_write.write(os.path.join(a.out, name), t)
    sampling = {"cfg": a.cfg, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
    with open(os.path.join(a.out, "arserve.json"), "w") as f:
        json.dump(config(vq, var, a.name, sampling, [n for n, _ in files]), f, indent=2)
        f.write("\n")
    with open(os.path.join(a.out, "classes.txt"), "w") as f:
        f.write("".join(n + "\n" for n in data.CLASS_NAMES))
    for name, t in files:
        print("wrote %s/%s: %d tensors, %.1f MB" % (a.out, name, len(t),
                                                   os.path.getsize(os.path.join(a.out, name)) / 1e6))


if __name__ == "__main__":
    main()
