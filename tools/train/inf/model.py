"""Infinity (text-to-image next-scale prediction over bits) in PyTorch, for training the
shapes-inf demo model here: the transformer, the BSQ-VAE's decoder and the next-scale inputs,
written for this repository from the conventions arserve runs (tests/golden/infinity_tiny/
README.md, "Conventions the official code follows"). Parameter names are the released
checkpoints' (`infinity_2b_reg.pth`, `infinity_vae_d32reg.pth`), so tools/convert/infinity.py
turns a trained state dict into an arserve model directory; tests/python/test_train_inf.py
loads the golden folder's official weights into these modules and requires the official
code's outputs (teacher-forced logits of both CFG rows, next-scale inputs, the decoded image).

The text encoder is transformers' T5EncoderModel (the released models use flan-t5-xl; the demo
trains a small one from scratch with the rest).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-6
ROPE_BASE = 10000.0
LVL_ROWS = 15  # lvl_embed rows in every released model


def rms_norm(x, weight, eps=LN_EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x):
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS)


class SelfAttention(nn.Module):
    """Cosine attention: q, k L2-normalised per head, q times exp(min(scale_mul, ln 100)),
    2D RoPE after the norm, softmax scale 1."""

    def __init__(self, C, H):
        super().__init__()
        self.H, self.hd = H, C // H
        self.mat_qkv = nn.Linear(C, 3 * C, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(C))
        self.v_bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("zero_k_bias", torch.zeros(C))
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, H, 1, 1), math.log(4.0)))
        self.proj = nn.Linear(C, C)

    def forward(self, x, rope, mask):
        B, L, C = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        q, k, v = F.linear(x, self.mat_qkv.weight, bias).view(B, L, 3, self.H, self.hd).permute(2, 0, 3, 1, 4)
        mul = self.scale_mul_1H11.clamp_max(math.log(100.0)).exp()
        q = F.normalize(q, dim=-1, eps=1e-12) * mul
        k = F.normalize(k, dim=-1, eps=1e-12)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask, scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(B, L, C))


class CrossAttention(nn.Module):
    """Each row over its own text tokens (text_mask [B, N]); scale 1/sqrt(hd). As the
    attentive pool (query=None), one learned query per head and no q projection."""

    def __init__(self, C, H, kv_channels, pool=False):
        super().__init__()
        self.H, self.hd = H, C // H
        if pool:
            self.mat_q = nn.Parameter(torch.randn(1, H, self.hd) * 0.02)
        else:
            self.mat_q = nn.Linear(C, C)
        self.mat_kv = nn.Linear(kv_channels, 2 * C, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("zero_k_bias", torch.zeros(C))
        self.proj = nn.Linear(C, C)

    def forward(self, x, text, text_mask):
        B, N, _ = text.shape
        C = self.H * self.hd
        kv = F.linear(text, self.mat_kv.weight, torch.cat((self.zero_k_bias, self.v_bias)))
        k, v = kv.view(B, N, 2, self.H, self.hd).permute(2, 0, 3, 1, 4)
        if x is None:
            q = self.mat_q.unsqueeze(2).expand(B, -1, -1, -1)  # [B, H, 1, hd]
        else:
            q = self.mat_q(x).view(B, -1, self.H, self.hd).transpose(1, 2)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        att = att.masked_fill(~text_mask[:, None, None, :], float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, -1, C))


class FFN(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, F_), nn.Linear(F_, C)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, H, F_):
        super().__init__()
        self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, C) / math.sqrt(C))
        self.sa = SelfAttention(C, H)
        self.ca = CrossAttention(C, H, C)
        self.ffn = FFN(C, F_)
        self.ca_norm = nn.LayerNorm(C, eps=LN_EPS)

    def forward(self, x, cond6, ca_kv, text_mask, rope, mask):
        g1, g2, s1, s2, sh1, sh2 = (self.ada_gss + cond6).unbind(2)  # each [B, 1, C]
        x = x + g1 * self.sa(layer_norm(x) * (1 + s1) + sh1, rope, mask)
        x = x + self.ca(self.ca_norm(x), ca_kv, text_mask)
        return x + g2 * self.ffn(layer_norm(x) * (1 + s2) + sh2)


class _Chunk(nn.Module):  # the released checkpoints' block_chunks.{c}.module.{j}
    def __init__(self, blocks):
        super().__init__()
        self.module = nn.ModuleList(blocks)


class _Pool(nn.Module):  # text_proj_for_sos.ca
    def __init__(self, C, text_channels):
        super().__init__()
        self.ca = CrossAttention(C, text_channels // 128, text_channels, pool=True)


class _HeadNorm(nn.Module):  # head_nm.ada_lin.1
    def __init__(self, C):
        super().__init__()
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))


class Infinity(nn.Module):
    """depth blocks of width C, H heads, FFN round(4 C / 256) * 256 (at least 256), bits d
    per token, text features of text_channels (a multiple of 128: the pool's heads) up to
    text_maxlen tokens, in `chunks` block chunks (the checkpoint's grouping)."""

    def __init__(self, C, depth, H, d, text_channels, text_maxlen, chunks=1, ffn=None):
        super().__init__()
        if text_channels % 128 or depth % chunks:
            raise ValueError("text_channels must be a multiple of 128 and depth of chunks")
        self.C, self.d = C, d
        F_ = ffn or max(256, round(4 * C / 256) * 256)
        self.cfg_uncond = nn.Parameter(torch.randn(text_maxlen, text_channels) * 0.02)
        self.pos_start = nn.Parameter(torch.randn(1, 1, C) * 0.02)
        self.text_norm = nn.Module()
        self.text_norm.weight = nn.Parameter(torch.ones(text_channels))
        self.text_proj_for_sos = _Pool(C, text_channels)
        self.text_proj_for_ca = nn.Sequential(nn.Linear(text_channels, C), nn.GELU(approximate="tanh"),
                                              nn.Linear(C, C))
        self.lvl_embed = nn.Embedding(LVL_ROWS, C)
        self.word_embed = nn.Linear(d, C)
        self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        self.head_nm = _HeadNorm(C)
        self.head = nn.Linear(C, 2 * d)
        per = depth // chunks
        self.block_chunks = nn.ModuleList(
            _Chunk([Block(C, H, F_) for _ in range(per)]) for _ in range(chunks))

    def blocks(self):
        return [b for c in self.block_chunks for b in c.module]

    def condition(self, feats, text_mask):
        """(sos [B, C], ca_kv [B, N, C], text [B, N, Ct]) from text features [B, N, Ct]
        (a row's unconditional text is cfg_uncond[:n], given by the caller)."""
        t = rms_norm(feats, self.text_norm.weight)
        sos = self.text_proj_for_sos.ca(None, t, text_mask)[:, 0]
        return sos, self.text_proj_for_ca(t), t

    def forward(self, feats, text_mask, inputs, schedule, rope_grid):
        """Teacher-forced logits [B, L, d, 2] of every token of the schedule ((h, w) per
        scale): inputs [B, L - 1, d] are the next-scale inputs of scales 1.. (next_scale_inputs)."""
        B = feats.shape[0]
        sos, ca_kv, _ = self.condition(feats, text_mask)
        cond6 = self.shared_ada_lin(sos).view(B, 1, 6, self.C)
        x = torch.cat((sos[:, None] + self.pos_start, self.word_embed(inputs)), 1)
        lv = torch.cat([torch.full((h * w,), s, dtype=torch.long) for s, (h, w) in enumerate(schedule)])
        x = x + self.lvl_embed(lv.to(x.device))
        rope = rope_table(schedule, rope_grid, self.blocks()[0].sa.hd, x.device)
        mask = lv[:, None] >= lv[None, :]  # block-causal: a scale sees itself and coarser ones
        mask = mask.to(x.device)
        for b in self.blocks():
            x = b(x, cond6, ca_kv, text_mask, rope, mask)
        scale, shift = self.head_nm.ada_lin(sos).view(B, 1, 2, self.C).unbind(2)
        return self.head(layer_norm(x) * (1 + scale) + shift).view(B, -1, self.d, 2)


def rope_positions(schedule, grid):
    """(row, col) of every token: i * (H / h) and j * (W / w) in float32, rounded half to
    even; (H, W) the RoPE grid (the '1M' schedule's last scale of the aspect ratio)."""
    rows, cols = [], []
    for h, w in schedule:
        fh = torch.tensor(grid[0] / h, dtype=torch.float32)
        fw = torch.tensor(grid[1] / w, dtype=torch.float32)
        r = torch.round(torch.arange(h, dtype=torch.float32) * fh)
        c = torch.round(torch.arange(w, dtype=torch.float32) * fw)
        rows.append(r[:, None].expand(h, w).reshape(-1))
        cols.append(c[None, :].expand(h, w).reshape(-1))
    return torch.cat(rows), torch.cat(cols)


def rope_table(schedule, grid, hd, device=None):
    """(cos, sin) [L, hd / 2]: pair m < hd / 4 turns by row x inv_freq[m], the others by
    col x inv_freq[m - hd / 4], inv_freq[k] = 1 / 10000^(2k / (hd / 2))."""
    half = hd // 2
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    row, col = rope_positions(schedule, grid)
    ang = torch.cat((row[:, None] * inv, col[:, None] * inv), 1)
    return ang.cos().to(device), ang.sin().to(device)


def apply_rope(x, rope):
    cos, sin = rope
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), -1).flatten(-2)


def bit_codes(bits):
    """Bits [..., d] in {0, 1} -> the BSQ codes l2norm((2 b - 1) / sqrt(d))."""
    d = bits.shape[-1]
    return F.normalize((2.0 * bits.float() - 1.0) / math.sqrt(d), dim=-1)


def next_scale_inputs(bits, schedule):
    """From the bits of every scale ([B, L, d], coarsest first, each scale row-major): the
    next-scale inputs [B, L - 1, d] of scales 1.. and f_hat [B, d, H, W] after each scale (a
    list): codes of scale s upsampled bilinearly (align_corners False) to the last scale's
    size and added (the last added as it is); input s + 1 = f_hat resized bilinearly to scale
    s + 1's size."""
    B, _, d = bits.shape
    H, W = schedule[-1]
    f_hat = bits.new_zeros((B, d, H, W), dtype=torch.float32)
    inputs, fhats, at = [], [], 0
    for s, (h, w) in enumerate(schedule):
        codes = bit_codes(bits[:, at:at + h * w]).transpose(1, 2).reshape(B, d, h, w)
        at += h * w
        if s < len(schedule) - 1:
            f_hat = f_hat + F.interpolate(codes, size=(H, W), mode="bilinear", align_corners=False)
            nh, nw = schedule[s + 1]
            nxt = F.interpolate(f_hat, size=(nh, nw), mode="bilinear", align_corners=False)
            inputs.append(nxt.flatten(2).transpose(1, 2))
        else:
            f_hat = f_hat + codes
        fhats.append(f_hat)
    return torch.cat(inputs, 1), fhats


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin, eps=1e-6)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, cout, eps=1e-6)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class _Up(nn.Module):
    def __init__(self, blocks, width, upsample):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        if upsample:
            self.upsample = nn.Module()
            self.upsample.conv = nn.Conv2d(width, width, 3, padding=1)


class Decoder(nn.Module):
    """The BSQ-VAE decoder (official flux_vqgan.Decoder, cnn_type 2d, no attention): conv_in;
    mid blocks 1, 2; levels coarsest first (up.{n-1} .. up.0), num_res_blocks + 1 ResNet
    blocks each, then nearest 2x and a 3x3 conv on levels 1 .. log2(patch); GroupNorm(32),
    swish, conv_out; output clamped to [-1, 1] by the caller."""

    def __init__(self, d, base, mult, num_res_blocks, patch):
        super().__init__()
        n = len(mult)
        ups = int(math.log2(patch))
        c0 = base * mult[-1]
        self.conv_in = nn.Conv2d(d, c0, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.block_2 = ResnetBlock(c0, c0), ResnetBlock(c0, c0)
        levels, cin = [None] * n, c0
        for lv in reversed(range(n)):
            w = base * mult[lv]
            blocks = []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(cin, w))
                cin = w
            levels[lv] = _Up(blocks, w, 1 <= lv <= ups)
        self.up = nn.ModuleList(levels)
        self.norm_out = nn.GroupNorm(32, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, 3, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.block_1(self.conv_in(z)))
        for lv in reversed(range(len(self.up))):
            for b in self.up[lv].block:
                h = b(h)
            if hasattr(self.up[lv], "upsample"):
                h = self.up[lv].upsample.conv(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))
