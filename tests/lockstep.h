/* Greedy generation on two backends in lockstep, tolerant of near-ties: a
 * reference backend (the CPU) and a backend under test (CUDA) each step one
 * request of the same model and prompt, and after every step each side's
 * greedy token is taken from its own guided logits. Where the two differ
 * and the reference's top-two margin is under a tolerance, the backends'
 * float differences (an ulp of expf or rsqrtf, FMA contraction, another
 * summation order) chose, not a bug: the reference's token is fed to both
 * and the run goes on. Where they differ by a margin above it, the run
 * stops there. Header-only: each test is one file. */
#ifndef ARSERVE_TESTS_LOCKSTEP_H
#define ARSERVE_TESTS_LOCKSTEP_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"

typedef enum lockstep_verdict {
    LOCKSTEP_SAME,     /* both chose the same token */
    LOCKSTEP_TIE,      /* different tokens, the reference's margin under the tolerance */
    LOCKSTEP_DIVERGED, /* different tokens by a margin above it (or not a number): a bug */
} lockstep_verdict_t;

/* What one token's two greedy choices mean, given the reference's top-two
 * margin (top-1 minus top-2 of its guided logits). */
static inline lockstep_verdict_t lockstep_judge(int ref_token, int dut_token, double ref_margin,
                                                double tol) {
    if (ref_token == dut_token)
        return LOCKSTEP_SAME;
    return ref_margin < tol ? LOCKSTEP_TIE : LOCKSTEP_DIVERGED;
}

/* The greedy token of guided logits g[0..n), as sampler_next picks it (the
 * highest, the lowest id on ties, NaN as -inf), and its margin over the
 * runner-up (+inf when n is 1). */
static inline int lockstep_greedy(const float *g, int n, double *margin) {
    int best = 0;
    double top = -INFINITY, second = -INFINITY;
    for (int i = 0; i < n; i++) {
        const double v = isnan(g[i]) ? -INFINITY : g[i];
        if (v > top) {
            second = top;
            top = v;
            best = i;
        } else if (v > second) {
            second = v;
        }
    }
    *margin = top - second;
    return best;
}

/* The guidance weight at step t: the request's own on a raster model; a
 * next-scale model ramps it over its scales as VAR does (family_scale.c's
 * scale_step: 1 + cfg * t / (S - 1)). lockstep_ref_alone catches a drift
 * from the engine's rule. */
static inline float lockstep_guidance(const gen_request_t *r, int t) {
    const model_config_t *c = &r->model->cfg;
    if (strcmp(r->model->family->name, "scale") || c->image.n_scales < 2)
        return r->params.cfg;
    return 1.0f + r->params.cfg * (float)t / (float)(c->image.n_scales - 1);
}

/* Under the emulator (a binary built with ARSERVE_TEST_CUDA_EMU) a test also
 * holds the largest guided-logit difference to a bound, measured there: it
 * catches a kernel that is off by less than it takes to change a token. On
 * a GPU the difference is printed beside the bound and not held against
 * it until a GPU run has measured it: a first run should not fail on a
 * guess. */
#ifdef ARSERVE_TEST_CUDA_EMU
#define LOCKSTEP_HOLD_GAP 1
#else
#define LOCKSTEP_HOLD_GAP 0
#endif

typedef struct lockstep {
    int tokens;         /* tokens compared */
    int ties;           /* tokens that differed within the tolerance */
    double widest_tie;  /* the largest reference margin among them */
    double worst_logit; /* largest |guided logit difference| (+inf for NaN) */
    double narrowest;   /* the smallest reference margin of any token */
    double largest;     /* the largest |guided logit| of the reference */
    int diverged_at;    /* the first token that differed above the tolerance; -1: none */
    int ref_token, dut_token;
    double margin; /* the reference's margin there */
} lockstep_t;

/* Steps ref and dut (started alike by the caller, greedy, full or the same
 * policy) to the end or to the first divergence, feeding both the
 * reference's greedy token of every position; each tie is printed to
 * stderr under `name` (NULL: not printed). AR_ERR (err set) when a step
 * fails; a divergence is AR_OK with out->diverged_at set. */
static int lockstep_run(gen_request_t *ref, gen_request_t *dut, double tol, const char *name,
                        lockstep_t *out, ar_error_t *err) {
    const model_config_t *c = &ref->model->cfg;
    const int V = c->image.codebook_size;
    memset(out, 0, sizeof *out);
    out->diverged_at = -1;
    out->narrowest = INFINITY;
    /* Forced tokens, overwritten below before the next step reads them:
     * with them a next-scale step keeps every row's logits (r->logits). */
    int *feed = calloc((size_t)ref->n_tokens, sizeof *feed);
    float *gr = malloc((size_t)V * sizeof *gr), *gd = malloc((size_t)V * sizeof *gd);
    int rc = AR_OK, at = 0;
    if (!feed || !gr || !gd) {
        rc = ar_errorf(err, "out of memory");
        goto out;
    }
    ref->forced = dut->forced = feed;
    while (!gen_request_done(ref) && out->diverged_at < 0) {
        const int t = ref->step, n = model_step_tokens(c, t);
        gen_request_t *br[] = {ref}, *bd[] = {dut};
        if (gen_step(br, 1, err) != AR_OK || gen_step(bd, 1, err) != AR_OK) {
            rc = AR_ERR;
            break;
        }
        const float w = lockstep_guidance(ref, t);
        /* The step's rows: n conditional, then n unconditional. */
        for (int i = 0; i < n; i++) {
            const size_t cond = (size_t)i * V, uncond = (size_t)(n + i) * V;
            sampler_cfg_combine(gr, ref->logits + cond, ref->logits + uncond, V, w);
            sampler_cfg_combine(gd, dut->logits + cond, dut->logits + uncond, V, w);
            for (int j = 0; j < V; j++) {
                const double d = fabs((double)gr[j] - gd[j]);
                out->largest = fmax(out->largest, fabs(gr[j]));
                out->worst_logit = isnan(d) ? INFINITY : fmax(out->worst_logit, d);
            }
            double mr, md;
            const int tr = lockstep_greedy(gr, V, &mr), td = lockstep_greedy(gd, V, &md);
            out->narrowest = fmin(out->narrowest, mr);
            const lockstep_verdict_t v = lockstep_judge(tr, td, mr, tol);
            if (v == LOCKSTEP_TIE) {
                out->ties++;
                out->widest_tie = fmax(out->widest_tie, mr);
                if (name)
                    fprintf(stderr,
                            "        %s: a tie at token %d: %d, the other backend %d, margin %.3g "
                            "under %.3g; %d fed to both\n",
                            name, at + i, tr, td, mr, tol, tr);
            } else if (v == LOCKSTEP_DIVERGED && out->diverged_at < 0) {
                out->diverged_at = at + i;
                out->ref_token = tr;
                out->dut_token = td;
                out->margin = mr;
            }
            ref->tokens[at + i] = dut->tokens[at + i] = tr;
        }
        at += n;
        out->tokens = at;
    }
out:
    ref->forced = dut->forced = NULL;
    free(feed);
    free(gr);
    free(gd);
    return rc;
}

/* Runs `alone` (started as the lockstep's reference was, on the reference
 * backend) on its own and returns its first token that is not tokens[i],
 * -1 when all are: the lockstep's reference tokens are the engine's own
 * greedy choices only if lockstep_greedy and lockstep_guidance pick as
 * the sampler does. -2 (err set) when a step fails. */
static int lockstep_ref_alone(gen_request_t *alone, const int *tokens, ar_error_t *err) {
    gen_request_t *b[] = {alone};
    while (!gen_request_done(alone))
        if (gen_step(b, 1, err) != AR_OK)
            return -2;
    for (int i = 0; i < alone->n_tokens; i++)
        if (alone->tokens[i] != tokens[i])
            return i;
    return -1;
}

#endif
