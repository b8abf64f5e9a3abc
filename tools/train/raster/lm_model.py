"""The Janus-architecture language model of the shapes demo model, in torch.

Parameter names are the engine's tensor names (engine/family/raster.c) without a prefix change,
so export is a dtype conversion: llm.embed, llm.layers.N.{attn_norm, attn.{q,k,v,o},
mlp_norm, mlp.{gate,up,down}}, llm.norm, gen.embed, gen.aligner.J, gen.head.{fc1,fc2}.
The forward is the one the engine runs (and tests/golden/gen_golden.py checks in numpy):
RMSNorm, rotate-half RoPE over the sequence position, SwiGLU MLP, no biases in the
language model; image tokens enter through gen.embed and an MLP aligner (Linear, GELU,
Linear), logits come from gen.head (Linear, GELU, Linear) on the final-normed state.
"""

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# The model of models/shapes (hidden 256, 4 layers, 4 heads of 64, SwiGLU 704).
DEFAULT_LLM = {"vocab_size": 64, "hidden_size": 256, "num_layers": 4, "num_heads": 4,
               "num_kv_heads": 4, "head_dim": 64, "intermediate_size": 704,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
DEFAULT_IMAGE = {"codebook_size": 1024, "embed_dim": 8, "aligner_layers": 2,
                 "head_hidden_size": 256, "grid_height": 16, "grid_width": 16}


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


def lin(i, o, bias=False):
    return nn.Linear(i, o, bias=bias)


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        L, H, KV, D = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
        self.H, self.KV, self.D = H, KV, D
        self.q, self.k, self.v = lin(L, H * D), lin(L, KV * D), lin(L, KV * D)
        self.o = lin(H * D, L)


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        L, F_ = c["hidden_size"], c["intermediate_size"]
        self.gate, self.up, self.down = lin(L, F_), lin(L, F_), lin(F_, L)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.attn = Attn(c)
        self.mlp_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = Mlp(c)

    def forward(self, x, cos, sin, mask, cache=None, start=0):
        """x [B, T, L] at positions whose rotary tables are cos, sin. With a cache
        (K, V of [B, KV, capacity, D]), the T new keys and values are written at
        [start, start + T) and the queries attend to [0, start + T) of it under mask."""
        B, T, _ = x.shape
        a = self.attn
        h = self.attn_norm(x)
        q = a.q(h).view(B, T, a.H, a.D).transpose(1, 2)
        k = a.k(h).view(B, T, a.KV, a.D).transpose(1, 2)
        v = a.v(h).view(B, T, a.KV, a.D).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:
            cache[0][:, :, start:start + T] = k
            cache[1][:, :, start:start + T] = v
            k, v = cache[0][:, :, :start + T], cache[1][:, :, :start + T]
        if a.KV != a.H:
            k = k.repeat_interleave(a.H // a.KV, 1)
            v = v.repeat_interleave(a.H // a.KV, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + a.o(o.transpose(1, 2).reshape(B, T, a.H * a.D))
        h = self.mlp_norm(x)
        return x + self.mlp.down(F.silu(self.mlp.gate(h)) * self.mlp.up(h))


def rope(x, cos, sin):
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], -1)
    return x * cos + rot * sin


class Llm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Head(nn.Module):
    def __init__(self, L, G, K):
        super().__init__()
        self.fc1, self.fc2 = lin(L, G, True), lin(G, K, True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Gen(nn.Module):
    def __init__(self, L, im):
        super().__init__()
        self.embed = nn.Embedding(im["codebook_size"], im["embed_dim"])
        self.aligner = nn.ModuleList(
            lin(im["embed_dim"] if j == 0 else L, L, True) for j in range(im["aligner_layers"]))
        self.head = Head(L, im["head_hidden_size"], im["codebook_size"])

    def align(self, tokens):
        x = self.aligner[0](self.embed(tokens))
        for layer in self.aligner[1:]:
            x = layer(F.gelu(x))
        return x


def sample_next(mixed, temperature, top_k=0, top_p=1.0, generator=None):
    """[B, V] guided logits -> [B] next tokens, in engine/sampler.c's order (sampler_next):
    NaN logits count as -inf and +inf as the largest float; greedy (the highest logit, the
    lowest id on ties) when top_k is 1 or the temperature is not a positive finite number;
    otherwise the top_k highest logits (all when top_k is 0 or >= V), softmax(logit /
    temperature) over them, then top-p: the shortest prefix of those tokens by descending
    probability whose mass reaches top_p (at least one token; off at >= 1), and a draw from
    what is kept. A row of only -inf gives token 0. The draw is torch's, not the engine's
    (rng.c): the same distribution, not the same tokens for a seed."""
    lg = torch.nan_to_num(mixed.float(), nan=-math.inf, posinf=torch.finfo(torch.float32).max,
                          neginf=-math.inf)
    V = lg.shape[-1]
    if top_k == 1 or not 0 < temperature < math.inf:
        return lg.argmax(-1)  # the first maximum: the lowest id, as the engine
    dead = lg.amax(-1) == -math.inf
    if dead.any():  # every logit -inf: the engine returns token 0
        lg = lg.clone()
        lg[dead, 0] = 0
    ids = None
    if 1 < top_k < V:
        lg, ids = lg.topk(top_k, -1)  # descending; ties at the k-th logit in torch's order
    elif top_p < 1:
        lg, ids = lg.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first
    probs = torch.softmax(lg / temperature, -1)
    if top_p < 1:
        before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each
        keep = before < top_p
        keep[:, 0] = True
        probs = probs.masked_fill(~keep, 0)
    pick = torch.multinomial(probs, 1, generator=generator)
    return (pick if ids is None else ids.gather(-1, pick))[:, 0]


class JanusLM(nn.Module):
    def __init__(self, llm_cfg, image_cfg):
        super().__init__()
        self.llm_cfg, self.image_cfg = dict(llm_cfg), dict(image_cfg)
        self.llm = Llm(llm_cfg)
        self.gen = Gen(llm_cfg["hidden_size"], image_cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        n_layers = self.llm_cfg["num_layers"]
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 2:
                std = 0.02
                if name.endswith(("attn.o.weight", "mlp.down.weight")):
                    std = 0.02 / math.sqrt(2 * n_layers)
                if name == "gen.embed.weight":
                    std = 1.0
                p.normal_(0.0, std)

    def rope_tables(self, pos):
        D = self.llm_cfg["head_dim"]
        inv = 1.0 / self.llm_cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64, device=pos.device) / D)
        ang = pos.to(torch.float64)[..., None] * inv
        ang = torch.cat([ang, ang], -1)
        return ang.cos().float()[:, None], ang.sin().float()[:, None]  # [B, 1, T, D]

    def forward(self, ids, valid, image):
        """ids [B, P] prompts left-padded to P (valid [B, P] marks real tokens; each row
        ends with the image-start token), image [B, N] token grids in raster order.
        Returns the logits [B, N, K] that predict image[:, t] from everything before it."""
        B, P = ids.shape
        x = torch.cat([self.llm.embed(ids), self.gen.align(image[:, :-1])], 1)
        T = x.shape[1]
        dev = ids.device
        keep = torch.cat([valid, torch.ones(B, T - P, dtype=torch.bool, device=dev)], 1)
        pos = (keep.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & keep[:, None, :]) | torch.eye(T, dtype=torch.bool, device=dev)[None]
        cos, sin = self.rope_tables(pos)
        mask = mask[:, None]
        for layer in self.llm.layers:
            x = layer(x, cos, sin, mask)
        x = self.llm.norm(x[:, P - 1:])
        return self.gen.head(x)

    @torch.no_grad()
    def generate(self, cond, uncond, n_images, cfg_w, temperature=1.0, generator=None, times=None,
                 top_k=0, top_p=1.0):
        """Samples n_images token grids of one prompt with classifier-free guidance and a
        KV cache, as the engine does: rows 2i and 2i+1 are image i's conditional and
        unconditional sequences (cond, uncond: the prompt rows, of one length), one
        forward pass over every row per token, logits mixed as u + cfg_w * (c - u),
        then sampled by sample_next (temperature, top-k, top-p; greedy at temperature 0).
        Returns [n_images, N] tokens; appends time.perf_counter() after each step to times
        when given."""
        c, im = self.llm_cfg, self.image_cfg
        P, N = len(cond), im["grid_height"] * im["grid_width"]
        B = 2 * n_images
        ids = torch.tensor([cond, uncond] * n_images)
        shape = (B, c["num_kv_heads"], P + N, c["head_dim"])
        caches = [(torch.empty(shape), torch.empty(shape)) for _ in self.llm.layers]
        x = self.llm.embed(ids)
        causal = torch.ones(P, P, dtype=torch.bool).tril()
        start, mask = 0, causal
        toks = torch.empty(n_images, N, dtype=torch.long)
        for t in range(N):
            cos, sin = self.rope_tables(torch.arange(start, start + x.shape[1])[None])
            for layer, cache in zip(self.llm.layers, caches):
                x = layer(x, cos, sin, mask, cache, start)
            start += x.shape[1]
            logits = self.gen.head(self.llm.norm(x[:, -1])).view(n_images, 2, -1)
            mixed = logits[:, 1] + cfg_w * (logits[:, 0] - logits[:, 1])
            tok = sample_next(mixed, temperature, top_k, top_p, generator)
            toks[:, t] = tok
            if times is not None:
                times.append(time.perf_counter())
            x = self.gen.align(tok.repeat_interleave(2))[:, None]
            mask = None  # one query row sees the whole cache
        return toks
