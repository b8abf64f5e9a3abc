/* The load client's and the simulator's arithmetic: arrival processes have
 * the rate and the spread they claim, mixes draw in proportion, traces read
 * back, the report's statistics match numpy's definitions and count
 * latency from the scheduled time, the cost table's fit recovers known
 * coefficients, and URLs parse. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/bench_report.h"
#include "cli/http_client.h"
#include "cli/loadgen.h"
#include "engine/cost_model.h"
#include "tests/test.h"

#define N_GAPS 40000

/* Mean and squared coefficient of variation of the gaps of t. */
static void gap_stats(const double *t, int n, double *mean, double *cv2) {
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++)
        sum += t[i] - (i ? t[i - 1] : 0);
    *mean = sum / n;
    for (int i = 0; i < n; i++) {
        double g = t[i] - (i ? t[i - 1] : 0) - *mean;
        sq += g * g;
    }
    *cv2 = sq / n / (*mean * *mean);
}

static void test_poisson_has_its_rate_and_unit_spread(void) {
    double *t = malloc(N_GAPS * sizeof *t), mean, cv2;
    loadgen_schedule(LOADGEN_POISSON, 4.0, 1.0, 7, t, N_GAPS);
    gap_stats(t, N_GAPS, &mean, &cv2);
    CHECK_NEAR(mean, 0.25, 0, 0.02);
    CHECK_NEAR(cv2, 1.0, 0, 0.05);
    for (int i = 1; i < N_GAPS; i++)
        CHECK(t[i] >= t[i - 1]);
    free(t);
}

static void test_gamma_burstiness_sets_the_spread(void) {
    /* Gamma gaps of shape k: CV^2 = 1/k at the same mean. */
    static const double shapes[] = {0.25, 1.0, 4.0};
    double *t = malloc(N_GAPS * sizeof *t), mean, cv2;
    for (int k = 0; k < 3; k++) {
        loadgen_schedule(LOADGEN_GAMMA, 2.0, shapes[k], 11, t, N_GAPS);
        gap_stats(t, N_GAPS, &mean, &cv2);
        CHECK_NEAR(mean, 0.5, 0, 0.03);
        CHECK_NEAR(cv2, 1.0 / shapes[k], 0, 0.1);
    }
    free(t);
}

static void test_schedules_are_seeded_and_burst_is_at_zero(void) {
    double a[64], b[64], c[64];
    loadgen_schedule(LOADGEN_GAMMA, 3.0, 0.5, 42, a, 64);
    loadgen_schedule(LOADGEN_GAMMA, 3.0, 0.5, 42, b, 64);
    loadgen_schedule(LOADGEN_GAMMA, 3.0, 0.5, 43, c, 64);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) != 0);
    loadgen_schedule(LOADGEN_BURST, 3.0, 1.0, 42, a, 64);
    for (int i = 0; i < 64; i++)
        CHECK(a[i] == 0);
}

static void test_mix_draws_in_proportion(void) {
    char *path = test_temp_file("");
    FILE *f = fopen(path, "w");
    fprintf(f, "# a comment\n{\"prompt\": \"a\", \"kv_policy\": \"linear\", \"kv_budget\": 0.25, "
               "\"weight\": 3}\n\n{\"prompt\": \"b\"}\n");
    fclose(f);
    loadgen_mix_t m;
    CHECK(loadgen_mix_read(&m, path) == 0);
    CHECK(m.n == 2 && m.total_weight == 4.0);
    CHECK(strcmp(m.e[0].body, "{\"prompt\":\"a\",\"kv_policy\":\"linear\",\"kv_budget\":0.25}") ==
          0);
    CHECK(strcmp(m.e[0].label, "linear@0.25") == 0 && strcmp(m.e[1].label, "default") == 0);
    int first = 0;
    for (int i = 0; i < 20000; i++)
        first += loadgen_mix_pick(&m, 5, i) == 0;
    CHECK_NEAR(first / 20000.0, 0.75, 0.01, 0);
    CHECK(loadgen_mix_pick(&m, 5, 17) == loadgen_mix_pick(&m, 5, 17));
    loadgen_mix_free(&m);
    f = fopen(path, "w");
    fprintf(f, "{\"prompt\": \"a\", \"weight\": 0}\n");
    fclose(f);
    CHECK(loadgen_mix_read(&m, path) == -1); /* a weight must be above 0 */
    f = fopen(path, "w");
    fprintf(f, "{\"n\": 2}\n");
    fclose(f);
    CHECK(loadgen_mix_read(&m, path) == -1); /* no prompt */
    test_remove_temp(path);
}

static void test_trace_reads_sorted_with_distinct_bodies(void) {
    char *path = test_temp_file("");
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"t\": 2.5, \"request\": {\"prompt\": \"x\"}, \"input_tokens\": 9}\n"
               "{\"t\": 0.5, \"request\": {\"prompt\": \"y\", \"n\": 2}}\n"
               "{\"t\": 1.0, \"request\": {\"prompt\": \"x\"}}\n"
               "{\"t\": 1.0, \"request\": {\"prompt\": \"z\"}}\n");
    fclose(f);
    loadgen_trace_item_t *it;
    int n;
    loadgen_mix_t m;
    CHECK(loadgen_trace_read(path, &it, &n, &m) == 0);
    CHECK(n == 4 && m.n == 3);
    CHECK(it[0].t == 0.5 && it[1].t == 1.0 && it[3].t == 2.5);
    /* Equal times keep the file's order (a burst replays in order). */
    CHECK(it[2].t == 1.0 && !strcmp(m.e[it[2].entry].body, "{\"prompt\":\"z\"}"));
    CHECK(it[1].entry == it[3].entry && it[0].entry != it[1].entry);
    CHECK(it[3].input_tokens == 9 && it[1].input_tokens == 0);
    free(it);
    loadgen_mix_free(&m);
    f = fopen(path, "w");
    fprintf(f, "{\"t\": -1, \"request\": {\"prompt\": \"x\"}}\n");
    fclose(f);
    CHECK(loadgen_trace_read(path, &it, &n, &m) == -1);
    test_remove_temp(path);
}

static void test_percentiles_are_numpys(void) {
    const double x[] = {1, 2, 3, 4};
    CHECK_NEAR(bench_percentile(x, 4, 50), 2.5, 1e-12, 0);
    CHECK_NEAR(bench_percentile(x, 4, 90), 3.7, 1e-12, 0);
    CHECK_NEAR(bench_percentile(x, 4, 0), 1, 1e-12, 0);
    CHECK_NEAR(bench_percentile(x, 4, 100), 4, 1e-12, 0);
    CHECK_NEAR(bench_percentile(x, 1, 99), 1, 1e-12, 0);
}

static double num(const cJSON *o, const char *k) {
    return cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(o, k));
}

static void test_report_counts_from_the_scheduled_time(void) {
    /* Three answered in 1, 2 and 3 s from their scheduled time (sent later:
     * the client was behind), one refused with 429. */
    bench_record_t r[4] = {
        {.scheduled = 0,
         .sent = 0.5,
         .done = 1,
         .status = 200,
         .images = 2,
         .output_tokens = 10,
         .input_tokens = 4,
         .queue_s = 0.1,
         .run_s = 0.4,
         .steps = 4,
         .decode_png_s = 0.2},
        {.scheduled = 0,
         .sent = 1.5,
         .done = 2,
         .status = 200,
         .images = 1,
         .output_tokens = 5,
         .input_tokens = 4,
         .queue_s = 0.3,
         .run_s = 0.4,
         .steps = 4,
         .decode_png_s = 0.2},
        {.scheduled = 1,
         .sent = 3.5,
         .done = 4,
         .status = 200,
         .images = 1,
         .output_tokens = 5,
         .input_tokens = 4,
         .queue_s = 0.2,
         .run_s = 0.4,
         .steps = 4,
         .decode_png_s = 0.2},
        {.scheduled = 1,
         .sent = 1,
         .done = 1.01,
         .status = 429,
         .queue_s = -1,
         .run_s = -1,
         .decode_png_s = -1},
    };
    const bench_run_t run = {
        .label = "t", .source = "bench", .arrival = "poisson", .request_rate = 2};
    const bench_slo_t slo = {.e2el_ms = 2500, .queue_ms = 250};
    bench_pool_t pool = {0};
    bench_pool_add(&pool, 10, 20, 1, 0);
    bench_pool_add(&pool, 30, 40, 3, 2);
    cJSON *o = bench_report(&run, r, 4, 4.0, &slo, &pool);
    CHECK(o != NULL);
    CHECK(num(o, "completed") == 3 && num(o, "num_failed") == 1);
    CHECK(num(cJSON_GetObjectItemCaseSensitive(o, "failed"), "429") == 1);
    CHECK_NEAR(num(o, "mean_e2el_ms"), 2000, 1e-9, 0);
    CHECK_NEAR(num(o, "median_e2el_ms"), 2000, 1e-9, 0);
    CHECK_NEAR(num(o, "std_e2el_ms"), 1000 * sqrt(2.0 / 3), 1e-9, 0);
    CHECK_NEAR(num(o, "p99_e2el_ms"), 2980, 1e-9, 0);
    CHECK_NEAR(num(o, "request_throughput"), 0.75, 1e-12, 0);
    CHECK_NEAR(num(o, "images_per_s"), 1.0, 1e-12, 0);
    CHECK_NEAR(num(o, "output_throughput"), 5.0, 1e-12, 0);
    CHECK(num(o, "total_input_tokens") == 12);
    /* Within both SLOs: the first (1 s, 100 ms) only; the second waited 300 ms. */
    CHECK_NEAR(num(o, "request_goodput"), 0.25, 1e-12, 0);
    CHECK_NEAR(num(o, "mean_queue_ms"), 200, 1e-9, 0);
    CHECK_NEAR(num(o, "mean_step_ms"), 100, 1e-9, 0);
    CHECK_NEAR(num(o, "mean_decode_png_ms"), 200, 1e-9, 0);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "kv_pool");
    CHECK(num(p, "max_used_bytes") == 30 && num(p, "mean_reserved_bytes") == 30);
    CHECK(num(p, "max_running") == 3 && num(p, "max_waiting") == 2);
    cJSON_Delete(o);
}

static void test_fit_recovers_coefficients(void) {
    enum { N = 60 };
    cost_features_t x[N];
    double y[N];
    const double c[4] = {2e-3, 5e-5, 3e-9, 1e-6};
    for (int i = 0; i < N; i++) {
        x[i] = (cost_features_t){.sequences = 2 + 2 * (i % 7),
                                 .kv_attended = 1000.0 * (i % 11) * (1 + i % 3),
                                 .new_tokens = 2 + 40 * (i % 5)};
        y[i] = c[0] + c[1] * x[i].sequences + c[2] * x[i].kv_attended + c[3] * x[i].new_tokens;
    }
    cost_table_t t = {0};
    CHECK(cost_table_fit(&t, x, y, N) == 0);
    for (int k = 0; k < 4; k++)
        CHECK_NEAR(t.coef[k], c[k], 0, 1e-6);
    CHECK(t.fit_samples == N && t.fit_rel_rms < 1e-9);
    CHECK_NEAR(cost_step_seconds(&t, &x[5]), y[5], 0, 1e-9);
    /* A feature that lowers the time would have a negative coefficient:
     * it is dropped, and no coefficient is negative. */
    for (int i = 0; i < N; i++)
        y[i] = 1e-2 - 1e-6 * x[i].new_tokens + 1e-4 * x[i].sequences;
    CHECK(cost_table_fit(&t, x, y, N) == 0);
    for (int k = 0; k < 4; k++)
        CHECK(t.coef[k] >= 0);
    CHECK(t.coef[3] == 0 && t.fit_rel_rms > 0);
    CHECK(cost_table_fit(&t, x, y, 2) == -1);
}

static void test_cost_table_round_trips_and_names_bad_keys(void) {
    char *path = test_temp_file("");
    cost_table_t t = {.family = "scale",
                      .source = "test",
                      .coef = {1e-3, 2e-5, 3e-9, 4e-7},
                      .decode_s = 0.02,
                      .png_s = 0.01,
                      .http_s = 0.003,
                      .fit_samples = 9,
                      .fit_rel_rms = 0.05};
    char why[256];
    CHECK(cost_table_save(&t, path, why, sizeof why) == 0);
    cost_table_t u;
    CHECK(cost_table_load(&u, path, why, sizeof why) == 0);
    CHECK(strcmp(u.family, "scale") == 0 && u.fit_samples == 9);
    for (int k = 0; k < 4; k++)
        CHECK(u.coef[k] == t.coef[k]);
    CHECK(u.decode_s == 0.02 && u.png_s == 0.01 && u.http_s == 0.003);
    /* A table written before the HTTP side was timed: none, 0. */
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"family\": \"raster\", \"step\": {\"intercept_s\": 1, \"per_sequence_s\": 0, "
               "\"per_kv_attended_s\": 0, \"per_new_token_s\": 0}, \"decode_s_per_image\": 0.5, "
               "\"png_s_per_image\": 0.25}");
    fclose(f);
    CHECK(cost_table_load(&u, path, why, sizeof why) == 0);
    CHECK(u.http_s == 0 && u.decode_s == 0.5);
    f = fopen(path, "w");
    fprintf(f, "{\"family\": \"raster\", \"step\": {\"intercept_s\": 1, \"per_sequence_s\": 0, "
               "\"per_kv_attended_s\": 0, \"per_new_token_s\": 0}, \"decode_s_per_image\": 0.5, "
               "\"png_s_per_image\": 0.25, \"http_s_per_request\": -1}");
    fclose(f);
    CHECK(cost_table_load(&u, path, why, sizeof why) == -1);
    CHECK(strstr(why, path) && strstr(why, "http_s_per_request"));
    f = fopen(path, "w");
    fprintf(f, "{\"family\": \"raster\", \"step\": {\"intercept_s\": 1, \"per_sequence_s\": -1}}");
    fclose(f);
    CHECK(cost_table_load(&u, path, why, sizeof why) == -1);
    CHECK(strstr(why, path) && strstr(why, "per_sequence_s"));
    test_remove_temp(path);
}

static void test_urls_parse(void) {
    http_target_t t;
    char why[256];
    CHECK(http_target_parse(&t, "http://127.0.0.1:8080", why, sizeof why) == 0);
    CHECK(!strcmp(t.host, "127.0.0.1") && !strcmp(t.port, "8080") && !t.base_path[0]);
    CHECK(http_target_parse(&t, "http://[::1]:81/api/", why, sizeof why) == 0);
    CHECK(!strcmp(t.host, "::1") && !strcmp(t.port, "81") && !strcmp(t.base_path, "/api"));
    CHECK(http_target_parse(&t, "http://example", why, sizeof why) == 0);
    CHECK(!strcmp(t.port, "80"));
    CHECK(http_target_parse(&t, "https://x", why, sizeof why) == -1);
    CHECK(http_target_parse(&t, "http://x:80a", why, sizeof why) == -1);
    CHECK(http_target_parse(&t, "http://:80", why, sizeof why) == -1);
}

int main(void) {
    TEST_RUN(test_poisson_has_its_rate_and_unit_spread);
    TEST_RUN(test_gamma_burstiness_sets_the_spread);
    TEST_RUN(test_schedules_are_seeded_and_burst_is_at_zero);
    TEST_RUN(test_mix_draws_in_proportion);
    TEST_RUN(test_trace_reads_sorted_with_distinct_bodies);
    TEST_RUN(test_percentiles_are_numpys);
    TEST_RUN(test_report_counts_from_the_scheduled_time);
    TEST_RUN(test_fit_recovers_coefficients);
    TEST_RUN(test_cost_table_round_trips_and_names_bad_keys);
    TEST_RUN(test_urls_parse);
    return TEST_SUMMARY();
}
