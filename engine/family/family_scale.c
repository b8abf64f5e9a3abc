/* The scale (next-scale) family: VAR's transformer (var.c) produces a whole
 * scale of tokens per step; the tokens of each finished scale are looked
 * up in the VQVAE codebook, upsampled (bicubic) to the last scale's size,
 * passed through the nearest shared Phi and added into the latent map
 * f_hat; the next scale's input is f_hat area-downsampled to its size; the
 * VQVAE decoder (vq_decoder.c, "msvq") draws f_hat. Its KV segments are the
 * scales; the last scale is never cached (kv_policy.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/family/family_scale.h"
#include "engine/generate.h"
#include "engine/model_family.h"
#include "engine/policy/kv_calibration.h"

static const char *const scale_architectures[] = {"var", NULL};

static void scale_geometry(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g) {
    /* The class is a condition, not a cached prefix: nothing before scale 0. */
    (void)n_prompt, (void)size; /* VAR has one size */
    memset(g, 0, sizeof *g);
    g->n_prompt = 0;
    g->step_unit = KV_STEP_SEGMENT;
    g->n_segments = cfg->image.n_scales;
    for (int i = 0; i < cfg->image.n_scales; i++)
        g->segment_tokens[i] = cfg->image.scales[i] * cfg->image.scales[i];
    g->n_layers = cfg->llm.num_layers;
    g->n_heads = cfg->llm.num_heads;
    g->calibration = kv_calibration_set_pick(cfg->kv_calibrations, cfg->image.sizes[0].name, g);
}

static int scale_ws_new(model_t *m, ar_error_t *err);
static void scale_ws_free(model_t *m);

static void scale_family_free(model_t *m) {
    scale_net_t *net = m->net;
    if (!net)
        return;
    scale_ws_free(m);
    var_free(&net->var);
    vq_decoder_free(&net->dec);
    for (int k = 0; k < MODEL_MAX_SCALES && m->be; k++) {
        m->be->weight_free(m->be, &net->phi_w[k]);
        m->be->weight_free(m->be, &net->phi_b[k]);
    }
    free(net);
    m->net = NULL;
}

static int scale_family_load(model_t *m, weight_set_t *ws, ar_error_t *err) {
    const model_config_t *c = &m->cfg;
    const int64_t E = c->image.embed_dim;
    if (c->image.phi_count > MODEL_MAX_SCALES)
        return ar_errorf(err, "%s/arserve.json: image.phi_count %d exceeds %d", m->dir,
                         c->image.phi_count, MODEL_MAX_SCALES);
    scale_net_t *net = m->net = calloc(1, sizeof *net);
    if (!net)
        return ar_errorf(err, "out of memory");
    int rc =
        var_load(&net->var, c, ws, m->be, err) || vq_decoder_load(&net->dec, c, ws, m->be, err);
    net->var.arena = &m->arena;
    if (!rc)
        rc = scale_ws_new(m, err);
    for (int k = 0; !rc && k < c->image.phi_count; k++)
        rc = weight_load(ws, &net->phi_w[k], SHAPE4(E, E, 3, 3), err, "vq.phi.%d.weight", k) ||
             weight_load(ws, &net->phi_b[k], SHAPE1(E), err, "vq.phi.%d.bias", k);
    if (rc) {
        scale_family_free(m);
        return AR_ERR;
    }
    return AR_OK;
}

/* The shared Phi for scale si of S: the nearest of phi_count ticks to
 * si / (S - 1), the first on a tie. Ticks are linspace(1/(3K), 1 - 1/(3K),
 * K) for K = 4 and linspace(1/(2K), 1 - 1/(2K), K) otherwise (VAR's
 * quant.py), computed in double as numpy's linspace does (k * step + start,
 * the last exactly stop): ties in real arithmetic (VAR's 10 scales have two)
 * then fall as they do in the reference. */
int scale_phi_index(int phi_count, int n_scales, int si) {
    const int K = phi_count;
    const double start = K == 4 ? 1.0 / 3 / K : 1.0 / 2 / K, stop = 1.0 - start;
    const double at = (double)si / (n_scales - 1), step = K > 1 ? (stop - start) / (K - 1) : 0;
    int best = 0;
    double best_d = INFINITY;
    for (int k = 0; k < K; k++) {
        const double tick = K > 1 && k == K - 1 ? stop : k * step + start;
        const double d = fabs(tick - at);
        if (d < best_d) {
            best_d = d;
            best = k;
        }
    }
    return best;
}

/* Backend scratch for the latent arithmetic of one request; zero holds
 * zeros (scratch memory may hold anything, even NaN). */
typedef struct latent_ws {
    float *fhat, *rows, *map, *up, *conv, *zero; /* E x G x G each */
} latent_ws_t;

#define LATENT_WS_BUFFERS 6

static size_t latent_ws_bytes(const model_config_t *c) {
    const size_t G = (size_t)c->image.grid_height;
    return LATENT_WS_BUFFERS * c->image.embed_dim * G * G * sizeof(float);
}

static void latent_ws_free(backend_t *be, latent_ws_t *w) {
    float *bufs[LATENT_WS_BUFFERS] = {w->fhat, w->rows, w->map, w->up, w->conv, w->zero};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        be->free(be, bufs[i]);
    memset(w, 0, sizeof *w);
}

static int latent_ws_alloc(backend_t *be, const model_config_t *c, latent_ws_t *w,
                           ar_error_t *err) {
    const size_t G = (size_t)c->image.grid_height, n = (size_t)c->image.embed_dim * G * G;
    float **bufs[LATENT_WS_BUFFERS] = {&w->fhat, &w->rows, &w->map, &w->up, &w->conv, &w->zero};
    float *zeros = calloc(n, sizeof *zeros);
    memset(w, 0, sizeof *w);
    for (size_t i = 0; zeros && i < sizeof bufs / sizeof bufs[0]; i++)
        if (!(*bufs[i] = be->alloc(be, n * sizeof(float)))) {
            latent_ws_free(be, w);
            free(zeros);
            zeros = NULL;
        }
    if (!zeros)
        return ar_errorf(err, "out of memory for the latent map");
    be->upload(be, w->zero, zeros, n * sizeof *zeros);
    free(zeros);
    return AR_OK;
}

/* The step's backend memory, kept between steps so that a step in steady
 * state allocates nothing: the latent maps, and the next scale's inputs of
 * up to cap requests (grown to the largest batch seen). */
struct scale_ws {
    latent_ws_t w;
    float *inputs; /* cap x E x G x G */
    int cap;
};

static int scale_ws_reserve(model_t *m, int n, ar_error_t *err) {
    struct scale_ws *ws = scale_net_of(m)->ws;
    backend_t *be = m->be;
    if (!ws->w.fhat && latent_ws_alloc(be, &m->cfg, &ws->w, err) != AR_OK)
        return AR_ERR;
    if (n <= ws->cap)
        return AR_OK;
    const size_t G = (size_t)m->cfg.image.grid_height;
    float *grown = be->alloc(be, (size_t)n * m->cfg.image.embed_dim * G * G * sizeof(float));
    if (!grown)
        return ar_errorf(err, "out of backend memory for the next scale's inputs of %d requests",
                         n);
    be->free(be, ws->inputs);
    ws->inputs = grown;
    ws->cap = n;
    return AR_OK;
}

static int scale_ws_new(model_t *m, ar_error_t *err) {
    scale_net_t *net = m->net;
    return (net->ws = calloc(1, sizeof *net->ws)) ? AR_OK : ar_errorf(err, "out of memory");
}

static void scale_ws_free(model_t *m) {
    scale_net_t *net = m->net;
    if (!net->ws)
        return;
    latent_ws_free(m->be, &net->ws->w);
    m->be->free(m->be, net->ws->inputs);
    free(net->ws);
    net->ws = NULL;
}

/* w->fhat = the latent map after scales [0, n_scales) of tokens: each
 * scale's codes (E, p, p), bicubic to (E, G, G) (the last scale is already
 * there), Phi(h) = (1 - r) h + r conv3x3(h), summed. */
static void latent_fhat(const model_t *m, backend_t *be, const int *tokens, int n_scales,
                        latent_ws_t *w) {
    const scale_net_t *net = scale_net_of(m);
    const model_config_t *c = &m->cfg;
    const int E = c->image.embed_dim, G = c->image.grid_height, S = c->image.n_scales;
    const size_t n = (size_t)E * G * G;
    const float r = c->image.phi_ratio;
    be->copy(be, w->fhat, w->zero, n * sizeof(float));
    for (int si = 0; si < n_scales; si++) {
        const int p = c->image.scales[si], at = net->var.scale_at[si],
                  k = scale_phi_index(c->image.phi_count, S, si);
        be->embedding(be, w->rows, &net->dec.codebook, tokens + at, p * p, 0);
        be->transpose(be, w->map, w->rows, p * p, E); /* (E, p, p) */
        float *h = w->map;
        if (si != S - 1) {
            be->resize_bicubic(be, w->up, w->map, E, p, p, G, G);
            h = w->up;
        }
        be->conv2d(be, w->conv, h, &net->phi_w[k], &net->phi_b[k], E, G, G, 1);
        be->scale(be, h, n, 1.0f - r);
        be->scale(be, w->conv, n, r);
        be->add(be, h, w->conv, n);
        be->add(be, w->fhat, h, n);
    }
}

/* The next input of a request about to run scale si > 0: f_hat of the
 * scales before, area-downsampled to scale si, as p*p rows of E (out). */
static void latent_next_input(model_t *m, const int *tokens, int si, latent_ws_t *w, float *out) {
    backend_t *be = m->be;
    const model_config_t *c = &m->cfg;
    const int E = c->image.embed_dim, G = c->image.grid_height, p = c->image.scales[si];
    latent_fhat(m, be, tokens, si, w);
    be->resize_area(be, w->map, w->fhat, E, G, G, p, p);
    be->transpose(be, out, w->map, E, p * p);
}

/* Step t runs scale t of both sequences of every request; each token of
 * the scale is then sampled with the guidance ramp t_si = cfg * si / (S-1):
 * logits (1 + t) cond - t uncond, i.e. sampler_next's weight 1 + t_si,
 * its draw numbered by the token's place in the whole pyramid. */
static int scale_step(model_t *m, gen_request_t *const *reqs, int n, ar_error_t *err) {
    scale_net_t *net = scale_net_of(m);
    if (n <= 0)
        return AR_OK;
    backend_t *be = m->be;
    const model_config_t *c = &m->cfg;
    const int V = c->image.codebook_size, S = c->image.n_scales, E = c->image.embed_dim;
    const size_t G = (size_t)c->image.grid_height;
    arena_t *a = &m->arena;
    arena_begin(a);
    var_input_t *in = arena_calloc(a, (size_t)2 * n, sizeof *in);
    float **latent = arena_calloc(a, (size_t)n, sizeof *latent);
    float *logits = NULL;
    int rc = AR_ERR;
    size_t rows = 0;
    if (!in || !latent) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    if (scale_ws_reserve(m, n, err) != AR_OK)
        goto out;
    latent_ws_t *w = &net->ws->w;
    for (int i = 0; i < n; i++) {
        const int si = reqs[i]->step;
        rows += (size_t)2 * c->image.scales[si] * c->image.scales[si];
        for (int j = 0; j < 2; j++)
            if (!reqs[i]->cond_table[j] &&
                !(reqs[i]->cond_table[j] =
                      be->alloc(be, var_adaln_floats(&net->var) * sizeof(float)))) {
                ar_errorf(err, "out of backend memory for the AdaLN tables");
                goto out;
            }
        if (si > 0)
            latent[i] = net->ws->inputs + (size_t)i * E * G * G;
    }
    if (!(logits = arena_alloc(a, rows * V * sizeof *logits))) {
        ar_errorf(err, "out of memory for %zu rows of logits", rows);
        goto out;
    }
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        const int si = r->step;
        if (si > 0)
            latent_next_input(m, r->tokens, si, w, latent[i]);
        for (int j = 0; j < 2; j++)
            in[2 * i + j] = (var_input_t){
                .seq = &r->seq[j],
                .scale = si,
                .label = j ? r->uncond_ids[0] : r->cond_ids[0],
                .latent = latent[i],
                .cache = si<S - 1, .adaln = r->cond_table[j], .adaln_ready = si> 0,
                .collect_mass = r->collect[j],
                .policy = r->policy_state[j],
                .peak_blocks = kv_policy_layered(r->policy_state[j]) ? &r->kv_peak_blocks : NULL,
            };
    }
    if (var_forward(&net->var, in, 2 * n, logits, err) != AR_OK)
        goto out;
    const float *row = logits;
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        const int si = r->step, at = net->var.scale_at[si],
                  pp = c->image.scales[si] * c->image.scales[si];
        if (r->forced && gen_request_keep_logits(r, row, (size_t)2 * pp * V, err) != AR_OK)
            goto out;
        sampler_params_t p = r->params;
        p.cfg = 1.0f + r->params.cfg * (float)si / (float)(S - 1);
        for (int t = 0; t < pp; t++) {
            const float *cond = row + (size_t)t * V, *uncond = row + (size_t)(pp + t) * V;
            r->tokens[at + t] = r->forced ? r->forced[at + t]
                                          : sampler_next(&r->sampler, cond, uncond, &p, r->seed,
                                                         r->stream, (uint64_t)(at + t));
        }
        row += (size_t)2 * pp * V;
    }
    rc = AR_OK;
out:
    arena_end(a);
    return rc;
}

/* The image from the first n_done scales of tokens (all of them when
 * finished): f_hat so far through the decoder. */
static int scale_draw(const model_t *m, vq_work_t *vw, const int *tokens, int size, int n_done,
                      uint8_t *rgb, ar_error_t *err) {
    (void)size; /* VAR has one size */
    const scale_net_t *net = scale_net_of(m);
    const model_config_t *c = &m->cfg;
    const int S = c->image.n_scales, n_scales = n_done < 0 ? 0 : n_done > S ? S : n_done;
    const int n = net->var.scale_at[n_scales];
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->image.codebook_size)
            return ar_errorf(err, "image token %d at position %d is outside the codebook (%d)",
                             tokens[i], i, c->image.codebook_size);
    latent_ws_t w;
    if (latent_ws_alloc(vw->be, c, &w, err) != AR_OK)
        return AR_ERR;
    latent_fhat(m, vw->be, tokens, n_scales, &w);
    int rc = vq_decode_latent(&net->dec, vw, w.fhat, rgb, NULL, err);
    latent_ws_free(vw->be, &w);
    return rc;
}

int scale_latent(model_t *m, const int *tokens, int n_scales, float *fhat_host, ar_error_t *err) {
    const model_config_t *c = &m->cfg;
    const size_t G = (size_t)c->image.grid_height;
    latent_ws_t w;
    if (n_scales < 0 || n_scales > c->image.n_scales)
        return ar_errorf(err, "%d scales: the model has %d", n_scales, c->image.n_scales);
    if (latent_ws_alloc(m->be, c, &w, err) != AR_OK)
        return AR_ERR;
    latent_fhat(m, m->be, tokens, n_scales, &w);
    m->be->download(m->be, fhat_host, w.fhat, (size_t)c->image.embed_dim * G * G * sizeof(float));
    latent_ws_free(m->be, &w);
    return AR_OK;
}

/* A draw's latent maps come and go with it. */
static size_t scale_draw_bytes(const model_t *m, size_t *n_buffers) {
    size_t n = 0;
    const size_t bytes = vq_work_bytes(&scale_net_of(m)->dec, &n) + latent_ws_bytes(&m->cfg);
    if (n_buffers)
        *n_buffers = n + LATENT_WS_BUFFERS;
    return bytes;
}

static struct vq_work *scale_draw_work_new(const model_t *m, backend_t *be, ar_error_t *err) {
    return vq_work_new(&scale_net_of(m)->dec, be, err);
}

const model_family_t model_family_scale = {
    .name = "scale",
    .architectures = scale_architectures,
    .segment_name = "scale",
    .models_name = "next-scale",
    .geometry = scale_geometry,
    .load = scale_family_load,
    .free = scale_family_free,
    .step = scale_step,
    .draw = scale_draw,
    .draw_bytes = scale_draw_bytes,
    .draw_work_new = scale_draw_work_new,
    .draw_work_free = vq_work_delete,
};
