/* End to end on two backends: the tiny model (ARSERVE_TINY_MODEL) generates
 * an image with greedy decoding on the CPU backend and on the CUDA backend
 * (under the emulator in CI, on a GPU in tests/gpu), step by step in
 * lockstep, for the full cache and for every KV policy at a budget that
 * validates on its 8 x 8 grid. The tokens must be equal. Where they are
 * not, the test fails naming the first differing step and the CPU's logit
 * margin there (top-1 minus top-2 of the guided logits): a small margin
 * means float differences between the backends, a large one a bug. */
#include "engine/backend/backend.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "tests/test.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const char *tiny;
static backend_t *cpu, *dut;
static model_t m_cpu, m_dut;
static int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt;

/* Guided logits as the greedy sampler ranks them: uncond + w (cond - uncond). */
static void guided(const float *logits, int K, float w, float *out) {
    for (int i = 0; i < K; i++)
        out[i] = logits[K + i] + w * (logits[i] - logits[K + i]);
}

static float top_margin(const float *g, int K) {
    float a = -INFINITY, b = -INFINITY;
    for (int i = 0; i < K; i++) {
        if (g[i] > a) {
            b = a;
            a = g[i];
        } else if (g[i] > b) {
            b = g[i];
        }
    }
    return a - b;
}

/* A pool on be that holds the full cache of one request at block_tokens. */
static int pool_for(kv_pool_t *pool, backend_t *be, const model_config_t *c, int bt,
                    ar_error_t *err) {
    const int per_head = (n_prompt + model_steps(c) + bt - 1) / bt;
    return kv_pool_init(pool, be, 2 * c->llm.num_layers * c->llm.num_kv_heads * per_head, bt,
                        c->llm.head_dim, DTYPE_F32, err);
}

/* One image on both backends under `pol`, compared token by token. */
static void check_same_tokens(const char *name, const kv_policy_params_t *pol, int bt) {
    const model_config_t *c = &m_cpu.cfg;
    const int K = c->image.codebook_size;
    ar_error_t err = {{0}};
    kv_pool_t pc, pd;
    CHECK_MSG(pool_for(&pc, cpu, c, bt, &err) == AR_OK, "%s", err.msg);
    CHECK_MSG(pool_for(&pd, dut, c, bt, &err) == AR_OK, "%s", err.msg);
    sampler_params_t sp = c->sampling;
    sp.temperature = 0; /* greedy */
    gen_request_t rc, rd;
    CHECK_MSG(gen_request_init(&rc, &m_cpu, &pc, pol, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
                  AR_OK,
              "%s: %s", name, err.msg);
    CHECK_MSG(gen_request_init(&rd, &m_dut, &pd, pol, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
                  AR_OK,
              "%s: %s", name, err.msg);
    float *gc = malloc((size_t)K * sizeof *gc), *gd = malloc((size_t)K * sizeof *gd);
    gen_request_t *bc[] = {&rc}, *bd[] = {&rd};
    double worst_logit = 0;
    int diverged = -1;
    while (!gen_request_done(&rc)) {
        const int t = rc.step;
        if (gen_step(bc, 1, &err) != AR_OK || gen_step(bd, 1, &err) != AR_OK) {
            CHECK_MSG(0, "%s: step %d: %s", name, t, err.msg);
            break;
        }
        guided(rc.logits, K, sp.cfg, gc);
        guided(rd.logits, K, sp.cfg, gd);
        for (int i = 0; i < K; i++) {
            const double d = fabs((double)gc[i] - gd[i]);
            worst_logit = d > worst_logit ? d : worst_logit;
        }
        if (rc.tokens[t] != rd.tokens[t]) {
            diverged = t;
            CHECK_MSG(0,
                      "%s (block_tokens %d): first differing token at step %d: cpu %d, cuda %d; "
                      "cpu logit margin there %.3g, largest guided-logit difference so far %.3g",
                      name, bt, t, rc.tokens[t], rd.tokens[t], top_margin(gc, K), worst_logit);
            break;
        }
    }
    if (diverged < 0)
        fprintf(stderr,
                "        %s (block_tokens %d): %d tokens equal; largest guided-logit "
                "difference %.3g\n",
                name, bt, rc.n_steps, worst_logit);
    free(gc);
    free(gd);
    gen_request_free(&rc);
    gen_request_free(&rd);
    CHECK(pc.bad_frees == 0 && pd.bad_frees == 0);
    kv_pool_free(&pc);
    kv_pool_free(&pd);
}

/* The policy at the first of these budgets that validates on the tiny
 * model's grid (the defaults assume a 24 x 24 grid and may not). */
static int policy_for(kv_policy_kind_t kind, kv_policy_params_t *p) {
    static const double budgets[] = {0, 0.5, 0.625, 0.75, 1.0}; /* 0: the default */
    kv_geometry_t g;
    model_geometry(&m_cpu.cfg, n_prompt, &g);
    ar_error_t err = {{0}};
    for (size_t i = 0; i < sizeof budgets / sizeof *budgets; i++) {
        kv_policy_defaults(p, kind);
        if (budgets[i] > 0)
            p->budget = budgets[i];
        if (kv_policy_check(p, &g, NULL, &err) == AR_OK)
            return AR_OK;
    }
    CHECK_MSG(0, "%s: no budget validates on the tiny grid: %s", kv_policy_name(kind), err.msg);
    return AR_ERR;
}

static void test_full_cache_same_tokens(void) {
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_FULL);
    check_same_tokens("full", &p, kv_pool_choose_block_tokens(model_steps(&m_cpu.cfg) / 8));
    check_same_tokens("full", &p, 3); /* a block size that splits lines */
}

static void test_policies_same_tokens(void) {
    const kv_policy_kind_t kinds[] = {KV_POLICY_STREAMING, KV_POLICY_LINEAR, KV_POLICY_HEADKV};
    const int bt = kv_pool_choose_block_tokens(model_steps(&m_cpu.cfg) / 8);
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
        kv_policy_params_t p;
        if (policy_for(kinds[i], &p) != AR_OK)
            continue;
        char name[64];
        snprintf(name, sizeof name, "%s@%.3g", kv_policy_name(kinds[i]), p.budget);
        check_same_tokens(name, &p, bt);
    }
}

/* A failure inside a backend op (here a bad free, as a failed launch would
 * be) surfaces at the end of the step that made it: gen_step fails with
 * the backend's message, and the failure is sticky, as a CUDA context's. */
static void test_backend_failure_fails_the_step(void) {
    ar_error_t err = {{0}};
    backend_t *b = backend_cuda_create(0, (size_t)128 << 20, &err);
    model_t m;
    CHECK_MSG(b && model_load(&m, tiny, b, &err) == AR_OK, "%s", err.msg);
    if (!b)
        return;
    kv_pool_t pool;
    CHECK_MSG(pool_for(&pool, b, &m.cfg, 1, &err) == AR_OK, "%s", err.msg);
    gen_request_t r;
    sampler_params_t sp = m.cfg.sampling;
    CHECK_MSG(gen_request_init(&r, &m, &pool, NULL, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
                  AR_OK,
              "%s", err.msg);
    gen_request_t *batch[] = {&r};
    CHECK_MSG(gen_step(batch, 1, &err) == AR_OK, "%s", err.msg);
    int x;
    b->free(b, &x); /* not an allocation of b: recorded, not fatal */
    CHECK(gen_step(batch, 1, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "step failed on the cuda backend");
    CHECK_STR_CONTAINS(err.msg, "not a live allocation");
    CHECK(gen_step(batch, 1, &err) == AR_ERR);
    gen_request_free(&r);
    kv_pool_free(&pool);
    model_free(&m);
    b->destroy(b);
}

typedef struct fork_draw {
    gen_drawer_t *drawer;
    const int *tokens;
    int n_done, rounds;
    uint8_t *rgb;
    int rc;
    ar_error_t err;
} fork_draw_t;

static void *draw_on_fork(void *arg) {
    fork_draw_t *f = arg;
    for (int i = 0; i < f->rounds && f->rc == AR_OK; i++)
        f->rc = gen_drawer_draw(f->drawer, f->tokens, f->n_done, f->rgb, &f->err);
    return NULL;
}

/* A fork of m's backend draws, on a thread of its own, the image the
 * backend itself decodes, byte for byte, while the backend steps a second
 * request on this thread; that request's tokens equal the first's (greedy,
 * same prompt): neither side touched the other's scratch. */
static void check_fork_draws_beside_steps(model_t *m) {
    const model_config_t *c = &m->cfg;
    const size_t px = (size_t)model_config_image_height(c) * model_config_image_width(c) * 3;
    ar_error_t err = {{0}};
    kv_pool_t pool;
    CHECK_MSG(pool_for(&pool, m->be, c, 4, &err) == AR_OK, "%s", err.msg);
    sampler_params_t sp = c->sampling;
    sp.temperature = 0;
    gen_request_t r1, r2;
    CHECK_MSG(gen_request_init(&r1, m, &pool, NULL, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
                  AR_OK,
              "%s", err.msg);
    gen_request_t *b1[] = {&r1}, *b2[] = {&r2};
    while (!gen_request_done(&r1))
        CHECK_MSG(gen_step(b1, 1, &err) == AR_OK, "%s", err.msg);
    uint8_t *want = malloc(px), *got = calloc(px, 1);
    CHECK_MSG(gen_decode(&r1, want, &err) == AR_OK, "%s", err.msg);
    const int n = r1.n_steps;
    int *tokens = malloc((size_t)n * sizeof *tokens);
    memcpy(tokens, r1.tokens, (size_t)n * sizeof *tokens);
    gen_request_free(&r1); /* its blocks back: the pool holds one request */
    gen_drawer_t d;
    CHECK_MSG(gen_drawer_open(&d, m, 1, &err) == AR_OK, "%s", err.msg);
    CHECK_MSG(gen_request_init(&r2, m, &pool, NULL, cond, uncond, n_prompt, &sp, 1, 0, &err) ==
                  AR_OK,
              "%s", err.msg);
    fork_draw_t f = {.drawer = &d, .tokens = tokens, .n_done = n, .rounds = 3, .rgb = got};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, draw_on_fork, &f) == 0);
    while (!gen_request_done(&r2))
        CHECK_MSG(gen_step(b2, 1, &err) == AR_OK, "%s", err.msg);
    pthread_join(th, NULL);
    CHECK_MSG(f.rc == AR_OK, "%s", f.err.msg);
    CHECK_MSG(!memcmp(want, got, px), "%s: the fork drew another image", m->be->name);
    CHECK_MSG(!memcmp(tokens, r2.tokens, (size_t)n * sizeof *tokens),
              "%s: stepping beside a drawing fork changed the tokens", m->be->name);
    gen_drawer_close(&d);
    gen_request_free(&r2);
    free(tokens);
    free(want);
    free(got);
    kv_pool_free(&pool);
}

static void test_fork_draws_beside_steps(void) {
    check_fork_draws_beside_steps(&m_cpu);
    check_fork_draws_beside_steps(&m_dut);
}

/* A fork that does not fit in its parent's reservation is refused with the
 * sizes; the parent goes on. */
static void test_fork_too_large_is_an_error(void) {
    ar_error_t err = {{0}};
    backend_t *f = dut->fork(dut, (size_t)1 << 40, 1, &err);
    CHECK(f == NULL);
    CHECK_STR_CONTAINS(err.msg, "a fork needs");
    f = dut->fork(dut, 1 << 20, 1, &err);
    CHECK_MSG(f != NULL, "%s", err.msg);
    if (f)
        f->destroy(f);
}

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-backend sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    cpu = backend_cpu_create(0, &err);
    dut = cpu ? backend_cuda_create(0, (size_t)256 << 20, &err) : NULL;
    if (!dut || model_load(&m_cpu, tiny, cpu, &err) != AR_OK ||
        model_load(&m_dut, tiny, dut, &err) != AR_OK ||
        model_prompt_from_text(&m_cpu, "a red circle", cond, uncond, &n_prompt, &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_full_cache_same_tokens);
    TEST_RUN(test_policies_same_tokens);
    TEST_RUN(test_backend_failure_fails_the_step);
    TEST_RUN(test_fork_draws_beside_steps);
    TEST_RUN(test_fork_too_large_is_an_error);
    model_free(&m_cpu);
    model_free(&m_dut);
    dut->destroy(dut);
    cpu->destroy(cpu);
    return TEST_SUMMARY();
}
