/* The cost table: what one engine iteration costs as a linear function of
 * the batch it steps, fitted from timed iterations (`arserve bench
 * --profile`, or a daemon's own, online: cost_learner_t) or derived from a
 * paper's step times (the capacity simulator's tables), plus
 * the per-image costs of decoding (on the engine thread) and PNG encoding
 * (on the PNG workers). A table is for one model family on one machine;
 * its file is JSON (cost_table_save). */
#ifndef ARSERVE_ENGINE_COST_MODEL_H
#define ARSERVE_ENGINE_COST_MODEL_H

#include <stddef.h>

#include "engine/planner.h"
#include "engine/policy/kv_policy.h"

/* What an iteration's cost is keyed by, summed over the batch's sequences
 * (two per image: the CFG pair). */
typedef struct cost_features {
    double sequences;
    double kv_attended; /* KV tokens attended, summed over the step's new tokens (query x key
                           pairs: a raster decode step's new token attends every token held, a
                           scale's tokens every token held and, the last scale, themselves) */
    double new_tokens;  /* rows computed: the prefix at a request's first step, then its step's
                           token or scale (the last scale too, which is never cached) */
    double kv_scored;   /* the part of kv_attended at steps whose policy collects key mass
                           (planner_plan_t.scored): each pair's probability summed per key too */
} cost_features_t;

/* Adds n_images images of one request at step `step` of plan pl (its
 * geometry g) to f. */
void cost_features_add(cost_features_t *f, const kv_geometry_t *g, const planner_plan_t *pl,
                       int step, int n_images);

/* acc += weight x f, feature by feature (a batch's sum: weight 1). */
void cost_features_accumulate(cost_features_t *acc, const cost_features_t *f, double weight);

/* Each step's features of n_images images of plan pl (geometry g): a
 * malloc'd array of pl->steps entries, or NULL when out of memory. */
cost_features_t *cost_plan_features(const kv_geometry_t *g, const planner_plan_t *pl, int n_images);

/* The step's coefficients, in cost_table_t.coef's order. */
enum {
    COST_COEF_INTERCEPT,
    COST_COEF_SEQUENCE,
    COST_COEF_KV_ATTENDED,
    COST_COEF_NEW_TOKEN,
    COST_COEF_KV_SCORED,
    COST_N_COEF
};

typedef struct cost_table {
    char family[32];  /* "raster" or "scale" */
    char source[256]; /* where the numbers come from (a profile run, a paper) */
    double coef[COST_N_COEF];
    double decode_s; /* per image, on the drawing thread */
    double png_s;    /* per image, on a PNG worker */
    /* Per request, on its HTTP thread: from its arrival to its submission
     * (parsing, the prompt's tokens) and from its job's end to its answer
     * queued (the PNGs in base64, the JSON). A file without it: 0. */
    double http_s;
    /* The fit: samples, relative RMS error and the largest relative error
     * of the fitted step times against the measured ones (0 when derived). */
    int fit_samples;
    double fit_rel_rms, fit_max_rel;
} cost_table_t;

/* The table's step time for features f (never below 0). */
double cost_step_seconds(const cost_table_t *t, const cost_features_t *f);

/* Least squares of y[i] ~ coef . (1, sequences, kv_attended, new_tokens,
 * kv_scored) over n samples, with every coefficient kept >= 0 (a feature
 * whose coefficient comes out negative is dropped and the rest refitted; a
 * feature no sample has, kv_scored when no policy collected, is 0); sets
 * coef and the fit figures. -1 when n is too small. */
int cost_table_fit(cost_table_t *t, const cost_features_t *x, const double *y, int n);

/* The model's cost before anything was timed: a conservative table (slow:
 * what one core of a small machine does), for a daemon started without a
 * table to answer something until its own iterations are fitted. Every
 * new token costs 2 FLOP per weight (n_weights: the caller may count
 * every stored byte as one, more than there are), every query-key pair 4
 * per head dimension per head per layer, at COST_DEFAULT_FLOPS; decoding
 * and PNG encoding 1 s an image. */
#define COST_DEFAULT_FLOPS 10e9
void cost_table_default(cost_table_t *t, const model_config_t *cfg, double n_weights);

/* The table as the file holds it (a cJSON object the caller deletes), or
 * NULL when out of memory. */
struct cJSON *cost_table_json(const cost_table_t *t);

/* Reads and writes the JSON file; errors name the file and the key. */
int cost_table_load(cost_table_t *t, const char *path, char *why, size_t why_cap);
int cost_table_save(const cost_table_t *t, const char *path, char *why, size_t why_cap);

/* A cost table learned online from an engine's own timed iterations:
 * the last `cap` (features, seconds) samples in a ring; every `refit_every`
 * samples the table is fitted again from the ring, robustly (a fit; a
 * fit of the half it finds least slowed; then fits of the samples not
 * slowed beyond COST_OUTLIER_FACTOR times the median error, or beyond
 * COST_OUTLIER_FLOOR of their fitted step, COST_TRIM_ROUNDS trimmed fits at
 * most: steps slowed by something else, a page fault, another process, up
 * to half of them, do not move the table; a step faster than the fit says
 * is the fit's own error and stays). Until the first fit the seed
 * answers; a fit that fails (too few samples, every batch alike) keeps the last table. A
 * refit runs on its caller's thread (the engine's, between steps), so it keeps to a share of
 * the time it is fed: after a refit that took r seconds, the next waits until the samples
 * added since sum to r / COST_REFIT_SHARE seconds (a refit of a full ring costs about 4
 * steps of the demo model; every 64 steps it would have slowed them by 6%). Bounded
 * memory: the ring and its scratch, fixed at init. Not thread-safe: one caller at a time. */
#define COST_OUTLIER_FACTOR 4.0
#define COST_OUTLIER_FLOOR 0.25
#define COST_TRIM_ROUNDS 5
#define COST_REFIT_SHARE 0.01
typedef struct cost_learner {
    cost_table_t table; /* what it answers with: the seed, then the last good fit */
    cost_features_t *x, *kept_x;
    double *y, *kept_y, *err;
    int cap, n, next;
    int refit_every, since_refit;
    double fed_since_refit_s; /* the seconds of the samples added since the last refit */
    double refit_s;           /* what the last refit took */
    long long samples;        /* added, ever */
    long long refits;         /* fits that replaced the table */
    int last_outliers;        /* samples the last fit left out */
    int images;               /* images timed (table.decode_s and png_s: their running means) */
    int requests;             /* requests timed (table.http_s: their running mean) */
} cost_learner_t;

/* AR_OK, or AR_ERR when out of memory. The table starts as *seed (its
 * source kept), and becomes "learned from N iterations" once fitted. */
int cost_learner_init(cost_learner_t *l, const cost_table_t *seed, int cap, int refit_every);
void cost_learner_free(cost_learner_t *l);
/* One timed iteration; 1 when it refitted the table, else 0. */
int cost_learner_add(cost_learner_t *l, const cost_features_t *f, double seconds);
/* One image's decoding and PNG encoding seconds (either < 0: not timed). */
void cost_learner_add_image(cost_learner_t *l, double decode_s, double png_s);
/* One answered request's HTTP-side seconds (table.http_s: their running
 * mean over the last ~64; < 0: not timed). */
void cost_learner_add_request(cost_learner_t *l, double http_s);

#endif
