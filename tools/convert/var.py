#!/usr/bin/env python3
"""Convert an official FoundationVision/VAR checkpoint pair into an arserve model directory.

Reads VAR's released files, plain state dicts saved with torch.save:

* the transformer, `var_d16.pth` .. `var_d30.pth` (class `VAR`: `class_emb`, `pos_start`,
  `pos_1LC`, `lvl_embed`, `word_embed`, `blocks.{i}.*`, `head_nm`, `head`);
* the multi-scale VQVAE, `vae_ch160v4096z32.pth` (class `VQVAE`: `quantize.embedding`,
  `quantize.quant_resi.*`, `post_quant_conv`, `decoder.*`; `encoder.*` and `quant_conv`,
  used only to tokenise images, are left out);

and writes OUT_DIR/arserve.json and OUT_DIR/model.safetensors in the `scale` family layout of
docs/model-format.md. Everything is inferred from the tensors' shapes: depth, width and heads
(`scale_mul_1H11`), classes (`class_emb` rows - 1), FFN width, shared or per-block AdaLN,
codebook V x Cvae, Phi count, and the decoder's base channels, channel multipliers and ResNet
blocks per level. Only the scales cannot be inferred from shapes: `--patch-nums` (default VAR's
256-pixel 1,2,3,4,5,6,8,10,13,16; its 512-pixel models use 1,2,3,4,6,9,13,18,24,32) must add up
to the rows of `pos_1LC`. Anything the engine cannot run is refused with a message naming it
(VAR trained without attn_l2_norm, a zero Phi ratio, a decoder without attention, ...).

Usage (from the repository root):

    python3 tools/convert/var.py var_d16.pth vae_ch160v4096z32.pth OUT_DIR \\
        [--patch-nums 1,2,3,4,5,6,8,10,13,16] [--class-names FILE] [--name NAME] \\
        [--dtype f32|f16|bf16|int8|fp8] [--quantize-heads] [--force]

`--dtype` sets the type of the matrices; vectors (biases, norms, scale_mul) keep their stored
type. `int8` and `fp8` store the blocks' Linear weights (AdaLN, qkv, proj, fc1, fc2) in 8 bits
with one scale per output row (NAME_scale, docs/model-format.md; `--quantize-heads` adds
word_embed, the shared and head AdaLN and the head) and every other tensor as stored
(tools/convert/quant.py has the lists). Needs only numpy, and holds one tensor's chunk at a time (tools/convert/ckpt.py): the
checkpoints (torch's zip format) are read by a restricted unpickler that rebuilds tensors and
ordered dicts and refuses any other object, so no code in a checkpoint runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402  (tools/convert/ckpt.py: lazy checkpoint reading, streamed writing)

VAR_256_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
# Not stored in the checkpoints: VAR's build_vae_var (models/__init__.py) and VQVAE defaults.
NORM_EPS = 1e-6
PHI_RATIO = 0.5
# VAR's FID setting (README "sampling": cfg 1.5, top_k 900, top_p 0.96).
SAMPLING = {"cfg": 1.5, "temperature": 1.0, "top_k": 900, "top_p": 0.96}


ConversionError = ckpt.ConversionError


def load_checkpoint(path: str) -> dict:
    """A torch.save'd state dict as {name: ckpt.Tensor}, values read only when written."""
    return ckpt.state_dict(ckpt.read_file(path), path, "a state dict (as VAR releases)")


# --------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------

def _need(sd: dict, key: str, where: str, ndim: int | None = None) -> np.ndarray:
    if key not in sd:
        raise ConversionError(f"{where}: missing tensor '{key}'")
    t = sd[key]
    if ndim is not None and t.ndim != ndim:
        raise ConversionError(f"{where}: '{key}' has shape {list(t.shape)}, expected {ndim} dims")
    return t


def _shape(t: np.ndarray, want: tuple, key: str, where: str) -> np.ndarray:
    if tuple(t.shape) != tuple(want):
        raise ConversionError(f"{where}: '{key}' has shape {list(t.shape)}, expected {list(want)}")
    return t


def _count(sd: dict, pattern: str) -> int:
    """Number of consecutive indices i from 0 for which some key matches pattern % i."""
    rx = re.compile(pattern)
    seen = {int(m.group(1)) for k in sd for m in [rx.match(k)] if m}
    n = 0
    while n in seen:
        n += 1
    if seen and max(seen) >= n:
        raise ConversionError(f"indices of '{pattern}' are not consecutive from 0: {sorted(seen)}")
    return n


def convert_var(sd: dict, patch_nums, where: str) -> tuple[dict, dict]:
    """VAR transformer state dict -> (llm/image/condition facts, canonical tensors)."""
    used = set()

    def take(key, want=None):
        t = _need(sd, key, where)
        if want is not None:
            _shape(t, want, key, where)
        used.add(key)
        return t

    depth = _count(sd, r"blocks\.(\d+)\.")
    if depth == 0:
        raise ConversionError(f"{where}: no 'blocks.{{i}}' tensors: not a VAR transformer "
                              "checkpoint (is it the VQVAE?)")
    cls = take("class_emb.weight")
    if cls.ndim != 2 or cls.shape[0] < 2:
        raise ConversionError(f"{where}: 'class_emb.weight' has shape {list(cls.shape)}")
    num_classes, C = cls.shape[0] - 1, cls.shape[1]
    if "blocks.0.attn.scale_mul_1H11" not in sd:
        raise ConversionError(
            f"{where}: no 'blocks.0.attn.scale_mul_1H11': the model was built with "
            "attn_l2_norm=False (scaled dot-product attention with scale 0.25/sqrt(head_dim)); "
            "arserve runs VAR's released attn_l2_norm=True models only")
    H = sd["blocks.0.attn.scale_mul_1H11"].size
    if C % H:
        raise ConversionError(f"{where}: width {C} is not a multiple of the {H} heads "
                              "(from scale_mul_1H11)")
    F = _need(sd, "blocks.0.ffn.fc1.weight", where, 2).shape[0]
    shared = "shared_ada_lin.1.weight" in sd
    S = len(patch_nums)
    L = sum(p * p for p in patch_nums)
    first_l = patch_nums[0] ** 2

    out = {}
    out["var.class_embed.weight"] = cls
    pos_start = take("pos_start")
    if pos_start.ndim != 3 or pos_start.shape[0] != 1 or pos_start.shape[2] != C:
        raise ConversionError(f"{where}: 'pos_start' has shape {list(pos_start.shape)}, "
                              f"expected [1, first_l, {C}]")
    if pos_start.shape[1] != first_l:
        raise ConversionError(f"{where}: 'pos_start' has {pos_start.shape[1]} rows but the first "
                              f"scale {patch_nums[0]} has {first_l} tokens: --patch-nums "
                              f"{','.join(map(str, patch_nums))} does not match the checkpoint")
    out["var.pos_start"] = pos_start[0]
    pos = take("pos_1LC")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != C:
        raise ConversionError(f"{where}: 'pos_1LC' has shape {list(pos.shape)}, expected [1, L, {C}]")
    if pos.shape[1] != L:
        raise ConversionError(
            f"{where}: 'pos_1LC' has {pos.shape[1]} positions but --patch-nums "
            f"{','.join(map(str, patch_nums))} add up to {L} tokens; pass the scales the model "
            "was trained with (VAR 256 px: 1,2,3,4,5,6,8,10,13,16; 512 px: 1,2,3,4,6,9,13,18,24,32)")
    out["var.pos_embed"] = pos[0]
    lvl = take("lvl_embed.weight")
    if lvl.shape != (S, C):
        raise ConversionError(f"{where}: 'lvl_embed.weight' has shape {list(lvl.shape)}: "
                              f"{lvl.shape[0]} levels, but --patch-nums has {S} scales")
    out["var.level_embed.weight"] = lvl
    we = take("word_embed.weight")
    if we.ndim != 2 or we.shape[0] != C:
        raise ConversionError(f"{where}: 'word_embed.weight' has shape {list(we.shape)}")
    Cvae = we.shape[1]
    out["var.word_embed.weight"] = we
    out["var.word_embed.bias"] = take("word_embed.bias", (C,))
    if shared:
        out["var.shared_adaln.weight"] = take("shared_ada_lin.1.weight", (6 * C, C))
        out["var.shared_adaln.bias"] = take("shared_ada_lin.1.bias", (6 * C,))
    for i in range(depth):
        p, q = f"blocks.{i}.", f"var.blocks.{i}."
        if shared:
            out[q + "adaln_gss"] = take(p + "ada_gss", (1, 1, 6, C)).reshape(6, C)
        else:
            if p + "ada_lin.1.weight" not in sd:
                raise ConversionError(f"{where}: block {i} has neither 'ada_lin.1.weight' nor a "
                                      "shared AdaLN table")
            out[q + "adaln.weight"] = take(p + "ada_lin.1.weight", (6 * C, C))
            out[q + "adaln.bias"] = take(p + "ada_lin.1.bias", (6 * C,))
        out[q + "attn.qkv.weight"] = take(p + "attn.mat_qkv.weight", (3 * C, C))
        if p + "attn.mat_qkv.bias" in sd:
            raise ConversionError(f"{where}: '{p}attn.mat_qkv.bias' present: VAR's key has no bias")
        if p + "attn.zero_k_bias" in sd:
            zk = take(p + "attn.zero_k_bias", (C,))
            if np.any(zk != 0):
                raise ConversionError(f"{where}: '{p}attn.zero_k_bias' is not zero")
        out[q + "attn.q_bias"] = take(p + "attn.q_bias", (C,))
        out[q + "attn.v_bias"] = take(p + "attn.v_bias", (C,))
        sm = p + "attn.scale_mul_1H11"
        if sm not in sd:
            raise ConversionError(f"{where}: no '{sm}': block {i} was built with "
                                  "attn_l2_norm=False, which arserve does not run")
        out[q + "attn.scale_mul"] = take(sm, (1, H, 1, 1)).reshape(H)
        out[q + "attn.proj.weight"] = take(p + "attn.proj.weight", (C, C))
        out[q + "attn.proj.bias"] = take(p + "attn.proj.bias", (C,))
        out[q + "ffn.fc1.weight"] = take(p + "ffn.fc1.weight", (F, C))
        out[q + "ffn.fc1.bias"] = take(p + "ffn.fc1.bias", (F,))
        out[q + "ffn.fc2.weight"] = take(p + "ffn.fc2.weight", (C, F))
        out[q + "ffn.fc2.bias"] = take(p + "ffn.fc2.bias", (C,))
    out["var.head_adaln.weight"] = take("head_nm.ada_lin.1.weight", (2 * C, C))
    out["var.head_adaln.bias"] = take("head_nm.ada_lin.1.bias", (2 * C,))
    head = take("head.weight")
    if head.ndim != 2 or head.shape[1] != C:
        raise ConversionError(f"{where}: 'head.weight' has shape {list(head.shape)}; "
                              "a Sequential head is not supported")
    V = head.shape[0]
    out["var.head.weight"] = head
    out["var.head.bias"] = take("head.bias", (V,))

    # buffers the engine recomputes (level ids, causal mask)
    for k in ("lvl_1L", "attn_bias_for_masking"):
        if k in sd:
            used.add(k)
    extra = sorted(set(sd) - used)
    if extra:
        raise ConversionError(f"{where}: tensors arserve does not know how to run: "
                              f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    facts = {"C": C, "depth": depth, "H": H, "F": F, "shared": shared, "V": V, "Cvae": Cvae,
             "num_classes": num_classes}
    return facts, out


def _conv(sd, key, want, where, used):
    t = _need(sd, key, where)
    _shape(t, want, key, where)
    used.add(key)
    return t


def convert_vae(sd: dict, where: str) -> tuple[dict, dict]:
    """VQVAE state dict -> (codebook/decoder facts, canonical vq.* tensors)."""
    used = set()
    out = {}
    if not any(k.startswith("decoder.") for k in sd):
        raise ConversionError(f"{where}: no 'decoder.*' tensors: not a VAR VQVAE checkpoint "
                              "(is it the transformer?)")
    emb = _need(sd, "quantize.embedding.weight", where, 2)
    V, E = emb.shape
    used.add("quantize.embedding.weight")
    out["vq.codebook.weight"] = emb

    # Phi: PhiPartiallyShared (qresi_ls.{k}), PhiShared (qresi), PhiNonShared ({k})
    if "quantize.quant_resi.qresi.weight" in sd:
        phis = ["quantize.quant_resi.qresi."]
    else:
        n = _count(sd, r"quantize\.quant_resi\.qresi_ls\.(\d+)\.")
        if n:
            phis = [f"quantize.quant_resi.qresi_ls.{k}." for k in range(n)]
        else:
            n = _count(sd, r"quantize\.quant_resi\.(\d+)\.")
            phis = [f"quantize.quant_resi.{k}." for k in range(n)]
    if not phis:
        raise ConversionError(f"{where}: no Phi convolutions ('quantize.quant_resi.*'): the VQVAE "
                              "was built with quant_resi=0 (identity Phi), which arserve does not run")
    for k, p in enumerate(phis):
        out[f"vq.phi.{k}.weight"] = _conv(sd, p + "weight", (E, E, 3, 3), where, used)
        out[f"vq.phi.{k}.bias"] = _conv(sd, p + "bias", (E,), where, used)
    out["vq.post_quant_conv.weight"] = _conv(sd, "post_quant_conv.weight", (E, E, 3, 3), where, used)
    out["vq.post_quant_conv.bias"] = _conv(sd, "post_quant_conv.bias", (E,), where, used)

    # decoder: levels in VAR's numbering (0 = finest); canonical up.{i} = VAR up.{n-1-i}
    n = _count(sd, r"decoder\.up\.(\d+)\.")
    if n == 0:
        raise ConversionError(f"{where}: no 'decoder.up.{{i}}' levels")
    nblk = _count(sd, r"decoder\.up\.0\.block\.(\d+)\.")
    if nblk == 0:
        raise ConversionError(f"{where}: decoder level 0 has no ResNet blocks")
    widths = []
    for lv in range(n):
        b = _count(sd, rf"decoder\.up\.{lv}\.block\.(\d+)\.")
        if b != nblk:
            raise ConversionError(f"{where}: decoder level {lv} has {b} ResNet blocks, level 0 "
                                  f"has {nblk}; arserve needs the same count on every level")
        widths.append(_need(sd, f"decoder.up.{lv}.block.0.conv2.weight", where, 4).shape[0])
    base = 0
    for w in widths:
        base = math.gcd(base, w)
    mult = [w // base for w in widths]
    conv_in = _need(sd, "decoder.conv_in.weight", where, 4)
    c0 = conv_in.shape[0]
    if c0 != widths[-1]:
        raise ConversionError(f"{where}: 'decoder.conv_in.weight' has {c0} output channels, the "
                              f"coarsest level has {widths[-1]}")
    for w in [c0] + widths:
        if w % 32:
            raise ConversionError(f"{where}: decoder width {w} is not a multiple of 32 "
                                  "(GroupNorm with 32 groups)")

    def res(src, dst, cin, cout):
        for nm, shp in (("norm1.weight", (cin,)), ("norm1.bias", (cin,)),
                        ("conv1.weight", (cout, cin, 3, 3)), ("conv1.bias", (cout,)),
                        ("norm2.weight", (cout,)), ("norm2.bias", (cout,)),
                        ("conv2.weight", (cout, cout, 3, 3)), ("conv2.bias", (cout,))):
            out[dst + nm] = _conv(sd, src + nm, shp, where, used)
        if cin != cout:
            out[dst + "nin_shortcut.weight"] = _conv(sd, src + "nin_shortcut.weight",
                                                     (cout, cin, 1, 1), where, used)
            out[dst + "nin_shortcut.bias"] = _conv(sd, src + "nin_shortcut.bias", (cout,), where, used)
        elif src + "nin_shortcut.weight" in sd:
            raise ConversionError(f"{where}: '{src}nin_shortcut.weight' on a block of equal widths")

    def attn(src, dst, c):
        if src + "qkv.weight" not in sd:
            raise ConversionError(f"{where}: no '{src}qkv.weight': the decoder was built without "
                                  "self-attention (using_sa/using_mid_sa False), which arserve "
                                  "does not run")
        for nm in ("norm.weight", "norm.bias"):
            out[dst + nm] = _conv(sd, src + nm, (c,), where, used)
        w = _conv(sd, src + "qkv.weight", (3 * c, c, 1, 1), where, used)
        b = _conv(sd, src + "qkv.bias", (3 * c,), where, used)
        for j, nm in enumerate("qkv"):
            out[f"{dst}{nm}.weight"] = w[j * c:(j + 1) * c]
            out[f"{dst}{nm}.bias"] = b[j * c:(j + 1) * c]
        out[dst + "proj_out.weight"] = _conv(sd, src + "proj_out.weight", (c, c, 1, 1), where, used)
        out[dst + "proj_out.bias"] = _conv(sd, src + "proj_out.bias", (c,), where, used)

    out["vq.decoder.conv_in.weight"] = _conv(sd, "decoder.conv_in.weight", (c0, E, 3, 3), where, used)
    out["vq.decoder.conv_in.bias"] = _conv(sd, "decoder.conv_in.bias", (c0,), where, used)
    res("decoder.mid.block_1.", "vq.decoder.mid.block_1.", c0, c0)
    attn("decoder.mid.attn_1.", "vq.decoder.mid.attn_1.", c0)
    res("decoder.mid.block_2.", "vq.decoder.mid.block_2.", c0, c0)
    cin = c0
    for i in range(n):
        lv = n - 1 - i
        src, dst = f"decoder.up.{lv}.", f"vq.decoder.up.{i}."
        cout = widths[lv]
        nattn = _count(sd, rf"decoder\.up\.{lv}\.attn\.(\d+)\.")
        if i == 0 and nattn != nblk:
            raise ConversionError(f"{where}: the coarsest decoder level (VAR's up.{lv}) has "
                                  f"{nattn} attention blocks for {nblk} ResNet blocks; arserve "
                                  "needs one after each (using_sa=True)")
        if i > 0 and nattn:
            raise ConversionError(f"{where}: decoder level up.{lv} has attention blocks; arserve "
                                  "runs attention on the coarsest level only")
        for j in range(nblk):
            res(f"{src}block.{j}.", f"{dst}block.{j}.", cin, cout)
            cin = cout
            if i == 0:
                attn(f"{src}attn.{j}.", f"{dst}attn.{j}.", cout)
        if i < n - 1:
            out[dst + "upsample.conv.weight"] = _conv(sd, src + "upsample.conv.weight",
                                                      (cout, cout, 3, 3), where, used)
            out[dst + "upsample.conv.bias"] = _conv(sd, src + "upsample.conv.bias", (cout,), where, used)
        elif src + "upsample.conv.weight" in sd:
            raise ConversionError(f"{where}: the finest decoder level up.{lv} has an upsample")
    out["vq.decoder.norm_out.weight"] = _conv(sd, "decoder.norm_out.weight", (cin,), where, used)
    out["vq.decoder.norm_out.bias"] = _conv(sd, "decoder.norm_out.bias", (cin,), where, used)
    out["vq.decoder.conv_out.weight"] = _conv(sd, "decoder.conv_out.weight", (3, cin, 3, 3), where, used)
    out["vq.decoder.conv_out.bias"] = _conv(sd, "decoder.conv_out.bias", (3,), where, used)

    # dropped: the encoder side and training statistics
    for k in sd:
        if (k.startswith("encoder.") or k.startswith("quant_conv.")
                or k == "quantize.ema_vocab_hit_SV"):
            used.add(k)
    extra = sorted(set(sd) - used)
    if extra:
        raise ConversionError(f"{where}: tensors arserve does not know how to run: "
                              f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    facts = {"V": V, "E": E, "phi_count": len(phis), "base": base, "mult": mult,
             "num_res_blocks": nblk - 1, "levels": n}
    return facts, out


def read_class_names(path: str, num_classes: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        names = f.read().splitlines()
    if names and names[-1] == "":
        names.pop()
    if len(names) != num_classes:
        raise ConversionError(f"{path}: {len(names)} class names, the checkpoint has "
                              f"{num_classes} classes (class_emb rows - 1)")
    seen = set()
    for i, nm in enumerate(names):
        if not nm.strip():
            raise ConversionError(f"{path}: line {i + 1} is empty")
        if nm in seen:
            raise ConversionError(f"{path}: class name {nm!r} appears twice")
        seen.add(nm)
    return names


def build(var_sd: dict, vae_sd: dict, patch_nums, name: str, var_path="VAR checkpoint",
          vae_path="VQVAE checkpoint", class_names: str | None = None) -> tuple[dict, dict]:
    """Returns (arserve.json dict, canonical tensors: ckpt.Tensors, read when written)."""
    patch_nums = tuple(int(p) for p in patch_nums)
    if len(patch_nums) < 2 or any(p <= 0 for p in patch_nums) or \
            any(b <= a for a, b in zip(patch_nums, patch_nums[1:])):
        raise ConversionError(f"--patch-nums {','.join(map(str, patch_nums))}: need at least two "
                              "scales, positive and strictly increasing")
    vf, vt = convert_var(var_sd, patch_nums, var_path)
    qf, qt = convert_vae(vae_sd, vae_path)
    if vf["V"] != qf["V"]:
        raise ConversionError(f"{var_path}: 'head.weight' predicts {vf['V']} codes but "
                              f"{vae_path} has a codebook of {qf['V']}")
    if vf["Cvae"] != qf["E"]:
        raise ConversionError(f"{var_path}: 'word_embed.weight' takes {vf['Cvae']} channels but "
                              f"{vae_path}'s codebook is {qf['E']} wide")
    manifest = {
        "format_version": 1,
        "name": name,
        "family": "scale",
        "architecture": "var",
        "weights": ["model.safetensors"],
        "llm": {
            "hidden_size": vf["C"], "num_layers": vf["depth"], "num_heads": vf["H"],
            "head_dim": vf["C"] // vf["H"], "intermediate_size": vf["F"],
            "norm_eps": NORM_EPS, "shared_adaln": vf["shared"],
        },
        "image": {
            "scales": list(patch_nums), "codebook_size": qf["V"], "embed_dim": qf["E"],
            "phi_count": qf["phi_count"], "phi_ratio": PHI_RATIO,
        },
        "condition": {"num_classes": vf["num_classes"]},
        "decoder": {
            "type": "msvq", "latent_channels": qf["E"], "base_channels": qf["base"],
            "channel_multiplier": qf["mult"], "num_res_blocks": qf["num_res_blocks"],
            "out_channels": 3,
        },
        "sampling": dict(SAMPLING),
    }
    if class_names is not None:
        read_class_names(class_names, vf["num_classes"])
        manifest["condition"]["class_names"] = "classes.txt"
    return manifest, {**vt, **qt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("var_ckpt", help="VAR transformer state dict (var_d16.pth ...)")
    ap.add_argument("vae_ckpt", help="VQVAE state dict (vae_ch160v4096z32.pth)")
    ap.add_argument("out_dir")
    ap.add_argument("--patch-nums", default=",".join(map(str, VAR_256_PATCH_NUMS)),
                    help="side of each scale, coarsest first (default VAR 256 px: %(default)s)")
    ap.add_argument("--class-names", help="text file, one class name per line (copied to "
                    "OUT_DIR/classes.txt)")
    ap.add_argument("--name", help="model name (default: the VAR checkpoint's file name)")
    ap.add_argument("--dtype", choices=ckpt.DTYPE_CHOICES, default="f32",
                    help="stored weight type (default f32); int8 and fp8: the blocks' Linear "
                    "weights in 8 bits, the rest as stored")
    ap.add_argument("--quantize-heads", action="store_true",
                    help="with --dtype int8 or fp8, also word_embed, the AdaLN outside the "
                    "blocks and the head")
    ap.add_argument("--force", action="store_true", help="write into an existing OUT_DIR")
    args = ap.parse_args(argv)
    try:
        try:
            patch_nums = [int(x) for x in args.patch_nums.split(",")]
        except ValueError:
            raise ConversionError(f"--patch-nums {args.patch_nums!r}: comma-separated integers") from None
        name = args.name or os.path.splitext(os.path.basename(args.var_ckpt))[0].replace("_", "-")
        if os.path.exists(args.out_dir) and not args.force and os.listdir(args.out_dir):
            raise ConversionError(f"{args.out_dir}: exists and is not empty (--force to write "
                                  "into it)")
        var_sd = load_checkpoint(args.var_ckpt)
        vae_sd = load_checkpoint(args.vae_ckpt)
        manifest, tensors = build(var_sd, vae_sd, patch_nums, name, args.var_ckpt,
                                  args.vae_ckpt, args.class_names)
        ckpt.write_model(args.out_dir, tensors, args.dtype, "FoundationVision/VAR", "convert_var",
                         manifest, args.quantize_heads)
    except ConversionError as e:
        print(f"convert_var: {e}", file=sys.stderr)
        return 1
    with open(os.path.join(args.out_dir, "arserve.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    if args.class_names:
        shutil.copyfile(args.class_names, os.path.join(args.out_dir, "classes.txt"))
    n = sum(int(np.prod(v.shape)) for v in tensors.values())
    print(f"convert_var: wrote {args.out_dir}: {len(tensors)} tensors, {n / 1e6:.1f}M parameters, "
          f"{manifest['llm']['num_layers']} blocks x {manifest['llm']['hidden_size']}, "
          f"scales {patch_nums}, {manifest['image']['scales'][-1] * 2 ** (len(manifest['decoder']['channel_multiplier']) - 1)} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
