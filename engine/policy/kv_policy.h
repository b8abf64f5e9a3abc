/* KV-cache compression policies (docs/kv-cache.md, docs/kv-policies.md): a
 * table of policies, one file each (engine/policy_*.c behind
 * kv_policy_impl.h), all asked the same questions. Before a request runs:
 * its worst-case trajectory (tokens one (layer, head) holds during each
 * step), for the planner. While it runs: after each step, which tokens each
 * (layer, head) keeps, from attention statistics it asked the engine to
 * collect. A policy sees the request as segments (the condition prefix,
 * then lines or scales), never as a grid. Pure host logic: no backend calls. */
#ifndef ARSERVE_KV_POLICY_H
#define ARSERVE_KV_POLICY_H

#include <stddef.h>

#include "base/status.h"

/* The policies, in table order: X(KIND, name). Adding one is a line here,
 * a file engine/policy_<name>.c defining kv_policy_<name>, and its knobs
 * below; every list of names, the API's and the config's, derives from it. */
#define KV_POLICIES(X)                                                                             \
    X(FULL, full)                                                                                  \
    X(STREAMING, streaming)                                                                        \
    X(LINEAR, linear)                                                                              \
    X(HEADKV, headkv)                                                                              \
    X(HEATKV, heatkv)                                                                              \
    X(HEATKV_BINARY, heatkv_binary)                                                                \
    X(AMSKV, amskv)                                                                                \
    X(SCALEKV, scalekv)

#define KV_POLICY_KIND_(kind, name) KV_POLICY_##kind,
typedef enum kv_policy_kind { KV_POLICIES(KV_POLICY_KIND_) KV_POLICY_COUNT } kv_policy_kind_t;

/* A set of policies, as a knob's owners: KV_ONLY(STREAMING) | KV_ONLY(HEATKV). */
#define KV_ONLY(kind) (1u << KV_POLICY_##kind)
_Static_assert(KV_POLICY_COUNT <= 32, "a knob's owners are the bits of an unsigned");

struct kv_calibration;

/* Every knob, with the papers' defaults from kv_policy_defaults(). */
typedef struct kv_policy_params {
    kv_policy_kind_t kind;
    double budget; /* fraction of the full cache a head may hold, (0, 1]; full ignores it */
    /* streaming */
    int sink_tokens; /* image tokens after the prefix kept as attention sinks (raster) */
    int sink_scales; /* first scales kept as attention sinks (next-scale models; heatkv too) */
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
    /* amskv (AMS-KV) */
    int amskv_condensed_scales; /* first scales a layer always keeps (C_cds) */
    int amskv_min_scales;       /* C_min: condensed + this many scales ending at the penultimate */
    int amskv_max_scales;       /* C_max: condensed + this many scales ending at the last */
    double amskv_threshold;     /* a layer expands when its inter-scale similarity is below it */
    /* scalekv (ScaleKV) */
    double scalekv_drafters; /* share of the compacted (layer, scale) pairs that are drafters */
    /* Only in the defaults kv_policy_resolve is given: each policy's own
     * budget on the model served, where its card's "kv_budgets" sets one
     * (0: the policy table's); a resolved policy has none. */
    double card_budgets[KV_POLICY_COUNT];
} kv_policy_params_t;

/* Every knob of every policy, one line each:
 *   X(name, policies, type, lo, lo_open, hi, default, help)
 * name is the kv_policy_params_t field, the request field of
 * POST /v1/images/generations and the daemon's config key (flag --name with
 * '-' for '_', variable ARSERVE_NAME); it belongs to `policies` (KV_ONLY
 * bits) alone. type is
 * INT or REAL; values lie in [lo, hi], or (lo, hi] when lo_open. The upper
 * bounds only keep arithmetic in range: whether a value suits a model is
 * kv_policy_check's question. The budget is not listed: every policy but
 * full takes one. Defaults and their sources: docs/kv-policies.md. */
#define KV_POLICY_KNOBS(X)                                                                         \
    /* StreamingLLM §3.1, Tab. 2: four initial tokens suffice as sinks */                         \
    X(sink_tokens, KV_ONLY(STREAMING), INT, 0, 0, 65536, 4,                                        \
      "streaming: image tokens after the prefix kept as attention sinks")                          \
    /* HeatKV §4: s = 3 sink scales for StreamingLLM and HeatKV on Infinity */                    \
    X(sink_scales, KV_ONLY(STREAMING) | KV_ONLY(HEATKV) | KV_ONLY(HEATKV_BINARY), INT, 0, 0, 256,  \
      3,                                                                                           \
      "next-scale models: first scales kept whole as attention sinks (streaming keeps the newest " \
      "tokens its budget holds beside them; heatkv prunes the others by its calibration)")         \
    /* LineAR leaves N_init and r open; issue 5 fixes 1 and 2 */                                   \
    X(anchor_lines, KV_ONLY(LINEAR), INT, 0, 0, 4096, 1,                                           \
      "linear: first image lines always kept (N_init)")                                            \
    X(recent_lines, KV_ONLY(LINEAR), INT, 0, 0, 4096, 2,                                           \
      "linear: most recent complete lines always kept (r)")                                        \
    /* HeadKV §4 step 2 */                                                                        \
    X(headkv_threshold, KV_ONLY(HEADKV), REAL, 0, 1, 1, 0.9,                                       \
      "headkv: attention mass that classifies a head (local when reached within "                  \
      "headkv_local_window tokens)")                                                               \
    /* HeadKV §5.3: a balanced split is best */                                                   \
    X(headkv_alpha, KV_ONLY(HEADKV), REAL, 0, 0, 1, 0.5,                                           \
      "headkv: share of a global head's history kept from the near range (STE)")                   \
    X(headkv_buffer, KV_ONLY(HEADKV), INT, 1, 0, 65536, 8,                                         \
      "headkv: new tokens between cache updates (and queries scored)")                             \
    X(headkv_local_window, KV_ONLY(HEADKV), INT, 0, 0, 65536, 32,                                  \
      "headkv: recent tokens a local head keeps")                                                  \
    /* HeadKV §5.1: "typically two rows" */                                                       \
    X(headkv_recent_lines, KV_ONLY(HEADKV), INT, 0, 0, 4096, 2,                                    \
      "headkv: recent lines a global head keeps")                                                  \
    /* HeadKV A.2: 100 for Janus-Pro and LlamaGen */                                               \
    X(headkv_group_tokens, KV_ONLY(HEADKV), INT, 1, 0, 65536, 100,                                 \
      "headkv: image tokens cached before heads are grouped and the first compression")            \
    /* AMS-KV §4: the first two scales are the condensed scales */                                \
    X(amskv_condensed_scales, KV_ONLY(AMSKV), INT, 0, 0, 256, 2,                                   \
      "amskv: first scales every layer keeps (C_cds)")                                             \
    /* AMS-KV §5: C_min holds the penultimate scale and the condensed ones */                     \
    X(amskv_min_scales, KV_ONLY(AMSKV), INT, 0, 0, 256, 1,                                         \
      "amskv: a layer's capacity C_min holds the condensed scales and this many scales ending "    \
      "with the penultimate")                                                                      \
    /* AMS-KV §5: C_max holds the last two scales and the condensed ones */                       \
    X(amskv_max_scales, KV_ONLY(AMSKV), INT, 0, 0, 256, 2,                                         \
      "amskv: an expanded layer's capacity C_max holds the condensed scales and this many "        \
      "scales ending with the last")                                                               \
    /* AMS-KV App. E: theta = -0.008 (stable from -0.01 to -0.007 on VAR-d30) */                   \
    X(amskv_threshold, KV_ONLY(AMSKV), REAL, -1e6, 0, 0, -0.008,                                   \
      "amskv: a layer expands to C_max when the similarity of its keys to the previous scale's "   \
      "(minus their mean squared distance) falls below this")                                      \
    /* ScaleKV leaves N_d open; its shipped budgets have 5.6% (2B) and 7.5% (8B) drafters */       \
    X(scalekv_drafters, KV_ONLY(SCALEKV), REAL, 0, 0, 1, 0.0625,                                   \
      "scalekv: share of the compacted (layer, scale) pairs classified drafter (kept nearly "      \
      "whole), the least selective by ASI")

typedef enum kv_knob_type { KV_KNOB_INT, KV_KNOB_REAL } kv_knob_type_t;

/* One knob as a value: what the API and the config loop over. */
typedef struct kv_policy_knob {
    const char *name;
    unsigned policies; /* the policies it belongs to (KV_ONLY bits) */
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

/* 1 when k is a knob of policy kind. */
static inline int kv_policy_knob_of(const kv_policy_knob_t *k, kv_policy_kind_t kind) {
    return (unsigned)kind < KV_POLICY_COUNT && (k->policies >> kind) & 1u;
}
/* The first policy k belongs to. */
kv_policy_kind_t kv_policy_knob_owner(const kv_policy_knob_t *k);
/* "streaming, heatkv, heatkv_binary": the policies k belongs to, into buf. */
const char *kv_policy_knob_owners(const kv_policy_knob_t *k, char *buf, size_t cap);

/* The knob called name, or NULL. */
const kv_policy_knob_t *kv_policy_knob_find(const char *name);
double kv_policy_knob_get(const kv_policy_params_t *p, const kv_policy_knob_t *k);
/* Stores v (truncated for an INT knob; callers check with kv_policy_knob_ok). */
void kv_policy_knob_set(kv_policy_params_t *p, const kv_policy_knob_t *k, double v);
/* 1 when v is a value of k: in range, and whole for an INT knob. */
int kv_policy_knob_ok(const kv_policy_knob_t *k, double v);
/* "an integer from 0 to 4096", "a number greater than 0 and at most 1" */
void kv_policy_knob_describe(const kv_policy_knob_t *k, char *buf, size_t cap);

/* ---- what a policy knows about a request ---- */

/* The most segments a request may have: lines of a grid (at most 256, as
 * arserve.json allows) or scales. */
#define KV_MAX_SEGMENTS 256

/* What one step of a request feeds after the condition prefix. */
typedef enum kv_step_unit {
    KV_STEP_TOKEN,   /* one token (raster: the token sampled at the step before) */
    KV_STEP_SEGMENT, /* a whole segment (next-scale: a scale) */
} kv_step_unit_t;

/* A request's KV cache as segments: the condition prefix (n_prompt tokens,
 * fed at step 0), then n_segments segments of segment_tokens[i] tokens
 * (lines or scales), for n_layers x n_heads caches per sequence. With
 * KV_STEP_TOKEN a request has one step per image token: step 0 feeds the
 * prefix, step t > 0 feeds image token t - 1 (the last is never fed). With
 * KV_STEP_SEGMENT it has one step per segment: step 0 feeds the prefix and
 * segment 0, step t > 0 feeds segment t; the last segment's keys and values
 * serve its own step's attention and are never cached (nothing attends to
 * them later; HeatKV's convention, so the cache peaks before the last
 * scale). The model's family makes it (engine/model_family.h); nothing else
 * computes steps. */
typedef struct kv_geometry {
    int n_prompt;
    kv_step_unit_t step_unit;
    int n_segments;
    int segment_tokens[KV_MAX_SEGMENTS];
    int n_layers, n_heads;
    /* The model's KV calibration (engine/policy/kv_calibration.h), which heatkv
     * and heatkv_binary read; NULL when the model has none. */
    const struct kv_calibration *calibration;
} kv_geometry_t;

/* n_segments segments of tokens_each tokens (lines of a raster grid). */
void kv_geometry_uniform(kv_geometry_t *g, int n_prompt, kv_step_unit_t unit, int n_segments,
                         int tokens_each, int n_layers, int n_heads);

/* AR_OK when g is a geometry requests can have; the message names the
 * dimension at fault. */
int kv_geometry_check(const kv_geometry_t *g, ar_error_t *err);

/* Image tokens of the whole request: the sum of its segments. */
int kv_geometry_image_tokens(const kv_geometry_t *g);
/* Steps of a request (see kv_geometry_t). */
int kv_geometry_steps(const kv_geometry_t *g);
/* Image tokens step t feeds into the cache (the prefix not counted). */
int kv_geometry_fed(const kv_geometry_t *g, int t);
/* Image tokens step t samples: one for KV_STEP_TOKEN, segment t's for
 * KV_STEP_SEGMENT; 0 past the last step. Over every step they sum to
 * kv_geometry_image_tokens. */
int kv_geometry_sampled(const kv_geometry_t *g, int t);
/* Tokens every head holds during step t under the full cache (after the
 * step's append): the prefix and every image token fed so far. */
int kv_geometry_held(const kv_geometry_t *g, int t);
/* The step during which segment k's last token is fed (its end), or -1
 * when it never is (a raster grid's last line: its last token is sampled,
 * never fed). */
int kv_geometry_segment_end(const kv_geometry_t *g, int k);

/* ---- the policies ---- */

/* The papers' knobs (the knob table's defaults) and the policy's own budget. */
void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind);

/* A policy's name -> kind; -1 if unknown (names are case-sensitive). */
int kv_policy_parse(const char *name);
const char *kv_policy_name(kv_policy_kind_t kind);
/* The names, in table order, NULL-terminated (choices of the config). */
extern const char *const kv_policy_names[KV_POLICY_COUNT + 1];
/* "full, streaming, linear, headkv" into buf (cap bytes); returns buf. */
const char *kv_policy_list(char *buf, size_t cap);
/* A policy's budget when a request or the config gives none. */
double kv_policy_default_budget(kv_policy_kind_t kind);
/* Every policy that takes a budget with its own (1/6 where it is one over
 * a whole number), then those that take none, in table order: "streaming
 * 1/6, linear 1/6, ...; full and amskv take none" into buf; returns buf. */
const char *kv_policy_budget_list(char *buf, size_t cap);
/* 1 when a policy's budget shapes its cache on geometry g (0 for full, and
 * for streaming on scales, where the sink and recent scales fix it). */
int kv_policy_uses_budget(kv_policy_kind_t kind, const kv_geometry_t *g);

/* 1 when a policy runs on geometries like g at all (raster policies need
 * tokens, HeatKV needs scales); whether its budget and knobs suit g is
 * kv_policy_check's question. */
int kv_policy_suits(kv_policy_kind_t kind, const kv_geometry_t *g);

/* What a request or a config says about its KV policy, each part optional.
 * has_kind 0: the default's kind; budget 0: none given; knobs_given[i]
 * nonzero: knob kv_policy_knobs[i] given, its value in knobs (a flag per
 * knob: no word's width caps the knobs). */
typedef struct kv_policy_overrides {
    int has_kind;
    kv_policy_kind_t kind;
    double budget;
    unsigned char knobs_given[KV_POLICY_N_KNOBS];
    kv_policy_params_t knobs;
} kv_policy_overrides_t;

/* A budget range (elastic budgets): a request runs at the largest budget
 * from min up to max that fits the KV pool when it is admitted. min 0: no
 * range (one fixed budget); max 0: the budget the request resolves to. */
typedef struct kv_budget_range {
    double min, max;
} kv_budget_range_t;

/* The policy a request runs with, resolved once: o's kind, else the
 * defaults' (the daemon's config); o's budget, else the defaults' when
 * positive, else the policy's own on the model (the defaults' card_budgets,
 * else the table's); o's knobs over the defaults' knobs.
 * A knob given for another policy than the request's, or a budget given
 * to a policy that takes none, is an error naming the knob or "kv_budget"
 * (*field, may be NULL): it would be ignored, and the client would never
 * know. defaults NULL: full and the papers' knobs. */
int kv_policy_resolve(const kv_policy_params_t *defaults, const kv_policy_overrides_t *o,
                      kv_policy_params_t *out, const char **field, ar_error_t *err);

/* Checks p for a request of geometry g: the geometry, the policy's budget
 * and knob ranges (as in KV_POLICY_KNOBS), then the policy's own rules (a
 * budget too small to hold the prefix and the recent window, a geometry it
 * does not work on, ...). The message names the setting; so does *field
 * (may be NULL): a knob's name, "budget" (also when the budget is too small
 * for the knobs), or NULL for the geometry or the kind. */
int kv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                    ar_error_t *err);

/* kv_policy_check, then the worst-case tokens one head holds during each
 * step t (after the step's append, before its compaction), for t in
 * [0, kv_geometry_steps(g)); a layered policy's heads differ, and tokens[t]
 * is the most any head holds. Exact where kv_policy_plan_exact says so,
 * else a worst case (kv_policy_remaining_blocks tightens it as requests
 * run). */
int kv_policy_trajectory(const kv_policy_params_t *p, const kv_geometry_t *g, int *tokens,
                         const char **field, ar_error_t *err);

/* The same counted as the engine holds it in a pool of block_tokens-token
 * blocks: blocks[t] is the most blocks one sequence's (layer, head) caches
 * hold together at any moment of step t (tokens may be NULL). For a policy
 * that compacts after steps that is every head's ceil(tokens / block)
 * after the append; for a layered one the engine's own order, simulated
 * with the policy's hooks: the step begin's compaction, then layer by
 * layer compaction and append. */
int kv_policy_trajectory_blocks(const kv_policy_params_t *p, const kv_geometry_t *g,
                                int block_tokens, long long *blocks, int *tokens,
                                const char **field, ar_error_t *err);

/* 1 when kind's trajectory is exact: every (layer, head) holds what it says
 * during every step, so a pool's use equals the sum of its requests'
 * plans; 0 when it is a worst case some heads stay below. The policy
 * table says which (kv_policy_ops_t.plan_bound). */
int kv_policy_plan_exact(kv_policy_kind_t kind);

/* 1 when every sequence of p on g holds, at its peak, exactly the plan's
 * peak (kv_policy_trajectory's most tokens, and so its blocks): every exact
 * plan, and a worst case whose first peak comes while every head still
 * holds what it says (HeadKV's when it peaks no later than its grouping);
 * 0 otherwise, when p fails on g, or out of memory. */
int kv_policy_peak_exact(const kv_policy_params_t *p, const kv_geometry_t *g);

/* The policy kv_policy "auto" means on geometry g (elastic budgets run it
 * from its least budget up to 1): defaults' kind when its budget shapes
 * g's cache and it runs on g, else the first of linear, heatkv, scalekv,
 * streaming that does (with the papers' knobs); -1 when none does.
 * defaults may be NULL. */
int kv_policy_auto(const kv_policy_params_t *defaults, const kv_geometry_t *g);

/* The least budget, on a 1e-4 grid, with which p (its knobs as they are)
 * passes kv_policy_check on g: the budget a smaller cache cannot go below.
 * 0 when the budget does not shape p's cache (full); -1 when p fails on g
 * at any budget (another knob, a missing calibration, a raster policy on a
 * next-scale model). Assumes, as every policy's check does, that a larger
 * budget never fails where a smaller one passes. */
double kv_policy_min_budget(const kv_policy_params_t *p, const kv_geometry_t *g);

/* What p's budget comes to on geometry g, in words, for people ("B = 4 of
 * 24 lines = ..."); the check's message when p does not suit g. */
void kv_policy_describe(const kv_policy_params_t *p, const kv_geometry_t *g, char *buf, size_t cap);

/* Statistics a policy asks the engine to collect (bits). */
enum {
    KV_STATS_KEY_MASS = 1, /* softmax mass each key received from the step's queries */
    /* Raw logits (kv_policy_window_queries) each key received from a few of
     * the step's queries, summed (ScaleKV's scores) */
    KV_STATS_WINDOW_LOGITS = 2,
};
unsigned kv_policy_stats(kv_policy_kind_t kind);

/* The most queries kv_policy_window_queries names. */
#define KV_MAX_WINDOW_QUERIES 64

/* One sequence's policy state. kv_policy_begin checks p on g (NULL, err
 * filled, when kv_policy_check fails or memory runs out). */
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

/* A plan that tightens: once a request's uncertainty has resolved (HeadKV
 * has grouped its heads, an AMS-KV layer has expanded or not), the rest of
 * its trajectory from step `step` on is known better than the plan's worst
 * case. From the state after step - 1 and the heads' lengths len[layer *
 * n_heads + head] now, writes blocks[i] for step + i (the most blocks one
 * sequence's heads hold at any moment of that step, as
 * kv_policy_trajectory_blocks counts them) and returns 1; the future is
 * still taken at its worst (no key mass, the lowest similarity), so no run
 * exceeds it. 0 when the policy cannot tell more than it could before step
 * - 1 (its plan is exact, it keeps no state to start from, or step - 1
 * settled nothing: the simulation costs steps x heads, so it runs only
 * when something changed); -1 out of memory. */
int kv_policy_remaining_blocks(const kv_policy_state_t *s, int step, const int *len,
                               int block_tokens, long long *blocks, ar_error_t *err);

/* Layered policies (next-scale ones that prune inside a step, HeatKV's
 * early pruning) also compact during the forward pass: */
int kv_policy_layered(const kv_policy_state_t *s);
/* The same for a kind on geometry g: its requests hold the most at some
 * layer of a step, so requests at different steps in one batch peak at
 * different moments. */
int kv_policy_kind_layered(kv_policy_kind_t kind, const kv_geometry_t *g);
/* Before step t's forward, for one (layer, head) holding len tokens:
 * KV_COMPACT and a keep list, or 0. */
int kv_policy_step_begin(kv_policy_state_t *s, int step, int layer, int head, int len, int *keep,
                         int *n_keep);
/* Before `layer` attends during step t (its keys for the step computed):
 * does kv_policy_layer_begin want the layer's inter-scale key similarity?
 * 1: the engine measures it (minus the mean squared distance between the
 * step's keys and the previous scale's cached keys resized to them, over
 * every head; AMS-KV eq. 3); 0: it passes NaN. The previous scale's keys
 * are the newest rows of each of the layer's heads when it asks. */
int kv_policy_layer_similarity(const kv_policy_state_t *s, int step, int layer);
/* Then, for each of the layer's heads in order (head 0 first), holding len
 * tokens: KV_COMPACT and a keep list, or 0 (the layer attends to what it
 * keeps). similarity is NaN when not measured; a policy's counts may
 * depend on it, and -INFINITY gives the most tokens held (the planner's
 * worst case). */
int kv_policy_layer_begin(kv_policy_state_t *s, int step, int layer, int head, int len,
                          double similarity, int *keep, int *n_keep);
/* After `layer` has attended during step t, before the step's new tokens
 * are appended to it: KV_COMPACT and a keep list, or 0; *cache is how many
 * of the step's new tokens (the newest) are appended to this head: all of
 * them unless the policy says fewer, 0 when they are only attended (and
 * never cached). */
int kv_policy_layer_end(kv_policy_state_t *s, int step, int layer, int head, int len, int *keep,
                        int *n_keep, int *cache);
/* Once the layer's cached heads have the step's new tokens (len counts
 * them): KV_COMPACT and a keep list, or 0 (a scale larger than what the
 * head may keep is appended, then cut). mass: the head's key mass from the
 * step's queries (len floats, host), or NULL when not collected; for a
 * policy collecting KV_STATS_WINDOW_LOGITS, the scores its window queries
 * gave (below). */
int kv_policy_layer_stored(kv_policy_state_t *s, int step, int layer, int head, int len,
                           const float *mass, int *keep, int *n_keep);

/* For a policy collecting KV_STATS_WINDOW_LOGITS, before
 * kv_policy_layer_stored of the same (layer, head, len): the queries that
 * score the head's keys, as rows of the step (0-based, the order they are
 * summed in, repeats counted), into rows (KV_MAX_WINDOW_QUERIES entries);
 * 0 when the head is not cut and needs no scores. The engine then passes
 * layer_stored, for every key j < len, sum over those rows r of
 * q_r . k_j / sqrt(head_dim), q_r the row's raw query projection (before
 * any bias, normalisation or rotation; ScaleKV's `mat_qkv(x)`) and k_j
 * the key as cached. */
int kv_policy_window_queries(const kv_policy_state_t *s, int step, int layer, int head, int len,
                             int *rows);
/* 1 when s's policy collects KV_STATS_WINDOW_LOGITS (s may be NULL). */
int kv_policy_window_logits(const kv_policy_state_t *s);

/* Watches a state's compactions (tests, tracing): after every call above
 * that returns KV_COMPACT, fn gets its step, layer, head, len and keep list.
 * fn NULL stops. */
typedef void (*kv_policy_observer_fn)(void *ctx, int step, int layer, int head, int len,
                                      const int *keep, int n_keep);
void kv_policy_observe(kv_policy_state_t *s, kv_policy_observer_fn fn, void *ctx);

#endif
