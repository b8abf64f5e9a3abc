"""Shape tables of the transformers in each release, in the official modules' state_dict order:
LlamaGen's GPT (autoregressive/models/gpt.py), Janus-Pro's MultiModalityCausalLM
(janus/models/modeling_vlm.py over transformers' Llama), VAR (models/var.py), Infinity
(infinity/models/infinity.py, `block_chunks.{c}.module.{j}`) and T5ForConditionalGeneration."""

from __future__ import annotations

import math

from . import nets
from .tensors import Tensor, bias, const, linear, norm_weight, normal


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


# ---- LlamaGen GPT (c2i) ---------------------------------------------------------------------

def llamagen_gpt(n_layer, dim, vocab=16384, classes=1000, dt="f32"):
    ffn = find_multiple(int(2 * 4 * dim / 3), 256)
    out_gain = 1 / math.sqrt(2 * n_layer)  # residual-branch outputs, scaled down with depth
    t = [normal("cls_embedding.embedding_table.weight", (classes + 1, dim), dt, 1.0),
         normal("tok_embeddings.weight", (vocab, dim), dt, 1.0)]
    for i in range(n_layer):
        p = f"layers.{i}."
        t += [linear(p + "attention.wqkv.weight", 3 * dim, dim, dt),
              linear(p + "attention.wo.weight", dim, dim, dt, out_gain),
              linear(p + "feed_forward.w1.weight", ffn, dim, dt),
              linear(p + "feed_forward.w3.weight", ffn, dim, dt),
              linear(p + "feed_forward.w2.weight", dim, ffn, dt, out_gain),
              norm_weight(p + "attention_norm.weight", dim, dt),
              norm_weight(p + "ffn_norm.weight", dim, dt)]
    t += [norm_weight("norm.weight", dim, dt), linear("output.weight", vocab, dim, dt)]
    return t


# ---- Janus-Pro (deepseek layout) -------------------------------------------------------------

def siglip_tower(p, width, layers, image, patch, dt, mlp_ratio=4):
    """timm VisionTransformer as janus/models/siglip_vit.py builds siglip_large_patch16_384:
    no class token, learned pos_embed, attention-pool ('map') head, LayerNorms with bias."""
    hidden = int(width * mlp_ratio)
    t = [normal(p + "pos_embed", (1, (image // patch) ** 2, width), dt, 0.02),
         Tensor(p + "patch_embed.proj.weight", (width, 3, patch, patch), dt,
                ("normal", 1 / math.sqrt(3 * patch * patch), 0.0)),
         bias(p + "patch_embed.proj.bias", width, dt)]
    for i in range(layers):
        q = f"{p}blocks.{i}."
        t += [norm_weight(q + "norm1.weight", width, dt), bias(q + "norm1.bias", width, dt),
              linear(q + "attn.qkv.weight", 3 * width, width, dt), bias(q + "attn.qkv.bias", 3 * width, dt),
              linear(q + "attn.proj.weight", width, width, dt), bias(q + "attn.proj.bias", width, dt),
              norm_weight(q + "norm2.weight", width, dt), bias(q + "norm2.bias", width, dt),
              linear(q + "mlp.fc1.weight", hidden, width, dt), bias(q + "mlp.fc1.bias", hidden, dt),
              linear(q + "mlp.fc2.weight", width, hidden, dt), bias(q + "mlp.fc2.bias", width, dt)]
    t += [norm_weight(p + "norm.weight", width, dt), bias(p + "norm.bias", width, dt)]
    a = p + "attn_pool."
    t += [normal(a + "latent", (1, 1, width), dt, 0.02),
          linear(a + "q.weight", width, width, dt), bias(a + "q.bias", width, dt),
          linear(a + "kv.weight", 2 * width, width, dt), bias(a + "kv.bias", 2 * width, dt),
          linear(a + "proj.weight", width, width, dt), bias(a + "proj.bias", width, dt),
          norm_weight(a + "norm.weight", width, dt), bias(a + "norm.bias", width, dt),
          linear(a + "mlp.fc1.weight", hidden, width, dt), bias(a + "mlp.fc1.bias", hidden, dt),
          linear(a + "mlp.fc2.weight", width, hidden, dt), bias(a + "mlp.fc2.bias", width, dt)]
    return t


def mlp_projector(p, d_in, d, depth, dt):
    """MlpProjector 'mlp_gelu': Sequential(Linear, GELU, Linear, ...): Linears at even indices."""
    t = [linear(f"{p}layers.0.weight", d, d_in, dt), bias(f"{p}layers.0.bias", d, dt)]
    for k in range(1, depth):
        t += [linear(f"{p}layers.{2 * k}.weight", d, d, dt), bias(f"{p}layers.{2 * k}.bias", d, dt)]
    return t


def janus(a: dict, dt="bf16"):
    """a: layers, hidden, ffn, vocab, codes, embed, vision (width, layers, image, patch)."""
    L, H, F, V = a["layers"], a["hidden"], a["ffn"], a["vocab"]
    out_gain = 1 / math.sqrt(2 * L)
    vw, vl, vi, vp = a["vision"]
    t = siglip_tower("vision_model.vision_tower.", vw, vl, vi, vp, dt)
    t += mlp_projector("aligner.", vw, H, 2, dt)
    t += nets.llamagen_vq("gen_vision_model.", dt, codes=a["codes"], embed=a["embed"])
    t += mlp_projector("gen_aligner.", a["embed"], H, 2, dt)
    t += [linear("gen_head.output_mlp_projector.weight", H, H, dt),
          bias("gen_head.output_mlp_projector.bias", H, dt),
          linear("gen_head.vision_head.weight", a["codes"], H, dt),
          bias("gen_head.vision_head.bias", a["codes"], dt),
          normal("gen_embed.weight", (a["codes"], a["embed"]), dt, 1.0)]
    p = "language_model.model."
    t.append(normal(p + "embed_tokens.weight", (V, H), dt, 1.0))
    for i in range(L):
        q = f"{p}layers.{i}."
        t += [linear(q + "self_attn.q_proj.weight", H, H, dt),
              linear(q + "self_attn.k_proj.weight", H, H, dt),
              linear(q + "self_attn.v_proj.weight", H, H, dt),
              linear(q + "self_attn.o_proj.weight", H, H, dt, out_gain),
              linear(q + "mlp.gate_proj.weight", F, H, dt),
              linear(q + "mlp.up_proj.weight", F, H, dt),
              linear(q + "mlp.down_proj.weight", H, F, dt, out_gain),
              norm_weight(q + "input_layernorm.weight", H, dt),
              norm_weight(q + "post_attention_layernorm.weight", H, dt)]
    t += [norm_weight(p + "norm.weight", H, dt), linear("language_model.lm_head.weight", V, H, dt)]
    return t


# ---- VAR ------------------------------------------------------------------------------------

def var_levels(patch_nums):
    return [i for i, pn in enumerate(patch_nums) for _ in range(pn * pn)]


def var(depth, patch_nums, vocab=4096, cvae=32, classes=1000, dt="f32"):
    """models/__init__.py build_vae_var: width 64 x depth, heads = depth, MLP 4x, per-block
    AdaLN (shared_aln=False), attn_l2_norm=True; lvl_1L and the block-causal mask are buffers."""
    C, H = 64 * depth, depth
    Lt = sum(p * p for p in patch_nums)
    init_std = math.sqrt(1 / C / 3)  # VAR's init_std for the embeddings it truncnormal-inits
    levels = var_levels(patch_nums)
    mask = [0.0 if levels[j] <= levels[i] else -math.inf for i in range(Lt) for j in range(Lt)]
    out_gain = 1 / math.sqrt(2 * depth)
    t = [normal("pos_start", (1, patch_nums[0] ** 2, C), dt, init_std),
         normal("pos_1LC", (1, Lt, C), dt, init_std),
         Tensor("lvl_1L", (1, Lt), "i64", ("values", levels), buffer=True),
         Tensor("attn_bias_for_masking", (1, 1, Lt, Lt), dt, ("values", mask), buffer=True),
         linear("word_embed.weight", C, cvae, dt), bias("word_embed.bias", C, dt),
         normal("class_emb.weight", (classes + 1, C), dt, init_std),
         normal("lvl_embed.weight", (len(patch_nums), C), dt, init_std)]
    for i in range(depth):
        p = f"blocks.{i}."
        t += [const(p + "attn.scale_mul_1H11", (1, H, 1, 1), dt, math.log(4.0)),  # VAR's init
              bias(p + "attn.q_bias", C, dt), bias(p + "attn.v_bias", C, dt),
              const(p + "attn.zero_k_bias", (C,), dt, 0.0, buffer=True),
              linear(p + "attn.mat_qkv.weight", 3 * C, C, dt),
              linear(p + "attn.proj.weight", C, C, dt, out_gain), bias(p + "attn.proj.bias", C, dt),
              linear(p + "ffn.fc1.weight", 4 * C, C, dt), bias(p + "ffn.fc1.bias", 4 * C, dt),
              linear(p + "ffn.fc2.weight", C, 4 * C, dt, out_gain), bias(p + "ffn.fc2.bias", C, dt),
              linear(p + "ada_lin.1.weight", 6 * C, C, dt, 0.5), bias(p + "ada_lin.1.bias", 6 * C, dt)]
    t += [linear("head_nm.ada_lin.1.weight", 2 * C, C, dt, 0.5), bias("head_nm.ada_lin.1.bias", 2 * C, dt),
          linear("head.weight", vocab, C, dt), bias("head.bias", vocab, dt)]
    return t


# ---- Infinity -------------------------------------------------------------------------------

def infinity(depth, C, H, chunks, bits, text_ch=2048, text_len=512, levels=15, dt="f32"):
    """Infinity(... shared_aln=True, cos_attn=True, block_chunks=chunks): text conditioning and
    the AdaLN head, then the blocks as block_chunks.{c}.module.{j}. `bits` per token is
    the VAE's codebook_dim, times 4 with spatial patchify (Infinity-8B)."""
    F = round(4 * C / 256) * 256
    pool_heads = text_ch // (128 if C <= 4096 else 64)
    out_gain = 1 / math.sqrt(2 * depth)
    t = [normal("cfg_uncond", (text_len, text_ch), dt, 1.0 / math.sqrt(text_ch)),
         normal("pos_start", (1, 1, C), dt, math.sqrt(1 / C / 3)),
         norm_weight("text_norm.weight", text_ch, dt),
         normal("text_proj_for_sos.ca.mat_q", (1, pool_heads, C // pool_heads), dt, 1.0),
         bias("text_proj_for_sos.ca.v_bias", C, dt),
         const("text_proj_for_sos.ca.zero_k_bias", (C,), dt, 0.0, buffer=True),
         linear("text_proj_for_sos.ca.mat_kv.weight", 2 * C, text_ch, dt),
         linear("text_proj_for_sos.ca.proj.weight", C, C, dt), bias("text_proj_for_sos.ca.proj.bias", C, dt),
         linear("text_proj_for_ca.0.weight", C, text_ch, dt), bias("text_proj_for_ca.0.bias", C, dt),
         linear("text_proj_for_ca.2.weight", C, C, dt), bias("text_proj_for_ca.2.bias", C, dt),
         normal("lvl_embed.weight", (levels, C), dt, math.sqrt(1 / C / 3)),
         linear("word_embed.weight", C, bits, dt), bias("word_embed.bias", C, dt),
         linear("shared_ada_lin.1.weight", 6 * C, C, dt, 0.5), bias("shared_ada_lin.1.bias", 6 * C, dt),
         linear("head_nm.ada_lin.1.weight", 2 * C, C, dt, 0.5), bias("head_nm.ada_lin.1.bias", 2 * C, dt),
         linear("head.weight", 2 * bits, C, dt), bias("head.bias", 2 * bits, dt)]
    per = depth // chunks
    for b in range(depth):
        p = f"block_chunks.{b // per}.module.{b % per}."
        t += [normal(p + "ada_gss", (1, 1, 6, C), dt, 0.02),
              const(p + "sa.scale_mul_1H11", (1, H, 1, 1), dt, math.log(4.0)),  # cos_attn init
              bias(p + "sa.q_bias", C, dt), bias(p + "sa.v_bias", C, dt),
              const(p + "sa.zero_k_bias", (C,), dt, 0.0, buffer=True),
              linear(p + "sa.mat_qkv.weight", 3 * C, C, dt),
              linear(p + "sa.proj.weight", C, C, dt, out_gain), bias(p + "sa.proj.bias", C, dt),
              bias(p + "ca.v_bias", C, dt),
              const(p + "ca.zero_k_bias", (C,), dt, 0.0, buffer=True),
              linear(p + "ca.mat_q.weight", C, C, dt), bias(p + "ca.mat_q.bias", C, dt),
              linear(p + "ca.mat_kv.weight", 2 * C, C, dt),
              linear(p + "ca.proj.weight", C, C, dt, out_gain), bias(p + "ca.proj.bias", C, dt),
              linear(p + "ffn.fc1.weight", F, C, dt), bias(p + "ffn.fc1.bias", F, dt),
              linear(p + "ffn.fc2.weight", C, F, dt, out_gain), bias(p + "ffn.fc2.bias", C, dt),
              norm_weight(p + "ca_norm.weight", C, dt), bias(p + "ca_norm.bias", C, dt)]
    return t


# ---- T5ForConditionalGeneration (flan-t5-xl) ---------------------------------------------------

def t5(c: dict, dt="f32"):
    """Full T5 v1.1 (gated-GELU), as the Hugging Face safetensors hold it: `shared.weight` once
    (the tied encoder/decoder embed_tokens are not stored), encoder, decoder, untied lm_head.
    Scales follow T5's own init (q by (d_model d_kv)^-1/2, no 1/sqrt(d) in attention)."""
    d, dkv, nh, dff, V = c["d_model"], c["d_kv"], c["num_heads"], c["d_ff"], c["vocab_size"]
    inner = nh * dkv
    t = [normal("shared.weight", (V, d), dt, 1.0)]

    def attn(p, rel):
        out = [normal(p + "q.weight", (inner, d), dt, (d * dkv) ** -0.5),
               normal(p + "k.weight", (inner, d), dt, d ** -0.5),
               normal(p + "v.weight", (inner, d), dt, d ** -0.5),
               normal(p + "o.weight", (d, inner), dt, inner ** -0.5)]
        if rel:
            out.append(normal(p + "relative_attention_bias.weight",
                              (c["relative_attention_num_buckets"], nh), dt, d ** -0.5))
        return out

    def ffn(p):
        return [normal(p + "DenseReluDense.wi_0.weight", (dff, d), dt, d ** -0.5),
                normal(p + "DenseReluDense.wi_1.weight", (dff, d), dt, d ** -0.5),
                normal(p + "DenseReluDense.wo.weight", (d, dff), dt, dff ** -0.5),
                norm_weight(p + "layer_norm.weight", d, dt)]

    for i in range(c["num_layers"]):
        p = f"encoder.block.{i}.layer."
        t += attn(p + "0.SelfAttention.", i == 0) + [norm_weight(p + "0.layer_norm.weight", d, dt)]
        t += ffn(p + "1.")
    t.append(norm_weight("encoder.final_layer_norm.weight", d, dt))
    for i in range(c["num_decoder_layers"]):
        p = f"decoder.block.{i}.layer."
        t += attn(p + "0.SelfAttention.", i == 0) + [norm_weight(p + "0.layer_norm.weight", d, dt)]
        t += attn(p + "1.EncDecAttention.", False) + [norm_weight(p + "1.layer_norm.weight", d, dt)]
        t += ffn(p + "2.")
    t.append(norm_weight("decoder.final_layer_norm.weight", d, dt))
    t.append(normal("lm_head.weight", (V, d), dt, d ** -0.5))
    return t
