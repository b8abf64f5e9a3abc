/* The infinity architecture against the official Infinity code
 * (FoundationVision/Infinity at a tiny random configuration; the data and
 * how it was made: tests/golden/infinity_tiny/README.md): the T5 encoder's
 * output, teacher-forced logits of both CFG rows at every scale (the
 * learned unconditional rows, and a negative prompt's), the next-scale
 * inputs and latent maps, the decoded image and its 8-bit pixels, for a
 * square and a non-square size; the bits the sampler draws from the
 * reference's own uniforms; and a batch of both sizes giving each request
 * what it gives alone. ARSERVE_TEST_BACKEND=cuda runs the same checks on
 * the CUDA backend (tests/test_backend.h). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "base/file.h"
#include "engine/calibration_run.h"
#include "engine/family/family_infinity.h"
#include "engine/format/safetensors.h"
#include "engine/generate.h"
#include "engine/planner.h"
#include "tests/test.h"
#include "tests/test_backend.h"

#define T5_TOL 1e-4
#define LOGIT_TOL 1e-4
#define LATENT_TOL 1e-5
#define IMAGE_TOL 1e-4
/* Attention mass is a probability: both sides sum the same fp32 softmax
 * rows (measured 2.1e-7 on the CPU backend). */
#define BETA_TOL 1e-5

/* The 2B-like model, then the 8B-like one (2x2 spatial patchify). */
static const char *const dirs[] = {"tests/golden/infinity_tiny",
                                   "tests/golden/infinity_tiny_patchify"};
static const char *dir;

static model_t model;
static backend_t *be;
static safetensors_t st;
static kv_pool_t pool;

static const void *get(const char *name, dtype_t dtype, int ndim, const int64_t *shape) {
    const st_tensor_t *t;
    ar_error_t err = {{0}};
    if (safetensors_get_any(&st, name, ndim, shape, &t, &err) != AR_OK || t->dtype != dtype) {
        fprintf(stderr, "golden %s: %s\n", name, err.msg[0] ? err.msg : "wrong dtype");
        return NULL;
    }
    return t->data;
}

/* An I32 or U8 tensor's n values as ints (a fresh array). */
static int *get_ints(const char *name, int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    const st_tensor_t *t = safetensors_find(&st, name);
    const dtype_t dt = t && t->dtype == DTYPE_U8 ? DTYPE_U8 : DTYPE_I32;
    const void *src = get(name, dt, ndim, shape);
    int *out = src ? malloc((size_t)n * sizeof *out) : NULL;
    for (int64_t i = 0; out && i < n; i++)
        out[i] = dt == DTYPE_U8 ? ((const uint8_t *)src)[i] : ((const int32_t *)src)[i];
    return out;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        worst = isnan(e) ? INFINITY : e > worst ? e : worst;
    }
    return worst;
}

/* The model's size drawing width x height. */
static int size_of(int width, int height) {
    for (int i = 0; i < model.cfg.image.n_sizes; i++) {
        int w, h;
        model_image_dims(&model.cfg, i, &w, &h);
        if (w == width && h == height)
            return i;
    }
    return -1;
}

static int load(void) {
    ar_error_t err = {{0}};
    char path[1024];
    be = test_backend_open(&err);
    if (!be || model_load(&model, dir, be, &err) != AR_OK) {
        fprintf(stderr, "cannot load the golden model: %s\n", err.msg);
        return -1;
    }
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    if (safetensors_open(&st, path, &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    /* Room for four requests' full caches at the largest size. */
    const model_config_t *c = &model.cfg;
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    const int bt = planner_block_tokens(c);
    size_t peak = 0;
    for (int i = 0; i < c->image.n_sizes; i++) {
        planner_plan_t plan;
        if (planner_plan_sized(&plan, c, &full, 1, i, bt, planner_kv_f32, NULL, &err) != AR_OK) {
            fprintf(stderr, "plan: %s\n", err.msg);
            return -1;
        }
        peak = plan.peak_bytes > peak ? plan.peak_bytes : peak;
        planner_plan_free(&plan);
    }
    if (kv_pool_init(&pool, be,
                     4 * (int)(peak / kv_pool_block_bytes(bt, c->llm.head_dim, DTYPE_F32)), bt,
                     c->llm.head_dim, DTYPE_F32, &err) != AR_OK) {
        fprintf(stderr, "pool: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* A teacher-forced run of golden case `name` (tf_0, tf_1, tf_wide_0) of
 * prompt ids `ids` (n, with </s>): its shape, bits and the reference's
 * tensors. */
typedef struct tf_case {
    const char *name;
    int prompt, size, L, S, n_ids, H, W, h, w; /* h, w: the latent */
    int *ids, *neg, n_neg, *bits;
    const float *cond, *uncond, *negl, *input, *fhat, *image;
    const uint8_t *rgb;
} tf_case_t;

static int case_load(tf_case_t *k, const char *name, int prompt, const char *suffix) {
    memset(k, 0, sizeof *k);
    k->name = name;
    k->prompt = prompt;
    char key[64];
    const int V = 2 * model.cfg.image.bits, E = model.cfg.decoder.latent_channels;
    snprintf(key, sizeof key, "%s_image_%s", name, suffix);
    const st_tensor_t *t = safetensors_find(&st, key);
    if (!t || t->ndim != 3) {
        fprintf(stderr, "golden %s: missing or not 3-D\n", key);
        return -1;
    }
    k->H = (int)t->shape[1];
    k->W = (int)t->shape[2];
    k->image = t->data;
    if ((k->size = size_of(k->W, k->H)) < 0) {
        fprintf(stderr, "no size of the model draws %dx%d\n", k->W, k->H);
        return -1;
    }
    const image_size_t *z = &model.cfg.image.sizes[k->size];
    const int P = model.cfg.image.spatial_patchify ? 2 : 1;
    k->S = z->n_scales;
    for (int i = 0; i < k->S; i++)
        k->L += z->h[i] * z->w[i];
    k->h = z->h[k->S - 1] * P;
    k->w = z->w[k->S - 1] * P;
    snprintf(key, sizeof key, "t5_ids_%d", prompt);
    if (!(t = safetensors_find(&st, key)))
        return -1;
    k->n_ids = (int)t->shape[0];
    k->ids = get_ints(key, 1, (int64_t[]){k->n_ids});
    if (!(t = safetensors_find(&st, "t5_ids_neg")))
        return -1;
    k->n_neg = (int)t->shape[0];
    k->neg = get_ints("t5_ids_neg", 1, (int64_t[]){k->n_neg});
    const int64_t lv[2] = {k->L, V};
#define GETF(field, fmt, nd, ...)                                                                  \
    snprintf(key, sizeof key, fmt, name, suffix);                                                  \
    if (!(k->field = get(key, DTYPE_F32, nd, (const int64_t[]){__VA_ARGS__})))                     \
        return -1;
    GETF(cond, "%s_logits_cond_%s", 2, lv[0], lv[1]);
    GETF(uncond, "%s_logits_uncond_%s", 2, lv[0], lv[1]);
    GETF(negl, "%s_logits_neg_%s", 2, lv[0], lv[1]);
    GETF(input, "%s_input_%s", 2, k->L - 1, model.cfg.image.bits);
#undef GETF
    /* Not every case records its latents. */
    snprintf(key, sizeof key, "%s_fhat_%s", name, suffix);
    if (safetensors_find(&st, key))
        k->fhat = get(key, DTYPE_F32, 4, (const int64_t[]){k->S, E, k->h, k->w});
    snprintf(key, sizeof key, "%s_bits_%s", name, suffix);
    k->bits = get_ints(key, 2, (int64_t[]){k->L, model.cfg.image.bits});
    snprintf(key, sizeof key, "%s_rgb_%s", name, suffix);
    k->rgb = get(key, DTYPE_U8, 3, (int64_t[]){k->H, k->W, 3});
    return k->ids && k->neg && k->bits && k->rgb ? 0 : -1;
}

static void case_free(tf_case_t *k) {
    free(k->ids);
    free(k->neg);
    free(k->bits);
}

static tf_case_t cases[3];
static int n_cases;

static void test_t5_output_matches(void) {
    ar_error_t err = {{0}};
    inf_model_t *inf = &((infinity_net_t *)model.net)->inf;
    const int T = model.cfg.text.hidden_size;
    const char *names[] = {"0", "1", "neg"};
    double worst = 0;
    for (int p = 0; p < 3; p++) {
        char key[32];
        snprintf(key, sizeof key, "t5_ids_%s", names[p]);
        const st_tensor_t *t = safetensors_find(&st, key);
        if (!t) {
            CHECK_MSG(0, "golden %s missing", key);
            return;
        }
        const int n = (int)t->shape[0];
        int *ids = get_ints(key, 1, (int64_t[]){n});
        snprintf(key, sizeof key, "t5_out_%s", names[p]);
        const float *want = get(key, DTYPE_F32, 2, (int64_t[]){n, T});
        float *out = be->alloc(be, (size_t)n * T * sizeof(float));
        float *host = malloc((size_t)n * T * sizeof *host);
        CHECK_MSG(inf_t5_encode(inf, ids, n, out, &err) == AR_OK, "%s", err.msg);
        be->download(be, host, out, (size_t)n * T * sizeof(float));
        const double e = want ? max_abs_diff(host, want, (size_t)n * T) : INFINITY;
        CHECK_MSG(e <= T5_TOL, "t5 output of prompt %s off by %g", names[p], e);
        worst = fmax(worst, e);
        be->free(be, out);
        free(host);
        free(ids);
    }
    printf("largest T5 error: %.3g\n", worst);
}

/* Starts a request of case k (its bits forced), its unconditional row the
 * learned rows or (negative) the negative prompt's, under policy (NULL:
 * the full cache). */
static int start_with(gen_request_t *r, const tf_case_t *k, const int *forced, int negative,
                      const kv_policy_params_t *policy) {
    ar_error_t err = {{0}};
    sampler_params_t sp = {3.0f, 1.0f, 0, 0.0f};
    int *uncond = malloc((size_t)k->n_ids * sizeof *uncond);
    for (int i = 0; i < k->n_ids; i++)
        uncond[i] = -1;
    const gen_image_opts_t opts = {.size = k->size,
                                   .negative = negative ? k->neg : NULL,
                                   .n_negative = negative ? k->n_neg : 0};
    const int rc = gen_request_init_opts(r, &model, &pool, policy, k->ids, uncond, k->n_ids, &opts,
                                         &sp, 1, 0, &err);
    free(uncond);
    if (rc != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    r->forced = forced;
    return 0;
}

static int start(gen_request_t *r, const tf_case_t *k, const int *forced, int negative) {
    return start_with(r, k, forced, negative, NULL);
}

/* Every case twice: the learned unconditional rows, then the negative
 * prompt's T5 features as the unconditional row (under the emulator, ten
 * times slower, the negative prompt on the first case only: the same ops). */
static void test_teacher_forced_logits_match(void) {
    const int V = 2 * model.cfg.image.bits;
#ifdef ARSERVE_TEST_CUDA_EMU
    const int n_runs = n_cases + 1;
#else
    const int n_runs = 2 * n_cases;
#endif
    for (int c = 0; c < n_runs; c++) {
        const tf_case_t *k = &cases[c % n_cases];
        const int neg = c >= n_cases;
        const float *uncond = neg ? k->negl : k->uncond;
        gen_request_t r;
        if (start(&r, k, k->bits, neg)) {
            CHECK(0);
            continue;
        }
        gen_request_t *batch[] = {&r};
        ar_error_t err = {{0}};
        double worst = 0;
        const image_size_t *z = &model.cfg.image.sizes[k->size];
        for (int at = 0; !gen_request_done(&r);) {
            const int si = r.step, pp = z->h[si] * z->w[si];
            CHECK_MSG(gen_step(batch, 1, &err) == AR_OK, "%s", err.msg);
            const double ec = max_abs_diff(r.logits, k->cond + (size_t)at * V, (size_t)pp * V);
            const double eu =
                max_abs_diff(r.logits + (size_t)pp * V, uncond + (size_t)at * V, (size_t)pp * V);
            CHECK_MSG(ec <= LOGIT_TOL && eu <= LOGIT_TOL,
                      "%s scale %d: logits off by %g (cond), %g", k->name, si, ec, eu);
            worst = fmax(worst, fmax(ec, eu));
            at += pp;
        }
        printf("%s (%dx%d, %s): largest logit error over %d tokens x 2 rows: %.3g\n", k->name, k->W,
               k->H, neg ? "negative prompt" : "learned unconditional rows", k->L, worst);
        gen_request_free(&r);
    }
}

/* The next-scale inputs and the latent after each scale, from the bits. */
static void test_inputs_and_latents_match(void) {
    const model_config_t *c = &model.cfg;
    const int E = c->decoder.latent_channels, bits = c->image.bits;
    float *fhat = malloc(infinity_latent_floats(c) * sizeof *fhat);
    float *rows = malloc(infinity_latent_floats(c) * 4 * sizeof *rows);
    for (int ci = 0; ci < n_cases; ci++) {
        const tf_case_t *k = &cases[ci];
        const image_size_t *z = &c->image.sizes[k->size];
        const size_t n = (size_t)E * k->h * k->w;
        ar_error_t err = {{0}};
        double wf = 0, wi = 0;
        for (int si = 1, at = 1; si <= k->S; si++) {
            CHECK_MSG(infinity_latent(c, k->size, k->bits, si, fhat, &err) == AR_OK, "%s", err.msg);
            if (k->fhat)
                wf = fmax(wf, max_abs_diff(fhat, k->fhat + (size_t)(si - 1) * n, n));
            if (si == k->S)
                break;
            const int pp = z->h[si] * z->w[si];
            CHECK_MSG(infinity_next_input(c, k->size, fhat, si, rows, &err) == AR_OK, "%s",
                      err.msg);
            /* tf_input's rows start at scale 1 (token 1). */
            wi =
                fmax(wi, max_abs_diff(rows, k->input + (size_t)(at - 1) * bits, (size_t)pp * bits));
            at += pp;
        }
        CHECK_MSG(wf <= LATENT_TOL && wi <= LATENT_TOL, "%s: latent off by %g, inputs by %g",
                  k->name, wf, wi);
        printf("%s: largest latent error %.3g, input error %.3g\n", k->name, wf, wi);
    }
    free(fhat);
    free(rows);
}

/* The sizes test_every_size_decodes draws: every one on the CPU; under the
 * emulator (ten times slower: 16 s a folder for the 15 sizes) the three that
 * bound what a decode needs, the tallest latent, the widest and the largest
 * (the work's buffers are sized by the largest; the other sizes run the same
 * kernels on fewer rows and columns). Returns how many it put in pick. */
static int sizes_to_decode(const model_config_t *c, int *pick) {
    const int n = c->image.n_sizes;
#ifdef ARSERVE_TEST_CUDA_EMU
    const image_size_t *z = c->image.sizes;
#define LAST_H(i) z[i].h[z[i].n_scales - 1]
#define LAST_W(i) z[i].w[z[i].n_scales - 1]
    int tall = 0, wide = 0, big = 0;
    for (int i = 1; i < n; i++) {
        tall = LAST_H(i) > LAST_H(tall) ? i : tall;
        wide = LAST_W(i) > LAST_W(wide) ? i : wide;
        big = LAST_H(i) * LAST_W(i) > LAST_H(big) * LAST_W(big) ? i : big;
    }
#undef LAST_H
#undef LAST_W
    int k = 0;
    const int three[3] = {tall, wide, big};
    for (int j = 0; j < 3; j++) {
        int seen = 0;
        for (int i = 0; i < k; i++)
            seen |= pick[i] == three[j];
        if (!seen)
            pick[k++] = three[j];
    }
    return k;
#else
    for (int i = 0; i < n; i++)
        pick[i] = i;
    return n;
#endif
}

/* Every size the model serves decodes within the decoder's buffers (sized
 * once, for the largest latent: with 2x2 patchify twice each side of the
 * last scale), not only the golden's own sizes: 64x80 on the patchify
 * model needs 10,240 floats where a latent sized without the patchify
 * gives 8,192. A latent past the largest is refused, not written past. */
static void test_every_size_decodes(void) {
    const model_config_t *c = &model.cfg;
    infinity_net_t *net = model.net;
    const int P = c->image.spatial_patchify ? 2 : 1, E = c->decoder.latent_channels;
    ar_error_t err = {{0}};
    struct vq_work *w = model_draw_work(&model, &err);
    CHECK_MSG(w != NULL, "%s", err.msg);
    if (!w)
        return;
    int pick[MODEL_MAX_SIZES];
    const int n_pick = sizes_to_decode(c, pick);
    if (n_pick < c->image.n_sizes)
        printf("every size: %d of %d decoded under the emulator (the tallest, widest and largest; "
               "the CPU run decodes each)\n",
               n_pick, c->image.n_sizes);
    for (int j = 0; j < n_pick; j++) {
        const image_size_t *z = &c->image.sizes[pick[j]];
        const int h = z->h[z->n_scales - 1] * P, wd = z->w[z->n_scales - 1] * P;
        const size_t H = (size_t)h << (c->decoder.n_levels - 1),
                     W = (size_t)wd << (c->decoder.n_levels - 1);
        float *zeros = calloc((size_t)E * h * wd, sizeof *zeros);
        uint8_t *rgb = malloc(H * W * 3);
        be->upload(be, w->latent, zeros, (size_t)E * h * wd * sizeof *zeros);
        CHECK_MSG(vq_decode_latent_hw(&net->dec, w, w->latent, h, wd, rgb, NULL, &err) == AR_OK,
                  "size %s (latent %dx%d): %s", z->name, h, wd, err.msg);
        free(zeros);
        free(rgb);
    }
    uint8_t px[3];
    CHECK(vq_decode_latent_hw(&net->dec, w, w->latent, 1, (int)w->positions + 1, px, NULL, &err) ==
          AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "larger than its buffers hold");
}

/* The decoder: float output (clamped to [-1, 1]) and the 8-bit RGB. */
static void test_decoded_images_match(void) {
    const model_config_t *c = &model.cfg;
    infinity_net_t *net = model.net;
    float *fhat = malloc(infinity_latent_floats(c) * sizeof *fhat);
    for (int ci = 0; ci < n_cases; ci++) {
        const tf_case_t *k = &cases[ci];
        const size_t n = (size_t)k->H * k->W * 3;
        uint8_t *rgb = malloc(n);
        float *pix = malloc(n * sizeof *pix);
        ar_error_t err = {{0}};
        struct vq_work *w = model_draw_work(&model, &err);
        CHECK_MSG(w && infinity_latent(c, k->size, k->bits, k->S, fhat, &err) == AR_OK, "%s",
                  err.msg);
        if (!w)
            break;
        be->upload(be, w->latent, fhat, (size_t)c->decoder.latent_channels * k->h * k->w * 4);
        CHECK_MSG(vq_decode_latent_hw(&net->dec, w, w->latent, k->h, k->w, rgb, pix, &err) == AR_OK,
                  "%s", err.msg);
        double worst = 0;
        int worst_px = 0;
        for (size_t i = 0; i < n; i++) {
            worst = fmax(worst, fabs(fmin(fmax(pix[i], -1.0), 1.0) - k->image[i]));
            const size_t ch = i / ((size_t)k->H * k->W), yx = i % ((size_t)k->H * k->W);
            const int d = abs(rgb[yx * 3 + ch] - k->rgb[yx * 3 + ch]);
            worst_px = d > worst_px ? d : worst_px;
        }
        printf("%s image: largest error %.3g, pixels within %d/255\n", k->name, worst, worst_px);
        CHECK_MSG(worst <= IMAGE_TOL, "%s image off by %g", k->name, worst);
        CHECK_MSG(worst_px <= 1, "%s: pixels differ by %d", k->name, worst_px);
        free(rgb);
        free(pix);
    }
    free(fhat);
}

/* The reference's sampling runs (s0, s1: the 1:1 size, s1 with the
 * negative prompt and top-p, s2: the wide size):
 * teacher-forced on the bits they drew, our logits guided as the reference
 * guides them (cfg * cond / tau + (1 - cfg) * uncond / tau) must be its
 * logits, and infinity_sample_bit must draw its bits from its own uniforms
 * wherever the uniform is not within rounding of the bit's probability. */
static void test_sampled_bits_match(void) {
    const model_config_t *c = &model.cfg;
    const int bits = c->image.bits, V = 2 * bits;
    const char *runs[] = {"s0", "s1", "s2"};
    for (int ri = 0; ri < 3; ri++) {
        char key[64];
        snprintf(key, sizeof key, "%s_params", runs[ri]);
        const float *par = get(key, DTYPE_F32, 1, (const int64_t[]){3});
        snprintf(key, sizeof key, "%s_image", runs[ri]);
        const st_tensor_t *img = safetensors_find(&st, key);
        if (!par || !img) {
            CHECK_MSG(0, "golden run %s missing", runs[ri]);
            continue;
        }
        /* s0: prompt 0; s1: prompt 1 with the negative prompt; s2: prompt
         * 0 at the wide size (README): the run's shape from its image, its
         * prompt from the case of its size with that prompt's ids. */
        tf_case_t run = ri == 2 ? cases[n_cases - 1] : cases[0];
        const tf_case_t *k = &run;
        CHECK(img->shape[1] == k->H && img->shape[2] == k->W);
        int *ids1 = NULL;
        if (ri == 1) {
            const st_tensor_t *t = safetensors_find(&st, "t5_ids_1");
            run.n_ids = t ? (int)t->shape[0] : 0;
            run.ids = ids1 = t ? get_ints("t5_ids_1", 1, (const int64_t[]){run.n_ids}) : NULL;
        }
        snprintf(key, sizeof key, "%s_bits", runs[ri]);
        int *want_bits = get_ints(key, 2, (const int64_t[]){k->L, bits});
        snprintf(key, sizeof key, "%s_uniforms", runs[ri]);
        const float *u = get(key, DTYPE_F32, 2, (const int64_t[]){k->L, bits});
        snprintf(key, sizeof key, "%s_logits", runs[ri]);
        const float *want = get(key, DTYPE_F32, 2, (const int64_t[]){k->L, V});
        const float cfg = par[0], tau = par[1], top_p = par[2];
        gen_request_t r;
        if (!want_bits || !u || !want || start(&r, k, want_bits, ri == 1)) {
            CHECK(0);
            free(want_bits);
            free(ids1);
            continue;
        }
        gen_request_t *batch[] = {&r};
        ar_error_t err = {{0}};
        const image_size_t *z = &c->image.sizes[k->size];
        double worst = 0;
        int differ = 0, near = 0;
        for (int at = 0; !gen_request_done(&r);) {
            const int si = r.step, pp = z->h[si] * z->w[si];
            CHECK_MSG(gen_step(batch, 1, &err) == AR_OK, "%s", err.msg);
            for (int t = 0; t < pp; t++)
                for (int b = 0; b < bits; b++) {
                    const float *lc = r.logits + (size_t)t * V + 2 * b;
                    const float *lu = r.logits + (size_t)(pp + t) * V + 2 * b;
                    const float *lw = want + (size_t)(at + t) * V + 2 * b;
                    for (int v = 0; v < 2; v++) {
                        const double g = cfg * (lc[v] / tau) + (1 - cfg) * (lu[v] / tau);
                        worst = fmax(worst, fabs(g - lw[v]));
                    }
                    const size_t place = (size_t)(at + t) * bits + b;
                    const int bit = infinity_sample_bit(lc, lu, cfg, tau, 0, top_p, u[place]);
                    /* p(0) from the reference's own logits, after its top-p
                     * cut (the value sorted first dropped when its
                     * probability is at most 1 - top_p): a uniform within
                     * 1e-5 of it may fall either way, and so may a bit
                     * whose low probability is within 1e-5 of the cut. */
                    double p0 = 1.0 / (1.0 + exp((double)lw[1] - lw[0]));
                    int at_cut = 0;
                    if (top_p > 0 && top_p < 1) {
                        const int lo = lw[1] < lw[0];
                        const double p_lo = lo ? 1.0 - p0 : p0;
                        at_cut = fabs(p_lo - (1.0 - top_p)) < 1e-5;
                        if (p_lo <= 1.0 - top_p)
                            p0 = lo ? 1.0 : 0.0;
                    }
                    if (bit != want_bits[place]) {
                        if (fabs(u[place] - p0) < 1e-5 || at_cut)
                            near++;
                        else
                            differ++;
                    }
                }
            at += pp;
        }
        const double tol = LOGIT_TOL * (fabs(cfg) + fabs(1 - cfg)) / tau;
        printf("%s (cfg %g, tau %g, top-p %g): guided logits within %.3g, %d bits differ (%d of "
               "them at the margin)\n",
               runs[ri], cfg, tau, top_p, worst, differ + near, near);
        CHECK_MSG(worst <= tol, "%s: guided logits off by %g", runs[ri], worst);
        CHECK_MSG(differ == 0, "%s: %d bits differ away from the margin", runs[ri], differ);
        gen_request_free(&r);
        free(want_bits);
        free(ids1);
    }
}

/* Logits of every step of a request run alone, kept per step. */
static float **run_alone(const tf_case_t *k, int negative, int *steps) {
    gen_request_t r;
    if (start(&r, k, k->bits, negative))
        return NULL;
    const int V = 2 * model.cfg.image.bits;
    float **out = calloc((size_t)r.n_steps, sizeof *out);
    gen_request_t *batch[] = {&r};
    ar_error_t err = {{0}};
    const image_size_t *z = &model.cfg.image.sizes[k->size];
    while (out && !gen_request_done(&r)) {
        const int si = r.step, n = 2 * z->h[si] * z->w[si] * V;
        if (gen_step(batch, 1, &err) != AR_OK || !(out[si] = malloc((size_t)n * sizeof(float))))
            break;
        memcpy(out[si], r.logits, (size_t)n * sizeof(float));
    }
    *steps = r.n_steps;
    gen_request_free(&r);
    return out;
}

/* Requests of two sizes, one of them with a negative prompt, in one batch,
 * the second joining two scales later: each gets the logits it gets alone
 * (its own text, RoPE grid and KV), bit for bit where the backend is asked
 * for batch invariance (one GEMM per sequence) or is the CPU (whose
 * prepared Linears keep rows independent), within rounding otherwise. */
static void check_two_sizes_in_one_batch(int batch_invariant) {
    be->batch_invariant = batch_invariant;
    const int exact = batch_invariant || strcmp(be->name, "cpu") == 0;
    const int V = 2 * model.cfg.image.bits;
    const tf_case_t *ka = &cases[0], *kb = &cases[n_cases - 1];
    int na = 0, nb = 0;
    float **wa = run_alone(ka, 0, &na), **wb = run_alone(kb, 1, &nb);
    gen_request_t a, b;
    if (!wa || !wb || start(&a, ka, ka->bits, 0) || start(&b, kb, kb->bits, 1)) {
        CHECK(0);
        return;
    }
    ar_error_t err = {{0}};
    int same = 1;
    while (!gen_request_done(&a) || !gen_request_done(&b)) {
        gen_request_t *batch[2];
        int n = 0;
        const int sa = a.step, sb = b.step;
        if (!gen_request_done(&a))
            batch[n++] = &a;
        if (sa >= 2 && !gen_request_done(&b))
            batch[n++] = &b;
        CHECK_MSG(gen_step(batch, n, &err) == AR_OK, "%s", err.msg);
        for (int i = 0; i < n; i++) {
            const int is_a = batch[i] == &a, si = is_a ? sa : sb;
            const tf_case_t *k = is_a ? ka : kb;
            const image_size_t *z = &model.cfg.image.sizes[k->size];
            const size_t len = (size_t)2 * z->h[si] * z->w[si] * V;
            const float *want = (is_a ? wa : wb)[si];
            double worst = 0;
            for (size_t j = 0; want && j < len; j++) {
                const double d = fabs((double)batch[i]->logits[j] - want[j]);
                worst = d > worst || d != d ? d : worst;
            }
            if (!want || (exact ? memcmp(batch[i]->logits, want, len * sizeof(float)) != 0
                                : !(worst <= 1e-4))) {
                same = 0;
                fprintf(stderr, "  %s at scale %d differs in the batch by %.3g\n",
                        is_a ? "1:1" : "wide", si, worst);
            }
        }
    }
    CHECK_MSG(same, "batch_invariant %d: a request's logits depend on the batch", batch_invariant);
    be->batch_invariant = 0;
    for (int i = 0; i < na; i++)
        free(wa[i]);
    for (int i = 0; i < nb; i++)
        free(wb[i]);
    free(wa);
    free(wb);
    gen_request_free(&a);
    gen_request_free(&b);
}

static void test_two_sizes_in_one_batch_equal_alone(void) {
    check_two_sizes_in_one_batch(1);
    check_two_sizes_in_one_batch(0);
}

/* `arserve calibrate` against HeatKV's calibration (arm-research/heatkv's
 * tools/compute_scas.py, run on the official code; the fixture and how it
 * was made: scas.json and the README beside it): teacher-forced on the
 * golden bit pyramids of both prompts, the conditional row's mass per
 * (layer, head, query scale, source scale) and the S-CAS scores and
 * orderings of every source scale. Folders without scas.json skip it. */
/* dir/name parsed, or NULL (printed: a skip when the folder has no such
 * file, a failure when it does not parse). */
static cJSON *read_json(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("skip: no %s\n", path);
        return NULL;
    }
    char *text = malloc(1 << 20);
    const size_t got = text ? fread(text, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (text)
        text[got] = 0;
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK_MSG(root, "%s does not parse", path);
    return root;
}

/* The prompts of a reference file (root's "prompts", at most 4) and the
 * golden bit pyramids they are forced to ("forced_bits"), into text and
 * forced (freed by the caller); how many, 0 when they do not load. */
static int forced_prompts(const cJSON *root, const char **text, int **forced) {
    const cJSON *prompts = cJSON_GetObjectItemCaseSensitive(root, "prompts"),
                *bits = cJSON_GetObjectItemCaseSensitive(root, "forced_bits");
    const int n = cJSON_GetArraySize(prompts), K = model.cfg.image.sizes[0].n_scales;
    if (n < 1 || n > 4 || cJSON_GetArraySize(bits) != n)
        return 0;
    int L = 0, ok = 1;
    for (int i = 0; i < K; i++)
        L += model.cfg.image.sizes[0].h[i] * model.cfg.image.sizes[0].w[i];
    for (int p = 0; p < n; p++) {
        text[p] = cJSON_GetArrayItem(prompts, p)->valuestring;
        forced[p] = get_ints(cJSON_GetArrayItem(bits, p)->valuestring, 2,
                             (int64_t[]){L, model.cfg.image.bits});
        ok &= text[p] && forced[p];
    }
    return ok ? n : 0;
}

/* `arserve calibrate`'s code on the prompts of root, teacher-forced; made
 * once per folder for the same prompts and bits (the reference files share
 * them), freed by calibration_drop. NULL when it fails. */
static struct {
    char key[512];
    kv_calibration_t c;
    int made;
} calibration_cache;

static const kv_calibration_t *forced_calibration(const cJSON *root) {
    char *key = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "forced_bits"));
    char *prompts = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "prompts"));
    char both[512];
    snprintf(both, sizeof both, "%s %s", key ? key : "", prompts ? prompts : "");
    free(key);
    free(prompts);
    if (calibration_cache.made && strcmp(both, calibration_cache.key) == 0)
        return &calibration_cache.c;
    const char *text[4] = {0};
    int *forced[4] = {0};
    const int n = forced_prompts(root, text, forced);
    ar_error_t err = {{0}};
    if (calibration_cache.made)
        kv_calibration_free(&calibration_cache.c);
    calibration_cache.made = 0;
    const int rc = n ? calibration_run_forced(&model, text, (const int *const *)forced, n, 0, NULL,
                                              NULL, &calibration_cache.c, &err)
                     : AR_ERR;
    for (int p = 0; p < 4; p++)
        free(forced[p]);
    CHECK_MSG(rc == AR_OK, "calibration: %s", n ? err.msg : "no prompts and forced bits");
    if (rc != AR_OK)
        return NULL;
    snprintf(calibration_cache.key, sizeof calibration_cache.key, "%s", both);
    calibration_cache.made = 1;
    return &calibration_cache.c;
}

static void calibration_drop(void) {
    if (calibration_cache.made)
        kv_calibration_free(&calibration_cache.c);
    calibration_cache.made = 0;
}

static void test_calibration_matches_heatkv(void) {
    cJSON *root = read_json("scas.json");
    if (!root)
        return;
    const cJSON *beta = cJSON_GetObjectItemCaseSensitive(root, "beta"),
                *score = cJSON_GetObjectItemCaseSensitive(root, "scas_score"),
                *order = cJSON_GetObjectItemCaseSensitive(root, "scas_order");
    const int n = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(root, "prompts")),
              K = model.cfg.image.sizes[0].n_scales,
              T = model.cfg.llm.num_layers * model.cfg.llm.num_heads;
    CHECK(cJSON_GetArraySize(beta) == T * K * K && cJSON_GetArraySize(score) == T * K &&
          cJSON_GetArraySize(order) == K - 1);
    const kv_calibration_t *cal = forced_calibration(root);
    if (cal) {
        const kv_calibration_t c = *cal;
        /* beta: theirs is null where their calibration does not look (a
         * query scale's own keys, and scale 0's queries). */
        double worst = 0, worst_score = 0;
        int compared = 0;
        for (int i = 0; i < T * K * K; i++) {
            const cJSON *v = cJSON_GetArrayItem(beta, i);
            if (!cJSON_IsNumber(v))
                continue;
            worst = fmax(worst, fabs((double)c.beta[i] - v->valuedouble));
            compared++;
        }
        for (int u = 0; u < T; u++)
            for (int src = 0; src < K - 1; src++) {
                double sum = 0;
                for (int q = src + 1; q < K; q++)
                    sum += c.beta[((size_t)u * K + q) * K + src];
                const double want = cJSON_GetArrayItem(score, u * K + src)->valuedouble;
                worst_score = fmax(worst_score, fabs(sum / (K - 1 - src) - want));
            }
        CHECK_MSG(compared == T * K * (K - 1) / 2, "%d beta entries in %s/scas.json", compared,
                  dir);
        CHECK_MSG(worst <= BETA_TOL && worst_score <= BETA_TOL,
                  "attention mass off by %g, S-CAS scores by %g", worst, worst_score);
        int same = 1;
        for (int src = 0; src < K - 1; src++) {
            const cJSON *o = cJSON_GetArrayItem(order, src);
            for (int i = 0; i < T; i++)
                same &= cJSON_GetArrayItem(o, i)->valueint == c.scas_order[(size_t)src * T + i];
        }
        CHECK_MSG(same, "S-CAS orderings differ from HeatKV's");
        printf(
            "calibration vs HeatKV (%d prompts, teacher-forced): largest mass error %.3g over %d "
            "entries, S-CAS score error %.3g, orderings %s\n",
            n, worst, compared, worst_score, same ? "equal" : "differ");
    }
    cJSON_Delete(root);
}

/* ---- HeatKV and ScaleKV against their public code ---- */

/* Under the CUDA emulator (ten times slower) and the sanitizers (four),
 * one run of each reference checks the backend's ops and the memory of
 * the code paths; the release CPU build runs them all. */
#if defined(ARSERVE_TEST_CUDA_EMU) || defined(__SANITIZE_ADDRESS__)
#define REFERENCE_RUNS_ONE 1
#else
#define REFERENCE_RUNS_ONE 0
#endif

/* A reference run of a KV policy's public code, teacher-forced: the model
 * and pool to run on, each prompt's ids and forced bits, and the file of
 * its logits (every stride-th token's, both CFG rows). */
typedef struct policy_ref {
    model_t *m;
    kv_pool_t *pool;
    const int *ids[2], *bits[2];
    int n_ids[2];
    safetensors_t *st;
    int stride;
} policy_ref_t;

/* One compaction: which tokens (by their place in the whole image,
 * coarsest scale first) a (layer, CFG row, head) kept after a scale. */
typedef struct kept {
    int step, layer, row, head, n;
    int *ids;
} kept_t;

/* What a run's compactions kept, followed through the observer. */
typedef struct kept_trace {
    int n_heads;
    int at, n_new;                     /* the current step's first token and its tokens */
    int *ids[2], *len[2], *step_of[2]; /* per row: unit u's tokens at ids[row] + u * cap */
    int cap;
    kept_t *events;
    int n_events;
} kept_trace_t;

typedef struct kept_row {
    kept_trace_t *t;
    int row;
} kept_row_t;

/* Unit u of row r holds the current step's tokens too (once a step). */
static void kept_extend(kept_trace_t *t, int r, int u, int step) {
    if (t->step_of[r][u] >= step)
        return;
    int *ids = t->ids[r] + (size_t)u * t->cap;
    for (int i = 0; i < t->n_new && t->len[r][u] < t->cap; i++)
        ids[t->len[r][u]++] = t->at + i;
    t->step_of[r][u] = step;
}

static void kept_observe(void *ctx, int step, int layer, int head, int len, const int *keep,
                         int n_keep) {
    kept_row_t *kr = ctx;
    kept_trace_t *t = kr->t;
    const int r = kr->row, u = layer * t->n_heads + head;
    kept_extend(t, r, u, step);
    int *ids = t->ids[r] + (size_t)u * t->cap;
    kept_t *e = &t->events[t->n_events];
    CHECK_MSG(len == t->len[r][u], "step %d layer %d head %d: %d tokens, traced %d", step, layer,
              head, len, t->len[r][u]);
    *e = (kept_t){step, layer, r, head, n_keep, malloc((size_t)n_keep * sizeof(int))};
    for (int i = 0; i < n_keep; i++)
        ids[i] = e->ids[i] = ids[keep[i]];
    t->len[r][u] = n_keep;
    t->n_events++;
}

/* The tokens of the model's default size, and its scales into *n_scales. */
static int ref_tokens(const model_t *m, int *n_scales) {
    const image_size_t *z = &m->cfg.image.sizes[0];
    int L = 0;
    for (int i = 0; i < z->n_scales; i++)
        L += z->h[i] * z->w[i];
    *n_scales = z->n_scales;
    return L;
}

/* Runs reference run `run` (its "budget", "prompt" and "logits") of policy
 * p on ref's model, teacher-forced at its default size, both CFG rows'
 * logits held to the reference's at every stride-th token. Between steps,
 * after_step(ctx, r, step) checks the caches. Returns the request's worst
 * logit error (its caches freed), or -1 when it could not run. */
typedef void (*after_step_fn)(void *ctx, gen_request_t *r, int step);
static double run_reference(const policy_ref_t *ref, const cJSON *run, kv_policy_params_t *p,
                            after_step_fn after_step, void *ctx, gen_request_t *r) {
    const int prompt = cJSON_GetObjectItemCaseSensitive(run, "prompt")->valueint;
    const char *name = cJSON_GetObjectItemCaseSensitive(run, "logits")->valuestring;
    p->budget = cJSON_GetObjectItemCaseSensitive(run, "budget")->valuedouble;
    int S;
    const int L = ref_tokens(ref->m, &S), V = 2 * ref->m->cfg.image.bits,
              n_ref = (L + ref->stride - 1) / ref->stride;
    char key[64];
    snprintf(key, sizeof key, "%s_cond", name);
    const st_tensor_t *lc = safetensors_find(ref->st, key);
    snprintf(key, sizeof key, "%s_uncond", name);
    const st_tensor_t *lu = safetensors_find(ref->st, key);
    ar_error_t err = {{0}};
    int *uncond = malloc((size_t)ref->n_ids[prompt] * sizeof *uncond);
    for (int i = 0; uncond && i < ref->n_ids[prompt]; i++)
        uncond[i] = -1;
    const gen_image_opts_t opts = {0};
    const sampler_params_t sp = {3.0f, 1.0f, 0, 0.0f};
    const int ok = lc && lu && lc->shape[0] == n_ref && lu->shape[0] == n_ref && uncond &&
                   gen_request_init_opts(r, ref->m, ref->pool, p, ref->ids[prompt], uncond,
                                         ref->n_ids[prompt], &opts, &sp, 1, 0, &err) == AR_OK;
    free(uncond);
    if (!ok) {
        CHECK_MSG(0, "run %s: no reference logits, or the request does not start: %s", name,
                  err.msg);
        return -1;
    }
    r->forced = ref->bits[prompt];
    after_step(ctx, r, -1);
    gen_request_t *batch[] = {r};
    const image_size_t *z = &ref->m->cfg.image.sizes[0];
    double worst = 0;
    for (int at = 0; !gen_request_done(r);) {
        const int si = r->step, pp = z->h[si] * z->w[si];
        if (gen_step(batch, 1, &err) != AR_OK) {
            CHECK_MSG(0, "run %s: %s", name, err.msg);
            break;
        }
        after_step(ctx, r, si);
        /* the reference's tokens at, at + stride, ... of this scale */
        for (int i = (at + ref->stride - 1) / ref->stride * ref->stride; i < at + pp;
             i += ref->stride)
            for (int j = 0; j < 2; j++) {
                const float *want =
                    (const float *)(j ? lu : lc)->data + (size_t)(i / ref->stride) * V;
                worst = fmax(worst, max_abs_diff(r->logits + ((size_t)j * pp + (i - at)) * V, want,
                                                 (size_t)V));
            }
        at += pp;
    }
    CHECK_MSG(worst <= LOGIT_TOL, "run %s: logits off by %g after pruning", name, worst);
    return worst;
}

/* ScaleKV: the tokens each cut keeps, followed through the observer. */
typedef struct scalekv_ctx {
    const policy_ref_t *ref;
    kept_trace_t t;
    kept_row_t rows[2];
    int at;
} scalekv_ctx_t;

static void scalekv_after_step(void *ctx, gen_request_t *r, int si) {
    scalekv_ctx_t *c = ctx;
    kept_trace_t *t = &c->t;
    const image_size_t *z = &c->ref->m->cfg.image.sizes[0];
    int S;
    ref_tokens(c->ref->m, &S);
    const int U = c->ref->m->cfg.llm.num_layers * t->n_heads;
    if (si < 0) { /* before the first step */
        for (int j = 0; j < 2; j++)
            kv_policy_observe(r->policy_state[j], kept_observe, &c->rows[j]);
        t->at = 0;
        t->n_new = z->h[0] * z->w[0];
        return;
    }
    for (int j = 0; j < 2 && si < S - 1; j++)
        for (int u = 0; u < U; u++)
            kept_extend(t, j, u, si);
    t->at += z->h[si] * z->w[si];
    t->n_new = si + 1 < S ? z->h[si + 1] * z->w[si + 1] : 0;
}

/* Every cut of ScaleKV's code (`kept`: [scale, layer, row, head, tokens])
 * but the last scale's (theirs cuts it, ours never caches it) keeps the
 * same tokens as ours, and ours cuts nowhere else. */
static void check_scalekv_run(const policy_ref_t *ref, const cJSON *run) {
    const char *name = cJSON_GetObjectItemCaseSensitive(run, "logits")->valuestring;
    int S;
    const int L = ref_tokens(ref->m, &S), H = ref->m->cfg.llm.num_heads,
              U = ref->m->cfg.llm.num_layers * H;
    scalekv_ctx_t c = {.ref = ref, .t = {.n_heads = H, .cap = L}};
    c.rows[0] = (kept_row_t){&c.t, 0};
    c.rows[1] = (kept_row_t){&c.t, 1};
    for (int j = 0; j < 2; j++) {
        c.t.ids[j] = malloc((size_t)U * L * sizeof(int));
        c.t.len[j] = calloc((size_t)U, sizeof(int));
        c.t.step_of[j] = malloc((size_t)U * sizeof(int));
        for (int u = 0; u < U; u++)
            c.t.step_of[j][u] = -1;
    }
    c.t.events = malloc((size_t)2 * U * S * sizeof *c.t.events);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    gen_request_t r;
    const double worst = run_reference(ref, run, &p, scalekv_after_step, &c, &r);
    int compared = 0, same = 0;
    const cJSON *w, *want_kept = worst >= 0 ? cJSON_GetObjectItemCaseSensitive(run, "kept") : NULL;
    cJSON_ArrayForEach(w, want_kept) {
        const int ws = cJSON_GetArrayItem(w, 0)->valueint, wl = cJSON_GetArrayItem(w, 1)->valueint,
                  wr = cJSON_GetArrayItem(w, 2)->valueint, wh = cJSON_GetArrayItem(w, 3)->valueint;
        const cJSON *wids = cJSON_GetArrayItem(w, 4);
        if (ws >= S - 1)
            continue;
        compared++;
        const kept_t *e = NULL;
        for (int i = 0; i < c.t.n_events && !e; i++)
            if (c.t.events[i].step == ws && c.t.events[i].layer == wl && c.t.events[i].row == wr &&
                c.t.events[i].head == wh)
                e = &c.t.events[i];
        int equal = e && e->n == cJSON_GetArraySize(wids);
        for (int i = 0; equal && i < e->n; i++)
            equal = e->ids[i] == cJSON_GetArrayItem(wids, i)->valueint;
        same += equal;
        CHECK_MSG(equal, "run %s: scale %d layer %d row %d head %d keeps %d tokens, theirs %d%s",
                  name, ws, wl, wr, wh, e ? e->n : -1, cJSON_GetArraySize(wids),
                  e ? " (different ones)" : "");
    }
    if (worst >= 0) {
        CHECK_MSG(compared == c.t.n_events, "run %s: %d cuts, theirs %d", name, c.t.n_events,
                  compared);
        printf("scalekv %g, prompt %d (%d tokens): %d of %d cuts keep their tokens (%d ours), "
               "logits within %.3g\n",
               p.budget, cJSON_GetObjectItemCaseSensitive(run, "prompt")->valueint, L, same,
               compared, c.t.n_events, worst);
        gen_request_free(&r);
    }
    for (int i = 0; i < c.t.n_events; i++)
        free(c.t.events[i].ids);
    free(c.t.events);
    for (int j = 0; j < 2; j++) {
        free(c.t.ids[j]);
        free(c.t.len[j]);
        free(c.t.step_of[j]);
    }
}

/* HeatKV: after each scale, what each (row, layer, head) caches against
 * their schedule's `removed` for the next scale (source scale -> layer ->
 * heads whose unit is gone): the sink scales, and each prunable scale whose
 * unit stays. Scale sizes add up uniquely here, so the length tells the
 * scales. */
typedef struct heatkv_ctx {
    const policy_ref_t *ref;
    const cJSON *removed;
    int sinks, heads, differ;
} heatkv_ctx_t;

static void heatkv_after_step(void *ctx, gen_request_t *r, int si) {
    heatkv_ctx_t *c = ctx;
    const model_t *m = c->ref->m;
    const image_size_t *z = &m->cfg.image.sizes[0];
    const int H = m->cfg.llm.num_heads;
    char t1[16];
    snprintf(t1, sizeof t1, "%d", si + 1);
    const cJSON *next =
        si < 0 || si >= z->n_scales - 1 ? NULL : cJSON_GetObjectItemCaseSensitive(c->removed, t1);
    for (int l = 0; next && l < m->cfg.llm.num_layers; l++)
        for (int h = 0; h < H; h++) {
            int want = 0;
            for (int s = 0; s <= si; s++) {
                char ks[16], kl[16];
                snprintf(ks, sizeof ks, "%d", s);
                snprintf(kl, sizeof kl, "%d", l);
                const cJSON *gone = cJSON_GetObjectItemCaseSensitive(
                                cJSON_GetObjectItemCaseSensitive(next, ks), kl),
                            *g;
                int is_gone = 0;
                cJSON_ArrayForEach(g, gone) is_gone |= g->valueint == h;
                want += s < c->sinks || !is_gone ? z->h[s] * z->w[s] : 0;
            }
            for (int j = 0; j < 2; j++) {
                const int len = r->seq[j].heads[l * H + h].len;
                c->heads++;
                c->differ += len != want;
                CHECK_MSG(len == want,
                          "after scale %d, row %d layer %d head %d caches %d tokens, theirs %d", si,
                          j, l, h, len, want);
            }
        }
}

static void check_heatkv_run(const policy_ref_t *ref, const cJSON *run, int sinks) {
    heatkv_ctx_t c = {ref, cJSON_GetObjectItemCaseSensitive(run, "removed"), sinks, 0, 0};
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_HEATKV);
    p.sink_scales = sinks;
    gen_request_t r;
    int S;
    const int L = ref_tokens(ref->m, &S);
    const double worst = run_reference(ref, run, &p, heatkv_after_step, &c, &r);
    if (worst < 0)
        return;
    printf("heatkv %g, prompt %d (%d tokens): %d of %d (scale, row, layer, head) caches hold "
           "their scales, logits within %.3g\n",
           p.budget, cJSON_GetObjectItemCaseSensitive(run, "prompt")->valueint, L,
           c.heads - c.differ, c.heads, worst);
    gen_request_free(&r);
}

/* The golden cases' ids and bits as a reference's (stride 1: every token). */
static int golden_ref(policy_ref_t *ref, safetensors_t *file, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    ar_error_t err = {{0}};
    if (safetensors_open(file, path, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return -1;
    }
    *ref = (policy_ref_t){.m = &model, .pool = &pool, .st = file, .stride = 1};
    for (int j = 0; j < 2 && j < n_cases; j++) {
        ref->ids[j] = cases[j].ids;
        ref->n_ids[j] = cases[j].n_ids;
        ref->bits[j] = cases[j].bits;
    }
    return cases[0].size == 0 && cases[1].size == 0 ? 0 : -1;
}

/* ScaleKV as its public code runs it (StargazerX0/ScaleKV's ScaleKVCluster
 * on the official Infinity; the fixture and how it was made: scalekv.json,
 * scalekv.safetensors and the README beside them): teacher-forced on both
 * prompts at two budgets, with the budgets our calibration gives (given to
 * their code), every (scale, layer, CFG row, head) keeps the tokens theirs
 * keeps, and the logits of both rows after pruning are theirs within
 * LOGIT_TOL. Folders without scalekv.json skip it. */
static void test_scalekv_matches_public_code(void) {
    cJSON *root = read_json("scalekv.json");
    policy_ref_t ref;
    safetensors_t file;
    if (!root)
        return;
    const kv_calibration_t *c = forced_calibration(root);
    if (c && golden_ref(&ref, &file, "scalekv.safetensors") == 0) {
        kv_calibration_set_t one = {.n = 1, .c = {*c}};
        model.cfg.kv_calibrations = &one;
        const cJSON *run;
        int n_runs = 0;
        cJSON_ArrayForEach(run, cJSON_GetObjectItemCaseSensitive(root, "runs")) {
            if (!REFERENCE_RUNS_ONE || n_runs++ == 0)
                check_scalekv_run(&ref, run);
        }
        model.cfg.kv_calibrations = NULL;
        safetensors_close(&file);
    }
    cJSON_Delete(root);
}

/* HeatKV as its public code runs it (arm-research/heatkv's real pruning,
 * scale-specific, on the official Infinity with the orderings of its own
 * calibration; how it was made: heatkv.json and the README): teacher-forced
 * on both prompts at two budgets, every (CFG row, layer, head) caches after
 * each scale the source scales their schedule keeps for the next, and the
 * logits of both rows are theirs within LOGIT_TOL. */
static void test_heatkv_matches_public_code(void) {
    cJSON *root = read_json("heatkv.json");
    policy_ref_t ref;
    safetensors_t file;
    if (!root)
        return;
    const kv_calibration_t *c = forced_calibration(root);
    if (c && golden_ref(&ref, &file, "heatkv.safetensors") == 0) {
        kv_calibration_set_t one = {.n = 1, .c = {*c}};
        model.cfg.kv_calibrations = &one;
        const int sinks = cJSON_GetObjectItemCaseSensitive(root, "sink_scales")->valueint;
        const cJSON *run;
        int n_runs = 0;
        /* With one run: the third, at 20%, where some units of a scale stay
         * and others go. */
        cJSON_ArrayForEach(run, cJSON_GetObjectItemCaseSensitive(root, "runs")) {
            if (!REFERENCE_RUNS_ONE || n_runs++ == 2)
                check_heatkv_run(&ref, run, sinks);
        }
        model.cfg.kv_calibrations = NULL;
        safetensors_close(&file);
    }
    cJSON_Delete(root);
}

/* dir's model with one size of the given scales (a temporary directory:
 * arserve.json rewritten, the weights and tokenizer linked), loaded into
 * *m with a pool for two full requests; the directory's path into tmp. */
static int load_resized(model_t *m, kv_pool_t *p, const cJSON *scales, const cJSON *rope,
                        const char *size, char *tmp) {
    char path[2048], target[PATH_MAX];
    ar_error_t err = {{0}};
    strcpy(tmp, "/tmp/arserve-test-XXXXXX");
    if (!mkdtemp(tmp))
        return -1;
    snprintf(path, sizeof path, "%s/arserve.json", dir);
    FILE *f = fopen(path, "rb");
    char *text = malloc(1 << 20);
    const size_t got = f && text ? fread(text, 1, (1 << 20) - 1, f) : 0;
    if (f)
        fclose(f);
    if (!text)
        return -1;
    text[got] = 0;
    cJSON *cfg = cJSON_Parse(text);
    free(text);
    cJSON *image = cJSON_GetObjectItemCaseSensitive(cfg, "image"), *one = cJSON_CreateObject(),
          *sizes = cJSON_CreateArray();
    cJSON_AddStringToObject(one, "name", size);
    cJSON_AddItemToObject(one, "scales", cJSON_Duplicate(scales, 1));
    cJSON_AddItemToObject(one, "rope_grid", cJSON_Duplicate(rope, 1));
    cJSON_AddItemToArray(sizes, one);
    cJSON_ReplaceItemInObjectCaseSensitive(image, "sizes", sizes);
    cJSON_ReplaceItemInObjectCaseSensitive(image, "default_size", cJSON_CreateString(size));
    char *out = cJSON_Print(cfg);
    cJSON_Delete(cfg);
    snprintf(path, sizeof path, "%s/arserve.json", tmp);
    f = fopen(path, "wb");
    const int wrote = f && out && fputs(out, f) >= 0;
    if (f)
        fclose(f);
    free(out);
    static const char *const linked[] = {"model.safetensors", "tokenizer.json"};
    int ok = wrote;
    for (int i = 0; i < 2 && ok; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, linked[i]);
        ok = realpath(path, target) != NULL;
        snprintf(path, sizeof path, "%s/%s", tmp, linked[i]);
        ok = ok && symlink(target, path) == 0;
    }
    if (!ok || model_load(m, tmp, be, &err) != AR_OK) {
        CHECK_MSG(0, "the resized model does not load: %s", err.msg);
        return -1;
    }
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    const int bt = planner_block_tokens(&m->cfg);
    planner_plan_t plan;
    if (planner_plan_sized(&plan, &m->cfg, &full, 1, 0, bt, planner_kv_f32, NULL, &err) != AR_OK) {
        model_free(m);
        return -1;
    }
    const int blocks =
        2 * (int)(plan.peak_bytes / kv_pool_block_bytes(bt, m->cfg.llm.head_dim, DTYPE_F32));
    planner_plan_free(&plan);
    if (kv_pool_init(p, be, blocks, bt, m->cfg.llm.head_dim, DTYPE_F32, &err) != AR_OK) {
        model_free(m);
        return -1;
    }
    return 0;
}

static void unlink_resized(const char *tmp) {
    static const char *const files[] = {"arserve.json", "model.safetensors", "tokenizer.json"};
    char path[2048];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", tmp, files[i]);
        unlink(path);
    }
    rmdir(tmp);
}

/* The same checks on a schedule with more scales (schedule_025.json: the
 * '0.25M' one, 10 scales, 2,521 tokens, where 4% is above the sinks and
 * the window): this model with that schedule, its own forced bits, HeatKV's
 * calibration orderings (compute_scas) equal to ours, then ScaleKV's cuts
 * and HeatKV's schedule at 4%, 10% and 20%, every 7th token's logits. */
static void test_policies_on_a_longer_schedule(void) {
    cJSON *root = read_json("schedule_025.json");
    if (!root)
        return;
    model_t m;
    kv_pool_t p;
    char tmp[64], path[1024];
    if (load_resized(&m, &p, cJSON_GetObjectItemCaseSensitive(root, "scales"),
                     cJSON_GetObjectItemCaseSensitive(root, "rope_grid"),
                     cJSON_GetObjectItemCaseSensitive(root, "size")->valuestring, tmp) != 0) {
        unlink_resized(tmp);
        cJSON_Delete(root);
        return;
    }
    snprintf(path, sizeof path, "%s/schedule_025.safetensors", dir);
    safetensors_t file;
    ar_error_t err = {{0}};
    int S;
    const int L = ref_tokens(&m, &S), T = m.cfg.llm.num_layers * m.cfg.llm.num_heads;
    policy_ref_t ref = {.m = &m, .pool = &p, .st = &file};
    ref.stride = cJSON_GetObjectItemCaseSensitive(root, "logit_stride")->valueint;
    int *bits[2] = {0};
    const char *text[2];
    kv_calibration_t c;
    const int opened = safetensors_open(&file, path, &err) == AR_OK;
    CHECK_MSG(opened, "%s", err.msg);
    for (int j = 0; opened && j < 2; j++) {
        char key[16];
        snprintf(key, sizeof key, "bits_%d", j);
        const st_tensor_t *t = safetensors_find(&file, key);
        bits[j] = malloc((size_t)L * m.cfg.image.bits * sizeof(int));
        for (int i = 0; t && t->dtype == DTYPE_U8 && i < L * m.cfg.image.bits; i++)
            bits[j][i] = ((const uint8_t *)t->data)[i];
        ref.bits[j] = t && t->shape[0] == L ? bits[j] : NULL;
        ref.ids[j] = cases[j].ids;
        ref.n_ids[j] = cases[j].n_ids;
        text[j] =
            cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "prompts"), j)->valuestring;
    }
    const int ran = opened && ref.bits[0] && ref.bits[1] &&
                    calibration_run_forced(&m, text, (const int *const *)bits, 2, 0, NULL, NULL, &c,
                                           &err) == AR_OK;
    CHECK_MSG(ran, "calibration on the longer schedule: %s", err.msg);
    if (ran) {
        /* compute_scas's orderings of the prunable source scales */
        const int sinks = cJSON_GetObjectItemCaseSensitive(root, "sink_scales")->valueint;
        const cJSON *order = cJSON_GetObjectItemCaseSensitive(root, "scas_order"), *o;
        int src = sinks, same = cJSON_GetArraySize(order) == S - 1 - sinks;
        cJSON_ArrayForEach(o, order) {
            for (int i = 0; i < T; i++)
                same &= cJSON_GetArrayItem(o, i)->valueint == c.scas_order[(size_t)src * T + i];
            src++;
        }
        CHECK_MSG(same, "S-CAS orderings on %d scales differ from HeatKV's", S);
        kv_calibration_set_t one = {.n = 1, .c = {c}};
        m.cfg.kv_calibrations = &one;
        const cJSON *run;
        int n_runs = 0; /* with one run: 4%, the window's and early pruning's */
        cJSON_ArrayForEach(run, cJSON_GetObjectItemCaseSensitive(root, "scalekv")) {
            if (!REFERENCE_RUNS_ONE || n_runs++ == 0)
                check_scalekv_run(&ref, run);
        }
        n_runs = 0;
        cJSON_ArrayForEach(run, cJSON_GetObjectItemCaseSensitive(root, "heatkv")) {
            if (!REFERENCE_RUNS_ONE || n_runs++ == 0)
                check_heatkv_run(&ref, run, sinks);
        }
        m.cfg.kv_calibrations = NULL;
        kv_calibration_free(&c);
    }
    if (opened)
        safetensors_close(&file);
    free(bits[0]);
    free(bits[1]);
    kv_pool_free(&p);
    model_free(&m);
    unlink_resized(tmp);
    cJSON_Delete(root);
}

/* T5's relative-position bucket against PyPI transformers' for every
 * distance to +-600 (tests/golden/t5_buckets/, gen.py beside it): the
 * golden prompts are at most 16 tokens, so only this reaches the log-spaced
 * buckets past max_distance, where the last one is half - 1 (one more would
 * be another direction's, and past the table at the top). */
static void test_t5_buckets_match_transformers(void) {
    ar_error_t err = {{0}};
    size_t len;
    char *text = file_read_all("tests/golden/t5_buckets/buckets.json", NULL, 1 << 20, &len, &err);
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK_MSG(root != NULL, "tests/golden/t5_buckets/buckets.json: %s",
              err.msg[0] ? err.msg : "not JSON");
    const int span = root ? cJSON_GetObjectItem(root, "span")->valueint : 0;
    const cJSON *config, *configs = root ? cJSON_GetObjectItem(root, "configs") : NULL;
    int n_configs = 0, wrong = 0;
    cJSON_ArrayForEach(config, configs) {
        const int nb = cJSON_GetObjectItem(config, "num_buckets")->valueint,
                  md = cJSON_GetObjectItem(config, "max_distance")->valueint;
        const cJSON *want = cJSON_GetObjectItem(config, "buckets");
        CHECK(cJSON_GetArraySize(want) == 2 * span + 1);
        for (int rel = -span; rel <= span && wrong < 5; rel++) {
            const int w = cJSON_GetArrayItem(want, rel + span)->valueint,
                      got = inf_t5_bucket(rel, nb, md);
            wrong += got != w;
            CHECK_MSG(got == w,
                      "%d buckets, max distance %d: distance %d gives %d, transformers %d", nb, md,
                      rel, got, w);
        }
        n_configs++;
    }
    CHECK(n_configs == 2);
    cJSON_Delete(root);
}

/* Every test on the model in dir; 0 when its data loaded. */
static int run_folder(void) {
    printf("== %s\n", dir);
    if (load() != 0)
        return -1;
    n_cases = 0;
    const int with_second = safetensors_find(&st, "tf_image_1") != NULL;
    if (case_load(&cases[n_cases++], "tf", 0, "0") ||
        (with_second && case_load(&cases[n_cases++], "tf", 1, "1")) ||
        case_load(&cases[n_cases++], "tf_wide", 0, "0"))
        return -1;
    TEST_RUN(test_t5_output_matches);
    TEST_RUN(test_teacher_forced_logits_match);
    TEST_RUN(test_inputs_and_latents_match);
    TEST_RUN(test_decoded_images_match);
    TEST_RUN(test_every_size_decodes);
    TEST_RUN(test_calibration_matches_heatkv);
    TEST_RUN(test_scalekv_matches_public_code);
    TEST_RUN(test_heatkv_matches_public_code);
#ifdef ARSERVE_TEST_CUDA_EMU
    printf("skip: test_policies_on_a_longer_schedule under the emulator (its backend ops are the "
           "runs above; the CPU run checks it)\n");
    (void)test_policies_on_a_longer_schedule;
#else
    TEST_RUN(test_policies_on_a_longer_schedule);
#endif
#ifdef ARSERVE_TEST_CUDA_EMU
    /* The emulated CUDA backend is about ten times slower: the sampler runs
     * on the host (its check repeats the teacher-forced passes above), and
     * the batch's GEMM shapes are the same in both folders, so those two
     * run on the CPU only, and the batch test on the first folder. */
    printf("skip: test_sampled_bits_match under the emulator (host sampling; the CPU run "
           "checks it)\n");
    (void)test_sampled_bits_match;
    if (dir == dirs[0])
        TEST_RUN(test_two_sizes_in_one_batch_equal_alone);
#else
    TEST_RUN(test_sampled_bits_match);
    TEST_RUN(test_two_sizes_in_one_batch_equal_alone);
#endif
    for (int i = 0; i < n_cases; i++)
        case_free(&cases[i]);
    calibration_drop();
    kv_pool_free(&pool);
    model_free(&model);
    safetensors_close(&st);
    be->destroy(be);
    return 0;
}

int main(void) {
    TEST_RUN(test_t5_buckets_match_transformers);
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        dir = dirs[i];
        if (run_folder() != 0) {
            printf("0 passed, 1 failed\n");
            return 1;
        }
    }
    return TEST_SUMMARY();
}
