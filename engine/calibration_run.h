/* Calibration runs (HeatKV §3.1): full-cache generations of a next-scale
 * model whose conditional row's attention mass, per (layer, head), from
 * each query scale to each source scale (eq. 2) is averaged over the
 * prompts given, then turned into orderings (engine/policy/kv_calibration.h). */
#ifndef ARSERVE_CALIBRATION_RUN_H
#define ARSERVE_CALIBRATION_RUN_H

#include "engine/kv/fp8_scales.h"
#include "engine/model.h"
#include "engine/policy/kv_calibration.h"

/* Called after each generation: done of total. */
typedef void (*calibration_progress_fn)(int done, int total, void *ctx);

/* Generates one image per prompt in prompts[0..n) (seed = its index) at
 * image size `size` (an index into image.sizes) under the full cache, K and
 * V stored as kv_dtype (DTYPE_F32 for statistics at full precision; a
 * 16-bit type halves the pool, for a model whose f32 cache does not fit),
 * with the model's sampling, and fills *out (that size's scales) for
 * sink_scales. A prompt is text for a text-prompted model (Infinity), a
 * class name or number for a class-conditional one (VAR); AR_ERR names the
 * prompt or step at fault. */
int calibration_run(model_t *m, const char *const *prompts, int n, int size, dtype_t kv_dtype,
                    int sink_scales, calibration_progress_fn progress, void *ctx,
                    kv_calibration_t *out, ar_error_t *err);

/* The same at the default size, teacher-forced (tests against a reference's calibration): where
 * forced and forced[p] are not NULL, prompt p's image takes the tokens
 * forced[p] (the family's layout at the default size, as
 * gen_request_t.forced) instead of sampling them, so that both sides
 * attend over the same image. */
int calibration_run_forced(model_t *m, const char *const *prompts, const int *const *forced, int n,
                           int sink_scales, calibration_progress_fn progress, void *ctx,
                           kv_calibration_t *out, ar_error_t *err);

/* fp8 KV scales (fp8_scales.h) of any model: one full-cache generation per
 * prompt (seed = its index, the model's sampling, K and V kept in fp32),
 * the largest |K| and |V| of both rows' caches per (layer, head) once the
 * image is done. A prompt is text for a text-prompted model, a class name
 * or number for a class-conditional one; AR_ERR names the prompt at
 * fault. */
int fp8_scales_measure(model_t *m, const char *const *prompts, int n,
                       calibration_progress_fn progress, void *ctx, fp8_scales_t *out,
                       ar_error_t *err);

#endif
