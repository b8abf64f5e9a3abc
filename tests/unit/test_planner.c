/* The KV planner: full-cache bytes by hand, and admission that is exact
 * against trajectories: it admits what fits at every future iteration and
 * refuses what would overflow at any one of them. */
#include <stdlib.h>
#include <string.h>

#include "engine/cost_model.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "tests/test.h"

static void test_full_cache_bytes_by_hand(void) {
    model_config_t c = {0};
    c.llm.num_layers = 2;
    c.llm.num_kv_heads = 4;
    c.llm.head_dim = 16;
    c.image.grid_height = 8;
    c.image.grid_width = 8;
    /* (prompt 10 + 64 image tokens - 1 fed back) x 2 layers x 4 heads x 16
     * x (K and V) x 4 bytes x 2 sequences (CFG) */
    CHECK(planner_full_cache_bytes(&c, 10) == (size_t)73 * 2 * 4 * 16 * 2 * 4 * 2);
}

/* The pool's block size keeps a head's last partial block under 5% of what
 * it holds at budget 1/8: 2 tokens for a 16 x 16 grid (32 tokens at 1/8),
 * 4 for Janus-Pro's 24 x 24 (72), 1 for the tiny model's 8 x 8 (8). */
static void test_block_tokens_per_model(void) {
    model_config_t c = {0};
    static const int grids[][2] = {{16, 2}, {24, 4}, {8, 1}, {32, 4}, {64, 16}};
    for (int i = 0; i < 5; i++) {
        c.image.grid_height = c.image.grid_width = grids[i][0];
        CHECK_MSG(planner_block_tokens(&c) == grids[i][1], "%dx%d grid: %d", grids[i][0],
                  grids[i][0], planner_block_tokens(&c));
    }
}

static void test_admits_exactly_what_fits(void) {
    planner_t p;
    planner_init(&p, 100);
    size_t a[4] = {10, 20, 30, 40};
    CHECK(planner_fits(&p, a, 4));
    CHECK(planner_add(&p, 1, a, 4) == AR_OK);
    CHECK(planner_reserved_now(&p) == 10);
    /* b peaks when a does: 40 + 60 = 100 fits, 61 does not. */
    size_t b[4] = {60, 60, 60, 60}, c[4] = {61, 1, 1, 1};
    CHECK(planner_fits(&p, b, 4));
    size_t b2[4] = {1, 1, 1, 61};
    CHECK(!planner_fits(&p, b2, 4));
    CHECK(planner_fits(&p, c, 4)); /* 61 + 10 at iteration 0 */
    /* Past the running trajectories, a new one meets the pool alone. */
    size_t d[6] = {1, 1, 1, 1, 100, 100}, e[6] = {1, 1, 1, 1, 100, 101};
    CHECK(planner_fits(&p, d, 6));
    CHECK(!planner_fits(&p, e, 6));
    planner_free(&p);
}

static void test_tick_and_remove_release(void) {
    planner_t p;
    planner_init(&p, 50);
    size_t a[3] = {50, 50, 50}, b[1] = {1};
    CHECK(planner_add(&p, 7, a, 3) == AR_OK);
    CHECK(!planner_fits(&p, b, 1));
    planner_tick(&p);
    planner_tick(&p);
    CHECK(!planner_fits(&p, b, 1));
    planner_tick(&p); /* a is done */
    CHECK(p.n == 0 && planner_fits(&p, b, 1));
    CHECK(planner_add(&p, 8, a, 3) == AR_OK);
    planner_remove(&p, 8);
    CHECK(p.n == 0 && planner_reserved_now(&p) == 0);
    planner_free(&p);
}

/* A request that starts an iteration later meets the running ones one
 * iteration on, and reserves nothing until then. */
static void test_delayed_start(void) {
    planner_t p;
    planner_init(&p, 100);
    size_t a[3] = {10, 50, 90}, b[2] = {51, 10};
    CHECK(planner_add(&p, 1, a, 3) == AR_OK);
    /* Now: 10 + 51, 50 + 10. An iteration later: 50 + 51 > 100. */
    CHECK(planner_fits(&p, b, 2) && !planner_fits_after(&p, b, 2, 1));
    size_t c[2] = {50, 1};
    CHECK(planner_fits_after(&p, c, 2, 1) && planner_add_after(&p, 2, c, 2, 1) == AR_OK);
    CHECK(planner_reserved_now(&p) == 10);
    planner_tick(&p);
    CHECK(planner_reserved_now(&p) == 100);
    planner_tick(&p);
    CHECK(planner_reserved_now(&p) == 91);
    planner_tick(&p);
    CHECK(p.n == 0);
    planner_free(&p);
}

/* Random traces: whatever the planner admits never overflows the pool at
 * any iteration, and whatever it refuses would have. */
static void test_random_traces_never_overflow(void) {
    unsigned seed = 12345;
    for (int trial = 0; trial < 200; trial++) {
        planner_t p;
        size_t pool = 1000;
        planner_init(&p, pool);
        enum { T = 64 };
        size_t load[T + 32] = {0}; /* bytes held per absolute iteration */
        for (int now = 0; now < T; now++) {
            int n = (seed = seed * 1103515245u + 12345u) >> 16 & 7;
            size_t traj[32];
            for (int i = 0; i < n; i++) {
                seed = seed * 1103515245u + 12345u;
                traj[i] = (seed >> 8) % 400;
            }
            if (n) {
                int fits = planner_fits(&p, traj, n);
                int really = 1;
                for (int i = 0; i < n; i++)
                    really &= load[now + i] + traj[i] <= pool;
                CHECK(fits == really);
                if (fits) {
                    planner_add(&p, (uint64_t)now, traj, n);
                    for (int i = 0; i < n; i++)
                        load[now + i] += traj[i];
                }
            }
            CHECK(planner_reserved_now(&p) == load[now]);
            CHECK(load[now] <= pool);
            planner_tick(&p);
        }
        planner_free(&p);
    }
}

/* A budget range is planned at the budgets its policy tells apart: the top
 * first, each level's plan different from the one above and never larger
 * at its peak, and the floor's plan that of the range's least budget. */
/* 2 layers of 2 heads of 8, an 8 x 8 grid. */
static model_config_t small_raster(void) {
    model_config_t c = {0};
    c.llm.num_layers = 2;
    c.llm.num_kv_heads = 2;
    c.llm.head_dim = 8;
    c.image.grid_height = c.image.grid_width = 8;
    return c;
}

/* A plan marks the steps during which its policy collects key mass (what
 * costs a step more, engine/cost_model.h): LineAR's guide queues, the lines
 * whose ends compress, the same steps its state collects at; none for the
 * full cache or StreamingLLM (which evicts by position). */
static void test_plan_marks_the_scored_steps(void) {
    model_config_t c = small_raster();
    ar_error_t err = {{0}};
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 0.5;
    planner_plan_t pl;
    CHECK_MSG(planner_plan(&pl, &c, &p, 4, 1, NULL, &err) == AR_OK, "%s", err.msg);
    kv_geometry_t g;
    model_geometry(&c, 4, &g);
    kv_policy_state_t *st = kv_policy_begin(&p, &g, &err);
    CHECK(st != NULL);
    int scored = 0, agree = 1;
    for (int t = 0; t < pl.steps; t++) {
        scored += pl.scored[t];
        agree &= pl.scored[t] == (kv_policy_collect(st, t) != 0);
        /* A step's cost features: its pairs are scored pairs too where scored. */
        cost_features_t f = {0};
        cost_features_add(&f, &g, &pl, t, 3);
        agree &= f.kv_attended > 0 && f.kv_scored == (pl.scored[t] ? f.kv_attended : 0);
    }
    /* Lines 4..7 end within the image (the last compresses before the last
     * step): their queries, steps 3*8+1 .. 7*8, are the guide queues. */
    CHECK_MSG(agree && scored == 7 * 8 - 3 * 8, "%d steps scored", scored);
    kv_policy_end(st);
    planner_plan_free(&pl);
    static const kv_policy_kind_t none[] = {KV_POLICY_FULL, KV_POLICY_STREAMING};
    for (int k = 0; k < 2; k++) {
        kv_policy_defaults(&p, none[k]);
        CHECK(planner_plan(&pl, &c, &p, 4, 1, NULL, &err) == AR_OK);
        scored = 0;
        for (int t = 0; t < pl.steps; t++)
            scored += pl.scored[t];
        CHECK_MSG(scored == 0, "%s: %d steps scored", kv_policy_name(none[k]), scored);
        planner_plan_free(&pl);
    }
}

static void test_levels_of_a_budget_range(void) {
    model_config_t c = small_raster();
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    planner_levels_t lv;
    ar_error_t err = {{0}};
    CHECK_MSG(planner_plan_levels(&lv, &c, &p, 0.5, 1, 4, 0, 1, planner_kv_f32, NULL, &err) ==
                  AR_OK,
              "%s", err.msg);
    CHECK(lv.n >= 2 && lv.n <= PLANNER_MAX_LEVELS && lv.budgets[0] == 1);
    for (int l = 1; l < lv.n; l++) {
        CHECK(lv.budgets[l] < lv.budgets[l - 1]);
        CHECK(lv.plans[l].peak_bytes <= lv.plans[l - 1].peak_bytes);
        CHECK(memcmp(lv.plans[l].bytes, lv.plans[l - 1].bytes,
                     (size_t)lv.plans[l].steps * sizeof(size_t)) != 0);
    }
    planner_levels_free(&lv);
    /* The floor's plan is the least budget's, on LineAR's 8 x 8 grid (few
     * levels) and on a token-granular policy with more levels than are kept
     * (StreamingLLM over [1/6, 1] on 24 x 24), where only a sampling that
     * keeps both ends still ends at the floor. */
    static const struct {
        kv_policy_kind_t kind;
        int grid;
        double lo;
    } floors[] = {{KV_POLICY_LINEAR, 8, 0.5}, {KV_POLICY_STREAMING, 24, 1.0 / 6}};
    for (size_t f = 0; f < sizeof floors / sizeof floors[0]; f++) {
        c.image.grid_height = c.image.grid_width = floors[f].grid;
        kv_policy_defaults(&p, floors[f].kind);
        CHECK_MSG(planner_plan_levels(&lv, &c, &p, floors[f].lo, 1, 4, 0, 1, planner_kv_f32, NULL,
                                      &err) == AR_OK,
                  "%s", err.msg);
        kv_policy_params_t at_lo = p;
        at_lo.budget = floors[f].lo;
        planner_plan_t floor_plan;
        CHECK(planner_plan(&floor_plan, &c, &at_lo, 4, 1, NULL, &err) == AR_OK);
        CHECK_MSG(lv.n > 0 && floor_plan.peak_bytes == lv.plans[lv.n - 1].peak_bytes &&
                      memcmp(floor_plan.bytes, lv.plans[lv.n - 1].bytes,
                             (size_t)floor_plan.steps * sizeof(size_t)) == 0,
                  "%s on %dx%d: the lowest level is budget %g, peak %zu B; the floor's plan %zu B",
                  kv_policy_name(floors[f].kind), floors[f].grid, floors[f].grid,
                  lv.n ? lv.budgets[lv.n - 1] : 0, lv.n ? lv.plans[lv.n - 1].peak_bytes : 0,
                  floor_plan.peak_bytes);
        planner_plan_free(&floor_plan);
        planner_levels_free(&lv);
    }
    c.image.grid_height = c.image.grid_width = 8;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    /* One budget: one level. */
    CHECK(planner_plan_levels(&lv, &c, &p, 0.75, 0.75, 4, 0, 1, planner_kv_f32, NULL, &err) ==
              AR_OK &&
          lv.n == 1 && lv.budgets[0] == 0.75);
    planner_levels_free(&lv);
    /* A floor too small for the policy's knobs fails, naming the budget. */
    const char *field = NULL;
    CHECK(planner_plan_levels(&lv, &c, &p, 0.01, 1, 4, 0, 1, planner_kv_f32, &field, &err) ==
              AR_ERR &&
          field && strcmp(field, "budget") == 0);
    CHECK(planner_plan_levels(&lv, &c, &p, 0.8, 0.5, 4, 0, 1, planner_kv_f32, NULL, &err) ==
          AR_ERR);
}

int main(void) {
    TEST_RUN(test_full_cache_bytes_by_hand);
    TEST_RUN(test_block_tokens_per_model);
    TEST_RUN(test_admits_exactly_what_fits);
    TEST_RUN(test_plan_marks_the_scored_steps);
    TEST_RUN(test_levels_of_a_budget_range);
    TEST_RUN(test_tick_and_remove_release);
    TEST_RUN(test_delayed_start);
    TEST_RUN(test_random_traces_never_overflow);
    return TEST_SUMMARY();
}
