"""The multi-scale VQVAE of the shapes VAR model, in torch (VAR's tokenizer at toy size).

Decoder: exactly the decoder arserve's `msvq` decoder runs: f_hat (Cvae, n, n) ->
post_quant_conv 3x3 (Cvae -> Cvae) -> the VQ-16 decoder body of engine/family/vq_decoder.c
(conv_in, mid block_1 / attn_1 / block_2, levels coarsest first with num_res_blocks + 1
ResNet blocks, attention after every block of level 0 only, nearest 2x + 3x3 conv between
levels, GroupNorm(32, eps 1e-6) + SiLU + conv_out). The body is tools/train/raster/vq_model.py's
Decoder (the one the raster demo model ships), module names = tensor names after `vq.`.

Encoder (checkpoint only, not part of the model directory): 4x4 stride-2 conv 3 -> 64,
then residual blocks without GroupNorm (PlainBlock; cfg encoder_norm) with 3x3 stride-2
downsampling (asymmetric (0, 1, 0, 1) pad) at widths 64, 128, 128 down to the latent grid,
attention at the latent grid, mid block, conv_out 3x3 to Cvae.

Quantiser: VAR's multi-scale residual VQ (VectorQuantizer2 with using_znorm=False, written
anew): for every scale pn of `scales` (coarsest first) the residual is area-downsampled to
pn x pn (not for the last scale), each vector takes the nearest code by L2, the code map is
bicubic-upsampled (align_corners=False) to the latent grid (not for the last scale), passed
through Phi (the shared conv of nearest tick, phi_index) and subtracted from the residual
and added to f_hat. Loss: mean over scales of beta * |f_hat.detach() - f|^2 (commitment,
to the encoder) + |f_hat - f.detach()|^2 (to the codebook and Phi); straight-through f_hat.
Codes are not normalised.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tools", "train", "raster"))
from vq_model import AttnBlock, Decoder, ResBlock, init_reference_channels, norm, to_model_input, to_u8  # noqa: E402,F401

DEFAULT_CFG = {
    "image_size": 64,
    "scales": [1, 2, 3, 4, 5, 6, 8],
    "codebook_size": 256,
    "embed_dim": 16,
    "phi_count": 4,
    "phi_ratio": 0.5,
    # decoder (engine `msvq`): level widths coarsest first = base * mult[n-1-i]
    # = 128 (8 px, attention), 128 (16), 32 (32), 64 (64)
    "base_channels": 32,
    "channel_multiplier": [2, 1, 4, 4],
    "num_res_blocks": 0,
    "out_channels": 3,
    # encoder: 4x4 stride-2 conv to width[0], then one block per width, 2x down between
    "encoder_widths": [64, 128, 128],
    "encoder_norm": False,
}


def reference_odd(decoder):
    """(last ResNet block, odd channel indices) of the reference-channel construction."""
    blk = decoder.up[-1].block[-1]
    return blk, torch.arange(1, blk.conv2.out_channels, 2, device=blk.conv2.weight.device)


@torch.no_grad()
def impose_reference(decoder, value):
    """Holds every odd channel of the last ResNet block's output at the constant `value`
    (zero conv2 and shortcut rows, shortcut bias = value): each GroupNorm group of norm_out
    (two channels) then holds one constant channel, which fixes the group's spread, so
    norm_out passes the even channel's absolute level (an object's colour) instead of
    rescaling it by the image's own spread. Needs a last block with a 1x1 shortcut."""
    blk, odd = reference_odd(decoder)
    blk.conv2.weight[odd] = 0
    blk.conv2.bias[odd] = 0
    blk.nin_shortcut.weight[odd] = 0
    blk.nin_shortcut.bias[odd] = value


@torch.no_grad()
def init_reference(decoder, value):
    """impose_reference, and norm_out's affine set so that norm_out starts as about the
    identity on the even channels (GroupNorm of (v, value) is about 2v/value - 1 while
    |v| << value) and zero on the constant ones."""
    impose_reference(decoder, value)
    n = decoder.norm_out
    n.weight[0::2] = value / 2
    n.bias[0::2] = value / 2
    n.weight[1::2] = 0
    n.bias[1::2] = 0


def phi_ticks(k):
    if k == 4:
        return np.linspace(1 / 3 / k, 1 - 1 / 3 / k, k)
    return np.linspace(1 / 2 / k, 1 - 1 / 2 / k, k)


def phi_index(si, n_scales, k):
    """Which shared Phi conv scale si of n_scales uses (VAR's PhiPartiallyShared)."""
    return int(np.argmin(np.abs(phi_ticks(k) - si / (n_scales - 1))))


class Phi(nn.Module):
    def __init__(self, e, ratio):
        super().__init__()
        self.ratio = ratio
        self.conv = nn.Conv2d(e, e, 3, padding=1)

    def forward(self, h):
        return h * (1 - self.ratio) + self.conv(h) * self.ratio


class PlainBlock(nn.Module):
    """Residual block without normalisation: x + conv(silu(conv(silu(x)))), 1x1 shortcut
    when the width changes. GroupNorm with one channel per group rescales each channel by
    its spread over the image and hides an object's absolute colour."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x):
        h = self.conv2(F.silu(self.conv1(F.silu(x))))
        return h + (self.nin_shortcut(x) if self.nin_shortcut is not None else x)


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        w = cfg["encoder_widths"]
        Block = ResBlock if cfg.get("encoder_norm", True) else PlainBlock
        self.conv_in = nn.Conv2d(3, w[0], 4, stride=2, padding=1)
        self.blocks = nn.ModuleList()
        self.downs = nn.ModuleList()
        c = w[0]
        for i, wi in enumerate(w):
            self.blocks.append(Block(c, wi))
            c = wi
            if i != len(w) - 1:
                self.downs.append(nn.Conv2d(c, c, 3, stride=2, padding=0))
        self.attn = AttnBlock(c)
        self.mid_1 = Block(c, c)
        self.mid_attn = AttnBlock(c)
        self.mid_2 = Block(c, c)
        self.conv_out = nn.Conv2d(c, cfg["embed_dim"], 3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i < len(self.downs):
                x = self.downs[i](F.pad(x, (0, 1, 0, 1)))
        x = self.attn(x)
        x = self.mid_2(self.mid_attn(self.mid_1(x)))
        return self.conv_out(x)


def up_to(h, n):
    return F.interpolate(h, size=(n, n), mode="bicubic", align_corners=False)


def down_to(f, n):
    return F.interpolate(f, size=(n, n), mode="area")


class MSVQ(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        e = cfg["embed_dim"]
        self.scales = list(cfg["scales"])
        self.encoder = Encoder(cfg)
        self.codebook = nn.Embedding(cfg["codebook_size"], e)
        nn.init.normal_(self.codebook.weight, std=0.1)
        self.phi = nn.ModuleList(Phi(e, cfg["phi_ratio"]) for _ in range(cfg["phi_count"]))
        self.post_quant_conv = nn.Conv2d(e, e, 3, padding=1)
        dcfg = dict(cfg, latent_channels=e)
        self.decoder = Decoder(dcfg)

    def phi_at(self, si):
        return self.phi[phi_index(si, len(self.scales), len(self.phi))]

    def nearest(self, v):
        """Nearest code by L2 of rows v (N, E)."""
        w = self.codebook.weight.detach()
        d = (v * v).sum(1, keepdim=True) + (w * w).sum(1)[None] - 2 * v @ w.t()
        return d.argmin(1)

    def code_map(self, idx, si):
        """Scale si's contribution to f_hat from its code map idx (B, pn, pn)."""
        n = self.scales[-1]
        h = self.codebook(idx).permute(0, 3, 1, 2)
        if si != len(self.scales) - 1:
            h = up_to(h, n)
        return self.phi_at(si)(h)

    def quantise(self, f, beta=0.25):
        """f (B, E, n, n) -> (straight-through f_hat, [idx (B, pn, pn)] per scale, loss,
        rest vectors per scale for dead-code restarts). In F32 under autocast too: the
        residuals shrink scale by scale, and bf16 would round the last ones away."""
        with torch.autocast(f.device.type, enabled=False):
            return self._quantise(f.float(), beta)

    def _quantise(self, f, beta):
        fd = f.detach()
        rest = fd.clone()
        f_hat = torch.zeros_like(fd)
        S = len(self.scales)
        idxs, rests, loss = [], [], 0.0
        for si, pn in enumerate(self.scales):
            r = down_to(rest, pn) if si != S - 1 else rest
            v = r.permute(0, 2, 3, 1).reshape(-1, r.shape[1])
            idx = self.nearest(v).view(f.shape[0], pn, pn)
            h = self.code_map(idx, si)
            f_hat = f_hat + h
            rest = rest - h.detach()
            idxs.append(idx)
            rests.append(v)
            loss = loss + beta * F.mse_loss(f_hat.detach(), f) + F.mse_loss(f_hat, fd)
        loss = loss / S
        f_st = f + (f_hat - f).detach() + (f_hat - f_hat.detach())
        return f_st, idxs, loss, rests

    @torch.no_grad()
    def tokenize(self, x):
        """x (B, 3, H, W) in [-1, 1] -> [idx (B, pn, pn)] per scale."""
        return self.quantise(self.encoder(x))[1]

    def fhat_from_codes(self, idxs):
        f_hat = 0
        for si, idx in enumerate(idxs):
            f_hat = f_hat + self.code_map(idx, si)
        return f_hat

    def decode_fhat(self, f_hat):
        return self.decoder(self.post_quant_conv(f_hat))

    def forward(self, x, beta=0.25, quantise=True):
        f = self.encoder(x)
        if not quantise:
            return self.decode_fhat(f), None, f.new_zeros(()), None
        f_st, idxs, loss, rests = self.quantise(f, beta)
        # f_st carries gradients to the encoder (straight-through) and to the codebook and
        # Phi (through f_hat - f_hat.detach(), zero in value); the decoder sees f_hat.
        return self.decode_fhat(f_st), idxs, loss, rests
