/* The shipped demo models on the CUDA backend against the CPU backend: each
 * model directory is loaded on both, and for every KV policy that runs on
 * it (at its default budget, else the smallest that validates) one greedy
 * image is generated on both in lockstep (tests/lockstep.h: a near-tie
 * feeds the CPU's token to both; a token that differs by a margin above
 * the tie tolerance fails). Both then draw the same tokens, and the largest
 * pixel difference (0..255) must be at most PIXEL_TOL.
 *
 * The models: argv, else ARSERVE_TEST_MODELS (space-separated), else
 * models/shapes and models/shapes-var (run from the repository root). Each
 * is DIR or DIR=POLICY,POLICY,...: only those policies. tests/gpu/run.sh
 * runs every policy of both; make test, under the emulator, the full cache
 * of models/shapes (its raster policies run on the tiny model in
 * test_backend_e2e) and three policies of models/shapes-var. */
#include "engine/backend/backend.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/policy/kv_policy.h"
#include "tests/lockstep.h"
#include "tests/test.h"
#include "tests/test_backend.h"

#include <stdlib.h>
#include <string.h>

/* The shipped models' guided logits reach about 46 (models/shapes, cfg 1.5:
 * 1.5 cond - 0.5 uncond; models/shapes-var, cfg 3 ramped from 1 to 4).
 * Under the emulator the backends' guided logits differ by 1e-4 on
 * models/shapes: float rounding through 6 layers of 256 (the CPU's own GEMM
 * for decode rows against OpenBLAS's order), an ulp of expf or rsqrtf,
 * times the guidance; a GPU's cuBLAS and kernels are of the same order. On
 * models/shapes-var, whose 7 blocks' weights are int8, by up to 8.6e-4 on an
 * AVX-512 machine and 1.01e-3 on an AVX2 one (HeatKV's image): the CUDA
 * backend multiplies an 8-bit weight as a bf16 one, its activations in two
 * bf16 halves (16 significant bits, where the CPU keeps fp32's 24; its F16
 * export differs by 1.5e-4), times a guidance of up to 4 - (-3). GAP is
 * 3e-5 of the largest logit: a softmax off by 0.1% moves them by 2e-2. Two
 * greedy tokens differ only where the CPU's top-two margin is under twice
 * the gap: the tie tolerance. */
#define GAP 1.5e-3
#define TIE_TOL (2 * GAP)
/* Both backends draw the same tokens; a float difference at the decoder's
 * output of an ulp or so can only move a pixel across one rounding edge of
 * the 8-bit conversion. A wrong decoder kernel moves them by tens. */
#define PIXEL_TOL 1
/* Device memory for one model, its decoder and the pools (both models hold
 * about 15 MB of weights). */
#define CUDA_RESERVE_BYTES ((size_t)512 << 20)

static backend_t *cpu, *dut;
/* What test_model_on_cuda_matches_cpu checks: DIR or DIR=POLICY,... */
static char model_spec[1024];

/* The condition rows of the model's first prompt: "a red circle" for a
 * text-prompted model, its class 0 for a class-conditional one. */
static int prompt_of(const model_t *m, int *cond, int *uncond, int *n, ar_error_t *err) {
    if (model_is_class_conditional(m))
        return model_prompt_from_class(m, 0, cond, uncond, n, err);
    return model_prompt_from_text(m, "a red circle", cond, uncond, n, err);
}

/* Whether a model's policy list (NULL: every policy) names kind. */
static int policy_wanted(const char *only, kv_policy_kind_t kind) {
    if (!only)
        return 1;
    const char *name = kv_policy_name(kind);
    const size_t len = strlen(name);
    for (const char *p = only; *p;) {
        const size_t n = strcspn(p, ",");
        if (n == len && !strncmp(p, name, len))
            return 1;
        p += n + (p[n] == ',');
    }
    return 0;
}

/* The policy of this kind at its default budget, else at the smallest that
 * validates on g; AR_ERR (err says why) when it does not run on g. */
static int policy_for(kv_policy_kind_t kind, const kv_geometry_t *g, kv_policy_params_t *p,
                      ar_error_t *err) {
    kv_policy_defaults(p, kind);
    if (!kv_policy_suits(kind, g))
        return ar_errorf(err, "not a policy of this geometry");
    if (kv_policy_check(p, g, NULL, err) == AR_OK)
        return AR_OK;
    const double least = kv_policy_min_budget(p, g);
    if (least <= 0)
        return AR_ERR; /* err: the default's failure */
    p->budget = least;
    return kv_policy_check(p, g, NULL, err);
}

/* One greedy image of m on both backends under p, in lockstep, then drawn
 * on both; the CPU alone must choose the tokens the lockstep fed. */
static void check_policy(const char *dir, model_t *mc, model_t *md, const kv_policy_params_t *p,
                         const int *cond, const int *uncond, int n_prompt) {
    const model_config_t *c = &mc->cfg;
    const size_t n_px = (size_t)model_config_image_height(c) * model_config_image_width(c) * 3;
    char name[1200];
    snprintf(name, sizeof name, "%s, %s@%.4g", dir, kv_policy_name(p->kind), p->budget);
    ar_error_t err = {{0}};
    kv_pool_t pc, pa, pd;
    if (gen_pool_for_one_image(&pc, mc, n_prompt, DTYPE_F32, &err) != AR_OK ||
        gen_pool_for_one_image(&pa, mc, n_prompt, DTYPE_F32, &err) != AR_OK ||
        gen_pool_for_one_image(&pd, md, n_prompt, DTYPE_F32, &err) != AR_OK) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    sampler_params_t sp = c->sampling;
    sp.temperature = 0; /* greedy */
    gen_request_t rc, rd, alone;
    if (gen_request_init(&rc, mc, &pc, p, cond, uncond, n_prompt, &sp, 1, 0, &err) != AR_OK ||
        gen_request_init(&rd, md, &pd, p, cond, uncond, n_prompt, &sp, 1, 0, &err) != AR_OK ||
        gen_request_init(&alone, mc, &pa, p, cond, uncond, n_prompt, &sp, 1, 0, &err) != AR_OK) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    lockstep_t ls;
    CHECK_MSG(lockstep_run(&rc, &rd, TIE_TOL, name, &ls, &err) == AR_OK, "%s: %s", name, err.msg);
    CHECK_MSG(ls.diverged_at < 0,
              "%s: token %d differs: cpu %d, cuda %d, cpu margin %.3g above the tie tolerance "
              "%.3g; largest guided-logit difference so far %.3g",
              name, ls.diverged_at, ls.ref_token, ls.dut_token, ls.margin, TIE_TOL, ls.worst_logit);
    CHECK_MSG(isfinite(ls.worst_logit), "%s: a guided logit is not a number", name);
    CHECK_MSG(!LOCKSTEP_HOLD_GAP || ls.worst_logit <= GAP,
              "%s: guided logits differ by %.3g, bound %.3g", name, ls.worst_logit, GAP);
    if (ls.diverged_at < 0 && !err.msg[0]) {
        const int first = lockstep_ref_alone(&alone, rc.tokens, &err);
        CHECK_MSG(first == -1,
                  "%s: the CPU alone chose another token at %d than the lockstep fed%s%s", name,
                  first, err.msg[0] ? ": " : "", err.msg);
        uint8_t *img_c = malloc(n_px), *img_d = malloc(n_px);
        int worst_px = -1;
        if (gen_decode(&rc, img_c, &err) == AR_OK && gen_decode(&rd, img_d, &err) == AR_OK) {
            worst_px = 0;
            for (size_t i = 0; i < n_px; i++) {
                const int d = abs((int)img_c[i] - (int)img_d[i]);
                worst_px = d > worst_px ? d : worst_px;
            }
        }
        CHECK_MSG(worst_px >= 0, "%s: drawing: %s", name, err.msg);
        CHECK_MSG(worst_px <= PIXEL_TOL, "%s: pixels differ by %d/255 (bound %d)", name, worst_px,
                  PIXEL_TOL);
        fprintf(stderr,
                "%s: %d tokens in %d steps, %d ties (widest margin %.3g, tolerance %.3g); guided "
                "logits up to %.3g, %.3g apart (bound %.3g%s), narrowest margin %.3g; largest "
                "pixel difference %d/255\n",
                name, ls.tokens, rc.n_steps, ls.ties, ls.widest_tie, TIE_TOL, ls.largest,
                ls.worst_logit, GAP, LOCKSTEP_HOLD_GAP ? "" : ", not held", ls.narrowest, worst_px);
        free(img_c);
        free(img_d);
    }
    gen_request_free(&rc);
    gen_request_free(&rd);
    gen_request_free(&alone);
    CHECK(pc.bad_frees == 0 && pa.bad_frees == 0 && pd.bad_frees == 0);
    kv_pool_free(&pc);
    kv_pool_free(&pa);
    kv_pool_free(&pd);
}

/* Every policy that runs on the model in dir (of those `only` names, NULL:
 * all); at least the full cache when it is asked for. */
static void check_model(const char *dir, const char *only) {
    ar_error_t err = {{0}};
    model_t mc, md;
    if (model_load(&mc, dir, cpu, &err) != AR_OK) {
        CHECK_MSG(0, "%s on the cpu backend: %s", dir, err.msg);
        return;
    }
    if (model_load(&md, dir, dut, &err) != AR_OK) {
        CHECK_MSG(0, "%s on the cuda backend: %s", dir, err.msg);
        model_free(&mc);
        return;
    }
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt = 0;
    if (prompt_of(&mc, cond, uncond, &n_prompt, &err) != AR_OK) {
        CHECK_MSG(0, "%s: %s", dir, err.msg);
    } else {
        kv_geometry_t g;
        model_geometry(&mc.cfg, n_prompt, &g);
        int ran = 0;
        for (int k = 0; k < KV_POLICY_COUNT; k++) {
            kv_policy_params_t p;
            ar_error_t why = {{0}};
            if (!policy_wanted(only, (kv_policy_kind_t)k))
                continue;
            if (policy_for((kv_policy_kind_t)k, &g, &p, &why) != AR_OK) {
                fprintf(stderr, "%s, %s: does not run on it (%s)\n", dir, kv_policy_names[k],
                        why.msg);
                continue;
            }
            check_policy(dir, &mc, &md, &p, cond, uncond, n_prompt);
            ran += k == KV_POLICY_FULL;
        }
        CHECK_MSG(ran || !policy_wanted(only, KV_POLICY_FULL), "%s: the full cache did not run",
                  dir);
    }
    model_free(&mc);
    model_free(&md);
}

static void test_model_on_cuda_matches_cpu(void) {
    char *only = strchr(model_spec, '=');
    if (only)
        *only++ = 0;
    fprintf(stderr, "== %s (%s)\n", model_spec, only ? only : "every policy");
    check_model(model_spec, only);
}

int main(int argc, char **argv) {
    static const char *shipped[] = {"models/shapes", "models/shapes-var"};
    const char **dirs = shipped;
    int n_dirs = 2;
    char *env = getenv("ARSERVE_TEST_MODELS") ? strdup(getenv("ARSERVE_TEST_MODELS")) : NULL;
    const char *from_env[16];
    if (argc > 1) {
        dirs = (const char **)(argv + 1);
        n_dirs = argc - 1;
    } else if (env) {
        n_dirs = 0;
        for (char *s = strtok(env, " "); s && n_dirs < 16; s = strtok(NULL, " "))
            from_env[n_dirs++] = s;
        dirs = from_env;
    }
    ar_error_t err = {{0}};
    cpu = backend_cpu_create(0, &err);
    dut = cpu ? test_cuda_create(0, CUDA_RESERVE_BYTES, &err) : NULL;
    if (dut) /* the mode held to the CPU's bounds (backend.h) */
        dut->activations = ACTIVATIONS_SPLIT;
    if (!dut) {
        fprintf(stderr, "%s\n", err.msg);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    for (int i = 0; i < n_dirs; i++) {
        snprintf(model_spec, sizeof model_spec, "%s", dirs[i]);
        TEST_RUN(test_model_on_cuda_matches_cpu);
    }
    free(env);
    dut->destroy(dut);
    cpu->destroy(cpu);
    return TEST_SUMMARY();
}
