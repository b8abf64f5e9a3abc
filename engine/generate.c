/* Stepping image requests through the raster model and the host sampler,
 * with the KV policy hooks between steps. */
#include "generate.h"

#include <stdlib.h>
#include <string.h>

#include "planner.h"

static int n_heads_total(const model_t *m) {
    return m->cfg.llm.num_layers * m->cfg.llm.num_kv_heads;
}

int gen_request_init(gen_request_t *r, model_t *m, kv_pool_t *pool,
                     const kv_policy_params_t *policy, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err) {
    memset(r, 0, sizeof *r);
    r->model = m;
    r->params = *params;
    r->seed = seed;
    r->stream = stream;
    r->n_prompt = n_prompt;
    r->n_steps = m->cfg.image.grid_height * m->cfg.image.grid_width;
    r->pool = pool;
    if (policy)
        r->policy = *policy;
    else
        kv_policy_defaults(&r->policy, KV_POLICY_FULL);
    const int with_policy = r->policy.kind != KV_POLICY_FULL;
    int K = m->cfg.image.codebook_size;
    /* The last sampled token is never fed back. */
    int capacity = n_prompt + r->n_steps - 1;
    r->cond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->uncond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->tokens = calloc((size_t)r->n_steps, sizeof(int));
    r->logits = malloc((size_t)2 * K * sizeof(float));
    if (!r->cond_ids || !r->uncond_ids || !r->tokens || !r->logits)
        goto oom;
    memcpy(r->cond_ids, cond, (size_t)n_prompt * sizeof(int));
    memcpy(r->uncond_ids, uncond, (size_t)n_prompt * sizeof(int));
    if (with_policy) {
        const size_t heads = (size_t)n_heads_total(m);
        r->mass_live[0] = calloc(heads, 1);
        r->mass_live[1] = calloc(heads, 1);
        r->mass_host = malloc(heads * (size_t)capacity * sizeof(float));
        r->zeros = calloc((size_t)capacity, sizeof(float));
        r->keep = malloc((size_t)capacity * sizeof(int));
        if (!r->mass_live[0] || !r->mass_live[1] || !r->mass_host || !r->zeros || !r->keep)
            goto oom;
        kv_geometry_t g = planner_geometry(&m->cfg, n_prompt);
        if (kv_policy_validate(&r->policy, &g, err) != AR_OK)
            goto fail;
        for (int j = 0; j < 2; j++)
            if (!(r->policy_state[j] = kv_policy_begin(&r->policy, &g, err)))
                goto fail;
    }
    if (sampler_init(&r->sampler, K, err) != AR_OK ||
        raster_seq_init(&r->seq[0], &m->lm, pool, capacity, with_policy, err) != AR_OK ||
        raster_seq_init(&r->seq[1], &m->lm, pool, capacity, with_policy, err) != AR_OK)
        goto fail;
    return AR_OK;
oom:
    ar_errorf(err, "out of memory");
fail:
    gen_request_free(r);
    return AR_ERR;
}

void gen_request_free(gen_request_t *r) {
    if (!r->model)
        return;
    for (int i = 0; i < 2; i++) {
        /* A double free is counted in the pool (pool->bad_frees) for the
         * owner of the pool to report; this request is gone either way. */
        if (r->seq[i].heads)
            raster_seq_free(&r->seq[i], &r->model->lm, NULL);
        if (r->policy_state[i])
            kv_policy_end(r->policy_state[i]);
        free(r->mass_live[i]);
    }
    sampler_free(&r->sampler);
    free(r->cond_ids);
    free(r->uncond_ids);
    free(r->tokens);
    free(r->logits);
    free(r->mass_host);
    free(r->zeros);
    free(r->keep);
    memset(r, 0, sizeof *r);
}

/* After step `step`'s forward: asks sequence j's policy, for every (layer,
 * head), what to keep, and applies it. Key mass is handed over for heads
 * that collected since their last reset (NULL otherwise); a head's mass is
 * zero past its length and, while not collecting, everywhere, so a
 * compaction gathers it only while it collects. */
static int policy_step_end(gen_request_t *r, int j, int step, int collected, ar_error_t *err) {
    raster_seq_t *sq = &r->seq[j];
    backend_t *be = r->model->lm.be;
    const int H = sq->n_heads, n = sq->n_layers * H;
    const size_t cap = (size_t)sq->capacity;
    uint8_t *live = r->mass_live[j];
    int any_live = 0;
    for (int i = 0; i < n; i++) {
        if (collected)
            live[i] = 1;
        any_live |= live[i];
    }
    /* One transfer for the whole sequence rather than one per head. */
    if (any_live)
        be->download(be, r->mass_host, sq->mass, (size_t)n * cap * sizeof(float));
    for (int i = 0; i < n; i++) {
        kv_head_t *kh = &sq->heads[i];
        float *mass_dev = sq->mass + (size_t)i * cap;
        const int len = kh->len;
        int n_keep = len;
        int what =
            kv_policy_step_end(r->policy_state[j], step, i / H, i % H, len,
                               live[i] ? r->mass_host + (size_t)i * cap : NULL, r->keep, &n_keep);
        if (what & KV_COMPACT) {
            if (kv_head_compact(r->pool, kh, r->keep, n_keep, live[i] ? mass_dev : NULL, err) !=
                AR_OK)
                return ar_error_prefix(err, "policy %s, step %d, sequence %d, layer %d, head %d",
                                       kv_policy_name(r->policy.kind), step, j, i / H, i % H);
            if (live[i] && kh->len < len)
                be->upload(be, mass_dev + kh->len, r->zeros,
                           (size_t)(len - kh->len) * sizeof(float));
        }
        if (what & KV_RESET_MASS) {
            if (live[i])
                be->upload(be, mass_dev, r->zeros, (size_t)kh->len * sizeof(float));
            live[i] = 0;
        }
    }
    return AR_OK;
}

int gen_step(gen_request_t *const *reqs, int n, ar_error_t *err) {
    if (n <= 0)
        return AR_OK;
    model_t *m = reqs[0]->model;
    backend_t *be = m->lm.be;
    int K = m->cfg.image.codebook_size;
    raster_input_t *in = malloc((size_t)2 * n * sizeof *in);
    gen_request_t **live = malloc((size_t)n * sizeof *live);
    float *logits = malloc((size_t)2 * n * K * sizeof(float));
    int n_live = 0, rc = AR_ERR;
    if (!in || !live || !logits) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        if (gen_request_done(r))
            continue;
        if (r->model != m) {
            ar_errorf(err, "requests of different models cannot share a step");
            goto out;
        }
        int prefill = r->step == 0;
        for (int j = 0; j < 2; j++)
            in[2 * n_live + j] = (raster_input_t){
                .seq = &r->seq[j],
                .n = prefill ? r->n_prompt : 1,
                .ids = prefill ? (j ? r->uncond_ids : r->cond_ids) : &r->tokens[r->step - 1],
                .is_image = !prefill,
                .collect_mass =
                    r->policy_state[j] && kv_policy_collect(r->policy_state[j], r->step),
            };
        live[n_live++] = r;
    }
    if (raster_forward(&m->lm, in, 2 * n_live, logits, err) != AR_OK)
        goto out;
    for (int i = 0; i < n_live; i++) {
        gen_request_t *r = live[i];
        int blocks = 0;
        for (int j = 0; j < 2; j++)
            for (int h = 0; h < r->seq[j].n_layers * r->seq[j].n_heads; h++)
                blocks += r->seq[j].heads[h].n_blocks;
        if (blocks > r->kv_peak_blocks)
            r->kv_peak_blocks = blocks;
        memcpy(r->logits, logits + (size_t)2 * i * K, (size_t)2 * K * sizeof(float));
        r->tokens[r->step] = r->forced
                                 ? r->forced[r->step]
                                 : sampler_next(&r->sampler, r->logits, r->logits + K, &r->params,
                                                r->seed, r->stream, (uint64_t)r->step);
        for (int j = 0; j < 2; j++)
            if (r->policy_state[j] &&
                policy_step_end(r, j, r->step, in[2 * i + j].collect_mass, err) != AR_OK)
                goto out;
        r->step++;
    }
    /* A device backend's ops cannot fail where they run; the step's first
     * failure (a launch, a CUDA call) surfaces here, once per step, after
     * the compactions too, and fails the step with its message. */
    be->sync(be);
    if (backend_status(be, err) != AR_OK) {
        ar_error_prefix(err, "step failed on the %s backend", be->name);
        goto out;
    }
    rc = AR_OK;
out:
    free(in);
    free(live);
    free(logits);
    return rc;
}

int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err) {
    if (!gen_request_done(r))
        return ar_errorf(err, "the image is not finished");
    return vq_decode(&r->model->dec, r->tokens, rgb, NULL, err);
}
