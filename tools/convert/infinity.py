#!/usr/bin/env python3
"""Convert an official FoundationVision/Infinity release into an arserve model directory.

Reads Infinity's released files:

* the transformer: `infinity_2b_reg.pth`, a plain state dict saved with torch.save (keys
  `block_chunks.{c}.module.{j}.*`), or Infinity-8B's sharded form, a folder such as
  `infinity_8b_weights/` (an `*.index.json` weight map and its shards, torch or safetensors),
  or a comma-separated list of shard files whose union is the state dict;
* the BSQ-VAE, `infinity_vae_d32reg.pth` / `infinity_vae_d56_f8_14_patchify.pth`:
  `torch.save({"vae": state_dict})` in the checkpoint's own names (`decoder.conv_in.weight`,
  `decoder.mid.block_1.norm1.weight`, ...); the encoder and quantizer are left out;
* the text encoder folder (`flan-t5-xl`): a Hugging Face T5 folder (config.json, safetensors,
  one file or sharded, and tokenizer.json); only the encoder is kept, `decoder.*` and
  `lm_head.weight` of a full T5 checkpoint are dropped;

and writes OUT_DIR/arserve.json, OUT_DIR/model.safetensors and OUT_DIR/tokenizer.json in the
`scale` family's `infinity` layout (tests/golden/infinity_tiny/README.md). Everything but the
schedule is inferred from the tensors' shapes and the T5 config: width, depth, heads, FFN
width, bits per token (and whether the model predicts 2x2-patchified bits, as Infinity-8B
does), text width and length, attentive-pool heads, the decoder's channels and levels. The
schedule comes from `--pn` (0.06M, 0.25M, 0.60M, 1M: 7, 10, 12, 13 scales) and the
aspect-ratio templates of Infinity's `infinity/utils/dynamic_resolution.py` (all 15 by
default, `--ratios` to keep some). Anything the engine cannot run is refused with a message
naming it (SwiGLU, rms_norm=True, cos_attn=False, non-shared AdaLN, a deeper head,
attention in the VAE, a quantizer projection, a non-gated T5, ...).

Usage (from the repository root):

    python3 tools/convert/infinity.py infinity_2b_reg.pth infinity_vae_d32reg.pth flan-t5-xl \\
        OUT_DIR [--pn 1M] [--ratios 1.0,0.5] [--name NAME] [--dtype f32|f16|bf16|int8|fp8] \\
        [--quantize-heads] [--force]

`--dtype` sets the type of the matrices; vectors (biases, norms, scale_mul) keep their stored
type, as the released checkpoints keep them in f32 beside bf16 matrices. `int8` and `fp8` store
the Linear weights of the transformer's and the T5 encoder's blocks in 8 bits with one scale
per output row (NAME_scale, docs/model-format.md; `--quantize-heads` adds the text
projections, word_embed, the shared and head AdaLN and the head) and every other tensor as
stored (tools/convert/quant.py has the lists). Needs only numpy, and
holds one tensor's chunk at a time (tools/convert/ckpt.py): torch checkpoints are read by its
restricted unpickler (tensors and dicts only, so no code in a checkpoint runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import sys

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import ckpt  # noqa: E402  (tools/convert/ckpt.py: lazy checkpoint reading, streamed writing)

_spec = importlib.util.spec_from_file_location("convert_var", os.path.join(_HERE, "var.py"))
_var = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_var)
ConversionError = ckpt.ConversionError

# Not stored in the checkpoints: Infinity's norm_eps (infinity.py, run_infinity.py).
NORM_EPS = 1e-6
# HeatKV's and the 8B notebook's setting; top-k does nothing on two values.
SAMPLING = {"cfg": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 0.0}

# Infinity's aspect-ratio templates (h / w) and the (h, w) of each of the 13 scales of its
# '1M' schedule, from infinity/utils/dynamic_resolution.py at 4c27bbb. Each ratio r also
# serves its inverse, keyed int(1000 / r) / 1000, with h and w swapped. The pn schedules are
# the first 7 (0.06M), 10 (0.25M), 12 (0.60M) or 13 (1M) scales.
RATIO_SCALES = {
    1.000: "1x1 2x2 4x4 6x6 8x8 12x12 16x16 20x20 24x24 32x32 40x40 48x48 64x64",
    1.250: "1x1 2x2 3x3 5x4 10x8 15x12 20x16 25x20 30x24 35x28 45x36 55x44 70x56",
    1.333: "1x1 2x2 4x3 8x6 12x9 16x12 20x15 24x18 28x21 36x27 48x36 60x45 72x54",
    1.500: "1x1 2x2 3x2 6x4 9x6 15x10 21x14 27x18 33x22 39x26 48x32 63x42 78x52",
    1.750: "1x1 2x2 3x3 7x4 11x6 14x8 21x12 28x16 35x20 42x24 56x32 70x40 84x48",
    2.000: "1x1 2x2 4x2 6x3 10x5 16x8 22x11 30x15 38x19 46x23 60x30 74x37 90x45",
    2.500: "1x1 2x2 5x2 10x4 15x6 20x8 25x10 30x12 40x16 50x20 65x26 80x32 100x40",
    3.000: "1x1 2x2 6x2 9x3 15x5 21x7 27x9 36x12 45x15 54x18 72x24 90x30 111x37",
}
PN_SCALES = {"0.06M": 7, "0.25M": 10, "0.60M": 12, "1M": 13}


def templates() -> list[tuple[float, list[tuple[int, int]]]]:
    """[(h_div_w, [(h, w) x 13])] in Infinity's order: each ratio, then its inverse."""
    out = []
    for r, text in RATIO_SCALES.items():
        hw = [tuple(int(x) for x in s.split("x")) for s in text.split()]
        out.append((r, hw))
        if r != 1.0:
            out.append((int(1 / r * 1000) / 1000, [(w, h) for h, w in hw]))
    return out


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def _shards_of(path: str) -> list[str]:
    """The files of a (possibly sharded) checkpoint: a file, a comma-separated list, or a folder
    with an *.index.json weight map (or else all its *.safetensors / *.pth / *.bin files)."""
    if "," in path:
        return [p for p in path.split(",") if p]
    return ckpt.shard_files(path) if os.path.isdir(path) else [path]


def load_infinity(path: str) -> dict:
    return ckpt.read_shards(_shards_of(path), "an Infinity transformer (shard)")


def load_vae(path: str) -> dict:
    obj = ckpt.read_file(path)
    if isinstance(obj, dict) and "vae" in obj and isinstance(obj["vae"], dict):
        obj = obj["vae"]
    return ckpt.state_dict(obj, path, "a BSQ-VAE ({'vae': state_dict})")


def load_t5(folder: str) -> tuple[dict, dict]:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{folder}: no config.json (expected a Hugging Face T5 folder)")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    names = os.listdir(folder)
    if "model.safetensors.index.json" in names:
        files = ckpt.shard_files(folder, ("model.safetensors.index.json",))
    elif "model.safetensors" in names:
        files = [os.path.join(folder, "model.safetensors")]
    elif "pytorch_model.bin" in names:
        files = [os.path.join(folder, "pytorch_model.bin")]
    else:
        raise ConversionError(f"{folder}: no model.safetensors (or its index, or pytorch_model.bin)")
    return cfg, ckpt.read_shards(files, "T5 weights")


# --------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------

def _unknown(where, extra):
    extra = sorted(extra)
    raise ConversionError(f"{where}: tensors arserve does not know how to run: "
                          f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")


def _flatten_blocks(sd: dict, where: str) -> tuple[dict, int]:
    """block_chunks.{c}.module.{j}. -> blocks.{c*per+j}.; blocks.{i}. kept."""
    rx = re.compile(r"block_chunks\.(\d+)\.module\.(\d+)\.(.*)$")
    chunks = {}
    for k in sd:
        m = rx.match(k)
        if m:
            chunks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if chunks and any(k.startswith("blocks.") for k in sd):
        raise ConversionError(f"{where}: both 'block_chunks.*' and 'blocks.*' tensors")
    if not chunks:
        return sd, 0
    n = len(chunks)
    if sorted(chunks) != list(range(n)):
        raise ConversionError(f"{where}: block chunks are not numbered 0..{n - 1}: {sorted(chunks)}")
    per = len(chunks[0])
    for c, js in chunks.items():
        if sorted(js) != list(range(per)):
            raise ConversionError(f"{where}: block chunk {c} holds blocks {sorted(js)}, chunk 0 "
                                  f"holds {per}")
    out = {}
    for k, v in sd.items():
        m = rx.match(k)
        out[f"blocks.{int(m.group(1)) * per + int(m.group(2))}.{m.group(3)}" if m else k] = v
    return out, n


def convert_infinity(sd: dict, where: str) -> tuple[dict, dict]:
    """Infinity transformer state dict -> (facts, canonical inf.* tensors)."""
    sd, _ = _flatten_blocks(sd, where)
    used = set()
    out = {}

    def take(key, want=None):
        t = _var._need(sd, key, where)
        if want is not None:
            _var._shape(t, want, key, where)
        used.add(key)
        return t

    if "class_emb.weight" in sd:
        raise ConversionError(f"{where}: 'class_emb.weight': a class-conditional Infinity "
                              "(text_channels=0); arserve runs the text-to-image models")
    depth = _var._count(sd, r"blocks\.(\d+)\.")
    if depth == 0:
        raise ConversionError(f"{where}: no 'block_chunks.{{c}}.module.{{j}}' or 'blocks.{{i}}' "
                              "tensors: not an Infinity transformer checkpoint (is it the VAE?)")
    pos_start = take("pos_start")
    if pos_start.ndim != 3 or pos_start.shape[:2] != (1, 1):
        raise ConversionError(f"{where}: 'pos_start' has shape {list(pos_start.shape)}, "
                              "expected [1, 1, C]")
    C = pos_start.shape[2]
    out["inf.pos_start"] = pos_start

    # refusals first, each naming the flag the model was built with
    for i in range(depth):
        p = f"blocks.{i}."
        if p + "ada_lin.1.weight" in sd or "shared_ada_lin.1.weight" not in sd:
            raise ConversionError(f"{where}: block {i} has its own AdaLN ('{p}ada_lin.1.weight') "
                                  "or 'shared_ada_lin.1.weight' is missing: a model built with "
                                  "shared_aln=False, which arserve does not run")
        if p + "ffn.fcg.weight" in sd:
            raise ConversionError(f"{where}: '{p}ffn.fcg.weight': a SwiGLU FFN (swiglu=True), "
                                  "which arserve does not run")
        if p + "sa.scale_mul_1H11" not in sd:
            raise ConversionError(f"{where}: no '{p}sa.scale_mul_1H11': self-attention built "
                                  "with cos_attn=False, which arserve does not run")
        if p + "ca_norm.weight" in sd and p + "ca_norm.bias" not in sd:
            raise ConversionError(f"{where}: '{p}ca_norm' has no bias: a model built with "
                                  "rms_norm=True, which arserve does not run")
        if p + "ca_gamma" in sd:
            raise ConversionError(f"{where}: '{p}ca_gamma': cross-attention layer scale "
                                  "(cross_attn_layer_scale >= 0), which arserve does not run")
    if "norm0_ve.weight" in sd:
        raise ConversionError(f"{where}: 'norm0_ve.weight': an input norm (nm0=True), which "
                              "arserve does not run")
    if "head.weight" not in sd and any(k.startswith("head.") for k in sd):
        raise ConversionError(f"{where}: the head is a Sequential "
                              f"({', '.join(sorted(k for k in sd if k.startswith('head.'))[:3])}): "
                              "head_depth > 1 or head_aln=False, which arserve does not run")
    if "head_nm.ada_lin.1.weight" not in sd:
        raise ConversionError(f"{where}: no 'head_nm.ada_lin.1.weight': a model built with "
                              "head_aln=False, which arserve does not run")

    H = sd["blocks.0.sa.scale_mul_1H11"].size
    if C % H:
        raise ConversionError(f"{where}: width {C} is not a multiple of the {H} heads")
    F = _var._need(sd, "blocks.0.ffn.fc1.weight", where, 2).shape[0]

    # text conditioning
    unc = take("cfg_uncond")
    if unc.ndim != 2:
        raise ConversionError(f"{where}: 'cfg_uncond' has shape {list(unc.shape)}")
    text_len = unc.shape[0]
    tn = take("text_norm.weight")
    if tn.ndim != 1:
        raise ConversionError(f"{where}: 'text_norm.weight' has shape {list(tn.shape)}")
    Ct5 = tn.shape[0]
    if unc.shape[1] != Ct5:
        raise ConversionError(f"{where}: 'cfg_uncond' has {unc.shape[1]} columns but "
                              f"'text_norm.weight' has {Ct5} (text_channels): the unconditional "
                              "text features must be as wide as the T5 encoder's")
    out["inf.cfg_uncond"] = unc
    out["inf.text_norm.weight"] = tn
    mat_q = take("text_proj_for_sos.ca.mat_q")
    if mat_q.ndim != 3 or mat_q.shape[0] != 1 or mat_q.shape[1] * mat_q.shape[2] != C:
        raise ConversionError(f"{where}: 'text_proj_for_sos.ca.mat_q' has shape "
                              f"{list(mat_q.shape)}, expected [1, heads, {C} / heads]")
    pool_heads = mat_q.shape[1]
    want_heads = Ct5 // (128 if C <= 4096 else 64)
    if pool_heads != want_heads:
        raise ConversionError(f"{where}: the attentive pool has {pool_heads} heads; Infinity's "
                              f"TextAttentivePool gives {Ct5} // {128 if C <= 4096 else 64} = "
                              f"{want_heads} for text width {Ct5}")
    out["inf.text_proj_for_sos.ca.mat_q"] = mat_q.reshape(C)
    out["inf.text_proj_for_sos.ca.mat_kv.weight"] = take("text_proj_for_sos.ca.mat_kv.weight", (2 * C, Ct5))
    out["inf.text_proj_for_sos.ca.v_bias"] = take("text_proj_for_sos.ca.v_bias", (C,))
    out["inf.text_proj_for_sos.ca.proj.weight"] = take("text_proj_for_sos.ca.proj.weight", (C, C))
    out["inf.text_proj_for_sos.ca.proj.bias"] = take("text_proj_for_sos.ca.proj.bias", (C,))
    out["inf.text_proj_for_ca.0.weight"] = take("text_proj_for_ca.0.weight", (C, Ct5))
    out["inf.text_proj_for_ca.0.bias"] = take("text_proj_for_ca.0.bias", (C,))
    out["inf.text_proj_for_ca.2.weight"] = take("text_proj_for_ca.2.weight", (C, C))
    out["inf.text_proj_for_ca.2.bias"] = take("text_proj_for_ca.2.bias", (C,))

    lvl = take("lvl_embed.weight")
    if lvl.ndim != 2 or lvl.shape[1] != C:
        raise ConversionError(f"{where}: 'lvl_embed.weight' has shape {list(lvl.shape)}")
    out["inf.lvl_embed.weight"] = lvl
    we = take("word_embed.weight")
    if we.ndim != 2 or we.shape[0] != C:
        raise ConversionError(f"{where}: 'word_embed.weight' has shape {list(we.shape)}")
    bits = we.shape[1]
    out["inf.word_embed.weight"] = we
    out["inf.word_embed.bias"] = take("word_embed.bias", (C,))
    out["inf.shared_ada_lin.1.weight"] = take("shared_ada_lin.1.weight", (6 * C, C))
    out["inf.shared_ada_lin.1.bias"] = take("shared_ada_lin.1.bias", (6 * C,))

    for i in range(depth):
        p, q = f"blocks.{i}.", f"inf.blocks.{i}."
        out[q + "ada_gss"] = take(p + "ada_gss", (1, 1, 6, C)).reshape(6, C)
        sm = take(p + "sa.scale_mul_1H11")
        if sm.shape not in ((1, H, 1, 1), (1, 1, H, 1)):
            raise ConversionError(f"{where}: '{p}sa.scale_mul_1H11' has shape {list(sm.shape)}")
        out[q + "sa.scale_mul_1H11"] = sm.reshape(H)
        out[q + "sa.mat_qkv.weight"] = take(p + "sa.mat_qkv.weight", (3 * C, C))
        if p + "sa.mat_qkv.bias" in sd:
            raise ConversionError(f"{where}: '{p}sa.mat_qkv.bias' present: Infinity's key has no bias")
        out[q + "sa.q_bias"] = take(p + "sa.q_bias", (C,))
        out[q + "sa.v_bias"] = take(p + "sa.v_bias", (C,))
        out[q + "sa.proj.weight"] = take(p + "sa.proj.weight", (C, C))
        out[q + "sa.proj.bias"] = take(p + "sa.proj.bias", (C,))
        out[q + "ca_norm.weight"] = take(p + "ca_norm.weight", (C,))
        out[q + "ca_norm.bias"] = take(p + "ca_norm.bias", (C,))
        out[q + "ca.mat_q.weight"] = take(p + "ca.mat_q.weight", (C, C))
        out[q + "ca.mat_q.bias"] = take(p + "ca.mat_q.bias", (C,))
        out[q + "ca.mat_kv.weight"] = take(p + "ca.mat_kv.weight", (2 * C, C))
        out[q + "ca.v_bias"] = take(p + "ca.v_bias", (C,))
        out[q + "ca.proj.weight"] = take(p + "ca.proj.weight", (C, C))
        out[q + "ca.proj.bias"] = take(p + "ca.proj.bias", (C,))
        out[q + "ffn.fc1.weight"] = take(p + "ffn.fc1.weight", (F, C))
        out[q + "ffn.fc1.bias"] = take(p + "ffn.fc1.bias", (F,))
        out[q + "ffn.fc2.weight"] = take(p + "ffn.fc2.weight", (C, F))
        out[q + "ffn.fc2.bias"] = take(p + "ffn.fc2.bias", (C,))
    out["inf.head_nm.ada_lin.1.weight"] = take("head_nm.ada_lin.1.weight", (2 * C, C))
    out["inf.head_nm.ada_lin.1.bias"] = take("head_nm.ada_lin.1.bias", (2 * C,))
    out["inf.head.weight"] = take("head.weight", (2 * bits, C))
    out["inf.head.bias"] = take("head.bias", (2 * bits,))

    # buffers the engine recomputes or never needs
    for k in sd:
        if k.endswith("zero_k_bias"):
            if np.any(sd[k] != 0):
                raise ConversionError(f"{where}: '{k}' is not zero")
            used.add(k)
        elif k in ("lvl_1L", "attn_bias_for_masking", "Infinity_visible_kvlen",
                   "Infinity_invisible_qlen"):
            used.add(k)
    extra = set(sd) - used
    if extra:
        _unknown(where, extra)
    facts = {"C": C, "depth": depth, "H": H, "F": F, "bits": bits, "Ct5": Ct5,
             "text_len": text_len, "pool_heads": pool_heads, "levels": lvl.shape[0]}
    return facts, out


# the layers Infinity's VAE wraps (Conv holds .conv, Normalize holds .norm)
_WRAPPED = {"conv_in", "conv_out", "conv1", "conv2", "nin_shortcut", "conv", "norm1", "norm2",
            "norm_out", "norm", "q", "k", "v", "proj_out"}


def _vae_plain_names(sd: dict, where: str) -> dict:
    """Checkpoint names; a state dict saved from the module (with the wrappers' inner
    '.conv.' / '.norm.') is mapped to them as the official load_cnn maps the other way."""
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if (len(parts) >= 3 and parts[-1] in ("weight", "bias") and parts[-2] in ("conv", "norm")
                and parts[-3] in _WRAPPED):
            parts = parts[:-2] + parts[-1:]
        nk = ".".join(parts)
        if nk in out:
            raise ConversionError(f"{where}: '{k}' and another tensor both name '{nk}'")
        out[nk] = v
    return out


def convert_vae(sd: dict, where: str) -> tuple[dict, dict]:
    """BSQ-VAE state dict -> (decoder facts, canonical vq.decoder.* tensors)."""
    sd = _vae_plain_names(sd, where)
    used = set()
    out = {}
    if not any(k.startswith("decoder.") for k in sd):
        raise ConversionError(f"{where}: no 'decoder.*' tensors: not an Infinity BSQ-VAE "
                              "checkpoint (is it the transformer?)")
    for k in sd:
        if k.startswith(("quantizer.", "quantize.")) and (".project_out." in k or ".project_in." in k):
            raise ConversionError(f"{where}: '{k}': the BSQ quantizer has a projection "
                                  "(codebook_dim != embed dim), which arserve does not run")
        if k.startswith("decoder.") and (".attn_1." in k or re.match(r"decoder\.up\.\d+\.attn\.", k)):
            raise ConversionError(f"{where}: '{k}': attention in the VAE decoder "
                                  "(cnn_attention='yes'), which arserve does not run")

    conv = lambda key, want: _var._conv(sd, key, want, where, used)  # noqa: E731
    n = _var._count(sd, r"decoder\.up\.(\d+)\.")
    if n == 0:
        raise ConversionError(f"{where}: no 'decoder.up.{{i}}' levels")
    nblk = _var._count(sd, r"decoder\.up\.0\.block\.(\d+)\.")
    widths = []
    for lv in range(n):
        b = _var._count(sd, rf"decoder\.up\.{lv}\.block\.(\d+)\.")
        if b != nblk or b == 0:
            raise ConversionError(f"{where}: decoder level {lv} has {b} ResNet blocks, level 0 "
                                  f"has {nblk}; arserve needs the same count on every level")
        widths.append(_var._need(sd, f"decoder.up.{lv}.block.0.conv2.weight", where, 4).shape[0])
    base = 0
    for w in widths:
        base = math.gcd(base, w)
    mult = [w // base for w in widths]
    conv_in = _var._need(sd, "decoder.conv_in.weight", where, 4)
    c0, E = conv_in.shape[0], conv_in.shape[1]
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
            out[dst + nm] = conv(src + nm, shp)
        if cin != cout:
            out[dst + "nin_shortcut.weight"] = conv(src + "nin_shortcut.weight", (cout, cin, 1, 1))
            out[dst + "nin_shortcut.bias"] = conv(src + "nin_shortcut.bias", (cout,))
        elif src + "nin_shortcut.weight" in sd:
            raise ConversionError(f"{where}: '{src}nin_shortcut.weight' on a block of equal widths")

    out["vq.decoder.conv_in.weight"] = conv("decoder.conv_in.weight", (c0, E, 3, 3))
    out["vq.decoder.conv_in.bias"] = conv("decoder.conv_in.bias", (c0,))
    res("decoder.mid.block_1.", "vq.decoder.mid.block_1.", c0, c0)
    res("decoder.mid.block_2.", "vq.decoder.mid.block_2.", c0, c0)
    cin = c0
    for i in range(n):  # canonical up.{i}: applied i-th (coarsest first) = official up.{n-1-i}
        lv = n - 1 - i
        src, dst = f"decoder.up.{lv}.", f"vq.decoder.up.{i}."
        for j in range(nblk):
            res(f"{src}block.{j}.", f"{dst}block.{j}.", cin, widths[lv])
            cin = widths[lv]
        has_up = src + "upsample.conv.weight" in sd
        if i < n - 1 and not has_up:
            raise ConversionError(f"{where}: decoder level up.{lv} has no upsample; arserve "
                                  "needs one on every level but the finest")
        if i == n - 1 and has_up:
            raise ConversionError(f"{where}: the finest decoder level up.{lv} has an upsample")
        if has_up:
            out[dst + "upsample.conv.weight"] = conv(src + "upsample.conv.weight", (cin, cin, 3, 3))
            out[dst + "upsample.conv.bias"] = conv(src + "upsample.conv.bias", (cin,))
    out["vq.decoder.norm_out.weight"] = conv("decoder.norm_out.weight", (cin,))
    out["vq.decoder.norm_out.bias"] = conv("decoder.norm_out.bias", (cin,))
    out["vq.decoder.conv_out.weight"] = conv("decoder.conv_out.weight", (3, cin, 3, 3))
    out["vq.decoder.conv_out.bias"] = conv("decoder.conv_out.bias", (3,))

    # dropped: the encoder and the quantizer (no parameters the decoder uses)
    for k in sd:
        if k.startswith(("encoder.", "quantizer.", "quantize.")):
            used.add(k)
    extra = set(sd) - used
    if extra:
        _unknown(where, extra)
    facts = {"E": E, "base": base, "mult": mult, "num_res_blocks": nblk - 1, "levels": n}
    return facts, out


T5_CONFIG_KEYS = ("d_model", "d_kv", "num_heads", "num_layers", "d_ff", "vocab_size",
                  "relative_attention_num_buckets")


def convert_t5(cfg: dict, sd: dict, where: str) -> tuple[dict, dict, list]:
    """HF T5 config + weights -> (facts, canonical t5.* tensors, notes)."""
    for k in T5_CONFIG_KEYS:
        if not isinstance(cfg.get(k), int):
            raise ConversionError(f"{where}/config.json: no integer '{k}'")
    ffp = cfg.get("feed_forward_proj", "relu")
    if ffp != "gated-gelu":
        raise ConversionError(f"{where}/config.json: feed_forward_proj is {ffp!r}; arserve runs "
                              "T5 v1.1 / flan-t5 encoders (gated-gelu)")
    d, dkv, nh, nl, dff = (cfg[k] for k in ("d_model", "d_kv", "num_heads", "num_layers", "d_ff"))
    nb = cfg["relative_attention_num_buckets"]
    maxd = int(cfg.get("relative_attention_max_distance", 128))
    eps = float(cfg.get("layer_norm_epsilon", 1e-6))
    notes = []
    dropped = [k for k in sd if k.startswith("decoder.") or k == "lm_head.weight"]
    if dropped:
        notes.append(f"dropped {len(dropped)} decoder tensors of the full T5 checkpoint "
                     "(decoder.*, lm_head.weight): Infinity runs the encoder only")
    sd = {k: v for k, v in sd.items() if k not in set(dropped)}
    used = set(dropped)
    out = {}

    def take(key, want):
        t = _var._need(sd, key, where)
        _var._shape(t, want, key, where)
        used.add(key)
        return t

    emb = None
    for k in ("shared.weight", "encoder.embed_tokens.weight"):
        if k in sd:
            if emb is not None and not ckpt.equal(emb, sd[k]):
                raise ConversionError(f"{where}: 'shared.weight' and 'encoder.embed_tokens.weight' differ")
            emb = take(k, (cfg["vocab_size"], d))
    if emb is None:
        raise ConversionError(f"{where}: missing tensor 'shared.weight'")
    out["t5.shared.weight"] = emb
    inner = nh * dkv
    nblocks = _var._count(sd, r"encoder\.block\.(\d+)\.")
    if nblocks != nl:
        raise ConversionError(f"{where}: {nblocks} encoder blocks, config.json says num_layers {nl}")
    for i in range(nl):
        p = f"encoder.block.{i}.layer."
        for nm in "qkv":
            out[f"t5.block.{i}.layer.0.SelfAttention.{nm}.weight"] = take(f"{p}0.SelfAttention.{nm}.weight", (inner, d))
        out[f"t5.block.{i}.layer.0.SelfAttention.o.weight"] = take(f"{p}0.SelfAttention.o.weight", (d, inner))
        rb = f"{p}0.SelfAttention.relative_attention_bias.weight"
        if i == 0:
            out[f"t5.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = take(rb, (nb, nh))
        elif rb in sd:
            raise ConversionError(f"{where}: '{rb}': a relative position bias past layer 0; T5 "
                                  "shares layer 0's")
        out[f"t5.block.{i}.layer.0.layer_norm.weight"] = take(f"{p}0.layer_norm.weight", (d,))
        if f"{p}1.DenseReluDense.wi.weight" in sd:
            raise ConversionError(f"{where}: '{p}1.DenseReluDense.wi.weight': a non-gated FFN")
        out[f"t5.block.{i}.layer.1.DenseReluDense.wi_0.weight"] = take(f"{p}1.DenseReluDense.wi_0.weight", (dff, d))
        out[f"t5.block.{i}.layer.1.DenseReluDense.wi_1.weight"] = take(f"{p}1.DenseReluDense.wi_1.weight", (dff, d))
        out[f"t5.block.{i}.layer.1.DenseReluDense.wo.weight"] = take(f"{p}1.DenseReluDense.wo.weight", (d, dff))
        out[f"t5.block.{i}.layer.1.layer_norm.weight"] = take(f"{p}1.layer_norm.weight", (d,))
    out["t5.final_layer_norm.weight"] = take("encoder.final_layer_norm.weight", (d,))
    extra = set(sd) - used
    if extra:
        _unknown(where, extra)
    facts = {"vocab_size": cfg["vocab_size"], "hidden_size": d, "num_layers": nl,
             "num_heads": nh, "head_dim": dkv, "intermediate_size": dff,
             "relative_buckets": nb, "relative_max_distance": maxd, "norm_eps": eps,
             "eos_id": int(cfg.get("eos_token_id", 1))}
    return facts, out, notes


def build(inf_sd: dict, vae_sd: dict, t5_cfg: dict, t5_sd: dict, pn: str, name: str,
          ratios=None, inf_path="Infinity checkpoint", vae_path="VAE checkpoint",
          t5_path="T5 folder") -> tuple[dict, dict, list]:
    """Returns (arserve.json dict, canonical tensors: ckpt.Tensors, read when written, notes)."""
    if pn not in PN_SCALES:
        raise ConversionError(f"--pn {pn!r}: one of {', '.join(PN_SCALES)}")
    inf, it = convert_infinity(inf_sd, inf_path)
    vq, qt = convert_vae(vae_sd, vae_path)
    tf, tt, notes = convert_t5(t5_cfg, t5_sd, t5_path)
    if inf["Ct5"] != tf["hidden_size"]:
        raise ConversionError(f"{inf_path}: 'cfg_uncond' has {inf['Ct5']} columns (text_channels) "
                              f"but the T5 encoder's d_model is {tf['hidden_size']}")
    if inf["bits"] == vq["E"]:
        patchify = False
    elif inf["bits"] == 4 * vq["E"]:
        patchify = True
    else:
        raise ConversionError(f"{inf_path}: 'word_embed.weight' takes {inf['bits']} bits per token "
                              f"but {vae_path}'s decoder takes {vq['E']} channels (expected equal, "
                              "or 4x with spatial patchify)")
    S = PN_SCALES[pn]
    if inf["levels"] < S:
        raise ConversionError(f"{inf_path}: 'lvl_embed.weight' has {inf['levels']} levels, "
                              f"--pn {pn} has {S} scales")
    stride = 2 ** (vq["levels"] - 1) * (2 if patchify else 1)
    tmpl = templates()
    if ratios is not None:
        keep = []
        for r in ratios:
            hit = [t for t in tmpl if abs(t[0] - r) < 1e-3]
            if not hit:
                raise ConversionError(f"--ratios: {r} is not one of Infinity's aspect-ratio "
                                      f"templates ({', '.join(str(t[0]) for t in tmpl)})")
            keep.append(hit[0])
        tmpl = keep
    sizes = []
    for r, hw in tmpl:
        sc = hw[:S]
        h, w = sc[-1]
        sizes.append({"name": f"{w * stride}x{h * stride}", "scales": [list(x) for x in sc],
                      "rope_grid": list(hw[-1])})
    names = [s["name"] for s in sizes]
    if len(set(names)) != len(names):
        raise ConversionError(f"two aspect-ratio templates give the same size: {names}")
    one = [s["name"] for (r, _), s in zip(tmpl, sizes) if r == 1.0]
    manifest = {
        "format_version": 1,
        "name": name,
        "family": "scale",
        "architecture": "infinity",
        "tokenizer": "tokenizer.json",
        "llm": {
            "hidden_size": inf["C"], "num_layers": inf["depth"], "num_heads": inf["H"],
            "head_dim": inf["C"] // inf["H"], "intermediate_size": inf["F"],
            "norm_eps": NORM_EPS, "shared_adaln": True,
        },
        "text": {
            "vocab_size": tf["vocab_size"], "hidden_size": tf["hidden_size"],
            "num_layers": tf["num_layers"], "num_heads": tf["num_heads"],
            "head_dim": tf["head_dim"], "intermediate_size": tf["intermediate_size"],
            "relative_buckets": tf["relative_buckets"],
            "relative_max_distance": tf["relative_max_distance"], "norm_eps": tf["norm_eps"],
            "max_tokens": inf["text_len"], "pool_heads": inf["pool_heads"], "eos_id": tf["eos_id"],
        },
        "image": {"bits": inf["bits"], "spatial_patchify": patchify,
                  "default_size": one[0] if one else sizes[0]["name"], "sizes": sizes},
        "decoder": {
            "type": "bsq", "latent_channels": vq["E"], "base_channels": vq["base"],
            "channel_multiplier": vq["mult"], "num_res_blocks": vq["num_res_blocks"],
            "out_channels": 3,
        },
        "sampling": dict(SAMPLING),
    }
    return manifest, {**it, **tt, **qt}, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("infinity", help="transformer: a .pth, a shard folder, or shard files a,b,...")
    ap.add_argument("vae", help="BSQ-VAE checkpoint ({'vae': state_dict})")
    ap.add_argument("t5", help="Hugging Face T5 folder (config.json, safetensors, tokenizer.json)")
    ap.add_argument("out_dir")
    ap.add_argument("--pn", default="1M", help="schedule: 0.06M, 0.25M, 0.60M or 1M (default %(default)s)")
    ap.add_argument("--ratios", help="aspect-ratio templates (h/w) to serve, e.g. 1.0,0.5 "
                    "(default: all 15)")
    ap.add_argument("--name", help="model name (default: the transformer's file name)")
    ap.add_argument("--dtype", choices=ckpt.DTYPE_CHOICES, default="f32",
                    help="stored weight type (default f32); int8 and fp8: the blocks' Linear "
                    "weights (T5's too) in 8 bits, the rest as stored")
    ap.add_argument("--quantize-heads", action="store_true",
                    help="with --dtype int8 or fp8, also the text projections, word_embed, "
                    "the AdaLN outside the blocks and the head")
    ap.add_argument("--force", action="store_true", help="write into an existing OUT_DIR")
    args = ap.parse_args(argv)
    try:
        ratios = None
        if args.ratios:
            try:
                ratios = [float(x) for x in args.ratios.split(",")]
            except ValueError:
                raise ConversionError(f"--ratios {args.ratios!r}: comma-separated numbers") from None
        base = os.path.basename(os.path.normpath(args.infinity.split(",")[0]))
        name = args.name or os.path.splitext(base)[0].replace("_", "-")
        if os.path.exists(args.out_dir) and not args.force and os.listdir(args.out_dir):
            raise ConversionError(f"{args.out_dir}: exists and is not empty (--force to write into it)")
        tok = os.path.join(args.t5, "tokenizer.json")
        if not os.path.isfile(tok):
            raise ConversionError(f"{args.t5}: no tokenizer.json (a folder with only spiece.model "
                                  "needs converting with transformers' T5TokenizerFast first)")
        inf_sd = load_infinity(args.infinity)
        vae_sd = load_vae(args.vae)
        t5_cfg, t5_sd = load_t5(args.t5)
        manifest, tensors, notes = build(inf_sd, vae_sd, t5_cfg, t5_sd, args.pn, name, ratios,
                                         args.infinity, args.vae, args.t5)
        for n in notes:
            print(f"convert_infinity: {n}")
        ckpt.write_model(args.out_dir, tensors, args.dtype, "FoundationVision/Infinity",
                         "convert_infinity", manifest, args.quantize_heads)
    except ConversionError as e:
        print(f"convert_infinity: {e}", file=sys.stderr)
        return 1
    with open(os.path.join(args.out_dir, "arserve.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    shutil.copyfile(tok, os.path.join(args.out_dir, "tokenizer.json"))
    n = sum(int(np.prod(v.shape)) for v in tensors.values())
    img = manifest["image"]
    print(f"convert_infinity: wrote {args.out_dir}: {len(tensors)} tensors, {n / 1e6:.2f}M "
          f"parameters, {manifest['llm']['num_layers']} blocks x {manifest['llm']['hidden_size']}, "
          f"{img['bits']} bits{' (patchified)' if img['spatial_patchify'] else ''}, "
          f"{len(img['sizes'])} sizes at {args.pn}, default {img['default_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
