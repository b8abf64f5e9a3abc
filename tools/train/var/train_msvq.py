#!/usr/bin/env python3
"""Trains the multi-scale VQVAE of the shapes VAR model (models/shapes-var).

Exact command that made the shipped tokenizer (from the repository root; training stream
seed 1, held-out stream seed 2; 1,024 codes; its first 500 steps on one thread, the rest on
two, resumed over three sessions; tools/train/var/README.md section 5):

    mkdir -p build/train_var/msvq-cb1024
    OMP_NUM_THREADS=2 nohup .venv-bench/bin/python tools/train/var/train_msvq.py \\
        --out build/train_var/msvq-cb1024 --config '{"codebook_size": 1024}' --seed 1 \\
        --steps 4000 --batch 16 --resume --threads 2 --ckpt-minutes 2 \\
        >> build/train_var/msvq-cb1024/stdout.log 2>&1 &

The first model's tokenizer (256 codes, section 1), one thread:

    mkdir -p build/train_var/msvq
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup .venv-tools/bin/python tools/train/var/train_msvq.py \\
        --out build/train_var/msvq --seed 1 --steps 1600 --batch 16 --resume \\
        >> build/train_var/msvq/stdout.log 2>&1 &
    # stopped after the checkpoint of step 1200 (28.1 dB, but rounded corners: 52% of
    # held-out reconstructions passed the detector), resumed with a longer schedule:
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nohup .venv-tools/bin/python tools/train/var/train_msvq.py \\
        --out build/train_var/msvq --seed 1 --steps 2600 --batch 16 --resume \\
        >> build/train_var/msvq/stdout.log 2>&1 &

It resumes from OUT/ckpt.pt (written every 100 steps); the batch of step t is samples
t*B .. t*B+B-1 of the seeded stream (tools/train/var/data.py), so a resumed run sees the
same data as an unbroken one. Logs: OUT/train.log, held-out PSNR in OUT/psnr.csv.

Model (msvq.py DEFAULT_CFG): 64x64 RGB (the 128 px scene box-filtered by 2) -> 8x8 latent
of Cvae 16, scales 1,2,3,4,5,6,8 (155 tokens), codebook 256 x 16 (the shipped one: 1024 x
16, --config), four shared Phi convs (ratio 0.5); decoder widths 128 (8 px, attention), 128,
64, 64 (64 px), one ResNet block per level. The last block's odd output channels are held at the constant 256 throughout
training (msvq.impose_reference, after every step) and norm_out starts as about the
identity on the even channels (msvq.init_reference), so that norm_out's GroupNorm (pairs
of channels) passes absolute colour levels. Encoder without GroupNorm (msvq.PlainBlock).

History (one thread of this 2-core machine): a first run at 128 px output (5 decoder
levels, widths 128, 128, 64, 32, 64, GroupNorm in the encoder, batch 8, ~1 s/step) reached
24.0 dB held-out at step 1200 but still drew every object in one of two or three hues
(orange for red, orange and yellow; blue for blue and black): 14% of its reconstructions
passed the ShapesEval detector. Stopped at step 1400 (build/train_var/msvq128-stopped) for
a 64 px configuration at 0.65 s/step of batch 16 (the scorer reads any size: true
scenes box-filtered to 64 px score 300/300 exact on shape, colour and size). That one
(widths 128, 128, 64, 64, tools/train/raster/vq_model.py init_reference_channels) was still grey
at step 300: its last block has no 1x1 shortcut, so the "constant" odd channels carried
the skip input, and the even channels had grown to a spatial spread larger than the
constant (as in the 128 px run: 11 against 8), so norm_out rescaled every image by its own
spread again. Stopped (build/train_var/msvq64-stopped) for the shipped configuration.

Schedule: steps [0, --ae-warmup) a plain autoencoder (decoder sees the encoder output);
at --ae-warmup the codebook is set to random encoder vectors and residuals of all scales;
then VAR's residual quantisation with straight-through gradients, codebook learned by
gradient; every --restart-every steps codes unused at every scale since the last check
restart from random residual vectors of the current batch (until 70% of the steps).
Loss: MSE + L1 + 0.5 * L1 of horizontal/vertical pixel differences + the VQ loss.
AdamW lr 1e-3, warm-up 50 steps, cosine to 5% at --steps, batch --batch (16 shipped).
PSNR is measured as the engine produces pixels: trunc(clip((x + 1) / 2 * 255)) against the
uint8 image, on held-out samples 0..N-1 of stream seed 2.
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
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
import data  # noqa: E402
from msvq import DEFAULT_CFG, MSVQ, down_to, impose_reference, init_reference, to_model_input, to_u8, up_to  # noqa: E402
from train_util import (add_loop_args, autocast, check_run_args, describe_device, describe_losses,  # noqa: E402
                        edge_loss, log, log_tokenizer_eval, resume, save, start_run, train_loop)


@torch.no_grad()
def evaluate_held_out(model, val, bs=32):
    """(PSNR of the pooled MSE, mean per-image PSNR, codes used per scale)."""
    model.eval()
    dev = model.codebook.weight.device
    se, psnrs = [], []
    used = [set() for _ in model.scales]
    for i in range(0, len(val), bs):
        u8 = val[i:i + bs]
        idxs = model.tokenize(to_model_input(u8).to(dev))
        for s, idx in enumerate(idxs):
            used[s].update(idx.flatten().tolist())
        rec = to_u8(model.decode_fhat(model.fhat_from_codes(idxs))).cpu().numpy().astype(np.float64)
        mse = ((rec - u8.astype(np.float64)) ** 2).reshape(len(u8), -1).mean(1)
        se.extend(mse.tolist())
        psnrs.extend((10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))).tolist())
    model.train()
    return 10 * math.log10(255.0 ** 2 / float(np.mean(se))), float(np.mean(psnrs)), [len(u) for u in used], len(set().union(*used))


@torch.no_grad()
def init_codebook(model, x, seed):
    f = model.encoder(x).float()
    n = model.scales[-1]
    vecs = []
    for pn in model.scales:
        d = down_to(f, pn)
        vecs.append(d.permute(0, 2, 3, 1).reshape(-1, f.shape[1]))
        vecs.append((f - up_to(d, n)).permute(0, 2, 3, 1).reshape(-1, f.shape[1]))
    vecs = torch.cat(vecs)
    g = torch.Generator().manual_seed(seed)  # on the CPU, so the draws do not depend on the device
    k = model.codebook.weight.shape[0]
    model.codebook.weight.copy_(vecs[torch.randint(0, len(vecs), (k,), generator=g).to(vecs.device)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-seed", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.25)
    ap.add_argument("--edge-weight", type=float, default=0.5)
    ap.add_argument("--ae-warmup", type=int, default=100)
    ap.add_argument("--ref-value", type=float, default=256.0,
                    help="constant of the reference channels (msvq.impose_reference)")
    ap.add_argument("--restart-every", type=int, default=50)
    ap.add_argument("--eval-images", type=int, default=128)
    ap.add_argument("--final-eval-images", type=int, default=512)
    ap.add_argument("--config", default=None, help="JSON overriding msvq.DEFAULT_CFG")
    ap.add_argument("--init", metavar="MODEL_DIR",
                    help="an exported model (models/shapes-var): its decoder, code book and Phi are "
                         "loaded and held, and an encoder is trained for them (quantising from "
                         "the first step, no code restarts); --config as it was trained")
    add_loop_args(ap, steps=1800, batch=8, lr=1e-3, warmup=50, eval_every=200)
    a = ap.parse_args(argv)
    check_run_args(ap, a)

    dev, logf, ckpt_path, end = start_run(a)
    cfg = dict(DEFAULT_CFG, **(json.loads(a.config) if a.config else {}))
    _, val = data.make_set(a.val_seed, a.final_eval_images, size=cfg["image_size"])

    torch.manual_seed(a.seed)
    model = MSVQ(cfg)
    init_reference(model.decoder, a.ref_value)
    if a.init:  # the exported decoder, code book and Phi, held: only the encoder trains
        import export

        export.load_into(model, export.load_exported(a.init)[0], a.init, leave=("encoder.",))
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("encoder."))
        a.ae_warmup = 0  # the code book is there: quantise from the first step
    model.to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=(0.9, 0.99),
                            weight_decay=0.0)
    K = cfg["codebook_size"]
    used = torch.zeros(K, dtype=torch.long, device=dev)
    ck = resume(ckpt_path, logf, opt, cfg) if a.resume else None
    if ck:
        model.load_state_dict(ck["model"])
        used = ck["used"].to(dev)
    else:
        log(logf, "start: args %s" % json.dumps(vars(a)))
        log(logf, "config %s" % json.dumps(cfg))
        n_dec = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("encoder."))
        log(logf, "params %.3fM (shipped part: decoder, post_quant_conv, codebook, phi %.3fM)" % (
            sum(p.numel() for p in model.parameters()) / 1e6, n_dec / 1e6))
        with open(os.path.join(a.out, "psnr.csv"), "w") as f:
            f.write("step,val_psnr,val_psnr_mean_per_image,codes_used\n")
    log(logf, "device %s" % describe_device(dev))

    def train_step(step):
        _, u8 = data.make_set(a.seed, a.batch, start=step * a.batch, size=cfg["image_size"])
        x = to_model_input(u8).to(dev)
        quantising = step >= a.ae_warmup
        if step == a.ae_warmup and not a.init:
            init_codebook(model, x, a.seed)
            log(logf, "step %d: codebook set from encoder vectors; quantising from here" % step)
        with autocast(dev):
            out, idxs, qloss, rests = model(x, beta=a.beta, quantise=quantising)
            out = out.float()
            mse = F.mse_loss(out, x)
            l1 = (out - x).abs().mean()
            el = edge_loss(out, x)
            loss = mse + l1 + a.edge_weight * el + qloss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        impose_reference(model.decoder, a.ref_value)
        if quantising:
            for idx in idxs:
                used.add_(torch.bincount(idx.flatten(), minlength=K))
        step += 1
        if (quantising and a.restart_every and not a.init and (step - a.ae_warmup) % a.restart_every == 0
                and step < 0.7 * a.steps):
            dead = (used == 0).nonzero().flatten()
            if len(dead):
                pool = torch.cat(rests)
                g = torch.Generator().manual_seed(a.seed * 1000003 + step)
                pick = torch.randint(0, len(pool), (len(dead),), generator=g).to(dev)
                noise = torch.randn(len(dead), pool.shape[1], generator=g).to(dev)
                with torch.no_grad():
                    model.codebook.weight[dead] = pool[pick] + 0.01 * noise
            log(logf, "step %d: %d of %d codes unused in the last %d steps, restarted" % (step, len(dead), K, a.restart_every))
            used.zero_()
        return {k: float(v.detach()) for k, v in (("loss", loss), ("mse", mse), ("l1", l1), ("edge", el), ("q", qloss))}

    def checkpoint(step):
        save(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                         "used": used, "config": cfg, "args": vars(a)})

    def evaluate(step):
        if not ((step % a.eval_every == 0 and step > a.ae_warmup) or step == a.steps):
            return False
        n = a.final_eval_images if step == a.steps else a.eval_images
        t0 = time.time()
        p, pm, per_scale, nu = evaluate_held_out(model, val[:n])
        log_tokenizer_eval(logf, a.out, step, p, pm, n, nu, " (per scale %s)" % per_scale, time.time() - t0)
        save(os.path.join(a.out, "ckpt-%06d.pt" % step), {"model": model.state_dict(), "step": step, "config": cfg})
        return True

    return train_loop(a, logf, opt, ck["step"] if ck else 0, end, train_step, checkpoint,
                      describe_losses, a.log_every, a.ckpt_every, evaluate)


if __name__ == "__main__":
    sys.exit(main())
