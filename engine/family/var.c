/* VAR's transformer on any backend: AdaLN blocks (non-affine LayerNorm
 * modulated per sequence by its class), cosine attention (q and k
 * L2-normalised, q times a learned per-head multiplier, softmax scale 1)
 * over each sequence's earlier scales and its own scale, GELU-tanh FFN,
 * and the AdaLN before the codebook head. Names: docs/model-format.md. */
#include "engine/family/var.h"

#include "engine/family/forward.h"
#include "engine/family/seq_rows.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VAR_MAX_HEADS 1024

static int load_block(var_model_t *m, weight_set_t *ws, int i, ar_error_t *err) {
    const llm_config_t *l = &m->cfg->llm;
    var_block_t *b = &m->blocks[i];
    const int64_t hidden = l->hidden_size, F = l->intermediate_size, H = l->num_heads;
    const char *p = "var.blocks";
    if (l->shared_adaln) {
        /* Added to activations as raw floats: held as fp32 whatever the file's type. */
        float *gss = malloc((size_t)(6 * hidden) * sizeof *gss);
        int rc = !gss ? ar_errorf(err, "out of memory")
                      : weight_read_f32(ws, gss, SHAPE2(6, hidden), err, "%s.%d.adaln_gss", p, i) ||
                            m->be->weight_load(m->be, &b->adaln_gss, gss, DTYPE_F32,
                                               SHAPE1(6 * hidden), err);
        free(gss);
        if (rc)
            return AR_ERR;
    } else if (weight_load_linear(ws, &b->adaln_w, SHAPE2(6 * hidden, hidden), err,
                                  "%s.%d.adaln.weight", p, i) ||
               weight_load(ws, &b->adaln_b, SHAPE1(6 * hidden), err, "%s.%d.adaln.bias", p, i)) {
        return AR_ERR;
    }
    /* The fused qkv matrix as a stack of its three row blocks (one matmul). */
    char attn[128];
    snprintf(attn, sizeof attn, "%s.%d.attn", p, i);
    if (weight_load_qkv_biased(ws, &b->qkv, &b->qkv_b, &b->q_bias, attn, "qkv.weight", hidden, err))
        return AR_ERR;
    /* exp(min(s, ln 100)) per head, once, at load. */
    float mul[VAR_MAX_HEADS];
    if (weight_read_f32(ws, mul, SHAPE1(H), err, "%s.%d.attn.scale_mul", p, i))
        return AR_ERR;
    for (int h = 0; h < H; h++)
        mul[h] = expf(fminf(mul[h], logf(100.0f)));
    if (m->be->weight_load(m->be, &b->head_mul, mul, DTYPE_F32, SHAPE1(H), err) ||
        weight_load_linear(ws, &b->proj, SHAPE2(hidden, hidden), err, "%s.%d.attn.proj.weight", p,
                           i) ||
        weight_load(ws, &b->proj_b, SHAPE1(hidden), err, "%s.%d.attn.proj.bias", p, i) ||
        weight_load_linear(ws, &b->fc1, SHAPE2(F, hidden), err, "%s.%d.ffn.fc1.weight", p, i) ||
        weight_load(ws, &b->fc1_b, SHAPE1(F), err, "%s.%d.ffn.fc1.bias", p, i) ||
        weight_load_linear(ws, &b->fc2, SHAPE2(hidden, F), err, "%s.%d.ffn.fc2.weight", p, i) ||
        weight_load(ws, &b->fc2_b, SHAPE1(hidden), err, "%s.%d.ffn.fc2.bias", p, i))
        return AR_ERR;
    return AR_OK;
}

/* level_pos and start, from the level table, the positions and pos_start. */
static int make_positions(var_model_t *m, weight_set_t *ws, ar_error_t *err) {
    backend_t *be = m->be;
    const image_config_t *im = &m->cfg->image;
    const int64_t hidden = m->cfg->llm.hidden_size, first = m->scale_at[1];
    tensor_t level = {0}, pos = {0}, pos_start = {0};
    int *level_of = malloc((size_t)m->n_tokens * sizeof *level_of);
    int *token = malloc((size_t)m->n_tokens * sizeof *token);
    float *tmp = be->alloc(be, (size_t)(m->n_tokens * hidden) * sizeof(float));
    int rc = AR_ERR;
    m->level_pos = be->alloc(be, (size_t)(m->n_tokens * hidden) * sizeof(float));
    m->start = be->alloc(be, (size_t)(first * hidden) * sizeof(float));
    if (!level_of || !token || !tmp || !m->level_pos || !m->start) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    if (weight_load(ws, &level, SHAPE2(im->n_scales, hidden), err, "var.level_embed.weight") ||
        weight_load(ws, &pos, SHAPE2(m->n_tokens, hidden), err, "var.pos_embed") ||
        weight_load(ws, &pos_start, SHAPE2(first, hidden), err, "var.pos_start"))
        goto out;
    for (int si = 0; si < im->n_scales; si++)
        for (int t = m->scale_at[si]; t < m->scale_at[si + 1]; t++)
            level_of[t] = si;
    for (int t = 0; t < m->n_tokens; t++)
        token[t] = t;
    /* Weights may be stored in a backend's own type; the tables go through
     * the embedding op, which reads any of them, into fp32 rows. */
    be->embedding(be, m->level_pos, &level, level_of, m->n_tokens, 0);
    be->embedding(be, tmp, &pos, token, m->n_tokens, 0);
    be->add(be, m->level_pos, tmp, (size_t)(m->n_tokens * hidden));
    be->embedding(be, m->start, &pos_start, token, (int)first, 0);
    be->add(be, m->start, m->level_pos, (size_t)(first * hidden));
    be->sync(be);
    rc = AR_OK;
out:
    free(level_of);
    free(token);
    be->free(be, tmp);
    be->weight_free(be, &level);
    be->weight_free(be, &pos);
    be->weight_free(be, &pos_start);
    return rc;
}

int var_load(var_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
             ar_error_t *err) {
    memset(m, 0, sizeof *m);
    m->cfg = cfg;
    m->be = be;
    const llm_config_t *l = &cfg->llm;
    const image_config_t *im = &cfg->image;
    const int64_t hidden = l->hidden_size, V = im->codebook_size;
    if (l->num_heads > VAR_MAX_HEADS)
        return ar_errorf(err, "llm.num_heads %d exceeds %d", l->num_heads, VAR_MAX_HEADS);
    for (int si = 0; si < im->n_scales; si++) {
        m->scale_at[si] = m->n_tokens;
        m->n_tokens += im->scales[si] * im->scales[si];
    }
    m->scale_at[im->n_scales] = m->n_tokens;
    m->blocks = calloc((size_t)l->num_layers, sizeof *m->blocks);
    if (!m->blocks)
        return ar_errorf(err, "out of memory");
    if (weight_load(ws, &m->class_embed, SHAPE2(l->vocab_size, hidden), err,
                    "var.class_embed.weight") ||
        weight_load_linear(ws, &m->word_embed, SHAPE2(hidden, im->embed_dim), err,
                           "var.word_embed.weight") ||
        weight_load(ws, &m->word_embed_b, SHAPE1(hidden), err, "var.word_embed.bias") ||
        (l->shared_adaln &&
         (weight_load_linear(ws, &m->shared_adaln_w, SHAPE2(6 * hidden, hidden), err,
                             "var.shared_adaln.weight") ||
          weight_load(ws, &m->shared_adaln_b, SHAPE1(6 * hidden), err, "var.shared_adaln.bias"))) ||
        weight_load_linear(ws, &m->head_adaln_w, SHAPE2(2 * hidden, hidden), err,
                           "var.head_adaln.weight") ||
        weight_load(ws, &m->head_adaln_b, SHAPE1(2 * hidden), err, "var.head_adaln.bias") ||
        weight_load_linear(ws, &m->head, SHAPE2(V, hidden), err, "var.head.weight") ||
        weight_load(ws, &m->head_b, SHAPE1(V), err, "var.head.bias") || make_positions(m, ws, err))
        return AR_ERR;
    for (int i = 0; i < l->num_layers; i++)
        if (load_block(m, ws, i, err) != AR_OK)
            return AR_ERR;
    return AR_OK;
}

static void workspace_free(var_model_t *m) {
    backend_t *be = m->be;
    float **bufs[] = {&m->x, &m->xn, &m->qkv, &m->att, &m->tmp, &m->ffn, &m->cond, &m->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        be->free(be, *bufs[i]);
        *bufs[i] = NULL;
    }
    m->ws_rows = m->ws_seqs = 0;
}

void var_free(var_model_t *m) {
    backend_t *be = m->be;
    if (!be)
        return;
    workspace_free(m);
    tensor_t *ts[] = {&m->class_embed,    &m->word_embed,     &m->word_embed_b,
                      &m->shared_adaln_w, &m->shared_adaln_b, &m->head_adaln_w,
                      &m->head_adaln_b,   &m->head,           &m->head_b};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        be->weight_free(be, ts[i]);
    for (int i = 0; m->blocks && i < m->cfg->llm.num_layers; i++) {
        for (tensor_t *t = &m->blocks[i].adaln_w; t <= &m->blocks[i].fc2_b; t++)
            be->weight_free(be, t);
        free(m->blocks[i].q_bias);
    }
    free(m->blocks);
    be->free(be, m->level_pos);
    be->free(be, m->start);
    memset(m, 0, sizeof *m);
}

static int workspace_reserve(var_model_t *m, int rows, int seqs, ar_error_t *err) {
    if (rows <= m->ws_rows && seqs <= m->ws_seqs)
        return AR_OK;
    rows = rows > m->ws_rows ? rows : m->ws_rows;
    seqs = seqs > m->ws_seqs ? seqs : m->ws_seqs;
    workspace_free(m);
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    const size_t hidden = (size_t)c->llm.hidden_size, F = (size_t)c->llm.intermediate_size,
                 R = (size_t)rows, S = (size_t)seqs;
    struct {
        float **p;
        size_t n;
    } plan[] = {{&m->x, R * hidden},       {&m->xn, R * hidden},
                {&m->qkv, 3 * R * hidden}, {&m->att, R * hidden},
                {&m->tmp, R * hidden},     {&m->ffn, R * F},
                {&m->cond, S * hidden},    {&m->logits, R * (size_t)c->image.codebook_size}};
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        if (!(*plan[i].p = be->alloc(be, plan[i].n * sizeof(float)))) {
            workspace_free(m);
            return ar_errorf(err, "out of backend memory for a %d-row workspace", rows);
        }
    m->ws_rows = rows;
    m->ws_seqs = seqs;
    return AR_OK;
}

static void rows_matmul(var_model_t *m, float *y, const float *x, const tensor_t *w,
                        const tensor_t *b, const int *q_start, int n_seq) {
    seq_rows_matmul(m->be, y, x, w, b, q_start, n_seq);
}

/* Every row's input into m->x: the class embedding plus the start
 * positions at scale 0, else word_embed(latent) plus the scale's level and
 * positions. */
static void embed_inputs(var_model_t *m, const var_input_t *in, int n_in, const int *q_start) {
    backend_t *be = m->be;
    const size_t hidden = (size_t)m->cfg->llm.hidden_size;
    for (int s = 0; s < n_in; s++) {
        float *dst = m->x + (size_t)q_start[s] * hidden;
        const int n = q_start[s + 1] - q_start[s], si = in[s].scale;
        if (si == 0) {
            for (int r = 0; r < n; r++)
                be->embedding(be, dst + (size_t)r * hidden, &m->class_embed, &in[s].label, 1, 0);
            be->add(be, dst, m->start, (size_t)n * hidden);
        } else {
            be->matmul(be, dst, in[s].latent, &m->word_embed, &m->word_embed_b, n);
            be->add(be, dst, m->level_pos + (size_t)m->scale_at[si] * hidden, (size_t)n * hidden);
        }
    }
}

size_t var_adaln_floats(const var_model_t *m) {
    const size_t hidden = (size_t)m->cfg->llm.hidden_size;
    return (size_t)m->cfg->llm.num_layers * 6 * hidden + 2 * hidden;
}

/* A sequence's AdaLN tables from its class: SiLU(class embedding) through
 * every block's Linear (or the shared one plus the block's own table) and
 * the head's, one row at a time so the result never depends on the batch. */
static void make_adaln(var_model_t *m, float *table, int label) {
    backend_t *be = m->be;
    const llm_config_t *l = &m->cfg->llm;
    const size_t hidden = (size_t)l->hidden_size, per_block = 6 * hidden;
    be->embedding(be, m->cond, &m->class_embed, &label, 1, 0);
    be->silu(be, m->cond, hidden);
    for (int li = 0; li < l->num_layers; li++) {
        const var_block_t *b = &m->blocks[li];
        float *t = table + (size_t)li * per_block;
        if (!l->shared_adaln) {
            be->matmul(be, t, m->cond, &b->adaln_w, &b->adaln_b, 1);
        } else {
            be->matmul(be, t, m->cond, &m->shared_adaln_w, &m->shared_adaln_b, 1);
            be->add(be, t, b->adaln_gss.data, per_block);
        }
    }
    be->matmul(be, table + (size_t)l->num_layers * per_block, m->cond, &m->head_adaln_w,
               &m->head_adaln_b, 1);
}

/* xn = LayerNorm(x) * (1 + scale) + shift, each sequence with its own
 * table: scale at tab[s] + sc, shift at tab[s] + sh. */
static void norm_modulate(var_model_t *m, const int *q_start, int n_seq, const float *const *tab,
                          size_t sc, size_t sh) {
    seq_rows_norm_modulate(m->be, m->xn, m->x, q_start, n_seq, tab, sc, sh, m->cfg->llm.hidden_size,
                           m->cfg->llm.norm_eps);
}

/* x += a * gate, the gate at tab[s] + g. */
static void gated_residual(var_model_t *m, const int *q_start, int n_seq, const float *a,
                           const float *const *tab, size_t g) {
    seq_rows_gated_residual(m->be, m->x, a, q_start, n_seq, tab, g, m->cfg->llm.hidden_size);
}

double var_key_similarity(backend_t *be, const kv_blocks_t *pool, const kv_view_t *heads,
                          int n_heads, int head_dim, const float *k_cur, int side_prev,
                          int side_cur, float *const scratch[4]) {
    const int H = n_heads, D = head_dim, C = H * D;
    const int sp = side_prev, sc = side_cur, rp = sp * sp, rc = sc * sc;
    float *prev = scratch[0], *prev_cm = scratch[1], *up = scratch[2], *cur_cm = scratch[3];
    for (int h = 0; h < H; h++) {
        const kv_view_t *kh = &heads[h];
        if (kh->len < rp)
            return NAN;
        be->kv_read_rows(be, prev + (size_t)h * rp * D, pool, kh, kh->len - rp, rp, 0);
        be->transpose(be, prev_cm + (size_t)h * D * rp, prev + (size_t)h * rp * D, rp, D);
    }
    be->resize_bicubic(be, up, prev_cm, C, sp, sp, sc, sc);
    be->transpose(be, cur_cm, k_cur, rc, C);
    be->scale(be, up, (size_t)C * rc, -1.0f);
    be->add(be, up, cur_cm, (size_t)C * rc);
    float *diff = malloc((size_t)C * rc * sizeof *diff);
    if (!diff)
        return NAN;
    be->download(be, diff, up, (size_t)C * rc * sizeof *diff);
    double sum = 0;
    for (size_t i = 0; i < (size_t)C * rc; i++)
        sum += (double)diff[i] * diff[i];
    free(diff);
    return -sum / ((double)C * rc);
}

/* The layer's key similarity of input s for AMS-KV (forward.h's
 * forward_similarity_fn): its keys against the previous scale's, from the
 * views forward_layer made of its heads. */
static double key_similarity(void *family, const forward_t *f, int s, const float *k) {
    var_model_t *m = family;
    const int H = f->n_heads, hd = m->cfg->llm.head_dim, si = f->in[s].step;
    const int *sides = m->cfg->image.scales;
    /* Scratch: the buffers free between the layer's Q/K/V and its
     * attention, each at least rows x hidden floats. */
    float *const scratch[4] = {m->att, m->tmp, m->xn, m->ffn};
    return var_key_similarity(m->be, &f->pool->blocks, &f->views[s * H], H, hd,
                              k + (size_t)f->q_start[s] * H * hd, sides[si - 1], sides[si],
                              scratch);
}

/* Checks input s and adds it to the pass. */
static int add_input(var_model_t *m, forward_t *f, const var_input_t *in, int s, ar_error_t *err) {
    const image_config_t *im = &m->cfg->image;
    const int si = in->scale;
    if (si < 0 || si >= im->n_scales || (si > 0 && !in->latent) || in->label < 0 ||
        in->label > m->cfg->condition.num_classes)
        return ar_errorf(err, "sequence %d: scale %d or class %d is out of range", s, si,
                         in->label);
    if (!in->adaln)
        return ar_errorf(err, "sequence %d: no AdaLN table", s);
    const int rows = im->scales[si] * im->scales[si];
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

/* Block li over the pass's rows (m->x), each sequence modulated by its
 * AdaLN table tabs[s]: attention to its cache and its own scale, the rows'
 * K and V cached after, then the FFN. */
static int run_block(var_model_t *m, forward_t *f, const float *const *tabs, int li,
                     ar_error_t *err) {
    backend_t *be = m->be;
    const llm_config_t *l = &m->cfg->llm;
    const var_block_t *b = &m->blocks[li];
    const int H = l->num_heads, hidden = l->hidden_size, n_in = f->n_seq;
    const int *q_start = f->q_start, rows = q_start[n_in];
    const size_t at = (size_t)li * 6 * hidden; /* the block's chunks in each table */
    forward_layer(f, li);
    norm_modulate(m, q_start, n_in, tabs, at + ADALN_SCALE1 * (size_t)hidden,
                  at + ADALN_SHIFT1 * (size_t)hidden);
    /* the stacked q, k, v: three blocks of rows (backend.h's matmul) */
    float *q = m->qkv, *k = q + (size_t)rows * hidden, *v = k + (size_t)rows * hidden;
    rows_matmul(m, m->qkv, m->xn, &b->qkv, &b->qkv_b, q_start, n_in);
    be->l2norm_heads(be, k, NULL, rows, H, l->head_dim);
    if (forward_prune(f, li, k, err) != AR_OK) /* AMS-KV's similarity may use tmp */
        return AR_ERR;
    if (f->any_window) /* the queries as projected, for ScaleKV (tmp is free until the proj) */
        forward_queries(f, m->tmp, q, b->q_bias, rows);
    be->l2norm_heads(be, q, b->head_mul.data, rows, H, l->head_dim);
    be->attention_scale(be, m->att, q, k, v, &f->pool->blocks, &f->batch, H, 1.0f);
    if (forward_store(f, li, k, v, err) != AR_OK)
        return AR_ERR;
    rows_matmul(m, m->tmp, m->att, &b->proj, &b->proj_b, q_start, n_in);
    gated_residual(m, q_start, n_in, m->tmp, tabs, at + ADALN_GAMMA1 * (size_t)hidden);
    norm_modulate(m, q_start, n_in, tabs, at + ADALN_SCALE2 * (size_t)hidden,
                  at + ADALN_SHIFT2 * (size_t)hidden);
    rows_matmul(m, m->ffn, m->xn, &b->fc1, &b->fc1_b, q_start, n_in);
    be->gelu_tanh(be, m->ffn, (size_t)rows * l->intermediate_size);
    rows_matmul(m, m->tmp, m->ffn, &b->fc2, &b->fc2_b, q_start, n_in);
    gated_residual(m, q_start, n_in, m->tmp, tabs, at + ADALN_GAMMA2 * (size_t)hidden);
    return AR_OK;
}

int var_forward(var_model_t *m, const var_input_t *in, int n_in, float *logits_host,
                ar_error_t *err) {
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    const llm_config_t *l = &c->llm;
    const int hidden = l->hidden_size, V = c->image.codebook_size;
    if (n_in <= 0)
        return AR_OK;
    forward_t f = {.be = be,
                   .arena = m->arena,
                   .n_heads = l->num_heads,
                   .head_dim = l->head_dim,
                   .similarity = key_similarity,
                   .family = m};
    int rc = AR_ERR;
    const float **tabs = NULL;
    if (forward_begin(&f, n_in, err) != AR_OK)
        goto out;
    if (!(tabs = arena_alloc(m->arena, (size_t)n_in * sizeof *tabs))) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int s = 0; s < n_in; s++)
        if (add_input(m, &f, &in[s], s, err) != AR_OK)
            goto out;
    const int *q_start = f.q_start, rows = q_start[n_in];
    if (workspace_reserve(m, rows, n_in, err) != AR_OK || forward_reserve(&f, err) != AR_OK)
        goto out;

    for (int s = 0; s < n_in; s++) {
        tabs[s] = in[s].adaln;
        if (!in[s].adaln_ready)
            make_adaln(m, in[s].adaln, in[s].label);
    }
    embed_inputs(m, in, n_in, q_start);
    for (int li = 0; li < l->num_layers; li++)
        if (run_block(m, &f, tabs, li, err) != AR_OK)
            goto out;
    forward_advance(&f);
    const size_t head = (size_t)l->num_layers * 6 * hidden; /* scale, then shift */
    norm_modulate(m, q_start, n_in, tabs, head, head + hidden);
    rows_matmul(m, m->logits, m->xn, &m->head, &m->head_b, q_start, n_in);
    be->download(be, logits_host, m->logits, (size_t)rows * V * sizeof(float));
    rc = AR_OK;
out:
    forward_end(&f);
    return rc;
}
