/* The KV planner: every request's KV trajectory (bytes held after each of
 * its steps) is known before it runs, so admission can check that the pool
 * holds the running requests plus a new one at every future iteration. The
 * full cache holds its whole capacity from the first step (its caches are
 * allocated when it starts); compressed-KV policies bring shaped
 * trajectories through the same check. */
#ifndef ARSERVE_PLANNER_H
#define ARSERVE_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "model_config.h"

/* Bytes of K and V one image (its CFG pair of sequences) holds under the
 * full cache with a prompt of n_prompt tokens. */
size_t planner_full_cache_bytes(const model_config_t *cfg, int n_prompt);

typedef struct planner_entry {
    uint64_t id;
    int steps_left;      /* iterations until it releases everything */
    size_t *bytes;       /* bytes held at each remaining iteration (steps_left entries) */
} planner_entry_t;

typedef struct planner {
    size_t pool_bytes;
    int n, cap;
    planner_entry_t *entries;
} planner_t;

void planner_init(planner_t *p, size_t pool_bytes);
void planner_free(planner_t *p);

/* Would a request holding bytes[i] at its i-th iteration from now (n_steps
 * entries) fit beside everything admitted, at every future iteration? */
int planner_fits(const planner_t *p, const size_t *bytes, int n_steps);

/* Records an admitted request (copies bytes). AR_ERR on out of memory. */
int planner_add(planner_t *p, uint64_t id, const size_t *bytes, int n_steps);

/* Advances every entry by one iteration (drops entries that are done). */
void planner_tick(planner_t *p);

/* Removes a request (finished early, cancelled). */
void planner_remove(planner_t *p, uint64_t id);

/* Bytes reserved now: the sum over entries of what they hold this iteration. */
size_t planner_reserved_now(const planner_t *p);

#endif
