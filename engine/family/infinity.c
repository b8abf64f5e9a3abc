/* Infinity's T5 encoder, conditioning and transformer on any backend
 * (infinity.h). The conventions that decide the numbers, as the official
 * code computes them: LayerNorms without affine in fp32 then x (1 + scale)
 * + shift; q and k L2-normalised, q times exp(min(scale_mul, ln 100)),
 * then 2D RoPE on both (interleaved pairs, the first quarter of the
 * frequencies turned by the row, the rest by the column), softmax scale 1;
 * cross-attention with scale 1 / sqrt(head_dim) over the sequence's own
 * text; the level embedding added before the first block only; the head's
 * AdaLN conditioned on the start token for both CFG rows. */
#include "engine/family/infinity.h"

#include "engine/family/forward.h"
#include "engine/family/seq_rows.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INF_MAX_HEADS 1024
#define INF_LEVELS 15 /* rows of lvl_embed */

size_t inf_cond_floats(const inf_model_t *m) {
    const model_config_t *c = m->cfg;
    const size_t C = (size_t)c->llm.hidden_size;
    return (size_t)c->llm.num_layers * 6 * C + 2 * C + C + (size_t)c->text.max_tokens * C;
}

/* Offsets into a cond buffer. */
static size_t cond_head_at(const inf_model_t *m) {
    return (size_t)m->cfg->llm.num_layers * 6 * m->cfg->llm.hidden_size;
}
static size_t cond_sos_at(const inf_model_t *m) {
    return cond_head_at(m) + 2 * (size_t)m->cfg->llm.hidden_size;
}
static size_t cond_text_at(const inf_model_t *m) {
    return cond_sos_at(m) + (size_t)m->cfg->llm.hidden_size;
}

/* A host array uploaded into a backend weight of type f32. */
static int load_host_f32(backend_t *be, tensor_t *t, const float *host, int64_t n,
                         ar_error_t *err) {
    return be->weight_load(be, t, host, DTYPE_F32, SHAPE1(n), err);
}

static int load_t5(inf_model_t *m, weight_set_t *ws, ar_error_t *err) {
    const text_config_t *t = &m->cfg->text;
    const int64_t D = t->hidden_size, I = (int64_t)t->num_heads * t->head_dim,
                  F = t->intermediate_size;
    const char *p = "t5.block";
    if (!(m->t5 = calloc((size_t)t->num_layers, sizeof *m->t5)) ||
        !(m->t5_rel_host = malloc((size_t)t->relative_buckets * t->num_heads * sizeof(float))))
        return ar_errorf(err, "out of memory");
    if (weight_load(ws, &m->t5_embed, SHAPE2(t->vocab_size, D), err, "t5.shared.weight") ||
        weight_load(ws, &m->t5_final, SHAPE1(D), err, "t5.final_layer_norm.weight") ||
        weight_read_f32(ws, m->t5_rel_host, SHAPE2(t->relative_buckets, t->num_heads), err,
                        "%s.0.layer.0.SelfAttention.relative_attention_bias.weight", p))
        return AR_ERR;
    for (int i = 0; i < t->num_layers; i++) {
        t5_layer_t *L = &m->t5[i];
        if (weight_load(ws, &L->ln1, SHAPE1(D), err, "%s.%d.layer.0.layer_norm.weight", p, i) ||
            weight_load_linear(ws, &L->q, SHAPE2(I, D), err, "%s.%d.layer.0.SelfAttention.q.weight",
                               p, i) ||
            weight_load_linear(ws, &L->k, SHAPE2(I, D), err, "%s.%d.layer.0.SelfAttention.k.weight",
                               p, i) ||
            weight_load_linear(ws, &L->v, SHAPE2(I, D), err, "%s.%d.layer.0.SelfAttention.v.weight",
                               p, i) ||
            weight_load_linear(ws, &L->o, SHAPE2(D, I), err, "%s.%d.layer.0.SelfAttention.o.weight",
                               p, i) ||
            weight_load(ws, &L->ln2, SHAPE1(D), err, "%s.%d.layer.1.layer_norm.weight", p, i) ||
            weight_load_linear(ws, &L->wi0, SHAPE2(F, D), err,
                               "%s.%d.layer.1.DenseReluDense.wi_0.weight", p, i) ||
            weight_load_linear(ws, &L->wi1, SHAPE2(F, D), err,
                               "%s.%d.layer.1.DenseReluDense.wi_1.weight", p, i) ||
            weight_load_linear(ws, &L->wo, SHAPE2(D, F), err,
                               "%s.%d.layer.1.DenseReluDense.wo.weight", p, i))
            return AR_ERR;
    }
    return AR_OK;
}

static int load_block(inf_model_t *m, weight_set_t *ws, int i, ar_error_t *err) {
    const llm_config_t *l = &m->cfg->llm;
    backend_t *be = m->be;
    inf_block_t *b = &m->blocks[i];
    const int64_t C = l->hidden_size, H = l->num_heads, F = l->intermediate_size;
    const char *p = "inf.blocks";
    float *host = malloc((size_t)(6 * C) * sizeof *host);
    float mul[INF_MAX_HEADS];
    int rc = AR_ERR;
    if (!host) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    /* Added to activations as raw floats: fp32 whatever the file's type. */
    if (weight_read_f32(ws, host, SHAPE2(6, C), err, "%s.%d.ada_gss", p, i) ||
        load_host_f32(be, &b->gss, host, 6 * C, err))
        goto out;
    char sa[128];
    snprintf(sa, sizeof sa, "%s.%d.sa", p, i);
    if (weight_load_qkv_biased(ws, &b->qkv, &b->qkv_b, &b->q_bias, sa, "mat_qkv.weight", C, err))
        goto out;
    if (weight_read_f32(ws, mul, SHAPE1(H), err, "%s.%d.sa.scale_mul_1H11", p, i))
        goto out;
    for (int h = 0; h < H; h++)
        mul[h] = expf(fminf(mul[h], logf(100.0f)));
    /* ca_norm(x) = LN(x) w + b, run as the modulation LN(x) (1 + (w - 1)) + b. */
    if (weight_read_f32(ws, host, SHAPE1(C), err, "%s.%d.ca_norm.weight", p, i))
        goto out;
    for (int64_t j = 0; j < C; j++)
        host[j] -= 1.0f;
    tensor_t *kv[] = {&b->ca_k, &b->ca_v};
    for (int j = 0; j < 2; j++)
        if (weight_load_linear_rows(ws, kv[j], j * C, C, SHAPE2(2 * C, C), err,
                                    "%s.%d.ca.mat_kv.weight", p, i))
            goto out;
    if (load_host_f32(be, &b->head_mul, mul, H, err) ||
        load_host_f32(be, &b->ca_norm_scale, host, C, err) ||
        weight_load(ws, &b->ca_norm_b, SHAPE1(C), err, "%s.%d.ca_norm.bias", p, i) ||
        weight_load_linear(ws, &b->proj, SHAPE2(C, C), err, "%s.%d.sa.proj.weight", p, i) ||
        weight_load(ws, &b->proj_b, SHAPE1(C), err, "%s.%d.sa.proj.bias", p, i) ||
        weight_load_linear(ws, &b->ca_q, SHAPE2(C, C), err, "%s.%d.ca.mat_q.weight", p, i) ||
        weight_load(ws, &b->ca_q_b, SHAPE1(C), err, "%s.%d.ca.mat_q.bias", p, i) ||
        weight_load(ws, &b->ca_v_b, SHAPE1(C), err, "%s.%d.ca.v_bias", p, i) ||
        weight_load_linear(ws, &b->ca_proj, SHAPE2(C, C), err, "%s.%d.ca.proj.weight", p, i) ||
        weight_load(ws, &b->ca_proj_b, SHAPE1(C), err, "%s.%d.ca.proj.bias", p, i) ||
        weight_load_linear(ws, &b->fc1, SHAPE2(F, C), err, "%s.%d.ffn.fc1.weight", p, i) ||
        weight_load(ws, &b->fc1_b, SHAPE1(F), err, "%s.%d.ffn.fc1.bias", p, i) ||
        weight_load_linear(ws, &b->fc2, SHAPE2(C, F), err, "%s.%d.ffn.fc2.weight", p, i) ||
        weight_load(ws, &b->fc2_b, SHAPE1(C), err, "%s.%d.ffn.fc2.bias", p, i))
        goto out;
    rc = AR_OK;
out:
    free(host);
    return rc;
}

int inf_load(inf_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
             ar_error_t *err) {
    memset(m, 0, sizeof *m);
    m->cfg = cfg;
    m->be = be;
    const llm_config_t *l = &cfg->llm;
    const text_config_t *t = &cfg->text;
    const int64_t C = l->hidden_size, T = t->hidden_size, bits = cfg->image.bits;
    if (l->num_heads > INF_MAX_HEADS)
        return ar_errorf(err, "llm.num_heads %d exceeds %d", l->num_heads, INF_MAX_HEADS);
    if (C % t->pool_heads)
        return ar_errorf(err, "text.pool_heads %d does not divide llm.hidden_size %lld",
                         t->pool_heads, (long long)C);
    if (!(m->blocks = calloc((size_t)l->num_layers, sizeof *m->blocks)))
        return ar_errorf(err, "out of memory");
    /* Two rows used as activations, held as fp32 buffers: the attentive
     * pool's query and pos_start. */
    float *q = malloc((size_t)2 * C * sizeof *q);
    int rc = !q ? ar_errorf(err, "out of memory")
                : weight_read_f32(ws, q, SHAPE1(C), err, "inf.text_proj_for_sos.ca.mat_q") ||
                      weight_read_f32(ws, q + C, SHAPE3(1, 1, C), err, "inf.pos_start");
    if (rc == AR_OK && (!(m->pool_q = be->alloc(be, (size_t)C * sizeof(float))) ||
                        !(m->pos_start = be->alloc(be, (size_t)C * sizeof(float)))))
        rc = ar_errorf(err, "out of backend memory");
    if (rc == AR_OK) {
        be->upload(be, m->pool_q, q, (size_t)C * sizeof(float));
        be->upload(be, m->pos_start, q + C, (size_t)C * sizeof(float));
    }
    free(q);
    if (rc != AR_OK)
        return AR_ERR;
    const char *sp = "inf.text_proj_for_sos.ca";
    if (load_t5(m, ws, err) ||
        weight_load(ws, &m->cfg_uncond, SHAPE2(t->max_tokens, T), err, "inf.cfg_uncond") ||
        weight_load(ws, &m->text_norm, SHAPE1(T), err, "inf.text_norm.weight") ||
        weight_load_linear_rows(ws, &m->pool_k, 0, C, SHAPE2(2 * C, T), err, "%s.mat_kv.weight",
                                sp) ||
        weight_load_linear_rows(ws, &m->pool_v, C, C, SHAPE2(2 * C, T), err, "%s.mat_kv.weight",
                                sp) ||
        weight_load(ws, &m->pool_v_b, SHAPE1(C), err, "%s.v_bias", sp) ||
        weight_load_linear(ws, &m->pool_proj, SHAPE2(C, C), err, "%s.proj.weight", sp) ||
        weight_load(ws, &m->pool_proj_b, SHAPE1(C), err, "%s.proj.bias", sp) ||
        weight_load_linear(ws, &m->ca1, SHAPE2(C, T), err, "inf.text_proj_for_ca.0.weight") ||
        weight_load(ws, &m->ca1_b, SHAPE1(C), err, "inf.text_proj_for_ca.0.bias") ||
        weight_load_linear(ws, &m->ca2, SHAPE2(C, C), err, "inf.text_proj_for_ca.2.weight") ||
        weight_load(ws, &m->ca2_b, SHAPE1(C), err, "inf.text_proj_for_ca.2.bias") ||
        weight_load_linear(ws, &m->shared_ada, SHAPE2(6 * C, C), err,
                           "inf.shared_ada_lin.1.weight") ||
        weight_load(ws, &m->shared_ada_b, SHAPE1(6 * C), err, "inf.shared_ada_lin.1.bias") ||
        weight_load_linear(ws, &m->head_ada, SHAPE2(2 * C, C), err,
                           "inf.head_nm.ada_lin.1.weight") ||
        weight_load(ws, &m->head_ada_b, SHAPE1(2 * C), err, "inf.head_nm.ada_lin.1.bias") ||
        weight_load_linear(ws, &m->head, SHAPE2(2 * bits, C), err, "inf.head.weight") ||
        weight_load(ws, &m->head_b, SHAPE1(2 * bits), err, "inf.head.bias") ||
        weight_load_linear(ws, &m->word_embed, SHAPE2(C, bits), err, "inf.word_embed.weight") ||
        weight_load(ws, &m->word_embed_b, SHAPE1(C), err, "inf.word_embed.bias") ||
        weight_load(ws, &m->lvl_embed, SHAPE2(INF_LEVELS, C), err, "inf.lvl_embed.weight"))
        return AR_ERR;
    if (cfg->image.n_scales > INF_LEVELS)
        return ar_errorf(err, "%d scales: Infinity's level table has %d rows", cfg->image.n_scales,
                         INF_LEVELS);
    for (int i = 0; i < l->num_layers; i++)
        if (load_block(m, ws, i, err) != AR_OK)
            return AR_ERR;
    return AR_OK;
}

static void workspace_free(inf_model_t *m) {
    backend_t *be = m->be;
    float **bufs[] = {&m->x,   &m->xn,     &m->qkv, &m->att, &m->tmp,
                      &m->ffn, &m->logits, &m->kt,  &m->vt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        be->free(be, *bufs[i]);
        *bufs[i] = NULL;
    }
    m->ws_rows = m->ws_text = 0;
}

void inf_free(inf_model_t *m) {
    backend_t *be = m->be;
    if (!be)
        return;
    workspace_free(m);
    tensor_t *ts[] = {
        &m->t5_embed, &m->t5_final,   &m->cfg_uncond,   &m->text_norm, &m->pool_k,     &m->pool_v,
        &m->pool_v_b, &m->pool_proj,  &m->pool_proj_b,  &m->ca1,       &m->ca1_b,      &m->ca2,
        &m->ca2_b,    &m->shared_ada, &m->shared_ada_b, &m->head_ada,  &m->head_ada_b, &m->head,
        &m->head_b,   &m->word_embed, &m->word_embed_b, &m->lvl_embed};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        be->weight_free(be, ts[i]);
    for (int i = 0; m->t5 && i < m->cfg->text.num_layers; i++)
        for (tensor_t *t = &m->t5[i].ln1; t <= &m->t5[i].wo; t++)
            be->weight_free(be, t);
    for (int i = 0; m->blocks && i < m->cfg->llm.num_layers; i++) {
        for (tensor_t *t = &m->blocks[i].gss; t <= &m->blocks[i].fc2_b; t++)
            be->weight_free(be, t);
        free(m->blocks[i].q_bias);
    }
    free(m->t5);
    free(m->t5_rel_host);
    free(m->blocks);
    be->free(be, m->pool_q);
    be->free(be, m->pos_start);
    memset(m, 0, sizeof *m);
}

/* Grows the workspace to rows query rows and text key rows. */
static int workspace_reserve(inf_model_t *m, int rows, int text, ar_error_t *err) {
    if (rows <= m->ws_rows && text <= m->ws_text)
        return AR_OK;
    rows = rows > m->ws_rows ? rows : m->ws_rows;
    text = text > m->ws_text ? text : m->ws_text;
    workspace_free(m);
    const model_config_t *c = m->cfg;
    const size_t C = (size_t)c->llm.hidden_size, F = (size_t)c->llm.intermediate_size,
                 R = (size_t)rows, T = (size_t)text;
    struct {
        float **p;
        size_t n;
    } plan[] = {{&m->x, R * C},
                {&m->xn, R * C},
                {&m->qkv, 3 * R * C},
                {&m->att, R * C},
                {&m->tmp, R * C},
                {&m->ffn, R * F},
                {&m->logits, R * 2 * (size_t)c->image.bits},
                {&m->kt, T * C},
                {&m->vt, T * C}};
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        if (!(*plan[i].p = m->be->alloc(m->be, (plan[i].n ? plan[i].n : 1) * sizeof(float)))) {
            workspace_free(m);
            return ar_errorf(err, "out of backend memory for a %d-row workspace", rows);
        }
    m->ws_rows = rows;
    m->ws_text = text;
    return AR_OK;
}

int inf_t5_bucket(int rel, int n_buckets, int max_distance) {
    const int half = n_buckets / 2, exact = half / 2;
    int bucket = rel > 0 ? half : 0;
    const int n = rel < 0 ? -rel : rel;
    if (n < exact)
        return bucket + n;
    /* In float, as the reference computes it, truncated toward zero. */
    const float lg = logf((float)n / (float)exact) / (float)log((double)max_distance / exact);
    int large = exact + (int)(lg * (float)(half - exact));
    return bucket + (large < half - 1 ? large : half - 1);
}

int inf_t5_encode(inf_model_t *m, const int *ids, int n, float *out, ar_error_t *err) {
    backend_t *be = m->be;
    const text_config_t *t = &m->cfg->text;
    const int D = t->hidden_size, H = t->num_heads, hd = t->head_dim, I = H * hd,
              F = t->intermediate_size;
    const int span = n, nb = 2 * n - 1;
    if (n < 1 || n > t->max_tokens)
        return ar_errorf(err, "a prompt of %d tokens: the text encoder takes 1 to %d", n,
                         t->max_tokens);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->vocab_size)
            return ar_errorf(err, "prompt token id %d is outside the vocabulary [0, %d)", ids[i],
                             t->vocab_size);
    float *bias_host = malloc((size_t)H * nb * sizeof *bias_host);
    float *x = be->alloc(be, (size_t)n * D * sizeof(float));
    float *h = be->alloc(be, (size_t)n * D * sizeof(float));
    float *q = be->alloc(be, (size_t)n * I * sizeof(float));
    float *k = be->alloc(be, (size_t)n * I * sizeof(float));
    float *v = be->alloc(be, (size_t)n * I * sizeof(float));
    float *a = be->alloc(be, (size_t)n * (F > I ? F : I) * sizeof(float));
    float *b = be->alloc(be, (size_t)n * F * sizeof(float));
    float *bias = be->alloc(be, (size_t)H * nb * sizeof(float));
    int rc = AR_ERR;
    if (!bias_host || !x || !h || !q || !k || !v || !a || !b || !bias) {
        ar_errorf(err, "out of memory for the text encoder");
        goto out;
    }
    /* Head hh's bias of relative position r = j - i at hh * nb + r + span - 1. */
    for (int r = -(span - 1); r <= span - 1; r++) {
        const int bk = inf_t5_bucket(r, t->relative_buckets, t->relative_max_distance);
        for (int hh = 0; hh < H; hh++)
            bias_host[(size_t)hh * nb + r + span - 1] = m->t5_rel_host[(size_t)bk * H + hh];
    }
    be->upload(be, bias, bias_host, (size_t)H * nb * sizeof(float));
    const int starts[2] = {0, n};
    be->embedding(be, x, &m->t5_embed, ids, n, 0);
    for (int li = 0; li < t->num_layers; li++) {
        const t5_layer_t *L = &m->t5[li];
        be->rmsnorm(be, h, x, &L->ln1, n, D, t->norm_eps);
        be->matmul(be, q, h, &L->q, NULL, n);
        be->matmul(be, k, h, &L->k, NULL, n);
        be->matmul(be, v, h, &L->v, NULL, n);
        /* T5 does not scale its scores by 1 / sqrt(d). */
        be->attention_dense(be, a, q, k, v, I, starts, starts, 1, H, hd, 1.0f, bias, span);
        be->matmul(be, h, a, &L->o, NULL, n);
        be->add(be, x, h, (size_t)n * D);
        be->rmsnorm(be, h, x, &L->ln2, n, D, t->norm_eps);
        be->matmul(be, a, h, &L->wi0, NULL, n);
        be->gelu_tanh(be, a, (size_t)n * F);
        be->matmul(be, b, h, &L->wi1, NULL, n);
        be->mul(be, a, b, (size_t)n * F);
        be->matmul(be, h, a, &L->wo, NULL, n);
        be->add(be, x, h, (size_t)n * D);
    }
    be->rmsnorm(be, out, x, &m->t5_final, n, D, t->norm_eps);
    rc = AR_OK;
out:
    free(bias_host);
    float *bufs[] = {x, h, q, k, v, a, b, bias};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        be->free(be, bufs[i]);
    return rc;
}

int inf_condition(inf_model_t *m, float *cond, const float *text, int n, ar_error_t *err) {
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    const int C = c->llm.hidden_size, T = c->text.hidden_size, L = c->llm.num_layers;
    const int ph = c->text.pool_heads, phd = C / ph;
    if (n < 1 || n > c->text.max_tokens)
        return ar_errorf(err, "%d text rows: the model takes 1 to %d", n, c->text.max_tokens);
    float *tn = be->alloc(be, (size_t)n * T * sizeof(float));
    float *k = be->alloc(be, (size_t)n * C * sizeof(float));
    float *v = be->alloc(be, (size_t)n * C * sizeof(float));
    float *small = be->alloc(be, (size_t)8 * C * sizeof(float));
    int rc = AR_ERR;
    if (!tn || !k || !v || !small) {
        ar_errorf(err, "out of backend memory for a prompt's conditioning");
        goto out;
    }
    if (text) {
        be->rmsnorm(be, tn, text, &m->text_norm, n, T, c->llm.norm_eps);
    } else {
        int *rows = malloc((size_t)n * sizeof *rows);
        if (!rows) {
            ar_errorf(err, "out of memory");
            goto out;
        }
        for (int i = 0; i < n; i++)
            rows[i] = i;
        be->embedding(be, tn, &m->cfg_uncond, rows, n, 0);
        free(rows);
        be->rmsnorm(be, tn, tn, &m->text_norm, n, T, c->llm.norm_eps);
    }
    /* The start token: one learned query attending over the text. */
    float *att = small, *sos = cond + cond_sos_at(m), *act = small + C;
    const int q_starts[2] = {0, 1}, k_starts[2] = {0, n};
    be->matmul(be, k, tn, &m->pool_k, NULL, n);
    be->matmul(be, v, tn, &m->pool_v, &m->pool_v_b, n);
    be->attention_dense(be, att, m->pool_q, k, v, C, q_starts, k_starts, 1, ph, phd,
                        1.0f / sqrtf((float)phd), NULL, 0);
    be->matmul(be, sos, att, &m->pool_proj, &m->pool_proj_b, 1);
    /* Every block's table: the shared AdaLN of SiLU(sos) plus its own. */
    be->copy(be, act, sos, (size_t)C * sizeof(float));
    be->silu(be, act, (size_t)C);
    float *six = small + 2 * C;
    be->matmul(be, six, act, &m->shared_ada, &m->shared_ada_b, 1);
    for (int li = 0; li < L; li++) {
        float *tab = cond + (size_t)li * 6 * C;
        be->copy(be, tab, six, (size_t)6 * C * sizeof(float));
        be->add(be, tab, m->blocks[li].gss.data, (size_t)6 * C);
    }
    be->matmul(be, cond + cond_head_at(m), act, &m->head_ada, &m->head_ada_b, 1);
    /* The cross-attention's text rows. */
    be->matmul(be, k, tn, &m->ca1, &m->ca1_b, n);
    be->gelu_tanh(be, k, (size_t)n * C);
    be->matmul(be, cond + cond_text_at(m), k, &m->ca2, &m->ca2_b, n);
    rc = AR_OK;
out:
    be->free(be, tn);
    be->free(be, k);
    be->free(be, v);
    be->free(be, small);
    return rc;
}

void inf_rope_position(int i, int j, int h, int w, int gh, int gw, int *row, int *col) {
    const float fh = (float)((double)gh / h), fw = (float)((double)gw / w);
    *row = (int)nearbyintf((float)i * fh);
    *col = (int)nearbyintf((float)j * fw);
}

static void rows_matmul(inf_model_t *m, float *y, const float *x, const tensor_t *w,
                        const tensor_t *b, const int *q_start, int n_seq) {
    seq_rows_matmul(m->be, y, x, w, b, q_start, n_seq);
}

/* xn = LayerNorm(x) * (1 + scale) + shift, sequence s's scale and shift at
 * tabs[s] + sc and + sh (its conditioning buffer). */
static void norm_modulate(inf_model_t *m, const float *const *tabs, const int *q_start, int n_seq,
                          size_t sc, size_t sh) {
    seq_rows_norm_modulate(m->be, m->xn, m->x, q_start, n_seq, tabs, sc, sh,
                           m->cfg->llm.hidden_size, m->cfg->llm.norm_eps);
}

static void gated_residual(inf_model_t *m, const float *const *tabs, const int *q_start, int n_seq,
                           const float *a, size_t g) {
    seq_rows_gated_residual(m->be, m->x, a, q_start, n_seq, tabs, g, m->cfg->llm.hidden_size);
}

/* The rows' first input: the start token plus pos_start at scale 0, else
 * word_embed of the next-scale input; then the scale's level embedding. */
static void embed_inputs(inf_model_t *m, const inf_input_t *in, int n_in, const int *q_start) {
    backend_t *be = m->be;
    const size_t C = (size_t)m->cfg->llm.hidden_size;
    for (int s = 0; s < n_in; s++) {
        float *dst = m->x + (size_t)q_start[s] * C;
        const int n = q_start[s + 1] - q_start[s], si = in[s].scale;
        if (si == 0) {
            be->copy(be, dst, in[s].cond + cond_sos_at(m), C * sizeof(float));
            be->add(be, dst, m->pos_start, C);
        } else {
            be->matmul(be, dst, in[s].rows, &m->word_embed, &m->word_embed_b, n);
        }
        be->embedding(be, m->tmp, &m->lvl_embed, &si, 1, 0);
        for (int r = 0; r < n; r++)
            be->add(be, dst + (size_t)r * C, m->tmp, C);
    }
}

/* Rows of scale si of size z. */
static int scale_rows(const image_size_t *z, int si) { return z->h[si] * z->w[si]; }

static int add_input(inf_model_t *m, forward_t *f, const inf_input_t *in, int s, ar_error_t *err) {
    const image_config_t *im = &m->cfg->image;
    if (in->size < 0 || in->size >= im->n_sizes)
        return ar_errorf(err, "sequence %d: size %d is out of range", s, in->size);
    const image_size_t *z = &im->sizes[in->size];
    const int si = in->scale;
    if (si < 0 || si >= z->n_scales || (si > 0 && !in->rows) || !in->cond || in->n_text < 1 ||
        in->n_text > m->cfg->text.max_tokens)
        return ar_errorf(err, "sequence %d: scale %d, input or text rows out of range", s, si);
    const int rows = scale_rows(z, si);
    return forward_add(f, s,
                       &(forward_seq_t){.seq = in->seq,
                                        .rows = rows,
                                        .n_new = in->cache ? rows : 0,
                                        .n_fed = in->cache ? rows : 0,
                                        .collect_mass = in->collect_mass,
                                        .policy = in->policy,
                                        .step = si,
                                        .cache = in->cache,
                                        .peak_blocks = in->peak_blocks},
                       err);
}

/* Each sequence's text keys and values of block b into m->kt and m->vt
 * (rows t_start[s] ..), from its cross-attention rows. */
static void text_kv(inf_model_t *m, const inf_block_t *b, const inf_input_t *in, int n_in,
                    const int *t_start) {
    backend_t *be = m->be;
    const size_t C = (size_t)m->cfg->llm.hidden_size;
    for (int s = 0; s < n_in; s++) {
        const float *text = in[s].cond + cond_text_at(m);
        be->matmul(be, m->kt + (size_t)t_start[s] * C, text, &b->ca_k, NULL, in[s].n_text);
        be->matmul(be, m->vt + (size_t)t_start[s] * C, text, &b->ca_v, &b->ca_v_b, in[s].n_text);
    }
}

static int run_block(inf_model_t *m, forward_t *f, const inf_input_t *in, const float *const *tabs,
                     const int *pos, const int *t_start, int li, ar_error_t *err) {
    backend_t *be = m->be;
    const llm_config_t *l = &m->cfg->llm;
    const inf_block_t *b = &m->blocks[li];
    const int H = l->num_heads, C = l->hidden_size, hd = l->head_dim, n_in = f->n_seq;
    const int *q_start = f->q_start, rows = q_start[n_in];
    const size_t at = (size_t)li * 6 * C;
    forward_layer(f, li);
    norm_modulate(m, tabs, q_start, n_in, at + ADALN_SCALE1 * (size_t)C,
                  at + ADALN_SHIFT1 * (size_t)C);
    /* the stacked q, k, v: three blocks of rows (backend.h's matmul) */
    float *q = m->qkv, *k = q + (size_t)rows * C, *v = k + (size_t)rows * C;
    rows_matmul(m, m->qkv, m->xn, &b->qkv, &b->qkv_b, q_start, n_in);
    if (f->any_window) /* the queries as projected, for ScaleKV (tmp is free until the proj) */
        forward_queries(f, m->tmp, q, b->q_bias, rows);
    be->l2norm_heads(be, q, b->head_mul.data, rows, H, hd);
    be->l2norm_heads(be, k, NULL, rows, H, hd);
    /* q's rows and k's, back to back, turned in one call (pos lists the
     * positions twice) */
    be->rope_2d(be, q, pos, 2 * rows, H, hd, 10000.0f);
    if (forward_prune(f, li, k, err) != AR_OK)
        return AR_ERR;
    be->attention_scale(be, m->att, q, k, v, &f->pool->blocks, &f->batch, H, 1.0f);
    if (forward_store(f, li, k, v, err) != AR_OK)
        return AR_ERR;
    rows_matmul(m, m->tmp, m->att, &b->proj, &b->proj_b, q_start, n_in);
    gated_residual(m, tabs, q_start, n_in, m->tmp, at + ADALN_GAMMA1 * (size_t)C);
    /* Cross-attention to the sequence's own text, ungated. */
    be->layernorm(be, m->xn, m->x, rows, C, l->norm_eps);
    be->modulate(be, m->xn, m->xn, b->ca_norm_scale.data, b->ca_norm_b.data, rows, C);
    rows_matmul(m, q, m->xn, &b->ca_q, &b->ca_q_b, q_start, n_in);
    text_kv(m, b, in, n_in, t_start);
    be->attention_dense(be, m->att, q, m->kt, m->vt, C, q_start, t_start, n_in, H, hd,
                        1.0f / sqrtf((float)hd), NULL, 0);
    rows_matmul(m, m->tmp, m->att, &b->ca_proj, &b->ca_proj_b, q_start, n_in);
    be->add(be, m->x, m->tmp, (size_t)rows * C);
    norm_modulate(m, tabs, q_start, n_in, at + ADALN_SCALE2 * (size_t)C,
                  at + ADALN_SHIFT2 * (size_t)C);
    rows_matmul(m, m->ffn, m->xn, &b->fc1, &b->fc1_b, q_start, n_in);
    be->gelu_tanh(be, m->ffn, (size_t)rows * l->intermediate_size);
    rows_matmul(m, m->tmp, m->ffn, &b->fc2, &b->fc2_b, q_start, n_in);
    gated_residual(m, tabs, q_start, n_in, m->tmp, at + ADALN_GAMMA2 * (size_t)C);
    return AR_OK;
}

int inf_forward(inf_model_t *m, const inf_input_t *in, int n_in, float *logits_host,
                ar_error_t *err) {
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    const llm_config_t *l = &c->llm;
    const int C = l->hidden_size, V = 2 * c->image.bits;
    if (n_in <= 0)
        return AR_OK;
    forward_t f = {.be = be, .arena = m->arena, .n_heads = l->num_heads, .head_dim = l->head_dim};
    int rc = AR_ERR;
    if (forward_begin(&f, n_in, err) != AR_OK)
        goto out;
    for (int s = 0; s < n_in; s++)
        if (add_input(m, &f, &in[s], s, err) != AR_OK)
            goto out;
    const int *q_start = f.q_start, rows = q_start[n_in];
    int *t_start = arena_alloc(m->arena, (size_t)(n_in + 1) * sizeof *t_start);
    /* (row, column) per row, then all of them again for k's rows (run_block) */
    int *pos = arena_alloc(m->arena, (size_t)4 * rows * sizeof *pos);
    const float **tabs = arena_alloc(m->arena, (size_t)n_in * sizeof *tabs);
    if (!t_start || !pos || !tabs) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    t_start[0] = 0;
    for (int s = 0; s < n_in; s++) {
        tabs[s] = in[s].cond; /* the AdaLN tables lead the conditioning buffer */
        t_start[s + 1] = t_start[s] + in[s].n_text;
        const image_size_t *z = &c->image.sizes[in[s].size];
        const int si = in[s].scale, h = z->h[si], w = z->w[si];
        for (int i = 0; i < h; i++)
            for (int j = 0; j < w; j++) {
                int *p = pos + 2 * (size_t)(q_start[s] + i * w + j);
                inf_rope_position(i, j, h, w, z->rope_h, z->rope_w, &p[0], &p[1]);
            }
    }
    memcpy(pos + 2 * (size_t)rows, pos, 2 * (size_t)rows * sizeof *pos);
    if (workspace_reserve(m, rows, t_start[n_in], err) != AR_OK ||
        forward_reserve(&f, err) != AR_OK)
        goto out;
    embed_inputs(m, in, n_in, q_start);
    for (int li = 0; li < l->num_layers; li++)
        if (run_block(m, &f, in, tabs, pos, t_start, li, err) != AR_OK)
            goto out;
    forward_advance(&f);
    const size_t head = cond_head_at(m); /* scale, then shift */
    norm_modulate(m, tabs, q_start, n_in, head, head + C);
    rows_matmul(m, m->logits, m->xn, &m->head, &m->head_b, q_start, n_in);
    be->download(be, logits_host, m->logits, (size_t)rows * V * sizeof(float));
    rc = AR_OK;
out:
    forward_end(&f);
    return rc;
}
