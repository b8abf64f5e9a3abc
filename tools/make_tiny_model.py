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
`--preset slow-sanitizer` is the same grid with far less work, for the
ThreadSanitizer pass of those tests, `--preset slow-asan` with a third of the
work, for the AddressSanitizer pass. `--preset var-d16` is VAR-d16's shapes
(16 blocks of 1024, 16 heads, 10 scales to 16 x 16, the released
4096 x 32 codebook and 160-channel decoder: 256 x 256 pixels, 1000 classes),
random, for bench/gpu_bench.py; `--dtype bf16` stores a VAR model's
transformer matrices in bfloat16 (default f32).

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
    # The slow model's grid (24x24 tokens, 576 steps, 96x96 pixels) at about a
    # twentieth of its work and a tenth of its KV: the ThreadSanitizer pass's
    # slow model. Under ThreadSanitizer the slow model took 75 s an image with
    # the other core busy (37 s of CPU) against 0.4 s; this one took 3 s there,
    # long enough to catch requests while they run. Six layers, not two: by
    # 2026-12-06 its image was 0.4 s under ThreadSanitizer on an idle AMX
    # machine (0.12 s of steps), and eight images' steps ended inside the
    # deadline tests' one second (a 200 after the drawing); with six, 504.
    "slow-sanitizer": {
        "name": "slow-sanitizer-random",
        "llm": {"hidden_size": 48, "num_layers": 6, "num_heads": 3, "num_kv_heads": 3,
                "head_dim": 16, "intermediate_size": 128},
        "image": {"grid_height": 24, "grid_width": 24, "head_hidden_size": 48},
    },
    # The slow model's grid at about a third of its work: the AddressSanitizer
    # pass's slow model. That build's engine code makes an image about 1.8x
    # slower (its CPU kernels are built plain: the slow model 1.38 s against
    # 0.77 s, `arserve generate` with one thread), and there this one takes
    # 0.76 s, about what the slow model takes in a plain build, the time the
    # integration tests' bounds were written for.
    "slow-asan": {
        "name": "slow-asan-random",
        "llm": {"hidden_size": 128, "num_layers": 4, "num_heads": 2, "num_kv_heads": 2,
                "head_dim": 64, "intermediate_size": 384},
        "image": {"grid_height": 24, "grid_width": 24, "head_hidden_size": 128},
    },
    # About 60M parameters, where a decode step's time is the weights' reads:
    # `make bench`'s mid-size model.
    "mid": {
        "name": "mid-random",
        "llm": {"hidden_size": 768, "num_layers": 8, "num_heads": 12, "num_kv_heads": 12,
                "head_dim": 64, "intermediate_size": 2048},
        "image": {"grid_height": 16, "grid_width": 16, "codebook_size": 1024,
                  "head_hidden_size": 768},
    },
    # Janus-Pro-1B's depth (24 layers) at the tiny widths, bf16 as the real
    # one: a decode step makes the real model's kernel launches and copies
    # (their count follows the layers, not the widths), in seconds under the
    # CUDA emulator: `make bench-launches`.
    "janus-1b-depth": {
        "name": "janus-1b-depth-random",
        "llm": {"num_layers": 24},
    },
    # Six layers at the tiny widths: test-bench-smoke's deep model for
    # bench-launches (a layer's launches are (deep - shallow) / 4 layers),
    # a quarter of janus-1b-depth's emulated work.
    "depth-6": {
        "name": "depth-6-random",
        "llm": {"num_layers": 6},
    },
}


# A next-scale (VAR-architecture) model: class-conditional, scales 1,2,3,4
# (30 tokens, 4 steps), 32x32 pixels. `--preset var-tiny`.
VAR_CONFIG = {
    "format_version": 1,
    "name": "var-tiny-random",
    "family": "scale",
    "architecture": "var",
    "weights": ["model.safetensors"],
    "llm": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "head_dim": 16,
            "intermediate_size": 256, "norm_eps": 1e-6, "shared_adaln": False},
    "image": {"scales": [1, 2, 3, 4], "codebook_size": 32, "embed_dim": 8,
              "phi_count": 4, "phi_ratio": 0.5},
    "condition": {"num_classes": 4, "class_names": "classes.txt"},
    "decoder": {"type": "msvq", "latent_channels": 8, "base_channels": 32,
                "channel_multiplier": [1, 2, 2], "num_res_blocks": 1, "out_channels": 3},
    "sampling": {"cfg": 1.5, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
}
VAR_CLASSES = ["red circle", "green square", "blue triangle", "black diamond"]
VAR_PRESETS = {
    "var-tiny": {},
    # One image takes about a second on a small CPU (10 scales up to 16x16,
    # 128x128 pixels): the daemon's tests keep such requests running.
    "var-slow": {
        "name": "var-slow-random",
        "llm": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "head_dim": 64,
                "intermediate_size": 1024},
        "image": {"scales": [1, 2, 3, 4, 5, 6, 8, 10, 13, 16]},
    },
    # VAR-d16's shapes (VAR's build_vae_var at depth 16: width 64 d, d heads of 64, FFN 4x;
    # the 256-pixel scales; the VQVAE's 4096 x 32 codebook and ch=160, (1, 1, 2, 2, 4),
    # two ResNet blocks a level; 1000 classes, named "class 0" .. "class 999"), with the
    # sampling tools/convert/var.py writes for the released checkpoints. About 310 M
    # transformer parameters: bench/gpu_bench.py's next-scale model (with --dtype bf16).
    "var-d16": {
        "name": "var-d16-random",
        "llm": {"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "head_dim": 64,
                "intermediate_size": 4096},
        "image": {"scales": [1, 2, 3, 4, 5, 6, 8, 10, 13, 16], "codebook_size": 4096,
                  "embed_dim": 32},
        "condition": {"num_classes": 1000},
        "decoder": {"latent_channels": 32, "base_channels": 160,
                    "channel_multiplier": [1, 1, 2, 2, 4], "num_res_blocks": 2},
        "sampling": {"cfg": 1.5, "top_k": 900, "top_p": 0.96},
    },
    # VAR-d16's depth and scales (16 blocks, 10 scales to 16 x 16) at the tiny
    # widths: its launches and copies a scale, in seconds under the CUDA
    # emulator (`make bench-launches`).
    "var-d16-depth": {
        "name": "var-d16-depth-random",
        "llm": {"num_layers": 16},
        "image": {"scales": [1, 2, 3, 4, 5, 6, 8, 10, 13, 16]},
    },
}


def preset_config(name):
    """CONFIG with the preset's overrides merged in (one level deep)."""
    cfg = json.loads(json.dumps(VAR_CONFIG if name in VAR_PRESETS else CONFIG))
    for key, value in {**PRESETS, **VAR_PRESETS}[name].items():
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


def decoder_weights(w, rng, dec, K, E, pq_kernel):
    """The VQ decoder (vq16, or msvq with a 3x3 post-quant conv) into w, F16 convolutions."""
    def bias(c):
        return (0.05 * rng.standard_normal(c)).astype(np.float32)

    def norm(c):
        return (1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32)

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
    conv("vq.post_quant_conv", lat, E, pq_kernel)
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

    decoder_weights(w, rng, dec, K, E, pq_kernel=1)
    return w


def make_var_weights(cfg, rng, dtype="f32"):
    """Random VAR weights under the scale family's names (docs/model-format.md): F32
    transformer (its AdaLN gammas far from VAR's near-zero init, so every block
    matters; its matrices BF16 with dtype "bf16"), F16 decoder."""
    w = {}
    llm, im = cfg["llm"], cfg["image"]
    C, F, H = llm["hidden_size"], llm["intermediate_size"], llm["num_heads"]
    N, K, E = cfg["condition"]["num_classes"], im["codebook_size"], im["embed_dim"]
    L = sum(p * p for p in im["scales"])

    def lin(out, inp, scale=1.0):
        if dtype == "bf16":  # drawn as float32 at once: 310 M of them for VAR-d16
            m = rng.standard_normal((out, inp), dtype=np.float32)
            m *= np.float32(scale / np.sqrt(inp))
            return bf16(m)
        return (rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(np.float32)

    def vec(c, scale=0.05):
        return (scale * rng.standard_normal(c)).astype(np.float32)

    w["var.class_embed.weight"] = vec((N + 1, C), 0.5)
    w["var.pos_start"] = vec((im["scales"][0] ** 2, C), 0.5)
    w["var.pos_embed"] = vec((L, C), 0.5)
    w["var.level_embed.weight"] = vec((len(im["scales"]), C), 0.5)
    w["var.word_embed.weight"] = lin(C, E)
    w["var.word_embed.bias"] = vec(C)
    for i in range(llm["num_layers"]):
        p = f"var.blocks.{i}"
        w[f"{p}.adaln.weight"] = lin(6 * C, C, 0.5)
        w[f"{p}.adaln.bias"] = vec(6 * C, 0.3)
        w[f"{p}.attn.qkv.weight"] = lin(3 * C, C)
        w[f"{p}.attn.q_bias"] = vec(C)
        w[f"{p}.attn.v_bias"] = vec(C)
        w[f"{p}.attn.scale_mul"] = (np.log(4.0) + 0.3 * rng.standard_normal(H)).astype(np.float32)
        w[f"{p}.attn.proj.weight"] = lin(C, C, 0.5)
        w[f"{p}.attn.proj.bias"] = vec(C)
        w[f"{p}.ffn.fc1.weight"] = lin(F, C)
        w[f"{p}.ffn.fc1.bias"] = vec(F)
        w[f"{p}.ffn.fc2.weight"] = lin(C, F, 0.5)
        w[f"{p}.ffn.fc2.bias"] = vec(C)
    w["var.head_adaln.weight"] = lin(2 * C, C, 0.5)
    w["var.head_adaln.bias"] = vec(2 * C, 0.3)
    w["var.head.weight"] = lin(K, C, 3.0)
    w["var.head.bias"] = vec(K)
    for k in range(im["phi_count"]):
        w[f"vq.phi.{k}.weight"] = (rng.standard_normal((E, E, 3, 3)) / np.sqrt(9 * E)).astype(
            np.float16)
        w[f"vq.phi.{k}.bias"] = vec(E).astype(np.float16)
    decoder_weights(w, rng, cfg["decoder"], K, E, pq_kernel=3)
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
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="a VAR model's transformer matrices: f32 (default) or bf16")
    ap.add_argument("--preset", choices=sorted({**PRESETS, **VAR_PRESETS}), default="tiny",
                    help="model size: tiny (the default, milliseconds per image), mid (60M "
                         "parameters, for benchmarks), slow "
                         "(about a second or two per image on a small CPU) or slow-sanitizer "
                         "(the slow model's grid, for sanitizer builds), slow-asan (a third of the slow "
                         "model's work, for the AddressSanitizer build); var-tiny and "
                         "var-slow: the same for a next-scale (VAR) model")
    args = ap.parse_args()
    config = preset_config(args.preset)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    var = args.preset in VAR_PRESETS
    weights = make_var_weights(config, rng, args.dtype) if var else make_weights(config, rng)
    safetensors_write.write(os.path.join(args.out, "model.safetensors"), weights,
                            metadata={"made_by": "tools/make_tiny_model.py",
                                      "seed": str(args.seed)})
    if var:
        n = config["condition"]["num_classes"]
        names = VAR_CLASSES if n == len(VAR_CLASSES) else ["class %d" % i for i in range(n)]
        with open(os.path.join(args.out, "classes.txt"), "w") as f:
            f.write("".join(c + "\n" for c in names))
    else:
        with open(os.path.join(args.out, "tokenizer.json"), "w") as f:
            json.dump(word_level_tokenizer(SPECIALS, WORDS, config["llm"]["vocab_size"]), f,
                      indent=1)
    with open(os.path.join(args.out, "arserve.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {args.out} ({len(weights)} tensors, seed {args.seed})")


if __name__ == "__main__":
    main()
