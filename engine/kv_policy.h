/* KV-cache compression policies for raster models (docs/kv-cache.md): full,
 * StreamingLLM, LineAR and HeadKV. A policy knows its worst-case trajectory
 * before a request runs (for the planner) and, while it runs, decides after
 * each step which tokens each (layer, head) keeps, from attention statistics
 * it asked the engine to collect. Pure host logic: no backend calls. */
#ifndef ARSERVE_KV_POLICY_H
#define ARSERVE_KV_POLICY_H

#include "status.h"

typedef enum kv_policy_kind {
    KV_POLICY_FULL = 0,
    KV_POLICY_STREAMING,
    KV_POLICY_LINEAR,
    KV_POLICY_HEADKV,
} kv_policy_kind_t;

/* Every knob, with the papers' defaults from kv_policy_defaults(). */
typedef struct kv_policy_params {
    kv_policy_kind_t kind;
    double budget; /* fraction of the full cache a head may hold, (0, 1]; full ignores it */
    /* streaming */
    int sink_tokens; /* image tokens after the prefix kept as attention sinks */
    /* linear (LineAR) */
    int anchor_lines; /* N_init, in lines */
    int recent_lines; /* r */
    /* headkv (HeadKV) */
    double headkv_threshold;  /* cumulative attention mass that classifies a head */
    double headkv_alpha;      /* share of the historical budget for the near range */
    int headkv_buffer;        /* new tokens between cache updates (and queries scored) */
    int headkv_local_window;  /* local heads keep this many recent tokens */
    int headkv_recent_lines;  /* global heads keep this many recent lines */
    int headkv_group_tokens;  /* grouping length: no compression until the cache reaches it */
} kv_policy_params_t;

/* What a policy knows about a request. */
typedef struct kv_geometry {
    int n_prompt;    /* condition prefix tokens */
    int line_width;  /* image tokens per line (w) */
    int n_lines;     /* lines per image (h) */
    int n_layers, n_heads;
} kv_geometry_t;

void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind);

/* "full", "streaming", "linear", "headkv" -> kind; -1 if unknown. */
int kv_policy_parse(const char *name);
const char *kv_policy_name(kv_policy_kind_t kind);

/* Checks the knobs against the geometry (budget too small to hold the
 * prefix and the recent window, ...); the message names the knob. */
int kv_policy_validate(const kv_policy_params_t *p, const kv_geometry_t *g, ar_error_t *err);

/* Steps in a request: w * h (one image token sampled per step). */
static inline int kv_geometry_steps(const kv_geometry_t *g) { return g->line_width * g->n_lines; }

/* Worst-case tokens one head holds during each step t (after the step's
 * append, before its compaction), for t in [0, steps). Exact for full,
 * streaming and linear; HeadKV plans every head as global. */
int kv_policy_trajectory(const kv_policy_params_t *p, const kv_geometry_t *g, int *tokens);

typedef struct kv_policy_state kv_policy_state_t;

kv_policy_state_t *kv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g,
                                   ar_error_t *err);
void kv_policy_end(kv_policy_state_t *s);

/* Should the engine accumulate key mass during step t's forward? */
int kv_policy_collect(const kv_policy_state_t *s, int step);

/* What kv_policy_step_end asks of the engine (bits). */
enum {
    KV_COMPACT = 1,    /* keep only keep[0..*n_keep) (ascending cache indices) */
    KV_RESET_MASS = 2, /* zero this head's key mass (after compaction) */
};

/* After step t's forward, for one (layer, head) holding len tokens. mass
 * (len floats, read only) is the key mass accumulated since this head's
 * last reset, or NULL when nothing was collected since. keep has room for
 * len entries. Returns a combination of the bits above (0: keep all). */
int kv_policy_step_end(kv_policy_state_t *s, int step, int layer, int head, int len,
                       const float *mass, int *keep, int *n_keep);

#endif
