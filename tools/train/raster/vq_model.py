"""The VQ tokenizer trained for the shapes demo model, in torch.

The decoder is exactly the VQ-16 decoder arserve runs (engine/family/vq_decoder.c): codebook
rows L2-normalised at lookup, post_quant_conv 1x1, conv_in 3x3, mid block_1 / attn_1 /
block_2, levels coarsest first with num_res_blocks + 1 ResNet blocks each (attention after
every block of level 0 only), nearest 2x upsample + 3x3 conv between levels, GroupNorm(32,
eps 1e-6) + swish + conv_out. Module names match the canonical `vq.*` tensor names of
docs/model-format.md after the `vq.` prefix, so export is a rename-free copy.

The encoder mirrors it: conv_in, levels finest first (encoder_res_blocks ResNet blocks
each, attention after each block of the coarsest level), 3x3 stride-2 downsampling with
the asymmetric (0, 1, 0, 1) zero pad between levels, mid block, conv_out to
latent_channels (GroupNorm + swish before it only with encoder_norm_out), quant_conv 1x1
to embed_dim. The quantiser compares L2-normalised
encoder outputs with L2-normalised codes (cosine distance), with commitment loss and a
straight-through gradient; codes follow the encoder outputs assigned to them by
exponential moving average (k-means style) rather than by gradient.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from tools.shapes import codebook as shapes_codebook  # noqa: E402

GN_GROUPS = 32
GN_EPS = 1e-6


def norm(c):
    return nn.GroupNorm(GN_GROUPS, c, eps=GN_EPS, affine=True)


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.norm1 = norm(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)
        else:
            self.nin_shortcut = None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (self.nin_shortcut(x) if self.nin_shortcut is not None else x)


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, residual."""

    def __init__(self, c):
        super().__init__()
        self.norm = norm(c)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.norm(x)
        q = self.q(t).reshape(b, c, h * w).transpose(1, 2)  # (b, hw, c)
        k = self.k(t).reshape(b, c, h * w)  # (b, c, hw)
        v = self.v(t).reshape(b, c, h * w)  # (b, c, hw)
        a = torch.softmax(torch.bmm(q, k) * (c ** -0.5), dim=2)  # (b, hw_q, hw_k)
        o = torch.bmm(v, a.transpose(1, 2)).reshape(b, c, h, w)
        return x + self.proj_out(o)


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Mid(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block_1 = ResBlock(c, c)
        self.attn_1 = AttnBlock(c)
        self.block_2 = ResBlock(c, c)

    def forward(self, x):
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    def __init__(self, c_in, c_out, n_blocks, with_attn, resample):
        super().__init__()
        self.block = nn.ModuleList(ResBlock(c_in if j == 0 else c_out, c_out) for j in range(n_blocks))
        self.attn = nn.ModuleList(AttnBlock(c_out) for _ in range(n_blocks)) if with_attn else nn.ModuleList()
        if resample == "up":
            self.upsample = Upsample(c_out)
        elif resample == "down":
            self.downsample = Downsample(c_out)

    def forward(self, x):
        for j, blk in enumerate(self.block):
            x = blk(x)
            if len(self.attn):
                x = self.attn[j](x)
        if hasattr(self, "upsample"):
            x = self.upsample(x)
        if hasattr(self, "downsample"):
            x = self.downsample(x)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        base, mult, nrb = cfg["base_channels"], cfg["channel_multiplier"], cfg["num_res_blocks"]
        n = len(mult)
        widths = [base * mult[n - 1 - i] for i in range(n)]  # coarsest first
        self.conv_in = nn.Conv2d(cfg["latent_channels"], widths[0], 3, padding=1)
        self.mid = Mid(widths[0])
        c = widths[0]
        self.up = nn.ModuleList()
        for i in range(n):
            self.up.append(Level(c, widths[i], nrb + 1, i == 0, "up" if i != n - 1 else None))
            c = widths[i]
        self.norm_out = norm(c)
        self.conv_out = nn.Conv2d(c, cfg["out_channels"], 3, padding=1)

    def forward(self, z):
        x = self.mid(self.conv_in(z))
        for lv in self.up:
            x = lv(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        base = cfg["base_channels"]
        mult = cfg.get("encoder_channel_multiplier", cfg["channel_multiplier"])
        nrb = cfg.get("encoder_res_blocks", max(1, cfg["num_res_blocks"]))
        n = len(mult)
        widths = [base * m for m in mult]  # finest first
        self.conv_in = nn.Conv2d(3, widths[0], 3, padding=1)
        self.down = nn.ModuleList()
        c = widths[0]
        for i in range(n):
            self.down.append(Level(c, widths[i], nrb, i == n - 1, "down" if i != n - 1 else None))
            c = widths[i]
        self.mid = Mid(c)
        # Optional GroupNorm + swish before conv_out (the usual VQGAN encoder). Off by
        # default: normalising each group by its spread over the image makes an
        # object's code depend on its area, and colours came out poorly separated.
        self.norm_out = norm(c) if cfg.get("encoder_norm_out", False) else None
        self.conv_out = nn.Conv2d(c, cfg["latent_channels"], 3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        for lv in self.down:
            x = lv(x)
        x = self.mid(x)
        if self.norm_out is not None:
            x = F.silu(self.norm_out(x))
        return self.conv_out(x)


class Codebook(nn.Module):
    """K x E codes, updated as exponential moving averages of the (normalised) encoder
    outputs assigned to them, not by gradient: `weight` is the normalised running mean
    direction; ema_sum / ema_count are the running sums."""

    def __init__(self, k, e):
        super().__init__()
        self.weight = nn.Parameter(F.normalize(torch.randn(k, e), dim=1), requires_grad=False)
        self.register_buffer("ema_sum", self.weight.detach().clone())
        self.register_buffer("ema_count", torch.ones(k))

    @torch.no_grad()
    def set(self, codes, count=1.0):
        self.weight.copy_(F.normalize(codes, dim=1))
        self.ema_sum.copy_(self.weight * count)
        self.ema_count.fill_(count)

    @torch.no_grad()
    def ema_update(self, zn_flat, idx, decay):
        k = self.weight.shape[0]
        counts = torch.bincount(idx, minlength=k).float()
        sums = torch.zeros_like(self.ema_sum).index_add_(0, idx, zn_flat)
        self.ema_count.mul_(decay).add_(counts, alpha=1 - decay)
        self.ema_sum.mul_(decay).add_(sums, alpha=1 - decay)
        self.weight.copy_(F.normalize(self.ema_sum, dim=1))

    @torch.no_grad()
    def restart(self, rows, vectors):
        c0 = float(self.ema_count.mean())
        self.weight[rows] = F.normalize(vectors, dim=1)
        self.ema_sum[rows] = self.weight[rows] * c0
        self.ema_count[rows] = c0


class VQModel(nn.Module):
    """encoder -> quant_conv -> quantise -> post_quant_conv -> decoder."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        lat, e, k = cfg["latent_channels"], cfg["embed_dim"], cfg["codebook_size"]
        self.encoder = Encoder(cfg)
        self.quant_conv = nn.Conv2d(lat, e, 1)
        self.codebook = Codebook(k, e)
        self.post_quant_conv = nn.Conv2d(e, lat, 1)
        self.decoder = Decoder(cfg)

    def encode(self, x):
        """x (b, 3, H, W) in [-1, 1] -> L2-normalised h (b, e, h, w)."""
        return F.normalize(self.quant_conv(self.encoder(x)), dim=1)

    def quantise(self, zn):
        """Nearest normalised code by cosine similarity: (indices (b, h, w), codes). In F32
        under autocast too: bf16 similarities would tie codes that differ."""
        cb = F.normalize(self.codebook.weight, dim=1)
        b, e, h, w = zn.shape
        flat = zn.float().permute(0, 2, 3, 1).reshape(-1, e)
        with torch.autocast(zn.device.type, enabled=False):
            idx = torch.argmax(flat @ cb.t(), dim=1)
        zq = cb[idx].reshape(b, h, w, e).permute(0, 3, 1, 2)
        return idx.reshape(b, h, w), zq

    def decode_indices(self, idx):
        cb = F.normalize(self.codebook.weight, dim=1)
        zq = cb[idx].permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(zq))

    def forward(self, x, beta=0.25, quantise=True):
        """(reconstruction, indices, normalised encoder output, commitment loss). With
        quantise=False the decoder sees the encoder output itself (warm-up)."""
        zn = self.encode(x)
        if not quantise:
            return self.decoder(self.post_quant_conv(zn)), None, zn, zn.new_zeros(())
        idx, zq = self.quantise(zn)
        commit_loss = beta * F.mse_loss(zn, zq.detach())
        zq_st = zn + (zq - zn).detach()  # straight-through
        out = self.decoder(self.post_quant_conv(zq_st))
        return out, idx, zn, commit_loss

    def tokenize(self, x):
        """x (b, 3, H, W) in [-1, 1] -> token indices (b, h, w), raster order."""
        return self.quantise(self.encode(x))[0]


@torch.no_grad()
def init_reference_channels(decoder, value=8.0):
    """Initialises the decoder's last ResNet block so that every odd output channel is the
    constant `value`: GroupNorm pairs it with an even channel, and the pair's statistics
    are then dominated by the constant, so norm_out passes the even channel's absolute
    level (an object's colour) at a fixed scale instead of rescaling it by the image's own
    spread. Needs a last-level width of at least 64 (two channels per group). Training
    may change these weights freely; this only sets the starting point."""
    blk = decoder.up[-1].block[-1]
    c = blk.conv2.out_channels
    if c // 32 < 2:
        return False
    odd = torch.arange(1, c, 2)
    blk.conv2.weight[odd] = 0
    blk.conv2.bias[odd] = 0
    if blk.nin_shortcut is not None:
        blk.nin_shortcut.weight[odd] = 0
        blk.nin_shortcut.bias[odd] = value
    else:
        blk.conv2.bias[odd] = value  # the skip adds the input, which is not constant
    return True


def tokenize_u8(model, u8, masks=None, pool=None):
    """Token grids, long (b, h, w) on the model's device, of uint8 images (b, H, W, 3): with
    masks (a checkpoint trained on tools/shapes/codebook.py's code book, its "codebook_masks")
    the code book's fixed tokens, else the model's encoder and quantiser. The code book
    encodes on the CPU in numpy; a multiprocessing pool, if given, shares the images out
    (the same tokens, sooner)."""
    dev = model.codebook.weight.device
    if masks is not None:
        return torch.from_numpy(codebook_grids(u8, masks, pool)).long().to(dev)
    return model.tokenize(to_model_input(u8).to(dev))


def codebook_grids(u8, masks, pool=None):
    """The code book's token grids, int32 numpy (b, h, w), of uint8 images (b, H, W, 3), in the
    pool's processes if one is given."""
    if pool is not None:
        return np.stack(pool.starmap(shapes_codebook.encode, [(im, masks) for im in u8]))
    return np.stack([shapes_codebook.encode(im, masks) for im in u8])


def to_model_input(u8):
    """uint8 images (b, H, W, 3) -> float (b, 3, H, W) such that the engine's
    trunc((x + 1) / 2 * 255) maps x back to exactly the uint8 value."""
    x = torch.as_tensor(u8).permute(0, 3, 1, 2).float()
    return (x + 0.5) / 127.5 - 1.0


def to_u8(x):
    """Model output (b, 3, H, W) -> uint8 (b, H, W, 3), as the engine does it."""
    p = ((x + 1.0) / 2.0 * 255.0).clamp(0.0, 255.0)
    return torch.floor(p).to(torch.uint8).permute(0, 2, 3, 1)
