#!/usr/bin/env python3
"""Trains the language model of the shapes demo model on VQ token grids.

Exact command that made models/shapes/lm.safetensors (from the repository root, after the
code book's decoder, train_vq.py --codebook, and tokenize_shapes.py; tools/train/raster/README.md,
sections 2b to 5b):

    OMP_NUM_THREADS=2 nice -n 5 python tools/train/raster/train_lm.py \\
        --tokens build/shapes/train/tokens-cb65.npz --val-tokens build/shapes/val/tokens-cb65.npz \\
        --out build/train/lm-cb65 --seed 1 --steps 7000 --batch 16 --threads 2 \\
        --codebook-size 521 --resume

About 0.6 s per step on two threads of this machine (77 minutes in all). The model before
it, on the learned 1,024-code VQ, was --steps 2900 on build/train/lm with that VQ's tokens.

The same command resumes from OUT/ckpt.pt (saved every --ckpt-every steps); the batch of
step t depends only on the seed and t. OUT/tokenizer.json is the word-level tokenizer the
model is trained with (written on the first run, reused after). Logs: OUT/train.log, the
held-out loss per --eval-every steps in OUT/val.csv.

Training rows are exactly what the engine feeds: <bos>, the prompt template with the
caption, <begin_of_image>, then the 256 image tokens; the loss is the cross-entropy of the
image tokens. With probability --uncond-prob a row is the engine's unconditional row
instead (every prompt token except <bos> and <begin_of_image> replaced by <pad>), which is
what classifier-free guidance needs.
"""

import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tools/train: train_util
sys.path.insert(0, ROOT)
from lm_model import DEFAULT_IMAGE, DEFAULT_LLM, JanusLM  # noqa: E402
from train_util import (add_loop_args, autocast, check_run_args, describe_device, load_weights, log,  # noqa: E402
                        resume, save, start_run, train_loop)

sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_tiny_model import word_level_tokenizer  # noqa: E402

TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
SPECIALS = ["<bos>", "<pad>", "<begin_of_image>", "<|User|>", "<|Assistant|>", "[UNK]"]


def vocabulary_words():
    """The caption words (tools/shapes/scene.py) plus the template's ':'."""
    from tools.shapes.scene import vocabulary
    return [":"] + [w for w in vocabulary() if w != ":"]


def tokenizer_json(vocab_size):
    """The word-level tokenizer (Hugging Face tokenizer.json format) the engine reads."""
    return word_level_tokenizer(SPECIALS, vocabulary_words(), vocab_size)


def word_level_ids(tok_json, text):
    """What the tokenizers package's encode(text, add_special_tokens=False).ids gives for a
    tokenizer_json(), in plain Python, for machines without that package: the added (special)
    tokens are matched verbatim first; the rest is lower-cased (the Lowercase normalizer), split
    into runs of word characters and runs of other non-space characters (the Whitespace
    pre-tokenizer), and each piece looked up, [UNK] if absent."""
    vocab = tok_json["model"]["vocab"]
    unk = vocab[tok_json["model"]["unk_token"]]
    specials = sorted((t["content"] for t in tok_json["added_tokens"]), key=len, reverse=True)
    parts = re.split("(" + "|".join(re.escape(t) for t in specials) + ")", text)
    ids = []
    for i, part in enumerate(parts):
        if i % 2:
            ids.append(vocab[part])
        else:
            ids.extend(vocab.get(w, unk) for w in re.findall(r"\w+|[^\w\s]+", part.lower()))
    return ids


def encode_prompts(tok_json, captions, use_package=True):
    """(cond rows, uncond rows) of token ids, as the engine builds them. Through the tokenizers
    package when it is installed (and use_package), else word_level_ids."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        use_package = False
    if use_package:
        tok = Tokenizer.from_str(json.dumps(tok_json))

        def encode(text):
            return tok.encode(text, add_special_tokens=False).ids
    else:
        def encode(text):
            return word_level_ids(tok_json, text)
    v = tok_json["model"]["vocab"]
    bos, pad, boi, unk = v["<bos>"], v["<pad>"], v["<begin_of_image>"], v["[UNK]"]
    cond, uncond = [], []
    for c in captions:
        ids = encode(TEMPLATE.replace("{prompt}", str(c)))
        if unk in ids:
            raise ValueError("caption %r has words outside the vocabulary" % c)
        row = [bos] + ids + [boi]
        cond.append(row)
        uncond.append([bos] + [pad] * len(ids) + [boi])
    return cond, uncond


def pad_left(rows, pad):
    P = max(len(r) for r in rows)
    ids = np.full((len(rows), P), pad, np.int64)
    valid = np.zeros((len(rows), P), bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = r
        valid[i, P - len(r):] = True
    return torch.from_numpy(ids), torch.from_numpy(valid)


def batch_rows(cond, uncond, grids, idx, drop, pad):
    rows = [uncond[i] if d else cond[i] for i, d in zip(idx, drop)]
    ids, valid = pad_left(rows, pad)
    image = torch.from_numpy(grids[idx].reshape(len(idx), -1).astype(np.int64))
    return ids, valid, image


@torch.no_grad()
def held_out_loss(model, cond, grids, pad, bs=32):
    """Mean cross-entropy per image token of the rows (F32 on every device)."""
    model.eval()
    dev = model.gen.embed.weight.device
    tot, n = 0.0, 0
    for i in range(0, len(cond), bs):
        idx = np.arange(i, min(i + bs, len(cond)))
        ids, valid, image = (t.to(dev) for t in batch_rows(cond, cond, grids, idx, np.zeros(len(idx), bool), pad))
        logits = model(ids, valid, image)
        tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), image.reshape(-1), reduction="sum"))
        n += image.numel()
    model.train()
    return tot / n


def load_exported(model, model_dir, tok_json, init_depth=None):
    """Starts model from an exported model directory's lm.safetensors (export_lm.py writes the
    state dict's own names; matrices BF16, the image path F16, norms F32): the sizes, the
    codebook and the tokenizer must be the ones it was trained with. With init_depth below
    num_layers the exported model has init_depth layers: they become the first ones, and each
    layer after them starts with its two output projections (attention, MLP) at zero, so it
    adds nothing and the deeper model's logits are the exported one's until it trains. 8-bit
    weights (tools/quantize.py) are read as their values times their scales."""
    path = os.path.join(model_dir, "lm.safetensors")
    if not os.path.exists(path):
        sys.exit("--init %s: no lm.safetensors (an export_lm.py model directory?)" % model_dir)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        if json.load(f)["model"]["vocab"] != tok_json["model"]["vocab"]:
            sys.exit("--init %s: its tokenizer.json is not this run's (copy it to OUT first)" % model_dir)
    stored = load_weights(path)
    layers = model.llm.layers
    new = tuple("llm.layers.%d." % i for i in range(init_depth or len(layers), len(layers)))
    want = {k: v for k, v in model.state_dict().items() if not k.startswith(new)}
    bad = sorted(set(stored) ^ set(want)) or [k for k in want if stored[k].shape != want[k].shape]
    if bad:
        sys.exit("--init %s: %s differs from this run's model (--llm, --codebook-size, --init-depth "
                 "as it was trained)" % (path, bad[0]))
    model.load_state_dict(stored, strict=False)
    with torch.no_grad():
        for layer in layers[init_depth or len(layers):]:
            layer.attn.o.weight.zero_()
            layer.mlp.down.weight.zero_()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", required=True, nargs="+",
                    help="npz files from tokenize_shapes.py (tokens, captions), concatenated in order")
    ap.add_argument("--val-tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--uncond-prob", type=float, default=0.1, help="caption dropout for guidance")
    ap.add_argument("--llm", default=None, help="JSON overriding the llm config")
    ap.add_argument("--init", metavar="MODEL_DIR",
                    help="start from an exported model's LM (models/shapes): training it further, "
                         "e.g. on new scenes; a run that resumes ignores it")
    ap.add_argument("--init-depth", type=int, metavar="N",
                    help="the --init model has N layers, fewer than --llm's num_layers: they become "
                         "the first ones, the layers after them start adding nothing")
    ap.add_argument("--codebook-size", type=int, default=DEFAULT_IMAGE["codebook_size"],
                    help="image codes the generation head predicts (the VQ's codebook size)")
    add_loop_args(ap, steps=2900, batch=16, lr=1e-3, warmup=200, eval_every=250)
    a = ap.parse_args(argv)
    check_run_args(ap, a)

    dev, logf, ckpt_path, end = start_run(a)
    tok_path = os.path.join(a.out, "tokenizer.json")
    llm_cfg = dict(DEFAULT_LLM, **(json.loads(a.llm) if a.llm else {}))
    if a.init_depth is not None and not (a.init and 1 <= a.init_depth <= llm_cfg["num_layers"]):
        ap.error("--init-depth %d: needs --init, and the --init model's depth, from 1 to num_layers (%d)"
                 % (a.init_depth, llm_cfg["num_layers"]))
    if os.path.exists(tok_path):
        with open(tok_path) as f:
            tok_json = json.load(f)
    else:
        tok_json = tokenizer_json(llm_cfg["vocab_size"])
        with open(tok_path, "w") as f:
            json.dump(tok_json, f, indent=1)
    pad = tok_json["model"]["vocab"]["<pad>"]

    grids, captions = [], []
    for path in a.tokens:
        with np.load(path) as z:
            grids.append(z["tokens"])
            captions.append(z["captions"])
    grids, captions = np.concatenate(grids), np.concatenate(captions)
    with np.load(a.val_tokens) as z:
        val_grids, val_captions = z["tokens"], z["captions"]
    image_cfg = dict(DEFAULT_IMAGE, grid_height=grids.shape[1], grid_width=grids.shape[2],
                     codebook_size=a.codebook_size)
    top_code = max(int(grids.max()), int(val_grids.max()))
    if top_code >= a.codebook_size:
        sys.exit("token grids hold code %d, outside --codebook-size %d" % (top_code, a.codebook_size))
    cond, uncond = encode_prompts(tok_json, captions)
    val_cond, _ = encode_prompts(tok_json, val_captions)

    torch.manual_seed(a.seed)
    model = JanusLM(llm_cfg, image_cfg)
    if a.init:
        load_exported(model, a.init, tok_json, a.init_depth)
    model.to(dev)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    ck = resume(ckpt_path, logf, opt, llm_cfg,
                same=lambda ck: ck["llm"] == llm_cfg and ck["image"] == image_cfg) if a.resume else None
    if ck:
        model.load_state_dict(ck["model"])
    else:
        log(logf, "start: args %s" % json.dumps(vars(a)))
        log(logf, "llm %s image %s; %.3fM parameters; %d training rows, %d held out; prompt lengths %d-%d" % (
            json.dumps(llm_cfg), json.dumps(image_cfg), sum(p.numel() for p in model.parameters()) / 1e6,
            len(cond), len(val_cond), min(map(len, cond)), max(map(len, cond))))
        with open(os.path.join(a.out, "val.csv"), "w") as f:
            f.write("step,val_loss,val_ppl\n")
    log(logf, "device %s" % describe_device(dev))

    def train_step(step):
        rng = np.random.default_rng([a.seed, step])
        idx = rng.integers(0, len(cond), a.batch)
        drop = rng.random(a.batch) < a.uncond_prob
        ids, valid, image = (t.to(dev) for t in batch_rows(cond, uncond, grids, idx, drop, pad))
        with autocast(dev):
            logits = model(ids, valid, image)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), image.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return {"loss": float(loss.detach())}

    def checkpoint(step, path=ckpt_path):
        save(path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "llm": llm_cfg, "image": image_cfg, "args": vars(a)})

    def evaluate(step):
        if step % a.eval_every and step != a.steps:
            return False
        t0 = time.time()
        vl = held_out_loss(model, val_cond, val_grids, pad)
        log(logf, "EVAL step %d held-out loss %.4f (perplexity %.1f) on %d rows (%.0f s)" % (
            step, vl, math.exp(vl), len(val_cond), time.time() - t0))
        with open(os.path.join(a.out, "val.csv"), "a") as f:
            f.write("%d,%.4f,%.2f\n" % (step, vl, math.exp(vl)))
        if step % 1000 == 0:
            checkpoint(step, os.path.join(a.out, "ckpt-%06d.pt" % step))
        return True

    return train_loop(a, logf, opt, ck["step"] if ck else 0, end, train_step, checkpoint,
                      lambda m: "loss %.4f" % m["loss"], a.log_every, a.ckpt_every, evaluate)


if __name__ == "__main__":
    sys.exit(main())
