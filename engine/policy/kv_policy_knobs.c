/* The table of KV policy knobs (KV_POLICY_KNOBS in kv_policy.h) as values,
 * so the HTTP API and the daemon's config loop over one description of
 * every knob: its name, policy, type, range and default. */
#include "engine/policy/kv_policy.h"

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "base/text.h"

#define KV_KNOB_TYPE_INT KV_KNOB_INT
#define KV_KNOB_TYPE_REAL KV_KNOB_REAL
#define KNOB_ENTRY(name_, policies_, type_, lo_, lo_open_, hi_, def_, help_)                       \
    {.name = #name_,                                                                               \
     .policies = policies_,                                                                        \
     .type = KV_KNOB_TYPE_##type_,                                                                 \
     .lo = lo_,                                                                                    \
     .hi = hi_,                                                                                    \
     .lo_open = lo_open_,                                                                          \
     .def = def_,                                                                                  \
     .offset = offsetof(kv_policy_params_t, name_),                                                \
     .help = help_},

const kv_policy_knob_t kv_policy_knobs[KV_POLICY_N_KNOBS] = {KV_POLICY_KNOBS(KNOB_ENTRY)};

/* Each knob's type is its field's: checked once, at compile time. */
#define KNOB_FIELD_TYPE_INT int
#define KNOB_FIELD_TYPE_REAL double
#define KNOB_TYPE_CHECK(name_, policies_, type_, ...)                                              \
    _Static_assert(__builtin_types_compatible_p(__typeof__(((kv_policy_params_t *)0)->name_),      \
                                                KNOB_FIELD_TYPE_##type_),                          \
                   #name_ ": the field's type is not the knob's");
KV_POLICY_KNOBS(KNOB_TYPE_CHECK)

const kv_policy_knob_t *kv_policy_knob_find(const char *name) {
    for (int i = 0; name && i < KV_POLICY_N_KNOBS; i++)
        if (strcmp(name, kv_policy_knobs[i].name) == 0)
            return &kv_policy_knobs[i];
    return NULL;
}

kv_policy_kind_t kv_policy_knob_owner(const kv_policy_knob_t *k) {
    for (int i = 0; i < KV_POLICY_COUNT; i++)
        if (kv_policy_knob_of(k, (kv_policy_kind_t)i))
            return (kv_policy_kind_t)i;
    return KV_POLICY_FULL;
}

const char *kv_policy_knob_owners(const kv_policy_knob_t *k, char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < KV_POLICY_COUNT; i++)
        if (kv_policy_knob_of(k, (kv_policy_kind_t)i))
            text_append(buf, cap, &used, "%s%s", used ? ", " : "",
                        kv_policy_name((kv_policy_kind_t)i));
    return buf;
}

double kv_policy_knob_get(const kv_policy_params_t *p, const kv_policy_knob_t *k) {
    const char *at = (const char *)p + k->offset;
    if (k->type == KV_KNOB_INT) {
        int v;
        memcpy(&v, at, sizeof v);
        return v;
    }
    double v;
    memcpy(&v, at, sizeof v);
    return v;
}

void kv_policy_knob_set(kv_policy_params_t *p, const kv_policy_knob_t *k, double v) {
    char *at = (char *)p + k->offset;
    if (k->type == KV_KNOB_INT) {
        int i = isfinite(v) && fabs(v) < INT_MAX ? (int)v : (v < 0 ? INT_MIN : INT_MAX);
        memcpy(at, &i, sizeof i);
    } else {
        memcpy(at, &v, sizeof v);
    }
}

int kv_policy_knob_ok(const kv_policy_knob_t *k, double v) {
    if (!isfinite(v) || v > k->hi || (k->lo_open ? !(v > k->lo) : !(v >= k->lo)))
        return 0;
    return k->type == KV_KNOB_REAL || v == floor(v);
}

void kv_policy_knob_describe(const kv_policy_knob_t *k, char *buf, size_t cap) {
    const char *what = k->type == KV_KNOB_INT ? "an integer" : "a number";
    if (k->lo_open)
        snprintf(buf, cap, "%s greater than %g and at most %g", what, k->lo, k->hi);
    else
        snprintf(buf, cap, "%s from %g to %g", what, k->lo, k->hi);
}
