/* Tests for engine/sampler.c: seeded determinism, CFG arithmetic, greedy
 * tie-breaking, top-k and top-p support, draw frequencies, NaN handling, and
 * agreement with a naive full-sort reference on random inputs.
 * Run: gcc -std=c11 -I. tests/unit/test_sampler.c engine/sampler.c base/rng.c
 *      base/status.c -lm && ./a.out */
#include "base/rng.h"
#include "engine/sampler.h"
#include "tests/test.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* A small deterministic generator for test inputs (splitmix64). */
static uint64_t test_rand_state = 0x9e3779b97f4a7c15ULL;
static uint64_t test_rand_u64(void) {
    uint64_t z = (test_rand_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static float test_rand_float(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(test_rand_u64() >> 11) * 0x1p-53);
}

static sampler_params_t params(float temperature, int top_k, float top_p) {
    sampler_params_t p = {.cfg = 1.0f, .temperature = temperature, .top_k = top_k, .top_p = top_p};
    return p;
}

static void test_init_rejects_bad_vocab(void) {
    sampler_t s;
    ar_error_t err = {{0}};
    CHECK(sampler_init(&s, 0, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "vocab");
    CHECK(sampler_init(&s, -3, NULL) == AR_ERR);
    sampler_free(&s); /* freeable after a failed init */
    CHECK(sampler_init(&s, 1, &err) == AR_OK);
    float one = 3.0f;
    sampler_params_t p = params(1.0f, 0, 1.0f);
    CHECK(sampler_next(&s, &one, NULL, &p, 1, 2, 3) == 0);
    sampler_free(&s);
    sampler_free(&s);
}

static void test_cfg_combine_exact(void) {
    enum { N = 257 };
    float cond[N], uncond[N], out[N];
    for (int i = 0; i < N; i++) {
        cond[i] = test_rand_float(-20, 20);
        uncond[i] = test_rand_float(-20, 20);
    }
    const float cfgs[] = {0.0f, 1.0f, 4.0f, 5.0f, 7.5f, -1.0f};
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
        sampler_cfg_combine(out, cond, uncond, N, cfgs[c]);
        int mismatches = 0;
        for (int i = 0; i < N; i++) {
            float expect = uncond[i] + cfgs[c] * (cond[i] - uncond[i]);
            mismatches += memcmp(&out[i], &expect, sizeof expect) != 0;
        }
        CHECK_MSG(mismatches == 0, "cfg %g: %d mismatches", cfgs[c], mismatches);
    }
    /* cfg 0 gives the unconditional logits exactly. */
    sampler_cfg_combine(out, cond, uncond, N, 0.0f);
    CHECK(memcmp(out, uncond, sizeof out) == 0);
    /* No uncond: a copy of cond. */
    sampler_cfg_combine(out, cond, NULL, N, 5.0f);
    CHECK(memcmp(out, cond, sizeof out) == 0);
    /* Hand-checked values, and out aliasing cond. */
    float a[3] = {1.0f, 2.0f, -1.0f}, b[3] = {0.5f, 3.0f, -1.0f};
    sampler_cfg_combine(a, a, b, 3, 4.0f);
    CHECK(a[0] == 2.5f && a[1] == -1.0f && a[2] == -1.0f);
}

/* The sampler applies CFG before choosing: cond alone prefers token 0, the
 * guided logits prefer token 2. */
static void test_next_uses_cfg(void) {
    sampler_t s;
    CHECK(sampler_init(&s, 3, NULL) == AR_OK);
    const float cond[3] = {2.0f, 1.0f, 1.5f}, uncond[3] = {2.0f, 1.0f, 0.0f};
    sampler_params_t p = params(0.0f, 0, 1.0f);
    p.cfg = 3.0f; /* guided: {2, 1, 4.5} */
    CHECK(sampler_next(&s, cond, uncond, &p, 0, 0, 0) == 2);
    CHECK(sampler_next(&s, cond, NULL, &p, 0, 0, 0) == 0);
    p.cfg = 0.0f; /* guided = uncond: {2, 1, 0} */
    CHECK(sampler_next(&s, cond, uncond, &p, 0, 0, 0) == 0);
    sampler_free(&s);
}

static void test_greedy_and_ties(void) {
    enum { V = 40 };
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float lg[V];
    for (int i = 0; i < V; i++)
        lg[i] = test_rand_float(-5, 5);
    lg[17] = 9.0f;
    lg[31] = 9.0f; /* tie: the lower id wins */
    lg[3] = 8.999f;
    const sampler_params_t ps[] = {params(1.0f, 1, 1.0f), params(0.0f, 0, 1.0f),
                                   params(0.0f, 50, 0.5f), params(-1.0f, 0, 1.0f)};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++)
        for (uint64_t seed = 0; seed < 50; seed++)
            CHECK(sampler_next(&s, lg, NULL, &ps[i], seed, seed * 7, seed * 3) == 17);
    /* All equal: token 0. */
    for (int i = 0; i < V; i++)
        lg[i] = 0.25f;
    CHECK(sampler_next(&s, lg, NULL, &ps[0], 5, 0, 0) == 0);
    CHECK(sampler_next(&s, lg, NULL, &ps[1], 5, 0, 0) == 0);
    sampler_free(&s);
}

static void test_seeded_determinism(void) {
    enum { V = 1000 };
    sampler_t s1, s2;
    CHECK(sampler_init(&s1, V, NULL) == AR_OK);
    CHECK(sampler_init(&s2, V, NULL) == AR_OK);
    float cond[V], uncond[V];
    for (int i = 0; i < V; i++) {
        cond[i] = test_rand_float(-2, 2);
        uncond[i] = test_rand_float(-2, 2);
    }
    sampler_params_t p = {.cfg = 2.0f, .temperature = 1.0f, .top_k = 0, .top_p = 1.0f};
    static int seen[V];
    memset(seen, 0, sizeof seen);
    int distinct = 0, same = 1;
    for (uint64_t seed = 0; seed < 300; seed++) {
        int a = sampler_next(&s1, cond, uncond, &p, seed, 4, 11);
        /* A different sampler, after unrelated work, gives the same token. */
        (void)sampler_next(&s2, uncond, cond, &p, seed + 1, 0, 0);
        int b = sampler_next(&s2, cond, uncond, &p, seed, 4, 11);
        same &= a == b;
        distinct += !seen[a];
        seen[a] = 1;
    }
    CHECK(same);
    CHECK_MSG(distinct > 50, "only %d distinct tokens over 300 seeds", distinct);
    /* Streams and steps explore too. */
    int differ_stream = 0, differ_step = 0;
    for (uint64_t i = 0; i < 100; i++) {
        int base = sampler_next(&s1, cond, uncond, &p, 1234, i, 0);
        differ_stream += sampler_next(&s1, cond, uncond, &p, 1234, i + 100, 0) != base;
        differ_step += sampler_next(&s1, cond, uncond, &p, 1234, i, 1) != base;
    }
    CHECK(differ_stream > 80);
    CHECK(differ_step > 80);
    sampler_free(&s1);
    sampler_free(&s2);
}

/* Top-k over a wide vocabulary: the draws stay within the k highest logits
 * (ties at the boundary go to the lower ids), and cover them. */
static void test_top_k_support(void) {
    enum { V = 3000, K = 7 };
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float lg[V];
    for (int i = 0; i < V; i++)
        lg[i] = test_rand_float(-1, 0.9f);
    /* Top 7: five distinct highs, then three tokens tied for 6th/7th place. */
    const int high[5] = {2999, 5, 1500, 77, 2048};
    for (int i = 0; i < 5; i++)
        lg[high[i]] = 1.5f - 0.05f * (float)i;
    lg[2500] = lg[900] = lg[1200] = 1.0f; /* 900 and 1200 are in, 2500 is out */
    int in_topk[V] = {0};
    for (int i = 0; i < 5; i++)
        in_topk[high[i]] = 1;
    in_topk[900] = in_topk[1200] = 1;

    int counts[V] = {0}, outside = 0;
    sampler_params_t p = params(1.0f, K, 1.0f);
    for (uint64_t seed = 0; seed < 1500; seed++) {
        int tok = sampler_next(&s, lg, NULL, &p, seed, 0, 0);
        counts[tok]++;
        outside += !in_topk[tok];
    }
    CHECK(outside == 0);
    for (int i = 0; i < V; i++)
        if (in_topk[i])
            CHECK_MSG(counts[i] > 0, "top-k token %d never drawn", i);

    /* Large k on a larger vocabulary (the LlamaGen c2i setting), with a hot
     * temperature so the draws reach deep into the kept set. */
    enum { V2 = 16384, K2 = 2000 };
    sampler_t s2;
    CHECK(sampler_init(&s2, V2, NULL) == AR_OK);
    float *lg2 = malloc(V2 * sizeof *lg2);
    float *sorted = malloc(V2 * sizeof *sorted);
    for (int i = 0; i < V2; i++)
        lg2[i] = test_rand_float(-3, 3);
    memcpy(sorted, lg2, V2 * sizeof *sorted);
    /* The K2-th highest value by bisection (the values are distinct with
     * overwhelming probability; checked below). */
    float cut = -INFINITY;
    {
        int above = 0;
        float lo = -3, hi = 3;
        for (int it = 0; it < 60; it++) {
            float mid = 0.5f * (lo + hi);
            above = 0;
            for (int i = 0; i < V2; i++)
                above += sorted[i] >= mid;
            if (above >= K2)
                lo = mid;
            else
                hi = mid;
        }
        cut = lo;
        above = 0;
        for (int i = 0; i < V2; i++)
            above += lg2[i] >= cut;
        CHECK(above == K2);
    }
    sampler_params_t p2 = params(100.0f, K2, 1.0f);
    int outside2 = 0;
    char *hit = calloc(V2, 1);
    int distinct = 0;
    for (uint64_t seed = 0; seed < 1500; seed++) {
        int tok = sampler_next(&s2, lg2, NULL, &p2, seed, 1, 2);
        outside2 += lg2[tok] < cut;
        distinct += !hit[tok];
        hit[tok] = 1;
    }
    CHECK(outside2 == 0);
    /* Near-uniform over K2: about K2 * (1 - e^-0.75) = 1055 distinct expected. */
    CHECK_MSG(distinct > 950, "%d of %d kept tokens drawn", distinct, K2);
    free(hit);
    free(lg2);
    free(sorted);
    sampler_free(&s2);
    sampler_free(&s);
}

/* Top-p with probabilities 0.4, 0.3, 0.2, 0.1 on shuffled ids: a nucleus of
 * 0.65 keeps exactly the first two (0.4 < 0.65 <= 0.7). Top-k renormalises
 * first: with k = 3 the masses are 4/9, 3/9, 2/9, so top_p 0.75 still keeps
 * two (7/9 > 0.75), while without top-k it keeps three (0.7 < 0.75). */
static void test_top_p_support(void) {
    enum { V = 6 };
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float lg[V];
    lg[4] = logf(0.4f);
    lg[1] = logf(0.3f);
    lg[5] = logf(0.2f);
    lg[0] = logf(0.1f);
    lg[2] = -INFINITY;
    lg[3] = -INFINITY;
    struct {
        sampler_params_t p;
        int allowed[V];
        double share[V]; /* expected frequencies */
    } cases[] = {
        {params(1.0f, 0, 0.65f), {0, 1, 0, 0, 1, 0}, {0, 3.0 / 7, 0, 0, 4.0 / 7, 0}},
        {params(1.0f, 0, 0.75f), {0, 1, 0, 0, 1, 1}, {0, 1.0 / 3, 0, 0, 4.0 / 9, 2.0 / 9}},
        {params(1.0f, 3, 0.75f), {0, 1, 0, 0, 1, 0}, {0, 3.0 / 7, 0, 0, 4.0 / 7, 0}},
        {params(1.0f, 0, 0.0f), {0, 0, 0, 0, 1, 0}, {0, 0, 0, 0, 1, 0}},
        {params(1.0f, 0, 0.3f), {0, 0, 0, 0, 1, 0}, {0, 0, 0, 0, 1, 0}},
        {params(1.0f, 0, 0.95f), {1, 1, 0, 0, 1, 1}, {0.1, 0.3, 0, 0, 0.4, 0.2}},
        {params(1.0f, 0, 1.0f), {1, 1, 0, 0, 1, 1}, {0.1, 0.3, 0, 0, 0.4, 0.2}},
        {params(1.0f, 0, NAN), {1, 1, 0, 0, 1, 1}, {0.1, 0.3, 0, 0, 0.4, 0.2}},
    };
    enum { DRAWS = 8000 };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int counts[V] = {0}, bad = 0;
        for (uint64_t i = 0; i < DRAWS; i++) {
            int tok = sampler_next(&s, lg, NULL, &cases[c].p, 42, 9, i);
            counts[tok]++;
            bad += !cases[c].allowed[tok];
        }
        CHECK_MSG(bad == 0, "case %zu: %d draws outside the nucleus", c, bad);
        for (int t = 0; t < V; t++) {
            double q = cases[c].share[t], sd = sqrt(q * (1 - q) / DRAWS);
            CHECK_MSG(fabs((double)counts[t] / DRAWS - q) <= 5 * sd + 1e-9,
                      "case %zu token %d: %.4f vs %.4f", c, t, (double)counts[t] / DRAWS, q);
        }
    }
    sampler_free(&s);
}

/* 20000 draws from a 5-token distribution match it within 5 standard errors,
 * at temperature 1 and at temperature 2 (probabilities ~ p^(1/2)). */
static void test_frequencies_match(void) {
    enum { V = 5, DRAWS = 20000 };
    const double prob[V] = {0.5, 0.25, 0.125, 0.0625, 0.0625};
    const int id_of[V] = {3, 0, 4, 1, 2};
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float cond[V], uncond[V];
    for (int i = 0; i < V; i++) {
        /* Through CFG: 1 + 2 * (c - 1) = log p  =>  c = (log p + 1) / 2. */
        uncond[id_of[i]] = 1.0f;
        cond[id_of[i]] = (float)((log(prob[i]) + 1.0) / 2.0);
    }
    const float temps[] = {1.0f, 2.0f};
    for (int ti = 0; ti < 2; ti++) {
        sampler_params_t p = {.cfg = 2.0f, .temperature = temps[ti], .top_k = 0, .top_p = 1.0f};
        double z = 0, q[V];
        for (int i = 0; i < V; i++)
            z += q[i] = pow(prob[i], 1.0 / temps[ti]);
        int counts[V] = {0};
        for (uint64_t seed = 0; seed < DRAWS; seed++)
            counts[sampler_next(&s, cond, uncond, &p, seed, 0, 0)]++;
        for (int i = 0; i < V; i++) {
            double e = q[i] / z, f = (double)counts[id_of[i]] / DRAWS;
            CHECK_MSG(fabs(f - e) <= 5 * sqrt(e * (1 - e) / DRAWS), "T=%g token %d: %.4f vs %.4f",
                      temps[ti], id_of[i], f, e);
        }
    }
    sampler_free(&s);
}

static void test_nan_and_inf(void) {
    enum { V = 8 };
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float lg[V], un[V];
    sampler_params_t sample = params(1.0f, 0, 1.0f), greedy = params(0.0f, 0, 1.0f);

    /* NaN is never drawn and never wins greedy, even at index 0. */
    for (int i = 0; i < V; i++)
        lg[i] = (i % 2) ? 0.0f : NAN;
    int nan_drawn = 0;
    for (uint64_t seed = 0; seed < 500; seed++)
        nan_drawn += sampler_next(&s, lg, NULL, &sample, seed, 0, 0) % 2 == 0;
    CHECK(nan_drawn == 0);
    CHECK(sampler_next(&s, lg, NULL, &greedy, 0, 0, 0) == 1);

    /* NaN in the unconditional row poisons that token only. */
    for (int i = 0; i < V; i++)
        lg[i] = un[i] = 0.0f;
    lg[6] = 10.0f;
    un[6] = NAN;
    lg[2] = 1.0f;
    sample.cfg = greedy.cfg = 3.0f;
    CHECK(sampler_next(&s, lg, un, &greedy, 0, 0, 0) == 2);
    for (uint64_t seed = 0; seed < 200; seed++)
        CHECK(sampler_next(&s, lg, un, &sample, seed, 0, 0) != 6);
    sample.cfg = greedy.cfg = 1.0f;

    /* Everything NaN or -inf: token 0, for every mode. */
    for (int i = 0; i < V; i++)
        lg[i] = (i % 3) ? -INFINITY : NAN;
    const sampler_params_t modes[] = {sample, greedy, params(1.0f, 3, 0.5f), params(0.5f, 0, 0.9f)};
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++)
        for (uint64_t seed = 0; seed < 20; seed++)
            CHECK(sampler_next(&s, lg, NULL, &modes[m], seed, 0, 0) == 0);

    /* Two +inf logits share the mass; finite ones get none. */
    for (int i = 0; i < V; i++)
        lg[i] = 5.0f;
    lg[3] = lg[5] = INFINITY;
    int c3 = 0, c5 = 0;
    for (uint64_t seed = 0; seed < 2000; seed++) {
        int tok = sampler_next(&s, lg, NULL, &sample, seed, 0, 0);
        c3 += tok == 3;
        c5 += tok == 5;
    }
    CHECK(c3 + c5 == 2000);
    CHECK(c3 > 850 && c5 > 850);
    CHECK(sampler_next(&s, lg, NULL, &greedy, 0, 0, 0) == 3);

    /* A tiny temperature is greedy in effect, not NaN. */
    for (int i = 0; i < V; i++)
        lg[i] = (float)i * 0.001f;
    sampler_params_t cold = params(1e-40f, 0, 1.0f);
    for (uint64_t seed = 0; seed < 50; seed++)
        CHECK(sampler_next(&s, lg, NULL, &cold, seed, 0, 0) == V - 1);
    sampler_free(&s);
}

/* The naive definition: sort every token by (logit desc, id asc), softmax
 * over the top k, cut the nucleus, walk the CDF. It uses the same float
 * operations in the same order, so it must agree exactly. */
static const float *ref_lg;
static int ref_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    if (ref_lg[x] != ref_lg[y])
        return ref_lg[x] > ref_lg[y] ? -1 : 1;
    return x < y ? -1 : (x > y);
}
static int reference_next(const float *cond, const float *uncond, int n, const sampler_params_t *p,
                          uint64_t seed, uint64_t stream, uint64_t step) {
    float *lg = malloc((size_t)n * sizeof *lg);
    int *ord = malloc((size_t)n * sizeof *ord);
    for (int i = 0; i < n; i++) {
        float v = uncond ? uncond[i] + p->cfg * (cond[i] - uncond[i]) : cond[i];
        lg[i] = isnan(v) ? -INFINITY : v == INFINITY ? FLT_MAX : v;
        ord[i] = i;
    }
    ref_lg = lg;
    qsort(ord, (size_t)n, sizeof *ord, ref_cmp);
    int result;
    float mx = lg[ord[0]];
    if (mx == -INFINITY) {
        result = 0;
    } else if (p->top_k == 1 || !(p->temperature > 0) || !isfinite(p->temperature)) {
        result = ord[0];
    } else {
        int m = (p->top_k > 1 && p->top_k < n) ? p->top_k : n;
        double total = 0;
        for (int j = 0; j < m; j++)
            total += expf((lg[ord[j]] - mx) / p->temperature);
        int kept = m;
        double mass = total;
        if (p->top_p < 1.0f) {
            double cum = 0;
            kept = 0;
            do
                cum += expf((lg[ord[kept++]] - mx) / p->temperature);
            while (cum < (double)p->top_p * total && kept < m);
            mass = cum;
        }
        double target = rng_uniform(seed, stream, step) * mass, cum = 0;
        result = ord[0];
        for (int j = 0; j < kept; j++) {
            float q = expf((lg[ord[j]] - mx) / p->temperature);
            if (q > 0) {
                cum += q;
                result = ord[j];
                if (cum > target)
                    break;
            }
        }
    }
    free(lg);
    free(ord);
    return result;
}

static void test_matches_full_sort_reference(void) {
    int mismatches = 0, cases = 0;
    for (int trial = 0; trial < 400; trial++) {
        int n = 1 + (int)(test_rand_u64() % (trial < 300 ? 300 : 5000));
        float *cond = malloc((size_t)n * sizeof *cond),
              *uncond = malloc((size_t)n * sizeof *uncond);
        int style = trial % 5;
        for (int i = 0; i < n; i++) {
            cond[i] = test_rand_float(-4, 4);
            uncond[i] = test_rand_float(-4, 4);
            if (style == 1)
                cond[i] = (float)(int)cond[i]; /* many ties */
            if (style == 2)
                cond[i] = (float)i * 0.01f; /* ascending */
            if (style == 3)
                cond[i] = -(float)i * 0.01f; /* descending */
            if (style == 4 && test_rand_u64() % 7 == 0)
                cond[i] = NAN;
        }
        sampler_t s;
        CHECK(sampler_init(&s, n, NULL) == AR_OK);
        for (int rep = 0; rep < 6; rep++) {
            sampler_params_t p;
            p.cfg = (rep % 2) ? 3.0f : 1.0f;
            const float temps[] = {1.0f, 0.7f, 2.5f, 0.0f, 1.0f, 0.05f};
            const int ks[] = {0, 2, 5, 1, 40, 1000};
            const float tps[] = {1.0f, 0.9f, 0.5f, 1.0f, 0.99f, 0.2f};
            p.temperature = temps[rep];
            p.top_k = ks[(rep + trial) % 6];
            p.top_p = tps[(rep * 5 + trial) % 6];
            const float *un = (rep % 2) ? uncond : NULL;
            for (uint64_t seed = 0; seed < 5; seed++) {
                uint64_t sd = seed * 1000003u + (uint64_t)trial;
                int got = sampler_next(&s, cond, un, &p, sd, 2, (uint64_t)rep);
                int want = reference_next(cond, un, n, &p, sd, 2, (uint64_t)rep);
                if (got != want && mismatches++ < 5)
                    fprintf(stderr, "  n=%d style=%d k=%d top_p=%g T=%g: got %d want %d\n", n,
                            style, p.top_k, p.top_p, p.temperature, got, want);
                cases++;
            }
        }
        sampler_free(&s);
        free(cond);
        free(uncond);
    }
    CHECK_MSG(mismatches == 0, "%d of %d draws differ from the reference", mismatches, cases);
}

/* One dominant token and 1024 tokens each just under the sampler's head cut
 * (weight < total / (1024 m)), so the tail holds about 0.9/1024 of the mass.
 * Draws with u beyond the head's mass, and a top-p above it, must rank the
 * tail and still agree with the full-sort reference. */
static void test_tail_reached(void) {
    enum { V = 1025 };
    sampler_t s;
    CHECK(sampler_init(&s, V, NULL) == AR_OK);
    float lg[V];
    for (int i = 0; i < V; i++)
        lg[i] = logf(0.9f / (1024.0f * 1024.0f)) + 0.01f * (float)(i % 7);
    lg[600] = 0.0f;
    /* Keep every tail weight under the cut even with the +0.06 spread. */
    for (int i = 0; i < V; i++)
        if (i != 600)
            lg[i] -= 0.07f;
    sampler_params_t p = params(1.0f, 0, 1.0f);
    int reached = 0, mismatches = 0;
    for (uint64_t seed = 0; seed < 40000; seed++) {
        if (rng_uniform(seed, 0, 0) < 0.999)
            continue;
        int got = sampler_next(&s, lg, NULL, &p, seed, 0, 0);
        mismatches += got != reference_next(lg, NULL, V, &p, seed, 0, 0);
        reached += got != 600;
    }
    CHECK_MSG(reached >= 5, "only %d draws reached the tail", reached);
    CHECK(mismatches == 0);
    /* top_p above the head's mass: the nucleus extends into the tail. */
    p.top_p = 0.99995f;
    for (uint64_t seed = 0; seed < 2000; seed++)
        mismatches += sampler_next(&s, lg, NULL, &p, seed, 3, 0) !=
                      reference_next(lg, NULL, V, &p, seed, 3, 0);
    CHECK(mismatches == 0);
    sampler_free(&s);
}

int main(void) {
    TEST_RUN(test_init_rejects_bad_vocab);
    TEST_RUN(test_cfg_combine_exact);
    TEST_RUN(test_next_uses_cfg);
    TEST_RUN(test_greedy_and_ties);
    TEST_RUN(test_seeded_determinism);
    TEST_RUN(test_top_k_support);
    TEST_RUN(test_top_p_support);
    TEST_RUN(test_frequencies_match);
    TEST_RUN(test_nan_and_inf);
    TEST_RUN(test_matches_full_sort_reference);
    TEST_RUN(test_tail_reached);
    return TEST_SUMMARY();
}
