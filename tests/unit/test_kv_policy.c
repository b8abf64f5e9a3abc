/* KV policies on synthetic attention: a simulated cache (token ids and key
 * mass per head) is driven step by step through kv_policy_step_end, so the
 * tests check which tokens each policy keeps, the steps it asks for
 * statistics, and that no head ever outgrows the planned trajectory. */
#include <stdint.h>
#include <stdlib.h>

#include "engine/policy/kv_policy.h"
#include "tests/test.h"

/* ---- deterministic randomness ---- */

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Uniform in [0, 1) from any number of keys. */
static double hash01(uint64_t a, uint64_t b, uint64_t c) {
    return (double)(mix64(a ^ mix64(b ^ mix64(c))) >> 11) / 9007199254740992.0;
}

typedef struct rng {
    uint64_t s;
} rng_t;

static int rng_int(rng_t *r, int lo, int hi) { /* [lo, hi] */
    r->s = mix64(r->s);
    return lo + (int)(r->s % (uint64_t)(hi - lo + 1));
}

static double rng_unit(rng_t *r) {
    r->s = mix64(r->s);
    return (double)(r->s >> 11) / 9007199254740992.0;
}

/* ---- the simulated cache ---- */

/* Writes weights (not yet normalised) of the query fed at step t over the
 * keys ids[0..len) of one head; the simulator normalises them to a softmax
 * row. Token ids: prefix 0..P-1, image token j is P + j. */
typedef void (*attn_fn_t)(void *ctx, int layer, int head, int step, const int *ids, int len,
                          float *w);

typedef struct sim_head {
    int len, has_mass;
    int *ids;
    float *mass;
    float *oracle; /* per token id: mass of the current line's queries only */
    int oracle_line;
} sim_head_t;

typedef struct sim {
    kv_policy_params_t p;
    kv_geometry_t g;
    kv_policy_state_t *s;
    int steps, cap, n_heads_total, exact;
    int *traj, *keep;
    float *row;
    sim_head_t *heads;
    attn_fn_t attn;
    void *ctx;
    int over_traj, off_traj, bad_keep, last_flags_any, compactions;
    int *flags; /* last step_end result per head */
} sim_t;

static int sim_init(sim_t *m, const kv_policy_params_t *p, const kv_geometry_t *g, attn_fn_t attn,
                    void *ctx) {
    memset(m, 0, sizeof *m);
    m->p = *p;
    m->g = *g;
    m->steps = kv_geometry_steps(g);
    m->cap = g->n_prompt + m->steps;
    m->n_heads_total = g->n_layers * g->n_heads;
    m->exact = kv_policy_plan_exact(p->kind);
    m->attn = attn;
    m->ctx = ctx;
    ar_error_t err;
    m->s = kv_policy_begin(p, g, &err);
    if (!m->s)
        return AR_ERR;
    m->traj = calloc((size_t)m->steps, sizeof *m->traj);
    m->keep = calloc((size_t)m->cap, sizeof *m->keep);
    m->row = calloc((size_t)m->cap, sizeof *m->row);
    m->heads = calloc((size_t)m->n_heads_total, sizeof *m->heads);
    m->flags = calloc((size_t)m->n_heads_total, sizeof *m->flags);
    if (!m->traj || !m->keep || !m->row || !m->heads || !m->flags)
        return AR_ERR;
    if (kv_policy_trajectory(p, g, m->traj, NULL, NULL) != AR_OK)
        return AR_ERR;
    for (int i = 0; i < m->n_heads_total; i++) {
        sim_head_t *h = &m->heads[i];
        h->ids = calloc((size_t)m->cap, sizeof *h->ids);
        h->mass = calloc((size_t)m->cap, sizeof *h->mass);
        h->oracle = calloc((size_t)m->cap, sizeof *h->oracle);
        if (!h->ids || !h->mass || !h->oracle)
            return AR_ERR;
        h->oracle_line = -1;
    }
    return AR_OK;
}

static void sim_free(sim_t *m) {
    kv_policy_end(m->s);
    if (m->heads)
        for (int i = 0; i < m->n_heads_total; i++) {
            free(m->heads[i].ids);
            free(m->heads[i].mass);
            free(m->heads[i].oracle);
        }
    free(m->heads);
    free(m->flags);
    free(m->traj);
    free(m->keep);
    free(m->row);
}

/* sim_init, or a recorded failure (and nothing left allocated). */
static int sim_start(sim_t *m, const kv_policy_params_t *p, const kv_geometry_t *g, attn_fn_t attn,
                     void *ctx) {
    if (sim_init(m, p, g, attn, ctx) == AR_OK)
        return 1;
    CHECK_MSG(0, "sim_init failed for %s", kv_policy_name(p->kind));
    sim_free(m);
    return 0;
}

static sim_head_t *sim_head(sim_t *m, int layer, int head) {
    return &m->heads[layer * m->g.n_heads + head];
}

/* Step t's forward: the append (prompt at step 0, image token t-1 after),
 * then, when the policy asks, the softmax row of the step's query added to
 * each head's key mass. The oracle always accumulates the current image
 * line's queries, whatever the policy asked for. */
static void sim_forward(sim_t *m, int t) {
    int collect = kv_policy_collect(m->s, t);
    for (int L = 0; L < m->g.n_layers; L++)
        for (int H = 0; H < m->g.n_heads; H++) {
            sim_head_t *h = sim_head(m, L, H);
            if (t == 0) {
                for (int i = 0; i < m->g.n_prompt; i++)
                    h->ids[i] = i;
                h->len = m->g.n_prompt;
            } else {
                h->ids[h->len] = m->g.n_prompt + t - 1;
                h->mass[h->len] = 0;
                h->len++;
            }
            if (h->len > m->traj[t])
                m->over_traj++;
            if (m->exact && h->len != m->traj[t])
                m->off_traj++;
            if (t == 0)
                continue;
            m->attn(m->ctx, L, H, t, h->ids, h->len, m->row);
            double sum = 0;
            for (int i = 0; i < h->len; i++)
                sum += m->row[i];
            for (int i = 0; i < h->len; i++)
                m->row[i] = (float)(m->row[i] / sum);
            if (collect) {
                for (int i = 0; i < h->len; i++)
                    h->mass[i] += m->row[i];
                h->has_mass = 1;
            }
            int line = (t - 1) / m->g.segment_tokens[0];
            if (line != h->oracle_line) {
                memset(h->oracle, 0, (size_t)m->cap * sizeof *h->oracle);
                h->oracle_line = line;
            }
            for (int i = 0; i < h->len; i++)
                h->oracle[h->ids[i]] += m->row[i];
        }
}

/* Step t's end: ask the policy for every head, check the keep list, apply
 * it to ids and mass, reset the mass when asked. */
static void sim_compact(sim_t *m, int t) {
    m->last_flags_any = 0;
    for (int L = 0; L < m->g.n_layers; L++)
        for (int H = 0; H < m->g.n_heads; H++) {
            sim_head_t *h = sim_head(m, L, H);
            int n_keep = -1;
            int f = kv_policy_step_end(m->s, t, L, H, h->len, h->has_mass ? h->mass : NULL, m->keep,
                                       &n_keep);
            m->flags[L * m->g.n_heads + H] = f;
            m->last_flags_any |= f;
            if (f & KV_COMPACT) {
                int ok = n_keep >= m->g.n_prompt && n_keep <= h->len;
                for (int i = 0; ok && i < n_keep; i++) {
                    ok = m->keep[i] >= 0 && m->keep[i] < h->len &&
                         (i == 0 || m->keep[i - 1] < m->keep[i]);
                    if (i < m->g.n_prompt)
                        ok = ok && m->keep[i] == i;
                }
                if (!ok) {
                    m->bad_keep++;
                    continue;
                }
                for (int i = 0; i < n_keep; i++) {
                    h->ids[i] = h->ids[m->keep[i]];
                    h->mass[i] = h->mass[m->keep[i]];
                }
                h->len = n_keep;
                m->compactions++;
            }
            if (f & KV_RESET_MASS) {
                memset(h->mass, 0, (size_t)h->len * sizeof *h->mass);
                h->has_mass = 0;
            }
        }
}

/* Runs every step; returns 1 if the policy compacted at the last step,
 * which it never should (the sequence is released right after). */
static int sim_run(sim_t *m) {
    for (int t = 0; t < m->steps; t++) {
        sim_forward(m, t);
        sim_compact(m, t);
    }
    return (m->last_flags_any & KV_COMPACT) != 0;
}

static int has_id(const sim_head_t *h, int id) {
    for (int i = 0; i < h->len; i++)
        if (h->ids[i] == id)
            return 1;
    return 0;
}

/* ---- attention generators ---- */

static void attn_uniform(void *ctx, int layer, int head, int step, const int *ids, int len,
                         float *w) {
    for (int i = 0; i < len; i++)
        w[i] = 1.0f;
}

/* Fresh random weights for every (query step, key id, head). */
typedef struct random_attn {
    uint64_t seed;
} random_attn_t;

static void attn_random(void *ctx, int layer, int head, int step, const int *ids, int len,
                        float *w) {
    const random_attn_t *r = ctx;
    int kind = (int)(mix64(r->seed ^ (uint64_t)(layer * 131 + head)) % 3);
    for (int i = 0; i < len; i++) {
        double u =
            hash01(r->seed, (uint64_t)step * 7919 + (uint64_t)layer * 31 + head, (uint64_t)ids[i]);
        if (kind == 0) /* local: the last three keys carry almost everything */
            w[i] = (float)(i >= len - 3 ? 100.0 + u : 0.01 * u);
        else if (kind == 1) /* spread */
            w[i] = (float)(0.05 + u);
        else /* condition-heavy */
            w[i] = (float)(ids[i] < 2 ? 50.0 : 0.05 + u);
    }
}

/* ---- tests ---- */

/* A raster request: h lines of w tokens, one token per step. */
static kv_geometry_t geom(int n_prompt, int w, int h, int layers, int heads) {
    kv_geometry_t g;
    kv_geometry_uniform(&g, n_prompt, KV_STEP_TOKEN, h, w, layers, heads);
    return g;
}

static void test_parse_names_and_defaults(void) {
    CHECK(kv_policy_parse("full") == KV_POLICY_FULL);
    CHECK(kv_policy_parse("streaming") == KV_POLICY_STREAMING);
    CHECK(kv_policy_parse("linear") == KV_POLICY_LINEAR);
    CHECK(kv_policy_parse("headkv") == KV_POLICY_HEADKV);
    CHECK(kv_policy_parse("LINEAR") == -1 && kv_policy_parse("h2o") == -1);
    CHECK(kv_policy_parse(NULL) == -1);
    for (int k = KV_POLICY_FULL; k <= KV_POLICY_HEADKV; k++)
        CHECK(kv_policy_parse(kv_policy_name((kv_policy_kind_t)k)) == k);

    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_FULL);
    CHECK(p.kind == KV_POLICY_FULL && p.budget == 1.0);
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    CHECK_NEAR(p.budget, 1.0 / 6, 1e-12, 0);
    CHECK(p.sink_tokens == 4);
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    CHECK_NEAR(p.budget, 1.0 / 6, 1e-12, 0);
    CHECK(p.anchor_lines == 1 && p.recent_lines == 2);
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    CHECK_NEAR(p.budget, 1.0 / 8, 1e-12, 0);
    CHECK_NEAR(p.headkv_threshold, 0.9, 1e-12, 0);
    CHECK_NEAR(p.headkv_alpha, 0.5, 1e-12, 0);
    CHECK(p.headkv_recent_lines == 2 && p.headkv_group_tokens == 100);
    CHECK(p.headkv_buffer == 8 && p.headkv_local_window == 32);

    /* The defaults hold on Janus-Pro's geometry (24 x 24) at the papers'
     * default budgets; LineAR's 1 + 2 lines do not fit in 1/8 of 24 lines. */
    kv_geometry_t janus = geom(40, 24, 24, 24, 16);
    for (int k = KV_POLICY_FULL; k <= KV_POLICY_HEADKV; k++) {
        kv_policy_defaults(&p, (kv_policy_kind_t)k);
        CHECK_MSG(kv_policy_check(&p, &janus, NULL, NULL) == AR_OK, "%s", kv_policy_name(p.kind));
    }
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 1.0 / 8;
    CHECK(kv_policy_check(&p, &janus, NULL, NULL) == AR_ERR);
}

static void test_full_keeps_everything(void) {
    kv_geometry_t g = geom(7, 5, 4, 2, 3);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_FULL);
    int traj[20];
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 20; t++)
        CHECK(traj[t] == 7 + t);
    sim_t m;
    if (!sim_start(&m, &p, &g, attn_uniform, NULL))
        return;
    for (int t = 0; t < m.steps; t++) {
        CHECK(!kv_policy_collect(m.s, t));
        sim_forward(&m, t);
        sim_compact(&m, t);
        CHECK(m.last_flags_any == 0);
    }
    CHECK(m.off_traj == 0 && m.over_traj == 0);
    CHECK(sim_head(&m, 1, 2)->len == 7 + 19); /* prompt + w*h - 1 image tokens */
    sim_free(&m);
}

static void test_streaming_trajectory_exact(void) {
    /* N = 5 + 20 - 1 = 24 tokens; budget 1/2 caps a head at 12. */
    kv_geometry_t g = geom(5, 4, 5, 1, 1);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.budget = 0.5;
    p.sink_tokens = 2;
    int traj[20];
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 20; t++)
        CHECK(traj[t] == (5 + t < 12 ? 5 + t : 12));
    /* budget 1 never evicts: the full trajectory */
    p.budget = 1.0;
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 20; t++)
        CHECK(traj[t] == 5 + t);
}

static void test_streaming_keeps_prefix_sinks_window(void) {
    kv_geometry_t g = geom(5, 4, 5, 2, 2);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.budget = 0.5; /* cap 12 = 5 prefix + 2 sinks + a window of 5 */
    p.sink_tokens = 2;
    sim_t m;
    if (!sim_start(&m, &p, &g, attn_uniform, NULL))
        return;
    for (int t = 0; t < m.steps; t++) {
        CHECK(!kv_policy_collect(m.s, t));
        sim_forward(&m, t);
        /* During step t the query sees prefix, sinks and the 5 newest. */
        const sim_head_t *h = sim_head(&m, 1, 0);
        int expect[12], n = 0;
        for (int i = 0; i < 5; i++)
            expect[n++] = i;
        for (int j = 0; j < t; j++)
            if (j < 2 || j >= t - 5)
                expect[n++] = 5 + j;
        CHECK(h->len == n);
        for (int i = 0; i < n && i < h->len; i++)
            CHECK(h->ids[i] == expect[i]);
        sim_compact(&m, t);
    }
    CHECK(m.off_traj == 0 && m.over_traj == 0 && m.bad_keep == 0);
    sim_free(&m);
}

static void test_linear_trajectory_and_schedule(void) {
    /* 8 lines of 4; budget 1/2 = 4 lines: B = 16 image tokens, prefix 3 on top. */
    kv_geometry_t g = geom(3, 4, 8, 1, 2);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 0.5;
    int traj[32];
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 32; t++) {
        int v = t <= 16 ? t : 16 - 4 + (t - 17) % 4 + 1;
        CHECK_MSG(traj[t] == 3 + v, "t=%d traj %d expected %d", t, traj[t], 3 + v);
    }
    sim_t m;
    if (!sim_start(&m, &p, &g, attn_uniform, NULL))
        return;
    for (int t = 0; t < m.steps; t++) {
        /* the guide queues of lines 4..7 (1-based), whose ends compress */
        CHECK_MSG(kv_policy_collect(m.s, t) == (t >= 13 && t <= 28), "t=%d", t);
        sim_forward(&m, t);
        sim_compact(&m, t);
        int f = m.flags[0];
        int compress = t == 16 || t == 20 || t == 24 || t == 28;
        CHECK_MSG(!!(f & KV_COMPACT) == compress, "t=%d flags %d", t, f);
        CHECK_MSG(!!(f & KV_RESET_MASS) == (compress || t == 12), "t=%d flags %d", t, f);
    }
    CHECK(m.off_traj == 0 && m.over_traj == 0 && m.bad_keep == 0);
    sim_free(&m);

    /* budget 1: never compresses, never collects */
    p.budget = 1.0;
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 32; t++)
        CHECK(traj[t] == 3 + t);
    kv_policy_state_t *s = kv_policy_begin(&p, &g, NULL);
    CHECK(s != NULL);
    for (int t = 0; s && t < 32; t++)
        CHECK(!kv_policy_collect(s, t));
    kv_policy_end(s);
}

/* Image token j of line 1..3 gets a low weight when j is in low[]. */
typedef struct chosen_attn {
    int n_prompt, low[4];
} chosen_attn_t;

static void attn_chosen(void *ctx, int layer, int head, int step, const int *ids, int len,
                        float *w) {
    const chosen_attn_t *c = ctx;
    for (int i = 0; i < len; i++) {
        int j = ids[i] - c->n_prompt;
        w[i] = 1.0f + 0.01f * (float)(i % 7);
        for (int k = 0; k < 4; k++)
            if (j == c->low[k])
                w[i] = 0.1f + 0.01f * (float)k;
    }
}

static void test_linear_evicts_chosen_mid_tokens(void) {
    /* 10 lines of 4, budget 0.6 = 6 lines: at the end of line 6 (step 24)
     * the mid region is lines 2-4 (image tokens 4..15); the four with low
     * attention go, whatever their position. */
    kv_geometry_t g = geom(3, 4, 10, 1, 1);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 0.6;
    chosen_attn_t c = {3, {5, 8, 13, 15}};
    sim_t m;
    if (!sim_start(&m, &p, &g, attn_chosen, &c))
        return;
    for (int t = 0; t <= 24; t++) {
        sim_forward(&m, t);
        sim_compact(&m, t);
    }
    const sim_head_t *h = sim_head(&m, 0, 0);
    CHECK(h->len == 3 + 20);
    for (int j = 0; j < 24; j++) {
        int low = j == 5 || j == 8 || j == 13 || j == 15;
        CHECK_MSG(has_id(h, 3 + j) == !low, "image token %d", j);
    }
    for (int i = 0; i < 3; i++)
        CHECK(h->ids[i] == i);
    sim_free(&m);
}

/* Saliency that depends on every query: fresh random weights per (query,
 * key), the prefix heavy, so only the sum over exactly the line's queries
 * ranks the mid tokens the way the oracle does. */
static void attn_per_query(void *ctx, int layer, int head, int step, const int *ids, int len,
                           float *w) {
    const random_attn_t *r = ctx;
    for (int i = 0; i < len; i++)
        w[i] = ids[i] < 3
                   ? 8.0f
                   : (float)(0.2 + hash01(r->seed, (uint64_t)step * 977 + head, (uint64_t)ids[i]));
}

static void test_linear_evicts_lowest_line_saliency(void) {
    for (int variant = 0; variant < 3; variant++) {
        int anchors = variant, recent = 2 - variant / 2;
        kv_geometry_t g = geom(3, 6, 14, 2, 2);
        kv_policy_params_t p;
        kv_policy_defaults(&p, KV_POLICY_LINEAR);
        p.budget = 7.0 / 14; /* 7 lines */
        p.anchor_lines = anchors;
        p.recent_lines = recent;
        random_attn_t r = {(uint64_t)variant + 11};
        sim_t m;
        if (!sim_start(&m, &p, &g, attn_per_query, &r))
            return;
        int line_ends = 0, mismatches = 0, protected_lost = 0;
        for (int t = 0; t < m.steps; t++) {
            sim_forward(&m, t);
            int compress = t % 6 == 0 && t / 6 >= 7 && t / 6 <= 13;
            int before_len[4];
            int expect_evict[4][6], n_expect = 6;
            for (int hh = 0; hh < 4 && compress; hh++) {
                const sim_head_t *h = &m.heads[hh];
                before_len[hh] = h->len;
                /* oracle: the 6 mid tokens with the least mass from this
                 * line's 6 queries (ties cannot happen with these weights) */
                int first = 3 + anchors * 6, last = h->len - recent * 6;
                for (int e = 0; e < n_expect; e++) {
                    int best = -1;
                    for (int i = first; i < last; i++) {
                        int taken = 0;
                        for (int q = 0; q < e; q++)
                            taken |= expect_evict[hh][q] == h->ids[i];
                        if (taken)
                            continue;
                        if (best < 0 || h->oracle[h->ids[i]] < h->oracle[h->ids[best]])
                            best = i;
                    }
                    expect_evict[hh][e] = h->ids[best];
                }
            }
            sim_compact(&m, t);
            for (int hh = 0; hh < 4 && compress; hh++) {
                const sim_head_t *h = &m.heads[hh];
                line_ends++;
                if (h->len != before_len[hh] - 6)
                    mismatches++;
                for (int e = 0; e < n_expect; e++)
                    if (has_id(h, expect_evict[hh][e]))
                        mismatches++;
                /* prefix, anchors and the recent lines are all there */
                for (int i = 0; i < 3 + anchors * 6; i++)
                    if (h->ids[i] != i)
                        protected_lost++;
                for (int j = t - recent * 6; j < t; j++)
                    if (!has_id(h, 3 + j))
                        protected_lost++;
            }
        }
        CHECK(line_ends == 4 * 7);
        CHECK_MSG(mismatches == 0, "variant %d: %d mismatches", variant, mismatches);
        CHECK(protected_lost == 0);
        CHECK(m.off_traj == 0 && m.over_traj == 0 && m.bad_keep == 0);
        sim_free(&m);
    }
}

static void test_linear_without_mass_evicts_oldest(void) {
    /* No statistics (an engine that did not collect): the oldest mid
     * tokens go, deterministically. */
    kv_geometry_t g = geom(2, 4, 8, 1, 1);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 5.0 / 8;
    kv_policy_state_t *s = kv_policy_begin(&p, &g, NULL);
    CHECK(s != NULL);
    if (!s)
        return;
    int keep[64], n_keep = 0;
    int f = kv_policy_step_end(s, 20, 0, 0, 22, NULL, keep, &n_keep);
    CHECK(f == (KV_COMPACT | KV_RESET_MASS));
    CHECK(n_keep == 18);
    /* prefix 0-1, anchor line 2-5, mid 6-13 loses 6-9, recent 14-21 */
    for (int i = 0; i < 6; i++)
        CHECK(keep[i] == i);
    for (int i = 6; i < 18; i++)
        CHECK(keep[i] == i + 4);
    kv_policy_end(s);
}

/* Rows built to classify: head 0 local (last three keys), head 1 spread,
 * head 2 mostly on the condition, head 3 85% on the last five keys, head 4
 * 95% on the last six (exactly the local window: not fewer, so global). */
static void attn_heads(void *ctx, int layer, int head, int step, const int *ids, int len,
                       float *w) {
    for (int i = 0; i < len; i++) {
        int back = len - 1 - i;
        switch (head) {
        case 0:
            w[i] = back < 3 ? 0.95f / 3 : 0.05f / (float)(len - 3);
            break;
        case 1:
            w[i] = 1.0f;
            break;
        case 2:
            w[i] = ids[i] < 4 ? 0.6f / 4 : (back < 3 ? 0.4f / 3 : 0.0f);
            break;
        case 3:
            w[i] = back < 5 ? 0.85f / 5 : 0.15f / (float)(len - 5);
            break;
        default:
            w[i] = back < 6 ? 0.95f / 6 : 0.05f / (float)(len - 6);
            break;
        }
    }
}

static void test_headkv_classifies_heads(void) {
    /* 8 lines of 8, budget 3/4: G = 48, G - buffer = 44; grouping at 20. */
    kv_geometry_t g = geom(4, 8, 8, 2, 5);
    for (int pass = 0; pass < 2; pass++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, KV_POLICY_HEADKV);
        p.budget = 0.75;
        p.headkv_buffer = 4;
        p.headkv_local_window = 6;
        p.headkv_group_tokens = 20;
        p.headkv_threshold = pass == 0 ? 0.9 : 0.8;
        sim_t m;
        if (!sim_start(&m, &p, &g, attn_heads, NULL))
            return;
        for (int t = 0; t <= 20; t++) {
            sim_forward(&m, t);
            sim_compact(&m, t);
        }
        for (int L = 0; L < 2; L++) {
            /* local heads: condition + the 6 newest; global heads keep all */
            CHECK(sim_head(&m, L, 0)->len == 4 + 6);
            CHECK(sim_head(&m, L, 1)->len == 4 + 20);
            CHECK(sim_head(&m, L, 2)->len == 4 + 20);
            /* 85% on the last five: local under 0.8, global under 0.9 */
            CHECK(sim_head(&m, L, 3)->len == (pass == 0 ? 4 + 20 : 4 + 6));
            CHECK(sim_head(&m, L, 4)->len == 4 + 20);
            const sim_head_t *h = sim_head(&m, L, 0);
            for (int i = 0; i < 4; i++)
                CHECK(h->ids[i] == i);
            for (int i = 0; i < 6; i++)
                CHECK(h->ids[4 + i] == 4 + 14 + i);
        }
        /* The classification sticks: local heads slide, global heads fill
         * up to G and then stay within it. */
        int local_max = 0, global_max = 0;
        for (int t = 21; t < m.steps; t++) {
            sim_forward(&m, t);
            if (sim_head(&m, 0, 0)->len > local_max)
                local_max = sim_head(&m, 0, 0)->len;
            if (sim_head(&m, 0, 1)->len > global_max)
                global_max = sim_head(&m, 0, 1)->len;
            sim_compact(&m, t);
        }
        CHECK(local_max == 4 + 6 + 4);
        CHECK(global_max == 4 + 48);
        CHECK(m.over_traj == 0 && m.bad_keep == 0);
        sim_free(&m);
    }
}

static void test_headkv_collect_schedule(void) {
    kv_geometry_t g = geom(4, 8, 8, 1, 1);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.budget = 0.75; /* G = 48: updates at 24, 28, ... evict from 48 on */
    p.headkv_buffer = 4;
    p.headkv_local_window = 6;
    p.headkv_group_tokens = 20;
    kv_policy_state_t *s = kv_policy_begin(&p, &g, NULL);
    CHECK(s != NULL);
    for (int t = 0; s && t < 64; t++)
        CHECK_MSG(kv_policy_collect(s, t) == (t == 20 || (t >= 45 && t <= 60)), "t=%d", t);
    kv_policy_end(s);
    int traj[64];
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 64; t++) {
        int v = t <= 48 ? t : 44 + (t - 49) % 4 + 1;
        CHECK_MSG(traj[t] == 4 + v, "t=%d traj %d expected %d", t, traj[t], 4 + v);
    }
}

/* Step 28 of test_ste: image token j (a candidate when j < 20) scores
 * 10 + j/10 near (j >= 10) and 1 + ((7j) mod 10)/10 long range. */
static void attn_ste(void *ctx, int layer, int head, int step, const int *ids, int len, float *w) {
    for (int i = 0; i < len; i++) {
        int j = ids[i] - 2;
        if (j < 0)
            w[i] = 5.0f;
        else if (j >= 20)
            w[i] = 3.0f;
        else if (j >= 10)
            w[i] = 10.0f + (float)j / 10;
        else
            w[i] = 1.0f + (float)((7 * j) % 10) / 10;
    }
}

static void test_ste_keeps_long_range_tokens(void) {
    /* 16 lines of 4, G = 24 image tokens, recent 2 lines (8), buffer 4:
     * at grouping (step 28) 20 historical candidates keep H = 12. */
    kv_geometry_t g = geom(2, 4, 16, 1, 1);
    for (int pass = 0; pass < 2; pass++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, KV_POLICY_HEADKV);
        p.budget = 24.0 / 64;
        p.headkv_buffer = 4;
        p.headkv_local_window = 4;
        p.headkv_group_tokens = 28;
        p.headkv_alpha = pass == 0 ? 0.5 : 0.0;
        sim_t m;
        if (!sim_start(&m, &p, &g, attn_ste, NULL))
            return;
        for (int t = 0; t <= 28; t++) {
            sim_forward(&m, t);
            sim_compact(&m, t);
        }
        const sim_head_t *h = sim_head(&m, 0, 0);
        CHECK(h->len == 2 + 20);
        /* A global top-12 over the 20 candidates: all 10 near-range tokens
         * and the two best long-range ones (scores 1.9 and 1.8: j = 7, 4). */
        int topk_long[10] = {0};
        topk_long[7] = topk_long[4] = 1;
        int kept_long = 0, kept_near = 0, only_ste = 0;
        for (int j = 0; j < 20; j++) {
            int kept = has_id(h, 2 + j);
            if (j < 10)
                kept_long += kept;
            if (j >= 10)
                kept_near += kept;
            if (j < 10 && kept && !topk_long[j])
                only_ste++;
        }
        if (pass == 0) {
            /* alpha 1/2: 6 of 10 per range; the long range keeps its own
             * best six (scores 1.9 .. 1.4: j = 7, 4, 1, 8, 5, 2) */
            CHECK(kept_long == 6 && kept_near == 6);
            CHECK(only_ste == 4);
            int best_long[6] = {7, 4, 1, 8, 5, 2};
            for (int k = 0; k < 6; k++)
                CHECK(has_id(h, 2 + best_long[k]));
            for (int j = 14; j < 20; j++)
                CHECK(has_id(h, 2 + j)); /* best near */
        } else {
            /* alpha 0: one stratum, which is exactly the global top-k */
            CHECK(kept_long == 2 && kept_near == 10 && only_ste == 0);
        }
        for (int j = 20; j < 28; j++)
            CHECK(has_id(h, 2 + j)); /* recent window */
        CHECK(m.over_traj == 0 && m.bad_keep == 0);
        sim_free(&m);
    }
}

/* STE splits the L historical tokens into the older long range and the
 * newer near range of round(alpha * L) tokens, half up (docs/kv-policies.md):
 * with alpha 1/2 and L = 5 the near range is the newest 3, not 2 (floor, or
 * rounding half to even, would make it 2). Each range keeps its best by
 * score, so where the boundary falls decides which tokens survive. */
static void test_ste_near_range_rounds_half_up(void) {
    /* 4 x 4, prefix 2; G = 3, buffer 1, no recent lines: grouping at step 5
     * sees V = 5 historical tokens and keeps H = 2, one per range. */
    kv_geometry_t g = geom(2, 4, 4, 1, 1);
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.budget = 3.0 / 16;
    p.headkv_buffer = 1;
    p.headkv_recent_lines = 0;
    p.headkv_local_window = 0; /* never local: the head stays global */
    p.headkv_group_tokens = 5;
    p.headkv_alpha = 0.5;
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(&p, &g, &err);
    CHECK_MSG(s != NULL, "%s", err.msg);
    if (!s)
        return;
    /* image tokens 0..4 score 5, 1, 10, 3, 0: long range {0, 1} keeps 0,
     * near range {2, 3, 4} keeps 2 (with a near range of 2: 2 and 3). */
    const float mass[7] = {0, 0, 5, 1, 10, 3, 0};
    int keep[7], n_keep = -1;
    const int what = kv_policy_step_end(s, 5, 0, 0, 7, mass, keep, &n_keep);
    CHECK(what == (KV_COMPACT | KV_RESET_MASS));
    CHECK_MSG(n_keep == 4, "kept %d", n_keep);
    const int want[4] = {0, 1, 2 + 0, 2 + 2};
    for (int i = 0; i < 4 && n_keep == 4; i++)
        CHECK_MSG(keep[i] == want[i], "keep[%d] = %d, expected %d", i, keep[i], want[i]);
    kv_policy_end(s);
}

static void random_params(rng_t *r, kv_policy_params_t *p, kv_geometry_t *g) {
    *g = geom(rng_int(r, 1, 12), rng_int(r, 1, 10), rng_int(r, 1, 12), rng_int(r, 1, 2),
              rng_int(r, 1, 3));
    kv_policy_defaults(p, (kv_policy_kind_t)rng_int(r, 0, 3));
    p->budget = rng_int(r, 0, 3) == 0 ? 1.0 : 0.05 + 0.95 * rng_unit(r);
    p->sink_tokens = rng_int(r, 0, 6);
    p->anchor_lines = rng_int(r, 0, 2);
    p->recent_lines = rng_int(r, 0, 3);
    p->headkv_threshold = 0.5 + 0.5 * rng_unit(r);
    p->headkv_alpha = rng_unit(r);
    p->headkv_buffer = rng_int(r, 1, 12);
    p->headkv_local_window = rng_int(r, 0, 16);
    p->headkv_recent_lines = rng_int(r, 0, 3);
    p->headkv_group_tokens = rng_int(r, 1, 80);
}

static void test_trajectory_bounds_random_runs(void) {
    int valid[4] = {0}, compacted[4] = {0}, over = 0, off = 0, bad = 0, late = 0;
    for (uint64_t seed = 1; seed <= 3000; seed++) {
        rng_t r = {seed};
        kv_policy_params_t p;
        kv_geometry_t g;
        random_params(&r, &p, &g);
        if (kv_policy_check(&p, &g, NULL, NULL) != AR_OK) {
            int traj[1];
            CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_ERR);
            continue;
        }
        valid[p.kind]++;
        random_attn_t a = {seed};
        sim_t m;
        if (!sim_start(&m, &p, &g, attn_random, &a))
            continue;
        late += sim_run(&m);
        compacted[p.kind] += m.compactions > 0;
        if (m.over_traj || m.off_traj || m.bad_keep)
            fprintf(stderr, "  seed %llu %s: over %d off %d bad %d\n", (unsigned long long)seed,
                    kv_policy_name(p.kind), m.over_traj, m.off_traj, m.bad_keep);
        over += m.over_traj;
        off += m.off_traj;
        bad += m.bad_keep;
        sim_free(&m);
    }
    CHECK(over == 0 && off == 0 && bad == 0 && late == 0);
    if (getenv("KVP_VERBOSE"))
        for (int k = 0; k < 4; k++)
            fprintf(stderr, "  %s: %d valid, %d compacted\n", kv_policy_name(k), valid[k],
                    compacted[k]);
    for (int k = 0; k < 4; k++)
        CHECK_MSG(valid[k] >= 100, "%s: %d valid", kv_policy_name(k), valid[k]);
    for (int k = 1; k < 4; k++)
        CHECK_MSG(compacted[k] >= 50, "%s: %d runs compacted", kv_policy_name(k), compacted[k]);
}

/* The least budget a policy takes: LineAR needs anchor + recent + the line
 * being made, so 4 of 16 lines; HeadKV needs 2 recent lines and its buffer,
 * 40 of 256 tokens; full takes no budget; a knob that fails at any budget
 * leaves none. */
static void test_min_budget(void) {
    kv_geometry_t demo = geom(20, 16, 16, 4, 4), scale = demo;
    scale.step_unit = KV_STEP_SEGMENT;
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    CHECK_NEAR(kv_policy_min_budget(&p, &demo), 0.25, 1e-12, 0);
    p.budget = 0.25;
    CHECK(kv_policy_check(&p, &demo, NULL, NULL) == AR_OK);
    p.budget = 0.2499;
    CHECK(kv_policy_check(&p, &demo, NULL, NULL) == AR_ERR);
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    CHECK_NEAR(kv_policy_min_budget(&p, &demo), 0.1563, 1e-12, 0); /* 40/256 = 0.15625, up */
    kv_policy_defaults(&p, KV_POLICY_FULL);
    CHECK(kv_policy_min_budget(&p, &demo) == 0);
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.anchor_lines = -1;
    CHECK(kv_policy_min_budget(&p, &demo) == -1);
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    CHECK(kv_policy_min_budget(&p, &scale) == -1);
}

static void test_validate_messages(void) {
    kv_geometry_t janus = geom(40, 24, 24, 24, 16), demo = geom(20, 16, 16, 4, 4);
    kv_policy_params_t p;
    ar_error_t err;
    int traj[576];

    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 0;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "budget must be in (0, 1]");
    p.budget = 1.5;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "1.5");
    p.budget = NAN;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "budget");
    CHECK(kv_policy_trajectory(&p, &janus, traj, NULL, NULL) == AR_ERR);
    CHECK(kv_policy_begin(&p, &janus, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "budget");

    kv_policy_defaults(&p, KV_POLICY_FULL);
    p.budget = 7; /* full ignores the budget */
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_OK);

    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.anchor_lines = -1;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "anchor_lines");
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.recent_lines = -2;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "recent_lines");
    /* 1/8 of 24 lines is 3; anchors 1 + recent 2 + the line being made = 4 */
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 1.0 / 8;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "budget");
    CHECK_STR_CONTAINS(err.msg, "4 lines");
    CHECK_STR_CONTAINS(err.msg, "4/24");
    /* on a 16 x 16 grid the defaults need 1/4 */
    p.budget = 1.0 / 6;
    CHECK(kv_policy_check(&p, &demo, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "4/16");
    p.budget = 0.25;
    CHECK(kv_policy_check(&p, &demo, NULL, &err) == AR_OK);

    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.sink_tokens = -1;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "sink_tokens");
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.budget = 0.05; /* 30 of 615 < 40 + 4 + 1 */
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "budget");
    CHECK_STR_CONTAINS(err.msg, "45/615");

    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.budget = 1.0 / 8; /* demo: 32 image tokens < 2 lines (32) + buffer 8 */
    CHECK(kv_policy_check(&p, &demo, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_buffer");
    CHECK_STR_CONTAINS(err.msg, "40/256");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_local_window = 65; /* janus 1/8: G - buffer = 64 */
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_local_window");
    CHECK_STR_CONTAINS(err.msg, "64");
    p.headkv_local_window = 64;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_OK);

    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_threshold = 0;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_threshold");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_alpha = 1.5;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_alpha");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_buffer = 0;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_buffer");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_local_window = -1;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_local_window");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_recent_lines = -1;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_recent_lines");
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_group_tokens = 0;
    CHECK(kv_policy_check(&p, &janus, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "headkv_group_tokens");

    kv_geometry_t bad_g = geom(40, 0, 24, 24, 16);
    kv_policy_defaults(&p, KV_POLICY_FULL);
    CHECK(kv_policy_check(&p, &bad_g, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "segment 0");
    bad_g = geom(0, 24, 24, 24, 16);
    CHECK(kv_policy_check(&p, &bad_g, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "n_prompt");
}

/* The knob table describes kv_policy_params_t: names, defaults, ranges;
 * kv_policy_check names the setting at fault. */
static void test_knob_table_and_check_fields(void) {
    kv_geometry_t janus = geom(40, 24, 24, 24, 16), demo = geom(20, 16, 16, 4, 4);
    kv_policy_params_t p;
    ar_error_t err;
    const char *field = "unset";
    CHECK(KV_POLICY_N_KNOBS == 15);
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        CHECK(kv_policy_knob_find(k->name) == k);
        kv_policy_defaults(&p, kv_policy_knob_owner(k));
        CHECK_MSG(kv_policy_knob_get(&p, k) == k->def, "%s", k->name);
        CHECK_MSG(kv_policy_knob_ok(k, k->def) && kv_policy_knob_ok(k, k->hi), "%s", k->name);
        CHECK_MSG(!kv_policy_knob_ok(k, k->hi + 1) && !kv_policy_knob_ok(k, NAN), "%s", k->name);
        CHECK_MSG(kv_policy_knob_ok(k, k->lo) == !k->lo_open, "%s", k->name);
        CHECK_MSG(!kv_policy_knob_ok(k, k->lo - 1), "%s", k->name);
        CHECK_MSG(kv_policy_knob_ok(k, k->def + 0.5) == (k->type == KV_KNOB_REAL) ||
                      k->def + 0.5 > k->hi,
                  "%s", k->name);
        /* Out of range: validate names the knob, of its own policy only. */
        kv_policy_knob_set(&p, k, k->hi + 1);
        CHECK(kv_policy_check(&p, &janus, &field, &err) == AR_ERR);
        CHECK_MSG(field && !strcmp(field, k->name), "%s: %s", k->name, field ? field : "NULL");
        CHECK_STR_CONTAINS(err.msg, k->name);
        /* another compressing policy, one that runs on raster models */
        int other = KV_POLICY_STREAMING;
        while (kv_policy_knob_of(k, (kv_policy_kind_t)other))
            other++;
        CHECK(other <= KV_POLICY_HEADKV);
        kv_policy_defaults(&p, (kv_policy_kind_t)other);
        kv_policy_knob_set(&p, k, k->hi + 1);
        CHECK_MSG(kv_policy_check(&p, &janus, &field, &err) == AR_OK, "%s under %s: %s", k->name,
                  kv_policy_name((kv_policy_kind_t)other), err.msg);
    }
    CHECK(kv_policy_knob_find("budget") == NULL && kv_policy_knob_find(NULL) == NULL);
    char buf[96];
    kv_policy_knob_describe(kv_policy_knob_find("headkv_threshold"), buf, sizeof buf);
    CHECK(!strcmp(buf, "a number greater than 0 and at most 1"));
    kv_policy_knob_describe(kv_policy_knob_find("anchor_lines"), buf, sizeof buf);
    CHECK(!strcmp(buf, "an integer from 0 to 4096"));

    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 1.0 / 8;
    CHECK(kv_policy_check(&p, &demo, &field, &err) == AR_ERR && field && !strcmp(field, "budget"));
    p.anchor_lines = 0;
    p.recent_lines = 1; /* 2 lines: 0 anchors + 1 recent + the line being made */
    CHECK(kv_policy_check(&p, &demo, &field, &err) == AR_OK && field == NULL);
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.headkv_local_window = 65;
    CHECK(kv_policy_check(&p, &janus, &field, &err) == AR_ERR && field &&
          !strcmp(field, "headkv_local_window"));
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    p.budget = 0;
    CHECK(kv_policy_check(&p, &janus, &field, &err) == AR_ERR && field && !strcmp(field, "budget"));
    kv_geometry_t bad_g = geom(40, 0, 24, 24, 16);
    CHECK(kv_policy_check(&p, &bad_g, &field, &err) == AR_ERR && field == NULL);
    /* Huge line knobs with a budget that never compresses stay harmless. */
    kv_policy_defaults(&p, KV_POLICY_LINEAR);
    p.budget = 1;
    p.anchor_lines = p.recent_lines = 4096;
    int traj[576];
    CHECK(kv_policy_trajectory(&p, &janus, traj, NULL, NULL) == AR_OK && traj[575] == 40 + 575);
}

/* ---- next-scale geometries: one scale per step ---- */

/* A next-scale request: scales of side sides[i], n_prompt prefix tokens. */
static kv_geometry_t scale_geom(int n_prompt, const int *sides, int n, int layers, int heads) {
    kv_geometry_t g;
    memset(&g, 0, sizeof g);
    g.n_prompt = n_prompt;
    g.step_unit = KV_STEP_SEGMENT;
    g.n_segments = n;
    for (int i = 0; i < n; i++)
        g.segment_tokens[i] = sides[i] * sides[i];
    g.n_layers = layers;
    g.n_heads = heads;
    return g;
}

static const int var_sides[] = {1, 2, 3, 4, 5, 6, 8, 10, 13, 16};               /* VAR, 256 px */
static const int inf_sides[] = {1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64}; /* Infinity */

/* Drives a policy over a scale geometry like the engine: step t appends
 * scale t (not the last), then asks for each head's keep list. Token ids
 * are cache indices of the full cache (prefix 0..P-1, then every scale's
 * tokens in order). Checks, at every step, the lengths against the
 * trajectory (exactly) and the content against want(t), the ids a head
 * should hold after the append; returns the compactions. */
static int run_scales(const kv_policy_params_t *p, const kv_geometry_t *g, int *bad) {
    const int S = kv_geometry_steps(g), H = g->n_layers * g->n_heads;
    const int cap = kv_geometry_held(g, S - 1);
    int traj[KV_MAX_SEGMENTS], start[KV_MAX_SEGMENTS + 1];
    ar_error_t err;
    kv_policy_state_t *s = kv_policy_begin(p, g, &err);
    int *ids = calloc((size_t)H * cap, sizeof *ids), *len = calloc((size_t)H, sizeof *len);
    int *keep = calloc((size_t)cap, sizeof *keep);
    if (!s || !ids || !len || !keep || kv_policy_trajectory(p, g, traj, NULL, &err) != AR_OK) {
        CHECK_MSG(0, "setup: %s", err.msg);
        kv_policy_end(s);
        free(ids), free(len), free(keep);
        return -1;
    }
    start[0] = g->n_prompt;
    for (int i = 0; i < S; i++)
        start[i + 1] = start[i] + g->segment_tokens[i];
    int compactions = 0;
    for (int t = 0; t < S; t++) {
        CHECK(!kv_policy_collect(s, t));
        for (int h = 0; h < H; h++) {
            int *id = ids + (size_t)h * cap;
            if (t == 0)
                for (int i = 0; i < g->n_prompt; i++)
                    id[len[h]++] = i;
            for (int i = 0; i < kv_geometry_fed(g, t); i++)
                id[len[h]++] = start[t] + i;
            *bad += len[h] != traj[t];
            /* What the full cache holds: everything. */
            int n = 0, ok = 1;
            for (int i = 0; i < g->n_prompt; i++)
                ok &= n < len[h] && id[n++] == i;
            for (int sc = 0; sc <= t && sc < S - 1; sc++) {
                for (int i = start[sc]; i < start[sc + 1]; i++)
                    ok &= n < len[h] && id[n++] == i;
            }
            *bad += !ok || n != len[h];
            int n_keep = -1;
            const int f = kv_policy_step_end(s, t, h / g->n_heads, h % g->n_heads, len[h], NULL,
                                             keep, &n_keep);
            if (!(f & KV_COMPACT))
                continue;
            *bad += t == S - 1; /* never at the last step */
            compactions++;
            for (int i = 0; i < n_keep; i++) {
                *bad += keep[i] < 0 || keep[i] >= len[h] || (i && keep[i] <= keep[i - 1]);
                id[i] = id[keep[i]];
            }
            len[h] = n_keep;
        }
    }
    kv_policy_end(s);
    free(ids), free(len), free(keep);
    return compactions;
}

/* The full cache on scales: every scale but the last, exactly. */
static void test_full_on_scales(void) {
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_FULL);
    int traj[16];
    kv_geometry_t g = scale_geom(0, var_sides, 10, 2, 3);
    static const int var_full[] = {1, 5, 14, 30, 55, 91, 155, 255, 424, 424};
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 10; t++)
        CHECK_MSG(traj[t] == var_full[t], "step %d: %d, want %d", t, traj[t], var_full[t]);
    /* Infinity: 6425 tokens per head before the last scale (NOTES: HeatKV's
     * Table 1 counts these), and the last scale (4096) never enters. */
    g = scale_geom(0, inf_sides, 13, 32, 16);
    static const int inf_full[] = {1, 5, 21, 57, 121, 265, 521, 921, 1497, 2521, 4121, 6425, 6425};
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 13; t++)
        CHECK_MSG(traj[t] == inf_full[t], "step %d: %d, want %d", t, traj[t], inf_full[t]);
    int bad = 0;
    g = scale_geom(3, var_sides, 10, 2, 2);
    CHECK(run_scales(&p, &g, &bad) == 0 && bad == 0);
}

/* Streaming on scales, driven as the engine does (layer_end, then the
 * append of the newest tokens it says) with token ids: after every layer
 * each head holds the prefix, the sink scales and the newest tokens, at
 * most the cap, and the trajectory is the most a head holds during each
 * step. Returns how many
 * compactions happened (-1 on a setup failure); *bad counts violations. */
static int drive_streaming_scales(const kv_policy_params_t *p, const kv_geometry_t *g, int *bad) {
    const int H = g->n_layers * g->n_heads, S = g->n_segments, steps = kv_geometry_steps(g);
    const int N = kv_geometry_held(g, steps - 1), cap = (int)floor(p->budget * N + 1e-9);
    int kept = g->n_prompt;
    for (int i = 0; i < p->sink_scales && i < S; i++)
        kept += g->segment_tokens[i];
    int traj[KV_MAX_SEGMENTS];
    ar_error_t err = {{0}};
    kv_policy_state_t *s = kv_policy_begin(p, g, &err);
    int *ids = calloc((size_t)H * (N + 1024), sizeof *ids), *len = calloc((size_t)H, sizeof *len);
    int *keep = calloc((size_t)N + 1024, sizeof *keep);
    if (!s || !ids || !len || !keep || kv_policy_trajectory(p, g, traj, NULL, &err) != AR_OK) {
        CHECK_MSG(0, "setup: %s", err.msg);
        kv_policy_end(s);
        free(ids), free(len), free(keep);
        return -1;
    }
    CHECK(kv_policy_layered(s));
    int compactions = 0, next_id = 0;
    for (int t = 0; t < steps; t++) {
        const int fed = kv_geometry_fed(g, t) + (t == 0 ? g->n_prompt : 0);
        int most = 0;
        for (int h = 0; h < H; h++) {
            int *id = ids + (size_t)h * (N + 1024), n_keep, cache;
            const int l = h / g->n_heads, hd = h % g->n_heads;
            const int f = kv_policy_layer_end(s, t, l, hd, len[h], keep, &n_keep, &cache);
            if (f & KV_COMPACT) {
                compactions++;
                for (int i = 0; i < n_keep; i++)
                    id[i] = id[keep[i]];
                len[h] = n_keep;
            }
            /* The newest `cache` of the step's tokens are appended. */
            *bad += cache < 0 || cache > fed || (t == steps - 1 ? 0 : cache == 0 && fed > 0);
            for (int i = fed - cache; i < fed; i++)
                id[len[h]++] = next_id + i;
            most = len[h] > most ? len[h] : most;
            *bad += kv_policy_layer_stored(s, t, l, hd, len[h], NULL, keep, &n_keep) != 0;
            /* prefix + sinks, then the newest tokens, at most the cap */
            const int total = next_id + fed;
            int ok = len[h] <= (cap > kept ? cap : kept);
            for (int i = 0; i < len[h]; i++)
                ok &= i < kept ? id[i] == i : id[i] == total - (len[h] - i);
            *bad += !ok;
        }
        next_id += fed;
        *bad += most != traj[t];
    }
    kv_policy_end(s);
    free(ids), free(len), free(keep);
    return compactions;
}

/* Streaming on scales (HeatKV's StreamingLLM baseline): the sink scales
 * and the most recent tokens within budget x the full cache, after every
 * layer. */
static void test_streaming_on_scales(void) {
    kv_policy_params_t p;
    kv_policy_defaults(&p, KV_POLICY_STREAMING);
    CHECK(p.sink_scales == 3);
    int traj[16];
    /* VAR at 1/6: cap floor(424/6) = 70 = 14 sink tokens + 56 recent. Of a
     * scale larger than 56 (64, 100, 169) only the newest 56 are cached. */
    kv_geometry_t g = scale_geom(0, var_sides, 10, 2, 3);
    static const int var_str[] = {1, 5, 14, 30, 55, 70, 70, 70, 70, 70};
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    for (int t = 0; t < 10; t++)
        CHECK_MSG(traj[t] == var_str[t], "step %d: %d, want %d", t, traj[t], var_str[t]);
    /* Infinity-2B at 10%: cap floor(0.1 x 6425) = 642 = 21 sinks + 621. */
    p.budget = 0.1;
    g = scale_geom(0, inf_sides, 13, 32, 16);
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK);
    CHECK_MSG(traj[6] == 521 && traj[7] == 642 && traj[9] == 642 && traj[12] == 642, "%d %d %d %d",
              traj[6], traj[7], traj[9], traj[12]);
    CHECK(kv_policy_uses_budget(KV_POLICY_STREAMING, &g));
    char words[512];
    kv_policy_describe(&p, &g, words, sizeof words);
    CHECK_STR_CONTAINS(words, "cap 642 tokens per head after every layer");
    CHECK_STR_CONTAINS(words, "3 sink scales (21 tokens");
    /* Below the sinks + one recent token: refused, naming the budget. */
    p.budget = 0.003;
    const char *field = NULL;
    ar_error_t err = {{0}};
    CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR && field && !strcmp(field, "budget"));
    CHECK_STR_CONTAINS(err.msg, "3 sink scales (21 tokens)");

    /* Simulated caches: content and bound after every layer, for several
     * sink counts and budgets, with and without a prefix. */
    static const int sinks[] = {0, 1, 3, 8, 9, 40};
    static const double budgets[] = {1.0, 0.5, 1.0 / 6, 0.1};
    int runs = 0, compactions = 0;
    for (size_t k = 0; k < sizeof sinks / sizeof sinks[0]; k++)
        for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++)
            for (int P = 0; P <= 2; P += 2) {
                p.sink_scales = sinks[k];
                p.budget = budgets[b];
                g = scale_geom(P, var_sides, 10, 2, 2);
                if (kv_policy_check(&p, &g, NULL, NULL) != AR_OK)
                    continue;
                int bad = 0;
                const int n = drive_streaming_scales(&p, &g, &bad);
                CHECK_MSG(bad == 0 && n >= 0, "sink_scales %d, budget %g, prefix %d: %d off",
                          sinks[k], budgets[b], P, bad);
                runs++;
                compactions += n;
            }
    CHECK_MSG(runs >= 30 && compactions > 0, "%d runs, %d compactions", runs, compactions);
    p.sink_scales = 40; /* more sinks than scales: the full cache at any budget */
    p.budget = 1;
    g = scale_geom(0, var_sides, 10, 2, 3);
    CHECK(kv_policy_trajectory(&p, &g, traj, NULL, NULL) == AR_OK && traj[8] == 424 &&
          traj[9] == 424);
}

/* LineAR and HeadKV need lines: on scales they refuse, naming why. */
static void test_line_policies_refuse_scales(void) {
    kv_geometry_t g = scale_geom(0, var_sides, 10, 2, 3);
    for (int k = KV_POLICY_LINEAR; k <= KV_POLICY_HEADKV; k++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, (kv_policy_kind_t)k);
        ar_error_t err = {{0}};
        const char *field = "unset";
        int traj[16];
        CHECK(kv_policy_check(&p, &g, &field, &err) == AR_ERR && field == NULL);
        CHECK_STR_CONTAINS(err.msg, kv_policy_name(p.kind));
        CHECK_STR_CONTAINS(err.msg, "works on raster models");
        CHECK_STR_CONTAINS(err.msg, "whole segments (scales)");
        CHECK(kv_policy_trajectory(&p, &g, traj, NULL, &err) == AR_ERR);
        CHECK(kv_policy_begin(&p, &g, &err) == NULL);
        p.budget = 1; /* no budget makes them fit */
        CHECK(kv_policy_check(&p, &g, NULL, NULL) == AR_ERR);
    }
}

/* What a step samples: one token per raster step, a whole scale per
 * next-scale step; over every step, the image's tokens; nothing outside. */
static void test_geometry_sampled_per_step(void) {
    const kv_geometry_t raster = geom(5, 4, 3, 2, 2), scales = scale_geom(0, var_sides, 10, 2, 3);
    const kv_geometry_t *const gs[] = {&raster, &scales};
    for (int i = 0; i < 2; i++) {
        const kv_geometry_t *g = gs[i];
        int sum = 0;
        for (int t = 0; t < kv_geometry_steps(g); t++)
            sum += kv_geometry_sampled(g, t);
        CHECK(sum == kv_geometry_image_tokens(g));
        CHECK(kv_geometry_sampled(g, -1) == 0 && kv_geometry_sampled(g, kv_geometry_steps(g)) == 0);
    }
    CHECK(kv_geometry_sampled(&raster, 0) == 1 && kv_geometry_sampled(&raster, 11) == 1);
    CHECK(kv_geometry_sampled(&scales, 0) == 1 && kv_geometry_sampled(&scales, 9) == 16 * 16);
}

/* Whose planned peak is exact: every policy whose plan is exact; HeadKV
 * (every head planned global) when its peak comes no later than its
 * grouping, as with the paper's grouping length on the demo grid, not when
 * it groups early and peaks later; AMS-KV (every layer planned expanded)
 * never; and nothing that fails its check. */
static void test_peak_exact(void) {
    kv_geometry_t demo = geom(20, 16, 16, 4, 4);
    kv_policy_params_t p;
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        kv_policy_defaults(&p, (kv_policy_kind_t)k);
        if (kv_policy_plan_exact((kv_policy_kind_t)k) && kv_policy_suits(p.kind, &demo))
            CHECK_MSG(kv_policy_peak_exact(&p, &demo) ==
                          (kv_policy_check(&p, &demo, NULL, NULL) == AR_OK),
                      "%s", kv_policy_name(p.kind));
    }
    CHECK(!kv_policy_plan_exact(KV_POLICY_HEADKV) && !kv_policy_plan_exact(KV_POLICY_AMSKV));
    kv_policy_defaults(&p, KV_POLICY_HEADKV);
    p.budget = 0.25; /* G = 64: the peak is the grouping step's P + 100 */
    int traj[256];
    CHECK(kv_policy_trajectory(&p, &demo, traj, NULL, NULL) == AR_OK && traj[100] == 120);
    CHECK(kv_policy_peak_exact(&p, &demo));
    p.headkv_group_tokens = 20; /* groups at 20, peaks at P + G = 84 later */
    CHECK(!kv_policy_peak_exact(&p, &demo));
    p.budget = 0.01; /* too small: fails its check */
    CHECK(!kv_policy_peak_exact(&p, &demo));
    kv_geometry_t var = scale_geom(1, var_sides, 10, 2, 2);
    kv_policy_defaults(&p, KV_POLICY_AMSKV);
    CHECK(kv_policy_check(&p, &var, NULL, NULL) == AR_OK && !kv_policy_peak_exact(&p, &var));
    kv_policy_defaults(&p, KV_POLICY_FULL);
    CHECK(kv_policy_peak_exact(&p, &var));
}

int main(void) {
    TEST_RUN(test_parse_names_and_defaults);
    TEST_RUN(test_full_keeps_everything);
    TEST_RUN(test_streaming_trajectory_exact);
    TEST_RUN(test_streaming_keeps_prefix_sinks_window);
    TEST_RUN(test_linear_trajectory_and_schedule);
    TEST_RUN(test_linear_evicts_chosen_mid_tokens);
    TEST_RUN(test_linear_evicts_lowest_line_saliency);
    TEST_RUN(test_linear_without_mass_evicts_oldest);
    TEST_RUN(test_headkv_classifies_heads);
    TEST_RUN(test_headkv_collect_schedule);
    TEST_RUN(test_ste_keeps_long_range_tokens);
    TEST_RUN(test_ste_near_range_rounds_half_up);
    TEST_RUN(test_trajectory_bounds_random_runs);
    TEST_RUN(test_knob_table_and_check_fields);
    TEST_RUN(test_min_budget);
    TEST_RUN(test_peak_exact);
    TEST_RUN(test_validate_messages);
    TEST_RUN(test_full_on_scales);
    TEST_RUN(test_streaming_on_scales);
    TEST_RUN(test_line_policies_refuse_scales);
    TEST_RUN(test_geometry_sampled_per_step);
    return TEST_SUMMARY();
}
