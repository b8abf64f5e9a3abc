/* VQ-16 decoder (the architecture shared by Janus-Pro and LlamaGen) on any
 * backend; names follow docs/model-format.md. */
#include "engine/family/vq_decoder.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GN_GROUPS 32
#define GN_EPS 1e-6f

static int load_conv(weight_set_t *ws, tensor_t *w, tensor_t *b, int c_out, int c_in, int k,
                     ar_error_t *err, const char *name) {
    return weight_load_conv(ws, w, SHAPE4(c_out, c_in, k, k), err, "%s.weight", name) ||
                   weight_load(ws, b, SHAPE1(c_out), err, "%s.bias", name)
               ? AR_ERR
               : AR_OK;
}

static int load_norm(weight_set_t *ws, tensor_t *w, tensor_t *b, int c, ar_error_t *err,
                     const char *name) {
    return weight_load(ws, w, SHAPE1(c), err, "%s.weight", name) ||
                   weight_load(ws, b, SHAPE1(c), err, "%s.bias", name)
               ? AR_ERR
               : AR_OK;
}

static int load_resblock(weight_set_t *ws, vq_resblock_t *r, int c_in, int c_out, ar_error_t *err,
                         const char *prefix) {
    char n[256];
    r->c_in = c_in;
    r->c_out = c_out;
#define SUB(s) (snprintf(n, sizeof n, "%s." s, prefix), n)
    if (load_norm(ws, &r->norm1_w, &r->norm1_b, c_in, err, SUB("norm1")) ||
        load_conv(ws, &r->conv1_w, &r->conv1_b, c_out, c_in, 3, err, SUB("conv1")) ||
        load_norm(ws, &r->norm2_w, &r->norm2_b, c_out, err, SUB("norm2")) ||
        load_conv(ws, &r->conv2_w, &r->conv2_b, c_out, c_out, 3, err, SUB("conv2")))
        return AR_ERR;
    if (c_in != c_out &&
        load_conv(ws, &r->nin_w, &r->nin_b, c_out, c_in, 1, err, SUB("nin_shortcut")))
        return AR_ERR;
    return AR_OK;
}

static int load_attn(weight_set_t *ws, vq_attnblock_t *a, int c, ar_error_t *err,
                     const char *prefix) {
    char n[256];
    a->c = c;
    return load_norm(ws, &a->norm_w, &a->norm_b, c, err, SUB("norm")) ||
                   load_conv(ws, &a->q_w, &a->q_b, c, c, 1, err, SUB("q")) ||
                   load_conv(ws, &a->k_w, &a->k_b, c, c, 1, err, SUB("k")) ||
                   load_conv(ws, &a->v_w, &a->v_b, c, c, 1, err, SUB("v")) ||
                   load_conv(ws, &a->proj_w, &a->proj_b, c, c, 1, err, SUB("proj_out"))
               ? AR_ERR
               : AR_OK;
#undef SUB
}

/* Level i is applied i-th (coarsest first) and has the width of
 * channel_multiplier[n - 1 - i]. */
static int level_width(const decoder_config_t *dc, int i) {
    return dc->base_channels * dc->channel_multiplier[dc->n_levels - 1 - i];
}

int vq_decoder_load(vq_decoder_t *d, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                    ar_error_t *err) {
    memset(d, 0, sizeof *d);
    d->cfg = cfg;
    d->be = be;
    const decoder_config_t *dc = &cfg->decoder;
    int E = cfg->image.embed_dim, lat = dc->latent_channels, c = level_width(dc, 0);
    d->n_levels = dc->n_levels;
    /* bsq (Infinity): the latent goes straight to conv_in; no attention. */
    d->bsq = strcmp(dc->type, "bsq") == 0;
    if ((!d->bsq && (weight_load(ws, &d->codebook, SHAPE2(cfg->image.codebook_size, E), err,
                                 "vq.codebook.weight") ||
                     load_conv(ws, &d->pq_w, &d->pq_b, lat, E, vq_post_quant_kernel(cfg), err,
                               "vq.post_quant_conv"))) ||
        load_conv(ws, &d->conv_in_w, &d->conv_in_b, c, lat, 3, err, "vq.decoder.conv_in") ||
        load_resblock(ws, &d->mid1, c, c, err, "vq.decoder.mid.block_1") ||
        (!d->bsq && load_attn(ws, &d->mid_attn, c, err, "vq.decoder.mid.attn_1")) ||
        load_resblock(ws, &d->mid2, c, c, err, "vq.decoder.mid.block_2"))
        return AR_ERR;
    for (int i = 0; i < d->n_levels; i++) {
        vq_level_t *lv = &d->levels[i];
        int c_out = level_width(dc, i);
        lv->n_blocks = dc->num_res_blocks + 1;
        lv->n_attn = i == 0 && !d->bsq ? lv->n_blocks : 0;
        lv->blocks = calloc((size_t)lv->n_blocks, sizeof *lv->blocks);
        lv->attn = lv->n_attn ? calloc((size_t)lv->n_attn, sizeof *lv->attn) : NULL;
        if (!lv->blocks || (lv->n_attn && !lv->attn))
            return ar_errorf(err, "out of memory");
        for (int j = 0; j < lv->n_blocks; j++) {
            char n[128];
            snprintf(n, sizeof n, "vq.decoder.up.%d.block.%d", i, j);
            if (load_resblock(ws, &lv->blocks[j], c, c_out, err, n))
                return AR_ERR;
            c = c_out;
            if (j < lv->n_attn) {
                snprintf(n, sizeof n, "vq.decoder.up.%d.attn.%d", i, j);
                if (load_attn(ws, &lv->attn[j], c, err, n))
                    return AR_ERR;
            }
        }
        lv->has_upsample = i != d->n_levels - 1;
        if (lv->has_upsample) {
            char n[128];
            snprintf(n, sizeof n, "vq.decoder.up.%d.upsample.conv", i);
            if (load_conv(ws, &lv->up_w, &lv->up_b, c, c, 3, err, n))
                return AR_ERR;
        }
    }
    if (load_norm(ws, &d->norm_out_w, &d->norm_out_b, c, err, "vq.decoder.norm_out") ||
        load_conv(ws, &d->conv_out_w, &d->conv_out_b, dc->out_channels, c, 3, err,
                  "vq.decoder.conv_out"))
        return AR_ERR;
    return AR_OK;
}

static void free_tensors(backend_t *be, tensor_t *first, size_t n) {
    for (size_t i = 0; i < n; i++)
        be->weight_free(be, &first[i]);
}

static void free_resblock(backend_t *be, vq_resblock_t *r) {
    free_tensors(be, &r->norm1_w, (size_t)(&r->nin_b - &r->norm1_w) + 1);
}

static void free_attn(backend_t *be, vq_attnblock_t *a) {
    free_tensors(be, &a->norm_w, (size_t)(&a->proj_b - &a->norm_w) + 1);
}

void vq_decoder_free(vq_decoder_t *d) {
    backend_t *be = d->be;
    if (!be)
        return;
    free_tensors(be, &d->codebook, 5);
    free_resblock(be, &d->mid1);
    free_resblock(be, &d->mid2);
    free_attn(be, &d->mid_attn);
    for (int i = 0; i < d->n_levels; i++) {
        vq_level_t *lv = &d->levels[i];
        for (int j = 0; lv->blocks && j < lv->n_blocks; j++)
            free_resblock(be, &lv->blocks[j]);
        for (int j = 0; lv->attn && j < lv->n_attn; j++)
            free_attn(be, &lv->attn[j]);
        free(lv->blocks);
        free(lv->attn);
        be->weight_free(be, &lv->up_w);
        be->weight_free(be, &lv->up_b);
    }
    free_tensors(be, &d->norm_out_w, 4);
    memset(d, 0, sizeof *d);
}

/* x (c_in, h, w) -> out (c_out, h, w); x is preserved. */
static void resblock(backend_t *be, const vq_resblock_t *r, float *out, const float *x, int h,
                     int w, const vq_work_t *s) {
    size_t hw = (size_t)h * w;
    be->groupnorm(be, s->t1, x, &r->norm1_w, &r->norm1_b, r->c_in, (int)hw, GN_GROUPS, GN_EPS, 1);
    be->conv2d(be, s->t2, s->t1, &r->conv1_w, &r->conv1_b, r->c_in, h, w, 1);
    be->groupnorm(be, s->t2, s->t2, &r->norm2_w, &r->norm2_b, r->c_out, (int)hw, GN_GROUPS, GN_EPS,
                  1);
    be->conv2d(be, out, s->t2, &r->conv2_w, &r->conv2_b, r->c_out, h, w, 1);
    if (r->c_in != r->c_out) {
        be->conv2d(be, s->t1, x, &r->nin_w, &r->nin_b, r->c_in, h, w, 0);
        be->add(be, out, s->t1, (size_t)r->c_out * hw);
    } else {
        be->add(be, out, x, (size_t)r->c_out * hw);
    }
}

/* Single-head self-attention over the h*w positions, in place on x. */
static void attnblock(backend_t *be, const vq_attnblock_t *a, float *x, int h, int w,
                      const vq_work_t *s) {
    int c = a->c, hw = h * w;
    be->groupnorm(be, s->t1, x, &a->norm_w, &a->norm_b, c, hw, GN_GROUPS, GN_EPS, 0);
    be->conv2d(be, s->t2, s->t1, &a->q_w, &a->q_b, c, h, w, 0);
    be->transpose(be, s->q, s->t2, c, hw); /* (hw, c) */
    be->conv2d(be, s->t2, s->t1, &a->k_w, &a->k_b, c, h, w, 0);
    be->transpose(be, s->k, s->t2, c, hw);                     /* (hw, c) */
    be->conv2d(be, s->v, s->t1, &a->v_w, &a->v_b, c, h, w, 0); /* (c, hw) */
    tensor_t kt = {.data = s->k, .dtype = DTYPE_F32, .ndim = 2, .shape = {hw, c}},
             vt = {.data = s->v, .dtype = DTYPE_F32, .ndim = 2, .shape = {c, hw}};
    be->matmul(be, s->scores, s->q, &kt, NULL, hw); /* (hw_q, hw_k) */
    be->scale(be, s->scores, (size_t)hw * hw, 1.0f / sqrtf((float)c));
    be->softmax(be, s->scores, hw, hw);
    be->matmul(be, s->q, s->scores, &vt, NULL, hw); /* (hw, c) */
    be->transpose(be, s->t2, s->q, hw, c);          /* (c, hw) */
    be->conv2d(be, s->t1, s->t2, &a->proj_w, &a->proj_b, c, h, w, 0);
    be->add(be, x, s->t1, (size_t)c * hw);
}

uint8_t vq_pixel_to_u8(float x, vq_pixels_t mode) {
    float p = mode == VQ_PIXELS_ROUND ? 127.5f * x + 128.0f : (x + 1.0f) / 2.0f * 255.0f;
    if (!(p > 0.0f))
        return 0; /* also NaN */
    if (p >= 255.0f)
        return 255;
    return (uint8_t)p;
}

int vq_post_quant_kernel(const model_config_t *cfg) {
    return strcmp(cfg->decoder.type, "msvq") == 0 ? 3 : 1;
}

/* The largest activation, in floats: the widest channel count at each
 * level's size, the latent and the grid's widest map. */
static size_t largest_activation(const vq_decoder_t *d) {
    const model_config_t *cfg = d->cfg;
    const decoder_config_t *dc = &cfg->decoder;
    size_t h, w;
    vq_largest_latent(cfg, &h, &w);
    size_t cmax = (size_t)dc->latent_channels, act = 0;
    for (int i = 0; i < d->n_levels; i++) {
        size_t ci = (size_t)level_width(dc, i), prev = i ? (size_t)level_width(dc, i - 1) : ci;
        size_t ci_max = ci > prev ? ci : prev;
        size_t sz = ci_max * (h << i) * (w << i);
        if (sz > act)
            act = sz;
        if (ci_max > cmax)
            cmax = ci_max;
    }
    if (cmax < (size_t)cfg->image.embed_dim)
        cmax = (size_t)cfg->image.embed_dim;
    return act > cmax * h * w ? act : cmax * h * w;
}

/* The sizes vq_work_init allocates, in floats (host: the output). */
typedef struct work_sizes {
    size_t act, rows, scores, host, grid;
} work_sizes_t;

static work_sizes_t work_sizes(const vq_decoder_t *d) {
    const model_config_t *cfg = d->cfg;
    size_t h, w;
    vq_largest_latent(cfg, &h, &w);
    const size_t grid = h * w, up = (size_t)1 << (cfg->decoder.n_levels - 1);
    return (work_sizes_t){.act = largest_activation(d),
                          .rows = grid * cfg->image.embed_dim,
                          .scores = d->bsq ? 1 : grid * grid,
                          .host = (size_t)3 * grid * up * up,
                          .grid = grid};
}

void vq_largest_latent(const model_config_t *cfg, size_t *h, size_t *w) {
    const image_config_t *im = &cfg->image;
    const size_t up = im->spatial_patchify ? 2 : 1;
    *h = (size_t)im->grid_height;
    *w = (size_t)im->grid_width;
    for (int i = 0; i < im->n_sizes; i++) {
        const image_size_t *z = &im->sizes[i];
        const size_t zh = (size_t)z->h[z->n_scales - 1] * up,
                     zw = (size_t)z->w[z->n_scales - 1] * up;
        if (zh * zw > *h * *w) {
            *h = zh;
            *w = zw;
        }
    }
}

/* Seven activations, two token maps and the attention matrix. */
#define WORK_BUFFERS 10

size_t vq_work_bytes(const vq_decoder_t *d, size_t *n_buffers) {
    const work_sizes_t z = work_sizes(d);
    if (n_buffers)
        *n_buffers = WORK_BUFFERS;
    return (7 * z.act + 2 * z.rows + z.scores) * sizeof(float);
}

int vq_work_init(vq_work_t *w, const vq_decoder_t *d, backend_t *be, ar_error_t *err) {
    const work_sizes_t z = work_sizes(d);
    memset(w, 0, sizeof *w);
    w->be = be;
    w->positions = z.grid;
    float **bufs[WORK_BUFFERS] = {&w->a, &w->b, &w->t1,   &w->t2,     &w->q,
                                  &w->k, &w->v, &w->rows, &w->latent, &w->scores};
    int ok = 1;
    for (size_t i = 0; i < WORK_BUFFERS; i++) {
        const size_t n = i < 7 ? z.act : i < 9 ? z.rows : z.scores;
        ok &= (*bufs[i] = be->alloc(be, n * sizeof(float))) != NULL;
    }
    ok &= (w->host = malloc(z.host * sizeof(float))) != NULL;
    if (!ok) {
        vq_work_free(w);
        return ar_errorf(err,
                         "out of memory for the image decoder's buffers (%.1f MiB on the %s "
                         "backend)",
                         vq_work_bytes(d, NULL) / 1048576.0, be->name);
    }
    return AR_OK;
}

void vq_work_free(vq_work_t *w) {
    backend_t *be = w->be;
    if (be) {
        float *bufs[WORK_BUFFERS] = {w->a, w->b, w->t1,   w->t2,     w->q,
                                     w->k, w->v, w->rows, w->latent, w->scores};
        for (size_t i = 0; i < WORK_BUFFERS; i++)
            be->free(be, bufs[i]);
    }
    free(w->host);
    memset(w, 0, sizeof *w);
}

vq_work_t *vq_work_new(const vq_decoder_t *d, backend_t *be, ar_error_t *err) {
    vq_work_t *w = calloc(1, sizeof *w);
    if (!w) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    if (vq_work_init(w, d, be, err) != AR_OK) {
        free(w);
        return NULL;
    }
    return w;
}

void vq_work_delete(vq_work_t *w) {
    if (!w)
        return;
    vq_work_free(w);
    free(w);
}

int vq_decode(const vq_decoder_t *d, vq_work_t *w, const int *tokens, uint8_t *rgb,
              float *pixels_f32, ar_error_t *err) {
    backend_t *be = w->be;
    const model_config_t *cfg = d->cfg;
    const int n = cfg->image.grid_height * cfg->image.grid_width, E = cfg->image.embed_dim;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= cfg->image.codebook_size)
            return ar_errorf(err, "image token %d at position %d is outside the codebook (%d)",
                             tokens[i], i, cfg->image.codebook_size);
    /* Codebook rows, L2-normalised, as (E, h*w). */
    be->embedding(be, w->rows, &d->codebook, tokens, n, 1);
    be->transpose(be, w->latent, w->rows, n, E);
    return vq_decode_latent(d, w, w->latent, rgb, pixels_f32, err);
}

int vq_decode_latent(const vq_decoder_t *d, vq_work_t *s, const float *latent, uint8_t *rgb,
                     float *pixels_f32, ar_error_t *err) {
    return vq_decode_latent_hw(d, s, latent, d->cfg->image.grid_height, d->cfg->image.grid_width,
                               rgb, pixels_f32, err);
}

int vq_decode_latent_hw(const vq_decoder_t *d, vq_work_t *s, const float *latent, int h, int w,
                        uint8_t *rgb, float *pixels_f32, ar_error_t *err) {
    backend_t *be = s->be;
    const model_config_t *cfg = d->cfg;
    const decoder_config_t *dc = &cfg->decoder;
    const int E = cfg->image.embed_dim;
    const int H = h << (dc->n_levels - 1), W = w << (dc->n_levels - 1);
    const int k = vq_post_quant_kernel(cfg);
    if (h < 1 || w < 1 || (size_t)h * (size_t)w > s->positions)
        return ar_errorf(err,
                         "image decoder: a %dx%d latent is larger than its buffers hold (%zu "
                         "positions, the largest size's)",
                         h, w, s->positions);
    if (d->bsq) {
        be->conv2d(be, s->a, latent, &d->conv_in_w, &d->conv_in_b, dc->latent_channels, h, w, 1);
    } else {
        be->conv2d(be, s->t1, latent, &d->pq_w, &d->pq_b, E, h, w, k / 2);
        be->conv2d(be, s->a, s->t1, &d->conv_in_w, &d->conv_in_b, dc->latent_channels, h, w, 1);
    }
    resblock(be, &d->mid1, s->b, s->a, h, w, s);
    if (!d->bsq)
        attnblock(be, &d->mid_attn, s->b, h, w, s);
    resblock(be, &d->mid2, s->a, s->b, h, w, s);
    float *cur = s->a, *other = s->b;
    for (int i = 0; i < d->n_levels; i++) {
        const vq_level_t *lv = &d->levels[i];
        for (int j = 0; j < lv->n_blocks; j++) {
            resblock(be, &lv->blocks[j], other, cur, h, w, s);
            float *t = cur;
            cur = other;
            other = t;
            if (j < lv->n_attn)
                attnblock(be, &lv->attn[j], cur, h, w, s);
        }
        if (lv->has_upsample) {
            int c = lv->blocks[lv->n_blocks - 1].c_out;
            be->upsample_nearest2x(be, other, cur, c, h, w);
            h *= 2;
            w *= 2;
            be->conv2d(be, cur, other, &lv->up_w, &lv->up_b, c, h, w, 1);
        }
    }
    int c_last = d->levels[d->n_levels - 1].blocks[d->levels[d->n_levels - 1].n_blocks - 1].c_out;
    be->groupnorm(be, other, cur, &d->norm_out_w, &d->norm_out_b, c_last, h * w, GN_GROUPS, GN_EPS,
                  1);
    be->conv2d(be, cur, other, &d->conv_out_w, &d->conv_out_b, c_last, h, w, 1);
    be->download(be, s->host, cur, (size_t)3 * H * W * sizeof(float));
    if (backend_status(be, err) != AR_OK)
        return ar_error_prefix(err, "image decoding on the %s backend", be->name);
    if (pixels_f32)
        memcpy(pixels_f32, s->host, (size_t)3 * H * W * sizeof(float));
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int ch = 0; ch < 3; ch++)
                rgb[((size_t)y * W + x) * 3 + ch] =
                    vq_pixel_to_u8(s->host[((size_t)ch * H + y) * W + x], dc->pixels);
    return AR_OK;
}
