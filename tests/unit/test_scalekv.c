/* ScaleKV: drafters are the least selective (layer, scale) pairs by ASI
 * Z-score; every compacted scale's budgets add up to budget x layers, the
 * drafters' above the refiners', as in the public code's budget files
 * (Infinity-2B's reproduced); a compaction keeps the observation window
 * and the keys its queries scored highest; the engine's pool use equals
 * the plan. tests/unit/test_golden_infinity.c holds the kept tokens
 * against the public code's. */
#include "../test.h"
#include "engine/backend/backend.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/policy/kv_calibration.h"
#include "engine/policy/kv_policy.h"
#include "tests/unit/kv_plan_run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static backend_t *be;

/* VAR-d16's pyramid, 6 layers of 2 heads, and a calibration whose ASI is
 * the layer's number (layer 0 least selective) except at scale 8, where
 * layer 5 is the least. */
static void setup(kv_geometry_t *g, kv_calibration_t *c) {
    static const int sides[] = {1, 2, 3, 4, 5, 6, 8, 10, 13, 16};
    memset(g, 0, sizeof *g);
    g->step_unit = KV_STEP_SEGMENT;
    g->n_segments = 10;
    for (int i = 0; i < 10; i++)
        g->segment_tokens[i] = sides[i] * sides[i];
    g->n_layers = 6;
    g->n_heads = 2;
    ar_error_t err = {{0}};
    CHECK(kv_calibration_synthetic(c, g, 3, &err) == AR_OK);
    const int T = 12, K = 10;
    for (int h = 0; h < T; h++)
        for (int q = 0; q < K; q++) {
            const int l = h / 2;
            c->beta[((size_t)h * K + q) * K + q] = 0.1f + 0.1f * (float)(q == 8 ? 5 - l : l);
            c->htr[(size_t)h * K + q] = 0.5f;
        }
    g->calibration = c;
}

static void test_drafters_and_budgets(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    setup(&g, &c);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    CHECK(p.budget == 0.1 && p.scalekv_drafters == 0.0625);
    p.budget = 0.25; /* B = floor(0.25 x 424) = 106: compacted from step 6 (155 > 106) */
    p.scalekv_drafters = 3.0 / 18; /* 3 of the 18 compacted (layer, scale) pairs */
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
    CHECK_MSG(s != NULL, "%s", err.msg);
    char words[1024];
    kv_policy_describe(&p, &g, words, sizeof words);
    CHECK_STR_CONTAINS(words, "B = 106 tokens per head");
    CHECK_STR_CONTAINS(words, "3 drafter layer-scales");
    /* Drafters (6, 0), (7, 0), (8, 5): the most of what the previous
     * drafters kept and the new scale (155, then 151 + 100, then 251 + 169)
     * that leaves the 5 refiners a whole share of 6 x 106. */
    CHECK_STR_CONTAINS(words, "151/97 251/77 416/44");
    /* Drive it: every head holds what the engine would, and after every
     * compaction the layers hold at most B x L in all, exactly that where
     * the drafters held their budget. */
    int len[6] = {0}, keep[1024], compacted_at[10] = {0}, over = 0, window_lost = 0;
    const int B = 106, L = 6;
    for (int t = 0; t < 9; t++) {
        int total = 0, most = 0, least = 1 << 30;
        for (int l = 0; l < L; l++) {
            int n_keep, cache;
            kv_policy_layer_end(s, t, l, 0, len[l], keep, &n_keep, &cache);
            CHECK(cache);
            len[l] += g.segment_tokens[t];
            if (kv_policy_layer_stored(s, t, l, 0, len[l], NULL, keep, &n_keep) & KV_COMPACT) {
                compacted_at[t]++;
                /* No mass: the window and then the newest are kept. */
                window_lost += keep[n_keep - 1] != len[l] - 1;
                len[l] = n_keep;
            }
            total += len[l];
            most = len[l] > most ? len[l] : most;
            least = len[l] < least ? len[l] : least;
        }
        if (t >= 6) {
            over += total > B * L;
            /* Drafters keep more. */
            CHECK_MSG(most > least && (t == 8 || total == B * L), "step %d: %d..%d, total %d", t,
                      least, most, total);
        }
    }
    /* Every refiner compacts; the first drafter cuts 155 to 151, then holds
     * its 251; layer 5, a refiner before, holds 77 + 169 under its 416. */
    CHECK(compacted_at[5] == 0 && compacted_at[6] == L && compacted_at[7] == L - 1 &&
          compacted_at[8] == L - 1);
    CHECK(over == 0 && window_lost == 0);
    CHECK(len[5] > len[4] && len[0] < len[5]); /* layer 5 drafts at scale 8 */
    kv_policy_end(s);
    /* The trajectory is exact: the most a head holds is a drafter's step. */
    int traj[16];
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, &err) == AR_OK);
    CHECK_MSG(traj[6] == 155 && traj[7] == 251, "%d %d", traj[6], traj[7]);
    kv_calibration_free(&c);
}

/* A compacted scale with no drafter gives every layer B, and the next
 * scale's drafters start again from B, not from all they could have held:
 * scale 6's layers are alike (no drafter), layer 0 drafts at 7 and 8. By
 * the rule above, B = 106 over 6 layers: scale 7's drafter 106 + 100 = 206
 * leaves the refiners (636 - 206) / 5 = 86; at scale 8, 206 + 169 = 375
 * less what makes the rest divide by 5: 371, and 53 each. */
static void test_a_scale_without_drafters_resets_the_limit(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    setup(&g, &c);
    const int T = 12, K = 10;
    for (int h = 0; h < T; h++)
        for (int q = 6; q < 9; q++)
            c.beta[((size_t)h * K + q) * K + q] = q == 6 || h / 2 != 0 ? 0.5f : 0.1f;
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    p.budget = 0.25;
    p.scalekv_drafters = 2.0 / 18;
    char words[1024];
    kv_policy_describe(&p, &g, words, sizeof words);
    CHECK_STR_CONTAINS(words, "B = 106 tokens per head");
    CHECK_STR_CONTAINS(words, "drafters (step:layer): 7:0 8:0");
    CHECK_STR_CONTAINS(words, ": 106/106 206/86 371/53");
    kv_calibration_free(&c);
}

/* The public code's budget file for Infinity-2B at 10% (StargazerX0/
 * ScaleKV, budgets/2b_10%_budget.json: 650 tokens a layer, blocks 0 and 23
 * drafters at scales 7 to 10, block 0 at scale 11), from its drafters: the
 * same budgets, scale by scale. */
static void test_infinity_2b_budget_file(void) {
    static const int sides[] = {1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64};
    kv_geometry_t g = {
        .step_unit = KV_STEP_SEGMENT, .n_segments = 13, .n_layers = 32, .n_heads = 1};
    for (int i = 0; i < 13; i++)
        g.segment_tokens[i] = sides[i] * sides[i];
    kv_calibration_t c;
    ar_error_t err = {{0}};
    CHECK(kv_calibration_synthetic(&c, &g, 3, &err) == AR_OK);
    for (int l = 0; l < 32; l++)
        for (int q = 0; q < 13; q++) {
            const int drafter = l == 0 || (l == 23 && q >= 7 && q <= 10);
            c.beta[((size_t)l * 13 + q) * 13 + q] = drafter ? 0.1f : 1.0f;
            c.htr[(size_t)l * 13 + q] = 0.5f;
        }
    g.calibration = &c;
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    p.budget = 650.5 / 6425; /* their 650 of 6425 tokens */
    p.scalekv_drafters = 9.0 / 160;
    char words[1024];
    kv_policy_describe(&p, &g, words, sizeof words);
    CHECK_STR_CONTAINS(words, "B = 650 tokens per head");
    CHECK_STR_CONTAINS(words, "9 drafter layer-scales of the compacted ones (from step 7)");
    CHECK_STR_CONTAINS(words, ": 920/632 1490/594 2510/526 4100/420 6385/465; drafters "
                              "(step:layer): 7:0 7:23 8:0 8:23 9:0 9:23 10:0 10:23 11:0");
    kv_calibration_free(&c);
}

static void test_window_and_top_mass_kept(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    setup(&g, &c);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    p.budget = 0.25;
    p.scalekv_drafters = 0;
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
    /* Step 7: 155 history + 100 (a 10 x 10 scale) = 255 keys; budget 106. */
    const int len = 255, first = 155;
    float mass[255];
    for (int j = 0; j < len; j++)
        mass[j] = 0.001f * (float)(j % 7);
    mass[20] = 5; /* a history key the scale attended most: kept, and its neighbours */
    int keep[255], n_keep, cache;
    for (int t = 0; t < 7; t++)
        for (int l = 0; l < 6; l++)
            kv_policy_layer_end(s, t, l, 0, 0, keep, &n_keep, &cache);
    CHECK(kv_policy_layer_stored(s, 7, 0, 0, len, mass, keep, &n_keep) == KV_COMPACT);
    CHECK(n_keep == 106);
    int has[255] = {0};
    for (int i = 0; i < n_keep; i++) {
        CHECK(i == 0 || keep[i] > keep[i - 1]);
        has[keep[i]] = 1;
    }
    /* The window: cells of 2 x 2 on the 10 x 10 grid, centres (0, 0), (0, 2), ... */
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            CHECK_MSG(has[first + (i * 2) * 10 + j * 2], "window cell %d,%d", i, j);
    for (int d = -2; d <= 2; d++)
        CHECK_MSG(has[20 + d], "pooled neighbour %d of the hot key", d);
    kv_policy_end(s);
    kv_calibration_free(&c);
}

/* The window's own mass does not lift its neighbours: ScaleKV's code masks
 * the window before max-pooling. A window key (the scale's first token) with
 * the most mass of all, and the older a history token the more mass: the
 * window's neighbours (the newest history tokens, the scale's second) rank
 * by their own neighbourhoods, below the oldest history, and are dropped. */
static void test_window_mass_does_not_lift_its_neighbours(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    setup(&g, &c);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    p.budget = 0.25;
    p.scalekv_drafters = 0;
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
    const int len = 255, first = 155; /* step 7, as above; budget 106 */
    float mass[255] = {0};
    for (int j = 0; j < first; j++)
        mass[j] = 0.001f * (float)(first - j);
    mass[first] = 5;
    int keep[255], n_keep, cache;
    for (int t = 0; t < 7; t++)
        for (int l = 0; l < 6; l++)
            kv_policy_layer_end(s, t, l, 0, 0, keep, &n_keep, &cache);
    CHECK(kv_policy_layer_stored(s, 7, 0, 0, len, mass, keep, &n_keep) == KV_COMPACT);
    int has[255] = {0};
    for (int i = 0; i < n_keep; i++)
        has[keep[i]] = 1;
    CHECK(has[first] && has[0] && has[89]);
    for (int j = first - 2; j <= first + 1; j++)
        CHECK_MSG(j == first || !has[j], "token %d kept for the window's mass", j);
    kv_policy_end(s);
    kv_calibration_free(&c);
}

static void test_refusals(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    setup(&g, &c);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_SCALEKV);
    const char *field = NULL;
    ar_error_t err = {{0}};
    p.budget = 0.002; /* no token of 424 */
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR && field && !strcmp(field, "budget"));
    CHECK_STR_CONTAINS(err.msg, "holds none of the 424 tokens");
    p.budget = 0.1;
    free(c.htr);
    c.htr = NULL; /* a calibration written before ScaleKV's statistics */
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, KV_CALIBRATION_FILE);
    CHECK_STR_CONTAINS(err.msg, "arserve calibrate");
    kv_calibration_free(&c);
}

/* On the demo model with its shipped calibration, in a pool exactly the
 * plan: the pool holds the plan's bytes in every step. */
static void test_measured_kv_equals_the_plan(void) {
    model_t m;
    ar_error_t err = {{0}};
    if (model_load(&m, "models/shapes-var", be, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    static const double budgets[] = {0.2, 0.3, 0.5};
    for (int i = 0; i < 3; i++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, KV_POLICY_SCALEKV);
        p.budget = budgets[i];
        p.scalekv_drafters = 0.25;
        kv_plan_run_t run;
        if (kv_plan_run(&m, &p, 2 + i, 7, 1, &run, &err) != AR_OK) {
            CHECK_MSG(0, "budget %g: %s", budgets[i], err.msg);
            continue;
        }
        CHECK_MSG(run.steps == 7 && run.equal == run.steps, "budget %g: %d of %d steps equal",
                  budgets[i], run.equal, run.steps);
        CHECK(run.request_peak == run.planned_peak && !run.leaked);
    }
    model_free(&m);
}

int main(void) {
    ar_error_t err;
    if (!(be = backend_open("cpu", 2, &err))) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_drafters_and_budgets);
    TEST_RUN(test_a_scale_without_drafters_resets_the_limit);
    TEST_RUN(test_infinity_2b_budget_file);
    TEST_RUN(test_window_and_top_mass_kept);
    TEST_RUN(test_window_mass_does_not_lift_its_neighbours);
    TEST_RUN(test_refusals);
    TEST_RUN(test_measured_kv_equals_the_plan);
    be->destroy(be);
    return TEST_SUMMARY();
}
