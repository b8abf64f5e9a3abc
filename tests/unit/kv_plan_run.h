/* Shared by the next-scale KV policy tests: one request of a class on a
 * model, in a pool of exactly its plan's peak (blocks of block_tokens
 * tokens), step by step. Header-only: each unit test is one file. */
#ifndef ARSERVE_TESTS_KV_PLAN_RUN_H
#define ARSERVE_TESTS_KV_PLAN_RUN_H

#include <stdlib.h>

#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"

/* What one run measured against its plan. */
typedef struct kv_plan_run {
    int steps;
    int over, equal;          /* steps whose pool peak passed, or met, the plan's bytes */
    size_t measured_peak;     /* the pool's most bytes in any step */
    size_t request_peak;      /* the request's own peak (kv_peak_blocks) in bytes */
    size_t planned_peak;      /* the plan's */
    int leaked;               /* blocks in use or bad frees after the request ended */
} kv_plan_run_t;

/* AR_ERR (err set) when the plan, the pool or a step fails. */
static int kv_plan_run(model_t *m, const kv_policy_params_t *p, int label, uint64_t seed,
                       int block_tokens, kv_plan_run_t *out, ar_error_t *err) {
    planner_plan_t plan;
    kv_pool_t pool;
    gen_request_t r;
    int cond, uncond, n, rc = AR_ERR;
    memset(out, 0, sizeof *out);
    if (planner_plan(&plan, &m->cfg, p, 1, block_tokens, NULL, err) != AR_OK)
        return AR_ERR;
    const size_t block = kv_pool_block_bytes(block_tokens, m->cfg.llm.head_dim, DTYPE_F32);
    if (kv_pool_init(&pool, m->be, (int)(plan.peak_bytes / block), block_tokens,
                     m->cfg.llm.head_dim, DTYPE_F32, err) != AR_OK) {
        planner_plan_free(&plan);
        return AR_ERR;
    }
    sampler_params_t sp = m->cfg.sampling;
    if (model_prompt_from_class(m, label, &cond, &uncond, &n, err) != AR_OK ||
        gen_request_init(&r, m, &pool, p, &cond, &uncond, n, &sp, seed, 0, err) != AR_OK)
        goto out_pool;
    gen_request_t *batch[] = {&r};
    out->steps = plan.steps;
    out->planned_peak = plan.peak_bytes;
    rc = AR_OK;
    for (int t = 0; t < plan.steps && rc == AR_OK; t++) {
        kv_pool_reset_peak(&pool);
        if ((rc = gen_step(batch, 1, err)) != AR_OK)
            break;
        const size_t got = (size_t)pool.peak_in_use * block;
        out->over += got > plan.bytes[t];
        out->equal += got == plan.bytes[t];
        out->measured_peak = got > out->measured_peak ? got : out->measured_peak;
    }
    out->request_peak = (size_t)r.kv_peak_blocks * block;
    gen_request_free(&r);
    out->leaked = kv_pool_blocks_in_use(&pool) != 0 || pool.bad_frees != 0;
out_pool:
    kv_pool_free(&pool);
    planner_plan_free(&plan);
    return rc;
}

#endif
