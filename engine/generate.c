/* Stepping image requests through their model's family (forward pass and
 * sampling), with the KV policy hooks between steps. */
#include "engine/generate.h"

#include <stdlib.h>
#include <string.h>

#include "engine/batcher.h"
#include "engine/model_family.h"
#include "engine/planner.h"

/* Tokens a sequence of geometry g holds at most: what the last step holds
 * (the family's geometry says what is fed); with key mass on a next-scale
 * model, every token, as a step's mass also covers the scale's own keys,
 * the last one's included. */
static int seq_capacity(const kv_geometry_t *g, int with_mass) {
    return g->step_unit == KV_STEP_SEGMENT && with_mass
               ? g->n_prompt + kv_geometry_image_tokens(g)
               : kv_geometry_held(g, kv_geometry_steps(g) - 1);
}

int gen_request_init(gen_request_t *r, model_t *m, kv_pool_t *pool,
                     const kv_policy_params_t *policy, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err) {
    return gen_request_init_opts(r, m, pool, policy, cond, uncond, n_prompt, NULL, params, seed,
                                 stream, err);
}

int gen_request_init_opts(gen_request_t *r, model_t *m, kv_pool_t *pool,
                          const kv_policy_params_t *policy, const int *cond, const int *uncond,
                          int n_prompt, const gen_image_opts_t *opts,
                          const sampler_params_t *params, uint64_t seed, uint64_t stream,
                          ar_error_t *err) {
    static const gen_image_opts_t none;
    opts = opts ? opts : &none;
    memset(r, 0, sizeof *r);
    const int n_sizes = m->cfg.image.n_sizes > 0 ? m->cfg.image.n_sizes : 1, size = opts->size;
    if (size < 0 || size >= n_sizes)
        return ar_errorf(err, "image size %d: the model has %d", size, n_sizes);
    if (opts->n_negative && (!model_config_has_text_encoder(&m->cfg) || opts->n_negative < 0 ||
                             opts->n_negative > m->cfg.text.max_tokens || !opts->negative))
        return ar_errorf(err, "a negative prompt of %d tokens: the model takes %s",
                         opts->n_negative,
                         model_config_has_text_encoder(&m->cfg) ? "1 to text.max_tokens" : "none");
    r->size = size;
    if (opts->n_negative) {
        if (!(r->neg_ids = malloc((size_t)opts->n_negative * sizeof(int))))
            return ar_errorf(err, "out of memory");
        memcpy(r->neg_ids, opts->negative, (size_t)opts->n_negative * sizeof(int));
        r->n_neg = opts->n_negative;
    }
    r->model = m;
    r->params = *params;
    r->seed = seed;
    r->stream = stream;
    r->n_prompt = n_prompt;
    r->pool = pool;
    if (policy)
        r->policy = *policy;
    else
        kv_policy_defaults(&r->policy, KV_POLICY_FULL);
    kv_geometry_t g;
    model_geometry_sized(&m->cfg, n_prompt, size, &g);
    r->n_steps = kv_geometry_steps(&g);
    r->n_tokens = kv_geometry_image_tokens(&g);
    const int with_policy = r->policy.kind != KV_POLICY_FULL;
    const int with_mass = with_policy && (kv_policy_stats(r->policy.kind) & KV_STATS_KEY_MASS);
    /* The logits of one token: its codebook, or Infinity's two per bit. */
    const int K =
        m->cfg.image.codebook_size > 0 ? m->cfg.image.codebook_size : 2 * m->cfg.image.bits;
    const int capacity = seq_capacity(&g, with_mass);
    r->cond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->uncond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->tokens = calloc(gen_request_token_values(r), sizeof(int));
    r->logits = malloc((size_t)2 * K * sizeof(float));
    if (!r->cond_ids || !r->uncond_ids || !r->tokens || !r->logits)
        goto oom;
    memcpy(r->cond_ids, cond, (size_t)n_prompt * sizeof(int));
    memcpy(r->uncond_ids, uncond, (size_t)n_prompt * sizeof(int));
    if (with_policy) {
        if (!(r->keep = malloc((size_t)capacity * sizeof(int))))
            goto oom;
        for (int j = 0; j < 2; j++)
            if (!(r->policy_state[j] = kv_policy_begin(&r->policy, &g, err)))
                goto fail;
    }
    if (with_mass) {
        const size_t heads = (size_t)g.n_layers * (size_t)g.n_heads;
        r->mass_live[0] = calloc(heads, 1);
        r->mass_live[1] = calloc(heads, 1);
        r->mass_host = malloc(heads * (size_t)capacity * sizeof(float));
        r->zeros = calloc((size_t)capacity, sizeof(float));
        if (!r->mass_live[0] || !r->mass_live[1] || !r->mass_host || !r->zeros)
            goto oom;
    }
    if (sampler_init(&r->sampler, K, err) != AR_OK)
        goto fail;
    for (int j = 0; j < 2; j++) {
        if (kv_seq_init(&r->seq[j], pool, g.n_layers, g.n_heads, capacity, with_mass, err) != AR_OK)
            goto fail;
        /* An fp8 cache takes the model's measured scales (else 1). */
        if (pool->blocks.dtype == DTYPE_F8_E4M3 && m->fp8_scales.k_amax)
            fp8_scales_apply(&m->fp8_scales, &r->seq[j]);
    }
    return AR_OK;
oom:
    ar_errorf(err, "out of memory");
fail:
    gen_request_free(r);
    return AR_ERR;
}

static void request_release_kv(gen_request_t *r);

int gen_pool_for_one_image(kv_pool_t *pool, model_t *m, int n_prompt, dtype_t kv_dtype,
                           ar_error_t *err) {
    const model_config_t *c = &m->cfg;
    const int bt = planner_block_tokens(c);
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    /* The largest of its sizes' peaks (Infinity's aspect ratios differ). */
    size_t peak = 0;
    for (int size = 0; size < (c->image.n_sizes > 0 ? c->image.n_sizes : 1); size++) {
        planner_plan_t plan;
        if (planner_plan_sized(&plan, c, &full, n_prompt, size, bt, planner_kv_same(kv_dtype), NULL,
                               err) != AR_OK)
            return AR_ERR;
        peak = plan.peak_bytes > peak ? plan.peak_bytes : peak;
        planner_plan_free(&plan);
    }
    return kv_pool_init(pool, m->be,
                        (int)(peak / kv_pool_block_bytes(bt, c->llm.head_dim, kv_dtype)), bt,
                        c->llm.head_dim, kv_dtype, err);
}

size_t gen_request_token_values(const gen_request_t *r) {
    return (size_t)r->n_tokens * (size_t)model_token_width(&r->model->cfg);
}

int gen_request_keep_logits(gen_request_t *r, const float *logits, size_t n, ar_error_t *err) {
    float *keep = realloc(r->logits, n * sizeof *keep);
    if (!keep)
        return ar_errorf(err, "out of memory for %zu logits", n);
    r->logits = keep;
    r->n_logits = n;
    memcpy(r->logits, logits, n * sizeof *keep);
    return AR_OK;
}

int gen_request_collect_mass(gen_request_t *r, ar_error_t *err) {
    if (r->step != 0 || r->policy.kind != KV_POLICY_FULL)
        return ar_errorf(err, "key mass for every step: only before the first step, full cache");
    kv_geometry_t g;
    model_geometry_sized(&r->model->cfg, r->n_prompt, r->size, &g);
    kv_seq_free(&r->seq[0], NULL);
    if (kv_seq_init(&r->seq[0], r->pool, g.n_layers, g.n_heads, seq_capacity(&g, 1), 1, err) !=
        AR_OK)
        return AR_ERR;
    r->collect_all = 1;
    return AR_OK;
}

void gen_request_free(gen_request_t *r) {
    if (!r->model)
        return;
    request_release_kv(r);
    for (int i = 0; i < 2; i++) {
        free(r->mass_live[i]);
        r->model->be->free(r->model->be, r->cond_table[i]);
    }
    sampler_free(&r->sampler);
    free(r->cond_ids);
    free(r->uncond_ids);
    free(r->neg_ids);
    free(r->tokens);
    free(r->logits);
    free(r->mass_host);
    free(r->zeros);
    free(r->keep);
    memset(r, 0, sizeof *r);
}

/* Keeps r->keep[0..n_keep) of sequence j's head i (and its mass, zeroed
 * past the new length, when mass_dev is not NULL). */
static int apply_keep(gen_request_t *r, int j, int i, int n_keep, float *mass_dev, int step,
                      ar_error_t *err) {
    kv_seq_t *sq = &r->seq[j];
    kv_head_t *kh = &sq->heads[i];
    const int len = kh->len, H = sq->n_heads;
    if (kv_head_compact(r->pool, kh, r->keep, n_keep, mass_dev, err) != AR_OK)
        return ar_error_prefix(err, "policy %s, step %d, sequence %d, layer %d, head %d",
                               kv_policy_name(r->policy.kind), step, j, i / H, i % H);
    if (mass_dev && kh->len < len)
        r->model->be->upload(r->model->be, mass_dev + kh->len, r->zeros,
                             (size_t)(len - kh->len) * sizeof(float));
    return AR_OK;
}

/* Before step `step`'s forward, a layered policy's early compaction of
 * sequence j (no key mass: layered policies do not collect it). */
static int policy_step_begin(gen_request_t *r, int j, int step, ar_error_t *err) {
    kv_seq_t *sq = &r->seq[j];
    const int H = sq->n_heads;
    for (int i = 0; i < sq->n_layers * H; i++) {
        int n_keep;
        if ((kv_policy_step_begin(r->policy_state[j], step, i / H, i % H, sq->heads[i].len, r->keep,
                                  &n_keep) &
             KV_COMPACT) &&
            apply_keep(r, j, i, n_keep, NULL, step, err) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

/* After step `step`'s forward: asks sequence j's policy, for every (layer,
 * head), what to keep, and applies it. Key mass (only for a policy that
 * asks for it) is handed over for heads that collected since their last
 * reset (NULL otherwise); a head's mass is zero past its length and, while
 * not collecting, everywhere, so a compaction gathers it only while it
 * collects. */
static int policy_step_end(gen_request_t *r, int j, int step, ar_error_t *err) {
    kv_seq_t *sq = &r->seq[j];
    backend_t *be = r->model->be;
    const int H = sq->n_heads, n = sq->n_layers * H;
    const size_t cap = (size_t)sq->capacity;
    /* NULL: the policy takes no mass here (a layered one uses it, and
     * zeroes it, layer by layer during the forward). */
    uint8_t *live = kv_policy_layered(r->policy_state[j]) ? NULL : r->mass_live[j];
    int any_live = 0;
    for (int i = 0; live && i < n; i++) {
        if (r->collect[j])
            live[i] = 1;
        any_live |= live[i];
    }
    /* One transfer for the whole sequence rather than one per head. */
    if (any_live)
        be->download(be, r->mass_host, sq->mass, (size_t)n * cap * sizeof(float));
    for (int i = 0; i < n; i++) {
        kv_head_t *kh = &sq->heads[i];
        const int has_mass = live && live[i];
        float *mass_dev = has_mass ? sq->mass + (size_t)i * cap : NULL;
        int n_keep = kh->len;
        int what =
            kv_policy_step_end(r->policy_state[j], step, i / H, i % H, kh->len,
                               has_mass ? r->mass_host + (size_t)i * cap : NULL, r->keep, &n_keep);
        if ((what & KV_COMPACT) && apply_keep(r, j, i, n_keep, mass_dev, step, err) != AR_OK)
            return AR_ERR;
        if ((what & KV_RESET_MASS) && has_mass) {
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
    backend_t *be = m->be;
    arena_begin(&m->arena);
    gen_request_t **live = arena_alloc(&m->arena, (size_t)n * sizeof *live);
    int n_live = 0, rc = AR_ERR;
    if (!live) {
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
        for (int j = 0; j < 2; j++) {
            r->collect[j] = (r->mass_live[j] && kv_policy_collect(r->policy_state[j], r->step)) ||
                            (j == 0 && r->collect_all);
            if (kv_policy_layered(r->policy_state[j]) &&
                policy_step_begin(r, j, r->step, err) != AR_OK)
                goto out;
        }
        live[n_live++] = r;
    }
    if (n_live == 0) {
        rc = AR_OK;
        goto out;
    }
    if (m->family->step(m, live, n_live, err) != AR_OK)
        goto out;
    for (int i = 0; i < n_live; i++) {
        gen_request_t *r = live[i];
        const int blocks = kv_seq_blocks(&r->seq[0]) + kv_seq_blocks(&r->seq[1]);
        if (blocks > r->kv_peak_blocks)
            r->kv_peak_blocks = blocks;
        for (int j = 0; j < 2; j++)
            if (r->policy_state[j] && policy_step_end(r, j, r->step, err) != AR_OK)
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
    arena_end(&m->arena);
    return rc;
}

int gen_draw(const model_t *m, struct vq_work *w, const int *tokens, int size, int n_done,
             uint8_t *rgb, ar_error_t *err) {
    return m->family->draw(m, w, tokens, size, n_done, rgb, err);
}

int gen_drawer_open(gen_drawer_t *d, const model_t *m, int n_threads, ar_error_t *err) {
    memset(d, 0, sizeof *d);
    d->model = m;
    size_t n_buffers = 0;
    const size_t bytes = m->family->draw_bytes(m, &n_buffers);
    if (!m->be->fork)
        return ar_errorf(err, "the %s backend cannot draw images on a thread of their own",
                         m->be->name);
    if (!(d->be = m->be->fork(m->be, bytes, n_threads, err)))
        return ar_error_prefix(err, "a %s backend for drawing images (%.1f MiB in %zu buffers)",
                               m->be->name, bytes / 1048576.0, n_buffers);
    if (!(d->work = m->family->draw_work_new(m, d->be, err))) {
        gen_drawer_close(d);
        return AR_ERR;
    }
    return AR_OK;
}

void gen_drawer_close(gen_drawer_t *d) {
    if (d->model)
        d->model->family->draw_work_free(d->work);
    if (d->be)
        d->be->destroy(d->be);
    memset(d, 0, sizeof *d);
}

int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err) {
    if (!gen_request_done(r))
        return ar_errorf(err, "the image is not finished");
    struct vq_work *w = model_draw_work(r->model, err);
    return w ? gen_draw(r->model, w, r->tokens, r->size, r->n_steps, rgb, err) : AR_ERR;
}

int gen_preview(gen_request_t *r, uint8_t *rgb, ar_error_t *err) {
    struct vq_work *w = model_draw_work(r->model, err);
    return w ? gen_draw(r->model, w, r->tokens, r->size, r->step, rgb, err) : AR_ERR;
}

/* ---- jobs ---- */

/* Gives back a request's KV and policy state; its tokens stay. */
static void request_release_kv(gen_request_t *r) {
    for (int i = 0; i < 2; i++) {
        /* A double free is counted in the pool (pool->bad_frees) for the
         * owner of the pool to report; this request is gone either way. */
        kv_seq_free(&r->seq[i], NULL);
        kv_policy_end(r->policy_state[i]);
        r->policy_state[i] = NULL;
    }
}

static int job_start(void *ctx, void *work, ar_error_t *err) {
    kv_pool_t *pool = ctx;
    gen_job_t *j = work;
    j->images = calloc((size_t)j->n_images, sizeof *j->images);
    if (!j->images)
        return ar_errorf(err, "out of memory");
    for (int i = 0; i < j->n_images; i++)
        if (gen_request_init_opts(&j->images[i], j->model, pool, &j->policy, j->cond, j->uncond,
                                  j->n_prompt, &j->opts, &j->params, j->seed, (uint64_t)i,
                                  err) != AR_OK) {
            gen_job_free(j);
            return AR_ERR;
        }
    return AR_OK;
}

static int job_step(void *ctx, void *const *work, int n, size_t *kv_peak_bytes, ar_error_t *err) {
    kv_pool_t *pool = ctx;
    *kv_peak_bytes = 0;
    if (n <= 0)
        return AR_OK;
    int n_req = 0;
    for (int i = 0; i < n; i++)
        n_req += ((gen_job_t *)work[i])->n_images;
    arena_t *arena = &((gen_job_t *)work[0])->model->arena;
    arena_begin(arena);
    gen_request_t **batch = arena_alloc(arena, (size_t)n_req * sizeof *batch);
    if (!batch) {
        arena_end(arena);
        return ar_errorf(err, "out of memory for a batch of %d images", n_req);
    }
    n_req = 0;
    for (int i = 0; i < n; i++) {
        gen_job_t *j = work[i];
        for (int k = 0; k < j->n_images; k++)
            batch[n_req++] = &j->images[k];
    }
    kv_pool_reset_peak(pool);
    int rc = gen_step(batch, n_req, err);
    *kv_peak_bytes = (size_t)pool->peak_in_use * kv_pool_bytes_per_block(pool);
    arena_end(arena);
    return rc;
}

static void job_stop(void *ctx, void *work) {
    gen_job_t *j = work;
    for (int i = 0; j->images && i < j->n_images; i++)
        request_release_kv(&j->images[i]);
}

int gen_request_remaining_bytes(const gen_request_t *r, size_t *bytes, int n, ar_error_t *err) {
    const kv_pool_t *pool = r->pool;
    const int heads = r->seq[0].n_layers * r->seq[0].n_heads;
    const size_t block = kv_pool_bytes_per_block(pool);
    arena_t *arena = &r->model->arena;
    arena_begin(arena);
    long long *blocks = arena_alloc(arena, (size_t)n * sizeof *blocks);
    int *len = arena_alloc(arena, (size_t)heads * sizeof *len), rc = 1;
    if (!blocks || !len) {
        ar_errorf(err, "out of memory");
        rc = -1;
    }
    for (int i = 0; rc == 1 && i < n; i++)
        bytes[i] = 0;
    for (int j = 0; rc == 1 && j < 2; j++) {
        for (int i = 0; i < heads; i++)
            len[i] = r->seq[j].heads[i].len;
        rc = kv_policy_remaining_blocks(r->policy_state[j], r->step, len, pool->blocks.block_tokens,
                                        blocks, err);
        for (int i = 0; rc == 1 && i < n; i++)
            bytes[i] += (size_t)blocks[i] * block;
    }
    arena_end(arena);
    return rc;
}

static int job_remaining(void *ctx, void *work, size_t *kv_bytes, int n) {
    (void)ctx;
    gen_job_t *j = work;
    arena_t *arena = &j->model->arena;
    arena_begin(arena);
    size_t *one = arena_alloc(arena, (size_t)n * sizeof *one);
    int ok = one != NULL;
    for (int i = 0; i < n; i++)
        kv_bytes[i] = 0;
    for (int k = 0; ok && k < j->n_images; k++) {
        ok = gen_request_remaining_bytes(&j->images[k], one, n, NULL) == 1;
        for (int i = 0; ok && i < n; i++)
            kv_bytes[i] += one[i];
    }
    arena_end(arena);
    return ok;
}

static void job_set_level(void *ctx, void *work, int level) {
    (void)ctx;
    gen_job_t *j = work;
    if (j->level_budgets)
        j->policy.budget = j->level_budgets[level];
}

const batcher_ops_t gen_batcher_ops = {.start = job_start,
                                       .step = job_step,
                                       .stop = job_stop,
                                       .remaining = job_remaining,
                                       .set_level = job_set_level};

void gen_job_free(gen_job_t *j) {
    for (int i = 0; j->images && i < j->n_images; i++)
        gen_request_free(&j->images[i]);
    free(j->images);
    j->images = NULL;
}
