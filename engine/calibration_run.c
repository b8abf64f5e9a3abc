/* Calibration runs (calibration_run.h). */
#include "engine/calibration_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"
#include "engine/model_family.h"

static int by_value_desc(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Adds step t's mass (one query scale) into beta: per head, the mass of
 * each source scale's keys over the scale's queries (eq. 2's row mean);
 * and into htr the row mean of the KV_CALIBRATION_TOPK largest masses of
 * earlier keys (ScaleKV's history top-K ratio, from the summed mass). */
static void add_step(const kv_geometry_t *g, const float *mass, size_t cap, int t, double *beta,
                     double *htr, float *scratch) {
    const int K = g->n_segments, T = g->n_layers * g->n_heads;
    const double rows = g->segment_tokens[t];
    int history = g->n_prompt; /* keys before scale t */
    for (int i = 0; i < t; i++)
        history += g->segment_tokens[i];
    for (int h = 0; h < T; h++) {
        const float *m = mass + (size_t)h * cap;
        memcpy(scratch, m, (size_t)history * sizeof *scratch);
        qsort(scratch, (size_t)history, sizeof *scratch, by_value_desc);
        double top = 0;
        for (int i = 0; i < KV_CALIBRATION_TOPK && i < history; i++)
            top += scratch[i];
        htr[(size_t)h * K + t] += top / rows;
        int at = g->n_prompt;
        for (int src = 0; src <= t; src++) {
            double sum = 0;
            for (int i = 0; i < g->segment_tokens[src]; i++)
                sum += m[at + i];
            at += g->segment_tokens[src];
            beta[((size_t)h * K + t) * K + src] += sum / rows;
        }
    }
}

/* The condition rows of prompt p: text, or a class by name or number. */
static int prompt_rows(const model_t *m, const char *p, int *cond, int *uncond, int *len,
                       ar_error_t *err) {
    if (!model_is_class_conditional(m))
        return model_prompt_from_text(m, p, cond, uncond, len, err);
    const int label = model_class_parse(m, p);
    if (label < 0)
        return ar_errorf(err,
                         "'%s' is neither a class name of the model nor a class number from 0 "
                         "to %d",
                         p, m->cfg.condition.num_classes - 1);
    return model_prompt_from_class(m, label, cond, uncond, len, err);
}

static int run(model_t *m, const char *const *prompts, const int *const *forced, int n, int size,
               dtype_t kv_dtype, int sink_scales, calibration_progress_fn progress, void *ctx,
               kv_calibration_t *out, ar_error_t *err);

int calibration_run(model_t *m, const char *const *prompts, int n, int size, dtype_t kv_dtype,
                    int sink_scales, calibration_progress_fn progress, void *ctx,
                    kv_calibration_t *out, ar_error_t *err) {
    return run(m, prompts, NULL, n, size, kv_dtype, sink_scales, progress, ctx, out, err);
}

int calibration_run_forced(model_t *m, const char *const *prompts, const int *const *forced, int n,
                           int sink_scales, calibration_progress_fn progress, void *ctx,
                           kv_calibration_t *out, ar_error_t *err) {
    return run(m, prompts, forced, n, 0, DTYPE_F32, sink_scales, progress, ctx, out, err);
}

static int run(model_t *m, const char *const *prompts, const int *const *forced, int n, int size,
               dtype_t kv_dtype, int sink_scales, calibration_progress_fn progress, void *ctx,
               kv_calibration_t *out, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    kv_geometry_t g;
    model_geometry_sized(&m->cfg, 1, size, &g);
    if (g.step_unit != KV_STEP_SEGMENT)
        return ar_errorf(err, "calibration is for next-scale models; %s is a raster model",
                         m->cfg.name);
    if (n < 1)
        return ar_errorf(err, "no prompts to calibrate on");
    const int K = g.n_segments, T = g.n_layers * g.n_heads;
    double *beta = calloc((size_t)T * K * K, sizeof *beta),
           *htr = calloc((size_t)T * K, sizeof *htr);
    float *beta_f = malloc((size_t)T * K * K * sizeof *beta_f), *mass = NULL, *zeros = NULL,
          *scratch = NULL;
    int *cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *cond),
        *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *uncond);
    kv_pool_t pool = {0};
    int rc = AR_ERR, len, longest = 1;
    if (!beta || !htr || !beta_f || !cond || !uncond) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int p = 0; p < n; p++) { /* the pool and the mass hold the longest prompt's image */
        if (prompt_rows(m, prompts[p], cond, uncond, &len, err) != AR_OK) {
            ar_error_prefix(err, "prompt %d", p + 1);
            goto out;
        }
        longest = len > longest ? len : longest;
    }
    kv_geometry_t gl;
    model_geometry_sized(&m->cfg, longest, size, &gl);
    const size_t cap = (size_t)gl.n_prompt + kv_geometry_image_tokens(&gl);
    const size_t n_mass = (size_t)T * cap;
    mass = malloc(n_mass * sizeof *mass);
    zeros = calloc(n_mass, sizeof *zeros);
    scratch = malloc(cap * sizeof *scratch);
    if (!mass || !zeros || !scratch) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    if (gen_pool_for_one_image(&pool, m, longest, kv_dtype, err) != AR_OK)
        goto out;
    for (int p = 0; p < n; p++) {
        gen_request_t r;
        sampler_params_t sp = m->cfg.sampling;
        const gen_image_opts_t opts = {.size = size};
        if (prompt_rows(m, prompts[p], cond, uncond, &len, err) != AR_OK ||
            gen_request_init_opts(&r, m, &pool, NULL, cond, uncond, len, &opts, &sp, (uint64_t)p, 0,
                                  err) != AR_OK)
            goto out;
        r.forced = forced ? forced[p] : NULL;
        if (gen_request_collect_mass(&r, err) != AR_OK) {
            gen_request_free(&r);
            goto out;
        }
        /* This prompt's geometry (its own prefix) and its sequence's mass rows. */
        model_geometry_sized(&m->cfg, len, size, &g);
        const size_t stride = (size_t)r.seq[0].capacity, n_seq = (size_t)T * stride;
        gen_request_t *batch[] = {&r};
        for (int t = 0; t < r.n_steps; t++) {
            if (gen_step(batch, 1, err) != AR_OK) {
                ar_error_prefix(err, "prompt %d, scale %d", p + 1, t);
                gen_request_free(&r);
                goto out;
            }
            m->be->download(m->be, mass, r.seq[0].mass, n_seq * sizeof *mass);
            m->be->upload(m->be, r.seq[0].mass, zeros, n_seq * sizeof *zeros);
            add_step(&g, mass, stride, t, beta, htr, scratch);
        }
        gen_request_free(&r);
        if (progress)
            progress(p + 1, n, ctx);
    }
    for (size_t i = 0; i < (size_t)T * K * K; i++)
        beta_f[i] = (float)(beta[i] / n);
    rc = kv_calibration_from_beta(out, &g, beta_f, n, sink_scales, err);
    if (rc == AR_OK)
        snprintf(out->size, sizeof out->size, "%s", m->cfg.image.sizes[size].name);
    if (rc == AR_OK && !(out->htr = malloc((size_t)T * K * sizeof *out->htr)))
        rc = ar_errorf(err, "out of memory");
    for (size_t i = 0; rc == AR_OK && i < (size_t)T * K; i++)
        out->htr[i] = (float)(htr[i] / n);
out:
    kv_pool_free(&pool);
    free(beta);
    free(htr);
    free(beta_f);
    free(scratch);
    free(mass);
    free(zeros);
    free(cond);
    free(uncond);
    return rc;
}

int fp8_scales_measure(model_t *m, const char *const *prompts, int n,
                       calibration_progress_fn progress, void *ctx, fp8_scales_t *out,
                       ar_error_t *err) {
    memset(out, 0, sizeof *out);
    if (n < 1)
        return ar_errorf(err, "no prompts to measure on");
    kv_geometry_t g;
    model_geometry(&m->cfg, 1, &g);
    int *cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *cond),
        *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *uncond);
    kv_pool_t pool = {0};
    int rc = AR_ERR, len, longest = 1;
    if (!cond || !uncond) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int p = 0; p < n; p++) { /* the pool holds the longest prompt's image */
        if (prompt_rows(m, prompts[p], cond, uncond, &len, err) != AR_OK) {
            ar_error_prefix(err, "prompt %d", p + 1);
            goto out;
        }
        longest = len > longest ? len : longest;
    }
    if (gen_pool_for_one_image(&pool, m, longest, DTYPE_F32, err) != AR_OK ||
        fp8_scales_init(out, g.n_layers, g.n_heads, err) != AR_OK)
        goto out;
    for (int p = 0; p < n; p++) {
        gen_request_t r;
        sampler_params_t sp = m->cfg.sampling;
        if (prompt_rows(m, prompts[p], cond, uncond, &len, err) != AR_OK ||
            gen_request_init(&r, m, &pool, NULL, cond, uncond, len, &sp, (uint64_t)p, 0, err) !=
                AR_OK)
            goto out;
        gen_request_t *batch[] = {&r};
        while (!gen_request_done(&r))
            if (gen_step(batch, 1, err) != AR_OK) {
                ar_error_prefix(err, "prompt %d, step %d", p + 1, r.step);
                gen_request_free(&r);
                goto out;
            }
        const int seen = fp8_scales_observe(out, &r.seq[0], err) == AR_OK &&
                         fp8_scales_observe(out, &r.seq[1], err) == AR_OK;
        gen_request_free(&r);
        if (!seen)
            goto out;
        out->n_prompts = p + 1;
        if (progress)
            progress(p + 1, n, ctx);
    }
    rc = AR_OK;
out:
    if (rc != AR_OK)
        fp8_scales_free(out);
    kv_pool_free(&pool);
    free(cond);
    free(uncond);
    return rc;
}
