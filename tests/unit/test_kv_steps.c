/* The engine's KV policy hooks, the planner's trajectories and the
 * scheduler's check that measured pool use never passes the plan, on the
 * tiny model with a stub policy defined here: this file links its own
 * policy table (engine/policy/kv_policy_impl.h), whose streaming slot holds the
 * stub, so the engine's dispatcher, generation loop, planner and scheduler
 * run it as they would any policy.
 *
 * The stub ("window"): every head keeps the prefix, sink_tokens image
 * tokens and the newest recent_lines * w tokens, odd heads one token
 * fewer, so heads hold different lengths. It collects key mass at every
 * step but each fifth, resets it every third step, and checks what the
 * engine hands it: the mass is given exactly when something was collected
 * since the last reset, and sums to the query rows collected since then
 * plus what the kept keys held at the last compaction. */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "engine/generate.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "engine/policy/kv_policy_impl.h"
#include "server/scheduler_test.h"
#include "tests/test.h"

/* ---- the stub policy ------------------------------------------------------------ */

static struct {
    long long stepped_states, step_ends, mass_checks, protocol_errors;
    double mass_worst; /* largest |sum - expected| / max(1, expected) */
} stub;

typedef struct window {
    int n_prompt, n_heads, cap; /* cap: what an even head keeps */
    int sinks, seen;
    double *expect; /* per (layer, head): mass the engine should hand over */
    uint8_t *live;  /* collected since the last reset */
    int *len;       /* what the head held after the last step */
} window_t;

/* Tokens an even head keeps after compaction (odd heads: one fewer). */
static int window_cap(const kv_policy_params_t *p, const kv_geometry_t *g) {
    return g->n_prompt + p->sink_tokens + p->recent_lines * g->segment_tokens[0];
}

static int window_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                        ar_error_t *err) {
    if (p->recent_lines < 1)
        return ar_errorf(err, "recent_lines must be at least 1");
    return AR_OK;
}

static void window_end(void *state) {
    window_t *s = state;
    if (!s)
        return;
    free(s->expect);
    free(s->live);
    free(s->len);
    free(s);
}

static void *window_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    window_t *s = calloc(1, sizeof *s);
    const size_t n = (size_t)g->n_layers * g->n_heads;
    if (!s || !(s->expect = calloc(n, sizeof *s->expect)) || !(s->live = calloc(n, 1)) ||
        !(s->len = calloc(n, sizeof *s->len))) {
        window_end(s);
        return NULL;
    }
    s->n_prompt = g->n_prompt;
    s->n_heads = g->n_heads;
    s->cap = window_cap(p, g);
    s->sinks = p->sink_tokens;
    return s;
}

/* The planned (worst, even) head keeps the window. */
static int window_kept_after(const void *state, int t, int v) {
    const window_t *s = state;
    return v < s->cap - s->n_prompt ? v : s->cap - s->n_prompt;
}

static int window_collect(const void *state, int step) { return step % 5 != 4; }

static int window_step_end(void *state, int step, int layer, int head, int len, const float *mass,
                           int *keep, int *n_keep) {
    window_t *s = state;
    stub.step_ends++;
    if (!s->seen++)
        stub.stepped_states++;
    const int i = layer * s->n_heads + head, rows = step == 0 ? s->n_prompt : 1;
    if (len != s->len[i] + rows)
        stub.protocol_errors++;
    if (window_collect(s, step)) {
        s->expect[i] += rows;
        s->live[i] = 1;
    }
    if (!mass != !s->live[i])
        stub.protocol_errors++;
    if (mass) {
        double sum = 0;
        for (int j = 0; j < len; j++)
            sum += mass[j];
        double e = fabs(sum - s->expect[i]) / (s->expect[i] > 1 ? s->expect[i] : 1);
        if (e > stub.mass_worst)
            stub.mass_worst = e;
        stub.mass_checks++;
    }
    int what = 0;
    *n_keep = len;
    const int cap = s->cap - head % 2;
    if (len > cap) {
        const int front = s->n_prompt + s->sinks, back = cap - front;
        *n_keep = 0;
        for (int j = 0; j < front; j++)
            keep[(*n_keep)++] = j;
        for (int j = len - back; j < len; j++)
            keep[(*n_keep)++] = j;
        if (mass) {
            s->expect[i] = 0;
            for (int k = 0; k < *n_keep; k++)
                s->expect[i] += mass[keep[k]];
        }
        what |= KV_COMPACT;
    }
    if (step % 3 == 2) {
        s->expect[i] = 0;
        s->live[i] = 0;
        what |= KV_RESET_MASS;
    }
    s->len[i] = *n_keep;
    return what;
}

static const kv_policy_ops_t window_ops = {
    .name = "window",
    .default_budget = 1.0,
    .takes_budget = 0,
    .stats = KV_STATS_KEY_MASS,
    .check = window_check,
    .begin = window_begin,
    .end = window_end,
    .kept_after = window_kept_after,
    .collect = window_collect,
    .step_end = window_step_end,
};

/* This test's policy table: the stub in streaming's slot. */
const kv_policy_ops_t *const kv_policy_table[KV_POLICY_COUNT] = {
    [KV_POLICY_FULL] = &kv_policy_full,
    [KV_POLICY_STREAMING] = &window_ops,
    [KV_POLICY_LINEAR] = &kv_policy_linear,
    [KV_POLICY_HEADKV] = &kv_policy_headkv,
};

/* ---- engine steps against the plan ---------------------------------------------- */

static const char *tiny;
static backend_t *be;
static model_t model;
static int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt;

static kv_policy_params_t window_policy(void) {
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.sink_tokens = 2;
    p.recent_lines = 1;
    return p;
}

/* One request under the window stub, in a pool that holds exactly its
 * planned peak (any overrun would fail a reserve), at block sizes 1, 3 and
 * 16: during every step the pool's peak equals the blocks of the heads'
 * lengths worked out by hand, which are within the planned trajectory;
 * after the step each head holds its window; the stub saw the mass it
 * should; at the end every block is back. */
static void test_window_policy_steps_within_plan(void) {
    static const int sizes[] = {1, 3, 16};
    const model_config_t *c = &model.cfg;
    const int steps = model_steps(c), L = c->llm.num_layers, H = c->llm.num_kv_heads;
    kv_policy_params_t pol = window_policy();
    kv_geometry_t g;
    model_geometry(c, n_prompt, &g);
    const int cap = window_cap(&pol, &g);
    planner_plan_t plan;
    memset(&stub, 0, sizeof stub);
    for (int k = 0; k < 3; k++) {
        const int bt = sizes[k];
        const size_t block = kv_pool_block_bytes(bt, c->llm.head_dim, DTYPE_F32);
        ar_error_t err = {{0}};
        CHECK_MSG(planner_plan(&plan, c, &pol, n_prompt, bt, NULL, &err) == AR_OK, "%s", err.msg);
        kv_pool_t pool;
        CHECK(kv_pool_init(&pool, be, (int)(plan.peak_bytes / block), bt, c->llm.head_dim,
                           DTYPE_F32, &err) == AR_OK);
        gen_request_t r;
        sampler_params_t sp = c->sampling;
        CHECK_MSG(gen_request_init(&r, &model, &pool, &pol, cond, uncond, n_prompt, &sp, 7, 0,
                                   &err) == AR_OK,
                  "%s", err.msg);
        gen_request_t *batch[] = {&r};
        int over = 0, wrong_len = 0, wrong_peak = 0;
        for (int t = 0; t < steps; t++) {
            kv_pool_reset_peak(&pool);
            if (gen_step(batch, 1, &err) != AR_OK) {
                CHECK_MSG(0, "step %d, block_tokens %d: %s", t, bt, err.msg);
                break;
            }
            int want_blocks = 0;
            for (int h = 0; h < H; h++) {
                int during = n_prompt + t, hcap = cap - h % 2;
                if (during > hcap + 1)
                    during = hcap + 1;
                want_blocks += 2 * L * ((during + bt - 1) / bt);
                const int after = n_prompt + t < hcap ? n_prompt + t : hcap;
                for (int s = 0; s < 2; s++)
                    for (int l = 0; l < L; l++) {
                        const kv_head_t *kh = &r.seq[s].heads[l * H + h];
                        wrong_len += kh->len != after || kh->n_blocks != (after + bt - 1) / bt;
                    }
            }
            wrong_peak += pool.peak_in_use != want_blocks;
            over += (size_t)pool.peak_in_use * block > plan.bytes[t];
        }
        CHECK_MSG(over == 0, "block_tokens %d: %d steps used more than planned", bt, over);
        CHECK_MSG(wrong_peak == 0, "block_tokens %d: %d steps peaked off the hand count", bt,
                  wrong_peak);
        CHECK_MSG(wrong_len == 0, "block_tokens %d: %d head lengths off the window", bt, wrong_len);
        CHECK(gen_request_done(&r));
        gen_request_free(&r);
        CHECK(kv_pool_blocks_in_use(&pool) == 0 && pool.bad_frees == 0);
        kv_pool_free(&pool);
        planner_plan_free(&plan);
    }
    CHECK(stub.stepped_states == 6); /* one state per sequence of the CFG pair */
    CHECK(stub.protocol_errors == 0);
    CHECK(stub.mass_checks > 0);
    CHECK_MSG(stub.mass_worst < 1e-4, "key mass off by %.3g (relative)", stub.mass_worst);
}

/* The planner's trajectory in bytes: tokens per head -> whole blocks ->
 * bytes, by hand, for the full cache and the window stub. */
static void test_trajectory_bytes_by_hand(void) {
    const model_config_t *c = &model.cfg;
    const int steps = model_steps(c);
    planner_plan_t plan;
    kv_policy_params_t full, win = window_policy();
    kv_policy_defaults(&full, KV_POLICY_FULL);
    kv_geometry_t g;
    model_geometry(c, n_prompt, &g);
    const int cap = window_cap(&win, &g);
    const size_t per_block = (size_t)c->llm.num_layers * c->llm.num_kv_heads * 2 /* CFG */;
    for (int bt = 1; bt <= 16; bt *= 4) {
        const size_t block = 2 * (size_t)bt * c->llm.head_dim * sizeof(float);
        CHECK(planner_plan(&plan, c, &full, n_prompt, bt, NULL, NULL) == AR_OK);
        for (int t = 0; t < steps; t++)
            CHECK(plan.bytes[t] == (size_t)((n_prompt + t + bt - 1) / bt) * block * per_block);
        planner_plan_free(&plan);
        CHECK(planner_plan(&plan, c, &win, n_prompt, bt, NULL, NULL) == AR_OK);
        for (int t = 0; t < steps; t++) {
            int tok = n_prompt + t < cap + 1 ? n_prompt + t : cap + 1;
            CHECK(plan.bytes[t] == (size_t)((tok + bt - 1) / bt) * block * per_block);
        }
        planner_plan_free(&plan);
    }
    /* The full cache at one-token blocks is planner_full_cache_bytes at its last step. */
    CHECK(planner_plan(&plan, c, &full, n_prompt, 1, NULL, NULL) == AR_OK);
    CHECK(plan.bytes[steps - 1] == planner_full_cache_bytes(c, n_prompt));
    planner_plan_free(&plan);
    ar_error_t err = {{0}};
    win.sink_tokens = -1;
    CHECK(planner_plan(&plan, c, &win, n_prompt, 4, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "sink_tokens");
}

/* The full cache, named or not, never reaches the policy: no state, no
 * per-step call, no mass. */
static void test_full_policy_costs_no_policy_calls(void) {
    const model_config_t *c = &model.cfg;
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    kv_pool_t pool;
    ar_error_t err = {{0}};
    const int bt = planner_block_tokens(c);
    const int per_head = (n_prompt + model_steps(c) + bt - 1) / bt;
    CHECK(kv_pool_init(&pool, be, 2 * c->llm.num_layers * c->llm.num_kv_heads * per_head, bt,
                       c->llm.head_dim, DTYPE_F32, &err) == AR_OK);
    memset(&stub, 0, sizeof stub);
    gen_request_t r;
    sampler_params_t sp = c->sampling;
    CHECK(gen_request_init(&r, &model, &pool, &full, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
          AR_OK);
    CHECK(r.seq[0].mass == NULL && r.policy_state[0] == NULL && r.policy_state[1] == NULL);
    gen_request_t *batch[] = {&r};
    while (!gen_request_done(&r))
        CHECK(gen_step(batch, 1, &err) == AR_OK);
    CHECK(stub.stepped_states == 0 && stub.step_ends == 0);
    gen_request_free(&r);
    kv_pool_free(&pool);
}

/* ---- the scheduler ---------------------------------------------------------------- */

static sched_outcome_t wait_job(sched_job_t *j, double timeout_s, sched_snapshot_t *snap) {
    const double until = (double)time(NULL) + timeout_s;
    sched_job_snapshot(j, snap);
    while (snap->outcome == SCHED_PENDING && (double)time(NULL) < until)
        sched_job_wait(j, snap->version, 1.0, snap);
    return snap->outcome;
}

/* A pool that holds one full-cache image at its peak; jobs under the window
 * stub (one and two images) and a full-cache job arrive together. All
 * finish, and no iteration's measured peak passes what the planner
 * reserved. A job whose policy knobs are wrong is refused, naming them. */
static void test_scheduler_measured_use_within_plan(void) {
    metrics_t *metrics = metrics_create();
    ar_error_t err = {{0}};
    sched_options_t so = {.max_running = 8, .max_waiting = 16, .png_workers = 1};
    /* Room for one full image at the daemon's block size: its last step. */
    const int steps = model_steps(&model.cfg);
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    planner_plan_t plan;
    CHECK(planner_plan(&plan, &model.cfg, &full, n_prompt, planner_block_tokens(&model.cfg), NULL,
                       &err) == AR_OK);
    const size_t one_full = plan.bytes[steps - 1];
    planner_plan_free(&plan);
    so.kv_pool_bytes = one_full;
    scheduler_t *s = scheduler_create(&model, &so, metrics, &err);
    if (!s) {
        CHECK_MSG(0, "%s", err.msg);
        metrics_destroy(metrics);
        return;
    }
    CHECK(sched_kv_capacity_bytes(s) == one_full &&
          sched_image_peak_bytes(s, &full, n_prompt) == one_full);
    enum { JOBS = 5 };
    static const int images[JOBS] = {1, 2, 1, 1, 1};
    sched_job_t *jobs[JOBS];
    sched_request_t rq = {.cond = cond,
                          .uncond = uncond,
                          .n_prompt = n_prompt,
                          .params = model.cfg.sampling,
                          .timeout_s = 120};
    for (int k = 0; k < JOBS; k++) {
        rq.n_images = images[k];
        rq.seed = 10 + k;
        rq.kv_policy = k != 3 ? window_policy() : full; /* job 3 keeps the full cache */
        sched_refusal_info_t why;
        jobs[k] = sched_submit(s, &rq, &why);
        CHECK_MSG(jobs[k] != NULL, "job %d: %s", k, why.message);
    }
    rq.n_images = 1;
    rq.kv_policy = window_policy();
    rq.kv_policy.recent_lines = 0;
    sched_refusal_info_t why;
    CHECK(sched_submit(s, &rq, &why) == NULL);
    CHECK(why.reason == SCHED_REFUSED_INVALID_POLICY && why.field == NULL);
    CHECK_STR_CONTAINS(why.message, "recent_lines");
    for (int k = 0; k < JOBS; k++) {
        if (!jobs[k])
            continue;
        sched_snapshot_t snap;
        sched_outcome_t o = wait_job(jobs[k], 120, &snap);
        CHECK_MSG(o == SCHED_DONE, "job %d ended as %d: %s", k, (int)o, snap.message);
        sched_job_release(jobs[k]);
    }
    scheduler_stop(s);
    CHECK_MSG(sched_kv_overruns(s) == 0, "%lld iterations used more KV than planned",
              sched_kv_overruns(s));
    scheduler_destroy(s);
    metrics_destroy(metrics);
}

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-unit sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    be = backend_cpu_create(0, &err);
    if (!be || model_load(&model, tiny, be, &err) != AR_OK ||
        model_prompt_from_text(&model, "a red circle", cond, uncond, &n_prompt, &err) != AR_OK) {
        fprintf(stderr, "%s\n0 passed, 1 failed\n", err.msg);
        return 1;
    }
    TEST_RUN(test_trajectory_bytes_by_hand);
    TEST_RUN(test_window_policy_steps_within_plan);
    TEST_RUN(test_full_policy_costs_no_policy_calls);
    TEST_RUN(test_scheduler_measured_use_within_plan);
    model_free(&model);
    be->destroy(be);
    return TEST_SUMMARY();
}
