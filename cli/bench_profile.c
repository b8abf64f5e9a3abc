/* `arserve bench --profile`: the engine timed in-process at batch sizes 1,
 * 2, 4, .. max and under a few KV policies (so the tokens attended vary
 * apart from the batch), each iteration recorded with its cost features
 * (engine/cost_model.h); decoding and PNG encoding timed per image; a cost
 * table fitted and written. The step timed is gen_step, the function the
 * daemon's batcher calls for an iteration. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "cli/cli.h"
#include "engine/backend/backend.h"
#include "engine/cost_model.h"
#include "engine/format/png_io.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/model_family.h"

#define PROFILE_PROMPT "a red circle above a blue square"

bench_profile_opts_t bench_profile_defaults(void) {
    return (bench_profile_opts_t){.max_batch = 8, .threads = 0};
}

typedef struct samples {
    int n, cap;
    cost_features_t *x;
    double *y;
} samples_t;

static int samples_add(samples_t *s, const cost_features_t *f, double y) {
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 256;
        cost_features_t *x = realloc(s->x, (size_t)cap * sizeof *x);
        if (x)
            s->x = x;
        double *yy = x ? realloc(s->y, (size_t)cap * sizeof *yy) : NULL;
        if (!yy)
            return -1;
        s->y = yy;
        s->cap = cap;
    }
    s->x[s->n] = *f;
    s->y[s->n++] = y;
    return 0;
}

/* Runs `batch` images of one prompt under policy p to the end, one gen_step
 * per iteration, recording each; then decodes and encodes each image,
 * adding their times to *decode_s and *png_s. */
static int profile_batch(model_t *m, const kv_policy_params_t *p, int batch, const int *cond,
                         const int *uncond, int n_prompt, samples_t *s, double *decode_s,
                         double *png_s, ar_error_t *err) {
    kv_geometry_t g;
    model_geometry(&m->cfg, n_prompt, &g);
    const int bt = planner_block_tokens(&m->cfg);
    planner_plan_t pl;
    if (planner_plan(&pl, &m->cfg, p, n_prompt, bt, NULL, err) != AR_OK)
        return AR_ERR;
    const size_t block = kv_pool_block_bytes(bt, m->cfg.llm.head_dim, DTYPE_F32);
    kv_pool_t pool;
    gen_request_t *reqs = calloc((size_t)batch, sizeof *reqs);
    gen_request_t **ptrs = calloc((size_t)batch, sizeof *ptrs);
    const int w = model_config_image_width(&m->cfg), h = model_config_image_height(&m->cfg);
    uint8_t *rgb = malloc((size_t)w * h * 3);
    int rc = reqs && ptrs && rgb ? AR_OK : ar_errorf(err, "out of memory");
    int made = 0;
    if (rc == AR_OK)
        rc = kv_pool_init(&pool, m->be, (int)(pl.peak_bytes / block + 1) * batch + 1, bt,
                          m->cfg.llm.head_dim, DTYPE_F32, err);
    const int have_pool = rc == AR_OK;
    while (rc == AR_OK && made < batch) {
        rc = gen_request_init(&reqs[made], m, &pool, p, cond, uncond, n_prompt, &m->cfg.sampling,
                              (uint64_t)made + 1, 0, err);
        if (rc == AR_OK) {
            ptrs[made] = &reqs[made];
            made++;
        }
    }
    for (int t = 0; rc == AR_OK && t < pl.steps; t++) {
        cost_features_t f = {0};
        cost_features_add(&f, &g, &pl, t, batch);
        const double t0 = clock_now_s();
        rc = gen_step(ptrs, batch, err);
        if (rc == AR_OK && samples_add(s, &f, clock_now_s() - t0))
            rc = ar_errorf(err, "out of memory");
    }
    for (int i = 0; rc == AR_OK && i < batch; i++) {
        const double t0 = clock_now_s();
        rc = gen_decode(&reqs[i], rgb, err);
        const double t1 = clock_now_s();
        uint8_t *png = NULL;
        size_t len = 0;
        if (rc == AR_OK)
            rc = png_encode(rgb, w, h, &png, &len, err);
        *decode_s += t1 - t0;
        *png_s += clock_now_s() - t1;
        free(png);
    }
    for (int i = 0; i < made; i++)
        gen_request_free(&reqs[i]);
    if (have_pool)
        kv_pool_free(&pool);
    planner_plan_free(&pl);
    free(reqs);
    free(ptrs);
    free(rgb);
    return rc;
}

static int policy_fits(const model_t *m, const kv_policy_params_t *p, int n_prompt) {
    planner_plan_t pl;
    ar_error_t err = {{0}};
    if (planner_plan(&pl, &m->cfg, p, n_prompt, planner_block_tokens(&m->cfg), NULL, &err) != AR_OK)
        return 0;
    planner_plan_free(&pl);
    return 1;
}

int bench_profile_run(const bench_profile_opts_t *o) {
    char model_dir[PATH_MAX];
    if (o->model_dir)
        snprintf(model_dir, sizeof model_dir, "%s", o->model_dir);
    else if (cli_default_model(model_dir, sizeof model_dir))
        return 1;
    ar_error_t err = {{0}};
    backend_t *be = backend_open("cpu", (int)o->threads, &err);
    if (!be) {
        fprintf(stderr, "arserve bench --profile: %s\n", err.msg);
        return 1;
    }
    model_t m;
    if (model_load(&m, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "arserve bench --profile: %s\n", err.msg);
        be->destroy(be);
        return 1;
    }
    const char *family = model_family_of(&m.cfg)->name;
    const int scale = model_is_class_conditional(&m);
    /* The policies timed: full, and one that holds far fewer tokens. */
    char policies[256];
    snprintf(policies, sizeof policies, "%s",
             o->policies ? o->policies
             : scale     ? "full,streaming"
                         : "full,linear");
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt = 0;
    int rc = scale ? model_prompt_from_class(&m, 0, cond, uncond, &n_prompt, &err)
                   : model_prompt_from_text(&m, PROFILE_PROMPT, cond, uncond, &n_prompt, &err);
    samples_t s = {0};
    double decode_s = 0, png_s = 0;
    int images = 0;
    fprintf(stderr, "profiling %s (%s family) at batch 1..%lld under %s\n", model_dir, family,
            o->max_batch, policies);
    /* A first image, not recorded: the caches and the threads warm up. */
    if (rc == AR_OK) {
        samples_t warm = {0};
        double d = 0, p = 0;
        kv_policy_params_t full;
        kv_policy_defaults(&full, KV_POLICY_FULL);
        rc = profile_batch(&m, &full, 1, cond, uncond, n_prompt, &warm, &d, &p, &err);
        free(warm.x);
        free(warm.y);
    }
    for (char *save = NULL, *name = strtok_r(policies, ",", &save); rc == AR_OK && name;
         name = strtok_r(NULL, ",", &save)) {
        const int kind = kv_policy_parse(name);
        if (kind < 0) {
            rc = ar_errorf(&err, "--policies: '%s' is not a KV policy", name);
            break;
        }
        kv_policy_params_t p;
        kv_policy_defaults(&p, (kv_policy_kind_t)kind);
        /* A small model may not fit a policy's default budget: the
         * smallest of a few larger ones that it fits. */
        static const double BUDGETS[] = {0.25, 0.5, 0.75};
        for (int k = 0; kind != KV_POLICY_FULL && k < 3 && !policy_fits(&m, &p, n_prompt); k++)
            p.budget = BUDGETS[k];
        for (int b = 1; rc == AR_OK && b <= o->max_batch; b *= 2) {
            const double t0 = clock_now_s();
            rc = profile_batch(&m, &p, b, cond, uncond, n_prompt, &s, &decode_s, &png_s, &err);
            images += b;
            if (rc == AR_OK)
                fprintf(stderr, "  %-10s budget %.3g, batch %3d: %.2f s\n", name, p.budget, b,
                        clock_now_s() - t0);
        }
    }
    cost_table_t t = {0};
    if (rc == AR_OK && cost_table_fit(&t, s.x, s.y, s.n) != 0)
        rc = ar_errorf(&err, "too few iterations timed (%d) to fit the cost table", s.n);
    char why[512];
    if (rc == AR_OK) {
        snprintf(t.family, sizeof t.family, "%s", family);
        snprintf(t.source, sizeof t.source,
                 "arserve bench --profile --model %.120s --max-batch %lld --threads %lld (%s)",
                 model_dir, o->max_batch, o->threads, be->name);
        t.decode_s = decode_s / images;
        t.png_s = png_s / images;
        if (cost_table_save(&t, o->out, why, sizeof why) != 0)
            rc = ar_errorf(&err, "%s", why);
    }
    if (rc == AR_OK) {
        printf("cost table %s: step = %.3g s + %.3g s/sequence + %.3g s/KV token attended + %.3g "
               "s/new token + %.3g s/KV token scored; decode %.4f s/image, PNG %.4f s/image\n",
               o->out, t.coef[COST_COEF_INTERCEPT], t.coef[COST_COEF_SEQUENCE],
               t.coef[COST_COEF_KV_ATTENDED], t.coef[COST_COEF_NEW_TOKEN],
               t.coef[COST_COEF_KV_SCORED], t.decode_s, t.png_s);
        printf("fit over %d iterations: relative RMS error %.1f%%, largest %.1f%%\n", t.fit_samples,
               100 * t.fit_rel_rms, 100 * t.fit_max_rel);
    } else {
        fprintf(stderr, "arserve bench --profile: %s\n", err.msg);
    }
    free(s.x);
    free(s.y);
    model_free(&m);
    be->destroy(be);
    return rc == AR_OK ? 0 : 1;
}
