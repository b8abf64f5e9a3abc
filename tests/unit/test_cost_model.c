/* The cost table a daemon learns from its own iterations
 * (engine/cost_model.h): the seed answers until the first fit, a fit
 * recovers the coefficients that made the times, steps slowed by
 * something else are left out, the ring forgets a machine that changed
 * speed, memory stays bounded, and the per-image costs follow the images;
 * the default table is the conservative one its header states. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"
#include "engine/cost_model.h"
#include "engine/model_config.h"
#include "tests/test.h"

static const double TRUTH[COST_N_COEF] = {2e-3, 5e-5, 3e-9, 1e-6, 2e-9};

/* Iteration i's features: batches of 1 to 8 images, raster-like steps
 * (a token a sequence attending up to 600), some prefix steps, and in some
 * batches a part of the pairs scored (a policy collecting key mass). */
static cost_features_t features(int i) {
    const double seqs = 2.0 * (1 + i % 8), held = 40 + (i * 37) % 600, fed = i % 13 == 0 ? 30 : 1;
    const double scored_seqs = (i / 3) % 4 == 0 ? 0 : 2.0 * (1 + (i / 5) % (1 + i % 8));
    return (cost_features_t){.sequences = seqs,
                             .kv_attended = seqs * fed * held,
                             .new_tokens = seqs * fed,
                             .kv_scored = scored_seqs * fed * held};
}

static double truth(const double c[COST_N_COEF], const cost_features_t *f, double scale) {
    return scale * (c[0] + c[1] * f->sequences + c[2] * f->kv_attended + c[3] * f->new_tokens +
                    c[4] * f->kv_scored);
}

static cost_table_t seed(void) {
    cost_table_t t = {.family = "raster", .source = "a seed", .decode_s = 0.5, .png_s = 0.25};
    t.coef[0] = 1;
    return t;
}

static void test_seed_answers_until_the_first_fit_then_the_fit(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 256, 64) == AR_OK);
    int refits = 0;
    for (int i = 0; i < 63; i++) {
        const cost_features_t f = features(i);
        refits += cost_learner_add(&l, &f, truth(TRUTH, &f, 1));
    }
    CHECK(refits == 0 && l.table.coef[0] == 1 && strcmp(l.table.source, "a seed") == 0);
    const cost_features_t f = features(63);
    CHECK(cost_learner_add(&l, &f, truth(TRUTH, &f, 1)) == 1);
    for (int k = 0; k < COST_N_COEF; k++)
        CHECK_NEAR(l.table.coef[k], TRUTH[k], 0, 1e-6);
    CHECK(strstr(l.table.source, "learned from the engine's last 64 iterations") != NULL);
    CHECK(l.refits == 1 && l.samples == 64 && l.last_outliers == 0);
    /* The per-image costs are the seed's until images are timed. */
    CHECK(l.table.decode_s == 0.5 && l.table.png_s == 0.25);
    cost_learner_free(&l);
}

/* One step in ten slowed 5x by something else (another process, a page
 * fault storm): the robust fit keeps the table within 2% where a plain
 * least-squares fit of the same samples is off by far more. */
static void test_slowed_steps_do_not_move_the_table(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 512, 512) == AR_OK);
    cost_features_t x[512];
    double y[512];
    for (int i = 0; i < 512; i++) {
        x[i] = features(i);
        const double noise = 1 + 0.02 * (rng_uniform(7, 0, (uint64_t)i) - 0.5);
        y[i] = truth(TRUTH, &x[i], noise * (i % 10 == 3 ? 5 : 1));
        cost_learner_add(&l, &x[i], y[i]);
    }
    CHECK_MSG(l.refits == 1 && l.last_outliers >= 51, "refits %lld, outliers %d, %s", l.refits,
              l.last_outliers, l.table.source);
    double worst = 0, worst_plain = 0;
    cost_table_t plain = {0};
    CHECK(cost_table_fit(&plain, x, y, 512) == 0);
    for (int i = 0; i < 64; i++) {
        const cost_features_t f = features(1000 + i);
        const double want = truth(TRUTH, &f, 1);
        worst = fmax(worst, fabs(cost_step_seconds(&l.table, &f) - want) / want);
        worst_plain = fmax(worst_plain, fabs(cost_step_seconds(&plain, &f) - want) / want);
    }
    CHECK_MSG(worst < 0.02, "robust fit off by %.1f%%", 100 * worst);
    CHECK_MSG(worst_plain > 0.1, "a plain fit off by only %.1f%%", 100 * worst_plain);
    cost_learner_free(&l);
}

/* Steps faster than the table says are the table's own error (a linear
 * table prices some steps high: a scale model's smallest), not steps slowed
 * by something else: they stay in the fit, whose steps then sum to what
 * was measured (one in eight 40% faster: a fit without them would be 5%
 * high on those and 2% high on the sum). */
static void test_fast_steps_stay_in_the_fit(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 512, 512) == AR_OK);
    double sum_y = 0, sum_fit = 0;
    cost_features_t x[512];
    double y[512];
    for (int i = 0; i < 512; i++) {
        x[i] = features(i);
        y[i] = truth(TRUTH, &x[i], i % 8 == 5 ? 0.6 : 1);
        sum_y += y[i];
        cost_learner_add(&l, &x[i], y[i]);
    }
    for (int i = 0; i < 512; i++)
        sum_fit += cost_step_seconds(&l.table, &x[i]);
    CHECK_MSG(l.refits == 1 && l.last_outliers == 0 && fabs(sum_fit / sum_y - 1) < 1e-6,
              "%d left out; the fit's steps sum to %.4f of the measured", l.last_outliers,
              sum_fit / sum_y);
    cost_learner_free(&l);
}

/* The ring holds the last cap samples: a machine that became twice as
 * slow is what the table says once the ring has turned over. */
static void test_the_ring_forgets_an_older_speed(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 128, 32) == AR_OK);
    for (int i = 0; i < 3 * 128; i++) {
        const cost_features_t f = features(i);
        cost_learner_add(&l, &f, truth(TRUTH, &f, i < 128 ? 1 : 2));
    }
    CHECK(l.n == 128 && l.samples == 3 * 128);
    for (int k = 0; k < COST_N_COEF; k++)
        CHECK_NEAR(l.table.coef[k], 2 * TRUTH[k], 0, 1e-6);
    cost_learner_free(&l);
}

/* Too few samples for a fit: the table stays what it was. Times that are
 * not numbers are not samples. */
static void test_a_fit_that_fails_keeps_the_table(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 64, 2) == AR_OK);
    const cost_features_t f = features(1), g = features(2);
    CHECK(cost_learner_add(&l, &f, 0.01) == 0 && cost_learner_add(&l, &g, 0.02) == 0);
    CHECK(l.table.coef[0] == 1 && l.refits == 0 && l.samples == 2);
    CHECK(cost_learner_add(&l, &f, NAN) == 0 && cost_learner_add(&l, &f, -1) == 0 &&
          l.samples == 2);
    cost_learner_free(&l);
}

/* Refitting is the engine thread's time too: the learner spends at most
 * COST_REFIT_SHARE of the time it was fed on its refits. Steps so short
 * that a refit every refit_every of them would cost more wait for more. */
static void test_refits_keep_to_their_share_of_the_time(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 4096, 64) == AR_OK);
    for (int i = 0; i < 4096; i++) {
        const cost_features_t f = features(i);
        cost_learner_add(&l, &f, 1e-3 * truth(TRUTH, &f, 1)); /* microseconds a step */
    }
    CHECK_MSG(l.refits >= 1 && l.refits < 8, "%lld refits over 4096 steps of microseconds",
              l.refits);
    CHECK_MSG(l.refit_s > 0, "the last refit's time: %g s", l.refit_s);
    /* Steps of a tenth of a second and more: a refit every 64. */
    cost_learner_free(&l);
    CHECK(cost_learner_init(&l, &s, 4096, 64) == AR_OK);
    for (int i = 0; i < 4096; i++) {
        const cost_features_t f = features(i);
        cost_learner_add(&l, &f, truth(TRUTH, &f, 100));
    }
    CHECK_MSG(l.refits == 64, "%lld refits over 4096 long steps", l.refits);
    cost_learner_free(&l);
}

/* A step's features are the rows it computes and the keys each attends: a
 * raster step its prefix at first, then one token against the cache; a
 * scale step its scale's tokens against the cache, the last scale's (never
 * cached) against the cache and themselves, the most costly step of an
 * image. */
static void test_step_features_count_every_row(void) {
    kv_geometry_t g = {.n_prompt = 0,
                       .step_unit = KV_STEP_SEGMENT,
                       .n_segments = 3,
                       .segment_tokens = {1, 4, 9},
                       .n_layers = 1,
                       .n_heads = 1};
    int tokens[3] = {1, 5, 5}; /* held during each step: the last scale is not cached */
    planner_plan_t pl = {.steps = 3, .tokens = tokens};
    static const double rows[3] = {1, 4, 9}, keys[3] = {1, 5, 14};
    for (int t = 0; t < 3; t++) {
        cost_features_t f = {0};
        cost_features_add(&f, &g, &pl, t, 2); /* two images: four sequences */
        CHECK_MSG(f.sequences == 4 && f.new_tokens == 4 * rows[t] &&
                      f.kv_attended == 4 * rows[t] * keys[t] && f.kv_scored == 0,
                  "scale step %d: %g rows, %g pairs", t, f.new_tokens, f.kv_attended);
    }
    kv_geometry_uniform(&g, 7, KV_STEP_TOKEN, 2, 2, 1, 1);
    int held[4] = {7, 8, 9, 10};
    unsigned char scored[4] = {0, 0, 1, 0};
    pl = (planner_plan_t){.steps = 4, .tokens = held, .scored = scored};
    static const double raster_rows[4] = {7, 1, 1, 1};
    for (int t = 0; t < 4; t++) {
        cost_features_t f = {0};
        cost_features_add(&f, &g, &pl, t, 1);
        CHECK_MSG(f.new_tokens == 2 * raster_rows[t] &&
                      f.kv_attended == 2 * raster_rows[t] * held[t] &&
                      f.kv_scored == (t == 2 ? f.kv_attended : 0),
                  "raster step %d: %g rows, %g pairs", t, f.new_tokens, f.kv_attended);
    }
}

/* No policy collected key mass in any sample: the scored term is left out
 * of the fit (0), the others recovered as before. */
static void test_no_scored_pairs_no_scored_term(void) {
    cost_features_t x[256];
    double y[256];
    for (int i = 0; i < 256; i++) {
        x[i] = features(i);
        x[i].kv_scored = 0;
        y[i] = truth(TRUTH, &x[i], 1);
    }
    cost_table_t t = {0};
    CHECK(cost_table_fit(&t, x, y, 256) == 0);
    CHECK(t.coef[COST_COEF_KV_SCORED] == 0);
    for (int k = 0; k < COST_COEF_KV_SCORED; k++)
        CHECK_NEAR(t.coef[k], TRUTH[k], 0, 1e-6);
}

static void test_images_and_requests_set_their_costs(void) {
    cost_learner_t l;
    const cost_table_t s = seed();
    CHECK(cost_learner_init(&l, &s, 64, 64) == AR_OK);
    cost_learner_add_image(&l, 0.2, 0.1);
    CHECK(l.table.decode_s == 0.2 && l.table.png_s == 0.1);
    cost_learner_add_image(&l, 0.4, 0.3);
    CHECK_NEAR(l.table.decode_s, 0.3, 1e-12, 0);
    CHECK_NEAR(l.table.png_s, 0.2, 1e-12, 0);
    for (int i = 0; i < 1000; i++)
        cost_learner_add_image(&l, 1.0, 2.0);
    CHECK_NEAR(l.table.decode_s, 1.0, 1e-6, 0);
    CHECK_NEAR(l.table.png_s, 2.0, 1e-6, 0);
    cost_learner_add_image(&l, -1, 5); /* not timed */
    CHECK_NEAR(l.table.png_s, 2.0, 1e-6, 0);
    /* Requests' HTTP side: the same running mean, its own count. */
    CHECK(l.table.http_s == 0);
    cost_learner_add_request(&l, 0.004);
    CHECK(l.table.http_s == 0.004);
    cost_learner_add_request(&l, 0.002);
    CHECK_NEAR(l.table.http_s, 0.003, 1e-12, 0);
    cost_learner_add_request(&l, NAN);
    cost_learner_add_request(&l, -1);
    CHECK_NEAR(l.table.http_s, 0.003, 1e-12, 0);
    CHECK(l.requests == 2 && l.images == 64);
    cost_learner_free(&l);
}

static void test_default_table(void) {
    model_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.llm.head_dim = 64;
    cfg.llm.num_heads = 16;
    cfg.llm.num_layers = 24;
    cost_table_t t;
    cost_table_default(&t, &cfg, 1e9);
    CHECK_NEAR(t.coef[3], 2e9 / COST_DEFAULT_FLOPS, 0, 1e-12);
    CHECK_NEAR(t.coef[2], 4.0 * 64 * 16 * 24 / COST_DEFAULT_FLOPS, 0, 1e-12);
    CHECK(t.coef[0] == 0 && t.coef[1] == 0 && t.decode_s == 1 && t.png_s == 1);
    CHECK(strstr(t.source, "default") != NULL);
}

int main(void) {
    TEST_RUN(test_seed_answers_until_the_first_fit_then_the_fit);
    TEST_RUN(test_slowed_steps_do_not_move_the_table);
    TEST_RUN(test_fast_steps_stay_in_the_fit);
    TEST_RUN(test_the_ring_forgets_an_older_speed);
    TEST_RUN(test_a_fit_that_fails_keeps_the_table);
    TEST_RUN(test_refits_keep_to_their_share_of_the_time);
    TEST_RUN(test_step_features_count_every_row);
    TEST_RUN(test_no_scored_pairs_no_scored_term);
    TEST_RUN(test_images_and_requests_set_their_costs);
    TEST_RUN(test_default_table);
    return TEST_SUMMARY();
}
