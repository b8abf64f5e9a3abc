/* fp8 KV scales: per (layer, head), the largest |K| and |V| the model's
 * cache held over calibration prompts, from which an e4m3 cache takes
 * scale = amax / 448 (its largest finite value), so each head's values
 * fill the type's range instead of sinking into its subnormals or
 * saturating (vLLM's k_scale and v_scale, per head rather than per layer).
 * `arserve calibrate --kv-scales` measures them and writes FP8_SCALES_FILE
 * into the model directory; model_load reads it when present, and requests
 * whose pool stores fp8 take its scales (without it every scale is 1).
 * Heads are numbered layer * n_heads + head. Format: docs/kv-cache.md. */
#ifndef ARSERVE_FP8_SCALES_H
#define ARSERVE_FP8_SCALES_H

#include "base/status.h"
#include "engine/kv/kv_seq.h"

#define FP8_SCALES_FILE "kv_scales.json"

typedef struct fp8_scales {
    int n_layers, n_heads, n_prompts;
    float *k_amax, *v_amax; /* n_layers * n_heads each; NULL when there are none */
} fp8_scales_t;

/* A head's e4m3 scale from its amax: amax / 448, and 1 for a head that
 * held only zeros. */
float fp8_scale_of(float amax);

/* Empty amaxes (all 0) for n_layers x n_heads heads. */
int fp8_scales_init(fp8_scales_t *s, int n_layers, int n_heads, ar_error_t *err);
void fp8_scales_free(fp8_scales_t *s);

/* Raises s's amaxes to the largest |K| and |V| that seq holds now (read
 * through the pool's backend; the sequence's geometry must be s's). */
int fp8_scales_observe(fp8_scales_t *s, const kv_seq_t *seq, ar_error_t *err);

/* Gives each head of seq its scales from s (which must fit its geometry). */
void fp8_scales_apply(const fp8_scales_t *s, kv_seq_t *seq);

/* Writes s to path as JSON; reads it back (every field checked: errors
 * name the file and the field). */
int fp8_scales_save(const fp8_scales_t *s, const char *path, ar_error_t *err);
int fp8_scales_load(fp8_scales_t *s, const char *path, ar_error_t *err);

#endif
