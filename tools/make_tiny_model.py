#!/usr/bin/env python3
"""Writes a tiny random raster (Janus-architecture) model directory for tests.

The weights are random but fixed by --seed, so the same command always gives
the same files. The model is small enough that a whole 8x8-token image (32x32
pixels) generates in a few milliseconds. It draws noise: it exists to exercise
the engine, the CLI and the server, not to make pictures.

    python tools/make_tiny_model.py --seed 1 --out build/tiny-model

`--preset slow` writes the same architecture at a larger size (a 24x24 token
grid, 576 steps per image, 96x96 pixels, wider and deeper layers) so one image
takes a second or two on a small CPU: the daemon's integration tests use it
to have requests still running while they queue, disconnect or drain.

    python tools/make_tiny_model.py --preset slow --seed 1 --out build/slow-model

Needs numpy only (the test venv has it).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_write  # noqa: E402

SPECIALS = ["<bos>", "<pad>", "<begin_of_image>", "<|User|>", "<|Assistant|>", "[UNK]"]
WORDS = [":", ",", ".", "a", "an", "the", "and", "of", "to", "on", "in", "two", "three",
         "red", "green", "blue", "yellow", "purple", "orange", "white", "black",
         "circle", "circles", "square", "squares", "triangle", "triangles",
         "diamond", "diamonds", "small", "large", "left", "right", "top", "bottom",
         "centre", "center", "above", "below", "next"]

CONFIG = {
    "format_version": 1,
    "name": "tiny-random",
    "family": "raster",
    "architecture": "janus",
    "weights": ["model.safetensors"],
    "tokenizer": "tokenizer.json",
    "llm": {"vocab_size": 64, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 4, "head_dim": 16, "intermediate_size": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "image": {"grid_height": 8, "grid_width": 8, "codebook_size": 32, "embed_dim": 8,
              "aligner_layers": 2, "head_hidden_size": 64},
    "decoder": {"type": "vq16", "latent_channels": 32, "base_channels": 32,
                "channel_multiplier": [1, 2, 2], "num_res_blocks": 1, "out_channels": 3},
    "prompt": {"template": "<|User|>: {prompt}\n\n<|Assistant|>:", "bos_token": "<bos>",
               "pad_token": "<pad>", "image_start_token": "<begin_of_image>"},
    "sampling": {"cfg": 5.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
}


# Overrides of CONFIG per --preset; "tiny" (the default) changes nothing, so
# its output stays byte-identical to the files the tests were written against.
PRESETS = {
    "tiny": {},
    "slow": {
        "name": "slow-random",
        "llm": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4,
                "head_dim": 64, "intermediate_size": 768},
        "image": {"grid_height": 24, "grid_width": 24, "head_hidden_size": 256},
    },
}


def preset_config(name):
    """CONFIG with the preset's overrides merged in (one level deep)."""
    cfg = json.loads(json.dumps(CONFIG))
    for key, value in PRESETS[name].items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def bf16(a):
    """float32 array -> ('BF16', uint16 array), rounding to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return ("BF16", u)


def make_weights(cfg, rng):
    w = {}
    llm, im, dec = cfg["llm"], cfg["image"], cfg["decoder"]
    L, F, V = llm["hidden_size"], llm["intermediate_size"], llm["vocab_size"]
    qd = llm["num_heads"] * llm["head_dim"]
    K, E, G = im["codebook_size"], im["embed_dim"], im["head_hidden_size"]

    def lin(out, inp, scale=1.0):
        return (rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(np.float32)

    def norm(c):
        return (1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32)

    def bias(c):
        return (0.05 * rng.standard_normal(c)).astype(np.float32)

    # The language model in BF16, the generation path and decoder in F16,
    # norms in F32: every storage type the engine reads gets exercised.
    w["llm.embed.weight"] = bf16(rng.standard_normal((V, L)).astype(np.float32))
    for i in range(llm["num_layers"]):
        p = f"llm.layers.{i}"
        w[f"{p}.attn_norm.weight"] = norm(L)
        for n in ("q", "k", "v"):
            w[f"{p}.attn.{n}.weight"] = bf16(lin(qd, L))
        w[f"{p}.attn.o.weight"] = bf16(lin(L, qd, 0.5))
        w[f"{p}.mlp_norm.weight"] = norm(L)
        w[f"{p}.mlp.gate.weight"] = bf16(lin(F, L))
        w[f"{p}.mlp.up.weight"] = bf16(lin(F, L))
        w[f"{p}.mlp.down.weight"] = bf16(lin(L, F, 0.5))
    w["llm.norm.weight"] = norm(L)
    w["gen.embed.weight"] = rng.standard_normal((K, E)).astype(np.float16)
    for j in range(im["aligner_layers"]):
        w[f"gen.aligner.{j}.weight"] = lin(L, E if j == 0 else L).astype(np.float16)
        w[f"gen.aligner.{j}.bias"] = bias(L).astype(np.float16)
    w["gen.head.fc1.weight"] = lin(G, L).astype(np.float16)
    w["gen.head.fc1.bias"] = bias(G).astype(np.float16)
    w["gen.head.fc2.weight"] = lin(K, G, 3.0).astype(np.float16)
    w["gen.head.fc2.bias"] = bias(K).astype(np.float16)

    def conv(prefix, cout, cin, k):
        w[f"{prefix}.weight"] = (rng.standard_normal((cout, cin, k, k))
                                 / np.sqrt(cin * k * k)).astype(np.float16)
        w[f"{prefix}.bias"] = bias(cout).astype(np.float16)

    def gn(prefix, c):
        w[f"{prefix}.weight"] = norm(c)
        w[f"{prefix}.bias"] = bias(c)

    def resblock(prefix, cin, cout):
        gn(f"{prefix}.norm1", cin)
        conv(f"{prefix}.conv1", cout, cin, 3)
        gn(f"{prefix}.norm2", cout)
        conv(f"{prefix}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{prefix}.nin_shortcut", cout, cin, 1)

    def attn(prefix, c):
        gn(f"{prefix}.norm", c)
        for n in ("q", "k", "v", "proj_out"):
            conv(f"{prefix}.{n}", c, c, 1)

    mult, base, lat = dec["channel_multiplier"], dec["base_channels"], dec["latent_channels"]
    widths = [base * m for m in reversed(mult)]  # level 0 (coarsest) first
    w["vq.codebook.weight"] = rng.standard_normal((K, E)).astype(np.float16)
    conv("vq.post_quant_conv", lat, E, 1)
    conv("vq.decoder.conv_in", widths[0], lat, 3)
    resblock("vq.decoder.mid.block_1", widths[0], widths[0])
    attn("vq.decoder.mid.attn_1", widths[0])
    resblock("vq.decoder.mid.block_2", widths[0], widths[0])
    c = widths[0]
    for i, cout in enumerate(widths):
        for j in range(dec["num_res_blocks"] + 1):
            resblock(f"vq.decoder.up.{i}.block.{j}", c, cout)
            c = cout
            if i == 0:
                attn(f"vq.decoder.up.{i}.attn.{j}", c)
        if i != len(widths) - 1:
            conv(f"vq.decoder.up.{i}.upsample.conv", c, c, 3)
    gn("vq.decoder.norm_out", c)
    conv("vq.decoder.conv_out", 3, c, 3)
    return w


def word_level_tokenizer(specials, words, vocab_size):
    """A Hugging Face tokenizer.json (WordLevel, lowercase, whitespace pre-tokenizer) with
    ids: the special tokens first, then the words; "[UNK]" must be among the specials."""
    tokens = specials + words
    if len(tokens) > vocab_size:
        raise ValueError("%d tokens do not fit a vocabulary of %d" % (len(tokens), vocab_size))
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for t in specials]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="model size: tiny (the default, milliseconds per image) or slow "
                         "(about a second or two per image on a small CPU)")
    args = ap.parse_args()
    config = preset_config(args.preset)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    weights = make_weights(config, rng)
    safetensors_write.write(os.path.join(args.out, "model.safetensors"), weights,
                            metadata={"made_by": "tools/make_tiny_model.py",
                                      "seed": str(args.seed)})
    with open(os.path.join(args.out, "tokenizer.json"), "w") as f:
        json.dump(word_level_tokenizer(SPECIALS, WORDS, config["llm"]["vocab_size"]), f, indent=1)
    with open(os.path.join(args.out, "arserve.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {args.out} ({len(weights)} tensors, seed {args.seed})")


if __name__ == "__main__":
    main()
