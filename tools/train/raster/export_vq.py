#!/usr/bin/env python3
"""Exports the trained VQ decoder and codebook as a model-directory fragment.

    python tools/train/raster/export_vq.py --ckpt build/train/vq/ckpt.pt --out build/train/vq/export

writes
    OUT/vq.safetensors   the `vq.*` tensors of docs/model-format.md (F16 by default;
                         GroupNorm weights and biases stay F32), nothing else
    OUT/vq.json          the "image" keys it fixes (codebook_size, embed_dim, grid_height,
                         grid_width) and the whole "decoder" section of arserve.json

A model directory lists the file beside its own in arserve.json:
"weights": ["model.safetensors", "vq.safetensors"]. The encoder is not exported; it stays
in the checkpoint (vq_model.VQModel.tokenize turns images into token grids).

The export checks that the tensor names are exactly those the engine loads for this
config, and reports the held-out PSNR of the exported (F16-rounded) decoder with --val.
Needs torch and numpy.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import safetensors_write  # noqa: E402  (tools/safetensors_write.py)
from vq_model import VQModel, to_u8, tokenize_u8  # noqa: E402


def expected_names(cfg):
    """The vq.* names engine/family/vq_decoder.c loads for a decoder config."""
    n = len(cfg["channel_multiplier"])
    widths = [cfg["base_channels"] * cfg["channel_multiplier"][n - 1 - i] for i in range(n)]
    names = ["vq.codebook.weight"]

    def wb(p):
        names.extend([p + ".weight", p + ".bias"])

    def res(p, cin, cout):
        for s in ("norm1", "conv1", "norm2", "conv2"):
            wb(p + "." + s)
        if cin != cout:
            wb(p + ".nin_shortcut")

    def attn(p):
        for s in ("norm", "q", "k", "v", "proj_out"):
            wb(p + "." + s)

    wb("vq.post_quant_conv")
    wb("vq.decoder.conv_in")
    res("vq.decoder.mid.block_1", widths[0], widths[0])
    attn("vq.decoder.mid.attn_1")
    res("vq.decoder.mid.block_2", widths[0], widths[0])
    c = widths[0]
    for i in range(n):
        for j in range(cfg["num_res_blocks"] + 1):
            res("vq.decoder.up.%d.block.%d" % (i, j), c, widths[i])
            c = widths[i]
            if i == 0:
                attn("vq.decoder.up.%d.attn.%d" % (i, j))
        if i != n - 1:
            wb("vq.decoder.up.%d.upsample.conv" % i)
    wb("vq.decoder.norm_out")
    wb("vq.decoder.conv_out")
    return names


def load_model(ckpt_path):
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model = VQModel(ck["config"])
    model.load_state_dict(ck["model"])
    model.eval()
    return model, ck


def vq_tensors(model, dtype=np.float16):
    """{canonical name: numpy array} of the decoder path."""
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("codebook.ema_"):
            continue  # training state of the EMA quantiser
        if k.startswith(("decoder.", "post_quant_conv.", "codebook.")):
            a = v.detach().float().numpy()
            is_norm = ".norm" in k  # GroupNorm affine parameters stay F32
            out["vq." + k] = a.astype(np.float32 if is_norm else dtype)
    return out


def fragment_config(cfg, image_size=128):
    n = len(cfg["channel_multiplier"])
    grid = image_size >> (n - 1)
    return {
        "image": {"grid_height": grid, "grid_width": grid, "codebook_size": cfg["codebook_size"],
                  "embed_dim": cfg["embed_dim"]},
        "decoder": {"type": "vq16", "latent_channels": cfg["latent_channels"],
                    "base_channels": cfg["base_channels"],
                    "channel_multiplier": list(cfg["channel_multiplier"]),
                    "num_res_blocks": cfg["num_res_blocks"], "out_channels": cfg["out_channels"]},
    }


@torch.no_grad()
def psnr_of(model, images, masks=None, bs=32):
    se = []
    for i in range(0, len(images), bs):
        u8 = images[i : i + bs]
        rec = to_u8(model.decode_indices(tokenize_u8(model, u8, masks))).numpy().astype(np.float64)
        se.extend(((rec - u8) ** 2).reshape(len(u8), -1).mean(1).tolist())
    return 10 * math.log10(255.0 ** 2 / float(np.mean(se)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--val", help="npz shard directory: report held-out PSNR before and after export")
    ap.add_argument("--val-images", type=int, default=512)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    model, ck = load_model(a.ckpt)
    cfg = ck["config"]
    tensors = vq_tensors(model, np.float16 if a.dtype == "f16" else np.float32)
    want = set(expected_names(cfg))
    got = set(tensors)
    if want != got:
        sys.exit("tensor names differ from the engine's: missing %s, extra %s" %
                 (sorted(want - got)[:8], sorted(got - want)[:8]))
    os.makedirs(a.out, exist_ok=True)
    safetensors_write.write(os.path.join(a.out, "vq.safetensors"), tensors, metadata={
        "made_by": "tools/train/raster/export_vq.py", "checkpoint_step": str(ck["step"]),
        "config": json.dumps(cfg)})
    frag = fragment_config(cfg)
    with open(os.path.join(a.out, "vq.json"), "w") as f:
        json.dump(frag, f, indent=1)
    nbytes = os.path.getsize(os.path.join(a.out, "vq.safetensors"))
    print("wrote %s/vq.safetensors (%d tensors, %.2f MB) and vq.json, from step %d" % (
        a.out, len(tensors), nbytes / 1e6, ck["step"]))
    print(json.dumps(frag))
    if a.val:
        sys.path.insert(0, ROOT)
        from tools.shapes.dataset import load_shards

        _, val = load_shards(a.val)
        val = val[: a.val_images]
        p32 = psnr_of(model, val, ck.get("codebook_masks"))
        sd = model.state_dict()
        for k, v in tensors.items():
            sd[k[3:]] = torch.from_numpy(v.astype(np.float32))
        model.load_state_dict(sd)
        p16 = psnr_of(model, val, ck.get("codebook_masks"))
        print("held-out PSNR on %d images: %.2f dB (checkpoint), %.2f dB (exported %s)" % (
            len(val), p32, p16, a.dtype))


if __name__ == "__main__":
    main()
