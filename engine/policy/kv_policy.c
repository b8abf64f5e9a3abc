/* The KV policies' common part (kv_policy.h): request geometry, names,
 * defaults, resolution and checks, the trajectory, and the dispatch to each
 * policy's file through kv_policy_table. Every rule, its paper reference and
 * the choices made where a paper is silent are in docs/kv-policies.md; the
 * step convention is docs/kv-cache.md's. */
#include "engine/policy/kv_policy_impl.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/text.h"

struct kv_policy_state {
    const kv_policy_ops_t *ops;
    void *impl;
    int steps; /* kv_geometry_steps(&g) */
    kv_geometry_t g;
    kv_policy_observer_fn observer; /* kv_policy_observe */
    void *observer_ctx;
};

/* What a compaction hook returned, shown to the state's observer. */
static int observed(const kv_policy_state_t *s, int what, int step, int layer, int head, int len,
                    const int *keep, const int *n_keep) {
    if ((what & KV_COMPACT) && s->observer)
        s->observer(s->observer_ctx, step, layer, head, len, keep, *n_keep);
    return what;
}

void kv_policy_observe(kv_policy_state_t *s, kv_policy_observer_fn fn, void *ctx) {
    if (s) {
        s->observer = fn;
        s->observer_ctx = ctx;
    }
}

/* ---- geometry ---- */

void kv_geometry_uniform(kv_geometry_t *g, int n_prompt, kv_step_unit_t unit, int n_segments,
                         int tokens_each, int n_layers, int n_heads) {
    memset(g, 0, sizeof *g);
    g->n_prompt = n_prompt;
    g->step_unit = unit;
    g->n_segments = n_segments;
    for (int i = 0; i < n_segments && i < KV_MAX_SEGMENTS; i++)
        g->segment_tokens[i] = tokens_each;
    g->n_layers = n_layers;
    g->n_heads = n_heads;
}

int kv_geometry_check(const kv_geometry_t *g, ar_error_t *err) {
    if (g->step_unit != KV_STEP_TOKEN && g->step_unit != KV_STEP_SEGMENT)
        return ar_errorf(err, "geometry: unknown step unit %d", (int)g->step_unit);
    /* Step 0 feeds the prefix: with one token per step it must hold one. */
    if (g->n_prompt < (g->step_unit == KV_STEP_TOKEN ? 1 : 0))
        return ar_errorf(err, "geometry: n_prompt must be at least %d; got %d",
                         g->step_unit == KV_STEP_TOKEN ? 1 : 0, g->n_prompt);
    if (g->n_segments < 1 || g->n_segments > KV_MAX_SEGMENTS)
        return ar_errorf(err, "geometry: %d segments (lines or scales); 1 to %d are possible",
                         g->n_segments, KV_MAX_SEGMENTS);
    if (g->n_layers < 1 || g->n_heads < 1)
        return ar_errorf(err, "geometry: n_layers and n_heads must be at least 1; got %d, %d",
                         g->n_layers, g->n_heads);
    long long total = g->n_prompt;
    for (int i = 0; i < g->n_segments; i++) {
        if (g->segment_tokens[i] < 1)
            return ar_errorf(err,
                             "geometry: segment %d (a line or scale) holds %d tokens; every "
                             "segment holds at least 1",
                             i, g->segment_tokens[i]);
        total += g->segment_tokens[i];
        if (total > INT_MAX / 4)
            return ar_errorf(err, "geometry: %d prompt tokens + %d segments is too many tokens",
                             g->n_prompt, g->n_segments);
    }
    return AR_OK;
}

int kv_geometry_image_tokens(const kv_geometry_t *g) {
    int n = 0;
    for (int i = 0; i < g->n_segments; i++)
        n += g->segment_tokens[i];
    return n;
}

int kv_geometry_steps(const kv_geometry_t *g) {
    return g->step_unit == KV_STEP_TOKEN ? kv_geometry_image_tokens(g) : g->n_segments;
}

int kv_geometry_fed(const kv_geometry_t *g, int t) {
    if (g->step_unit == KV_STEP_TOKEN)
        return t > 0;
    /* The last scale attends to itself and is never cached. */
    return t >= 0 && t < g->n_segments - 1 ? g->segment_tokens[t] : 0;
}

int kv_geometry_sampled(const kv_geometry_t *g, int t) {
    if (t < 0 || t >= kv_geometry_steps(g))
        return 0;
    return g->step_unit == KV_STEP_TOKEN ? 1 : g->segment_tokens[t];
}

int kv_geometry_held(const kv_geometry_t *g, int t) {
    if (g->step_unit == KV_STEP_TOKEN)
        return g->n_prompt + t;
    int n = g->n_prompt;
    for (int i = 0; i <= t && i < g->n_segments; i++)
        n += kv_geometry_fed(g, i);
    return n;
}

int kv_geometry_segment_end(const kv_geometry_t *g, int k) {
    if (k < 0 || k >= g->n_segments)
        return -1;
    if (g->step_unit == KV_STEP_SEGMENT)
        return k;
    int fed = 0; /* image tokens fed through the step that ends segment k */
    for (int i = 0; i <= k; i++)
        fed += g->segment_tokens[i];
    return fed < kv_geometry_steps(g) ? fed : -1;
}

int kv_geometry_lines(const kv_geometry_t *g, const char *policy, int *w, int *h, ar_error_t *err) {
    int uniform = g->step_unit == KV_STEP_TOKEN;
    for (int i = 1; uniform && i < g->n_segments; i++)
        uniform = g->segment_tokens[i] == g->segment_tokens[0];
    if (!uniform) {
        ar_errorf(err,
                  "%s works on raster models (one token per step, lines of equal length); "
                  "this model's steps are %s",
                  policy,
                  g->step_unit == KV_STEP_TOKEN ? "tokens in segments of unequal length"
                                                : "whole segments (scales)");
        return 0;
    }
    *w = g->segment_tokens[0];
    *h = g->n_segments;
    return 1;
}

/* ---- names and defaults ---- */

#define KV_POLICY_NAME_(kind, name) #name,
const char *const kv_policy_names[KV_POLICY_COUNT + 1] = {KV_POLICIES(KV_POLICY_NAME_) NULL};

static const kv_policy_ops_t *ops_of(kv_policy_kind_t kind) {
    return (unsigned)kind < KV_POLICY_COUNT ? kv_policy_table[kind] : NULL;
}

int kv_policy_parse(const char *name) {
    for (int i = 0; name && i < KV_POLICY_COUNT; i++)
        if (strcmp(name, kv_policy_names[i]) == 0)
            return i;
    return -1;
}

const char *kv_policy_name(kv_policy_kind_t kind) {
    return (unsigned)kind < KV_POLICY_COUNT ? kv_policy_names[kind] : "unknown";
}

const char *kv_policy_list(char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < KV_POLICY_COUNT; i++)
        text_append(buf, cap, &used, "%s%s", i ? ", " : "", kv_policy_names[i]);
    return buf;
}

double kv_policy_default_budget(kv_policy_kind_t kind) {
    const kv_policy_ops_t *ops = ops_of(kind);
    return ops ? ops->default_budget : 1.0;
}

/* A budget as people write it: "1/6" when it is one over a whole number
 * (as a double, exactly), else "%g" ("0.3"); returns buf. */
static const char *budget_text(double budget, char *buf, size_t cap) {
    const double inv = budget > 0 ? floor(1 / budget + 0.5) : 0;
    if (inv >= 1 && inv <= 1e6 && 1 / inv == budget)
        snprintf(buf, cap, "1/%.0f", inv);
    else
        snprintf(buf, cap, "%g", budget);
    return buf;
}

const char *kv_policy_budget_list(char *buf, size_t cap) {
    size_t used = 0;
    int n_with = 0, n_none = 0, none_left = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < KV_POLICY_COUNT; i++)
        none_left += !kv_policy_table[i]->takes_budget;
    for (int i = 0; i < KV_POLICY_COUNT; i++) {
        const kv_policy_ops_t *ops = kv_policy_table[i];
        if (!ops->takes_budget)
            continue;
        char b[32];
        text_append(buf, cap, &used, "%s%s %s", n_with++ ? ", " : "", kv_policy_names[i],
                    budget_text(ops->default_budget, b, sizeof b));
    }
    for (int i = 0; i < KV_POLICY_COUNT; i++) {
        if (kv_policy_table[i]->takes_budget)
            continue;
        const char *sep = n_none == 0 ? (n_with ? "; " : "") : none_left == 1 ? " and " : ", ";
        text_append(buf, cap, &used, "%s%s", sep, kv_policy_names[i]);
        n_none++;
        none_left--;
    }
    if (n_none)
        text_append(buf, cap, &used, " take%s none", n_none == 1 ? "s" : "");
    return buf;
}

int kv_policy_uses_budget(kv_policy_kind_t kind, const kv_geometry_t *g) {
    const kv_policy_ops_t *ops = ops_of(kind);
    if (!ops || !ops->takes_budget)
        return 0;
    return ops->uses_budget && g ? ops->uses_budget(g) : 1;
}

int kv_policy_suits(kv_policy_kind_t kind, const kv_geometry_t *g) {
    const kv_policy_ops_t *ops = ops_of(kind);
    return ops && (!ops->step_units || (ops->step_units >> g->step_unit & 1u));
}

unsigned kv_policy_stats(kv_policy_kind_t kind) {
    const kv_policy_ops_t *ops = ops_of(kind);
    return ops ? ops->stats : 0;
}

void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind) {
    memset(p, 0, sizeof *p);
    p->kind = kind;
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        kv_policy_knob_set(p, &kv_policy_knobs[i], kv_policy_knobs[i].def);
    p->budget = kv_policy_default_budget(kind);
}

/* The field a failed check names. */
static int fail_at(const char **field, const char *name) {
    if (field)
        *field = name;
    return AR_ERR;
}

int kv_policy_resolve(const kv_policy_params_t *defaults, const kv_policy_overrides_t *o,
                      kv_policy_params_t *out, const char **field, ar_error_t *err) {
    if (field)
        *field = NULL;
    const kv_policy_kind_t kind = o && o->has_kind ? o->kind
                                  : defaults       ? defaults->kind
                                                   : KV_POLICY_FULL;
    kv_policy_defaults(out, kind);
    if (defaults) {
        for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
            kv_policy_knob_set(out, &kv_policy_knobs[i],
                               kv_policy_knob_get(defaults, &kv_policy_knobs[i]));
        if (defaults->card_budgets[kind] > 0)
            out->budget = defaults->card_budgets[kind];
        if (defaults->budget > 0)
            out->budget = defaults->budget;
    }
    if (!o)
        return AR_OK;
    /* A budget given to a policy that takes none would be ignored, and the
     * client would believe it ran at that budget. */
    if (o->budget > 0 && !ops_of(kind)->takes_budget) {
        if (o->has_kind)
            ar_errorf(err,
                      "kv_budget: kv_policy %s takes no budget; leave kv_budget out or name "
                      "a policy that takes one",
                      kv_policy_name(kind));
        else
            ar_errorf(err,
                      "kv_budget: this request has no kv_policy and the server's default, "
                      "%s, takes no budget: send a kv_policy that takes one with it",
                      kv_policy_name(kind));
        return fail_at(field, "kv_budget");
    }
    if (o->budget > 0)
        out->budget = o->budget;
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        if (!o->knobs_given[i])
            continue;
        if (!kv_policy_knob_of(k, kind)) {
            char owners[128];
            kv_policy_knob_owners(k, owners, sizeof owners);
            if (o->has_kind)
                ar_errorf(err, "%s is a knob of kv_policy %s; this request's kv_policy is %s",
                          k->name, owners, kv_policy_name(kind));
            else
                ar_errorf(err,
                          "%s is a knob of kv_policy %s; this request has no kv_policy and the "
                          "server's default is %s: send \"kv_policy\": \"%s\" with it",
                          k->name, owners, kv_policy_name(kind),
                          kv_policy_name(kv_policy_knob_owner(k)));
            return fail_at(field, k->name);
        }
        kv_policy_knob_set(out, k, kv_policy_knob_get(&o->knobs, k));
    }
    return AR_OK;
}

/* ---- checks and the trajectory ---- */

int kv_budget_share(double budget, long long n) { return (int)floor(budget * (double)n + 1e-9); }

int kv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                    ar_error_t *err) {
    if (field)
        *field = NULL;
    if (!p || !g)
        return ar_errorf(err, "kv_policy_check: NULL argument");
    if (kv_geometry_check(g, err) != AR_OK)
        return AR_ERR;
    const kv_policy_ops_t *ops = ops_of(p->kind);
    if (!ops)
        return ar_errorf(err, "kv_policy: unknown kind %d", (int)p->kind);
    if (ops->takes_budget && !(p->budget > 0 && p->budget <= 1)) {
        ar_errorf(err, "budget must be in (0, 1]; got %g", p->budget);
        return fail_at(field, "budget");
    }
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        double v = kv_policy_knob_get(p, k);
        if (!kv_policy_knob_of(k, p->kind) || kv_policy_knob_ok(k, v))
            continue;
        char want[96];
        kv_policy_knob_describe(k, want, sizeof want);
        ar_errorf(err, "%s must be %s; got %g", k->name, want, v);
        return fail_at(field, k->name);
    }
    return ops->check ? ops->check(p, g, field, err) : AR_OK;
}

/* kv_policy_check of p with budget b, quietly. */
static int passes_with(kv_policy_params_t p, const kv_geometry_t *g, double b) {
    ar_error_t err;
    p.budget = b;
    return kv_policy_check(&p, g, NULL, &err) == AR_OK;
}

double kv_policy_min_budget(const kv_policy_params_t *p, const kv_geometry_t *g) {
    if (!p || !g || !passes_with(*p, g, 1.0))
        return -1;
    if (!kv_policy_uses_budget(p->kind, g))
        return 0;
    const double grid = 1e4;
    int lo = 0, hi = (int)grid; /* lo fails (a budget of 0 is never one), hi passes */
    while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        if (passes_with(*p, g, mid / grid))
            hi = mid;
        else
            lo = mid;
    }
    return hi / grid;
}

int kv_policy_auto(const kv_policy_params_t *defaults, const kv_geometry_t *g) {
    static const kv_policy_kind_t prefer[] = {KV_POLICY_LINEAR, KV_POLICY_HEATKV, KV_POLICY_SCALEKV,
                                              KV_POLICY_STREAMING};
    if (defaults && kv_policy_uses_budget(defaults->kind, g) &&
        kv_policy_min_budget(defaults, g) > 0)
        return (int)defaults->kind;
    for (size_t i = 0; i < sizeof prefer / sizeof prefer[0]; i++) {
        kv_policy_params_t p;
        kv_policy_defaults(&p, prefer[i]);
        if (kv_policy_uses_budget(p.kind, g) && kv_policy_min_budget(&p, g) > 0)
            return (int)p.kind;
    }
    return -1;
}

static int ops_layered(const kv_policy_ops_t *ops, const kv_geometry_t *g) {
    return ops->layer_end && (!ops->layered_on || ops->layered_on(g));
}

/* The engine's order of events from step t0 on, simulated head by head
 * with the policy's own hooks on a state of its own (impl, which it
 * advances), from the heads' lengths len[] at the start of step t0 (which
 * it updates): a layered policy's step begin, then layer by layer its
 * compaction before and after attention and the append; any policy's
 * compaction after the step. Key mass is never there (a policy that needs
 * it takes the safe side) and measured similarities are the lowest, so
 * this is the most any run from that state holds. blocks[t - t0] and
 * tokens[t - t0] as kv_policy_trajectory_blocks says. */
static void simulate(const kv_policy_ops_t *ops, void *impl, const kv_geometry_t *g, int t0,
                     int *len, int *keep, int block_tokens, long long *blocks, int *tokens) {
    const int H = g->n_heads, n = g->n_layers * H, layered = ops_layered(ops, g);
#define BLOCKS(x) (((long long)(x) + block_tokens - 1) / block_tokens)
    for (int t = t0; t < kv_geometry_steps(g); t++) {
        const int fed = kv_geometry_fed(g, t) + (t == 0 ? g->n_prompt : 0);
        long long cur = 0, peak = 0;
        int most = 0, n_keep;
        for (int i = 0; i < n; i++)
            peak += BLOCKS(len[i]); /* the step starts where the last one ended */
        for (int i = 0; i < n; i++) {
            if (layered && ops->step_begin &&
                (ops->step_begin(impl, t, i / H, i % H, len[i], keep, &n_keep) & KV_COMPACT))
                len[i] = n_keep;
            cur += BLOCKS(len[i]);
        }
        for (int l = 0; l < g->n_layers; l++) {
            /* The worst case: every similarity measured is the lowest. */
            const double sim =
                ops->layer_similarity && ops->layer_similarity(impl, t, l) ? -INFINITY : NAN;
            for (int i = l * H; i < (l + 1) * H; i++) {
                int cache = fed;
                cur -= BLOCKS(len[i]);
                if (layered && ops->layer_begin &&
                    (ops->layer_begin(impl, t, l, i % H, len[i], sim, keep, &n_keep) & KV_COMPACT))
                    len[i] = n_keep;
                if (layered &&
                    (ops->layer_end(impl, t, l, i % H, len[i], keep, &n_keep, &cache) & KV_COMPACT))
                    len[i] = n_keep;
                len[i] += cache;
                cur += BLOCKS(len[i]);
                most = len[i] > most ? len[i] : most;
            }
            peak = cur > peak ? cur : peak;
            for (int i = l * H; layered && ops->layer_stored && i < (l + 1) * H; i++) {
                cur -= BLOCKS(len[i]);
                if (ops->layer_stored(impl, t, l, i % H, len[i], NULL, keep, &n_keep) & KV_COMPACT)
                    len[i] = n_keep;
                cur += BLOCKS(len[i]);
            }
        }
        for (int i = 0; ops->step_end && i < n; i++)
            if (ops->step_end(impl, t, i / H, i % H, len[i], NULL, keep, &n_keep) & KV_COMPACT)
                len[i] = n_keep;
        if (blocks)
            blocks[t - t0] = peak;
        if (tokens)
            tokens[t - t0] = most;
    }
#undef BLOCKS
}

/* Room for a simulation's head lengths and keep lists on geometry g. */
static int simulation_buffers(const kv_geometry_t *g, int **len, int **keep, ar_error_t *err) {
    *len = calloc((size_t)g->n_layers * g->n_heads, sizeof **len);
    *keep = malloc((size_t)(g->n_prompt + kv_geometry_image_tokens(g)) * sizeof **keep);
    if (*len && *keep)
        return AR_OK;
    free(*len);
    free(*keep);
    return ar_errorf(err, "kv_policy_trajectory: out of memory");
}

int kv_policy_trajectory_blocks(const kv_policy_params_t *p, const kv_geometry_t *g,
                                int block_tokens, long long *blocks, int *tokens,
                                const char **field, ar_error_t *err) {
    if (block_tokens < 1)
        return ar_errorf(err, "kv_policy_trajectory: block_tokens %d must be positive",
                         block_tokens);
    if (kv_policy_check(p, g, field, err) != AR_OK)
        return AR_ERR;
    const kv_policy_ops_t *ops = kv_policy_table[p->kind];
    void *impl = ops->begin ? ops->begin(p, g) : NULL;
    if (ops->begin && !impl)
        return ar_errorf(err, "kv_policy_trajectory: out of memory");
    int rc = AR_OK, *len, *keep;
    if (ops_layered(ops, g)) {
        if ((rc = simulation_buffers(g, &len, &keep, err)) == AR_OK) {
            simulate(ops, impl, g, 0, len, keep, block_tokens, blocks, tokens);
            free(len);
            free(keep);
        }
    } else {
        const long long heads = (long long)g->n_layers * g->n_heads;
        int v = 0; /* image tokens a head holds */
        for (int t = 0; t < kv_geometry_steps(g); t++) {
            v += kv_geometry_fed(g, t);
            const int held = g->n_prompt + v;
            if (tokens)
                tokens[t] = held;
            if (blocks)
                blocks[t] = heads * ((held + block_tokens - 1) / block_tokens);
            if (ops->kept_after)
                v = ops->kept_after(impl, t, v);
        }
    }
    if (ops->end)
        ops->end(impl);
    return rc;
}

int kv_policy_trajectory(const kv_policy_params_t *p, const kv_geometry_t *g, int *tokens,
                         const char **field, ar_error_t *err) {
    if (!tokens)
        return ar_errorf(err, "kv_policy_trajectory: NULL argument");
    return kv_policy_trajectory_blocks(p, g, 1, NULL, tokens, field, err);
}

int kv_policy_plan_exact(kv_policy_kind_t kind) {
    const kv_policy_ops_t *ops = ops_of(kind);
    return ops && !ops->plan_bound;
}

int kv_policy_peak_exact(const kv_policy_params_t *p, const kv_geometry_t *g) {
    const kv_policy_ops_t *ops = ops_of(p->kind);
    if (!ops || kv_policy_check(p, g, NULL, NULL) != AR_OK)
        return 0;
    if (!ops->plan_bound)
        return 1;
    if (!ops->plan_exact_through)
        return 0;
    const int steps = kv_geometry_steps(g);
    int *tokens = malloc((size_t)steps * sizeof *tokens);
    if (!tokens || kv_policy_trajectory(p, g, tokens, NULL, NULL) != AR_OK) {
        free(tokens);
        return 0;
    }
    int first_peak = 0;
    for (int t = 1; t < steps; t++)
        if (tokens[t] > tokens[first_peak])
            first_peak = t;
    free(tokens);
    return first_peak <= ops->plan_exact_through(p);
}

void kv_policy_describe(const kv_policy_params_t *p, const kv_geometry_t *g, char *buf,
                        size_t cap) {
    ar_error_t err = {{0}};
    if (kv_policy_check(p, g, NULL, &err) != AR_OK) {
        snprintf(buf, cap, "%s", err.msg);
        return;
    }
    const kv_policy_ops_t *ops = kv_policy_table[p->kind];
    void *impl = ops->begin ? ops->begin(p, g) : NULL;
    if (ops->describe && (impl || !ops->begin))
        ops->describe(impl, p, buf, cap);
    else
        snprintf(buf, cap, "%s", ops->describe ? "out of memory" : "every token kept");
    if (ops->end)
        ops->end(impl);
}

/* ---- per sequence ---- */

kv_policy_state_t *kv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g,
                                   ar_error_t *err) {
    if (kv_policy_check(p, g, NULL, err) != AR_OK)
        return NULL;
    kv_policy_state_t *s = calloc(1, sizeof *s);
    if (!s) {
        ar_errorf(err, "kv_policy_begin: out of memory");
        return NULL;
    }
    s->ops = kv_policy_table[p->kind];
    s->steps = kv_geometry_steps(g);
    s->g = *g;
    if (s->ops->begin && !(s->impl = s->ops->begin(p, g))) {
        ar_errorf(err, "kv_policy_begin: out of memory for %s's state of %d x %d heads",
                  s->ops->name, g->n_layers, g->n_heads);
        free(s);
        return NULL;
    }
    return s;
}

void kv_policy_end(kv_policy_state_t *s) {
    if (!s)
        return;
    if (s->ops->end)
        s->ops->end(s->impl);
    free(s);
}

int kv_policy_collect(const kv_policy_state_t *s, int step) {
    if (!s || !s->ops->collect || step < 0 || step >= s->steps)
        return 0;
    return s->ops->collect(s->impl, step);
}

int kv_policy_step_end(kv_policy_state_t *s, int step, int layer, int head, int len,
                       const float *mass, int *keep, int *n_keep) {
    if (n_keep)
        *n_keep = len;
    if (!s || !s->ops->step_end || !keep || !n_keep || step < 0 || step >= s->steps || layer < 0 ||
        layer >= s->g.n_layers || head < 0 || head >= s->g.n_heads || len < s->g.n_prompt)
        return 0;
    return observed(s, s->ops->step_end(s->impl, step, layer, head, len, mass, keep, n_keep), step,
                    layer, head, len, keep, n_keep);
}

int kv_policy_layered(const kv_policy_state_t *s) { return s && ops_layered(s->ops, &s->g); }

int kv_policy_kind_layered(kv_policy_kind_t kind, const kv_geometry_t *g) {
    return (unsigned)kind < KV_POLICY_COUNT && ops_layered(kv_policy_table[kind], g);
}

int kv_policy_remaining_blocks(const kv_policy_state_t *s, int step, const int *len,
                               int block_tokens, long long *blocks, ar_error_t *err) {
    if (!s || !s->ops->clone || step < 1 || step >= s->steps || block_tokens < 1 || !len ||
        !blocks || !s->ops->settled(s->impl, step - 1))
        return 0;
    void *impl = s->ops->clone(s->impl);
    int *lens, *keep;
    if (!impl || simulation_buffers(&s->g, &lens, &keep, err) != AR_OK) {
        if (impl)
            s->ops->end(impl);
        ar_errorf(err, "kv_policy_remaining_blocks: out of memory");
        return -1;
    }
    memcpy(lens, len, (size_t)s->g.n_layers * s->g.n_heads * sizeof *lens);
    simulate(s->ops, impl, &s->g, step, lens, keep, block_tokens, blocks, NULL);
    s->ops->end(impl);
    free(lens);
    free(keep);
    return 1;
}

static int layer_args_ok(const kv_policy_state_t *s, int step, int layer, int head, int len,
                         const int *keep, const int *n_keep) {
    return s && keep && n_keep && step >= 0 && step < s->steps && layer >= 0 &&
           layer < s->g.n_layers && head >= 0 && head < s->g.n_heads && len >= 0;
}

int kv_policy_step_begin(kv_policy_state_t *s, int step, int layer, int head, int len, int *keep,
                         int *n_keep) {
    if (n_keep)
        *n_keep = len;
    if (!layer_args_ok(s, step, layer, head, len, keep, n_keep) || !s->ops->step_begin)
        return 0;
    return observed(s, s->ops->step_begin(s->impl, step, layer, head, len, keep, n_keep), step,
                    layer, head, len, keep, n_keep);
}

int kv_policy_layer_stored(kv_policy_state_t *s, int step, int layer, int head, int len,
                           const float *mass, int *keep, int *n_keep) {
    if (n_keep)
        *n_keep = len;
    if (!layer_args_ok(s, step, layer, head, len, keep, n_keep) || !s->ops->layer_stored)
        return 0;
    return observed(s, s->ops->layer_stored(s->impl, step, layer, head, len, mass, keep, n_keep),
                    step, layer, head, len, keep, n_keep);
}

int kv_policy_window_logits(const kv_policy_state_t *s) {
    return s && (s->ops->stats & KV_STATS_WINDOW_LOGITS) && s->ops->window_queries;
}

int kv_policy_window_queries(const kv_policy_state_t *s, int step, int layer, int head, int len,
                             int *rows) {
    if (!kv_policy_window_logits(s) || !rows || step < 0 || step >= s->steps || layer < 0 ||
        layer >= s->g.n_layers || head < 0 || head >= s->g.n_heads || len < 0)
        return 0;
    return s->ops->window_queries(s->impl, step, layer, head, len, rows);
}

int kv_policy_layer_similarity(const kv_policy_state_t *s, int step, int layer) {
    if (!s || !s->ops->layer_similarity || step < 0 || step >= s->steps || layer < 0 ||
        layer >= s->g.n_layers)
        return 0;
    return s->ops->layer_similarity(s->impl, step, layer);
}

int kv_policy_layer_begin(kv_policy_state_t *s, int step, int layer, int head, int len,
                          double similarity, int *keep, int *n_keep) {
    if (n_keep)
        *n_keep = len;
    if (!layer_args_ok(s, step, layer, head, len, keep, n_keep) || !s->ops->layer_begin)
        return 0;
    return observed(s,
                    s->ops->layer_begin(s->impl, step, layer, head, len, similarity, keep, n_keep),
                    step, layer, head, len, keep, n_keep);
}

int kv_policy_layer_end(kv_policy_state_t *s, int step, int layer, int head, int len, int *keep,
                        int *n_keep, int *cache) {
    if (n_keep)
        *n_keep = len;
    *cache = s ? kv_geometry_fed(&s->g, step) + (step == 0 ? s->g.n_prompt : 0) : 0;
    if (!layer_args_ok(s, step, layer, head, len, keep, n_keep) || !s->ops->layer_end)
        return 0;
    return observed(s, s->ops->layer_end(s->impl, step, layer, head, len, keep, n_keep, cache),
                    step, layer, head, len, keep, n_keep);
}

int kv_keep_segments(const kv_geometry_t *g, unsigned have, unsigned want, int len, int *keep) {
    long long held = g->n_prompt;
    for (int i = 0; i < g->n_segments && i < 32; i++)
        held += (have >> i & 1u) ? g->segment_tokens[i] : 0;
    if (held != len)
        return -1;
    int at = g->n_prompt, k = 0;
    kv_keep_range(keep, &k, 0, g->n_prompt);
    for (int i = 0; i < g->n_segments && i < 32; i++) {
        if (!(have >> i & 1u))
            continue;
        if (want >> i & 1u)
            kv_keep_range(keep, &k, at, g->segment_tokens[i]);
        at += g->segment_tokens[i];
    }
    return k;
}

/* ---- token selection ---- */

void kv_keep_range(int *keep, int *k, int first, int n) {
    for (int i = 0; i < n; i++)
        keep[(*k)++] = first + i;
}

/* Score of cache index i: its key mass, 0 when nothing was collected; NaN
 * sorts lowest so a corrupt score is evicted rather than kept. */
static float score_of(const float *mass, int i) {
    if (!mass)
        return 0.0f;
    float x = mass[i];
    return isnan(x) ? -INFINITY : x;
}

/* Total order for eviction: lower score first, then the older token. */
static int evicts_before(const float *mass, int a, int b) {
    float x = score_of(mass, a), y = score_of(mass, b);
    if (x != y)
        return x < y;
    return a < b;
}

static void sift_down(int *v, int root, int n, const float *mass) {
    for (;;) {
        int c = 2 * root + 1;
        if (c >= n)
            return;
        if (c + 1 < n && evicts_before(mass, v[c], v[c + 1]))
            c++;
        if (!evicts_before(mass, v[root], v[c]))
            return;
        int tmp = v[root];
        v[root] = v[c];
        v[c] = tmp;
        root = c;
    }
}

void kv_keep_top(int *out, int first, int n, int n_keep, const float *mass) {
    if (n_keep >= n) {
        for (int i = 0; i < n; i++)
            out[i] = first + i;
        return;
    }
    if (n_keep <= 0)
        return;
    /* Heap sort by eviction order, then the last evicted index is the
     * threshold: exactly n_keep indices sort after it. */
    for (int i = 0; i < n; i++)
        out[i] = first + i;
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_down(out, i, n, mass);
    for (int end = n - 1; end > 0; end--) {
        int tmp = out[0];
        out[0] = out[end];
        out[end] = tmp;
        sift_down(out, 0, end, mass);
    }
    int threshold = out[n - n_keep - 1], k = 0;
    for (int i = first; i < first + n; i++)
        if (evicts_before(mass, threshold, i))
            out[k++] = i;
}
