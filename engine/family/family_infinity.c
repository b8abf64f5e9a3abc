/* The infinity architecture of the scale family (Infinity, text-to-image
 * next-scale): a request's prompt goes through the T5 encoder once, and
 * each CFG row gets its conditioning (infinity.c) at its first step; each
 * step then runs one scale of both rows, samples every bit of every token
 * of the scale from its two guided logits, and adds the scale's codes into
 * the request's latent map on the host: codes (2 bit - 1) / sqrt(d),
 * L2-normalised, bilinearly upsampled to the last scale and summed; the
 * next scale's input is that sum bilinearly resized down to the next
 * scale. Infinity-8B's 2x2 patchify moves bits between the token map and
 * the VAE's latent (pixel shuffle). The BSQ-VAE decoder (vq_decoder.c,
 * "bsq") draws the sum. A request's tokens hold one value (0 or 1) per bit.
 * Its KV segments are the scales of its image size; the last scale is never
 * cached. */
#include "engine/family/family_infinity.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "engine/generate.h"
#include "engine/model_family.h"
#include "engine/policy/kv_calibration.h"

static const char *const infinity_architectures[] = {"infinity", NULL};

static void infinity_geometry(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g) {
    /* The text is read by cross-attention, never cached: no prefix. */
    (void)n_prompt;
    const image_size_t *z = &cfg->image.sizes[size];
    memset(g, 0, sizeof *g);
    g->step_unit = KV_STEP_SEGMENT;
    g->n_segments = z->n_scales;
    for (int i = 0; i < z->n_scales; i++)
        g->segment_tokens[i] = z->h[i] * z->w[i];
    g->n_layers = cfg->llm.num_layers;
    g->n_heads = cfg->llm.num_heads;
    g->calibration = kv_calibration_set_pick(cfg->kv_calibrations, z->name, g);
}

static int infinity_token_width(const model_config_t *cfg) { return cfg->image.bits; }

static void infinity_free(model_t *m) {
    infinity_net_t *net = m->net;
    if (!net)
        return;
    inf_free(&net->inf);
    vq_decoder_free(&net->dec);
    if (m->be)
        m->be->free(m->be, net->rows);
    free(net);
    m->net = NULL;
}

static int infinity_load(model_t *m, weight_set_t *ws, ar_error_t *err) {
    infinity_net_t *net = m->net = calloc(1, sizeof *net);
    if (!net)
        return ar_errorf(err, "out of memory");
    int rc = inf_load(&net->inf, &m->cfg, ws, m->be, err) ||
             vq_decoder_load(&net->dec, &m->cfg, ws, m->be, err);
    net->inf.arena = &m->arena;
    if (rc) {
        infinity_free(m);
        return AR_ERR;
    }
    return AR_OK;
}

/* Token offsets of each scale of size z (offs[n_scales] = every token). */
static void scale_offsets(const image_size_t *z, int *offs) {
    offs[0] = 0;
    for (int i = 0; i < z->n_scales; i++)
        offs[i + 1] = offs[i] + z->h[i] * z->w[i];
}

/* Bilinear resize (C, h, w) -> (C, H, W) as torch's interpolate with
 * align_corners=False and no antialiasing (Infinity's trilinear over a
 * one-frame volume): source (o + 0.5) * in / out - 0.5, clamped at 0. */
static void resize_bilinear(float *out, const float *in, int c, int h, int w, int H, int W) {
    const float sh = (float)h / (float)H, sw = (float)w / (float)W;
    for (int y = 0; y < H; y++) {
        float fy = sh * ((float)y + 0.5f) - 0.5f;
        fy = fy < 0 ? 0 : fy;
        const int y0 = (int)fy, y1 = y0 < h - 1 ? y0 + 1 : y0;
        const float ly1 = fy - (float)y0, ly0 = 1.0f - ly1;
        for (int x = 0; x < W; x++) {
            float fx = sw * ((float)x + 0.5f) - 0.5f;
            fx = fx < 0 ? 0 : fx;
            const int x0 = (int)fx, x1 = x0 < w - 1 ? x0 + 1 : x0;
            const float lx1 = fx - (float)x0, lx0 = 1.0f - lx1;
            for (int ch = 0; ch < c; ch++) {
                const float *p = in + (size_t)ch * h * w;
                out[((size_t)ch * H + y) * W + x] =
                    ly0 * (lx0 * p[y0 * w + x0] + lx1 * p[y0 * w + x1]) +
                    ly1 * (lx0 * p[y1 * w + x0] + lx1 * p[y1 * w + x1]);
            }
        }
    }
}

/* The codes of one scale's bits (h * w tokens of `bits` values) as the
 * VAE's latent channels (d, ph, pw): d = bits (ph = h) or, patchified,
 * d = bits / 4 at twice each side, transformer bit c*4 + a*2 + b of token
 * (i, j) becoming channel c at (2i + a, 2j + b). Each value (2 bit - 1) s,
 * s = 1 / sqrt(d), then each position's d values L2-normalised. */
static void scale_codes(const model_config_t *cfg, const int *bits_in, int h, int w, float *codes) {
    const int bits = cfg->image.bits, P = cfg->image.spatial_patchify ? 2 : 1;
    const int d = bits / (P * P), ph = h * P, pw = w * P;
    const float s = (float)(1.0 / sqrt((double)d));
    for (int i = 0; i < h; i++)
        for (int j = 0; j < w; j++)
            for (int k = 0; k < bits; k++) {
                const int c = k / (P * P), a = (k / P) % P, b = k % P;
                const float v = (float)bits_in[((size_t)i * w + j) * bits + k] * s * 2.0f - s;
                codes[((size_t)c * ph + (i * P + a)) * pw + (j * P + b)] = v;
            }
    for (int y = 0; y < ph * pw; y++) {
        float ss = 0;
        for (int c = 0; c < d; c++)
            ss += codes[(size_t)c * ph * pw + y] * codes[(size_t)c * ph * pw + y];
        const float n = fmaxf(sqrtf(ss), 1e-12f);
        for (int c = 0; c < d; c++)
            codes[(size_t)c * ph * pw + y] /= n;
    }
}

size_t infinity_latent_floats(const model_config_t *cfg) {
    size_t h, w;
    vq_largest_latent(cfg, &h, &w);
    return (size_t)cfg->decoder.latent_channels * h * w;
}

int infinity_latent(const model_config_t *cfg, int size, const int *bits, int n_scales, float *fhat,
                    ar_error_t *err) {
    const image_config_t *im = &cfg->image;
    if (size < 0 || size >= im->n_sizes)
        return ar_errorf(err, "image size %d is out of range", size);
    const image_size_t *z = &im->sizes[size];
    const int P = im->spatial_patchify ? 2 : 1, d = cfg->decoder.latent_channels;
    const int S = z->n_scales, H = z->h[S - 1] * P, W = z->w[S - 1] * P;
    if (n_scales < 0 || n_scales > S)
        return ar_errorf(err, "%d scales: the size has %d", n_scales, S);
    int offs[MODEL_MAX_SCALES + 1];
    scale_offsets(z, offs);
    float *codes = malloc((size_t)d * H * W * sizeof *codes);
    float *up = malloc((size_t)d * H * W * sizeof *up);
    if (!codes || !up) {
        free(codes);
        free(up);
        return ar_errorf(err, "out of memory for the latent map");
    }
    memset(fhat, 0, (size_t)d * H * W * sizeof *fhat);
    for (int si = 0; si < n_scales; si++) {
        const int h = z->h[si], w = z->w[si];
        for (size_t t = (size_t)offs[si] * im->bits; t < (size_t)offs[si + 1] * im->bits; t++)
            if (bits[t] != 0 && bits[t] != 1) {
                free(codes);
                free(up);
                return ar_errorf(err, "bit %zu is %d, not 0 or 1", t, bits[t]);
            }
        scale_codes(cfg, bits + (size_t)offs[si] * im->bits, h, w, codes);
        const float *add = codes;
        if (si != S - 1) {
            resize_bilinear(up, codes, d, h * P, w * P, H, W);
            add = up;
        }
        for (size_t k = 0; k < (size_t)d * H * W; k++)
            fhat[k] += add[k];
    }
    free(codes);
    free(up);
    return AR_OK;
}

int infinity_next_input(const model_config_t *cfg, int size, const float *fhat, int si, float *rows,
                        ar_error_t *err) {
    const image_config_t *im = &cfg->image;
    const image_size_t *z = &im->sizes[size];
    const int P = im->spatial_patchify ? 2 : 1, d = cfg->decoder.latent_channels;
    const int S = z->n_scales, H = z->h[S - 1] * P, W = z->w[S - 1] * P;
    const int h = z->h[si], w = z->w[si];
    float *map = malloc((size_t)d * h * P * w * P * sizeof *map);
    if (!map)
        return ar_errorf(err, "out of memory");
    resize_bilinear(map, fhat, d, H, W, h * P, w * P);
    /* Rows of the token map, bit c*4 + a*2 + b from channel c at (2i + a, 2j + b). */
    for (int i = 0; i < h; i++)
        for (int j = 0; j < w; j++)
            for (int k = 0; k < im->bits; k++) {
                const int c = k / (P * P), a = (k / P) % P, b = k % P;
                rows[((size_t)i * w + j) * im->bits + k] =
                    map[((size_t)c * h * P + (i * P + a)) * w * P + (j * P + b)];
            }
    free(map);
    return AR_OK;
}

int infinity_sample_bit(const float *lc, const float *lu, float cfg, float tau, int top_k,
                        float top_p, double u) {
    float l[2];
    for (int v = 0; v < 2; v++)
        l[v] = lu ? cfg * (lc[v] / tau) + (1.0f - cfg) * (lu[v] / tau) : lc[v] / tau;
    if (top_k == 1 || !(tau > 0))
        return l[1] > l[0];
    /* Top-p as the reference: sorted ascending, the low value is dropped
     * when its probability is at most 1 - top_p. */
    const float mx = fmaxf(l[0], l[1]);
    const double e0 = exp((double)l[0] - mx), e1 = exp((double)l[1] - mx);
    double p0 = e0 / (e0 + e1);
    if (top_p > 0 && top_p < 1) {
        const int lo = l[1] < l[0]; /* the value sorted first */
        const double p_lo = lo ? 1.0 - p0 : p0;
        if (p_lo <= 1.0 - top_p)
            p0 = lo ? 1.0 : 0.0;
    }
    return u < p0 ? 0 : 1;
}

/* The step's buffers: next-scale inputs of every request (backend). */
static int rows_reserve(model_t *m, size_t floats, ar_error_t *err) {
    infinity_net_t *net = m->net;
    if (floats <= net->rows_cap)
        return AR_OK;
    m->be->free(m->be, net->rows);
    if (!(net->rows = m->be->alloc(m->be, floats * sizeof(float)))) {
        net->rows_cap = 0;
        return ar_errorf(err, "out of backend memory for the next scales' inputs");
    }
    net->rows_cap = floats;
    return AR_OK;
}

/* The text rows of a request's sequence j: the prompt's, then the negative
 * prompt's or (without one) as many learned unconditional rows. */
static int text_rows(const gen_request_t *r, int j) {
    return j == 1 && r->n_neg ? r->n_neg : r->n_prompt;
}

/* Each row's conditioning at the request's first step: T5 over the prompt
 * for the conditional row; for the other, T5 over the negative prompt, or
 * the learned unconditional rows cfg_uncond[:n_prompt]. */
static int condition_request(model_t *m, gen_request_t *r, ar_error_t *err) {
    infinity_net_t *net = m->net;
    backend_t *be = m->be;
    const size_t n = inf_cond_floats(&net->inf);
    const int longest = r->n_neg > r->n_prompt ? r->n_neg : r->n_prompt;
    for (int j = 0; j < 2; j++)
        if (!r->cond_table[j] && !(r->cond_table[j] = be->alloc(be, n * sizeof(float))))
            return ar_errorf(err, "out of backend memory for a prompt's conditioning");
    float *text = be->alloc(be, (size_t)longest * m->cfg.text.hidden_size * sizeof(float));
    if (!text)
        return ar_errorf(err, "out of backend memory for the text encoder's output");
    int rc = inf_t5_encode(&net->inf, r->cond_ids, r->n_prompt, text, err) ||
             inf_condition(&net->inf, r->cond_table[0], text, r->n_prompt, err);
    if (!rc && r->n_neg)
        rc = inf_t5_encode(&net->inf, r->neg_ids, r->n_neg, text, err) ||
             inf_condition(&net->inf, r->cond_table[1], text, r->n_neg, err);
    else if (!rc)
        rc = inf_condition(&net->inf, r->cond_table[1], NULL, r->n_prompt, err);
    be->free(be, text);
    return rc ? AR_ERR : AR_OK;
}

static int infinity_step(model_t *m, gen_request_t *const *reqs, int n, ar_error_t *err) {
    infinity_net_t *net = m->net;
    if (n <= 0)
        return AR_OK;
    backend_t *be = m->be;
    const model_config_t *c = &m->cfg;
    const int bits = c->image.bits, V = 2 * bits;
    arena_t *a = &m->arena;
    arena_begin(a);
    inf_input_t *in = arena_calloc(a, (size_t)2 * n, sizeof *in);
    size_t rows = 0, in_floats = 0;
    float *logits = NULL, *fhat = NULL, *host_rows = NULL;
    int rc = AR_ERR;
    if (!in) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        const int si = reqs[i]->step;
        const image_size_t *z = &c->image.sizes[reqs[i]->size];
        rows += (size_t)2 * z->h[si] * z->w[si];
        if (si > 0)
            in_floats += (size_t)z->h[si] * z->w[si] * bits;
        if (si == 0 && condition_request(m, reqs[i], err) != AR_OK)
            goto out;
    }
    if (!(logits = arena_alloc(a, rows * V * sizeof *logits)) ||
        !(fhat = arena_alloc(a, infinity_latent_floats(c) * sizeof *fhat)) ||
        !(host_rows = arena_alloc(a, (in_floats ? in_floats : 1) * sizeof *host_rows))) {
        ar_errorf(err, "out of memory for %zu rows of logits", rows);
        goto out;
    }
    if (rows_reserve(m, in_floats ? in_floats : 1, err) != AR_OK)
        goto out;
    size_t at_in = 0;
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        const int si = r->step, size = r->size;
        const image_size_t *z = &c->image.sizes[size];
        const float *dev_rows = NULL;
        if (si > 0) {
            if (infinity_latent(c, size, r->tokens, si, fhat, err) != AR_OK ||
                infinity_next_input(c, size, fhat, si, host_rows + at_in, err) != AR_OK)
                goto out;
            const size_t nf = (size_t)z->h[si] * z->w[si] * bits;
            be->upload(be, net->rows + at_in, host_rows + at_in, nf * sizeof(float));
            dev_rows = net->rows + at_in;
            at_in += nf;
        }
        for (int j = 0; j < 2; j++)
            in[2 * i + j] = (inf_input_t){
                .seq = &r->seq[j],
                .size = size,
                .scale = si,
                .rows = dev_rows,
                .cond = r->cond_table[j],
                .n_text = text_rows(r, j),
                .cache = si < z->n_scales - 1,
                .collect_mass = r->collect[j],
                .policy = r->policy_state[j],
                .peak_blocks = kv_policy_layered(r->policy_state[j]) ? &r->kv_peak_blocks : NULL,
            };
    }
    if (inf_forward(&net->inf, in, 2 * n, logits, err) != AR_OK)
        goto out;
    const float *row = logits;
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        const image_size_t *z = &c->image.sizes[r->size];
        const int si = r->step, pp = z->h[si] * z->w[si];
        int offs[MODEL_MAX_SCALES + 1];
        scale_offsets(z, offs);
        if (r->forced && gen_request_keep_logits(r, row, (size_t)2 * pp * V, err) != AR_OK)
            goto out;
        const sampler_params_t *p = &r->params;
        for (int t = 0; t < pp; t++)
            for (int b = 0; b < bits; b++) {
                /* Bit b of token t of the scale: its place in the whole image. */
                const size_t place = (size_t)(offs[si] + t) * bits + b;
                const float *cond = row + (size_t)t * V + 2 * b,
                            *uncond = row + (size_t)(pp + t) * V + 2 * b;
                r->tokens[place] =
                    r->forced
                        ? r->forced[place]
                        : infinity_sample_bit(cond, uncond, p->cfg, p->temperature, p->top_k,
                                              p->top_p, rng_uniform(r->seed, r->stream, place));
            }
        row += (size_t)2 * pp * V;
    }
    rc = AR_OK;
out:
    arena_end(a);
    return rc;
}

static int infinity_draw(const model_t *m, vq_work_t *vw, const int *tokens, int size, int n_done,
                         uint8_t *rgb, ar_error_t *err) {
    const infinity_net_t *net = m->net;
    const model_config_t *c = &m->cfg;
    const int P = c->image.spatial_patchify ? 2 : 1;
    if (size < 0 || size >= c->image.n_sizes)
        return ar_errorf(err, "image size %d: the model has %d", size, c->image.n_sizes);
    const image_size_t *z = &c->image.sizes[size];
    const int S = z->n_scales, n_scales = n_done < 0 ? 0 : n_done > S ? S : n_done;
    const int h = z->h[S - 1] * P, w = z->w[S - 1] * P;
    const size_t n = (size_t)c->decoder.latent_channels * h * w;
    float *fhat = malloc(n * sizeof *fhat);
    if (!fhat)
        return ar_errorf(err, "out of memory");
    int rc = infinity_latent(c, size, tokens, n_scales, fhat, err);
    if (rc == AR_OK) {
        vw->be->upload(vw->be, vw->latent, fhat, n * sizeof *fhat);
        rc = vq_decode_latent_hw(&net->dec, vw, vw->latent, h, w, rgb, NULL, err);
    }
    free(fhat);
    return rc;
}

static size_t infinity_draw_bytes(const model_t *m, size_t *n_buffers) {
    return vq_work_bytes(&((const infinity_net_t *)m->net)->dec, n_buffers);
}

static struct vq_work *infinity_draw_work_new(const model_t *m, backend_t *be, ar_error_t *err) {
    return vq_work_new(&((const infinity_net_t *)m->net)->dec, be, err);
}

const model_family_t model_family_infinity = {
    .name = "scale",
    .architectures = infinity_architectures,
    .segment_name = "scale",
    .models_name = "next-scale",
    .geometry = infinity_geometry,
    .token_width = infinity_token_width,
    .load = infinity_load,
    .free = infinity_free,
    .step = infinity_step,
    .draw = infinity_draw,
    .draw_bytes = infinity_draw_bytes,
    .draw_work_new = infinity_draw_work_new,
    .draw_work_free = vq_work_delete,
};
