/* A next-scale model's KV calibration (HeatKV §3.1): the attention mass
 * each query scale gave each earlier source scale, per (layer, head),
 * averaged over calibration prompts on the conditional row (eq. 2), and the
 * head orderings derived from it, lowest first: S-CAS per source scale
 * (eq. 4) and CAS (eq. 3, which depends on the sink scales). `arserve
 * calibrate` writes it to the model directory as KV_CALIBRATION_FILE; the
 * model loads it when present; heatkv, heatkv_binary and scalekv read it. A
 * head is numbered layer * n_heads + head. A calibration holds one image
 * size's scales; a model's file holds one per size calibrated
 * (kv_calibration_set_t). Format: docs/kv-policies.md. */
#ifndef ARSERVE_KV_CALIBRATION_H
#define ARSERVE_KV_CALIBRATION_H

#include "base/status.h"
#include "engine/policy/kv_policy.h"

#define KV_CALIBRATION_FILE "kv_calibration.json"
/* K' of ScaleKV's history top-K ratio (the paper leaves it open): as many
 * keys as its observation window has queries. */
#define KV_CALIBRATION_TOPK 16
/* The most image sizes one file calibrates (a model's sizes: MODEL_MAX_SIZES). */
#define KV_CALIBRATION_MAX_SIZES 16

typedef struct kv_calibration {
    int n_layers, n_heads, n_scales;
    int scale_tokens[KV_MAX_SEGMENTS]; /* tokens of each scale */
    /* The image size it was made at, as the API names it ("WxH"); "" when
     * not known (synthetic, or a file from before sizes were named): such
     * an entry goes with any size of its scale_tokens. Sizes of transposed
     * aspect ratios have equal token counts, and their own calibrations. */
    char size[24];
    int sink_scales; /* the s that cas_order was computed with */
    int n_prompts;   /* 0: a synthetic ordering (no data behind it) */
    /* beta[(head * n_scales + q) * n_scales + src]: mean mass from scale q's
     * queries to scale src's keys (0 for src > q); NULL when synthetic. */
    float *beta;
    /* htr[head * n_scales + q]: ScaleKV's history top-K ratio, the mass the
     * KV_CALIBRATION_TOPK most attended earlier keys get from scale q's
     * queries, per query (from their summed mass, so a lower bound); NULL
     * when not collected (older files, synthetic). */
    float *htr;
    int *cas_order;  /* n_layers * n_heads heads, lowest CAS first */
    int *scas_order; /* per source scale src < n_scales - 1: n_layers * n_heads heads at
                        scas_order + src * n_layers * n_heads, lowest S-CAS first */
} kv_calibration_t;

/* Orderings from beta (n_layers * n_heads * n_scales^2 values, copied) for
 * s sink scales. AR_ERR only when out of memory. */
int kv_calibration_from_beta(kv_calibration_t *c, const kv_geometry_t *g, const float *beta,
                             int n_prompts, int sink_scales, ar_error_t *err);

/* A synthetic calibration for geometry g: every ordering is head order,
 * and every head's statistics alike (ScaleKV's drafters then fall to the
 * first layers). What a budget costs in bytes does not depend on which
 * heads go first, so `arserve plan` uses it for models without weights. */
int kv_calibration_synthetic(kv_calibration_t *c, const kv_geometry_t *g, int sink_scales,
                             ar_error_t *err);

void kv_calibration_free(kv_calibration_t *c);

/* AR_OK when c was made for geometry g (layers, heads, scales); else the
 * message says what differs and how to recalibrate. */
int kv_calibration_check(const kv_calibration_t *c, const kv_geometry_t *g, ar_error_t *err);

/* Writes c alone to path as JSON (version 1); kv_calibration_set_load reads
 * it back (every field checked: errors name the file and the field). */
int kv_calibration_save(const kv_calibration_t *c, const char *path, ar_error_t *err);

/* A model's calibrations, one per image size (its scales' token counts),
 * in the file's order. */
typedef struct kv_calibration_set {
    int n;
    kv_calibration_t c[KV_CALIBRATION_MAX_SIZES];
} kv_calibration_set_t;

/* The entry made at the image size named size (g's scales): the one of
 * that name, else an unnamed one of g's scale_tokens; NULL when none is (or
 * s is NULL). */
const kv_calibration_t *kv_calibration_set_pick(const kv_calibration_set_t *s, const char *size,
                                                const kv_geometry_t *g);

/* Moves *c into s (then zeroed), in place of the entry of its size if
 * there is one, else at the end; AR_ERR (c kept) when s is full. */
int kv_calibration_set_put(kv_calibration_set_t *s, kv_calibration_t *c, ar_error_t *err);

void kv_calibration_set_free(kv_calibration_set_t *s);

/* The file: one calibration as kv_calibration_save writes it (version 1),
 * several as version 2's "calibrations" array; load reads either, every
 * field checked (errors name the file, the entry and the field). */
int kv_calibration_set_save(const kv_calibration_set_t *s, const char *path, ar_error_t *err);
int kv_calibration_set_load(kv_calibration_set_t *s, const char *path, ar_error_t *err);

#endif
