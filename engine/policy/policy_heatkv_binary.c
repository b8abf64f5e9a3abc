/* Binary-HeatKV: HeatKV (policy_heatkv.c) with whole heads as the unit: a
 * pruned head keeps only the sink scales, heads taken by the CAS ordering
 * (HeatKV eq. 3, Algorithm 1's binary case). */
#include "engine/policy/heatkv.h"
#include "engine/policy/kv_policy_impl.h"

#include <stdlib.h>

static int binary_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                        ar_error_t *err) {
    return heatkv_policy_check(p, g, 1, field, err);
}

static void *binary_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    return heatkv_policy_begin(p, g, 1);
}

const kv_policy_ops_t kv_policy_heatkv_binary = {
    .name = "heatkv_binary",
    .default_budget = 0.1,
    .takes_budget = 1,
    .step_units = 1u << KV_STEP_SEGMENT,
    .check = binary_check,
    .begin = binary_begin,
    .end = heatkv_policy_end,
    .step_begin = heatkv_policy_step_begin,
    .layer_end = heatkv_policy_layer_end,
    .describe = heatkv_policy_describe,
};
