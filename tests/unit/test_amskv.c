/* AMS-KV: the condensed scales stay, the rest rolls (CLRU), a layer
 * expands once from C_min to C_max when its key similarity is below the
 * threshold; the similarity on constructed keys; the planner's worst case
 * (every layer expanded) is never exceeded on the demo model, and is met
 * exactly when every layer expands. */
#include "../test.h"
#include "engine/backend/backend.h"
#include "engine/family/var.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/policy/kv_policy.h"
#include "tests/unit/kv_plan_run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static backend_t *be;

/* VAR-d16's pyramid (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), two layers of two
 * heads: condensed 1 + 4 = 5 tokens, C_min = 5 + 169, C_max = 5 + 169 + 256. */
static void var_d16(kv_geometry_t *g) {
    static const int sides[] = {1, 2, 3, 4, 5, 6, 8, 10, 13, 16};
    memset(g, 0, sizeof *g);
    g->step_unit = KV_STEP_SEGMENT;
    g->n_segments = 10;
    for (int i = 0; i < 10; i++)
        g->segment_tokens[i] = sides[i] * sides[i];
    g->n_layers = 2;
    g->n_heads = 2;
}

/* One request driven through the policy as the engine does, layer 0 seeing
 * similarity sim[0] and layer 1 sim[1] whenever asked. Records, per step
 * and layer, whether it asked, the keep list's length (-1: no compaction)
 * and whether the scale was cached; len[] are the heads' lengths. */
typedef struct drive {
    int asked[KV_MAX_SEGMENTS][2], kept[KV_MAX_SEGMENTS][2], cached[KV_MAX_SEGMENTS][2];
    int len[2], keep[1024];
} drive_t;

static void drive(kv_policy_state_t *s, const kv_geometry_t *g, const double sim[2], drive_t *d) {
    memset(d, 0, sizeof *d);
    for (int t = 0; t < g->n_segments; t++)
        for (int l = 0; l < 2; l++) {
            d->asked[t][l] = kv_policy_layer_similarity(s, t, l);
            int n_keep, cache;
            d->kept[t][l] = -1;
            for (int h = 0; h < 2; h++) {
                const int what = kv_policy_layer_begin(
                    s, t, l, h, d->len[l], d->asked[t][l] ? sim[l] : NAN, d->keep, &n_keep);
                if (what & KV_COMPACT) {
                    d->kept[t][l] = n_keep;
                    if (h == 0) { /* the condensed tokens, then the newest */
                        for (int i = 0; i < 5 && i < n_keep; i++)
                            CHECK(d->keep[i] == i);
                        CHECK(n_keep == 5 || d->keep[n_keep - 1] == d->len[l] - 1);
                        for (int i = 6; i < n_keep; i++)
                            CHECK(d->keep[i] == d->keep[i - 1] + 1);
                    }
                }
                kv_policy_layer_end(s, t, l, h, d->len[l], d->keep, &n_keep, &cache);
                d->cached[t][l] = cache;
            }
            if (d->kept[t][l] >= 0)
                d->len[l] = d->kept[t][l];
            if (d->cached[t][l] && t < g->n_segments - 1)
                d->len[l] += g->segment_tokens[t];
        }
}

static void test_condensed_kept_local_rolled_and_one_expansion(void) {
    kv_geometry_t g;
    var_d16(&g);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_AMSKV);
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
    CHECK_MSG(s != NULL, "%s", err.msg);
    if (!s)
        return;
    /* Layer 0 moves far (-1 < -0.008): cache-demanding; layer 1 stays close. */
    drive_t d;
    drive(s, &g, (const double[2]){-1.0, -0.001}, &d);
    kv_policy_end(s);
    /* 1 + 4 + ... + 64 = 155 fit in C_min = 174; scale 7 (100) does not. */
    for (int t = 0; t < 7; t++)
        CHECK(!d.asked[t][0] && !d.asked[t][1] && d.kept[t][0] < 0 && d.kept[t][1] < 0);
    CHECK(d.asked[7][0] && d.asked[7][1]);
    /* Layer 0 expanded to 430 at step 7: 255, then 424, fit; never asked again. */
    CHECK(d.kept[7][0] < 0 && d.kept[8][0] < 0 && !d.asked[8][0] && !d.asked[9][0]);
    /* At the last scale (256), it rolls to the condensed + 430 - 5 - 256 = 169. */
    CHECK(d.kept[9][0] == 5 + 169);
    /* Layer 1 stays at 174: at step 7, 5 condensed + 174 - 5 - 100 = 69 newest. */
    CHECK(d.kept[7][1] == 5 + 69 && d.cached[7][1]);
    CHECK(d.asked[8][1] && d.kept[8][1] == 5 + 0 && d.cached[8][1]);
    /* The last scale (256) is larger than C_min - 5: attended, not cached. */
    CHECK(d.asked[9][1] && d.kept[9][1] < 0 && !d.cached[9][1]);
    CHECK(d.len[1] == 174 && d.len[0] == 174);

    /* Similarity not measured (NaN) counts as cache-demanding; at the
     * threshold exactly, a layer stays. */
    s = kv_policy_begin(&p, &g, &err);
    drive(s, &g, (const double[2]){NAN, p.amskv_threshold}, &d);
    kv_policy_end(s);
    CHECK(d.kept[7][0] < 0 && d.kept[9][0] == 174);
    CHECK(d.kept[7][1] == 74);
}

/* The plan is every layer expanding at its first chance; no mix of
 * similarities holds more, and the plan is what an all-expanding run holds. */
static void test_plan_is_the_most_any_run_holds(void) {
    kv_geometry_t g;
    var_d16(&g);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_AMSKV);
    ar_error_t err = {{0}};
    int tokens[KV_MAX_SEGMENTS];
    CHECK_MSG(kv_policy_trajectory(&p, &g, tokens, NULL, &err) == AR_OK, "%s", err.msg);
    /* Worst case: nothing evicted until the last scale: the full cache. */
    int full[KV_MAX_SEGMENTS];
    kv_policy_params_t f;
    kv_policy_defaults(&f, KV_POLICY_FULL);
    CHECK(kv_policy_trajectory(&f, &g, full, NULL, &err) == AR_OK);
    for (int t = 0; t < 9; t++)
        CHECK_MSG(tokens[t] == full[t], "step %d: %d, full %d", t, tokens[t], full[t]);
    CHECK(tokens[9] == 174);
    /* Smaller C_max (condensed + the last scale): the plan rolls at step 8. */
    p.amskv_max_scales = 1;
    CHECK(kv_policy_trajectory(&p, &g, tokens, NULL, &err) == AR_OK);
    CHECK_MSG(tokens[8] == 5 + 256 - 169 + 169 && tokens[7] == 255, "%d %d", tokens[7], tokens[8]);
    static const double sims[] = {-1, -0.0081, -0.008, -0.0079, 0, NAN};
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 6; b++) {
            kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
            drive_t d;
            int most = 0;
            drive(s, &g, (const double[2]){sims[a], sims[b]}, &d);
            kv_policy_end(s);
            for (int l = 0; l < 2; l++)
                most = d.len[l] > most ? d.len[l] : most;
            CHECK(most <= tokens[8]);
        }
}

static void test_bad_knobs_name_the_knob(void) {
    kv_geometry_t g;
    var_d16(&g);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_AMSKV);
    const char *field = NULL;
    ar_error_t err = {{0}};
    p.amskv_max_scales = 0; /* C_max = 5 < C_min = 5 + 169 */
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR);
    CHECK(field && strcmp(field, "amskv_min_scales") == 0);
    CHECK_STR_CONTAINS(err.msg, "C_max");
    kv_policy_defaults(&p, KV_POLICY_AMSKV);
    p.amskv_condensed_scales = 9;
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR);
    CHECK(field && strcmp(field, "amskv_condensed_scales") == 0);
    p.amskv_condensed_scales = 2;
    p.amskv_threshold = 0.5;
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR);
    CHECK(field && strcmp(field, "amskv_threshold") == 0);
    p.amskv_threshold = -0.008;
    kv_geometry_uniform(&g, 3, KV_STEP_TOKEN, 4, 4, 2, 2);
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "next-scale");
}

/* ---- the similarity on constructed keys ---- */

enum { H = 2, D = 4, C = H * D, SP = 2, SC = 3, RP = SP * SP, RC = SC * SC };

/* A pool whose two heads hold `extra` unrelated rows, then the previous
 * scale's keys prev (RP rows of C), in blocks of bt tokens taken in
 * reverse order (so a head's blocks are neither contiguous nor ordered). */
static void fill(kv_pool_t *pool, kv_head_t heads[H], const float *prev, int extra, int bt) {
    ar_error_t err = {{0}};
    CHECK(kv_pool_init(pool, be, 64, bt, D, DTYPE_F32, &err) == AR_OK);
    const int len = extra + RP;
    float *k = calloc((size_t)len * C, sizeof *k), *v = calloc((size_t)len * C, sizeof *v);
    for (int i = 0; i < extra * C; i++)
        k[i] = 5.0f + (float)i;
    memcpy(k + (size_t)extra * C, prev, sizeof(float) * RP * C);
    /* Take every other free block so the ids interleave between heads. */
    kv_view_t views[H];
    for (int h = 0; h < H; h++) {
        memset(&heads[h], 0, sizeof heads[h]);
        CHECK(kv_head_reserve(pool, &heads[h], len, &err) == AR_OK);
        views[h] = kv_head_view(&heads[h], len);
    }
    const int q[2] = {0, len};
    be->kv_append(be, &pool->blocks, views, k, v, q, 1, H);
    for (int h = 0; h < H; h++)
        heads[h].len = len;
    free(k);
    free(v);
}

static double measure(kv_pool_t *pool, kv_head_t heads[H], const float *cur) {
    float *scratch[4];
    for (int i = 0; i < 4; i++)
        scratch[i] = be->alloc(be, sizeof(float) * C * RC);
    kv_view_t views[H];
    for (int h = 0; h < H; h++)
        views[h] = kv_head_view(&heads[h], heads[h].len);
    const double s = var_key_similarity(be, &pool->blocks, views, H, D, cur, SP, SC, scratch);
    for (int i = 0; i < 4; i++)
        be->free(be, scratch[i]);
    return s;
}

static void release(kv_pool_t *pool, kv_head_t heads[H]) {
    for (int h = 0; h < H; h++)
        kv_head_release(pool, &heads[h], NULL);
    kv_pool_free(pool);
}

static void test_similarity_on_constructed_keys(void) {
    float prev[RP * C], cur[RC * C];
    unsigned seed = 7;
    for (int bt = 1; bt <= 3; bt++) {
        /* Constant channels survive any resize: the current keys at +0.1
         * from them are at similarity -0.01 exactly. */
        for (int r = 0; r < RP; r++)
            for (int c = 0; c < C; c++)
                prev[r * C + c] = 0.25f * (float)c - 0.5f;
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < C; c++)
                cur[r * C + c] = 0.25f * (float)c - 0.5f + (c % 2 ? 0.1f : -0.1f);
        kv_pool_t pool;
        kv_head_t heads[H];
        fill(&pool, heads, prev, bt + 1, bt);
        double s = measure(&pool, heads, cur);
        CHECK_MSG(fabs(s + 0.01) < 1e-6, "bt %d: similarity %g, want -0.01", bt, s);
        release(&pool, heads);

        /* Random keys: the distance to the previous scale's keys resized
         * by the backend's own bicubic op, channel by channel. */
        for (int i = 0; i < RP * C; i++)
            prev[i] = (float)(rand_r(&seed) % 1000) / 500.0f - 1.0f;
        for (int i = 0; i < RC * C; i++)
            cur[i] = (float)(rand_r(&seed) % 1000) / 500.0f - 1.0f;
        float cm[C * RP], up[C * RC];
        for (int r = 0; r < RP; r++)
            for (int c = 0; c < C; c++)
                cm[c * RP + r] = prev[r * C + c];
        be->resize_bicubic(be, up, cm, C, SP, SP, SC, SC);
        double want = 0;
        for (int r = 0; r < RC; r++)
            for (int c = 0; c < C; c++) {
                const double dlt = (double)cur[r * C + c] - up[c * RC + r];
                want -= dlt * dlt / (C * RC);
            }
        fill(&pool, heads, prev, 2 * bt, bt);
        s = measure(&pool, heads, cur);
        CHECK_MSG(fabs(s - want) < 1e-5, "bt %d: similarity %g, want %g", bt, s, want);
        /* A head holding fewer rows than the previous scale: not measured. */
        heads[1].len = RP - 1;
        CHECK(isnan(measure(&pool, heads, cur)));
        heads[1].len = 2 * bt + RP;
        release(&pool, heads);
    }
}

/* ---- on the engine ---- */

/* A request on the demo model in a pool exactly its plan: with threshold
 * 0 every layer expands (real keys are never identical), and the pool
 * holds exactly the plan's bytes in every step; with the default and with
 * the lowest threshold it holds no more, and (lowest) strictly less. */
static void test_measured_kv_within_the_plan(void) {
    model_t m;
    ar_error_t err = {{0}};
    if (model_load(&m, "models/shapes-var", be, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    static const double thetas[] = {0, -0.008, -1e6};
    for (int i = 0; i < 3; i++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, KV_POLICY_AMSKV);
        p.amskv_threshold = thetas[i];
        kv_plan_run_t run;
        if (kv_plan_run(&m, &p, 3, 5, 1, &run, &err) != AR_OK) {
            CHECK_MSG(0, "theta %g: %s", thetas[i], err.msg);
            continue;
        }
        CHECK_MSG(run.over == 0, "theta %g: %d steps above the plan", thetas[i], run.over);
        if (thetas[i] == 0)
            CHECK_MSG(run.equal == run.steps, "theta 0: %d of %d steps equal", run.equal,
                      run.steps);
        if (thetas[i] < -1)
            CHECK_MSG(run.measured_peak < run.planned_peak, "nothing expanded, yet peak %zu = plan",
                      run.measured_peak);
        CHECK(!run.leaked);
        printf("  amskv theta %g: measured peak %zu B, plan %zu B (%.1f%%)\n", thetas[i],
               run.measured_peak, run.planned_peak,
               100.0 * (double)run.measured_peak / run.planned_peak);
    }
    model_free(&m);
}

int main(void) {
    ar_error_t err;
    if (!(be = backend_open("cpu", 2, &err))) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_condensed_kept_local_rolled_and_one_expansion);
    TEST_RUN(test_plan_is_the_most_any_run_holds);
    TEST_RUN(test_bad_knobs_name_the_knob);
    TEST_RUN(test_similarity_on_constructed_keys);
    TEST_RUN(test_measured_kv_within_the_plan);
    be->destroy(be);
    return TEST_SUMMARY();
}
