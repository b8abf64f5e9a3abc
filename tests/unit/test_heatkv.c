/* HeatKV: the static schedule's properties on random instances (N_k is
 * eq. 5's least count, the budget holds after every layer of every scale,
 * removals only grow, each source scale loses exactly N_k heads, greedy
 * early pruning takes the fewest candidates a brute force finds), the
 * calibration file (round trip, orderings from attention mass, refusal of
 * another model's), and on the shipped multiscale demo model the engine's
 * measured KV, step by step, equal to the plan byte for byte. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/policy/heatkv.h"
#include "engine/policy/kv_calibration.h"
#include "tests/test.h"
#include "tests/unit/kv_plan_run.h"

static unsigned rng_state = 12345;
static int rnd(int n) {
    rng_state = rng_state * 1103515245u + 12345u;
    return (int)((rng_state >> 8) % (unsigned)n);
}

static void shuffle(int *v, int n) {
    for (int i = 0; i < n; i++)
        v[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = rnd(i + 1), t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

/* A random next-scale geometry (K scales, L x H heads) and calibration with
 * random orderings; equal: every scale past the sinks has the same size. */
static void random_instance(kv_geometry_t *g, kv_calibration_t *c, int max_heads, int sinks,
                            int equal) {
    memset(g, 0, sizeof *g);
    g->step_unit = KV_STEP_SEGMENT;
    g->n_segments = 4 + rnd(3);
    g->n_layers = 1 + rnd(3);
    g->n_heads = 1 + rnd(max_heads);
    const int same = 1 + rnd(6);
    for (int i = 0; i < g->n_segments; i++)
        g->segment_tokens[i] = equal && i >= sinks ? same : 1 + rnd(9);
    ar_error_t err;
    CHECK(kv_calibration_synthetic(c, g, sinks, &err) == AR_OK);
    const int T = g->n_layers * g->n_heads;
    shuffle(c->cas_order, T);
    for (int src = 0; src < g->n_segments - 1; src++)
        shuffle(c->scas_order + (size_t)src * T, T);
    g->calibration = c;
}

static long long cached_before(const kv_geometry_t *g, int end) {
    long long n = 0;
    for (int i = 0; i < end && i < g->n_segments - 1; i++)
        n += g->segment_tokens[i];
    return n;
}

/* N_k is the least N with N c_s + (T - N) c_k <= b T P (HeatKV §3.2). */
static void test_n_pruned_is_the_least_count_in_budget(void) {
    int checked = 0;
    for (int trial = 0; trial < 300; trial++) {
        kv_geometry_t g;
        kv_calibration_t c;
        const int s = rnd(3);
        random_instance(&g, &c, 4, s, 0);
        const int T = g.n_layers * g.n_heads, K = g.n_segments;
        const double minb = heatkv_min_budget(&g, s), b = minb + (1 - minb) * rnd(1000) / 1000.0;
        const double P = (double)cached_before(&g, K - 1);
        for (int k = s; k < K - 1; k++) {
            const double ck = (double)cached_before(&g, k + 1), cs = (double)cached_before(&g, s);
            int least = -1;
            for (int N = 0; N <= T && least < 0; N++)
                if (N * cs + (T - N) * ck <= b * T * P + 1e-9)
                    least = N;
            CHECK_MSG(least >= 0 && heatkv_n_pruned(&g, s, b, k) == least,
                      "trial %d k %d: N_k %d, least %d", trial, k, heatkv_n_pruned(&g, s, b, k),
                      least);
            checked++;
        }
        for (int k = 0; k < s && k < K; k++)
            CHECK(heatkv_n_pruned(&g, s, b, k) == 0);
        kv_calibration_free(&c);
    }
    CHECK(checked > 300);
}

/* Tokens all heads hold after layer l ran step k (or at the step's start,
 * l = -1), given which candidates are early: computed here from the
 * schedule's G sets alone. A unit (src, u) is in G_k when its first step in
 * G (gone) is at most k. */
static long long size_with(const heatkv_schedule_t *s, const kv_geometry_t *g, int k, int l,
                           const unsigned char *early_unit) {
    const int T = s->n_layers * s->n_heads;
    long long n = 0;
    for (int u = 0; u < T; u++) {
        const int ran = u / s->n_heads <= l;
        for (int src = 0; src < s->n_scales - 1 && src <= k; src++) {
            if (!ran && src == k)
                continue;
            int here = src < s->sinks;
            if (!here) {
                const int gone = s->gone[(size_t)src * T + u];
                here = ran ? gone > k : gone > k || (gone == k && !early_unit[(size_t)src * T + u]);
            }
            n += here ? g->segment_tokens[src] : 0;
        }
    }
    return n;
}

/* The position of head u in source scale src's ordering. */
static int rank_in(const kv_calibration_t *c, int src, int u) {
    const int T = c->n_layers * c->n_heads;
    for (int r = 0; r < T; r++)
        if (c->scas_order[(size_t)src * T + r] == u)
            return r;
    return -1;
}

/* Greedy's order within a layer (scale-dependent): an early unit never
 * passes over a candidate of its layer that comes first, a larger source
 * scale or, in the same one, a lower rank. */
static int order_violations(const heatkv_schedule_t *s, const kv_calibration_t *c, int k) {
    const int T = s->n_layers * s->n_heads;
    int bad = 0;
    for (int x = 0; x < T; x++)
        for (int sx = s->sinks; sx < k; sx++) {
            const size_t ux = (size_t)sx * T + x;
            if (s->gone[ux] != k || !s->early[ux])
                continue;
            for (int y = 0; y < T; y++)
                for (int sy = s->sinks; sy < k; sy++) {
                    const size_t uy = (size_t)sy * T + y;
                    if (y / s->n_heads != x / s->n_heads || s->gone[uy] != k || s->early[uy])
                        continue;
                    bad += sy > sx || (sy == sx && rank_in(c, sy, y) < rank_in(c, sx, x));
                }
        }
    return bad;
}

static void check_schedule(const heatkv_schedule_t *s, const kv_geometry_t *g, int *bad_budget,
                           int *bad_grow, int *bad_count) {
    const int T = s->n_layers * s->n_heads, K = s->n_scales;
    for (int k = 0; k < K; k++) {
        for (int l = -1; l < s->n_layers; l++) {
            long long n = l < 0 ? heatkv_tokens_at(s, g, k, 0, 1) : heatkv_tokens_at(s, g, k, l, 0);
            *bad_budget += n > s->cap_tokens + 1e-6;
        }
        for (int u = 0; u < T; u++)
            for (int src = 0; src < K - 1; src++)
                for (int k2 = k + 1; k2 < K; k2++)
                    *bad_grow += heatkv_present(s, src, u, k2, 0) && src <= k &&
                                 !heatkv_present(s, src, u, k, 0);
        if (k < s->sinks || k >= K - 1)
            continue;
        /* At the end of scale k each source scale is gone from N_k heads
         * (binary: N_k heads hold nothing but the sinks). */
        for (int src = s->sinks; src <= k; src++) {
            int absent = 0;
            for (int u = 0; u < T; u++)
                absent += !heatkv_present(s, src, u, k, 0);
            *bad_count += absent != s->N[k];
        }
    }
}

/* The least number of candidates (units, or heads when binary) that keeps
 * every layer of step k within budget, by trying every subset. */
static int brute_force_least(const heatkv_schedule_t *s, const kv_geometry_t *g, int k,
                             int binary) {
    const int T = s->n_layers * s->n_heads;
    int cand[64], n = 0;
    for (int u = 0; u < T; u++) {
        if (binary) {
            if (k > s->sinks && s->gone[(size_t)s->sinks * T + u] == k)
                cand[n++] = u;
            continue;
        }
        for (int src = s->sinks; src < k; src++)
            if (s->gone[(size_t)src * T + u] == k)
                cand[n++] = src * T + u;
    }
    CHECK(n <= 14);
    const size_t n_units = (size_t)(s->n_scales - 1) * T;
    unsigned char *early = malloc(n_units);
    int best = -1;
    for (unsigned mask = 0; mask < (1u << n); mask++) {
        const int size = __builtin_popcount(mask);
        if (best >= 0 && size >= best)
            continue;
        memset(early, 0, n_units);
        for (int i = 0; i < n; i++)
            if (mask >> i & 1u) {
                if (binary)
                    for (int src = s->sinks; src <= k; src++)
                        early[(size_t)src * T + cand[i]] = 1;
                else
                    early[cand[i]] = 1;
            }
        int ok = 1;
        for (int l = 0; l < s->n_layers && ok; l++)
            ok = size_with(s, g, k, l, early) <= s->cap_tokens + 1e-6;
        if (ok)
            best = size;
    }
    free(early);
    return best;
}

static void schedules_on_random_instances(int binary, int equal, int assert_least) {
    int bad_budget = 0, bad_grow = 0, bad_count = 0, not_least = 0, steps = 0, early_steps = 0,
        bad_order = 0;
    for (int trial = 0; trial < 400; trial++) {
        kv_geometry_t g;
        kv_calibration_t c;
        const int sinks = rnd(3);
        random_instance(&g, &c, 2, sinks, equal);
        const double minb = heatkv_min_budget(&g, sinks);
        const double b = minb + (1 - minb) * rnd(1000) / 1000.0;
        heatkv_schedule_t s;
        ar_error_t err = {{0}};
        if (heatkv_schedule_build(&s, &g, &c, sinks, b, binary, &err) != AR_OK) {
            CHECK_MSG(0, "trial %d: %s", trial, err.msg);
            kv_calibration_free(&c);
            continue;
        }
        check_schedule(&s, &g, &bad_budget, &bad_grow, &bad_count);
        for (int k = s.sinks; k < g.n_segments - 1; k++) {
            if (!binary)
                bad_order += order_violations(&s, &c, k);
            const int least = brute_force_least(&s, &g, k, binary);
            steps++;
            early_steps += s.n_early[k] > 0;
            not_least += least != s.n_early[k];
            if (assert_least)
                CHECK_MSG(least == s.n_early[k], "trial %d scale %d: greedy %d, least %d", trial, k,
                          s.n_early[k], least);
        }
        heatkv_schedule_free(&s);
        kv_calibration_free(&c);
    }
    CHECK_MSG(bad_budget == 0, "%d checkpoints over budget", bad_budget);
    CHECK_MSG(bad_grow == 0, "%d head-scales came back", bad_grow);
    CHECK_MSG(bad_count == 0, "%d source scales not pruned in exactly N_k heads", bad_count);
    CHECK_MSG(bad_order == 0, "%d early units passed over a candidate of their layer before them",
              bad_order);
    CHECK_MSG(early_steps > 20, "only %d of %d steps needed early pruning", early_steps, steps);
    if (!assert_least)
        printf("  scale-dependent, scales of any size: greedy took more than the least in %d of "
               "%d steps (%d with early pruning)\n",
               not_least, steps, early_steps);
}

static void test_binary_schedule_properties_and_greedy_is_least(void) {
    schedules_on_random_instances(1, 0, 1);
}

/* Head-scales of equal size: a deeper unit frees at least as much at every
 * checkpoint, so greedy is the least (HeatKV's exchange argument). */
static void test_scale_schedule_properties_and_greedy_is_least_on_equal_scales(void) {
    schedules_on_random_instances(0, 1, 1);
}

static void test_scale_schedule_properties_on_any_scales(void) {
    schedules_on_random_instances(0, 0, 0);
}

static void test_budget_below_the_sinks_is_refused(void) {
    kv_geometry_t g;
    kv_calibration_t c;
    random_instance(&g, &c, 2, 2, 0);
    heatkv_schedule_t s;
    ar_error_t err = {{0}};
    const double minb = heatkv_min_budget(&g, 2);
    CHECK(heatkv_schedule_build(&s, &g, &c, 2, minb * 0.99, 0, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "sink scales");
    CHECK(heatkv_schedule_build(&s, &g, &c, 2, minb, 0, &err) == AR_OK);
    heatkv_schedule_free(&s);
    kv_calibration_free(&c);
}

/* ---- HeatKV's public code ---- */

static int json_int(const cJSON *o, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(o, key)->valueint;
}

/* Our schedule against the one HeatKV's code computes
 * (tests/golden/heatkv_schedule/README.md) from the same orderings, on
 * Infinity-2B's 1M 1:1 schedule at HeatKV's Table 1 budgets and on two small
 * ones at budgets where greedy early pruning acts: at every step, the
 * (source scale, layer, head) units attention does not see, and those not
 * cached after the step. */
static void test_schedule_equals_the_public_code(void) {
    FILE *f = fopen("tests/golden/heatkv_schedule/schedule.json", "rb");
    CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    rewind(f);
    char *text = malloc((size_t)size + 1);
    CHECK(text && fread(text, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    text[size] = 0;
    cJSON *root = cJSON_Parse(text);
    free(text);
    CHECK(root != NULL);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(root, "cases"), *tc;
    int n_cases = 0;
    cJSON_ArrayForEach(tc, cases) {
        kv_geometry_t g = {.step_unit = KV_STEP_SEGMENT};
        g.n_layers = json_int(tc, "n_layers");
        g.n_heads = json_int(tc, "n_heads");
        const int sinks = json_int(tc, "sinks"), T = g.n_layers * g.n_heads;
        const double budget = cJSON_GetObjectItemCaseSensitive(tc, "budget")->valuedouble;
        const cJSON *x;
        cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(tc, "scale_tokens"))
            g.segment_tokens[g.n_segments++] = x->valueint;
        const int K = g.n_segments;
        kv_calibration_t c;
        ar_error_t err = {{0}};
        CHECK(kv_calibration_synthetic(&c, &g, sinks, &err) == AR_OK);
        int src = sinks;
        cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(tc, "scas_order")) {
            int i = 0;
            const cJSON *u;
            cJSON_ArrayForEach(u, x) c.scas_order[(size_t)src * T + i++] = u->valueint;
            src++;
        }
        heatkv_schedule_t s;
        CHECK_MSG(heatkv_schedule_build(&s, &g, &c, sinks, budget, 0, &err) == AR_OK, "%s",
                  err.msg);
        const char *what[2] = {"attention_removed", "cached_removed"};
        int differ = 0;
        for (int kind = 0; kind < 2; kind++) {
            const cJSON *steps = cJSON_GetObjectItemCaseSensitive(tc, what[kind]);
            for (int t = 0; t < K - kind; t++)
                for (int i = sinks; i <= K - 2; i++)
                    for (int l = 0; l < g.n_layers; l++) {
                        const int mask =
                            cJSON_GetArrayItem(
                                cJSON_GetArrayItem(cJSON_GetArrayItem(steps, t), i - sinks), l)
                                ->valueint;
                        for (int h = 0; h < g.n_heads; h++) {
                            /* attention: earlier scales only; cache: this one too */
                            if (i > t || (kind == 0 && i == t))
                                continue;
                            const int theirs = !(mask >> h & 1),
                                      ours = heatkv_present(&s, i, l * g.n_heads + h, t, !kind);
                            if (theirs != ours && differ++ < 5)
                                CHECK_MSG(0,
                                          "%s sinks %d budget %g: step %d, %s, scale %d, layer "
                                          "%d, head %d: theirs %s, ours %s",
                                          cJSON_GetObjectItemCaseSensitive(tc, "name")->valuestring,
                                          sinks, budget, t, what[kind], i, l, h,
                                          theirs ? "kept" : "removed", ours ? "kept" : "removed");
                        }
                    }
        }
        CHECK_MSG(differ == 0, "%d units differ", differ);
        heatkv_schedule_free(&s);
        kv_calibration_free(&c);
        n_cases++;
    }
    CHECK(n_cases == 12);
    cJSON_Delete(root);
}

/* ---- calibration ---- */

static void test_orderings_from_beta(void) {
    kv_geometry_t g = {.step_unit = KV_STEP_SEGMENT, .n_segments = 4, .n_layers = 2, .n_heads = 3};
    for (int i = 0; i < 4; i++)
        g.segment_tokens[i] = (i + 1) * (i + 1);
    const int T = 6, K = 4;
    float beta[6 * 16] = {0};
    for (int h = 0; h < T; h++)
        for (int q = 0; q < K; q++)
            for (int src = 0; src <= q; src++)
                beta[(h * K + q) * K + src] = (float)(((h * 7 + src * 3 + q) % 5) + h * 0.01);
    kv_calibration_t c;
    ar_error_t err;
    CHECK(kv_calibration_from_beta(&c, &g, beta, 10, 1, &err) == AR_OK);
    /* S-CAS of source 1: mean of beta[q][1] over q = 2, 3; ascending. */
    for (int i = 0; i + 1 < T; i++) {
        const int a = c.scas_order[1 * T + i], b = c.scas_order[1 * T + i + 1];
        const double sa = beta[(a * K + 2) * K + 1] + beta[(a * K + 3) * K + 1];
        const double sb = beta[(b * K + 2) * K + 1] + beta[(b * K + 3) * K + 1];
        CHECK_MSG(sa < sb || (sa == sb && a % 3 <= b % 3), "scas[1] %d before %d", a, b);
        /* CAS with one sink: the last scale's mass on sources 1 and 2. */
        const int x = c.cas_order[i], y = c.cas_order[i + 1];
        const double cx = beta[(x * K + 3) * K + 1] + beta[(x * K + 3) * K + 2];
        const double cy = beta[(y * K + 3) * K + 1] + beta[(y * K + 3) * K + 2];
        CHECK_MSG(cx < cy || (cx == cy && x % 3 <= y % 3), "cas %d before %d", x, y);
    }
    /* Round trip through the file. */
    char path[] = "/tmp/arserve-calib-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK_MSG(kv_calibration_save(&c, path, &err) == AR_OK, "%s", err.msg);
    kv_calibration_set_t file;
    CHECK_MSG(kv_calibration_set_load(&file, path, &err) == AR_OK && file.n == 1, "%s", err.msg);
    const kv_calibration_t back = file.c[0];
    CHECK(back.n_layers == 2 && back.n_heads == 3 && back.n_scales == 4 && back.sink_scales == 1 &&
          back.n_prompts == 10 && back.beta);
    CHECK(!memcmp(back.cas_order, c.cas_order, T * sizeof(int)));
    CHECK(!memcmp(back.scas_order, c.scas_order, (size_t)(K - 1) * T * sizeof(int)));
    CHECK(fabsf(back.beta[17] - beta[17]) < 1e-6f);
    CHECK(kv_calibration_check(&back, &g, &err) == AR_OK);
    /* Another model's shape is refused, saying what to do. */
    kv_geometry_t other = g;
    other.n_heads = 4;
    CHECK(kv_calibration_check(&back, &other, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "arserve calibrate");
    /* Equal scores: units (layer * 3 + head) by head, then layer, as HeatKV's
     * calibration sorts its (score, head, layer) tuples. */
    kv_calibration_t tied;
    for (int i = 0; i < T * K * K; i++)
        beta[i] = 0.25f;
    CHECK(kv_calibration_from_beta(&tied, &g, beta, 1, 1, &err) == AR_OK);
    const int by_head[6] = {0, 3, 1, 4, 2, 5};
    CHECK(!memcmp(tied.cas_order, by_head, sizeof by_head));
    for (int src = 0; src < K - 1; src++)
        CHECK_MSG(!memcmp(tied.scas_order + src * T, by_head, sizeof by_head), "scas[%d]", src);
    kv_calibration_free(&tied);
    other = g;
    other.segment_tokens[2] = 10; /* the same model at another image size */
    CHECK(kv_calibration_check(&back, &other, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "no entry for this image size (scales of 1,4,10,16 tokens; it "
                                "was made at scales of 1,4,9,16)");
    kv_calibration_set_free(&file);
    /* A broken file names itself and the field. */
    FILE *f = fopen(path, "w");
    fputs("{\"format\":\"arserve-kv-calibration\",\"version\":1,\"n_layers\":2,\"n_heads\":3,"
          "\"prompts\":1,\"scale_tokens\":[1,4,9,16],\"sink_scales\":1,"
          "\"cas_order\":[0,1,2,3,4,4],\"scas_order\":[]}",
          f);
    fclose(f);
    CHECK(kv_calibration_set_load(&file, path, &err) == AR_ERR && file.n == 0);
    CHECK_STR_CONTAINS(err.msg, path);
    CHECK_STR_CONTAINS(err.msg, "cas_order[5]");
    unlink(path);
    kv_calibration_free(&c);
}

/* A model's file holds a calibration per image size: an entry is picked by
 * its size's name (transposed sizes have the same token counts, not the
 * same statistics), an unnamed one (older files) by its scales; putting a
 * size's again replaces it; one entry saves as version 1, several as
 * version 2, and a broken entry or two of one size are refused by number. */
static void test_calibration_set_one_entry_per_size(void) {
    kv_geometry_t wide = {.step_unit = KV_STEP_SEGMENT,
                          .n_segments = 3,
                          .n_layers = 1,
                          .n_heads = 2,
                          .segment_tokens = {1, 2, 8}};
    kv_geometry_t square = wide;
    square.segment_tokens[2] = 9;
    ar_error_t err = {{0}};
    kv_calibration_set_t s = {0};
    kv_calibration_t c;
    const char *names[] = {"32x16", "16x32", "24x24"};
    const kv_geometry_t *geoms[] = {&wide, &wide, &square};
    for (int i = 0; i < 3; i++) {
        CHECK(kv_calibration_synthetic(&c, geoms[i], 1, &err) == AR_OK);
        c.n_prompts = i + 1;
        snprintf(c.size, sizeof c.size, "%s", names[i]);
        CHECK(kv_calibration_set_put(&s, &c, &err) == AR_OK);
        CHECK(c.cas_order == NULL); /* moved */
    }
    CHECK(s.n == 3);
    CHECK(kv_calibration_set_pick(&s, "16x32", &wide) == &s.c[1]);
    CHECK(kv_calibration_set_pick(&s, "32x16", &wide) == &s.c[0]);
    CHECK(kv_calibration_set_pick(&s, "24x24", &square) == &s.c[2]);
    CHECK(kv_calibration_set_pick(&s, "48x8", &wide) == NULL);
    CHECK(kv_calibration_set_pick(NULL, "24x24", &square) == NULL);
    /* The same size again replaces its entry. */
    CHECK(kv_calibration_synthetic(&c, &wide, 2, &err) == AR_OK);
    c.n_prompts = 7;
    snprintf(c.size, sizeof c.size, "16x32");
    CHECK(kv_calibration_set_put(&s, &c, &err) == AR_OK);
    CHECK(s.n == 3 && s.c[1].n_prompts == 7 && s.c[1].sink_scales == 2);
    /* Through the file: version 2 keeps every entry and its name. */
    char path[] = "/tmp/arserve-calibset-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK_MSG(kv_calibration_set_save(&s, path, &err) == AR_OK, "%s", err.msg);
    kv_calibration_set_t back;
    CHECK_MSG(kv_calibration_set_load(&back, path, &err) == AR_OK, "%s", err.msg);
    CHECK(back.n == 3);
    for (int i = 0; i < back.n && i < 3; i++) {
        CHECK_MSG(strcmp(back.c[i].size, s.c[i].size) == 0, "entry %d: %s", i, back.c[i].size);
        CHECK(back.c[i].n_prompts == s.c[i].n_prompts &&
              back.c[i].sink_scales == s.c[i].sink_scales);
        CHECK(!memcmp(back.c[i].scale_tokens, s.c[i].scale_tokens, sizeof s.c[i].scale_tokens));
    }
    kv_calibration_set_free(&back);
    CHECK(back.n == 0);
    /* One entry saves as the single calibration of version 1. */
    kv_calibration_set_t one = {0};
    CHECK(kv_calibration_synthetic(&c, &square, 1, &err) == AR_OK);
    CHECK(kv_calibration_set_put(&one, &c, &err) == AR_OK);
    CHECK(kv_calibration_set_save(&one, path, &err) == AR_OK);
    char text[64] = "";
    FILE *v1 = fopen(path, "r");
    CHECK(v1 && fread(text, 1, sizeof text - 1, v1) > 0);
    if (v1)
        fclose(v1);
    CHECK_MSG(strstr(text, "\"version\":1,\"n_layers\"") != NULL, "%s", text);
    CHECK_MSG(kv_calibration_set_load(&back, path, &err) == AR_OK, "%s", err.msg);
    CHECK(back.n == 1 && back.c[0].size[0] == 0 && back.c[0].n_scales == 3);
    kv_calibration_set_free(&back);
    /* An unnamed entry goes with any size of its scales. */
    CHECK(kv_calibration_set_pick(&one, "24x24", &square) == &one.c[0]);
    CHECK(kv_calibration_set_pick(&one, "9x9", &square) == &one.c[0]);
    CHECK(kv_calibration_set_pick(&one, "32x16", &wide) == NULL);
    kv_calibration_set_free(&one);
    /* Two entries of one size, and a broken entry, are refused by number. */
    FILE *f = fopen(path, "w");
    const char *entry = "{\"n_layers\":1,\"n_heads\":2,\"prompts\":1,\"size\":\"24x24\","
                        "\"scale_tokens\":[1,4,9],\"sink_scales\":1,\"cas_order\":[0,1],"
                        "\"scas_order\":[[0,1],[1,0]]}";
    fprintf(f, "{\"format\":\"arserve-kv-calibration\",\"version\":2,\"calibrations\":[%s,%s]}",
            entry, entry);
    fclose(f);
    CHECK(kv_calibration_set_load(&back, path, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "calibrations[1] is for the image size of calibrations[0]");
    CHECK_STR_CONTAINS(err.msg, path);
    f = fopen(path, "w");
    fprintf(f,
            "{\"format\":\"arserve-kv-calibration\",\"version\":2,\"calibrations\":[%s,"
            "{\"n_layers\":1,\"n_heads\":2,\"prompts\":1,\"scale_tokens\":[1,4,16],"
            "\"sink_scales\":1,\"cas_order\":[0,0],\"scas_order\":[[0,1],[1,0]]}]}",
            entry);
    fclose(f);
    CHECK(kv_calibration_set_load(&back, path, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "calibrations[1]: cas_order[1]");
    CHECK(back.n == 0);
    unlink(path);
    kv_calibration_set_free(&s);
}

/* ---- on the engine ---- */

#define DEMO "models/shapes-var"

static backend_t *be;

/* The demo model's file names but its calibration's, at most max; returns
 * how many. */
static int demo_files(char (*names)[256], int max) {
    DIR *d = opendir(DEMO);
    CHECK(d != NULL);
    int n = 0;
    for (struct dirent *e; d != NULL && n < max && (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.' && strcmp(e->d_name, KV_CALIBRATION_FILE) != 0)
            snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    if (d != NULL)
        closedir(d);
    return n;
}

/* A copy of the demo model's directory (links to every file but its own
 * calibration) with a calibration file for another shape: the model refuses
 * to load, naming the file. */
static void test_model_refuses_a_calibration_of_another_shape(void) {
    char dir[] = "/tmp/arserve-calmodel-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char names[16][256], src[1024], path[1024], cwd[512];
    const int n = demo_files(names, 16);
    CHECK(n >= 3); /* arserve.json, classes, weights */
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    for (int i = 0; i < n; i++) {
        snprintf(src, sizeof src, "%s/%s/%.255s", cwd, DEMO, names[i]);
        snprintf(path, sizeof path, "%s/%.255s", dir, names[i]);
        CHECK(symlink(src, path) == 0);
    }
    kv_geometry_t g = {.step_unit = KV_STEP_SEGMENT, .n_segments = 3, .n_layers = 2, .n_heads = 2};
    for (int i = 0; i < 3; i++)
        g.segment_tokens[i] = 1 << (2 * i);
    kv_calibration_t c;
    ar_error_t err = {{0}};
    CHECK(kv_calibration_synthetic(&c, &g, 1, &err) == AR_OK);
    snprintf(path, sizeof path, "%s/%s", dir, KV_CALIBRATION_FILE);
    CHECK(kv_calibration_save(&c, path, &err) == AR_OK);
    kv_calibration_free(&c);
    model_t m;
    CHECK(model_load(&m, dir, be, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, KV_CALIBRATION_FILE);
    CHECK_STR_CONTAINS(err.msg, "arserve calibrate");
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%.255s", dir, names[i]);
        unlink(path);
    }
    snprintf(path, sizeof path, "%s/%s", dir, KV_CALIBRATION_FILE);
    unlink(path);
    CHECK(rmdir(dir) == 0);
}

/* One request per (policy, budget, sinks, block size) on the demo model
 * with a shuffled calibration, in a pool exactly its planned peak: the pool
 * holds, during each step, exactly the plan's bytes for that step, and the
 * request's own peak is the plan's peak. */
static void test_measured_kv_equals_the_plan(void) {
    model_t m;
    ar_error_t err = {{0}};
    if (model_load(&m, DEMO, be, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    kv_geometry_t g;
    model_geometry(&m.cfg, 0, &g);
    static const struct {
        kv_policy_kind_t kind;
        double budget;
        int sinks, bt;
    } runs[] = {
        {KV_POLICY_HEATKV, 0.2, 3, 1},        {KV_POLICY_HEATKV, 0.1, 2, 1},
        {KV_POLICY_HEATKV, 0.04, 1, 1},       {KV_POLICY_HEATKV, 0.3, 3, 4},
        {KV_POLICY_HEATKV_BINARY, 0.2, 3, 1}, {KV_POLICY_HEATKV_BINARY, 0.1, 2, 4},
        {KV_POLICY_HEATKV_BINARY, 0.5, 3, 2},
    };
    int compared = 0, early_runs = 0;
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        kv_calibration_t c;
        CHECK(kv_calibration_synthetic(&c, &g, runs[i].sinks, &err) == AR_OK);
        shuffle(c.cas_order, g.n_layers * g.n_heads);
        for (int src = 0; src < g.n_segments - 1; src++)
            shuffle(c.scas_order + (size_t)src * g.n_layers * g.n_heads, g.n_layers * g.n_heads);
        kv_calibration_set_t one = {.n = 1, .c = {c}};
        m.cfg.kv_calibrations = &one;
        kv_policy_params_t p;
        kv_policy_defaults(&p, runs[i].kind);
        p.budget = runs[i].budget;
        p.sink_scales = runs[i].sinks;
        const int bt = runs[i].bt;
        kv_plan_run_t run;
        if (kv_plan_run(&m, &p, (int)i, 3, bt, &run, &err) != AR_OK) {
            CHECK_MSG(0, "run %zu: %s", i, err.msg);
            continue;
        }
        compared += run.steps;
        CHECK_MSG(run.equal == run.steps, "run %zu: %d steps off the plan", i,
                  run.steps - run.equal);
        CHECK_MSG(run.request_peak == run.planned_peak, "run %zu: peak %zu, plan %zu", i,
                  run.request_peak, run.planned_peak);
        CHECK(!run.leaked);
        const size_t block = kv_pool_block_bytes(bt, m.cfg.llm.head_dim, DTYPE_F32);
        /* The plan is below the full cache's and the budget holds. */
        const double B = p.budget * g.n_layers * g.n_heads * kv_geometry_held(&g, run.steps - 1);
        CHECK_MSG(bt > 1 || (double)run.planned_peak <= 2 * B * block + 1e-6, "run %zu", i);
        heatkv_schedule_t s;
        CHECK(heatkv_schedule_build(&s, &g, &c, p.sink_scales, p.budget,
                                    runs[i].kind == KV_POLICY_HEATKV_BINARY, &err) == AR_OK);
        for (int k = 0; k < g.n_segments; k++)
            early_runs += s.n_early[k] > 0;
        heatkv_schedule_free(&s);
        kv_calibration_free(&c);
        m.cfg.kv_calibrations = NULL;
    }
    CHECK(compared == 7 * 7);
    CHECK_MSG(early_runs > 0, "no run needed early pruning");
    model_free(&m);
}

int main(void) {
    ar_error_t err;
    if (!(be = backend_open("cpu", 2, &err))) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_n_pruned_is_the_least_count_in_budget);
    TEST_RUN(test_binary_schedule_properties_and_greedy_is_least);
    TEST_RUN(test_scale_schedule_properties_and_greedy_is_least_on_equal_scales);
    TEST_RUN(test_scale_schedule_properties_on_any_scales);
    TEST_RUN(test_budget_below_the_sinks_is_refused);
    TEST_RUN(test_schedule_equals_the_public_code);
    TEST_RUN(test_orderings_from_beta);
    TEST_RUN(test_calibration_set_one_entry_per_size);
    TEST_RUN(test_model_refuses_a_calibration_of_another_shape);
    TEST_RUN(test_measured_kv_equals_the_plan);
    be->destroy(be);
    return TEST_SUMMARY();
}
