#!/usr/bin/env python3
"""Trains the shapes-inf demo model (Infinity's architecture: a T5 encoder trained from scratch,
the next-scale bitwise transformer, a BSQ-VAE) on the shapes world's captions at 64 px, every
stage resumable, and writes an arserve model directory through tools/convert/infinity.py.

    python3 tools/train/inf/train.py --out build/train-inf              (the demo's sizes)
    python3 tools/train/inf/train.py --out /tmp/ti --tiny               (seconds: the test's)

Stages, in order (the same command continues where the last run stopped):
  vae     OUT/vae: the BSQ-VAE (encoder, multi-scale bitwise quantiser, decoder) on rendered
          scenes (64 px: the 128 px render box-filtered), reconstruction + commitment loss
  lm      OUT/lm: T5 and the transformer together, teacher-forced on the VAE's bits of
          captioned scenes (tools/shapes), 10% of captions dropped to the learned
          unconditional rows (classifier-free guidance)
  export  OUT/official (the released checkpoints' layout: infinity.pth, vae.pth, t5/ with its
          tokenizer.json), then OUT/model via tools/convert/infinity.py (--pn 0.06M, 1:1, F16)
Samples are drawn from seeded streams as the stages train (sample i of stream s), so no data
stage; the text tokenizer is word-level over tools/shapes' vocabulary.

--device auto trains on CUDA when torch sees one (bf16 autocast), else the CPU in F32;
--max-minutes M stops a training stage with its checkpoint written (exit status 75: run the
same command again). Needs torch, numpy, Pillow and transformers; nothing is downloaded.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
for p in (HERE, os.path.join(ROOT, "tools", "train"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import model as M  # noqa: E402
import train_util as U  # noqa: E402
from tools.shapes import scene as S  # noqa: E402

SCHEDULE = [(1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16)]  # '0.06M' at 1:1
ROPE_GRID = (64, 64)  # the '1M' schedule's last 1:1 scale
IMAGE = 64
# What the same command needs to continue after a time limit: nothing, it always resumes from OUT.
AGAIN = ""
SPECIALS = ["<pad>", "</s>", "<unk>"]  # T5's ids 0, 1, 2

FULL = {"d": 16, "vae_base": 32, "vae_mult": [1, 2, 2], "vae_blocks": 1,
        "C": 192, "depth": 6, "H": 4, "text_channels": 128, "text_maxlen": 16,
        "t5": {"d_model": 128, "d_kv": 32, "num_heads": 4, "d_ff": 256, "num_layers": 2},
        "vae_steps": 3000, "vae_batch": 16, "vae_lr": 1e-3,
        "lm_steps": 12000, "lm_batch": 32, "lm_lr": 6e-4, "lm_mix": None,
        "lm_default_colour": None, "lm_default_position": None, "lm_default_pair": None,
        "init_depth": None}
TINY = dict(FULL, d=8, vae_mult=[1, 1, 1], C=64, depth=2, H=2,
            t5={"d_model": 128, "d_kv": 32, "num_heads": 2, "d_ff": 128, "num_layers": 1},
            vae_steps=3, vae_batch=2, lm_steps=3, lm_batch=2)


# ----------------------------------------------------------------------------- data


def sample(seed, i, mix=None, **defaults):
    """(caption, uint8 image [64, 64, 3]) of sample i of stream `seed`; defaults:
    sample_training_scene's default_colour, default_position, default_pair."""
    rng = np.random.default_rng([seed, i])
    rec, img = S.sample_training_scene(rng, mix, **defaults)
    return rec["caption"], np.asarray(Image.fromarray(img).reduce(S.SIZE // IMAGE))


def batch(seed, step, n, mix=None, **defaults):
    caps, imgs = zip(*(sample(seed, step * n + k, mix, **defaults) for k in range(n)))
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return list(caps), x


def tokenizer_json():
    """A word-level tokenizer (the engine's Hugging Face tokenizer.json reader): <pad>,
    </s>, <unk>, then the caption words; lower-cased, split on whitespace and punctuation."""
    vocab = {w: i for i, w in enumerate(SPECIALS + S.vocabulary())}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": w, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for i, w in enumerate(SPECIALS)],
            "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}


def encode(vocab, caption):
    """Ids of a caption and </s> (what arserve feeds T5: its tokenizer's ids, then eos)."""
    return [vocab.get(w, 2) for w in re.findall(r"\w+|[^\w\s]+", caption.lower())] + [1]


# ----------------------------------------------------------------------------- the VAE


class Encoder(nn.Module):
    """64 px RGB -> d channels at 16 x 16 (two stride-2 convs)."""

    def __init__(self, d, base):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, base, 3, padding=1), M.ResnetBlock(base, base),
            nn.Conv2d(base, 2 * base, 4, stride=2, padding=1), M.ResnetBlock(2 * base, 2 * base),
            nn.Conv2d(2 * base, 2 * base, 4, stride=2, padding=1), M.ResnetBlock(2 * base, 2 * base),
            nn.GroupNorm(32, 2 * base, eps=1e-6), nn.SiLU(), nn.Conv2d(2 * base, d, 3, padding=1))

    def forward(self, x):
        return self.net(x)


class BSQVAE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = Encoder(cfg["d"], cfg["vae_base"])
        self.decoder = M.Decoder(cfg["d"], cfg["vae_base"], cfg["vae_mult"], cfg["vae_blocks"], patch=4)

    def quantize(self, z):
        """Multi-scale bitwise residual quantisation of z [B, d, 16, 16]: at each scale the
        residual's area average, its signs as bits; f_hat adds each scale's codes as the
        engine does (model.next_scale_inputs). Returns (bits [B, L, d] long, f_hat)."""
        B, d, H, W = z.shape
        f_hat, bits = torch.zeros_like(z), []
        for s, (h, w) in enumerate(SCHEDULE):
            r = F.interpolate(z - f_hat, size=(h, w), mode="area")
            b = (r > 0).long()
            bits.append(b.flatten(2).transpose(1, 2))
            codes = M.bit_codes(b.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            f_hat = f_hat + (F.interpolate(codes, size=(H, W), mode="bilinear", align_corners=False)
                             if s < len(SCHEDULE) - 1 else codes)
        return torch.cat(bits, 1), f_hat

    def forward(self, x):
        z = self.encoder(x)
        bits, f_hat = self.quantize(z)
        zq = z + (f_hat - z).detach()  # straight through
        return self.decoder(zq), z, f_hat, bits


# ----------------------------------------------------------------------------- stages


def make_lm(cfg, vocab_size):
    from transformers import T5Config, T5EncoderModel
    t = cfg["t5"]
    t5 = T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=t["d_model"], d_kv=t["d_kv"],
                                 num_heads=t["num_heads"], d_ff=t["d_ff"], num_layers=t["num_layers"],
                                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                                 relative_attention_max_distance=128, dropout_rate=0.0,
                                 layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    net = M.Infinity(cfg["C"], cfg["depth"], cfg["H"], cfg["d"], cfg["text_channels"], cfg["text_maxlen"],
                     chunks=cfg["depth"])
    return t5, net


def run_stage(name, a, cfg, dev, modules, step_fn, steps, lr, seed):
    """A stage's run of train_util.train_loop: AdamW, warm-up then cosine, OUT/name/ckpt.pt
    (resumed from whenever it exists) every 200 steps, on --ckpt-minutes and at --max-minutes.
    step_fn(step, seed) -> (loss, the step's scalars to log)."""
    out = os.path.join(a.out, name)
    os.makedirs(out, exist_ok=True)
    logf, ckpt = os.path.join(out, "train.log"), os.path.join(out, "ckpt.pt")
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    # A stage continues under a longer schedule (--set lm_steps=...): no config check.
    ck = U.resume(ckpt, logf, opt, cfg, same=lambda ck: True)
    if ck:
        for m, sd in zip(modules, ck["models"]):
            m.load_state_dict(sd)
    step = ck["step"] if ck else 0
    if step >= steps:
        return 0
    sched = argparse.Namespace(lr=lr, warmup=min(100, steps // 10 + 1), steps=steps, min_lr_frac=0.05,
                               max_minutes=a.max_minutes, ckpt_minutes=a.ckpt_minutes)
    U.log(logf, "%s from step %d of %d on %s" % (name, step, steps, U.describe_device(dev)))

    def train_step(step):
        with U.autocast(dev):
            loss, scalars = step_fn(step, seed)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return scalars

    def checkpoint(step):
        U.save(ckpt, {"models": [m.state_dict() for m in modules], "opt": opt.state_dict(),
                      "step": step, "config": cfg})

    describe = lambda m: " ".join("%s %.4f" % kv for kv in m.items())  # noqa: E731
    return U.train_loop(sched, logf, opt, step, steps, train_step, checkpoint, describe, 20, 200,
                        again=AGAIN)


def stage_vae(a, cfg, dev):
    vae = BSQVAE(cfg)
    if a.init:  # the exported decoder, held: the encoder learns to write the bits it reads
        load_exported(a.init, cfg, decoder=vae.decoder)
        vae.decoder.requires_grad_(False)
    vae = vae.to(dev)

    def step_fn(step, seed):
        _, x = batch(seed, step, cfg["vae_batch"])
        x = x.to(dev)
        rec, z, f_hat, _ = vae(x)
        mse = F.mse_loss(rec.float(), x)
        commit = F.mse_loss(z.float(), f_hat.float().detach())
        loss = mse + F.l1_loss(rec.float(), x) + 0.25 * commit
        psnr = 10 * torch.log10(4.0 / mse.detach().clamp_min(1e-10))
        return loss, {"loss": loss.item(), "psnr": psnr.item(), "commit": commit.item()}

    return run_stage("vae", a, cfg, dev, [vae], step_fn, cfg["vae_steps"], cfg["vae_lr"], seed=1)


def load_vae(a, cfg, dev):
    vae = BSQVAE(cfg)
    vae.load_state_dict(torch.load(os.path.join(a.out, "vae", "ckpt.pt"), map_location="cpu",
                                   weights_only=False)["models"][0])
    return vae.to(dev).eval()


def stage_lm(a, cfg, dev):
    vae = load_vae(a, cfg, dev)
    vocab = tokenizer_json()["model"]["vocab"]
    t5, net = make_lm(cfg, len(vocab))
    if a.init:
        load_init(a.init, cfg, t5, net)
    t5, net = t5.to(dev), net.to(dev)
    gen = torch.Generator().manual_seed(5)

    def step_fn(step, seed):
        caps, x = batch(seed, step, cfg["lm_batch"], cfg["lm_mix"], default_colour=cfg["lm_default_colour"],
                        default_position=cfg["lm_default_position"], default_pair=cfg["lm_default_pair"])
        with torch.no_grad():
            bits, _ = vae.quantize(vae.encoder(x.to(dev)))
        ids = [encode(vocab, c)[:cfg["text_maxlen"]] for c in caps]
        n = max(len(i) for i in ids)
        tok = torch.tensor([i + [0] * (n - len(i)) for i in ids], device=dev)
        mask = tok != 0
        mask[:, 0] = True
        feats = t5(input_ids=tok, attention_mask=mask.long()).last_hidden_state
        drop = (torch.rand(len(caps), generator=gen) < 0.1).to(dev)
        unc = net.cfg_uncond[:n][None].expand(len(caps), -1, -1)
        feats = torch.where(drop[:, None, None], unc.to(feats.dtype), feats)
        inputs, _ = M.next_scale_inputs(bits, SCHEDULE)
        logits = net(feats, mask, inputs.to(feats.dtype), SCHEDULE, ROPE_GRID)
        loss = F.cross_entropy(logits.float().reshape(-1, 2), bits.reshape(-1))
        acc = (logits.argmax(-1) == bits).float().mean()
        return loss, {"loss": loss.item(), "bit_acc": acc.item()}

    return run_stage("lm", a, cfg, dev, [t5, net], step_fn, cfg["lm_steps"], cfg["lm_lr"], seed=3)


def released(t5, net, vae_decoder, vae_encoder=None):
    """The modules' tensors under the released checkpoints' names: (infinity.pth's,
    vae.pth's, the T5 folder's config and weights)."""
    vsd = {"decoder." + k: v for k, v in vae_decoder.state_dict().items()}
    if vae_encoder is not None:
        vsd.update({"encoder." + k: v for k, v in vae_encoder.state_dict().items()})
    return net.state_dict(), vsd, t5.config.to_dict(), t5.state_dict()


def load_exported(model_dir, cfg, t5=None, net=None, decoder=None):
    """Loads an exported arserve model (what `export` wrote, e.g. models/shapes-inf) back
    into the modules given, which must have its sizes (--set them as it was trained). Where
    each stored element came from is read off the converter itself: it is run on copies of
    the modules' released tensors filled with distinct element numbers, so the stored
    tensor under each name holds the numbers of the elements it took (renames, reshapes
    and any reordering alike)."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "convert"))
    import infinity as conv  # tools/convert/infinity.py

    stored = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            stored.update(U.load_weights(os.path.join(model_dir, f)))
    if not stored:
        sys.exit("--init %s: no *.safetensors there (an exported model directory?)" % model_dir)
    stub_t5, stub_net = make_lm(cfg, len(tokenizer_json()["model"]["vocab"]))
    stub_dec = BSQVAE(cfg).decoder
    inf_sd, vae_sd, t5_cfg, t5_sd = released(t5 or stub_t5, net or stub_net, decoder or stub_dec)
    params = {p.data_ptr() for m in (t5 or stub_t5, net or stub_net, decoder or stub_dec)
              for p in m.parameters()}
    origin, next_id, numbered = {}, 0, {}
    for group, sd in (("inf", inf_sd), ("vae", vae_sd), ("t5", t5_sd)):
        numbered[group] = {}
        for k, v in sd.items():
            if v.data_ptr() not in params:  # buffers (masks, zero biases) keep their values
                numbered[group][k] = v.detach().double().numpy()
                continue
            key = (v.data_ptr(), v.shape)  # tied tensors (T5's embeddings) share their numbers
            if key not in origin:
                origin[key] = (group, k, next_id)
                next_id += v.numel()
            base = origin[key][2]
            numbered[group][k] = np.arange(base, base + v.numel(), dtype=np.float64).reshape(v.shape)
    where = "the modules' released tensors"
    _, it = conv.convert_infinity(numbered["inf"], where)
    _, qt = conv.convert_vae(numbered["vae"], where)
    _, tt, _ = conv.convert_t5(t5_cfg, numbered["t5"], where)
    mapped = {**it, **qt, **tt}
    flat = {(g, k): torch.zeros(n, dtype=torch.float64) for (_, shape), (g, k, _) in origin.items()
            for n in [int(np.prod(shape))]}
    starts = sorted((b, g, k) for (_, _), (g, k, b) in origin.items())
    ids = [b for b, _, _ in starts]
    for name, idx in mapped.items():
        if name not in stored:
            sys.exit("--init %s: no tensor %r (the sizes --set differ from the model's?)" % (model_dir, name))
        val = stored[name].double().reshape(-1)
        idx = np.asarray(idx, dtype=np.float64).reshape(-1).astype(np.int64)
        if val.numel() != idx.size:
            sys.exit("--init %s: %r holds %d values, these sizes give %d (set the sizes it was "
                     "trained with)" % (model_dir, name, val.numel(), idx.size))
        src = np.searchsorted(ids, idx, side="right") - 1
        for j in np.unique(src):
            _, g, k = starts[j]
            sel = src == j
            flat[(g, k)][torch.from_numpy(idx[sel] - ids[j])] = val[torch.from_numpy(sel)]
    for g, sd, mod in (("inf", inf_sd, net), ("vae", vae_sd, decoder), ("t5", t5_sd, t5)):
        if mod is None:
            continue
        prefix = "decoder." if g == "vae" else ""
        mod.load_state_dict({k[len(prefix):]: flat[origin[(v.data_ptr(), v.shape)][:2]].reshape(v.shape).to(v.dtype)
                             for k, v in sd.items() if v.data_ptr() in params}, strict=False)


def load_init(model_dir, cfg, t5, net):
    """--init into the lm stage's T5 and transformer. With init_depth below depth the model
    in model_dir has init_depth blocks: they become the first ones, and each block after them
    starts with its three output projections (self-attention, cross-attention, FFN) at zero,
    so the deeper transformer's logits are the model's until it trains."""
    d0 = cfg["init_depth"] or cfg["depth"]
    if d0 == cfg["depth"]:
        return load_exported(model_dir, cfg, t5=t5, net=net)
    small_cfg = dict(cfg, depth=d0)
    _, small = make_lm(small_cfg, len(tokenizer_json()["model"]["vocab"]))
    load_exported(model_dir, small_cfg, t5=t5, net=small)
    shared = {k: v for k, v in small.state_dict().items() if not k.startswith("block_chunks.")}
    missing = net.load_state_dict(shared, strict=False).missing_keys
    assert all(k.startswith("block_chunks.") for k in missing), missing
    blocks = net.blocks()
    for src, dst in zip(small.blocks(), blocks):
        dst.load_state_dict(src.state_dict())
    with torch.no_grad():
        for b in blocks[d0:]:
            for lin in (b.sa.proj, b.ca.proj, b.ffn.fc2):
                lin.weight.zero_()
                lin.bias.zero_()


def stage_export(a, cfg):
    off = os.path.join(a.out, "official")
    os.makedirs(os.path.join(off, "t5"), exist_ok=True)
    vae = load_vae(a, cfg, torch.device("cpu"))
    vocab_json = tokenizer_json()
    t5, net = make_lm(cfg, len(vocab_json["model"]["vocab"]))
    ck = torch.load(os.path.join(a.out, "lm", "ckpt.pt"), map_location="cpu", weights_only=False)
    t5.load_state_dict(ck["models"][0])
    net.load_state_dict(ck["models"][1])
    inf_sd, vsd, _, _ = released(t5, net, vae.decoder, vae.encoder)
    # Matrices as F16, as released; vectors F32 holding F16 values: the converter's --dtype f16
    # stores every tensor in F16, so these files are exactly what arserve runs.
    half = lambda sd: {k: (v.half() if v.dim() >= 2 else v.half().float()) for k, v in sd.items()}  # noqa: E731
    torch.save(half(inf_sd), os.path.join(off, "infinity.pth"))
    torch.save({"vae": half(vsd)}, os.path.join(off, "vae.pth"))
    t5.half().save_pretrained(os.path.join(off, "t5"))
    with open(os.path.join(off, "t5", "tokenizer.json"), "w") as f:
        json.dump(vocab_json, f, indent=1)
    model = os.path.join(a.out, "model")
    shutil.rmtree(model, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert", "infinity.py"),
           os.path.join(off, "infinity.pth"), os.path.join(off, "vae.pth"), os.path.join(off, "t5"),
           model, "--pn", "0.06M", "--ratios", "1.0", "--name", a.name, "--dtype", "f16"]
    print("export:", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the test's sizes: seconds on a CPU")
    ap.add_argument("--name", default="shapes-inf")
    ap.add_argument("--stages", default="vae,lm,export")
    ap.add_argument("--init", metavar="MODEL_DIR",
                    help="start from an exported model (its sizes --set as trained): the lm "
                         "stage from its T5 and transformer, the vae stage trains an encoder "
                         "for its decoder, which stays fixed; give it again to continue")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a size or step count, e.g. --set lm_steps=20000")
    U.add_run_args(ap, again=AGAIN)
    a = ap.parse_args(argv)
    U.check_run_args(ap, a)
    cfg = dict(TINY if a.tiny else FULL)
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in cfg:
            ap.error("--set %s: no such setting (%s)" % (k, ", ".join(sorted(cfg))))
        cfg[k] = json.loads(v)
    if cfg["lm_mix"] is not None:
        try:
            S.mix_thresholds(cfg["lm_mix"])
        except (ValueError, AttributeError) as e:
            ap.error("--set lm_mix=%s: %s (a JSON object of caption kinds' weights)"
                     % (json.dumps(cfg["lm_mix"]), e))
    if cfg["lm_default_colour"] is not None and cfg["lm_default_colour"] not in S.COLOURS:
        ap.error("--set lm_default_colour=%s: not one of %s" % (json.dumps(cfg["lm_default_colour"]),
                                                                ", ".join(S.COLOURS)))
    if cfg["lm_default_position"] is not None and cfg["lm_default_position"] not in S.POSITIONS:
        ap.error("--set lm_default_position=%s: not one of %s" % (json.dumps(cfg["lm_default_position"]),
                                                                  ", ".join(S.POSITIONS)))
    if cfg["lm_default_pair"] is not None:
        try:  # the data's own check, on one sample
            S.sample_training_scene(np.random.default_rng(0), default_pair=cfg["lm_default_pair"])
        except (ValueError, TypeError) as e:
            ap.error("--set lm_default_pair=%s: %s" % (json.dumps(cfg["lm_default_pair"]), e))
    if cfg["init_depth"] is not None and not (a.init and isinstance(cfg["init_depth"], int)
                                              and 0 < cfg["init_depth"] <= cfg["depth"]):
        ap.error("--set init_depth=%s: the --init model's depth, from 1 to depth (%d); needs --init"
                 % (json.dumps(cfg["init_depth"]), cfg["depth"]))
    if a.init and not os.path.isdir(a.init):
        ap.error("--init %s: not a directory" % a.init)
    stages = a.stages.split(",")
    bad = [s for s in stages if s not in ("vae", "lm", "export")]
    if bad:
        ap.error("--stages: unknown stage %r (vae, lm, export)" % bad[0])
    dev = U.pick_device(a.device)
    torch.manual_seed(1)
    for st in stages:
        rc = stage_export(a, cfg) if st == "export" else (stage_vae if st == "vae" else stage_lm)(a, cfg, dev)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
