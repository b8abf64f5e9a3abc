/* The table of KV policies, indexed by kv_policy_kind_t: the one list the
 * dispatcher (engine/policy/kv_policy.c) reads. In an object of its own so that a
 * test may link a table with a policy of its own instead. */
#include "engine/policy/kv_policy_impl.h"

#define KV_POLICY_ENTRY_(kind, name) [KV_POLICY_##kind] = &kv_policy_##name,
const kv_policy_ops_t *const kv_policy_table[KV_POLICY_COUNT] = {KV_POLICIES(KV_POLICY_ENTRY_)};
