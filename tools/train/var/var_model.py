"""VAR's transformer (class-conditional next-scale prediction) at toy size, in torch,
written to match what arserve's `scale` family / `var` architecture runs
(docs/model-format.md). Module names map one to one onto the exported `var.*` tensors
(export.py).

Sequence: L = sum(pn^2) tokens, scales coarsest first. Token 0..scales[0]^2-1 (the start)
is class_embed[c] + pos_start; the tokens of scale si >= 1 are word_embed(next-scale input
of scale si-1) (msvq: area-downsampled f_hat). Every token adds level_embed[scale] +
pos_embed[position]. Block: AdaLN table SiLU -> Linear(C, 6C) of the class embedding, chunks
gamma1, gamma2, scale1, scale2, shift1, shift2;
  x += attn(LN(x) * (1 + scale1) + shift1) * gamma1
  x += ffn(LN(x) * (1 + scale2) + shift2) * gamma2
LN non-affine, eps 1e-6. Attention: qkv = x W^T + [q_bias, 0, v_bias]; q and k L2-normalised
per head, q times exp(min(scale_mul[h], ln 100)); softmax scale 1; block-causal mask (a
token sees every token of its own and earlier scales). FFN fc1 -> GELU(tanh) -> fc2.
With `shared_adaln` (VAR's shared_aln) one Linear(C, 6C) makes the table for every block and
each block adds its own [6, C] constant rows (`adaln_gss`).
Head: LN(x) * (1 + scale) + shift (SiLU -> Linear(C, 2C) of the class embedding, chunks
scale, shift) -> Linear(C, V). The condition is class_embed[c] (D = C); the unconditional
class is index num_classes.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-6
MAX_SCALE_MUL = math.log(100.0)


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads, self.hd = heads, c // heads
        self.qkv = nn.Linear(c, 3 * c, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(c))
        self.v_bias = nn.Parameter(torch.zeros(c))
        self.scale_mul = nn.Parameter(torch.full((heads,), math.log(4.0)))
        self.proj = nn.Linear(c, c)

    def forward(self, x, mask):
        b, l, c = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        qkv = F.linear(x, self.qkv.weight, bias).view(b, l, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (b, h, l, hd)
        q = F.normalize(q, dim=-1) * self.scale_mul.clamp(max=MAX_SCALE_MUL).exp().view(1, -1, 1, 1)
        k = F.normalize(k, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.proj(o.transpose(1, 2).reshape(b, l, c))


class FFN(nn.Module):
    def __init__(self, c, f):
        super().__init__()
        self.fc1 = nn.Linear(c, f)
        self.fc2 = nn.Linear(f, c)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, heads, f, shared_adaln=False):
        super().__init__()
        self.c = c
        if shared_adaln:  # the model's one table plus this block's own constant rows
            self.adaln_gss = nn.Parameter(torch.randn(6, c) / math.sqrt(c))
        else:
            self.adaln = nn.Linear(c, 6 * c)
        self.attn = Attention(c, heads)
        self.ffn = FFN(c, f)

    def forward(self, x, cond, mask, shared_table=None):
        """shared_table: the shared AdaLN Linear's output (B, 6C), with shared_adaln."""
        table = self.adaln(F.silu(cond)) if shared_table is None else shared_table + self.adaln_gss.flatten()
        g1, g2, s1, s2, b1, b2 = table.view(-1, 1, 6, self.c).unbind(2)
        x = x + self.attn(F.layer_norm(x, (self.c,), eps=LN_EPS) * (1 + s1) + b1, mask) * g1
        x = x + self.ffn(F.layer_norm(x, (self.c,), eps=LN_EPS) * (1 + s2) + b2) * g2
        return x


class VAR(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        c, h, d = cfg["width"], cfg["heads"], cfg["depth"]
        self.C, self.num_classes = c, cfg["num_classes"]
        self.scales = list(cfg["scales"])
        self.L = sum(p * p for p in self.scales)
        self.first_l = self.scales[0] ** 2
        V, E = cfg["codebook_size"], cfg["embed_dim"]
        std = math.sqrt(1 / c / 3)
        self.class_embed = nn.Embedding(self.num_classes + 1, c)
        self.pos_start = nn.Parameter(torch.empty(self.first_l, c))
        self.pos_embed = nn.Parameter(torch.empty(self.L, c))
        self.level_embed = nn.Embedding(len(self.scales), c)
        for p in (self.class_embed.weight, self.pos_start, self.pos_embed, self.level_embed.weight):
            nn.init.trunc_normal_(p, std=std)
        self.word_embed = nn.Linear(E, c)
        self.shared = bool(cfg.get("shared_adaln", False))
        if self.shared:
            self.shared_adaln = nn.Linear(c, 6 * c)
        self.blocks = nn.ModuleList(Block(c, h, cfg["ffn"], self.shared) for _ in range(d))
        self.head_adaln = nn.Linear(c, 2 * c)
        self.head = nn.Linear(c, V)
        lvl = torch.cat([torch.full((p * p,), i) for i, p in enumerate(self.scales)])
        self.register_buffer("lvl", lvl, persistent=False)
        # block-causal: a token sees tokens of its own and earlier scales
        self.register_buffer("mask", lvl[:, None] >= lvl[None, :], persistent=False)
        self._init(std, d)

    @torch.no_grad()
    def _init(self, std, depth):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    m.bias.zero_()
        c = self.C
        tables = [self.shared_adaln.weight] if self.shared else []
        for b in self.blocks:
            b.attn.proj.weight.div_(math.sqrt(2 * depth))
            b.ffn.fc2.weight.div_(math.sqrt(2 * depth))
            tables.append(b.adaln_gss if self.shared else b.adaln.weight)
        for t in tables:  # rows in six chunks: gammas, then scales and shifts
            chunks = t.view(6, c, -1)
            chunks[2:].mul_(0.5)
            chunks[:2].mul_(1e-5)
        self.head_adaln.weight.mul_(0.5)
        self.head.weight.mul_(0.02)

    def forward(self, labels, x_in):
        """labels (B,) (num_classes = unconditional); x_in (B, L - first_l, E) next-scale inputs
        of scales 1..S-1 -> logits (B, L, V)."""
        b = labels.shape[0]
        cond = self.class_embed(labels)
        sos = cond[:, None, :] + self.pos_start[None]
        x = torch.cat([sos, self.word_embed(x_in)], 1) if x_in is not None and x_in.shape[1] else sos
        l = x.shape[1]
        x = x + self.level_embed(self.lvl[:l])[None] + self.pos_embed[None, :l]
        mask = self.mask[:l, :l]
        shared_table = self.shared_adaln(F.silu(cond)) if self.shared else None
        for blk in self.blocks:
            x = blk(x, cond, mask, shared_table)
        s, t = self.head_adaln(F.silu(cond)).view(-1, 1, 2, self.C).unbind(2)
        x = F.layer_norm(x, (self.C,), eps=LN_EPS) * (1 + s) + t
        return self.head(x)


def next_scale_inputs(vq, idxs):
    """Teacher-forcing inputs of scales 1..S-1 from the code maps [idx (B, pn, pn)]:
    (B, L - first_l, E). Scale si's codes -> codebook rows -> bicubic up to the last size
    -> Phi -> added to f_hat; the next scale's input is f_hat area-downsampled to its size."""
    from msvq import down_to  # noqa: E402
    scales = vq.scales
    f_hat = 0
    outs = []
    for si in range(len(scales) - 1):
        f_hat = f_hat + vq.code_map(idxs[si], si)
        nxt = down_to(f_hat, scales[si + 1])
        outs.append(nxt.flatten(2).transpose(1, 2))
    return torch.cat(outs, 1)
