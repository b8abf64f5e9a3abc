/* KV-cache compression policies for raster models (docs/kv-cache.md): full,
 * StreamingLLM, LineAR and HeadKV. A policy knows its worst-case trajectory
 * before a request runs (for the planner) and, while it runs, decides after
 * each step which tokens each (layer, head) keeps, from attention statistics
 * it asked the engine to collect. Pure host logic: no backend calls. */
#ifndef ARSERVE_KV_POLICY_H
#define ARSERVE_KV_POLICY_H

#include <stddef.h>

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
    double headkv_threshold; /* cumulative attention mass that classifies a head */
    double headkv_alpha;     /* share of the historical budget for the near range */
    int headkv_buffer;       /* new tokens between cache updates (and queries scored) */
    int headkv_local_window; /* local heads keep this many recent tokens */
    int headkv_recent_lines; /* global heads keep this many recent lines */
    int headkv_group_tokens; /* grouping length: no compression until the cache reaches it */
} kv_policy_params_t;

/* Every knob of every policy, one line each:
 *   X(name, policy, type, lo, lo_open, hi, default, help)
 * name is the kv_policy_params_t field, the request field of
 * POST /v1/images/generations and the daemon's config key (flag --name with
 * '-' for '_', variable ARSERVE_NAME); it belongs to `policy` alone. type is
 * INT or REAL; values lie in [lo, hi], or (lo, hi] when lo_open. The upper
 * bounds only keep arithmetic in range: whether a value suits a model is
 * kv_policy_validate's question. The budget is not listed: every policy but
 * full takes one. Defaults and their sources: docs/kv-policies.md. */
#define KV_POLICY_KNOBS(X)                                                                         \
    /* StreamingLLM §3.1, Tab. 2: four initial tokens suffice as sinks */                         \
    X(sink_tokens, KV_POLICY_STREAMING, INT, 0, 0, 65536, 4,                                       \
      "streaming: image tokens after the prefix kept as attention sinks")                          \
    /* LineAR leaves N_init and r open; issue 5 fixes 1 and 2 */                                   \
    X(anchor_lines, KV_POLICY_LINEAR, INT, 0, 0, 4096, 1,                                          \
      "linear: first image lines always kept (N_init)")                                            \
    X(recent_lines, KV_POLICY_LINEAR, INT, 0, 0, 4096, 2,                                          \
      "linear: most recent complete lines always kept (r)")                                        \
    /* HeadKV §4 step 2 */                                                                        \
    X(headkv_threshold, KV_POLICY_HEADKV, REAL, 0, 1, 1, 0.9,                                      \
      "headkv: attention mass that classifies a head (local when reached within "                  \
      "headkv_local_window tokens)")                                                               \
    /* HeadKV §5.3: a balanced split is best */                                                   \
    X(headkv_alpha, KV_POLICY_HEADKV, REAL, 0, 0, 1, 0.5,                                          \
      "headkv: share of a global head's history kept from the near range (STE)")                   \
    X(headkv_buffer, KV_POLICY_HEADKV, INT, 1, 0, 65536, 8,                                        \
      "headkv: new tokens between cache updates (and queries scored)")                             \
    X(headkv_local_window, KV_POLICY_HEADKV, INT, 0, 0, 65536, 32,                                 \
      "headkv: recent tokens a local head keeps")                                                  \
    /* HeadKV §5.1: "typically two rows" */                                                       \
    X(headkv_recent_lines, KV_POLICY_HEADKV, INT, 0, 0, 4096, 2,                                   \
      "headkv: recent lines a global head keeps")                                                  \
    /* HeadKV A.2: 100 for Janus-Pro and LlamaGen */                                               \
    X(headkv_group_tokens, KV_POLICY_HEADKV, INT, 1, 0, 65536, 100,                                \
      "headkv: image tokens cached before heads are grouped and the first compression")

typedef enum kv_knob_type { KV_KNOB_INT, KV_KNOB_REAL } kv_knob_type_t;

/* One knob as a value: what the API and the config loop over. */
typedef struct kv_policy_knob {
    const char *name;
    kv_policy_kind_t policy; /* the policy it belongs to */
    kv_knob_type_t type;
    double lo, hi;
    int lo_open;
    double def;
    size_t offset; /* of the field in kv_policy_params_t (int or double by type) */
    const char *help;
} kv_policy_knob_t;

#define KV_POLICY_KNOB_ONE_(name, ...) +1
enum { KV_POLICY_N_KNOBS = 0 KV_POLICY_KNOBS(KV_POLICY_KNOB_ONE_) };

/* The knobs, in KV_POLICY_KNOBS order. */
extern const kv_policy_knob_t kv_policy_knobs[KV_POLICY_N_KNOBS];

/* The knob called name, or NULL. */
const kv_policy_knob_t *kv_policy_knob_find(const char *name);
double kv_policy_knob_get(const kv_policy_params_t *p, const kv_policy_knob_t *k);
/* Stores v (truncated for an INT knob; callers check with kv_policy_knob_ok). */
void kv_policy_knob_set(kv_policy_params_t *p, const kv_policy_knob_t *k, double v);
/* 1 when v is a value of k: in range, and whole for an INT knob. */
int kv_policy_knob_ok(const kv_policy_knob_t *k, double v);
/* "an integer from 0 to 4096", "a number greater than 0 and at most 1" */
void kv_policy_knob_describe(const kv_policy_knob_t *k, char *buf, size_t cap);

/* What a policy knows about a request. */
typedef struct kv_geometry {
    int n_prompt;   /* condition prefix tokens */
    int line_width; /* image tokens per line (w) */
    int n_lines;    /* lines per image (h) */
    int n_layers, n_heads;
} kv_geometry_t;

void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind);

/* "full", "streaming", "linear", "headkv" -> kind; -1 if unknown. */
int kv_policy_parse(const char *name);
const char *kv_policy_name(kv_policy_kind_t kind);

/* Checks the knobs of p's policy (ranges as in KV_POLICY_KNOBS), then
 * against the geometry (budget too small to hold the prefix and the recent
 * window, ...); the message names the knob. */
int kv_policy_validate(const kv_policy_params_t *p, const kv_geometry_t *g, ar_error_t *err);

/* kv_policy_validate, also saying which setting is at fault: *field (may be
 * NULL) is set to a knob's name, to "budget" (also when the budget is too
 * small for the knobs), or to NULL for a bad geometry or kind. */
int kv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                    ar_error_t *err);

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
