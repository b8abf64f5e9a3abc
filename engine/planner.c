/* Exact admission against known KV trajectories. */
#include "planner.h"

#include <stdlib.h>
#include <string.h>

#include "status.h"

size_t planner_full_cache_bytes(const model_config_t *cfg, int n_prompt) {
    size_t tokens = (size_t)n_prompt + (size_t)cfg->image.grid_height * cfg->image.grid_width - 1;
    size_t per_token = (size_t)cfg->llm.num_layers * cfg->llm.num_kv_heads * cfg->llm.head_dim *
                       2 /* K and V */ * sizeof(float);
    return 2 /* CFG pair */ * tokens * per_token;
}

void planner_init(planner_t *p, size_t pool_bytes) {
    memset(p, 0, sizeof *p);
    p->pool_bytes = pool_bytes;
}

void planner_free(planner_t *p) {
    for (int i = 0; i < p->n; i++) free(p->entries[i].bytes);
    free(p->entries);
    memset(p, 0, sizeof *p);
}

int planner_fits(const planner_t *p, const size_t *bytes, int n_steps) {
    for (int t = 0; t < n_steps; t++) {
        size_t total = bytes[t];
        for (int i = 0; i < p->n; i++)
            if (t < p->entries[i].steps_left) total += p->entries[i].bytes[t];
        if (total > p->pool_bytes) return 0;
    }
    return 1;
}

int planner_add(planner_t *p, uint64_t id, const size_t *bytes, int n_steps) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 16;
        planner_entry_t *e = realloc(p->entries, (size_t)cap * sizeof *e);
        if (!e) return AR_ERR;
        p->entries = e;
        p->cap = cap;
    }
    size_t *copy = malloc((size_t)n_steps * sizeof *copy);
    if (!copy) return AR_ERR;
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
    for (int i = 0; i < p->n; i++) total += p->entries[i].bytes[0];
    return total;
}
