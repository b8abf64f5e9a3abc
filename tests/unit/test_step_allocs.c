/* The engine's steady state allocates nothing: once a batch has made its
 * first steps (workspaces and the step arena grown), later steps
 * of the same batch call no malloc, calloc, realloc or aligned_alloc,
 * through gen_step or through the batcher's ops as the daemon drives them.
 * The allocators are wrapped at link time (-Wl,--wrap, the Makefile's rule
 * for this binary), so calls from the engine's own code are counted and
 * calls inside shared libraries (OpenBLAS, libgomp) are not. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/arena.h"
#include "engine/batcher_test.h"
#include "engine/generate.h"
#include "engine/planner.h"
#include "tests/test.h"

static long n_allocs;
static int counting;

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
void *__wrap_malloc(size_t n) {
    n_allocs += counting;
    return __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t size) {
    n_allocs += counting;
    return __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n) {
    n_allocs += counting;
    return __real_realloc(p, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n) {
    n_allocs += counting;
    return __real_aligned_alloc(align, n);
}

/* The arena: 64-byte blocks that do not overlap, nested scopes that keep
 * the outer one's blocks, and a scope that spilled grows the chunk when
 * the next one opens, after which scopes of that size allocate nothing. */
static void test_arena(void) {
    arena_t a = {0};
    arena_begin(&a);
    unsigned char *p = arena_alloc(&a, 100), *q = arena_alloc(&a, 1);
    CHECK(p && q && (uintptr_t)p % 64 == 0 && (uintptr_t)q % 64 == 0);
    CHECK(q >= p + 100 || q + 1 <= p);
    memset(p, 0xab, 100);
    arena_begin(&a); /* a nested scope: p stays */
    unsigned char *z = arena_calloc(&a, 50, 2);
    CHECK(z && z != p && z[0] == 0 && z[99] == 0);
    arena_end(&a);
    CHECK(p[99] == 0xab);
    arena_end(&a);
    for (int round = 0; round < 3; round++) {
        n_allocs = 0;
        counting = 1;
        arena_begin(&a);
        for (int i = 0; i < 10; i++)
            CHECK(arena_alloc(&a, 1000) != NULL);
        arena_end(&a);
        counting = 0;
        /* round 0 spills; round 1 opens with the chunk's growth, its one allocation */
        CHECK_MSG(round == 0 ? n_allocs >= 10 : n_allocs == (round == 1),
                  "round %d: %ld allocations", round, n_allocs);
    }
    arena_free(&a);
}

static const char *tiny, *var_tiny;
static backend_t *be;

/* The model at dir, its prompt (a class for a next-scale model), and a
 * pool for n_images full caches. */
static int load_dir(const char *dir, model_t *m, kv_pool_t *pool, int n_images, int cond[],
                    int uncond[], int *n) {
    ar_error_t err = {{0}};
    if (model_load(m, dir, be, &err) != AR_OK ||
        (model_is_class_conditional(m)
             ? model_prompt_from_class(m, 1, cond, uncond, n, &err)
             : model_prompt_from_text(m, "a red circle", cond, uncond, n, &err)) != AR_OK) {
        CHECK_MSG(0, "%s: %s", dir, err.msg);
        return AR_ERR;
    }
    const int bt = planner_block_tokens(&m->cfg);
    const llm_config_t *l = &m->cfg.llm;
    const int per_head = (*n + model_image_tokens(&m->cfg) + bt - 1) / bt;
    if (kv_pool_init(pool, be, n_images * 2 * l->num_layers * l->num_kv_heads * per_head, bt,
                     l->head_dim, DTYPE_F32, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        model_free(m);
        return AR_ERR;
    }
    return AR_OK;
}

static int load(model_t *m, kv_pool_t *pool, int n_images, int cond[], int uncond[], int *n) {
    return load_dir(tiny, m, pool, n_images, cond, uncond, n);
}

/* Three images under each policy a raster model runs, stepped together:
 * steps 2 .. the last but one allocate nothing. */
static void test_gen_step(kv_policy_kind_t kind, double budget) {
    model_t m;
    kv_pool_t pool;
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n;
    if (load(&m, &pool, 3, cond, uncond, &n) != AR_OK)
        return;
    kv_policy_params_t pol;
    kv_policy_defaults(&pol, kind);
    if (kind != KV_POLICY_FULL)
        pol.budget = budget;
    gen_request_t r[3];
    gen_request_t *b[] = {&r[0], &r[1], &r[2]};
    ar_error_t err = {{0}};
    for (int i = 0; i < 3; i++)
        CHECK_MSG(gen_request_init(&r[i], &m, &pool, &pol, cond, uncond, n, &m.cfg.sampling,
                                   (uint64_t)i, 0, &err) == AR_OK,
                  "%s", err.msg);
    const int steps = r[0].n_steps;
    long during = -1;
    for (int s = 0; s < steps && !err.msg[0]; s++) {
        if (s == 2) {
            n_allocs = 0;
            counting = 1;
        }
        if (s == steps - 1) {
            counting = 0;
            during = n_allocs;
        }
        CHECK_MSG(gen_step(b, 3, &err) == AR_OK, "%s", err.msg);
    }
    counting = 0;
    CHECK_MSG(during == 0, "%s: %ld allocations in steps 2..%d", kv_policy_name(kind), during,
              steps - 2);
    for (int i = 0; i < 3; i++)
        gen_request_free(&r[i]);
    kv_pool_free(&pool);
    model_free(&m);
}

static void test_full(void) { test_gen_step(KV_POLICY_FULL, 1); }
static void test_streaming(void) { test_gen_step(KV_POLICY_STREAMING, 0.5); }
static void test_linear(void) { test_gen_step(KV_POLICY_LINEAR, 0.5); }
static void test_headkv(void) { test_gen_step(KV_POLICY_HEADKV, 0.75); }

/* The same on the LlamaGen architecture (class token, 2D RoPE, plain head):
 * its golden tiny model under every raster policy. */
static void test_llamagen(void) {
    const char *janus = tiny;
    tiny = "tests/golden/llamagen_tiny";
    test_gen_step(KV_POLICY_FULL, 1);
    test_gen_step(KV_POLICY_STREAMING, 0.5);
    test_gen_step(KV_POLICY_LINEAR, 0.75);
    test_gen_step(KV_POLICY_HEADKV, 0.75);
    tiny = janus;
}

/* A next-scale model's steps are its scales, each larger than the last:
 * once a batch of two has run every scale (the step arena, the workspaces
 * and the latent buffers grown), the next batch of two allocates nothing
 * after its first step (which makes its requests' AdaLN tables). */
static void test_scale_steps(void) {
    model_t m;
    kv_pool_t pool;
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n;
    if (load_dir(var_tiny, &m, &pool, 2, cond, uncond, &n) != AR_OK)
        return;
    ar_error_t err = {{0}};
    for (int round = 0; round < 2; round++) {
        gen_request_t r[2];
        gen_request_t *b[] = {&r[0], &r[1]};
        for (int i = 0; i < 2; i++)
            CHECK_MSG(gen_request_init(&r[i], &m, &pool, NULL, cond, uncond, n, &m.cfg.sampling,
                                       (uint64_t)i, 0, &err) == AR_OK,
                      "%s", err.msg);
        long during = 0;
        for (int s = 0; s < r[0].n_steps && !err.msg[0]; s++) {
            n_allocs = 0;
            counting = round == 1 && s > 0;
            CHECK_MSG(gen_step(b, 2, &err) == AR_OK, "%s", err.msg);
            counting = 0;
            during += n_allocs;
        }
        if (round == 1)
            CHECK_MSG(during == 0, "%ld allocations in scales 1..%d of the second batch", during,
                      r[0].n_steps - 1);
        for (int i = 0; i < 2; i++)
            gen_request_free(&r[i]);
    }
    kv_pool_free(&pool);
    model_free(&m);
}

/* Two jobs through the batcher (its step and remaining ops, the planner's
 * bookkeeping, the events a driver takes): the iterations between
 * admission and the first end allocate nothing. */
static void test_batcher(void) {
    model_t m;
    kv_pool_t pool;
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n;
    if (load(&m, &pool, 3, cond, uncond, &n) != AR_OK)
        return;
    ar_error_t err = {{0}};
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    planner_plan_t plan;
    CHECK_MSG(planner_plan(&plan, &m.cfg, &full, n, pool.blocks.block_tokens, NULL, &err) == AR_OK,
              "%s", err.msg);
    size_t *kv2 = malloc((size_t)plan.steps * sizeof *kv2);
    for (int s = 0; s < plan.steps; s++)
        kv2[s] = 2 * plan.bytes[s];
    const batcher_options_t opt = {
        .pool_bytes = (size_t)pool.n_blocks * kv_pool_block_bytes(pool.blocks.block_tokens,
                                                                  pool.blocks.head_dim, DTYPE_F32),
        .max_running = 3,
        .max_waiting = 4};
    batcher_t *bt = batcher_create(&opt, &gen_batcher_ops, &pool, &err);
    gen_job_t jobs[2] = {{0}};
    for (int j = 0; j < 2; j++) {
        jobs[j] = (gen_job_t){.model = &m,
                              .cond = cond,
                              .uncond = uncond,
                              .n_prompt = n,
                              .n_images = j + 1,
                              .params = m.cfg.sampling,
                              .seed = (uint64_t)j,
                              .policy = full};
        const batcher_job_t job = {.n_images = j + 1,
                                   .steps = plan.steps,
                                   .kv_bytes = j ? kv2 : plan.bytes,
                                   .deadline = INFINITY,
                                   .work = &jobs[j]};
        uint64_t id;
        CHECK(batcher_submit(bt, &job, &id) == BATCHER_ACCEPTED);
    }
    long during = -1;
    for (int it = 0; it < plan.steps; it++) {
        if (it == 2) {
            n_allocs = 0;
            counting = 1;
        }
        if (it == plan.steps - 1) {
            counting = 0;
            during = n_allocs;
        }
        batcher_iterate(bt, 0);
        batcher_event_t ev[16]; /* taken every iteration, as the daemon's engine loop does */
        while (batcher_take_events(bt, ev, 16) == 16)
            ;
    }
    counting = 0;
    CHECK_MSG(during == 0, "%ld allocations in iterations 2..%d", during, plan.steps - 2);
    for (int it = 0; it < 4; it++)
        batcher_iterate(bt, 0);
    CHECK(gen_request_done(&jobs[0].images[0]) && gen_request_done(&jobs[1].images[1]));
    batcher_destroy(bt);
    for (int j = 0; j < 2; j++)
        gen_job_free(&jobs[j]);
    free(kv2);
    planner_plan_free(&plan);
    kv_pool_free(&pool);
    model_free(&m);
}

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny)
        tiny = "build/tiny-model";
    var_tiny = getenv("ARSERVE_VAR_TINY_MODEL");
    if (!var_tiny)
        var_tiny = "build/var-tiny-model";
    ar_error_t err = {{0}};
    be = backend_cpu_create(1, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_arena);
    TEST_RUN(test_full);
    TEST_RUN(test_streaming);
    TEST_RUN(test_linear);
    TEST_RUN(test_headkv);
    TEST_RUN(test_llamagen);
    TEST_RUN(test_batcher);
    TEST_RUN(test_scale_steps);
    be->destroy(be);
    return TEST_SUMMARY();
}
