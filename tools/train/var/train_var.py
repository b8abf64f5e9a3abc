#!/usr/bin/env python3
"""Trains the VAR transformer of the shapes VAR model (models/shapes-var) on multi-scale
codes of the msvq tokenizer.

Exact command that made the shipped transformer (from the repository root; two threads;
training samples 0..N-1 of stream seed 3, held-out samples of stream seed 4, batch order
and class dropout from --seed 1; the 1,024-code tokenizer of train_msvq.py's header; 109
minutes; tools/train/var/README.md section 6):

    mkdir -p build/train_var/var-cb1024-shared5
    OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 nohup .venv-bench/bin/python tools/train/var/train_var.py \\
        --vq build/train_var/msvq-cb1024/ckpt.pt --out build/train_var/var-cb1024-shared5 \\
        --seed 1 --steps 3000 --n-train 32000 --config '{"depth": 5, "shared_adaln": true}' \\
        --resume --threads 2 --ckpt-minutes 2 >> build/train_var/var-cb1024-shared5/stdout.log 2>&1 &

The first model's transformer (256 codes, depth 4; sections 1 and 2), one thread:

    mkdir -p build/train_var/var
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup .venv-tools/bin/python tools/train/var/train_var.py \\
        --vq build/train_var/msvq/ckpt.pt --out build/train_var/var --seed 1 --steps 1000 \\
        --n-train 32000 --config '{"depth": 4}' --resume >> build/train_var/var/stdout.log 2>&1 &
    # stopped after the checkpoint of step 500 (samples still ragged blobs), resumed with a
    # longer schedule (the learning rate jumps from 6.1e-4 to 8.2e-4):
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup .venv-tools/bin/python tools/train/var/train_var.py \\
        --vq build/train_var/msvq/ckpt.pt --out build/train_var/var --seed 1 --steps 1500 \\
        --n-train 32000 --config '{"depth": 4}' --resume >> build/train_var/var/stdout.log 2>&1 &

The first run tokenises the training and held-out sets with the VQ checkpoint into
OUT/tokens-train.npz / OUT/tokens-val.npz (labels and the codes of every scale, coarsest
first, raster order within a scale); later runs reuse them. Resumes from OUT/ckpt.pt
(every 100 steps); the batch of step t depends only on the seed and t.

Model: width 256, 4 heads of 64, depth 5 (--config; DEFAULT_CFG has 6), FFN 1024, 44
classes + the unconditional one, scales of the tokenizer (155 tokens); 4.80 M parameters
with 1,024 codes (the first model: depth 4, 5.0 M). Loss: cross-entropy over all L tokens
(mean), teacher forcing with the block-causal mask; 10% of rows get the unconditional class.
--config '{"shared_adaln": true}' gives VAR's shared AdaLN (one table for every block plus
each block's own rows; 2.4 MB smaller at depth 4).
AdamW (0.9, 0.95), weight decay 0.05 on matrices, lr --lr with a 100-step warm-up and
cosine decay to 5% at --steps, gradient clip 2.0, batch 32.
Logs: OUT/train.log, held-out loss per token (nats; overall and per scale) and
first-scale accuracy every --eval-every steps in OUT/val.csv.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
import data  # noqa: E402
from msvq import MSVQ, to_model_input  # noqa: E402
from train_util import (add_loop_args, autocast, check_run_args, describe_device, log, resume, save,  # noqa: E402
                        start_run, train_loop)
from var_model import VAR, next_scale_inputs  # noqa: E402

DEFAULT_CFG = {"width": 256, "heads": 4, "depth": 6, "ffn": 1024}


def load_vq(path, dev=torch.device("cpu")):
    ck = torch.load(path, map_location="cpu", weights_only=False)
    vq = MSVQ(ck["config"])
    vq.load_state_dict(ck["model"])
    vq.to(dev).eval()
    for p in vq.parameters():
        p.requires_grad_(False)
    return vq


@torch.no_grad()
def tokenize_set(vq, seed, n, path, logf, bs=64, default_colour=None):
    if os.path.exists(path):  # reused only if made from the same stream, count and colour
        z = np.load(path)
        made_with = str(z["default_colour"]) if "default_colour" in z else ""
        same_seed = "seed" in z and int(z["seed"]) == seed
        if same_seed and len(z["labels"]) == n and made_with == (default_colour or ""):
            return z["labels"], z["codes"]
    t0 = time.time()
    L = sum(p * p for p in vq.scales)
    labels = np.zeros(n, np.int64)
    codes = np.zeros((n, L), np.int16)
    for s in range(0, n, bs):
        m = min(bs, n - s)
        lab, img = data.make_set(seed, m, start=s, size=vq.cfg["image_size"], default_colour=default_colour)
        idxs = vq.tokenize(to_model_input(img).to(vq.codebook.weight.device))
        labels[s:s + m] = lab
        codes[s:s + m] = torch.cat([i.flatten(1) for i in idxs], 1).cpu().numpy()
    np.savez(path + ".tmp.npz", labels=labels, codes=codes, default_colour=default_colour or "", seed=seed)
    os.replace(path + ".tmp.npz", path)
    log(logf, "tokenised %d samples of stream %d into %s (%.0f s)" % (n, seed, path, time.time() - t0))
    return labels, codes


def split_codes(codes, scales):
    out, o = [], 0
    for p in scales:
        out.append(codes[:, o:o + p * p].reshape(-1, p, p))
        o += p * p
    return out


def batch_loss(var, vq, labels, codes, cond_drop=0.0, gen=None, amp=False):
    """(cross-entropy per token (B, L), logits) of a batch; the class dropout draws from gen
    (on the CPU, so they do not depend on the device). amp: the transformer and the loss
    under train_util.autocast (the teacher-forcing inputs stay F32)."""
    dev = var.head.weight.device
    codes = torch.as_tensor(codes).long()
    labels = torch.as_tensor(labels).long()
    if cond_drop > 0:
        drop = torch.rand(len(labels), generator=gen) < cond_drop
        labels = torch.where(drop, torch.full_like(labels, var.num_classes), labels)
    codes, labels = codes.to(dev), labels.to(dev)
    with torch.no_grad():
        x_in = next_scale_inputs(vq, split_codes(codes, vq.scales))
    with autocast(dev) if amp else contextlib.nullcontext():
        logits = var(labels, x_in)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), codes.reshape(-1),
                             reduction="none").view(codes.shape)
    return ce, logits


@torch.no_grad()
def evaluate_held_out(var, vq, labels, codes, bs=64):
    var.eval()
    ces, acc0 = [], []
    for s in range(0, len(labels), bs):
        ce, logits = batch_loss(var, vq, labels[s:s + bs], codes[s:s + bs])
        ces.append(ce)
        acc0.append((logits[:, 0].argmax(-1) == torch.as_tensor(codes[s:s + bs, 0]).long().to(logits.device)).float())
    var.train()
    ce = torch.cat(ces)
    per_scale, o = [], 0
    for p in vq.scales:
        per_scale.append(float(ce[:, o:o + p * p].mean()))
        o += p * p
    return float(ce.mean()), per_scale, float(torch.cat(acc0).mean())


def load_grown(var, model_dir, d0):
    """--init (--init-depth d0): the exported model's transformer into var, whose first d0
    blocks take the model's d0; each block after them starts with its two output projections
    (attention, FFN) at zero, so it adds nothing and the deeper transformer's logits are the
    model's until it trains."""
    import export

    depth = len(var.blocks)
    if d0 > depth:
        sys.exit("--init-depth %d: more than --config's depth %d" % (d0, depth))
    export.load_into(var, export.load_exported(model_dir)[1], model_dir,
                     leave=["blocks.%d." % i for i in range(d0, depth)])
    with torch.no_grad():
        for b in var.blocks[d0:]:
            for lin in (b.attn.proj, b.ffn.fc2):
                lin.weight.zero_()
                lin.bias.zero_()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vq", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-seed", type=int, default=3)
    ap.add_argument("--val-seed", type=int, default=4)
    ap.add_argument("--n-train", type=int, default=32000)
    ap.add_argument("--n-val", type=int, default=512)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--cond-drop", type=float, default=0.1)
    ap.add_argument("--config", default=None, help="JSON overriding DEFAULT_CFG")
    ap.add_argument("--init", metavar="MODEL_DIR",
                    help="start from an exported model's transformer (models/shapes-var; --config as "
                         "it was trained, --vq a tokenizer for its decoder: train_msvq.py --init)")
    ap.add_argument("--init-depth", type=int, metavar="N",
                    help="the --init model has N blocks, fewer than --config's depth: they become the "
                         "first ones, the blocks after them start as the identity (load_grown)")
    ap.add_argument("--default-colour", choices=data.S.COLOURS,
                    help="draw the classes that name no colour in this one (data.sample)")
    add_loop_args(ap, steps=2000, batch=32, lr=1e-3, warmup=100, eval_every=200)
    a = ap.parse_args(argv)
    check_run_args(ap, a)
    if a.init_depth is not None and (not a.init or a.init_depth < 1):
        ap.error("--init-depth %d: needs --init, and the --init model's depth (1 or more)" % a.init_depth)

    dev, logf, ckpt_path, end = start_run(a)
    vq = load_vq(a.vq, dev)
    cfg = dict(DEFAULT_CFG, **(json.loads(a.config) if a.config else {}))
    cfg.update(ffn=cfg.get("ffn", 4 * cfg["width"]), num_classes=data.NUM_CLASSES, scales=list(vq.scales),
               codebook_size=vq.cfg["codebook_size"], embed_dim=vq.cfg["embed_dim"])
    tr_lab, tr_codes = tokenize_set(vq, a.data_seed, a.n_train, os.path.join(a.out, "tokens-train.npz"), logf,
                                    default_colour=a.default_colour)
    va_lab, va_codes = tokenize_set(vq, a.val_seed, a.n_val, os.path.join(a.out, "tokens-val.npz"), logf,
                                    default_colour=a.default_colour)

    torch.manual_seed(a.seed)
    var = VAR(cfg)
    if a.init:
        load_grown(var, a.init, a.init_depth or cfg["depth"])
    var.to(dev)
    def decays(n, p):  # matrices only; not embeddings, positions or a block's own AdaLN rows (VAR's)
        return p.ndim == 2 and not any(s in n for s in ("embed", "pos_", "adaln_gss"))

    decay = [p for n, p in var.named_parameters() if decays(n, p)]
    other = [p for n, p in var.named_parameters() if not decays(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    ck = resume(ckpt_path, logf, opt, cfg) if a.resume else None
    if ck:
        var.load_state_dict(ck["model"])
    else:
        log(logf, "start: args %s" % json.dumps(vars(a)))
        log(logf, "config %s" % json.dumps(cfg))
        log(logf, "params %.3fM; %d tokens per image; train %d, val %d" % (
            sum(p.numel() for p in var.parameters()) / 1e6, var.L, len(tr_lab), len(va_lab)))
        with open(os.path.join(a.out, "val.csv"), "w") as f:
            f.write("step,val_loss,%s,first_token_acc\n" % ",".join("loss_s%d" % p for p in vq.scales))
    log(logf, "device %s" % describe_device(dev))

    def train_step(step):
        rng = np.random.default_rng([a.seed, step])
        pick = rng.integers(0, len(tr_lab), a.batch)
        gen = torch.Generator().manual_seed(a.seed * 1000003 + step)
        ce, _ = batch_loss(var, vq, tr_lab[pick], tr_codes[pick], a.cond_drop, gen, amp=True)
        loss = ce.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(var.parameters(), a.clip)
        opt.step()
        return {"loss": float(loss.detach())}

    def checkpoint(step):
        save(ckpt_path, {"model": var.state_dict(), "opt": opt.state_dict(), "step": step,
                         "config": cfg, "args": vars(a), "vq": os.path.abspath(a.vq)})

    def evaluate(step):
        if step % a.eval_every and step != end:
            return False
        t0 = time.time()
        vl, per, a0 = evaluate_held_out(var, vq, va_lab, va_codes)
        log(logf, "EVAL step %d val_loss %.4f per scale %s first-token acc %.3f (%.0f s)" % (
            step, vl, " ".join("%.3f" % v for v in per), a0, time.time() - t0))
        with open(os.path.join(a.out, "val.csv"), "a") as f:
            f.write("%d,%.4f,%s,%.4f\n" % (step, vl, ",".join("%.4f" % v for v in per), a0))
        if step % 500 == 0:
            save(os.path.join(a.out, "ckpt-%06d.pt" % step), {"model": var.state_dict(), "step": step, "config": cfg})
        return True

    return train_loop(a, logf, opt, ck["step"] if ck else 0, end, train_step, checkpoint,
                      lambda m: "loss %.4f" % m["loss"], a.log_every, a.ckpt_every, evaluate)


if __name__ == "__main__":
    sys.exit(main())
