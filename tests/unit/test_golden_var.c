/* The scale family against the official VAR code (FoundationVision/VAR at
 * a tiny random configuration; the data and how it was made:
 * tests/golden/var_tiny/README.md): teacher-forced logits of both CFG rows
 * within 1e-4 at every scale, the latent map f_hat after every scale, the
 * identical greedy token pyramid under VAR's guidance ramp, the decoded
 * image within 1/255; Phi's tick rule on VAR's 10 and 13 scales; and a
 * ragged batch (a second request joining at a later scale) giving each
 * request what it gives alone. ARSERVE_TEST_BACKEND=cuda runs the same
 * checks on the CUDA backend (tests/test_backend.h). */
#include <math.h>
#include <stdlib.h>

#include "engine/family/family_scale.h"
#include "engine/format/safetensors.h"
#include "engine/generate.h"
#include "engine/planner.h"
#include "tests/test.h"
#include "tests/test_backend.h"

#define LOGIT_TOL 1e-4
#define FHAT_TOL 1e-5

static const char *dir = "tests/golden/var_tiny";

typedef struct golden {
    safetensors_t st;
    int labels[2], L, V, E, G, S, H, W;
    const int32_t *tf_tokens, *sample_tokens;
    const float *tf_cond, *tf_uncond, *tf_fhat, *tf_image, *sample_fhat, *sample_image;
    float cfg;
} golden_t;

static model_t model;
static backend_t *be;
static golden_t g;
static kv_pool_t pool;
static int *tf_tokens, *sample_tokens; /* as int */

static const float *get_f32(const char *name, int ndim, const int64_t *shape, ar_error_t *err) {
    const st_tensor_t *t;
    return safetensors_get(&g.st, name, ndim, shape, &t, err) == AR_OK ? t->data : NULL;
}

static int *get_i32(const char *name, int n, ar_error_t *err) {
    const st_tensor_t *t;
    if (safetensors_get_any(&g.st, name, 1, (int64_t[]){n}, &t, err) != AR_OK ||
        t->dtype != DTYPE_I32) {
        if (!err->msg[0])
            ar_errorf(err, "%s is not I32", name);
        return NULL;
    }
    int *out = malloc((size_t)n * sizeof *out);
    for (int i = 0; i < n; i++)
        out[i] = ((const int32_t *)t->data)[i];
    return out;
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
    if (safetensors_open(&g.st, path, &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    const model_config_t *c = &model.cfg;
    g.L = model_image_tokens(c);
    g.V = c->image.codebook_size;
    g.E = c->image.embed_dim;
    g.G = c->image.grid_height;
    g.S = c->image.n_scales;
    g.H = model_config_image_height(c);
    g.W = model_config_image_width(c);
    int *labels = get_i32("labels", 2, &err);
    tf_tokens = get_i32("tf_tokens", g.L, &err);
    sample_tokens = labels && tf_tokens ? get_i32("sample_tokens", g.L, &err) : NULL;
    const float *cfg = get_f32("sample_cfg", 1, (int64_t[]){1}, &err);
    if (!labels || !tf_tokens || !sample_tokens || !cfg ||
        !(g.tf_cond = get_f32("tf_logits_cond", 2, (int64_t[]){g.L, g.V}, &err)) ||
        !(g.tf_uncond = get_f32("tf_logits_uncond", 2, (int64_t[]){g.L, g.V}, &err)) ||
        !(g.tf_fhat = get_f32("tf_fhat", 4, (int64_t[]){g.S, g.E, g.G, g.G}, &err)) ||
        !(g.sample_fhat = get_f32("sample_fhat", 4, (int64_t[]){g.S, g.E, g.G, g.G}, &err)) ||
        !(g.tf_image = get_f32("tf_image", 3, (int64_t[]){3, g.H, g.W}, &err)) ||
        !(g.sample_image = get_f32("sample_image", 3, (int64_t[]){3, g.H, g.W}, &err))) {
        fprintf(stderr, "golden data: %s\n", err.msg);
        free(labels);
        return -1;
    }
    g.labels[0] = labels[0];
    g.labels[1] = labels[1];
    g.cfg = cfg[0];
    free(labels);
    /* Room for six requests' full caches (the planner's own figure). */
    planner_plan_t plan;
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    const int bt = planner_block_tokens(c);
    if (planner_plan(&plan, c, &full, 1, bt, NULL, &err) != AR_OK ||
        kv_pool_init(
            &pool, be,
            6 * (int)(plan.peak_bytes / kv_pool_block_bytes(bt, c->llm.head_dim, DTYPE_F32)), bt,
            c->llm.head_dim, DTYPE_F32, &err) != AR_OK) {
        fprintf(stderr, "pool: %s\n", err.msg);
        return -1;
    }
    planner_plan_free(&plan);
    return 0;
}

static int start(gen_request_t *r, int label, const sampler_params_t *sp, const int *forced) {
    ar_error_t err = {{0}};
    int cond, uncond, n;
    if (model_prompt_from_class(&model, label, &cond, &uncond, &n, &err) != AR_OK ||
        gen_request_init(r, &model, &pool, NULL, &cond, &uncond, n, sp, 1, 0, &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    r->forced = forced;
    return 0;
}

static int run(gen_request_t *r) {
    gen_request_t *batch[] = {r};
    ar_error_t err = {{0}};
    while (!gen_request_done(r))
        if (gen_step(batch, 1, &err) != AR_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return -1;
        }
    return 0;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        if (e > worst || isnan(e))
            worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

/* Scale si's first token. */
static int scale_at(int si) {
    int at = 0;
    for (int i = 0; i < si; i++)
        at += model.cfg.image.scales[i] * model.cfg.image.scales[i];
    return at;
}

static void test_teacher_forced_logits_match(void) {
    sampler_params_t sp = {g.cfg, 1.0f, 1, 1.0f};
    gen_request_t r;
    if (start(&r, g.labels[0], &sp, tf_tokens)) {
        CHECK(0);
        return;
    }
    gen_request_t *batch[] = {&r};
    ar_error_t err = {{0}};
    double worst = 0;
    while (!gen_request_done(&r)) {
        const int si = r.step, at = scale_at(si), pp = scale_at(si + 1) - at;
        CHECK_MSG(gen_step(batch, 1, &err) == AR_OK, "%s", err.msg);
        const double ec = max_abs_diff(r.logits, g.tf_cond + (size_t)at * g.V, (size_t)pp * g.V);
        const double eu = max_abs_diff(r.logits + (size_t)pp * g.V, g.tf_uncond + (size_t)at * g.V,
                                       (size_t)pp * g.V);
        CHECK_MSG(ec <= LOGIT_TOL && eu <= LOGIT_TOL, "scale %d: logits differ by %g (cond), %g",
                  si, ec, eu);
        worst = fmax(worst, fmax(ec, eu));
    }
    printf("largest logit error over %d tokens x 2 rows x %d codes: %.3g\n", g.L, g.V, worst);
    gen_request_free(&r);
}

/* f_hat after every scale, for the teacher-forced pyramid and for the
 * sampled one (the accumulation, bicubic upsampling and Phi). */
static void test_latent_after_each_scale_matches(void) {
    const size_t n = (size_t)g.E * g.G * g.G;
    float *f = malloc(n * sizeof *f);
    ar_error_t err = {{0}};
    double worst = 0;
    for (int run_ = 0; run_ < 2; run_++)
        for (int si = 1; si <= g.S; si++) {
            const int *tokens = run_ ? sample_tokens : tf_tokens;
            const float *want = (run_ ? g.sample_fhat : g.tf_fhat) + (size_t)(si - 1) * n;
            CHECK_MSG(scale_latent(&model, tokens, si, f, &err) == AR_OK, "%s", err.msg);
            const double e = max_abs_diff(f, want, n);
            CHECK_MSG(e <= FHAT_TOL, "%s pyramid, after scale %d: f_hat off by %g",
                      run_ ? "sampled" : "teacher-forced", si - 1, e);
            worst = fmax(worst, e);
        }
    printf("largest f_hat error: %.3g\n", worst);
    free(f);
}

static void test_greedy_pyramid_matches(void) {
    sampler_params_t sp = {g.cfg, 1.0f, 1, 1.0f};
    gen_request_t r;
    if (start(&r, g.labels[1], &sp, NULL) || run(&r)) {
        CHECK(0);
        return;
    }
    int first_diff = -1;
    for (int i = 0; i < g.L && first_diff < 0; i++)
        if (r.tokens[i] != sample_tokens[i])
            first_diff = i;
    CHECK_MSG(first_diff < 0, "greedy token %d: engine %d, reference %d", first_diff,
              r.tokens[first_diff < 0 ? 0 : first_diff],
              sample_tokens[first_diff < 0 ? 0 : first_diff]);
    gen_request_free(&r);
}

/* The decoder from f_hat: float output and 8-bit pixels of both runs. */
static void test_decoded_images_match(void) {
    const size_t n = (size_t)g.H * g.W * 3, nf = (size_t)g.E * g.G * g.G;
    uint8_t *rgb = malloc(n);
    float *pix = malloc(n * sizeof *pix), *f = malloc(nf * sizeof *f);
    ar_error_t err = {{0}};
    for (int run_ = 0; run_ < 2; run_++) {
        const float *want = run_ ? g.sample_image : g.tf_image;
        CHECK_MSG(scale_latent(&model, run_ ? sample_tokens : tf_tokens, g.S, f, &err) == AR_OK,
                  "%s", err.msg);
        /* f_hat into the backend's memory, where the decoder reads it. */
        struct vq_work *w = model_draw_work(&model, &err);
        CHECK_MSG(w != NULL, "%s", err.msg);
        if (!w)
            break;
        be->upload(be, w->latent, f, nf * sizeof *f);
        CHECK_MSG(vq_decode_latent(&scale_net_of(&model)->dec, w, w->latent, rgb, pix, &err) ==
                      AR_OK,
                  "%s", err.msg);
        double worst = 0;
        int worst_px = 0;
        for (size_t i = 0; i < n; i++) {
            const double x = fmin(fmax(pix[i], -1.0), 1.0);
            worst = fmax(worst, fabs((x + 1) / 2 - want[i]));
            const size_t ch = i / ((size_t)g.H * g.W), yx = i % ((size_t)g.H * g.W);
            const int ref = (int)(want[i] * 255.0); /* the same truncation */
            worst_px =
                abs(rgb[yx * 3 + ch] - ref) > worst_px ? abs(rgb[yx * 3 + ch] - ref) : worst_px;
        }
        printf("%s image: largest error %.3g, pixels within %d/255\n",
               run_ ? "sampled" : "teacher-forced", worst, worst_px);
        CHECK_MSG(worst <= 2e-5, "image %d off by %g", run_, worst);
        CHECK_MSG(worst_px <= 1, "image %d: pixels differ by %d", run_, worst_px);
    }
    free(rgb);
    free(pix);
    free(f);
}

/* The tick rule on the reference's own scale counts (numpy's argmin over
 * its linspace ticks; scales 2 and 7 of 10 are ties that go up). */
static void test_phi_choice_matches_reference(void) {
    static const int s10k4[] = {0, 0, 1, 1, 1, 2, 2, 3, 3, 3};
    static const int s13k4[] = {0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3};
    static const int s10k3[] = {0, 0, 0, 0, 1, 1, 1, 2, 2, 2};
    for (int si = 0; si < 10; si++) {
        CHECK_MSG(scale_phi_index(4, 10, si) == s10k4[si], "K=4 S=10 si=%d", si);
        CHECK_MSG(scale_phi_index(3, 10, si) == s10k3[si], "K=3 S=10 si=%d", si);
        CHECK(scale_phi_index(1, 10, si) == 0);
    }
    for (int si = 0; si < 13; si++)
        CHECK_MSG(scale_phi_index(4, 13, si) == s13k4[si], "K=4 S=13 si=%d", si);
}

/* Request b joins one scale after a and another two after: every forward
 * pass mixes scales (ragged rows), and each request's tokens, logits and
 * image equal those it gets alone. */
static void test_ragged_batch_equals_alone(void) {
    sampler_params_t sp = {g.cfg, 1.0f, 0, 1.0f}; /* sampled, not greedy */
    const int n_px = g.H * g.W * 3;
    gen_request_t alone[3], mixed[3];
    int labels[3] = {g.labels[0], g.labels[1], 0};
    uint8_t *img_alone = malloc((size_t)3 * n_px), *img_mixed = malloc((size_t)3 * n_px);
    ar_error_t err = {{0}};
    for (int i = 0; i < 3; i++) {
        if (start(&alone[i], labels[i], &sp, NULL) || run(&alone[i])) {
            CHECK(0);
            return;
        }
        CHECK(gen_decode(&alone[i], img_alone + (size_t)i * n_px, &err) == AR_OK);
    }
    /* The three finished requests keep their caches until freed: the pool has room for six. */
    for (int i = 0; i < 3; i++)
        if (start(&mixed[i], labels[i], &sp, NULL)) {
            CHECK(0);
            return;
        }
    static const int joins[3] = {0, 1, 3};
    for (int iter = 0; !gen_request_done(&mixed[0]) || !gen_request_done(&mixed[1]) ||
                       !gen_request_done(&mixed[2]);
         iter++) {
        gen_request_t *batch[3];
        int n = 0;
        for (int i = 0; i < 3; i++)
            if (iter >= joins[i] && !gen_request_done(&mixed[i]))
                batch[n++] = &mixed[i];
        if (gen_step(batch, n, &err) != AR_OK) {
            CHECK_MSG(0, "%s", err.msg);
            return;
        }
    }
    for (int i = 0; i < 3; i++) {
        CHECK_MSG(!memcmp(alone[i].tokens, mixed[i].tokens, (size_t)g.L * sizeof(int)),
                  "request %d: tokens differ in a ragged batch", i);
        CHECK(gen_decode(&mixed[i], img_mixed + (size_t)i * n_px, &err) == AR_OK);
        CHECK_MSG(!memcmp(img_alone + (size_t)i * n_px, img_mixed + (size_t)i * n_px, (size_t)n_px),
                  "request %d: image differs in a ragged batch", i);
        gen_request_free(&alone[i]);
        gen_request_free(&mixed[i]);
    }
    CHECK_MSG(kv_pool_blocks_in_use(&pool) == 0, "%d blocks still in use",
              kv_pool_blocks_in_use(&pool));
    free(img_alone);
    free(img_mixed);
}

/* Request b, teacher-forced, alone and beside a request one scale ahead of
 * it: with the backend asked for batch invariance (backend.h), the same
 * logits at every scale, bit for bit (each request's rows a GEMM of their
 * own where the backend's rows are not independent); without it (one GEMM
 * over both requests' rows), still bit for bit on the CPU, whose prepared
 * Linears keep rows independent, and within rounding elsewhere. */
static void check_logits_beside_another(int batch_invariant) {
    sampler_params_t sp = {g.cfg, 1.0f, 0, 1.0f};
    gen_request_t alone, b, other;
    ar_error_t err = {{0}};
    float *want[MODEL_MAX_SCALES] = {0};
    be->batch_invariant = batch_invariant;
    if (start(&alone, g.labels[1], &sp, tf_tokens)) {
        CHECK(0);
        return;
    }
    for (int si = 0; si < g.S; si++) {
        gen_request_t *one[] = {&alone};
        const size_t n = (size_t)2 * (scale_at(si + 1) - scale_at(si)) * g.V;
        CHECK(gen_step(one, 1, &err) == AR_OK);
        want[si] = malloc(n * sizeof(float));
        memcpy(want[si], alone.logits, n * sizeof(float));
    }
    gen_request_free(&alone);
    if (start(&other, g.labels[0], &sp, NULL) || start(&b, g.labels[1], &sp, tf_tokens)) {
        CHECK(0);
        return;
    }
    const int exact = batch_invariant || strcmp(be->name, "cpu") == 0;
    gen_request_t *first[] = {&other};
    CHECK(gen_step(first, 1, &err) == AR_OK);
    for (int si = 0; si < g.S; si++) {
        gen_request_t *batch[] = {&b, &other};
        const int n_req = gen_request_done(&other) ? 1 : 2;
        const size_t n = (size_t)2 * (scale_at(si + 1) - scale_at(si)) * g.V;
        CHECK_MSG(gen_step(batch, n_req, &err) == AR_OK, "%s", err.msg);
        const double d = max_abs_diff(b.logits, want[si], n);
        CHECK_MSG(exact ? !memcmp(b.logits, want[si], n * sizeof(float)) : d <= 1e-4,
                  "scale %d, batch_invariant %d: logits differ beside another request by %.3g", si,
                  batch_invariant, d);
        free(want[si]);
    }
    gen_request_free(&b);
    gen_request_free(&other);
    be->batch_invariant = 0;
}

/* Request b alone, teacher-forced, with batch invariance and without: the
 * same logits within rounding (a GEMM per sequence and per stacked matrix
 * against one over all). */
static void check_invariance_changes_only_rounding(void) {
    sampler_params_t sp = {g.cfg, 1.0f, 0, 1.0f};
    gen_request_t r[2];
    ar_error_t err = {{0}};
    for (int mode = 0; mode < 2; mode++)
        if (start(&r[mode], g.labels[1], &sp, tf_tokens)) {
            CHECK(0);
            return;
        }
    for (int si = 0; si < g.S; si++) {
        const size_t n = (size_t)2 * (scale_at(si + 1) - scale_at(si)) * g.V;
        for (int mode = 0; mode < 2; mode++) {
            gen_request_t *one[] = {&r[mode]};
            be->batch_invariant = mode;
            CHECK(gen_step(one, 1, &err) == AR_OK);
        }
        const double d = max_abs_diff(r[0].logits, r[1].logits, n);
        CHECK_MSG(d <= 1e-4, "scale %d: batch invariance changed the logits by %.3g", si, d);
    }
    be->batch_invariant = 0;
    gen_request_free(&r[0]);
    gen_request_free(&r[1]);
}

static void test_logits_do_not_depend_on_the_batch(void) {
    check_logits_beside_another(1);
    check_logits_beside_another(0);
    check_invariance_changes_only_rounding();
}

int main(void) {
    if (load() != 0) {
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_teacher_forced_logits_match);
    TEST_RUN(test_latent_after_each_scale_matches);
    TEST_RUN(test_greedy_pyramid_matches);
    TEST_RUN(test_decoded_images_match);
    TEST_RUN(test_phi_choice_matches_reference);
    TEST_RUN(test_ragged_batch_equals_alone);
    TEST_RUN(test_logits_do_not_depend_on_the_batch);
    kv_pool_free(&pool);
    model_free(&model);
    safetensors_close(&g.st);
    free(tf_tokens);
    free(sample_tokens);
    be->destroy(be);
    return TEST_SUMMARY();
}
