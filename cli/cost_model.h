/* The capacity simulator's cost table: what one engine iteration costs as
 * a linear function of the batch it steps, fitted from timed iterations
 * (`arserve bench --profile`) or derived from a paper's step times, plus
 * the per-image costs of decoding (on the engine thread) and PNG encoding
 * (on the PNG workers). A table is for one model family on one machine;
 * its file is JSON (cost_table_save). */
#ifndef ARSERVE_CLI_COST_MODEL_H
#define ARSERVE_CLI_COST_MODEL_H

#include <stddef.h>

#include "engine/planner.h"
#include "engine/policy/kv_policy.h"

/* What an iteration's cost is keyed by, summed over the batch's sequences
 * (two per image: the CFG pair). */
typedef struct cost_features {
    double sequences;
    double kv_attended; /* KV tokens attended, summed over the step's new tokens (query x key
                           pairs: a raster decode step's new token attends every token held) */
    double new_tokens;  /* tokens fed: the prefix at a request's first step, then its step's */
} cost_features_t;

/* Adds n_images images of one request at step `step` of plan pl (its
 * geometry g) to f. */
void cost_features_add(cost_features_t *f, const kv_geometry_t *g, const planner_plan_t *pl,
                       int step, int n_images);

#define COST_N_COEF 4 /* intercept, per sequence, per KV attended, per new token */

typedef struct cost_table {
    char family[32];  /* "raster" or "scale" */
    char source[256]; /* where the numbers come from (a profile run, a paper) */
    double coef[COST_N_COEF];
    double decode_s; /* per image, on the engine thread */
    double png_s;    /* per image, on a PNG worker */
    /* The fit: samples, relative RMS error and the largest relative error
     * of the fitted step times against the measured ones (0 when derived). */
    int fit_samples;
    double fit_rel_rms, fit_max_rel;
} cost_table_t;

/* The table's step time for features f (never below 0). */
double cost_step_seconds(const cost_table_t *t, const cost_features_t *f);

/* Least squares of y[i] ~ coef . (1, sequences, kv_attended, new_tokens)
 * over n samples, with every coefficient kept >= 0 (a feature whose
 * coefficient comes out negative is dropped and the rest refitted); sets
 * coef and the fit figures. -1 when n is too small. */
int cost_table_fit(cost_table_t *t, const cost_features_t *x, const double *y, int n);

/* Reads and writes the JSON file; errors name the file and the key. */
int cost_table_load(cost_table_t *t, const char *path, char *why, size_t why_cap);
int cost_table_save(const cost_table_t *t, const char *path, char *why, size_t why_cap);

#endif
