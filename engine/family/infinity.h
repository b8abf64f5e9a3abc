/* Infinity's networks on any backend (FoundationVision/Infinity; the
 * family around them is family_infinity.c): the T5 encoder that reads the
 * prompt, the conditioning made once per sequence from its text (the
 * attentive pool's start token, the shared AdaLN tables, the
 * cross-attention's text rows), and the transformer that advances a ragged
 * batch of sequences by one scale each: cosine self-attention with 2D RoPE
 * over its earlier scales and the whole of its own, cross-attention to its
 * own text, GELU-tanh FFN, and the bitwise head (two logits per bit).
 * Tensor names: docs/model-format.md, "The infinity architecture". */
#ifndef ARSERVE_INFINITY_H
#define ARSERVE_INFINITY_H

#include "base/arena.h"
#include "engine/backend/backend.h"
#include "engine/kv/kv_seq.h"
#include "engine/model_config.h"
#include "engine/policy/kv_policy.h"
#include "engine/weights.h"

typedef struct t5_layer {
    tensor_t ln1, q, k, v, o, ln2, wi0, wi1, wo;
} t5_layer_t;

typedef struct inf_block {
    tensor_t gss;        /* [6 C]: added to the shared AdaLN output */
    tensor_t qkv, qkv_b; /* q, k, v stacked [3, C, C]; biases [3, C], k's zeros */
    tensor_t head_mul, proj, proj_b;
    tensor_t ca_norm_scale, ca_norm_b; /* ca_norm as a modulation: weight - 1, bias */
    tensor_t ca_q, ca_q_b, ca_k, ca_v, ca_v_b, ca_proj, ca_proj_b;
    tensor_t fc1, fc1_b, fc2, fc2_b;
    float *q_bias; /* host [C]: qkv_b's first row, for ScaleKV's raw queries */
} inf_block_t;

typedef struct inf_model {
    const model_config_t *cfg;
    backend_t *be;
    arena_t *arena; /* the model's step arena, for a pass's host arrays */
    /* T5 encoder */
    tensor_t t5_embed, t5_final;
    t5_layer_t *t5;
    float *t5_rel_host; /* host [relative_buckets x num_heads]: layer 0's bias table */
    /* conditioning */
    tensor_t cfg_uncond, text_norm;
    float *pool_q; /* backend [C]: the attentive pool's one query */
    tensor_t pool_k, pool_v, pool_v_b, pool_proj, pool_proj_b;
    tensor_t ca1, ca1_b, ca2, ca2_b; /* text_proj_for_ca: Linear, GELU-tanh, Linear */
    tensor_t shared_ada, shared_ada_b, head_ada, head_ada_b, head, head_b;
    tensor_t word_embed, word_embed_b, lvl_embed;
    float *pos_start; /* backend [C] */
    inf_block_t *blocks;
    /* Workspace (backend), grown on demand. */
    int ws_rows, ws_text;
    float *x, *xn, *qkv, *att, *tmp, *ffn, *logits, *kt, *vt; /* qkv: q, k, v row blocks */
} inf_model_t;

/* A sequence's conditioning, in one backend buffer of inf_cond_floats: its
 * AdaLN tables (every block's six chunks gamma1, gamma2, scale1, scale2,
 * shift1, shift2, then the head's scale and shift), its start token, and
 * its text rows for cross-attention (n_text x C, at most text.max_tokens). */
size_t inf_cond_floats(const inf_model_t *m);

int inf_load(inf_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
             ar_error_t *err);
void inf_free(inf_model_t *m);

/* The T5 encoder over one prompt's n token ids (host, </s> included) into
 * out (backend, n x text.hidden_size). */
int inf_t5_encode(inf_model_t *m, const int *ids, int n, float *out, ar_error_t *err);

/* A sequence's conditioning into cond (backend, inf_cond_floats) from its
 * n text feature rows (backend, n x text.hidden_size: T5's output, or NULL
 * for the learned unconditional rows cfg_uncond[:n]). */
int inf_condition(inf_model_t *m, float *cond, const float *text, int n, ar_error_t *err);

/* What one sequence feeds in one pass: scale si of its image size, h * w
 * rows. */
typedef struct inf_input {
    kv_seq_t *seq;
    int size;  /* index into image.sizes */
    int scale; /* si */
    /* si > 0: the next-scale input, h * w rows of image.bits (backend);
     * NULL at si = 0 (the start token). */
    const float *rows;
    const float *cond; /* inf_condition's buffer */
    int n_text;        /* its text rows */
    int cache;         /* append the scale's K and V (not for the last) */
    int collect_mass;
    kv_policy_state_t *policy; /* a layered policy, or NULL (var.h) */
    int *peak_blocks;
} inf_input_t;

/* One forward pass over n_in inputs (sharing one pool): every row's
 * 2 x image.bits logits (bit b of a token: logits 2b and 2b + 1 for the
 * values 0 and 1) into logits_host, input by input. Fails as var_forward. */
int inf_forward(inf_model_t *m, const inf_input_t *in, int n_in, float *logits_host,
                ar_error_t *err);

/* The 2D RoPE position (row, column) of token (i, j) of a scale of h x w
 * tokens whose size has the rope grid (gh, gw): round(i * gh / h) and
 * round(j * gw / w), in float, halves to even (Infinity's "normalised by
 * h, w" positions). */
void inf_rope_position(int i, int j, int h, int w, int gh, int gw, int *row, int *col);

/* T5's bidirectional relative position bucket of key j for query i. */
int inf_t5_bucket(int rel, int n_buckets, int max_distance);

#endif
