/* The raster family's generation path on any backend (Janus-Pro or
 * LlamaGen, raster.h): embedding, Llama blocks (RMSNorm, RoPE, attention
 * over paged per-head caches, SwiGLU) and the generation head. */
#include "engine/family/raster.h"

#include "engine/family/forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Layer i's weights. q, k and v are one stacked weight (backend.h's
 * matmul), as are gate and up: one GEMM each where there would be three
 * and two. fused_qkv: LlamaGen's wqkv (q rows, then k, then v), whose
 * blocks are the stack's parts. */
static int load_layer(raster_model_t *m, weight_set_t *ws, int i, int fused_qkv, ar_error_t *err) {
    const llm_config_t *l = &m->cfg->llm;
    /* model_config keeps num_kv_heads == num_heads: q, k and v are alike */
    const int64_t hidden = l->hidden_size, qd = (int64_t)l->num_heads * l->head_dim,
                  F = l->intermediate_size;
    raster_layer_t *y = &m->layers[i];
    const char *p = "llm.layers";
    static const char *const qkv_names[3] = {"q", "k", "v"};
    weight_part_t qkv[3], gate_up[2];
    for (int j = 0; j < 3; j++) {
        if (fused_qkv)
            snprintf(qkv[j].name, sizeof qkv[j].name, "%s.%d.attn.wqkv.weight", p, i);
        else
            snprintf(qkv[j].name, sizeof qkv[j].name, "%s.%d.attn.%s.weight", p, i, qkv_names[j]);
        qkv[j].row0 = fused_qkv ? j * qd : 0;
        qkv[j].rows = fused_qkv ? 3 * qd : qd;
    }
    for (int j = 0; j < 2; j++) {
        snprintf(gate_up[j].name, sizeof gate_up[j].name, "%s.%d.mlp.%s.weight", p, i,
                 j ? "up" : "gate");
        gate_up[j].row0 = 0;
        gate_up[j].rows = F;
    }
    if (weight_load_linear_stack(ws, &y->qkv, 3, qkv, qd, hidden, err) ||
        weight_load(ws, &y->attn_norm, SHAPE1(hidden), err, "%s.%d.attn_norm.weight", p, i) ||
        weight_load_linear(ws, &y->o, SHAPE2(hidden, qd), err, "%s.%d.attn.o.weight", p, i) ||
        weight_load(ws, &y->mlp_norm, SHAPE1(hidden), err, "%s.%d.mlp_norm.weight", p, i) ||
        weight_load_linear_stack(ws, &y->gate_up, 2, gate_up, F, hidden, err) ||
        weight_load_linear(ws, &y->down, SHAPE2(hidden, F), err, "%s.%d.mlp.down.weight", p, i))
        return AR_ERR;
    return AR_OK;
}

/* The image path's weights: gen.embed, the aligner behind it and the head. */
static int load_image_path(raster_model_t *m, weight_set_t *ws, ar_error_t *err) {
    const image_config_t *im = &m->cfg->image;
    const int64_t hidden = m->cfg->llm.hidden_size, K = im->codebook_size, G = im->head_hidden_size;
    /* Without an aligner an image token's embedding enters the LM as it is. */
    if (weight_load(ws, &m->gen_embed, SHAPE2(K, m->image_aligner ? im->embed_dim : hidden), err,
                    "gen.embed.weight"))
        return AR_ERR;
    for (int j = 0; m->image_aligner && j < im->aligner_layers; j++)
        if (weight_load_linear(ws, &m->aligner_w[j], SHAPE2(hidden, j ? hidden : im->embed_dim),
                               err, "gen.aligner.%d.weight", j) ||
            weight_load(ws, &m->aligner_b[j], SHAPE1(hidden), err, "gen.aligner.%d.bias", j))
            return AR_ERR;
    if (!m->head_mlp)
        return weight_load_linear(ws, &m->head_w, SHAPE2(K, hidden), err, "gen.head.weight")
                   ? AR_ERR
                   : AR_OK;
    if (weight_load_linear(ws, &m->head_fc1_w, SHAPE2(G, hidden), err, "gen.head.fc1.weight") ||
        weight_load(ws, &m->head_fc1_b, SHAPE1(G), err, "gen.head.fc1.bias") ||
        weight_load_linear(ws, &m->head_fc2_w, SHAPE2(K, G), err, "gen.head.fc2.weight") ||
        weight_load(ws, &m->head_fc2_b, SHAPE1(K), err, "gen.head.fc2.bias"))
        return AR_ERR;
    return AR_OK;
}

int raster_load(raster_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                ar_error_t *err) {
    memset(m, 0, sizeof *m);
    m->cfg = cfg;
    m->be = be;
    /* What the architecture switches, named once. LlamaGen's prefix is a
     * class: its table (num_classes + 1 rows, the last the null class)
     * stands where Janus's text embedding does. */
    const int llamagen = strcmp(cfg->architecture, "llamagen") == 0;
    const int class_prefix = llamagen, fused_qkv = llamagen;
    m->image_aligner = !llamagen;
    m->rope_2d = llamagen;
    m->head_mlp = !llamagen;
    const llm_config_t *l = &cfg->llm;
    const image_config_t *im = &cfg->image;
    if (im->aligner_layers > RASTER_MAX_ALIGNER)
        return ar_errorf(err, "image.aligner_layers %d exceeds %d", im->aligner_layers,
                         RASTER_MAX_ALIGNER);
    m->layers = calloc((size_t)l->num_layers, sizeof *m->layers);
    if (!m->layers)
        return ar_errorf(err, "out of memory");
    if (weight_load(ws, &m->embed, SHAPE2(l->vocab_size, l->hidden_size), err,
                    class_prefix ? "llm.class_embed.weight" : "llm.embed.weight") ||
        weight_load(ws, &m->norm, SHAPE1(l->hidden_size), err, "llm.norm.weight"))
        return AR_ERR;
    for (int i = 0; i < l->num_layers; i++)
        if (load_layer(m, ws, i, fused_qkv, err) != AR_OK)
            return AR_ERR;
    return load_image_path(m, ws, err);
}

static void workspace_free(raster_model_t *m) {
    backend_t *be = m->be;
    float **bufs[] = {&m->x,       &m->xn,   &m->qkv,  &m->att,   &m->tmp,
                      &m->gate_up, &m->last, &m->head, &m->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        be->free(be, *bufs[i]);
        *bufs[i] = NULL;
    }
    free(m->pos);
    m->pos = NULL;
    m->ws_rows = m->ws_seqs = 0;
}

static size_t tensor_bytes(const tensor_t *t) {
    return t->data ? (size_t)tensor_numel(t) * dtype_size(t->dtype) : 0;
}

/* The weights one image-token step reads whole (raster.h), summed as
 * bytes or as elements. */
static size_t step_weights(const raster_model_t *m, size_t (*measure)(const tensor_t *)) {
    size_t n = measure(&m->norm) + measure(&m->head_fc1_w) + measure(&m->head_fc1_b) +
               measure(&m->head_fc2_w) + measure(&m->head_fc2_b) + measure(&m->head_w);
    for (int i = 0; i < m->cfg->llm.num_layers; i++) {
        const raster_layer_t *y = &m->layers[i];
        const tensor_t *ts[] = {&y->attn_norm, &y->qkv, &y->o, &y->mlp_norm, &y->gate_up, &y->down};
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++)
            n += measure(ts[j]);
    }
    for (int j = 0; j < RASTER_MAX_ALIGNER; j++)
        n += measure(&m->aligner_w[j]) + measure(&m->aligner_b[j]);
    return n;
}

static size_t numel(const tensor_t *t) { return t->data ? (size_t)tensor_numel(t) : 0; }

size_t raster_step_weight_bytes(const raster_model_t *m) { return step_weights(m, tensor_bytes); }

size_t raster_step_weight_elems(const raster_model_t *m) { return step_weights(m, numel); }

void raster_free(raster_model_t *m) {
    if (!m->be)
        return;
    workspace_free(m);
    backend_t *be = m->be;
    be->weight_free(be, &m->embed);
    be->weight_free(be, &m->norm);
    for (int i = 0; m->layers && i < m->cfg->llm.num_layers; i++) {
        raster_layer_t *y = &m->layers[i];
        tensor_t *ts[] = {&y->attn_norm, &y->qkv, &y->o, &y->mlp_norm, &y->gate_up, &y->down};
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++)
            be->weight_free(be, ts[j]);
    }
    free(m->layers);
    be->weight_free(be, &m->gen_embed);
    for (int j = 0; j < RASTER_MAX_ALIGNER; j++) {
        be->weight_free(be, &m->aligner_w[j]);
        be->weight_free(be, &m->aligner_b[j]);
    }
    be->weight_free(be, &m->head_fc1_w);
    be->weight_free(be, &m->head_fc1_b);
    be->weight_free(be, &m->head_fc2_w);
    be->weight_free(be, &m->head_fc2_b);
    be->weight_free(be, &m->head_w);
    memset(m, 0, sizeof *m);
}

static int workspace_reserve(raster_model_t *m, int rows, int seqs, ar_error_t *err) {
    if (rows <= m->ws_rows && seqs <= m->ws_seqs)
        return AR_OK;
    if (rows < m->ws_rows)
        rows = m->ws_rows;
    if (seqs < m->ws_seqs)
        seqs = m->ws_seqs;
    workspace_free(m);
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    size_t hidden = (size_t)c->llm.hidden_size, qd = (size_t)c->llm.num_heads * c->llm.head_dim,
           F = (size_t)c->llm.intermediate_size, R = (size_t)rows, S = (size_t)seqs;
    size_t wide = hidden > (size_t)c->image.embed_dim ? hidden : (size_t)c->image.embed_dim;
    struct {
        float **p;
        size_t n;
    } plan[] = {{&m->x, R * hidden},
                {&m->xn, R * wide},
                {&m->qkv, 3 * R * qd},
                {&m->att, R * qd},
                {&m->tmp, R * hidden},
                {&m->gate_up, 2 * R * F},
                {&m->last, S * hidden},
                {&m->head, S * (size_t)(c->image.head_hidden_size ? c->image.head_hidden_size : 1)},
                {&m->logits, S * (size_t)c->image.codebook_size}};
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        *plan[i].p = be->alloc(be, plan[i].n * sizeof(float));
        if (!*plan[i].p) {
            workspace_free(m);
            return ar_errorf(err, "out of backend memory for a %d-row workspace", rows);
        }
    }
    m->pos = malloc(4 * R * sizeof *m->pos);
    if (!m->pos) {
        workspace_free(m);
        return ar_errorf(err, "out of memory");
    }
    m->ws_rows = rows;
    m->ws_seqs = seqs;
    return AR_OK;
}

/* The embeddings of n rows of ids (condition ids, or image ids) into dst. */
static void embed_rows(raster_model_t *m, float *dst, int is_image, const int *ids, int n) {
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    if (!is_image || !m->image_aligner) {
        be->embedding(be, dst, is_image ? &m->gen_embed : &m->embed, ids, n, 0);
        return;
    }
    /* gen.embed -> aligner (Linear, then GELU + Linear per further layer) */
    be->embedding(be, m->xn, &m->gen_embed, ids, n, 0);
    float *a = m->xn, *b = m->tmp;
    for (int j = 0; j < c->image.aligner_layers; j++) {
        if (j)
            be->gelu(be, a, (size_t)n * c->llm.hidden_size);
        float *out = j == c->image.aligner_layers - 1 ? dst : b;
        be->matmul(be, out, a, &m->aligner_w[j], &m->aligner_b[j], n);
        b = a;
        a = out;
    }
}

/* Writes the input embeddings of every row into m->x: each run of inputs of
 * one kind (condition or image ids; their rows are consecutive) in one
 * embedding and one aligner pass, so a decode step's cost in launches does
 * not grow with its batch. A row's bytes are the same either way (a
 * prepared Linear weight keeps rows independent). */
static void embed_inputs(raster_model_t *m, const raster_input_t *in, int n_in,
                         const int *q_start) {
    const size_t hidden = (size_t)m->cfg->llm.hidden_size;
    for (int s0 = 0, s1; s0 < n_in; s0 = s1) {
        for (s1 = s0 + 1; s1 < n_in && in[s1].is_image == in[s0].is_image; s1++)
            ;
        int *ids = s1 - s0 > 1
                       ? arena_alloc(m->arena, (size_t)(q_start[s1] - q_start[s0]) * sizeof *ids)
                       : NULL;
        if (!ids) /* one input, or no room for the run's ids: input by input */
            s1 = s0 + 1;
        for (int s = s0; ids && s < s1; s++)
            memcpy(ids + (q_start[s] - q_start[s0]), in[s].ids, (size_t)in[s].n * sizeof *ids);
        embed_rows(m, m->x + (size_t)q_start[s0] * hidden, in[s0].is_image, ids ? ids : in[s0].ids,
                   q_start[s1] - q_start[s0]);
    }
}

/* Every row's position in m->pos: its place in the sequence (1D RoPE), or
 * its (grid row, column) with rope_2d; then all of them again, for the k
 * rows that follow the q rows in one rope call. */
static void set_positions(raster_model_t *m, const raster_input_t *in, int n_in,
                          const int *q_start) {
    const int gw = m->cfg->image.grid_width, per_row = m->rope_2d ? 2 : 1;
    for (int s = 0; s < n_in; s++)
        for (int i = 0; i < in[s].n; i++) {
            int *p = m->pos + per_row * (q_start[s] + i);
            if (!m->rope_2d) {
                p[0] = in[s].seq->n_fed + i;
            } else if (in[s].is_image) {
                /* Image token t at grid (t / w, t % w); a class token gets a
                 * negative row: rope_2d zeroes its q and k, as LlamaGen's
                 * cache of zeros at the condition positions does. */
                const int t = in[s].image_index + i;
                p[0] = t / gw;
                p[1] = t % gw;
            } else {
                p[0] = -1;
                p[1] = 0;
            }
        }
    const size_t n = (size_t)per_row * q_start[n_in];
    memcpy(m->pos + n, m->pos, n * sizeof *m->pos);
}

/* Layer li over the pass's rows (m->x): attention, the rows' K and V
 * appended first, then the SwiGLU MLP. */
static int run_layer(raster_model_t *m, forward_t *f, int li, ar_error_t *err) {
    backend_t *be = m->be;
    const llm_config_t *l = &m->cfg->llm;
    const raster_layer_t *y = &m->layers[li];
    const int H = l->num_heads, hd = l->head_dim, hidden = l->hidden_size,
              rows = f->q_start[f->n_seq];
    /* The stacked weights' outputs, each a block of rows (backend.h's matmul). */
    const size_t qd = (size_t)H * hd, F = (size_t)l->intermediate_size;
    float *q = m->qkv, *k = q + rows * qd, *v = k + rows * qd;
    float *gate = m->gate_up, *up = gate + rows * F;
    forward_layer(f, li);
    be->rmsnorm(be, m->xn, m->x, &y->attn_norm, rows, hidden, l->norm_eps);
    be->matmul(be, m->qkv, m->xn, &y->qkv, NULL, rows);
    /* q's rows and k's, back to back, turned in one call (set_positions
     * lists the positions twice) */
    if (m->rope_2d)
        be->rope_2d(be, q, m->pos, 2 * rows, H, hd, l->rope_theta);
    else
        be->rope(be, q, m->pos, 2 * rows, H, hd, l->rope_theta);
    if (forward_store(f, li, k, v, err) != AR_OK)
        return AR_ERR;
    be->attention(be, m->att, q, &f->pool->blocks, &f->batch, H, 1.0f / sqrtf((float)hd));
    backend_matmul_add(be, m->x, m->att, &y->o, rows, m->tmp);
    be->rmsnorm(be, m->xn, m->x, &y->mlp_norm, rows, hidden, l->norm_eps);
    be->matmul(be, gate, m->xn, &y->gate_up, NULL, rows);
    be->silu_mul(be, gate, gate, up, (size_t)rows * F);
    backend_matmul_add(be, m->x, gate, &y->down, rows, m->tmp);
    return AR_OK;
}

int raster_forward(raster_model_t *m, const raster_input_t *in, int n_in, float *logits_host,
                   ar_error_t *err) {
    backend_t *be = m->be;
    const model_config_t *c = m->cfg;
    const llm_config_t *l = &c->llm;
    const int H = l->num_heads, hidden = l->hidden_size, K = c->image.codebook_size;
    if (n_in <= 0)
        return AR_OK;
    forward_t f = {
        .be = be, .arena = m->arena, .n_heads = H, .head_dim = l->head_dim, .attend_new = 1};
    int rc = AR_ERR;
    if (forward_begin(&f, n_in, err) != AR_OK)
        goto out;
    for (int s = 0; s < n_in; s++)
        if (forward_add(&f, s,
                        &(forward_seq_t){.seq = in[s].seq,
                                         .rows = in[s].n,
                                         .n_new = in[s].n,
                                         .n_fed = in[s].n,
                                         .collect_mass = in[s].collect_mass},
                        err) != AR_OK)
            goto out;
    const int *q_start = f.q_start, rows = q_start[n_in];
    if (workspace_reserve(m, rows, n_in, err) != AR_OK || forward_reserve(&f, err) != AR_OK)
        goto out;

    set_positions(m, in, n_in, q_start);
    embed_inputs(m, in, n_in, q_start);
    for (int li = 0; li < l->num_layers; li++)
        if (run_layer(m, &f, li, err) != AR_OK)
            goto out;
    forward_advance(&f);
    for (int s = 0; s < n_in; s++)
        be->copy(be, m->last + (size_t)s * hidden, m->x + (size_t)(q_start[s + 1] - 1) * hidden,
                 (size_t)hidden * sizeof(float));
    be->rmsnorm(be, m->last, m->last, &m->norm, n_in, hidden, l->norm_eps);
    if (m->head_mlp) {
        be->matmul(be, m->head, m->last, &m->head_fc1_w, &m->head_fc1_b, n_in);
        be->gelu(be, m->head, (size_t)n_in * c->image.head_hidden_size);
        be->matmul(be, m->logits, m->head, &m->head_fc2_w, &m->head_fc2_b, n_in);
    } else {
        be->matmul(be, m->logits, m->last, &m->head_w, NULL, n_in);
    }
    be->download(be, logits_host, m->logits, (size_t)n_in * K * sizeof(float));
    rc = AR_OK;
out:
    forward_end(&f);
    return rc;
}
