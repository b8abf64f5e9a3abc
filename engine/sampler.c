/* Host sampler: CFG, temperature, top-k, top-p and an inverse-CDF draw over
 * the kept tokens in rank order. Top-k is an introselect; the ranking comes
 * lazily from a heap over the tokens that carry the mass, never a full sort. */
#include "engine/sampler.h"

#include "base/rng.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Below this many elements introselect finishes with an insertion sort. */
#define SELECT_SMALL 16

int sampler_init(sampler_t *s, int vocab, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    if (vocab < 1)
        return ar_errorf(err, "sampler_init: vocab %d: must be at least 1", vocab);
    s->logits = malloc((size_t)vocab * sizeof *s->logits);
    s->probs = malloc((size_t)vocab * sizeof *s->probs);
    s->order = malloc((size_t)vocab * sizeof *s->order);
    s->ranked = malloc((size_t)vocab * sizeof *s->ranked);
    if (!s->logits || !s->probs || !s->order || !s->ranked) {
        sampler_free(s);
        return ar_errorf(err, "sampler_init: out of memory for vocab %d", vocab);
    }
    s->vocab = vocab;
    return AR_OK;
}

void sampler_free(sampler_t *s) {
    free(s->logits);
    free(s->probs);
    free(s->order);
    free(s->ranked);
    memset(s, 0, sizeof *s);
}

void sampler_cfg_combine(float *out, const float *cond, const float *uncond, int n, float cfg) {
    if (!uncond) {
        if (out != cond)
            memmove(out, cond, (size_t)n * sizeof *out);
        return;
    }
    for (int i = 0; i < n; i++)
        out[i] = uncond[i] + cfg * (cond[i] - uncond[i]);
}

/* Does token a rank before token b? Higher logit first, then the lower id.
 * Logits are sanitised (no NaN), so this is a strict total order on ids. */
static inline int ranks_before(const float *lg, int a, int b) {
    /* Bitwise, not short-circuit: this sits in data-dependent loops where a
     * mispredicted branch costs more than the extra compares. */
    return (lg[a] > lg[b]) | ((lg[a] == lg[b]) & (a < b));
}

static inline void swap_int(int *a, int *b) {
    int t = *a;
    *a = *b;
    *b = t;
}

/* Restores the heap property below slot i of h[0..n). With best_on_top each
 * parent ranks before its children; otherwise each parent ranks after them. */
static void heap_sift_down(int *h, int n, int i, const float *lg, int best_on_top) {
    int x = h[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && ranks_before(lg, h[c + 1], h[c]) == best_on_top)
            c++;
        if (ranks_before(lg, h[c], x) != best_on_top)
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static void heap_build(int *h, int n, const float *lg, int best_on_top) {
    for (int i = n / 2 - 1; i >= 0; i--)
        heap_sift_down(h, n, i, lg, best_on_top);
}

/* Removes and returns the best token of the best-on-top heap h[0..*n),
 * which must not be empty. */
static int heap_pop_best(int *h, int *n, const float *lg) {
    int top = h[0];
    h[0] = h[--*n];
    if (*n > 0)
        heap_sift_down(h, *n, 0, lg, 1);
    return top;
}

/* Hands out candidate tokens in rank order. The head is a heap built up
 * front; the tail is heapified only when the head runs out. Every head token
 * ranks before every tail token, so the two together give the full ranking. */
typedef struct ranker {
    const float *lg;
    int *head, *tail;
    int head_n, tail_n, tail_ready;
} ranker_t;

static int ranker_next(ranker_t *r) {
    if (r->head_n > 0)
        return heap_pop_best(r->head, &r->head_n, r->lg);
    if (!r->tail_ready) {
        heap_build(r->tail, r->tail_n, r->lg, 1);
        r->tail_ready = 1;
    }
    return heap_pop_best(r->tail, &r->tail_n, r->lg);
}

/* Sorts a[0..n) into rank order (best first) in O(n log n) worst case. */
static void heap_sort_ranked(int *a, int n, const float *lg) {
    heap_build(a, n, lg, 0);
    for (int end = n - 1; end > 0; end--) {
        swap_int(&a[0], &a[end]);
        heap_sift_down(a, end, 0, lg, 0);
    }
}

static void insertion_sort_ranked(int *a, int n, const float *lg) {
    for (int i = 1; i < n; i++) {
        int x = a[i], j = i;
        for (; j > 0 && ranks_before(lg, x, a[j - 1]); j--)
            a[j] = a[j - 1];
        a[j] = x;
    }
}

/* Rearranges a[0..n) so that a[0..k) holds the k best-ranked tokens, in no
 * particular order (introselect: quickselect with a median-of-three pivot,
 * falling back to a heap sort of the remaining range if the recursion gets
 * deep, so the worst case is O(n log n) and the usual case O(n)). */
static void select_top(int *a, int n, int k, const float *lg) {
    int lo = 0, hi = n, depth = 0;
    for (int m = n; m > 1; m >>= 1)
        depth += 2;
    /* Invariant: every token in a[0..lo) ranks before every token in
     * a[lo..n), every token in a[hi..n) after every token in a[0..hi), and
     * lo <= k <= hi. */
    while (hi - lo > SELECT_SMALL) {
        if (depth-- == 0) {
            heap_sort_ranked(a + lo, hi - lo, lg);
            return;
        }
        int mid = lo + (hi - lo) / 2, last = hi - 1;
        if (ranks_before(lg, a[mid], a[lo]))
            swap_int(&a[mid], &a[lo]);
        if (ranks_before(lg, a[last], a[lo]))
            swap_int(&a[last], &a[lo]);
        if (ranks_before(lg, a[last], a[mid]))
            swap_int(&a[last], &a[mid]);
        swap_int(&a[mid], &a[last]); /* the median is the pivot, parked at the end */
        /* Branch-free Lomuto: always swap, advance only past a better token. */
        int pivot = a[last], store = lo;
        for (int i = lo; i < last; i++) {
            int x = a[i], before = ranks_before(lg, x, pivot);
            a[i] = a[store];
            a[store] = x;
            store += before;
        }
        swap_int(&a[store], &a[last]);
        if (store == k)
            return;
        if (store < k)
            lo = store + 1;
        else
            hi = store;
    }
    insertion_sort_ranked(a + lo, hi - lo, lg);
}

int sampler_next(sampler_t *s, const float *cond, const float *uncond, const sampler_params_t *p,
                 uint64_t seed, uint64_t stream, uint64_t step) {
    const int n = s->vocab;
    float *lg = s->logits, *probs = s->probs;
    int *ord = s->order;

    sampler_cfg_combine(lg, cond, uncond, n, p->cfg);
    /* The strict > keeps the lowest id among equal maxima; all -inf gives 0. */
    float mx = -INFINITY;
    int argmax = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(lg[i]))
            lg[i] = -INFINITY;
        else if (lg[i] == INFINITY)
            lg[i] = FLT_MAX;
        if (lg[i] > mx) {
            mx = lg[i];
            argmax = i;
        }
    }
    const float t = p->temperature;
    if (mx == -INFINITY || p->top_k == 1 || !(t > 0) || !isfinite(t))
        return argmax;

    for (int i = 0; i < n; i++)
        ord[i] = i;
    int m = n;
    if (p->top_k > 1 && p->top_k < n) {
        select_top(ord, n, p->top_k, lg);
        m = p->top_k;
    }

    /* Divide rather than multiply by 1/t: for a tiny t, 1/t overflows and
     * 0 * inf would turn the best token's weight into NaN. */
    double total = 0;
    for (int j = 0; j < m; j++) {
        int id = ord[j];
        probs[id] = expf((lg[id] - mx) / t);
        total += probs[id];
    }

    /* Split off the head: tokens whose weight is at least total / (1024 m),
     * so the tail holds under 1/1024 of the mass and is ranked only when a
     * draw reaches it. */
    const double cut = total / (1024.0 * m);
    int head_n = 0;
    for (int j = 0; j < m; j++)
        if (probs[ord[j]] >= cut)
            swap_int(&ord[j], &ord[head_n++]);
    ranker_t rk = {.lg = lg,
                   .head = ord,
                   .tail = ord + head_n,
                   .head_n = head_n,
                   .tail_n = m - head_n,
                   .tail_ready = 0};
    heap_build(ord, head_n, lg, 1);

    int *ranked = s->ranked, r = 0;
    const int use_top_p = p->top_p < 1.0f; /* false for NaN */
    double mass = total;
    if (use_top_p) {
        double threshold = (double)p->top_p * total, cum = 0;
        do {
            int id = ranker_next(&rk);
            ranked[r++] = id;
            cum += probs[id];
        } while (cum < threshold && r < m);
        mass = cum;
    }

    const double target = rng_uniform(seed, stream, step) * mass;
    double cum = 0;
    int last_positive = argmax; /* ranks first; its weight is exp(0) = 1 */
    for (int j = 0; j < m; j++) {
        int id;
        if (j < r)
            id = ranked[j];
        else if (!use_top_p)
            id = ranker_next(&rk);
        else
            break;
        if (probs[id] > 0) {
            cum += probs[id];
            last_positive = id;
            if (cum > target)
                return id;
        }
    }
    /* Reached only when rounding puts the target at the very end of the mass. */
    return last_positive;
}
