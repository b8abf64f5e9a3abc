/* Exact admission against known KV trajectories. */
#include "planner.h"

#include <stdlib.h>
#include <string.h>

#include "family.h"
#include "kv_pool.h"

/* Bytes of one token in every (layer, head) of both CFG sequences. */
static size_t token_image_bytes(const model_config_t *cfg) {
    return kv_pool_block_bytes(1, cfg->llm.head_dim) * (size_t)cfg->llm.num_layers *
           (size_t)cfg->llm.num_kv_heads * 2 /* CFG pair */;
}

size_t planner_full_cache_bytes(const model_config_t *cfg, int n_prompt) {
    kv_geometry_t g;
    model_geometry(cfg, n_prompt, &g);
    return (size_t)kv_geometry_held(&g, kv_geometry_steps(&g) - 1) * token_image_bytes(cfg);
}

int planner_block_tokens(const model_config_t *cfg) {
    return kv_pool_choose_block_tokens(model_image_tokens(cfg) / PLANNER_MIN_BUDGET_INV);
}

void planner_plan_free(planner_plan_t *pl) {
    free(pl->tokens);
    free(pl->bytes);
    memset(pl, 0, sizeof *pl);
}

int planner_plan(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                 int n_prompt, int block_tokens, const char **field, ar_error_t *err) {
    memset(pl, 0, sizeof *pl);
    if (field)
        *field = NULL;
    if (block_tokens < 1)
        return ar_errorf(err, "block_tokens %d: must be positive", block_tokens);
    kv_geometry_t g;
    model_geometry(cfg, n_prompt, &g);
    pl->steps = kv_geometry_steps(&g);
    pl->tokens = malloc((size_t)pl->steps * sizeof *pl->tokens);
    pl->bytes = malloc((size_t)pl->steps * sizeof *pl->bytes);
    if (!pl->tokens || !pl->bytes) {
        planner_plan_free(pl);
        return ar_errorf(err, "out of memory");
    }
    if (kv_policy_trajectory(p, &g, pl->tokens, field, err) != AR_OK) {
        planner_plan_free(pl);
        return AR_ERR;
    }
    const size_t per_block = kv_pool_block_bytes(block_tokens, cfg->llm.head_dim) *
                             (size_t)cfg->llm.num_layers * (size_t)cfg->llm.num_kv_heads *
                             2 /* CFG pair */;
    for (int t = 0; t < pl->steps; t++) {
        pl->bytes[t] = (size_t)((pl->tokens[t] + block_tokens - 1) / block_tokens) * per_block;
        if (pl->bytes[t] > pl->peak_bytes)
            pl->peak_bytes = pl->bytes[t];
        if (pl->tokens[t] > pl->tokens[pl->peak_step])
            pl->peak_step = t;
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
    for (int t = 0; t < n_steps; t++) {
        size_t total = bytes[t];
        for (int i = 0; i < p->n; i++)
            if (t < p->entries[i].steps_left)
                total += p->entries[i].bytes[t];
        if (total > p->pool_bytes)
            return 0;
    }
    return 1;
}

int planner_add(planner_t *p, uint64_t id, const size_t *bytes, int n_steps) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 16;
        planner_entry_t *e = realloc(p->entries, (size_t)cap * sizeof *e);
        if (!e)
            return AR_ERR;
        p->entries = e;
        p->cap = cap;
    }
    size_t *copy = malloc((size_t)n_steps * sizeof *copy);
    if (!copy)
        return AR_ERR;
    memcpy(copy, bytes, (size_t)n_steps * sizeof *copy);
    p->entries[p->n++] = (planner_entry_t){id, n_steps, copy};
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
