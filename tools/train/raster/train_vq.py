#!/usr/bin/env python3
"""Trains the VQ tokenizer of the shapes demo model (128x128 -> 16x16 tokens).

Exact commands that made models/shapes/vq.safetensors (from the repository root; seed 1
for training, data seeds 1 and 2). The learning-rate schedule was shortened once, at step
1100 (--steps 2500 -> 1900), and the codes were frozen at step 1300, whose checkpoint
is the shipped one (held-out PSNR 30.8 dB at step 1250 on 256 images, see export_vq.py
--val for the exported figure):

    python -m tools.shapes.dataset --out build/shapes/train --n 20000 --seed 1
    python -m tools.shapes.dataset --out build/shapes/val --n 512 --seed 2
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 python tools/train/raster/train_vq.py \\
        --train build/shapes/train --val build/shapes/val --out build/train/vq \\
        --seed 1 --steps 2500 --stop-at 1100 --resume >> build/train/vq/stdout.log 2>&1
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 python tools/train/raster/train_vq.py \\
        --train build/shapes/train --val build/shapes/val --out build/train/vq \\
        --seed 1 --steps 1900 --freeze-codes-at 1300 --stop-at 1300 --resume >> build/train/vq/stdout.log 2>&1
    cp build/train/vq/ckpt.pt build/train/vq/ckpt-frozen-codes.pt

Each command resumes from build/train/vq/ckpt.pt (the batch of step t depends only on the
seed and t, so a resumed run sees the same data as an unbroken one). About 3.5-4 s per
step on one thread of this 2-core machine: 1300 steps took about 80 minutes of training
spread over two sessions. Then export the decoder and codebook:

    python tools/train/raster/export_vq.py --ckpt build/train/vq/ckpt-frozen-codes.pt --out build/train/vq/export

Model (defaults): decoder base_channels 32, channel_multiplier [2, 1, 2, 2] (level widths
64, 64, 32, 64 from the 16x16 level to the 128x128 one), num_res_blocks 0 (one ResNet
block per level), latent_channels 64, embed_dim 8, codebook 1024; the encoder has one
ResNet block per level at widths 32, 32, 64, 64 (finest first) and no GroupNorm before
its conv_out. The architecture is in vq_model.py.
Loss: MSE + L1 + 0.5 * L1 of the horizontal and vertical pixel differences (edges), plus
the commitment loss (beta 0.25). AdamW at 1e-3 (batch 8), linear warm-up over 100 steps
then cosine decay to 5% of the peak rate at --steps. Schedule of the quantiser:
- steps [0, --ae-warmup): a plain autoencoder (the decoder sees the normalised encoder
  output);
- at --ae-warmup: the codebook is initialised by spherical k-means on the encoder outputs
  of --kmeans-images training images;
- from then on: quantised (straight-through), codes updated as an exponential moving
  average (decay --ema-decay) of the encoder outputs assigned to them, and every
  --restart-every steps the codes unused since the previous check restart from random
  encoder outputs of the current batch (until 80% of the steps).

Colour is what is slow to learn here: networks reproduce shapes in grey long before
they tell colours apart. GroupNorm (32 groups) without a residual bypass rescales each
group by its spread over the image, which makes an object's level depend on its area;
with 32 channels each group is one channel. Hence: a 64-wide last decoder level (two
channels per group) whose odd channels start as constants (init_reference_channels),
and no GroupNorm at the encoder output. History on this machine (1 thread, ~3.5 s/step):
  run 1: [1, 1, 2, 2], num_res_blocks 1, gradient-trained codes, no warm-up, lr 5e-4:
         18.9 dB at step 250, 19.6 dB at 500, colours mostly grey; stopped.
  run 2: same widths with warm-up + k-means + EMA codes, lr 1e-3: the unquantised
         autoencoder was still grey at step 200; stopped.
  run 3: [2, 1, 2, 2], num_res_blocks 0: still grey at step 200; stopped.
  run 4 (these defaults): colours appear from step ~500; 21.2 dB at 500, 23.8 at 750.
Which of run 4's changes matters most was not isolated.
--fg-weight (off by default) weights non-background pixels more; untested beyond 100 steps.

Logs: OUT/train.log (one line per --log-every steps, an EVAL line per --eval-every),
OUT/psnr.csv (step, held-out PSNR of the pooled MSE, mean of per-image PSNR, codes used).

With --codebook FILE (tools/shapes/codebook.py's output) there is no encoder and no
quantiser to learn: each image's tokens are the code book's (white, or a palette colour over
a coverage pattern), fixed, and only their embeddings (codebook_size = the code book's codes)
and the decoder train, to draw what the codes mean.
PSNR is measured as the engine produces pixels: trunc(clip((x + 1) / 2 * 255)) against the
original uint8 image. Uses --threads CPU threads (1), or the GPU: --device, --max-minutes and
--ckpt-minutes (train_util.add_run_args) are what tools/train/pipeline.py drives it with.
"""

import argparse
import json
import math
import os
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
from vq_model import VQModel, init_reference_channels, to_model_input, to_u8, tokenize_u8  # noqa: E402
from train_util import (add_loop_args, autocast, check_run_args, describe_device, describe_losses,  # noqa: E402
                        edge_loss, log, log_tokenizer_eval, resume, save, start_run, train_loop,
                        worker_pool)
from tools.shapes.dataset import load_shards  # noqa: E402
from tools.shapes import codebook as shapes_codebook  # noqa: E402

DEFAULT_CFG = {
    "base_channels": 32,
    "channel_multiplier": [2, 1, 2, 2],
    "num_res_blocks": 0,
    "encoder_channel_multiplier": [1, 1, 2, 2],
    "encoder_res_blocks": 1,
    "encoder_norm_out": False,
    "latent_channels": 64,
    "embed_dim": 8,
    "codebook_size": 1024,
    "out_channels": 3,
}


def batch_at(images, step, a):
    rng = np.random.default_rng([a.seed, step])
    idx = rng.integers(0, len(images), a.batch)
    x = images[idx]
    flip = rng.random(a.batch) < 0.5
    x[flip] = x[flip, :, ::-1]
    return x


@torch.no_grad()
def evaluate_held_out(model, val, bs=32, masks=None):
    """(PSNR of the pooled MSE, mean per-image PSNR, distinct codes used, code perplexity);
    with masks, the tokens are the fixed code book's."""
    model.eval()
    se, psnrs, counts = [], [], torch.zeros(model.cfg["codebook_size"])
    for i in range(0, len(val), bs):
        u8 = val[i : i + bs]
        idx = tokenize_u8(model, u8, masks)
        counts += torch.bincount(idx.flatten(), minlength=len(counts)).float().cpu()
        rec = to_u8(model.decode_indices(idx)).cpu().numpy().astype(np.float64)
        mse = ((rec - u8.astype(np.float64)) ** 2).reshape(len(u8), -1).mean(1)
        se.extend(mse.tolist())
        psnrs.extend((10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))).tolist())
    model.train()
    p = counts / counts.sum()
    ppl = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
    return 10 * math.log10(255.0 ** 2 / float(np.mean(se))), float(np.mean(psnrs)), int((counts > 0).sum()), ppl


@torch.no_grad()
def kmeans_init(model, images, a, logf, n_vectors=65536):
    """Spherical k-means of encoder outputs into the codebook."""
    t0 = time.time()
    model.eval()
    dev = model.codebook.weight.device
    rng = np.random.default_rng([a.seed, 7])
    pick = rng.choice(len(images), min(a.kmeans_images, len(images)), replace=False)
    e, k = model.cfg["embed_dim"], model.cfg["codebook_size"]
    vecs = torch.cat([model.encode(to_model_input(images[np.sort(pick[i : i + 32])]).to(dev)).permute(0, 2, 3, 1).reshape(-1, e)
                      for i in range(0, len(pick), 32)])
    g = torch.Generator().manual_seed(a.seed)  # on the CPU, so the draws do not depend on the device
    vecs = vecs[torch.randperm(len(vecs), generator=g)[:n_vectors].to(dev)]
    cent = vecs[torch.randperm(len(vecs), generator=g)[:k].to(dev)].clone()
    for _ in range(a.kmeans_iters):
        assign = torch.cat([torch.argmax(c @ cent.t(), 1) for c in vecs.split(8192)])
        sums = torch.zeros_like(cent).index_add_(0, assign, vecs)
        counts = torch.bincount(assign, minlength=k)
        empty = (counts == 0).nonzero().flatten()
        sums[empty] = vecs[torch.randint(0, len(vecs), (len(empty),), generator=g).to(dev)]
        cent = F.normalize(sums, dim=1)
    model.codebook.set(cent, count=a.batch * 256 / k)
    model.train()
    log(logf, "step %d: codebook from spherical k-means of %d encoder outputs (%d images), %d codes empty in the last round, %.0f s" % (
        a.ae_warmup, len(vecs), len(pick), len(empty), time.time() - t0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="directory of npz shards (tools/shapes/dataset.py)")
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beta", type=float, default=0.25, help="commitment loss weight")
    ap.add_argument("--edge-weight", type=float, default=0.5)
    ap.add_argument("--fg-weight", type=float, default=0.0, help="extra loss weight of non-background pixels")
    ap.add_argument("--restart-every", type=int, default=100)
    ap.add_argument("--ae-warmup", type=int, default=300, help="steps before quantisation starts")
    ap.add_argument("--ema-decay", type=float, default=0.99)
    ap.add_argument("--freeze-codes-at", type=int, default=0,
                    help="from this step on only the decoder trains (encoder and codebook fixed, "
                         "so the tokens of any later checkpoint are the same); 0 = never")
    ap.add_argument("--kmeans-images", type=int, default=512)
    ap.add_argument("--kmeans-iters", type=int, default=15)
    ap.add_argument("--eval-images", type=int, default=256, help="held-out images per periodic eval")
    ap.add_argument("--config", default=None, help="JSON overriding the model config")
    ap.add_argument("--no-reference-init", dest="reference_init", action="store_false",
                    help="skip vq_model.init_reference_channels")
    ap.add_argument("--codebook", metavar="NPZ",
                    help="fixed tokens from this code book (tools/shapes/codebook.py): only the "
                         "code embeddings and the decoder train")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes that encode each batch with --codebook's code book (numpy, "
                         "on the CPU: on a GPU it is most of a step's time); 1 = in this process")
    add_loop_args(ap, steps=2500, batch=8, lr=1e-3, warmup=100, eval_every=250)
    a = ap.parse_args(argv)
    check_run_args(ap, a)
    if a.workers < 1:
        ap.error("--workers must be >= 1")
    with worker_pool(a.workers if a.codebook else 1) as pool:
        return train(a, pool)


def train(a, pool):
    """The run main() parsed; pool encodes batches with the code book (None: in this process)."""
    dev, logf, ckpt_path, end = start_run(a)
    cfg = dict(DEFAULT_CFG, **(json.loads(a.config) if a.config else {}))
    masks = None
    if a.codebook:
        with np.load(a.codebook) as z:
            masks = z["masks"]
        cfg["codebook_size"] = 1 + len(shapes_codebook.PALETTE) * len(masks)

    _, images = load_shards(a.train)
    _, val = load_shards(a.val)
    torch.manual_seed(a.seed)
    model = VQModel(cfg)
    if a.reference_init:
        init_reference_channels(model.decoder)
    if masks is not None:  # the embeddings learn by gradient; the encoder is unused
        model.codebook.weight.requires_grad_(True)
        model.encoder.requires_grad_(False)
        model.quant_conv.requires_grad_(False)
    model.to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    used = torch.zeros(cfg["codebook_size"], dtype=torch.long, device=dev)
    ck = resume(ckpt_path, logf, opt, cfg) if a.resume else None
    if ck:
        model.load_state_dict(ck["model"])
        used = ck["used"].to(dev)
    else:
        log(logf, "start: args %s" % json.dumps(vars(a)))
        log(logf, "config %s" % json.dumps(cfg))
        log(logf, "params: %.3fM (decoder+post_quant_conv+codebook %.3fM); train %d images, val %d" % (
            sum(p.numel() for p in model.parameters()) / 1e6,
            (sum(p.numel() for p in model.decoder.parameters())
             + sum(p.numel() for p in model.post_quant_conv.parameters())
             + model.codebook.weight.numel()) / 1e6, len(images), len(val)))
        with open(os.path.join(a.out, "psnr.csv"), "w") as f:
            f.write("step,val_psnr,val_psnr_mean_per_image,codes_used\n")
    log(logf, "device %s" % describe_device(dev))

    def train_step(step):
        u8 = batch_at(images, step, a)
        x = to_model_input(u8).to(dev)
        quantising = step >= a.ae_warmup and masks is None
        frozen = bool(a.freeze_codes_at) and step >= a.freeze_codes_at
        if frozen:
            for mod in (model.encoder, model.quant_conv):
                mod.requires_grad_(False)
        if step == a.ae_warmup and masks is None:
            kmeans_init(model, images, a, logf)
        with autocast(dev):
            if masks is not None:
                idx = tokenize_u8(model, u8, masks, pool)
                out, qloss = model.decode_indices(idx), x.new_zeros(())
            else:
                out, idx, zn, qloss = model(x, beta=a.beta, quantise=quantising)
            out = out.float()
            if a.fg_weight:
                # Pixels that are not background weigh 1 + fg_weight (normalised).
                w = 1.0 + a.fg_weight * (x < 0.99).any(1, keepdim=True).float()
                w = w / w.mean()
                mse = (w * (out - x) ** 2).mean()
                l1 = (w * (out - x).abs()).mean()
            else:
                mse = F.mse_loss(out, x)
                l1 = (out - x).abs().mean()
            el = edge_loss(out, x)
            loss = mse + l1 + a.edge_weight * el + qloss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if quantising and not frozen:
            flat = zn.detach().float().permute(0, 2, 3, 1).reshape(-1, cfg["embed_dim"])
            model.codebook.ema_update(flat, idx.flatten(), a.ema_decay)
            used.add_(torch.bincount(idx.flatten(), minlength=cfg["codebook_size"]))
        step += 1
        if (quantising and not frozen and a.restart_every and (step - a.ae_warmup) % a.restart_every == 0
                and step < 0.8 * a.steps):
            dead = (used == 0).nonzero().flatten()
            if len(dead):
                g = torch.Generator().manual_seed(a.seed * 1000003 + step)
                pick = torch.randint(0, len(flat), (len(dead),), generator=g).to(dev)
                noise = torch.randn(len(dead), flat.shape[1], generator=g).to(dev)
                model.codebook.restart(dead, flat[pick] + 0.02 * noise)
            log(logf, "step %d: %d of %d codes unused in the last %d steps, restarted" % (
                step, len(dead), cfg["codebook_size"], a.restart_every))
            used.zero_()
        return {k: float(v.detach()) for k, v in (("loss", loss), ("mse", mse), ("l1", l1), ("edge", el), ("q", qloss))}

    def checkpoint(step):
        save(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                         "used": used, "config": cfg, "args": vars(a), "codebook_masks": masks})

    def evaluate(step):
        if not ((step % a.eval_every == 0 and (step > a.ae_warmup or masks is not None)) or step == a.steps):
            return False
        n = len(val) if step == a.steps else a.eval_images
        t0 = time.time()
        p, pm, nu, ppl = evaluate_held_out(model, val[:n], masks=masks)
        log_tokenizer_eval(logf, a.out, step, p, pm, n, nu, ", perplexity %.0f" % ppl, time.time() - t0)
        if step % 1000 == 0 or step == a.steps:
            save(os.path.join(a.out, "ckpt-%06d.pt" % step), {"model": model.state_dict(), "step": step, "config": cfg})
        return True

    return train_loop(a, logf, opt, ck["step"] if ck else 0, end, train_step, checkpoint,
                      describe_losses, a.log_every, a.ckpt_every, evaluate)


if __name__ == "__main__":
    sys.exit(main())
