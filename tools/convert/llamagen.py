#!/usr/bin/env python3
"""Convert an official FoundationVision/LlamaGen class-to-image checkpoint pair into an arserve
model directory (`raster` family, `architecture: llamagen`, docs/model-format.md).

Reads LlamaGen's released files:

* the GPT, `c2i_B_256.pt` .. `c2i_XXL_384.pt` (class `Transformer` of
  autoregressive/models/gpt.py): its state dict under "model" (DDP), "module" (DeepSpeed),
  "state_dict", or the file itself (FSDP), as sample_c2i.py accepts;
* the image tokenizer, `vq_ds16_c2i.pt` (class `VQModel` of tokenizer/tokenizer_image/vq_model.py):
  its state dict under "model". `encoder.*`, `quant_conv.*` and `quantize.codebook_used`, used
  only to tokenise images, are left out.

and writes OUT_DIR/arserve.json and OUT_DIR/model.safetensors. The GPT's size (GPT-B, -L, -XL,
-XXL, -XXXL, or the text-to-image sizes' shapes) is recognised from its layer count and width,
or given with --gpt-model; a size outside the table needs --n-head. Every tensor name and shape
is checked against the set that size implies; an unrecognised tensor is refused by name. The
fused `wqkv` is kept whole (the engine splits it into q, k and v at load). The image grid is not
in the checkpoints: --image-size (256, 384 or 512), else read from the file name (`_384`), over
the VQ's downsampling (16 for VQ-16).

Text-to-image LlamaGen (a T5 caption encoder, `cls_embedding.cap_proj`) is refused: serving it
needs a T5 encoder, which arserve does not have.

Usage (from the repository root):

    python3 tools/convert/llamagen.py c2i_XL_384.pt vq_ds16_c2i.pt OUT_DIR \\
        [--gpt-model GPT-XL] [--image-size 384] [--n-head N] [--class-names FILE] \\
        [--name NAME] [--dtype f32|f16|bf16|int8|fp8] [--quantize-heads] [--force]

`--dtype` sets the type of the matrices; vectors (biases, norms) keep their stored type. `int8`
and `fp8` store the blocks' Linear weights (wqkv, o, gate, up, down) in 8 bits with one scale
per output row (NAME_scale, docs/model-format.md; `--quantize-heads` adds the head) and every
other tensor as stored (tools/convert/quant.py has the lists). Needs only numpy, and holds one
tensor's chunk at a time: the checkpoints (torch's zip format) are read by
tools/convert/ckpt.py's restricted unpickler, which rebuilds tensors and dicts and refuses any
other object (an argparse.Namespace of training arguments is read as an inert record), so no
code in a checkpoint runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ckpt  # noqa: E402  (tools/convert/ckpt.py: lazy checkpoint reading, streamed writing)
import var as _var  # noqa: E402  (tools/convert/var.py: class names)

ConversionError = ckpt.ConversionError

# gpt.py's GPT_models: name -> (n_layer, n_head, dim). GPT-1B/3B/7B are the text-to-image sizes.
GPT_SIZES = {
    "GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280),
    "GPT-XXL": (48, 24, 1536), "GPT-XXXL": (48, 40, 2560),
    "GPT-1B": (22, 32, 2048), "GPT-3B": (24, 32, 3200), "GPT-7B": (32, 32, 4096),
}
# Not stored in the checkpoints: gpt.py's ModelArgs defaults (rope_base, norm_eps) and
# sample_c2i.py's defaults (cfg 4.0, top-k 2000, top-p 1.0, temperature 1.0).
ROPE_BASE = 10000.0
NORM_EPS = 1e-5
SAMPLING = {"cfg": 4.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}
DERIVED = ("freqs_cis",)  # the RoPE table, if a checkpoint carries it: recomputed by the engine


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

class _Record:
    """An argparse.Namespace (training arguments) in a checkpoint: its fields, nothing run."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})


def load_container(path: str):
    """What torch.save wrote at path: dicts of ckpt.Tensors (nested as saved)."""
    return ckpt.read_file(path, {("argparse", "Namespace"): _Record})


def _is_state_dict(o) -> bool:
    return isinstance(o, dict) and o and all(ckpt.is_tensor(v) for v in o.values())


def state_dict(obj, path: str, keys=("model", "module", "state_dict")) -> dict:
    """The state dict in a checkpoint, found as sample_c2i.py finds it."""
    if isinstance(obj, dict):
        for k in keys:
            if k in obj and _is_state_dict(obj[k]):
                return dict(obj[k])
        if _is_state_dict(obj):
            return dict(obj)
    kinds = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
    raise ConversionError(f"{path}: no state dict of tensors under {', '.join(map(repr, keys))} "
                          f"or at the top level (found {kinds})")


# --------------------------------------------------------------------------------------------
# the GPT
# --------------------------------------------------------------------------------------------

def _need(sd: dict, key: str, where: str, ndim: int) -> np.ndarray:
    if key not in sd:
        raise ConversionError(f"{where}: missing tensor '{key}'")
    t = sd[key]
    if t.ndim != ndim:
        raise ConversionError(f"{where}: '{key}' has shape {list(t.shape)}, expected {ndim} dims")
    return t


def _layers(sd: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    seen = {int(m.group(1)) for k in sd for m in [rx.match(k)] if m}
    n = 0
    while n in seen:
        n += 1
    return n


def gpt_arch(sd: dict, where: str, gpt_model: str | None, n_head: int | None) -> dict:
    """Sizes of the GPT in sd (checked against --gpt-model when given)."""
    if any(k.startswith("cls_embedding.cap_proj") or k == "cls_embedding.uncond_embedding"
           for k in sd):
        raise ConversionError(f"{where}: a text-to-image LlamaGen checkpoint "
                              "(cls_embedding.cap_proj): it needs a T5 caption encoder, which "
                              "arserve does not have; only class-to-image (c2i) checkpoints convert")
    table = _need(sd, "cls_embedding.embedding_table.weight", where, 2)
    tok = _need(sd, "tok_embeddings.weight", where, 2)
    D = int(tok.shape[1])
    n_layer = _layers(sd, r"layers\.(\d+)\.")
    if n_layer == 0:
        raise ConversionError(f"{where}: no 'layers.0.*' tensors")
    named = [k for k, (nl, _, d) in GPT_SIZES.items() if (nl, d) == (n_layer, D)]
    if gpt_model:
        if gpt_model not in GPT_SIZES:
            raise ConversionError(f"--gpt-model {gpt_model}: one of {', '.join(GPT_SIZES)}")
        nl, nh, d = GPT_SIZES[gpt_model]
        if (nl, d) != (n_layer, D):
            raise ConversionError(f"{where}: {n_layer} layers of width {D}, but --gpt-model "
                                  f"{gpt_model} has {nl} of {d}")
        named = [gpt_model]
    if n_head is None:
        if not named:
            raise ConversionError(f"{where}: {n_layer} layers of width {D} is none of "
                                  f"{', '.join(GPT_SIZES)}: give --n-head (the head count is not "
                                  "in the tensors' shapes)")
        n_head = GPT_SIZES[named[0]][1]
    if D % n_head:
        raise ConversionError(f"{where}: width {D} does not split into {n_head} heads")
    hd = D // n_head
    rows = int(_need(sd, "layers.0.attention.wqkv.weight", where, 2).shape[0])
    if (rows - D) % (2 * hd) or rows <= D:
        raise ConversionError(f"{where}: 'layers.0.attention.wqkv.weight' has {rows} rows, not "
                              f"{D} query rows plus two whole numbers of {hd}-wide heads")
    n_kv = (rows - D) // (2 * hd)
    if n_kv != n_head:
        raise ConversionError(f"{where}: {n_kv} key/value heads for {n_head} query heads: "
                              "grouped-query attention is not supported yet")
    if hd % 4:
        raise ConversionError(f"{where}: head width {hd} is not a multiple of 4 (2D RoPE)")
    F = int(_need(sd, "layers.0.feed_forward.w1.weight", where, 2).shape[0])
    V = int(tok.shape[0])
    if int(table.shape[0]) < 2:
        raise ConversionError(f"{where}: the class table has {table.shape[0]} rows")
    return {"name": named[0] if named else None, "L": n_layer, "H": n_head, "D": D, "hd": hd,
            "F": F, "V": V, "classes": int(table.shape[0]) - 1}


def gpt_expected(a: dict) -> dict:
    D, F, V, C = a["D"], a["F"], a["V"], a["classes"]
    t = {"cls_embedding.embedding_table.weight": ("llm.class_embed.weight", (C + 1, D)),
         "tok_embeddings.weight": ("gen.embed.weight", (V, D)),
         "norm.weight": ("llm.norm.weight", (D,)),
         "output.weight": ("gen.head.weight", (V, D))}
    for i in range(a["L"]):
        s, d = f"layers.{i}.", f"llm.layers.{i}."
        t[s + "attention.wqkv.weight"] = (d + "attn.wqkv.weight", (3 * D, D))
        t[s + "attention.wo.weight"] = (d + "attn.o.weight", (D, D))
        t[s + "attention_norm.weight"] = (d + "attn_norm.weight", (D,))
        t[s + "ffn_norm.weight"] = (d + "mlp_norm.weight", (D,))
        t[s + "feed_forward.w1.weight"] = (d + "mlp.gate.weight", (F, D))
        t[s + "feed_forward.w3.weight"] = (d + "mlp.up.weight", (F, D))
        t[s + "feed_forward.w2.weight"] = (d + "mlp.down.weight", (D, F))
    return t


# --------------------------------------------------------------------------------------------
# the VQ model
# --------------------------------------------------------------------------------------------

VQ_DROPPED = re.compile(r"^(?:encoder\.|quant_conv\.|quantize\.codebook_used$)")


def _conv(t: dict, src: str, dst: str, cout: int, cin: int, k: int):
    t[src + ".weight"] = (dst + ".weight", (cout, cin, k, k))
    t[src + ".bias"] = (dst + ".bias", (cout,))


def _norm(t: dict, src: str, dst: str, c: int):
    t[src + ".weight"] = (dst + ".weight", (c,))
    t[src + ".bias"] = (dst + ".bias", (c,))


def _res(t: dict, src: str, dst: str, cin: int, cout: int):
    _norm(t, src + ".norm1", dst + ".norm1", cin)
    _conv(t, src + ".conv1", dst + ".conv1", cout, cin, 3)
    _norm(t, src + ".norm2", dst + ".norm2", cout)
    _conv(t, src + ".conv2", dst + ".conv2", cout, cout, 3)
    if cin != cout:
        _conv(t, src + ".nin_shortcut", dst + ".nin_shortcut", cout, cin, 1)


def _attn(t: dict, src: str, dst: str, c: int):
    _norm(t, src + ".norm", dst + ".norm", c)
    for p in ("q", "k", "v", "proj_out"):
        _conv(t, f"{src}.{p}", f"{dst}.{p}", c, c, 1)


def vq_arch(sd: dict, where: str) -> dict:
    cb = _need(sd, "quantize.embedding.weight", where, 2)
    pq = _need(sd, "post_quant_conv.weight", where, 4)
    n_levels = _layers(sd, r"decoder\.conv_blocks\.(\d+)\.")
    n_res = _layers(sd, r"decoder\.conv_blocks\.0\.res\.(\d+)\.")
    if n_levels == 0 or n_res == 0:
        raise ConversionError(f"{where}: no 'decoder.conv_blocks.0.res.0.*' tensors")
    widths = [int(_need(sd, f"decoder.conv_blocks.{i}.res.0.conv1.weight", where, 4).shape[0])
              for i in range(n_levels)]
    base = widths[-1]  # ch x ch_mult[0], and LlamaGen's ch_mult[0] is 1
    if any(w % base for w in widths):
        raise ConversionError(f"{where}: decoder level widths {widths} are not multiples of the "
                              f"finest level's {base}")
    if any(w % 32 for w in widths):
        raise ConversionError(f"{where}: decoder level widths {widths}: GroupNorm has 32 groups")
    return {"V": int(cb.shape[0]), "E": int(cb.shape[1]), "z": int(pq.shape[0]),
            "levels": n_levels, "n_res": n_res, "widths": widths, "base": base,
            "mult": [w // base for w in reversed(widths)]}


def vq_expected(a: dict) -> dict:
    t = {"quantize.embedding.weight": ("vq.codebook.weight", (a["V"], a["E"]))}
    _conv(t, "post_quant_conv", "vq.post_quant_conv", a["z"], a["E"], 1)
    c = a["widths"][0]
    _conv(t, "decoder.conv_in", "vq.decoder.conv_in", c, a["z"], 3)
    _res(t, "decoder.mid.0", "vq.decoder.mid.block_1", c, c)
    _attn(t, "decoder.mid.1", "vq.decoder.mid.attn_1", c)
    _res(t, "decoder.mid.2", "vq.decoder.mid.block_2", c, c)
    for i, w in enumerate(a["widths"]):
        for j in range(a["n_res"]):
            _res(t, f"decoder.conv_blocks.{i}.res.{j}", f"vq.decoder.up.{i}.block.{j}", c, w)
            c = w
            if i == 0:  # attention after every ResNet block of the coarsest level
                _attn(t, f"decoder.conv_blocks.{i}.attn.{j}", f"vq.decoder.up.{i}.attn.{j}", c)
        if i != a["levels"] - 1:
            _conv(t, f"decoder.conv_blocks.{i}.upsample.conv", f"vq.decoder.up.{i}.upsample.conv",
                  c, c, 3)
    _norm(t, "decoder.norm_out", "vq.decoder.norm_out", c)
    _conv(t, "decoder.conv_out", "vq.decoder.conv_out", 3, c, 3)
    return t


# --------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------

def _take(sd: dict, expected: dict, where: str, skip=lambda k: False) -> dict:
    """{arserve name: tensor} for every expected tensor; refuses strays and bad shapes."""
    stray = sorted(k for k in sd if k not in expected and not skip(k))
    if stray:
        more = f" (and {len(stray) - 5} more)" if len(stray) > 5 else ""
        raise ConversionError(f"{where}: unrecognised tensor{'s' if len(stray) > 1 else ''} "
                              f"{', '.join(stray[:5])}{more}: not part of the LlamaGen "
                              "architecture this converter knows")
    out = {}
    for src, (dst, shape) in expected.items():
        if src not in sd:
            raise ConversionError(f"{where}: missing tensor '{src}'")
        t = sd[src]
        if tuple(t.shape) != tuple(shape):
            raise ConversionError(f"{where}: '{src}' has shape {list(t.shape)}, expected "
                                  f"{list(shape)}")
        if not np.issubdtype(t.dtype, np.floating):
            raise ConversionError(f"{where}: '{src}' has dtype {t.dtype}, expected floating point")
        out[dst] = t
    return out


def image_size_from_name(path: str) -> int | None:
    m = re.search(r"_(\d+)$", os.path.splitext(os.path.basename(path))[0])
    return int(m.group(1)) if m else None


def build(gpt_sd: dict, vq_sd: dict, image_size: int, name: str, gpt_model=None, n_head=None,
          gpt_path="GPT checkpoint", vq_path="VQ checkpoint", class_names=None):
    """Returns (arserve.json dict, {canonical name: ckpt.Tensor}, the GPT's size name)."""
    a = gpt_arch(gpt_sd, gpt_path, gpt_model, n_head)
    q = vq_arch(vq_sd, vq_path)
    if a["V"] != q["V"]:
        raise ConversionError(f"{gpt_path}: 'tok_embeddings.weight' has {a['V']} rows but "
                              f"{vq_path}'s codebook has {q['V']}")
    down = 2 ** (q["levels"] - 1)
    if image_size % down:
        raise ConversionError(f"--image-size {image_size} is not a multiple of the VQ's "
                              f"downsampling {down}")
    grid = image_size // down
    tensors = _take(gpt_sd, gpt_expected(a), gpt_path, lambda k: k in DERIVED)
    tensors.update(_take(vq_sd, vq_expected(q), vq_path, lambda k: bool(VQ_DROPPED.match(k))))
    manifest = {
        "format_version": 1,
        "name": name,
        "family": "raster",
        "architecture": "llamagen",
        "weights": ["model.safetensors"],
        "llm": {
            "hidden_size": a["D"], "num_layers": a["L"], "num_heads": a["H"],
            "num_kv_heads": a["H"], "head_dim": a["hd"], "intermediate_size": a["F"],
            "rms_norm_eps": NORM_EPS, "rope_theta": ROPE_BASE,
        },
        "image": {"grid_height": grid, "grid_width": grid, "codebook_size": q["V"],
                  "embed_dim": q["E"]},
        "condition": {"num_classes": a["classes"]},
        "decoder": {
            "type": "vq16", "latent_channels": q["z"], "base_channels": q["base"],
            "channel_multiplier": q["mult"], "num_res_blocks": q["n_res"] - 1,
            "out_channels": 3, "pixels": "round",
        },
        "sampling": dict(SAMPLING),
    }
    if class_names is not None:
        _var.read_class_names(class_names, a["classes"])
        manifest["condition"]["class_names"] = "classes.txt"
    return manifest, tensors, a["name"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gpt_ckpt", help="LlamaGen c2i GPT checkpoint (c2i_XL_384.pt ...)")
    ap.add_argument("vq_ckpt", help="LlamaGen VQ checkpoint (vq_ds16_c2i.pt)")
    ap.add_argument("out_dir")
    ap.add_argument("--gpt-model", help=f"the GPT's size ({', '.join(GPT_SIZES)}); default: "
                    "recognised from its layers and width")
    ap.add_argument("--n-head", type=int, help="attention heads, for a size outside the table")
    ap.add_argument("--image-size", type=int, help="pixels per side the GPT was trained for "
                    "(default: from the GPT file name, e.g. c2i_XL_384.pt)")
    ap.add_argument("--class-names", help="text file, one class name per line (copied to "
                    "OUT_DIR/classes.txt)")
    ap.add_argument("--name", help="model name (default: the GPT checkpoint's file name)")
    ap.add_argument("--dtype", choices=ckpt.DTYPE_CHOICES, default="f32",
                    help="stored weight type (default f32); int8 and fp8: the blocks' Linear "
                    "weights in 8 bits, the rest as stored")
    ap.add_argument("--quantize-heads", action="store_true",
                    help="with --dtype int8 or fp8, also the head")
    ap.add_argument("--force", action="store_true", help="write into an existing OUT_DIR")
    args = ap.parse_args(argv)
    try:
        image_size = args.image_size or image_size_from_name(args.gpt_ckpt)
        if not image_size or image_size <= 0:
            raise ConversionError(f"{args.gpt_ckpt}: give --image-size (256, 384 or 512): the "
                                  "file name does not say it")
        name = args.name or os.path.splitext(os.path.basename(args.gpt_ckpt))[0].replace("_", "-")
        if os.path.exists(args.out_dir) and not args.force and os.listdir(args.out_dir):
            raise ConversionError(f"{args.out_dir}: exists and is not empty (--force to write "
                                  "into it)")
        gpt_sd = state_dict(load_container(args.gpt_ckpt), args.gpt_ckpt)
        vq_sd = state_dict(load_container(args.vq_ckpt), args.vq_ckpt, keys=("model",))
        manifest, tensors, size = build(gpt_sd, vq_sd, image_size, name, args.gpt_model,
                                        args.n_head, args.gpt_ckpt, args.vq_ckpt,
                                        args.class_names)
        ckpt.write_model(args.out_dir, tensors, args.dtype, "FoundationVision/LlamaGen",
                         "convert/llamagen", manifest, args.quantize_heads)
    except ConversionError as e:
        print(f"convert/llamagen: {e}", file=sys.stderr)
        return 1
    with open(os.path.join(args.out_dir, "arserve.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    if args.class_names:
        shutil.copyfile(args.class_names, os.path.join(args.out_dir, "classes.txt"))
    n = sum(int(np.prod(v.shape)) for v in tensors.values())
    lm, im = manifest["llm"], manifest["image"]
    skipped = [k for k in gpt_sd if k in DERIVED]
    print(f"convert/llamagen: wrote {args.out_dir}: {len(tensors)} tensors ({args.dtype}), "
          f"{n / 1e6:.1f}M parameters; {size or 'GPT'}: {lm['num_layers']} layers x "
          f"{lm['hidden_size']}, {lm['num_heads']} heads, FFN {lm['intermediate_size']}; "
          f"{manifest['condition']['num_classes']} classes + the null class; grid "
          f"{im['grid_height']} x {im['grid_width']} ({image_size} px), codebook "
          f"{im['codebook_size']} x {im['embed_dim']}"
          + (f"; skipped {', '.join(skipped)} (recomputed)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
