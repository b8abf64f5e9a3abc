/* 8-bit Linear weights against the checkpoint's own type, on the golden
 * models of every family (Janus, LlamaGen, VAR, Infinity, and Janus with
 * bf16 weights): each model and its int8 and fp8 copies (tools/quantize.py,
 * made by the Makefile under $ARSERVE_W8_GOLDEN) draw the same prompt;
 *   - teacher-forced on the original's greedy tokens, the largest logit
 *     error of the 8-bit model, as a share of the original's largest
 *     logit magnitude, stays within the type's bound below;
 *   - greedy (top-k 1, the same seed), the share of tokens the 8-bit model
 *     changes is printed (a random tiny model's logits are near ties, so
 *     it is measured, not bounded).
 * The bounds sit beside the 16-bit KV ones of test_golden.c: int8 keeps
 * about 7 bits of each row's largest weight, fp8 e4m3 3 bits of each
 * weight. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "tests/test.h"

/* Largest teacher-forced logit error over the largest logit magnitude:
 * measured at most 0.0295 (int8, var_tiny) and 0.0847 (fp8, infinity_tiny)
 * over the goldens; tiny random weights, so relatively coarse rows. */
#define INT8_BOUND 0.04
#define FP8_BOUND 0.12

static const char *const GOLDENS[] = {"janus_tiny", "janus_tiny_bf16", "llamagen_tiny", "var_tiny",
                                      "infinity_tiny"};

typedef struct run {
    int *tokens, n_tokens;
    float *logits; /* every step's kept logits, back to back */
    size_t n_logits;
} run_t;

static void run_free(run_t *r) {
    free(r->tokens);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* One image of m, greedy, teacher-forced on forced when it is not NULL;
 * its tokens and every step's logits into out. */
static int draw(model_t *m, const int *forced, run_t *out, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n = 0;
    if ((model_is_class_conditional(m)
             ? model_prompt_from_class(m, 1, cond, uncond, &n, err)
             : model_prompt_from_text(m, "a red circle", cond, uncond, &n, err)) != AR_OK)
        return AR_ERR;
    planner_plan_t plan;
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    const int bt = planner_block_tokens(&m->cfg);
    if (planner_plan(&plan, &m->cfg, &full, n, bt, NULL, err) != AR_OK)
        return AR_ERR;
    const size_t block = kv_pool_block_bytes(bt, m->cfg.llm.head_dim, DTYPE_F32);
    const int blocks = (int)((plan.peak_bytes + block - 1) / block) + 1;
    planner_plan_free(&plan);
    kv_pool_t pool;
    if (kv_pool_init(&pool, m->be, blocks, bt, m->cfg.llm.head_dim, DTYPE_F32, err) != AR_OK)
        return AR_ERR;
    sampler_params_t sp = m->cfg.sampling;
    sp.top_k = 1;
    gen_request_t r;
    int rc = gen_request_init(&r, m, &pool, NULL, cond, uncond, n, &sp, 7, 0, err);
    if (rc == AR_OK) {
        r.forced = forced;
        gen_request_t *batch[] = {&r};
        while (rc == AR_OK && !gen_request_done(&r)) {
            rc = gen_step(batch, 1, err);
            if (rc != AR_OK || !r.n_logits)
                continue;
            float *grown = realloc(out->logits, (out->n_logits + r.n_logits) * sizeof(float));
            if (!grown) {
                rc = ar_errorf(err, "out of memory");
                break;
            }
            out->logits = grown;
            memcpy(out->logits + out->n_logits, r.logits, r.n_logits * sizeof(float));
            out->n_logits += r.n_logits;
        }
        const size_t values = gen_request_token_values(&r); /* Infinity: bits */
        if (rc == AR_OK && (out->tokens = malloc(values * sizeof(int)))) {
            memcpy(out->tokens, r.tokens, values * sizeof(int));
            out->n_tokens = (int)values;
        }
        gen_request_free(&r);
    }
    kv_pool_free(&pool);
    return rc;
}

static void check_golden(backend_t *be, const char *name, const char *w8) {
    char dir[1024];
    snprintf(dir, sizeof dir, "tests/golden/%s", name);
    model_t orig;
    ar_error_t err = {{0}};
    run_t base, base_free;
    if (model_load(&orig, dir, be, &err) != AR_OK || draw(&orig, NULL, &base_free, &err) != AR_OK ||
        draw(&orig, base_free.tokens, &base, &err) != AR_OK) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    double peak = 0;
    for (size_t i = 0; i < base.n_logits; i++)
        peak = fmax(peak, fabs(base.logits[i]));
    static const struct {
        const char *suffix;
        double bound;
    } types[] = {{"int8", INT8_BOUND}, {"fp8", FP8_BOUND}};
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        snprintf(dir, sizeof dir, "%s/%s-%s", w8, name, types[t].suffix);
        model_t q;
        run_t forced, greedy;
        if (model_load(&q, dir, be, &err) != AR_OK ||
            draw(&q, base_free.tokens, &forced, &err) != AR_OK ||
            draw(&q, NULL, &greedy, &err) != AR_OK) {
            CHECK_MSG(0, "%s: %s", dir, err.msg);
            return;
        }
        CHECK(forced.n_logits == base.n_logits && greedy.n_tokens == base_free.n_tokens);
        double worst = 0;
        for (size_t i = 0; i < base.n_logits && i < forced.n_logits; i++)
            worst = fmax(worst, fabs(forced.logits[i] - base.logits[i]));
        int changed = 0;
        for (int i = 0; i < greedy.n_tokens && i < base_free.n_tokens; i++)
            changed += greedy.tokens[i] != base_free.tokens[i];
        const double rel = peak > 0 ? worst / peak : worst;
        printf("%-16s %-4s: teacher-forced logit error %.3g (%.4f of the largest logit %.3g; "
               "bound %.2g), greedy token values changed %d of %d (%.1f%%), weights %.1f%% of the "
               "original's bytes\n",
               name, types[t].suffix, worst, rel, peak, types[t].bound, changed, base_free.n_tokens,
               100.0 * changed / base_free.n_tokens,
               100.0 * (double)q.weight_bytes / (double)orig.weight_bytes);
        CHECK_MSG(rel <= types[t].bound, "%s %s: logits off by %.4f of the largest (bound %.2g)",
                  name, types[t].suffix, rel, types[t].bound);
        CHECK_MSG(q.weight_bytes < orig.weight_bytes, "%s %s: %zu bytes, not fewer than %zu", name,
                  types[t].suffix, q.weight_bytes, orig.weight_bytes);
        run_free(&forced);
        run_free(&greedy);
        model_free(&q);
    }
    run_free(&base);
    run_free(&base_free);
    model_free(&orig);
}

static backend_t *be;
static const char *w8_dir;

static void test_8bit_weights_keep_each_golden_models_logits(void) {
    for (size_t i = 0; i < sizeof GOLDENS / sizeof *GOLDENS; i++)
        check_golden(be, GOLDENS[i], w8_dir);
}

int main(void) {
    w8_dir = getenv("ARSERVE_W8_GOLDEN");
    ar_error_t err = {{0}};
    if (!w8_dir) {
        printf("ARSERVE_W8_GOLDEN is not set (the Makefile makes the goldens' 8-bit copies)\n"
               "0 passed, 1 failed\n");
        return 1;
    }
    if (!(be = backend_cpu_create(1, &err))) {
        printf("backend: %s\n0 passed, 1 failed\n", err.msg);
        return 1;
    }
    TEST_RUN(test_8bit_weights_keep_each_golden_models_logits);
    be->destroy(be);
    return TEST_SUMMARY();
}
