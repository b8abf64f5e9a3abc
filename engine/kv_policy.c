/* KV-cache compression policies for raster models (kv_policy.h): full,
 * StreamingLLM, LineAR and HeadKV. Every rule here, its paper reference and
 * the choices made where a paper is silent are written up in
 * docs/kv-policies.md; the step convention is docs/kv-cache.md's. */
#include "kv_policy.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Budgets are fractions; this keeps 1/6 * 24 lines at 4 lines, not 3. */
#define BUDGET_EPS 1e-9

/* Everything a policy derives from its knobs and the geometry before a
 * request runs. Counts are in image tokens unless named otherwise. */
typedef struct plan {
    kv_policy_kind_t kind;
    int n_prompt, w, h, steps;
    /* streaming: tokens one head may hold (prefix included), sink tokens */
    int cap, sinks;
    /* linear: B = budget_lines * w, anchors, recent lines (tokens) */
    int budget_lines, B, anchors, recent;
    /* headkv: global budget, recent window, buffer, local window, grouping step */
    int G, R, buf, local_window, t_group;
    double threshold, alpha;
} plan_t;

struct kv_policy_state {
    plan_t pl;
    int n_layers, n_heads;
    unsigned char *local; /* headkv: 1 for a head classified local, per (layer, head) */
};

void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind) {
    memset(p, 0, sizeof *p);
    p->kind = kind;
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        kv_policy_knob_set(p, &kv_policy_knobs[i], kv_policy_knobs[i].def);
    switch (kind) {
    case KV_POLICY_STREAMING: /* no ratio of its own: linear's, to compare alike */
    case KV_POLICY_LINEAR:
        p->budget = 1.0 / 6; /* LineAR's headline ratio (abstract, Tab. 1-6) */
        break;
    case KV_POLICY_HEADKV:
        p->budget = 1.0 / 8; /* the ratio HeadKV evaluates most (Tab. 1-4) */
        break;
    default:
        p->budget = 1.0;
        break;
    }
}

static const char *const kind_names[] = {"full", "streaming", "linear", "headkv"};

int kv_policy_parse(const char *name) {
    if (!name)
        return -1;
    for (int i = 0; i < (int)(sizeof kind_names / sizeof kind_names[0]); i++)
        if (strcmp(name, kind_names[i]) == 0)
            return i;
    return -1;
}

const char *kv_policy_name(kv_policy_kind_t kind) {
    if ((int)kind < 0 || (int)kind >= (int)(sizeof kind_names / sizeof kind_names[0]))
        return "unknown";
    return kind_names[kind];
}

static int floor_budget(double budget, long long n) {
    return (int)floor(budget * (double)n + BUDGET_EPS);
}

static int validate_geometry(const kv_geometry_t *g, ar_error_t *err) {
    if (g->n_prompt < 1)
        return ar_errorf(err, "geometry: n_prompt must be at least 1; got %d", g->n_prompt);
    if (g->line_width < 1)
        return ar_errorf(err, "geometry: line_width must be at least 1; got %d", g->line_width);
    if (g->n_lines < 1)
        return ar_errorf(err, "geometry: n_lines must be at least 1; got %d", g->n_lines);
    if (g->n_layers < 1 || g->n_heads < 1)
        return ar_errorf(err, "geometry: n_layers and n_heads must be at least 1; got %d, %d",
                         g->n_layers, g->n_heads);
    if ((long long)g->line_width * g->n_lines + g->n_prompt > INT_MAX / 4)
        return ar_errorf(err, "geometry: %d prompt tokens + %d x %d image tokens is too many",
                         g->n_prompt, g->line_width, g->n_lines);
    return AR_OK;
}

/* The field a failed check names (kv_policy_check). */
static int fail_at(const char **field, const char *name) {
    if (field)
        *field = name;
    return AR_ERR;
}

int kv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                    ar_error_t *err) {
    if (field)
        *field = NULL;
    if (!p || !g)
        return ar_errorf(err, "kv_policy_validate: NULL argument");
    if (validate_geometry(g, err) != AR_OK)
        return AR_ERR;
    if ((int)p->kind < KV_POLICY_FULL || (int)p->kind > KV_POLICY_HEADKV)
        return ar_errorf(err, "kv_policy: unknown kind %d", (int)p->kind);
    if (p->kind == KV_POLICY_FULL)
        return AR_OK;
    if (!(p->budget > 0 && p->budget <= 1)) {
        ar_errorf(err, "budget must be in (0, 1]; got %g", p->budget);
        return fail_at(field, "budget");
    }
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        double v = kv_policy_knob_get(p, k);
        if (k->policy != p->kind || kv_policy_knob_ok(k, v))
            continue;
        char want[96];
        kv_policy_knob_describe(k, want, sizeof want);
        ar_errorf(err, "%s must be %s; got %g", k->name, want, v);
        return fail_at(field, k->name);
    }

    const int P = g->n_prompt, w = g->line_width, h = g->n_lines, S = w * h;
    switch (p->kind) {
    case KV_POLICY_STREAMING: {
        int N = P + S - 1, cap = floor_budget(p->budget, N);
        long long need = (long long)P + p->sink_tokens + 1;
        if (cap < need) {
            ar_errorf(err,
                      "budget %g holds %d of the %d tokens of a full cache; streaming needs the "
                      "prefix (%d) + sink_tokens (%d) + 1 recent token = %lld (budget >= %lld/%d "
                      "= %.4g)",
                      p->budget, cap, N, P, p->sink_tokens, need, need, N, (double)need / N);
            return fail_at(field, "budget");
        }
        return AR_OK;
    }
    case KV_POLICY_LINEAR: {
        int lines = floor_budget(p->budget, h);
        long long need = (long long)p->anchor_lines + p->recent_lines + 1;
        /* With B >= h lines no line end ever compresses: any knobs do. */
        if (lines < h && lines < need) {
            ar_errorf(err,
                      "budget %g keeps %d of %d lines; linear needs anchor_lines (%d) + "
                      "recent_lines (%d) + the line being generated = %lld lines (budget >= "
                      "%lld/%d = %.4g)",
                      p->budget, lines, h, p->anchor_lines, p->recent_lines, need, need, h,
                      (double)need / h);
            return fail_at(field, "budget");
        }
        return AR_OK;
    }
    case KV_POLICY_HEADKV: {
        int G = floor_budget(p->budget, S);
        long long R = (long long)p->headkv_recent_lines * w;
        /* A global head never evicts when G - buffer covers the whole image. */
        if ((long long)G - p->headkv_buffer >= S - 1)
            return AR_OK;
        long long need = R + p->headkv_buffer;
        if (G < need) {
            ar_errorf(err,
                      "budget %g holds %d of %d image tokens; headkv needs headkv_recent_lines "
                      "(%d) x %d + headkv_buffer (%d) = %lld (budget >= %lld/%d = %.4g)",
                      p->budget, G, S, p->headkv_recent_lines, w, p->headkv_buffer, need, need, S,
                      (double)need / S);
            return fail_at(field, "budget");
        }
        if (p->headkv_local_window > G - p->headkv_buffer) {
            ar_errorf(err,
                      "headkv_local_window %d must be at most budget x %d - headkv_buffer = %d: "
                      "a local head holds less than a global one",
                      p->headkv_local_window, S, G - p->headkv_buffer);
            return fail_at(field, "headkv_local_window");
        }
        return AR_OK;
    }
    default:
        return AR_OK;
    }
}

int kv_policy_validate(const kv_policy_params_t *p, const kv_geometry_t *g, ar_error_t *err) {
    return kv_policy_check(p, g, NULL, err);
}

static int min_int(int a, int b) { return a < b ? a : b; }

/* Assumes kv_policy_validate passed. */
static void plan_derive(const kv_policy_params_t *p, const kv_geometry_t *g, plan_t *pl) {
    memset(pl, 0, sizeof *pl);
    pl->kind = p->kind;
    pl->n_prompt = g->n_prompt;
    pl->w = g->line_width;
    pl->h = g->n_lines;
    pl->steps = pl->w * pl->h;
    switch (p->kind) {
    case KV_POLICY_STREAMING:
        pl->cap = floor_budget(p->budget, pl->n_prompt + pl->steps - 1);
        pl->sinks = p->sink_tokens;
        break;
    case KV_POLICY_LINEAR:
        pl->budget_lines = floor_budget(p->budget, pl->h);
        pl->B = pl->budget_lines * pl->w;
        /* More lines than the image has only matter when nothing is ever
         * compressed (validation); clamped, the products stay in int. */
        pl->anchors = min_int(p->anchor_lines, pl->h) * pl->w;
        pl->recent = min_int(p->recent_lines, pl->h) * pl->w;
        break;
    case KV_POLICY_HEADKV:
        pl->G = floor_budget(p->budget, pl->steps);
        pl->R = min_int(p->headkv_recent_lines, pl->h) * pl->w;
        pl->buf = p->headkv_buffer;
        pl->local_window = p->headkv_local_window;
        pl->t_group = p->headkv_group_tokens;
        pl->threshold = p->headkv_threshold;
        pl->alpha = p->headkv_alpha;
        break;
    default:
        break;
    }
}

/* ---- per-step schedule: depends on the step only, never on attention ---- */

/* No policy compacts at the last step: the sequence is released after it. */
static int before_last(const plan_t *pl, int t) { return t < pl->steps - 1; }

/* LineAR compresses at the end of 1-based line l (step l*w) for
 * budget_lines <= l <= last: from the line that fills B (§3.3, l/n >= rho)
 * to the last line that completes in the cache before the last step. */
static int linear_last_line(const plan_t *pl) {
    int last = (pl->steps - 2) / pl->w;
    return pl->steps < 2 ? 0 : (last < pl->h - 1 ? last : pl->h - 1);
}

static int linear_compresses(const plan_t *pl, int t) {
    if (t <= 0 || t % pl->w)
        return 0;
    int l = t / pl->w;
    return l >= pl->budget_lines && l <= linear_last_line(pl);
}

/* Mass restarts at the start of each line whose end compresses: step
 * (l-1)*w for the first such line, then at every compressing line end. */
static int linear_resets(const plan_t *pl, int t) {
    if (pl->budget_lines > linear_last_line(pl))
        return 0;
    return t == (pl->budget_lines - 1) * pl->w || linear_compresses(pl, t);
}

/* The guide queue (LineAR eq. 8) of a compressing line l is the queries
 * of its w tokens, fed at steps (l-1)*w+1 .. l*w. */
static int linear_collects(const plan_t *pl, int t) {
    int last = linear_last_line(pl);
    if (pl->budget_lines > last)
        return 0;
    return t >= (pl->budget_lines - 1) * pl->w + 1 && t <= last * pl->w;
}

/* Tokens LineAR evicts from the mid region of a head holding V image
 * tokens at a compressing line end: down to B - w (eq. 6), i.e. w in the
 * steady state, never more than the mid region holds. */
static int linear_n_evict(const plan_t *pl, int V) {
    int n = V - (pl->B - pl->w), mid = V - pl->anchors - pl->recent;
    if (mid < 0)
        mid = 0;
    if (n < 0)
        n = 0;
    return n < mid ? n : mid;
}

static int headkv_groups(const plan_t *pl, int t) { return t == pl->t_group && before_last(pl, t); }

/* Periodic updates every buffer steps after grouping (HeadKV §4 step 3). */
static int headkv_updates(const plan_t *pl, int t) {
    return t > pl->t_group && (t - pl->t_group) % pl->buf == 0 && before_last(pl, t);
}

/* A global head holds t image tokens until its first eviction and G - buf
 * after each one, so an update evicts exactly when t > G - buf. The key mass
 * is collected at the grouping step (one query row, for classification)
 * and over the buf steps before every evicting update (the query buffer). */
static int headkv_collects(const plan_t *pl, int t) {
    if (t <= 0 || t < pl->t_group || !before_last(pl, t))
        return 0;
    if (t == pl->t_group)
        return 1;
    int next = pl->t_group + (t - pl->t_group + pl->buf - 1) / pl->buf * pl->buf;
    return before_last(pl, next) && next > pl->G - pl->buf;
}

/* Image tokens a (worst-case) head keeps after step t's compaction. */
static int plan_visual_after(const plan_t *pl, int t, int V) {
    switch (pl->kind) {
    case KV_POLICY_STREAMING:
        return pl->n_prompt + V >= pl->cap && before_last(pl, t) ? pl->cap - 1 - pl->n_prompt : V;
    case KV_POLICY_LINEAR:
        return linear_compresses(pl, t) ? V - linear_n_evict(pl, V) : V;
    case KV_POLICY_HEADKV:
        if ((headkv_groups(pl, t) || headkv_updates(pl, t)) && V > pl->G - pl->buf)
            return pl->G - pl->buf;
        return V;
    default:
        return V;
    }
}

int kv_policy_trajectory(const kv_policy_params_t *p, const kv_geometry_t *g, int *tokens) {
    if (!tokens || kv_policy_validate(p, g, NULL) != AR_OK)
        return AR_ERR;
    plan_t pl;
    plan_derive(p, g, &pl);
    int V = 0;
    for (int t = 0; t < pl.steps; t++) {
        if (t > 0)
            V++;
        tokens[t] = pl.n_prompt + V;
        V = plan_visual_after(&pl, t, V);
    }
    return AR_OK;
}

kv_policy_state_t *kv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g,
                                   ar_error_t *err) {
    if (kv_policy_validate(p, g, err) != AR_OK)
        return NULL;
    kv_policy_state_t *s = calloc(1, sizeof *s);
    if (!s) {
        ar_errorf(err, "kv_policy_begin: out of memory");
        return NULL;
    }
    plan_derive(p, g, &s->pl);
    s->n_layers = g->n_layers;
    s->n_heads = g->n_heads;
    if (p->kind == KV_POLICY_HEADKV) {
        s->local = calloc((size_t)g->n_layers * (size_t)g->n_heads, 1);
        if (!s->local) {
            free(s);
            ar_errorf(err, "kv_policy_begin: out of memory for %d x %d head types", g->n_layers,
                      g->n_heads);
            return NULL;
        }
    }
    return s;
}

void kv_policy_end(kv_policy_state_t *s) {
    if (!s)
        return;
    free(s->local);
    free(s);
}

int kv_policy_collect(const kv_policy_state_t *s, int step) {
    if (!s || step < 0 || step >= s->pl.steps)
        return 0;
    switch (s->pl.kind) {
    case KV_POLICY_LINEAR:
        return linear_collects(&s->pl, step);
    case KV_POLICY_HEADKV:
        return headkv_collects(&s->pl, step);
    default:
        return 0;
    }
}

/* ---- token selection ---- */

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

/* Writes to out[0..n_keep) the n_keep cache indices of [first, first+n)
 * with the highest score, ascending; n - n_keep lowest are evicted
 * (BottomK, LineAR eq. 10). out has room for n entries. */
static void keep_top(int *out, int first, int n, int n_keep, const float *mass) {
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

static void keep_range(int *keep, int *k, int first, int n) {
    for (int i = 0; i < n; i++)
        keep[(*k)++] = first + i;
}

/* HeadKV: accumulate the current query's attention backward from the
 * newest key until it reaches threshold; fewer tokens than the local window
 * makes a local head (§4 step 2). No statistics: global, the safe side. */
static int headkv_is_local(const plan_t *pl, const float *row, int len) {
    if (!row)
        return 0;
    double total = 0;
    for (int i = 0; i < len; i++)
        total += row[i];
    if (!(total > 0) || !isfinite(total))
        return 0;
    double acc = 0;
    for (int k = 1; k <= len; k++) {
        acc += row[len - k];
        if (acc >= pl->threshold * total)
            return k < pl->local_window;
    }
    return 0;
}

/* Stratified Token Eviction (HeadKV §4, eq. 5-6): the L historical tokens
 * [first, first+L) split into the older long range and the newer near range
 * (alpha*L tokens); each keeps its share of the H survivors (alpha*H near)
 * by score, so near-range tokens cannot crowd out long-range ones. */
static int headkv_ste(const plan_t *pl, int *out, int first, int L, int H, const float *mass) {
    int L_near = (int)floor(pl->alpha * L + 0.5), L_long = L - L_near;
    int H_near = (int)floor(pl->alpha * H + 0.5);
    if (H_near > L_near)
        H_near = L_near;
    if (H_near < H - L_long)
        H_near = H - L_long;
    int H_long = H - H_near;
    keep_top(out, first, L_long, H_long, mass);
    keep_top(out + H_long, first + L_long, L_near, H_near, mass);
    return H;
}

int kv_policy_step_end(kv_policy_state_t *s, int step, int layer, int head, int len,
                       const float *mass, int *keep, int *n_keep) {
    if (n_keep)
        *n_keep = len;
    if (!s || !keep || !n_keep || step < 0 || step >= s->pl.steps || layer < 0 ||
        layer >= s->n_layers || head < 0 || head >= s->n_heads || len < s->pl.n_prompt)
        return 0;
    const plan_t *pl = &s->pl;
    const int P = pl->n_prompt, V = len - P;
    int k = 0;
    switch (pl->kind) {
    case KV_POLICY_STREAMING: {
        /* Prefix + sinks + the most recent tokens, so that the next append
         * brings the head back to cap (StreamingLLM §3.2). */
        if (len < pl->cap || !before_last(pl, step))
            return 0;
        int recent = pl->cap - 1 - P - pl->sinks;
        keep_range(keep, &k, 0, P + pl->sinks);
        keep_range(keep, &k, len - recent, recent);
        *n_keep = k;
        return KV_COMPACT;
    }
    case KV_POLICY_LINEAR: {
        int flags = linear_resets(pl, step) ? KV_RESET_MASS : 0;
        if (!linear_compresses(pl, step))
            return flags;
        int n_evict = linear_n_evict(pl, V);
        if (n_evict == 0)
            return flags;
        /* prefix + anchors | mid | recent lines (LineAR §3.3, eq. 5-6) */
        int mid_first = P + pl->anchors, mid = len - pl->recent - mid_first;
        keep_range(keep, &k, 0, mid_first);
        keep_top(keep + k, mid_first, mid, mid - n_evict, mass);
        k += mid - n_evict;
        keep_range(keep, &k, len - pl->recent, pl->recent);
        *n_keep = k;
        return flags | KV_COMPACT;
    }
    case KV_POLICY_HEADKV: {
        unsigned char *local = &s->local[(size_t)layer * s->n_heads + head];
        if (headkv_groups(pl, step))
            *local = (unsigned char)headkv_is_local(pl, mass, len);
        else if (!headkv_updates(pl, step))
            return 0;
        if (*local) {
            /* condition + a sliding recent window (§4, eq. 3) */
            if (V <= pl->local_window)
                return KV_RESET_MASS;
            keep_range(keep, &k, 0, P);
            keep_range(keep, &k, len - pl->local_window, pl->local_window);
        } else {
            /* condition + STE-chosen history + recent window (§4, eq. 4) */
            if (V <= pl->G - pl->buf)
                return KV_RESET_MASS;
            int L = V - pl->R, H = pl->G - pl->buf - pl->R;
            keep_range(keep, &k, 0, P);
            k += headkv_ste(pl, keep + k, P, L, H, mass);
            keep_range(keep, &k, len - pl->R, pl->R);
        }
        *n_keep = k;
        return KV_COMPACT | KV_RESET_MASS;
    }
    default:
        return 0;
    }
}
