/* The full cache: every token of every head stays. No state, no statistics,
 * no step-end work: the generation loop never calls a policy for it. */
#include "engine/policy/kv_policy_impl.h"

const kv_policy_ops_t kv_policy_full = {
    .name = "full",
    .default_budget = 1.0,
    .takes_budget = 0,
};
