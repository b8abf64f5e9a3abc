#!/usr/bin/env python3
"""Convert a Hugging Face Janus / Janus-Pro checkpoint into an arserve model directory.

Reads a checkpoint directory in either of its two public layouts:

* transformers (`JanusForConditionalGeneration`, config `model_type: "janus"`):
  config.json + model.safetensors or model-0000N-of-0000M.safetensors shards, tensor names
  `model.language_model.*`, `model.generation_embeddings`, `model.generation_aligner.*`,
  `model.generation_head.*`, `model.vqmodel.*`;
* deepseek-ai's original release (`MultiModalityCausalLM`, config `model_type:
  "multi_modality"`): config.json + pickled pytorch_model*.bin shards (or safetensors), tensor
  names `language_model.model.*`, `gen_embed`, `gen_aligner.layers.*`, `gen_head.*`,
  `gen_vision_model.*`.

and writes (docs/model-format.md):

* `arserve.json`: architecture from the config, prompt template and special-token names taken
  from the tokenizer files, default sampling parameters from generation_config.json;
* `model.safetensors`: the generation path only, under arserve's canonical tensor names (the
  understanding vision tower and aligner, the text lm_head, quant_conv and the VQ encoder are
  left out), every tensor's shape checked against the config;
* `tokenizer.json`: copied unchanged.

Usage (from the repository root):

    python3 tools/convert/janus.py SRC_DIR OUT_DIR [--dtype f32|f16|bf16|keep|int8|fp8]
        [--quantize-heads]

`--dtype` sets the type of the matrices; `keep` (the default) keeps each tensor's stored type
(the deepseek release is bf16), and vectors (norms) always keep theirs. `int8` and `fp8` store
the transformer blocks' Linear weights in 8 bits with one scale per output row (NAME_scale,
docs/model-format.md; `--quantize-heads` adds the aligner and the head) and every other tensor
as stored (tools/convert/quant.py has the lists). Needs only numpy, and
holds one tensor's chunk at a time (tools/convert/ckpt.py): pickled shards are read by its
restricted unpickler (tensors and dicts only, so no code in a checkpoint runs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402  (tools/convert/ckpt.py: lazy checkpoint reading, streamed writing)

# Janus-Pro's prompt (deepseek's "deepseek" SFT format with an empty system prompt). The engine
# prepends BOS and appends the image-start token.
JANUS_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
# Janus-Pro's special tokens, used only when no tokenizer file names them.
JANUS_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
JANUS_PAD = "<\uff5c\u2581pad\u2581\uff5c>"
JANUS_BOI = "<begin_of_image>"

# transformers' LlamaConfig defaults: deepseek's language_config leaves most keys out.
LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
}
# transformers' JanusVQVAEConfig defaults.
VQ_DEFAULTS = {
    "embed_dim": 8,
    "num_embeddings": 16384,
    "latent_channels": 256,
    "base_channels": 128,
    "channel_multiplier": [1, 1, 2, 2, 4],
    "num_res_blocks": 2,
    "out_channels": 3,
    "projection_dim": 2048,
    "num_hidden_layers": 2,
    "hidden_act": "gelu",
    "image_token_embed_dim": 2048,
}
# deepseek's VQ-16 ignores its config entirely: these are the sizes it always builds.
VQ16_FIXED = {
    "latent_channels": 256,
    "base_channels": 128,
    "channel_multiplier": [1, 1, 2, 2, 4],
    "num_res_blocks": 2,
    "out_channels": 3,
}

OUT_DTYPES = ("f32", "f16", "bf16", "keep", "int8", "fp8")


ConvertError = ckpt.ConversionError


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConvertError(f"{path}: not valid JSON: {e}") from e


def detect_layout(config: dict, path: str) -> str:
    mt = config.get("model_type")
    if mt == "janus" or "text_config" in config:
        return "transformers"
    if mt == "multi_modality" or "language_config" in config:
        return "deepseek"
    raise ConvertError(
        f"{path}: model_type is {mt!r}; expected 'janus' (transformers) or 'multi_modality' "
        "(deepseek-ai's original release)"
    )


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConvertError(msg)


def llm_section(text: dict, where: str) -> dict:
    """The `llm` section of arserve.json from a Llama config dict."""
    t = dict(LLAMA_DEFAULTS)
    t.update({k: v for k, v in text.items() if v is not None or k not in t})
    heads = int(t["num_attention_heads"])
    hidden = int(t["hidden_size"])
    kv = int(t["num_key_value_heads"] or heads)
    head_dim = int(t["head_dim"] or hidden // heads)

    rope = t.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    theta = rope.get("rope_theta", t["rope_theta"])
    scaling = t.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
    _require(rope_type == "default", f"{where}: RoPE type {rope_type!r} is not supported (only plain RoPE)")
    _require(t["hidden_act"] == "silu",
             f"{where}: hidden_act is {t['hidden_act']!r}; the engine implements SiLU")
    _require(not t["attention_bias"], f"{where}: attention_bias is set; the engine has no attention biases")
    _require(not t["mlp_bias"], f"{where}: mlp_bias is set; the engine has no MLP biases")
    _require(heads % kv == 0, f"{where}: {heads} heads is not a multiple of {kv} key/value heads")
    # The engine's own words (engine/model_config.c), so that a checkpoint it
    # would refuse at load is refused here, before any weight is read.
    _require(kv == heads,
             f"{where}: 'llm.num_kv_heads' ({kv}) differs from 'llm.num_heads' ({heads}): "
             "grouped-query attention is not supported yet")
    return {
        "vocab_size": int(t["vocab_size"]),
        "hidden_size": hidden,
        "num_layers": int(t["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": int(t["intermediate_size"]),
        "rms_norm_eps": float(t["rms_norm_eps"]),
        "rope_theta": float(theta),
    }


def arch_from_transformers(cfg: dict, where: str) -> dict:
    _require(isinstance(cfg.get("text_config"), dict), f"{where}: missing 'text_config'")
    llm = llm_section(cfg["text_config"], f"{where} (text_config)")
    vq = dict(VQ_DEFAULTS)
    vq.update(cfg.get("vq_config") or {})
    vision = cfg.get("vision_config") or {}

    image_size = vision.get("image_size", 384)
    patch_size = vision.get("patch_size", 16)
    image_size = image_size[0] if isinstance(image_size, (list, tuple)) else image_size
    patch_size = patch_size[0] if isinstance(patch_size, (list, tuple)) else patch_size
    grid = int(vq.get("num_patches") or image_size // patch_size)
    _require(
        grid == image_size // patch_size,
        f"{where}: vq_config.num_patches ({grid}) differs from vision image_size/patch_size "
        f"({image_size}/{patch_size})",
    )
    n_image = vision.get("num_image_tokens")
    _require(
        n_image is None or int(n_image) == grid * grid,
        f"{where}: vision_config.num_image_tokens ({n_image}) is not the {grid} x {grid} = "
        f"{grid * grid} tokens of the generation grid (image_size {image_size} / patch_size "
        f"{patch_size})",
    )
    _require(vq["hidden_act"] == "gelu",
             f"{where}: vq_config.hidden_act is {vq['hidden_act']!r}; expected 'gelu'")
    L = llm["hidden_size"]
    _require(
        int(vq["projection_dim"]) == L,
        f"{where}: vq_config.projection_dim ({vq['projection_dim']}) must equal the LLM hidden size ({L}): "
        "the generation aligner feeds the LLM",
    )
    _require(
        int(vq["image_token_embed_dim"]) == L,
        f"{where}: vq_config.image_token_embed_dim ({vq['image_token_embed_dim']}) must equal the LLM hidden "
        f"size ({L}): the generation head reads the LLM's last hidden state",
    )
    return {
        "llm": llm,
        "image": {
            "grid_height": grid,
            "grid_width": grid,
            "codebook_size": int(vq["num_embeddings"]),
            "embed_dim": int(vq["embed_dim"]),
            "aligner_layers": int(vq["num_hidden_layers"]),
            "head_hidden_size": int(vq["projection_dim"]),
        },
        "decoder": {
            "type": "vq16",
            "latent_channels": int(vq["latent_channels"]),
            "base_channels": int(vq["base_channels"]),
            "channel_multiplier": [int(m) for m in vq["channel_multiplier"]],
            "num_res_blocks": int(vq["num_res_blocks"]),
            "out_channels": int(vq["out_channels"]),
        },
    }


def arch_from_deepseek(cfg: dict, where: str) -> dict:
    def params(key: str) -> dict:
        sub = cfg.get(key)
        _require(isinstance(sub, dict), f"{where}: missing '{key}'")
        return sub.get("params") or {}

    llm = llm_section(cfg.get("language_config") or {}, f"{where} (language_config)")
    L = llm["hidden_size"]
    gv, ga, gh = params("gen_vision_config"), params("gen_aligner_config"), params("gen_head_config")
    cls = cfg["gen_vision_config"].get("cls")
    _require(cls == "VQ-16", f"{where}: gen_vision_config.cls is {cls!r}; only 'VQ-16' is supported")
    _require(
        ga.get("projector_type", "mlp_gelu") == "mlp_gelu",
        f"{where}: gen_aligner_config projector_type {ga.get('projector_type')!r} is not supported",
    )
    K, E = int(gv.get("image_token_size", 16384)), int(gv.get("n_embed", 8))
    for key, want, got in (
        ("gen_aligner_config.params.input_dim", E, ga.get("input_dim", E)),
        ("gen_aligner_config.params.n_embed", L, ga.get("n_embed", L)),
        ("gen_head_config.params.n_embed", L, gh.get("n_embed", L)),
        ("gen_head_config.params.image_token_size", K, gh.get("image_token_size", K)),
    ):
        _require(int(got) == want, f"{where}: {key} is {got}, expected {want}")
    decoder = {"type": "vq16", **VQ16_FIXED}
    levels = len(decoder["channel_multiplier"])
    # The generation image is the understanding encoder's size (384 for Janus-Pro), one VQ
    # token per 2^(levels-1) pixels.
    image_size = int((cfg.get("vision_config") or {}).get("params", {}).get("image_size", 384))
    grid = image_size >> (levels - 1)
    return {
        "llm": llm,
        "image": {
            "grid_height": grid,
            "grid_width": grid,
            "codebook_size": K,
            "embed_dim": E,
            "aligner_layers": int(ga.get("depth", 1)),
            "head_hidden_size": int(gh.get("image_token_embed", L)),
        },
        "decoder": decoder,
    }


def validate_arch(arch: dict, where: str) -> None:
    llm, im, dec = arch["llm"], arch["image"], arch["decoder"]
    for sec, d in (("llm", llm), ("image", im)):
        for k, v in d.items():
            _require(v > 0, f"{where}: {sec}.{k} is {v}; it must be positive")
    _require(llm["head_dim"] % 2 == 0, f"{where}: head_dim {llm['head_dim']} is odd (RoPE rotates pairs)")
    _require(im["aligner_layers"] >= 1, f"{where}: the generation aligner needs at least one layer")
    _require(dec["base_channels"] > 0 and dec["num_res_blocks"] >= 0, f"{where}: bad decoder sizes {dec}")
    _require(dec["out_channels"] == 3, f"{where}: decoder out_channels is {dec['out_channels']}, expected 3")
    for m in dec["channel_multiplier"]:
        width = dec["base_channels"] * m
        _require(
            width % 32 == 0,
            f"{where}: decoder level width {dec['base_channels']}*{m} = {width} is not a multiple of 32 "
            "(GroupNorm has 32 groups)",
        )


# --------------------------------------------------------------------------------------------
# Canonical names and expected shapes
# --------------------------------------------------------------------------------------------


def _res_block(prefix: str, cin: int, cout: int) -> dict:
    t = {
        f"{prefix}.norm1.weight": (cin,),
        f"{prefix}.norm1.bias": (cin,),
        f"{prefix}.conv1.weight": (cout, cin, 3, 3),
        f"{prefix}.conv1.bias": (cout,),
        f"{prefix}.norm2.weight": (cout,),
        f"{prefix}.norm2.bias": (cout,),
        f"{prefix}.conv2.weight": (cout, cout, 3, 3),
        f"{prefix}.conv2.bias": (cout,),
    }
    if cin != cout:
        t[f"{prefix}.nin_shortcut.weight"] = (cout, cin, 1, 1)
        t[f"{prefix}.nin_shortcut.bias"] = (cout,)
    return t


def _attn_block(prefix: str, c: int) -> dict:
    t = {f"{prefix}.norm.weight": (c,), f"{prefix}.norm.bias": (c,)}
    for p in ("q", "k", "v", "proj_out"):
        t[f"{prefix}.{p}.weight"] = (c, c, 1, 1)
        t[f"{prefix}.{p}.bias"] = (c,)
    return t


def expected_shapes(arch: dict) -> dict:
    """Canonical name -> shape for every tensor the engine reads, in a fixed order."""
    llm, im, dec = arch["llm"], arch["image"], arch["decoder"]
    L, V, F = llm["hidden_size"], llm["vocab_size"], llm["intermediate_size"]
    q_out = llm["num_heads"] * llm["head_dim"]
    kv_out = llm["num_kv_heads"] * llm["head_dim"]
    K, E, G = im["codebook_size"], im["embed_dim"], im["head_hidden_size"]

    t = {"llm.embed.weight": (V, L)}
    for i in range(llm["num_layers"]):
        p = f"llm.layers.{i}"
        t.update(
            {
                f"{p}.attn_norm.weight": (L,),
                f"{p}.attn.q.weight": (q_out, L),
                f"{p}.attn.k.weight": (kv_out, L),
                f"{p}.attn.v.weight": (kv_out, L),
                f"{p}.attn.o.weight": (L, q_out),
                f"{p}.mlp_norm.weight": (L,),
                f"{p}.mlp.gate.weight": (F, L),
                f"{p}.mlp.up.weight": (F, L),
                f"{p}.mlp.down.weight": (L, F),
            }
        )
    t["llm.norm.weight"] = (L,)
    t["gen.embed.weight"] = (K, E)
    for j in range(im["aligner_layers"]):
        t[f"gen.aligner.{j}.weight"] = (L, E if j == 0 else L)
        t[f"gen.aligner.{j}.bias"] = (L,)
    t.update(
        {
            "gen.head.fc1.weight": (G, L),
            "gen.head.fc1.bias": (G,),
            "gen.head.fc2.weight": (K, G),
            "gen.head.fc2.bias": (K,),
            "vq.codebook.weight": (K, E),
        }
    )

    latent, base, mult = dec["latent_channels"], dec["base_channels"], dec["channel_multiplier"]
    n = len(mult)
    t["vq.post_quant_conv.weight"] = (latent, E, 1, 1)
    t["vq.post_quant_conv.bias"] = (latent,)
    c = base * mult[n - 1]
    t["vq.decoder.conv_in.weight"] = (c, latent, 3, 3)
    t["vq.decoder.conv_in.bias"] = (c,)
    t.update(_res_block("vq.decoder.mid.block_1", c, c))
    t.update(_attn_block("vq.decoder.mid.attn_1", c))
    t.update(_res_block("vq.decoder.mid.block_2", c, c))
    for i in range(n):  # i = 0 is the coarsest level, applied first
        cout = base * mult[n - 1 - i]
        for j in range(dec["num_res_blocks"] + 1):
            t.update(_res_block(f"vq.decoder.up.{i}.block.{j}", c, cout))
            c = cout
            if i == 0:
                t.update(_attn_block(f"vq.decoder.up.{i}.attn.{j}", c))
        if i != n - 1:
            t[f"vq.decoder.up.{i}.upsample.conv.weight"] = (c, c, 3, 3)
            t[f"vq.decoder.up.{i}.upsample.conv.bias"] = (c,)
    t["vq.decoder.norm_out.weight"] = (c,)
    t["vq.decoder.norm_out.bias"] = (c,)
    t["vq.decoder.conv_out.weight"] = (dec["out_channels"], c, 3, 3)
    t["vq.decoder.conv_out.bias"] = (dec["out_channels"],)
    return t


_LLM_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_MID = {"0": "block_1", "1": "attn_1", "2": "block_2"}

# Parts of a checkpoint the generation path does not use.
_SKIP = re.compile(
    r"^(?:model\.)?(?:vision_model|aligner)\."  # understanding encoder and its aligner
    r"|^(?:model\.language_model\.|language_model\.)?lm_head\."  # text head
    r"|\.rotary_emb\.inv_freq$"  # recomputed buffers in old Llama checkpoints
    r"|^(?:model\.vqmodel|gen_vision_model)\.(?:encoder\.|quant_conv\.|quantize\.codebook_used)"
)


def _vq_name(rest: str) -> str | None:
    if rest == "quantize.embedding.weight":
        return "vq.codebook.weight"
    m = re.fullmatch(r"post_quant_conv\.(weight|bias)", rest)
    if m:
        return f"vq.{rest}"
    if not rest.startswith("decoder."):
        return None
    d = rest[len("decoder.") :]
    if re.fullmatch(r"(conv_in|norm_out|conv_out)\.(weight|bias)", d):
        return f"vq.decoder.{d}"
    m = re.fullmatch(r"mid\.(block_1|attn_1|block_2|0|1|2)\.(.+)", d)
    if m:
        return f"vq.decoder.mid.{_MID.get(m[1], m[1])}.{m[2]}"
    m = re.fullmatch(r"(?:up|conv_blocks)\.(\d+)\.(block|res|attn)\.(\d+)\.(.+)", d)
    if m:
        kind = "block" if m[2] in ("block", "res") else "attn"
        return f"vq.decoder.up.{m[1]}.{kind}.{m[3]}.{m[4]}"
    m = re.fullmatch(r"(?:up|conv_blocks)\.(\d+)\.upsample\.conv\.(weight|bias)", d)
    if m:
        return f"vq.decoder.up.{m[1]}.upsample.conv.{m[2]}"
    return None


def canonical_name(name: str) -> str | None:
    """arserve's name for a checkpoint tensor; None if the generation path does not use it.

    Raises ConvertError for a name it does not recognise at all."""
    if _SKIP.search(name):
        return None
    m = re.fullmatch(r"(?:model\.language_model|language_model\.model)\.(.+)", name)
    if m:
        rest = m[1]
        if rest == "embed_tokens.weight":
            return "llm.embed.weight"
        if rest == "norm.weight":
            return "llm.norm.weight"
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m and m[2] in _LLM_LAYER:
            return f"llm.layers.{m[1]}.{_LLM_LAYER[m[2]]}"
    elif name in ("model.generation_embeddings.weight", "gen_embed.weight"):
        return "gen.embed.weight"
    elif m := re.fullmatch(r"model\.generation_aligner\.fc1\.(weight|bias)", name):
        return f"gen.aligner.0.{m[1]}"
    elif m := re.fullmatch(r"model\.generation_aligner\.hidden_layers\.(\d+)\.(weight|bias)", name):
        return f"gen.aligner.{int(m[1]) + 1}.{m[2]}"
    elif m := re.fullmatch(r"gen_aligner\.layers\.(\d+)\.(weight|bias)", name):
        # deepseek's MlpProjector is Sequential(Linear, GELU, Linear, ...): Linears at even indices.
        idx = int(m[1])
        if idx % 2:
            raise ConvertError(f"{name}: parameters at an odd (GELU) position of gen_aligner.layers")
        return f"gen.aligner.{idx // 2}.{m[2]}"
    elif m := re.fullmatch(
        r"(?:model\.generation_head\.proj_out|gen_head\.output_mlp_projector)\.(weight|bias)", name
    ):
        return f"gen.head.fc1.{m[1]}"
    elif m := re.fullmatch(r"(?:model\.generation_head|gen_head)\.vision_head\.(weight|bias)", name):
        return f"gen.head.fc2.{m[1]}"
    elif m := re.fullmatch(r"(?:model\.vqmodel|gen_vision_model)\.(.+)", name):
        out = _vq_name(m[1])
        if out:
            return out
    raise ConvertError(f"unrecognised tensor name '{name}': not part of a Janus checkpoint")


# --------------------------------------------------------------------------------------------
# Checkpoint loading
# --------------------------------------------------------------------------------------------


def checkpoint_files(src: str) -> list[str]:
    """The weight files of a checkpoint directory, safetensors preferred over pickles."""
    for index_name, pattern in (
        ("model.safetensors.index.json", "model*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        if os.path.isfile(os.path.join(src, index_name)):
            return ckpt.shard_files(src, (index_name,))
        files = sorted(glob.glob(os.path.join(src, pattern)))
        if files:
            return files
    raise ConvertError(f"{src}: no model*.safetensors or pytorch_model*.bin weight files")


def file_tensors(path: str) -> dict:
    """{name: ckpt.Tensor} of one weight file (a state dict, or one under "state_dict")."""
    sd = ckpt.read_file(path)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    return ckpt.state_dict(sd, path, "Janus weights")


def load_weights(src: str, arch: dict) -> dict:
    """Canonical name -> ckpt.Tensor for the generation path, checked against the config."""
    want = expected_shapes(arch)
    got: dict = {}
    origin: dict[str, str] = {}
    problems = []
    for path in checkpoint_files(src):
        print(f"reading {os.path.basename(path)}")
        for name, t in file_tensors(path).items():
            canon = canonical_name(name)
            if canon is None:
                continue
            if canon in origin:
                raise ConvertError(f"'{name}' and '{origin[canon]}' both map to '{canon}'")
            if canon not in want:
                problems.append(f"  {name} -> {canon}: not expected for this config")
                continue
            if tuple(t.shape) != want[canon]:
                problems.append(f"  {name} -> {canon}: shape {tuple(t.shape)}, config says {want[canon]}")
                origin[canon] = name
                continue
            if t.stored not in ckpt.FLOATS:
                raise ConvertError(f"{name}: tensor of type {t.stored} is not a float tensor")
            got[canon] = t
            origin[canon] = name
    missing = [k for k in want if k not in origin]
    if missing:
        more = " ..." if len(missing) > 20 else ""
        problems.append(f"  missing ({len(missing)}): " + ", ".join(missing[:20]) + more)
    if problems:
        raise ConvertError("checkpoint does not match its config:\n" + "\n".join(problems))
    return {k: got[k] for k in want}


# --------------------------------------------------------------------------------------------
# Tokenizer and prompt
# --------------------------------------------------------------------------------------------


def tokenizer_vocab(tok: dict) -> dict:
    """token text -> id over the model vocabulary and the added tokens of a tokenizer.json."""
    vocab = {}
    model_vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update(model_vocab)
    elif isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
        vocab.update({p[0]: i for i, p in enumerate(model_vocab)})
    for a in tok.get("added_tokens") or []:
        vocab[a["content"]] = a["id"]
    return vocab


def _token_text(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def prompt_tokens(src: str, vocab: dict, args) -> dict:
    """Names of BOS, pad and begin-of-image. First found wins: the command line, deepseek's
    processor_config.json, special_tokens_map.json, tokenizer_config.json, the ids in
    generation_config.json, Janus-Pro's names. Each must be in tokenizer.json and, unless given on
    the command line, agree with generation_config.json's ids (what transformers' generate uses)."""
    found = {
        "bos_token": args.bos_token,
        "pad_token": args.pad_token,
        "image_start_token": args.image_start_token,
    }
    sources = []
    proc = read_json(os.path.join(src, "processor_config.json")) or {}  # deepseek's VLChatProcessor
    sources.append({"pad_token": proc.get("pad_tag"), "image_start_token": proc.get("image_start_tag")})
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        d = read_json(os.path.join(src, fname)) or {}
        extra = d.get("extra_special_tokens")
        sources.append(
            {
                "bos_token": _token_text(d.get("bos_token")),
                "pad_token": _token_text(d.get("pad_token")),
                "image_start_token": _token_text(d.get("boi_token"))
                or (_token_text(extra.get("boi_token")) if isinstance(extra, dict) else None),
            }
        )
    id_to_text = {i: s for s, i in vocab.items()}
    gen = read_json(os.path.join(src, "generation_config.json")) or {}
    gen_ids = {
        "bos_token": gen.get("bos_token_id"),
        "pad_token": gen.get("pad_token_id"),
        # transformers' Janus generate reads generation_kwargs["boi_token_id"]
        "image_start_token": gen.get("boi_token_id",
                                     (gen.get("generation_kwargs") or {}).get("boi_token_id")),
    }
    sources.append({k: id_to_text.get(v) for k, v in gen_ids.items() if isinstance(v, int)})
    sources.append({"bos_token": JANUS_BOS, "pad_token": JANUS_PAD, "image_start_token": JANUS_BOI})
    given = {k for k in found if found[k]}  # named on the command line: not cross-checked
    for s in sources:
        for k, v in s.items():
            if not found.get(k) and v:
                found[k] = v
    for k, name in found.items():
        _require(name in vocab, f"{src}: the {k} '{name}' is not in tokenizer.json")
        want_id = gen_ids.get(k)
        _require(
            k in given or not isinstance(want_id, int) or vocab[name] == want_id,
            f"{src}: {k} '{name}' has id {vocab[name]} in tokenizer.json but generation_config.json says "
            f"{want_id}",
        )
    return found


def sampling_section(src: str) -> dict:
    gen = read_json(os.path.join(src, "generation_config.json")) or {}
    cfg = gen.get("guidance_scale") or 5.0
    temperature = gen.get("temperature") or 1.0
    return {"cfg": float(cfg), "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def convert(args) -> None:
    src, out = args.src, args.out
    config_path = os.path.join(src, "config.json")
    config = read_json(config_path)
    _require(config is not None, f"{src}: no config.json")
    layout = detect_layout(config, config_path)
    arch = (arch_from_transformers if layout == "transformers" else arch_from_deepseek)(config, config_path)
    validate_arch(arch, config_path)
    print(f"{layout} layout: {arch['llm']['num_layers']} layers, hidden {arch['llm']['hidden_size']}, "
          f"codebook {arch['image']['codebook_size']}, grid {arch['image']['grid_height']}")

    tok_path = os.path.join(src, "tokenizer.json")
    tok = read_json(tok_path)
    _require(tok is not None, f"{src}: no tokenizer.json (arserve reads the HF tokenizers format)")
    vocab = tokenizer_vocab(tok)
    prompt = {"template": args.template, **prompt_tokens(src, vocab, args)}
    _require(prompt["template"].count("{prompt}") == 1, "--template must contain '{prompt}' exactly once")

    weights = load_weights(src, arch)

    manifest = {
        "format_version": 1,
        "name": args.name or os.path.basename(os.path.normpath(src)),
        "family": "raster",
        "architecture": "janus",
        "weights": ["model.safetensors"],
        "tokenizer": "tokenizer.json",
        **arch,
        "prompt": prompt,
        "sampling": sampling_section(src),
    }
    ckpt.write_model(out, weights, args.dtype, f"deepseek-ai/Janus ({layout} layout)",
                     "convert_janus", manifest, args.quantize_heads)
    shutil.copyfile(tok_path, os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "arserve.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    n_params = sum(int(np.prod(shape)) for shape in expected_shapes(arch).values())
    print(f"wrote {out}: {len(weights)} tensors, {n_params / 1e6:.2f}M parameters")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="Hugging Face Janus checkpoint directory")
    p.add_argument("out", help="arserve model directory to write")
    p.add_argument("--dtype", choices=sorted(OUT_DTYPES), default="keep",
                   help="weight type in model.safetensors (default: keep the stored type); "
                   "int8 and fp8: the blocks' Linear weights in 8 bits, the rest as stored")
    p.add_argument("--quantize-heads", action="store_true",
                   help="with --dtype int8 or fp8, also the aligner and the head")
    p.add_argument("--name", help="model name in arserve.json (default: the source directory's name)")
    p.add_argument("--template", default=JANUS_TEMPLATE, help="prompt template holding {prompt} once")
    p.add_argument("--bos-token", help="override the BOS token name")
    p.add_argument("--pad-token", help="override the pad token name")
    p.add_argument("--image-start-token", help="override the begin-of-image token name")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        convert(args)
    except ConvertError as e:
        print(f"convert_janus: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
