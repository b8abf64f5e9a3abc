/* Exact admission against known KV trajectories. */
#include "engine/planner.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv/kv_pool.h"
#include "engine/model_family.h"

const planner_kv_dtype_t planner_kv_f32 = {DTYPE_F32, DTYPE_F32};

planner_kv_dtype_t planner_kv_same(dtype_t t) { return (planner_kv_dtype_t){t, t}; }

const char *const planner_kv_dtype_settings[] = {"auto", "f32", "bf16", "f16", "fp8", NULL};

/* The cache's element types, in the order `arserve plan` lists them (the
 * settings above but auto). */
static const struct {
    const char *name;
    dtype_t t;
} kv_dtypes[] = {
    {"f32", DTYPE_F32}, {"bf16", DTYPE_BF16}, {"f16", DTYPE_F16}, {"fp8", DTYPE_F8_E4M3}};
#define N_KV_DTYPES (int)(sizeof kv_dtypes / sizeof kv_dtypes[0])

const char *planner_kv_dtype_name(dtype_t t) {
    for (int i = 0; i < N_KV_DTYPES; i++)
        if (kv_dtypes[i].t == t)
            return kv_dtypes[i].name;
    return "?";
}

/* One element type from s[0..n) into *t; AR_ERR naming `what`. */
static int parse_one(const char *s, size_t n, const char *what, dtype_t *t, ar_error_t *err) {
    for (int i = 0; i < N_KV_DTYPES; i++)
        if (strlen(kv_dtypes[i].name) == n && strncmp(s, kv_dtypes[i].name, n) == 0) {
            *t = kv_dtypes[i].t;
            return AR_OK;
        }
    return ar_errorf(err, "%s type '%.*s' is not one of f32, bf16, f16, fp8", what,
                     (int)(n > 32 ? 32 : n), s);
}

int planner_kv_dtype_parse(const char *s, planner_kv_dtype_t *out, ar_error_t *err) {
    if (!s || !s[0])
        return ar_errorf(err, "empty: give K,V (e.g. f32,bf16) or one type for both");
    const char *comma = strchr(s, ',');
    planner_kv_dtype_t dt;
    if (!comma) {
        if (parse_one(s, strlen(s), "the", &dt.k, err) != AR_OK)
            return AR_ERR;
        dt.v = dt.k;
    } else if (strchr(comma + 1, ',')) {
        return ar_errorf(err, "'%s' has more than two types: give K,V (e.g. f32,bf16)", s);
    } else if (parse_one(s, (size_t)(comma - s), "K's", &dt.k, err) != AR_OK ||
               parse_one(comma + 1, strlen(comma + 1), "V's", &dt.v, err) != AR_OK) {
        return AR_ERR;
    }
    *out = dt;
    return AR_OK;
}

int planner_kv_dtype_choose(const char *name, dtype_t weights, dtype_t *out, ar_error_t *err) {
    if (name && strcmp(name, "auto") == 0) {
        *out = weights;
        return AR_OK;
    }
    planner_kv_dtype_t dt;
    if (planner_kv_dtype_parse(name, &dt, err) != AR_OK)
        return AR_ERR;
    if (dt.k != dt.v)
        return ar_errorf(err,
                         "'%s': the pool stores K and V in one type; give one of f32, bf16, "
                         "f16, fp8 or auto",
                         name);
    *out = dt.k;
    return AR_OK;
}

int planner_kv_dtype_equal(planner_kv_dtype_t a, planner_kv_dtype_t b) {
    return a.k == b.k && a.v == b.v;
}

/* Bytes of K and V of block_tokens tokens of one (sequence, layer, head). */
static size_t block_bytes(const model_config_t *cfg, int block_tokens, planner_kv_dtype_t dt) {
    return (size_t)block_tokens * (size_t)cfg->llm.head_dim * (dtype_size(dt.k) + dtype_size(dt.v));
}

size_t planner_token_image_bytes(const model_config_t *cfg, planner_kv_dtype_t dt) {
    return block_bytes(cfg, 1, dt) * (size_t)cfg->llm.num_layers * (size_t)cfg->llm.num_kv_heads *
           2 /* CFG pair */;
}

size_t planner_full_cache_bytes_dtype(const model_config_t *cfg, int n_prompt,
                                      planner_kv_dtype_t dt) {
    kv_geometry_t g;
    model_geometry(cfg, n_prompt, &g);
    /* The full cache only grows: its last step holds the most. */
    return (size_t)kv_geometry_held(&g, kv_geometry_steps(&g) - 1) *
           planner_token_image_bytes(cfg, dt);
}

size_t planner_full_cache_bytes(const model_config_t *cfg, int n_prompt) {
    return planner_full_cache_bytes_dtype(cfg, n_prompt, planner_kv_f32);
}

int planner_block_tokens(const model_config_t *cfg) {
    return kv_pool_choose_block_tokens(model_image_tokens(cfg) / PLANNER_MIN_BUDGET_INV);
}

void planner_plan_free(planner_plan_t *pl) {
    free(pl->tokens);
    free(pl->bytes);
    free(pl->scored);
    memset(pl, 0, sizeof *pl);
}

int planner_plan(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                 int n_prompt, int block_tokens, const char **field, ar_error_t *err) {
    return planner_plan_dtype(pl, cfg, p, n_prompt, block_tokens, planner_kv_f32, field, err);
}

int planner_plan_dtype(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                       int n_prompt, int block_tokens, planner_kv_dtype_t dt, const char **field,
                       ar_error_t *err) {
    return planner_plan_sized(pl, cfg, p, n_prompt, 0, block_tokens, dt, field, err);
}

int planner_plan_sized(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                       int n_prompt, int size, int block_tokens, planner_kv_dtype_t dt,
                       const char **field, ar_error_t *err) {
    memset(pl, 0, sizeof *pl);
    if (field)
        *field = NULL;
    if (block_tokens < 1)
        return ar_errorf(err, "block_tokens %d: must be positive", block_tokens);
    kv_geometry_t g;
    model_geometry_sized(cfg, n_prompt, size, &g);
    pl->steps = kv_geometry_steps(&g);
    pl->tokens = malloc((size_t)pl->steps * sizeof *pl->tokens);
    pl->bytes = malloc((size_t)pl->steps * sizeof *pl->bytes);
    pl->scored = malloc((size_t)pl->steps * sizeof *pl->scored);
    long long *blocks = malloc((size_t)pl->steps * sizeof *blocks);
    if (!pl->tokens || !pl->bytes || !pl->scored || !blocks) {
        free(blocks);
        planner_plan_free(pl);
        return ar_errorf(err, "out of memory");
    }
    if (kv_policy_trajectory_blocks(p, &g, block_tokens, blocks, pl->tokens, field, err) != AR_OK) {
        free(blocks);
        planner_plan_free(pl);
        return AR_ERR;
    }
    kv_policy_state_t *st = kv_policy_begin(p, &g, err);
    if (!st) {
        free(blocks);
        planner_plan_free(pl);
        return AR_ERR;
    }
    for (int t = 0; t < pl->steps; t++)
        pl->scored[t] = (unsigned char)(kv_policy_collect(st, t) != 0);
    kv_policy_end(st);
    const size_t per_block = block_bytes(cfg, block_tokens, dt) * 2 /* CFG pair */;
    for (int t = 0; t < pl->steps; t++) {
        pl->bytes[t] = (size_t)blocks[t] * per_block;
        if (pl->bytes[t] > pl->peak_bytes)
            pl->peak_bytes = pl->bytes[t];
        if (pl->tokens[t] > pl->tokens[pl->peak_step])
            pl->peak_step = t;
    }
    free(blocks);
    return AR_OK;
}

/* The candidate budgets of [lo, hi], descending, at most PLANNER_MAX_LEVELS:
 * hi, k / n_tokens strictly between, lo. */
static int level_candidates(double lo, double hi, int n_tokens, double *out) {
    double all[4096 + 2];
    int n = 0;
    all[n++] = hi;
    const int k_hi = (int)floor(hi * n_tokens), k_lo = (int)ceil(lo * n_tokens);
    for (int k = k_hi; k >= k_lo && n < 4096; k--) {
        const double b = (double)k / n_tokens;
        if (b < hi && b > lo)
            all[n++] = b;
    }
    if (lo < hi)
        all[n++] = lo;
    if (n <= PLANNER_MAX_LEVELS) {
        memcpy(out, all, (size_t)n * sizeof *out);
        return n;
    }
    /* Evenly sampled, both ends kept. */
    for (int i = 0; i < PLANNER_MAX_LEVELS; i++)
        out[i] = all[(int)((long long)i * (n - 1) / (PLANNER_MAX_LEVELS - 1))];
    return PLANNER_MAX_LEVELS;
}

void planner_levels_free(planner_levels_t *lv) {
    for (int i = 0; i < lv->n; i++)
        planner_plan_free(&lv->plans[i]);
    lv->n = 0;
}

static int same_plan(const planner_plan_t *a, const planner_plan_t *b) {
    return a->steps == b->steps &&
           memcmp(a->bytes, b->bytes, (size_t)a->steps * sizeof *a->bytes) == 0;
}

int planner_plan_levels(planner_levels_t *lv, const model_config_t *cfg,
                        const kv_policy_params_t *p, double lo, double hi, int n_prompt, int size,
                        int block_tokens, planner_kv_dtype_t dt, const char **field,
                        ar_error_t *err) {
    memset(lv, 0, sizeof *lv);
    if (field)
        *field = NULL;
    if (!(lo > 0 && lo <= hi && hi <= 1))
        return ar_errorf(err, "budget range [%g, %g]: need 0 < min <= max <= 1", lo, hi);
    double cand[PLANNER_MAX_LEVELS];
    const int n_cand = level_candidates(lo, hi, model_image_tokens(cfg), cand);
    for (int i = 0; i < n_cand; i++) {
        kv_policy_params_t q = *p;
        q.budget = cand[i];
        planner_plan_t plan;
        const int floor_level = i == n_cand - 1;
        if (planner_plan_sized(&plan, cfg, &q, n_prompt, size, block_tokens, dt,
                               floor_level ? field : NULL, floor_level ? err : NULL) != AR_OK) {
            if (!floor_level)
                continue;
            planner_levels_free(lv);
            return AR_ERR;
        }
        if (lv->n > 0 && same_plan(&lv->plans[lv->n - 1], &plan)) {
            planner_plan_free(&plan); /* the larger budget above holds the same */
            continue;
        }
        lv->budgets[lv->n] = cand[i];
        lv->plans[lv->n++] = plan;
    }
    return AR_OK;
}

void planner_init(planner_t *p, size_t pool_bytes) {
    memset(p, 0, sizeof *p);
    p->pool_bytes = pool_bytes;
}

void planner_free(planner_t *p) {
    for (int i = 0; i < p->n; i++)
        free(p->entries[i].bytes);
    free(p->entries);
    memset(p, 0, sizeof *p);
}

int planner_fits(const planner_t *p, const size_t *bytes, int n_steps) {
    return planner_fits_after(p, bytes, n_steps, 0);
}

int planner_fits_after(const planner_t *p, const size_t *bytes, int n_steps, int delay) {
    for (int t = 0; t < n_steps; t++) {
        size_t total = bytes[t];
        for (int i = 0; i < p->n; i++)
            if (t + delay < p->entries[i].steps_left)
                total += p->entries[i].bytes[t + delay];
        if (total > p->pool_bytes)
            return 0;
    }
    return 1;
}

int planner_add(planner_t *p, uint64_t id, const size_t *bytes, int n_steps) {
    return planner_add_after(p, id, bytes, n_steps, 0);
}

int planner_add_after(planner_t *p, uint64_t id, const size_t *bytes, int n_steps, int delay) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 16;
        planner_entry_t *e = realloc(p->entries, (size_t)cap * sizeof *e);
        if (!e)
            return AR_ERR;
        p->entries = e;
        p->cap = cap;
    }
    size_t *copy = calloc((size_t)(delay + n_steps), sizeof *copy);
    if (!copy)
        return AR_ERR;
    memcpy(copy + delay, bytes, (size_t)n_steps * sizeof *copy);
    p->entries[p->n++] = (planner_entry_t){id, delay + n_steps, copy};
    return AR_OK;
}

static void remove_at(planner_t *p, int i) {
    free(p->entries[i].bytes);
    p->entries[i] = p->entries[--p->n];
}

void planner_tick(planner_t *p) {
    for (int i = 0; i < p->n;) {
        planner_entry_t *e = &p->entries[i];
        if (--e->steps_left <= 0) {
            remove_at(p, i);
            continue;
        }
        memmove(e->bytes, e->bytes + 1, (size_t)e->steps_left * sizeof *e->bytes);
        i++;
    }
}

/* The most an entry reserves at any of its remaining iterations. */
static size_t entry_peak(const planner_entry_t *e) {
    size_t m = 0;
    for (int t = 0; t < e->steps_left; t++)
        m = e->bytes[t] > m ? e->bytes[t] : m;
    return m;
}

size_t planner_tighten(planner_t *p, uint64_t id, const size_t *bytes, int n_steps) {
    for (int i = 0; i < p->n; i++) {
        planner_entry_t *e = &p->entries[i];
        if (e->id != id)
            continue;
        const size_t before = entry_peak(e);
        for (int t = 0; t < n_steps && t < e->steps_left; t++)
            e->bytes[t] = bytes[t] < e->bytes[t] ? bytes[t] : e->bytes[t];
        return before - entry_peak(e);
    }
    return 0;
}

void planner_remove(planner_t *p, uint64_t id) {
    for (int i = 0; i < p->n; i++)
        if (p->entries[i].id == id) {
            remove_at(p, i);
            return;
        }
}

size_t planner_reserved_now(const planner_t *p) {
    size_t total = 0;
    for (int i = 0; i < p->n; i++)
        total += p->entries[i].bytes[0];
    return total;
}
