"""Shape tables of the convolutional image tokenizers the releases ship, in each official
module's state_dict order: LlamaGen's VQ-16 (LlamaGen and Janus), VAR's multi-scale VQVAE and
Infinity's BSQ-VAE (in the checkpoint's names, without the Conv/Normalize wrappers)."""

from __future__ import annotations

import math

from .tensors import Tensor, bias, const, conv, norm_weight, normal, unit_rows


def _gn(t, name, c, dt):
    t += [norm_weight(f"{name}.weight", c, dt), bias(f"{name}.bias", c, dt)]


def _conv(t, name, cout, cin, k, dt, gain=1.0):
    t += [conv(f"{name}.weight", cout, cin, k, dt, gain), bias(f"{name}.bias", cout, dt)]


def _res(t, p, cin, cout, dt, depth_gain):
    _gn(t, f"{p}.norm1", cin, dt)
    _conv(t, f"{p}.conv1", cout, cin, 3, dt)
    _gn(t, f"{p}.norm2", cout, dt)
    _conv(t, f"{p}.conv2", cout, cout, 3, dt, depth_gain)  # the residual branch's last conv
    if cin != cout:
        _conv(t, f"{p}.nin_shortcut", cout, cin, 1, dt)


def _attn_qkv_split(t, p, c, dt):
    _gn(t, f"{p}.norm", c, dt)
    for n in ("q", "k", "v"):
        _conv(t, f"{p}.{n}", c, c, 1, dt)
    _conv(t, f"{p}.proj_out", c, c, 1, dt, 0.5)


def _attn_qkv_fused(t, p, c, dt):
    _gn(t, f"{p}.norm", c, dt)
    _conv(t, f"{p}.qkv", 3 * c, c, 1, dt)
    _conv(t, f"{p}.proj_out", c, c, 1, dt, 0.5)


# ---- LlamaGen's VQModel (tokenizer/tokenizer_image/vq_model.py), also Janus's gen_vision_model

def llamagen_vq(p, dt, ch=128, ch_mult=(1, 1, 2, 2, 4), z=256, codes=16384, embed=8, n_res=2):
    t: list[Tensor] = []
    g = 0.5
    n = len(ch_mult)
    _conv(t, f"{p}encoder.conv_in", ch, 3, 3, dt)
    cin = ch
    for i in range(n):
        cout = ch * ch_mult[i]
        for j in range(n_res):
            _res(t, f"{p}encoder.conv_blocks.{i}.res.{j}", cin, cout, dt, g)
            cin = cout
        if i == n - 1:
            for j in range(n_res):
                _attn_qkv_split(t, f"{p}encoder.conv_blocks.{i}.attn.{j}", cin, dt)
        if i != n - 1:
            _conv(t, f"{p}encoder.conv_blocks.{i}.downsample.conv", cin, cin, 3, dt)
    _res(t, f"{p}encoder.mid.0", cin, cin, dt, g)
    _attn_qkv_split(t, f"{p}encoder.mid.1", cin, dt)
    _res(t, f"{p}encoder.mid.2", cin, cin, dt, g)
    _gn(t, f"{p}encoder.norm_out", cin, dt)
    _conv(t, f"{p}encoder.conv_out", z, cin, 3, dt)

    cin = ch * ch_mult[-1]
    _conv(t, f"{p}decoder.conv_in", cin, z, 3, dt)
    _res(t, f"{p}decoder.mid.0", cin, cin, dt, g)
    _attn_qkv_split(t, f"{p}decoder.mid.1", cin, dt)
    _res(t, f"{p}decoder.mid.2", cin, cin, dt, g)
    for i, level in enumerate(reversed(range(n))):
        cout = ch * ch_mult[level]
        for j in range(n_res + 1):
            _res(t, f"{p}decoder.conv_blocks.{i}.res.{j}", cin, cout, dt, g)
            cin = cout
        if level == n - 1:
            for j in range(n_res + 1):
                _attn_qkv_split(t, f"{p}decoder.conv_blocks.{i}.attn.{j}", cin, dt)
        if level != 0:
            _conv(t, f"{p}decoder.conv_blocks.{i}.upsample.conv", cin, cin, 3, dt)
    _gn(t, f"{p}decoder.norm_out", cin, dt)
    _conv(t, f"{p}decoder.conv_out", 3, cin, 3, dt)

    t.append(Tensor(f"{p}quantize.codebook_used", (65536,), dt, ("ints", codes), buffer=True))
    t.append(unit_rows(f"{p}quantize.embedding.weight", (codes, embed), dt))
    _conv(t, f"{p}quant_conv", embed, z, 1, dt)
    _conv(t, f"{p}post_quant_conv", z, embed, 1, dt)
    return t


# ---- VAR's VQVAE (models/vqvae.py, models/basic_vae.py, models/quant.py) ---------------------

def var_vqvae(dt, ch=160, ch_mult=(1, 1, 2, 2, 4), cvae=32, vocab=4096, n_res=2, phis=4, scales=10):
    t: list[Tensor] = []
    g = 0.5
    n = len(ch_mult)
    _conv(t, "encoder.conv_in", ch, 3, 3, dt)
    cin = ch
    for i in range(n):
        cout = ch * ch_mult[i]
        for j in range(n_res):
            _res(t, f"encoder.down.{i}.block.{j}", cin, cout, dt, g)
            cin = cout
        if i == n - 1:
            for j in range(n_res):
                _attn_qkv_fused(t, f"encoder.down.{i}.attn.{j}", cin, dt)
        if i != n - 1:
            _conv(t, f"encoder.down.{i}.downsample.conv", cin, cin, 3, dt)
    _res(t, "encoder.mid.block_1", cin, cin, dt, g)
    _attn_qkv_fused(t, "encoder.mid.attn_1", cin, dt)
    _res(t, "encoder.mid.block_2", cin, cin, dt, g)
    _gn(t, "encoder.norm_out", cin, dt)
    _conv(t, "encoder.conv_out", cvae, cin, 3, dt)

    cin = ch * ch_mult[-1]
    _conv(t, "decoder.conv_in", cin, cvae, 3, dt)
    _res(t, "decoder.mid.block_1", cin, cin, dt, g)
    _attn_qkv_fused(t, "decoder.mid.attn_1", cin, dt)
    _res(t, "decoder.mid.block_2", cin, cin, dt, g)
    # VAR numbers decoder levels finest first (up.0) but builds and lists them coarsest first
    ups = []
    for level in reversed(range(n)):
        u: list[Tensor] = []
        cout = ch * ch_mult[level]
        for j in range(n_res + 1):
            _res(u, f"decoder.up.{level}.block.{j}", cin, cout, dt, g)
            cin = cout
        if level == n - 1:
            for j in range(n_res + 1):
                _attn_qkv_fused(u, f"decoder.up.{level}.attn.{j}", cin, dt)
        if level != 0:
            _conv(u, f"decoder.up.{level}.upsample.conv", cin, cin, 3, dt)
        ups.append(u)
    for u in reversed(ups):  # ModuleList order: up.0 first
        t += u
    _gn(t, "decoder.norm_out", cin, dt)
    _conv(t, "decoder.conv_out", 3, cin, 3, dt)

    t.append(const("quantize.ema_vocab_hit_SV", (scales, vocab), dt, 0.0, buffer=True))
    for k in range(phis):
        _conv(t, f"quantize.quant_resi.qresi_ls.{k}", cvae, cvae, 3, dt, 0.5)
    t.append(normal("quantize.embedding.weight", (vocab, cvae), dt, 1.0))
    _conv(t, "quant_conv", cvae, cvae, 3, dt)
    _conv(t, "post_quant_conv", cvae, cvae, 3, dt)
    return t


# ---- Infinity's BSQ-VAE (infinity/models/bsq_vae/flux_vqgan.py), checkpoint names ------------

def infinity_bsq_vae(dt, base=128, ch_mult=(1, 2, 4, 4, 4), codebook_dim=32, n_res=2, patch=16,
                     embed=256):
    """`vae_model(...)` with cnn_attention='no': Encoder(down.i.block.j, down.i.downsample for
    the log2(patch) first levels), Decoder (up.i.upsample for levels 1..log2(patch)), then the
    quantizer's two `lfq.mask` buffers (int64 powers of two), as load_cnn reads them."""
    t: list[Tensor] = []
    g = 0.5
    n = len(ch_mult)
    downs = int(math.log2(patch))
    _conv(t, "encoder.conv_in", base, 3, 3, dt)
    cin = base
    for i in range(n):
        cout = base * ch_mult[i]
        for j in range(n_res):
            _res(t, f"encoder.down.{i}.block.{j}", cin, cout, dt, g)
            cin = cout
        if i < downs:
            _conv(t, f"encoder.down.{i}.downsample.conv", cin, cin, 3, dt)
    _res(t, "encoder.mid.block_1", cin, cin, dt, g)
    _res(t, "encoder.mid.block_2", cin, cin, dt, g)
    _gn(t, "encoder.norm_out", cin, dt)
    _conv(t, "encoder.conv_out", codebook_dim, cin, 3, dt)

    cin = base * ch_mult[-1]
    _conv(t, "decoder.conv_in", cin, codebook_dim, 3, dt)
    _res(t, "decoder.mid.block_1", cin, cin, dt, g)
    _res(t, "decoder.mid.block_2", cin, cin, dt, g)
    ups = []
    for level in reversed(range(n)):
        u: list[Tensor] = []
        cout = base * ch_mult[level]
        for j in range(n_res + 1):
            _res(u, f"decoder.up.{level}.block.{j}", cin, cout, dt, g)
            cin = cout
        if 1 <= level <= downs:
            _conv(u, f"decoder.up.{level}.upsample.conv", cin, cin, 3, dt)
        ups.append(u)
    for u in reversed(ups):
        t += u
    _gn(t, "decoder.norm_out", cin, dt)
    _conv(t, "decoder.conv_out", 3, cin, 3, dt)
    powers = [1 << k for k in range(codebook_dim - 1, -1, -1)]
    for q in ("quantizer", "quantize"):
        t.append(Tensor(f"{q}.lfq.mask", (codebook_dim,), "i64", ("values", powers), buffer=True))
    return t
