/* End to end on two backends: the tiny model (ARSERVE_TINY_MODEL) generates
 * an image with greedy decoding on the CPU backend and on the CUDA backend
 * (under the emulator in CI, on a GPU in tests/gpu), step by step in
 * lockstep (tests/lockstep.h), for the full cache and for every KV policy at
 * a budget that validates on its 8 x 8 grid, with K and V stored in f32,
 * bf16, f16 and fp8 (scales of 1, and scales measured on the prompt). Where
 * the two greedy tokens differ by less than the KV type's tie tolerance of
 * the CPU's top-two margin, the CPU's token is fed to both and the tie is
 * counted; a difference above it fails the test, naming the step, both
 * tokens and the margin. */
#include "engine/backend/backend.h"
#include "engine/calibration_run.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "tests/lockstep.h"
#include "tests/test.h"
#include "tests/test_backend.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const char *tiny;
static backend_t *cpu, *dut;
static model_t m_cpu, m_dut;
static int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt;

/* How far the two backends' guided logits may be apart, per KV type: 4x
 * what the emulator measures against the CPU on this model, whose guided
 * logits (cfg 5: 6 cond - 5 uncond) reach about 22.
 *  - f32 K and V: the backends differ by float rounding alone (an ulp of
 *    expf or rsqrtf, FMA contraction, summation order), 2.5e-4 here (an
 *    ulp or two of each raw logit times the guidance's 11); a GPU's cuBLAS
 *    and kernels are of the same order. 1e-3 is 5e-5 of the largest logit:
 *    a softmax off by 0.1% moves them by 2e-2.
 *  - A 16- or 8-bit cache rounds K and V after those differences: an
 *    element on the other side of a rounding edge moves by a whole step of
 *    the type (2^-11 of it in f16, 2^-8 in bf16, 2^-4 in e4m3). Measured:
 *    f16 1.1e-3, bf16 1.2e-2, e4m3 1.5e-2 with scales of 1 (K and V mostly
 *    in its subnormals, where the step is 2^-9), 6e-4 with measured scales.
 * Two greedy tokens can differ only where the CPU's top-two margin is under
 * twice the gap (the top two move toward each other by at most the gap
 * each): the tie tolerance is twice the bound. */
#define GAP_F32 1e-3
#define GAP_F16 5e-3
#define GAP_BF16 5e-2
#define GAP_FP8 6e-2
#define TIE_TOL(gap) (2 * (gap))
#define TIE_TOL_F32 TIE_TOL(GAP_F32)

static const struct kv_type {
    dtype_t dtype;
    double gap;
} kv_types[] = {
    {DTYPE_F32, GAP_F32},
    {DTYPE_BF16, GAP_BF16},
    {DTYPE_F16, GAP_F16},
    {DTYPE_F8_E4M3, GAP_FP8},
};
#define N_KV_TYPES (sizeof kv_types / sizeof kv_types[0])

/* fp8 scales measured on the CPU on the test's prompt (main). */
static fp8_scales_t measured;

/* A pool on be that holds the full caches of n requests at block_tokens. */
static int pool_for(kv_pool_t *pool, backend_t *be, const model_config_t *c, int n, int bt,
                    dtype_t dtype, ar_error_t *err) {
    const int per_head = (n_prompt + model_steps(c) + bt - 1) / bt;
    return kv_pool_init(pool, be, n * 2 * c->llm.num_layers * c->llm.num_kv_heads * per_head, bt,
                        c->llm.head_dim, dtype, err);
}

/* One image on both backends under `pol`, K and V as kt says, in lockstep;
 * then the CPU alone, which must choose what the lockstep fed. */
static void check_lockstep(const char *name, const kv_policy_params_t *pol, int bt,
                           const struct kv_type *kt) {
    const model_config_t *c = &m_cpu.cfg;
    ar_error_t err = {{0}};
    kv_pool_t pc, pd;
    if (pool_for(&pc, cpu, c, 2, bt, kt->dtype, &err) != AR_OK ||
        pool_for(&pd, dut, c, 1, bt, kt->dtype, &err) != AR_OK) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    sampler_params_t sp = c->sampling;
    sp.temperature = 0; /* greedy */
    gen_request_t rc, rd, alone;
    if (gen_request_init(&rc, &m_cpu, &pc, pol, cond, uncond, n_prompt, &sp, 1, 0, &err) != AR_OK ||
        gen_request_init(&rd, &m_dut, &pd, pol, cond, uncond, n_prompt, &sp, 1, 0, &err) != AR_OK ||
        gen_request_init(&alone, &m_cpu, &pc, pol, cond, uncond, n_prompt, &sp, 1, 0, &err) !=
            AR_OK) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    const char *kv = dtype_name(kt->dtype);
    const double tol = TIE_TOL(kt->gap);
    lockstep_t ls;
    CHECK_MSG(lockstep_run(&rc, &rd, tol, name, &ls, &err) == AR_OK, "%s, %s KV: %s", name, kv,
              err.msg);
    CHECK_MSG(ls.diverged_at < 0,
              "%s (%s KV, block_tokens %d): token %d differs: cpu %d, cuda %d, cpu margin %.3g "
              "above the tie tolerance %.3g; largest guided-logit difference so far %.3g",
              name, kv, bt, ls.diverged_at, ls.ref_token, ls.dut_token, ls.margin, tol,
              ls.worst_logit);
    CHECK_MSG(isfinite(ls.worst_logit), "%s, %s KV: a guided logit is not a number", name, kv);
    CHECK_MSG(!LOCKSTEP_HOLD_GAP || ls.worst_logit <= kt->gap,
              "%s (%s KV, block_tokens %d): guided logits differ by %.3g, bound %.3g", name, kv, bt,
              ls.worst_logit, kt->gap);
    if (ls.diverged_at < 0) {
        const int first = lockstep_ref_alone(&alone, rc.tokens, &err);
        CHECK_MSG(first == -1,
                  "%s, %s KV: the CPU alone chose another token at %d than the lockstep fed (%s)",
                  name, kv, first, err.msg);
        fprintf(stderr,
                "        %-16s %-7s KV, blocks of %2d: %d tokens, %d ties (widest margin %.3g, "
                "tolerance %.3g); guided logits up to %.3g, %.3g apart (bound %.3g%s), "
                "narrowest margin %.3g\n",
                name, kv, bt, ls.tokens, ls.ties, ls.widest_tie, tol, ls.largest, ls.worst_logit,
                kt->gap, LOCKSTEP_HOLD_GAP ? "" : ", not held", ls.narrowest);
    }
    gen_request_free(&rc);
    gen_request_free(&rd);
    gen_request_free(&alone);
    CHECK(pc.bad_frees == 0 && pd.bad_frees == 0);
    kv_pool_free(&pc);
    kv_pool_free(&pd);
}

/* The decision itself, on made-up margins: a near-tie goes on, a clear
 * difference fails, a NaN margin fails, the same token is the same. */
static void test_lockstep_judges_ties_by_the_margin(void) {
    CHECK(lockstep_judge(3, 3, 0.0, TIE_TOL_F32) == LOCKSTEP_SAME);
    CHECK(lockstep_judge(3, 3, 5.0, TIE_TOL_F32) == LOCKSTEP_SAME);
    CHECK(lockstep_judge(3, 4, TIE_TOL_F32 / 10, TIE_TOL_F32) == LOCKSTEP_TIE);
    CHECK(lockstep_judge(3, 4, TIE_TOL_F32 * 10, TIE_TOL_F32) == LOCKSTEP_DIVERGED);
    CHECK(lockstep_judge(3, 4, TIE_TOL_F32, TIE_TOL_F32) == LOCKSTEP_DIVERGED);
    CHECK(lockstep_judge(3, 4, NAN, TIE_TOL_F32) == LOCKSTEP_DIVERGED);
    /* The greedy pick is the sampler's: the highest, the lowest id on a
     * tie, NaN never chosen. */
    const float g[] = {1.0f, NAN, 2.5f, 2.5f, 2.4995f};
    double margin;
    CHECK(lockstep_greedy(g, 5, &margin) == 2 && margin == 0.0);
    CHECK(lockstep_greedy(g + 3, 2, &margin) == 0 && fabs(margin - 5e-4) < 1e-6);
    CHECK(lockstep_judge(lockstep_greedy(g + 3, 2, &margin), 1, margin, TIE_TOL_F32) ==
          LOCKSTEP_TIE);
}

/* The tie path through real steps, deterministic on any machine: the
 * "backend under test" is the CPU itself on another prompt, so tokens
 * differ at some steps. With an unbounded tolerance every difference is a
 * tie: the run goes to the end, and the reference's tokens are those it
 * chooses alone (the other prompt's tokens never reach it). With none, the
 * run stops at the first difference. */
static void test_lockstep_feeds_the_reference_token_on_a_tie(void) {
    const model_config_t *c = &m_cpu.cfg;
    int cond2[MODEL_MAX_PROMPT_TOKENS], uncond2[MODEL_MAX_PROMPT_TOKENS], n2;
    ar_error_t err = {{0}};
    kv_pool_t pool;
    if (model_prompt_from_text(&m_cpu, "a blue square on the left", cond2, uncond2, &n2, &err) !=
            AR_OK ||
        /* Three requests, and one more for the longer prompt's extra tokens. */
        pool_for(&pool, cpu, c, 4, 1, DTYPE_F32, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    sampler_params_t sp = c->sampling;
    sp.temperature = 0;
    for (int bounded = 0; bounded <= 1; bounded++) {
        gen_request_t a, b, alone;
        if (gen_request_init(&a, &m_cpu, &pool, NULL, cond, uncond, n_prompt, &sp, 1, 0, &err) ||
            gen_request_init(&b, &m_cpu, &pool, NULL, cond2, uncond2, n2, &sp, 1, 0, &err) ||
            gen_request_init(&alone, &m_cpu, &pool, NULL, cond, uncond, n_prompt, &sp, 1, 0,
                             &err)) {
            CHECK_MSG(0, "%s", err.msg);
            break;
        }
        lockstep_t ls;
        CHECK_MSG(lockstep_run(&a, &b, bounded ? 0.0 : INFINITY, NULL, &ls, &err) == AR_OK, "%s",
                  err.msg);
        const int first = lockstep_ref_alone(&alone, a.tokens, &err);
        if (!bounded) {
            printf("another prompt as the backend under test: %d ties in %d tokens\n", ls.ties,
                   ls.tokens);
            CHECK_MSG(ls.ties > 0, "the two prompts chose the same %d tokens", ls.tokens);
            CHECK(ls.diverged_at < 0 && ls.tokens == a.n_tokens);
            CHECK_MSG(first == -1, "the reference's token %d is not its own", first);
        } else {
            /* Stopped at the first difference, the reference's token fed
             * up to and including it. */
            CHECK(ls.ties == 0 && ls.diverged_at >= 0 && ls.tokens == ls.diverged_at + 1);
            CHECK(ls.diverged_at < 0 || first < 0 || first > ls.diverged_at);
            CHECK(ls.diverged_at < 0 || ls.ref_token == alone.tokens[ls.diverged_at]);
            printf("the same with no tolerance: stopped at token %d (%d against %d, margin %.3g)\n",
                   ls.diverged_at, ls.ref_token, ls.dut_token, ls.margin);
        }
        gen_request_free(&a);
        gen_request_free(&b);
        gen_request_free(&alone);
    }
    CHECK(pool.bad_frees == 0);
    kv_pool_free(&pool);
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

/* Every KV type under the full cache, then fp8 with measured scales. */
static void test_full_cache_same_tokens(void) {
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_FULL);
    const int bt = kv_pool_choose_block_tokens(model_steps(&m_cpu.cfg) / 8);
    for (size_t i = 0; i < N_KV_TYPES; i++) {
        check_lockstep("full", &p, bt, &kv_types[i]);
        check_lockstep("full", &p, 3, &kv_types[i]); /* a block size that splits lines */
    }
    m_cpu.fp8_scales = m_dut.fp8_scales = measured;
    check_lockstep("full, fp8 scales", &p, bt, &kv_types[N_KV_TYPES - 1]);
    m_cpu.fp8_scales = m_dut.fp8_scales = (fp8_scales_t){0};
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
        for (size_t t = 0; t < N_KV_TYPES; t++)
            check_lockstep(name, &p, bt, &kv_types[t]);
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
    CHECK_MSG(pool_for(&pool, b, &m.cfg, 1, 1, DTYPE_F32, &err) == AR_OK, "%s", err.msg);
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
        f->rc = gen_drawer_draw(f->drawer, f->tokens, 0, f->n_done, f->rgb, &f->err);
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
    CHECK_MSG(pool_for(&pool, m->be, c, 1, 4, DTYPE_F32, &err) == AR_OK, "%s", err.msg);
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
 * sizes; the parent goes on. A fork drives its device as its parent does
 * (graphs, activations, batch invariance). */
static void test_fork_too_large_is_an_error(void) {
    ar_error_t err = {{0}};
    backend_t *f = dut->fork(dut, (size_t)1 << 40, 1, &err);
    CHECK(f == NULL);
    CHECK_STR_CONTAINS(err.msg, "a fork needs");
    const backend_graphs_t graphs = dut->graphs;
    const backend_activations_t activations = dut->activations;
    dut->graphs = graphs == GRAPHS_ON ? GRAPHS_OFF : GRAPHS_ON;
    dut->activations = activations == ACTIVATIONS_SPLIT ? ACTIVATIONS_16BIT : ACTIVATIONS_SPLIT;
    dut->batch_invariant = !dut->batch_invariant;
    f = dut->fork(dut, 1 << 20, 1, &err);
    CHECK_MSG(f != NULL, "%s", err.msg);
    if (f) {
        CHECK(f->graphs == dut->graphs && f->activations == dut->activations &&
              f->batch_invariant == dut->batch_invariant);
        f->destroy(f);
    }
    dut->graphs = graphs;
    dut->activations = activations;
    dut->batch_invariant = !dut->batch_invariant;
}

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-backend sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    cpu = backend_cpu_create(0, &err);
    dut = cpu ? test_cuda_create(0, (size_t)256 << 20, &err) : NULL;
    if (dut) /* the mode held to the CPU's bounds (backend.h) */
        dut->activations = ACTIVATIONS_SPLIT;
    if (!dut || model_load(&m_cpu, tiny, cpu, &err) != AR_OK ||
        model_load(&m_dut, tiny, dut, &err) != AR_OK ||
        model_prompt_from_text(&m_cpu, "a red circle", cond, uncond, &n_prompt, &err) != AR_OK ||
        fp8_scales_measure(&m_cpu, (const char *[]){"a red circle"}, 1, NULL, NULL, &measured,
                           &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_lockstep_judges_ties_by_the_margin);
    TEST_RUN(test_lockstep_feeds_the_reference_token_on_a_tie);
    TEST_RUN(test_full_cache_same_tokens);
    TEST_RUN(test_policies_same_tokens);
    TEST_RUN(test_backend_failure_fails_the_step);
    TEST_RUN(test_fork_draws_beside_steps);
    TEST_RUN(test_fork_too_large_is_an_error);
    fp8_scales_free(&measured);
    model_free(&m_cpu);
    model_free(&m_dut);
    dut->destroy(dut);
    cpu->destroy(cpu);
    return TEST_SUMMARY();
}
